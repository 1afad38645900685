"""Normal (high-throughput) mode of DeepEP V1's `Buffer`, on the EP engine (`features/ep`).

V1 streams any number of tokens through fixed rings of `num_nvl_bytes`; the EP engine needs a slot per token: `M`
(num_max_tokens_per_rank) token slots per source rank at every destination. `NormalMode` holds one `NormalEngine`
(symmetric memory plus an EP component laid out for `(M, hidden, top-k)`) and keeps the engine big enough:

- Sizing. The memory is allocated at construction from `num_nvl_bytes` (collective, as V1's constructor is) and laid
  out at the first dispatch, when hidden and top-k are known: M = the most tokens that fit
  (`fit_tokens`). A call with a larger hidden size or top-k lays it out again (every rank sees the same values, so
  every rank decides alike), keeping room for the most tokens any rank dispatched in a CPU-synced call so far
  (`tokens_seen`, known to every rank), on the same memory when it fits, else on a larger one. The layout's top-k
  is at least the number of ranks (a dispatch without top-k ids routes by synthetic ones, one column per rank).
- Growth. A rank holding more tokens than M dispatches 0 tokens and reports its count through the notify exchange
  (`LegacyLayout.reported_num_tokens`); after the CPU wait for the receive counts every rank knows the largest count
  of all ranks (`max_num_tokens`), so when it exceeds M all ranks replace the engine by a larger one (M' = that count
  plus a quarter, aligned to 256) and redo the call. Only tokens that fitted their slots were sent, and the first
  attempt's outputs are dropped. No host collective is added to any call; growth costs one collective buffer build.
- No-sync calls (`num_worst_tokens > 0`, CUDA-graph capturable) cannot learn the other ranks' counts on the host:
  every rank's count must fit M. A rank that holds more dispatches 0 tokens (its peers do not hang), then raises
  `ValueError`; the others' outputs of that call lack its tokens. Warm the buffer up with a CPU-synced dispatch of
  the largest token count (or build it with a larger `num_nvl_bytes`) before capturing graphs.
- Handles (`LegacyHandle`) keep the engine they came from alive: combines and cached dispatches of a handle made
  before a growth run on the old engine (every rank holds the same handles).

The V1 handle is a 6-tuple (DeepEP's intranode layout, every element filled: see `LegacyHandle`).

Host path. A dispatch with top-k ids (torch tensors) is remembered by its signature (`NormalMode.lean_dispatch`): the
first call takes the checked path (`dispatch`, through `EP.dispatch`), later ones run the EP bound dispatch that served
it (`EPHandle._origin`, its `run_v1`, as `EP.dispatch` would: V1's signature decides EP's, so EP's key is not built a
second time) and make V1's handle without a Python-level constructor. The engine parts this uses beyond the entry
points in `v1/__init__.py`: `EPHandle._origin` / `_counts`, `BoundDispatch.key` / `run_v1`, `EP._bound` (replaced
when EP forgets its bound calls: the entries go too) and the usability check `EP.dispatch` makes (the engine's
`_destroyed`, `_failed`, `EP._error_state`). tests/test_legacy_cpu.py checks that both paths launch and return the
same. What V1's API itself costs beyond ElasticBuffer's call: the handle's five tensors (views made per call, as DeepEP
makes them per call) and the per-expert list.
"""

import functools
import weakref
from typing import Any, Callable, NamedTuple, Optional, Tuple

from ..buffers.base import BUFFER_ALIGNMENT, BufferBase
from ..features.ep.feature import EP
from ..features.ep.handle import EPHandle
from ..features.ep.kernels import COMBINE_CHUNK_ROWS, COMBINE_CHUNK_SIGNAL_BYTES
from ..features.ep.layout import EPLayout, buffer_size_hint
from ..features.ep.legacy import LegacyLayout
from ..runtime import checks, interop
from ..runtime.event import EventOverlap, as_event_handle
from ..runtime.sizes import align

