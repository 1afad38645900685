// Hybrid mode, P1 (composed path, features/hybrid/feature.py): the small kernels around the intranode engine.
//
// A rank (n, r) of N domains x R ranks owns a rail area (features/hybrid/plan.py `RailArea`):
//   [flags 4096 B | send regions [N][region_bytes] | recv regions [N][region_bytes]]
// Region m holds a 16-byte header (int32 count, int32 kind, 2 x int32 0) and then `count` rows. Dispatch rows
// (`rail_row`): [src token int32, pad to 16 | top-k int64 x K | weights f32 x K | scales 4 B x num_sf | x], each
// part padded to 16 bytes. Combine rows: [x bf16 x hidden | weights f32 x K], each part padded to 16 bytes.
//
// hybrid_route      (1 block)      per token the destination domains (dedup) and its rail position per domain
// hybrid_pack       (block/token)  rows into the send region of every other destination domain, in rail order
// hybrid_report     (1 thread)     send / receive counts into host-mapped memory (CPU-sync dispatches)
// hybrid_unpack     (2 launches)   the forwarder's union input: mode 0 own tokens + empty rows, mode 1 rail rows
//                                  scattered to row s * M + source token (index order = source domain, token)
// hybrid_combine_pack              the in-domain combined union rows back into the send region of their origin
// hybrid_combine_final             bias, then each domain's partial in ascending key (its last top-k slot), FP32,
//                                  one rounding: refs.combine(..., reduce_in_scaleup=True)
// rail_epoch_begin / rail_signal / rail_wait: the loopback transport's stream-ordered epoch flags.
//
// P2 (pipelined dispatch, features/hybrid/feature.py `_pipelined_rails`): the region holds the rows SPLIT in two parts
// so that the metadata crosses the rail first and the payload after it, in chunks of rows:
//   [header | meta rows [M][meta_bytes] | payload rows [M][payload_bytes]]
//   meta row (`SplitRows`): [src token int32, pad to 16 | top-k int64 x K | weights f32 x K], each part padded to 16;
//   payload row: [scales 4 B x num_sf | x], each part padded to 16.
// hybrid_pack_split       (block/token)  hybrid_pack in the split layout
// hybrid_unpack_meta      (grid-stride)  union top-k / weights of the rail rows, fwd_src / fwd_count, ready = 0
// hybrid_unpack_payload   (block/row)    scales and x of rail rows [row_begin, row_end) into their union rows
// hybrid_ready            (1 thread)     release-store the rows-ready counter the intranode dispatch's guard polls
//
// deterministic=True (DeepEP's order, below): hybrid_sort_keys, hybrid_sort_plan, hybrid_sort_rows, hybrid_sort_meta.
#include "common/ep.cuh"
#include "common/timeout.cuh"

namespace deepep {

constexpr int kHybridThreads = 256;
constexpr int kHybridRouteThreads = 1024;
constexpr int kHybridMaxDomains = 16;
constexpr int kHybridHeaderBytes = 16;
constexpr int kHybridMaxSignals = 8;
constexpr int kPhaseHybridRail = 12;        // runtime/errors.py PHASES[12]

__device__ __forceinline__ int64_t align16(int64_t v) { return (v + 15) / 16 * 16; }

struct RailRow {
    int64_t topk_off, w_off, sf_off, x_off, bytes;
};

__device__ __forceinline__ RailRow rail_row(int num_topk, int num_sf, int hidden_bytes) {
    RailRow r;
    r.topk_off = 16;
    r.w_off = r.topk_off + align16(8LL * num_topk);
    r.sf_off = r.w_off + align16(4LL * num_topk);
    r.x_off = r.sf_off + align16(4LL * num_sf);
    r.bytes = r.x_off + align16(hidden_bytes);
    return r;
}

__device__ __forceinline__ int64_t combine_row_bytes(int hidden, int num_topk) {
    return align16(2LL * hidden) + align16(4LL * num_topk);
}

__device__ __forceinline__ void copy16(uint8_t* dst, const uint8_t* src, int64_t num_bytes) {
    for (int64_t i = threadIdx.x; i < num_bytes / 16; i += blockDim.x)
        st_v4(dst + i * 16, ld_v4(src + i * 16));
}

// A token's domain mask (bit m: one of its experts lives in domain m).
template <int kMaxTopk>
__device__ __forceinline__ uint32_t domain_mask(const int64_t* topk_idx, int t, int num_topk, int experts_per_domain,
                                                int num_domains) {
    uint32_t mask = 0;
    #pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
        if (k < num_topk) {
            const int64_t e = topk_idx[static_cast<int64_t>(t) * num_topk + k];
            if (e >= 0 && e < static_cast<int64_t>(num_domains) * experts_per_domain)   // out of range: ignored
                mask |= 1u << static_cast<int>(e / experts_per_domain);
        }
    }
    return mask;
}

