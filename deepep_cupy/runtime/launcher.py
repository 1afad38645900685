"""What the launcher announced (torchrun, mpirun, SLURM srun, RANK / WORLD_SIZE by hand) and a bounded, diagnosed
rendezvous for torch.distributed. `runtime.group` builds the host process group from these."""

import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Optional

from .. import envs

DEFAULT_CPU_TIMEOUT_SECS = 300.0


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


# -------------------------------------------------------------------------------------------------------------------
# Joining torch.distributed


def init_torch_distributed(rank: int, size: int, master_addr: str, master_port: int, backend: str,
                           timeout: Optional[float] = None, origin: str = 'the environment',
                           mpi_group=None, use_launcher_store: bool = False) -> None:
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
        _register_exit(dist.distributed_c10d._get_default_store(), rank, size)
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
    _register_exit(store, rank, size)


_exit_state = {}


def _register_exit(store, rank: int, size: int) -> None:
    """At interpreter exit, every rank checks out through the store before torch.distributed is torn down, so rank 0
    (which serves the store) outlives the others' last use of it: exiting first would abort the process
    ('terminate called without an active exception') and leave the peers' teardown to time out."""
    import atexit
    if not _exit_state:
        atexit.register(_check_out)
    _exit_state.update(store=store, rank=rank, size=size)


def _check_out(limit: float = 30.0, grace: float = 1.0) -> None:
    store = _exit_state.pop('store', None)
    if store is None:
        return
    try:
        # Tear this rank's process group down first (its threads may still talk to the peers and the store), then
        # check out; the store's host leaves last, a grace period after the last check-out, while every other rank
        # has already dropped its connection (a client still connected when the server goes away can abort at exit:
        # 'terminate called without an active exception', seen rarely under load, still with a 0.3 s grace).
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        store.add('deepep_cupy/exit', 1)
        if not rank_zero_waits(_exit_state['rank']):
            del store           # the last reference: the client disconnects now, before the host leaves
            import gc
            gc.collect()        # and any cycle still holding the client
            return
        deadline = time.monotonic() + limit
        while int(store.add('deepep_cupy/exit', 0)) < _exit_state['size']:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        time.sleep(grace)
    except Exception:  # noqa: BLE001  (exit path: a peer may already be gone)
        pass


def rank_zero_waits(rank: int) -> bool:
    """Only the store's host waits for the others to check out."""
    return rank == 0
