"""The bound calls of the low-latency engine: what a `low_latency_dispatch` / `low_latency_combine` of one call
signature needs, fixed once (feature.py binds one on the first call of a signature, after `LLPlanner`'s checks) so
that a call then does only its per-call work: the checks that stay per call (addresses, the handle's origin), its
allocations and views, one generated patch of the launch's pointer words, the launch and its stream order.

A signature is everything the planner's checks read: each array's (shape, strides, dtype, device) or CuPy's
equivalent (`interop.meta`), the integer arguments and the flags with their types (1, 1.0 and True are equal keys
but the planner accepts only one of them). Addresses are per call, and so is the 16-byte alignment the planner asks
of bfloat16 arrays.

Why: an eager decode call's host time is this Python (tests/test_host_path_cpu.py pins its bytecodes per call); the
planner, the parameter dictionaries and a packed launch per call cost about ten times what a call needs.

Outputs: recv_x (and FP8 scales) are allocations of their own, as DeepEP's; the small outputs and the handle's
tensors (recv_count, src_info, layout_range, and the engine's row_route, send_pos, call_info) are views of ONE int32
allocation made per call (`HandleLayout`): fresh every call, never shared between calls, laid out at 256-byte
boundaries. The launches are the previous per-call path's, argument for argument, but one: a combine without a hook
passes the handle's call word (its kernel writes it and, without a receive phase of its own, never reads it back)
instead of a one-word allocation per call; with a hook the receive phase reads it, so each call has its own.
The stream order is DeepEP's: without a hook the communication stream waits for the caller's, runs the kernel, and
the caller's waits for it (an event of the engine each way); with a hook everything runs on the caller's stream. A
hook's receive launch takes an argument block from the bound call's free list at the send and returns it once
launched (a launch copies its arguments), so pending hooks never share one and no call packs a launch anew.
"""

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

from ...runtime import interop
from ...runtime.sizes import align
from .plan import PHASE_RECV, PHASE_SEND, THREADS, combine_smem_bytes, dispatch_smem_bytes

MAX_BOUND = 64          # bound calls remembered per engine and kind (dispatch / combine); more: forgotten, rebound
_ALIGN_WORDS = 64       # sections of the handle's allocation start at 256-byte boundaries


class HandleLayout:
    """Where a dispatch's small outputs sit in its per-call int32 allocation (word offsets), and the dispatch's sizes
    (M, H, E, N, K, kind) a combine of its handles is checked against, and the `interop.Carver` of the handles'
    views. One per bound dispatch: a combine's signature holds it by identity."""

    __slots__ = ('num_max_tokens', 'hidden', 'num_experts', 'num_tokens', 'num_topk', 'kind', 'num_local_experts',
                 'num_rows', 'num_ranks', 'num_words', 'recv_count', 'src_info', 'layout_range', 'row_route',
                 'send_pos', 'call_info', 'combine_call_info', 'carver')

    def __init__(self, M: int, H: int, E: int, N: int, K: int, R: int, kind: str, carver):
        self.num_max_tokens, self.hidden, self.num_experts, self.num_tokens, self.num_topk = M, H, E, N, K
        self.kind, self.num_ranks, self.carver = kind, R, carver
        L, T = E // R, R * M
        self.num_local_experts, self.num_rows = L, T
        words = 0

        def take(n: int) -> int:
            nonlocal words
            at = align(words, _ALIGN_WORDS)
            words = at + n
            return at
        self.recv_count = take(L)
        self.src_info = take(L * T)
        self.layout_range = take(2 * L * R)         # int64: an even word
        self.row_route = take(L * T)
        self.send_pos = take(N * K)
        self.call_info = take(1)
        # A combine without hook writes its call word but never reads it back (the receive phase runs in the same
        # kernel): every such combine of the handle's calls may share this one.
        self.combine_call_info = take(1)
        self.num_words = align(words, _ALIGN_WORDS)

    def sections(self, names: Tuple[str, ...]) -> Tuple[str, ...]:
        """Those of `names` that hold elements (an empty one, send_pos without tokens, is passed as a null pointer,
        as an empty allocation's address is)."""
        return tuple(n for n in names if n != 'send_pos' or self.num_tokens * self.num_topk > 0)

    def view_args(self, name: str) -> Tuple[Tuple[int, ...], str, int]:
        """(shape, dtype, word offset) of the handle's tensor `name`."""
        L, T = self.num_local_experts, self.num_rows
        return {'recv_count': ((L,), 'int32', self.recv_count), 'src_info': ((L, T), 'int32', self.src_info),
                'layout_range': ((L, self.num_ranks), 'int64', self.layout_range),
                'row_route': ((L, T), 'int32', self.row_route),
                'send_pos': ((self.num_tokens, self.num_topk), 'int32', self.send_pos),
                'call_info': ((1,), 'int32', self.call_info)}[name]

    def view(self, carver, group, name: str):
        shape, dtype, word = self.view_args(name)
        return carver.view(group, dtype, shape, word)


