"""Reference implementations of MoE dispatch and combine (torch), mirroring DeepEP's `deep_ep/utils/refs.py`.

Three layers:

1. Pure functions of all ranks' inputs (`dispatch_from_gathered`, the expert-count / psum / expanded-layout helpers).
   GPU correctness checks gather the inputs on the host and call these, so a check never depends on NCCL or on the
   code under test; CPU tests call them with lists of per-rank inputs.
2. Combine: `generate_pre_combine_data` (DeepEP's deterministic test data), `ordered_accumulate` and `combine`, the
   exact fixed-order reduction the combine kernels must reproduce bit for bit.
3. All-to-all forms: `dispatch`, DeepEP's reference (signature and result tuple as DeepEP's, over torch.distributed),
   and `dispatch_nccl` / `combine_nccl` over our `NcclComm` (what a user would write without this library; benchmark
   baselines). They share the per-destination selection and the reduction order with layers 1 and 2.

Conventions (DeepEP V2): expert `e` lives on rank `e // (num_experts // num_ranks)` with local id
`e % (num_experts // num_ranks)`; `-1` in `topk_idx` means "no expert"; a token is received once per destination rank
that owns at least one of its experts; `src_token_global_idx = src_rank * num_max_tokens_per_rank + src_token_idx`.
"""

import math
from collections.abc import Sequence
from typing import NamedTuple, Optional, Union

import torch

from .math import align

Bias = Union[None, torch.Tensor, Sequence[torch.Tensor]]

# -------------------------------------------------------------------------------------------------------------------
# Shared helpers (used by the gathered reference and the NCCL baseline alike)


def tokens_for_rank(topk_idx: torch.Tensor, dst_rank: int, num_experts_per_rank: int) -> torch.Tensor:
    """Indices of the tokens that go to `dst_rank` (at least one top-k expert lives there), ascending.

    Args:
        topk_idx: `[num_tokens, num_topk]`, integer, global expert ids or -1.
        dst_rank: destination rank.
        num_experts_per_rank: experts per rank.

    Returns:
        `[num_send_tokens]`, int64 token indices in ascending order.
    """
    lo = dst_rank * num_experts_per_rank
    mask = ((topk_idx >= lo) & (topk_idx < lo + num_experts_per_rank)).any(dim=1)
    return mask.nonzero(as_tuple=True)[0]


def to_local_topk_idx(topk_idx: torch.Tensor, rank: int, num_experts_per_rank: int) -> torch.Tensor:
    """Global expert ids → local ids of `rank`'s experts, -1 for experts elsewhere (and for -1).

    Args:
        topk_idx: `[n, num_topk]`, integer, global expert ids or -1.
        rank: the receiving rank.
        num_experts_per_rank: experts per rank.

    Returns:
        `[n, num_topk]`, same dtype, values in `[-1, num_experts_per_rank)`.
    """
    lo = rank * num_experts_per_rank
    is_local = (topk_idx >= lo) & (topk_idx < lo + num_experts_per_rank)
    return torch.where(is_local, topk_idx - lo, torch.full_like(topk_idx, -1))


def _experts_per_rank(num_experts: int, num_ranks: int) -> int:
    if num_ranks <= 0 or num_experts <= 0 or num_experts % num_ranks != 0:
        raise ValueError(f'num_experts ({num_experts}) must be a positive multiple of the number of ranks '
                         f'({num_ranks})')
    return num_experts // num_ranks


# -------------------------------------------------------------------------------------------------------------------
# Layer 1: dispatch from all ranks' inputs


class DispatchRef(NamedTuple):
    """What one rank receives from a (non-expanded) dispatch, rows sorted by (source rank, source token index).

    Attributes:
        recv_x: `[num_recv, hidden]`, the dtype of `x` (bfloat16, or float8_e4m3fn with `recv_sf`).
        recv_sf: `[num_recv, num_sf]`, row-major scales, or None without scales.
        recv_topk_idx: `[num_recv, num_topk]`, the dtype of `topk_idx`: local expert id, or -1 where the slot's expert
            is not on this rank.
        recv_topk_weights: `[num_recv, num_topk]`, float32, the ORIGINAL weights of every slot (not masked, as
            DeepEP's refs return them; compare only where `recv_topk_idx >= 0`), or None without weights.
        recv_src_token_global_idx: `[num_recv]`, int32, `src_rank * num_max_tokens_per_rank + src_token_idx`.
        num_recv_tokens_per_rank: `[num_ranks]`, int32 (CPU), rows received from each source rank.
    """
    recv_x: torch.Tensor
    recv_sf: Optional[torch.Tensor]
    recv_topk_idx: torch.Tensor
    recv_topk_weights: Optional[torch.Tensor]
    recv_src_token_global_idx: torch.Tensor
    num_recv_tokens_per_rank: torch.Tensor


def _per_rank(values, num_ranks: int, name: str) -> list:
    if values is None:
        return [None] * num_ranks
    values = list(values)
    if len(values) != num_ranks:
        raise ValueError(f'{name} must hold one entry per rank ({num_ranks}), got {len(values)}')
    return values


