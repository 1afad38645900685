"""Low-latency engine without a GPU: the host references (against naive loops and utils.math), the region layout and
size hint, the argument checks, the kernel declarations against kernels_cu/ep_ll.cu, and the sm_90 compile."""


import numpy as np
import pytest

torch = pytest.importorskip('torch')

from deepep_cupy.features import ll  # noqa: E402
from deepep_cupy.jit import compiler  # noqa: E402
from deepep_cupy.tests import ll_reference as ref  # noqa: E402


# ---- references ----------------------------------------------------------------------------------------------------
def _random_x(n, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((n, h), generator=g) * torch.rand((n, 1), generator=g) * 8).to(torch.bfloat16)
    if n > 3:
        x[1] = 0                          # amax clamp
        x[2, :128] = 1e-7                 # tiny group
        x[3, 5] = -3e38                   # huge value
    return x


def _bf16_amaxes():
    """Every group amax the cast can see: each finite positive bfloat16, clamped to 1e-4, as float32."""
    bits = np.arange(0x0001, 0x7F80, dtype=np.uint32) << 16
    return np.unique(np.maximum(bits.view(np.float32), np.float32(1e-4)))


def _ceil_pow2_exponent(d):
    b = d.view(np.uint32)
    return (b >> 23) + ((b & 0x7FFFFF) != 0)


def test_cast_fp8_round_scale_equals_utils_math():
    # With round_scale DeepEP V1's kernel (amax * float(1/448)) and V2's torch recipe (amax / 448) agree
    from deepep_cupy.utils.math import per_token_cast_to_fp8
    x = _random_x(48, 1024)
    q, sf = ref.cast_fp8(x, True)
    q2, sf2 = per_token_cast_to_fp8(x, round_scale=True)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(sf.view(torch.int32), sf2.view(torch.int32))
    _, packed = per_token_cast_to_fp8(x, use_ue8m0=True, round_scale=True)
    assert torch.equal(ref.pack_ue8m0(sf), packed)


def test_round_scale_recipes_agree_on_every_bf16_amax():
    # ... on every input: the two products differ by at most one ulp, and only an exact power of two (amax = 448 * 2^k,
    # where both are exact) could put them on either side of a binade boundary
    amax = _bf16_amaxes()
    f32 = np.float32
    v1 = amax * (f32(1) / f32(448))
    v2 = amax / f32(448)
    assert v1.dtype == v2.dtype == np.float32
    assert np.array_equal(_ceil_pow2_exponent(v1), _ceil_pow2_exponent(v2))
    assert (v1 != v2).mean() > 0.4                  # while the unrounded scales often differ


def test_cast_fp8_differs_from_utils_math_without_round_scale():
    # Without round_scale the V1 low-latency cast is DeepEP v1.2.1's kernel recipe, not V2's torch recipe
    from deepep_cupy.utils.math import per_token_cast_to_fp8
    x = _random_x(48, 1024)
    q, sf = ref.cast_fp8(x, False)
    q2, sf2 = per_token_cast_to_fp8(x, round_scale=False)
    amax = x.reshape(48, 8, 128).abs().float().amax(dim=2).clamp(min=1e-4).numpy()
    assert np.array_equal(sf.numpy(), amax * (np.float32(1) / np.float32(448)))
    assert not torch.equal(sf, sf2) and not torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert (sf - sf2).abs().max() <= sf.abs().max() * 2 ** -23


def test_cast_fp8_on_a_value_where_the_recipes_differ():
    # amax 3: 448 / 3 rounds to 0x43155555, and 1.125 * it is exactly 168, a tie between e4m3 160 (0x72, even) and
    # 176 (0x73); V2's reciprocal(3) * 448 rounds one ulp higher (0x43155556), so 1.125 * it goes to 176. The scales
    # differ in the last bit too: 3 * float(1/448) = 0x3bdb6db8, 3 / 448 = 0x3bdb6db7.
    x = torch.zeros((1, 128), dtype=torch.bfloat16)
    x[0, 0], x[0, 1], x[0, 2] = 3.0, 1.125, -2.25
    q, sf = ref.cast_fp8(x, False)
    assert int(sf.view(torch.int32)[0, 0]) == 0x3BDB6DB8
    assert q.view(torch.uint8)[0, :3].tolist() == [0x7E, 0x72, 0xFA]
    from deepep_cupy.utils.math import per_token_cast_to_fp8
    q2, sf2 = per_token_cast_to_fp8(x)
    assert int(sf2.view(torch.int32)[0, 0]) == 0x3BDB6DB7
    assert q2.view(torch.uint8)[0, :3].tolist() == [0x7E, 0x73, 0xFB]


