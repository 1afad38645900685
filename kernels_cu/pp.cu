// Pipeline-parallel send/recv between ring neighbours (rank ± 1 modulo W). Inside a scale-up domain, and between
// domains over a CUDA-IPC mapping (the loopback), the protocol below runs as is; `peer_bases` is then the PP feature's
// own table (indices = global rank - the domain's first rank, so records name global ranks). A pair of domains joined
// by NCCL (deepep_cupy/features/pp/links.py) reuses both kernels around NCCL point-to-point on side streams:
//   send: pp_wait_impl (1 thread, bounded: consumed_by[k_d] >= num_sent[k_d] + 1 - num_inflight), then pp_send_impl
//         into the sender's local OUTBOX (its table entry for the peer), then on the pair's send stream
//         ncclSend(header, slot) and pp_bump_impl(consumed_by[k_d]): a send "is consumed" once NCCL delivered it,
//         which needs the receiver's ncclRecv, posted by its pp_recv, so the slot semantics are the NVLink ones.
//   recv: on the pair's receive stream ncclRecv(header, slot) into this rank's slot [k_s][0], pp_bump_impl
//         (sent_from[k_s]); on the communication stream pp_wait_impl (sent_from[k_s] >= num_recv[k_s] + 1), then
//         pp_recv_impl with num_inflight = 1 (it writes its consumed signal into the outbox's unused control words).
// The waits run as one-thread kernels before the wide copy kernels, so a spinning grid never keeps the NCCL kernels
// of the side streams off the SMs.
//
// Data (the buffer's data region, offsets relative to every rank's symmetric base; deepep_cupy/pp.py `PPLayout`):
//   headers [2 sources][num_inflight] of kPPHeaderBytes at headers_offset; slots [2 sources][num_inflight] of
//   slot_bytes (align(num_max_tensor_bytes, 32)) at slots_offset. The RECEIVER owns them: source index k of rank X
//   is 0 for X's previous rank, 1 for its next rank; with 2 ranks previous == next and only k = 0 is used. The
//   sender pushes the tensor bytes straight into its slot over NVLink; the receiver copies them out locally.
//
// Control words: the workspace region kWsPPOffset (common/workspace.cuh) of every rank (uint32, zero at allocation,
// never cleared):
//   local, written only by this rank's kernels (stream-ordered on the buffer's communication stream):
//     [0] send ticket, [1] recv ticket              last_block_done counters (reset by the last block)
//     [4 + k]  num_sent[k]     messages this rank has sent to neighbour k (epoch, wraps mod 2^32)
//     [8 + k]  num_recv[k]     messages this rank has received from neighbour k
//     [12 + k] send_cursor[k]  slot of the next message to neighbour k, in [0, num_inflight)
//     [16 + k] recv_cursor[k]  slot of the next message from neighbour k
//   signals, written by a neighbour with a system-scope release store, read here with acquire loads:
//     [32 + k] sent_from[k]    (byte +128) neighbour k finished writing its messages [0, value) into our slots
//     [64 + k] consumed_by[k]  (byte +256) neighbour k copied our messages [0, value) out of its slots
// Protocol (n = num_sent of the pair, m = num_recv; FIFO per directed pair, matched by call order):
//   send to d:   thread 0 of every block waits until consumed_by[k_d] >= n + 1 - num_inflight (the slot's previous
//                message was copied out: back-pressure, a slot is never overwritten); the grid writes the bytes into
//                d's slot [k_s][send_cursor] and block 0 writes the header {num_bytes, seq = n}; the last block to
//                finish (last_block_done fences every block's stores at system scope) bumps num_sent / send_cursor
//                and publishes sent_from[k_s] = n + 1 at d.
//   recv from s: thread 0 of every block waits until sent_from[k_s] >= m + 1, checks the header against the tensor
//                (bytes and sequence number); on a match the grid copies slot [k_s][recv_cursor] into the tensor, on
//                a mismatch nothing is copied and block 0 fills the PP error record (the host raises on its next PP
//                call); either way the last block bumps num_recv / recv_cursor and publishes consumed_by[k_d] = m + 1
//                at s, so the pair stays in step.
//   (k_d: d's index as seen by the sender, k_s: the sender's index as seen by d.) Cursors advance modulo
//   num_inflight on both sides in lockstep; after a reconfiguration with every message consumed they are equal on
//   both sides, so `cursor % num_inflight` still agrees. Waits are bounded (wait_epoch); the aux field of a timeout
//   record is kPPWaitSlot (a send found no free slot: the receiver did not call pp_recv) or kPPWaitData (a recv
//   found no message: the sender did not call pp_send).
#include "common/ep.cuh"

