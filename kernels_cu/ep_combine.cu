// EP combine: the reverse of dispatch. Every rank sends, for each token it received, its partial result back into a
// slot at the token's origin; the origin reduces the slots in a fixed order (bitwise equal to refs.combine).
//
// Slots at the origin: [token][num_slots] rows of [hidden bfloat16 | K float32 weights] (CombineSlots in
// common/ep.cuh).
//   kLocalReduce = true  (num_slots = min(R, K)): one row per destination rank, already reduced over that rank's
//     local experts (non-expanded input is that sum; expanded input is summed here in ascending top-k order in FP32
//     and rounded to bfloat16 once: sum_local_rows). Slot index = the rank's ordinal among the token's destination
//     ranks in order of first top-k appearance (metadata column 1; topk_owners). At the origin, a rank's row enters
//     the final sum at the position of the rank's LAST top-k slot (DeepEP's refs.combine keeps a group's sum in its
//     last slot).
//   kLocalReduce = false (num_slots = K, expanded input with allow_multiple_reduction=False): top-k slot k's row goes
//     to slot k unreduced; the origin adds slots in ascending k.
// Final sum at the origin: FP32 accumulator = bias_0 + bias_1 (as floats), then the surviving partials in ascending
// top-k order, rounded to bfloat16 once. Weights: combined_topk_weights[t][k] = the weight the owner of top-k slot k
// sent back for slot k (0 where topk_idx is -1); with weights_over_ranks (DeepEP V1's definition, non-expanded input
// only) the FP32 sum, from 0, over the token's destination ranks in order of first top-k appearance, of the weight
// each sent back for slot k (equal to the owner's value when the others send 0, as V1's dispatch returns them).
//
// One launch, two roles, so that the reduction overlaps the sending (combine_impl_with_combine_reduce_epilogue_impl:
// the name holds both of DeepEP's kernel names, combine_impl and combine_reduce_epilogue_impl, as it does both jobs).
// Compiled per top-k bucket kMaxTopk with the exact top-k `num_topk` at run time ("top-k buckets", common/ep.cuh):
//   blocks [0, num_send_blocks) send. Rows of this rank's dispatch output, grouped by origin s, are cut into chunks
//     of chunk_rows rows (chunk j of origin s = rows [psum[s-1] + j * chunk_rows, ...)); block b takes chunks b,
//     b + num_send_blocks, ... of the list over origins, writes their partials into the slots at s, then releases
//     chunk_signal[me][j] = e at s. Our own tokens' partials are not sent (the receiving blocks read them from x).
//   blocks [num_send_blocks, gridDim.x) receive: per token t and owner d of one of its slots, wait for
//     chunk_signal[d][slot_of_t_at_d / chunk_rows] >= e in our workspace (the slot is the dispatch's send_pos[t][d]),
//     then reduce.
// Combine epoch e = the local count of combines; senders first wait for combine_consumed[d] >= e - 1 (d reduced
// our previous rows out of its slots); the last block of the launch stores e and publishes combine_consumed[me] = e
// at every rank. Chunk signals live at kChunkSignalOffset of the workspace: [src][chunk_stride] epochs.
#include "common/ep.cuh"

