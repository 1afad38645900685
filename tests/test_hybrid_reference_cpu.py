"""The host reference of the fused hybrid design (tests/references/hybrid_reference.py, hybrid_combine_reference.py)
against the package's one-domain references: dispatch rows equal `refs.dispatch_from_gathered` up to the hybrid row
order, the expanded layout equals `refs.expanded_layout` of the hybrid rows, and combine equals `refs.combine` bit for
bit for DeepEP's three recipes, for 2x1, 2x2, 2x4, 4x1 and 4x2 domains x ranks with -1 slots, 0-token ranks and
unbalanced routing."""

import numpy as np
import pytest

torch = pytest.importorskip('torch')

from references import hybrid_combine_reference as cref  # noqa: E402
from references import hybrid_reference as href  # noqa: E402

from deepep_cupy.utils import refs  # noqa: E402

SHAPES = [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


def make_job(num_domains, num_scaleup, seed, num_local_experts=3, num_topk=4, num_max_tokens=12, hidden=16):
    """Top-k ids per rank: distinct experts per token, skewed towards low experts (unbalanced), ~15% -1 slots,
    rank 1 with no tokens and one rank with M tokens."""
    rng = np.random.default_rng(seed)
    W = num_domains * num_scaleup
    E = W * num_local_experts
    K = min(num_topk, E)
    shape = href.HybridShape(num_domains, num_scaleup, E, num_max_tokens, K)
    prob = np.exp(-np.arange(E) / (0.4 * E))
    prob /= prob.sum()
    topk_idxs = []
    for g in range(W):
        T = 0 if g == 1 else (num_max_tokens if g == W - 1 else int(rng.integers(1, num_max_tokens + 1)))
        t = np.stack([rng.choice(E, size=K, replace=False, p=prob) for _ in range(T)]) if T else \
            np.zeros((0, K), dtype=np.int64)
        t = np.where(rng.random(t.shape) < 0.15, -1, t).astype(np.int64)
        topk_idxs.append(t)
    xs = [torch.randn(t.shape[0], hidden).to(torch.bfloat16) for t in topk_idxs]
    ws = [torch.rand(t.shape, dtype=torch.float32) for t in topk_idxs]
    return shape, topk_idxs, xs, ws


@pytest.mark.parametrize('num_domains,num_scaleup', SHAPES)
@pytest.mark.parametrize('seed', [0, 1])
def test_dispatch_matches_refs_up_to_the_hybrid_row_order(num_domains, num_scaleup, seed):
    shape, topk_idxs, xs, ws = make_job(num_domains, num_scaleup, seed)
    A, L, M, R = 4, shape.num_local_experts, shape.num_max_tokens_per_rank, num_scaleup
    d = href.dispatch(shape, topk_idxs, expert_alignment=A, do_expand=True)
    for rank in range(shape.num_ranks):
        ref = refs.dispatch_from_gathered(xs, None, [torch.from_numpy(t) for t in topk_idxs], ws, rank, M,
                                          shape.num_experts)
        src = ref.recv_src_token_global_idx.long().numpy()
        perm = href.hybrid_row_order(src // M, src % M, R)
        rec = d.recv[rank]
        assert np.array_equal(rec.recv_src_rank, src[perm] // M)
        assert np.array_equal(rec.recv_src_token_idx, src[perm] % M)
        assert np.array_equal(rec.recv_src_metadata[:, 0], src[perm])
        assert np.array_equal(rec.recv_topk_idx, ref.recv_topk_idx.numpy()[perm])
        recv_x = torch.stack([xs[s][t] for s, t in zip(rec.recv_src_rank, rec.recv_src_token_idx)]) \
            if rec.recv_src_rank.size else torch.zeros(0, xs[0].shape[1], dtype=torch.bfloat16)
        assert torch.equal(recv_x, ref.recv_x[torch.from_numpy(perm)])
        # psum_num_recv_tokens_per_scaleup_rank: segment r = every source with scale-up index r
        per_src = ref.num_recv_tokens_per_rank.numpy()
        expect_psum = np.cumsum([per_src[r::R].sum() for r in range(R)])
        assert np.array_equal(rec.layout.psum_num_recv_tokens_per_scaleup_rank, expect_psum)
        # Per-expert counts and the expanded layout, against refs on the hybrid-ordered rows
        local_topk = torch.from_numpy(rec.recv_topk_idx)
        counts = refs.expected_expert_counts(local_topk, L)
        assert np.array_equal(rec.layout.num_unaligned_recv_tokens_per_expert, counts.numpy())
        assert rec.layout.num_recv_tokens_per_expert_list == refs.aligned_expert_counts(counts, A)
        ex = refs.expanded_layout(local_topk, L, A)
        assert rec.layout.num_expanded_tokens == ex.num_expanded_tokens
        assert np.array_equal(rec.layout.psum_num_recv_tokens_per_expert, ex.psum_num_recv_tokens_per_expert)
        assert np.array_equal(rec.expanded_row_src, ex.row_src.numpy())
        assert np.array_equal(rec.expanded_row_slot, ex.row_slot.numpy())
        assert np.array_equal(rec.recv_src_metadata[:, 2:], ex.topk_to_expanded_row.numpy())
    # The worst case holds every real count
    worst_rows, worst_expanded = href.worst_case_rows(shape, A)
    assert all(r.layout.num_recv_tokens <= worst_rows and r.layout.num_expanded_tokens <= worst_expanded
               for r in d.recv)


@pytest.mark.parametrize('num_domains,num_scaleup', SHAPES)
def test_rails_dedup_and_forward_positions(num_domains, num_scaleup):
    shape, topk_idxs, _, _ = make_job(num_domains, num_scaleup, 7)
    d = href.dispatch(shape, topk_idxs)
    N, R, L = num_domains, num_scaleup, shape.num_local_experts
    total_rail, total_naive = 0, 0
    for s, topk in enumerate(topk_idxs):
        n, r = divmod(s, R)
        owner = np.where(topk >= 0, topk // L, -1)
        for m in range(N):
            goes = np.array([((owner[t] >= 0) & (owner[t] // R == m)).any() for t in range(topk.shape[0])], bool)
            f = m * R + r
            meta = d.token_metadata_at_forward[f][n]
            assert np.array_equal(meta[:goes.sum(), 0], np.nonzero(goes)[0]) and (meta[goes.sum():, 0] == -1).all()
            if m == n:
                assert (s, f) not in d.rails
                continue
            msgs = d.rails[(s, f)]
            # Once per (token, destination domain), in ascending token order, to the rank with the same index
            assert [x.src_token_idx for x in msgs] == np.nonzero(goes)[0].tolist()
            total_rail += len(msgs)
            for p, msg in enumerate(msgs):
                t = msg.src_token_idx
                assert d.routings[s].domain_pos[t, m] == p
                for lo in range(R):
                    on_rank = ((owner[t] >= 0) & (owner[t] == m * R + lo)).any()
                    assert (msg.forward_slots[lo] >= 0) == on_rank
                    if on_rank:
                        # The slot is the token's position among s's tokens going to (m, lo)
                        to_rank = [u for u in range(topk.shape[0]) if (owner[u] == m * R + lo).any()]
                        assert msg.forward_slots[lo] == to_rank.index(t)
                        total_naive += 1
            # The rail notify block: counts of every rank of domain m and of their experts
            block = d.routings[s].notify_blocks[m]
            assert block.shape == (R, 1 + L)
            assert block[:, 0].sum() == sum(len({o for o in owner[t] if o >= 0 and o // R == m})
                                            for t in range(topk.shape[0]))
    assert total_rail <= total_naive        # dedup: never more rail messages than rank-level sends
    # The notify counts every rank holds cover exactly what it receives, region by region
    for rec in d.recv:
        assert rec.layout.num_recv_tokens == rec.recv_src_rank.size
        regions = np.array([shape.region_of(int(s)) for s in rec.recv_src_rank], dtype=np.int64)
        assert np.array_equal(np.bincount(regions, minlength=shape.num_ranks), rec.layout.num_recv_per_region)
        assert (np.diff(regions) >= 0).all()          # rows in region order r * N + n


def _expected_weights(d, ws_recv, shape, origin):
    """combined_topk_weights of `origin`: slot k's weight as its owner rank returned it (0 for -1)."""
    topk = d.routings[origin].topk_idx
    out = np.zeros(topk.shape, dtype=np.float32)
    for t in range(topk.shape[0]):
        for k in range(topk.shape[1]):
            if topk[t, k] < 0:
                continue
            owner = int(topk[t, k]) // shape.num_local_experts
            rec = d.recv[owner]
            i = np.nonzero((rec.recv_src_rank == origin) & (rec.recv_src_token_idx == t))[0][0]
            out[t, k] = ws_recv[owner][i, k]
    return out


def order_sensitive(num_tokens, num_topk, hidden, gen):
    """`[num_tokens, num_topk, hidden]` bfloat16 partials whose FP32 sums depend on the order of the additions:
    +-(1 + m/8) * 2^e with e in {1, 0, -23, -24, -25} (1 + 2^-24 rounds to 1, 2^-24 + 2^-24 does not), so any reordering
    of a sum of three or more terms shows in the bits."""
    pick = torch.randint(0, 5, (num_tokens, num_topk, hidden), generator=gen)
    e = torch.tensor([1.0, 0.0, -23.0, -24.0, -25.0])[pick]
    m = 1 + torch.randint(0, 8, e.shape, generator=gen).float() / 8
    sign = torch.where(torch.rand(e.shape, generator=gen) < 0.5, -1.0, 1.0)
    return (sign * m * torch.exp2(e)).to(torch.bfloat16)


RECIPES = [(False, True, True), (False, True, False), (True, True, True), (True, False, False)]


@pytest.mark.parametrize('num_domains,num_scaleup', SHAPES)
@pytest.mark.parametrize('do_expand,reduce_in_local,reduce_in_scaleup', RECIPES)
def test_combine_is_bitwise_refs_combine(num_domains, num_scaleup, do_expand, reduce_in_local, reduce_in_scaleup):
    shape, topk_idxs, _, _ = make_job(num_domains, num_scaleup, 11, num_topk=6, hidden=24)
    N, R, K, H, L = num_domains, num_scaleup, shape.num_topk, 24, shape.num_local_experts
    gen = torch.Generator().manual_seed(5)
    ys = [order_sensitive(t.shape[0], K, H, gen) for t in topk_idxs]
    for y in ys:
        if y.shape[0] > 1:
            y[0, :, :4] = -0.0
            y[1, 1] = -y[1, 0]
    d = href.dispatch(shape, topk_idxs, expert_alignment=2, do_expand=do_expand)
    xs, ws, ws_recv = [], [], []
    for rec in d.recv:
        y_recv = torch.stack([ys[s][t] for s, t in zip(rec.recv_src_rank, rec.recv_src_token_idx)]) \
            if rec.recv_src_rank.size else torch.zeros(0, K, H, dtype=torch.bfloat16)
        w_recv = torch.rand(y_recv.shape[:2], generator=gen)
        local = torch.from_numpy(rec.recv_topk_idx)
        if do_expand:
            ex = refs.expanded_layout(local, L, 2)
            xs.append(_bits(refs.expand_slots(y_recv, ex)))
            ws.append(refs.expand_slots(w_recv, ex).numpy())
        else:
            xs.append(_bits(refs.reduce_local_slots(y_recv, local)))
            ws.append(w_recv.numpy())
        ws_recv.append(w_recv.numpy())
    biases = []
    for o, t in enumerate(topk_idxs):
        nb = o % 3
        biases.append([_bits((torch.randn(t.shape[0], H, generator=gen) * 2.0 ** (5 * j)).to(torch.bfloat16))
                       for j in range(nb)])
    out = cref.combine(d, xs, ws, biases, do_expand, reduce_in_local, reduce_in_scaleup)
    for o, t in enumerate(topk_idxs):
        bias = [_bf16(b) for b in biases[o]] or None
        expect = refs.combine(ys[o], torch.from_numpy(t), N, R, shape.num_experts, bias, reduce_in_local,
                              reduce_in_scaleup)
        got = out.combined_x[o]
        mismatch = np.nonzero(got != _bits(expect))
        assert mismatch[0].size == 0, (f'rank {o}: first mismatch at token {mismatch[0][0]}, column '
                                       f'{mismatch[1][0]}: expected {_bits(expect)[mismatch][0]:#06x}, got '
                                       f'{got[mismatch][0]:#06x}')
        assert np.array_equal(out.combined_topk_weights[o], _expected_weights(d, ws_recv, shape, o))
    # One rail row per (token, remote domain) when the forwarder reduces its domain
    units_per_row = {len(units) for rows in out.rail_rows.values() for units in rows.values()}
    if reduce_in_scaleup:
        assert units_per_row <= {1}
    n_rail = sum(len(rows) for rows in out.rail_rows.values())
    assert n_rail == sum(len(m) for m in d.rails.values())


def test_zero_sign_and_single_partial_rounding():
    """A -0.0 partial comes out as +0.0 (the sums start from +0.0), as in refs.combine."""
    shape = href.HybridShape(2, 1, 2, 4, 1)
    topk = [np.array([[1]], dtype=np.int64), np.zeros((0, 1), dtype=np.int64)]
    d = href.dispatch(shape, topk)
    xs = [np.zeros((0, 2), np.uint16), np.array([[0x8000, 0x3F80]], dtype=np.uint16)]
    out = cref.combine(d, xs)
    assert out.combined_x[0].tolist() == [[0x0000, 0x3F80]]
    y = torch.tensor([[[-0.0, 1.0]]], dtype=torch.bfloat16)
    assert _bits(refs.combine(y, torch.from_numpy(topk[0]), 2, 1, 2, None, True, True)).tolist() == [[0, 0x3F80]]


def test_recipe_checks():
    shape = href.HybridShape(2, 1, 2, 4, 1)
    d = href.dispatch(shape, [np.array([[0]]), np.array([[1]])])
    xs = [np.zeros((1, 8), np.uint16)] * 2
    with pytest.raises(ValueError, match='reduce_in_local must be True'):
        cref.combine(d, xs, reduce_in_local=False, reduce_in_scaleup=False)
    with pytest.raises(ValueError, match='needs reduce_in_local'):
        cref.combine(d, xs, do_expand=True, reduce_in_local=False, reduce_in_scaleup=True)
    with pytest.raises(ValueError, match='same expert twice'):
        href.route(href.HybridShape(2, 1, 4, 4, 2), np.array([[1, 1]]))
