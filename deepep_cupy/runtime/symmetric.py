"""Symmetric device memory over CUDA IPC, plus small host-mapped memory.

Every rank of a scale-up domain allocates one buffer of the same size with plain `cudaMalloc` (IPC handles must
name a whole allocation, so CuPy's pool is not used), zeroes it, exports an IPC handle, all-gathers the handles
through the host process group and opens its peers' buffers. A peer address is `peer_base[r] + offset`; the device
keeps a table of the bases (`peer_bases_ptr`, uint64 `[num_peers]`) for kernels.

Teardown order (collective): close the peers' mappings → host barrier → free the own allocation → host barrier
(`release_local` skips the barriers, for garbage collection).
A rank must not free its memory while a peer still maps it, and no kernel may be in flight.

A failed buffer (a wait timed out) still runs that collective teardown, inside `soft_barriers`: its peers may be alive
(a rank that was only missing or late destroys as a healthy one, through the same barriers, and a host collective
that one side skipped would pair with the next collective of the other side: a deadlock or MPI_ERR_TRUNCATE), or dead.
So each barrier is bounded; the first one that fails means a peer is gone, and the teardown's later barriers are
skipped (local from then on).
"""

import contextlib
import contextvars
import ctypes
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from .group import ProcessGroup


class SoftBarriers:
    """The host barriers of one failed buffer's teardown (`soft_barriers`): each bounded by `timeout`; once one fails
    (a peer is gone), the rest return at once."""

    def __init__(self, timeout: Optional[float]):
        self.timeout = timeout
        self.peers_gone: Optional[str] = None

    def barrier(self, group: ProcessGroup) -> None:
        if self.peers_gone is not None:
            return
        try:
            group.barrier(timeout=self.timeout)
        except Exception as e:      # a timeout, or the host transport's own error (a dead peer's closed socket)
            self.peers_gone = f'{type(e).__name__}: {e}'


_soft: contextvars.ContextVar = contextvars.ContextVar('deepep_cupy_soft_barriers', default=None)


@contextlib.contextmanager
def soft_barriers(timeout: Optional[float]) -> Iterator[SoftBarriers]:
    """Within it, `SymmetricMemory.destroy` meets its peers through bounded barriers that give up instead of raising
    (the teardown of a failed buffer; see the module's docstring)."""
    soft = SoftBarriers(timeout)
    token = _soft.set(soft)
    try:
        yield soft
    finally:
        _soft.reset(token)


class HostMappedMemory:
    """Pinned host memory mapped into the device address space (UVA: the same address on both sides); used for
    error records and for counters the CPU polls."""

    def __init__(self, num_bytes: int):
        import cupy
        self.num_bytes = num_bytes
        self.ptr = cupy.cuda.runtime.hostAlloc(num_bytes, cupy.cuda.runtime.hostAllocMapped)
        ctypes.memset(self.ptr, 0, num_bytes)

    def view(self, dtype, count: int, offset: int = 0) -> np.ndarray:
        """A numpy view (host side) of `count` elements at byte `offset`."""
        dtype = np.dtype(dtype)
        assert offset + count * dtype.itemsize <= self.num_bytes
        buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(self.ptr + offset)
        return np.frombuffer(buf, dtype=dtype)

    def free(self):
        if self.ptr:
            import cupy
            cupy.cuda.runtime.freeHost(self.ptr)
            self.ptr = 0


