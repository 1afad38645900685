"""All-gather sessions, reduce-scatter and all-reduce inside one NVLink domain (`kernels_cu/agrs.cu`).

`AGRSMixin` gives a deepep_cupy buffer DeepEP V2's all-gather session API (`agrs_set_config`, `create_agrs_session` /
`destroy_agrs_session` / `agrs_new_session`, `agrs_get_inplace_tensor`, `all_gather`) and V2.5 BucketBuffer-style
`reduce_scatter` / `all_reduce`. Copies are SM-driven NVLink stores (upstream uses copy engines); every wait is
bounded. The host bookkeeping (session regions, epochs, reduction layout, grids) and the bitwise references of the
reductions are plain Python below, so they can be tested without a GPU.

Memory: the data region holds the session area `[0, num_max_session_bytes)` and, after it (4 KiB aligned), the
reduction area; see the protocol comment at the top of `kernels_cu/agrs.cu`. Sessions are sequential (one open at a
time); a session holds at most `num_max_all_gathers_per_session` (<= 32) gathered tensors. Reductions never touch the
session area, so they may run while a session is open.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .constants import BUFFER_ALIGNMENT, NUM_MAX_SCALEUP_RANKS
from .jit.launch import PTR, KernelSpec, Param, load_kernels
from .validation import check_int

# Workspace bytes [CTRL_OFFSET, CTRL_OFFSET + CTRL_BYTES) hold this feature's control words (kernels_cu/agrs.cu).
CTRL_OFFSET = 24576
CTRL_BYTES = 4096
THREADS = 512                   # kAgrsThreads
GATHER_UNROLL = 4               # kAgrsGatherUnroll
REGION_ALIGNMENT = 32           # each gather region is align(R * num_bytes, 32)
REDUCE_AREA_ALIGNMENT = 4096    # the reduction area starts at align(num_max_session_bytes, 4096)
MAX_GATHERS_PER_SESSION = 32    # kAgrsMetaSlots: a session never spans more gather epochs than meta slots
MAX_SENDERS = 32                # kAgrsMaxSenders
MAX_ROUNDS = 65535              # rounds per sender block (chunk flags hold (epoch << 32) + round + 1)
GROUP_ELEMS = 8                 # reductions work on groups of 8 elements; shards start at multiples of 8
CHUNK_MIN_ELEMS, CHUNK_MAX_ELEMS = 2048, 32768
DEFAULT_GATHER_SMS = 32
DEFAULT_REDUCE_SMS = 64
SENDER_SHARE = (1, 2)           # share of a reduction's blocks that send (at most MAX_SENDERS); the rest reduce
# `aux` of an error record (kernels_cu/agrs.cu): which wait gave up.
AUX_NAMES = {1: 'all-gather signal', 2: 'all-gather size mismatch (ranks gathered different sizes)',
             3: 'reduction slots free (previous reduction done)', 4: 'reduce-scatter chunk', 5: 'all-reduce shard'}
COMM_PRECISIONS = ('fp32', 'bf16')


def align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# ---- kernel declarations ------------------------------------------------------------------------------------------
_P = Param
_ERR = (_P('error_record', PTR), _P('timeout_ns', np.uint64))
# (input bfloat16, staging bfloat16) pairs the reduce kernel is instantiated for.
REDUCE_VARIANTS = ((False, False), (False, True), (True, True))


def _b(flag: bool) -> str:
    return 'true' if flag else 'false'


def gather_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('agrs', f'deepep::agrs_gather_kernel<{num_ranks}>', (
        _P('src', PTR), _P('num_bytes', np.int64), _P('region_offset', np.uint64), _P('peer_bases', PTR),
        _P('rank', np.int32), _P('write_local', np.int32), _P('do_signal', np.int32), _P('epoch', np.uint32),
        _P('meta', np.uint32)))


def wait_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('agrs', f'deepep::agrs_wait_kernel<{num_ranks}>', (
        _P('peer_bases', PTR), _P('rank', np.int32), _P('epoch', np.uint32), _P('meta', np.uint32), *_ERR))


def reduce_spec(num_ranks: int, in_bf16: bool, stage_bf16: bool) -> KernelSpec:
    return KernelSpec('agrs', f'deepep::agrs_reduce_kernel<{num_ranks}, {_b(in_bf16)}, {_b(stage_bf16)}>', (
        _P('x', PTR), _P('out', PTR), _P('num_elems', np.int64), _P('shard_elems', np.int64),
        _P('chunk_elems', np.int64), _P('scale', np.float32), _P('num_senders', np.int32), _P('peer_bases', PTR),
        _P('rank', np.int32), _P('recv_offset', np.uint64), _P('slot_bytes', np.uint64),
        _P('gather_offset', np.uint64), _P('gather_slot_bytes', np.uint64), _P('is_all_reduce', np.int32),
        _P('epoch', np.uint32), *_ERR))


def unpack_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('agrs', f'deepep::agrs_unpack_kernel<{num_ranks}>', (
        _P('x', PTR), _P('num_elems', np.int64), _P('shard_elems', np.int64), _P('peer_bases', PTR),
        _P('rank', np.int32), _P('gather_offset', np.uint64), _P('gather_slot_bytes', np.uint64),
        _P('epoch', np.uint32), *_ERR))


def all_specs(num_ranks: int) -> List[KernelSpec]:
    """Every specialisation a buffer of `num_ranks` scale-up ranks may request."""
    return ([gather_spec(num_ranks), wait_spec(num_ranks)]
            + [reduce_spec(num_ranks, i, s) for i, s in REDUCE_VARIANTS] + [unpack_spec(num_ranks)])


def shipped_specs() -> Dict[str, List[KernelSpec]]:
    """Family name → every `KernelSpec` of this feature for 1..8 ranks (for `jit/registry.py`)."""
    return {'agrs': [s for n in range(1, NUM_MAX_SCALEUP_RANKS + 1) for s in all_specs(n)]}


# ---- host bookkeeping (no GPU) ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GatherRegion:
    """One gathered tensor's region: `offset` bytes from the session start, `num_bytes` per rank, `region_bytes`
    reserved (= align(R * num_bytes, 32)); rank r's tensor sits at `offset + r * num_bytes`."""
    offset: int
    num_bytes: int
    region_bytes: int

    def slot_offset(self, rank: int) -> int:
        return self.offset + rank * self.num_bytes

    @property
    def end(self) -> int:
        return self.offset + self.region_bytes


