"""What an engram fetch returns per layer (features/engram/feature.py `Engram.fetch`): a hook that makes the current
stream wait for the fetch and returns the layer's result."""

from typing import Any, Optional, Tuple

from ...runtime import interop
from ...runtime.event import EventHandle
from ...runtime.streams import DeferredMarks, DeferredRecord


class EngramFetchHook:
    """What a fetch returns per layer: calling it makes the current stream wait for the fetch and returns the layer's
    result (`(data, sf)` for DeepEP V2.0's `engram_fetch`; `data`, or `(data, sf)` with scale factors, for V2.5's
    `EngramBuffer.fetch`). May be called more than once, in any order across layers.

    `deferred`: the fetch's torch tensors used on the communication stream (`DeferredRecord`, shared by the layers'
    hooks): marked as used there only when a hook is called on another stream than the fetch's, or when every hook
    was dropped uncalled."""

    __slots__ = ('_event', '_like', '_result', '_keep_alive', '_deferred')

    def __init__(self, event: Optional[EventHandle], like: Any, result: Any, keep_alive: Tuple,
                 deferred: Optional[DeferredRecord] = None):
        self._event, self._like, self._result, self._keep_alive = event, like, result, keep_alive
        self._deferred = deferred

    def __call__(self):
        if self._event is not None:
            stream = interop.current_stream(self._like)
            if self._deferred is not None:
                self._deferred.waited_on(stream)
            self._event.stream_wait(stream)
        return self._result


class SoleFetchHook(EngramFetchHook, DeferredMarks):
    """The hook of a one-layer fetch: its torch tensors' deferred `record_stream` tracked here (`record`, the fetch's
    stream `current` and the communication stream `comm`: `DeferredRecord`'s protocol, one object per fetch instead
    of two)."""

    __slots__ = ('_record', '_current', '_comm')

    def __init__(self, event, like: Any, result: Any, keep_alive: Tuple, record: Tuple, current, comm):
        # (one assignment per slot: a fetch makes one of these, and a tuple assignment costs more bytecodes)
        self._event = event
        self._like = like
        self._result = result
        self._keep_alive = keep_alive
        self._deferred = None
        self._record = record
        self._current = current
        self._comm = comm

    def __call__(self):
        if self._event is not None:
            stream = interop.current_stream(self._like)
            if self._record:
                self._waited_on(stream)
            self._event.stream_wait(stream)
        return self._result
