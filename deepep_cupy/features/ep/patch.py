"""Parts of the bound dispatch (bound.py): the generated patchers of a launch's argument words and the output
layout of one (num_recv, num_expanded)."""

from typing import NamedTuple, Optional, Tuple

from ...runtime import interop


def patcher(bound, names):
    """`patch(view, values)` storing `values[k]` (the pointer of `names[k]`) at the word of each of `names` that
    `bound`'s kernel takes: straight-line code generated once (a loop over pairs costs three times as much)."""
    taken = set(bound.spec.param_names)
    body = ''.join(f'    u[{bound.index(n)}] = v[{k}]\n' for k, n in enumerate(names) if n in taken) or '    pass\n'
    namespace = {}
    exec(compile(f'def patch(u, v):\n{body}', f'<patch of {bound.spec.name}>', 'exec'), namespace)
    return namespace['patch']


def address_patcher(bound, exprs, what: str):
    """`patch(u, xp, sp, tp, wp, cp, ws)` storing, for each (parameter name, expression) of `exprs` that `bound`'s
    kernel takes, the expression's value at its word of `u`: the expressions are of the call's pointers (x, sf,
    top-k ids, weights, stats) and the workspace's address `ws`, with the workspace offsets written in as constants
    (straight-line code generated once: no tuple of addresses built per call)."""
    taken = set(bound.spec.param_names)
    body = ''.join(f'    u[{bound.index(n)}] = {e}\n' for n, e in exprs if n in taken) or '    pass\n'
    namespace = {}
    exec(compile(f'def patch(u, xp, sp, tp, wp, cp, ws):\n{body}', f'<{what} patch of {bound.spec.name}>', 'exec'),
         namespace)
    return namespace['patch']


def strides(shape) -> Optional[Tuple[int, ...]]:
    return None if shape is None else interop.contiguous_strides(tuple(shape))


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
    # From the start of the allocation (the outputs begin at the bound dispatch's `_out_base` word in it): the torch
    # storage offsets (elements of the view's dtype) of recv_topk_idx, recv_topk_weights, recv_x, recv_sf (-1: none /
    # not carved) and recv_src_metadata (int32), and the byte offsets of `bound._OUTPUTS` (-1: none / not carved).
    at: Tuple[int, int, int, int, int]
    byte_at: Tuple[int, int, int, int, int, int]
