"""Rank → GPU binding and the two communication domains.

Scale-up domain: the ranks of one host whose GPUs reach each other over NVLink/P2P (CUDA IPC works between them);
scale-out domain: one rank per scale-up domain with the same index (they talk over NCCL). Ranks are laid out so that
scale-up domains are consecutive: `scaleout_idx = rank // num_scaleup`, `scaleup_idx = rank % num_scaleup`.
`DEEPEP_CUPY_SCALEUP_SIZE` forces a smaller scale-up domain (e.g. 1) so the scale-out path runs on one host.
"""

import os
import socket
import sys
from dataclasses import dataclass
from typing import Optional

from .. import envs
from ..constants import NUM_MAX_SCALEUP_RANKS
from . import preflight
from .group import ProcessGroup


def _torch_current_device() -> Optional[int]:
    """torch's current CUDA device when the caller has set one up (torch imported and its CUDA initialised)."""
    torch = sys.modules.get('torch')
    if torch is None or not hasattr(torch, 'cuda') or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def select_device(group: ProcessGroup, device: Optional[int] = None) -> int:
    """Bind this process to a CUDA device and return its index.

    Args:
        group: the process group (its `local_rank` picks the device when nothing else does).
        device: explicit device index; default: torch's current device when torch has initialised CUDA (vLLM, SGLang
            and Megatron select each rank's GPU that way), else `DEEPEP_CUPY_DEVICE`, else
            `local_rank % num_visible_devices` (several ranks share a GPU when a host runs more ranks than it has
            GPUs, for logic tests).
    """
    preflight.check_cuda()      # driver, CuPy build, NVRTC, a visible GPU: one-line SetupError naming the fix
    import cupy
    num_devices = cupy.cuda.runtime.getDeviceCount()
    if num_devices == 0:
        raise RuntimeError('deepep_cupy: no CUDA device is visible to this process')
    if device is None:
        device = _torch_current_device()
    if device is None:
        device = envs.device_override()
    if device is None:
        device = group.local_rank % num_devices
    if not 0 <= device < num_devices:
        raise ValueError(f'device: {device} is not a visible CUDA device (0..{num_devices - 1})')
    cupy.cuda.Device(device).use()
    return device


def _local_ordinal(pci_bus_id: str) -> Optional[int]:
    """This process's ordinal of the GPU with `pci_bus_id` (`cudaDeviceGetByPCIBusId`), None if it is not visible."""
    import cupy
    try:
        return int(cupy.cuda.runtime.deviceGetByPCIBusId(pci_bus_id))
    except Exception:  # noqa: BLE001 (cudaErrorInvalidDevice and friends: hidden by CUDA_VISIBLE_DEVICES)
        return None


def _nvml_bus_id(pci_bus_id: str) -> str:
    """NVML's spelling of a PCI bus id: an 8-digit domain (CUDA gives 4), upper case."""
    domain, _, rest = pci_bus_id.partition(':')
    return f'{int(domain, 16):08X}:{rest.upper()}' if rest else pci_bus_id.upper()


