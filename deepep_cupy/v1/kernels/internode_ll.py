"""DeepEP V1's low-latency mode across scale-up domains on the hybrid EP engine (`features/hybrid`): the design, the
argument checks, the launchers of kernels_cu/legacy_internode_ll.cu and their host mirrors (numpy, for the CPU
tests). The buffer side (engine, streams, hooks, zero-copy, masks) is v1/internode_ll.py.

Status: built and CPU-tested (tests/test_legacy_internode_ll_cpu.py: the kernels' mirrors composed with a model of
the hybrid dispatch / combine equal ll_reference's single-domain results on every rank; argument errors; an NVRTC
compile); the GPU rank program is deepep_cupy/tests/legacy_low_latency_internode.py.

Design: "pseudo tokens". V1's low-latency dispatch moves one message per (token, top-k expert) (not one per rank)
and its combine brings back one row per (token, k), which the origin weights and sums in ascending k. The composed
path does exactly that with one hybrid dispatch and one hybrid combine (the no-CPU-sync, CUDA-graph-capturable path
with `num_worst_tokens` rows; rails between domains, the intranode engine inside each):

- dispatch at the origin: `ll_internode_prepare` makes T * K pseudo tokens `p = t * K + k`, each with top-k of one
  expert (`topk_idx[t][k]`, or -1), its V1 slot position as weight (the position of (t, k) among this rank's (t, k)
  choosing that expert, in (t, k) order, as ep_ll.cu numbers them; dropped at >= M or a masked owner), and its row:
  V1's FP8 cast (common/ll_fp8.cuh, the same code as ep_ll.cu: per 128 channels, scale_inv = amax * (1 / 448) or
  round_scale's power of two) done once per token and stored for each valid slot as FP8 + float32 scales (or the
  bfloat16 row). One hybrid dispatch of `(pseudo_x, pseudo_sf)` with `num_max_tokens_per_rank = M * K` sends each
  pseudo token to the one rank owning its expert (over the rail once per destination domain, then NVLink), without a
  CPU sync, into `R * M * min(K, L)` worst-case rows (L = E / R local experts). Every rank must pass the same M and
  top-k (the rail exchange sizes are `M * K` rows per rail peer on both ends), as every model does.
- at the receiver: `ll_internode_layout` counts the rows per (local expert, global source rank) and builds V1's layout
  (`layout_range`, `recv_count`, the cumulative stats); `ll_internode_scatter` puts row i at V1's row `(j, begin[j][s]
  + slot)` (bytes, scales as float `[L, H/128, R*M]` or UE8M0-packed int32 `[L, H/512, R*M]` viewed transposed,
  `src_info = t`). Rows of expert j therefore come in ascending source rank, then the source's (t, k) order: the
  single-domain order (ep_ll.cu), whatever order the hybrid dispatch delivered them in (no sort is needed: the engine
  is built `deterministic=False`).
- combine: `ll_internode_gather` builds the hybrid combine's input from V1's layout (row i = the caller's row
  `row_of[i]`; zero-copy: the staging buffer), the hybrid combine returns one bfloat16 row per pseudo token (its only
  row: the FP32 in-domain and cross-domain sums of one row are exact), and `ll_internode_reduce` computes V1's `acc =
  fma(w_k, row_k, acc)` in FP32, ascending k, over the slots with `send_pos >= 0`, a valid expert and a live owner
  (DeepEP v1.2.1's fused multiply-add), one rounding to bfloat16: the arithmetic of ep_ll.cu's combine on the same
  rows, so results are bit for bit the single-domain path's (a -0 row becomes +0 on the way, which changes no sum: acc
  starts at +0 and never is -0).
- Hooks: `return_recv_hook=True` enqueues prepare and the whole hybrid dispatch (or gather and the hybrid combine) on
  the Buffer's communication stream, forked from the caller's stream by an event, and returns; `hook()` makes the
  caller's current stream wait for it and launches layout + scatter (or reduce) there. The caller's stream is free
  in between, but the waiting is done by NCCL's kernels and by the intranode dispatch / combine kernels on the
  communication stream, which occupy SMs while they wait: unlike V1's hook (0 SMs until `hook()`), the composed
  path's receive is not SM-free. CUDA graphs: capture the call and its hook in the same graph (the hook joins the
  forked stream back).
- Masks (`enable_shrink`): kept on this rank (`[R]` int32 on the GPU); a masked rank's experts are not sent to, its
  rows are dropped at the receiver and its slots add nothing at the combine. The rails are collective, so a rank
  that really stops calling stalls NCCL and fails the buffer (the rail watchdog's timeout), it is never masked
  automatically as V1's shrink mode does.
"""

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from ...constants import NUM_MAX_TOPK
from ...features.ll.plan import LLCallChecks, V1LLHandle, _int_arg
from ...jit.launch import PTR, KernelSpec, Param, load_kernels
from ...runtime import interop

