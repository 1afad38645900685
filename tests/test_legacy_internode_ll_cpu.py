"""DeepEP V1 low-latency mode across scale-up domains without a GPU (v1/kernels/internode_ll.py):
- the kernels' host mirrors composed with a model of the hybrid dispatch / combine (each pseudo token delivered to
  its expert's owner, in a shuffled order, with the intranode source index the hybrid engine gives; the combine
  handing each pseudo token's one row back) equal the single-domain references (deepep_cupy.tests.ll_reference) on
  every rank, bit for bit: layout_range, recv_count, src_info, the rows' sources and the weighted combine, with
  0-token ranks, -1 slots, repeated experts and masks;
- the argument errors, raised before any engine is built; construction no longer refuses; the size hint across
  domains; the kernel specs against the C++ and an NVRTC compile (slow);
- the mode's host path (fake engine, recording kernels): which kernels run on which stream with and without hooks
  and async_finish, every argument packed with its declared type; with a model of torch's streams (its default
  stream is handle 0, `torch.cuda.ExternalStream(0)` a pool stream), every launch of a local call on the caller's
  stream."""

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import fakes  # noqa: E402

from deepep_cupy.buffers import shipped  # noqa: E402
from deepep_cupy.runtime import interop  # noqa: E402
from deepep_cupy.tests import ll_reference as ref  # noqa: E402
from deepep_cupy.v1 import internode_ll as lli  # noqa: E402
from deepep_cupy.v1.buffer import Buffer  # noqa: E402
from deepep_cupy.v1.kernels import internode  # noqa: E402
from deepep_cupy.v1.kernels import internode_ll as ill  # noqa: E402


# ---- the composition against the single-domain references ---------------------------------------------------------
def _inputs(R, M, H, K, E, seed, zero_rank=1, repeat=False):
    g = torch.Generator().manual_seed(seed)
    xs, topks = [], []
    for r in range(R):
        n = 0 if r == zero_rank else int(torch.randint(1, M + 1, (1,), generator=g))
        x = (torch.randn((n, H), generator=g) * 3).to(torch.bfloat16)
        t = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else \
            torch.zeros((0, K), dtype=torch.int64)
        if n:
            t[torch.rand(t.shape, generator=g) < 0.2] = -1
            if repeat:
                t[0, :] = t[0, 0] if t[0, 0] >= 0 else 0     # one token listing one expert K times
        xs.append(x)
        topks.append(t.to(torch.int64))
    return xs, topks


