"""Parts of the bound dispatch (bound.py): the generated patchers of a launch's argument words, the output layout of
one (num_recv, num_expanded), the words patched by index, and the per-call helpers of rarer paths (the general call's
cached and CPU-sync steps among them)."""

from typing import Any, NamedTuple, Optional, Tuple

from ...runtime import interop
from ...runtime.sizes import align
from .kernels import HOST_MAX_TOKENS_WORD

CARVE_ALIGN_WORDS = 64      # recv_x / recv_sf start at 256-byte boundaries of their allocation (16 B rows, TMA)


def patcher(bound, names):
    """`patch(view, values)` storing `values[k]` (the pointer of `names[k]`) at the word of each of `names` that
    `bound`'s kernel takes: straight-line code generated once (a loop over pairs costs three times as much)."""
    taken = set(bound.spec.param_names)
    body = ''.join(f'    u[{bound.index(n)}] = v[{k}]\n' for k, n in enumerate(names) if n in taken) or '    pass\n'
    namespace = {}
    exec(compile(f'def patch(u, v):\n{body}', f'<patch of {bound.spec.name}>', 'exec'), namespace)
    return namespace['patch']


def _stores(bound, exprs, view: str = 'u') -> list:
    """The generated patchers' lines: `view[word] = expression` for each (parameter name, expression) of `exprs` that
    `bound`'s kernel takes ('ws + 0' stored as `ws`)."""
    taken = set(bound.spec.param_names)
    return [f'    {view}[{bound.index(n)}] = {e[:-4] if e.endswith(" + 0") else e}\n' for n, e in exprs if n in taken]


def address_patcher(bound, exprs, what: str):
    """`patch(u, xp, sp, tp, wp, cp, ws)` storing, for each (parameter name, expression) of `exprs` that `bound`'s
    kernel takes, the expression's value at its word of `u`: the expressions are of the call's pointers (x, sf,
    top-k ids, weights, stats) and the workspace's address `ws`, with the workspace offsets written in as constants
    (straight-line code generated once: no tuple of addresses built per call)."""
    body = ''.join(_stores(bound, exprs)) or '    pass\n'
    namespace = {}
    exec(compile(f'def patch(u, xp, sp, tp, wp, cp, ws):\n{body}', f'<{what} patch of {bound.spec.name}>', 'exec'),
         namespace)
    return namespace['patch']


def call_patcher(blocks, what: str, extra: Tuple[str, ...] = ()):
    """`patch(xp, sp, tp, wp, cp, ws, *extra)` storing, for each `(bound, exprs)` of `blocks` and each (parameter name,
    expression) of `exprs` that the bound launch's kernel takes, the expression's value at its word: every pointer of a
    call's launches in one straight-line function (a call whose pointers are all the inputs' or the workspace's plus
    constants: a no-sync dispatch with its outputs carved out of its workspace's allocation; `extra`: further
    addresses the expressions may name, e.g. recv_x's own allocation's). The blocks' views are default arguments (fast
    locals)."""
    namespace, body, views = {}, [], []
    for k, (bound, exprs) in enumerate(blocks):
        namespace[f'v{k}'] = bound.u64
        views.append(f'u{k}=v{k}')
        body += _stores(bound, exprs, f'u{k}')
    params = ', '.join(('xp', 'sp', 'tp', 'wp', 'cp', 'ws') + tuple(extra) + tuple(views))
    exec(compile(f'def patch({params}):\n{"".join(body) or "    pass"}\n',
                 f'<{what} patch>', 'exec'), namespace)
    return namespace['patch']


def cached_patcher(bound, exprs):
    """`patch(xp, sp, tp, wp, cp, ws, g0, b, xo=0, so=0)` storing, for each (parameter name, expression) of `exprs`
    that `bound`'s kernel takes, the expression's value at its word: a lean dispatch's pointers, of the call's inputs,
    the workspace `ws`, the outputs' allocation `g0` (`b`: the outputs' byte offsets, `Outputs.byte_at`) and recv_x's
    and recv_sf's own allocations `xo`, `so` (where they are not carved)."""
    namespace = {'v': bound.u64}
    body = ''.join(_stores(bound, exprs)) or '    pass\n'
    exec(compile(f'def patch(xp, sp, tp, wp, cp, ws, g0, b, xo=0, so=0, u=v):\n{body}',
                 f'<cached patch of {bound.spec.name}>', 'exec'), namespace)
    return namespace['patch']


def strides(shape) -> Optional[Tuple[int, ...]]:
    return None if shape is None else interop.contiguous_strides(tuple(shape))


