"""Host reference of DeepEP V1's internode contract (the handle and the receive order of a dispatch across scale-up
domains, v1/kernels/internode.py) and host mirrors of the handle kernels (kernels_cu/legacy_internode.cu): the
same steps on numpy arrays. Pure: no GPU needed (tests/test_legacy_internode_cpu.py; the GPU rank program
deepep_cupy/tests/legacy_internode.py checks the GPU's handle against `reference_internode`, bit for bit)."""

from typing import List, NamedTuple, Sequence

import numpy as np


# ---- host reference ------------------------------------------------------------------------------------------------
def ranks_of(topk_idx: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """`[N, R]` bool is_token_in_rank of `topk_idx` `[N, K]` (ids outside [0, E) choose nothing)."""
    topk_idx = np.asarray(topk_idx, dtype=np.int64)
    out = np.zeros((topk_idx.shape[0], num_ranks), dtype=bool)
    per_rank = num_experts // num_ranks
    rows, cols = np.nonzero((topk_idx >= 0) & (topk_idx < num_experts))
    out[rows, topk_idx[rows, cols] // per_rank] = True
    return out


def domain_counts(is_token_in_rank: np.ndarray, num_domains: int) -> np.ndarray:
    """`[D]` int32 num_tokens_per_rdma_rank: tokens with >= 1 destination rank in each domain."""
    n, r = is_token_in_rank.shape
    return is_token_in_rank.reshape(n, num_domains, r // num_domains).any(2).sum(0).astype(np.int32)


def channel_of(num_tokens: int, num_channels: int) -> np.ndarray:
    """`[N]` V1's channel of each token: contiguous ranges of `ceil(N / C)` tokens."""
    per = max(1, -(-num_tokens // num_channels))
    return np.arange(num_tokens) // per


def _channel_prefix(sent: np.ndarray, channels: np.ndarray, num_channels: int) -> np.ndarray:
    """`[X, C]` int32 inclusive prefix over channels of the tokens sent to each of X targets (`sent` `[N, X]`)."""
    out = np.zeros((sent.shape[1], num_channels), dtype=np.int64)
    for c in range(num_channels):
        out[:, c] = sent[channels == c].sum(0)
    return np.cumsum(out, 1).astype(np.int32)


def _slots(sent: np.ndarray) -> np.ndarray:
    """`[N, X]` int32: a token's position among the tokens sent to target x, -1 where not sent."""
    return np.where(sent, np.cumsum(sent, 0) - 1, -1).astype(np.int32)


class InternodeHandleRef(NamedTuple):
    """V1's internode handle of one rank (field order = V1's tuple order), plus `recv_src` `[rows, 2]` (source rank,
    source token) of every received row and `num_tokens_per_rdma_rank`."""
    is_token_in_rank: np.ndarray
    rdma_channel_prefix_matrix: np.ndarray
    gbl_channel_prefix_matrix: np.ndarray
    recv_rdma_channel_prefix_matrix: np.ndarray
    recv_rdma_rank_prefix_sum: np.ndarray
    recv_gbl_channel_prefix_matrix: np.ndarray
    recv_gbl_rank_prefix_sum: np.ndarray
    recv_src_meta: np.ndarray
    send_rdma_head: np.ndarray
    send_nvl_head: np.ndarray
    recv_src: np.ndarray
    num_tokens_per_rdma_rank: np.ndarray

    def v1_tuple(self) -> tuple:
        return tuple(self[:10])


def reference_internode(topk_idx: Sequence[np.ndarray], num_experts: int, num_domains: int,
                        num_channels: int) -> List[InternodeHandleRef]:
    """Every rank's V1 internode handle and receive order for a dispatch where rank g holds `topk_idx[g]` `[N_g, K]`
    (see the module docstring for each field)."""
    R, D, C = len(topk_idx), num_domains, num_channels
    S = R // D
    in_rank = [ranks_of(t, num_experts, R) for t in topk_idx]
    in_domain = [m.reshape(m.shape[0], D, S).any(2) for m in in_rank]
    chan = [channel_of(m.shape[0], C) for m in in_rank]
    out = []
    for g in range(R):
        d, local = divmod(g, S)
        # Receive side of the rail hop: this rank forwards the tokens of rail peers (s, l) with an expert in domain d.
        fwd_rows = []           # (source domain, source token) in source domain then token order
        recv_rdma_chan = np.zeros((D, C), dtype=np.int32)
        for s in range(D):
            peer = s * S + local
            sent = in_domain[peer][:, d]
            recv_rdma_chan[s] = _channel_prefix(sent[:, None], chan[peer], C)[0]
            fwd_rows += [(s, int(t)) for t in np.nonzero(sent)[0]]
        recv_rdma_sum = np.cumsum(recv_rdma_chan[:, -1]).astype(np.int32)
        nvl_sent = np.zeros((len(fwd_rows), S), dtype=bool)
        for i, (s, t) in enumerate(fwd_rows):
            nvl_sent[i] = in_rank[s * S + local][t, d * S:(d + 1) * S]
        send_nvl_head = _slots(nvl_sent)
        # Receive side at this rank: rows by source rank, then token order.
        counts = np.array([int(in_rank[src][:, g].sum()) for src in range(R)], dtype=np.int64)
        recv_gbl_sum = np.cumsum(counts).astype(np.int32)
        starts = recv_gbl_sum - counts
        recv_gbl_chan = np.zeros((R, C), dtype=np.int32)
        recv_src, meta = [], []
        for src in range(R):
            sent = in_rank[src][:, g]
            incl = _channel_prefix(sent[:, None], chan[src], C)[0]
            recv_gbl_chan[src] = starts[src] + incl - np.bincount(chan[src][sent], minlength=C)[:C]
            s_dom = src // S
            for t in np.nonzero(sent)[0]:
                recv_src.append((src, int(t)))
                bits = in_rank[src][t, d * S:(d + 1) * S]
                meta.append((s_dom, int(sum(1 << i for i in range(S) if bits[i]))))
        meta_bytes = np.array(meta, dtype='<i4').reshape(-1, 2).view(np.uint8).reshape(-1, 8)
        out.append(InternodeHandleRef(
            in_rank[g], _channel_prefix(in_domain[g], chan[g], C), _channel_prefix(in_rank[g], chan[g], C),
            recv_rdma_chan, recv_rdma_sum, recv_gbl_chan, recv_gbl_sum, meta_bytes, _slots(in_domain[g]),
            send_nvl_head, np.array(recv_src, dtype=np.int64).reshape(-1, 2), domain_counts(in_rank[g], D)))
    return out


# ---- host mirrors of the handle kernels (CPU tests: the same steps on numpy arrays) ---------------------------------
def channel_width(num_tokens: int, num_channels: int) -> int:
    return max(1, -(-num_tokens // num_channels))


def mirror_forward(topk_idx: np.ndarray, num_experts: int, num_domains: int, num_scaleup: int, domain: int,
                   rank: int, fwd_src: np.ndarray, fwd_count: np.ndarray, union_topk: np.ndarray,
                   num_max_tokens: int, num_channels: int, rail_counts: Sequence[int], num_nvl_rows: int):
    """`legacy_internode_forward` on the host. `rail_counts[s]`: the count in rail header s (ignored at s = domain).
    Returns `(rdma [N, C], gbl [R, C], recv_rdma [N, C], recv_rdma_sum [N], send_nvl_head [rows, S],
    slot_counts [N], slot_masks: {receiver: {union row: mask}})`."""
    N, S, C, M = num_domains, num_scaleup, num_channels, num_max_tokens
    R, T = N * S, topk_idx.shape[0]
    epr = num_experts // R
    width = channel_width(T, C)
    gbl = np.zeros((R, C), dtype=np.int32)
    rdma = np.zeros((N, C), dtype=np.int32)
    run = np.zeros(R + N, dtype=np.int64)
    for c in range(C):
        cnt = np.zeros(R + N, dtype=np.int64)
        for t in range(c * width, min(T, (c + 1) * width)):
            ranks = {int(e) // epr for e in topk_idx[t] if 0 <= e < num_experts}
            for r in ranks:
                cnt[r] += 1
            for m in {r // S for r in ranks}:
                cnt[R + m] += 1
        run += cnt
        gbl[:, c], rdma[:, c] = run[:R], run[R:]
    recv_rdma = np.zeros((N, C), dtype=np.int32)
    counts = []
    for s in range(N):
        if s == domain:
            recv_rdma[s] = rdma[domain]
            counts.append(int(run[R + domain]))
            continue
        count = min(max(int(fwd_count[s]), 0), M)
        counts.append(count)
        w = channel_width(int(rail_counts[s]), C)
        src = fwd_src[s * M:s * M + count]
        for c in range(C):
            recv_rdma[s, c] = int((src < (c + 1) * w).sum())
    recv_rdma_sum = np.cumsum(counts).astype(np.int32)
    send_nvl_head = np.full((num_nvl_rows, S), -1, dtype=np.int32)
    masks = {r: {} for r in range(S)}
    row, slots = 0, [0] * S
    for u in range(N * M):
        mask = 0
        for e in union_topk[u]:
            if 0 <= e < S * epr:
                mask |= 1 << (int(e) // epr)
        if not mask:
            continue
        for r in range(S):
            if (mask >> r) & 1:
                if row < num_nvl_rows:
                    send_nvl_head[row, r] = slots[r]
                slots[r] += 1
                masks[r][u] = mask
        row += 1
    slot_counts = np.array([T if s == domain else int(rail_counts[s]) for s in range(N)], dtype=np.int64)
    return rdma, gbl, recv_rdma, recv_rdma_sum, send_nvl_head, slot_counts, masks


def mirror_receive(keys: np.ndarray, num_recv: int, num_rows: int, num_domains: int, num_scaleup: int,
                   num_max_tokens: int, num_channels: int, slot_counts: Sequence[np.ndarray], slot_masks):
    """`legacy_internode_receive` on the host. `keys` `[rows]`: the rows' global source index (ascending);
    `slot_counts[j]` / `slot_masks[j]` (`{union row: mask}`): what local forwarder j wrote into this rank's slot.
    Returns `(recv_gbl_rank_prefix_sum [R], recv_gbl_channel_prefix_matrix [R, C], recv_src_meta [rows, 8] uint8)`."""
    N, S, M, C = num_domains, num_scaleup, num_max_tokens, num_channels
    R = N * S
    n = min(max(num_recv, 0), num_rows)
    k = np.asarray(keys[:n], dtype=np.int64)
    psum = np.array([int((k < (src + 1) * M).sum()) for src in range(R)], dtype=np.int32)
    chan = np.zeros((R, C), dtype=np.int32)
    for src in range(R):
        w = channel_width(int(slot_counts[src % S][src // S]), C)
        for c in range(C):
            chan[src, c] = int((k < src * M + min(c * w, M)).sum())
    meta = np.zeros((num_rows, 2), dtype='<i4')
    meta[:, 0] = -1
    for i in range(n):
        src, t = divmod(int(k[i]), M)
        s, j = divmod(src, S)
        meta[i] = (s, slot_masks[j][s * M + t])
    return psum, chan, meta.view(np.uint8).reshape(num_rows, 8)
