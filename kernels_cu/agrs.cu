// All-gather sessions, reduce-scatter and all-reduce over the ranks of one NVLink domain (CUDA IPC, SM-driven
// copies). deepep_cupy/agrs.py lays out the memory and launches these kernels; offsets below are bytes from each
// rank's symmetric base and are identical on every rank, because every rank makes the same calls in the same order.
//
// Data region:
//   [data_offset, data_offset + session_bytes)       all-gather session. Regions are reserved one after another, each
//       align(R * num_bytes, 32); rank r's tensor sits at region + r * num_bytes, so a region is a [R, *shape] view.
//   [data_offset + align(session_bytes, 4096), end)  reduction area of the current reduce-scatter / all-reduce:
//       recv slots [src] of slot_bytes (src's piece for this rank, in the staging precision), then, for all-reduce,
//       gather slots [src] of gather_slot_bytes (src's reduced shard, FP32).
//
// Control words: the workspace region kWsAgrsOffset (common/workspace.cuh) of every rank's buffer. uint32 words,
// epochs that only grow, nothing is ever cleared:
//   [0] gather ticket, [1] reduce ticket, [2] unpack ticket   local, for last_block_done
//   gather_signal[src]   word 32 + src   src finished writing its tensors of gather epoch e into this rank's region
//   shard_signal[src]    word 64 + src   src finished writing its reduced shard of all-reduce epoch e into our gather
//                                        slot [src]
//   done[src]            word 96 + src   src finished reduction epoch e entirely: it read everything we wrote into
//                                        its recv / gather slots, which we may now overwrite
//   gather_meta[src][32] word 128        meta[src][e % 32] = end of src's regions of gather epoch e (32-byte units)
//   chunk_flag[src][32]  word 384        uint64 (byte 1536): chunk_flag[src][b] = (e << 32) + round + 1: src's
//                                        sender block b finished its chunk of round `round` for this rank in reduction
//                                        epoch e. 64 bits because a slot may go unwritten for many epochs (calls with
//                                        fewer senders or shorter shards): a 32-bit (e << 16) word would compare
//                                        wrongly (wrap-safe >= fails) after 32768 epochs and a reducer would read
//                                        stale data.
//
// All-gather (gather epoch e = the host's count of all_gather calls): agrs_gather_batch_kernel (up to 8 tensors per
// launch; hybrid mode: agrs_gather_kernel, one per tensor and step) on the communication stream stores this rank's
// bytes into slot [me] of each tensor's region at every rank (16-byte vector stores; the local store is skipped when
// the source already is that slot, the in-place case). The last launch of a call (earlier launches are complete by
// stream order) publishes, from its last block, meta[me][e % 32] and then gather_signal[me] = e at every rank, itself
// included (release). agrs_wait_kernel, launched by the wait handle on the user's stream, waits gather_signal[p] >= e
// for every p (acquire) and checks meta[p][e % 32] against its own
// (ranks that disagree on sizes are reported instead of returning garbage). A session holds at most 32 calls and its
// destroy is a barrier ordered after the user's stream, so a peer is never 32 gather epochs ahead of a waiter and the
// meta slot is still the one of epoch e.
//
// Reduce-scatter / all-reduce (reduction epoch e = the host's count of those calls), one cooperative kernel with two
// roles; element groups of 8 (shards start at multiples of 8 elements):
//   sender blocks b < S wait done[p] >= e - 1 for every peer p, then for chunk k = round * S + b of every peer d's
//     piece convert it to the staging precision, store it into recv slot [me] at d and publish chunk_flag[me][b] =
//     (e << 32) + round + 1 at d (release after the block's stores).
//   reducer blocks take this rank's chunks k in turn, wait chunk_flag[p][k % S] >= (e << 32) + k / S + 1 for every
//     peer p, then sum the R pieces in rank order 0..R-1 in FP32 (this rank's own piece read from the input, rounded
//     to the staging precision like the others), multiply by `scale` and store the result in the output precision;
//     all-reduce also stores the FP32 result into gather slot [me] of every peer.
//   The grid's last block publishes done[me] = e (reduce-scatter) or shard_signal[me] = e (all-reduce) at every peer.
// All-reduce then runs agrs_unpack_kernel: wait shard_signal[p] >= e, copy the gather slots into the input in place,
// and publish done[me] = e from the last block. A sender of epoch e + 1 waits for done of epoch e, so recv and gather
// slots are never overwritten while read; reducers wait only on senders, so the cooperative launch cannot deadlock.
#include "common/ep.cuh"

