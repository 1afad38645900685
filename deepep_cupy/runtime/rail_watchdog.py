"""A host watchdog over NCCL rail exchanges that no host wait covers.

With CPU sync the host polls the notify's counts, bounded, and aborts the rail communicators on timeout. Without it
(no-sync and cached dispatches, combines, barriers) nothing on the host waits for an exchange: a rail peer that never
arrives leaves NCCL's kernels spinning, and the caller's next synchronisation hangs. The watchdog closes that hole as
torch's NCCL watchdog does: every exchange enqueued outside a CUDA-graph capture records an event before its first
group and one after its last; a daemon thread queries the pending events, and an exchange still pending `timeout_s`
after its stream reached it (the first event completed) aborts the transport
(`ncclCommAbort`, which NCCL allows from another thread: the spinning kernels return, so the synchronisation that
hung returns too) and stores a `TimeoutError` naming the phase and the rail peers, raised by the transport's next
call. Exchanges captured into a CUDA graph are not watched (a replay does not pass through Python). The bound runs
from the exchange's start, not from its enqueue: kernels before it on the stream may wait for a peer of the domain
themselves (bounded by the GPU timeout), and that wait, naming the peer it waited for, must report first (seen on
1xH100 over NCCL sockets: a rank whose domain peer died reported its rail peer instead, both bounds being 8 s).

The thread puts itself in thread-local stream-capture mode before its first query (as torch's NCCL watchdog does):
in the default global mode, an event query from any thread while another thread captures a CUDA graph invalidates
that capture (`cudaErrorStreamCaptureInvalidated`, seen on 1xH100 in hybrid P1 over NCCL sockets).

CUDA is reached through an injectable `events` object (create / record / query / destroy), so the logic is tested on
the CPU (tests/test_rails_cpu.py).
"""

import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1      # CUstreamCaptureMode (cuda.h)


