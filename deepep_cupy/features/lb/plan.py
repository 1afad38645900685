"""Load balancing with redundant experts (DeepEP V2.5), the plain-Python part: kernel declarations, the SM count, the
redundancy mapping's checks and bookkeeping, and the launches of a checked call (the launch path is feature.py; the
kernels are `kernels_cu/lb.cu`).

A redundancy mapping (int32 `[num_ranks, num_redundant]`, identical on every rank of the scale-up domain) says which
expert each redundant slot of each rank hosts: entry `[r, c]` is the domain-local expert id `owner * L + local_idx`,
or -1 for an empty slot. `lb_prefetch_weights` copies every hosted expert's weights from its owner into the slot
(owners push over NVLink); `lb_reduce_grads` adds every slot's gradient into its owner's expert gradient (owners pull
and add in FP32 in ascending (rank, slot) order: deterministic). The redundant pools live in the buffer's data region
(the load-balancing region), at the same offset on every rank; `lb_set_plan` lays them out from a `BufferAllocator`.
Every call is collective over the domain: each rank checks its arguments, then all ranks compare what they were given
(one host all-gather) and raise the same error before any kernel runs when something is wrong or inconsistent.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...constants import DEFAULT_NVLINK_GBS, NUM_MAX_SCALEUP_RANKS
from ...jit.launch import PTR, KernelSpec, Param
from ...runtime import interop, workspace
from ...runtime.event import EventHandle
from ...runtime.sizes import align, ceil_div

# Symmetric workspace bytes [CTRL_OFFSET, CTRL_OFFSET + CTRL_BYTES) belong to kernels_cu/lb.cu.
CTRL_OFFSET, CTRL_BYTES = workspace.LB
THREADS = 512                       # kLBThreads
CHUNK_BYTES = 32 * 8 * 16           # kLBChunkVectors * 16: bytes of one expert a warp handles per work item
EXPERT_BYTES_ALIGNMENT = 32         # bytes per expert must be a multiple of this (get_num_tma_alignment())
NUM_MAX_MAPPING_ENTRIES = 4096      # num_ranks * num_redundant (the kernels keep the entry lists in shared memory)
SM_READ_GBS, SM_WRITE_GBS = 180.0, 45.0
NUM_MAX_REDUCE_STAGES = 3           # 4 KiB shared-memory stages per warp of the gradient reduction (cp.async pipeline)
SHARED_MEM_OPTIN_BYTES = 232448     # dynamic shared memory a block may opt into on sm_90 / sm_100 (227 KiB)


def prefetch_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('lb', f'deepep::lb_prefetch_kernel<{num_ranks}>', (
        Param('mapping', PTR), Param('num_redundant', np.int32), Param('num_local_experts', np.int32),
        Param('expert_weights', PTR), Param('num_bytes_per_expert', np.int64), Param('pool_offset', np.uint64),
        Param('signal_ready', np.int32), Param('signal_done', np.int32), Param('peer_bases', PTR),
        Param('rank', np.int32), Param('error_record', PTR), Param('timeout_ns', np.uint64)))


def reduce_grads_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('lb', f'deepep::lb_reduce_grads_kernel<{num_ranks}>', (
        Param('mapping', PTR), Param('num_redundant', np.int32), Param('num_local_experts', np.int32),
        Param('expert_grads', PTR), Param('num_bytes_per_expert', np.int64), Param('pool_offset', np.uint64),
        Param('num_stages', np.int32), Param('stage_offset', np.int32), Param('peer_bases', PTR),
        Param('rank', np.int32), Param('error_record', PTR), Param('timeout_ns', np.uint64)))


def all_specs(num_ranks: int) -> List[KernelSpec]:
    """Every specialisation a buffer of `num_ranks` scale-up ranks may request."""
    return [prefetch_spec(num_ranks), reduce_grads_spec(num_ranks)]


def shipped_specs(max_ranks: int = NUM_MAX_SCALEUP_RANKS) -> Dict[str, List[KernelSpec]]:
    """Family name → every `KernelSpec` of this module, for 1 to `max_ranks` ranks per domain."""
    return {'lb': [s for n in range(1, max_ranks + 1) for s in all_specs(n)]}


def theoretical_num_sms(nvlink_gbs: float, num_device_sms: Optional[int] = None) -> int:
    """DeepEP V2.5's SM count for load balancing: `align(ceil(max(nvlink / 180, nvlink / 45)), 2)` (SM read and
    write rates in GB/s), at least 2 and at most the device's SMs rounded down to even."""
    nvlink_gbs = float(nvlink_gbs) or DEFAULT_NVLINK_GBS
    sms = math.ceil(max(nvlink_gbs / SM_READ_GBS, nvlink_gbs / SM_WRITE_GBS))
    sms = max(2, align(sms, 2))
    if num_device_sms:
        sms = min(sms, max(1, num_device_sms // 2 * 2))
    return sms


# ---- the redundancy mapping on the host ---------------------------------------------------------------------------

def check_mapping_values(mapping: np.ndarray, num_local_experts: int) -> None:
    """Raise `ValueError` naming the first bad entry: ids outside `[-1, num_ranks * L)`, or a rank hosting one of
    its own experts.

    Args:
        mapping: `[num_ranks, num_redundant]` integers (host copy).
        num_local_experts: L, experts per rank.
    """
    num_ranks = mapping.shape[0]
    num_experts = num_ranks * num_local_experts
    bad = (mapping < -1) | (mapping >= num_experts)
    if bad.any():
        r, c = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f'redundancy_mapping[{r}, {c}] = {int(mapping[r, c])}: entries must be -1 or a domain-local '
                         f'expert id in [0, {num_experts}) ({num_ranks} ranks x {num_local_experts} local experts)')
    own = (mapping >= 0) & (mapping // num_local_experts == np.arange(num_ranks)[:, None])
    if own.any():
        r, c = (int(v) for v in np.argwhere(own)[0])
        raise ValueError(f'redundancy_mapping[{r}, {c}] = {int(mapping[r, c])} is an expert of rank {r} itself: a rank '
                         f'never hosts a redundant copy of its own experts')


def _owned_mask(mapping: np.ndarray, rank: int, num_local_experts: int) -> np.ndarray:
    return (mapping >= 0) & (mapping // num_local_experts == rank)


def owned_entries(mapping: np.ndarray, rank: int, num_local_experts: int) -> List[Tuple[int, int, int]]:
    """`(rank r, slot c, local expert)` of every slot that hosts one of `rank`'s experts, in ascending (r, c) order:
    what the prefetch kernel pushes, and (grouped by expert) what the reduction pulls."""
    rs, cs = np.nonzero(_owned_mask(mapping, rank, num_local_experts))
    return list(zip(rs.tolist(), cs.tolist(), (mapping[rs, cs] % num_local_experts).tolist()))


def copies_per_expert(mapping: np.ndarray, rank: int, num_local_experts: int) -> Dict[int, List[Tuple[int, int]]]:
    """Local expert → its copies `(rank, slot)` in ascending order: the FP32 addition order of `lb_reduce_grads`."""
    out: Dict[int, List[Tuple[int, int]]] = {}
    for r, c, j in owned_entries(mapping, rank, num_local_experts):
        out.setdefault(j, []).append((r, c))
    return out


def count_work(mapping: np.ndarray, rank: int, num_local_experts: int) -> Tuple[int, int]:
    """`(slots hosting this rank's experts, distinct local experts among them)`: the work items of the prefetch and
    of the reduction, per chunk."""
    mask = _owned_mask(mapping, rank, num_local_experts)
    return int(mask.sum()), int(np.unique(mapping[mask] % num_local_experts).size)


def send_bytes_per_peer(mapping: np.ndarray, rank: int, num_local_experts: int, num_bytes_per_expert: int,
                        op: str) -> List[int]:
    """Bytes that cross from `rank` to each peer: `'prefetch'` pushes this rank's experts to the slots hosting them,
    `'reduce'` sends (as the pulls of the owners) this rank's slots to their owners. The peer-copy floor moves these."""
    num_ranks = mapping.shape[0]
    if op == 'prefetch':
        peers = np.nonzero(_owned_mask(mapping, rank, num_local_experts))[0]
    elif op == 'reduce':
        row = mapping[rank]
        peers = row[row >= 0] // num_local_experts
    else:
        raise ValueError(f"op must be 'prefetch' or 'reduce', got {op!r}")
    return [int(v) * num_bytes_per_expert for v in np.bincount(peers, minlength=num_ranks)]


def to_host(x: Any) -> np.ndarray:
    """A numpy copy of a torch tensor or CuPy array (waits for the current stream)."""
    if interop.is_torch(x):
        return x.detach().cpu().numpy()
    return x.get()


def _grid(num_items: int, num_sms: int) -> int:
    """Blocks for `num_items` warp work items: at most `num_sms`, one block per 16 items below that."""
    return max(1, min(num_sms, ceil_div(num_items, THREADS // 32)))


@dataclass(frozen=True)
class LBPair:
    """One (redundant pool, source) pair of a call: `src` is the local tensor, the pool sits at `pool_offset` of every
    rank's symmetric buffer."""
    src: Any
    dst: Any
    pool_offset: int
    num_bytes_per_expert: int


@dataclass(frozen=True)
class LBCall:
    """A checked load-balancing call: what the launch needs."""
    op: str
    kind: str
    mapping: Any                      # the device tensor the kernels read
    host_mapping: np.ndarray          # int32 [num_ranks, num_redundant]
    num_redundant: int
    num_local_experts: int
    pairs: Tuple[LBPair, ...]
    num_sms: int
    previous_event: Optional[EventHandle] = None


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a call: the kernel, its grid (blocks of `THREADS`), arguments by name and dynamic shared
    memory."""
    spec: KernelSpec
    grid: int
    args: Dict[str, Any]
    shared_mem: int


def reduce_grads_shared_mem(num_ranks: int, num_redundant: int, num_local_experts: int,
                            max_shared_mem: int = SHARED_MEM_OPTIN_BYTES) -> Tuple[int, int, int]:
    """`(num_stages, stage_offset, bytes)` of the gradient reduction's dynamic shared memory: the entry lists
    (int32 [4 L + R C]), then as many 4 KiB stages per warp (1..3) as fit in `max_shared_mem`."""
    stage_offset = align(4 * (4 * num_local_experts + num_ranks * num_redundant), 128)
    per_stage = (THREADS // 32) * CHUNK_BYTES
    num_stages = max(1, min(NUM_MAX_REDUCE_STAGES, (max_shared_mem - stage_offset) // per_stage))
    return num_stages, stage_offset, stage_offset + num_stages * per_stage


def launch_plan(call: LBCall, num_ranks: int, rank: int, peer_bases_ptr: int, error_record_ptr: int,
                timeout_ns: int, max_shared_mem: int = SHARED_MEM_OPTIN_BYTES) -> List[Launch]:
    """The launches of a checked call: one prefetch launch per tensor pair (the first exchanges the ready signals,
    the last the done signals), or one reduction launch. Grids shrink to the work (16 warp items per block)."""
    C, L = call.num_redundant, call.num_local_experts
    common = {'peer_bases': peer_bases_ptr, 'rank': rank, 'error_record': error_record_ptr, 'timeout_ns': timeout_ns}
    num_owned, num_active = count_work(call.host_mapping, rank, L)
    out = []
    for k, pair in enumerate(call.pairs):
        num_chunks = ceil_div(pair.num_bytes_per_expert, CHUNK_BYTES)
        args = {'mapping': call.mapping, 'num_redundant': C, 'num_local_experts': L,
                'num_bytes_per_expert': pair.num_bytes_per_expert, 'pool_offset': pair.pool_offset, **common}
        if call.op == 'prefetch':
            out.append(Launch(prefetch_spec(num_ranks), _grid(num_owned * num_chunks, call.num_sms), {
                **args, 'expert_weights': pair.src, 'signal_ready': int(k == 0),
                'signal_done': int(k == len(call.pairs) - 1)}, 4 * num_ranks * C))
        else:
            num_stages, stage_offset, shared_mem = reduce_grads_shared_mem(num_ranks, C, L, max_shared_mem)
            out.append(Launch(reduce_grads_spec(num_ranks), _grid(num_active * num_chunks, call.num_sms), {
                **args, 'expert_grads': pair.src, 'num_stages': num_stages, 'stage_offset': stage_offset},
                shared_mem))
    return out
