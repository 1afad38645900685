"""Byte counts of the EP benchmark (`perf/ep_bench.py`): what a dispatch or a combine moves, per destination rank.

Conventions (DeepEP's, `tests/elastic/test_ep.py`): a token travels once to every rank that owns at least one of its
top-k experts (its own rank included, but those bytes never cross a link). A dispatched token counts
`hidden * itemsize + 4 * num_sf + num_topk * (8 + 4)` bytes (hidden, scale factors, int64 top-k ids, float32 top-k
weights); a combined token counts `2 * hidden` bytes (bfloat16 rows, no weights). `rows[src][dst]` is the number of
tokens rank `src` dispatches to rank `dst`; combine sends the same rows back, from `dst` to `src`.

Pure Python and numpy (no torch, no GPU), so CPU tests cover it.
"""

from typing import List, NamedTuple, Sequence

import numpy as np

TOPK_IDX_BYTES = 8        # int64
TOPK_WEIGHT_BYTES = 4     # float32
VECTOR_BYTES = 16         # the peer-copy kernel moves 16-byte vectors


def align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def tokens_per_rank(topk_idx, num_experts: int, num_ranks: int) -> List[int]:
    """Tokens this rank dispatches to each rank: a token counts once per rank owning at least one of its experts.

    Args:
        topk_idx: `[num_tokens, num_topk]`, integer (numpy array, or anything `np.asarray` takes, e.g. a CPU torch
            tensor), global expert ids in `[0, num_experts)` or -1 (ignored).
        num_experts: total experts, a multiple of `num_ranks`; expert e lives on rank `e // (num_experts // num_ranks)`.
        num_ranks: ranks of the domain.

    Returns:
        `num_ranks` Python ints.
    """
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f'num_experts ({num_experts}) must be a positive multiple of num_ranks ({num_ranks})')
    idx = np.asarray(topk_idx)
    if idx.ndim != 2:
        raise ValueError(f'topk_idx must be 2-D [num_tokens, num_topk], got shape {idx.shape}')
    if idx.size and (idx.min() < -1 or idx.max() >= num_experts):
        raise ValueError(f'topk_idx values must be in [-1, {num_experts})')
    hit = np.zeros((idx.shape[0], num_ranks + 1), dtype=bool)
    dst = np.where(idx >= 0, idx // (num_experts // num_ranks), num_ranks)
    hit[np.arange(idx.shape[0])[:, None], dst] = True
    return [int(v) for v in hit[:, :num_ranks].sum(axis=0)]


def dispatch_bytes_per_token(hidden: int, itemsize: int, num_sf: int, num_topk: int) -> int:
    """Bytes of one dispatched token: hidden (`itemsize` 2 for bfloat16, 1 for fp8), scales, top-k ids and weights."""
    return hidden * itemsize + 4 * num_sf + num_topk * (TOPK_IDX_BYTES + TOPK_WEIGHT_BYTES)


def combine_bytes_per_token(hidden: int) -> int:
    """Bytes of one combined token: a bfloat16 row."""
    return 2 * hidden


class Traffic(NamedTuple):
    """What one rank moves in one direction (dispatch, or combine).

    Attributes:
        send_bytes: per destination rank, bytes this rank sends there (0 for itself), rounded up to 16.
        recv_bytes: per source rank, bytes this rank receives from there (0 for itself), rounded up to 16.
        logical_bytes: DeepEP's count for GB/s: every row this rank receives (dispatch) or sends back (combine),
            its own rows included, times the bytes per token.
    """
    send_bytes: List[int]
    recv_bytes: List[int]
    logical_bytes: int

    @property
    def cross_bytes(self) -> int:
        """Bytes this rank puts on links (what the peer-copy floor moves)."""
        return sum(self.send_bytes)


def traffic(rows: Sequence[Sequence[int]], rank: int, bytes_per_token: int, reverse: bool = False) -> Traffic:
    """Per-peer byte counts of one rank.

    Args:
        rows: `rows[src][dst]`, tokens src dispatches to dst (every rank's `tokens_per_rank`, gathered).
        rank: this rank.
        bytes_per_token: `dispatch_bytes_per_token(...)` or `combine_bytes_per_token(...)`.
        reverse: combine direction (rows go from dst back to src).

    Returns:
        `Traffic`.
    """
    m = np.asarray(rows, dtype=np.int64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or not 0 <= rank < m.shape[0]:
        raise ValueError(f'rows must be a square [num_ranks][num_ranks] matrix containing rank {rank}')
    if reverse:
        m = m.T
    num_ranks = m.shape[0]
    send = [0 if p == rank else align(int(m[rank, p]) * bytes_per_token, VECTOR_BYTES) for p in range(num_ranks)]
    recv = [0 if p == rank else align(int(m[p, rank]) * bytes_per_token, VECTOR_BYTES) for p in range(num_ranks)]
    # Dispatch: the rows this rank receives; combine: the same rows, which this rank sends back.
    logical_rows = int(m[rank, :].sum()) if reverse else int(m[:, rank].sum())
    return Traffic(send, recv, logical_rows * bytes_per_token)
