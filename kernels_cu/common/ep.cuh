// Shared pieces of the EP kernels (notify, dispatch, combine): the control area of the workspace, message layout,
// vector copies, bfloat16 conversions and the send/receive completion protocol.
//
// Control area (byte offset kCtrlOffset of every rank's workspace; uint32 words):
//   local, written only by this rank's kernels (stream-ordered):
//     [0] notify epoch   [1] dispatch data epoch   [2] combine epoch
//     [4] dispatch send ticket   [5] combine send ticket   [6] dispatch recv ticket   [7] combine recv ticket
//     [8] grid barrier arrivals  [9] grid barrier generation
//     ep_fused.cu (the notify and the dispatch in one launch): [10] notify blocks arrived, [11] positions ready
//     (data epoch: every notify block wrote its tokens' slots and positions), [12] layout ready (data epoch: the
//     receive layout is written), [15] blocks that read the data epoch (one rank: block 0 publishes the epoch once
//     every block read it), [1024, 2048) the self-counting receivers' counts (one rank, not expanded): uint64
//     [kFusedMaxCountBlocks], receiving block r's = data epoch << 32 | its count of received tokens
//   signals, written by peers (index = the peer's scale-up rank), epochs that only grow:
//     notify_signal[src]     at +256: src published its counts for notify epoch e into our notify area
//     data_signal[src]       at +384: not written (the dispatch releases chunk by chunk, see below); kSigData
//                            labels the dispatch chunk waits in timeout reports
//     data_consumed[dst]     at +512: dst copied our messages of epoch e out of its slots (we may overwrite them);
//                            notify also waits for it (epoch of our last dispatch) before writing into dst's notify
//                            area: dst is then done reading what we wrote there for its previous notify
//     combine_signal[src]    at +640: src finished writing its combine rows of combine epoch e into our slots
//     combine_consumed[dst]  at +768: dst reduced our rows of combine epoch e (we may overwrite them)
// Notify counts (byte offset kNotifyOffset of the workspace): int32 [src][1 + num_local_experts]:
//   [0] tokens src sends us, [1 + j] (token, slot) pairs src sends to our local expert j.
// Notify rows (byte offset kNotifyRowsOffset of the workspace, same epoch): int32 [src][kNotifyRowWords]:
//   [0, R) tokens src sends to each rank (its whole row of the count matrix: every rank learns the full matrix, for
//   DeepEP V1's rank_prefix_matrix); [kNotifyRowTokens] the tokens src dispatches (its caller's count, which may
//   exceed what it sends when the V1 adapter probes a capacity overflow); [kNotifyRowChannels + c] src's inclusive
//   prefix over its channels of tokens sent to us (V1's channel_prefix_matrix row for us; only when channels are
//   asked for).
// Chunk signals, epochs that only grow, written by peers: combine at kChunkSignalOffset, dispatch at
// kDispatchSignalOffset, each uint32 [src][chunk] (ep_combine.cu, ep_dispatch.cu).
#pragma once
#include "common/timeout.cuh"

