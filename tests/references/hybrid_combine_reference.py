"""Host reference of the FUSED hybrid combine (numpy, pure; its kernels are not written yet): the reduction order
those kernels must reproduce bit for bit, equal to DeepEP's `refs.combine` for its three recipes
(tests/test_hybrid_reference_cpu.py checks all three).

A partial travels as a *unit*: a bfloat16 row, the top-k slots it stands for, the weights of those slots and its
*key*, the top-k slot whose position orders it in every sum (the LAST slot of the group it sums: DeepEP's
`refs.combine` keeps a group's sum in the group's last slot, and later sums add surviving slots in ascending k).

1. Every rank (m, l), per received row of a token of origin (n, r): with `reduce_in_local` one unit, the row itself
   (non-expanded input is already the rank's sum) or the FP32 sum from +0.0 of its expanded rows in ascending k,
   rounded to bfloat16 once; without it (expanded input, `allow_multiple_reduction=False`) one unit per local top-k
   slot. Each unit goes over NVLink to the forwarder (m, r) into combine stage row `stage_row = n * M + domain_pos`
   (metadata column 1 // K) at slot `stage_slot` (column 1 % K with `reduce_in_local`, else k).
2. The forwarder (m, r), per stage row, knowing the token's top-k ids from `token_metadata_at_forward`: with
   `reduce_in_scaleup` the FP32 sum from +0.0 of the units in ascending key, rounded to bfloat16 once, one unit whose
   key is the domain's last slot (a single unit may pass unchanged: it is bfloat16 already, and the origin's sum,
   which starts from +0.0 or the bias, absorbs the sign of a -0.0); without it the units pass through in stage slot
   order. Own-domain tokens (n = m) stay at the forwarder, which is their
   origin; the others cross rail r to (n, r) at rail position `domain_pos[t][m]`, one row per (token, domain) with
   `reduce_in_scaleup`.
3. The origin: FP32 accumulator = bias_0 (+ bias_1), then every unit of every domain in ascending key, rounded to
   bfloat16 once. `combined_topk_weights[t][k]` = the weight the owner of slot k returned for slot k (0 for -1),
   selected (never summed) at the forwarder and at the origin.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .hybrid_reference import HybridDispatch, HybridShape, rank_ordinals


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even, NaN -> 0x7FFF as the GPU's cvt.rn does); uint16 bits. (The same
    rounding as features/agrs/reference.py.)"""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(0x7FFF), r)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass
class Unit:
    """A partial on its way to the origin."""
    value: np.ndarray          # [H] uint16 (bfloat16 bits)
    key: int                   # the top-k slot that orders it
    slots: np.ndarray          # [K] bool: the top-k slots it stands for
    weights: np.ndarray        # [K] float32, meaningful where `slots`


def _sum_units(units: List[Unit], start: Optional[np.ndarray] = None) -> np.ndarray:
    """FP32 sum of the units in ascending key from `start` (or +0.0), rounded once; uint16 bits."""
    acc = np.zeros(units[0].value.shape, dtype=np.float32) if start is None else start.astype(np.float32).copy()
    for u in sorted(units, key=lambda u: u.key):
        acc += bf16_bits_to_f32(u.value)
    return f32_to_bf16_bits(acc)


def _merge(units: List[Unit], num_topk: int) -> Unit:
    """One unit standing for all: the FP32 sum, the last key, the union of slots, each slot's weight selected."""
    slots = np.zeros(num_topk, dtype=bool)
    weights = np.zeros(num_topk, dtype=np.float32)
    for u in units:
        weights[u.slots] = u.weights[u.slots]
        slots |= u.slots
    return Unit(_sum_units(units), max(u.key for u in units), slots, weights)


@dataclass
class HybridCombine:
    """The combine of a job.

    Attributes:
        combined_x: per origin rank `[T, H]` uint16 (bfloat16 bits).
        combined_topk_weights: per origin rank `[T, K]` float32, or None without weights.
        stage: per forwarder rank, `(stage_row, stage_slot)` -> the `Unit` a rank of its domain pushed.
        rail_rows: `(forwarder, origin)` -> per rail position the units that crossed the rail (in order).
    """
    combined_x: List[np.ndarray]
    combined_topk_weights: Optional[List[np.ndarray]]
    stage: List[Dict[Tuple[int, int], Unit]]
    rail_rows: Dict[Tuple[int, int], Dict[int, List[Unit]]]


