"""Test-program setup: process group and device binding, per-rank seeds, rank-synchronised printing, NVLink bandwidth.

Unlike upstream, `init_dist` does not create the process group itself: it picks up what the launcher gave (mpirun,
an initialised torch.distributed, or nothing) through `runtime.group.get_group`, and it never changes torch's default
dtype or device. torch is imported lazily, so CuPy-only programs can use all of this.
"""

import random
import sys
from typing import Optional, Tuple

from ..runtime import group as group_mod
from ..runtime.group import ProcessGroup

# State of the last `init_dist` / `init_seed` call (upstream keeps the same module-level globals).
_group: Optional[ProcessGroup] = None
_local_seed: Optional[int] = None
_global_seed: Optional[int] = None


def _torch_distributed_initialized() -> bool:
    # Only look if the user already imported torch: a torch group cannot exist otherwise
    if 'torch' not in sys.modules:
        return False
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _num_cuda_devices() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver or no device: all mean "no GPU to bind"
        return 0


def init_dist(local_rank: Optional[int] = None, num_local_ranks: Optional[int] = None, seed: int = 0, group=None,
              comm=None) -> Tuple[int, int, ProcessGroup]:
    """Join the job's process group, bind this rank's GPU and seed every RNG.

    The group is, in order: the `group` (torch ProcessGroup or our `ProcessGroup`) or `comm` (mpi4py communicator)
    given, MPI when started by `mpirun`, the torch.distributed world when it is already initialised, else a
    single-process group. The GPU is `DEEPEP_CUPY_DEVICE` if set, else `local_rank % device_count`; it is made
    current for CuPy and, when torch is imported and sees CUDA, for torch. Without a GPU nothing is bound.

    Args:
        local_rank: this rank's index on its host (default: the group's `local_rank`).
        num_local_ranks: ranks per host, to check `local_rank` against (default: the group's `local_size`).
        seed: global seed; each rank uses `seed + rank` (see `init_seed`).
        group: a torch.distributed ProcessGroup or a `ProcessGroup`.
        comm: an mpi4py communicator.

    Returns:
        `(rank, world_size, group)` with `group` our `ProcessGroup`.
    """
    global _group
    if group is None and comm is None and not group_mod.launched_by_mpi() and _torch_distributed_initialized():
        import torch.distributed as dist
        group = dist.group.WORLD
    pg = group_mod.get_group(group=group, comm=comm)

    local_rank = pg.local_rank if local_rank is None else local_rank
    num_local_ranks = pg.local_size if num_local_ranks is None else num_local_ranks
    if not isinstance(local_rank, int) or not 0 <= local_rank < num_local_ranks:
        raise ValueError(f'local_rank={local_rank!r} must be an int in [0, num_local_ranks={num_local_ranks})')

    num_devices = _num_cuda_devices()
    if num_devices > 0:
        import cupy

        from .. import envs
        device = envs.device_override()
        device = local_rank % num_devices if device is None else device
        cupy.cuda.Device(device).use()
        if 'torch' in sys.modules:
            import torch
            if torch.cuda.is_available():
                torch.cuda.set_device(device)

    _group = pg
    init_seed(seed, pg)
    return pg.rank, pg.size, pg


def init_seed(global_seed: int, group: Optional[ProcessGroup] = None) -> None:
    """Seed torch (if installed), `random` and NumPy with `global_seed + rank`.

    Args:
        global_seed: the seed shared by all ranks (what `get_global_seed` returns).
        group: whose rank to add (default: the `init_dist` group, else a group from `get_group()`, which is a
            collective under mpirun).
    """
    global _local_seed, _global_seed
    group = group if group is not None else (_group if _group is not None else group_mod.get_group())
    _global_seed = int(global_seed)
    _local_seed = _global_seed + group.rank
    random.seed(_local_seed)
    import numpy as np
    np.random.seed(_local_seed % 2**32)
    try:
        import torch
    except ImportError:
        return
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
        once_in_node: print only on each host's local rank 0.
        group: the ranks to synchronise (default: the `init_dist` group; none: print without a barrier).
    """
    group = group if group is not None else _group
    if not once_in_node or group is None or group.local_rank == 0:
        print(s, flush=True)
    if group is not None:
        group.barrier()


from ..runtime.nvlink import get_nvlink_gbs, parse_nvlink_gbs  # noqa: E402,F401  (the probe lives in runtime)
