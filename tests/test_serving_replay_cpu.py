"""The host side of `deepep_cupy.tests.serving_replay` (vLLM / SGLang call-for-call replay): the frameworks' buffer
sizing (inside one scale-up domain and across several: vLLM's internode branch), the stand-in experts' host
reference against a brute-force one (one level, and V1's two levels across domains), the case list and what a
topology skips, the choice of inputs and checks by topology (the internode checks accept reference-built outputs of a
2x2 dispatch and catch a wrong handle element), every deep_ep call of the sequences bound to the V1 Buffer's real
signatures, the dispatchers' call order on a recording buffer, and `--help` without torch."""

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip('torch')

from deepep_cupy.buffers.legacy import Buffer, Config
from deepep_cupy.tests import cli
from deepep_cupy.tests import legacy_reference as ref
from deepep_cupy.tests import serving_replay as sr
from deepep_cupy.tests import serving_replay_cases as sc
from deepep_cupy.tests.common import Failure
from deepep_cupy.v1 import internode as v1_internode

ROOT = Path(__file__).resolve().parents[1]
H, E = 2048, 64


# ---- sizing, the frameworks' way ------------------------------------------------------------------------------------
def test_framework_env_defaults_overrides_and_errors():
    assert sr.framework_env({}) == {'VLLM_DEEPEP_BUFFER_SIZE_MB': 1024, 'VLLM_MOE_DP_CHUNK_SIZE': 256,
                                    'VLLM_DEEPEP_LOW_LATENCY_USE_MNNVL': 0,
                                    'VLLM_DEEPEP_HIGH_THROUGHPUT_FORCE_INTRA_NODE': 0, 'VLLM_DBO_COMM_SMS': 20,
                                    'SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK': 128}
    env = sr.framework_env({'VLLM_DEEPEP_BUFFER_SIZE_MB': '64', 'VLLM_MOE_DP_CHUNK_SIZE': ' 128 '})
    assert env['VLLM_DEEPEP_BUFFER_SIZE_MB'] == 64 and env['VLLM_MOE_DP_CHUNK_SIZE'] == 128
    with pytest.raises(ValueError, match='VLLM_DBO_COMM_SMS'):
        sr.framework_env({'VLLM_DBO_COMM_SMS': 'many'})


