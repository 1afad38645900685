"""Normal mode of DeepEP V1's `Buffer` across scale-up domains (DeepEP's internode mode), on the hybrid EP engine
(features/hybrid), with V1's 10-element handle built on the GPU (v1/kernels/internode.py, the design).

`InternodeMode` holds one `InternodeEngine`: symmetric memory with the hybrid feature (rails to the other domains,
the intranode engine over the forwarder's union of N * M rows) laid out for `(M, hidden, top-k)`, built
`deterministic=True` (rows by global source rank, then token: V1's receive order), plus the V1 exchange area (its
extra region) and the handle kernels. The engine is built at the first dispatch, when hidden and top-k are known
(collective: every rank dispatches), and rebuilt (all ranks together) when a call needs more.

- Sizing. M (tokens per rank) = the most whose intranode layout (N * M union rows over the S ranks of a domain) fits
  `num_nvl_bytes` and, when given, whose rail area fits `num_rdma_bytes` (`internode_tokens`); without
  `num_nvl_bytes`, or when that holds fewer tokens than needed, `grown_tokens` of the need.
- Growth (CPU-sync dispatches). A rank holding more than M tokens dispatches 0 and reports its count; every rank
  reports its count in word 2 of its rail headers (`legacy_internode_begin`), each forwarder reads its rail's largest
  on the host while it waits for the hybrid notify anyway (`legacy_internode_report`), and passes
  `N * M + that count` as the intranode dispatch's `LegacyLayout.reported_num_tokens`: after the intranode notify
  every rank of every domain knows the job's largest count (`InternodeCall.max_num_tokens`). When it exceeds M, all
  ranks rebuild the engine for it (a quarter more) and redo the call. No host collective is added to any call.
- No CPU sync (`num_worst_tokens > 0`): as intranode (normal.py), every rank's count must fit M; a rank
  holding more dispatches 0 tokens (its peers do not hang), then raises `ValueError`.
- Handles (`InternodeHandle`) keep their engine alive: combines and cached dispatches of a handle made before a
  rebuild run on the old engine.
"""

from typing import Any, Callable, Optional, Tuple

from ..buffers import hybrid
from ..buffers.base import BufferBase
from ..constants import BUFFER_ALIGNMENT, NUM_MAX_TOPK
from ..features.ep.legacy import LegacyLayout
from ..features.hybrid import plan as hplan
from ..features.hybrid.feature import HybridEP
from ..runtime import checks, interop, workspace
from ..runtime.event import EventHandle, EventOverlap
from ..runtime.rails import FLAGS_BYTES, HEADER_BYTES
from ..runtime.sizes import align
from .kernels import internode
from .normal import (
    DEFAULT_TOKENS,
    TOKEN_ALIGNMENT,
    V1Handle,
    dispatch_with_growth,
    fit_tokens,
    max_tokens,
    needed_bytes,
    split_x,
)

HOST_BYTES = 4096       # legacy_internode_report's words: [rail max, forwarded rows]


