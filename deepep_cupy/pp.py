"""Pipeline-parallel send/recv between ring neighbours (`kernels_cu/pp.cu`), DeepEP V2's `pp_*` API.

`PPMixin` adds `pp_set_config`, `pp_send`, `pp_recv` and `get_pp_buffer_size_hint` to a `BufferBase`. A rank sends
to and receives from its ring neighbours only (rank ± 1 modulo the group size). Every directed pair is a FIFO: the
k-th `pp_recv(x, src)` on rank d receives the k-th `pp_send(t, d)` of rank src, whatever happens in between. The
receiver owns `num_max_inflight_tensors` slots per source neighbour in its symmetric memory; `pp_send` pushes the bytes
straight into the next free slot over NVLink (one kernel) and waits on the GPU, bounded, while all slots are full
(back-pressure: a slot is never overwritten before the receiver copied it out); `pp_recv` waits for the message and
copies it into the tensor. Both run on the buffer's communication stream, ordered after the current stream.
Per-pair counters live on the GPU, so the host launches carry no sequence numbers.

A receiving tensor must have exactly as many bytes as the matching sent tensor. That can only be checked on the
GPU (the size travels in a slot header): on a mismatch nothing is copied, the message is consumed, and the next PP
call on the receiving rank raises `RuntimeError` describing the pair and both sizes.
"""

import time
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .constants import BUFFER_ALIGNMENT
from .jit.launch import PTR, KernelSpec, Param, load_kernels
from .runtime import interop
from .runtime.event import EventHandle, EventOverlap
from .validation import check_int

# Workspace bytes [CTRL_OFFSET, CTRL_OFFSET + CTRL_BYTES) hold the PP control words (see kernels_cu/pp.cu).
CTRL_OFFSET = 20480
CTRL_BYTES = 4096
THREADS = 512                # kPPThreads
UNROLL = 4                   # kPPUnroll
HEADER_BYTES = 16            # kPPHeaderBytes
SLOT_ALIGNMENT = 32          # upstream's PP alignment; also keeps every slot 16-byte aligned for vector stores
HEADER_REGION_ALIGNMENT = 128
NUM_SOURCES = 2              # slot regions per receiver: previous and next rank
NUM_MAX_INFLIGHT_TENSORS = 1 << 16
PHASE_PP = 7                 # kPhasePP
WAIT_SLOT, WAIT_DATA = 1, 2  # aux codes of a PP timeout record (kPPWaitSlot, kPPWaitData)
ERROR_WORDS = 8              # kPPErrorWords
DATA_REGION_OWNER = 'PP send/recv'

_P = Param
SEND_SPEC = KernelSpec('pp', 'deepep::pp_send_impl', (
    _P('x', PTR), _P('num_bytes', np.uint64), _P('peer_bases', PTR), _P('rank', np.int32), _P('dst', np.int32),
    _P('dst_slot_idx', np.int32), _P('src_slot_idx_at_dst', np.int32), _P('num_inflight', np.int32),
    _P('headers_offset', np.uint64), _P('slots_offset', np.uint64), _P('slot_bytes', np.uint64),
    _P('error_record', PTR), _P('timeout_ns', np.uint64)))
RECV_SPEC = KernelSpec('pp', 'deepep::pp_recv_impl', (
    _P('x', PTR), _P('num_bytes', np.uint64), _P('peer_bases', PTR), _P('rank', np.int32), _P('src', np.int32),
    _P('src_slot_idx', np.int32), _P('dst_slot_idx_at_src', np.int32), _P('num_inflight', np.int32),
    _P('headers_offset', np.uint64), _P('slots_offset', np.uint64), _P('slot_bytes', np.uint64),
    _P('error_record', PTR), _P('pp_error', PTR), _P('timeout_ns', np.uint64)))


def all_specs() -> List[KernelSpec]:
    """Every specialisation of the family (the kernels are not templated on the number of ranks)."""
    return [SEND_SPEC, RECV_SPEC]


