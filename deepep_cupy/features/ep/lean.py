"""The lean paths of a bound dispatch (bound.py's `BoundDispatch.run`, chosen at binding): a cached dispatch, a
no-sync one and a CPU-sync one, in the common case (no V1 matrices; no-sync and cached: no separate send launch, a
cached call in its handle's mode), with only their per-call work: the checks that stay per call (x's alignment; a
CPU-sync call's top-k range; the handle's type and origin, shapes and flags are the call's key), one allocation
(recv_x / recv_sf too large to be carved out of it: also theirs), the views, one generated patcher of the launch
arguments, the launches (no-sync: back to back), the handle's slots, the event. Everything fixed per bound dispatch
(or per output sizes: cached and CPU-sync, `learn_size`) is precomputed: the patchers, the views' arguments, the
allocation functions, the handles' fixed slots; the cached and CPU-sync paths share their receive up to its launch
(`prepare_receive`). A CPU-sync call prepares the receive of the last call's sizes while the GPU counts (speculated:
kept when the counts repeat them, else dropped and prepared again; `run_cpu_sync`), so that what follows the counts
is mostly the receive's launch and the event. They fall back to `BoundDispatch.__call__` while it must run (the data
region not yet claimed, a readiness guard set or left in a block).

Why: the Python host path is what an eager decode-sized dispatch costs on the GPU host
(tests/test_ep_host_order_cpu.py pins that these paths launch what `__call__` launches, tests/test_host_path_cpu.py
their bytecodes per call)."""

import functools
from typing import Tuple

from . import plan as ep_plan
from .handle import EPHandle, WorkspaceOffsets
from .kernels import HOST_MAX_TOKENS_WORD
from .legacy import receive_views, workspace_views
from .patch import Outputs as _Outputs
from .patch import allocate_x, cached_patcher, call_patcher, cupy_views

MAX_SIZES = 64      # output sizes remembered per cached bound dispatch (CPU-sync handles' sizes vary per call)
# Pointer arguments patched per call: inputs and workspace parts (bound.py's names, in its order), outputs
INPUTS = ('x', 'sf', 'topk_idx', 'topk_weights', 'send_pos', 'send_expert_pos', 'token_of_slot', 'send_count',
          'recv_layout')
OUTPUTS = ('recv_x', 'recv_sf', 'recv_topk_idx', 'recv_topk_weights', 'recv_src_metadata', 'recv_src_idx')

# A handle without `__init__` (the lean paths set its slots as `EPHandle._new` does)
_new_handle = functools.partial(EPHandle.__new__, EPHandle)


def part_exprs(offsets: WorkspaceOffsets) -> WorkspaceOffsets:
    """Each workspace part's address as an expression of the generated patchers (`ws + byte offset`)."""
    return WorkspaceOffsets._make(f'ws + {4 * w}' for w in offsets)


def input_exprs(offsets: WorkspaceOffsets) -> dict:
    """The `INPUTS` pointers' expressions (parameter -> expression): the call's inputs, the workspace's parts."""
    at = part_exprs(offsets)
    return dict(zip(INPUTS, ('xp', 'sp', 'tp', 'wp', at.send_pos, at.send_expert_pos, at.token_of_slot, at.send_count,
                             at.recv_layout)))


def constant_zeros(p: ep_plan.DispatchPlan) -> Tuple[str, ...]:
    """The pointer arguments that are 0 on every call of a bound dispatch (the signature says the array is absent):
    bound as 0, a generated patcher leaves them."""
    return tuple(n for n, absent in (('sf', p.sfi is None), ('topk_weights', p.topk_weights is None),
                                     ('cumulative_stats', p.stats is None)) if absent)


