// Bounded waits. A thread that gives up claims the error once (first writer wins, through an atomic on a claim word
// in the rank's own device workspace), fills in the host-mapped error record (who waited for what) and returns
// false; the host turns the record into a TimeoutError naming the phase and peer. Atomics stay in device memory:
// host-mapped memory is only written with plain stores.
#pragma once
#include "common/sync.cuh"
#include "common/workspace.cuh"

namespace deepep {

// Byte offset of the claim word inside every rank's symmetric workspace (common/workspace.cuh).
constexpr uint64_t kErrorClaimOffset = kWsErrorClaimOffset;

struct ErrorSink {
    int32_t* claim;    // device memory, local
    int32_t* record;   // host-mapped, kErrorRecordWords words
};

__device__ __forceinline__ ErrorSink make_error_sink(const uint64_t* peer_bases, int rank, int32_t* host_record) {
    return {reinterpret_cast<int32_t*>(peer_bases[rank] + kErrorClaimOffset), host_record};
}

__device__ __forceinline__ void report_timeout(const ErrorSink& sink, int phase, int rank, int peer,
                                               int64_t expected, int64_t observed, int aux) {
    if (atomicCAS(sink.claim, 0, 1) != 0)
        return;  // someone already reported
    volatile int32_t* rec = sink.record;
    rec[0] = -1;
    rec[1] = phase;
    rec[2] = rank;
    rec[3] = peer;
    rec[4] = static_cast<int32_t>(expected);
    rec[5] = static_cast<int32_t>(observed);
    rec[6] = aux;
    __threadfence_system();
    rec[0] = 1;
    __threadfence_system();
}

// Whether a timeout was already reported (lets other waiters give up early instead of each waiting the full time).
__device__ __forceinline__ bool timeout_reported(const ErrorSink& sink) {
    return *reinterpret_cast<const volatile int32_t*>(sink.claim) != 0;
}

// Spin until `*flag` reaches epoch `target` (acquire, system scope) or `timeout_ns` passes.
// Returns true on success; on timeout reports (phase, rank, peer, target, last seen, aux) and returns false.
__device__ __forceinline__ bool wait_epoch(const uint32_t* flag, uint32_t target, uint64_t timeout_ns,
                                           const ErrorSink& sink, int phase, int rank, int peer, int aux = 0) {
    uint32_t seen = ld_acquire_sys(flag);
    if (epoch_reached(seen, target))
        return true;
    const uint64_t start = global_timer_ns();
    for (uint32_t iter = 0;; ++iter) {
        seen = ld_acquire_sys(flag);
        if (epoch_reached(seen, target))
            return true;
        if ((iter & 255) == 255) {
            if (global_timer_ns() - start > timeout_ns) {
                report_timeout(sink, phase, rank, peer, target, seen, aux);
                return false;
            }
            if (timeout_reported(sink))
                return false;
        }
    }
}

// Epoch exchange with one peer, the handshake of the barrier, the peer copy, engram and load balancing: this rank
// announces `epoch` in slot [rank] of `peer`'s uint32 signal array (release store, system scope: it publishes
// everything this rank wrote before, earlier kernels on its stream included), then waits (acquire, bounded, reported
// as (phase, rank, peer, epoch, last seen, aux)) until `peer` announced `epoch` in slot [peer] of this rank's array.
// Returns false on a timeout. The array sits at byte `signal_offset` of every rank's symmetric buffer.
__device__ __forceinline__ bool exchange_epoch(const uint64_t* peer_bases, uint64_t signal_offset, int rank, int peer,
                                               uint32_t epoch, uint64_t timeout_ns, const ErrorSink& sink, int phase,
                                               int aux = 0) {
    st_release_sys(reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(peer_bases[peer]) + signal_offset) + rank,
                   epoch);
    return wait_epoch(reinterpret_cast<const uint32_t*>(reinterpret_cast<const uint8_t*>(peer_bases[rank]) +
                                                        signal_offset) + peer,
                      epoch, timeout_ns, sink, phase, rank, peer, aux);
}

// The same with the two arrays given (`peer_signals` in `peer`'s buffer, `my_signals` in this rank's), for kernels
// without an error sink at hand: it is made (one read of the peer table) after the announcement.
__device__ __forceinline__ bool exchange_epoch(uint32_t* peer_signals, const uint32_t* my_signals, int rank, int peer,
                                               uint32_t epoch, uint64_t timeout_ns, const uint64_t* peer_bases,
                                               int32_t* error_record, int phase, int aux = 0) {
    st_release_sys(peer_signals + rank, epoch);
    return wait_epoch(my_signals + peer, epoch, timeout_ns, make_error_sink(peer_bases, rank, error_record), phase,
                      rank, peer, aux);
}

}  // namespace deepep
