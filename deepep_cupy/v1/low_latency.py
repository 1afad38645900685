"""Low-latency mode of DeepEP V1's `Buffer`: the methods (a mixin of `Buffer`, with DeepEP's exact signatures) and
the holder of the `LowLatencyEngine` (`features/ll`). Across scale-up domains the methods forward to the
`InternodeLLMode` (v1/internode_ll.py; the design: v1/kernels/internode_ll.py), with the same
signatures, outputs and numerics.

The engine's memory (`num_rdma_bytes`, rounded up to 2 MiB) is allocated with the Buffer; the engine is laid out at
the first low-latency call (or `clean_low_latency_buffer`) with that call's `(num_max_dispatch_tokens_per_rank,
hidden, num_experts)` as maxima. A call beyond them lays the engine out again with the larger maxima, on the same
memory (then cleaned: a collective barrier) when it fits, else on a larger one: DeepEP requires every rank to pass
the same values, so every rank decides alike. Handles of the previous layout cannot be combined afterwards.
"""

from typing import Callable, Optional

from ..buffers.base import BUFFER_ALIGNMENT, BufferBase
from ..features.ll import NUM_MAX_RANKS, LowLatencyEngine, check_dims, get_rdma_size_hint
from ..runtime import interop
from ..runtime.sizes import align
from .internode_ll import rdma_size_hint as internode_rdma_size_hint


class LowLatencyMode:
    """The low-latency engine of one V1 `Buffer`.

    Args:
        num_ranks: the group's size.
        num_rdma_bytes: V1's low-latency buffer size (0: allocated at the first low-latency call).
        enable_shrink: DeepEP's shrink mode (masks).
        make_base: `make_base(num_bytes)` builds the `BufferBase` (collective).
    """

    def __init__(self, num_ranks: int, num_rdma_bytes: int, enable_shrink: bool,
                 make_base: Callable[[int], BufferBase]):
        self.num_ranks = num_ranks
        self.enable_shrink = bool(enable_shrink)
        self._make = make_base
        self.base: Optional[BufferBase] = make_base(align(num_rdma_bytes, BUFFER_ALIGNMENT)) if num_rdma_bytes else None
        self.engine: Optional[LowLatencyEngine] = None
        self._placeholder = False       # the engine only holds masks (set before any low-latency call)
        self.ready: Optional[LowLatencyEngine] = None      # the engine once laid out by a call (not a placeholder)

    def engine_for(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> LowLatencyEngine:
        """The engine with room for these maxima (laid out, or again with larger maxima; collective then)."""
        eng = self.engine
        if eng is not None and not self._placeholder:
            lay = eng.layout
            if (num_max_dispatch_tokens_per_rank <= lay.num_max_tokens and hidden <= lay.hidden and
                    num_experts <= lay.num_experts):
                return eng
            num_max_dispatch_tokens_per_rank = max(num_max_dispatch_tokens_per_rank, lay.num_max_tokens)
            hidden, num_experts = max(hidden, lay.hidden), max(num_experts, lay.num_experts)
        need = get_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, self.num_ranks, num_experts)
        reused = self.base is not None and self.base.num_bytes >= need
        if not reused:
            if self.base is not None:
                self.base.destroy()
            self.base = self._make(need)
        self.engine = LowLatencyEngine(self.base, num_max_dispatch_tokens_per_rank, hidden, num_experts,
                                       enable_shrink=self.enable_shrink)
        if reused and eng is not None and not self._placeholder:
            self.engine.clean_buffer()      # the old layout's words are stale under the new one
        self._placeholder = False           # (a placeholder ran no call: its masks carry over, nothing is stale)
        self.ready = self.engine
        return self.engine

    def mask_engine(self, what: str) -> LowLatencyEngine:
        """The engine holding the masks (local: a placeholder laid out on this rank's memory when no low-latency
        call ran yet; the first call replaces it on every rank alike, keeping the masks)."""
        if not self.enable_shrink:
            raise RuntimeError(f'{what} needs a Buffer built with enable_shrink=True')
        if self.engine is None:
            if self.base is None:
                raise RuntimeError(f'{what}: no low-latency memory yet (num_rdma_bytes=0 and no low-latency call)')
            self.engine = LowLatencyEngine(self.base, 1, 128, self.num_ranks, enable_shrink=True)
            self._placeholder = True
        return self.engine

    def require_engine(self, what: str) -> LowLatencyEngine:
        if self.engine is None:
            raise RuntimeError(f'{what}: no low-latency call has run on this buffer yet')
        return self.engine

    def destroy(self) -> None:
        if self.base is not None:
            self.base.destroy()
        self.base = self.engine = self.ready = None


