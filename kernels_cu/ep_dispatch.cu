// EP dispatch: one kernel with two roles, dispatch_impl_with_dispatch_copy_epilogue_impl (the name holds both of
// DeepEP's kernel names, dispatch_impl and dispatch_copy_epilogue_impl, as it does both jobs):
//   blocks [0, num_send_blocks) send: this rank's tokens straight into their slots at every other rank, over NVLink,
//     destination by destination in chunks of chunk_rows slots, each chunk released to its destination once written;
//   blocks [num_send_blocks, gridDim.x) receive: slots → the user's tensors, in the order and layout asked for, each
//     row as soon as its chunk is released. Our own tokens never touch the slots: the receivers read them straight
//     from x and the input top-k arrays (at one rank a dispatch is one copy of x).
// `phases` says which roles the launch has (kPhaseSend, kPhaseRecv): both in one launch (the receive overlaps the
// send: no CPU sync, or cached), or a send-only launch before the host waits for the counts and a receive-only one
// after it allocated the outputs (CPU sync). Compiled per top-k bucket kMaxTopk with the exact top-k `num_topk`
// ("top-k buckets", common/ep.cuh).
//
// Protocol per dispatch (data epoch e = the local count of dispatches; a launch with the send phase computes
// e = ctrl[data epoch] + 1 in every block and its last block stores it; a receive-only launch reads e):
//   send:  threads [0, R) of every sending block first wait for data_consumed[d] >= e - 1 at this rank (destination
//          d copied our previous messages out). Chunk j of destination d is slots [j * chunk_rows, ...) of our region
//          [me][slot] at d, slot p holding token token_of_slot[d][p] (notify); a block writes the chunk's messages,
//          then (after a block barrier) releases dispatch_signal[me][j] = e at d.
//   recv:  row i of source s != me, in slot p: waits for dispatch_signal[s][p / chunk_rows] >= e in our workspace
//          (acquire), then copies the message out. Rows of our own tokens wait for nothing.
//   The last block of a launch with the receive phase publishes data_consumed[me] = e at every source.
// Chunk signals live at kDispatchSignalOffset of the workspace: [src][chunk_stride] epochs. chunk_rows must be the
// same on every rank (the host derives it from num_max_tokens_per_rank and the rank count only).
// Readiness guard (hybrid P2, features/hybrid/feature.py; ready_mod = 0: off, no change): the input rows arrive while
// the kernel runs (the rail payload lands chunk by chunk on another stream). Before reading input row t (its hidden
// bytes or scales) a sender, or a receiver copying its own token t, waits (bounded) until *ready >= t % ready_mod + 1
// (acquire); a timeout is reported as (dispatch, rank, rank, target, last seen, kAuxRailReady).
#include "common/ep.cuh"