class SessionPlan:
    """Bump allocator of one all-gather session; identical on every rank because every rank makes the same calls.

    Args:
        num_ranks: ranks of the group (R).
        capacity: bytes of the session area (`num_max_session_bytes`).
        max_gathers: tensors one session may gather (`num_max_all_gathers_per_session`).
    """

    def __init__(self, num_ranks: int, capacity: int, max_gathers: int):
        self.num_ranks, self.capacity, self.max_gathers = num_ranks, capacity, max_gathers
        self.is_open = False
        self.used_bytes = 0
        self.num_gathers = 0

    def open(self) -> None:
        if self.is_open:
            raise RuntimeError('an all-gather session is already open: destroy it first (sessions are sequential)')
        self.is_open, self.used_bytes, self.num_gathers = True, 0, 0

    def close(self) -> None:
        if not self.is_open:
            raise RuntimeError('no all-gather session is open')
        self.is_open = False

    def peek(self, sizes: Sequence[int]) -> List[GatherRegion]:
        """The regions the next gathers of `sizes` bytes (per rank) would get; ValueError if they do not fit."""
        if not self.is_open:
            raise RuntimeError('no all-gather session is open: use create_agrs_session() or agrs_new_session()')
        if self.num_gathers + len(sizes) > self.max_gathers:
            raise ValueError(f'this session already holds {self.num_gathers} gathered tensor(s); {len(sizes)} more '
                             f'exceed num_max_all_gathers_per_session={self.max_gathers}')
        regions, offset = [], self.used_bytes
        for nbytes in sizes:
            region = GatherRegion(offset, nbytes, align(self.num_ranks * nbytes, REGION_ALIGNMENT))
            regions.append(region)
            offset = region.end
        if offset > self.capacity:
            raise ValueError(f'gathering {list(sizes)} bytes per rank needs session bytes up to {offset}, more than '
                             f'num_max_session_bytes={self.capacity} ({self.used_bytes} already used in this '
                             f'session); see get_agrs_num_max_session_bytes')
        return regions

    def reserve(self, sizes: Sequence[int]) -> List[GatherRegion]:
        regions = self.peek(sizes)
        if regions:
            self.used_bytes = regions[-1].end
        self.num_gathers += len(sizes)
        return regions