def bind_call_patch(b, p: ep_plan.DispatchPlan, inputs: dict, notify_exprs: tuple) -> None:
    """The bound dispatch `b`'s generated patcher of a whole no-sync call (bound.py, at binding). No CPU sync: every
    pointer is an input's, the workspace's plus a constant, or (recv_x not carved) recv_x's / recv_sf's, all patched
    by one generated function: `call_patch(xp, sp, tp, wp, cp, ws)` with recv_x carved,
    `call_patch_x(xp, sp, tp, wp, cp, ws, xo, so)` (xo, so: recv_x's and recv_sf's storage addresses) without
    (None: block by block; `__call__` uses `call_patch`, lean.py's no-sync paths either)."""
    b.call_patch = b.call_patch_x = None
    b._zeros = constant_zeros(p)
    if b.fixed is not None:
        # (pointers that are 0 on every call with this key stay as bound: `constant_zeros`)
        zero, carved = b._zeros, b.fixed.x_offset >= 0
        outs = tuple((n, f'ws + {at}') for n, at in zip(OUTPUTS, b.fixed.byte_at) if at >= 0)
        if not carved:      # (recv_sf's 0 without FP8 stays as bound, like the other absent outputs)
            outs = (('recv_x', 'xo'),) + ((('recv_sf', 'so'),) if b.fixed.sf_shape is not None else ()) + outs
        ins = tuple((n, e) for n, e in inputs.items() if n not in zero)
        blocks = [(b.notify, tuple((n, e) for n, e in notify_exprs if n not in zero))]
        blocks += [(b.send, ins)] if b.send else []
        one = call_patcher(blocks + [(b.recv, ins + outs)], 'no-sync dispatch', () if carved else ('xo', 'so'))
        b.call_patch, b.call_patch_x = (one, None) if carved else (None, one)


def bind(b, p: ep_plan.DispatchPlan) -> None:
    """Choose the bound dispatch `b`'s `run` for its checked plan `p` (at the end of its binding) and precompute what
    the lean path takes: `b.run` is a plain function (`run_cached`, `run_no_sync`, `run_cpu_sync` or
    `BoundDispatch.__call__`), kept on the instance without a reference cycle; `EP.dispatch` calls `b.run(b, ...)`."""
    f = b.fixed
    # no CPU sync, torch: the views' arguments of the fixed layout (recv_x, recv_sf, recv_topk_idx, recv_topk_weights;
    # None: none); the handles' slots fixed per bound dispatch; the metadata's place; the workspace's allocation as one
    # call on the caller's stream (None: `Carver.empty` on the comm stream)
    b._fixed_views = b._handle_const = b._meta_of = None
    b._meta_byte = 0
    if f is not None:
        b._fixed_views = view_args(f)
        b._handle_const = (b.handle_fields, f.num_recv, f.num_expanded, None, None)
        b._meta_byte, b._meta_of = f.byte_at[4], (b.carver, f.meta_shape, f.at[4])
    b._ws_alloc = None if b.alloc_on_comm else b.carver.allocator(b.ws_alloc_shape, b.ws_alloc_dtype)
    # `__call__` runs while `_lean_blocked` (the data region not yet claimed, or a readiness guard left in a block)
    b._lean_blocked = b.claim
    b._lean_sizes = {}          # cached: (num_recv, num_expanded) -> `learn_size`'s entry
    b._lean_patchers = {}       # cached: the outputs' presence -> their patcher
    b._lean_spec = None         # CPU-sync: (num_recv, num_expanded, entry) to speculate on (see `run_cpu_sync`)
    b._lean_last = None         # CPU-sync: (num_recv, num_expanded) of the last call
    plain = b.v1_channels is None and b.send is None
    # cached: whether the handles of this key keep their top-k ids in the workspace (the origin's do_handle_copy)
    b.topk_in_ws = p.cached and p.handle._topk_idx is None
    # no CPU sync, recv_x not carved, torch on the caller's stream: recv_x's allocation function, recv_sf's storage's
    # (None: no FP8) and recv_sf's view of it (None: the storage itself); None: `patch.allocate_x` per call
    b._x_allocs = None
    if f is not None and f.x_offset < 0 and b._torch_dtypes is not None and not b.alloc_on_comm:
        sf_alloc = sf_view = None
        if f.sf_shape is not None:
            sf_alloc = b.carver.allocator(f.sf_shape, b.sf_dtype)
            if p.use_tma_aligned_col_major_sf:  # (`allocate_x`'s storage.t()[:rows])
                sf_view = (f.sf_view_shape, f.sf_strides, 0)
        b._x_allocs = (b.carver.allocator(f.x_shape, b.x_dtype), sf_alloc, sf_view)
    if p.cached and plain and p.do_expand == p.handle.do_expand:
        b.run = run_cached
    elif (b.call_patch is not None or b.call_patch_x is not None) and plain:
        b.run = run_no_sync
    elif p.do_cpu_sync and not p.cached and b.v1_channels is None:
        b.run = run_cpu_sync
    else:
        b.run = type(b).__call__
    # DeepEP V1 calls (a `LegacyLayout`; `EP.dispatch` calls `b.run_v1(b, ..., legacy, ecp)`): the no-sync and CPU-sync
    # lean paths, V1's matrices' pointers patched with the others (bound.py), its views made after the launches
    b.run_v1 = type(b).__call__
    if b.v1_channels is not None:
        if (b.call_patch is not None or b.call_patch_x is not None) and b.send is None and not b.v1_counts:
            b.run_v1 = run_no_sync_v1
        elif p.do_cpu_sync and not (b.async_ and b.v1_counts):    # (an async call's event holds the counts)
            b.run_v1 = run_cpu_sync_v1


