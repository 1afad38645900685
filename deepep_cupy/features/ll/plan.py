"""Low-latency engine, the pure part: constants, the region layout and size hint, kernel declarations, the V1 handle
and the argument checks (`LLPlanner`); nothing here touches a GPU. See feature.py and kernels_cu/ep_ll.cu."""

from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...constants import NUM_MAX_TOPK
from ...jit.launch import PTR, KernelSpec, Param
from ...runtime import interop
from ...runtime.interop import TensorInfo

FAMILY = 'ep_ll'
THREADS = 512                   # kernels_cu/ep_ll.cu kThreads
SEG_CHANNELS = 512              # channels per flag segment (kSegChannels)
CONTROL_BYTES = 4096            # kControlBytes
CTL_MASK_WORD = 16              # kCtlMask: int32 [R] mask words in the control area
NUM_MAX_RANKS = 8               # ranks of one NVLink domain (row routes pack the source rank in 3 bits)
NUM_MAX_EXPERTS = 4096          # the receive layout of all (expert, source) pairs sits in shared memory
NUM_MAX_TOKENS = 1 << 24        # row routes pack the token index in 24 bits
PHASE_SEND, PHASE_RECV = 1, 2
SECTION_ALIGN = 256
SIZE_ALIGN = 2 * 1024 * 1024    # BufferBase sizes are multiples of 2 MiB

