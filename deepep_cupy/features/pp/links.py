"""PP across scale-up domains (hybrid mode): how each ring neighbour is reached, the PP feature's peer table, and the
NCCL pair links (the kernels are kernels_cu/pp.cu; the launch path is feature.py).

With N domains of R ranks (rank g = n * R + r) the ring g -> g + 1 (mod W = N * R) leaves a domain at its last rank:
rank n * R + R - 1 and rank (n + 1) * R are neighbours in different domains, and generally on different rails (scale-up
indices R - 1 and 0), so the hybrid rails do not join them. Each ring pair gets a link of its own:

- `nvlink`: both ranks in one domain; the buffer's IPC mapping, the protocol of kernels_cu/pp.cu as is.
- `loopback`: different domains on one host (the test stand-in for NCCL, picked like the hybrid rails:
  `DEEPEP_CUPY_RAIL_TRANSPORT`, auto = loopback when the two ranks share a GPU): the rank maps the neighbour's whole
  symmetric buffer over CUDA IPC and runs the same NVLink protocol through it (one host collective at
  `pp_set_config`: every rank shares its IPC handle).
- `nccl`: different domains, NCCL point-to-point on a 2-rank communicator per DIRECTED pair (sender = NCCL rank 0,
  receiver = rank 1; no world communicator), made collectively at `pp_set_config` (one world all-gather of the unique
  ids the senders made, then every rank initialises its communicators in one global order, so the blocking
  initialisations cannot wait on each other in a cycle). One communicator per direction keeps each communicator's
  operations one-way and in FIFO order: NCCL serialises the work of a communicator, so a send blocked until its peer
  receives would otherwise hold back a receive in the other direction (with 2 domains x 1 rank both ranks are each
  other's previous AND next rank, and both send first). The transfers run on one side stream per directed pair; the
  communication stream only runs bounded waits (kernels_cu/pp.cu has the sequence), so a missing neighbour ends in a
  `TimeoutError` naming the phase and the peer, after which the communicators are aborted (no hang), and `destroy`
  releases them. Every message moves `HEADER_BYTES + slot_bytes` (the size travels in the header, so the receiver
  posts its receive before it knows the size, and a size mismatch is reported by the receiver's next call as over
  NVLink); smaller tensors cost the full slot.

Peer table: `peer_bases` of the PP kernels in hybrid mode is the feature's own uint64 table of `2 W - 1` entries whose
pointer is at entry `W - 1`, indexed by `global rank - first rank of this domain` (negative for lower domains): this
rank and its domain peers keep their scale-up indices (the error sink and the error record's rank base work as in one
domain) and a timeout record names global ranks after the buffer adds the domain's first rank. A cross-domain
neighbour's entry is its IPC-mapped buffer (loopback) or this rank's outbox for it (nccl: the send kernel packs the
message there, NCCL ships it).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...runtime.sizes import align
from .plan import CTRL_BYTES, CTRL_OFFSET, HEADER_BYTES, HEADER_REGION_ALIGNMENT, PPLayout, neighbour_slot_idx

LINK_NVLINK, LINK_LOOPBACK, LINK_NCCL = 'nvlink', 'loopback', 'nccl'


@dataclass(frozen=True)
class Neighbour:
    """One ring neighbour of this rank.

    Attributes:
        peer: its global rank; slot_idx: its neighbour index here (0 previous, 1 next); slot_idx_at_peer: this rank's
        neighbour index there; kind: `nvlink`, `loopback` or `nccl`; table_idx: its entry in the peer table
        (`peer - first rank of this rank's domain`).
    """
    peer: int
    slot_idx: int
    slot_idx_at_peer: int
    kind: str
    table_idx: int

    @property
    def crosses(self) -> bool:
        return self.kind != LINK_NVLINK


def link_kind(a: int, b: int, num_scaleup_ranks: int, gpu_of_rank: Sequence[Any], setting: str) -> str:
    """How ring neighbours `a` and `b` are joined: `nvlink` inside a domain, else what `DEEPEP_CUPY_RAIL_TRANSPORT` =
    `setting` picks for their GPUs (as NCCL tells them apart: `Topology.nccl_gpu_ids`), by the rule of the hybrid
    rails (features/hybrid/plan.py `choose_transport`): auto = loopback when they share a GPU of one NCCL host (NCCL
    refuses that), else NCCL."""
    if a // num_scaleup_ranks == b // num_scaleup_ranks:
        return LINK_NVLINK
    shared = gpu_of_rank[a] == gpu_of_rank[b]
    if setting == LINK_NCCL and shared:
        raise ValueError(f'DEEPEP_CUPY_RAIL_TRANSPORT=nccl, but ring neighbours {a} and {b} (different domains) share '
                         f'a GPU and one NCCL host, which NCCL refuses: give each domain its own NCCL_HOSTID, or use '
                         f'loopback (or auto) for ranks that share GPUs')
    if setting in (LINK_NCCL, LINK_LOOPBACK):
        return setting
    if setting != 'auto':
        raise ValueError(f'rail transport must be auto, nccl or loopback, got {setting!r}')
    return LINK_LOOPBACK if shared else LINK_NCCL


def ring_neighbours(num_ranks: int, num_scaleup_ranks: int, rank: int, gpu_of_rank: Sequence[Any],
                    setting: str) -> Dict[int, Neighbour]:
    """This rank's ring neighbours by global rank (one entry when there are 2 ranks).

    Raises:
        ValueError: fewer than 2 ranks, R does not divide W, or an invalid transport setting.
    """
    if num_ranks < 2:
        raise ValueError(f'PP send/recv needs at least 2 ranks (a ring neighbour), the group has {num_ranks}')
    if num_scaleup_ranks < 1 or num_ranks % num_scaleup_ranks:
        raise ValueError(f'{num_ranks} ranks cannot form scale-up domains of {num_scaleup_ranks} ranks')
    if len(gpu_of_rank) != num_ranks:
        raise ValueError(f'gpu_of_rank has {len(gpu_of_rank)} entries for {num_ranks} ranks')
    base = rank - rank % num_scaleup_ranks
    out = {}
    for peer in ((rank - 1) % num_ranks, (rank + 1) % num_ranks):
        out[peer] = Neighbour(peer, neighbour_slot_idx(rank, peer, num_ranks),
                              neighbour_slot_idx(peer, rank, num_ranks),
                              link_kind(rank, peer, num_scaleup_ranks, gpu_of_rank, setting), peer - base)
    return out


def crossing_pairs(num_ranks: int, num_scaleup_ranks: int, gpu_of_rank: Sequence[Any], setting: str
                   ) -> List[Tuple[int, int, str]]:
    """Every directed ring pair `(src, dst, kind)` that crosses domains, in the global order every rank creates the
    NCCL communicators in: by `(min(src, dst), max(src, dst), src)`."""
    pairs = set()
    for s in range(num_ranks):
        for d in ((s - 1) % num_ranks, (s + 1) % num_ranks):
            if d != s and s // num_scaleup_ranks != d // num_scaleup_ranks:
                pairs.add((s, d))
    ordered = sorted(pairs, key=lambda p: (min(p), max(p), p[0]))
    return [(s, d, link_kind(s, d, num_scaleup_ranks, gpu_of_rank, setting)) for s, d in ordered]


def table_entries(num_ranks: int, base_rank: int, bases: Dict[int, int]) -> np.ndarray:
    """The peer table: uint64 `[2 W - 1]`, entry `W - 1 + (g - base_rank)` = `bases[g]` (0 elsewhere); kernels get the
    address of entry `W - 1` (see the module docstring)."""
    table = np.zeros(2 * num_ranks - 1, dtype=np.uint64)
    for g, ptr in bases.items():
        if not 0 <= g < num_ranks:
            raise ValueError(f'rank {g} is not in [0, {num_ranks})')
        table[num_ranks - 1 + g - base_rank] = ptr
    return table


@dataclass(frozen=True)
class Outbox:
    """A sender's local staging area for one NCCL neighbour, laid out so that `pp_send_impl` writes it as if it were
    the receiver's buffer with `src_slot_idx_at_dst = 0`: its control words (written, never read) at the workspace
    offset, then `num_inflight` headers and slots."""
    num_max_tensor_bytes: int
    num_inflight: int

    @property
    def slot_bytes(self) -> int:
        return PPLayout(self.num_max_tensor_bytes, self.num_inflight, 0).slot_bytes

    @property
    def headers_offset(self) -> int:
        return align(CTRL_OFFSET + CTRL_BYTES, HEADER_REGION_ALIGNMENT)

    @property
    def slots_offset(self) -> int:
        return self.headers_offset + align(self.num_inflight * HEADER_BYTES, HEADER_REGION_ALIGNMENT)

    @property
    def num_bytes(self) -> int:
        return self.slots_offset + self.num_inflight * self.slot_bytes

    def header(self, slot: int) -> int:
        return self.headers_offset + slot * HEADER_BYTES

    def slot(self, slot: int) -> int:
        return self.slots_offset + slot * self.slot_bytes


def nccl_recv_offsets(layout: PPLayout, slot_idx: int) -> Tuple[int, int]:
    """`(headers_offset, slots_offset)` to give `pp_recv_impl` (num_inflight = 1) for a message NCCL delivered into
    this rank's slot `[slot_idx][0]`: the kernel adds `slot_idx` header / slot strides."""
    return (layout.header_offset(slot_idx, 0) - slot_idx * HEADER_BYTES,
            layout.slot_offset(slot_idx, 0) - slot_idx * layout.slot_bytes)


