"""The host side of all-gather sessions and reductions, plain Python (no GPU): the session bump allocator, gather
regions and metas, the reduction layout and grid, and the size hints. Identical on every rank because every rank makes
the same calls in the same order."""

import functools
import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ...runtime.sizes import align, ceil_div
from .kernels import (
    CHUNK_MAX_ELEMS,
    CHUNK_MIN_ELEMS,
    COMM_PRECISIONS,
    GATHER_UNROLL,
    GROUP_ELEMS,
    MAX_ROUNDS,
    MAX_SENDERS,
    REDUCE_AREA_ALIGNMENT,
    REGION_ALIGNMENT,
    SENDER_SHARE,
    THREADS,
)


class GatherRegion(NamedTuple):
    """One gathered tensor's region: `offset` bytes from the session start, `num_bytes` per rank, `region_bytes`
    reserved (= align(R * num_bytes, 32)); rank r's tensor sits at `offset + r * num_bytes`. (A NamedTuple: a call
    makes several, and a frozen dataclass costs ~1 us each to build.)"""
    offset: int
    num_bytes: int
    region_bytes: int

    def slot_offset(self, rank: int) -> int:
        return self.offset + rank * self.num_bytes

    @property
    def end(self) -> int:
        return self.offset + self.region_bytes


class SessionPlan:
    """Bump allocator of one all-gather session; identical on every rank because every rank makes the same calls.

    Args:
        num_ranks: ranks of the group (R).
        capacity: bytes of the session area (`num_max_session_bytes`).
        max_gathers: tensors one session may gather (`num_max_all_gathers_per_session`).
    """

    def __init__(self, num_ranks: int, capacity: int, max_gathers: int):
        self.num_ranks, self.capacity, self.max_gathers = num_ranks, capacity, max_gathers
        self.is_open = False
        self.used_bytes = 0
        self.num_gathers = 0

    def open(self) -> None:
        if self.is_open:
            raise RuntimeError('an all-gather session is already open: destroy it first (sessions are sequential)')
        self.is_open, self.used_bytes, self.num_gathers = True, 0, 0

    def close(self) -> None:
        if not self.is_open:
            raise RuntimeError('no all-gather session is open')
        self.is_open = False

    def peek(self, sizes: Sequence[int]) -> List[GatherRegion]:
        """The regions the next gathers of `sizes` bytes (per rank) would get; ValueError if they do not fit."""
        if not self.is_open:
            raise RuntimeError('no all-gather session is open: use create_agrs_session() or agrs_new_session()')
        if self.num_gathers + len(sizes) > self.max_gathers:
            raise ValueError(f'this session already holds {self.num_gathers} gathered tensor(s); {len(sizes)} more '
                             f'exceed num_max_all_gathers_per_session={self.max_gathers}')
        regions, offset = [], self.used_bytes
        for nbytes in sizes:
            region = GatherRegion(offset, nbytes, align(self.num_ranks * nbytes, REGION_ALIGNMENT))
            regions.append(region)
            offset = region.end
        if offset > self.capacity:
            raise ValueError(f'gathering {list(sizes)} bytes per rank needs session bytes up to {offset}, more than '
                             f'num_max_session_bytes={self.capacity} ({self.used_bytes} already used in this '
                             f'session); see get_agrs_num_max_session_bytes')
        return regions

    def reserve(self, sizes: Sequence[int], regions: Optional[List[GatherRegion]] = None) -> List[GatherRegion]:
        """Take the regions of the next gathers of `sizes` bytes (`regions`: what `peek(sizes)` just returned)."""
        if regions is None:
            regions = self.peek(sizes)
        if regions:
            self.used_bytes = regions[-1].end
        self.num_gathers += len(sizes)
        return regions