// domain_pos [T][N]: position of token t among this rank's tokens going to domain m, -1; counts [N]; the send
// regions' headers (kind 2) for every other domain.
template <int kMaxTopk>
__global__ void __launch_bounds__(kHybridRouteThreads, 1)
hybrid_route(const int64_t* topk_idx, int num_tokens, int num_topk, int experts_per_domain, int num_domains,
             int domain, int32_t* domain_pos, int32_t* counts, uint8_t* rail_base, uint64_t send_offset,
             uint64_t region_bytes) {
    __shared__ int s_warp[kHybridMaxDomains][kHybridRouteThreads / 32];
    __shared__ int s_base[kHybridMaxDomains];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    if (threadIdx.x < num_domains)
        s_base[threadIdx.x] = 0;
    __syncthreads();
    for (int tile = 0; tile < num_tokens; tile += blockDim.x) {
        const int t = tile + threadIdx.x;
        const uint32_t mask = t < num_tokens ? domain_mask<kMaxTopk>(topk_idx, t, num_topk, experts_per_domain,
                                                                       num_domains) : 0;
        for (int m = 0; m < num_domains; ++m) {
            const uint32_t b = __ballot_sync(0xffffffffu, (mask >> m) & 1u);
            if (lane == 0)
                s_warp[m][warp] = __popc(b);
        }
        __syncthreads();
        if (threadIdx.x < num_domains) {
            const int m = threadIdx.x;
            int run = s_base[m];
            for (int w = 0; w < num_warps; ++w) {
                const int c = s_warp[m][w];
                s_warp[m][w] = run;
                run += c;
            }
            s_base[m] = run;
        }
        __syncthreads();
        for (int m = 0; m < num_domains; ++m) {
            const uint32_t b = __ballot_sync(0xffffffffu, (mask >> m) & 1u);
            if (t < num_tokens) {
                const bool goes = (mask >> m) & 1u;
                domain_pos[static_cast<int64_t>(t) * num_domains + m] =
                    goes ? s_warp[m][warp] + __popc(b & ((1u << lane) - 1u)) : -1;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x < num_domains) {
        const int m = threadIdx.x;
        counts[m] = s_base[m];
        if (m != domain) {
            auto* header = reinterpret_cast<int32_t*>(rail_base + send_offset + m * region_bytes);
            header[0] = s_base[m];
            header[1] = 2;
            header[2] = 0;
            header[3] = 0;
        }
    }
}

// One block per token: its row into the send region of every other domain it goes to.
template <int kMaxTopk>
__global__ void __launch_bounds__(kHybridThreads)
hybrid_pack(const uint8_t* x, int64_t x_row_bytes, int hidden_bytes, const uint32_t* sf, int64_t sf_stride_token,
            int64_t sf_stride_col, int num_sf, const int64_t* topk_idx, const float* topk_weights, int num_tokens,
            int num_topk, const int32_t* domain_pos, int num_domains, int domain, uint8_t* rail_base,
            uint64_t send_offset, uint64_t region_bytes) {
    const int t = blockIdx.x;
    if (t >= num_tokens)
        return;
    const RailRow row = rail_row(num_topk, num_sf, hidden_bytes);
    for (int m = 0; m < num_domains; ++m) {
        const int pos = domain_pos[static_cast<int64_t>(t) * num_domains + m];
        if (m == domain || pos < 0)
            continue;
        uint8_t* dst = rail_base + send_offset + m * region_bytes + kHybridHeaderBytes + pos * row.bytes;
        if (threadIdx.x == 0)
            *reinterpret_cast<int32_t*>(dst) = t;
        for (int k = threadIdx.x; k < num_topk; k += blockDim.x) {
            reinterpret_cast<int64_t*>(dst + row.topk_off)[k] = topk_idx[static_cast<int64_t>(t) * num_topk + k];
            reinterpret_cast<float*>(dst + row.w_off)[k] =
                topk_weights != nullptr ? topk_weights[static_cast<int64_t>(t) * num_topk + k] : 0.0f;
        }
        for (int j = threadIdx.x; j < num_sf; j += blockDim.x)
            reinterpret_cast<uint32_t*>(dst + row.sf_off)[j] = sf[t * sf_stride_token + j * sf_stride_col];
        copy16(dst + row.x_off, x + t * x_row_bytes, hidden_bytes);
    }
}

// Send counts (from hybrid_route) and receive counts (headers of the receive regions) for the host.
__global__ void hybrid_report(const int32_t* counts, const uint8_t* rail_base, uint64_t recv_offset,
                              uint64_t region_bytes, int num_domains, int domain, int32_t* host_out, int seq) {
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    volatile int32_t* out = host_out;
    for (int m = 0; m < num_domains; ++m) {
        out[1 + m] = counts[m];
        out[1 + num_domains + m] = m == domain ? 0 :
            *reinterpret_cast<const int32_t*>(rail_base + recv_offset + m * region_bytes);
    }
    __threadfence_system();
    out[0] = seq;
    __threadfence_system();
}

// Copy one token into union row u: top-k ids masked to this domain's experts (domain-relative ids, -1 elsewhere).
template <int kMaxTopk>
__device__ __forceinline__ void union_row(int64_t u, const uint8_t* x_src, const uint32_t* sf_src,
                                          int64_t sf_step, const int64_t* topk_src, const float* w_src,
                                          int hidden_bytes, int num_sf, int num_topk, int experts_per_domain,
                                          int domain, uint8_t* union_x, uint32_t* union_sf, int64_t* union_topk,
                                          float* union_weights) {
    for (int k = threadIdx.x; k < num_topk; k += blockDim.x) {
        const int64_t e = topk_src[k];
        const int64_t lo = static_cast<int64_t>(domain) * experts_per_domain;
        union_topk[u * num_topk + k] = (e >= lo && e < lo + experts_per_domain) ? e - lo : -1;
        if (union_weights != nullptr)
            union_weights[u * num_topk + k] = w_src != nullptr ? w_src[k] : 0.0f;
    }
    for (int j = threadIdx.x; j < num_sf; j += blockDim.x)
        union_sf[u * num_sf + j] = sf_src[j * sf_step];
    copy16(union_x + u * hidden_bytes, x_src, hidden_bytes);
}

// Mode 0 (grid-stride over the N * M union rows): own tokens at row domain * M + t, every other row empty (top-k
// all -1, so the intranode dispatch sends it nowhere). Mode 1 (one block per (source domain s, rail position p)):
// rail row p of s into union row s * M + its source token; fwd_src[s * M + p] = that token, fwd_count[s] = count.
template <int kMaxTopk>
__global__ void __launch_bounds__(kHybridThreads)
hybrid_unpack(int mode, const uint8_t* x, int64_t x_row_bytes, int hidden_bytes, const uint32_t* sf,
              int64_t sf_stride_token, int64_t sf_stride_col, int num_sf, const int64_t* topk_idx,
              const float* topk_weights, int num_tokens, int num_topk, int experts_per_domain, int num_domains,
              int domain, int num_max_tokens, const uint8_t* rail_base, uint64_t recv_offset, uint64_t region_bytes,
              uint8_t* union_x, uint32_t* union_sf, int64_t* union_topk, float* union_weights, int32_t* fwd_src,
              int32_t* fwd_count) {
    const int64_t M = num_max_tokens;
    if (mode == 0) {
        for (int64_t u = blockIdx.x; u < num_domains * M; u += gridDim.x) {
            const int s = static_cast<int>(u / M), t = static_cast<int>(u % M);
            if (s == domain && t < num_tokens) {
                union_row<kMaxTopk>(u, x + t * x_row_bytes, sf + t * sf_stride_token, sf_stride_col,
                                    topk_idx + static_cast<int64_t>(t) * num_topk,
                                    topk_weights != nullptr ? topk_weights + static_cast<int64_t>(t) * num_topk
                                                            : nullptr,
                                    hidden_bytes, num_sf, num_topk, experts_per_domain, domain, union_x, union_sf,
                                    union_topk, union_weights);
            } else {
                for (int k = threadIdx.x; k < num_topk; k += blockDim.x) {
                    union_topk[u * num_topk + k] = -1;
                    if (union_weights != nullptr)
                        union_weights[u * num_topk + k] = 0.0f;
                }
            }
        }
        return;
    }
    const int s = static_cast<int>(blockIdx.x / M), p = static_cast<int>(blockIdx.x % M);
    if (s >= num_domains || s == domain)
        return;
    const uint8_t* region = rail_base + recv_offset + s * region_bytes;
    int count = *reinterpret_cast<const int32_t*>(region);
    count = count < 0 ? 0 : (count > num_max_tokens ? num_max_tokens : count);
    if (p == 0 && threadIdx.x == 0)
        fwd_count[s] = count;
    if (p >= count)
        return;
    const RailRow row = rail_row(num_topk, num_sf, hidden_bytes);
    const uint8_t* src = region + kHybridHeaderBytes + p * row.bytes;
    const int t = *reinterpret_cast<const int32_t*>(src);
    if (t < 0 || t >= num_max_tokens)
        return;
    union_row<kMaxTopk>(s * M + t, src + row.x_off, reinterpret_cast<const uint32_t*>(src + row.sf_off), 1,
                        reinterpret_cast<const int64_t*>(src + row.topk_off),
                        reinterpret_cast<const float*>(src + row.w_off), hidden_bytes, num_sf, num_topk,
                        experts_per_domain, domain, union_x, union_sf, union_topk, union_weights);
    if (threadIdx.x == 0)
        fwd_src[s * M + p] = t;
}

// One block per (origin domain s, rail position p): the in-domain combined union row s * M + fwd_src[s * M + p]
// (bf16 row and the slots' weights) into the send region of s at p; header (kind 3) by the p = 0 block.
__global__ void __launch_bounds__(kHybridThreads)
hybrid_combine_pack(const uint8_t* combined_x, const float* combined_weights, int hidden, int num_topk,
                    const int32_t* fwd_src, const int32_t* fwd_count, int num_domains, int domain,
                    int num_max_tokens, uint8_t* rail_base, uint64_t send_offset, uint64_t region_bytes) {
    const int64_t M = num_max_tokens;
    const int s = static_cast<int>(blockIdx.x / M), p = static_cast<int>(blockIdx.x % M);
    if (s >= num_domains || s == domain)
        return;
    uint8_t* region = rail_base + send_offset + s * region_bytes;
    const int count = fwd_count[s];
    if (p == 0 && threadIdx.x == 0) {
        auto* header = reinterpret_cast<int32_t*>(region);
        header[0] = count;
        header[1] = 3;
        header[2] = 0;
        header[3] = 0;
    }
    if (p >= count)
        return;
    const int64_t u = s * M + fwd_src[s * M + p];
    const int64_t row_bytes = combine_row_bytes(hidden, num_topk);
    uint8_t* dst = region + kHybridHeaderBytes + p * row_bytes;
    copy16(dst, combined_x + u * 2LL * hidden, 2LL * hidden);
    auto* w = reinterpret_cast<float*>(dst + align16(2LL * hidden));
    for (int k = threadIdx.x; k < num_topk; k += blockDim.x)
        w[k] = combined_weights != nullptr ? combined_weights[u * num_topk + k] : 0.0f;
}

// One block per origin token t = token_begin + block: FP32 accumulator = bias_0 (+ bias_1) or +0.0, then every
// domain's partial (this domain's from the intranode combine's union row, the others' from their rail rows) in
// ascending key (the domain's last top-k slot), one rounding to bf16. Weights: slot k's from the domain owning its
// expert (0 for -1). P2 launches it per landed chunk of the rail exchange (tokens [token_begin, ...)), P1 once.
template <int kMaxTopk>
__global__ void __launch_bounds__(kHybridThreads)
hybrid_combine_final(const int64_t* topk_idx, int num_tokens, int num_topk, int experts_per_domain, int num_domains,
                     int domain, int num_max_tokens, const int32_t* domain_pos, const uint8_t* combined_x,
                     const float* combined_weights, int hidden, const uint8_t* rail_base, uint64_t recv_offset,
                     uint64_t region_bytes, const uint16_t* bias0, const uint16_t* bias1, int num_bias,
                     uint16_t* out_x, float* out_weights, int token_begin) {
    __shared__ const uint8_t* s_src[kHybridMaxDomains];
    __shared__ int s_num;
    const int t = token_begin + static_cast<int>(blockIdx.x);
    if (t >= num_tokens)
        return;
    const int64_t M = num_max_tokens;
    const int64_t row_bytes = combine_row_bytes(hidden, num_topk);
    const int64_t* topk = topk_idx + static_cast<int64_t>(t) * num_topk;
    auto partial_of = [&](int m) -> const uint8_t* {
        if (m == domain)
            return combined_x + (m * M + t) * 2LL * hidden;
        return rail_base + recv_offset + m * region_bytes + kHybridHeaderBytes +
               domain_pos[static_cast<int64_t>(t) * num_domains + m] * row_bytes;
    };
    if (threadIdx.x == 0) {
        int key[kHybridMaxDomains];
        for (int m = 0; m < num_domains; ++m)
            key[m] = -1;
        const int64_t num_experts = static_cast<int64_t>(num_domains) * experts_per_domain;
        for (int k = 0; k < num_topk; ++k)
            if (topk[k] >= 0 && topk[k] < num_experts)
                key[topk[k] / experts_per_domain] = k;
        int n = 0;
        for (int k = 0; k < num_topk; ++k) {        // ascending key: a domain's key is the slot k where it ends
            if (topk[k] < 0 || topk[k] >= num_experts)
                continue;
            const int m = static_cast<int>(topk[k] / experts_per_domain);
            if (key[m] == k)
                s_src[n++] = partial_of(m);
        }
        s_num = n;
    }
    __syncthreads();
    const int num = s_num;
    for (int c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
        float acc[8];
        const int64_t off = static_cast<int64_t>(t) * hidden + c * 8;
        if (num_bias == 0) {
            #pragma unroll
            for (int i = 0; i < 8; ++i)
                acc[i] = 0.0f;
        } else {
            const Vec16 b = ld_v4(bias0 + off);
            acc[0] = bf16_lo(b.x); acc[1] = bf16_hi(b.x); acc[2] = bf16_lo(b.y); acc[3] = bf16_hi(b.y);
            acc[4] = bf16_lo(b.z); acc[5] = bf16_hi(b.z); acc[6] = bf16_lo(b.w); acc[7] = bf16_hi(b.w);
            if (num_bias == 2)
                add_bf16x8(acc, ld_v4(bias1 + off));
        }
        for (int i = 0; i < num; ++i)
            add_bf16x8(acc, ld_v4(s_src[i] + c * 16));
        Vec16 o;
        o.x = pack_bf16x2(acc[0], acc[1]);
        o.y = pack_bf16x2(acc[2], acc[3]);
        o.z = pack_bf16x2(acc[4], acc[5]);
        o.w = pack_bf16x2(acc[6], acc[7]);
        st_v4(out_x + off, o);
    }
    if (out_weights != nullptr) {
        for (int k = threadIdx.x; k < num_topk; k += blockDim.x) {
            const int64_t e = topk[k];
            float w = 0.0f;
            if (e >= 0 && e < static_cast<int64_t>(num_domains) * experts_per_domain) {
                const int m = static_cast<int>(e / experts_per_domain);
                w = m == domain ? combined_weights[(m * M + t) * num_topk + k]
                                : reinterpret_cast<const float*>(partial_of(m) + align16(2LL * hidden))[k];
            }
            out_weights[static_cast<int64_t>(t) * num_topk + k] = w;
        }
    }
}

// ---- P2: the split rows ----------------------------------------------------------------------------------------
struct SplitRows {
    int64_t topk_off, w_off, meta_bytes, x_off, payload_bytes, payload_base;

    __device__ __forceinline__ SplitRows(int num_topk, int num_sf, int hidden_bytes, int num_max_tokens) {
        topk_off = 16;
        w_off = topk_off + align16(8LL * num_topk);
        meta_bytes = w_off + align16(4LL * num_topk);
        x_off = align16(4LL * num_sf);
        payload_bytes = x_off + align16(hidden_bytes);
        payload_base = kHybridHeaderBytes + static_cast<int64_t>(num_max_tokens) * meta_bytes;
    }
    __device__ __forceinline__ int64_t meta(int p) const { return kHybridHeaderBytes + p * meta_bytes; }
    __device__ __forceinline__ int64_t payload(int p) const { return payload_base + p * payload_bytes; }
};

// One block per token: its metadata and payload into the send region of every other domain it goes to.
template <int kMaxTopk>
__global__ void __launch_bounds__(kHybridThreads)
hybrid_pack_split(const uint8_t* x, int64_t x_row_bytes, int hidden_bytes, const uint32_t* sf,
                  int64_t sf_stride_token, int64_t sf_stride_col, int num_sf, const int64_t* topk_idx,
                  const float* topk_weights, int num_tokens, int num_topk, const int32_t* domain_pos, int num_domains,
                  int domain, int num_max_tokens, uint8_t* rail_base, uint64_t send_offset, uint64_t region_bytes) {
    const int t = blockIdx.x;
    if (t >= num_tokens)
        return;
    const SplitRows rows(num_topk, num_sf, hidden_bytes, num_max_tokens);
    for (int m = 0; m < num_domains; ++m) {
        const int pos = domain_pos[static_cast<int64_t>(t) * num_domains + m];
        if (m == domain || pos < 0)
            continue;
        uint8_t* region = rail_base + send_offset + m * region_bytes;
        uint8_t* meta = region + rows.meta(pos);
        uint8_t* payload = region + rows.payload(pos);
        if (threadIdx.x == 0)
            *reinterpret_cast<int32_t*>(meta) = t;
        for (int k = threadIdx.x; k < num_topk; k += blockDim.x) {
            reinterpret_cast<int64_t*>(meta + rows.topk_off)[k] = topk_idx[static_cast<int64_t>(t) * num_topk + k];
            reinterpret_cast<float*>(meta + rows.w_off)[k] =
                topk_weights != nullptr ? topk_weights[static_cast<int64_t>(t) * num_topk + k] : 0.0f;
        }
        for (int j = threadIdx.x; j < num_sf; j += blockDim.x)
            reinterpret_cast<uint32_t*>(payload)[j] = sf[t * sf_stride_token + j * sf_stride_col];
        copy16(payload + rows.x_off, x + t * x_row_bytes, hidden_bytes);
    }
}

// The rail rows' metadata, after the metadata exchange (hybrid_unpack mode 0 ran before: own rows and empty rows):
// thread per (source domain s, rail position p): union row s * M + t (t = its source token) gets the top-k ids
// masked to this domain and the weights; fwd_src [s * M + p] = t, fwd_count [s] = count. Also resets the rows-ready
// counter (this call's, a fresh allocation) to 0 before the payload stream starts.
template <int kMaxTopk>
__global__ void __launch_bounds__(kHybridThreads)
hybrid_unpack_meta(int num_topk, int num_sf, int hidden_bytes, int experts_per_domain, int num_domains, int domain,
                   int num_max_tokens, const uint8_t* rail_base, uint64_t recv_offset, uint64_t region_bytes,
                   int64_t* union_topk, float* union_weights, int32_t* fwd_src, int32_t* fwd_count,
                   uint32_t* ready) {
    const int64_t M = num_max_tokens;
    const SplitRows rows(num_topk, num_sf, hidden_bytes, num_max_tokens);
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (tid == 0)
        *ready = 0;
    for (int64_t i = tid; i < num_domains * M; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int s = static_cast<int>(i / M), p = static_cast<int>(i % M);
        if (s == domain)
            continue;
        const uint8_t* region = rail_base + recv_offset + s * region_bytes;
        int count = *reinterpret_cast<const int32_t*>(region);
        count = count < 0 ? 0 : (count > num_max_tokens ? num_max_tokens : count);
        if (p == 0)
            fwd_count[s] = count;
        if (p >= count)
            continue;
        const uint8_t* meta = region + rows.meta(p);
        const int t = *reinterpret_cast<const int32_t*>(meta);
        if (t < 0 || t >= num_max_tokens)
            continue;
        fwd_src[i] = t;
        const int64_t u = s * M + t;
        const int64_t lo = static_cast<int64_t>(domain) * experts_per_domain;
        const auto* topk = reinterpret_cast<const int64_t*>(meta + rows.topk_off);
        const auto* w = reinterpret_cast<const float*>(meta + rows.w_off);
        for (int k = 0; k < num_topk; ++k) {
            const int64_t e = topk[k];
            union_topk[u * num_topk + k] = (e >= lo && e < lo + experts_per_domain) ? e - lo : -1;
            if (union_weights != nullptr)
                union_weights[u * num_topk + k] = w[k];
        }
    }
}

// One block per (source domain s, rail position p in [row_begin, row_end)): scales and x of the rail row into union
// row s * M + t, once the payload chunk holding the rows landed.
__global__ void __launch_bounds__(kHybridThreads)
hybrid_unpack_payload(int num_topk, int num_sf, int hidden_bytes, int num_domains, int domain, int num_max_tokens,
                      int row_begin, int row_end, const uint8_t* rail_base, uint64_t recv_offset,
                      uint64_t region_bytes, uint8_t* union_x, uint32_t* union_sf) {
    const int span = row_end - row_begin;
    if (span <= 0)
        return;
    const int s = static_cast<int>(blockIdx.x / span), p = row_begin + static_cast<int>(blockIdx.x % span);
    if (s >= num_domains || s == domain)
        return;
    const int64_t M = num_max_tokens;
    const SplitRows rows(num_topk, num_sf, hidden_bytes, num_max_tokens);
    const uint8_t* region = rail_base + recv_offset + s * region_bytes;
    int count = *reinterpret_cast<const int32_t*>(region);
    count = count < 0 ? 0 : (count > num_max_tokens ? num_max_tokens : count);
    if (p >= count)
        return;
    const int t = *reinterpret_cast<const int32_t*>(region + rows.meta(p));
    if (t < 0 || t >= num_max_tokens)
        return;
    const int64_t u = s * M + t;
    const uint8_t* payload = region + rows.payload(p);
    for (int j = threadIdx.x; j < num_sf; j += blockDim.x)
        union_sf[u * num_sf + j] = reinterpret_cast<const uint32_t*>(payload)[j];
    copy16(union_x + u * hidden_bytes, payload + rows.x_off, hidden_bytes);
}

// Publish `value` rows ready (every earlier write of this stream, the unpacked rows included, before it).
__global__ void hybrid_ready(uint32_t* ready, uint32_t value) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        __threadfence_system();
        st_release_sys(ready, value);
    }
}

