// The fused kernel's receivers at one rank without expansion (kernels_cu/ep_fused.cu, "self-counting receivers" and
// "speculation" at its top): SelfCountingReceiver and the copies and waits it uses. Included by ep_fused.cu after
// ep_dispatch.cu (kDispatchThreads, write_row_fields, warp_copy), inside nothing: it opens namespace deepep itself.
#pragma once

namespace deepep {

// The prefetch ends before the positions are ready, so it takes nothing from the copy and saves its first rows an HBM
// read. Notify blocks of 512 tokens (one per thread) rather than
// 256: smaller ones would leave half of each block idle in notify_body (its loops and barriers span the block) and
// double the blocks of each cross-block prefix; what they would save, half the warps of each per-key block scan, is
// off the critical path at one rank (the receivers count for themselves) and is spent again on the prefix elsewhere.
constexpr int64_t kFusedPrefetchBytes = 8 << 20;

// Into L2: the 128-byte lines start, start + stride, ... below num_lines of x's rows from first_row on (a row's
// hidden bytes are lines_per_row lines; rows x_row_bytes apart).
__device__ __forceinline__ void prefetch_rows_l2(const uint8_t* x, int64_t x_row_bytes, int64_t lines_per_row,
                                                 int64_t first_row, int64_t num_lines, int64_t start, int64_t stride) {
    for (int64_t i = start; i < num_lines; i += stride)
        asm volatile("prefetch.global.L2 [%0];" :: "l"(x + (first_row + i / lines_per_row) * x_row_bytes +
                                                         (i % lines_per_row) * 128));
}

// Rounds of received tokens without a gap copied as one range (SelfCountingReceiver::receive).
constexpr bool kFusedFlatRounds = true;

// Copy threads [0, num_threads) of the grid copy `num_bytes` (a multiple of 16, both pointers 16-byte aligned) as a
// plain copy does: copy thread i the 16-byte chunks i, i + num_threads, ..., kCopyUnroll loads in flight per thread
// before the stores.
__device__ __forceinline__ void grid_copy(uint8_t* dst, const uint8_t* src, int64_t num_bytes, int64_t thread,
                                          int64_t num_threads) {
    const int64_t num_chunks = num_bytes / 16;
    for (int64_t base = thread; base < num_chunks; base += num_threads * kCopyUnroll) {
        Vec16 v[kCopyUnroll];
        #pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
            if (base + u * num_threads < num_chunks)
                v[u] = ld_v4(src + (base + u * num_threads) * 16);
        #pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u)
            if (base + u * num_threads < num_chunks)
                st_na_v4(dst + (base + u * num_threads) * 16, v[u]);
    }
}

// The block copies `num_bytes` as grid_copy's threads, its own threads only.
__device__ __forceinline__ void block_copy(uint8_t* dst, const uint8_t* src, int64_t num_bytes) {
    grid_copy(dst, src, num_bytes, threadIdx.x, kDispatchThreads);
}

// A block's data epoch for this launch, read by one thread: ctrl[kCtrlDataEpoch] + 1. It is read by every block
// before any block can store it: with several ranks the last block stores it, after every block passed its waits; at
// one rank (`count_started`) block 0 stores it once every block counted itself in kCtrlFusedStarted, released after
// the read, so the read cannot see the store.
__device__ __forceinline__ uint32_t fused_read_epoch(uint32_t* ctrl, bool count_started) {
    const uint32_t epoch = read_local(ctrl + kCtrlDataEpoch) + 1;
    if (count_started)
        red_add_release_gpu(ctrl + kCtrlFusedStarted, 1u);
    return epoch;
}

// Count words of the self-counting receivers (kCtrlFusedCounts): epoch << 32 | kFusedSpecDone? | count.
constexpr uint64_t kFusedSpecDone = 1ull << 31;         // the block's speculative copy is done (a miss only)
constexpr uint64_t kFusedCountMask = kFusedSpecDone - 1;

// One thread waits for a self-counting receiver's count word to carry `epoch` and every bit of `need`
// (kFusedSpecDone or 0), bounded at twice a peer's timeout (as wait_fused_flag), from `start`; `word` gets the last
// value read. False after a timeout (reported as kAuxFusedCounts) or once another wait reported one.
__device__ __forceinline__ bool wait_count_word(const uint64_t* src, uint32_t epoch, uint64_t need, uint64_t start,
                                                uint64_t timeout_ns, const ErrorSink& sink, uint64_t& word) {
    const uint64_t longer = timeout_ns > (~0ull >> 2) ? timeout_ns : 2 * timeout_ns;
    word = ld_acquire_gpu(src);
    for (uint32_t iter = 0; static_cast<uint32_t>(word >> 32) != epoch || (word & need) != need; ++iter) {
        if ((iter & 255) == 255) {
            if (global_timer_ns() - start > longer) {
                report_timeout(sink, kPhaseDispatch, 0, 0, epoch, static_cast<uint32_t>(word >> 32), kAuxFusedCounts);
                return false;
            }
            if (timeout_reported(sink))
                return false;
        }
        word = ld_acquire_gpu(src);
    }
    return true;
}

// A self-counting receiver's inputs and outputs (the kernel's arguments of the same names).
struct RecvArgs {
    const uint8_t* x;
    int64_t x_row_bytes;
    int hidden_bytes;
    const uint8_t* sf;
    int64_t sf_stride_token, sf_stride_col;
    int num_sf;
    const float* topk_weights;
    int num_meta_rows;
    uint8_t* recv_x;
    uint8_t* recv_sf;
    int64_t recv_sf_stride_row, recv_sf_stride_col;
    int64_t* recv_topk_idx;
    float* recv_topk_weights;
    int32_t* recv_src_metadata;
    int32_t* recv_src_idx;
};

// A self-counting receiver (see the top): receiving block `block` of `num_blocks` (at most kFusedMaxCountBlocks =
// kDispatchThreads) takes the tokens [block * T / n, (block + 1) * T / n) and writes their rows exactly as
// dispatch_recv_blocks writes them from the notify's slots (non-expanded, own tokens: rank 0, no readiness guard),
// then its share of the marks of the rows past the receive count. Three steps, every thread of the block in each:
//   first_ids()  before anything else the block does (the kernel calls it before it reads the data epoch, so that
//                the top-k loads overlap that read): whether one rank receives each of its first kDispatchThreads
//                tokens;
//   publish()    once the epoch is known (and, for a notify block that also receives, before its notify work, so
//                that no receiver waits for that): the rows of those tokens among them (shared memory), the count
//                of the whole share, published as counts[block] = epoch << 32 | count (`counts`: kCtrlFusedCounts);
//   receive()    every block's count (thread j reads block j's: no chain of blocks), hence the first row of ours and
//                the receive count; then the rows, kDispatchThreads tokens at a time. False after a timeout.
template <int kMaxTopk>
struct SelfCountingReceiver {
    struct Shared {
        int token[kDispatchThreads];    // the received tokens of the current round of the share, in token order
        int num_first;                  // how many of them in the first round
        int first_row;                  // the row of the share's first received token
    };
    const int64_t* topk_idx;
    int num_tokens, num_topk, num_experts;
    int block, num_blocks, begin, end;
    Shared& s;

