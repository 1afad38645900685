// EP dispatch without CPU sync in ONE launch, fused_notify_and_dispatch: the notify's work (ep_notify.cu notify_body)
// and the dispatch's senders and receivers (ep_dispatch.cu, both phases) in one kernel. Opt-in:
// DEEPEP_CUPY_EP_FUSED_NOTIFY (deepep_cupy/envs.py); the host uses it for non-cached dispatches without CPU sync.
//
// Cooperative launch of kDispatchThreads threads per block, at most one block per SM (the host checks the grid
// against the SM count, the launch against the occupancy: a grid that cannot be co-resident fails to launch instead
// of deadlocking in the waits below):
//   blocks [0, num_send_blocks) send, the others receive, exactly as in ep_dispatch.cu;
//   the first num_notify_blocks receiving blocks, [num_send_blocks, num_send_blocks + num_notify_blocks), first run
//     notify_body with one token per thread (512 tokens per block: positions are counts of earlier tokens, so every
//     output is the notify kernel's, bit for bit), then receive. Receivers wait for the layout anyway (with several
//     ranks), so the count exchange of notify block 0 delays no sender. At one rank without expansion the notify
//     blocks receive nothing when the other receivers are at least 3/4 of them: those need nothing from the notify
//     blocks (below) and take the whole copy (a share dealt to a notify block would end after its notify work).
// Two local flags inside the launch (control words of common/ep.cuh), each set to this dispatch's data epoch e (the
// flags only grow with the epoch: nothing to reset between launches):
//   positions ready (kCtrlFusedPositions): the last notify block to arrive (ticket kCtrlFusedArrivals, reset by it)
//     releases e once every notify block wrote its tokens' slots and expert positions (and block 0 send_count). The
//     senders need no more: they send while block 0 still exchanges the counts with the peers.
//   layout ready (kCtrlFusedLayout): block 0 releases e once the receive layout is written (after the exchange).
//     The receivers of several ranks, or of an expanded dispatch, wait for the positions and the layout.
// One rank without expansion: self-counting receivers (SelfCountingReceiver, ep_fused_receiver.cuh). A received row
// is then a token's slot, its rank among the tokens with a valid expert, so the receivers count for themselves
// instead of waiting for the notify blocks' slots (which come only after every key of every token is counted, a grid
// barrier and an arrival ticket): receiving block r of n takes the tokens
// [r * T / n, (r + 1) * T / n), counts its received ones and publishes the count (kCtrlFusedCounts[r] = e << 32 |
// count, released at GPU scope); thread j reads block j's count (all at once: no chain of blocks), so every block
// learns where its rows start and the receive count, and copies its rows in token order. Same rows, bit for bit, as
// the notify's slots give.
// Speculation (SelfCountingReceiver::speculate), when the receivers are the blocks without notify work, x's rows are
// dense and the outputs hold a row for every token: every token is received unless all its top-k ids are masked, and
// then token t's row is t, so the receivers copy x's rows into recv_x from the launch's first instant, as ONE copy
// spread over the grid (16-byte chunk c by copy thread c mod the grid's copy threads, as a plain copy walks memory),
// while one warp per block reads the epoch, counts the block's share and reads the other blocks' counts. A receive
// count of num_tokens confirms it (each block then writes its share's other fields); a miss (a token received by
// nobody) waits for every block's copy to end, then receives as above (recv_x's rows past the receive count, which
// no caller reads, then hold speculated bytes). Why: without it the copy starts only once the epoch and the counts
// are read; with it the span is bound by the copy's spread between blocks (their shares of HBM are uneven), the
// share's fields after it and, at FP8, the notify blocks beside the copy (per-block stamps before and after:
// perf/results/1xh200_s10_probe_fused_stamps.md; the span against a plain copy: the README's performance section).
// At one rank block 0 publishes the data epoch without the ticket and its system-scope fences (as ep_dispatch.cu):
// only later kernels of the stream read it. Every block counts itself in kCtrlFusedStarted right after reading the
// epoch (released at GPU scope), and block 0 stores the epoch only once the count is the grid, so that no block of
// this launch can read the new epoch (it would wait for flags one epoch ahead); block 0 resets the count.
// Before the flags, the blocks without notify work do what needs no layout: they prefetch their share of x into L2
// (at most kFusedPrefetchBytes; self-counting receivers their own rows, once their count is published; speculating
// ones copy at once instead), and the senders wait for their destinations' data_consumed (ep_dispatch.cu's senders do
// that first; they then find it done).
// Every wait is bounded (timeout.cuh): a notify block that timed out never raises a flag, and the blocks waiting for
// it give up once its record is written. They wait twice as long as a wait on a peer, so that a missing peer is
// reported as such (by the notify block that waited for it) rather than as a flag of this rank that never came; only a
// notify block stuck without a record makes them report (phase dispatch, peer = this rank, aux kAuxFusedPositions /
// kAuxFusedLayout; kAuxFusedCounts: a self-counting receiver's count that never came; kAuxFusedStarted: block 0's
// count of started blocks, at one rank).
// With the peers the protocol is the two kernels' (notify epoch and signals, data epoch, chunk signals, data_consumed
// published by the last block). Sending before the count exchange ends changes nothing for them: ep_dispatch.cu's
// senders, too, need only data_consumed[d] >= e - 1 before writing into d's slots and releasing its chunk signals.
//
// Why one kernel rather than Programmatic Dependent Launch between the two: griddepcontrol.wait returns only once the
// whole notify grid completed and flushed, so PDL would overlap the dispatch's launch and prologue with the notify's
// tail and no more; here the senders send while the counts are exchanged and, at one rank, the receivers copy while
// the notify blocks still count. It also needs no launch attributes (cuLaunchKernelEx) in the JIT layer.
#include "ep_notify.cu"
#include "ep_dispatch.cu"
#include "ep_fused_receiver.cuh"

