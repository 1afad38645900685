"""Argument checks of the hybrid dispatch / combine: everything is rejected before the first kernel (the rail kernels
run before the intranode engine's own checks)."""

from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Tuple

from ...constants import NUM_MAX_LOCAL_EXPERTS, NUM_MAX_TOPK
from ...runtime.interop import tensor_info
from . import plan as hplan


@dataclass
class DispatchArgs:
    """A hybrid dispatch's checked arguments (`check_dispatch_args`)."""
    x: Any                      # `[T, hidden]` bfloat16 or float8_e4m3fn (rows contiguous, 16-byte aligned)
    sf: Any                     # FP8: `[T, num_sf]` 4-byte scales, else None
    topk_idx: Any               # `[T, K]` int64 (a cached dispatch's: the handle's)
    topk_weights: Any           # `[T, K]` float32, or None
    num_tokens: int
    num_topk: int
    num_experts: int
    num_max_tokens: int         # M of the call
    hidden_bytes: int
    x_row_bytes: int            # x's row stride in bytes
    num_sf: int
    sf_strides: Tuple[int, int]     # (token, column) strides of sf in elements, (0, 0) without
    cpu_sync: bool

    def check_range(self, buf) -> None:
        """topk_idx values in [-1, num_experts) (a host read of its min / max; skipped inside CUDA-graph capture)."""
        t = self.topk_idx
        if not self.num_tokens:
            return
        lo, hi = int(t.min()), int(t.max())
        if lo < -1 or hi >= self.num_experts:
            raise ValueError(f'topk_idx values must be in [-1, {self.num_experts}), got [{lo}, {hi}]')


class XRows(NamedTuple):
    """A dispatch's checked x (and FP8 scales): `_check_x`."""
    x: Any
    sf: Any
    num_tokens: int
    hidden: int
    hidden_bytes: int
    x_row_bytes: int
    num_sf: int
    sf_strides: Tuple[int, int]


def _device_check(info, device: int, name: str) -> None:
    if info.device != device:
        raise ValueError(f'{name} must be on this buffer\'s device ({device}), got device {info.device}')


def check_dispatch_args(feat, x, topk_idx, topk_weights, num_experts: Optional[int],
                        num_max_tokens_per_rank: Optional[int], expert_alignment: Optional[int], previous_event,
                        allocate_on_comm_stream: bool, handle, do_cpu_sync: Optional[bool],
                        allow_previous_event_alone: bool = False) -> DispatchArgs:
    """Check a hybrid dispatch's arguments (ValueError / TypeError as the intranode engine raises them);
    `allow_previous_event_alone`: DeepEP V1's event rule (a previous event without allocate_on_comm_stream)."""
    device = feat.inner.settings.device
    if previous_event is not None and not allocate_on_comm_stream and not allow_previous_event_alone:
        raise ValueError('previous_event needs allocate_on_comm_stream=True')
    if handle is not None:
        _check_cached(feat, handle, topk_idx, expert_alignment)
        topk_idx, num_experts = handle.topk_idx, handle.num_experts
        num_max_tokens_per_rank = handle.num_max_tokens_per_rank
    xr = _check_x(x, device)
    num_topk = _check_topk(topk_idx, topk_weights, xr.num_tokens, device)
    M = _check_sizes(feat, num_experts, num_max_tokens_per_rank, xr, num_topk)
    cpu_sync = handle is None and (do_cpu_sync is None or bool(do_cpu_sync))
    return DispatchArgs(x=xr.x, sf=xr.sf, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens=xr.num_tokens,
                        num_topk=num_topk, num_experts=num_experts, num_max_tokens=M, hidden_bytes=xr.hidden_bytes,
                        x_row_bytes=xr.x_row_bytes, num_sf=xr.num_sf, sf_strides=xr.sf_strides, cpu_sync=cpu_sync)


