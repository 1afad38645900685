"""CPU tests of perf/ll_side_by_side.py's pure parts: arguments, inputs, packing and the bitwise comparison (with
rows in a different order, and cases that must fail), the recipe diagnostics, kernel-time parsing, the table."""

import importlib.util
import os

import pytest

torch = pytest.importorskip('torch')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location('ll_side_by_side', os.path.join(ROOT, 'perf', 'll_side_by_side.py'))
sbs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sbs)


# -- arguments --

def test_defaults_are_the_issue_shape():
    a = sbs.parse_args([])
    assert (a.num_tokens, a.hidden, a.num_topk, a.num_experts) == (128, 7168, 8, 256)
    assert a.libs == ('deepep', 'ours') and a.lib is None and a.graph_calls % 2 == 0


@pytest.mark.parametrize('argv', [['--graph-calls', '3'], ['--hidden', '7000'], ['--num-topk', '9', '--num-experts',
                                                                                  '8'],
                                  ['--libs', 'deepep,foo'], ['--libs', 'ours,ours'], ['--num-tokens', '0'],
                                  ['--num-masked', '-1']])
def test_bad_arguments_exit(argv):
    with pytest.raises(SystemExit):
        sbs.parse_args(argv)


def test_child_command_round_trips():
    a = sbs.parse_args(['--num-tokens', '64', '--hidden', '2048', '--libs', 'ours', '--out', '/tmp/x'])
    cmd = sbs.child_command(a, 'ours', 1234)
    child = sbs.parse_args(cmd[2:])
    assert child.lib == 'ours' and child.port == 1234 and child.num_tokens == 64 and child.hidden == 2048
    assert child.out == '/tmp/x' and child.deepep_prefix == a.deepep_prefix


def test_child_env_puts_the_right_deep_ep_first():
    base = {'PYTHONPATH': os.pathsep.join(['/a/deepep_cupy/_deep_ep_bootstrap', '/b'])}
    env = sbs.child_env('deepep', '/tmp/deepep_v121', base)
    assert env['PYTHONPATH'].split(os.pathsep) == ['/tmp/deepep_v121', '/b']
    env = sbs.child_env('ours', '/tmp/deepep_v121', base)
    assert env['PYTHONPATH'].split(os.pathsep) == [sbs.ROOT, '/b']


# -- inputs --

def test_inputs_are_seeded_and_valid():
    a = sbs.make_inputs(16, 512, 4, 32, 5, seed=3)
    b = sbs.make_inputs(16, 512, 4, 32, 5, seed=3)
    assert all(torch.equal(a[k], b[k]) for k in ('x', 'topk_idx', 'topk_weights', 'expert_scale'))
    assert a['x'].dtype == torch.bfloat16 and a['topk_idx'].dtype == torch.int64
    assert int((a['topk_idx'] == -1).sum()) == 5
    for row in a['topk_idx']:
        chosen = row[row >= 0]
        assert chosen.unique().numel() == chosen.numel()
    assert not torch.equal(a['x'], sbs.make_inputs(16, 512, 4, 32, 5, seed=4)['x'])


# -- packing and comparison --

