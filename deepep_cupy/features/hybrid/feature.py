"""The hybrid EP feature, P1: dispatch / combine across N scale-up domains composed from the verified intranode
engine (`features/ep`) and rail exchanges (`runtime/rails.py`), with the small kernels of kernels_cu/hybrid.cu.

Dispatch at rank (n, r), all on the caller's current stream, then the intranode engine's own streams:
 1. hybrid_route: per token its destination domains (dedup: a token crosses rail r once per domain) and its rail
    position there; hybrid_pack: rows (x, scales, top-k, weights, source token) into the send region of each domain.
 2. rail exchange with the rail peers (m, r). CPU sync: a header-only 'notify' exchange, the host reads the counts
    (hybrid_report, bounded wait), then an exact-size 'dispatch' exchange; no CPU sync / cached / CUDA graphs: one
    static exchange of M rows per peer, counts in the 16-byte headers (no host sync at all).
 3. hybrid_unpack: the forwarder's union input of N * M rows, row s * M + t = token t of the rail peer in domain s
    (own tokens at s = n), top-k masked to this domain's experts (domain-relative ids, -1 elsewhere); rows no token
    fills have top-k -1 and go nowhere.
 4. the intranode dispatch of the union over the domain (E / N experts, N * M tokens per rank): every row reaches every
    local owner; rows arrive grouped by forwarder r, then union row (source domain, token) = `hybrid_row_order`.
 5. `deterministic=True` (the buffer's, read per call; R > 1): the rows are moved into DeepEP's order, one sort by
    src_token_global_idx (deterministic.py; on the communication stream when asynchronous), the handle keeps the
    permutation, and combine moves its input back before the intranode combine.
Combine: the intranode combine back to the forwarder's union rows (FP32 in-domain reduction, one rounding: DeepEP's
reduce_in_scaleup=True), hybrid_combine_pack of the rows of other domains' tokens into the rail send regions (rail
order), the reverse rail exchange, then hybrid_combine_final at the origin: bias, then each domain's partial in
ascending key (the domain's last top-k slot), FP32, one rounding: bitwise `refs.combine(..., reduce_in_scaleup=True)`.

P2 (`DEEPEP_CUPY_HYBRID_PIPELINE`, opt-in; bitwise the same results): the rail rows are split (hybrid_pack_split:
metadata rows, then payload rows, in each region), the metadata crosses first, hybrid_unpack_meta fills the union's
top-k and weights (the intranode notify needs nothing else) and resets a rows-ready counter (a word of this call's fwd
allocation); then, on a side stream forked by an event, the payload exchange runs in chunks of rail rows
(`plan.payload_plan`), each followed (`after_chunk` of either transport) by hybrid_unpack_payload of its rows and
hybrid_ready, which release-stores `plan.rows_ready_after(c)`. Meanwhile the intranode dispatch runs with its
readiness guard (`EP.ready_guard` = (counter, M, SMs left free)): a union row of source token t is read once the
counter passed t (a token's rail position never exceeds t). The caller's stream joins the side stream before the call
returns. Combine: the reverse exchange cut by `plan_exchange(chunk_bytes=...)`; after each chunk, on the side stream
(after an event), hybrid_combine_final of the tokens whose partials all landed (`plan.combine_tokens_ready`). Only
kernels, events and NCCL calls between the chunks: CPU sync, no sync, cached and captured calls all take it.

The fully fused design (features/hybrid/__init__.py) would add: a hierarchical notify instead of the union's padded
N * M rows (the intranode layout pass scans empty rows; worst-case buffers grow with N), forwarding straight into
the receivers' slots (no union copy and no second NVLink pass of the own-domain tokens), chunked rails overlapping
NVLink (P2), and combine units pushed to the forwarder without the union round trip.
"""

import weakref
from typing import Any, Optional, Tuple

from ...constants import NUM_MAX_TOPK, topk_bucket
from ...runtime import interop
from ...runtime.event import EventHandle, EventOverlap, as_event_handle
from ...runtime.polling import wait_until
from ...runtime.rails import plan_exchange
from ...runtime.sizes import ceil_div
from . import deterministic as hdet
from . import plan as hplan
from .checks import DispatchArgs, check_combine_args, check_dispatch_args, check_sorted_combine_args
from .handle import HybridHandle
from .kernels import MAX_DOMAINS, ROUTE_THREADS, THREADS, HybridKernels
from .plan import RailCounts, RoutedRows, UnionRows
from .rails import HybridRails

