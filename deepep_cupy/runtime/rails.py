"""Rails between scale-up domains, and the transports that move bytes along them.

A rail is the set of ranks with the same scale-up index in every domain: with N domains of R ranks (node-major,
rank g = n * R + r), rail r = ranks r, R + r, ..., (N - 1) * R + r, and a rank's rail rank is its domain index n.
Hybrid mode crosses domains only along rails (DeepEP's "RDMA rank peers", NCCL's `ncclTeamRail`): each GPU talks to
the GPU with the same local index on every other node, which is also the NIC-aligned pairing.

Transports (`ScaleoutTransport`): a rail exchange moves, for every rail peer, one byte range of this rank's buffer to
the peer and one byte range from it, stream-ordered, as a `RailPlan` says:

- `NcclRailTransport` (`runtime/rail_nccl.py`): one NCCL communicator per rail (N ranks, no world communicator),
  made from a unique id that the rail's first rank (domain 0) creates and the host process group carries, and
  connected to every rail peer at construction; each chunk of a plan is one NCCL group of `send`/`recv` of bytes on
  the given stream. Every rail peer issues the same number of groups, and between every pair the same operations in
  the same order with the same sizes (a transfer always carries its 16-byte header, so none is empty): the matching
  NCCL needs, kept by construction (`plan_exchange`) rather than by luck. `abort()` is the timeout path
  (`ncclCommAbort`: pending NCCL work returns, no hang).
- `IpcLoopbackTransport`: a test double for more domains than GPUs on one host: the rail peers map each other's
  buffer (CUDA IPC), and each rank pulls what its peers packed for it with `cudaMemcpyAsync`, between stream-ordered
  epoch flags (ready before the copies, consumed after) that an injected `StreamSignals` writes and waits for.

Nothing here runs a kernel: the loopback's signals are injected by the feature layer (features/hybrid/__init__.py
lists the kernels), and NCCL is reached through `cupy.cuda.nccl` (or any object with its methods, for tests).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from .group import ProcessGroup
from .sizes import ceil_div

HEADER_BYTES = 16          # every transfer starts with its header: int32 [count, epoch, kind, 0]
FLAG_STRIDE = 128          # bytes between the loopback's epoch words
FLAGS_BYTES = 4096         # the loopback's flags area: its epoch, ready [N], consumed [N]


@dataclass(frozen=True)
class RailTopology:
    """This rank's place among the domains and its rail.

    Attributes:
        num_ranks: W = N * R; rank: this rank.
        num_domains: N; num_scaleup_ranks: R.
        domain_idx: this rank's domain (its rank in its rail communicator).
        scaleup_idx: this rank's scale-up index (which rail it is on).
        rail_ranks: global ranks of this rail, in domain order.
    """
    num_ranks: int
    rank: int
    num_domains: int
    num_scaleup_ranks: int
    domain_idx: int
    scaleup_idx: int
    rail_ranks: Tuple[int, ...]

    @property
    def peer_domains(self) -> List[int]:
        """The other domains of the rail, ascending (the order every rail operation walks them)."""
        return [m for m in range(self.num_domains) if m != self.domain_idx]

    def rail_rank_of(self, domain: int) -> int:
        """Global rank of this rail's member in `domain`."""
        return self.rail_ranks[domain]


