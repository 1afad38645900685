// EP dispatch, the previous design (DEEPEP_CUPY_EP_LEGACY_DISPATCH=1; the default is ep_dispatch.cu): a send kernel
// (dispatch_send_legacy: warps walk this rank's tokens, each token straight into its slot at every destination rank,
// over NVLink) and a receive epilogue that starts once every source finished (dispatch_recv_legacy: slots → the
// user's tensors, in the order and layout asked for; ep_dispatch.cu's receivers produce the same bytes).
// Both are compiled per top-k bucket kMaxTopk and take the exact top-k `num_topk` ("top-k buckets", common/ep.cuh).
//
// Protocol per dispatch (data epoch e = the local count of dispatches, bumped by the send kernel's last block):
//   send:  threads [0, R) of every block first wait for data_consumed[d] >= e - 1 at this rank (destination d has
//          copied our previous messages out); warps then write messages into slot [me][send_pos[t][d]] of every
//          destination d; the last block to finish publishes data_signal[me] = e at every destination (release).
//   recv:  waits for data_signal[s] >= e from every source, copies messages out, and the last block publishes
//          data_consumed[me] = e at every source.
#include "common/ep.cuh"

namespace deepep {

constexpr int kLegacySendThreads = 512;
constexpr int kLegacyRecvThreads = 512;

template <int kNumRanks, int kMaxTopk>
__global__ void __launch_bounds__(kLegacySendThreads, 1)
dispatch_send_legacy(const uint8_t* x, int64_t x_row_bytes, int hidden_bytes,
                     const uint8_t* sf, int64_t sf_stride_token, int64_t sf_stride_col, int num_sf,
                     const int64_t* topk_idx, const float* topk_weights, const int32_t* send_pos,
                     const int32_t* send_expert_pos, int num_tokens, int num_topk, int num_max_tokens_per_rank,
                     const uint64_t* peer_bases, int rank, uint64_t recv_offset, int32_t* error_record,
                     uint64_t timeout_ns) {
    const Peers peers{peer_bases, rank};
    uint32_t* ctrl = peers.local_ctrl();
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    const uint32_t epoch = read_local(ctrl + kCtrlDataEpoch) + 1;
    if (!wait_all_peers(peers, kSigDataConsumed, kNumRanks, epoch - 1, timeout_ns, sink, kPhaseDispatch))
        return;

    const MessageLayout msg(num_topk, num_sf, hidden_bytes);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int num_warps = kLegacySendThreads / 32;
    const int num_chunks = hidden_bytes / 16;
    const int total_warps = gridDim.x * num_warps;
    const RowSegments segs(num_tokens, num_chunks, total_warps);
    for (int item = blockIdx.x * num_warps + warp; item < num_tokens * segs.num; item += total_warps) {
        const int t = item / segs.num, seg = item - t * segs.num;
        // Destination message addresses (uniform across the warp).
        uint8_t* dst[kNumRanks];
        #pragma unroll
        for (int d = 0; d < kNumRanks; ++d) {
            const int slot = send_pos[static_cast<int64_t>(t) * kNumRanks + d];
            dst[d] = slot < 0 ? nullptr
                              : peers.base(d) + recv_offset +
                                    (static_cast<int64_t>(rank) * num_max_tokens_per_rank + slot) * msg.bytes;
        }
        // Meta (first segment): lane k < K writes slot k's expert, weight and expert position; lane 0 the source
        // index; then the scale factors (4 bytes each, any strides).
        if (seg == 0 && lane < num_topk) {
            const int64_t e = topk_idx[static_cast<int64_t>(t) * num_topk + lane];
            const float w = topk_weights != nullptr ? topk_weights[static_cast<int64_t>(t) * num_topk + lane] : 0.f;
            const int32_t pos = send_expert_pos[static_cast<int64_t>(t) * num_topk + lane];
            #pragma unroll
            for (int d = 0; d < kNumRanks; ++d) {
                if (dst[d] != nullptr) {
                    msg.expert_ids(dst[d])[lane] = static_cast<int32_t>(e);
                    msg.weights(dst[d])[lane] = w;
                    msg.expert_pos(dst[d])[lane] = pos;
                }
            }
        }
        if (seg == 0 && lane == 0) {
            #pragma unroll
            for (int d = 0; d < kNumRanks; ++d)
                if (dst[d] != nullptr)
                    *msg.src_idx(dst[d]) = t;
        }
        for (int p = seg == 0 ? lane : num_sf; p < num_sf; p += 32) {
            const uint32_t v = *reinterpret_cast<const uint32_t*>(sf + (t * sf_stride_token + p * sf_stride_col) * 4);
            #pragma unroll
            for (int d = 0; d < kNumRanks; ++d)
                if (dst[d] != nullptr)
                    reinterpret_cast<uint32_t*>(dst[d] + msg.sf_offset)[p] = v;
        }
        // Hidden: each 16-byte chunk read once, stored to every remote destination; 8 chunks in flight per lane.
        // Our own rows skip the staging slots (the receive epilogue reads them straight from x), so a token without a
        // remote destination loads nothing (at one rank, the send moves metadata only).
        bool any_remote = false;
        #pragma unroll
        for (int d = 0; d < kNumRanks; ++d)
            any_remote |= dst[d] != nullptr && d != rank;
        if (!any_remote)
            continue;
        const uint8_t* src = x + t * x_row_bytes;
        constexpr int kUnroll = 8;
        const int c_end = segs.end(seg, num_chunks);
        for (int base = segs.begin(seg) + lane; base < c_end; base += 32 * kUnroll) {
            Vec16 v[kUnroll];
            #pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (base + u * 32 < c_end)
                    v[u] = ld_nc_v4(src + static_cast<int64_t>(base + u * 32) * 16);
            #pragma unroll
            for (int d = 0; d < kNumRanks; ++d) {
                if (dst[d] == nullptr || d == rank)
                    continue;
                #pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (base + u * 32 < c_end)
                        st_na_v4(dst[d] + msg.hidden_offset + static_cast<int64_t>(base + u * 32) * 16, v[u]);
            }
        }
    }

    if (last_block_done(ctrl + kCtrlDispatchSendTicket)) {
        if (threadIdx.x == 0)
            ctrl[kCtrlDataEpoch] = epoch;
        if (threadIdx.x < kNumRanks)
            st_release_sys(peers.remote_signal(threadIdx.x, kSigData), epoch);
    }
}

// Copy the received messages into the user's tensors (our own tokens' hidden bytes come straight from x).
//   Non-expanded (do_expand = 0): row i of recv_x / recv_sf / recv_topk_idx / recv_topk_weights / metadata is the
//     i-th received token (sources ascending, then token index at the source). recv_topk_idx holds the local expert
//     id or -1; recv_topk_weights the weight or 0 where not local. Rows [num_recv, num_out_rows) get topk -1 and
//     metadata -1 (worst-case outputs without a CPU sync).
//   Expanded (do_expand = 1): one row per (token, local expert) pair, expert j's rows from layout start[j], in
//     (source, token) order; recv_topk_weights is 1-D. With do_zero_padding the alignment gaps get zeros.
//   Metadata [num_recv][K + 2]: src_rank * M + src token index; src_rank * K + combine slot (the ordinal of this rank
//   among the token's destination ranks in order of first top-k appearance); then per top-k slot the expanded row
//   (expanded mode) or -1. recv_src_idx (DeepEP V1's handle, when asked for): [num_recv] the token index at the source.
//   Rows past num_meta_rows are not written (a no-sync caller's num_worst_tokens below the real count).
template <int kNumRanks, int kMaxTopk>
__global__ void __launch_bounds__(kLegacyRecvThreads)
dispatch_recv_legacy(const uint8_t* x, int64_t x_row_bytes, int hidden_bytes, int num_sf, int num_topk,
                     int num_experts, int num_max_tokens_per_rank,
                     const int32_t* recv_layout, int do_expand, int do_zero_padding, int num_out_rows,
                     int num_meta_rows,
                     uint8_t* recv_x, uint8_t* recv_sf, int64_t recv_sf_stride_row,
                     int64_t recv_sf_stride_col, int64_t* recv_topk_idx, float* recv_topk_weights,
                     int32_t* recv_src_metadata, int32_t* recv_src_idx, const uint64_t* peer_bases, int rank,
                     uint64_t recv_offset, int32_t* error_record, uint64_t timeout_ns) {
    const Peers peers{peer_bases, rank};
    uint32_t* ctrl = peers.local_ctrl();
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    const uint32_t epoch = read_local(ctrl + kCtrlDataEpoch);
    if (!wait_all_peers(peers, kSigData, kNumRanks, epoch, timeout_ns, sink, kPhaseDispatch))
        return;

    const int num_local_experts = num_experts / kNumRanks;
    const RecvLayout layout{const_cast<int32_t*>(recv_layout), kNumRanks, num_local_experts};
    const int num_recv = min(layout.totals()[0], num_meta_rows);
    const MessageLayout msg(num_topk, num_sf, hidden_bytes);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int num_warps = blockDim.x / 32;
    const int global_warp = blockIdx.x * num_warps + warp, total_warps = gridDim.x * num_warps;
    const int meta_cols = num_topk + 2;
    const int num_chunks = hidden_bytes / 16;
    const RowSegments segs(num_recv, num_chunks, total_warps);

    for (int item = global_warp; item < num_recv * segs.num; item += total_warps) {
        const int i = item / segs.num, seg = item - i * segs.num;
        const int c_begin = segs.begin(seg), c_bytes = (segs.end(seg, num_chunks) - c_begin) * 16;
        int s = 0;
        #pragma unroll
        for (int r = 0; r < kNumRanks - 1; ++r)
            s += (i >= layout.psum_src()[r]) ? 1 : 0;
        const int slot = i - (s > 0 ? layout.psum_src()[s - 1] : 0);
        uint8_t* m = peers.local() + recv_offset + (static_cast<int64_t>(s) * num_max_tokens_per_rank + slot) * msg.bytes;
        // Hidden bytes: from the slot, or for our own tokens from x (the send kernel skipped them).
        const uint8_t* hidden_src = s == rank ? x + static_cast<int64_t>(*msg.src_idx(m)) * x_row_bytes
                                              : m + msg.hidden_offset;

        // Per top-k slot: global expert, whether local, owner rank.
        const int e = lane < num_topk ? msg.expert_ids(m)[lane] : -1;
        const int owner = e >= 0 ? e / num_local_experts : -1;
        const bool local = owner == rank;
        const float w = lane < num_topk ? msg.weights(m)[lane] : 0.f;
        // Combine slot: number of distinct owners among top-k slots before this rank's first slot.
        const uint32_t local_mask = __ballot_sync(0xffffffffu, local);
        const int first_local = __ffs(local_mask) - 1;
        const int combine_slot = topk_owners<kMaxTopk>(owner, lane, num_topk).ordinal(first_local);
        // The first segment of a row writes its metadata, top-k and scale factors; every segment copies its chunks.
        const bool first_seg = seg == 0;
        if (first_seg && lane == 0) {
            recv_src_metadata[static_cast<int64_t>(i) * meta_cols] = s * num_max_tokens_per_rank + *msg.src_idx(m);
            recv_src_metadata[static_cast<int64_t>(i) * meta_cols + 1] = s * num_topk + combine_slot;
            if (recv_src_idx != nullptr)
                recv_src_idx[i] = *msg.src_idx(m);
        }

        if (!do_expand) {
            if (first_seg && lane < num_topk) {
                recv_topk_idx[static_cast<int64_t>(i) * num_topk + lane] = local ? e - rank * num_local_experts : -1;
                if (recv_topk_weights != nullptr)
                    recv_topk_weights[static_cast<int64_t>(i) * num_topk + lane] = local ? w : 0.f;
                recv_src_metadata[static_cast<int64_t>(i) * meta_cols + 2 + lane] = -1;
            }
            for (int p = first_seg ? lane : num_sf; p < num_sf; p += 32)
                reinterpret_cast<uint32_t*>(recv_sf)[i * recv_sf_stride_row + p * recv_sf_stride_col] =
                    reinterpret_cast<const uint32_t*>(m + msg.sf_offset)[p];
            warp_copy(recv_x + static_cast<int64_t>(i) * hidden_bytes + c_begin * 16, hidden_src + c_begin * 16,
                      c_bytes, lane);
        } else {
            int row = -1;
            if (local) {
                const int j = e - rank * num_local_experts;
                row = layout.start()[j] + layout.src_base()[s * num_local_experts + j] + msg.expert_pos(m)[lane];
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
                for (int p = first_seg ? lane : num_sf; p < num_sf; p += 32)
                    reinterpret_cast<uint32_t*>(recv_sf)[r * recv_sf_stride_row + p * recv_sf_stride_col] =
                        reinterpret_cast<const uint32_t*>(m + msg.sf_offset)[p];
                warp_copy(recv_x + static_cast<int64_t>(r) * hidden_bytes + c_begin * 16, hidden_src + c_begin * 16,
                          c_bytes, lane);
            }
        }
    }

    // Worst-case outputs (no CPU sync): mark the token rows past the real count (top-k ids and metadata -1).
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t num_threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
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
                for (int p = lane; p < num_sf; p += 32)
                    reinterpret_cast<uint32_t*>(recv_sf)[r * recv_sf_stride_row + p * recv_sf_stride_col] = 0;
                if (lane == 0 && recv_topk_weights != nullptr)
                    recv_topk_weights[r] = 0.f;
            }
        }
    }

    if (last_block_done(ctrl + kCtrlDispatchRecvTicket)) {
        if (threadIdx.x < kNumRanks)
            st_release_sys(peers.remote_signal(threadIdx.x, kSigDataConsumed), epoch);
    }
}

}  // namespace deepep