def _check_cached(feat, handle, topk_idx, expert_alignment: Optional[int]) -> None:
    """A cached dispatch: the handle is this buffer's and the arguments agree with it."""
    from .handle import HybridHandle
    if type(handle) is not HybridHandle:
        raise TypeError(f'handle must be the HybridHandle of a dispatch on this buffer, got '
                        f'{type(handle).__name__}')
    if handle.buffer_id != id(feat):
        raise ValueError('handle comes from another buffer')
    if topk_idx is not None:
        raise ValueError('a cached dispatch (handle given) takes topk_idx from the handle: pass topk_idx=None')
    if expert_alignment is not None and expert_alignment != handle.expert_alignment:
        raise ValueError(f'expert_alignment={expert_alignment} differs from the handle\'s '
                         f'({handle.expert_alignment})')


def _check_x(x, device: int) -> XRows:
    """x: a bfloat16 tensor or an `(x_fp8, sf)` pair; 2-D, contiguous 16-byte aligned rows; 4-byte scales."""
    fp8 = isinstance(x, (tuple, list))
    if fp8 and len(x) != 2:
        raise ValueError('x must be a tensor or a (x_fp8, sf) pair')
    xa, sf = (x[0], x[1]) if fp8 else (x, None)
    xi = tensor_info(xa, 'x')
    _device_check(xi, device, 'x')
    if xi.ndim != 2:
        raise ValueError(f'x must be 2-D [num_tokens, hidden], got shape {xi.shape}')
    if not xi.dtype_matches('float8_e4m3fn' if fp8 else 'bfloat16'):
        raise TypeError(f'x must be {"float8_e4m3fn" if fp8 else "bfloat16"}, got {xi.dtype}')
    T, H = xi.shape
    if H and xi.strides[1] != 1 or (T > 1 and xi.strides[0] < H):
        raise ValueError('x rows must be contiguous')
    hidden_bytes = H * xi.itemsize
    if hidden_bytes % 16:
        raise ValueError(f'hidden * itemsize must be a multiple of 16 bytes, got {hidden_bytes}')
    if xi.ptr % 16 or (T > 1 and xi.strides[0] * xi.itemsize % 16):
        raise ValueError('x rows must start at 16-byte aligned addresses')
    num_sf, sf_strides = 0, (0, 0)
    if fp8:
        si = tensor_info(sf, 'sf')
        _device_check(si, device, 'sf')
        if si.ndim != 2 or si.shape[0] != T:
            raise ValueError(f'sf must be [num_tokens={T}, num_sf], got {si.shape}')
        if si.itemsize != 4:
            raise TypeError(f'sf must hold 4-byte scales (float32, or int32 packed UE8M0), got {si.dtype}')
        num_sf, sf_strides = si.shape[1], (si.strides[0], si.strides[1])
    return XRows(x=xa, sf=sf, num_tokens=T, hidden=H, hidden_bytes=hidden_bytes,
                 x_row_bytes=xi.strides[0] * xi.itemsize, num_sf=num_sf, sf_strides=sf_strides)


def _check_topk(topk_idx, topk_weights, num_tokens: int, device: int) -> int:
    """topk_idx `[T, K]` int64 contiguous (1 <= K <= NUM_MAX_TOPK), topk_weights float32 of its shape; returns K."""
    ti = tensor_info(topk_idx, 'topk_idx')
    _device_check(ti, device, 'topk_idx')
    if ti.dtype != 'int64':
        raise TypeError(f'topk_idx must be int64, got {ti.dtype}')
    if ti.ndim != 2 or ti.shape[0] != num_tokens or not 1 <= ti.shape[1] <= NUM_MAX_TOPK:
        raise ValueError(f'topk_idx must be [num_tokens={num_tokens}, 1..{NUM_MAX_TOPK}], got {ti.shape}')
    if not ti.is_contiguous():
        raise ValueError('topk_idx must be contiguous')
    if topk_weights is not None:
        wi = tensor_info(topk_weights, 'topk_weights')
        _device_check(wi, device, 'topk_weights')
        if wi.dtype != 'float32':
            raise TypeError(f'topk_weights must be float32, got {wi.dtype}')
        if wi.shape != ti.shape or not wi.is_contiguous():
            raise ValueError(f'topk_weights must be contiguous {ti.shape}, got {wi.shape}')
    return ti.shape[1]