    __device__ __forceinline__ SelfCountingReceiver(const int64_t* topk_idx, int num_tokens, int num_topk,
                                                    int num_experts, int block, int num_blocks, Shared& s)
        : topk_idx(topk_idx), num_tokens(num_tokens), num_topk(num_topk), num_experts(num_experts), block(block),
          num_blocks(num_blocks),
          begin(static_cast<int>(static_cast<int64_t>(num_tokens) * block / num_blocks)),
          end(static_cast<int>(static_cast<int64_t>(num_tokens) * (block + 1) / num_blocks)), s(s) {}

    // Whether one rank receives token t: one of its top-k ids is an expert (notify_body's destination mask at one
    // rank). Tokens past the share: no.
    __device__ __forceinline__ bool received(int t) const {
        bool any = false;
        if (t < end) {
            #pragma unroll
            for (int k = 0; k < kMaxTopk; ++k) {
                if (k < num_topk) {
                    const int64_t e = topk_idx[static_cast<int64_t>(t) * num_topk + k];
                    any |= e >= 0 && e < num_experts;
                }
            }
        }
        return any;
    }

    // The received tokens of the round starting at token t0 into s.token (in token order); returns how many.
    __device__ __forceinline__ int gather(int t0, bool here) const {
        int n;
        const int pos = block_exclusive_scan(here ? 1 : 0, n);
        if (here)
            s.token[pos] = t0 + static_cast<int>(threadIdx.x);
        return n;
    }

