"""`BufferBase`: what every deepep_cupy buffer stands on.

Builds, in order: the host process group, a configuration check across ranks (before any CUDA work, so a
misconfigured rank fails with a clear error on every rank instead of hanging), the rank → GPU binding, the topology,
the symmetric memory `[workspace | num_bytes]`, a host-mapped area (error record and the records the host polls), the
communication stream and the GPU barrier (compiled here, never inside a timed or collective region). The map of the
workspace and of the host-mapped area is kernels_cu/common/workspace.cuh (mirrored by runtime/workspace.py).

Memory of one rank:
    symmetric (GPU): [workspace 2 MiB | data region: num_bytes | extra region: num_extra_bytes]
    host storage:    num_host_bytes of pinned host memory every rank of the scale-up domain maps (optional)
The data region belongs to one feature at a time (`claim_data_region`); the extra region to the subclass that asked
for it (V2.5 `EPBuffer`: the load-balancing pools; `EngramBuffer`: GPU tables).
"""

import sys
from typing import Any, Dict, Optional

from ..constants import BUFFER_ALIGNMENT
from ..envs import DesignKnobs
from ..features.barrier import Barrier
from ..runtime import errors, interop, workspace
from ..runtime.checks import check_int
from ..runtime.event import EventHandle
from ..runtime.group import ProcessGroup, get_group
from ..runtime.host_storage import HostStorage
from ..runtime.polling import wait_until
from ..runtime.streams import StreamOrder, wait_device_idle
from ..runtime.symmetric import HostMappedMemory, SymmetricMemory, soft_barriers
from ..runtime.topology import Topology, detect_topology, select_device

WORKSPACE_BYTES = workspace.WORKSPACE_BYTES
HOST_MAPPED_BYTES = workspace.HOST_MAPPED_BYTES
assert WORKSPACE_BYTES == BUFFER_ALIGNMENT

# Communication streams of destroyed buffers, per device, for reuse. Streams are never destroyed: torch may still hold
# events recorded on them for tensors it frees later (record_stream), and destroying the stream first would make
# those frees fail at exit.
_STREAM_POOL = {}


def _acquire_stream(device: int):
    import cupy
    pool = _STREAM_POOL.setdefault(device, [])
    return pool.pop() if pool else cupy.cuda.Stream(non_blocking=True)


def _release_stream(device: int, stream) -> None:
    _STREAM_POOL.setdefault(device, []).append(stream)


def check_configuration(group: ProcessGroup, what: str, settings: Dict[str, Any], timeout: float) -> DesignKnobs:
    """The design knobs of this rank (`DesignKnobs.from_env`), after checking in one all-gather that `settings` and
    the design knobs are the same on every rank of `group` (`ValueError` otherwise: a knob's names the knob)."""
    design = DesignKnobs.from_env()
    gathered = group.allgather_object((settings, design.wire()), timeout=timeout)
    group.check_identical(what, [g[0] for g in gathered])
    DesignKnobs.check_alike([g[1] for g in gathered], group.rank)
    return design