FAMILY = 'legacy_internode_ll'
THREADS = 512                   # kLLThreads
LAYOUT_THREADS = 1024           # kLLLayoutThreads
MAX_BLOCKS = 1024
MAX_EXPERTS = 4096              # the layout's (expert, source) histogram sits in shared memory
MAX_PSEUDO_TOKENS = 1 << 24     # pseudo positions travel as float32 weights (exact below 2^24)

_P = Param
PREPARE_SPEC = KernelSpec(FAMILY, 'deepep::ll_internode::ll_internode_prepare', (
    _P('x', PTR), _P('topk_idx', PTR), _P('num_tokens', np.int32), _P('num_topk', np.int32), _P('hidden', np.int32),
    _P('num_experts', np.int32), _P('num_ranks', np.int32), _P('num_max_tokens', np.int32), _P('mask', PTR),
    _P('use_fp8', np.int32), _P('round_scale', np.int32), _P('pseudo_x', PTR), _P('pseudo_sf', PTR),
    _P('pseudo_topk', PTR), _P('pseudo_pos', PTR), _P('send_pos', PTR)))
LAYOUT_SPEC = KernelSpec(FAMILY, 'deepep::ll_internode::ll_internode_layout', (
    _P('recv_topk', PTR), _P('topk_stride', np.int64), _P('recv_meta', PTR), _P('meta_stride', np.int64),
    _P('num_rows', np.int32), _P('num_recv', PTR), _P('num_domains', np.int32), _P('num_scaleup', np.int32),
    _P('num_pseudo', np.int32), _P('num_local_experts', np.int32), _P('mask', PTR), _P('layout_range', PTR),
    _P('recv_count', PTR), _P('cumulative_stats', PTR), _P('begin', PTR)))
SCATTER_SPEC = KernelSpec(FAMILY, 'deepep::ll_internode::ll_internode_scatter', (
    _P('recv_x', PTR), _P('x_row_bytes', np.int64), _P('recv_sf', PTR), _P('sf_stride_row', np.int64),
    _P('sf_stride_col', np.int64), _P('recv_topk', PTR), _P('topk_stride', np.int64), _P('recv_weights', PTR),
    _P('weight_stride', np.int64), _P('recv_meta', PTR), _P('meta_stride', np.int64), _P('num_rows', np.int32),
    _P('num_recv', PTR), _P('num_domains', np.int32), _P('num_scaleup', np.int32), _P('num_pseudo', np.int32),
    _P('num_topk', np.int32), _P('num_local_experts', np.int32), _P('num_max_tokens', np.int32),
    _P('hidden', np.int32), _P('use_fp8', np.int32), _P('use_ue8m0', np.int32), _P('mask', PTR), _P('begin', PTR),
    _P('out_x', PTR), _P('out_sf', PTR), _P('src_info', PTR), _P('row_of', PTR)))
GATHER_SPEC = KernelSpec(FAMILY, 'deepep::ll_internode::ll_internode_gather', (
    _P('x', PTR), _P('row_of', PTR), _P('num_rows', np.int32), _P('num_recv', PTR), _P('hidden', np.int32),
    _P('combine_x', PTR)))
REDUCE_SPEC = KernelSpec(FAMILY, 'deepep::ll_internode::ll_internode_reduce', (
    _P('pseudo_out', PTR), _P('topk_idx', PTR), _P('topk_weights', PTR), _P('send_pos', PTR),
    _P('num_tokens', np.int32), _P('num_topk', np.int32), _P('hidden', np.int32), _P('num_experts', np.int32),
    _P('num_ranks', np.int32), _P('mask', PTR), _P('combined_x', PTR)))
SPECS = (PREPARE_SPEC, LAYOUT_SPEC, SCATTER_SPEC, GATHER_SPEC, REDUCE_SPEC)


def shipped_specs():
    """Family name → every specialisation (one each: the sizes are run-time arguments)."""
    return {FAMILY: list(SPECS)}