# `aux` of the error records the kernels write (kernels_cu/ep_ll.cu kAux*).
WAIT_KINDS = {
    101: 'the destination to copy out our dispatch messages of the call before last (a third call while two were '
         'still un-hooked, or the peer stopped calling)',
    102: 'the source\'s dispatch token counts',
    103: 'a dispatch message from the source',
    104: 'the origin to reduce our combine rows of the call before last',
    105: 'combine rows from the expert owner',
    106: 'the peer at the clean barrier',
}


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _align(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


# ---- layout --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LLLayout:
    """Byte layout of the engine's region for maxima (M tokens per rank, hidden H, R ranks, E experts, top-k K).

    Region: `[control 4096 B | half 0 | half 1 | zero-copy staging 0 | staging 1]`; each half:
    `[counts u64 E | cflags u32 M*K*nseg | lists i32 E*M | dispatch messages R*M | combine rows M*K of 2H B]`;
    a message is `[nseg u32 flags | hidden: 2H B (BF16) or H B FP8 + H/128 float scales]`; a staging half is
    `[E*M rows of 2H B]` (the `[L, R*M, H]` bfloat16 combine input). Sizes in bytes, offsets from the half start.
    """
    num_max_tokens: int
    hidden: int
    num_ranks: int
    num_experts: int
    num_max_topk: int

    @property
    def num_segs(self) -> int:
        return _ceil_div(self.hidden, SEG_CHANNELS)

    @property
    def msg_hidden_offset(self) -> int:
        return _align(4 * self.num_segs, 16)

    @property
    def msg_bytes(self) -> int:
        # BF16 (2H) is never smaller than FP8 + scales (H + H/32)
        return _align(self.msg_hidden_offset + 2 * self.hidden, 16)

    @property
    def counts_words(self) -> int:
        return self.num_experts

    @property
    def cflags_offset(self) -> int:
        return _align(8 * self.num_experts, SECTION_ALIGN)

    @property
    def cflags_words(self) -> int:
        return self.num_max_tokens * self.num_max_topk * self.num_segs

    @property
    def lists_offset(self) -> int:
        return _align(self.cflags_offset + 4 * self.cflags_words, SECTION_ALIGN)

    @property
    def dslots_offset(self) -> int:
        return _align(self.lists_offset + 4 * self.num_experts * self.num_max_tokens, SECTION_ALIGN)

    @property
    def num_messages(self) -> int:
        return self.num_ranks * self.num_max_tokens

    @property
    def cslots_offset(self) -> int:
        return _align(self.dslots_offset + self.num_messages * self.msg_bytes, SECTION_ALIGN)

    @property
    def half_bytes(self) -> int:
        return _align(self.cslots_offset + self.num_max_tokens * self.num_max_topk * 2 * self.hidden, SECTION_ALIGN)

    @property
    def staging_offset(self) -> int:
        """From the region start."""
        return CONTROL_BYTES + 2 * self.half_bytes

    @property
    def staging_half_bytes(self) -> int:
        return _align(self.num_experts * self.num_max_tokens * 2 * self.hidden, SECTION_ALIGN)

    @property
    def total_bytes(self) -> int:
        return self.staging_offset + 2 * self.staging_half_bytes


def check_dims(num_max_tokens: int, hidden: int, num_ranks: int, num_experts: int, num_topk: Optional[int] = None,
               prefix: str = '') -> None:
    """Validate low-latency dimensions (ValueError / TypeError naming the argument)."""
    for name, value, minimum in (('num_max_dispatch_tokens_per_rank', num_max_tokens, 1), ('hidden', hidden, 128),
                                 ('num_ranks', num_ranks, 1), ('num_experts', num_experts, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f'{prefix}{name} must be an int, got {type(value).__name__} ({value!r})')
        if value < minimum:
            raise ValueError(f'{prefix}{name} must be >= {minimum}, got {value}')
    if num_max_tokens >= NUM_MAX_TOKENS:
        raise ValueError(f'{prefix}num_max_dispatch_tokens_per_rank must be below {NUM_MAX_TOKENS}, '
                         f'got {num_max_tokens}')
    if hidden % 128 != 0:
        raise ValueError(f'{prefix}hidden must be a multiple of 128 (one FP8 scale per 128 channels), got {hidden}')
    if num_ranks > NUM_MAX_RANKS:
        raise ValueError(f'{prefix}low-latency mode supports at most {NUM_MAX_RANKS} ranks in one NVLink domain, '
                         f'got {num_ranks}')
    if num_experts % num_ranks != 0:
        raise ValueError(f'{prefix}num_experts={num_experts} must be a multiple of the number of ranks {num_ranks}')
    if num_experts > NUM_MAX_EXPERTS:
        raise ValueError(f'{prefix}num_experts must be at most {NUM_MAX_EXPERTS}, got {num_experts}')
    if num_topk is not None and not 1 <= num_topk <= NUM_MAX_TOPK:
        raise ValueError(f'{prefix}num_topk must be in [1, {NUM_MAX_TOPK}], got {num_topk}')


def get_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of symmetric memory the engine needs (DeepEP's `get_low_latency_rdma_size_hint` signature), for any
    top-k up to 32, a multiple of 2 MiB. Formula (S = H/128 scales, nseg = ceil(H/512), K = 32):
    `4096 + 2 * (8E + 4*M*K*nseg + 4*E*M + R*M*(align16(4 nseg) + 2H) + M*K*2H) + 2 * E*M*2H` plus alignment."""
    check_dims(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    layout = LLLayout(num_max_tokens=num_max_dispatch_tokens_per_rank, hidden=hidden, num_ranks=num_ranks,
                      num_experts=num_experts, num_max_topk=NUM_MAX_TOPK)
    return _align(layout.total_bytes, SIZE_ALIGN)


def layout_for_region(num_max_tokens: int, hidden: int, num_ranks: int, num_experts: int, region_bytes: int,
                      num_max_topk: Optional[int] = None) -> LLLayout:
    """The layout for these maxima that fits `region_bytes`: `num_max_topk` if given, else the largest top-k <= 32
    that fits. ValueError naming the sizes if none does."""
    check_dims(num_max_tokens, hidden, num_ranks, num_experts, num_max_topk)
    candidates = [num_max_topk] if num_max_topk is not None else list(range(NUM_MAX_TOPK, 0, -1))
    sizes = dict(num_max_tokens=num_max_tokens, hidden=hidden, num_ranks=num_ranks, num_experts=num_experts)
    for k in candidates:
        layout = LLLayout(**sizes, num_max_topk=k)
        if layout.total_bytes <= region_bytes:
            return layout
    need = LLLayout(**sizes, num_max_topk=candidates[-1]).total_bytes
    raise ValueError(f'the low-latency region has {region_bytes} bytes but M={num_max_tokens}, hidden={hidden}, '
                     f'R={num_ranks}, E={num_experts}, top-k {candidates[-1]} need {need}; size the buffer with '
                     f'get_low_latency_rdma_size_hint({num_max_tokens}, {hidden}, {num_ranks}, {num_experts}) = '
                     f'{get_rdma_size_hint(num_max_tokens, hidden, num_ranks, num_experts)}')


# ---- kernels -------------------------------------------------------------------------------------------------------
_P = Param
_REGION = (_P('peer_bases', PTR), _P('rank', np.int32), _P('region_offset', np.uint64), _P('half_bytes', np.uint64))
_ERR = (_P('error_record', PTR), _P('timeout_ns', np.uint64))


def dispatch_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec(FAMILY, f'deepep::ll::dispatch<{num_ranks}>', (
        _P('x', PTR), _P('topk_idx', PTR), _P('num_tokens', np.int32), _P('num_topk', np.int32),
        _P('hidden', np.int32), _P('num_experts', np.int32), _P('num_max_tokens', np.int32),
        _P('use_fp8', np.int32), _P('round_scale', np.int32), _P('use_ue8m0', np.int32),
        _P('recv_x', PTR), _P('recv_sf', PTR), _P('recv_count', PTR), _P('src_info', PTR), _P('layout_range', PTR),
        _P('row_route', PTR), _P('send_pos', PTR), _P('call_info', PTR), _P('cumulative_stats', PTR),
        _P('wait_stats', PTR), *_REGION, _P('lists_offset', np.uint64), _P('dslots_offset', np.uint64),
        _P('slot_tokens', np.int32), _P('msg_bytes', np.int32), _P('msg_hidden_offset', np.int32),
        _P('shrink', np.int32), _P('phases', np.int32), *_ERR))


def combine_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec(FAMILY, f'deepep::ll::combine<{num_ranks}>', (
        _P('x', PTR), _P('recv_count', PTR), _P('row_route', PTR), _P('layout_range', PTR), _P('send_pos', PTR),
        _P('topk_idx', PTR), _P('topk_weights', PTR), _P('combined_x', PTR), _P('num_tokens', np.int32),
        _P('num_topk', np.int32), _P('hidden', np.int32), _P('num_experts', np.int32),
        _P('num_max_tokens', np.int32), _P('call_info', PTR), _P('wait_stats', PTR), *_REGION,
        _P('cflags_offset', np.uint64), _P('cslots_offset', np.uint64), _P('slot_segs', np.int32),
        _P('shrink', np.int32), _P('phases', np.int32), *_ERR))


def clean_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec(FAMILY, f'deepep::ll::clean<{num_ranks}>', (
        _P('reset', np.int32), *_REGION, _P('counts_words', np.uint64), _P('cflags_offset', np.uint64),
        _P('cflags_words', np.uint64), _P('dslots_offset', np.uint64), _P('num_messages', np.int32),
        _P('msg_bytes', np.int32), _P('msg_flag_words', np.int32), _P('shrink', np.int32), *_ERR))


def specs_for(num_ranks: int) -> List[KernelSpec]:
    return [dispatch_spec(num_ranks), combine_spec(num_ranks), clean_spec(num_ranks)]


def shipped_specs() -> Dict[str, List[KernelSpec]]:
    """Every `ep_ll` specialisation (one per domain size: the kernel name must not vary with the call's options,
    DeepEP's profiler-based tests expect one `dispatch` and one `combine` kernel)."""
    return {FAMILY: [s for n in range(1, NUM_MAX_RANKS + 1) for s in specs_for(n)]}


def dispatch_smem_bytes(num_experts: int, num_ranks: int) -> int:
    """Dynamic shared memory of the dispatch kernel: count [E], begin [E], row base [L + 1] (int32)."""
    return 4 * (2 * num_experts + num_experts // num_ranks + 1)


def combine_smem_bytes(num_experts: int, num_ranks: int) -> int:
    return 4 * (num_experts // num_ranks + 1)


# ---- handle --------------------------------------------------------------------------------------------------------
class V1LLHandle(tuple):
    """DeepEP's low-latency handle tuple `(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts)`, with the fields the combine needs as attributes (`LLHandle` inside one domain, v1/kernels/
    internode_ll.py `InternodeLLHandle` across domains: each planner accepts only its own)."""

    # DeepEP's tuple fields 2..4 by name
    num_max_dispatch_tokens_per_rank = property(itemgetter(2), doc='M of the dispatch')
    hidden = property(itemgetter(3), doc='H of the dispatch')
    num_experts = property(itemgetter(4), doc='E of the dispatch')

    def __new__(cls, src_info, layout_range, num_max_tokens: int, hidden: int, num_experts: int, **extra):
        self = super().__new__(cls, (src_info, layout_range, num_max_tokens, hidden, num_experts))
        self.__dict__.update(extra)
        return self

    def __reduce__(self):
        raise TypeError('a low-latency handle refers to GPU tensors and cannot be pickled')


class LLHandle(V1LLHandle):
    """DeepEP's low-latency handle `(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)`:
    `src_info` `[L, R*M]` int32 (the token's index at its source rank), `layout_range` `[L, R]` int64
    (`begin << 32 | count` of source r's rows in expert j). Extra fields (attributes) the combine needs:

    Attributes:
        recv_count: `[L]` int32, rows received per local expert (the dispatch's `recv_count`).
        row_route: `[L, R*M]` int32, per received row `(src_rank << 29) | (topk_slot << 24) | token`.
        send_pos: `[N, K]` int32, per top-k slot of this rank's tokens: the token's position among this rank's
            tokens sent to that expert, or -1 (no expert, masked owner).
        num_tokens, num_topk: N and K of the dispatch; kind: 'torch' or 'cupy'.

    A dispatch's handle holds its small outputs' allocation (`_group`, at `_g0`; bound.py `HandleLayout`, `_sig`):
    row_route, send_pos and call_info (int32 `[1]`) are views of it made when first read (the combine takes their
    addresses, not views).
    """

    _LAZY = ('row_route', 'send_pos', 'call_info')

    def __getattr__(self, name: str):
        # (only for attributes not in the instance dictionary: the lazy views)
        d = self.__dict__
        if name in LLHandle._LAZY and '_sig' in d:
            sig = d['_sig']
            view = d[name] = sig.view(sig.carver, d['_group'], name)
            return view
        raise AttributeError(f'{type(self).__name__!r} object has no attribute {name!r}')


# ---- argument checks (pure) ----------------------------------------------------------------------------------------
@dataclass
class CallDims:
    """The sizes of a checked low-latency call (a dispatch's, or for a combine its dispatch's)."""
    kind: str
    num_tokens: int
    num_topk: int
    hidden: int
    num_experts: int
    num_max_tokens: int
    num_local_experts: int
    num_rows: int          # T = R * M


@dataclass
class DispatchPlan(CallDims):
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    x: TensorInfo
    topk_idx: TensorInfo
    cumulative_stats: Optional[TensorInfo]
    wait_stats: Optional[TensorInfo]


@dataclass
class CombinePlan(CallDims):
    x: Optional[TensorInfo]                 # None: not checked (`LLCallChecks.zero_copy_checks_x`)
    topk_idx: TensorInfo
    topk_weights: TensorInfo
    out: Optional[TensorInfo]
    wait_stats: Optional[TensorInfo]
    zero_copy: bool


def _int_arg(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f'{name} must be an int, got {type(value).__name__} ({value!r})')
    if value < minimum:
        raise ValueError(f'{name} must be >= {minimum}, got {value}')
    return int(value)


def _bool_arg(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f'{name} must be a bool, got {type(value).__name__} ({value!r})')
    return bool(value)


class LLCallChecks:
    """The argument checks of DeepEP V1's low-latency calls, inside one NVLink domain (`LLPlanner`) and across domains
    (v1/kernels/internode_ll.py `InternodeLLPlanner`): R = `num_ranks` ranks, arrays on `device` (CPU tensors pass
    when it is -1). Every user error raises ValueError / TypeError naming the argument, before any kernel runs. The
    limits on the sizes are each planner's (`_dispatch_sizes`), so is the handle (`handle_type`)."""

    handle_type = V1LLHandle
    # Whether the combine checks x with zero_copy too (it then reads the staging buffer, not x): inside one domain
    # it does (bound.py's combine reads x's TensorInfo either way); across domains x may then be anything.
    zero_copy_checks_x = True

    def __init__(self, num_ranks: int, device: int):
        self.num_ranks, self.device = num_ranks, device

    def _info(self, x: Any, name: str) -> TensorInfo:
        t = interop.tensor_info(x, name)
        if t.device != self.device:
            where = 'the host' if t.device < 0 else f'cuda:{t.device}'
            raise ValueError(f'{name} must be on cuda:{self.device} (this rank\'s GPU), got an array on {where}')
        return t

    @staticmethod
    def _expect(t: TensorInfo, name: str, dtype: str, shape: Tuple[int, ...], kind: str) -> None:
        if t.kind != kind:
            raise TypeError(f'{name} is a {t.kind} array but x is a {kind} array; pass one kind')
        if not t.dtype_matches(dtype):
            raise TypeError(f'{name} must be {dtype}, got {t.dtype}')
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f'{name} must have shape {list(shape)}, got {list(t.shape)}')
        if not t.is_contiguous():
            raise ValueError(f'{name} must be contiguous, got strides {list(t.strides)}')
        if t.ptr % 16 != 0 and t.numel > 0 and dtype in ('bfloat16', 'float8_e4m3fn'):
            raise ValueError(f'{name} must start at a 16-byte aligned address')

    def _dispatch_sizes(self, num_max_tokens: Any, num_experts: Any, hidden: int, num_topk: int) -> Tuple[int, int]:
        """Check a dispatch's M, E (as passed), hidden and top-k against the planner's limits; returns `(M, E)`."""
        raise NotImplementedError

    def plan_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: Any, num_experts: Any,
                      cumulative_local_expert_recv_stats: Any = None, dispatch_wait_recv_cost_stats: Any = None,
                      use_fp8: Any = True, round_scale: Any = False, use_ue8m0: Any = False, async_finish: Any = False,
                      return_recv_hook: Any = False) -> DispatchPlan:
        use_fp8, round_scale, use_ue8m0 = (_bool_arg('use_fp8', use_fp8), _bool_arg('round_scale', round_scale),
                                           _bool_arg('use_ue8m0', use_ue8m0))
        if _bool_arg('async_finish', async_finish) and _bool_arg('return_recv_hook', return_recv_hook):
            raise ValueError('async_finish and return_recv_hook are mutually exclusive')
        if use_ue8m0 and not round_scale:
            raise ValueError('use_ue8m0=True requires round_scale=True (UE8M0 holds power-of-two scales only)')
        xi = self._info(x, 'x')
        if len(xi.shape) != 2:
            raise ValueError(f'x must be 2-D [num_tokens, hidden], got shape {list(xi.shape)}')
        num_tokens, hidden = xi.shape
        ti = self._info(topk_idx, 'topk_idx')
        if len(ti.shape) != 2 or ti.shape[0] != num_tokens:
            raise ValueError(f'topk_idx must be [num_tokens={num_tokens}, num_topk], got shape {list(ti.shape)}')
        num_topk = ti.shape[1]
        M, E = self._dispatch_sizes(num_max_dispatch_tokens_per_rank, num_experts, hidden, num_topk)
        if use_fp8 and use_ue8m0 and hidden % 512 != 0:
            raise ValueError(f'use_ue8m0 packs 4 scales (512 channels) per int32: hidden must be a multiple of 512, '
                             f'got {hidden}')
        if num_tokens > M:
            raise ValueError(f'x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank={M}')
        kind = xi.kind
        self._expect(xi, 'x', 'bfloat16', (num_tokens, hidden), kind)
        self._expect(ti, 'topk_idx', 'int64', (num_tokens, num_topk), kind)
        R = self.num_ranks
        L = E // R
        cs = ws = None
        if cumulative_local_expert_recv_stats is not None:
            cs = self._info(cumulative_local_expert_recv_stats, 'cumulative_local_expert_recv_stats')
            self._expect(cs, 'cumulative_local_expert_recv_stats', 'int32', (L,), kind)
        if dispatch_wait_recv_cost_stats is not None:
            ws = self._info(dispatch_wait_recv_cost_stats, 'dispatch_wait_recv_cost_stats')
            self._expect(ws, 'dispatch_wait_recv_cost_stats', 'int64', (R,), kind)
        return DispatchPlan(kind=kind, num_tokens=num_tokens, num_topk=num_topk, hidden=hidden, num_experts=E,
                            num_max_tokens=M, num_local_experts=L, num_rows=R * M, use_fp8=use_fp8,
                            round_scale=round_scale, use_ue8m0=use_ue8m0, x=xi, topk_idx=ti, cumulative_stats=cs,
                            wait_stats=ws)

    def plan_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, use_logfmt: Any = False,
                     zero_copy: Any = False, async_finish: Any = False, return_recv_hook: Any = False,
                     out: Any = None, combine_wait_recv_cost_stats: Any = None) -> CombinePlan:
        if _bool_arg('use_logfmt', use_logfmt):
            raise NotImplementedError('use_logfmt=True (DeepEP\'s LogFMT-10 combine) is not supported: its encoding '
                                      'uses approximate hardware log2/exp2, so no host reference can check it bit for '
                                      'bit; use BF16 combine (use_logfmt=False)')
        zero_copy = _bool_arg('zero_copy', zero_copy)
        if _bool_arg('async_finish', async_finish) and _bool_arg('return_recv_hook', return_recv_hook):
            raise ValueError('async_finish and return_recv_hook are mutually exclusive')
        if not isinstance(handle, self.handle_type):
            raise TypeError(f'handle must be the handle a low_latency_dispatch of this buffer returned, got '
                            f'{type(handle).__name__}')
        M, hidden, E = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        R = self.num_ranks
        L, T, N, K = E // R, R * M, handle.num_tokens, handle.num_topk
        xi = oi = si = None
        if self.zero_copy_checks_x or not zero_copy:
            xi = self._info(x, 'x')
        kind = handle.kind
        if xi is not None:
            self._expect(xi, 'x', 'bfloat16', (L, T, hidden), kind)
        ti = self._info(topk_idx, 'topk_idx')
        self._expect(ti, 'topk_idx', 'int64', (N, K), kind)
        wi = self._info(topk_weights, 'topk_weights')
        self._expect(wi, 'topk_weights', 'float32', (N, K), kind)
        if out is not None:
            oi = self._info(out, 'out')
            self._expect(oi, 'out', 'bfloat16', (N, hidden), kind)
        if combine_wait_recv_cost_stats is not None:
            si = self._info(combine_wait_recv_cost_stats, 'combine_wait_recv_cost_stats')
            self._expect(si, 'combine_wait_recv_cost_stats', 'int64', (R,), kind)
        return CombinePlan(kind=kind, num_tokens=N, num_topk=K, hidden=hidden, num_experts=E, num_max_tokens=M,
                           num_local_experts=L, num_rows=T, x=xi, topk_idx=ti, topk_weights=wi, out=oi, wait_stats=si,
                           zero_copy=zero_copy)


class LLPlanner(LLCallChecks):
    """Checks low-latency call arguments against the engine's layout (one NVLink domain); runs without a GPU (CPU
    tensors pass when `device` is -1)."""

    handle_type = LLHandle

    def __init__(self, layout: LLLayout, rank: int, device: int):
        super().__init__(layout.num_ranks, device)
        self.layout, self.rank = layout, rank

    def _call_dims(self, num_max_tokens: Any, num_experts: Any, hidden: int, num_topk: Optional[int]) -> None:
        lay = self.layout
        check_dims(num_max_tokens, hidden, lay.num_ranks, num_experts, num_topk)
        if num_max_tokens > lay.num_max_tokens:
            raise ValueError(f'num_max_dispatch_tokens_per_rank={num_max_tokens} exceeds the {lay.num_max_tokens} '
                             f'this buffer was laid out for')
        if hidden > lay.hidden:
            raise ValueError(f'hidden={hidden} exceeds the {lay.hidden} this buffer was laid out for')
        if num_experts > lay.num_experts:
            raise ValueError(f'num_experts={num_experts} exceeds the {lay.num_experts} this buffer was laid out for')
        if num_topk is not None and num_topk > lay.num_max_topk:
            raise ValueError(f'num_topk={num_topk} exceeds the {lay.num_max_topk} top-k slots this buffer has room '
                             f'for (a larger buffer holds up to {NUM_MAX_TOPK})')

    def _dispatch_sizes(self, num_max_tokens: Any, num_experts: Any, hidden: int, num_topk: int) -> Tuple[int, int]:
        M = _int_arg('num_max_dispatch_tokens_per_rank', num_max_tokens, 1)
        E = _int_arg('num_experts', num_experts, 1)
        self._call_dims(M, E, hidden, num_topk)
        return M, E
