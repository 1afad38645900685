// DeepEP V1 low-latency FP8 cast (one scale per 128 channels), shared by the single-domain low-latency kernels
// (ep_ll.cu) and the cross-domain ones (legacy_internode_ll.cu), so that both cast bit for bit alike. Only DeepEP
// V1's low-latency API casts on the device: V2's FP8 dispatch takes tensors the caller cast with V2's torch recipe
// (deepep_cupy/utils/math.py `per_token_cast_to_fp8`: `amax / 448`), which this file does not follow.
#pragma once
#include "common/ep.cuh"

namespace deepep {
namespace ll {

constexpr float kFp8Max = 448.f;
constexpr float kFp8MaxInv = 1.f / 448.f;   // rounded once to float (0x3b124925), as DeepEP's kFinfoAmaxInvE4M3
constexpr float kAmaxClamp = 1e-4f;

// ---- FP8 ----------------------------------------------------------------------------------------------------------
// Two floats to float8_e4m3fn (round to nearest even, saturating), `lo` in the low byte.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// Quantise the 16 channels a lane holds (two 16-byte vectors of bfloat16) with the scale of its 128-channel group,
// which is held by the 8 lanes (lane & ~7) ... (lane | 7). Every lane of the warp calls it (lanes past the hidden size
// pass zeros; a group is entirely inside or outside). DeepEP v1.2.1's arithmetic (csrc/kernels/internode_ll.cu
// dispatch, csrc/kernels/utils.cuh calculate_fp8_scales; deepep_cupy/tests/ll_reference.cast_fp8 mirrors it):
//   amax = max(max |x|, 1e-4) over the group, in float
//   round_scale: scale_inv = 2^ceil(log2(amax * kFp8MaxInv)) (the product rounded, then its exponent bumped if the
//                mantissa is not zero), q = e4m3(x * 2^-e) (== x / scale_inv exactly)
//   otherwise:   scale_inv = amax * kFp8MaxInv, q = e4m3(x * (448 / amax)) (a correctly rounded division, then the
//                product rounded; not V2's `amax / 448`, which differs in the last bit for about half the amaxes)
__device__ __forceinline__ Vec16 cast_fp8_lane(const Vec16& a, const Vec16& b, bool round_scale, float& scale_inv) {
    const uint32_t words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    float f[16];
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        f[2 * i] = bf16_lo(words[i]);
        f[2 * i + 1] = bf16_hi(words[i]);
    }
    float amax = 0.f;
    #pragma unroll
    for (int i = 0; i < 16; ++i)
        amax = fmaxf(amax, fabsf(f[i]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
    amax = fmaxf(amax, kAmaxClamp);
    float scale;
    if (round_scale) {
        const uint32_t bits = __float_as_uint(__fmul_rn(amax, kFp8MaxInv));
        const uint32_t exponent = (bits >> 23) + ((bits & 0x7fffffu) != 0 ? 1u : 0u);
        scale_inv = __uint_as_float(exponent << 23);
        scale = __uint_as_float((254u - exponent) << 23);
    } else {
        scale_inv = __fmul_rn(amax, kFp8MaxInv);
        scale = __fdiv_rn(kFp8Max, amax);
    }
    uint32_t out[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i)
        out[i] = e4m3x2(__fmul_rn(f[4 * i], scale), __fmul_rn(f[4 * i + 1], scale)) |
                 (e4m3x2(__fmul_rn(f[4 * i + 2], scale), __fmul_rn(f[4 * i + 3], scale)) << 16);
    return {out[0], out[1], out[2], out[3]};
}

__device__ __forceinline__ uint32_t ue8m0_byte(float power_of_two) { return __float_as_uint(power_of_two) >> 23; }

}  // namespace ll
}  // namespace deepep