class BufferBase:
    """Symmetric memory, streams and a GPU barrier over a group of ranks.

    Args:
        group: a `torch.distributed` ProcessGroup (or a deepep_cupy `ProcessGroup`); `comm`: an mpi4py communicator.
            Neither: `MPI.COMM_WORLD` when started by mpirun, else a single process.
        num_bytes: bytes of symmetric memory per rank beyond the workspace; a multiple of 2 MiB, the same on every rank.
        allow_hybrid_mode: NVLink inside a scale-up domain and NCCL between domains (False: one direct domain).
        num_cpu_timeout_secs: bound on host waits; num_gpu_timeout_secs: bound on GPU spin-waits.
        explicitly_destroy: if True, memory is released only by `destroy()` (collective; every rank calls it). If
            False, a buffer that is garbage-collected frees its own memory (locally, without the other ranks).
        device: CUDA device of this rank (default: `DEEPEP_CUPY_DEVICE`, else local rank modulo the device count).
        config: further settings that must be identical on every rank (checked at construction).
        comm_stream: a `cupy.cuda.Stream` to use as the communication stream (buffers that share one, such as the
            engines of a DeepEP V1 `Buffer`); it stays the caller's. Default: one of the pool's.
        num_extra_bytes: symmetric bytes after the data region (a multiple of 2 MiB), for the subclass.
        num_host_bytes: bytes of host storage per rank (a multiple of 2 MiB; 0: none), see `runtime/host_storage.py`.
    """

    _destroyed = True           # until construction completes (also for a constructor that raised)
    explicitly_destroy = True
    _owns_stream = True         # the communication stream returns to the pool at teardown
    num_extra_bytes = num_host_bytes = 0
    host_storage: Optional[HostStorage] = None
    _rail_barrier = None        # hybrid mode: the barrier along the rails (features/hybrid)
    error_rank_base = 0         # global rank of this domain's scale-up index 0 (timeout messages)
    design = DesignKnobs()      # the design knobs (immutable; read from the environment at construction)

    def __init__(self, group=None, comm=None, num_bytes: int = 0, allow_hybrid_mode: bool = True,
                 num_cpu_timeout_secs: float = 300, num_gpu_timeout_secs: float = 100,
                 explicitly_destroy: bool = False, device: Optional[int] = None,
                 config: Optional[Dict[str, Any]] = None, num_extra_bytes: int = 0, num_host_bytes: int = 0,
                 comm_stream=None):
        for name, value in (('num_bytes', num_bytes), ('num_extra_bytes', num_extra_bytes),
                            ('num_host_bytes', num_host_bytes)):
            check_int(name, value)
            if value % BUFFER_ALIGNMENT != 0:
                raise ValueError(f'{name} must be a multiple of {BUFFER_ALIGNMENT} (2 MiB), got {value}')
        if not num_gpu_timeout_secs > 0 or not num_cpu_timeout_secs > 0:
            raise ValueError('num_gpu_timeout_secs and num_cpu_timeout_secs must be positive')
        self._destroyed = True      # until construction completes
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_bytes = num_bytes
        self.num_extra_bytes = num_extra_bytes
        self.num_host_bytes = num_host_bytes
        self.host_storage: Optional[HostStorage] = None
        self.num_cpu_timeout_secs = float(num_cpu_timeout_secs)
        self.num_gpu_timeout_secs = float(num_gpu_timeout_secs)
        self.allow_hybrid_mode = bool(allow_hybrid_mode)

        self.group: ProcessGroup = get_group(group, comm, timeout=self.num_cpu_timeout_secs)
        self.rank_idx, self.num_ranks = self.group.rank, self.group.size
        settings = {'class': type(self).__name__, 'num_bytes': num_bytes, 'num_extra_bytes': num_extra_bytes,
                    'num_host_bytes': num_host_bytes, 'allow_hybrid_mode': self.allow_hybrid_mode,
                    'num_gpu_timeout_secs': self.num_gpu_timeout_secs, **(config or {})}
        self.design = check_configuration(self.group, f'{type(self).__name__} configuration', settings,
                                          self.num_cpu_timeout_secs)

        # select_device checks the host first (preflight.check_cuda): no driver, no CuPy, no NVRTC or no GPU raise its
        # one-line SetupError, so CuPy is imported only after it
        self.device = select_device(self.group, device)
        import cupy
        self.topology: Topology = detect_topology(self.group, self.device, self.allow_hybrid_mode)
        t = self.topology
        self.num_scaleup_ranks, self.num_scaleout_ranks = t.num_scaleup_ranks, t.num_scaleout_ranks
        self.scaleup_rank_idx, self.scaleout_rank_idx = t.scaleup_rank_idx, t.scaleout_rank_idx

        self.host_mapped = HostMappedMemory(HOST_MAPPED_BYTES)
        self.error_record = self.host_mapped.view('int32', errors.ERROR_RECORD_WORDS,
                                                  workspace.HOST_ERROR_RECORD.offset)
        try:
            self.sym = SymmetricMemory(self.group, t.scaleup_peers, WORKSPACE_BYTES + num_bytes + num_extra_bytes)
        except BaseException:
            self.host_mapped.free()
            raise
        if num_host_bytes:
            try:
                self.host_storage = HostStorage(self.group, t.scaleup_peers, num_host_bytes)
            except BaseException:
                self.sym.destroy(timeout=self.num_cpu_timeout_secs)
                self.host_mapped.free()
                raise
        self._owns_stream = comm_stream is None
        self.comm_stream = _acquire_stream(self.device) if comm_stream is None else comm_stream
        self.stream_order = StreamOrder(self.comm_stream, self.design.always_comm_stream)
        self._barrier = Barrier(self.sym, self.host_mapped.ptr, self.timeout_ns, with_tests=True)
        # No world NCCL communicator (ranks of several domains may share a GPU, which NCCL refuses): between scale-up
        # domains the barrier goes along the rails of the hybrid feature (`_rail_barrier`, set by it).
        self.nccl = None
        self._rail_barrier = None
        # Kernels of a domain report scale-up indices; the timeout message adds this to name global ranks.
        self.error_rank_base = self.scaleout_rank_idx * self.num_scaleup_ranks
        self.num_device_sms = cupy.cuda.Device(self.device).attributes['MultiProcessorCount']
        self._data_region_owner: Optional[str] = None
        self._failed: Optional[str] = None
        self._destroyed = False
        self.group.barrier(timeout=self.num_cpu_timeout_secs)

    # Properties and small helpers
    @property
    def timeout_ns(self) -> int:
        return int(self.num_gpu_timeout_secs * 1e9)

    @property
    def data_offset(self) -> int:
        """Byte offset of the user region (after the workspace) inside the symmetric buffer."""
        return WORKSPACE_BYTES

    @property
    def extra_offset(self) -> int:
        """Byte offset of the extra region (after the data region) inside the symmetric buffer."""
        return WORKSPACE_BYTES + self.num_bytes

    # DeepEP V2.5's `BufferBase` surface
    @property
    def runtime(self):
        """What owns this rank's memory and streams: the buffer itself while it lives, None once destroyed (DeepEP:
        its C++ runtime)."""
        return None if self._destroyed else self

    @property
    def main_context(self):
        """The first communication context (one group; `BucketBuffer` has one per group), None once destroyed."""
        contexts = getattr(self, 'contexts', None)
        if self._destroyed:
            return None
        return contexts[0] if contexts else self

    def memory_usage(self) -> Dict[str, int]:
        """Bytes this rank holds: `workspace`, `data` (the data region), `extra`, `host` storage, `host_mapped`."""
        return {'workspace': WORKSPACE_BYTES, 'data': self.num_bytes, 'extra': self.num_extra_bytes,
                'host': self.num_host_bytes, 'host_mapped': HOST_MAPPED_BYTES}

    def print_memory_usage(self) -> None:
        """Print this rank's workspace, communication buffer and storage sizes (DeepEP V2.5)."""
        if self._destroyed:
            raise RuntimeError('this deepep_cupy buffer was destroyed')
        usage = self.memory_usage()
        mib = {k: v / (1 << 20) for k, v in usage.items()}
        print(f'{type(self).__name__} rank {self.rank_idx}/{self.num_ranks}: workspace {mib["workspace"]:.1f} MiB, '
              f'buffer {mib["data"]:.1f} MiB, extra {mib["extra"]:.1f} MiB (GPU, symmetric); host storage '
              f'{mib["host"]:.1f} MiB; host-mapped {mib["host_mapped"]:.3f} MiB', flush=True)

    def get_comm_stream(self):
        """The buffer's communication stream (a `cupy.cuda.Stream`; `torch.cuda.ExternalStream(s.ptr)` for torch),
        ordered after every kernel of the buffer so far (synchronous calls may have run on the caller's stream)."""
        return self.stream_order.settle()

    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on the current stream (pass it as `previous_event`)."""
        return EventHandle()

    def get_physical_domain_size(self):
        """`(num_scaleout, num_scaleup)` of the hardware (before `DEEPEP_CUPY_SCALEUP_SIZE`)."""
        p = self.topology.physical_scaleup
        return self.num_ranks // p, p

    def get_logical_domain_size(self):
        """`(num_scaleout, num_scaleup)` this buffer uses."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def claim_data_region(self, owner: str) -> None:
        """Reserve the data region `[data_offset, data_offset + num_bytes)` for one feature (EP dispatch/combine,
        PP, all-gather sessions, engram, load balancing): features lay out their slots from `data_offset` and cannot
        share one buffer. Raises `RuntimeError` naming the current owner when another feature holds it."""
        if self._data_region_owner not in (None, owner):
            raise RuntimeError(f'this buffer\'s symmetric memory is already used by {self._data_region_owner}; '
                               f'{owner} needs a buffer of its own')
        self._data_region_owner = owner

    def is_usable(self) -> bool:
        """Neither destroyed nor failed, and no rail transport gave up (without looking at the error record)."""
        return not self._destroyed and self._failed is None and not self._transports_failed()

    def fail(self, reason: str) -> None:
        """Mark the buffer unusable (a wait timed out): every later call raises `RuntimeError` with `reason`."""
        self._failed = reason

    def check_usable(self) -> None:
        """Raise if the buffer was destroyed or a GPU wait timed out earlier; check the error record."""
        if self._destroyed:
            raise RuntimeError('this deepep_cupy buffer was destroyed')
        if self._failed is not None:
            raise RuntimeError(f'this deepep_cupy buffer is unusable after an earlier failure: {self._failed}')
        try:
            errors.raise_if_timed_out(self.error_record, self.num_gpu_timeout_secs, self.rank_idx,
                                      getattr(self, 'error_rank_base', 0))
        except TimeoutError as e:
            self._failed = str(e)
            raise

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """GPU barrier over every rank: the IPC barrier kernel inside the scale-up domain, then (several domains) an
        NCCL all-reduce of one word across all ranks on the same stream. Runs on the communication stream (which
        first waits for the current stream, and which the current stream then waits for) or on the current stream.
        With `with_cpu_sync` the host also waits, and raises `TimeoutError` on a GPU timeout. `sequential` is
        accepted for DeepEP compatibility (the barrier kernel is one block: always sequential)."""
        del sequential
        self.check_usable()
        current = interop.current_stream()
        stream = self.stream_order.begin(current) if use_comm_stream else current
        self._barrier(stream)
        if self._rail_barrier is not None:
            self._rail_barrier(stream)
            self._barrier(stream)
        if use_comm_stream:
            self.stream_order.end(current)
        if with_cpu_sync:
            self.synchronize(stream)

    def synchronize(self, stream=None) -> None:
        """Wait for `stream` (default: the communication stream) on the host, bounded: raises `TimeoutError` if a
        kernel reported a GPU timeout, or if the stream is still busy after the GPU timeout plus a margin."""
        stream = stream or self.stream_order.settle()
        event = stream.record()
        limit = self.num_gpu_timeout_secs + 30

        def timed_out():
            self._failed = 'host wait for the GPU timed out'
            raise TimeoutError(f'deepep_cupy rank {self.rank_idx}: the GPU did not finish within {limit:g} s and '
                               f'reported no timeout')
        # Done, or a kernel reported a timeout (the stream then ends soon: the waits give up), or a rail transport
        # failed (an NCCL peer died during a graph replay: the watchdog aborted, the replay's NCCL kernels return).
        wait_until(lambda: event.done or int(self.error_record[0]) != 0, limit, timed_out, self._check_transports,
                   spin=False)
        event.synchronize()
        self.check_usable()
        self._check_transports()

    # Teardown
    def _destroy_features(self) -> None:
        """Release what the buffer's features hold (the subclasses' components); local, no collective."""

    def _release_extra(self, collective: bool) -> None:
        """Release memory a feature holds outside the symmetric buffer (the hybrid rails), once no kernel runs;
        `collective`: every rank does it now (else local, as for garbage collection)."""

    def _transports_failed(self) -> bool:
        """Whether a transport outside the GPU timeouts (the hybrid rails) gave up after a timeout."""
        return False

    def _check_transports(self) -> None:
        """Raise a transport's failure outside the GPU timeouts (the hybrid rails' watchdog error, or NCCL's)."""

    def _abort_transports(self) -> None:
        """Abort what may still wait for a peer outside the GPU timeouts (the hybrid rails' NCCL communicators), so
        that a failed buffer's teardown never waits for a dead peer; local."""

    def destroy(self) -> None:
        """Release all GPU memory (collective: every rank must call it). Idempotent. A buffer that failed (a wait
        timed out: `is_usable()` is False, or a rail transport gave up) aborts its rail transports first
        (ncclCommAbort: no NCCL kernel keeps waiting for them), waits for its communication stream bounded instead of
        synchronising the device, and meets its peers through bounded barriers that give up once one fails
        (`symmetric.soft_barriers`): a peer that is alive, e.g. the rank that was missing, destroys through the same
        host collectives; a dead one costs one barrier timeout (`num_cpu_timeout_secs`)."""
        if self._destroyed:
            return
        failed = self._failed is not None or int(self.error_record[0]) != 0 or self._transports_failed()
        if not failed:
            self._teardown(failed=False)
            return
        self._abort_transports()
        with soft_barriers(self.num_cpu_timeout_secs):
            self._teardown(failed=True)

    def _teardown(self, failed: bool) -> None:
        """The collective teardown. A failed buffer waits, bounded, for its communication stream and then for the whole
        device (kernels on other streams may still use the memory: the rail exchanges run on the caller's stream, and
        NCCL's kernels queued behind a timed-out wait); if either stays busy, or the CUDA context is lost (e.g. NCCL
        faulted after its abort), it frees nothing, says so on stderr and returns: the memory is left to the process
        exit rather than freed under a running kernel, and the caller, who has the buffer's error already, gets no
        second one. A healthy buffer synchronises the device."""
        import cupy
        self._destroyed = True
        self._destroy_features()
        if failed:
            try:
                self._wait_comm_stream()
                lost = self._wait_device_idle()
            except TimeoutError as e:
                lost = e
            if lost is not None:
                print(f'deepep_cupy rank {self.rank_idx}: destroy of a failed buffer freed nothing '
                      f'({type(lost).__name__}: {lost}); its memory is left to the process exit', file=sys.stderr,
                      flush=True)
                return
            self._release_collective()
            return
        try:
            cupy.cuda.runtime.deviceSynchronize()
        finally:
            self._release_collective()

    def _release_collective(self) -> None:
        self._release_extra(collective=True)
        if self.nccl is not None:
            self.nccl.destroy()
            self.nccl = None
        self._release_host_storage()
        self.sym.destroy(timeout=self.num_cpu_timeout_secs)
        self.host_mapped.free()
        if self._owns_stream:
            _release_stream(self.device, self.comm_stream)
        self.comm_stream = None

    def _wait_device_idle(self) -> Optional[BaseException]:
        """A failed buffer's teardown: every stream of this device idle, bounded by the GPU timeout plus a margin
        (`streams.wait_device_idle`); the CUDA error if the context is lost."""
        return wait_device_idle(self.device, self.num_gpu_timeout_secs + 30)

    def _wait_comm_stream(self) -> None:
        """Wait for the communication stream, bounded by the GPU timeout plus a margin (its kernels give up by then)."""
        event = self.stream_order.settle().record()
        limit = self.num_gpu_timeout_secs + 30

        def timed_out():
            raise TimeoutError('the communication stream did not finish')
        wait_until(lambda: event.done, limit, timed_out, spin=False)

    def _release_host_storage(self) -> None:
        """Unregister and unmap the host segments (local on every rank: mappings keep the pages alive)."""
        if self.host_storage is not None:
            self.host_storage.release()
            self.host_storage = None

    def _release_local(self) -> None:
        """Free this rank's memory without the other ranks: wait (bounded by the GPU timeout plus a margin) for the
        communication stream, then close the peers' mappings and free the own allocation and host-mapped memory.
        If the stream does not finish, the memory is left allocated rather than freed under a running kernel."""
        self._destroyed = True
        self._destroy_features()
        self._wait_comm_stream()
        self._release_extra(collective=False)
        if self.nccl is not None:
            self.nccl.destroy()
            self.nccl = None
        self._release_host_storage()
        self.sym.release_local()
        self.host_mapped.free()
        if self._owns_stream:
            _release_stream(self.device, self.comm_stream)
        self.comm_stream = None

    def __del__(self):
        # With explicitly_destroy, memory is released by the collective destroy() only (a collective teardown from a
        # garbage-collector callback could deadlock, as upstream warns). Without it, a dropped buffer frees its own
        # memory here, locally; nothing may raise from a finalizer (the interpreter may be shutting down).
        if self._destroyed or self.explicitly_destroy:
            return
        try:
            self._release_local()
        except Exception:
            pass


