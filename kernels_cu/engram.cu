// Engram: tables of rows (bfloat16 or float8), one per layer, split over the ranks of one scale-up (NVLink) domain; any
// rank fetches any rows by global index g (row g % E of rank g / E, E = the layer's entries per rank), reading the
// owners' storage directly.
//
// Storage: every rank's tables sit in its storage, GPU memory (the symmetric buffer, read by peers over NVLink) or
// pinned host memory that every rank of the domain has mapped (runtime/host_storage.py, read over PCIe / C2C).
// `table_bases[r]` is the device address of rank r's storage; layer l's table starts `layers[l].table_offset` bytes
// into it (identical on every rank). The kernels never care which memory it is.
// Fetch output: this rank's buffer at `out`, rows in index order ([layers, T, n * hidden]).
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
// Write protocol (epoch e = epoch + 1; one launch per layer): every block stores ready[me] = e at every peer
// (idempotent) and waits until ready[p] >= e for every peer p: nobody still reads the old table. Blocks copy the
// caller's rows into the local table (`table`, GPU or host memory). The last block sets epoch = e, stores done[me] = e
// at every peer (a system-scope release: host memory included) and waits for done[p] >= e from every peer, so the
// kernel ends once every table of the domain is complete; fetches are stream-ordered after it and need no signal
// (tables do not change between writes). A rank runs at most one write epoch ahead of any peer, so "reached"
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

// Copy the caller's rows (`num_bytes`, a multiple of 16) into this rank's table at `table` (its storage, GPU or host
// memory), between the two signal exchanges.
template <int kNumRanks>
__global__ void __launch_bounds__(kEngramThreads, 1)
engram_write_kernel(const uint8_t* storage, int64_t num_bytes, uint8_t* table, const uint64_t* peer_bases, int rank,
                    int32_t* error_record, uint64_t timeout_ns) {
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

// Per layer of a fetch (int64 words): the layer's entries per rank, its table's byte offset in every rank's storage,
// and the row of its first entry in the replicated scale-factor table.
constexpr int kEngramLayerWords = 3;

// Gather rows: output row i (layer i / rows_per_layer; token, entry of that layer's [T, n] indices) is row g % E of
// rank g / E's table of the layer, g = indices[i] (indices are [layers, T, n], contiguous). The 16-byte vectors of all
// output rows form one index space walked with a grid stride, so a row's vectors are read by adjacent threads;
// kEngramUnroll loads in flight per thread. Indices outside [0, kNumRanks * E) (only possible when the caller skipped
// the host range check) give zero rows.
// With `num_sf > 0`, also gathers 4-byte scale factors from the replicated local table `sf` (rows
// [sf_row_offset + g] of [sum over layers of kNumRanks * E, num_sf]) into `sf_out`: layer l, token t, column
// j * num_sf + p at l * sf_layer_stride + t * sf_stride_token + column * sf_stride_col (elements).
template <int kNumRanks>
__global__ void __launch_bounds__(kEngramThreads, 1)
engram_fetch_impl(const int32_t* indices, int num_rows, int rows_per_layer, int num_entries_per_token, int row_bytes,
                  const int64_t* layers, const uint64_t* table_bases, uint8_t* out, const uint32_t* sf, int num_sf,
                  uint32_t* sf_out, int64_t sf_layer_stride, int64_t sf_stride_token, int64_t sf_stride_col) {
    static_assert(kNumRanks >= 1 && kNumRanks <= 32, "engram supports up to 32 ranks per domain");
    __shared__ const uint8_t* s_table[kNumRanks];
    if (threadIdx.x < kNumRanks)
        s_table[threadIdx.x] = reinterpret_cast<const uint8_t*>(table_bases[threadIdx.x]);
    __syncthreads();

    const int vectors_per_row = row_bytes / 16;
    const int num_vectors = num_rows * vectors_per_row;      // < 2^31 (checked on the host)
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
                const int64_t* layer = layers + static_cast<int64_t>(row / rows_per_layer) * kEngramLayerWords;
                const int num_entries = static_cast<int>(__ldg(layer));
                const int g = __ldg(indices + row);
                if (g >= 0 && g < kNumRanks * num_entries) {
                    const int owner = g / num_entries;
                    const int entry = g - owner * num_entries;
                    v[u] = ld_nc_v4(s_table[owner] + __ldg(layer + 1) + static_cast<int64_t>(entry) * row_bytes +
                                    col * 16);
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
            const int layer_idx = row / rows_per_layer;
            const int64_t* layer = layers + static_cast<int64_t>(layer_idx) * kEngramLayerWords;
            const int num_entries = static_cast<int>(__ldg(layer));
            const int g = __ldg(indices + row);
            const uint32_t value = g >= 0 && g < kNumRanks * num_entries
                                   ? __ldg(sf + (__ldg(layer + 2) + g) * num_sf + p) : 0u;
            const int layer_row = row - layer_idx * rows_per_layer;
            const int token = layer_row / num_entries_per_token;
            const int column = (layer_row - token * num_entries_per_token) * num_sf + p;
            sf_out[layer_idx * sf_layer_stride + token * sf_stride_token + column * sf_stride_col] = value;
        }
    }
}

}  // namespace deepep