def _rank_units(d: HybridDispatch, rank: int, x: np.ndarray, w: Optional[np.ndarray], do_expand: bool,
                reduce_in_local: bool):
    """Step 1 at `rank`: `(forwarder, stage_row, stage_slot, Unit)` per unit it pushes."""
    shape, rec = d.shape, d.recv[rank]
    K, R = shape.num_topk, shape.num_scaleup_ranks
    for i in range(rec.recv_src_rank.size):
        fwd = shape.rank_of(shape.domain_of(rank), int(rec.recv_src_rank[i]) % R)
        stage_row, rank_slot = divmod(int(rec.recv_src_metadata[i, 1]), K)
        local = rec.recv_topk_idx[i] >= 0
        local_slots = np.nonzero(local)[0]
        if not do_expand:
            weights = w[i].astype(np.float32) if w is not None else np.zeros(K, dtype=np.float32)
            yield fwd, stage_row, rank_slot, Unit(x[i].copy(), int(local_slots[-1]), local, weights)
            continue
        rows = rec.recv_src_metadata[i, 2:]
        weights = np.zeros(K, dtype=np.float32)
        if w is not None:
            weights[local_slots] = w[rows[local_slots]]
        per_slot = []
        for k in local_slots:
            only = np.zeros(K, dtype=bool)
            only[k] = True
            per_slot.append(Unit(x[rows[k]].copy(), int(k), only, weights * only))
        if reduce_in_local:
            unit = _merge(per_slot, K)
            yield fwd, stage_row, rank_slot, unit
        else:
            for u in per_slot:
                yield fwd, stage_row, u.key, u


