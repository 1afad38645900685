"""Host storage shared by the ranks of a scale-up domain: pinned host memory every rank's GPU can read (DeepEP's
`num_cpu_bytes` / `use_cpu_rdma_storage`, the engram tables).

Each rank owns one segment of `num_bytes` in host memory. It creates the segment, every rank of the domain maps every
segment (`mmap`) and registers each mapping with CUDA as mapped, portable memory (`cudaHostRegister`), so a kernel
of any rank reads (and the owner's kernels write) any segment at its host address: on every GPU this build supports
the device address of registered host memory equals the host address (`cudaDevAttrCanUseHostPointerForRegisteredMem`,
checked). A device table holds the domain's segment addresses in scale-up order (`table_ptr`, uint64 `[num_peers]`).

Segments are POSIX shared memory (`/dev/shm/deepep_cupy-<job token>-<rank>`, the token made by rank 0 for this
buffer, so two jobs or two buffers on one host never collide; created with O_EXCL). The space is reserved when the
segment is created (`posix_fallocate`: a full /dev/shm fails there with a clear error instead of a SIGBUS later);
when /dev/shm is too small the segment is an anonymous memory file (`memfd_create`) that peers open through
`/proc/<pid>/fd/<fd>` instead. The owner unlinks its name as soon as every peer has mapped the segment, so a job
that dies later leaves nothing behind. Teardown is local on every rank (unregister, unmap, close): a mapping keeps
the pages alive, so a rank may release while its peers still read its segment; no collective is needed.

Locators (what a rank tells its peers): `('shm', name)` or `('memfd', pid, fd)`.
"""

import ctypes
import errno
import os
import secrets
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .group import ProcessGroup

SHM_DIR = '/dev/shm'
NAME_PREFIX = 'deepep_cupy'
HOST_REGISTER_PORTABLE = 1      # cudaHostRegisterPortable
HOST_REGISTER_MAPPED = 2        # cudaHostRegisterMapped

_PROT_READ, _PROT_WRITE, _MAP_SHARED = 1, 2, 1
_MAP_FAILED = ctypes.c_void_p(-1).value


def segment_name(token: str, rank: int) -> str:
    """The shared-memory name of `rank`'s segment in the buffer whose job token is `token`."""
    return f'{NAME_PREFIX}-{token}-{rank}'


def new_token() -> str:
    """A token unique to one buffer of one job: the creating process's id and 48 random bits."""
    return f'{os.getpid():x}-{secrets.token_hex(6)}'


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


def _map(fd: int, num_bytes: int) -> int:
    """`mmap` of the whole file `fd`, shared, read-write; the address."""
    addr = _libc().mmap(None, num_bytes, _PROT_READ | _PROT_WRITE, _MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f'mmap of {num_bytes} bytes of host storage failed: {os.strerror(err)}')
    return int(addr)


def _unmap(addr: int, num_bytes: int) -> None:
    _libc().munmap(addr, num_bytes)


def create_segment(token: str, rank: int, num_bytes: int, shm_dir: str = SHM_DIR) -> Tuple[int, Tuple]:
    """Create this rank's segment of `num_bytes` (reserved now) and return `(fd, locator)`.

    POSIX shared memory when `shm_dir` has the space; otherwise (ENOSPC, or no `shm_dir`) an anonymous memory file.
    Raises `FileExistsError` if the name is taken (it never is for a fresh token), `OSError` naming the fix when
    neither kind can be made."""
    name = segment_name(token, rank)
    path = os.path.join(shm_dir, name)
    fd = -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileNotFoundError:
        pass                                            # no /dev/shm here: fall back to a memory file
    if fd >= 0:
        try:
            os.posix_fallocate(fd, 0, num_bytes)
            return fd, ('shm', name)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EOPNOTSUPP, errno.EINVAL):
                raise
    if not hasattr(os, 'memfd_create'):
        raise OSError(errno.ENOSPC, f'deepep_cupy host storage: {shm_dir} cannot hold {num_bytes} bytes and this '
                                    f'system has no memfd_create; enlarge {shm_dir} (docker: --shm-size)')
    fd = os.memfd_create(name, 0)
    try:
        os.posix_fallocate(fd, 0, num_bytes)
    except OSError as e:
        os.close(fd)
        raise OSError(e.errno, f'deepep_cupy host storage: cannot reserve {num_bytes} bytes of host memory for '
                               f'rank {rank} ({os.strerror(e.errno)})') from None
    return fd, ('memfd', os.getpid(), fd)


def open_segment(locator: Sequence, shm_dir: str = SHM_DIR) -> int:
    """Open a peer's segment from its locator; the file descriptor. Raises `OSError` saying why a peer's segment is
    not reachable (another host, another /dev/shm, no permission to open another process's memory file)."""
    kind = locator[0]
    try:
        if kind == 'shm':
            return os.open(os.path.join(shm_dir, locator[1]), os.O_RDWR)
        if kind == 'memfd':
            return os.open(f'/proc/{int(locator[1])}/fd/{int(locator[2])}', os.O_RDWR)
    except OSError as e:
        raise OSError(e.errno, f'cannot open the host storage segment {tuple(locator)}: {os.strerror(e.errno)}; '
                               f'every rank of the scale-up domain must run on one host and see its /dev/shm (and '
                               f'/proc of the other ranks)') from None
    raise ValueError(f'unknown host storage locator {tuple(locator)!r}')


