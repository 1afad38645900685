"""All-gather / reduce-scatter / all-reduce across scale-up domains (hybrid mode) without a GPU: the hybrid numpy
references against an independent computation, the hybrid layouts and size hints, `plan_ranges`, and the rank
program's stress (tests/agrs.py) on N x R emulated ranks (threads): the real host code of features/agrs with emulated
kernels, and rail exchanges issued through `NcclRailTransport` on a recording fake NCCL whose calls must match between
every rail pair (same groups, same sends / receives in the same order with the same sizes) before bytes move."""

import ctypes
from types import SimpleNamespace

import fakes as buffer_fakes
import numpy as np
import pytest

from deepep_cupy import ElasticBuffer
from deepep_cupy.buffers import agrs_rails, elastic
from deepep_cupy.features.agrs import feature as agrs_feature
from deepep_cupy.features.agrs import kernels as agrs_kernels
from deepep_cupy.features.agrs import plan as agrs_plan
from deepep_cupy.features.agrs import reference as ref
from deepep_cupy.runtime import interop, rail_nccl, rails, streams, workspace
from deepep_cupy.runtime.group import ProcessGroup

MiB = 1 << 20


# ---- references ----------------------------------------------------------------------------------------------------
def _bf16_round(v):
    return ref.bf16_bits_to_f32(ref.f32_to_bf16_bits(v))


def _independent_rs(inputs, rank, N, stage_bf16, scale, out_bf16):
    """Element by element with Python floats rounded to FP32 after every operation (numpy float32 scalars)."""
    W = len(inputs)
    R, n = W // N, inputs[0].size // W
    vals = [ref.bf16_bits_to_f32(x) if x.dtype == np.uint16 else x for x in inputs]
    out = np.empty(n, np.float32)
    for i in range(n):
        total = None
        for m in range(N):
            part = None
            for r in range(R):
                v = np.float32(vals[m * R + r][rank * n + i])
                if stage_bf16:
                    v = _bf16_round(np.array([v], np.float32))[0]
                part = v if part is None else np.float32(part + v)
            total = part if total is None else np.float32(total + part)
        out[i] = np.float32(total * np.float32(scale))
    return ref.f32_to_bf16_bits(out) if out_bf16 else out


@pytest.mark.parametrize('N,R', [(2, 1), (2, 2), (3, 2), (4, 1), (2, 4)])
@pytest.mark.parametrize('case', ['fp32', 'bf16-comm', 'bf16-in'])
def test_hybrid_reduce_scatter_reference_matches_an_independent_sum(N, R, case):
    rng = np.random.default_rng(N * 10 + R)
    W, n = N * R, 16
    xs = [rng.standard_normal(W * n, dtype=np.float32) * 1000 for _ in range(W)]
    if case == 'bf16-in':
        xs = [ref.f32_to_bf16_bits(x) for x in xs]
    comm = 'bf16' if case == 'bf16-comm' else 'fp32'
    for rank in (0, W - 1):
        got = ref.hybrid_reduce_scatter_reference(xs, rank, N, comm, 0.5)
        want = _independent_rs(xs, rank, N, case != 'fp32', 0.5, case == 'bf16-in')
        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_hybrid_references_reduce_to_the_flat_ones_and_differ_in_order():
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(4 * 64, dtype=np.float32) * 1e4 for _ in range(4)]
    # One domain: the intranode reference. One rank per domain: the same order as the flat sum.
    for N in (1, 4):
        assert np.array_equal(ref.hybrid_reduce_scatter_reference(xs, 1, N, 'fp32', 0.25),
                              ref.reduce_scatter_reference(xs, 1, 'fp32', 0.25))
        assert np.array_equal(ref.hybrid_all_reduce_reference(xs, N, 0.25), ref.all_reduce_reference(xs, 0.25))
    # 2 x 2: (x0 + x1) + (x2 + x3) is another rounding than ((x0 + x1) + x2) + x3 for some elements.
    flat, hyb = ref.all_reduce_reference(xs), ref.hybrid_all_reduce_reference(xs, 2)
    assert not np.array_equal(flat, hyb)
    want = ((xs[0] + xs[1]).astype(np.float32) + (xs[2] + xs[3]).astype(np.float32)).astype(np.float32)
    assert np.array_equal(hyb, want)
    # Integers: every order is exact, so the sum is the float64 one.
    ints = [rng.integers(-100, 100, 4 * 8).astype(np.float32) for _ in range(6)]
    assert np.array_equal(ref.hybrid_all_reduce_reference(ints, 3), np.sum(np.stack(ints).astype(np.float64), 0))
    with pytest.raises(ValueError, match='domains'):
        ref.hybrid_all_reduce_reference(xs, 3)


