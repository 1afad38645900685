"""Load balancing with redundant experts (DeepEP V2.5): the feature of a buffer. plan.py: the declarations, the
mapping's bookkeeping and (its docstring) what a redundancy mapping is and what each call does; `kernels_cu/lb.cu`:
the protocol."""

import hashlib
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...constants import NUM_MAX_LOCAL_EXPERTS
from ...jit.launch import load_kernels
from ...runtime import checks, interop
from ...runtime.checks import check_int
from ...runtime.event import EventOverlap, as_event_handle
from ...runtime.nvlink import get_nvlink_gbs
from .plan import (
    EXPERT_BYTES_ALIGNMENT,
    NUM_MAX_MAPPING_ENTRIES,
    THREADS,
    LBCall,
    LBPair,
    all_specs,
    check_mapping_values,
    launch_plan,
    theoretical_num_sms,
    to_host,
)

DATA_REGION_OWNER = 'load balancing'


def _tensor_lists(op: str, redundant, sources) -> Tuple[str, str, List[Any], List[Any]]:
    """`(the redundant tensors' argument name, the owners' one, the redundant tensors, the owners' tensors)` of a
    prefetch (a tensor or a non-empty sequence of each, as many of both) or a reduction (one tensor each)."""
    dst_name = 'redundant_expert_weights' if op == 'prefetch' else 'redundant_expert_grads'
    src_name = 'expert_weights' if op == 'prefetch' else 'expert_grads'
    if op != 'prefetch':
        return dst_name, src_name, [redundant], [sources]
    dsts = list(redundant) if isinstance(redundant, (list, tuple)) else [redundant]
    srcs = list(sources) if isinstance(sources, (list, tuple)) else [sources]
    if not dsts:
        raise ValueError(f'{dst_name} must be a tensor or a non-empty sequence of tensors')
    if len(dsts) != len(srcs):
        raise ValueError(f'{dst_name} has {len(dsts)} tensors but {src_name} has {len(srcs)}')
    return dst_name, src_name, dsts, srcs


def _check_pair_layout(op: str, di: interop.TensorInfo, si: interop.TensorInfo, dn: str, sn: str,
                       num_redundant: int) -> None:
    """A (redundant, owner's) pair of tensors `dn`, `sn` fits the operation: a reduction's are 2-D float32 of one
    hidden size, a prefetch's of one dtype; the redundant one has a row per redundant slot."""
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


