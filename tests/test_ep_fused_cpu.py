"""The fused notify and dispatch (`DEEPEP_CUPY_EP_FUSED_NOTIFY`, kernels_cu/ep_fused.cu) without a GPU: its sizes and
refusals (features/ep/fused.py), and the host wiring (features/ep/bound.py): a no-sync dispatch is ONE cooperative
launch whose arguments are the notify's and the dispatch's of the two-kernel path; CPU-sync, cached and two-launch
dispatches keep their kernels. The kernel's declaration against its signature: tests/test_peer_copy.py;
its compilation for sm_90: tests/test_jit.py (slow)."""

import os

import pytest

torch = pytest.importorskip('torch')

import test_ep_checks_cpu as ep_tests  # noqa: E402

from deepep_cupy import constants  # noqa: E402
from deepep_cupy.features.ep import fused  # noqa: E402
from deepep_cupy.features.ep import kernels as ep_kernels  # noqa: E402

R, M, H, K, E = ep_tests.R, ep_tests.M, ep_tests.H, ep_tests.K, ep_tests.E
FUSED = 'deepep::fused_notify_and_dispatch'
NOTIFY = 'deepep::notify_dispatch'
DISPATCH = 'deepep::dispatch_impl_with_dispatch_copy_epilogue_impl'
# Pointers into the handle's workspace (one allocation per call): compared as offsets from send_expert_pos.
WORKSPACE = ('send_pos', 'send_expert_pos', 'recv_layout', 'psum_recv_per_expert', 'topk_copy', 'token_of_slot',
             'send_count')
# Pointers to the caller's arrays or to the outputs (other allocations): compared as set or not.
OTHER_POINTERS = ('topk_idx', 'x', 'sf', 'topk_weights', 'cumulative_stats', 'recv_x', 'recv_sf', 'recv_topk_idx',
                  'recv_topk_weights', 'recv_src_metadata', 'recv_src_idx', 'host_seq')


