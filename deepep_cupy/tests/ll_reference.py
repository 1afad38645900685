"""Host references (torch, CPU) of the low-latency dispatch and combine, with exactly the kernels' arithmetic
(kernels_cu/ep_ll.cu), so that results compare bit for bit.

- `cast_fp8`: DeepEP v1.2.1's low-latency recipe (kernels_cu/common/ll_fp8.cuh): per token, per 128 channels,
  `amax = max(max |x|, 1e-4)` in float and `inv = float(1 / 448)`; without round_scale `scale_inv = amax * inv`,
  `q = e4m3(x * (448 / amax))` (each operation rounded once); with round_scale `scale_inv = 2^ceil(log2(amax * inv))`
  (exactly: the exponent of `amax * inv` bumped when its mantissa is not zero) and `q = e4m3(x * 2^-e)`
  (== `x / scale_inv`). Not DeepEP V2's torch recipe (`deepep_cupy.utils.math.per_token_cast_to_fp8`:
  `scale_inv = amax / 448`), which differs in the last bit of about half the scales without round_scale; with
  round_scale both agree on every bfloat16 input (tests/test_ll_cpu.py checks both statements).
- `dispatch_reference`: the masked layout of one receiving rank from every rank's inputs.
- `combine_reference`: `sum_k w_k * row_k` in float32, ascending k, `acc = acc + w * row` (two roundings), one
  rounding to bfloat16.
"""

from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence

import torch

FP8_MAX = 448.0
AMAX_CLAMP = 1e-4
GROUP = 128
# float(1 / 448), rounded once (0x3b124925): DeepEP's kFinfoAmaxInvE4M3, ll_fp8.cuh's kFp8MaxInv.
FP8_MAX_INV = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(FP8_MAX, dtype=torch.float32)


def cast_fp8(x: torch.Tensor, round_scale: bool):
    """`x` `[N, H]` bfloat16 (H % 128 == 0) → `(q [N, H] float8_e4m3fn, scale_inv [N, H/128] float32)`."""
    n, h = x.shape
    s = h // GROUP
    amax = x.reshape(n, s, GROUP).abs().float().amax(dim=2).clamp(min=AMAX_CLAMP) if n > 0 else \
        torch.empty((0, s), dtype=torch.float32)
    if round_scale:
        bits = (amax * FP8_MAX_INV).view(torch.int32)
        exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale_inv = (exponent << 23).view(torch.float32)
        scale = ((254 - exponent) << 23).view(torch.float32)
    else:
        scale_inv = amax * FP8_MAX_INV
        scale = torch.full_like(amax, FP8_MAX) / amax
    q = (x.float().reshape(n, s, GROUP) * scale.unsqueeze(2)).reshape(n, h).to(torch.float8_e4m3fn)
    return q, scale_inv


