"""Stream ordering between the caller's stream and a buffer's communication stream, written once for every feature.

A call enters with `begin`: the communication stream waits for `previous_event` (when given) or for the caller's
current stream. It leaves with `end` (the current stream waits for the communication stream) or `event` (an
`EventOverlap` the caller waits on later; torch tensors used on the communication stream are marked with
`record_stream` so torch's allocator does not reuse them early). The events are reused for every call: a stream wait
captures the event's state when it is enqueued, so re-recording it afterwards is safe.

A call that would wait on both sides and hand back no event (no `previous_event`, not asynchronous, outputs not
allocated on the communication stream) runs on the caller's stream instead (`enter(..., local=True)` / `leave`): the
same order for everything the caller can see, one event record instead of four records / waits. What the
communication stream gave up is its role as the buffer's single queue, so the order keeps:
- the *tail*: the stream known to be ordered after every kernel the buffer enqueued (None: only the communication
  stream is). A local call on another stream first joins (`begin` + `end`: the fork / join a CUDA graph capture
  accepts), paid only when the stream changes;
- the *mark*: an event recorded right after the kernels of the last local call, which the communication stream
  waits for before its next work (`begin`, also with `previous_event`) and before host waits and teardown
  (`settle`: `BufferBase.synchronize`, `_release_local`, `get_comm_stream`). So the communication stream depends on
  exactly what it did when every kernel ran on it (its earlier work and `previous_event`), never on compute the
  caller enqueued after a local call.
Joining a stream during a torch graph capture (an eager tail folded into the communication stream, in global,
thread-local or relaxed mode) is allowed: with torch 2.11 the capture and its replay succeed.
"""

from typing import Any, Optional, Sequence, Tuple

from .. import envs
from . import interop
from .event import EventHandle, EventOverlap, empty_overlap


