"""The lean dispatch paths (`BoundDispatch.run`: features/ep/lean.py's `run_cached`, `run_no_sync`,
`run_cpu_sync`) on a GPU, one rank: for torch and CuPy arrays, BF16 and FP8, no-sync and CPU-sync dispatches (recv_x
carved or, too large, not) and cached ones (handles from no-sync, CPU-sync and expanded dispatches), the outputs, the
new handle's metadata and layout, and the combine of its rows are bitwise equal to those of the general `__call__` on
the same inputs; CPU-sync dispatches also when their sizes change between calls (the lean path speculates that they
repeat). Skipped without a GPU."""

import numpy as np
import pytest
from test_gpu_ep_carve import E, H, K, M, _defined_rows, _host, _inputs, _same_allocation

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize('kind', ['torch', 'cupy'])
@pytest.mark.parametrize('fp8', [False, True])
@pytest.mark.parametrize('mode', ['no-sync', 'no-sync large', 'no-sync large tma', 'cached', 'cached from cpu-sync',
                                  'cached expanded', 'cached no handle copy', 'cached large', 'cpu-sync',
                                  'cpu-sync large', 'cpu-sync large tma', 'cpu-sync sizes change',
                                  'cpu-sync large sizes change'])
def test_lean_paths_equal_the_general_call(monkeypatch, kind, fp8, mode):
    """'large': worst-case outputs too large to carve (`CARVED_RECV_MAX_BYTES` 0, as for perf/ep_profile.py's
    4096-token buffer at hidden 7168): lean.py's `run_no_sync` through `call_patch_x`, `run_cached` and `run_cpu_sync`
    through `prepare_receive`, recv_x / recv_sf allocations of their own; 'tma': with TMA-aligned column-major scales
    (FP8 only); 'sizes change': CPU-sync calls whose counts differ from the last call's (the first tokens' top-k ids
    masked to -1: fewer tokens; some slots: fewer (token, expert) pairs) and repeat (the speculated outputs of
    `run_cpu_sync` missed, hit after a miss, missed back), each equal to the general call's."""
    pytest.importorskip('torch')
    from deepep_cupy import ElasticBuffer
    from deepep_cupy.features.ep import bound, lean
    from deepep_cupy.features.ep.bound import BoundDispatch
    large, tma = 'large' in mode, mode.endswith('tma')
    if tma and not fp8:
        pytest.skip('TMA-aligned scales are FP8 only')
    if large:
        monkeypatch.setattr(bound, 'CARVED_RECV_MAX_BYTES', 0)
    x, idx, w = _inputs(kind, fp8)
    expand = mode == 'cached expanded'
    first_kw = dict(num_experts=E, do_cpu_sync=mode == 'cached from cpu-sync',
                    do_handle_copy=mode != 'cached no handle copy')
    if expand:
        first_kw.update(do_expand=True, expert_alignment=4)
    if tma:
        first_kw['use_tma_aligned_col_major_sf'] = True
    buf = ElasticBuffer(num_max_tokens_per_rank=M, hidden=H, num_topk=K, explicitly_destroy=True)
    cached = mode.startswith('cached')
    sync = mode.startswith('cpu-sync')
    lean_run = lean.run_cached if cached else lean.run_cpu_sync if sync else lean.run_no_sync
    if 'sizes change' in mode:
        fewer, slots = idx.copy() if kind == 'cupy' else idx.clone(), idx.copy() if kind == 'cupy' else idx.clone()
        fewer[:5] = -1
        slots[1:15:2, 0] = -1
        calls = (fewer, fewer, idx, slots, slots, idx)
    else:
        calls = (idx,)
    try:
        first = buf.dispatch(x, idx, w, **first_kw)

        def call(ids):
            if cached:
                return buf.dispatch(x, handle=first[3], do_expand=expand)
            return buf.dispatch(x, ids, w, num_experts=E, do_cpu_sync=sync, use_tma_aligned_col_major_sf=tma)
        call(idx)       # binds (a cached call learns its sizes)
        got = []
        for is_lean in (True, False):
            b = [v for v in buf._ep._bound.values() if getattr(v, 'run', None) is lean_run]     # (BoundCombines too)
            assert len(b) == 1, 'the call must be bound to its lean path'
            assert lean_run is not lean.run_no_sync or (b[0].call_patch_x is not None) == large, \
                'carved outputs, or not, as the mode says'
            if not is_lean:
                b[0].run = BoundDispatch.__call__
            got.append([])
            for ids in calls:
                out = call(ids)
                handle = out[3]
                meta = _host(handle.recv_src_metadata)
                rows = _defined_rows(handle, meta, expand)
                recv_x, recv_sf = out[0] if fp8 else (out[0], None)
                if large:       # (recv_x is not carved out of the handle's allocation)
                    assert not _same_allocation(recv_x, handle)
                num_recv = int(_host(handle.psum_num_recv_tokens_per_scaleup_rank)[-1])
                combined = None
                if not fp8:
                    combined = _host(buf.combine(recv_x, handle)[0])
                got[-1].append(dict(
                    x=_host(recv_x)[rows], sf=None if recv_sf is None else _host(recv_sf)[rows],
                    topk=None if out[1] is None else _host(out[1])[rows],
                    weights=None if out[2] is None else _host(out[2])[rows], meta=meta[:num_recv],
                    layout=_host(handle.recv_layout), psum=_host(handle.psum_num_recv_tokens_per_expert),
                    counts=list(handle.num_recv_tokens_per_expert_list), combined=combined,
                    sizes=(handle.num_recv_tokens, handle.num_expanded_tokens), rows=rows,
                    shapes=[None if t is None else tuple(t.shape) for t in (recv_x, recv_sf, out[1], out[2])]))
            if is_lean and sync:
                # (the next call speculates on the last one's sizes once two calls in a row had them; outputs not
                # carved: never; one call: the binding call before it had the same inputs)
                last = got[-1][-1]['sizes']
                before = got[-1][-2]['sizes'] if len(calls) > 1 else last
                spec = b[0]._lean_spec
                assert (spec is None) if large or before != last else spec[:2] == last
            b[0].run = lean_run
    finally:
        buf.destroy()
    if len(calls) > 1:      # (the masked calls' counts differ: each call after a change missed the speculation)
        sizes = [r['sizes'] for r in got[0]]
        assert sizes[0] == sizes[1] and sizes[3] == sizes[4] and sizes[2] == sizes[5], sizes
        assert sizes[0][0] < sizes[2][0] and sizes[3][0] == sizes[2][0] and sizes[3][1] < sizes[2][1], sizes
    for a, g in zip(*got):
        _assert_equal(a, g)


def _assert_equal(a, g):
    assert len(a['rows']) > 0
    for name in a:
        if g[name] is None:
            assert a[name] is None, name
        elif isinstance(g[name], np.ndarray):
            assert np.array_equal(a[name], g[name]), f'{name}: the lean path differs from __call__'
        else:
            assert a[name] == g[name], name
