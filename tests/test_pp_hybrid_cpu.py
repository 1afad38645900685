"""PP across scale-up domains without a GPU (features/pp/links.py): which ring pairs cross domains and over which
link for several N x R shapes, the peer table and outbox layouts, the NCCL communicators (one per directed pair, made
in an order that cannot deadlock) and the NCCL call sequence of a send/recv program against a fake NCCL, the launch
arguments of the loopback and NCCL paths, timeouts aborting the communicators, and argument errors."""

from types import SimpleNamespace

import fakes
import numpy as np
import pytest

from deepep_cupy.buffers.base import WORKSPACE_BYTES
from deepep_cupy.features.pp import feature as pp_feature
from deepep_cupy.features.pp import links
from deepep_cupy.features.pp import plan as pp
from deepep_cupy.jit import launch
from deepep_cupy.runtime import interop

MiB = 1 << 20


# ---- topology ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('num_domains,num_scaleup', [(2, 1), (2, 2), (4, 1), (3, 2), (2, 4), (1, 4), (4, 2)])
def test_ring_neighbours_cross_domains_exactly_at_the_domain_ends(num_domains, num_scaleup):
    W, R = num_domains * num_scaleup, num_scaleup
    if W < 2:
        return
    one_gpu = ['gpu0'] * W
    for g in range(W):
        nbs = links.ring_neighbours(W, R, g, one_gpu, 'auto')
        assert set(nbs) == {(g - 1) % W, (g + 1) % W}
        for peer, nb in nbs.items():
            crosses = peer // R != g // R
            assert nb.kind == (links.LINK_LOOPBACK if crosses else links.LINK_NVLINK)     # shared GPU: loopback
            assert nb.table_idx == peer - (g - g % R)
            assert nb.slot_idx == pp.neighbour_slot_idx(g, peer, W)
            assert nb.slot_idx_at_peer == pp.neighbour_slot_idx(peer, g, W)
            if not crosses:
                assert nb.table_idx == peer % R                 # a domain peer keeps its scale-up index
            # both ends agree on the link
            assert links.ring_neighbours(W, R, peer, one_gpu, 'auto')[g].kind == nb.kind
    # Only the last rank of a domain and the first of the next one cross (and with one rank per domain, every pair).
    crossing = links.crossing_pairs(W, R, one_gpu, 'auto')
    expected = {(s, d) for s in range(W) for d in ((s - 1) % W, (s + 1) % W)
                if d != s and s // R != d // R}
    assert {(s, d) for s, d, _ in crossing} == expected
    if num_domains > 1:
        assert all(s % R in (0, R - 1) and d % R in (0, R - 1) for s, d, _ in crossing)


def test_link_kind_follows_the_transport_setting():
    gpus = ['a', 'b', 'a', 'b']                 # 2 x 2 on two GPUs: the cross pairs (1, 2) and (3, 0)
    nbs = links.ring_neighbours(4, 2, 1, gpus, 'auto')
    assert nbs[0].kind == links.LINK_NVLINK and nbs[2].kind == links.LINK_NCCL      # 1 on b, 2 on a
    assert links.ring_neighbours(4, 2, 1, gpus, 'loopback')[2].kind == links.LINK_LOOPBACK
    assert links.ring_neighbours(4, 2, 1, gpus, 'nccl')[2].kind == links.LINK_NCCL
    same = ['a', 'a', 'a', 'a']
    with pytest.raises(ValueError, match='share a GPU'):
        links.ring_neighbours(4, 2, 1, same, 'nccl')
    with pytest.raises(ValueError, match='auto, nccl or loopback'):
        links.ring_neighbours(4, 2, 1, gpus, 'rdma')
    with pytest.raises(ValueError, match='at least 2 ranks'):
        links.ring_neighbours(1, 1, 0, ['a'], 'auto')
    with pytest.raises(ValueError, match='scale-up domains of 3'):
        links.ring_neighbours(4, 3, 0, gpus, 'auto')
    with pytest.raises(ValueError, match='gpu_of_rank'):
        links.ring_neighbours(4, 2, 0, gpus[:3], 'auto')


def test_two_domains_of_one_rank_are_each_others_previous_and_next():
    nbs = links.ring_neighbours(2, 1, 0, ['a', 'b'], 'auto')
    assert list(nbs) == [1]
    nb = nbs[1]
    assert (nb.kind, nb.slot_idx, nb.slot_idx_at_peer, nb.table_idx) == (links.LINK_NCCL, 0, 0, 1)
    # Both directions have their own communicator, created in one order by both ranks.
    assert links.crossing_pairs(2, 1, ['a', 'b'], 'auto') == [(0, 1, 'nccl'), (1, 0, 'nccl')]


def _init_completes(per_rank_order):
    """Each rank initialises its communicators in its order, each init blocking until both ranks of the pair are in
    it: whether every rank gets through (no cycle of waits)."""
    pos = {r: 0 for r in per_rank_order}
    progress = True
    while progress:
        progress = False
        for r, order in per_rank_order.items():
            if pos[r] == len(order):
                continue
            pair = order[pos[r]]
            other = pair[1] if pair[0] == r else pair[0]
            if pos[other] < len(per_rank_order[other]) and per_rank_order[other][pos[other]] == pair:
                pos[r] += 1
                pos[other] += 1
                progress = True
    return all(pos[r] == len(o) for r, o in per_rank_order.items())


@pytest.mark.parametrize('num_domains,num_scaleup', [(2, 1), (3, 1), (4, 1), (8, 1), (2, 2), (4, 2), (3, 4)])
def test_communicator_creation_order_cannot_deadlock(num_domains, num_scaleup):
    W = num_domains * num_scaleup
    gpus = [f'gpu{g}' for g in range(W)]
    pairs = [(s, d) for s, d, _ in links.crossing_pairs(W, num_scaleup, gpus, 'auto')]
    order = {r: [p for p in pairs if r in p] for r in range(W)}
    assert _init_completes(order)
    # while a per-rank order that is not the global one can (ranks 0..3 of a 4 x 1 ring, each "own pairs first")
    if num_domains == 4 and num_scaleup == 1:
        selfish = {r: sorted(order[r], key=lambda p: (p[0] != r, p)) for r in order}
        assert not _init_completes(selfish)


# ---- layouts ------------------------------------------------------------------------------------------------------
def test_peer_table_is_indexed_by_global_rank_minus_the_domain_start():
    table = links.table_entries(6, 2, {2: 0x100, 3: 0x200, 1: 0x300, 4: 0x400})
    assert table.dtype == np.uint64 and table.shape == (11,)
    centre = 5              # W - 1: the kernels' peer_bases points here
    assert table[centre + 0] == 0x100 and table[centre + 1] == 0x200
    assert table[centre - 1] == 0x300 and table[centre + 2] == 0x400
    assert int(table.astype(bool).sum()) == 4
    with pytest.raises(ValueError, match='not in'):
        links.table_entries(6, 2, {6: 1})


def test_outbox_layout():
    for size, n in ((1, 1), (4096, 4), (3 * MiB + 5, 2)):
        box = links.Outbox(size, n)
        assert box.headers_offset >= pp.CTRL_OFFSET + pp.CTRL_BYTES       # the kernel's scratch control words fit
        assert box.headers_offset % 128 == 0 and box.slots_offset % 128 == 0
        assert box.slots_offset >= box.header(n - 1) + pp.HEADER_BYTES
        assert box.slot_bytes == pp.PPLayout(size, n, 0).slot_bytes >= size
        assert box.num_bytes == box.slot(n - 1) + box.slot_bytes
        # the kernel's address with src_slot_idx_at_dst = 0 is the outbox's slot
        for c in range(n):
            assert box.headers_offset + (0 * n + c) * pp.HEADER_BYTES == box.header(c)
            assert box.slots_offset + (0 * n + c) * box.slot_bytes == box.slot(c)


def test_nccl_receive_offsets_land_on_slot_zero_of_the_source():
    lay = pp.PPLayout(12345, 3, WORKSPACE_BYTES)
    for k in (0, 1):
        headers, slots = links.nccl_recv_offsets(lay, k)
        idx = k * 1 + 0                     # pp_recv_impl with num_inflight = 1, cursor 0
        assert headers + idx * pp.HEADER_BYTES == lay.header_offset(k, 0)
        assert slots + idx * lay.slot_bytes == lay.slot_offset(k, 0)


def test_send_cursor_mirror_follows_the_device_rule_across_reconfigurations():
    stored, device = 0, 0
    for n in (3, 3, 3, 3, 2, 2, 5, 1, 4):
        slot, stored = links.next_cursor(stored, n)
        dev_slot = device % n               # kernels_cu/pp.cu: cursor = stored % n; stored = (cursor + 1) % n
        device = (dev_slot + 1) % n
        assert (slot, stored) == (dev_slot, device)


# ---- NCCL pair links against a fake NCCL ----------------------------------------------------------------------------
class FakeComm:
    def __init__(self, log, size, uid, rank):
        self.log, self.size, self.uid, self.rank = log, size, uid, rank
        log.append(('init', uid, size, rank))

    def send(self, ptr, count, dtype, peer, stream):
        self.log.append(('send', self.uid, ptr, count, dtype, peer, stream))

    def recv(self, ptr, count, dtype, peer, stream):
        self.log.append(('recv', self.uid, ptr, count, dtype, peer, stream))

    def abort(self):
        self.log.append(('abort', self.uid))

    def destroy(self):
        self.log.append(('destroy', self.uid))


class FakeNccl:
    NCCL_UINT8 = 7

    def __init__(self, rank):
        self.log, self.rank = [], rank

    def get_unique_id(self):
        return f'uid-of-{self.rank}-{sum(1 for e in self.log if e[0] == "uid")}'

    def NcclCommunicator(self, size, uid, rank):       # noqa: N802 (cupy's name)
        return FakeComm(self.log, size, uid, rank)

    def groupStart(self):                              # noqa: N802
        self.log.append(('groupStart',))

    def groupEnd(self):                                # noqa: N802
        self.log.append(('groupEnd',))


class WorldOfIds:
    """allgather_object of the uid dicts: this rank's object plus what every other rank would have made."""

    def __init__(self, rank, size, pairs):
        self.rank, self.size, self.pairs, self.calls = rank, size, pairs, []

    def allgather_object(self, obj, timeout=None):
        self.calls.append(obj)
        out = []
        for r in range(self.size):
            out.append(obj if r == self.rank else {(s, d): f'uid-{s}-{d}' for s, d in self.pairs if s == r})
        return out

    def check_same(self, what, value, timeout=None):
        pass


class SideStream:
    def __init__(self, name):
        self.name, self.ptr, self.waited, self.done = name, hash(name) & 0xFFFF, [], True

    def wait_event(self, event):
        self.waited.append(event)

    def synchronize(self):
        pass


def test_nccl_links_one_communicator_per_directed_pair_in_the_global_order():
    pairs = [(s, d) for s, d, _ in links.crossing_pairs(4, 1, ['a', 'b', 'c', 'd'], 'nccl')]
    nccl = FakeNccl(1)
    streams = iter(SideStream(f's{i}') for i in range(10))
    world = WorldOfIds(1, 4, pairs)
    lk = links.NcclPairLinks(world, 1, pairs, nccl, lambda: next(streams), scratch_ptr=0x9000)
    assert len(world.calls) == 1 and set(world.calls[0]) == {(1, 0), (1, 2)}     # ids of the pairs it sends on
    inits = [e for e in nccl.log if e[0] == 'init']
    # rank 1: pairs {0,1} then {1,2}; inside a pair, the direction with the lower sender first
    # (0->1: receiver, 1->0: sender, 1->2: sender, 2->1: receiver)
    assert [(e[2], e[3]) for e in inits] == [(2, 1), (2, 0), (2, 0), (2, 1)]
    assert inits[0][1] == 'uid-0-1' and inits[3][1] == 'uid-2-1'      # received from the senders
    assert inits[1][1] == world.calls[0][(1, 0)] and inits[2][1] == world.calls[0][(1, 2)]
    assert set(lk.comms) == {(0, 1), (1, 0), (1, 2), (2, 1)}
    assert len({id(s) for s in lk.streams.values()}) == 4
    # then each communicator connected, pair by pair in the same order: one byte, one group each
    moves = [e for e in nccl.log if e[0] in ('send', 'recv')]
    assert [(e[0], e[1], e[2], e[3]) for e in moves] == [
        ('recv', 'uid-0-1', 0x9001, 1), ('send', inits[1][1], 0x9000, 1), ('send', inits[2][1], 0x9000, 1),
        ('recv', 'uid-2-1', 0x9001, 1)]
    assert sum(1 for e in nccl.log if e[0] == 'groupStart') == 4


def test_nccl_send_recv_program_issues_one_group_per_message_then_the_bump():
    pairs = [(0, 1), (1, 0)]
    nccl = FakeNccl(0)
    lk = links.NcclPairLinks(WorldOfIds(0, 2, pairs), 0, pairs, nccl, lambda: SideStream('side'),
                              scratch_ptr=0x9000)
    del nccl.log[:]
    bumped = []
    s = lk.send(1, [(0x1000, 16), (0x2000, 4096)], 'ev0', lambda st: bumped.append(('send', st)))
    r = lk.recv(1, [(0x3000, 16), (0x4000, 4096)], 'ev1', lambda st: bumped.append(('recv', st)))
    assert s is lk.streams[(0, 1)] and r is lk.streams[(1, 0)] and s is not r
    assert s.waited == ['ev0'] and r.waited == ['ev1']
    send_uid, recv_uid = lk.comms[(0, 1)].uid, lk.comms[(1, 0)].uid
    assert nccl.log == [
        ('groupStart',), ('send', send_uid, 0x1000, 16, 7, 1, s.ptr), ('send', send_uid, 0x2000, 4096, 7, 1, s.ptr),
        ('groupEnd',),
        ('groupStart',), ('recv', recv_uid, 0x3000, 16, 7, 0, r.ptr), ('recv', recv_uid, 0x4000, 4096, 7, 0, r.ptr),
        ('groupEnd',)]
    assert bumped == [('send', s), ('recv', r)]
    lk.abort()
    assert sorted(e for e in nccl.log if e[0] == 'abort') == sorted([('abort', send_uid), ('abort', recv_uid)])
    with pytest.raises(RuntimeError, match='aborted'):
        lk.send(1, [(0x1000, 16)], 'ev', lambda st: None)
    lk.destroy()
    assert not any(e[0] == 'destroy' for e in nccl.log)        # aborted communicators are not destroyed again
    lk2 = links.NcclPairLinks(WorldOfIds(0, 2, pairs), 0, pairs, nccl, lambda: SideStream('side'),
                              scratch_ptr=0x9000)
    lk2.destroy()
    assert sum(1 for e in nccl.log if e[0] == 'destroy') == 2


# ---- the feature in hybrid mode (kernels that only record launches) ------------------------------------------------
class Kernel(fakes.RecordingKernel):
    pass


def hybrid_buffer(monkeypatch, num_domains, num_scaleup, rank, gpus, setting, nccl=None):
    """An `ElasticBuffer` of `num_domains` x `num_scaleup` ranks without a GPU whose PP kernels record launches and
    whose links use fakes (IPC opens return fake addresses, NCCL is `nccl`)."""
    W, R = num_domains * num_scaleup, num_scaleup
    base = rank - rank % R
    sym = SimpleNamespace(peer_bases_ptr=0x1000, base=0x7000_0000_0000 + rank * 0x1_0000_0000,
                          peer_bases=[0x7000_0000_0000 + (base + i) * 0x1_0000_0000 for i in range(R)],
                          num_bytes=WORKSPACE_BYTES + 64 * MiB)
    group = WorldOfIds(rank, W, [(s, d) for s, d, k in links.crossing_pairs(W, R, gpus, setting) if k == 'nccl'])
    handles = {}

    def allgather(obj, timeout=None):
        if isinstance(obj, bytes):          # the IPC handles
            return [b'handle-%d' % g for g in range(W)]
        return WorldOfIds.allgather_object(group, obj, timeout)
    group.allgather_object = allgather
    buf = fakes.make_buffer(num_ranks=W, rank=rank, group=group, sym=sym, num_scaleup_ranks=R,
                            num_scaleout_ranks=num_domains, scaleup_rank_idx=rank % R, scaleout_rank_idx=rank // R,
                            error_rank_base=base, topology=SimpleNamespace(
                                pci_bus_ids=tuple(gpus),
                                nccl_gpu_ids=tuple(gpus), scaleup_peers=list(range(base, base + R))))
    log = []
    buf.launches = log
    kernels = SimpleNamespace(send=Kernel(pp.SEND_SPEC, log), recv=Kernel(pp.RECV_SPEC, log),
                              wait=Kernel(pp.WAIT_SPEC, log), bump=Kernel(pp.BUMP_SPEC, log))
    monkeypatch.setattr(pp_feature, 'PPKernels', lambda: kernels)
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: fakes.FakeStream('current'))
    monkeypatch.setattr(buf, 'synchronize', lambda stream=None: buf.check_usable(), raising=False)
    monkeypatch.setenv('DEEPEP_CUPY_RAIL_TRANSPORT', setting)
    allocs, tables, closed = [], [], []
    nccl = nccl or FakeNccl(rank)
    real = links.HybridPeers

    def make(b, s):
        return real(b, s, nccl=nccl, make_stream=lambda: SideStream('side'),
                    to_device=lambda t: (tables.append(t.copy()) or 0x5000_0000, t),
                    alloc=lambda n: (allocs.append(n) or 0x6000_0000 + 0x1000_0000 * len(allocs), None),
                    ipc_handle=lambda b_: handles.setdefault('mine', b'handle-%d' % rank),
                    ipc_open=lambda h: 0x9000_0000_0000 + int(h.split(b'-')[1]) * 0x1_0000_0000,
                    ipc_close=closed.append)
    monkeypatch.setattr(pp_feature, 'HybridPeers', make)
    monkeypatch.setattr(links, '_device_synchronize', lambda: None)
    buf.fake = SimpleNamespace(nccl=nccl, allocs=allocs, tables=tables, closed=closed)
    return buf