def run_cached(b, ep, x_in, topk_idx, topk_weights, stats, handle: EPHandle, event, xp: int, sp: int, tp: int,
               wp: int, cp: int):
    """`__call__` of a cached dispatch bound without V1 matrices, with one launch, in its handle's mode (no
    psum to recompute): its per-call work only. The sizes come from the handle (its origin is this call's key's,
    so its constants are this bound dispatch's)."""
    if xp & 15:
        raise ValueError('x rows must start at 16-byte aligned addresses')
    h = handle
    lean = b._lean_sizes.get((h.num_recv_tokens, h.num_expanded_tokens))
    if lean is None:    # (a size met for the first time: CPU-sync handles' sizes vary per call)
        lean = learn_size(b, h.num_recv_tokens, h.num_expanded_tokens)
    if b._lean_blocked or ep.ready_guard is not None:
        return b(ep, x_in, topk_idx, topk_weights, stats, handle, event, xp, sp, tp, wp, cp)
    current = b.stream()
    comm = ep._order.enter(current, event, b.local)
    user_topk, counts = h._topk_idx, h._counts
    if user_topk is not None:   # (else the patch takes the workspace's copy)
        tp = h.topk_idx_ptr
    if type(counts) is list:    # (the handle's list, which its caller may hold: copied now; numpy: shared)
        counts = list(counts)
    made = prepare_receive(b, lean, comm, h.workspace, h.workspace_ptr, user_topk, h._psum_expert, xp, sp, tp, wp,
                           cp)
    made[3]._counts = counts
    b.recv(comm)
    if b.async_:
        return made + (receive_event(b, ep, current, x_in, topk_idx, topk_weights, stats, made),)
    return made + (ep._order.leave(b.kind, current, comm, False),)


