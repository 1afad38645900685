"""Small numeric helpers for tests and benchmarks: similarity, per-token FP8 casts, sizes, hashes and alignment.

Everything here is pure torch (CPU or CUDA tensors), keeps no state and never uses `torch.compile`, so it runs
wherever torch does. These are references and test tooling, not fast paths.
"""

from collections.abc import Iterable
from typing import Any, Tuple

import torch

# Largest finite float8_e4m3fn value, and the width of one scaling group along the hidden dimension.
FP8_E4M3_MAX = 448.0
FP8_GROUP_SIZE = 128
# Per-group amax clamp, so an all-zero group gets a finite, non-zero scale.
FP8_AMAX_CLAMP = 1e-4
# UE8M0 exponent byte of 1.0 (bias 127): what padding scale groups hold in packed UE8M0 factors.
UE8M0_ONE = 127


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """Dissimilarity of two tensors: `1 - 2·Σ(x+1)(y+1) / Σ((x+1)² + (y+1)²)`, computed in float64.

    It is 0 for identical tensors and grows with the squared difference relative to the magnitude (the +1 shift keeps
    it defined for all-zero inputs).

    Args:
        x: any shape and floating dtype.
        y: same shape as `x` (or broadcastable to it).

    Returns:
        the difference as a Python float (`nan` only when both tensors are all -1).
    """
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    similarity = 2 * (x * y).sum() / denominator
    return (1 - similarity).item()


def _check_2d_float(x: Any, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f'{name} must be a torch.Tensor, got {type(x).__name__}')
    if x.dim() != 2:
        raise ValueError(f'{name} must be 2-D [num_tokens, hidden], got shape {tuple(x.shape)}')