@pytest.mark.parametrize('round_scale', [False, True])
def test_cast_fp8_equals_naive_loop(round_scale):
    # DeepEP v1.2.1 csrc/kernels/utils.cuh calculate_fp8_scales, csrc/kernels/internode_ll.cu dispatch's cast
    x = _random_x(6, 256, seed=3)
    q, sf = ref.cast_fp8(x, round_scale)
    f32 = np.float32
    inv = f32(f32(1) / f32(448))
    for t in range(x.shape[0]):
        for g in range(2):
            vals = x[t, g * 128:(g + 1) * 128].float().numpy()
            amax = max(f32(np.abs(vals).max()), f32(1e-4))
            if round_scale:
                d = f32(amax * inv)
                bits = int(np.array([d], np.float32).view(np.int32)[0])
                e = (bits >> 23) + (1 if bits & 0x7FFFFF else 0)
                scale_inv = np.array([e << 23], np.int32).view(np.float32)[0]
                scaled = [f32(v / scale_inv) for v in vals]
            else:
                scale_inv = f32(amax * inv)
                scale = f32(f32(448) / amax)
                scaled = [f32(v * scale) for v in vals]
            assert sf[t, g].item() == scale_inv
            want = torch.tensor(scaled, dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(q[t, g * 128:(g + 1) * 128].view(torch.uint8), want)


def test_dequantize_matches_scaled_fp8():
    x = _random_x(8, 512, seed=5)
    q, sf = ref.cast_fp8(x, True)
    a = ref.dequantize(q, sf)
    b = ref.dequantize(q, ref.pack_ue8m0(sf))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert (a.float() - x.float()).abs().max() <= x.float().abs().max() / 8


def _inputs(num_ranks, num_tokens, num_topk, num_experts, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs, topks = [], []
    for s in range(num_ranks):
        n = num_tokens[s]
        xs.append(torch.randn((n, 512), generator=g).to(torch.bfloat16))
        scores = torch.rand((n, num_experts), generator=g)
        topk = torch.topk(scores, num_topk, dim=1).indices if n else torch.empty((0, num_topk), dtype=torch.int64)
        if n:
            topk[torch.rand((n, num_topk), generator=g) < 0.2] = -1
        topks.append(topk)
    return xs, topks


@pytest.mark.parametrize('use_fp8, round_scale, use_ue8m0', [(False, False, False), (True, False, False),
                                                              (True, True, False), (True, True, True)])
@pytest.mark.parametrize('masked', [(), (1,)])
def test_dispatch_reference_equals_naive_loop(use_fp8, round_scale, use_ue8m0, masked):
    R, E, K, M = 3, 12, 4, 7
    xs, topks = _inputs(R, [7, 0, 5], K, E)
    L = E // R
    for rank in range(R):
        got = ref.dispatch_reference(xs, topks, rank, E, M, use_fp8, round_scale, use_ue8m0, masked)
        for j in range(L):
            e = rank * L + j
            rows = []
            begin = 0
            for s in range(R):
                mine = [] if s in masked else [(t, k) for t in range(topks[s].shape[0]) for k in range(K)
                                               if int(topks[s][t, k]) == e]
                assert int(got.layout_range[j, s]) == (begin << 32) | len(mine)
                begin += len(mine)
                rows += [(s, t, k) for t, k in mine]
            ex = got.experts[j]
            assert ex.count == len(rows) == int(got.recv_count[j])
            for i, (s, t, k) in enumerate(rows):
                assert (int(ex.src_rank[i]), int(ex.src_info[i]), int(ex.topk_slot[i])) == (s, t, k)
                if use_fp8:
                    q, sf = ref.cast_fp8(xs[s][t:t + 1], round_scale)
                    assert torch.equal(ex.x[i].view(torch.uint8), q[0].view(torch.uint8))
                    want_sf = ref.pack_ue8m0(sf)[0] if use_ue8m0 else sf[0]
                    assert torch.equal(ex.scales[i], want_sf)
                else:
                    assert torch.equal(ex.x[i].view(torch.int16), xs[s][t].view(torch.int16))


def test_dispatch_reference_drops_repeats_past_m():
    xs = [torch.zeros((3, 128), dtype=torch.bfloat16)]
    topks = [torch.tensor([[0, 0], [0, 1], [0, 0]])]       # expert 0 chosen 5 times by 3 tokens, M = 3
    got = ref.dispatch_reference(xs, topks, 0, 2, 3, False)
    assert got.experts[0].count == 3 and [int(t) for t in got.experts[0].src_info] == [0, 0, 1]
    assert [int(k) for k in got.experts[0].topk_slot] == [0, 1, 0]


@pytest.mark.parametrize('masked', [(), (0,)])
def test_combine_reference_equals_naive_loop(masked):
    R, E, K, N, H = 2, 8, 5, 6, 16
    g = torch.Generator().manual_seed(7)
    topk = torch.randint(-1, E, (N, K), generator=g)
    topk[0, 1] = E + 3                                   # out of range: ignored like -1
    w = torch.rand((N, K), generator=g) * 3
    base = torch.randn((N, H), generator=g).to(torch.bfloat16)

    def row_of(e, k):
        return (base.float() * ref.expert_factor(e).unsqueeze(1)).to(torch.bfloat16)

    got = ref.combine_reference(topk, w, E, R, row_of, masked)
    f32 = np.float32
    for t in range(N):
        acc = np.zeros(H, np.float32)
        for k in range(K):
            e = int(topk[t, k])
            if not 0 <= e < E or e // (E // R) in masked:
                continue
            row = row_of(topk[:, k], k)[t].float().numpy()
            acc = (acc + (f32(w[t, k].item()) * row).astype(np.float32)).astype(np.float32)
        want = torch.from_numpy(acc).to(torch.bfloat16)
        assert torch.equal(got[t].view(torch.int16), want.view(torch.int16)), t


# ---- layout ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('dims', [(128, 7168, 2, 288), (128, 7168, 1, 256), (8, 128, 8, 8), (256, 4096, 8, 64),
                                  (1, 2560, 4, 4)])
