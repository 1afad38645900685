// Bucket collectives (DeepEP V2.5 `BucketBuffer`): all-gather, reduce-scatter and all-reduce IN PLACE on tensors that
// live in the buffer's registered storage, over the ranks of one communication context (a group inside one NVLink
// domain). deepep_cupy/features/agrs/bucket.py launches them; every offset below is a byte offset from each rank's
// symmetric allocation base and is identical on every rank (the tensors sit at the same place in every rank's storage,
// which is what a shared `BufferAllocator` plan gives).
//
// Each call is ONE cooperative launch (so a profile shows one kernel per call, named after DeepEP's): phases of local
// work separated by rank barriers. A rank barrier: every thread publishes its writes (system-scope fence), the grid
// meets (software grid barrier on this context's local words), thread p < kNumRanks of block 0 stores the barrier's
// epoch into arrive[me] at peer p (release) and waits until arrive[p] of this rank reaches it (acquire, bounded), and
// the grid meets again. Peers' data is then read (pull) with L1-bypassing loads; nothing is ever pushed, so a rank
// only writes its own memory and all cross-rank ordering is in the barriers:
//   all-gather     (R x B bytes at `offset`, this rank's shard [me * B, + B)): [copy `src` into the own shard when it
//                  is elsewhere] barrier 1 (every shard in place) -> copy shard p from peer p, for every p != me ->
//                  barrier 2 (no peer reads this rank's shard any more).
//   reduce-scatter (N fp32 at `offset`, shard S = N / R): barrier 1 (every input complete) -> own shard =
//                  scale * sum over p = 0..R-1 of peer p's own-shard elements (FP32, that order) -> barrier 2 (no peer
//                  reads this rank's input any more).
//   all-reduce     (N fp32, shard S = align(ceil(N / R), 4), the last shards shorter or empty): barrier 1 -> reduce the
//                  own shard as above -> barrier 2 (every shard reduced, no peer reads the input any more) -> copy
//                  shard p from peer p, p != me -> barrier 3.
// Barrier epochs: the host counts this context's in-kernel barriers (every rank makes the same calls), a call's k-th
// barrier has epoch `epoch + k`. A rank can be at most one barrier ahead of any peer, so "reached" (wrap-safe >=) is
// exact.
//
// Words of a context: the slice [kBucketCtrlOffset + context * kBucketContextBytes, + kBucketContextBytes) of the
// workspace (common/workspace.cuh); uint32:
//   [0] grid barrier count, [1] grid barrier generation (local), [2] abort: the epoch of a barrier that timed out
//   arrive[src]  word 32 + src: the last barrier epoch rank `src` announced to this rank (written only by src)
//   bytes [kBucketBarrierOffset, kBucketContextBytes): the words of the context's `barrier_kernel` (barrier.cu).
#include "common/ep.cuh"

