"""Hybrid P2, the pipelined dispatch (DEEPEP_CUPY_HYBRID_PIPELINE), without a GPU: the split rows and the chunked
payload plan (every chunk matched on both ends, the counts, the rows-ready invariant the intranode guard relies on),
the NCCL calls and the loopback copies of a pipelined exchange with the per-chunk hook, the feature's call sequence
(CPU sync, no sync, cached: kernels, exchanges, the side stream, the readiness guard handed to the intranode engine),
and the guard's arguments in the intranode dispatch launches (features/ep/bound.py). The kernels' compilation for
sm_90: tests/test_jit.py (slow) and the slow test below."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import fakes  # noqa: E402
import test_hybrid_feature_cpu as hf  # noqa: E402
from test_rails_cpu import FakeRailNccl  # noqa: E402

from deepep_cupy.features.hybrid import feature as hfeature  # noqa: E402
from deepep_cupy.features.hybrid import kernels as hkernels  # noqa: E402
from deepep_cupy.features.hybrid import plan as hplan  # noqa: E402
from deepep_cupy.runtime import rail_nccl, rails  # noqa: E402


# ---- split rows and chunk plans --------------------------------------------------------------------------------------
def test_split_rows_fit_the_area_for_every_format():
    for hidden in (64, 2048, 7168):
        for K in (1, 4, 8, 32):
            area = hplan.rail_area(2, 16, hidden, K)
            for num_sf, hidden_bytes in ((0, 2 * hidden), (hidden // 128 or 1, hidden), (hidden // 32, hidden)):
                if 4 * num_sf > 4 * -(-hidden // hplan.SF_GROUP) * 4:
                    continue
                rows = hplan.split_rows(area, 16, K, min(num_sf, -(-hidden // hplan.SF_GROUP)), hidden_bytes)
                assert rows.meta_bytes + rows.payload_bytes == hplan.dispatch_row_bytes(
                    K, min(num_sf, -(-hidden // hplan.SF_GROUP)), hidden_bytes)
                assert rows.payload_offset % 16 == 0 and rows.region_bytes <= area.region_bytes
    assert hplan.meta_row_bytes(8) == 16 + 64 + 32 and hplan.payload_row_bytes(56, 7168) == 224 + 7168
    with pytest.raises(ValueError, match='split rows'):
        hplan.split_rows(hplan.rail_area(2, 16, 64, 4), 32, 4, 0, 128)


def test_chunk_rows():
    pb = hplan.payload_row_bytes(0, 2 * 7168)           # 14336 bytes: 74 rows make 1 MiB
    assert hplan.pipeline_chunk_rows(4096, pb) == 512    # 8 chunks of 7 MiB
    assert hplan.pipeline_chunk_rows(512, pb) == 74      # 7 chunks of >= 1 MiB
    assert hplan.pipeline_chunk_rows(64, pb) == 64       # one chunk
    assert hplan.pipeline_chunk_rows(4096, pb, 100) == 100 and hplan.pipeline_chunk_rows(8, pb, 100) == 8
    for M in (1, 7, 128, 4096):
        for pb in (16, 1024, 14336):
            rows = hplan.pipeline_chunk_rows(M, pb)
            assert 1 <= rows <= M and -(-M // rows) <= hplan.PIPELINE_MAX_CHUNKS
    with pytest.raises(ValueError, match='PIPELINE_ROWS'):
        hplan.pipeline_chunk_rows(8, 16, -1)
    assert [hplan.rows_ready_after(c, 3, 8) for c in range(3)] == [3, 6, 8]


@pytest.mark.parametrize('N', [2, 3, 4])
@pytest.mark.parametrize('exact', [False, True])
def test_payload_plans_match_on_both_ends(N, exact):
    M, K, H = 10, 4, 64
    area = hplan.rail_area(N, M, H, K)
    rows = hplan.split_rows(area, M, K, 0, 2 * H)
    rng = np.random.default_rng(N)
    counts = rng.integers(0, M + 1, size=(N, N))       # counts[a][b]: rows a sends to b
    chunk = 3
    plans = []
    for n in range(N):
        top = rails.rail_topology(N, 1, n)
        send = {m: int(counts[n][m]) for m in top.peer_domains} if exact else None
        recv = {m: int(counts[m][n]) for m in top.peer_domains} if exact else None
        plans.append(hplan.payload_plan(top, area, rows, send, recv, chunk))
    assert {p.num_chunks for p in plans} == {-(-M // chunk)}
    for a in range(N):
        for b in range(N):
            if a == b:
                continue
            sends = [op for op in plans[a].ops if op.kind == 'send' and op.peer == b]
            recvs = [op for op in plans[b].ops if op.kind == 'recv' and op.peer == a]
            assert [(op.chunk, op.num_bytes, op.offset, op.peer_offset) for op in sends] == \
                [(op.chunk, op.num_bytes, op.peer_offset, op.offset) for op in recvs]
            total = counts[a][b] if exact else M
            assert sum(op.num_bytes for op in sends) == total * rows.payload_bytes
            # chunk c holds rows [c * chunk, ...): payload row p of a's region for b
            for op in sends:
                first = (op.offset - area.send_region(a, b) - rows.payload_offset) // rows.payload_bytes
                assert first == op.chunk * chunk and op.num_bytes % rows.payload_bytes == 0
    # send before recv per peer, peers ascending, inside each chunk
    for p in plans:
        for c in range(p.num_chunks):
            keys = [(op.peer, op.kind != 'send') for op in p.chunk_ops(c)]
            assert keys == sorted(keys)


def test_rows_ready_invariant_against_the_routing():
    """The guard waits for `t % M + 1` rows ready: after chunk c every union row (s, t) with t below
    `rows_ready_after(c)` must have landed, i.e. its rail position p (the count of s's earlier tokens to this domain,
    as hybrid_route numbers them) is in a chunk <= c."""
    rng = np.random.default_rng(5)
    for _ in range(50):
        M = int(rng.integers(1, 40))
        T = int(rng.integers(0, M + 1))
        goes = rng.random(T) < rng.random()
        pos = np.cumsum(goes) - goes                       # position among the tokens that go
        chunk = int(rng.integers(1, M + 1))
        for c in range(-(-M // chunk)):
            ready = hplan.rows_ready_after(c, chunk, M)
            landed = min((c + 1) * chunk, int(goes.sum()))
            for t in range(min(ready, T)):
                if goes[t]:
                    assert pos[t] < landed
        assert hplan.rows_ready_after(-(-M // chunk) - 1, chunk, M) == M


def test_payload_plan_rejects_bad_counts():
    area = hplan.rail_area(3, 8, 64, 4)
    rows = hplan.split_rows(area, 8, 4, 0, 128)
    top = rails.rail_topology(3, 1, 1)
    with pytest.raises(ValueError, match='every peer'):
        hplan.payload_plan(top, area, rows, {0: 1}, None, 4)
    with pytest.raises(ValueError, match='out of range'):
        hplan.payload_plan(top, area, rows, {0: 1, 2: 9}, None, 4)
    with pytest.raises(ValueError, match='chunk_rows'):
        hplan.payload_plan(top, area, rows, None, None, 0)


# ---- transports with the per-chunk hook ------------------------------------------------------------------------------
@pytest.mark.parametrize('exact', [False, True])
def test_nccl_pipelined_exchange_moves_the_split_rows(exact):
    """Metadata exchange, then the chunked payload with a hook after every chunk's group, on every member of a rail of
    3 domains: the calls match as NCCL needs (fake communicators), and the receive regions then hold exactly what the
    peers packed (headers, metadata rows, payload rows)."""
    N, M, K, H = 3, 7, 4, 64
    area = hplan.rail_area(N, M, H, K)
    rows = hplan.split_rows(area, M, K, 0, 2 * H)
    rng = np.random.default_rng(1)
    counts = rng.integers(0, M + 1, size=(N, N))
    bufs = [np.zeros(area.total_bytes, dtype=np.uint8) for _ in range(N)]
    for n in range(N):                                   # send regions: random bytes (header: the count)
        for m in range(N):
            if m != n:
                at = area.send_region(n, m)
                bufs[n][at:at + area.region_bytes] = rng.integers(0, 256, area.region_bytes, dtype=np.uint8)
                bufs[n][at:at + 4] = np.frombuffer(np.int32(counts[n][m]).tobytes(), dtype=np.uint8)
    fake = FakeRailNccl(N)
    hooks = {n: [] for n in range(N)}
    stream = SimpleNamespace(ptr=0x77)
    for n in range(N):
        top = rails.rail_topology(N, 1, n)
        module, comm = fake.member(n)
        t = rail_nccl.NcclRailTransport(top, bufs[n].ctypes.data, comm, nccl=module)
        send = {m: int(counts[n][m]) for m in top.peer_domains} if exact else None
        recv = {m: int(counts[m][n]) for m in top.peer_domains} if exact else None
        meta = rails.plan_exchange(top, area, 'dispatch', hplan.payloads(top.peer_domains, send, M, rows.meta_bytes),
                                   hplan.payloads(top.peer_domains, recv, M, rows.meta_bytes))
        t.exchange(meta, stream)
        t.after_chunk = lambda c, s, n=n: hooks[n].append((c, s.ptr, len(fake.calls[n])))
        t.exchange(hplan.payload_plan(top, area, rows, send, recv, 3), stream)
        t.after_chunk = None
    groups = fake.run()
    assert groups == 1 + 3                               # the metadata group + ceil(7 / 3) payload chunks
    for n in range(N):
        assert [h[:2] for h in hooks[n]] == [(c, 0x77) for c in range(3)]
        ends = [i for i, call in enumerate(fake.calls[n]) if call[0] == 'end']
        assert [h[2] for h in hooks[n]] == [e + 1 for e in ends[1:]]      # each hook right after its group
        for m in range(N):
            if m == n:
                continue
            c = counts[m][n] if exact else M
            src, dst = bufs[m][area.send_region(m, n):], bufs[n][area.recv_region(n, m):]
            head = rails.HEADER_BYTES + c * rows.meta_bytes
            assert np.array_equal(src[:head], dst[:head])
            lo, hi = rows.payload_offset, rows.payload_offset + c * rows.payload_bytes
            assert np.array_equal(src[lo:hi], dst[lo:hi])


def test_loopback_calls_the_hook_after_each_chunks_copies():
    log = []
    top = rails.rail_topology(3, 1, 1)
    signals = SimpleNamespace(begin=lambda s: log.append('begin'), signal=lambda a, s: log.append('signal'),
                              wait=lambda a, p, phase, s: log.append(('wait', tuple(p), phase)))
    t = rails.IpcLoopbackTransport(top, [0x1000_0000, 0x2000_0000, 0x3000_0000], 0, signals,
                                   memcpy=lambda d, s, n, st: log.append(('copy', d, s, n)))
    t.after_chunk = lambda c, s: log.append(('hook', c))
    area = hplan.rail_area(3, 8, 64, 4)
    rows = hplan.split_rows(area, 8, 4, 0, 128)
    t.exchange(hplan.payload_plan(top, area, rows, {0: 8, 2: 3}, {0: 5, 2: 0}, 4), SimpleNamespace(ptr=1))
    kinds = [e if isinstance(e, str) else e[0] + (str(e[1]) if e[0] == 'hook' else '') for e in log]
    assert kinds == ['begin', 'signal', 'wait', 'copy', 'hook0', 'copy', 'hook1', 'signal', 'wait']
    copies = [e for e in log if e[0] == 'copy']
    assert [c[3] for c in copies] == [4 * rows.payload_bytes, 1 * rows.payload_bytes]
    assert copies[1][1] - copies[0][1] == 4 * rows.payload_bytes



def test_rails_exchange_sets_the_chunk_hook_for_one_exchange_only():
    """`HybridRails.exchange(plan, stream, after_chunk)`: the transport holds the hook during that exchange only, also
    when the exchange raises; without a hook the transport's is left as it is (None)."""
    seen = []

    class Transport:
        after_chunk = None

        def exchange(self, plan, stream):
            seen.append(self.after_chunk)
            if plan == 'bad':
                raise RuntimeError('rail failed')

    rails_ = object.__new__(hfeature.HybridRails)
    rails_.transport = t = Transport()
    hook = lambda c, s: None  # noqa: E731
    rails_.exchange('plan', 'stream', after_chunk=hook)
    assert seen == [hook] and t.after_chunk is None
    rails_.exchange('plan', 'stream')
    assert seen == [hook, None] and t.after_chunk is None
    with pytest.raises(RuntimeError, match='rail failed'):
        rails_.exchange('bad', 'stream', after_chunk=hook)
    assert seen[-1] is hook and t.after_chunk is None