namespace deepep {

constexpr uint64_t kCtrlOffset = kWsEPCtrlOffset;        // common/workspace.cuh
constexpr uint64_t kNotifyOffset = kWsEPNotifyOffset;
constexpr uint64_t kChunkSignalOffset = kWsEPChunkSignalOffset;    // combine chunk signals
constexpr uint64_t kChunkSignalBytes = kWsEPChunkSignalBytes;
constexpr int kNotifyMaxRanks = 8, kNotifyMaxLocalExperts = 1024;
constexpr uint64_t kNotifyRowsOffset = kNotifyOffset + 36864;
constexpr int kNotifyMaxChannels = 128;     // DeepEP V1 channels = num_sms / 2
constexpr int kNotifyRowTokens = kNotifyMaxRanks, kNotifyRowChannels = 16;
constexpr int kNotifyRowWords = kNotifyRowChannels + kNotifyMaxChannels;
static_assert(kNotifyOffset + 4 * kNotifyMaxRanks * (1 + kNotifyMaxLocalExperts) <= kNotifyRowsOffset,
              "the notify counts overlap the notify rows");
static_assert(kNotifyRowsOffset + 4 * kNotifyMaxRanks * kNotifyRowWords <= kWsEPNotifyOffset + kWsEPNotifyBytes,
              "the notify rows overflow the notify region");
constexpr uint64_t kDispatchSignalOffset = kWsEPDispatchSignalOffset;    // dispatch chunk signals
constexpr uint64_t kDispatchSignalBytes = kWsEPDispatchSignalBytes;
constexpr int kCtrlNotifyEpoch = 0, kCtrlDataEpoch = 1, kCtrlCombineEpoch = 2;
constexpr int kCtrlDispatchSendTicket = 4, kCtrlCombineSendTicket = 5;
constexpr int kCtrlDispatchRecvTicket = 6, kCtrlCombineRecvTicket = 7;
constexpr int kCtrlGridCount = 8, kCtrlGridGen = 9;
constexpr int kCtrlFusedArrivals = 10, kCtrlFusedPositions = 11, kCtrlFusedLayout = 12;
constexpr int kCtrlFusedStarted = 15, kCtrlFusedCounts = 1024, kFusedMaxCountBlocks = 512;
// Auxiliary words of error records (timeout.cuh) for waits on this rank's own blocks (peer = this rank).
constexpr int kAuxGridBarrier = 1000, kAuxFusedPositions = 1001, kAuxFusedLayout = 1002, kAuxFusedCounts = 1003;
constexpr int kAuxFusedStarted = 1004;
constexpr int kSigNotify = 64, kSigData = 96, kSigDataConsumed = 128, kSigCombine = 160, kSigCombineConsumed = 192;
static_assert((kSigCombineConsumed + 32) * 4 <= kWsEPCtrlBytes, "EP control words overflow their workspace region");
static_assert(kCtrlFusedStarted < kSigNotify, "the local control words overlap the signals");
static_assert(kCtrlFusedCounts >= kSigCombineConsumed + 32 && kCtrlFusedCounts % 2 == 0 &&
              (kCtrlFusedCounts + 2 * kFusedMaxCountBlocks) * 4 <= kWsEPCtrlBytes,
              "the fused receivers' counts must be 8-byte aligned, after the signals, inside the control region");

struct Peers {
    const uint64_t* bases;   // device table of peer base addresses
    int rank;                // scale-up index of this rank
    __device__ __forceinline__ uint8_t* base(int peer) const { return reinterpret_cast<uint8_t*>(bases[peer]); }
    __device__ __forceinline__ uint8_t* local() const { return base(rank); }
    __device__ __forceinline__ uint32_t* ctrl(int peer) const {
        return reinterpret_cast<uint32_t*>(base(peer) + kCtrlOffset);
    }
    __device__ __forceinline__ uint32_t* local_ctrl() const { return ctrl(rank); }
    // Signal slot `kind` of `peer`'s control area that names this rank.
    __device__ __forceinline__ uint32_t* remote_signal(int peer, int kind) const { return ctrl(peer) + kind + rank; }
    __device__ __forceinline__ const uint32_t* my_signal(int kind, int src) const { return local_ctrl() + kind + src; }
    // Combine chunk signal [src][j] in `peer`'s workspace (see ep_combine.cu).
    __device__ __forceinline__ uint32_t* chunk_signal(int peer, int src, int stride, int j) const {
        return reinterpret_cast<uint32_t*>(base(peer) + kChunkSignalOffset) + static_cast<int64_t>(src) * stride + j;
    }
    // Dispatch chunk signal [src][j] in `peer`'s workspace (see ep_dispatch.cu).
    __device__ __forceinline__ uint32_t* dispatch_signal(int peer, int src, int stride, int j) const {
        return reinterpret_cast<uint32_t*>(base(peer) + kDispatchSignalOffset) + static_cast<int64_t>(src) * stride +
               j;
    }
};

// Read a local epoch counter (written by earlier kernels on the stream).
__device__ __forceinline__ uint32_t read_local(const uint32_t* p) { return *reinterpret_cast<const volatile uint32_t*>(p); }

// Add to a counter of this launch's blocks, after this thread's earlier reads and writes (release at GPU scope; no
// return value: a reduction, not a round trip).
__device__ __forceinline__ void red_add_release_gpu(uint32_t* ptr, uint32_t v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(ptr), "r"(v) : "memory");
}