def run_cpu_sync(b, ep, x_in, topk_idx, topk_weights, stats, handle, event, xp: int, sp: int, tp: int, wp: int,
                 cp: int, v1=None):
    """`__call__` of a dispatch with a CPU sync, bound without V1 matrices: its per-call work only, in `__call__`'s
    order (the top-k range check started first and read back before any EP kernel; the notify and the send (several
    ranks: its own launch); the host's wait for the counts; the receive of exact outputs). What needs no count comes
    before the wait: the notify's patch before the range's result (patching launches nothing), the receive's input
    pointers while the GPU counts, and, speculating that the sizes repeat (always at one rank without masked tokens,
    often at decode; from the second of two calls in a row with the same sizes until a miss, so that sizes that vary
    per call cost no speculation but the first miss's), the outputs of the last call's sizes (`prepare_receive`:
    their allocation, views, the patch of their pointers, the receive block's sizes, the new handle but its counts),
    so that on a hit the host's share after the counts is the receive's launch, the handle's counts and the event
    (the CPU-sync dispatch's host time beyond the notify). Only outputs carved out of one allocation (at
    most `CARVED_RECV_MAX_BYTES`, 16 MiB) are speculated; on a miss they are freed before the right ones are
    allocated (no kernel saw them), so two groups are never live at once, though the allocator's cache may keep the
    freed one (at most 16 MiB) for later calls; a miss costs about what the outputs cost without speculating plus
    the unused group's allocation and views (spent before the wait, while the GPU counts). A CPU-sync call cannot be
    captured into a CUDA graph (the host reads back what its kernels wrote: captured, they would not run and the
    wait would time out), so its event is `StreamOrder.leave`'s with `captured=False`: the stream is not asked.
    `v1`: a DeepEP V1 call's `LegacyLayout` (`run_cpu_sync_v1`), whose views of the workspace are made while the GPU
    counts too."""
    if xp & 15:
        raise ValueError('x rows must start at 16-byte aligned addresses')
    if b._lean_blocked or ep.ready_guard is not None:
        return b(ep, x_in, topk_idx, topk_weights, stats, handle, event, xp, sp, tp, wp, cp)
    current = b.stream()
    wait_range = ep._start_range(topk_idx, tp, b.num_topk_values, b.num_topk, current)
    comm = ep._order.enter(current, event, b.local)
    alloc = b._ws_alloc
    ws = alloc() if alloc is not None else b.carver.empty(b.ws_alloc_shape, b.ws_alloc_dtype, comm)
    ws_ptr = ws.data_ptr() if b._torch_dtypes is not None else b.carver.ptr(ws)
    n, snd = b.notify, b.send
    b.notify_patch(n.u64, xp, sp, tp, wp, cp, ws_ptr)
    if snd is not None:
        b.send_patch(snd.u64, xp, sp, tp, wp, cp, ws_ptr)
    lo, hi = wait_range()
    if lo < -1 or hi >= b.num_experts:
        raise ValueError(f'topk_idx values must be in [-1, {b.num_experts}), got min {lo}, max {hi}')
    n.i32[b.notify_seq] = seq = ep._next_host_seq()
    n(comm)
    if snd is not None:
        snd(comm)
    # While the GPU counts: the receive's input pointers, and the outputs of the last call's sizes (speculated).
    b.recv_in_patch(b.recv.u64, xp, sp, tp, wp, cp, ws_ptr)
    user_topk = topk_idx if b.user_topk else None
    spec = b._lean_spec
    made = None if spec is None else prepare_receive(b, spec[2], comm, ws, ws_ptr, user_topk, None, xp, sp, tp, wp,
                                                     cp)
    if v1 is not None:
        workspace_views(b, v1, ws)
    num_recv, num_expanded, counts = ep._wait_host_counts(seq, b.num_local_experts)
    if made is None or num_recv != spec[0] or num_expanded != spec[1]:
        made = None             # (a miss: the speculated outputs go before the right ones are allocated)
        key = (num_recv, num_expanded)
        lean = b._lean_sizes.get(key)
        if lean is None:
            lean = learn_size(b, num_recv, num_expanded)
        made = prepare_receive(b, lean, comm, ws, ws_ptr, user_topk, None, xp, sp, tp, wp, cp)
        # Speculate once two calls in a row had these sizes (own_x: never), until a miss
        b._lean_spec = (num_recv, num_expanded, lean) if key == b._lean_last and not lean[7] else None
        b._lean_last = key
    b.recv(comm)
    made[3]._counts = counts.copy()     # (after the launch: `EP._wait_host_counts`)
    if b.async_:
        return made + (receive_event(b, ep, current, x_in, topk_idx, topk_weights, stats, made),)
    return made + (ep._order.leave(b.kind, current, comm, False, captured=False),)


