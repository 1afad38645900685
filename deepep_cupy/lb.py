"""Load balancing with redundant experts (DeepEP V2.5): `LBMixin` for the buffer classes, and the launcher of
`kernels_cu/lb.cu`.

A redundancy mapping (int32 `[num_ranks, num_redundant]`, identical on every rank of the scale-up domain) says which
expert each redundant slot of each rank hosts: entry `[r, c]` is the domain-local expert id `owner * L + local_idx`,
or -1 for an empty slot. `lb_prefetch_weights` copies every hosted expert's weights from its owner into the slot
(owners push over NVLink); `lb_reduce_grads` adds every slot's gradient into its owner's expert gradient (owners pull
and add in FP32 in ascending (rank, slot) order: deterministic). The redundant pools live in the buffer's data region
(the load-balancing region), at the same offset on every rank; `lb_set_plan` lays them out from a `BufferAllocator`.
Every call is collective over the domain: each rank checks its arguments, then all ranks compare what they were given
(one host all-gather) and raise the same error before any kernel runs when something is wrong or inconsistent.
"""

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .allocator import BufferAllocator, Placeholder
from .jit.launch import PTR, KernelSpec, Param, load_kernels
from .runtime import interop
from .runtime.event import EventHandle, EventOverlap
from .validation import check_int

# Symmetric workspace bytes [CTRL_OFFSET, CTRL_OFFSET + CTRL_BYTES) belong to kernels_cu/lb.cu.
CTRL_OFFSET = 30720
CTRL_BYTES = 2048
THREADS = 512                       # kLBThreads
CHUNK_BYTES = 32 * 8 * 16           # kLBChunkVectors * 16: bytes of one expert a warp handles per work item
EXPERT_BYTES_ALIGNMENT = 32         # bytes per expert must be a multiple of this (get_num_tma_alignment())
NUM_MAX_MAPPING_ENTRIES = 4096      # num_ranks * num_redundant (the kernels keep the entry lists in shared memory)
NUM_MAX_LOCAL_EXPERTS = 1024
SM_READ_GBS, SM_WRITE_GBS = 180.0, 45.0
NUM_MAX_REDUCE_STAGES = 3           # 4 KiB shared-memory stages per warp of the gradient reduction (cp.async pipeline)
SHARED_MEM_OPTIN_BYTES = 232448     # dynamic shared memory a block may opt into on sm_90 / sm_100 (227 KiB)
DEFAULT_NVLINK_GBS = 450.0          # when nvidia-smi reports no NVLink


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


def shipped_specs() -> Dict[str, List[KernelSpec]]:
    """Family name → every `KernelSpec` of this module, for 1 to 8 ranks per domain."""
    from .constants import NUM_MAX_SCALEUP_RANKS
    return {'lb': [s for n in range(1, NUM_MAX_SCALEUP_RANKS + 1) for s in all_specs(n)]}


