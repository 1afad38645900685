// Load balancing of redundant experts inside one scale-up (NVLink) domain: weight prefetch (owners push an expert's
// weights into the borrowers' redundant slots) and gradient reduction (owners pull the borrowers' redundant
// gradients and add them into their own expert gradients).
//
// Redundancy mapping: int32 [kNumRanks, num_redundant], identical on every rank (checked on the host):
// entry [r][c] = domain-local expert id (owner * L + local_idx) whose copy lives in slot c of rank r, or -1.
// No rank hosts its own experts (checked on the host). The redundant pool of a pair is [num_redundant, bytes] at the
// same symmetric offset on every rank (inside the load-balancing region of the data region).
//
// Control words: the workspace region kWsLBOffset of every rank's symmetric buffer (kLBCtrlOffset; the workspace map
// is common/workspace.cuh). uint32 words, epochs that only grow, nothing is ever cleared:
//   [0]            epoch: load-balancing operations this rank completed; written only by the last block of the
//                  launch that ends an operation (stream-ordered, read by the next operation's launches)
//   [1]            ticket of last_block_done (local; reset by the last block)
//   ready[src]     at byte +128: the last operation epoch for which rank `src` reached the operation: everything it
//                  did before on its stream is complete (its redundant gradients are final; it no longer reads its
//                  redundant weights, so they may be overwritten). Written only by rank src (system-scope release).
//   done[src]      at byte +256: the last operation epoch in which rank `src` finished its part: prefetch - all its
//                  pushes into this rank's pool are written; reduce - it finished reading this rank's pool.
//                  Written only by rank src, by the last block of its final launch (release after last_block_done).
// Protocol of one operation with epoch e = epoch + 1 (both kinds; prefetch of several tensor pairs is one launch per
// pair, the first with `signal_ready`, the last with `signal_done`, all with the same e):
//   1. every block of the first launch stores ready[me] = e at every peer (idempotent: same value) and waits until
//      its own ready[p] >= e for every peer p, so no block touches a peer's pool before that peer is ready;
//   2. warps copy (prefetch: local weights -> peer's slot) or reduce (expert_grads[e] += peer slots, ascending
//      (rank, slot), FP32, one pass per chunk: deterministic);
//   3. the last block of the last launch (every block's writes published by last_block_done) sets epoch = e, stores
//      done[me] = e at every peer and waits until done[p] >= e for every peer p. The operation therefore ends when
//      every peer pushed into us (prefetch) or stopped reading our pool (reduce).
// A rank cannot finish epoch e before every peer stored done = e, so it runs at most one epoch ahead of any peer and
// "reached" (wrap-safe >=) is exact. The host checks that every rank called the same operation with the same
// mapping and sizes before any launch, so epochs of different operations never mix.
#include "common/ep.cuh"

namespace deepep {

constexpr uint64_t kLBCtrlOffset = kWsLBOffset;     // common/workspace.cuh
constexpr uint64_t kLBCtrlBytes = kWsLBBytes;
constexpr int kLBEpoch = 0, kLBTicket = 1;
constexpr int kLBReadyOffset = 128, kLBDoneOffset = 256;
constexpr int kLBThreads = 512;
constexpr int kLBUnroll = 8;                         // 16-byte vectors in flight per lane and source
constexpr int kLBChunkVectors = 32 * kLBUnroll;      // vectors a warp handles per work item (4 KiB)

__device__ __forceinline__ uint32_t* lb_ctrl(const uint64_t* peer_bases, int peer) {
    return reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(peer_bases[peer]) + kLBCtrlOffset);
}

// Step 1 of the protocol (every block). Returns false in every thread of the block if a wait timed out.
template <int kNumRanks>
__device__ __forceinline__ bool lb_ready(const uint64_t* peer_bases, int rank, uint32_t epoch, uint64_t timeout_ns,
                                         const ErrorSink& sink) {
    __shared__ int s_ok;
    if (threadIdx.x == 0)
        s_ok = 1;
    __syncthreads();
    const int peer = threadIdx.x;
    if (peer < kNumRanks && peer != rank) {
        if (!exchange_epoch(peer_bases, kLBCtrlOffset + kLBReadyOffset, rank, peer, epoch, timeout_ns, sink, kPhaseLB,
                            0))
            s_ok = 0;
    }
    __syncthreads();
    return s_ok != 0;
}