def patcher(bound, exprs: Tuple[Tuple[str, str], ...], params: str, what: str) -> Callable:
    """`patch(u, <params>)` storing each (parameter name, expression of `params`) of `exprs` at its word of the
    pointer view `u` of a block bound like `bound` (straight-line code generated once: a call patches a dozen
    pointers, a loop over pairs would cost three times as much)."""
    body = ''.join(f'    u[{bound.index(n)}] = {e}\n' for n, e in exprs) or '    pass\n'
    namespace: Dict[str, Any] = {}
    exec(compile(f'def patch(u, {params}):\n{body}', f'<{what} patch of {bound.spec.name}>', 'exec'), namespace)
    return namespace['patch']


def _at(base: str, words: int) -> str:
    return base if words == 0 else f'{base} + {4 * words}'


class BoundDispatch(NamedTuple):
    """One dispatch signature, bound (`bind_dispatch`); feature.py's `LowLatencyEngine._run_dispatch` unpacks it."""
    torch: bool                 # the arrays are torch tensors (else CuPy)
    hook: bool                  # return_recv_hook: the send now, the receive in `hook()`
    async_: bool                # async_finish
    check_x: bool               # x has rows: its address must be 16-byte aligned
    stream: Callable            # the current stream of the call's arrays
    patch: Callable             # patch(u, xp, tp, xo, so, g0, cp, wp)
    send_u: Any                 # the launch's pointer view (`send.u64`)
    send: Any                   # the BoundLaunch: phases SEND | RECV, or SEND with a hook
    recv_free: Optional[list]   # with a hook: BoundLaunches of the receive phase not held by a pending hook
    bind_recv: Optional[Callable]   # a new one of them
    x_alloc: Callable           # recv_x [L, T, H]
    sf_alloc: Optional[Callable]    # FP8: the scales' storage [L, S, T]
    group_alloc: Callable       # the handle's allocation (`HandleLayout`)
    views: Tuple                # torch: the as_strided arguments of recv_count, src_info, layout_range
    layout: HandleLayout
    handle_const: Dict[str, Any]    # the handles' attributes fixed by the signature
    carver: Any
    enter: Any                  # without a hook: the engine's events of the stream order (the comm stream waits for
    leave: Any                  # `enter` on the current one, the current one for `leave` on the comm stream), else None


class BoundCombine(NamedTuple):
    """One combine signature, bound (`bind_combine`); feature.py's `LowLatencyEngine._run_combine` unpacks it."""
    torch: bool
    hook: bool
    async_: bool
    zero_copy: bool
    check_x: bool               # x has rows: 16-byte aligned
    check_out: bool             # out given, with rows: 16-byte aligned
    stream: Callable
    patch: Callable             # patch(u, xp, g0, tp, wp, op, ci, sp)
    send_u: Any
    send: Any
    recv_free: Optional[list]
    bind_recv: Optional[Callable]
    out_alloc: Optional[Callable]   # combined [N, H] (None: `out` given)
    call_alloc: Optional[Callable]  # with a hook: the call word (int32 [1]) the receive reads back
    combine_call_word: int      # without a hook: the byte offset of the handle's shared call word
    enter: Any                  # (as BoundDispatch's)
    leave: Any


def _bind_pair(kernel, grid: int, smem: int, named: Dict[str, Any], hook: bool):
    """The send block (phases SEND | RECV, or SEND with a hook), and with a hook the factory of receive blocks."""
    send = kernel.bind(grid, THREADS, shared_mem=smem, **named, phases=PHASE_SEND if hook else PHASE_SEND | PHASE_RECV)
    if not hook:
        return send, None, None

    def bind_recv():
        return kernel.bind(grid, THREADS, shared_mem=smem, **named, phases=PHASE_RECV)
    return send, [bind_recv()], bind_recv


