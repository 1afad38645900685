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
//     blocks receive nothing when the other receivers are at least 3/4 of them: those start on the slots, long
//     before the notify blocks are done, and take the whole copy (a share dealt to a notify block would end after
//     its notify work).
// Three local flags inside the launch (control words of common/ep.cuh), each set to this dispatch's data epoch e (the
// flags only grow with the epoch: nothing to reset between launches):
//   slots ready (kCtrlFusedSlots): at one rank without expansion notify_body runs split (kSplitSlots: the
//     destination keys first, then the experts; elsewhere the single pass releases it with the positions); the last
//     notify block to arrive at its slots (ticket kCtrlFusedSlotArrivals, reset by it) releases e
//     once every notify block wrote its tokens' slots (send_pos, token_of_slot) and block 0 send_count and, at one
//     rank, the receive count. At one rank without expansion the receivers need no more (a received row is its
//     slot): they wait for this flag only and copy while the notify blocks still compute the expert positions.
//   positions ready (kCtrlFusedPositions): the last notify block to arrive (ticket kCtrlFusedArrivals, reset by it)
//     releases e once every notify block also wrote its tokens' expert positions. The senders need no more: they
//     send while block 0 still exchanges the counts with the peers.
//   layout ready (kCtrlFusedLayout): block 0 releases e once the receive layout is written (after the exchange).
//     The other receivers (several ranks, or expanded) wait for the positions and the layout.
// At one rank block 0 publishes the data epoch without the ticket and its system-scope fences (as ep_dispatch.cu):
// only later kernels of the stream read it. Every block counts itself in kCtrlFusedStarted right after reading the
// epoch (released at GPU scope), and block 0 stores the epoch only once the count is the grid, so that no block of
// this launch can read the new epoch (it would wait for flags one epoch ahead); block 0 resets the count.
// Before the flags, the blocks without notify work do what needs no layout: they prefetch their share of x into L2
// (at most kFusedPrefetchBytes), and the senders wait for their destinations' data_consumed (ep_dispatch.cu's
// senders do that first; they then find it done).
// Every wait is bounded (timeout.cuh): a notify block that timed out never raises a flag, and the blocks waiting for
// it give up once its record is written. They wait twice as long as a wait on a peer, so that a missing peer is
// reported as such (by the notify block that waited for it) rather than as a flag of this rank that never came; only a
// notify block stuck without a record makes them report (phase dispatch, peer = this rank, aux kAuxFusedSlots /
// kAuxFusedPositions / kAuxFusedLayout; kAuxFusedStarted: block 0's count of started blocks, at one rank).
// With the peers the protocol is the two kernels' (notify epoch and signals, data epoch, chunk signals, data_consumed
// published by the last block). Sending before the count exchange ends changes nothing for them: ep_dispatch.cu's
// senders, too, need only data_consumed[d] >= e - 1 before writing into d's slots and releasing its chunk signals.
//
// Why one kernel rather than Programmatic Dependent Launch between the two: griddepcontrol.wait returns only once the
// whole notify grid completed and flushed, so PDL would overlap the dispatch's launch and prologue with the notify's
// tail and no more; here the senders send while the counts are exchanged and, at one rank, the receivers copy while
// block 0 still writes the per-expert layout. It also needs no launch attributes (cuLaunchKernelEx) in the JIT layer.
#include "ep_notify.cu"
#include "ep_dispatch.cu"