def gather_meta(region_end: int) -> int:
    """What ranks compare to detect disagreeing sizes: the end of a call's regions in 32-byte units (uint32)."""
    return (region_end // REGION_ALIGNMENT) & 0xFFFFFFFF


def gather_grid(num_bytes: int, aligned: bool, num_sms: int) -> int:
    """Blocks of one gather launch: enough for the bytes (4 vectors in flight per thread), at most `num_sms`."""
    units = num_bytes // 16 if aligned else num_bytes
    per_block = THREADS * (GATHER_UNROLL if aligned else 1)
    return max(1, min(num_sms, -(-units // per_block)))


@dataclass(frozen=True)
class ReduceLayout:
    """Placement and grid of one reduce-scatter / all-reduce (byte offsets relative to the reduction area).

    Attributes:
        num_elems: input elements per rank; shard_elems: elements per shard (a multiple of 8; the last shards of an
            all-reduce may be shorter or empty).
        slot_bytes: one recv slot (a peer's piece in the staging precision), 32-byte aligned; recv slots start at 0.
        gather_offset, gather_slot_bytes: the all-reduce gather slots (FP32 shards), 0 for reduce-scatter.
        num_bytes: bytes of the reduction area used.
        chunk_elems: elements per chunk (the unit a sender publishes); num_senders, num_reducers: blocks per role.
    """
    num_elems: int
    shard_elems: int
    slot_bytes: int
    gather_offset: int
    gather_slot_bytes: int
    num_bytes: int
    chunk_elems: int
    num_senders: int
    num_reducers: int


def reduce_layout(num_ranks: int, num_elems: int, shard_elems: int, stage_itemsize: int, all_reduce: bool,
                  num_sms: int) -> ReduceLayout:
    """Layout and grid for a reduction of `num_elems` elements per rank in shards of `shard_elems` (multiple of 8)."""
    assert shard_elems % GROUP_ELEMS == 0, shard_elems
    slot_bytes = align(shard_elems * stage_itemsize, REGION_ALIGNMENT)
    gather_slot_bytes = align(shard_elems * 4, REGION_ALIGNMENT) if all_reduce else 0
    gather_offset = num_ranks * slot_bytes if all_reduce else 0
    # Senders drive NVLink (and pause at each chunk's system-scope release); reducers only read local memory.
    num, den = SENDER_SHARE
    senders = min(MAX_SENDERS, max(1, min(num_sms - 1, -(-num * num_sms // den))))
    chunk = min(CHUNK_MAX_ELEMS, max(CHUNK_MIN_ELEMS, align(-(-shard_elems // senders), CHUNK_MIN_ELEMS)))
    num_chunks = -(-shard_elems // chunk)
    senders = min(senders, max(1, num_chunks))
    reducers = max(1, min(num_sms - senders, num_chunks))
    if -(-num_chunks // senders) >= MAX_ROUNDS:
        raise ValueError(f'a shard of {shard_elems} elements is too large for one reduction ({num_chunks} chunks)')
    return ReduceLayout(num_elems, shard_elems, slot_bytes, gather_offset, gather_slot_bytes,
                        num_ranks * (slot_bytes + gather_slot_bytes), chunk, senders, reducers)


def reduce_area_offset(num_max_session_bytes: int) -> int:
    """Start of the reduction area, in bytes from the start of the data region."""
    return align(num_max_session_bytes, REDUCE_AREA_ALIGNMENT)


def all_reduce_shard_elems(num_ranks: int, num_elems: int) -> int:
    return align(-(-num_elems // num_ranks), GROUP_ELEMS) if num_elems else GROUP_ELEMS


def group_size(group) -> int:
    """R of a group given as an int, a deepep_cupy `ProcessGroup`, a torch ProcessGroup or an mpi4py communicator."""
    if isinstance(group, (int, np.integer)) and not isinstance(group, bool):
        return int(group)
    if hasattr(group, 'allgather_object') and isinstance(getattr(group, 'size', None), int):
        return group.size
    if callable(getattr(group, 'size', None)):
        return int(group.size())
    if callable(getattr(group, 'Get_size', None)):
        return int(group.Get_size())
    from .runtime.group import get_group
    return get_group(group).size


def dtype_info(dtype) -> Tuple[str, str, int]:
    """`(kind, canonical name, itemsize)` of a torch dtype (kind 'torch') or a numpy dtype / name (kind 'cupy';
    'bfloat16' and 'float8_e4m3fn' are held as uint16 / uint8 arrays)."""
    from .runtime import interop
    if type(dtype).__module__.startswith('torch'):
        name = str(dtype).replace('torch.', '')
        if name not in interop._ITEMSIZE:
            raise TypeError(f'dtype: unsupported torch dtype {dtype}')
        return 'torch', name, interop.itemsize(name)
    if isinstance(dtype, str) and dtype in ('bfloat16', 'float8_e4m3fn'):
        return 'cupy', {'bfloat16': 'uint16', 'float8_e4m3fn': 'uint8'}[dtype], interop.itemsize(dtype)
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f'dtype must be a torch dtype or a numpy dtype, got {dtype!r}') from None
    if np_dtype.name not in interop._ITEMSIZE:
        raise TypeError(f'dtype: unsupported dtype {np_dtype}')
    return 'cupy', np_dtype.name, np_dtype.itemsize


def _is_shape(x) -> bool:
    return isinstance(x, (tuple, list)) and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool)
                                                for d in x)


def normalize_shapes(shapes) -> Tuple[List[Tuple[int, ...]], bool]:
    """`(list of shapes, single)`: `shapes` is one shape (ints) or a non-empty sequence of shapes."""
    if _is_shape(shapes) and len(shapes) > 0:
        out, single = [tuple(int(d) for d in shapes)], True
    elif isinstance(shapes, (tuple, list)) and shapes and all(_is_shape(s) for s in shapes):
        out, single = [tuple(int(d) for d in s) for s in shapes], False
    else:
        raise ValueError(f'shapes must be a shape or a non-empty sequence of shapes, got {shapes!r}')
    for s in out:
        if any(d < 0 for d in s):
            raise ValueError(f'shapes: negative dimension in {s}')
    return out, single


def num_max_session_bytes(num_ranks: int, shapes, itemsize: int) -> int:
    """Σ over shapes of align(R · prod(shape) · itemsize, 32) (DeepEP's `get_agrs_num_max_session_bytes`)."""
    shape_list, _ = normalize_shapes(shapes)
    return sum(align(num_ranks * math.prod(s) * itemsize, REGION_ALIGNMENT) for s in shape_list)


def reduce_num_bytes(num_ranks: int, num_elems: int, op: str = 'all_reduce', comm_precision: str = 'fp32') -> int:
    """Reduction-area bytes one `reduce_scatter` (input of `num_elems` elements per rank) or `all_reduce` needs."""
    if op == 'all_reduce':
        return reduce_layout(num_ranks, num_elems, all_reduce_shard_elems(num_ranks, num_elems), 4, True,
                             2).num_bytes
    if op != 'reduce_scatter':
        raise ValueError(f"op must be 'reduce_scatter' or 'all_reduce', got {op!r}")
    if comm_precision not in COMM_PRECISIONS:
        raise ValueError(f'comm_precision must be one of {COMM_PRECISIONS}, got {comm_precision!r}')
    shard = align(-(-num_elems // num_ranks), GROUP_ELEMS)
    return num_ranks * align(shard * (2 if comm_precision == 'bf16' else 4), REGION_ALIGNMENT)


# ---- bitwise references (numpy, the kernels' order) ----------------------------------------------------------------
def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even, NaN → 0x7FFF as the GPU's cvt.rn does); uint16 bits."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(0x7FFF), r)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def reduce_reference(pieces: Sequence[np.ndarray], stage_bf16: bool, scale: float, out_bf16: bool) -> np.ndarray:
    """What the kernels compute from the R pieces of one shard (float32, or uint16 bfloat16 bits), in rank order:
    each piece rounded to the staging precision, FP32 sum from piece 0, times `scale` (FP32), then rounded to the
    output precision. Returns float32, or uint16 bits when `out_bf16`."""
    values = []
    for p in pieces:
        v = bf16_bits_to_f32(p) if p.dtype == np.uint16 else np.asarray(p, dtype=np.float32)
        values.append(bf16_bits_to_f32(f32_to_bf16_bits(v)) if stage_bf16 else v)
    acc = values[0].copy()
    for v in values[1:]:
        acc = (acc + v).astype(np.float32)
    acc = (acc * np.float32(scale)).astype(np.float32)
    return f32_to_bf16_bits(acc) if out_bf16 else acc


def reduce_scatter_reference(inputs: Sequence[np.ndarray], rank: int, comm_precision: str = 'fp32',
                             scale: float = 1.0) -> np.ndarray:
    """Rank `rank`'s `reduce_scatter` result from every rank's flattened input (`[R * n]` float32 or uint16 bits)."""
    num_ranks = len(inputs)
    n = inputs[0].size // num_ranks
    bf16 = inputs[0].dtype == np.uint16
    pieces = [np.ravel(x)[rank * n:(rank + 1) * n] for x in inputs]
    return reduce_reference(pieces, bf16 or comm_precision == 'bf16', scale, bf16)


def all_reduce_reference(inputs: Sequence[np.ndarray], scale: float = 1.0) -> np.ndarray:
    """`all_reduce` result (float32, flattened) from every rank's flattened float32 input."""
    return reduce_reference([np.ravel(x) for x in inputs], False, scale, False)


# ---- the buffer mixin ---------------------------------------------------------------------------------------------
class AGRSWaitHandle:
    """Returned by `all_gather`: call it (on the stream that will read the outputs) before using the outputs. It
    launches one small kernel that waits, bounded, until every rank's bytes of that call have arrived."""

    def __init__(self, buffer, session_idx: int, epoch: int, meta: int, like: Any, keep_alive: Tuple[Any, ...]):
        self._buffer, self._session_idx, self._epoch, self._meta = buffer, session_idx, epoch, meta
        self._like, self._keep_alive = like, keep_alive

    def __call__(self) -> None:
        buf = self._buffer
        st = buf._agrs
        if st.session_idx != self._session_idx or not st.plan.is_open:
            raise RuntimeError('this all-gather\'s session was destroyed: call the wait handle before '
                               'destroy_agrs_session() (the outputs are invalid now)')
        buf.check_usable()
        from .runtime import interop
        stream = interop.current_stream(self._like)
        st.kernels['wait'].launch(1, 32, (buf.sym.peer_bases_ptr, buf.sym.local_idx, self._epoch, self._meta,
                                          buf.host_mapped.ptr, buf.timeout_ns), stream=stream)
        self._keep_alive = ()


class _AGRSState:
    """Per-buffer state of the feature (kernels, session plan, epochs, views of the data region)."""

    def __init__(self, buf):
        import cupy
        num_ranks = buf.num_scaleup_ranks
        loaded = load_kernels(all_specs(num_ranks))
        self.kernels = {'gather': loaded[gather_spec(num_ranks).name], 'wait': loaded[wait_spec(num_ranks).name],
                        'unpack': loaded[unpack_spec(num_ranks).name]}
        for i, s in REDUCE_VARIANTS:
            self.kernels[('reduce', i, s)] = loaded[reduce_spec(num_ranks, i, s).name]
        self.plan: Optional[SessionPlan] = None
        self.session_capacity = 0
        self.session_idx = 0
        self.gather_epoch = 0
        self.reduce_epoch = 0
        self.num_sms = min(buf.num_device_sms, DEFAULT_GATHER_SMS)
        self.data_base = buf.sym.base + buf.data_offset
        self.cupy_bytes = buf.sym.local_view(buf.data_offset, buf.num_bytes) if buf.num_bytes else None
        self._torch_bytes = None
        self.order_event = cupy.cuda.Event(disable_timing=True)

    def torch_bytes(self):
        if self._torch_bytes is None:
            from .runtime import interop
            self._torch_bytes = interop.to_torch(self.cupy_bytes)
        return self._torch_bytes

    def view(self, kind: str, offset: int, num_bytes: int, dtype_name: str, shape: Tuple[int, ...]):
        """A torch / CuPy array over `num_bytes` bytes of the data region at `offset`, as `dtype_name`, `shape`."""
        if kind == 'torch':
            import torch
            return self.torch_bytes()[offset:offset + num_bytes].view(getattr(torch, dtype_name)).view(shape)
        return self.cupy_bytes[offset:offset + num_bytes].view(np.dtype(dtype_name)).reshape(shape)


class AGRSMixin:
    """All-gather sessions, reduce-scatter and all-reduce for a `BufferBase` (one scale-up domain, 1..8 ranks).

    Every rank must make the same calls in the same order with the same sizes. Kernels run on the buffer's
    communication stream after the current stream; gathers are completed by their wait handle, reductions by the
    returned `EventOverlap`. Not CUDA-graph capturable (epochs are counted on the host).
    """

    # ---- static size helpers (DeepEP V2) -----------------------------------------------------------------------
    @staticmethod
    def get_agrs_num_max_session_bytes(group, shapes, dtype) -> int:
        """Session bytes for gathering one tensor of each of `shapes` (Σ align(R · prod(shape) · itemsize, 32)).

        Args:
            group: the group (or its size); shapes: a sequence of shapes; dtype: torch or numpy dtype.
        """
        return num_max_session_bytes(group_size(group), shapes, dtype_info(dtype)[2])

    @staticmethod
    def get_agrs_buffer_size_hint(group, num_max_session_bytes: int, num_max_reduce_bytes: int = 0) -> int:
        """Buffer `num_bytes` for a session area of `num_max_session_bytes` (2 MiB aligned), plus a reduction area of
        `num_max_reduce_bytes` (see `get_agrs_reduce_num_bytes`) after it when given."""
        check_int('num_max_session_bytes', num_max_session_bytes)
        check_int('num_max_reduce_bytes', num_max_reduce_bytes)
        if not num_max_reduce_bytes:
            return align(num_max_session_bytes, BUFFER_ALIGNMENT)
        return align(reduce_area_offset(num_max_session_bytes) + num_max_reduce_bytes, BUFFER_ALIGNMENT)

    @staticmethod
    def get_agrs_reduce_num_bytes(group, num_max_elems: int, op: str = 'all_reduce',
                                  comm_precision: str = 'fp32') -> int:
        """Reduction-area bytes for `reduce_scatter` (input of `num_max_elems` elements per rank) or `all_reduce`
        (`num_max_elems` FP32 elements)."""
        check_int('num_max_elems', num_max_elems)
        return reduce_num_bytes(group_size(group), num_max_elems, op, comm_precision)

    # ---- configuration and sessions ------------------------------------------------------------------------------
    def _agrs_get(self) -> _AGRSState:
        st = getattr(self, '_agrs', None)
        if st is None:
            self.check_usable()
            if self.num_scaleout_ranks != 1:
                raise NotImplementedError('all-gather / reduce-scatter need one NVLink (scale-up) domain; this buffer '
                                          f'spans {self.num_scaleout_ranks}')
            self.claim_data_region('all-gather / reduce-scatter')
            st = self._agrs = _AGRSState(self)
        return st

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int = 32,
                        num_sms: int = 0) -> None:
        """Configure all-gather sessions (collective; ends with a GPU barrier so earlier work is complete everywhere).

        Args:
            num_max_session_bytes: session area (see `get_agrs_num_max_session_bytes`), at most the buffer's num_bytes.
            num_max_all_gathers_per_session: tensors one session may gather, 1..32.
            num_sms: blocks of a gather launch (0: min(device SMs, 32)).
        """
        check_int('num_max_session_bytes', num_max_session_bytes)
        check_int('num_max_all_gathers_per_session', num_max_all_gathers_per_session, 1)
        check_int('num_sms', num_sms)
        if num_max_all_gathers_per_session > MAX_GATHERS_PER_SESSION:
            raise ValueError(f'num_max_all_gathers_per_session must be <= {MAX_GATHERS_PER_SESSION}, '
                             f'got {num_max_all_gathers_per_session}')
        if num_max_session_bytes > self.num_bytes:
            raise ValueError(f'num_max_session_bytes={num_max_session_bytes} exceeds the buffer\'s num_bytes='
                             f'{self.num_bytes}; build it with get_agrs_buffer_size_hint(group, '
                             f'{num_max_session_bytes})')
        st = self._agrs_get()
        if st.plan is not None and st.plan.is_open:
            raise RuntimeError('agrs_set_config: destroy the open all-gather session first')
        self.group.check_same('agrs_set_config arguments', (num_max_session_bytes, num_max_all_gathers_per_session,
                                                           num_sms), timeout=self.num_cpu_timeout_secs)
        st.plan = SessionPlan(self.num_scaleup_ranks, num_max_session_bytes, num_max_all_gathers_per_session)
        st.session_capacity = num_max_session_bytes
        st.num_sms = min(num_sms or DEFAULT_GATHER_SMS, self.num_device_sms)
        self.barrier(use_comm_stream=True)

    def create_agrs_session(self) -> None:
        """Open a session: gathers reserve regions of the session area one after another (collective in order)."""
        st = self._agrs_get()
        if st.plan is None:
            raise RuntimeError('call agrs_set_config(num_max_session_bytes, ...) before creating a session')
        self.check_usable()
        st.plan.open()
        st.session_idx += 1

    def destroy_agrs_session(self) -> None:
        """Close the session: a GPU barrier after the current stream, so no rank still writes into (or reads) the
        session area when the next session reuses it. The session's outputs are invalid afterwards."""
        st = self._agrs_get()
        if st.plan is None or not st.plan.is_open:
            raise RuntimeError('destroy_agrs_session: no all-gather session is open')
        st.plan.close()
        self.barrier(use_comm_stream=True)

    @contextlib.contextmanager
    def agrs_new_session(self, enabled: bool = True):
        """`with buf.agrs_new_session(): ...` creates a session and destroys it on exit (nothing if not `enabled`)."""
        if not enabled:
            yield
            return
        self.create_agrs_session()
        try:
            yield
        finally:
            if self._failed is None and not self._destroyed:
                self.destroy_agrs_session()
            elif self._agrs.plan.is_open:
                self._agrs.plan.close()

    def agrs_get_inplace_tensor(self, shapes, dtype):
        """Views of this rank's slot in the next gather region(s): fill them and pass them to `all_gather` in the
        same order, and no copy of the source is made (zero-copy).

        Args:
            shapes: one shape, or a sequence of shapes (one view each).
            dtype: torch dtype (torch views) or numpy dtype (CuPy views; bfloat16 as uint16).

        Returns:
            a view `[*shape]` (one shape) or a list of views; valid for the open session.
        """
        st = self._agrs_get()
        if st.plan is None:
            raise RuntimeError('call agrs_set_config(...) and create a session first')
        shape_list, single = normalize_shapes(shapes)
        kind, name, itemsize = dtype_info(dtype)
        regions = st.plan.peek([math.prod(s) * itemsize for s in shape_list])
        rank = self.sym.local_idx
        views = [st.view(kind, r.slot_offset(rank), r.num_bytes, name, s) for r, s in zip(regions, shape_list)]
        return views[0] if single else views

    # ---- all-gather -----------------------------------------------------------------------------------------------
    def all_gather(self, tensors):
        """Gather every rank's tensor(s) into the open session.

        Args:
            tensors: one tensor or a list of tensors (torch or CuPy, one kind, contiguous, on this rank's GPU; any
                dtype; 16-byte aligned sizes and sources take the fast path). Every rank passes the same shapes.

        Returns:
            `(gathered, wait_handle)` for one tensor, `(*gathered, wait_handle)` for a list: each `gathered` is a
            `[R, *shape]` view into the session buffer (valid until the session is destroyed); call `wait_handle()`
            on the stream that reads them first.
        """
        from .ep import checks
        from .runtime import interop
        st = self._agrs_get()
        if st.plan is None or not st.plan.is_open:
            raise RuntimeError('all_gather needs an open session: use create_agrs_session() or agrs_new_session()')
        self.check_usable()
        single = not isinstance(tensors, (list, tuple))
        items = [tensors] if single else list(tensors)
        if not items:
            raise ValueError('tensors must be a tensor or a non-empty list of tensors')
        infos = []
        for i, t in enumerate(items):
            info = checks.info(t, 'tensors' if single else f'tensors[{i}]', self.device)
            checks.check_contiguous(info, 'tensors' if single else f'tensors[{i}]')
            if infos:
                checks.check_same_kind(infos[0].kind, info, f'tensors[{i}]')
            infos.append(info)
        sizes = [info.nbytes for info in infos]
        regions = st.plan.peek(sizes)
        rank, num_ranks = self.sym.local_idx, self.num_scaleup_ranks
        # A source inside the not yet gathered part of the session area must be its own in-place slot.
        free_start, free_end = st.data_base + st.plan.used_bytes, st.data_base + st.plan.capacity
        inplace = []
        for i, (info, region) in enumerate(zip(infos, regions)):
            exact = info.nbytes > 0 and info.ptr == st.data_base + region.slot_offset(rank)
            if not exact and info.nbytes > 0 and info.ptr < free_end and info.ptr + info.nbytes > free_start:
                raise ValueError(f'tensors[{i}] lies in the part of the session buffer that this or a later gather '
                                 f'writes; pass the views of agrs_get_inplace_tensor in order, or another tensor')
            inplace.append(exact)

        regions = st.plan.reserve(sizes)
        st.gather_epoch = (st.gather_epoch + 1) & 0xFFFFFFFF
        epoch, meta = st.gather_epoch, gather_meta(regions[-1].end)
        current, comm = interop.current_stream(items[0]), self.comm_stream
        st.order_event.record(current)
        comm.wait_event(st.order_event)
        kernel = st.kernels['gather']
        for i, (info, region) in enumerate(zip(infos, regions)):
            aligned = info.nbytes % 16 == 0 and info.ptr % 16 == 0
            kernel.launch(gather_grid(info.nbytes, aligned, st.num_sms), THREADS, (
                info.ptr, info.nbytes, self.data_offset + region.offset, self.sym.peer_bases_ptr, rank,
                0 if inplace[i] else 1, 1 if i == len(infos) - 1 else 0, epoch, meta), stream=comm)
        if infos[0].kind == 'torch':
            s = interop.torch_stream(comm.ptr)
            for t, exact in zip(items, inplace):
                if not exact:
                    t.record_stream(s)
        outputs = []
        for info, region in zip(infos, regions):
            outputs.append(st.view(info.kind, region.offset, num_ranks * info.nbytes, info.dtype,
                                   (num_ranks, *info.shape)))
        handle = AGRSWaitHandle(self, st.session_idx, epoch, meta, items[0],
                                tuple(t for t, exact in zip(items, inplace) if not exact))
        return (*outputs, handle)

    # ---- reductions -----------------------------------------------------------------------------------------------
    def _agrs_reduce_streams(self, like, previous_event):
        from .runtime import interop
        from .runtime.event import EventHandle, EventOverlap
        current, comm = interop.current_stream(like), self.comm_stream
        if previous_event is not None:
            ev = previous_event.event if isinstance(previous_event, EventOverlap) else previous_event
            if not isinstance(ev, EventHandle):
                raise TypeError(f'previous_event must be an EventHandle (buffer.capture()), got {type(ev).__name__}')
            ev.stream_wait(comm)
        else:
            st = self._agrs
            st.order_event.record(current)
            comm.wait_event(st.order_event)
        return current, comm

    def _agrs_reduce_area(self, st: _AGRSState, layout: ReduceLayout) -> int:
        start = reduce_area_offset(st.session_capacity)
        if start + layout.num_bytes > self.num_bytes:
            raise ValueError(f'this reduction needs {layout.num_bytes} bytes of the reduction area but the buffer has '
                             f'{max(0, self.num_bytes - start)} after the session area ({st.session_capacity} bytes); '
                             f'build it with get_agrs_buffer_size_hint(group, session_bytes, '
                             f'get_agrs_reduce_num_bytes(...))')
        return self.data_offset + start

    def _agrs_finish(self, comm, kind: str, tensors, result):
        from .runtime import interop
        from .runtime.event import EventHandle, EventOverlap
        if kind == 'torch':
            s = interop.torch_stream(comm.ptr)
            for t in tensors:
                t.record_stream(s)
        event = EventOverlap(EventHandle(comm), extra_tensors=tensors)
        event.register_hook_after_wait(lambda: result)
        return event

    def _agrs_launch_reduce(self, st, kernel_key, x_ptr, out_ptr, layout, scale, area, is_all_reduce, comm):
        # Wraps to 0 like every epoch (wrap-safe compares); skipping 0 would make the next senders wait for a `done`
        # of epoch 0, which no rank publishes.
        st.reduce_epoch = (st.reduce_epoch + 1) & 0xFFFFFFFF
        grid = layout.num_senders + layout.num_reducers
        st.kernels[kernel_key].launch(grid, THREADS, (
            x_ptr, out_ptr, layout.num_elems, layout.shard_elems, layout.chunk_elems, float(scale),
            layout.num_senders, self.sym.peer_bases_ptr, self.sym.local_idx, area, layout.slot_bytes,
            area + layout.gather_offset, layout.gather_slot_bytes, int(is_all_reduce), st.reduce_epoch,
            self.host_mapped.ptr, self.timeout_ns), stream=comm, cooperative=True)
        return st.reduce_epoch

    @staticmethod
    def _agrs_check_scale(scale) -> float:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
            raise TypeError(f'scale must be a number, got {scale!r}')
        if not math.isfinite(float(scale)):
            raise ValueError(f'scale must be finite, got {scale}')
        return float(scale)

    def reduce_scatter(self, x, comm_precision: str = 'fp32', scale: float = 1.0, num_sms: int = 0,
                       previous_event=None):
        """Sum every rank's `x` and give rank r the r-th of R equal shards, times `scale`.

        Args:
            x: `[R * n, ...]` or `[R, ...]` (shard r = the r-th slice along dim 0), float32 or bfloat16 (CuPy:
                float32 or uint16), contiguous, n elements per shard a multiple of 8, 16-byte aligned.
            comm_precision: `'fp32'` or `'bf16'` (pieces travel, and enter the sum, rounded to bfloat16);
                bfloat16 inputs always travel as bfloat16. The sum is FP32 in rank order 0..R-1 (deterministic).
            scale: multiplies the FP32 sum before the final rounding.
            num_sms: blocks of the kernel, half senders (at most 32) and half reducers (0: min(device SMs, 64)).
            previous_event: `EventHandle` the communication stream waits for instead of the current stream.

        Returns:
            `EventOverlap`; `wait()` makes the current stream wait and returns the shard: `[n]` for 1-D `x`,
            `[shape[0] / R, ...]` otherwise (`[...]` when shape[0] == R and x has 2+ dims), dtype of `x`.
        """
        from .ep import checks
        from .runtime import interop
        st = self._agrs_get()
        self.check_usable()
        info = checks.info(x, 'x', self.device)
        checks.check_dtype(info, 'x', 'float32', 'bfloat16')
        checks.check_contiguous(info, 'x')
        if comm_precision not in COMM_PRECISIONS:
            raise ValueError(f'comm_precision must be one of {COMM_PRECISIONS}, got {comm_precision!r}')
        scale = self._agrs_check_scale(scale)
        check_int('num_sms', num_sms)
        num_ranks = self.num_scaleup_ranks
        if info.ndim == 0 or info.shape[0] % num_ranks:
            raise ValueError(f'x must have a first dimension divisible by R={num_ranks}, got shape {list(info.shape)}')
        out_shape = (tuple(info.shape[1:]) if info.ndim >= 2 and info.shape[0] == num_ranks
                     else (info.shape[0] // num_ranks, *info.shape[1:]))
        shard = info.numel // num_ranks
        if shard % GROUP_ELEMS or info.ptr % 16:
            raise ValueError(f'x: each shard must hold a multiple of {GROUP_ELEMS} elements and x must be 16-byte '
                             f'aligned, got {shard} elements per shard at address {info.ptr:#x}')
        in_bf16 = info.dtype != 'float32'
        stage_bf16 = in_bf16 or comm_precision == 'bf16'
        layout = reduce_layout(num_ranks, info.numel, shard, 2 if stage_bf16 else 4, False,
                               min(num_sms or DEFAULT_REDUCE_SMS, self.num_device_sms))
        area = self._agrs_reduce_area(st, layout)
        current, comm = self._agrs_reduce_streams(x, previous_event)
        # With previous_event the communication stream does not wait for the current stream, so memory just freed on
        # the current stream (still in use by its queued kernels) must not become `out`: allocate on the
        # communication stream then, and let torch's allocator also wait for the current stream's uses of `out`.
        alloc_stream = comm if previous_event is not None else None
        out = interop.Allocator(info.kind).empty(out_shape, 'bfloat16' if in_bf16 else 'float32', alloc_stream)
        if alloc_stream is not None and info.kind == 'torch':
            import torch
            out.record_stream(torch.cuda.current_stream())      # `current` (the stream of a torch `x`)
        out_ptr = interop.tensor_info(out, 'out').ptr
        self._agrs_launch_reduce(st, ('reduce', in_bf16, stage_bf16), info.ptr, out_ptr, layout, scale, area, False,
                                 comm)
        return self._agrs_finish(comm, info.kind, (x, out), out)

    def all_reduce(self, x, scale: float = 1.0, num_sms: int = 0, previous_event=None):
        """Sum every rank's `x` in place (FP32, rank order 0..R-1 per element, deterministic), times `scale`.

        Args:
            x: float32 tensor / CuPy array of any shape, contiguous, 16-byte aligned; overwritten with the result.
            scale, num_sms, previous_event: as in `reduce_scatter`.

        Returns:
            `EventOverlap`; `wait()` makes the current stream wait and returns `x`.
        """
        from .ep import checks
        from .runtime.event import EventHandle, EventOverlap
        st = self._agrs_get()
        self.check_usable()
        info = checks.info(x, 'x', self.device)
        checks.check_dtype(info, 'x', 'float32')
        checks.check_contiguous(info, 'x')
        scale = self._agrs_check_scale(scale)
        check_int('num_sms', num_sms)
        if info.ptr % 16:
            raise ValueError(f'x must be 16-byte aligned, got address {info.ptr:#x}')
        num_ranks, rank = self.num_scaleup_ranks, self.sym.local_idx
        shard = all_reduce_shard_elems(num_ranks, info.numel)
        layout = reduce_layout(num_ranks, info.numel, shard, 4, True,
                               min(num_sms or DEFAULT_REDUCE_SMS, self.num_device_sms))
        area = self._agrs_reduce_area(st, layout)
        current, comm = self._agrs_reduce_streams(x, previous_event)
        if info.numel == 0:
            event = EventOverlap(EventHandle(comm), extra_tensors=(x,))
            event.register_hook_after_wait(lambda: x)
            return event
        epoch = self._agrs_launch_reduce(st, ('reduce', False, False), info.ptr, info.ptr + rank * shard * 4, layout,
                                         scale, area, True, comm)
        if num_ranks > 1:
            st.kernels['unpack'].launch(max(1, min(st.num_sms, -(-info.numel // (THREADS * 4 * GATHER_UNROLL)))),
                                        THREADS, (info.ptr, info.numel, shard, self.sym.peer_bases_ptr, rank,
                                                  area + layout.gather_offset, layout.gather_slot_bytes, epoch,
                                                  self.host_mapped.ptr, self.timeout_ns), stream=comm)
        return self._agrs_finish(comm, info.kind, (x,), x)
