"""EP dispatch and combine inside one scale-up (NVLink) domain: the launch path (the checks and sizes are plan.py).

Per dispatch, on the buffer's communication stream:
  notify (layout of this rank's tokens + count exchange, ~µs) → send (tokens straight into their slots at every
  destination over NVLink) → [CPU waits for the counts if `do_cpu_sync`, allocates exact outputs] → receive epilogue
  (slots → user tensors). The send kernel does not depend on the output sizes, so the GPU keeps sending while the
  host waits. Combine: one launch whose sending blocks write partial rows into slots at each token's origin, chunk
  by chunk, while its reducing blocks sum every token once its chunks are released (fixed FP32 order).
See kernels_cu/ep_*.cu for the protocols.
"""

from typing import Any, Dict, Optional

import numpy as np

from ...runtime import interop, workspace
from ...runtime.host_range import HostRange
from ...runtime.polling import wait_until
from ...runtime.sizes import ceil_div
from . import plan as ep_plan
from .handle import EPHandle, workspace_layout
from .kernels import (
    COMBINE_CHUNK_ROWS,
    COMBINE_THREADS,
    HOST_MAX_TOKENS_WORD,
    NOTIFY_THREADS,
    RECV_THREADS,
    SEND_THREADS,
    EPKernels,
    topk_bucket,
)
from .layout import NUM_MAX_LOCAL_EXPERTS, NUM_MAX_TOPK  # noqa: F401 (NUM_MAX_LOCAL_EXPERTS: tests read it here)
from .legacy import LegacyLayout

HOST_COUNTS_OFFSET = workspace.HOST_EP_COUNTS.offset    # the dispatch counts in the buffer's host-mapped memory
HOST_RANGE_OFFSET = workspace.HOST_EP_RANGE.offset      # the top-k range check's [seq, lo, hi] (int64)
DATA_REGION_OWNER = 'EP dispatch/combine'