def _compose(xs, topks, N, S, M, E, masked=()):
    """Every rank's dispatch outputs (layout_range, recv_count, src_info, row sources) from the mirrors and a model of
    the hybrid dispatch; then the rows each owner holds, for the combine."""
    R = N * S
    L, K = E // R, topks[0].shape[1]
    Mc = M * K
    prep = [ill.prepare_host(t.numpy(), E, R, M, masked) for t in topks]
    rng = np.random.default_rng(7)
    received = [[] for _ in range(R)]       # per owner: (local expert, intranode source index, pos, (src, p))
    for g, (ptopk, ppos, _) in enumerate(prep):
        d, lr = divmod(g, S)
        for p, e in enumerate(ptopk.tolist()):
            if e < 0:
                continue
            received[e // L].append((e % L, lr * (N * Mc) + d * Mc + p, float(ppos[p]), (g, p)))
    out = []
    for r in range(R):
        rows = received[r]
        rng.shuffle(rows)
        pad = 3
        topk = np.array([x[0] for x in rows] + [-1] * pad, dtype=np.int64)
        meta0 = np.array([x[1] for x in rows] + [-1] * pad, dtype=np.int64)
        w = np.array([x[2] for x in rows] + [0] * pad, dtype=np.float32)
        layout_range, recv_count, row_of, src_info = ill.receive_host(topk, meta0, w, len(rows), N, S, Mc, K, L, M,
                                                                      masked)
        out.append(SimpleNamespace(rows=rows, layout_range=layout_range, recv_count=recv_count, row_of=row_of,
                                   src_info=src_info))
    return prep, out


@pytest.mark.parametrize('N,S', [(2, 1), (2, 2), (2, 4), (4, 1), (3, 2)])
@pytest.mark.parametrize('masked', [(), (1,)])
def test_mirrors_equal_the_single_domain_references(N, S, masked):
    R, M, H, K = N * S, 6, 256, 3
    E = 2 * R
    L, T = E // R, R * M
    xs, topks = _inputs(R, M, H, K, E, seed=N * 10 + S, repeat=True)
    prep, got = _compose(xs, topks, N, S, M, E, masked)
    weights = [torch.rand(t.shape, generator=torch.Generator().manual_seed(i)) for i, t in enumerate(topks)]
    # the owners' expert outputs: row (j, r) = the token's row times 2^(e % 4 - 2) (a row sent back for the wrong
    # slot changes the result)
    owner_rows = []
    for r in range(R):
        want = ref.dispatch_reference(xs, topks, r, E, M, False, masked=masked)
        g = got[r]
        if r in masked:         # every rank masks it: nothing is sent to it (the reference models a live receiver)
            assert int(g.recv_count.sum()) == 0
            owner_rows.append(None)
            continue
        assert g.layout_range.tolist() == want.layout_range.tolist(), (r, 'layout_range')
        assert g.recv_count.tolist() == want.recv_count.tolist(), (r, 'recv_count')
        y = torch.full((L * T, H), float('nan'), dtype=torch.bfloat16)
        for i, (j, _, _, (src, p)) in enumerate(g.rows):
            row = int(g.row_of[i])
            if row < 0:
                assert src in masked
                continue
            jj, rr = divmod(row, T)
            assert jj == j
            e = want.experts[j]
            assert rr < e.count and int(e.src_rank[rr]) == src and int(e.src_info[rr]) == p // K, (r, j, rr)
            assert int(e.topk_slot[rr]) == p % K and g.src_info[row] == p // K
            factor = ref.expert_factor(torch.tensor([r * L + j]))[0]
            y[row] = (xs[src][p // K].float() * factor).to(torch.bfloat16)
        owner_rows.append(y)
    # combine: gather at the owner, the hybrid combine returns each pseudo token's one row, reduce at the origin
    for g_rank in range(R):
        if g_rank in masked:
            continue
        t_idx, w = topks[g_rank], weights[g_rank]
        n = t_idx.shape[0]
        pseudo_out = np.zeros((n * K, H), dtype=np.float32)
        for r in range(R):
            if r in masked:
                continue
            for i, (_, _, _, (src, p)) in enumerate(got[r].rows):
                if src == g_rank and got[r].row_of[i] >= 0:
                    pseudo_out[p] = owner_rows[r][int(got[r].row_of[i])].float().numpy()
        sums = ill.reduce_host(pseudo_out, t_idx.numpy(), w.numpy(), prep[g_rank][2], E, R, masked)
        combined = torch.from_numpy(sums).to(torch.bfloat16)

        def row_of(e, k, x=xs[g_rank]):
            return (x.float() * ref.expert_factor(e).unsqueeze(1)).to(torch.bfloat16)
        want = ref.combine_reference(t_idx, w, E, R, row_of, masked)
        assert torch.equal(combined.view(torch.int16), want.view(torch.int16)), g_rank


def test_prepare_positions_and_drops():
    topk = np.array([[3, 1], [3, -1], [5, 3], [1, 1]])
    ptopk, ppos, send = ill.prepare_host(topk, 8, 4, 2)        # experts 0..7 on 4 ranks, M = 2
    # expert 3: (0,0) -> 0, (1,0) -> 1, (2,1) -> 2 dropped (>= M); expert 1: (0,1) 0, (3,0) 1, (3,1) 2 dropped
    assert send.tolist() == [[0, 0], [1, -1], [0, -1], [1, -1]]
    assert ptopk.tolist() == [3, 1, 3, -1, 5, -1, 1, -1]
    assert ppos.tolist()[:6] == [0, 0, 1, 0, 0, 2]
    _, _, send = ill.prepare_host(topk, 8, 4, 8, masked=(1,))  # rank 1 owns experts 2, 3
    assert send.tolist() == [[-1, 0], [-1, -1], [0, -1], [1, 2]]


def test_sizes():
    assert ill.pseudo_tokens(128, 8) == 1024
    assert ill.worst_rows(16, 128, 8, 16) == 16 * 128 * 8 and ill.worst_rows(16, 128, 8, 2) == 16 * 128 * 2
    hint = Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=128, hidden=7168, num_ranks=16,
                                                 num_experts=256)
    assert hint > 0 and hint % (2 << 20) == 0
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) > 0      # one domain: as before
    with pytest.raises(ValueError, match='multiple of the number of ranks'):
        Buffer.get_low_latency_rdma_size_hint(128, 7168, 16, 100)


# ---- construction, argument errors ---------------------------------------------------------------------------------
def test_construction_accepts_low_latency_across_domains():
    internode.check_domains(4, 2, 2, True, 8)
    internode.check_domains(16, 2, 8, True, 8)
    with pytest.raises(NotImplementedError, match='normal and low-latency modes across domains'):
        internode.check_domains(17, 17, 1, True, 8)


def _buffer(num_domains=2, num_scaleup=2, enable_shrink=False, make_engine=None):
    def refuse(*args):
        raise AssertionError(f'an engine was built for a call that should have raised first: {args}')
    buf = Buffer.__new__(Buffer)
    buf.__dict__.update(_destroyed=False, group=None, rank=0, group_size=num_domains * num_scaleup,
                        low_latency_mode=True, explicitly_destroy=True, enable_shrink=enable_shrink, device=-1,
                        _stream=None, _ll=None, _normal=None, _internode=None, num_domains=num_domains,
                        num_scaleup_ranks=num_scaleup)
    buf._ll_internode = lli.InternodeLLMode(num_domains, num_scaleup, -1, enable_shrink, make_engine or refuse)
    return buf


def test_argument_errors_before_any_engine():
    buf = _buffer()
    R, M, H, E = 4, 8, 256, 16
    x = torch.zeros(4, H, dtype=torch.bfloat16)
    t = torch.zeros(4, 2, dtype=torch.int64)

    def d(**kw):
        a = dict(x=x, topk_idx=t, num_max_dispatch_tokens_per_rank=M, num_experts=E)
        a.update(kw)
        return buf.low_latency_dispatch(**a)
    cases = [
        (dict(x=x.float()), TypeError, 'x must be bfloat16'),
        (dict(x=x[:, :200]), ValueError, 'multiple of 128'),
        (dict(topk_idx=t[:3]), ValueError, 'topk_idx must be'),
        (dict(topk_idx=t.int()), TypeError, 'topk_idx must be int64'),
        (dict(num_experts=18), ValueError, 'multiple of the number of ranks'),
        (dict(num_max_dispatch_tokens_per_rank=2), ValueError, 'more than num_max_dispatch_tokens_per_rank'),
        (dict(num_max_dispatch_tokens_per_rank=2.0), TypeError, 'must be an int'),
        (dict(use_ue8m0=True), ValueError, 'requires round_scale'),
        (dict(use_ue8m0=True, round_scale=True), ValueError, 'multiple of 512'),
        (dict(async_finish=True, return_recv_hook=True), ValueError, 'mutually exclusive'),
        (dict(use_fp8=1), TypeError, 'use_fp8 must be a bool'),
        (dict(cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32)), ValueError,
         'cumulative_local_expert_recv_stats'),
        (dict(dispatch_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int32)), TypeError,
         'dispatch_wait_recv_cost_stats'),
        (dict(topk_idx=torch.zeros(4, 33, dtype=torch.int64)), ValueError, 'num_topk'),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            d(**kw)
    with pytest.raises(NotImplementedError, match='NVFP4'):
        d(use_nvfp4=True)
    h = ill.InternodeLLHandle(None, None, M, H, E, num_tokens=4, num_topk=2, kind='torch', mode_id=0)
    y = torch.zeros(E // R, R * M, H, dtype=torch.bfloat16)
    w = torch.zeros(4, 2)
    with pytest.raises(TypeError, match='handle must be'):
        buf.low_latency_combine(y, t, w, (1, 2, 3, 4, 5))
    with pytest.raises(NotImplementedError, match='use_logfmt'):
        buf.low_latency_combine(y, t, w, h, use_logfmt=True)
    with pytest.raises(ValueError, match='x must have shape'):
        buf.low_latency_combine(y[:, :3], t, w, h)
    with pytest.raises(TypeError, match='topk_weights must be float32'):
        buf.low_latency_combine(y, t, w.double(), h)
    with pytest.raises(ValueError, match='another buffer'):
        buf.low_latency_combine(y, t, w, h)
    with pytest.raises(RuntimeError, match='enable_shrink'):
        buf.low_latency_update_mask_buffer(1, True)
    with pytest.raises(RuntimeError, match='no low-latency call'):
        buf._ll_internode.require_engine('low_latency_combine')
    buf.clean_low_latency_buffer(M, H, E)       # checked, nothing to clean
    with pytest.raises(ValueError, match='multiple of 128'):
        buf.clean_low_latency_buffer(M, 200, E)
    assert buf._ll_internode.engine is None


# ---- the mode's host path ------------------------------------------------------------------------------------------
class _FakeFeature:
    """The hybrid feature's dispatch / combine, returning arrays of the real shapes (rows = num_worst)."""

    def __init__(self, log):
        self.log = log

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None, num_experts=None,
                 num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0, previous_event=None,
                 previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False,
                 handle=None, do_handle_copy=True, do_cpu_sync=None, do_expand=False, do_zero_padding=False,
                 use_tma_aligned_col_major_sf=False, v1=None):
        Mc, cpu_sync = num_max_tokens_per_rank, do_cpu_sync
        fp8 = isinstance(x, tuple)
        xa = x[0] if fp8 else x
        rows = v1.num_worst
        self.log.append(('hybrid_dispatch', interop.current_stream(), rows, Mc, fp8, cpu_sync))
        rx = torch.zeros((rows, xa.shape[1]), dtype=xa.dtype)
        rx = (rx, torch.zeros((rows, x[1].shape[1]))) if fp8 else rx
        inner = SimpleNamespace(psum_num_recv_tokens_per_scaleup_rank=torch.zeros(4, dtype=torch.int32),
                                recv_src_metadata=torch.zeros((rows, 3), dtype=torch.int32), num_recv_tokens=rows,
                                metadata_owner=None)
        return rx, torch.zeros((rows, 1), dtype=torch.int64), torch.zeros((rows, 1)), SimpleNamespace(inner=inner), \
            None

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None,
                previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False,
                v1=False):
        self.log.append(('hybrid_combine', interop.current_stream(), x.shape[0]))
        return torch.zeros((0, x.shape[1]), dtype=torch.bfloat16), None, None