namespace deepep {

constexpr uint64_t kAgrsCtrlOffset = kWsAgrsOffset;     // common/workspace.cuh
constexpr uint64_t kAgrsCtrlBytes = kWsAgrsBytes;
constexpr int kAgrsMaxRanks = 8;
constexpr int kAgrsMetaSlots = 32;
constexpr int kAgrsMaxSenders = 32;
constexpr int kAgrsThreads = 512;
constexpr int kAgrsGatherUnroll = 4;

constexpr int kAgrsTicketGather = 0, kAgrsTicketReduce = 1, kAgrsTicketUnpack = 2;
constexpr int kAgrsSigGather = 32, kAgrsSigShard = 64, kAgrsSigDone = 96;
constexpr int kAgrsGatherMeta = 128;
constexpr int kAgrsChunkFlags = kAgrsGatherMeta + kAgrsMaxRanks * kAgrsMetaSlots;  // uint32 index of uint64 flags
static_assert(kAgrsChunkFlags % 2 == 0, "64-bit chunk flags must be 8-byte aligned");
static_assert(kAgrsChunkFlags * 4 + kAgrsMaxRanks * kAgrsMaxSenders * 8 <= kAgrsCtrlBytes,
              "all-gather / reduce-scatter control words overflow their workspace range");

// Hybrid mode (several scale-up domains, deepep_cupy/features/agrs/feature.py): the effective meta a rank publishes
// after the rail exchange of an all-gather: its own when every rail peer sent the same meta, kAgrsMetaMismatch when
// one did not (its domain peers then report a size mismatch), kAgrsMetaSkip when this rank already reported a timeout
// (it does not signal, so its domain peers time out too instead of reading what never arrived).
constexpr uint32_t kAgrsMetaMismatch = 0xFFFFFFFEu, kAgrsMetaSkip = 0xFFFFFFFFu;

// `aux` of an error record: which wait gave up (deepep_cupy/agrs.py mirrors these).
constexpr int kAgrsAuxGatherWait = 1, kAgrsAuxSizeMismatch = 2, kAgrsAuxDoneWait = 3, kAgrsAuxChunkWait = 4,
              kAgrsAuxShardWait = 5;

struct AgrsCtrl {
    const uint64_t* bases;
    int rank;
    __device__ __forceinline__ uint8_t* base(int peer) const { return reinterpret_cast<uint8_t*>(bases[peer]); }
    __device__ __forceinline__ uint32_t* words(int peer) const {
        return reinterpret_cast<uint32_t*>(base(peer) + kAgrsCtrlOffset);
    }
    __device__ __forceinline__ uint32_t* local() const { return words(rank); }
    // chunk_flag[0][0] of `peer` (64-bit words).
    __device__ __forceinline__ uint64_t* chunk_flags(int peer) const {
        return reinterpret_cast<uint64_t*>(words(peer) + kAgrsChunkFlags);
    }
};

// wait_epoch for a 64-bit flag (wrap-safe >=); the error record keeps the low 32 bits (round + 1) of both values.
__device__ __forceinline__ bool wait_epoch(const uint64_t* flag, uint64_t target, uint64_t timeout_ns,
                                           const ErrorSink& sink, int phase, int rank, int peer, int aux) {
    uint64_t seen = ld_acquire_sys(flag);
    if (static_cast<int64_t>(seen - target) >= 0)
        return true;
    const uint64_t start = global_timer_ns();
    for (uint32_t iter = 0;; ++iter) {
        seen = ld_acquire_sys(flag);
        if (static_cast<int64_t>(seen - target) >= 0)
            return true;
        if ((iter & 255) == 255) {
            if (global_timer_ns() - start > timeout_ns) {
                report_timeout(sink, phase, rank, peer, static_cast<uint32_t>(target), static_cast<uint32_t>(seen),
                               aux);
                return false;
            }
            if (timeout_reported(sink))
                return false;
        }
    }
}

// Threads p < kNumRanks, p != rank, wait until this rank's flag first[p * stride] (32- or 64-bit) reaches `target`
// (acquire), then the block syncs. Returns false in every thread if a wait timed out. Every thread must call it.
template <int kNumRanks, typename Word>
__device__ __forceinline__ bool agrs_wait_peers(const AgrsCtrl& ctrl, const Word* first, int stride, Word target,
                                                uint64_t timeout_ns, const ErrorSink& sink, int aux) {
    __shared__ int s_ok;
    if (threadIdx.x == 0)
        s_ok = 1;
    __syncthreads();
    const int p = threadIdx.x;
    if (p < kNumRanks && p != ctrl.rank) {
        if (!wait_epoch(first + p * stride, target, timeout_ns, sink, kPhaseAGRS, ctrl.rank, p, aux))
            s_ok = 0;
    }
    __syncthreads();
    const bool ok = s_ok != 0;
    __syncthreads();    // s_ok is reused by the next call
    return ok;
}

__device__ __forceinline__ int64_t shard_len(int64_t num_elems, int64_t shard_elems, int idx) {
    const int64_t left = num_elems - static_cast<int64_t>(idx) * shard_elems;
    return left <= 0 ? 0 : (left < shard_elems ? left : shard_elems);
}

__device__ __forceinline__ uint64_t chunk_flag(uint32_t epoch, int64_t round) {
    return (static_cast<uint64_t>(epoch) << 32) + static_cast<uint64_t>(round) + 1u;
}

// ---- 8-element groups in FP32 or bfloat16 ------------------------------------------------------------------------
__device__ __forceinline__ void unpack_f32x4(const Vec16& a, float* v) {
    v[0] = __uint_as_float(a.x); v[1] = __uint_as_float(a.y); v[2] = __uint_as_float(a.z); v[3] = __uint_as_float(a.w);
}

__device__ __forceinline__ Vec16 pack_f32x4(const float* v) {
    return {__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3])};
}

