"""Host reference of the FUSED hybrid dispatch (numpy, pure; its kernels are not written yet): every position, count
and row order those kernels must produce, for N domains x R ranks, derived the way the kernels will derive them and
checked while the tokens move. `hybrid_row_order` (the composed path's row order, which the shipped rank program
deepep_cupy/tests/ep_hybrid.py needs) lives in deepep_cupy/features/hybrid/plan.py.

Conventions (DeepEP V2's, with the world of W = N * R ranks): expert e lives on rank `e // L` (L = E / W local
experts), i.e. in domain `e // (R * L)`; rank g = n * R + r is domain n, scale-up index r; -1 in `topk_idx` is no
expert; experts are distinct within a token (the kernels count a token once per expert);
`src_token_global_idx = src_rank * M + src_token_idx`.

The protocol (features/hybrid/__init__.py has the whole design):

1. Origin notify (rank s = (n, r), per token t, all in ascending t): the destination ranks (a rank owning at least one
   of its experts) and domains; `send_pos[t][d]` = t's position among s's tokens going to rank d (its slot there);
   `domain_pos[t][m]` = t's position among s's tokens going to domain m (its rail position for m != n, its combine
   stage row at the forwarder for every m); `send_expert_pos[t][k]` = t's position among s's tokens choosing expert
   topk[t][k]; and per destination domain m a counts block `[R][1 + L]` (tokens to each rank of m, tokens to each of
   its experts).
2. Rail notify: s sends block m to its rail peer (m, r) (fixed size); the forwarder (m, r) hands row l of the block
   of every rail peer n (its own included) to its local rank (m, l), which then holds `[W regions][1 + L]` counts.
3. Dispatch: own-domain tokens go over NVLink straight into region (r, n) of each destination (n, l) at
   `send_pos`; a token for another domain m crosses rail r once (at `domain_pos[t][m]`, with its R forward slots
   `send_pos[t][m * R + l]`) and the forwarder (m, r) writes it into region (r, n) of each destination (m, l).
4. Receive (rank d = (m, l)): rows grouped by scale-up index r of the source (DeepEP's
   `psum_num_recv_tokens_per_scaleup_rank`, `[R]` inclusive), inside a group by source domain n, then source token
   index: the region order `r * N + n` (the composed path's intranode engine gives the same order). With
   `deterministic=True` DeepEP sorts ALL rows by `src_token_global_idx` in one sort (`EPHandle.deterministic_sort`,
   deep_ep/buffers/elastic.py; `deepep_deterministic_sort` below is its host version): (source rank, token), which
   is `refs.dispatch_from_gathered`'s order, not this one once R > 1 and N > 1; its counts and psums stay.
   `hybrid_row_order` maps the sorted order onto this one; features/hybrid/deterministic.py moves rows back.
5. Expanded layout: expert j's rows from `align(...)`-ed starts, in receive-row order; the kernels' row is
   `start[j] + src_base[region][j] + send_expert_pos` with `src_base` the exclusive prefix over regions (row order).
6. Metadata `[rows, K + 2]`: `src_token_global_idx`; `stage_row * K + stage_slot` where `stage_row = n * M +
   domain_pos[t][m]` at the forwarder (m, r) and `stage_slot` = this rank's ordinal among the token's destination
   ranks of domain m in order of first top-k appearance; per top-k slot the expanded row or -1.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from deepep_cupy.features.hybrid.plan import hybrid_row_order  # noqa: F401 (the shipped order; tests read it here)
from deepep_cupy.runtime.sizes import align


@dataclass(frozen=True)
class HybridShape:
    """The sizes of a hybrid job."""
    num_domains: int               # N
    num_scaleup_ranks: int         # R
    num_experts: int               # E
    num_max_tokens_per_rank: int   # M
    num_topk: int                  # K

    def __post_init__(self):
        if self.num_domains < 1 or self.num_scaleup_ranks < 1:
            raise ValueError(f'need at least 1 domain of 1 rank, got {self.num_domains} x {self.num_scaleup_ranks}')
        if self.num_experts < 1 or self.num_experts % self.num_ranks:
            raise ValueError(f'num_experts ({self.num_experts}) must be a positive multiple of the number of ranks '
                             f'({self.num_ranks})')
        if self.num_topk < 1 or self.num_max_tokens_per_rank < 1:
            raise ValueError('num_topk and num_max_tokens_per_rank must be positive')

    @property
    def num_ranks(self) -> int:
        return self.num_domains * self.num_scaleup_ranks

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    def domain_of(self, rank: int) -> int:
        return rank // self.num_scaleup_ranks

    def scaleup_idx_of(self, rank: int) -> int:
        return rank % self.num_scaleup_ranks

    def rank_of(self, domain: int, scaleup_idx: int) -> int:
        return domain * self.num_scaleup_ranks + scaleup_idx

    def region_of(self, src_rank: int) -> int:
        """Receive region of a source rank at any destination: `r * N + n` (row order)."""
        return self.scaleup_idx_of(src_rank) * self.num_domains + self.domain_of(src_rank)

    def rank_of_region(self, region: int) -> int:
        return self.rank_of(region % self.num_domains, region // self.num_domains)


def _exclusive_positions(mask: np.ndarray) -> np.ndarray:
    """Per column, each True row's position among the column's True rows (ascending row), -1 elsewhere."""
    pos = np.cumsum(mask, axis=0, dtype=np.int64) - 1
    return np.where(mask, pos, -1).astype(np.int32)


@dataclass
class Routing:
    """What the origin's notify computes for its tokens (all positions in ascending token order).

    Attributes:
        topk_idx: `[T, K]` int64, the global expert ids or -1.
        dst_rank: `[T, K]` int64, the rank owning each slot's expert, -1.
        send_pos: `[T, W]` int32, slot at each destination rank, -1 (DeepEP's `dst_buffer_slot_idx`).
        domain_pos: `[T, N]` int32, position among the tokens going to each domain, -1.
        send_expert_pos: `[T, K]` int32, position among the tokens choosing each slot's expert, -1.
        num_tokens_per_rank: `[W]`; num_tokens_per_domain: `[N]`; num_tokens_per_expert: `[E]` (int32).
        notify_blocks: `[N, R, 1 + L]` int32, the counts block for each destination domain.
    """
    topk_idx: np.ndarray
    dst_rank: np.ndarray
    send_pos: np.ndarray
    domain_pos: np.ndarray
    send_expert_pos: np.ndarray
    num_tokens_per_rank: np.ndarray
    num_tokens_per_domain: np.ndarray
    num_tokens_per_expert: np.ndarray
    notify_blocks: np.ndarray


def route(shape: HybridShape, topk_idx: np.ndarray) -> Routing:
    """The origin notify of one rank (step 1 of the module docstring)."""
    topk_idx = np.asarray(topk_idx, dtype=np.int64)
    K, E, W, N, L, R = (shape.num_topk, shape.num_experts, shape.num_ranks, shape.num_domains,
                        shape.num_local_experts, shape.num_scaleup_ranks)
    if topk_idx.ndim != 2 or topk_idx.shape[1] != K or topk_idx.shape[0] > shape.num_max_tokens_per_rank:
        raise ValueError(f'topk_idx must be [T <= {shape.num_max_tokens_per_rank}, {K}], got {topk_idx.shape}')
    if topk_idx.size and (topk_idx.min() < -1 or topk_idx.max() >= E):
        raise ValueError(f'topk_idx values must be in [-1, {E})')
    T = topk_idx.shape[0]
    valid = topk_idx >= 0
    chooses = np.zeros((T, E), dtype=bool)
    rows, slots = valid.nonzero()
    chooses[rows, topk_idx[rows, slots]] = True
    if chooses.sum() != valid.sum():
        raise ValueError('topk_idx: a token names the same expert twice (the kernels count a token once per expert)')
    dst_rank = np.where(valid, topk_idx // L, -1)
    rank_mask = np.zeros((T, W), dtype=bool)
    rank_mask[rows, dst_rank[rows, slots]] = True
    domain_mask = rank_mask.reshape(T, N, R).any(axis=2)
    expert_pos = _exclusive_positions(chooses)
    send_expert_pos = np.full((T, K), -1, dtype=np.int32)
    send_expert_pos[rows, slots] = expert_pos[rows, topk_idx[rows, slots]]
    per_rank = rank_mask.sum(axis=0).astype(np.int32)
    per_expert = chooses.sum(axis=0).astype(np.int32)
    blocks = np.concatenate([per_rank.reshape(N, R, 1), per_expert.reshape(N, R, L)], axis=2).astype(np.int32)
    return Routing(topk_idx, dst_rank, _exclusive_positions(rank_mask), _exclusive_positions(domain_mask),
                   send_expert_pos, per_rank, domain_mask.sum(axis=0).astype(np.int32), per_expert, blocks)


def rank_ordinals(dst_rank_row: np.ndarray) -> Dict[int, Tuple[int, int]]:
    """For one token's `[K]` owner ranks: rank -> (ordinal by first top-k appearance among all its ranks, last k)."""
    out: Dict[int, Tuple[int, int]] = {}
    for k, d in enumerate(dst_rank_row.tolist()):
        if d >= 0:
            out[d] = (out[d][0], k) if d in out else (len(out), k)
    return out


def stage_slot_of(shape: HybridShape, dst_rank_row: np.ndarray, rank: int) -> int:
    """`rank`'s ordinal among the token's destination ranks of its own domain, by first top-k appearance (the
    combine stage slot at the forwarder with multiple reduction)."""
    m = shape.domain_of(rank)
    in_domain = [d for d in rank_ordinals(dst_rank_row) if shape.domain_of(d) == m]
    return in_domain.index(rank)


@dataclass
class RailMessage:
    """One token on a rail, origin (n, r) → forwarder (m, r), at rail position `domain_pos[t][m]`."""
    src_token_idx: int
    forward_slots: np.ndarray          # [R] int32: slot at each rank (m, l), -1: not forwarded there


@dataclass
class ReceiveLayout:
    """The receive layout of rank (m, l), derived from its `[W regions][1 + L]` notify counts only (as the kernel).

    Attributes:
        num_recv_per_region: `[W]`, rows from each region (`r * N + n`).
        psum_num_recv_tokens_per_scaleup_rank: `[R]` int32, inclusive prefix over scale-up groups.
        region_begin: `[W]`, first row of each region.
        num_recv_tokens: rows received.
        num_unaligned_recv_tokens_per_expert: `[L]` int32.
        src_base: `[W, L]` int32, exclusive prefix over regions of each expert's pairs.
        expert_start: `[L]` int64, aligned first expanded row of each expert.
        num_recv_tokens_per_expert_list: aligned counts (Python ints).
        psum_num_recv_tokens_per_expert: `[L]` int32 (`do_expand`'s convention when asked).
        num_expanded_tokens: expanded rows (sum of aligned counts).
    """
    num_recv_per_region: np.ndarray
    psum_num_recv_tokens_per_scaleup_rank: np.ndarray
    region_begin: np.ndarray
    num_recv_tokens: int
    num_unaligned_recv_tokens_per_expert: np.ndarray
    src_base: np.ndarray
    expert_start: np.ndarray
    num_recv_tokens_per_expert_list: List[int]
    psum_num_recv_tokens_per_expert: np.ndarray
    num_expanded_tokens: int


def receive_layout(shape: HybridShape, counts: np.ndarray, expert_alignment: int = 1,
                   do_expand: bool = False) -> ReceiveLayout:
    """The receive layout from one rank's notify counts `[W regions][1 + L]` (step 4/5 of the module docstring)."""
    N, R = shape.num_domains, shape.num_scaleup_ranks
    per_region = counts[:, 0].astype(np.int64)
    psum = np.cumsum(per_region.reshape(R, N).sum(axis=1)).astype(np.int32)
    region_begin = np.cumsum(per_region) - per_region
    per_expert_region = counts[:, 1:].astype(np.int64)
    src_base = (np.cumsum(per_expert_region, axis=0) - per_expert_region).astype(np.int32)
    count = per_expert_region.sum(axis=0)
    aligned = np.array([align(int(c), expert_alignment) for c in count], dtype=np.int64)
    start = np.cumsum(aligned) - aligned
    psum_expert = (start + count) if do_expand else np.cumsum(aligned)
    return ReceiveLayout(per_region, psum, region_begin, int(per_region.sum()), count.astype(np.int32), src_base,
                         start, [int(a) for a in aligned], psum_expert.astype(np.int32), int(aligned.sum()))


@dataclass
class RankReceive:
    """What rank (m, l) holds after a dispatch, rows in hybrid order.

    Attributes:
        layout: `ReceiveLayout`.
        recv_src_rank, recv_src_token_idx: `[rows]` int64, where each row comes from.
        recv_topk_idx: `[rows, K]` int64, local expert id or -1.
        recv_src_metadata: `[rows, K + 2]` int32 (module docstring, step 6; expanded rows only with `do_expand`).
        expanded_row_src, expanded_row_slot: `[num_expanded]` int64, the receive row and top-k slot of each expanded
            row (-1 in alignment gaps), when `do_expand`.
    """
    layout: ReceiveLayout
    recv_src_rank: np.ndarray
    recv_src_token_idx: np.ndarray
    recv_topk_idx: np.ndarray
    recv_src_metadata: np.ndarray
    expanded_row_src: Optional[np.ndarray] = None
    expanded_row_slot: Optional[np.ndarray] = None


@dataclass
class HybridDispatch:
    """The whole dispatch of a job.

    Attributes:
        shape: the sizes.
        routings: per origin rank, its `Routing`.
        rails: `(src_rank, forwarder_rank)` -> the `RailMessage`s in rail order (remote domains only).
        token_metadata_at_forward: per rank f = (m, r), `[N, M, 1 + K]` int32: per combine stage row (n, p) the
            source token index at (n, r) (-1: empty) and its K global expert ids (all rows, its own domain's too).
        recv: per rank, its `RankReceive`.
        notify_counts: per rank, the `[W, 1 + L]` counts it holds after the rail notify.
    """
    shape: HybridShape
    routings: List[Routing]
    rails: Dict[Tuple[int, int], List[RailMessage]]
    token_metadata_at_forward: List[np.ndarray]
    recv: List[RankReceive]
    notify_counts: List[np.ndarray]


def dispatch(shape: HybridShape, topk_idxs: Sequence[np.ndarray], expert_alignment: int = 1,
             do_expand: bool = False) -> HybridDispatch:
    """Run the hybrid dispatch protocol on the host (index level: which token lands in which slot of which rank),
    checking on the way that no slot is written twice and every region is filled densely.

    Args:
        shape: the sizes.
        topk_idxs: per rank `[T_g, K]` global expert ids or -1 (T_g may be 0).
        expert_alignment: A (expanded layout, aligned counts).
        do_expand: build the expanded layout and metadata columns 2..K+1.
    """
    N, R, W, M, K, L = (shape.num_domains, shape.num_scaleup_ranks, shape.num_ranks, shape.num_max_tokens_per_rank,
                        shape.num_topk, shape.num_local_experts)
    if len(topk_idxs) != W:
        raise ValueError(f'topk_idxs must hold one array per rank ({W}), got {len(topk_idxs)}')
    routings = [route(shape, t) for t in topk_idxs]

    # Step 2: rail notify, then the forwarder hands row l of every block to rank (m, l).
    counts = [np.zeros((W, 1 + L), dtype=np.int32) for _ in range(W)]
    for f in range(W):
        m, r = shape.domain_of(f), shape.scaleup_idx_of(f)
        for n in range(N):
            block = routings[shape.rank_of(n, r)].notify_blocks[m]     # over the rail unless n == m
            for lo in range(R):
                counts[shape.rank_of(m, lo)][r * N + n] = block[lo]

    # Step 3: the tokens move. slots[d][region] = [(src_token_idx)] * count, filled by exactly one writer each.
    slots = [[np.full(int(counts[d][g, 0]), -1, dtype=np.int64) for g in range(W)] for d in range(W)]

    def land(d: int, src: int, slot: int, t: int):
        region = slots[d][shape.region_of(src)]
        if not 0 <= slot < region.size or region[slot] != -1:
            raise AssertionError(f'slot {slot} of region {shape.region_of(src)} at rank {d} is out of range or taken')
        region[slot] = t

    rails: Dict[Tuple[int, int], List[RailMessage]] = {}
    meta_at_forward = [np.full((N, M, 1 + K), -1, dtype=np.int32) for _ in range(W)]
    for s, rt in enumerate(routings):
        n, r = shape.domain_of(s), shape.scaleup_idx_of(s)
        for m in range(N):
            f = shape.rank_of(m, r)
            tokens = np.nonzero(rt.domain_pos[:, m] >= 0)[0]
            assert np.array_equal(rt.domain_pos[tokens, m], np.arange(tokens.size)), 'domain positions not dense'
            meta_at_forward[f][n, :tokens.size, 0] = tokens
            meta_at_forward[f][n, :tokens.size, 1:] = rt.topk_idx[tokens]
            messages = [RailMessage(int(t), rt.send_pos[t, m * R:(m + 1) * R].copy()) for t in tokens]
            if m != n:
                rails[(s, f)] = messages          # the forwarder f reads them in rail order and forwards
            for msg in messages:                  # (own domain: the origin writes the same slots directly)
                for lo, slot in enumerate(msg.forward_slots.tolist()):
                    if slot >= 0:
                        land(shape.rank_of(m, lo), s, slot, msg.src_token_idx)
    for d in range(W):
        for g in range(W):
            assert (slots[d][g] >= 0).all(), f'region {g} at rank {d} has holes'

    recv = [_receive(shape, d, counts[d], slots[d], routings, expert_alignment, do_expand) for d in range(W)]
    return HybridDispatch(shape, routings, rails, meta_at_forward, recv, counts)


def _receive(shape: HybridShape, d: int, counts: np.ndarray, slots: List[np.ndarray], routings: List[Routing],
             expert_alignment: int, do_expand: bool) -> RankReceive:
    """The epilogue of rank d: regions in row order, then the top-k remap, metadata and expanded layout."""
    M, K, L = shape.num_max_tokens_per_rank, shape.num_topk, shape.num_local_experts
    m = shape.domain_of(d)
    lay = receive_layout(shape, counts, expert_alignment, do_expand)
    src_rank = np.concatenate([np.full(slots[g].size, shape.rank_of_region(g), dtype=np.int64)
                               for g in range(shape.num_ranks)])
    src_token = np.concatenate(slots).astype(np.int64)
    rows = src_rank.size
    assert rows == lay.num_recv_tokens
    topk = np.zeros((rows, K), dtype=np.int64)
    meta = np.full((rows, K + 2), -1, dtype=np.int32)
    local_topk = np.full((rows, K), -1, dtype=np.int64)
    for i in range(rows):
        rt, t = routings[src_rank[i]], src_token[i]
        topk[i] = rt.topk_idx[t]
        local_topk[i] = np.where(rt.dst_rank[t] == d, rt.topk_idx[t] - d * L, -1)
        stage_row = shape.domain_of(int(src_rank[i])) * M + int(rt.domain_pos[t, m])
        meta[i, 0] = src_rank[i] * M + t
        meta[i, 1] = stage_row * K + stage_slot_of(shape, rt.dst_rank[t], d)
    out = RankReceive(lay, src_rank, src_token, local_topk, meta)
    if do_expand:
        row_src = np.full(lay.num_expanded_tokens, -1, dtype=np.int64)
        row_slot = np.full(lay.num_expanded_tokens, -1, dtype=np.int64)
        for i in range(rows):
            region = shape.region_of(int(src_rank[i]))
            for k in np.nonzero(local_topk[i] >= 0)[0]:
                j = int(local_topk[i, k])
                pos = int(routings[src_rank[i]].send_expert_pos[src_token[i], k])
                row = int(lay.expert_start[j] + lay.src_base[region, j] + pos)
                assert row_src[row] == -1, f'expanded row {row} at rank {d} written twice'
                row_src[row], row_slot[row] = i, k
                meta[i, 2 + k] = row
        out.expanded_row_src, out.expanded_row_slot = row_src, row_slot
    return out


def worst_case_rows(shape: HybridShape, expert_alignment: int = 1) -> Tuple[int, int]:
    """`(non-expanded rows, expanded rows)` of a dispatch without a CPU sync (DeepEP: `W * M`, and
    `W * M * min(K, L) + (A - 1) * L` rounded up to A)."""
    W, M, K, L = shape.num_ranks, shape.num_max_tokens_per_rank, shape.num_topk, shape.num_local_experts
    return W * M, align(W * M * min(K, L) + (expert_alignment - 1) * L, expert_alignment)


@dataclass
class DeterministicSort:
    """DeepEP's `deterministic=True` epilogue on one rank's rows (`deepep_deterministic_sort`).

    Attributes:
        row_src: `[rows]` int64, non-expanded row j after the sort = row `row_src[j]` before (rows past the received
            count stay, in order; expanded, the order of the keys, which DeepEP does not apply to any array).
        recv_src_metadata: `[rows, K + 2]` int32, the handle's metadata after the sort as DeepEP leaves it:
            non-expanded, rows moved by `row_src`; expanded, rows not moved and columns 2.. remapped.
        expanded_row_src: `[expanded rows]` int64, expanded row j after the sort = row `expanded_row_src[j]` before
            (expanded dispatches; else None).
    """
    row_src: np.ndarray
    recv_src_metadata: np.ndarray
    expanded_row_src: Optional[np.ndarray] = None


def deepep_deterministic_sort(recv_src_metadata: np.ndarray, num_recv_tokens: int, do_expand: bool = False,
                              psum_num_recv_tokens_per_expert: Optional[np.ndarray] = None,
                              num_unaligned_recv_tokens_per_expert: Optional[np.ndarray] = None,
                              num_expanded_rows: int = 0) -> DeterministicSort:
    """Host version of DeepEP's `EPHandle.deterministic_sort` (deep_ep/buffers/elastic.py, non-cached dispatch), step
    by step: keys = `recv_src_metadata[:, 0]`, rows past `num_recv_tokens` keyed INT32_MAX, one sort (stable here:
    DeepEP's keys of received rows are distinct, so only the rows past the count, which it leaves unspecified, could
    differ). Expanded: key `expert * 1e10 - 5e9 + src_token_global_idx` for each valid (row, slot) pair's expanded row
    and `expert * 1e10` for padding, the expert of a row found by bucketize over `psum - unaligned`, a stable sort, and
    `recv_src_metadata[:, 2:]` remapped through the inverse permutation.

    Args:
        recv_src_metadata: `[rows, K + 2]` int32 before the sort.
        num_recv_tokens: received rows (`psum_num_recv_tokens_per_scaleup_rank[-1]`).
        do_expand, psum_num_recv_tokens_per_expert, num_unaligned_recv_tokens_per_expert, num_expanded_rows: the
            expanded layout (`[L]` int32 each; rows of the expanded outputs).
    """
    meta = np.array(recv_src_metadata, dtype=np.int32, copy=True)
    rows = meta.shape[0]
    keys = meta[:, 0].astype(np.int64)
    oob = np.arange(rows) >= num_recv_tokens
    keys[oob] = np.iinfo(np.int32).max
    orig = np.argsort(keys, kind='stable')
    if not do_expand:
        return DeterministicSort(orig, meta[orig])
    big = 10_000_000_000
    psum = np.asarray(psum_num_recv_tokens_per_expert, dtype=np.int64)
    start = psum - np.asarray(num_unaligned_recv_tokens_per_expert, dtype=np.int64)
    expert_of_row = np.searchsorted(start[1:], np.arange(num_expanded_rows), side='right')     # bucketize(right)
    exp_keys = expert_of_row.astype(np.int64) * big
    slots = meta[:, 2:]
    valid = (slots >= 0) & ~oob[:, None]
    src = np.broadcast_to(meta[:, :1].astype(np.int64), slots.shape)
    np.add.at(exp_keys, slots[valid], -big // 2 + src[valid])
    exp_orig = np.argsort(exp_keys, kind='stable')
    to_index = np.empty_like(exp_orig)
    to_index[exp_orig] = np.arange(exp_orig.size)
    meta[:, 2:][valid] = to_index[slots[valid]]
    return DeterministicSort(orig, meta, exp_orig)
