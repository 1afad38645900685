// DeepEP V1's get_dispatch_layout: from topk_idx [num_tokens][num_topk] (int64, -1 = no expert), per rank the tokens
// sent there (a token counts once per rank owning >= 1 of its experts), per expert the (token, slot) pairs choosing
// it, and is_token_in_rank [num_tokens][num_ranks] (bool). Expert e belongs to rank e / (num_experts / num_ranks).
// Ids outside [0, num_experts) choose nothing.
//
// One thread per token, kLayoutThreads tokens per block. Each block counts into shared memory, then adds its non-zero
// counts to the outputs with global atomics: the count outputs must be zero before the launch (the caller clears
// them with one memset on the same stream). Integer counts: the result does not depend on the order of the atomics.
// Needs no symmetric memory and no host synchronisation (CUDA-graph capturable).
#include "common/types.cuh"

namespace deepep {

constexpr int kLayoutThreads = 256;
constexpr int kLayoutMaxRanks = 64;     // the rank mask of a token is one uint64

__global__ void __launch_bounds__(kLayoutThreads)
get_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                    int32_t* num_tokens_per_rank,     // [num_ranks], zero on entry
                    int32_t* num_tokens_per_expert,   // [num_experts], zero on entry
                    bool* is_token_in_rank) {         // [num_tokens][num_ranks] out
    extern __shared__ int32_t s_counts[];           // [num_experts] per expert, then [num_ranks] per rank
    int32_t* s_rank = s_counts + num_experts;
    for (int i = threadIdx.x; i < num_experts + num_ranks; i += blockDim.x)
        s_counts[i] = 0;
    __syncthreads();

    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int experts_per_rank = num_experts / num_ranks;
    if (t < num_tokens) {
        uint64_t mask = 0;
        for (int k = 0; k < num_topk; ++k) {
            const int64_t e = topk_idx[static_cast<int64_t>(t) * num_topk + k];
            if (e >= 0 && e < num_experts) {
                atomicAdd(s_counts + e, 1);
                mask |= 1ull << (static_cast<int>(e) / experts_per_rank);
            }
        }
        bool* row = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
        for (int r = 0; r < num_ranks; ++r) {
            const bool in = (mask >> r) & 1ull;
            row[r] = in;
            if (in)
                atomicAdd(s_rank + r, 1);
        }
    }
    __syncthreads();

    for (int i = threadIdx.x; i < num_experts + num_ranks; i += blockDim.x) {
        const int32_t v = s_counts[i];
        if (v != 0)
            atomicAdd(i < num_experts ? num_tokens_per_expert + i : num_tokens_per_rank + (i - num_experts), v);
    }
}

}  // namespace deepep

namespace deepep {

// DeepEP V1's num_tokens_per_rdma_rank (several scale-up domains): per domain d, the tokens with >= 1 expert on a rank
// of d (ranks [d * ranks_per_domain, (d + 1) * ranks_per_domain)), read from the is_token_in_rank that
// get_dispatch_layout wrote before it on the same stream. Launched only with several domains (one domain: V1 returns
// None and nothing launches). The output must be zero on entry (cleared by the same memset as the other counts).
constexpr int kLayoutMaxDomains = kLayoutMaxRanks;

__global__ void __launch_bounds__(kLayoutThreads)
get_dispatch_layout_domains(const bool* is_token_in_rank, int num_tokens, int num_ranks, int num_domains,
                            int32_t* num_tokens_per_domain) {   // [num_domains], zero on entry
    __shared__ int32_t s_domain[kLayoutMaxDomains];
    for (int i = threadIdx.x; i < num_domains; i += blockDim.x)
        s_domain[i] = 0;
    __syncthreads();

    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int ranks_per_domain = num_ranks / num_domains;
    if (t < num_tokens) {
        const bool* row = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
        for (int d = 0; d < num_domains; ++d) {
            bool in = false;
            for (int r = d * ranks_per_domain; r < (d + 1) * ranks_per_domain; ++r)
                in |= row[r];
            if (in)
                atomicAdd(s_domain + d, 1);
        }
    }
    __syncthreads();

    for (int i = threadIdx.x; i < num_domains; i += blockDim.x) {
        const int32_t v = s_domain[i];
        if (v != 0)
            atomicAdd(num_tokens_per_domain + i, v);
    }
}

}  // namespace deepep