// The last block of a launch to finish gets `true` (after every block published its writes at system scope).
// The ticket is reset by the last block, so launches with different grid sizes can follow each other.
__device__ __forceinline__ bool last_block_done(uint32_t* ticket) {
    __syncthreads();
    __shared__ bool s_last;
    if (threadIdx.x == 0) {
        fence_acq_rel_sys();
        const uint32_t prev = atomicAdd(ticket, 1u);
        s_last = (prev == gridDim.x - 1);
        if (s_last) {
            *reinterpret_cast<volatile uint32_t*>(ticket) = 0;
            fence_acq_rel_sys();
        }
    }
    __syncthreads();
    return s_last;
}

// Software grid barrier of blocks [0, num_blocks) of a launch (all co-resident: a cooperative launch). Bounded: a
// block that waits longer than timeout_ns reports (phase, rank, rank, generation + 1, generation seen,
// kAuxGridBarrier) and gets false (in every thread), as do the others once a timeout was reported.
__device__ __forceinline__ bool grid_sync(uint32_t* ctrl, uint32_t num_blocks, uint64_t timeout_ns,
                                          const ErrorSink& sink, int phase, int rank) {
    __shared__ int s_grid_ok;
    __syncthreads();
    if (threadIdx.x == 0) {
        int ok = 1;
        volatile uint32_t* gen = ctrl + kCtrlGridGen;
        const uint32_t g = *gen;
        __threadfence();
        if (atomicAdd(ctrl + kCtrlGridCount, 1u) == num_blocks - 1) {
            *reinterpret_cast<volatile uint32_t*>(ctrl + kCtrlGridCount) = 0;
            __threadfence();
            atomicExch(ctrl + kCtrlGridGen, g + 1);
        } else {
            const uint64_t start = global_timer_ns();
            for (uint32_t iter = 0; *gen == g; ++iter) {
                if ((iter & 255) == 255) {
                    if (global_timer_ns() - start > timeout_ns) {
                        report_timeout(sink, phase, rank, rank, g + 1, *gen, kAuxGridBarrier);
                        ok = 0;
                        break;
                    }
                    if (timeout_reported(sink)) {
                        ok = 0;
                        break;
                    }
                }
            }
        }
        __threadfence();
        s_grid_ok = ok;
    }
    __syncthreads();
    const bool ok = s_grid_ok != 0;
    __syncthreads();              // s_grid_ok may be rewritten by the next barrier
    return ok;
}

// Threads [0, num_ranks) each wait for one peer's signal of `kind` to reach `epoch`; then the block syncs.
// Returns false (in every thread) if any wait timed out.
__device__ __forceinline__ bool wait_all_peers(const Peers& peers, int kind, int num_ranks, uint32_t epoch,
                                               uint64_t timeout_ns, const ErrorSink& sink, int phase) {
    __shared__ int s_ok;
    if (threadIdx.x == 0)
        s_ok = 1;
    __syncthreads();
    if (threadIdx.x < num_ranks) {
        if (!wait_epoch(peers.my_signal(kind, threadIdx.x), epoch, timeout_ns, sink, phase, peers.rank, threadIdx.x,
                        kind))
            s_ok = 0;
    }
    __syncthreads();
    return s_ok != 0;
}

// Block-wide exclusive prefix sum of one int per thread (blockDim.x a multiple of 32, at most 1024); `total` gets
// the block's sum. Every thread of the block must call it.
__device__ __forceinline__ int block_exclusive_scan(int value, int& total) {
    __shared__ int s_warp[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
    int inclusive = value;
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d)
            inclusive += other;
    }
    if (lane == 31)
        s_warp[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        int w = lane < num_warps ? s_warp[lane] : 0;
        #pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int other = __shfl_up_sync(0xffffffffu, w, d);
            if (lane >= d)
                w += other;
        }
        if (lane < num_warps)
            s_warp[lane] = w;     // inclusive over warps
    }
    __syncthreads();
    total = s_warp[num_warps - 1];
    const int result = inclusive - value + (warp > 0 ? s_warp[warp - 1] : 0);
    __syncthreads();              // s_warp may be reused by the next call
    return result;
}