namespace deepep {

// notify_body's hook here: the last notify block to arrive (ticket ctrl[ticket], reset by it) releases
// ctrl[flag] = epoch.
struct FusedArrival {
    uint32_t* ctrl;
    int ticket, flag;
    uint32_t epoch;
    uint32_t num_notify_blocks;
    __device__ __forceinline__ void operator()() const {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            if (atomicAdd(ctrl + ticket, 1u) == num_notify_blocks - 1) {
                *reinterpret_cast<volatile uint32_t*>(ctrl + ticket) = 0;
                __threadfence();
                st_release_gpu(ctrl + flag, epoch);
            }
        }
        __syncthreads();
    }
};

// Thread 0 waits (bounded: twice the peers' timeout) for a local flag of this launch to reach `epoch` (acquire at GPU
// scope: only blocks of this launch release it); every thread gets the result.
__device__ __forceinline__ bool wait_fused_flag(const uint32_t* flag, uint32_t epoch, uint64_t timeout_ns,
                                                const ErrorSink& sink, int rank, int aux) {
    __shared__ int s_flag_ok;
    if (threadIdx.x == 0) {
        const uint64_t longer = timeout_ns > (~0ull >> 2) ? timeout_ns : 2 * timeout_ns;
        int ok = 1;
        uint32_t seen = ld_acquire_gpu(flag);
        const uint64_t start = global_timer_ns();
        for (uint32_t iter = 0; !epoch_reached(seen, epoch); ++iter) {
            if ((iter & 255) == 255) {
                if (global_timer_ns() - start > longer) {
                    report_timeout(sink, kPhaseDispatch, rank, rank, epoch, seen, aux);
                    ok = 0;
                    break;
                }
                if (timeout_reported(sink)) {
                    ok = 0;
                    break;
                }
            }
            seen = ld_acquire_gpu(flag);
        }
        __threadfence();
        s_flag_ok = ok;
    }
    __syncthreads();
    const bool ok = s_flag_ok != 0;
    __syncthreads();              // s_flag_ok is rewritten by the next wait
    return ok;
}

