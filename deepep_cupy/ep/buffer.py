"""`ElasticBuffer` / `EPBuffer`: MoE dispatch and combine inside one scale-up (NVLink) domain, with DeepEP V2's API.

Per dispatch, on the buffer's communication stream:
  notify (layout of this rank's tokens + count exchange, ~µs) → send (tokens straight into their slots at every
  destination over NVLink) → [CPU waits for the counts if `do_cpu_sync`, allocates exact outputs] → receive epilogue
  (slots → user tensors). The send kernel does not depend on the output sizes, so the GPU keeps sending while the
  host waits. Combine: one launch whose sending blocks write partial rows into slots at each token's origin, chunk
  by chunk, while its reducing blocks sum every token once its chunks are released (fixed FP32 order).
See kernels_cu/ep_*.cu for the protocols.
"""

import math
import time
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from .. import constants
from ..agrs import AGRSMixin
from ..buffer_base import BufferBase
from ..engram import EngramMixin
from ..lb import LBMixin
from ..pp import PPMixin
from ..runtime import interop
from ..runtime.event import EventHandle, EventOverlap
from ..runtime.group import get_group
from ..runtime.host_range import HostRange
from . import checks, layout
from .handle import EPHandle, workspace_layout
from .kernels import COMBINE_CHUNK_ROWS, COMBINE_CHUNK_SIGNAL_BYTES, NOTIFY_THREADS, EPKernels

HOST_COUNTS_OFFSET = 1024      # byte offset of the dispatch counts in the buffer's host-mapped memory
HOST_RANGE_OFFSET = 8192       # byte offset of the top-k range check's [seq, lo, hi] (int64)


def _bias_list(bias) -> Tuple[Any, ...]:
    if bias is None:
        return ()
    if isinstance(bias, (tuple, list)):
        if len(bias) > 2:
            raise ValueError(f'bias must be None, a tensor or a tuple of at most 2 tensors, got {len(bias)}')
        return tuple(b for b in bias if b is not None)
    return (bias,)