class V25Methods:
    """DeepEP V2.5's methods every buffer class of that API shares (its `deep_ep.comm` functions bound as methods,
    `barrier(wait_comm_stream=...)` instead of V2.0's `barrier(use_comm_stream=...)`). Mixed in before `BufferBase`.
    """

    def context_barrier(self, context_idx: Optional[int], wait_comm_stream: bool, with_cpu_sync: bool,
                        sequential: bool) -> None:
        """The GPU barrier of communication context `context_idx` (these buffers have one: None or 0)."""
        if context_idx not in (None, 0):
            raise ValueError(f'context_idx={context_idx}: this buffer has a single communication context')
        BufferBase.barrier(self, wait_comm_stream, with_cpu_sync, sequential)

    def barrier(self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True,
                context_idx: Optional[int] = None) -> None:
        """GPU barrier over every rank (`deep_ep.comm.barrier`): on the communication stream, ordered after the current
        stream and before what follows on it (`wait_comm_stream=False`: on the current stream); with
        `with_cpu_sync` the host waits too (and raises `TimeoutError` on a GPU timeout)."""
        self.context_barrier(context_idx, wait_comm_stream, with_cpu_sync, sequential)

    def get_comm_stream(self):
        """The communication stream: a `torch.cuda.Stream` when torch has CUDA, else the CuPy stream."""
        from .. import comm
        return comm.get_comm_stream(self)

    @property
    def context(self):
        """The (single) communication context: the buffer itself (DeepEP: its C++ context), None once destroyed."""
        return self.main_context