// ---- deterministic=True: DeepEP's row order (deep_ep/buffers/elastic.py `EPHandle.deterministic_sort`) ----------
// DeepEP sorts every received row by src_token_global_idx = (s * R + r) * M + t (source domain s, source scale-up
// index r, token t), and, expanded, each expert's rows among themselves. The intranode engine of the composed path
// hands them over in ascending intranode key (r * N + s) * M + t (forwarder r, union row s * M + t): a group (all
// rows, or one expert's expanded rows) is W = R * N runs, run q = r * N + s in token order. DeepEP's sort is then a
// transposition of the runs: row e of run q goes to lo + base[q] + (e - start[q]), start[q] the first row of run q
// (a binary search: the keys ascend inside a group), base[q] the rows of the runs before q in (s, r) order. Host
// model: features/hybrid/plan.py `sort_transposition` (against DeepEP's sort: tests/test_hybrid_deterministic_cpu.py).
//
// hybrid_sort_keys  (grid-stride)  the intranode key of every expanded row (its receive row's metadata column 0)
// hybrid_sort_plan  (block/group)  row_src [dst] = src and row_dst [src] = dst of every row (identity outside groups)
// hybrid_sort_rows  (block/row)    move rows of an array through row_src (dispatch) or row_dst (combine's input)
// hybrid_sort_meta  (grid-stride)  the handle's recv_src_metadata in DeepEP's order, column 0 as the global index
constexpr int kHybridMaxRuns = kHybridMaxDomains * kNotifyMaxRanks;

