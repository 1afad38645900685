"""`EPBuffer`: DeepEP V2.5's EP buffer (`deep_ep.buffers.ep`): MoE dispatch / combine and load balancing with
redundant experts on one buffer.

Symmetric memory of one rank: `[workspace | EP region: num_bytes | LB region: the plan's bytes]`. The EP feature
(`features/ep`) lays out its slots in the EP region exactly as for `ElasticBuffer`; the load-balancing feature
(`features/lb`) owns the LB region, where the `BufferAllocator` plan passed as `lb_allocation_plan_or_num_bytes` is
materialised at construction (every rank passes the same plan, so a pool sits at the same offset everywhere).
V2.5's `defer_epilogue` is built here on the EP feature's events: the dispatch / combine runs as an asynchronous one
and the returned `EventOverlap` hands out the outputs from `wait()` / `current_stream_wait()`.
"""

import weakref
from typing import Optional, Union

from ..constants import DEFAULT_NVLINK_GBS, NUM_MAX_TOPK
from ..features.ep import layout as ep_layout
from ..features.ep import plan as ep_plan
from ..features.ep.feature import EP
from ..features.ep.handle import EPHandle
from ..features.hybrid.feature import HybridEP
from ..features.lb.feature import LB
from ..runtime.checks import check_int
from ..runtime.group import get_group
from ..runtime.group_size import group_size
from ..runtime.nvlink import get_nvlink_gbs
from ..runtime.sizes import align
from . import hybrid
from .allocator import BufferAllocator, Placeholder
from .base import BUFFER_ALIGNMENT, BufferBase, V25Methods

__all__ = ['EPBuffer', 'EPHandle']