def prepare_receive(b, lean, comm, ws, ws_ptr: int, user_topk, psum_expert, xp: int, sp: int, tp: int, wp: int,
                    cp: int) -> tuple:
    """The receive of a cached or CPU-sync lean dispatch up to its launch, for the sizes of `lean` (`learn_size`'s
    entry; CPU-sync: maybe speculated, see `run_cpu_sync`): the outputs' allocation and views (recv_x too large to
    carve: an allocation of its own, FP8 recv_sf's storage too, as `__call__` makes them), one patch of the launch's
    pointers, the receive block's sizes, the new handle but its counts. Returns the call's result but its event:
    (recv_x or (recv_x, recv_sf), recv_topk_idx, recv_topk_weights, handle)."""
    out, patch, tv, fixed, meta_byte, meta_of, alloc, own_x = lean
    carver = b.carver
    group = alloc() if alloc is not None else carver.empty(out.alloc_shape, out.alloc_dtype, comm)
    if tv is not None:          # torch: the views inline (their arguments fixed per size: `learn_size`)
        g0 = group.data_ptr()
        x_v, sf_v, topk_v, weights_v = tv
        td = b._torch_dtypes
        recv_topk_idx = None if topk_v is None else group.view(td[0]).as_strided(*topk_v)
        recv_topk_weights = None if weights_v is None else group.view(td[1]).as_strided(*weights_v)
        if x_v is not None:
            recv_x = group.as_strided(*x_v)
            recv_sf = None if sf_v is None else group.view(td[2]).as_strided(*sf_v)
    else:
        recv_x, recv_sf, recv_topk_idx, recv_topk_weights, g0 = views(b, group, out)
    if own_x:                   # (after the small outputs' allocation, as `__call__` makes them)
        (recv_x, recv_sf), (xo, so) = allocate_x(carver, out, b.x_dtype, b.sf_dtype,
                                                 b.p.use_tma_aligned_col_major_sf, comm if b.alloc_on_comm else None)
        patch(xp, sp, tp, wp, cp, ws_ptr, g0, out.byte_at, xo, so)
    else:
        patch(xp, sp, tp, wp, cp, ws_ptr, g0, out.byte_at)
    if out is not b._recv_sized or b._recv_free:
        b._size_recv(out, 0)
    # (`EPHandle._new` inline: the same slots, tests/test_ep_host_order_cpu.py compares them; the caller sets
    # `_counts`)
    nh = _new_handle()
    nh._c, nh.num_recv_tokens, nh.num_expanded_tokens, nh._meta = fixed
    nh._origin, nh._meta_ptr, nh._meta_of = b, g0 + meta_byte, (group, meta_of)
    nh.workspace, nh.workspace_ptr, nh._topk_idx, nh._psum_expert = ws, ws_ptr, user_topk, psum_expert
    return ((recv_x, recv_sf) if b.fp8 else recv_x), recv_topk_idx, recv_topk_weights, nh


def receive_event(b, ep, current, x_in, topk_idx, topk_weights, stats, made: tuple):
    """The `EventOverlap` of an asynchronous cached or CPU-sync lean call (`made`: `prepare_receive`'s result), holding
    what `__call__`'s holds."""
    x_out, recv_topk_idx, recv_topk_weights, nh = made
    recv_x, recv_sf = x_out if b.fp8 else (x_out, None)
    return async_event(b, ep, current, x_in, topk_idx, topk_weights, stats, recv_x, recv_sf, recv_topk_idx,
                       recv_topk_weights, nh.workspace, nh._meta_of[0], nh._topk_idx)