def theoretical_num_sms(nvlink_gbs: float, num_device_sms: Optional[int] = None) -> int:
    """DeepEP V2.5's SM count for load balancing: `align(ceil(max(nvlink / 180, nvlink / 45)), 2)` (SM read and
    write rates in GB/s), at least 2 and at most the device's SMs rounded down to even."""
    nvlink_gbs = float(nvlink_gbs) or DEFAULT_NVLINK_GBS
    sms = math.ceil(max(nvlink_gbs / SM_READ_GBS, nvlink_gbs / SM_WRITE_GBS))
    sms = max(2, (sms + 1) // 2 * 2)
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


def _to_host(x: Any) -> np.ndarray:
    """A numpy copy of a torch tensor or CuPy array (waits for the current stream)."""
    if interop.is_torch(x):
        return x.detach().cpu().numpy()
    return x.get()


def _grid(num_items: int, num_sms: int) -> int:
    """Blocks for `num_items` warp work items: at most `num_sms`, one block per 16 items below that."""
    return max(1, min(num_sms, (num_items + THREADS // 32 - 1) // (THREADS // 32)))


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
    """One kernel launch of a call: the kernel, its grid (blocks of `THREADS`), arguments and dynamic shared memory."""
    spec: KernelSpec
    grid: int
    args: Tuple
    shared_mem: int


def reduce_grads_shared_mem(num_ranks: int, num_redundant: int, num_local_experts: int,
                            max_shared_mem: int = SHARED_MEM_OPTIN_BYTES) -> Tuple[int, int, int]:
    """`(num_stages, stage_offset, bytes)` of the gradient reduction's dynamic shared memory: the entry lists
    (int32 [4 L + R C]), then as many 4 KiB stages per warp (1..3) as fit in `max_shared_mem`."""
    stage_offset = -(-4 * (4 * num_local_experts + num_ranks * num_redundant) // 128) * 128
    per_stage = (THREADS // 32) * CHUNK_BYTES
    num_stages = max(1, min(NUM_MAX_REDUCE_STAGES, (max_shared_mem - stage_offset) // per_stage))
    return num_stages, stage_offset, stage_offset + num_stages * per_stage


def launch_plan(call: LBCall, num_ranks: int, rank: int, peer_bases_ptr: int, error_record_ptr: int,
                timeout_ns: int, max_shared_mem: int = SHARED_MEM_OPTIN_BYTES) -> List[Launch]:
    """The launches of a checked call: one prefetch launch per tensor pair (the first exchanges the ready signals,
    the last the done signals), or one reduction launch. Grids shrink to the work (16 warp items per block)."""
    C, L = call.num_redundant, call.num_local_experts
    common = (peer_bases_ptr, rank, error_record_ptr, timeout_ns)
    num_owned, num_active = count_work(call.host_mapping, rank, L)
    out = []
    for k, pair in enumerate(call.pairs):
        num_chunks = -(-pair.num_bytes_per_expert // CHUNK_BYTES)
        if call.op == 'prefetch':
            out.append(Launch(prefetch_spec(num_ranks), _grid(num_owned * num_chunks, call.num_sms), (
                call.mapping, C, L, pair.src, pair.num_bytes_per_expert, pair.pool_offset, int(k == 0),
                int(k == len(call.pairs) - 1), *common), 4 * num_ranks * C))
        else:
            num_stages, stage_offset, shared_mem = reduce_grads_shared_mem(num_ranks, C, L, max_shared_mem)
            out.append(Launch(reduce_grads_spec(num_ranks), _grid(num_active * num_chunks, call.num_sms), (
                call.mapping, C, L, pair.src, pair.num_bytes_per_expert, pair.pool_offset, num_stages, stage_offset,
                *common), shared_mem))
    return out


def event_of(previous_event) -> Optional[EventHandle]:
    """The `EventHandle` of `previous_event` (an `EventHandle` or an `EventOverlap` holding one), or None."""
    if previous_event is None:
        return None
    event = previous_event.event if isinstance(previous_event, EventOverlap) else previous_event
    if not isinstance(event, EventHandle):
        raise TypeError(f'previous_event must be an EventHandle (buffer.capture()), got {type(event).__name__}')
    return event


class LBMixin:
    """Load balancing over the ranks of one scale-up domain (mixed into the buffer classes; `self` is a
    `BufferBase`). State lives in `_lb_*` attributes set by `lb_set_plan` or on first use."""

    # ---- region ----------------------------------------------------------------------------------------------------
    def lb_set_plan(self, plan_or_num_bytes):
        """Reserve the load-balancing region at the start of the data region (collective: every rank must pass an
        identical plan or size) and materialise a plan there.

        Args:
            plan_or_num_bytes: a `BufferAllocator` (its tensors become views of the region) or a byte count.

        Returns:
            the plan's tensors (see `BufferAllocator.materialize`), or for a byte count the region as a uint8 array
            (`lb_get_storage()`).
        """
        self.check_usable()
        if isinstance(plan_or_num_bytes, BufferAllocator):
            plan, num_bytes = plan_or_num_bytes, plan_or_num_bytes.num_bytes
            signature = plan.signature()
        else:
            plan, num_bytes = None, check_int('plan_or_num_bytes', plan_or_num_bytes)
            signature = num_bytes
        # Compare first: when the plans agree, the size check below fails on every rank or on none.
        self.group.check_same('the load-balancing plan', signature, timeout=self.num_cpu_timeout_secs)
        if num_bytes > self.num_bytes:
            raise ValueError(f'the load-balancing plan needs {num_bytes} bytes but the buffer has {self.num_bytes} '
                             f'(build it with num_bytes >= plan.num_bytes)')
        self.claim_data_region('load balancing')
        self._lb_num_bytes = num_bytes
        self._lb_kernels()              # compile now, never inside a timed or collective region
        self.lb_get_theoretical_num_sms()   # and read the NVLink bandwidth (nvidia-smi, cached) now
        if plan is None:
            return self.lb_get_storage()
        kind = 'cupy' if all(isinstance(a, Placeholder) for a in plan.placeholders) else 'torch'
        return plan.materialize(self.lb_get_storage(kind))

    def lb_get_storage(self, kind: str = 'cupy'):
        """The load-balancing region as a uint8 array (`kind` `'cupy'` or `'torch'`), a view of symmetric memory."""
        self._lb_region()
        view = self.sym.local_view(self.data_offset, self._lb_num_bytes)
        if kind == 'torch':
            return interop.to_torch(view)
        if kind != 'cupy':
            raise ValueError(f"kind must be 'cupy' or 'torch', got {kind!r}")
        return view

    def _lb_region(self) -> Tuple[int, int]:
        if getattr(self, '_lb_num_bytes', None) is None:
            self.claim_data_region('load balancing')
            self._lb_num_bytes = self.num_bytes
        return self.data_offset, self._lb_num_bytes

    def lb_get_theoretical_num_sms(self) -> int:
        """SMs that can drive NVLink for prefetch / reduction: `align(ceil(max(nvlink / 180, nvlink / 45)), 2)` with
        the NVLink GB/s of `deepep_cupy.utils.envs.get_nvlink_gbs()` (450 when it reports none)."""
        from .utils.envs import get_nvlink_gbs
        return theoretical_num_sms(get_nvlink_gbs(), self.num_device_sms)

    # ---- checks ----------------------------------------------------------------------------------------------------
    def _lb_tensor(self, x: Any, name: str, kind: Optional[str]) -> interop.TensorInfo:
        from .ep import checks
        info = checks.info(x, name, self.device)
        if kind is not None:
            checks.check_same_kind(kind, info, name)
        checks.check_contiguous(info, name)
        if info.ndim < 1:
            raise ValueError(f'{name} must have at least one dimension, got a scalar')
        if info.ptr % 16:
            raise ValueError(f'{name} must start at a 16-byte aligned address')
        return info

    def _lb_check_local(self, op: str, redundant, sources, mapping, num_sms: int, previous_event=None) -> LBCall:
        """This rank's argument checks (no collective); raises ValueError / TypeError naming the argument."""
        from .ep import checks
        event = event_of(previous_event)
        dst_name = 'redundant_expert_weights' if op == 'prefetch' else 'redundant_expert_grads'
        src_name = 'expert_weights' if op == 'prefetch' else 'expert_grads'
        if op == 'prefetch':
            dsts = list(redundant) if isinstance(redundant, (list, tuple)) else [redundant]
            srcs = list(sources) if isinstance(sources, (list, tuple)) else [sources]
            if not dsts:
                raise ValueError(f'{dst_name} must be a tensor or a non-empty sequence of tensors')
            if len(dsts) != len(srcs):
                raise ValueError(f'{dst_name} has {len(dsts)} tensors but {src_name} has {len(srcs)}')
        else:
            dsts, srcs = [redundant], [sources]
        check_int('num_sms', num_sms)
        mi = checks.info(mapping, 'redundancy_mapping', self.device)
        kind = mi.kind
        checks.check_dtype(mi, 'redundancy_mapping', 'int32')
        num_ranks = self.num_scaleup_ranks
        if mi.ndim != 2 or mi.shape[0] != num_ranks:
            raise ValueError(f'redundancy_mapping must be [num_nvlink_ranks={num_ranks}, num_redundant], got '
                             f'{list(mi.shape)}')
        checks.check_contiguous(mi, 'redundancy_mapping')
        num_redundant = mi.shape[1]
        if num_ranks * num_redundant > NUM_MAX_MAPPING_ENTRIES:
            raise ValueError(f'redundancy_mapping has {num_ranks} x {num_redundant} entries; at most '
                             f'{NUM_MAX_MAPPING_ENTRIES} are supported')

        region_offset, region_bytes = self._lb_region()
        base = self.sym.base
        pairs, num_local_experts = [], None
        for k, (dst, src) in enumerate(zip(dsts, srcs)):
            dn = dst_name if len(dsts) == 1 else f'{dst_name}[{k}]'
            sn = src_name if len(srcs) == 1 else f'{src_name}[{k}]'
            di, si = self._lb_tensor(dst, dn, kind), self._lb_tensor(src, sn, kind)
            if op == 'reduce':
                for info, name, rows in ((di, dn, num_redundant), (si, sn, None)):
                    checks.check_dtype(info, name, 'float32')
                    if info.ndim != 2:
                        raise ValueError(f'{name} must be 2-D [{"num_redundant" if rows else "L"}, hidden], got '
                                         f'{list(info.shape)}')
                if di.shape[1] != si.shape[1]:
                    raise ValueError(f'{dn} has hidden {di.shape[1]} but {sn} has {si.shape[1]}')
            elif di.dtype != si.dtype:
                raise TypeError(f'{dn} ({di.dtype}) and {sn} ({si.dtype}) must have the same dtype')
            if di.shape[0] != num_redundant:
                raise ValueError(f'{dn} must have num_redundant={num_redundant} rows (redundancy_mapping columns), '
                                 f'got {list(di.shape)}')
            L = si.shape[0]
            if L < 1 or L > NUM_MAX_LOCAL_EXPERTS:
                raise ValueError(f'{sn} must have between 1 and {NUM_MAX_LOCAL_EXPERTS} experts (dim 0), got {L}')
            if num_local_experts is not None and L != num_local_experts:
                raise ValueError(f'{sn} has {L} experts but {src_name}[0] has {num_local_experts}')
            num_local_experts = L
            num_bytes_per_expert = si.nbytes // L
            if num_redundant and di.nbytes // num_redundant != num_bytes_per_expert:
                raise ValueError(f'{dn} holds {di.nbytes // num_redundant} bytes per expert but {sn} holds '
                                 f'{num_bytes_per_expert}: they must be equal')
            if num_bytes_per_expert % EXPERT_BYTES_ALIGNMENT:
                raise ValueError(f'{sn}: bytes per expert ({num_bytes_per_expert}) must be a multiple of '
                                 f'{EXPERT_BYTES_ALIGNMENT}')
            offset = di.ptr - base
            if offset < region_offset or offset + di.nbytes > region_offset + region_bytes:
                raise ValueError(f'{dn} must lie in this buffer\'s load-balancing region (symmetric memory '
                                 f'[{region_offset}, {region_offset + region_bytes}) of the buffer); plan it with a '
                                 f'BufferAllocator passed to lb_set_plan')
            pairs.append(LBPair(si.obj, di.obj, offset, num_bytes_per_expert))

        host = np.ascontiguousarray(_to_host(mapping)).astype(np.int32, copy=False)
        check_mapping_values(host, num_local_experts)
        num_sms = min(num_sms or self.lb_get_theoretical_num_sms(), self.num_device_sms)
        return LBCall(op, kind, mapping, host, num_redundant, num_local_experts, tuple(pairs), num_sms, event)

    def _lb_check(self, op: str, redundant, sources, mapping, num_sms: int, previous_event=None) -> LBCall:
        """Local checks, then one all-gather: every rank raises the same error if any rank's arguments are bad or if
        the domain's ranks disagree on the operation, the mapping, the sizes or the pool offsets."""
        error, call, signature = None, None, None
        try:
            call = self._lb_check_local(op, redundant, sources, mapping, num_sms, previous_event)
            digest = hashlib.blake2b(call.host_mapping.tobytes(), digest_size=8).hexdigest()
            signature = (op, call.host_mapping.shape, digest, call.num_local_experts,
                         tuple((p.pool_offset, p.num_bytes_per_expert) for p in call.pairs))
        except (ValueError, TypeError) as e:
            error = e
        everyone = self.group.allgather_object((self.rank_idx, None if error is None else repr(error), signature),
                                               timeout=self.num_cpu_timeout_secs)
        domain = set(self.topology.scaleup_peers) if hasattr(self, 'topology') else set(range(len(everyone)))
        everyone = [v for v in everyone if v[0] in domain]
        if error is not None:
            raise error
        bad = [(r, e) for r, e, _ in everyone if e is not None]
        if bad:
            raise ValueError(f'lb_{op}: rank {bad[0][0]} rejected its arguments ({bad[0][1]}); every rank of the '
                             f'domain must pass valid, consistent arguments')
        groups: Dict[Any, List[int]] = {}
        for r, _, s in everyone:
            groups.setdefault(s, []).append(r)
        if len(groups) > 1:
            detail = '; '.join(f'ranks {ranks}: (op, mapping shape, mapping hash, L, [(pool offset, bytes per '
                               f'expert)]) = {s}' for s, ranks in groups.items())
            raise ValueError(f'lb_{op}: the ranks of the domain disagree on the operation, the redundancy_mapping or '
                             f'the tensor layout ({detail}); the mapping must be identical on every rank')
        return call

    # ---- launch ----------------------------------------------------------------------------------------------------
    def _lb_kernels(self):
        kernels = getattr(self, '_lb_loaded', None)
        if kernels is None:
            kernels = self._lb_loaded = load_kernels(all_specs(self.num_scaleup_ranks))
        return kernels

    def _lb_run(self, call: LBCall) -> EventOverlap:
        kernels = self._lb_kernels()
        comm = self.comm_stream
        if call.previous_event is not None:
            call.previous_event.stream_wait(comm)
        else:
            comm.wait_event(interop.current_stream(call.mapping).record())
        max_shared_mem = getattr(self, '_lb_max_shared_mem', None)
        if max_shared_mem is None:
            import cupy
            max_shared_mem = self._lb_max_shared_mem = int(
                cupy.cuda.Device(self.device).attributes['MaxSharedMemoryPerBlockOptin'])
        for launch in launch_plan(call, self.num_scaleup_ranks, self.sym.local_idx, self.sym.peer_bases_ptr,
                                  self.host_mapped.ptr, self.timeout_ns, max_shared_mem):
            kernels[launch.spec.name].launch(launch.grid, THREADS, launch.args, stream=comm,
                                             shared_mem=launch.shared_mem)
        local = [p.src for p in call.pairs] + [call.mapping]
        if call.kind == 'torch':
            s = interop.torch_stream(comm.ptr)
            for t in local:
                t.record_stream(s)
        return EventOverlap(EventHandle(comm), extra_tensors=tuple(local) + tuple(p.dst for p in call.pairs))

    # ---- API -------------------------------------------------------------------------------------------------------
    def lb_prefetch_weights(self, redundant_expert_weights, expert_weights, redundancy_mapping, num_sms: int = 0,
                            previous_event=None) -> EventOverlap:
        """Copy every hosted expert's weights from its owner into the redundant slots (collective over the domain).

        Args:
            redundant_expert_weights: `[num_redundant, *shape]` tensor, or a non-empty sequence of them (e.g. weights
                and scale factors), inside the load-balancing region (same offsets on every rank). Slots whose mapping
                entry is -1 are left untouched.
            expert_weights: `[L, *shape]` tensor(s) of this rank's experts (any CUDA memory, contiguous), one per
                redundant tensor, with the same dtype and bytes per expert (a multiple of 32).
            redundancy_mapping: `[num_nvlink_ranks, num_redundant]` int32, contiguous, on this GPU, identical on every
                rank: entry `[r, c]` = domain-local expert id (`owner * L + local_idx`) held in slot c of rank r, or
                -1; a rank never hosts its own experts.
            num_sms: SMs (blocks) of the copy (0: `lb_get_theoretical_num_sms()`).
            previous_event: an `EventHandle` the communication stream waits for instead of the current stream.

        Returns:
            `EventOverlap`; `wait()` makes the current stream wait until the weights are in place on this rank.
        """
        self.check_usable()
        call = self._lb_check('prefetch', redundant_expert_weights, expert_weights, redundancy_mapping, num_sms,
                              previous_event)
        return self._lb_run(call)

    def lb_reduce_grads(self, redundant_expert_grads, expert_grads, redundancy_mapping, num_sms: int = 0,
                        previous_event=None) -> EventOverlap:
        """Add every redundant copy's gradient into its owner's expert gradient, in place (collective over the domain).

        `expert_grads[j] += redundant_expert_grads@r[c]` for every slot (r, c) hosting local expert j, summed in
        FP32 in ascending (r, c) order (deterministic). The redundant gradients are only read (never cleared).

        Args:
            redundant_expert_grads: `[num_redundant, hidden]` float32 inside the load-balancing region (same offset
                on every rank); complete on every rank when it calls this.
            expert_grads: `[L, hidden]` float32, contiguous, anywhere on this GPU; `hidden * 4` a multiple of 32.
            redundancy_mapping: as in `lb_prefetch_weights`.
            num_sms: SMs (blocks) of the reduction (0: `lb_get_theoretical_num_sms()`).
            previous_event: an `EventHandle` the communication stream waits for instead of the current stream.

        Returns:
            `EventOverlap`; `wait()` makes the current stream wait for the reduced `expert_grads` (and for every peer
            to finish reading this rank's redundant gradients, so they may be overwritten afterwards).
        """
        self.check_usable()
        call = self._lb_check('reduce', redundant_expert_grads, expert_grads, redundancy_mapping, num_sms,
                              previous_event)
        return self._lb_run(call)
