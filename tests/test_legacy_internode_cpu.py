"""DeepEP V1 `Buffer` across scale-up domains without a GPU (v1/kernels/internode.py):
- the host reference of V1's internode contract on a hand-checked 2x2 case, and its invariants on random routing;
- the handle kernels' host mirrors (v1/kernels/internode_reference.py), fed what the hybrid dispatch leaves
  (simulated here from the routing), equal to the reference for every rank, element by element, with and without
  num_worst_tokens padding;
- `get_dispatch_layout`'s `num_tokens_per_rdma_rank`: the launches (recorded kernels whose `run` emulates the CUDA
  code) against the reference; one domain launches and returns exactly what it did before;
- sizing (M from num_nvl_bytes / num_rdma_bytes, growth, the Config hints beyond 8 ranks), the kernels' constants;
- what construction refuses (more than 8 ranks in one domain, too many domains) and the
  argument errors raised before any kernel;
- the whole adapter's host path (tests/legacy_internode_host_path_prog.py, in a subprocess)."""

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import fakes  # noqa: E402

from deepep_cupy.buffers import shipped  # noqa: E402
from deepep_cupy.features.ep.layout import buffer_size_hint  # noqa: E402
from deepep_cupy.features.hybrid import kernels as hybrid_kernels  # noqa: E402
from deepep_cupy.features.hybrid import plan as hplan  # noqa: E402
from deepep_cupy.runtime import errors as errors_module  # noqa: E402
from deepep_cupy.runtime import interop  # noqa: E402
from deepep_cupy.v1 import buffer as legacy  # noqa: E402
from deepep_cupy.v1 import internode as legacy_internode  # noqa: E402
from deepep_cupy.v1 import normal as legacy_normal  # noqa: E402
from deepep_cupy.v1.buffer import Buffer  # noqa: E402
from deepep_cupy.v1.kernels import internode  # noqa: E402
from deepep_cupy.v1.kernels import internode_reference as iref  # noqa: E402
from deepep_cupy.v1.kernels import layout as legacy_layout  # noqa: E402

E = 8   # 4 ranks in 2 domains of 2: rank g owns experts 2g, 2g + 1


# ---- host reference ------------------------------------------------------------------------------------------------
def _case():
    """Rank 0 holds 3 tokens: t0 -> experts {0, 5} (ranks 0, 2), t1 -> {6, 7} (rank 3), t2 -> {2, -1} (rank 1);
    the other ranks hold one token each to expert 4 (rank 2), rank 3's none (empty routing)."""
    return [np.array([[0, 5], [6, 7], [2, -1]]), np.array([[4, -1]]), np.array([[4, 4]]),
            np.zeros((0, 2), dtype=np.int64)]


