"""Test-program setup (DeepEP's `deep_ep.utils.envs`): joining the job, device binding, per-rank seeds,
rank-synchronised printing, link bandwidths and domain sizes.

`init_dist` has two forms:

- DeepEP's, `init_dist(local_rank, num_local_ranks, seed=0)`, for programs that start their ranks with
  `torch.multiprocessing.spawn`: a world of `WORLD_SIZE` nodes × `num_local_ranks` ranks, `RANK` the node index,
  rendezvous at `MASTER_ADDR` (127.0.0.1) : `MASTER_PORT` (8361), global rank `RANK * num_local_ranks + local_rank`.
  It makes bfloat16 and CUDA torch's defaults, as DeepEP does.
- Ours, `init_dist()` / `init_dist(seed=...)`, for programs started by a launcher: it joins the job the launcher made
  (an initialised torch.distributed, torchrun, mpirun, SLURM srun, or RANK / WORLD_SIZE by hand) and leaves torch's
  defaults alone.

Either way, when torch is installed `torch.distributed` is initialised afterwards (NCCL for CUDA tensors when every rank
of a host has its own GPU, gloo for the rest and for ranks sharing a GPU) and the returned group is a torch
ProcessGroup, so DeepEP-style `dist.*` calls work. Without torch the group is ours (MPI, or a TCP group for torchrun /
SLURM style environments). torch is imported lazily: CuPy-only programs can use all of this.
"""

import functools
import os
import random
import re
import subprocess
from typing import List, Optional, Tuple

from .. import envs as lib_envs
from ..runtime import group as group_mod
from ..runtime import nvlink as _nvlink
from ..runtime import tcp_group
from ..runtime.group import ProcessGroup
from ..runtime.nvlink import parse_nvlink_gbs  # noqa: F401  (re-exported: DeepEP's name)
from ..runtime.topology import get_logical_domain_size, get_physical_domain_size

__all__ = ['init_dist', 'init_seed', 'get_local_seed', 'get_global_seed', 'dist_print', 'get_nvlink_gbs',
           'get_rdma_gbs', 'get_sm_read_gbs', 'get_sm_write_gbs', 'check_fast_rdma_atomic_support',
           'check_nvlink_connections', 'check_torch_deterministic', 'get_physical_domain_size',
           'get_logical_domain_size', 'EnvOverride']

# State of the last `init_dist` / `init_seed` call (upstream keeps the same module-level globals).
_group: Optional[ProcessGroup] = None
_local_rank: Optional[int] = None
_local_seed: Optional[int] = None
_global_seed: Optional[int] = None

# `get_rdma_gbs` when neither an InfiniBand NIC nor NVLink is found: one PCIe Gen5 x16 link, GB/s.
FALLBACK_LINK_GBS = 50.0

# Backends of the torch world `init_dist` makes: NCCL for CUDA tensors (one GPU per rank), gloo for CPU objects.
TORCH_BACKEND_OWN_GPUS = 'cpu:gloo,cuda:nccl'
TORCH_BACKEND_SHARED_GPUS = 'gloo'


def _import_torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    return torch if dist.is_available() else None


def _num_cuda_devices(torch=None) -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver or no device: ask torch, else there is no GPU to bind
        pass
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 0


# NCCL between ranks sharing a GPU: the library's envs holds these (the runner uses them too); re-exported here, where
# DeepEP's programs and the test programs find them.
NCCL_SHARED_GPU_ENV = lib_envs.NCCL_SHARED_GPU_ENV
NCCL_HOST_PER_RANK_ENV = lib_envs.NCCL_HOST_PER_RANK_ENV
nccl_hosts_emulated = lib_envs.nccl_hosts_emulated
emulate_nccl_host = lib_envs.emulate_nccl_host


def torch_backend(num_local_ranks: int, torch=None) -> str:
    """The torch.distributed backend for `num_local_ranks` ranks per host: NCCL (CUDA tensors) plus gloo (CPU) when
    every rank can have its own GPU, or when ranks share GPUs but each names its own NCCL host (`NCCL_HOSTID`, see
    `emulate_nccl_host`); gloo alone when ranks share a GPU otherwise (NCCL would refuse them) or torch sees no
    GPU."""
    torch = torch or _import_torch()
    if torch is not None and torch.cuda.is_available() and (
            torch.cuda.device_count() >= max(1, num_local_ranks) or nccl_hosts_emulated()):
        return TORCH_BACKEND_OWN_GPUS
    return TORCH_BACKEND_SHARED_GPUS


