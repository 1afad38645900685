"""CPU tests of `deepep_cupy.utils.refs`: hand-computed dispatch layouts, expert counts and the expanded layout, the
exact combine reduction order, DeepEP's pre-combine data, and the NCCL-form baselines run over a threaded fake
communicator."""

import math
import threading

import numpy as np
import pytest

torch = pytest.importorskip('torch')  # the utilities under test take torch tensors

from deepep_cupy.utils import refs

BF16 = torch.bfloat16

# Three ranks, six experts (two per rank), M = 4, top-3. Comments: destination rank of each slot.
M, E, K, H = 4, 6, 3, 8
TOPK = [
    torch.tensor([[0, 1, -1],     # r0 t0 -> ranks 0, 0 (two experts on one rank)
                  [5, 2, 3],      # r0 t1 -> 2, 1, 1
                  [-1, -1, -1]]),  # r0 t2 -> nowhere
    torch.tensor([[4, 0, 2],      # r1 t0 -> 2, 0, 1
                  [1, -1, 0]]),   # r1 t1 -> 0, 0
    torch.tensor([[2, 5, -1],     # r2 t0 -> 1, 2
                  [0, 4, 1],      # r2 t1 -> 0, 2, 0
                  [-1, 3, -1],    # r2 t2 -> 1
                  [5, 4, 3]]),    # r2 t3 -> 2, 2, 1
]
# Expected per receiving rank: (source rank, token) in order and the local top-k ids.
EXPECTED = {
    0: ([(0, 0), (1, 0), (1, 1), (2, 1)], [[0, 1, -1], [-1, 0, -1], [1, -1, 0], [0, -1, 1]], [1, 2, 1]),
    1: ([(0, 1), (1, 0), (2, 0), (2, 2), (2, 3)],
        [[-1, 0, 1], [-1, -1, 0], [0, -1, -1], [-1, 1, -1], [-1, -1, 1]], [1, 1, 3]),
    2: ([(0, 1), (1, 0), (2, 0), (2, 1), (2, 3)],
        [[1, -1, -1], [0, -1, -1], [-1, 1, -1], [-1, 0, -1], [1, 0, -1]], [1, 1, 3]),
}


def make_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Row t of rank r holds r*10 + t + column (bf16-exact), so every row is distinct.
    xs = [torch.stack([(torch.arange(H) + 10 * r + t).to(BF16) for t in range(topk.shape[0])])
          for r, topk in enumerate(TOPK)]
    # Column-major scales, as DeepEP's tests pass them.
    sfs = [torch.rand((2, t.shape[0]), generator=gen).t() for t in TOPK]
    weights = [torch.rand(t.shape, generator=gen) for t in TOPK]
    return xs, sfs, weights


@pytest.mark.parametrize('rank', [0, 1, 2])
def test_dispatch_order_dedup_and_remap(rank):
    xs, sfs, weights = make_inputs()
    ref = refs.dispatch_from_gathered(xs, sfs, TOPK, weights, rank, M, E)
    pairs, local_topk, counts = EXPECTED[rank]
    assert ref.num_recv_tokens_per_rank.tolist() == counts
    assert ref.num_recv_tokens_per_rank.dtype == torch.int32
    assert ref.recv_src_token_global_idx.tolist() == [s * M + t for s, t in pairs]
    assert ref.recv_src_token_global_idx.dtype == torch.int32
    assert ref.recv_topk_idx.tolist() == local_topk
    assert ref.recv_topk_idx.dtype == TOPK[0].dtype
    assert torch.equal(ref.recv_x, torch.stack([xs[s][t] for s, t in pairs]))
    assert torch.equal(ref.recv_sf, torch.stack([sfs[s][t] for s, t in pairs]))
    assert ref.recv_sf.is_contiguous()
    # Weights come back unmasked (the original weights of every slot).
    assert torch.equal(ref.recv_topk_weights, torch.stack([weights[s][t] for s, t in pairs]))


def test_dispatch_without_sf_and_weights():
    xs, _, _ = make_inputs()
    ref = refs.dispatch_from_gathered(xs, None, TOPK, None, 1, M, E)
    assert ref.recv_sf is None and ref.recv_topk_weights is None
    assert ref.recv_x.shape == (5, H)