TOKEN_ALIGNMENT = 256           # M is a multiple of the notify kernel's tokens per block
DEFAULT_TOKENS = 1024           # M of a buffer built without num_nvl_bytes, before any growth
MAX_ATTEMPTS = 3                # a dispatch redone after growing (once is enough; the rest is a safety bound)
MAX_LEAN_CALLS = 64             # dispatch signatures remembered (`NormalMode.lean_dispatch`); more: forgotten at once


# ---- sizes (pure) --------------------------------------------------------------------------------------------------
def max_tokens(num_ranks: int) -> int:
    """The largest M the combine's chunk signals allow (`R * ceil(M / 16)` words in their workspace region)."""
    return COMBINE_CHUNK_SIGNAL_BYTES // 4 // num_ranks * COMBINE_CHUNK_ROWS


def needed_bytes(num_ranks: int, num_tokens: int, hidden: int, num_topk: int) -> int:
    """Bytes of memory (2 MiB aligned) an EP layout of `num_tokens` slots needs."""
    return buffer_size_hint(num_ranks, num_tokens, hidden, num_topk)


def fit_tokens(num_ranks: int, num_bytes: int, hidden: int, num_topk: int) -> int:
    """The most token slots (a multiple of TOKEN_ALIGNMENT, or 0) an EP layout of `(hidden, num_topk)` fits in
    `num_bytes`."""
    def fits(m):
        return EPLayout(num_ranks, m, hidden, num_topk, True, 0).end_offset <= num_bytes
    lo, hi = 0, max_tokens(num_ranks) // TOKEN_ALIGNMENT
    while lo < hi:                      # the largest k with fits(k * TOKEN_ALIGNMENT)
        mid = (lo + hi + 1) // 2
        if fits(mid * TOKEN_ALIGNMENT):
            lo = mid
        else:
            hi = mid - 1
    return lo * TOKEN_ALIGNMENT