namespace deepep {

constexpr int kCombineThreads = 512;
// Warp-uniform chunk loops: the loops over a row's 16-byte chunks (lane l takes chunks l, l + 32, ...) shuffle the per-
// slot rows and slots between the lanes (__shfl_sync over the whole warp), so their trip count is the warp's, not the
// lane's: where the row's chunks do not fill the last pass (hidden not a multiple of 256), the lanes past its end
// repeat the last chunk's loads and store nothing. A lane-strided loop hung at hidden 128 (the lanes that
// left it met the next token's shuffles while the others still waited in this one).

template <int kNumRanks, int kMaxTopk, bool kLocalReduce>
__device__ __forceinline__ void
combine_send_blocks(const uint8_t* x, int hidden, int num_topk, const float* topk_weights, int do_expand,
                    const int32_t* recv_src_metadata, const int32_t* recv_layout, int num_experts,
                    int num_max_tokens_per_rank, int num_slots, const Peers& peers, int rank,
                    uint64_t combine_offset, const ErrorSink& sink, uint64_t timeout_ns, uint32_t epoch,
                    int send_block, int num_send_blocks, int chunk_rows, int chunk_stride) {
    if (!wait_all_peers(peers, kSigCombineConsumed, kNumRanks, epoch - 1, timeout_ns, sink, kPhaseCombine))
        return;

    const int num_local_experts = num_experts / kNumRanks;
    const RecvLayout layout{const_cast<int32_t*>(recv_layout), kNumRanks, num_local_experts};
    const int row_bytes = hidden * 2;
    const CombineSlots slot_layout(num_slots, hidden, num_topk);
    const int num_chunks = row_bytes / 16;
    const int meta_cols = num_topk + 2;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int num_warps = kCombineThreads / 32;
    // Chunks per origin (none for ourselves), as a prefix over origins.
    __shared__ int s_chunk_base[kNumRanks + 1];
    if (threadIdx.x == 0) {
        int total = 0;
        for (int s = 0; s < kNumRanks; ++s) {
            s_chunk_base[s] = total;
            const int count = layout.psum_src()[s] - (s > 0 ? layout.psum_src()[s - 1] : 0);
            total += s == rank ? 0 : (count + chunk_rows - 1) / chunk_rows;
        }
        s_chunk_base[kNumRanks] = total;
    }
    __syncthreads();

    for (int chunk = send_block; chunk < s_chunk_base[kNumRanks]; chunk += num_send_blocks) {
        int origin_rank = 0;
        while (chunk >= s_chunk_base[origin_rank + 1])
            ++origin_rank;
        const int j = chunk - s_chunk_base[origin_rank];
        const int origin_begin = origin_rank > 0 ? layout.psum_src()[origin_rank - 1] : 0;
        const int row0 = origin_begin + j * chunk_rows;
        const int rows = min(chunk_rows, layout.psum_src()[origin_rank] - row0);
        const RowSegments segs(rows, num_chunks, num_warps);
        for (int item = warp; item < rows * segs.num; item += num_warps) {
            const int i = row0 + item / segs.num, seg = item % segs.num;
            const int c_begin = segs.begin(seg), c_end = segs.end(seg, num_chunks);
            const int32_t* meta = recv_src_metadata + static_cast<int64_t>(i) * meta_cols;
            const int g = meta[0];
            const int s = g / num_max_tokens_per_rank, t = g % num_max_tokens_per_rank;
            // Expanded row of each top-k slot (lane k), -1 if not local.
            const int row = (do_expand && lane < num_topk) ? meta[2 + lane] : -1;
            const uint32_t rows_mask = __ballot_sync(0xffffffffu, row >= 0);
            uint8_t* origin = peers.base(s) + combine_offset;

            if (kLocalReduce) {
                const int slot = meta[1] % num_topk;
                uint8_t* dst = slot_layout.slot(origin, t, slot);
                if (!do_expand) {
                    warp_copy<true>(dst + c_begin * 16, x + static_cast<int64_t>(i) * row_bytes + c_begin * 16,
                                    (c_end - c_begin) * 16, lane);
                } else {
                    // Local rows of this token in ascending top-k order (lane k holds row k; rows_mask is
                    // warp-uniform, so the shuffles are too).
                    const auto local_row = [&](int k) { return __shfl_sync(0xffffffffu, row, k); };
                    // Every lane runs every pass (the shuffles need the whole warp: warp-uniform chunk loops, above).
                    for (int c0 = c_begin; c0 < c_end; c0 += 32) {
                        const int c = min(c0 + lane, c_end - 1);
                        const Vec16 v = sum_local_rows<kMaxTopk>(x, row_bytes, c, rows_mask, local_row);
                        if (c0 + lane < c_end)
                            st_na_v4(dst + c * 16, v);
                    }
                }
                if (seg == 0 && topk_weights != nullptr && lane < num_topk) {
                    float w = 0.f;
                    if (!do_expand)
                        w = topk_weights[static_cast<int64_t>(i) * num_topk + lane];
                    else if (row >= 0)
                        w = topk_weights[row];
                    reinterpret_cast<float*>(dst + slot_layout.weights_offset)[lane] = w;
                }
            } else {
                uint32_t pending = rows_mask;
                while (pending) {
                    const int k = __ffs(pending) - 1;
                    pending &= pending - 1;
                    const int r = __shfl_sync(0xffffffffu, row, k);
                    uint8_t* dst = slot_layout.slot(origin, t, k);
                    warp_copy<true>(dst + c_begin * 16, x + static_cast<int64_t>(r) * row_bytes + c_begin * 16,
                                    (c_end - c_begin) * 16, lane);
                    if (seg == 0 && topk_weights != nullptr && lane == k)
                        reinterpret_cast<float*>(dst + slot_layout.weights_offset)[k] = topk_weights[r];
                }
            }
        }
        // The chunk's rows are written (by every warp of the block): release them to their origin.
        __syncthreads();
        if (threadIdx.x == 0)
            st_release_sys(peers.chunk_signal(origin_rank, rank, chunk_stride, j), epoch);
    }
}

template <int kNumRanks, int kMaxTopk, bool kLocalReduce>
__device__ __forceinline__ void
combine_recv_blocks(const int64_t* topk_idx, int num_tokens, int num_topk, int hidden, int num_experts, int num_slots,
                    const uint8_t* bias0, const uint8_t* bias1, uint8_t* combined_x, float* combined_topk_weights,
                    int with_weights, int weights_over_ranks, const uint8_t* x, const float* topk_weights,
                    int do_expand, const int32_t* send_pos, const int32_t* recv_layout,
                    const int32_t* recv_src_metadata, const Peers& peers, int rank, uint64_t combine_offset,
                    const ErrorSink& sink,
                    uint64_t timeout_ns, uint32_t epoch, int recv_block, int num_recv_blocks, int chunk_rows,
                    int chunk_stride) {

    const int num_local_experts = num_experts / kNumRanks;
    const int row_bytes = hidden * 2;
    const CombineSlots slot_layout(num_slots, hidden, num_topk);
    const int num_chunks = row_bytes / 16;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int num_warps = blockDim.x / 32;
    const uint8_t* slots = peers.local() + combine_offset;
    const int total_warps = num_recv_blocks * num_warps;
    const RowSegments segs(num_tokens, num_chunks, total_warps);

    for (int item = recv_block * num_warps + warp; item < num_tokens * segs.num; item += total_warps) {
        const int t = item / segs.num, seg = item - t * segs.num;
        // Lane k: slot k's owner rank, whether slot k is the owner's last slot, and the owner's combine slot.
        const int64_t e = lane < num_topk ? topk_idx[static_cast<int64_t>(t) * num_topk + lane] : -1;
        const int owner = (e >= 0 && e < num_experts) ? static_cast<int>(e) / num_local_experts : -1;
        const TopkOwners owners = topk_owners<kMaxTopk>(owner, lane, num_topk);
        const int src_slot = kLocalReduce ? owners.ordinal(owners.first_k) : lane;
        // Slots that enter the final sum, in ascending top-k order.
        const uint32_t adds = __ballot_sync(0xffffffffu, lane < num_topk && (kLocalReduce ? owners.last : owner >= 0));

        // Wait until every other owner's chunk holding this token's partial (and weights) has been released.
        bool ok = true;
        if (lane < num_topk && owner >= 0 && owner != rank && ((adds >> lane) & 1u)) {
            const int j = send_pos[static_cast<int64_t>(t) * kNumRanks + owner] / chunk_rows;
            ok = wait_epoch(peers.chunk_signal(rank, owner, chunk_stride, j), epoch, timeout_ns, sink, kPhaseCombine,
                            rank, owner, kSigCombine);
        }
        if (__any_sync(0xffffffffu, !ok))
            break;
        const uint8_t* token_slots = slot_layout.token(slots, t);
        // Our own partials never went through the slots: they are rows of x. Row of this token in the dispatch
        // output (our slot of it, after the tokens of lower source ranks), and per top-k slot the row of x to read
        // (non-expanded: that row; expanded: the slot's expert row from the metadata, -1 if not ours).
        const uint32_t own_mask = __ballot_sync(0xffffffffu, lane < num_topk && owner == rank);
        int own_row = -1, own_k_row = -1;
        if (own_mask != 0) {
            own_row = send_pos[static_cast<int64_t>(t) * kNumRanks + rank] + (rank > 0 ? recv_layout[rank - 1] : 0);
            if (do_expand && ((own_mask >> lane) & 1u))
                own_k_row = recv_src_metadata[static_cast<int64_t>(own_row) * (num_topk + 2) + 2 + lane];
        }
        // Per top-k slot k (lane k holds them; the masks are warp-uniform, so the shuffles below are too): the slot
        // to read, or the row of x.
        const auto x_row_of = [&](int k) { return do_expand ? __shfl_sync(0xffffffffu, own_k_row, k) : own_row; };
        const auto slot_of = [&](int k) { return __shfl_sync(0xffffffffu, src_slot, k); };
        const int c_end = segs.end(seg, num_chunks);
        // Every lane runs every pass (the shuffles need the whole warp: warp-uniform chunk loops, above).
        for (int c0 = segs.begin(seg); c0 < c_end; c0 += 32) {
            const int c = min(c0 + lane, c_end - 1);
            // Issue every load of this chunk first (biases, then partials in batches of 8), then add in order.
            Vec16 b0, b1;
            if (bias0 != nullptr)
                b0 = ld_nc_v4(bias0 + static_cast<int64_t>(t) * row_bytes + c * 16);
            if (bias1 != nullptr)
                b1 = ld_nc_v4(bias1 + static_cast<int64_t>(t) * row_bytes + c * 16);
            // Our own reduced partial (local reduce, expanded input): the FP32 sum of our expert rows in ascending
            // top-k order rounded to bfloat16 once, exactly what the send kernel computes for the other ranks.
            Vec16 own_sum;
            if (kLocalReduce && do_expand && own_mask != 0)
                own_sum = sum_local_rows<kMaxTopk>(x, row_bytes, c, own_mask, x_row_of);
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            #pragma unroll
            for (int k0 = 0; k0 < kMaxTopk; k0 += 8) {
                Vec16 v[8];
                #pragma unroll
                for (int u = 0; u < 8; ++u) {
                    const int k = k0 + u;
                    if (k < kMaxTopk && ((adds >> k) & 1u)) {
                        if (!((own_mask >> k) & 1u))
                            v[u] = ld_v4(token_slots + static_cast<int64_t>(slot_of(k)) * slot_layout.bytes + c * 16);
                        else if (kLocalReduce && do_expand)
                            v[u] = own_sum;
                        else
                            v[u] = ld_nc_v4(x + static_cast<int64_t>(x_row_of(k)) * row_bytes + c * 16);
                    }
                }
                if (k0 == 0) {
                    if (bias0 != nullptr)
                        add_bf16x8(acc, b0);
                    if (bias1 != nullptr)
                        add_bf16x8(acc, b1);
                }
                #pragma unroll
                for (int u = 0; u < 8; ++u)
                    if (k0 + u < kMaxTopk && ((adds >> (k0 + u)) & 1u))
                        add_bf16x8(acc, v[u]);
            }
            if (c0 + lane < c_end)
                st_v4(combined_x + static_cast<int64_t>(t) * row_bytes + c * 16, round_bf16x8(acc));
        }
        if (seg == 0 && with_weights && lane < num_topk && kLocalReduce && weights_over_ranks) {
            // Every destination rank of the token, in order of first top-k appearance (= combine slot order; the
            // owner of each first slot read from topk_idx: no shuffles in this divergent branch).
            float w = 0.f;
            uint32_t firsts = owners.firsts;
            for (int ordinal = 0; firsts != 0; ++ordinal) {
                const int f = __ffs(firsts) - 1;
                firsts &= firsts - 1;
                const int d = static_cast<int>(topk_idx[static_cast<int64_t>(t) * num_topk + f]) / num_local_experts;
                w += d == rank ? topk_weights[static_cast<int64_t>(own_row) * num_topk + lane]
                               : reinterpret_cast<const volatile float*>(token_slots + static_cast<int64_t>(ordinal) *
                                                                         slot_layout.bytes +
                                                                         slot_layout.weights_offset)[lane];
            }
            combined_topk_weights[static_cast<int64_t>(t) * num_topk + lane] = w;
        } else if (seg == 0 && with_weights && lane < num_topk) {
            float w = 0.f;
            if (owner == rank)         // what the send kernel would have sent us for this slot
                w = !do_expand ? topk_weights[static_cast<int64_t>(own_row) * num_topk + lane]
                               : own_k_row >= 0 ? topk_weights[own_k_row] : 0.f;
            else if (owner >= 0)
                w = reinterpret_cast<const volatile float*>(token_slots + static_cast<int64_t>(src_slot) *
                                                            slot_layout.bytes + slot_layout.weights_offset)[lane];
            combined_topk_weights[static_cast<int64_t>(t) * num_topk + lane] = w;
        }
    }
}

template <int kNumRanks, int kMaxTopk, bool kLocalReduce>
__global__ void __launch_bounds__(kCombineThreads, 1)
combine_impl_with_combine_reduce_epilogue_impl(
    const uint8_t* x, int hidden, const float* topk_weights, int do_expand, const int32_t* recv_src_metadata,
    const int32_t* recv_layout, const int32_t* send_pos, const int64_t* topk_idx, int num_tokens, int num_topk,
    int num_experts, int num_max_tokens_per_rank, int num_slots, const uint8_t* bias0, const uint8_t* bias1,
    uint8_t* combined_x, float* combined_topk_weights, int with_weights, int weights_over_ranks,
    int num_send_blocks, int chunk_rows, int chunk_stride, const uint64_t* peer_bases, int rank,
    uint64_t combine_offset, int32_t* error_record, uint64_t timeout_ns) {
    const Peers peers{peer_bases, rank};
    uint32_t* ctrl = peers.local_ctrl();
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    const uint32_t epoch = read_local(ctrl + kCtrlCombineEpoch) + 1;
    if (static_cast<int>(blockIdx.x) < num_send_blocks) {
        combine_send_blocks<kNumRanks, kMaxTopk, kLocalReduce>(
            x, hidden, num_topk, topk_weights, do_expand, recv_src_metadata, recv_layout, num_experts,
            num_max_tokens_per_rank, num_slots, peers, rank, combine_offset, sink, timeout_ns, epoch, blockIdx.x,
            num_send_blocks, chunk_rows, chunk_stride);
    } else {
        combine_recv_blocks<kNumRanks, kMaxTopk, kLocalReduce>(
            topk_idx, num_tokens, num_topk, hidden, num_experts, num_slots, bias0, bias1, combined_x,
            combined_topk_weights, with_weights, weights_over_ranks, x, topk_weights, do_expand, send_pos, recv_layout,
            recv_src_metadata, peers, rank, combine_offset, sink, timeout_ns, epoch, blockIdx.x - num_send_blocks,
            gridDim.x - num_send_blocks, chunk_rows, chunk_stride);
    }
    // Every block done (all our slots reduced, all our rows released): the next combine may overwrite them.
    if (last_block_done(ctrl + kCtrlCombineSendTicket)) {
        if (threadIdx.x == 0)
            ctrl[kCtrlCombineEpoch] = epoch;
        if (threadIdx.x < kNumRanks)
            st_release_sys(peers.remote_signal(threadIdx.x, kSigCombineConsumed), epoch);
    }
}

}  // namespace deepep
