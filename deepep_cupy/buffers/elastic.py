"""`ElasticBuffer`: DeepEP V2's buffer (`deep_ep.buffers.elastic`): MoE dispatch and combine inside one scale-up
(NVLink) domain, plus PP send/recv, all-gather sessions and reductions, engram and load balancing.

The class keeps DeepEP's public methods and delegates each to a feature component (`deepep_cupy.features`), created
on first use; a component owns its state and its `destroy()`. A buffer serves one feature: the first one to lay out
its slots claims the data region. Components reference the buffer weakly, so dropping the last reference to a buffer
frees it at once (`explicitly_destroy=False`).
"""

import weakref
from typing import Optional

from ..constants import DEFAULT_NVLINK_GBS, NUM_MAX_TOPK
from ..features.agrs.feature import AGRS
from ..features.agrs.plan import (
    hybrid_domains,
    hybrid_reduce_num_bytes,
    num_max_session_bytes,
    reduce_area_offset,
)
from ..features.engram.feature import Engram
from ..features.engram.plan import storage_size_hint
from ..features.ep import feature as ep_feature
from ..features.ep import layout as ep_layout
from ..features.ep import plan as ep_plan
from ..features.ep.feature import EP
from ..features.ep.handle import EPHandle
from ..features.hybrid.feature import HybridEP
from ..features.lb.feature import LB
from ..features.pp.feature import PP
from ..features.pp.plan import get_pp_buffer_size_hint
from ..runtime import dtypes
from ..runtime.checks import check_int
from ..runtime.group import get_group
from ..runtime.group_size import group_size
from ..runtime.nvlink import get_nvlink_gbs
from ..runtime.sizes import align
from . import agrs_rails, hybrid
from .allocator import BufferAllocator, Placeholder
from .base import BUFFER_ALIGNMENT, BufferBase

__all__ = ['ElasticBuffer', 'EPHandle']


def _doc(source):
    """Give the decorated delegating method the docstring of the component method doing the work."""
    def apply(method):
        method.__doc__ = source.__doc__
        return method
    return apply