def next_cursor(stored: int, num_inflight: int) -> Tuple[int, int]:
    """`(slot used, value stored after)` of a cursor word (kernels_cu/pp.cu: `slot = stored % n`, then
    `stored = (slot + 1) % n`): the host's mirror of the device cursor of an NCCL send."""
    slot = stored % num_inflight
    return slot, (slot + 1) % num_inflight


class NcclPairLinks:
    """This rank's NCCL communicators (one per directed cross-domain pair it is in) and their side streams.

    Args:
        group: the world's host process group (every world rank calls the constructor: a host collective).
        rank: this rank.
        pairs: every directed pair `(src, dst)` over NCCL, in `crossing_pairs` order (the same list on every rank).
        nccl: `cupy.cuda.nccl` or a fake with `get_unique_id`, `NcclCommunicator`, `groupStart`, `groupEnd`,
            `NCCL_UINT8`.
        make_stream: a new side stream (an object with `.ptr` and `.wait_event(event)`), one per pair.
        timeout: host collective timeout.
        scratch_ptr: device address of 2 bytes the connecting exchange moves (default: allocated for it).
    """

    def __init__(self, group, rank: int, pairs: Sequence[Tuple[int, int]], nccl: Any = None,
                 make_stream: Optional[Callable[[], Any]] = None, timeout: Optional[float] = None,
                 scratch_ptr: Optional[int] = None):
        if nccl is None:
            from ...runtime.preflight import nccl as _nccl
            nccl = _nccl()
        if make_stream is None:
            import cupy
            make_stream = lambda: cupy.cuda.Stream(non_blocking=True)    # noqa: E731
        self.nccl, self.rank = nccl, rank
        self.aborted = False
        self.comms: Dict[Tuple[int, int], Any] = {}
        self.streams: Dict[Tuple[int, int], Any] = {}
        mine = [tuple(p) for p in pairs if rank in p]
        ids = {p: nccl.get_unique_id() for p in mine if p[0] == rank}
        everyone = group.allgather_object(ids, timeout=timeout)
        try:
            for s, d in mine:           # the global order, restricted to this rank's pairs
                uid = everyone[s][(s, d)]
                self.comms[(s, d)] = nccl.NcclCommunicator(2, uid, 0 if rank == s else 1)
                self.streams[(s, d)] = make_stream()
            self._connect(mine, scratch_ptr)
        except BaseException:
            self.abort()
            raise

    def _connect(self, mine: Sequence[Tuple[int, int]], scratch_ptr: Optional[int]) -> None:
        """Open each communicator's connection now, pair by pair in the global order: one byte from sender to
        receiver, waited for. NCCL connects a peer lazily inside the `groupEnd` of the first transfer, and that host
        call blocks until the peer calls too; with one communicator per direction, rank 0's first send (on 0->1)
        and rank 1's first send (on 1->0) would each block for the other: the PP hang over NCCL links on 1xH100.
        In the global order, the first unconnected pair always finds both its ranks at it, so this cannot deadlock.
        `scratch_ptr`: 2 bytes of device memory (default: allocated here for the duration)."""
        if not mine:
            return
        own = None
        if scratch_ptr is None:
            import cupy
            own = cupy.zeros(2, dtype=cupy.uint8)
            scratch_ptr = own.data.ptr
        nccl, uint8 = self.nccl, self.nccl.NCCL_UINT8
        for s, d in mine:
            comm, stream = self.comms[(s, d)], self.streams[(s, d)]
            nccl.groupStart()
            try:
                if self.rank == s:
                    comm.send(scratch_ptr, 1, uint8, 1, stream.ptr)
                else:
                    comm.recv(scratch_ptr + 1, 1, uint8, 0, stream.ptr)
            finally:
                nccl.groupEnd()
            stream.synchronize()
        del own

    def _transfer(self, pair: Tuple[int, int], is_send: bool, ranges: Sequence[Tuple[int, int]], after,
                  bump: Callable[[Any], None]) -> Any:
        if self.aborted:
            raise RuntimeError('the PP NCCL links were aborted after a timeout; build a new buffer')
        comm, stream = self.comms[pair], self.streams[pair]
        stream.wait_event(after)
        nccl, uint8 = self.nccl, self.nccl.NCCL_UINT8
        nccl.groupStart()
        try:
            for ptr, num_bytes in ranges:
                if is_send:
                    comm.send(ptr, num_bytes, uint8, 1, stream.ptr)
                else:
                    comm.recv(ptr, num_bytes, uint8, 0, stream.ptr)
        finally:
            nccl.groupEnd()
        bump(stream)
        return stream

    def send(self, dst: int, ranges: Sequence[Tuple[int, int]], after, bump: Callable[[Any], None]) -> Any:
        """On the pair's side stream, after event `after`: one NCCL group sending each `(ptr, num_bytes)` to `dst`,
        then `bump(stream)`. Returns the side stream."""
        return self._transfer((self.rank, dst), True, ranges, after, bump)

    def recv(self, src: int, ranges: Sequence[Tuple[int, int]], after, bump: Callable[[Any], None]) -> Any:
        """The same, receiving from `src` into each range."""
        return self._transfer((src, self.rank), False, ranges, after, bump)

    def idle(self) -> bool:
        """Whether every side stream finished its work (`stream.done`)."""
        return all(getattr(s, 'done', True) for s in self.streams.values())

    def abort(self) -> None:
        """`ncclCommAbort` on every communicator: pending transfers return, the links are unusable."""
        if not self.aborted:
            self.aborted = True
            from ...runtime.nccl import abort_bounded
            for (s, d), comm in self.comms.items():
                abort_bounded(comm, f'the PP link {s}->{d}')

    def destroy(self) -> None:
        """Release the communicators (after their work finished, else `abort` first). Idempotent."""
        comms, self.comms = self.comms, {}
        if not self.aborted:
            for comm in comms.values():
                comm.destroy()
        self.streams = {}