def run_no_sync(b, ep, x_in, topk_idx, topk_weights, stats, handle, event, xp: int, sp: int, tp: int, wp: int,
                cp: int):
    """`__call__` of a dispatch without CPU sync, bound without V1 matrices and with no separate send launch: its
    per-call work only; the launches back to back. Its worst-case outputs are carved out of its workspace
    (`call_patch`), or, too large for that (`CARVED_RECV_MAX_BYTES`), recv_x (and FP8 recv_sf's storage) are
    allocations of their own, made after the workspace's as `__call__` makes them (`patch.allocate_x`; torch on the
    caller's stream: `Carver.allocator`'s partials, bound in `bind`) and patched with it (`call_patch_x`)."""
    if xp & 15:
        raise ValueError('x rows must start at 16-byte aligned addresses')
    if b._lean_blocked or ep.ready_guard is not None:
        return b(ep, x_in, topk_idx, topk_weights, stats, handle, event, xp, sp, tp, wp, cp)
    current = b.stream()
    comm = ep._order.enter(current, event, b.local)
    alloc, patch_x = b._ws_alloc, b.call_patch_x
    ws = alloc() if alloc is not None else b.carver.empty(b.ws_alloc_shape, b.ws_alloc_dtype, comm)
    td = b._torch_dtypes
    if patch_x is None:         # recv_x carved
        if td is not None:      # torch: the views inline (the layout is fixed: their arguments too)
            ws_ptr = ws.data_ptr()
            x_view, sf_view, topk_view, weights_view = b._fixed_views
            recv_x = ws.as_strided(*x_view)
            recv_sf = None if sf_view is None else ws.view(td[2]).as_strided(*sf_view)
            recv_topk_idx = None if topk_view is None else ws.view(td[0]).as_strided(*topk_view)
            recv_topk_weights = None if weights_view is None else ws.view(td[1]).as_strided(*weights_view)
        else:
            recv_x, recv_sf, recv_topk_idx, recv_topk_weights, ws_ptr = views(b, ws, b.fixed)
        b.call_patch(xp, sp, tp, wp, cp, ws_ptr)
    else:
        x_allocs = b._x_allocs
        if x_allocs is not None:    # torch on the caller's stream: the allocations inline
            x_alloc, sf_alloc, sf_view = x_allocs
            recv_x = x_alloc()
            xo = recv_x.data_ptr()
            recv_sf, so = None, 0
            if sf_alloc is not None:
                recv_sf = sf_alloc()
                so = recv_sf.data_ptr()
                if sf_view is not None:
                    recv_sf = recv_sf.as_strided(*sf_view)
        else:
            (recv_x, recv_sf), (xo, so) = allocate_x(b.carver, b.fixed, b.x_dtype, b.sf_dtype,
                                                     b.p.use_tma_aligned_col_major_sf,
                                                     comm if b.alloc_on_comm else None)
        if td is not None:      # torch: the small outputs' views inline (their arguments fixed)
            ws_ptr = ws.data_ptr()
            _, _, topk_view, weights_view = b._fixed_views
            recv_topk_idx = None if topk_view is None else ws.view(td[0]).as_strided(*topk_view)
            recv_topk_weights = None if weights_view is None else ws.view(td[1]).as_strided(*weights_view)
        else:                   # (`cupy_views` leaves recv_x and recv_sf, which are not carved)
            _, _, recv_topk_idx, recv_topk_weights, ws_ptr = views(b, ws, b.fixed)
        patch_x(xp, sp, tp, wp, cp, ws_ptr, xo, so)
    # (the receive block holds the fixed sizes: sized at binding, and after a guarded call `_lean_blocked` sends
    # the next one through `__call__`, which sizes it back)
    r = b.recv
    if r is not b.notify:      # (fused: one launch)
        b.notify(comm)
    r(comm)
    user_topk = topk_idx if b.user_topk else None
    # (`EPHandle._new` inline: the same slots, tests/test_ep_host_order_cpu.py compares them)
    nh = _new_handle()
    nh._c, nh.num_recv_tokens, nh.num_expanded_tokens, nh._meta, nh._psum_expert = b._handle_const
    nh._origin = b
    nh._counts, nh._meta_ptr, nh._meta_of = [], ws_ptr + b._meta_byte, (ws, b._meta_of)
    nh.workspace, nh.workspace_ptr, nh._topk_idx = ws, ws_ptr, user_topk
    if b.async_:
        event_out = async_event(b, ep, current, x_in, topk_idx, topk_weights, stats, recv_x, recv_sf,
                                recv_topk_idx, recv_topk_weights, ws, ws, user_topk)
    else:
        event_out = ep._order.leave(b.kind, current, comm, False)
    return ((recv_x, recv_sf) if b.fp8 else recv_x), recv_topk_idx, recv_topk_weights, nh, event_out