class ElasticBuffer(BufferBase, PPMixin, AGRSMixin, EngramMixin, LBMixin):
    """Buffer for MoE dispatch / combine over the ranks of one scale-up (NVLink) domain, plus DeepEP V2's other
    features on the same symmetric memory (one feature per buffer): PP send/recv (`pp_*`), all-gather sessions,
    reduce-scatter and all-reduce (`agrs_*`, `all_gather`, ...), engram (`engram_*`) and load balancing (`lb_*`).

    Args:
        group: torch.distributed ProcessGroup; `comm`: mpi4py communicator (neither: MPI world under mpirun, else one
            process).
        num_bytes: symmetric bytes per rank (multiple of 2 MiB); default `get_buffer_size_hint(...)` of the MoE
            settings below.
        num_max_tokens_per_rank: most tokens a rank dispatches per call (all ranks must agree).
        hidden: hidden size; num_topk: top-k (0: size for up to 32).
        use_fp8_dispatch: accepted for DeepEP compatibility (the buffer is sized for BF16, which covers FP8).
        deterministic: accepted; dispatch is always deterministic here (rows ordered by source rank, then token).
        allow_hybrid_mode: NVLink inside a scale-up domain and NCCL between domains. This build implements one
            scale-up domain; several domains raise `NotImplementedError` at construction.
        allow_multiple_reduction: combine of expanded inputs reduces per rank before sending (less traffic).
        prefer_overlap_with_compute: SM heuristic (False: at least 64 SMs).
        num_cpu_timeout_secs, num_gpu_timeout_secs: bounds on host and GPU waits.
        explicitly_destroy: memory is released by `destroy()` (collective).
    """

    def __init__(self, group=None, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: float = 300, num_gpu_timeout_secs: float = 100,
                 explicitly_destroy: bool = False, comm=None, device: Optional[int] = None):
        for name, value in (('num_max_tokens_per_rank', num_max_tokens_per_rank), ('hidden', hidden),
                            ('num_topk', num_topk), ('num_cpu_bytes', num_cpu_bytes)):
            checks.check_int(name, value)
        if num_topk > layout.NUM_MAX_TOPK:
            raise ValueError(f'num_topk must be <= {layout.NUM_MAX_TOPK}, got {num_topk}')
        if num_cpu_bytes:
            raise NotImplementedError('num_cpu_bytes (host-memory engram storage) is not supported yet')
        pg = get_group(group, comm, timeout=num_cpu_timeout_secs)
        if num_bytes is None:
            if not (num_max_tokens_per_rank and hidden):
                raise ValueError('give num_bytes, or num_max_tokens_per_rank and hidden so the size can be derived')
            num_bytes = self.get_buffer_size_hint(pg, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                                  allow_hybrid_mode, allow_multiple_reduction)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk
        self.use_fp8_dispatch = bool(use_fp8_dispatch)
        self.deterministic = bool(deterministic)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.num_allocated_qps = num_allocated_qps
        super().__init__(group=pg, num_bytes=num_bytes, allow_hybrid_mode=allow_hybrid_mode,
                         num_cpu_timeout_secs=num_cpu_timeout_secs, num_gpu_timeout_secs=num_gpu_timeout_secs,
                         explicitly_destroy=explicitly_destroy, device=device,
                         config={'num_max_tokens_per_rank': num_max_tokens_per_rank, 'hidden': hidden,
                                 'num_topk': num_topk, 'allow_multiple_reduction': self.allow_multiple_reduction})
        if self.num_scaleout_ranks > 1:
            self.destroy()
            raise NotImplementedError(
                f'{self.num_scaleout_ranks} scale-up domains: dispatch/combine across domains (hybrid mode over NCCL) '
                f'is not implemented yet; run within one NVLink domain')
        self.num_rdma_ranks, self.num_nvlink_ranks = self.num_scaleout_ranks, self.num_scaleup_ranks
        self._layout: Optional[layout.EPLayout] = None
        if num_max_tokens_per_rank and hidden:
            self._set_layout(num_max_tokens_per_rank, hidden, num_topk or layout.NUM_MAX_TOPK)
        self._kernels = {}
        self._order_events = None
        if num_topk:
            self._get_kernels(num_topk)      # compile now, never inside a timed or collective region
        self._host_seq = 0
        self.host_counts = self.host_mapped.view('int32', 3 + layout.NUM_MAX_LOCAL_EXPERTS, HOST_COUNTS_OFFSET)
        self._topk_range = HostRange(self.host_mapped, HOST_RANGE_OFFSET)
        # Read the NVLink bandwidth now (it runs nvidia-smi once per process), never inside a timed or captured call.
        from ..utils.envs import get_nvlink_gbs
        self._nvlink_gbs = get_nvlink_gbs() or 450.0

    # ---- static helpers ------------------------------------------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Symmetric bytes (beyond the workspace, 2 MiB aligned) a buffer needs for these MoE settings."""
        num_ranks = group.size if hasattr(group, 'allgather_object') else get_group(group).size
        return layout.buffer_size_hint(num_ranks, num_max_tokens_per_rank, hidden, num_topk,
                                       allow_multiple_reduction)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, nvlink_gbs: float = 0,
                                sm_read_gbs: float = 200, sm_write_gbs: float = 50) -> int:
        """SMs for the send kernels so that they can drive NVLink at full speed (DeepEP V2's analytic model,
        direct mode, balanced routing assumed)."""
        num_ranks = self.num_ranks
        if num_ranks == 1:
            return 4
        nvlink_gbs = nvlink_gbs or self._nvlink_gbs
        # Expected distinct destination ranks of a token: R * (1 - C(E - E/R, K) / C(E, K)).
        per_rank = num_experts // num_ranks
        miss = math.comb(num_experts - per_rank, num_topk) / math.comb(num_experts, num_topk)
        t = num_ranks * (1 - miss)
        read = 1 / t
        write = 1.0
        nvlink = 1 - 1 / num_ranks
        bw = nvlink_gbs / nvlink
        sms = max(bw * read / sm_read_gbs, bw * write / sm_write_gbs)
        sms = layout.align(max(4, math.ceil(1.25 * sms)), 2)
        if not self.prefer_overlap_with_compute:
            sms = max(sms, 64)
        return min(sms, self.num_device_sms)

    # ---- internals -----------------------------------------------------------------------------------------------
    def _set_layout(self, num_max_tokens_per_rank: int, hidden: int, num_topk: int):
        self.claim_data_region('EP dispatch/combine')
        lay = layout.EPLayout(self.num_scaleup_ranks, num_max_tokens_per_rank, hidden, num_topk,
                              self.allow_multiple_reduction, self.data_offset)
        if lay.end_offset > self.sym.num_bytes:
            raise ValueError(f'num_bytes={self.num_bytes} is too small for num_max_tokens_per_rank='
                             f'{num_max_tokens_per_rank}, hidden={hidden}, num_topk={num_topk}: need '
                             f'{layout.align(lay.end_offset - self.data_offset, constants.BUFFER_ALIGNMENT)} bytes '
                             f'(see get_buffer_size_hint)')
        self._layout = lay

    def _get_kernels(self, num_topk: int) -> EPKernels:
        k = self._kernels.get(num_topk)
        if k is None:
            k = self._kernels[num_topk] = EPKernels(self.num_scaleup_ranks, num_topk)
        return k

    def _streams(self, current, previous_event, allocate_on_comm_stream: bool):
        """The communication stream made to wait for `previous_event` (or for `current`, the caller's current
        stream). Returns (current, comm, alloc stream)."""
        comm = self.comm_stream
        if self._order_events is None:
            import cupy
            self._order_events = (cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True))
        if previous_event is not None:
            if not allocate_on_comm_stream:
                raise ValueError('previous_event requires allocate_on_comm_stream=True (DeepEP V2 rule)')
            ev = previous_event.event if isinstance(previous_event, EventOverlap) else previous_event
            if not isinstance(ev, EventHandle):
                raise TypeError(f'previous_event must be an EventHandle (buffer.capture()), got {type(ev).__name__}')
            ev.stream_wait(comm)
        else:
            # One reusable event per direction: a wait captures the event's state when it is enqueued.
            self._order_events[0].record(current)
            comm.wait_event(self._order_events[0])
        # None: allocate on the current stream (the allocators' default).
        return current, comm, (comm if allocate_on_comm_stream else None)

    def _finish(self, kind: str, current, comm, async_with_compute_stream: bool, tensors: Sequence[Any]):
        """Either make the current stream wait for the communication stream, or return an event for the caller."""
        live = tuple(t for t in tensors if t is not None)
        if async_with_compute_stream:
            if kind == 'torch':
                s = interop.torch_stream(comm.ptr)
                for t in live:
                    t.record_stream(s)
            return EventOverlap(EventHandle(comm), extra_tensors=live)
        self._order_events[1].record(comm)
        current.wait_event(self._order_events[1])
        return EventOverlap(None)

    def _topk_range_async(self, ti, stream):
        """Start reading (min, max) of topk_idx back to the host (`HostRange`: one small kernel on `stream`, the one
        that made topk_idx); returns a function that waits for them. The check still raises before any EP kernel."""
        return self._topk_range.start(self._get_kernels(ti.shape[1]).topk_range, ti.ptr, ti.numel, stream,
                                      self.num_cpu_timeout_secs, f'dispatch on rank {self.rank_idx} (topk_idx)')

    def _wait_host_counts(self, seq: int, num_local_experts: int):
        """Poll the host-mapped counts written by the notify kernel (bounded by num_cpu_timeout_secs)."""
        host = self.host_counts
        deadline = time.monotonic() + self.num_cpu_timeout_secs
        spins = 0
        while int(host[0]) != seq:
            spins += 1
            if spins % 64 == 0:
                if int(self.error_record[0]) != 0:
                    self.synchronize()
                if time.monotonic() > deadline:
                    self._failed = 'dispatch CPU wait timed out'
                    raise TimeoutError(f'deepep_cupy rank {self.rank_idx}: Dispatch CPU wait for the receive counts '
                                       f'timed out after {self.num_cpu_timeout_secs:g} s')
                if spins > 4096:
                    time.sleep(5e-5)
        return int(host[1]), int(host[2]), [int(v) for v in host[3:3 + num_local_experts]]

    # ---- dispatch ------------------------------------------------------------------------------------------------
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
            num_sms: SMs of the send kernel (0: `get_theoretical_num_sms`).
            previous_event: `EventHandle` the communication stream waits for (needs allocate_on_comm_stream).
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
        self.check_usable()
        del num_qps, previous_event_before_epilogue     # NVLink-only build: no QPs, single epilogue event
        fp8 = isinstance(x, (tuple, list))
        if fp8:
            if len(x) != 2:
                raise ValueError(f'x must be a tensor or a (x_fp8, sf) pair, got a sequence of {len(x)}')
            x, sf = x
        else:
            sf = None
        xi = checks.info(x, 'x', self.device)
        kind = xi.kind
        checks.check_dtype(xi, 'x', 'float8_e4m3fn' if fp8 else 'bfloat16')
        if xi.ndim != 2:
            raise ValueError(f'x must be 2-D [num_tokens, hidden], got shape {list(xi.shape)}')
        num_tokens, hidden = xi.shape
        if xi.strides[1] != 1:
            raise ValueError('x must have contiguous rows (stride 1 along hidden)')
        hidden_bytes = hidden * xi.itemsize
        if hidden_bytes % 16 != 0:
            raise ValueError(f'x: hidden * element size must be a multiple of 16 bytes, got {hidden} x {xi.itemsize}')
        if xi.strides[0] * xi.itemsize % 16 != 0 or xi.ptr % 16 != 0:
            raise ValueError('x rows must start at 16-byte aligned addresses')
        if sf is not None:
            sfi = checks.info(sf, 'x[1] (scale factors)', self.device)
            checks.check_same_kind(kind, sfi, 'x[1] (scale factors)')
            checks.check_dtype(sfi, 'x[1] (scale factors)', 'float32', 'int32')
            if sfi.ndim != 2 or sfi.shape[0] != num_tokens:
                raise ValueError(f'x[1] (scale factors) must be [num_tokens={num_tokens}, P], got {list(sfi.shape)}')
            num_sf = sfi.shape[1]
            if num_sf > layout.ceil_div(hidden, layout.SF_GROUP):
                raise ValueError(f'x[1] (scale factors) has {num_sf} columns; at most ceil(hidden / 128) = '
                                 f'{layout.ceil_div(hidden, layout.SF_GROUP)} are supported')
        else:
            sfi, num_sf = None, 0

        cached = handle is not None
        if cached:
            if not isinstance(handle, EPHandle):
                raise TypeError(f'handle must be an EPHandle, got {type(handle).__name__}')
            if handle.buffer_id != id(self):
                raise ValueError('handle was made by another buffer; use the buffer that dispatched it')
            if topk_idx is not None:
                raise ValueError('topk_idx must be None for a cached dispatch (it comes from the handle)')
            for name, value, expect in (('num_experts', num_experts, handle.num_experts),
                                        ('expert_alignment', expert_alignment, handle.expert_alignment),
                                        ('num_max_tokens_per_rank', num_max_tokens_per_rank,
                                         handle.num_max_tokens_per_rank)):
                if value is not None and value != expect:
                    raise ValueError(f'{name}={value} does not match the handle ({expect})')
            if do_cpu_sync:
                raise ValueError('do_cpu_sync must be False (or None) for a cached dispatch')
            if num_tokens != handle.num_tokens:
                raise ValueError(f'x has {num_tokens} tokens but the handle was made for {handle.num_tokens}')
            if handle.kind != kind:
                raise TypeError(f'x is a {kind} array but the handle holds {handle.kind} arrays')
            num_experts, expert_alignment = handle.num_experts, handle.expert_alignment
            num_max_tokens_per_rank = handle.num_max_tokens_per_rank
            topk_idx = handle.topk_idx
            do_cpu_sync = False
        else:
            if topk_idx is None:
                raise ValueError('topk_idx is required (or pass handle= for a cached dispatch)')
            if num_experts is None:
                raise ValueError('num_experts is required')
            num_max_tokens_per_rank = (self.num_max_tokens_per_rank if num_max_tokens_per_rank is None
                                       else num_max_tokens_per_rank)
            expert_alignment = 1 if expert_alignment is None else expert_alignment
            do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        checks.check_int('num_experts', num_experts, 1)
        checks.check_int('expert_alignment', expert_alignment, 1)
        checks.check_int('num_max_tokens_per_rank', num_max_tokens_per_rank, 1)
        checks.check_int('num_sms', num_sms, 0)
        R = self.num_scaleup_ranks
        if num_experts % R != 0:
            raise ValueError(f'num_experts={num_experts} must be a multiple of the number of ranks ({R})')
        L = num_experts // R
        if L > layout.NUM_MAX_LOCAL_EXPERTS:
            raise ValueError(f'num_experts / num_ranks = {L} local experts; at most {layout.NUM_MAX_LOCAL_EXPERTS}')
        if num_tokens > num_max_tokens_per_rank:
            raise ValueError(f'x has {num_tokens} tokens, more than num_max_tokens_per_rank={num_max_tokens_per_rank}')
        if do_zero_padding and not do_expand:
            raise ValueError('do_zero_padding=True needs do_expand=True')

        ti = checks.info(topk_idx, 'topk_idx', self.device)
        checks.check_same_kind(kind, ti, 'topk_idx')
        checks.check_dtype(ti, 'topk_idx', 'int64')
        if ti.ndim != 2 or ti.shape[0] != num_tokens:
            raise ValueError(f'topk_idx must be [num_tokens={num_tokens}, num_topk], got {list(ti.shape)}')
        checks.check_contiguous(ti, 'topk_idx')
        K = ti.shape[1]
        if not 1 <= K <= layout.NUM_MAX_TOPK:
            raise ValueError(f'topk_idx: num_topk must be in [1, {layout.NUM_MAX_TOPK}], got {K}')
        if self.num_topk and K > self.num_topk:
            raise ValueError(f'topk_idx has {K} columns but the buffer was built for num_topk={self.num_topk}')
        current = interop.current_stream(x)
        # The value range needs the GPU: start it now (one small kernel on the stream that made topk_idx, writing
        # host-mapped memory), read it after the other checks.
        range_check = self._topk_range_async(ti, current) if do_cpu_sync and not cached else None
        if topk_weights is not None:
            wi = checks.info(topk_weights, 'topk_weights', self.device)
            checks.check_same_kind(kind, wi, 'topk_weights')
            checks.check_dtype(wi, 'topk_weights', 'float32')
            checks.check_shape(wi, 'topk_weights', (num_tokens, K))
            checks.check_contiguous(wi, 'topk_weights')
        if cumulative_local_expert_recv_stats is not None:
            ci = checks.info(cumulative_local_expert_recv_stats, 'cumulative_local_expert_recv_stats', self.device)
            checks.check_same_kind(kind, ci, 'cumulative_local_expert_recv_stats')
            checks.check_dtype(ci, 'cumulative_local_expert_recv_stats', 'int32')
            checks.check_shape(ci, 'cumulative_local_expert_recv_stats', (L,))
            checks.check_contiguous(ci, 'cumulative_local_expert_recv_stats')
        if smem_bytes(num_experts, R) > 200 * 1024:
            raise ValueError(f'num_experts={num_experts} is too large for the notify kernel (at most 4096)')
        if self._layout is None:
            self._set_layout(num_max_tokens_per_rank, hidden, K)
        lay = self._layout
        msg_bytes = layout.message_bytes(hidden_bytes, num_sf, K)
        if R * num_max_tokens_per_rank * msg_bytes > lay.dispatch_recv_bytes:
            raise ValueError(f'buffer too small for this dispatch (num_max_tokens_per_rank={num_max_tokens_per_rank}, '
                             f'hidden={hidden}, num_topk={K}): build it with get_buffer_size_hint for these sizes')
        if layout.ceil_div(num_max_tokens_per_rank, NOTIFY_THREADS) * (num_experts + R) * 4 > \
                lay.scratch_bytes(R * layout.NUM_MAX_LOCAL_EXPERTS):
            raise ValueError('num_max_tokens_per_rank is larger than the buffer was built for')
        num_sms = num_sms or self.get_theoretical_num_sms(num_experts, K)
        num_sms = min(num_sms, self.num_device_sms)
        kernels = self._get_kernels(K)
        if range_check is not None:
            lo, hi = range_check()
            if lo < -1 or hi >= num_experts:
                raise ValueError(f'topk_idx values must be in [-1, {num_experts}), got min {lo}, max {hi}')

        # ---- launch ------------------------------------------------------------------------------------------
        current, comm, alloc_stream = self._streams(current, previous_event, allocate_on_comm_stream)
        alloc = interop.Allocator(kind)
        common = (self.sym.peer_bases_ptr, self.sym.local_idx)
        err = (self.host_mapped.ptr, self.timeout_ns)
        if cached:
            workspace, ws_ptr, offsets = handle.workspace, handle.workspace_ptr, handle.offsets
            user_topk = handle._topk_idx
            topk_ptr = handle.topk_idx_ptr
        else:
            # One allocation for the handle's small arrays (see EPHandle); notify fills it, copy of topk_idx included.
            words, offsets = workspace_layout(num_tokens, R, K, L, bool(do_handle_copy))
            workspace = alloc.empty((words,), 'int32', alloc_stream)
            ws_ptr = workspace.data_ptr() if kind == 'torch' else workspace.data.ptr
            user_topk = None if do_handle_copy else topk_idx
            topk_ptr = ti.ptr
            if do_cpu_sync:
                self._host_seq = (self._host_seq % 0x7FFFFFFF) + 1
                self.host_counts[0] = 0
            grid = max(1, layout.ceil_div(num_tokens, NOTIFY_THREADS))
            kernels.notify.launch(grid, NOTIFY_THREADS, (
                topk_ptr, num_tokens, num_experts, num_max_tokens_per_rank, expert_alignment, *common, *err,
                self.sym.base + lay.scratch_offset, ws_ptr + 4 * offsets[0], ws_ptr + 4 * offsets[1],
                ws_ptr + 4 * offsets[2], ws_ptr + 4 * offsets[3], int(do_expand),
                _ptr(cumulative_local_expert_recv_stats),
                self.host_mapped.ptr + HOST_COUNTS_OFFSET if do_cpu_sync else 0, self._host_seq,
                ws_ptr + 4 * offsets[4] if do_handle_copy else 0),
                stream=comm, shared_mem=smem_bytes(num_experts, R), cooperative=grid > 1)   # one block: no grid sync
        kernels.dispatch_send.launch(num_sms, 512, (
            xi.ptr, xi.strides[0] * xi.itemsize, hidden_bytes, sfi.ptr if sfi else 0,
            sfi.strides[0] if sfi else 0, sfi.strides[1] if sfi else 0, num_sf, topk_ptr,
            _ptr(topk_weights), ws_ptr + 4 * offsets[0], ws_ptr + 4 * offsets[1], num_tokens,
            num_max_tokens_per_rank, *common, lay.dispatch_recv_offset, *err), stream=comm)

        if do_cpu_sync:
            num_recv, num_expanded, aligned_list = self._wait_host_counts(self._host_seq, L)
        elif cached:
            num_recv, num_expanded, aligned_list = handle.num_recv_tokens, handle.num_expanded_tokens, \
                list(handle.num_recv_tokens_per_expert_list)
            if do_expand and not handle.do_expand and not handle.do_cpu_sync:
                num_expanded = worst_expanded_rows(R, num_max_tokens_per_rank, K, L, expert_alignment)
        else:
            num_recv = R * num_max_tokens_per_rank
            num_expanded = worst_expanded_rows(R, num_max_tokens_per_rank, K, L, expert_alignment)
            aligned_list = []
        num_out_rows = num_expanded if do_expand else num_recv

        recv_x = alloc.empty((num_out_rows, hidden), 'float8_e4m3fn' if fp8 else 'bfloat16', alloc_stream)
        recv_sf = None
        sf_strides = (0, 0)
        if sfi is not None:
            if use_tma_aligned_col_major_sf:
                padded = layout.align(num_out_rows, 4)
                storage = alloc.empty((num_sf, padded), sfi.dtype, alloc_stream)
                recv_sf = storage.t()[:num_out_rows] if kind == 'torch' else storage.T[:num_out_rows]
                sf_strides = (1, padded)
            else:
                recv_sf = alloc.empty((num_out_rows, num_sf), sfi.dtype, alloc_stream)
                sf_strides = (num_sf, 1)
        recv_topk_idx = None if do_expand else alloc.empty((num_recv, K), 'int64', alloc_stream)
        recv_topk_weights = None
        if topk_weights is not None:
            recv_topk_weights = alloc.empty((num_out_rows,) if do_expand else (num_recv, K), 'float32', alloc_stream)
        recv_src_metadata = alloc.empty((num_recv, K + 2), 'int32', alloc_stream)
        # The epilogue is a local copy, a warp per row segment of up to 1 KiB (see RowSegments in common/ep.cuh).
        recv_blocks = epilogue_blocks(max(num_recv, num_out_rows), hidden_bytes, self.num_device_sms)
        kernels.dispatch_recv.launch(recv_blocks, 512, (
            xi.ptr, xi.strides[0] * xi.itemsize, hidden_bytes, num_sf, num_experts, num_max_tokens_per_rank,
            ws_ptr + 4 * offsets[2], int(do_expand),
            int(do_zero_padding), num_out_rows, num_recv, recv_x, _ptr(recv_sf),
            sf_strides[0], sf_strides[1], _ptr(recv_topk_idx), _ptr(recv_topk_weights), recv_src_metadata, *common,
            lay.dispatch_recv_offset, *err), stream=comm)

        psum_expert = None
        if cached and do_expand != handle.do_expand:
            psum_expert = _psum_expert_from_layout(handle.recv_layout, R, L, expert_alignment, do_expand, kind, comm)
        elif cached:
            psum_expert = handle._psum_expert
        new_handle = EPHandle(
            do_expand=bool(do_expand), num_experts=num_experts, expert_alignment=expert_alignment,
            num_max_tokens_per_rank=num_max_tokens_per_rank, num_sms=num_sms, num_recv_tokens=num_recv,
            num_expanded_tokens=num_expanded, num_recv_tokens_per_expert_list=aligned_list,
            recv_src_metadata=recv_src_metadata, num_tokens=num_tokens, num_topk=K, hidden=hidden, kind=kind,
            buffer_id=id(self), do_cpu_sync=do_cpu_sync and not cached or (cached and handle.do_cpu_sync),
            num_ranks=R, workspace=workspace, workspace_ptr=ws_ptr, offsets=offsets, topk_idx=user_topk,
            psum_expert=psum_expert)
        event = self._finish(kind, current, comm, async_with_compute_stream,
                             (x, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats, recv_x, recv_sf,
                              recv_topk_idx, recv_topk_weights, recv_src_metadata, workspace))
        out_x = (recv_x, recv_sf) if fp8 else recv_x
        return out_x, recv_topk_idx, recv_topk_weights, new_handle, event

    # ---- combine -------------------------------------------------------------------------------------------------
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
            num_sms: SMs that send (0: the dispatch's); the SMs they leave (as many as the reduction can use)
                reduce what arrives, in the same launch.
            previous_event, async_with_compute_stream, allocate_on_comm_stream: as in `dispatch`.

        Returns:
            `(combined_x [num_tokens, hidden] bfloat16, combined_topk_weights [num_tokens, num_topk] float32 or None,
            event)`.
        """
        self.check_usable()
        del num_qps, previous_event_before_epilogue
        if not isinstance(handle, EPHandle):
            raise TypeError(f'handle must be an EPHandle, got {type(handle).__name__}')
        if handle.buffer_id != id(self):
            raise ValueError('handle was made by another buffer; use the buffer that dispatched it')
        xi = checks.info(x, 'x', self.device)
        kind = handle.kind
        checks.check_same_kind(kind, xi, 'x')
        checks.check_dtype(xi, 'x', 'bfloat16')
        hidden = handle.hidden if xi.ndim != 2 else xi.shape[1]
        checks.check_shape(xi, 'x', (handle.num_rows, hidden))
        checks.check_contiguous(xi, 'x')
        if hidden % 8 != 0:
            raise ValueError(f'x: hidden must be a multiple of 8 for combine, got {hidden}')
        if xi.ptr % 16 != 0:
            raise ValueError('x must start at a 16-byte aligned address')
        K, N, R = handle.num_topk, handle.num_tokens, self.num_scaleup_ranks
        lay = self._layout
        local_reduce = not (handle.do_expand and not self.allow_multiple_reduction)
        num_slots = layout.num_combine_slots(R, K, local_reduce)
        if N * num_slots * layout.combine_slot_bytes(hidden, K) > lay.combine_recv_bytes or \
                handle.num_max_tokens_per_rank * num_slots * layout.combine_slot_bytes(hidden, K) > \
                lay.combine_recv_bytes:
            raise ValueError(f'buffer too small for a combine with hidden={hidden}, num_topk={K}')
        if topk_weights is not None:
            wi = checks.info(topk_weights, 'topk_weights', self.device)
            checks.check_same_kind(kind, wi, 'topk_weights')
            checks.check_dtype(wi, 'topk_weights', 'float32')
            checks.check_shape(wi, 'topk_weights', (handle.num_rows,) if handle.do_expand else (handle.num_rows, K))
            checks.check_contiguous(wi, 'topk_weights')
        biases = _bias_list(bias)
        for j, b in enumerate(biases):
            bi = checks.info(b, f'bias[{j}]', self.device)
            checks.check_same_kind(kind, bi, f'bias[{j}]')
            checks.check_dtype(bi, f'bias[{j}]', 'bfloat16')
            checks.check_shape(bi, f'bias[{j}]', (N, hidden))
            checks.check_contiguous(bi, f'bias[{j}]')
        checks.check_int('num_sms', num_sms, 0)
        num_sms = min(num_sms or handle.num_sms, self.num_device_sms)
        kernels = self._get_kernels(K)
        chunk_stride = layout.ceil_div(handle.num_max_tokens_per_rank, COMBINE_CHUNK_ROWS)
        if R * chunk_stride * 4 > COMBINE_CHUNK_SIGNAL_BYTES:
            raise ValueError(f'num_max_tokens_per_rank={handle.num_max_tokens_per_rank} is too large for combine '
                             f'(at most {COMBINE_CHUNK_SIGNAL_BYTES // 4 // R * COMBINE_CHUNK_ROWS} with {R} ranks)')

        current, comm, alloc_stream = self._streams(interop.current_stream(x), previous_event,
                                                    allocate_on_comm_stream)
        alloc = interop.Allocator(kind)
        common = (self.sym.peer_bases_ptr, self.sym.local_idx)
        err = (self.host_mapped.ptr, self.timeout_ns)
        combined_x = alloc.empty((N, hidden), 'bfloat16', alloc_stream)
        combined_w = alloc.empty((N, K), 'float32', alloc_stream) if topk_weights is not None else None
        # One launch: num_sms blocks send, the other SMs reduce as the senders' chunks arrive (one block per SM, all
        # co-resident).
        num_send = min(num_sms, self.num_device_sms - 1)
        num_reduce = max(1, min(self.num_device_sms - num_send, epilogue_blocks(N, 2 * hidden, self.num_device_sms)))
        kernels.combine[local_reduce].launch(num_send + num_reduce, 512, (
            xi.ptr, hidden, _ptr(topk_weights), int(handle.do_expand), handle.recv_src_metadata, handle.ptr(2),
            handle.ptr(0), handle.topk_idx_ptr, N, handle.num_experts, handle.num_max_tokens_per_rank, num_slots,
            biases[0] if biases else 0, biases[1] if len(biases) > 1 else 0, combined_x, _ptr(combined_w),
            int(topk_weights is not None), num_send, COMBINE_CHUNK_ROWS, chunk_stride, *common,
            lay.combine_recv_offset, *err), stream=comm)
        event = self._finish(kind, current, comm, async_with_compute_stream,
                             (x, topk_weights, *biases, combined_x, combined_w, handle.recv_src_metadata,
                              handle.workspace, handle._topk_idx))
        return combined_x, combined_w, event


class EPBuffer(ElasticBuffer):
    """DeepEP V2.5's name for the EP buffer (same machinery as `ElasticBuffer`)."""


def smem_bytes(num_experts: int, num_ranks: int) -> int:
    """Dynamic shared memory of the notify kernel: per-warp counts, block bases and totals per key."""
    return (NOTIFY_THREADS // 32 + 2) * (num_experts + num_ranks) * 4


def epilogue_blocks(num_rows: int, row_bytes: int, num_device_sms: int) -> int:
    """Blocks (16 warps each) of a receive epilogue: a warp per row segment of up to 1 KiB (two 16-byte loads per
    lane), at most one block per SM. Decode-size calls get enough warps to split rows instead of walking them."""
    segments = max(1, layout.ceil_div(row_bytes, 1024))
    return min(num_device_sms, max(1, layout.ceil_div(num_rows * segments, 16)))


def worst_expanded_rows(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_local_experts: int,
                        expert_alignment: int) -> int:
    """Rows of an expanded output without a CPU sync: every (token, local expert) pair plus alignment gaps."""
    pairs = num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts)
    return layout.align(pairs + (expert_alignment - 1) * num_local_experts, expert_alignment)


def _psum_expert_from_layout(recv_layout, R: int, L: int, alignment: int, do_expand: bool, kind: str, stream):
    """psum_num_recv_tokens_per_expert from the layout blob (for a cached dispatch in the other mode)."""
    counts = recv_layout[R:R + L]
    if kind == 'torch':
        import torch
        with torch.cuda.stream(interop.torch_stream(stream.ptr)):
            aligned = (counts + alignment - 1) // alignment * alignment
            return (recv_layout[R + L:R + 2 * L] + counts) if do_expand else torch.cumsum(aligned, 0).to(torch.int32)
    import cupy
    with stream:
        aligned = (counts + alignment - 1) // alignment * alignment
        return (recv_layout[R + L:R + 2 * L] + counts) if do_expand else cupy.cumsum(aligned).astype(np.int32)


def _ptr(x) -> Any:
    """An array for a kernel pointer argument, or 0 (null) for None."""
    return 0 if x is None else x