def shipped_specs() -> Dict[str, List[KernelSpec]]:
    """Family name → every `KernelSpec` PP may load, for any group of 1 to 8 ranks."""
    return {'pp': all_specs()}


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
    """Symmetric bytes (2 MiB aligned) for PP: `align(align(bytes, 32) * inflight * 2 * 2, 2 MiB)`, DeepEP's
    formula (send and receive buffers for the previous and the next rank). This implementation keeps receive slots
    only and needs about half of it (`PPLayout.num_bytes`); the hint is kept so sizes match upstream."""
    check_int('num_max_tensor_bytes', num_max_tensor_bytes, 1)
    check_int('num_max_inflight_tensors', num_max_inflight_tensors, 1)
    return _align(_align(num_max_tensor_bytes, SLOT_ALIGNMENT) * num_max_inflight_tensors * 2 * 2, BUFFER_ALIGNMENT)


@dataclass(frozen=True)
class PPLayout:
    """Where a receiver keeps its slots (byte offsets from the symmetric base, identical on every rank).

    `[headers: NUM_SOURCES x inflight x HEADER_BYTES, padded][slots: NUM_SOURCES x inflight x slot_bytes]` from
    `data_offset`; source index 0 is the previous rank, 1 the next one (see `neighbour_slot_idx`)."""
    num_max_tensor_bytes: int
    num_max_inflight_tensors: int
    data_offset: int

    @property
    def slot_bytes(self) -> int:
        return _align(self.num_max_tensor_bytes, SLOT_ALIGNMENT)

    @property
    def headers_offset(self) -> int:
        return self.data_offset

    @property
    def slots_offset(self) -> int:
        return self.data_offset + _align(NUM_SOURCES * self.num_max_inflight_tensors * HEADER_BYTES,
                                         HEADER_REGION_ALIGNMENT)

    @property
    def end_offset(self) -> int:
        return self.slots_offset + NUM_SOURCES * self.num_max_inflight_tensors * self.slot_bytes

    @property
    def num_bytes(self) -> int:
        """Bytes of the data region this layout needs."""
        return self.end_offset - self.data_offset

    def slot_offset(self, source_idx: int, slot: int) -> int:
        return self.slots_offset + (source_idx * self.num_max_inflight_tensors + slot) * self.slot_bytes

    def header_offset(self, source_idx: int, slot: int) -> int:
        return self.headers_offset + (source_idx * self.num_max_inflight_tensors + slot) * HEADER_BYTES


def neighbours(rank_idx: int, num_ranks: int) -> Tuple[int, int]:
    """`(previous, next)` rank of `rank_idx` on the ring of `num_ranks` ranks."""
    return (rank_idx - 1) % num_ranks, (rank_idx + 1) % num_ranks


def neighbour_slot_idx(rank_idx: int, peer_rank_idx: int, num_ranks: int) -> int:
    """Index (0: previous rank, 1: next rank) under which `rank_idx` files its neighbour `peer_rank_idx`. With two
    ranks the previous and the next rank are the same one: index 0. `ValueError` if they are not neighbours."""
    prev_idx, next_idx = neighbours(rank_idx, num_ranks)
    if peer_rank_idx == rank_idx or peer_rank_idx not in (prev_idx, next_idx):
        raise ValueError(f'rank {peer_rank_idx} is not a ring neighbour of rank {rank_idx} ({num_ranks} ranks)')
    return 0 if peer_rank_idx == prev_idx else 1


def unmatched_messages(counts: Sequence[Tuple[Dict[int, int], Dict[int, int]]]) -> List[Tuple[int, int, int, int]]:
    """Directed pairs whose sends and receives differ.

    Args:
        counts: per rank, `(num_sent, num_recv)`: dicts from peer rank to the messages sent to / received from it.

    Returns:
        `(src, dst, num_sent, num_received)` for every pair with pending (or over-received) messages.
    """
    out = []
    for src, (num_sent, _) in enumerate(counts):
        peers = set(num_sent) | {dst for dst, (_, num_recv) in enumerate(counts) if src in num_recv}
        for dst in sorted(peers):
            sent, received = num_sent.get(dst, 0), counts[dst][1].get(src, 0)
            if sent != received:
                out.append((src, dst, sent, received))
    return out