def grown_tokens(num_tokens: int, num_ranks: int) -> int:
    """M after a growth to hold `num_tokens`: a quarter more, aligned; ValueError beyond the combine's limit."""
    limit = max_tokens(num_ranks)
    if num_tokens > limit:
        raise ValueError(f'a rank dispatches {num_tokens} tokens; this build holds at most {limit} per rank with '
                         f'{num_ranks} ranks (the combine\'s chunk signals)')
    return min(limit, align(max(num_tokens + num_tokens // 4, DEFAULT_TOKENS), TOKEN_ALIGNMENT))


# ---- the engine --------------------------------------------------------------------------------------------------
class NormalEngine(BufferBase):
    """Symmetric memory and an EP component laid out for `geometry = (M, hidden, top-k)`.

    Args:
        group, num_bytes, device, num_cpu_timeout_secs, num_gpu_timeout_secs: as `BufferBase`'s.
        comm_stream: the V1 Buffer's communication stream (shared by its engines).
        nvlink_gbs: NVLink bandwidth for the engine's SM policy.
    """

    def __init__(self, group, num_bytes: int, comm_stream, device: int, nvlink_gbs: float,
                 num_cpu_timeout_secs: float, num_gpu_timeout_secs: float):
        super().__init__(group=group, num_bytes=num_bytes, num_cpu_timeout_secs=num_cpu_timeout_secs,
                         num_gpu_timeout_secs=num_gpu_timeout_secs, explicitly_destroy=False, device=device,
                         comm_stream=comm_stream)
        self._nvlink_gbs = nvlink_gbs
        self.ep: Optional[EP] = None
        self.geometry = (0, 0, 0)

    def lay_out(self, num_tokens: int, hidden: int, num_topk: int) -> EP:
        """A new EP component for `(num_tokens, hidden, num_topk)` on this memory (kernels loaded now)."""
        self.ep = EP(weakref.proxy(self), num_tokens, hidden, num_topk, True, True, self._nvlink_gbs)
        self.geometry = (num_tokens, hidden, num_topk)
        return self.ep

    def _destroy_features(self) -> None:
        if self.ep is not None:
            self.ep.destroy()
        self.ep = None


# ---- the handle --------------------------------------------------------------------------------------------------
class V1Handle(tuple):
    """A DeepEP V1 normal-mode handle: V1's tuple, with what this library's calls need as attributes (`LegacyHandle`
    inside one domain, v1/internode.py `InternodeHandle` across domains: each mode accepts only its own)."""

    def __new__(cls, items, **extra):
        self = super().__new__(cls, items)
        self.__dict__.update(extra)
        return self

    def __reduce__(self):
        raise TypeError('a DeepEP V1 handle refers to GPU tensors and cannot be pickled')


class LegacyHandle(V1Handle):
    """DeepEP V1's intranode handle, `(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
    recv_src_idx, is_token_in_rank, send_head)`:

    - `rank_prefix_matrix` `[R, R]` int32: `M[i][j]` = tokens ranks 0..i send to rank j (rank j's rows from source i
      are `[M[i-1][j], M[i][j])`);
    - `channel_prefix_matrix` `[R, C]` int32 (C = `config.num_sms // 2`): per destination, the inclusive prefix over
      V1's channels (channel c = tokens `[c * ceil(N / C), ...)`) of this rank's tokens sent there;
    - `recv_channel_prefix_matrix` `[R, C]` int32: per source, where its channel c starts inside its block of rows;
    - `recv_src_idx` `[num_recv]` int32: each received row's token index at its source;
    - `is_token_in_rank` `[N, R]` bool: the dispatch's argument (for a dispatch with top-k ids, what they give);
    - `send_head` `[N, R]` int32: the slot of token t at rank r (its position among this rank's tokens sent to r),
      -1 if not sent (V1: the ring position; the combine rewrites it in place; here nothing reads it).

    Attributes (for combine and cached dispatch): `ep_handle` (the `EPHandle`), `ep` (the EP component),
    `engine` (the `NormalEngine`, kept alive), `with_topk` (the dispatch had top-k ids).
    """


# `LegacyHandle(items)` without its Python-level `__new__` (a C call; the lean dispatch sets the attributes)
_new_handle = functools.partial(tuple.__new__, LegacyHandle)


# ---- argument checks (pure) ------------------------------------------------------------------------------------------
def check_event_rule(previous_event, async_finish: bool, allocate_on_comm_stream: bool):
    """V1's rule: `allocate_on_comm_stream` needs `previous_event` and `async_finish` (a `previous_event` alone is
    legal). Returns `previous_event`, None for an `EventOverlap` holding no event: V1 passes its `.event` on, so an
    empty one means none (SGLang's synchronous normal dispatch hands the layout's empty event to dispatch)."""
    if type(previous_event) is EventOverlap and previous_event.event is None:
        previous_event = None
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError('allocate_on_comm_stream=True needs previous_event and async_finish=True (DeepEP V1 rule)')
    return previous_event


def check_dispatch_scalars(expert_alignment, num_worst_tokens, with_topk: bool) -> None:
    """V1 dispatch's scalar arguments: `expert_alignment` an int >= 1, `num_worst_tokens` an int >= 0 and, when > 0,
    top-k ids given; TypeError / ValueError naming the argument."""
    if type(expert_alignment) is not int or expert_alignment < 1:     # (`check_int` where it may raise)
        checks.check_int('expert_alignment', expert_alignment, 1)
    if type(num_worst_tokens) is not int or num_worst_tokens < 0:
        checks.check_int('num_worst_tokens', num_worst_tokens, 0)
    if num_worst_tokens and not with_topk:
        raise ValueError('num_worst_tokens > 0 needs topk_idx (as DeepEP)')


def check_num_sms(config) -> int:
    num_sms = config.num_sms
    if num_sms < 2 or num_sms % 2 != 0:
        raise ValueError(f'config.num_sms must be a positive even number, got {num_sms}')
    return num_sms


def split_x(x) -> Tuple[Any, Any, int, int]:
    """`(x, scales or None, num_tokens, hidden)` of V1's `x` (a tensor or an `(x_fp8, scales)` pair)."""
    if type(x) is interop.TORCH_TENSOR[0]:      # (the common case: `shape_of` of a plain torch tensor, inline)
        shape = interop.shape_of(x, 'x')
        if len(shape) == 2:
            return x, None, shape[0], shape[1]
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f'x must be a tensor or an (x_fp8, scales) pair, got a sequence of {len(x)}')
        data, sf = x
    else:
        data, sf = x, None
    shape = interop.shape_of(data, 'x')
    if len(shape) != 2:
        raise ValueError(f'x must be 2-D [num_tokens, hidden], got shape {list(shape)}')
    return data, sf, shape[0], shape[1]


# ---- normal mode ---------------------------------------------------------------------------------------------------
class Attempt(NamedTuple):
    """The try of a dispatch that held every rank's tokens (`dispatch_with_growth`)."""
    target: Any         # what `ensure` returned for it: the EP component (one domain) or the engine (across domains)
    out: Tuple          # the feature's dispatch result
    layout: Any         # the try's V1 layout (`LegacyLayout`, `InternodeCall`): `max_num_tokens` of every rank


def dispatch_with_growth(mode, x, split: Tuple[Any, Any, int, int], num_topk: int, topk_idx, topk_weights,
                         worst: bool, attempt: Callable) -> Attempt:
    """A non-cached V1 dispatch's grow-and-redo loop (the module docstring's Growth and No-sync rules), in one domain
    and across domains (v1/internode.py `InternodeMode.dispatch`).

    Args:
        mode: `NormalMode` or `InternodeMode` (its `ensure`, `engine` and `tokens_seen`).
        x, split: V1's x and its `split_x`; topk_idx, topk_weights, num_topk: the call's top-k.
        worst: num_worst_tokens > 0 (no CPU sync: nothing can grow, a rank whose tokens do not fit raises).
        attempt: `attempt(target, M, over, xs, ts, ws) -> (out, layout)`: one dispatch of `xs, ts, ws` (the call's
            x, top-k ids and weights, or with `over` their first 0 rows) on `target` (`mode.ensure`'s), M slots per
            rank.
    """
    data, sf, num_tokens, hidden = split
    for _ in range(MAX_ATTEMPTS):
        target = mode.ensure(hidden, num_topk)
        M = mode.engine.geometry[0]
        over = num_tokens > M
        if over:        # probe: send nothing, report num_tokens, learn everyone's counts
            xs = (data[:0], sf[:0]) if sf is not None else data[:0]
            ts, ws = topk_idx[:0], None if topk_weights is None else topk_weights[:0]
        else:
            xs, ts, ws = x if sf is None else (data, sf), topk_idx, topk_weights
        out, layout = attempt(target, M, over, xs, ts, ws)
        if worst:
            if over:
                raise ValueError(f'dispatch with num_worst_tokens: this rank holds {num_tokens} tokens but the buffer '
                                 f'has {M} slots per rank and cannot grow without a CPU sync; warm it up with a '
                                 f'dispatch of the largest token count without num_worst_tokens (or pass a larger '
                                 f'num_nvl_bytes) before capturing CUDA graphs')
            break
        mode.tokens_seen = max(mode.tokens_seen, layout.max_num_tokens)
        if layout.max_num_tokens <= M:
            break
        mode.ensure(hidden, num_topk, layout.max_num_tokens)      # every rank saw the same maximum: grow, then redo
    else:
        raise RuntimeError(f'dispatch: the buffer did not hold {layout.max_num_tokens} tokens per rank after '
                           f'{MAX_ATTEMPTS} growths (M={M})')
    return Attempt(target=target, out=out, layout=layout)


class NormalMode:
    """The normal-mode calls of one V1 `Buffer` (see the module docstring).

    Args:
        num_ranks, device: the group's size and this rank's GPU.
        num_nvl_bytes: V1's buffer size: the memory is allocated now (rounded up to 2 MiB; 0: at the first dispatch).
        make_engine: `make_engine(num_bytes)` builds a `NormalEngine` (collective).
    """

    def __init__(self, num_ranks: int, device: int, num_nvl_bytes: int, make_engine: Callable[[int], NormalEngine]):
        self.num_ranks, self.device = num_ranks, device
        self._make = make_engine
        self.engine: Optional[NormalEngine] = None
        if num_nvl_bytes > 0:
            self.engine = make_engine(align(num_nvl_bytes, BUFFER_ALIGNMENT))
        self._rank_bases = {}
        self.num_growths = 0
        self.tokens_seen = 0        # the most tokens any rank dispatched in a CPU-synced call (known to every rank)
        self._lean = {}             # dispatch signature -> its entry (`lean_dispatch`); emptied when `ensure` lays out

    # -- sizing --
    def ensure(self, hidden: int, num_topk: int, num_tokens: int = 0) -> EP:
        """The EP component for calls of `hidden` and `num_topk` with room for `num_tokens` tokens per rank, laid out
        or grown as needed. Collective whenever it changes anything: every rank must call it with equal arguments."""
        eng = self.engine
        if eng is not None:
            M, H, K = eng.geometry
            if hidden <= H and num_topk <= K and num_tokens <= M and eng.ep is not None:
                return eng.ep
        else:
            M, H, K = 0, 0, 0
        self._lean.clear()          # (the entries' bound dispatches are of the EP component being replaced)
        R = self.num_ranks
        # Synthetic top-k ids (a dispatch without top-k) have one column per rank: lay out for at least that.
        H, K, need = max(hidden, H), max(num_topk, K, R), max(num_tokens, self.tokens_seen, 1)
        if eng is not None:
            fit = fit_tokens(R, eng.num_bytes, H, K)
            if fit >= need:
                return eng.lay_out(fit, H, K)
        if eng is not None:
            # Every rank's kernels on the old engine are done before it may be freed (handles may keep it).
            eng.barrier(with_cpu_sync=True)
        num_bytes = needed_bytes(R, grown_tokens(need, R), H, K)
        self.engine = eng = self._make(num_bytes)
        self.num_growths += 1
        return eng.lay_out(fit_tokens(R, num_bytes, H, K), H, K)

    def synthetic_topk(self, is_token_in_rank, num_experts: int):
        """`[N, R]` int64 top-k ids for a dispatch without top-k: column r is `r * L` (rank r's first expert) where
        `is_token_in_rank[t, r]`, else -1. No host synchronisation."""
        R = self.num_ranks
        info = checks.info(is_token_in_rank, 'is_token_in_rank', self.device)
        checks.check_dtype(info, 'is_token_in_rank', 'bool')
        if info.ndim != 2 or info.shape[1] != R:
            raise ValueError(f'is_token_in_rank must be [num_tokens, {R}], got {list(info.shape)}')
        L = num_experts // R
        key = (info.kind, L)
        base = self._rank_bases.get(key)
        if info.kind == 'torch':
            import torch
            if base is None:
                base = self._rank_bases[key] = torch.arange(R, dtype=torch.int64, device=is_token_in_rank.device) * L
            return torch.where(is_token_in_rank, base, -1)
        import cupy
        if base is None:
            base = self._rank_bases[key] = cupy.arange(R, dtype=cupy.int64) * L
        return cupy.where(is_token_in_rank.view(cupy.bool_), base, -1)

    # -- dispatch --
    def dispatch(self, x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment: int,
                 num_worst_tokens: int, num_experts: Optional[int], num_sms: int, previous_event, async_finish: bool,
                 allocate_on_comm_stream: bool):
        """A non-cached V1 dispatch (arguments checked by the caller, `num_experts` from the layout tensors).

        Returns:
            V1's `(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)`.
        """
        split = split_x(x)
        N = split[2]
        with_topk = topk_idx is not None
        expert_counts = None
        if not with_topk:
            topk_idx = self.synthetic_topk(is_token_in_rank, num_experts)
            expert_counts = num_tokens_per_expert
        K = interop.shape_of(topk_idx, 'topk_idx')[-1]
        worst = num_worst_tokens > 0
        channels = num_sms // 2

        def attempt(ep, M, over, xs, ts, ws):
            lg = LegacyLayout(channels, N, None if over else expert_counts)
            out = ep.dispatch(xs, topk_idx=ts, topk_weights=ws, num_experts=num_experts, num_max_tokens_per_rank=M,
                              expert_alignment=expert_alignment, num_sms=num_sms, previous_event=previous_event,
                              async_with_compute_stream=async_finish, allocate_on_comm_stream=allocate_on_comm_stream,
                              do_handle_copy=True, do_cpu_sync=not worst, do_expand=False, do_zero_padding=False,
                              use_tma_aligned_col_major_sf=False, num_worst_tokens=num_worst_tokens,
                              allow_previous_event_alone=True, legacy=lg)
            return out, lg
        ep, out, lg = dispatch_with_growth(self, x, split, K, topk_idx, topk_weights, worst, attempt)
        recv_x, recv_topk_idx, recv_topk_weights, ep_handle, event = out
        handle = LegacyHandle((lg.rank_prefix_matrix, lg.channel_prefix_matrix, lg.recv_channel_prefix_matrix,
                               lg.recv_src_idx, is_token_in_rank, lg.send_head),
                              ep_handle=ep_handle, ep=ep, engine=self.engine, with_topk=with_topk)
        if not with_topk:
            recv_topk_idx = recv_topk_weights = None
        return recv_x, recv_topk_idx, recv_topk_weights, ep_handle.num_recv_tokens_per_expert_list, handle, event

    def lean_dispatch(self, x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                      num_worst_tokens, num_sms: int, previous_event, async_finish: bool,
                      allocate_on_comm_stream: bool):
        """`dispatch` of a call with top-k ids and torch tensors by its signature (the caller checked the event rule
        and `num_sms`, and that num_tokens_per_rank and is_token_in_rank are given): the first call of a signature
        takes the checked path (`_checked_dispatch`) and remembers its entry, the EP bound dispatch that served it
        (`EPHandle._origin`) with what its calls share; a repeated signature runs that bound dispatch straight
        (`b.run_v1`, what `EP.dispatch` calls: the signature here decides EP's, so EP's own key is not rebuilt), with
        the engine's usability check, a `LegacyLayout` of the entry (reused: the engine fills its outputs per call) and
        V1's handle made without a Python-level constructor. Checks that depend on the values (x's alignment; a
        CPU-sync call's top-k range) stay in the bound dispatch; growth (a peer's count above M) redoes the call on the
        checked path. Entries are dropped when `ensure` lays out anew and when the EP component forgot its bound calls
        (its `_bound` replaced: destroyed, or `set_default_num_sms`).

        Returns:
            `dispatch`'s result, or None for a call with other array types (the caller's checked path takes it).
        """
        tensor = interop.TORCH_TENSOR[0]
        if type(topk_idx) is not tensor or type(num_tokens_per_expert) is not tensor:     # (None too)
            return None
        if type(x) is tensor:       # (`interop.meta` of plain torch tensors, inline as in `EP.dispatch`)
            xs, xp, ss, sp = (x.shape, x.stride(), x.dtype, x.get_device()), x.data_ptr(), None, 0
        elif type(x) is tuple and len(x) == 2 and type(x[0]) is tensor and type(x[1]) is tensor:
            data, sf = x
            xs, xp = (data.shape, data.stride(), data.dtype, data.get_device()), data.data_ptr()
            ss, sp = (sf.shape, sf.stride(), sf.dtype, sf.get_device()), sf.data_ptr()
        else:
            return None
        ts, tp = (topk_idx.shape, topk_idx.stride(), topk_idx.dtype, topk_idx.get_device()), topk_idx.data_ptr()
        if topk_weights is None:
            ws, wp = None, 0
        elif type(topk_weights) is tensor:
            ws, wp = ((topk_weights.shape, topk_weights.stride(), topk_weights.dtype, topk_weights.get_device()),
                      topk_weights.data_ptr())
        else:
            return None
        # (the scalars' types too: 1, 1.0 and True are equal keys, and only int passes the checks)
        key = (xs, ss, ts, ws, num_tokens_per_expert.shape, expert_alignment, expert_alignment.__class__,
               num_worst_tokens, num_worst_tokens.__class__, num_sms, previous_event is None, async_finish,
               allocate_on_comm_stream)
        try:
            entry = self._lean.get(key)
        except TypeError:   # (an unhashable argument: the checked path names it, or takes the call unremembered)
            entry = key = None
        if entry is not None:
            b, ep, bound, lg, eng, worst, M = entry
            if ep._bound is bound:
                # (`EP.dispatch`'s usability check, on the engine itself rather than through the EP's proxy of it)
                if eng._destroyed or eng._failed is not None or ep._error_state[0]:
                    eng.check_usable()
                out = b.run_v1(b, ep, x, topk_idx, topk_weights, None, None,
                               None if previous_event is None else as_event_handle(previous_event), xp, sp, tp, wp,
                               0, lg, 0)
                if not worst:
                    seen = lg.max_num_tokens
                    if seen > self.tokens_seen:
                        self.tokens_seen = seen
                    if seen > M:        # every rank saw the same maximum: grow, then redo (the checked path)
                        self.ensure(0, 0, seen)
                        return self._checked_dispatch(key, x, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                                      topk_weights, expert_alignment, num_worst_tokens, num_sms,
                                                      previous_event, async_finish, allocate_on_comm_stream)
                recv_x, recv_topk_idx, recv_topk_weights, ep_handle, event = out
                handle = _new_handle((lg.rank_prefix_matrix, lg.channel_prefix_matrix, lg.recv_channel_prefix_matrix,
                                      lg.recv_src_idx, is_token_in_rank, lg.send_head))
                handle.__dict__ = {'ep_handle': ep_handle, 'ep': ep, 'engine': eng, 'with_topk': True}
                counts = ep_handle._counts      # (`EPHandle.num_recv_tokens_per_expert_list` inline)
                if type(counts) is not list:
                    counts = ep_handle._counts = counts.tolist()
                return recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event
            del self._lean[key]
        return self._checked_dispatch(key, x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                      expert_alignment, num_worst_tokens, num_sms, previous_event, async_finish,
                                      allocate_on_comm_stream)

    def _checked_dispatch(self, key, x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                          expert_alignment, num_worst_tokens, num_sms: int, previous_event, async_finish: bool,
                          allocate_on_comm_stream: bool):
        """`lean_dispatch` of a signature without an entry: the remaining checks and `dispatch`, then the entry of
        `key` (None: not remembered) when the bound dispatch that served the call is one EP remembers (its key set)
        on the current EP component."""
        check_dispatch_scalars(expert_alignment, num_worst_tokens, True)
        num_experts = interop.shape_of(num_tokens_per_expert, 'num_tokens_per_expert')[0]
        out = self.dispatch(x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                            num_worst_tokens, num_experts, num_sms, previous_event, async_finish,
                            allocate_on_comm_stream)
        handle, eng = out[4], self.engine
        b = handle.ep_handle._origin
        if key is not None and b is not None and b.key is not None and eng is not None and handle.ep is eng.ep:
            if len(self._lean) >= MAX_LEAN_CALLS:
                self._lean.clear()
            ep, N = handle.ep, split_x(x)[2]
            self._lean[key] = (b, ep, ep._bound, LegacyLayout(num_sms // 2, N, None), eng, num_worst_tokens > 0,
                               eng.geometry[0])
        return out

    def destroy(self) -> None:
        """Collective teardown of the current engine (older ones, kept by handles, are freed when dropped)."""
        self._lean.clear()
        if self.engine is not None:
            self.engine.destroy()
        self.engine = None


def expected_handle_type(handle) -> LegacyHandle:
    """`handle` if it is a V1 normal-mode handle of this library; TypeError otherwise."""
    if not isinstance(handle, LegacyHandle):
        raise TypeError(f'handle must be the handle a normal-mode dispatch of a deepep_cupy Buffer returned, got '
                        f'{type(handle).__name__}')
    if not isinstance(handle.ep_handle, EPHandle):
        raise TypeError('handle holds no EPHandle')
    return handle


