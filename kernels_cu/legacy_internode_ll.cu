// DeepEP V1 low-latency mode across scale-up domains (deepep_cupy/v1/kernels/internode_ll.py, the design): the
// small kernels around one hybrid dispatch / combine (features/hybrid) that turn V1's low-latency calls into
// "pseudo-token" hybrid calls and back, so that every result is bit for bit the single-domain path's (ep_ll.cu).
//
// A pseudo token is one (token t, top-k slot k) pair of an origin rank: index p = t * K + k, top-k of one expert
// (topk_idx[t][k], or -1), weight slot = its V1 slot position (float, exact below 2^24). The hybrid dispatch moves
// each pseudo token to the one rank owning its expert (V1 low-latency moves one message per (token, expert) too);
// the hybrid combine brings back one row per pseudo token, unreduced (a sum of one row is exact: FP32 0 + row, one
// rounding of a bfloat16 value), so the origin can weight and sum in V1's order.
//
// ll_internode_prepare  (origin, before the hybrid dispatch): warps 0 .. E-1 scan topk_idx in (t, k) order per
//                       expert e (ballots: ep_ll.cu's scan) and give each (t, k) choosing e its position among this
//                       rank's (t, k) choosing e (V1's slot; kept below M and when e's owner is not masked, else -1):
//                       send_pos[t][k], pseudo top-k (e or -1) and pseudo weight (the position). Warps past E: one
//                       token each, cast once (ll_fp8.cuh: V1's per-128-channel recipe) and stored into the K pseudo
//                       rows of every valid slot (FP8 bytes + float scales, or the bfloat16 row).
// ll_internode_layout   (receiver, one block, after the hybrid dispatch): per (local expert j, global source s) the
//                       rows received (a shared histogram; a masked source's rows are dropped), then V1's layout:
//                       begin = exclusive prefix over s, layout_range[j][s] = begin << 32 | count, recv_count[j],
//                       the cumulative stats, and the begin table for ll_internode_scatter.
// ll_internode_scatter  (receiver, warp per row): hybrid row i (source from the intranode source index, expert from
//                       its top-k, slot from its weight) into V1's row (j, begin[j][s] + slot): bytes, scales (float
//                       [L][H/128][R*M], or UE8M0 int32 [L][H/512][R*M] packed here from the power-of-two scales),
//                       src_info = t; row_of[i] = j * R * M + row (-1: dropped), for the combine.
// ll_internode_gather   (owner, warp per row, before the hybrid combine): combine input row i = V1 row row_of[i] of
//                       the caller's x (or the zero-copy buffer); zeros for a dropped row.
// ll_internode_reduce   (origin, warp per token, after the hybrid combine): V1's weighted sum, exactly ep_ll.cu's:
//                       acc = fma(w_k, row_k, acc) in FP32 in ascending k over the slots with send_pos >= 0, a
//                       valid expert and a live owner (DeepEP v1.2.1's fused multiply-add), one rounding to bfloat16.
//
// No kernel here waits on another rank: the hybrid dispatch / combine do every cross-rank wait (bounded there).
#include "common/ep.cuh"
#include "common/ll_fp8.cuh"