def rail_topology(num_ranks: int, num_scaleup_ranks: int, rank: int,
                  host_of_rank: Optional[Sequence[Any]] = None) -> RailTopology:
    """The rails of a node-major job, checking the layout.

    Args:
        num_ranks: W; num_scaleup_ranks: R (must divide W); rank: this rank.
        host_of_rank: every rank's host (any comparable value), or None to skip the layout check. Domains must be
            consecutive rank blocks on one host each, hosts in rank order (several domains may share a host when
            `DEEPEP_CUPY_SCALEUP_SIZE` shrinks them).

    Raises:
        ValueError: R does not divide W, or the ranks are not node-major (the message names the ranks and the fix).
    """
    if num_scaleup_ranks < 1 or num_ranks % num_scaleup_ranks:
        raise ValueError(f'{num_ranks} ranks cannot form scale-up domains of {num_scaleup_ranks} ranks')
    if not 0 <= rank < num_ranks:
        raise ValueError(f'rank {rank} is not in [0, {num_ranks})')
    num_domains = num_ranks // num_scaleup_ranks
    if host_of_rank is not None:
        hosts = list(host_of_rank)
        if len(hosts) != num_ranks:
            raise ValueError(f'host_of_rank has {len(hosts)} entries for {num_ranks} ranks')
        order: List[Any] = []
        for g, h in enumerate(hosts):
            first = g - g % num_scaleup_ranks
            if h != hosts[first]:
                raise ValueError(
                    f'ranks must be laid out node-major: domain {g // num_scaleup_ranks} (ranks {first}..'
                    f'{first + num_scaleup_ranks - 1}) must be on one host, but rank {g} is on {h!r} and rank {first} '
                    f'on {hosts[first]!r}. Launch R = {num_scaleup_ranks} consecutive ranks per node (torchrun '
                    f'--nnodes N --nproc-per-node R, mpirun --map-by ppr:R:node, srun --ntasks-per-node R)')
            if not order or order[-1] != h:
                if h in order:
                    raise ValueError(f'ranks must be laid out node-major: host {h!r} holds ranks that are not '
                                     f'consecutive (rank {g} comes back to it after another host)')
                order.append(h)
    n, r = divmod(rank, num_scaleup_ranks)
    rails = tuple(m * num_scaleup_ranks + r for m in range(num_domains))
    return RailTopology(num_ranks, rank, num_domains, num_scaleup_ranks, n, r, rails)


class RailGroup(ProcessGroup):
    """A rail's view of the world's host collectives: every world rank calls each collective at the same time (each
    for its own rail), and gets back its rail members' values. Used to bootstrap per-rail resources (NCCL ids, the
    loopback's IPC mappings) without sub-communicators."""

    backend = 'rail'

    def __init__(self, world: ProcessGroup, members: Sequence[int]):
        members = tuple(members)
        if world.rank not in members:
            raise ValueError(f'rank {world.rank} is not a member of the rail {members}')
        super().__init__(members.index(world.rank), len(members))
        self.world, self.members = world, members
        self.host_of_rank = [world.host_of_rank[g] for g in members]
        self.host_idx = self.host_of_rank[self.rank]
        self.num_hosts = len(set(self.host_of_rank))

    def allgather_object(self, obj, timeout=None):
        values = self.world.allgather_object(obj, timeout=timeout)
        return [values[g] for g in self.members]


def exchange_rail_unique_ids(world: ProcessGroup, rails: RailTopology, make_id: Callable[[], Any]) -> Any:
    """The NCCL unique id of this rank's rail: the rail's first rank (domain 0) makes it, one world all-gather
    carries every rail's id (a host collective: every world rank calls it once)."""
    uid = make_id() if rails.domain_idx == 0 else None
    ids = world.allgather_object(uid)
    return ids[rails.rail_ranks[0]]


# ---- exchange plans ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RailOp:
    """One transfer of a plan, in bytes from the start of the rank's buffer.

    `offset` is where this rank reads (send) or writes (recv); `peer_offset` is the matching range at the peer
    (its receive region for a send, its send region for a recv): symmetric buffers give both ends the same layout."""
    chunk: int
    peer: int              # the peer's domain (its rank in the rail communicator)
    kind: str              # 'send' or 'recv'
    offset: int
    peer_offset: int
    num_bytes: int


@dataclass(frozen=True)
class RailPlan:
    """A rail exchange: `num_chunks` NCCL groups, each holding `ops` of its chunk in order (peers ascending, send
    before recv)."""
    phase: str
    num_chunks: int
    ops: Tuple[RailOp, ...]

    def chunk_ops(self, chunk: int) -> List[RailOp]:
        return [op for op in self.ops if op.chunk == chunk]

    @property
    def peers(self) -> List[int]:
        return sorted({op.peer for op in self.ops})