def pack_ue8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales `[N, S]` float32 (S % 4 == 0) → `[N, S/4]` int32 of exponent bytes, byte q of int g =
    group 4g + q (little endian)."""
    n, s = scale_inv.shape
    exponents = (scale_inv.contiguous().view(torch.int32) >> 23).to(torch.uint8)
    return exponents.reshape(n, s).contiguous().view(torch.int32).reshape(n, s // 4)


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`q` `[n, H]` float8_e4m3fn, `scales` `[n, H/128]` float32 or packed UE8M0 `[n, H/512]` int32 →
    `[n, H]` bfloat16 (`float(q) * scale`, rounded once). Same ops on CPU and GPU tensors, so both sides of a test
    build identical rows."""
    n, h = q.shape
    if scales.dtype == torch.int32:
        scales = (scales.contiguous().view(torch.uint8).reshape(n, h // GROUP).to(torch.int32) << 23) \
            .view(torch.float32)
    return (q.float().reshape(n, h // GROUP, GROUP) * scales.reshape(n, h // GROUP, 1)).reshape(n, h) \
        .to(torch.bfloat16)


@dataclass
class ExpertRows:
    """What one local expert received: `count` rows, in the kernel's order."""
    count: int
    src_info: torch.Tensor      # [count] int32: token index at the source
    src_rank: torch.Tensor      # [count] int32
    topk_slot: torch.Tensor     # [count] int32: k of the (token, k) that chose this expert
    x: torch.Tensor             # [count, H] bfloat16 or float8_e4m3fn
    scales: Optional[torch.Tensor]   # [count, H/128] float32, [count, H/512] int32 (UE8M0), or None (BF16)


@dataclass
class DispatchReference:
    recv_count: torch.Tensor    # [L] int32
    layout_range: torch.Tensor  # [L, R] int64: (begin << 32) | count
    experts: List[ExpertRows]


def dispatch_reference(xs: Sequence[torch.Tensor], topks: Sequence[torch.Tensor], rank: int, num_experts: int,
                       num_max_tokens: int, use_fp8: bool, round_scale: bool = False, use_ue8m0: bool = False,
                       masked: Iterable[int] = ()) -> DispatchReference:
    """The receive side of `rank` given every rank's `x` `[N_s, H]` bfloat16 and `topk_idx` `[N_s, K]` int64.

    Rows of local expert j (global id rank * L + j): sources in ascending rank order (masked sources send nothing),
    each source's (token, k) pairs with `topk_idx[t, k] == e` in (t, k) order, at most `num_max_tokens` per source
    (more only with repeated experts in one token: the kernel drops them too)."""
    num_ranks = len(xs)
    L = num_experts // num_ranks
    masked = set(masked)
    casts = []
    for s in range(num_ranks):
        if use_fp8:
            q, sf = cast_fp8(xs[s], round_scale)
            casts.append((q, pack_ue8m0(sf) if use_ue8m0 else sf))
        else:
            casts.append((xs[s], None))
    recv_count = torch.zeros(L, dtype=torch.int32)
    layout_range = torch.zeros((L, num_ranks), dtype=torch.int64)
    experts = []
    for j in range(L):
        e = rank * L + j
        parts = {'t': [], 's': [], 'k': [], 'x': [], 'sf': []}
        begin = 0
        for s in range(num_ranks):
            hits = (topks[s] == e).nonzero() if s not in masked else torch.empty((0, 2), dtype=torch.int64)
            hits = hits[:num_max_tokens]
            count = hits.shape[0]
            layout_range[j, s] = (begin << 32) | count
            begin += count
            t, k = hits[:, 0], hits[:, 1]
            parts['t'].append(t.to(torch.int32))
            parts['k'].append(k.to(torch.int32))
            parts['s'].append(torch.full((count,), s, dtype=torch.int32))
            parts['x'].append(casts[s][0][t])
            if use_fp8:
                parts['sf'].append(casts[s][1][t])
        recv_count[j] = begin
        experts.append(ExpertRows(begin, torch.cat(parts['t']), torch.cat(parts['s']), torch.cat(parts['k']),
                                  torch.cat(parts['x']), torch.cat(parts['sf']) if use_fp8 else None))
    return DispatchReference(recv_count, layout_range, experts)


def combine_reference(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, num_ranks: int,
                      row_of: Callable[[torch.Tensor, int], torch.Tensor],
                      masked: Iterable[int] = ()) -> torch.Tensor:
    """`combined[t] = bf16(sum over k ascending with topk_idx[t, k] in [0, E) and its owner not masked of
    w[t, k] * row_of(t, k))`, accumulated in float32 as `acc = fma(w, row, acc)` (one rounding per step: DeepEP
    v1.2.1's fused multiply-add; `fma_f32`).

    Args:
        topk_idx: `[N, K]` int64; topk_weights: `[N, K]` float32.
        row_of: `(expert ids [N] int64, k) -> [N, H] bfloat16`, the row each token's slot k gets back (any value
            where the id is invalid; it is not used).
    """
    n, num_topk = topk_idx.shape
    L = num_experts // num_ranks
    masked_owner = torch.zeros(num_ranks + 1, dtype=torch.bool)
    for r in masked:
        masked_owner[r] = True
    acc = None
    for k in range(num_topk):
        e = topk_idx[:, k]
        valid = (e >= 0) & (e < num_experts)
        owner = torch.where(valid, e // L, torch.full_like(e, num_ranks))
        valid &= ~masked_owner[owner]
        rows = row_of(e, k).float()
        if acc is None:
            acc = torch.zeros_like(rows)
        acc = torch.where(valid.unsqueeze(1), fma_f32(topk_weights[:, k:k + 1].float().expand_as(rows), rows, acc),
                          acc)
    if acc is None:
        raise ValueError('topk_idx needs at least one column')
    return acc.to(torch.bfloat16)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """`a * b + c` rounded once to float32 (CUDA's `__fmaf_rn`), for finite float32 tensors of one shape. The product
    is exact in float64 (24 + 24 significant bits); the sum is rounded to float64 by round-to-odd (the error of the
    float64 sum, from Knuth's two-sum, decides the last bit), and round-to-odd at 53 bits followed by a rounding to
    24 bits is the correctly rounded result (53 >= 24 + 2)."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float('inf')), torch.full_like(s, float('-inf')))
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def expert_factor(expert_ids: torch.Tensor) -> torch.Tensor:
    """A power of two per expert (2^(e % 4 - 2)), float32: the rank programs scale each expert's rows by it, so that
    a row sent back for the wrong top-k slot changes the result."""
    return torch.pow(2.0, (expert_ids.clamp(min=0) % 4 - 2).to(torch.float32))