def _bind_device(local_rank: int, torch) -> Optional[int]:
    """Make `DEEPEP_CUPY_DEVICE`, else `local_rank % num_devices`, current for CuPy and torch (None without a GPU)."""
    num_devices = _num_cuda_devices(torch)
    if num_devices == 0:
        return None
    device = lib_envs.device_override()
    device = local_rank % num_devices if device is None else device
    if not 0 <= device < num_devices:
        raise ValueError(f'DEEPEP_CUPY_DEVICE={device} is not a visible CUDA device (0..{num_devices - 1})')
    try:
        import cupy
        cupy.cuda.Device(device).use()
    except ImportError:
        pass
    if torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(device)
    return device


def init_dist(local_rank: Optional[int] = None, num_local_ranks: Optional[int] = None, seed: int = 0, group=None,
              comm=None, set_torch_defaults: Optional[bool] = None):
    """Join (or make) the job's process group, bind this rank's GPU and seed every RNG.

    DeepEP's form (`local_rank` given, ranks started by `torch.multiprocessing.spawn`): the world is `WORLD_SIZE`
    nodes (default 1) × `num_local_ranks`, this is rank `RANK * num_local_ranks + local_rank` (`RANK` = node index,
    default 0), the rendezvous is at `MASTER_ADDR`:`MASTER_PORT` (default 127.0.0.1:8361) and the GPU is
    `DEEPEP_CUPY_DEVICE`, else `local_rank % num_visible_devices`.

    Launcher form (`local_rank` None): the job is, in order, `group` (a torch or our `ProcessGroup`) or `comm` (an
    mpi4py communicator) when given, an initialised torch.distributed, mpirun (ranks from MPI; the torch rendezvous
    address goes from rank 0 over MPI), torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT),
    SLURM srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, tasks per node; MASTER_ADDR/PORT from the environment,
    else the first node and a port from the job id), RANK / WORLD_SIZE set by hand, else this process alone. The GPU
    is `DEEPEP_CUPY_DEVICE`, else the local rank modulo the visible devices.

    A rank that never arrives makes every other rank raise `TimeoutError` naming it within
    `DEEPEP_CUPY_CPU_TIMEOUT_SECS` (default 300 s).

    Args:
        local_rank: this rank's index on its node (DeepEP's form); None to join a launched job.
        num_local_ranks: ranks per node (required with `local_rank`).
        seed: global seed; each rank uses `seed + rank` (see `init_seed`).
        group: a torch.distributed ProcessGroup or a `ProcessGroup` to use as is (launcher form).
        comm: an mpi4py communicator (launcher form).
        set_torch_defaults: make bfloat16 torch's default dtype and CUDA its default device (when torch sees CUDA);
            default True in DeepEP's form, False in the launcher form.

    Returns:
        `(rank, num_ranks, group)`: `group` is a torch.distributed ProcessGroup when torch is installed (DeepEP's
        form: a new group over all ranks, as DeepEP returns; launcher form: the world, or the `group` given), else our
        `ProcessGroup`. `deepep_cupy.get_group()` gives our host-side view of the job in every case.
    """
    global _group, _local_rank
    torch = _import_torch()
    if local_rank is not None:
        rank, size, ret_group, pg, local_rank = _init_spawned(local_rank, num_local_ranks, torch)
        defaults = True if set_torch_defaults is None else set_torch_defaults
    else:
        if num_local_ranks is not None:
            raise ValueError('num_local_ranks needs local_rank: pass both (DeepEP\'s form) or neither (launcher form)')
        rank, size, ret_group, pg = _join_launched(group, comm, torch)
        local_rank = pg.local_rank
        _bind_device(local_rank, torch)
        defaults = bool(set_torch_defaults)
    _group, _local_rank = pg, local_rank
    if defaults and torch is not None:
        torch.set_default_dtype(torch.bfloat16)
        if torch.cuda.is_available():
            torch.set_default_device('cuda')
    init_seed(seed, pg)
    return rank, size, ret_group