__global__ void __launch_bounds__(kHybridThreads)
hybrid_sort_keys(const int32_t* meta, int num_topk, int num_meta_rows, const int32_t* num_recv, int32_t* keys,
                 int num_rows) {
    const int rows = min(max(*num_recv, 0), num_meta_rows);
    const int64_t total = static_cast<int64_t>(rows) * num_topk;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int32_t* m = meta + (i / num_topk) * (num_topk + 2);
        const int e = m[2 + static_cast<int>(i % num_topk)];
        if (e >= 0 && e < num_rows)
            keys[e] = m[0];
    }
}

// Block g: group g's rows [lo, hi) and the rows up to the next group's start (alignment gaps; the last block: up to
// num_rows), which stay. Groups: lo = 0 for g = 0, else align(group_end[g - 1], alignment); hi = group_end[g]
// (inclusive prefix sums: the intranode handle's psum per scale-up rank, last entry, or its psum per expert).
__global__ void __launch_bounds__(kHybridThreads)
hybrid_sort_plan(const int32_t* keys, int key_stride, const int32_t* group_end, int num_groups, int alignment,
                 int num_rows, int num_domains, int num_scaleup_ranks, int num_max_tokens, int32_t* row_src,
                 int32_t* row_dst) {
    __shared__ int s_start[kHybridMaxRuns + 1];
    __shared__ int s_base[kHybridMaxRuns];
    const int g = blockIdx.x;
    if (g >= num_groups)
        return;
    auto clamp = [&](int64_t v) { return static_cast<int>(v < 0 ? 0 : (v > num_rows ? num_rows : v)); };
    auto aligned = [&](int v) { return static_cast<int64_t>(v + alignment - 1) / alignment * alignment; };
    const int lo = g == 0 ? 0 : clamp(aligned(group_end[g - 1]));
    const int hi = max(lo, clamp(group_end[g]));
    const int next = g + 1 < num_groups ? max(hi, clamp(aligned(group_end[g]))) : num_rows;
    const int W = num_domains * num_scaleup_ranks;
    for (int q = threadIdx.x; q <= W; q += blockDim.x) {
        int a = lo, b = hi;         // the first row of [lo, hi) whose key is >= q * M
        if (q == W) {
            a = hi;
        } else {
            const int64_t v = static_cast<int64_t>(q) * num_max_tokens;
            while (a < b) {
                const int mid = a + (b - a) / 2;
                if (keys[static_cast<int64_t>(mid) * key_stride] < v)
                    a = mid + 1;
                else
                    b = mid;
            }
        }
        s_start[q] = a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int i = 0; i < W; ++i) {       // DeepEP's order: source domain, then scale-up index
            const int q = (i % num_scaleup_ranks) * num_domains + i / num_scaleup_ranks;
            s_base[q] = run;
            run += s_start[q + 1] - s_start[q];
        }
    }
    __syncthreads();
    for (int e = lo + static_cast<int>(threadIdx.x); e < next; e += blockDim.x) {
        int dst = e;
        if (e < hi) {
            int q = keys[static_cast<int64_t>(e) * key_stride] / num_max_tokens;
            q = q < 0 ? 0 : (q >= W ? W - 1 : q);
            dst = lo + s_base[q] + (e - s_start[q]);
            dst = (dst < lo || dst >= hi) ? e : dst;        // (keys out of order: a bug; stay inside the group)
        }
        row_dst[e] = dst;
        row_src[dst] = e;
    }
}