def test_dispatch_counts_match_global_counts():
    # Summed over receivers, per-expert counts equal the (token, slot) pairs selecting each expert.
    xs, _, _ = make_inputs()
    per_rank = [refs.expected_expert_counts(refs.dispatch_from_gathered(xs, None, TOPK, None, r, M, E).recv_topk_idx,
                                            E // 3) for r in range(3)]
    all_topk = torch.cat(TOPK).flatten()
    assert torch.cat(per_rank).tolist() == [int((all_topk == e).sum()) for e in range(E)]
    assert per_rank[0].tolist() == [4, 3] and per_rank[0].dtype == torch.int32


def test_dispatch_argument_errors():
    xs, _, _ = make_inputs()
    with pytest.raises(ValueError, match='num_experts'):
        refs.dispatch_from_gathered(xs, None, TOPK, None, 0, M, 7)
    with pytest.raises(ValueError, match='rank'):
        refs.dispatch_from_gathered(xs, None, TOPK, None, 3, M, E)
    with pytest.raises(ValueError, match='xs\\[2\\]'):
        refs.dispatch_from_gathered(xs, None, TOPK, None, 0, 3, E)
    bad = [t.clone() for t in TOPK]
    bad[1][0, 0] = E
    with pytest.raises(ValueError, match='topk_idxs\\[1\\]'):
        refs.dispatch_from_gathered(xs, None, bad, None, 0, M, E)
    with pytest.raises(ValueError, match='topk_idxs'):
        refs.dispatch_from_gathered(xs, None, TOPK[:2], None, 0, M, E)


def test_expanded_layout_alignment_1_and_4():
    local = torch.tensor(EXPECTED[1][1])  # rank 1: expert 0 <- (0,1),(1,2),(2,0); expert 1 <- (0,2),(3,1),(4,2)
    counts = refs.expected_expert_counts(local, 2)
    assert counts.tolist() == [3, 3]

    lay = refs.expanded_layout(local, 2, expert_alignment=1)
    assert lay.num_expanded_tokens == 6
    assert lay.expert_start.tolist() == [0, 3]
    assert lay.row_src.tolist() == [0, 1, 2, 0, 3, 4]
    assert lay.row_slot.tolist() == [1, 2, 0, 2, 1, 2]
    assert lay.psum_num_recv_tokens_per_expert.tolist() == [3, 6]
    assert refs.psum_num_recv_tokens_per_expert(counts, 1, do_expand=False).tolist() == [3, 6]

    lay = refs.expanded_layout(local, 2, expert_alignment=4)
    assert lay.num_expanded_tokens == 8
    assert lay.expert_start.tolist() == [0, 4]
    assert lay.row_src.tolist() == [0, 1, 2, -1, 0, 3, 4, -1]
    assert lay.row_slot.tolist() == [1, 2, 0, -1, 2, 1, 2, -1]
    assert lay.topk_to_expanded_row.tolist() == [[-1, 0, 4], [-1, -1, 1], [2, -1, -1], [-1, 5, -1], [-1, -1, 6]]
    assert lay.topk_to_expanded_row.dtype == torch.int32
    # Expanded psum: aligned start + actual count; non-expanded: inclusive prefix of aligned counts.
    assert lay.psum_num_recv_tokens_per_expert.tolist() == [3, 7]
    assert refs.psum_num_recv_tokens_per_expert(counts, 4, do_expand=True).tolist() == [3, 7]
    assert refs.psum_num_recv_tokens_per_expert(counts, 4, do_expand=False).tolist() == [4, 8]
    assert refs.aligned_expert_counts(counts, 4) == [4, 4]

    # Expanded tensors: rows / weights in layout order, zero in the gaps.
    recv_x = torch.arange(5 * 2, dtype=torch.float32).view(5, 2).to(BF16)
    ex = refs.expand_rows(recv_x, lay)
    assert ex[[0, 1, 2, 4, 5, 6]].tolist() == recv_x[[0, 1, 2, 0, 3, 4]].tolist()
    assert (ex[[3, 7]] == 0).all()
    w = torch.arange(15, dtype=torch.float32).view(5, 3)
    assert refs.expand_slots(w, lay).tolist() == [1, 5, 6, 0, 2, 10, 14, 0]


def test_expanded_layout_empty_expert():
    local = torch.tensor([[1, -1], [1, 1]])
    lay = refs.expanded_layout(local, 3, expert_alignment=4)
    assert lay.num_tokens_per_expert.tolist() == [0, 3, 0]
    assert lay.expert_start.tolist() == [0, 0, 4]
    assert lay.psum_num_recv_tokens_per_expert.tolist() == [0, 3, 4]
    assert lay.row_src.tolist() == [0, 1, 1, -1]
    assert lay.row_slot.tolist() == [0, 0, 1, -1]


# ---------------------------------------------------------------------------------------------------------------------
# Combine


def bf16(v):
    return torch.tensor(v, dtype=torch.float32).to(BF16).float().item()


def f32(v):
    return float(np.float32(v))


def y_of(rows):
    """`[n, K, 1]` bfloat16 from nested lists (values chosen bf16-exact)."""
    return torch.tensor(rows, dtype=torch.float32).unsqueeze(-1).to(BF16)


def test_combine_local_reduction_changes_bits():
    # E=4 on 2 ranks: slots -> ranks [0, 1, 0]; slots 0 and 2 form rank 0's group.
    topk = torch.tensor([[0, 2, 1]])
    y = y_of([[1.0, 2 ** -8, 2 ** -8]])
    single = refs.combine(y, topk, 1, 2, 4, reduce_in_local=False)
    # One rounding: 1 + 2^-8 + 2^-8 = 1 + 2^-7 exactly (a bf16 value).
    assert single.float().item() == 1 + 2 ** -7
    local = refs.combine(y, topk, 1, 2, 4, reduce_in_local=True)
    # Rank 0's group: 1 + 2^-8 rounds (tie to even) to 1.0, kept in slot 2; final: 0 + 2^-8 (slot 1) + 1.0 -> 1.0.
    assert bf16(1 + 2 ** -8) == 1.0
    assert local.float().item() == 1.0


def test_combine_group_sum_slot_order_matters():
    # Rank 0's group sum is 2^-24 (slots 0, 2), rank 1's is -1 (slot 1), bias 1.
    topk = torch.tensor([[0, 2, 1]])
    y = y_of([[2 ** -24, -1.0, 0.0]])
    bias = torch.ones((1, 1), dtype=BF16)
    last = refs.combine(y, topk, 1, 2, 4, bias=bias)
    first = refs.combine(y, topk, 1, 2, 4, bias=bias, group_sum_slot='first')
    # DeepEP keeps a group's sum in its LAST slot: order bias, rank 1 (slot 1), rank 0 (slot 2).
    assert last.float().item() == f32(f32(1.0 - 1.0) + 2 ** -24) == 2 ** -24
    # First slot: order bias, rank 0 (slot 0), rank 1 (slot 1): 1 + 2^-24 rounds to 1 in float32.
    assert first.float().item() == f32(f32(1.0 + 2 ** -24) - 1.0) == 0.0
    with pytest.raises(ValueError, match='group_sum_slot'):
        refs.combine(y, topk, 1, 2, 4, group_sum_slot='middle')


def test_combine_scaleup_reduction_rounds_before_bias():
    topk = torch.tensor([[0, 2, 1]])
    y = y_of([[1.0, 2 ** -8, 0.0]])
    bias = torch.full((1, 1), 2 ** -8, dtype=BF16)
    plain = refs.combine(y, topk, 1, 2, 4, bias=bias, reduce_in_local=True, reduce_in_scaleup=False)
    # bias + 2^-8 (slot 1) = 2^-7, + 1.0 (slot 2) = 1 + 2^-7.
    assert plain.float().item() == 1 + 2 ** -7
    scaleup = refs.combine(y, topk, 1, 2, 4, bias=bias, reduce_in_local=True, reduce_in_scaleup=True)
    # One scale-out domain: 2^-8 + 1.0 rounds to 1.0 first, then bias: 2^-8 + 1.0 -> 1.0.
    assert scaleup.float().item() == 1.0
    with pytest.raises(ValueError, match='reduce_in_local'):
        refs.combine(y, topk, 1, 2, 4, reduce_in_local=False, reduce_in_scaleup=True)


def test_combine_hierarchical_hand_computed():
    # E=8 on 2 domains x 2 ranks: slots -> ranks [0, 3, 1, 0], domains [0, 1, 0, 0].
    topk = torch.tensor([[1, 6, 2, 0]])
    a, b, c, d = 1.0, 2 ** -8, 2 ** -8, 2 ** -9
    y = y_of([[a, b, c, d]])
    r0 = bf16(f32(a + d))                 # rank 0: slots 0, 3 -> kept in slot 3
    dom0 = bf16(f32(c + r0))              # domain 0: slot 2 (rank 1), then slot 3 -> kept in slot 3
    assert r0 == 1.0 and dom0 == 1.0
    out = refs.combine(y, topk, 2, 2, 8, reduce_in_local=True, reduce_in_scaleup=True)
    assert out.float().item() == bf16(f32(b + dom0)) == 1.0  # final: slot 1 (domain 1), then slot 3
    out = refs.combine(y, topk, 2, 2, 8, reduce_in_local=True, reduce_in_scaleup=False)
    assert out.float().item() == bf16(f32(f32(b + c) + r0)) == 1 + 2 ** -7  # slots 1, 2, 3
    out = refs.combine(y, topk, 2, 2, 8, reduce_in_local=False)
    assert out.float().item() == bf16(f32(f32(f32(a + b) + c) + d)) == 1 + 2 ** -7


@pytest.mark.parametrize('num_bias', [0, 1, 2])
def test_combine_biases_and_empty_rows(num_bias):
    gen = torch.Generator().manual_seed(1)
    n, k, h = 3, 3, 16
    topk = torch.tensor([[0, 3, -1], [-1, -1, -1], [2, 2, 1]])
    y = torch.randn((n, k, h), generator=gen).to(BF16)
    biases = tuple(torch.randn((n, h), generator=gen).to(BF16) for _ in range(num_bias))
    bias = None if num_bias == 0 else biases[0] if num_bias == 1 else biases
    out = refs.combine(y, topk, 1, 2, 4, bias=bias)
    start = torch.zeros((n, h)) if num_bias == 0 else sum((b.float() for b in biases[1:]), biases[0].float())
    # A row whose slots are all -1 is the bias alone.
    assert torch.equal(out[1], start[1].to(BF16))
    # Row 0: slots on ranks 0 and 1 (single-slot groups): bias, y[0,0], y[0,1] in order.
    assert torch.equal(out[0], ((start[0] + y[0, 0].float()) + y[0, 1].float()).to(BF16))
    if num_bias == 1:
        assert torch.equal(refs.combine(y, topk, 1, 2, 4, bias=(biases[0],)), out)
    assert out.dtype == BF16 and out.shape == (n, h)


def test_combine_bias_errors():
    y = torch.zeros((2, 2, 4), dtype=BF16)
    topk = torch.zeros((2, 2), dtype=torch.int64)
    with pytest.raises(ValueError, match='bias'):
        refs.combine(y, topk, 1, 2, 4, bias=(torch.zeros(2, 4),) * 3)
    with pytest.raises(ValueError, match='bias'):
        refs.combine(y, topk, 1, 2, 4, bias=torch.zeros(3, 4))
    with pytest.raises(ValueError, match='y must be'):
        refs.combine(y[0], topk, 1, 2, 4)


def scalar_combine(y, topk, num_so, num_su, num_experts, bias_start, local, scaleup, slot):
    """A loop-per-token restatement of the recipe (float32 via numpy), to cross-check the vectorised one."""
    n, k, h = y.shape
    per_rank = num_experts // (num_so * num_su)
    out = torch.empty((n, h), dtype=BF16)
    for t in range(n):
        parts = {j: y[t, j].float().numpy() for j in range(k) if topk[t, j] >= 0}
        stages = [lambda e: e // per_rank] if local else []
        stages += [lambda e: e // (per_rank * num_su)] if scaleup else []
        for group_of in stages:
            groups = {}
            for j in sorted(parts):
                groups.setdefault(int(group_of(int(topk[t, j]))), []).append(j)
            new = {}
            for members in groups.values():
                acc = np.zeros(h, dtype=np.float32)
                for j in members:
                    acc = acc + parts[j]
                new[members[-1] if slot == 'last' else members[0]] = torch.from_numpy(acc).to(BF16).float().numpy()
            parts = new
        acc = bias_start[t].numpy().astype(np.float32)
        for j in sorted(parts):
            acc = acc + parts[j]
        out[t] = torch.from_numpy(acc).to(BF16)
    return out


@pytest.mark.parametrize('local,scaleup', [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize('slot', ['last', 'first'])
def test_combine_matches_scalar_recipe(local, scaleup, slot):
    gen = torch.Generator().manual_seed(7)
    n, k, h, num_so, num_su, num_experts = 64, 3, 8, 2, 2, 8
    topk = torch.randint(-1, num_experts, (n, k), generator=gen)
    y = (torch.randn((n, k, h), generator=gen) * torch.logspace(-3, 3, h)).to(BF16)
    bias = (torch.randn((n, h), generator=gen).to(BF16), torch.randn((n, h), generator=gen).to(BF16))
    out = refs.combine(y, topk, num_so, num_su, num_experts, bias, local, scaleup, slot)
    start = bias[0].float() + bias[1].float()
    assert torch.equal(out, scalar_combine(y, topk, num_so, num_su, num_experts, start, local, scaleup, slot))


def test_generate_pre_combine_data():
    num_ranks, k, h, seed = 3, 3, 16, 5
    g = torch.tensor([0, 5, 11, 7], dtype=torch.int32)
    y = refs.generate_pre_combine_data(g, M, k, h, num_ranks, seed)
    assert y.dtype == BF16 and y.shape == (4, k, h)
    assert torch.equal(y, refs.generate_pre_combine_data(g, M, k, h, num_ranks, seed))
    assert (y.float().abs() <= 1).all()
    # A function of the global index only.
    assert torch.equal(y[2], refs.generate_pre_combine_data(torch.tensor([11]), M, k, h, num_ranks, seed)[0])
    assert not torch.equal(y, refs.generate_pre_combine_data(g, M, k, h, num_ranks, seed + 1))
    max_seed = num_ranks * M * k
    for i, j, c in [(1, 2, 0), (3, 0, 15), (2, 1, 7)]:
        s = int(g[i]) * k + j
        v = math.sin(((s * 131071 % max_seed) + 1) / max_seed * (c + 1) + math.sin(seed))
        assert abs(y[i, j, c].item() - v) <= 2 ** -8


def test_ordered_accumulate_and_reduce_local_slots():
    data = y_of([[1.0, 2 ** -8, 2 ** -8], [3.0, 0.0, -1.0]])
    assert refs.ordered_accumulate(data).flatten().tolist() == [1 + 2 ** -7, 2.0]
    init = torch.tensor([[-1.0], [0.5]])
    assert refs.ordered_accumulate(data, init).flatten().tolist() == [2 ** -7, 2.5]
    local = torch.tensor([[0, -1, 1], [-1, -1, -1]])
    assert refs.reduce_local_slots(data, local).flatten().tolist() == [1.0, 0.0]


def test_expected_combined_x_matches_combine():
    topk = TOPK[2]
    out = refs.expected_combined_x(topk, 2, M, 3, E, H, global_seed=3)
    y = refs.generate_pre_combine_data(2 * M + torch.arange(4), M, K, H, 3, 3)
    assert torch.equal(out, refs.combine(y, topk, 1, 3, E))


# ---------------------------------------------------------------------------------------------------------------------
# NCCL-form baselines over a fake communicator (one thread per rank, all-to-all through shared memory)


class FakeComm:
    """Stands in for `NcclComm` on CPU tensors: `all_to_all_single` swaps row blocks through a shared mailbox."""

    def __init__(self, rank, size, mailbox, barrier):
        self.rank, self.size, self.mailbox, self.barrier = rank, size, mailbox, barrier

    def all_to_all_single(self, recv, send, recv_splits=None, send_splits=None, stream=None):
        send_splits = send_splits or [send.shape[0] // self.size] * self.size
        recv_splits = recv_splits or [recv.shape[0] // self.size] * self.size
        self.mailbox[self.rank] = list(torch.split(send, send_splits))
        self.barrier.wait()
        chunks = [self.mailbox[src][self.rank] for src in range(self.size)]
        assert [c.shape[0] for c in chunks] == list(recv_splits)
        recv.copy_(torch.cat(chunks))
        self.barrier.wait()


def run_ranks(fn, num_ranks):
    mailbox, barrier = {}, threading.Barrier(num_ranks, timeout=30)
    results, errors = [None] * num_ranks, []

    def body(rank):
        try:
            results[rank] = fn(FakeComm(rank, num_ranks, mailbox, barrier))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize('num_bias', [0, 2])
def test_nccl_forms_match_gathered_reference(num_bias):
    xs, sfs, weights = make_inputs(seed=3)
    seed = 11

    def rank_program(comm):
        r = comm.rank
        out = refs.dispatch_nccl((xs[r], sfs[r]), TOPK[r], weights[r], M, E, comm)
        y = refs.generate_pre_combine_data(out.result.recv_src_token_global_idx, M, K, H, comm.size, seed)
        x = refs.reduce_local_slots(y, out.result.recv_topk_idx)
        gen = torch.Generator().manual_seed(100 + r)
        bias = tuple(torch.randn((TOPK[r].shape[0], H), generator=gen).to(BF16) for _ in range(num_bias)) or None
        combined = refs.combine_nccl(x, out.handle, comm, out.result.recv_topk_weights, bias)
        return out, combined, bias

    for r, (out, combined, bias) in enumerate(run_ranks(rank_program, 3)):
        ref = refs.dispatch_from_gathered(xs, sfs, TOPK, weights, r, M, E)
        for name, a, b in zip(ref._fields, ref, out.result):
            assert torch.equal(a, b), name
        expected = refs.expected_combined_x(TOPK[r], r, M, 3, E, H, seed, bias=bias)
        assert torch.equal(combined.combined_x, expected)
        # Weights come back as the originals, 0 in -1 slots.
        assert torch.equal(combined.combined_topk_weights, torch.where(TOPK[r] >= 0, weights[r], 0.0))