// ---- vector memory helpers ----------------------------------------------------------------------------------
struct alignas(16) Vec16 {
    uint32_t x, y, z, w;
};

__device__ __forceinline__ Vec16 ld_nc_v4(const void* p) {
    Vec16 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Coherent load (data written by peers during this kernel's lifetime, after an acquire).
__device__ __forceinline__ Vec16 ld_v4(const void* p) {
    Vec16 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ void st_v4(void* p, const Vec16& v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ void st_na_v4(void* p, const Vec16& v) {
    asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Rows split into segments of 16-byte chunks so that few rows still occupy every warp of the grid (decode-size calls
// are latency-bound: a warp per row of 14 KiB walks its row in ~28 dependent steps). Work item w of
// [0, num_rows * num) is row w / num, chunks [seg * len, min(num_chunks, (seg + 1) * len)) with seg = w % num; `len`
// is a multiple of 32 (a full warp step), so with many rows every row is one segment, as before.
struct RowSegments {
    int num;   // segments per row
    int len;   // chunks per segment
    __device__ __forceinline__ RowSegments(int num_rows, int num_chunks, int total_warps) {
        const int max_segs = max(1, (num_chunks + 31) / 32);
        int segs = num_rows > 0 ? min(max_segs, max(1, total_warps / num_rows)) : 1;
        len = max(32, ((num_chunks + segs - 1) / segs + 31) / 32 * 32);
        num = max(1, (num_chunks + len - 1) / len);
    }
    __device__ __forceinline__ int begin(int seg) const { return seg * len; }
    __device__ __forceinline__ int end(int seg, int num_chunks) const { return min(num_chunks, (seg + 1) * len); }
};

// A warp copies `num_bytes` (a multiple of 16, both pointers 16-byte aligned), kCopyUnroll loads in flight per
// lane before the stores (a load followed at once by its store leaves the copy latency-bound).
constexpr int kCopyUnroll = 8;

template <bool kNonCoherentSrc = false>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int num_bytes, int lane) {
    auto* d = reinterpret_cast<uint8_t*>(dst);
    const auto* s = reinterpret_cast<const uint8_t*>(src);
    const int num_chunks = num_bytes / 16;
    for (int base = lane; base < num_chunks; base += 32 * kCopyUnroll) {
        Vec16 v[kCopyUnroll];
        #pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
            if (base + u * 32 < num_chunks)
                v[u] = kNonCoherentSrc ? ld_nc_v4(s + static_cast<int64_t>(base + u * 32) * 16)
                                       : ld_v4(s + static_cast<int64_t>(base + u * 32) * 16);
        #pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
            if (base + u * 32 < num_chunks)
                st_na_v4(d + static_cast<int64_t>(base + u * 32) * 16, v[u]);
    }
}

// Grid-strided copy of `num_vectors` 16-byte vectors: the thread `tid` of `num_threads` takes vectors tid,
// tid + num_threads, ... and keeps kUnroll loads in flight before its stores (a load followed at once by its store
// leaves the copy latency-bound). `load(i)` returns vector i, `store(i, v)` writes it; they pick the cache policy and
// the destination(s).
template <int kUnroll, typename Load, typename Store>
__device__ __forceinline__ void grid_stride_copy(int64_t num_vectors, int64_t tid, int64_t num_threads,
                                                 const Load& load, const Store& store) {
    for (int64_t base = tid; base < num_vectors; base += num_threads * kUnroll) {
        Vec16 v[kUnroll];
        #pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = base + u * num_threads;
            if (i < num_vectors)
                v[u] = load(i);
        }
        #pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = base + u * num_threads;
            if (i < num_vectors)
                store(i, v[u]);
        }
    }
}

// ---- bfloat16 ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ float bf16_lo(uint32_t packed) { return __uint_as_float(packed << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t packed) { return __uint_as_float(packed & 0xffff0000u); }

// Round two floats to bfloat16 (round to nearest even, as torch does) and pack them (lo in the low half).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Accumulate the 8 bfloat16 values of a 16-byte vector into 8 floats.
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const Vec16& v) {
    acc[0] += bf16_lo(v.x); acc[1] += bf16_hi(v.x);
    acc[2] += bf16_lo(v.y); acc[3] += bf16_hi(v.y);
    acc[4] += bf16_lo(v.z); acc[5] += bf16_hi(v.z);
    acc[6] += bf16_lo(v.w); acc[7] += bf16_hi(v.w);
}

__device__ __forceinline__ Vec16 round_bf16x8(const float (&acc)[8]) {
    return {pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]), pack_bf16x2(acc[4], acc[5]),
            pack_bf16x2(acc[6], acc[7])};
}