class LowLatencyMethods:
    """DeepEP V1's low-latency methods of `Buffer` (`self._ll` is the `LowLatencyMode` inside one domain,
    `self._ll_internode` the `InternodeLLMode` across domains (v1/internode_ll.py); both None without
    `low_latency_mode=True`)."""

    _ll: Optional[LowLatencyMode] = None
    _ll_internode = None

    def _low_latency(self, what: str):
        self._check_alive()
        if self._ll_internode is not None:
            return self._ll_internode
        if self._ll is None:
            raise RuntimeError(f'{what} needs a Buffer built with low_latency_mode=True')
        return self._ll

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of `num_rdma_bytes` the low-latency calls need for these maxima (any top-k up to 32), a multiple of
        2 MiB.

        Args:
            num_max_dispatch_tokens_per_rank: the most tokens a rank dispatches (the same on every rank).
            hidden: the hidden size (a multiple of 128).
            num_ranks: ranks of the group; num_experts: experts in all (a multiple of num_ranks). More than one
                NVLink domain's ranks: the same formula at num_ranks (v1/internode_ll.py
                `rdma_size_hint`: across domains the engine is laid out at the first call, this bounds nothing).
        """
        if isinstance(num_ranks, int) and num_ranks > NUM_MAX_RANKS:
            return internode_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        return get_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: a GPU barrier, every low-latency signal and counter of this rank back to zero, a second
        barrier (lays the engine out first if no low-latency call ran yet). Normal-mode calls use memory of their
        own, so DeepEP's clean after them is not needed here (but harmless).

        Args:
            num_max_dispatch_tokens_per_rank, hidden, num_experts: the maxima of the low-latency calls.
        """
        ll = self._low_latency('clean_low_latency_buffer')
        if ll is self._ll_internode:
            return ll.clean_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        check_dims(num_max_dispatch_tokens_per_rank, hidden, self.group_size, num_experts)
        ll.engine_for(num_max_dispatch_tokens_per_rank, hidden, num_experts).clean_buffer(
            num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False, *,
                             x_global_scale=None, use_nvfp4: bool = False):
        """Send each token to the experts it chooses (low-latency kernels: fixed worst-case layout, no CPU sync,
        CUDA-graph capturable). Every rank passes the same `num_max_dispatch_tokens_per_rank` and `num_experts`.

        Args:
            x: `[num_tokens, hidden]` bfloat16, contiguous, `num_tokens <= num_max_dispatch_tokens_per_rank`,
                `hidden % 128 == 0`.
            topk_idx: `[num_tokens, num_topk]` int64 (`deep_ep.topk_idx_t`), top-k <= 32; -1 selects nothing.
            num_max_dispatch_tokens_per_rank: M; num_experts: E, a multiple of the number of ranks.
            cumulative_local_expert_recv_stats: `[E / R]` int32, += tokens received per local expert.
            dispatch_wait_recv_cost_stats: `[R]` int64, += cycles spent waiting for each source.
            use_fp8: cast to float8_e4m3fn in the kernel (one scale per 128 channels: amax * (1 / 448), as DeepEP
                v1.2.1); round_scale: power-of-two scales; use_ue8m0: scales packed as exponent bytes (needs
                round_scale, hidden % 512 == 0).
            async_finish: return an event instead of making the current stream wait (not with return_recv_hook).
            return_recv_hook: launch only the send phase (current stream, no SM held while waiting); `hook()`
                launches the receive phase. Across domains the sends (and the whole hybrid exchange) run on the
                communication stream and `hook()` joins it and launches the receive kernels on the current stream;
                NCCL's and the intranode kernels do hold SMs while they wait (v1/internode_ll.py).
            x_global_scale, use_nvfp4: DeepEP fork options (NVFP4); not supported (NotImplementedError if set).

        Returns:
            `(recv_x, recv_count, handle, event, hook)`: recv_x `[E / R, R * M, hidden]` bfloat16, or with FP8
            `(float8_e4m3fn [E / R, R * M, hidden], scales)`, scales float32 `[E / R, R * M, hidden / 128]` (int32
            `[E / R, R * M, hidden / 512]` with UE8M0) column-major in the last two dims; only the first
            `recv_count[j]` rows of expert j are valid. recv_count `[E / R]` int32. handle:
            `(src_info [E / R, R * M] int32, layout_range [E / R, R] int64, M, hidden, E)`. event: `EventOverlap`.
            hook: a callable (with return_recv_hook) or None.
        """
        if x_global_scale is not None or use_nvfp4:
            raise NotImplementedError('x_global_scale / use_nvfp4 (NVFP4 low-latency dispatch, a DeepEP fork option) '
                                      'are not supported; use use_fp8')
        ll = self._ll
        if ll is not None and ll.ready is not None and not self._destroyed:
            # A call signature the laid-out engine has bound (features/ll/bound.py) fits its maxima: no relayout
            # to decide, the engine's per-call path only. Else (None) the checks and the layout below.
            out = ll.ready.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                    cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                    round_scale, use_ue8m0, async_finish, return_recv_hook, bound_only=True)
            if out is not None:
                return out
        ll = self._low_latency('low_latency_dispatch')
        if ll is self._ll_internode:
            return ll.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                               cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                               use_ue8m0, async_finish, return_recv_hook)
        shape = interop.tensor_info(x, 'x').shape
        if len(shape) != 2:
            raise ValueError(f'x must be 2-D [num_tokens, hidden], got shape {list(shape)}')
        check_dims(num_max_dispatch_tokens_per_rank, shape[1], self.group_size, num_experts)
        eng = ll.engine_for(num_max_dispatch_tokens_per_rank, shape[1], num_experts)
        return eng.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                            use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False, out=None,
                            combine_wait_recv_cost_stats=None, *, overlap: bool = False, src_signals=None,
                            src_signal_expect_value: int = 0):
        """Send the expert outputs back to their tokens' ranks and reduce there, WEIGHTED:
        `combined_x[t] = sum over k with topk_idx[t, k] >= 0 of topk_weights[t, k] * x[row of (t, k)]` in FP32,
        ascending k, rounded to bfloat16 once.

        Args:
            x: `[E / R, R * M, hidden]` bfloat16, contiguous: the dispatch's layout (ignored with zero_copy).
            topk_idx, topk_weights: the dispatch's `[num_tokens, num_topk]` int64 ids and float32 weights.
            handle: the low_latency_dispatch's handle.
            use_logfmt: not supported (NotImplementedError).
            zero_copy: the rows were written into `get_next_low_latency_combine_buffer(handle)`.
            async_finish, return_recv_hook: as in `low_latency_dispatch`.
            out: `[num_tokens, hidden]` bfloat16 to write into.
            combine_wait_recv_cost_stats: `[R]` int64, += cycles spent waiting for each owner.
            overlap, src_signals, src_signal_expect_value: DeepEP fork options (single-batch overlap); not supported.

        Returns:
            `(combined_x [num_tokens, hidden] bfloat16, event, hook)`.
        """
        if overlap or src_signals is not None or src_signal_expect_value:
            raise NotImplementedError('overlap / src_signals (single-batch overlap, a DeepEP fork option) are not '
                                      'supported')
        ll = self._ll
        if ll is not None and ll.engine is not None and not self._destroyed:       # (`_low_latency` inline)
            return ll.engine.combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                     return_recv_hook, out, combine_wait_recv_cost_stats)
        eng = self._low_latency('low_latency_combine')
        if eng is not self._ll_internode:
            eng = eng.require_engine('low_latency_combine')
        return eng.combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook,
                           out, combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle):
        """The `[E / R, R * M, hidden]` bfloat16 view the next `low_latency_combine(..., zero_copy=True)` reads."""
        ll = self._low_latency('get_next_low_latency_combine_buffer')
        if ll is self._ll_internode:
            return ll.get_next_combine_buffer(handle)
        return ll.require_engine('get_next_low_latency_combine_buffer').get_next_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (`mask=True`) or unmask a rank for the low-latency calls of this rank (needs enable_shrink)."""
        self._mask_engine('low_latency_update_mask_buffer').update_mask_buffer(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status) -> None:
        """Write the mask of every rank (1 = masked) into `mask_status` (`[R]` int32 on this GPU)."""
        self._mask_engine('low_latency_query_mask_buffer').query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (on this rank)."""
        self._mask_engine('low_latency_clean_mask_buffer').clean_mask_buffer()

    def _mask_engine(self, what: str):
        ll = self._low_latency(what)
        if ll is self._ll_internode:
            return ll           # the same mask methods, on this rank's mask words (internode_ll.py)
        return ll.mask_engine(what)
