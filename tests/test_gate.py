"""CPU tests of `deepep_cupy.utils.gate`: the precise unbalanced generator hits the requested hot-rank ratio within 10%
(in fact within rounding) with the other ranks balanced to max/min < 1.02 (upstream's `tests/utils/test_gate.py`
criteria), and the random mode lands near the ratio statistically."""

import time

import pytest

torch = pytest.importorskip('torch')  # the utilities under test take torch tensors

from deepep_cupy.utils.gate import count_tokens_per_rank, generate_rank_count, generate_topk_idx, get_unbalanced_scores


def routing_stats(scores: torch.Tensor, num_ranks: int, num_topk: int):
    """(hot ratio, inequality, topk_idx) of routing by `torch.topk(scores)`."""
    topk_idx = torch.topk(scores, num_topk, dim=1).indices
    counts = count_tokens_per_rank(topk_idx, scores.size(1), num_ranks).double()
    others = counts[1:]
    return (counts[0] / others.mean()).item(), (others.max() / others.min()).item(), topk_idx


def test_count_tokens_per_rank():
    topk_idx = torch.tensor([[0, 1, 5], [2, -1, -1], [7, 6, 4], [-1, -1, -1]])
    # 8 experts over 4 ranks: token 0 -> ranks {0, 2}, token 1 -> {1}, token 2 -> {3, 2}, token 3 -> none
    assert count_tokens_per_rank(topk_idx, 8, 4).tolist() == [1, 1, 2, 1]


# Precise mode
PRECISE_CASES = [
    # (ratio, num_ranks, num_topk, num_experts, num_tokens)
    (1.0, 8, 8, 256, 4096),
    (1.5, 8, 8, 256, 4096),
    (2.0, 8, 8, 256, 4096),
    (4.0, 8, 8, 256, 4096),
    (8.0, 8, 8, 256, 4096),
    (0.5, 8, 8, 256, 4096),
    (2.0, 8, 6, 256, 4096),
    (1.3, 16, 8, 256, 4096),
    (3.0, 4, 8, 64, 2048),
    (2.0, 2, 4, 32, 1024),
    (1.5, 32, 8, 256, 8192),
]


@pytest.mark.parametrize('ratio,num_ranks,num_topk,num_experts,num_tokens', PRECISE_CASES)
def test_precise_ratio_and_balance(ratio, num_ranks, num_topk, num_experts, num_tokens):
    torch.manual_seed(int(ratio * 100) + num_ranks)
    scores = get_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio, precise=True, device='cpu')
    assert scores.shape == (num_tokens, num_experts) and scores.dtype == torch.float32
    hot_ratio, inequality, topk_idx = routing_stats(scores, num_ranks, num_topk)
    # Upstream's criteria...
    assert abs(hot_ratio / ratio - 1) < 0.1, f'{hot_ratio=} for {ratio=}'
    assert inequality < 1.02, f'{inequality=}'
    # ...and what the construction actually guarantees: exact up to rounding rank 0's count, others within ±1
    assert abs(hot_ratio / ratio - 1) < 0.01, f'{hot_ratio=} for {ratio=}'
    counts = count_tokens_per_rank(topk_idx, num_experts, num_ranks)
    assert counts[1:].max() - counts[1:].min() <= 1
    # Exactly num_topk experts per token score above the threshold, all distinct, the rest below it
    assert ((scores > 0.9).sum(dim=1) == num_topk).all()
    assert (scores <= 1.0).all() and (scores >= 0).all()
    assert (topk_idx.sort(dim=1).values.diff(dim=1) > 0).all()


