"""The hybrid feature's host side (features/hybrid/feature.py) driven without a GPU: recording kernels with the real
launchers' signatures, a fake intranode engine and a fake rail transport. Checks the call sequence of CPU-sync,
no-sync and cached dispatches and of combine (which kernels, which rail exchanges with which sizes, what the
intranode engine is asked), that invalid arguments raise before any launch, and the bounded notify wait."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import fakes  # noqa: E402

from deepep_cupy.features.hybrid import feature as hfeature  # noqa: E402
from deepep_cupy.features.hybrid import kernels as hkernels  # noqa: E402
from deepep_cupy.features.hybrid import plan as hplan  # noqa: E402
from deepep_cupy.features.hybrid.handle import HybridHandle  # noqa: E402
from deepep_cupy.runtime.rails import ScaleoutTransport, rail_topology  # noqa: E402

N, R, M, H, K, E = 3, 2, 8, 64, 4, 24


class FakeInner:
    def __init__(self):
        self.settings = SimpleNamespace(device=-1)
        self.calls = []

    def _check_usable(self):
        pass

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None, num_experts=None,
                 num_max_tokens_per_rank=None, expert_alignment=None, **rest):
        m, alignment = num_max_tokens_per_rank, expert_alignment
        self.calls.append(('dispatch', x, topk_idx, topk_weights, num_experts, m, rest))
        ux = x[0] if isinstance(x, tuple) else x
        handle = SimpleNamespace(expert_alignment=alignment or 1, num_recv_tokens=5, kind='torch',
                                 recv_src_metadata=torch.tensor([[0 * N * M + 1 * M + 3, 0], [1 * N * M + 2, 0]],
                                                                dtype=torch.int32))
        return ux[:5], torch.zeros((5, K), dtype=torch.int64), None, handle, None

    def combine(self, x, handle, topk_weights=None, bias=None, **rest):
        self.calls.append(('combine', x, handle, topk_weights, bias, rest))
        rows = N * handle.m
        return torch.zeros((rows, H), dtype=torch.bfloat16), torch.zeros((rows, K)), None

    def destroy(self):
        pass


class FakeRails:
    def __init__(self, rank, num_domains=N, num_scaleup_ranks=R):
        self.rails = rail_topology(num_domains * num_scaleup_ranks, num_scaleup_ranks, rank)
        self.base = 0x5000_0000
        self.plans = []
        self.transport = ScaleoutTransport(self.rails, self.base)

    def exchange(self, plan, stream):
        self.plans.append(plan)

    def barrier(self, stream):
        self.plans.append('barrier')

    def release(self, collective):
        pass


def make(rank=3, counts=None, report=True, monkeypatch=None):
    log = []
    host = fakes.FakeHostMapped()

    def run_report(args):
        if not report:
            return
        words = host.view('int32', 1 + 2 * N)
        send, recv = counts
        words[1:1 + N], words[1 + N:1 + 2 * N] = send, recv
        words[0] = args['seq']

    kernels = SimpleNamespace(**{
        name: fakes.RecordingKernel(spec, log, run_report if name == 'report' else None)
        for name, spec in (('route', hkernels.route_spec(4)), ('pack', hkernels.pack_spec(4)),
                           ('report', hkernels.report_spec()), ('unpack', hkernels.unpack_spec(4)),
                           ('combine_pack', hkernels.combine_pack_spec()),
                           ('combine_final', hkernels.combine_final_spec(4)))})
    buf = fakes.make_buffer(num_ranks=N * R, rank=rank, num_scaleup_ranks=R, num_scaleout_ranks=N,
                            scaleup_rank_idx=rank % R, scaleout_rank_idx=rank // R, num_cpu_timeout_secs=0.3)
    inner, rails = FakeInner(), FakeRails(rank)
    feat = hfeature.HybridEP(buf, inner, M, H, K, rails=rails, kernels_of=lambda k: kernels, host=host)
    return feat, inner, rails, log


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    stream = fakes.FakeStream('current')
    monkeypatch.setattr(hfeature.interop, 'current_stream', lambda like=None: stream)
    monkeypatch.setattr(hfeature, '_capturing', lambda like: False)
    monkeypatch.setattr(hfeature, 'EventHandle', lambda *a: 'event')
    monkeypatch.setattr(hfeature, 'EventOverlap', lambda event: event)


def inputs(T=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((T, H), generator=gen).to(torch.bfloat16)
    topk = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return x, topk, torch.rand((T, K), generator=gen)


def test_cpu_sync_dispatch_then_combine():
    send, recv = [2, 0, 4], [3, 0, 1]       # own domain (1) ignored
    feat, inner, rails, log = make(rank=3, counts=(send, recv))
    x, topk, w = inputs()
    out = feat.dispatch(x, topk, w, num_experts=E)
    names = [c.name.split('<')[0] for c in log]
    assert names == ['deepep::hybrid_route', 'deepep::hybrid_pack', 'deepep::hybrid_report',
                     'deepep::hybrid_unpack', 'deepep::hybrid_unpack']
    assert [c.args['mode'] for c in log[3:]] == [0, 1]
    row = hplan.dispatch_row_bytes(K, 0, 2 * H)
    notify, dispatch = rails.plans
    assert notify.phase == 'notify' and all(op.num_bytes == 16 for op in notify.ops)
    sizes = {(op.peer, op.kind): op.num_bytes for op in dispatch.ops}
    assert sizes == {(0, 'send'): 16 + 2 * row, (0, 'recv'): 16 + 3 * row, (2, 'send'): 16 + 4 * row,
                     (2, 'recv'): 16 + 1 * row}
    kind, ux, ut, uw, num_experts, m, rest = inner.calls[0]
    assert ux.shape == (N * M, H) and ut.shape == (N * M, K) and num_experts == E // N and m == N * M
    h = out[3]
    assert isinstance(h, HybridHandle) and h.send_counts == {0: 2, 2: 4} and h.recv_counts == {0: 3, 2: 1}
    assert torch.equal(h.topk_idx, topk) and h.topk_idx.data_ptr() != topk.data_ptr()     # do_handle_copy
    assert h.num_tokens == 6 and h.num_experts == E and h.num_max_tokens_per_rank == M
    # metadata column 0: (r * N * M + s * M + t) -> (s * R + r) * M + t
    assert h.recv_src_metadata[:, 0].tolist() == [(1 * R + 0) * M + 3, (0 * R + 1) * M + 2]
    assert h.num_recv_tokens == 5          # from the intranode handle

    h.inner.m = M
    log.clear()
    bias = torch.zeros((6, H), dtype=torch.bfloat16)
    cx, cw, event = feat.combine(torch.zeros((5, H), dtype=torch.bfloat16), h, topk_weights=torch.zeros((5, K)),
                                 bias=(bias, bias), async_with_compute_stream=True)
    assert [c.name.split('<')[0] for c in log] == ['deepep::hybrid_combine_pack', 'deepep::hybrid_combine_final']
    assert log[1].args['num_bias'] == 2 and event == 'event'
    assert inner.calls[-1][4] is None       # biases only at the origin's final reduction
    crow = hplan.combine_row_bytes(H, K)
    sizes = {(op.peer, op.kind): op.num_bytes for op in rails.plans[-1].ops}
    # the reverse of the dispatch: send back what came in, receive what went out
    assert sizes == {(0, 'send'): 16 + 3 * crow, (0, 'recv'): 16 + 2 * crow, (2, 'send'): 16 + 1 * crow,
                     (2, 'recv'): 16 + 4 * crow}
    assert cx.shape == (6, H) and cw.shape == (6, K)


def test_no_sync_and_cached_dispatch_use_static_exchanges():
    feat, inner, rails, log = make(rank=0)
    x, topk, w = inputs(T=M)
    out = feat.dispatch(x, topk, w, num_experts=E, do_cpu_sync=False)
    assert 'deepep::hybrid_report' not in [c.name for c in log]
    row = hplan.dispatch_row_bytes(K, 0, 2 * H)
    assert [p.phase for p in rails.plans] == ['dispatch']
    assert {op.num_bytes for op in rails.plans[0].ops} == {16 + M * row}
    h = out[3]
    assert h.send_counts is None
    cached = feat.dispatch(x, handle=h, topk_weights=w)
    assert inner.calls[-1][2] is None and cached[3].topk_idx is h.topk_idx
    assert [p.phase for p in rails.plans] == ['dispatch', 'dispatch']
    h.inner.m = M
    feat.combine(torch.zeros((5, H), dtype=torch.bfloat16), h)
    crow = hplan.combine_row_bytes(H, K)
    assert {op.num_bytes for op in rails.plans[-1].ops} == {16 + M * crow}


def test_fp8_dispatch_carries_scales():
    feat, inner, rails, log = make(rank=1, counts=([0, 1, 1], [0, 1, 1]))
    x, topk, w = inputs()
    sf = torch.rand((H // 32, 6)).t()       # column-major scales, 2 per token
    feat.dispatch((x.view(torch.uint8)[:, :H].contiguous().view(torch.float8_e4m3fn), sf), topk, w, num_experts=E)
    pack = log[1].args
    assert pack['num_sf'] == 2 and pack['sf_stride_token'] == 1 and pack['sf_stride_col'] == 6
    assert pack['hidden_bytes'] == H
    ux, usf = inner.calls[0][1]
    assert usf.shape == (N * M, 2) and ux.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize('what,exc,call', [
    ('x float32', TypeError, lambda f, x, t, w: f.dispatch(x.float(), t, w, num_experts=E)),
    ('strided x', ValueError, lambda f, x, t, w: f.dispatch(x[:, ::2], t, w, num_experts=E)),
    ('topk int32', TypeError, lambda f, x, t, w: f.dispatch(x, t.int(), w, num_experts=E)),
    ('topk too large', ValueError, lambda f, x, t, w: f.dispatch(x, torch.full_like(t, E), w, num_experts=E)),
    ('topk below -1', ValueError, lambda f, x, t, w: f.dispatch(x, torch.full_like(t, -2), w, num_experts=E)),
    ('weights shape', ValueError, lambda f, x, t, w: f.dispatch(x, t, w[:, :2], num_experts=E)),
    ('E not a multiple', ValueError, lambda f, x, t, w: f.dispatch(x, t, w, num_experts=E + 1)),
    ('E missing', ValueError, lambda f, x, t, w: f.dispatch(x, t, w)),
    ('too many tokens', ValueError, lambda f, x, t, w: f.dispatch(x, t, w, num_experts=E, num_max_tokens_per_rank=2)),
    ('prev event', ValueError, lambda f, x, t, w: f.dispatch(x, t, w, num_experts=E, previous_event=object())),
    ('combine handle type', TypeError, lambda f, x, t, w: f.combine(x, (1, 2))),
])
def test_invalid_arguments_raise_before_any_launch(what, exc, call):
    feat, inner, rails, log = make(rank=2, counts=([0, 0, 0], [0, 0, 0]))
    x, topk, w = inputs()
    with pytest.raises(exc):
        call(feat, x, topk, w)
    assert log == [] and rails.plans == [] and inner.calls == []


def test_notify_wait_is_bounded_and_names_the_rail_peer():
    feat, inner, rails, log = make(rank=4, report=False)
    x, topk, w = inputs()
    with pytest.raises(TimeoutError, match=r'hybrid notify: rail peer rank 0 \(domain 0'):
        feat.dispatch(x, topk, w, num_experts=E)
    assert rails.transport.aborted and feat._buf._failed


def test_barrier_goes_along_the_rails():
    feat, inner, rails, log = make(rank=0, counts=([0] * N, [0] * N))
    feat._buf._rail_barrier(fakes.FakeStream())
    assert rails.plans == ['barrier']
    assert np.array_equal(feat._host_words, np.zeros(1 + 2 * N, dtype=np.int32))


def test_kernel_signals_name_global_peers_and_the_exchange():
    log = []
    k = SimpleNamespace(epoch_begin=fakes.RecordingKernel(hkernels.epoch_begin_spec(), log),
                        signal=fakes.RecordingKernel(hkernels.signal_spec(), log),
                        wait=fakes.RecordingKernel(hkernels.wait_spec(), log))
    rails = rail_topology(4 * 2, 2, 5)          # domain 2, scale-up index 1: rail ranks 1, 3, 5, 7
    sig = hkernels.KernelSignals(k, 0x9000, 5, rails.rail_ranks, 0x100, 0x200, 7)
    stream = fakes.FakeStream()
    sig.begin(stream)
    sig.signal([0x10, 0x20, 0x30], stream)
    sig.wait([0x40, 0x50], [0, 3], 'rail combine', stream)
    begin, signal, wait = log
    assert begin.args['epoch'] == 0x9000 and signal.args['num'] == 3 and signal.args['a2'] == 0x30
    assert signal.args['a3'] == 0 and wait.args['num'] == 2
    assert (wait.args['p0'], wait.args['p1'], wait.args['aux'], wait.args['rank']) == (1, 7, 3, 5)
    assert (wait.args['claim'], wait.args['error_record'], wait.args['timeout_ns']) == (0x100, 0x200, 7)
    with pytest.raises(ValueError, match='at most 8'):
        sig.signal(list(range(9)), stream)


def test_timeout_record_of_a_rail_wait_names_global_ranks():
    from deepep_cupy.runtime import errors
    rec = np.array([1, errors.PHASE_HYBRID_RAIL, 5, 7, 3, 2, 1, 0], dtype=np.int32)
    assert 'hybrid rail exchange (notify): rank 5 waited for rank 7' in errors.describe(rec, rank_base=4)
    rec[1] = 4          # an intranode phase: scale-up indices, shifted to global ranks
    assert 'dispatch: rank 9 waited for rank 11' in errors.describe(rec, rank_base=4)
    with pytest.raises(TimeoutError, match='rank 9 waited for rank 11'):
        errors.raise_if_timed_out(rec, 3.0, 9, rank_base=4)


def test_previous_event_reaches_the_intranode_engine_after_the_union(monkeypatch):
    """With `previous_event` the intranode engine's stream waits for that event alone, so the union the current
    stream builds must be covered by an event recorded after it (found on the GPU: a race in psum per source)."""
    recorded = []
    monkeypatch.setattr(hfeature, 'EventHandle', lambda *a: recorded.append(len(log)) or f'after-{len(log)}')
    feat, inner, rails, log = make(rank=0)
    waited = []
    user_event = SimpleNamespace(stream_wait=lambda stream: waited.append(stream))
    monkeypatch.setattr(hfeature, 'as_event_handle', lambda e: e)
    x, topk, w = inputs()
    feat.dispatch(x, topk, w, num_experts=E, do_cpu_sync=False, previous_event=user_event,
                  allocate_on_comm_stream=True)
    unpacks = [i for i, c in enumerate(log) if c.name.startswith('deepep::hybrid_unpack')]
    assert waited and recorded == [unpacks[-1] + 1]
    passed = inner.calls[0][6]['previous_event']
    assert passed == f'after-{unpacks[-1] + 1}' and passed is not user_event


def test_derived_num_bytes_one_domain_and_missing_sizes():
    from deepep_cupy.buffers import hybrid as bhybrid
    calls = []

    def hint(*args):
        calls.append(args)
        return 6 << 20
    one = SimpleNamespace(size=1)
    assert bhybrid.derived_num_bytes(hint, one, None, 128, 1024, 8, True, True, True) == 6 << 20
    assert calls == [(one, 128, 1024, 8, True, True, True)]
    with pytest.raises(ValueError, match='num_max_tokens_per_rank and hidden'):
        bhybrid.derived_num_bytes(hint, one, None, 0, 1024, 8, False, True, True)