def _ceil_pow2(v: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ≥ each (positive, normal, float32) element, exactly: bump the exponent if the mantissa
    is non-zero, then clear the mantissa (no float `log2`, which can round an exact power the wrong way)."""
    bits = v.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False,
                          round_scale: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise rows to float8_e4m3fn with one scale per 128 consecutive channels (DeepEP's FP8 dispatch format).

    The hidden dimension is zero-padded to a multiple of 128; each group's scale is `amax / 448` with `amax` the
    group's largest |x| in float32, clamped at 1e-4. With `round_scale` the scale is rounded up to a power of two
    (`2^ceil(log2(amax / 448))`), which the UE8M0 format requires.

    Args:
        x: `[num_tokens, hidden]`, any floating dtype (bfloat16 in the tests); `hidden` need not be a multiple of 128.
        use_ue8m0: pack the scales as UE8M0 exponent bytes, four per int32 (requires `round_scale`).
        round_scale: round every scale up to a power of two.

    Returns:
        `(x_fp8, sf)`: `x_fp8` is `[num_tokens, hidden]`, float8_e4m3fn. `sf` is `[num_tokens, ceil(hidden / 128)]`,
        float32, the scale of each group (so `x ≈ x_fp8 · sf`), or with `use_ue8m0`
        `[num_tokens, ceil(ceil(hidden / 128) / 4)]`, int32, where memory byte `i` of int `j` (the low byte first on
        little-endian GPUs and CPUs) is the biased exponent of group `4j + i`'s scale; groups past the end hold 127
        (scale 1.0).
    """
    _check_2d_float(x, 'x')
    if not x.is_floating_point():
        raise TypeError(f'x must be a floating tensor, got dtype {x.dtype}')
    if use_ue8m0 and not round_scale:
        raise ValueError('use_ue8m0=True needs round_scale=True: UE8M0 can only hold power-of-two scales')
    num_tokens, hidden = x.shape
    num_groups = ceil_div(hidden, FP8_GROUP_SIZE)
    aligned_hidden = num_groups * FP8_GROUP_SIZE

    x_padded = torch.nn.functional.pad(x, (0, aligned_hidden - hidden), mode='constant', value=0)
    x_view = x_padded.view(num_tokens, num_groups, FP8_GROUP_SIZE)
    x_amax = x_view.abs().float().amax(dim=2).view(num_tokens, num_groups).clamp(FP8_AMAX_CLAMP)
    if round_scale:
        sf = _ceil_pow2(x_amax / FP8_E4M3_MAX)
        x_scaled = x_view / sf.unsqueeze(2)
    else:
        sf = x_amax / FP8_E4M3_MAX
        # Same expression as upstream (multiply by 448 / amax rather than divide by the scale): bitwise-equal outputs
        x_scaled = x_view * (FP8_E4M3_MAX / x_amax.unsqueeze(2))
    x_fp8 = x_scaled.to(torch.float8_e4m3fn).view(num_tokens, aligned_hidden)[:, :hidden].contiguous()
    if not use_ue8m0:
        return x_fp8, sf.view(num_tokens, num_groups)

    # Exponent byte of each (power-of-two, normal) scale, then four bytes per int32 in memory order
    exponents = (sf.view(torch.int32) >> 23).to(torch.uint8)
    num_packed = ceil_div(num_groups, 4)
    packed = torch.full((num_tokens, num_packed * 4), UE8M0_ONE, dtype=torch.uint8, device=x.device)
    packed[:, :num_groups] = exponents
    return x_fp8, packed.view(torch.int32)


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantise the output of `per_token_cast_to_fp8`: `x_fp8 · scale` per 128-channel group.

    Args:
        x_fp8: `[num_tokens, hidden]`, float8_e4m3fn (any hidden size).
        x_scales: `[num_tokens, ceil(hidden / 128)]`, float32 scales (row- or column-major), or packed UE8M0
            `[num_tokens, ceil(ceil(hidden / 128) / 4)]`, int32, each byte `b` standing for the float with bits
            `b << 23`.
        out_dtype: dtype of the result (upstream returns bfloat16).

    Returns:
        `[num_tokens, hidden]`, `out_dtype`.
    """
    _check_2d_float(x_fp8, 'x_fp8')
    sf = x_scales
    if not isinstance(sf, torch.Tensor):
        raise TypeError(f'x_scales must be a torch.Tensor, got {type(sf).__name__}')
    num_tokens, hidden = x_fp8.shape
    num_groups = ceil_div(hidden, FP8_GROUP_SIZE)
    # Any shape holding the scales token by token works, as upstream (it views them as `[num_tokens, -1]`): DeepEP's
    # low-latency test passes packed UE8M0 scales `[L, T, H/512]` viewed as `(-1, H/128)`.
    if num_tokens == 0:
        scales = torch.empty((0, num_groups), dtype=torch.float32, device=x_fp8.device)
    elif sf.dtype == torch.int32:
        exponent_bytes = sf.contiguous().view(torch.uint8).reshape(-1)
        if exponent_bytes.numel() % max(1, num_tokens) or exponent_bytes.numel() // max(1, num_tokens) < num_groups:
            raise ValueError(f'x_scales (packed UE8M0) must hold at least {num_groups} exponent bytes per token for '
                             f'{num_tokens} tokens, got shape {tuple(sf.shape)}')
        exponent_bytes = exponent_bytes.view(num_tokens, -1)[:, :num_groups].to(torch.int32)
        scales = (exponent_bytes << 23).view(torch.float32)
    elif sf.dtype == torch.float32:
        if tuple(sf.shape) == (num_tokens, num_groups):
            scales = sf
        elif sf.numel() == num_tokens * num_groups:
            scales = sf.reshape(num_tokens, num_groups)
        else:
            raise ValueError(f'x_scales must be [{num_tokens}, {num_groups}] (or hold that many scales token by '
                             f'token), got {tuple(sf.shape)}')
    else:
        raise TypeError(f'x_scales must be float32 scales or int32 packed UE8M0 factors, got dtype {sf.dtype}')

    x = torch.nn.functional.pad(x_fp8.float(), (0, num_groups * FP8_GROUP_SIZE - hidden))
    x = x.view(num_tokens, num_groups, FP8_GROUP_SIZE) * scales.unsqueeze(2)
    return x.view(num_tokens, num_groups * FP8_GROUP_SIZE)[:, :hidden].to(out_dtype)


def create_grouped_scores(scores: torch.Tensor, group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Zero the scores of experts outside each token's selected groups (group-limited gating, V1 internode test).

    Args:
        scores: `[num_tokens, num_experts]`, floating; `num_experts` divisible by `num_groups`.
        group_idx: `[num_tokens, num_selected_groups]`, int64, the groups each token may route to.
        num_groups: number of expert groups (nodes), experts numbered group by group.

    Returns:
        `[num_tokens, num_experts]`, `scores` with the experts of unselected groups set to 0.
    """
    num_tokens, num_experts = scores.shape
    if num_groups <= 0 or num_experts % num_groups != 0:
        raise ValueError(f'num_groups={num_groups} must be positive and divide num_experts={num_experts}')
    mask = torch.zeros((num_tokens, num_groups), dtype=torch.bool, device=scores.device)
    mask.scatter_(1, group_idx, True)
    grouped = scores.view(num_tokens, num_groups, -1) * mask.unsqueeze(-1)
    return grouped.view(num_tokens, num_experts)


def inplace_unique(x: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Per row, replace `x` by its distinct non-negative values sorted descending, padded with -1, in place.

    Negative entries are ignored; rows with more distinct values than columns keep the largest ones.

    Args:
        x: `[num_rows, num_cols]`, an integer dtype, values in `[-inf, num_slots)`; modified in place.
        num_slots: exclusive upper bound of the values (e.g. the number of ranks).

    Returns:
        `x` itself.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f'x must be a 2-D tensor, got {getattr(x, "shape", type(x).__name__)}')
    if x.is_floating_point():
        raise TypeError(f'x must be an integer tensor, got dtype {x.dtype}')
    if x.numel() > 0 and int(x.max().item()) >= num_slots:
        raise ValueError(f'x holds {int(x.max().item())}, not below num_slots={num_slots}')
    # Presence bitmap with one extra column that swallows the negative entries
    present = torch.zeros((x.size(0), num_slots + 1), dtype=torch.bool, device=x.device)
    present.scatter_(1, x.masked_fill(x < 0, num_slots).long(), True)
    values = torch.arange(num_slots, device=x.device, dtype=x.dtype).expand(x.size(0), -1)
    values = values.masked_fill(~present[:, :num_slots], -1)
    values = values.sort(dim=1, descending=True).values
    num_kept = min(num_slots, x.size(1))
    x.fill_(-1)
    x[:, :num_kept] = values[:, :num_kept]
    return x


def hash_tensor(t: torch.Tensor) -> int:
    """A cheap reproducibility fingerprint: the sum of the tensor's bytes viewed as int32 (zero-padded to 4 bytes).

    Args:
        t: any shape and dtype; non-contiguous tensors are hashed by their logical (row-major) contents.

    Returns:
        the sum as a Python int.
    """
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 4 != 0:
        raw = torch.nn.functional.pad(raw, (0, 4 - raw.numel() % 4))
    return int(raw.view(torch.int32).sum(dtype=torch.int64).item())


def hash_tensors(*tensors: Any) -> int:
    """XOR of `hash_tensor` over tensors (nested tuples/lists allowed, None skipped), as DeepEP combines them."""
    value = 0
    for t in _flatten(tensors):
        value ^= hash_tensor(t)
    return value


def _flatten(items: Iterable[Any]):
    for item in items:
        if item is None:
            continue
        if isinstance(item, (tuple, list)):
            yield from _flatten(item)
        else:
            yield item


def count_bytes(*tensors: Any) -> int:
    """Total payload size in bytes: `Σ numel · element_size`.

    Args:
        *tensors: torch tensors (or arrays with `nbytes`), None (skipped) and nested tuples/lists of them.

    Returns:
        the number of bytes, as a Python int.
    """
    total = 0
    for t in _flatten(tensors):
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        elif hasattr(t, 'nbytes'):
            total += int(t.nbytes)
        else:
            raise TypeError(f'count_bytes takes tensors, None and tuples of them, got {type(t).__name__}')
    return total


def ceil_div(x: int, y: int) -> int:
    """`ceil(x / y)` for integers."""
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    """`x` rounded up to a multiple of `y`."""
    return ceil_div(x, y) * y


def safe_div(a: float, b: float) -> float:
    """`a / b`, or 0 when `b` is 0 (e.g. bytes per token on a rank that received none; DeepEP returns 0 for 0 / 0
    and raises `ZeroDivisionError` for other `a`, which this never does)."""
    return 0 if b == 0 else a / b