class InternodeLLKernels:
    """The loaded kernels (attributes named after them; loaded when the engine is built, never inside a call)."""

    def __init__(self, device: Optional[int] = None, loaded=None):
        loaded = loaded if loaded is not None else load_kernels(list(SPECS), device=device)
        self.prepare = loaded[PREPARE_SPEC.name]
        self.layout = loaded[LAYOUT_SPEC.name]
        self.scatter = loaded[SCATTER_SPEC.name]
        self.gather = loaded[GATHER_SPEC.name]
        self.reduce = loaded[REDUCE_SPEC.name]


# ---- sizes (pure) --------------------------------------------------------------------------------------------------
def pseudo_tokens(num_max_tokens: int, num_topk: int) -> int:
    """Pseudo tokens per rank of a call (the hybrid dispatch's num_max_tokens_per_rank): M * K."""
    return num_max_tokens * num_topk


def worst_rows(num_ranks: int, num_max_tokens: int, num_topk: int, num_local_experts: int) -> int:
    """Rows a rank may receive: each source sends at most M pseudo tokens per local expert (V1 keeps M per (expert,
    source)) and at most M * K in all: `R * M * min(K, L)` (the hybrid dispatch's num_worst_tokens)."""
    return num_ranks * num_max_tokens * min(num_topk, num_local_experts)


# ---- the handle ----------------------------------------------------------------------------------------------------
class InternodeLLHandle(V1LLHandle):
    """DeepEP's low-latency handle `(src_info [L, R*M] int32, layout_range [L, R] int64, M, hidden, num_experts)`
    across domains (values as the single-domain path's). Attributes for the combine: `hybrid_handle`, `engine` (kept
    alive), `row_of` `[rows]` int32 (hybrid row -> V1 row `j * R * M + r`, -1: dropped), `send_pos` `[T, K]` int32,
    `num_rows`, `num_recv_ptr` (the received row count's device address), `recv_count`, `num_tokens`, `num_topk`,
    `kind`, `mode_id`, `keep` (allocations the launches read)."""


# ---- argument checks (pure) ----------------------------------------------------------------------------------------
class InternodeLLPlanner(LLCallChecks):
    """Checks of the low-latency calls across domains (R ranks in all), before any kernel: ValueError / TypeError
    naming the argument. Runs without a GPU (CPU tensors pass when `device` is -1). The single-domain planner's
    checks (features/ll/plan.py `LLCallChecks`) with the limits of the composed path (`dims`)."""

    handle_type = InternodeLLHandle
    zero_copy_checks_x = False

    def dims(self, num_max_tokens: Any, hidden: Any, num_experts: Any, num_topk: Optional[int] = None) -> None:
        R = self.num_ranks
        M = _int_arg('num_max_dispatch_tokens_per_rank', num_max_tokens, 1)
        H = _int_arg('hidden', hidden, 128)
        E = _int_arg('num_experts', num_experts, 1)
        if H % 128:
            raise ValueError(f'hidden must be a multiple of 128 (one FP8 scale per 128 channels), got {H}')
        if E % R:
            raise ValueError(f'num_experts={E} must be a multiple of the number of ranks {R}')
        if E > MAX_EXPERTS:
            raise ValueError(f'num_experts must be at most {MAX_EXPERTS}, got {E}')
        if num_topk is not None:
            if not 1 <= num_topk <= NUM_MAX_TOPK:
                raise ValueError(f'num_topk must be in [1, {NUM_MAX_TOPK}], got {num_topk}')
            if M * num_topk >= MAX_PSEUDO_TOKENS:
                raise ValueError(f'num_max_dispatch_tokens_per_rank * num_topk = {M * num_topk} must be below '
                                 f'{MAX_PSEUDO_TOKENS}')

    def _dispatch_sizes(self, num_max_tokens: Any, num_experts: Any, hidden: int, num_topk: int) -> Tuple[int, int]:
        self.dims(num_max_tokens, hidden, num_experts, num_topk)
        return int(num_max_tokens), int(num_experts)


# ---- launchers -----------------------------------------------------------------------------------------------------
def _ptr(a) -> int:
    if a is None:
        return 0
    if isinstance(a, int):
        return a
    return a.data_ptr() if interop.is_torch(a) else a.data.ptr