def dispatch_from_gathered(xs: Sequence[torch.Tensor], sfs: Optional[Sequence[torch.Tensor]],
                           topk_idxs: Sequence[torch.Tensor], topk_weights_list: Optional[Sequence[torch.Tensor]],
                           rank: int, num_max_tokens_per_rank: int, num_experts: int) -> DispatchRef:
    """What `rank` receives from a dispatch, computed from every rank's inputs.

    Args:
        xs: per source rank, `[num_tokens_r, hidden]` (bfloat16 or float8_e4m3fn); `num_tokens_r` may differ.
        sfs: per source rank `[num_tokens_r, num_sf]` scales (any strides), or None.
        topk_idxs: per source rank `[num_tokens_r, num_topk]`, integer, global expert ids in `[0, num_experts)` or -1.
        topk_weights_list: per source rank `[num_tokens_r, num_topk]` float32, or None.
        rank: the receiving rank.
        num_max_tokens_per_rank: M, at least every `num_tokens_r`; defines `src_token_global_idx`.
        num_experts: total number of experts, a multiple of the number of ranks.

    Returns:
        `DispatchRef`, rows sorted by (source rank, source token index), each token once per destination rank.
    """
    num_ranks = len(xs)
    num_experts_per_rank = _experts_per_rank(num_experts, num_ranks)
    if not 0 <= rank < num_ranks:
        raise ValueError(f'rank must be in [0, {num_ranks}), got {rank}')
    topk_idxs = _per_rank(topk_idxs, num_ranks, 'topk_idxs')
    sfs = _per_rank(sfs, num_ranks, 'sfs')
    weights = _per_rank(topk_weights_list, num_ranks, 'topk_weights_list')
    num_topk = topk_idxs[0].shape[1] if topk_idxs[0].dim() == 2 else -1
    for src, (x, topk_idx) in enumerate(zip(xs, topk_idxs)):
        if x.dim() != 2 or x.shape[0] > num_max_tokens_per_rank:
            raise ValueError(f'xs[{src}] must be [num_tokens <= {num_max_tokens_per_rank}, hidden], '
                             f'got {tuple(x.shape)}')
        if topk_idx.dim() != 2 or topk_idx.shape != (x.shape[0], num_topk):
            raise ValueError(f'topk_idxs[{src}] must be [{x.shape[0]}, {num_topk}], got {tuple(topk_idx.shape)}')
        if topk_idx.numel() and (topk_idx.min() < -1 or topk_idx.max() >= num_experts):
            raise ValueError(f'topk_idxs[{src}] must hold expert ids in [-1, {num_experts})')
        if weights[src] is not None and weights[src].shape != topk_idx.shape:
            raise ValueError(f'topk_weights_list[{src}] must be {tuple(topk_idx.shape)}, '
                             f'got {tuple(weights[src].shape)}')

    parts = {'x': [], 'sf': [], 'topk_idx': [], 'weights': [], 'src': []}
    num_recv_tokens_per_rank = []
    for src in range(num_ranks):
        idx = tokens_for_rank(topk_idxs[src], rank, num_experts_per_rank)
        num_recv_tokens_per_rank.append(idx.numel())
        parts['x'].append(xs[src][idx.to(xs[src].device)])
        parts['topk_idx'].append(topk_idxs[src][idx])
        parts['src'].append((idx + src * num_max_tokens_per_rank).to(torch.int32))
        if sfs[src] is not None:
            parts['sf'].append(sfs[src][idx.to(sfs[src].device)].contiguous())
        if weights[src] is not None:
            parts['weights'].append(weights[src][idx.to(weights[src].device)])
    if parts['sf'] and len(parts['sf']) != num_ranks:
        raise ValueError('sfs must be given for every rank or for none')
    if parts['weights'] and len(parts['weights']) != num_ranks:
        raise ValueError('topk_weights_list must be given for every rank or for none')
    return DispatchRef(
        recv_x=torch.cat(parts['x']),
        recv_sf=torch.cat(parts['sf']) if parts['sf'] else None,
        recv_topk_idx=to_local_topk_idx(torch.cat(parts['topk_idx']), rank, num_experts_per_rank),
        recv_topk_weights=torch.cat(parts['weights']) if parts['weights'] else None,
        recv_src_token_global_idx=torch.cat(parts['src']),
        num_recv_tokens_per_rank=torch.tensor(num_recv_tokens_per_rank, dtype=torch.int32))


# -------------------------------------------------------------------------------------------------------------------
# Layer 1: per-expert counts, psums and the expanded (GEMM) layout