def test_reference_hand_checked():
    refs = iref.reference_internode(_case(), E, 2, 2)
    r0, r1, r2, r3 = refs
    assert r0.num_tokens_per_rdma_rank.tolist() == [2, 2]
    assert r0.is_token_in_rank.tolist() == [[1, 0, 1, 0], [0, 0, 0, 1], [0, 1, 0, 0]]
    # Channels of rank 0: ceil(3 / 2) = 2 tokens per channel: t0, t1 | t2.
    assert r0.rdma_channel_prefix_matrix.tolist() == [[1, 2], [2, 2]]
    assert r0.gbl_channel_prefix_matrix.tolist() == [[1, 1], [0, 1], [1, 1], [1, 1]]
    assert r0.send_rdma_head.tolist() == [[0, 0], [-1, 1], [1, -1]]
    # Rank 2 = (domain 1, local 0) forwards for rail peers 0 (domain 0) and 2 (itself): rank 0's t0, t1 (both have an
    # expert in domain 1), then its own t0.
    assert r2.recv_rdma_channel_prefix_matrix.tolist() == [[2, 2], [1, 1]]
    assert r2.recv_rdma_rank_prefix_sum.tolist() == [2, 3]
    assert r2.send_nvl_head.tolist() == [[0, -1], [-1, 0], [1, -1]]
    # Rank 2 receives rank 0's t0, rank 1's t0 and its own t0: rows grouped by source rank.
    assert r2.recv_src.tolist() == [[0, 0], [1, 0], [2, 0]]
    assert r2.recv_gbl_rank_prefix_sum.tolist() == [1, 2, 3, 3]
    assert r2.recv_gbl_channel_prefix_matrix.tolist() == [[0, 1], [1, 2], [2, 3], [3, 3]]
    meta = r2.recv_src_meta.view('<i4').reshape(-1, 2)
    assert meta.tolist() == [[0, 1], [0, 1], [1, 1]]
    assert r2.recv_src_meta.shape == (3, 8) and r2.recv_src_meta.dtype == np.uint8
    assert r3.recv_src.tolist() == [[0, 1]] and r3.recv_src_meta.view('<i4').tolist() == [[0, 2]]
    assert r1.recv_src.tolist() == [[0, 2]] and r1.send_nvl_head.shape == (0, 2)
    assert r3.is_token_in_rank.shape == (0, 4) and r3.num_tokens_per_rdma_rank.tolist() == [0, 0]
    assert len(r0.v1_tuple()) == 10 and r0.v1_tuple()[0] is r0.is_token_in_rank


