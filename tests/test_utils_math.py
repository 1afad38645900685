"""CPU tests of `deepep_cupy.utils.math`: hand-computed similarity, sizes, hashes and alignment, and FP8 casts (exact
values on hand-made rows, UE8M0 byte packing, padding, the amax clamp, and round-trip error bounds)."""

import pytest

torch = pytest.importorskip('torch')  # the utilities under test take torch tensors

from deepep_cupy.utils.math import (
    align,
    calc_diff,
    ceil_div,
    count_bytes,
    create_grouped_scores,
    hash_tensor,
    hash_tensors,
    inplace_unique,
    per_token_cast_back,
    per_token_cast_to_fp8,
    safe_div,
)

FP8 = torch.float8_e4m3fn


def as_int32(value: int) -> int:
    """An unsigned 32-bit pattern read as a signed int32."""
    return value - (1 << 32) if value >= 1 << 31 else value


# calc_diff, sizes, alignment, hashes
def test_calc_diff_hand_computed():
    x = torch.zeros(5)
    assert calc_diff(x, x) == 0.0
    # x + 1 = 1, y + 1 = 2 everywhere: 1 - 2·2 / (1 + 4) = 0.2
    assert calc_diff(torch.zeros(5), torch.ones(5)) == pytest.approx(0.2, abs=1e-15)
    # x + 1 = [1, 1], y + 1 = [2, 0]: 1 - 2·2 / ((1 + 4) + (1 + 0)) = 1/3
    assert calc_diff(torch.tensor([0.0, 0.0]), torch.tensor([1.0, -1.0])) == pytest.approx(1 / 3, abs=1e-15)
    diff = calc_diff(torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.float32))
    assert isinstance(diff, float) and diff == 0.0


def test_align_ceil_div_safe_div():
    assert [align(x, 4) for x in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]
    assert align(7168, 128) == 7168 and align(7169, 128) == 7296
    assert [ceil_div(x, 2) for x in (0, 1, 2, 7, 8)] == [0, 1, 1, 4, 4]
    assert safe_div(6, 4) == 1.5
    assert safe_div(1, 0) == 0 and safe_div(0, 0) == 0


def test_count_bytes():
    bf16 = torch.zeros((3, 4), dtype=torch.bfloat16)      # 24 bytes
    idx = torch.zeros(2, dtype=torch.int64)                # 16
    fp8 = torch.zeros(5, dtype=FP8)                        # 5
    assert count_bytes() == 0
    assert count_bytes(bf16) == 24
    assert count_bytes(bf16, None, idx) == 40
    assert count_bytes((fp8, torch.zeros((1, 3), dtype=torch.float32)), None, [idx, (None, bf16)]) == 5 + 12 + 16 + 24
    with pytest.raises(TypeError, match='count_bytes'):
        count_bytes(3)


def test_hash_tensor():
    assert hash_tensor(torch.tensor([1, 2, 3], dtype=torch.int32)) == 6
    assert hash_tensor(torch.tensor([1.0])) == 0x3F800000
    # bf16 1.0 = 0x3f80; 6 bytes padded to 8: ints 0x3f803f80 and 0x00003f80
    assert hash_tensor(torch.ones(3, dtype=torch.bfloat16)) == 0x3F803F80 + 0x3F80
    # int64 -1 is two int32 -1 words
    assert hash_tensor(torch.tensor([-1], dtype=torch.int64)) == -2
    t = torch.arange(12, dtype=torch.int32).view(3, 4)
    assert hash_tensor(t.T) == hash_tensor(t.T.contiguous()) == 66
    assert hash_tensors(t, None, (torch.tensor([1], dtype=torch.int32),)) == 67


def test_inplace_unique():
    x = torch.tensor([[3, 1, 3, -1], [-1, -1, -1, -1], [0, 1, 2, 3], [2, 2, 2, 2]])
    out = inplace_unique(x, 4)
    assert out is x
    assert x.tolist() == [[3, 1, -1, -1], [-1, -1, -1, -1], [3, 2, 1, 0], [2, -1, -1, -1]]
    # More distinct values than columns: the largest survive
    y = torch.tensor([[0, 2, 1]], dtype=torch.int32)
    inplace_unique(y, 3)
    assert y.tolist() == [[2, 1, 0]] and y.dtype == torch.int32
    z = torch.tensor([[0, 4, 1, 3]])
    inplace_unique(z[:, :2], 5)
    assert z.tolist() == [[4, 0, 1, 3]]
    with pytest.raises(ValueError, match='num_slots'):
        inplace_unique(torch.tensor([[0, 5]]), 5)
    with pytest.raises(TypeError):
        inplace_unique(torch.zeros((1, 2)), 3)


