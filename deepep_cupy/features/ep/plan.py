"""The pure part of dispatch and combine: argument checks, sizes, the SM policy and the output allocation sizes, as
functions of the buffer's settings (`EPSettings`) and the call's arguments. No GPU and no buffer object is needed:
tests/test_ep_checks_cpu.py drives them with CPU tensors. Every user error raises `ValueError` / `TypeError` naming the
argument, before any EP kernel runs (the buffer stays usable)."""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from ...runtime import checks
from ...runtime.event import EventHandle, as_event_handle
from ...runtime.interop import TensorInfo
from ...runtime.sizes import align, ceil_div
from . import layout
from .dispatch_checks import check_side_arrays, check_topk_idx, check_x, resolve_routing
from .handle import EPHandle
from .kernels import COMBINE_CHUNK_ROWS, COMBINE_CHUNK_SIGNAL_BYTES, NOTIFY_THREADS
from .legacy import LegacyLayout
from .settings import EPSettings

NUM_MAX_NOTIFY_SMEM_BYTES = 200 * 1024
DIRECT_QPS, HYBRID_QPS = 17, 129        # DeepEP's num_allocated_qps for 0 (hybrid: 65 on MT4131 NICs)


# ---- SM and QP policy ----------------------------------------------------------------------------------------------
def theoretical_num_sms(num_ranks: int, num_experts: int, num_topk: int, nvlink_gbs: float, num_device_sms: int,
                        prefer_overlap_with_compute: bool = True, sm_read_gbs: float = 200,
                        sm_write_gbs: float = 50) -> int:
    """SMs for the send kernels so that they can drive NVLink at full speed (DeepEP V2's analytic model, direct mode,
    balanced routing assumed)."""
    if num_ranks == 1:
        return 4
    # Expected distinct destination ranks of a token: R * (1 - C(E - E/R, K) / C(E, K)).
    per_rank = num_experts // num_ranks
    miss = math.comb(num_experts - per_rank, num_topk) / math.comb(num_experts, num_topk)
    t = num_ranks * (1 - miss)
    read = 1 / t
    write = 1.0
    nvlink = 1 - 1 / num_ranks
    bw = nvlink_gbs / nvlink
    sms = max(bw * read / sm_read_gbs, bw * write / sm_write_gbs)
    sms = align(max(4, math.ceil(1.25 * sms)), 2)
    if not prefer_overlap_with_compute:
        sms = max(sms, 64)
    return min(sms, num_device_sms)


def resolve_num_allocated_qps(num_allocated_qps: int, hybrid: bool) -> int:
    """DeepEP's default for `num_allocated_qps=0`: 17 in direct mode, 129 in hybrid mode (65 on ConnectX MT4131
    NICs upstream; this build has no RDMA path); any other value is kept."""
    if num_allocated_qps:
        return num_allocated_qps
    return HYBRID_QPS if hybrid else DIRECT_QPS


def theoretical_num_qps(num_sms: int, hybrid: bool, num_allocated_qps: int) -> int:
    """DeepEP's QPs for `num_sms` SMs: `min(num_sms, 9)` direct, `num_sms * 16 + 1` hybrid, at most
    `num_allocated_qps` (QPs carry no traffic inside one NVLink domain)."""
    return min(num_sms * 16 + 1 if hybrid else min(num_sms, 9), num_allocated_qps)


# ---- sizes -----------------------------------------------------------------------------------------------------------
def notify_smem_bytes(num_experts: int, num_ranks: int) -> int:
    """Dynamic shared memory of the notify kernel: per-warp counts, block bases and totals per key."""
    return (NOTIFY_THREADS // 32 + 2) * (num_experts + num_ranks) * 4


def notify_grid(num_tokens: int, num_co_resident_blocks: int) -> int:
    """Blocks of a notify launch (kernels_cu/ep_notify.cu): one per NOTIFY_THREADS tokens, at most the blocks that can
    be co-resident (`Kernel.co_resident_blocks`; the launch is cooperative when it has several blocks, and a grid
    barrier needs them all resident), past which the blocks take several tiles of tokens each. At least 1."""
    return max(1, min(ceil_div(num_tokens, NOTIFY_THREADS), num_co_resident_blocks))


def epilogue_blocks(num_rows: int, row_bytes: int, num_device_sms: int) -> int:
    """Blocks (16 warps each) of a receive epilogue: a warp per row segment of up to 1 KiB (two 16-byte loads per
    lane), at most one block per SM. Decode-size calls get enough warps to split rows instead of walking them."""
    segments = max(1, ceil_div(row_bytes, 1024))
    return min(num_device_sms, max(1, ceil_div(num_rows * segments, 16)))


def worst_expanded_rows(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_local_experts: int,
                        expert_alignment: int) -> int:
    """Rows of an expanded output without a CPU sync: every (token, local expert) pair plus alignment gaps."""
    pairs = num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts)
    return align(pairs + (expert_alignment - 1) * num_local_experts, expert_alignment)