def run_no_sync_v1(b, ep, x_in, topk_idx, topk_weights, stats, handle, event, xp: int, sp: int, tp: int, wp: int,
                   cp: int, legacy, ecp: int):
    """`run_no_sync` of a DeepEP V1 call (`legacy`: its `LegacyLayout`, without expert counts: `ecp` is 0, as
    bound): V1's matrices' pointers are in `call_patch` / `call_patch_x` (workspace plus constants); V1's outputs are
    views made after the launches, like the other outputs in the workspace's allocation (torch: one int32 view of it
    and an `as_strided` per output, their arguments fixed at binding, `legacy.bind`'s `v1_fixed_views`, send_head
    shared with the handle as its dst_buffer_slot_idx; CuPy: `v1_outputs`' two parts)."""
    if b._lean_blocked or ep.ready_guard is not None:
        return b(ep, x_in, topk_idx, topk_weights, stats, handle, event, xp, sp, tp, wp, cp, legacy, ecp)
    out = run_no_sync(b, ep, x_in, topk_idx, topk_weights, stats, handle, event, xp, sp, tp, wp, cp)
    nh = out[3]
    ws = nh.workspace
    fixed_views = b.v1_fixed_views
    if fixed_views is None:
        receive_views(b, legacy, nh, ws, b.fixed.byte_at[5], workspace_views(b, legacy, ws))
        return out
    w = ws if b.v1_ws_int32 else ws.view(b.v1_int32)
    rpm, cpm, rcpm, src, head, head_key = fixed_views
    legacy.rank_prefix_matrix = w.as_strided(*rpm)
    legacy.channel_prefix_matrix = w.as_strided(*cpm)
    legacy.recv_channel_prefix_matrix = w.as_strided(*rcpm)
    legacy.recv_src_idx = w.as_strided(*src)
    legacy.send_head = send_head = w.as_strided(*head)
    nh._views = {'int32': w, head_key: send_head}
    return out


def run_cpu_sync_v1(b, ep, x_in, topk_idx, topk_weights, stats, handle, event, xp: int, sp: int, tp: int, wp: int,
                    cp: int, legacy, ecp: int):
    """`run_cpu_sync` of a DeepEP V1 call (`legacy`: its `LegacyLayout`; `ecp`: its expert counts' address, patched
    before the notify's launch when the signature has them): the receive speculated as V2's (its recv_src_idx pointer
    is one of the outputs' patch); V1's views of the workspace (its matrices, send_head) made while the GPU counts
    (`legacy.workspace_views`); after the receive's launch the largest reported token count (growth) and the rest of
    V1's outputs: recv_src_idx (torch: a view of the outputs' allocation right after recv_src_metadata, patch.py
    `output_layout`'s order; CuPy: `legacy.receive_views`)."""
    if b._lean_blocked or ep.ready_guard is not None:
        return b(ep, x_in, topk_idx, topk_weights, stats, handle, event, xp, sp, tp, wp, cp, legacy, ecp)
    if b.v1_counts:
        b.notify.u64[b.notify_v1_idx[0]] = ecp
    out = run_cpu_sync(b, ep, x_in, topk_idx, topk_weights, stats, handle, event, xp, sp, tp, wp, cp, legacy)
    legacy.max_num_tokens = int(ep.host_counts[HOST_MAX_TOKENS_WORD])
    nh = out[3]
    i32 = b.v1_int32
    if i32 is None:
        receive_views(b, legacy, nh, nh._meta_of[0], b.outputs(nh.num_recv_tokens, nh.num_expanded_tokens).byte_at[5],
                      None)
        return out
    group, (_, _, meta_word) = nh._meta_of
    num_recv = nh.num_recv_tokens
    g = group if group.dtype is i32 else group.view(i32)
    legacy.recv_src_idx = g.as_strided((num_recv,), (1,), meta_word + num_recv * b.v1_meta_cols)
    nh._views = legacy.handle_views     # (`legacy.workspace_views`' while the GPU counted)
    return out


def views(b, group, out: _Outputs):
    """(recv_x, recv_sf, recv_topk_idx, recv_topk_weights, the allocation's address) of a lean path's CuPy call:
    views of `group` (None where `out` carves none; torch calls make theirs inline from `view_args`)."""
    recv_topk_idx, recv_topk_weights, recv_x, recv_sf = cupy_views(b.carver, group, out, b.x_dtype, b.sf_dtype)
    return recv_x, recv_sf, recv_topk_idx, recv_topk_weights, b.carver.ptr(group)


