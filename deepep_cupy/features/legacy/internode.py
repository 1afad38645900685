"""DeepEP V1's internode normal mode (several scale-up domains) on the hybrid EP engine (`features/hybrid`): the
design, the construction check, and a host reference of V1's internode contract. Pure: no GPU needed
(tests/test_legacy_internode_cpu.py).

Status: `get_dispatch_layout` (with `num_tokens_per_rdma_rank`) runs on the GPU (features/legacy/layout.py); the
adapter of `dispatch` / `combine` described below is not built yet: those calls raise `NotImplementedError`
(`internode_missing`) before any kernel, and low-latency mode across domains is refused at construction
(`check_domains`). `reference_internode` is the specification the adapter will be checked against, bit for bit.

Ranks and domains. R ranks form D = R / S scale-up domains of S ranks; rank `g = d * S + l` is local rank l of domain
d (V1: `rdma_rank = g // 8`, `nvl_rank = g % 8`, with S = 8; here S is the topology's, so `NUM_MAX_NVL_PEERS`-wide
V1 tensors are S wide). Expert e lives on rank `e // (E / R)`; V1's "RDMA rank" is our domain, its RDMA peers (same
`nvl_rank`) are our rail peers.

V1's contract, as the adapter will serve it:

- `get_dispatch_layout` → `num_tokens_per_rdma_rank` `[D]` int32 on the GPU: tokens of this rank with >= 1 expert in
  domain d (a token counts once per domain). Kernel `get_dispatch_layout_domains` after the layout kernel.
- `dispatch(x, num_tokens_per_rdma_rank=..., ...)` maps onto one hybrid dispatch (`HybridEP.dispatch`) of the
  buffer's `deterministic=True` order, which is V1's receive order: rows grouped by global source rank ascending,
  within a source rank in token order (V1 writes each channel, a contiguous token range, at its prefix offset). The
  hybrid path's M (tokens per rank) follows V1's normal-mode sizing and growth rule (`legacy_normal.py`): M from
  `num_nvl_bytes` / `num_rdma_bytes`, a rank with more tokens reports its count and every rank grows and redoes;
  the count has to ride on the hybrid notify exchange (the rail header) and the intranode one, which is the missing
  engine piece. `recv_topk_idx` / weights, `num_recv_tokens_per_expert_list` with `expert_alignment` and
  `num_worst_tokens` are the hybrid dispatch's outputs (local expert ids, -1 and weight 0 elsewhere).
- The handle, V1's 10-tuple in V1's order (C = `config.num_sms // 2` channels, channel c = tokens
  `[c * ceil(N / C), (c + 1) * ceil(N / C))` of the sender):
   0 `is_token_in_rank` `[N, R]` bool: the dispatch's argument.
   1 `rdma_channel_prefix_matrix` `[D, C]` int32: per destination domain, inclusive prefix over channels of this
     rank's tokens sent there (a token once per domain).
   2 `gbl_channel_prefix_matrix` `[R, C]` int32: the same per destination rank.
   3 `recv_rdma_channel_prefix_matrix` `[D, C]` int32: at this rank as forwarder, per source domain s (the rail peer
     (s, l)), inclusive prefix over the peer's channels of its tokens with an expert in this domain.
   4 `recv_rdma_rank_prefix_sum` `[D]` int32: inclusive prefix over source domains of those forwarded token counts.
   5 `recv_gbl_channel_prefix_matrix` `[R, C]` int32: per source rank, the absolute row where its channel c starts.
   6 `recv_gbl_rank_prefix_sum` `[R]` int32: inclusive prefix over source ranks of the rows received (V1 tests read
     it as `handle[-4]`).
   7 `recv_src_meta` `[rows, 8]` uint8: per row, int32 source domain then int32 bitmask of the local ranks of this
     domain the token goes to (V1's `SourceMeta`, little-endian).
   8 `send_rdma_head` `[N, D]` int32: the token's slot among this rank's tokens going to domain d (V1: its RDMA ring
     position), -1 if none of its experts is there. Equals the hybrid handle's `domain_pos`.
   9 `send_nvl_head` `[num_rdma_recv_tokens, S]` int32: per token this rank forwarded (source domain, then token
     order: the rows of item 4) and local rank l, its slot among the forwarded tokens going to l (V1: NVL ring
     position), -1 if not sent there. `send_nvl_head.shape[0]` is V1's `num_rdma_recv_tokens`.
  Positions stand where V1 has ring positions (the composed path has no rings); every element is filled, and code
  reading V1's fields (shapes, prefix sums, source domain, bitmask) sees V1's values. The handle object also keeps the
  `HybridHandle` for combine and cached dispatch.
- Cached dispatch (`handle` given) = a hybrid cached dispatch of the kept `HybridHandle`: same rows, same order.
- `combine(x, handle, topk_weights, bias)` = the hybrid combine with `reduce_in_scaleup=True`: FP32 in-domain sum at
  the forwarder, FP32 across domains plus 0-2 biases at the origin, one rounding; `combined_topk_weights` = the FP32
  sum over destination ranks of their row's weights (V1's definition, as intranode). V1 sums in a different order
  (NVL then RDMA); within one domain the order is the intranode adapter's.
- Events (`previous_event`, `async_finish`, `allocate_on_comm_stream`) as intranode (`legacy_normal.check_event_rule`).
"""

from typing import List, NamedTuple, Sequence

import numpy as np

LOW_LATENCY_ACROSS_DOMAINS = ('low-latency mode across scale-up domains (low_latency_dispatch / low_latency_combine '
                              'over NVLink inside a domain and rails between) is not implemented in deepep_cupy yet')


def check_domains(num_ranks: int, num_domains: int, num_scaleup_ranks: int, low_latency_mode: bool,
                  max_scaleup_ranks: int) -> None:
    """Refuse, at construction, what the topology cannot serve (yet): NotImplementedError naming it."""
    if num_domains <= 1:
        if num_ranks > max_scaleup_ranks:
            raise NotImplementedError(f'{num_ranks} ranks in one NVLink domain: DeepEP V1 runs at most '
                                      f'{max_scaleup_ranks} ranks per domain')
        return
    assert num_domains * num_scaleup_ranks == num_ranks, (num_domains, num_scaleup_ranks, num_ranks)
    if low_latency_mode:
        raise NotImplementedError(f'{num_ranks} ranks in {num_domains} scale-up domains of {num_scaleup_ranks}: '
                                  f'{LOW_LATENCY_ACROSS_DOMAINS}; build the Buffer with low_latency_mode=False '
                                  f'(normal mode) or run inside one domain')


def internode_missing(call: str, num_domains: int, num_scaleup_ranks: int) -> str:
    """The NotImplementedError message of a normal-mode call across domains the adapter does not serve yet."""
    return (f'{call} across {num_domains} scale-up domains of {num_scaleup_ranks} ranks: DeepEP V1\'s internode '
            f'{call} (the V1 handle over the hybrid engine: features/legacy/internode.py) is not implemented in '
            f'deepep_cupy yet; get_dispatch_layout works (num_tokens_per_rdma_rank), normal and low-latency mode run '
            f'inside one domain')


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
