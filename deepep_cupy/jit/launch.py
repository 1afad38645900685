"""Typed, named kernel launches.

Every kernel is declared once with its parameter list (`Param(name, 'ptr')` or a numpy dtype), in the order of the
C++ signature. A loaded `Kernel` is launched by parameter name:

    kernel.launch(grid, block, stream=s, x=x_ptr, hidden=7168, ...)

Its `launch` (and `prepare`) is generated once from the declaration with one keyword-only parameter per kernel
parameter, so CPython binds the arguments and a missing, extra or misspelled name raises `TypeError`; the values are
then packed positionally (one `struct.pack_into` into a preallocated buffer, then `cuLaunchKernel`). The launcher
converts each argument to its exact type (CuPy would pass a Python `int` as 64-bit and a `float` as double without
complaint), checks cooperative grids against co-residency (CuPy would not) and raises the dynamic shared-memory limit
explicitly when a launch needs more than 48 KiB.
"""

import functools
import keyword
import struct
import threading
import types
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from . import compiler

PTR = 'ptr'
_SMEM_DEFAULT_LIMIT = 48 * 1024
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


@dataclass(frozen=True)
class Param:
    """One kernel parameter: `kind` is `'ptr'` (a device address) or a numpy scalar type (`np.int32`, ...)."""
    name: str
    kind: Union[str, type]


@dataclass(frozen=True)
class KernelSpec:
    """A kernel: its family (`.cu` file), the C++ name expression that instantiates it, and its parameters."""
    family: str
    name: str
    params: Tuple[Param, ...]

    @property
    def param_names(self) -> Tuple[str, ...]:
        return tuple(p.name for p in self.params)


# Keywords of `launch` / `prepare` themselves; no kernel parameter may take these names.
_LAUNCH_KEYWORDS = ('grid', 'block', 'stream', 'shared_mem', 'cooperative')


@functools.lru_cache(maxsize=None)
def _named_code(names: Tuple[str, ...], with_stream: bool):
    """The code of `(grid, block, *, [stream=None,] shared_mem=0, cooperative=False, <names>)` that calls
    `_call(grid, block, (<names>,), [stream,] shared_mem, cooperative)`; compiled once per parameter list."""
    for n in names:
        if not n.isidentifier() or keyword.iskeyword(n) or n in _LAUNCH_KEYWORDS or n == '_call':
            raise ValueError(f'kernel parameter name {n!r} cannot be a launch keyword')
    if len(set(names)) != len(names):
        raise ValueError(f'duplicate kernel parameter names in {names}')
    values = f'({", ".join(names)},)' if names else '()'
    stream = ('stream=None, ', 'stream, ') if with_stream else ('', '')
    params = ''.join(', ' + n for n in names)
    src = (f'def launch(grid, block, *, {stream[0]}shared_mem=0, cooperative=False{params}):\n'
           f'    return _call(grid, block, {values}, {stream[1]}shared_mem, cooperative)\n')
    namespace = {}
    exec(compile(src, f'<launcher of {len(names)} parameters>', 'exec'), namespace)
    fn = namespace['launch']
    return fn.__code__, fn.__kwdefaults__


def named_launcher(spec: KernelSpec, call: Callable, with_stream: bool = True, what: str = 'launch') -> Callable:
    """A function taking `(grid, block, *, stream=None, shared_mem=0, cooperative=False, **params)` with exactly
    `spec`'s parameter names as keyword-only arguments, which calls `call(grid, block, args, stream, shared_mem,
    cooperative)` with `args` in declaration order (`with_stream=False`: no `stream` keyword, and `call` gets none).
    CPython does the binding: a missing, extra or misspelled name raises `TypeError` naming the kernel."""
    code, kwdefaults = _named_code(spec.param_names, with_stream)
    fn = types.FunctionType(code, {'_call': call}, what)
    fn.__kwdefaults__ = dict(kwdefaults)
    fn.__qualname__ = f'{spec.name}.{what}'
    fn.__doc__ = f'{what} {spec.name}({", ".join(spec.param_names)}) by parameter name.'
    return fn