torch = pytest.importorskip('torch')


def test_loopback_neighbours_run_the_nvlink_protocol_through_the_peer_table(monkeypatch):
    # 2 x 2 on one GPU: rank 2 (domain 1, scale-up 0) has rank 1 (domain 0) before it and rank 3 (its domain) after.
    buf = hybrid_buffer(monkeypatch, 2, 2, 2, ['g'] * 4, 'auto')
    buf.pp_set_config(MiB, 2)
    h = buf._pp.hybrid
    assert {p: nb.kind for p, nb in h.neighbours.items()} == {1: 'loopback', 3: 'nvlink'}
    table = buf.fake.tables[-1]
    assert table[3 + 0] == buf.sym.base and table[3 + 1] == buf.sym.peer_bases[1]      # W - 1 = 3
    assert table[3 - 1] == 0x9000_0000_0000 + 1 * 0x1_0000_0000                          # rank 1, IPC-mapped
    assert h.table_ptr == 0x5000_0000 + 3 * 8 and buf.fake.allocs == [] and h.links is None
    x = torch.zeros(MiB // 2, dtype=torch.bfloat16)
    buf.pp_send(x, 1)
    buf.pp_recv(x, 3)
    (send, recv) = buf.launches
    assert send.name == pp.SEND_SPEC.name and recv.name == pp.RECV_SPEC.name
    lay = buf._pp.layout
    assert send.args['peer_bases'] == recv.args['peer_bases'] == h.table_ptr
    assert send.args['rank'] == recv.args['rank'] == 0
    assert send.args['dst'] == -1 and send.args['dst_slot_idx'] == 0 and send.args['src_slot_idx_at_dst'] == 1
    assert recv.args['src'] == 1 and recv.args['src_slot_idx'] == 1 and recv.args['dst_slot_idx_at_src'] == 0
    for a in (send.args, recv.args):
        assert (a['num_inflight'], a['headers_offset'], a['slots_offset']) == (2, lay.headers_offset, lay.slots_offset)
    # a mismatch record names the global rank (recorded: the table index)
    buf._pp.error[:] = [1, -1, 0, 64, 0, 32, 0, 0]
    with pytest.raises(RuntimeError, match='from rank 1 got a tensor of 64 bytes'):
        buf.pp_send(x, 1)
    buf._pp.destroy()
    assert buf.fake.closed == [0x9000_0000_0000 + 1 * 0x1_0000_0000]


def test_nccl_neighbour_send_and_recv_sequence(monkeypatch):
    # 2 x 1 on two GPUs: rank 0's only neighbour is rank 1, in the other domain, over NCCL in both directions.
    buf = hybrid_buffer(monkeypatch, 2, 1, 0, ['a', 'b'], 'auto')
    buf.pp_set_config(4096, 2)
    h, lay = buf._pp.hybrid, buf._pp.layout
    nccl = buf.fake.nccl
    assert [e[3] for e in nccl.log if e[0] == 'init'] == [0, 1]     # sender of 0->1, receiver of 1->0
    box = links.Outbox(4096, 2)
    assert buf.fake.allocs == [2, box.num_bytes]      # the connecting exchange's 2 bytes, the outbox
    outbox = 0x6000_0000 + 0x1000_0000 * 2
    assert buf.fake.tables[-1][1 + 1] == outbox and h.bases[1] == outbox
    del nccl.log[:]
    x = torch.zeros(1000, dtype=torch.uint8)
    for _ in range(3):
        buf.pp_send(x, 1)
    buf.pp_recv(torch.zeros(64, dtype=torch.uint8), 1)
    names = [(e.name.split('::')[1], e.stream.name if e.stream is not None else None) for e in buf.launches]
    main = names[1][1]          # the stream the call runs on (the caller's, for a synchronous call)
    assert names == [('pp_wait_impl', main), ('pp_send_impl', main), ('pp_bump_impl', 'side')] * 3 + \
        [('pp_bump_impl', 'side'), ('pp_wait_impl', main), ('pp_recv_impl', main)]
    wait_send, send = buf.launches[0].args, buf.launches[1].args
    assert (wait_send['wait_word'], wait_send['count_word'], wait_send['delta'], wait_send['aux']) == \
        (pp.WORD_CONSUMED_BY + 0, pp.WORD_NUM_SENT + 0, 1 - 2, pp.WAIT_SLOT)
    assert wait_send['peer'] == 1 and wait_send['rank'] == 0 and wait_send['peer_bases'] == h.table_ptr
    assert (send['dst'], send['src_slot_idx_at_dst'], send['num_inflight']) == (1, 0, 2)
    assert (send['headers_offset'], send['slots_offset']) == (box.headers_offset, box.slots_offset)
    bump = buf.launches[2].args['word']
    assert bump == buf.sym.base + pp.CTRL_OFFSET + 4 * (pp.WORD_CONSUMED_BY + 0)
    wait_recv, recv = buf.launches[-2].args, buf.launches[-1].args
    assert (wait_recv['wait_word'], wait_recv['count_word'], wait_recv['delta'], wait_recv['aux']) == \
        (pp.WORD_SENT_FROM + 0, pp.WORD_NUM_RECV + 0, 1, pp.WAIT_DATA)
    assert buf.launches[-3].args['word'] == buf.sym.base + pp.CTRL_OFFSET + 4 * (pp.WORD_SENT_FROM + 0)
    assert (recv['src'], recv['num_inflight'], recv['dst_slot_idx_at_src']) == (1, 1, 1)
    assert (recv['headers_offset'], recv['slots_offset']) == links.nccl_recv_offsets(lay, 0)
    # NCCL: each send ships header + whole slot of the outbox slot the kernel used (cursor 0, 1, 0); the receive
    # lands in this rank's slot [0][0].
    sends = [e for e in nccl.log if e[0] == 'send']
    assert [(e[2] - outbox, e[3], e[5]) for e in sends] == [
        (box.header(0), 16, 1), (box.slot(0), box.slot_bytes, 1), (box.header(1), 16, 1),
        (box.slot(1), box.slot_bytes, 1), (box.header(0), 16, 1), (box.slot(0), box.slot_bytes, 1)]
    recvs = [e for e in nccl.log if e[0] == 'recv']
    assert [(e[2] - buf.sym.base, e[3], e[5]) for e in recvs] == [
        (lay.header_offset(0, 0), 16, 0), (lay.slot_offset(0, 0), lay.slot_bytes, 0)]
    assert nccl.log.count(('groupStart',)) == nccl.log.count(('groupEnd',)) == 4
    # the side streams wait for the communication stream (events recorded on it)
    assert [len(st.waited) for st in h.links.streams.values()] == [3, 1]
    assert all(ev is not None for st in h.links.streams.values() for ev in st.waited)


def test_nccl_timeout_aborts_the_communicators_and_destroy_releases_them(monkeypatch):
    buf = hybrid_buffer(monkeypatch, 2, 1, 1, ['a', 'b'], 'nccl')
    buf.pp_set_config(4096, 2)
    nccl = buf.fake.nccl
    uids = sorted(c.uid for c in buf._pp.hybrid.links.comms.values())
    # what pp_wait_impl records on rank 1 (scale-up index 0) waiting for rank 0 (peer-table index 0 - 1 = -1)
    buf.error_record[:] = [1, pp.PHASE_PP, 0, -1, 5, 3, pp.WAIT_DATA, 0]
    with pytest.raises(TimeoutError, match=r'rank 1 waited for rank 0 .*aux 2 = pp_recv found no message'):
        buf.pp_recv(torch.zeros(16, dtype=torch.uint8), 0)
    assert sorted(e[1] for e in nccl.log if e[0] == 'abort') == uids
    buf._pp.destroy()
    assert not any(e[0] == 'destroy' for e in nccl.log)


def test_nccl_destroy_after_clean_use_destroys_the_communicators(monkeypatch):
    buf = hybrid_buffer(monkeypatch, 2, 1, 0, ['a', 'b'], 'auto')
    buf.pp_set_config(4096, 2)
    buf._pp.destroy()
    nccl = buf.fake.nccl
    assert sum(1 for e in nccl.log if e[0] == 'destroy') == 2 and not any(e[0] == 'abort' for e in nccl.log)
    assert buf._pp.hybrid is None


def test_hybrid_argument_errors_raise_before_any_launch_or_nccl_call(monkeypatch):
    buf = hybrid_buffer(monkeypatch, 4, 1, 0, ['a', 'b', 'c', 'd'], 'auto')
    buf.pp_set_config(4096, 2)
    nccl = buf.fake.nccl
    before = len(nccl.log)
    x = torch.zeros(1024, dtype=torch.uint8)
    for fn, exc, match in ((lambda: buf.pp_send(x, 2), ValueError, r'ring neighbours \[1, 3\]'),
                           (lambda: buf.pp_recv(x, 0), ValueError, 'ring neighbours'),
                           (lambda: buf.pp_send(torch.zeros(4097, dtype=torch.uint8), 1), ValueError,
                            'num_max_tensor_bytes'),
                           (lambda: buf.pp_send(x, 4), ValueError, 'out of range'),
                           (lambda: buf.pp_recv(x[1:17], 3), ValueError, '16-byte')):
        with pytest.raises(exc, match=match):
            fn()
    assert buf.launches == [] and len(nccl.log) == before
    assert buf._pp.num_sent == {} and buf._pp.num_recv == {}


def test_transport_setting_must_be_valid_and_agree(monkeypatch):
    buf = hybrid_buffer(monkeypatch, 2, 1, 0, ['a', 'a'], 'auto')
    monkeypatch.setenv('DEEPEP_CUPY_RAIL_TRANSPORT', 'nccl')        # two ranks of one GPU: NCCL refuses
    with pytest.raises(ValueError, match='share a GPU'):
        buf.pp_set_config(4096, 2)
    other = hybrid_buffer(monkeypatch, 2, 1, 0, ['a', 'b'], 'auto')
    calls = []
    other.group.check_same = lambda what, value, timeout=None: calls.append((what, value))
    other.pp_set_config(4096, 2)
    assert ('DEEPEP_CUPY_RAIL_TRANSPORT (PP links between domains)', 'auto') in calls


def test_launch_declarations_of_the_link_kernels_match_pp_cu():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location('_probe', Path(__file__).with_name('test_peer_copy.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.compile_probe('pp', [pp.WAIT_SPEC, pp.BUMP_SPEC])
    assert launch.KernelSpec is type(pp.WAIT_SPEC)


def test_link_kind_takes_nccl_between_nccl_hosts_on_one_gpu():
    from deepep_cupy.features.pp.links import link_kind
    ids = ['node0/0000:18:00.0', 'node1/0000:18:00.0']
    assert link_kind(0, 1, 1, ids, 'nccl') == 'nccl' and link_kind(0, 1, 1, ids, 'auto') == 'nccl'
    with pytest.raises(ValueError, match='NCCL_HOSTID'):
        link_kind(0, 1, 1, ['h/0000:18:00.0'] * 2, 'nccl')
    assert link_kind(0, 1, 1, ['h/0000:18:00.0'] * 2, 'auto') == 'loopback'