// Step 3 of the protocol (every block calls it; the last block to finish does the work).
template <int kNumRanks>
__device__ __forceinline__ void lb_done(const uint64_t* peer_bases, int rank, uint32_t epoch, uint64_t timeout_ns,
                                        const ErrorSink& sink) {
    uint32_t* ctrl = lb_ctrl(peer_bases, rank);
    if (!last_block_done(ctrl + kLBTicket))
        return;
    if (threadIdx.x == 0)
        ctrl[kLBEpoch] = epoch;
    const int peer = threadIdx.x;
    if (peer < kNumRanks && peer != rank)
        exchange_epoch(peer_bases, kLBCtrlOffset + kLBDoneOffset, rank, peer, epoch, timeout_ns, sink, kPhaseLB, 1);
}

__device__ __forceinline__ uint32_t lanemask_lt() {
    uint32_t mask;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
    return mask;
}

// Asynchronous 16-byte copies global -> shared (cp.async, L2 only): the data in flight waits in shared memory instead
// of registers, so a block can keep several times more NVLink reads outstanding than its register file would hold.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most `pending` (0..3) of this thread's most recent commit groups are still in flight.
__device__ __forceinline__ void cp_async_wait(int pending) {
    switch (pending) {
        case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    }
}

__device__ __forceinline__ Vec16 ld_shared_v4(const void* p) {
    Vec16 v;
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

__device__ __forceinline__ void add_f32x4(Vec16& acc, const Vec16& v) {
    acc.x = __float_as_uint(__uint_as_float(acc.x) + __uint_as_float(v.x));
    acc.y = __float_as_uint(__uint_as_float(acc.y) + __uint_as_float(v.y));
    acc.z = __float_as_uint(__uint_as_float(acc.z) + __uint_as_float(v.z));
    acc.w = __float_as_uint(__uint_as_float(acc.w) + __uint_as_float(v.w));
}

// ---- prefetch -------------------------------------------------------------------------------------------------
// Push this rank's experts into the slots that host them. Work items: (entry this rank owns, 4 KiB chunk), entries in
// ascending (rank, slot) order; a warp per item. Dynamic shared memory: int32 [kNumRanks * num_redundant].
template <int kNumRanks>
__global__ void __launch_bounds__(kLBThreads, 1)
lb_prefetch_kernel(const int32_t* mapping, int num_redundant, int num_local_experts, const uint8_t* expert_weights,
                   int64_t num_bytes_per_expert, uint64_t pool_offset, int signal_ready, int signal_done,
                   const uint64_t* peer_bases, int rank, int32_t* error_record, uint64_t timeout_ns) {
    static_assert(kNumRanks >= 1 && kNumRanks <= 32, "load balancing supports up to 32 ranks per domain");
    static_assert(kLBDoneOffset + 4 * kNumRanks <= kLBCtrlBytes, "control words overflow their region");
    extern __shared__ int32_t s_owned[];             // flat mapping index r * num_redundant + c
    __shared__ int s_num_owned;
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    const uint32_t epoch = read_local(lb_ctrl(peer_bases, rank) + kLBEpoch) + 1;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    // Entries this rank owns, in ascending flat order (warp 0, one ballot per 32 entries).
    const int num_entries = kNumRanks * num_redundant;
    if (warp == 0) {
        int count = 0;
        for (int base = 0; base < num_entries; base += 32) {
            const int i = base + lane;
            const int v = i < num_entries ? __ldg(mapping + i) : -1;
            const bool owned = v >= 0 && v / num_local_experts == rank;
            const uint32_t ballot = __ballot_sync(0xffffffffu, owned);
            if (owned)
                s_owned[count + __popc(ballot & lanemask_lt())] = i;
            count += __popc(ballot);
        }
        if (lane == 0)
            s_num_owned = count;
    }
    if (signal_ready) {
        if (!lb_ready<kNumRanks>(peer_bases, rank, epoch, timeout_ns, sink))
            return;
    } else {
        __syncthreads();
    }

    const int64_t num_vectors = num_bytes_per_expert / 16;
    const int64_t num_chunks = (num_vectors + kLBChunkVectors - 1) / kLBChunkVectors;
    const int64_t num_items = static_cast<int64_t>(s_num_owned) * num_chunks;
    const int num_warps = kLBThreads / 32;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * num_warps + warp; item < num_items;
         item += static_cast<int64_t>(gridDim.x) * num_warps) {
        const int i = s_owned[item / num_chunks];
        const int64_t chunk = item % num_chunks;
        const int dst_rank = i / num_redundant, slot = i % num_redundant;
        const int local_idx = __ldg(mapping + i) % num_local_experts;
        const uint8_t* src = expert_weights + local_idx * num_bytes_per_expert;
        uint8_t* dst = reinterpret_cast<uint8_t*>(peer_bases[dst_rank]) + pool_offset + slot * num_bytes_per_expert;
        const int64_t first = chunk * kLBChunkVectors + lane;
        Vec16 v[kLBUnroll];
        #pragma unroll
        for (int u = 0; u < kLBUnroll; ++u)
            if (first + u * 32 < num_vectors)
                v[u] = ld_nc_v4(src + (first + u * 32) * 16);
        #pragma unroll
        for (int u = 0; u < kLBUnroll; ++u)
            if (first + u * 32 < num_vectors)
                st_na_v4(dst + (first + u * 32) * 16, v[u]);
    }

    if (signal_done)
        lb_done<kNumRanks>(peer_bases, rank, epoch, timeout_ns, sink);
}