namespace deepep {
namespace ll_internode {

constexpr int kLLThreads = 512;              // row kernels
constexpr int kLLWarps = kLLThreads / 32;
constexpr int kLLLayoutThreads = 1024;       // ll_internode_layout: one block
constexpr int kLLSegChannels = 512;          // channels a warp casts per step (32 lanes x 16)
constexpr int kLLScanUnroll = 8;

__device__ __forceinline__ bool masked_rank(const int32_t* mask, int r) {
    return mask != nullptr && *reinterpret_cast<const volatile int32_t*>(mask + r) != 0;
}

// Global source rank of an intranode source index `r * (N * Mc) + s * Mc + p` (forwarder r, source domain s, pseudo
// token p: features/hybrid/plan.py translate_src_index), and p.
__device__ __forceinline__ int source_rank(int index, int num_domains, int num_scaleup, int num_pseudo, int& p) {
    const int nm = num_domains * num_pseudo;
    const int r = index / nm, rem = index - r * nm;
    const int s = rem / num_pseudo;
    p = rem - s * num_pseudo;
    return s * num_scaleup + r;
}

// ---- origin: pseudo tokens ------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kLLThreads, 1)
ll_internode_prepare(const uint8_t* x, const int64_t* topk_idx, int num_tokens, int num_topk, int hidden,
                     int num_experts, int num_ranks, int num_max_tokens, const int32_t* mask, int use_fp8,
                     int round_scale, uint8_t* pseudo_x, float* pseudo_sf, int64_t* pseudo_topk, float* pseudo_pos,
                     int32_t* send_pos) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int total_warps = gridDim.x * kLLWarps, global_warp = blockIdx.x * kLLWarps + warp;
    const int L = num_experts / num_ranks;
    const int total_topk = num_tokens * num_topk;
    const int row_bytes = use_fp8 ? hidden : 2 * hidden;
    const int num_scales = hidden / 128;
    for (int item = global_warp; item < num_experts + num_tokens; item += total_warps) {
        if (item < num_experts) {
            // Expert scan, as ep_ll.cu's: every (t, k) with topk_idx[t][k] == e in (t, k) order.
            const int e = item;
            const bool to_live = !masked_rank(mask, e / L);
            int count = 0;
            for (int base = 0; base < total_topk; base += 32 * kLLScanUnroll) {
                int64_t v[kLLScanUnroll];
                #pragma unroll
                for (int u = 0; u < kLLScanUnroll; ++u) {
                    const int i = base + u * 32 + lane;
                    v[u] = i < total_topk ? __ldg(topk_idx + i) : -1;
                }
                #pragma unroll
                for (int u = 0; u < kLLScanUnroll; ++u) {
                    const int i = base + u * 32 + lane;
                    const bool hit = v[u] == e;
                    const uint32_t ballot = __ballot_sync(0xffffffffu, hit);
                    if (hit) {
                        const int pos = count + __popc(ballot & ((1u << lane) - 1u));
                        const bool kept = to_live && pos < num_max_tokens;
                        send_pos[i] = kept ? pos : -1;
                        pseudo_topk[i] = kept ? e : -1;
                        pseudo_pos[i] = static_cast<float>(pos);
                    }
                    count += __popc(ballot);
                }
            }
            continue;
        }
        // Token t: cast once, store into the pseudo row of every slot holding a valid expert.
        const int t = item - num_experts;
        const int64_t v = lane < num_topk ? __ldg(topk_idx + static_cast<int64_t>(t) * num_topk + lane) : -1;
        const bool valid = v >= 0 && v < num_experts;
        if (lane < num_topk && !valid) {
            const int64_t i = static_cast<int64_t>(t) * num_topk + lane;
            send_pos[i] = -1;
            pseudo_topk[i] = -1;
            pseudo_pos[i] = 0.f;
        }
        const uint32_t slots = __ballot_sync(0xffffffffu, lane < num_topk && valid);
        if (slots == 0)
            continue;
        const uint8_t* src = x + static_cast<int64_t>(t) * hidden * 2;
        for (int c0 = lane * 16; c0 - lane * 16 < hidden; c0 += kLLSegChannels) {
            const bool active = c0 < hidden;
            Vec16 a = {0, 0, 0, 0}, b = {0, 0, 0, 0};
            if (active) {
                a = ld_nc_v4(src + static_cast<int64_t>(c0) * 2);
                b = ld_nc_v4(src + static_cast<int64_t>(c0) * 2 + 16);
            }
            if (use_fp8) {
                float scale_inv;
                const Vec16 q = ::deepep::ll::cast_fp8_lane(a, b, round_scale != 0, scale_inv);
                for (uint32_t m = slots; m != 0; m &= m - 1) {
                    const int64_t p = static_cast<int64_t>(t) * num_topk + (__ffs(m) - 1);
                    if (active) {
                        st_na_v4(pseudo_x + p * row_bytes + c0, q);
                        if (lane % 8 == 0)
                            pseudo_sf[p * num_scales + c0 / 128] = scale_inv;
                    }
                }
            } else if (active) {
                for (uint32_t m = slots; m != 0; m &= m - 1) {
                    uint8_t* dst = pseudo_x + (static_cast<int64_t>(t) * num_topk + (__ffs(m) - 1)) * row_bytes +
                                   static_cast<int64_t>(c0) * 2;
                    st_na_v4(dst, a);
                    st_na_v4(dst + 16, b);
                }
            }
        }
    }
}

// ---- receiver: V1's layout ------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kLLLayoutThreads, 1)
ll_internode_layout(const int64_t* recv_topk, int64_t topk_stride, const int32_t* recv_meta, int64_t meta_stride,
                    int num_rows, const int32_t* num_recv, int num_domains, int num_scaleup, int num_pseudo,
                    int num_local_experts, const int32_t* mask, int64_t* layout_range, int32_t* recv_count,
                    int32_t* cumulative_stats, int32_t* begin) {
    extern __shared__ int32_t s_count[];   // [L * R]
    const int R = num_domains * num_scaleup, L = num_local_experts;
    for (int i = threadIdx.x; i < L * R; i += blockDim.x)
        s_count[i] = 0;
    __syncthreads();
    const int rows = min(num_rows, *num_recv);
    for (int i = threadIdx.x; i < rows; i += blockDim.x) {
        const int64_t j = recv_topk[static_cast<int64_t>(i) * topk_stride];
        const int index = recv_meta[static_cast<int64_t>(i) * meta_stride];
        if (j < 0 || j >= L || index < 0)
            continue;
        int p;
        const int s = source_rank(index, num_domains, num_scaleup, num_pseudo, p);
        if (!masked_rank(mask, s))
            atomicAdd(&s_count[j * R + s], 1);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < L; j += blockDim.x) {
        int acc = 0;
        for (int s = 0; s < R; ++s) {
            const int c = s_count[j * R + s];
            begin[j * R + s] = acc;
            layout_range[j * R + s] = (static_cast<int64_t>(acc) << 32) | static_cast<uint32_t>(c);
            acc += c;
        }
        recv_count[j] = acc;
        if (cumulative_stats != nullptr)
            cumulative_stats[j] += acc;
    }
}

// ---- receiver: rows into V1's layout --------------------------------------------------------------------------
__global__ void __launch_bounds__(kLLThreads, 1)
ll_internode_scatter(const uint8_t* recv_x, int64_t x_row_bytes, const float* recv_sf, int64_t sf_stride_row,
                     int64_t sf_stride_col, const int64_t* recv_topk, int64_t topk_stride, const float* recv_weights,
                     int64_t weight_stride, const int32_t* recv_meta, int64_t meta_stride, int num_rows,
                     const int32_t* num_recv, int num_domains, int num_scaleup, int num_pseudo, int num_topk,
                     int num_local_experts, int num_max_tokens, int hidden, int use_fp8, int use_ue8m0,
                     const int32_t* mask, const int32_t* begin, uint8_t* out_x, void* out_sf, int32_t* src_info,
                     int32_t* row_of) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int total_warps = gridDim.x * kLLWarps, global_warp = blockIdx.x * kLLWarps + warp;
    const int R = num_domains * num_scaleup, L = num_local_experts;
    const int T = R * num_max_tokens;                 // rows per local expert
    const int row_bytes = use_fp8 ? hidden : 2 * hidden;
    const int num_scales = hidden / 128;
    const int rows = min(num_rows, *num_recv);
    for (int i = global_warp; i < rows; i += total_warps) {
        const int64_t j = recv_topk[static_cast<int64_t>(i) * topk_stride];
        const int index = recv_meta[static_cast<int64_t>(i) * meta_stride];
        int p = 0;
        const int s = index >= 0 ? source_rank(index, num_domains, num_scaleup, num_pseudo, p) : 0;
        if (j < 0 || j >= L || index < 0 || masked_rank(mask, s)) {
            if (lane == 0)
                row_of[i] = -1;
            continue;
        }
        const int pos = static_cast<int>(recv_weights[static_cast<int64_t>(i) * weight_stride]);
        const int r = begin[j * R + s] + pos;
        const int64_t out_row = j * T + r;
        if (lane == 0) {
            row_of[i] = static_cast<int32_t>(out_row);
            src_info[out_row] = p / num_topk;
        }
        warp_copy(out_x + out_row * row_bytes, recv_x + static_cast<int64_t>(i) * x_row_bytes, row_bytes, lane);
        if (!use_fp8)
            continue;
        const float* sf = recv_sf + static_cast<int64_t>(i) * sf_stride_row;
        if (!use_ue8m0) {
            // float [L][S][T]: (j * S + q) * T + r
            for (int q = lane; q < num_scales; q += 32)
                static_cast<float*>(out_sf)[(j * num_scales + q) * T + r] = sf[q * sf_stride_col];
        } else {
            // int32 [L][S / 4][T]: byte u of int g = group 4g + u
            for (int g = lane; g < num_scales / 4; g += 32) {
                uint32_t packed = 0;
                #pragma unroll
                for (int u = 0; u < 4; ++u)
                    packed |= ::deepep::ll::ue8m0_byte(sf[(4 * g + u) * sf_stride_col]) << (8 * u);
                static_cast<uint32_t*>(out_sf)[(j * (num_scales / 4) + g) * T + r] = packed;
            }
        }
    }
}

