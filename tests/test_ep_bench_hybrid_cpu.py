"""perf/ep_bench_hybrid.py's pure parts on the CPU: DeepEP's SO / SU byte accounting against brute-force counts from
refs' routing, the row text, the skip reasons and the per-stage timeline of a chrome trace."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from deepep_cupy.utils import bench_bytes

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(f'perf_{name}', ROOT / 'perf' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hb = _load('ep_bench_hybrid')


def _routing(torch, N, R, E, T, K, seed, holes=True):
    g = torch.Generator().manual_seed(seed)
    W = N * R
    topks = []
    for _ in range(W):
        scores = torch.rand(T, E, generator=g)
        idx = torch.topk(scores, K, dim=-1).indices
        if holes:
            idx[torch.rand(T, K, generator=g) < 0.2] = -1
        topks.append(idx)
    return topks


def _brute(torch, topks, rank, E, N, R, M, ignore_local):
    """DeepEP's test_ep definitions, written out token by token; SU from refs' receive rows."""
    from deepep_cupy.utils import refs

    W = N * R
    own = rank // R
    idx = topks[rank].tolist()
    dispatch_so = 0
    if N > 1:
        for i in range(N):
            if ignore_local and i == own:
                continue
            dispatch_so += sum(any(e >= 0 and e // (E // N) == i for e in row) for row in idx)
    combine_so = 0
    for row in idx:
        ranks = {e // (E // W) for e in row if e >= 0}
        if ignore_local:
            ranks = {d for d in ranks if not own * R <= d < (own + 1) * R}
        combine_so += len(ranks)
    if N == 1 and not ignore_local:
        combine_so = 0
    xs = [torch.zeros(t.shape[0], 4, dtype=torch.bfloat16) for t in topks]
    ref = refs.dispatch_from_gathered(xs, None, topks, None, rank, M, E)
    src = ref.recv_src_token_global_idx.long()
    su = int(src.numel())
    if ignore_local:
        su -= int((src // M % R == rank % R).sum())
    rail = sum(len({e // (E // N) for e in row if e >= 0} - {own}) for row in idx)
    return {'dispatch_so': dispatch_so, 'combine_so': combine_so, 'su': su, 'rail': rail}


@pytest.mark.parametrize('N,R', [(2, 1), (2, 2), (4, 2), (1, 4), (3, 1)])
@pytest.mark.parametrize('ignore_local', [False, True])
def test_token_counts_match_brute_force(N, R, ignore_local):
    torch = pytest.importorskip('torch')      # the brute force counts from refs' torch receive rows
    E, T, K, M = 24 * N * R, 37, 6, 40
    topks = _routing(torch, N, R, E, T, K, seed=N * 10 + R)
    rows = [bench_bytes.tokens_per_rank(t, E, N * R) for t in topks]
    for rank in range(N * R):
        got = hb.hybrid_tokens(topks[rank], rows, rank, E, N, R, ignore_local)
        assert got == _brute(torch, topks, rank, E, N, R, M, ignore_local), (rank, got)


def test_counts_of_a_hand_routing():
    # 2 domains x 1 rank, 4 experts (2 per rank). Token 0 -> experts 0, 1 (own domain only); token 1 -> 0, 2 (both);
    # token 2 -> 3 only (the other domain); token 3 -> nothing.
    topk = np.array([[0, 1], [0, 2], [3, -1], [-1, -1]])
    rows = [bench_bytes.tokens_per_rank(topk, 4, 2), [1, 1]]
    got = hb.hybrid_tokens(topk, rows, 0, 4, 2, 1)
    assert got == {'dispatch_so': 4, 'combine_so': 4, 'su': 2 + 1, 'rail': 2}
    local = hb.hybrid_tokens(topk, rows, 0, 4, 2, 1, ignore_local=True)
    # R = 1: every source has this rank's scale-up index, so DeepEP's --ignore-local-traffic SU counts nothing
    assert local == {'dispatch_so': 2, 'combine_so': 2, 'su': 0, 'rail': 2}
    with pytest.raises(ValueError):
        hb.hybrid_tokens(topk, rows, 0, 5, 2, 1)


def test_bytes_and_rates():
    tokens = {'dispatch_so': 10, 'combine_so': 7, 'su': 20, 'rail': 4}
    nb = hb.hybrid_bytes(tokens, hidden=128, itemsize=1, num_sf=1, num_topk=8)
    d = 128 + 4 + 12 * 8
    c = 2 * 128 + 4 * 8
    assert d == bench_bytes.dispatch_bytes_per_token(128, 1, 1, 8)
    assert nb == {'dispatch': {'so': 10 * d, 'su': 20 * d, 'rail': 4 * d},
                  'combine': {'so': 7 * c, 'su': 20 * c, 'rail': 4 * c}}
    row = hb.add_rates({'us': 2.0}, {'so': 4000.0, 'su': 8000.0, 'rail': 0.0})
    assert row['so_gbs'] == pytest.approx(2.0) and row['su_gbs'] == pytest.approx(4.0) and row['rail_gbs'] == 0.0
    assert hb.add_rates({'error': 'x'}, nb['dispatch'])['so_gbs'] is None


def test_row_text_lines_up_with_the_header():
    row = hb.add_rates({'num_tokens': 4096, 'dtype': 'fp8', 'path': 'hybrid', 'op': 'dispatch_nosync',
                        'host_us': 35.25, 'us': 120.0}, {'so': 1.2e6, 'su': 2.4e6, 'rail': 6e5})
    text = hb.row_text(row)
    assert text.split('|')[0].split() == ['4096', 'fp8', 'hybrid', 'dispatch_nosync']
    assert [p.strip() for p in text.split('|')[1:]] == ['35.2    120.0', '10.0    20.0       5.0']
    assert [i for i, ch in enumerate(text) if ch == '|'] == [i for i, ch in enumerate(hb.HEADER) if ch == '|']
    missing = hb.row_text({'num_tokens': 128, 'dtype': 'bf16', 'path': 'refs', 'op': 'combine', 'error': 'boom'})
    assert missing.count(' - ') >= 3 and missing.endswith('error: boom')


def test_skip_reasons():
    assert hb.refs_skip_reason([('h', 'a'), ('h', 'b')]) is None
    shared = hb.refs_skip_reason([('h', 'a'), ('h', 'b'), ('h', 'a')])
    assert 'ranks 0 and 2' in shared and 'NCCL refuses' in shared and 'skipped' in shared
    assert hb.refs_skip_reason([('h1', 'a'), ('h2', 'a')]) is None       # same bus id on two hosts: two GPUs
    assert 'boom' in hb.refs_skip_reason([('h', 'a')], 'boom')
    assert hb.hybrid_skip_reason(2) is None and 'DEEPEP_CUPY_SCALEUP_SIZE' in hb.hybrid_skip_reason(1)
    assert hb.one_domain_skip_reason('1', 1, None) is None
    assert 'without DEEPEP_CUPY_SCALEUP_SIZE' in hb.one_domain_skip_reason(None, None, None)
    assert 'failed (x)' in hb.one_domain_skip_reason('1', None, 'x')
    assert '2 domains' in hb.one_domain_skip_reason('1', 2, None)


def _ev(name, ts, dur, cat='kernel'):
    return {'cat': cat, 'name': name, 'ts': ts, 'dur': dur}


def test_stage_timeline_of_a_trace():
    events = [_ev('void deepep::hybrid_route<8>(int*)', 0, 2), _ev('deepep::hybrid_pack<8>', 3, 5),
              _ev('ncclDevKernel_SendRecv(ncclDevKernelArgsStorage)', 10, 20), _ev('deepep::hybrid_report', 31, 1),
              _ev('ncclKernel_SendRecv_RING_SIMPLE', 33, 7), _ev('deepep::hybrid_unpack<8>', 41, 4),
              _ev('deepep::hybrid_unpack<8>', 46, 4), _ev('notify_dispatch<8>', 51, 3),
              _ev('dispatch_impl_with_dispatch_copy_epilogue_impl<...>', 55, 10), _ev('elementwise_kernel', 66, 1),
              _ev('Memcpy DtoD', 67, 2, cat='gpu_memcpy'), {'cat': 'cpu_op', 'name': 'aten::empty', 'ts': 0,
                                                            'dur': 100}]
    t = hb.stage_timeline(events)
    assert t['stages'] == [('route', 2, 1), ('pack', 5, 1), ('rail', 27, 2), ('report', 1, 1), ('unpack', 8, 2),
                           ('intranode', 13, 2), ('copy', 2, 1)]
    assert t['span'] == 69 and t['other'] == 1
    combine = hb.stage_timeline([_ev('combine_impl_with_combine_reduce_epilogue_impl', 0, 9),
                                 _ev('deepep::hybrid_combine_pack', 10, 3), _ev('deepep::rail_wait', 14, 1),
                                 _ev('deepep::hybrid_combine_final<8>', 16, 4)])
    assert [s for s, _, _ in combine['stages']] == ['intranode', 'combine_pack', 'rail', 'combine_final']
    merged = hb.merge_timelines([t, {**t, 'span': 80.0, 'stages': [('route', 4, 1)]}, t])
    assert merged['span'] == 69 and merged['stages'][0] == ('route', 2.0, 1) and merged['stages'][2][1] == 27
    text = hb.timeline_text('hybrid dispatch 4096 bf16', merged)
    assert text.startswith('[timeline] hybrid dispatch 4096 bf16: route 2.0 | pack 5.0 | rail 27.0 (x2)')
    assert text.endswith('| other 1.0 | span 69.0 us')
    assert hb.timeline_text('x', hb.merge_timelines([])) == '[timeline] x: no kernels in the trace'
    assert hb.stage_timeline([])['span'] is None


def test_ep_bench_has_the_hybrid_flags():
    p = _load('ep_bench').build_parser()
    args = p.parse_args(['--hybrid', '--ignore-local-traffic', '--tokens', '128'])
    assert args.hybrid and args.ignore_local_traffic and args.tokens == [128]
    assert not p.parse_args([]).hybrid
