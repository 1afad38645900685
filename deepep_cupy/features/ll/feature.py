"""Low-latency (decode) EP engine: DeepEP V1's `low_latency_dispatch` / `low_latency_combine` and their helpers
(masks, clean, zero-copy combine buffer, size hint) on the `ep_ll` kernel family (kernels_cu/ep_ll.cu, where the
protocol is described).

The engine owns a region of a `BufferBase`'s symmetric memory (by default its whole data region). The region's
layout is fixed at construction from maxima (tokens per rank M, hidden H, experts E, top-k K), so that every flag
word only ever holds epochs of its own kind: no call ever needs the buffer cleared. Calls may use any M' <= M,
H' <= H (H' % 128 == 0), E' <= E (E' % R == 0) and K' <= K.

Layering: `LLLayout` (sizes and offsets, pure), `LLPlanner` (argument checks, pure: runs without a GPU),
`LowLatencyEngine` (allocation, streams, launches). The V1 `Buffer` holds an engine and forwards
`low_latency_dispatch` / `low_latency_combine` / `get_next_low_latency_combine_buffer` /
`clean_low_latency_buffer` / `low_latency_{update,query,clean}_mask_buffer` / `get_low_latency_rdma_size_hint`.
"""

from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from ...runtime import interop
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


# ---- engine --------------------------------------------------------------------------------------------------------
def describe_wait(record) -> str:
    """What the failed wait of an error record (int32 [8], see runtime/errors.py) was waiting for."""
    return WAIT_KINDS.get(int(record[6]), f'aux {int(record[6])}')