class StreamOrder:
    """The ordering helpers of one communication stream.

    Args:
        comm: the buffer's communication stream (a `cupy.cuda.Stream`).
        always_comm_stream: every call on `comm` (`DesignKnobs.always_comm_stream`; None: read the environment).
    """

    __slots__ = ('comm', '_enter', '_leave', '_mark', '_tail', '_marked', '_mark_captured', 'local')

    def __init__(self, comm, always_comm_stream: Optional[bool] = None):
        self.comm = comm
        self._enter = self._leave = self._mark = None
        self._tail = None           # a stream ordered after every kernel of the buffer (None: only `comm` is)
        self._marked = False        # local kernels ran since `comm` last waited for `_mark`
        self._mark_captured = False     # `_mark` was recorded inside a CUDA graph capture
        if always_comm_stream is None:
            always_comm_stream = envs.always_comm_stream()
        self.local = not always_comm_stream     # whether `enter` may run a call on the caller's stream

    def _events(self):
        import cupy
        self._enter = cupy.cuda.Event(disable_timing=True)
        self._leave = cupy.cuda.Event(disable_timing=True)
        self._mark = cupy.cuda.Event(disable_timing=True)

    def _wait_mark(self, current) -> None:
        """The communication stream waits for the last local call's mark where CUDA allows it: an event recorded
        inside a graph capture is a node of that graph (no eager stream may wait for it once the capture ended), and a
        stream already joined to a capture may not wait for eager work (cudaErrorStreamCaptureIsolation). Across such
        a boundary there is nothing to order: the graph's kernels run when it is launched."""
        comm = self.comm
        if self._mark_captured:
            ok = comm.is_capturing() or (current is not None and current.is_capturing())
        else:
            ok = not comm.is_capturing()
        if ok:
            comm.wait_event(self._mark)
        self._marked = False

    def begin(self, current, previous_event: Optional[EventHandle] = None):
        """Make the communication stream wait for `previous_event`, or for `current` without one (and for the last
        local call's kernels); returns it."""
        comm = self.comm
        if self._enter is None:
            self._events()
        if self._marked:
            self._wait_mark(current)
        self._tail = None
        if previous_event is not None:
            previous_event.stream_wait(comm)
        else:
            self._enter.record(current)
            comm.wait_event(self._enter)
        return comm

    def end(self, current) -> None:
        """Make `current` wait for everything enqueued on the communication stream so far."""
        if self._leave is None:
            self._events()
        self._leave.record(self.comm)
        current.wait_event(self._leave)
        self._tail = current

    def enter(self, current, previous_event: Optional[EventHandle] = None, local: bool = False):
        """The stream a call runs on: `current` when `local` (the call is synchronous and allocates on `current`),
        there is no `previous_event` and `DEEPEP_CUPY_ALWAYS_COMM_STREAM` is off (joined first when `current` is not
        the tail); else `begin`. Pair it with `leave`."""
        if local and previous_event is None and self.local:
            tail = self._tail
            if tail is not current and (tail is None or tail.ptr != current.ptr):
                self.begin(current)
                self.end(current)
            return current
        return self.begin(current, previous_event)

    def leave(self, kind: str, current, stream, async_with_compute_stream: bool,
              tensors: Sequence[Any] = (), captured: Optional[bool] = None) -> EventOverlap:
        """`finish` of a call that ran on `stream` (what `enter` returned): after a local call, the mark is recorded
        behind its kernels (nothing to wait for). `captured`: whether `current` is capturing a CUDA graph, when the
        caller knows (None: `current` is asked; an EP CPU-sync dispatch passes False: its host waited for what its
        kernels wrote, which a captured kernel would not have run)."""
        if async_with_compute_stream:
            live = tuple(t for t in tensors if t is not None)
            return self.event(kind, live, live)
        if stream is not current:
            self.end(current)
        elif stream is not self.comm:
            self._mark.record(current)
            self._marked = True
            self._mark_captured = current.is_capturing() if captured is None else captured
        return empty_overlap()

    def settle(self):
        """The communication stream, ordered after every kernel the buffer enqueued (on it or on a caller's stream):
        what host waits and teardown wait for. Returns it."""
        if self._marked:
            self._wait_mark(None)
        return self.comm

    def event(self, kind: str, record: Sequence[Any] = (), keep: Sequence[Any] = ()) -> EventOverlap:
        """An `EventOverlap` on the communication stream keeping `keep` alive; torch tensors of `record` (when `kind`
        is 'torch') are marked as used on the communication stream."""
        if kind == 'torch' and record:
            s = interop.torch_stream(self.comm.ptr)
            for t in record:
                t.record_stream(s)
        return EventOverlap(EventHandle(self.comm), extra_tensors=tuple(keep))

    def scoped_event(self, kind: str, current, record: Sequence[Any] = (), keep: Sequence[Any] = ()) -> EventOverlap:
        """`event`, for a call that `begin` ordered after `current` (or after a `previous_event`): torch tensors of
        `record` are marked as used on the communication stream only if the event is waited on another stream than
        `current`, or dropped unwaited (`DeferredRecord`); `keep` must hold them."""
        if kind == 'torch' and record:
            return DeferredRecordOverlap(EventHandle(self.comm), keep,
                                         DeferredRecord(tuple(record), current, self.comm))
        return EventOverlap(EventHandle(self.comm), extra_tensors=tuple(keep))

    def finish(self, kind: str, current, async_with_compute_stream: bool, tensors: Sequence[Any]) -> EventOverlap:
        """DeepEP's end of a call: with `async_with_compute_stream`, an event holding (and recorded on) `tensors`
        (None entries skipped); else the current stream waits and the event is empty."""
        if async_with_compute_stream:
            live = tuple(t for t in tensors if t is not None)
            return self.event(kind, live, live)
        self.end(current)
        return empty_overlap()


