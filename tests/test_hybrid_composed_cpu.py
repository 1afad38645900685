"""The composed hybrid path (features/hybrid/feature.py, kernels_cu/hybrid.cu) emulated on the host, kernel by kernel
(numpy versions written to do exactly what each kernel does), with the intranode engine replaced by the references
it is verified against (`refs.dispatch_from_gathered` / `refs.combine` over one domain). Checks: dispatch rows equal
the global reference in `hybrid_row_order`, the metadata translation, psum per scale-up index, and combine equal to
`refs.combine(..., reduce_in_scaleup=True)` bit for bit (biases 0/1/2) for 2x1, 2x2, 2x4, 4x1, 4x2."""

import numpy as np
import pytest

torch = pytest.importorskip('torch')

from references import hybrid_reference as href  # noqa: E402

from deepep_cupy import constants  # noqa: E402
from deepep_cupy.features.hybrid import plan as hplan  # noqa: E402
from deepep_cupy.runtime.rails import plan_exchange, rail_topology  # noqa: E402
from deepep_cupy.utils import refs  # noqa: E402

SHAPES = [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]


def make_inputs(N, R, seed, L=3, K=4, M=10, H=16):
    gen = torch.Generator().manual_seed(seed)
    W, E = N * R, N * R * L
    K = min(K, E)
    xs, topks, ws = [], [], []
    for g in range(W):
        T = 0 if g == 1 else (M if g == W - 1 else int(torch.randint(1, M + 1, (1,), generator=gen)))
        scores = torch.rand((T, E), generator=gen) + torch.linspace(1, 0, E) * 0.5     # skewed to low experts
        topk = torch.topk(scores, K, dim=1).indices.to(torch.int64)
        topk = torch.where(torch.rand((T, K), generator=gen) < 0.15, torch.full_like(topk, -1), topk)
        xs.append(torch.randn((T, H), generator=gen).to(torch.bfloat16))
        topks.append(topk)
        ws.append(torch.rand((T, K), generator=gen))
    return E, M, H, K, xs, topks, ws