namespace deepep {

// The prefetch ends (~1.4 us at 4096 tokens of 7168 BF16) before even the slots are ready, so it takes nothing from
// the copy and saves its first rows an HBM read: kept as is. Notify blocks of 512 tokens (one per thread) rather than
// 256: smaller ones would leave half of each block idle in notify_body (its loops and barriers span the block) and
// double the blocks of each cross-block prefix; what they would save, half the warps of each per-key block scan, is
// off the critical path at one rank (the receivers start on the slots) and is spent again on the prefix elsewhere.
constexpr int64_t kFusedPrefetchBytes = 8 << 20;

// notify_body's hooks here: the last notify block to arrive (ticket ctrl[ticket], reset by it) releases
// ctrl[flag] = epoch. "slots ready" and "positions ready" each have their own ticket.
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

template <bool kSplit>
struct SplitSlots {
    static constexpr bool value = kSplit;
};

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* ptr) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

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

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
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
    // Read by every block before any block can store it: with several ranks the last block stores it, after every
    // block passed its waits; at one rank block 0 stores it once every block counted itself in kCtrlFusedStarted
    // (each block's count is released after its read: the read cannot see the store).
    __shared__ uint32_t s_epoch;
    if (threadIdx.x == 0) {
        s_epoch = read_local(ctrl + kCtrlDataEpoch) + 1;
        if (kNumRanks == 1)
            red_add_release_gpu(ctrl + kCtrlFusedStarted, 1u);
    }
    __syncthreads();
    const uint32_t epoch = s_epoch;
    const int block = blockIdx.x;
    const bool sender = block < num_send_blocks;
    const int notify_block = block - num_send_blocks;      // this block's index among the notify blocks
    bool ok = true;
    if (notify_block >= 0 && notify_block < num_notify_blocks) {
        const auto n = static_cast<uint32_t>(num_notify_blocks);
        // The slots in a pass of their own only where a receiver starts on them (one rank, not expanded): elsewhere
        // nobody waits for them alone, and the split would cost a grid barrier before the positions.
        auto run_notify = [&](auto split) {
            return notify_body<kNumRanks, kMaxTopk, kDispatchThreads, decltype(split)::value>(
                topk_idx, num_tokens, num_topk, num_experts, num_max_tokens_per_rank, expert_alignment, peer_bases,
                rank, error_record, timeout_ns, scratch, send_pos, send_expert_pos, recv_layout, psum_recv_per_expert,
                do_expand, cumulative_stats, host_counts, host_seq, topk_copy, reported_num_tokens, expert_counts,
                num_channels, channel_prefix_matrix, recv_channel_prefix_matrix, rank_prefix_matrix, token_of_slot,
                send_count, notify_block, num_notify_blocks, smem,
                FusedArrival{ctrl, kCtrlFusedSlotArrivals, kCtrlFusedSlots, epoch, n},
                FusedArrival{ctrl, kCtrlFusedArrivals, kCtrlFusedPositions, epoch, n});
        };
        if (kNumRanks == 1 && !do_expand)
            ok = run_notify(SplitSlots<kNumRanks == 1>{});     // one instantiation only at several ranks
        else
            ok = run_notify(SplitSlots<false>{});
        if (notify_block == 0) {
            // Every thread's layout words are written: release them to the receivers.
            __syncthreads();
            if (ok && threadIdx.x == 0) {
                __threadfence();
                st_release_gpu(ctrl + kCtrlFusedLayout, epoch);
            }
        }
    } else {
        // x's rows into L2 while the notify blocks work (the first kFusedPrefetchBytes of them).
        const int64_t lines_per_row = (hidden_bytes + 127) / 128;
        const int64_t rows = min(static_cast<int64_t>(num_tokens),
                                 max(static_cast<int64_t>(1), kFusedPrefetchBytes / (lines_per_row * 128)));
        const int64_t stride = static_cast<int64_t>(gridDim.x - num_notify_blocks) * blockDim.x;
        const int64_t index = sender ? block : block - num_notify_blocks;     // among the blocks without notify work
        for (int64_t i = index * blockDim.x + threadIdx.x;
             i < rows * lines_per_row; i += stride)
            prefetch_l2(x + (i / lines_per_row) * x_row_bytes + (i % lines_per_row) * 128);
        if (sender && kNumRanks > 1)
            ok = wait_all_peers(peers, kSigDataConsumed, kNumRanks, epoch - 1, timeout_ns, sink, kPhaseDispatch);
    }
    // `ok` is uniform over the block here (every failure above is a block's).
    // One rank, not expanded: the receivers read only the slots (the row of a received token is its slot; its token
    // from token_of_slot, its expert ids from topk_idx) and the receive count of the layout, which notify_body writes
    // before the slots are released. The senders need the expert positions (in their messages), the other receivers
    // the layout.
    const bool needs_layout = kNumRanks > 1 || do_expand;
    // There the notify blocks, which finish last (expert positions, then block 0's layout), leave the copy to the
    // other receivers when those are at least 3/4 of the receivers (they then copy at most 4/3 of their share): a
    // static share of the rows (dispatch_recv_blocks deals them out by block) would start only after the notify
    // work, the others start on the slots. recv_block < 0: no receive. (features/ep/fused.py
    // fused_notify_blocks_receive states the same rule for the tests.)
    const int num_receivers = static_cast<int>(gridDim.x) - num_send_blocks;
    const int num_idle = (!needs_layout && num_receivers >= 4 * num_notify_blocks) ? num_notify_blocks : 0;
    const int recv_block = block - num_send_blocks - num_idle;
    const bool receives = !sender && recv_block >= 0;
    if (ok && receives && !needs_layout)
        ok = wait_fused_flag(ctrl + kCtrlFusedSlots, epoch, timeout_ns, sink, rank, kAuxFusedSlots);
    else if (ok && (sender || receives))
        ok = wait_fused_flag(ctrl + kCtrlFusedPositions, epoch, timeout_ns, sink, rank, kAuxFusedPositions);
    if (ok && receives && needs_layout)
        ok = wait_fused_flag(ctrl + kCtrlFusedLayout, epoch, timeout_ns, sink, rank, kAuxFusedLayout);

    const MessageLayout msg(num_topk, num_sf, hidden_bytes);
    const int num_chunks = hidden_bytes / 16;
    if (ok && sender) {
        ok = dispatch_send_blocks<kNumRanks, kMaxTopk>(
            x, x_row_bytes, sf, sf_stride_token, sf_stride_col, num_sf, topk_idx, topk_weights, send_expert_pos,
            token_of_slot, send_count, num_tokens, num_topk, num_max_tokens_per_rank, msg, num_chunks, peers, rank,
            recv_offset, sink, timeout_ns, epoch, block, num_send_blocks, chunk_rows, chunk_stride);
    } else if (ok && receives) {
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