class DeferredMarks:
    """The deferred `record_stream` of `DeferredRecord` (below, which explains it) as a mixin, also for an object a
    call returns anyway (one object per call instead of two): its `_record` (torch tensors used on `_comm`, not yet
    ordered) and `_current` (the call's stream), in the subclass's slots. Waited on `_current`: nothing to do; on
    another stream (`_waited_on`), or dropped unwaited, `record_stream` on the communication stream then (`mark`)."""

    __slots__ = ()

    def _waited_on(self, stream) -> None:
        current = self._current
        if stream is not current and stream.ptr != current.ptr:
            self.mark()
        self._record = ()

    def mark(self) -> None:
        """Mark the tracked tensors as used on the communication stream (once)."""
        tensors, self._record = self._record, ()
        if tensors:
            s = interop.torch_stream(self._comm.ptr)
            for t in tensors:
                t.record_stream(s)

    def __del__(self):
        if self._record:
            try:
                self.mark()
            except Exception:       # interpreter shutdown: nothing left to protect
                pass


class DeferredRecord(DeferredMarks):
    """Torch tensors that a call used on the communication stream `comm`, between the caller's stream `current` and
    a completion the caller waits for later (an event, a wait kernel), held until then.

    Waited for on `current`, their last use on `comm` is ordered before everything `current` does afterwards, which is
    where torch's allocator reuses memory freed on `current` (the stream a caller's tensors are normally allocated
    on): no `record_stream` is needed, as for any kernel of `current`. Waited for on another stream, or dropped
    without a wait, they are marked as used on `comm` then (`record_stream` only takes effect when the memory is
    freed, so marking late is as good as at the launch, as long as they are alive, which this object ensures).
    A tensor allocated on a third stream is the caller's to order, as for any use on `current`; so is freeing a
    tensor's storage explicitly (`untyped_storage().resize_(0)`) before the wait, which `record_stream` at the launch
    would have covered."""

    __slots__ = ('_record', '_current', '_comm')

    def __init__(self, tensors: Tuple[Any, ...], current, comm):
        self._record, self._current, self._comm = tensors, current, comm

    def waited_on(self, stream) -> None:
        """The completion was made a dependency of `stream` (a CuPy stream object)."""
        if self._record:
            self._waited_on(stream)


class DeferredRecordOverlap(EventOverlap):
    """An `EventOverlap` whose tensors' `record_stream` is a `DeferredRecord` (`StreamOrder.scoped_event`)."""

    def __init__(self, event, extra_tensors: Sequence[Any], deferred: DeferredRecord):
        super().__init__(event, extra_tensors)
        self._deferred = deferred

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        deferred = self._deferred
        if deferred is None or self.event is None:
            return super().current_stream_wait(release_handle)
        stream = interop.current_stream()
        deferred.waited_on(stream)
        self._deferred = None
        self.event.stream_wait(stream)
        return self._after_wait(release_handle)


def wait_device_idle(device: int, limit: float) -> Optional[BaseException]:
    """Wait, bounded, until every stream of this process on `device` is idle (`cudaDeviceSynchronize` in a helper
    thread, joined for at most `limit` seconds): a failed buffer's teardown does it before freeing memory that
    kernels on other streams than its own may still use (rail exchanges on the caller's stream, NCCL kernels queued
    behind a timed-out wait). Returns None once idle, or the CUDA error the synchronisation raised (e.g. a sticky
    `cudaErrorIllegalAddress`: the context is lost); raises TimeoutError if the device is still busy at the bound."""
    import threading
    outcome = []

    def run():
        import cupy
        try:
            cupy.cuda.runtime.setDevice(device)
            cupy.cuda.runtime.deviceSynchronize()
            outcome.append(None)
        except Exception as e:  # noqa: BLE001 (returned to the caller, which reports it)
            outcome.append(e)
    thread = threading.Thread(target=run, name='deepep_cupy-device-idle', daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        raise TimeoutError(f'device {device} was still busy {limit:g} s into the teardown of a failed buffer')
    return outcome[0]