def test_precise_rank_count_and_topk_idx():
    torch.manual_seed(0)
    num_tokens, num_experts, num_ranks, num_topk = 1000, 64, 8, 6
    rank_count = generate_rank_count(num_tokens, num_experts, num_ranks, num_topk, 2.0, device='cpu')
    assert rank_count.shape == (num_tokens, num_ranks) and rank_count.dtype == torch.int32
    assert (rank_count.sum(dim=1) == num_topk).all()
    assert (rank_count >= 0).all() and (rank_count <= num_experts // num_ranks).all()
    topk_idx = generate_topk_idx(rank_count, num_tokens, num_experts, num_ranks, num_topk)
    assert topk_idx.shape == (num_tokens, num_topk) and topk_idx.dtype == torch.int64
    assert (topk_idx.sort(dim=1).values.diff(dim=1) > 0).all()
    # The experts reproduce the counts
    recount = torch.zeros_like(rank_count).scatter_add_(1, topk_idx // (num_experts // num_ranks),
                                                        torch.ones_like(topk_idx, dtype=torch.int32))
    assert torch.equal(recount, rank_count)
    # Every expert of a rank gets used (uniform choice within ranks)
    assert torch.bincount(topk_idx.flatten(), minlength=num_experts).min() > 0


def test_precise_tight_capacity():
    # Two experts per rank and top-8: every token must touch at least 4 ranks
    torch.manual_seed(3)
    scores = get_unbalanced_scores(2048, 16, 8, 8, 1.0, precise=True, device='cpu')
    hot_ratio, inequality, topk_idx = routing_stats(scores, 8, 8)
    assert abs(hot_ratio - 1) < 0.01 and inequality < 1.02
    per_token = torch.zeros((2048, 8), dtype=torch.bool).scatter_(1, topk_idx // 2, True).sum(dim=1)
    assert (per_token >= 4).all()


def test_precise_unreachable_and_bad_args():
    with pytest.raises(ValueError, match='unreachable'):
        # One expert per rank, top-8 of 8 ranks: every token hits every rank
        get_unbalanced_scores(16, 8, 8, 8, 2.0, precise=True, device='cpu')
    assert get_unbalanced_scores(16, 8, 8, 8, 1.0, precise=True, device='cpu').shape == (16, 8)
    with pytest.raises(ValueError, match='num_experts'):
        get_unbalanced_scores(16, 10, 4, 2, precise=True, device='cpu')
    with pytest.raises(ValueError, match='num_topk'):
        get_unbalanced_scores(16, 8, 2, 9, device='cpu')
    with pytest.raises(ValueError, match='ratio'):
        get_unbalanced_scores(16, 8, 2, 2, ratio=0.0, device='cpu')
    with pytest.raises(ValueError, match='num_tokens'):
        get_unbalanced_scores(-1, 8, 2, 2, device='cpu')
    with pytest.raises(ValueError, match='rank_count'):
        generate_topk_idx(torch.tensor([[1, 1], [2, 1]]), 2, 4, 2, 2)


def test_edge_shapes():
    assert get_unbalanced_scores(0, 64, 8, 4, 2.0, precise=True, device='cpu').shape == (0, 64)
    single = get_unbalanced_scores(32, 16, 1, 4, 3.0, precise=True, device='cpu')
    assert ((single > 0.9).sum(dim=1) == 4).all()
    assert get_unbalanced_scores(32, 16, 1, 4, 3.0, device='cpu').shape == (32, 16)


def test_precise_speed_and_determinism():
    torch.manual_seed(7)
    start = time.perf_counter()
    a = get_unbalanced_scores(4096, 256, 8, 8, 2.0, precise=True, device='cpu')
    assert time.perf_counter() - start < 10  # typically well under a second
    torch.manual_seed(7)
    assert torch.equal(a, get_unbalanced_scores(4096, 256, 8, 8, 2.0, precise=True, device='cpu'))


# Random mode: only statistical. The bisection evaluates each factor on a fresh 4096-token sample and the final scores
# are yet another sample, so the achieved ratio scatters by a few percent (seen over 15 seeds of each case below:
# within 4.6%, worst at ratio 4); 15% leaves room for unlucky seeds. The other ranks are balanced only in expectation
# (seen: max/min up to 1.11), so the bound there is 1.2, not the precise mode's 1.02.
@pytest.mark.parametrize('ratio', [1.0, 1.5, 2.0, 4.0])
@pytest.mark.parametrize('num_ranks,num_topk,num_experts', [(8, 8, 256), (4, 6, 64)])
def test_random_ratio(ratio, num_ranks, num_topk, num_experts):
    torch.manual_seed(int(ratio * 10) + num_ranks)
    scores = get_unbalanced_scores(4096, num_experts, num_ranks, num_topk, ratio, device='cpu')
    assert scores.shape == (4096, num_experts) and scores.dtype == torch.float32
    hot_ratio, inequality, _ = routing_stats(scores, num_ranks, num_topk)
    assert abs(hot_ratio / ratio - 1) < 0.15, f'{hot_ratio=} for {ratio=}'
    assert inequality < 1.2
    # Rank 0's experts are stretched by the factor, the others stay in [0, 1)
    assert (scores[:, num_experts // num_ranks:] < 1).all()
    if ratio == 1.0:
        assert (scores < 1).all()


def test_random_rejects_cold_rank():
    with pytest.raises(ValueError, match='precise=True'):
        get_unbalanced_scores(64, 16, 4, 2, ratio=0.5, device='cpu')


@pytest.mark.gpu
@pytest.mark.parametrize('ratio', [1.0, 2.0, 4.0])
def test_precise_on_cuda(ratio):
    if not torch.cuda.is_available():
        pytest.skip('torch without CUDA')
    torch.manual_seed(0)
    scores = get_unbalanced_scores(4096, 256, 8, 8, ratio, precise=True)
    assert scores.is_cuda
    hot_ratio, inequality, _ = routing_stats(scores, 8, 8)
    assert abs(hot_ratio / ratio - 1) < 0.01 and inequality < 1.02
    assert ((scores > 0.9).sum(dim=1) == 8).all()
    random_scores = get_unbalanced_scores(4096, 256, 8, 8, ratio)
    assert random_scores.is_cuda and abs(routing_stats(random_scores, 8, 8)[0] / ratio - 1) < 0.15
