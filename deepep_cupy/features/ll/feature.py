"""Low-latency (decode) EP engine: DeepEP V1's `low_latency_dispatch` / `low_latency_combine` and their helpers
(masks, clean, zero-copy combine buffer, size hint) on the `ep_ll` kernel family (kernels_cu/ep_ll.cu, where the
protocol is described).

The engine owns a region of a `BufferBase`'s symmetric memory (by default its whole data region). The region's
layout is fixed at construction from maxima (tokens per rank M, hidden H, experts E, top-k K), so that every flag
word only ever holds epochs of its own kind: no call ever needs the buffer cleared. Calls may use any M' <= M,
H' <= H (H' % 128 == 0), E' <= E (E' % R == 0) and K' <= K.

Layering: `LLLayout` (sizes and offsets, pure), `LLPlanner` (argument checks, pure: runs without a GPU),
`LowLatencyEngine` (allocation, streams, launches). A dispatch or combine of a call signature met for the first time
is checked by the planner and bound (bound.py); later calls of it do only their per-call work (bound.py says which).
The V1 `Buffer` holds an engine and forwards
`low_latency_dispatch` / `low_latency_combine` / `get_next_low_latency_combine_buffer` /
`clean_low_latency_buffer` / `low_latency_{update,query,clean}_mask_buffer` / `get_low_latency_rdma_size_hint`.
"""

import sys
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ...runtime import interop
from ...runtime.event import EventHandle, EventOverlap, empty_overlap
from ...runtime.interop import TORCH_TENSOR, meta
from .bound import MAX_BOUND, BoundCombine, BoundDispatch, bind_combine, bind_dispatch, make_hook
from .plan import (  # noqa: F401
    CTL_MASK_WORD,
    PHASE_RECV,
    PHASE_SEND,
    THREADS,
    WAIT_KINDS,
    LLHandle,
    LLPlanner,
    _int_arg,
    combine_smem_bytes,
    dispatch_smem_bytes,
    layout_for_region,
    specs_for,
)

# An `LLHandle` without `LLHandle.__new__`'s keyword dictionary (the bound calls set its attributes)
_new_handle = tuple.__new__
_INT64 = []         # [torch.int64] once a torch call was bound (this module imports no torch)


# ---- engine --------------------------------------------------------------------------------------------------------
def describe_wait(record) -> str:
    """What the failed wait of an error record (int32 [8], see runtime/errors.py) was waiting for."""
    return WAIT_KINDS.get(int(record[6]), f'aux {int(record[6])}')


