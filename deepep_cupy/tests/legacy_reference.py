"""Host references of DeepEP V1's normal mode (`get_dispatch_layout`, `dispatch` with its 6-tuple handle, `combine`),
built from every rank's inputs gathered on the host (CPU torch, no GPU, no code under test).

The combine inputs of the rank programs are a function of what a rank received: rank d sends back
`bf16(float(row) * combine_factor(d))` for every row it received, so the expected result of a rank needs only its own
tokens (`combine`).
"""

from typing import List, NamedTuple, Optional, Sequence

import torch


def owners(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """`[N, K]` int64: the rank owning each top-k slot's expert, -1 for ids outside `[0, num_experts)`."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    return torch.where(valid, topk_idx // (num_experts // num_ranks), -1)


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """`get_dispatch_layout`'s `(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
    is_token_in_rank [N, R] bool)`."""
    own = owners(topk_idx, num_experts, num_ranks)
    in_rank = torch.stack([(own == r).any(1) for r in range(num_ranks)], 1) if topk_idx.shape[0] else \
        torch.zeros((0, num_ranks), dtype=torch.bool)
    per_expert = torch.bincount(topk_idx[(topk_idx >= 0) & (topk_idx < num_experts)].flatten(),
                                minlength=num_experts).to(torch.int32)
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


def synthetic_topk(in_rank: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The top-k ids a dispatch without top-k routes by: column r = r's first expert where the token goes to r."""
    R = in_rank.shape[1]
    return torch.where(in_rank, torch.arange(R) * (num_experts // R), -1)


def rank_prefix_matrix(in_ranks: Sequence[torch.Tensor]) -> torch.Tensor:
    """`[R, R]` int32: `M[i][j]` = tokens ranks 0..i send to rank j."""
    counts = torch.stack([m.sum(0) for m in in_ranks]).to(torch.int64)
    return torch.cumsum(counts, 0).to(torch.int32)


def channel_prefix_matrix(in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """`[R, C]` int32: per destination, the inclusive prefix over V1's channels (channel c = tokens
    `[c * ceil(N / C), ...)`) of the tokens sent there."""
    N, R = in_rank.shape
    per = -(-N // num_channels) if N else 0
    out = torch.zeros((R, num_channels), dtype=torch.int32)
    for c in range(num_channels):
        end = min(N, (c + 1) * per)
        out[:, c] = in_rank[:end].sum(0).to(torch.int32)
    return out


def recv_channel_prefix_matrix(in_ranks: Sequence[torch.Tensor], rank: int, num_channels: int) -> torch.Tensor:
    """`[R, C]` int32: per source, where its channel c starts inside its block of `rank`'s rows."""
    out = torch.zeros((len(in_ranks), num_channels), dtype=torch.int32)
    for s, m in enumerate(in_ranks):
        prefix = channel_prefix_matrix(m, num_channels)[rank]
        out[s, 1:] = prefix[:-1]
    return out


def send_head(in_rank: torch.Tensor) -> torch.Tensor:
    """`[N, R]` int32: token t's position among this rank's tokens going to r, -1 if it does not go there."""
    pos = torch.cumsum(in_rank.to(torch.int64), 0) - 1
    return torch.where(in_rank, pos, -1).to(torch.int32)


class DispatchRef(NamedTuple):
    """What one rank receives: rows grouped by source rank, then in token order."""
    recv_x: torch.Tensor
    recv_sf: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]       # local expert id or -1 (int64)
    recv_topk_weights: Optional[torch.Tensor]   # float32, 0 where -1
    recv_src_idx: torch.Tensor                  # int32: token index at the source
    src_rank: torch.Tensor                      # int64: the source of each row
    expert_counts: List[int]                    # received (token, slot) pairs per local expert (unaligned)


def dispatch(xs: Sequence[torch.Tensor], sfs: Optional[Sequence[torch.Tensor]], topks: Sequence[torch.Tensor],
             weights: Optional[Sequence[torch.Tensor]], in_ranks: Sequence[torch.Tensor], rank: int,
             num_experts: int, per_experts: Optional[Sequence[torch.Tensor]] = None) -> DispatchRef:
    """The rows `rank` receives; `topks` None-free (pass `synthetic_topk` for a dispatch without top-k, with the
    ranks' `num_tokens_per_expert` as `per_experts`: the per-expert counts then come from them)."""
    R = len(xs)
    L = num_experts // R
    parts = {k: [] for k in ('x', 'sf', 'idx', 'w', 'src', 'rank')}
    for s in range(R):
        rows = in_ranks[s][:, rank].nonzero(as_tuple=True)[0]
        parts['x'].append(xs[s][rows])
        if sfs is not None:
            parts['sf'].append(sfs[s][rows].contiguous())
        t = topks[s][rows]
        local = owners(t, num_experts, R) == rank
        parts['idx'].append(torch.where(local, t - rank * L, -1))
        if weights is not None:
            parts['w'].append(torch.where(local, weights[s][rows], torch.zeros_like(weights[s][rows])))
        parts['src'].append(rows.to(torch.int32))
        parts['rank'].append(torch.full((rows.numel(),), s, dtype=torch.int64))
    recv_idx = torch.cat(parts['idx'])
    if per_experts is not None:
        counts = [int(sum(int(p[rank * L + j]) for p in per_experts)) for j in range(L)]
    else:
        counts = [int((recv_idx == j).sum()) for j in range(L)]
    return DispatchRef(torch.cat(parts['x']), torch.cat(parts['sf']) if sfs is not None else None, recv_idx,
                       torch.cat(parts['w']) if weights is not None else None, torch.cat(parts['src']),
                       torch.cat(parts['rank']), counts)


def aligned(counts: Sequence[int], alignment: int) -> List[int]:
    return [-(-c // alignment) * alignment for c in counts]


def combine_factor(rank: int) -> float:
    """Rank d sends back each received row times this (exact in float32: a multiple of 1/4)."""
    return (rank + 1) * 0.25


def combine_rows(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """What `rank` passes to combine for its received bfloat16 rows (run on the GPU or the host: same bits)."""
    return (rows.float() * combine_factor(rank)).to(torch.bfloat16)


def weights_rows(recv_weights: torch.Tensor, recv_topk_idx: torch.Tensor, rank: int) -> torch.Tensor:
    """The top-k weights `rank` passes to combine: the dispatch's where the slot is local, `(rank + 1) / 2` elsewhere
    (as DeepEP's test overwrites the non-local slots, so that V1's sum over ranks shows)."""
    return torch.where(recv_topk_idx >= 0, recv_weights, torch.full_like(recv_weights, (rank + 1) * 0.5))


def dest_orders(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """`(by_last, by_first)`, `[N, R]` int64 each: per token its destination ranks in order of their last (first)
    top-k slot, padded with -1."""
    N = topk_idx.shape[0]
    by_last = torch.full((N, num_ranks), -1, dtype=torch.int64)
    by_first = by_last.clone()
    for t, row in enumerate(owners(topk_idx, num_experts, num_ranks).tolist()):
        first, last = {}, {}
        for k, d in enumerate(row):
            if d >= 0:
                first.setdefault(d, k)
                last[d] = k
        for i, d in enumerate(sorted(last, key=last.get)):
            by_last[t, i] = d
        for i, d in enumerate(sorted(first, key=first.get)):
            by_first[t, i] = d
    return by_last, by_first


def combine(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, num_ranks: int, bias=(),
            weights_of_rank=None):
    """`(combined_x, combined_topk_weights or None)` of this rank's tokens: FP32 `bias_0 + bias_1`, then every
    destination rank d's row `combine_rows(x[t], d)` in order of d's last top-k slot, one rounding; weights: FP32 from
    0, over the destinations in order of their first top-k slot, of what each sent back (`weights_of_rank(d)`: `[N, K]`
    float32, row t = what rank d returns for token t).

    Args:
        x: `[N, H]` bfloat16, this rank's tokens (the rows every destination received).
        topk_idx: `[N, K]` the dispatch's top-k ids (synthetic ones for a dispatch without top-k).
        bias: 0, 1 or 2 `[N, H]` bfloat16 tensors.
        weights_of_rank: `fn(d) -> [N, K] float32`, or None (no weights).
    """
    N, H = x.shape
    by_last, by_first = dest_orders(topk_idx, num_experts, num_ranks)
    acc = torch.zeros((N, H), dtype=torch.float32)
    for b in bias:
        acc = acc + b.float()
    for i in range(num_ranks):
        d = by_last[:, i]
        factor = ((d + 1).to(torch.float32) * 0.25).unsqueeze(1)
        rows = (x.float() * factor).to(torch.bfloat16).float()
        acc = torch.where((d >= 0).unsqueeze(1), acc + rows, acc)
    if weights_of_rank is None:
        return acc.to(torch.bfloat16), None
    per_rank = torch.stack([weights_of_rank(d) for d in range(num_ranks)])      # [R, N, K]
    w = torch.zeros(topk_idx.shape, dtype=torch.float32)
    for i in range(num_ranks):
        d = by_first[:, i]
        got = per_rank[d.clamp(min=0), torch.arange(N)]
        w = torch.where((d >= 0).unsqueeze(1), w + got, w)
    return acc.to(torch.bfloat16), w


def domain_orders(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, num_domains: int):
    """`(by_last, by_first)`, `[N, D, S]` int64 each (D domains of S = R / D ranks): per token its destination domains
    in order of their last (first) top-k slot (a domain's = the last (first) slot of any of its ranks), and inside each
    its destination ranks in order of their last (first) top-k slot, padded with -1. The order of V1's two-level
    combine across scale-up domains (rows per domain, then the domains' partials); one domain: `dest_orders`'."""
    S, D = num_ranks // num_domains, num_domains
    by = {}
    for name, pick in (('last', max), ('first', min)):
        out = torch.full((topk_idx.shape[0], D, S), -1, dtype=torch.int64)
        for t, row in enumerate(owners(topk_idx, num_experts, num_ranks).tolist()):
            slot = {}
            for k, d in enumerate(row):
                if d >= 0:
                    slot[d] = k if name == 'last' or d not in slot else slot[d]
            doms = {}
            for d, k in slot.items():
                doms[d // S] = pick(doms.get(d // S, k), k)
            for i, m in enumerate(sorted(doms, key=doms.get)):
                for j, d in enumerate(sorted((d for d in slot if d // S == m), key=slot.get)):
                    out[t, i, j] = d
        by[name] = out
    return by['last'], by['first']