# ---- layouts, hints, plans ------------------------------------------------------------------------------------------
def test_hybrid_layouts_do_not_overlap_and_hints_cover_them():
    for N, R, n, item in ((2, 1, 8, 4), (2, 4, 1000, 2), (8, 8, 64, 4)):
        lay = agrs_plan.hybrid_reduce_scatter_layout(N, R, n, item, 64)
        assert lay.inner.num_bytes <= lay.xp_offset and lay.xp_offset + N * R * n * 4 <= lay.send_offset
        assert lay.send_offset + N * n * 4 <= lay.recv_offset and lay.recv_offset + N * n * 4 == lay.num_bytes
        assert lay.inner.shard_elems == N * n and lay.inner.num_elems == N * R * n
        hint = agrs_plan.hybrid_reduce_num_bytes(N, R, N * R * n, 'reduce_scatter', 'bf16' if item == 2 else 'fp32')
        assert hint >= lay.num_bytes
        for numel in (1, 777, 100_000):
            ar = agrs_plan.hybrid_all_reduce_layout(N, R, numel, 64)
            assert ar.slots_offset >= ar.inner.num_bytes and ar.slot_bytes >= numel * 4
            assert agrs_plan.hybrid_reduce_num_bytes(N, R, numel) == ar.num_bytes
    assert agrs_plan.hybrid_reduce_num_bytes(1, 4, 4096) == agrs_plan.reduce_num_bytes(4, 4096)
    with pytest.raises(ValueError, match='op'):
        agrs_plan.hybrid_reduce_num_bytes(2, 2, 64, 'gather')
    with pytest.raises(ValueError, match='comm_precision'):
        agrs_plan.hybrid_reduce_num_bytes(2, 2, 64, 'reduce_scatter', 'fp16')


def test_hybrid_domains_and_buffer_hint(monkeypatch):
    monkeypatch.delenv('DEEPEP_CUPY_SCALEUP_SIZE', raising=False)
    assert agrs_plan.hybrid_domains(4) == (1, 4)
    g = ProcessGroup(0, 4)
    g.host_of_rank = [0, 0, 1, 1]
    assert agrs_plan.hybrid_domains(g) == (2, 2)
    monkeypatch.setenv('DEEPEP_CUPY_SCALEUP_SIZE', '1')
    assert agrs_plan.hybrid_domains(4) == (4, 1) and agrs_plan.hybrid_domains(g) == (4, 1)
    # The rail area lives in the workspace: a session may fill num_bytes (DeepEP's test_agrs.py does).
    assert ElasticBuffer.get_agrs_buffer_size_hint(4, 2 * MiB) == 2 * MiB
    # The reductions' hint follows the domains: rail slots of N domains.
    assert (ElasticBuffer.get_agrs_reduce_num_bytes(4, 1000) ==
            agrs_plan.hybrid_all_reduce_layout(4, 1, 1000, 2).num_bytes > agrs_plan.reduce_num_bytes(4, 1000))


def test_plan_ranges():
    top = rails.rail_topology(6, 2, 3)          # domain 1 of 3, scale-up index 1
    plan = rails.plan_ranges(top, 'all-gather', {2: [(64, 96, 32)], 0: [(0, 16, 16), (8, 8, 0)]},
                             {0: [(128, 160, 16)]})
    assert plan.num_chunks == 1 and plan.phase == 'all-gather'
    assert [(o.peer, o.kind, o.offset, o.peer_offset, o.num_bytes) for o in plan.ops] == [
        (0, 'send', 0, 16, 16), (0, 'recv', 128, 160, 16), (2, 'send', 64, 96, 32)]      # empty range dropped
    with pytest.raises(ValueError, match='not rail peers'):
        rails.plan_ranges(top, 'x', {1: [(0, 0, 16)]}, {})
    with pytest.raises(ValueError, match='negative'):
        rails.plan_ranges(top, 'x', {0: [(-16, 0, 16)]}, {})