def _check_sizes(feat, num_experts: Optional[int], num_max_tokens_per_rank: Optional[int], xr: XRows,
                 num_topk: int) -> int:
    """num_experts, M of the call and the rows against the buffer's; returns M."""
    W = feat.N * feat.R
    if num_experts is None:
        raise ValueError('num_experts is required')
    if num_experts <= 0 or num_experts % W or num_experts // W > NUM_MAX_LOCAL_EXPERTS:
        raise ValueError(f'num_experts ({num_experts}) must be a positive multiple of the number of ranks ({W}), '
                         f'at most {NUM_MAX_LOCAL_EXPERTS} per rank')
    M = feat.M if num_max_tokens_per_rank is None else num_max_tokens_per_rank
    if not isinstance(M, int) or not 1 <= M <= feat.M:
        raise ValueError(f'num_max_tokens_per_rank must be in [1, {feat.M}] (the buffer\'s), got {M!r}')
    if xr.num_tokens > M:
        raise ValueError(f'num_tokens ({xr.num_tokens}) > num_max_tokens_per_rank ({M})')
    K = num_topk
    if hplan.dispatch_row_bytes(K, xr.num_sf, xr.hidden_bytes) > feat.area.row_bytes or K > feat.num_topk:
        raise ValueError(f'hidden {xr.hidden} / top-k {K} / {xr.num_sf} scales exceed the buffer\'s (hidden '
                         f'{feat.hidden}, top-k {feat.num_topk})')
    return M


def check_combine_args(feat, x, handle, bias) -> List[Any]:
    """Check what the intranode combine does not see (the handle's type, the biases); returns the biases."""
    from .handle import HybridHandle
    if type(handle) is not HybridHandle:
        raise TypeError(f'handle must be the HybridHandle of a dispatch on this buffer, got {type(handle).__name__}')
    if handle.buffer_id != id(feat):
        raise ValueError('handle comes from another buffer')
    xi = tensor_info(x, 'x')
    if xi.ndim != 2 or not xi.dtype_matches('bfloat16'):
        raise (TypeError if xi.ndim == 2 else ValueError)(f'combine x must be 2-D bfloat16, got {xi.dtype} {xi.shape}')
    H, K, T = xi.shape[1], handle.topk_idx.shape[1], handle.num_tokens
    if hplan.combine_row_bytes(H, K) > feat.area.row_bytes:
        raise ValueError(f'combine hidden {H} exceeds the buffer\'s ({feat.hidden})')
    if bias is None:
        biases = []
    elif isinstance(bias, (tuple, list)):
        biases = [b for b in bias if b is not None]
        if len(bias) > 2:
            raise ValueError(f'bias: at most 2 tensors, got {len(bias)}')
    else:
        biases = [bias]
    for b in biases:
        bi = tensor_info(b, 'bias')
        if bi.shape != (T, H) or not bi.is_contiguous():
            raise ValueError(f'bias must be contiguous [{T}, {H}], got {bi.shape}')
        if not bi.dtype_matches('bfloat16'):
            raise TypeError(f'bias must be bfloat16, got {bi.dtype}')
    return biases


def check_sorted_combine_args(handle, x, topk_weights) -> None:
    """A combine of a deterministic dispatch's handle moves its input before the intranode combine sees it: check
    here what that one would (rows, contiguity), so that nothing runs on a bad input."""
    rows, K = handle.inner.num_rows, handle.topk_idx.shape[1]
    xi = tensor_info(x, 'x')
    if xi.shape[0] != rows or not xi.is_contiguous():
        raise ValueError(f'x must be contiguous [{rows}, hidden] (the dispatch\'s rows), got {xi.shape}')
    if topk_weights is not None:
        wi = tensor_info(topk_weights, 'topk_weights')
        want = (rows,) if handle.inner.do_expand else (rows, K)
        if not wi.dtype_matches('float32'):
            raise TypeError(f'topk_weights must be float32, got {wi.dtype}')
        if wi.shape != want or not wi.is_contiguous():
            raise ValueError(f'topk_weights must be contiguous {list(want)}, got {wi.shape}')
