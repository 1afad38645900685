"""`deterministic=True` across scale-up domains: DeepEP's row order after a hybrid dispatch.

DeepEP (`deep_ep/buffers/elastic.py`, `EPHandle.deterministic_sort`, run by `ElasticBuffer.dispatch` when
`self.deterministic`) sorts with ONE `torch.sort` of `recv_src_metadata[:, 0]` (src_token_global_idx; rows past the
received count keyed last): non-expanded, every output row (x, scales, top-k, weights) and, for a non-cached dispatch,
the handle's `recv_src_metadata`; expanded, each expert's rows by (expert, src_token_global_idx), valid rows before
the padding, with `recv_src_metadata[:, 2:]` remapped to the new rows (its rows are not moved there). It rewrites no
count: `psum_num_recv_tokens_per_scaleup_rank`, `psum_num_recv_tokens_per_expert`, `num_recv_tokens_per_expert_list`
stay as the dispatch made them (hybrid: the psum per scale-up index counts every source (*, r), though its groups are
no longer contiguous after the sort).

The composed path's intranode engine gives rows grouped by source scale-up index (the forwarder), inside a group by
source domain, then token. At N x R with R > 1 that differs from DeepEP's order, so a deterministic dispatch moves the
rows after the intranode dispatch (kernels_cu/hybrid.cu `hybrid_sort_*`; the sort is a transposition of runs,
features/hybrid/plan.py `sort_transposition`), and combine moves its input back into the intranode order first. At
R == 1 the orders are one and nothing runs. Our expanded handles' metadata rows are sorted too: DeepEP leaves them in
arrival order, which it does not define, so sorted is one of its orders (and matches the non-expanded handle's).
"""

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ...runtime import interop
from ...runtime.interop import tensor_info
from .kernels import MAX_SORT_RUNS, THREADS

MAX_GRID = 65535            # row kernels are grid-stride


@dataclass
class SortedRows:
    """A deterministic dispatch's permutations (int32 device arrays) and its handle's sorted metadata.

    Attributes:
        row_src, row_dst: `[num_recv rows]`: DeepEP row j holds intranode row `row_src[j]`; intranode row i went to
            `row_dst[i]` (identity past the received count).
        exp_src, exp_dst: the same over the expanded rows (expanded dispatches; None otherwise).
        meta: `[num_recv rows, K + 2]` int32, the handle's `recv_src_metadata` (rows in DeepEP's order, column 0 the
            global source index, columns 2.. the expanded rows after the sort).
        keep: the allocations the launches use (kept until the handle goes).
    """
    row_src: Any
    row_dst: Any
    exp_src: Optional[Any]
    exp_dst: Optional[Any]
    meta: Any
    keep: Tuple[Any, ...]

    @property
    def combine_index(self) -> Any:
        """Where each intranode row of a combine's input is in the caller's (DeepEP-ordered) input."""
        return self.exp_dst if self.exp_dst is not None else self.row_dst


def _empty(like, shape, dtype: str):
    if interop.is_torch(like):
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    import cupy
    return cupy.empty(shape, dtype=dtype)


def _empty_like(a):
    """A new contiguous array of `a`'s shape and dtype (combine's input moved into the intranode order)."""
    if interop.is_torch(a):
        return a.new_empty(a.shape)
    import cupy
    return cupy.empty(a.shape, dtype=a.dtype)


def _ptr(a) -> int:
    return 0 if a is None else (a.data_ptr() if interop.is_torch(a) else a.data.ptr)


def _rows_of(a) -> Tuple[int, int, int, int, int]:
    """`(rows, cols, elem_bytes, row_stride, col_stride)` of a 1-D or 2-D array for `hybrid_sort_rows` (strides in
    elements): 16-byte elements where the columns are contiguous and the rows and the start 16-byte aligned (x, and
    most top-k / weight / scale rows), else the array's own 4- or 8-byte items (column-major scales, 1-D weights)."""
    info = tensor_info(a, 'array')
    item = info.itemsize
    if len(info.shape) == 1:
        (rows,), cols, row_stride, col_stride = info.shape, 1, info.strides[0], 1
    else:
        (rows, cols), (row_stride, col_stride) = info.shape, info.strides
    if col_stride == 1 and cols * item % 16 == 0 and row_stride * item % 16 == 0 and info.ptr % 16 == 0:
        return rows, cols * item // 16, 16, row_stride * item // 16, 1
    assert item in (4, 8), f'no row layout for the sort: shape {info.shape}, strides {info.strides}, item {item}'
    return rows, cols, item, row_stride, col_stride


def _span_bytes(rows: int, cols: int, elem: int, row_stride: int, col_stride: int) -> int:
    return ((rows - 1) * row_stride + (cols - 1) * col_stride + 1) * elem if rows and cols else 0


def _grid(rows: int) -> int:
    return max(1, min(rows, MAX_GRID))


