// Peer-copy floor: for each peer p != me, copy send_bytes[p] bytes of a local source buffer into peer p's symmetric
// buffer, then signal completion. It moves exactly the cross-GPU bytes of a dispatch or combine and nothing else (no
// layout pass, no metadata, no receive epilogue), so its time is the floor the EP kernels are compared against
// (perf/ep_bench.py). Launched with any number of blocks of kPeerCopyThreads threads.
//
// Data: the source holds the chunks for peers 0..R-1 back to back (chunk p at the exclusive prefix of send_bytes
// over peers != me; this rank's own entry is ignored). Chunk p lands at byte recv_offset + me * recv_stride of peer
// p's buffer. The 16-byte vectors of all chunks form one index space that the grid walks with a grid stride, so every
// peer gets threads in proportion to its bytes; each thread keeps kPeerCopyUnroll loads in flight before it stores.
//
// Control words: the workspace region kWsPeerCopyOffset (common/workspace.cuh) of every rank's symmetric buffer is
// reserved for this kernel. uint32 words, epochs that only grow, nothing is ever cleared:
//   [0]              epoch: peer copies this rank has run; written only by the last block of this rank's kernel
//   [1]              ticket of last_block_done (local; reset by the last block)
//   arrive[src]      at byte +128: the last epoch in which rank `src` finished writing its chunk into this rank's
//                    buffer; written only by rank src (system-scope release store), read here with acquire loads
// Protocol: every block copies its share; the last block to finish (last_block_done has published every block's
// stores at system scope) bumps the local epoch to e; thread p < R, p != me, stores arrive[me] = e at peer p and then
// waits until its own arrive[p] reaches e. The kernel therefore ends when this rank's data has reached every peer
// and every peer's data has reached this rank. A rank runs at most one epoch ahead of a peer (it cannot finish epoch
// e before the peer's arrive of e), so "reached" (wrap-safe >=) is exact; overwriting a chunk that a peer's previous
// epoch wrote is harmless because nobody reads the data.
#include "common/ep.cuh"

namespace deepep {

constexpr uint64_t kPeerCopyCtrlOffset = kWsPeerCopyOffset;     // common/workspace.cuh
constexpr uint64_t kPeerCopyCtrlBytes = kWsPeerCopyBytes;
constexpr int kPeerCopyEpoch = 0, kPeerCopyTicket = 1;
constexpr int kPeerCopyArriveOffset = 128;
constexpr int kPeerCopyThreads = 512;
constexpr int kPeerCopyUnroll = 4;

template <int kNumRanks>
__global__ void __launch_bounds__(kPeerCopyThreads, 1)
peer_copy_kernel(const uint8_t* src, const int64_t* send_bytes, const uint64_t* peer_bases, int rank,
                 uint64_t recv_offset, uint64_t recv_stride, int32_t* error_record, uint64_t timeout_ns) {
    static_assert(kNumRanks >= 1 && kNumRanks <= 32, "peer copy supports up to 32 ranks per domain");
    static_assert(kPeerCopyArriveOffset + 4 * kNumRanks <= kPeerCopyCtrlBytes, "control words overflow their region");
    __shared__ int64_t s_psum[kNumRanks + 1];   // exclusive prefix of 16-byte vectors per peer, s_psum[R] = total
    __shared__ uint8_t* s_dst[kNumRanks];
    __shared__ uint32_t s_epoch;

    if (threadIdx.x == 0) {
        int64_t total = 0;
        for (int p = 0; p < kNumRanks; ++p) {
            s_psum[p] = total;
            s_dst[p] = reinterpret_cast<uint8_t*>(peer_bases[p]) + recv_offset +
                       static_cast<uint64_t>(rank) * recv_stride;
            total += p == rank ? 0 : send_bytes[p] / 16;
        }
        s_psum[kNumRanks] = total;
    }
    __syncthreads();

    const int64_t num_vectors = s_psum[kNumRanks];
    const int64_t num_threads = static_cast<int64_t>(gridDim.x) * kPeerCopyThreads;
    grid_stride_copy<kPeerCopyUnroll>(
        num_vectors, static_cast<int64_t>(blockIdx.x) * kPeerCopyThreads + threadIdx.x, num_threads,
        [&](int64_t i) { return ld_nc_v4(src + i * 16); },
        [&](int64_t i, const Vec16& v) {
            int p = 0;      // the peer whose chunk holds vector i
            #pragma unroll
            for (int q = 1; q < kNumRanks; ++q)
                p = i >= s_psum[q] ? q : p;
            st_na_v4(s_dst[p] + (i - s_psum[p]) * 16, v);
        });

    auto* ctrl = reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(peer_bases[rank]) + kPeerCopyCtrlOffset);
    if (!last_block_done(ctrl + kPeerCopyTicket))
        return;
    if (threadIdx.x == 0) {
        s_epoch = read_local(ctrl + kPeerCopyEpoch) + 1;
        ctrl[kPeerCopyEpoch] = s_epoch;
    }
    __syncthreads();
    const uint32_t e = s_epoch;
    const int peer = threadIdx.x;
    if (peer < kNumRanks && peer != rank) {
        auto* arrive = reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(peer_bases[peer]) + kPeerCopyCtrlOffset +
                                                   kPeerCopyArriveOffset);
        const auto* mine = reinterpret_cast<const uint32_t*>(reinterpret_cast<const uint8_t*>(ctrl) +
                                                             kPeerCopyArriveOffset);
        exchange_epoch(arrive, mine, rank, peer, e, timeout_ns, peer_bases, error_record, kPhasePeerCopy);
    }
}

}  // namespace deepep
