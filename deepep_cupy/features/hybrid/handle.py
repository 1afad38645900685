"""`HybridHandle`: what a hybrid dispatch leaves for its combine and for cached dispatches: the intranode engine's
`EPHandle` (over the forwarder's union input) plus the rail state of this rank."""

from typing import Any, List, Optional

from .plan import translate_src_index


class HybridHandle:
    """A dispatch across several scale-up domains.

    Public fields (DeepEP V2 names; the rest are read from the intranode handle `inner`):
        do_expand, expert_alignment, num_sms, num_recv_tokens, num_expanded_tokens, num_recv_tokens_per_expert_list,
            psum_num_recv_tokens_per_expert, num_unaligned_recv_tokens_per_expert: the intranode handle's (the rows
            of a rank are exactly the intranode dispatch's rows).
        psum_num_recv_tokens_per_scaleup_rank: `[R]` int32, inclusive: group r = rows forwarded by local rank r =
            every source (*, r), in source domain then token order (DeepEP V2's hybrid order).
        num_experts, num_max_tokens_per_rank, topk_idx: the user's (global experts, M of the call, `[T, K]`).
        recv_src_metadata: column 0 translated to `src_rank * M + token` (a copy made on first access); after a
            `deterministic=True` dispatch (R > 1) the sorted copy made with it (rows in DeepEP's order, expanded rows
            in columns 2.. after the sort: deterministic.py).
        token_metadata_at_forward: `[N, M, 1 + K]` int32 made on first access: per source domain and rail position
            (own domain: position among this rank's tokens with an expert here) the source token and the K expert
            ids of THIS domain (-1 elsewhere).
        dst_buffer_slot_idx: `[T, N]` int32, the slot of each of this rank's tokens in each destination domain's rail
            region (its position among the tokens going to that domain), -1 where the token has no expert there. DeepEP
            keeps a 4-D slot tensor of its own kernels' layout; ours is the composed path's, equal across a dispatch
            and the cached dispatches made from its handle.
        channel_linked_list: None (the composed path keeps no channel lists).
    Rail state: domain_pos `[T, N]` int32, fwd_src `[N * M]`, fwd_count `[N]` (device), send_counts / recv_counts
    (host lists after a CPU sync, else None). sorted_rows: the `deterministic.SortedRows` of a deterministic dispatch
    (its rows are in DeepEP's order, the intranode handle's are not: combine moves its input back), else None.
    """

    channel_linked_list = None

    def __init__(self, inner, topk_idx: Any, num_experts: int, num_max_tokens_per_rank: int, num_domains: int,
                 num_scaleup_ranks: int, domain: int, domain_pos: Any, fwd_src: Any, fwd_count: Any,
                 send_counts: Optional[List[int]], recv_counts: Optional[List[int]], union_topk: Any, keep: tuple,
                 buffer_id: int, sorted_rows: Any = None):
        self.inner = inner
        self.topk_idx = topk_idx
        self.num_experts = num_experts
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_domains, self.num_scaleup_ranks, self.domain = num_domains, num_scaleup_ranks, domain
        self.domain_pos, self.fwd_src, self.fwd_count = domain_pos, fwd_src, fwd_count
        self.send_counts, self.recv_counts = send_counts, recv_counts
        self.union_topk = union_topk
        self.keep = keep                # the union input and other arrays the intranode calls read
        self.buffer_id = buffer_id
        self.sorted_rows = sorted_rows
        self._meta = self._tmaf = None

    @property
    def num_tokens(self) -> int:
        return int(self.topk_idx.shape[0])

    def __getattr__(self, name: str):
        if name.startswith('_') or name == 'inner':
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def dst_buffer_slot_idx(self):
        return self.domain_pos

    @property
    def recv_src_metadata(self):
        if self.sorted_rows is not None:
            return self.sorted_rows.meta
        if self._meta is None:
            inner = self.inner.recv_src_metadata
            meta = inner.clone() if hasattr(inner, 'clone') else inner.copy()
            col = inner[:, 0].long() if hasattr(inner, 'long') else inner[:, 0].astype('int64')
            out = translate_src_index(col, self.num_domains, self.num_scaleup_ranks, self.num_max_tokens_per_rank)
            meta[:, 0] = out.int() if hasattr(out, 'int') else out.astype('int32')
            self._meta = meta
        return self._meta

    @property
    def token_metadata_at_forward(self):
        if self._tmaf is None:
            self._tmaf = _token_metadata_at_forward(self)
        return self._tmaf


def _token_metadata_at_forward(h: HybridHandle):
    """`[N, M, 1 + K]` int32 from the rail state (a host round trip; for inspection, not for the hot path)."""
    import numpy as np
    N, M, n = h.num_domains, h.num_max_tokens_per_rank, h.domain
    host = (lambda a: a.cpu().numpy()) if hasattr(h.union_topk, 'cpu') else (lambda a: a.get())
    union = host(h.union_topk).reshape(N, M, -1)
    K = union.shape[2]
    epd = h.num_experts // N
    fwd_src, fwd_count, pos = host(h.fwd_src).reshape(N, M), host(h.fwd_count), host(h.domain_pos)
    out = np.full((N, M, 1 + K), -1, dtype=np.int32)
    for s in range(N):
        if s == n:
            tokens = np.nonzero(pos[:h.num_tokens, n] >= 0)[0] if h.num_tokens else np.zeros(0, dtype=np.int64)
        else:
            tokens = fwd_src[s, :min(max(int(fwd_count[s]), 0), M)]
            tokens = tokens[(tokens >= 0) & (tokens < M)]
        out[s, :tokens.size, 0] = tokens
        ids = union[s, tokens]
        out[s, :tokens.size, 1:] = np.where(ids >= 0, ids + n * epd, -1)
    if hasattr(h.union_topk, 'cpu'):
        import torch
        return torch.from_numpy(out).to(h.union_topk.device)
    import cupy
    return cupy.asarray(out)