class SymmetricMemory:
    """One buffer per rank of a scale-up domain, every buffer mapped in every rank.

    Args:
        group: the host process group (collective construction and teardown).
        domain_ranks: global ranks of this rank's scale-up domain, in scale-up index order.
        num_bytes: bytes per rank (identical on every rank; checked).
    """

    def __init__(self, group: ProcessGroup, domain_ranks: List[int], num_bytes: int):
        import cupy
        rt = cupy.cuda.runtime
        self.group = group
        self.domain_ranks = list(domain_ranks)
        self.num_peers = len(domain_ranks)
        self.local_idx = self.domain_ranks.index(group.rank)
        self.num_bytes = int(num_bytes)
        self.base = 0
        self.peer_bases: List[int] = []
        self._opened: List[int] = []
        self._table = None

        group.check_same('symmetric buffer size (num_bytes)', self.num_bytes)
        self.base = rt.malloc(self.num_bytes)
        try:
            rt.memset(self.base, 0, self.num_bytes)
            rt.deviceSynchronize()
            handle = rt.ipcGetMemHandle(self.base)
        except Exception:
            rt.free(self.base)
            self.base = 0
            raise
        handles = group.allgather_object(bytes(handle))
        try:
            for r in self.domain_ranks:
                if r == group.rank:
                    self.peer_bases.append(self.base)
                else:
                    ptr = rt.ipcOpenMemHandle(handles[r], rt.cudaIpcMemLazyEnablePeerAccess)
                    self._opened.append(ptr)
                    self.peer_bases.append(ptr)
            self._table = cupy.asarray(np.array(self.peer_bases, dtype=np.uint64))
        except Exception:
            self._close_peers()
            raise

    @property
    def peer_bases_ptr(self) -> int:
        """Device address of the uint64 `[num_peers]` table of peer base addresses."""
        return int(self._table.data.ptr)

    def peer_ptr(self, peer_idx: int, offset: int = 0) -> int:
        """Address (valid on this device) of byte `offset` of peer `peer_idx`'s buffer."""
        assert 0 <= offset <= self.num_bytes
        return self.peer_bases[peer_idx] + offset

    def local_view(self, offset: int, count: int, dtype=np.uint8):
        """A CuPy array over `count` elements of the local buffer at byte `offset` (no copy)."""
        import cupy
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        if offset < 0 or offset + nbytes > self.num_bytes:
            raise ValueError(f'view [{offset}, {offset + nbytes}) is outside the {self.num_bytes}-byte buffer')
        mem = cupy.cuda.UnownedMemory(self.base + offset, nbytes, self)
        return cupy.ndarray((count,), dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def _close_peers(self):
        import cupy
        for ptr in self._opened:
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)
        self._opened = []

    def destroy(self, timeout: Optional[float] = None):
        """Collective teardown: close peer mappings, barrier, free, barrier. Idempotent. Under `soft_barriers` the
        caller has waited (bounded) for its streams, and the device is not synchronised here (a failed buffer)."""
        if not self.base:
            return
        import cupy
        if _soft.get() is None:
            cupy.cuda.runtime.deviceSynchronize()
        self._close_peers()
        self._table = None
        self._barrier(timeout)
        cupy.cuda.runtime.free(self.base)
        self.base = 0
        self.peer_bases = []
        self._barrier(timeout)

    def _barrier(self, timeout: Optional[float]) -> None:
        soft = _soft.get()
        if soft is None:
            self.group.barrier(timeout=timeout)
        else:
            soft.barrier(self.group)

    def release_local(self) -> None:
        """Local teardown, without the host barriers (a buffer garbage-collected with `explicitly_destroy=False`):
        close this rank's mappings of the peers' buffers and free its own allocation. The caller has made sure no
        kernel of this rank still uses it; peers that still map it keep their mapping until they free theirs.
        Idempotent."""
        if not self.base:
            return
        import cupy
        self._close_peers()
        self._table = None
        cupy.cuda.runtime.free(self.base)
        self.base = 0
        self.peer_bases = []


def process_key() -> Tuple[str, int]:
    """`(host, pid)`: which process this is, comparable across the ranks of a job."""
    import os
    import socket

    from .. import envs
    return envs.host_override() or socket.gethostname(), os.getpid()


class PeerMapping:
    """Another group's view of symmetric allocations that already exist: every rank of `group` shares the IPC handle
    of its allocation (`base`, `num_bytes`), and each rank maps the others' (a `BucketBuffer` registered with several
    groups). Allocations this process has mapped already (`known`: `(host, pid)` of their owner -> address) are not
    opened twice.

    Args:
        group: the host process group of the context (collective construction).
        base, num_bytes: this rank's allocation (identical size on every rank; checked).
        known: `(host, pid)` -> address of allocations this process maps already (its own included).
    """

    def __init__(self, group: ProcessGroup, base: int, num_bytes: int, known: Dict[Tuple[str, int], int]):
        import cupy
        rt = cupy.cuda.runtime
        self.group = group
        self.num_peers, self.local_idx = group.size, group.rank
        group.check_same('symmetric buffer size (num_bytes)', int(num_bytes))
        everyone = group.allgather_object((process_key(), bytes(rt.ipcGetMemHandle(base))))
        self._opened: List[int] = []
        self.peer_bases: List[int] = []
        try:
            for key, handle in everyone:
                ptr = known.get(key)
                if ptr is None:
                    ptr = rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)
                    self._opened.append(ptr)
                self.peer_bases.append(ptr)
            self._table = cupy.asarray(np.array(self.peer_bases, dtype=np.uint64))
        except Exception:
            self.release()
            raise

    @property
    def peer_bases_ptr(self) -> int:
        return int(self._table.data.ptr)

    def release(self) -> None:
        """Close the mappings this object opened (local; the owners free their allocations). Idempotent."""
        import cupy
        for ptr in self._opened:
            try:
                cupy.cuda.runtime.ipcCloseMemHandle(ptr)
            except Exception:  # noqa: BLE001 (interpreter shutdown)
                pass
        self._opened = []
        self._table = None