def test_hybrid_kernel_specs():
    names = [s.name for s in agrs_kernels.hybrid_specs()]
    assert names == ['deepep::agrs_rail_meta_kernel', 'deepep::agrs_hybrid_permute_kernel<false>',
                     'deepep::agrs_hybrid_permute_kernel<true>', 'deepep::agrs_hybrid_sum_kernel<false>',
                     'deepep::agrs_hybrid_sum_kernel<true>']
    assert set(names) <= {s.name for s in agrs_kernels.shipped_specs()['agrs']}
    from test_peer_copy import compile_probe
    compile_probe('agrs', agrs_kernels.hybrid_specs())


@pytest.mark.slow
def test_hybrid_kernels_compile_for_sm90():
    from deepep_cupy.jit import compiler
    specs = agrs_kernels.hybrid_specs() + agrs_kernels.all_specs(2)
    module = compiler.compile_cubin('agrs', [s.name for s in specs], arch='90', use_cache=False)
    assert module.cubin[:4] == b'\x7fELF' and set(module.lowered) == {s.name for s in specs}


def test_rail_constants_match_the_kernel():
    import re

    from deepep_cupy.jit import compiler
    source = (compiler.kernels_dir() / 'agrs.cu').read_text()
    assert re.search(rf'kAgrsRailSendHeader = {agrs_kernels.RAIL_SEND_HEADER}\b', source)
    assert re.search(rf'kAgrsRailRecvHeader = {agrs_kernels.RAIL_RECV_HEADER}\b', source)
    assert re.search(rf'kAgrsRailMetaWord = {agrs_kernels.RAIL_META_WORD}\b', source)
    assert re.search(r'kAgrsMetaMismatch = 0xFFFFFFFEu, kAgrsMetaSkip = 0xFFFFFFFFu', source)
    # The loopback flags of up to 8 domains end before the headers; the headers of MAX_DOMAINS fit the rail area.
    assert (1 + 2 * 8) * rails.FLAG_STRIDE <= agrs_kernels.RAIL_SEND_HEADER
    assert agrs_kernels.RAIL_SEND_HEADER + 16 <= agrs_kernels.RAIL_META_WORD < agrs_kernels.RAIL_RECV_HEADER
    assert agrs_kernels.RAIL_RECV_HEADER + 16 * agrs_kernels.MAX_DOMAINS <= agrs_kernels.RAIL_BYTES


# ---- emulated ranks -------------------------------------------------------------------------------------------------
class _RecordingNccl:
    """This rank's NCCL module and rail communicator for `NcclRailTransport`: the calls are recorded."""
    NCCL_UINT8 = 7

    def __init__(self):
        self.calls = []

    def groupStart(self):
        self.calls.append(('start',))

    def groupEnd(self):
        self.calls.append(('end',))

    def send(self, ptr, n, dtype, peer, stream):
        self.calls.append(('send', ptr, n, dtype, peer))

    def recv(self, ptr, n, dtype, peer, stream):
        self.calls.append(('recv', ptr, n, dtype, peer))

    def abort(self):
        self.calls.append(('abort',))

    def destroy(self):
        pass


