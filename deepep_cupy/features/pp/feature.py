"""Pipeline-parallel send/recv between ring neighbours: the PP feature of a buffer (kernels_cu/pp.cu for the
protocol, plan.py for sizes, layout and bookkeeping).

A rank sends to and receives from its ring neighbours only. Every directed pair is a FIFO: the k-th
`pp_recv(x, src)` on rank d receives the k-th `pp_send(t, d)` of rank src. The receiver owns
`num_max_inflight_tensors` slots per source neighbour in its symmetric memory; `pp_send` pushes the bytes straight
into the next free slot over NVLink (one kernel) and waits on the GPU, bounded, while all slots are full; `pp_recv`
waits for the message and copies it into the tensor. Both run on the buffer's communication stream, ordered after the
current stream. Per-pair counters live on the GPU, so the host launches carry no sequence numbers. A size mismatch
can only be seen on the GPU: nothing is copied, the message is consumed, and the next PP call on the receiving rank
raises `RuntimeError` describing the pair and both sizes.
"""

import dataclasses
import time
from typing import Any, Dict, NamedTuple, Optional

import numpy as np

from ...jit.launch import load_kernels
from ...runtime import interop
from ...runtime.checks import check_int
from ...runtime.event import EventOverlap, as_event_handle
from ...runtime.sizes import ceil_div
from .plan import (
    DATA_REGION_OWNER,
    ERROR_RECORD_OFFSET,
    ERROR_WORDS,
    NUM_MAX_INFLIGHT_TENSORS,
    PHASE_PP,
    RECV_SPEC,
    SEND_SPEC,
    THREADS,
    TIMEOUT_HINT,
    UNROLL,
    PPLayout,
    all_specs,
    describe_mismatch,
    neighbour_slot_idx,
    neighbours,
    unmatched_messages,
)


class PPCall(NamedTuple):
    """A checked `pp_send` / `pp_recv`: the tensor, the peer and both sides' neighbour indices of the pair, the grid,
    the slot layout and the event the communication stream waits for."""
    info: Any
    peer: int
    my_slot_for_peer: int       # the peer's neighbour index as seen by this rank
    peer_slot_for_me: int       # this rank's neighbour index as seen by the peer
    grid: int
    layout: PPLayout
    event: Any


class PPKernels:
    def __init__(self):
        loaded = load_kernels(all_specs())
        self.send = loaded[SEND_SPEC.name]
        self.recv = loaded[RECV_SPEC.name]