def _grid(num_items: int) -> int:
    return max(1, min(MAX_BLOCKS, -(-num_items // (THREADS // 32))))


def launch_prepare(k: InternodeLLKernels, stream, x, topk_idx, num_experts: int, num_ranks: int, num_max_tokens: int,
                   mask, use_fp8: bool, round_scale: bool, pseudo_x, pseudo_sf, pseudo_topk, pseudo_pos,
                   send_pos) -> None:
    T, K = interop.shape_of(topk_idx)
    H = interop.shape_of(x)[1]
    k.prepare.launch(_grid(num_experts + T), THREADS, stream=stream, x=x, topk_idx=topk_idx, num_tokens=T,
                     num_topk=K, hidden=H, num_experts=num_experts, num_ranks=num_ranks,
                     num_max_tokens=num_max_tokens, mask=_ptr(mask), use_fp8=int(use_fp8),
                     round_scale=int(round_scale), pseudo_x=pseudo_x, pseudo_sf=_ptr(pseudo_sf),
                     pseudo_topk=pseudo_topk, pseudo_pos=pseudo_pos, send_pos=send_pos)


def _stride(a, dim: int) -> int:
    return int(interop.tensor_info(a).strides[dim])


def launch_receive(k: InternodeLLKernels, stream, recv, num_domains: int, num_scaleup: int, num_pseudo: int,
                   num_topk: int, num_local_experts: int, num_max_tokens: int, hidden: int, use_fp8: bool,
                   use_ue8m0: bool, mask, out_x, out_sf, src_info, layout_range, recv_count, cumulative_stats, begin,
                   row_of) -> None:
    """ll_internode_layout then ll_internode_scatter, on `stream`. `recv`: `ReceivedRows` (the hybrid dispatch's)."""
    R = num_domains * num_scaleup
    k.layout.launch(1, LAYOUT_THREADS, stream=stream, shared_mem=4 * num_local_experts * R,
                    recv_topk=recv.topk, topk_stride=_stride(recv.topk, 0), recv_meta=recv.meta,
                    meta_stride=_stride(recv.meta, 0), num_rows=recv.num_rows, num_recv=recv.num_recv_ptr,
                    num_domains=num_domains, num_scaleup=num_scaleup, num_pseudo=num_pseudo,
                    num_local_experts=num_local_experts, mask=_ptr(mask), layout_range=layout_range,
                    recv_count=recv_count, cumulative_stats=_ptr(cumulative_stats), begin=begin)
    x, sf = recv.x if use_fp8 else (recv.x, None)
    k.scatter.launch(_grid(recv.num_rows), THREADS, stream=stream, recv_x=x,
                     x_row_bytes=_stride(x, 0) * interop.tensor_info(x).itemsize, recv_sf=_ptr(sf),
                     sf_stride_row=_stride(sf, 0) if sf is not None else 0,
                     sf_stride_col=_stride(sf, 1) if sf is not None else 0, recv_topk=recv.topk,
                     topk_stride=_stride(recv.topk, 0), recv_weights=recv.weights,
                     weight_stride=_stride(recv.weights, 0), recv_meta=recv.meta, meta_stride=_stride(recv.meta, 0),
                     num_rows=recv.num_rows, num_recv=recv.num_recv_ptr, num_domains=num_domains,
                     num_scaleup=num_scaleup, num_pseudo=num_pseudo, num_topk=num_topk,
                     num_local_experts=num_local_experts, num_max_tokens=num_max_tokens, hidden=hidden,
                     use_fp8=int(use_fp8), use_ue8m0=int(use_ue8m0), mask=_ptr(mask), begin=begin, out_x=out_x,
                     out_sf=_ptr(out_sf), src_info=src_info, row_of=row_of)


def launch_gather(k: InternodeLLKernels, stream, x_ptr: int, row_of, num_rows: int, num_recv_ptr: int, hidden: int,
                  combine_x) -> None:
    k.gather.launch(_grid(num_rows), THREADS, stream=stream, x=x_ptr, row_of=row_of, num_rows=num_rows,
                    num_recv=num_recv_ptr, hidden=hidden, combine_x=combine_x)


def launch_reduce(k: InternodeLLKernels, stream, pseudo_out, topk_idx, topk_weights, send_pos, num_experts: int,
                  num_ranks: int, mask, combined_x) -> None:
    T, K = interop.shape_of(topk_idx)
    k.reduce.launch(_grid(T), THREADS, stream=stream, pseudo_out=pseudo_out, topk_idx=topk_idx,
                    topk_weights=topk_weights, send_pos=send_pos, num_tokens=T, num_topk=K,
                    hidden=interop.shape_of(combined_x)[1], num_experts=num_experts, num_ranks=num_ranks,
                    mask=_ptr(mask), combined_x=combined_x)


@dataclass
class ReceivedRows:
    """What the hybrid dispatch left at a receiver: `x` (`[rows, H]` bfloat16, or `(float8_e4m3fn [rows, H], float32
    scales [rows, H/128])`), `topk` `[rows, 1]` int64 (local expert or -1), `weights` `[rows, 1]` float32 (the
    pseudo token's slot position), `meta` `[rows, *]` int32 (column 0: the intranode source index), `num_rows`,
    `num_recv_ptr` (device address of the received count)."""
    x: Any
    topk: Any
    weights: Any
    meta: Any
    num_rows: int
    num_recv_ptr: int


# ---- host mirrors (numpy; tests/test_legacy_internode_ll_cpu.py) ---------------------------------------------------
def prepare_host(topk_idx: np.ndarray, num_experts: int, num_ranks: int, num_max_tokens: int,
                 masked=()) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`ll_internode_prepare`'s routing: `(pseudo_topk [T*K] int64, pseudo_pos [T*K] float32, send_pos [T, K]
    int32)` (the rows: the cast of each token, in the valid slots' rows; see ll_reference.cast_fp8)."""
    T, K = topk_idx.shape
    L = num_experts // num_ranks
    flat = topk_idx.reshape(-1)
    ptopk = np.full(T * K, -1, dtype=np.int64)
    ppos = np.zeros(T * K, dtype=np.float32)
    send = np.full(T * K, -1, dtype=np.int32)
    counts = {}
    for i, e in enumerate(flat.tolist()):
        if not 0 <= e < num_experts:
            continue
        pos = counts.get(e, 0)
        counts[e] = pos + 1
        kept = (e // L) not in masked and pos < num_max_tokens
        ppos[i] = pos
        if kept:
            ptopk[i], send[i] = e, pos
    return ptopk, ppos, send.reshape(T, K)


def receive_host(topk: np.ndarray, meta0: np.ndarray, weights: np.ndarray, num_recv: int, num_domains: int,
                 num_scaleup: int, num_pseudo: int, num_topk: int, num_local_experts: int, num_max_tokens: int,
                 masked=()):
    """`ll_internode_layout` + the index part of `ll_internode_scatter` for received rows (top-k `[rows]` local
    expert or -1, column 0 of the metadata, weights `[rows]`): `(layout_range [L, R] int64, recv_count [L] int32,
    row_of [rows] int32, src_info {V1 row: t})`."""
    R, L = num_domains * num_scaleup, num_local_experts
    T = R * num_max_tokens
    rows = min(len(topk), num_recv)
    nm = num_domains * num_pseudo

    def source(index):
        r, rem = divmod(int(index), nm)
        s, p = divmod(rem, num_pseudo)
        return s * num_scaleup + r, p
    count = np.zeros((L, R), dtype=np.int64)
    for i in range(rows):
        j, index = int(topk[i]), int(meta0[i])
        if 0 <= j < L and index >= 0:
            s, _ = source(index)
            if s not in masked:
                count[j, s] += 1
    begin = np.zeros((L, R), dtype=np.int64)
    begin[:, 1:] = np.cumsum(count, axis=1)[:, :-1]
    layout_range = (begin << 32) | count
    recv_count = count.sum(1).astype(np.int32)
    row_of = np.full(len(topk), -2, dtype=np.int32)      # -2: not written (past the received count)
    src_info = {}
    for i in range(rows):
        j, index = int(topk[i]), int(meta0[i])
        s, p = source(index) if index >= 0 else (0, 0)
        if not (0 <= j < L and index >= 0) or s in masked:
            row_of[i] = -1
            continue
        out = j * T + int(begin[j, s]) + int(weights[i])
        row_of[i] = out
        src_info[out] = p // num_topk
    return layout_range, recv_count, row_of, src_info


def reduce_host(pseudo_out: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray, send_pos: np.ndarray,
                num_experts: int, num_ranks: int, masked=()) -> np.ndarray:
    """`ll_internode_reduce`: `pseudo_out` `[T*K, H]` float32 (bfloat16 values) → `[T, H]` float32 sums (round to
    bfloat16 once afterwards): `acc = acc + w * row` in float32, ascending k."""
    T, K = topk_idx.shape
    L = num_experts // num_ranks
    out = np.zeros((T, pseudo_out.shape[1]), dtype=np.float32)
    for t in range(T):
        acc = np.zeros(pseudo_out.shape[1], dtype=np.float32)
        for k in range(K):
            e, pos = int(topk_idx[t, k]), int(send_pos[t, k])
            if pos < 0 or not 0 <= e < num_experts or e // L in masked:
                continue
            acc = (acc + (np.float32(topk_weights[t, k]) * pseudo_out[t * K + k]).astype(np.float32)).astype(
                np.float32)
        out[t] = acc
    return out
