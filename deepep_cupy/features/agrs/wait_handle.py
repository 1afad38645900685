"""What the collectives return (features/agrs/feature.py): the wait handle of `all_gather`, the `EventOverlap` of
`reduce_scatter` / `all_reduce`. Both track the torch tensors a call used on the communication stream as
`runtime/streams.py` `DeferredRecord` does (inline: one object per call instead of three)."""

import struct
from functools import partial
from typing import Any, Tuple

from ...runtime import interop
from ...runtime.event import EventOverlap
from ...runtime.streams import DeferredMarks

# agrs_wait_kernel's epoch and meta: adjacent uint32 parameters (checked when the launch is bound).
_EPOCH_META = struct.Struct('=II')


class AGRSWaitHandle(DeferredMarks):
    """Returned by `all_gather`: call it (on the stream that will read the outputs) before using the outputs. It
    launches one small kernel that waits, bounded, until every rank's bytes of that call have arrived.

    The handle keeps the call's sources alive until it is called. `record` (the torch sources among them; () for
    other arrays), which the gather kernels read on the communication stream `comm`, are tracked as a
    `runtime/streams.py` `DeferredRecord` would (inline here: one object per call): the wait kernel returns only after
    this rank's own gather signalled, i.e. after the gather kernels finished reading the sources, so called on the
    call's stream `current` the handle orders their last use there and no `record_stream` is needed; called on
    another stream, or dropped uncalled, it marks them as used on the communication stream."""

    __slots__ = ('_call', '_keep_alive', '_record', '_current', '_comm')

    def __init__(self, call: Tuple[Any, int, int, int, Any], keep_alive: Tuple[Any, ...], record: Tuple[Any, ...],
                 current: Any, comm: Any):
        # (one assignment per slot: a tuple assignment costs two more bytecodes per call)
        self._call = call       # (feature, session_idx, epoch, meta, like): what the wait reads, set once
        self._keep_alive = keep_alive
        self._record = record   # (the torch sources of keep_alive)
        self._current = current
        self._comm = comm

    def __call__(self) -> None:
        st, session_idx, epoch, meta, like = self._call
        if st.session_idx != session_idx or not st.plan.is_open:
            raise RuntimeError('this all-gather\'s session was destroyed: call the wait handle before '
                               'destroy_agrs_session() (the outputs are invalid now)')
        buf = st._buf
        if buf._destroyed or buf._failed is not None or buf.error_record[0]:
            st._check_usable()
        stream = interop.current_stream(like)
        if self._record:            # (`_waited_on` inline)
            current = self._current
            if stream is not current and stream.ptr != current.ptr:
                self.mark()
            self._record = ()
        w = st._wait_launch or self._bind(st)
        st._wait_pack(epoch, meta)
        w(stream)
        self._keep_alive = ()

    @staticmethod
    def _bind(st):
        """The wait kernel's bound launch (by name, once per feature; per call the epoch and meta change, packed by
        `st._wait_pack(epoch, meta)`)."""
        buf = st._buf
        w = st._wait_launch = st.kernels['wait'].bind(
            1, 32, peer_bases=buf.sym.peer_bases_ptr, rank=buf.sym.local_idx, epoch=0, meta=0,
            error_record=buf.host_mapped.ptr, timeout_ns=buf.timeout_ns)
        i = w.index('epoch')
        assert w.index('meta') == i + 1, 'agrs_wait_kernel: epoch and meta adjacent'
        st._wait_pack = partial(_EPOCH_META.pack_into, w.data, 4 * i)       # (epoch's byte offset)
        return w


class ReductionOverlap(DeferredMarks, EventOverlap):
    """The `EventOverlap` of a `reduce_scatter` / `all_reduce`: waiting on it returns the result (the first time, as
    a hook registered with `register_hook_after_wait` would, which is why another hook cannot be registered before).
    `record`: the torch tensors the call used on the communication stream `comm`, ordered by a wait on `current`.

    Args:
        event: the `EventHandle` recorded on the communication stream after the call's kernels.
        keep: arrays kept alive until the wait; result: what the wait returns.
    """

    hook_after_wait = None              # (`EventOverlap`'s per-instance defaults, here per class: set when used)
    _release_handle_by_call = False

    def __init__(self, event, keep: Tuple[Any, ...], result: Any, record: Tuple[Any, ...], current, comm):
        self.event, self.extra_tensors, self._result = event, keep, result
        self._record, self._current, self._comm = record, current, comm

    def register_hook_after_wait(self, hook_after_wait) -> None:
        if self._result is not None:
            raise ValueError('register_hook_after_wait: a hook is already registered on this event')
        super().register_hook_after_wait(hook_after_wait)

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        event = self.event
        if event is None:
            raise ValueError('current_stream_wait: this EventOverlap holds no event (it was released or is empty)')
        stream = interop.current_stream()
        if self._record:            # (`_waited_on` inline)
            current = self._current
            if stream is not current and stream.ptr != current.ptr:
                self.mark()
            self._record = ()
        event.stream_wait(stream)
        result = self._result
        if result is None:          # (waited before: a hook registered since then runs)
            return self._after_wait(release_handle)
        self._result = None
        if release_handle:
            self.event = self.extra_tensors = None
        return result

    wait = current_stream_wait      # (`EventOverlap.wait` without its extra frame: the result, None after the first)