def _init_spawned(local_rank, num_local_ranks, torch):
    """DeepEP's form: the world from MASTER_ADDR / MASTER_PORT / WORLD_SIZE (nodes) / RANK (node index)."""
    if not isinstance(num_local_ranks, int) or num_local_ranks < 1:
        raise ValueError(f'num_local_ranks must be a positive int, got {num_local_ranks!r}')
    if not isinstance(local_rank, int) or not 0 <= local_rank < num_local_ranks:
        raise ValueError(f'local_rank={local_rank!r} must be an int in [0, num_local_ranks={num_local_ranks})')
    addr = os.environ.get('MASTER_ADDR') or group_mod.DEFAULT_MASTER_ADDR
    port = int(os.environ.get('MASTER_PORT') or group_mod.DEFAULT_MASTER_PORT)
    num_nodes = int(os.environ.get('WORLD_SIZE') or 1)
    node_rank = int(os.environ.get('RANK') or 0)
    rank, size = node_rank * num_local_ranks + local_rank, num_nodes * num_local_ranks
    origin = (f'init_dist(local_rank={local_rank}, num_local_ranks={num_local_ranks}) with WORLD_SIZE={num_nodes} '
              f'node(s), RANK={node_rank}, MASTER_ADDR={addr}, MASTER_PORT={port}')
    _bind_device(local_rank, torch)
    if torch is None:
        pg = tcp_group.TcpProcessGroup(rank, size, addr, port, origin=origin)
        group_mod.set_default_group(pg)
        return rank, size, pg, pg, local_rank
    import torch.distributed as dist
    wanted = lib_envs.rail_transport() == 'nccl' or lib_envs.nccl_host_per_rank()
    if (wanted and not nccl_hosts_emulated() and torch.cuda.is_available()
            and torch.cuda.device_count() < num_local_ranks):
        # NCCL rails (or NCCL for the program's own references) asked for while ranks share GPUs (DeepEP's programs
        # on one GPU): every rank its own NCCL host, so NCCL joins them (sockets over the loopback) instead of
        # refusing; README: Testing scale-out on one GPU.
        emulate_nccl_host(f'deepep_cupy_rank{rank}')
    if not dist.is_initialized():
        group_mod.init_torch_distributed(rank, size, addr, port, torch_backend(num_local_ranks, torch),
                                         origin=origin)
    ret_group = dist.new_group(list(range(dist.get_world_size())))
    return dist.get_rank(), dist.get_world_size(), ret_group, group_mod.TorchProcessGroup(ret_group), local_rank