class OutputOffsets(NamedTuple):
    """The torch storage offsets, from the start of the outputs' allocation, of the outputs carved out of it (elements
    of each view's dtype; -1: none / not carved), in this order (`cupy_views` unpacks them)."""
    topk_idx: int           # int64
    topk_weights: int       # float32
    x: int                  # recv_x's dtype
    sf: int                 # recv_sf's dtype
    meta: int               # int32: recv_src_metadata (always carved)


class OutputBytes(NamedTuple):
    """The byte offsets, from the start of the outputs' allocation, of each of `lean.OUTPUTS` (the receive launch's
    output pointers, in its order: the generated patchers read them by index; -1: none / not carved)."""
    x: int
    sf: int
    topk_idx: int
    topk_weights: int
    meta: int
    src_idx: int            # V1's recv_src_idx


class OutputViews(NamedTuple):
    """The `as_strided` arguments of a torch call's views of the outputs' allocation: each (shape, strides, offset in
    its dtype's elements), None where the layout carves none (recv_x and recv_sf too large to carve: allocations of
    their own)."""
    x: Optional[tuple]
    sf: Optional[tuple]
    topk_idx: Optional[tuple]
    topk_weights: Optional[tuple]


class Outputs(NamedTuple):
    """Where a dispatch's outputs go for one (num_recv, num_expanded)."""
    num_recv: int
    num_expanded: int
    num_out_rows: int
    words: int                  # int32 words of the small outputs' allocation
    meta_offset: int            # word offsets in it
    src_idx_offset: int         # V1's recv_src_idx [num_recv] (-1: not a V1 dispatch)
    topk_offset: int
    weights_offset: int
    x_shape: Tuple[int, int]
    sf_shape: Optional[Tuple[int, int]]
    sf_strides: Tuple[int, int]
    topk_shape: Optional[Tuple[int, int]]
    weights_shape: Optional[Tuple[int, ...]]
    meta_shape: Tuple[int, int]
    grid: int
    topk_strides: Optional[Tuple[int, int]]         # C-contiguous strides of recv_topk_idx / recv_topk_weights
    weights_strides: Optional[Tuple[int, ...]]
    x_offset: int               # word offset of recv_x in the small outputs' allocation (-1: an allocation of its own)
    sf_offset: int              # of recv_sf's storage (-1: an allocation of its own, or no recv_sf)
    x_strides: Tuple[int, int]  # C-contiguous strides of recv_x
    sf_view_shape: Optional[Tuple[int, int]]        # recv_sf's shape (rows, num_sf), strides `sf_strides`
    alloc_shape: Tuple[int]     # of the small outputs' allocation when it is theirs alone (CPU sync, cached)
    alloc_dtype: str            # of that allocation (and of the workspace's without a CPU sync): recv_x's when it is
    #                             carved (recv_x is then a plain as_strided view of it), else int32
    # From the start of the allocation (the outputs begin at the bound dispatch's `_out_base` word in it): the torch
    # storage offsets of the carved outputs, the byte offsets of the receive's output pointers, a torch call's views.
    at: OutputOffsets
    byte_at: OutputBytes
    views: OutputViews


