"""Router scores with a controlled load imbalance: rank 0 is the "hot" rank that receives about `ratio` times the tokens
of each other rank (a token counts once per rank it sends at least one expert to).

Two modes, as upstream:

- random: every score is uniform, rank 0's experts' scores are stretched by a factor found by bisection; the achieved
  ratio is only statistical (a few percent off at 4096 tokens).
- precise: an exact per-token, per-rank expert-count matrix is built first (`generate_rank_count`), concrete experts are
  drawn from it (`generate_topk_idx`), and the scores make exactly those experts the top-k.

All randomness comes from torch's global generator of `device`, so callers seed it (`init_seed`).
"""

from typing import Optional, Union

import torch

# Precise mode: the chosen experts score in (THRESHOLD, 1], all others in [0, THRESHOLD).
THRESHOLD = 0.9
# Random mode: bisection bounds and steps of the factor that stretches rank 0's scores.
FACTOR_RANGE = (1.0, 100.0)
NUM_BISECT_ITERATIONS = 20


def _default_device(device: Optional[Union[str, torch.device]]) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device('cuda' if torch.cuda.is_available() else 'cpu')


def _check_args(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float) -> None:
    for name, value in (('num_tokens', num_tokens), ('num_experts', num_experts), ('num_ranks', num_ranks),
                        ('num_topk', num_topk)):
        if not isinstance(value, int) or value < (0 if name == 'num_tokens' else 1):
            raise ValueError(f'{name} must be a {"non-negative" if name == "num_tokens" else "positive"} int, '
                             f'got {value!r}')
    if num_experts % num_ranks != 0:
        raise ValueError(f'num_experts={num_experts} must be divisible by num_ranks={num_ranks}')
    if num_topk > num_experts:
        raise ValueError(f'num_topk={num_topk} cannot exceed num_experts={num_experts}')
    if not ratio > 0:
        raise ValueError(f'ratio must be positive, got {ratio!r}')


