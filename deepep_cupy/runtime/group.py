"""Host-side process group: one small interface over mpi4py, torch.distributed, TCP sockets or a single process.

Every buffer talks to its peers on the host through this interface only (bootstrap, handle exchange, config checks),
so the rest of the library does not care how the job was launched. `detect_launch` reads what the launcher announced
(torchrun, mpirun, SLURM srun, RANK / WORLD_SIZE); `get_group()` refuses to run a job that announces several ranks as
independent 1-rank worlds.
"""

import pickle
import socket
import sys
import time
from typing import Any, List, Optional

from .. import envs

DEFAULT_CPU_TIMEOUT_SECS = 300.0


class ProcessGroup:
    """The host collectives deepep_cupy needs, plus rank, host and local-rank information.

    Attributes:
        rank: this process's rank in the group.
        size: number of ranks.
        backend: `'mpi'`, `'torch'` or `'single'`.
        host_idx: index of this rank's host (hosts numbered by their lowest rank).
        num_hosts: number of hosts.
        local_rank: index of this rank among the ranks of its host.
        local_size: number of ranks on this host.
        host_of_rank: host index of every rank.
    """

    backend = 'abstract'

    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.size = size
        self.host_idx = 0
        self.num_hosts = 1
        self.local_rank = 0
        self.local_size = 1
        self.host_of_rank = [0] * size

    def _init_hosts(self, timeout: Optional[float] = None):
        host = envs.host_override() or socket.gethostname()
        hosts = self.allgather_object(host, timeout=timeout)
        order: List[str] = []
        for h in hosts:
            if h not in order:
                order.append(h)
        self.host_of_rank = [order.index(h) for h in hosts]
        self.host_idx = self.host_of_rank[self.rank]
        self.num_hosts = len(order)
        same_host = [r for r in range(self.size) if self.host_of_rank[r] == self.host_idx]
        self.local_rank = same_host.index(self.rank)
        self.local_size = len(same_host)

    # Collectives (every rank of the group must call them in the same order)
    def allgather_object(self, obj: Any, timeout: Optional[float] = None) -> List[Any]:
        raise NotImplementedError

    def broadcast_object(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Any:
        return self.allgather_object(obj if self.rank == root else None, timeout=timeout)[root]

    def barrier(self, timeout: Optional[float] = None) -> None:
        self.allgather_object(None, timeout=timeout)

    def check_same(self, what: str, value: Any, timeout: Optional[float] = None) -> None:
        """Raise `ValueError` on every rank when `value` differs between ranks (a misconfigured job)."""
        self.check_identical(what, self.allgather_object(value, timeout=timeout))

    def check_identical(self, what: str, values: List[Any]) -> None:
        """`check_same` for values already gathered (`values[r]`: rank r's)."""
        if any(v != values[0] for v in values):
            groups = {}
            for r, v in enumerate(values):
                groups.setdefault(repr(v), []).append(r)
            detail = '; '.join(f'ranks {ranks}: {v}' for v, ranks in groups.items())
            raise ValueError(f'{what} must be identical on every rank, got {detail} (this is rank {self.rank})')

    def __repr__(self):
        return (f'{type(self).__name__}(rank={self.rank}, size={self.size}, host={self.host_idx}/{self.num_hosts}, '
                f'local={self.local_rank}/{self.local_size})')


class SingleProcessGroup(ProcessGroup):
    """A group of one process (no MPI, no torch.distributed)."""

    backend = 'single'

    def __init__(self):
        super().__init__(0, 1)
        self._init_hosts()

    def allgather_object(self, obj, timeout=None):
        return [obj]


class MPIProcessGroup(ProcessGroup):
    """A group over an mpi4py communicator. Waits are non-blocking polls bounded by a timeout, so a rank that never
    arrives makes the others raise `TimeoutError` instead of hanging."""

    backend = 'mpi'

    def __init__(self, comm=None, timeout: Optional[float] = None):
        from mpi4py import MPI
        self._MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.default_timeout = envs.cpu_timeout_secs(timeout or DEFAULT_CPU_TIMEOUT_SECS)
        super().__init__(self.comm.Get_rank(), self.comm.Get_size())
        self._init_hosts()

    def _wait(self, request, what: str, timeout: Optional[float]):
        limit = self.default_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        sleep = 1e-5
        while not request.Test():
            if time.monotonic() > deadline:
                raise TimeoutError(f'rank {self.rank}: host {what} did not complete within {limit:.1f} s '
                                   f'(a peer rank is missing, hung or called a different collective)')
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-3)

    def allgather_object(self, obj, timeout=None):
        import numpy as np
        MPI = self._MPI
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        self._wait(self.comm.Iallgather(np.array([data.size], dtype=np.int64), sizes), 'all-gather (sizes)', timeout)
        displs = np.zeros(self.size, dtype=np.int64)
        displs[1:] = np.cumsum(sizes)[:-1]
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        req = self.comm.Iallgatherv(data, [recv, sizes.tolist(), displs.tolist(), MPI.BYTE])
        self._wait(req, 'all-gather (data)', timeout)
        return [pickle.loads(recv[displs[r]:displs[r] + sizes[r]].tobytes()) for r in range(self.size)]

    def barrier(self, timeout=None):
        self._wait(self.comm.Ibarrier(), 'barrier', timeout)