def test_layout_sections_disjoint_aligned(dims):
    M, H, R, E = dims
    for k in (1, 8, 32):
        lay = ll.LLLayout(M, H, R, E, k)
        sections = [(0, 8 * E), (lay.cflags_offset, 4 * lay.cflags_words), (lay.lists_offset, 4 * E * M),
                    (lay.dslots_offset, lay.num_messages * lay.msg_bytes),
                    (lay.cslots_offset, M * k * 2 * H)]
        for (a, n), (b, _) in zip(sections, sections[1:]):
            assert a + n <= b and b % ll.SECTION_ALIGN == 0
        assert sections[-1][0] + sections[-1][1] <= lay.half_bytes
        assert lay.msg_bytes % 16 == 0 and lay.msg_hidden_offset >= 4 * lay.num_segs
        assert lay.msg_hidden_offset + H + 4 * (H // 128) <= lay.msg_bytes       # FP8 message fits
        assert lay.staging_offset == ll.CONTROL_BYTES + 2 * lay.half_bytes
        assert lay.staging_half_bytes >= E * M * 2 * H
    hint = ll.get_rdma_size_hint(M, H, R, E)
    assert hint % (2 << 20) == 0 and hint >= ll.LLLayout(M, H, R, E, 32).total_bytes


def test_size_hint_decode_shape():
    # 128 tokens, hidden 7168, 288 experts, 2 ranks: dominated by the zero-copy staging (2 * E * M * 2H)
    hint = ll.get_rdma_size_hint(128, 7168, 2, 288)
    assert 2 * 288 * 128 * 2 * 7168 < hint < 1.3e9


def test_layout_for_region_picks_largest_topk_and_explains():
    need8 = ll.LLLayout(16, 1024, 2, 16, 8).total_bytes
    assert ll.layout_for_region(16, 1024, 2, 16, need8).num_max_topk == 8
    assert ll.layout_for_region(16, 1024, 2, 16, 1 << 40).num_max_topk == 32
    with pytest.raises(ValueError, match='get_low_latency_rdma_size_hint'):
        ll.layout_for_region(16, 1024, 2, 16, 1000)


@pytest.mark.parametrize('args, err, match', [
    ((0, 1024, 2, 16), ValueError, 'num_max_dispatch_tokens_per_rank must be >= 1'),
    ((8, 1000, 2, 16), ValueError, 'multiple of 128'),
    ((8, 1024, 9, 18), ValueError, 'at most 8 ranks'),
    ((8, 1024, 3, 16), ValueError, 'multiple of the number of ranks'),
    ((8.0, 1024, 2, 16), TypeError, 'must be an int'),
    ((8, 1024, 2, 8192), ValueError, 'at most 4096'),
])
def test_size_hint_rejects_bad_dims(args, err, match):
    with pytest.raises(err, match=match):
        ll.get_rdma_size_hint(*args)


# ---- argument checks (CPU tensors: the planner's device is -1) -----------------------------------------------------
@pytest.fixture()
def planner():
    return ll.LLPlanner(ll.LLLayout(16, 1024, 2, 16, 8), rank=0, device=-1)


def _dispatch_args(N=4, H=1024, K=4, M=16, E=16):
    return dict(x=torch.zeros((N, H), dtype=torch.bfloat16), topk_idx=torch.zeros((N, K), dtype=torch.int64),
                num_max_dispatch_tokens_per_rank=M, num_experts=E)


def test_plan_dispatch_ok(planner):
    p = planner.plan_dispatch(**_dispatch_args(), use_fp8=True, round_scale=True, use_ue8m0=True,
                              cumulative_local_expert_recv_stats=torch.zeros(8, dtype=torch.int32),
                              dispatch_wait_recv_cost_stats=torch.zeros(2, dtype=torch.int64))
    assert (p.num_local_experts, p.num_rows, p.num_tokens, p.num_topk, p.hidden) == (8, 32, 4, 4, 1024)
    p = planner.plan_dispatch(**_dispatch_args(N=0, M=4, E=8), use_fp8=False)
    assert p.num_tokens == 0 and p.num_rows == 8


@pytest.mark.parametrize('change, kwargs, err, match', [
    (dict(N=17), {}, ValueError, 'more than num_max_dispatch_tokens_per_rank'),
    (dict(M=32, N=4), {}, ValueError, 'exceeds the 16'),
    (dict(H=2048), {}, ValueError, 'hidden=2048 exceeds'),
    (dict(H=1000), {}, ValueError, 'multiple of 128'),
    (dict(E=32), {}, ValueError, 'num_experts=32 exceeds'),
    (dict(E=15), {}, ValueError, 'multiple of the number of ranks'),
    (dict(K=9), {}, ValueError, 'num_topk=9 exceeds'),
    (dict(K=33), {}, ValueError, r'num_topk must be in \[1, 32\]'),
    ({}, dict(use_ue8m0=True), ValueError, 'requires round_scale=True'),
    ({}, dict(async_finish=True, return_recv_hook=True), ValueError, 'mutually exclusive'),
    ({}, dict(use_fp8=1), TypeError, 'use_fp8 must be a bool'),
    ({}, dict(cumulative_local_expert_recv_stats=torch.zeros(8, dtype=torch.int64)), TypeError,
     'cumulative_local_expert_recv_stats must be int32'),
    ({}, dict(dispatch_wait_recv_cost_stats=torch.zeros(3, dtype=torch.int64)), ValueError,
     r'dispatch_wait_recv_cost_stats must have shape \[2\]'),
])
def test_plan_dispatch_rejects(planner, change, kwargs, err, match):
    with pytest.raises(err, match=match):
        planner.plan_dispatch(**_dispatch_args(**change), **kwargs)


def test_plan_dispatch_rejects_bad_tensors(planner):
    a = _dispatch_args()
    with pytest.raises(TypeError, match='x must be bfloat16'):
        planner.plan_dispatch(**{**a, 'x': a['x'].float()})
    with pytest.raises(TypeError, match='topk_idx must be int64'):
        planner.plan_dispatch(**{**a, 'topk_idx': a['topk_idx'].int()})
    with pytest.raises(ValueError, match='x must be contiguous'):
        planner.plan_dispatch(**{**a, 'x': torch.zeros((1024, 4), dtype=torch.bfloat16).t()})
    with pytest.raises(ValueError, match='topk_idx must be'):
        planner.plan_dispatch(**{**a, 'topk_idx': torch.zeros((3, 4), dtype=torch.int64)})
    with pytest.raises(TypeError, match='x must be a torch.Tensor or a cupy.ndarray'):
        planner.plan_dispatch(**{**a, 'x': np.zeros((4, 1024))})
    with pytest.raises(ValueError, match='hidden must be a multiple of 512'):
        ll.LLPlanner(ll.LLLayout(16, 1024 + 128, 2, 16, 8), 0, -1).plan_dispatch(
            **_dispatch_args(H=1024 + 128), use_fp8=True, round_scale=True, use_ue8m0=True)
    # BF16 dispatch with any hidden % 128 == 0
    ll.LLPlanner(ll.LLLayout(16, 1024 + 128, 2, 16, 8), 0, -1).plan_dispatch(**_dispatch_args(H=1024 + 128),
                                                                             use_fp8=False)


def _handle(N=4, K=4, M=16, H=1024, E=16):
    return ll.LLHandle(torch.zeros((E // 2, 2 * M), dtype=torch.int32), torch.zeros((E // 2, 2), dtype=torch.int64),
                       M, H, E, recv_count=None, row_route=None, send_pos=None, num_tokens=N, num_topk=K,
                       kind='torch', engine_id=0)


def test_handle_is_deepeps_tuple():
    h = _handle()
    assert isinstance(h, tuple) and len(h) == 5 and h[2:] == (16, 1024, 16)
    src_info, layout_range, M, H, E = h
    assert src_info.shape == (8, 32) and layout_range.shape == (8, 2) and h.num_topk == 4
    assert (h.num_max_dispatch_tokens_per_rank, h.hidden, h.num_experts) == (M, H, E)     # (fields 2..4 by name)


def _combine_args(N=4, K=4, M=16, H=1024, E=16):
    return dict(x=torch.zeros((E // 2, 2 * M, H), dtype=torch.bfloat16),
                topk_idx=torch.zeros((N, K), dtype=torch.int64), topk_weights=torch.zeros((N, K)),
                handle=_handle(N, K, M, H, E))


def test_plan_combine(planner):
    p = planner.plan_combine(**_combine_args(), out=torch.zeros((4, 1024), dtype=torch.bfloat16),
                             combine_wait_recv_cost_stats=torch.zeros(2, dtype=torch.int64), zero_copy=True)
    assert (p.num_tokens, p.num_topk, p.num_rows, p.zero_copy) == (4, 4, 32, True)
    a = _combine_args()
    with pytest.raises(NotImplementedError, match='LogFMT'):
        planner.plan_combine(**a, use_logfmt=True)
    with pytest.raises(ValueError, match='mutually exclusive'):
        planner.plan_combine(**a, async_finish=True, return_recv_hook=True)
    with pytest.raises(TypeError, match='handle must be'):
        planner.plan_combine(**{**a, 'handle': tuple(a['handle'])})
    with pytest.raises(ValueError, match=r'x must have shape \[8, 32, 1024\]'):
        planner.plan_combine(**{**a, 'x': torch.zeros((8, 16, 1024), dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=r'topk_idx must have shape \[4, 4\]'):
        planner.plan_combine(**{**a, 'topk_idx': torch.zeros((4, 3), dtype=torch.int64)})
    with pytest.raises(TypeError, match='topk_weights must be float32'):
        planner.plan_combine(**{**a, 'topk_weights': torch.zeros((4, 4), dtype=torch.float64)})
    with pytest.raises(ValueError, match=r'out must have shape \[4, 1024\]'):
        planner.plan_combine(**a, out=torch.zeros((5, 1024), dtype=torch.bfloat16))


# ---- kernels -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('make', [ll.dispatch_spec, ll.combine_spec, ll.clean_spec])
def test_spec_parameters_match_kernel_signature(make):
    # (names, order and kinds of every shipped spec: tests/test_kernel_interfaces_cpu.py)
    from test_kernel_interfaces_cpu import ki
    spec = make(2)
    assert ki.check_spec(spec, ki.parse('ep_ll')) == []


def test_profiler_names():
    """DeepEP's bench_kineto: exactly one kernel name containing 'dispatch' and one containing 'combine', found by
    '::dispatch' / '::combine' in hook mode."""
    specs = ll.shipped_specs()['ep_ll']
    for n in range(1, 9):
        names = [s.name for s in ll.specs_for(n)]
        assert sum('dispatch' in s for s in names) == 1 and sum('combine' in s for s in names) == 1
        assert f'deepep::ll::dispatch<{n}>' in names and f'deepep::ll::combine<{n}>' in names
    assert len(specs) == 24 and len({s.name for s in specs}) == 24


def test_registry_ships_ll_specs():
    from deepep_cupy.buffers import shipped
    assert {s.name for s in shipped.shipped_specs()['ep_ll']} == {s.name for s in ll.shipped_specs()['ep_ll']}


def test_ll_kernels_compile_for_sm90():
    names = [s.name for s in ll.specs_for(2)]
    module = compiler.compile_cubin('ep_ll', names, arch='90', use_cache=False)
    assert module.cubin[:4] == b'\x7fELF' and sorted(module.lowered) == sorted(names)
    # demangled names stay in namespace deepep::ll
    assert all(m.startswith('_ZN6deepep2ll') for m in module.lowered.values())


# ---- the engine's host path with a fake BufferBase and recording kernels ------------------------------------------
class _FakeStream:
    def __init__(self, name):
        self.name, self.ptr, self.waits = name, id(self), []

    def wait_event(self, ev):
        self.waits.append(ev)


class _FakeEvent:
    def record(self, stream=None):
        self.stream = stream


class _FakeKernel:
    def __init__(self, spec, log):
        self.spec, self.log = spec, log

    def launch(self, grid, block, args, stream=None, shared_mem=0, cooperative=False):
        from deepep_cupy.jit.launch import pack_args
        packed = pack_args(self.spec, args)         # every argument has its declared type
        named = {p.name: v for p, v in zip(self.spec.params, packed)}
        self.log.append((self.spec.name, grid, block, shared_mem, stream.name, named))

    def prepare(self, grid, block, args, shared_mem=0, cooperative=False):
        from deepep_cupy.jit.launch import pack_args
        pack_args(self.spec, args)
        return lambda stream: self.launch(grid, block, args, stream, shared_mem)

    def bind(self, grid, block, *, shared_mem=0, cooperative=False, **named):
        """A real `BoundLaunch` (the bound calls' launches: features/ll/bound.py), packed like the GPU's; each launch
        is logged with the packed arguments by name."""
        from deepep_cupy.jit import launch
        assert set(named) == set(self.spec.param_names), sorted(set(named) ^ set(self.spec.param_names))
        packed = launch.pack_args(self.spec, [named[n] for n in self.spec.param_names])
        layout, offsets = launch.arg_struct(self.spec)
        bound = launch.BoundLaunch(self.spec, layout, offsets, grid, block, shared_mem, cooperative, self._go_bound)
        layout.pack_into(bound.data, 0, *packed)
        return bound

    def _go_bound(self, bound, stream):
        self.log.append((self.spec.name, bound.grid[0], bound.block[0], bound.shared_mem, stream.name,
                         bound.values()))


class _FakeBase:
    def __init__(self, num_ranks, rank, num_bytes):
        from types import SimpleNamespace
        self.num_scaleup_ranks, self.scaleup_rank_idx, self.num_scaleout_ranks = num_ranks, rank, 1
        self.data_offset, self.num_bytes, self.device = 2 << 20, num_bytes, -1
        self.sym = SimpleNamespace(peer_bases_ptr=0x1000, base=0x7f0000000000)
        self.host_mapped = SimpleNamespace(ptr=0x2000)
        self.timeout_ns, self.num_device_sms = 10 ** 9, 132
        self.comm_stream = _FakeStream('comm')
        self.error_record = np.zeros(8, np.int32)
        self.claimed = None
        self._destroyed, self._failed = False, None

    def claim_data_region(self, owner):
        self.claimed = owner

    def check_usable(self):
        pass


@pytest.fixture()
def fake_engine(monkeypatch):
    from deepep_cupy.runtime import event as event_mod
    from deepep_cupy.runtime import interop
    current = _FakeStream('current')
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: current)
    monkeypatch.setattr(interop, 'stream_getter', lambda kind, device: lambda: current)
    monkeypatch.setattr(interop.Allocator, 'empty',
                        lambda self, shape, dtype, stream=None: torch.zeros(shape, dtype=getattr(torch, dtype)))

    class _Handle:
        def __init__(self, stream=None):
            self.stream = stream
    monkeypatch.setattr(event_mod, 'EventHandle', _Handle)
    monkeypatch.setattr(ll.feature, 'EventHandle', _Handle)
    monkeypatch.setattr(interop, 'torch_stream', lambda handle: None)
    monkeypatch.setattr(torch.Tensor, 'record_stream', lambda self, stream: None)
    monkeypatch.setattr(ll.LowLatencyEngine, '_events', lambda self: (_FakeEvent(), _FakeEvent()))
    R, M, H, E = 2, 16, 1024, 16
    base = _FakeBase(R, 1, ll.get_rdma_size_hint(M, H, R, E))
    log = []
    kernels = tuple(_FakeKernel(s, log) for s in ll.specs_for(R))
    eng = ll.LowLatencyEngine(base, M, H, E, kernels=kernels)
    return eng, log, base


@pytest.mark.parametrize('use_fp8, round_scale, use_ue8m0', [(False, False, False), (True, False, False),
                                                              (True, True, True)])
@pytest.mark.parametrize('hook', [False, True])
def test_engine_host_path(fake_engine, use_fp8, round_scale, use_ue8m0, hook):
    eng, log, base = fake_engine
    assert base.claimed == 'EP low-latency' and eng.num_max_topk == 32
    N, K, H, M, E, L, T = 5, 4, 1024, 16, 16, 8, 32
    x = torch.zeros((N, H), dtype=torch.bfloat16)
    topk = torch.zeros((N, K), dtype=torch.int64)
    stats = torch.zeros(L, dtype=torch.int32)
    recv, count, handle, event, recv_hook = eng.dispatch(
        x, topk, M, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, round_scale=round_scale,
        use_ue8m0=use_ue8m0, async_finish=not hook, return_recv_hook=hook)
    if use_fp8:
        q, sf = recv
        assert q.shape == (L, T, H) and q.dtype == torch.float8_e4m3fn
        cols = H // 512 if use_ue8m0 else H // 128
        assert sf.shape == (L, T, cols) and sf.stride() == (cols * T, 1, T)
        assert sf.dtype == (torch.int32 if use_ue8m0 else torch.float32)
    else:
        assert recv.shape == (L, T, H) and recv.dtype == torch.bfloat16
    assert count.shape == (L,) and handle[0].shape == (L, T) and handle[1].shape == (L, 2)
    assert tuple(handle[2:]) == (M, H, E) and handle.send_pos.shape == (N, K)
    name, grid, block, smem, stream, args = log[-1]
    assert name == 'deepep::ll::dispatch<2>' and grid == 132 and block == ll.THREADS
    assert smem == ll.dispatch_smem_bytes(E, 2)
    assert args['phases'] == (ll.PHASE_SEND if hook else ll.PHASE_SEND | ll.PHASE_RECV)
    assert stream == ('current' if hook else 'comm')
    assert args['rank'] == 1 and args['cumulative_stats'] == stats.data_ptr()
    assert args['region_offset'] == base.data_offset and args['use_ue8m0'] == int(use_ue8m0)
    assert (recv_hook is not None) == hook and (event.event is not None) == (not hook)
    if hook:
        recv_hook()
        assert log[-1][0] == 'deepep::ll::dispatch<2>' and log[-1][5]['phases'] == ll.PHASE_RECV
        assert log[-1][4] == 'current'
    y = torch.zeros((L, T, H), dtype=torch.bfloat16)
    w = torch.zeros((N, K), dtype=torch.float32)
    out = torch.zeros((N, H), dtype=torch.bfloat16)
    for zero_copy in (False, True):
        combined, event, recv_hook = eng.combine(y, topk, w, handle, zero_copy=zero_copy, async_finish=not hook,
                                                 return_recv_hook=hook, out=out)
        assert combined is out
        name, grid, block, smem, stream, args = log[-1]
        assert name == 'deepep::ll::combine<2>' and smem == ll.combine_smem_bytes(E, 2)
        assert args['phases'] == (ll.PHASE_SEND if hook else ll.PHASE_SEND | ll.PHASE_RECV)
        assert args['x'] == (eng._staging_ptr(1 if zero_copy else 0) if zero_copy else y.data_ptr())
        assert args['recv_count'] == handle.recv_count.data_ptr() and args['send_pos'] == handle.send_pos.data_ptr()
        if hook:
            recv_hook()
            assert log[-1][5]['phases'] == ll.PHASE_RECV
    eng.clean_buffer()
    assert log[-1][0] == 'deepep::ll::clean<2>' and log[-1][1] == 1 and log[-1][5]['reset'] == 1


def test_engine_rejects_handles_and_modes(fake_engine):
    eng, log, base = fake_engine
    x = torch.zeros((2, 1024), dtype=torch.bfloat16)
    topk = torch.zeros((2, 4), dtype=torch.int64)
    _, _, handle, _, _ = eng.dispatch(x, topk, 16, 16)
    foreign = ll.LLHandle(*handle, **{**handle.__dict__, 'engine_id': 0})
    y = torch.zeros((8, 32, 1024), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match='another buffer'):
        eng.combine(y, topk, torch.zeros((2, 4)), foreign)
    with pytest.raises(RuntimeError, match='enable_shrink=True'):
        eng.update_mask_buffer(0, True)
    with pytest.raises(ValueError, match='no scale-out'):
        fake = _FakeBase(2, 0, 1 << 30)
        fake.num_scaleout_ranks = 2
        ll.LowLatencyEngine(fake, 16, 1024, 16, kernels=(None, None, None))
    n = len(log)
    with pytest.raises(ValueError):
        eng.dispatch(torch.zeros((17, 1024), dtype=torch.bfloat16), torch.zeros((17, 4), dtype=torch.int64), 16, 16)
    assert len(log) == n, 'no kernel may run for a bad call'


def test_combine_reference_is_deepeps_fused_multiply_add():
    """V1 low-latency combine as DeepEP v1.2.1 compiles it (`accum += float(row) * weight` contracted to fma.rn.f32):
    `fma_f32` rounds once, where a multiply then an add would round twice; exact on random values too."""
    from fractions import Fraction

    from deepep_cupy.tests.ll_reference import fma_f32
    a = torch.tensor([1 + 2 ** -12], dtype=torch.float32)
    c = torch.tensor([-1.0], dtype=torch.float32)
    assert float(fma_f32(a, a, c)) == 2 ** -11 + 2 ** -24      # a * a = 1 + 2^-11 + 2^-24, kept in full
    assert float(a * a + c) == 2 ** -11                          # two roundings lose the 2^-24
    g = torch.Generator().manual_seed(3)
    x, y, z = (torch.randn(4000, generator=g) * 10 ** torch.randint(-3, 4, (4000,), generator=g) for _ in range(3))
    got = fma_f32(x, y, z)
    for i in range(0, 4000, 7):
        exact = Fraction(float(x[i])) * Fraction(float(y[i])) + Fraction(float(z[i]))
        lo = torch.tensor(float(exact), dtype=torch.float32)
        near = [torch.nextafter(lo, torch.tensor(-float('inf'))), lo, torch.nextafter(lo, torch.tensor(float('inf')))]
        best = min(near, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(torch.int32)) & 1))
        assert float(got[i]) == float(best), i