template <bool kBF16, bool kNonCoherent>
__device__ __forceinline__ void load8(const uint8_t* p, float (&v)[8]) {
    if (kBF16) {
        const Vec16 a = kNonCoherent ? ld_nc_v4(p) : ld_v4(p);
        v[0] = bf16_lo(a.x); v[1] = bf16_hi(a.x); v[2] = bf16_lo(a.y); v[3] = bf16_hi(a.y);
        v[4] = bf16_lo(a.z); v[5] = bf16_hi(a.z); v[6] = bf16_lo(a.w); v[7] = bf16_hi(a.w);
    } else {
        const Vec16 a = kNonCoherent ? ld_nc_v4(p) : ld_v4(p);
        const Vec16 b = kNonCoherent ? ld_nc_v4(p + 16) : ld_v4(p + 16);
        unpack_f32x4(a, v);
        unpack_f32x4(b, v + 4);
    }
}

template <bool kBF16>
__device__ __forceinline__ void store8(uint8_t* p, const float (&v)[8]) {
    if (kBF16) {
        st_na_v4(p, round_bf16x8(v));
    } else {
        st_na_v4(p, pack_f32x4(v));
        st_na_v4(p + 16, pack_f32x4(v + 4));
    }
}

// kN (4 or 8) consecutive elements in FP32 or bfloat16: one 16-byte vector, or two for 8 FP32 elements.
template <int kN, bool kBF16, bool kNonCoherent>
__device__ __forceinline__ void load_n(const uint8_t* p, float (&v)[kN]) {
    static_assert(kN == 8 || (kN == 4 && !kBF16), "units are 4 FP32 or 8 elements");
    if constexpr (kN == 4)
        unpack_f32x4(kNonCoherent ? ld_nc_v4(p) : ld_v4(p), v);
    else
        load8<kBF16, kNonCoherent>(p, v);
}

template <int kN, bool kBF16>
__device__ __forceinline__ void store_n(uint8_t* p, const float (&v)[kN]) {
    static_assert(kN == 8 || (kN == 4 && !kBF16), "units are 4 FP32 or 8 elements");
    if constexpr (kN == 4)
        st_na_v4(p, pack_f32x4(v));
    else
        store8<kBF16>(p, v);
}

template <bool kBF16>
__device__ __forceinline__ float load1(const uint8_t* p) {
    if (kBF16)
        return __uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16);
    return *reinterpret_cast<const float*>(p);
}

template <bool kBF16>
__device__ __forceinline__ void store1(uint8_t* p, float v) {
    if (kBF16)
        *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(pack_bf16x2(v, 0.f) & 0xffffu);
    else
        *reinterpret_cast<float*>(p) = v;
}

// Round to bfloat16 (nearest even) and back: the value a bfloat16 staging slot would hold.
__device__ __forceinline__ float round_bf16(float v) { return bf16_lo(pack_bf16x2(v, 0.f)); }

// ---- all-gather ---------------------------------------------------------------------------------------------------