# ---- host versions of the kernels ------------------------------------------------------------------------------
def route(topk, epd, N):
    """hybrid_route: domain_pos [T, N], counts [N]."""
    T = topk.shape[0]
    mask = np.zeros((T, N), dtype=bool)
    for t in range(T):
        for e in topk[t].tolist():
            if e >= 0:
                mask[t, e // epd] = True
    pos = np.where(mask, np.cumsum(mask, axis=0) - 1, -1).astype(np.int32)
    return pos, mask.sum(axis=0).astype(np.int32)


def pack(x, topk, w, pos, n, N):
    """hybrid_pack: per other domain, rows in rail order (src token, top-k, weights, x)."""
    out = {}
    for m in range(N):
        if m == n:
            continue
        rows = sorted((int(pos[t, m]), t) for t in range(topk.shape[0]) if pos[t, m] >= 0)
        assert [p for p, _ in rows] == list(range(len(rows)))
        out[m] = [(t, topk[t].clone(), w[t].clone(), x[t].clone()) for _, t in rows]
    return out


def mask_topk(row, domain, epd):
    lo = domain * epd
    return torch.where((row >= lo) & (row < lo + epd), row - lo, torch.full_like(row, -1))


def unpack(x, topk, w, recv, n, N, M, K, H, epd):
    """hybrid_unpack modes 0 and 1: the union input, fwd_src, fwd_count."""
    ux = torch.zeros((N * M, H), dtype=torch.bfloat16)
    ut = torch.full((N * M, K), -1, dtype=torch.int64)
    uw = torch.zeros((N * M, K))
    fwd_src = np.full(N * M, -1, dtype=np.int64)
    fwd_count = np.zeros(N, dtype=np.int64)
    for t in range(topk.shape[0]):
        ux[n * M + t], ut[n * M + t], uw[n * M + t] = x[t], mask_topk(topk[t], n, epd), w[t]
    for s, rows in recv.items():
        fwd_count[s] = len(rows)
        for p, (t, tk, ww, xx) in enumerate(rows):
            u = s * M + t
            ux[u], ut[u], uw[u] = xx, mask_topk(tk, n, epd), ww
            fwd_src[s * M + p] = t
    return ux, ut, uw, fwd_src, fwd_count


def f32_to_bf16(a):
    return torch.from_numpy(a).to(torch.bfloat16)


@pytest.mark.parametrize('N,R', SHAPES)
@pytest.mark.parametrize('seed', [0, 1])
def test_composed_dispatch_and_combine_match_refs(N, R, seed):
    E, M, H, K, xs, topks, ws = make_inputs(N, R, seed)
    W, epd = N * R, E // N
    # Dispatch: route + pack at every origin, the rail exchange, unpack at every forwarder.
    routed = [route(topks[g].numpy(), epd, N) for g in range(W)]
    sent = [pack(xs[g], topks[g], ws[g], routed[g][0], g // R, N) for g in range(W)]
    unions = []
    for g in range(W):
        n, r = divmod(g, R)
        recv = {m: sent[m * R + r][n] for m in range(N) if m != n}
        # the exchange carries each count in its header; the receiver's counts equal the sender's
        assert all(len(recv[m]) == routed[m * R + r][1][n] for m in recv)
        unions.append(unpack(xs[g], topks[g], ws[g], recv, n, N, M, K, H, epd))
    # The intranode dispatch of each domain over the union inputs (N * M tokens, E / N experts).
    for d in range(W):
        m, lo = divmod(d, R)
        dom = [unions[m * R + r] for r in range(R)]
        inner = refs.dispatch_from_gathered([u[0] for u in dom], None, [u[1] for u in dom], [u[2] for u in dom], lo,
                                            N * M, epd)
        ref = refs.dispatch_from_gathered(xs, None, topks, ws, d, M, E)
        src = ref.recv_src_token_global_idx.long().numpy()
        perm = href.hybrid_row_order(src // M, src % M, R)
        glob = hplan.translate_src_index(inner.recv_src_token_global_idx.long().numpy(), N, R, M)
        assert np.array_equal(glob, src[perm])
        assert torch.equal(inner.recv_x, ref.recv_x[torch.from_numpy(perm)])
        assert torch.equal(inner.recv_topk_idx, ref.recv_topk_idx[torch.from_numpy(perm)])
        # psum over scale-up groups = the intranode psum over the R forwarders
        per_src = ref.num_recv_tokens_per_rank.numpy()
        assert np.array_equal(np.cumsum(inner.num_recv_tokens_per_rank.numpy()),
                              np.cumsum([per_src[r::R].sum() for r in range(R)]))

    # Combine: the intranode combine at each forwarder gives each union row its domain's partial (refs over one
    # domain: what the intranode engine is verified against), then combine pack, the reverse exchange, the final.
    seed_c = 5
    partial = []
    for g in range(W):
        n, r = divmod(g, R)
        ux, ut, uw, fwd_src, fwd_count = unions[g]
        rows = np.arange(N * M)
        glob = ((rows // M) * R + r) * M + rows % M          # the union row's global source token
        y = refs.generate_pre_combine_data(torch.from_numpy(glob), M, K, H, W, seed_c)
        partial.append(refs.combine(y, ut, 1, R, epd, None, True, False))
    for o in range(W):
        n, r = divmod(o, R)
        topk = topks[o]
        T = topk.shape[0]
        pos, _ = routed[o]
        for num_bias in (0, 1, 2):
            gen = torch.Generator().manual_seed(o * 7 + num_bias)
            biases = [torch.randn((T, H), generator=gen).to(torch.bfloat16) for _ in range(num_bias)]
            out = np.zeros((T, H), dtype=np.float32)
            for t in range(T):
                acc = np.zeros(H, dtype=np.float32)
                if num_bias:
                    acc = biases[0][t].float().numpy().copy()
                    if num_bias == 2:
                        acc = acc + biases[1][t].float().numpy()
                key = {}
                for k, e in enumerate(topk[t].tolist()):
                    if e >= 0:
                        key[e // epd] = k
                for m in sorted(key, key=key.get):
                    if m == n:
                        row = partial[o][n * M + t]
                    else:       # rail row domain_pos[t][m] of the forwarder (m, r), packed from its union row
                        f = m * R + r
                        p = int(pos[t, m])
                        assert unions[f][3][n * M + p] == t and p < unions[f][4][n]
                        row = partial[f][n * M + t]
                    acc = acc + row.float().numpy()
                out[t] = acc
            y = refs.generate_pre_combine_data(o * M + torch.arange(T), M, K, H, W, seed_c)
            expect = refs.combine(y, topk, N, R, E, tuple(biases) if biases else None, True, True)
            assert torch.equal(f32_to_bf16(out), expect), (N, R, o, num_bias)


@pytest.mark.parametrize('N,R', SHAPES)
def test_rail_area_plans_are_symmetric(N, R):
    area = hplan.rail_area(N, 64, 256, 8)
    assert area.row_bytes % 16 == 0 and area.region_bytes % 16 == 0 and area.recv_offset % 16 == 0
    assert area.row_bytes >= hplan.combine_row_bytes(256, 8)
    assert area.row_bytes == hplan.dispatch_row_bytes(8, 2, 512)
    assert area.total_bytes % (1 << 21) == 0 and area.total_bytes >= area.recv_offset + N * area.region_bytes
    W = N * R
    plans = {}
    for g in range(W):
        rails = rail_topology(W, R, g)
        static = hplan.payloads(rails.peer_domains, None, 64, area.row_bytes)
        plans[g] = plan_exchange(rails, area, 'dispatch', static, static)
    for g, p in plans.items():
        n, r = divmod(g, R)
        for op in p.ops:
            peer = plans[op.peer * R + r]
            match = [q for q in peer.ops if q.peer == n and q.kind != op.kind]
            assert len(match) == 1 and match[0].num_bytes == op.num_bytes
            # what one end reads (sends) is where the other end's plan says the peer's range is
            assert match[0].offset == op.peer_offset and match[0].peer_offset == op.offset


def test_exact_payloads_and_transport_choice():
    assert hplan.payloads([1, 2], {1: 3, 2: 0}, 10, 32) == {1: 96, 2: 0}
    assert hplan.payloads([0], None, 10, 32) == {0: 320}
    assert hplan.choose_transport('auto', ['a', 'a']) == 'loopback'
    assert hplan.choose_transport('auto', ['a', 'b']) == 'nccl'
    assert hplan.choose_transport('loopback', ['a', 'b']) == 'loopback'
    with pytest.raises(ValueError, match='share a GPU'):
        hplan.choose_transport('nccl', ['a', 'a'])
    with pytest.raises(ValueError):
        hplan.choose_transport('tcp', ['a'])
    assert [constants.topk_bucket(k) for k in (1, 3, 8, 9, 32)] == [1, 4, 8, 16, 32]


def test_translate_src_index():
    N, R, M = 3, 2, 5
    rows = []
    for r in range(R):
        for s in range(N):
            for t in range(M):
                rows.append((r * N * M + s * M + t, (s * R + r) * M + t))
    inner = np.array([a for a, _ in rows] + [-1])
    assert hplan.translate_src_index(inner, N, R, M).tolist() == [b for _, b in rows] + [-1]
    t = torch.from_numpy(inner)
    assert hplan.translate_src_index(t, N, R, M).tolist() == [b for _, b in rows] + [-1]


def test_rank_program_reorders_references_into_the_hybrid_order():
    """deepep_cupy/tests/ep_hybrid.py's reordering of a gathered reference (what the GPU rank program compares)."""
    from deepep_cupy.tests import ep_hybrid
    N, R = 2, 2
    E, M, H, K, xs, topks, ws = make_inputs(N, R, 3)
    for d in range(N * R):
        ref = refs.dispatch_from_gathered(xs, None, topks, ws, d, M, E)
        src = ref.recv_src_token_global_idx.long().numpy()
        perm = href.hybrid_row_order(src // M, src % M, R)
        out = ep_hybrid._reorder(ref, perm, R)
        got = out.recv_src_token_global_idx.long().numpy()
        # grouped by source scale-up index, then source domain, then token
        keys = [((g // M) % R, (g // M) // R, g % M) for g in got.tolist()]
        assert keys == sorted(keys) and sorted(got.tolist()) == sorted(src.tolist())
        assert torch.equal(out.recv_x, ref.recv_x[torch.from_numpy(perm)])
        per_src = ref.num_recv_tokens_per_rank
        assert out.num_recv_tokens_per_rank.tolist() == [int(per_src[r::R].sum()) for r in range(R)]


def test_ranks_sharing_a_gpu_under_different_nccl_hosts_may_use_nccl(monkeypatch):
    # The ids are Topology.nccl_gpu_ids: '<NCCL_HOSTID or hostname>/<PCI bus id>'. One GPU, two NCCL hosts: NCCL
    # accepts the pair (its socket transport), so do we; one GPU under one host: the refusal names the way out.
    from deepep_cupy.runtime import topology
    one_gpu = ['node0/0000:18:00.0', 'node1/0000:18:00.0']
    assert hplan.choose_transport('nccl', one_gpu) == 'nccl'
    assert hplan.choose_transport('auto', one_gpu) == 'nccl'
    with pytest.raises(ValueError, match='NCCL_HOSTID'):
        hplan.choose_transport('nccl', ['h/0000:18:00.0', 'h/0000:18:00.0'])
    monkeypatch.setenv('NCCL_HOSTID', 'node7')
    assert topology.nccl_host() == 'node7'
    monkeypatch.setenv('NCCL_HOSTID', '  ')
    import socket
    assert topology.nccl_host() == socket.gethostname()