class _CupyStream(fakes.FakeStream):
    """A CuPy stream stand-in with a chosen raw handle (0: the legacy NULL stream, torch's default stream)."""

    def __init__(self, name: str, ptr: int):
        super().__init__(name)
        self.ptr = ptr

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class _TorchCudaModel:
    """torch.cuda's streams as torch has them (no GPU): the default stream is handle 0, and
    `torch.cuda.ExternalStream(0)` is NOT the default stream but a new stream from torch's pool (THCPStream_pynew: no
    pointer and no id -> getStreamFromPool; pool streams are non-blocking, unordered with the default stream)."""

    def __init__(self, caller: int = 0):
        self.default = SimpleNamespace(cuda_stream=0)
        self.now = self.default if caller == 0 else SimpleNamespace(cuda_stream=caller)
        self.num_pool = 0

    def ExternalStream(self, stream_ptr, device=None):  # noqa: N802 (torch's name)
        if not stream_ptr:
            self.num_pool += 1
            return SimpleNamespace(cuda_stream=0x9000 + self.num_pool)
        return SimpleNamespace(cuda_stream=stream_ptr)

    def current_stream(self, device=None):
        return self.now

    def default_stream(self, device=None):
        return self.default

    @contextlib.contextmanager
    def stream(self, s):
        before, self.now = self.now, s
        try:
            yield
        finally:
            self.now = before

    def install(self, monkeypatch):
        for name in ('ExternalStream', 'current_stream', 'default_stream', 'stream'):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(interop, '_TORCH_STREAMS', {})
        return self