@pytest.mark.parametrize('num_domains,num_scaleup', [(2, 1), (2, 2), (2, 4), (4, 1), (3, 2)])
def test_reference_invariants(num_domains, num_scaleup):
    rng = np.random.default_rng(num_domains * 10 + num_scaleup)
    R, K, C = num_domains * num_scaleup, 3, 3
    num_experts = 4 * R
    topk = []
    for g in range(R):
        n = int(rng.integers(0, 40)) if g else 0       # rank 0 holds no tokens
        t = np.array([rng.permutation(num_experts)[:K] for _ in range(n)], dtype=np.int64).reshape(n, K)
        t[rng.random(t.shape) < 0.2] = -1
        topk.append(t)
    refs = iref.reference_internode(topk, num_experts, num_domains, C)
    for g, ref in enumerate(refs):
        d, local = divmod(g, num_scaleup)
        rows = ref.recv_src
        assert ref.recv_gbl_rank_prefix_sum[-1] == rows.shape[0] == ref.recv_src_meta.shape[0]
        assert (np.diff(rows[:, 0]) >= 0).all(), 'rows grouped by source rank'
        for src in range(R):      # within a source rank in token order, and every routed token once
            mine = rows[rows[:, 0] == src, 1]
            want = np.nonzero(iref.ranks_of(topk[src], num_experts, R)[:, g])[0]
            assert mine.tolist() == want.tolist()
        assert ref.send_nvl_head.shape == (ref.recv_rdma_rank_prefix_sum[-1], num_scaleup)
        assert ref.rdma_channel_prefix_matrix[:, -1].tolist() == ref.num_tokens_per_rdma_rank.tolist()
        assert ref.gbl_channel_prefix_matrix[:, -1].tolist() == ref.is_token_in_rank.sum(0).tolist()
        assert ((ref.send_rdma_head >= 0).sum(0) == ref.num_tokens_per_rdma_rank).all()
        assert (ref.recv_src_meta.view('<i4').reshape(-1, 2)[:, 0] == rows[:, 0] // num_scaleup).all()
        # Each row this rank receives from source (s, j) went through the forwarder (d, j): one NVL entry there.
        via = sum(int((refs[d * num_scaleup + j].send_nvl_head[:, local] >= 0).sum()) for j in range(num_scaleup))
        assert via == rows.shape[0]


# ---- get_dispatch_layout across domains ---------------------------------------------------------------------------
def _domains_kernel_run(counts_of):
    """The CUDA kernel `get_dispatch_layout_domains`, in Python, on the recorded arguments (bound launches record
    pointers: `counts_of` maps them back to the allocations)."""
    def run(a):
        in_rank, out = counts_of(a['is_token_in_rank']), counts_of(a['num_tokens_per_domain'])
        n, r, d = int(a['num_tokens']), int(a['num_ranks']), int(a['num_domains'])
        out[:d] += in_rank.view(-1)[:n * r].view(n, d, r // d).any(2).sum(0).int()
    return run


def _layout_run(a, counts_of):
    """The CUDA kernel `get_dispatch_layout`, in Python (is_token_in_rank only: the counts are tested elsewhere)."""
    ids, out = a['topk_idx'], counts_of(a['is_token_in_rank'])
    ranks = torch.from_numpy(iref.ranks_of(ids.numpy(), int(a['num_experts']), int(a['num_ranks'])))
    out[:ranks.numel()].copy_(ranks.view(-1))


def _fake_world(monkeypatch, log):
    """Allocations recorded (zeroed: `allocs`, in order; the layout's through `Carver`), memsets logged; returns
    `allocs` and `counts_of(ptr)`: the recorded allocation holding address `ptr`, viewed from there."""
    allocs = []

    def empty(self, shape, dtype, stream=None):
        allocs.append(torch.zeros(shape, dtype=getattr(torch, dtype)))
        return allocs[-1]
    monkeypatch.setattr(interop.Allocator, 'empty', empty)
    monkeypatch.setattr(interop.Carver, 'empty', empty)
    monkeypatch.setattr(interop.Carver, 'allocator', lambda self, shape, dtype: lambda: empty(self, shape, dtype))
    monkeypatch.setattr(legacy_layout, '_memset_async', lambda ptr, n, stream: log.append(('memset', n)))
    current = fakes.FakeStream('current')
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: current)

    def counts_of(ptr):
        for base in allocs:
            start = base.data_ptr()
            if start <= ptr < start + base.numel() * base.element_size():
                return base.view(-1)[(ptr - start) // base.element_size():]
        raise AssertionError(f'no recorded allocation holds address {ptr:#x}')
    return allocs, counts_of


def _make_layout(log, counts_of, topk_arg, num_domains):
    """A DispatchLayout whose kernels record and emulate; `topk_arg` maps the pointer back to the tensor."""
    def layout_run(a):
        _layout_run(dict(a, topk_idx=topk_arg[0]), counts_of)
    return legacy_layout.DispatchLayout(
        -1, kernel=fakes.RecordingKernel(legacy_layout.LAYOUT_SPEC, log, run=layout_run), num_domains=num_domains,
        domains_kernel=fakes.RecordingKernel(legacy_layout.DOMAINS_SPEC, log, run=_domains_kernel_run(counts_of)))


def make_buffer(log, counts_of, topk_arg, num_domains, num_scaleup):
    buf = Buffer.__new__(Buffer)
    buf.__dict__.update(
        _destroyed=False, group=None, rank=0, group_size=num_domains * num_scaleup, num_nvl_bytes=0,
        num_rdma_bytes=0, low_latency_mode=False, explicitly_destroy=True, enable_shrink=False, device=-1,
        _stream=None, _order=fakes.stream_order(fakes.FakeStream('comm')), _configs={}, _ll=None, _normal=None,
        num_domains=num_domains, num_scaleup_ranks=num_scaleup,
        _layout=_make_layout(log, counts_of, topk_arg, num_domains))
    return buf


@pytest.mark.parametrize('num_domains,num_scaleup', [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2)])
def test_layout_num_tokens_per_rdma_rank(monkeypatch, num_domains, num_scaleup):
    log = []
    allocs, counts_of = _fake_world(monkeypatch, log)
    R = num_domains * num_scaleup
    num_experts = 4 * R
    g = torch.Generator().manual_seed(R)
    idx = torch.topk(torch.rand(300, num_experts, generator=g), 4).indices
    idx[::5, 2] = -1
    buf = make_buffer(log, counts_of, [idx], num_domains, num_scaleup)
    per_rank, per_domain, per_expert, in_rank, event = buf.get_dispatch_layout(idx, num_experts)
    assert per_domain is not None and per_domain.shape == (num_domains,) and per_domain.dtype == torch.int32
    want = iref.domain_counts(iref.ranks_of(idx.numpy(), num_experts, R), num_domains)
    assert per_domain.tolist() == want.tolist()
    assert log[0] == ('memset', 4 * (R + num_experts + num_domains))
    first, second = log[1], log[2]
    assert first.name == legacy_layout.LAYOUT_SPEC.name and second.name == legacy_layout.DOMAINS_SPEC.name
    assert second.stream is first.stream and second.grid == first.grid == 2
    assert second.args['is_token_in_rank'] == first.args['is_token_in_rank'] == in_rank.data_ptr()
    assert per_rank.shape == (R,) and per_expert.shape == (num_experts,)
    assert per_domain.data_ptr() == allocs[0].data_ptr() + 4 * (R + num_experts)
    assert per_expert.data_ptr() == allocs[0].data_ptr() + 4 * R


def test_layout_one_domain_is_unchanged(monkeypatch):
    log = []
    allocs, counts_of = _fake_world(monkeypatch, log)
    idx = torch.zeros(10, 2, dtype=torch.int64)
    buf = make_buffer(log, counts_of, [idx], 1, 2)
    per_rank, per_domain, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    assert per_domain is None
    assert log[0] == ('memset', 4 * (2 + E)) and len(log) == 2 and allocs[0].shape == (2 + E,)


def test_layout_plan_domains():
    idx = torch.zeros(4, 2, dtype=torch.int64)
    assert legacy_layout.plan_layout(idx, E, 4, -1, 2).num_domains == 2
    assert legacy_layout.plan_layout(idx, E, 4, -1).num_domains == 1
    with pytest.raises(AssertionError, match='domains'):
        legacy_layout.plan_layout(idx, 12, 6, -1, 4)
    assert legacy_layout.DOMAINS_SPEC in legacy_layout.shipped_specs()[legacy_layout.FAMILY]


# ---- what is refused -----------------------------------------------------------------------------------------------
def test_construction_refusals():
    internode.check_domains(8, 1, 8, True, 8)
    internode.check_domains(4, 2, 2, False, 8)
    internode.check_domains(4, 2, 2, True, 8)      # low-latency mode across domains: served (internode_ll.py)
    with pytest.raises(NotImplementedError, match='at most 8 ranks per domain'):
        internode.check_domains(16, 1, 16, False, 8)
    internode.check_domains(128, 16, 8, False, 8)
    with pytest.raises(NotImplementedError, match='at most 16 domains'):
        internode.check_domains(17, 17, 1, False, 8)


def _refusing_buffer(monkeypatch, num_domains=2, num_scaleup=2):
    """A Buffer across domains whose engine must not be built (the calls below raise first)."""
    log = []
    _, counts_of = _fake_world(monkeypatch, log)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    buf = make_buffer(log, counts_of, [idx], num_domains, num_scaleup)

    def make_engine(*args):
        raise AssertionError(f'an engine was built for a call that should have raised first: {args}')
    buf._internode = legacy_internode.InternodeMode(num_domains, num_scaleup, 0, 0, make_engine)
    return buf, log


def test_dispatch_and_combine_argument_errors_before_any_kernel(monkeypatch):
    buf, log = _refusing_buffer(monkeypatch)
    R, E4 = 4, 16
    idx = torch.zeros(4, 2, dtype=torch.int64)
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    in_rank = torch.zeros(4, R, dtype=torch.bool)
    lay = dict(num_tokens_per_rank=torch.zeros(R, dtype=torch.int32), is_token_in_rank=in_rank,
               num_tokens_per_expert=torch.zeros(E4, dtype=torch.int32),
               num_tokens_per_rdma_rank=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match='without topk_idx across 2 scale-up domains'):
        buf.dispatch(x, **lay)
    no_rdma = dict(lay, num_tokens_per_rdma_rank=None)
    with pytest.raises(ValueError, match='num_tokens_per_rdma_rank is required'):
        buf.dispatch(x, topk_idx=idx, **no_rdma)
    with pytest.raises(ValueError, match='is_token_in_rank is required'):
        buf.dispatch(x, topk_idx=idx, **dict(lay, is_token_in_rank=None))
    with pytest.raises(ValueError, match='topk_idx must be'):
        buf.dispatch(x, topk_idx=idx[:3], **lay)
    with pytest.raises(ValueError, match='is_token_in_rank'):
        buf.dispatch(x, topk_idx=idx, **dict(lay, is_token_in_rank=in_rank[:, :2]))
    with pytest.raises(TypeError, match='is_token_in_rank'):
        buf.dispatch(x, topk_idx=idx, **dict(lay, is_token_in_rank=in_rank.int()))
    with pytest.raises(ValueError, match='channels'):
        buf.dispatch(x, topk_idx=idx, config=legacy.Config(258, 8, 256), **lay)
    with pytest.raises(ValueError, match='takes no topk_idx'):
        buf.dispatch(x, handle=object(), topk_idx=idx)
    with pytest.raises(TypeError, match='across scale-up domains returned'):
        buf.dispatch(x, handle=(1, 2))
    with pytest.raises(TypeError, match='across scale-up domains returned'):
        buf.combine(x, tuple(range(10)))
    with pytest.raises(ValueError, match='allocate_on_comm_stream'):
        buf.combine(x, None, allocate_on_comm_stream=True)
    with pytest.raises(ValueError, match='num_worst_tokens > 0 needs topk_idx'):
        buf.dispatch(x, num_worst_tokens=8, **lay)
    assert log == [] and buf._internode.engine is None
    assert buf.get_local_buffer_tensor(torch.bfloat16).shape == (0,)
    buf.destroy()


def test_internode_calls_serve_a_buffer_across_domains_only(monkeypatch):
    buf, _ = _refusing_buffer(monkeypatch)
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match='across scale-up domains returned'):
        buf.internode_combine(x, (0,) * 10)
    with pytest.raises(ValueError, match='is required'):
        buf.internode_dispatch(x, topk_idx=torch.zeros(4, 2, dtype=torch.int64))
    buf.num_domains = 1
    with pytest.raises(NotImplementedError, match='inside one NVLink domain'):
        buf.internode_dispatch(x)