namespace deepep {

constexpr uint64_t kPPCtrlOffset = kWsPPOffset;     // common/workspace.cuh
constexpr uint64_t kPPCtrlBytes = kWsPPBytes;
constexpr int kPPSendTicket = 0, kPPRecvTicket = 1;
constexpr int kPPNumSent = 4, kPPNumRecv = 8, kPPSendCursor = 12, kPPRecvCursor = 16;
constexpr int kPPSentFrom = 32, kPPConsumedBy = 64;
constexpr int kPPThreads = 512;
constexpr int kPPUnroll = 4;
constexpr int kPPHeaderBytes = 16;
constexpr int kPPWaitSlot = 1, kPPWaitData = 2;
static_assert((kPPConsumedBy + 2) * 4 <= kPPCtrlBytes, "PP control words overflow their region");

// PP error record (host-mapped int32 words, written by the recv kernel on a header mismatch; read and cleared by the
// host): [0] state (0 none, -1 being written, 1 set), [1] source rank, [2] sequence number expected, [3, 4] bytes
// expected (low, high), [5, 6] bytes in the header (low, high), [7] sequence number in the header.
constexpr int kPPErrorWords = 8;

struct PPHeader {
    uint64_t num_bytes;
    uint32_t seq;
    uint32_t reserved;
};

// The grid copies `num_bytes` from src to dst (both 16-byte aligned): 16-byte vectors with kPPUnroll loads in
// flight per thread before the stores, grid-stride; the last block copies the < 16 tail bytes.
template <bool kNonCoherentSrc>
__device__ __forceinline__ void pp_grid_copy(uint8_t* dst, const uint8_t* src, uint64_t num_bytes) {
    const int64_t num_vectors = static_cast<int64_t>(num_bytes / 16);
    const int64_t num_threads = static_cast<int64_t>(gridDim.x) * kPPThreads;
    grid_stride_copy<kPPUnroll>(
        num_vectors, static_cast<int64_t>(blockIdx.x) * kPPThreads + threadIdx.x, num_threads,
        [&](int64_t i) { return kNonCoherentSrc ? ld_nc_v4(src + i * 16) : ld_v4(src + i * 16); },
        [&](int64_t i, const Vec16& v) { st_na_v4(dst + i * 16, v); });
    const uint64_t tail = static_cast<uint64_t>(num_vectors) * 16;
    if (blockIdx.x == gridDim.x - 1 && tail + threadIdx.x < num_bytes)
        dst[tail + threadIdx.x] = src[tail + threadIdx.x];
}

__device__ __forceinline__ uint32_t* pp_ctrl(const uint64_t* peer_bases, int peer) {
    return reinterpret_cast<uint32_t*>(peer_bases[peer] + kPPCtrlOffset);
}

// Send `num_bytes` of x to neighbour `dst` (scale-up index). dst_slot_idx: dst's neighbour index as seen by this
// rank; src_slot_idx_at_dst: this rank's neighbour index as seen by dst. Any grid size; kPPThreads threads.
__global__ void __launch_bounds__(kPPThreads, 1)
pp_send_impl(const uint8_t* x, uint64_t num_bytes, const uint64_t* peer_bases, int rank, int dst, int dst_slot_idx,
             int src_slot_idx_at_dst, int num_inflight, uint64_t headers_offset, uint64_t slots_offset,
             uint64_t slot_bytes, int32_t* error_record, uint64_t timeout_ns) {
    __shared__ int s_ok;
    uint32_t* ctrl = pp_ctrl(peer_bases, rank);
    // Read before this block arrives at the ticket; only the last block to arrive updates them.
    const uint32_t seq = read_local(ctrl + kPPNumSent + dst_slot_idx);
    const uint32_t cursor = read_local(ctrl + kPPSendCursor + dst_slot_idx) % static_cast<uint32_t>(num_inflight);
    if (threadIdx.x == 0) {
        const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
        s_ok = wait_epoch(ctrl + kPPConsumedBy + dst_slot_idx, seq + 1u - static_cast<uint32_t>(num_inflight),
                          timeout_ns, sink, kPhasePP, rank, dst, kPPWaitSlot);
    }
    __syncthreads();
    if (!s_ok)
        return;

    uint8_t* remote = reinterpret_cast<uint8_t*>(peer_bases[dst]);
    const uint64_t idx = static_cast<uint64_t>(src_slot_idx_at_dst) * num_inflight + cursor;
    pp_grid_copy<true>(remote + slots_offset + idx * slot_bytes, x, num_bytes);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        auto* header = reinterpret_cast<PPHeader*>(remote + headers_offset + idx * kPPHeaderBytes);
        header->num_bytes = num_bytes;
        header->seq = seq;
    }

    if (last_block_done(ctrl + kPPSendTicket) && threadIdx.x == 0) {
        ctrl[kPPNumSent + dst_slot_idx] = seq + 1;
        ctrl[kPPSendCursor + dst_slot_idx] = (cursor + 1) % static_cast<uint32_t>(num_inflight);
        st_release_sys(pp_ctrl(peer_bases, dst) + kPPSentFrom + src_slot_idx_at_dst, seq + 1);
    }
}