// Store `num_bytes` bytes of `src` into slot [rank] (at region_offset + rank * num_bytes) of every rank's buffer, the
// local one only if `write_local`, with the grid's threads (`tid` of `num_threads`).
template <int kNumRanks>
__device__ __forceinline__ void agrs_copy_slot(const AgrsCtrl& ctrl, const uint8_t* src, int64_t num_bytes,
                                               uint64_t region_offset, bool write_local, int64_t tid,
                                               int64_t num_threads) {
    const uint64_t slot_offset = region_offset + static_cast<uint64_t>(ctrl.rank) * static_cast<uint64_t>(num_bytes);
    uint8_t* dst[kNumRanks];
    #pragma unroll
    for (int p = 0; p < kNumRanks; ++p)
        dst[p] = (p != ctrl.rank || write_local) ? ctrl.base(p) + slot_offset : nullptr;

    const bool vec = (num_bytes % 16 == 0) && (reinterpret_cast<uint64_t>(src) % 16 == 0) && (slot_offset % 16 == 0);
    if (vec) {
        // Each vector is read once and stored into every rank's slot.
        grid_stride_copy<kAgrsGatherUnroll>(
            num_bytes / 16, tid, num_threads, [&](int64_t i) { return ld_nc_v4(src + i * 16); },
            [&](int64_t i, const Vec16& v) {
                #pragma unroll
                for (int p = 0; p < kNumRanks; ++p)
                    if (dst[p] != nullptr)
                        st_na_v4(dst[p] + i * 16, v);
            });
    } else {
        // Unaligned sizes or sources: byte stores (correct, slow; the API documents the 16-byte fast path).
        for (int64_t i = tid; i < num_bytes; i += num_threads) {
            const uint8_t b = src[i];
            #pragma unroll
            for (int p = 0; p < kNumRanks; ++p)
                if (dst[p] != nullptr)
                    dst[p][i] = b;
        }
    }
}

// After every block's copies (the grid's last block, `last_block_done`): publish meta[me][epoch % 32] and then
// gather_signal[me] = epoch at every rank, itself included (release). Every thread of the last block calls it.
template <int kNumRanks>
__device__ __forceinline__ void agrs_publish_gather(const AgrsCtrl& ctrl, uint32_t epoch, uint32_t meta) {
    const int p = threadIdx.x;
    if (p < kNumRanks) {
        uint32_t* remote = ctrl.words(p);
        remote[kAgrsGatherMeta + ctrl.rank * kAgrsMetaSlots + epoch % kAgrsMetaSlots] = meta;  // ordered by the release
        st_release_sys(remote + kAgrsSigGather + ctrl.rank, epoch);
    }
}

// One tensor of an all-gather call (hybrid mode's steps launch it per tensor and shard): agrs_copy_slot of `src`;
// with `do_signal`, agrs_publish_gather after it.
template <int kNumRanks>
__global__ void __launch_bounds__(kAgrsThreads, 1)
agrs_gather_kernel(const uint8_t* src, int64_t num_bytes, uint64_t region_offset, const uint64_t* peer_bases, int rank,
                   int write_local, int do_signal, uint32_t epoch, uint32_t meta, const uint32_t* meta_word) {
    static_assert(kNumRanks >= 1 && kNumRanks <= kAgrsMaxRanks, "all-gather supports up to 8 ranks");
    const AgrsCtrl ctrl{peer_bases, rank};
    agrs_copy_slot<kNumRanks>(ctrl, src, num_bytes, region_offset, write_local != 0,
                              static_cast<int64_t>(blockIdx.x) * kAgrsThreads + threadIdx.x,
                              static_cast<int64_t>(gridDim.x) * kAgrsThreads);
    if (!do_signal || !last_block_done(ctrl.local() + kAgrsTicketGather))
        return;
    // Hybrid mode: the meta the rail check published (agrs_rail_meta_kernel); kAgrsMetaSkip: do not signal at all.
    if (meta_word != nullptr) {
        meta = *reinterpret_cast<const volatile uint32_t*>(meta_word);
        if (meta == kAgrsMetaSkip)
            return;
    }
    agrs_publish_gather<kNumRanks>(ctrl, epoch, meta);
}

// Up to kAgrsGatherBatch tensors of one all-gather call in one launch (the single-domain path): tensor t < num_tensors
// is (src<t>, num_bytes<t>, region_offset<t>), stored as agrs_gather_kernel would with write_local = bit t of
// `write_local_mask`; the whole grid copies the tensors one after another (no block split: a grid sized for the
// largest tensor). With `do_signal` (the call's last launch: calls of more tensors launch it once per kAgrsGatherBatch
// tensors, on one stream), the grid's last block publishes the call's signal once, after every tensor. The descriptor
// table travels by value in the launch's arguments (one scalar parameter per field: the launcher passes scalars).
constexpr int kAgrsGatherBatch = 8;

