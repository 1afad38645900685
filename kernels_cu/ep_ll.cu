// Low-latency (decode) EP dispatch and combine: DeepEP V1's `low_latency_dispatch` / `low_latency_combine` over
// NVLink (CUDA IPC), fixed worst-case buffers, no CPU sync, CUDA-graph capturable.
//
// Every kernel runs one or both phases (`phases`: kSend = 1, kRecv = 2). Without a receive hook one launch runs
// both (send, then receive in the same blocks; grid <= SMs, every block co-resident); with a hook the send launch
// returns once the stores are issued and the hook's launch receives.
//
// Engine region (byte `region_offset` of every rank's symmetric buffer; deepep_cupy/features/ll.py builds the layout
// and passes the offsets):
//   [0, 4096)  control words (uint32, below)
//   half h (h = 0, 1) at 4096 + h * half_bytes:  (dispatch call n uses half n & 1, combine call c half c & 1)
//     counts  uint64 [E][R]      (j * R + s): (n << 32) | tokens source s sends to our local expert j in call n
//     cflags  uint32 [M*K][nseg] combine: epoch c once row (t, k) segment g from the owner of t's slot k landed
//     lists   int32  [E][M]      ((j * R + s) * M + i): (t << 5) | k of the i-th token s sends to expert j
//     dslots  [R][M] messages    dispatch: [flags (nseg uint32) | hidden (FP8 H or BF16 2H bytes) | FP8 scales]
//     cslots  [M*K] rows of 2H   combine: bfloat16 row of token t, top-k slot k (index t * K + k)
//   staging (zero-copy combine input), written by the caller, read by the combine send phase.
// Here M, E, nseg are the engine's maxima (strides), K the call's top-k; a segment = 512 channels.
//
// Control words (index into uint32 [1024]):
//   local, written only by this rank's kernels (stream-ordered):
//     [0] dispatch calls  [1] combine calls  [2..5] last-block tickets  [6] clean-barrier calls
//     [16 + r] mask of rank r (int32; the host and timed-out waits in shrink mode set it)
//   signals, written by peer s (epochs that only grow, so nothing is ever cleared between calls):
//     [64 + 8h + s]  s received (copied out) our dispatch messages of call n in half h: value n
//     [96 + 8h + s]  s reduced our combine rows of call c in half h: value c
//     [128 + s]      s reached clean barrier b: value b
//
// Dispatch call n (h = n & 1), at sender `me`:
//   - wait dispatch_consumed[h][d] >= n - 2 from every live destination d (it copied our messages of the previous
//     call that used half h out); at most two calls in flight per rank, a third waits (and times out: no silent
//     overwrite);
//   - a warp per global expert e = (d, j) scans topk_idx (ballots over 32 entries: deterministic token order), writes
//     the list entries into d's lists[h][j][me][*] and our send_pos[t][k], then releases counts[h][j][me] at d;
//   - a warp per (token t, part of its segments) reads x once, casts to FP8 (per 128 channels) if asked, stores the
//     part into message slot [me][t] of every live destination rank owning one of t's experts (once per rank, not
//     per expert), then releases the part's segment flags (value n) at each.
//   At receiver `me`: waits every live source's count words; row (j, r) of the masked layout is, in ascending source
//   order, then in the source's token order, list entry i of source s (begin_s = sum of the counts of sources < s);
//   each row part waits for its message's segment flags and copies hidden bytes and scales out; the last block
//   releases dispatch_consumed[h][me] = n at every source. One launch: our own tokens skip the message slots (the
//   receiver casts straight from x).
// Combine call c (hc = c & 1): owner d waits combine_consumed[hc][s] >= c - 2 from every origin s, copies each row
// (j, r) it received into cslots[hc][t * K + k] at the row's origin s and releases the row's segment flags (value c);
// origin waits the flags of each (token, slot, segment) it needs and reduces in FP32 in ascending k
// (acc = fma(w_k, row_k, acc): one rounding per step, DeepEP v1.2.1's fused multiply-add), rounds to bfloat16 once;
// the last block releases combine_consumed[hc][me] = c at every owner. One launch: rows of our own experts are read
// straight from x.
// Masks: a masked rank is neither sent to nor waited for (slots of a masked owner add nothing).
//
// Measurement hooks (perf/ll_variants.py compiles variants of these kernels with -D values and times them beside the
// shipped ones; without a -D every value below is the shipped kernel's):
//   DEEPEP_LL_MIN_BLOCKS      dispatch / combine blocks per SM in __launch_bounds__ (the variant's launcher
//                             launches that many per SM: every block stays co-resident);
//   DEEPEP_LL_SEG_BATCH       segments each lane loads before it converts any (kSegBatch);
//   DEEPEP_LL_GPU_SCOPE       1: signals acquire / release at GPU scope (valid only while every rank is on one GPU);
//   DEEPEP_LL_PROBE_NO_DATA   1: the receive phases move no row bytes (dispatch: no cast or copy, combine: no
//                             reduction; outputs invalid): the time of everything else, for leave-one-out timing;
//   DEEPEP_LL_OWN_TOKENS      1: one launch receives our own tokens by token, not by row: a warp per (token, part)
//                             reads x once, casts once and stores into each of the token's rows at our experts
//                             (shipped: a warp per row, each reading and casting its token again);
//   DEEPEP_LL_PART_SEGS       segments per warp item (row part or token part) in every phase (shipped: 0, as many
//                             parts per row as keep every warp busy).
#include "common/ep.cuh"
#include "common/ll_fp8.cuh"

#ifndef DEEPEP_LL_MIN_BLOCKS
#define DEEPEP_LL_MIN_BLOCKS 1
#endif
#ifndef DEEPEP_LL_SEG_BATCH
#define DEEPEP_LL_SEG_BATCH 4
#endif
#ifndef DEEPEP_LL_GPU_SCOPE
#define DEEPEP_LL_GPU_SCOPE 0
#endif
#ifndef DEEPEP_LL_PROBE_NO_DATA
#define DEEPEP_LL_PROBE_NO_DATA 0
#endif
#ifndef DEEPEP_LL_OWN_TOKENS
#define DEEPEP_LL_OWN_TOKENS 0
#endif
#ifndef DEEPEP_LL_PART_SEGS
#define DEEPEP_LL_PART_SEGS 0
#endif

