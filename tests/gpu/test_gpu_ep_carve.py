"""Decode-sized dispatch outputs carved out of one allocation (features/ep/bound.py) on a GPU, one rank:
for torch and CuPy arrays, BF16 and FP8 (row-major and TMA-aligned column-major scales), CPU sync, no sync, expanded
and cached dispatches, the carved recv_x / recv_sf / top-k outputs and the handle's metadata are bitwise equal to
those of separately allocated outputs (`CARVED_RECV_MAX_BYTES = 0`), share the handle's allocation, and outlive the
handle. Skipped without a GPU."""

import gc

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

M, H, K, E = 128, 1024, 8, 32


def _host(a):
    """A numpy copy of a torch tensor / CuPy array (raw bits of bfloat16 / float8)."""
    import cupy
    if isinstance(a, cupy.ndarray):
        return cupy.asnumpy(cupy.ascontiguousarray(a))
    import torch
    if a.dtype in (torch.bfloat16,):
        a = a.view(torch.int16)
    elif a.dtype == torch.float8_e4m3fn:
        a = a.view(torch.uint8)
    return a.contiguous().cpu().numpy()


def _inputs(kind, fp8):
    import torch
    g = torch.Generator(device='cuda').manual_seed(1)
    x = torch.randn(M, H, device='cuda', generator=g).to(torch.bfloat16)
    scores = torch.rand(M, E, device='cuda', generator=g)
    idx = torch.topk(scores, K, dim=1).indices
    idx[::2, -1] = -1                       # some slots unused (every token still goes somewhere)
    w = torch.rand(M, K, device='cuda', generator=g)
    if fp8:
        x = (x.to(torch.float8_e4m3fn), torch.rand(M, H // 128, device='cuda', generator=g))
    if kind == 'cupy':
        from deepep_cupy.runtime import interop
        conv = interop.to_cupy
        x = tuple(conv(t) for t in x) if fp8 else conv(x)
        idx, w = conv(idx), conv(w)
    return x, idx, w


def _defined_rows(handle, meta, expand):
    """Indices of the output rows every mode defines: the received tokens' rows (no-sync outputs are worst-case
    sized), expanded: the rows the metadata names (the alignment gaps are left out)."""
    num_recv = int(_host(handle.psum_num_recv_tokens_per_scaleup_rank)[-1])
    if not expand:
        return np.arange(num_recv)
    rows = meta[:num_recv, 2:].ravel()
    return np.unique(rows[rows >= 0])


def _same_allocation(a, handle):
    import cupy
    if isinstance(a, cupy.ndarray):
        return a.data.mem is handle.metadata_owner.data.mem
    return a.untyped_storage().data_ptr() == handle.metadata_owner.untyped_storage().data_ptr()


@pytest.mark.parametrize('kind', ['torch', 'cupy'])
@pytest.mark.parametrize('fp8, tma', [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize('mode', ['cpu-sync', 'no-sync', 'expand', 'cached'])
def test_carved_outputs_equal_separate_allocations(kind, fp8, tma, mode):
    pytest.importorskip('torch')
    from deepep_cupy import ElasticBuffer
    from deepep_cupy.features.ep import bound
    x, idx, w = _inputs(kind, fp8)
    kw = dict(num_experts=E, use_tma_aligned_col_major_sf=tma)
    if mode != 'cpu-sync':
        kw['do_cpu_sync'] = False
    expand = mode == 'expand'
    if expand:
        kw.update(do_expand=True, expert_alignment=4, do_zero_padding=True)
    buf = ElasticBuffer(num_max_tokens_per_rank=M, hidden=H, num_topk=K, explicitly_destroy=True)
    limit = bound.CARVED_RECV_MAX_BYTES
    got = {}
    try:
        for carve in (limit, 0):
            bound.CARVED_RECV_MAX_BYTES = carve
            buf._ep._bound.clear()          # bind afresh under this limit
            out = buf.dispatch(x, idx, w, **kw)
            if mode == 'cached':
                out = buf.dispatch(x, handle=out[3], topk_weights=w, use_tma_aligned_col_major_sf=tma)
            handle = out[3]
            meta = _host(handle.recv_src_metadata)
            num_recv = int(_host(handle.psum_num_recv_tokens_per_scaleup_rank)[-1])
            rows = _defined_rows(handle, meta, expand)
            recv_x, recv_sf = out[0] if fp8 else (out[0], None)
            got[carve] = dict(x=_host(recv_x)[rows], topk=None if out[1] is None else _host(out[1])[rows],
                              weights=None if out[2] is None else _host(out[2])[rows],
                              meta=meta[:num_recv], rows=rows, sf=None if recv_sf is None else _host(recv_sf)[rows])
            assert _same_allocation(recv_x, handle) == (carve > 0)
            if recv_sf is not None:
                assert _same_allocation(recv_sf, handle) == (carve > 0)
            if carve:
                kept, copy = recv_x, _host(recv_x)
                del out, handle, recv_x, recv_sf
                gc.collect()
                import torch
                junk = torch.full((1 << 22,), -1, dtype=torch.int32, device='cuda')      # reuse of freed memory
                torch.cuda.synchronize()
                assert np.array_equal(_host(kept), copy), 'a carved recv_x must outlive its handle'
                del kept, junk
    finally:
        bound.CARVED_RECV_MAX_BYTES = limit
        buf.destroy()
    a, b = got[limit], got[0]
    assert np.array_equal(a['rows'], b['rows']) and len(a['rows']) > 0
    for name in ('x', 'sf', 'topk', 'weights', 'meta'):
        if b[name] is None:
            assert a[name] is None, name
        else:
            assert np.array_equal(a[name], b[name]), f'{name}: carved differs from a separate allocation'