// Rows of a [num_rows, num_cols] array of `elem_bytes`-byte elements (4, 8 or 16; strides in elements, alike for src
// and dst), one block per row j (grid-stride); i = index[j] (j itself from num_index on, or out of range).
// mode 0: dst[j] = src[i] for every row (combine's input into the intranode order, from the caller's array);
// mode 1: dst[j] = src[i] where i != j; mode 2: dst[j] = src[j] where i != j. An in-place sort of an array A through
// row_src is mode 2 (A -> scratch) then mode 1 (scratch -> A): a row that moves comes from a row that moves.
__global__ void __launch_bounds__(kHybridThreads)
hybrid_sort_rows(const uint8_t* src, uint8_t* dst, const int32_t* index, int num_index, int num_rows, int num_cols,
                 int elem_bytes, int64_t row_stride, int64_t col_stride, int mode) {
    for (int64_t j = blockIdx.x; j < num_rows; j += gridDim.x) {
        int64_t i = j < num_index ? index[j] : j;
        i = (i < 0 || i >= num_rows) ? j : i;
        if (mode != 0 && i == j)
            continue;
        const int64_t from = (mode == 2 ? j : i) * row_stride, to = j * row_stride;
        for (int c = threadIdx.x; c < num_cols; c += blockDim.x) {
            const int64_t a = from + c * col_stride, b = to + c * col_stride;
            if (elem_bytes == 16)
                st_v4(dst + b * 16, ld_v4(src + a * 16));
            else if (elem_bytes == 8)
                reinterpret_cast<uint64_t*>(dst)[b] = reinterpret_cast<const uint64_t*>(src)[a];
            else
                reinterpret_cast<uint32_t*>(dst)[b] = reinterpret_cast<const uint32_t*>(src)[a];
        }
    }
}