namespace deepep {
namespace ll {

// Signal loads and stores (system scope: the peers are other GPUs; see DEEPEP_LL_GPU_SCOPE above).
template <typename T>
__device__ __forceinline__ T acquire(const T* flag) {
#if DEEPEP_LL_GPU_SCOPE
    return ld_acquire_gpu(flag);
#else
    return ld_acquire_sys(flag);
#endif
}
template <typename T>
__device__ __forceinline__ void release(T* flag, T value) {
#if DEEPEP_LL_GPU_SCOPE
    st_release_gpu(flag, value);
#else
    st_release_sys(flag, value);
#endif
}

constexpr int kThreads = 512;
constexpr int kNumWarps = kThreads / 32;
constexpr int kSend = 1, kRecv = 2;
constexpr int kSegChannels = 512;             // channels per flag segment (one UE8M0 int32 of 4 scale bytes)
constexpr int kControlWords = 1024;                 // uint32 control words at the start of the region
constexpr int kControlBytes = kControlWords * 4;
constexpr int kScanUnroll = 8;

constexpr int kCtlDispatchCalls = 0, kCtlCombineCalls = 1;
constexpr int kCtlDispatchSendTicket = 2, kCtlDispatchRecvTicket = 3;
constexpr int kCtlCombineSendTicket = 4, kCtlCombineRecvTicket = 5;
constexpr int kCtlBarrierCalls = 6;
constexpr int kCtlMask = 16, kCtlDispatchConsumed = 64, kCtlCombineConsumed = 96, kCtlBarrier = 128;

// `aux` of error records: what the waiting thread waited for (deepep_cupy/features/ll.py WAIT_KINDS mirrors it).
constexpr int kAuxDispatchConsumed = 101, kAuxCounts = 102, kAuxMessage = 103;
constexpr int kAuxCombineConsumed = 104, kAuxRows = 105, kAuxBarrier = 106;

struct Region {
    const uint64_t* bases;
    uint64_t offset;
    __device__ __forceinline__ uint8_t* at(int peer) const { return reinterpret_cast<uint8_t*>(bases[peer] + offset); }
    __device__ __forceinline__ uint32_t* ctl(int peer) const { return reinterpret_cast<uint32_t*>(at(peer)); }
};

// Who waits and what a failed wait does: with shrink the silent peer gets masked, else the timeout is reported.
struct Waiter {
    int32_t* mask;
    ErrorSink sink;
    uint64_t timeout_ns;
    int rank, phase;
    bool shrink;
};

__device__ __forceinline__ uint32_t epoch_of(uint32_t v) { return v; }
__device__ __forceinline__ uint32_t epoch_of(uint64_t v) { return static_cast<uint32_t>(v >> 32); }

__device__ __forceinline__ bool is_masked(const int32_t* mask, int r) {
    return *reinterpret_cast<const volatile int32_t*>(mask + r) != 0;
}

// Spin until the epoch of `*flag` (the high word of a 64-bit count word) reaches `target`; `value` gets the last
// value read and `cycles` (if not null) the clock cycles spent. Returns false if `peer` is or becomes masked, after
// a timeout (see Waiter), or once another thread reported a timeout.
template <typename T>
__device__ __noinline__ bool wait_signal_slow(const T* flag, uint32_t target, const Waiter& w, int peer, int aux,
                                              T& value, uint64_t* cycles) {
    const uint64_t start = global_timer_ns();
    const long long c0 = clock64();
    bool ok = false;
    for (uint32_t iter = 0;; ++iter) {
        value = acquire(flag);
        if (epoch_reached(epoch_of(value), target)) {
            ok = true;
            break;
        }
        if ((iter & 127) == 127) {
            if (is_masked(w.mask, peer))
                break;
            if (global_timer_ns() - start > w.timeout_ns) {
                if (w.shrink)
                    atomicExch(w.mask + peer, 1);
                else
                    report_timeout(w.sink, w.phase, w.rank, peer, target, epoch_of(value), aux);
                break;
            }
            if (!w.shrink && timeout_reported(w.sink))
                break;
        }
    }
    if (cycles != nullptr)
        *cycles += static_cast<uint64_t>(clock64() - c0);
    return ok;
}

template <typename T>
__device__ __forceinline__ bool wait_signal(const T* flag, uint32_t target, const Waiter& w, int peer, int aux,
                                            T& value, uint64_t* cycles) {
    value = acquire(flag);
    return epoch_reached(epoch_of(value), target) || wait_signal_slow(flag, target, w, peer, aux, value, cycles);
}

__device__ __forceinline__ uint32_t read_mask_bits(const int32_t* mask, int num_ranks) {
    uint32_t bits = 0;
    for (int r = 0; r < num_ranks; ++r)
        bits |= is_masked(mask, r) ? (1u << r) : 0u;
    return bits;
}

// Parts of a row of `num_segs` segments: as many parts per row as keep every warp busy, whole segments each (a
// part never splits a flag segment).
struct Parts {
    int num, segs;   // parts per row, segments per part
    __device__ __forceinline__ Parts(int num_rows, int num_segs, int total_warps) {
        const int want = num_rows > 0 ? max(1, min(num_segs, total_warps / num_rows)) : 1;
        segs = DEEPEP_LL_PART_SEGS > 0 ? min(num_segs, DEEPEP_LL_PART_SEGS) : (num_segs + want - 1) / want;
        num = (num_segs + segs - 1) / segs;
    }
};

// FP8 (cast_fp8_lane, e4m3x2, ue8m0_byte, kFp8Max, kAmaxClamp): common/ll_fp8.cuh, shared with
// legacy_internode_ll.cu.

// Scale output (column-major in the last two dims, as DeepEP): float [L][S][T] at (j * S + p) * T + r, or packed
// UE8M0 int32 [L][S / 4][T] at (j * S / 4 + g) * T + r, byte q of the int = group 4g + q.
struct ScaleOut {
    void* ptr;
    int num_scales, num_rows;   // S = hidden / 128, T
    bool ue8m0;
    __device__ __forceinline__ void put_float(int j, int p, int r, float v) const {
        static_cast<float*>(ptr)[(static_cast<int64_t>(j) * num_scales + p) * num_rows + r] = v;
    }
    __device__ __forceinline__ void put_packed(int j, int g, int r, uint32_t v) const {
        static_cast<uint32_t*>(ptr)[(static_cast<int64_t>(j) * (num_scales / 4) + g) * num_rows + r] = v;
    }
};

// Segments in flight per lane: a lane loads 32 bytes of each segment, all before it converts any.
constexpr int kSegBatch = DEEPEP_LL_SEG_BATCH;

// The lane's 16 channels of segments [g0, g0 + kSegBatch) ∩ [g0, seg_end) of bfloat16 row `src` (zeros past hidden).
__device__ __forceinline__ void load_segments(const uint8_t* src, int hidden, int g0, int seg_end, int lane,
                                              Vec16 (&v0)[kSegBatch], Vec16 (&v1)[kSegBatch]) {
    #pragma unroll
    for (int u = 0; u < kSegBatch; ++u) {
        const int c0 = (g0 + u) * kSegChannels + lane * 16;
        v0[u] = v1[u] = {0, 0, 0, 0};
        if (g0 + u < seg_end && c0 < hidden) {
            v0[u] = ld_nc_v4(src + static_cast<int64_t>(c0) * 2);
            v1[u] = ld_nc_v4(src + static_cast<int64_t>(c0) * 2 + 16);
        }
    }
}

// The FP8 (or BF16) bytes and scales of segments [seg_begin, seg_end) of token row `src` (bfloat16 x), cast here,
// into output row (j, r). Every lane of the warp calls it.
__device__ __forceinline__ void cast_row_part(const uint8_t* src, int hidden, bool use_fp8, bool round_scale,
                                              int seg_begin, int seg_end, uint8_t* dst_row, const ScaleOut& sf,
                                              int j, int r, int lane) {
    for (int g0 = seg_begin; g0 < seg_end; g0 += kSegBatch) {
        Vec16 v0[kSegBatch], v1[kSegBatch];
        load_segments(src, hidden, g0, seg_end, lane, v0, v1);
        #pragma unroll
        for (int u = 0; u < kSegBatch; ++u) {
            const int g = g0 + u;
            if (g >= seg_end)
                break;
            const int c0 = g * kSegChannels + lane * 16;
            const bool active = c0 < hidden;
            if (!use_fp8) {
                if (active) {
                    st_na_v4(dst_row + static_cast<int64_t>(c0) * 2, v0[u]);
                    st_na_v4(dst_row + static_cast<int64_t>(c0) * 2 + 16, v1[u]);
                }
                continue;
            }
            float scale_inv;
            const Vec16 q = cast_fp8_lane(v0[u], v1[u], round_scale, scale_inv);
            if (active)
                st_na_v4(dst_row + c0, q);
            if (!sf.ue8m0) {
                if (active && lane % 8 == 0)
                    sf.put_float(j, c0 / 128, r, scale_inv);
            } else {
                const uint32_t e = ue8m0_byte(scale_inv);
                const uint32_t packed = __shfl_sync(0xffffffffu, e, 0) | (__shfl_sync(0xffffffffu, e, 8) << 8) |
                                        (__shfl_sync(0xffffffffu, e, 16) << 16) |
                                        (__shfl_sync(0xffffffffu, e, 24) << 24);
                if (lane == 0)
                    sf.put_packed(j, g, r, packed);
            }
        }
    }
}

// Segments [seg_begin, seg_end) of token row `src` (bfloat16 x), cast once, into the output rows of the top-k slots
// in `rows` (bit k: slot k has a row here; lane k holds its expert `j` and row `r`). Every lane of the warp calls it.
__device__ __forceinline__ void cast_token_part(const uint8_t* src, int hidden, bool use_fp8, bool round_scale,
                                                int seg_begin, int seg_end, uint8_t* recv_x, int out_row_bytes,
                                                int num_rows_out, const ScaleOut& sf, uint32_t rows, int j, int r,
                                                int lane) {
    for (int g0 = seg_begin; g0 < seg_end; g0 += kSegBatch) {
        Vec16 v0[kSegBatch], v1[kSegBatch];
        load_segments(src, hidden, g0, seg_end, lane, v0, v1);
        #pragma unroll
        for (int u = 0; u < kSegBatch; ++u) {
            const int g = g0 + u;
            if (g >= seg_end)
                break;
            const int c0 = g * kSegChannels + lane * 16;
            const bool active = c0 < hidden;
            float scale_inv = 0.f;
            Vec16 q = v0[u];
            uint32_t packed = 0;
            if (use_fp8) {
                q = cast_fp8_lane(v0[u], v1[u], round_scale, scale_inv);
                if (sf.ue8m0) {
                    const uint32_t e = ue8m0_byte(scale_inv);
                    packed = __shfl_sync(0xffffffffu, e, 0) | (__shfl_sync(0xffffffffu, e, 8) << 8) |
                             (__shfl_sync(0xffffffffu, e, 16) << 16) | (__shfl_sync(0xffffffffu, e, 24) << 24);
                }
            }
            for (uint32_t left = rows; left != 0; left &= left - 1) {
                const int k = __ffs(left) - 1;
                const int jk = __shfl_sync(0xffffffffu, j, k), rk = __shfl_sync(0xffffffffu, r, k);
                uint8_t* dst_row = recv_x + (static_cast<int64_t>(jk) * num_rows_out + rk) * out_row_bytes;
                if (!use_fp8) {
                    if (active) {
                        st_na_v4(dst_row + static_cast<int64_t>(c0) * 2, v0[u]);
                        st_na_v4(dst_row + static_cast<int64_t>(c0) * 2 + 16, v1[u]);
                    }
                    continue;
                }
                if (active)
                    st_na_v4(dst_row + c0, q);
                if (!sf.ue8m0) {
                    if (active && lane % 8 == 0)
                        sf.put_float(jk, c0 / 128, rk, scale_inv);
                } else if (lane == 0) {
                    sf.put_packed(jk, g, rk, packed);
                }
            }
        }
    }
}

// Block-wide exclusive prefix sum of `values[0, n)` in place (any n); values[n] gets the total.
__device__ __forceinline__ void block_scan_inplace(int32_t* values, int n) {
    int carry = 0;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const int v = i < n ? values[i] : 0;
        int total;
        const int ex = block_exclusive_scan(v, total);
        if (i < n)
            values[i] = carry + ex;
        carry += total;
    }
    if (threadIdx.x == 0)
        values[n] = carry;
    __syncthreads();
}

// Largest j in [0, n) with row_base[j] <= g (row_base ascending, row_base[0] = 0 <= g).
__device__ __forceinline__ int find_expert(const int32_t* row_base, int n, int g) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (row_base[mid] <= g)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

// Per-source wait cycles of this block, flushed into the user's int64 [R] stats at the end.
template <int kNumRanks>
__device__ __forceinline__ void flush_wait_stats(const uint64_t* s_wait, int64_t* stats) {
    __syncthreads();
    if (stats != nullptr && threadIdx.x < kNumRanks && s_wait[threadIdx.x] != 0)
        atomicAdd(reinterpret_cast<unsigned long long*>(stats + threadIdx.x), s_wait[threadIdx.x]);
}

// ---- dispatch -----------------------------------------------------------------------------------------------------
template <int kNumRanks>
__global__ void __launch_bounds__(kThreads, DEEPEP_LL_MIN_BLOCKS)
dispatch(const uint8_t* x, const int64_t* topk_idx, int num_tokens, int num_topk, int hidden, int num_experts,
         int num_max_tokens, int use_fp8, int round_scale, int use_ue8m0,
         uint8_t* recv_x, void* recv_sf, int32_t* recv_count, int32_t* src_info, int64_t* layout_range,
         int32_t* row_route, int32_t* send_pos, int32_t* call_info, int32_t* cumulative_stats, int64_t* wait_stats,
         const uint64_t* peer_bases, int rank, uint64_t region_offset, uint64_t half_bytes, uint64_t lists_offset,
         uint64_t dslots_offset, int slot_tokens, int msg_bytes, int msg_hidden_offset, int shrink, int phases,
         int32_t* error_record, uint64_t timeout_ns) {
    extern __shared__ int32_t smem[];   // receive: count [E], begin [E], row_base [L + 1]
    __shared__ uint32_t s_masked;
    __shared__ uint64_t s_wait[kNumRanks];
    const Region region{peer_bases, region_offset};
    uint32_t* ctl = region.ctl(rank);
    int32_t* mask = reinterpret_cast<int32_t*>(ctl + kCtlMask);
    const Waiter waiter{mask, make_error_sink(peer_bases, rank, error_record), timeout_ns, rank, kPhaseDispatch,
                        shrink != 0};
    const int L = num_experts / kNumRanks;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int total_warps = gridDim.x * kNumWarps, global_warp = blockIdx.x * kNumWarps + warp;
    const bool direct = (phases & kSend) && (phases & kRecv);
    const int num_segs = (hidden + kSegChannels - 1) / kSegChannels;
    const int out_row_bytes = use_fp8 ? hidden : hidden * 2;
    const int scale_offset = msg_hidden_offset + hidden;   // FP8 messages: float scales after the hidden bytes
    const int num_rows_out = kNumRanks * num_max_tokens;   // T
    uint32_t n = (phases & kSend) ? read_local(ctl + kCtlDispatchCalls) + 1
                                  : static_cast<uint32_t>(*reinterpret_cast<volatile int32_t*>(call_info));
    const int h = n & 1;
    const uint64_t half = kControlBytes + h * half_bytes;
    // Message slot [s][t] of half h at `peer`.
    const auto message = [&](int peer, int s, int t) {
        return region.at(peer) + half + dslots_offset + (static_cast<int64_t>(s) * slot_tokens + t) * msg_bytes;
    };
    if (threadIdx.x < kNumRanks)
        s_wait[threadIdx.x] = 0;
    if (threadIdx.x == 0)
        s_masked = read_mask_bits(mask, kNumRanks);
    __syncthreads();

    if (phases & kSend) {
        if (blockIdx.x == 0 && threadIdx.x == 0)
            *call_info = static_cast<int32_t>(n);
        // Every live destination copied out our messages of the previous call in this half.
        bool ok = true;
        if (threadIdx.x < kNumRanks && !((s_masked >> threadIdx.x) & 1u)) {
            uint32_t seen;
            ok = wait_signal(ctl + kCtlDispatchConsumed + 8 * h + threadIdx.x, n - 2, waiter, threadIdx.x,
                             kAuxDispatchConsumed, seen, nullptr) || waiter.shrink;
        }
        if (__syncthreads_or(!ok))
            return;
        if (threadIdx.x == 0)
            s_masked = read_mask_bits(mask, kNumRanks);
        __syncthreads();
        const uint32_t live = ~s_masked;

        const int total_topk = num_tokens * num_topk;
        const Parts parts(num_tokens, num_segs, max(1, total_warps - num_experts));
        const int num_items = num_experts + num_tokens * parts.num;
        for (int item = global_warp; item < num_items; item += total_warps) {
            if (item < num_experts) {
                // Expert scan: every (t, k) with topk_idx[t][k] == e in (t, k) order.
                const int e = item, d = e / L, j = e - d * L;
                const bool to_live = (live >> d) & 1u;
                int32_t* list = reinterpret_cast<int32_t*>(region.at(d) + half + lists_offset) +
                                (static_cast<int64_t>(j) * kNumRanks + rank) * slot_tokens;
                int count = 0;
                for (int base = 0; base < total_topk; base += 32 * kScanUnroll) {
                    int64_t v[kScanUnroll];
                    #pragma unroll
                    for (int u = 0; u < kScanUnroll; ++u) {
                        const int i = base + u * 32 + lane;
                        v[u] = i < total_topk ? __ldg(topk_idx + i) : -1;
                    }
                    #pragma unroll
                    for (int u = 0; u < kScanUnroll; ++u) {
                        const int i = base + u * 32 + lane;
                        const bool hit = v[u] == e;
                        const uint32_t ballot = __ballot_sync(0xffffffffu, hit);
                        if (hit) {
                            const int pos = count + __popc(ballot & ((1u << lane) - 1u));
                            const int t = i / num_topk, k = i - t * num_topk;
                            // A token listing one expert twice could overflow the block: extra entries are dropped.
                            const bool kept = to_live && pos < num_max_tokens;
                            if (kept)
                                list[pos] = (t << 5) | k;
                            send_pos[i] = kept ? pos : -1;
                        }
                        count += __popc(ballot);
                    }
                }
                __syncwarp();
                if (lane == 0 && to_live) {
                    uint64_t* word = reinterpret_cast<uint64_t*>(region.at(d) + half) +
                                     static_cast<int64_t>(j) * kNumRanks + rank;
                    release(word, (static_cast<uint64_t>(n) << 32) | static_cast<uint32_t>(
                                             min(count, num_max_tokens)));
                }
                continue;
            }
            // Token part: read once, cast once, store into every destination rank's slot [me][t].
            const int tp = item - num_experts, t = tp / parts.num, part = tp - t * parts.num;
            const int seg_begin = part * parts.segs, seg_end = min(num_segs, seg_begin + parts.segs);
            const int64_t v = lane < num_topk ? __ldg(topk_idx + static_cast<int64_t>(t) * num_topk + lane) : -1;
            const bool valid = v >= 0 && v < num_experts;
            if (part == 0 && lane < num_topk && !valid)
                send_pos[static_cast<int64_t>(t) * num_topk + lane] = -1;
            uint32_t dest = __reduce_or_sync(0xffffffffu, valid ? (1u << (static_cast<int>(v) / L)) : 0u) & live;
            if (direct)
                dest &= ~(1u << rank);   // the receive phase casts our own tokens straight from x
            if (dest == 0)
                continue;
            const uint8_t* src = x + static_cast<int64_t>(t) * hidden * 2;
            for (int g0 = seg_begin; g0 < seg_end; g0 += kSegBatch) {
                Vec16 v0[kSegBatch], v1[kSegBatch];
                load_segments(src, hidden, g0, seg_end, lane, v0, v1);
                #pragma unroll
                for (int u = 0; u < kSegBatch; ++u) {
                    if (g0 + u >= seg_end)
                        break;
                    const int c0 = (g0 + u) * kSegChannels + lane * 16;
                    const bool active = c0 < hidden;
                    if (use_fp8) {
                        float scale_inv;
                        const Vec16 q = cast_fp8_lane(v0[u], v1[u], round_scale != 0, scale_inv);
                        #pragma unroll
                        for (int d = 0; d < kNumRanks; ++d) {
                            if (!((dest >> d) & 1u) || !active)
                                continue;
                            uint8_t* m = message(d, rank, t);
                            st_na_v4(m + msg_hidden_offset + c0, q);
                            if (lane % 8 == 0)
                                reinterpret_cast<float*>(m + scale_offset)[c0 / 128] = scale_inv;
                        }
                    } else {
                        #pragma unroll
                        for (int d = 0; d < kNumRanks; ++d) {
                            if (!((dest >> d) & 1u) || !active)
                                continue;
                            uint8_t* m = message(d, rank, t) + msg_hidden_offset + static_cast<int64_t>(c0) * 2;
                            st_na_v4(m, v0[u]);
                            st_na_v4(m + 16, v1[u]);
                        }
                    }
                }
            }
            // The part is written (all lanes): release its segment flags at every destination.
            __syncwarp();
            const int num_flags = (seg_end - seg_begin) * kNumRanks;
            for (int p = lane; p < num_flags; p += 32) {
                const int g = seg_begin + p / kNumRanks, d = p % kNumRanks;
                if ((dest >> d) & 1u)
                    release(reinterpret_cast<uint32_t*>(message(d, rank, t)) + g, n);
            }
        }
        if (last_block_done(ctl + kCtlDispatchSendTicket)) {
            if (threadIdx.x == 0)
                ctl[kCtlDispatchCalls] = n;
        }
    }

    if (!(phases & kRecv))
        return;

    // ---- receive: the layout from every live source's counts ----
    int32_t* s_count = smem;
    int32_t* s_begin = smem + num_experts;
    int32_t* s_row_base = smem + 2 * num_experts;
    if (threadIdx.x == 0)
        s_masked = read_mask_bits(mask, kNumRanks);
    __syncthreads();
    const uint32_t recv_masked = s_masked;
    uint64_t* my_counts = reinterpret_cast<uint64_t*>(region.at(rank) + half);
    bool failed = false;
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x) {
        const int s = i % kNumRanks;
        int c = 0;
        if (!((recv_masked >> s) & 1u)) {
            uint64_t word;
            uint64_t cycles = 0;
            if (wait_signal(my_counts + i, n, waiter, s, kAuxCounts, word,
                            (wait_stats != nullptr && blockIdx.x == 0) ? &cycles : nullptr))
                c = static_cast<int>(static_cast<uint32_t>(word));
            else
                failed = !waiter.shrink;
            if (cycles != 0)
                atomicAdd(reinterpret_cast<unsigned long long*>(&s_wait[s]), static_cast<unsigned long long>(cycles));
        }
        s_count[i] = c;
    }
    if (__syncthreads_or(failed))
        return;
    for (int j = threadIdx.x; j < L; j += blockDim.x) {
        int acc = 0;
        #pragma unroll
        for (int s = 0; s < kNumRanks; ++s) {
            s_begin[j * kNumRanks + s] = acc;
            acc += s_count[j * kNumRanks + s];
        }
        s_row_base[j] = acc;
    }
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
            layout_range[i] = (static_cast<int64_t>(s_begin[i]) << 32) | static_cast<uint32_t>(s_count[i]);
        for (int j = threadIdx.x; j < L; j += blockDim.x) {
            recv_count[j] = s_row_base[j];
            if (cumulative_stats != nullptr)
                cumulative_stats[j] += s_row_base[j];
        }
    }
    __syncthreads();
    block_scan_inplace(s_row_base, L);
    const int total_rows = s_row_base[L];

    // ---- receive: rows (expert j, row r), in parts of whole segments ----
    const ScaleOut sf{recv_sf, hidden / 128, num_rows_out, use_ue8m0 != 0};
    const int chunks_per_seg = use_fp8 ? kSegChannels / 16 : kSegChannels / 8;
    const int row_chunks = out_row_bytes / 16;
    const Parts parts(total_rows, num_segs, total_warps);
    const int32_t* my_lists = reinterpret_cast<const int32_t*>(region.at(rank) + half + lists_offset);
    bool aborted = false;   // a wait timed out without shrink: stop (the buffer is unusable from here on)
    for (int item = global_warp; item < total_rows * parts.num; item += total_warps) {
        const int g_row = item / parts.num, part = item - g_row * parts.num;
        const int seg_begin = part * parts.segs, seg_end = min(num_segs, seg_begin + parts.segs);
        const int j = find_expert(s_row_base, L, g_row), r = g_row - s_row_base[j];
        int s = 0;
        #pragma unroll
        for (int q = 1; q < kNumRanks; ++q)
            s += (r >= s_begin[j * kNumRanks + q]) ? 1 : 0;
        // Sources with no tokens share a begin with the next one: the last source whose block starts at or before r
        // is the one whose block holds r.
        const int i = r - s_begin[j * kNumRanks + s];
        const int entry = my_lists[(static_cast<int64_t>(j) * kNumRanks + s) * slot_tokens + i];
        const int t = entry >> 5, k = entry & 31;
        uint8_t* dst_row = recv_x + (static_cast<int64_t>(j) * num_rows_out + r) * out_row_bytes;
        if (part == 0 && lane == 0) {
            src_info[static_cast<int64_t>(j) * num_rows_out + r] = t;
            row_route[static_cast<int64_t>(j) * num_rows_out + r] =
                static_cast<int32_t>((static_cast<uint32_t>(s) << 29) | (static_cast<uint32_t>(k) << 24) | t);
        }
        if (direct && s == rank) {
            if (!DEEPEP_LL_PROBE_NO_DATA && !DEEPEP_LL_OWN_TOKENS)
                cast_row_part(x + static_cast<int64_t>(t) * hidden * 2, hidden, use_fp8 != 0, round_scale != 0,
                              seg_begin, seg_end, dst_row, sf, j, r, lane);
            continue;
        }
        const uint8_t* m = message(rank, s, t);
        bool ok = true;
        uint64_t cycles = 0;
        for (int p = lane; p < seg_end - seg_begin; p += 32) {
            uint32_t seen;
            ok = ok && wait_signal(reinterpret_cast<const uint32_t*>(m) + seg_begin + p, n, waiter, s, kAuxMessage,
                                   seen, wait_stats != nullptr ? &cycles : nullptr);
        }
        if (cycles != 0)
            atomicAdd(reinterpret_cast<unsigned long long*>(&s_wait[s]), static_cast<unsigned long long>(cycles));
        if (!__all_sync(0xffffffffu, ok)) {
            if (waiter.shrink)
                continue;   // the source went silent and is masked now: its rows stay stale
            aborted = true;
            break;
        }
        __syncwarp();   // lanes read segments whose flags other lanes acquired
        if (DEEPEP_LL_PROBE_NO_DATA)
            continue;
        const int c_begin = seg_begin * chunks_per_seg, c_end = min(row_chunks, seg_end * chunks_per_seg);
        warp_copy(dst_row + c_begin * 16, m + msg_hidden_offset + c_begin * 16, (c_end - c_begin) * 16, lane);
        if (use_fp8) {
            const float* scales = reinterpret_cast<const float*>(m + scale_offset);
            if (!sf.ue8m0) {
                for (int p = seg_begin * 4 + lane; p < min(seg_end * 4, sf.num_scales); p += 32)
                    sf.put_float(j, p, r, scales[p]);
            } else {
                for (int g = seg_begin + lane; g < seg_end; g += 32)
                    sf.put_packed(j, g, r, ue8m0_byte(scales[4 * g]) | (ue8m0_byte(scales[4 * g + 1]) << 8) |
                                               (ue8m0_byte(scales[4 * g + 2]) << 16) |
                                               (ue8m0_byte(scales[4 * g + 3]) << 24));
            }
        }
    }
    if (DEEPEP_LL_OWN_TOKENS && !DEEPEP_LL_PROBE_NO_DATA && direct && !aborted) {
        // Our own tokens, by token: slot k of token t went to our expert j as entry send_pos[t][k] of our block of
        // expert j's rows (the scan wrote it before it released the count this block acquired).
        const Parts tparts(num_tokens, num_segs, total_warps);
        for (int item = global_warp; item < num_tokens * tparts.num; item += total_warps) {
            const int t = item / tparts.num, part = item - t * tparts.num;
            const int seg_begin = part * tparts.segs, seg_end = min(num_segs, seg_begin + tparts.segs);
            const int64_t idx = static_cast<int64_t>(t) * num_topk + lane;
            const int64_t e = lane < num_topk ? __ldg(topk_idx + idx) : -1;
            const bool ours = e >= static_cast<int64_t>(rank) * L && e < static_cast<int64_t>(rank + 1) * L;
            const int pos = ours ? send_pos[idx] : -1;
            const int j = ours ? static_cast<int>(e) - rank * L : 0;
            const int r = pos >= 0 ? s_begin[j * kNumRanks + rank] + pos : 0;
            const uint32_t rows = __ballot_sync(0xffffffffu, pos >= 0);
            if (rows != 0)
                cast_token_part(x + static_cast<int64_t>(t) * hidden * 2, hidden, use_fp8 != 0, round_scale != 0,
                                seg_begin, seg_end, recv_x, out_row_bytes, num_rows_out, sf, rows, j, r, lane);
        }
    }
    if (__syncthreads_or(aborted))
        return;
    flush_wait_stats<kNumRanks>(s_wait, wait_stats);
    // Every block copied its rows out: the sources may reuse this half's slots (call n + 2).
    if (last_block_done(ctl + kCtlDispatchRecvTicket)) {
        if (threadIdx.x < kNumRanks && !((read_mask_bits(mask, kNumRanks) >> threadIdx.x) & 1u))
            release(region.ctl(threadIdx.x) + kCtlDispatchConsumed + 8 * h + rank, n);
    }
}