# ---- the feature's call sequence -------------------------------------------------------------------------------------
class HookRails(hf.FakeRails):
    """FakeRails whose exchanges call the per-chunk hook after each chunk, as `HybridRails.exchange` has both
    transports do."""

    def exchange(self, plan, stream, after_chunk=None):
        self.plans.append((plan, stream))
        for c in range(plan.num_chunks):
            if after_chunk is not None:
                after_chunk(c, stream)


class GuardInner(hf.FakeInner):
    def __init__(self):
        super().__init__()
        self.ready_guard = None
        self.guards = []

    def dispatch(self, *args, **kwargs):
        self.guards.append(self.ready_guard)
        return super().dispatch(*args, **kwargs)


def make_pipelined(monkeypatch, rank=3, counts=None, rows=0):
    stream = fakes.FakeStream('current')          # as test_hybrid_feature_cpu's no_cuda fixture
    monkeypatch.setattr(hfeature.interop, 'current_stream', lambda like=None: stream)
    monkeypatch.setattr(hfeature, '_capturing', lambda like: False)
    monkeypatch.setattr(hfeature, 'EventHandle', lambda *a: 'event')
    monkeypatch.setattr(hfeature, 'EventOverlap', lambda event: event)
    monkeypatch.setenv('DEEPEP_CUPY_HYBRID_PIPELINE', '1')
    if rows:
        monkeypatch.setenv('DEEPEP_CUPY_HYBRID_PIPELINE_ROWS', str(rows))
    log = []
    host = fakes.FakeHostMapped()

    def run_report(args):
        words = host.view('int32', 1 + 2 * hf.N)
        send, recv = counts
        words[1:1 + hf.N], words[1 + hf.N:1 + 2 * hf.N] = send, recv
        words[0] = args['seq']

    specs = (('route', hkernels.route_spec(4)), ('pack', hkernels.pack_spec(4)), ('report', hkernels.report_spec()),
             ('unpack', hkernels.unpack_spec(4)), ('combine_pack', hkernels.combine_pack_spec()),
             ('combine_final', hkernels.combine_final_spec(4)), ('pack_split', hkernels.pack_split_spec(4)),
             ('unpack_meta', hkernels.unpack_meta_spec(4)), ('unpack_payload', hkernels.unpack_payload_spec()),
             ('ready', hkernels.ready_spec()))
    kernels = SimpleNamespace(**{name: fakes.RecordingKernel(spec, log, run_report if name == 'report' else None)
                                 for name, spec in specs})
    buf = fakes.make_buffer(num_ranks=hf.N * hf.R, rank=rank, num_scaleup_ranks=hf.R, num_scaleout_ranks=hf.N,
                            scaleup_rank_idx=rank % hf.R, scaleout_rank_idx=rank // hf.R, num_cpu_timeout_secs=0.3)
    inner, rails_ = GuardInner(), HookRails(rank)
    feat = hfeature.HybridEP(buf, inner, hf.M, hf.H, hf.K, rails=rails_, kernels_of=lambda k: kernels, host=host)
    side = fakes.FakeStream('side')
    feat._side = side
    joins = []
    monkeypatch.setattr(hfeature, '_stream_after', lambda waiting, done: (joins.append((waiting.name, done.name)),
                                                                           log.append(('join', waiting.name))))
    return feat, inner, rails_, log, joins


def _names(log):
    return [c[0] + ':' + c[1] if isinstance(c, tuple) else c.name.split('<')[0].replace('deepep::hybrid_', '')
            for c in log]


def test_pipelined_cpu_sync_dispatch(monkeypatch):
    send, recv = [2, 0, 4], [3, 0, 1]
    feat, inner, rails_, log, joins = make_pipelined(monkeypatch, rank=3, counts=(send, recv), rows=3)
    x, topk, w = hf.inputs()
    out = feat.dispatch(x, topk, w, num_experts=hf.E)
    chunks = -(-hf.M // 3)
    assert _names(log) == (['route', 'pack_split', 'report', 'unpack', 'unpack_meta', 'join:side'] +
                           ['unpack_payload', 'ready'] * chunks + ['join:current'])
    assert joins == [('side', 'current'), ('current', 'side')]
    K, M, N, H = hf.K, hf.M, hf.N, hf.H
    meta_b, pay_b = hplan.meta_row_bytes(K), hplan.payload_row_bytes(0, 2 * H)
    (notify, s0), (meta, s1), (payload, s2) = rails_.plans
    assert notify.phase == 'notify' and (s0.name, s1.name, s2.name) == ('current', 'current', 'side')
    assert {(op.peer, op.kind): op.num_bytes for op in meta.ops} == {
        (0, 'send'): 16 + 2 * meta_b, (0, 'recv'): 16 + 3 * meta_b, (2, 'send'): 16 + 4 * meta_b,
        (2, 'recv'): 16 + 1 * meta_b}
    assert payload.num_chunks == chunks
    moved = {}
    for op in payload.ops:
        moved[(op.peer, op.kind)] = moved.get((op.peer, op.kind), 0) + op.num_bytes
    assert moved == {(0, 'send'): 2 * pay_b, (0, 'recv'): 3 * pay_b, (2, 'send'): 4 * pay_b, (2, 'recv'): 1 * pay_b}
    unpacks = [c for c in log if not isinstance(c, tuple) and c.name == 'deepep::hybrid_unpack_payload']
    readies = [c for c in log if not isinstance(c, tuple) and c.name == 'deepep::hybrid_ready']
    assert [(u.args['row_begin'], u.args['row_end'], u.grid) for u in unpacks] == [
        (0, 3, N * 3), (3, 6, N * 3), (6, 8, N * 2)]
    assert [r.args['value'] for r in readies] == [3, 6, 8]
    meta_k = next(c for c in log if not isinstance(c, tuple) and c.name.startswith('deepep::hybrid_unpack_meta'))
    ready_ptr = meta_k.args['ready']
    assert {r.args['ready'] for r in readies} == {ready_ptr}
    assert inner.guards == [(ready_ptr, M, hplan.PIPELINE_FREE_SMS)] and inner.ready_guard is None
    assert [c.args['mode'] for c in log if not isinstance(c, tuple) and c.name.startswith(
        'deepep::hybrid_unpack<')] == [0]
    h = out[3]
    assert h.send_counts == {0: 2, 2: 4} and h.recv_counts == {0: 3, 2: 1}
    assert h.fwd_src.shape[0] == N * M and h.fwd_count.shape[0] == N


def test_pipelined_no_sync_and_cached_are_static(monkeypatch):
    feat, inner, rails_, log, joins = make_pipelined(monkeypatch, rank=0)
    x, topk, w = hf.inputs(T=hf.M)
    out = feat.dispatch(x, topk, w, num_experts=hf.E, do_cpu_sync=False)
    assert 'report' not in _names(log)
    meta_b, pay_b = hplan.meta_row_bytes(hf.K), hplan.payload_row_bytes(0, 2 * hf.H)
    (meta, _), (payload, side) = rails_.plans
    assert {op.num_bytes for op in meta.ops} == {16 + hf.M * meta_b} and side.name == 'side'
    rows = hplan.pipeline_chunk_rows(hf.M, pay_b)
    assert payload.num_chunks == -(-hf.M // rows)
    assert sum(op.num_bytes for op in payload.ops if op.kind == 'send') == (hf.N - 1) * hf.M * pay_b
    log.clear()
    feat.dispatch(x, handle=out[3], topk_weights=w)
    assert inner.calls[-1][2] is None and len(inner.guards) == 2 and inner.guards[1][1] == hf.M
    assert 'join:side' in _names(log) and _names(log)[-1] == 'join:current'
    # switched off per call (the perf script compares both in one run): P1's kernels and one whole-row exchange
    feat.pipeline = False
    log.clear()
    rails_.plans.clear()
    feat.dispatch(x, topk, w, num_experts=hf.E, do_cpu_sync=False)
    assert _names(log) == ['route', 'pack', 'unpack', 'unpack'] and inner.guards[-1] is None
    assert len(rails_.plans) == 1


def test_pipeline_refuses_the_fused_intranode_kernel(monkeypatch):
    monkeypatch.setenv('DEEPEP_CUPY_HYBRID_PIPELINE', '1')
    buf = fakes.make_buffer(num_ranks=hf.N * hf.R, rank=0, num_scaleup_ranks=hf.R, num_scaleout_ranks=hf.N,
                            scaleup_rank_idx=0, scaleout_rank_idx=0)
    inner = hf.FakeInner()
    inner.fused_notify = True
    with pytest.raises(ValueError, match='FUSED_NOTIFY'):
        hfeature.HybridEP(buf, inner, hf.M, hf.H, hf.K, rails=hf.FakeRails(0), kernels_of=lambda k: None,
                          host=fakes.FakeHostMapped())


# ---- the guard in the intranode dispatch launches --------------------------------------------------------------------
@pytest.mark.parametrize('cpu_sync', [False, True])
def test_intranode_dispatch_takes_the_guard(monkeypatch, cpu_sync):
    import test_ep_checks_cpu as ep_tests
    for k in ('DEEPEP_CUPY_EP_FUSED_NOTIFY', 'DEEPEP_CUPY_EP_DISPATCH_OVERLAP'):
        monkeypatch.delenv(k, raising=False)
    buf = ep_tests.make_buffer(monkeypatch)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ep_tests.M, ep_tests.H, generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand(ep_tests.M, ep_tests.E, generator=g), ep_tests.K).indices
    kw = dict(num_experts=ep_tests.E, num_sms=4, do_cpu_sync=cpu_sync)
    dispatches = lambda: [c for c in buf.launches if 'dispatch_impl' in c.name]     # noqa: E731
    buf.dispatch(x, idx, None, **kw)
    plain = dispatches()
    assert plain and all(c.args['ready'] == 0 and c.args['ready_mod'] == 0 for c in plain)
    ep = buf._ep_feature()
    buf.launches.clear()
    ep.ready_guard = (0xABC0, 37, 127)
    buf.dispatch(x, idx, None, **kw)
    guarded = dispatches()
    assert all(c.args['ready'] == 0xABC0 and c.args['ready_mod'] == 37 for c in guarded)
    # the receive grid leaves the guard's SMs free (the senders of a one-launch dispatch stay)
    extra = 0 if cpu_sync else 4
    assert guarded[-1].grid == extra + min(plain[-1].grid - extra, 132 - extra - 127) < plain[-1].grid
    ep.ready_guard = (0xABC0, 37, 132 - extra)
    buf.launches.clear()
    with pytest.raises(ValueError, match='SMs free'):
        buf.dispatch(x, idx, None, **kw)
    assert buf.launches == []                           # refused before any launch
    ep.ready_guard = None
    buf.launches.clear()
    buf.dispatch(x, idx, None, **kw)                    # the bound call forgets the guard
    assert all(c.args['ready'] == 0 and c.args['ready_mod'] == 0 for c in dispatches())


@pytest.mark.slow
def test_pipeline_kernels_compile_for_sm90():
    from deepep_cupy.features.ep import kernels as ep_kernels
    from deepep_cupy.jit import compiler
    names = [s.name for b in (1, 8, 32) for s in (hkernels.pack_split_spec(b), hkernels.unpack_meta_spec(b))]
    names += [hkernels.unpack_payload_spec().name, hkernels.ready_spec().name]
    module = compiler.compile_cubin('hybrid', names, arch='90', use_cache=False)
    assert module.cubin[:4] == b'\x7fELF' and sorted(module.lowered) == sorted(names)
    names = [ep_kernels.dispatch_spec(r, b).name for r in (1, 2, 4, 8) for b in (8, 32)]
    module = compiler.compile_cubin('ep_dispatch', names, arch='90', use_cache=False)
    assert module.cubin[:4] == b'\x7fELF' and sorted(module.lowered) == sorted(names)


def test_guard_timeout_record_says_what_waited():
    from deepep_cupy.runtime import errors
    rec = np.array([1, 4, 1, 1, 7, 3, errors.AUX_RAIL_READY, 0], dtype=np.int32)
    text = errors.describe(rec, rank_base=2)
    assert 'dispatch (hybrid pipeline: rail rows not ready' in text and 'rank 3 waited for rank 3' in text
    assert 'expected signal 7, last seen 3' in text


def test_perf_script_text_and_arguments():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), '..', 'perf', 'hybrid_pipeline.py')
    spec = importlib.util.spec_from_file_location('hybrid_pipeline', path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.build_parser().parse_args([])
    assert (args.tokens, args.hidden, args.num_topk, args.num_experts) == ([512, 4096], 7168, 8, 256)
    assert mod.build_parser().parse_args(['--tokens', '128,']).tokens == [128]
    assert mod.ratio_text(2e-3, 1e-3) == '0.500' and mod.ratio_text(0.0, 1.0) == 'n/a'
    line = mod.row_text(4096, 'bf16', 'dispatch_sync', {'P1': 1e-3, 'P2': 8e-4})
    assert '1000.0 us' in line and '800.0 us' in line and 'P2/P1 0.800' in line


def test_combine_tokens_ready():
    row = hplan.combine_row_bytes(64, 4)                 # 144 bytes
    step = 3 * row
    # chunk 0 holds the header and rows 0, 1 whole (row 2 ends 16 bytes into chunk 1)
    assert [hplan.combine_tokens_ready(c, step, row, 4, 10) for c in range(4)] == [2, 5, 8, 10]
    assert hplan.combine_tokens_ready(0, step, row, 1, 10) == 10      # one chunk: everything
    assert hplan.combine_tokens_ready(1, step, row, 9, 4) == 4
    rng = np.random.default_rng(2)
    for _ in range(200):
        T = int(rng.integers(1, 30))
        rows = int(rng.integers(1, T + 1))
        n = -(-(16 + T * row) // (rows * row))
        prev = 0
        for c in range(n):
            got = hplan.combine_tokens_ready(c, rows * row, row, n, T)
            assert prev <= got and (c < n - 1 or got == T)
            # every row p < got ends within the bytes of chunks 0..c
            assert got == T and c == n - 1 or 16 + got * row <= (c + 1) * rows * row
            prev = got


def test_pipelined_combine_finishes_tokens_per_chunk(monkeypatch):
    send, recv = [2, 0, 4], [3, 0, 1]
    feat, inner, rails_, log, joins = make_pipelined(monkeypatch, rank=3, counts=(send, recv), rows=2)
    x, topk, w = hf.inputs()
    h = feat.dispatch(x, topk, w, num_experts=hf.E)[3]
    h.inner.m = hf.M
    log.clear()
    joins.clear()
    rails_.plans.clear()
    cx, cw, _ = feat.combine(torch.zeros((5, hf.H), dtype=torch.bfloat16), h, topk_weights=torch.zeros((5, hf.K)))
    (plan, stream), = rails_.plans
    crow = hplan.combine_row_bytes(hf.H, hf.K)
    assert plan.phase == 'combine' and plan.num_chunks == -(-feat.area.region_bytes // (2 * crow))
    finals = [c for c in log if not isinstance(c, tuple) and c.name.startswith('deepep::hybrid_combine_final')]
    spans = [(f.args['token_begin'], f.args['token_begin'] + f.grid) for f in finals]
    T = 6
    assert spans[0][0] == 0 and spans[-1][1] == T and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert spans == [(0, 1), (1, 3), (3, 5), (5, 6)]
    assert all(f.args['num_tokens'] == T for f in finals)
    # each final after an event of the exchange stream, on the side stream; the caller's stream joins at the end
    assert joins == [('side', 'current')] * len(finals) + [('current', 'side')]
    assert [c.name.split('<')[0] for c in log if not isinstance(c, tuple)][0] == 'deepep::hybrid_combine_pack'
    assert cx.shape == (T, hf.H) and cw.shape == (T, hf.K)
    moved = sum(op.num_bytes for op in plan.ops if op.kind == 'recv')
    assert moved == 2 * 16 + (2 + 4) * crow                 # what this rank sent out comes back


def test_pipelined_combine_of_a_rank_without_tokens_issues_the_same_groups(monkeypatch):
    """Rail peers must issue the same NCCL groups: a rank with no tokens cuts its combine exchange like the others."""
    send, recv = [0, 0, 0], [3, 0, 1]
    feat, inner, rails_, log, joins = make_pipelined(monkeypatch, rank=3, counts=(send, recv), rows=2)
    x, topk, w = hf.inputs()
    h = feat.dispatch(x[:0], topk[:0], w[:0], num_experts=hf.E)[3]
    h.inner.m = hf.M
    log.clear()
    rails_.plans.clear()
    cx, _, _ = feat.combine(torch.zeros((5, hf.H), dtype=torch.bfloat16), h)
    (plan, _), = rails_.plans
    crow = hplan.combine_row_bytes(hf.H, hf.K)
    assert plan.num_chunks == -(-feat.area.region_bytes // (2 * crow)) and cx.shape == (0, hf.H)
    assert not [c for c in log if not isinstance(c, tuple) and c.name.startswith('deepep::hybrid_combine_final')]