// ---- owner: the combine's input rows --------------------------------------------------------------------------
__global__ void __launch_bounds__(kLLThreads, 1)
ll_internode_gather(const uint8_t* x, const int32_t* row_of, int num_rows, const int32_t* num_recv, int hidden,
                    uint8_t* combine_x) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int total_warps = gridDim.x * kLLWarps, global_warp = blockIdx.x * kLLWarps + warp;
    const int row_bytes = 2 * hidden;
    const int rows = min(num_rows, *num_recv);
    for (int i = global_warp; i < rows; i += total_warps) {
        const int src = row_of[i];
        uint8_t* dst = combine_x + static_cast<int64_t>(i) * row_bytes;
        if (src >= 0) {
            warp_copy(dst, x + static_cast<int64_t>(src) * row_bytes, row_bytes, lane);
        } else {
            for (int c = lane; c < row_bytes / 16; c += 32)
                st_v4(dst + static_cast<int64_t>(c) * 16, Vec16{0, 0, 0, 0});
        }
    }
}

// ---- origin: V1's weighted sum --------------------------------------------------------------------------------
__global__ void __launch_bounds__(kLLThreads, 1)
ll_internode_reduce(const uint8_t* pseudo_out, const int64_t* topk_idx, const float* topk_weights,
                    const int32_t* send_pos, int num_tokens, int num_topk, int hidden, int num_experts, int num_ranks,
                    const int32_t* mask, uint8_t* combined_x) {
    __shared__ float s_weights[kLLWarps][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int total_warps = gridDim.x * kLLWarps, global_warp = blockIdx.x * kLLWarps + warp;
    const int L = num_experts / num_ranks;
    const int row_bytes = 2 * hidden, row_chunks = row_bytes / 16;
    for (int t = global_warp; t < num_tokens; t += total_warps) {
        const int64_t idx = static_cast<int64_t>(t) * num_topk + lane;
        const int64_t e = lane < num_topk ? __ldg(topk_idx + idx) : -1;
        const int pos = lane < num_topk ? __ldg(send_pos + idx) : -1;
        const bool valid = pos >= 0 && e >= 0 && e < num_experts && !masked_rank(mask, static_cast<int>(e) / L);
        s_weights[warp][lane] = lane < num_topk ? __ldg(topk_weights + idx) : 0.f;
        const uint32_t add_mask = __ballot_sync(0xffffffffu, valid);
        __syncwarp();
        const uint8_t* rows = pseudo_out + static_cast<int64_t>(t) * num_topk * row_bytes;
        for (int ch = lane; ch < row_chunks; ch += 32) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (uint32_t m = add_mask; m != 0; m &= m - 1) {
                const int k = __ffs(m) - 1;
                const Vec16 v = ld_nc_v4(rows + static_cast<int64_t>(k) * row_bytes + static_cast<int64_t>(ch) * 16);
                const float w = s_weights[warp][k];
                const uint32_t words[4] = {v.x, v.y, v.z, v.w};
                #pragma unroll
                for (int q = 0; q < 4; ++q) {
                    acc[2 * q] = __fmaf_rn(w, bf16_lo(words[q]), acc[2 * q]);
                    acc[2 * q + 1] = __fmaf_rn(w, bf16_hi(words[q]), acc[2 * q + 1]);
                }
            }
            st_v4(combined_x + static_cast<int64_t>(t) * row_bytes + static_cast<int64_t>(ch) * 16,
                  round_bf16x8(acc));
        }
        __syncwarp();
    }
}

}  // namespace ll_internode
}  // namespace deepep
