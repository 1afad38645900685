// The memory map of a buffer's small shared areas, in one place:
//   - the symmetric workspace: the first kWorkspaceBytes of every rank's symmetric buffer, at the same offsets on
//     every rank (peers address each other's words), holding signals, epochs and small control data;
//   - the host-mapped memory of a buffer (pinned, mapped into the GPU's address space): records the host polls.
// Byte offsets and sizes; each region's user documents its words in the file named. The data region of the buffer
// (what features lay out their slots in) starts at kWorkspaceBytes. deepep_cupy/runtime/workspace.py mirrors these
// values (tests/test_workspace_cpu.py reads this file and compares). Values are plain decimal literals on purpose.
#pragma once
#include "common/types.cuh"

namespace deepep {

// ---- symmetric workspace ---------------------------------------------------------------------------------------
constexpr uint64_t kWorkspaceBytes = 2097152;
constexpr uint64_t kWsBarrierOffset = 0;                 // barrier.cu: epoch and arrivals
constexpr uint64_t kWsBarrierBytes = 512;
constexpr uint64_t kWsErrorClaimOffset = 512;            // common/timeout.cuh: the error claim word
constexpr uint64_t kWsErrorClaimBytes = 512;
constexpr uint64_t kWsBarrierTestOffset = 4096;          // barrier.cu: check slots of the barrier test kernels
constexpr uint64_t kWsBarrierTestBytes = 4096;
constexpr uint64_t kWsEPCtrlOffset = 8192;               // common/ep.cuh: EP epochs, tickets, signals
constexpr uint64_t kWsEPCtrlBytes = 8192;
constexpr uint64_t kWsPeerCopyOffset = 16384;            // peer_copy.cu: control words
constexpr uint64_t kWsPeerCopyBytes = 4096;
constexpr uint64_t kWsPPOffset = 20480;                  // pp.cu: PP send/recv control words
constexpr uint64_t kWsPPBytes = 4096;
constexpr uint64_t kWsAgrsOffset = 24576;                // agrs.cu: all-gather / reduce-scatter control words
constexpr uint64_t kWsAgrsBytes = 4096;
constexpr uint64_t kWsEngramOffset = 28672;              // engram.cu: control words
constexpr uint64_t kWsEngramBytes = 2048;
constexpr uint64_t kWsLBOffset = 30720;                  // lb.cu: load-balancing control words
constexpr uint64_t kWsLBBytes = 2048;
constexpr uint64_t kWsBucketOffset = 32768;              // bucket.cu: per communication context, kernel and barrier words
constexpr uint64_t kWsBucketBytes = 16384;
constexpr uint64_t kWsEPNotifyOffset = 65536;            // common/ep.cuh: notify counts [src][1 + L]
constexpr uint64_t kWsEPNotifyBytes = 65536;
constexpr uint64_t kWsEPChunkSignalOffset = 131072;      // ep_combine.cu: combine chunk signals [src][chunk]
constexpr uint64_t kWsEPChunkSignalBytes = 1048576;
constexpr uint64_t kWsEPDispatchSignalOffset = 1179648;  // ep_dispatch.cu: dispatch chunk signals [src][chunk]
constexpr uint64_t kWsEPDispatchSignalBytes = 524288;
constexpr uint64_t kWsAgrsRailOffset = 1703936;          // agrs.cu, hybrid mode: rail flags (loopback) and headers
constexpr uint64_t kWsAgrsRailBytes = 4096;

// ---- host-mapped memory ----------------------------------------------------------------------------------------
constexpr uint64_t kHostMappedBytes = 65536;
constexpr uint64_t kHostErrorRecordOffset = 0;           // common/types.cuh: the error record (kErrorRecordWords)
constexpr uint64_t kHostErrorRecordBytes = 1024;
constexpr uint64_t kHostEPCountsOffset = 1024;           // ep_notify.cu: [seq, num_recv, num_expanded, counts[L]], max
constexpr uint64_t kHostEPCountsBytes = 7168;
constexpr uint64_t kHostEPRangeOffset = 8192;            // common/value_range.cuh: top-k id range [seq, lo, hi]
constexpr uint64_t kHostEPRangeBytes = 64;
constexpr uint64_t kHostEngramRangeOffset = 8256;        // common/value_range.cuh: engram index range [seq, lo, hi]
constexpr uint64_t kHostEngramRangeBytes = 64;
constexpr uint64_t kHostPPErrorOffset = 8320;            // pp.cu: the PP size-mismatch record (kPPErrorWords)
constexpr uint64_t kHostPPErrorBytes = 64;

// ---- checks: regions in address order, 16-byte aligned, disjoint, inside their area ------------------------------
#define DEEPEP_WS_ALIGNED(name) static_assert(name % 16 == 0, #name " must be 16-byte aligned");
#define DEEPEP_WS_BEFORE(a, b) \
    static_assert(a##Offset + a##Bytes <= b##Offset, #a " overlaps " #b " (regions must be disjoint, in order)");
DEEPEP_WS_ALIGNED(kWsBarrierOffset) DEEPEP_WS_ALIGNED(kWsErrorClaimOffset) DEEPEP_WS_ALIGNED(kWsBarrierTestOffset)
DEEPEP_WS_ALIGNED(kWsEPCtrlOffset) DEEPEP_WS_ALIGNED(kWsPeerCopyOffset) DEEPEP_WS_ALIGNED(kWsPPOffset)
DEEPEP_WS_ALIGNED(kWsAgrsOffset) DEEPEP_WS_ALIGNED(kWsEngramOffset) DEEPEP_WS_ALIGNED(kWsLBOffset)
DEEPEP_WS_ALIGNED(kWsBucketOffset) DEEPEP_WS_ALIGNED(kWsEPNotifyOffset) DEEPEP_WS_ALIGNED(kWsEPChunkSignalOffset)
DEEPEP_WS_ALIGNED(kWsEPDispatchSignalOffset) DEEPEP_WS_ALIGNED(kWsAgrsRailOffset)
DEEPEP_WS_BEFORE(kWsBarrier, kWsErrorClaim) DEEPEP_WS_BEFORE(kWsErrorClaim, kWsBarrierTest)
DEEPEP_WS_BEFORE(kWsBarrierTest, kWsEPCtrl) DEEPEP_WS_BEFORE(kWsEPCtrl, kWsPeerCopy)
DEEPEP_WS_BEFORE(kWsPeerCopy, kWsPP) DEEPEP_WS_BEFORE(kWsPP, kWsAgrs) DEEPEP_WS_BEFORE(kWsAgrs, kWsEngram)
DEEPEP_WS_BEFORE(kWsEngram, kWsLB) DEEPEP_WS_BEFORE(kWsLB, kWsBucket) DEEPEP_WS_BEFORE(kWsBucket, kWsEPNotify)
DEEPEP_WS_BEFORE(kWsEPNotify, kWsEPChunkSignal) DEEPEP_WS_BEFORE(kWsEPChunkSignal, kWsEPDispatchSignal)
DEEPEP_WS_BEFORE(kWsEPDispatchSignal, kWsAgrsRail)
static_assert(kWsAgrsRailOffset + kWsAgrsRailBytes <= kWorkspaceBytes, "the workspace regions overflow");
DEEPEP_WS_ALIGNED(kHostErrorRecordOffset) DEEPEP_WS_ALIGNED(kHostEPCountsOffset) DEEPEP_WS_ALIGNED(kHostEPRangeOffset)
DEEPEP_WS_ALIGNED(kHostEngramRangeOffset) DEEPEP_WS_ALIGNED(kHostPPErrorOffset)
DEEPEP_WS_BEFORE(kHostErrorRecord, kHostEPCounts) DEEPEP_WS_BEFORE(kHostEPCounts, kHostEPRange)
DEEPEP_WS_BEFORE(kHostEPRange, kHostEngramRange) DEEPEP_WS_BEFORE(kHostEngramRange, kHostPPError)
static_assert(kHostPPErrorOffset + kHostPPErrorBytes <= kHostMappedBytes, "the host-mapped regions overflow it");
#undef DEEPEP_WS_ALIGNED
#undef DEEPEP_WS_BEFORE

// What the regions hold must fit them.
static_assert(kErrorRecordWords * 4 <= kHostErrorRecordBytes, "the error record overflows its region");
static_assert(8 * 3 <= kHostEPRangeBytes && 8 * 3 <= kHostEngramRangeBytes, "a range record is 3 int64 words");
static_assert(4 * 8 <= kHostPPErrorBytes, "the PP error record is 8 int32 words");
// EP: up to 8 ranks and 1024 local experts (deepep_cupy/features/ep/layout.py NUM_MAX_LOCAL_EXPERTS).
static_assert(4 * (3 + 1024 + 1) <= kHostEPCountsBytes,
              "the dispatch counts of 1024 local experts and the max token count overflow their region");
static_assert(4 * 8 * (1 + 1024) <= kWsEPNotifyBytes, "the notify counts of 8 ranks x 1024 experts overflow");

}  // namespace deepep
