"""Rank → GPU binding and the two communication domains.

Scale-up domain: the ranks of one host whose GPUs reach each other over NVLink/P2P (CUDA IPC works between them);
scale-out domain: one rank per scale-up domain with the same index (they talk over NCCL). Ranks are laid out so that
scale-up domains are consecutive: `scaleout_idx = rank // num_scaleup`, `scaleup_idx = rank % num_scaleup`.
`DEEPEP_CUPY_SCALEUP_SIZE` forces a smaller scale-up domain (e.g. 1) so the scale-out path runs on one host.
"""

from dataclasses import dataclass
from typing import Optional

from .. import envs
from ..constants import NUM_MAX_SCALEUP_RANKS
from . import preflight
from .group import ProcessGroup


def select_device(group: ProcessGroup, device: Optional[int] = None) -> int:
    """Bind this process to a CUDA device and return its index.

    Args:
        group: the process group (its `local_rank` picks the device).
        device: explicit device index; default `DEEPEP_CUPY_DEVICE`, else `local_rank % num_visible_devices`
            (several ranks share a GPU when a host runs more ranks than it has GPUs, for logic tests).
    """
    preflight.check_cuda()      # driver, CuPy build, NVRTC, a visible GPU: one-line SetupError naming the fix
    import cupy
    num_devices = cupy.cuda.runtime.getDeviceCount()
    if num_devices == 0:
        raise RuntimeError('deepep_cupy: no CUDA device is visible to this process')
    if device is None:
        device = envs.device_override()
    if device is None:
        device = group.local_rank % num_devices
    if not 0 <= device < num_devices:
        raise ValueError(f'device: {device} is not a visible CUDA device (0..{num_devices - 1})')
    cupy.cuda.Device(device).use()
    return device


@dataclass(frozen=True)
class Topology:
    """Where every rank lives.

    Attributes:
        num_ranks, rank: the group.
        num_scaleup_ranks: ranks per scale-up (NVLink) domain; `num_scaleout_ranks = num_ranks // num_scaleup_ranks`.
        scaleup_rank_idx, scaleout_rank_idx: this rank's position.
        physical_scaleup: the NVLink-reachable domain size before any override.
        device: this rank's CUDA device; pci_bus_ids: every rank's GPU (ranks sharing a GPU share the id).
    """
    num_ranks: int
    rank: int
    num_scaleup_ranks: int
    num_scaleout_ranks: int
    scaleup_rank_idx: int
    scaleout_rank_idx: int
    physical_scaleup: int
    device: int
    pci_bus_ids: tuple

    @property
    def scaleup_peers(self):
        """Global ranks of this rank's scale-up domain, in scale-up index order."""
        base = self.scaleout_rank_idx * self.num_scaleup_ranks
        return list(range(base, base + self.num_scaleup_ranks))

    def num_ranks_per_gpu(self) -> int:
        """Largest number of ranks of this scale-up domain sharing one GPU (1 in production runs)."""
        ids = [self.pci_bus_ids[r] for r in self.scaleup_peers]
        return max(ids.count(i) for i in ids)


def detect_topology(group: ProcessGroup, device: int, allow_hybrid_mode: bool = True) -> Topology:
    """Work out the domains (a host collective: every rank must call it).

    The physical scale-up domain is the ranks of one host when every pair of their GPUs can access each other
    (`cudaDeviceCanAccessPeer`, or the same GPU), else 1. Hosts must hold equal, consecutive rank blocks.
    With `allow_hybrid_mode=False` the whole group is one logical domain (direct mode), which needs one host.
    """
    import cupy
    pci = cupy.cuda.runtime.deviceGetPCIBusId(device)
    infos = group.allgather_object((group.host_idx, pci, device))
    pci_ids = tuple(i[1] for i in infos)

    # Peer access among this host's GPUs (checked locally; the host's ranks see the same GPUs).
    host_ranks = [r for r in range(group.size) if infos[r][0] == group.host_idx]
    local_ok = True
    for r in host_ranks:
        other = infos[r][2]
        if pci_ids[r] != pci and not cupy.cuda.runtime.deviceCanAccessPeer(device, other):
            local_ok = False
    all_ok = all(group.allgather_object(local_ok))
    counts = [sum(1 for i in infos if i[0] == h) for h in range(group.num_hosts)]
    if len(set(counts)) != 1:
        raise ValueError(f'every host must run the same number of ranks, got {counts} ranks per host')
    if any(infos[r][0] != r // counts[0] for r in range(group.size)):
        raise ValueError('ranks must be laid out host by host (ranks 0..n-1 on the first host, and so on)')
    physical = counts[0] if all_ok else 1

    scaleup = physical
    forced = envs.scaleup_size()
    if forced is not None:
        if forced < 1 or physical % forced != 0:
            raise ValueError(f'DEEPEP_CUPY_SCALEUP_SIZE={forced} must divide the physical scale-up size {physical}')
        scaleup = forced
    if not allow_hybrid_mode:
        if scaleup != group.size:
            raise ValueError(f'allow_hybrid_mode=False (direct mode) needs every rank in one scale-up domain, but the '
                             f'domain holds {scaleup} of {group.size} ranks')
    if scaleup > NUM_MAX_SCALEUP_RANKS:
        raise ValueError(f'a scale-up domain holds at most {NUM_MAX_SCALEUP_RANKS} ranks, got {scaleup}')
    return Topology(num_ranks=group.size, rank=group.rank, num_scaleup_ranks=scaleup,
                    num_scaleout_ranks=group.size // scaleup, scaleup_rank_idx=group.rank % scaleup,
                    scaleout_rank_idx=group.rank // scaleup, physical_scaleup=physical, device=device,
                    pci_bus_ids=pci_ids)


def get_physical_domain_size(group=None, comm=None):
    """`(num_scaleout, num_scaleup)` of the hardware for a group (a collective: every rank calls it). Binds this
    process to its GPU like a buffer would."""
    from .group import get_group
    pg = get_group(group, comm)
    topo = detect_topology(pg, select_device(pg))
    return pg.size // topo.physical_scaleup, topo.physical_scaleup


def get_logical_domain_size(group=None, allow_hybrid_mode: bool = True, comm=None):
    """`(num_scaleout, num_scaleup)` a buffer with `allow_hybrid_mode` would use (honours
    `DEEPEP_CUPY_SCALEUP_SIZE`; direct mode is one domain)."""
    from .group import get_group
    pg = get_group(group, comm)
    topo = detect_topology(pg, select_device(pg), allow_hybrid_mode)
    return topo.num_scaleout_ranks, topo.num_scaleup_ranks