template <int kNumRanks>
__global__ void __launch_bounds__(kAgrsThreads, 1)
agrs_gather_batch_kernel(const uint8_t* src0, const uint8_t* src1, const uint8_t* src2, const uint8_t* src3,
                         const uint8_t* src4, const uint8_t* src5, const uint8_t* src6, const uint8_t* src7,
                         int64_t num_bytes0, int64_t num_bytes1, int64_t num_bytes2, int64_t num_bytes3,
                         int64_t num_bytes4, int64_t num_bytes5, int64_t num_bytes6, int64_t num_bytes7,
                         uint64_t region_offset0, uint64_t region_offset1, uint64_t region_offset2,
                         uint64_t region_offset3, uint64_t region_offset4, uint64_t region_offset5,
                         uint64_t region_offset6, uint64_t region_offset7, int num_tensors, uint32_t write_local_mask,
                         const uint64_t* peer_bases, int rank, int do_signal, uint32_t epoch, uint32_t meta) {
    static_assert(kNumRanks >= 1 && kNumRanks <= kAgrsMaxRanks, "all-gather supports up to 8 ranks");
    const AgrsCtrl ctrl{peer_bases, rank};
    const uint8_t* const srcs[kAgrsGatherBatch] = {src0, src1, src2, src3, src4, src5, src6, src7};
    const int64_t sizes[kAgrsGatherBatch] = {num_bytes0, num_bytes1, num_bytes2, num_bytes3,
                                             num_bytes4, num_bytes5, num_bytes6, num_bytes7};
    const uint64_t regions[kAgrsGatherBatch] = {region_offset0, region_offset1, region_offset2, region_offset3,
                                                region_offset4, region_offset5, region_offset6, region_offset7};
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * kAgrsThreads + threadIdx.x;
    const int64_t num_threads = static_cast<int64_t>(gridDim.x) * kAgrsThreads;
    const int n = num_tensors < kAgrsGatherBatch ? num_tensors : kAgrsGatherBatch;
    for (int t = 0; t < n; ++t)
        agrs_copy_slot<kNumRanks>(ctrl, srcs[t], sizes[t], regions[t], (write_local_mask >> t) & 1u, tid,
                                  num_threads);
    if (!do_signal || !last_block_done(ctrl.local() + kAgrsTicketGather))
        return;
    agrs_publish_gather<kNumRanks>(ctrl, epoch, meta);
}

// One block of 32 threads on the user's stream: thread p waits for rank p's gather epoch `epoch` and checks its meta.
template <int kNumRanks>
__global__ void __launch_bounds__(32, 1)
agrs_wait_kernel(const uint64_t* peer_bases, int rank, uint32_t epoch, uint32_t meta, int32_t* error_record,
                 uint64_t timeout_ns) {
    const AgrsCtrl ctrl{peer_bases, rank};
    const int p = threadIdx.x;
    if (p >= kNumRanks)
        return;
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    const uint32_t* words = ctrl.local();
    if (!wait_epoch(words + kAgrsSigGather + p, epoch, timeout_ns, sink, kPhaseAGRS, rank, p, kAgrsAuxGatherWait))
        return;
    const uint32_t seen = ld_acquire_sys(words + kAgrsGatherMeta + p * kAgrsMetaSlots + epoch % kAgrsMetaSlots);
    if (seen != meta)
        report_timeout(sink, kPhaseAGRS, rank, p, meta, seen, kAgrsAuxSizeMismatch);
}

// ---- reduce-scatter / all-reduce ----------------------------------------------------------------------------------

// Reductions move 16-byte units of the staging precision: 4 FP32 or 8 bfloat16 elements. A warp's stores into a
// peer then cover 512 contiguous bytes; 32-byte groups per thread (8 FP32) would make each store instruction write
// half of every 32-byte sector, and NVLink carries such partial writes at well under half its bandwidth.
template <bool kStageBF16>
constexpr int kStageUnit = kStageBF16 ? 8 : 4;

// `num` elements of `src` (input precision) into `dst` (staging precision); both start at a multiple of 8 elements.
// 128 bytes of input per thread and pass are in flight.
template <bool kInBF16, bool kStageBF16>
__device__ __forceinline__ void stage_copy(uint8_t* dst, const uint8_t* src, int64_t num) {
    constexpr int kIn = kInBF16 ? 2 : 4, kStage = kStageBF16 ? 2 : 4;
    constexpr int kUnit = kStageUnit<kStageBF16>;
    constexpr int kUnroll = 128 / (kUnit * kIn);
    const int64_t num_units = num / kUnit;
    for (int64_t base = threadIdx.x; base < num_units; base += kAgrsThreads * kUnroll) {
        float v[kUnroll][kUnit];
        #pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t g = base + u * kAgrsThreads;
            if (g < num_units)
                load_n<kUnit, kInBF16, true>(src + g * kUnit * kIn, v[u]);
        }
        #pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t g = base + u * kAgrsThreads;
            if (g < num_units)
                store_n<kUnit, kStageBF16>(dst + g * kUnit * kStage, v[u]);
        }
    }
    for (int64_t i = num_units * kUnit + threadIdx.x; i < num; i += kAgrsThreads)
        store1<kStageBF16>(dst + i * kStage, load1<kInBF16>(src + i * kIn));
}