class RailAreasLike(Protocol):
    """Where each peer's send and receive regions are (features/hybrid/plan.py `RailArea`)."""
    region_bytes: int

    def send_region(self, self_domain: int, peer_domain: int) -> int: ...

    def recv_region(self, self_domain: int, peer_domain: int) -> int: ...


def plan_exchange(rails: RailTopology, areas: RailAreasLike, phase: str, send_payload: Dict[int, int],
                  recv_payload: Dict[int, int], chunk_bytes: int = 0) -> RailPlan:
    """The plan of one rail exchange.

    Args:
        rails: this rank's rails.
        areas: the rail area's regions (`HybridLayout.rail_areas(...)`).
        phase: `'notify'`, `'dispatch'` or `'combine'` (names timeouts).
        send_payload, recv_payload: payload bytes (after the header) to / from every peer domain. Static (no CPU
            sync, CUDA graphs): the region's capacity for every peer; exact (CPU sync): count * message bytes, which
            the peer knows too (the notify gave both ends every count between them).
        chunk_bytes: split every transfer in chunks of this many bytes (a multiple of 16; 0: one chunk). Every rank
            issues `ceil(region_bytes / chunk_bytes)` groups; chunk c of a pair exists at both ends iff its
            transfer reaches byte c * chunk_bytes.

    Raises:
        ValueError: a payload does not fit the region, a peer is missing, or a chunk size is not a multiple of 16.
    """
    peers = rails.peer_domains
    for name, payload in (('send_payload', send_payload), ('recv_payload', recv_payload)):
        if sorted(payload) != peers:
            raise ValueError(f'{name} must name every peer domain {peers}, got {sorted(payload)}')
        for m, nbytes in payload.items():
            if nbytes < 0 or nbytes % 16 or HEADER_BYTES + nbytes > areas.region_bytes:
                raise ValueError(f'{phase}: {name}[{m}] = {nbytes} bytes must be a multiple of 16 fitting the '
                                 f'{areas.region_bytes}-byte region after its {HEADER_BYTES}-byte header')
    if chunk_bytes < 0 or chunk_bytes % 16:
        raise ValueError(f'chunk_bytes must be a non-negative multiple of 16, got {chunk_bytes}')
    step = chunk_bytes or areas.region_bytes
    num_chunks = ceil_div(areas.region_bytes, step)
    n = rails.domain_idx
    ops = []
    for c in range(num_chunks):
        begin = c * step
        for m in peers:
            for kind, total, offset, peer_offset in (
                    ('send', HEADER_BYTES + send_payload[m], areas.send_region(n, m), areas.recv_region(m, n)),
                    ('recv', HEADER_BYTES + recv_payload[m], areas.recv_region(n, m), areas.send_region(m, n))):
                if begin < total:
                    size = min(step, total - begin)
                    ops.append(RailOp(c, m, kind, offset + begin, peer_offset + begin, size))
    return RailPlan(phase, num_chunks, tuple(ops))


