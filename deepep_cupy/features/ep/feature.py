"""EP dispatch and combine inside one scale-up (NVLink) domain: the launch path (the checks and sizes are plan.py).

Per dispatch, on the buffer's communication stream:
  notify (layout of this rank's tokens + count exchange, ~µs) → one dispatch launch whose senders write tokens straight
  into their slots at every destination over NVLink, chunk by chunk, while its receivers copy each chunk into the
  user's tensors as soon as it is released (own tokens straight from x). With `do_cpu_sync` the send is a launch of its
  own before the CPU waits for the counts and allocates exact outputs (the GPU keeps sending meanwhile), the receive
  one after. Calls are bound per signature (bound.py). Combine: one launch whose sending blocks write partial rows
  into slots at each token's origin, chunk by chunk, while its reducing blocks sum every token once its chunks are
  released (fixed FP32 order).
See kernels_cu/ep_*.cu for the protocols.
"""

import ctypes
import dataclasses
import weakref
from typing import Any, Dict, Optional

from ...constants import NUM_MAX_TOPK, topk_bucket
from ...runtime import interop, workspace
from ...runtime.event import as_event_handle
from ...runtime.host_range import HostRange
from ...runtime.interop import meta
from ...runtime.polling import SPIN_POLLS, wait_until
from . import plan as ep_plan
from .bound import BoundCombine, BoundDispatch
from .handle import EPHandle
from .kernels import HOST_MAX_TOKENS_WORD, EPKernels
from .legacy import LegacyLayout

HOST_COUNTS_OFFSET = workspace.HOST_EP_COUNTS.offset    # the dispatch counts in the buffer's host-mapped memory
HOST_RANGE_OFFSET = workspace.HOST_EP_RANGE.offset      # the top-k range check's [seq, lo, hi] (int64)
DATA_REGION_OWNER = 'EP dispatch/combine'
MAX_BOUND_CALLS = 256       # call signatures remembered (bound.py); more are forgotten all at once

_live_features: 'weakref.WeakSet[EP]' = weakref.WeakSet()     # every EP feature alive (`set_default_num_sms`)
_default_num_sms = 0