def _expected_stage_slots(shape: HybridShape, topk_row: np.ndarray, domain: int, reduce_in_local: bool) -> List[int]:
    """The stage slots a forwarder of `domain` waits for, from the token's top-k ids alone (what the kernel knows)."""
    L = shape.num_local_experts
    owners = np.where(topk_row >= 0, topk_row // L, -1)
    if not reduce_in_local:
        return [k for k, o in enumerate(owners.tolist()) if o >= 0 and shape.domain_of(o) == domain]
    in_domain = [o for o in rank_ordinals(owners) if shape.domain_of(o) == domain]
    return list(range(len(in_domain)))


def combine(d: HybridDispatch, xs: Sequence[np.ndarray], weights: Optional[Sequence[np.ndarray]] = None,
            biases: Optional[Sequence[Sequence[np.ndarray]]] = None, do_expand: bool = False,
            reduce_in_local: bool = True, reduce_in_scaleup: bool = True) -> HybridCombine:
    """Run the hybrid combine protocol on the host.

    Args:
        d: the dispatch (`reference.dispatch`, with `do_expand` as here).
        xs: per rank its combine input, uint16 bfloat16 bits: `[num_recv, H]` (non-expanded: each row the rank's
            local sum) or `[num_expanded, H]` (expanded; alignment gaps ignored).
        weights: per rank `[num_recv, K]` or `[num_expanded]` float32, or None.
        biases: per origin rank a sequence of 0, 1 or 2 `[T, H]` uint16 arrays, or None.
        do_expand, reduce_in_local, reduce_in_scaleup: DeepEP's recipe (tests/elastic/test_ep.py): non-expanded
            input needs `reduce_in_local`; `reduce_in_scaleup` needs `reduce_in_local`.

    Returns:
        `HybridCombine`.
    """
    shape = d.shape
    N, W, M, K = shape.num_domains, shape.num_ranks, shape.num_max_tokens_per_rank, shape.num_topk
    if not do_expand and not reduce_in_local:
        raise ValueError('a non-expanded combine input is already reduced per rank: reduce_in_local must be True')
    if reduce_in_scaleup and not reduce_in_local:
        raise ValueError('reduce_in_scaleup=True needs reduce_in_local=True')
    if do_expand and d.recv[0].expanded_row_src is None:
        raise ValueError('do_expand=True needs a dispatch made with do_expand=True')
    if len(xs) != W:
        raise ValueError(f'xs must hold one array per rank ({W}), got {len(xs)}')
    hidden = next((x.shape[1] for x in xs if x.ndim == 2), 0)

    # Step 1: every rank pushes its units into the stage of the forwarder of each token.
    stage: List[Dict[Tuple[int, int], Unit]] = [dict() for _ in range(W)]
    for rank in range(W):
        w = weights[rank] if weights is not None else None
        for fwd, stage_row, slot, unit in _rank_units(d, rank, xs[rank], w, do_expand, reduce_in_local):
            if (stage_row, slot) in stage[fwd]:
                raise AssertionError(f'stage slot ({stage_row}, {slot}) at rank {fwd} written twice')
            stage[fwd][(stage_row, slot)] = unit

    # Step 2: the forwarders reduce their domain (or pass through) and send one row block per (token, domain).
    own: List[Dict[int, List[Unit]]] = [dict() for _ in range(W)]
    rail_rows: Dict[Tuple[int, int], Dict[int, List[Unit]]] = {}
    for f in range(W):
        m, r = shape.domain_of(f), shape.scaleup_idx_of(f)
        rows: Dict[int, Dict[int, Unit]] = {}
        for (stage_row, slot), unit in stage[f].items():
            rows.setdefault(stage_row, {})[slot] = unit
        for stage_row, by_slot in sorted(rows.items()):
            n, p = divmod(stage_row, M)
            t, topk_row = int(d.token_metadata_at_forward[f][n, p, 0]), d.token_metadata_at_forward[f][n, p, 1:]
            assert t >= 0, f'stage row {stage_row} at rank {f} has no token'
            expect = _expected_stage_slots(shape, topk_row, m, reduce_in_local)
            assert sorted(by_slot) == expect, f'stage row {stage_row} at rank {f}: slots {sorted(by_slot)} != {expect}'
            units = [by_slot[s] for s in expect]
            out = [_merge(units, K)] if reduce_in_scaleup else units
            origin = shape.rank_of(n, r)
            if n == m:
                own[origin][t] = out
            else:
                rail_rows.setdefault((f, origin), {})[p] = out

    # Step 3: the origin's final sum over its token's domains.
    combined_x, combined_w = [], []
    for o in range(W):
        n, r = shape.domain_of(o), shape.scaleup_idx_of(o)
        rt = d.routings[o]
        T = rt.topk_idx.shape[0]
        out_x = np.zeros((T, hidden), dtype=np.uint16)
        out_w = np.zeros((T, K), dtype=np.float32)
        bias = list(biases[o]) if biases is not None else []
        if len(bias) > 2:
            raise ValueError(f'rank {o}: at most 2 biases, got {len(bias)}')
        for t in range(T):
            units = list(own[o].get(t, []))
            for m in range(N):
                pos = int(rt.domain_pos[t, m])
                if m != n and pos >= 0:
                    units += rail_rows[(shape.rank_of(m, r), o)][pos]
            start = np.zeros(hidden, dtype=np.float32)
            if bias:
                start = bf16_bits_to_f32(bias[0][t]).copy()
                if len(bias) == 2:
                    start += bf16_bits_to_f32(bias[1][t])
            out_x[t] = _sum_units(units, start) if units else f32_to_bf16_bits(start)
            for u in units:
                out_w[t, u.slots] = u.weights[u.slots]
            covered = np.zeros(K, dtype=bool)
            for u in units:
                assert not (covered & u.slots).any(), f'token {t} of rank {o}: a top-k slot arrived twice'
                covered |= u.slots
            assert np.array_equal(covered, rt.topk_idx[t] >= 0), f'token {t} of rank {o}: slots missing'
        combined_x.append(out_x)
        combined_w.append(out_w)
    return HybridCombine(combined_x, combined_w if weights is not None else None, stage, rail_rows)
