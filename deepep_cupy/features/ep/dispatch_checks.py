"""The argument checks of a dispatch that plan.py's `plan_dispatch` runs in order: x and its scale factors, the routing
(a cached dispatch's handle or the call's arguments), topk_idx's layout, the optional arrays. Pure: no GPU, no buffer;
each user error raises `ValueError` / `TypeError` naming the argument."""

from typing import Any, NamedTuple, Optional

from ...runtime import checks
from ...runtime.interop import TensorInfo
from ...runtime.sizes import ceil_div
from . import layout
from .handle import EPHandle
from .legacy import LegacyLayout
from .settings import EPSettings


class XArgs(NamedTuple):
    """A dispatch's checked `x` (`check_x`)."""
    fp8: bool                          # x came as (x_fp8, sf)
    x: Any
    xi: TensorInfo
    sf: Any                            # scale factors (FP8), or None
    sfi: Optional[TensorInfo]
    num_sf: int


class Routing(NamedTuple):
    """A dispatch's routing settings resolved from its handle or its arguments (`resolve_routing`)."""
    topk_idx: Any
    num_experts: Any
    expert_alignment: Any
    num_max_tokens_per_rank: Any
    do_cpu_sync: bool


def check_x(s: EPSettings, x) -> XArgs:
    """`x` (a tensor or an (x_fp8, sf) pair) and its scale factors, checked."""
    fp8 = isinstance(x, (tuple, list))
    if fp8:
        if len(x) != 2:
            raise ValueError(f'x must be a tensor or a (x_fp8, sf) pair, got a sequence of {len(x)}')
        x, sf = x
    else:
        sf = None
    xi = checks.info(x, 'x', s.device)
    checks.check_dtype(xi, 'x', 'float8_e4m3fn' if fp8 else 'bfloat16')
    if xi.ndim != 2:
        raise ValueError(f'x must be 2-D [num_tokens, hidden], got shape {list(xi.shape)}')
    num_tokens, hidden = xi.shape
    if xi.strides[1] != 1:
        raise ValueError('x must have contiguous rows (stride 1 along hidden)')
    hidden_bytes = hidden * xi.itemsize
    if hidden_bytes % 16 != 0:
        raise ValueError(f'x: hidden * element size must be a multiple of 16 bytes, got {hidden} x {xi.itemsize}')
    if xi.strides[0] * xi.itemsize % 16 != 0 or xi.ptr % 16 != 0:
        raise ValueError('x rows must start at 16-byte aligned addresses')
    if sf is None:
        return XArgs(fp8=fp8, x=x, xi=xi, sf=None, sfi=None, num_sf=0)
    sfi = checks.info(sf, 'x[1] (scale factors)', s.device)
    checks.check_same_kind(xi.kind, sfi, 'x[1] (scale factors)')
    checks.check_dtype(sfi, 'x[1] (scale factors)', 'float32', 'int32')
    if sfi.ndim != 2 or sfi.shape[0] != num_tokens:
        raise ValueError(f'x[1] (scale factors) must be [num_tokens={num_tokens}, P], got {list(sfi.shape)}')
    num_sf = sfi.shape[1]
    if num_sf > ceil_div(hidden, layout.SF_GROUP):
        raise ValueError(f'x[1] (scale factors) has {num_sf} columns; at most ceil(hidden / 128) = '
                         f'{ceil_div(hidden, layout.SF_GROUP)} are supported')
    return XArgs(fp8=fp8, x=x, xi=xi, sf=sf, sfi=sfi, num_sf=num_sf)