class LowLatencyEngine:
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
        from ...runtime.event import EventHandle, EventOverlap
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
        return EventOverlap(None)

    @staticmethod
    def _swap_last(a, kind: str):
        return a.transpose(1, 2) if kind == 'torch' else a.swapaxes(1, 2)

    # -- dispatch --
    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                 cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, use_fp8: bool = True,
                 round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                 return_recv_hook: bool = False):
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
            return_recv_hook: launch only the send phase on the current stream; `hook()` launches the receive phase.

        Returns:
            `(recv_x, recv_count, handle, event, hook)`: recv_x `[L, R*M, H]` bfloat16, or with FP8
            `(float8_e4m3fn [L, R*M, H], scales)` with scales float32 `[L, R*M, H/128]` (int32 `[L, R*M, H/512]`
            with UE8M0), a transposed view of a `[L, H/128, R*M]` buffer; rows of expert j: source blocks in
            ascending rank order, each in the source's token order, the first recv_count[j] valid. recv_count `[L]`
            int32. handle: `LLHandle`. event: `EventOverlap`. hook: callable or None.
        """
        self._check_usable()
        p = self.planner.plan_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                       cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                       round_scale, use_ue8m0, async_finish, return_recv_hook)
        lay, R = self.layout, self.num_ranks
        L, T, H, N, K = p.num_local_experts, p.num_rows, p.hidden, p.num_tokens, p.num_topk
        current = interop.current_stream(x)
        alloc = interop.Allocator(p.kind)
        if p.use_fp8:
            recv_x = alloc.empty((L, T, H), 'float8_e4m3fn')
            sf_buffer = alloc.empty((L, H // 512, T), 'int32') if p.use_ue8m0 else alloc.empty((L, H // 128, T),
                                                                                                  'float32')
            recv_out = (recv_x, self._swap_last(sf_buffer, p.kind))
        else:
            recv_x = alloc.empty((L, T, H), 'bfloat16')
            sf_buffer = None
            recv_out = recv_x
        recv_count = alloc.empty((L,), 'int32')
        src_info = alloc.empty((L, T), 'int32')
        layout_range = alloc.empty((L, R), 'int64')
        row_route = alloc.empty((L, T), 'int32')
        send_pos = alloc.empty((N, K), 'int32')
        call_info = alloc.empty((1,), 'int32')

        def args(phases: int) -> Dict[str, Any]:
            return dict(
                x=p.x.ptr, topk_idx=p.topk_idx.ptr, num_tokens=N, num_topk=K, hidden=H, num_experts=p.num_experts,
                num_max_tokens=p.num_max_tokens, use_fp8=int(p.use_fp8), round_scale=int(p.round_scale),
                use_ue8m0=int(p.use_ue8m0), recv_x=recv_x, recv_sf=0 if sf_buffer is None else sf_buffer,
                recv_count=recv_count, src_info=src_info, layout_range=layout_range, row_route=row_route,
                send_pos=send_pos, call_info=call_info,
                cumulative_stats=0 if p.cumulative_stats is None else p.cumulative_stats.ptr,
                wait_stats=0 if p.wait_stats is None else p.wait_stats.ptr, lists_offset=lay.lists_offset,
                dslots_offset=lay.dslots_offset, slot_tokens=lay.num_max_tokens, msg_bytes=lay.msg_bytes,
                msg_hidden_offset=lay.msg_hidden_offset, phases=phases, **self._common_args())

        grid, smem = self.base.num_device_sms, dispatch_smem_bytes(p.num_experts, R)
        handle = LLHandle(src_info, layout_range, p.num_max_tokens, H, p.num_experts, recv_count=recv_count,
                          row_route=row_route, send_pos=send_pos, call_info=call_info, num_tokens=N, num_topk=K,
                          kind=p.kind, engine_id=id(self))
        hook: Optional[Callable[[], None]] = None
        if return_recv_hook:
            _launch(self._dispatch_kernel, grid, args(PHASE_SEND), current, smem)
            recv_launch = _prepare(self._dispatch_kernel, grid, args(PHASE_RECV), smem)
            hook = _make_hook(recv_launch, recv_x, (x, topk_idx))
            from ...runtime.event import EventOverlap
            event = EventOverlap(None)
        else:
            comm = self._enter_comm(current)
            _launch(self._dispatch_kernel, grid, args(PHASE_SEND | PHASE_RECV), comm, smem)
            event = self._leave_comm(p.kind, current, comm, bool(async_finish), (
                x, topk_idx, recv_x, sf_buffer, recv_count, src_info, layout_range, row_route, send_pos, call_info,
                cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats))
        return recv_out, recv_count, handle, event, hook

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
        self._check_usable()
        p = self.planner.plan_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                      return_recv_hook, out, combine_wait_recv_cost_stats)
        if getattr(handle, 'engine_id', None) != id(self):
            raise ValueError('handle comes from another buffer\'s low_latency_dispatch')
        lay, R = self.layout, self.num_ranks
        current = interop.current_stream(x)
        alloc = interop.Allocator(p.kind)
        src_ptr = self._staging_ptr(self._num_combines % 2) if p.zero_copy else p.x.ptr
        self._num_combines += 1
        combined = out if out is not None else alloc.empty((p.num_tokens, p.hidden), 'bfloat16')
        call_info = alloc.empty((1,), 'int32')

        def args(phases: int) -> Dict[str, Any]:
            return dict(
                x=src_ptr, recv_count=handle.recv_count, row_route=handle.row_route, layout_range=handle[1],
                send_pos=handle.send_pos, topk_idx=p.topk_idx.ptr, topk_weights=p.topk_weights.ptr,
                combined_x=combined, num_tokens=p.num_tokens, num_topk=p.num_topk, hidden=p.hidden,
                num_experts=p.num_experts, num_max_tokens=p.num_max_tokens, call_info=call_info,
                wait_stats=0 if p.wait_stats is None else p.wait_stats.ptr, cflags_offset=lay.cflags_offset,
                cslots_offset=lay.cslots_offset, slot_segs=lay.num_segs, phases=phases, **self._common_args())

        grid, smem = self.base.num_device_sms, combine_smem_bytes(p.num_experts, R)
        hook = None
        if return_recv_hook:
            _launch(self._combine_kernel, grid, args(PHASE_SEND), current, smem)
            recv_launch = _prepare(self._combine_kernel, grid, args(PHASE_RECV), smem)
            hook = _make_hook(recv_launch, combined, (x, topk_idx, topk_weights, handle, call_info))
            from ...runtime.event import EventOverlap
            event = EventOverlap(None)
        else:
            comm = self._enter_comm(current)
            _launch(self._combine_kernel, grid, args(PHASE_SEND | PHASE_RECV), comm, smem)
            event = self._leave_comm(p.kind, current, comm, bool(async_finish), (
                x, topk_idx, topk_weights, combined, call_info, handle[0], handle[1], handle.recv_count,
                handle.row_route, handle.send_pos, combine_wait_recv_cost_stats))
        return combined, event, hook

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
        M, H, E = handle[2], handle[3], handle[4]
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

    def _require_shrink(self, what: str) -> None:
        if not self.enable_shrink:
            raise RuntimeError(f'{what} needs a buffer built with enable_shrink=True')

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


def _prepare(kernel, grid: int, named: Dict[str, Any], shared_mem: int) -> Callable:
    """A packed launch (`launch(stream)`) by parameter name."""
    pack = getattr(kernel, 'prepare_args', None) or kernel.prepare
    return pack(grid, THREADS, _ordered(kernel, named), shared_mem=shared_mem)


def _make_hook(recv_launch: Callable, like: Any, keep: Tuple) -> Callable[[], None]:
    """`hook()`: launches the receive phase on the current stream (torch's when `like` is a torch tensor). Holds
    `keep` (the call's inputs) until then."""
    state = {'keep': keep}

    def hook() -> None:
        recv_launch(interop.current_stream(like))
        state['keep'] = None
    return hook