def _nvml_peer_access(pci_bus_id: str, peer_bus_ids) -> Optional[bool]:
    """Whether NVML reports P2P reads between this GPU and every peer (by PCI bus id, so it works for GPUs this
    process cannot see); None when NVML (`pynvml`, package `nvidia-ml-py`) is missing or fails."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 (no driver)
        return None
    try:
        mine = pynvml.nvmlDeviceGetHandleByPciBusId(_nvml_bus_id(pci_bus_id))
        for peer in peer_bus_ids:
            other = pynvml.nvmlDeviceGetHandleByPciBusId(_nvml_bus_id(peer))
            if pynvml.nvmlDeviceGetP2PStatus(mine, other, pynvml.NVML_P2P_CAPS_INDEX_READ) != \
                    pynvml.NVML_P2P_STATUS_OK:
                return False
        return True
    except Exception:  # noqa: BLE001 (an NVML error: unknown)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


@dataclass(frozen=True)
class Topology:
    """Where every rank lives.

    Attributes:
        num_ranks, rank: the group.
        num_scaleup_ranks: ranks per scale-up (NVLink) domain; `num_scaleout_ranks = num_ranks // num_scaleup_ranks`.
        scaleup_rank_idx, scaleout_rank_idx: this rank's position.
        physical_scaleup: the NVLink-reachable domain size before any override.
        device: this rank's CUDA device; pci_bus_ids: every rank's GPU (ranks sharing a GPU share the id).
        nccl_gpu_ids: every rank's GPU as NCCL tells GPUs apart, `'<NCCL host>/<PCI bus id>'` with the host
            `NCCL_HOSTID` or else the hostname: ranks that NCCL refuses in one communicator ("Duplicate GPU") have
            equal ids, so ranks sharing a GPU but naming different NCCL hosts can be joined by NCCL.
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
    nccl_gpu_ids: tuple = ()

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

    Every rank's GPU is identified by its PCI bus id, so ranks whose processes see different GPU sets
    (`CUDA_VISIBLE_DEVICES` per rank) still find each other. The physical scale-up domain is the ranks of one host when
    every pair of their GPUs can access each other (`cudaDeviceCanAccessPeer` on this process's ordinals of the peers'
    GPUs, found with `cudaDeviceGetByPCIBusId`; NVML's P2P status by PCI bus id for GPUs this process cannot see), or
    the same GPU; else 1. Hosts must hold equal, consecutive rank blocks. With `allow_hybrid_mode=False` the whole
    group is one logical domain (direct mode), which needs one host.

    Raises:
        RuntimeError: a scale-up domain of several ranks in which some rank cannot see a peer's GPU: CUDA IPC would
            fail, so this names CUDA_VISIBLE_DEVICES and the ways out, on every rank.
    """
    import cupy
    pci = cupy.cuda.runtime.deviceGetPCIBusId(device)
    infos = group.allgather_object((group.host_idx, pci, device, nccl_host()))
    pci_ids = tuple(i[1] for i in infos)
    nccl_ids = tuple(f'{i[3]}/{i[1]}' for i in infos)

    # Peer access from this process to every other GPU of its host
    host_ranks = [r for r in range(group.size) if infos[r][0] == group.host_idx]
    local_ok, hidden_peers = True, []
    for r in host_ranks:
        if pci_ids[r] == pci:
            continue
        ordinal = _local_ordinal(pci_ids[r])
        if ordinal is None:
            hidden_peers.append(r)
        elif not cupy.cuda.runtime.deviceCanAccessPeer(device, ordinal):
            local_ok = False
    if hidden_peers and _nvml_peer_access(pci, sorted({pci_ids[r] for r in hidden_peers})) is False:
        local_ok = False
    status = group.allgather_object((local_ok, hidden_peers, os.environ.get('CUDA_VISIBLE_DEVICES')))
    all_ok = all(s[0] for s in status)
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
    blind = [(r, [p for p in s[1] if p // scaleup == r // scaleup], s[2]) for r, s in enumerate(status)]
    blind = [b for b in blind if b[1]]
    if scaleup > 1 and blind:
        detail = '; '.join(f'rank {r} (CUDA_VISIBLE_DEVICES={v!r}) cannot see the GPU of rank(s) {p}'
                           for r, p, v in blind[:4])
        raise RuntimeError(
            f'deepep_cupy: {detail}{" ..." if len(blind) > 4 else ""}. The ranks of a scale-up (NVLink) domain map '
            f'each other\'s memory with CUDA IPC, which needs every GPU of the domain visible to every rank: give all '
            f'ranks of a host the same CUDA_VISIBLE_DEVICES (or leave it unset) and select each rank\'s GPU with '
            f'torch.cuda.set_device(local_rank) or DEEPEP_CUPY_DEVICE; or set DEEPEP_CUPY_SCALEUP_SIZE=1 to connect '
            f'the ranks over NCCL instead')
    if not allow_hybrid_mode:
        if scaleup != group.size:
            raise ValueError(f'allow_hybrid_mode=False (direct mode) needs every rank in one scale-up domain, but the '
                             f'domain holds {scaleup} of {group.size} ranks')
    if scaleup > NUM_MAX_SCALEUP_RANKS:
        raise ValueError(f'a scale-up domain holds at most {NUM_MAX_SCALEUP_RANKS} ranks, got {scaleup}')
    return Topology(num_ranks=group.size, rank=group.rank, num_scaleup_ranks=scaleup,
                    num_scaleout_ranks=group.size // scaleup, scaleup_rank_idx=group.rank % scaleup,
                    scaleout_rank_idx=group.rank // scaleup, physical_scaleup=physical, device=device,
                    pci_bus_ids=pci_ids, nccl_gpu_ids=nccl_ids)


def nccl_host() -> str:
    """The host NCCL takes this process for: `NCCL_HOSTID` when set (NCCL's own variable), else the hostname."""
    return os.environ.get('NCCL_HOSTID', '').strip() or socket.gethostname()


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