def resolve_routing(s: EPSettings, xi: TensorInfo, handle: Optional[EPHandle], topk_idx, num_experts,
                    num_max_tokens_per_rank, expert_alignment, do_cpu_sync) -> Routing:
    """The routing of a cached dispatch (the handle's, the arguments checked against it) or of a new one (the
    arguments with their defaults)."""
    if handle is None:
        if topk_idx is None:
            raise ValueError('topk_idx is required (or pass handle= for a cached dispatch)')
        if num_experts is None:
            raise ValueError('num_experts is required')
        if num_max_tokens_per_rank is None:
            num_max_tokens_per_rank = s.num_max_tokens_per_rank
        return Routing(topk_idx=topk_idx, num_experts=num_experts,
                        expert_alignment=1 if expert_alignment is None else expert_alignment,
                        num_max_tokens_per_rank=num_max_tokens_per_rank,
                        do_cpu_sync=True if do_cpu_sync is None else bool(do_cpu_sync))
    if not isinstance(handle, EPHandle):
        raise TypeError(f'handle must be an EPHandle, got {type(handle).__name__}')
    if handle.buffer_id != s.owner_id:
        raise ValueError('handle was made by another buffer; use the buffer that dispatched it')
    if topk_idx is not None:
        raise ValueError('topk_idx must be None for a cached dispatch (it comes from the handle)')
    for name, value, expect in (('num_experts', num_experts, handle.num_experts),
                                ('expert_alignment', expert_alignment, handle.expert_alignment),
                                ('num_max_tokens_per_rank', num_max_tokens_per_rank,
                                 handle.num_max_tokens_per_rank)):
        if value is not None and value != expect:
            raise ValueError(f'{name}={value} does not match the handle ({expect})')
    if do_cpu_sync:
        raise ValueError('do_cpu_sync must be False (or None) for a cached dispatch')
    num_tokens = xi.shape[0]
    if num_tokens != handle.num_tokens:
        raise ValueError(f'x has {num_tokens} tokens but the handle was made for {handle.num_tokens}')
    if handle.kind != xi.kind:
        raise TypeError(f'x is a {xi.kind} array but the handle holds {handle.kind} arrays')
    return Routing(topk_idx=handle.topk_idx, num_experts=handle.num_experts,
                    expert_alignment=handle.expert_alignment,
                    num_max_tokens_per_rank=handle.num_max_tokens_per_rank, do_cpu_sync=False)


def check_topk_idx(s: EPSettings, kind: str, topk_idx, num_tokens: int, num_experts: int,
                   legacy: Optional[LegacyLayout]) -> TensorInfo:
    """topk_idx's layout (its values are checked on the GPU) and V1's expert counts."""
    ti = checks.info(topk_idx, 'topk_idx', s.device)
    checks.check_same_kind(kind, ti, 'topk_idx')
    checks.check_dtype(ti, 'topk_idx', 'int64')
    if ti.ndim != 2 or ti.shape[0] != num_tokens:
        raise ValueError(f'topk_idx must be [num_tokens={num_tokens}, num_topk], got {list(ti.shape)}')
    checks.check_contiguous(ti, 'topk_idx')
    K = ti.shape[1]
    if legacy is not None:
        legacy.check_expert_counts(kind, num_experts, s.device)
    if not 1 <= K <= layout.NUM_MAX_TOPK:
        raise ValueError(f'topk_idx: num_topk must be in [1, {layout.NUM_MAX_TOPK}], got {K}')
    if s.num_topk and K > s.num_topk:
        raise ValueError(f'topk_idx has {K} columns but the buffer was built for num_topk={s.num_topk}')
    return ti


def check_side_arrays(s: EPSettings, kind: str, topk_weights, stats, num_tokens: int, num_topk: int,
                      num_local_experts: int) -> None:
    """topk_weights `[num_tokens, num_topk]` float32 and cumulative_local_expert_recv_stats `[L]` int32, if given."""
    if topk_weights is not None:
        wi = checks.info(topk_weights, 'topk_weights', s.device)
        checks.check_same_kind(kind, wi, 'topk_weights')
        checks.check_dtype(wi, 'topk_weights', 'float32')
        checks.check_shape(wi, 'topk_weights', (num_tokens, num_topk))
        checks.check_contiguous(wi, 'topk_weights')
    if stats is not None:
        ci = checks.info(stats, 'cumulative_local_expert_recv_stats', s.device)
        checks.check_same_kind(kind, ci, 'cumulative_local_expert_recv_stats')
        checks.check_dtype(ci, 'cumulative_local_expert_recv_stats', 'int32')
        checks.check_shape(ci, 'cumulative_local_expert_recv_stats', (num_local_experts,))
        checks.check_contiguous(ci, 'cumulative_local_expert_recv_stats')