def count_tokens_per_rank(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """Number of tokens that send at least one expert to each rank (entries < 0 are ignored).

    Args:
        topk_idx: `[num_tokens, num_topk]`, int64, expert indices or -1.
        num_experts: total number of experts (divisible by `num_ranks`).
        num_ranks: number of ranks.

    Returns:
        `[num_ranks]`, int64.
    """
    rank_idx = torch.where(topk_idx >= 0, topk_idx // (num_experts // num_ranks), num_ranks)
    hit = torch.zeros((topk_idx.size(0), num_ranks + 1), dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, rank_idx, True)
    return hit[:, :num_ranks].sum(dim=0)


# Random mode
def get_scores_by_factor(num_tokens: int, num_experts: int, num_ranks: int, factor: float,
                         device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """Uniform scores, with rank 0's experts drawn from U[0, factor) instead of U[0, 1).

    Returns:
        `[num_tokens, num_experts]`, float32.
    """
    scores = torch.rand((num_tokens, num_experts), dtype=torch.float32, device=_default_device(device))
    scores[:, :num_experts // num_ranks] *= factor
    return scores


def map_unbalanced_ratio_to_factor(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float,
                                   device: Optional[Union[str, torch.device]] = None) -> float:
    """Bisect the factor of `get_scores_by_factor` in [1, 100] (20 steps, a fresh sample each) so that rank 0's token
    count is about `ratio` times the mean of the other ranks'.

    Returns:
        the lower end of the final bracket.
    """
    # The bracket lives on the device and moves with `torch.where`: the 20 steps queue without a host sync, and the
    # one `.item()` at the end waits for all of them (DeepEP's test_gate calls this tens of thousands of times).
    device = _default_device(device)
    factor_lo = torch.tensor(FACTOR_RANGE[0], dtype=torch.float64, device=device)
    factor_hi = torch.tensor(FACTOR_RANGE[1], dtype=torch.float64, device=device)
    num_experts_per_rank = num_experts // num_ranks
    for _ in range(NUM_BISECT_ITERATIONS):
        factor_mid = (factor_lo + factor_hi) / 2
        scores = torch.rand((num_tokens, num_experts), dtype=torch.float32, device=device)
        scores[:, :num_experts_per_rank] *= factor_mid.float()
        topk_idx = torch.topk(scores, num_topk, dim=1).indices
        counts = count_tokens_per_rank(topk_idx, num_experts, num_ranks).float()
        too_hot = counts[0] > counts[1:].mean() * ratio
        factor_hi = torch.where(too_hot, factor_mid, factor_hi)
        factor_lo = torch.where(too_hot, factor_lo, factor_mid)
    return float(factor_lo.item())


# Precise mode
def _num_ranks_per_token(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int,
                         device: torch.device) -> torch.Tensor:
    """How many distinct ranks each token of a balanced random router touches (the natural distribution)."""
    topk_idx = torch.topk(torch.rand((num_tokens, num_experts), device=device), num_topk, dim=1).indices
    hit = torch.zeros((num_tokens, num_ranks), dtype=torch.bool, device=device)
    hit.scatter_(1, topk_idx // (num_experts // num_ranks), True)
    return hit.sum(dim=1)


def generate_rank_count(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float,
                        device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """An exact per-token expert count per rank in which rank 0 is hit by `ratio` times as many tokens as each other
    rank, and the other ranks are hit equally (±1 token).

    Construction (every step keeps each row a valid routing):

    1. `a[t]`, the number of distinct ranks token `t` touches, is sampled from a balanced random router, then clamped
       to `[ceil(num_topk / experts_per_rank), a_max]`. With `ratio ≥ 1`, `a_max = floor((R - 1) / ratio) + 1`
       guarantees rank 0 never needs more than `num_tokens` hits; with `ratio < 1`, `a_max = R - 1` so no token is
       forced onto rank 0.
    2. With `S = Σ a[t]`, rank 0 gets `h0 = round(ratio · S / (R - 1 + ratio))` tokens, so each other rank gets
       `(S - h0) / (R - 1)` and the ratio is exact up to rounding `h0`. Tokens with `a[t] = R` must be among them; the
       rest are drawn at random.
    3. The other ranks are dealt by writing a random cyclic order of ranks 1..R-1 along a line and giving each token (in
       random order) the next `a[t] - [t hits rank 0]` consecutive labels: a window never exceeds R - 1 labels, so a
       token's ranks are distinct, and every rank appears `floor` or `ceil` of `(S - h0) / (R - 1)` times.
    4. Each touched rank gets one expert; the remaining `num_topk - a[t]` experts go to uniformly random free expert
       slots of the touched ranks (capacity `experts_per_rank` each).

    So the other ranks' counts differ by at most 1 (max/min < 1.02 once each gets ≥ 50 tokens) and rank 0's count
    over their mean equals `ratio` up to `0.5 / h0` relative error, whenever `ratio` is reachable at all.

    Args:
        num_tokens, num_experts, num_ranks, num_topk: the routing problem (`num_experts % num_ranks == 0`).
        ratio: rank 0's token count over the mean of the other ranks' (> 0).
        device: where to build it (default: CUDA if available, else CPU).

    Returns:
        `[num_tokens, num_ranks]`, int32, rows summing to `num_topk`, entries at most `num_experts // num_ranks`.

    Raises:
        ValueError: arguments out of range, or a `ratio` no routing can reach (e.g. one expert per rank).
    """
    _check_args(num_tokens, num_experts, num_ranks, num_topk, ratio)
    device = _default_device(device)
    num_experts_per_rank = num_experts // num_ranks
    if num_ranks == 1:
        return torch.full((num_tokens, 1), num_topk, dtype=torch.int32, device=device)

    # 1. Ranks per token
    a_min = -(-num_topk // num_experts_per_rank)
    a_max = min(num_ranks - 1, num_topk) if ratio < 1 else min(num_ranks, num_topk, int((num_ranks - 1) / ratio) + 1)
    if a_min > a_max:
        raise ValueError(f'ratio={ratio} is unreachable: every token needs at least {a_min} ranks '
                         f'(num_topk={num_topk}, {num_experts_per_rank} experts per rank, {num_ranks} ranks)')
    a = _num_ranks_per_token(num_tokens, num_experts, num_ranks, num_topk, device).clamp(a_min, a_max)

    # 2. Which tokens hit rank 0: all that touch every rank, then random others
    total = int(a.sum().item())
    must = a == num_ranks
    num_hot = round(ratio * total / (num_ranks - 1 + ratio))
    num_hot = max(int(must.sum().item()), min(num_tokens, num_hot))
    priority = torch.rand(num_tokens, device=device) + must.float()
    hot = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    hot[torch.topk(priority, num_hot).indices] = True

    # 3. Deal the other ranks as windows over a repeated random cyclic order
    num_others = num_ranks - 1
    b = a - hot.long()
    token_order = torch.randperm(num_tokens, device=device)
    b_ordered = b[token_order]
    starts = torch.cumsum(b_ordered, 0) - b_ordered + int(torch.randint(num_others, ()).item())
    offsets = torch.arange(num_others, device=device)
    positions = starts.unsqueeze(1) + offsets.unsqueeze(0)
    cycle = torch.randperm(num_others, device=device) + 1
    labels = torch.where(offsets.unsqueeze(0) < b_ordered.unsqueeze(1), cycle[positions % num_others], 0)
    member = torch.zeros((num_tokens, num_ranks), dtype=torch.bool, device=device)
    member[token_order] = torch.zeros_like(member).scatter_(1, labels, True)
    member[:, 0] = hot

    # 4. One expert per touched rank, the rest on random free slots of touched ranks
    slot_scores = torch.rand((num_tokens, num_ranks, num_experts_per_rank), device=device)
    slot_scores[:, :, 0] += 2
    slot_scores.masked_fill_(~member.unsqueeze(2), -1)
    chosen = torch.topk(slot_scores.view(num_tokens, num_experts), num_topk, dim=1).indices
    rank_count = torch.zeros((num_tokens, num_ranks), dtype=torch.int32, device=device)
    rank_count.scatter_add_(1, chosen // num_experts_per_rank, torch.ones_like(chosen, dtype=torch.int32))
    return rank_count


def generate_topk_idx(rank_count: torch.Tensor, num_tokens: int, num_experts: int, num_ranks: int,
                      num_topk: int) -> torch.Tensor:
    """Concrete distinct experts for a per-token, per-rank count matrix (uniform among each rank's experts).

    Args:
        rank_count: `[num_tokens, num_ranks]`, integer, rows summing to `num_topk`, entries at most
            `num_experts // num_ranks`.
        num_tokens, num_experts, num_ranks, num_topk: the routing problem (`num_experts % num_ranks == 0`).

    Returns:
        `[num_tokens, num_topk]`, int64, experts ascending by rank (random order within a rank).
    """
    if tuple(rank_count.shape) != (num_tokens, num_ranks):
        raise ValueError(f'rank_count must be [num_tokens={num_tokens}, num_ranks={num_ranks}], '
                         f'got {tuple(rank_count.shape)}')
    num_experts_per_rank = num_experts // num_ranks
    if num_experts_per_rank * num_ranks != num_experts:
        raise ValueError(f'num_experts={num_experts} must be divisible by num_ranks={num_ranks}')
    if ((rank_count.sum(dim=1) != num_topk).any() or (rank_count < 0).any()
            or (rank_count > num_experts_per_rank).any()):
        raise ValueError(f'rank_count rows must sum to num_topk={num_topk} and hold counts in '
                         f'[0, num_experts // num_ranks = {num_experts_per_rank}]')
    device = rank_count.device
    local_order = torch.rand((num_tokens, num_ranks, num_experts_per_rank), device=device).argsort(dim=2)
    selected = torch.arange(num_experts_per_rank, device=device) < rank_count.unsqueeze(2).long()
    expert_idx = local_order + (torch.arange(num_ranks, device=device) * num_experts_per_rank).view(1, -1, 1)
    return expert_idx.masked_select(selected).view(num_tokens, num_topk)


def get_precise_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float,
                                  device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """Scores whose top-k is exactly `generate_topk_idx(generate_rank_count(...))`: chosen experts score in
    (0.9, 1], all others in [0, 0.9). See `get_unbalanced_scores`."""
    device = _default_device(device)
    rank_count = generate_rank_count(num_tokens, num_experts, num_ranks, num_topk, ratio, device)
    topk_idx = generate_topk_idx(rank_count, num_tokens, num_experts, num_ranks, num_topk)
    scores = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=device).uniform_(0, THRESHOLD)
    topk_scores = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=device)
    topk_scores.uniform_(THRESHOLD + 1e-6, 1.0)
    scores.scatter_(1, topk_idx, topk_scores)
    return scores


def get_random_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float,
                                 device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """Uniform scores with rank 0's experts stretched by the bisected factor (factor 1 when `ratio == 1`).
    See `get_unbalanced_scores`."""
    factor = 1.0
    if ratio != 1.0 and num_ranks > 1:
        factor = map_unbalanced_ratio_to_factor(num_tokens, num_experts, num_ranks, num_topk, ratio, device)
    return get_scores_by_factor(num_tokens, num_experts, num_ranks, factor, device)


def get_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float = 1.0,
                          precise: bool = False, device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """Router scores under which rank 0 receives about `ratio` times the tokens of each other rank.

    Take `torch.topk(scores, num_topk)` to route. In precise mode the ratio is met within `0.5 / h0` (h0 = rank 0's
    token count) and the other ranks are hit within ±1 token of each other; in random mode both hold only in
    expectation (the bisection works on noisy samples: expect a few percent off, more for small `num_tokens`).

    Args:
        num_tokens: number of tokens (rows).
        num_experts: number of experts, divisible by `num_ranks`; experts `[r·E/R, (r+1)·E/R)` live on rank `r`.
        num_ranks: number of ranks.
        num_topk: experts per token.
        ratio: rank 0's token count over the mean of the other ranks'; random mode needs `ratio ≥ 1` (its factor
            only stretches rank 0's scores upwards), precise mode accepts any positive value it can reach.
        precise: build exact counts instead of bisecting a score factor.
        device: where to create the scores (default: CUDA if available, else CPU).

    Returns:
        `[num_tokens, num_experts]`, float32.
    """
    _check_args(num_tokens, num_experts, num_ranks, num_topk, ratio)
    if precise:
        return get_precise_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio, device)
    if ratio < 1:
        raise ValueError(f'ratio={ratio} below 1 needs precise=True (random mode can only make rank 0 hotter)')
    return get_random_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio, device)