def test_sizes_and_grid():
    assert [fused.fused_notify_blocks(n) for n in (0, 1, 512, 513, 4096, 4097)] == [1, 1, 1, 2, 8, 9]
    assert fused.FUSED_THREADS == ep_kernels.DISPATCH_THREADS == 512
    assert fused.fused_smem_bytes(256, 8) == (512 // 32 + 2) * (256 + 8) * 4
    # Senders first, then the receivers the dispatch kernel would have, never past the SMs, at least the notify
    # blocks (the first receivers).
    assert fused.fused_grid(0, 112, 1, 132) == 112
    assert fused.fused_grid(22, 200, 1, 132) == 132
    assert fused.fused_grid(4, 1, 8, 132) == 12
    assert fused.fused_grid(0, 1, 1, 132) == 1
    assert fused.fused_grid(131, 5, 1, 132) == 132
    for send in (0, 1, 22, 124):
        for epi in (1, 7, 132):
            for nb in (1, 8, 132 - send):
                g = fused.fused_grid(send, epi, nb, 132)
                assert send + max(1, nb) <= g <= 132


def test_who_receives_at_one_rank():
    """The notify blocks leave the copy to the others at one rank without expansion when those are >= 3/4 of the
    receivers: so at the target sizes (hidden 7168 BF16, decode and 4096 tokens); the GPU lane's 17000 tokens of
    hidden 128 (launch/gpu_suite.sh, fuse_lane) keep them receiving."""
    sms = 132

    def grid(tokens, hidden):
        return fused.fused_grid(0, ep_tests.ep_plan.epilogue_blocks(tokens, 2 * hidden, sms),
                                fused.fused_notify_blocks(tokens), sms)

    for tokens in (128, 4096):
        g, nb = grid(tokens, 7168), fused.fused_notify_blocks(tokens)
        assert not fused.fused_notify_blocks_receive(g, 0, nb, 1, False)
        assert fused.fused_notify_blocks_receive(g, 0, nb, 1, True)        # expanded: every receiver waits anyway
        assert fused.fused_notify_blocks_receive(g, 4, nb, 2, False)       # several ranks: the layout
    assert (grid(17000, 128), fused.fused_notify_blocks(17000)) == (132, 34)
    assert fused.fused_notify_blocks_receive(132, 0, 34, 1, False)
    assert fused.fused_notify_blocks_receive(1, 0, 1, 1, False)            # no other receiver (0 tokens)


@pytest.mark.parametrize('case, reason', [
    (dict(cached=True), 'cached'),
    (dict(cpu_sync=True), 'CPU-sync'),
    (dict(one_launch=False), 'two launches'),
    (dict(num_experts=4096), 'shared memory'),
    (dict(num_tokens=132 * 512 + 1), 'notify blocks'),
    (dict(num_tokens=(132 - 24) * 512 + 1), 'notify blocks'),
    (dict(num_send_blocks=132), 'notify blocks'),
    (dict(num_device_sms=513, num_tokens=512), 'receiving blocks'),
])
def test_refusals(case, reason):
    kw = dict(num_tokens=4096, num_experts=256, num_ranks=8, num_send_blocks=24, num_device_sms=132, cached=False,
              cpu_sync=False, one_launch=True)
    assert fused.fused_refusal(**kw) is None
    assert fused.fused_refusal(512, 2800, 8, 131, 132, False, False, True) is None   # the largest accepted
    assert fused.fused_refusal(132 * 512, 256, 1, 0, 132, False, False, True) is None
    kw.update(case)
    assert reason in fused.fused_refusal(**kw)


def test_count_blocks_match_the_kernel():
    """The refusal's bound on the receiving blocks is the kernel's count words (kernels_cu/common/ep.cuh), which one
    thread of a 512-thread block each reads."""
    text = open(os.path.join(os.path.dirname(__file__), '..', 'kernels_cu', 'common', 'ep.cuh')).read()
    assert f'kFusedMaxCountBlocks = {fused.FUSED_MAX_COUNT_BLOCKS};' in text
    assert fused.FUSED_MAX_COUNT_BLOCKS <= fused.FUSED_THREADS
    assert fused.fused_refusal(512, 256, 1, 0, 512, False, False, True) is None


def _buffer(monkeypatch, num_ranks=R, **env):
    for k in ('DEEPEP_CUPY_EP_FUSED_NOTIFY', 'DEEPEP_CUPY_EP_FUSED_COOPERATIVE', 'DEEPEP_CUPY_EP_DISPATCH_OVERLAP'):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return ep_tests.make_buffer(monkeypatch, num_ranks=num_ranks)


@pytest.mark.parametrize('num_ranks, setting, kw, fused_by', [
    (1, None, {}, True),                                    # the default: one rank, not expanded, no CPU sync
    (1, None, dict(do_expand=True, expert_alignment=4), False),
    (1, None, dict(do_cpu_sync=True), False),
    (1, '0', {}, False),
    (R, None, {}, False),                                   # several ranks: opt-in
    (R, '1', {}, True),
    (1, '1', dict(do_expand=True, expert_alignment=4), True),
])
def test_the_default_fuses_where_receivers_count_for_themselves(monkeypatch, num_ranks, setting, kw, fused_by):
    """DEEPEP_CUPY_EP_FUSED_NOTIFY unset: the fused kernel at one rank without expansion only (its self-counting
    receivers, kernels_cu/ep_fused.cu); '0' never, '1' wherever it can serve."""
    x, idx, w = ep_tests.make_inputs()
    env = {} if setting is None else dict(DEEPEP_CUPY_EP_FUSED_NOTIFY=setting)
    buf = _buffer(monkeypatch, num_ranks, **env)
    call = dict(num_experts=E, num_sms=4, do_cpu_sync=False)
    call.update(kw)
    buf.dispatch(x, idx, w, **call)
    names = [e.name.split('<')[0] for e in buf.launches]
    b = next(iter(buf._ep._bound.values()))
    assert b.fused == fused_by
    if fused_by:
        assert names == [FUSED] and b.fused_refusal is None
    else:
        assert names[0] == NOTIFY and FUSED not in names
        assert ('unset' in b.fused_refusal) == (setting is None and not kw.get('do_cpu_sync'))


@pytest.mark.parametrize('mode', ['no-sync', 'expand', 'fp8'])
def test_a_no_sync_dispatch_is_one_launch_with_both_kernels_arguments(monkeypatch, mode):
    x, idx, w = ep_tests.make_inputs()
    kw = dict(num_experts=E, num_sms=4, do_cpu_sync=False)
    if mode == 'expand':
        kw.update(do_expand=True, expert_alignment=4, do_zero_padding=True)
    xin = (x.to(torch.float8_e4m3fn), torch.ones(M, 2)) if mode == 'fp8' else x
    two = _buffer(monkeypatch)
    two.dispatch(xin, idx, w, **kw)
    notify, dispatch = two.launches
    assert (notify.name.split('<')[0], dispatch.name.split('<')[0]) == (NOTIFY, DISPATCH)
    one = _buffer(monkeypatch, DEEPEP_CUPY_EP_FUSED_NOTIFY='1')
    for _ in range(2):                                 # the bound call launches what the first call launched
        one.launches.clear()
        out = one.dispatch(xin, idx, w, **kw)
        assert len(one.launches) == 1
        f = one.launches[0]
        assert f.name == f'{FUSED}<{R}, {constants.topk_bucket(K)}>'
        assert f.cooperative and f.block == ep_kernels.DISPATCH_THREADS
        assert f.shared_mem == fused.fused_smem_bytes(E, R)
        assert f.args['num_notify_blocks'] == fused.fused_notify_blocks(M) == 1
        assert f.args['num_send_blocks'] == dispatch.args['num_send_blocks'] == 4
        assert f.grid == fused.fused_grid(4, dispatch.grid - 4, 1, 132) == dispatch.grid
        for ref in (notify, dispatch):
            for name, value in ref.args.items():
                if name in WORKSPACE:
                    base = 'send_expert_pos'
                    assert value - ref.args[base] == f.args[name] - f.args[base], name
                elif name in OTHER_POINTERS:
                    assert bool(value) == bool(f.args[name]), name
                elif name not in ('phases', 'ready', 'ready_mod'):      # the guard: hybrid P2 only
                    assert value == f.args[name], name
        assert set(f.args) == ((set(notify.args) | set(dispatch.args) | {'num_notify_blocks'}) -
                               {'phases', 'ready', 'ready_mod'})
    assert out[3].num_recv_tokens == R * M
    # Its handle combines and re-dispatches (cached: the dispatch kernel alone) as a two-kernel handle does.
    one.launches.clear()
    one.dispatch(xin, handle=out[3], do_expand=kw.get('do_expand', False))
    one.combine(torch.zeros(out[3].num_rows, H, dtype=torch.bfloat16), out[3])
    assert [e.name.split('<')[0] for e in one.launches] == [DISPATCH, 'deepep::combine_impl_with_combine_reduce_'
                                                                      'epilogue_impl']


def test_the_grid_covers_every_notify_block(monkeypatch):
    """More notify blocks than the dispatch's grid (here through a smaller token count per notify block)."""
    monkeypatch.setattr(fused, 'FUSED_THREADS', 4)
    x, idx, w = ep_tests.make_inputs()
    buf = _buffer(monkeypatch, DEEPEP_CUPY_EP_FUSED_NOTIFY='1')
    buf.dispatch(x, idx, w, num_experts=E, num_sms=1, do_cpu_sync=False)
    (f,) = buf.launches
    assert f.args['num_notify_blocks'] == M // 4 == 16
    assert f.grid == 1 + 16 > 1 + ep_tests.ep_plan.epilogue_blocks(R * M, 2 * H, 132)
    b = next(iter(buf._ep._bound.values()))
    assert b.fused and b.fused_refusal is None


def test_other_dispatches_keep_their_kernels(monkeypatch):
    x, idx, w = ep_tests.make_inputs()
    on = dict(DEEPEP_CUPY_EP_FUSED_NOTIFY='1')
    buf = _buffer(monkeypatch, **on)
    buf.dispatch(x, idx, w, num_experts=E, num_sms=4)                        # CPU sync: the host waits in between
    assert [e.name.split('<')[0] for e in buf.launches] == [NOTIFY, DISPATCH, DISPATCH]
    b = next(iter(buf._ep._bound.values()))
    assert not b.fused and 'CPU-sync' in b.fused_refusal
    buf = _buffer(monkeypatch, DEEPEP_CUPY_EP_DISPATCH_OVERLAP='0', **on)     # two launches asked for (2 ranks)
    buf.dispatch(x, idx, w, num_experts=E, num_sms=4, do_cpu_sync=False)
    assert [e.name.split('<')[0] for e in buf.launches] == [NOTIFY, DISPATCH, DISPATCH]
    buf = _buffer(monkeypatch, DEEPEP_CUPY_EP_FUSED_COOPERATIVE='0', **on)    # a plain launch of the same grid
    buf.dispatch(x, idx, w, num_experts=E, num_sms=4, do_cpu_sync=False)
    assert [(e.name.split('<')[0], e.cooperative) for e in buf.launches] == [(FUSED, False)]