// x: this rank's input, `num_elems` elements (input precision); piece d = elements [d * shard_elems, ...) of at most
// shard_elems. out: where this rank's reduced shard goes (output precision = input precision). Blocks [0, num_senders)
// send, the others reduce. All-reduce (`is_all_reduce` 1, FP32 only) also pushes the result into the peers' gather
// slots. `is_all_reduce` 2 (hybrid reduce-scatter): no pushes, but the end publishes shard_signal instead of done, so
// that done[me] comes later (agrs_unpack_kernel with nothing to copy, after the rail step reused the area).
template <int kNumRanks, bool kInBF16, bool kStageBF16>
__global__ void __launch_bounds__(kAgrsThreads, 1)
agrs_reduce_kernel(const uint8_t* x, uint8_t* out, int64_t num_elems, int64_t shard_elems, int64_t chunk_elems,
                   float scale, int num_senders, const uint64_t* peer_bases, int rank, uint64_t recv_offset,
                   uint64_t slot_bytes, uint64_t gather_offset, uint64_t gather_slot_bytes, int is_all_reduce,
                   uint32_t epoch, int32_t* error_record, uint64_t timeout_ns) {
    static_assert(kNumRanks >= 1 && kNumRanks <= kAgrsMaxRanks, "reduce-scatter supports up to 8 ranks");
    static_assert(!kInBF16 || kStageBF16, "bfloat16 inputs are staged as bfloat16");
    constexpr int kIn = kInBF16 ? 2 : 4, kStage = kStageBF16 ? 2 : 4;
    // Units per reducer thread and pass: about 64 floats of loads in flight (kRedUnroll * kNumRanks * kUnit).
    constexpr int kUnit = kStageUnit<kStageBF16>;
    constexpr int kRedUnroll = 64 / (kNumRanks * kUnit) > 0 ? 64 / (kNumRanks * kUnit) : 1;
    const AgrsCtrl ctrl{peer_bases, rank};
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);

    if (static_cast<int>(blockIdx.x) < num_senders) {
        const int b = blockIdx.x;
        if (!agrs_wait_peers<kNumRanks, uint32_t>(ctrl, ctrl.local() + kAgrsSigDone, 1, epoch - 1, timeout_ns, sink,
                                                  kAgrsAuxDoneWait))
            return;
        for (int64_t round = 0;; ++round) {
            const int64_t begin = (round * num_senders + b) * chunk_elems;
            bool any = false;
            #pragma unroll
            for (int j = 1; j < kNumRanks; ++j) {
                const int d = (rank + j) % kNumRanks;
                const int64_t len = shard_len(num_elems, shard_elems, d);
                if (begin >= len)
                    continue;
                any = true;
                const int64_t n = len - begin < chunk_elems ? len - begin : chunk_elems;
                uint8_t* dst = ctrl.base(d) + recv_offset + static_cast<uint64_t>(rank) * slot_bytes + begin * kStage;
                stage_copy<kInBF16, kStageBF16>(dst, x + (d * shard_elems + begin) * kIn, n);
                __syncthreads();
                if (threadIdx.x == 0) {
                    fence_acq_rel_sys();
                    st_release_sys(ctrl.chunk_flags(d) + rank * kAgrsMaxSenders + b, chunk_flag(epoch, round));
                }
            }
            if (!any)
                break;
        }
    } else {
        const int q = blockIdx.x - num_senders, num_reducers = gridDim.x - num_senders;
        const int64_t len = shard_len(num_elems, shard_elems, rank);
        const int64_t num_chunks = (len + chunk_elems - 1) / chunk_elems;
        const uint8_t* own = x + static_cast<int64_t>(rank) * shard_elems * kIn;
        const uint8_t* slots = ctrl.base(rank) + recv_offset;
        for (int64_t k = q; k < num_chunks; k += num_reducers) {
            if (!agrs_wait_peers<kNumRanks, uint64_t>(ctrl, ctrl.chunk_flags(rank) + k % num_senders, kAgrsMaxSenders,
                                                      chunk_flag(epoch, k / num_senders), timeout_ns, sink,
                                                      kAgrsAuxChunkWait))
                return;
            const int64_t begin = k * chunk_elems;
            const int64_t n = len - begin < chunk_elems ? len - begin : chunk_elems;
            const int64_t num_units = n / kUnit;
            // kRedUnroll units per thread and pass, every rank's piece of each loaded before any is summed: loads
            // in flight are what bounds a reducer block's bandwidth. One load per rank through a selected pointer
            // (loads on divergent branches would put v in local memory). When the staging is narrower than the
            // input, this rank's piece is loaded separately and rounded, and v[u][rank] (the first half of it, read
            // as bfloat16; an L1 hit) is ignored.
            constexpr bool kOwnApart = kStageBF16 && !kInBF16;
            for (int64_t g0 = threadIdx.x; g0 < num_units; g0 += kAgrsThreads * kRedUnroll) {
                float v[kRedUnroll][kNumRanks][kUnit];
                float own_v[kRedUnroll][kUnit];
                #pragma unroll
                for (int u = 0; u < kRedUnroll; ++u) {
                    const int64_t e = begin + (g0 + u * kAgrsThreads) * kUnit;
                    if (g0 + u * kAgrsThreads < num_units) {
                        if (kOwnApart)
                            load_n<kUnit, false, false>(own + e * kIn, own_v[u]);
                        #pragma unroll
                        for (int r = 0; r < kNumRanks; ++r)
                            load_n<kUnit, kStageBF16, false>(
                                r == rank ? own + e * kIn : slots + r * slot_bytes + e * kStage, v[u][r]);
                    }
                }
                #pragma unroll
                for (int u = 0; u < kRedUnroll; ++u) {
                    const int64_t e = begin + (g0 + u * kAgrsThreads) * kUnit;
                    if (g0 + u * kAgrsThreads >= num_units)
                        continue;
                    float acc[kUnit];
                    #pragma unroll
                    for (int i = 0; i < kUnit; ++i) {
                        float s = 0.f;
                        #pragma unroll
                        for (int r = 0; r < kNumRanks; ++r) {
                            // This rank's piece enters the sum rounded to the staging precision like the others.
                            const float t = (kOwnApart && r == rank) ? round_bf16(own_v[u][i]) : v[u][r][i];
                            s = r == 0 ? t : __fadd_rn(s, t);
                        }
                        acc[i] = __fmul_rn(s, scale);
                    }
                    store_n<kUnit, kInBF16>(out + e * kIn, acc);
                    if (is_all_reduce == 1) {
                        #pragma unroll
                        for (int p = 0; p < kNumRanks; ++p)
                            if (p != rank)
                                store_n<kUnit, false>(ctrl.base(p) + gather_offset + rank * gather_slot_bytes + e * 4,
                                                      acc);
                    }
                }
            }
            for (int64_t e = begin + num_units * kUnit + threadIdx.x; e < begin + n; e += kAgrsThreads) {
                float s = 0.f;
                #pragma unroll
                for (int r = 0; r < kNumRanks; ++r) {
                    float t = r == rank ? load1<kInBF16>(own + e * kIn) : load1<kStageBF16>(slots + r * slot_bytes +
                                                                                             e * kStage);
                    if (r == rank && kStageBF16 && !kInBF16)
                        t = round_bf16(t);
                    s = r == 0 ? t : __fadd_rn(s, t);
                }
                const float result = __fmul_rn(s, scale);
                store1<kInBF16>(out + e * kIn, result);
                if (is_all_reduce == 1) {
                    #pragma unroll
                    for (int p = 0; p < kNumRanks; ++p)
                        if (p != rank)
                            store1<false>(ctrl.base(p) + gather_offset + rank * gather_slot_bytes + e * 4, result);
                }
            }
        }
    }

    if (!last_block_done(ctrl.local() + kAgrsTicketReduce))
        return;
    const int p = threadIdx.x;
    if (p < kNumRanks && p != rank)
        st_release_sys(ctrl.words(p) + (is_all_reduce ? kAgrsSigShard : kAgrsSigDone) + rank, epoch);
}