def _fake_mode(monkeypatch, log, enable_shrink=False, torch_model=None):
    """The mode over a fake engine. Default: `_OnStream` replaced by a switch of the fake current stream. With
    `torch_model` (`_TorchCudaModel`): the real `_OnStream` over the model of torch's streams, and
    `interop.current_stream` answering torch's current stream, as on a GPU (a stream nobody named is 'pool')."""
    if torch_model is None:
        current, comm = fakes.FakeStream('current'), fakes.FakeStream('comm')
        streams = {'now': current}
        monkeypatch.setattr(interop, 'current_stream', lambda like=None: streams['now'])

        @contextlib.contextmanager
        def on_stream(kind, stream):
            before, streams['now'] = streams['now'], stream
            try:
                yield
            finally:
                streams['now'] = before
        monkeypatch.setattr(lli, '_OnStream', on_stream)
    else:
        current, comm = _CupyStream('current', torch_model.now.cuda_stream), _CupyStream('comm', 0x7700)
        by_ptr = {current.ptr: current, comm.ptr: comm}

        def current_stream(like=None):
            ptr = torch_model.now.cuda_stream
            return by_ptr.setdefault(ptr, _CupyStream('pool', ptr))
        monkeypatch.setattr(interop, 'current_stream', current_stream)
    monkeypatch.setattr(interop.Allocator, 'empty', lambda self, shape, dtype, stream=None:
                        torch.zeros(shape, dtype=getattr(torch, dtype)))
    monkeypatch.setattr(lli, '_record', lambda kind, stream, tensors: None)
    monkeypatch.setattr(lli, 'EventHandle', fakes.FakeEventHandle)
    monkeypatch.setattr(lli, '_capturing', lambda kind: False)
    kernels = ill.InternodeLLKernels(loaded={s.name: fakes.RecordingKernel(s, log) for s in ill.SPECS})
    engine = SimpleNamespace(ll_kernels=kernels, comm_stream=comm, feature=_FakeFeature(log),
                             check_usable=lambda: None, barrier=lambda **kw: None, destroy=lambda: None)
    built = []

    def make(num_pseudo, hidden):
        built.append((num_pseudo, hidden))
        return engine
    mode = lli.InternodeLLMode(2, 2, -1, enable_shrink, make)
    return mode, current, comm, built


