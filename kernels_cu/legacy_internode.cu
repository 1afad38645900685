// DeepEP V1's internode handle on the composed hybrid path (deepep_cupy/v1/kernels/internode.py): the small
// kernels that carry what V1's handle needs and the hybrid dispatch does not, and that build the handle's tensors.
//
// Rank g = (d, l) of N domains x S ranks (g = d * S + l); rail peers (m, l); V1's channel c of a rank holding T
// tokens = its tokens [c * w, (c + 1) * w), w = max(1, ceil(T / C)). The hybrid dispatch at g: its tokens cross rail l
// once per destination domain, the forwarder (m, l) builds a union of N * M rows (row s * M + t = token t of (s, l),
// top-k masked to domain m's experts, domain-relative ids) and dispatches it inside domain m.
//
// legacy_internode_begin    (1 thread, after hybrid_route, before the rail exchanges): this rank's token count into
//                           word 2 of every rail send region's header (hybrid.cu leaves it 0), so that each forwarder
//                           learns its rail peers' counts (V1's channels of their tokens); the call's epoch.
// legacy_internode_report   (1 thread, CPU-sync dispatches, after the rail notify exchange): the largest count of the
//                           rail peers and the rows this rank forwards, into host-mapped memory.
// legacy_internode_forward  (1 block, before the intranode dispatch): the sender's and forwarder's handle parts
//                           (rdma / gbl channel prefix matrices, recv_rdma_channel_prefix_matrix, its prefix sum,
//                           send_nvl_head) and, for each local receiver, the counts of the rail peers and the
//                           local-rank bitmask of each union row it receives (the V1 exchange area, below).
// legacy_internode_receive  (1 block, after the intranode dispatch and the deterministic sort): the receiver's parts
//                           (recv_gbl_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_src_meta).
// legacy_internode_combine_weights (thread per token, after the hybrid combine): V1's combined_topk_weights, the FP32
//                           sum over the token's domains (first top-k appearance order) of each domain's in-domain sum.
//
// The V1 exchange area (int32 words at byte `area_offset` of every scale-up rank's symmetric buffer, zero at
// allocation):
//   [0]                     this rank's epoch counter (legacy_internode_begin: one per non-cached dispatch; every
//                           rank of the job makes the same dispatches, so the epochs agree)
//   [kV1AckOffset + r]      uint32: the last epoch local rank r consumed from this rank's slots (written by r)
//   slot(p, j), p = epoch & 1, at kV1SlotsOffset + (p * S + j) * slot_words: written by local forwarder j for this
//                           rank: [kV1SlotTag] uint32 the epoch (release-stored after the rest), [kV1SlotCounts + s]
//                           the token count of rank (s, j), [kV1SlotMasks + u] the bitmask of union row u of j.
// Protocol: forwarder j writes slot(p, j) of every local rank r, then release-stores its tag = epoch e; receiver r
// waits (acquire, bounded) for the tags of all S forwarders, reads, then release-stores its ack = e into every
// forwarder's area. Before writing epoch e's slots, forwarder j waits for every receiver's ack >= e - 2 (the last epoch
// that used the same slots), so no slot is overwritten before its reader is done, whatever the streams' interleaving.
// Every wait is bounded and reports (phase 13, rank, peer, expected, seen, aux 1 = acks, 2 = tags).
#include "common/timeout.cuh"

