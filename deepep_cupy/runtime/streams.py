"""Stream ordering between the caller's stream and a buffer's communication stream, written once for every feature.

A call enters with `begin`: the communication stream waits for `previous_event` (when given) or for the caller's
current stream. It leaves with `end` (the current stream waits for the communication stream) or `event` (an
`EventOverlap` the caller waits on later; torch tensors used on the communication stream are marked with
`record_stream` so torch's allocator does not reuse them early). Two events are reused for every call: a stream wait
captures the event's state when it is enqueued, so re-recording it afterwards is safe.
"""

from typing import Any, Optional, Sequence

from . import interop
from .event import EventHandle, EventOverlap


class StreamOrder:
    """The ordering helpers of one communication stream.

    Args:
        comm: the buffer's communication stream (a `cupy.cuda.Stream`).
    """

    __slots__ = ('comm', '_enter', '_leave')

    def __init__(self, comm):
        self.comm = comm
        self._enter = self._leave = None

    def _events(self):
        import cupy
        self._enter = cupy.cuda.Event(disable_timing=True)
        self._leave = cupy.cuda.Event(disable_timing=True)

    def begin(self, current, previous_event: Optional[EventHandle] = None):
        """Make the communication stream wait for `previous_event`, or for `current` without one; returns it."""
        comm = self.comm
        if previous_event is not None:
            previous_event.stream_wait(comm)
        else:
            if self._enter is None:
                self._events()
            self._enter.record(current)
            comm.wait_event(self._enter)
        return comm

    def end(self, current) -> None:
        """Make `current` wait for everything enqueued on the communication stream so far."""
        if self._leave is None:
            self._events()
        self._leave.record(self.comm)
        current.wait_event(self._leave)

    def event(self, kind: str, record: Sequence[Any] = (), keep: Sequence[Any] = ()) -> EventOverlap:
        """An `EventOverlap` on the communication stream keeping `keep` alive; torch tensors of `record` (when `kind`
        is 'torch') are marked as used on the communication stream."""
        if kind == 'torch' and record:
            s = interop.torch_stream(self.comm.ptr)
            for t in record:
                t.record_stream(s)
        return EventOverlap(EventHandle(self.comm), extra_tensors=tuple(keep))

    def finish(self, kind: str, current, async_with_compute_stream: bool, tensors: Sequence[Any]) -> EventOverlap:
        """DeepEP's end of a call: with `async_with_compute_stream`, an event holding (and recorded on) `tensors`
        (None entries skipped); else the current stream waits and the event is empty."""
        if async_with_compute_stream:
            live = tuple(t for t in tensors if t is not None)
            return self.event(kind, live, live)
        self.end(current)
        return EventOverlap(None)