def _names(log):
    return [(e.name.split('::')[-1], e.stream.name) if hasattr(e, 'name') else (e[0], e[1].name) for e in log]


@pytest.mark.parametrize('fp8', [False, True])
def test_host_path_streams_and_hooks(monkeypatch, fp8):
    log = []
    mode, current, comm, built = _fake_mode(monkeypatch, log)
    R, M, H, K, E = 4, 8, 512, 2, 16
    x = torch.zeros(5, H, dtype=torch.bfloat16)
    t = torch.zeros(5, K, dtype=torch.int64)
    w = torch.zeros(5, K)
    # no hook, no async: everything on the current stream
    recv, count, handle, event, hook = mode.dispatch(x, t, M, E, use_fp8=fp8, round_scale=fp8, use_ue8m0=fp8)
    assert built == [(M * K, H)] and hook is None and event.event is None
    assert _names(log) == [('ll_internode_prepare', 'current'), ('hybrid_dispatch', 'current'),
                           ('ll_internode_layout', 'current'), ('ll_internode_scatter', 'current')]
    assert log[1][2] == ill.worst_rows(R, M, K, E // R) and log[1][3] == M * K and log[1][5] is False
    rx = recv[0] if fp8 else recv
    assert tuple(rx.shape) == (E // R, R * M, H) and tuple(count.shape) == (E // R,)
    if fp8:
        assert tuple(recv[1].shape) == (E // R, R * M, H // 512) and recv[1].dtype == torch.int32
    assert tuple(handle[0].shape) == (E // R, R * M) and tuple(handle[1].shape) == (E // R, R) and \
        tuple(handle[2:]) == (M, H, E)
    # hook: prepare + hybrid on comm, layout + scatter at hook() on the current stream
    log.clear()
    _, _, handle, _, hook = mode.dispatch(x, t, M, E, use_fp8=fp8, return_recv_hook=True)
    assert _names(log) == [('ll_internode_prepare', 'comm'), ('hybrid_dispatch', 'comm')] and comm.waits == 1
    hook()
    assert _names(log)[2:] == [('ll_internode_layout', 'current'), ('ll_internode_scatter', 'current')]
    assert current.waits == 1
    # async_finish: all on comm
    log.clear()
    _, _, handle, event, _ = mode.dispatch(x, t, M, E, use_fp8=fp8, async_finish=True)
    assert {s for _, s in _names(log)} == {'comm'} and event.event is not None
    # combine: the three modes, and zero-copy
    y = torch.zeros(E // R, R * M, H, dtype=torch.bfloat16)
    log.clear()
    out = torch.empty(5, H, dtype=torch.bfloat16)
    combined, event, hook = mode.combine(y, t, w, handle, out=out)
    assert combined is out and _names(log) == [('ll_internode_gather', 'current'), ('hybrid_combine', 'current'),
                                               ('ll_internode_reduce', 'current')]
    log.clear()
    combined, event, hook = mode.combine(y, t, w, handle, return_recv_hook=True)
    assert _names(log) == [('ll_internode_gather', 'comm'), ('hybrid_combine', 'comm')]
    hook()
    assert _names(log)[2] == ('ll_internode_reduce', 'current')
    with pytest.raises(RuntimeError, match='get_next_low_latency_combine_buffer'):
        mode.combine(None, t, w, handle, zero_copy=True)
    for _ in range(2):      # the two halves alternate
        staging = mode.get_next_combine_buffer(handle)
        assert tuple(staging.shape) == (E // R, R * M, H)
        log.clear()
        mode.combine(None, t, w, handle, zero_copy=True)
        assert log[0].args['x'] == staging.data_ptr()
    # 0 tokens: no prepare, no reduce
    log.clear()
    _, _, h0, _, _ = mode.dispatch(x[:0], t[:0], M, E, use_fp8=fp8)
    assert [n for n, _ in _names(log)] == ['hybrid_dispatch', 'll_internode_layout', 'll_internode_scatter']
    log.clear()
    mode.combine(y, t[:0], w[:0], h0)
    assert [n for n, _ in _names(log)] == ['ll_internode_gather', 'hybrid_combine']
    # larger maxima build a larger engine (collective), smaller ones reuse it
    mode.dispatch(x, t[:, :1].contiguous(), M, E)
    assert len(built) == 1
    mode.dispatch(x, torch.zeros(5, 4, dtype=torch.int64), M, E)
    assert built[-1] == (M * 4, H)


def test_kernel_constants_and_specs():
    from test_legacy_internode_cpu import _kernel_interfaces
    ki = _kernel_interfaces()
    src = ki.parse(ill.FAMILY)
    assert src.constant('kLLThreads') == ill.THREADS and src.constant('kLLLayoutThreads') == ill.LAYOUT_THREADS
    checked, mismatches = ki.check_all({ill.FAMILY: list(ill.SPECS)})
    assert mismatches == [] and checked == len(ill.SPECS)
    assert set(ill.SPECS) <= set(shipped.shipped_specs()[ill.FAMILY])


@pytest.mark.slow
def test_legacy_internode_ll_kernels_compile_for_sm90():
    from deepep_cupy.jit import compiler
    names = [s.name for s in ill.SPECS]
    module = compiler.compile_cubin(ill.FAMILY, names, arch='90', use_cache=False)
    assert module.cubin[:4] == b'\x7fELF' and sorted(module.lowered) == sorted(names)


# ---- streams as torch has them -------------------------------------------------------------------------------------
@pytest.mark.parametrize('caller', [0, 0x5500], ids=['default stream', 'side stream'])
@pytest.mark.parametrize('target', [0, 0x5500, 0x7700], ids=['to 0', 'to side', 'to comm'])
def test_on_stream_makes_exactly_that_stream_current_for_torch(monkeypatch, caller, target):
    """Inside `_OnStream`, torch's current stream is the one asked for, also for handle 0 (torch's default stream,
    where a caller's local call runs): `torch.cuda.ExternalStream(0)` would be a pool stream, unordered with it."""
    model = _TorchCudaModel(caller).install(monkeypatch)
    before = model.now
    with lli._OnStream('torch', _CupyStream('s', target)):
        assert model.now.cuda_stream == target and model.num_pool == 0
    assert model.now is before
    recorded = []
    monkeypatch.setattr(torch.Tensor, 'record_stream', lambda t, s: recorded.append(s), raising=False)
    lli._record('torch', _CupyStream('s', target), (torch.zeros(1), None))
    assert [s.cuda_stream for s in recorded] == [target] and model.num_pool == 0


@pytest.mark.parametrize('caller', [0, 0x5500], ids=['default stream', 'side stream'])
@pytest.mark.parametrize('fp8', [False, True])
def test_local_calls_launch_everything_on_the_callers_stream(monkeypatch, caller, fp8):
    """Without hook or async_finish every launch of dispatch and combine (ours and the hybrid feature's, which run on
    torch's current stream) is on the caller's stream, whichever torch stream that is (the first GPU run: on torch's
    default stream, the hybrid dispatch ran on a pool stream and the layout read its counts before they were
    written: recv_count all zeros). With a hook, the sends run on the communication stream, the receive on the
    caller's."""
    model = _TorchCudaModel(caller).install(monkeypatch)
    log = []
    mode, current, comm, _ = _fake_mode(monkeypatch, log, torch_model=model)
    M, H, K, E = 8, 512, 2, 16
    x = torch.zeros(5, H, dtype=torch.bfloat16)
    t = torch.zeros(5, K, dtype=torch.int64)
    w = torch.zeros(5, K)
    _, _, handle, _, _ = mode.dispatch(x, t, M, E, use_fp8=fp8, round_scale=fp8)
    y = torch.zeros(E // 4, 4 * M, H, dtype=torch.bfloat16)
    mode.combine(y, t, w, handle)
    names = _names(log)
    assert [n for n, _ in names] == ['ll_internode_prepare', 'hybrid_dispatch', 'll_internode_layout',
                                     'll_internode_scatter', 'll_internode_gather', 'hybrid_combine',
                                     'll_internode_reduce']
    assert {s for _, s in names} == {'current'}, names
    assert model.now.cuda_stream == caller and model.num_pool == 0
    log.clear()
    _, _, handle, _, hook = mode.dispatch(x, t, M, E, use_fp8=fp8, round_scale=fp8, return_recv_hook=True)
    hook()
    assert _names(log) == [('ll_internode_prepare', 'comm'), ('hybrid_dispatch', 'comm'),
                           ('ll_internode_layout', 'current'), ('ll_internode_scatter', 'current')]
    assert model.now.cuda_stream == caller and model.num_pool == 0


def test_receive_kernels_read_the_dispatch_outputs_and_write_the_returned_tensors():
    """tests/legacy_internode_ll_host_path_prog.py in a subprocess: over the real hybrid feature and intranode engine
    host paths, the layout / scatter launches read the intranode dispatch's outputs and received count and write the
    tensors the call returns (BF16 and FP8, 2x1 and 2x2, every rank)."""
    import subprocess
    import sys
    from pathlib import Path
    prog = Path(__file__).with_name('legacy_internode_ll_host_path_prog.py')
    out = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith('OK'), out.stdout[-3000:] + out.stderr[-3000:]
