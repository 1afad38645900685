"""The number of ranks of a group as users pass it, read locally (no collective, no process group built)."""

import sys

import numpy as np


def group_size(group=None, comm=None) -> int:
    """Ranks of `group` or `comm`, without communicating.

    Args:
        group: an int (the size itself), a deepep_cupy `ProcessGroup`, a `torch.distributed` ProcessGroup, or None.
        comm: an mpi4py communicator (instead of `group`).

    Returns:
        the size; for neither, the world's: `mpirun`'s, else the initialised `torch.distributed` world, else 1.
    """
    if group is not None and comm is not None:
        raise ValueError('pass either group= (torch.distributed) or comm= (mpi4py), not both')
    g = comm if comm is not None else group
    if g is None:
        from .group import launched_by_mpi
        if launched_by_mpi():
            from mpi4py import MPI
            return MPI.COMM_WORLD.Get_size()
        if 'torch' in sys.modules:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                return dist.get_world_size()
        return 1
    if isinstance(g, (int, np.integer)) and not isinstance(g, bool):
        return int(g)
    if hasattr(g, 'allgather_object') and isinstance(getattr(g, 'size', None), int):    # our ProcessGroup
        return g.size
    if callable(getattr(g, 'Get_size', None)):                                          # mpi4py
        return int(g.Get_size())
    if callable(getattr(g, 'size', None)):                                              # torch ProcessGroup
        return int(g.size())
    raise TypeError(f'group must be a torch.distributed ProcessGroup, a deepep_cupy ProcessGroup, an mpi4py '
                    f'communicator (comm=) or an int, got {type(g).__name__}')