# ---- the handle kernels' host mirrors against the reference -------------------------------------------------------
def _routing(num_domains, num_scaleup, seed, K=3, L=2, max_tokens=30, zero_rank=1):
    rng = np.random.default_rng(seed)
    R = num_domains * num_scaleup
    E = L * R
    topk = []
    for g in range(R):
        n = 0 if g == zero_rank else int(rng.integers(1, max_tokens + 1))
        t = np.array([rng.permutation(E)[:K] for _ in range(n)], dtype=np.int64).reshape(n, K)
        t[rng.random(t.shape) < 0.25] = -1
        topk.append(t)
    return E, topk


def _hybrid_state(topk, E, N, S, M):
    """What the hybrid dispatch leaves at each rank for the handle kernels: per forwarder (d, lr) the rail rows of
    each source domain (fwd_src / fwd_count, tokens in rail = token order), the union's top-k (row s * M + t, masked
    to domain d's experts, domain-relative ids, -1 elsewhere), the rail headers' counts; per receiver its rows'
    global source index in DeepEP's deterministic order (`src * M + token`, ascending)."""
    R, epd = N * S, E // N
    out = []
    for g in range(R):
        d, lr = divmod(g, S)
        fwd_src = np.full(N * M, -1, dtype=np.int32)
        fwd_count = np.zeros(N, dtype=np.int32)
        union = np.full((N * M, topk[0].shape[1]), -1, dtype=np.int64)
        for s in range(N):
            src = topk[s * S + lr]
            masked = np.where((src >= d * epd) & (src < (d + 1) * epd), src - d * epd, -1)
            if s == d:
                union[d * M:d * M + src.shape[0]] = masked
                continue
            sent = np.nonzero((masked >= 0).any(1))[0]
            fwd_src[s * M:s * M + sent.size] = sent
            fwd_count[s] = sent.size
            union[s * M + sent] = masked[sent]
        in_rank = [iref.ranks_of(t, E, R) for t in topk]
        keys = sorted(src * M + t for src in range(R) for t in np.nonzero(in_rank[src][:, g])[0])
        rail_counts = [topk[s * S + lr].shape[0] for s in range(N)]
        out.append(dict(fwd_src=fwd_src, fwd_count=fwd_count, union=union, keys=np.array(keys, dtype=np.int64),
                        rail_counts=rail_counts))
    return out


