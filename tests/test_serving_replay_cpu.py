"""The host side of `deepep_cupy.tests.serving_replay` (vLLM / SGLang call-for-call replay): the frameworks' buffer
sizing, the stand-in experts' host reference against a brute-force one, the case list, every deep_ep call of the
sequences bound to the V1 Buffer's real signatures, the dispatchers' call order on a recording buffer, and `--help`
without torch."""

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip('torch')

from deepep_cupy.buffers.legacy import Buffer, Config
from deepep_cupy.tests import cli
from deepep_cupy.tests import legacy_reference as ref
from deepep_cupy.tests import serving_replay as sr
from deepep_cupy.tests import serving_replay_cases as sc

ROOT = Path(__file__).resolve().parents[1]
H, E = 2048, 64


# ---- sizing, the frameworks' way ------------------------------------------------------------------------------------
def test_framework_env_defaults_overrides_and_errors():
    assert sr.framework_env({}) == {'VLLM_DEEPEP_BUFFER_SIZE_MB': 1024, 'VLLM_MOE_DP_CHUNK_SIZE': 256,
                                    'VLLM_DEEPEP_LOW_LATENCY_USE_MNNVL': 0, 'VLLM_DBO_COMM_SMS': 20,
                                    'SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK': 128}
    env = sr.framework_env({'VLLM_DEEPEP_BUFFER_SIZE_MB': '64', 'VLLM_MOE_DP_CHUNK_SIZE': ' 128 '})
    assert env['VLLM_DEEPEP_BUFFER_SIZE_MB'] == 64 and env['VLLM_MOE_DP_CHUNK_SIZE'] == 128
    with pytest.raises(ValueError, match='VLLM_DBO_COMM_SMS'):
        sr.framework_env({'VLLM_DBO_COMM_SMS': 'many'})