class EPBuffer(V25Methods, hybrid.RailHooks, BufferBase):
    """Buffer for MoE dispatch / combine over the ranks of one scale-up (NVLink) domain, plus the load-balancing
    region of redundant experts (DeepEP V2.5).

    Args:
        group: torch.distributed ProcessGroup (or a deepep_cupy `ProcessGroup`); `comm`: an mpi4py communicator.
        num_bytes: bytes of the EP region (a multiple of 2 MiB, without workspace and LB region); default
            `get_buffer_size_hint(...)` of the MoE settings below.
        num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch: the MoE settings sizing the EP region
            (`num_topk=0`: size for up to 32).
        lb_allocation_plan_or_num_bytes: the LB region: a `BufferAllocator` plan (materialised into it here: its
            placeholders become views of this rank's region) or a byte count (a multiple of 2 MiB; 0: none). Every
            rank of the domain passes the same plan.
        deterministic: accepted; dispatch is always deterministic here (rows ordered by source rank, then token).
        allow_hybrid_mode: NVLink inside a scale-up domain and rails between domains (several domains: the composed
            hybrid path of `ElasticBuffer`, features/hybrid; needs num_max_tokens_per_rank and hidden).
        allow_multiple_reduction, prefer_overlap_with_compute: as `ElasticBuffer`'s.
        sl_idx: RDMA service level; accepted (no RDMA traffic inside one NVLink domain).
        num_allocated_qps: queue-pair budget (0: 129 with `allow_hybrid_mode`, else 17); caps
            `get_theoretical_num_qps`.
        num_cpu_timeout_secs, num_gpu_timeout_secs: bounds on host and GPU waits.
        explicitly_destroy: memory is released by `destroy()` (collective); else when the buffer is garbage-collected.
    """

    def __init__(self, group=None, num_bytes: Optional[int] = None, num_max_tokens_per_rank: int = 0, hidden: int = 0,
                 num_topk: int = 0, use_fp8_dispatch: bool = False,
                 lb_allocation_plan_or_num_bytes: Union[BufferAllocator, int] = 0, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: Optional[int] = None, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: float = 300, num_gpu_timeout_secs: float = 100,
                 explicitly_destroy: bool = False, *, comm=None, device: Optional[int] = None):
        for name, value in (('num_max_tokens_per_rank', num_max_tokens_per_rank), ('hidden', hidden),
                            ('num_topk', num_topk), ('num_allocated_qps', num_allocated_qps)):
            check_int(name, value)
        if num_topk > NUM_MAX_TOPK:
            raise ValueError(f'num_topk must be <= {NUM_MAX_TOPK}, got {num_topk}')
        plan = lb_allocation_plan_or_num_bytes if isinstance(lb_allocation_plan_or_num_bytes, BufferAllocator) \
            else None
        if plan is not None and plan.materialized:
            raise ValueError('lb_allocation_plan_or_num_bytes: this plan was already materialised')
        num_lb_bytes = plan.num_bytes if plan is not None else check_int('lb_allocation_plan_or_num_bytes',
                                                                          lb_allocation_plan_or_num_bytes)
        if num_lb_bytes % BUFFER_ALIGNMENT:
            raise ValueError(f'lb_allocation_plan_or_num_bytes must be a multiple of {BUFFER_ALIGNMENT} (2 MiB), got '
                             f'{num_lb_bytes}')
        pg = get_group(group, comm, timeout=num_cpu_timeout_secs)
        if num_bytes is None:
            num_bytes = hybrid.derived_num_bytes(self.get_buffer_size_hint, pg, device, num_max_tokens_per_rank,
                                                 hidden, num_topk, use_fp8_dispatch, allow_hybrid_mode,
                                                 allow_multiple_reduction)
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = num_max_tokens_per_rank, hidden, num_topk
        self.use_fp8_dispatch = bool(use_fp8_dispatch)
        self.deterministic = bool(deterministic)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.sl_idx = sl_idx
        self.num_lb_bytes = num_lb_bytes
        self.nccl_comm_handle = None
        self._ep: Optional[EP] = None
        self._lb: Optional[LB] = None
        super().__init__(group=pg, num_bytes=num_bytes, num_extra_bytes=num_lb_bytes,
                         allow_hybrid_mode=allow_hybrid_mode, num_cpu_timeout_secs=num_cpu_timeout_secs,
                         num_gpu_timeout_secs=num_gpu_timeout_secs, explicitly_destroy=explicitly_destroy,
                         device=device, config={'num_max_tokens_per_rank': num_max_tokens_per_rank, 'hidden': hidden,
                                                'num_topk': num_topk, 'lb_plan': None if plan is None else
                                                plan.signature(), 'allow_multiple_reduction':
                                                self.allow_multiple_reduction})
        try:
            self.num_rdma_ranks, self.num_nvlink_ranks = self.num_scaleout_ranks, self.num_scaleup_ranks
            self.num_allocated_qps = num_allocated_qps or (ep_plan.HYBRID_QPS if allow_hybrid_mode
                                                           else ep_plan.DIRECT_QPS)
            # Read the NVLink bandwidth now (nvidia-smi, once per process), never inside a timed or captured call.
            self._nvlink_gbs = get_nvlink_gbs() or DEFAULT_NVLINK_GBS
            self._lb_region = (self.extra_offset, num_lb_bytes)
            if num_lb_bytes or plan is not None:
                # Load balancing asked for (several domains: LB raises NotImplementedError naming the limit)
                self._lb_feature().kernels()        # compile now, never inside a timed or collective region
                self._lb.theoretical_num_sms()
            if plan is not None:
                kind = 'cupy' if all(isinstance(p, Placeholder) for p in plan.placeholders) else 'torch'
                plan.materialize(self._lb.storage(kind))
            if (num_max_tokens_per_rank and hidden) or num_topk or self.num_scaleout_ranks > 1:
                self._ep_feature()                  # lays out the EP region and compiles the kernels now (hybrid:
                #                                     the rails too, collectively)
        except BaseException:
            self.destroy()
            raise

    def _ep_feature(self) -> EP:
        if self._ep is None and self.num_scaleout_ranks > 1:
            self._ep = hybrid.make_hybrid_ep(self)      # several scale-up domains: the composed hybrid path
        if self._ep is None:
            self._ep = EP(weakref.proxy(self), self.num_max_tokens_per_rank, self.hidden, self.num_topk,
                          self.allow_multiple_reduction, self.prefer_overlap_with_compute, self._nvlink_gbs)
        return self._ep

    def _lb_feature(self) -> LB:
        if self._lb is None:
            self._lb = LB(weakref.proxy(self), region=self._lb_region)
        return self._lb

    def _destroy_features(self) -> None:
        for feature in (self._ep, self._lb):
            if feature is not None:
                feature.destroy()
        self._hybrid = self._ep if isinstance(self._ep, HybridEP) else None
        self._ep = self._lb = None

    # ---- sizes and SM / QP policy ------------------------------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes of the EP region (2 MiB aligned) for these MoE settings; `group` only gives the number of ranks."""
        return ep_layout.buffer_size_hint(group_size(group), num_max_tokens_per_rank, hidden, num_topk,
                                          allow_multiple_reduction)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 0,
                                sm_write_gbs: float = 0) -> int:
        """SMs of the dispatch / combine send kernels (deepep_cupy's model of its kernels, as `ElasticBuffer`'s:
        balanced routing, NVLink-bound; 0 for a bandwidth: detected or default)."""
        if num_scaleout_topk:
            raise ValueError('num_scaleout_topk is reserved (DeepEP supports 0 only)')
        del rdma_gbs
        return ep_plan.theoretical_num_sms(self.num_ranks, num_experts, num_topk, nvlink_gbs or self._nvlink_gbs,
                                           self.num_device_sms, self.prefer_overlap_with_compute,
                                           sm_read_gbs or 200, sm_write_gbs or 50)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP V2.5's queue pairs for `num_sms` SMs: `num_sms * 16 + 1` with `allow_hybrid_mode`, else
        `min(num_sms, 9)`, at most `num_allocated_qps` (accepted: NVLink traffic needs no QPs)."""
        return ep_plan.theoretical_num_qps(num_sms, self.allow_hybrid_mode, self.num_allocated_qps)

    def _check_qps(self, num_qps: int) -> None:
        check_int('num_qps', num_qps)
        if num_qps > self.num_allocated_qps:
            raise ValueError(f'num_qps={num_qps} exceeds num_allocated_qps={self.num_allocated_qps} (allocated QPs are '
                             f'not enough)')

    def _check_call_options(self, num_sms: int, num_qps: int, async_with_compute_stream: bool,
                            defer_epilogue: bool) -> int:
        """V2.5's checks of a dispatch / combine's options (`defer_epilogue` only asynchronously, `num_qps` within the
        allocated QPs); returns `num_sms`, an explicit one rounded up to even."""
        if defer_epilogue and not async_with_compute_stream:
            raise ValueError('defer_epilogue=True needs async_with_compute_stream=True')
        if num_sms:
            num_sms = align(check_int('num_sms', num_sms), 2)
        if num_qps:
            self._check_qps(num_qps)
        return num_sms

    # ---- dispatch / combine ------------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0, previous_event=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = False, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False,
                 defer_epilogue: bool = False):
        """Send each token to every rank owning one of its experts (`ElasticBuffer.dispatch`, with V2.5's changes).

        V2.5: the handle keeps `topk_idx` itself (`handle.topk_idx is topk_idx`; do not modify it while the handle is
        in use), `do_handle_copy` must be False; an explicit `num_sms` is rounded up to even;
        `previous_event_before_epilogue` is gone; `defer_epilogue=True` (needs `async_with_compute_stream=True`)
        returns only the `EventOverlap`, whose `wait()` / `current_stream_wait()` makes the current stream wait and
        returns `(recv_x, recv_topk_idx, recv_topk_weights, handle)`.

        Returns:
            `(recv_x or (recv_x, recv_sf), recv_topk_idx, recv_topk_weights, handle, event)`, or with
            `defer_epilogue` the event.
        """
        if do_handle_copy:
            raise ValueError('do_handle_copy must be False (DeepEP V2.5: the handle keeps topk_idx by reference)')
        num_sms = self._check_call_options(num_sms, num_qps, async_with_compute_stream, defer_epilogue)
        out = (self._ep or self._ep_feature()).dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats, num_experts=num_experts,
            num_max_tokens_per_rank=num_max_tokens_per_rank, expert_alignment=expert_alignment, num_sms=num_sms,
            num_qps=num_qps, previous_event=previous_event, previous_event_before_epilogue=None,
            async_with_compute_stream=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream,
            handle=handle, do_handle_copy=False, do_cpu_sync=do_cpu_sync, do_expand=do_expand,
            do_zero_padding=do_zero_padding, use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf)
        return _deferred(out) if defer_epilogue else out

    def combine(self, x, handle: EPHandle, topk_weights=None, bias=None, num_sms: int = 0, num_qps: int = 0,
                previous_event=None, async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                defer_epilogue: bool = False):
        """Send every received row back to its token's origin and reduce there (`ElasticBuffer.combine`, with V2.5's
        changes: `num_sms=0` reuses the dispatch's, an explicit one is rounded up to even; `defer_epilogue=True`
        (needs `async_with_compute_stream=True`) returns only the `EventOverlap`, whose `wait()` /
        `current_stream_wait()` returns `(combined_x, combined_topk_weights)`).

        Returns:
            `(combined_x, combined_topk_weights, event)`, or with `defer_epilogue` the event.
        """
        num_sms = self._check_call_options(num_sms, num_qps, async_with_compute_stream, defer_epilogue)
        out = (self._ep or self._ep_feature()).combine(
            x, handle, topk_weights=topk_weights, bias=bias, num_sms=num_sms, num_qps=num_qps,
            previous_event=previous_event, previous_event_before_epilogue=None,
            async_with_compute_stream=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream)
        return _deferred(out) if defer_epilogue else out

    # ---- load balancing ----------------------------------------------------------------------------------------
    def lb_get_storage(self, kind: str = 'torch'):
        """The LB region as a uint8 array (`kind` 'torch' or 'cupy'), a view of symmetric memory."""
        return self._lb_feature().storage(kind)

    def lb_get_theoretical_num_sms(self) -> int:
        """SMs for prefetch / reduction: `align(ceil(max(nvlink / 180, nvlink / 45)), 2)`."""
        return self._lb_feature().theoretical_num_sms()

    def _lb_num_sms(self, num_sms: int) -> int:
        if not self.num_lb_bytes:
            raise RuntimeError('this EPBuffer has no load-balancing region: build it with '
                               'lb_allocation_plan_or_num_bytes (a BufferAllocator plan of the redundant pools)')
        return self.lb_get_theoretical_num_sms() if num_sms == 0 else align(check_int('num_sms', num_sms), 2)

    def lb_prefetch_weights(self, redundant_expert_weights, expert_weights, redundancy_mapping, num_sms: int = 0,
                            previous_event=None):
        """Push this rank's expert weights into the redundant slots its peers host (collective over the domain).

        Args:
            redundant_expert_weights: `[num_redundant, *shape]` tensor, or a non-empty sequence of them, inside this
                buffer's LB region (same offsets on every rank); slots whose mapping entry is -1 stay untouched.
            expert_weights: `[L, *shape]` tensor(s) of this rank's experts (contiguous, any CUDA memory), one per
                redundant tensor, same bytes per expert (a multiple of `get_num_tma_alignment()`).
            redundancy_mapping: `[num_nvlink_ranks, num_redundant]` int32, identical on every rank: entry `[r, c]` is
                the domain-local expert id (`owner * L + local_idx`) in slot c of rank r, or -1.
            num_sms: SMs (0: `lb_get_theoretical_num_sms()`; else rounded up to even).
            previous_event: an `EventHandle` to wait for instead of the current stream.

        Returns:
            `EventOverlap`; `wait()` makes the current stream wait until the weights are in place on this rank.
        """
        num_sms = self._lb_num_sms(num_sms)
        return self._lb_feature().prefetch_weights(redundant_expert_weights, expert_weights, redundancy_mapping,
                                                   num_sms, previous_event)

    def lb_reduce_grads(self, redundant_expert_grads, expert_grads, redundancy_mapping, num_sms: int = 0,
                        previous_event=None):
        """Add every redundant copy's gradient into its owner's `expert_grads`, in place (collective over the domain;
        FP32, ascending (rank, slot) order; the redundant gradients are only read).

        Args:
            redundant_expert_grads: `[num_redundant, hidden]` float32 inside this buffer's LB region.
            expert_grads: `[L, hidden]` float32, contiguous, accumulated into.
            redundancy_mapping, num_sms, previous_event: as in `lb_prefetch_weights`.

        Returns:
            `EventOverlap`; `wait()` makes the current stream wait for the reduced `expert_grads`.
        """
        num_sms = self._lb_num_sms(num_sms)
        return self._lb_feature().reduce_grads(redundant_expert_grads, expert_grads, redundancy_mapping, num_sms,
                                               previous_event)


def _deferred(out):
    """V2.5's `defer_epilogue`: the event of the asynchronous call's result `out` (`(*outputs, event)`), whose
    `wait()` / `current_stream_wait()` returns the outputs."""
    *outputs, event = out
    outputs = tuple(outputs)
    event.register_hook_after_wait(lambda: outputs)
    return event