def describe_mismatch(record: Sequence[int], rank_idx: int) -> str:
    """The message for a PP error record (layout in kernels_cu/pp.cu, `kPPErrorWords`)."""
    src, seq = int(record[1]), int(record[2]) & 0xFFFFFFFF
    expected = (int(record[3]) & 0xFFFFFFFF) | ((int(record[4]) & 0xFFFFFFFF) << 32)
    sent = (int(record[5]) & 0xFFFFFFFF) | ((int(record[6]) & 0xFFFFFFFF) << 32)
    sent_seq = int(record[7]) & 0xFFFFFFFF
    text = (f'deepep_cupy rank {rank_idx}: pp_recv of message #{seq} from rank {src} got a tensor of {expected} bytes '
            f'but the matching pp_send sent {sent} bytes; nothing was copied into that tensor (sends and receives of '
            f'a pair are matched in call order and must have equal sizes)')
    if sent_seq != seq:
        text += f'. The slot held message #{sent_seq}: the PP protocol lost step (internal error)'
    return text


_TIMEOUT_HINT = (f'[PP: aux {WAIT_SLOT} = pp_send found no free slot (the receiver has not called pp_recv for an '
                 f'older message), aux {WAIT_DATA} = pp_recv found no message (the sender has not called pp_send); '
                 f'expected/seen are message counts of the pair]')


class _PPKernels:
    def __init__(self):
        loaded = load_kernels(all_specs())
        self.send = loaded[SEND_SPEC.name]
        self.recv = loaded[RECV_SPEC.name]