def gather_meta(region_end: int) -> int:
    """What ranks compare to detect disagreeing sizes: the end of a call's regions in 32-byte units (uint32)."""
    return (region_end // REGION_ALIGNMENT) & 0xFFFFFFFF


def gather_grid(num_bytes: int, aligned: bool, num_sms: int) -> int:
    """Blocks of one gather launch: enough for the bytes (4 vectors in flight per thread), at most `num_sms`."""
    units = num_bytes // 16 if aligned else num_bytes
    per_block = THREADS * (GATHER_UNROLL if aligned else 1)
    return max(1, min(num_sms, ceil_div(units, per_block)))


@dataclass(frozen=True)
class ReduceLayout:
    """Placement and grid of one reduce-scatter / all-reduce (byte offsets relative to the reduction area).

    Attributes:
        num_elems: input elements per rank; shard_elems: elements per shard (a multiple of 8; the last shards of an
            all-reduce may be shorter or empty).
        slot_bytes: one recv slot (a peer's piece in the staging precision), 32-byte aligned; recv slots start at 0.
        gather_offset, gather_slot_bytes: the all-reduce gather slots (FP32 shards), 0 for reduce-scatter.
        num_bytes: bytes of the reduction area used.
        chunk_elems: elements per chunk (the unit a sender publishes); num_senders, num_reducers: blocks per role.
    """
    num_elems: int
    shard_elems: int
    slot_bytes: int
    gather_offset: int
    gather_slot_bytes: int
    num_bytes: int
    chunk_elems: int
    num_senders: int
    num_reducers: int


@functools.lru_cache(maxsize=256)
def reduce_layout(num_ranks: int, num_elems: int, shard_elems: int, stage_itemsize: int, all_reduce: bool,
                  num_sms: int) -> ReduceLayout:
    """Layout and grid for a reduction of `num_elems` elements per rank in shards of `shard_elems` (multiple of 8)."""
    assert shard_elems % GROUP_ELEMS == 0, shard_elems
    slot_bytes = align(shard_elems * stage_itemsize, REGION_ALIGNMENT)
    gather_slot_bytes = align(shard_elems * 4, REGION_ALIGNMENT) if all_reduce else 0
    gather_offset = num_ranks * slot_bytes if all_reduce else 0
    # Senders drive NVLink (and pause at each chunk's system-scope release); reducers only read local memory.
    num, den = SENDER_SHARE
    senders = min(MAX_SENDERS, max(1, min(num_sms - 1, ceil_div(num * num_sms, den))))
    chunk = min(CHUNK_MAX_ELEMS, max(CHUNK_MIN_ELEMS, align(ceil_div(shard_elems, senders), CHUNK_MIN_ELEMS)))
    num_chunks = ceil_div(shard_elems, chunk)
    senders = min(senders, max(1, num_chunks))
    reducers = max(1, min(num_sms - senders, num_chunks))
    if ceil_div(num_chunks, senders) >= MAX_ROUNDS:
        raise ValueError(f'a shard of {shard_elems} elements is too large for one reduction ({num_chunks} chunks)')
    return ReduceLayout(num_elems, shard_elems, slot_bytes, gather_offset, gather_slot_bytes,
                        num_ranks * (slot_bytes + gather_slot_bytes), chunk, senders, reducers)


def reduce_area_offset(num_max_session_bytes: int) -> int:
    """Start of the reduction area, in bytes from the start of the data region."""
    return align(num_max_session_bytes, REDUCE_AREA_ALIGNMENT)


def all_reduce_shard_elems(num_ranks: int, num_elems: int) -> int:
    return align(ceil_div(num_elems, num_ranks), GROUP_ELEMS) if num_elems else GROUP_ELEMS


def _is_shape(x) -> bool:
    return isinstance(x, (tuple, list)) and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool)
                                                for d in x)


def normalize_shapes(shapes) -> Tuple[List[Tuple[int, ...]], bool]:
    """`(list of shapes, single)`: `shapes` is one shape (ints) or a non-empty sequence of shapes."""
    if _is_shape(shapes) and len(shapes) > 0:
        out, single = [tuple(int(d) for d in shapes)], True
    elif isinstance(shapes, (tuple, list)) and shapes and all(_is_shape(s) for s in shapes):
        out, single = [tuple(int(d) for d in s) for s in shapes], False
    else:
        raise ValueError(f'shapes must be a shape or a non-empty sequence of shapes, got {shapes!r}')
    for s in out:
        if any(d < 0 for d in s):
            raise ValueError(f'shapes: negative dimension in {s}')
    return out, single


def num_max_session_bytes(num_ranks: int, shapes, itemsize: int) -> int:
    """Σ over shapes of align(R · prod(shape) · itemsize, 32) (DeepEP's `get_agrs_num_max_session_bytes`)."""
    shape_list, _ = normalize_shapes(shapes)
    return sum(align(num_ranks * math.prod(s) * itemsize, REGION_ALIGNMENT) for s in shape_list)


def reduce_num_bytes(num_ranks: int, num_elems: int, op: str = 'all_reduce', comm_precision: str = 'fp32') -> int:
    """Reduction-area bytes one `reduce_scatter` (input of `num_elems` elements per rank) or `all_reduce` needs."""
    if op == 'all_reduce':
        return reduce_layout(num_ranks, num_elems, all_reduce_shard_elems(num_ranks, num_elems), 4, True,
                             2).num_bytes
    if op != 'reduce_scatter':
        raise ValueError(f"op must be 'reduce_scatter' or 'all_reduce', got {op!r}")
    if comm_precision not in COMM_PRECISIONS:
        raise ValueError(f'comm_precision must be one of {COMM_PRECISIONS}, got {comm_precision!r}')
    shard = align(ceil_div(num_elems, num_ranks), GROUP_ELEMS)
    return num_ranks * align(shard * (2 if comm_precision == 'bf16' else 4), REGION_ALIGNMENT)