def test_vllm_buffer_kwargs_are_what_vllm_passes_and_bind_to_buffer():
    env, group = sr.framework_env({}), object()
    ht = sr.vllm_ht_buffer_kwargs(group, env)
    assert ht == dict(group=group, num_nvl_bytes=1 << 30, num_rdma_bytes=0, low_latency_mode=False,
                      num_qps_per_rank=1, explicitly_destroy=True)
    ll = sr.vllm_ll_buffer_kwargs(group, Buffer, env, H, 4, E)
    assert ll['num_rdma_bytes'] == Buffer.get_low_latency_rdma_size_hint(256, H, 4, E) > 0
    assert (ll['num_nvl_bytes'], ll['num_qps_per_rank'], ll['low_latency_mode'], ll['allow_mnnvl'],
            ll['enable_shrink'], ll['explicitly_destroy']) == (1 << 30, E // 4, True, False, False, True)
    assert sr.vllm_ll_buffer_kwargs(group, Buffer, env, H, 4, E, fault_tolerance=True)['enable_shrink'] is True
    for kwargs in (ht, ll):
        inspect.signature(Buffer.__init__).bind(None, **kwargs)
    assert sr.vllm_configs(Buffer, 1) == (None, None) and sr.vllm_configs(Buffer, 3) == (None, None)
    d, c = sr.vllm_configs(Buffer, 4)
    assert (d.num_sms, d.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_send_tokens) == (20, 6, 9)


@pytest.mark.parametrize('R', [1, 2, 4])
def test_sglang_sizes_per_mode(R):
    M = 128
    hints = [cfg.get_nvl_buffer_size_hint(H, R) for cfg in (Buffer.get_dispatch_config(R),
                                                           Buffer.get_combine_config(R))]
    ll = Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    assert sr.sglang_buffer_sizes(Buffer, R, H, 1, 'normal', M, E) == (max(hints), 0, False, 20)
    assert sr.sglang_buffer_sizes(Buffer, R, H, 1, 'low_latency', M, E) == (0, ll, True, E // R)
    assert sr.sglang_buffer_sizes(Buffer, R, H, 1, 'auto', M, E) == (max(hints), ll, True, max(20, E // R))
    bf16 = sr.sglang_buffer_sizes(Buffer, R, H, 2, 'normal', M, E).num_nvl_bytes
    assert bf16 > max(hints)                    # FP8 dispatch sizes by hidden * 1 bytes
    cfgs = (Config(24, 8, 256), Config(24, 8, 512))
    custom = sr.sglang_buffer_sizes(Buffer, R, H, 1, 'auto', M, 4 * R, configs=cfgs)
    assert custom.num_qps_per_rank == 24 and custom.num_nvl_bytes == cfgs[1].get_nvl_buffer_size_hint(H, R)


@pytest.mark.parametrize('R', [1, 2, 4])
def test_the_prefill_case_overflows_sglangs_fp8_buffer_only(R):
    n = sr.prefill_tokens(Buffer, R)
    assert n == 2560
    fp8 = sr.sglang_buffer_sizes(Buffer, R, H, 1, 'normal', 128, E).num_nvl_bytes
    bf16 = sr.sglang_buffer_sizes(Buffer, R, H, 2, 'normal', 128, E).num_nvl_bytes
    assert sr.grows(fp8, R, n, H, 8) and not sr.grows(bf16, R, n, H, 8)
    assert not sr.grows(1 << 30, R, 128, H, 8)          # vLLM's 1 GiB holds the replay's tokens


def test_tma_aligned_col_major_scales():
    for n in (0, 1, 5, 8):
        sf = torch.arange(n * 4, dtype=torch.int32).reshape(n, 4)
        got = sr.tma_aligned_col_major(sf)
        assert torch.equal(got, sf) and got.shape == (n, 4)
        assert n == 0 or got.stride() == (1, -(-n // 4) * 4)


# ---- the stand-in experts' host reference ---------------------------------------------------------------------------
def _world(R=3, Ek=6, K=3, Hs=16, sizes=(5, 0, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes[:R]:
        x = (torch.randn(n, Hs, generator=g) * 3).to(torch.bfloat16)
        t = torch.stack([torch.randperm(Ek, generator=g)[:K] for _ in range(n)]) if n else \
            torch.empty((0, K), dtype=torch.int64)
        t[torch.rand(n, K, generator=g) < 0.25] = -1
        out.append((x, t, torch.randn(n, K, generator=g)))
    return out


def _brute_force(x, topk, w, Ek, R):
    """Per token: destinations in the order of their last top-k slot, each returning the sum over its local slots k
    (ascending) of bf16(bf16(row * 2^(e % 4 - 2)) * w_k); FP32 sum over destinations, one rounding."""
    L = Ek // R
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    for t in range(x.shape[0]):
        last = {}
        for k, e in enumerate(topk[t].tolist()):
            if e >= 0:
                last[e // L] = k
        acc = torch.zeros(x.shape[1])
        for d in sorted(last, key=last.get):
            y = torch.zeros(x.shape[1])
            for k, e in enumerate(topk[t].tolist()):
                if e >= 0 and e // L == d:
                    row = (x[t].float() * 2.0 ** (e % 4 - 2)).to(torch.bfloat16)
                    y = y + (row.float() * w[t, k]).to(torch.bfloat16).float()
            acc = acc + y.to(torch.bfloat16).float()
        out[t] = acc.to(torch.bfloat16)
    return out


@pytest.mark.parametrize('seed', [0, 1])
def test_expected_combine_equals_a_brute_force_loop(seed):
    R, Ek = 3, 6
    for x, t, w in _world(R, Ek, seed=seed):
        assert torch.equal(sr.expected_combine(x.float(), t, w, Ek, R).view(torch.int16),
                           _brute_force(x, t, w, Ek, R).view(torch.int16))


def test_expected_combine_sums_ranks_in_the_order_of_their_last_slot():
    """Destinations 0, 1, 2 return 1, 2^26, -2^26; token [e0 (rank 0), e2 (1), e4 (2), e1 (0)]: by last slot
    (1, 2, 0) the FP32 sum is 1, by first slot (0, 1, 2) the 1 is lost (2^26 + 1 rounds to 2^26)."""
    x = torch.ones(1, 8, dtype=torch.bfloat16)
    t = torch.tensor([[0, 2, 4, 1]])
    w = torch.tensor([[2.0, 2.0 ** 26, -2.0 ** 28, 1.0]])     # y0 = bf16(.25*2) + bf16(.5*1) = 1
    got = sr.expected_combine(x.float(), t, w, 6, 3)
    assert got.float().tolist() == [[1.0] * 8] and torch.equal(got, _brute_force(x, t, w, 6, 3))


def test_expert_rows_reads_only_local_slots():
    """The GPU side passes the received weights (0 off the rank), the host the original ones: equal results."""
    x, t, w = _world(1, 4, K=4, sizes=(6,))[0]
    local = torch.where(ref.owners(t, 8, 2) == 1, t - 4, -1)
    noisy = torch.where(local >= 0, w, torch.full_like(w, float('nan')))
    zeroed = torch.where(local >= 0, w, torch.zeros_like(w))
    a, b = sr.expert_rows(x.float(), local, noisy, 1, 4), sr.expert_rows(x.float(), local, zeroed, 1, 4)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)) and not a.isnan().any()


# ---- the case list ------------------------------------------------------------------------------------------------
def test_case_list_and_selection():
    names = [c.name for c in sc.CASES]
    assert len(names) == len(set(names)) and all(c.block in sc.BLOCKS for c in sc.CASES)
    assert [c.name for c in sc.select_cases('all')] == [c.name for c in sc.CASES if c.default]
    assert 'sglang_normal_sync' in [c.name for c in sc.select_cases('all')]
    assert [c.name for c in sc.select_cases('sglang_auto, vllm_ht_dbo')] == ['vllm_ht_dbo', 'sglang_auto']
    with pytest.raises(ValueError, match='vllm_ht_typo'):
        sc.select_cases('vllm_ht_typo')
    for block in sc.BLOCKS:                     # blocks run in the order their cases are listed
        assert any(c.block == block for c in sc.CASES)
    help_text = cli.serving_replay_parser().format_help().replace('\n', ' ')
    for name in names:
        assert name.replace('_', '') in help_text.replace(' ', '').replace('_', '')


def test_help_works_without_torch_and_lists_the_defaults():
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['serving_replay', '--help']; "
            "runpy.run_module('deepep_cupy.tests.serving_replay', run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS='120')
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, cwd='/', timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith('usage: python -m deepep_cupy.tests.serving_replay')
    args = cli.serving_replay_parser().parse_args([])
    assert (args.num_tokens, args.num_ll_tokens, args.hidden, args.num_topk, args.num_experts, args.cases) == \
        (128, 32, 2048, 8, 64, 'all')


# ---- every deep_ep call binds to the V1 Buffer's signature ----------------------------------------------------------
V1_METHODS = ('get_dispatch_layout', 'dispatch', 'combine', 'low_latency_dispatch', 'low_latency_combine',
              'clean_low_latency_buffer', 'capture', 'set_num_sms', 'destroy', 'get_local_buffer_tensor',
              'low_latency_query_mask_buffer', 'low_latency_clean_mask_buffer', 'get_low_latency_rdma_size_hint')


def test_every_deep_ep_call_of_the_sequences_binds_to_the_v1_signature():
    tree = ast.parse((ROOT / 'deepep_cupy' / 'tests' / 'serving_replay_cases.py').read_text())
    seen = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        attr = node.func.attr
        if attr not in V1_METHODS and attr != 'Buffer':
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue                            # Buffer(**kwargs): the kwargs test above binds those
        fn = Buffer.__init__ if attr == 'Buffer' else getattr(Buffer, attr)
        sig = inspect.signature(fn)
        selfless = isinstance(inspect.getattr_static(Buffer, attr, None), staticmethod)
        placeholders = ([] if selfless else [None]) + [None] * len(node.args)
        try:
            sig.bind(*placeholders, **{k.arg: None for k in node.keywords})
        except TypeError as e:
            raise AssertionError(f'line {node.lineno}: {attr}(...) does not bind to Buffer.{attr}{sig}: {e}') from e
        seen.add(attr)
    assert seen >= {'get_dispatch_layout', 'dispatch', 'combine', 'low_latency_dispatch', 'low_latency_combine',
                    'clean_low_latency_buffer', 'capture', 'Buffer', 'get_local_buffer_tensor'}


# ---- the call order, on a recording buffer --------------------------------------------------------------------------
class FakeEvent:
    def __init__(self, live=True):
        self.event, self.waits = (object() if live else None), 0

    def current_stream_wait(self):
        assert self.event is not None, 'current_stream_wait on an empty EventOverlap'
        self.waits += 1


class RecordingBuffer:
    """The V1 Buffer's calls, each bound to the real signature and logged as (name, arguments)."""
    log = []
    num_sms = 20
    get_dispatch_config = staticmethod(Buffer.get_dispatch_config)
    get_combine_config = staticmethod(Buffer.get_combine_config)
    get_low_latency_rdma_size_hint = staticmethod(Buffer.get_low_latency_rdma_size_hint)

    @classmethod
    def _record(cls, name, fn, *args, **kwargs):
        bound = inspect.signature(fn).bind(None, *args, **kwargs)
        bound.apply_defaults()
        arguments = {k: v for k, v in bound.arguments.items() if k != 'self'}
        cls.log.append((name, arguments))
        return arguments

    def __init__(self, *args, **kwargs):
        self.low_latency_mode = self._record('Buffer', Buffer.__init__, *args, **kwargs)['low_latency_mode']

    @classmethod
    def capture(cls):
        cls.log.append(('capture', {}))
        return FakeEvent()

    def get_dispatch_layout(self, *args, **kwargs):
        a = self._record('get_dispatch_layout', Buffer.get_dispatch_layout, *args, **kwargs)
        n = a['topk_idx'].shape[0]
        return (torch.zeros(2, dtype=torch.int32), None, torch.zeros(E, dtype=torch.int32),
                torch.zeros((n, 2), dtype=torch.bool), FakeEvent(a['async_finish']))

    def dispatch(self, *args, **kwargs):
        a = self._record('dispatch', Buffer.dispatch, *args, **kwargs)
        return a['x'], a['topk_idx'], a['topk_weights'], [0] * 4, 'handle', FakeEvent(a['async_finish'])

    def combine(self, *args, **kwargs):
        a = self._record('combine', Buffer.combine, *args, **kwargs)
        return a['x'], None, FakeEvent(a['async_finish'])

    def low_latency_dispatch(self, *args, **kwargs):
        a = self._record('low_latency_dispatch', Buffer.low_latency_dispatch, *args, **kwargs)
        hook = (lambda: self.log.append(('hook', {}))) if a['return_recv_hook'] else None
        return 'recv', 'count', 'llhandle', FakeEvent(a['async_finish']), hook

    def low_latency_combine(self, *args, **kwargs):
        a = self._record('low_latency_combine', Buffer.low_latency_combine, *args, **kwargs)
        hook = (lambda: self.log.append(('hook', {}))) if a['return_recv_hook'] else None
        return (a['out'] if a['out'] is not None else 'combined'), FakeEvent(a['async_finish']), hook

    def clean_low_latency_buffer(self, *args, **kwargs):
        self._record('clean_low_latency_buffer', Buffer.clean_low_latency_buffer, *args, **kwargs)


@pytest.fixture
def ctx():
    RecordingBuffer.log = []
    env = sr.framework_env({})
    return SimpleNamespace(Buffer=RecordingBuffer, env=env, E=E, H=H, R=2, rank=0, what='[test]',
                           torch_group=SimpleNamespace(size=lambda: 2), cpu_group='cpu_group')


def _names(log):
    return [name for name, _ in log]


def test_sglang_normal_calls(ctx):
    state = sc.SGLangBuffer(ctx, 'normal')
    assert RecordingBuffer.log[0][1]['allow_mnnvl'] is True and RecordingBuffer.log[0][1]['low_latency_mode'] is False
    disp = sc.SGLangNormal(ctx, state)
    x, ids, w = torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)
    RecordingBuffer.log = []
    out, _ = disp.dispatch_b(*disp.dispatch_a(x, ids, w))
    disp.combine_b(*disp.combine_a(x))
    assert _names(RecordingBuffer.log) == ['capture', 'get_dispatch_layout', 'dispatch', 'capture', 'combine']
    layout, dispatch, combine = (a for n, a in RecordingBuffer.log if n != 'capture')
    assert layout['topk_idx'].dtype == torch.int64 and layout['previous_event'] is not None
    assert (layout['async_finish'], layout['allocate_on_comm_stream']) == (True, True)
    assert (dispatch['async_finish'], dispatch['allocate_on_comm_stream'], dispatch['expert_alignment'],
            dispatch['config']) == (True, True, 128, None)
    assert (combine['async_finish'], combine['allocate_on_comm_stream'], combine['topk_weights']) == (True, True, None)
    assert out[5].waits == 1 and disp.handle is None
    # async_finish=False (the class default): the layout's empty event goes on as the dispatch's previous_event
    RecordingBuffer.log = []
    sync = sc.SGLangNormal(ctx, state, async_finish=False)
    sync.dispatch_b(*sync.dispatch_a(x, ids, w))
    layout, dispatch = (a for _, a in RecordingBuffer.log)
    assert layout['previous_event'] is None and dispatch['previous_event'].event is None
    assert (dispatch['async_finish'], dispatch['allocate_on_comm_stream']) == (False, False)


def test_sglang_low_latency_calls_and_the_auto_clean(ctx):
    state = sc.SGLangBuffer(ctx, 'auto')
    assert RecordingBuffer.log[0][1]['num_qps_per_rank'] == max(20, E // 2)
    x, ids, w = torch.zeros(3, H, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2)
    for mode, extra in ((sr.FP8, {'round_scale': False, 'use_ue8m0': False}), (sr.BF16, None)):
        RecordingBuffer.log = []
        disp = sc.SGLangLowLatency(ctx, state, mode)
        out = disp.dispatch_a(x, ids)
        disp.dispatch_b(out)
        disp.combine_b(*disp.combine_a(x, ids, w))
        assert _names(RecordingBuffer.log) == ['low_latency_dispatch', 'hook', 'low_latency_combine', 'hook']
        d, c = RecordingBuffer.log[0][1], RecordingBuffer.log[2][1]
        assert (d['num_max_dispatch_tokens_per_rank'], d['num_experts'], d['use_fp8']) == (128, E, mode[0])
        assert (d['async_finish'], d['return_recv_hook'], c['async_finish'], c['return_recv_hook']) == \
            (False, True, False, True)
        assert c['handle'] == 'llhandle' and c['out'] is None and c['zero_copy'] is False
        if extra:
            assert {k: d[k] for k in extra} == extra
    RecordingBuffer.log = []
    for phase in ('decode', 'prefill', 'decode', 'decode', 'prefill', 'decode'):
        state.low_latency() if phase == 'decode' else state.normal()
    assert _names(RecordingBuffer.log) == ['clean_low_latency_buffer'] * 2 and state.cleans == 2
    assert RecordingBuffer.log[0][1] == dict(num_max_dispatch_tokens_per_rank=128, hidden=H, num_experts=E)


def test_vllm_calls(ctx):
    buf = RecordingBuffer(**sr.vllm_ht_buffer_kwargs('cpu_group', ctx.env))
    case = SimpleNamespace(x=torch.zeros(3, 8, dtype=torch.bfloat16), topk_idx=torch.zeros(3, 2, dtype=torch.int64),
                           topk_weights=torch.zeros(3, 2), E=E)
    for dbo, prev in ((False, None), (True, FakeEvent())):
        RecordingBuffer.log = []
        out, _ = sc.vllm_ht_dispatch(buf, case, 'bf16', None, prev, dbo=dbo)
        output = torch.empty_like(case.x)
        sc.vllm_ht_finalize(buf, out[4], case.x, None, output, True, prev, dbo=dbo)
        layout, dispatch, combine = (a for _, a in RecordingBuffer.log)
        assert layout['previous_event'] is prev and dispatch['previous_event'] is prev
        assert (layout['async_finish'], layout['allocate_on_comm_stream']) == (False, False)
        assert (dispatch['async_finish'], dispatch['allocate_on_comm_stream'], dispatch['expert_alignment']) == \
            (not dbo, False, 1)
        assert (combine['topk_weights'], combine['async_finish'], combine['allocate_on_comm_stream']) == \
            (None, not dbo, False)
    inp = SimpleNamespace(x=torch.zeros(2, H, dtype=torch.bfloat16), topk_idx=case.topk_idx[:2],
                          topk_weights=case.topk_weights[:2], E=E)
    for hook in (True, False):
        RecordingBuffer.log = []
        out = sc.vllm_ll_prepare(buf, inp, 256, sr.FP8_UE8M0)
        output, recv_hook = sc.vllm_ll_finalize(buf, inp, out[2], inp.x, hook)
        d, c = RecordingBuffer.log[0][1], RecordingBuffer.log[1][1]
        assert (d['use_fp8'], d['round_scale'], d['use_ue8m0'], d['async_finish'], d['return_recv_hook']) == \
            (True, True, True, False, True)
        assert (c['zero_copy'], c['async_finish'], c['return_recv_hook'], c['out'] is output) == \
            (False, False, hook, True)
        assert (recv_hook is not None) == hook
