"""Torch ↔ CuPy interop: a uniform view of user arrays (pointer, shape, strides, dtype), streams and allocation.

CuPy has no bfloat16 or float8 dtypes, so kernels never need a CuPy view of a torch tensor: they take raw pointers.
`TensorInfo` describes an array of either kind without copying, and `Allocator` makes new arrays of the input's kind
(torch in, torch out; CuPy in, CuPy out). CuPy users hold bfloat16 data as `uint16` arrays and float8 as `uint8`.
"""

import contextlib
import functools
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from . import dtypes

_ITEMSIZE = dtypes.ITEMSIZE
_CUPY_ALIASES = dtypes.CUPY_ALIASES


def itemsize(dtype_name: str) -> int:
    return _ITEMSIZE[dtype_name]


def is_torch(x: Any) -> bool:
    torch = sys.modules.get('torch')
    return torch is not None and isinstance(x, torch.Tensor)


def is_cupy(x: Any) -> bool:
    cupy = sys.modules.get('cupy')
    return cupy is not None and isinstance(x, cupy.ndarray)


@dataclass(slots=True)
class TensorInfo:
    """A zero-copy description of a torch tensor or CuPy array.

    Attributes:
        kind: `'torch'` or `'cupy'`.
        ptr: device address of element 0.
        shape, strides: in elements.
        dtype: canonical name (`'bfloat16'`, `'float8_e4m3fn'`, `'float32'`, ...); for CuPy the numpy name.
        device: CUDA device index, or -1 for host memory.
        obj: the array itself (kept alive by whoever holds this info).
    """
    kind: str
    ptr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    dtype: str
    device: int
    obj: Any

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def dtype_matches(self, name: str) -> bool:
        """Whether this array can hold `name` data (CuPy `uint16` stands for bfloat16, `uint8` for float8)."""
        if self.kind == 'cupy':
            return name in _CUPY_ALIASES.get(self.dtype, (self.dtype,))
        return self.dtype == name


_TORCH_DTYPE_NAMES = {}     # torch.dtype -> canonical name, filled on first sight