// Receive the next message from neighbour `src` (scale-up index) into x (`num_bytes`, which must equal the bytes
// sent). src_slot_idx: src's neighbour index as seen by this rank; dst_slot_idx_at_src: this rank's neighbour index
// as seen by src. pp_error: host-mapped kPPErrorWords record for a size mismatch.
__global__ void __launch_bounds__(kPPThreads, 1)
pp_recv_impl(uint8_t* x, uint64_t num_bytes, const uint64_t* peer_bases, int rank, int src, int src_slot_idx,
             int dst_slot_idx_at_src, int num_inflight, uint64_t headers_offset, uint64_t slots_offset,
             uint64_t slot_bytes, int32_t* error_record, int32_t* pp_error, uint64_t timeout_ns) {
    __shared__ int s_state;     // 0: timed out, 1: header matches, 2: mismatch
    uint32_t* ctrl = pp_ctrl(peer_bases, rank);
    const uint32_t seq = read_local(ctrl + kPPNumRecv + src_slot_idx);
    const uint32_t cursor = read_local(ctrl + kPPRecvCursor + src_slot_idx) % static_cast<uint32_t>(num_inflight);
    const uint64_t idx = static_cast<uint64_t>(src_slot_idx) * num_inflight + cursor;
    uint8_t* local = reinterpret_cast<uint8_t*>(peer_bases[rank]);
    if (threadIdx.x == 0) {
        const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
        int state = 0;
        if (wait_epoch(ctrl + kPPSentFrom + src_slot_idx, seq + 1, timeout_ns, sink, kPhasePP, rank, src,
                       kPPWaitData)) {
            const auto* header = reinterpret_cast<const volatile PPHeader*>(local + headers_offset +
                                                                            idx * kPPHeaderBytes);
            const uint64_t sent_bytes = header->num_bytes;
            const uint32_t sent_seq = header->seq;
            state = (sent_bytes == num_bytes && sent_seq == seq) ? 1 : 2;
            if (state == 2 && blockIdx.x == 0) {
                volatile int32_t* rec = pp_error;
                if (rec[0] == 0) {
                    rec[0] = -1;
                    rec[1] = src;
                    rec[2] = static_cast<int32_t>(seq);
                    rec[3] = static_cast<int32_t>(num_bytes & 0xffffffffu);
                    rec[4] = static_cast<int32_t>(num_bytes >> 32);
                    rec[5] = static_cast<int32_t>(sent_bytes & 0xffffffffu);
                    rec[6] = static_cast<int32_t>(sent_bytes >> 32);
                    rec[7] = static_cast<int32_t>(sent_seq);
                    __threadfence_system();
                    rec[0] = 1;
                    __threadfence_system();
                }
            }
        }
        s_state = state;
    }
    __syncthreads();
    if (s_state == 0)
        return;
    if (s_state == 1)
        pp_grid_copy<false>(x, local + slots_offset + idx * slot_bytes, num_bytes);

    if (last_block_done(ctrl + kPPRecvTicket) && threadIdx.x == 0) {
        ctrl[kPPNumRecv + src_slot_idx] = seq + 1;
        ctrl[kPPRecvCursor + src_slot_idx] = (cursor + 1) % static_cast<uint32_t>(num_inflight);
        st_release_sys(pp_ctrl(peer_bases, src) + kPPConsumedBy + dst_slot_idx_at_src, seq + 1);
    }
}

// Bounded wait on this rank's own control words: until ctrl[wait_word] >= ctrl[count_word] + delta (epoch order).
// One thread. The timeout record is (kPhasePP, rank, peer, target, last seen, aux) as in the kernels above.
__global__ void pp_wait_impl(const uint64_t* peer_bases, int rank, int peer, int wait_word, int count_word, int delta,
                             int aux, int32_t* error_record, uint64_t timeout_ns) {
    if (blockIdx.x != 0 || threadIdx.x != 0)
        return;
    uint32_t* ctrl = pp_ctrl(peer_bases, rank);
    const uint32_t target = read_local(ctrl + count_word) + static_cast<uint32_t>(delta);
    wait_epoch(ctrl + wait_word, target, timeout_ns, make_error_sink(peer_bases, rank, error_record), kPhasePP, rank,
               peer, aux);
}

// One more message of a pair crossed NCCL: *word += 1 (release, system scope), stream-ordered after the NCCL group.
// Only this kernel writes the word (on the pair's side stream), so read-increment-store is race-free.
__global__ void pp_bump_impl(uint32_t* word) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
        st_release_sys(word, read_local(word) + 1u);
}

}  // namespace deepep