class _EmuNcclTransport(rail_nccl.NcclRailTransport):
    """`NcclRailTransport` on a recording fake; after each exchange every rank checks its calls against its rail peers'
    (what real NCCL needs to match) and pulls the bytes of its receives from the peers' host memory. `strict = False`
    lets sizes differ (the loopback transport's pull semantics: the receiver's size)."""

    strict = True

    def __init__(self, top, base, group):
        self.rec = _RecordingNccl()
        super().__init__(top, base, self.rec, self.rec)
        self.group, self.log = group, []

    def exchange(self, plan, stream):
        self.rec.calls = []
        super().exchange(plan, stream)
        calls = self.rec.calls
        self.log.append((plan.phase, [c[:1] + c[2:] if c[0] in ('send', 'recv') else c for c in calls]))
        everyone = self.group.allgather_object((self.rails.domain_idx, plan.phase, calls))
        me = self.rails.domain_idx
        for m in self.rails.peer_domains:
            dom, phase, theirs = everyone[self.rails.rail_rank_of(m)]
            assert dom == m and phase == plan.phase
            assert [c for c in theirs if c[0] in ('start', 'end')] == [c for c in calls if c[0] in ('start', 'end')]
            sends = [c for c in theirs if c[0] == 'send' and c[4] == me]
            recvs = [c for c in calls if c[0] == 'recv' and c[4] == m]
            assert len(sends) == len(recvs)
            if self.strict:
                assert [c[2] for c in sends] == [c[2] for c in recvs], f'{plan.phase}: {m} -> {me} sizes differ'
            assert all(c[2] > 0 and c[3] == self.rec.NCCL_UINT8 for c in sends)
            for s, r in zip(sends, recvs):
                ctypes.memmove(r[1], s[1], r[2])
        self.group.allgather_object(None)        # nobody changes a source before every rank copied