class PPMixin:
    """Pipeline-parallel send/recv for a `BufferBase` subclass (state in `_pp_*` attributes, set by
    `pp_set_config`)."""

    get_pp_buffer_size_hint = staticmethod(get_pp_buffer_size_hint)

    # ---- configuration ---------------------------------------------------------------------------------------------
    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Reserve the data region for PP (collective: every rank calls it with the same values).

        Args:
            num_max_tensor_bytes: most bytes a sent or received tensor may have.
            num_max_inflight_tensors: slots per directed neighbour pair: a sender may be this many messages ahead
                of its receiver; one more `pp_send` waits on the GPU until the receiver takes the oldest.

        Calling it again (every rank, with every sent message received) changes the limits.
        """
        check_int('num_max_tensor_bytes', num_max_tensor_bytes, 1)
        check_int('num_max_inflight_tensors', num_max_inflight_tensors, 1)
        if num_max_inflight_tensors > NUM_MAX_INFLIGHT_TENSORS:
            raise ValueError(f'num_max_inflight_tensors must be <= {NUM_MAX_INFLIGHT_TENSORS}, got '
                             f'{num_max_inflight_tensors}')
        self._pp_check_usable()
        if self.num_ranks < 2:
            raise ValueError(f'PP send/recv needs at least 2 ranks (a ring neighbour), the group has {self.num_ranks}')
        if self.num_scaleout_ranks > 1:
            raise NotImplementedError(f'{self.num_scaleout_ranks} scale-up domains: PP between domains is not '
                                      f'implemented yet; build the buffer with allow_hybrid_mode=False on one '
                                      f'NVLink domain')
        assert self.scaleup_rank_idx == self.rank_idx, 'one scale-up domain: scale-up index == rank'
        layout = PPLayout(num_max_tensor_bytes, num_max_inflight_tensors, self.data_offset)
        if layout.num_bytes > self.num_bytes:
            raise ValueError(
                f'num_bytes={self.num_bytes} is too small for num_max_tensor_bytes={num_max_tensor_bytes}, '
                f'num_max_inflight_tensors={num_max_inflight_tensors}: PP needs {layout.num_bytes} bytes; build the '
                f'buffer with num_bytes=get_pp_buffer_size_hint({num_max_tensor_bytes}, {num_max_inflight_tensors})')
        reconfigure = getattr(self, '_pp_layout', None) is not None
        if not reconfigure:
            self.claim_data_region(DATA_REGION_OWNER)
            kernels = _PPKernels()      # compile now, never inside a timed or collective region
        self.group.check_same('pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors)',
                              (num_max_tensor_bytes, num_max_inflight_tensors), timeout=self.num_cpu_timeout_secs)
        if reconfigure:
            # Slots move: every message must have been received. Cursors stay valid (see kernels_cu/pp.cu).
            self.synchronize()
            pending = unmatched_messages(self.group.allgather_object(
                (self._pp_num_sent, self._pp_num_recv), timeout=self.num_cpu_timeout_secs))
            if pending:
                pairs = ', '.join(f'{s}->{d}: {n} sent, {m} received' for s, d, n, m in pending)
                raise RuntimeError(f'pp_set_config: messages are still in flight ({pairs}); receive them first')
        else:
            self._pp_kernels = kernels
            self._pp_error_memory, self._pp_error = _alloc_error_record(self)
            self._pp_num_sent: Dict[int, int] = {}
            self._pp_num_recv: Dict[int, int] = {}
            self._pp_events = None
        self._pp_layout = layout

    # ---- send / recv -----------------------------------------------------------------------------------------------
    def pp_send(self, x, dst_rank_idx: int, num_sms: int = 0, previous_event=None,
                async_with_compute_stream: bool = False) -> EventOverlap:
        """Send a tensor to a ring neighbour (the next `pp_recv(.., src_rank_idx=this rank)` there receives it).

        Args:
            x: any shape and dtype, contiguous, on this rank's GPU, 16-byte aligned, at most `num_max_tensor_bytes`
                bytes (torch tensor or CuPy array). It must not change until the send has run (the current stream
                waits for it unless `async_with_compute_stream`).
            dst_rank_idx: `(rank ± 1) % num_ranks`.
            num_sms: blocks of the copy kernel (0: every SM of the device).
            previous_event: `EventHandle` the communication stream waits for instead of the current stream.
            async_with_compute_stream: return an event for the caller to wait on instead of making the current stream
                wait (x is kept alive by the event).

        Returns:
            `EventOverlap` (empty unless `async_with_compute_stream`).
        """
        return self._pp_transfer(True, x, dst_rank_idx, num_sms, previous_event, async_with_compute_stream)

    def pp_recv(self, x, src_rank_idx: int, num_sms: int = 0, previous_event=None,
                async_with_compute_stream: bool = False) -> EventOverlap:
        """Receive the next tensor a ring neighbour sent to this rank, into `x`.

        Args:
            x: output, contiguous, on this rank's GPU, 16-byte aligned, exactly as many bytes as the matching sent
                tensor (dtype and shape are up to the caller).
            src_rank_idx: `(rank ± 1) % num_ranks`.
            num_sms, previous_event, async_with_compute_stream: as for `pp_send`.

        Returns:
            `EventOverlap` (empty unless `async_with_compute_stream`).
        """
        return self._pp_transfer(False, x, src_rank_idx, num_sms, previous_event, async_with_compute_stream)

    # ---- internals -------------------------------------------------------------------------------------------------
    def _pp_check_usable(self) -> None:
        """`check_usable` with the PP meaning of a timeout's aux code, then any pending size-mismatch report."""
        try:
            self.check_usable()
        except TimeoutError as e:
            if int(self.error_record[1]) == PHASE_PP:
                raise TimeoutError(f'{e} {_TIMEOUT_HINT}') from None
            raise
        record = getattr(self, '_pp_error', None)
        if record is not None and int(record[0]) != 0:
            if int(record[0]) == -1:        # the kernel is still filling it in (microseconds)
                time.sleep(1e-3)
            message = describe_mismatch(record, self.rank_idx)
            record[:] = 0
            raise RuntimeError(message)

    def _pp_plan(self, is_send: bool, x, peer: int, num_sms: int, previous_event) -> Tuple[Any, int, tuple]:
        """Check one call (raises before any GPU work) and return `(kernel, grid, args)`."""
        name = 'dst_rank_idx' if is_send else 'src_rank_idx'
        self._pp_check_usable()
        layout: Optional[PPLayout] = getattr(self, '_pp_layout', None)
        if layout is None:
            raise RuntimeError(f'call pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors) before '
                               f'{"pp_send" if is_send else "pp_recv"}')
        if isinstance(peer, np.integer):
            peer = int(peer)
        check_int(name, peer)
        if peer >= self.num_ranks:
            raise ValueError(f'{name}={peer} is out of range for {self.num_ranks} ranks')
        try:
            my_slot_for_peer = neighbour_slot_idx(self.rank_idx, peer, self.num_ranks)
        except ValueError:
            prev_idx, next_idx = neighbours(self.rank_idx, self.num_ranks)
            raise ValueError(f'{name}={peer}: rank {self.rank_idx} can only {"send to" if is_send else "receive from"} '
                             f'its ring neighbours {sorted({prev_idx, next_idx})}') from None
        peer_slot_for_me = neighbour_slot_idx(peer, self.rank_idx, self.num_ranks)
        check_int('num_sms', num_sms)
        if previous_event is not None:
            ev = previous_event.event if isinstance(previous_event, EventOverlap) else previous_event
            if not isinstance(ev, EventHandle):
                raise TypeError(f'previous_event must be an EventHandle (buffer.capture()), got {type(ev).__name__}')

        info = interop.tensor_info(x, 'x')
        if info.device != self.device:
            where = 'the host' if info.device < 0 else f'cuda:{info.device}'
            raise ValueError(f'x must be on cuda:{self.device} (this rank\'s GPU), got an array on {where}')
        if not info.is_contiguous():
            raise ValueError(f'x must be contiguous, got shape {list(info.shape)} with strides {list(info.strides)}')
        num_bytes = info.nbytes
        if num_bytes > layout.num_max_tensor_bytes:
            raise ValueError(f'x holds {num_bytes} bytes, more than num_max_tensor_bytes='
                             f'{layout.num_max_tensor_bytes} given to pp_set_config')
        if num_bytes and info.ptr % 16:
            raise ValueError(f'x must start at a 16-byte aligned address, got {info.ptr:#x} (a view at an offset?)')

        num_sms = min(num_sms or self.num_device_sms, self.num_device_sms)
        grid = max(1, min(num_sms, _ceil_div(num_bytes // 16, THREADS * UNROLL)))
        common = (layout.num_max_inflight_tensors, layout.headers_offset, layout.slots_offset, layout.slot_bytes,
                  self.host_mapped.ptr)
        head = (info.ptr, num_bytes, self.sym.peer_bases_ptr, self.rank_idx, peer, my_slot_for_peer, peer_slot_for_me)
        if is_send:
            return self._pp_kernels.send, grid, head + common + (self.timeout_ns,)
        return self._pp_kernels.recv, grid, head + common + (self._pp_error_memory.ptr, self.timeout_ns)

    def _pp_transfer(self, is_send: bool, x, peer: int, num_sms: int, previous_event,
                     async_with_compute_stream: bool) -> EventOverlap:
        kernel, grid, args = self._pp_plan(is_send, x, peer, num_sms, previous_event)
        current, comm = self._pp_streams(x, previous_event)
        kernel.launch(grid, THREADS, args, stream=comm)
        counts = self._pp_num_sent if is_send else self._pp_num_recv
        counts[int(peer)] = counts.get(int(peer), 0) + 1
        return self._pp_finish(current, comm, x, async_with_compute_stream)

    def _pp_streams(self, like, previous_event):
        """The current stream, and the communication stream made to wait for `previous_event` or the current stream."""
        current = interop.current_stream(like)
        comm = self.comm_stream
        if self._pp_events is None:
            import cupy
            self._pp_events = (cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True))
        if previous_event is not None:
            ev = previous_event.event if isinstance(previous_event, EventOverlap) else previous_event
            ev.stream_wait(comm)
        else:
            # A wait captures the event's state when it is enqueued, so one event per direction is reused.
            self._pp_events[0].record(current)
            comm.wait_event(self._pp_events[0])
        return current, comm

    def _pp_finish(self, current, comm, x, async_with_compute_stream: bool) -> EventOverlap:
        if async_with_compute_stream:
            if interop.is_torch(x):
                x.record_stream(interop.torch_stream(comm.ptr))
            return EventOverlap(EventHandle(comm), extra_tensors=(x,))
        self._pp_events[1].record(comm)
        current.wait_event(self._pp_events[1])
        return EventOverlap(None)


def _alloc_error_record(buf) -> Tuple[Any, np.ndarray]:
    """Host-mapped PP error record of one buffer (8 int32), freed when the buffer object is garbage collected.
    BufferBase keeps no per-feature host memory and a mixin cannot hook `destroy()` (BufferBase comes first in the
    MRO), so the record has its own small allocation."""
    from .runtime.symmetric import HostMappedMemory
    memory = HostMappedMemory(4 * ERROR_WORDS)
    finalizer = weakref.finalize(buf, _free_quietly, memory)
    finalizer.atexit = False        # at interpreter exit the CUDA context may already be gone
    return memory, memory.view('int32', ERROR_WORDS)


def _free_quietly(memory) -> None:
    try:
        memory.free()
    except Exception:   # a finalizer must not raise; the process is going away or the context is gone
        pass
