"""CUDA events for compute/communication overlap (DeepEP's `EventHandle` and `EventOverlap`)."""

import functools
from typing import Any, Callable, Optional, Sequence

from . import interop

# Events of dropped `EventHandle`s per (stream handle, current device): an event is reused only where it was made
# (CUDA events belong to one device, and the default stream's handle is the same on every device), so that a call
# returning an event does not create one (cudaEventCreate ~1.6 us on the GPU host, a record 0.9 us). Re-recording a
# reused event is safe: nobody holds its handle any more, and a stream wait already enqueued captured the state it
# waited for.
_FREE_EVENTS = {}
_MAX_FREE_PER_STREAM = 16


_RUNTIME = []       # cupy.cuda.runtime, imported once (an import statement per call costs ~1 us on the GPU host)


def _current_device() -> int:
    if not _RUNTIME:
        import cupy
        _RUNTIME.append(cupy.cuda.runtime)
    return _RUNTIME[0].getDevice()


def _new_event():
    """A fresh CUDA event without timing (the one place events of `EventHandle`s are created)."""
    import cupy
    return cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)


class EventHandle:
    """A CUDA event recorded on a stream (default: the current stream, torch's when torch is in use).

    Args:
        stream: a CuPy stream object to record on; default `interop.current_stream()`.

    The event comes from a pool of events of dropped handles of the same stream (made when the pool is empty) and
    goes back to it when this handle is dropped.
    """

    def __init__(self, stream=None):
        self.stream = stream = stream if stream is not None else interop.current_stream()
        key = self._pool_key = (stream.ptr, _current_device())
        try:
            event = _FREE_EVENTS[key].pop()     # (pop is atomic: threads never share an event)
        except (KeyError, IndexError):
            event = _new_event()
        self.event = event
        event.record(stream)

    def __del__(self):
        try:
            key, event = self._pool_key, self.event
            if event is None:
                return
            free = _FREE_EVENTS.get(key)
            if free is None:
                free = _FREE_EVENTS.setdefault(key, [])
            if len(free) < _MAX_FREE_PER_STREAM:
                free.append(event)
        except Exception:       # made without __init__, or the interpreter is shutting down: nothing to give back
            pass

    def current_stream_wait(self, like: Any = None) -> None:
        """Make the current stream (torch's if `like` is a torch tensor or torch is in use) wait for this event."""
        interop.current_stream(like).wait_event(self.event)

    def stream_wait(self, stream) -> None:
        """Make `stream` (a CuPy stream object) wait for this event."""
        stream.wait_event(self.event)

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.done


class EventOverlap:
    """An event plus the arrays that must stay alive until the current stream has waited on it.

    `current_stream_wait()` makes the current stream wait, then runs the hook registered with
    `register_hook_after_wait` once (e.g. a deferred deterministic sort). `with ev:` runs the body concurrently with
    the communication and waits on exit. `wait()` waits and returns the hook's result (V2.5).

    Args:
        event: an `EventHandle` (None: nothing to wait for).
        extra_tensors: arrays kept alive until the wait.
    """

    # Class-level defaults: `empty_overlap()` makes an instance without running `__init__` (the common return of a
    # synchronous call; the attributes an instance sets later shadow these).
    event = None
    extra_tensors = None
    hook_after_wait = None
    _release_handle_by_call = False

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Sequence[Any]] = None):
        self.event = event
        self.extra_tensors = tuple(extra_tensors) if extra_tensors is not None else None
        self.hook_after_wait: Optional[Callable] = None
        self._release_handle_by_call = False

    def register_hook_after_wait(self, hook_after_wait: Callable) -> None:
        if self.hook_after_wait is not None:
            raise ValueError('register_hook_after_wait: a hook is already registered on this event')
        self.hook_after_wait = hook_after_wait

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        if self.event is None:
            raise ValueError('current_stream_wait: this EventOverlap holds no event (it was released or is empty)')
        self.event.current_stream_wait()
        return self._after_wait(release_handle)

    def _after_wait(self, release_handle: bool) -> Any:
        """What follows the stream wait: the registered hook (run once; its result returned), then the release."""
        result = None
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            result = hook()
        if release_handle:
            self.event = None
            self.extra_tensors = None
        return result

    def wait(self) -> Any:
        """Wait on the current stream and return the registered hook's result (None without a hook)."""
        return self.current_stream_wait()

    def __call__(self, release_handle: bool = False) -> 'EventOverlap':
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> 'EventOverlap':
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


# `EventOverlap(None)` without the Python-level `__init__` (a C call: the class defaults above hold its state).
empty_overlap = functools.partial(object.__new__, EventOverlap)


def as_event_handle(previous_event) -> Optional[EventHandle]:
    """The `EventHandle` of `previous_event` (an `EventHandle`, an `EventOverlap` holding one, or None);
    `TypeError` naming the argument otherwise."""
    if previous_event is None:
        return None
    event = previous_event.event if isinstance(previous_event, EventOverlap) else previous_event
    if not isinstance(event, EventHandle):
        raise TypeError(f'previous_event must be an EventHandle (buffer.capture()), got {type(event).__name__}')
    return event