// out[j] = meta[row_src[j]] (j itself from num_index on): column 0 as src_token_global_idx (the intranode index
// r * (N * M) + s * M + t as (s * R + r) * M + t; negative values stay: features/hybrid/plan.py translate_src_index),
// column 1 as is, columns 2.. (expanded rows) through exp_dst when given (their places after the expanded sort).
__global__ void __launch_bounds__(kHybridThreads)
hybrid_sort_meta(const int32_t* meta, int32_t* out, const int32_t* row_src, int num_index, int num_rows, int num_topk,
                 const int32_t* exp_dst, int num_exp_rows, int num_domains, int num_scaleup_ranks,
                 int num_max_tokens) {
    const int cols = num_topk + 2;
    const int64_t total = static_cast<int64_t>(num_rows) * cols;
    const int64_t nm = static_cast<int64_t>(num_domains) * num_max_tokens;
    for (int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; x < total;
         x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t j = x / cols;
        const int c = static_cast<int>(x % cols);
        int64_t i = j < num_index ? row_src[j] : j;
        i = (i < 0 || i >= num_rows) ? j : i;
        int32_t v = meta[i * cols + c];
        if (c == 0 && v >= 0) {
            const int64_t r = v / nm, rem = v % nm;
            v = static_cast<int32_t>(((rem / num_max_tokens) * num_scaleup_ranks + r) * num_max_tokens +
                                     rem % num_max_tokens);
        } else if (c >= 2 && exp_dst != nullptr && v >= 0 && v < num_exp_rows) {
            v = exp_dst[v];
        }
        out[j * cols + c] = v;
    }
}

