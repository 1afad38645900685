"""All-gather sessions, reduce-scatter and all-reduce inside one NVLink domain, or across several (hybrid mode): the
feature of a buffer (`kernels_cu/agrs.cu` for the protocols, plan.py for the host bookkeeping, reduce.py for the
reductions' calls, reference.py for the bitwise references).

DeepEP V2's all-gather session API (`agrs_set_config`, `create_agrs_session` / `destroy_agrs_session` /
`agrs_new_session`, `agrs_get_inplace_tensor`, `all_gather`) and V2.5 BucketBuffer-style `reduce_scatter` /
`all_reduce`. Copies are SM-driven NVLink stores (upstream uses copy engines); every wait is bounded.

Memory: the data region holds the session area `[0, num_max_session_bytes)` and, after it (4 KiB aligned), the
reduction area. Sessions are sequential (one open at a time); a session holds at most
`num_max_all_gathers_per_session` (<= 32) gathered tensors. Reductions never touch the session area, so they may run
while a session is open. Every rank must make the same calls in the same order with the same sizes; not CUDA-graph
capturable (epochs are counted on the host).

Hybrid mode (several scale-up domains): hybrid.py.
"""

import contextlib
import math
import operator
from functools import partial, reduce
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from ...jit.launch import load_kernels
from ...runtime import checks, dtypes, interop
from .gather_entry import gather_entry
from .gather_launch import GatherLaunches
from .hybrid import HybridSteps
from .kernels import (
    DEFAULT_GATHER_SMS,
    MAX_GATHERS_PER_SESSION,
    REDUCE_VARIANTS,
    all_specs,
    gather_batch_spec,
    gather_spec,
    reduce_spec,
    unpack_spec,
    wait_spec,
)
from .plan import SessionPlan, normalize_shapes
from .reduce import Reductions
from .wait_handle import AGRSWaitHandle

DATA_REGION_OWNER = 'all-gather / reduce-scatter'
# A torch tensor's shape, dtype and device in one C call (its strides: `torch.Tensor.stride`, a method).
_SIGNATURE = operator.attrgetter('shape', 'dtype', 'device')
_or_all = partial(reduce, operator.or_)     # (`_or_all(ptrs, 0) & 15`: a source off 16 bytes)