def _to_ptr(value, param: Param, kernel: str) -> np.uint64:
    if isinstance(value, (bool, float)) or value is None:
        raise TypeError(f'{kernel}: argument {param.name!r} must be a device pointer, got {value!r}')
    if isinstance(value, (int, np.integer)):
        return np.uint64(int(value))
    ptr = getattr(value, 'data_ptr', None)
    if callable(ptr):      # torch tensor
        return np.uint64(ptr())
    data = getattr(value, 'data', None)
    if data is not None and hasattr(data, 'ptr'):   # cupy ndarray
        return np.uint64(data.ptr)
    if hasattr(value, 'ptr'):   # cupy MemoryPointer and friends
        return np.uint64(value.ptr)
    raise TypeError(f'{kernel}: argument {param.name!r} must be a device pointer, got {type(value).__name__}')


# Pointer extraction by exact argument type, learned on first sight (a dict lookup and one call per pointer on the
# launch path instead of a chain of isinstance / getattr checks, which cost ~1 µs per argument on slow hosts).
_PTR_GETTERS = {type(None): lambda v: 0}


def _slow_ptr(value, param: Param, kernel: str) -> int:
    ptr = int(_to_ptr(value, param, kernel))
    t = type(value)
    if getattr(t, '__module__', '').startswith('torch') and callable(getattr(value, 'data_ptr', None)):
        _PTR_GETTERS[t] = t.data_ptr
    elif t.__name__ == 'ndarray' and getattr(t, '__module__', '').startswith('cupy'):
        _PTR_GETTERS[t] = lambda v: v.data.ptr
    return ptr


def _to_scalar(value, param: Param, kernel: str):
    kind = np.dtype(param.kind)
    if isinstance(value, np.generic):
        if value.dtype != kind:
            raise TypeError(f'{kernel}: argument {param.name!r} must be {kind.name}, got {value.dtype.name}')
        return value
    if kind.kind in 'iu':
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f'{kernel}: argument {param.name!r} must be an integer ({kind.name}), got {value!r}')
        info = np.iinfo(kind)
        if not info.min <= int(value) <= info.max:
            raise ValueError(f'{kernel}: argument {param.name!r}={value} does not fit in {kind.name}')
        return kind.type(value)
    if kind.kind == 'f':
        if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
            raise TypeError(f'{kernel}: argument {param.name!r} must be a number ({kind.name}), got {value!r}')
        return kind.type(value)
    raise TypeError(f'{kernel}: unsupported parameter kind {kind} for {param.name!r}')


def _converter(param: Param, kernel: str):
    """A fast converter for one parameter: plain Python ints (the common case) take a short path with a cached
    range; everything else goes through the full checks above."""
    if param.kind == PTR:
        def ptr(value, _uint64=np.uint64):
            if type(value) is int and value >= 0:
                return _uint64(value)
            return _to_ptr(value, param, kernel)
        return ptr
    kind = np.dtype(param.kind)
    if kind.kind in 'iu':
        info = np.iinfo(kind)
        lo, hi, typ = int(info.min), int(info.max), kind.type

        def integer(value):
            if type(value) is int and lo <= value <= hi:
                return typ(value)
            return _to_scalar(value, param, kernel)
        return integer
    return lambda value: _to_scalar(value, param, kernel)


def converters_for(spec: KernelSpec) -> Tuple:
    return tuple(_converter(p, spec.name) for p in spec.params)


def pack_args(spec: KernelSpec, args: Sequence, converters: Optional[Tuple] = None) -> Tuple:
    """Convert launch arguments to their exact types, checking count and kinds (`converters`: from
    `converters_for(spec)`, cached by the caller; hashing a spec per launch costs more than the conversion)."""
    if converters is None:
        converters = converters_for(spec)
    if len(args) != len(converters):
        names = [p.name for p in spec.params]
        raise TypeError(f'{spec.name}: expected {len(spec.params)} arguments {names}, got {len(args)}')
    return tuple(c(a) for c, a in zip(converters, args))


