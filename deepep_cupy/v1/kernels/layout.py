"""DeepEP V1's `get_dispatch_layout` (kernels_cu/legacy_layout.cu): per-rank and per-expert token counts and
`is_token_in_rank` from `topk_idx`, on the GPU, with no host synchronisation (CUDA-graph capturable).

`plan_layout` checks the arguments (pure, no GPU); `DispatchLayout` allocates the outputs and launches: one memset of
the counts, then one kernel. The counts of both outputs share one allocation (`num_tokens_per_rank` first).
`DispatchLayout.run` checks and binds each call signature once (`LayoutCall`): a repeated signature costs the outputs'
allocations, the memset, four patched pointers, the launch and one call making the count views.

Several scale-up domains (`num_domains > 1`, V1's internode `num_tokens_per_rdma_rank`): the allocation holds a third
count, `[num_domains]` after the per-expert counts (cleared by the same memset), filled by a second kernel
(`get_dispatch_layout_domains`) from the `is_token_in_rank` the first wrote, on the same stream. With one domain
nothing of this runs: the launches and outputs are the single-domain ones.
"""

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ...jit.launch import PTR, KernelSpec, Param, load_kernels
from ...runtime import checks, interop
from ...runtime.event import as_event_handle
from ...runtime.interop import TensorInfo
from ...runtime.sizes import ceil_div

FAMILY = 'legacy_layout'
THREADS = 256                    # kLayoutThreads (one token per thread)
NUM_MAX_RANKS = 64               # kLayoutMaxRanks
NUM_MAX_SMEM_BYTES = 200 * 1024  # the per-block counters of every expert and rank sit in shared memory
NUM_MAX_DOMAINS = NUM_MAX_RANKS  # kLayoutMaxDomains
MAX_CALLS = 64                   # call signatures remembered (`DispatchLayout.run`); more are forgotten all at once

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


class LayoutCall:
    """One checked `get_dispatch_layout` signature (`DispatchLayout.run`): its launches bound (the pointers patched per
    call), the outputs' allocation functions, the count views' sizes."""

    __slots__ = ('kind', 'torch', 'local', 'alloc_on_comm', 'carver', 'alloc_counts', 'alloc_in_rank',
                 'counts_shape', 'in_rank_shape', 'count_bytes', 'expert_byte', 'domain_byte', 'split', 'launch',
                 'idx', 'domains', 'domains_idx')

    def __init__(self, layout: 'DispatchLayout', p: LayoutPlan, device: int, async_finish: bool,
                 allocate_on_comm_stream: bool):
        R, E = p.num_ranks, p.num_experts
        D = p.num_domains if p.num_domains > 1 else 0
        assert D == 0 or D == layout.num_domains, \
            f'a plan for {p.num_domains} domains, a launcher for {layout.num_domains}'
        self.kind, self.torch = p.kind, p.kind == 'torch'
        self.local = not (async_finish or allocate_on_comm_stream)
        self.alloc_on_comm = bool(allocate_on_comm_stream)
        self.carver = carver = interop.Carver(p.kind, device)
        self.counts_shape, self.in_rank_shape = (R + E + D,), (p.num_tokens, R)
        self.alloc_counts = self.alloc_in_rank = None        # (on the comm stream: `Carver.empty` per call)
        if not self.alloc_on_comm:
            self.alloc_counts = carver.allocator(self.counts_shape, 'int32')
            self.alloc_in_rank = carver.allocator(self.in_rank_shape, 'bool')
        self.count_bytes, self.expert_byte, self.domain_byte = 4 * (R + E + D), 4 * R, 4 * (R + E)
        # (the views' sizes in the allocation's order: per rank, per expert, per domain)
        self.split = (R, E, D) if D else (R, E)
        self.launch = b = layout.kernel.bind(
            p.grid, THREADS, shared_mem=p.smem_bytes, topk_idx=0, num_tokens=p.num_tokens, num_topk=p.num_topk,
            num_experts=E, num_ranks=R, num_tokens_per_rank=0, num_tokens_per_expert=0, is_token_in_rank=0)
        self.idx = tuple(b.index(n) for n in ('topk_idx', 'num_tokens_per_rank', 'num_tokens_per_expert',
                                              'is_token_in_rank'))
        self.domains = self.domains_idx = None
        if D:
            self.domains = d = layout.domains_kernel.bind(
                p.grid, THREADS, shared_mem=0, is_token_in_rank=0, num_tokens=p.num_tokens, num_ranks=R,
                num_domains=D, num_tokens_per_domain=0)
            self.domains_idx = (d.index('is_token_in_rank'), d.index('num_tokens_per_domain'))