// All-reduce, second step: copy every peer's reduced shard from this rank's gather slots into x (FP32, in place);
// with `publish_done`, then publish done[me] = epoch at every peer.
template <int kNumRanks>
__global__ void __launch_bounds__(kAgrsThreads, 1)
agrs_unpack_kernel(uint8_t* x, int64_t num_elems, int64_t shard_elems, const uint64_t* peer_bases, int rank,
                   uint64_t gather_offset, uint64_t gather_slot_bytes, uint32_t epoch, int publish_done,
                   int32_t* error_record, uint64_t timeout_ns) {
    const AgrsCtrl ctrl{peer_bases, rank};
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    if (!agrs_wait_peers<kNumRanks, uint32_t>(ctrl, ctrl.local() + kAgrsSigShard, 1, epoch, timeout_ns, sink,
                                              kAgrsAuxShardWait))
        return;
    const int64_t num_threads = static_cast<int64_t>(gridDim.x) * kAgrsThreads;
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * kAgrsThreads + threadIdx.x;
    #pragma unroll
    for (int j = 1; j < kNumRanks; ++j) {
        const int d = (rank + j) % kNumRanks;
        const int64_t len = shard_len(num_elems, shard_elems, d);
        const uint8_t* src = ctrl.base(rank) + gather_offset + d * gather_slot_bytes;
        uint8_t* dst = x + d * shard_elems * 4;
        const int64_t num_vectors = len / 4;
        grid_stride_copy<kAgrsGatherUnroll>(
            num_vectors, tid, num_threads, [&](int64_t i) { return ld_v4(src + i * 16); },
            [&](int64_t i, const Vec16& v) { st_na_v4(dst + i * 16, v); });
        for (int64_t i = num_vectors * 4 + tid; i < len; i += num_threads)
            reinterpret_cast<float*>(dst)[i] = reinterpret_cast<const float*>(src)[i];
    }
    // Hybrid mode publishes done[me] only after its rail step (a second launch with nothing to copy).
    if (!publish_done || !last_block_done(ctrl.local() + kAgrsTicketUnpack))
        return;
    const int p = threadIdx.x;
    if (p < kNumRanks && p != rank)
        st_release_sys(ctrl.words(p) + kAgrsSigDone + rank, epoch);
}