// ---- gradient reduction ---------------------------------------------------------------------------------------
// expert_grads[j] += pool_r[c] for every (r, c) with mapping[r][c] == rank * L + j, in ascending (r, c) order.
// Work items: (local expert with at least one copy, 4 KiB chunk); a warp per item loads the expert's chunk into
// registers, adds every copy's chunk in ascending order and stores the sum once.
// The copies' chunks are read over NVLink, where a read takes microseconds: each warp streams them through
// `num_stages` (1..3) 4 KiB stages of shared memory with cp.async, issuing the read of the copy num_stages - 1 ahead
// of the one it adds (across work items), so about num_stages * 64 KiB per block are in flight. Every lane copies and
// reads only its own 16-byte vectors of a stage, so a lane's own cp.async.wait_group is the only synchronisation.
// Dynamic shared memory: int32 [4 * L + kNumRanks * num_redundant]: per local expert the number of copies, the first
// copy's position in the copy list, a fill cursor, the list of experts with copies, then the copy list (flat mapping
// indices grouped by expert, ascending inside each group); then, at `stage_offset` bytes (a multiple of 128),
// [kLBThreads / 32 warps][num_stages][4 KiB] stages.
template <int kNumRanks>
__global__ void __launch_bounds__(kLBThreads, 1)
lb_reduce_grads_kernel(const int32_t* mapping, int num_redundant, int num_local_experts, float* expert_grads,
                       int64_t num_bytes_per_expert, uint64_t pool_offset, int num_stages, int stage_offset,
                       const uint64_t* peer_bases, int rank, int32_t* error_record, uint64_t timeout_ns) {
    static_assert(kNumRanks >= 1 && kNumRanks <= 32, "load balancing supports up to 32 ranks per domain");
    static_assert(kLBDoneOffset + 4 * kNumRanks <= kLBCtrlBytes, "control words overflow their region");
    extern __shared__ __align__(128) int32_t s_shared[];
    const int L = num_local_experts;
    int32_t* s_count = s_shared;
    int32_t* s_start = s_shared + L;
    int32_t* s_fill = s_shared + 2 * L;
    int32_t* s_active = s_shared + 3 * L;
    int32_t* s_copies = s_shared + 4 * L;
    __shared__ int s_num_active;
    const ErrorSink sink = make_error_sink(peer_bases, rank, error_record);
    const uint32_t epoch = read_local(lb_ctrl(peer_bases, rank) + kLBEpoch) + 1;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int num_entries = kNumRanks * num_redundant;

    // Count copies per local expert.
    for (int j = threadIdx.x; j < L; j += kLBThreads)
        s_count[j] = s_fill[j] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < num_entries; i += kLBThreads) {
        const int v = __ldg(mapping + i);
        if (v >= 0 && v / L == rank)
            atomicAdd(s_count + v % L, 1);
    }
    __syncthreads();
    // Exclusive prefix sums: copy-list starts, and positions of the experts that have copies.
    int carry_start = 0, carry_active = 0;
    for (int base = 0; base < L; base += kLBThreads) {
        const int j = base + threadIdx.x;
        const int count = j < L ? s_count[j] : 0;
        int total_start, total_active;
        const int start = block_exclusive_scan(count, total_start);
        const int active = block_exclusive_scan(count > 0 ? 1 : 0, total_active);
        if (j < L) {
            s_start[j] = carry_start + start;
            if (count > 0)
                s_active[carry_active + active] = j;
        }
        carry_start += total_start;
        carry_active += total_active;
    }
    if (threadIdx.x == 0)
        s_num_active = carry_active;
    __syncthreads();
    // Copy list in ascending flat order (warp 0): lanes holding the same expert are ranked by lane.
    if (warp == 0) {
        for (int base = 0; base < num_entries; base += 32) {
            const int i = base + lane;
            const int v = i < num_entries ? __ldg(mapping + i) : -1;
            const bool owned = v >= 0 && v / L == rank;
            const int key = owned ? v % L : -1 - lane;      // unowned lanes match nobody
            const uint32_t same = __match_any_sync(0xffffffffu, key);
            int pos = 0;
            if (owned)
                pos = s_fill[key] + __popc(same & lanemask_lt());
            __syncwarp();
            if (owned) {
                s_copies[s_start[key] + pos] = i;
                if ((same & lanemask_lt()) == 0)               // the group's lowest lane advances the cursor
                    s_fill[key] += __popc(same);
            }
            __syncwarp();
        }
    }
    if (!lb_ready<kNumRanks>(peer_bases, rank, epoch, timeout_ns, sink))
        return;

    const int64_t num_vectors = num_bytes_per_expert / 16;
    const int64_t num_chunks = (num_vectors + kLBChunkVectors - 1) / kLBChunkVectors;
    const int64_t num_items = static_cast<int64_t>(s_num_active) * num_chunks;
    const int num_warps = kLBThreads / 32;
    const int64_t first_item = static_cast<int64_t>(blockIdx.x) * num_warps + warp;
    const int64_t item_stride = static_cast<int64_t>(gridDim.x) * num_warps;
    // This lane's 16-byte vector u of stage s: stages + s * 4096 + (u * 32 + lane) * 16.
    uint8_t* stages = reinterpret_cast<uint8_t*>(s_shared) + stage_offset +
                      static_cast<int64_t>(warp) * num_stages * (kLBChunkVectors * 16) + lane * 16;

    // Producer cursor: the next (work item, copy) whose chunk this warp reads; every call commits one group (empty
    // past the end), so "group n complete" always means "stage n % num_stages of the n-th copy is filled".
    int64_t load_item = first_item;
    int load_copy = 0;
    auto issue = [&](int stage) {
        if (load_item < num_items) {
            const int j = s_active[load_item / num_chunks];
            const int64_t chunk = load_item % num_chunks;
            const int i = s_copies[s_start[j] + load_copy];
            // cp.async.cg reads through L2, never a stale L1 line: the peer may have written its pool while this
            // kernel waited in lb_ready.
            const uint8_t* src = reinterpret_cast<const uint8_t*>(peer_bases[i / num_redundant]) + pool_offset +
                                 (i % num_redundant) * num_bytes_per_expert;
            const int64_t first = chunk * kLBChunkVectors + lane;
            uint8_t* dst = stages + stage * (kLBChunkVectors * 16);
            #pragma unroll
            for (int u = 0; u < kLBUnroll; ++u)
                if (first + u * 32 < num_vectors)
                    cp_async_16(dst + u * 32 * 16, src + (first + u * 32) * 16);
            if (++load_copy == s_count[j]) {
                load_copy = 0;
                load_item += item_stride;
            }
        }
        cp_async_commit();
    };
    for (int s = 0; s + 1 < num_stages; ++s)
        issue(s);

    int stage = 0;
    for (int64_t item = first_item; item < num_items; item += item_stride) {
        const int j = s_active[item / num_chunks];
        const int64_t chunk = item % num_chunks;
        uint8_t* grad = reinterpret_cast<uint8_t*>(expert_grads) + j * num_bytes_per_expert;
        const int64_t first = chunk * kLBChunkVectors + lane;
        Vec16 acc[kLBUnroll];
        #pragma unroll
        for (int u = 0; u < kLBUnroll; ++u)
            if (first + u * 32 < num_vectors)
                acc[u] = ld_v4(grad + (first + u * 32) * 16);
        for (int k = 0; k < s_count[j]; ++k) {
            issue(stage == 0 ? num_stages - 1 : stage - 1);   // the stage added last time round
            cp_async_wait(num_stages - 1);
            const uint8_t* src = stages + stage * (kLBChunkVectors * 16);
            #pragma unroll
            for (int u = 0; u < kLBUnroll; ++u)
                if (first + u * 32 < num_vectors)
                    add_f32x4(acc[u], ld_shared_v4(src + u * 32 * 16));
            stage = stage + 1 == num_stages ? 0 : stage + 1;
        }
        #pragma unroll
        for (int u = 0; u < kLBUnroll; ++u)
            if (first + u * 32 < num_vectors)
                st_v4(grad + (first + u * 32) * 16, acc[u]);
    }
    cp_async_wait(0);

    lb_done<kNumRanks>(peer_bases, rank, epoch, timeout_ns, sink);
}

}  // namespace deepep