class HybridPeers:
    """What the PP feature of a buffer over several domains holds: its neighbours, the peer table on the device, the
    loopback IPC mappings, and for NCCL neighbours the outboxes and `NcclPairLinks` (made collectively by the first
    `pp_set_config`; `set_layout` by every one).

    Args:
        buf: the buffer (`group`, `topology.pci_bus_ids`, `sym.base` / `sym.peer_bases`, ranks and sizes).
        setting: `DEEPEP_CUPY_RAIL_TRANSPORT` (`auto`, `nccl` or `loopback`; checked equal on every rank).
        nccl, make_stream: for `NcclPairLinks` (tests pass fakes).
        to_device: `numpy array -> (device address, keep-alive)`; alloc: `num_bytes -> (device address, keep-alive)`;
        ipc_handle: `base -> bytes`; ipc_open: `bytes -> address`; ipc_close: `address -> None` (default: CuPy / the
        CUDA runtime).
    """

    def __init__(self, buf, setting: str, nccl: Any = None, make_stream: Optional[Callable[[], Any]] = None,
                 to_device: Optional[Callable] = None, alloc: Optional[Callable] = None,
                 ipc_handle: Optional[Callable] = None, ipc_open: Optional[Callable] = None,
                 ipc_close: Optional[Callable] = None):
        self.num_ranks, self.rank = buf.num_ranks, buf.rank_idx
        R = buf.num_scaleup_ranks
        self.base_rank = self.rank - self.rank % R
        self._to_device, self._alloc = to_device or _to_device, alloc or _alloc
        self._ipc_close = ipc_close or _ipc_close
        timeout = buf.num_cpu_timeout_secs
        buf.group.check_same('DEEPEP_CUPY_RAIL_TRANSPORT (PP links between domains)', setting, timeout=timeout)
        gpus = list(buf.topology.nccl_gpu_ids)
        # Every pair first: an invalid setting (NCCL on a shared GPU) raises on every rank, not only at the pair.
        pairs = crossing_pairs(self.num_ranks, R, gpus, setting)
        self.neighbours = ring_neighbours(self.num_ranks, R, self.rank, gpus, setting)
        self.own_base = int(buf.sym.base)
        self.bases: Dict[int, int] = {self.base_rank + i: int(b) for i, b in enumerate(buf.sym.peer_bases)}
        self._opened: List[int] = []
        self.links: Optional[NcclPairLinks] = None
        self.outboxes: Dict[int, Tuple[Outbox, int, Any]] = {}
        self.table_ptr, self._table = 0, None
        if any(kind == LINK_LOOPBACK for _, _, kind in pairs):     # the same decision on every rank
            handles = buf.group.allgather_object((ipc_handle or _ipc_handle)(self.own_base), timeout=timeout)
            try:
                for nb in self.neighbours.values():
                    if nb.kind == LINK_LOOPBACK:
                        ptr = (ipc_open or _ipc_open)(handles[nb.peer])
                        self._opened.append(ptr)
                        self.bases[nb.peer] = ptr
            except BaseException:
                self.release(True, 0)
                raise
        nccl_pairs = [(s, d) for s, d, kind in pairs if kind == LINK_NCCL]
        if nccl_pairs:
            try:
                scratch_ptr, scratch = self._alloc(2)       # for the connecting exchange only
                self.links = NcclPairLinks(buf.group, self.rank, nccl_pairs, nccl, make_stream, timeout,
                                           scratch_ptr)
                del scratch
            except BaseException:
                self.release(True, 0)
                raise

    def set_layout(self, layout: PPLayout) -> None:
        """Outboxes for the NCCL neighbours sized for `layout`, and the peer table (after every transfer finished)."""
        for nb in self.neighbours.values():
            if nb.kind == LINK_NCCL:
                box = Outbox(layout.num_max_tensor_bytes, layout.num_max_inflight_tensors)
                ptr, keep = self._alloc(box.num_bytes)
                self.outboxes[nb.peer] = (box, ptr, keep)
                self.bases[nb.peer] = ptr
        table = table_entries(self.num_ranks, self.base_rank, self.bases)
        ptr, self._table = self._to_device(table)
        self.table_ptr = ptr + (self.num_ranks - 1) * 8

    def ctrl_word(self, word: int) -> int:
        """Device address of this rank's control word `word` (kernels_cu/pp.cu)."""
        return self.own_base + CTRL_OFFSET + 4 * word

    def idle(self) -> bool:
        return self.links is None or self.links.idle()

    def abort(self) -> None:
        if self.links is not None:
            self.links.abort()

    def wait_idle(self, limit: float) -> bool:
        """Wait (host, up to `limit` seconds) for the side streams; False if they are still busy."""
        import time
        deadline = time.monotonic() + limit
        while not self.idle():
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-3)
        return True

    def release(self, failed: bool, limit: float) -> None:
        """Teardown (local): NCCL links destroyed once idle (aborted if `failed` or still busy after `limit` s), then
        the device synchronised, the loopback mappings closed and the outboxes dropped. Idempotent."""
        if self.links is not None:
            if failed or not self.wait_idle(limit):
                self.links.abort()
            self.links.destroy()
            self.links = None
        if self._opened or self.outboxes:
            _device_synchronize()
        for ptr in self._opened:
            try:
                self._ipc_close(ptr)
            except Exception:  # noqa: BLE001 (teardown, maybe at interpreter shutdown)
                pass
        self._opened = []
        self.outboxes = {}
        self._table = None
        self.table_ptr = 0


def _to_device(table: np.ndarray):
    import cupy
    arr = cupy.asarray(table)
    return int(arr.data.ptr), arr


def _alloc(num_bytes: int):
    import cupy
    arr = cupy.zeros(num_bytes, dtype=cupy.uint8)
    return int(arr.data.ptr), arr


def _ipc_handle(base: int) -> bytes:
    import cupy
    return bytes(cupy.cuda.runtime.ipcGetMemHandle(base))


def _ipc_open(handle: bytes) -> int:
    import cupy
    rt = cupy.cuda.runtime
    return int(rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess))


def _ipc_close(ptr: int) -> None:
    import cupy
    cupy.cuda.runtime.ipcCloseMemHandle(ptr)


def _device_synchronize() -> None:
    import cupy
    cupy.cuda.runtime.deviceSynchronize()