    __device__ __forceinline__ bool first_ids() const { return received(begin + static_cast<int>(threadIdx.x)); }

    __device__ __forceinline__ void publish(bool here, uint64_t* counts, uint32_t epoch) const {
        const int n = gather(begin, here);
        int count = 0;          // the share's received tokens past the first round (none in a share of one round)
        if (end - begin > kDispatchThreads) {       // (uniform over the block: its barriers are safe)
            int rest = 0;
            for (int t = begin + kDispatchThreads + static_cast<int>(threadIdx.x); t < end; t += kDispatchThreads)
                rest += received(t) ? 1 : 0;
            block_exclusive_scan(rest, count);
        }
        if (threadIdx.x == 0) {
            s.num_first = n;
            st_release_gpu(counts + block, (static_cast<uint64_t>(epoch) << 32) | static_cast<uint32_t>(n + count));
        }
    }

    // Lane l of one warp waits for the count words of the blocks l, l + 32, ... to carry `epoch`, bounded as
    // wait_fused_flag; sums their counts over every block (`total`) and over the blocks before ours (`first`).
    // Uniform over the warp.
    __device__ __forceinline__ bool warp_counts(const uint64_t* counts, uint32_t epoch, uint64_t timeout_ns,
                                                const ErrorSink& sink, int& first, int& total) const {
        const int lane = threadIdx.x % 32;
        bool ok = true;
        int mine = 0, all = 0;
        const uint64_t start = global_timer_ns();
        for (int j = lane; j < num_blocks && ok; j += 32) {
            uint64_t word;
            ok = wait_count_word(counts + j, epoch, 0, start, timeout_ns, sink, word);
            const int count = static_cast<int>(word & kFusedCountMask);
            all += count;
            mine += j < block ? count : 0;
        }
        first = __reduce_add_sync(0xffffffffu, mine);
        total = __reduce_add_sync(0xffffffffu, all);
        return __all_sync(0xffffffffu, ok);
    }

    // Row i's fields but its hidden bytes, for token tok, by one warp, as dispatch_recv_blocks writes an own token's
    // at rank 0 (the local expert of a global id e is e itself; an id past the experts is no expert here).
    __device__ __forceinline__ void row_fields(const RecvArgs& a, int i, int tok, int lane) const {
        int e = -1;
        float w = 0.f;
        if (lane < num_topk) {
            e = static_cast<int32_t>(topk_idx[static_cast<int64_t>(tok) * num_topk + lane]);
            w = a.topk_weights != nullptr ? a.topk_weights[static_cast<int64_t>(tok) * num_topk + lane] : 0.f;
        }
        write_row_fields<kMaxTopk>(i, e, w, lane, 0, tok, true, true, 0, num_experts, num_topk, 0,
                                   reinterpret_cast<const uint32_t*>(a.sf) + tok * a.sf_stride_token, a.sf_stride_col,
                                   a.num_sf, a.recv_sf, a.recv_sf_stride_row, a.recv_sf_stride_col, a.recv_topk_idx,
                                   a.recv_topk_weights, a.recv_src_metadata, a.recv_src_idx);
    }