// ---- top-k buckets ------------------------------------------------------------------------------------------------
// The EP kernels are compiled for a top-k bucket kMaxTopk (1, 2, 4, 8, 16 or 32; deepep_cupy/features/ep/kernels.py
// topk_bucket) and take the exact top-k, 1 <= num_topk <= kMaxTopk, at run time: per-slot arrays and unrolled loops
// span the bucket, and slots k >= num_topk hold no expert (lane k of a warp holds -1 there, and its bit is clear in
// every per-slot ballot), so they change nothing. Every stride and size uses num_topk.

// The destination ranks of one token in order of first top-k appearance: a token's combine slots (local reduce) are
// numbered in this order, by the dispatch epilogue (metadata column 1) and by the origin of the combine alike. Lane
// k < num_topk holds `owner`, the rank owning top-k slot k's expert (-1: none); lanes k >= num_topk hold -1. Every
// lane of the warp calls it.
struct TopkOwners {
    bool first;        // this lane's slot is its owner's first
    bool last;         // this lane's slot is its owner's last (a rank's reduced row enters the origin's sum there)
    int first_k;       // the first slot of this lane's owner (this lane without an owner)
    uint32_t firsts;   // lanes holding their owner's first slot
    // The combine slot of the owner whose first top-k slot is `k`: the number of distinct owners before it.
    __device__ __forceinline__ int ordinal(int k) const { return __popc(firsts & ((1u << k) - 1)); }
};

template <int kMaxTopk>
__device__ __forceinline__ TopkOwners topk_owners(int owner, int lane, int num_topk) {
    TopkOwners o{owner >= 0, owner >= 0, lane, 0u};
    for (int k2 = 0; k2 < kMaxTopk; ++k2) {
        const int o2 = __shfl_sync(0xffffffffu, owner, k2);
        if (o2 == owner && owner >= 0) {
            if (k2 < lane) {
                o.first = false;
                o.first_k = min(o.first_k, k2);
            }
            if (k2 > lane)
                o.last = false;
        }
    }
    o.firsts = __ballot_sync(0xffffffffu, o.first && lane < num_topk);
    return o;
}

// A rank's reduced partial of one token, 16 bytes (8 elements) at chunk c: the bfloat16 rows of x picked by `mask`
// (bit k: top-k slot k; row_of(k) its row of x, every bit at or above num_topk clear) summed in FP32 in ascending k,
// rounded to bfloat16 once. The combine's senders send it; the origin computes its own partial with it: both sides
// agree bit for bit. `mask` is warp-uniform (row_of may shuffle).
template <int kMaxTopk, typename RowOf>
__device__ __forceinline__ Vec16 sum_local_rows(const uint8_t* x, int row_bytes, int c, uint32_t mask,
                                                const RowOf& row_of) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    // Loads in batches of 8 rows before the additions (kept in ascending k order).
    #pragma unroll
    for (int k0 = 0; k0 < kMaxTopk; k0 += 8) {
        Vec16 v[8];
        #pragma unroll
        for (int u = 0; u < 8; ++u)
            if (k0 + u < kMaxTopk && ((mask >> (k0 + u)) & 1u))
                v[u] = ld_nc_v4(x + static_cast<int64_t>(row_of(k0 + u)) * row_bytes + c * 16);
        #pragma unroll
        for (int u = 0; u < 8; ++u)
            if (k0 + u < kMaxTopk && ((mask >> (k0 + u)) & 1u))
                add_bf16x8(acc, v[u]);
    }
    return round_bf16x8(acc);
}

