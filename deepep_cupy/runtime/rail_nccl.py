"""The rail hop over NCCL point-to-point: one communicator per rail (`runtime/rails.py` has the topology, the
exchange plans and the loopback transport; `runtime/rail_watchdog.py` bounds the exchanges no host wait covers)."""

import threading
from typing import Any, Callable, Optional

from .group import ProcessGroup
from .nccl import ABORT_WAIT_SECS, AbortThread
from .rails import HEADER_BYTES, RailPlan, RailTopology, ScaleoutTransport, exchange_rail_unique_ids

# How long `abort` waits for ncclCommAbort before the caller goes on to raise its error (the abort usually returns by
# then; when NCCL holds it up, it finishes in the background and `destroy` waits for it).
ABORT_REPORT_SECS = 0.5


class NcclRailTransport(ScaleoutTransport):
    """The rail hop over NCCL point-to-point: one communicator per rail.

    Args:
        rails: this rank's rails.
        base_ptr: device address of this rank's buffer.
        comm: a `cupy.cuda.nccl.NcclCommunicator` of this rank's rail (N ranks, rank = domain index), or a fake with
            `send`, `recv`, `abort`, `destroy`.
        nccl: the module with `groupStart`, `groupEnd` and `NCCL_UINT8` (default `cupy.cuda.nccl`).
    """

    name = 'NCCL'

    def __init__(self, rails: RailTopology, base_ptr: int, comm: Any, nccl: Any = None):
        super().__init__(rails, base_ptr)
        if nccl is None:
            from .preflight import nccl as _nccl
            nccl = _nccl()
        self.comm, self.nccl = comm, nccl
        # Every call on the communicator holds it: the watchdog thread's abort must never run beside the main
        # thread's enqueue or error query on the same communicator (NCCL does not allow that; an abort frees it).
        self._lock = threading.Lock()
        # `abort` runs once, from whichever thread comes first (the watchdog's, or the caller's); `_abort` is it.
        self._abort_guard = threading.Lock()
        self._abort: Optional[AbortThread] = None
        # Called after each chunk's group with (chunk, stream): pipelining bumps a chunk counter there (P2).
        self.after_chunk: Optional[Callable[[int, Any], None]] = None
        # Bounds exchanges no host wait covers (runtime/rail_watchdog.py); `watch_timeouts` sets it.
        self.watchdog: Any = None
        # The phase of the latest exchange (named when NCCL reports an error between calls), and the error that
        # ended the transport, if any (a watchdog timeout or NCCL's error; stored before the abort).
        self.last_phase = 'connect'
        self.failure: Optional[BaseException] = None

    def watch_timeouts(self, timeout_s: float, events: Any = None) -> None:
        """Bound every exchange enqueued outside a CUDA-graph capture by `timeout_s` from the host: a rail peer
        that never arrives aborts the communicator (no hang) and the next call raises `TimeoutError` naming the
        phase and the peers. `events`: the watchdog's event operations (default: CUDA events on this device)."""
        from .rail_watchdog import CudaEvents, RailWatchdog
        if events is None:
            import cupy
            events = CudaEvents(cupy.cuda.runtime.getDevice())
        self.watchdog = RailWatchdog(timeout_s, self._watchdog_fired, events, probe=self._probe)
        self.watchdog.start()

    def _probe(self) -> None:
        """The watchdog's check of NCCL's asynchronous error, between exchanges too (CUDA-graph replays enqueue
        nothing the watchdog could time): a rail peer whose process died closes its sockets, NCCL records the
        error, and this aborts the communicator, so the replay's NCCL kernels return and the next call (and
        `buffer.synchronize()`) raises naming the rail peers. Skipped while the main thread holds the
        communicator."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            check = getattr(self.comm, 'check_async_error', None)
            if check is None or self.aborted:
                return
            try:
                check()
                return
            except Exception as e:  # noqa: BLE001 (NCCL's error, reported below with the peers)
                reason = f'{type(e).__name__}: {e}'
        finally:
            self._lock.release()
        self._nccl_failed(self.last_phase, reason)

    def _nccl_failed(self, phase: str, reason: str) -> RuntimeError:
        """NCCL reported an error (`reason`) during or after the rail exchange of `phase`: store the error naming the
        phase and the rail peers (the watchdog's, so every later call raises it), abort, and return it."""
        peers = self.rails.peer_domains
        ranks = [self.rails.rail_rank_of(m) for m in peers]
        error = RuntimeError(f'rank {self.rails.rank}: hybrid {phase}: NCCL reported an error on the rail with peer '
                             f'rank{"s" if len(ranks) > 1 else ""} {", ".join(map(str, ranks))} (domains {peers}, '
                             f'scale-up index {self.rails.scaleup_idx}): {reason}; a rail peer died or left, the '
                             f'NCCL rail transport was aborted (build a new buffer)')
        self.failure = error
        self.abort()
        return error

    def _watchdog_fired(self, phase: str, peer_domains) -> BaseException:
        ranks = [self.rails.rail_rank_of(m) for m in peer_domains]
        peers = (f'rail peer rank {ranks[0]} (domain {peer_domains[0]}' if len(ranks) == 1 else
                 f'rail peer ranks {ranks} (domains {list(peer_domains)}')
        error = TimeoutError(f'rank {self.rails.rank}: hybrid rail {phase}: the NCCL exchange with {peers}, scale-up '
                            f'index {self.rails.scaleup_idx}) did not complete within {self.watchdog.timeout_s:.1f} '
                            f's; a peer never arrived, the NCCL rail transport was aborted (build a new buffer)')
        # Stored before the abort: a caller that sees the transport aborted finds this error, not a bare one.
        self.failure = error
        self.abort()
        return error

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.watchdog is not None:
            self.watchdog.raise_if_failed()       # (the watchdog's own failure: it could not start, a query failed)
        super()._check_usable()

    @classmethod
    def create(cls, world: ProcessGroup, rails: RailTopology, base_ptr: int, nccl: Any = None,
               stream: Any = None, scratch_ptr: Optional[int] = None) -> 'NcclRailTransport':
        """Make this rank's rail communicator and connect it to every rail peer (`connect`; a host collective of
        the world: every rank calls it). Two ranks of one rail may share a GPU only as different NCCL hosts
        (`NCCL_HOSTID`); ranks of one domain may. With an injected `nccl` (tests) it connects only when `stream`
        and `scratch_ptr` are given too."""
        real = nccl is None
        if real:
            from .preflight import nccl as _nccl
            nccl = _nccl()
        uid = exchange_rail_unique_ids(world, rails, nccl.get_unique_id)
        comm = nccl.NcclCommunicator(rails.num_domains, uid, rails.domain_idx)
        transport = cls(rails, base_ptr, comm, nccl)
        try:
            if real or (stream is not None and scratch_ptr is not None):
                transport.connect(stream, scratch_ptr)
        except BaseException:
            transport.abort()
            raise
        return transport

    def connect(self, stream: Any = None, scratch_ptr: Optional[int] = None) -> None:
        """Open NCCL's connections to every rail peer now: one group of a header-sized send and receive with each.

        NCCL connects point-to-point peers lazily, inside the `groupEnd` of their first transfer, and that host call
        blocks until the peer makes its own first call to this rank. Left to the first dispatch, a rail peer that
        never comes blocks the host inside `groupEnd`, before any bounded wait (the missing-rank hang seen on 1xH100
        over NCCL sockets), and a first transfer inside a CUDA-graph capture would connect during the capture.

        Args:
            stream: an object with `.ptr` and `.synchronize()` (default a new non-blocking CuPy stream).
            scratch_ptr: device memory of `HEADER_BYTES * (num_domains + 1)` bytes (default allocated here).
        """
        peers = self.rails.peer_domains
        if not peers:
            return
        keep = None
        if stream is None or scratch_ptr is None:
            import cupy
            stream = stream or cupy.cuda.Stream(non_blocking=True)
            if scratch_ptr is None:
                keep = cupy.zeros(HEADER_BYTES * (self.rails.num_domains + 1), dtype=cupy.uint8)
                scratch_ptr = keep.data.ptr
        uint8 = self.nccl.NCCL_UINT8
        self.nccl.groupStart()
        try:
            for m in peers:
                self.comm.send(scratch_ptr, HEADER_BYTES, uint8, m, stream.ptr)
                self.comm.recv(scratch_ptr + HEADER_BYTES * (1 + m), HEADER_BYTES, uint8, m, stream.ptr)
        finally:
            self.nccl.groupEnd()
        stream.synchronize()
        del keep

    def exchange(self, plan: RailPlan, stream: Any) -> None:
        self._check_usable()
        nccl, uint8 = self.nccl, self.nccl.NCCL_UINT8
        failure = None
        start = None
        if self.watchdog is not None and plan.num_chunks:
            start = self.watchdog.begin(stream.ptr)     # the exchange's bound runs from when the stream reaches it
        with self._lock:
            self._check_usable()            # (the watchdog may have aborted meanwhile)
            self.last_phase = plan.phase
            try:
                for c in range(plan.num_chunks):
                    nccl.groupStart()
                    try:
                        for op in plan.chunk_ops(c):
                            fn = self.comm.send if op.kind == 'send' else self.comm.recv
                            fn(self.base_ptr + op.offset, op.num_bytes, uint8, op.peer, stream.ptr)
                    finally:
                        nccl.groupEnd()
                    if self.after_chunk is not None:
                        self.after_chunk(c, stream)
            except Exception as e:
                if type(e).__name__ != 'NcclError':
                    raise
                failure = e                 # NCCL already saw a peer go (e.g. NCCL_ERROR_REMOTE_ERROR)
        if failure is not None:
            raise self._nccl_failed(plan.phase, f'{type(failure).__name__}: {failure}') from failure
        if self.watchdog is not None and plan.num_chunks:
            self.watchdog.watch(stream.ptr, plan.phase, plan.peers, start=start)

    def check(self) -> None:
        """Raise the watchdog's timeout, or NCCL's asynchronous error, if any (host polling loops call it while
        they wait)."""
        self._check_usable()
        reason = None
        with self._lock:
            check = getattr(self.comm, 'check_async_error', None)
            if check is not None and not self.aborted:
                try:
                    check()
                except Exception as e:  # noqa: BLE001 (NCCL's error, raised below with the phase and the peers)
                    reason = f'{type(e).__name__}: {e}'
        if reason is not None:
            raise self._nccl_failed(self.last_phase, reason)

    def abort(self) -> None:
        """`ncclCommAbort` once, from whichever thread comes first, in a helper thread (`nccl.AbortThread`, holding
        the communicator's lock: the holder of an enqueue finishes it first): waited for `ABORT_REPORT_SECS` here,
        then left to finish in the background, so that the error is raised at once even where NCCL holds the abort up
        (on 1xH100 over sockets, 20 s while a CUDA-graph replay's NCCL kernels were in flight). The transport counts
        as aborted from the start: no other call reaches the communicator. `destroy` waits for the abort."""
        with self._abort_guard:
            if self.aborted:
                return
            self.aborted = True
            if self.comm is None:
                return
            self._abort = AbortThread(self.comm, 'the NCCL rail communicator', self._lock)
        self._abort.thread.join(ABORT_REPORT_SECS)

    def wait_aborted(self, limit: float = ABORT_WAIT_SECS) -> bool:
        """Wait (bounded) for an abort begun by `abort`; whether NCCL's kernels of this communicator can be taken as
        gone (no abort begun, or it returned)."""
        return self._abort is None or self._abort.wait(limit)

    def destroy(self, abort_wait_secs: float = ABORT_WAIT_SECS) -> None:
        """Stop the watchdog, wait (at most `abort_wait_secs`) for an abort in flight, and destroy the communicator if
        it was never aborted. An abort that does not return leaves the communicator (and its lock) to the process's
        exit."""
        if self.watchdog is not None:
            self.watchdog.close()
        if not self.wait_aborted(abort_wait_secs):
            self.comm = None
            return
        with self._lock:
            if self.comm is not None:
                comm, self.comm = self.comm, None
                if not self.aborted:
                    comm.destroy()