def view_args(out: _Outputs) -> tuple:
    """The `as_strided` arguments of a torch call's views of the outputs' allocation under the layout `out`: (recv_x,
    recv_sf, recv_topk_idx, recv_topk_weights), each (shape, strides, offset in its dtype's elements) or None where
    `out` carves none."""
    topk_at, weights_at, x_at, sf_at, _ = out.at
    return ((out.x_shape, out.x_strides, x_at) if x_at >= 0 else None,
            (out.sf_view_shape, out.sf_strides, sf_at) if sf_at >= 0 else None,
            (out.topk_shape, out.topk_strides, topk_at) if topk_at >= 0 else None,
            (out.weights_shape, out.weights_strides, weights_at) if weights_at >= 0 else None)


def learn_size(b, num_recv: int, num_expanded: int) -> tuple:
    """`prepare_receive`'s entry for these sizes (remembered): the outputs' layout, the patcher of the receive's
    pointers (a CPU-sync binding's: the outputs' only, `run_cpu_sync` patched the inputs), the views' arguments, the new
    handles' slots fixed by the sizes, the metadata's byte offset and place, the small outputs' allocation function,
    whether recv_x is not carved (`own_x`; then, with FP8 recv_sf, the patcher takes their own allocations' addresses
    `xo`, `so`)."""
    out = b.outputs(num_recv, num_expanded)
    own_x = out.byte_at[0] < 0
    present = tuple(at >= 0 for at in out.byte_at) + (own_x and out.sf_shape is not None, own_x)
    patch = b._lean_patchers.get(present)
    if patch is None and b.cpu_sync and not b.cached:    # (`run_cpu_sync` patched the inputs: the outputs only)
        patch = b._lean_patchers[present] = cached_patcher(b.recv, _output_exprs(out, present, own_x))
    elif patch is None:
        # Pointers that are 0 on every call of this bound dispatch stay as bound (0): the scales without FP8, the
        # weights when none are given (both part of the key), and the outputs this layout has none of (all but
        # recv_x / recv_sf, which are either carved or allocations of their own, depend on the key alone).
        inputs = input_exprs(b.offsets)
        for n in b._zeros:
            inputs.pop(n, None)
        if b.topk_in_ws:     # (the handle's copy: `tp` is not looked up per call)
            inputs['topk_idx'] = f'ws + {b.topk_copy_bytes}'
        patch = b._lean_patchers[present] = cached_patcher(b.recv, tuple(inputs.items()) +
                                                           _output_exprs(out, present, own_x))
    tv = view_args(out) if b._torch_dtypes is not None else None     # torch: the views' arguments
    if len(b._lean_sizes) >= MAX_SIZES:
        b._lean_sizes.clear()
    fixed = (b.handle_fields, out.num_recv, out.num_expanded, None)     # the new handles' slots of these sizes
    lean = b._lean_sizes[(num_recv, num_expanded)] = (
        out, patch, tv, fixed, out.byte_at[4], (b.carver, out.meta_shape, out.at[4]),
        None if b.alloc_on_comm else b.carver.allocator(out.alloc_shape, out.alloc_dtype), own_x)
    return lean


def _output_exprs(out: _Outputs, present: tuple, own_x: bool) -> tuple:
    """The (parameter, expression) pairs of a lean patcher's output pointers: carved ones at `g0 + b[k]` (`b`: the
    outputs' byte offsets), recv_x and recv_sf not carved at their own allocations' `xo`, `so`."""
    outs = tuple((n, f'g0 + b[{k}]') for k, (n, here) in enumerate(zip(OUTPUTS, present)) if here)
    if own_x:
        outs += (('recv_x', 'xo'),) + ((('recv_sf', 'so'),) if out.sf_shape is not None else ())
    return outs


def async_event(b, ep, current, x_in, *tensors):
    """The `EventOverlap` of an asynchronous call of the bound dispatch `b` (also `__call__`'s), holding (and recorded
    on) x, its scales and `tensors`."""
    sf = x_in[1] if b.fp8 else None
    xa = x_in[0] if b.fp8 else x_in
    return ep._order.finish(b.kind, current, True, (xa, sf) + tensors)
