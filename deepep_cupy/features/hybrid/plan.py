"""Pure host-side pieces of the composed hybrid path (feature.py): the rail area, row sizes, exchange payloads, the
transport choice, the metadata translation and row order, the size of the intranode part, and the records a dispatch's
steps hand on. No CUDA here (CPU-tested)."""

from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ...constants import SF_GROUP
from ...runtime.rails import FLAGS_BYTES, HEADER_BYTES, RailOp, RailPlan, RailTopology
from ...runtime.sizes import align, ceil_div


def dispatch_row_bytes(num_topk: int, num_sf: int, hidden_bytes: int) -> int:
    """Bytes of one dispatch rail row (kernels_cu/hybrid.cu `rail_row`): [src token int32 | top-k int64 x K |
    weights f32 x K | scales 4 B x num_sf | x], each part padded to 16 bytes."""
    return 16 + align(8 * num_topk, 16) + align(4 * num_topk, 16) + align(4 * num_sf, 16) + align(hidden_bytes, 16)


def combine_row_bytes(hidden: int, num_topk: int) -> int:
    """Bytes of one combine rail row: [x bf16 x hidden | weights f32 x K], each part padded to 16 bytes."""
    return align(2 * hidden, 16) + align(4 * num_topk, 16)


@dataclass(frozen=True)
class RailArea:
    """A rank's rail memory: `[flags | send regions [N] | recv regions [N]]`, each region a 16-byte header and up to
    `num_max_tokens` rows of `row_bytes` (the largest of both formats). Every rank has the same layout, so a peer's
    region for this rank sits at the same offset as this rank's region for the peer (`runtime.rails.RailAreasLike`).
    """
    num_domains: int
    num_max_tokens: int
    row_bytes: int

    @property
    def region_bytes(self) -> int:
        return HEADER_BYTES + self.num_max_tokens * self.row_bytes

    @property
    def flags_offset(self) -> int:
        return 0

    @property
    def send_offset(self) -> int:
        return FLAGS_BYTES

    @property
    def recv_offset(self) -> int:
        return FLAGS_BYTES + self.num_domains * self.region_bytes

    @property
    def total_bytes(self) -> int:
        return align(self.recv_offset + self.num_domains * self.region_bytes, 1 << 21)

    def send_region(self, self_domain: int, peer_domain: int) -> int:
        return self.send_offset + peer_domain * self.region_bytes

    def recv_region(self, self_domain: int, peer_domain: int) -> int:
        return self.recv_offset + peer_domain * self.region_bytes


def rail_area(num_domains: int, num_max_tokens: int, hidden: int, num_topk: int) -> RailArea:
    """The rail area for a buffer's settings: BF16 rows with the most scales any FP8 dispatch may carry."""
    row = max(dispatch_row_bytes(num_topk, ceil_div(hidden, SF_GROUP), 2 * hidden), combine_row_bytes(hidden, num_topk))
    return RailArea(num_domains, num_max_tokens, row)


def payloads(peers: Sequence[int], rows: Optional[Dict[int, int]], num_max_tokens: int, row_bytes: int
             ) -> Dict[int, int]:
    """Payload bytes per peer domain: `rows[m] * row_bytes` (exact, known to both ends), or the static worst case
    `num_max_tokens * row_bytes` when `rows` is None (no CPU sync, CUDA graphs: the header carries the count)."""
    if rows is None:
        return {m: num_max_tokens * row_bytes for m in peers}
    return {m: int(rows[m]) * row_bytes for m in peers}


def choose_transport(setting: str, rail_gpu_ids: Sequence[str]) -> str:
    """`'nccl'` or `'loopback'` for `DEEPEP_CUPY_RAIL_TRANSPORT` = `setting` and the GPUs of this rank's rail members
    as NCCL tells them apart (`Topology.nccl_gpu_ids`: NCCL host and PCI bus id). Every member sees the same ids, so a
    rail agrees; auto picks loopback when two members share a GPU of one NCCL host (NCCL refuses two ranks of one
    communicator there; ranks sharing a GPU that name different hosts with NCCL_HOSTID are accepted)."""
    if setting in ('nccl', 'loopback'):
        if setting == 'nccl' and len(set(rail_gpu_ids)) < len(rail_gpu_ids):
            raise ValueError('DEEPEP_CUPY_RAIL_TRANSPORT=nccl, but two members of a rail share a GPU and one NCCL '
                             'host, which NCCL refuses: give each domain its own NCCL_HOSTID (README: Testing '
                             'scale-out on one GPU), or use loopback (or auto) for ranks that share GPUs')
        return setting
    if setting != 'auto':
        raise ValueError(f'rail transport must be auto, nccl or loopback, got {setting!r}')
    return 'loopback' if len(set(rail_gpu_ids)) < len(rail_gpu_ids) else 'nccl'


