// Engram: a table of rows (bfloat16 or float8) split over the ranks of one scale-up (NVLink) domain; any rank fetches
// any rows by global index g (row g % num_entries of rank g / num_entries), reading the owners' memory directly.
//
// Layout (data region of the symmetric buffer; offsets identical on every rank):
//   [out_offset, table_offset)   fetch output of this rank: rows land here in index order ([T, n * hidden])
//   [table_offset, + num_entries * row_bytes)   this rank's table (written by engram_write_kernel, read by peers)
// Scale factors of FP8 tables are replicated on every rank by the caller and gathered locally (no traffic).
//
// Control words: the workspace region kWsEngramOffset of every rank's symmetric buffer (kEngramCtrlOffset; the
// workspace map is common/workspace.cuh). uint32 words, epochs that only grow, nothing is ever cleared:
//   [0]            epoch: table writes this rank completed; written only by the last block of engram_write_kernel
//   [1]            ticket of last_block_done (local; reset by the last block)
//   ready[src]     at byte +128: the last write epoch rank `src` reached; everything src ran before on its stream is
//                  complete, in particular its fetches that read this rank's table. Written only by rank src.
//   done[src]      at byte +256: the last write epoch in which rank `src` finished writing its own table.
//                  Written only by rank src, by the last block of its write kernel (release after last_block_done).
// Write protocol (epoch e = epoch + 1): every block stores ready[me] = e at every peer (idempotent) and waits until
// ready[p] >= e for every peer p: nobody still reads the old table. Blocks copy the caller's rows into the local
// table. The last block sets epoch = e, stores done[me] = e at every peer and waits for done[p] >= e from every peer,
// so the kernel ends once every table of the domain is complete; fetches are stream-ordered after it and need no
// signal (tables do not change between writes). A rank runs at most one write epoch ahead of any peer, so "reached"
// (wrap-safe >=) is exact.
#include "common/ep.cuh"
#include "common/value_range.cuh"

namespace deepep {

constexpr uint64_t kEngramCtrlOffset = kWsEngramOffset;     // common/workspace.cuh
constexpr uint64_t kEngramCtrlBytes = kWsEngramBytes;
constexpr int kEngramEpoch = 0, kEngramTicket = 1;
constexpr int kEngramReadyOffset = 128, kEngramDoneOffset = 256;
constexpr int kEngramThreads = 512;
constexpr int kEngramUnroll = 8;          // 16-byte vectors in flight per thread

__device__ __forceinline__ uint32_t* engram_ctrl(const uint64_t* peer_bases, int peer) {
    return reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(peer_bases[peer]) + kEngramCtrlOffset);
}

// Copy the caller's rows (`num_bytes`, a multiple of 16) into this rank's table, between the two signal exchanges.
template <int kNumRanks>
__global__ void __launch_bounds__(kEngramThreads, 1)
engram_write_kernel(const uint8_t* storage, int64_t num_bytes, uint64_t table_offset, const uint64_t* peer_bases,
                    int rank, int32_t* error_record, uint64_t timeout_ns) {
    static_assert(kNumRanks >= 1 && kNumRanks <= 32, "engram supports up to 32 ranks per domain");
    static_assert(kEngramDoneOffset + 4 * kNumRanks <= kEngramCtrlBytes, "control words overflow their region");
    __shared__ int s_ok;
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    uint32_t* ctrl = engram_ctrl(peer_bases, rank);
    const uint32_t epoch = read_local(ctrl + kEngramEpoch) + 1;
    const int peer = threadIdx.x;

    if (threadIdx.x == 0)
        s_ok = 1;
    __syncthreads();
    if (peer < kNumRanks && peer != rank) {
        if (!exchange_epoch(peer_bases, kEngramCtrlOffset + kEngramReadyOffset, rank, peer, epoch, timeout_ns, sink,
                            kPhaseEngram, 0))
            s_ok = 0;
    }
    __syncthreads();
    if (!s_ok)
        return;

    uint8_t* table = reinterpret_cast<uint8_t*>(peer_bases[rank]) + table_offset;
    grid_stride_copy<kEngramUnroll>(
        num_bytes / 16, static_cast<int64_t>(blockIdx.x) * kEngramThreads + threadIdx.x,
        static_cast<int64_t>(gridDim.x) * kEngramThreads, [&](int64_t i) { return ld_nc_v4(storage + i * 16); },
        [&](int64_t i, const Vec16& v) { st_na_v4(table + i * 16, v); });

    if (!last_block_done(ctrl + kEngramTicket))
        return;
    if (threadIdx.x == 0)
        ctrl[kEngramEpoch] = epoch;
    if (peer < kNumRanks && peer != rank)
        exchange_epoch(peer_bases, kEngramCtrlOffset + kEngramDoneOffset, rank, peer, epoch, timeout_ns, sink,
                       kPhaseEngram, 1);
}