def thread_local_capture_mode(lib: Any = None) -> None:
    """Set the calling thread's stream-capture interaction mode to thread-local (`cuThreadExchangeStreamCaptureMode`,
    the driver call behind `cudaThreadExchangeStreamCaptureMode`): this thread's unsafe calls (event queries) no
    longer invalidate captures begun in global mode by other threads. `lib`: the driver library (default
    libcuda.so.1); raises RuntimeError when the call fails."""
    import ctypes
    if lib is None:
        from .preflight import _load_libcuda
        lib = _load_libcuda()
    mode = ctypes.c_int(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    rc = lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
    if rc != 0:
        raise RuntimeError(f'cuThreadExchangeStreamCaptureMode failed with CUresult {rc}')


class CudaEvents:
    """The watchdog's events through the CUDA runtime (CuPy), made on `device`."""

    def __init__(self, device: int):
        self.device = device

    def create(self) -> int:
        import cupy
        rt = cupy.cuda.runtime
        return rt.eventCreateWithFlags(rt.eventDisableTiming)

    def record(self, event: int, stream_ptr: int) -> None:
        import cupy
        cupy.cuda.runtime.eventRecord(event, stream_ptr)

    def query(self, event: int) -> bool:
        import cupy
        rt = cupy.cuda.runtime
        return rt.eventQuery(event) == 0          # cudaSuccess; cudaErrorNotReady otherwise

    def destroy(self, event: int) -> None:
        import cupy
        cupy.cuda.runtime.eventDestroy(event)

    def bind_thread(self) -> None:
        """Make the watchdog thread's current device the transport's (event queries need its context), and its
        stream-capture mode thread-local, so its queries never invalidate another thread's graph capture."""
        import cupy
        cupy.cuda.runtime.setDevice(self.device)
        thread_local_capture_mode()

    def capturing(self, stream_ptr: int) -> bool:
        import cupy
        rt = cupy.cuda.runtime
        return rt.streamIsCapturing(stream_ptr) != rt.streamCaptureStatusNone


class RailWatchdog:
    """Bounds stream-ordered exchanges from the host.

    Args:
        timeout_s: how long an exchange may stay pending after it was enqueued.
        on_timeout: `(phase, peers) -> BaseException`, called once from the watchdog thread for the first exchange
            that times out: aborts the transport and returns the error to store.
        events: the event operations (`CudaEvents` or a fake).
        poll_s: the thread's polling interval.
    """

    def __init__(self, timeout_s: float, on_timeout: Callable[[str, Sequence[int]], BaseException], events: Any,
                 poll_s: float = 0.005, probe: Optional[Callable[[], None]] = None, probe_s: float = 0.1):
        if not timeout_s > 0:
            raise ValueError(f'timeout_s must be positive, got {timeout_s}')
        self.timeout_s, self.on_timeout, self.events, self.poll_s = float(timeout_s), on_timeout, events, poll_s
        self.error: Optional[BaseException] = None
        # (end event, start event or None, deadline or None until the start completed, phase, peers)
        self._pending: List[Tuple[int, Optional[int], Optional[float], str, Tuple[int, ...]]] = []
        self._pool: List[int] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        # Called from the thread every `probe_s` while nothing failed (e.g. NCCL's asynchronous error); it stores
        # its own error in `self.error`.
        self.probe, self.probe_s = probe, probe_s

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _record(self, stream_ptr: int) -> Optional[int]:
        """An event (from the pool) recorded on `stream_ptr`; None inside a CUDA-graph capture (not watched)."""
        self.raise_if_failed()
        capturing = getattr(self.events, 'capturing', None)
        if capturing is not None and capturing(stream_ptr):
            return None
        with self._lock:
            event = self._pool.pop() if self._pool else self.events.create()
        self.events.record(event, stream_ptr)
        return event

    def begin(self, stream_ptr: int) -> Optional[int]:
        """Record the event that marks an exchange's start on `stream_ptr` (before its first group); pass it to
        `watch`. None inside a CUDA-graph capture (not watched)."""
        return self._record(stream_ptr)

    def watch(self, stream_ptr: int, phase: str, peers: Sequence[int], start: Optional[int] = None) -> None:
        """Record an event on `stream_ptr` after an exchange with `peers` (rail peer domains) and bound it: from the
        completion of `start` (`begin`'s event), or, without one, from now."""
        event = self._record(stream_ptr)
        if event is None:
            return
        deadline = None if start is not None else time.monotonic() + self.timeout_s
        with self._lock:
            self._pending.append((event, start, deadline, phase, tuple(peers)))
        self.start()
        self._wake.set()

    def start(self) -> None:
        """Start the thread (the first `watch` does; with a probe, the owner starts it at once)."""
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name='deepep_cupy-rail-watchdog', daemon=True)
                self._thread.start()

    def poll(self, now: Optional[float] = None) -> None:
        """One pass (the thread's loop body; tests call it directly): retire completed exchanges, start the bound of
        those their stream reached, fire on the first one past its deadline."""
        now = time.monotonic() if now is None else now
        expired = None
        with self._lock:
            keep = []
            for item in self._pending:
                event, start, deadline, phase, peers = item
                if self.events.query(event):
                    self._pool.append(event)
                    if start is not None:
                        self._pool.append(start)
                    continue
                if deadline is None and self.events.query(start):
                    deadline = now + self.timeout_s
                    item = (event, start, deadline, phase, peers)
                if deadline is not None and deadline <= now and expired is None and self.error is None:
                    expired = item
                keep.append(item)   # (the aborted exchange's events stay pending until the abort lands)
            self._pending = keep
        if expired is not None:
            self.error = self.on_timeout(expired[3], expired[4])

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _run(self) -> None:
        bind = getattr(self.events, 'bind_thread', None)
        if bind is not None:
            try:
                bind()
            except Exception as e:      # without the device or the capture mode, its queries would do harm
                self.error = RuntimeError(f'rail watchdog could not start: {e}')
                return
        next_probe = 0.0
        while not self._closed:
            if self.probe is not None and self.error is None and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + self.probe_s
                try:
                    self.probe()
                except Exception as e:  # noqa: BLE001 (a failing probe: stop probing, say why)
                    self.error = self.error or RuntimeError(f'rail watchdog probe failed: {e}')
            if self.num_pending == 0:
                self._wake.wait(self.probe_s if self.probe is not None else 0.1)
                self._wake.clear()
                continue
            try:
                self.poll()
            except Exception as e:          # a failing query (e.g. the context is gone): stop watching
                self.error = self.error or RuntimeError(f'rail watchdog stopped: {e}')
                return
            time.sleep(self.poll_s)

    def close(self) -> None:
        """Stop the thread and free the events (after the streams finished the watched work)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
        with self._lock:
            events = [e for item in self._pending for e in item[:2] if e is not None] + self._pool
            self._pending, self._pool = [], []
        for e in events:
            try:
                self.events.destroy(e)
            except Exception:
                pass