class EP:
    """The EP feature of one buffer: its regions in the data region, its kernels (per top-k bucket), the host-mapped
    counts of CPU-sync dispatches and the top-k range check.

    Args:
        buf: the buffer (a `BufferBase`; held weakly by the caller's choice, see `ElasticBuffer`).
        num_max_tokens_per_rank, hidden, num_topk: the buffer's MoE settings (0: unknown); with M and hidden the
            regions are laid out (and the data region claimed) now, with num_topk its kernels are compiled now.
        allow_multiple_reduction, prefer_overlap_with_compute: as `ElasticBuffer`'s.
        nvlink_gbs: NVLink bandwidth for the SM policy.
    """

    def __init__(self, buf, num_max_tokens_per_rank: int, hidden: int, num_topk: int, allow_multiple_reduction: bool,
                 prefer_overlap_with_compute: bool, nvlink_gbs: float):
        self._buf = buf
        self.settings = ep_plan.EPSettings(
            device=buf.device, num_ranks=buf.num_scaleup_ranks, rank=buf.sym.local_idx, owner_id=id(self),
            num_max_tokens_per_rank=num_max_tokens_per_rank, num_topk=num_topk, num_bytes=buf.num_bytes,
            data_offset=buf.data_offset, sym_num_bytes=buf.data_offset + buf.num_bytes,      # end of the data region
            num_device_sms=buf.num_device_sms,
            allow_multiple_reduction=allow_multiple_reduction,
            prefer_overlap_with_compute=prefer_overlap_with_compute, nvlink_gbs=nvlink_gbs)
        self.layout = None
        self._kernels: Dict[int, EPKernels] = {}
        self._host_seq = 0
        # Fixed for the buffer's life: kept here so that the hot path does not go through the buffer's proxy.
        self._sym, self._order, self._host_ptr = buf.sym, buf.stream_order, buf.host_mapped.ptr
        self.host_counts = buf.host_mapped.view('int32', HOST_MAX_TOKENS_WORD + 1, HOST_COUNTS_OFFSET)
        self._topk_range = HostRange(buf.host_mapped, HOST_RANGE_OFFSET)
        if num_max_tokens_per_rank and hidden:
            buf.claim_data_region(DATA_REGION_OWNER)
            self.layout = ep_plan.layout_for(self.settings, num_max_tokens_per_rank, hidden, num_topk or NUM_MAX_TOPK)
        if num_topk:
            self.kernels(num_topk)      # compile now, never inside a timed or collective region

    def kernels(self, num_topk: int) -> EPKernels:
        """The kernels for a top-k of `num_topk` (its bucket's; loaded on first use)."""
        bucket = topk_bucket(num_topk)
        k = self._kernels.get(bucket)
        if k is None:
            k = self._kernels[bucket] = EPKernels(self.settings.num_ranks, bucket)
        return k

    def destroy(self) -> None:
        """Forget the layout and kernels (the buffer frees the memory)."""
        self.layout = None
        self._kernels = {}

    # ---- dispatch ------------------------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: Optional[EPHandle] = None, do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False, num_worst_tokens: int = 0,
                 allow_previous_event_alone: bool = False, legacy: Optional[LegacyLayout] = None):
        """`ElasticBuffer.dispatch` (see there). The DeepEP V1 adapter's options (`num_worst_tokens`,
        `allow_previous_event_alone`, `legacy`; their defaults keep V2's behaviour): see `plan.plan_dispatch`."""
        buf = self._buf
        buf.check_usable()
        del num_qps, previous_event_before_epilogue     # NVLink-only build: no QPs, single epilogue event
        current = interop.current_stream(x[0] if isinstance(x, (tuple, list)) and x else x)
        p = ep_plan.plan_dispatch(
            self.settings, self.layout, x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
            num_max_tokens_per_rank, expert_alignment, num_sms, previous_event, allocate_on_comm_stream, handle,
            do_handle_copy, do_cpu_sync, do_expand, do_zero_padding, use_tma_aligned_col_major_sf,
            lambda ti: self._start_range(ti, current), num_worst_tokens, allow_previous_event_alone, legacy)
        if p.new_layout:
            buf.claim_data_region(DATA_REGION_OWNER)
            self.layout = p.layout
        return self._launch_dispatch(p, current, async_with_compute_stream, allocate_on_comm_stream)

    def _start_range(self, ti, stream):
        """Start reading topk_idx's (min, max) back: one small kernel on `stream` (the one that made topk_idx) writing
        host-mapped memory (`HostRange`); returns the function that waits for them."""
        buf = self._buf
        return self._topk_range.start(self.kernels(ti.shape[1]).topk_range, ti.ptr, ti.numel, stream,
                                      buf.num_cpu_timeout_secs, f'dispatch on rank {buf.rank_idx} (topk_idx)')

    def _launch_dispatch(self, p: ep_plan.DispatchPlan, current, async_with_compute_stream: bool,
                         allocate_on_comm_stream: bool):
        buf, lay, s = self._buf, p.layout, self.settings
        kernels = self.kernels(p.num_topk)
        R, K, L = s.num_ranks, p.num_topk, p.num_local_experts
        sym = self._sym
        comm = self._order.begin(current, p.previous_event)
        alloc_stream = comm if allocate_on_comm_stream else None     # None: allocate on the current stream
        alloc = interop.Allocator(p.kind)
        # The parameters every EP kernel ends with (passed by name, literally: a `**dict` would take CPython's slow
        # generic call path).
        peer_bases, rank, error_record, timeout_ns = sym.peer_bases_ptr, sym.local_idx, self._host_ptr, buf.timeout_ns
        if p.cached:
            h = p.handle
            ws, ws_ptr, offsets, user_topk, topk_ptr = h.workspace, h.workspace_ptr, h.offsets, h._topk_idx, \
                h.topk_idx_ptr
        else:
            # One allocation for the handle's small arrays (see EPHandle); notify fills it, copy of topk_idx included.
            words, offsets = workspace_layout(p.num_tokens, R, K, L, p.do_handle_copy)
            ws = alloc.empty((words,), 'int32', alloc_stream)
            ws_ptr = ws.data_ptr() if p.kind == 'torch' else ws.data.ptr
            user_topk = None if p.do_handle_copy else p.topk_idx
            topk_ptr = p.ti.ptr
            if p.do_cpu_sync:
                self._host_seq = (self._host_seq % 0x7FFFFFFF) + 1
                self.host_counts[0] = 0
            lg = p.legacy
            reported, expert_counts, C, cpm, rcpm, rpm = p.num_tokens, 0, 0, 0, 0, 0
            if lg is not None:      # V1's matrices: one allocation, written by notify
                C = lg.num_channels
                mats = alloc.empty((R * R + 2 * R * C,), 'int32', alloc_stream)
                rpm = lg.rank_prefix_matrix = mats[:R * R].reshape(R, R)
                cpm = lg.channel_prefix_matrix = mats[R * R:R * R + R * C].reshape(R, C)
                rcpm = lg.recv_channel_prefix_matrix = mats[R * R + R * C:].reshape(R, C)
                cpm, rcpm = (cpm, rcpm) if C else (0, 0)
                reported = p.num_tokens if lg.reported_num_tokens < 0 else lg.reported_num_tokens
                expert_counts = _ptr(lg.expert_counts)
            grid = max(1, ceil_div(p.num_tokens, NOTIFY_THREADS))
            # Cooperative for several blocks only (one block has no grid barrier to wait in).
            kernels.notify.launch(
                grid, NOTIFY_THREADS, stream=comm, shared_mem=p.notify_smem_bytes, cooperative=grid > 1,
                topk_idx=topk_ptr, num_tokens=p.num_tokens, num_topk=K, num_experts=p.num_experts,
                num_max_tokens_per_rank=p.num_max_tokens_per_rank, expert_alignment=p.expert_alignment,
                peer_bases=peer_bases, rank=rank, error_record=error_record, timeout_ns=timeout_ns,
                scratch=sym.base + lay.scratch_offset, send_pos=ws_ptr + 4 * offsets[0],
                send_expert_pos=ws_ptr + 4 * offsets[1], recv_layout=ws_ptr + 4 * offsets[2],
                psum_recv_per_expert=ws_ptr + 4 * offsets[3], do_expand=int(p.do_expand),
                cumulative_stats=_ptr(p.stats),
                host_counts=self._host_ptr + HOST_COUNTS_OFFSET if p.do_cpu_sync else 0, host_seq=self._host_seq,
                topk_copy=ws_ptr + 4 * offsets[4] if p.do_handle_copy else 0, reported_num_tokens=reported,
                expert_counts=expert_counts, num_channels=C, channel_prefix_matrix=cpm,
                recv_channel_prefix_matrix=rcpm, rank_prefix_matrix=rpm)
        xi, sfi = p.xi, p.sfi
        kernels.dispatch_send.launch(
            p.num_sms, SEND_THREADS, stream=comm, x=xi.ptr, x_row_bytes=xi.strides[0] * xi.itemsize,
            hidden_bytes=p.hidden_bytes, sf=sfi.ptr if sfi else 0, sf_stride_token=sfi.strides[0] if sfi else 0,
            sf_stride_col=sfi.strides[1] if sfi else 0, num_sf=p.num_sf, topk_idx=topk_ptr,
            topk_weights=_ptr(p.topk_weights), send_pos=ws_ptr + 4 * offsets[0],
            send_expert_pos=ws_ptr + 4 * offsets[1], num_tokens=p.num_tokens, num_topk=K,
            num_max_tokens_per_rank=p.num_max_tokens_per_rank, peer_bases=peer_bases, rank=rank,
            recv_offset=lay.dispatch_recv_offset, error_record=error_record, timeout_ns=timeout_ns)

        counts = self._wait_host_counts(self._host_seq, L) if p.do_cpu_sync else ep_plan.dispatch_counts(p)
        out = ep_plan.dispatch_outputs(p, *counts, s.num_device_sms)
        lg = p.legacy
        recv_src_idx = None
        if lg is not None:
            if p.do_cpu_sync:
                lg.max_num_tokens = int(self.host_counts[HOST_MAX_TOKENS_WORD])
            recv_src_idx = lg.recv_src_idx = alloc.empty((out.num_recv,), 'int32', alloc_stream)
        recv_x = alloc.empty((out.num_out_rows, p.hidden), 'float8_e4m3fn' if p.fp8 else 'bfloat16', alloc_stream)
        recv_sf = None
        if out.sf_shape is not None:
            storage = alloc.empty(out.sf_shape, sfi.dtype, alloc_stream)
            if p.use_tma_aligned_col_major_sf:
                recv_sf = storage.t()[:out.num_out_rows] if p.kind == 'torch' else storage.T[:out.num_out_rows]
            else:
                recv_sf = storage
        recv_topk_idx = None if out.topk_idx_shape is None else alloc.empty(out.topk_idx_shape, 'int64', alloc_stream)
        recv_topk_weights = None
        if out.topk_weights_shape is not None:
            recv_topk_weights = alloc.empty(out.topk_weights_shape, 'float32', alloc_stream)
        recv_src_metadata = alloc.empty(out.metadata_shape, 'int32', alloc_stream)
        # The epilogue is a local copy, a warp per row segment of up to 1 KiB (see RowSegments in common/ep.cuh).
        kernels.dispatch_recv.launch(
            out.epilogue_blocks, RECV_THREADS, stream=comm, x=xi.ptr, x_row_bytes=xi.strides[0] * xi.itemsize,
            hidden_bytes=p.hidden_bytes, num_sf=p.num_sf, num_topk=K, num_experts=p.num_experts,
            num_max_tokens_per_rank=p.num_max_tokens_per_rank, recv_layout=ws_ptr + 4 * offsets[2],
            do_expand=int(p.do_expand), do_zero_padding=int(p.do_zero_padding), num_out_rows=out.num_out_rows,
            num_meta_rows=out.num_recv, recv_x=recv_x, recv_sf=_ptr(recv_sf), recv_sf_stride_row=out.sf_strides[0],
            recv_sf_stride_col=out.sf_strides[1], recv_topk_idx=_ptr(recv_topk_idx),
            recv_topk_weights=_ptr(recv_topk_weights), recv_src_metadata=recv_src_metadata,
            recv_src_idx=_ptr(recv_src_idx), peer_bases=peer_bases,
            rank=rank, recv_offset=lay.dispatch_recv_offset, error_record=error_record, timeout_ns=timeout_ns)

        psum_expert = None
        if p.cached and p.do_expand != p.handle.do_expand:
            psum_expert = _psum_expert_from_layout(p.handle.recv_layout, R, L, p.expert_alignment, p.do_expand, p.kind,
                                                   comm)
        elif p.cached:
            psum_expert = p.handle._psum_expert
        new_handle = EPHandle(
            do_expand=p.do_expand, num_experts=p.num_experts, expert_alignment=p.expert_alignment,
            num_max_tokens_per_rank=p.num_max_tokens_per_rank, num_sms=p.num_sms, num_recv_tokens=out.num_recv,
            num_expanded_tokens=out.num_expanded, num_recv_tokens_per_expert_list=out.aligned_counts,
            recv_src_metadata=recv_src_metadata, num_tokens=p.num_tokens, num_topk=K, hidden=p.hidden, kind=p.kind,
            buffer_id=s.owner_id, do_cpu_sync=p.do_cpu_sync or (p.cached and p.handle.do_cpu_sync), num_ranks=R,
            workspace=ws, workspace_ptr=ws_ptr, offsets=offsets, topk_idx=user_topk, psum_expert=psum_expert)
        keep = (p.x, p.sf, p.topk_idx, p.topk_weights, p.stats, recv_x, recv_sf, recv_topk_idx, recv_topk_weights,
                recv_src_metadata, ws)
        if lg is not None:
            keep += (lg.expert_counts, lg.rank_prefix_matrix, recv_src_idx)    # the matrices share one allocation
        event = self._order.finish(p.kind, current, async_with_compute_stream, keep)
        out_x = (recv_x, recv_sf) if p.fp8 else recv_x
        return out_x, recv_topk_idx, recv_topk_weights, new_handle, event

    def _wait_host_counts(self, seq: int, num_local_experts: int):
        """Poll the host-mapped counts written by the notify kernel (bounded by num_cpu_timeout_secs)."""
        buf, host = self._buf, self.host_counts

        def check():
            if int(buf.error_record[0]) != 0:
                buf.synchronize()               # raises the GPU's timeout report

        def timed_out():
            buf.fail('dispatch CPU wait timed out')
            raise TimeoutError(f'deepep_cupy rank {buf.rank_idx}: Dispatch CPU wait for the receive counts timed out '
                               f'after {buf.num_cpu_timeout_secs:g} s')
        wait_until(lambda: int(host[0]) == seq, buf.num_cpu_timeout_secs, timed_out, check)
        return int(host[1]), int(host[2]), [int(v) for v in host[3:3 + num_local_experts]]

    # ---- combine -------------------------------------------------------------------------------------------------
    def combine(self, x, handle: EPHandle, topk_weights=None, bias=None, num_sms: int = 0, num_qps: int = 0,
                previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False, weights_over_ranks: bool = False,
                allow_previous_event_alone: bool = False):
        """`ElasticBuffer.combine` (see there). The DeepEP V1 adapter's options (`weights_over_ranks`,
        `allow_previous_event_alone`; their defaults keep V2's behaviour): see `plan.plan_combine`."""
        buf = self._buf
        buf.check_usable()
        del num_qps, previous_event_before_epilogue
        p = ep_plan.plan_combine(self.settings, self.layout, x, handle, topk_weights, bias, num_sms, previous_event,
                                 allocate_on_comm_stream, weights_over_ranks, allow_previous_event_alone)
        h, N, K, hidden, lay = p.handle, p.handle.num_tokens, p.handle.num_topk, p.hidden, self.layout
        kernels = self.kernels(K)
        current = interop.current_stream(x)
        comm = self._order.begin(current, p.previous_event)
        alloc_stream = comm if allocate_on_comm_stream else None
        alloc = interop.Allocator(p.kind)
        combined_x = alloc.empty((N, hidden), 'bfloat16', alloc_stream)
        combined_w = alloc.empty((N, K), 'float32', alloc_stream) if topk_weights is not None else None
        kernels.combine[p.local_reduce].launch(
            p.num_send_blocks + p.num_reduce_blocks, COMBINE_THREADS, stream=comm, x=p.xi.ptr, hidden=hidden,
            topk_weights=_ptr(topk_weights), do_expand=int(h.do_expand), recv_src_metadata=h.recv_src_metadata,
            recv_layout=h.ptr(2), send_pos=h.ptr(0), topk_idx=h.topk_idx_ptr, num_tokens=N, num_topk=K,
            num_experts=h.num_experts, num_max_tokens_per_rank=h.num_max_tokens_per_rank, num_slots=p.num_slots,
            bias0=p.biases[0] if p.biases else 0, bias1=p.biases[1] if len(p.biases) > 1 else 0,
            combined_x=combined_x, combined_topk_weights=_ptr(combined_w), with_weights=int(topk_weights is not None),
            weights_over_ranks=int(p.weights_over_ranks), num_send_blocks=p.num_send_blocks,
            chunk_rows=COMBINE_CHUNK_ROWS, chunk_stride=p.chunk_stride,
            peer_bases=self._sym.peer_bases_ptr, rank=self._sym.local_idx, combine_offset=lay.combine_recv_offset,
            error_record=self._host_ptr, timeout_ns=buf.timeout_ns)
        event = self._order.finish(p.kind, current, async_with_compute_stream,
                                   (x, topk_weights, *p.biases, combined_x, combined_w, h.recv_src_metadata,
                                    h.workspace, h._topk_idx))
        return combined_x, combined_w, event


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