def _fake_dispatch(x, topk_idx, num_experts, order_seed=None, use_fp8=True):
    """A one-rank low-latency dispatch on the CPU: rows of expert e in token order, or shuffled (DeepEP's arrival
    order) with `order_seed`."""
    N, H = x.shape
    T = N
    recv = torch.zeros((num_experts, T, H), dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    scales = torch.zeros((num_experts, H // 128, T), dtype=torch.float32).transpose(1, 2)     # column-major view
    count = torch.zeros((num_experts,), dtype=torch.int32)
    src = torch.full((num_experts, T), -7, dtype=torch.int32)
    layout = torch.zeros((num_experts, 1), dtype=torch.int64)
    g = torch.Generator().manual_seed(order_seed or 0)
    for e in range(num_experts):
        tokens = torch.nonzero((topk_idx == e).any(dim=1)).view(-1)
        if order_seed is not None:
            tokens = tokens[torch.randperm(tokens.numel(), generator=g)]
        c = tokens.numel()
        q, sf = x[tokens].to(recv.dtype), (x[tokens].float().view(c, -1, 128).abs().amax(-1).clamp(min=1e-4) / 448)
        recv[e, :c] = q
        scales[e, :c] = sf
        src[e, :c] = tokens.to(torch.int32)
        count[e] = c
        layout[e, 0] = c        # begin 0, count c
    return recv, scales if use_fp8 else None, count, src, layout


def _inputs():
    inp = sbs.make_inputs(12, 256 * 2, 3, 8, 4, seed=1)
    return inp['x'], inp['topk_idx']


def test_dispatch_same_rows_in_another_order_pass():
    x, idx = _inputs()
    a = sbs.pack_dispatch(*_fake_dispatch(x, idx, 8))
    b = sbs.pack_dispatch(*_fake_dispatch(x, idx, 8, order_seed=5))
    assert not torch.equal(a['key'], b['key'])          # the orders differ...
    r = sbs.compare_dispatch('dispatch_fp8', a, b)      # ...the sets do not
    assert r['ok'], r['detail']
    assert r['num_rows'] == int((idx >= 0).sum())
    assert a['rows'].dtype == torch.uint8 and a['scales'].dtype == torch.int32


def test_dispatch_bf16_pass_and_count_mismatch_fails():
    x, idx = _inputs()
    d = _fake_dispatch(x, idx, 8, use_fp8=False)
    a = sbs.pack_dispatch(*d)
    assert a['scales'] is None and a['rows'].dtype == torch.int16
    assert sbs.compare_dispatch('dispatch_bf16', a, sbs.pack_dispatch(*d))['ok']
    recv, sf, count, src, layout = _fake_dispatch(x, idx, 8, use_fp8=False)
    count[2] -= 1
    layout[2, 0] -= 1
    r = sbs.compare_dispatch('dispatch_bf16', a, sbs.pack_dispatch(recv, sf, count, src, layout))
    assert not r['ok'] and 'recv_count' in r['detail'] and 'expert 2' in r['detail']


def test_dispatch_one_flipped_bit_fails_with_its_position():
    x, idx = _inputs()
    a = sbs.pack_dispatch(*_fake_dispatch(x, idx, 8))
    recv, sf, count, src, layout = _fake_dispatch(x, idx, 8, order_seed=2)
    e = int(torch.nonzero(count > 0)[0])
    token = int(src[e, 0])
    recv.view(torch.uint8)[e, 0, 7] ^= 1
    r = sbs.compare_dispatch('dispatch_fp8', a, sbs.pack_dispatch(recv, sf, count, src, layout))
    assert not r['ok'] and r['num_diff'] == 1
    assert f'expert {e}' in r['detail'] and f'token {token}' in r['detail'] and 'column 7' in r['detail']


def test_dispatch_scale_and_row_set_mismatches_fail():
    x, idx = _inputs()
    a = sbs.pack_dispatch(*_fake_dispatch(x, idx, 8))
    recv, sf, count, src, layout = _fake_dispatch(x, idx, 8)
    e = int(torch.nonzero(count > 0)[0])
    sf[e, 0, 1] = torch.nextafter(sf[e, 0, 1], torch.tensor(1.0))     # one ulp
    r = sbs.compare_dispatch('dispatch_fp8', a, sbs.pack_dispatch(recv, sf, count, src, layout))
    assert not r['ok'] and r['detail'].startswith('scales differ')
    recv, sf, count, src, layout = _fake_dispatch(x, idx, 8)
    src[e, 0] = 11 if int(src[e, 0]) != 11 else 10       # a token the expert did not receive... or a duplicate
    r = sbs.compare_dispatch('dispatch_fp8', a, sbs.pack_dispatch(recv, sf, count, src, layout))
    assert not r['ok'] and 'row sets differ' in r['detail']


def test_pack_keys_carry_the_source_rank():
    # Two source ranks: expert 0 holds rank 0's tokens 0, 2 then rank 1's token 2 (layout begin 2, count 1).
    recv = torch.arange(3 * 128, dtype=torch.float32).view(1, 3, 128).to(torch.bfloat16)
    src = torch.tensor([[0, 2, 2]], dtype=torch.int32)
    layout = torch.tensor([[2, (2 << 32) | 1]], dtype=torch.int64)
    p = sbs.pack_dispatch(recv, None, torch.tensor([3], dtype=torch.int32), src, layout)
    assert p['key'].tolist() == [0, 2, (1 << 32) | 2]
    assert p['layout_counts'].tolist() == [[2, 1]]


def test_combine_exact_and_mismatch():
    a = torch.randn(4, 256).to(torch.bfloat16)
    assert sbs.compare_exact('combine_bf16', a, a.clone())['ok']
    b = a.clone()
    b[3, 100] = -b[3, 100]
    r = sbs.compare_exact('combine_bf16', a, b)
    assert not r['ok'] and r['num_diff'] == 1 and '[3, 100]' in r['detail']
    z = torch.zeros(2, 2, dtype=torch.bfloat16)
    assert not sbs.compare_exact('combine_bf16', z, -z)['ok']     # -0 differs from 0 by bits
    assert not sbs.compare_exact('combine_bf16', z, z.float())['ok']


def test_compare_outputs_reports_missing_cases():
    x, idx = _inputs()
    p = sbs.pack_dispatch(*_fake_dispatch(x, idx, 8))
    c = torch.zeros(2, 2, dtype=torch.bfloat16)
    checks = sbs.compare_outputs({'dispatch_fp8': p, 'combine_bf16': c}, {'dispatch_fp8': p})
    by = {r['name']: r for r in checks}
    assert by['dispatch_fp8']['ok']
    assert not by['combine_bf16']['ok'] and 'ours' in by['combine_bf16']['detail']
    assert not by['dispatch_bf16']['ok'] and 'DeepEP and ours' in by['dispatch_bf16']['detail']


# -- recipe diagnostics --

def test_scale_recipes_and_their_match():
    x, idx = _inputs()
    packed = sbs.pack_dispatch(*_fake_dispatch(x, idx, 8))      # the fake uses amax / 448
    m = sbs.scale_recipe_match(packed, x, round_scale=False)
    assert m['v2_torch'] == 1.0 and 0 <= m['v1_kernel'] <= 1
    r = sbs.fp8_scale_recipes(torch.zeros(1, 512, dtype=torch.bfloat16) + 1, round_scale=True)
    for v in r.values():
        bits = v.view(torch.int32)
        assert bool(((bits & 0x7FFFFF) == 0).all())           # powers of two


def test_combine_references_agree_where_exact():
    inp = sbs.make_inputs(6, 256, 2, 4, 2, seed=0)
    refs = sbs.combine_references(inp['x'], inp['topk_idx'], inp['topk_weights'], inp['expert_scale'])
    assert refs['fma'].shape == (6, 256) and refs['fma'].dtype == torch.bfloat16
    # A token whose every entry is masked combines to zeros in both.
    idx = inp['topk_idx'].clone()
    idx[0] = -1
    refs = sbs.combine_references(inp['x'], idx, inp['topk_weights'], inp['expert_scale'])
    assert not bool(refs['mul_add'][0].float().abs().sum()) and not bool(refs['fma'][0].float().abs().sum())
    # One expert with weight 1 and scale 1: the row itself, by either arithmetic.
    one = sbs.combine_references(inp['x'], torch.zeros(6, 1, dtype=torch.int64), torch.ones(6, 1),
                                 torch.ones(4))
    assert torch.equal(one['fma'], inp['x']) and torch.equal(one['mul_add'], inp['x'])


# -- kernel times, ratios, table --

def _ev(name, ts, dur):
    return {'cat': 'kernel', 'name': name, 'ts': ts, 'dur': dur}


def test_kernel_times_names_periods_and_table():
    events, t = [], 0
    for _ in range(3):      # 3 iterations of: DeepEP-style send, recv; our-style names; a spacer
        events += [_ev('void deep_ep::internode_ll::dispatch<true, 3, 7168>(int*)', t, 4.0),
                   _ev('void deep_ep::internode_ll::dispatch<true, 3, 7168>(int*)', t + 10, 6.0),
                   _ev('combine<1>', t + 20, 3.0), _ev('combine<1>', t + 30, 5.0),
                   _ev('void at::native::spin_kernel(long)', t + 40, 100.0),
                   {'cat': 'cpu_op', 'name': 'dispatch', 'ts': t, 'dur': 50.0}]
        t += 100
    k, table = sbs.kernel_times(events, 3, ('dispatch', 'combine'), period=2, exclude=('spin',))
    assert k['dispatch'] == [4.0, 6.0] and k['combine'] == [3.0, 5.0]
    assert table['*'] == 18.0 and not any('spin' in n for n in table)
    k, _ = sbs.kernel_times(events, 3, ('dispatch',), period=1)
    assert k['dispatch'] == [10.0]
    k, _ = sbs.kernel_times(events, 4, ('dispatch', 'notify'), period=2)
    assert k['dispatch'] is None and k['notify'] is None      # 6 launches are not 4 iterations x 2 phases
    assert sbs._kernel_regex('dispatch').search('_Z8dispatchILi1EEvPKh')
    assert not sbs._kernel_regex('dispatch').search('void dispatch_layout<1>(int)')
    assert not sbs._kernel_regex('combine').search('elementwise_kernel_combined')


def test_ratio():
    assert sbs.ratio(20.0, 10.0) == 0.5
    assert sbs.ratio(None, 1.0) is None and sbs.ratio(1.0, None) is None and sbs.ratio(0.0, 1.0) is None


def test_table_has_every_metric_and_na():
    text = sbs.format_table({'deepep': {'graph_dispatch_fp8': 24.5}, 'ours': {'graph_dispatch_fp8': 9.8,
                                                                              'graph_combine': 7.0}})
    lines = text.splitlines()
    assert lines[0].split(' | ')[0].strip() == 'metric' and [c.strip() for c in lines[0].split('|')][1:] == \
        ['DeepEP', 'ours', 'ratio']
    assert len(lines) == 2 + len(sbs.METRICS)
    row = next(line for line in lines if line.startswith('graph: dispatch FP8'))
    assert [c.strip() for c in row.split('|')][1:] == ['24.50', '9.80', '0.400']
    row = next(line for line in lines if line.startswith('graph: combine'))
    assert [c.strip() for c in row.split('|')][1:] == ['n/a', '7.00', 'n/a']
    assert len({len(line) for line in lines}) == 1      # aligned