def _threads(cols: int) -> int:
    return min(THREADS, (cols + 31) // 32 * 32)


def _launch_rows(k, src, dst_ptr: int, index, num_index: int, layout, mode: int, stream) -> None:
    rows, cols, elem, row_stride, col_stride = layout
    if rows and cols:
        k.sort_rows.launch(_grid(rows), _threads(cols), stream=stream, src=_ptr(src), dst=dst_ptr, index=_ptr(index),
                           num_index=num_index, num_rows=rows, num_cols=cols, elem_bytes=elem, row_stride=row_stride,
                           col_stride=col_stride, mode=mode)


def sort_dispatch(k, inner, recv_x, recv_sf, recv_topk_idx, recv_topk_weights, num_domains: int,
                  num_scaleup_ranks: int, num_max_tokens: int, stream) -> Tuple[SortedRows, Any]:
    """Move a dispatch's outputs (in place) into DeepEP's deterministic order, on `stream` (after the intranode
    dispatch's writes), and make the handle's sorted metadata.

    Args:
        k: the hybrid kernels; inner: the intranode `EPHandle` of the call (its metadata, psums, alignment).
        recv_x, recv_sf, recv_topk_idx, recv_topk_weights: the intranode dispatch's outputs (None where absent).
        num_domains, num_scaleup_ranks, num_max_tokens: N, R and the call's M.

    Returns:
        `(SortedRows, scratch)`: scratch (as large as the largest output, or None) is only needed until the launches
        on `stream` ran: the caller drops it, or keeps it with an asynchronous call's event.
    """
    N, R, M = num_domains, num_scaleup_ranks, num_max_tokens
    assert N * R <= MAX_SORT_RUNS, f'{N} x {R} ranks exceed the sort kernel\'s {MAX_SORT_RUNS} runs'
    meta = inner.recv_src_metadata
    rows, K = int(meta.shape[0]), int(meta.shape[1]) - 2
    expanded = bool(inner.do_expand)
    exp_rows = int(recv_x.shape[0]) if expanded else 0
    psum_src = inner.psum_num_recv_tokens_per_scaleup_rank
    num_recv = _ptr(psum_src) + 4 * (int(psum_src.shape[0]) - 1)     # the received rows (on the GPU)
    words = _empty(meta, (2 * rows + 3 * exp_rows,), 'int32')
    row_src, row_dst = words[:rows], words[rows:2 * rows]
    plan = dict(num_domains=N, num_scaleup_ranks=R, num_max_tokens=M)
    if rows:
        k.sort_plan.launch(1, THREADS, stream=stream, keys=_ptr(meta), key_stride=K + 2, group_end=num_recv,
                           num_groups=1, alignment=1, num_rows=rows, row_src=_ptr(row_src), row_dst=_ptr(row_dst),
                           **plan)
    exp_src = exp_dst = None
    if expanded:
        exp_keys = words[2 * rows:2 * rows + exp_rows]
        exp_src, exp_dst = words[2 * rows + exp_rows:2 * rows + 2 * exp_rows], words[2 * rows + 2 * exp_rows:]
        psum_expert = inner.psum_num_recv_tokens_per_expert
        num_local_experts = int(psum_expert.shape[0])
        if rows and exp_rows:
            k.sort_keys.launch(_grid((rows * K + THREADS - 1) // THREADS), THREADS, stream=stream, meta=_ptr(meta),
                               num_topk=K, num_meta_rows=rows, num_recv=num_recv, keys=_ptr(exp_keys),
                               num_rows=exp_rows)
        if exp_rows:
            k.sort_plan.launch(num_local_experts, THREADS, stream=stream, keys=_ptr(exp_keys), key_stride=1,
                               group_end=_ptr(psum_expert), num_groups=num_local_experts,
                               alignment=int(inner.expert_alignment), num_rows=exp_rows, row_src=_ptr(exp_src),
                               row_dst=_ptr(exp_dst), **plan)
    sorted_meta = _empty(meta, (rows, K + 2), 'int32')
    if rows:
        k.sort_meta.launch(_grid((rows * (K + 2) + THREADS - 1) // THREADS), THREADS, stream=stream, meta=_ptr(meta),
                           out=_ptr(sorted_meta), row_src=_ptr(row_src), num_index=rows, num_rows=rows, num_topk=K,
                           exp_dst=_ptr(exp_dst) if exp_rows else 0, num_exp_rows=exp_rows, **plan)
    # The outputs, each in place: moving rows to a scratch copy (mode 2), then back through the permutation (mode 1).
    index, num_index = (exp_src, exp_rows) if expanded else (row_src, rows)
    arrays = [a for a in (recv_x, recv_sf, recv_topk_idx, recv_topk_weights) if a is not None]
    layouts = [_rows_of(a) for a in arrays]
    scratch = None
    span = max((_span_bytes(*lay) for lay in layouts), default=0)
    if span:
        scratch = _empty(meta, ((span + 15) // 16 * 4,), 'int32')
        for a, lay in zip(arrays, layouts):
            _launch_rows(k, a, _ptr(scratch), index, num_index, lay, 2, stream)
            _launch_rows(k, scratch, _ptr(a), index, num_index, lay, 1, stream)
    order = SortedRows(row_src=row_src, row_dst=row_dst, exp_src=exp_src, exp_dst=exp_dst, meta=sorted_meta,
                       keep=(words,))
    return order, scratch


def unsort_combine(k, order: SortedRows, x, topk_weights, stream) -> Tuple[Any, Any]:
    """A combine's input (rows in DeepEP's order) as new arrays in the intranode order: row i = the caller's row
    `order.combine_index[i]`. Returns `(x, topk_weights)` (None stays None)."""
    index = order.combine_index
    num_index = int(index.shape[0])
    out = []
    for a in (x, topk_weights):
        if a is None:
            out.append(None)
            continue
        b = _empty_like(a)      # (contiguous, as `a`: checks.check_sorted_combine_args)
        _launch_rows(k, a, _ptr(b), index, num_index, _rows_of(a), 0, stream)
        out.append(b)
    return out[0], out[1]