_STRUCT_CODES = {'int8': 'b', 'uint8': 'B', 'int16': 'h', 'uint16': 'H', 'int32': 'i', 'uint32': 'I', 'int64': 'q',
                 'uint64': 'Q', 'float32': 'f', 'float64': 'd'}


def arg_struct(spec: KernelSpec) -> Tuple[struct.Struct, Tuple[int, ...]]:
    """The C layout of a kernel's parameters: each at its natural alignment (pointers as 8-byte integers), and the
    byte offset of each, for `cuLaunchKernel`'s array of parameter pointers."""
    fmt, offsets, offset = ['='], [], 0
    for p in spec.params:
        code = 'Q' if p.kind == PTR else _STRUCT_CODES[np.dtype(p.kind).name]
        size = struct.calcsize('=' + code)
        pad = (-offset) % size
        fmt.append('x' * pad + code)
        offset += pad
        offsets.append(offset)
        offset += size
    return struct.Struct(''.join(fmt)), tuple(offsets)


class _ArgBuffer:
    """Parameter storage for one launch and the array of pointers to each parameter."""

    def __init__(self, layout: struct.Struct, offsets: Tuple[int, ...], round_to: int = 1):
        self.data = np.zeros(max(8, -(-layout.size // round_to) * round_to), dtype=np.uint8)
        base = self.data.ctypes.data
        self.pointers = np.array([base + o for o in offsets] or [0], dtype=np.uint64)
        self.pointers_addr = self.pointers.ctypes.data


class BoundLaunch:
    """One launch whose arguments live in a preallocated block, packed and checked once by name (`Kernel.bind`);
    hot paths then patch only the arguments that change, through typed views of the block, and call it with a
    stream.

    Why positional patching: a named launch binds every keyword and packs every argument on each call (~60 ns per
    argument in CPython plus the packing); a dispatch changes a handful of pointers per call. `index(name)` gives a
    parameter's word index in the view matching its type (`u64` for pointers and uint64, `i64`, `i32`, `u32`, `f32`),
    resolved once by name, so the patching stays name-checked: `bl.u64[bl.index('x')] = x_ptr`. The views enforce
    the C type (a negative pointer, an int32 out of range or a float for an integer raise).

    Kernels copy their parameters when launched (also into a captured CUDA graph), so a block may be re-patched right
    after a launch. The grid may be re-set between launches (`grid = (x, y, z)` or `set_grid`); block and shared
    memory are fixed at binding. Not thread-safe (as the buffers are not).
    """

    __slots__ = ('spec', '_grid', 'block', 'shared_mem', 'cooperative', 'data', 'pointers_addr', 'u64', 'i64', 'i32',
                 'u32', 'f32', '_index', '_go', '_keep', '_direct', '_coop', '_fast', '_fast_coop')

    def __init__(self, spec: KernelSpec, layout: struct.Struct, offsets: Tuple[int, ...], grid, block,
                 shared_mem: int, cooperative: bool, go: Callable[['BoundLaunch', object], None],
                 direct: Optional[Tuple[Callable, int]] = None):
        self.spec = spec
        self._fast = None
        self._grid, self.block = _dim3(grid), _dim3(block)
        self.shared_mem, self.cooperative = shared_mem, cooperative
        buffer = _ArgBuffer(layout, offsets, round_to=8)
        self._keep = buffer
        self.data, self.pointers_addr = buffer.data, buffer.pointers_addr
        raw = memoryview(buffer.data).cast('B')
        self.u64, self.i64 = raw.cast('Q'), raw.cast('q')
        self.i32, self.u32, self.f32 = raw.cast('i'), raw.cast('I'), raw.cast('f')
        index = {}
        for p, offset in zip(spec.params, offsets):
            size = 8 if p.kind == PTR else np.dtype(p.kind).itemsize
            index[p.name] = offset // size
        self._index = index
        self._go = go
        # (cuLaunchKernel's binding, function): a plain launch on a given stream calls it straight from `__call__`
        # (three Python frames fewer per launch); None: every launch goes through `go`.
        self._direct = None if cooperative else direct
        self._set_fast()
        # Cooperative: (cuLaunchCooperativeKernel's binding, function) when launches may call it straight, else None;
        # `_fast_coop` is then its partial for the current grid once `Kernel._check_launch` passed it (the
        # co-residency check is a function of the grid, block and shared memory; a new grid clears it).
        self._coop = None
        self._fast_coop = None

    def index(self, name: str) -> int:
        """Word index of parameter `name` in the view of its type (`KeyError` naming the kernel if unknown)."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f'{self.spec.name} has no parameter {name!r}') from None

    @property
    def grid(self) -> Tuple[int, int, int]:
        return self._grid

    @grid.setter
    def grid(self, grid) -> None:
        # (a 3-tuple as the hot paths set it; `set_grid` normalises other forms). An unchanged grid keeps its partial
        # (and its object, which the cooperative launch's check compares by identity): some calls set it every time.
        if grid != self._grid:
            self._grid = grid
            self._set_fast()

    def set_grid(self, grid) -> None:
        self.grid = _dim3(grid)

    def _set_fast(self) -> None:
        """The direct launch with everything but the stream and the argument block bound (a `functools.partial`: a
        launch then passes three values instead of unpacking the grid and block per call). A cooperative launch's
        waits for the check of its grid (`Kernel._go_bound`)."""
        self._fast_coop = None
        d = self._direct
        if d is None:
            self._fast = None
            return
        g, b = self._grid, self.block
        self._fast = functools.partial(d[0], d[1], g[0], g[1], g[2], b[0], b[1], b[2], self.shared_mem)

    def values(self) -> Dict[str, object]:
        """The packed arguments by name (for tests and fakes)."""
        layout, _ = arg_struct(self.spec)
        return dict(zip(self.spec.param_names, layout.unpack_from(self.data)))

    def __call__(self, stream) -> None:
        """Launch on `stream` (a stream object with `.ptr`, or None for CuPy's current stream)."""
        if stream is not None:
            fast = self._fast
            if fast is not None:
                fast(stream.ptr, self.pointers_addr, 0)
                return
            fast = self._fast_coop
            if fast is not None:
                fast(stream.ptr, self.pointers_addr)
                return
        self._go(self, stream)


class Kernel:
    """A loaded kernel bound to one device. Call `launch(grid, block, stream=..., shared_mem=..., **params)` with every
    kernel parameter by name, or `prepare(grid, block, **params)` for a launch whose arguments never change.

    Launches go straight to `cuLaunchKernel` with the parameters packed by one `struct.pack_into` (a few µs from
    Python); any argument `struct` rejects is re-checked by `pack_args` for a clear error."""

    def __init__(self, spec: KernelSpec, function, device: int):
        self.spec = spec
        self.function = function
        self.device = device
        self._smem_limit = _SMEM_DEFAULT_LIMIT
        self._num_sms = None
        self._capacity = {}
        self._converters = converters_for(spec)
        self._struct, self._offsets = arg_struct(spec)
        self._ptr_params = tuple(i for i, p in enumerate(spec.params) if p.kind == PTR)
        self._scratch = _ArgBuffer(self._struct, self._offsets)
        self.launch = named_launcher(spec, self.launch_args)
        self.prepare = named_launcher(spec, self.prepare_args, with_stream=False, what='prepare')
        self.bind = named_launcher(spec, self.bind_args, with_stream=False, what='bind')

    def max_active_blocks_per_sm(self, block: int, shared_mem: int = 0) -> int:
        from cupy_backends.cuda.api import driver
        return driver.occupancyMaxActiveBlocksPerMultiprocessor(self.function.ptr, block, shared_mem)

    def co_resident_blocks(self, num_threads: int, shared_mem: int = 0) -> int:
        """The largest cooperative grid: blocks of `num_threads` threads and `shared_mem` bytes resident at once."""
        self._allow_smem(shared_mem)
        capacity = self._capacity.get((num_threads, shared_mem))
        if capacity is None:
            if self._num_sms is None:
                import cupy
                self._num_sms = cupy.cuda.Device(self.device).attributes['MultiProcessorCount']
            capacity = self.max_active_blocks_per_sm(num_threads, shared_mem) * self._num_sms
            self._capacity[(num_threads, shared_mem)] = capacity
        return capacity

    def _allow_smem(self, shared_mem: int) -> None:     # (before an occupancy query or a launch that needs it)
        if shared_mem > self._smem_limit:
            _driver().funcSetAttribute(self.function.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem)
            self._smem_limit = shared_mem

    def _pack_into(self, buffer: _ArgBuffer, args: Sequence) -> None:
        if len(args) != len(self._converters):
            pack_args(self.spec, args, self._converters)     # raises with the expected parameter names
        values = list(args)
        getters = _PTR_GETTERS
        for i in self._ptr_params:
            v = values[i]
            t = type(v)
            if t is not int:
                get = getters.get(t)
                values[i] = get(v) if get is not None else _slow_ptr(v, self.spec.params[i], self.spec.name)
        try:
            self._struct.pack_into(buffer.data, 0, *values)
        except (struct.error, TypeError) as e:
            pack_args(self.spec, args, self._converters)     # raises the detailed TypeError / ValueError
            raise TypeError(f'{self.spec.name}: bad launch arguments: {e}') from e

    def _check_launch(self, grid: Tuple[int, ...], block: Tuple[int, ...], shared_mem: int, cooperative: bool):
        self._allow_smem(shared_mem)
        if cooperative:
            capacity = self.co_resident_blocks(block[0] * block[1] * block[2], shared_mem)
            num_blocks = grid[0] * grid[1] * grid[2]
            if num_blocks > capacity:
                raise ValueError(f'{self.spec.name}: cooperative grid of {num_blocks} blocks exceeds the '
                                 f'{capacity} blocks that can be co-resident on this device')

    def _go(self, grid, block, shared_mem: int, cooperative: bool, stream, buffer: _ArgBuffer):
        driver = _driver()
        if stream is None:
            import cupy
            stream = cupy.cuda.get_current_stream()
        if cooperative:
            driver.launchCooperativeKernel(self.function.ptr, grid[0], grid[1], grid[2], block[0], block[1],
                                           block[2], shared_mem, stream.ptr, buffer.pointers_addr)
        else:
            driver.launchKernel(self.function.ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                shared_mem, stream.ptr, buffer.pointers_addr, 0)

    def launch_args(self, grid, block, args: Sequence, stream=None, shared_mem: int = 0, cooperative: bool = False):
        """Launch with the arguments in declaration order (what the named `launch` calls)."""
        grid, block = _dim3(grid), _dim3(block)
        self._pack_into(self._scratch, args)
        self._check_launch(grid, block, shared_mem, cooperative)
        self._go(grid, block, shared_mem, cooperative, stream, self._scratch)

    def prepare_args(self, grid, block, args: Sequence, shared_mem: int = 0, cooperative: bool = False):
        """Check and pack a launch once (arguments in declaration order); returns `launch(stream)` for hot paths whose
        arguments never change. The named `prepare` calls it."""
        grid, block = _dim3(grid), _dim3(block)
        buffer = _ArgBuffer(self._struct, self._offsets)
        self._pack_into(buffer, args)
        self._check_launch(grid, block, shared_mem, cooperative)
        return lambda stream: self._go(grid, block, shared_mem, cooperative, stream, buffer)

    def bind_args(self, grid, block, args: Sequence, shared_mem: int = 0, cooperative: bool = False) -> BoundLaunch:
        """A `BoundLaunch` of these arguments (declaration order; the named `bind` calls it): checked and packed once,
        patched per call by the hot paths."""
        # The direct launch unless this kernel's bound launches are intercepted (a test's `_go_bound` override).
        direct = None if '_go_bound' in self.__dict__ else (_driver().launchKernel, self.function.ptr)
        bound = BoundLaunch(self.spec, self._struct, self._offsets, grid, block, shared_mem, cooperative,
                            self._go_bound, direct)
        self._pack_into(bound._keep, args)
        self._check_launch(bound.grid, bound.block, shared_mem, cooperative)
        if cooperative and direct is not None:
            bound._coop = (_driver().launchCooperativeKernel, self.function.ptr)
            bound._fast_coop = _coop_partial(bound)
        return bound

    def _go_bound(self, bound: BoundLaunch, stream) -> None:
        if bound.cooperative:
            # A grid patched after binding must still be co-resident.
            self._check_launch(bound.grid, bound.block, bound.shared_mem, True)
            if bound._coop is not None:
                bound._fast_coop = _coop_partial(bound)
            self._go(bound.grid, bound.block, bound.shared_mem, True, stream, bound._keep)
            return
        if stream is None:
            import cupy
            stream = cupy.cuda.get_current_stream()
        g, b = bound.grid, bound.block
        _driver().launchKernel(self.function.ptr, g[0], g[1], g[2], b[0], b[1], b[2], bound.shared_mem, stream.ptr,
                               bound.pointers_addr, 0)


def _coop_partial(bound: BoundLaunch) -> Callable:
    """The cooperative launch of `bound` with everything but the stream and the argument block bound (its grid, block
    and shared memory just checked)."""
    (launch, function), g, b = bound._coop, bound.grid, bound.block
    return functools.partial(launch, function, g[0], g[1], g[2], b[0], b[1], b[2], bound.shared_mem)


_DRIVER = []


def _driver():
    """cupy's driver API module (imported once: an import statement on every launch costs ~1 µs)."""
    if not _DRIVER:
        from cupy_backends.cuda.api import driver
        _DRIVER.append(driver)
    return _DRIVER[0]


def _dim3(dims) -> Tuple[int, int, int]:
    if type(dims) is int and dims >= 1:        # the common case, kept cheap: launches sit on hot paths
        return dims, 1, 1
    dims = (dims,) if isinstance(dims, (int, np.integer)) else tuple(dims)
    if not 1 <= len(dims) <= 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f'launch dimensions must be 1 to 3 positive integers, got {dims}')
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


_lock = threading.Lock()
_loaded: Dict[Tuple, Kernel] = {}


def load_kernels(specs: Sequence[KernelSpec], defines: Optional[Dict[str, object]] = None,
                 device: Optional[int] = None) -> Dict[str, Kernel]:
    """Compile (disk-cached) and load every kernel of `specs` on `device`; all specs must share one family.
    Memoised in-process, so asking again is a dictionary lookup.

    Returns:
        dict from each spec's name expression to its `Kernel`.
    """
    import cupy
    if not specs:
        return {}
    family = specs[0].family
    if any(s.family != family for s in specs):
        raise ValueError('load_kernels: all specs must belong to one kernel family')
    device = cupy.cuda.Device().id if device is None else device
    defines = dict(defines or {})
    key = (device, family, tuple(s.name for s in specs), tuple(sorted(defines.items())))
    with _lock:
        cached = [_loaded.get(key + (s.name,)) for s in specs]
        if all(k is not None for k in cached):
            return {s.name: k for s, k in zip(specs, cached)}
        with cupy.cuda.Device(device):
            compiled = compiler.compile_cubin(family, [s.name for s in specs], arch=compiler.device_arch(device),
                                              defines=defines)
            module = cupy.cuda.function.Module()
            module.load(compiled.cubin)
            out = {}
            for s in specs:
                kernel = Kernel(s, module.get_function(compiled.lowered[s.name]), device)
                kernel._module = module   # the module must outlive its functions
                _loaded[key + (s.name,)] = out[s.name] = kernel
        return out


def load_kernel(spec: KernelSpec, defines: Optional[Dict[str, object]] = None, device: Optional[int] = None) -> Kernel:
    return load_kernels([spec], defines, device)[spec.name]