class LB:
    """The load-balancing feature of one buffer: its region (V2.0: the start of the data region, its size set by
    `set_region` or on first use; V2.5 `EPBuffer`: a region of its own after the data region, fixed at construction),
    its kernels and the device's shared-memory limit.

    Args:
        buf: the buffer (a `BufferBase`).
        region: `(symmetric offset, bytes)` of a fixed region outside the data region, or None.
    """

    def __init__(self, buf, region: Optional[Tuple[int, int]] = None):
        if buf.num_scaleout_ranks > 1:
            raise NotImplementedError(
                f'load balancing over {buf.num_scaleout_ranks} scale-up domains is not implemented: redundant '
                f'experts are copied and reduced over NVLink inside one domain; build the buffer on one domain '
                f'(allow_hybrid_mode=False, or one node\'s ranks)')
        self._buf = buf
        self._region = region
        self.num_bytes: Optional[int] = None if region is None else region[1]
        self._kernels = None
        self._max_shared_mem: Optional[int] = None

    def destroy(self) -> None:
        self.num_bytes = None

    # ---- region ----------------------------------------------------------------------------------------------------
    def set_region(self, num_bytes: int, signature) -> None:
        """Reserve the load-balancing region `[0, num_bytes)` of the data region (collective: every rank passes the
        same `signature`, a plan's or the byte count)."""
        buf = self._buf
        if self._region is not None:
            raise RuntimeError('this buffer\'s load-balancing region was fixed at construction '
                               '(lb_allocation_plan_or_num_bytes)')
        # Compare first: when the plans agree, the size check below fails on every rank or on none.
        buf.group.check_same('the load-balancing plan', signature, timeout=buf.num_cpu_timeout_secs)
        if num_bytes > buf.num_bytes:
            raise ValueError(f'the load-balancing plan needs {num_bytes} bytes but the buffer has {buf.num_bytes} '
                             f'(build it with num_bytes >= plan.num_bytes)')
        buf.claim_data_region(DATA_REGION_OWNER)
        self.num_bytes = num_bytes
        self.kernels()                      # compile now, never inside a timed or collective region
        self.theoretical_num_sms()          # and read the NVLink bandwidth (nvidia-smi, cached) now

    def storage(self, kind: str = 'cupy'):
        """The load-balancing region as a uint8 array (`kind` `'cupy'` or `'torch'`), a view of symmetric memory."""
        offset, num_bytes = self.region()
        view = self._buf.sym.local_view(offset, num_bytes)
        if kind == 'torch':
            return interop.to_torch(view)
        if kind != 'cupy':
            raise ValueError(f"kind must be 'cupy' or 'torch', got {kind!r}")
        return view

    def region(self) -> Tuple[int, int]:
        """`(offset, bytes)` of the load-balancing region (the whole data region unless `set_region` said less, or the
        fixed region)."""
        if self._region is not None:
            return self._region
        buf = self._buf
        if self.num_bytes is None:
            buf.claim_data_region(DATA_REGION_OWNER)
            self.num_bytes = buf.num_bytes
        return buf.data_offset, self.num_bytes

    def theoretical_num_sms(self) -> int:
        """SMs that can drive NVLink for prefetch / reduction: `align(ceil(max(nvlink / 180, nvlink / 45)), 2)` with
        the NVLink GB/s of `deepep_cupy.utils.envs.get_nvlink_gbs()` (450 when it reports none)."""
        return theoretical_num_sms(get_nvlink_gbs(), self._buf.num_device_sms)

    # ---- checks ----------------------------------------------------------------------------------------------------
    def _tensor(self, x: Any, name: str, kind: Optional[str]) -> interop.TensorInfo:
        info = checks.info(x, name, self._buf.device)
        if kind is not None:
            checks.check_same_kind(kind, info, name)
        checks.check_contiguous(info, name)
        if info.ndim < 1:
            raise ValueError(f'{name} must have at least one dimension, got a scalar')
        if info.ptr % 16:
            raise ValueError(f'{name} must start at a 16-byte aligned address')
        return info

    def _check_local(self, op: str, redundant, sources, mapping, num_sms: int, previous_event=None) -> LBCall:
        """This rank's argument checks (no collective); raises ValueError / TypeError naming the argument."""
        buf = self._buf
        event = as_event_handle(previous_event)
        dst_name, src_name, dsts, srcs = _tensor_lists(op, redundant, sources)
        check_int('num_sms', num_sms)
        kind, num_redundant = self._check_mapping(mapping)
        region = self.region()
        pairs, num_local_experts = [], None
        for k, (dst, src) in enumerate(zip(dsts, srcs)):
            dn = dst_name if len(dsts) == 1 else f'{dst_name}[{k}]'
            sn = src_name if len(srcs) == 1 else f'{src_name}[{k}]'
            di, si = self._tensor(dst, dn, kind), self._tensor(src, sn, kind)
            _check_pair_layout(op, di, si, dn, sn, num_redundant)
            L = si.shape[0]
            if L < 1 or L > NUM_MAX_LOCAL_EXPERTS:
                raise ValueError(f'{sn} must have between 1 and {NUM_MAX_LOCAL_EXPERTS} experts (dim 0), got {L}')
            if num_local_experts is not None and L != num_local_experts:
                raise ValueError(f'{sn} has {L} experts but {src_name}[0] has {num_local_experts}')
            num_local_experts = L
            pairs.append(self._pool_pair(di, si, dn, sn, L, num_redundant, region))
        host = np.ascontiguousarray(to_host(mapping)).astype(np.int32, copy=False)
        check_mapping_values(host, num_local_experts)
        num_sms = min(num_sms or self.theoretical_num_sms(), buf.num_device_sms)
        return LBCall(op, kind, mapping, host, num_redundant, num_local_experts, tuple(pairs), num_sms, event)

    def _check_mapping(self, mapping) -> Tuple[str, int]:
        """The redundancy mapping's layout (its values are checked once on the host, `check_mapping_values`); returns
        `(its array kind, num_redundant)`."""
        num_ranks = self._buf.num_scaleup_ranks
        mi = checks.info(mapping, 'redundancy_mapping', self._buf.device)
        checks.check_dtype(mi, 'redundancy_mapping', 'int32')
        if mi.ndim != 2 or mi.shape[0] != num_ranks:
            raise ValueError(f'redundancy_mapping must be [num_nvlink_ranks={num_ranks}, num_redundant], got '
                             f'{list(mi.shape)}')
        checks.check_contiguous(mi, 'redundancy_mapping')
        num_redundant = mi.shape[1]
        if num_ranks * num_redundant > NUM_MAX_MAPPING_ENTRIES:
            raise ValueError(f'redundancy_mapping has {num_ranks} x {num_redundant} entries; at most '
                             f'{NUM_MAX_MAPPING_ENTRIES} are supported')
        return mi.kind, num_redundant

    def _pool_pair(self, di: interop.TensorInfo, si: interop.TensorInfo, dn: str, sn: str, num_local_experts: int,
                   num_redundant: int, region: Tuple[int, int]) -> LBPair:
        """A (redundant pool, owner's experts) pair of `num_local_experts` experts: the same bytes per expert (a
        multiple of `EXPERT_BYTES_ALIGNMENT`), the pool inside the load-balancing region `region` (offset, bytes)."""
        region_offset, region_bytes = region
        num_bytes_per_expert = si.nbytes // num_local_experts
        if num_redundant and di.nbytes // num_redundant != num_bytes_per_expert:
            raise ValueError(f'{dn} holds {di.nbytes // num_redundant} bytes per expert but {sn} holds '
                             f'{num_bytes_per_expert}: they must be equal')
        if num_bytes_per_expert % EXPERT_BYTES_ALIGNMENT:
            raise ValueError(f'{sn}: bytes per expert ({num_bytes_per_expert}) must be a multiple of '
                             f'{EXPERT_BYTES_ALIGNMENT}')
        offset = di.ptr - self._buf.sym.base
        if offset < region_offset or offset + di.nbytes > region_offset + region_bytes:
            raise ValueError(f'{dn} must lie in this buffer\'s load-balancing region (symmetric memory '
                             f'[{region_offset}, {region_offset + region_bytes}) of the buffer); plan it with a '
                             f'BufferAllocator passed to lb_set_plan')
        return LBPair(si.obj, di.obj, offset, num_bytes_per_expert)

    def check(self, op: str, redundant, sources, mapping, num_sms: int, previous_event=None) -> LBCall:
        """Local checks, then one all-gather: every rank raises the same error if any rank's arguments are bad or if
        the domain's ranks disagree on the operation, the mapping, the sizes or the pool offsets."""
        buf = self._buf
        error, call, signature = None, None, None
        try:
            call = self._check_local(op, redundant, sources, mapping, num_sms, previous_event)
            digest = hashlib.blake2b(call.host_mapping.tobytes(), digest_size=8).hexdigest()
            signature = (op, call.host_mapping.shape, digest, call.num_local_experts,
                         tuple((p.pool_offset, p.num_bytes_per_expert) for p in call.pairs))
        except (ValueError, TypeError) as e:
            error = e
        everyone = buf.group.allgather_object((buf.rank_idx, None if error is None else repr(error), signature),
                                              timeout=buf.num_cpu_timeout_secs)
        domain = set(buf.topology.scaleup_peers)
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
    def kernels(self):
        if self._kernels is None:
            self._kernels = load_kernels(all_specs(self._buf.num_scaleup_ranks))
        return self._kernels

    def run(self, call: LBCall) -> EventOverlap:
        """Launch a checked call on the communication stream; the returned event keeps its tensors alive."""
        buf = self._buf
        kernels = self.kernels()
        comm = buf.stream_order.begin(interop.current_stream(call.mapping), call.previous_event)
        if self._max_shared_mem is None:
            import cupy
            self._max_shared_mem = int(cupy.cuda.Device(buf.device).attributes['MaxSharedMemoryPerBlockOptin'])
        for launch in launch_plan(call, buf.num_scaleup_ranks, buf.sym.local_idx, buf.sym.peer_bases_ptr,
                                  buf.host_mapped.ptr, buf.timeout_ns, self._max_shared_mem):
            kernels[launch.spec.name].launch(launch.grid, THREADS, stream=comm, shared_mem=launch.shared_mem,
                                             **launch.args)
        local = [p.src for p in call.pairs] + [call.mapping]
        return buf.stream_order.event(call.kind, local, tuple(local) + tuple(p.dst for p in call.pairs))

    # ---- API -------------------------------------------------------------------------------------------------------
    def prefetch_weights(self, redundant_expert_weights, expert_weights, redundancy_mapping, num_sms: int = 0,
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
        self._buf.check_usable()
        call = self.check('prefetch', redundant_expert_weights, expert_weights, redundancy_mapping, num_sms,
                          previous_event)
        return self.run(call)

    def reduce_grads(self, redundant_expert_grads, expert_grads, redundancy_mapping, num_sms: int = 0,
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
        self._buf.check_usable()
        call = self.check('reduce', redundant_expert_grads, expert_grads, redundancy_mapping, num_sms,
                          previous_event)
        return self.run(call)
