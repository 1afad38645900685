"""Rails and their transports without a GPU (runtime/rails.py): the rail topology and its layout check, the per-rail
unique-id exchange over a fake world group, exchange plans, the NCCL transport's calls against fake communicators
(every rail peer issues matching groups, sends and receives, headers included) and the IPC loopback transport's
copies and flags against a simulated stream of every rank. Both transports then carry real bytes: the host reference
of the fused design's pack kernel writes the rail send regions (tests/references/hybrid_messages.py), the transport
moves them, the host reference of its forward kernel writes the scale-up slots, and every slot equals what the
dispatch reference says."""

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from references import hybrid_layout as hlay
from references import hybrid_messages as messages
from references import hybrid_reference as href

from deepep_cupy.runtime import rail_nccl, rails
from deepep_cupy.runtime.group import ProcessGroup


class WorldView(ProcessGroup):
    """Rank `rank` of a world whose other ranks contribute `others(r, obj)` to every all-gather."""

    def __init__(self, rank, size, others, hosts=None):
        super().__init__(rank, size)
        self.others, self.calls = others, 0
        self.host_of_rank = list(hosts) if hosts is not None else [0] * size

    def allgather_object(self, obj, timeout=None):
        self.calls += 1
        return [obj if r == self.rank else self.others(r, obj) for r in range(self.size)]


# ---- topology -------------------------------------------------------------------------------------------------------
def test_rail_topology_of_a_node_major_job():
    t = rails.rail_topology(8, 2, 5, host_of_rank=['a'] * 4 + ['b'] * 4)
    assert (t.num_domains, t.domain_idx, t.scaleup_idx) == (4, 2, 1)
    assert t.rail_ranks == (1, 3, 5, 7) and t.peer_domains == [0, 1, 3] and t.rail_rank_of(3) == 7
    # Several domains per host are fine (DEEPEP_CUPY_SCALEUP_SIZE), one domain over two hosts is not
    rails.rail_topology(4, 1, 0, host_of_rank=['a', 'a', 'b', 'b'])
    with pytest.raises(ValueError, match='node-major: domain 0 .* rank 1 is on'):
        rails.rail_topology(4, 2, 0, host_of_rank=['a', 'b', 'a', 'b'])
    with pytest.raises(ValueError, match='not consecutive'):
        rails.rail_topology(4, 1, 0, host_of_rank=['a', 'b', 'a', 'b'])
    with pytest.raises(ValueError, match='cannot form scale-up domains'):
        rails.rail_topology(6, 4, 0)