def output_layout(p, o, v1: bool, base: int, x_dtype: str, carve_max_bytes: int) -> Outputs:
    """Where the outputs of the checked dispatch `p` (a plan without arrays) with the sizes `o`
    (`plan.dispatch_outputs`) go in their int32 allocation, from its word `base`: recv_src_metadata, V1's recv_src_idx
    (`v1`), recv_topk_idx (even word), recv_topk_weights, then recv_x and recv_sf's storage when together they are at
    most `carve_max_bytes`, each at a 256-byte boundary of the allocation (then of recv_x's dtype `x_dtype`)."""
    x_per_word = 4 // interop.itemsize(x_dtype)
    rows = o.num_out_rows
    offset = meta = 0
    offset += o.num_recv * (p.num_topk + 2)
    src_idx = offset if v1 else -1
    if src_idx >= 0:
        offset += o.num_recv
    topk = offset = align(offset, 2)
    has_topk, has_weights = o.topk_idx_shape is not None, o.topk_weights_shape is not None
    if has_topk:
        offset += 2 * o.topk_idx_shape[0] * o.topk_idx_shape[1]
    weights = offset
    if has_weights:
        n = 1
        for d in o.topk_weights_shape:
            n *= d
        offset += n
    x_words = rows * p.hidden_bytes // 4        # (hidden_bytes: a multiple of 16)
    sf_words = 0 if o.sf_shape is None else o.sf_shape[0] * o.sf_shape[1]
    x_at = sf_at = -1
    if 4 * (x_words + sf_words) <= carve_max_bytes:
        x_at = align(base + offset, CARVE_ALIGN_WORDS) - base
        offset = x_at + x_words
        if o.sf_shape is not None:      # (also with no rows: an FP8 dispatch always returns its scales)
            sf_at = align(base + offset, CARVE_ALIGN_WORDS) - base
            offset = sf_at + sf_words
    # An even number of words: int64 views of the allocation need one (torch views the whole allocation).
    offset = align(offset, 2)
    b = base
    at = OutputOffsets((b + topk) >> 1 if has_topk else -1, b + weights if has_weights else -1,
                       (b + x_at) * x_per_word if x_at >= 0 else -1, b + sf_at if sf_at >= 0 else -1, b + meta)
    byte_at = OutputBytes._make(4 * (b + w) if w >= 0 else -1 for w in (
        x_at, sf_at, topk if has_topk else -1, weights if has_weights else -1, meta, src_idx))
    topk_strides, weights_strides = strides(o.topk_idx_shape), strides(o.topk_weights_shape)
    x_shape, x_strides = (rows, p.hidden), (p.hidden, 1)
    sf_view_shape = None if o.sf_shape is None else (rows, p.num_sf)
    views = OutputViews((x_shape, x_strides, at.x) if at.x >= 0 else None,
                        (sf_view_shape, o.sf_strides, at.sf) if at.sf >= 0 else None,
                        (o.topk_idx_shape, topk_strides, at.topk_idx) if at.topk_idx >= 0 else None,
                        (o.topk_weights_shape, weights_strides, at.topk_weights) if at.topk_weights >= 0 else None)
    return Outputs(
        num_recv=o.num_recv, num_expanded=o.num_expanded, num_out_rows=rows, words=offset, meta_offset=meta,
        src_idx_offset=src_idx, topk_offset=topk, weights_offset=weights, x_shape=x_shape, sf_shape=o.sf_shape,
        sf_strides=o.sf_strides, topk_shape=o.topk_idx_shape, weights_shape=o.topk_weights_shape,
        meta_shape=o.metadata_shape, grid=o.epilogue_blocks, topk_strides=topk_strides,
        weights_strides=weights_strides, x_offset=x_at, sf_offset=sf_at, x_strides=x_strides,
        sf_view_shape=sf_view_shape, alloc_shape=(max(2, offset) * (x_per_word if x_at >= 0 else 1),),
        alloc_dtype=x_dtype if x_at >= 0 else 'int32', at=at, byte_at=byte_at, views=views)


class TorchDtypes(NamedTuple):
    """A torch binding's dtypes of the views of the outputs' allocation, resolved once."""
    int64: Any              # recv_topk_idx
    float32: Any            # recv_topk_weights
    sf: Any                 # recv_sf (int32 without FP8: unused)


class ReceiveIndex(NamedTuple):
    """The receive launch's words that an output layout sets (`BoundDispatch._size_recv`; its kernel's parameter
    names)."""
    num_out_rows: int       # i32
    num_meta_rows: int      # i32
    recv_sf_stride_row: int     # i64
    recv_sf_stride_col: int     # i64


class NotifyV1Index(NamedTuple):
    """The notify launch's words of DeepEP V1's pointers (its kernel's parameter names)."""
    expert_counts: int
    rank_prefix_matrix: int
    channel_prefix_matrix: int
    recv_channel_prefix_matrix: int


class GuardIndex(NamedTuple):
    """The words of a dispatch launch's readiness guard arguments (`ep_dispatch.cu`)."""
    ready: int          # u64: the counter's address
    ready_mod: int      # i32: rows modulo


def patch_guard(launch, idx: GuardIndex, guard) -> None:
    """The readiness guard's arguments of a dispatch launch (`ep_dispatch.cu`; guard None: off)."""
    launch.u64[idx.ready] = guard[0] if guard is not None else 0
    launch.i32[idx.ready_mod] = guard[1] if guard is not None else 0


def psum_expert_from_layout(recv_layout, R: int, L: int, alignment: int, do_expand: bool, kind: str, stream):
    """psum_num_recv_tokens_per_expert from the layout blob (for a cached dispatch in the other mode)."""
    counts = recv_layout[R:R + L]
    if kind == 'torch':
        import torch
        with torch.cuda.stream(interop.torch_stream(stream.ptr)):
            aligned = (counts + alignment - 1) // alignment * alignment
            return (recv_layout[R + L:R + 2 * L] + counts) if do_expand else torch.cumsum(aligned, 0).to(torch.int32)
    import cupy
    import numpy as np
    with stream:
        aligned = (counts + alignment - 1) // alignment * alignment
        return (recv_layout[R + L:R + 2 * L] + counts) if do_expand else cupy.cumsum(aligned).astype(np.int32)


