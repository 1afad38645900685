"""DeepEP V1 `Buffer` across scale-up domains without a GPU (features/legacy/internode.py):
- the host reference of V1's internode contract on a hand-checked 2x2 case, and its invariants on random routing;
- `get_dispatch_layout`'s `num_tokens_per_rdma_rank`: the launches (recorded kernels whose `run` emulates the CUDA
  code) against the reference; one domain launches and returns exactly what it did before;
- what construction refuses (low-latency across domains, more than 8 ranks in one domain) and the calls that raise
  NotImplementedError before any kernel (dispatch, combine)."""

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import fakes  # noqa: E402

from deepep_cupy.buffers.legacy import Buffer  # noqa: E402
from deepep_cupy.features.legacy import internode  # noqa: E402
from deepep_cupy.features.legacy import layout as legacy_layout  # noqa: E402
from deepep_cupy.runtime import interop  # noqa: E402

E = 8   # 4 ranks in 2 domains of 2: rank g owns experts 2g, 2g + 1


# ---- host reference ------------------------------------------------------------------------------------------------
def _case():
    """Rank 0 holds 3 tokens: t0 -> experts {0, 5} (ranks 0, 2), t1 -> {6, 7} (rank 3), t2 -> {2, -1} (rank 1);
    the other ranks hold one token each to expert 4 (rank 2), rank 3's none (empty routing)."""
    return [np.array([[0, 5], [6, 7], [2, -1]]), np.array([[4, -1]]), np.array([[4, 4]]),
            np.zeros((0, 2), dtype=np.int64)]


def test_reference_hand_checked():
    refs = internode.reference_internode(_case(), E, 2, 2)
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
    refs = internode.reference_internode(topk, num_experts, num_domains, C)
    for g, ref in enumerate(refs):
        d, local = divmod(g, num_scaleup)
        rows = ref.recv_src
        assert ref.recv_gbl_rank_prefix_sum[-1] == rows.shape[0] == ref.recv_src_meta.shape[0]
        assert (np.diff(rows[:, 0]) >= 0).all(), 'rows grouped by source rank'
        for src in range(R):      # within a source rank in token order, and every routed token once
            mine = rows[rows[:, 0] == src, 1]
            want = np.nonzero(internode.ranks_of(topk[src], num_experts, R)[:, g])[0]
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
    """The CUDA kernel `get_dispatch_layout_domains`, in Python, on the recorded arguments."""
    def run(a):
        in_rank, out = a['is_token_in_rank'], counts_of(a['num_tokens_per_domain'])
        n, r, d = int(a['num_tokens']), int(a['num_ranks']), int(a['num_domains'])
        out[:d] += in_rank[:n].view(n, d, r // d).any(2).sum(0).int()
    return run


def _layout_run(a):
    """The CUDA kernel `get_dispatch_layout`, in Python (is_token_in_rank only: the counts are tested elsewhere)."""
    ids, out = a['topk_idx'], a['is_token_in_rank']
    out.copy_(torch.from_numpy(internode.ranks_of(ids.numpy(), int(a['num_experts']), int(a['num_ranks']))))


def _fake_world(monkeypatch, log):
    allocs = []
    monkeypatch.setattr(interop.Allocator, 'empty',
                        lambda self, shape, dtype, stream=None: allocs.append(torch.zeros(shape,
                                                                                          dtype=getattr(torch, dtype)))
                        or allocs[-1])
    monkeypatch.setattr(legacy_layout, '_memset_async', lambda ptr, n, stream: log.append(('memset', n)))
    current = fakes.FakeStream('current')
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: current)

    def counts_of(ptr):
        base = allocs[0]
        return base[(ptr - base.data_ptr()) // 4:]
    return allocs, counts_of


def _make_layout(log, counts_of, topk_arg, num_domains):
    """A DispatchLayout whose kernels record and emulate; `topk_arg` maps the pointer back to the tensor."""
    def layout_run(a):
        _layout_run(dict(a, topk_idx=topk_arg[0]))
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
    want = internode.domain_counts(internode.ranks_of(idx.numpy(), num_experts, R), num_domains)
    assert per_domain.tolist() == want.tolist()
    assert log[0] == ('memset', 4 * (R + num_experts + num_domains))
    first, second = log[1], log[2]
    assert first.name == legacy_layout.LAYOUT_SPEC.name and second.name == legacy_layout.DOMAINS_SPEC.name
    assert second.stream is first.stream and second.grid == first.grid == 2
    assert second.args['is_token_in_rank'] is in_rank
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
    with pytest.raises(NotImplementedError, match='low-latency mode across scale-up domains'):
        internode.check_domains(4, 2, 2, True, 8)
    with pytest.raises(NotImplementedError, match='at most 8 ranks per domain'):
        internode.check_domains(16, 1, 16, False, 8)


def test_dispatch_and_combine_across_domains_refuse_before_any_kernel(monkeypatch):
    log = []
    _, counts_of = _fake_world(monkeypatch, log)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    buf = make_buffer(log, counts_of, [idx], 2, 2)
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match='dispatch across 2 scale-up domains of 2 ranks'):
        buf.dispatch(x, topk_idx=idx)
    with pytest.raises(NotImplementedError, match='combine across 2 scale-up domains'):
        buf.combine(x, None)
    assert log == []
    assert buf.get_local_buffer_tensor(torch.bfloat16).shape == (0,)
    buf.destroy()