def set_default_num_sms(num_sms: int) -> None:
    """The SMs of every dispatch given `num_sms=0` without a handle, on every buffer, built or to be built (0: the SM
    policy again); the bound calls of live buffers are forgotten, so the next call of each signature plans anew."""
    global _default_num_sms
    _default_num_sms = num_sms
    for feature in list(_live_features):
        feature.settings = dataclasses.replace(feature.settings, default_num_sms=num_sms)
        feature._bound = {}


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
            prefer_overlap_with_compute=prefer_overlap_with_compute, nvlink_gbs=nvlink_gbs,
            default_num_sms=_default_num_sms)
        _live_features.add(self)
        self.layout = None
        self._kernels: Dict[int, EPKernels] = {}
        self._range_kernels: Dict[int, Any] = {}     # num_topk -> its bucket's range kernel (`_start_range`)
        self._host_seq = 0
        # Fixed for the buffer's life: kept here so that the hot path does not go through the buffer's proxy.
        self._sym, self._order, self._host_ptr = buf.sym, buf.stream_order, buf.host_mapped.ptr
        self.host_counts = buf.host_mapped.view('int32', HOST_MAX_TOKENS_WORD + 1, HOST_COUNTS_OFFSET)
        # (its first three words, seq, num_recv, num_expanded, through ctypes: reads give Python ints, where numpy
        # makes scalar objects; the poll and the sizes of every CPU-sync dispatch read them)
        self._host_record = (ctypes.c_int32 * 3).from_buffer(self.host_counts)
        self.host_counts_ptr = self._host_ptr + HOST_COUNTS_OFFSET
        self._counts_views: Dict[int, Any] = {}     # num_local_experts -> its counts' view (`_wait_host_counts`)
        self._error_state = buf.error_record        # word 0 != 0: a kernel reported a timeout
        self._topk_range = HostRange(buf.host_mapped, HOST_RANGE_OFFSET)
        self._range_what = f'dispatch on rank {buf.rank_idx} (topk_idx)'
        self._bound: Dict[tuple, object] = {}       # call signature -> BoundDispatch / BoundCombine
        # The dispatch kernels (the buffer's design knobs, envs.DesignKnobs: read when it was made and compared across
        # its ranks; every dispatch of a buffer uses one protocol, as every rank must).
        design = buf.design
        self.dispatch_overlap = design.ep_dispatch_overlap
        # (None: unset, the fused kernel where its receivers count for themselves: `BoundDispatch`)
        self.fused_notify = design.ep_fused_notify
        self.fused_cooperative = design.ep_fused_cooperative
        self.combine_cap_all_sms = design.combine_cap_all_sms      # num_sms caps a combine's reducers too
        # Hybrid P2 (features/hybrid/feature.py) sets it around one dispatch: (counter address, rows modulo, SMs to
        # leave free); the dispatch kernel then waits for each input row to be ready (kernels_cu/ep_dispatch.cu).
        self.ready_guard = None
        self._carvers: Dict[str, interop.Carver] = {}
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
            if self.fused_notify:
                k.fused_dispatch()      # compiled with the others, not inside the first (maybe captured) dispatch
        return k

    def destroy(self) -> None:
        """Forget the layout, kernels and bound calls (the buffer frees the memory)."""
        self.layout = None
        self._kernels = {}
        self._range_kernels = {}
        self._bound = {}

    # ---- helpers of the bound calls (bound.py) ---------------------------------------------------------------------
    def _check_usable(self) -> None:
        """The buffer's `check_usable`, reached only when something is wrong (its three conditions read here first:
        the call through the buffer's proxy costs ~1 us of a dispatch)."""
        buf = self._buf
        if buf._destroyed or buf._failed is not None or self._error_state[0]:
            buf.check_usable()

    def carver(self, kind: str) -> interop.Carver:
        """The allocator of this buffer's device for arrays of `kind`."""
        c = self._carvers.get(kind)
        if c is None:
            c = self._carvers[kind] = interop.Carver(kind, self.settings.device)
        return c

    def _next_host_seq(self) -> int:
        """The sequence number of the next CPU-sync dispatch's host-mapped counts (the previous ones are cleared)."""
        self._host_seq = seq = (self._host_seq % 0x7FFFFFFF) + 1
        self._host_record[0] = 0
        return seq

    def _claim(self, bound: BoundDispatch) -> None:
        """The first dispatch that laid the EP regions out passed every check: claim the data region, keep the layout
        (and the bound dispatch, which waited for this to be cached)."""
        self._buf.claim_data_region(DATA_REGION_OWNER)
        self.layout = bound.p.layout
        bound.claim = False
        if bound.key is not None:
            self._remember(bound.key, bound)

    def _remember(self, key, bound) -> None:
        if len(self._bound) >= MAX_BOUND_CALLS:
            self._bound.clear()
        self._bound[key] = bound

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
        `allow_previous_event_alone`, `legacy`; their defaults keep V2's behaviour): see `plan.plan_dispatch`. They are
        part of the call signature like the others (a `LegacyLayout` by its inputs: channels, reported count and the
        expert counts' signature), so V1 calls are bound too."""
        # (num_qps, previous_event_before_epilogue: unused in this NVLink-only build: no QPs, one epilogue event)
        buf = self._buf     # (`_check_usable` inline: its three conditions, the full check only when one holds)
        if buf._destroyed or buf._failed is not None or self._error_state[0]:
            buf.check_usable()
        tensor = interop.TORCH_TENSOR[0]
        if type(x) is tensor:               # `interop.meta` of a plain torch tensor, inline (two calls fewer)
            fp8, xs, xp, ss, sp = False, (x.shape, x.stride(), x.dtype, x.get_device()), x.data_ptr(), None, 0
        else:
            fp8 = type(x) is tuple or type(x) is list
            if fp8 and len(x) == 2:
                xa, sf = x
                if type(xa) is tensor and type(sf) is tensor:       # (`interop.meta` inline, as above)
                    xs, xp = (xa.shape, xa.stride(), xa.dtype, xa.get_device()), xa.data_ptr()
                    ss, sp = (sf.shape, sf.stride(), sf.dtype, sf.get_device()), sf.data_ptr()
                else:
                    (xs, xp), (ss, sp) = meta(xa), meta(sf)
            else:
                (xs, xp), ss, sp = meta(x), None, 0
        if topk_idx is None:                # (a cached dispatch's: `meta(None)` inline)
            ts, tp = None, 0
        elif type(topk_idx) is tensor:
            ts, tp = (topk_idx.shape, topk_idx.stride(), topk_idx.dtype, topk_idx.get_device()), topk_idx.data_ptr()
        else:
            ts, tp = meta(topk_idx)
        if topk_weights is None:
            ws, wp = None, 0
        elif type(topk_weights) is tensor:
            ws, wp = ((topk_weights.shape, topk_weights.stride(), topk_weights.dtype, topk_weights.get_device()),
                      topk_weights.data_ptr())
        else:
            ws, wp = meta(topk_weights)
        if cumulative_local_expert_recv_stats is None:
            cs, cp = None, 0
        else:
            cs, cp = meta(cumulative_local_expert_recv_stats)
        origin = None if handle is None else (handle._origin if type(handle) is EPHandle else False)
        if legacy is None:
            es, v1 = None, None
        elif type(legacy) is LegacyLayout:
            ec = legacy.expert_counts
            es, ecp = (None, 0) if ec is None else meta(ec)
            v1 = (legacy.num_channels, type(legacy.num_channels), legacy.reported_num_tokens,
                  type(legacy.reported_num_tokens), es)
        else:
            es, v1 = object(), False        # plan.py raises TypeError
        # (the scalars' types too: 1, 1.0 and True are equal keys, and plan.py rejects all but int; `__class__` is
        # `type()` for them, one global lookup and call fewer)
        key = (fp8, xs, ss, ts, ws, cs, origin, num_experts, num_experts.__class__, num_max_tokens_per_rank,
               num_max_tokens_per_rank.__class__, expert_alignment, expert_alignment.__class__, num_sms,
               num_sms.__class__, previous_event is None, allocate_on_comm_stream, async_with_compute_stream,
               do_handle_copy, do_cpu_sync, do_expand, do_zero_padding, use_tma_aligned_col_major_sf, num_worst_tokens,
               num_worst_tokens.__class__, allow_previous_event_alone, v1)
        b = self._bound.get(key)
        if b is None:       # a signature met for the first time
            b = self._bind_dispatch(
                key, bool((handle is None or origin) and _cacheable(xs, ss, ts, ws, cs, es)), async_with_compute_stream,
                x, topk_idx=topk_idx, topk_weights=topk_weights, stats=cumulative_local_expert_recv_stats,
                num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank,
                expert_alignment=expert_alignment, num_sms=num_sms, previous_event=previous_event,
                allocate_on_comm_stream=allocate_on_comm_stream, handle=handle, do_handle_copy=do_handle_copy,
                do_cpu_sync=do_cpu_sync, do_expand=do_expand, do_zero_padding=do_zero_padding,
                use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, num_worst_tokens=num_worst_tokens,
                allow_previous_event_alone=allow_previous_event_alone, legacy=legacy)
        event = None if previous_event is None else as_event_handle(previous_event)
        if legacy is None:      # (`run`: the bound call's path specialised at binding, bound.py)
            return b.run(b, self, x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, handle, event, xp, sp,
                         tp, wp, cp)
        return b.run_v1(b, self, x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, handle, event, xp, sp,
                        tp, wp, cp, legacy, ecp)

    def _bind_dispatch(self, key: tuple, remember: bool, async_with_compute_stream: bool, x,
                       **plan_args) -> BoundDispatch:
        """A dispatch signature's full checks (`plan.plan_dispatch` of `x` and `plan_args`, the call's other
        arguments) and its bound dispatch, remembered under `key` when every part of the key is a signature
        (`remember`; a call that laid the EP regions out: once it claimed the data region, `_claim`)."""
        p = ep_plan.plan_dispatch(self.settings, self.layout, x, start_range=None, **plan_args)
        b = BoundDispatch(self, p, plan_args['allocate_on_comm_stream'], async_with_compute_stream)
        if remember:
            b.key = key
            if not b.claim:
                self._remember(key, b)
        return b

    def _start_range(self, topk_idx, ptr: int, num_values: int, num_topk: int, stream):
        """Start reading topk_idx's (min, max) back: one small kernel on `stream` (the one that made topk_idx) writing
        host-mapped memory (`HostRange`); returns the function that waits for them."""
        kernel = self._range_kernels.get(num_topk)
        if kernel is None:
            kernel = self._range_kernels[num_topk] = self.kernels(num_topk).topk_range
        return self._topk_range.start(kernel, ptr, num_values, stream, self._buf.num_cpu_timeout_secs,
                                      self._range_what)

    def _wait_host_counts(self, seq: int, num_local_experts: int):
        """Poll the host-mapped counts written by the notify kernel (bounded by num_cpu_timeout_secs); returns
        `(num_recv, num_expanded, aligned counts per local expert)`, the last a numpy VIEW of the host-mapped words:
        the caller copies it once the receive is launched (the next CPU-sync dispatch rewrites them), so that nothing
        but two reads lies between the counts' arrival and the receive's launch."""
        record = self._host_record
        polls = SPIN_POLLS
        while record[0] != seq and polls:      # the common case: the counts land within microseconds
            polls -= 1
        if not polls:
            buf = self._buf

            def check():
                if int(buf.error_record[0]) != 0:
                    buf.synchronize()               # raises the GPU's timeout report

            def timed_out():
                buf.fail('dispatch CPU wait timed out')
                raise TimeoutError(f'deepep_cupy rank {buf.rank_idx}: Dispatch CPU wait for the receive counts timed '
                                   f'out after {buf.num_cpu_timeout_secs:g} s')
            wait_until(lambda: record[0] == seq, buf.num_cpu_timeout_secs, timed_out, check)
        view = self._counts_views.get(num_local_experts)
        if view is None:
            view = self._counts_views[num_local_experts] = self.host_counts[3:3 + num_local_experts]
        return record[1], record[2], view

    # ---- combine -------------------------------------------------------------------------------------------------
    def combine(self, x, handle: EPHandle, topk_weights=None, bias=None, num_sms: int = 0, num_qps: int = 0,
                previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False, weights_over_ranks: bool = False,
                allow_previous_event_alone: bool = False):
        """`ElasticBuffer.combine` (see there). The DeepEP V1 adapter's options (`weights_over_ranks`,
        `allow_previous_event_alone`; their defaults keep V2's behaviour): see `plan.plan_combine`; both are part of
        the call signature."""
        self._check_usable()
        del num_qps, previous_event_before_epilogue
        (xs, xp), (ws, wp) = meta(x), meta(topk_weights)
        if bias is None:
            bs, biases, bias_ptrs = None, (), ()
        elif type(bias) is tuple or type(bias) is list:
            metas = [meta(b) for b in bias]
            bs = tuple(m[0] for m in metas) if len(bias) <= 2 else object()
            biases = tuple(b for b in bias if b is not None)
            bias_ptrs = [m[1] for b, m in zip(bias, metas) if b is not None]
        else:
            bs, p0 = meta(bias)
            biases, bias_ptrs = (bias,), (p0,)
        origin = handle._origin if type(handle) is EPHandle else False
        key = (origin, xs, ws, bs, num_sms, type(num_sms), previous_event is None, allocate_on_comm_stream,
               async_with_compute_stream, weights_over_ranks, allow_previous_event_alone)
        b = self._bound.get(key)
        if b is None:
            p = ep_plan.plan_combine(self.settings, self.layout, x, handle, topk_weights=topk_weights, bias=bias,
                                     num_sms=num_sms, previous_event=previous_event,
                                     allocate_on_comm_stream=allocate_on_comm_stream,
                                     weights_over_ranks=weights_over_ranks,
                                     allow_previous_event_alone=allow_previous_event_alone,
                                     cap_all_sms=self.combine_cap_all_sms)
            b = BoundCombine(self, p, allocate_on_comm_stream, async_with_compute_stream)
            if origin and _cacheable(xs, ws) and (bs is None or _cacheable(*bs)):
                self._remember(key, b)
        event = None if previous_event is None else as_event_handle(previous_event)
        return b(self, x, handle, topk_weights, biases, event, xp, wp, bias_ptrs)


def _cacheable(*signatures) -> bool:
    """Whether every signature came from a torch tensor / CuPy array or None (`interop.meta` gives anything else a
    fresh object, which no later call can match)."""
    for s in signatures:
        if type(s) is object:
            return False
    return True