namespace deepep {

constexpr uint64_t kBucketCtrlOffset = kWsBucketOffset;     // common/workspace.cuh
constexpr uint64_t kBucketCtrlBytes = kWsBucketBytes;
constexpr int kBucketContextBytes = 1024;
constexpr int kBucketBarrierOffset = 512;
constexpr int kBucketThreads = 512;
constexpr int kBucketGridCount = 0, kBucketGridGen = 1, kBucketAbort = 2, kBucketArrive = 32;
static_assert(kBucketCtrlBytes % kBucketContextBytes == 0, "bucket contexts must tile their workspace region");
static_assert((kBucketArrive + 32) * 4 <= kBucketBarrierOffset, "bucket words overflow into the barrier's");

enum BucketOp : int { kBucketAllGather = 0, kBucketReduceScatter = 1, kBucketAllReduce = 2 };

__device__ __forceinline__ uint32_t* bucket_words(const uint64_t* peer_bases, int peer, uint64_t ctrl_offset) {
    return reinterpret_cast<uint32_t*>(peer_bases[peer] + ctrl_offset);
}

// L2-coherent loads (peers' memory, written before the barrier this thread passed through its block and grid):
// they bypass L1, which may hold a neighbouring line read in an earlier phase.
__device__ __forceinline__ Vec16 ld_cg_v4(const void* p) {
    Vec16 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float ld_cg_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ uint8_t ld_cg_u8(const uint8_t* p) {
    uint16_t v;
    asm volatile("ld.global.cg.u8 %0, [%1];" : "=h"(v) : "l"(p));
    return static_cast<uint8_t>(v);
}

__device__ __forceinline__ float4 as_float4(const Vec16& v) {
    return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
}

// Software grid barrier (cooperative launch: every block is resident) on this context's local words.
__device__ __forceinline__ void bucket_grid_sync(uint32_t* words) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile uint32_t* gen = words + kBucketGridGen;
        const uint32_t g = *gen;
        __threadfence();
        if (atomicAdd(words + kBucketGridCount, 1u) == gridDim.x - 1) {
            *reinterpret_cast<volatile uint32_t*>(words + kBucketGridCount) = 0;
            __threadfence();
            atomicExch(words + kBucketGridGen, g + 1);
        } else {
            while (*gen == g) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

// The rank barrier described above; false (in every thread) when a wait timed out (reported through `sink`).
template <int kNumRanks>
__device__ __forceinline__ bool bucket_rank_barrier(const uint64_t* peer_bases, int rank, uint64_t ctrl_offset,
                                                    uint32_t epoch, uint64_t timeout_ns, const ErrorSink& sink,
                                                    int aux) {
    __threadfence_system();
    uint32_t* local = bucket_words(peer_bases, rank, ctrl_offset);
    bucket_grid_sync(local);
    if (blockIdx.x == 0 && threadIdx.x < kNumRanks) {
        const int peer = threadIdx.x;
        st_release_sys(bucket_words(peer_bases, peer, ctrl_offset) + kBucketArrive + rank, epoch);
        if (!wait_epoch(local + kBucketArrive + peer, epoch, timeout_ns, sink, kPhaseBucket, rank, peer, aux))
            atomicExch(local + kBucketAbort, epoch);
    }
    bucket_grid_sync(local);
    return read_local(local + kBucketAbort) != epoch;
}

// Copy `num_bytes` from `src` (a peer's memory when `from_peer`, else local) to local `dst` with a grid stride:
// 16-byte vectors when both are 16-byte aligned, the rest byte by byte.
__device__ __forceinline__ void bucket_copy(uint8_t* dst, const uint8_t* src, int64_t num_bytes, bool from_peer) {
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * kBucketThreads + threadIdx.x;
    const int64_t num_threads = static_cast<int64_t>(gridDim.x) * kBucketThreads;
    int64_t num_vectors = 0;
    if (((reinterpret_cast<uint64_t>(dst) | reinterpret_cast<uint64_t>(src)) & 15) == 0) {
        num_vectors = num_bytes / 16;
        for (int64_t i = tid; i < num_vectors; i += num_threads)
            st_na_v4(dst + i * 16, from_peer ? ld_cg_v4(src + i * 16) : ld_nc_v4(src + i * 16));
    }
    for (int64_t i = num_vectors * 16 + tid; i < num_bytes; i += num_threads)
        dst[i] = from_peer ? ld_cg_u8(src + i) : src[i];
}

// local[begin, begin + n) = scale * sum over ranks p = 0..kNumRanks-1 of rank p's [begin, begin + n) (fp32 elements
// from byte `offset` of every allocation), accumulated in FP32 in rank order.
template <int kNumRanks>
__device__ __forceinline__ void bucket_reduce(const uint64_t* peer_bases, int rank, uint64_t offset, int64_t begin,
                                              int64_t n, float scale) {
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * kBucketThreads + threadIdx.x;
    const int64_t num_threads = static_cast<int64_t>(gridDim.x) * kBucketThreads;
    const float* in[kNumRanks];
    #pragma unroll
    for (int p = 0; p < kNumRanks; ++p)
        in[p] = reinterpret_cast<const float*>(peer_bases[p] + offset) + begin;
    float* out = reinterpret_cast<float*>(peer_bases[rank] + offset) + begin;
    int64_t num_vectors = 0;
    if ((reinterpret_cast<uint64_t>(out) & 15) == 0) {
        num_vectors = n / 4;
        for (int64_t i = tid; i < num_vectors; i += num_threads) {
            Vec16 v[kNumRanks];
            #pragma unroll
            for (int p = 0; p < kNumRanks; ++p)
                v[p] = ld_cg_v4(in[p] + i * 4);
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
            #pragma unroll
            for (int p = 0; p < kNumRanks; ++p) {
                const float4 f = as_float4(v[p]);
                acc.x += f.x;
                acc.y += f.y;
                acc.z += f.z;
                acc.w += f.w;
            }
            *reinterpret_cast<float4*>(out + i * 4) = make_float4(acc.x * scale, acc.y * scale, acc.z * scale,
                                                                  acc.w * scale);
        }
    }
    for (int64_t i = num_vectors * 4 + tid; i < n; i += num_threads) {
        float acc = 0.f;
        #pragma unroll
        for (int p = 0; p < kNumRanks; ++p)
            acc += ld_cg_f32(in[p] + i);
        out[i] = acc * scale;
    }
}

// The three collectives (see the top of the file). `num` is the shard's bytes (all-gather) or the tensor's fp32
// elements (reductions); `src` is the all-gather's source when it is not this rank's shard already (else null).
template <int kNumRanks, int kOp>
__device__ __forceinline__ void bucket_collective(const uint64_t* peer_bases, int rank, uint64_t ctrl_offset,
                                                  uint32_t epoch, uint64_t offset, int64_t num, const uint8_t* src,
                                                  float scale, int32_t* error_record, uint64_t timeout_ns) {
    static_assert(kNumRanks >= 1 && kNumRanks <= 32, "bucket collectives support up to 32 ranks per context");
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    if (kOp == kBucketAllGather) {
        uint8_t* region = reinterpret_cast<uint8_t*>(peer_bases[rank] + offset);
        if (src != nullptr)
            bucket_copy(region + rank * num, src, num, false);
        if (!bucket_rank_barrier<kNumRanks>(peer_bases, rank, ctrl_offset, epoch, timeout_ns, sink, 1))
            return;
        for (int k = 1; k < kNumRanks; ++k) {
            const int p = (rank + k) % kNumRanks;      // start with the next rank: spreads the links' load
            bucket_copy(region + p * num, reinterpret_cast<const uint8_t*>(peer_bases[p] + offset) + p * num, num,
                        true);
        }
        bucket_rank_barrier<kNumRanks>(peer_bases, rank, ctrl_offset, epoch + 1, timeout_ns, sink, 2);
        return;
    }
    if (!bucket_rank_barrier<kNumRanks>(peer_bases, rank, ctrl_offset, epoch, timeout_ns, sink, 1))
        return;
    const int64_t shard = kOp == kBucketReduceScatter ? num / kNumRanks
                                                      : (num + 4 * kNumRanks - 1) / (4 * kNumRanks) * 4;
    const int64_t begin = static_cast<int64_t>(rank) * shard;
    const int64_t len = begin < num ? (num - begin < shard ? num - begin : shard) : 0;
    bucket_reduce<kNumRanks>(peer_bases, rank, offset, begin, len, scale);
    if (!bucket_rank_barrier<kNumRanks>(peer_bases, rank, ctrl_offset, epoch + 1, timeout_ns, sink, 2))
        return;
    if (kOp == kBucketReduceScatter)
        return;
    uint8_t* data = reinterpret_cast<uint8_t*>(peer_bases[rank] + offset);
    for (int k = 1; k < kNumRanks; ++k) {
        const int p = (rank + k) % kNumRanks;
        const int64_t p_begin = static_cast<int64_t>(p) * shard;
        const int64_t p_len = p_begin < num ? (num - p_begin < shard ? num - p_begin : shard) : 0;
        bucket_copy(data + p_begin * 4, reinterpret_cast<const uint8_t*>(peer_bases[p] + offset) + p_begin * 4,
                    p_len * 4, true);
    }
    bucket_rank_barrier<kNumRanks>(peer_bases, rank, ctrl_offset, epoch + 2, timeout_ns, sink, 3);
}

// One kernel per collective, named so that a profile filtered by DeepEP's kernel names ('all_reduce',
// 'reduce_scatter') matches exactly one of them.
template <int kNumRanks>
__global__ void __launch_bounds__(kBucketThreads, 1)
bucket_all_gather_impl(const uint64_t* peer_bases, int rank, uint64_t ctrl_offset, uint32_t epoch, uint64_t offset,
                       int64_t num, const uint8_t* src, float scale, int32_t* error_record, uint64_t timeout_ns) {
    bucket_collective<kNumRanks, kBucketAllGather>(peer_bases, rank, ctrl_offset, epoch, offset, num, src, scale,
                                                   error_record, timeout_ns);
}

template <int kNumRanks>
__global__ void __launch_bounds__(kBucketThreads, 1)
bucket_reduce_scatter_impl(const uint64_t* peer_bases, int rank, uint64_t ctrl_offset, uint32_t epoch,
                           uint64_t offset, int64_t num, const uint8_t* src, float scale, int32_t* error_record,
                           uint64_t timeout_ns) {
    bucket_collective<kNumRanks, kBucketReduceScatter>(peer_bases, rank, ctrl_offset, epoch, offset, num, src, scale,
                                                       error_record, timeout_ns);
}

template <int kNumRanks>
__global__ void __launch_bounds__(kBucketThreads, 1)
bucket_all_reduce_impl(const uint64_t* peer_bases, int rank, uint64_t ctrl_offset, uint32_t epoch, uint64_t offset,
                       int64_t num, const uint8_t* src, float scale, int32_t* error_record, uint64_t timeout_ns) {
    bucket_collective<kNumRanks, kBucketAllReduce>(peer_bases, rank, ctrl_offset, epoch, offset, num, src, scale,
                                                   error_record, timeout_ns);
}

}  // namespace deepep
