"""DeepEP V1's `get_dispatch_layout` (kernels_cu/legacy_layout.cu): per-rank and per-expert token counts and
`is_token_in_rank` from `topk_idx`, on the GPU, with no host synchronisation (CUDA-graph capturable).

`plan_layout` checks the arguments (pure, no GPU); `DispatchLayout` allocates the outputs and launches: one memset of
the counts, then one kernel. The counts of both outputs share one allocation (`num_tokens_per_rank` first).

Several scale-up domains (`num_domains > 1`, V1's internode `num_tokens_per_rdma_rank`): the allocation holds a third
count, `[num_domains]` after the per-expert counts (cleared by the same memset), filled by a second kernel
(`get_dispatch_layout_domains`) from the `is_token_in_rank` the first wrote, on the same stream. With one domain
nothing of this runs: the launches and outputs are the single-domain ones.
"""

from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np

from ...jit.launch import PTR, KernelSpec, Param, load_kernels
from ...runtime import checks, interop
from ...runtime.interop import TensorInfo
from ...runtime.sizes import ceil_div

FAMILY = 'legacy_layout'
THREADS = 256                    # kLayoutThreads (one token per thread)
NUM_MAX_RANKS = 64               # kLayoutMaxRanks
NUM_MAX_SMEM_BYTES = 200 * 1024  # the per-block counters of every expert and rank sit in shared memory
NUM_MAX_DOMAINS = NUM_MAX_RANKS  # kLayoutMaxDomains

LAYOUT_SPEC = KernelSpec(FAMILY, 'deepep::get_dispatch_layout', (
    Param('topk_idx', PTR), Param('num_tokens', np.int32), Param('num_topk', np.int32), Param('num_experts', np.int32),
    Param('num_ranks', np.int32), Param('num_tokens_per_rank', PTR), Param('num_tokens_per_expert', PTR),
    Param('is_token_in_rank', PTR)))
DOMAINS_SPEC = KernelSpec(FAMILY, 'deepep::get_dispatch_layout_domains', (
    Param('is_token_in_rank', PTR), Param('num_tokens', np.int32), Param('num_ranks', np.int32),
    Param('num_domains', np.int32), Param('num_tokens_per_domain', PTR)))


def shipped_specs():
    """Family name → every specialisation (one kernel: the sizes are run-time arguments)."""
    return {FAMILY: [LAYOUT_SPEC, DOMAINS_SPEC]}


def smem_bytes(num_experts: int, num_ranks: int) -> int:
    return 4 * (num_experts + num_ranks)


@dataclass(slots=True)
class LayoutPlan:
    """A checked `get_dispatch_layout`."""
    kind: str
    topk_idx: TensorInfo
    num_tokens: int
    num_topk: int
    num_experts: int
    num_ranks: int
    grid: int
    smem_bytes: int
    num_domains: int = 1


def plan_layout(topk_idx: Any, num_experts: Any, num_ranks: int, device: int, num_domains: int = 1) -> LayoutPlan:
    """Check `get_dispatch_layout(topk_idx, num_experts)` for `num_ranks` ranks in `num_domains` scale-up domains of
    equal size; ValueError / TypeError naming the argument."""
    ti = checks.info(topk_idx, 'topk_idx', device)
    checks.check_dtype(ti, 'topk_idx', 'int64')
    if ti.ndim != 2:
        raise ValueError(f'topk_idx must be 2-D [num_tokens, num_topk], got shape {list(ti.shape)}')
    checks.check_contiguous(ti, 'topk_idx')
    num_experts = checks.check_int('num_experts', num_experts, 1)
    if not 1 <= num_ranks <= NUM_MAX_RANKS:
        raise ValueError(f'get_dispatch_layout supports 1 to {NUM_MAX_RANKS} ranks, got {num_ranks}')
    if num_experts % num_ranks != 0:
        raise ValueError(f'num_experts={num_experts} must be a multiple of the number of ranks ({num_ranks})')
    smem = smem_bytes(num_experts, num_ranks)
    if smem > NUM_MAX_SMEM_BYTES:
        raise ValueError(f'num_experts={num_experts} is too large for get_dispatch_layout (at most '
                         f'{NUM_MAX_SMEM_BYTES // 4 - num_ranks})')
    assert 1 <= num_domains <= NUM_MAX_DOMAINS and num_ranks % num_domains == 0, \
        f'{num_ranks} ranks cannot form {num_domains} scale-up domains of equal size'
    num_tokens, num_topk = ti.shape
    return LayoutPlan(ti.kind, ti, num_tokens, num_topk, num_experts, num_ranks,
                      max(1, ceil_div(num_tokens, THREADS)), smem, num_domains)


class DispatchLayout:
    """The layout kernel on one device (loaded at construction: never compiled inside a call)."""

    def __init__(self, device: int, kernel=None, num_domains: int = 1, domains_kernel=None):
        self.kernel = kernel if kernel is not None else load_kernels([LAYOUT_SPEC], device=device)[LAYOUT_SPEC.name]
        self.num_domains = num_domains
        self.domains_kernel = domains_kernel
        if num_domains > 1 and domains_kernel is None:
            self.domains_kernel = load_kernels([DOMAINS_SPEC], device=device)[DOMAINS_SPEC.name]

    def __call__(self, p: LayoutPlan, stream, alloc_stream=None) -> Tuple[Any, Any, Any, Any]:
        """Launch on `stream` (a CuPy stream), outputs allocated on `alloc_stream` (None: the current stream).

        Returns:
            `(num_tokens_per_rank [R] int32, num_tokens_per_domain [D] int32 or None (one domain),
            num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool, counts)`, `counts` the allocation the
            count tensors view (keep it with the event).
        """
        R, E = p.num_ranks, p.num_experts
        D = p.num_domains if p.num_domains > 1 else 0
        assert D == 0 or D == self.num_domains, f'a plan for {p.num_domains} domains, a launcher for {self.num_domains}'
        alloc = interop.Allocator(p.kind)
        counts = alloc.empty((R + E + D,), 'int32', alloc_stream)
        is_token_in_rank = alloc.empty((p.num_tokens, R), 'bool', alloc_stream)
        counts_ptr = counts.data_ptr() if p.kind == 'torch' else counts.data.ptr
        _memset_async(counts_ptr, 4 * (R + E + D), stream)
        self.kernel.launch(p.grid, THREADS, stream=stream, shared_mem=p.smem_bytes, topk_idx=p.topk_idx.ptr,
                           num_tokens=p.num_tokens, num_topk=p.num_topk, num_experts=E, num_ranks=R,
                           num_tokens_per_rank=counts_ptr, num_tokens_per_expert=counts_ptr + 4 * R,
                           is_token_in_rank=is_token_in_rank)
        if not D:
            return counts[:R], None, counts[R:], is_token_in_rank, counts
        self.domains_kernel.launch(p.grid, THREADS, stream=stream, shared_mem=0, is_token_in_rank=is_token_in_rank,
                                   num_tokens=p.num_tokens, num_ranks=R, num_domains=D,
                                   num_tokens_per_domain=counts_ptr + 4 * (R + E))
        return counts[:R], counts[R + E:], counts[R:R + E], is_token_in_rank, counts


def _memset_async(ptr: int, num_bytes: int, stream) -> None:
    import cupy
    cupy.cuda.runtime.memsetAsync(ptr, 0, num_bytes, stream.ptr)