def test_rail_group_and_unique_ids():
    N, R = 3, 2
    made = []

    def others(r, obj):                   # what rank r contributes: an id when it is first on its rail
        return f'id-of-{r}'.encode() if r < R else None

    for g in range(N * R):
        world = WorldView(g, N * R, others, hosts=[r // R for r in range(N * R)])
        top = rails.rail_topology(N * R, R, g)
        uid = rails.exchange_rail_unique_ids(world, top, lambda g=g: made.append(g) or f'id-of-{g}'.encode())
        assert uid == f'id-of-{g % R}'.encode() and world.calls == 1
        group = rails.RailGroup(world, top.rail_ranks)
        assert (group.rank, group.size, group.host_of_rank) == (g // R, N, [0, 1, 2])
        assert group.allgather_object('x') == ['x' if gg == g else others(gg, 'x') for gg in top.rail_ranks]
    assert made == list(range(R))         # only each rail's first rank made an id


def test_unique_id_from_cupy_without_a_gpu():
    nccl = pytest.importorskip('cupy.cuda.nccl')
    world = WorldView(0, 2, lambda r, obj: None)
    uid = rails.exchange_rail_unique_ids(world, rails.rail_topology(2, 1, 0), nccl.get_unique_id)
    assert len(uid) == 128


# ---- plans -----------------------------------------------------------------------------------------------------------
def _layout(N, R, M=6, hidden=16, K=4):
    return hlay.HybridLayout(N, R, M, hidden, K, True, data_offset=0)


def test_plan_exchange_static_exact_and_chunked():
    lay = _layout(3, 2)
    areas = lay.rail_areas('data')
    top = rails.rail_topology(6, 2, 3)                  # domain 1, rail 1
    cap = areas.region_bytes - rails.HEADER_BYTES
    static = rails.plan_exchange(top, areas, 'dispatch', {0: cap, 2: cap}, {0: cap, 2: cap})
    assert static.num_chunks == 1 and static.peers == [0, 2]
    assert [(o.peer, o.kind, o.num_bytes) for o in static.ops] == [(0, 'send', areas.region_bytes),
                                                                    (0, 'recv', areas.region_bytes),
                                                                    (2, 'send', areas.region_bytes),
                                                                    (2, 'recv', areas.region_bytes)]
    send0 = static.ops[0]
    assert send0.offset == areas.send_region(1, 0) and send0.peer_offset == areas.recv_region(0, 1)
    exact = rails.plan_exchange(top, areas, 'dispatch', {0: 0, 2: 32}, {0: 48, 2: 0}, chunk_bytes=32)
    assert exact.num_chunks == -(-areas.region_bytes // 32)
    sizes = [(o.chunk, o.peer, o.kind, o.num_bytes) for o in exact.ops]
    # Every transfer carries at least its header; chunk c exists while the transfer reaches c * 32
    assert sizes == [(0, 0, 'send', 16), (0, 0, 'recv', 32), (0, 2, 'send', 32), (0, 2, 'recv', 16),
                     (1, 0, 'recv', 32), (1, 2, 'send', 16)]
    with pytest.raises(ValueError, match='every peer domain'):
        rails.plan_exchange(top, areas, 'dispatch', {0: 0}, {0: 0, 2: 0})
    with pytest.raises(ValueError, match='multiple of 16 fitting'):
        rails.plan_exchange(top, areas, 'dispatch', {0: cap + 16, 2: 0}, {0: 0, 2: 0})
    with pytest.raises(ValueError, match='chunk_bytes'):
        rails.plan_exchange(top, areas, 'dispatch', {0: 0, 2: 0}, {0: 0, 2: 0}, chunk_bytes=24)


# ---- a fake NCCL world ----------------------------------------------------------------------------------------------
class FakeRailNccl:
    """The NCCL of one rail: per member a module (groupStart / groupEnd) and a communicator that record calls."""
    NCCL_UINT8 = 7

    def __init__(self, num_domains):
        self.calls = {m: [] for m in range(num_domains)}
        self.aborted, self.destroyed = [], []

    def member(self, domain):
        rail = self

        class Module:
            NCCL_UINT8 = FakeRailNccl.NCCL_UINT8

            @staticmethod
            def groupStart():
                rail.calls[domain].append(('start',))

            @staticmethod
            def groupEnd():
                rail.calls[domain].append(('end',))

            @staticmethod
            def get_unique_id():
                return b'u' * 128

            @staticmethod
            def NcclCommunicator(size, uid, rank):
                assert (size, uid, rank) == (len(rail.calls), b'u' * 128, domain)
                return Comm()

        class Comm:
            def send(self, ptr, n, dtype, peer, stream):
                rail.calls[domain].append(('send', ptr, n, dtype, peer, stream))

            def recv(self, ptr, n, dtype, peer, stream):
                rail.calls[domain].append(('recv', ptr, n, dtype, peer, stream))

            def abort(self):
                rail.aborted.append(domain)

            def destroy(self):
                rail.destroyed.append(domain)

        return Module, Comm()

    def run(self):
        """Check the calls match as NCCL needs them, then move the bytes (ctypes.memmove between host buffers)."""
        ops = {}
        groups = set()
        for m, calls in self.calls.items():
            group, inside = -1, False
            for c in calls:
                if c[0] == 'start':
                    assert not inside, f'domain {m}: nested group'
                    group, inside = group + 1, True
                elif c[0] == 'end':
                    assert inside, f'domain {m}: groupEnd without groupStart'
                    inside = False
                else:
                    assert inside, f'domain {m}: {c[0]} outside a group'
                    kind, ptr, n, dtype, peer, _ = c
                    assert dtype == self.NCCL_UINT8 and n >= rails.HEADER_BYTES
                    key = (m, peer) if kind == 'send' else (peer, m)
                    ops.setdefault((kind,) + key, []).append((group, ptr, n))
            assert not inside
            groups.add(group)
        assert len(groups) == 1, f'rail peers issued different numbers of groups: {groups}'
        pairs = {k[1:] for k in ops}
        for a, b in pairs:
            sends, recvs = ops.get(('send', a, b), []), ops.get(('recv', a, b), [])
            assert [(g, n) for g, _, n in sends] == [(g, n) for g, _, n in recvs], f'{a} -> {b} do not match'
            for (_, src, n), (_, dst, _) in zip(sends, recvs):
                ctypes.memmove(dst, src, n)
        return groups.pop() + 1          # the number of groups every rail peer issued


def _job(N, R, seed=3, M=6, hidden=16, K=4, L=2):
    rng = np.random.default_rng(seed)
    W, E = N * R, N * R * L
    topk = []
    for g in range(W):
        T = 0 if g == 1 else int(rng.integers(1, M + 1))
        t = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]) if T else np.zeros((0, K), np.int64)
        topk.append(np.where(rng.random(t.shape) < 0.2, -1, t).astype(np.int64))
    shape = href.HybridShape(N, R, E, M, K)
    x = [rng.integers(0, 256, (t.shape[0], 2 * hidden), dtype=np.uint8) for t in topk]
    sf = [rng.integers(0, 2 ** 32, (t.shape[0], 1), dtype=np.uint32) for t in topk]
    w = [rng.random(t.shape, dtype=np.float32) for t in topk]
    return shape, topk, x, sf, w, _layout(N, R, M, hidden, K)


def _check_forwarded(shape, lay, d, bufs, x, sf, w, metas):
    """Every slot the forwarders wrote holds the token the reference puts there, byte for byte."""
    _, scaleup = messages.formats(lay, 1, x[0].shape[1])
    for rank in range(shape.num_ranks):
        m = shape.domain_of(rank)
        for src in range(shape.num_ranks):
            n, r = shape.domain_of(src), shape.scaleup_idx_of(src)
            if n == m:
                continue                          # the own domain's regions come from the NVLink path
            rt = d.routings[src]
            tokens = np.nonzero(rt.send_pos[:, rank] >= 0)[0]
            for t in tokens:
                got = scaleup.unpack(bufs[rank], lay.scaleup_region_offset(n, r) +
                                     int(rt.send_pos[t, rank]) * lay.message_bytes)
                assert got['src_token_idx'] == t and np.array_equal(got['expert_ids'], rt.topk_idx[t])
                assert np.array_equal(got['expert_pos'], rt.send_expert_pos[t])
                assert np.array_equal(got['weights'], w[src][t]) and np.array_equal(got['sf'], sf[src][t])
                assert np.array_equal(got['hidden'], x[src][t])
        f_meta = metas[rank]
        for n in range(shape.num_domains):
            if n != m:
                assert np.array_equal(f_meta[n], d.token_metadata_at_forward[rank][n])


def _notify_and_dispatch(shape, lay, d, bufs, x, sf, w, exchange, exact):
    """The rail part of a dispatch on every rank: pack notify, exchange, check; pack data, exchange, forward."""
    W = shape.num_ranks
    tops = [rails.rail_topology(W, shape.num_scaleup_ranks, g) for g in range(W)]
    plans = []
    for g in range(W):
        payload = messages.pack_notify(lay, d, g, bufs[g], epoch=1)
        plans.append(rails.plan_exchange(tops[g], lay.rail_areas('notify'), 'notify', payload, payload))
    exchange(plans)
    areas = lay.rail_areas('notify')
    for g in range(W):
        m, r = divmod(g, shape.num_scaleup_ranks)
        for n in tops[g].peer_domains:
            off = areas.recv_region(m, n)
            count, epoch, kind = messages.read_header(bufs[g], off)
            block = bufs[g][off + 16:off + 16 + 4 * count].view(np.int32)
            assert (epoch, kind) == (1, hlay.KIND_NOTIFY)
            assert np.array_equal(block, d.routings[n * shape.num_scaleup_ranks + r].notify_blocks[m].ravel())
    data = lay.rail_areas('data')
    plans = []
    for g in range(W):
        sent = messages.pack_dispatch(lay, d, g, bufs[g], x[g], w[g], sf[g], epoch=2)
        if exact:            # what the notify told both ends: tokens from each rail peer
            rail_msg = messages.formats(lay, 1, x[0].shape[1])[0].bytes
            m, r = divmod(g, shape.num_scaleup_ranks)
            recv = {n: int(d.routings[n * shape.num_scaleup_ranks + r].num_tokens_per_domain[m]) * rail_msg
                    for n in tops[g].peer_domains}
        else:
            sent = recv = {n: data.region_bytes - 16 for n in tops[g].peer_domains}
        plans.append(rails.plan_exchange(tops[g], data, 'dispatch', sent, recv, chunk_bytes=256))
    exchange(plans)
    metas = [messages.forward(lay, shape, g, bufs, 1, x[0].shape[1], epoch=2) for g in range(W)]
    _check_forwarded(shape, lay, d, bufs, x, sf, w, metas)


@pytest.mark.parametrize('N,R', [(2, 1), (2, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize('exact', [False, True])
def test_nccl_transport_carries_a_dispatch(N, R, exact):
    shape, topk, x, sf, w, lay = _job(N, R)
    d = href.dispatch(shape, topk)
    bufs = [np.zeros(lay.end_offset, dtype=np.uint8) for _ in range(shape.num_ranks)]
    fakes = {r: FakeRailNccl(N) for r in range(R)}
    transports, scratch = [], []
    for g in range(shape.num_ranks):
        top = rails.rail_topology(shape.num_ranks, R, g)
        module, _ = fakes[top.scaleup_idx].member(top.domain_idx)
        world = WorldView(g, shape.num_ranks, lambda r, obj: b'u' * 128 if r < R else None)
        synced = []
        connect_stream = SimpleNamespace(ptr=0x6, synchronize=lambda s=synced, g=g: s.append(g))
        scratch.append(np.zeros(rails.HEADER_BYTES * (N + 1), dtype=np.uint8))
        transports.append(rail_nccl.NcclRailTransport.create(world, top, bufs[g].ctypes.data, nccl=module,
                                                         stream=connect_stream, scratch_ptr=scratch[-1].ctypes.data))
        assert synced == [g]                     # construction waits for its connecting exchange
    for rail in fakes.values():                  # one group: a header each way with every rail peer, zeros only
        assert rail.run() == 1
        for m, calls in rail.calls.items():
            assert sorted((c[0], c[4]) for c in calls if c[0] in ('send', 'recv')) == sorted(
                (kind, p) for p in range(N) if p != m for kind in ('send', 'recv'))
        rail.calls = {m: [] for m in rail.calls}
    assert not any(b.any() for b in bufs) and not any(b.any() for b in scratch)
    stream = SimpleNamespace(ptr=0x5)

    def exchange(plans):
        for t, plan in zip(transports, plans):
            t.exchange(plan, stream)
        for rail in fakes.values():
            rail.run()
            rail.calls = {m: [] for m in rail.calls}

    _notify_and_dispatch(shape, lay, d, bufs, x, sf, w, exchange, exact)
    # The timeout path: abort once, name the phase and the peer, refuse later exchanges
    err = transports[0].timeout_error('dispatch', 1, 2.5)
    assert 'hybrid dispatch: rail peer rank' in str(err) and f'rank {R} (domain 1' in str(err)
    assert fakes[0].aborted == [0]
    transports[0].abort()
    assert fakes[0].aborted == [0]
    with pytest.raises(RuntimeError, match='aborted'):
        transports[0].exchange(rails.RailPlan('x', 0, ()), stream)
    transports[0].destroy()                      # aborted: nothing to destroy
    transports[R].destroy()                      # domain 1 of rail 0
    assert fakes[0].destroyed == [1]


def test_static_plans_issue_identical_calls_on_every_rail_peer():
    """Without a CPU sync (and in CUDA graphs) every rail peer makes the very same NCCL calls: the same groups, each
    with a send and a receive of the same size per peer, peers in ascending order; chunk 0 of every transfer starts
    at its region, header first."""
    N, R = 4, 2
    lay = _layout(N, R)
    areas = lay.rail_areas('data')
    fake = FakeRailNccl(N)
    cap = areas.region_bytes - rails.HEADER_BYTES
    shapes = []
    for n in range(N):
        top = rails.rail_topology(N * R, R, n * R + 1)
        module, comm = fake.member(n)
        t = rail_nccl.NcclRailTransport(top, 0x1000_0000 * (n + 1), comm, nccl=module)
        plan = rails.plan_exchange(top, areas, 'dispatch', dict.fromkeys(top.peer_domains, cap),
                                   dict.fromkeys(top.peer_domains, cap), chunk_bytes=1024)
        t.exchange(plan, SimpleNamespace(ptr=3))
        calls = fake.calls[n]
        shapes.append([c[0] if c[0] in ('start', 'end') else (c[0], c[2]) for c in calls])
        firsts = [c for c in calls[:1 + 2 * (N - 1)] if c[0] in ('send', 'recv')]
        assert [c[4] for c in firsts] == [p for p in top.peer_domains for _ in (0, 1)]
        assert [c[1] - t.base_ptr for c in firsts] == [
            (areas.send_region if c[0] == 'send' else areas.recv_region)(n, c[4]) for c in firsts]
    assert all(s == shapes[0] for s in shapes)
    assert shapes[0].count('start') == -(-areas.region_bytes // 1024)


# ---- the loopback transport on simulated streams ---------------------------------------------------------------------
class SimStreams:
    """Each rank's stream as a list of operations, run round-robin until every stream is done (or none can move)."""

    def __init__(self, num_ranks):
        self.programs = [[] for _ in range(num_ranks)]
        self.epoch_word = [0] * num_ranks

    def signals(self, rank):
        sim = self

        class Signals:
            def begin(self, stream):
                sim.programs[rank].append(('begin',))

            def signal(self, addrs, stream):
                sim.programs[rank].append(('signal', list(addrs)))

            def wait(self, addrs, peers, phase, stream):
                assert len(addrs) == len(peers) and phase.startswith('rail ')
                sim.programs[rank].append(('wait', list(addrs)))
        return Signals()

    def memcpy(self, rank):
        return lambda dst, src, n, stream: self.programs[rank].append(('copy', dst, src, n))

    def run(self):
        u32 = lambda a: ctypes.c_uint32.from_address(a)  # noqa: E731
        pcs = [0] * len(self.programs)
        while any(pc < len(p) for pc, p in zip(pcs, self.programs)):
            moved = False
            for g, prog in enumerate(self.programs):
                while pcs[g] < len(prog):
                    op = prog[pcs[g]]
                    epoch = u32(self.epoch_word[g])
                    if op[0] == 'begin':
                        epoch.value += 1
                    elif op[0] == 'signal':
                        for a in op[1]:
                            u32(a).value = epoch.value
                    elif op[0] == 'wait':
                        if any(u32(a).value < epoch.value for a in op[1]):
                            break
                    else:
                        ctypes.memmove(op[1], op[2], op[3])
                    pcs[g] += 1
                    moved = True
            assert moved, f'deadlock: streams stuck at {pcs}'
        self.programs = [[] for _ in self.programs]


@pytest.mark.parametrize('N,R', [(2, 1), (2, 2), (2, 4), (4, 1)])
@pytest.mark.parametrize('exact', [False, True])
def test_loopback_transport_carries_a_dispatch(N, R, exact):
    shape, topk, x, sf, w, lay = _job(N, R, seed=N + R)
    d = href.dispatch(shape, topk)
    W = shape.num_ranks
    bufs = [np.zeros(lay.end_offset, dtype=np.uint8) for _ in range(W)]
    sim = SimStreams(W)
    transports = []
    for g in range(W):
        top = rails.rail_topology(W, R, g)
        bases = [bufs[rr].ctypes.data for rr in top.rail_ranks]
        t = rails.IpcLoopbackTransport(top, bases, lay.rail_flags_offset, sim.signals(g), sim.memcpy(g))
        sim.epoch_word[g] = t.epoch_word
        transports.append(t)
    stream = SimpleNamespace(ptr=0x9)

    def exchange(plans):
        for t, plan in zip(transports, plans):
            t.exchange(plan, stream)
        sim.run()

    _notify_and_dispatch(shape, lay, d, bufs, x, sf, w, exchange, exact)
    # Two exchanges ran: every epoch word and flag says 2
    for t in transports:
        assert ctypes.c_uint32.from_address(t.epoch_word).value == 2
        for p in t.rails.peer_domains:
            assert ctypes.c_uint32.from_address(t.ready_flag(t.rails.domain_idx, p)).value == 2


def test_loopback_order_and_addresses():
    """Rank (domain 1) of a 3-domain rail: ready at every peer, per peer one wait then its copies from the peer's
    send region for us into our receive region, consumed at every peer, then one wait for every peer."""
    log = []

    class Signals:
        def begin(self, stream):
            log.append(('begin',))

        def signal(self, addrs, stream):
            log.append(('signal', tuple(addrs)))

        def wait(self, addrs, peers, phase, stream):
            log.append(('wait', tuple(addrs), tuple(peers), phase))

    lay = _layout(3, 1)
    top = rails.rail_topology(3, 1, 1)
    bases = [0x10_0000_0000, 0x20_0000_0000, 0x30_0000_0000]
    t = rails.IpcLoopbackTransport(top, bases, lay.rail_flags_offset, Signals(),
                                   lambda dst, src, n, s: log.append(('copy', dst, src, n)))
    areas = lay.rail_areas('data')
    plan = rails.plan_exchange(top, areas, 'combine', {0: 32, 2: 0}, {0: 0, 2: 64})
    t.exchange(plan, SimpleNamespace(ptr=1))
    flags = lay.rail_flags_offset
    assert log == [
        ('begin',),
        ('signal', (bases[0] + flags + 2 * 128, bases[2] + flags + 2 * 128)),
        ('wait', (bases[1] + flags + 1 * 128,), (0,), 'rail combine'),
        ('copy', bases[1] + areas.recv_region(1, 0), bases[0] + areas.send_region(0, 1), 16),
        ('wait', (bases[1] + flags + 3 * 128,), (2,), 'rail combine'),
        ('copy', bases[1] + areas.recv_region(1, 2), bases[2] + areas.send_region(2, 1), 80),
        ('signal', (bases[0] + flags + 5 * 128, bases[2] + flags + 5 * 128)),
        ('wait', (bases[1] + flags + 4 * 128, bases[1] + flags + 6 * 128), (0, 2), 'rail combine')]
    with pytest.raises(ValueError, match='one base per domain'):
        rails.IpcLoopbackTransport(top, bases[:2], flags, Signals())
    with pytest.raises(ValueError, match='at most 15 domains'):
        big = rails.rail_topology(16, 1, 0)
        rails.IpcLoopbackTransport(big, [0] * 16, flags, Signals())


# ---- the host watchdog over NCCL exchanges (runtime/rail_watchdog.py) -----------------------------------------------
class FakeEvents:
    """Events that complete when the test says so; `capturing` streams are not watched."""

    def __init__(self):
        self.next, self.done, self.recorded, self.destroyed = 1, set(), [], []
        self.capturing_streams = set()

    def create(self):
        self.next += 1
        return self.next

    def record(self, event, stream_ptr):
        self.done.discard(event)
        self.recorded.append((event, stream_ptr))

    def query(self, event):
        return event in self.done

    def destroy(self, event):
        self.destroyed.append(event)

    def capturing(self, stream_ptr):
        return stream_ptr in self.capturing_streams


def _watched_transport(N=3, R=2, g=2):
    from deepep_cupy.runtime.rail_watchdog import RailWatchdog
    top = rails.rail_topology(N * R, R, g)
    fake = FakeRailNccl(N)
    module, comm = fake.member(top.domain_idx)
    t = rail_nccl.NcclRailTransport(top, 0x1000, comm, nccl=module)
    events = FakeEvents()
    t.watch_timeouts(5.0, events)
    assert isinstance(t.watchdog, RailWatchdog)
    t.watchdog._thread = SimpleNamespace(join=lambda timeout: None)     # drive poll() by hand: no thread
    return t, fake, events


def test_watchdog_retires_completed_exchanges_and_skips_captures():
    t, fake, events = _watched_transport()
    plan = rails.RailPlan('combine', 1, (rails.RailOp(0, 0, 'send', 0, 0, 16), rails.RailOp(0, 0, 'recv', 16, 16, 16)))
    t.exchange(plan, SimpleNamespace(ptr=0x7))  # a start event before the groups, an end event after them
    assert [p for _, p in events.recorded] == [0x7, 0x7] and t.watchdog.num_pending == 1
    events.done.add(events.recorded[1][0])
    t.watchdog.poll(now=1e18)                   # completed: never times out, however late the poll
    assert t.watchdog.num_pending == 0 and t.watchdog.error is None and fake.aborted == []
    t.exchange(plan, SimpleNamespace(ptr=0x7))  # both events are reused from the pool
    assert {e for e, _ in events.recorded[2:]} == {e for e, _ in events.recorded[:2]}
    events.done.add(events.recorded[3][0])
    t.watchdog.poll()
    events.capturing_streams.add(0x9)
    t.exchange(plan, SimpleNamespace(ptr=0x9))  # inside a capture: not watched
    assert len(events.recorded) == 4 and t.watchdog.num_pending == 0
    t.destroy()
    assert fake.destroyed == [1] and sorted(events.destroyed) == sorted({e for e, _ in events.recorded})


def test_watchdog_aborts_a_hung_exchange_and_names_phase_and_peers():
    import time
    t, fake, events = _watched_transport(N=3, R=2, g=2)       # domain 1, scale-up index 0: peers ranks 0 and 4
    plan = rails.plan_exchange(t.rails, _layout(3, 2).rail_areas('data'), 'dispatch', {0: 0, 2: 0}, {0: 0, 2: 0})
    t.exchange(plan, SimpleNamespace(ptr=0x7))
    start = events.recorded[0][0]
    t.watchdog.poll(now=time.monotonic() + 100.0)              # the stream has not reached it: no bound yet
    assert t.watchdog.error is None and fake.aborted == []
    events.done.add(start)
    now = time.monotonic()
    t.watchdog.poll(now=now)                                   # reached: the bound runs from here
    t.watchdog.poll(now=now + 1.0)                             # pending, within the bound
    assert t.watchdog.error is None and fake.aborted == []
    t.watchdog.poll(now=now + 10.0)                            # past it: abort once, store the error
    assert fake.aborted == [1]
    err = t.watchdog.error
    assert isinstance(err, TimeoutError)
    assert 'hybrid rail dispatch' in str(err) and 'rail peer ranks [0, 4]' in str(err) and '5.0 s' in str(err)
    t.watchdog.poll(now=now + 20.0)
    assert fake.aborted == [1]
    with pytest.raises(TimeoutError, match='rail peer ranks'):
        t.exchange(plan, SimpleNamespace(ptr=0x7))
    t.destroy()                                                # aborted: the communicator is not destroyed again
    assert fake.destroyed == []


def test_watchdog_thread_fires_on_its_own():
    """The real thread (short timeout): a hung exchange is aborted without any call from the caller."""
    import time

    from deepep_cupy.runtime.rail_watchdog import RailWatchdog
    fired = []
    events = FakeEvents()
    w = RailWatchdog(0.05, lambda phase, peers: fired.append((phase, peers)) or TimeoutError(phase), events,
                     poll_s=0.005)
    w.watch(0x3, 'barrier', [1])
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fired == [('barrier', (1,))] and isinstance(w.error, TimeoutError)
    w.close()
    with pytest.raises(ValueError, match='timeout_s'):
        RailWatchdog(0, lambda *a: None, events)


def test_watchdog_thread_leaves_other_threads_captures_alone():
    """The thread sets thread-local capture mode before its first query (a query in global mode from another
    thread invalidates a graph being captured), and a thread that cannot set it stores why and stops."""
    from deepep_cupy.runtime import rail_watchdog as wd
    seen = []

    class Lib:
        def __init__(self, rc):
            self.rc = rc

        def cuThreadExchangeStreamCaptureMode(self, mode_ptr):     # noqa: N802 (the driver's name)
            seen.append(ctypes.cast(mode_ptr, ctypes.POINTER(ctypes.c_int)).contents.value)
            return self.rc

    wd.thread_local_capture_mode(Lib(0))
    assert seen == [wd.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL]
    with pytest.raises(RuntimeError, match='CUresult 900'):
        wd.thread_local_capture_mode(Lib(900))

    class Events:
        def bind_thread(self):
            raise RuntimeError('no context')

    dog = wd.RailWatchdog(1.0, lambda phase, peers: TimeoutError(phase), Events())
    dog._run()
    with pytest.raises(RuntimeError, match='could not start: no context'):
        dog.raise_if_failed()


def test_watchdog_probe_aborts_on_nccl_async_error_between_exchanges():
    """A rail peer that dies while nothing is pending (a CUDA-graph replay enqueues nothing the watchdog times):
    NCCL's asynchronous error, polled by the watchdog thread, aborts the communicator and names the rail peer."""
    import time
    top = rails.rail_topology(4, 2, 1)          # domain 0, scale-up index 1: rail peer rank 3 (domain 1)

    class Comm:
        broken, aborted = False, 0

        def check_async_error(self):
            if self.broken:
                raise RuntimeError('NCCL_ERROR_REMOTE_ERROR')

        def abort(self):
            Comm.aborted += 1

    comm = Comm()
    t = rail_nccl.NcclRailTransport(top, 0x1000, comm, nccl=SimpleNamespace(NCCL_UINT8=7))
    t.watch_timeouts(5.0, events=SimpleNamespace())
    t.watchdog.probe_s = 0.01
    time.sleep(0.05)
    assert t.watchdog.error is None and not t.aborted
    comm.broken = True
    for _ in range(200):
        if t.aborted:
            break
        time.sleep(0.01)
    assert t.aborted and Comm.aborted == 1
    with pytest.raises(RuntimeError, match=r'NCCL reported an error on the rail with peer rank 3 \(domains \[1\]'):
        t.check()
    with pytest.raises(RuntimeError, match='NCCL_ERROR_REMOTE_ERROR'):
        t.exchange(rails.RailPlan('x', 0, ()), SimpleNamespace(ptr=0))
    t.destroy()


def test_nccl_error_inside_an_exchange_names_the_phase_and_the_peer():
    """NCCL already saw the peer go when the next exchange is enqueued (groupEnd raises NcclError): the caller gets
    a RuntimeError naming the phase and the rail peer, the communicator is aborted once, later calls raise it."""
    top = rails.rail_topology(2, 1, 0)

    class NcclError(Exception):
        pass

    class Comm:
        aborted = 0

        def send(self, *a):
            pass

        def recv(self, *a):
            pass

        def abort(self):
            Comm.aborted += 1

    def group_end():
        raise NcclError('NCCL_ERROR_REMOTE_ERROR: remote process exited')
    module = SimpleNamespace(NCCL_UINT8=7, groupStart=lambda: None, groupEnd=group_end)
    t = rail_nccl.NcclRailTransport(top, 0x1000, Comm(), nccl=module)
    areas = SimpleNamespace(region_bytes=4096, send_region=lambda a, b: 0, recv_region=lambda a, b: 4096)
    plan = rails.plan_exchange(top, areas, 'notify', {1: 0}, {1: 0})
    with pytest.raises(RuntimeError, match=r'hybrid notify: NCCL reported an error on the rail with peer rank 1 '
                                           r'\(domains \[1\].*REMOTE_ERROR') as info:
        t.exchange(plan, SimpleNamespace(ptr=0))
    assert type(info.value.__cause__).__name__ == 'NcclError' and t.aborted and Comm.aborted == 1
    with pytest.raises(RuntimeError, match='hybrid notify: NCCL reported'):
        t.check()
    t.destroy()


def test_abort_that_nccl_holds_up_reports_at_once_and_destroy_waits_for_it():
    """ncclCommAbort blocked while a CUDA-graph replay's NCCL kernels were in flight (1xH100, sockets: the whole
    20 s bound): the failure is raised after `ABORT_REPORT_SECS`, the abort finishes in the background, destroy waits
    for it (bounded) and does not destroy an aborted communicator; an abort that never returns leaves it alone."""
    import threading
    import time
    top = rails.rail_topology(2, 1, 0)
    release = threading.Event()

    class Comm:
        aborts, destroys = 0, 0

        def check_async_error(self):
            raise RuntimeError('NCCL_ERROR_REMOTE_ERROR')

        def abort(self):
            Comm.aborts += 1
            release.wait(5.0)

        def destroy(self):
            Comm.destroys += 1

    t = rail_nccl.NcclRailTransport(top, 0x1000, Comm(), nccl=SimpleNamespace(NCCL_UINT8=7))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match='NCCL reported an error on the rail with peer rank 1'):
        t.check()
    assert time.monotonic() - t0 < rail_nccl.ABORT_REPORT_SECS + 1.0 and t.aborted and Comm.aborts == 1
    with pytest.raises(RuntimeError, match='NCCL_ERROR_REMOTE_ERROR'):      # the stored failure, no second abort
        t.check()
    t.abort()
    assert Comm.aborts == 1 and not t.wait_aborted(0.05)
    release.set()
    t.destroy()
    assert t.wait_aborted(0.0) and Comm.destroys == 0

    stuck = threading.Event()

    class Stuck(Comm):
        def abort(self):
            stuck.wait(5.0)

    t = rail_nccl.NcclRailTransport(top, 0x1000, Stuck(), nccl=SimpleNamespace(NCCL_UINT8=7))
    t.abort()
    try:
        t.destroy(abort_wait_secs=0.05)             # returns: the communicator is left to the process exit
    finally:
        stuck.set()
    assert t.comm is None


def test_watchdog_bound_runs_from_the_exchange_start():
    """A domain peer's wait before the exchange on the stream (bounded by the GPU timeout) reports first: the
    exchange's bound starts once its stream reached it, however long it sat enqueued."""
    import time

    from deepep_cupy.runtime.rail_watchdog import RailWatchdog
    fired = []
    events = FakeEvents()
    w = RailWatchdog(1.0, lambda phase, peers: fired.append(phase) or TimeoutError(phase), events)
    start = w.begin(0x5)
    w.watch(0x5, 'combine', [1], start=start)
    now = time.monotonic()
    w.poll(now=now + 50.0)
    assert fired == [] and w.num_pending == 1
    events.done.add(start)
    w.poll(now=now + 60.0)                      # started now: 1 s from here
    w.poll(now=now + 60.5)
    assert fired == []
    w.poll(now=now + 61.5)
    assert fired == ['combine']
    with pytest.raises(TimeoutError):           # failed: nothing more is watched
        w.begin(0x5)
    w = RailWatchdog(1.0, lambda phase, peers: TimeoutError(phase), events)
    events.capturing_streams.add(0x6)
    assert w.begin(0x6) is None                 # captured exchanges are not watched