def _join_launched(group, comm, torch):
    """The launcher form: returns (rank, size, group to return, our ProcessGroup)."""
    dist = None
    if torch is not None:
        import torch.distributed as dist
    if group is not None or comm is not None:
        pg = group_mod.get_group(group=group, comm=comm)
        if group is None and dist is not None and not dist.is_initialized():
            group_mod.init_torch_distributed(pg.rank, pg.size, '', 0, torch_backend(pg.local_size, torch),
                                             origin='the mpi4py communicator given', mpi_group=pg)
        ret = group if group is not None else (dist.group.WORLD if dist is not None else pg)
        return pg.rank, pg.size, ret, pg

    if dist is not None and dist.is_initialized():
        pg = group_mod.get_group()
        return dist.get_rank(), dist.get_world_size(), dist.group.WORLD, pg

    launch = group_mod.detect_launch()
    if launch.launcher == 'mpi':
        pg = group_mod.MPIProcessGroup()
        if dist is not None:
            group_mod.init_torch_distributed(pg.rank, pg.size, launch.master_addr, launch.master_port,
                                             torch_backend(pg.local_size, torch), origin=launch.origin, mpi_group=pg)
            return pg.rank, pg.size, dist.group.WORLD, pg
        return pg.rank, pg.size, pg, pg

    if launch.launcher == 'none':
        if dist is None:
            pg = group_mod.SingleProcessGroup()
            return 0, 1, pg, pg
        dist.init_process_group(torch_backend(1, torch), store=dist.HashStore(), rank=0, world_size=1)
        return 0, 1, dist.group.WORLD, group_mod.TorchProcessGroup()

    # torchrun, SLURM, RANK / WORLD_SIZE by hand
    if dist is None:
        pg = tcp_group.TcpProcessGroup(launch.rank, launch.size, launch.master_addr, launch.master_port,
                                       origin=launch.origin)
        group_mod.set_default_group(pg)
        return pg.rank, pg.size, pg, pg
    local_size = launch.local_size if launch.local_size > 0 else launch.size
    group_mod.init_torch_distributed(
        launch.rank, launch.size, launch.master_addr, launch.master_port, torch_backend(local_size, torch),
        origin=launch.origin, use_launcher_store=os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True')
    return launch.rank, launch.size, dist.group.WORLD, group_mod.TorchProcessGroup()


def _current_rank() -> int:
    """This process's rank without a collective when possible (the `init_dist` group, torch.distributed)."""
    if _group is not None:
        return _group.rank
    if group_mod._torch_distributed_initialized():
        import torch.distributed as dist
        return dist.get_rank()
    return group_mod.get_group().rank


def init_seed(global_seed: int, group: Optional[ProcessGroup] = None) -> None:
    """Seed torch (if installed), `random` and NumPy with `global_seed + rank`.

    Args:
        global_seed: the seed shared by all ranks (what `get_global_seed` returns).
        group: whose rank to add (default: the `init_dist` group, else the torch.distributed rank as DeepEP, else
            `get_group()`'s, a collective under mpirun).
    """
    global _local_seed, _global_seed
    _global_seed = int(global_seed)
    _local_seed = _global_seed + (group.rank if group is not None else _current_rank())
    random.seed(_local_seed)
    import numpy as np
    np.random.seed(_local_seed % 2**32)
    torch = _import_torch()
    if torch is not None:
        torch.manual_seed(_local_seed)


def get_local_seed() -> int:
    """This rank's seed (`global seed + rank`) from the last `init_seed`."""
    if _local_seed is None:
        raise RuntimeError('no seed yet: call init_dist or init_seed first')
    return _local_seed


def get_global_seed() -> int:
    """The seed shared by all ranks, from the last `init_seed`."""
    if _global_seed is None:
        raise RuntimeError('no seed yet: call init_dist or init_seed first')
    return _global_seed


def dist_print(s: str = '', once_in_node: bool = False, group: Optional[ProcessGroup] = None) -> None:
    """Print (flushed) then wait for every rank, so output of successive calls does not interleave across steps.

    Args:
        s: the text.
        once_in_node: print only on each node's local rank 0.
        group: the ranks to synchronise (default: the `init_dist` group; none: print without a barrier).
    """
    group = group if group is not None else _group
    local_rank = _local_rank if group is _group and _local_rank is not None else getattr(group, 'local_rank', 0)
    if not once_in_node or local_rank == 0:
        print(s, flush=True)
    if group is not None:
        group.barrier()


def check_nvlink_connections(group) -> None:
    """On PCIe GPUs (whose NVLink bridges pair two GPUs at most), check that the group has at most 2 ranks and that
    their GPUs are NVLink-connected (through NVML, when `pynvml` is installed). Other GPUs pass: the buffers check
    peer access themselves.

    Args:
        group: a torch ProcessGroup or a `ProcessGroup` (a collective: every rank calls it).
    """
    torch = _import_torch()
    if torch is None or not torch.cuda.is_available() or 'PCIE' not in torch.cuda.get_device_name().upper():
        return
    pg = group_mod.get_group(group)
    if pg.size > 2:
        raise RuntimeError(f'PCIe GPUs only have pairwise NVLink connections: a group of {pg.size} ranks cannot use '
                           f'NVLink between all of them')
    import cupy
    bus_ids = pg.allgather_object(cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.runtime.getDevice()))
    try:
        import pynvml
    except ImportError:
        return
    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByPciBusId(b) for b in bus_ids]
        for i in range(len(handles)):
            for j in range(i + 1, len(handles)):
                status = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                if status != pynvml.NVML_P2P_STATUS_OK:
                    raise RuntimeError(f'GPUs {bus_ids[i]} and {bus_ids[j]} are not connected via NVLink')
    finally:
        pynvml.nvmlShutdown()


