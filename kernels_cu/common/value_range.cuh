// Min and max of an integer array for host-side argument checks (top-k ids of a CPU-sync dispatch, engram indices):
// one block on the stream that made the array, the result into host-mapped memory [seq, lo, hi] (int64), the
// sequence number last. The host polls the sequence number (deepep_cupy/runtime/host_range.py), so the check
// raises before any communication kernel runs without a stream synchronisation API call.
#pragma once
#include "common/types.cuh"

namespace deepep {

constexpr int kRangeThreads = 1024;
// Loads in flight per thread: the loop is bound by load latency, not bandwidth (one load per iteration makes a chain
// of global-memory round trips; 8 in flight halve the time at 4096 tokens of top-8 ids). Unrolling 16 does not give
// 16: ptxas keeps the kernel at 32 registers and interleaves the loads with the folds, about 6 in flight.
constexpr int kRangeUnroll = 8;

template <typename T>
__global__ void __launch_bounds__(kRangeThreads)
value_range_kernel(const T* values, int64_t num_values, int64_t* host_out, int64_t seq) {
    int64_t lo = 0x7fffffffffffffffLL, hi = -0x7fffffffffffffffLL - 1;
    const int64_t step = static_cast<int64_t>(blockDim.x) * kRangeUnroll, last = num_values - 1;
    for (int64_t base = threadIdx.x; base < num_values; base += step) {
        // Past the end: the last value again, which changes neither min nor max (so the fold needs no bound).
        int64_t v[kRangeUnroll];
        #pragma unroll
        for (int u = 0; u < kRangeUnroll; ++u)
            v[u] = static_cast<int64_t>(__ldg(values + min(base + static_cast<int64_t>(u) * blockDim.x, last)));
        #pragma unroll
        for (int u = 0; u < kRangeUnroll; ++u) {
            lo = min(lo, v[u]);
            hi = max(hi, v[u]);
        }
    }
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        lo = min(lo, static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, static_cast<long long>(lo), d)));
        hi = max(hi, static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, static_cast<long long>(hi), d)));
    }
    __shared__ int64_t s_lo[kRangeThreads / 32], s_hi[kRangeThreads / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        s_lo[warp] = lo;
        s_hi[warp] = hi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) {
            lo = min(lo, s_lo[w]);
            hi = max(hi, s_hi[w]);
        }
        volatile int64_t* out = host_out;
        out[1] = lo;
        out[2] = hi;
        __threadfence_system();
        out[0] = seq;
        __threadfence_system();
    }
}

}  // namespace deepep