class ElasticBuffer(hybrid.RailHooks, BufferBase):
    """Buffer for MoE dispatch / combine over the ranks of one scale-up (NVLink) domain, plus DeepEP V2's other
    features on the same symmetric memory (one feature per buffer): PP send/recv (`pp_*`), all-gather sessions,
    reduce-scatter and all-reduce (`agrs_*`, `all_gather`, ...), engram (`engram_*`) and load balancing (`lb_*`).

    Args:
        group: torch.distributed ProcessGroup; `comm`: mpi4py communicator (neither: MPI world under mpirun, else one
            process).
        num_bytes: symmetric bytes per rank (multiple of 2 MiB); default `get_buffer_size_hint(...)` of the MoE
            settings below.
        num_cpu_bytes: the part of `num_bytes` (a multiple of 2 MiB) kept in host memory: the engram table's storage,
            pinned host segments every rank of the scale-up domain maps (`get_engram_storage_size_hint`'s
            `cpu_bytes`). 0: everything in GPU memory.
        num_max_tokens_per_rank: most tokens a rank dispatches per call (all ranks must agree).
        hidden: hidden size; num_topk: top-k (0: size for up to 32).
        use_fp8_dispatch: accepted for DeepEP compatibility (the buffer is sized for BF16, which covers FP8).
        deterministic: received rows in DeepEP's deterministic order, one sort by source token index
            (`src_token_global_idx`). Inside one domain that is the order dispatch always gives; across domains with
            several ranks each, the rows are moved into it after the dispatch (psums and counts unchanged).
        allow_hybrid_mode: NVLink inside a scale-up domain and rails (NCCL, or the IPC loopback when rail members
            share a GPU: `DEEPEP_CUPY_RAIL_TRANSPORT`) between domains. With several domains dispatch / combine take
            the composed hybrid path (features/hybrid/feature.py; rows in DeepEP V2's hybrid order, combine reduced
            in each domain first); the other features stay inside one domain.
        allow_multiple_reduction: combine of expanded inputs reduces per rank before sending (less traffic).
        prefer_overlap_with_compute: SM heuristic (False: at least 64 SMs).
        num_allocated_qps: DeepEP's queue-pair budget (0: 17 direct, 129 hybrid); caps `get_theoretical_num_qps`.
        num_cpu_timeout_secs, num_gpu_timeout_secs: bounds on host and GPU waits.
        explicitly_destroy: memory is released by `destroy()` (collective); else when the buffer is garbage-collected.
    """

    def __init__(self, group=None, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: float = 300, num_gpu_timeout_secs: float = 100,
                 explicitly_destroy: bool = False, comm=None, device: Optional[int] = None):
        for name, value in (('num_max_tokens_per_rank', num_max_tokens_per_rank), ('hidden', hidden),
                            ('num_topk', num_topk), ('num_cpu_bytes', num_cpu_bytes)):
            check_int(name, value)
        if num_topk > NUM_MAX_TOPK:
            raise ValueError(f'num_topk must be <= {NUM_MAX_TOPK}, got {num_topk}')
        pg = get_group(group, comm, timeout=num_cpu_timeout_secs)
        if num_bytes is None:
            num_bytes = hybrid.derived_num_bytes(self.get_buffer_size_hint, pg, device, num_max_tokens_per_rank,
                                                 hidden, num_topk, use_fp8_dispatch, allow_hybrid_mode,
                                                 allow_multiple_reduction)
        check_int('num_bytes', num_bytes)
        if num_cpu_bytes % BUFFER_ALIGNMENT or num_cpu_bytes > num_bytes:
            raise ValueError(f'num_cpu_bytes must be a multiple of {BUFFER_ALIGNMENT} (2 MiB) and at most num_bytes='
                             f'{num_bytes}, got {num_cpu_bytes}')
        self.num_cpu_bytes = num_cpu_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk
        self.use_fp8_dispatch = bool(use_fp8_dispatch)
        self.deterministic = bool(deterministic)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.num_allocated_qps = num_allocated_qps
        self._ep = self._pp = self._agrs = self._engram = self._lb = None
        super().__init__(group=pg, num_bytes=num_bytes - num_cpu_bytes, num_host_bytes=num_cpu_bytes,
                         allow_hybrid_mode=allow_hybrid_mode,
                         num_cpu_timeout_secs=num_cpu_timeout_secs, num_gpu_timeout_secs=num_gpu_timeout_secs,
                         explicitly_destroy=explicitly_destroy, device=device,
                         config={'num_max_tokens_per_rank': num_max_tokens_per_rank, 'hidden': hidden,
                                 'num_topk': num_topk, 'allow_multiple_reduction': self.allow_multiple_reduction})
        self.num_rdma_ranks, self.num_nvlink_ranks = self.num_scaleout_ranks, self.num_scaleup_ranks
        self.num_allocated_qps = ep_plan.resolve_num_allocated_qps(num_allocated_qps, self.num_scaleout_ranks > 1)
        # Read the NVLink bandwidth now (it runs nvidia-smi once per process), never inside a timed or captured call.
        self._nvlink_gbs = get_nvlink_gbs() or DEFAULT_NVLINK_GBS
        # Several domains without the MoE sizes: no EP (its first call raises, naming them); the buffer still serves
        # PP and all-gather / reduce-scatter (DeepEP's test_agrs.py builds it from num_bytes alone).
        if (num_max_tokens_per_rank and hidden) or (num_topk and self.num_scaleout_ranks == 1):
            try:
                self._ep_feature()      # lays out the EP regions and compiles the kernels now (hybrid: the rails)
            except BaseException:
                self.destroy()
                raise

    # ---- the features, each created on first use ---------------------------------------------------------------
    def _ep_feature(self) -> EP:
        if self._ep is None:
            if self.num_scaleout_ranks > 1:
                # Several scale-up domains: the composed hybrid path over the intranode engine (features/hybrid).
                self._ep = hybrid.make_hybrid_ep(self)
            else:
                self._ep = EP(weakref.proxy(self), self.num_max_tokens_per_rank, self.hidden, self.num_topk,
                              self.allow_multiple_reduction, self.prefer_overlap_with_compute, self._nvlink_gbs)
        return self._ep

    def _pp_feature(self) -> PP:
        if self._pp is None:
            self._pp = PP(weakref.proxy(self))
        return self._pp

    def _agrs_feature(self) -> AGRS:
        if self._agrs is None:
            self._agrs = AGRS(weakref.proxy(self), make_rails=agrs_rails.make)
        return self._agrs

    def _engram_feature(self) -> Engram:
        if self._engram is None:
            self._engram = Engram(weakref.proxy(self), host_storage=self.host_storage)
        return self._engram

    def _lb_feature(self) -> LB:
        if self._lb is None:
            self._lb = LB(weakref.proxy(self))
        return self._lb

    def _destroy_features(self) -> None:
        for feature in (self._ep, self._pp, self._agrs, self._engram, self._lb):
            if feature is not None:
                feature.destroy()
        self._hybrid = self._ep if isinstance(self._ep, HybridEP) else None
        self._ep = self._pp = self._agrs = self._engram = self._lb = None

    # ---- sizes and SM / QP policy ------------------------------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True, comm=None) -> int:
        """Symmetric bytes (beyond the workspace, 2 MiB aligned) a buffer needs for these MoE settings.

        `group` (a torch group, a deepep_cupy `ProcessGroup`, an int, or None for the world) or `comm` (an mpi4py
        communicator) only gives the number of ranks; nothing is communicated."""
        return ep_layout.buffer_size_hint(group_size(group, comm), num_max_tokens_per_rank, hidden, num_topk,
                                          allow_multiple_reduction)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The SMs of every dispatch that passes `num_sms=0` (and no handle), on every buffer, from now on (0: the
        SM policy of `get_theoretical_num_sms` again). DeepEP V2 takes `num_sms` per call only; Megatron-Core calls
        this where `ElasticBuffer` has it, as it calls V1's `Buffer.set_num_sms`."""
        check_int('new_num_sms', new_num_sms, 0)
        ep_feature.set_default_num_sms(new_num_sms)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, nvlink_gbs: float = 0,
                                sm_read_gbs: float = 200, sm_write_gbs: float = 50) -> int:
        """SMs for the send kernels so that they can drive NVLink at full speed (DeepEP V2's analytic model,
        direct mode, balanced routing assumed)."""
        return ep_plan.theoretical_num_sms(self.num_ranks, num_experts, num_topk, nvlink_gbs or self._nvlink_gbs,
                                           self.num_device_sms, self.prefer_overlap_with_compute, sm_read_gbs,
                                           sm_write_gbs)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP's queue pairs for `num_sms` SMs: `min(num_sms, 9)` in direct mode, `num_sms * 16 + 1` in hybrid
        mode, at most `num_allocated_qps` (accepted everywhere; NVLink traffic needs no QPs)."""
        return ep_plan.theoretical_num_qps(num_sms, self.num_scaleout_ranks > 1, self.num_allocated_qps)

    # ---- dispatch / combine ------------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: Optional[EPHandle] = None, do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False):
        """Send each token to every rank owning one of its experts.

        Args:
            x: `[num_tokens, hidden]` bfloat16, or `(x_fp8 [num_tokens, hidden] float8_e4m3fn, sf [num_tokens, P])`
                with 4-byte scale factors (float32, or int32 holding packed UE8M0), any strides for sf. Rows must be
                contiguous and `hidden * itemsize` a multiple of 16. CuPy users pass bfloat16 as uint16, fp8 as uint8.
            topk_idx: `[num_tokens, num_topk]` int64, expert ids in `[-1, num_experts)` (-1 = none). None with handle.
            topk_weights: `[num_tokens, num_topk]` float32, optional.
            cumulative_local_expert_recv_stats: `[num_local_experts]` int32, incremented by the received counts.
            num_experts: total experts (a multiple of the number of ranks).
            num_max_tokens_per_rank: default the buffer's; every rank must pass the same value.
            expert_alignment: per-expert counts rounded up to this (default 1).
            num_sms: SMs of the send kernel (0: `get_theoretical_num_sms`; a cached dispatch: the handle's).
            num_qps: accepted for DeepEP compatibility (no QPs inside one NVLink domain).
            previous_event: `EventHandle` the communication stream waits for (needs allocate_on_comm_stream).
            previous_event_before_epilogue: accepted (one epilogue, ordered by previous_event).
            async_with_compute_stream: return an event instead of making the current stream wait.
            allocate_on_comm_stream: allocate outputs on the communication stream.
            handle: an `EPHandle` for a cached dispatch (same layout, no CPU sync, topk_idx must be None).
            do_handle_copy: the handle keeps a copy of topk_idx (False: the tensor itself).
            do_cpu_sync: wait for the counts on the host and return exact sizes (default True, False with handle);
                False gives worst-case sized outputs without any host synchronisation (CUDA-graph capturable).
            do_expand: one output row per (token, local expert), grouped by expert (GEMM layout).
            do_zero_padding: zero the alignment gaps of the expanded layout.
            use_tma_aligned_col_major_sf: received scale factors column-major with rows padded to 4.

        Returns:
            `(recv_x or (recv_x, recv_sf), recv_topk_idx, recv_topk_weights, handle, event)`.
        """
        return (self._ep or self._ep_feature()).dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats, num_experts=num_experts,
            num_max_tokens_per_rank=num_max_tokens_per_rank, expert_alignment=expert_alignment, num_sms=num_sms,
            num_qps=num_qps, previous_event=previous_event,
            previous_event_before_epilogue=previous_event_before_epilogue,
            async_with_compute_stream=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream,
            handle=handle, do_handle_copy=do_handle_copy, do_cpu_sync=do_cpu_sync, do_expand=do_expand,
            do_zero_padding=do_zero_padding, use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf)

    def combine(self, x, handle: EPHandle, topk_weights=None, bias=None, num_sms: int = 0, num_qps: int = 0,
                previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send every received row back to its token's origin and reduce there (unweighted sum in FP32, fixed
        order, one rounding to bfloat16: bitwise equal to `deepep_cupy.utils.refs.combine`).

        Args:
            x: bfloat16 rows aligned with the dispatch output: `[num_recv_tokens, hidden]` (non-expanded; each row is
                this rank's sum over its local experts) or `[num_expanded_tokens, hidden]` (expanded).
            handle: the dispatch's `EPHandle`.
            topk_weights: float32 `[num_recv_tokens, num_topk]` (non-expanded) or `[num_expanded_tokens]` (expanded);
                the result's combined_topk_weights[t][k] is the value returned for slot k by its owner.
            bias: None, a tensor or a tuple of up to two bfloat16 `[num_tokens, hidden]` tensors added in FP32.
            num_sms: SMs that send (0: the dispatch's `num_sms`), DeepEP's meaning; the SMs they leave (as many as
                the reduction can use) reduce what arrives, in the same launch, as DeepEP's reduce epilogue takes
                the whole GPU. One rank sends nothing: every block reduces.
            previous_event, async_with_compute_stream, allocate_on_comm_stream: as in `dispatch`.

        Returns:
            `(combined_x [num_tokens, hidden] bfloat16, combined_topk_weights [num_tokens, num_topk] float32 or None,
            event)`.
        """
        return (self._ep or self._ep_feature()).combine(
            x, handle, topk_weights=topk_weights, bias=bias, num_sms=num_sms, num_qps=num_qps,
            previous_event=previous_event, previous_event_before_epilogue=previous_event_before_epilogue,
            async_with_compute_stream=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream)

    # ---- PP send/recv ------------------------------------------------------------------------------------------
    get_pp_buffer_size_hint = staticmethod(get_pp_buffer_size_hint)

    @_doc(PP.set_config)
    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int, num_qps: int = 0) -> None:
        # `num_qps` (DeepEP's RDMA queue pairs for PP) has no meaning over NVLink: it is recorded as `num_pp_qps`
        # (0: the buffer's `num_allocated_qps`), capped at `num_allocated_qps` as upstream does.
        check_int('num_qps', num_qps)
        self._pp_feature().set_config(num_max_tensor_bytes, num_max_inflight_tensors)
        self.num_pp_qps = min(num_qps or self.num_allocated_qps, self.num_allocated_qps)

    @_doc(PP.send)
    def pp_send(self, x, dst_rank_idx: int, num_sms: int = 0, previous_event=None,
                async_with_compute_stream: bool = False):
        return (self._pp or self._pp_feature())._transfer(True, x, dst_rank_idx, num_sms, previous_event,
                                                          async_with_compute_stream)     # (`PP.send`'s body)

    @_doc(PP.recv)
    def pp_recv(self, x, src_rank_idx: int, num_sms: int = 0, previous_event=None,
                async_with_compute_stream: bool = False):
        return (self._pp or self._pp_feature())._transfer(False, x, src_rank_idx, num_sms, previous_event,
                                                          async_with_compute_stream)     # (`PP.recv`'s body)

    # ---- all-gather sessions, reduce-scatter, all-reduce -------------------------------------------------------
    @staticmethod
    def get_agrs_num_max_session_bytes(group, shapes, dtype) -> int:
        """Session bytes for gathering one tensor of each of `shapes` (Σ align(R · prod(shape) · itemsize, 32)).

        Args:
            group: the group (or its size); shapes: a sequence of shapes; dtype: torch or numpy dtype.
        """
        return num_max_session_bytes(group_size(group), shapes, dtypes.describe(dtype)[2])

    @staticmethod
    def get_agrs_buffer_size_hint(group, num_max_session_bytes: int, num_max_reduce_bytes: int = 0) -> int:
        """Buffer `num_bytes` for a session area of `num_max_session_bytes` (2 MiB aligned), plus a reduction area of
        `num_max_reduce_bytes` (see `get_agrs_reduce_num_bytes`) after it when given."""
        check_int('num_max_session_bytes', num_max_session_bytes)
        check_int('num_max_reduce_bytes', num_max_reduce_bytes)
        if not num_max_reduce_bytes:
            return align(num_max_session_bytes, BUFFER_ALIGNMENT)
        return align(reduce_area_offset(num_max_session_bytes) + num_max_reduce_bytes, BUFFER_ALIGNMENT)

    @staticmethod
    def get_agrs_reduce_num_bytes(group, num_max_elems: int, op: str = 'all_reduce',
                                  comm_precision: str = 'fp32') -> int:
        """Reduction-area bytes for `reduce_scatter` (input of `num_max_elems` elements per rank) or `all_reduce`
        (`num_max_elems` FP32 elements); in hybrid mode the in-domain step plus the rail slots."""
        check_int('num_max_elems', num_max_elems)
        num_domains, num_scaleup = hybrid_domains(group)
        return hybrid_reduce_num_bytes(num_domains, num_scaleup, num_max_elems, op, comm_precision)

    @_doc(AGRS.set_config)
    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int = 32,
                        num_sms: int = 0) -> None:
        AGRS.check_config(self.num_bytes, num_max_session_bytes, num_max_all_gathers_per_session, num_sms)
        self._agrs_feature().set_config(num_max_session_bytes, num_max_all_gathers_per_session, num_sms)

    @_doc(AGRS.create_session)
    def create_agrs_session(self) -> None:
        self._agrs_feature().create_session()

    @_doc(AGRS.destroy_session)
    def destroy_agrs_session(self) -> None:
        self._agrs_feature().destroy_session()

    @_doc(AGRS.new_session)
    def agrs_new_session(self, enabled: bool = True):
        return self._agrs_feature().new_session(enabled)

    @_doc(AGRS.get_inplace_tensor)
    def agrs_get_inplace_tensor(self, shapes, dtype):
        return self._agrs_feature().get_inplace_tensor(shapes, dtype)

    @_doc(AGRS.all_gather)
    def all_gather(self, tensors):
        return (self._agrs or self._agrs_feature()).all_gather(tensors)

    @_doc(AGRS.reduce_scatter)
    def reduce_scatter(self, x, comm_precision: str = 'fp32', scale: float = 1.0, num_sms: int = 0,
                       previous_event=None):
        return (self._agrs or self._agrs_feature()).reduce_scatter(x, comm_precision, scale, num_sms, previous_event)

    @_doc(AGRS.all_reduce)
    def all_reduce(self, x, scale: float = 1.0, num_sms: int = 0, previous_event=None):
        return (self._agrs or self._agrs_feature()).all_reduce(x, scale, num_sms, previous_event)

    # ---- engram ------------------------------------------------------------------------------------------------
    get_engram_storage_size_hint = staticmethod(storage_size_hint)

    def engram_write(self, storage, sf=None) -> None:
        """Copy this rank's rows into its table (collective over the domain: every rank calls it with tables of the
        same shape and dtype); the table lives in host storage when the buffer has `num_cpu_bytes`, else in the last
        `cpu_bytes` of the data region. Waits until no peer still fetches from the old table; fetches issued later
        see the new tables.

        Args:
            storage: `[num_entries, hidden]` bfloat16 or float8_e4m3fn (CuPy: uint16 / uint8), contiguous, on this
                GPU; `hidden * itemsize` a multiple of 16 bytes.
            sf: for float8 tables, the scale factors of EVERY rank's rows, replicated on every rank:
                `[num_ranks * num_entries, num_packs]` float32 (or int32 packed UE8M0), contiguous. None: no scales.
        """
        self._engram_feature().write([storage], None if sf is None else [sf])

    def engram_fetch(self, indices, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False,
                     check_indices: bool = True):
        """Gather rows of the domain's table (not collective: each rank fetches on its own).

        Args:
            indices: `[num_tokens, num_entries_per_token]` int32, contiguous, on this GPU; global entry ids in
                `[0, num_ranks * num_entries)`.
            num_qps: blocks of the fetch kernel (upstream: RDMA queue pairs); 0: every SM, fewer for small fetches.
            use_tma_aligned_col_major_sf: scale factors column-major with the token dimension padded to 4.
            check_indices: read the indices' range back before the launch (the host waits for the current stream to
                reach this call) and raise ValueError if one is out of range. False skips it; out-of-range rows come
                out zero.

        Returns:
            a hook; `hook()` makes the current stream wait and returns `(data, sf)`: `data` is `[num_tokens,
            num_entries_per_token * hidden]` in the table's dtype, a view of this buffer's fetch output area (valid
            until the next fetch on this buffer), `sf` `[num_tokens, num_entries_per_token * num_packs]` (float32 /
            int32, new memory) or None without scale factors.
        """
        return (self._engram or self._engram_feature()).fetch(indices, num_qps, use_tma_aligned_col_major_sf,
                                                              check_indices)[0]

    # ---- load balancing ----------------------------------------------------------------------------------------
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
        lb = self._lb_feature()
        lb.set_region(num_bytes, signature)
        if plan is None:
            return lb.storage()
        kind = 'cupy' if all(isinstance(a, Placeholder) for a in plan.placeholders) else 'torch'
        return plan.materialize(lb.storage(kind))

    @_doc(LB.storage)
    def lb_get_storage(self, kind: str = 'cupy'):
        return self._lb_feature().storage(kind)

    @_doc(LB.theoretical_num_sms)
    def lb_get_theoretical_num_sms(self) -> int:
        return self._lb_feature().theoretical_num_sms()

    @_doc(LB.prefetch_weights)
    def lb_prefetch_weights(self, redundant_expert_weights, expert_weights, redundancy_mapping, num_sms: int = 0,
                            previous_event=None):
        return (self._lb or self._lb_feature()).prefetch_weights(redundant_expert_weights, expert_weights,
                                                                 redundancy_mapping, num_sms, previous_event)

    @_doc(LB.reduce_grads)
    def lb_reduce_grads(self, redundant_expert_grads, expert_grads, redundancy_mapping, num_sms: int = 0,
                        previous_event=None):
        return (self._lb or self._lb_feature()).reduce_grads(redundant_expert_grads, expert_grads,
                                                             redundancy_mapping, num_sms, previous_event)