// ---- combine ------------------------------------------------------------------------------------------------------
template <int kNumRanks>
__global__ void __launch_bounds__(kThreads, DEEPEP_LL_MIN_BLOCKS)
combine(const uint8_t* x, const int32_t* recv_count, const int32_t* row_route, const int64_t* layout_range,
        const int32_t* send_pos, const int64_t* topk_idx, const float* topk_weights, uint8_t* combined_x,
        int num_tokens, int num_topk, int hidden, int num_experts, int num_max_tokens, int32_t* call_info,
        int64_t* wait_stats, const uint64_t* peer_bases, int rank, uint64_t region_offset, uint64_t half_bytes,
        uint64_t cflags_offset, uint64_t cslots_offset, int slot_segs, int shrink, int phases, int32_t* error_record,
        uint64_t timeout_ns) {
    extern __shared__ int32_t smem[];   // send: row_base [L + 1]
    __shared__ uint32_t s_masked;
    __shared__ uint64_t s_wait[kNumRanks];
    __shared__ const uint8_t* s_rows[kNumWarps][32];
    __shared__ float s_weights[kNumWarps][32];
    const Region region{peer_bases, region_offset};
    uint32_t* ctl = region.ctl(rank);
    int32_t* mask = reinterpret_cast<int32_t*>(ctl + kCtlMask);
    const Waiter waiter{mask, make_error_sink(peer_bases, rank, error_record), timeout_ns, rank, kPhaseCombine,
                        shrink != 0};
    const int L = num_experts / kNumRanks;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int total_warps = gridDim.x * kNumWarps, global_warp = blockIdx.x * kNumWarps + warp;
    const bool direct = (phases & kSend) && (phases & kRecv);
    const int num_segs = (hidden + kSegChannels - 1) / kSegChannels;
    const int row_bytes = hidden * 2, row_chunks = row_bytes / 16;
    constexpr int kChunksPerSeg = kSegChannels / 8;
    const int num_rows_in = kNumRanks * num_max_tokens;    // T
    uint32_t c = (phases & kSend) ? read_local(ctl + kCtlCombineCalls) + 1
                                  : static_cast<uint32_t>(*reinterpret_cast<volatile int32_t*>(call_info));
    const int hc = c & 1;
    const uint64_t half = kControlBytes + hc * half_bytes;
    // Flag of (slot row, segment) and the slot row at `peer`.
    const auto flag = [&](int peer, int64_t slot, int g) {
        return reinterpret_cast<uint32_t*>(region.at(peer) + half + cflags_offset) + slot * slot_segs + g;
    };
    const auto slot_row = [&](int peer, int64_t slot) {
        return region.at(peer) + half + cslots_offset + slot * row_bytes;
    };
    if (threadIdx.x < kNumRanks)
        s_wait[threadIdx.x] = 0;
    if (threadIdx.x == 0)
        s_masked = read_mask_bits(mask, kNumRanks);
    __syncthreads();

    if (phases & kSend) {
        if (blockIdx.x == 0 && threadIdx.x == 0)
            *call_info = static_cast<int32_t>(c);
        bool ok = true;
        if (threadIdx.x < kNumRanks && !((s_masked >> threadIdx.x) & 1u)) {
            uint32_t seen;
            ok = wait_signal(ctl + kCtlCombineConsumed + 8 * hc + threadIdx.x, c - 2, waiter, threadIdx.x,
                             kAuxCombineConsumed, seen, nullptr) || waiter.shrink;
        }
        if (__syncthreads_or(!ok))
            return;
        if (threadIdx.x == 0)
            s_masked = read_mask_bits(mask, kNumRanks);
        // Rows this rank received in the dispatch, expert by expert.
        int32_t* s_row_base = smem;
        for (int j = threadIdx.x; j < L; j += blockDim.x)
            s_row_base[j] = recv_count[j];
        __syncthreads();
        block_scan_inplace(s_row_base, L);
        const uint32_t live = ~s_masked;
        const int total_rows = s_row_base[L];
        const Parts parts(total_rows, num_segs, total_warps);
        for (int item = global_warp; item < total_rows * parts.num; item += total_warps) {
            const int g_row = item / parts.num, part = item - g_row * parts.num;
            const int seg_begin = part * parts.segs, seg_end = min(num_segs, seg_begin + parts.segs);
            const int j = find_expert(s_row_base, L, g_row), r = g_row - s_row_base[j];
            const int route = row_route[static_cast<int64_t>(j) * num_rows_in + r];
            const int s = (route >> 29) & 7, k = (route >> 24) & 31, t = route & 0xffffff;
            if (!((live >> s) & 1u) || (direct && s == rank))
                continue;   // masked origin, or our own token (the receive phase reads x)
            const int64_t slot = static_cast<int64_t>(t) * num_topk + k;
            const int c_begin = seg_begin * kChunksPerSeg, c_end = min(row_chunks, seg_end * kChunksPerSeg);
            warp_copy<true>(slot_row(s, slot) + c_begin * 16,
                            x + (static_cast<int64_t>(j) * num_rows_in + r) * row_bytes + c_begin * 16,
                            (c_end - c_begin) * 16, lane);
            __syncwarp();
            for (int p = lane; p < seg_end - seg_begin; p += 32)
                release(flag(s, slot, seg_begin + p), c);
        }
        if (last_block_done(ctl + kCtlCombineSendTicket)) {
            if (threadIdx.x == 0)
                ctl[kCtlCombineCalls] = c;
        }
    }

    if (!(phases & kRecv))
        return;

    // ---- receive: per (token, part of its segments), wait for the rows, reduce in ascending top-k order ----
    if (threadIdx.x == 0)
        s_masked = read_mask_bits(mask, kNumRanks);
    __syncthreads();
    const uint32_t live = ~s_masked;
    const Parts parts(num_tokens, num_segs, total_warps);
    bool aborted = false;
    for (int item = global_warp; item < num_tokens * parts.num; item += total_warps) {
        const int t = item / parts.num, part = item - t * parts.num;
        const int seg_begin = part * parts.segs, seg_end = min(num_segs, seg_begin + parts.segs);
        const int nsp = seg_end - seg_begin;
        // Lane k: whether slot k adds a row, its owner, and where the row is.
        const int64_t idx = static_cast<int64_t>(t) * num_topk + lane;
        const int64_t e = lane < num_topk ? __ldg(topk_idx + idx) : -1;
        const int pos = lane < num_topk ? __ldg(send_pos + idx) : -1;
        const int owner = (e >= 0 && e < num_experts) ? static_cast<int>(e) / L : 0;
        const bool valid = pos >= 0 && e >= 0 && e < num_experts && ((live >> owner) & 1u);
        const bool local = valid && direct && owner == rank;
        const uint8_t* row = nullptr;
        if (local) {
            // Our own expert's row, straight from x (a top-k table that differs from the dispatch's reads nothing
            // outside x).
            const int j = static_cast<int>(e) - rank * L;
            const int begin = static_cast<int>(__ldg(layout_range + static_cast<int64_t>(j) * kNumRanks + rank) >> 32);
            if (begin + pos < num_rows_in)
                row = x + (static_cast<int64_t>(j) * num_rows_in + begin + pos) * row_bytes;
        } else if (valid) {
            row = slot_row(rank, idx);
        }
        s_rows[warp][lane] = row;
        s_weights[warp][lane] = lane < num_topk ? __ldg(topk_weights + idx) : 0.f;
        const uint32_t wait_mask = __ballot_sync(0xffffffffu, valid && !local);
        // Wait for every (slot, segment) flag of this part (lane-parallel over the pairs).
        bool ok = true;
        for (int base = 0; base < num_topk * nsp; base += 32) {
            const int p = base + lane;
            const int kk = p / nsp;
            const int owner_k = __shfl_sync(0xffffffffu, owner, kk & 31);
            if (p < num_topk * nsp && ((wait_mask >> kk) & 1u)) {
                uint32_t seen;
                uint64_t cycles = 0;
                ok = wait_signal(flag(rank, static_cast<int64_t>(t) * num_topk + kk, seg_begin + p % nsp), c,
                                 waiter, owner_k, kAuxRows, seen, wait_stats != nullptr ? &cycles : nullptr) && ok;
                if (cycles != 0)
                    atomicAdd(reinterpret_cast<unsigned long long*>(&s_wait[owner_k]),
                              static_cast<unsigned long long>(cycles));
            }
        }
        if (!__all_sync(0xffffffffu, ok)) {
            if (!waiter.shrink) {
                aborted = true;
                break;
            }
            // Shrink: an owner went silent mid-call and is masked now; drop its slots.
            const uint32_t now_live = ~read_mask_bits(mask, kNumRanks);
            if (lane < num_topk && valid && !((now_live >> owner) & 1u))
                s_rows[warp][lane] = nullptr;
        }
        __syncwarp();
        const uint32_t add_mask = __ballot_sync(0xffffffffu, lane < num_topk && s_rows[warp][lane] != nullptr);
        const int c_begin = seg_begin * kChunksPerSeg, c_end = min(row_chunks, seg_end * kChunksPerSeg);
        for (int ch = c_begin + lane; ch < (DEEPEP_LL_PROBE_NO_DATA ? c_begin : c_end); ch += 32) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int k0 = 0; k0 < num_topk; k0 += 8) {
                Vec16 v[8];
                #pragma unroll
                for (int u = 0; u < 8; ++u)
                    if (k0 + u < 32 && ((add_mask >> (k0 + u)) & 1u))
                        v[u] = ld_v4(s_rows[warp][k0 + u] + static_cast<int64_t>(ch) * 16);
                #pragma unroll
                for (int u = 0; u < 8; ++u) {
                    if (k0 + u >= 32 || !((add_mask >> (k0 + u)) & 1u))
                        continue;
                    const float w = s_weights[warp][k0 + u];
                    const uint32_t words[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
                    #pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        acc[2 * q] = __fmaf_rn(w, bf16_lo(words[q]), acc[2 * q]);
                        acc[2 * q + 1] = __fmaf_rn(w, bf16_hi(words[q]), acc[2 * q + 1]);
                    }
                }
            }
            st_v4(combined_x + static_cast<int64_t>(t) * row_bytes + static_cast<int64_t>(ch) * 16,
                  round_bf16x8(acc));
        }
        __syncwarp();
    }
    if (__syncthreads_or(aborted))
        return;
    flush_wait_stats<kNumRanks>(s_wait, wait_stats);
    // Every block reduced its tokens: the owners may reuse this half's slots (call c + 2).
    if (last_block_done(ctl + kCtlCombineRecvTicket)) {
        if (threadIdx.x < kNumRanks && !((read_mask_bits(mask, kNumRanks) >> threadIdx.x) & 1u))
            release(region.ctl(threadIdx.x) + kCtlCombineConsumed + 8 * hc + rank, c);
    }
}