class TorchProcessGroup(ProcessGroup):
    """A group over a `torch.distributed` ProcessGroup (for users inside torch jobs). Its waits are bounded by the
    timeout the torch group was created with."""

    backend = 'torch'

    def __init__(self, group=None):
        import torch.distributed as dist
        self._dist = dist
        self.group = group if group is not None else dist.group.WORLD
        super().__init__(dist.get_rank(self.group), dist.get_world_size(self.group))
        self._init_hosts()

    def allgather_object(self, obj, timeout=None):
        out = [None] * self.size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj, root=0, timeout=None):
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._dist.get_global_rank(self.group, root), group=self.group)
        return box[0]

    def barrier(self, timeout=None):
        # An object collective, not dist.barrier: with init_dist's 'cpu:gloo,cuda:nccl' it stays on gloo
        self.allgather_object(None)

    # A buffer's `group` is this wrapper, and callers compare it with the torch group they passed (Megatron rebuilds
    # its buffer whenever `buffer.group != group`): the wrapper equals the torch group it wraps.
    def __eq__(self, other):
        if isinstance(other, TorchProcessGroup):
            return self.group is other.group
        return other is self.group

    def __hash__(self):
        return hash(self.group)


_default_group: Optional[ProcessGroup] = None


def set_default_group(group: Optional[ProcessGroup]) -> None:
    """Make `group` what `get_group()` returns when nothing else identifies the job (`init_dist` does this for the
    TCP group it builds without torch and MPI)."""
    global _default_group
    _default_group = group


def _torch_distributed_initialized() -> bool:
    # Only look if torch is already imported: a torch group cannot exist otherwise
    if 'torch' not in sys.modules:
        return False
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _is_mpi_comm(obj) -> bool:
    """Whether `obj` is an mpi4py communicator (or quacks like one: Get_rank, Get_size, allgather)."""
    mpi = sys.modules.get('mpi4py.MPI')
    if mpi is not None and isinstance(obj, mpi.Comm):
        return True
    return all(callable(getattr(obj, name, None)) for name in ('Get_rank', 'Get_size', 'allgather'))


def _is_torch_group(obj) -> bool:
    """Whether `obj` is a `torch.distributed` ProcessGroup (or quacks like one: rank() and size() methods)."""
    cls = getattr(sys.modules.get('torch.distributed'), 'ProcessGroup', None)
    if isinstance(cls, type) and isinstance(obj, cls):
        return True
    return callable(getattr(obj, 'rank', None)) and callable(getattr(obj, 'size', None))


def _type_name(obj) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == 'builtins' else f'{cls.__module__}.{cls.__qualname__}'


def _check_group_args(group, comm) -> None:
    """`TypeError` naming the argument when `group` or `comm` is not what it takes."""
    if group is not None and not isinstance(group, ProcessGroup):
        if _is_mpi_comm(group):
            raise TypeError(f'group: got an mpi4py communicator ({_type_name(group)}), but group takes a '
                            f'torch.distributed ProcessGroup (as in DeepEP) or a deepep_cupy ProcessGroup: pass an '
                            f'mpi4py communicator as comm= (e.g. comm=MPI.COMM_WORLD), or neither under mpirun')
        if not _is_torch_group(group):
            raise TypeError(f'group must be None, a torch.distributed ProcessGroup or a deepep_cupy ProcessGroup '
                            f'(an mpi4py communicator goes to comm=), got {_type_name(group)}')
    if comm is not None and not _is_mpi_comm(comm):
        hint = ' (a torch.distributed ProcessGroup goes to group=)' if _is_torch_group(comm) else ''
        raise TypeError(f'comm must be None or an mpi4py communicator{hint}, got {_type_name(comm)}')


def get_group(group=None, comm=None, timeout: Optional[float] = None) -> ProcessGroup:
    """Build the process group from what the user passed, else from how the job was launched.

    Args:
        group: a `torch.distributed` ProcessGroup, or an existing `ProcessGroup` (returned as is).
        comm: an mpi4py communicator.
        timeout: bound in seconds for host collectives (MPI and TCP backends).

    Returns:
        `ProcessGroup`: torch if `group` is given; MPI if `comm` is given or the process was started by `mpirun`; the
        torch.distributed world when it is initialised; the group `init_dist` built (TCP); else a single-process
        group.

    Raises:
        TypeError: `group` is an mpi4py communicator (it belongs in `comm`) or anything else but a process group;
            `comm` is not an mpi4py communicator.
        RuntimeError: the environment announces several ranks (torchrun, SLURM, RANK/WORLD_SIZE) but nothing joined
            them: running on as a 1-rank world would silently give N independent jobs.
    """
    if group is not None and comm is not None:
        raise ValueError('pass either group= (torch.distributed) or comm= (mpi4py), not both')
    _check_group_args(group, comm)
    if isinstance(group, ProcessGroup):
        return group
    if group is not None:
        return TorchProcessGroup(group)
    if comm is not None or launched_by_mpi():
        return MPIProcessGroup(comm, timeout=timeout)
    if _torch_distributed_initialized():
        return TorchProcessGroup()
    if _default_group is not None:
        return _default_group
    launch = detect_launch()
    if launch.size > 1:
        raise RuntimeError(
            f'this process is rank {launch.rank} of a {launch.size}-rank job ({launch.origin}), but no process group '
            f'joins the ranks: call deepep_cupy.utils.envs.init_dist() first (it joins the job), or '
            f'torch.distributed.init_process_group(), or pass group= (a torch ProcessGroup) / comm= (an mpi4py '
            f'communicator)')
    return SingleProcessGroup()


# Re-exported: what used to live here.
from .launcher import (  # noqa: E402,F401
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    MPI_MARKERS,
    LaunchEnv,
    detect_launch,
    init_torch_distributed,
    launched_by_mpi,
)