def test_create_grouped_scores():
    scores = torch.arange(1, 13, dtype=torch.float32).view(2, 6)
    out = create_grouped_scores(scores, torch.tensor([[0, 2], [1, 1]]), 3)
    assert out.tolist() == [[1, 2, 0, 0, 5, 6], [0, 0, 9, 10, 0, 0]]
    with pytest.raises(ValueError, match='num_groups'):
        create_grouped_scores(scores, torch.tensor([[0], [1]]), 4)


# FP8 casts: exact values on hand-made rows
def hand_row() -> torch.Tensor:
    """One token, two groups: group 0 has amax 2, group 1 is all zero."""
    x = torch.zeros((1, 256), dtype=torch.bfloat16)
    x[0, :4] = torch.tensor([2.0, -1.0, 0.5, 0.0])
    return x


def test_fp8_cast_hand_made_float_scales():
    x_fp8, sf = per_token_cast_to_fp8(hand_row())
    assert x_fp8.dtype == FP8 and x_fp8.shape == (1, 256)
    assert sf.dtype == torch.float32 and sf.shape == (1, 2)
    # scale = amax / 448, so x · 448 / 2 = [448, -224, 112, 0], all exact in e4m3
    assert x_fp8.float()[0, :4].tolist() == [448.0, -224.0, 112.0, 0.0]
    assert (x_fp8.float()[0, 4:] == 0).all()
    assert sf[0, 0].item() == pytest.approx(2 / 448, rel=1e-7)
    # The all-zero group uses the clamped amax 1e-4
    assert sf[0, 1].item() == torch.tensor(1e-4 / 448, dtype=torch.float32).item()
    back = per_token_cast_back(x_fp8, sf, out_dtype=torch.float32)
    assert back[0, :4].tolist() == pytest.approx([2.0, -1.0, 0.5, 0.0], rel=1e-6)
    assert (back[0, 4:] == 0).all()


def test_fp8_cast_hand_made_round_scale():
    x_fp8, sf = per_token_cast_to_fp8(hand_row(), round_scale=True)
    # 2 / 448 ≈ 0.00446 rounds up to 2^-7; the clamped zero group's 2.2e-7 rounds up to 2^-22
    assert sf.tolist() == [[2.0 ** -7, 2.0 ** -22]]
    assert x_fp8.float()[0, :4].tolist() == [256.0, -128.0, 64.0, 0.0]
    assert per_token_cast_back(x_fp8, sf, torch.float32)[0, :4].tolist() == [2.0, -1.0, 0.5, 0.0]


def test_fp8_ue8m0_packing_exact_bytes():
    # Five groups (two int32 per row) whose amax is 448 · 2^k, so each scale is exactly 2^k; group 4's amax,
    # 320 · 2^-9, gives amax / 448 ≈ 0.71 · 2^-9, which rounds up to 2^-9 (and 320 is exact in e4m3)
    exponents = [0, 1, -1, 3, -9]
    amaxes = [448.0 * 2.0 ** k for k in exponents[:4]] + [320.0 * 2.0 ** -9]
    x = torch.zeros((2, 5 * 128), dtype=torch.float32)
    for g, amax in enumerate(amaxes):
        x[0, g * 128 + 7] = -amax
        x[0, g * 128 + 100] = amax / 4
    x[1] = x[0] * 2  # every exponent one higher
    x_fp8, sf = per_token_cast_to_fp8(x, use_ue8m0=True, round_scale=True)
    assert sf.dtype == torch.int32 and sf.shape == (2, 2)
    for row, shift in ((0, 0), (1, 1)):
        exponent_bytes = [127 + k + shift for k in exponents] + [127, 127, 127]  # padding groups hold 1.0
        assert sf.contiguous().view(torch.uint8)[row].tolist() == exponent_bytes
        expected = [as_int32(sum(b << (8 * i) for i, b in enumerate(exponent_bytes[j * 4:j * 4 + 4])))
                    for j in range(2)]
        assert sf[row].tolist() == expected
    back = per_token_cast_back(x_fp8, sf, torch.float32)
    assert torch.equal(back, x)
    # The float-scale form of the same quantisation holds the same scales
    _, sf_float = per_token_cast_to_fp8(x, round_scale=True)
    assert sf_float[0].tolist() == [2.0 ** k for k in exponents]


def test_fp8_ue8m0_needs_round_scale_and_checks():
    with pytest.raises(ValueError, match='round_scale'):
        per_token_cast_to_fp8(torch.zeros((1, 128)), use_ue8m0=True)
    with pytest.raises(ValueError, match='x must be 2-D'):
        per_token_cast_to_fp8(torch.zeros(128))
    with pytest.raises(TypeError, match='floating'):
        per_token_cast_to_fp8(torch.zeros((1, 128), dtype=torch.int32))
    x_fp8, sf = per_token_cast_to_fp8(torch.zeros((2, 256)))
    with pytest.raises(ValueError, match='x_scales must be'):
        per_token_cast_back(x_fp8, sf[:, :1])
    with pytest.raises(TypeError, match='x_scales must be'):
        per_token_cast_back(x_fp8, sf.double())