// Combine slots at a token's origin (ep_combine.cu): [token][num_slots] rows of [hidden bfloat16, padded to 16 bytes |
// num_topk float32 weights, padded to 16 bytes]. deepep_cupy/features/ep/layout.py combine_slot_bytes is the host's
// copy of the row size.
struct CombineSlots {
    int num_slots;
    int weights_offset;    // bytes from a slot's start to its weights
    int bytes;             // bytes per slot
    __device__ __forceinline__ CombineSlots(int num_slots_, int hidden, int num_topk)
        : num_slots(num_slots_), weights_offset((hidden * 2 + 15) / 16 * 16),
          bytes((hidden * 2 + 15) / 16 * 16 + (4 * num_topk + 15) / 16 * 16) {}
    // Slot `s` of token `t` in the slot area starting at `slots`.
    __device__ __forceinline__ uint8_t* slot(uint8_t* slots, int t, int s) const {
        return slots + (static_cast<int64_t>(t) * num_slots + s) * bytes;
    }
    // The first slot of token `t`.
    __device__ __forceinline__ const uint8_t* token(const uint8_t* slots, int t) const {
        return slots + static_cast<int64_t>(t) * num_slots * bytes;
    }
};

// ---- dispatch message layout ------------------------------------------------------------------------------------
// [src token index | global expert ids (K) | weights (K) | position among the source's tokens of that expert (K)]
// padded to 16 bytes, then scale factors, then hidden bytes.
struct MessageLayout {
    int num_topk;
    int meta_bytes;
    int sf_offset;
    int hidden_offset;
    int bytes;
    __device__ __forceinline__ MessageLayout(int num_topk_, int num_sf, int hidden_bytes) : num_topk(num_topk_) {
        meta_bytes = (4 + 12 * num_topk + 15) / 16 * 16;
        sf_offset = meta_bytes;
        hidden_offset = sf_offset + (4 * num_sf + 15) / 16 * 16;
        bytes = hidden_offset + (hidden_bytes + 15) / 16 * 16;
    }
    __device__ __forceinline__ int32_t* src_idx(uint8_t* msg) const { return reinterpret_cast<int32_t*>(msg); }
    __device__ __forceinline__ int32_t* expert_ids(uint8_t* msg) const { return reinterpret_cast<int32_t*>(msg) + 1; }
    __device__ __forceinline__ float* weights(uint8_t* msg) const {
        return reinterpret_cast<float*>(msg) + 1 + num_topk;
    }
    __device__ __forceinline__ int32_t* expert_pos(uint8_t* msg) const {
        return reinterpret_cast<int32_t*>(msg) + 1 + 2 * num_topk;
    }
};

// ---- receive layout blob ----------------------------------------------------------------------------------------
// Written by the notify kernel into a handle tensor; read by the dispatch epilogue and combine (int32 words):
//   [0, R)                 psum_src: inclusive prefix over sources of tokens received
//   [R, R+L)               count: (token, slot) pairs received per local expert (unaligned)
//   [R+L, R+2L)            start: first expanded row of each local expert (aligned)
//   [R+2L, R+2L+R*L)       src_base: exclusive prefix over sources of each expert's pairs ([src][expert])
//   [R+2L+R*L]             num_recv_tokens, then num_expanded_tokens
struct RecvLayout {
    int32_t* blob;
    int num_ranks, num_local_experts;
    __device__ __forceinline__ int32_t* psum_src() const { return blob; }
    __device__ __forceinline__ int32_t* count() const { return blob + num_ranks; }
    __device__ __forceinline__ int32_t* start() const { return blob + num_ranks + num_local_experts; }
    __device__ __forceinline__ int32_t* src_base() const { return blob + num_ranks + 2 * num_local_experts; }
    __device__ __forceinline__ int32_t* totals() const {
        return blob + num_ranks + 2 * num_local_experts + num_ranks * num_local_experts;
    }
};

}  // namespace deepep
