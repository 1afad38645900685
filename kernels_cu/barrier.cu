// GPU barrier over the ranks of a symmetric buffer (one scale-up domain, CUDA IPC).
//
// Protocol (epochs, nothing is ever cleared):
//   signals (symmetric offset `signal_offset` in every rank's buffer: kWsBarrierOffset of common/workspace.cuh):
//     uint32 epoch           -- this rank's barrier count; written only by this rank's barrier kernel
//     uint32 arrive[8]       -- at offset 128: arrive[src] = last epoch rank `src` announced to this rank
//   One block of 32 threads. Thread 0 bumps the local epoch to e. Thread t < kNumRanks writes e into
//   arrive[rank] of rank t with a system-scope release store (publishing everything this rank wrote before, earlier
//   kernels on the stream included), then waits with acquire loads until its own arrive[t] reaches e
//   (exchange_epoch, common/timeout.cuh).
//   A rank can run at most one epoch ahead of any peer, so "reached" (wrap-safe >=) is exact.
#include "common/timeout.cuh"

namespace deepep {

constexpr int kBarrierArriveOffset = 128;
static_assert(kBarrierArriveOffset + 4 * 32 <= kWsBarrierBytes, "barrier words overflow their workspace region");

template <int kNumRanks>
__global__ void __launch_bounds__(32, 1)
barrier_kernel(const uint64_t* peer_bases, uint64_t signal_offset, int rank, int32_t* error_record,
               uint64_t timeout_ns) {
    static_assert(kNumRanks >= 1 && kNumRanks <= 32, "barrier supports up to 32 ranks per domain");
    __shared__ uint32_t s_epoch;
    auto* local = reinterpret_cast<uint8_t*>(peer_bases[rank]) + signal_offset;
    if (threadIdx.x == 0) {
        auto* epoch = reinterpret_cast<uint32_t*>(local);
        s_epoch = *epoch + 1;
        *epoch = s_epoch;
    }
    __syncthreads();
    const uint32_t e = s_epoch;
    const int peer = threadIdx.x;
    if (peer < kNumRanks) {
        auto* remote = reinterpret_cast<uint8_t*>(peer_bases[peer]) + signal_offset + kBarrierArriveOffset;
        exchange_epoch(reinterpret_cast<uint32_t*>(remote),
                       reinterpret_cast<const uint32_t*>(local + kBarrierArriveOffset), rank, peer, e, timeout_ns,
                       peer_bases, error_record, kPhaseBarrier);
    }
    __syncthreads();
}

// Test helper for the barrier rank program: write `value` into slot [rank] of every peer's check area (the workspace's
// kWsBarrierTestOffset), optionally after spinning `delay_ns` (to prove the barrier waits for a late rank). Its name
// leaves out "barrier" so that a profile filtered by that name matches the barrier kernel only.
__global__ void ring_test_write(const uint64_t* peer_bases, uint64_t check_offset, int rank, int num_ranks,
                                uint32_t value, uint64_t delay_ns) {
    if (delay_ns > 0 && threadIdx.x == 0) {
        const uint64_t start = global_timer_ns();
        while (global_timer_ns() - start < delay_ns) {
        }
    }
    __syncthreads();
    for (int peer = threadIdx.x; peer < num_ranks; peer += blockDim.x) {
        auto* slot = reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(peer_bases[peer]) + check_offset) + rank;
        *reinterpret_cast<volatile uint32_t*>(slot) = value;
    }
}

// Count slots of this rank's check area that do not hold `value` (accumulated into *num_mismatches).
__global__ void ring_test_check(const uint64_t* peer_bases, uint64_t check_offset, int rank, int num_ranks,
                                uint32_t value, int32_t* num_mismatches) {
    const auto* slots = reinterpret_cast<const uint32_t*>(reinterpret_cast<uint8_t*>(peer_bases[rank]) + check_offset);
    for (int src = threadIdx.x; src < num_ranks; src += blockDim.x)
        if (reinterpret_cast<const volatile uint32_t*>(slots)[src] != value)
            atomicAdd(num_mismatches, 1);
}

}  // namespace deepep