def plan_ranges(rails: RailTopology, phase: str, sends: Dict[int, Sequence[Tuple[int, int, int]]],
                recvs: Dict[int, Sequence[Tuple[int, int, int]]]) -> RailPlan:
    """A one-chunk plan from explicit byte ranges (features whose rail data is not in `RailAreas` regions, e.g. the
    all-gather / reduce-scatter area of the data region).

    Args:
        rails: this rank's rails.
        phase: names timeouts.
        sends, recvs: per peer domain, `(offset, peer_offset, num_bytes)` ranges in order (offsets from the start of
            the rank's buffer; the buffers are symmetric, so the peer's range of a send is where it receives, and of a
            recv where it sends). Both ends must list the matching ranges in the same order; empty ranges are dropped
            at both ends alike (the sizes are known everywhere), so no zero-byte NCCL operation is issued.

    Raises:
        ValueError: a peer is not a peer domain of this rail, or a range is negative.
    """
    peers = rails.peer_domains
    ops = []
    for m in peers:
        for kind, ranges in (('send', sends.get(m, ())), ('recv', recvs.get(m, ()))):
            for offset, peer_offset, num_bytes in ranges:
                if offset < 0 or peer_offset < 0 or num_bytes < 0:
                    raise ValueError(f'{phase}: {kind} range ({offset}, {peer_offset}, {num_bytes}) for domain {m} '
                                     f'is negative')
                if num_bytes:
                    ops.append(RailOp(0, m, kind, int(offset), int(peer_offset), int(num_bytes)))
    for name, table in (('sends', sends), ('recvs', recvs)):
        extra = sorted(set(table) - set(peers))
        if extra:
            raise ValueError(f'{phase}: {name} name domains {extra} that are not rail peers {peers}')
    return RailPlan(phase, 1, tuple(ops))


# ---- transports ----------------------------------------------------------------------------------------------------
class ScaleoutTransport:
    """Moves a rail plan's bytes between rail peers, stream-ordered.

    Attributes:
        rails: this rank's `RailTopology`.
        base_ptr: device address of this rank's buffer (plan offsets count from it).
    """

    name = 'abstract'

    def __init__(self, rails: RailTopology, base_ptr: int):
        self.rails, self.base_ptr = rails, int(base_ptr)
        self.aborted = False

    def exchange(self, plan: RailPlan, stream: Any) -> None:
        """Enqueue `plan` on `stream` (an object with `.ptr`); every rail peer must enqueue the same plans in the
        same order."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise if the transport failed (host waits call it while they poll, and once the wait is over: a wait
        that a timeout's abort released has read nothing valid)."""
        self._check_usable()

    def abort(self) -> None:
        """Give up on pending transfers (the timeout path); the transport is unusable afterwards."""
        self.aborted = True

    def destroy(self) -> None:
        """Release the transport's resources (after the streams finished its work)."""

    def _check_usable(self) -> None:
        if self.aborted:
            raise RuntimeError(f'the {self.name} rail transport was aborted after a timeout; build a new buffer')

    def timeout_error(self, phase: str, peer_domain: int, seconds: float) -> TimeoutError:
        """Abort, and the error to raise: which phase waited for which rail peer (global rank, domain, index)."""
        self.abort()
        peer = self.rails.rail_rank_of(peer_domain)
        return TimeoutError(f'rank {self.rails.rank}: hybrid {phase}: rail peer rank {peer} (domain {peer_domain}, '
                            f'scale-up index {self.rails.scaleup_idx}) did not arrive within {seconds:.1f} s; the '
                            f'{self.name} rail transport was aborted')


class StreamSignals(Protocol):
    """Stream-ordered epoch flags for the loopback transport (GPU kernels in the feature layer; fakes in tests).

    The exchange epoch lives in device memory (so CUDA graph replays advance it): `begin` increments it; `signal`
    stores it, with release semantics at system scope, into each address; `wait` spins, bounded, until each address
    holds at least the epoch, and on timeout records `phase` and the peer in the buffer's error record."""

    def begin(self, stream: Any) -> None: ...

    def signal(self, addrs: Sequence[int], stream: Any) -> None: ...

    def wait(self, addrs: Sequence[int], peers: Sequence[int], phase: str, stream: Any) -> None: ...


def _memcpy_async(dst: int, src: int, num_bytes: int, stream: Any) -> None:
    import cupy
    rt = cupy.cuda.runtime
    rt.memcpyAsync(dst, src, num_bytes, rt.memcpyDefault, stream.ptr)