// ---- clean (DeepEP's clean_low_latency_buffer) ----------------------------------------------------------------------
// One block: a barrier over the live ranks, then (if `reset`) zero this rank's call counters, consumed signals,
// count words, combine flags and message flags, then a second barrier. Afterwards every rank's epochs restart at 1
// together (e.g. after a masked rank sat calls out). A silent rank times out (shrink: it gets masked).
template <int kNumRanks>
__device__ __forceinline__ bool clean_barrier(const Region& region, uint32_t* ctl, int rank, const Waiter& waiter) {
    const uint32_t b = read_local(ctl + kCtlBarrierCalls) + 1;
    __syncthreads();
    bool ok = true;
    if (threadIdx.x < kNumRanks && !is_masked(waiter.mask, threadIdx.x)) {
        fence_acq_rel_sys();
        st_release_sys(region.ctl(threadIdx.x) + kCtlBarrier + rank, b);
        uint32_t seen;
        ok = wait_signal(ctl + kCtlBarrier + threadIdx.x, b, waiter, threadIdx.x, kAuxBarrier, seen, nullptr) ||
             waiter.shrink;
    }
    ok = !__syncthreads_or(!ok);
    if (threadIdx.x == 0)
        ctl[kCtlBarrierCalls] = b;
    __syncthreads();
    return ok;
}