    // Worst-case outputs (no CPU sync): our share of the marks of the token rows past the receive count.
    __device__ __forceinline__ void marks(const RecvArgs& a, int num_recv) const {
        const int meta_cols = num_topk + 2;
        const int64_t tid = static_cast<int64_t>(block) * blockDim.x + threadIdx.x;
        const int64_t num_threads = static_cast<int64_t>(num_blocks) * blockDim.x;
        for (int64_t idx = tid; idx < static_cast<int64_t>(a.num_meta_rows - num_recv) * num_topk; idx += num_threads)
            a.recv_topk_idx[static_cast<int64_t>(num_recv) * num_topk + idx] = -1;
        for (int64_t idx = tid; idx < static_cast<int64_t>(a.num_meta_rows - num_recv) * meta_cols; idx += num_threads)
            a.recv_src_metadata[static_cast<int64_t>(num_recv) * meta_cols + idx] = -1;
    }

    // `first_gathered`: publish() left the first round's tokens in s (else the first round is gathered here);
    // `done`: wait for every block's kFusedSpecDone (after a speculation that missed).
    __device__ __forceinline__ bool receive(const RecvArgs& a, const uint64_t* counts, uint32_t epoch,
                                            uint64_t timeout_ns, const ErrorSink& sink, bool first_gathered,
                                            bool done) const {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int num_warps = kDispatchThreads / 32;
        // Our rows into L2 while the other blocks publish (at most our share of kFusedPrefetchBytes).
        const int64_t lines_per_row = (a.hidden_bytes + 127) / 128;
        prefetch_rows_l2(a.x, a.x_row_bytes, lines_per_row, begin,
                         min(static_cast<int64_t>(end - begin) * lines_per_row, kFusedPrefetchBytes / 128 / num_blocks),
                         threadIdx.x, kDispatchThreads);

        // Every block's count: thread j waits for block j's (bounded: twice a peer's timeout, as wait_fused_flag).
        uint64_t word = 0;
        bool ok = true;
        if (static_cast<int>(threadIdx.x) < num_blocks)
            ok = wait_count_word(counts + threadIdx.x, epoch, done ? kFusedSpecDone : 0, global_timer_ns(), timeout_ns,
                                 sink, word);
        if (__syncthreads_or(!ok))
            return false;
        int total;
        const int before = block_exclusive_scan(
            static_cast<int>(threadIdx.x) < num_blocks ? static_cast<int>(word & kFusedCountMask) : 0, total);
        if (static_cast<int>(threadIdx.x) == block)
            s.first_row = before;
        __syncthreads();
        const int num_recv = min(total, a.num_meta_rows);       // rows past num_meta_rows are not written
        const int num_chunks = a.hidden_bytes / 16;

        // Our rows, round by round (the first round's tokens are in s.token already where `first_gathered`). A round
        // whose tokens are all received (none masked: the usual case) and whose rows of x are dense is one contiguous
        // range of bytes in x and in recv_x: the whole block copies it at once, walking memory as a plain copy does
        // (and as no warp per row does: its loads spread over the block's rows); the warps then write the rows'
        // other outputs.
        int row0 = s.first_row;
        for (int t0 = begin; t0 < end; t0 += kDispatchThreads) {
            const int n = (t0 == begin && first_gathered) ? s.num_first
                                                          : gather(t0, received(t0 + static_cast<int>(threadIdx.x)));
            const int rows = max(0, min(n, num_recv - row0));
            const bool flat = kFusedFlatRounds && n == min(kDispatchThreads, end - t0) &&
                              a.x_row_bytes == a.hidden_bytes;
            if (flat)
                block_copy(a.recv_x + static_cast<int64_t>(row0) * a.hidden_bytes,
                           a.x + static_cast<int64_t>(t0) * a.x_row_bytes,
                           static_cast<int64_t>(rows) * a.hidden_bytes);
            const RowSegments segs(flat ? 0 : rows, num_chunks, num_warps);
            for (int item = warp; item < rows * segs.num; item += num_warps) {
                const int j = item / segs.num, seg = item - j * segs.num;
                const int i = row0 + j, tok = s.token[j];
                if (seg == 0)
                    row_fields(a, i, tok, lane);
                if (!flat) {
                    const int c_begin = segs.begin(seg), c_bytes = (segs.end(seg, num_chunks) - c_begin) * 16;
                    warp_copy(a.recv_x + static_cast<int64_t>(i) * a.hidden_bytes + c_begin * 16,
                              a.x + tok * a.x_row_bytes + c_begin * 16, c_bytes, lane);
                }
            }
            row0 += n;
            __syncthreads();                                  // s.token is rewritten by the next round
        }
        marks(a, num_recv);
        return true;
    }