def layout_for(settings: EPSettings, num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> layout.EPLayout:
    """The EP regions of the data region for these sizes; `ValueError` if the buffer is too small."""
    lay = layout.EPLayout(settings.num_ranks, num_max_tokens_per_rank, hidden, num_topk,
                          settings.allow_multiple_reduction, settings.data_offset)
    if lay.end_offset > settings.sym_num_bytes:
        raise ValueError(f'num_bytes={settings.num_bytes} is too small for num_max_tokens_per_rank='
                         f'{num_max_tokens_per_rank}, hidden={hidden}, num_topk={num_topk}: need '
                         f'{align(lay.end_offset - settings.data_offset, layout.BUFFER_ALIGNMENT)} bytes '
                         f'(see get_buffer_size_hint)')
    return lay


def _bias_list(bias) -> Tuple[Any, ...]:
    if bias is None:
        return ()
    if isinstance(bias, (tuple, list)):
        if len(bias) > 2:
            raise ValueError(f'bias must be None, a tensor or a tuple of at most 2 tensors, got {len(bias)}')
        return tuple(b for b in bias if b is not None)
    return (bias,)


def _check_previous_event(previous_event, allocate_on_comm_stream: bool,
                          allow_previous_event_alone: bool = False) -> Optional[EventHandle]:
    if previous_event is not None and not allocate_on_comm_stream and not allow_previous_event_alone:
        raise ValueError('previous_event requires allocate_on_comm_stream=True (DeepEP V2 rule)')
    return as_event_handle(previous_event)


# ---- dispatch --------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class DispatchPlan:
    """A checked dispatch: what the launch path needs."""
    kind: str                          # 'torch' or 'cupy'
    fp8: bool                          # x came as (x_fp8, sf)
    x: Any
    xi: TensorInfo
    sf: Any                            # scale factors (FP8), or None
    sfi: Optional[TensorInfo]
    num_sf: int
    topk_idx: Any                      # the call's, or the handle's for a cached dispatch
    ti: TensorInfo
    topk_weights: Any
    stats: Any                         # cumulative_local_expert_recv_stats
    num_tokens: int
    hidden: int
    hidden_bytes: int
    num_topk: int                      # K
    num_local_experts: int             # L
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    handle: Optional[EPHandle]         # the cached dispatch's handle
    do_cpu_sync: bool
    do_expand: bool
    do_zero_padding: bool
    do_handle_copy: bool
    use_tma_aligned_col_major_sf: bool
    num_sms: int
    notify_smem_bytes: int
    layout: layout.EPLayout
    new_layout: bool                   # the layout was made by this call (the EP feature claims the data region)
    previous_event: Optional[EventHandle]
    num_worst_tokens: int = 0          # no CPU sync, non-expanded: exactly this many output rows (0: R * M)
    legacy: Optional[LegacyLayout] = None
    cached: bool = False               # a cached dispatch (handle given)

    def without_arrays(self) -> 'DispatchPlan':
        """This plan holding no array, handle or event (what a remembered plan keeps: it must not keep a call's
        tensors alive); array infos keep their metadata, topk_weights becomes True where it was given; the
        `LegacyLayout` (a call's V1 inputs and outputs) is dropped: the bound dispatch keeps what of it is fixed."""
        def info(t: Optional[TensorInfo]) -> Optional[TensorInfo]:
            return None if t is None else dataclasses.replace(t, obj=None)
        return dataclasses.replace(self, x=None, xi=info(self.xi), sf=None, sfi=info(self.sfi), topk_idx=None,
                                   ti=info(self.ti), topk_weights=None if self.topk_weights is None else True,
                                   stats=None, handle=None, previous_event=None, legacy=None)


def _checked_layout(s: EPSettings, lay: Optional[layout.EPLayout], num_max_tokens_per_rank: int, hidden: int,
                    hidden_bytes: int, num_sf: int, num_topk: int, num_experts: int) -> layout.EPLayout:
    """The EP regions (`lay`, or laid out now when None), checked to hold this dispatch."""
    R = s.num_ranks
    if lay is None:
        lay = layout_for(s, num_max_tokens_per_rank, hidden, num_topk)
    msg_bytes = layout.message_bytes(hidden_bytes, num_sf, num_topk)
    if R * num_max_tokens_per_rank * msg_bytes > lay.dispatch_recv_bytes:
        raise ValueError(f'buffer too small for this dispatch (num_max_tokens_per_rank={num_max_tokens_per_rank}, '
                         f'hidden={hidden}, num_topk={num_topk}): build it with get_buffer_size_hint for these sizes')
    if ceil_div(num_max_tokens_per_rank, NOTIFY_THREADS) * (num_experts + R) * 4 > \
            lay.scratch_bytes(R * layout.NUM_MAX_LOCAL_EXPERTS):
        raise ValueError('num_max_tokens_per_rank is larger than the buffer was built for')
    return lay


def _checked_local_experts(s: EPSettings, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms,
                           num_tokens: int) -> int:
    """The dispatch's counts are integers in range, its experts split evenly over the ranks (at most
    `NUM_MAX_LOCAL_EXPERTS` per rank) and x's tokens within num_max_tokens_per_rank; returns the experts per rank."""
    checks.check_int('num_experts', num_experts, 1)
    checks.check_int('expert_alignment', expert_alignment, 1)
    checks.check_int('num_max_tokens_per_rank', num_max_tokens_per_rank, 1)
    checks.check_int('num_sms', num_sms, 0)
    R = s.num_ranks
    if num_experts % R != 0:
        raise ValueError(f'num_experts={num_experts} must be a multiple of the number of ranks ({R})')
    L = num_experts // R
    if L > layout.NUM_MAX_LOCAL_EXPERTS:
        raise ValueError(f'num_experts / num_ranks = {L} local experts; at most {layout.NUM_MAX_LOCAL_EXPERTS}')
    if num_tokens > num_max_tokens_per_rank:
        raise ValueError(f'x has {num_tokens} tokens, more than num_max_tokens_per_rank={num_max_tokens_per_rank}')
    return L


def _check_modes(do_cpu_sync: bool, do_expand: bool, do_zero_padding: bool, cached: bool, num_worst_tokens,
                 legacy: Optional[LegacyLayout], num_tokens: int) -> None:
    """The dispatch's modes fit together: zero padding needs expanded outputs, `num_worst_tokens` a non-cached,
    non-expanded dispatch without CPU sync, a `LegacyLayout` (checked here) a non-cached dispatch."""
    if do_zero_padding and not do_expand:
        raise ValueError('do_zero_padding=True needs do_expand=True')
    checks.check_int('num_worst_tokens', num_worst_tokens, 0)
    if num_worst_tokens and (do_cpu_sync or do_expand or cached):
        raise ValueError('num_worst_tokens > 0 needs a non-cached, non-expanded dispatch without CPU sync')
    if legacy is not None:
        if not isinstance(legacy, LegacyLayout):
            raise TypeError(f'legacy must be a LegacyLayout or None, got {type(legacy).__name__}')
        if cached:
            raise ValueError('a cached dispatch takes no LegacyLayout (its handle has the layout)')
        legacy.check(num_tokens)


def plan_dispatch(s: EPSettings, lay: Optional[layout.EPLayout], x, topk_idx, topk_weights, stats,
                  num_experts: Optional[int], num_max_tokens_per_rank: Optional[int],
                  expert_alignment: Optional[int], num_sms: int, previous_event, allocate_on_comm_stream: bool,
                  handle: Optional[EPHandle], do_handle_copy: bool, do_cpu_sync: Optional[bool], do_expand: bool,
                  do_zero_padding: bool, use_tma_aligned_col_major_sf: bool,
                  start_range: Optional[Callable[[TensorInfo], Callable[[], Tuple[int, int]]]] = None,
                  num_worst_tokens: int = 0, allow_previous_event_alone: bool = False,
                  legacy: Optional[LegacyLayout] = None) -> DispatchPlan:
    """Check a dispatch (`ElasticBuffer.dispatch`'s arguments) and size it.

    The DeepEP V1 adapter's options (defaults: V2's behaviour): `num_worst_tokens` > 0 gives a no-sync,
    non-expanded dispatch exactly that many output rows (the rows past the real count: top-k -1, metadata -1; it must
    be at least the rows received); `allow_previous_event_alone` accepts `previous_event` without
    `allocate_on_comm_stream` (V1's rule); `legacy` (a `LegacyLayout`, non-cached only) asks for V1's handle parts.

    `start_range(topk_idx_info)` starts reading topk_idx's (min, max) back (a GPU kernel) and returns the function that
    waits for it; it is called for a CPU-sync dispatch once the top-k ids passed their other checks, so the GPU works
    while the remaining checks run, and its values are checked last. None: no value check."""
    xa = check_x(s, x)
    xi = xa.xi
    kind = xi.kind
    num_tokens, hidden = xi.shape
    cached = handle is not None
    route = resolve_routing(s, xi, handle, topk_idx, num_experts=num_experts,
                            num_max_tokens_per_rank=num_max_tokens_per_rank, expert_alignment=expert_alignment,
                            do_cpu_sync=do_cpu_sync)
    num_experts, expert_alignment = route.num_experts, route.expert_alignment
    num_max_tokens_per_rank, do_cpu_sync = route.num_max_tokens_per_rank, route.do_cpu_sync
    L = _checked_local_experts(s, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, num_tokens)
    R = s.num_ranks
    _check_modes(do_cpu_sync, do_expand, do_zero_padding, cached, num_worst_tokens, legacy, num_tokens)
    ti = check_topk_idx(s, kind, route.topk_idx, num_tokens, num_experts, legacy)
    K = ti.shape[1]
    # The value range needs the GPU: start it now, read it after the other checks.
    range_check = start_range(ti) if start_range is not None and do_cpu_sync and not cached else None
    check_side_arrays(s, kind, topk_weights, stats, num_tokens, K, L)
    smem = notify_smem_bytes(num_experts, R)
    if smem > NUM_MAX_NOTIFY_SMEM_BYTES:
        raise ValueError(f'num_experts={num_experts} is too large for the notify kernel (at most 4096)')
    hidden_bytes = hidden * xi.itemsize
    new_layout = lay is None
    lay = _checked_layout(s, lay, num_max_tokens_per_rank, hidden, hidden_bytes, xa.num_sf, K, num_experts)
    # A cached dispatch sends like the dispatch that made its handle (as combine does).
    num_sms = num_sms or (handle.num_sms if cached else s.default_num_sms or theoretical_num_sms(
        R, num_experts, K, s.nvlink_gbs, s.num_device_sms, s.prefer_overlap_with_compute))
    num_sms = min(num_sms, s.num_device_sms)
    if range_check is not None:
        lo, hi = range_check()
        if lo < -1 or hi >= num_experts:
            raise ValueError(f'topk_idx values must be in [-1, {num_experts}), got min {lo}, max {hi}')
    event = _check_previous_event(previous_event, allocate_on_comm_stream, allow_previous_event_alone)
    return DispatchPlan(
        kind=kind, fp8=xa.fp8, x=xa.x, xi=xi, sf=xa.sf, sfi=xa.sfi, num_sf=xa.num_sf, topk_idx=route.topk_idx, ti=ti,
        topk_weights=topk_weights, stats=stats, num_tokens=num_tokens, hidden=hidden, hidden_bytes=hidden_bytes,
        num_topk=K, num_local_experts=L, num_experts=num_experts, expert_alignment=expert_alignment,
        num_max_tokens_per_rank=num_max_tokens_per_rank, handle=handle if cached else None, do_cpu_sync=do_cpu_sync,
        do_expand=bool(do_expand), do_zero_padding=bool(do_zero_padding), do_handle_copy=bool(do_handle_copy),
        use_tma_aligned_col_major_sf=bool(use_tma_aligned_col_major_sf), num_sms=num_sms, notify_smem_bytes=smem,
        layout=lay, new_layout=new_layout, previous_event=event, num_worst_tokens=num_worst_tokens, legacy=legacy,
        cached=cached)


@dataclass(slots=True)
class DispatchOutputs:
    """Sizes of a dispatch's outputs once the receive counts are known (exact after a CPU sync, worst case else)."""
    num_recv: int                      # rows of the non-expanded outputs and of the metadata
    num_expanded: int
    aligned_counts: List[int]          # num_recv_tokens_per_expert_list (empty without a CPU sync)
    num_out_rows: int                  # rows of recv_x (expanded or not)
    sf_shape: Optional[Tuple[int, int]]   # storage of recv_sf: (num_sf, padded rows) column-major, or (rows, num_sf)
    sf_strides: Tuple[int, int]        # element strides of recv_sf (row, column)
    topk_idx_shape: Optional[Tuple[int, int]]
    topk_weights_shape: Optional[Tuple[int, ...]]
    metadata_shape: Tuple[int, int]
    epilogue_blocks: int


def dispatch_counts(p: DispatchPlan, handle: Optional[EPHandle] = None) -> Tuple[int, int, List[int]]:
    """`(num_recv, num_expanded, aligned counts)` of a dispatch without a CPU sync: the handle's for a cached one
    (`handle`, default the plan's; worst case for an expanded output the handle was not made for), else the worst
    case."""
    R, M, K, L, A = p.layout.num_ranks, p.num_max_tokens_per_rank, p.num_topk, p.num_local_experts, p.expert_alignment
    if p.cached:
        h = handle if handle is not None else p.handle
        num_expanded = h.num_expanded_tokens
        if p.do_expand and not h.do_expand and not h.do_cpu_sync:
            num_expanded = worst_expanded_rows(R, M, K, L, A)
        return h.num_recv_tokens, num_expanded, list(h.num_recv_tokens_per_expert_list)
    return p.num_worst_tokens or R * M, worst_expanded_rows(R, M, K, L, A), []


def dispatch_outputs(p: DispatchPlan, num_recv: int, num_expanded: int, aligned_counts: List[int],
                     num_device_sms: int) -> DispatchOutputs:
    """The output sizes of a checked dispatch for these receive counts."""
    num_out_rows = num_expanded if p.do_expand else num_recv
    sf_shape, sf_strides = None, (0, 0)
    if p.sfi is not None:
        if p.use_tma_aligned_col_major_sf:
            padded = align(num_out_rows, 4)
            sf_shape, sf_strides = (p.num_sf, padded), (1, padded)
        else:
            sf_shape, sf_strides = (num_out_rows, p.num_sf), (p.num_sf, 1)
    K = p.num_topk
    weights = None
    if p.topk_weights is not None:
        weights = (num_out_rows,) if p.do_expand else (num_recv, K)
    return DispatchOutputs(num_recv, num_expanded, aligned_counts, num_out_rows, sf_shape, sf_strides,
                           None if p.do_expand else (num_recv, K), weights, (num_recv, K + 2),
                           epilogue_blocks(max(num_recv, num_out_rows), p.hidden_bytes, num_device_sms))


# ---- combine ---------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class CombinePlan:
    """A checked combine: what the launch path needs."""
    kind: str
    x: Any
    xi: TensorInfo
    handle: EPHandle
    hidden: int
    topk_weights: Any
    biases: Tuple[Any, ...]
    local_reduce: bool
    num_slots: int
    num_send_blocks: int
    num_reduce_blocks: int
    chunk_stride: int
    previous_event: Optional[EventHandle]
    weights_over_ranks: bool = False   # DeepEP V1's combined_topk_weights: the sum over the destination ranks


def combine_blocks(num_sms: int, dispatch_num_sms: int, num_ranks: int, num_tokens: int, hidden: int,
                   num_device_sms: int, cap_all_sms: bool = False) -> Tuple[int, int]:
    """`(sending, reducing)` blocks of a combine (one launch, one block per SM, all co-resident; the reducers sum
    each token once its chunks arrived). `num_sms` (0: the dispatch's) is DeepEP's: the SMs that communicate; the
    reducers take the SMs the senders leave (as many as the reduction can use), as DeepEP's reduce epilogue takes the
    whole GPU. One rank sends nothing (its own partials never leave it): every block reduces.

    Capping the reducers by `num_sms` too makes a combine with the SM counts DeepEP's programs and vLLM pass (its
    `get_theoretical_num_sms`) up to 60x slower at one rank (4 SMs) and halves the senders on two, so it is opt-in:
    with `cap_all_sms` (`DEEPEP_CUPY_COMBINE_CAP_ALL_SMS`, for callers that overlap compute with the combine), the
    senders and reducers together take at most `num_sms` (0: the dispatch's) SMs, half sending (at least one block
    of each role with several ranks, so 2 SMs when `num_sms` is 1)."""
    if cap_all_sms:
        cap = max(1, min(num_sms or dispatch_num_sms, num_device_sms))
        num_send = 0 if num_ranks == 1 else max(1, cap // 2)
        return num_send, max(1, min(cap - num_send, epilogue_blocks(num_tokens, 2 * hidden, num_device_sms)))
    if num_ranks == 1:
        num_send = 0
    else:
        num_send = max(1, min(num_sms or dispatch_num_sms, num_device_sms - 1))
    num_reduce = max(1, min(num_device_sms - num_send, epilogue_blocks(num_tokens, 2 * hidden, num_device_sms)))
    return num_send, num_reduce


def plan_combine(s: EPSettings, lay: Optional[layout.EPLayout], x, handle, topk_weights, bias, num_sms: int,
                 previous_event, allocate_on_comm_stream: bool, weights_over_ranks: bool = False,
                 allow_previous_event_alone: bool = False, cap_all_sms: bool = False) -> CombinePlan:
    """Check a combine (`ElasticBuffer.combine`'s arguments) and size it (blocks per role: `combine_blocks`).

    The DeepEP V1 adapter's options (defaults: V2's behaviour): `weights_over_ranks` makes combined_topk_weights[t][k]
    the sum over the token's destination ranks of what each returned for slot k (non-expanded handles only);
    `allow_previous_event_alone` as in `plan_dispatch`. `cap_all_sms`: see `combine_blocks`."""
    if not isinstance(handle, EPHandle):
        raise TypeError(f'handle must be an EPHandle, got {type(handle).__name__}')
    if handle.buffer_id != s.owner_id:
        raise ValueError('handle was made by another buffer; use the buffer that dispatched it')
    xi = checks.info(x, 'x', s.device)
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
    K, N, R = handle.num_topk, handle.num_tokens, s.num_ranks
    local_reduce = not (handle.do_expand and not s.allow_multiple_reduction)
    if weights_over_ranks and handle.do_expand:
        raise ValueError('weights_over_ranks (DeepEP V1 combined weights) needs a non-expanded dispatch handle')
    num_slots = layout.num_combine_slots(R, K, local_reduce)
    if N * num_slots * layout.combine_slot_bytes(hidden, K) > lay.combine_recv_bytes or \
            handle.num_max_tokens_per_rank * num_slots * layout.combine_slot_bytes(hidden, K) > \
            lay.combine_recv_bytes:
        raise ValueError(f'buffer too small for a combine with hidden={hidden}, num_topk={K}')
    if topk_weights is not None:
        wi = checks.info(topk_weights, 'topk_weights', s.device)
        checks.check_same_kind(kind, wi, 'topk_weights')
        checks.check_dtype(wi, 'topk_weights', 'float32')
        checks.check_shape(wi, 'topk_weights', (handle.num_rows,) if handle.do_expand else (handle.num_rows, K))
        checks.check_contiguous(wi, 'topk_weights')
    biases = _bias_list(bias)
    for j, b in enumerate(biases):
        bi = checks.info(b, f'bias[{j}]', s.device)
        checks.check_same_kind(kind, bi, f'bias[{j}]')
        checks.check_dtype(bi, f'bias[{j}]', 'bfloat16')
        checks.check_shape(bi, f'bias[{j}]', (N, hidden))
        checks.check_contiguous(bi, f'bias[{j}]')
    checks.check_int('num_sms', num_sms, 0)
    chunk_stride = ceil_div(handle.num_max_tokens_per_rank, COMBINE_CHUNK_ROWS)
    if R * chunk_stride * 4 > COMBINE_CHUNK_SIGNAL_BYTES:
        raise ValueError(f'num_max_tokens_per_rank={handle.num_max_tokens_per_rank} is too large for combine '
                         f'(at most {COMBINE_CHUNK_SIGNAL_BYTES // 4 // R * COMBINE_CHUNK_ROWS} with {R} ranks)')
    event = _check_previous_event(previous_event, allocate_on_comm_stream, allow_previous_event_alone)
    num_send, num_reduce = combine_blocks(num_sms, handle.num_sms, R, N, hidden, s.num_device_sms, cap_all_sms)
    return CombinePlan(kind, x, xi, handle, hidden, topk_weights, biases, local_reduce, num_slots, num_send,
                       num_reduce, chunk_stride, event, bool(weights_over_ranks))