def translate_src_index(inner, num_domains: int, num_scaleup_ranks: int, num_max_tokens: int):
    """The intranode dispatch's source index `r * (N * M) + s * M + t` (local source r, union row s * M + t) as the
    global one `(s * R + r) * M + t`; negative values stay. Works on numpy / torch / CupPy integer arrays."""
    nm = num_domains * num_max_tokens
    r, rem = inner // nm, inner % nm
    out = ((rem // num_max_tokens) * num_scaleup_ranks + r) * num_max_tokens + rem % num_max_tokens
    return out * (inner >= 0) + inner * (inner < 0)


def hybrid_row_order(src_rank, src_token_idx, num_scaleup_ranks: int):
    """The permutation that puts rows sorted by (source rank, token) - `refs.dispatch_from_gathered`'s order - into
    the hybrid order (source scale-up index, source domain, token): `rows_hybrid = rows_ref[perm]` (numpy arrays)."""
    import numpy as np
    src_rank = np.asarray(src_rank, dtype=np.int64)
    return np.lexsort((np.asarray(src_token_idx), src_rank // num_scaleup_ranks, src_rank % num_scaleup_ranks))


# ---- P2: the pipelined dispatch's split rows and chunked payload exchange --------------------------------------------
PIPELINE_MAX_CHUNKS = 8             # chunks per payload exchange at most (each costs an NCCL group + two kernels)
PIPELINE_MIN_CHUNK_BYTES = 1 << 20  # per peer and chunk at least (NCCL p2p is near its rate from ~1 MB)
PIPELINE_FREE_SMS = 16              # SMs the guarded intranode dispatch leaves to the payload stream's kernels


def meta_row_bytes(num_topk: int) -> int:
    """Bytes of one split metadata row (kernels_cu/hybrid.cu `SplitRows`): [src token int32 | top-k int64 x K |
    weights f32 x K], each part padded to 16 bytes."""
    return 16 + align(8 * num_topk, 16) + align(4 * num_topk, 16)


def payload_row_bytes(num_sf: int, hidden_bytes: int) -> int:
    """Bytes of one split payload row: [scales 4 B x num_sf | x], each part padded to 16 bytes."""
    return align(4 * num_sf, 16) + align(hidden_bytes, 16)


@dataclass(frozen=True)
class SplitRows:
    """A region in the split layout of the pipelined dispatch: `[header | meta rows [M] | payload rows [M]]`."""
    num_max_tokens: int
    meta_bytes: int
    payload_bytes: int

    @property
    def payload_offset(self) -> int:
        """Offset of payload row 0 from the region's start."""
        return HEADER_BYTES + self.num_max_tokens * self.meta_bytes

    @property
    def region_bytes(self) -> int:
        return self.payload_offset + self.num_max_tokens * self.payload_bytes


def split_rows(area: RailArea, num_max_tokens: int, num_topk: int, num_sf: int, hidden_bytes: int) -> SplitRows:
    """The split layout of a call, checked against the rail area (it fits whenever the unsplit rows do)."""
    rows = SplitRows(num_max_tokens, meta_row_bytes(num_topk), payload_row_bytes(num_sf, hidden_bytes))
    if rows.region_bytes > area.region_bytes:
        raise ValueError(f'the split rows of {num_max_tokens} tokens need {rows.region_bytes} bytes per rail region, '
                         f'the area has {area.region_bytes}')
    return rows


def pipeline_chunk_rows(num_max_tokens: int, payload_bytes: int, setting: int = 0) -> int:
    """Rail rows per payload chunk: `setting` when > 0 (`DEEPEP_CUPY_HYBRID_PIPELINE_ROWS`), else at most
    PIPELINE_MAX_CHUNKS chunks of at least PIPELINE_MIN_CHUNK_BYTES each (bounded by M). A function of values every
    rank shares: rail peers must cut the exchange alike."""
    if setting < 0:
        raise ValueError(f'DEEPEP_CUPY_HYBRID_PIPELINE_ROWS must be >= 0, got {setting}')
    if num_max_tokens < 1 or payload_bytes < 1:
        raise ValueError(f'num_max_tokens ({num_max_tokens}) and payload_bytes ({payload_bytes}) must be positive')
    if setting:
        return min(setting, num_max_tokens)
    rows = max(ceil_div(num_max_tokens, PIPELINE_MAX_CHUNKS), ceil_div(PIPELINE_MIN_CHUNK_BYTES, payload_bytes))
    return min(rows, num_max_tokens)


def rows_ready_after(chunk: int, chunk_rows: int, num_max_tokens: int) -> int:
    """The rows-ready counter after payload chunk `chunk` landed and was unpacked: every union row whose source token
    t is below it is complete, since a token's rail position never exceeds t (positions count a source's earlier
    tokens to the same domain) and chunk c holds rail positions [c * rows, (c + 1) * rows) of every peer."""
    return min((chunk + 1) * chunk_rows, num_max_tokens)


def payload_plan(rails: RailTopology, area: RailArea, rows: SplitRows, send_rows: Optional[Dict[int, int]],
                 recv_rows: Optional[Dict[int, int]], chunk_rows: int) -> RailPlan:
    """The payload exchange of a pipelined dispatch: `ceil(M / chunk_rows)` chunks (NCCL groups, every rank the same
    number), chunk c moving payload rows [c * chunk_rows, ...) of each peer below its row count (`None`: M rows, the
    static exchange of no-sync, cached and captured calls). Both ends know every count between them (the notify), so
    chunk c of a pair exists at both ends or neither. Ops: peers ascending, send before recv (`plan_exchange`'s order).
    """
    peers = rails.peer_domains
    M = rows.num_max_tokens
    if chunk_rows < 1:
        raise ValueError(f'chunk_rows must be >= 1, got {chunk_rows}')
    counts = {}
    for name, given in (('send_rows', send_rows), ('recv_rows', recv_rows)):
        if given is None:
            counts[name] = {m: M for m in peers}
            continue
        if sorted(given) != peers:
            raise ValueError(f'{name} must name every peer domain {peers}, got {sorted(given)}')
        for m, c in given.items():
            if not 0 <= int(c) <= M:
                raise ValueError(f'{name}[{m}] = {c} is out of range [0, {M}]')
        counts[name] = {m: int(c) for m, c in given.items()}
    n = rails.domain_idx
    num_chunks = ceil_div(M, chunk_rows)
    ops: List[RailOp] = []
    for c in range(num_chunks):
        begin = c * chunk_rows
        for m in peers:
            for kind, total, offset, peer_offset in (
                    ('send', counts['send_rows'][m], area.send_region(n, m), area.recv_region(m, n)),
                    ('recv', counts['recv_rows'][m], area.recv_region(n, m), area.send_region(m, n))):
                end = min(begin + chunk_rows, total)
                if begin < end:
                    at = rows.payload_offset + begin * rows.payload_bytes
                    ops.append(RailOp(c, m, kind, offset + at, peer_offset + at, (end - begin) * rows.payload_bytes))
    return RailPlan('dispatch', num_chunks, tuple(ops))


def combine_tokens_ready(chunk: int, chunk_bytes: int, row_bytes: int, num_chunks: int, num_tokens: int) -> int:
    """Tokens whose rail partials all landed after chunk `chunk` of a combine exchange cut by `plan_exchange(...,
    chunk_bytes)` (transfers: a 16-byte header, then rows at their rail positions): rows ending within the first
    (chunk + 1) * chunk_bytes bytes; a token's rail position in every domain is at most its index. After the last
    chunk: every token."""
    if chunk >= num_chunks - 1:
        return num_tokens
    return max(0, min(num_tokens, ((chunk + 1) * chunk_bytes - HEADER_BYTES) // row_bytes))


# ---- deterministic=True: DeepEP's row order (deterministic.py, kernels_cu/hybrid.cu hybrid_sort_plan) ---------------
def sort_transposition(keys, group_end: Sequence[int], alignment: int, num_rows: int, num_domains: int,
                       num_scaleup_ranks: int, num_max_tokens: int):
    """Host model of `hybrid_sort_plan` (every block): DeepEP's sort by src_token_global_idx of rows that come in the
    intranode order, as a transposition of runs.

    Group g spans rows `[lo, hi)`: lo = 0 for g = 0, else `align(group_end[g - 1], alignment)`, hi = `group_end[g]`;
    rows from hi to the next group's lo (the last group: to `num_rows`) stay. Inside a group the intranode keys
    `(r * N + s) * M + t` ascend (forwarder r, source domain s, token t), so run q = r * N + s is contiguous; DeepEP's
    key `(s * R + r) * M + t` orders the runs by (s, r) and keeps each run's order.

    Args:
        keys: `[num_rows]` intranode keys (only rows inside groups are read).
        group_end: inclusive ends: `[psum_num_recv_tokens_per_scaleup_rank[-1]]` (all rows), or the expanded
            `psum_num_recv_tokens_per_expert` (one group per expert).
        alignment: the expert alignment (1 for the rows' one group).
        num_rows, num_domains, num_scaleup_ranks, num_max_tokens: the array's rows, N, R, M (the call's).

    Returns:
        `(row_src, row_dst)` int32 `[num_rows]`: DeepEP row j holds intranode row `row_src[j]`; intranode row e goes
        to `row_dst[e]`.
    """
    import numpy as np
    keys = np.asarray(keys, dtype=np.int64)
    N, R, M = num_domains, num_scaleup_ranks, num_max_tokens
    W = N * R
    row_src = np.arange(num_rows, dtype=np.int32)
    row_dst = np.arange(num_rows, dtype=np.int32)
    ends = [int(e) for e in group_end]

    def clamp(v: int) -> int:
        return min(max(v, 0), num_rows)
    for g, end in enumerate(ends):
        lo = 0 if g == 0 else clamp(align(ends[g - 1], alignment))
        hi = max(lo, clamp(end))
        start = np.searchsorted(keys[lo:hi], np.arange(W + 1, dtype=np.int64) * M) + lo
        start[W] = hi
        count = np.diff(start)
        base = np.zeros(W, dtype=np.int64)
        run = 0
        for i in range(W):
            q = (i % R) * N + i // R
            base[q] = run
            run += int(count[q])
        e = np.arange(lo, hi)
        q = np.clip(keys[lo:hi] // M, 0, W - 1)
        dst = lo + base[q] + (e - start[q])
        row_dst[lo:hi] = dst
        row_src[dst] = e
    return row_src, row_dst


# ---- the records of a dispatch's steps (feature.py) --------------------------------------------------------------
class RoutedRows(NamedTuple):
    """What a dispatch's step 1 (feature.py `HybridEP._route`) leaves for the exchange and the unpack."""
    domain_pos: Any             # `[T, N]` int32: each token's rail position in each destination domain, or -1
    counts: Any                 # `[N]` int32: tokens per destination domain (hybrid_report reads them)
    row_args: Dict[str, Any]    # the row arguments hybrid_pack and hybrid_unpack share (x, scales, top-k, weights)
    pipelined: bool             # P2 (`HybridEP.pipeline`, read once per call)
    split: Optional[SplitRows]  # P2: the split row layout, else None


class RailCounts(NamedTuple):
    """Tokens per peer domain each way after a CPU sync (`HybridEP._notify`), else None each (static sizes)."""
    send: Optional[Dict[int, int]]
    recv: Optional[Dict[int, int]]


class UnionRows(NamedTuple):
    """The forwarder's union input of N * M rows (`HybridEP._unpack`), the intranode dispatch's input."""
    x: Any                      # `[N * M, hidden]` (the dispatch's x dtype)
    sf: Any                     # `[N * M, num_sf]` scales (FP8), else None
    topk: Any                   # `[N * M, K]` int64, domain-relative expert ids (-1 elsewhere)
    weights: Any                # `[N * M, K]` float32, or None without topk_weights
    fwd: Any                    # int32 allocation of fwd_src, fwd_count (and P2's rows-ready counter)
    fwd_src: Any                # `[N * M]` int32: the source token of each union row
    fwd_count: Any              # `[N]` int32: rows received per source domain
    guard: Optional[Tuple[int, int, int]]   # P2: `EP.ready_guard` (counter address, M, SMs left free), else None
    side: Any                   # P2: the payload's side stream (joins the caller's after the intranode dispatch)