class IpcLoopbackTransport(ScaleoutTransport):
    """The rail hop as copies between IPC-mapped buffers (a stand-in for NCCL when ranks share GPUs).

    Per exchange (epoch e): signal ready[me] = e at every peer (my send regions are packed); per peer, wait for
    ready[peer] = e here, then copy each of the peer's send ranges for me into my receive ranges (pull); signal
    consumed[me] = e at every peer; wait for consumed[peer] = e here (nobody reads my send regions any more, as after
    an NCCL group). Flags, uint32 words FLAG_STRIDE bytes apart at `flags_offset`: word 0 is this rank's exchange
    epoch (`StreamSignals.begin` increments it on the device), word 1 + m is ready[m], word 1 + N + m consumed[m].

    Args:
        rails: this rank's rails.
        peer_bases: every rail member's buffer as mapped in this process (index = domain; its own base included).
        flags_offset: where the flag words are (`HybridLayout.rail_flags_offset`).
        signals: the `StreamSignals`.
        memcpy: `(dst, src, num_bytes, stream)`; default `cudaMemcpyAsync` (device to device, UVA).
    """

    name = 'IPC loopback'

    def __init__(self, rails: RailTopology, peer_bases: Sequence[int], flags_offset: int, signals: StreamSignals,
                 memcpy: Optional[Callable[[int, int, int, Any], None]] = None):
        if len(peer_bases) != rails.num_domains:
            raise ValueError(f'peer_bases must hold one base per domain ({rails.num_domains}), got {len(peer_bases)}')
        if (1 + 2 * rails.num_domains) * FLAG_STRIDE > FLAGS_BYTES:
            raise ValueError(f'the loopback transport holds the flags of at most '
                             f'{(FLAGS_BYTES // FLAG_STRIDE - 1) // 2} domains, got {rails.num_domains}')
        super().__init__(rails, peer_bases[rails.domain_idx])
        self.peer_bases = [int(b) for b in peer_bases]
        self.flags_offset = int(flags_offset)
        self.signals = signals
        self.memcpy = memcpy or _memcpy_async
        # Called after each chunk's copies with (chunk, stream), as `NcclRailTransport.after_chunk` (P2 pipelining).
        self.after_chunk: Optional[Callable[[int, Any], None]] = None

    @property
    def epoch_word(self) -> int:
        """Address of this rank's exchange epoch (what `StreamSignals.begin` increments and `signal` stores)."""
        return self.base_ptr + self.flags_offset

    def ready_flag(self, owner_domain: int, of_domain: int) -> int:
        """Address of ready[of_domain] in `owner_domain`'s buffer."""
        return self.peer_bases[owner_domain] + self.flags_offset + (1 + of_domain) * FLAG_STRIDE

    def consumed_flag(self, owner_domain: int, of_domain: int) -> int:
        """Address of consumed[of_domain] in `owner_domain`'s buffer."""
        return (self.peer_bases[owner_domain] + self.flags_offset +
                (1 + self.rails.num_domains + of_domain) * FLAG_STRIDE)

    def exchange(self, plan: RailPlan, stream: Any) -> None:
        self._check_usable()
        me, peers = self.rails.domain_idx, self.rails.peer_domains
        phase = f'rail {plan.phase}'
        self.signals.begin(stream)
        self.signals.signal([self.ready_flag(p, me) for p in peers], stream)
        waited = set()
        for c in range(plan.num_chunks):
            for op in plan.chunk_ops(c):
                if op.kind != 'recv':
                    continue
                if op.peer not in waited:
                    self.signals.wait([self.ready_flag(me, op.peer)], [op.peer], phase, stream)
                    waited.add(op.peer)
                self.memcpy(self.base_ptr + op.offset, self.peer_bases[op.peer] + op.peer_offset, op.num_bytes,
                            stream)
            if self.after_chunk is not None:
                self.after_chunk(c, stream)
        self.signals.signal([self.consumed_flag(p, me) for p in peers], stream)
        self.signals.wait([self.consumed_flag(me, p) for p in peers], peers, phase, stream)