@dataclass
class Mapping:
    """One segment mapped into this process: file descriptor, address (host == device) and whether CUDA knows it."""
    fd: int
    addr: int
    num_bytes: int
    registered: bool = False


class HostStorage:
    """The host segments of a scale-up domain, mapped and registered in this process (see the module docstring).

    Args:
        group: the host process group (construction is collective over it).
        domain_ranks: global ranks of this rank's scale-up domain, in scale-up order (a segment per rank).
        num_bytes: bytes of each rank's segment (identical on every rank, checked; a multiple of the page size).
        register: register the mappings with CUDA (False for CPU-only use and tests).
    """

    def __init__(self, group: ProcessGroup, domain_ranks: Sequence[int], num_bytes: int, register: bool = True):
        self.group = group
        self.domain_ranks = list(domain_ranks)
        self.num_peers = len(self.domain_ranks)
        self.local_idx = self.domain_ranks.index(group.rank)
        self.num_bytes = int(num_bytes)
        self.mappings: List[Optional[Mapping]] = [None] * self.num_peers
        self.addrs: List[int] = []
        self._table: Any = None
        if self.num_bytes <= 0 or self.num_bytes % os.sysconf('SC_PAGE_SIZE'):
            raise ValueError(f'host storage bytes must be a positive multiple of the page size, got {self.num_bytes}')
        group.check_same('host storage size (num_cpu_bytes)', self.num_bytes)
        if register:
            check_host_pointer_access()
        token = group.broadcast_object(new_token() if group.rank == 0 else None)

        # Create, map and register this rank's segment; everyone reports its locator or its error.
        error, locator, own_fd = None, None, -1
        try:
            own_fd, locator = create_segment(token, group.rank, self.num_bytes)
            self.mappings[self.local_idx] = self._map(own_fd, register)
        except Exception as e:  # noqa: BLE001 (reported to every rank below, then raised)
            error = f'rank {group.rank}: {e}'
            if own_fd >= 0 and self.mappings[self.local_idx] is None:
                os.close(own_fd)
                _unlink(locator)
        reports = group.allgather_object((error, locator))
        if any(e is not None for e, _ in reports):
            self.release()
            _unlink(locator)
            raise RuntimeError('deepep_cupy host storage: ' + '; '.join(e for e, _ in reports if e is not None))

        # Open and map the peers' segments of the domain.
        error = None
        try:
            for idx, r in enumerate(self.domain_ranks):
                if idx != self.local_idx:
                    self.mappings[idx] = self._map(open_segment(reports[r][1]), register)
        except Exception as e:  # noqa: BLE001 (reported to every rank below, then raised)
            error = f'rank {group.rank}: {e}'
        errors = [e for e in group.allgather_object(error) if e is not None]
        _unlink(locator)                        # every rank has opened it (or the construction failed): drop the name
        if errors:
            self.release()
            raise RuntimeError('deepep_cupy host storage: ' + '; '.join(errors))
        self.addrs = [m.addr for m in self.mappings]
        if register:
            import cupy
            self._table = cupy.asarray(np.array(self.addrs, dtype=np.uint64))

    def _map(self, fd: int, register: bool) -> Mapping:
        try:
            m = Mapping(fd, _map(fd, self.num_bytes), self.num_bytes)
        except BaseException:
            os.close(fd)
            raise
        if register:
            import cupy
            try:
                cupy.cuda.runtime.hostRegister(m.addr, m.num_bytes, HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED)
            except BaseException:
                _unmap(m.addr, m.num_bytes)
                os.close(fd)
                raise
            m.registered = True
        return m

    @property
    def base(self) -> int:
        """Address (host and device) of this rank's segment."""
        return self.addrs[self.local_idx]

    @property
    def table_ptr(self) -> int:
        """Device address of the uint64 `[num_peers]` table of segment addresses (scale-up order)."""
        return int(self._table.data.ptr)

    def release(self) -> None:
        """Unregister, unmap and close every mapping of this process (local; idempotent). No kernel of this rank may
        still use them; peers keep their own mappings, which keep the pages alive."""
        for idx, m in enumerate(self.mappings):
            if m is None:
                continue
            self.mappings[idx] = None
            if m.registered:
                try:
                    import cupy
                    cupy.cuda.runtime.hostUnregister(m.addr)
                except Exception:  # noqa: BLE001 (context already gone at interpreter exit)
                    pass
            _unmap(m.addr, m.num_bytes)
            os.close(m.fd)
        self.addrs = []
        self._table = None


def _unlink(locator) -> None:
    """Remove a segment's name (POSIX shared memory only; a memory file has none). Missing names are fine."""
    if locator is not None and locator[0] == 'shm':
        try:
            os.unlink(os.path.join(SHM_DIR, locator[1]))
        except FileNotFoundError:
            pass


def check_host_pointer_access(device: Optional[int] = None) -> None:
    """Raise `NotImplementedError` on a GPU that cannot read registered host memory at its host address."""
    import cupy
    rt = cupy.cuda.runtime
    device = rt.getDevice() if device is None else device
    if not rt.deviceGetAttribute(rt.cudaDevAttrCanUseHostPointerForRegisteredMem, device):
        raise NotImplementedError(f'GPU {device} cannot use host pointers of registered memory '
                                  f'(cudaDevAttrCanUseHostPointerForRegisteredMem = 0): host storage is not supported')