// ---- hybrid mode (several scale-up domains joined by rails) -------------------------------------------------------
// The rail exchanges themselves are host-issued (runtime/rails.py transports); these kernels prepare and finish them.
// `rail` is this rank's rail area (workspace region kWsAgrsRailOffset, common/workspace.cuh): the send header at
// byte kAgrsRailSendHeader, the receive header of domain m at kAgrsRailRecvHeader + 16 * m, the effective meta word
// at kAgrsRailMetaWord.
constexpr int kAgrsRailSendHeader = 2304, kAgrsRailRecvHeader = 2560, kAgrsRailMetaWord = 2432;
static_assert(kAgrsRailRecvHeader + 16 * 16 <= kWsAgrsRailBytes, "the rail headers of 16 domains overflow the area");

// mode 0 (before the all-gather's rail exchange): write `meta` into the send header. mode 1 (after it): compare every
// rail peer's header with `meta` and publish the effective meta (see kAgrsMetaMismatch / kAgrsMetaSkip).
__global__ void agrs_rail_meta_kernel(uint8_t* rail, int num_domains, int domain, uint32_t meta, int mode,
                                      const uint64_t* peer_bases, int rank) {
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    if (mode == 0) {
        *reinterpret_cast<uint32_t*>(rail + kAgrsRailSendHeader) = meta;
        return;
    }
    uint32_t eff = meta;
    for (int m = 0; m < num_domains; ++m)
        if (m != domain && *reinterpret_cast<const uint32_t*>(rail + kAgrsRailRecvHeader + 16 * m) != meta)
            eff = kAgrsMetaMismatch;
    if (timeout_reported(make_error_sink(peer_bases, rank, nullptr)))
        eff = kAgrsMetaSkip;
    *reinterpret_cast<uint32_t*>(rail + kAgrsRailMetaWord) = eff;
}

// Reduce-scatter input, reordered for the in-domain step: xp[(r * N + m) * n + i] = x[(m * R + r) * n + i] in FP32
// (exact), so that scale-up rank r's piece (the shards (m, r) of every domain m) is contiguous.
template <bool kInBF16>
__global__ void __launch_bounds__(kAgrsThreads)
agrs_hybrid_permute_kernel(const uint8_t* x, float* xp, int64_t shard_elems, int num_domains, int num_scaleup) {
    const int64_t total = shard_elems * num_domains * num_scaleup;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kAgrsThreads;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * kAgrsThreads + threadIdx.x; j < total; j += stride) {
        const int64_t piece = j / shard_elems, i = j - piece * shard_elems;
        const int64_t r = piece / num_domains, m = piece - r * num_domains;
        xp[j] = load1<kInBF16>(x + ((m * num_scaleup + r) * shard_elems + i) * (kInBF16 ? 2 : 4));
    }
}

// The final sum over domains: out[i] = round((p_0[i] + p_1[i] + ... + p_{N-1}[i]) * scale) in FP32, domains in order
// 0..N-1, p_domain = own[i] (this rank's domain partial), p_m = slot m of `slots` (rail peer m's partial, FP32).
template <bool kOutBF16>
__global__ void __launch_bounds__(kAgrsThreads)
agrs_hybrid_sum_kernel(uint8_t* out, const float* own, const uint8_t* slots, uint64_t slot_bytes, int num_domains,
                       int domain, int64_t num_elems, float scale) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kAgrsThreads;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kAgrsThreads + threadIdx.x; i < num_elems; i += stride) {
        float s = 0.f;
        for (int m = 0; m < num_domains; ++m) {
            const float v = m == domain ? own[i] : reinterpret_cast<const float*>(slots + m * slot_bytes)[i];
            s = m == 0 ? v : __fadd_rn(s, v);
        }
        store1<kOutBF16>(out + i * (kOutBF16 ? 2 : 4), __fmul_rn(s, scale));
    }
}

}  // namespace deepep
