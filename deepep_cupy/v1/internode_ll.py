"""Low-latency mode of DeepEP V1's `Buffer` across scale-up domains, on the hybrid EP engine (the design:
v1/kernels/internode_ll.py): `LLInternodeEngine` (symmetric memory with the hybrid feature laid out for pseudo
tokens) and `InternodeLLMode` (the calls: streams, hooks, zero-copy staging, masks).

- The engine is built at the first low-latency call (collective: every rank calls, with the same M, hidden and
  top-k) for `M * K` pseudo tokens per rank of that call's hidden; a later call beyond those maxima builds a larger
  one (every rank alike, after a barrier). Handles keep their engine alive. Memory of its own (normal mode across
  domains keeps another engine), so one Buffer serves both modes (SGLang's `auto`) without cleaning.
- Streams: without a hook or async_finish, everything runs on the caller's current stream. async_finish: on the
  communication stream (forked from the current one by an event), with an event returned. Hook: the sends (prepare
  and the hybrid dispatch, or gather and the hybrid combine) on the communication stream; `hook()` makes the current
  stream wait and launches the receive kernels there. Intermediates of the hooked call are held until the next call
  of this mode (which forks the communication stream after everything the caller's stream did, hooks included).
"""

from typing import Any, Callable, NamedTuple, Optional

from ..buffers import hybrid
from ..buffers.base import BufferBase
from ..constants import NUM_MAX_TOPK
from ..features.ll.feature import ShrinkMaskMethods
from ..runtime import interop
from ..runtime.event import EventHandle, EventOverlap
from .kernels import internode_ll as ill
from .kernels.internode import V1Options
from .normal import needed_bytes


def rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """`get_low_latency_rdma_size_hint` for a group larger than one NVLink domain: the single-domain formula
    (features/ll/plan.py `LLLayout`, top-k 32) at `num_ranks`. Across domains the low-latency engine is laid out at the
    first call from its M, hidden and top-k, so this value bounds nothing there; it is what vLLM / SGLang pass as
    num_rdma_bytes (also the normal mode's rail bound across domains: a larger one is harmless)."""
    from ..features.ll.plan import SIZE_ALIGN, LLLayout
    planner = ill.InternodeLLPlanner(ill._int_arg('num_ranks', num_ranks, 1), -1)
    planner.dims(num_max_dispatch_tokens_per_rank, hidden, num_experts)
    layout = LLLayout(num_max_tokens=num_max_dispatch_tokens_per_rank, hidden=hidden, num_ranks=num_ranks,
                      num_experts=num_experts, num_max_topk=NUM_MAX_TOPK)
    return -(-layout.total_bytes // SIZE_ALIGN) * SIZE_ALIGN


class _WorstRows(V1Options):
    """The hybrid dispatch's V1 rules with `num_worst` output rows (no CPU sync; no V1 handle kernels)."""

    def __init__(self, num_worst: int):
        self.num_worst = num_worst


class LLInternodeEngine(hybrid.RailHooks, BufferBase):
    """Symmetric memory with the hybrid EP feature for `num_pseudo` pseudo tokens per rank of top-k 1 (collective: it
    makes the rails), built `deterministic=False` (the scatter places rows by their slot), and the kernels.

    Args:
        group, device, num_cpu_timeout_secs, num_gpu_timeout_secs: as `BufferBase`'s.
        num_pseudo: pseudo tokens per rank (M * K); hidden: the largest hidden; num_domains, num_scaleup_ranks: the
            topology; comm_stream: the V1 Buffer's communication stream; nvlink_gbs: the intranode SM policy's.
    """

    def __init__(self, group, num_pseudo: int, hidden: int, num_domains: int, num_scaleup_ranks: int, comm_stream,
                 device: int, nvlink_gbs: float, num_cpu_timeout_secs: float, num_gpu_timeout_secs: float):
        N, S = num_domains, num_scaleup_ranks
        super().__init__(group=group, num_bytes=needed_bytes(S, N * num_pseudo, hidden, 1), allow_hybrid_mode=True,
                         num_cpu_timeout_secs=num_cpu_timeout_secs, num_gpu_timeout_secs=num_gpu_timeout_secs,
                         explicitly_destroy=False, device=device,
                         config={'num_max_tokens_per_rank': num_pseudo, 'hidden': hidden, 'num_topk': 1},
                         comm_stream=comm_stream)
        assert (self.num_scaleout_ranks, self.num_scaleup_ranks) == (N, S), 'the topology changed'
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = num_pseudo, hidden, 1
        self.geometry = (num_pseudo, hidden)
        self.deterministic = False
        self.allow_multiple_reduction = self.prefer_overlap_with_compute = True
        self._nvlink_gbs = nvlink_gbs
        self._ep = self._hybrid = None
        try:
            self.ll_kernels = ill.InternodeLLKernels(device)
            self._ep = hybrid.make_hybrid_ep(self)
        except BaseException:
            self.destroy()
            raise

    @property
    def feature(self):
        return self._ep

    def _destroy_features(self) -> None:
        if self._ep is not None:
            self._ep.destroy()
        self._hybrid, self._ep = self._ep, None


def _torch_stream(handle: int):
    """The torch stream of raw `cudaStream_t` `handle`. Handle 0 is torch's default stream (the legacy NULL stream,
    what `torch.cuda.current_stream()` is unless the caller picked another): `torch.cuda.ExternalStream(0)` is NOT
    that stream but a fresh stream from torch's pool, created non-blocking, so work made current through it runs
    unordered with the caller's stream."""
    if handle == 0:
        import torch
        return torch.cuda.default_stream()
    return interop.torch_stream(handle)


class _OnStream:
    """Makes `stream` (a cupy stream) current for CuPy and, for torch arrays, for torch too (unchanged when it already
    is torch's current stream: the local calls' case, which must keep every launch on the caller's stream)."""

    def __init__(self, kind: str, stream):
        self.kind, self.stream, self._torch = kind, stream, None

    def __enter__(self):
        self.stream.__enter__()
        if self.kind == 'torch':
            import torch
            if torch.cuda.current_stream().cuda_stream != self.stream.ptr:
                self._torch = torch.cuda.stream(_torch_stream(self.stream.ptr))
                self._torch.__enter__()
        return self

    def __exit__(self, *exc):
        if self._torch is not None:
            self._torch.__exit__(*exc)
            self._torch = None
        self.stream.__exit__(*exc)


class _DispatchOutputs(NamedTuple):
    """A dispatch's outputs, allocated before its send phase (the receive phase writes them)."""
    recv_x: Any             # `[L, R*M, H]` float8_e4m3fn (FP8) or bfloat16
    sf_buffer: Any          # FP8: scales `[L, H/128, R*M]` float32 (UE8M0: `[L, H/512, R*M]` int32); else None
    recv_out: Any           # V1's recv_x: recv_x, or FP8 `(recv_x, the scales viewed [L, R*M, H/128])`
    small: Any              # int32 `[L + L*R + N*K + worst]`: recv_count | begin | send_pos | row_of
    recv_count: Any         # `[L]` int32
    begin: Any              # `[L*R]` int32: the first row of each (local expert, source) pair
    send_pos: Any           # `[N, K]` int32
    row_of: Any             # `[worst]` int32: hybrid row -> V1 row
    src_info: Any           # `[L, R*M]` int32
    layout_range: Any       # `[L, R]` int64


def _dispatch_outputs(alloc, p, num_ranks: int, num_worst: int) -> _DispatchOutputs:
    """The outputs of the checked dispatch `p` (`DispatchPlan`) over `num_ranks` ranks, `num_worst` rows at most."""
    L, T, H, n, K, R = p.num_local_experts, p.num_rows, p.hidden, p.num_tokens, p.num_topk, num_ranks
    if p.use_fp8:
        recv_x = alloc.empty((L, T, H), 'float8_e4m3fn')
        sf_buffer = alloc.empty((L, H // 512, T), 'int32') if p.use_ue8m0 else alloc.empty((L, H // 128, T),
                                                                                              'float32')
        swap = (lambda a: a.transpose(1, 2)) if p.kind == 'torch' else (lambda a: a.swapaxes(1, 2))
        recv_out = (recv_x, swap(sf_buffer))
    else:
        recv_x, sf_buffer = alloc.empty((L, T, H), 'bfloat16'), None
        recv_out = recv_x
    small = alloc.empty((L + L * R + n * K + num_worst,), 'int32')
    return _DispatchOutputs(recv_x=recv_x, sf_buffer=sf_buffer, recv_out=recv_out, small=small,
                            recv_count=small[:L], begin=small[L:L + L * R],
                            send_pos=small[L + L * R:L + L * R + n * K].reshape(n, K), row_of=small[L + L * R + n * K:],
                            src_info=alloc.empty((L, T), 'int32'), layout_range=alloc.empty((L, R), 'int64'))


def _receive_hook(comm, anchor, receive, rows) -> Callable[[], None]:
    """V1's `hook()` of a call whose send phase is enqueued on `comm`: the then-current stream (torch's for a torch
    `anchor`) waits for that, then `receive(stream, rows)` runs there (once: a second call raises KeyError)."""
    done = EventHandle(comm)
    state = {'rows': rows}

    def hook() -> None:
        cur = interop.current_stream(anchor)
        done.stream_wait(cur)
        receive(cur, state.pop('rows'))
    return hook


def _record(kind: str, stream, tensors) -> None:
    """torch: mark `tensors` used on `stream` (the caching allocator keeps them until its work is done)."""
    if kind != 'torch':
        return
    s = _torch_stream(stream.ptr)
    for t in tensors:
        if t is not None and interop.is_torch(t):
            t.record_stream(s)


class InternodeLLMode(ShrinkMaskMethods):
    """The low-latency calls of one V1 `Buffer` across domains (see the module docstring).

    Args:
        num_domains, num_scaleup_ranks: the topology; device: this rank's GPU; enable_shrink: the mask calls.
        make_engine: `make_engine(num_pseudo, hidden)` builds an `LLInternodeEngine` (collective).
    """

    def __init__(self, num_domains: int, num_scaleup_ranks: int, device: int, enable_shrink: bool,
                 make_engine: Callable[[int, int], LLInternodeEngine]):
        self.num_domains, self.num_scaleup_ranks = num_domains, num_scaleup_ranks
        self.num_ranks = num_domains * num_scaleup_ranks
        self.enable_shrink = bool(enable_shrink)
        self.planner = ill.InternodeLLPlanner(self.num_ranks, device)
        self._make = make_engine
        self.engine: Optional[LLInternodeEngine] = None
        self.maxima = (0, 0, 0)         # (M, hidden, top-k) the engine holds
        self.num_builds = 0
        self._num_combines = 0          # picks the zero-copy staging half of the next combine
        self._staging = {}              # (half, L, T, H, kind) -> view
        self._mask = None
        self._held = ()                 # a hooked call's intermediates, until the next call forks the comm stream

    # -- engine --
    def engine_for(self, num_max_tokens: int, hidden: int, num_topk: int) -> LLInternodeEngine:
        """The engine with room for these maxima (built, or rebuilt with larger maxima: collective then)."""
        M, H, K = self.maxima
        eng = self.engine
        if eng is not None and num_max_tokens <= M and hidden <= H and num_topk <= K:
            return eng
        M, H, K = max(M, num_max_tokens), max(H, hidden), max(K, num_topk)
        if eng is not None:
            eng.barrier(with_cpu_sync=True)     # every rank's kernels on the old engine are done (handles keep it)
        self.engine = self._make(ill.pseudo_tokens(M, K), H)
        self.maxima = (M, H, K)
        self.num_builds += 1
        self._staging = {}
        return self.engine

    def require_engine(self, what: str) -> LLInternodeEngine:
        if self.engine is None:
            raise RuntimeError(f'{what}: no low-latency call has run on this buffer yet')
        return self.engine

    def _mask_ptr(self) -> int:
        return self._masks().data.ptr if self.enable_shrink else 0

    def _fork(self, current):
        """The communication stream, after everything `current` did (an event; capturable)."""
        comm = self.engine.comm_stream
        EventHandle(current).stream_wait(comm)
        self._held = ()
        return comm

    # -- dispatch --
    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                 cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, use_fp8: bool = True,
                 round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                 return_recv_hook: bool = False):
        """V1's `low_latency_dispatch` across domains (outputs as `LowLatencyMethods.low_latency_dispatch`'s).
        `dispatch_wait_recv_cost_stats` is accepted and left unchanged (the waits happen in NCCL and the intranode
        engine, which do not count per source)."""
        p = self.planner.plan_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                       cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                       round_scale, use_ue8m0, async_finish, return_recv_hook)
        eng = self.engine_for(p.num_max_tokens, p.hidden, p.num_topk)
        eng.check_usable()
        k = eng.ll_kernels
        N, S, R = self.num_domains, self.num_scaleup_ranks, self.num_ranks
        L, H, n, K, M, E = p.num_local_experts, p.hidden, p.num_tokens, p.num_topk, p.num_max_tokens, p.num_experts
        kind = p.kind
        alloc = interop.Allocator(kind)
        current = interop.current_stream(x)
        num_pseudo, worst = ill.pseudo_tokens(M, K), ill.worst_rows(R, M, K, L)
        o = _dispatch_outputs(alloc, p, R, worst)
        mask = self._mask_ptr()
        made = (o.recv_x, o.sf_buffer, o.small, o.src_info, o.layout_range)

        def send(stream):
            return self._dispatch_send(stream, eng, p, alloc, x, topk_idx, mask, o.send_pos, num_pseudo, worst)

        def receive(stream, rows):
            ill.launch_receive(k, stream, rows, N, S, num_pseudo, K, L, M, H, p.use_fp8, p.use_ue8m0, mask, o.recv_x,
                               o.sf_buffer, o.src_info, o.layout_range, o.recv_count,
                               cumulative_local_expert_recv_stats, o.begin, o.row_of)

        hook = None
        if return_recv_hook:
            comm = self._fork(current)
            _record(kind, comm, (x, topk_idx))
            hh, rows, keep = send(comm)
            hook = _receive_hook(comm, x, receive, rows)
            self._held = keep + (x, topk_idx)
            event = EventOverlap(None)
        elif async_finish:
            comm = self._fork(current)
            hh, rows, keep = send(comm)
            receive(comm, rows)
            _record(kind, comm, made + (x, topk_idx, cumulative_local_expert_recv_stats))
            event = EventOverlap(EventHandle(comm), extra_tensors=tuple(t for t in made + keep + (x, topk_idx)
                                                                         if t is not None))
        else:
            hh, rows, keep = send(current)
            receive(current, rows)
            event = EventOverlap(None)
        handle = ill.InternodeLLHandle(o.src_info, o.layout_range, M, H, E, hybrid_handle=hh, engine=eng,
                                       row_of=o.row_of, send_pos=o.send_pos, num_rows=rows.num_rows,
                                       num_recv_ptr=rows.num_recv_ptr, recv_count=o.recv_count, num_tokens=n,
                                       num_topk=K, kind=kind, mode_id=id(self), keep=(o.small,) + keep)
        return o.recv_out, o.recv_count, handle, event, hook

    def _dispatch_send(self, stream, eng: LLInternodeEngine, p, alloc, x, topk_idx, mask: int, send_pos,
                       num_pseudo: int, num_worst: int):
        """A dispatch's send phase on `stream`: the pseudo tokens (`ll_internode_prepare`) and the hybrid dispatch
        of them (`num_pseudo` per rank, `num_worst` rows at the most). Returns `(hybrid handle, ReceivedRows,
        intermediates the receive phase reads)`."""
        n, K, H, fp8 = p.num_tokens, p.num_topk, p.hidden, p.use_fp8
        with _OnStream(p.kind, stream):
            pseudo_x = alloc.empty((n * K, H), 'float8_e4m3fn' if fp8 else 'bfloat16')
            pseudo_sf = alloc.empty((n * K, H // 128), 'float32') if fp8 else None
            pseudo_topk = alloc.empty((n * K, 1), 'int64')
            pseudo_pos = alloc.empty((n * K, 1), 'float32')
            if n:
                ill.launch_prepare(eng.ll_kernels, stream, x, topk_idx, p.num_experts, self.num_ranks,
                                   p.num_max_tokens, mask, fp8, p.round_scale, pseudo_x, pseudo_sf, pseudo_topk,
                                   pseudo_pos, send_pos)
            xs = (pseudo_x, pseudo_sf) if fp8 else pseudo_x
            rx, rtopk, rw, hh, _ = eng.feature.dispatch(
                xs, topk_idx=pseudo_topk, topk_weights=pseudo_pos, num_experts=p.num_experts,
                num_max_tokens_per_rank=num_pseudo, expert_alignment=1, num_sms=0, num_qps=0,
                async_with_compute_stream=False, allocate_on_comm_stream=False, do_handle_copy=False,
                do_cpu_sync=False, do_expand=False, do_zero_padding=False, use_tma_aligned_col_major_sf=False,
                v1=_WorstRows(num_worst))
        inner = hh.inner
        psum = inner.psum_num_recv_tokens_per_scaleup_rank
        rows = ill.ReceivedRows(x=rx, topk=rtopk, weights=rw, meta=inner.recv_src_metadata,
                                num_rows=inner.num_recv_tokens,
                                num_recv_ptr=ill._ptr(psum) + 4 * (interop.shape_of(psum)[0] - 1))
        return hh, rows, (pseudo_x, pseudo_sf, pseudo_topk, pseudo_pos, rx if not fp8 else rx[0],
                          rx[1] if fp8 else None, rtopk, rw, inner.metadata_owner, psum)

    # -- combine --
    def combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False, zero_copy: bool = False,
                async_finish: bool = False, return_recv_hook: bool = False, out=None,
                combine_wait_recv_cost_stats=None):
        """V1's `low_latency_combine` across domains (bit for bit the single-domain arithmetic; see the design).
        `combine_wait_recv_cost_stats` is accepted and left unchanged."""
        p = self.planner.plan_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                      return_recv_hook, out, combine_wait_recv_cost_stats)
        if handle.mode_id != id(self):
            raise ValueError('handle comes from another buffer\'s low_latency_dispatch')
        eng, hh = handle.engine, handle.hybrid_handle
        eng.check_usable()
        k, kind, H = eng.ll_kernels, p.kind, p.hidden
        if zero_copy:
            view = self._staging.get(self._staging_key(self._num_combines % 2, handle))
            if view is None:
                raise RuntimeError('low_latency_combine(zero_copy=True): write the expert outputs into '
                                   'get_next_low_latency_combine_buffer(handle) first')
            src = view
        else:
            src = x
        self._num_combines += 1
        alloc = interop.Allocator(kind)
        current = interop.current_stream(topk_idx)
        combined = out if out is not None else alloc.empty((p.num_tokens, H), 'bfloat16')
        mask = self._mask_ptr()

        def send(stream):
            with _OnStream(kind, stream):
                combine_x = alloc.empty((handle.num_rows, H), 'bfloat16')
                ill.launch_gather(k, stream, ill._ptr(src), handle.row_of, handle.num_rows, handle.num_recv_ptr, H,
                                  combine_x)
                pseudo_out, _, _ = eng.feature.combine(combine_x, hh, None, None, 0, 0, None, None, False, False,
                                                       v1=True)
            return pseudo_out, combine_x

        def receive(stream, pseudo_out):
            if p.num_tokens:
                ill.launch_reduce(k, stream, pseudo_out, topk_idx, topk_weights, handle.send_pos, p.num_experts,
                                  self.num_ranks, mask, combined)

        hook = None
        if return_recv_hook:
            comm = self._fork(current)
            _record(kind, comm, (x, src))
            pseudo_out, combine_x = send(comm)
            hook = _receive_hook(comm, topk_idx, receive, pseudo_out)
            self._held = (pseudo_out, combine_x, x, handle)
            event = EventOverlap(None)
        elif async_finish:
            comm = self._fork(current)
            pseudo_out, combine_x = send(comm)
            receive(comm, pseudo_out)
            _record(kind, comm, (x, topk_idx, topk_weights, combined))
            event = EventOverlap(EventHandle(comm), extra_tensors=(x, topk_idx, topk_weights, combined, pseudo_out,
                                                                   combine_x, handle))
        else:
            pseudo_out, combine_x = send(current)
            receive(current, pseudo_out)
            event = EventOverlap(None)
        return combined, event, hook

    # -- zero-copy staging --
    def _staging_key(self, half: int, handle):
        M, H, E = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        return (half, E // self.num_ranks, self.num_ranks * M, H, handle.kind)

    def get_next_combine_buffer(self, handle):
        """The `[L, R*M, H]` bfloat16 buffer the next `combine(..., zero_copy=True)` reads (two alternate, allocated at
        first use: call this once before capturing CUDA graphs)."""
        if not isinstance(handle, ill.InternodeLLHandle) or handle.mode_id != id(self):
            raise TypeError('handle must come from this buffer\'s low_latency_dispatch')
        key = self._staging_key(self._num_combines % 2, handle)
        view = self._staging.get(key)
        if view is None:
            if _capturing(handle.kind):
                raise RuntimeError('get_next_low_latency_combine_buffer allocates its buffer at first use: call it '
                                   'once (for both halves: two combines) before capturing a CUDA graph')
            _, L, T, H, kind = key
            view = interop.Allocator(kind).empty((L, T, H), 'bfloat16')
            self._staging[key] = view
        return view

    # -- masks --
    def _masks(self):
        if self._mask is None:
            import cupy
            with cupy.cuda.Device(self.planner.device):
                self._mask = cupy.zeros((self.num_ranks,), dtype=cupy.int32)
        return self._mask

    def clean_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """`clean_low_latency_buffer`: the arguments checked; nothing to clean (the composed path keeps no signal or
        counter between calls: every wait lives in the hybrid dispatch / combine of the call)."""
        self.planner.dims(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def destroy(self) -> None:
        if self.engine is not None:
            self.engine.destroy()
        self.engine = None
        self._staging, self._held, self._mask = {}, (), None


def _capturing(kind: str) -> bool:
    """Whether the current stream (torch's for torch arrays, else CuPy's) is capturing a CUDA graph."""
    if kind == 'torch':
        import torch
        return torch.cuda.is_current_stream_capturing()
    import cupy
    return cupy.cuda.get_current_stream().is_capturing()