def expected_expert_counts(recv_topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """Received (token, top-k slot) pairs per local expert (unaligned; `cumulative_local_expert_recv_stats` adds these).

    Args:
        recv_topk_idx: `[num_recv, num_topk]`, integer, local expert ids or -1.
        num_local_experts: L.

    Returns:
        `[L]`, int32.
    """
    valid = recv_topk_idx[recv_topk_idx >= 0]
    if valid.numel() and valid.max() >= num_local_experts:
        raise ValueError(f'recv_topk_idx must hold local expert ids in [-1, {num_local_experts})')
    return torch.bincount(valid.long().cpu(), minlength=num_local_experts).to(torch.int32)


def aligned_expert_counts(counts: torch.Tensor, expert_alignment: int = 1) -> list:
    """`handle.num_recv_tokens_per_expert_list`: each count rounded up to `expert_alignment`, as Python ints."""
    if expert_alignment < 1:
        raise ValueError(f'expert_alignment must be >= 1, got {expert_alignment}')
    return [align(int(c), expert_alignment) for c in counts.tolist()]


def psum_num_recv_tokens_per_expert(counts: torch.Tensor, expert_alignment: int = 1,
                                    do_expand: bool = False) -> torch.Tensor:
    """`handle.psum_num_recv_tokens_per_expert` from unaligned per-expert counts.

    Non-expanded: inclusive prefix sum of the aligned counts. Expanded: `psum[i]` = aligned start of expert i + its
    actual count, so expert i's rows are `[align(psum[i-1], A), psum[i])` (start 0 for i = 0) and its alignment gap is
    `[psum[i], align(psum[i], A))`.

    Args:
        counts: `[L]`, integer, unaligned (token, slot) pairs per local expert.
        expert_alignment: A.
        do_expand: which convention.

    Returns:
        `[L]`, int32.
    """
    aligned = torch.tensor(aligned_expert_counts(counts, expert_alignment), dtype=torch.int64)
    inclusive = torch.cumsum(aligned, 0)
    if not do_expand:
        return inclusive.to(torch.int32)
    return (inclusive - aligned + counts.cpu().long()).to(torch.int32)


class ExpandedLayoutRef(NamedTuple):
    """The expanded (GEMM) layout: one row per (received token, local top-k slot), grouped by local expert.

    Expert j occupies rows `[expert_start[j], expert_start[j] + num_tokens_per_expert[j])` with
    `expert_start[j] = align(expert_start[j-1] + num_tokens_per_expert[j-1], A)`; inside an expert rows are ordered
    by (received row, top-k slot) ascending (DeepEP leaves this order unspecified; this is ours).

    Attributes:
        num_tokens_per_expert: `[L]`, int32, unaligned counts.
        expert_start: `[L]`, int64, aligned start row of each expert.
        psum_num_recv_tokens_per_expert: `[L]`, int32, expanded convention (start + count).
        num_expanded_tokens: Python int, sum of aligned counts (= `align(psum[-1], A)`, 0 with no experts).
        row_src: `[num_expanded_tokens]`, int64, received row of each expanded row, -1 in alignment gaps.
        row_slot: `[num_expanded_tokens]`, int64, top-k slot of each expanded row, -1 in alignment gaps.
        topk_to_expanded_row: `[num_recv, num_topk]`, int32, expanded row of each local slot, -1 for non-local slots
            (columns `2..K+1` of DeepEP's `recv_src_metadata` in expand mode).
    """
    num_tokens_per_expert: torch.Tensor
    expert_start: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    num_expanded_tokens: int
    row_src: torch.Tensor
    row_slot: torch.Tensor
    topk_to_expanded_row: torch.Tensor


def expanded_layout(recv_topk_idx: torch.Tensor, num_local_experts: int,
                    expert_alignment: int = 1) -> ExpandedLayoutRef:
    """The expanded layout of one rank's dispatch output.

    Args:
        recv_topk_idx: `[num_recv, num_topk]`, integer, local expert ids or -1.
        num_local_experts: L.
        expert_alignment: A, rows reserved per expert are a multiple of it.

    Returns:
        `ExpandedLayoutRef` (CPU tensors).
    """
    recv_topk_idx = recv_topk_idx.cpu()
    counts = expected_expert_counts(recv_topk_idx, num_local_experts)
    aligned = torch.tensor(aligned_expert_counts(counts, expert_alignment), dtype=torch.int64)
    expert_start = torch.cumsum(aligned, 0) - aligned
    num_expanded_tokens = int(aligned.sum())

    # (row, slot) pairs in row-major order; a stable sort by expert keeps that order inside each expert.
    rows, slots = (recv_topk_idx >= 0).nonzero(as_tuple=True)
    experts = recv_topk_idx[rows, slots].long()
    experts, order = torch.sort(experts, stable=True)
    rows, slots = rows[order], slots[order]
    first_pair_of_expert = torch.cumsum(counts.long(), 0) - counts.long()
    rank_in_expert = torch.arange(experts.numel()) - first_pair_of_expert[experts]
    dst = expert_start[experts] + rank_in_expert

    row_src = torch.full((num_expanded_tokens,), -1, dtype=torch.int64)
    row_slot = torch.full((num_expanded_tokens,), -1, dtype=torch.int64)
    row_src[dst], row_slot[dst] = rows, slots
    topk_to_expanded_row = torch.full(recv_topk_idx.shape, -1, dtype=torch.int32)
    topk_to_expanded_row[rows, slots] = dst.to(torch.int32)
    psum = (expert_start + counts.long()).to(torch.int32)
    return ExpandedLayoutRef(counts, expert_start, psum, num_expanded_tokens, row_src, row_slot, topk_to_expanded_row)


def expand_rows(values: torch.Tensor, layout: ExpandedLayoutRef) -> torch.Tensor:
    """Per-received-row values in the expanded layout (e.g. `recv_x`, `recv_sf`), zeros in alignment gaps.

    Args:
        values: `[num_recv, ...]`.
        layout: from `expanded_layout`.

    Returns:
        `[num_expanded_tokens, ...]`, same dtype.
    """
    out = torch.zeros((layout.num_expanded_tokens, *values.shape[1:]), dtype=values.dtype, device=values.device)
    used = (layout.row_src >= 0).nonzero(as_tuple=True)[0]
    out[used.to(values.device)] = values[layout.row_src[used].to(values.device)]
    return out


def expand_slots(values: torch.Tensor, layout: ExpandedLayoutRef) -> torch.Tensor:
    """Per-(row, slot) values in the expanded layout (e.g. `recv_topk_weights` → `[num_expanded]`, or pre-combine
    data `[num_recv, K, hidden]` → the expanded combine input `[num_expanded, hidden]`), zeros in alignment gaps.

    Args:
        values: `[num_recv, num_topk, ...]`.
        layout: from `expanded_layout`.

    Returns:
        `[num_expanded_tokens, ...]`, same dtype.
    """
    out = torch.zeros((layout.num_expanded_tokens, *values.shape[2:]), dtype=values.dtype, device=values.device)
    used = (layout.row_src >= 0).nonzero(as_tuple=True)[0]
    src_rows, src_slots = layout.row_src[used].to(values.device), layout.row_slot[used].to(values.device)
    out[used.to(values.device)] = values[src_rows, src_slots]
    return out


# -------------------------------------------------------------------------------------------------------------------
# Layer 2: combine


def generate_pre_combine_data(src_token_global_idx: torch.Tensor, num_max_tokens_per_rank: int, num_topk: int,
                              hidden: int, num_ranks: Optional[int] = None,
                              global_seed: Optional[int] = None) -> torch.Tensor:
    """DeepEP's deterministic combine test data: a function of the source token's global index only.

    With `g = src_token_global_idx[i]`, `seed = g * K + k`, `max_seed = num_ranks * M * K`:
    `y[i, k, h] = sin(((seed * 131071 % max_seed) + 1) / max_seed * (h + 1) + sin(global_seed))`, computed in float32
    and rounded to bfloat16. `sin` may differ in the last float32 bit between CPU and CUDA, so generate the kernel's
    input and the reference's on the same device (or generate once and copy).

    Args:
        src_token_global_idx: `[n]`, integer.
        num_max_tokens_per_rank: M.
        num_topk: K.
        hidden: H.
        num_ranks: R (default: the torch.distributed world size, as DeepEP, else the `init_dist` group's).
        global_seed: the job's global seed, the same on every rank (default: `envs.get_global_seed()`, as DeepEP).

    Returns:
        `[n, K, H]`, bfloat16, values in [-1, 1], on the device of `src_token_global_idx`.
    """
    if num_ranks is None:
        num_ranks = _world_size()
    if global_seed is None:
        from .envs import get_global_seed
        global_seed = get_global_seed()
    if src_token_global_idx.dim() != 1:
        raise ValueError(f'src_token_global_idx must be 1-D, got shape {tuple(src_token_global_idx.shape)}')
    device = src_token_global_idx.device
    seeds = src_token_global_idx.long().unsqueeze(1) * num_topk + torch.arange(num_topk, device=device).unsqueeze(0)
    max_seed = num_ranks * num_max_tokens_per_rank * num_topk
    phase = ((seeds * 131071 % max_seed).float() + 1) / max_seed
    y = torch.sin(phase.unsqueeze(-1) * torch.arange(1, hidden + 1, device=device, dtype=torch.float32)
                  + math.sin(float(global_seed)))
    return y.to(torch.bfloat16)


def ordered_accumulate(data: torch.Tensor, initial_value: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum over dim 1 in ascending order, adding each slot as float32 to an accumulator that starts as a copy of
    `initial_value` (its dtype: pass float32, as `combine` does) or as float32 zeros; rounded once to `data.dtype`.

    Args:
        data: `[n, K, H]`.
        initial_value: `[n, H]` start value, or None for zeros.

    Returns:
        `[n, H]`, `data.dtype`.
    """
    if initial_value is None:
        acc = torch.zeros((data.shape[0], data.shape[2]), dtype=torch.float32, device=data.device)
    else:
        acc = initial_value.clone()
    for k in range(data.shape[1]):
        acc += data[:, k].float()
    return acc.to(data.dtype)


def reduce_local_slots(y: torch.Tensor, recv_topk_idx: torch.Tensor) -> torch.Tensor:
    """One rank's non-expanded combine input: per received row, the sum of its local slots' partials (ascending k,
    float32, one rounding), which is exactly the rank group's sum in `combine(..., reduce_in_local=True)`.

    Args:
        y: `[num_recv, K, H]`, per-slot partial results (e.g. `generate_pre_combine_data` of the received rows).
        recv_topk_idx: `[num_recv, K]`, local expert ids or -1.

    Returns:
        `[num_recv, H]`, `y.dtype`.
    """
    return ordered_accumulate(torch.where((recv_topk_idx >= 0).unsqueeze(-1).to(y.device), y, torch.zeros_like(y)))


def _bias_start(bias: Bias, num_tokens: int, hidden: int, device) -> torch.Tensor:
    if bias is None:
        return torch.zeros((num_tokens, hidden), dtype=torch.float32, device=device)
    biases = [bias] if isinstance(bias, torch.Tensor) else list(bias)
    if not 1 <= len(biases) <= 2:
        raise ValueError(f'bias must be None, a tensor or a tuple of 1 or 2 tensors, got {len(biases)} tensors')
    for b in biases:
        if tuple(b.shape) != (num_tokens, hidden):
            raise ValueError(f'bias must be [{num_tokens}, {hidden}], got {tuple(b.shape)}')
    start = biases[0].float()
    return start + biases[1].float() if len(biases) == 2 else start.clone()


def _group_sum_slot(group_id: torch.Tensor, alive: torch.Tensor, group_sum_slot: str) -> torch.Tensor:
    """For each alive slot, the slot (same token, same group, alive) that holds the group's sum: the last one in
    ascending k (`'last'`, DeepEP) or the first (`'first'`). Dead slots map to themselves. `[n, K]` int64."""
    num_topk = group_id.shape[1]
    k = torch.arange(num_topk, device=group_id.device)
    same = (group_id.unsqueeze(2) == group_id.unsqueeze(1)) & alive.unsqueeze(1)  # [n, K (slot), K (other slot)]
    if group_sum_slot == 'last':
        target = torch.where(same, k, -1).amax(dim=2)
    elif group_sum_slot == 'first':
        target = torch.where(same, k, num_topk).amin(dim=2)
    else:
        raise ValueError(f"group_sum_slot must be 'last' or 'first', got {group_sum_slot!r}")
    return torch.where(alive, target, k.expand_as(target))


def _grouped_reduce(partials: torch.Tensor, alive: torch.Tensor, group_id: torch.Tensor, group_sum_slot: str):
    """Sum each token's alive partials per group (ascending k, float32), round to `partials.dtype`, keep the sum at the
    group's sum slot; returns the new (partials, alive)."""
    num_tokens, num_topk = alive.shape
    target = _group_sum_slot(group_id, alive, group_sum_slot)
    acc = torch.zeros(partials.shape, dtype=torch.float32, device=partials.device)
    for k in range(num_topk):
        tokens = alive[:, k].nonzero(as_tuple=True)[0]
        # Each token adds to exactly one accumulator per step, so the in-group order is ascending k.
        acc[tokens, target[tokens, k]] += partials[tokens, k].float()
    alive = alive & (target == torch.arange(num_topk, device=alive.device))
    partials = torch.where(alive.unsqueeze(-1), acc.to(partials.dtype), torch.zeros_like(partials))
    return partials, alive


def combine(y: torch.Tensor, topk_idx: torch.Tensor, num_scaleout_ranks: int, num_scaleup_ranks: int,
            num_experts: int, bias: Bias = None, reduce_in_local: bool = True, reduce_in_scaleup: bool = False,
            group_sum_slot: str = 'last') -> torch.Tensor:
    """The exact (bitwise) combine result for the tokens of one rank: an UNWEIGHTED sum of the top-k partials.

    Recipe (every float32 addition happens in the order given, since float addition is not associative and the kernels
    must match this bit for bit):

    0. Slot k of token t holds `y[t, k]`; slots with `topk_idx == -1` are excluded (count as no partial).
    1. `reduce_in_local`: group each token's slots by destination rank (`expert // experts_per_rank`); for each group,
       accumulate its partials in float32 in ascending k starting from 0, round the sum to `y.dtype` and keep it in
       the group's LAST slot in ascending k (DeepEP's `refs.combine`; `group_sum_slot='first'` keeps it in the first
       instead); the group's other slots drop out.
    2. `reduce_in_scaleup` (needs `reduce_in_local`): the same over the surviving slots, grouped by scale-out domain
       (`rank // num_scaleup_ranks`).
    3. Final: float32 accumulator = `float(bias_0) + float(bias_1)` (or `float(bias_0)`, or 0), then add every surviving
       partial in ascending k, round to `y.dtype` once.

    So with `reduce_in_local` each rank's contribution is rounded to bfloat16 before the final sum, and the slot that
    holds it decides its place in the final order. `reduce_in_scaleup=True` differs from False even with one scale-out
    domain (one more rounding before the bias is added).

    Args:
        y: `[num_tokens, K, H]`, bfloat16, partial result of each top-k slot.
        topk_idx: `[num_tokens, K]`, integer, global expert ids or -1 (the dispatch's input).
        num_scaleout_ranks: scale-out domains (1 in direct mode).
        num_scaleup_ranks: ranks per scale-out domain (all ranks in direct mode).
        num_experts: total experts, a multiple of `num_scaleout_ranks * num_scaleup_ranks`.
        bias: None, a tensor, or a tuple of 1 or 2 tensors, each `[num_tokens, H]`.
        reduce_in_local: pre-reduce per destination rank (step 1).
        reduce_in_scaleup: pre-reduce per scale-out domain (step 2).
        group_sum_slot: `'last'` (DeepEP) or `'first'`: which slot of a group keeps its sum.

    Returns:
        `[num_tokens, H]`, `y.dtype`.
    """
    if y.dim() != 3 or topk_idx.shape != y.shape[:2]:
        raise ValueError(f'y must be [num_tokens, num_topk, hidden] matching topk_idx {tuple(topk_idx.shape)}, '
                         f'got {tuple(y.shape)}')
    if reduce_in_scaleup and not reduce_in_local:
        raise ValueError('reduce_in_scaleup=True needs reduce_in_local=True')
    num_experts_per_rank = _experts_per_rank(num_experts, num_scaleout_ranks * num_scaleup_ranks)
    topk_idx = topk_idx.to(y.device)
    alive = topk_idx >= 0
    partials = torch.where(alive.unsqueeze(-1), y, torch.zeros_like(y))
    if reduce_in_local:
        partials, alive = _grouped_reduce(partials, alive, topk_idx // num_experts_per_rank, group_sum_slot)
    if reduce_in_scaleup:
        domain = topk_idx // (num_experts_per_rank * num_scaleup_ranks)
        partials, alive = _grouped_reduce(partials, alive, domain, group_sum_slot)
    acc = _bias_start(bias, y.shape[0], y.shape[2], y.device)
    for k in range(y.shape[1]):
        acc = torch.where(alive[:, k].unsqueeze(-1), acc + partials[:, k].float(), acc)
    return acc.to(y.dtype)


def expected_combined_x(topk_idx: torch.Tensor, rank: int, num_max_tokens_per_rank: int, num_ranks: int,
                        num_experts: int, hidden: int, global_seed: int, num_scaleout_ranks: int = 1,
                        bias: Bias = None, reduce_in_local: bool = True, reduce_in_scaleup: bool = False,
                        group_sum_slot: str = 'last') -> torch.Tensor:
    """What `rank`'s combine must return when every rank fed it `generate_pre_combine_data` (non-expanded: through
    `reduce_local_slots`; expanded: through `expand_slots`). Needs only this rank's `topk_idx`, since the data is a
    function of the global token index.

    Args:
        topk_idx: `[num_tokens, K]`, this rank's dispatch input.
        rank, num_max_tokens_per_rank, num_ranks, num_experts, hidden, global_seed: as in the dispatch / data.
        num_scaleout_ranks: scale-out domains (`num_scaleup_ranks = num_ranks // num_scaleout_ranks`).
        bias, reduce_in_local, reduce_in_scaleup, group_sum_slot: as in `combine`.

    Returns:
        `[num_tokens, hidden]`, bfloat16, on the device of `topk_idx`.
    """
    if num_scaleout_ranks < 1 or num_ranks % num_scaleout_ranks != 0:
        raise ValueError(f'num_scaleout_ranks ({num_scaleout_ranks}) must divide num_ranks ({num_ranks})')
    src = rank * num_max_tokens_per_rank + torch.arange(topk_idx.shape[0], device=topk_idx.device)
    y = generate_pre_combine_data(src, num_max_tokens_per_rank, topk_idx.shape[1], hidden, num_ranks, global_seed)
    return combine(y, topk_idx, num_scaleout_ranks, num_ranks // num_scaleout_ranks, num_experts, bias,
                   reduce_in_local, reduce_in_scaleup, group_sum_slot)


# -------------------------------------------------------------------------------------------------------------------
# Layer 3: all-to-all forms


def _world_size(group=None) -> int:
    """Ranks of `group` (default: the torch.distributed world, else the `init_dist` group)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    from . import envs
    if envs._group is not None:
        return envs._group.size
    raise RuntimeError('no process group: call deepep_cupy.utils.envs.init_dist first, or pass num_ranks')


def _all_to_all_rows(send: torch.Tensor, num_send: list, num_recv: list, group) -> torch.Tensor:
    """`torch.distributed.all_to_all_single` of whole rows, for any dtype and either backend: rows travel as raw
    bytes (gloo and NCCL both move uint8; neither needs to know float8), through host memory when the group cannot
    move CUDA tensors (gloo alone, as for ranks sharing a GPU)."""
    import torch.distributed as dist
    send = send.contiguous()
    row_shape = tuple(send.shape[1:])
    row_bytes = math.prod(row_shape) * send.element_size()
    send_bytes = send.reshape(send.shape[0], math.prod(row_shape)).view(torch.uint8).reshape(send.shape[0], row_bytes)
    staged = send.is_cuda and 'nccl' not in str(dist.get_backend(group)).lower()
    if staged:
        send_bytes = send_bytes.cpu()
    recv = torch.empty((sum(num_recv), row_bytes), dtype=torch.uint8, device=send_bytes.device)
    dist.all_to_all_single(recv, send_bytes, output_split_sizes=list(num_recv), input_split_sizes=list(num_send),
                           group=group)
    if staged:
        recv = recv.to(send.device)
    return recv.view(send.dtype).reshape(sum(num_recv), *row_shape)


class RefDispatchResult(NamedTuple):
    """DeepEP's `refs.dispatch` result, in DeepEP's tuple order (rows sorted by source rank, then source token).

    Attributes:
        recv_x: `[num_recv, hidden]`, the dtype of `x`; or `(recv_x, recv_sf)` when `x` was `(x, sf)`.
        recv_topk_idx: `[num_recv, num_topk]`, the dtype of `topk_idx`: local expert id, -1 where the expert is on
            another rank.
        recv_topk_weights: `[num_recv, num_topk]`, the original weights (not masked), or None without weights.
        recv_src_token_idx: `[num_recv]`, int32, `src_rank * num_max_tokens_per_rank + src_token_idx`.
        num_recv_tokens_per_rank: `[num_ranks]`, int32 (CPU), rows received from each source rank.
    """
    recv_x: Union[torch.Tensor, tuple]
    recv_topk_idx: torch.Tensor
    recv_topk_weights: Optional[torch.Tensor]
    recv_src_token_idx: torch.Tensor
    num_recv_tokens_per_rank: torch.Tensor


def dispatch(x: Union[torch.Tensor, tuple], topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
             num_max_tokens_per_rank: int, num_experts: int, group=None) -> RefDispatchResult:
    """DeepEP's reference dispatch: each token goes once to every rank owning one of its experts, through
    `torch.distributed.all_to_all_single` over `group` (default: the world, as DeepEP). Collective; synchronises the
    host (the count exchange sizes the outputs). Works on CUDA tensors (NCCL, or gloo through host memory) and on CPU
    tensors (gloo).

    Args:
        x: `[num_tokens, hidden]`, or `(x [num_tokens, hidden], sf [num_tokens, num_sf])` (e.g. float8 with scales).
        topk_idx: `[num_tokens, num_topk]`, integer, global expert ids or -1.
        topk_weights: `[num_tokens, num_topk]` float32, or None (DeepEP requires them; here the result holds None).
        num_max_tokens_per_rank: M, at least `num_tokens` (defines `recv_src_token_idx`).
        num_experts: total experts, a multiple of the number of ranks.
        group: a torch.distributed ProcessGroup (default: the world).

    Returns:
        `RefDispatchResult` (a 5-tuple like DeepEP's), equal to `dispatch_from_gathered` on the gathered inputs.
    """
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError('refs.dispatch exchanges tokens with torch.distributed, which is not initialised: call '
                           'deepep_cupy.utils.envs.init_dist first')
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    num_experts_per_rank = _experts_per_rank(num_experts, num_ranks)
    use_sf = isinstance(x, tuple)
    x, sf = x if use_sf else (x, None)
    if x.dim() != 2 or x.shape[0] > num_max_tokens_per_rank or tuple(topk_idx.shape[:1]) != (x.shape[0],):
        raise ValueError(f'x must be [num_tokens <= {num_max_tokens_per_rank}, hidden] matching topk_idx '
                         f'{tuple(topk_idx.shape)}, got {tuple(x.shape)}')
    if topk_weights is not None and topk_weights.shape != topk_idx.shape:
        raise ValueError(f'topk_weights must be {tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)}')

    per_dst = [tokens_for_rank(topk_idx, dst, num_experts_per_rank) for dst in range(num_ranks)]
    send_token_idx = torch.cat(per_dst)
    num_send = [int(idx.numel()) for idx in per_dst]
    counts = _all_to_all_rows(torch.tensor(num_send, dtype=torch.int64, device=x.device).view(num_ranks, 1),
                              [1] * num_ranks, [1] * num_ranks, group)
    num_recv = counts.view(-1).tolist()

    def exchange(t: torch.Tensor) -> torch.Tensor:
        return _all_to_all_rows(t[send_token_idx.to(t.device)], num_send, num_recv, group)

    recv_x = exchange(x)
    recv_src = exchange((torch.arange(x.shape[0], device=x.device) + rank * num_max_tokens_per_rank).to(torch.int32))
    return RefDispatchResult(
        recv_x=(recv_x, exchange(sf)) if use_sf else recv_x,
        recv_topk_idx=to_local_topk_idx(exchange(topk_idx), rank, num_experts_per_rank),
        recv_topk_weights=exchange(topk_weights) if topk_weights is not None else None,
        recv_src_token_idx=recv_src,
        num_recv_tokens_per_rank=torch.tensor(num_recv, dtype=torch.int32))


class NcclDispatchHandle(NamedTuple):
    """What `combine_nccl` needs from `dispatch_nccl`.

    Attributes:
        topk_idx: `[num_tokens, K]`, the dispatch's input (global expert ids or -1).
        send_token_idx: `[num_send]`, int64, local token index of each sent row, grouped by destination rank.
        num_send_tokens_per_rank: rows sent to each rank (Python ints).
        num_recv_tokens_per_rank: rows received from each rank (Python ints).
        num_experts: total experts.
    """
    topk_idx: torch.Tensor
    send_token_idx: torch.Tensor
    num_send_tokens_per_rank: list
    num_recv_tokens_per_rank: list
    num_experts: int


class NcclDispatchOutput(NamedTuple):
    """`dispatch_nccl`'s result: the received data (same form as `dispatch_from_gathered`) and the handle for
    combine."""
    result: DispatchRef
    handle: NcclDispatchHandle


class CombineRef(NamedTuple):
    """Combine result: `combined_x` `[num_tokens, H]` bfloat16; `combined_topk_weights` `[num_tokens, K]` float32
    (each slot's weight as its expert's rank returned it, 0 for -1 slots) or None."""
    combined_x: torch.Tensor
    combined_topk_weights: Optional[torch.Tensor]


def dispatch_nccl(x: Union[torch.Tensor, tuple], topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                  num_max_tokens_per_rank: int, num_experts: int, comm, group=None) -> NcclDispatchOutput:
    """Dispatch with NCCL all-to-alls, the way a user would write it: counts, then rows, scales, top-k ids, weights
    and source indices, then a local-expert remap. Collective over `comm`; runs on torch's current stream and
    synchronises the host (per-destination `nonzero`, and the count exchange that sizes the outputs).

    Args:
        x: `[num_tokens, hidden]` bfloat16, or `(x float8_e4m3fn [num_tokens, hidden], sf [num_tokens, num_sf])`;
            CUDA tensors.
        topk_idx: `[num_tokens, K]`, integer, global expert ids or -1.
        topk_weights: `[num_tokens, K]` float32, or None.
        num_max_tokens_per_rank: M (at least `num_tokens`; defines the source global index).
        num_experts: total experts, a multiple of the number of ranks.
        comm: `deepep_cupy.runtime.nccl.NcclComm`.
        group: optional `ProcessGroup`; if given, its rank and size must match `comm`'s (no host collective).

    Returns:
        `NcclDispatchOutput`; `result` equals `dispatch_from_gathered` on the gathered inputs.
    """
    if group is not None and (group.rank, group.size) != (comm.rank, comm.size):
        raise ValueError(f'group (rank {group.rank} of {group.size}) does not match comm (rank {comm.rank} of '
                         f'{comm.size})')
    rank, num_ranks = comm.rank, comm.size
    num_experts_per_rank = _experts_per_rank(num_experts, num_ranks)
    x, sf = x if isinstance(x, tuple) else (x, None)
    if x.dim() != 2 or x.shape[0] > num_max_tokens_per_rank or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f'x must be [num_tokens <= {num_max_tokens_per_rank}, hidden] matching topk_idx '
                         f'{tuple(topk_idx.shape)}, got {tuple(x.shape)}')

    per_dst = [tokens_for_rank(topk_idx, dst, num_experts_per_rank) for dst in range(num_ranks)]
    send_token_idx = torch.cat(per_dst)
    num_send = [int(idx.numel()) for idx in per_dst]
    recv_counts = torch.empty(num_ranks, dtype=torch.int64, device=x.device)
    comm.all_to_all_single(recv_counts, torch.tensor(num_send, dtype=torch.int64, device=x.device))
    num_recv = recv_counts.tolist()

    def exchange(send: torch.Tensor) -> torch.Tensor:
        send = send.contiguous()
        recv = torch.empty((sum(num_recv), *send.shape[1:]), dtype=send.dtype, device=send.device)
        comm.all_to_all_single(recv, send, recv_splits=num_recv, send_splits=num_send)
        return recv

    recv_topk_idx = exchange(topk_idx[send_token_idx])
    result = DispatchRef(
        recv_x=exchange(x[send_token_idx]),
        recv_sf=exchange(sf[send_token_idx]) if sf is not None else None,
        recv_topk_idx=to_local_topk_idx(recv_topk_idx, rank, num_experts_per_rank),
        recv_topk_weights=exchange(topk_weights[send_token_idx]) if topk_weights is not None else None,
        recv_src_token_global_idx=exchange((send_token_idx + rank * num_max_tokens_per_rank).to(torch.int32)),
        num_recv_tokens_per_rank=torch.tensor(num_recv, dtype=torch.int32))
    return NcclDispatchOutput(result, NcclDispatchHandle(topk_idx, send_token_idx, num_send, num_recv, num_experts))


def combine_nccl(x: torch.Tensor, handle: NcclDispatchHandle, comm, topk_weights: Optional[torch.Tensor] = None,
                 bias: Bias = None, group_sum_slot: str = 'last') -> CombineRef:
    """Combine with one NCCL all-to-all back to the source ranks, then the final reduction of `combine` (the returned
    rows are the rank groups' sums, added in the order of their sum slots after the bias). Bitwise equal to
    `combine(y, topk_idx, 1, R, E, bias, reduce_in_local=True)` when every rank passes `reduce_local_slots(y_recv)`.

    Args:
        x: `[num_recv, H]` bfloat16 CUDA, rows aligned with `dispatch_nccl`'s `recv_x` (each the rank's local sum).
        handle: from `dispatch_nccl`.
        comm: the `NcclComm` of the dispatch.
        topk_weights: `[num_recv, K]` float32 to send back, or None.
        bias: None, a tensor, or a tuple of 1 or 2 tensors, each `[num_tokens, H]`.
        group_sum_slot: as in `combine`.

    Returns:
        `CombineRef`.
    """
    num_recv, num_send = handle.num_recv_tokens_per_rank, handle.num_send_tokens_per_rank
    if x.dim() != 2 or x.shape[0] != sum(num_recv):
        raise ValueError(f'x must be [{sum(num_recv)}, hidden] (the dispatch output rows), got {tuple(x.shape)}')

    def exchange_back(send: torch.Tensor) -> torch.Tensor:
        send = send.contiguous()
        recv = torch.empty((sum(num_send), *send.shape[1:]), dtype=send.dtype, device=send.device)
        comm.all_to_all_single(recv, send, recv_splits=num_send, send_splits=num_recv)
        return recv

    back_x = exchange_back(x)
    back_w = exchange_back(topk_weights) if topk_weights is not None else None

    topk_idx = handle.topk_idx
    num_tokens, num_topk = topk_idx.shape
    num_experts_per_rank = _experts_per_rank(handle.num_experts, comm.size)
    device = x.device
    valid = topk_idx >= 0
    dst_rank = torch.where(valid, topk_idx // num_experts_per_rank, 0)
    # row_of[t, r]: the returned row of token t from rank r (rows come back grouped by rank, tokens ascending).
    sent_to = torch.repeat_interleave(torch.arange(comm.size, device=device), torch.tensor(num_send, device=device))
    row_of = torch.full((num_tokens, comm.size), -1, dtype=torch.int64, device=device)
    row_of[handle.send_token_idx, sent_to] = torch.arange(sum(num_send), device=device)

    is_sum_slot = valid & (_group_sum_slot(dst_rank, valid, group_sum_slot) == torch.arange(num_topk, device=device))
    acc = _bias_start(bias, num_tokens, x.shape[1], device)
    for k in range(num_topk):
        tokens = is_sum_slot[:, k].nonzero(as_tuple=True)[0]
        acc[tokens] += back_x[row_of[tokens, dst_rank[tokens, k]]].float()

    combined_w = None
    if back_w is not None:
        combined_w = torch.zeros((num_tokens, num_topk), dtype=back_w.dtype, device=device)
        tokens, slots = valid.nonzero(as_tuple=True)
        combined_w[tokens, slots] = back_w[row_of[tokens, dst_rank[tokens, slots]], slots]
    return CombineRef(acc.to(x.dtype), combined_w)