class _EmuAGRS(agrs_feature.AGRS):
    """The feature's host code with the kernels emulated on host memory (`buf.mem`, the symmetric buffer)."""

    def __init__(self, buf, **_):
        self.signal, self.meta, self.shards = {}, {}, {}
        top = rails.rail_topology(buf.num_ranks, buf.num_scaleup_ranks, buf.rank_idx)
        fake = agrs_rails.AGRSRails.__new__(agrs_rails.AGRSRails)
        fake.rails, fake.rail_offset, fake.mapping, fake.kind = top, workspace.AGRS_RAIL.offset, None, 'nccl'
        fake.transport = _EmuNcclTransport(top, buf.sym.base, buf.group)
        fake.barrier_plan = fake.header_plan('barrier')
        super().__init__(buf, rails=fake)
        import torch
        self._bytes['torch'] = torch.from_numpy(buf.mem[self.area_offset:])

    def _copy(self, dst, src, num_bytes, stream):
        ctypes.memmove(dst, src, num_bytes)

    def _domain_rows(self, rows):
        """The rows of this rank's domain, by scale-up index."""
        buf = self._buf
        R = buf.num_scaleup_ranks
        return rows[self.domain * R:(self.domain + 1) * R]

    def load_hybrid_kernels(self):
        k = {'rail_meta': buffer_fakes.RecordingKernel(agrs_kernels.rail_meta_spec(), run=self._rail_meta)}
        for flag in (False, True):
            k[('permute', flag)] = buffer_fakes.RecordingKernel(agrs_kernels.permute_spec(flag),
                                                                run=lambda a, f=flag: self._permute(a, f))
            k[('sum', flag)] = buffer_fakes.RecordingKernel(agrs_kernels.sum_spec(flag),
                                                            run=lambda a, f=flag: self._sum(a, f))
        return k

    def load_kernels(self, n):
        k = {'gather': buffer_fakes.RecordingKernel(agrs_kernels.gather_spec(n), run=self._gather),
             'gather_batch': buffer_fakes.RecordingKernel(agrs_kernels.gather_batch_spec(n), run=self._no_batch),
             'wait': buffer_fakes.RecordingKernel(agrs_kernels.wait_spec(n), run=self._wait),
             'unpack': buffer_fakes.RecordingKernel(agrs_kernels.unpack_spec(n), run=self._unpack)}
        for i, s in agrs_kernels.REDUCE_VARIANTS:
            k[('reduce', i, s)] = buffer_fakes.RecordingKernel(agrs_kernels.reduce_spec(n, i, s),
                                                               run=lambda a, i=i, s=s: self._reduce(a, i, s))
        return k

    @staticmethod
    def _no_batch(a):
        raise AssertionError('hybrid mode launches agrs_gather_kernel per tensor and step, not the batched kernel')

    # kernels/agrs.cu, on host memory
    def _gather(self, a):
        buf = self._buf
        data = ctypes.string_at(a['src'], a['num_bytes'])
        meta = a['meta']
        if a['do_signal'] and a['meta_word']:
            meta = ctypes.c_uint32.from_address(a['meta_word']).value
        rows = self._domain_rows(buf.group.allgather_object(
            (a['region_offset'], a['num_bytes'], data, a['do_signal'], a['epoch'], meta)))
        me = buf.sym.local_idx
        for r, (offset, n, d, signal, epoch, m) in enumerate(rows):
            if r != me or a['write_local']:
                buf.mem[offset + r * n:offset + (r + 1) * n] = np.frombuffer(d, np.uint8)
            if signal and m != agrs_kernels.META_SKIP:
                self.signal[r], self.meta[(r, epoch % 32)] = epoch, m

    def _wait(self, a):
        for p in range(self._buf.num_scaleup_ranks):
            if self.signal.get(p, 0) < a['epoch'] or self.meta[(p, a['epoch'] % 32)] != a['meta']:
                raise TimeoutError(f'emulated GPU wait: scale-up rank {p}: epoch {self.signal.get(p)} meta '
                                   f'{self.meta.get((p, a["epoch"] % 32))}, want {a["epoch"]} {a["meta"]}')

    def _reduce(self, a, in_bf16, stage_bf16):
        buf = self._buf
        dtype = np.uint16 if in_bf16 else np.float32
        num_elems, c = a['num_elems'], a['shard_elems']
        x = np.frombuffer(ctypes.string_at(a['x'], num_elems * np.dtype(dtype).itemsize), dtype=dtype).copy()
        xs = self._domain_rows(buf.group.allgather_object(x))
        lo = min(num_elems, buf.sym.local_idx * c)
        hi = min(num_elems, lo + c)
        result = ref.reduce_reference([v[lo:hi] for v in xs], stage_bf16, a['scale'], in_bf16)
        ctypes.memmove(a['out'], result.tobytes(), result.nbytes)
        shards = self._domain_rows(buf.group.allgather_object(result))
        self.shards[a['epoch']] = shards if a['is_all_reduce'] == 1 else None

    def _unpack(self, a):
        if a['num_elems'] == 0:
            assert a['publish_done'] == 1
            return
        for p, shard in enumerate(self.shards.pop(a['epoch'])):
            if p != self._buf.sym.local_idx and shard.size:
                ctypes.memmove(a['x'] + p * a['shard_elems'] * 4, shard.tobytes(), shard.nbytes)

    def _rail_meta(self, a):
        word = ctypes.c_uint32
        if a['mode'] == 0:
            word.from_address(a['rail'] + agrs_kernels.RAIL_SEND_HEADER).value = a['meta']
            return
        eff = a['meta']
        for m in range(a['num_domains']):
            if m != a['domain'] and word.from_address(a['rail'] + agrs_kernels.RAIL_RECV_HEADER + 16 * m).value != eff:
                eff = agrs_kernels.META_MISMATCH
        word.from_address(a['rail'] + agrs_kernels.RAIL_META_WORD).value = eff

    def _permute(self, a, in_bf16):
        n, N, R = a['shard_elems'], a['num_domains'], a['num_scaleup']
        dtype = np.uint16 if in_bf16 else np.float32
        x = np.frombuffer(ctypes.string_at(a['x'], N * R * n * np.dtype(dtype).itemsize), dtype=dtype)
        x = ref.bf16_bits_to_f32(x) if in_bf16 else x
        xp = x.reshape(N, R, n).transpose(1, 0, 2).astype(np.float32).copy()
        ctypes.memmove(a['xp'], xp.tobytes(), xp.nbytes)

    def _sum(self, a, out_bf16):
        n, N = a['num_elems'], a['num_domains']
        parts = []
        for m in range(N):
            ptr = a['own'] if m == a['domain'] else a['slots'] + m * a['slot_bytes']
            parts.append(np.frombuffer(ctypes.string_at(ptr, n * 4), np.float32).copy())
        out = ref.reduce_reference(parts, False, a['scale'], out_bf16)
        ctypes.memmove(a['out'], out.tobytes(), out.nbytes)