namespace deepep {

constexpr int kDispatchThreads = 512;
constexpr int kPhaseSend = 1, kPhaseRecv = 2;
constexpr int kAuxRailReady = 224;          // runtime/errors.py AUX_RAIL_READY

// The readiness guard (see the top): lane 0 waits, the warp learns the outcome. `seen` (warp-uniform, 0 at first)
// keeps the last counter value the warp acquired: rows below it need no new wait (that acquire covers them).
__device__ __forceinline__ bool wait_row_ready(const uint32_t* ready, int ready_mod, int t, int lane, uint32_t& seen,
                                               uint64_t timeout_ns, const ErrorSink& sink, int rank) {
    if (ready_mod <= 0)
        return true;
    const uint32_t target = static_cast<uint32_t>(t % ready_mod + 1);
    if (seen >= target)
        return true;
    bool ok = true;
    uint32_t now = seen;
    if (lane == 0) {
        ok = wait_epoch(ready, target, timeout_ns, sink, kPhaseDispatch, rank, rank, kAuxRailReady);
        now = ok ? ld_acquire_sys(ready) : now;
    }
    seen = __shfl_sync(0xffffffffu, now, 0);
    return __shfl_sync(0xffffffffu, ok, 0);
}

template <int kNumRanks, int kMaxTopk>
__device__ __forceinline__ bool
dispatch_send_blocks(const uint8_t* x, int64_t x_row_bytes, const uint8_t* sf, int64_t sf_stride_token,
                     int64_t sf_stride_col, int num_sf, const int64_t* topk_idx, const float* topk_weights,
                     const int32_t* send_expert_pos, const int32_t* token_of_slot, const int32_t* send_count,
                     int num_tokens, int num_topk, int num_max_tokens_per_rank, const MessageLayout& msg,
                     int num_chunks, const Peers& peers, int rank, uint64_t recv_offset, const ErrorSink& sink,
                     uint64_t timeout_ns, uint32_t epoch, int send_block, int num_send_blocks, int chunk_rows,
                     int chunk_stride, const uint32_t* ready = nullptr, int ready_mod = 0) {
    if (!wait_all_peers(peers, kSigDataConsumed, kNumRanks, epoch - 1, timeout_ns, sink, kPhaseDispatch))
        return false;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int num_warps = kDispatchThreads / 32;
    // Chunks per destination as a prefix over k = 0..R-2, destination (rank + 1 + k) % R: ranks start on different
    // peers, so that they do not all write into one peer first.
    __shared__ int s_chunk_base[kNumRanks + 1];
    if (threadIdx.x == 0) {
        int total = 0;
        for (int k = 0; k < kNumRanks; ++k) {
            s_chunk_base[k] = total;
            if (k < kNumRanks - 1)
                total += (send_count[(rank + 1 + k) % kNumRanks] + chunk_rows - 1) / chunk_rows;
        }
        s_chunk_base[kNumRanks] = total;
    }
    __syncthreads();

    for (int chunk = send_block; chunk < s_chunk_base[kNumRanks]; chunk += num_send_blocks) {
        int k = 0;
        while (chunk >= s_chunk_base[k + 1])
            ++k;
        const int d = (rank + 1 + k) % kNumRanks;
        const int j = chunk - s_chunk_base[k];
        const int slot0 = j * chunk_rows;
        const int rows = min(chunk_rows, send_count[d] - slot0);
        uint8_t* region = peers.base(d) + recv_offset +
                          static_cast<int64_t>(rank) * num_max_tokens_per_rank * msg.bytes;
        const RowSegments segs(rows, num_chunks, num_warps);
        bool not_ready = false;         // the readiness guard gave up (warp-uniform)
        uint32_t seen = 0;              // the guard's last acquired counter (warp-uniform)
        for (int item = warp; item < rows * segs.num; item += num_warps) {
            const int p = slot0 + item / segs.num, seg = item % segs.num;
            const int t = token_of_slot[static_cast<int64_t>(d) * num_tokens + p];
            if (!wait_row_ready(ready, ready_mod, t, lane, seen, timeout_ns, sink, rank)) {
                not_ready = true;
                break;
            }
            uint8_t* m = region + static_cast<int64_t>(p) * msg.bytes;
            if (seg == 0) {
                // Meta: lane k < K writes slot k's expert, weight and expert position, lane 0 the source index; then
                // the scale factors (4 bytes each, any strides).
                if (lane < num_topk) {
                    const int64_t e = topk_idx[static_cast<int64_t>(t) * num_topk + lane];
                    msg.expert_ids(m)[lane] = static_cast<int32_t>(e);
                    msg.weights(m)[lane] =
                        topk_weights != nullptr ? topk_weights[static_cast<int64_t>(t) * num_topk + lane] : 0.f;
                    msg.expert_pos(m)[lane] = send_expert_pos[static_cast<int64_t>(t) * num_topk + lane];
                }
                if (lane == 0)
                    *msg.src_idx(m) = t;
                for (int q = lane; q < num_sf; q += 32)
                    reinterpret_cast<uint32_t*>(m + msg.sf_offset)[q] =
                        *reinterpret_cast<const uint32_t*>(sf + (t * sf_stride_token + q * sf_stride_col) * 4);
            }
            const int c_begin = segs.begin(seg), c_end = segs.end(seg, num_chunks);
            if (ready_mod > 0)      // rows written while the kernel runs: no read-only (non-coherent) loads
                warp_copy<false>(m + msg.hidden_offset + c_begin * 16, x + t * x_row_bytes + c_begin * 16,
                                 (c_end - c_begin) * 16, lane);
            else
                warp_copy<true>(m + msg.hidden_offset + c_begin * 16, x + t * x_row_bytes + c_begin * 16,
                                (c_end - c_begin) * 16, lane);
        }
        // The chunk's messages are written (by every warp of the block): release them to their destination. With
        // the guard on, every warp meets here whether or not it gave up (ready_mod is uniform over the block).
        if (ready_mod > 0) {
            if (__syncthreads_or(not_ready))
                return false;
        } else {
            __syncthreads();
        }
        if (threadIdx.x == 0)
            st_release_sys(peers.dispatch_signal(d, rank, chunk_stride, j), epoch);
    }
    return true;
}

// A received row's fields but its hidden bytes (dispatch_recv_blocks, and the fused kernel's self-counting receivers,
// ep_fused.cu), by the whole warp; only the warp of the row's first segment (`first_seg`) writes. Lane k holds top-k
// slot k's global expert `e` (-1: none) and weight `w`; the row came from rank `s`, token `t` there. Writes the
// metadata's first two columns and recv_src_idx and, in the non-expanded layout (`plain`), this rank's top-k ids (the
// local expert or -1) and weights (0 where not local), the metadata's -1 expert rows and the scale factors (`num_sf`
// 4-byte words, `sf_step` words apart from `sf_src`). Returns the ballot of the slots whose expert is this rank's.
template <int kMaxTopk>
__device__ __forceinline__ uint32_t
write_row_fields(int64_t i, int e, float w, int lane, int s, int t, bool first_seg, bool plain, int rank,
                 int num_local_experts, int num_topk, int num_max_tokens_per_rank, const uint32_t* sf_src,
                 int64_t sf_step, int num_sf, uint8_t* recv_sf, int64_t recv_sf_stride_row,
                 int64_t recv_sf_stride_col, int64_t* recv_topk_idx, float* recv_topk_weights,
                 int32_t* recv_src_metadata, int32_t* recv_src_idx) {
    const int meta_cols = num_topk + 2;
    const int owner = e >= 0 ? e / num_local_experts : -1;
    const bool local = owner == rank;
    // Combine slot: number of distinct owners among top-k slots before this rank's first slot.
    const uint32_t local_mask = __ballot_sync(0xffffffffu, local);
    const int combine_slot = topk_owners<kMaxTopk>(owner, lane, num_topk).ordinal(__ffs(local_mask) - 1);
    if (first_seg && lane == 0) {
        recv_src_metadata[i * meta_cols] = s * num_max_tokens_per_rank + t;
        recv_src_metadata[i * meta_cols + 1] = s * num_topk + combine_slot;
        if (recv_src_idx != nullptr)
            recv_src_idx[i] = t;
    }
    if (first_seg && plain) {
        if (lane < num_topk) {
            recv_topk_idx[i * num_topk + lane] = local ? e - rank * num_local_experts : -1;
            if (recv_topk_weights != nullptr)
                recv_topk_weights[i * num_topk + lane] = local ? w : 0.f;
            recv_src_metadata[i * meta_cols + 2 + lane] = -1;
        }
        for (int q = lane; q < num_sf; q += 32)
            reinterpret_cast<uint32_t*>(recv_sf)[i * recv_sf_stride_row + q * recv_sf_stride_col] = sf_src[q * sf_step];
    }
    return local_mask;
}

// Copy the received rows into the user's tensors (own tokens straight from x and the input top-k arrays).
//   Non-expanded (do_expand = 0): row i of recv_x / recv_sf / recv_topk_idx / recv_topk_weights / metadata is the
//     i-th received token (sources ascending, then token index at the source). recv_topk_idx holds the local expert
//     id or -1; recv_topk_weights the weight or 0 where not local. Rows [num_recv, num_out_rows) get topk -1 and
//     metadata -1 (worst-case outputs without a CPU sync).
//   Expanded (do_expand = 1): one row per (token, local expert) pair, expert j's rows from layout start[j], in
//     (source, token) order; recv_topk_weights is 1-D. With do_zero_padding the alignment gaps get zeros.
//   Metadata [num_recv][K + 2]: src_rank * M + src token index; src_rank * K + combine slot (the ordinal of this rank
//   among the token's destination ranks in order of first top-k appearance); then per top-k slot the expanded row
//   (expanded mode) or -1. recv_src_idx (DeepEP V1's handle, when asked for): [num_recv] the token index at the source
//   (written beside the metadata, from the same field).
//   Rows past num_meta_rows are not written (a no-sync caller's num_worst_tokens below the real count): their slots
//   are neither waited for nor read (the sources' stream order keeps those writes before their next dispatch's).
template <int kNumRanks, int kMaxTopk>
__device__ __forceinline__ bool
dispatch_recv_blocks(const uint8_t* x, int64_t x_row_bytes, int hidden_bytes, const uint8_t* sf,
                     int64_t sf_stride_token, int64_t sf_stride_col, int num_sf, const int64_t* topk_idx,
                     const float* topk_weights, const int32_t* send_expert_pos, const int32_t* token_of_slot,
                     const int32_t* recv_layout, int num_tokens, int num_topk, int num_experts,
                     int num_max_tokens_per_rank, int do_expand, int do_zero_padding, int num_out_rows,
                     int num_meta_rows, uint8_t* recv_x, uint8_t* recv_sf, int64_t recv_sf_stride_row,
                     int64_t recv_sf_stride_col, int64_t* recv_topk_idx, float* recv_topk_weights,
                     int32_t* recv_src_metadata, int32_t* recv_src_idx, const MessageLayout& msg, int num_chunks,
                     const Peers& peers, int rank, uint64_t recv_offset, const ErrorSink& sink, uint64_t timeout_ns,
                     uint32_t epoch, int recv_block, int num_recv_blocks, int chunk_rows, int chunk_stride,
                     const uint32_t* ready = nullptr, int ready_mod = 0) {
    const int num_local_experts = num_experts / kNumRanks;
    const RecvLayout layout{const_cast<int32_t*>(recv_layout), kNumRanks, num_local_experts};
    const int num_recv = min(layout.totals()[0], num_meta_rows);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int num_warps = kDispatchThreads / 32;
    const int global_warp = recv_block * num_warps + warp, total_warps = num_recv_blocks * num_warps;
    const int meta_cols = num_topk + 2;
    const RowSegments segs(num_recv, num_chunks, total_warps);
    const int own_begin = rank > 0 ? layout.psum_src()[rank - 1] : 0;
    uint32_t seen = 0;                  // the readiness guard's last acquired counter (warp-uniform)

    for (int item = global_warp; item < num_recv * segs.num; item += total_warps) {
        const int i = item / segs.num, seg = item - i * segs.num;
        const int c_begin = segs.begin(seg), c_bytes = (segs.end(seg, num_chunks) - c_begin) * 16;
        int s = 0;
        #pragma unroll
        for (int r = 0; r < kNumRanks - 1; ++r)
            s += (i >= layout.psum_src()[r]) ? 1 : 0;
        const int slot = i - (s > 0 ? layout.psum_src()[s - 1] : 0);

        // This row's fields, per top-k slot k in lane k: global expert, weight, expert position; the token index at
        // its source; where its scale factors and hidden bytes are.
        int t, e = -1, pos = 0;
        float w = 0.f;
        const uint8_t* hidden_src;
        const uint32_t* sf_src;
        int64_t sf_step;                                  // in 4-byte words, between scale factor columns
        if (s == rank) {
            t = token_of_slot[static_cast<int64_t>(rank) * num_tokens + (i - own_begin)];
            if (!wait_row_ready(ready, ready_mod, t, lane, seen, timeout_ns, sink, rank))
                return false;
            if (lane < num_topk) {
                e = static_cast<int32_t>(topk_idx[static_cast<int64_t>(t) * num_topk + lane]);
                w = topk_weights != nullptr ? topk_weights[static_cast<int64_t>(t) * num_topk + lane] : 0.f;
                // Only the expanded layout reads the expert position (the fused kernel's receivers of a non-expanded
                // one-rank dispatch run while its notify blocks still write them).
                pos = do_expand ? send_expert_pos[static_cast<int64_t>(t) * num_topk + lane] : 0;
            }
            hidden_src = x + t * x_row_bytes;
            sf_src = reinterpret_cast<const uint32_t*>(sf) + t * sf_stride_token;
            sf_step = sf_stride_col;
        } else {
            // Wait until the source released the chunk holding this slot (lane 0 waits; the vote orders the others).
            bool ok = true;
            if (lane == 0)
                ok = wait_epoch(peers.dispatch_signal(rank, s, chunk_stride, slot / chunk_rows), epoch, timeout_ns,
                                sink, kPhaseDispatch, rank, s, kSigData);
            if (!__shfl_sync(0xffffffffu, ok, 0))
                return false;
            uint8_t* m = peers.local() + recv_offset +
                         (static_cast<int64_t>(s) * num_max_tokens_per_rank + slot) * msg.bytes;
            t = *reinterpret_cast<const volatile int32_t*>(msg.src_idx(m));
            if (lane < num_topk) {
                e = msg.expert_ids(m)[lane];
                w = msg.weights(m)[lane];
                pos = msg.expert_pos(m)[lane];
            }
            hidden_src = m + msg.hidden_offset;
            sf_src = reinterpret_cast<const uint32_t*>(m + msg.sf_offset);
            sf_step = 1;
        }

        // The first segment of a row writes its fields (non-expanded: all but the hidden bytes); every segment
        // copies its chunks.
        const bool first_seg = seg == 0;
        const uint32_t local_mask = write_row_fields<kMaxTopk>(
            i, e, w, lane, s, t, first_seg, !do_expand, rank, num_local_experts, num_topk, num_max_tokens_per_rank,
            sf_src, sf_step, num_sf, recv_sf, recv_sf_stride_row, recv_sf_stride_col, recv_topk_idx,
            recv_topk_weights, recv_src_metadata, recv_src_idx);
        const bool local = (local_mask >> lane) & 1u;
        if (!do_expand) {
            warp_copy(recv_x + static_cast<int64_t>(i) * hidden_bytes + c_begin * 16, hidden_src + c_begin * 16,
                      c_bytes, lane);
        } else {
            int row = -1;
            if (local) {
                const int j = e - rank * num_local_experts;
                row = layout.start()[j] + layout.src_base()[s * num_local_experts + j] + pos;
                if (first_seg && recv_topk_weights != nullptr)
                    recv_topk_weights[row] = w;
            }
            if (first_seg && lane < num_topk)
                recv_src_metadata[static_cast<int64_t>(i) * meta_cols + 2 + lane] = row;
            uint32_t pending = local_mask;
            while (pending) {
                const int k = __ffs(pending) - 1;
                pending &= pending - 1;
                const int r = __shfl_sync(0xffffffffu, row, k);
                for (int q = first_seg ? lane : num_sf; q < num_sf; q += 32)
                    reinterpret_cast<uint32_t*>(recv_sf)[r * recv_sf_stride_row + q * recv_sf_stride_col] =
                        sf_src[q * sf_step];
                warp_copy(recv_x + static_cast<int64_t>(r) * hidden_bytes + c_begin * 16, hidden_src + c_begin * 16,
                          c_bytes, lane);
            }
        }
    }

    // Worst-case outputs (no CPU sync): mark the token rows past the real count (top-k ids and metadata -1).
    const int64_t tid = static_cast<int64_t>(recv_block) * blockDim.x + threadIdx.x;
    const int64_t num_threads = static_cast<int64_t>(num_recv_blocks) * blockDim.x;
    if (!do_expand) {
        for (int64_t idx = tid; idx < static_cast<int64_t>(num_meta_rows - num_recv) * num_topk; idx += num_threads)
            recv_topk_idx[static_cast<int64_t>(num_recv) * num_topk + idx] = -1;
    }
    for (int64_t idx = tid; idx < static_cast<int64_t>(num_meta_rows - num_recv) * meta_cols; idx += num_threads)
        recv_src_metadata[static_cast<int64_t>(num_recv) * meta_cols + idx] = -1;
    // Zero the alignment gaps of the expanded layout.
    if (do_expand && do_zero_padding) {
        for (int j = global_warp; j < num_local_experts; j += total_warps) {
            const int begin = layout.start()[j] + layout.count()[j];
            const int end = j + 1 < num_local_experts ? layout.start()[j + 1] : layout.totals()[1];
            for (int r = begin; r < end && r < num_out_rows; ++r) {
                for (int off = lane * 16; off < hidden_bytes; off += 32 * 16)
                    st_v4(recv_x + static_cast<int64_t>(r) * hidden_bytes + off, Vec16{0, 0, 0, 0});
                for (int q = lane; q < num_sf; q += 32)
                    reinterpret_cast<uint32_t*>(recv_sf)[r * recv_sf_stride_row + q * recv_sf_stride_col] = 0;
                if (lane == 0 && recv_topk_weights != nullptr)
                    recv_topk_weights[r] = 0.f;
            }
        }
    }
    return true;
}

template <int kNumRanks, int kMaxTopk>
__global__ void __launch_bounds__(kDispatchThreads, 1)
dispatch_impl_with_dispatch_copy_epilogue_impl(
    const uint8_t* x, int64_t x_row_bytes, int hidden_bytes, const uint8_t* sf, int64_t sf_stride_token,
    int64_t sf_stride_col, int num_sf, const int64_t* topk_idx, const float* topk_weights,
    const int32_t* send_expert_pos, const int32_t* token_of_slot, const int32_t* send_count,
    const int32_t* recv_layout, int num_tokens, int num_topk, int num_experts, int num_max_tokens_per_rank,
    int do_expand, int do_zero_padding, int num_out_rows, int num_meta_rows, uint8_t* recv_x, uint8_t* recv_sf,
    int64_t recv_sf_stride_row, int64_t recv_sf_stride_col, int64_t* recv_topk_idx, float* recv_topk_weights,
    int32_t* recv_src_metadata, int32_t* recv_src_idx, int phases, int num_send_blocks, int chunk_rows,
    int chunk_stride, const uint64_t* peer_bases, int rank, uint64_t recv_offset, int32_t* error_record,
    uint64_t timeout_ns, const uint32_t* ready, int ready_mod) {
    const Peers peers{peer_bases, rank};
    uint32_t* ctrl = peers.local_ctrl();
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    const uint32_t epoch = read_local(ctrl + kCtrlDataEpoch) + ((phases & kPhaseSend) ? 1 : 0);
    const MessageLayout msg(num_topk, num_sf, hidden_bytes);
    const int num_chunks = hidden_bytes / 16;
    bool ok;
    if (static_cast<int>(blockIdx.x) < num_send_blocks) {
        ok = dispatch_send_blocks<kNumRanks, kMaxTopk>(
            x, x_row_bytes, sf, sf_stride_token, sf_stride_col, num_sf, topk_idx, topk_weights, send_expert_pos,
            token_of_slot, send_count, num_tokens, num_topk, num_max_tokens_per_rank, msg, num_chunks, peers, rank,
            recv_offset, sink, timeout_ns, epoch, blockIdx.x, num_send_blocks, chunk_rows, chunk_stride, ready,
            ready_mod);
    } else {
        ok = dispatch_recv_blocks<kNumRanks, kMaxTopk>(
            x, x_row_bytes, hidden_bytes, sf, sf_stride_token, sf_stride_col, num_sf, topk_idx, topk_weights,
            send_expert_pos, token_of_slot, recv_layout, num_tokens, num_topk, num_experts, num_max_tokens_per_rank,
            do_expand, do_zero_padding, num_out_rows, num_meta_rows, recv_x, recv_sf, recv_sf_stride_row,
            recv_sf_stride_col, recv_topk_idx, recv_topk_weights, recv_src_metadata, recv_src_idx, msg, num_chunks,
            peers, rank, recv_offset, sink, timeout_ns, epoch, blockIdx.x - num_send_blocks,
            gridDim.x - num_send_blocks, chunk_rows, chunk_stride, ready, ready_mod);
    }
    // A timed-out wait leaves the epoch unpublished (the buffer is unusable after a timeout anyway).
    if (__syncthreads_or(!ok))
        return;
    if (kNumRanks == 1) {
        // One rank: only later kernels of this stream read the two words (stream order makes every block's writes
        // visible to them), no receiver waits for an epoch, and no block but block 0 writes: block 0 publishes
        // without the ticket and its system-scope fences (~1 us per block at decode sizes).
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            if (phases & kPhaseSend)
                ctrl[kCtrlDataEpoch] = epoch;
            if (phases & kPhaseRecv)
                ctrl[kSigDataConsumed + rank] = epoch;
        }
        return;
    }
    // Every block done: the next dispatch may overwrite the slots we read; our senders' data is all released.
    if (last_block_done(ctrl + kCtrlDispatchSendTicket)) {
        if ((phases & kPhaseSend) && threadIdx.x == 0)
            ctrl[kCtrlDataEpoch] = epoch;
        if ((phases & kPhaseRecv) && threadIdx.x < kNumRanks)
            st_release_sys(peers.remote_signal(threadIdx.x, kSigDataConsumed), epoch);
    }
}

}  // namespace deepep
