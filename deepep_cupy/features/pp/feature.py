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

Several scale-up domains (hybrid mode): ring pairs inside a domain keep this NVLink path; a pair that crosses domains
gets its own link (links.py): the neighbour's buffer mapped over CUDA IPC (the loopback, one host) running the same
protocol, or NCCL point-to-point on a 2-rank communicator per directed pair, with the bounded waits on the
communication stream and the transfers on side streams (kernels_cu/pp.cu). Same API, FIFO and slot semantics.
"""

import struct
import time
from typing import Any, Dict, NamedTuple, Optional

import numpy as np

from ... import envs
from ...jit.launch import load_kernels
from ...runtime import interop
from ...runtime.checks import check_int
from ...runtime.event import EventOverlap, as_event_handle
from ...runtime.sizes import ceil_div
from .links import LINK_NCCL, HybridPeers, Neighbour, nccl_recv_offsets, next_cursor
from .plan import (
    BUMP_SPEC,
    DATA_REGION_OWNER,
    ERROR_RECORD_OFFSET,
    ERROR_WORDS,
    HEADER_BYTES,
    NUM_MAX_INFLIGHT_TENSORS,
    PHASE_PP,
    RECV_SPEC,
    SEND_SPEC,
    THREADS,
    TIMEOUT_HINT,
    UNROLL,
    WAIT_DATA,
    WAIT_SLOT,
    WAIT_SPEC,
    WORD_CONSUMED_BY,
    WORD_NUM_RECV,
    WORD_NUM_SENT,
    WORD_SENT_FROM,
    PPLayout,
    all_specs,
    describe_mismatch,
    neighbour_slot_idx,
    neighbours,
    unmatched_messages,
)

_X_BYTES = struct.Struct('=QQ')     # the send / receive kernels' x and num_bytes (their first parameters)


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
        self.wait = loaded[WAIT_SPEC.name]
        self.bump = loaded[BUMP_SPEC.name]


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
        self._bound: Dict[Any, Any] = {}     # call signature -> its checked entry with its bound launch (`_entry`)
        self.hybrid: Optional[HybridPeers] = None     # several domains: links, peer table (links.py)
        self._send_cursor: Dict[int, int] = {}       # NCCL neighbours: the host's mirror of the device send cursor

    def destroy(self) -> None:
        self.layout = None
        self._bound = {}
        hybrid, self.hybrid = self.hybrid, None
        if hybrid is not None:
            buf = self._buf
            hybrid.release(getattr(buf, '_failed', None) is not None, buf.num_gpu_timeout_secs)

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
        hybrid = buf.num_scaleout_ranks > 1
        if not hybrid:
            assert buf.scaleup_rank_idx == buf.rank_idx, 'one scale-up domain: scale-up index == rank'
        setting = envs.rail_transport() if hybrid else None
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
            if self.hybrid is not None and not self.hybrid.wait_idle(buf.num_gpu_timeout_secs + 30):
                self.hybrid.abort()
                buf.fail('pp_set_config: the NCCL transfers of PP did not finish')
                raise TimeoutError(f'deepep_cupy rank {buf.rank_idx}: pp_set_config: the NCCL transfers to the '
                                   f'neighbours did not finish; the PP links were aborted')
        else:
            self.kernels = kernels
            if hybrid:
                self.hybrid = HybridPeers(buf, setting)     # collective: IPC handles, NCCL ids and communicators
        if self.hybrid is not None:
            self.hybrid.set_layout(layout)
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
        except (TimeoutError, RuntimeError) as e:
            if self.hybrid is not None:         # a neighbour is missing: NCCL work pending on it must not hang
                self.hybrid.abort()
            if isinstance(e, TimeoutError) and int(buf.error_record[1]) == PHASE_PP:
                raise TimeoutError(f'{e} {TIMEOUT_HINT}') from None
            raise
        record = self.error
        if int(record[0]) != 0:
            if int(record[0]) == -1:        # the kernel is still filling it in (microseconds)
                time.sleep(1e-3)
            message = describe_mismatch(record, buf.rank_idx, getattr(buf, 'error_rank_base', 0))
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

    def _transfer(self, is_send: bool, x, peer: int, num_sms: int, previous_event,
                  async_with_compute_stream: bool) -> EventOverlap:
        buf = self._buf
        if buf._destroyed or buf._failed is not None or buf.error_record[0] or self.error[0]:
            self.check_usable()         # (its conditions read here first)
        # Per call signature (x's kind, shape, strides, dtype and device, the peer, num_sms; `interop.meta`, inlined
        # for a plain torch tensor) `plan` runs once and the launch is bound (`_entry`); a repeated call re-checks only
        # what is per call (usability, x's alignment, previous_event) and patches x's address.
        if type(x) is interop.TORCH_TENSOR[0]:
            key = (is_send, x.shape, x.stride(), x.dtype, x.get_device(), peer, type(peer), num_sms, type(num_sms))
            ptr = x.data_ptr()
        else:
            sig, ptr = interop.meta(x)       # (a torch signature spliced in: the key above, once meta saw torch)
            key = (is_send, *sig, peer, type(peer), num_sms, type(num_sms)) if type(sig) is tuple else \
                (is_send, sig, peer, type(peer), num_sms, type(num_sms))
        e = self._bound.get(key)
        if e is None or e[0] is not self.layout:
            e, ptr = self._entry(key, is_send, x, peer, num_sms, previous_event)
        lay, b, num_bytes, grid, kind, peer, nb = e
        if ptr % 16 and num_bytes:
            raise ValueError(f'x must start at a 16-byte aligned address, got {ptr:#x} (a view at an offset?)')
        event = None if previous_event is None else as_event_handle(previous_event)
        order = buf.stream_order
        current = interop.current_stream(x)
        comm = order.enter(current, event, local=not async_with_compute_stream)
        if nb is None:          # (NVLink or a loopback mapping)
            _X_BYTES.pack_into(b.data, 0, ptr, num_bytes)
            b.grid = grid
            b(comm)
        else:                   # (an NCCL neighbour)
            if not is_send:
                # The receive goes into slot [k_s][0] once the previous message of the pair was copied out of it.
                self._post_nccl_recv(nb, lay, comm.record())
            self._wait(comm, nb, is_send, lay)
            _X_BYTES.pack_into(b.data, 0, ptr, num_bytes)
            b.grid = grid
            b(comm)
            if is_send:
                self._post_nccl_send(nb, lay, comm.record())
        counts = self.num_sent if is_send else self.num_recv
        counts[peer] = counts.get(peer, 0) + 1
        return order.leave(kind, current, comm, async_with_compute_stream, (x,))

    def _entry(self, key, is_send: bool, x, peer: int, num_sms: int, previous_event):
        """`(entry, x's address)`: `plan` of the call, and what its signature fixes: `(layout, the bound send or
        receive launch, x's bytes, grid, x's kind, the peer, its NCCL `Neighbour` or None)`, remembered by `key`
        unless x is of an unknown type (nothing of x is kept)."""
        c = self.plan(is_send, x, peer, num_sms, previous_event)
        lay = c.layout
        b = self._bind(is_send, c, lay)
        assert (b.index('x'), b.index('num_bytes')) == (0, 1), 'pp kernels: x and num_bytes come first'   # `_X_BYTES`
        nb = self.hybrid.neighbours[c.peer] if self.hybrid is not None else None
        e = (lay, b, c.info.nbytes, (c.grid, 1, 1), c.info.kind, c.peer,
             nb if nb is not None and nb.kind == LINK_NCCL else None)
        if type(key[1]) is not object:
            if len(self._bound) >= 64:
                self._bound.clear()
            self._bound[key] = e
        return e, c.info.ptr

    def _bind(self, is_send: bool, c: PPCall, lay: PPLayout):
        """The bound send or receive kernel of one neighbour: over NVLink or a loopback mapping, the protocol of
        kernels_cu/pp.cu with the receiver's slots; over NCCL, a send packs into the outbox (slot index 0 there) and a
        receive reads slot [k_s][0] of this rank, where NCCL delivered the message."""
        buf = self._buf
        peer_bases, rank, peer_idx = buf.sym.peer_bases_ptr, buf.rank_idx, c.peer
        n, headers, slots, slot_bytes = lay.num_max_inflight_tensors, lay.headers_offset, lay.slots_offset, \
            lay.slot_bytes
        at_peer = c.peer_slot_for_me
        if self.hybrid is not None:
            nb = self.hybrid.neighbours[c.peer]
            peer_bases, rank, peer_idx = self.hybrid.table_ptr, buf.scaleup_rank_idx, nb.table_idx
            if nb.kind == LINK_NCCL:
                if is_send:
                    box = self.hybrid.outboxes[c.peer][0]
                    headers, slots, at_peer = box.headers_offset, box.slots_offset, 0
                else:
                    (headers, slots), n, at_peer = nccl_recv_offsets(lay, c.my_slot_for_peer), 1, 1
        common = dict(x=0, num_bytes=0, peer_bases=peer_bases, rank=rank, num_inflight=n, headers_offset=headers,
                      slots_offset=slots, slot_bytes=slot_bytes, error_record=buf.host_mapped.ptr,
                      timeout_ns=buf.timeout_ns)
        if is_send:
            return self.kernels.send.bind(1, THREADS, dst=peer_idx, dst_slot_idx=c.my_slot_for_peer,
                                          src_slot_idx_at_dst=at_peer, **common)
        return self.kernels.recv.bind(1, THREADS, src=peer_idx, src_slot_idx=c.my_slot_for_peer,
                                      dst_slot_idx_at_src=at_peer, pp_error=self.error_ptr, **common)

    def _wait(self, stream, nb: Neighbour, is_send: bool, lay: PPLayout) -> None:
        """The bounded one-thread wait before an NCCL neighbour's send (a free slot: the message num_inflight back
        was delivered) or receive (the message arrived), so the wide kernel never spins next to NCCL's."""
        buf, k = self._buf, nb.slot_idx
        if is_send:
            words = (WORD_CONSUMED_BY + k, WORD_NUM_SENT + k, 1 - lay.num_max_inflight_tensors, WAIT_SLOT)
        else:
            words = (WORD_SENT_FROM + k, WORD_NUM_RECV + k, 1, WAIT_DATA)
        self.kernels.wait.launch(1, 32, stream=stream, peer_bases=self.hybrid.table_ptr, rank=buf.scaleup_rank_idx,
                                 peer=nb.table_idx, wait_word=words[0], count_word=words[1], delta=words[2],
                                 aux=words[3], error_record=buf.host_mapped.ptr, timeout_ns=buf.timeout_ns)

    def _bump(self, word: int):
        return lambda stream: self.kernels.bump.launch(1, 32, stream=stream, word=word)

    def _post_nccl_send(self, nb: Neighbour, lay: PPLayout, after) -> None:
        """Ship the outbox slot the send kernel just filled (header + whole slot), then count it delivered."""
        h = self.hybrid
        box, ptr, _ = h.outboxes[nb.peer]
        slot, self._send_cursor[nb.peer] = next_cursor(self._send_cursor.get(nb.peer, 0), lay.num_max_inflight_tensors)
        h.links.send(nb.peer, [(ptr + box.header(slot), HEADER_BYTES), (ptr + box.slot(slot), box.slot_bytes)], after,
                     self._bump(h.ctrl_word(WORD_CONSUMED_BY + nb.slot_idx)))

    def _post_nccl_recv(self, nb: Neighbour, lay: PPLayout, after) -> None:
        """Receive the next message of the pair into slot [k_s][0] (header + whole slot), then count it arrived."""
        h, k = self.hybrid, nb.slot_idx
        h.links.recv(nb.peer, [(h.own_base + lay.header_offset(k, 0), HEADER_BYTES),
                               (h.own_base + lay.slot_offset(k, 0), lay.slot_bytes)], after,
                     self._bump(h.ctrl_word(WORD_SENT_FROM + k)))