template <int kNumRanks>
__global__ void __launch_bounds__(kThreads, 1)
clean(int reset, const uint64_t* peer_bases, int rank, uint64_t region_offset, uint64_t half_bytes,
      uint64_t counts_words, uint64_t cflags_offset, uint64_t cflags_words, uint64_t dslots_offset,
      int num_messages, int msg_bytes, int msg_flag_words, int shrink, int32_t* error_record, uint64_t timeout_ns) {
    const Region region{peer_bases, region_offset};
    uint32_t* ctl = region.ctl(rank);
    const Waiter waiter{reinterpret_cast<int32_t*>(ctl + kCtlMask), make_error_sink(peer_bases, rank, error_record),
                        timeout_ns, rank, kPhaseDispatch, shrink != 0};
    if (!clean_barrier<kNumRanks>(region, ctl, rank, waiter) || !reset)
        return;
    if (threadIdx.x < kCtlBarrierCalls)
        ctl[threadIdx.x] = 0;
    if (threadIdx.x >= kCtlDispatchConsumed && threadIdx.x < kCtlBarrier)
        ctl[threadIdx.x] = 0;
    for (int h = 0; h < 2; ++h) {
        uint8_t* half = region.at(rank) + kControlBytes + h * half_bytes;
        for (uint64_t i = threadIdx.x; i < counts_words; i += blockDim.x)
            reinterpret_cast<uint64_t*>(half)[i] = 0;
        for (uint64_t i = threadIdx.x; i < cflags_words; i += blockDim.x)
            reinterpret_cast<uint32_t*>(half + cflags_offset)[i] = 0;
        for (int64_t i = threadIdx.x; i < static_cast<int64_t>(num_messages) * msg_flag_words; i += blockDim.x)
            reinterpret_cast<uint32_t*>(half + dslots_offset + (i / msg_flag_words) * msg_bytes)[i % msg_flag_words] =
                0;
    }
    fence_acq_rel_sys();
    clean_barrier<kNumRanks>(region, ctl, rank, waiter);
}

}  // namespace ll
}  // namespace deepep
