"""PP across scale-up domains, end to end without a GPU: the real host code of every rank (threads), the PP kernels
replayed in Python on emulated device memory from their launch arguments (peer table, control words, headers, slots,
the NCCL outboxes), and NCCL point-to-point emulated with rendezvous semantics (a send completes only once the peer's
receive takes it) on worker threads, one per side stream. The rank program's random stress and back-pressure checks
then run over N x R shapes with loopback and NCCL links, plus mismatch, reconfiguration and timeout."""

import argparse
import collections
import ctypes
import itertools
import struct
import threading
from types import SimpleNamespace

import fakes
import numpy as np
import pytest
from test_pp_cpu import ThreadGroup, _CPUTorch, _rank_program, mismatch_and_reconfiguration

from deepep_cupy.buffers.base import WORKSPACE_BYTES
from deepep_cupy.features.pp import feature as pp_feature
from deepep_cupy.features.pp import links
from deepep_cupy.features.pp import plan as pp
from deepep_cupy.runtime import interop

torch = pytest.importorskip('torch')
MiB = 1 << 20


class Device:
    """Emulated memory of every rank (one address space: addresses are unique across ranks), the PP kernels, and
    NCCL. One condition variable orders everything."""

    def __init__(self):
        self.cond = threading.Condition()
        self.regions = {}           # base -> bytearray
        self.tables = {}            # address -> numpy uint64 table
        self.buffers = {}           # own symmetric base -> buffer (error records)
        self.channels = collections.defaultdict(collections.deque)     # NCCL uid -> pending sends
        self.streams = {}
        self.failed = []

    # ---- memory
    def region(self, base, num_bytes):
        self.regions[base] = bytearray(num_bytes)
        return base

    def _at(self, addr):
        for base, mem in self.regions.items():
            if base <= addr < base + len(mem):
                return mem, addr - base
        raise AssertionError(f'address {addr:#x} is not mapped')

    def read(self, addr, n):
        mem, off = self._at(addr)
        assert off + n <= len(mem)
        return bytes(mem[off:off + n])

    def write(self, addr, data):
        mem, off = self._at(addr)
        assert off + len(data) <= len(mem)
        mem[off:off + len(data)] = data

    def u32(self, addr):
        return struct.unpack('<I', self.read(addr, 4))[0]

    def set_u32(self, addr, value):
        self.write(addr, struct.pack('<I', value & 0xFFFFFFFF))

    def entry(self, peer_bases, idx):
        for base, table in self.tables.items():
            if base <= peer_bases < base + table.nbytes:
                return int(table[(peer_bases - base) // 8 + idx])
        raise AssertionError(f'{peer_bases:#x} is not a peer table')

    # ---- kernels (run at launch on the rank's thread, like a stream the host waits for)
    def _wait(self, cond_fn, a, own, peer, expected, aux):
        buf = self.buffers[own]
        if self.cond.wait_for(cond_fn, a['timeout_ns'] / 1e9):
            return True
        if buf.error_record[0] == 0:
            buf.error_record[:] = [1, pp.PHASE_PP, a['rank'], peer, expected, 0, aux, 0]
        return False

    def send(self, a):
        with self.cond:
            own = self.entry(a['peer_bases'], a['rank'])
            ctrl = own + pp.CTRL_OFFSET
            kd, ks, n = a['dst_slot_idx'], a['src_slot_idx_at_dst'], a['num_inflight']
            seq = self.u32(ctrl + 4 * (pp.WORD_NUM_SENT + kd))
            cursor = self.u32(ctrl + 4 * (12 + kd)) % n
            if not self._wait(lambda: self.u32(ctrl + 4 * (pp.WORD_CONSUMED_BY + kd)) >= seq + 1 - n, a, own,
                              a['dst'], seq + 1 - n, pp.WAIT_SLOT):
                return
            remote = self.entry(a['peer_bases'], a['dst'])
            idx = ks * n + cursor
            data = ctypes.string_at(a['x'], a['num_bytes']) if a['num_bytes'] else b''
            self.write(remote + a['slots_offset'] + idx * a['slot_bytes'], data)
            self.write(remote + a['headers_offset'] + idx * 16, struct.pack('<QII', a['num_bytes'], seq, 0))
            self.set_u32(ctrl + 4 * (pp.WORD_NUM_SENT + kd), seq + 1)
            self.set_u32(ctrl + 4 * (12 + kd), (cursor + 1) % n)
            self.set_u32(remote + pp.CTRL_OFFSET + 4 * (pp.WORD_SENT_FROM + ks), seq + 1)
            self.cond.notify_all()

    def recv(self, a):
        with self.cond:
            own = self.entry(a['peer_bases'], a['rank'])
            ctrl = own + pp.CTRL_OFFSET
            ks, kd, n = a['src_slot_idx'], a['dst_slot_idx_at_src'], a['num_inflight']
            seq = self.u32(ctrl + 4 * (pp.WORD_NUM_RECV + ks))
            cursor = self.u32(ctrl + 4 * (16 + ks)) % n
            if not self._wait(lambda: self.u32(ctrl + 4 * (pp.WORD_SENT_FROM + ks)) >= seq + 1, a, own, a['src'],
                              seq + 1, pp.WAIT_DATA):
                return
            idx = ks * n + cursor
            sent_bytes, sent_seq, _ = struct.unpack('<QII', self.read(own + a['headers_offset'] + idx * 16, 16))
            if sent_bytes == a['num_bytes'] and sent_seq == seq:
                if sent_bytes:
                    ctypes.memmove(a['x'], self.read(own + a['slots_offset'] + idx * a['slot_bytes'], sent_bytes),
                                   sent_bytes)
            else:
                error = self.buffers[own]._pp.error
                if error[0] == 0:
                    error[:] = [1, a['src'], seq, a['num_bytes'], 0, sent_bytes, 0, sent_seq]
            self.set_u32(ctrl + 4 * (pp.WORD_NUM_RECV + ks), seq + 1)
            self.set_u32(ctrl + 4 * (16 + ks), (cursor + 1) % n)
            remote = self.entry(a['peer_bases'], a['src'])
            self.set_u32(remote + pp.CTRL_OFFSET + 4 * (pp.WORD_CONSUMED_BY + kd), seq + 1)
            self.cond.notify_all()

    def wait(self, a):
        with self.cond:
            own = self.entry(a['peer_bases'], a['rank'])
            ctrl = own + pp.CTRL_OFFSET
            target = self.u32(ctrl + 4 * a['count_word']) + a['delta']
            self._wait(lambda: self.u32(ctrl + 4 * a['wait_word']) >= target, a, own, a['peer'], target, a['aux'])

    def bump(self, a):
        with self.cond:
            self.set_u32(a['word'], self.u32(a['word']) + 1)
            self.cond.notify_all()


class Stream:
    """A side stream: its operations run in order on a worker thread."""
    _ids = itertools.count(1)

    def __init__(self, dev):
        self.dev, self.ptr = dev, 0x5000_0000 + next(self._ids)
        self.queue, self.busy = collections.deque(), False
        dev.streams[self.ptr] = self
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.stopped = False
        self.thread.start()

    def wait_event(self, event):
        pass            # the communication stream's kernels already ran when the host recorded the event

    def put(self, op):
        with self.dev.cond:
            self.queue.append(op)
            self.dev.cond.notify_all()

    @property
    def done(self):
        with self.dev.cond:
            return not self.queue and not self.busy

    def synchronize(self):
        with self.dev.cond:
            self.dev.cond.wait_for(lambda: not self.queue and not self.busy, timeout=30)

    def _run(self):
        dev = self.dev
        while True:
            with dev.cond:
                dev.cond.wait_for(lambda: self.queue or self.stopped)
                if self.stopped:
                    return
                op = self.queue[0]
                self.busy = True
            try:
                op()
            except BaseException as e:      # noqa: BLE001 (reported by the test)
                dev.failed.append(e)
            with dev.cond:
                self.queue.popleft()
                self.busy = False
                dev.cond.notify_all()


class Comm:
    """One rank's end of an emulated 2-rank NCCL communicator: rendezvous send/recv of bytes."""

    def __init__(self, dev, nccl, uid, rank):
        self.dev, self.nccl, self.uid, self.rank, self.aborted = dev, nccl, uid, rank, False

    def send(self, ptr, count, dtype, peer, stream):
        self.nccl.group.append((stream, 'send', self, ptr, count))

    def recv(self, ptr, count, dtype, peer, stream):
        self.nccl.group.append((stream, 'recv', self, ptr, count))

    def abort(self):
        with self.dev.cond:
            self.aborted = True
            self.dev.cond.notify_all()

    def destroy(self):
        pass

    def run(self, kind, ptr, count):
        dev, chan = self.dev, self.dev.channels[self.uid]
        with dev.cond:
            if kind == 'send':
                item = [dev.read(ptr, count), False]
                chan.append(item)
                dev.cond.notify_all()
                dev.cond.wait_for(lambda: item[1] or self.aborted)
            else:
                dev.cond.wait_for(lambda: chan or self.aborted)
                if self.aborted:
                    return
                item = chan.popleft()
                assert len(item[0]) == count, f'NCCL sizes differ: sent {len(item[0])}, receiving {count}'
                dev.write(ptr, item[0])
                item[1] = True
                dev.cond.notify_all()


class Nccl:
    NCCL_UINT8 = 7
    _uids = itertools.count()

    def __init__(self, dev):
        self.dev, self.group = dev, None

    def get_unique_id(self):
        return f'uid{next(self._uids)}'

    def NcclCommunicator(self, size, uid, rank):       # noqa: N802
        assert size == 2
        return Comm(self.dev, self, uid, rank)

    def groupStart(self):                              # noqa: N802
        self.group = []

    def groupEnd(self):                                # noqa: N802
        ops, self.group = self.group, None
        self.dispatch(ops)

    def dispatch(self, ops):
        """One NCCL group: each stream's operations run in order on that stream."""
        by_stream = collections.defaultdict(list)
        for stream, kind, comm, ptr, count in ops:
            by_stream[stream].append((kind, comm, ptr, count))
        for sptr, items in by_stream.items():
            self.dev.streams[sptr].put(lambda items=items: [c.run(k, p, n) for k, c, p, n in items])


class StreamKernel(fakes.RecordingKernel):
    """A one-thread kernel: on a side stream it runs in that stream's order, else at once."""

    def _launch(self, grid, block, args, stream, shared_mem, cooperative):
        named = dict(zip(self.spec.param_names, args))
        if isinstance(stream, Stream):
            stream.put(lambda: self.run(named))
        else:
            self.run(named)


def run_hybrid(monkeypatch, num_domains, num_scaleup, gpus, setting, body, data_bytes=2 * MiB, timeout=20.0):
    W, R = num_domains * num_scaleup, num_scaleup
    dev = Device()
    shared = {'slots': [None] * W, 'barrier': threading.Barrier(W)}
    bases = [dev.region(0x7000_0000_0000 + g * 0x1_0000_0000, WORKSPACE_BYTES + data_bytes) for g in range(W)]
    bufs = []
    for g in range(W):
        base = g - g % R
        sym = SimpleNamespace(peer_bases_ptr=0, base=bases[g], peer_bases=bases[base:base + R],
                              num_bytes=WORKSPACE_BYTES + data_bytes)
        buf = fakes.make_buffer(num_ranks=W, rank=g, num_bytes=data_bytes, sym=sym, num_scaleup_ranks=R,
                                num_scaleout_ranks=num_domains, scaleup_rank_idx=g % R, scaleout_rank_idx=g // R,
                                error_rank_base=base, topology=SimpleNamespace(
                                    pci_bus_ids=tuple(gpus),
                                nccl_gpu_ids=tuple(gpus), scaleup_peers=list(range(base, base + R))))
        buf.group, buf.num_gpu_timeout_secs = ThreadGroup(g, shared), timeout
        monkeypatch.setattr(buf, 'synchronize', lambda stream=None, buf=buf: buf.check_usable(), raising=False)
        dev.buffers[bases[g]] = buf
        bufs.append(buf)
    kernels = SimpleNamespace(send=fakes.RecordingKernel(pp.SEND_SPEC, run=dev.send),
                              recv=fakes.RecordingKernel(pp.RECV_SPEC, run=dev.recv),
                              wait=StreamKernel(pp.WAIT_SPEC, run=dev.wait),
                              bump=StreamKernel(pp.BUMP_SPEC, run=dev.bump))
    monkeypatch.setattr(pp_feature, 'PPKernels', lambda: kernels)
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: fakes.FakeStream('current'))
    monkeypatch.setenv('DEEPEP_CUPY_RAIL_TRANSPORT', setting)
    monkeypatch.setattr(links, '_device_synchronize', lambda: None)
    counter = itertools.count(1)
    real = links.HybridPeers

    def to_device(table):
        addr = 0x4000_0000_0000 + next(counter) * 0x1_0000_0000
        dev.tables[addr] = table.copy()
        return addr, None

    def alloc(num_bytes):
        return dev.region(0x6000_0000_0000 + next(counter) * 0x1_0000_0000, num_bytes), None

    nccl = Nccl(dev)
    streams = []

    def make(b, s):
        def new_stream():
            streams.append(Stream(dev))
            return streams[-1]
        return real(b, s, nccl=_PerThreadNccl(nccl), make_stream=new_stream, to_device=to_device, alloc=alloc,
                    ipc_handle=lambda base: base.to_bytes(8, 'little'),
                    ipc_open=lambda h: int.from_bytes(h, 'little'), ipc_close=lambda p: None)
    monkeypatch.setattr(pp_feature, 'HybridPeers', make)
    errors = [None] * W

    def main(g):
        try:
            body(bufs[g], g)
        except BaseException as e:      # noqa: BLE001 (reported below)
            errors[g] = e
            shared['barrier'].abort()
    threads = [threading.Thread(target=main, args=(g,)) for g in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for s in streams:
        with dev.cond:
            s.stopped = True
            dev.cond.notify_all()
    assert not any(t.is_alive() for t in threads), 'emulated ranks hung'
    for g, e in enumerate(errors):
        if e is not None and not isinstance(e, threading.BrokenBarrierError):
            raise AssertionError(f'rank {g}: {type(e).__name__}: {e}') from e
    assert not any(errors) and not dev.failed, (errors, dev.failed)
    return dev, bufs


class _PerThreadNccl:
    """The NCCL module as each rank's thread sees it: group calls are per thread (per process on a GPU)."""

    def __init__(self, nccl):
        self._nccl, self._local = nccl, threading.local()
        self.NCCL_UINT8 = nccl.NCCL_UINT8

    def get_unique_id(self):
        return self._nccl.get_unique_id()

    def NcclCommunicator(self, size, uid, rank):       # noqa: N802
        comm = self._nccl.NcclCommunicator(size, uid, rank)
        comm.nccl = self
        return comm

    @property
    def group(self):
        return self._local.group

    def groupStart(self):                              # noqa: N802
        self._local.group = []

    def groupEnd(self):                                # noqa: N802
        ops, self._local.group = self._local.group, None
        self._nccl.dispatch(ops)


SHAPES = [(2, 1, 'nccl'), (2, 1, 'loopback'), (2, 2, 'nccl'), (2, 2, 'loopback'), (4, 1, 'nccl'), (3, 2, 'nccl'),
          (4, 1, 'loopback')]


@pytest.mark.parametrize('num_domains,num_scaleup,setting', SHAPES)
def test_rank_program_stress_and_back_pressure_across_domains(monkeypatch, num_domains, num_scaleup, setting):
    program = _rank_program()
    monkeypatch.setattr(program, 'torch', _CPUTorch())
    monkeypatch.setattr(program, 'sleep_gpu', lambda cycles, stream=None: None)
    W = num_domains * num_scaleup
    shape = (8, 64)
    args = argparse.Namespace(num_stress_iterations=3, num_sends=96, num_max_inflight_tensors=2, num_sleep_cycles=0,
                              num_sms=0, seed=3)
    gpus = [f'gpu{g // num_scaleup}' for g in range(W)] if setting == 'nccl' else ['gpu0'] * W

    def body(buf, rank):
        buf.pp_set_config(8 * 64 * 2, args.num_max_inflight_tensors)
        assert program.run_stress(buf, args, shape, rank, W) > 0
        program.run_back_pressure(buf, args, rank, W, shape)
        buf.group.barrier()
    dev, bufs = run_hybrid(monkeypatch, num_domains, num_scaleup, gpus, setting, body)
    assert pp.unmatched_messages([(b._pp.num_sent, b._pp.num_recv) for b in bufs]) == []
    kinds = {nb.kind for b in bufs for nb in b._pp.hybrid.neighbours.values()}
    assert setting in kinds and (num_scaleup == 1 or 'nvlink' in kinds)
    if setting == 'nccl':
        assert all(len(q) == 0 for q in dev.channels.values())      # every NCCL send was received


@pytest.mark.parametrize('setting', ['nccl', 'loopback'])
def test_mismatch_reconfiguration_and_timeout_across_domains(monkeypatch, setting):
    def body(buf, rank):
        peer = 1 - rank
        out = mismatch_and_reconfiguration(buf, rank, f'from rank {peer} got a tensor of 8192 bytes but the matching '
                                                      f'pp_send sent 4096 bytes')
        if rank == 1:                   # nobody sends to rank 1: a bounded wait naming rank 0, then the abort
            buf.num_gpu_timeout_secs = 0.2
            buf._pp._bound.clear()      # the kernels bind the timeout once: rebind with the short one
            buf.pp_recv(out, peer)
            with pytest.raises(TimeoutError, match=r'pp send/recv: rank 1 waited for rank 0 .*aux 2\)'):
                buf.synchronize()
            with pytest.raises(RuntimeError, match='unusable'):
                buf.pp_send(out, peer)
            if setting == 'nccl':
                assert buf._pp.hybrid.links.aborted
        buf.group.barrier()
        buf._pp.destroy()
    gpus = ['a', 'b'] if setting == 'nccl' else ['a', 'a']
    run_hybrid(monkeypatch, 2, 1, gpus, setting, body)


def test_nccl_send_beyond_the_slots_times_out_naming_the_receiver(monkeypatch):
    def body(buf, rank):
        buf.pp_set_config(4096, 2)
        buf.group.barrier()
        if rank == 0:                   # rank 1 never receives: 2 sends fit, the third waits and gives up
            buf.num_gpu_timeout_secs = 0.3
            for _ in range(3):
                buf.pp_send(torch.zeros(64, dtype=torch.uint8), 1)
            with pytest.raises(TimeoutError, match=r'rank 0 waited for rank 1 .*aux 1\)'):
                buf.synchronize()
            with pytest.raises(RuntimeError, match='unusable'):    # the next PP call aborts the communicators
                buf.pp_recv(torch.zeros(64, dtype=torch.uint8), 1)
            assert buf._pp.hybrid.links.aborted
        buf.group.barrier()
        buf._pp.destroy()
    run_hybrid(monkeypatch, 2, 1, ['a', 'b'], 'nccl', body)


def test_emulator_tables_are_numpy():
    assert links.table_entries(2, 0, {0: 1}).dtype == np.uint64