# ---- hybrid mode: N scale-up domains x R ranks ---------------------------------------------------------------------
def hybrid_domains(group) -> Tuple[int, int]:
    """`(N, R)` a buffer over `group` will most likely have, without communicating (for the size hints): R = the ranks
    of one host (`group.host_of_rank`, when the group carries it; else all ranks), or `DEEPEP_CUPY_SCALEUP_SIZE` when
    set. The buffer detects its real topology; if it has more domains than this guess, its calls raise naming the
    num_bytes they need."""
    from ... import envs
    from ...runtime.group_size import group_size
    num_ranks = group_size(group)
    hosts = getattr(group, 'host_of_rank', None)
    per_host = num_ranks
    if hosts is not None and len(hosts) == num_ranks and num_ranks:
        per_host = max(1, sum(1 for h in hosts if h == hosts[0]))
    forced = envs.scaleup_size()
    scaleup = forced if forced and per_host % forced == 0 else per_host
    if num_ranks % scaleup:
        scaleup = num_ranks
    return num_ranks // scaleup, scaleup


@dataclass(frozen=True)
class HybridReduceScatterLayout:
    """A reduce-scatter over N domains (offsets from the reduction area): `inner` the in-domain reduce-scatter of the
    reordered input (R pieces of N * n elements; its recv slots from 0), `xp_offset` that FP32 input `[R][N][n]`,
    `send_offset` the in-domain result `[N][n]` FP32 (slot m goes to rail peer m; slot n is this domain's partial),
    `recv_offset` the rail peers' partials `[N][n]` FP32 (slot m from peer m)."""
    inner: ReduceLayout
    shard_elems: int
    xp_offset: int
    send_offset: int
    recv_offset: int
    num_bytes: int


@functools.lru_cache(maxsize=256)
def hybrid_reduce_scatter_layout(num_domains: int, num_scaleup: int, shard_elems: int, stage_itemsize: int,
                                 num_sms: int) -> HybridReduceScatterLayout:
    n, w = shard_elems, num_domains * num_scaleup
    inner = reduce_layout(num_scaleup, w * n, num_domains * n, stage_itemsize, False, num_sms)
    xp = align(inner.num_bytes, REGION_ALIGNMENT)
    send = align(xp + w * n * 4, REGION_ALIGNMENT)
    recv = send + num_domains * n * 4
    return HybridReduceScatterLayout(inner, n, xp, send, recv, recv + num_domains * n * 4)


@dataclass(frozen=True)
class HybridAllReduceLayout:
    """An all-reduce over N domains: `inner` the in-domain all-reduce (from 0), then N rail slots of `slot_bytes`
    at `slots_offset` (slot m: domain m's partial, FP32; this rank's own is the slot it sends from)."""
    inner: ReduceLayout
    slots_offset: int
    slot_bytes: int
    num_bytes: int


@functools.lru_cache(maxsize=256)
def hybrid_all_reduce_layout(num_domains: int, num_scaleup: int, num_elems: int, num_sms: int) -> HybridAllReduceLayout:
    inner = reduce_layout(num_scaleup, num_elems, all_reduce_shard_elems(num_scaleup, num_elems), 4, True, num_sms)
    slots = align(inner.num_bytes, REGION_ALIGNMENT)
    slot_bytes = align(num_elems * 4, REGION_ALIGNMENT)
    return HybridAllReduceLayout(inner, slots, slot_bytes, slots + num_domains * slot_bytes)


def hybrid_reduce_num_bytes(num_domains: int, num_scaleup: int, num_elems: int, op: str = 'all_reduce',
                            comm_precision: str = 'fp32') -> int:
    """Reduction-area bytes one hybrid `reduce_scatter` (input of `num_elems` elements per rank) or `all_reduce`
    needs; `reduce_num_bytes` with one domain."""
    if num_domains <= 1:
        return reduce_num_bytes(num_scaleup, num_elems, op, comm_precision)
    if op == 'all_reduce':
        return hybrid_all_reduce_layout(num_domains, num_scaleup, num_elems, 2).num_bytes
    if op != 'reduce_scatter':
        raise ValueError(f"op must be 'reduce_scatter' or 'all_reduce', got {op!r}")
    if comm_precision not in COMM_PRECISIONS:
        raise ValueError(f'comm_precision must be one of {COMM_PRECISIONS}, got {comm_precision!r}')
    w = num_domains * num_scaleup
    shard = align(ceil_div(num_elems, w), GROUP_ELEMS)
    return hybrid_reduce_scatter_layout(num_domains, num_scaleup, shard, 2 if comm_precision == 'bf16' else 4,
                                        2).num_bytes