def bind_dispatch(engine, p, hook: bool, async_finish: bool) -> BoundDispatch:
    """The bound dispatch of the checked plan `p` (`LLPlanner.plan_dispatch`) on `engine`."""
    lay, R = engine.layout, engine.num_ranks
    L, T, H, N, K = p.num_local_experts, p.num_rows, p.hidden, p.num_tokens, p.num_topk
    torch = p.kind == 'torch'
    carver = interop.Carver(p.kind, engine.base.device)
    hl = HandleLayout(p.num_max_tokens, H, p.num_experts, N, K, R, p.kind, carver)
    named = dict(
        x=0, topk_idx=0, num_tokens=N, num_topk=K, hidden=H, num_experts=p.num_experts,
        num_max_tokens=p.num_max_tokens, use_fp8=int(p.use_fp8), round_scale=int(p.round_scale),
        use_ue8m0=int(p.use_ue8m0), recv_x=0, recv_sf=0, recv_count=0, src_info=0, layout_range=0, row_route=0,
        send_pos=0, call_info=0, cumulative_stats=0, wait_stats=0, lists_offset=lay.lists_offset,
        dslots_offset=lay.dslots_offset, slot_tokens=lay.num_max_tokens, msg_bytes=lay.msg_bytes,
        msg_hidden_offset=lay.msg_hidden_offset, **engine._common_args())
    send, recv_free, bind_recv = _bind_pair(engine._dispatch_kernel, engine.base.num_device_sms,
                                            dispatch_smem_bytes(p.num_experts, R), named, hook)
    exprs = [('x', 'xp'), ('topk_idx', 'tp'), ('recv_x', 'xo')]
    if p.use_fp8:
        exprs.append(('recv_sf', 'so'))
    exprs += [(n, _at('g0', getattr(hl, n))) for n in hl.sections(('recv_count', 'src_info', 'layout_range',
                                                                    'row_route', 'send_pos', 'call_info'))]
    if p.cumulative_stats is not None:
        exprs.append(('cumulative_stats', 'cp'))
    if p.wait_stats is not None:
        exprs.append(('wait_stats', 'wp'))
    patch = patcher(send, tuple(exprs), 'xp, tp, xo, so, g0, cp, wp', 'dispatch')
    enter, leave = (None, None) if hook else engine._events()
    sf_alloc = None
    if p.use_fp8:
        sf_alloc = (carver.allocator((L, H // 512, T), 'int32') if p.use_ue8m0 else
                    carver.allocator((L, H // 128, T), 'float32'))
    views = ()
    if torch:
        views = (((L,), (1,), hl.recv_count), ((L, T), (T, 1), hl.src_info),
                 ((L, R), (R, 1), hl.layout_range // 2))
    return BoundDispatch(
        torch=torch, hook=hook, async_=async_finish, check_x=N > 0,
        stream=interop.stream_getter(p.kind, engine.base.device), patch=patch, send_u=send.u64, send=send,
        recv_free=recv_free, bind_recv=bind_recv,
        x_alloc=carver.allocator((L, T, H), 'float8_e4m3fn' if p.use_fp8 else 'bfloat16'), sf_alloc=sf_alloc,
        group_alloc=carver.allocator((hl.num_words,), 'int32'), views=views, layout=hl,
        handle_const=dict(num_tokens=N, num_topk=K, kind=p.kind, engine_id=id(engine), _sig=hl), carver=carver,
        enter=enter, leave=leave)


def bind_combine(engine, p, hl: HandleLayout, hook: bool, async_finish: bool) -> BoundCombine:
    """The bound combine of the checked plan `p` (`LLPlanner.plan_combine`) of handles laid out as `hl`."""
    lay, R = engine.layout, engine.num_ranks
    named = dict(
        x=0, recv_count=0, row_route=0, layout_range=0, send_pos=0, topk_idx=0, topk_weights=0, combined_x=0,
        num_tokens=p.num_tokens, num_topk=p.num_topk, hidden=p.hidden, num_experts=p.num_experts,
        num_max_tokens=p.num_max_tokens, call_info=0, wait_stats=0, cflags_offset=lay.cflags_offset,
        cslots_offset=lay.cslots_offset, slot_segs=lay.num_segs, **engine._common_args())
    send, recv_free, bind_recv = _bind_pair(engine._combine_kernel, engine.base.num_device_sms,
                                            combine_smem_bytes(p.num_experts, R), named, hook)
    exprs = [('x', 'xp')] + [(n, _at('g0', getattr(hl, n))) for n in hl.sections(('recv_count', 'row_route',
                                                                                  'layout_range', 'send_pos'))]
    exprs += [('topk_idx', 'tp'), ('topk_weights', 'wp'), ('combined_x', 'op'), ('call_info', 'ci')]
    if p.wait_stats is not None:
        exprs.append(('wait_stats', 'sp'))
    patch = patcher(send, tuple(exprs), 'xp, g0, tp, wp, op, ci, sp', 'combine')
    enter, leave = (None, None) if hook else engine._events()
    carver = interop.Carver(p.kind, engine.base.device)
    return BoundCombine(
        torch=p.kind == 'torch', hook=hook, async_=async_finish, zero_copy=p.zero_copy, check_x=p.x.numel > 0,
        check_out=p.out is not None and p.out.numel > 0, stream=interop.stream_getter(p.kind, engine.base.device),
        patch=patch, send_u=send.u64, send=send, recv_free=recv_free, bind_recv=bind_recv,
        out_alloc=None if p.out is not None else carver.allocator((p.num_tokens, p.hidden), 'bfloat16'),
        call_alloc=carver.allocator((1,), 'int32') if hook else None, combine_call_word=4 * hl.combine_call_info,
        enter=enter, leave=leave)


def make_hook(stream: Callable, recv_free: list, keep: Tuple) -> Callable[[], None]:
    """`hook()` of a call whose send ran: launches the receive phase (its block `recv_free.pop()`, patched with the
    send's pointers by the caller, who passes it as `keep[0]`) on the current stream, then returns the block to
    `recv_free` (a launch copies its parameters: the block may be patched again at once). Holds `keep` (the block,
    the call's inputs and outputs) until then. Called twice: RuntimeError (the receive phase of a call runs once;
    DeepEP's would wait for messages that never come)."""
    state = [keep]

    def hook() -> None:
        held = state[0]
        if held is None:
            raise RuntimeError('this low-latency receive hook was already called (each call\'s hook runs once)')
        state[0] = None
        block = held[0]
        block(stream())
        recv_free.append(block)
    return hook
