// EP notify: the send layout of this rank's tokens and the exchange of counts with the peers of the scale-up domain.
//
// Cooperative launch, one block per tile of kNotifyThreads tokens (a warp per 32 tokens), the grid capped at the
// blocks that can be co-resident (features/ep/plan.py notify_grid): with more tiles than that, a block takes several
// (notify_body). Compiled per top-k bucket kMaxTopk; the exact top-k is `num_topk` (see "top-k buckets" in
// common/ep.cuh). The work is notify_body, which ep_fused.cu runs too (the notify and the dispatch in one launch,
// with tiles of 512 tokens).
//   1. Every token: the destination ranks it goes to (once per rank owning >= 1 of its experts), its slot at each
//      destination = its position among this rank's tokens going there (so received rows are ordered by source rank,
//      then token index: deterministic), and, per top-k slot, its position among this rank's tokens choosing that
//      expert (the expanded layout uses it, again in token order).
//      Positions = position inside the warp (brute force over the 32 tokens) + earlier warps of the tile + earlier
//      tiles of the block + earlier blocks (per-block counts exchanged through scratch memory and a grid barrier).
//   2. Block 0 writes, into every peer d, the number of tokens going to d and the (token, slot) pairs going to each
//      of d's local experts, then releases notify_signal[me] at d with the new notify epoch; waits for every peer's
//      signal; derives the receive layout (prefix sums over sources, per-expert counts, aligned expanded starts) into
//      the handle's layout blob; and publishes the totals to host-mapped memory for the optional CPU wait.
//   3. With it, every rank also learns the whole count matrix and every rank's dispatched token count (the notify
//      rows, common/ep.cuh): block 0 writes its row into every peer with the counts. What DeepEP V1's handle holds
//      comes from there when asked for: rank_prefix_matrix [R][R] (M[i][j] = tokens ranks 0..i send to j),
//      channel_prefix_matrix [R][C] (per destination, inclusive prefix over V1's C channels, channel c = tokens
//      [c * ceil(N / C), ...), of the tokens sent there; one more grid barrier) and recv_channel_prefix_matrix [R][C]
//      (per source, where its channel c starts inside its block of ours); the largest dispatched token count over
//      the ranks goes to host_counts[kHostMaxTokensWord] (the V1 adapter grows its buffer from it).
//      expert_counts, when given, replaces the per-expert counts the exchange publishes (V1's num_tokens_per_expert
//      for a dispatch without top-k, whose top-k ids are synthetic: one per destination rank).
//   Also for the dispatch kernel's senders (which walk each destination's slots in order): token_of_slot[d][p], the
//   token in slot p at destination d, and send_count[d], the tokens going to d.
//   Shortcuts: a single block (decode sizes) has no grid barrier (its V1 channel barrier is a block barrier); one rank
//   exchanges nothing (its notify rows go to its own workspace, read back after a block barrier).
#include "common/ep.cuh"
#include "common/value_range.cuh"