@pytest.mark.parametrize('num_domains,num_scaleup', [(2, 1), (2, 2), (2, 4), (4, 1), (3, 2)])
@pytest.mark.parametrize('pad', [0, 5])
def test_mirrors_build_the_reference_handle(num_domains, num_scaleup, pad):
    """Every rank's 10 elements from the mirrors of legacy_internode_forward / _receive equal the reference's;
    `pad` extra rows (num_worst_tokens) hold -1 (send_nvl_head) and (domain -1, mask 0) (recv_src_meta)."""
    N, S, C, M = num_domains, num_scaleup, 3, 32
    E, topk = _routing(N, S, seed=N * 10 + S)
    R = N * S
    refs = iref.reference_internode(topk, E, N, C)
    state = _hybrid_state(topk, E, N, S, M)
    fwd = []
    for g in range(R):
        st = state[g]
        d, lr = divmod(g, S)
        rows = int(refs[g].send_nvl_head.shape[0]) + pad
        fwd.append(iref.mirror_forward(topk[g], E, N, S, d, lr, st['fwd_src'], st['fwd_count'], st['union'], M, C,
                                       st['rail_counts'], rows))
    for g in range(R):
        d, lr = divmod(g, S)
        ref = refs[g]
        rdma, gbl, recv_rdma, recv_rdma_sum, nvl, _, _ = fwd[g]
        n = ref.recv_src.shape[0]
        counts = [fwd[d * S + j][5] for j in range(S)]
        masks = [fwd[d * S + j][6][lr] for j in range(S)]
        psum, chan, meta = iref.mirror_receive(state[g]['keys'], n, n + pad, N, S, M, C, counts, masks)
        assert np.array_equal(rdma, ref.rdma_channel_prefix_matrix), g
        assert np.array_equal(gbl, ref.gbl_channel_prefix_matrix), g
        assert np.array_equal(recv_rdma, ref.recv_rdma_channel_prefix_matrix), g
        assert np.array_equal(recv_rdma_sum, ref.recv_rdma_rank_prefix_sum), g
        assert np.array_equal(chan, ref.recv_gbl_channel_prefix_matrix), g
        assert np.array_equal(psum, ref.recv_gbl_rank_prefix_sum), g
        assert np.array_equal(meta[:n], ref.recv_src_meta), g
        assert np.array_equal(nvl[:ref.send_nvl_head.shape[0]], ref.send_nvl_head), g
        assert (nvl[ref.send_nvl_head.shape[0]:] == -1).all()
        assert (meta[n:].view('<i4').reshape(-1, 2) == [-1, 0]).all()
        # The rows in DeepEP's order are the reference's receive order.
        keys = state[g]['keys']
        assert np.array_equal(np.stack([keys // M, keys % M], 1), ref.recv_src), g


# ---- sizes, hints and constants -------------------------------------------------------------------------------------
def test_sizing_and_growth():
    li = legacy_internode
    for N, S in ((2, 8), (2, 1), (4, 2)):
        m = li.internode_tokens(N, S, 2 * 10**9, 0, 7168, 8)
        assert m > 0 and legacy_normal.fit_tokens(S, 2 * 10**9, 7168, 8) >= N * m
        assert li.internode_tokens(N, S, 0, 10**9, 7168, 8) == 0
        capped = li.internode_tokens(N, S, 2 * 10**9, 64 << 20, 7168, 8)
        assert capped == li.rail_tokens(N, 64 << 20, 7168, 8) < m
        for tokens, fits in ((capped, True), (capped + 1, False)):
            area = hplan.rail_area(N, tokens, 7168, 8)
            assert (area.recv_offset + N * area.region_bytes <= 64 << 20) == fits
        assert li.grown_tokens(1, N, S) == legacy_normal.DEFAULT_TOKENS
        assert li.grown_tokens(5000, N, S) == 6400
        with pytest.raises(ValueError, match='at most'):
            li.grown_tokens(li.token_limit(N, S) + 1, N, S)
    # DeepEP's internode test: Buffer(group, 2e9, 1e9), 4096 tokens, hidden 7168, 2 nodes of 8: no growth needed.
    assert li.internode_tokens(2, 8, int(2e9), int(1e9), 7168, 8) >= 4096
    # The hints beyond 8 ranks size the hybrid engine for the hinted tokens (nodes of 8).
    c = legacy.Config(24, 8, 288)
    nvl, rdma = c.get_nvl_buffer_size_hint(7168 * 2, 16), c.get_rdma_buffer_size_hint(7168 * 2, 16)
    assert rdma % (2 << 20) == 0 and nvl % (2 << 20) == 0
    assert li.internode_tokens(2, 8, nvl, rdma, 7168, 32) >= c.hint_tokens() - legacy_normal.TOKEN_ALIGNMENT
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) == buffer_size_hint(8, c.hint_tokens(), 7168, 0)


def test_kernel_constants_and_specs():
    ki = _kernel_interfaces()
    src = ki.parse(internode.FAMILY)
    for value, name in ((internode.THREADS, 'kV1Threads'), (internode.WEIGHT_THREADS, 'kV1WeightThreads'),
                        (internode.MAX_DOMAINS, 'kV1MaxDomains'), (internode.MAX_SCALEUP_RANKS, 'kV1MaxScaleup'),
                        (internode.AREA_ACK_OFFSET, 'kV1AckOffset'), (internode.AREA_SLOTS_OFFSET, 'kV1SlotsOffset'),
                        (internode.SLOT_COUNTS, 'kV1SlotCounts'), (internode.SLOT_MASKS, 'kV1SlotMasks'),
                        (13, 'kPhaseLegacyInternode')):
        assert src.constant(name) == value, name
    assert 'V1 internode' in errors_module.PHASES[13]
    assert internode.MAX_DOMAINS == hybrid_kernels.MAX_DOMAINS
    specs = {internode.FAMILY: list(internode.SPECS)}
    checked, mismatches = ki.check_all(specs)
    assert mismatches == [] and checked == len(internode.SPECS)
    assert set(internode.SPECS) <= set(shipped.shipped_specs()[internode.FAMILY])
    assert internode.slot_words(2, 100) % 32 == 0 and internode.slot_words(2, 100) >= internode.SLOT_MASKS + 200
    assert internode.area_bytes(4, 2, 100) == 4 * (internode.AREA_SLOTS_OFFSET + 8 * internode.slot_words(2, 100))


def _kernel_interfaces():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / 'tools' / 'kernel_interfaces.py'
    spec = importlib.util.spec_from_file_location('kernel_interfaces', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the adapter's host path ----------------------------------------------------------------------------------------
def test_host_path_runs_every_mode():
    import subprocess
    import sys
    from pathlib import Path
    prog = Path(__file__).with_name('legacy_internode_host_path_prog.py')
    out = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith('OK'), out.stdout[-3000:] + out.stderr[-3000:]