class AGRS(GatherLaunches, HybridSteps, Reductions):
    """The all-gather / reduction feature of one buffer: kernels, the session plan, epochs and views of the data
    region. Creating it claims the data region.

    Args:
        buf: the buffer (a `BufferBase`); N scale-up domains of 1 to 8 ranks (hybrid mode when N > 1).
        rails: hybrid mode: the rails (buffers/agrs_rails.py `AGRSRails`; tests inject one), or
        make_rails: `(buf, rail_offset) -> rails`, called here in hybrid mode (collective).
    """

    def __init__(self, buf, rails: Any = None, make_rails: Optional[Callable[[Any, int], Any]] = None):
        buf.check_usable()
        buf.claim_data_region(DATA_REGION_OWNER)
        self._buf = buf
        self._init_domains(buf, rails, make_rails)      # area_offset, area_bytes; rails in hybrid mode (hybrid.py)
        self.kernels = self.load_kernels(buf.num_scaleup_ranks)
        self.plan: Optional[SessionPlan] = None
        self.session_capacity = 0
        self.session_idx = 0
        self.gather_epoch = 0
        self.reduce_epoch = 0
        self.num_sms = min(buf.num_device_sms, DEFAULT_GATHER_SMS)
        self.data_base = buf.sym.base + self.area_offset
        self._bytes: Dict[str, Any] = {}
        self._typed: Dict[str, Any] = {}          # torch views of the whole data region, per dtype
        self._infos: Dict[Any, Tuple[str, int, str, Tuple[int, ...]]] = {}    # signature -> checked tensor facts
        self._gather_launch = None                  # hybrid: the gather kernel's bound launch (every argument patched)
        self._batch_launch = None                   # the batched gather kernel's (sources, mask, epoch, meta patched)
        self._batch_grid = None                     # (the grid last set on it)
        self._wait_launch = self._wait_pack = None     # the wait kernel's and `(epoch, meta) ->` their packing
        self._reduce_launches: Dict[Any, Any] = {}  # (kernel, layout, area, all-reduce) -> bound reduce launch
        self._reduce_checked: Dict[Any, Any] = {}   # reduce_scatter signature -> what its checks derived
        self._gather_entries: Dict[Any, Any] = {}   # all_gather (signatures, session state) -> `gather_entry`

    @staticmethod
    def load_kernels(num_ranks: int) -> Dict[Any, Any]:
        loaded = load_kernels(all_specs(num_ranks))
        kernels = {'gather': loaded[gather_spec(num_ranks).name], 'wait': loaded[wait_spec(num_ranks).name],
                   'gather_batch': loaded[gather_batch_spec(num_ranks).name],
                   'unpack': loaded[unpack_spec(num_ranks).name]}
        for i, s in REDUCE_VARIANTS:
            kernels[('reduce', i, s)] = loaded[reduce_spec(num_ranks, i, s).name]
        return kernels

    def view(self, kind: str, offset: int, num_bytes: int, dtype_name: str, shape: Tuple[int, ...]):
        """A torch / CuPy array over `num_bytes` bytes of the data region at `offset`, as `dtype_name`, `shape`."""
        data = self._bytes.get(kind)
        if data is None:
            buf = self._buf
            data = buf.sym.local_view(self.area_offset, self.area_bytes) if self.area_bytes else None
            if kind == 'torch':
                data = interop.to_torch(data)
            self._bytes[kind] = data
        if kind == 'torch':
            # One as_strided on a typed view of the area made once per dtype (a slice and two views per call cost
            # ~4 us of Python; region offsets are 32-byte aligned, so every itemsize divides them).
            typed = self._typed.get(dtype_name)
            if typed is None:
                import torch
                typed = self._typed[dtype_name] = data.view(getattr(torch, dtype_name))
            size = typed.element_size()
            assert offset % size == 0 and num_bytes == math.prod(shape) * size
            return typed.as_strided(shape, interop.contiguous_strides(shape), offset // size)
        return data[offset:offset + num_bytes].view(np.dtype(dtype_name)).reshape(shape)

    def _gathered(self, *key):
        """`view(*key)` for an all-gather's output, made once per (kind, region, dtype, shape): sessions reserve the
        same regions call after call, and a view costs ~2-3 us of CUDA-side torch on the GPU host."""
        views = self.__dict__.setdefault('_gathered_views', {})
        if key not in views:
            if len(views) >= 256:
                views.clear()
            views[key] = self.view(*key)
        return views[key]

    def destroy(self) -> None:
        self._bytes, self._typed = {}, {}
        self.__dict__.pop('_gathered_views', None)
        self._gather_entries = {}
        if self.plan is not None:
            self.plan.is_open = False
        self._hand_over_rails()

    # ---- configuration and sessions ------------------------------------------------------------------------------
    def set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int = 32,
                   num_sms: int = 0) -> None:
        """Configure all-gather sessions (collective; ends with a GPU barrier so earlier work is complete everywhere).

        Args:
            num_max_session_bytes: session area (see `get_agrs_num_max_session_bytes`), at most the buffer's num_bytes.
            num_max_all_gathers_per_session: tensors one session may gather, 1..32.
            num_sms: blocks of a gather launch (0: min(device SMs, 32)).
        """
        buf = self._buf
        if self.plan is not None and self.plan.is_open:
            raise RuntimeError('agrs_set_config: destroy the open all-gather session first')
        buf.group.check_same('agrs_set_config arguments', (num_max_session_bytes, num_max_all_gathers_per_session,
                                                          num_sms), timeout=buf.num_cpu_timeout_secs)
        self.plan = SessionPlan(buf.num_ranks, num_max_session_bytes, num_max_all_gathers_per_session)
        self._gather_entries = {}       # (they hold the previous plan's capacity and num_sms)
        self._reduce_checked, self._reduce_launches = {}, {}    # (their areas follow the session area, grids num_sms)
        self.session_capacity = num_max_session_bytes
        self.num_sms = min(num_sms or DEFAULT_GATHER_SMS, buf.num_device_sms)
        buf.barrier(use_comm_stream=True)

    @staticmethod
    def check_config(num_bytes: int, num_max_session_bytes: int, num_max_all_gathers_per_session: int,
                     num_sms: int) -> None:
        """`agrs_set_config`'s argument checks (before the feature exists: a bad call claims nothing)."""
        checks.check_int('num_max_session_bytes', num_max_session_bytes)
        checks.check_int('num_max_all_gathers_per_session', num_max_all_gathers_per_session, 1)
        checks.check_int('num_sms', num_sms)
        if num_max_all_gathers_per_session > MAX_GATHERS_PER_SESSION:
            raise ValueError(f'num_max_all_gathers_per_session must be <= {MAX_GATHERS_PER_SESSION}, '
                             f'got {num_max_all_gathers_per_session}')
        if num_max_session_bytes > num_bytes:
            raise ValueError(f'num_max_session_bytes={num_max_session_bytes} exceeds the buffer\'s num_bytes='
                             f'{num_bytes}; build it with get_agrs_buffer_size_hint(group, '
                             f'{num_max_session_bytes})')

    def create_session(self) -> None:
        """Open a session: gathers reserve regions of the session area one after another (collective in order)."""
        plan = self.plan
        if plan is None:
            raise RuntimeError('call agrs_set_config(num_max_session_bytes, ...) before creating a session')
        buf = self._buf
        if buf._destroyed or buf._failed is not None or buf.error_record[0]:
            self._check_usable()        # (its three conditions read here first)
        if plan.is_open:
            plan.open()                 # (raises: sessions are sequential)
        plan.is_open, plan.used_bytes, plan.num_gathers = True, 0, 0         # (`plan.open()` inline)
        self.session_idx += 1

    def destroy_session(self) -> None:
        """Close the session: a GPU barrier after the current stream, so no rank still writes into (or reads) the
        session area when the next session reuses it. The session's outputs are invalid afterwards."""
        if self.plan is None or not self.plan.is_open:
            raise RuntimeError('destroy_agrs_session: no all-gather session is open')
        self.plan.close()
        self._buf.barrier(use_comm_stream=True)

    @contextlib.contextmanager
    def new_session(self, enabled: bool = True):
        """`with buf.agrs_new_session(): ...` creates a session and destroys it on exit (nothing if not `enabled`)."""
        if not enabled:
            yield
            return
        self.create_session()
        try:
            yield
        finally:
            if self._buf.is_usable():
                self.destroy_session()
            elif self.plan.is_open:
                self.plan.close()

    def get_inplace_tensor(self, shapes, dtype):
        """Views of this rank's slot in the next gather region(s): fill them and pass them to `all_gather` in the
        same order, and no copy of the source is made (zero-copy).

        Args:
            shapes: one shape, or a sequence of shapes (one view each).
            dtype: torch dtype (torch views) or numpy dtype (CuPy views; bfloat16 as uint16).

        Returns:
            a view `[*shape]` (one shape) or a list of views; valid for the open session.
        """
        if self.plan is None:
            raise RuntimeError('call agrs_set_config(...) and create a session first')
        shape_list, single = normalize_shapes(shapes)
        kind, name, itemsize = dtypes.describe(dtype)
        regions = self.plan.peek([math.prod(s) * itemsize for s in shape_list])
        rank = self._buf.rank_idx
        views = [self.view(kind, r.slot_offset(rank), r.num_bytes, name, s) for r, s in zip(regions, shape_list)]
        return views[0] if single else views

    # ---- all-gather ----------------------------------------------------------------------------------------------
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
        plan = self.plan
        if plan is None or not plan.is_open:
            raise RuntimeError('all_gather needs an open session: use create_agrs_session() or agrs_new_session()')
        buf = self._buf
        if buf._destroyed or buf._failed is not None or buf.error_record[0]:
            self._check_usable()        # (its three conditions read here first: the call costs ~1 us)
        single = not isinstance(tensors, (list, tuple))
        items = (tensors,) if single else tuple(tensors)
        # Per call: the signatures and pointers; what the signatures and the session's state (bytes and gathers used)
        # decide (the checks, regions, grids, packed launch arguments, output views) is looked up, computed once by
        # `gather_entry`. Torch tensors (subclasses too) are read field by field across the list (a C call per field,
        # not per tensor; the descriptors raise TypeError for anything else, and before `interop.meta` saw a torch
        # tensor the placeholder class has none); other arrays through `interop.meta`. (A single tensor and a list of
        # one share their entry: they differ only in the names of failed checks, which make no entry.)
        try:
            tensor_type = interop.TORCH_TENSOR[0]
            ptrs = list(map(tensor_type.data_ptr, items))
            key = (tuple(map(_SIGNATURE, items)), tuple(map(tensor_type.stride, items)), plan.used_bytes,
                   plan.num_gathers)
        except (TypeError, AttributeError):
            key, ptrs = self._gather_key(items)
        e = self._gather_entries.get(key)
        if e is None:
            metas = [interop.meta(t) for t in items]
            e = gather_entry(self, items, single, metas, key)
            ptrs = [m[1] for m in metas]
        pack, consts, grid, mask, below, free_end, end, num_gathers, meta, outputs, track, rest = e
        keep = items
        if max(ptrs) > below and min(ptrs) < free_end:      # (a source near the free area: an in-place slot?)
            mask, keep, consts = self._in_place(items, ptrs, e)
        plan.used_bytes = end                               # (`plan.reserve` of these regions)
        plan.num_gathers = num_gathers
        self.gather_epoch = epoch = (self.gather_epoch + 1) & 0xFFFFFFFF
        current = interop.current_stream(items[0])
        comm = buf.stream_order.begin(current)
        if pack is not None:        # (single domain, up to GATHER_BATCH tensors: one launch, one pack)
            if _or_all(ptrs, 0) & 15:
                grid = self._misaligned_grid(rest.tensors, ptrs, 0, len(ptrs))
            b = self._batch_launch
            if grid is not self._batch_grid:
                b.grid = self._batch_grid = grid
            pack(*ptrs, *consts, epoch, meta)
            b(comm)
        elif self.hybrid:
            per = rest.tensors
            g = self._single_gather_launch()
            g.u32[self._gather_launch_idx.epoch], g.u32[self._gather_launch_idx.meta] = epoch, meta
            self._hybrid_gather(g, comm, ptrs, [f.num_bytes for f in per], rest.regions,
                                [not mask >> i & 1 for i in range(len(per))], meta)
        else:
            self._gather_batches(comm, rest.batches, rest.tensors, ptrs, mask, epoch, meta)
        handle = AGRSWaitHandle((self, self.session_idx, epoch, meta, items[0]), keep, keep if track else (), current,
                                comm)
        if self.hybrid:     # (a rail timeout skips the signal that the wait kernel's return would stand for)
            handle.mark()
        return outputs + (handle,)

    def _in_place(self, items, ptrs, e):
        """`all_gather`'s `(in-place mask, sources to keep, pack constants)` for a call whose sources come near its free
        area (entry `e`; see `_copy_mask`)."""
        pack, consts, _, _, _, free_end, _, _, _, _, _, rest = e
        mask = self._copy_mask(ptrs, rest.tensors, rest.free_start, free_end)
        if mask == e[3]:
            return mask, items, consts
        keep = tuple([t for i, t in enumerate(items) if mask >> i & 1])
        if pack is not None:        # (the mask's place in the constants: `gather_entry.single_batch_pack`)
            consts = (*consts[:-4], mask, *consts[-3:])
        return mask, keep, consts

    def _gather_key(self, items):
        """`all_gather`'s `(key, pointers)` for anything but a list of torch tensors (CuPy arrays, mixed or unknown
        inputs), or before `interop.meta` saw a torch tensor: then the torch key, so that the first call's entry is
        found again."""
        plan = self.plan
        metas = [interop.meta(t) for t in items]
        tensor_type = interop.TORCH_TENSOR[0]
        try:
            ptrs = list(map(tensor_type.data_ptr, items))
            return (tuple(map(_SIGNATURE, items)), tuple(map(tensor_type.stride, items)), plan.used_bytes,
                    plan.num_gathers), ptrs
        except (TypeError, AttributeError):
            return (tuple([m[0] for m in metas]), plan.used_bytes, plan.num_gathers), [m[1] for m in metas]

    @staticmethod
    def _copy_mask(ptrs, per, free_start: int, free_end: int) -> int:
        """The in-place mask of an all-gather call whose sources come near its free area (bit i clear: source i is its
        own in-place slot, neither copied, kept nor marked); a source inside the not yet gathered part of the session
        area must be its own in-place slot."""
        mask = 0
        for i, (ptr, f) in enumerate(zip(ptrs, per)):
            nbytes = f.num_bytes
            if ptr != f.slot_ptr or not nbytes:
                mask |= 1 << i
                if nbytes and ptr < free_end and ptr + nbytes > free_start:
                    raise ValueError(f'tensors[{i}] lies in the part of the session buffer that this or a later '
                                     f'gather writes; pass the views of agrs_get_inplace_tensor in order, or another '
                                     f'tensor')
        return mask