def cupy_views(carver, group, out: Outputs, x_dtype: str, sf_dtype: Optional[str]):
    """(recv_topk_idx, recv_topk_weights, recv_x, recv_sf) of a CuPy call: views of `group` where `out` has them
    (else None; `out.at` holds their offsets from the start of `group`)."""
    topk_at, weights_at, x_at, sf_at, _ = out.at
    return (None if topk_at < 0 else carver.view(group, 'int64', out.topk_shape, topk_at * 2),
            None if weights_at < 0 else carver.view(group, 'float32', out.weights_shape, weights_at),
            None if x_at < 0 else carver.view(group, x_dtype, out.x_shape, out.byte_at[0] >> 2),
            None if sf_at < 0 else carver.view(group, sf_dtype, out.sf_view_shape, sf_at, out.sf_strides))


def allocate_x(carver, out: Outputs, x_dtype: str, sf_dtype: Optional[str], col_major_sf: bool, stream):
    """`((recv_x, recv_sf), (their addresses))` in allocations of their own (`stream`: the allocations' or None)."""
    recv_x = carver.empty(out.x_shape, x_dtype, stream)
    recv_sf, sfo = None, 0
    if out.sf_shape is not None:
        storage = carver.empty(out.sf_shape, sf_dtype, stream)
        sfo = carver.ptr(storage)
        if col_major_sf:
            rows = out.num_out_rows
            recv_sf = storage.t()[:rows] if carver.kind == 'torch' else storage.T[:rows]
        else:
            recv_sf = storage
    return (recv_x, recv_sf), (carver.ptr(recv_x), sfo)


def from_handle(b, h, comm) -> tuple:
    """What a cached call of the bound dispatch `b` takes from its handle `h` (`BoundDispatch.__call__`): `(workspace,
    its address, the user's top-k ids or None, the top-k ids' address, psum_num_recv_tokens_per_expert or None, the
    output layout, the counts)`; the sizes are `plan.dispatch_counts` inline (worst case for an expanded output the
    handle was not made for), the psum is recomputed (on `comm`) for a handle of the other mode."""
    ws, ws_ptr, user_topk = h.workspace, h.workspace_ptr, h._topk_idx
    # (`h.topk_idx_ptr` inline: the handle's origin, and so its workspace offsets, are this call's key's)
    tp = ws_ptr + b.topk_copy_bytes if user_topk is None else h.topk_idx_ptr
    psum_expert = h._psum_expert
    if b.do_expand != h.do_expand:
        psum_expert = psum_expert_from_layout(h.recv_layout, h.num_ranks, b.num_local_experts, h.expert_alignment,
                                              b.do_expand, b.kind, comm)
    num_recv, num_expanded, counts = h.num_recv_tokens, h.num_expanded_tokens, h._counts
    if b.do_expand and not h.do_expand and not h.do_cpu_sync:
        num_expanded = b.worst_expanded
    if type(counts) is list:    # (the handle's list, which its caller may hold: copied now)
        counts = list(counts)
    # else the numpy counts of a CPU-sync dispatch, written by nobody: shared, each handle makes its own list on
    # first access (EPHandle.num_recv_tokens_per_expert_list)
    return ws, ws_ptr, user_topk, tp, psum_expert, b.outputs(num_recv, num_expanded), counts


def wait_counts(b, ep, comm, legacy) -> tuple:
    """The notify and send launches of a CPU-sync call of the bound dispatch `b` (`BoundDispatch.__call__`), then the
    host's wait for the counts (V1: and the largest reported token count); returns `(the output layout of the counts,
    the aligned counts per local expert)`, the latter a view of the host-mapped words (`EP._wait_host_counts`)."""
    n = b.notify
    seq = ep._next_host_seq()
    n.i32[b.notify_seq] = seq
    if not b.fused:    # (never with a CPU sync: features/ep/fused.py)
        n(comm)
    if b.send is not None:
        b.send(comm)
    num_recv, num_expanded, counts = ep._wait_host_counts(seq, b.num_local_experts)
    if legacy is not None:
        legacy.max_num_tokens = int(ep.host_counts[HOST_MAX_TOKENS_WORD])
    return b.outputs(num_recv, num_expanded), counts


def check_guard(bound, guard) -> None:
    """Hybrid P2's readiness guard fits the bound dispatch `bound` (checked before any launch)."""
    if bound.fused:
        raise ValueError('the hybrid pipeline\'s readiness guard needs the default dispatch kernel (not '
                         'DEEPEP_CUPY_EP_FUSED_NOTIFY)')
    if bound.recv_extra + guard[2] >= bound.num_device_sms:
        raise ValueError(f'the hybrid pipeline leaves {guard[2]} SMs free beside {bound.recv_extra} sending '
                         f'blocks: more than the GPU has ({bound.num_device_sms}); lower num_sms')