class DispatchLayout:
    """The layout kernel on one device (loaded at construction: never compiled inside a call)."""

    def __init__(self, device: int, kernel=None, num_domains: int = 1, domains_kernel=None):
        self.kernel = kernel if kernel is not None else load_kernels([LAYOUT_SPEC], device=device)[LAYOUT_SPEC.name]
        self.num_domains = num_domains
        self.domains_kernel = domains_kernel
        if num_domains > 1 and domains_kernel is None:
            self.domains_kernel = load_kernels([DOMAINS_SPEC], device=device)[DOMAINS_SPEC.name]
        self._calls = {}        # call signature -> LayoutCall

    def run(self, order, topk_idx, num_experts, num_ranks: int, device: int, previous_event: Optional[Any],
            async_finish: bool, allocate_on_comm_stream: bool):
        """`Buffer.get_dispatch_layout` (its event rule checked by the caller) for `num_ranks` ranks on `device`,
        through the buffer's `StreamOrder` `order`: the first call of a signature (topk_idx's, num_experts and its
        type, the stream flags) is checked (`plan_layout`) and bound (`LayoutCall`); every call then allocates the
        outputs, clears the counts and launches on the stream `order.enter` gives.

        Returns:
            `(num_tokens_per_rank [R] int32, num_tokens_per_domain [D] int32 or None (one domain),
            num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool, event)`; the counts are views of one
            allocation (`[R + E (+ D)]`, the event keeps it alive).
        """
        if type(topk_idx) is interop.TORCH_TENSOR[0]:      # (`interop.meta` of a plain torch tensor, inline)
            sig, tp = (topk_idx.shape, topk_idx.stride(), topk_idx.dtype, topk_idx.get_device()), topk_idx.data_ptr()
        else:
            sig, tp = interop.meta(topk_idx)
        key = (sig, num_experts, num_experts.__class__, async_finish, allocate_on_comm_stream)
        try:
            c = self._calls.get(key)
        except TypeError:   # (an unhashable argument: checked below, not remembered)
            c = key = None
        if c is None:       # (the checks raise before anything is enqueued)
            c = LayoutCall(self, plan_layout(topk_idx, num_experts, num_ranks, device, self.num_domains), device,
                           async_finish, allocate_on_comm_stream)
            # (`interop.meta`'s signature of an array, not a fresh object: a later call can match it)
            if key is not None and type(sig) is not object:
                if len(self._calls) >= MAX_CALLS:
                    self._calls.clear()
                self._calls[key] = c
        current = interop.current_stream(topk_idx)
        comm = order.enter(current, None if previous_event is None else as_event_handle(previous_event), c.local)
        alloc = c.alloc_counts
        if alloc is not None:
            counts, in_rank = alloc(), c.alloc_in_rank()
        else:
            carver = c.carver
            counts = carver.empty(c.counts_shape, 'int32', comm)
            in_rank = carver.empty(c.in_rank_shape, 'bool', comm)
        if c.torch:
            cp, ip = counts.data_ptr(), in_rank.data_ptr()
        else:
            cp, ip = counts.data.ptr, in_rank.data.ptr
        _memset_async(cp, c.count_bytes, comm)
        b, i = c.launch, c.idx
        u = b.u64
        u[i[0]], u[i[1]], u[i[2]], u[i[3]] = tp, cp, cp + c.expert_byte, ip
        b(comm)
        d = c.domains
        if d is not None:       # (after the first kernel, on the same stream: it reads is_token_in_rank)
            u, j = d.u64, c.domains_idx
            u[j[0]], u[j[1]] = ip, cp + c.domain_byte
            d(comm)
        if c.torch:             # (one call makes every view)
            views = counts.split_with_sizes(c.split)
        else:
            R, E = c.split[0], c.split[1]
            views = (counts[:R], counts[R:R + E], counts[R + E:])
        event = order.leave(c.kind, current, comm, async_finish, (topk_idx, counts, in_rank) if async_finish else ())
        return views[0], views[2] if d is not None else None, views[1], in_rank, event


def _memset_async(ptr: int, num_bytes: int, stream) -> None:
    import cupy
    cupy.cuda.runtime.memsetAsync(ptr, 0, num_bytes, stream.ptr)