    // The speculative receive (see the top), every thread of the block, at the start of the kernel: the last warp
    // reads the data epoch (into `epoch`; it also counts the block in kCtrlFusedStarted), counts the share, publishes
    // the count and reads every block's, while the other warps copy their part of x's first num_tokens rows into
    // recv_x's (copy thread c of the grid: the 16-byte chunks c, c + copy threads, ...). Every token received (the
    // receive count is num_tokens): token t's row is t and the copy is the rows' hidden bytes; the block writes its
    // share's other fields. Else (a token received by nobody: its top-k ids all masked) every block, once its copy is
    // done, republishes its count with kFusedSpecDone, and receives as receive() does once every block's copy is
    // done (no speculative write can then land on a row written right). False after a timeout.
    __device__ __forceinline__ bool speculate(const RecvArgs& a, uint32_t* ctrl, uint64_t* counts, uint32_t& epoch,
                                              uint64_t timeout_ns, const ErrorSink& sink) const {
        __shared__ uint32_t s_epoch;
        __shared__ int s_ok, s_count, s_total;
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        constexpr int kCopyWarps = kDispatchThreads / 32 - 1;
        if (warp == kCopyWarps) {
            uint32_t e = 0;
            if (lane == 0)
                e = fused_read_epoch(ctrl, true);
            e = __shfl_sync(0xffffffffu, e, 0);
            int mine = 0;
            for (int t = begin + lane; t < end; t += 32)
                mine += received(t) ? 1 : 0;
            const int count = __reduce_add_sync(0xffffffffu, mine);
            if (lane == 0)
                st_release_gpu(counts + block, (static_cast<uint64_t>(e) << 32) | static_cast<uint32_t>(count));
            int first, total;
            const bool ok = warp_counts(counts, e, timeout_ns, sink, first, total);
            if (lane == 0) {
                s_epoch = e;
                s_ok = ok;
                s_count = count;
                s_total = total;
            }
        } else {
            grid_copy(a.recv_x, a.x, static_cast<int64_t>(num_tokens) * a.hidden_bytes,
                      static_cast<int64_t>(block) * kCopyWarps * 32 + threadIdx.x,
                      static_cast<int64_t>(num_blocks) * kCopyWarps * 32);
        }
        __syncthreads();
        epoch = s_epoch;
        if (!s_ok)
            return false;
        if (s_total == num_tokens) {
            for (int t = begin + warp; t < end; t += kDispatchThreads / 32)
                row_fields(a, t, t, lane);
            marks(a, num_tokens);
            return true;
        }
        if (threadIdx.x == 0) {
            __threadfence();
            st_release_gpu(counts + block, (static_cast<uint64_t>(epoch) << 32) | kFusedSpecDone |
                                               static_cast<uint32_t>(s_count));
        }
        return receive(a, counts, epoch, timeout_ns, sink, false, true);
    }
};

}  // namespace deepep