def _hybrid_host_buffer(group, N, R, num_bytes):
    mem = np.zeros((2 << 20) + num_bytes, dtype=np.uint8)
    g = group.rank
    sym = SimpleNamespace(base=mem.ctypes.data, local_idx=g % R, peer_bases_ptr=0x1000, num_bytes=mem.size,
                          num_peers=R)
    buf = buffer_fakes.make_buffer(group.size, g, num_bytes, group=group, sym=sym, num_gpu_timeout_secs=1.0,
                                   num_cpu_timeout_secs=60.0, num_scaleup_ranks=R, num_scaleout_ranks=N,
                                   scaleup_rank_idx=g % R, scaleout_rank_idx=g // R)
    buf.mem = mem
    buf.claim_data_region = lambda owner: None
    buf.barrier = lambda use_comm_stream=True, with_cpu_sync=False, sequential=True: group.barrier()
    buf.synchronize = lambda stream=None: None
    return buf


@pytest.fixture()
def emulated(monkeypatch):
    torch = pytest.importorskip('torch')
    from deepep_cupy.tests import agrs as prog
    current = buffer_fakes.FakeStream('current')
    monkeypatch.setattr(elastic, 'AGRS', _EmuAGRS)
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: current)
    monkeypatch.setattr(interop, 'Allocator', lambda kind: type('A', (), {'empty': staticmethod(
        lambda shape, dtype, stream=None: torch.empty(shape, dtype=getattr(torch, dtype)))})())
    monkeypatch.setattr(streams, 'EventHandle', buffer_fakes.FakeEventHandle)
    monkeypatch.setattr(torch.cuda, 'ExternalStream', lambda ptr: None)
    monkeypatch.setattr(torch.Tensor, 'record_stream', lambda self, stream: None)
    monkeypatch.setattr(prog, 'DEVICE', 'cpu')
    monkeypatch.setattr(prog, 'STRESS_SHAPE', (4, 8, 64))
    return prog


def _run_ranks(N, R, fn):
    from concurrent.futures import ThreadPoolExecutor
    W = N * R
    exchange = buffer_fakes.ThreadExchange(W, timeout=60)
    with ThreadPoolExecutor(W) as pool:
        return list(pool.map(lambda g: fn(buffer_fakes.ThreadGroup(g, W, exchange)), range(W)))


@pytest.mark.parametrize('N,R', [(2, 1), (2, 2), (3, 1), (2, 3)])
def test_rank_program_stress_in_hybrid_mode(N, R, emulated, monkeypatch):
    from argparse import Namespace

    import torch
    prog = emulated
    monkeypatch.setenv('DEEPEP_CUPY_SCALEUP_SIZE', str(R))      # the size hints see the domains
    args = Namespace(seed=11, num_stress_gathers=10, num_stress_reductions=10, num_max_inflight_agrs=4, num_sms=0)

    def rank_main(group):
        session = ElasticBuffer.get_agrs_num_max_session_bytes(group, [prog.STRESS_SHAPE] * 4, torch.bfloat16)
        reduce_bytes = max(ElasticBuffer.get_agrs_reduce_num_bytes(group, 100_000),
                           ElasticBuffer.get_agrs_reduce_num_bytes(group, N * R * 8 * 6000, 'reduce_scatter'))
        buf = _hybrid_host_buffer(group, N, R, ElasticBuffer.get_agrs_buffer_size_hint(group, session, reduce_bytes))
        buf.agrs_set_config(session, 4)
        checked = sum(prog.run_stress(buf, args, it) for it in range(2))
        tried = prog.test_errors(buf, args)
        return checked, tried, buf._agrs.rails.transport.log

    results = _run_ranks(N, R, rank_main)
    for checked, tried, _ in results:
        assert checked == 2 * (10 + 10) and len(tried) >= 15
    # Every rail peer issued the same exchanges (phases and, per exchange, the same groups), and some of each kind.
    logs = [log for _, _, log in results]
    for g in range(N * R):
        assert [p for p, _ in logs[g]] == [p for p, _ in logs[g % R]]
    assert {p for p, _ in logs[0]} == {'all-gather', 'reduce-scatter', 'all-reduce'}