template <int kNumRanks, int kMaxTopk>
__global__ void __launch_bounds__(kDispatchThreads, 1)
fused_notify_and_dispatch(
    const uint8_t* x, int64_t x_row_bytes, int hidden_bytes, const uint8_t* sf, int64_t sf_stride_token,
    int64_t sf_stride_col, int num_sf, const int64_t* topk_idx, const float* topk_weights, int num_tokens,
    int num_topk, int num_experts, int num_max_tokens_per_rank, int expert_alignment, int32_t* scratch,
    int32_t* send_pos, int32_t* send_expert_pos, int32_t* token_of_slot, int32_t* send_count, int32_t* recv_layout,
    int32_t* psum_recv_per_expert, int do_expand, int32_t* cumulative_stats, int32_t* host_counts, int host_seq,
    int64_t* topk_copy, int reported_num_tokens, const int32_t* expert_counts, int num_channels,
    int32_t* channel_prefix_matrix, int32_t* recv_channel_prefix_matrix, int32_t* rank_prefix_matrix,
    int do_zero_padding, int num_out_rows, int num_meta_rows, uint8_t* recv_x, uint8_t* recv_sf,
    int64_t recv_sf_stride_row, int64_t recv_sf_stride_col, int64_t* recv_topk_idx, float* recv_topk_weights,
    int32_t* recv_src_metadata, int32_t* recv_src_idx, int num_send_blocks, int num_notify_blocks, int chunk_rows,
    int chunk_stride, const uint64_t* peer_bases, int rank, uint64_t recv_offset, int32_t* error_record,
    uint64_t timeout_ns) {
    extern __shared__ int32_t smem[];             // notify_body's (notify_smem_bytes for 16 warps)
    const Peers peers{peer_bases, rank};
    uint32_t* ctrl = peers.local_ctrl();
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    const int block = blockIdx.x;
    const bool sender = block < num_send_blocks;
    const int notify_block = block - num_send_blocks;      // this block's index among the notify blocks
    // One rank, not expanded: self-counting receivers (see the top); the senders need the expert positions (in their
    // messages), the other receivers the layout. There the notify blocks, which finish last (expert positions, then
    // block 0's layout), leave the copy to the other receivers when those are at least 3/4 of the receivers (they then
    // copy at most 4/3 of their share): a notify block's share would start only after its notify work.
    // recv_block < 0: no receive. (features/ep/fused.py fused_notify_blocks_receive states the same rule for the
    // tests.)
    const bool self_counting = kNumRanks == 1 && !do_expand;
    const int num_receivers = static_cast<int>(gridDim.x) - num_send_blocks;
    const int num_idle = (self_counting && num_receivers >= 4 * num_notify_blocks) ? num_notify_blocks : 0;
    const int recv_block = block - num_send_blocks - num_idle;
    const bool receives = !sender && recv_block >= 0;
    const bool counting = receives && self_counting;
    __shared__ typename SelfCountingReceiver<kMaxTopk>::Shared s_counting;
    const SelfCountingReceiver<kMaxTopk> counter(topk_idx, num_tokens, num_topk, num_experts, recv_block,
                                                 num_receivers - num_idle, s_counting);
    const RecvArgs recv_args{x, x_row_bytes, hidden_bytes, sf, sf_stride_token, sf_stride_col, num_sf, topk_weights,
                             num_meta_rows, recv_x, recv_sf, recv_sf_stride_row, recv_sf_stride_col, recv_topk_idx,
                             recv_topk_weights, recv_src_metadata, recv_src_idx};
    uint64_t* const counts = reinterpret_cast<uint64_t*>(ctrl + kCtrlFusedCounts);
    // The speculative receive (see the top): the counting blocks are the blocks without notify work, x's rows are
    // dense and recv_x and the metadata hold a row for every token (uniform over the grid).
    const bool speculate = counting && num_idle > 0 && x_row_bytes == hidden_bytes && num_tokens <= num_out_rows &&
                           num_tokens <= num_meta_rows;
    uint32_t epoch;
    bool ok = true;
    if (speculate) {
        ok = counter.speculate(recv_args, ctrl, counts, epoch, timeout_ns, sink);
    } else {
        const bool first_here = counting && counter.first_ids();
        __shared__ uint32_t s_epoch;
        if (threadIdx.x == 0)
            s_epoch = fused_read_epoch(ctrl, kNumRanks == 1);
        __syncthreads();
        epoch = s_epoch;
        if (counting)
            counter.publish(first_here, counts, epoch);
        if (notify_block >= 0 && notify_block < num_notify_blocks) {
            ok = notify_body<kNumRanks, kMaxTopk, kDispatchThreads>(
                topk_idx, num_tokens, num_topk, num_experts, num_max_tokens_per_rank, expert_alignment, peer_bases,
                rank, error_record, timeout_ns, scratch, send_pos, send_expert_pos, recv_layout, psum_recv_per_expert,
                do_expand, cumulative_stats, host_counts, host_seq, topk_copy, reported_num_tokens, expert_counts,
                num_channels, channel_prefix_matrix, recv_channel_prefix_matrix, rank_prefix_matrix, token_of_slot,
                send_count, notify_block, num_notify_blocks, smem,
                FusedArrival{ctrl, kCtrlFusedArrivals, kCtrlFusedPositions, epoch,
                             static_cast<uint32_t>(num_notify_blocks)});
            if (notify_block == 0) {
                // Every thread's layout words are written: release them to the receivers.
                __syncthreads();
                if (ok && threadIdx.x == 0) {
                    __threadfence();
                    st_release_gpu(ctrl + kCtrlFusedLayout, epoch);
                }
            }
        } else if (!counting) {
            // x's rows into L2 while the notify blocks work (the first kFusedPrefetchBytes of them).
            const int64_t lines_per_row = (hidden_bytes + 127) / 128;
            const int64_t rows = min(static_cast<int64_t>(num_tokens),
                                     max(static_cast<int64_t>(1), kFusedPrefetchBytes / (lines_per_row * 128)));
            const int64_t index = sender ? block : block - num_notify_blocks;   // among the blocks without notify work
            prefetch_rows_l2(x, x_row_bytes, lines_per_row, 0, rows * lines_per_row,
                             index * blockDim.x + threadIdx.x,
                             static_cast<int64_t>(gridDim.x - num_notify_blocks) * blockDim.x);
            if (sender && kNumRanks > 1)
                ok = wait_all_peers(peers, kSigDataConsumed, kNumRanks, epoch - 1, timeout_ns, sink, kPhaseDispatch);
        }
        // `ok` is uniform over the block here (every failure above is a block's).
        if (ok && (sender || (receives && !self_counting)))
            ok = wait_fused_flag(ctrl + kCtrlFusedPositions, epoch, timeout_ns, sink, rank, kAuxFusedPositions);
        if (ok && receives && !self_counting)
            ok = wait_fused_flag(ctrl + kCtrlFusedLayout, epoch, timeout_ns, sink, rank, kAuxFusedLayout);
    }

    const MessageLayout msg(num_topk, num_sf, hidden_bytes);
    const int num_chunks = hidden_bytes / 16;
    if (ok && sender) {
        ok = dispatch_send_blocks<kNumRanks, kMaxTopk>(
            x, x_row_bytes, sf, sf_stride_token, sf_stride_col, num_sf, topk_idx, topk_weights, send_expert_pos,
            token_of_slot, send_count, num_tokens, num_topk, num_max_tokens_per_rank, msg, num_chunks, peers, rank,
            recv_offset, sink, timeout_ns, epoch, block, num_send_blocks, chunk_rows, chunk_stride);
    } else if (ok && counting && !speculate) {
        ok = counter.receive(recv_args, counts, epoch, timeout_ns, sink, true, false);
    } else if (ok && receives && !counting) {
        ok = dispatch_recv_blocks<kNumRanks, kMaxTopk>(
            x, x_row_bytes, hidden_bytes, sf, sf_stride_token, sf_stride_col, num_sf, topk_idx, topk_weights,
            send_expert_pos, token_of_slot, recv_layout, num_tokens, num_topk, num_experts, num_max_tokens_per_rank,
            do_expand, do_zero_padding, num_out_rows, num_meta_rows, recv_x, recv_sf, recv_sf_stride_row,
            recv_sf_stride_col, recv_topk_idx, recv_topk_weights, recv_src_metadata, recv_src_idx, msg, num_chunks,
            peers, rank, recv_offset, sink, timeout_ns, epoch, recv_block, num_receivers - num_idle, chunk_rows,
            chunk_stride);
    }
    if (kNumRanks == 1) {
        // One rank (as in ep_dispatch.cu): only later kernels of this stream read the two words, no receiver waits
        // for an epoch: block 0 publishes without the ticket and its system-scope fences, once every block read the
        // epoch (or the next launch's late reader would wait for a flag one epoch ahead). Block 0 resets the count
        // even after a timeout (every block counted itself first thing); the wait is bounded all the same.
        const bool block_ok = !__syncthreads_or(!ok);
        if (block == 0 && threadIdx.x == 0) {
            const uint32_t target = gridDim.x;
            uint32_t seen = ld_acquire_gpu(ctrl + kCtrlFusedStarted);
            const uint64_t start = global_timer_ns();
            bool started = true;
            for (uint32_t iter = 0; seen < target; ++iter) {
                if ((iter & 255) == 255 && global_timer_ns() - start > timeout_ns) {
                    report_timeout(sink, kPhaseDispatch, rank, rank, target, seen, kAuxFusedStarted);
                    started = false;
                    break;
                }
                seen = ld_acquire_gpu(ctrl + kCtrlFusedStarted);
            }
            if (started) {
                *reinterpret_cast<volatile uint32_t*>(ctrl + kCtrlFusedStarted) = 0;
                if (block_ok) {
                    ctrl[kCtrlDataEpoch] = epoch;
                    ctrl[kSigDataConsumed + rank] = epoch;
                }
            }
        }
        return;
    }
    // As in ep_dispatch.cu: a timed-out wait leaves the epoch unpublished (the buffer is unusable after a timeout).
    if (__syncthreads_or(!ok))
        return;
    if (last_block_done(ctrl + kCtrlDispatchSendTicket)) {
        if (threadIdx.x == 0)
            ctrl[kCtrlDataEpoch] = epoch;
        if (threadIdx.x < kNumRanks)
            st_release_sys(peers.remote_signal(threadIdx.x, kSigDataConsumed), epoch);
    }
}

}  // namespace deepep