def test_fp8_all_zero_rows():
    x = torch.zeros((3, 200), dtype=torch.bfloat16)
    x_fp8, sf = per_token_cast_to_fp8(x)
    assert (x_fp8.float() == 0).all()
    assert torch.equal(sf, torch.full((3, 2), 1e-4 / 448, dtype=torch.float32))
    x_fp8, sf = per_token_cast_to_fp8(x, use_ue8m0=True, round_scale=True)
    assert sf.contiguous().view(torch.uint8).tolist() == [[127 - 22, 127 - 22, 127, 127]] * 3
    assert (per_token_cast_back(x_fp8, sf) == 0).all()


def test_fp8_matches_upstream_expression():
    torch.manual_seed(1)
    x = torch.randn((16, 7168), dtype=torch.bfloat16)
    x_fp8, sf = per_token_cast_to_fp8(x)
    view = x.view(16, -1, 128)
    amax = view.abs().float().amax(dim=2).clamp(1e-4)
    expected = (view * (448.0 / amax.unsqueeze(2))).to(FP8).view(16, -1)
    assert torch.equal(x_fp8.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(sf, amax / 448.0)


# FP8 round trips: error bounds
def assert_round_trip_bound(x: torch.Tensor, back: torch.Tensor, sf_float: torch.Tensor):
    """e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself, a subnormal one (|q| < 2^-6) by at
    most half its spacing, 2^-10, in units of the group's scale."""
    num_tokens, hidden = x.shape
    scale = sf_float.repeat_interleave(128, dim=1)[:, :hidden]
    bound = (x.float().abs() * 2.0 ** -4 + scale * 2.0 ** -10) * (1 + 1e-6)
    err = (back.float() - x.float()).abs()
    worst = (err - bound).max()
    assert worst <= 0, f'round-trip error exceeds the e4m3 bound by {worst.item()}'


@pytest.mark.parametrize('hidden', [128, 300, 7168, 7000])
@pytest.mark.parametrize('round_scale', [False, True])
def test_fp8_round_trip(hidden, round_scale):
    torch.manual_seed(hidden)
    x = torch.randn((32, hidden), dtype=torch.bfloat16) * torch.logspace(-3, 3, 32).unsqueeze(1).bfloat16()
    x[3] = 0  # amax clamp
    x_fp8, sf = per_token_cast_to_fp8(x, round_scale=round_scale)
    assert x_fp8.shape == (32, hidden) and sf.shape == (32, ceil_div(hidden, 128))
    back = per_token_cast_back(x_fp8, sf, torch.float32)
    assert back.shape == (32, hidden)
    assert_round_trip_bound(x, back, sf)
    assert (back[3] == 0).all()
    assert calc_diff(back, x) < 2e-3
    # bf16 output (upstream's default) and column-major scales
    back_bf16 = per_token_cast_back(x_fp8, sf.T.contiguous().T)
    assert back_bf16.dtype == torch.bfloat16 and torch.equal(back_bf16, back.bfloat16())
    if round_scale:
        x_fp8_ue8m0, sf_ue8m0 = per_token_cast_to_fp8(x, use_ue8m0=True, round_scale=True)
        assert sf_ue8m0.shape == (32, ceil_div(ceil_div(hidden, 128), 4))
        assert torch.equal(x_fp8_ue8m0.view(torch.uint8), x_fp8.view(torch.uint8))
        assert torch.equal(per_token_cast_back(x_fp8_ue8m0, sf_ue8m0, torch.float32), back)


def test_fp8_empty_batch():
    x_fp8, sf = per_token_cast_to_fp8(torch.zeros((0, 300), dtype=torch.bfloat16), use_ue8m0=True, round_scale=True)
    assert x_fp8.shape == (0, 300) and sf.shape == (0, 1)
    assert per_token_cast_back(x_fp8, sf).shape == (0, 300)


@pytest.mark.gpu
def test_fp8_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip('torch without CUDA')
    torch.manual_seed(2)
    x = torch.randn((64, 7000), dtype=torch.bfloat16)
    for kwargs in ({}, {'round_scale': True}, {'round_scale': True, 'use_ue8m0': True}):
        q_cpu, sf_cpu = per_token_cast_to_fp8(x, **kwargs)
        q_gpu, sf_gpu = per_token_cast_to_fp8(x.cuda(), **kwargs)
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8)), kwargs
        if kwargs:
            # Power-of-two scales are exact on both devices
            assert torch.equal(sf_gpu.cpu(), sf_cpu), kwargs
            assert torch.equal(per_token_cast_back(q_gpu, sf_gpu).cpu(), per_token_cast_back(q_cpu, sf_cpu)), kwargs
        else:
            # torch's CUDA division by a scalar multiplies by its reciprocal: `amax / 448` may differ by one ulp
            torch.testing.assert_close(sf_gpu.cpu(), sf_cpu, rtol=2.5e-7, atol=0)
    assert hash_tensor(x.cuda()) == hash_tensor(x)
