"""The host references of the V1 rank program (`deepep_cupy/tests/legacy_reference.py`) against the library's
independent references (`deepep_cupy.utils.refs`) on a small random world, and their V1 handle parts against their
definitions."""

import pytest

torch = pytest.importorskip('torch')

from deepep_cupy.tests import legacy_reference as ref  # noqa: E402
from deepep_cupy.utils import refs  # noqa: E402

R, E, K, H = 3, 12, 4, 64


def world(seed=0, sizes=(7, 0, 12)):
    g = torch.Generator().manual_seed(seed)
    xs, topks, ws = [], [], []
    for n in sizes:
        xs.append(torch.randn(n, H, generator=g).to(torch.bfloat16))
        t = torch.topk(torch.rand(n, E, generator=g), K).indices
        t[torch.rand(n, K, generator=g) < 0.2] = -1
        topks.append(t)
        ws.append(torch.randn(n, K, generator=g))
    return xs, topks, ws


def test_layout_and_matrices():
    xs, topks, ws = world()
    lays = [ref.layout(t, E, R) for t in topks]
    for t, (per_rank, per_expert, in_rank) in zip(topks, lays):
        assert per_rank.tolist() == [int(in_rank[:, r].sum()) for r in range(R)]
        assert per_expert.tolist() == [int((t == e).sum()) for e in range(E)]
    in_ranks = [lay[2] for lay in lays]
    rpm = ref.rank_prefix_matrix(in_ranks)
    assert rpm[-1].tolist() == [sum(int(m[:, j].sum()) for m in in_ranks) for j in range(R)]
    cpm = ref.channel_prefix_matrix(in_ranks[2], 5)       # 12 tokens, 5 channels of 3: the last one empty
    assert cpm[:, -1].tolist() == in_ranks[2].sum(0).tolist() == cpm[:, -2].tolist()
    assert cpm[:, 0].tolist() == in_ranks[2][:3].sum(0).tolist()
    assert ref.channel_prefix_matrix(in_ranks[1], 4).abs().sum() == 0        # no tokens
    rcpm = ref.recv_channel_prefix_matrix(in_ranks, 0, 5)
    assert rcpm[:, 0].abs().sum() == 0 and rcpm[2, 1] == cpm[0, 0]
    head = ref.send_head(in_ranks[0])
    for r in range(R):
        sent = in_ranks[0][:, r]
        assert head[sent, r].tolist() == list(range(int(sent.sum()))) and bool((head[~sent, r] == -1).all())


@pytest.mark.parametrize('rank', range(R))
def test_dispatch_matches_refs(rank):
    xs, topks, ws = world(1)
    in_ranks = [ref.layout(t, E, R)[2] for t in topks]
    got = ref.dispatch(xs, None, topks, ws, in_ranks, rank, E)
    M = 16
    want = refs.dispatch_from_gathered(xs, None, topks, ws, rank, M, E)
    assert torch.equal(got.recv_x, want.recv_x)
    assert torch.equal(got.recv_topk_idx, want.recv_topk_idx.to(torch.int64))
    local = want.recv_topk_idx >= 0
    assert torch.equal(got.recv_topk_weights, torch.where(local, want.recv_topk_weights, 0.0))
    assert torch.equal(got.recv_src_idx, (want.recv_src_token_global_idx % M).to(torch.int32))
    assert got.expert_counts == [int((got.recv_topk_idx == j).sum()) for j in range(E // R)]
    # Without top-k: routed by is_token_in_rank, per-expert counts from num_tokens_per_expert.
    synth = [ref.synthetic_topk(m, E) for m in in_ranks]
    per_experts = [ref.layout(t, E, R)[1] for t in topks]
    got2 = ref.dispatch(xs, None, synth, None, in_ranks, rank, E, per_experts)
    assert torch.equal(got2.recv_x, got.recv_x) and got2.expert_counts == got.expert_counts


@pytest.mark.parametrize('rank', range(R))
@pytest.mark.parametrize('num_bias', (0, 1, 2))
def test_combine_matches_refs(rank, num_bias):
    """refs.combine (local reduce): slot k holds rank d's row at d's first slot (0 at its other slots), so the group
    sum is the row, placed at d's last slot: the V1 reference's order."""
    xs, topks, ws = world(2)
    x, t = xs[rank], topks[rank]
    own = ref.owners(t, E, R)
    y = torch.zeros(x.shape[0], K, H, dtype=torch.bfloat16)
    for i in range(x.shape[0]):
        seen = set()
        for k in range(K):
            d = int(own[i, k])
            if d >= 0 and d not in seen:
                seen.add(d)
                y[i, k] = ref.combine_rows(x[i:i + 1], d)[0]
    g = torch.Generator().manual_seed(3)
    biases = [torch.randn(x.shape[0], H, generator=g).to(torch.bfloat16) for _ in range(num_bias)]
    want = refs.combine(y, t, 1, R, E, tuple(biases) if biases else None, True, False)
    got, _ = ref.combine(x, t, E, R, biases)
    assert torch.equal(got, want)


def test_combined_weights_sum_over_ranks():
    xs, topks, ws = world(4)
    x, t, w = xs[0], topks[0], ws[0]
    own = ref.owners(t, E, R)
    # Dispatched weights (0 at non-local slots): the sum is the owner's value.
    _, got = ref.combine(x, t, E, R, [], lambda d: torch.where(own == d, w, torch.zeros_like(w)))
    assert torch.equal(got, torch.where(own >= 0, w, torch.zeros_like(w)))
    # Non-local slots overwritten with (d + 1) / 2: every destination adds its value.
    _, got = ref.combine(x, t, E, R, [], lambda d: torch.where(own == d, w, torch.full_like(w, (d + 1) * 0.5)))
    for i in range(x.shape[0]):
        dests = []
        for d in own[i].tolist():
            if d >= 0 and d not in dests:
                dests.append(d)
        for k in range(K):
            acc = torch.zeros((), dtype=torch.float32)
            for d in dests:
                acc = acc + (w[i, k] if int(own[i, k]) == d else torch.tensor((d + 1) * 0.5))
            assert torch.equal(got[i, k], acc), (i, k)