# ---- sizes (pure) --------------------------------------------------------------------------------------------------
def rail_tokens(num_domains: int, num_bytes: int, hidden: int, num_topk: int) -> int:
    """The most tokens per rank whose rail area (features/hybrid/plan.py `rail_area`) fits `num_bytes`."""
    row = hplan.rail_area(num_domains, 1, hidden, num_topk).row_bytes
    free = num_bytes - FLAGS_BYTES - 2 * num_domains * HEADER_BYTES
    return max(0, free // (2 * num_domains * row))


def token_limit(num_domains: int, num_scaleup_ranks: int) -> int:
    """The most tokens per rank: the intranode engine holds N * M union rows (`normal.max_tokens`)."""
    return max_tokens(num_scaleup_ranks) // num_domains


def internode_tokens(num_domains: int, num_scaleup_ranks: int, num_nvl_bytes: int, num_rdma_bytes: int, hidden: int,
                     num_topk: int) -> int:
    """M from V1's byte sizes (0: none given): see the module docstring."""
    if num_nvl_bytes <= 0:
        return 0
    m = fit_tokens(num_scaleup_ranks, num_nvl_bytes, hidden, num_topk) // num_domains
    if num_rdma_bytes > 0:
        m = min(m, rail_tokens(num_domains, num_rdma_bytes, hidden, num_topk))
    return min(m, token_limit(num_domains, num_scaleup_ranks))


def grown_tokens(num_tokens: int, num_domains: int, num_scaleup_ranks: int) -> int:
    """M after a growth to hold `num_tokens`: a quarter more, aligned; ValueError beyond the engine's limit."""
    limit = token_limit(num_domains, num_scaleup_ranks)
    if num_tokens > limit:
        raise ValueError(f'a rank dispatches {num_tokens} tokens; this build holds at most {limit} per rank with '
                         f'{num_domains} domains of {num_scaleup_ranks} ranks')
    return min(limit, align(max(num_tokens + num_tokens // 4, DEFAULT_TOKENS), TOKEN_ALIGNMENT))


# ---- the engine --------------------------------------------------------------------------------------------------
class InternodeEngine(hybrid.RailHooks, BufferBase):
    """Symmetric memory with the hybrid EP feature for `geometry = (M, hidden, top-k)` (collective: it makes the
    rails), the V1 exchange area in its extra region and the handle kernels.

    Args:
        group, device, num_cpu_timeout_secs, num_gpu_timeout_secs: as `BufferBase`'s.
        num_max_tokens, hidden, num_topk: the layout; num_domains, num_scaleup_ranks: the topology.
        comm_stream: the V1 Buffer's communication stream; nvlink_gbs: for the intranode engine's SM policy.
    """

    def __init__(self, group, num_max_tokens: int, hidden: int, num_topk: int, num_domains: int,
                 num_scaleup_ranks: int, comm_stream, device: int, nvlink_gbs: float, num_cpu_timeout_secs: float,
                 num_gpu_timeout_secs: float):
        N, S, M = num_domains, num_scaleup_ranks, num_max_tokens
        super().__init__(group=group, num_bytes=needed_bytes(S, N * M, hidden, num_topk), allow_hybrid_mode=True,
                         num_cpu_timeout_secs=num_cpu_timeout_secs, num_gpu_timeout_secs=num_gpu_timeout_secs,
                         explicitly_destroy=False, device=device,
                         config={'num_max_tokens_per_rank': M, 'hidden': hidden, 'num_topk': num_topk},
                         num_extra_bytes=align(internode.area_bytes(S, N, M), BUFFER_ALIGNMENT),
                         comm_stream=comm_stream)
        assert (self.num_scaleout_ranks, self.num_scaleup_ranks) == (N, S), 'the topology changed'
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = M, hidden, num_topk
        self.geometry = (M, hidden, num_topk)
        self.deterministic = True           # V1's receive order (features/hybrid/deterministic.py)
        self.allow_multiple_reduction = self.prefer_overlap_with_compute = True
        self._nvlink_gbs = nvlink_gbs
        self._ep = self._hybrid = self._host = None
        try:
            from ..runtime.symmetric import HostMappedMemory
            self.v1_kernels = internode.InternodeKernels(device)
            self._host = host = HostMappedMemory(HOST_BYTES)
            self.area = internode.ExchangeArea(
                self.sym.peer_bases_ptr, self.extra_offset, self.sym.local_idx, S, internode.slot_words(N, M),
                self.sym.base + self.extra_offset, self.host_mapped.ptr + workspace.HOST_ERROR_RECORD.offset,
                self.timeout_ns, host.view('int32', 2), host.ptr)
            self._ep = hybrid.make_hybrid_ep(self)
        except BaseException:
            self.destroy()
            raise

    @property
    def feature(self) -> HybridEP:
        return self._ep

    def _destroy_features(self) -> None:
        if self._ep is not None:
            self._ep.destroy()
        self._hybrid, self._ep = self._ep, None

    def _release_extra(self, collective: bool) -> None:
        super()._release_extra(collective)
        if self._host is not None:
            self._host.free()
            self._host = None


# ---- the handle --------------------------------------------------------------------------------------------------
class InternodeHandle(V1Handle):
    """DeepEP V1's internode handle (v1.2.1 order; C = `config.num_sms // 2`, D domains of S ranks, R = D * S):
    `(is_token_in_rank [N, R] bool, rdma_channel_prefix_matrix [D, C], gbl_channel_prefix_matrix [R, C],
    recv_rdma_channel_prefix_matrix [D, C], recv_rdma_rank_prefix_sum [D], recv_gbl_channel_prefix_matrix [R, C],
    recv_gbl_rank_prefix_sum [R], recv_src_meta [rows, 8] uint8, send_rdma_head [N, D], send_nvl_head [F, S])`, int32
    unless said; every value as `internode_reference.reference_internode` defines it (v1/kernels/internode.py).
    With num_worst_tokens, recv_src_meta and send_nvl_head have num_worst_tokens rows (past the real counts: source
    domain -1 and bitmask 0, and -1).

    Attributes (for combine and cached dispatch): `hybrid_handle` (the `HybridHandle`), `engine` (the
    `InternodeEngine`, kept alive), `keep` (the allocations the tensors view).
    """


def expected_internode_handle(handle) -> InternodeHandle:
    """`handle` if it is a handle of a normal-mode dispatch across domains of this library; TypeError otherwise."""
    if not isinstance(handle, InternodeHandle):
        raise TypeError(f'handle must be the handle a normal-mode dispatch of a deepep_cupy Buffer across scale-up '
                        f'domains returned, got {type(handle).__name__}')
    return handle


def _ptr(a) -> int:
    return a.data_ptr() if interop.is_torch(a) else a.data.ptr


# ---- the mode ------------------------------------------------------------------------------------------------------
class InternodeMode:
    """The normal-mode calls of one V1 `Buffer` across domains (see the module docstring).

    Args:
        num_domains, num_scaleup_ranks: the topology; num_nvl_bytes, num_rdma_bytes: V1's sizes.
        make_engine: `make_engine(M, hidden, num_topk)` builds an `InternodeEngine` (collective).
    """

    V1_CACHED = internode.V1Options()

    def __init__(self, num_domains: int, num_scaleup_ranks: int, num_nvl_bytes: int, num_rdma_bytes: int,
                 make_engine: Callable[[int, int, int], InternodeEngine]):
        self.num_domains, self.num_scaleup_ranks = num_domains, num_scaleup_ranks
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self._make = make_engine
        self.engine: Optional[InternodeEngine] = None
        self.num_growths = 0        # engines replaced
        self.tokens_seen = 0        # the most tokens any rank dispatched in a CPU-synced call (known to every rank)

    def ensure(self, hidden: int, num_topk: int, num_tokens: int = 0) -> InternodeEngine:
        """The engine for calls of `hidden` and `num_topk` with room for `num_tokens` tokens per rank, built or
        rebuilt as needed. Collective whenever it changes anything: every rank must call it with equal arguments."""
        N, S, eng = self.num_domains, self.num_scaleup_ranks, self.engine
        M, H, K = eng.geometry if eng is not None else (0, 0, 0)
        if eng is not None and hidden <= H and num_topk <= K and num_tokens <= M:
            return eng
        H, K, need = max(hidden, H), max(num_topk, K), max(num_tokens, self.tokens_seen, 1)
        m = internode_tokens(N, S, self.num_nvl_bytes, self.num_rdma_bytes, H, K)
        if m < need:
            m = grown_tokens(need, N, S)
        if eng is not None:
            # Every rank's kernels on the old engine are done before it may be freed (handles may keep it).
            eng.barrier(with_cpu_sync=True)
            self.num_growths += 1
        self.engine = eng = self._make(m, H, K)
        return eng

    # -- dispatch --
    def dispatch(self, x, is_token_in_rank, topk_idx, topk_weights, expert_alignment: int, num_worst_tokens: int,
                 num_experts: int, num_sms: int, previous_event, async_finish: bool, allocate_on_comm_stream: bool):
        """A non-cached V1 dispatch across domains (arguments checked by the caller, `num_experts` from the layout
        tensors; top-k ids required).

        Returns:
            V1's `(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)`.
        """
        split = split_x(x)
        data, _, T, hidden = split
        tshape = interop.shape_of(topk_idx, 'topk_idx')
        if len(tshape) != 2 or tshape[0] != T or not 1 <= tshape[1] <= NUM_MAX_TOPK:
            raise ValueError(f'topk_idx must be [num_tokens={T}, 1..{NUM_MAX_TOPK}], got {list(tshape)}')
        K, R, C = tshape[1], self.num_domains * self.num_scaleup_ranks, num_sms // 2
        if C > internode.NUM_MAX_CHANNELS:
            raise ValueError(f'config.num_sms / 2 = {C} channels; at most {internode.NUM_MAX_CHANNELS}')
        kind = 'torch' if interop.is_torch(data) else 'cupy'
        ii = checks.info(is_token_in_rank, 'is_token_in_rank', interop.tensor_info(data, 'x').device)
        checks.check_dtype(ii, 'is_token_in_rank', 'bool')
        checks.check_shape(ii, 'is_token_in_rank', (T, R))
        worst = num_worst_tokens > 0

        def attempt(eng, M, over, xs, ts, ws):
            n = 0 if over else T
            call = internode.InternodeCall(eng.v1_kernels, eng.area, kind, n, n if worst else T, num_experts, C,
                                           num_worst_tokens, LegacyLayout,
                                           eng.comm_stream if allocate_on_comm_stream else None)
            out = eng.feature.dispatch(
                xs, topk_idx=ts, topk_weights=ws, num_experts=num_experts, num_max_tokens_per_rank=M,
                expert_alignment=expert_alignment, num_sms=num_sms, previous_event=previous_event,
                async_with_compute_stream=async_finish, allocate_on_comm_stream=allocate_on_comm_stream,
                do_handle_copy=True, do_cpu_sync=not worst, do_expand=False, do_zero_padding=False,
                use_tma_aligned_col_major_sf=False, v1=call)
            if worst and over:
                # (its receive still runs before the refusal: the exchange area's slots of this call must be
                # acknowledged)
                _receive(eng, call, out[3], is_token_in_rank, interop.current_stream(data), out[4], async_finish)
            return out, call
        eng, out, call = dispatch_with_growth(self, x, split, K, topk_idx, topk_weights, worst, attempt)
        recv_x, recv_topk_idx, recv_topk_weights, hh, event = out
        handle, event = _receive(eng, call, hh, is_token_in_rank, interop.current_stream(data), event, async_finish)
        return recv_x, recv_topk_idx, recv_topk_weights, hh.num_recv_tokens_per_expert_list, handle, event

    @staticmethod
    def cached_dispatch(x, handle: InternodeHandle, num_sms: int, previous_event, async_finish: bool,
                        allocate_on_comm_stream: bool):
        """V1's cached dispatch: `(recv_x, None, None, None, None, event)` (same rows, same order)."""
        recv_x, _, _, _, event = handle.engine.feature.dispatch(
            x, num_sms=num_sms, previous_event=previous_event, async_with_compute_stream=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream, handle=handle.hybrid_handle, v1=InternodeMode.V1_CACHED)
        return recv_x, None, None, None, None, event

    @staticmethod
    def combine(x, handle: InternodeHandle, topk_weights, bias, num_sms: int, previous_event, async_finish: bool,
                allocate_on_comm_stream: bool) -> Tuple[Any, Any, EventOverlap]:
        """V1's combine: `(combined_x, combined_topk_weights, event)`; the weights are the FP32 sum over the token's
        destination ranks (in-domain sums by the intranode combine, the domains' by `combine_weights`)."""
        eng, hh = handle.engine, handle.hybrid_handle
        feat = eng.feature
        combined_x, combined_w, event = feat.combine(
            x, hh, topk_weights=topk_weights, bias=bias, num_sms=num_sms, previous_event=previous_event,
            async_with_compute_stream=async_finish, allocate_on_comm_stream=allocate_on_comm_stream, v1=True)
        if combined_w is not None:
            stream = interop.current_stream(x)
            internode.combine_weights(eng.v1_kernels, feat, hh, combined_w, interop.shape_of(x)[1], stream)
            if async_finish:
                event = EventOverlap(EventHandle(stream), extra_tensors=event.extra_tensors)
        return combined_x, combined_w, event

    def destroy(self) -> None:
        """Collective teardown of the current engine (older ones, kept by handles, are freed when dropped)."""
        if self.engine is not None:
            self.engine.destroy()
        self.engine = None


def _receive(eng: InternodeEngine, call, hh, is_token_in_rank, current, event, async_finish: bool):
    """The receiver's handle parts (after the hybrid dispatch's sort: on the current stream, or asynchronously on the
    communication stream where the rows were written) and the handle; returns `(handle, event)`."""
    feat = eng.feature
    inner = hh.inner
    # Column 0: the global source index `src_rank * M + token` (sorted rows; one rank per domain: the intranode
    # index `s * M + t` is that already).
    meta = hh.sorted_rows.meta if hh.sorted_rows is not None else inner.recv_src_metadata
    psum = inner.psum_num_recv_tokens_per_scaleup_rank
    on = eng.comm_stream if async_finish else current
    recv_psum, recv_chan, recv_meta, flat = call.receive(on, meta, interop.shape_of(meta)[0],
                                                         _ptr(psum) + 4 * (interop.shape_of(psum)[0] - 1), feat.N,
                                                         hh.num_max_tokens_per_rank)
    rdma, gbl, recv_rdma, recv_rdma_sum, send_nvl_head, forwarded = call.forwarded
    handle = InternodeHandle((is_token_in_rank, rdma, gbl, recv_rdma, recv_rdma_sum, recv_chan, recv_psum, recv_meta,
                              hh.domain_pos, send_nvl_head), hybrid_handle=hh, engine=eng,
                             keep=(flat, forwarded, call.call_words))
    if async_finish:
        made = (flat, call.call_words, meta, psum)
        if call.kind == 'torch':
            comm = interop.torch_stream(on.ptr)
            for t in made:
                t.record_stream(comm)
        event = EventOverlap(EventHandle(on), extra_tensors=tuple(event.extra_tensors or ()) + made)
    return handle, event