def check_torch_deterministic() -> None:
    """Refuse torch's deterministic algorithms together with `fill_uninitialized_memory`: then `torch.empty` launches
    a fill kernel that may race with the communication stream."""
    import torch
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        raise RuntimeError('torch.use_deterministic_algorithms(True) with torch.utils.deterministic.'
                           'fill_uninitialized_memory=True makes torch.empty launch fill kernels that can race with '
                           'the communication stream: turn fill_uninitialized_memory off')


def _run(args: List[str]) -> Optional[str]:
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def parse_ibstat_rate(text: str, nic_name: str) -> Optional[int]:
    """The `Rate:` (Gb/s) of the first port of CA `nic_name` in `ibstat` output, or None."""
    match = re.search(rf"CA '{re.escape(nic_name)}'.*?Port \d+:\s*.*?Rate:\s*(\d+)", text, re.DOTALL)
    return int(match.group(1)) if match else None


@functools.lru_cache
def get_rdma_gbs(nic_name: str = 'mlx5_0') -> float:
    """RDMA bandwidth of `nic_name` in GB/s: its `ibstat` rate (Gb/s) / 8.

    Without that NIC (or without `ibstat`) deepep_cupy carries the traffic DeepEP sends over RDMA (PP send/recv,
    scale-out) over NVLink or NCCL, so this returns `get_nvlink_gbs()` instead, and `FALLBACK_LINK_GBS` (a PCIe Gen5
    x16 link) when no NVLink is reported either. DeepEP returns 0 there, which makes its PP test divide by zero.

    Args:
        nic_name: the InfiniBand CA name.
    """
    text = _run(['ibstat'])
    rate = None if text is None else parse_ibstat_rate(text, nic_name)
    if rate is not None:
        return rate / 8
    return _nvlink.get_nvlink_gbs() or FALLBACK_LINK_GBS


@functools.lru_cache
def check_fast_rdma_atomic_support(nic_name: str = 'mlx5_0') -> bool:
    """Whether `nic_name` is a ConnectX-8 or newer (`ibstat` CA type MT4131), which has fast RDMA atomics."""
    text = _run(['ibstat'])
    if text is None:
        return False
    match = re.search(rf"CA '{re.escape(nic_name)}'.*?CA type:\s*(\S+)", text, re.DOTALL)
    return match is not None and match.group(1) == 'MT4131'


@functools.lru_cache
def get_sm_read_gbs() -> float:
    """Default HBM read bandwidth one SM reaches, GB/s (DeepEP V2.5's constant)."""
    return 180


@functools.lru_cache
def get_sm_write_gbs() -> float:
    """Default HBM write bandwidth one SM reaches, GB/s (DeepEP V2.5's constant)."""
    return 45


class EnvOverride:
    """Set environment variables inside a `with` block and restore them after (DeepEP V2.5).

    Args:
        envs: `(name, value, enable)` triples; only enabled ones are set.
    """

    def __init__(self, envs: List[Tuple[str, str, bool]]):
        self.envs = {name: value for name, value, enable in envs if enable}
        self.original_values = {}

    def __enter__(self):
        self.original_values = {name: os.environ.get(name) for name in self.envs}
        os.environ.update(self.envs)
        return self

    def __exit__(self, *_):
        for name, value in self.original_values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@functools.lru_cache
def get_nvlink_gbs(factor: float = 0.9) -> float:
    """Usable NVLink bandwidth of one GPU: the sum of its links' GB/s (first GPU of `nvidia-smi nvlink -s`) × `factor`.

    Without NVLink (a single GPU, PCIe GPUs, no nvidia-smi) this returns `FALLBACK_LINK_GBS` × `factor`, not 0 as
    DeepEP does: DeepEP's test programs divide by it in their performance lines. The library's own SM heuristics read
    the exact figure (`deepep_cupy.runtime.nvlink`).

    Args:
        factor: the fraction of the link rate a kernel can reach.
    """
    return _nvlink.get_nvlink_gbs(factor) or FALLBACK_LINK_GBS * factor