def test_vllm_buffer_kwargs_are_what_vllm_passes_and_bind_to_buffer():
    env, group = sr.framework_env({}), object()
    ht = sr.vllm_ht_buffer_kwargs(group, env)
    assert ht == dict(group=group, num_nvl_bytes=1 << 30, num_rdma_bytes=0, low_latency_mode=False,
                      num_qps_per_rank=1, explicitly_destroy=True)
    ll = sr.vllm_ll_buffer_kwargs(group, Buffer, env, H, 4, E)
    assert ll['num_rdma_bytes'] == Buffer.get_low_latency_rdma_size_hint(256, H, 4, E) > 0
    assert (ll['num_nvl_bytes'], ll['num_qps_per_rank'], ll['low_latency_mode'], ll['allow_mnnvl'],
            ll['enable_shrink'], ll['explicitly_destroy']) == (1 << 30, E // 4, True, False, False, True)
    assert sr.vllm_ll_buffer_kwargs(group, Buffer, env, H, 4, E, fault_tolerance=True)['enable_shrink'] is True
    for kwargs in (ht, ll):
        inspect.signature(Buffer.__init__).bind(None, **kwargs)
    assert sr.vllm_configs(Buffer, 1) == (None, None) and sr.vllm_configs(Buffer, 3) == (None, None)
    d, c = sr.vllm_configs(Buffer, 4)
    assert (d.num_sms, d.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_send_tokens) == (20, 6, 9)


def test_vllm_ht_kwargs_across_domains_are_vllms_internode_branch():
    """all2all.py @0014300: internode and not VLLM_DEEPEP_HIGH_THROUGHPUT_FORCE_INTRA_NODE -> RDMA bytes = the NVLink
    bytes, num_qps_per_rank = the manager's num_sms (20) // 2; else 0 and 1. The LL kwargs have no such branch."""
    env, group = sr.framework_env({}), object()
    ht = sr.vllm_ht_buffer_kwargs(group, env, internode=True)
    assert ht == dict(group=group, num_nvl_bytes=1 << 30, num_rdma_bytes=1 << 30, low_latency_mode=False,
                      num_qps_per_rank=10, explicitly_destroy=True)
    inspect.signature(Buffer.__init__).bind(None, **ht)
    small = sr.framework_env({'VLLM_DEEPEP_BUFFER_SIZE_MB': '64'})
    assert sr.vllm_ht_buffer_kwargs(group, small, internode=True)['num_rdma_bytes'] == 64 << 20
    forced = sr.framework_env({'VLLM_DEEPEP_HIGH_THROUGHPUT_FORCE_INTRA_NODE': '1'})
    assert sr.vllm_ht_buffer_kwargs(group, forced, internode=True) == sr.vllm_ht_buffer_kwargs(group, env)
    assert sr.vllm_ht_buffer_kwargs(group, env, internode=False)['num_rdma_bytes'] == 0


@pytest.mark.parametrize('R', [1, 2, 4])
def test_sglang_sizes_per_mode(R):
    M = 128
    hints = [cfg.get_nvl_buffer_size_hint(H, R) for cfg in (Buffer.get_dispatch_config(R),
                                                           Buffer.get_combine_config(R))]
    ll = Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    assert sr.sglang_buffer_sizes(Buffer, R, H, 1, 'normal', M, E) == (max(hints), 0, False, 20)
    assert sr.sglang_buffer_sizes(Buffer, R, H, 1, 'low_latency', M, E) == (0, ll, True, E // R)
    assert sr.sglang_buffer_sizes(Buffer, R, H, 1, 'auto', M, E) == (max(hints), ll, True, max(20, E // R))
    bf16 = sr.sglang_buffer_sizes(Buffer, R, H, 2, 'normal', M, E).num_nvl_bytes
    assert bf16 > max(hints)                    # FP8 dispatch sizes by hidden * 1 bytes
    cfgs = (Config(24, 8, 256), Config(24, 8, 512))
    custom = sr.sglang_buffer_sizes(Buffer, R, H, 1, 'auto', M, 4 * R, configs=cfgs)
    assert custom.num_qps_per_rank == 24 and custom.num_nvl_bytes == cfgs[1].get_nvl_buffer_size_hint(H, R)


@pytest.mark.parametrize('R', [1, 2, 4])
def test_the_prefill_case_overflows_sglangs_fp8_buffer_only(R):
    n = sr.prefill_tokens(Buffer, R)
    assert n == 2560
    fp8 = sr.sglang_buffer_sizes(Buffer, R, H, 1, 'normal', 128, E).num_nvl_bytes
    bf16 = sr.sglang_buffer_sizes(Buffer, R, H, 2, 'normal', 128, E).num_nvl_bytes
    assert sr.grows(fp8, R, n, H, 8) and not sr.grows(bf16, R, n, H, 8)
    assert not sr.grows(1 << 30, R, 128, H, 8)          # vLLM's 1 GiB holds the replay's tokens


@pytest.mark.parametrize('D,S', [(2, 1), (2, 2), (2, 4), (4, 1)])
def test_prefill_growth_across_domains(D, S):
    """Across domains the V1 Buffer lays out M = internode_tokens(...) at its first dispatch: the prefill case still
    overflows SGLang's FP8-sized buffer there, not the BF16 one, nor vLLM's 1 GiB at the replay's token counts; every
    topology holds the prefill tokens (token_limit)."""
    R, n = D * S, sr.prefill_tokens(Buffer, D * S)
    fp8 = sr.sglang_buffer_sizes(Buffer, R, H, 1, 'normal', 128, E)
    bf16 = sr.sglang_buffer_sizes(Buffer, R, H, 2, 'normal', 128, E)
    assert fp8.num_rdma_bytes == bf16.num_rdma_bytes == 0      # SGLang: by group.size() alone (<= 8 ranks: 0)
    assert sr.grows(fp8.num_nvl_bytes, R, n, H, 8, D, 0) and not sr.grows(bf16.num_nvl_bytes, R, n, H, 8, D, 0)
    vllm = sr.vllm_ht_buffer_kwargs(None, sr.framework_env({}), internode=True)
    assert not sr.grows(vllm['num_nvl_bytes'], R, 128, H, 8, D, vllm['num_rdma_bytes'])
    m = v1_internode.internode_tokens(D, S, fp8.num_nvl_bytes, 0, H, 8)
    assert sr.grows(fp8.num_nvl_bytes, R, m + 1, H, 8, D) and not sr.grows(fp8.num_nvl_bytes, R, m, H, 8, D)
    assert sr.token_limit(R, D) == v1_internode.token_limit(D, S) >= n
    assert sr.token_limit(R) >= n


def test_tma_aligned_col_major_scales():
    for n in (0, 1, 5, 8):
        sf = torch.arange(n * 4, dtype=torch.int32).reshape(n, 4)
        got = sr.tma_aligned_col_major(sf)
        assert torch.equal(got, sf) and got.shape == (n, 4)
        assert n == 0 or got.stride() == (1, -(-n // 4) * 4)


# ---- the stand-in experts' host reference ---------------------------------------------------------------------------
def _world(R=3, Ek=6, K=3, Hs=16, sizes=(5, 0, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes[:R]:
        x = (torch.randn(n, Hs, generator=g) * 3).to(torch.bfloat16)
        t = torch.stack([torch.randperm(Ek, generator=g)[:K] for _ in range(n)]) if n else \
            torch.empty((0, K), dtype=torch.int64)
        t[torch.rand(n, K, generator=g) < 0.25] = -1
        out.append((x, t, torch.randn(n, K, generator=g)))
    return out


def _last_slots(topk_row, L):
    """Destination rank -> the last top-k slot of the token that goes to it."""
    last = {}
    for k, e in enumerate(topk_row.tolist()):
        if e >= 0:
            last[e // L] = k
    return last


def _destination_row(x, topk, w, t, d, L):
    """What destination rank d returns for token t (FP32 view of its bfloat16 row): the sum over its local slots k
    (ascending) of bf16(bf16(row * 2^(e % 4 - 2)) * w_k), rounded once."""
    y = torch.zeros(x.shape[1])
    for k, e in enumerate(topk[t].tolist()):
        if e >= 0 and e // L == d:
            row = (x[t].float() * 2.0 ** (e % 4 - 2)).to(torch.bfloat16)
            y = y + (row.float() * w[t, k]).to(torch.bfloat16).float()
    return y.to(torch.bfloat16).float()


def _brute_force(x, topk, w, Ek, R):
    """Per token: destinations in the order of their last top-k slot, each returning `_destination_row`; FP32 sum
    over destinations, one rounding."""
    L = Ek // R
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    for t in range(x.shape[0]):
        last = _last_slots(topk[t], L)
        acc = torch.zeros(x.shape[1])
        for d in sorted(last, key=last.get):
            acc = acc + _destination_row(x, topk, w, t, d, L)
        out[t] = acc.to(torch.bfloat16)
    return out


@pytest.mark.parametrize('seed', [0, 1])
def test_expected_combine_equals_a_brute_force_loop(seed):
    R, Ek = 3, 6
    for x, t, w in _world(R, Ek, seed=seed):
        assert torch.equal(sr.expected_combine(x.float(), t, w, Ek, R).view(torch.int16),
                           _brute_force(x, t, w, Ek, R).view(torch.int16))


def test_expected_combine_sums_ranks_in_the_order_of_their_last_slot():
    """Destinations 0, 1, 2 return 1, 2^26, -2^26; token [e0 (rank 0), e2 (1), e4 (2), e1 (0)]: by last slot
    (1, 2, 0) the FP32 sum is 1, by first slot (0, 1, 2) the 1 is lost (2^26 + 1 rounds to 2^26)."""
    x = torch.ones(1, 8, dtype=torch.bfloat16)
    t = torch.tensor([[0, 2, 4, 1]])
    w = torch.tensor([[2.0, 2.0 ** 26, -2.0 ** 28, 1.0]])     # y0 = bf16(.25*2) + bf16(.5*1) = 1
    got = sr.expected_combine(x.float(), t, w, 6, 3)
    assert got.float().tolist() == [[1.0] * 8] and torch.equal(got, _brute_force(x, t, w, 6, 3))


def _brute_force_domains(x, topk, w, Ek, R, D):
    """V1's combine across D domains of S ranks: per destination domain (in order of its last top-k slot, the last of
    any of its ranks) the FP32 sum of its ranks' rows (ranks in order of their last slot), rounded to bfloat16; the
    FP32 sum of those partials, one rounding."""
    L, S = Ek // R, R // D
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    for t in range(x.shape[0]):
        last = _last_slots(topk[t], L)
        dom_last = {}
        for d, k in last.items():
            dom_last[d // S] = max(dom_last.get(d // S, k), k)
        acc = torch.zeros(x.shape[1])
        for m in sorted(dom_last, key=dom_last.get):
            part = torch.zeros(x.shape[1])
            for d in sorted((d for d in last if d // S == m), key=last.get):
                part = part + _destination_row(x, topk, w, t, d, L)
            acc = acc + part.to(torch.bfloat16).float()
        out[t] = acc.to(torch.bfloat16)
    return out


@pytest.mark.parametrize('R,D', [(4, 2), (4, 4), (2, 2), (8, 2)])
def test_expected_combine_across_domains_equals_a_two_level_loop(R, D):
    Ek = 2 * R
    for x, t, w in _world(3, Ek, K=4, sizes=(6, 0, 9), seed=R + D):
        got = sr.expected_combine(x.float(), t, w, Ek, R, D)
        assert torch.equal(got.view(torch.int16), _brute_force_domains(x, t, w, Ek, R, D).view(torch.int16))
        # one domain: the one-level reference (the intranode combine rounds once)
        assert torch.equal(_brute_force_domains(x, t, w, Ek, R, 1).view(torch.int16),
                           sr.expected_combine(x.float(), t, w, Ek, R).view(torch.int16))


def test_expected_combine_across_domains_rounds_per_domain():
    """Ranks 0, 1 (domain 0) return 1 and 2^-8 (their FP32 sum rounds to 1 in bfloat16), rank 2 (domain 1) 2^-8:
    two levels give bf16(1 + 2^-8) = 1, one level 1 + 2^-7 (representable)."""
    x = torch.ones(1, 8, dtype=torch.bfloat16)
    t = torch.tensor([[0, 2, 4]])              # experts of ranks 0, 1, 2 (2 local experts each, 4 ranks)
    w = torch.tensor([[4.0, 2.0 ** -8, 2.0 ** -8 * 4]])
    one = sr.expected_combine(x.float(), t, w, 8, 4)
    two = sr.expected_combine(x.float(), t, w, 8, 4, 2)
    assert one.float().tolist() == [[1.0 + 2.0 ** -7] * 8] and two.float().tolist() == [[1.0] * 8]
    assert torch.equal(two, _brute_force_domains(x, t, w, 8, 4, 2))


@pytest.mark.parametrize('R,D', [(4, 1), (4, 2), (8, 2), (4, 4)])
def test_domain_orders(R, D):
    """legacy_reference.domain_orders (moved from legacy_internode.Case): one domain is dest_orders; the domains in
    order of their last (first) slot, their ranks in order of their own."""
    g = torch.Generator().manual_seed(R * 10 + D)
    Ek, S = 2 * R, R // D
    t = torch.stack([torch.randperm(Ek, generator=g)[:5] for _ in range(20)])
    t[torch.rand(20, 5, generator=g) < 0.2] = -1
    by_last, by_first = ref.domain_orders(t, Ek, R, D)
    assert by_last.shape == by_first.shape == (20, D, S)
    if D == 1:
        want = ref.dest_orders(t, Ek, R)
        assert torch.equal(by_last[:, 0], want[0]) and torch.equal(by_first[:, 0], want[1])
    own = ref.owners(t, Ek, R)
    for row in range(20):
        for by, pick in ((by_last, max), (by_first, min)):
            slots = {}
            for k, d in enumerate(own[row].tolist()):
                if d >= 0:
                    slots.setdefault(d, []).append(k)
            rank_key = {d: pick(ks) for d, ks in slots.items()}
            doms = sorted({d // S for d in slots}, key=lambda m: pick(rank_key[d] for d in slots if d // S == m))
            want = torch.full((D, S), -1, dtype=torch.int64)
            for i, m in enumerate(doms):
                ranks = sorted((d for d in slots if d // S == m), key=rank_key.get)
                want[i, :len(ranks)] = torch.tensor(ranks)
            assert torch.equal(by[row], want), (row, by[row], want)


def test_expert_rows_reads_only_local_slots():
    """The GPU side passes the received weights (0 off the rank), the host the original ones: equal results."""
    x, t, w = _world(1, 4, K=4, sizes=(6,))[0]
    local = torch.where(ref.owners(t, 8, 2) == 1, t - 4, -1)
    noisy = torch.where(local >= 0, w, torch.full_like(w, float('nan')))
    zeroed = torch.where(local >= 0, w, torch.zeros_like(w))
    a, b = sr.expert_rows(x.float(), local, noisy, 1, 4), sr.expert_rows(x.float(), local, zeroed, 1, 4)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)) and not a.isnan().any()


# ---- the case list ------------------------------------------------------------------------------------------------
def test_case_list_and_selection():
    names = [c.name for c in sc.CASES]
    assert len(names) == len(set(names)) and all(c.block in sc.BLOCKS for c in sc.CASES)
    assert [c.name for c in sc.select_cases('all')] == [c.name for c in sc.CASES if c.default]
    assert 'sglang_normal_sync' in [c.name for c in sc.select_cases('all')]
    assert [c.name for c in sc.select_cases('sglang_auto, vllm_ht_dbo')] == ['vllm_ht_dbo', 'sglang_auto']
    with pytest.raises(ValueError, match='vllm_ht_typo'):
        sc.select_cases('vllm_ht_typo')
    for block in sc.BLOCKS:                     # blocks run in the order their cases are listed
        assert any(c.block == block for c in sc.CASES)
    help_text = cli.serving_replay_parser().format_help().replace('\n', ' ')
    for name in names:
        assert name.replace('_', '') in help_text.replace(' ', '').replace('_', '')


@pytest.mark.parametrize('R,D', [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (8, 2), (4, 4)])
def test_skip_reasons_by_topology(R, D):
    """Every default case runs at every tested topology (one domain; 2x1, 2x2, 2x4, 4x1 across domains); vLLM's LL
    cases are skipped off its hidden sizes, the prefill case above the topology's token limit, each with its reason."""
    cases = sc.select_cases('all')
    n = sr.prefill_tokens(Buffer, R)
    assert sc.skip_reasons(cases, H, n, R, D) == {}
    off = sc.skip_reasons(cases, 1000, n, R, D)
    assert set(off) == {c.name for c in cases if c.block.startswith('vllm_ll')}
    assert all('hidden 1000' in why for why in off.values())
    limit = sr.token_limit(R, D)
    big = sc.skip_reasons(cases, H, limit + 1, R, D)
    assert list(big) == ['sglang_normal_prefill_growth'] and str(limit) in big['sglang_normal_prefill_growth']
    assert ('scale-up domains' in big['sglang_normal_prefill_growth']) == (D > 1)
    assert sc.skip_reasons(cases, H, limit, R, D) == {}


def test_help_works_without_torch_and_lists_the_defaults():
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['serving_replay', '--help']; "
            "runpy.run_module('deepep_cupy.tests.serving_replay', run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS='120')
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, cwd='/', timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith('usage: python -m deepep_cupy.tests.serving_replay')
    args = cli.serving_replay_parser().parse_args([])
    assert (args.num_tokens, args.num_ll_tokens, args.hidden, args.num_topk, args.num_experts, args.cases) == \
        (128, 32, 2048, 8, 64, 'all')


# ---- inputs and checks by topology ---------------------------------------------------------------------------------
def _cpu_case(D, S, rank, sizes, seed=0, K=3, Hs=256):
    """A `DomainCase` (D > 1) or `legacy_intranode.Case` built on the host: every rank's inputs as the GPU one gathers
    them (`sizes[r]` tokens of rank r), none of its CUDA tensors."""
    R = D * S
    Ek = 2 * R
    cls = sr.DomainCase if D > 1 else sr.Case
    case = cls.__new__(cls)
    g = torch.Generator().manual_seed(seed)
    case.rank, case.R, case.H, case.K, case.E = rank, R, Hs, K, Ek
    case.xs, case.topks, case.ws = [], [], []
    for n in sizes:
        case.xs.append(torch.randn(n, Hs, generator=g).to(torch.bfloat16))
        t = torch.stack([torch.randperm(Ek, generator=g)[:K] for _ in range(n)]) if n else \
            torch.empty((0, K), dtype=torch.int64)
        t[torch.rand(n, K, generator=g) < 0.2] = -1
        case.topks.append(t)
        case.ws.append(torch.randn(n, K, generator=g))
    case.host = {'bf16': (case.xs, None)}
    lay = [ref.layout(t, Ek, R) for t in case.topks]
    case.in_ranks, case.per_experts, case._refs = [a[2] for a in lay], [a[1] for a in lay], {}
    if D > 1:
        case.D, case.S, case._handles = D, S, {}
    return case


def _perfect_dispatch(case, C):
    """What a correct V1 dispatch across domains returns (from the references) and the layout it was given."""
    r = case.ref('bf16')
    h = case.handle_ref(C)
    per_rank, per_expert, in_rank = ref.layout(case.topks[case.rank], case.E, case.R)
    handle = [in_rank] + [torch.from_numpy(np.ascontiguousarray(a).astype(np.int32)) for a in h.v1_tuple()[1:7]]
    handle += [torch.from_numpy(np.ascontiguousarray(a)) for a in h.v1_tuple()[7:]]
    layout = (per_rank, torch.from_numpy(h.num_tokens_per_rdma_rank), per_expert, in_rank)
    out = (r.recv_x, r.recv_topk_idx, r.recv_topk_weights, ref.aligned(r.expert_counts, 1), tuple(handle), None)
    return out, layout


@pytest.mark.parametrize('D,S', [(2, 1), (2, 2), (4, 1), (2, 4)])
def test_the_internode_checks_accept_a_correct_dispatch_and_catch_errors(D, S):
    """`check_normal` across domains: the framework's layout (num_tokens_per_rdma_rank included) and
    legacy_internode.check_dispatch (rows in V1's receive order, counts, all 10 handle elements) accept outputs built
    from the references, for every rank (one with 0 tokens), and name what a wrong one gets wrong."""
    R, C = D * S, 4
    sizes = [7, 0] + [5 + r for r in range(2, R)]
    for rank in range(R):
        case = _cpu_case(D, S, rank, sizes, seed=D * 10 + S)
        out, layout = _perfect_dispatch(case, C)
        sr.check_normal(case, 'bf16', out, layout, 1, 2 * C, f'[rank {rank}]')
        assert case.layout is layout
        bad = list(out[4])
        bad[8] = bad[8].clone()
        if bad[8].numel():
            bad[8].view(-1)[0] += 1
            with pytest.raises(Failure, match='send_rdma_head'):
                sr.check_normal(case, 'bf16', out[:4] + (tuple(bad),) + out[5:], layout, 1, 2 * C, 'bad')
        rdma = layout[1].clone()
        rdma[0] += 1
        with pytest.raises(Failure, match='num_tokens_per_rdma_rank'):
            sr.check_normal(case, 'bf16', out, (layout[0], rdma) + layout[2:], 1, 2 * C, 'bad')
        with pytest.raises(Failure, match='num_tokens_per_rdma_rank is None'):
            sr.check_normal(case, 'bf16', out, (layout[0], None) + layout[2:], 1, 2 * C, 'bad')
        other = tuple(layout[:3]) + (layout[3].clone(),)       # the handle must hold the layout's tensor itself
        with pytest.raises(Failure, match='handle\\[0\\]'):
            sr.check_normal(case, 'bf16', out, other, 1, 2 * C, 'bad')


def test_one_domain_layout_check_wants_no_rdma_counts():
    case = _cpu_case(1, 2, 0, [4, 3])
    per_rank, per_expert, in_rank = ref.layout(case.topks[0], case.E, case.R)
    sr.check_layout(case, (per_rank, None, per_expert, in_rank), 4, 'one domain')
    with pytest.raises(Failure, match='must be None'):
        sr.check_layout(case, (per_rank, torch.zeros(1, dtype=torch.int32), per_expert, in_rank), 4, 'one domain')


def test_check_combined_uses_the_references_of_the_topology():
    for D, S in ((1, 4), (2, 2), (4, 1)):
        case = _cpu_case(D, S, 2, [6, 0, 5, 3], seed=3)
        x, t, w = case.xs[2], case.topks[2], case.ws[2]
        want = _brute_force_domains(x, t, w, case.E, case.R, D)
        sr.check_combined(case, 'bf16', want, f'{D}x{S}')
        if D > 1 and not torch.equal(want, _brute_force_domains(x, t, w, case.E, case.R, 1)):
            with pytest.raises(Failure, match='combined_x'):
                sr.check_combined(case, 'bf16', _brute_force_domains(x, t, w, case.E, case.R, 1), 'one level')


def test_context_picks_inputs_and_checks_by_topology(monkeypatch):
    made, checked = [], []
    monkeypatch.setattr(sr, 'Case', lambda *a, **k: made.append(('Case', a, k)))
    monkeypatch.setattr(sr, 'DomainCase', lambda *a, **k: made.append(('DomainCase', a, k)))
    monkeypatch.setattr(sr.llp, 'check_dispatch', lambda *a: checked.append(('one domain', a)))
    monkeypatch.setattr(sr, 'check_ll_dispatch_across', lambda *a: checked.append(('across', a)))
    args = SimpleNamespace(num_tokens=16, num_ll_tokens=4, hidden=H, num_topk=8, num_experts=E)
    group = SimpleNamespace(rank=1, size=4)
    for D, kind in ((1, 'Case'), (2, 'DomainCase'), (4, 'DomainCase')):
        made.clear()
        checked.clear()
        ctx = sr.Context(args, group, None, None, Buffer, {}, num_domains=D)
        assert (ctx.D, ctx.S) == (D, 4 // D)
        ctx.case(3, zero=True)
        name, a, k = made[0]
        assert name == kind and k == {'zero_ranks': {1, 3}}
        assert a == ((group, D) if D > 1 else (group,)) + (16, H, 8, E, 3)
        ctx.check_ll_dispatch('inp', 'out', sr.FP8, 256, 'what')
        assert checked == [('across' if D > 1 else 'one domain', ('inp', 'out', sr.FP8, 256, (), 'what'))]
        ctx.check_buffer(SimpleNamespace(num_domains=D, num_scaleup_ranks=4 // D))
        other = (1, 4) if D > 1 else (2, 2)
        with pytest.raises(Failure, match=f'expected {D} x {4 // D}'):
            ctx.check_buffer(SimpleNamespace(num_domains=other[0], num_scaleup_ranks=other[1]))


def test_normal_mode_is_the_topologys():
    one, across = SimpleNamespace(num_growths=1), SimpleNamespace(num_growths=2)
    assert sc.normal_mode(SimpleNamespace(_normal=one, _internode=None)) is one
    assert sc.normal_mode(SimpleNamespace(_normal=None, _internode=across)) is across


# ---- every deep_ep call binds to the V1 Buffer's signature ----------------------------------------------------------
V1_METHODS = ('get_dispatch_layout', 'dispatch', 'combine', 'low_latency_dispatch', 'low_latency_combine',
              'clean_low_latency_buffer', 'capture', 'set_num_sms', 'destroy', 'get_local_buffer_tensor',
              'low_latency_query_mask_buffer', 'low_latency_clean_mask_buffer', 'get_low_latency_rdma_size_hint')


def test_every_deep_ep_call_of_the_sequences_binds_to_the_v1_signature():
    tree = ast.parse((ROOT / 'deepep_cupy' / 'tests' / 'serving_replay_cases.py').read_text())
    seen = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        attr = node.func.attr
        if attr not in V1_METHODS and attr != 'Buffer':
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue                            # Buffer(**kwargs): the kwargs test above binds those
        fn = Buffer.__init__ if attr == 'Buffer' else getattr(Buffer, attr)
        sig = inspect.signature(fn)
        selfless = isinstance(inspect.getattr_static(Buffer, attr, None), staticmethod)
        placeholders = ([] if selfless else [None]) + [None] * len(node.args)
        try:
            sig.bind(*placeholders, **{k.arg: None for k in node.keywords})
        except TypeError as e:
            raise AssertionError(f'line {node.lineno}: {attr}(...) does not bind to Buffer.{attr}{sig}: {e}') from e
        seen.add(attr)
    assert seen >= {'get_dispatch_layout', 'dispatch', 'combine', 'low_latency_dispatch', 'low_latency_combine',
                    'clean_low_latency_buffer', 'capture', 'Buffer', 'get_local_buffer_tensor'}


# ---- the call order, on a recording buffer --------------------------------------------------------------------------
class FakeEvent:
    def __init__(self, live=True):
        self.event, self.waits = (object() if live else None), 0

    def current_stream_wait(self):
        assert self.event is not None, 'current_stream_wait on an empty EventOverlap'
        self.waits += 1


class RecordingBuffer:
    """The V1 Buffer's calls, each bound to the real signature and logged as (name, arguments)."""
    log = []
    num_sms = 20
    get_dispatch_config = staticmethod(Buffer.get_dispatch_config)
    get_combine_config = staticmethod(Buffer.get_combine_config)
    get_low_latency_rdma_size_hint = staticmethod(Buffer.get_low_latency_rdma_size_hint)

    @classmethod
    def _record(cls, name, fn, *args, **kwargs):
        bound = inspect.signature(fn).bind(None, *args, **kwargs)
        bound.apply_defaults()
        arguments = {k: v for k, v in bound.arguments.items() if k != 'self'}
        cls.log.append((name, arguments))
        return arguments

    def __init__(self, *args, **kwargs):
        self.low_latency_mode = self._record('Buffer', Buffer.__init__, *args, **kwargs)['low_latency_mode']

    @classmethod
    def capture(cls):
        cls.log.append(('capture', {}))
        return FakeEvent()

    def get_dispatch_layout(self, *args, **kwargs):
        a = self._record('get_dispatch_layout', Buffer.get_dispatch_layout, *args, **kwargs)
        n = a['topk_idx'].shape[0]
        return (torch.zeros(2, dtype=torch.int32), None, torch.zeros(E, dtype=torch.int32),
                torch.zeros((n, 2), dtype=torch.bool), FakeEvent(a['async_finish']))

    def dispatch(self, *args, **kwargs):
        a = self._record('dispatch', Buffer.dispatch, *args, **kwargs)
        return a['x'], a['topk_idx'], a['topk_weights'], [0] * 4, 'handle', FakeEvent(a['async_finish'])

    def combine(self, *args, **kwargs):
        a = self._record('combine', Buffer.combine, *args, **kwargs)
        return a['x'], None, FakeEvent(a['async_finish'])

    def low_latency_dispatch(self, *args, **kwargs):
        a = self._record('low_latency_dispatch', Buffer.low_latency_dispatch, *args, **kwargs)
        hook = (lambda: self.log.append(('hook', {}))) if a['return_recv_hook'] else None
        return 'recv', 'count', 'llhandle', FakeEvent(a['async_finish']), hook

    def low_latency_combine(self, *args, **kwargs):
        a = self._record('low_latency_combine', Buffer.low_latency_combine, *args, **kwargs)
        hook = (lambda: self.log.append(('hook', {}))) if a['return_recv_hook'] else None
        return (a['out'] if a['out'] is not None else 'combined'), FakeEvent(a['async_finish']), hook

    def clean_low_latency_buffer(self, *args, **kwargs):
        self._record('clean_low_latency_buffer', Buffer.clean_low_latency_buffer, *args, **kwargs)


@pytest.fixture
def ctx():
    RecordingBuffer.log = []
    env = sr.framework_env({})
    return SimpleNamespace(Buffer=RecordingBuffer, env=env, E=E, H=H, R=2, D=1, rank=0, what='[test]',
                           torch_group=SimpleNamespace(size=lambda: 2), cpu_group='cpu_group')


def _names(log):
    return [name for name, _ in log]


def test_sglang_normal_calls(ctx):
    state = sc.SGLangBuffer(ctx, 'normal')
    assert RecordingBuffer.log[0][1]['allow_mnnvl'] is True and RecordingBuffer.log[0][1]['low_latency_mode'] is False
    disp = sc.SGLangNormal(ctx, state)
    x, ids, w = torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)
    RecordingBuffer.log = []
    out, _ = disp.dispatch_b(*disp.dispatch_a(x, ids, w))
    disp.combine_b(*disp.combine_a(x))
    assert _names(RecordingBuffer.log) == ['capture', 'get_dispatch_layout', 'dispatch', 'capture', 'combine']
    layout, dispatch, combine = (a for n, a in RecordingBuffer.log if n != 'capture')
    assert layout['topk_idx'].dtype == torch.int64 and layout['previous_event'] is not None
    assert (layout['async_finish'], layout['allocate_on_comm_stream']) == (True, True)
    assert (dispatch['async_finish'], dispatch['allocate_on_comm_stream'], dispatch['expert_alignment'],
            dispatch['config']) == (True, True, 128, None)
    assert (combine['async_finish'], combine['allocate_on_comm_stream'], combine['topk_weights']) == (True, True, None)
    assert out[5].waits == 1 and disp.handle is None
    # async_finish=False (the class default): the layout's empty event goes on as the dispatch's previous_event
    RecordingBuffer.log = []
    sync = sc.SGLangNormal(ctx, state, async_finish=False)
    sync.dispatch_b(*sync.dispatch_a(x, ids, w))
    layout, dispatch = (a for _, a in RecordingBuffer.log)
    assert layout['previous_event'] is None and dispatch['previous_event'].event is None
    assert (dispatch['async_finish'], dispatch['allocate_on_comm_stream']) == (False, False)


def test_sglang_low_latency_calls_and_the_auto_clean(ctx):
    state = sc.SGLangBuffer(ctx, 'auto')
    assert RecordingBuffer.log[0][1]['num_qps_per_rank'] == max(20, E // 2)
    x, ids, w = torch.zeros(3, H, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2)
    for mode, extra in ((sr.FP8, {'round_scale': False, 'use_ue8m0': False}), (sr.BF16, None)):
        RecordingBuffer.log = []
        disp = sc.SGLangLowLatency(ctx, state, mode)
        out = disp.dispatch_a(x, ids)
        disp.dispatch_b(out)
        disp.combine_b(*disp.combine_a(x, ids, w))
        assert _names(RecordingBuffer.log) == ['low_latency_dispatch', 'hook', 'low_latency_combine', 'hook']
        d, c = RecordingBuffer.log[0][1], RecordingBuffer.log[2][1]
        assert (d['num_max_dispatch_tokens_per_rank'], d['num_experts'], d['use_fp8']) == (128, E, mode[0])
        assert (d['async_finish'], d['return_recv_hook'], c['async_finish'], c['return_recv_hook']) == \
            (False, True, False, True)
        assert c['handle'] == 'llhandle' and c['out'] is None and c['zero_copy'] is False
        if extra:
            assert {k: d[k] for k in extra} == extra
    RecordingBuffer.log = []
    for phase in ('decode', 'prefill', 'decode', 'decode', 'prefill', 'decode'):
        state.low_latency() if phase == 'decode' else state.normal()
    assert _names(RecordingBuffer.log) == ['clean_low_latency_buffer'] * 2 and state.cleans == 2
    assert RecordingBuffer.log[0][1] == dict(num_max_dispatch_tokens_per_rank=128, hidden=H, num_experts=E)


def test_vllm_calls(ctx):
    buf = RecordingBuffer(**sr.vllm_ht_buffer_kwargs('cpu_group', ctx.env))
    case = SimpleNamespace(x=torch.zeros(3, 8, dtype=torch.bfloat16), topk_idx=torch.zeros(3, 2, dtype=torch.int64),
                           topk_weights=torch.zeros(3, 2), E=E)
    for dbo, prev in ((False, None), (True, FakeEvent())):
        RecordingBuffer.log = []
        out, _ = sc.vllm_ht_dispatch(buf, case, 'bf16', None, prev, dbo=dbo)
        output = torch.empty_like(case.x)
        sc.vllm_ht_finalize(buf, out[4], case.x, None, output, True, prev, dbo=dbo)
        layout, dispatch, combine = (a for _, a in RecordingBuffer.log)
        assert layout['previous_event'] is prev and dispatch['previous_event'] is prev
        assert (layout['async_finish'], layout['allocate_on_comm_stream']) == (False, False)
        assert (dispatch['async_finish'], dispatch['allocate_on_comm_stream'], dispatch['expert_alignment']) == \
            (not dbo, False, 1)
        assert (combine['topk_weights'], combine['async_finish'], combine['allocate_on_comm_stream']) == \
            (None, not dbo, False)
    inp = SimpleNamespace(x=torch.zeros(2, H, dtype=torch.bfloat16), topk_idx=case.topk_idx[:2],
                          topk_weights=case.topk_weights[:2], E=E)
    for hook in (True, False):
        RecordingBuffer.log = []
        out = sc.vllm_ll_prepare(buf, inp, 256, sr.FP8_UE8M0)
        output, recv_hook = sc.vllm_ll_finalize(buf, inp, out[2], inp.x, hook)
        d, c = RecordingBuffer.log[0][1], RecordingBuffer.log[1][1]
        assert (d['use_fp8'], d['round_scale'], d['use_ue8m0'], d['async_finish'], d['return_recv_hook']) == \
            (True, True, True, False, True)
        assert (c['zero_copy'], c['async_finish'], c['return_recv_hook'], c['out'] is output) == \
            (False, False, hook, True)
        assert (recv_hook is not None) == hook


@pytest.mark.parametrize('D', [1, 2])
def test_vllm_managers_build_the_buffer_of_the_topology(ctx, D):
    """get_handle's Buffer(**kwargs): the HT manager's internode branch across domains; the LL manager's one branch."""
    ctx.D = D
    sc.VllmManager(ctx, False)
    sc.VllmManager(ctx, True)
    (_, ht), (_, ll) = RecordingBuffer.log
    assert (ht['num_rdma_bytes'], ht['num_qps_per_rank']) == ((1 << 30, 10) if D > 1 else (0, 1))
    assert ll == {**ll, 'low_latency_mode': True, 'num_qps_per_rank': E // 2,
                  'num_rdma_bytes': Buffer.get_low_latency_rdma_size_hint(256, H, 2, E)}


# ---- the sequences on the V1 Buffer's host path across domains (no GPU: fake kernels, no data moved) ---------------
def test_normal_mode_sequences_run_on_the_internode_host_path():
    """tests/serving_replay_host_path_prog.py in a subprocess: vLLM HT and SGLang normal sequences (this file's
    functions) through the real V1 adapter and hybrid / intranode engines' Python at 2x2, V1's internode shapes."""
    prog = Path(__file__).with_name('serving_replay_host_path_prog.py')
    out = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith('OK'), out.stdout[-3000:] + out.stderr[-3000:]
    for line in ('vLLM HT fp8 dbo=True async=True', 'SGLang normal ue8m0 async_finish=False',
                 'SGLang normal two-batch overlap: OK', '0-token rank: OK'):
        assert line in out.stdout, line


def test_low_latency_sequences_on_the_internode_host_path(monkeypatch):
    """vLLM's and SGLang's low-latency sequences on a V1 Buffer across 2 x 2 domains (the real InternodeLLMode over
    test_legacy_internode_ll_cpu's fake engine): the hooked sends go to the communication stream and each `hook()`
    receives on the caller's stream, vLLM's synchronous finalize stays there, DBO's order (D0, hook D0, D1, hook D1,
    C0, hook C0, C1, hook C1) runs through, and SGLang's clean at a normal -> low-latency switch is accepted."""
    from test_legacy_internode_ll_cpu import _buffer, _fake_mode, _names
    log = []
    mode, current, comm, built = _fake_mode(monkeypatch, log)
    buf = _buffer()
    buf._ll_internode = mode
    Rr, Hh, Ee, Kk = 4, 512, 16, 2
    M = sr.framework_env({})['VLLM_MOE_DP_CHUNK_SIZE']

    def inputs(n):
        return SimpleNamespace(x=torch.zeros(n, Hh, dtype=torch.bfloat16), topk_weights=torch.zeros(n, Kk), E=Ee,
                               topk_idx=torch.zeros(n, Kk, dtype=torch.int64))
    y = torch.zeros(Ee // Rr, Rr * M, Hh, dtype=torch.bfloat16)
    for mode_bits in (sr.BF16, sr.FP8, sr.FP8_UE8M0):
        for do_recv_hook in (True, False):
            inp = inputs(5)
            log.clear()
            out = sc.vllm_ll_prepare(buf, inp, M, mode_bits)
            assert _names(log) == [('ll_internode_prepare', 'comm'), ('hybrid_dispatch', 'comm')]
            out[4]()
            assert _names(log)[2:] == [('ll_internode_layout', 'current'), ('ll_internode_scatter', 'current')]
            log.clear()
            output, hook = sc.vllm_ll_finalize(buf, inp, out[2], y, do_recv_hook)
            on = 'comm' if do_recv_hook else 'current'
            assert _names(log)[:2] == [('ll_internode_gather', on), ('hybrid_combine', on)]
            if hook is not None:
                hook()
            assert _names(log)[2:] == [('ll_internode_reduce', 'current')] and output.shape == (5, Hh)
    assert built == [(M * Kk, Hh)]
    # vLLM DBO (two micro-batches, hooks run by the other one)
    inps = [inputs(5), inputs(0)]
    log.clear()
    d0 = sc.vllm_ll_prepare(buf, inps[0], M, sr.FP8)
    d0[4]()
    d1 = sc.vllm_ll_prepare(buf, inps[1], M, sr.FP8)
    _, h0 = sc.vllm_ll_finalize(buf, inps[0], d0[2], y, True)
    d1[4]()
    _, h1 = sc.vllm_ll_finalize(buf, inps[1], d1[2], y, True)
    h0()
    h1()
    assert [n for n, _ in _names(log)].count('hybrid_dispatch') == 2 and \
        [n for n, _ in _names(log)].count('ll_internode_reduce') == 1     # (0 tokens in micro-batch 1: no reduce)
    # SGLang low latency (return_recv_hook=True), then the auto mode's clean at a normal -> low-latency switch
    state = SimpleNamespace(low_latency=lambda: buf,
                            M=sr.framework_env({})['SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK'])
    ctx = SimpleNamespace(E=Ee, H=Hh)
    disp = sc.SGLangLowLatency(ctx, state, sr.FP8)
    inp = inputs(3)
    log.clear()
    out = disp.dispatch_a(inp.x, inp.topk_idx)
    disp.dispatch_b(out)
    combined = disp.combine_b(*disp.combine_a(torch.zeros(Ee // Rr, Rr * state.M, Hh, dtype=torch.bfloat16),
                                              inp.topk_idx, inp.topk_weights))
    assert combined.shape == (3, Hh) and disp.handle is None
    assert [s for _, s in _names(log)] == ['comm', 'comm', 'current', 'current', 'comm', 'comm', 'current']
    buf.clean_low_latency_buffer(state.M, Hh, Ee)