def tensor_info(x: Any, name: str = 'tensor') -> TensorInfo:
    """Describe `x` (torch tensor or CuPy array) without copying; `TypeError` naming `name` otherwise."""
    if is_torch(x):
        dtype = _TORCH_DTYPE_NAMES.get(x.dtype)
        if dtype is None:
            dtype = str(x.dtype).replace('torch.', '')
            if dtype not in _ITEMSIZE:
                raise TypeError(f'{name}: unsupported dtype {x.dtype}')
            _TORCH_DTYPE_NAMES[x.dtype] = dtype
        return TensorInfo('torch', x.data_ptr(), tuple(x.shape), x.stride(), dtype, x.get_device(), x)
    if is_cupy(x):
        dtype = np.dtype(x.dtype).name
        if dtype not in _ITEMSIZE:
            raise TypeError(f'{name}: unsupported dtype {x.dtype}')
        strides = tuple(s // x.itemsize for s in x.strides)
        return TensorInfo('cupy', int(x.data.ptr), tuple(x.shape), strides, dtype, x.data.device_id, x)
    raise TypeError(f'{name} must be a torch.Tensor or a cupy.ndarray, got {type(x).__name__}')


def data_ptr(x: Any, name: str = 'tensor') -> int:
    """`x`'s address: a plain torch tensor's in one call (`tensor_info` reads six properties), anything else's
    through `tensor_info` (`TypeError` naming `name` for what is neither torch nor CuPy)."""
    torch = sys.modules.get('torch')
    if torch is not None and type(x) is torch.Tensor:
        return x.data_ptr()
    return tensor_info(x, name).ptr


def shape_of(x: Any, name: str = 'tensor') -> Tuple[int, ...]:
    """`x`'s shape (a torch tensor or CuPy array: no other property is read); `TypeError` naming `name` otherwise,
    or for a dtype `tensor_info` rejects. For adapters that need a size before the checked call."""
    if type(x) is TORCH_TENSOR[0] and x.dtype in _TORCH_DTYPE_NAMES:      # (a plain torch tensor of a known dtype)
        return tuple(x.shape)
    if is_torch(x):
        if x.dtype not in _TORCH_DTYPE_NAMES:
            tensor_info(x, name)            # learns the dtype's name, or raises
        return tuple(x.shape)
    return tensor_info(x, name).shape


def to_cupy(x: Any):
    """A CuPy view of a torch CUDA tensor (DLPack, no copy) or `x` itself if it is CuPy. bfloat16 tensors come out
    as `uint16` and float8 as `uint8` (CuPy has neither dtype)."""
    import cupy
    if is_cupy(x):
        return x
    if is_torch(x):
        import torch
        if x.dtype == torch.bfloat16:
            x = x.view(torch.uint16) if hasattr(torch, 'uint16') else x.view(torch.int16)
        elif x.dtype == torch.float8_e4m3fn:
            x = x.view(torch.uint8)
        elif x.dtype == torch.bool:
            x = x.view(torch.uint8)
        return cupy.from_dlpack(x)
    raise TypeError(f'expected a torch.Tensor or a cupy.ndarray, got {type(x).__name__}')


def to_torch(x: Any, dtype: Optional[str] = None):
    """A torch view of a CuPy array (DLPack, no copy), reinterpreted as `dtype` (e.g. `'bfloat16'`) if given."""
    import torch
    if is_torch(x):
        return x if dtype is None else x.view(getattr(torch, dtype))
    t = torch.from_dlpack(x)
    return t if dtype is None else t.view(getattr(torch, dtype))


def current_stream(like: Any = None):
    """The stream kernels for `like` run on, as a `cupy.cuda.Stream`-like object: torch's current stream when `like`
    is a torch tensor (or None and torch has initialised CUDA), else CuPy's current stream."""
    f = _CURRENT_STREAM_OF.get(type(like))      # a torch tensor or CuPy array type seen before: one call
    if f is not None:
        return f(like)
    import cupy
    torch = sys.modules.get('torch')
    use_torch = is_torch(like) or (like is None and torch is not None and torch.cuda.is_initialized())
    if use_torch:
        # The raw handle straight from torch's C API (torch.cuda.current_stream() costs ~10 us of Python per call,
        # a hot-path cost when every collective call asks twice); the public API where the C one is missing.
        raw = getattr(torch._C, '_cuda_getCurrentRawStream', None)
        if raw is not None:
            if like is not None and type(like) is torch.Tensor:
                _CURRENT_STREAM_OF[type(like)] = _torch_current_stream(torch, raw)
            device = like.get_device() if is_torch(like) and like.is_cuda else torch._C._cuda_getDevice()
            return external_stream(raw(device))
        return external_stream(torch.cuda.current_stream().cuda_stream)
    if is_cupy(like):
        _CURRENT_STREAM_OF[type(like)] = lambda x, get=cupy.cuda.get_current_stream: get()
    return cupy.cuda.get_current_stream()


_CURRENT_STREAM_OF = {}      # array type -> its `current_stream` (learned on first sight; not for None)


def _torch_current_stream(torch, raw):
    """`current_stream(t)` for a torch tensor `t`: its device's current stream (the current device's for a CPU
    tensor) without the type checks."""
    cache, get_device = _EXTERNAL_STREAMS, torch._C._cuda_getDevice

    def current(t):
        device = t.get_device()
        handle = raw(device if device >= 0 else get_device())
        s = cache.get(handle)
        return s if s is not None else external_stream(handle)
    return current


def stream_getter(kind: str, device: int):
    """A function returning what `current_stream(like)` returns for arrays of `kind` on `device`, without looking
    at the array (hot paths resolve it once per call signature)."""
    if kind == 'torch' and device >= 0:
        torch = sys.modules['torch']
        raw = getattr(torch._C, '_cuda_getCurrentRawStream', None)
        if raw is None:
            return lambda: external_stream(torch.cuda.current_stream(device).cuda_stream)
        cache = _EXTERNAL_STREAMS

        def get():
            handle = raw(device)
            s = cache.get(handle)
            return s if s is not None else external_stream(handle)
        return get
    import cupy
    return cupy.cuda.get_current_stream


_EXTERNAL_STREAMS = {}


def external_stream(handle: int):
    """A cached `cupy.cuda.ExternalStream` for a raw `cudaStream_t` value."""
    import cupy
    s = _EXTERNAL_STREAMS.get(handle)
    if s is None:
        # Stream.from_external wants an object with __cuda_stream__; a raw handle still needs ExternalStream.
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', DeprecationWarning)
            s = _EXTERNAL_STREAMS[handle] = cupy.cuda.ExternalStream(handle)
    return s


_TORCH_STREAMS = {}


def torch_stream(handle: int):
    """A cached `torch.cuda.ExternalStream` for a raw `cudaStream_t` value (the buffers' streams live as long as the
    process: they come from a pool and are never destroyed). Handle 0 (the legacy default stream) is torch's default
    stream of the current device: torch takes `ExternalStream(0)` for "no handle" and hands out a stream of its pool,
    unordered with the default stream (torch 2.11)."""
    if handle == 0:
        import torch
        return torch.cuda.default_stream()
    s = _TORCH_STREAMS.get(handle)
    if s is None:
        import torch
        s = _TORCH_STREAMS[handle] = torch.cuda.ExternalStream(handle)
    return s


class Allocator:
    """Allocates arrays of one kind (`'torch'` or `'cupy'`) on the current device; `stream` (a `cupy` stream) is the
    stream the allocation is ordered on (torch's caching allocator is told through `torch.cuda.stream`)."""

    def __init__(self, kind: str):
        assert kind in ('torch', 'cupy'), kind
        self.kind = kind

    def empty(self, shape, dtype: str, stream=None):
        if self.kind == 'torch':
            torch = sys.modules['torch']
            if stream is None:
                return torch.empty(shape, dtype=getattr(torch, dtype), device='cuda')
            with torch.cuda.stream(torch_stream(stream.ptr)):
                return torch.empty(shape, dtype=getattr(torch, dtype), device='cuda')
        import cupy
        np_dtype = dtypes.cupy_storage(dtype)
        if stream is None:
            return cupy.empty(shape, dtype=np_dtype)
        with stream:
            return cupy.empty(shape, dtype=np_dtype)

    def zeros(self, shape, dtype: str, stream=None):
        x = self.empty(shape, dtype, stream)
        if self.kind == 'torch':
            import torch
            ctx = torch.cuda.stream(torch_stream(stream.ptr)) if stream is not None else None
            with ctx or contextlib.nullcontext():
                x.zero_()
        else:
            with stream if stream is not None else contextlib.nullcontext():
                x.fill(0)
        return x


# ---- hot paths: call signatures and carved allocations --------------------------------------------------------------
_META = {}      # array type -> function(x) -> (signature, pointer)
# [torch.Tensor] once `meta` saw a torch tensor ([a private class] before: matches nothing), for hot paths that inline
# `meta` of plain torch tensors
TORCH_TENSOR = [type('_NoTorchYet', (), {})]


def _none_meta(x):
    return None, 0


def _torch_meta(x):
    # (hot paths inline this for `type(x) is TORCH_TENSOR[0]`: keep them in step)
    return (x.shape, x.stride(), x.dtype, x.get_device()), x.data_ptr()


def _cupy_meta(x):
    return ('cupy', x.shape, x.strides, x.dtype, x.data.device_id), x.data.ptr


def meta(x: Any) -> Tuple[Any, int]:
    """`(signature, pointer)` of `x`: the signature (kind, shape, strides, dtype, device; hashable) decides every
    argument check `tensor_info` feeds, so a hot path checks a signature once and caches what it derived; the pointer
    is the per-call part. `(None, 0)` for None; for anything that is not a torch tensor or a CuPy array, a fresh
    `object()` as the signature (it matches nothing cached; the caller's checked path then raises)."""
    f = _META.get(type(x))
    if f is None:
        t = type(x)
        torch, cupy = sys.modules.get('torch'), sys.modules.get('cupy')
        if x is None:
            f = _none_meta
        elif torch is not None and issubclass(t, torch.Tensor):
            f = _torch_meta
            TORCH_TENSOR[0] = torch.Tensor
        elif cupy is not None and issubclass(t, cupy.ndarray):
            f = _cupy_meta
        else:
            return object(), 0
        _META[t] = f
    return f(x)


@functools.lru_cache(maxsize=1024)
def contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """Element strides of a C-contiguous array of `shape` (cached per shape: hot paths build views with
    `as_strided`)."""
    steps, step = [], 1
    for n in reversed(shape):
        steps.append(step)
        step *= n
    return tuple(reversed(steps))


class Carver:
    """Allocation for hot paths: arrays of one kind on one device (-1: host memory, as CPU tests use), with the dtype
    and device objects resolved once, and views carved out of one int32 allocation (`words` / `view`) so that a call's
    small outputs cost one allocation.

    Args:
        kind: `'torch'` or `'cupy'`.
        device: the CUDA device (-1: host; torch only).
    """

    def __init__(self, kind: str, device: int):
        self.kind = kind
        if kind == 'torch':
            import torch
            self._torch = torch
            self._device = torch.device('cuda', device) if device >= 0 else torch.device('cpu')
            self._dtypes = {}
        else:
            import cupy
            self._cupy = cupy

    def _dtype(self, name: str):
        dt = self._dtypes.get(name)
        if dt is None:
            dt = self._dtypes[name] = getattr(self._torch, name)
        return dt

    def empty(self, shape, dtype: str, stream=None):
        """`[*shape]` of `dtype` (canonical name); `stream`: order the allocation on it (None: the current stream)."""
        if self.kind == 'torch':
            torch = self._torch
            dt = self._dtypes.get(dtype) or self._dtype(dtype)
            if stream is None:
                return torch.empty(shape, dtype=dt, device=self._device)
            with torch.cuda.stream(torch_stream(stream.ptr)):
                return torch.empty(shape, dtype=dt, device=self._device)
        cupy = self._cupy
        if stream is None:
            return cupy.empty(shape, dtype=dtypes.cupy_storage(dtype))
        with stream:
            return cupy.empty(shape, dtype=dtypes.cupy_storage(dtype))

    def allocator(self, shape, dtype: str):
        """A function of no arguments making what `empty(shape, dtype)` makes (on the current stream): a partial of
        torch.empty / cupy.empty, so that a hot path with a fixed output layout allocates without a Python frame."""
        if self.kind == 'torch':
            return functools.partial(self._torch.empty, shape, dtype=self._dtype(dtype), device=self._device)
        return functools.partial(self._cupy.empty, shape, dtype=dtypes.cupy_storage(dtype))

    def words(self, num_words: int, stream=None):
        """One int32 allocation to carve views from (`view`)."""
        return self.empty((max(2, num_words),), 'int32', stream)

    def ptr(self, x) -> int:
        return x.data_ptr() if self.kind == 'torch' else x.data.ptr

    def as_words(self, base):
        """`base` (a 1-D allocation of whole int32 words) as int32 where views need it (torch; CuPy views take the
        address): several int32 views of one allocation then share one typed view."""
        if self.kind == 'torch' and base.dtype is not self._torch.int32:
            return base.view(self._torch.int32)
        return base

    def view(self, base, dtype: str, shape: Tuple[int, ...], word_offset: int,
             strides: Optional[Tuple[int, ...]] = None):
        """A `[*shape]` view of `dtype` (1, 2, 4 or 8 bytes; 8 at an even `word_offset`) into `base` (a 1-D
        allocation of any dtype whose size is a whole number of int32 words, e.g. `words`) from int32 word
        `word_offset`; `strides` in elements (None: C-contiguous)."""
        size = _ITEMSIZE[dtype]
        if strides is None:
            strides = contiguous_strides(shape)
        if self.kind == 'torch':
            dt = self._dtypes.get(dtype) or self._dtype(dtype)
            typed = base if base.dtype is dt else base.view(dt)
            return typed.as_strided(shape, strides, word_offset * 4 // size)
        return self._cupy.ndarray(shape, dtype=dtypes.cupy_storage(dtype), memptr=base.data + word_offset * 4,
                                  strides=tuple(s * size for s in strides))