// Gather rows: output row i (= token i / n, entry i % n) is row g % num_entries of rank g / num_entries's table, with
// g = indices[i]. The 16-byte vectors of all output rows form one index space walked with a grid stride, so a row's
// vectors are read by adjacent threads; kEngramUnroll loads in flight per thread. Indices outside
// [0, kNumRanks * num_entries) (only possible when the caller skipped the host range check) give zero rows.
// With `num_sf > 0`, also gathers 4-byte scale factors from the replicated local table `sf` [kNumRanks * num_entries,
// num_sf] into `sf_out` (token t, column j * num_sf + p at t * sf_stride_token + column * sf_stride_col, elements).
template <int kNumRanks>
__global__ void __launch_bounds__(kEngramThreads, 1)
engram_fetch_impl(const int32_t* indices, int num_rows, int num_entries_per_token, int row_bytes, int num_entries,
                    uint64_t table_offset, uint64_t out_offset, const uint32_t* sf, int num_sf, uint32_t* sf_out,
                    int64_t sf_stride_token, int64_t sf_stride_col, const uint64_t* peer_bases, int rank) {
    static_assert(kNumRanks >= 1 && kNumRanks <= 32, "engram supports up to 32 ranks per domain");
    __shared__ const uint8_t* s_table[kNumRanks];
    if (threadIdx.x < kNumRanks)
        s_table[threadIdx.x] = reinterpret_cast<const uint8_t*>(peer_bases[threadIdx.x]) + table_offset;
    __syncthreads();

    const int64_t num_global = static_cast<int64_t>(kNumRanks) * num_entries;
    const int vectors_per_row = row_bytes / 16;
    const int num_vectors = num_rows * vectors_per_row;      // < 2^31 (checked on the host)
    uint8_t* out = reinterpret_cast<uint8_t*>(peer_bases[rank]) + out_offset;
    const int num_threads = gridDim.x * kEngramThreads;
    for (int base = blockIdx.x * kEngramThreads + threadIdx.x; base < num_vectors;
         base += num_threads * kEngramUnroll) {
        Vec16 v[kEngramUnroll];
        #pragma unroll
        for (int u = 0; u < kEngramUnroll; ++u) {
            const int vec = base + u * num_threads;
            if (vec < num_vectors) {
                const int row = vec / vectors_per_row;
                const int col = vec - row * vectors_per_row;
                const int g = __ldg(indices + row);
                if (g >= 0 && g < num_global) {
                    const int owner = g / num_entries;
                    const int entry = g - owner * num_entries;
                    v[u] = ld_nc_v4(s_table[owner] + static_cast<int64_t>(entry) * row_bytes + col * 16);
                } else {
                    v[u] = {0, 0, 0, 0};
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < kEngramUnroll; ++u) {
            const int vec = base + u * num_threads;
            if (vec < num_vectors)
                st_na_v4(out + static_cast<int64_t>(vec) * 16, v[u]);
        }
    }

    if (num_sf > 0) {
        const int num_values = num_rows * num_sf;
        for (int k = blockIdx.x * kEngramThreads + threadIdx.x; k < num_values; k += num_threads) {
            const int row = k / num_sf;
            const int p = k - row * num_sf;
            const int g = __ldg(indices + row);
            const uint32_t value = g >= 0 && g < num_global ? __ldg(sf + static_cast<int64_t>(g) * num_sf + p) : 0u;
            const int token = row / num_entries_per_token;
            const int column = (row - token * num_entries_per_token) * num_sf + p;
            sf_out[token * sf_stride_token + column * sf_stride_col] = value;
        }
    }
}

}  // namespace deepep