class ShrinkMaskMethods:
    """DeepEP V1's mask methods of low-latency mode (`enable_shrink`), for the engine inside one domain and for the
    composed mode across domains (v1/internode_ll.py): they need `enable_shrink`, `num_ranks`, `planner` (its
    `_info` / `_expect` checks) and `_masks()` (this rank's `[R]` int32 mask words on the GPU)."""

    def _require_shrink(self, what: str) -> None:
        if not self.enable_shrink:
            raise RuntimeError(f'{what} needs a Buffer built with enable_shrink=True')

    def update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (`mask=True`) or unmask rank `rank_to_mask` on this rank (stream-ordered on the current stream)."""
        self._require_shrink('low_latency_update_mask_buffer')
        rank_to_mask = _int_arg('rank_to_mask', rank_to_mask, 0)
        if rank_to_mask >= self.num_ranks:
            raise ValueError(f'rank_to_mask must be below {self.num_ranks}, got {rank_to_mask}')
        with interop.current_stream():
            self._masks()[rank_to_mask] = 1 if mask else 0

    def query_mask_buffer(self, mask_status) -> None:
        """Copy the mask (1 = masked) into `mask_status` (`[R]` int32 on this GPU), on the current stream."""
        self._require_shrink('low_latency_query_mask_buffer')
        mi = self.planner._info(mask_status, 'mask_status')
        self.planner._expect(mi, 'mask_status', 'int32', (self.num_ranks,), mi.kind)
        with interop.current_stream(mask_status):
            interop.to_cupy(mask_status)[...] = self._masks()

    def clean_mask_buffer(self) -> None:
        """Unmask every rank (on this rank, current stream)."""
        self._require_shrink('low_latency_clean_mask_buffer')
        with interop.current_stream():
            self._masks().fill(0)


class LowLatencyEngine(ShrinkMaskMethods):
    """Low-latency dispatch / combine over a `BufferBase` (one NVLink domain of R <= 8 ranks).

    Args:
        base: the `BufferBase` (symmetric memory, streams, error record, GPU timeout).
        num_max_dispatch_tokens_per_rank, hidden, num_experts: maxima of every later call (the layout's strides).
        num_max_topk: top-k slots reserved per token (default: the largest <= 32 that fits the region).
        enable_shrink: a rank that stays silent past the GPU timeout gets masked (DeepEP's shrink mode) instead of
            failing the buffer; the mask calls need it.
        region_offset, region_bytes: the engine's part of the symmetric buffer (default: the whole data region,
            claimed as 'EP low-latency').
        kernels: preloaded `(dispatch, combine, clean)` kernels (tests); default: compiled and loaded here, never
            inside a call.
    """

    def __init__(self, base, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int,
                 num_max_topk: Optional[int] = None, enable_shrink: bool = False, region_offset: Optional[int] = None,
                 region_bytes: Optional[int] = None, kernels: Optional[Tuple[Any, Any, Any]] = None):
        if getattr(base, 'num_scaleout_ranks', 1) != 1:
            raise ValueError('low-latency mode needs every rank in one NVLink domain (no scale-out ranks); got '
                             f'{base.num_scaleout_ranks} scale-out domains')
        self.base = base
        self.num_ranks = base.num_scaleup_ranks
        self.rank = base.scaleup_rank_idx
        if region_offset is None:
            base.claim_data_region('EP low-latency')
            region_offset, region_bytes = base.data_offset, base.num_bytes
        elif region_bytes is None:
            raise ValueError('region_bytes is required with region_offset')
        self.region_offset, self.region_bytes = int(region_offset), int(region_bytes)
        self.layout = layout_for_region(num_max_dispatch_tokens_per_rank, hidden, self.num_ranks, num_experts,
                                        self.region_bytes, num_max_topk)
        self.enable_shrink = bool(enable_shrink)
        self.planner = LLPlanner(self.layout, self.rank, base.device)
        if kernels is None:
            from ...jit.launch import load_kernels
            loaded = load_kernels(specs_for(self.num_ranks), device=base.device)
            kernels = tuple(loaded[s.name] for s in specs_for(self.num_ranks))
        self._dispatch_kernel, self._combine_kernel, self._clean_kernel = kernels
        self._num_combines = 0           # host count: picks the zero-copy staging half of the next combine
        self._order_events = None
        self._staging_views: Dict[Tuple, Any] = {}
        self._mask_view = None
        # The bound calls by signature (bound.py), and what their per-call path reads without a lookup chain
        self._dispatches: Dict[Tuple, BoundDispatch] = {}
        self._combines: Dict[Tuple, BoundCombine] = {}
        self._id = id(self)
        self._error_word = base.error_record         # word 0 != 0: a kernel reported a timeout
        self._staging_ptrs = (self._staging_ptr(0), self._staging_ptr(1))

    # -- small helpers --
    @property
    def num_max_topk(self) -> int:
        return self.layout.num_max_topk

    def _check_usable(self) -> None:
        try:
            self.base.check_usable()
        except TimeoutError as e:
            raise TimeoutError(f'{e} (low-latency wait for {describe_wait(self.base.error_record)})') from e

    def _common_args(self) -> Dict[str, Any]:
        return dict(peer_bases=self.base.sym.peer_bases_ptr, rank=self.rank, region_offset=self.region_offset,
                    half_bytes=self.layout.half_bytes, shrink=int(self.enable_shrink),
                    error_record=self.base.host_mapped.ptr, timeout_ns=self.base.timeout_ns)

    def _events(self):
        if self._order_events is None:
            import cupy
            self._order_events = (cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True))
        return self._order_events

    def _enter_comm(self, current):
        comm = self.base.comm_stream
        ev = self._events()[0]
        ev.record(current)
        comm.wait_event(ev)
        return comm

    def _leave_comm(self, kind: str, current, comm, async_finish: bool, tensors):
        live = tuple(t for t in tensors if t is not None)
        if async_finish:
            if kind == 'torch':
                s = interop.torch_stream(comm.ptr)
                for t in live:
                    t.record_stream(s)
            return EventOverlap(EventHandle(comm), extra_tensors=live)
        ev = self._events()[1]
        ev.record(comm)
        current.wait_event(ev)
        return empty_overlap()

    # -- dispatch --
    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                 cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, use_fp8: bool = True,
                 round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                 return_recv_hook: bool = False, *, bound_only: bool = False):
        """DeepEP's `low_latency_dispatch`.

        Args:
            x: `[N, H]`, bfloat16, contiguous, N <= num_max_dispatch_tokens_per_rank.
            topk_idx: `[N, K]`, int64, K <= 32; -1 (or any id outside [0, E)) sends nothing. A token's experts must
                be distinct (as DeepEP assumes): repeats beyond a source's M rows per expert are dropped.
            num_max_dispatch_tokens_per_rank: M, the same on every rank; num_experts: E, a multiple of R.
            cumulative_local_expert_recv_stats: `[L]`, int32, += rows received per local expert.
            dispatch_wait_recv_cost_stats: `[R]`, int64, += clock cycles this rank's receive warps spent waiting for
                each source (its token counts, in block 0, and its messages, in every warp).
            use_fp8: cast to float8_e4m3fn in the kernel with one scale per 128 channels (round_scale: power-of-two
                scales; use_ue8m0: pack them as exponent bytes, needs round_scale and H % 512 == 0).
            async_finish: return an event instead of making the current stream wait (not with a hook).
            return_recv_hook: launch only the send phase on the current stream; `hook()` launches the receive phase
                (once: a second call raises RuntimeError).
            bound_only: return None, doing nothing, when this call signature is met for the first time (the V1
                Buffer's path, which then lays the engine out again for larger maxima if needed).

        Returns:
            `(recv_x, recv_count, handle, event, hook)`: recv_x `[L, R*M, H]` bfloat16, or with FP8
            `(float8_e4m3fn [L, R*M, H], scales)` with scales float32 `[L, R*M, H/128]` (int32 `[L, R*M, H/512]`
            with UE8M0), a transposed view of a `[L, H/128, R*M]` buffer; rows of expert j: source blocks in
            ascending rank order, each in the source's token order, the first recv_count[j] valid. recv_count `[L]`
            int32. handle: `LLHandle`. event: `EventOverlap`. hook: callable or None. recv_x and the scales are
            allocations of their own; recv_count and the handle's tensors are views of one allocation of the call
            (bound.py `HandleLayout`).
        """
        if self.base._destroyed or self.base._failed is not None or self._error_word[0]:
            self._check_usable()
        # The call signature (bound.py): `interop.meta` inline for plain torch tensors
        tensor = TORCH_TENSOR[0]
        if type(x) is tensor:
            xs, xp = (x.shape, x.stride(), x.dtype, x.get_device()), x.data_ptr()
        else:
            xs, xp = meta(x)
        if type(topk_idx) is tensor:
            ts, tp = (topk_idx.shape, topk_idx.stride(), topk_idx.dtype, topk_idx.get_device()), topk_idx.data_ptr()
        else:
            ts, tp = meta(topk_idx)
        cs, ws = cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats
        css, cp = (None, 0) if cs is None else meta(cs)
        wss, wp = (None, 0) if ws is None else meta(ws)
        key = (xs, ts, css, wss, num_max_dispatch_tokens_per_rank, num_max_dispatch_tokens_per_rank.__class__,
               num_experts, num_experts.__class__, use_fp8, use_fp8.__class__, round_scale, round_scale.__class__,
               use_ue8m0, use_ue8m0.__class__, async_finish, async_finish.__class__, return_recv_hook,
               return_recv_hook.__class__)
        b = self._dispatches.get(key)
        if b is None:
            if bound_only:
                return None
            b = self._bind_dispatch(key, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cs, ws, use_fp8,
                                    round_scale, use_ue8m0, async_finish, return_recv_hook)
        return self._run_dispatch(b, x, topk_idx, xp, tp, cp, wp, cs, ws)

    def _run_dispatch(self, b: BoundDispatch, x, topk_idx, xp: int, tp: int, cp: int, wp: int, cs, ws):
        """The per-call work of the bound dispatch `b` (bound.py): the address check, the outputs and the handle
        (views of the call's allocation), the patch of the launch's pointers (`xp`, `tp`: x and topk_idx; `cp`, `wp`:
        the stats `cs`, `ws`, 0 without), the launch and its stream order. Returns `dispatch`'s tuple."""
        (torch, hook, async_, check_x, stream, patch, send_u, send, recv_free, bind_recv, x_alloc, sf_alloc,
         group_alloc, views, hl, handle_const, carver, enter, leave) = b
        if check_x and xp & 15:
            raise ValueError('x must start at a 16-byte aligned address')
        current = stream()
        recv_x = x_alloc()
        sf = None if sf_alloc is None else sf_alloc()
        group = group_alloc()
        if torch:
            xo, g0 = recv_x.data_ptr(), group.data_ptr()
            rc_view, si_view, lr_view = views
            recv_count = group.as_strided(*rc_view)
            src_info = group.as_strided(*si_view)
            layout_range = group.view(_INT64[0]).as_strided(*lr_view)
            if sf is None:
                so, recv_out = 0, recv_x
            else:
                so, recv_out = sf.data_ptr(), (recv_x, sf.transpose(1, 2))
        else:
            xo, g0 = carver.ptr(recv_x), carver.ptr(group)
            recv_count, src_info, layout_range = (hl.view(carver, group, 'recv_count'),
                                                  hl.view(carver, group, 'src_info'),
                                                  hl.view(carver, group, 'layout_range'))
            if sf is None:
                so, recv_out = 0, recv_x
            else:
                so, recv_out = carver.ptr(sf), (recv_x, sf.swapaxes(1, 2))
        handle = _new_handle(LLHandle, (src_info, layout_range, hl.num_max_tokens, hl.hidden, hl.num_experts))
        d = handle.__dict__
        d.update(handle_const)
        d['recv_count'], d['_group'], d['_g0'] = recv_count, group, g0
        patch(send_u, xp, tp, xo, so, g0, cp, wp)
        if hook:
            rb = recv_free.pop() if recv_free else bind_recv()
            patch(rb.u64, xp, tp, xo, so, g0, cp, wp)
            send(current)
            return recv_out, recv_count, handle, empty_overlap(), make_hook(
                stream, recv_free, (rb, x, topk_idx, recv_x, sf, group, cs, ws))
        comm = self.base.comm_stream
        enter.record(current)
        comm.wait_event(enter)
        send(comm)
        if async_:
            return recv_out, recv_count, handle, self._leave_comm(
                handle_const['kind'], current, comm, True, (x, topk_idx, recv_x, sf, group, cs, ws)), None
        leave.record(comm)
        current.wait_event(leave)
        return recv_out, recv_count, handle, empty_overlap(), None

    def _bind_dispatch(self, key, x, topk_idx, M, E, cs, ws, use_fp8, round_scale, use_ue8m0, async_finish,
                       return_recv_hook) -> BoundDispatch:
        """Check a dispatch signature met for the first time (`LLPlanner.plan_dispatch`: every user error raises here,
        before any kernel runs), bind it (bound.py) and remember it under `key`."""
        p = self.planner.plan_dispatch(x, topk_idx, M, E, cs, ws, use_fp8, round_scale, use_ue8m0, async_finish,
                                       return_recv_hook)
        b = bind_dispatch(self, p, bool(return_recv_hook), bool(async_finish))
        if p.kind == 'torch' and not _INT64:
            _INT64.append(sys.modules['torch'].int64)
        if len(self._dispatches) >= MAX_BOUND:
            self._dispatches.clear()
        self._dispatches[key] = b
        return b

    # -- combine --
    def combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False, zero_copy: bool = False,
                async_finish: bool = False, return_recv_hook: bool = False, out=None,
                combine_wait_recv_cost_stats=None):
        """DeepEP's `low_latency_combine`: `combined_x[t] = sum over k with topk_idx[t, k] >= 0 (owner not masked)
        of topk_weights[t, k] * x[row of (t, k)]`, in FP32 in ascending k (`acc = acc + w * row`, each operation
        rounded), rounded to bfloat16 once.

        Args:
            x: `[L, R*M, H]`, bfloat16, contiguous, the dispatch's masked layout (ignored with zero_copy, where the
                rows were written into `get_next_combine_buffer(handle)`).
            topk_idx, topk_weights: the dispatch's `[N, K]` int64 ids and `[N, K]` float32 weights.
            handle: the dispatch's `LLHandle`.
            use_logfmt: not supported (NotImplementedError).
            out: `[N, H]` bfloat16 to write into (default: a new tensor).
            combine_wait_recv_cost_stats: `[R]`, int64, += clock cycles spent waiting for each owner's rows.

        Returns:
            `(combined_x [N, H] bfloat16, event, hook)`.
        """
        if self.base._destroyed or self.base._failed is not None or self._error_word[0]:
            self._check_usable()
        tensor = TORCH_TENSOR[0]
        if type(x) is tensor:
            xs, xp = (x.shape, x.stride(), x.dtype, x.get_device()), x.data_ptr()
        else:
            xs, xp = meta(x)
        if type(topk_idx) is tensor:
            ts, tp = (topk_idx.shape, topk_idx.stride(), topk_idx.dtype, topk_idx.get_device()), topk_idx.data_ptr()
        else:
            ts, tp = meta(topk_idx)
        if type(topk_weights) is tensor:
            wts, wp = ((topk_weights.shape, topk_weights.stride(), topk_weights.dtype, topk_weights.get_device()),
                       topk_weights.data_ptr())
        else:
            wts, wp = meta(topk_weights)
        # (the handle's dispatch signature, by identity: its `HandleLayout`; None never matches a bound combine)
        hs = handle.__dict__.get('_sig') if type(handle) is LLHandle else None
        os_, op = (None, 0) if out is None else meta(out)
        ss, sp = (None, 0) if combine_wait_recv_cost_stats is None else meta(combine_wait_recv_cost_stats)
        key = (xs, ts, wts, hs, os_, ss, use_logfmt, use_logfmt.__class__, zero_copy, zero_copy.__class__,
               async_finish, async_finish.__class__, return_recv_hook, return_recv_hook.__class__)
        b = self._combines.get(key)
        if b is None:
            b = self._bind_combine(key, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                   return_recv_hook, out, combine_wait_recv_cost_stats)
        return self._run_combine(b, x, topk_idx, topk_weights, handle, out, combine_wait_recv_cost_stats, xp, tp, wp,
                                 op, sp)

    def _run_combine(self, b: BoundCombine, x, topk_idx, topk_weights, handle, out, stats, xp: int, tp: int, wp: int,
                     op: int, sp: int):
        """The per-call work of the bound combine `b` (bound.py): the address and origin checks, the output, the
        patch of the launch's pointers (`xp`, `tp`, `wp`, `op`, `sp`: x, topk_idx, topk_weights, out and the stats,
        0 where None), the launch and its stream order. Returns `combine`'s tuple."""
        (torch, hook, async_, zero, check_x, check_out, stream, patch, send_u, send, recv_free, bind_recv,
         out_alloc, call_alloc, combine_call_word, enter, leave) = b
        if check_x and xp & 15:
            raise ValueError('x must start at a 16-byte aligned address')
        if check_out and op & 15:
            raise ValueError('out must start at a 16-byte aligned address')
        if handle.engine_id != self._id:
            raise ValueError('handle comes from another buffer\'s low_latency_dispatch')
        if zero:
            xp = self._staging_ptrs[self._num_combines % 2]
        self._num_combines += 1
        current = stream()
        if out_alloc is None:
            combined = out
        else:
            combined = out_alloc()
            op = combined.data_ptr() if torch else combined.data.ptr
        g0 = handle._g0
        if hook:
            call = call_alloc()
            ci = call.data_ptr() if torch else call.data.ptr
            patch(send_u, xp, g0, tp, wp, op, ci, sp)
            rb = recv_free.pop() if recv_free else bind_recv()
            patch(rb.u64, xp, g0, tp, wp, op, ci, sp)
            send(current)
            return combined, empty_overlap(), make_hook(
                stream, recv_free, (rb, x, topk_idx, topk_weights, handle, call, combined, stats))
        patch(send_u, xp, g0, tp, wp, op, g0 + combine_call_word, sp)
        comm = self.base.comm_stream
        enter.record(current)
        comm.wait_event(enter)
        send(comm)
        if async_:
            return combined, self._leave_comm(handle._sig.kind, current, comm, True, (
                x, topk_idx, topk_weights, combined, handle._group, stats)), None
        leave.record(comm)
        current.wait_event(leave)
        return combined, empty_overlap(), None

    def _bind_combine(self, key, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                      return_recv_hook, out, stats) -> BoundCombine:
        """Check a combine signature met for the first time (`LLPlanner.plan_combine`, the handle's origin), bind it
        (bound.py) and remember it under `key`."""
        p = self.planner.plan_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                      return_recv_hook, out, stats)
        hl = handle.__dict__.get('_sig')
        if getattr(handle, 'engine_id', None) != id(self) or hl is None:
            raise ValueError('handle comes from another buffer\'s low_latency_dispatch')
        b = bind_combine(self, p, hl, bool(return_recv_hook), bool(async_finish))
        if len(self._combines) >= MAX_BOUND:
            self._combines.clear()
        self._combines[key] = b
        return b

    # -- zero-copy staging --
    def _staging_offset(self, half: int) -> int:
        return self.region_offset + self.layout.staging_offset + half * self.layout.staging_half_bytes

    def _staging_ptr(self, half: int) -> int:
        return self.base.sym.base + self._staging_offset(half)

    def get_next_combine_buffer(self, handle):
        """DeepEP's `get_next_low_latency_combine_buffer(handle)`: the `[L, R*M, H]` bfloat16 view (contiguous) of
        the staging buffer the next `combine(..., zero_copy=True)` reads; write the expert outputs into it."""
        if not isinstance(handle, LLHandle) or getattr(handle, 'engine_id', None) != id(self):
            raise TypeError('handle must come from this buffer\'s low_latency_dispatch')
        M, H, E = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        L, T = E // self.num_ranks, self.num_ranks * M
        half = self._num_combines % 2
        key = (half, L, T, H, handle.kind)
        view = self._staging_views.get(key)
        if view is None:
            sym = self.base.sym
            flat = sym.local_view(self._staging_offset(half), L * T * H, np.uint16)
            view = flat.reshape(L, T, H)
            if handle.kind == 'torch':
                view = interop.to_torch(view, 'bfloat16')
            self._staging_views[key] = view
        return view

    # -- masks (shrink mode) --
    def _masks(self):
        if self._mask_view is None:
            self._mask_view = self.base.sym.local_view(self.region_offset + 4 * CTL_MASK_WORD, self.num_ranks,
                                                       np.int32)
        return self._mask_view

    # -- clean --
    def clean_buffer(self, num_max_dispatch_tokens_per_rank: Optional[int] = None, hidden: Optional[int] = None,
                     num_experts: Optional[int] = None, reset: bool = True) -> None:
        """DeepEP's `clean_low_latency_buffer` (collective: every live rank calls it, with no low-latency result
        outstanding). A GPU barrier over the unmasked ranks, then (reset) every call counter, signal and flag of
        this rank back to zero, then a second barrier: afterwards every rank's epochs restart together (needed only
        when ranks did different numbers of calls, e.g. a masked rank sat out; the epochs make it unnecessary
        otherwise). A silent rank is masked (shrink) or fails the buffer with TimeoutError (later calls raise)."""
        self._check_usable()
        lay = self.layout
        if num_max_dispatch_tokens_per_rank is not None:
            self.planner._call_dims(num_max_dispatch_tokens_per_rank, num_experts or lay.num_experts,
                                    hidden or lay.hidden, None)
        current = interop.current_stream()
        comm = self._enter_comm(current)
        _launch(self._clean_kernel, 1, dict(
            reset=int(reset), counts_words=lay.counts_words, cflags_offset=lay.cflags_offset,
            cflags_words=lay.cflags_words, dslots_offset=lay.dslots_offset, num_messages=lay.num_messages,
            msg_bytes=lay.msg_bytes, msg_flag_words=lay.num_segs, **self._common_args()), comm, 0)
        self._leave_comm('cupy', current, comm, False, ())


def _ordered(kernel, named: Dict[str, Any]) -> Tuple:
    """The arguments of `named` (parameter name -> value) in the kernel's declaration order; TypeError naming any
    missing or unknown parameter."""
    names = [p.name for p in kernel.spec.params]
    missing, extra = [n for n in names if n not in named], [n for n in named if n not in names]
    if missing or extra:
        raise TypeError(f'{kernel.spec.name}: missing parameters {missing}, unknown parameters {extra}')
    return tuple(named[n] for n in names)


def _launch(kernel, grid: int, named: Dict[str, Any], stream, shared_mem: int) -> None:
    """Launch by parameter name (positional `launch_args` where the launcher has it, else `launch`)."""
    go = getattr(kernel, 'launch_args', None) or kernel.launch
    go(grid, THREADS, _ordered(kernel, named), stream=stream, shared_mem=shared_mem)