// ---- the loopback transport's epoch flags (runtime/rails.py StreamSignals) ---------------------------------------
__global__ void rail_epoch_begin(uint32_t* epoch) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
        *epoch = *epoch + 1;
}

// Release-store this rank's epoch into each of the first `num` addresses (system scope: publishes every earlier
// write of this stream, copies included).
__global__ void rail_signal(const uint32_t* epoch, int num, uint64_t a0, uint64_t a1, uint64_t a2, uint64_t a3,
                            uint64_t a4, uint64_t a5, uint64_t a6, uint64_t a7) {
    const uint64_t addrs[kHybridMaxSignals] = {a0, a1, a2, a3, a4, a5, a6, a7};
    __threadfence_system();
    const int i = threadIdx.x;
    if (i < num && i < kHybridMaxSignals)
        st_release_sys(reinterpret_cast<uint32_t*>(addrs[i]), *epoch);
}

// Wait (bounded) until each of the first `num` flags reached this rank's epoch; on timeout the error record names
// the hybrid rail phase, this rank and the peer (global ranks), `aux` the exchange (1 notify, 2 dispatch,
// 3 combine, 4 barrier).
__global__ void rail_wait(const uint32_t* epoch, int num, int aux, int rank, int32_t* claim, int32_t* error_record,
                          uint64_t timeout_ns, uint64_t a0, uint64_t a1, uint64_t a2, uint64_t a3, uint64_t a4,
                          uint64_t a5, uint64_t a6, uint64_t a7, int p0, int p1, int p2, int p3, int p4, int p5,
                          int p6, int p7) {
    const uint64_t addrs[kHybridMaxSignals] = {a0, a1, a2, a3, a4, a5, a6, a7};
    const int peers[kHybridMaxSignals] = {p0, p1, p2, p3, p4, p5, p6, p7};
    const int i = threadIdx.x;
    if (i < num && i < kHybridMaxSignals) {
        const ErrorSink sink{claim, error_record};
        wait_epoch(reinterpret_cast<const uint32_t*>(addrs[i]), *epoch, timeout_ns, sink, kPhaseHybridRail, rank,
                   peers[i], aux);
    }
    __syncthreads();
    __threadfence_system();
}

}  // namespace deepep