class PP:
    """The PP feature of one buffer: its slot layout (set by `set_config`), kernels, message counts per neighbour
    and the host-mapped mismatch record.

    Args:
        buf: the buffer (a `BufferBase`).
    """

    def __init__(self, buf):
        self._buf = buf
        self.layout: Optional[PPLayout] = None
        self.kernels: Optional[PPKernels] = None
        self.num_sent: Dict[int, int] = {}
        self.num_recv: Dict[int, int] = {}
        self.error_ptr = buf.host_mapped.ptr + ERROR_RECORD_OFFSET
        self.error = buf.host_mapped.view('int32', ERROR_WORDS, ERROR_RECORD_OFFSET)
        self._bound: Dict[Any, Any] = {}     # (send?, peer) -> bound launch, its patched words, its layout

    def destroy(self) -> None:
        self.layout = None
        self._bound = {}

    # ---- configuration -------------------------------------------------------------------------------------------
    def set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Reserve the data region for PP (collective: every rank calls it with the same values).

        Args:
            num_max_tensor_bytes: most bytes a sent or received tensor may have.
            num_max_inflight_tensors: slots per directed neighbour pair: a sender may be this many messages ahead
                of its receiver; one more `pp_send` waits on the GPU until the receiver takes the oldest.

        Calling it again (every rank, with every sent message received) changes the limits.
        """
        buf = self._buf
        check_int('num_max_tensor_bytes', num_max_tensor_bytes, 1)
        check_int('num_max_inflight_tensors', num_max_inflight_tensors, 1)
        if num_max_inflight_tensors > NUM_MAX_INFLIGHT_TENSORS:
            raise ValueError(f'num_max_inflight_tensors must be <= {NUM_MAX_INFLIGHT_TENSORS}, got '
                             f'{num_max_inflight_tensors}')
        self.check_usable()
        if buf.num_ranks < 2:
            raise ValueError(f'PP send/recv needs at least 2 ranks (a ring neighbour), the group has {buf.num_ranks}')
        if buf.num_scaleout_ranks > 1:
            raise NotImplementedError(f'{buf.num_scaleout_ranks} scale-up domains: PP between domains is not '
                                      f'implemented yet; build the buffer with allow_hybrid_mode=False on one '
                                      f'NVLink domain')
        assert buf.scaleup_rank_idx == buf.rank_idx, 'one scale-up domain: scale-up index == rank'
        layout = PPLayout(num_max_tensor_bytes, num_max_inflight_tensors, buf.data_offset)
        if layout.num_bytes > buf.num_bytes:
            raise ValueError(
                f'num_bytes={buf.num_bytes} is too small for num_max_tensor_bytes={num_max_tensor_bytes}, '
                f'num_max_inflight_tensors={num_max_inflight_tensors}: PP needs {layout.num_bytes} bytes; build the '
                f'buffer with num_bytes=get_pp_buffer_size_hint({num_max_tensor_bytes}, {num_max_inflight_tensors})')
        reconfigure = self.layout is not None
        if not reconfigure:
            buf.claim_data_region(DATA_REGION_OWNER)
            kernels = PPKernels()      # compile now, never inside a timed or collective region
        buf.group.check_same('pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors)',
                             (num_max_tensor_bytes, num_max_inflight_tensors), timeout=buf.num_cpu_timeout_secs)
        if reconfigure:
            # Slots move: every message must have been received. Cursors stay valid (see kernels_cu/pp.cu).
            buf.synchronize()
            pending = unmatched_messages(buf.group.allgather_object(
                (self.num_sent, self.num_recv), timeout=buf.num_cpu_timeout_secs))
            if pending:
                pairs = ', '.join(f'{s}->{d}: {n} sent, {m} received' for s, d, n, m in pending)
                raise RuntimeError(f'pp_set_config: messages are still in flight ({pairs}); receive them first')
        else:
            self.kernels = kernels
        self.layout = layout

    # ---- send / recv ---------------------------------------------------------------------------------------------
    def send(self, x, dst_rank_idx: int, num_sms: int = 0, previous_event=None,
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
        return self._transfer(True, x, dst_rank_idx, num_sms, previous_event, async_with_compute_stream)

    def recv(self, x, src_rank_idx: int, num_sms: int = 0, previous_event=None,
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
        return self._transfer(False, x, src_rank_idx, num_sms, previous_event, async_with_compute_stream)

    # ---- internals -----------------------------------------------------------------------------------------------
    def check_usable(self) -> None:
        """The buffer's `check_usable` with the PP meaning of a timeout's aux code, then any pending size-mismatch
        report."""
        buf = self._buf
        try:
            buf.check_usable()
        except TimeoutError as e:
            if int(buf.error_record[1]) == PHASE_PP:
                raise TimeoutError(f'{e} {TIMEOUT_HINT}') from None
            raise
        record = self.error
        if int(record[0]) != 0:
            if int(record[0]) == -1:        # the kernel is still filling it in (microseconds)
                time.sleep(1e-3)
            message = describe_mismatch(record, buf.rank_idx)
            record[:] = 0
            raise RuntimeError(message)

    def plan(self, is_send: bool, x, peer: int, num_sms: int, previous_event) -> PPCall:
        """Check one call (raises before any GPU work) and size it."""
        buf = self._buf
        name = 'dst_rank_idx' if is_send else 'src_rank_idx'
        self.check_usable()
        layout = self.layout
        if layout is None:
            raise RuntimeError(f'call pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors) before '
                               f'{"pp_send" if is_send else "pp_recv"}')
        if isinstance(peer, np.integer):
            peer = int(peer)
        check_int(name, peer)
        if peer >= buf.num_ranks:
            raise ValueError(f'{name}={peer} is out of range for {buf.num_ranks} ranks')
        try:
            my_slot_for_peer = neighbour_slot_idx(buf.rank_idx, peer, buf.num_ranks)
        except ValueError:
            prev_idx, next_idx = neighbours(buf.rank_idx, buf.num_ranks)
            raise ValueError(f'{name}={peer}: rank {buf.rank_idx} can only {"send to" if is_send else "receive from"} '
                             f'its ring neighbours {sorted({prev_idx, next_idx})}') from None
        peer_slot_for_me = neighbour_slot_idx(peer, buf.rank_idx, buf.num_ranks)
        check_int('num_sms', num_sms)
        event = as_event_handle(previous_event)

        info = interop.tensor_info(x, 'x')
        if info.device != buf.device:
            where = 'the host' if info.device < 0 else f'cuda:{info.device}'
            raise ValueError(f'x must be on cuda:{buf.device} (this rank\'s GPU), got an array on {where}')
        if not info.is_contiguous():
            raise ValueError(f'x must be contiguous, got shape {list(info.shape)} with strides {list(info.strides)}')
        num_bytes = info.nbytes
        if num_bytes > layout.num_max_tensor_bytes:
            raise ValueError(f'x holds {num_bytes} bytes, more than num_max_tensor_bytes='
                             f'{layout.num_max_tensor_bytes} given to pp_set_config')
        if num_bytes and info.ptr % 16:
            raise ValueError(f'x must start at a 16-byte aligned address, got {info.ptr:#x} (a view at an offset?)')

        num_sms = min(num_sms or buf.num_device_sms, buf.num_device_sms)
        grid = max(1, min(num_sms, ceil_div(num_bytes // 16, THREADS * UNROLL)))
        return PPCall(info, peer, my_slot_for_peer, peer_slot_for_me, grid, layout, event)

    def _planned(self, is_send: bool, x, peer: int, num_sms: int, previous_event):
        """`(plan, x's address)`: `plan` once per call signature (x's kind, shape, strides, dtype and device, the peer,
        num_sms and the layout); a repeated call re-checks only what is per call (usability, x's alignment,
        previous_event)."""
        sig, ptr = interop.meta(x)
        key = (is_send, sig, peer, type(peer), num_sms, type(num_sms))
        calls = self.__dict__.setdefault('_planned_calls', {})
        c = calls.get(key)
        if c is None or c.layout is not self.layout:
            c = self.plan(is_send, x, peer, num_sms, previous_event)
            if type(sig) is not object:
                if len(calls) >= 64:
                    calls.clear()
                calls[key] = c._replace(info=dataclasses.replace(c.info, ptr=0, obj=None), event=None)   # x not kept
            return c, c.info.ptr
        self.check_usable()
        if ptr % 16 and c.info.nbytes:
            raise ValueError(f'x must start at a 16-byte aligned address, got {ptr:#x} (a view at an offset?)')
        return c._replace(event=as_event_handle(previous_event)), ptr

    def _transfer(self, is_send: bool, x, peer: int, num_sms: int, previous_event,
                  async_with_compute_stream: bool) -> EventOverlap:
        c, ptr = self._planned(is_send, x, peer, num_sms, previous_event)
        buf, lay, info = self._buf, c.layout, c.info
        order = buf.stream_order
        current = interop.current_stream(x)
        comm = order.enter(current, c.event, local=not async_with_compute_stream)
        key = (is_send, c.peer)
        bound = self._bound.get(key)
        if bound is None or bound[3] is not lay:    # bound by name once per (direction, peer) and layout; per call
            # x, its size and the grid change
            if is_send:
                b = self.kernels.send.bind(
                    1, THREADS, x=0, num_bytes=0, peer_bases=buf.sym.peer_bases_ptr, rank=buf.rank_idx, dst=c.peer,
                    dst_slot_idx=c.my_slot_for_peer, src_slot_idx_at_dst=c.peer_slot_for_me,
                    num_inflight=lay.num_max_inflight_tensors, headers_offset=lay.headers_offset,
                    slots_offset=lay.slots_offset, slot_bytes=lay.slot_bytes, error_record=buf.host_mapped.ptr,
                    timeout_ns=buf.timeout_ns)
            else:
                b = self.kernels.recv.bind(
                    1, THREADS, x=0, num_bytes=0, peer_bases=buf.sym.peer_bases_ptr, rank=buf.rank_idx, src=c.peer,
                    src_slot_idx=c.my_slot_for_peer, dst_slot_idx_at_src=c.peer_slot_for_me,
                    num_inflight=lay.num_max_inflight_tensors, headers_offset=lay.headers_offset,
                    slots_offset=lay.slots_offset, slot_bytes=lay.slot_bytes, error_record=buf.host_mapped.ptr,
                    pp_error=self.error_ptr, timeout_ns=buf.timeout_ns)
            bound = self._bound[key] = (b, b.index('x'), b.index('num_bytes'), lay)
        b, i_x, i_bytes, _ = bound
        b.u64[i_x], b.u64[i_bytes] = ptr, info.nbytes
        b.grid = (c.grid, 1, 1)
        b(comm)
        counts = self.num_sent if is_send else self.num_recv
        counts[c.peer] = counts.get(c.peer, 0) + 1
        return order.leave(info.kind, current, comm, async_with_compute_stream, (x,))