namespace deepep {

constexpr int kV1Threads = 1024;
constexpr int kV1WeightThreads = 256;
constexpr int kV1MaxScaleup = 8;
constexpr int kV1MaxDomains = 16;
constexpr int kV1MaxRanks = kV1MaxScaleup * kV1MaxDomains;
constexpr int kPhaseLegacyInternode = 13;      // runtime/errors.py PHASES[13]
constexpr int kV1AckOffset = 32, kV1SlotsOffset = 64;
constexpr int kV1SlotTag = 0, kV1SlotCounts = 16, kV1SlotMasks = 32;
constexpr int kV1HeaderBytes = 16;             // hybrid.cu kHybridHeaderBytes: [count, kind, word 2, 0]

__device__ __forceinline__ int32_t* v1_area(uint64_t base, uint64_t area_offset) {
    return reinterpret_cast<int32_t*>(base + area_offset);
}

__device__ __forceinline__ int32_t* v1_slot(uint64_t base, uint64_t area_offset, int parity, int forwarder,
                                            int num_scaleup, int64_t slot_words) {
    return v1_area(base, area_offset) + kV1SlotsOffset +
           (static_cast<int64_t>(parity) * num_scaleup + forwarder) * slot_words;
}

// V1's channel width: the tokens of one channel of a rank holding `num_tokens`.
__device__ __forceinline__ int64_t v1_channel_width(int64_t num_tokens, int num_channels) {
    const int64_t w = (num_tokens + num_channels - 1) / num_channels;
    return w > 0 ? w : 1;
}

// The entries of `sorted[0, n)` (ascending, read with stride `stride`) below `bound`.
__device__ __forceinline__ int v1_count_below(const int32_t* sorted, int64_t stride, int n, int64_t bound) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (static_cast<int64_t>(sorted[mid * stride]) < bound)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

__device__ __forceinline__ const int32_t* rail_header(const uint8_t* rail_base, uint64_t offset, uint64_t region_bytes,
                                                      int m) {
    return reinterpret_cast<const int32_t*>(rail_base + offset + m * region_bytes);
}

__global__ void legacy_internode_begin(uint8_t* rail_base, uint64_t send_offset, uint64_t region_bytes,
                                       int num_domains, int domain, int reported_num_tokens, int32_t* area,
                                       int32_t* call_words) {
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    for (int m = 0; m < num_domains; ++m)
        if (m != domain)
            reinterpret_cast<int32_t*>(rail_base + send_offset + m * region_bytes)[2] = reported_num_tokens;
    const int32_t epoch = area[0] + 1;
    area[0] = epoch;
    call_words[0] = epoch;
}

// host_out[0] = the largest token count of the rail peers (their headers' word 2), host_out[1] = the rows this rank
// forwards (its own tokens with an expert in its domain, then every rail peer's rows).
__global__ void legacy_internode_report(const uint8_t* rail_base, uint64_t recv_offset, uint64_t region_bytes,
                                        int num_domains, int domain, const int32_t* counts, int32_t* host_out) {
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    int most = 0, rows = counts[domain];
    for (int m = 0; m < num_domains; ++m) {
        if (m == domain)
            continue;
        const int32_t* header = rail_header(rail_base, recv_offset, region_bytes, m);
        most = max(most, header[2]);
        rows += header[0];
    }
    volatile int32_t* out = host_out;
    out[0] = most;
    out[1] = rows;
    __threadfence_system();
}

// Outputs (int32): rdma_channel_prefix_matrix [N][C], gbl_channel_prefix_matrix [R][C],
// recv_rdma_channel_prefix_matrix [N][C], recv_rdma_rank_prefix_sum [N], send_nvl_head [num_nvl_rows][S] (rows past
// the forwarded count -1). Reads the user's topk_idx [T][K], the union's top-k [N * M][K] (hybrid_unpack), fwd_src /
// fwd_count (rail rows of each source domain: source tokens in rail = token order), the rail receive headers.
__global__ void __launch_bounds__(kV1Threads, 1)
legacy_internode_forward(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_domains,
                         int domain, int num_scaleup, int rank, const int32_t* fwd_src, const int32_t* fwd_count,
                         const int64_t* union_topk, int num_max_tokens, int num_channels, const uint8_t* rail_base,
                         uint64_t recv_offset, uint64_t region_bytes, const uint64_t* peer_bases,
                         uint64_t area_offset, int64_t slot_words, const int32_t* call_words,
                         int32_t* rdma_channel_prefix_matrix, int32_t* gbl_channel_prefix_matrix,
                         int32_t* recv_rdma_channel_prefix_matrix, int32_t* recv_rdma_rank_prefix_sum,
                         int32_t* send_nvl_head, int num_nvl_rows, int32_t* error_record, uint64_t timeout_ns) {
    __shared__ int32_t s_cnt[kV1MaxRanks + kV1MaxDomains];
    __shared__ int32_t s_run[kV1MaxRanks + kV1MaxDomains];
    __shared__ int32_t s_warp[kV1MaxScaleup + 1][kV1Threads / 32];
    __shared__ int32_t s_base[kV1MaxScaleup + 1];
    __shared__ int s_ok;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, num_warps = blockDim.x >> 5;
    const int S = num_scaleup, N = num_domains, R = N * S, C = num_channels, K = num_topk;
    const int64_t M = num_max_tokens;
    const uint32_t epoch = static_cast<uint32_t>(call_words[0]);
    const int parity = static_cast<int>(epoch & 1u);
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    if (tid == 0)
        s_ok = 1;
    __syncthreads();
    // Every local receiver consumed what this rank wrote into these slots two epochs ago.
    if (tid < S && epoch > 2) {
        const auto* acks = reinterpret_cast<const uint32_t*>(v1_area(peer_bases[rank], area_offset) + kV1AckOffset);
        if (!wait_epoch(acks + tid, epoch - 2, timeout_ns, sink, kPhaseLegacyInternode, rank, tid, 1))
            s_ok = 0;
    }
    __syncthreads();
    if (!s_ok)
        return;
    // The token counts of the rail peers (s, rank), this rank's own at s = domain, into every local receiver's slot.
    for (int i = tid; i < S * N; i += blockDim.x) {
        const int r = i / N, s = i % N;
        const int value = s == domain ? num_tokens : rail_header(rail_base, recv_offset, region_bytes, s)[2];
        v1_slot(peer_bases[r], area_offset, parity, rank, S, slot_words)[kV1SlotCounts + s] = value;
    }

    // Sender side: per channel, this rank's tokens going to each rank (once per rank) and domain (once per domain).
    const int epr = num_experts / R;
    const int64_t width = v1_channel_width(num_tokens, C);
    for (int i = tid; i < R + N; i += blockDim.x)
        s_run[i] = 0;
    for (int c = 0; c < C; ++c) {
        for (int i = tid; i < R + N; i += blockDim.x)
            s_cnt[i] = 0;
        __syncthreads();
        const int64_t begin = c * width, end = min(static_cast<int64_t>(num_tokens), begin + width);
        for (int64_t t = begin + tid; t < end; t += blockDim.x) {
            uint32_t ranks[kV1MaxRanks / 32] = {0u, 0u, 0u, 0u};
            for (int k = 0; k < K; ++k) {
                const int64_t e = topk_idx[t * K + k];
                if (e >= 0 && e < num_experts) {
                    const int r = static_cast<int>(e / epr);
                    ranks[r >> 5] |= 1u << (r & 31);
                }
            }
            uint32_t domains = 0;
            for (int w = 0; w < kV1MaxRanks / 32; ++w) {
                uint32_t bits = ranks[w];
                while (bits) {
                    const int r = w * 32 + __ffs(bits) - 1;
                    bits &= bits - 1;
                    atomicAdd(s_cnt + r, 1);
                    domains |= 1u << (r / S);
                }
            }
            while (domains) {
                const int m = __ffs(domains) - 1;
                domains &= domains - 1;
                atomicAdd(s_cnt + R + m, 1);
            }
        }
        __syncthreads();
        for (int i = tid; i < R + N; i += blockDim.x) {
            s_run[i] += s_cnt[i];
            if (i < R)
                gbl_channel_prefix_matrix[i * C + c] = s_run[i];
            else
                rdma_channel_prefix_matrix[(i - R) * C + c] = s_run[i];
        }
        __syncthreads();
    }

    // Forwarder side: per source domain s, the rows forwarded (own domain: this rank's tokens with an expert here).
    for (int i = tid; i < N * C; i += blockDim.x) {
        const int s = i / C, c = i % C;
        int value;
        if (s == domain) {
            value = rdma_channel_prefix_matrix[domain * C + c];
        } else {
            const int count = min(max(fwd_count[s], 0), static_cast<int>(M));
            const int64_t w = v1_channel_width(rail_header(rail_base, recv_offset, region_bytes, s)[2], C);
            value = v1_count_below(fwd_src + s * M, 1, count, (c + 1) * w);
        }
        recv_rdma_channel_prefix_matrix[i] = value;
    }
    if (tid == 0) {
        int running = 0;
        for (int s = 0; s < N; ++s) {
            running += s == domain ? s_run[R + domain] : min(max(fwd_count[s], 0), static_cast<int>(M));
            recv_rdma_rank_prefix_sum[s] = running;
        }
    }

    // The union rows in order (source domain, then token = the forwarded order): each live row's local-rank bitmask,
    // its row of send_nvl_head (its position among the forwarded rows going to each local rank), and the bitmask
    // into the slot of every local rank it goes to. Counters: 0 = forwarded rows, 1 + r = rows going to rank r.
    if (tid <= S)
        s_base[tid] = 0;
    __syncthreads();
    const int64_t num_union = N * M;
    for (int64_t tile = 0; tile < num_union; tile += blockDim.x) {
        const int64_t u = tile + tid;
        uint32_t mask = 0;
        if (u < num_union) {
            for (int k = 0; k < K; ++k) {
                const int64_t e = union_topk[u * K + k];      // domain-relative: local rank e / epr
                if (e >= 0 && e < static_cast<int64_t>(S) * epr)
                    mask |= 1u << static_cast<int>(e / epr);
            }
        }
        for (int j = 0; j <= S; ++j) {
            const bool on = j == 0 ? mask != 0 : ((mask >> (j - 1)) & 1u) != 0;
            const uint32_t b = __ballot_sync(0xffffffffu, on);
            if (lane == 0)
                s_warp[j][warp] = __popc(b);
        }
        __syncthreads();
        if (tid <= S) {
            int run = s_base[tid];
            for (int w = 0; w < num_warps; ++w) {
                const int c = s_warp[tid][w];
                s_warp[tid][w] = run;
                run += c;
            }
            s_base[tid] = run;
        }
        __syncthreads();
        int row = -1;
        for (int j = 0; j <= S; ++j) {
            const bool on = j == 0 ? mask != 0 : ((mask >> (j - 1)) & 1u) != 0;
            const uint32_t b = __ballot_sync(0xffffffffu, on);
            const int pos = s_warp[j][warp] + __popc(b & ((1u << lane) - 1u));
            if (j == 0) {
                row = on ? pos : -1;
            } else if (row >= 0) {
                if (row < num_nvl_rows)
                    send_nvl_head[static_cast<int64_t>(row) * S + (j - 1)] = on ? pos : -1;
                if (on)
                    v1_slot(peer_bases[j - 1], area_offset, parity, rank, S, slot_words)[kV1SlotMasks + u] = mask;
            }
        }
        __syncthreads();
    }
    for (int64_t i = s_base[0] * static_cast<int64_t>(S) + tid; i < static_cast<int64_t>(num_nvl_rows) * S;
         i += blockDim.x)
        send_nvl_head[i] = -1;
    // Publish this epoch's slots to every local receiver.
    __syncthreads();
    if (tid < S) {
        fence_acq_rel_sys();
        st_release_sys(reinterpret_cast<uint32_t*>(v1_slot(peer_bases[tid], area_offset, parity, rank, S,
                                                           slot_words) + kV1SlotTag), epoch);
    }
}

// Outputs: recv_gbl_rank_prefix_sum [R], recv_gbl_channel_prefix_matrix [R][C] (int32), recv_src_meta [num_rows][2]
// int32 (V1's SourceMeta: source domain, local-rank bitmask; rows past the received count: -1, 0). Reads the rows'
// global source index `src_rank * M + token` (column 0 of `recv_meta`, ascending: DeepEP's deterministic order) and
// the count received (`num_recv`, on the GPU).
__global__ void __launch_bounds__(kV1Threads, 1)
legacy_internode_receive(const int32_t* recv_meta, int64_t meta_stride, int num_rows, const int32_t* num_recv,
                         int num_domains, int num_scaleup, int rank, int num_max_tokens, int num_channels,
                         const uint64_t* peer_bases, uint64_t area_offset, int64_t slot_words,
                         const int32_t* call_words, int32_t* recv_gbl_rank_prefix_sum,
                         int32_t* recv_gbl_channel_prefix_matrix, int32_t* recv_src_meta, int32_t* error_record,
                         uint64_t timeout_ns) {
    __shared__ int s_ok;
    const int tid = threadIdx.x;
    const int S = num_scaleup, R = num_domains * num_scaleup, C = num_channels;
    const int64_t M = num_max_tokens;
    const uint32_t epoch = static_cast<uint32_t>(call_words[0]);
    const int parity = static_cast<int>(epoch & 1u);
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    const uint64_t own = peer_bases[rank];
    if (tid == 0)
        s_ok = 1;
    __syncthreads();
    if (tid < S) {
        const auto* tag = reinterpret_cast<const uint32_t*>(v1_slot(own, area_offset, parity, tid, S, slot_words) +
                                                            kV1SlotTag);
        if (!wait_epoch(tag, epoch, timeout_ns, sink, kPhaseLegacyInternode, rank, tid, 2))
            s_ok = 0;
    }
    __syncthreads();
    if (!s_ok)
        return;
    const int n = min(max(*num_recv, 0), num_rows);
    for (int src = tid; src < R; src += blockDim.x)
        recv_gbl_rank_prefix_sum[src] = v1_count_below(recv_meta, meta_stride, n, (src + 1) * M);
    for (int i = tid; i < R * C; i += blockDim.x) {
        const int src = i / C, c = i % C;
        const volatile int32_t* slot = v1_slot(own, area_offset, parity, src % S, S, slot_words);
        const int64_t w = v1_channel_width(slot[kV1SlotCounts + src / S], C);
        recv_gbl_channel_prefix_matrix[i] = v1_count_below(recv_meta, meta_stride, n, src * M + min(c * w, M));
    }
    for (int i = tid; i < num_rows; i += blockDim.x) {
        int32_t source_domain = -1, mask = 0;
        if (i < n) {
            const int64_t g = recv_meta[i * meta_stride];
            const int src = static_cast<int>(g / M), s = src / S;
            const volatile int32_t* slot = v1_slot(own, area_offset, parity, src % S, S, slot_words);
            source_domain = s;
            mask = slot[kV1SlotMasks + s * M + g % M];
        }
        recv_src_meta[2LL * i] = source_domain;
        recv_src_meta[2LL * i + 1] = mask;
    }
    // Done reading this epoch's slots: tell every forwarder.
    __syncthreads();
    if (tid < S) {
        fence_acq_rel_sys();
        st_release_sys(reinterpret_cast<uint32_t*>(v1_area(peer_bases[tid], area_offset) + kV1AckOffset + rank),
                       epoch);
    }
}

// out_weights [T][K] float32: for slot k, the FP32 sum from +0.0 over the token's domains (in order of their first
// top-k slot) of the domain's in-domain sum (this domain's from the intranode combine's union row, the others' from
// their rail combine rows, which the hybrid combine just received).
__global__ void __launch_bounds__(kV1WeightThreads)
legacy_internode_combine_weights(const int64_t* topk_idx, int num_tokens, int num_topk, int experts_per_domain,
                                 int num_domains, int domain, int num_max_tokens, const int32_t* domain_pos,
                                 const float* combined_weights, int hidden, const uint8_t* rail_base,
                                 uint64_t recv_offset, uint64_t region_bytes, float* out_weights) {
    const int64_t row_bytes = (2LL * hidden + 15) / 16 * 16 + (4LL * num_topk + 15) / 16 * 16;
    const int64_t weights_at = (2LL * hidden + 15) / 16 * 16;
    const int64_t num_experts = static_cast<int64_t>(num_domains) * experts_per_domain;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += gridDim.x * blockDim.x) {
        const int64_t* topk = topk_idx + static_cast<int64_t>(t) * num_topk;
        const float* partial[kV1MaxDomains];
        int num = 0;
        uint32_t seen = 0;
        for (int k = 0; k < num_topk; ++k) {
            if (topk[k] < 0 || topk[k] >= num_experts)
                continue;
            const int m = static_cast<int>(topk[k] / experts_per_domain);
            if ((seen >> m) & 1u)
                continue;
            seen |= 1u << m;
            if (m == domain) {
                partial[num++] = combined_weights + (static_cast<int64_t>(m) * num_max_tokens + t) * num_topk;
            } else {
                const int p = domain_pos[static_cast<int64_t>(t) * num_domains + m];
                partial[num++] = reinterpret_cast<const float*>(rail_base + recv_offset + m * region_bytes +
                                                                kV1HeaderBytes + p * row_bytes + weights_at);
            }
        }
        for (int k = 0; k < num_topk; ++k) {
            float acc = 0.0f;
            for (int i = 0; i < num; ++i)
                acc += partial[i][k];
            out_weights[static_cast<int64_t>(t) * num_topk + k] = acc;
        }
    }
}

}  // namespace deepep
