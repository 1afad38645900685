"""Host-side process group: one small interface over mpi4py, torch.distributed, TCP sockets or a single process.

Every buffer talks to its peers on the host through this interface only (bootstrap, handle exchange, config checks),
so the rest of the library does not care how the job was launched. `detect_launch` reads what the launcher announced
(torchrun, mpirun, SLURM srun, RANK / WORLD_SIZE); `get_group()` refuses to run a job that announces several ranks as
independent 1-rank worlds.
"""

import os
import pickle
import re
import socket
import struct
import sys
import time
from dataclasses import dataclass
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
        values = self.allgather_object(value, timeout=timeout)
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


class TcpProcessGroup(ProcessGroup):
    """A group over plain TCP sockets, for jobs started without MPI and without torch (SLURM `srun`, or RANK /
    WORLD_SIZE set by hand). Rank 0 listens on `master_addr:master_port`, every other rank connects to it; a
    collective sends every rank's object to rank 0, which sends the full list back. Every wait is bounded by the
    timeout and raises `TimeoutError` naming the ranks that did not arrive.

    Args:
        rank, size: this rank and the number of ranks.
        master_addr, master_port: where rank 0 listens.
        timeout: bound in seconds for the rendezvous and for every collective (default `DEEPEP_CUPY_CPU_TIMEOUT_SECS`,
            else 300).
        origin: what announced the job (launcher and variables), quoted in errors.
    """

    backend = 'tcp'

    def __init__(self, rank: int, size: int, master_addr: str, master_port: int, timeout: Optional[float] = None,
                 origin: str = 'the environment'):
        if not 0 <= rank < size:
            raise ValueError(f'rank {rank} is outside [0, {size}) ({origin})')
        self.master_addr, self.master_port, self.origin = master_addr, int(master_port), origin
        self.default_timeout = envs.cpu_timeout_secs(timeout or DEFAULT_CPU_TIMEOUT_SECS)
        self._seq = 0
        self._peers = {}        # rank 0: peer rank -> socket
        self._root = None       # other ranks: the socket to rank 0
        super().__init__(rank, size)
        deadline = time.monotonic() + self.default_timeout
        if size > 1:
            self._rendezvous(deadline)
        self._init_hosts()

    # Framing: 8-byte big-endian length, then a pickled (sequence number, payload) pair
    @staticmethod
    def _send(sock: socket.socket, obj: Any) -> None:
        data = pickle.dumps(obj)
        sock.sendall(struct.pack('>Q', len(data)) + data)

    def _recv(self, sock: socket.socket, deadline: float, what: str) -> Any:
        header = self._recv_exact(sock, 8, deadline, what)
        return pickle.loads(self._recv_exact(sock, struct.unpack('>Q', header)[0], deadline, what))

    def _recv_exact(self, sock: socket.socket, num_bytes: int, deadline: float, what: str) -> bytes:
        chunks, received = [], 0
        while received < num_bytes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f'rank {self.rank}: {what} did not arrive within {self.default_timeout:g} s')
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(min(num_bytes - received, 1 << 20))
            except socket.timeout:
                continue
            if not chunk:
                raise ConnectionError(f'rank {self.rank}: {what}: the connection closed (the peer exited or failed)')
            chunks.append(chunk)
            received += len(chunk)
        return b''.join(chunks)

    def _rendezvous(self, deadline: float) -> None:
        where = f'{self.master_addr}:{self.master_port}'
        if self.rank == 0:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                server.bind(('', self.master_port))
            except OSError as e:
                raise RuntimeError(f'rank 0 cannot listen on port {self.master_port} ({e}); set MASTER_PORT to a free '
                                   f'port ({self.origin})') from e
            server.listen(self.size)
            try:
                while len(self._peers) < self.size - 1:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        missing = sorted(set(range(1, self.size)) - set(self._peers))
                        for sock in self._peers.values():
                            self._send(sock, (-1, f'ranks {missing} never joined'))
                        raise TimeoutError(
                            f'rank 0: {len(missing)} of {self.size} ranks did not join within '
                            f'{self.default_timeout:g} s (missing ranks {missing}); {self.origin} announced '
                            f'{self.size} ranks, so start all of them (e.g. srun -n {self.size}, torchrun '
                            f'--nproc-per-node {self.size}) or fix those variables')
                    server.settimeout(remaining)
                    try:
                        sock, _ = server.accept()
                    except socket.timeout:
                        continue
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    peer_rank, peer_size = self._recv(sock, deadline, 'a joining rank\'s hello')[1]
                    if peer_size != self.size or not 0 < peer_rank < self.size or peer_rank in self._peers:
                        self._send(sock, (-1, f'rank 0 expects ranks 1..{self.size - 1} of {self.size}'))
                        raise RuntimeError(f'rank 0: a process joined as rank {peer_rank} of {peer_size}, but this '
                                           f'job has {self.size} ranks and ranks {sorted(self._peers)} already joined '
                                           f'({self.origin})')
                    self._peers[peer_rank] = sock
            finally:
                server.close()
            for sock in self._peers.values():
                self._send(sock, (0, 'ready'))
            return

        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((self.master_addr, self.master_port),
                                                timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                break
            except OSError as e:
                if time.monotonic() + delay > deadline:
                    raise TimeoutError(f'rank {self.rank}: could not reach rank 0 at {where} within '
                                       f'{self.default_timeout:g} s ({e}); {self.origin} announced {self.size} ranks: '
                                       f'start rank 0 too, or set MASTER_ADDR/MASTER_PORT to where it runs') from e
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send(sock, (0, (self.rank, self.size)))
        seq, reply = self._recv(sock, deadline, f'rank 0\'s go-ahead ({where})')
        if seq < 0:
            raise TimeoutError(f'rank {self.rank}: rank 0 gave up: {reply} ({self.origin})')
        self._root = sock

    def allgather_object(self, obj, timeout=None):
        deadline = time.monotonic() + (self.default_timeout if timeout is None else timeout)
        self._seq += 1
        if self.size == 1:
            return [obj]
        if self.rank != 0:
            self._send(self._root, (self._seq, obj))
            seq, values = self._recv(self._root, deadline, 'the all-gather result from rank 0')
            if seq != self._seq:
                raise RuntimeError(f'rank {self.rank}: collective {self._seq} got reply {seq} from rank 0: {values}')
            return values
        values = [obj] + [None] * (self.size - 1)
        for peer, sock in sorted(self._peers.items()):
            try:
                seq, values[peer] = self._recv(sock, deadline, f'rank {peer}\'s all-gather input')
            except TimeoutError as e:
                missing = [p for p in range(1, self.size) if p >= peer]
                raise TimeoutError(f'{e} (ranks not yet heard from: {missing}; a peer is hung, exited or called a '
                                   f'different collective)') from e
            if seq != self._seq:
                raise RuntimeError(f'rank 0: rank {peer} is at collective {seq}, rank 0 at {self._seq} (the ranks '
                                   f'called different collectives)')
        for sock in self._peers.values():
            self._send(sock, (self._seq, values))
        return values

    def close(self) -> None:
        for sock in [*self._peers.values(), *([self._root] if self._root is not None else [])]:
            try:
                sock.close()
            except OSError:
                pass
        self._peers, self._root = {}, None


# -------------------------------------------------------------------------------------------------------------------
# What the launcher announced


MPI_MARKERS = ('OMPI_COMM_WORLD_SIZE', 'PMI_SIZE', 'PMIX_RANK', 'MV2_COMM_WORLD_SIZE', 'MPI_LOCALNRANKS')
DEFAULT_MASTER_ADDR = '127.0.0.1'
DEFAULT_MASTER_PORT = 8361      # DeepEP's `init_dist` default


def launched_by_mpi() -> bool:
    """Whether this process was started by mpirun/mpiexec (Open MPI, MPICH, MVAPICH, PMIx)."""
    return any(k in os.environ for k in MPI_MARKERS)


@dataclass(frozen=True)
class LaunchEnv:
    """The job this process belongs to, as its launcher's environment variables describe it.

    Attributes:
        launcher: `'torchrun'`, `'mpi'`, `'slurm'`, `'env'` (RANK / WORLD_SIZE set by hand or another launcher) or
            `'none'` (a lone process).
        rank, size: the global rank and number of ranks (-1 under MPI when the variables do not tell: ask MPI).
        local_rank, local_size: this rank's index among the ranks of its host, and their number.
        master_addr, master_port: where rank 0 serves the rendezvous.
        origin: the variables that announced this, quoted in error messages.
    """
    launcher: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    master_addr: str
    master_port: int
    origin: str


def _int_env(env, *names: str, default: Optional[int] = None) -> Optional[int]:
    for name in names:
        value = env.get(name)
        if value not in (None, ''):
            try:
                return int(value)
            except ValueError as e:
                raise ValueError(f'environment variable {name}={value!r} must be an integer') from e
    return default


def _slurm_tasks_on_node(env) -> Optional[int]:
    """Tasks on this node from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE (e.g. `4(x2),3`), else
    SLURM_NTASKS_PER_NODE."""
    spec = env.get('SLURM_STEP_TASKS_PER_NODE') or env.get('SLURM_TASKS_PER_NODE')
    node = _int_env(env, 'SLURM_NODEID', default=0)
    if spec:
        counts = []
        for part in spec.split(','):
            m = re.fullmatch(r'\s*(\d+)(?:\(x(\d+)\))?\s*', part)
            if m is None:
                counts = []
                break
            counts += [int(m.group(1))] * int(m.group(2) or 1)
        if 0 <= node < len(counts):
            return counts[node]
    return _int_env(env, 'SLURM_NTASKS_PER_NODE')


def _slurm_first_host(env) -> Optional[str]:
    """The first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (`gpu[01-04,07],cpu1` -> `gpu01`)."""
    nodelist = env.get('SLURM_STEP_NODELIST') or env.get('SLURM_JOB_NODELIST') or env.get('SLURM_NODELIST')
    if not nodelist:
        return None
    m = re.match(r'([^,\[]+)(?:\[([^\]]+)\])?', nodelist.strip())
    if m is None:
        return None
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    return prefix + re.split(r'[-,]', ranges)[0]


def detect_launch(environ=None) -> LaunchEnv:
    """Read the launcher's variables (torchrun first, then MPI, SLURM, plain RANK / WORLD_SIZE).

    Args:
        environ: a mapping to read instead of `os.environ` (tests).
    """
    env = os.environ if environ is None else environ
    addr = env.get('MASTER_ADDR') or DEFAULT_MASTER_ADDR
    port = _int_env(env, 'MASTER_PORT', default=DEFAULT_MASTER_PORT)
    if 'TORCHELASTIC_RUN_ID' in env or all(k in env for k in ('LOCAL_RANK', 'RANK', 'WORLD_SIZE')):
        size = _int_env(env, 'WORLD_SIZE', default=1)
        return LaunchEnv('torchrun', _int_env(env, 'RANK', default=0), size, _int_env(env, 'LOCAL_RANK', default=0),
                         _int_env(env, 'LOCAL_WORLD_SIZE', default=size), addr, port,
                         f'torchrun (RANK={env.get("RANK")}, WORLD_SIZE={env.get("WORLD_SIZE")}, '
                         f'LOCAL_RANK={env.get("LOCAL_RANK")}, MASTER_ADDR={addr}, MASTER_PORT={port})')
    if any(k in env for k in MPI_MARKERS):
        rank = _int_env(env, 'OMPI_COMM_WORLD_RANK', 'PMI_RANK', 'PMIX_RANK', 'MV2_COMM_WORLD_RANK', default=-1)
        size = _int_env(env, 'OMPI_COMM_WORLD_SIZE', 'PMI_SIZE', 'MV2_COMM_WORLD_SIZE', default=-1)
        local_rank = _int_env(env, 'OMPI_COMM_WORLD_LOCAL_RANK', 'MPI_LOCALRANKID', 'MV2_COMM_WORLD_LOCAL_RANK',
                              default=-1)
        local_size = _int_env(env, 'OMPI_COMM_WORLD_LOCAL_SIZE', 'MPI_LOCALNRANKS', 'MV2_COMM_WORLD_LOCAL_SIZE',
                              default=-1)
        markers = ', '.join(f'{k}={env[k]}' for k in MPI_MARKERS if k in env)
        return LaunchEnv('mpi', rank, size, local_rank, local_size, addr, port, f'mpirun ({markers})')
    slurm_size = _int_env(env, 'SLURM_STEP_NUM_TASKS', 'SLURM_NTASKS', 'SLURM_NPROCS')
    if 'SLURM_PROCID' in env and slurm_size is not None and slurm_size > 1:
        rank = _int_env(env, 'SLURM_PROCID')
        local_size = _slurm_tasks_on_node(env)
        num_nodes = _int_env(env, 'SLURM_STEP_NUM_NODES', 'SLURM_JOB_NUM_NODES', 'SLURM_NNODES', default=1)
        if local_size is None:
            local_size = slurm_size if num_nodes == 1 else -1
        if 'MASTER_ADDR' not in env and num_nodes > 1:
            addr = _slurm_first_host(env) or addr
        if 'MASTER_PORT' not in env and 'SLURM_JOB_ID' in env:
            # One port per job, so two jobs sharing a node do not meet on DeepEP's default port
            port = 20000 + _int_env(env, 'SLURM_JOB_ID') % 20000
        return LaunchEnv('slurm', rank, slurm_size, _int_env(env, 'SLURM_LOCALID', default=0), local_size, addr, port,
                         f'SLURM (SLURM_PROCID={rank}, SLURM_NTASKS={slurm_size}, '
                         f'SLURM_LOCALID={env.get("SLURM_LOCALID")}, MASTER_ADDR={addr}, MASTER_PORT={port})')
    size = _int_env(env, 'WORLD_SIZE', default=1)
    if 'RANK' in env and size > 1:
        return LaunchEnv('env', _int_env(env, 'RANK'), size, _int_env(env, 'LOCAL_RANK', default=-1),
                         _int_env(env, 'LOCAL_WORLD_SIZE', default=-1), addr, port,
                         f'RANK={env.get("RANK")}, WORLD_SIZE={size}, MASTER_ADDR={addr}, MASTER_PORT={port}')
    return LaunchEnv('none', 0, 1, 0, 1, addr, port, 'no launcher')


# -------------------------------------------------------------------------------------------------------------------
# The default group


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
        RuntimeError: the environment announces several ranks (torchrun, SLURM, RANK/WORLD_SIZE) but nothing joined
            them: running on as a 1-rank world would silently give N independent jobs.
    """
    if group is not None and comm is not None:
        raise ValueError('pass either group= (torch.distributed) or comm= (mpi4py), not both')
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


# -------------------------------------------------------------------------------------------------------------------
# Joining torch.distributed


def init_torch_distributed(rank: int, size: int, master_addr: str, master_port: int, backend: str,
                           timeout: Optional[float] = None, origin: str = 'the environment',
                           mpi_group: Optional['MPIProcessGroup'] = None, use_launcher_store: bool = False) -> None:
    """Initialise torch.distributed's default group for a job whose ranks are known, with a bounded, diagnosed
    rendezvous: rank 0 serves a TCPStore, every rank checks in, and a rank that does not arrive within `timeout` is
    named in the `TimeoutError` every other rank raises.

    Args:
        rank, size: this rank and the number of ranks.
        master_addr, master_port: where rank 0 serves the store (ignored with `mpi_group`: rank 0 serves it on
            MASTER_ADDR, else 127.0.0.1 on one host or its hostname, on MASTER_PORT, else a free port, and sends the
            address over MPI).
        backend: torch backend string (`'cpu:gloo,cuda:nccl'`, `'gloo'`, ...).
        timeout: seconds (default `DEEPEP_CUPY_CPU_TIMEOUT_SECS`, else 300); also torch's collective timeout.
        origin: what announced the job, quoted in errors.
        mpi_group: an `MPIProcessGroup` to send the store address over (mpirun jobs).
        use_launcher_store: the launcher already serves the store (torchrun's agent store): use `env://`.
    """
    import datetime

    import torch.distributed as dist
    limit = envs.cpu_timeout_secs(timeout or DEFAULT_CPU_TIMEOUT_SECS)
    delta = datetime.timedelta(seconds=limit)
    if use_launcher_store:
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=delta)
        return
    if mpi_group is not None:
        host = os.environ.get('MASTER_ADDR') or (
            DEFAULT_MASTER_ADDR if mpi_group.num_hosts == 1 else socket.gethostname())
        store = None
        if rank == 0:
            store = dist.TCPStore(host, int(os.environ.get('MASTER_PORT', 0)), size, True, delta,
                                  wait_for_workers=False)
        host, port = mpi_group.broadcast_object((host, store.port if store is not None else None))
        if store is None:
            store = dist.TCPStore(host, port, size, False, delta)
        master_addr, master_port = host, port
    else:
        try:
            store = dist.TCPStore(master_addr, master_port, size, rank == 0, delta, wait_for_workers=False)
        except Exception as e:  # torch raises DistNetworkError / DistStoreError / RuntimeError by version
            what = (f'rank 0 could not serve the rendezvous on port {master_port}' if rank == 0 else
                    f'rank {rank} could not reach rank 0 at {master_addr}:{master_port} within {limit:g} s')
            raise TimeoutError(f'{what} ({type(e).__name__}: {e}); {origin} announced {size} ranks: start all of '
                               f'them, and set MASTER_ADDR/MASTER_PORT to rank 0\'s host and a free port') from e

    # Check in, then wait (bounded) until every rank has: the missing ones are named
    prefix = 'deepep_cupy/join'
    store.set(f'{prefix}/{rank}', socket.gethostname())
    deadline = time.monotonic() + limit
    delay = 0.005
    while True:
        present = [r for r in range(size) if store.check([f'{prefix}/{r}'])]
        if len(present) == size:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(size)) - set(present))
            raise TimeoutError(f'rank {rank}: {len(missing)} of {size} ranks did not join the torch.distributed '
                               f'rendezvous at {master_addr}:{master_port} within {limit:g} s (missing ranks '
                               f'{missing}); {origin} announced {size} ranks: start all of them, or fix those '
                               f'variables')
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=delta)