namespace deepep {

constexpr int kNotifyThreads = 256;
constexpr int kHostMaxTokensWord = 3 + kNotifyMaxLocalExperts;   // in host_counts, after the per-expert counts

// No hook: the notify kernel alone.
struct NoNotifyHook {
    __device__ __forceinline__ void operator()() const {}
};

// This thread's token of a tile (kThreads tokens, one per thread): its experts (-1 = none; slots k >= num_topk hold
// none), the destination ranks it goes to, and its positions among the tile's warp's tokens (per destination; per
// top-k slot, among the warp's tokens choosing that expert).
template <int kNumRanks, int kMaxTopk>
struct NotifyToken {
    int t;
    bool valid;
    int expert[kMaxTopk];
    uint32_t dst_mask;
    int dst_pos[kNumRanks];
    int expert_pos[kMaxTopk];
};

// One tile of the notify's first step, for every thread of the block: its token (`tok`, tokens
// [tile * kThreads, (tile + 1) * kThreads)) and, in `warp_counts` ([kThreads / 32][num_keys]), per warp the count of
// its tokens going to each rank (rank keys) and the lane mask of its tokens choosing each expert (expert keys). Copies
// the tile's top-k ids to `topk_copy` when it is not null. Starts and ends with the block in step (the caller's
// previous reads of `warp_counts` must be done: a block barrier before a second tile).
template <int kNumRanks, int kMaxTopk, int kThreads>
__device__ __forceinline__ void
notify_tile(NotifyToken<kNumRanks, kMaxTopk>& tok, int tile, const int64_t* topk_idx, int num_tokens, int num_topk,
            int num_experts, int64_t* topk_copy, int32_t* warp_counts) {
    constexpr int kNotifyWarps = kThreads / 32;
    const int num_keys = num_experts + kNumRanks;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int num_local_experts = num_experts / kNumRanks;
    tok.t = tile * kThreads + threadIdx.x;
    tok.valid = tok.t < num_tokens;
    // The top-k ids first: their loads are the longest wait of a decode-sized notify, in flight while the block
    // zeroes its counters.
    int64_t raw_topk[kMaxTopk];
    #pragma unroll
    for (int k = 0; k < kMaxTopk; ++k)
        raw_topk[k] = (tok.valid && k < num_topk) ? topk_idx[static_cast<int64_t>(tok.t) * num_topk + k] : -1;
    for (int i = threadIdx.x; i < kNotifyWarps * num_keys; i += blockDim.x)
        warp_counts[i] = 0;
    #pragma unroll
    for (int k = 0; k < kMaxTopk; ++k)
        tok.expert[k] = (raw_topk[k] >= 0 && raw_topk[k] < num_experts) ? static_cast<int>(raw_topk[k]) : -1;
    // The copy of the ids now: the raw ids are dead from here on (no registers held across the passes at top-32).
    if (topk_copy != nullptr && tok.valid) {
        #pragma unroll
        for (int k = 0; k < kMaxTopk; ++k)
            if (k < num_topk)
                topk_copy[static_cast<int64_t>(tok.t) * num_topk + k] = raw_topk[k];
    }
    // Destination mask.
    tok.dst_mask = 0;
    #pragma unroll
    for (int k = 0; k < kMaxTopk; ++k)
        if (tok.expert[k] >= 0)
            tok.dst_mask |= 1u << (tok.expert[k] / num_local_experts);
    __syncthreads();

    // Position inside the warp: destinations via ballots, experts by comparing with earlier lanes' experts.
    const uint32_t lt_mask = (1u << lane) - 1;
    #pragma unroll
    for (int d = 0; d < kNumRanks; ++d) {
        const uint32_t ballot = __ballot_sync(0xffffffffu, (tok.dst_mask >> d) & 1u);
        tok.dst_pos[d] = __popc(ballot & lt_mask);
        if (lane == 0)
            warp_counts[warp * num_keys + num_experts + d] = __popc(ballot);
    }
    // Experts: every lane sets its bit in the warp's mask of each of its experts; a token's position among the warp's
    // tokens choosing expert e is the number of lower lanes in e's mask (a token counts once per expert).
    uint32_t* warp_masks = reinterpret_cast<uint32_t*>(warp_counts + warp * num_keys);
    #pragma unroll
    for (int k = 0; k < kMaxTopk; ++k)
        if (tok.expert[k] >= 0)
            atomicOr(&warp_masks[tok.expert[k]], 1u << lane);
    __syncwarp();
    #pragma unroll
    for (int k = 0; k < kMaxTopk; ++k)
        tok.expert_pos[k] = tok.expert[k] >= 0 ? __popc(warp_masks[tok.expert[k]] & lt_mask) : 0;
    __syncthreads();
}

// The notify's work for the blocks [0, num_blocks) of a launch of kThreads threads per block, `block` this block's
// index among them and `smem` the dynamic shared memory (notify_smem_bytes in features/ep/plan.py, for kThreads / 32
// warps). The tokens come in tiles of kThreads (one token per thread); block b takes the tiles
// [b * P, (b + 1) * P), P = ceil(tiles / num_blocks): one tile when the grid covers the tokens (its tokens' state
// stays in registers across the grid barrier), several when the grid is capped at the blocks that can be co-resident
// (features/ep/plan.py notify_grid; then a counting pass over the block's tiles before the grid barrier and a placing
// pass after it, which reads the tiles again). Only with `kTiled` (the notify kernel): the fused kernel's grid always
// has a block per tile (features/ep/fused.py refuses more notify blocks than it has), and the second path would cost
// it registers it does not have. What it computes depends on neither kThreads nor the grid (positions are counts of
// earlier tokens). `on_positions()` is called by every thread of every block once the block's per-token
// outputs (send_pos, token_of_slot, send_expert_pos, V1 channel prefixes) and, in block 0, send_count are written (a
// block barrier after it is the hook's). Returns false (in every thread of the block) after a timeout.
template <int kNumRanks, int kMaxTopk, int kThreads, typename OnPositions, bool kTiled = false>
__device__ __forceinline__ bool
notify_body(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_max_tokens_per_rank,
            int expert_alignment, const uint64_t* peer_bases, int rank, int32_t* error_record, uint64_t timeout_ns,
            int32_t* scratch,                 // [num_blocks][num_experts + kNumRanks], local
            int32_t* send_pos,                // [num_tokens][kNumRanks] out: slot at each destination or -1
            int32_t* send_expert_pos,         // [num_tokens][num_topk] out: position among tokens of that expert
            int32_t* recv_layout,             // layout blob (see RecvLayout) out
            int32_t* psum_recv_per_expert,    // [L] out, or null (see features/ep/handle.py: two conventions)
            int do_expand,
            int32_t* cumulative_stats,        // [L] += unaligned counts, or null
            int32_t* host_counts,             // host-mapped: seq, num_recv, num_expanded, aligned counts [L];
                                              // [kHostMaxTokensWord] the most tokens any rank dispatches
            int host_seq,
            int64_t* topk_copy,               // [num_tokens][num_topk] out: a copy of topk_idx, or null
            int reported_num_tokens,          // published to the peers (the caller's count, >= num_tokens)
            const int32_t* expert_counts,     // [num_experts] published per-expert counts instead, or null
            int num_channels,                 // DeepEP V1 channels of the matrices below (0: none)
            int32_t* channel_prefix_matrix,   // [kNumRanks][num_channels] out, or null (num_channels = 0)
            int32_t* recv_channel_prefix_matrix,   // [kNumRanks][num_channels] out, or null
            int32_t* rank_prefix_matrix,      // [kNumRanks][kNumRanks] out, or null
            int32_t* token_of_slot,           // [kNumRanks][num_tokens] out: the token in slot p at destination d
            int32_t* send_count,              // [kNumRanks] out: tokens this rank sends to each destination
            int block, int num_blocks,
            int32_t* smem,                    // [kNotifyWarps][num_keys] per-warp counts, then block bases
            const OnPositions& on_positions) {
    constexpr int kTokensPerTile = kThreads;     // one token per thread
    constexpr int kNotifyWarps = kThreads / 32;
    const int num_keys = num_experts + kNumRanks;
    const int warp = threadIdx.x / 32;
    const int num_local_experts = num_experts / kNumRanks;
    // This block's tiles (see above; with one tile per block, block b's tile is b, past the tokens or not).
    const int num_tiles = max(1, (num_tokens + kTokensPerTile - 1) / kTokensPerTile);
    const int tiles_per_block = (num_tiles + num_blocks - 1) / num_blocks;
    const bool one_tile = tiles_per_block == 1;
    const int first_tile = min(num_tiles, block * tiles_per_block);
    const int end_tile = min(num_tiles, first_tile + tiles_per_block);
    const Peers peers{peer_bases, rank};
    uint8_t* const local_base = peers.local();                // read once (the table is in global memory)
    uint32_t* ctrl = reinterpret_cast<uint32_t*>(local_base + kCtrlOffset);
    const ErrorSink sink{reinterpret_cast<int32_t*>(local_base + kErrorClaimOffset), error_record};

    int32_t* warp_counts = smem;                              // [kNotifyWarps][num_keys]
    // Exclusive scan over the block's warps of every key (expert keys hold lane masks, rank keys counts); block totals
    // to scratch, then the bases from earlier blocks (and the totals over all blocks, used by block 0) into smem after
    // the warp bases. A single block (decode sizes) skips the round trip through scratch and the grid barrier. Each
    // key has one owner thread in every scan (the same stride loop): its block base and total need no barrier.
    int32_t* block_base = smem + kNotifyWarps * num_keys;     // [num_keys]
    int32_t* totals = block_base + num_keys;                  // [num_keys] (block 0 only; the block's own before)
    // `placing`: the warp bases start at (and advance) the key's base in block_base (the placing pass of several
    // tiles); else they start at 0 and the tile's counts add to the block's in totals.
    auto scan_warps = [&](bool placing) {
        for (int key = threadIdx.x; key < num_keys; key += blockDim.x) {
            // Every warp's value loaded before any is overwritten: one shared-memory round trip, not one per warp.
            int v[kNotifyWarps];
            #pragma unroll
            for (int w = 0; w < kNotifyWarps; ++w)
                v[w] = warp_counts[w * num_keys + key];
            int running = placing ? block_base[key] : 0;
            #pragma unroll
            for (int w = 0; w < kNotifyWarps; ++w) {
                const int c = key < num_experts ? __popc(static_cast<uint32_t>(v[w])) : v[w];
                warp_counts[w * num_keys + key] = running;
                running += c;
            }
            if (placing)
                block_base[key] = running;
            else
                totals[key] += running;
        }
    };
    const bool one_block = num_blocks == 1;
    for (int key = threadIdx.x; key < num_keys; key += blockDim.x)
        totals[key] = 0;
    // The block's totals (in totals) to scratch, the grid barrier, then this block's bases and the totals over every
    // block (one block: bases 0, its totals are those).
    auto exchange_bases = [&]() -> bool {
        for (int key = threadIdx.x; key < num_keys; key += blockDim.x) {
            if (one_block)
                block_base[key] = 0;
            else
                scratch[static_cast<int64_t>(block) * num_keys + key] = totals[key];
        }
        if (!one_block) {
            if (!grid_sync(ctrl, num_blocks, timeout_ns, sink, kPhaseNotify, rank))
                return false;
            // Independent loads, 8 in flight per thread (a dependent chain of L2 round trips costs ~2 us at 16
            // blocks).
            for (int key = threadIdx.x; key < num_keys; key += blockDim.x) {
                int running = 0, base = 0;
                #pragma unroll 8
                for (int b = 0; b < num_blocks; ++b) {
                    const int v = __ldcg(scratch + static_cast<int64_t>(b) * num_keys + key);
                    running += v;
                    base += b < block ? v : 0;
                }
                block_base[key] = base;
                totals[key] = running;
            }
        }
        __syncthreads();
        return true;
    };
    // The outputs of this thread's token: its slots at every destination, its expert positions and, for the thread of
    // each V1 channel's last token, the count of tokens up to it per destination (empty channels are block 0's,
    // below; block 0 sends them on after one more grid barrier). Position of key `key` = its base for this warp (plus
    // the block's base where `with_block_base`: one tile) + the position inside the warp.
    const bool with_channels = num_channels > 0 && channel_prefix_matrix != nullptr;
    const int tokens_per_channel = with_channels ? (num_tokens + num_channels - 1) / num_channels : 0;
    NotifyToken<kNumRanks, kMaxTopk> tok;
    auto place = [&](bool with_block_base) {
        auto base_of = [&](int key) {
            return (with_block_base ? block_base[key] : 0) + warp_counts[warp * num_keys + key];
        };
        if (!tok.valid)
            return;
        #pragma unroll
        for (int d = 0; d < kNumRanks; ++d) {
            const int pos = ((tok.dst_mask >> d) & 1u) ? base_of(num_experts + d) + tok.dst_pos[d] : -1;
            send_pos[static_cast<int64_t>(tok.t) * kNumRanks + d] = pos;
            if (pos >= 0)
                token_of_slot[static_cast<int64_t>(d) * num_tokens + pos] = tok.t;
        }
        #pragma unroll
        for (int k = 0; k < kMaxTopk; ++k) {
            const int e = tok.expert[k];
            if (k < num_topk)
                send_expert_pos[static_cast<int64_t>(tok.t) * num_topk + k] =
                    e >= 0 ? base_of(e) + tok.expert_pos[k] : -1;
        }
        if (with_channels) {
            const int c = tok.t / tokens_per_channel;
            if (tok.t == min(num_tokens, (c + 1) * tokens_per_channel) - 1) {
                #pragma unroll
                for (int d = 0; d < kNumRanks; ++d)
                    channel_prefix_matrix[d * num_channels + c] =
                        base_of(num_experts + d) + tok.dst_pos[d] + ((tok.dst_mask >> d) & 1u);
            }
        }
    };
    if (!kTiled || one_tile) {
        // The token's state and its warp bases stay (registers, shared memory) across the barrier; the ids are copied
        // while counting.
        notify_tile<kNumRanks, kMaxTopk, kThreads>(tok, block, topk_idx, num_tokens, num_topk, num_experts,
                                                   topk_copy, warp_counts);
        scan_warps(false);
        if (!exchange_bases())
            return false;
        place(true);
    } else if constexpr (kTiled) {
        // Counting the block's tiles, then placing them (each read again; the ids are copied then). Separate from the
        // branch above so that neither keeps the other's values live across the barrier.
        #pragma unroll 1
        for (int tile = first_tile; tile < end_tile; ++tile) {
            notify_tile<kNumRanks, kMaxTopk, kThreads>(tok, tile, topk_idx, num_tokens, num_topk, num_experts,
                                                       nullptr, warp_counts);
            scan_warps(false);
            __syncthreads();      // (the next tile zeroes warp_counts)
        }
        if (!exchange_bases())
            return false;
        #pragma unroll 1
        for (int tile = first_tile; tile < end_tile; ++tile) {
            notify_tile<kNumRanks, kMaxTopk, kThreads>(tok, tile, topk_idx, num_tokens, num_topk, num_experts,
                                                       topk_copy, warp_counts);
            scan_warps(true);
            __syncthreads();
            place(false);
            __syncthreads();      // (the next tile zeroes warp_counts)
        }
    }
    if (block == 0 && threadIdx.x < kNumRanks)
        send_count[threadIdx.x] = totals[num_experts + threadIdx.x];
    if (with_channels) {
        if (num_blocks > 1) {
            if (!grid_sync(ctrl, num_blocks, timeout_ns, sink, kPhaseNotify, rank))
                return false;
        } else {
            __syncthreads();
        }
    }
    on_positions();
    if (block != 0)
        return true;

    // ---- block 0: exchange counts with the peers --------------------------------------------------------------
    // The received counts land in shared memory (the block's per-warp count area is free again): [kNumRanks][row].
    const int row_words = 1 + num_local_experts;
    // Before writing into peer d's notify area (counts and rows), d must be done reading what we wrote there for its
    // previous notify: wait for data_consumed[d] (written by d, in our control area) to reach the data epoch of our
    // last dispatch. d publishes it at the end of that dispatch's receive, which its stream runs after its notify.
    // The dispatch receivers (ep_dispatch.cu, ep_fused.cu) wait only for the chunks they receive, so a rank that
    // exchanges no tokens with d could otherwise overwrite d's area while d still reads it. Normally already true:
    // the next dispatch's senders wait for the same signal, and d's own notify signal (waited for below) comes after
    // it.
    if (kNumRanks > 1 &&
        !wait_all_peers(peers, kSigDataConsumed, kNumRanks, read_local(ctrl + kCtrlDataEpoch), timeout_ns, sink,
                        kPhaseNotify))
        return false;
    // The notify rows (common/ep.cuh), at every rank d (at one rank: our own workspace only, read back below): our
    // row of the count matrix, our token count, and per destination our channel prefixes.
    const int row_len = kNotifyRowChannels + (with_channels ? num_channels : 0);
    for (int i = threadIdx.x; i < kNumRanks * row_len; i += blockDim.x) {
        const int d = i / row_len, w = i % row_len;
        int value;
        if (w < kNumRanks) {
            value = totals[num_experts + w];
        } else if (w == kNotifyRowTokens) {
            value = reported_num_tokens;
        } else if (w >= kNotifyRowChannels) {
            const int c = w - kNotifyRowChannels;
            const bool empty = c * tokens_per_channel >= num_tokens;
            value = empty ? totals[num_experts + d] : __ldcg(channel_prefix_matrix + d * num_channels + c);
            if (empty && d == rank)   // once per (destination, empty channel): our own output
                for (int dd = 0; dd < kNumRanks; ++dd)
                    channel_prefix_matrix[dd * num_channels + c] = totals[num_experts + dd];
        } else {
            continue;
        }
        uint8_t* const dst = kNumRanks == 1 ? local_base : peers.base(d);
        reinterpret_cast<int32_t*>(dst + kNotifyRowsOffset)[rank * kNotifyRowWords + w] = value;
    }
    // Per-expert counts as published: expert_counts (V1 without top-k) replaces those of the top-k ids.
    auto published = [&](int d, int j) {
        return j == 0 ? totals[num_experts + d]
                      : (expert_counts != nullptr ? expert_counts[d * num_local_experts + j - 1]
                                                  : totals[d * num_local_experts + j - 1]);
    };
    int32_t* s_area = smem;
    if (kNumRanks == 1) {
        // One rank receives what it sends: no exchange (and no system-scope fence) needed. The barrier: every thread
        // is done reading its warp bases above before the area is overwritten, and the notify rows written above are
        // visible to the block (they are read back below).
        __syncthreads();
        for (int i = threadIdx.x; i < row_words; i += blockDim.x)
            s_area[i] = published(0, i);
    } else {
        __shared__ uint32_t s_epoch;
        if (threadIdx.x == 0) {
            s_epoch = read_local(ctrl + kCtrlNotifyEpoch) + 1;
            ctrl[kCtrlNotifyEpoch] = s_epoch;
        }
        __syncthreads();
        const uint32_t epoch = s_epoch;
        for (int i = threadIdx.x; i < kNumRanks * row_words; i += blockDim.x) {
            const int d = i / row_words, j = i % row_words;
            auto* area = reinterpret_cast<int32_t*>(peers.base(d) + kNotifyOffset);
            area[rank * row_words + j] = published(d, j);
        }
        // Counts and rows of every thread are written: release them to every peer with the notify signal.
        __syncthreads();
        if (threadIdx.x < kNumRanks) {
            fence_acq_rel_sys();
            st_release_sys(peers.remote_signal(threadIdx.x, kSigNotify), epoch);
        }
        if (!wait_all_peers(peers, kSigNotify, kNumRanks, epoch, timeout_ns, sink, kPhaseNotify))
            return false;
        const auto* area = reinterpret_cast<const volatile int32_t*>(local_base + kNotifyOffset);
        for (int i = threadIdx.x; i < kNumRanks * row_words; i += blockDim.x)
            s_area[i] = area[i];
    }
    __syncthreads();
    RecvLayout layout{recv_layout, kNumRanks, num_local_experts};
    // What the notify rows give: V1's matrices and the largest token count of any rank.
    const auto* rows = reinterpret_cast<const volatile int32_t*>(local_base + kNotifyRowsOffset);
    if (rank_prefix_matrix != nullptr && threadIdx.x < kNumRanks) {
        int running = 0;
        for (int i = 0; i < kNumRanks; ++i) {
            running += rows[i * kNotifyRowWords + threadIdx.x];
            rank_prefix_matrix[i * kNumRanks + threadIdx.x] = running;
        }
    }
    if (with_channels && recv_channel_prefix_matrix != nullptr) {
        for (int i = threadIdx.x; i < kNumRanks * num_channels; i += blockDim.x) {
            const int s = i / num_channels, c = i % num_channels;
            recv_channel_prefix_matrix[i] = c == 0 ? 0 : rows[s * kNotifyRowWords + kNotifyRowChannels + c - 1];
        }
    }
    if (threadIdx.x == 0 && host_counts != nullptr) {
        int most = 0;
        for (int s = 0; s < kNumRanks; ++s)
            most = max(most, static_cast<int>(rows[s * kNotifyRowWords + kNotifyRowTokens]));
        reinterpret_cast<volatile int32_t*>(host_counts)[kHostMaxTokensWord] = most;
    }
    if (threadIdx.x == 0) {
        int running = 0;
        #pragma unroll
        for (int s = 0; s < kNumRanks; ++s) {
            running += s_area[s * row_words];
            layout.psum_src()[s] = running;
        }
        layout.totals()[0] = running;
        if (host_counts != nullptr)
            reinterpret_cast<volatile int32_t*>(host_counts)[1] = running;
    }
    // Experts in chunks of blockDim.x: counts, per-source bases, aligned starts (block scan with a carry).
    int carry = 0;
    for (int j0 = 0; j0 < num_local_experts; j0 += blockDim.x) {
        const int j = j0 + threadIdx.x;
        int count = 0;
        if (j < num_local_experts) {
            #pragma unroll
            for (int s = 0; s < kNumRanks; ++s) {
                layout.src_base()[s * num_local_experts + j] = count;
                count += s_area[s * row_words + 1 + j];
            }
        }
        const int aligned = (count + expert_alignment - 1) / expert_alignment * expert_alignment;
        int chunk_total;
        const int start = carry + block_exclusive_scan(j < num_local_experts ? aligned : 0, chunk_total);
        if (j < num_local_experts) {
            layout.count()[j] = count;
            layout.start()[j] = start;
            if (psum_recv_per_expert != nullptr)
                psum_recv_per_expert[j] = do_expand ? start + count : start + aligned;
            if (cumulative_stats != nullptr)
                cumulative_stats[j] += count;
            if (host_counts != nullptr)
                reinterpret_cast<volatile int32_t*>(host_counts)[3 + j] = aligned;
        }
        carry += chunk_total;
    }
    if (threadIdx.x == 0) {
        layout.totals()[1] = carry;
        if (host_counts != nullptr) {
            volatile int32_t* host = host_counts;
            host[2] = carry;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && host_counts != nullptr) {
        __threadfence_system();
        reinterpret_cast<volatile int32_t*>(host_counts)[0] = host_seq;
        __threadfence_system();
    }
    return true;
}

// At least 3 blocks per SM (2 from top-k 16: 128 registers), without spills at sm_90: the co-resident blocks the grid
// is capped at (features/ep/bound.py) hold at least the tokens one pass of the uncapped kernel's grid held.
template <int kNumRanks, int kMaxTopk>
__global__ void __launch_bounds__(kNotifyThreads, kMaxTopk >= 16 ? 2 : 3)
notify_dispatch(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_max_tokens_per_rank,
                int expert_alignment, const uint64_t* peer_bases, int rank, int32_t* error_record, uint64_t timeout_ns,
                int32_t* scratch, int32_t* send_pos, int32_t* send_expert_pos, int32_t* recv_layout,
                int32_t* psum_recv_per_expert, int do_expand, int32_t* cumulative_stats, int32_t* host_counts,
                int host_seq, int64_t* topk_copy, int reported_num_tokens, const int32_t* expert_counts,
                int num_channels, int32_t* channel_prefix_matrix, int32_t* recv_channel_prefix_matrix,
                int32_t* rank_prefix_matrix, int32_t* token_of_slot, int32_t* send_count) {
    extern __shared__ int32_t smem[];
    notify_body<kNumRanks, kMaxTopk, kNotifyThreads, NoNotifyHook, true>(
        topk_idx, num_tokens, num_topk, num_experts, num_max_tokens_per_rank, expert_alignment, peer_bases, rank,
        error_record, timeout_ns, scratch, send_pos, send_expert_pos, recv_layout, psum_recv_per_expert, do_expand,
        cumulative_stats, host_counts, host_seq, topk_copy, reported_num_tokens, expert_counts, num_channels,
        channel_prefix_matrix, recv_channel_prefix_matrix, rank_prefix_matrix, token_of_slot, send_count, blockIdx.x,
        gridDim.x, smem, NoNotifyHook{});
}

}  // namespace deepep