def test_hybrid_stress_catches_a_wrong_reference(emulated, monkeypatch):
    """The emulated hybrid stress compares for real: the flat (intranode-order) reference must not pass for 2 x 2."""
    monkeypatch.setattr(ref, 'hybrid_all_reduce_reference', lambda inputs, n, scale=1.0: ref.all_reduce_reference(
        inputs, scale))
    with pytest.raises(emulated.Failure, match='mismatch'):
        test_rank_program_stress_in_hybrid_mode(2, 2, emulated, monkeypatch)


def test_hybrid_gather_reports_ranks_that_disagree_on_sizes(emulated, monkeypatch):
    import torch
    monkeypatch.setenv('DEEPEP_CUPY_SCALEUP_SIZE', '1')
    monkeypatch.setattr(_EmuNcclTransport, 'strict', False)     # the loopback's semantics (NCCL needs equal sizes)

    def rank_main(group):
        buf = _hybrid_host_buffer(group, 2, 1, ElasticBuffer.get_agrs_buffer_size_hint(group, 2 * MiB))
        buf.agrs_set_config(2 * MiB, 4)
        with buf.agrs_new_session():
            out, handle = buf.all_gather(torch.zeros(4096 if group.rank == 0 else 8192, dtype=torch.uint8))
            try:
                handle()
            except TimeoutError as e:
                return str(e)
        return 'no error'

    # One rank per domain: only the rail header tells the two apart (no domain peer compares metas).
    assert all('epoch' in r and str(agrs_kernels.META_MISMATCH) in r for r in _run_ranks(2, 1, rank_main))


def test_hybrid_argument_errors_before_any_exchange(emulated, monkeypatch):
    import torch
    monkeypatch.setenv('DEEPEP_CUPY_SCALEUP_SIZE', '2')

    def rank_main(group):
        buf = _hybrid_host_buffer(group, 2, 2, 4 * MiB)
        out = []
        for what, fn in (
                ('session over num_bytes', lambda: buf.agrs_set_config(4 * MiB + 32)),
                ('first dim', lambda: buf.reduce_scatter(torch.zeros(4 * 8 + 2))),
                ('shard', lambda: buf.reduce_scatter(torch.zeros(4 * 4))),
                ('reduction area', lambda: buf.all_reduce(torch.zeros(MiB)))):
            try:
                fn()
                out.append((what, 'no error'))
            except ValueError as e:
                out.append((what, str(e)))
        return out, len(buf._agrs.rails.transport.log)

    for out, num_exchanges in _run_ranks(2, 2, rank_main):
        assert num_exchanges == 0
        d = dict(out)
        assert 'exceeds' in d['session over num_bytes']
        assert 'divisible by R=4' in d['first dim'] and 'multiple of 8' in d['shard']
        assert 'num_bytes >=' in d['reduction area']


# ---- the rails a hybrid buffer makes (buffers/agrs_rails.py) and the timeout path ------------------------------------
class _FakeNcclModule:
    """One rank's `cupy.cuda.nccl` stand-in: a shared unique id, a communicator that records its construction."""
    NCCL_UINT8 = 7

    def __init__(self):
        self.made = []

    @staticmethod
    def get_unique_id():
        return b'u' * 128

    def NcclCommunicator(self, size, uid, rank):
        self.made.append((size, uid, rank))
        return _RecordingNccl()


def _rails_buffer(group, N, R, pci=None):
    buf = _hybrid_host_buffer(group, N, R, 2 * MiB)
    ids = pci or [f'gpu{g}' for g in range(N * R)]
    buf.topology = SimpleNamespace(pci_bus_ids=ids, nccl_gpu_ids=ids)
    return buf