HOST_BYTES = 4096           # the report record: [seq, send counts [N], recv counts [N]]


def _empty(like, shape, dtype=None):
    """An uninitialised array of the same library, device and (default) dtype as `like`."""
    if interop.is_torch(like):
        import torch
        dt = {'int32': torch.int32, 'int64': torch.int64, 'float32': torch.float32}.get(dtype, dtype) or like.dtype
        return torch.empty(shape, dtype=dt, device=like.device)
    import cupy
    return cupy.empty(shape, dtype=dtype or like.dtype)


def _ptr(a) -> int:
    if a is None:
        return 0
    return a.data_ptr() if interop.is_torch(a) else a.data.ptr


def _stream_after(waiting, done) -> None:
    """Make stream `waiting` wait for the work enqueued on `done` so far (an event; capturable)."""
    EventHandle(done).stream_wait(waiting)


def _capturing(like) -> bool:
    if interop.is_torch(like):
        import torch
        return like.is_cuda and torch.cuda.is_current_stream_capturing()
    import cupy
    return cupy.cuda.get_current_stream().is_capturing()


class HybridEP:
    """The EP feature of a buffer over several scale-up domains (see the module docstring).

    Args:
        buf: the buffer (held weakly by the caller).
        inner: the intranode engine over the domain (features/ep `EP`, laid out for N * M tokens per rank; the
            buffer composes the two features).
        num_max_tokens_per_rank, hidden, num_topk: the buffer's MoE settings (M and hidden are required: they size
            the rail area).
        rails: a `HybridRails` (tests inject one); default: made here (collective).
        kernels_of: `num_topk -> HybridKernels` (tests inject fakes); host: host-mapped memory for the counts.
    """

    def __init__(self, buf, inner, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                 rails: Optional[HybridRails] = None, kernels_of=None, host=None):
        if not (num_max_tokens_per_rank and hidden):
            raise ValueError('hybrid mode (several scale-up domains) needs num_max_tokens_per_rank and hidden at '
                             'construction: they size the rail buffers')
        self._buf = buf
        self.N, self.R = buf.num_scaleout_ranks, buf.num_scaleup_ranks
        self.domain, self.rank = buf.scaleout_rank_idx, buf.rank_idx
        if self.N > MAX_DOMAINS:
            raise ValueError(f'hybrid mode supports at most {MAX_DOMAINS} scale-up domains, got {self.N}')
        self.M, self.hidden, self.num_topk = num_max_tokens_per_rank, hidden, num_topk or NUM_MAX_TOPK
        self._kernels = {}
        self._kernels_of = kernels_of or self._load_kernels
        self.inner = inner
        self.area = hplan.rail_area(self.N, self.M, hidden, self.num_topk)
        self.rails = rails if rails is not None else HybridRails(buf, self.area, self._kernels_of(self.num_topk))
        self._seq = 0
        # P2 (DEEPEP_CUPY_HYBRID_PIPELINE): pipelined rails in dispatch; every rank must agree (the rail exchanges
        # differ: the buffer's design knobs, compared across its ranks when it was made, envs.DesignKnobs).
        # `pipeline` may be switched per call (perf/hybrid_pipeline.py does, on every rank alike); `pipeline_rows`
        # overrides the rows per payload chunk (0: DEEPEP_CUPY_HYBRID_PIPELINE_ROWS, else hplan.pipeline_chunk_rows).
        self.pipeline = bool(buf.design.hybrid_pipeline)
        self.pipeline_rows = 0
        self._rows_setting = buf.design.hybrid_pipeline_rows
        if self.pipeline and getattr(inner, 'fused_notify', False):
            raise ValueError('DEEPEP_CUPY_HYBRID_PIPELINE needs the default intranode dispatch kernel: unset '
                             'DEEPEP_CUPY_EP_FUSED_NOTIFY')
        if getattr(inner, 'fused_notify', False) is None:
            # Unset: the two kernels even at one rank (`pipeline` may be switched on per call, and its readiness guard
            # is theirs; a bound dispatch keeps its kernels)
            inner.fused_notify = False
        self._side = None
        if self.pipeline and rails is None:
            self._payload_stream()      # made now, not inside a first call that a CUDA graph may be capturing
        if host is None:
            from ...runtime.symmetric import HostMappedMemory
            host = HostMappedMemory(HOST_BYTES)
        self._host = host
        self._host_words = self._host.view('int32', 1 + 2 * self.N)
        self._host_ptr = self._host.ptr
        ref = weakref.ref(self)
        buf._rail_barrier = lambda stream: ref() is not None and ref().rails.barrier(stream)
        if num_topk:
            self._kernels_of(num_topk)

    def _load_kernels(self, num_topk: int) -> HybridKernels:
        b = topk_bucket(num_topk)
        if b not in self._kernels:
            self._kernels[b] = HybridKernels(b)
        return self._kernels[b]

    def destroy(self) -> None:
        self.inner.destroy()

    def release(self, collective: bool) -> None:
        """Free the rail memory (after the streams finished; `BufferBase._release_extra`)."""
        if self.rails is not None:
            self.rails.release(collective)
            self.rails = None
        if self._host is not None and hasattr(self._host, 'free'):
            self._host.free()
            self._host = None

    # ---- dispatch ----------------------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: Optional[HybridHandle] = None,
                 do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False, v1=None):
        """`ElasticBuffer.dispatch` across domains (see there); rows come in DeepEP V2's hybrid order. `v1`: DeepEP
        V1's rules and the hooks of its internode handle (v1/internode.py `V1Options`; None: V2's)."""
        self.inner._check_usable()
        a = check_dispatch_args(self, x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                                expert_alignment, previous_event, allocate_on_comm_stream, handle, do_cpu_sync,
                                v1 is not None)
        stream = interop.current_stream(a.x)
        if previous_event is not None:
            as_event_handle(previous_event).stream_wait(stream)
        if a.cpu_sync and not _capturing(a.x):      # as the intranode engine: checked where the host syncs anyway
            a.check_range(self._buf)
        k = self._kernels_of(a.num_topk)
        routed = self._route(k, a, stream)
        if v1 is not None:
            v1.routed(self, stream)
        counts = self._exchange_rows(k, a, routed, stream, v1)
        union = self._unpack(k, a, routed, counts, stream)
        N, Mc = self.N, a.num_max_tokens
        v1_args = {} if v1 is None else dict(num_worst_tokens=v1.num_worst, allow_previous_event_alone=True,
                                             legacy=v1.forward(self, stream, a.topk_idx, union.topk, union.fwd_src,
                                                               union.fwd_count, Mc))
        # With a previous event the intranode engine's stream waits for that event only, not for the current stream:
        # hand it an event recorded after the union was built (the current stream already waited for the caller's).
        self.inner.ready_guard = union.guard
        try:
            recv_x, recv_topk, recv_w, inner_handle, event = self.inner.dispatch(
                (union.x, union.sf) if a.sf is not None else union.x,
                topk_idx=None if handle is not None else union.topk, topk_weights=union.weights,
                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                num_experts=a.num_experts // N, num_max_tokens_per_rank=N * Mc, expert_alignment=expert_alignment,
                num_sms=num_sms, num_qps=num_qps,
                previous_event=None if previous_event is None else EventHandle(stream),
                async_with_compute_stream=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream,
                handle=None if handle is None else handle.inner, do_handle_copy=do_handle_copy, do_cpu_sync=do_cpu_sync,
                do_expand=do_expand, do_zero_padding=do_zero_padding,
                use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, **v1_args)
        finally:
            self.inner.ready_guard = None
            if union.side is not None:
                _stream_after(stream, union.side)   # the payload stream joins the caller's (its reads of the rails too)
        if async_with_compute_stream and interop.is_torch(a.x):
            self._keep_for_comm_stream(union)
        topk = a.topk_idx
        user_topk = handle.topk_idx if handle is not None else topk
        if handle is None and do_handle_copy:
            user_topk = topk.clone() if hasattr(topk, 'clone') else topk.copy()
        order = None
        if self.R > 1 and getattr(self._buf, 'deterministic', False):
            order, event = self._sort(k, inner_handle, recv_x, recv_topk, recv_w, Mc, stream, event,
                                      async_with_compute_stream)
        h = HybridHandle(
            inner_handle, topk_idx=user_topk, num_experts=a.num_experts, num_max_tokens_per_rank=Mc, num_domains=N,
            num_scaleup_ranks=self.R, domain=self.domain, domain_pos=routed.domain_pos, fwd_src=union.fwd_src,
            fwd_count=union.fwd_count, send_counts=counts.send, recv_counts=counts.recv,
            union_topk=union.topk if handle is None else handle.union_topk,
            keep=(union.x, union.sf, union.topk, union.weights, union.fwd, routed.counts), buffer_id=id(self),
            sorted_rows=order)
        return recv_x, recv_topk, recv_w, h, event

    def _route(self, k, a: DispatchArgs, stream) -> RoutedRows:
        """Step 1: hybrid_route (per token its destination domains and rail positions, the rows per domain), then
        hybrid_pack of the rows into the send region of each domain (P2: hybrid_pack_split, metadata then payload)."""
        N, n, Mc, K, T = self.N, self.domain, a.num_max_tokens, a.num_topk, a.num_tokens
        area, base, topk, w = self.area, self.rails.base, a.topk_idx, a.topk_weights
        domain_pos = _empty(topk, (T, N), 'int32')
        counts = _empty(topk, (N,), 'int32')
        k.route.launch(1, ROUTE_THREADS, stream=stream, topk_idx=topk, num_tokens=T, num_topk=K,
                       experts_per_domain=a.num_experts // N, num_domains=N, domain=n, domain_pos=domain_pos,
                       counts=counts, rail_base=base, send_offset=area.send_offset, region_bytes=area.region_bytes)
        xargs = dict(x=a.x, x_row_bytes=a.x_row_bytes, hidden_bytes=a.hidden_bytes, sf=a.sf if a.sf is not None else 0,
                     sf_stride_token=a.sf_strides[0], sf_stride_col=a.sf_strides[1], num_sf=a.num_sf, topk_idx=topk,
                     topk_weights=w if w is not None else 0, num_tokens=T, num_topk=K)
        pipelined = self.pipeline
        split = hplan.split_rows(area, Mc, K, a.num_sf, a.hidden_bytes) if pipelined else None
        if T and pipelined:
            k.pack_split.launch(T, THREADS, stream=stream, **xargs, domain_pos=domain_pos, num_domains=N, domain=n,
                                num_max_tokens=Mc, rail_base=base, send_offset=area.send_offset,
                                region_bytes=area.region_bytes)
        elif T:
            k.pack.launch(T, THREADS, stream=stream, **xargs, domain_pos=domain_pos, num_domains=N, domain=n,
                          rail_base=base, send_offset=area.send_offset, region_bytes=area.region_bytes)
        return RoutedRows(domain_pos=domain_pos, counts=counts, row_args=xargs, pipelined=pipelined, split=split)

    def _exchange_rows(self, k, a: DispatchArgs, routed: RoutedRows, stream, v1) -> RailCounts:
        """Step 2: with a CPU sync the notify (the counts on the host), then the rail exchange of the rows: P1 whole
        rows, exact sizes after a CPU sync, else M rows per peer; P2 the metadata rows only (the payload follows on
        the side stream, `_unpack`)."""
        send_counts = recv_counts = None
        if a.cpu_sync:
            send_counts, recv_counts = self._notify(k, routed.counts, stream, v1)
        rails, Mc = self.rails.rails, a.num_max_tokens
        first = (routed.split.meta_bytes if routed.pipelined else
                 hplan.dispatch_row_bytes(a.num_topk, a.num_sf, a.hidden_bytes))
        plan = plan_exchange(rails, self.area, 'dispatch', hplan.payloads(rails.peer_domains, send_counts, Mc, first),
                             hplan.payloads(rails.peer_domains, recv_counts, Mc, first))
        self.rails.exchange(plan, stream)
        return RailCounts(send=send_counts, recv=recv_counts)

    def _unpack(self, k, a: DispatchArgs, routed: RoutedRows, counts: RailCounts, stream) -> UnionRows:
        """Step 3: hybrid_unpack of the received rows into the forwarder's union input of N * M rows. P2: its
        metadata (hybrid_unpack_meta), then the payload exchange and unpack in chunks on the side stream, which the
        intranode dispatch's readiness guard waits for."""
        N, n, Mc, K = self.N, self.domain, a.num_max_tokens, a.num_topk
        area, base, xa, sf, topk = self.area, self.rails.base, a.x, a.sf, a.topk_idx
        pipelined = routed.pipelined
        union_x = _empty(xa, (N * Mc, xa.shape[1]))
        union_sf = _empty(sf, (N * Mc, a.num_sf)) if sf is not None else None
        union_topk = _empty(topk, (N * Mc, K))
        union_w = _empty(topk, (N * Mc, K), 'float32') if a.topk_weights is not None else None
        fwd = _empty(topk, (N * Mc + N + (1 if pipelined else 0),), 'int32')
        fwd_src, fwd_count = fwd[:N * Mc], fwd[N * Mc:N * Mc + N]
        uargs = dict(experts_per_domain=a.num_experts // N, num_domains=N, domain=n, num_max_tokens=Mc,
                     rail_base=base, recv_offset=area.recv_offset, region_bytes=area.region_bytes, union_x=union_x,
                     union_sf=_ptr(union_sf), union_topk=union_topk, union_weights=_ptr(union_w), fwd_src=fwd_src,
                     fwd_count=fwd_count)
        xargs = routed.row_args
        k.unpack.launch(min(N * Mc, 8192), THREADS, stream=stream, mode=0, **xargs, **uargs)
        guard = side = None
        if pipelined:
            ready = _ptr(fwd) + 4 * (N * Mc + N)
            k.unpack_meta.launch(max(1, min(ceil_div(N * Mc, THREADS), 1024)), THREADS, stream=stream, num_topk=K,
                                 num_sf=a.num_sf, hidden_bytes=a.hidden_bytes, experts_per_domain=a.num_experts // N,
                                 num_domains=N, domain=n, num_max_tokens=Mc, rail_base=base,
                                 recv_offset=area.recv_offset, region_bytes=area.region_bytes, union_topk=union_topk,
                                 union_weights=_ptr(union_w), fwd_src=fwd_src, fwd_count=fwd_count, ready=ready)
            side = self._payload_stream()
            _stream_after(side, stream)
            self._payload(k, routed.split, counts.send, counts.recv, union_x, union_sf, a, ready, side)
            guard = (ready, Mc, hplan.PIPELINE_FREE_SMS)
        else:
            k.unpack.launch(N * Mc, THREADS, stream=stream, mode=1, **xargs, **uargs)
        return UnionRows(x=union_x, sf=union_sf, topk=union_topk, weights=union_w, fwd=fwd, fwd_src=fwd_src,
                         fwd_count=fwd_count, guard=guard, side=side)

    def _keep_for_comm_stream(self, union: UnionRows) -> None:
        """The intranode engine reads the union on its stream after this call returns: keep the caching allocator
        from handing the memory to the current stream meanwhile (torch arrays)."""
        comm = interop.torch_stream(self._buf.comm_stream.ptr)
        for t in (union.x, union.sf, union.topk, union.weights):
            if t is not None:
                t.record_stream(comm)

    def _sort(self, k, inner_handle, recv_x, recv_topk, recv_w, num_max_tokens: int, stream, event, async_: bool):
        """`deterministic=True`: the intranode dispatch's outputs moved (in place) into DeepEP's order
        (deterministic.py), on the current stream, or, asynchronous, on the communication stream where they are
        written (the returned event then covers the sort). Returns `(SortedRows, event)`."""
        fp8 = isinstance(recv_x, tuple)
        rx, rsf = recv_x if fp8 else (recv_x, None)
        on = self._buf.comm_stream if async_ else stream
        order, scratch = hdet.sort_dispatch(k, inner_handle, rx, rsf, recv_topk, recv_w, self.N, self.R,
                                            num_max_tokens, on)
        if async_:
            made = [t for t in (order.meta, scratch) + order.keep if t is not None]
            if interop.is_torch(rx) and rx.is_cuda:
                comm = interop.torch_stream(on.ptr)
                for t in made:
                    t.record_stream(comm)
            kept = tuple(getattr(event, 'extra_tensors', None) or ())
            event = EventOverlap(EventHandle(on), extra_tensors=kept + tuple(made))
        return order, event

    def _payload_stream(self):
        """The side stream of the pipelined payload (made once; never destroyed, as the buffers' streams)."""
        if self._side is None:
            import cupy
            self._side = cupy.cuda.Stream(non_blocking=True)
        return self._side

    def _payload(self, k, split: hplan.SplitRows, send_counts, recv_counts, union_x, union_sf, a, ready: int,
                 side) -> None:
        """P2: the payload exchange in chunks on `side`; after each chunk its rows go into the union and the
        rows-ready counter advances (`hplan.rows_ready_after`), which the intranode dispatch's guard polls. Only
        kernels and NCCL calls are enqueued between the chunks (no host work: capturable)."""
        N, n, Mc = self.N, self.domain, split.num_max_tokens
        rows = self.pipeline_rows or hplan.pipeline_chunk_rows(Mc, split.payload_bytes, self._rows_setting)
        plan = hplan.payload_plan(self.rails.rails, self.area, split, send_counts, recv_counts, rows)
        area, base = self.area, self.rails.base

        def landed(c: int, stream) -> None:
            begin, end = c * rows, hplan.rows_ready_after(c, rows, Mc)
            k.unpack_payload.launch(N * (end - begin), THREADS, stream=stream, num_topk=a.num_topk, num_sf=a.num_sf,
                                    hidden_bytes=a.hidden_bytes, num_domains=N, domain=n, num_max_tokens=Mc,
                                    row_begin=begin, row_end=end, rail_base=base, recv_offset=area.recv_offset,
                                    region_bytes=area.region_bytes, union_x=union_x, union_sf=_ptr(union_sf))
            k.ready.launch(1, 1, stream=stream, ready=ready, value=end)

        self.rails.exchange(plan, side, after_chunk=landed)

    def _notify(self, k, counts, stream, v1=None):
        """CPU sync: the header-only rail exchange, then the send / receive counts on the host (bounded wait)."""
        rails, N, n = self.rails.rails, self.N, self.domain
        zero = {m: 0 for m in rails.peer_domains}
        self.rails.exchange(plan_exchange(rails, self.area, 'notify', zero, zero), stream)
        if v1 is not None:
            v1.notified(self, stream, counts)
        self._seq = seq = (self._seq % 0x7FFFFFFF) + 1
        words = self._host_words
        words[0] = 0
        k.report.launch(1, 1, stream=stream, counts=counts, rail_base=self.rails.base,
                        recv_offset=self.area.recv_offset, region_bytes=self.area.region_bytes, num_domains=N,
                        domain=n, host_out=self._host_ptr, seq=seq)
        buf = self._buf

        transport = self.rails.transport

        def check():
            if int(buf.error_record[0]) != 0:
                buf.check_usable()          # raises the GPU's timeout report (phase and peer)
            transport.check()               # the rail watchdog's error (an NCCL peer that never came, or died)

        def timed_out():
            buf.fail('hybrid notify timed out')
            peer = rails.peer_domains[0]
            raise self.rails.transport.timeout_error('notify', peer, buf.num_cpu_timeout_secs)
        wait_until(lambda: int(words[0]) == seq, buf.num_cpu_timeout_secs, timed_out, check)
        check()
        send = {m: int(words[1 + m]) for m in range(N) if m != n}
        recv = {m: int(words[1 + N + m]) for m in range(N) if m != n}
        for m, c in list(send.items()) + list(recv.items()):
            if not 0 <= c <= self.M:
                raise RuntimeError(f'hybrid notify: rail count {c} for domain {m} is out of range [0, {self.M}]')
        return send, recv

    # ---- combine -----------------------------------------------------------------------------------------------
    def combine(self, x, handle: HybridHandle, topk_weights=None, bias=None, num_sms: int = 0, num_qps: int = 0,
                previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False, v1: bool = False):
        """`ElasticBuffer.combine` across domains (see there): bitwise `refs.combine(..., reduce_in_scaleup=True)`.
        `v1`: DeepEP V1's rules (in-domain weights summed over ranks, a previous event alone: the intranode's)."""
        self.inner._check_usable()
        biases = check_combine_args(self, x, handle, bias)
        k = self._kernels_of(handle.topk_idx.shape[1])
        stream = interop.current_stream(x)
        unsorted = ()
        if handle.sorted_rows is not None:
            # A deterministic dispatch's rows: back into the intranode order first (on this stream, after the
            # caller's previous event; the intranode engine's stream then waits for the move instead).
            check_sorted_combine_args(handle, x, topk_weights)
            if previous_event is not None:
                as_event_handle(previous_event).stream_wait(stream)
            x, topk_weights = unsorted = hdet.unsort_combine(k, handle.sorted_rows, x, topk_weights, stream)
            if previous_event is not None:
                previous_event = EventHandle(stream)
        cx, cw, _ = self.inner.combine(x, handle.inner, topk_weights=topk_weights, num_sms=num_sms, num_qps=num_qps,
                                       previous_event=previous_event, allocate_on_comm_stream=allocate_on_comm_stream,
                                       weights_over_ranks=v1, allow_previous_event_alone=v1)
        out_x, out_w = self._combine_rails(k, handle, x, cx, cw, biases, stream)
        handle.keep_combine = (cx, cw) + tuple(unsorted)
        event = EventOverlap(EventHandle(stream) if async_with_compute_stream else None)
        return out_x, out_w, event

    def _combine_rails(self, k, handle: HybridHandle, x, cx, cw, biases, stream) -> Tuple[Any, Any]:
        """Combine across domains after the intranode combine (`cx`, `cw`: its union rows and weights):
        hybrid_combine_pack of the rows of other domains' tokens into the rail send regions, the reverse rail
        exchange, then hybrid_combine_final at the origin (bias, then each domain's partial in ascending key).
        Returns `(out_x [T, hidden], out_w [T, K] or None)`."""
        N, n, Mc, T = self.N, self.domain, handle.num_max_tokens_per_rank, handle.num_tokens
        K, hidden = handle.topk_idx.shape[1], x.shape[1]
        area, base, rails = self.area, self.rails.base, self.rails.rails
        k.combine_pack.launch(N * Mc, THREADS, stream=stream, combined_x=cx, combined_weights=_ptr(cw), hidden=hidden,
                              num_topk=K, fwd_src=handle.fwd_src, fwd_count=handle.fwd_count, num_domains=N,
                              domain=n, num_max_tokens=Mc, rail_base=base, send_offset=area.send_offset,
                              region_bytes=area.region_bytes)
        row = hplan.combine_row_bytes(hidden, K)
        peers = rails.peer_domains
        # P2: the exchange in chunks of rows; the final reduction of the tokens whose partials landed runs per chunk
        # on the side stream (after an event on this one), overlapping the next chunks. The chunks depend on values
        # every rail peer shares only (not on this rank's token count): the peers must issue the same groups.
        pipelined = self.pipeline
        chunk_bytes = 0
        if pipelined:
            chunk_bytes = row * (self.pipeline_rows or hplan.pipeline_chunk_rows(Mc, row, self._rows_setting))
        plan = plan_exchange(rails, area, 'combine', hplan.payloads(peers, handle.recv_counts, Mc, row),
                             hplan.payloads(peers, handle.send_counts, Mc, row), chunk_bytes=chunk_bytes)
        out_x = _empty(x, (T, hidden))
        out_w = _empty(cw, (T, K)) if cw is not None else None
        fargs = dict(topk_idx=handle.topk_idx, num_tokens=T, num_topk=K, experts_per_domain=handle.num_experts // N,
                     num_domains=N, domain=n, num_max_tokens=Mc, domain_pos=handle.domain_pos, combined_x=cx,
                     combined_weights=_ptr(cw), hidden=hidden, rail_base=base, recv_offset=area.recv_offset,
                     region_bytes=area.region_bytes, bias0=_ptr(biases[0]) if biases else 0,
                     bias1=_ptr(biases[1]) if len(biases) > 1 else 0, num_bias=len(biases), out_x=out_x,
                     out_weights=_ptr(out_w))
        if pipelined:
            side = self._payload_stream()
            done = [0]

            def landed(c: int, exchange_stream) -> None:
                end = hplan.combine_tokens_ready(c, chunk_bytes, row, plan.num_chunks, T)
                if end > done[0]:
                    _stream_after(side, exchange_stream)
                    k.combine_final.launch(end - done[0], THREADS, stream=side, token_begin=done[0], **fargs)
                    done[0] = end

            try:
                self.rails.exchange(plan, stream, after_chunk=landed)
            finally:
                _stream_after(stream, side)
        else:
            self.rails.exchange(plan, stream)
            if T:
                k.combine_final.launch(T, THREADS, stream=stream, token_begin=0, **fargs)
        return out_x, out_w