def test_agrs_rails_over_nccl(monkeypatch):
    monkeypatch.delenv('DEEPEP_CUPY_RAIL_TRANSPORT', raising=False)

    def rank_main(group):
        nccl = _FakeNcclModule()
        r = agrs_rails.AGRSRails(_rails_buffer(group, 3, 2), workspace.AGRS_RAIL.offset, nccl=nccl,
                                 events=SimpleNamespace())
        assert r.transport.watchdog is not None and r.transport.watchdog.timeout_s == 1.0      # num_gpu_timeout_secs
        ops = [(o.peer, o.kind, o.offset - workspace.AGRS_RAIL.offset, o.peer_offset - workspace.AGRS_RAIL.offset,
                o.num_bytes) for o in r.barrier_plan.ops]
        return r.kind, nccl.made, r.rails.rail_ranks, ops

    for g, (kind, made, rail, ops) in enumerate(_run_ranks(3, 2, rank_main)):
        n = g // 2
        assert kind == 'nccl' and made == [(3, b'u' * 128, n)] and rail == (g % 2, 2 + g % 2, 4 + g % 2)
        # The barrier: the 16-byte send header to every rail peer's receive header [n], theirs into [m].
        S, H = agrs_kernels.RAIL_SEND_HEADER, agrs_kernels.RAIL_RECV_HEADER
        assert ops == [x for m in range(3) if m != n for x in ((m, 'send', S, H + 16 * n, 16),
                                                                  (m, 'recv', H + 16 * m, S, 16))]


def test_agrs_rails_refuse_bad_setups(monkeypatch):
    # Ranks that share a GPU cannot be NCCL rail peers; too many loopback peers; transports that disagree.
    monkeypatch.setenv('DEEPEP_CUPY_RAIL_TRANSPORT', 'nccl')
    with pytest.raises(ValueError, match='share a GPU'):
        agrs_rails.AGRSRails(_rails_buffer(buffer_fakes.AgreeingGroup(0, 2), 2, 1, ['gpu0', 'gpu0']), 0,
                             nccl=_FakeNcclModule())
    monkeypatch.setenv('DEEPEP_CUPY_RAIL_TRANSPORT', 'loopback')
    with pytest.raises(ValueError, match='at most 8 rail peers'):
        agrs_rails.AGRSRails(_rails_buffer(buffer_fakes.AgreeingGroup(0, 10), 10, 1), 0)
    monkeypatch.setenv('DEEPEP_CUPY_RAIL_TRANSPORT', 'auto')

    def rank_main(group):
        pci = ['gpu0', 'gpu1', 'gpu0', 'gpu1']      # rail 0: ranks 0, 2 share gpu0 (loopback); rail 1 likewise
        if group.rank == 3:
            pci = ['gpu0', 'gpu1', 'gpu2', 'gpu3']  # a rank that sees other GPUs picks NCCL
        try:
            agrs_rails.AGRSRails(_rails_buffer(group, 2, 2, pci), 0, nccl=_FakeNcclModule())
        except ValueError as e:
            return str(e)
    assert all('different transports' in m for m in _run_ranks(2, 2, rank_main))


def test_a_gpu_timeout_aborts_the_rails(emulated, monkeypatch):
    import torch
    monkeypatch.setenv('DEEPEP_CUPY_SCALEUP_SIZE', '1')

    def rank_main(group):
        buf = _hybrid_host_buffer(group, 2, 1, 4 * MiB)
        buf.agrs_set_config(2 * MiB, 4)

        def timed_out():
            raise TimeoutError('deepep_cupy rank 0: GPU wait timed out after 1 s in hybrid rail exchange (all-gather)')
        buf.check_usable = timed_out
        buf.error_record[0] = 1         # (what a kernel's timeout report writes; calls check the record first)
        transport = buf._agrs.rails.transport
        out = []
        for _ in range(2):
            try:
                buf.reduce_scatter(torch.zeros(16))
            except TimeoutError as e:
                out.append(str(e))
        return out, transport.aborted, transport.rec.calls[-1:]

    for (first, second), aborted, last in _run_ranks(2, 1, rank_main):
        assert 'all-gather' in first and 'rail transport was aborted' in first and aborted and last == [('abort',)]
        assert 'aborted' not in second         # aborted once; later calls raise the plain error
