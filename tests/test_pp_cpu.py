"""PP send/recv without a GPU: the kernel family compiles for sm_90 and its launch declarations match the kernel
signatures; size hint, slot layout and neighbour bookkeeping; every invalid call raises before a kernel is launched
(a buffer whose kernels only record launches); GPU-reported size mismatches and timeouts become clear exceptions;
reconfiguration checks; and the rank program's schedule generator and deadlock check."""

import importlib.util
import random
import re
from pathlib import Path

import fakes
import numpy as np
import pytest

from deepep_cupy import ElasticBuffer
from deepep_cupy.buffers.base import WORKSPACE_BYTES, BufferBase
from deepep_cupy.features.pp import feature as pp_feature
from deepep_cupy.features.pp import plan as pp
from deepep_cupy.jit import compiler, launch
from deepep_cupy.runtime import errors, interop, workspace
from deepep_cupy.runtime.event import EventOverlap

MiB = 1 << 20


def _probe_helpers():
    spec = importlib.util.spec_from_file_location('_peer_copy_probe', Path(__file__).with_name('test_peer_copy.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- kernels ---------------------------------------------------------------------------------------------------------
def test_pp_family_compiles_for_sm90():
    specs = pp.shipped_specs()['pp']
    assert [s.name for s in specs] == ['deepep::pp_send_impl', 'deepep::pp_recv_impl', 'deepep::pp_wait_impl',
                                       'deepep::pp_bump_impl']
    module = compiler.compile_cubin('pp', [s.name for s in specs], arch='90', use_cache=False)
    assert module.cubin[:4] == b'\x7fELF' and set(module.lowered) == {s.name for s in specs}


def test_launch_declarations_match_kernel_signatures():
    _probe_helpers().compile_probe('pp', pp.all_specs())


def test_signature_probe_catches_a_wrong_pp_declaration():
    from dataclasses import replace
    spec = pp.SEND_SPEC
    assert spec.params[1].name == 'num_bytes'
    wrong = replace(spec, params=spec.params[:1] + (launch.Param('num_bytes', np.int32),) + spec.params[2:])
    with pytest.raises(AssertionError, match=r'parameter 1 \(num_bytes\) is declared int'):
        _probe_helpers().compile_probe('pp', [wrong])


def test_kernel_constants_match_the_launcher():
    source = (compiler.kernels_dir() / 'pp.cu').read_text()
    for name, value in (('kPPThreads', pp.THREADS), ('kPPUnroll', pp.UNROLL), ('kPPHeaderBytes', pp.HEADER_BYTES),
                        ('kPPWaitSlot', pp.WAIT_SLOT), ('kPPWaitData', pp.WAIT_DATA),
                        ('kPPErrorWords', pp.ERROR_WORDS)):
        assert re.search(rf'\b{name} = {value}\b', source), f'{name} = {value} not found in pp.cu'
    types = (compiler.kernels_dir() / 'common' / 'types.cuh').read_text()
    assert f'kPhasePP = {pp.PHASE_PP}' in types and 'pp' in errors.PHASES[pp.PHASE_PP]
    # The workspace range assigned to PP (common/workspace.cuh), clear of the peer-copy words below and the
    # all-gather words above; the error record's place in the host-mapped memory.
    assert (pp.CTRL_OFFSET, pp.CTRL_BYTES) == workspace.PP == (20480, 4096)
    assert re.search(r'kPPCtrlOffset = kWsPPOffset;', source) and re.search(r'kPPCtrlBytes = kWsPPBytes;', source)
    assert pp.ERROR_RECORD_OFFSET == workspace.HOST_PP_ERROR.offset
    assert 4 * pp.ERROR_WORDS <= workspace.HOST_PP_ERROR.num_bytes


# ---- sizes and layout ------------------------------------------------------------------------------------------------
def test_size_hint_is_upstreams_formula():
    hint = pp.get_pp_buffer_size_hint
    assert hint(4096 * 7168 * 2, 4) == 4096 * 7168 * 2 * 16        # already 2 MiB aligned (896 MiB)
    assert hint(1, 1) == 2 * MiB
    assert hint(MiB // 2, 1) == 2 * MiB
    assert hint(MiB // 2 + 1, 1) == 4 * MiB                       # align(524289, 32) * 4 > 2 MiB
    assert hint(33, 3) == 2 * MiB
    assert BufferBase.__dict__.get('get_pp_buffer_size_hint') is None
    assert ElasticBuffer.get_pp_buffer_size_hint(100, 2) == hint(100, 2)      # static on the buffer class
    for bad, exc in ((0, ValueError), (-5, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(exc):
            hint(bad, 1)
        with pytest.raises(exc):
            hint(16, bad)


def test_layout_is_aligned_disjoint_and_fits_the_hint():
    rng = random.Random(0)
    cases = [(1, 1), (31, 1), (32, 7), (4096 * 7168 * 2, 4), (MiB + 3, 64), (16, 65536)]
    cases += [(rng.randint(1, 1 << 28), rng.randint(1, 64)) for _ in range(200)]
    for num_bytes, inflight in cases:
        lay = pp.PPLayout(num_bytes, inflight, WORKSPACE_BYTES)
        assert lay.slot_bytes % 32 == 0 and lay.slot_bytes >= num_bytes
        assert lay.slots_offset % 128 == 0 and lay.headers_offset == WORKSPACE_BYTES
        last_header = lay.header_offset(pp.NUM_SOURCES - 1, inflight - 1)
        assert last_header + pp.HEADER_BYTES <= lay.slots_offset
        assert lay.slot_offset(pp.NUM_SOURCES - 1, inflight - 1) + lay.slot_bytes == lay.end_offset
        assert all(lay.slot_offset(k, s) % 16 == 0 for k in range(2) for s in (0, inflight - 1))
        assert lay.num_bytes <= pp.get_pp_buffer_size_hint(num_bytes, inflight), (num_bytes, inflight)


# ---- neighbours ------------------------------------------------------------------------------------------------------
def test_neighbour_slot_indices():
    assert pp.neighbours(0, 4) == (3, 1) and pp.neighbours(3, 4) == (2, 0)
    assert pp.neighbour_slot_idx(0, 1, 2) == 0 and pp.neighbour_slot_idx(1, 0, 2) == 0     # prev == next
    assert pp.neighbour_slot_idx(0, 2, 3) == 0 and pp.neighbour_slot_idx(0, 1, 3) == 1
    for rank, peer, n in ((0, 0, 1), (0, 2, 4), (1, 1, 4), (0, 4, 8)):
        with pytest.raises(ValueError, match='not a ring neighbour'):
            pp.neighbour_slot_idx(rank, peer, n)


@pytest.mark.parametrize('num_ranks', range(2, 9))
def test_every_pair_has_its_own_slots_and_counters(num_ranks):
    for d in range(num_ranks):
        # At a receiver, distinct sources own distinct slot regions; at a sender, distinct destinations own
        # distinct counters.
        sources = {s: pp.neighbour_slot_idx(d, s, num_ranks) for s in set(pp.neighbours(d, num_ranks))}
        assert len(set(sources.values())) == len(sources) and set(sources.values()) <= {0, 1}
        for s, k in sources.items():
            # What the sender passes as src_slot_idx_at_dst is what the receiver uses as src_slot_idx, and vice
            # versa for the consumed signal.
            assert pp.neighbour_slot_idx(d, s, num_ranks) == k
            assert pp.neighbour_slot_idx(s, d, num_ranks) in (0, 1)
    if num_ranks == 2:
        assert all(pp.neighbour_slot_idx(r, 1 - r, 2) == 0 for r in range(2))


def test_unmatched_messages():
    balanced = [({1: 3, 3: 1}, {1: 2, 3: 5}), ({0: 2, 2: 0}, {0: 3}), ({}, {}), ({0: 5}, {0: 1})]
    assert pp.unmatched_messages(balanced) == []
    pending = [({1: 4}, {}), ({}, {0: 3})]
    assert pp.unmatched_messages(pending) == [(0, 1, 4, 3)]
    assert pp.unmatched_messages([({}, {1: 1}), ({}, {})]) == [(1, 0, 0, 1)]     # received more than sent


def test_describe_mismatch():
    big = (5 << 32) + 7
    record = [1, 3, 9, 8192, 0, big & 0xFFFFFFFF, big >> 32, 9]
    text = pp.describe_mismatch(np.array(record, dtype=np.int64).astype(np.int32), 2)
    assert 'rank 2' in text and 'from rank 3' in text and 'message #9' in text
    assert '8192 bytes' in text and f'{big} bytes' in text and 'lost step' not in text
    record[7] = 8
    assert 'lost step' in pp.describe_mismatch(record, 2)


# ---- a buffer whose kernels only record launches ---------------------------------------------------------------------
class RecordingKernel(fakes.RecordingKernel):
    """Launched by parameter name like the real kernel; packs the arguments (count and exact types) and records
    `(name, grid, arguments by name)`."""

    def _launch(self, grid, block, args, stream, shared_mem, cooperative):
        launch.pack_args(self.spec, args, self.converters)
        assert block == pp.THREADS and not cooperative
        self.log.append((self.spec.name, grid, dict(zip(self.spec.param_names, args))))

    def _go_bound(self, bound, stream):        # a bound launch (packed like the GPU's), logged alike
        assert bound.block == (pp.THREADS, 1, 1) and not bound.cooperative
        self.log.append((self.spec.name, bound.grid[0], bound.values()))


class FakeGroup:
    def __init__(self, others=None):
        self.calls, self.others = [], others

    def check_same(self, what, value, timeout=None):
        self.calls.append(('check_same', what, value))

    def allgather_object(self, obj, timeout=None):
        self.calls.append(('allgather', obj))
        return self.others(obj) if self.others else [obj]


class _Obj:
    pass


def make_buffer(monkeypatch, num_ranks=4, rank=1, num_bytes=64 * MiB, device=-1):
    """An `ElasticBuffer` without a GPU (tests/fakes.py) whose PP kernels only record launches."""
    buf = fakes.make_buffer(num_ranks=num_ranks, rank=rank, num_bytes=num_bytes, device=device, group=FakeGroup())
    log = []
    buf.launches = log
    kernels = _Obj()
    kernels.send, kernels.recv = RecordingKernel(pp.SEND_SPEC, log), RecordingKernel(pp.RECV_SPEC, log)
    monkeypatch.setattr(pp_feature, 'PPKernels', lambda: kernels)
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: fakes.FakeStream('current'))
    monkeypatch.setattr(buf, 'synchronize', lambda stream=None: buf.check_usable(), raising=False)
    return buf


ERROR_PTR = 0x2000 + pp.ERROR_RECORD_OFFSET        # the fake host-mapped memory's address of the PP error record


def test_set_config_checks_before_anything_else(monkeypatch):
    buf = make_buffer(monkeypatch, num_bytes=8 * MiB)
    for args, exc, match in (((0, 4), ValueError, 'num_max_tensor_bytes'), ((16, 0), ValueError, 'inflight'),
                             ((16, True), TypeError, 'inflight'), ((16.0, 2), TypeError, 'num_max_tensor_bytes'),
                             ((16, pp.NUM_MAX_INFLIGHT_TENSORS + 1), ValueError, 'inflight'),
                             ((4 * MiB, 1), ValueError, 'get_pp_buffer_size_hint')):
        with pytest.raises(exc, match=match):
            buf.pp_set_config(*args)
    assert buf._data_region_owner is None and buf.group.calls == []
    one = make_buffer(monkeypatch, num_ranks=1, rank=0)
    with pytest.raises(ValueError, match='at least 2 ranks'):
        one.pp_set_config(1024, 2)
    unconfigured = make_buffer(monkeypatch)
    with pytest.raises(RuntimeError, match='pp_set_config'):
        unconfigured.pp_send(np.zeros(4), 2)


def test_set_config_claims_the_region_and_checks_ranks_agree(monkeypatch):
    buf = make_buffer(monkeypatch)
    buf.pp_set_config(3 * MiB + 1, 4)
    assert buf._data_region_owner == pp.DATA_REGION_OWNER
    assert buf.group.calls == [('check_same', 'pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors)',
                                (3 * MiB + 1, 4))]
    assert buf._pp.layout == pp.PPLayout(3 * MiB + 1, 4, WORKSPACE_BYTES)
    with pytest.raises(RuntimeError, match='already used by PP'):
        buf.claim_data_region('EP dispatch/combine')
    other = make_buffer(monkeypatch)
    other.claim_data_region('EP dispatch/combine')
    with pytest.raises(RuntimeError, match='already used by EP'):
        other.pp_set_config(1024, 2)


torch = pytest.importorskip('torch')


def test_send_and_recv_launch_with_the_pair_indices(monkeypatch):
    buf = make_buffer(monkeypatch, num_ranks=4, rank=1)
    buf.pp_set_config(MiB, 2)
    lay = buf._pp.layout
    x = torch.zeros(MiB // 2, dtype=torch.bfloat16)                   # 1 MiB
    assert isinstance(buf.pp_send(x, 2), EventOverlap)
    buf.pp_recv(x, np.int64(0))
    buf.pp_send(x[:8], 0, num_sms=4)
    buf.pp_recv(torch.zeros(3, dtype=torch.uint8), 2, num_sms=1000)
    (send_name, send_grid, send), (recv_name, recv_grid, recv) = buf.launches[:2]
    assert send_name == pp.SEND_SPEC.name and recv_name == pp.RECV_SPEC.name
    assert send['dst'] == 2 and send['dst_slot_idx'] == 1 and send['src_slot_idx_at_dst'] == 0
    assert recv['src'] == 0 and recv['src_slot_idx'] == 0 and recv['dst_slot_idx_at_src'] == 1
    for args in (send, recv):
        assert args['num_bytes'] == MiB and args['rank'] == 1 and args['num_inflight'] == 2
        assert (args['headers_offset'], args['slots_offset'], args['slot_bytes']) == \
            (lay.headers_offset, lay.slots_offset, lay.slot_bytes)
        assert args['peer_bases'] == 0x1000 and args['error_record'] == 0x2000 and args['timeout_ns'] == 10 ** 10
    assert recv['pp_error'] == ERROR_PTR
    assert send_grid == recv_grid == MiB // 16 // (pp.THREADS * pp.UNROLL)         # 32 blocks cover 1 MiB
    assert buf.launches[2][1] == 1 and buf.launches[2][2]['num_bytes'] == 16     # tiny: one block
    assert buf.launches[3][1] == 1 and buf.launches[3][2]['num_bytes'] == 3      # tail only
    big = torch.zeros(MiB, dtype=torch.uint8)
    buf._pp.layout = pp.PPLayout(64 * MiB, 2, WORKSPACE_BYTES)
    buf.pp_send(torch.zeros(64 * MiB, dtype=torch.uint8), 2)
    assert buf.launches[-1][1] == 132                                            # every SM (num_sms=0)
    buf.pp_send(big, 2, num_sms=8)
    assert buf.launches[-1][1] == 8
    assert buf._pp.num_sent == {2: 3, 0: 1} and buf._pp.num_recv == {0: 1, 2: 1}


def test_two_ranks_use_one_slot_region_per_direction(monkeypatch):
    for rank in (0, 1):
        buf = make_buffer(monkeypatch, num_ranks=2, rank=rank)
        buf.pp_set_config(1024, 4)
        x = torch.zeros(64, dtype=torch.uint8)
        buf.pp_send(x, 1 - rank)
        buf.pp_recv(x, 1 - rank)
        (_, _, send), (_, _, recv) = buf.launches
        assert send['dst_slot_idx'] == send['src_slot_idx_at_dst'] == 0
        assert recv['src_slot_idx'] == recv['dst_slot_idx_at_src'] == 0


def invalid_calls(buf):
    x = torch.zeros(1024, dtype=torch.uint8)
    limit = buf._pp.layout.num_max_tensor_bytes
    return [
        ('over num_max_tensor_bytes', ValueError, 'num_max_tensor_bytes', lambda: buf.pp_send(
            torch.zeros(limit + 1, dtype=torch.uint8), 2)),
        ('recv over num_max_tensor_bytes', ValueError, 'num_max_tensor_bytes', lambda: buf.pp_recv(
            torch.zeros(limit // 2 + 1, dtype=torch.int16), 0)),
        ('not contiguous', ValueError, 'contiguous', lambda: buf.pp_send(torch.zeros(8, 8)[:, ::2], 2)),
        ('not 16-byte aligned', ValueError, '16-byte', lambda: buf.pp_send(x[1:17], 2)),
        ('numpy array', TypeError, 'x must be', lambda: buf.pp_send(np.zeros(4), 2)),
        ('complex dtype', TypeError, 'dtype', lambda: buf.pp_send(torch.zeros(4, dtype=torch.complex64), 2)),
        ('dst itself', ValueError, 'ring neighbours', lambda: buf.pp_send(x, 1)),
        ('dst not a neighbour', ValueError, r'ring neighbours \[0, 2\]', lambda: buf.pp_send(x, 3)),
        ('src not a neighbour', ValueError, 'receive from', lambda: buf.pp_recv(x, 3)),
        ('dst out of range', ValueError, 'out of range', lambda: buf.pp_send(x, 4)),
        ('dst negative', ValueError, 'dst_rank_idx', lambda: buf.pp_send(x, -1)),
        ('dst float', TypeError, 'dst_rank_idx', lambda: buf.pp_send(x, 2.0)),
        ('src None', TypeError, 'src_rank_idx', lambda: buf.pp_recv(x, None)),
        ('num_sms negative', ValueError, 'num_sms', lambda: buf.pp_send(x, 2, num_sms=-1)),
        ('num_sms float', TypeError, 'num_sms', lambda: buf.pp_recv(x, 0, num_sms=1.0)),
        ('previous_event', TypeError, 'previous_event', lambda: buf.pp_send(x, 2, previous_event=object())),
    ]


def test_invalid_calls_raise_before_any_kernel(monkeypatch):
    buf = make_buffer(monkeypatch, num_ranks=4, rank=1)
    buf.pp_set_config(4096, 2)
    for name, exc, match, fn in invalid_calls(buf):
        with pytest.raises(exc, match=match):
            fn()
        assert buf.launches == [] and buf._pp.num_sent == {} and buf._pp.num_recv == {}, name
    buf.pp_send(torch.zeros(4096, dtype=torch.uint8), 2)             # exactly the maximum: fine
    buf.pp_send(torch.zeros(0, dtype=torch.uint8), 0)                # empty: a message of 0 bytes
    assert len(buf.launches) == 2


def test_tensor_on_another_device_is_rejected(monkeypatch):
    buf = make_buffer(monkeypatch, device=0)
    buf.pp_set_config(4096, 2)
    with pytest.raises(ValueError, match=r'cuda:0 .*the host'):
        buf.pp_send(torch.zeros(16), 2)
    assert buf.launches == []


def test_size_mismatch_is_reported_once_by_the_next_call(monkeypatch):
    buf = make_buffer(monkeypatch)
    buf.pp_set_config(8192, 2)
    x = torch.zeros(64, dtype=torch.uint8)
    buf._pp.error[:] = [1, 0, 4, 8192, 0, 4096, 0, 4]      # what pp_recv_impl writes
    with pytest.raises(RuntimeError, match='message #4 from rank 0 got a tensor of 8192 bytes .* sent 4096 bytes'):
        buf.pp_send(x, 2)
    assert buf.launches == [] and not buf._pp.error.any()
    buf.pp_send(x, 2)                                       # reported once; the pair is still in step
    assert len(buf.launches) == 1


def test_gpu_timeout_in_pp_names_the_wait(monkeypatch):
    buf = make_buffer(monkeypatch)
    buf.pp_set_config(8192, 2)
    buf.error_record[:] = [1, pp.PHASE_PP, 1, 2, 5, 3, pp.WAIT_SLOT, 0]
    with pytest.raises(TimeoutError, match=r'pp send/recv: rank 1 waited for rank 2.*aux 1 = pp_send found no free'):
        buf.pp_send(torch.zeros(16, dtype=torch.uint8), 2)
    with pytest.raises(RuntimeError, match='unusable'):
        buf.pp_recv(torch.zeros(16, dtype=torch.uint8), 0)
    assert buf.launches == []


def test_reconfiguration_needs_every_message_received(monkeypatch):
    buf = make_buffer(monkeypatch, num_ranks=2, rank=0)
    buf.pp_set_config(8192, 2)
    x = torch.zeros(64, dtype=torch.uint8)
    buf.pp_send(x, 1)
    buf.pp_send(x, 1)
    # Rank 1 sent us one message (not received yet) and received one of our two.
    buf.group.others = lambda mine: [mine, ({0: 1}, {0: 1})]
    with pytest.raises(RuntimeError, match=r'0->1: 2 sent, 1 received, 1->0: 1 sent, 0 received'):
        buf.pp_set_config(4096, 4)
    assert buf._pp.layout.num_max_tensor_bytes == 8192
    buf.pp_recv(x, 1)
    buf.group.others = lambda mine: [mine, ({0: 1}, {0: 2})]
    buf.pp_set_config(4096, 4)
    assert buf._pp.layout == pp.PPLayout(4096, 4, WORKSPACE_BYTES)
    with pytest.raises(ValueError, match='num_max_tensor_bytes=4096'):
        buf.pp_send(torch.zeros(4097, dtype=torch.uint8), 1)


# ---- the rank program's schedules ------------------------------------------------------------------------------------
def _rank_program():
    from deepep_cupy.tests import pp as program
    return program


@pytest.mark.parametrize('num_ranks', [2, 3, 4, 8])
def test_stress_schedule_matches_every_send_with_a_later_recv(num_ranks):
    program = _rank_program()
    full = 4096 * 7168 * 2
    ops = program.generate_stress_ops(num_ranks, 128, full, random.Random(num_ranks))
    sends, recvs = {}, {}
    for rank, rank_ops in enumerate(ops):
        assert [op.timestamp for op in rank_ops] == sorted(op.timestamp for op in rank_ops)
        for op in rank_ops:
            m = op.message
            assert op.peer in program.neighbours(rank, num_ranks) and op.peer != rank
            assert 1 <= m.num_bytes <= full
            if op.kind == 'send':
                assert (m.src, op.peer) == (rank, m.dst)
                sends[m] = op.timestamp
            else:
                assert (m.dst, op.peer) == (rank, m.src)
                recvs[m] = op.timestamp
    assert sum(len(o) for o in ops) == 256 and set(sends) == set(recvs)
    assert all(recvs[m] > sends[m] for m in sends)
    for rank_ops in ops:                                    # FIFO order per pair on both sides
        for kind in ('send', 'recv'):
            seen = {}
            for op in rank_ops:
                if op.kind == kind:
                    pair = (op.message.src, op.message.dst)
                    assert op.message.idx == seen.get(pair, 0)
                    seen[pair] = op.message.idx + 1
    assert any(m.num_bytes == full for m in sends) and any(m.num_bytes < full for m in sends)
    assert not program.schedule_deadlocks(ops, capacity=10 ** 9)     # unbounded slots: always completes


def test_deadlock_check():
    program = _rank_program()
    M = program.Message
    a = [M(0, 1, k, 16) for k in range(2)]
    b = [M(1, 0, k, 16) for k in range(2)]
    # Both ranks send two messages before receiving: needs two slots per pair.
    ops = [[program.Op(0, 'send', 1, a[0]), program.Op(1, 'send', 1, a[1]),
            program.Op(2, 'recv', 1, b[0]), program.Op(3, 'recv', 1, b[1])],
           [program.Op(0, 'send', 0, b[0]), program.Op(1, 'send', 0, b[1]),
            program.Op(2, 'recv', 0, a[0]), program.Op(3, 'recv', 0, a[1])]]
    assert program.schedule_deadlocks(ops, capacity=1)
    assert not program.schedule_deadlocks(ops, capacity=2)
    ops2, redraws = program.feasible_stress_ops(2, 128, 1 << 20, 4, seed=0)
    assert not program.schedule_deadlocks(ops2, 4) and redraws >= 0
    # Some 2-rank schedules with 4 slots cannot complete (DeepEP's generator makes bursts of sends); they exist.
    infeasible = sum(program.schedule_deadlocks(program.generate_stress_ops(2, 128, 1 << 20, random.Random(s)), 4)
                     for s in range(600))
    assert 0 < infeasible < 30


def test_message_seeds_are_distinct():
    program = _rank_program()
    seeds = {program.message_seed(0, it, program.Message(s, d, k, 1))
             for it in range(4) for s in range(8) for d in range(8) for k in range(64)}
    assert len(seeds) == 4 * 8 * 8 * 64


def test_make_buffer_builds_an_elastic_buffer(monkeypatch):
    program = _rank_program()
    calls = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            calls.append((type(self).__name__, args, kwargs))

    monkeypatch.setattr(program, 'ElasticBuffer', type('ElasticBuffer', (Recorder,), {}))
    program.make_buffer('group', 2 * MiB, num_gpu_timeout_secs=3)
    program.make_buffer('group', 2 * MiB)
    common = {'num_bytes': 2 * MiB, 'allow_hybrid_mode': True, 'explicitly_destroy': True}
    assert calls == [('ElasticBuffer', ('group',), {**common, 'num_gpu_timeout_secs': 3}),
                     ('ElasticBuffer', ('group',), common)]


# ---- the protocol, emulated: real host code on every rank (threads), kernels replayed in Python from their args -----
class EmulatedGPU:
    """Executes pp_send_impl / pp_recv_impl from their launch arguments the way kernels_cu/pp.cu does (counters,
    cursors, back-pressure and data waits, header check), on host memory. A launch completes before it returns, so
    each rank behaves like one stream whose host waits for every kernel. Asserts that no slot is overwritten
    before its message was consumed."""

    def __init__(self, num_ranks):
        import threading
        self.cond = threading.Condition()
        self.ctrl = [{name: [0, 0] for name in ('num_sent', 'num_recv', 'send_cursor', 'recv_cursor', 'sent_from',
                                                 'consumed_by')} for _ in range(num_ranks)]
        self.slots = {}         # (receiver, source idx, slot) -> (bytes, seq, consumed)
        self.buffers = {}

    def _timeout(self, rank, peer, expected, seen, aux):
        self.buffers[rank].error_record[:] = [1, pp.PHASE_PP, rank, peer, expected, seen, aux, 0]

    def send(self, a):
        import ctypes
        r, d, kd, ks, c = a['rank'], a['dst'], a['dst_slot_idx'], a['src_slot_idx_at_dst'], a['num_inflight']
        assert kd in (0, 1) and ks in (0, 1)
        with self.cond:
            ctrl = self.ctrl[r]
            seq, cursor = ctrl['num_sent'][kd], ctrl['send_cursor'][kd] % c
            if not self.cond.wait_for(lambda: ctrl['consumed_by'][kd] >= seq + 1 - c, a['timeout_ns'] / 1e9):
                return self._timeout(r, d, seq + 1 - c, ctrl['consumed_by'][kd], pp.WAIT_SLOT)
            old = self.slots.get((d, ks, cursor))
            assert old is None or old[2], f'rank {r} overwrote an unconsumed slot of rank {d}'
            data = ctypes.string_at(a['x'], a['num_bytes']) if a['num_bytes'] else b''
            self.slots[(d, ks, cursor)] = (data, seq, False)
            ctrl['num_sent'][kd], ctrl['send_cursor'][kd] = seq + 1, (cursor + 1) % c
            self.ctrl[d]['sent_from'][ks] = seq + 1
            self.cond.notify_all()

    def recv(self, a):
        import ctypes
        r, s, ks, kd, c = a['rank'], a['src'], a['src_slot_idx'], a['dst_slot_idx_at_src'], a['num_inflight']
        with self.cond:
            ctrl = self.ctrl[r]
            seq, cursor = ctrl['num_recv'][ks], ctrl['recv_cursor'][ks] % c
            if not self.cond.wait_for(lambda: ctrl['sent_from'][ks] >= seq + 1, a['timeout_ns'] / 1e9):
                return self._timeout(r, s, seq + 1, ctrl['sent_from'][ks], pp.WAIT_DATA)
            data, sent_seq, _ = self.slots[(r, ks, cursor)]
            if len(data) == a['num_bytes'] and sent_seq == seq:
                if data:
                    ctypes.memmove(a['x'], data, len(data))
            else:
                error = self.buffers[r]._pp.error
                if error[0] == 0:
                    error[:] = [1, s, seq, a['num_bytes'], 0, len(data), 0, sent_seq]
            self.slots[(r, ks, cursor)] = (data, sent_seq, True)
            ctrl['num_recv'][ks], ctrl['recv_cursor'][ks] = seq + 1, (cursor + 1) % c
            self.ctrl[s]['consumed_by'][kd] = seq + 1
            self.cond.notify_all()


def EmulatedKernel(spec, run):
    """A kernel launched by name whose launch runs `run(arguments by name)` (see tests/fakes.py)."""
    return fakes.RecordingKernel(spec, run=run)


class ThreadGroup:
    """The host collectives of one rank, between threads."""

    def __init__(self, rank, shared):
        self.rank, self.size, self.shared = rank, len(shared['slots']), shared

    def allgather_object(self, obj, timeout=None):
        import pickle
        self.shared['slots'][self.rank] = pickle.loads(pickle.dumps(obj))     # a snapshot, as MPI and torch send
        self.shared['barrier'].wait()
        out = list(self.shared['slots'])
        self.shared['barrier'].wait()
        return out

    def check_same(self, what, value, timeout=None):
        values = self.allgather_object(value)
        if any(v != values[0] for v in values):
            raise ValueError(f'{what} differs')

    def barrier(self, timeout=None):
        self.allgather_object(None)


class _CPUTorch:
    """`torch` for the rank program on CPU: the tensor factories drop `device='cuda'`."""

    _FACTORIES = ('Generator', 'randint', 'randn', 'empty', 'zeros', 'full', 'arange')

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            return lambda *a, **k: attr(*a, **{key: v for key, v in k.items() if key != 'device'})
        return attr


def run_ranks(monkeypatch, num_ranks, body, num_bytes=64 * MiB):
    """Run `body(buf, rank)` on `num_ranks` threads, each with its own buffer on one emulated GPU."""
    import threading
    gpu = EmulatedGPU(num_ranks)
    shared = {'slots': [None] * num_ranks, 'barrier': threading.Barrier(num_ranks)}
    bufs = []
    for rank in range(num_ranks):
        buf = make_buffer(monkeypatch, num_ranks=num_ranks, rank=rank, num_bytes=num_bytes)
        buf.group, buf.num_gpu_timeout_secs = ThreadGroup(rank, shared), 20.0
        gpu.buffers[rank] = buf
        bufs.append(buf)
    kernels = _Obj()
    kernels.send, kernels.recv = EmulatedKernel(pp.SEND_SPEC, gpu.send), EmulatedKernel(pp.RECV_SPEC, gpu.recv)
    monkeypatch.setattr(pp_feature, 'PPKernels', lambda: kernels)
    errors_seen = [None] * num_ranks

    def main(rank):
        try:
            body(bufs[rank], rank)
        except BaseException as e:       # reported below, with the rank
            errors_seen[rank] = e
            shared['barrier'].abort()
    threads = [threading.Thread(target=main, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), 'emulated ranks hung'
    for rank, e in enumerate(errors_seen):
        if e is not None and not isinstance(e, threading.BrokenBarrierError):
            raise AssertionError(f'rank {rank}: {type(e).__name__}: {e}') from e
    assert not any(errors_seen), errors_seen
    return gpu, bufs


@pytest.mark.parametrize('num_ranks', [2, 3, 4])
def test_rank_program_stress_and_back_pressure_on_the_emulated_protocol(monkeypatch, num_ranks):
    import argparse
    program = _rank_program()
    monkeypatch.setattr(program, 'torch', _CPUTorch())
    monkeypatch.setattr(program, 'sleep_gpu', lambda cycles, stream=None: None)
    shape = (8, 64)
    args = argparse.Namespace(num_stress_iterations=2, num_sends=64, num_max_inflight_tensors=2, num_sleep_cycles=0,
                              num_sms=0, seed=1)

    def body(buf, rank):
        buf.pp_set_config(8 * 64 * 2, args.num_max_inflight_tensors)
        assert program.run_stress(buf, args, shape, rank, num_ranks) > 0
        program.run_back_pressure(buf, args, rank, num_ranks, shape)
    gpu, bufs = run_ranks(monkeypatch, num_ranks, body)
    sent = [b._pp.num_sent for b in bufs]
    assert pp.unmatched_messages([(b._pp.num_sent, b._pp.num_recv) for b in bufs]) == []
    assert sum(sum(s.values()) for s in sent) >= 2 * 64
    # Device counters agree with the host's on both sides of every pair.
    for r, b in enumerate(bufs):
        for peer, n in b._pp.num_sent.items():
            assert gpu.ctrl[r]['num_sent'][pp.neighbour_slot_idx(r, peer, num_ranks)] == n


def mismatch_and_reconfiguration(buf, rank: int, mismatch: str):
    """Ranks 0 and 1 of a PP pair (each calls it): a receive larger than its send is reported by the next call
    (`mismatch`: the expected message) and copies nothing; pp_set_config refuses while a message is in flight, then
    takes new slots whose cursors wrap alike on both sides. Returns a 100-byte tensor for the caller's next receive."""
    peer = 1 - rank
    buf.pp_set_config(8192, 2)
    buf.pp_send(torch.full((4096,), 7, dtype=torch.uint8), peer)
    poisoned = torch.full((8192,), 0xAB, dtype=torch.uint8)
    buf.pp_recv(poisoned, peer)
    with pytest.raises(RuntimeError, match=mismatch):
        buf.pp_send(poisoned, peer)
    assert bool((poisoned == 0xAB).all())
    x = torch.arange(100, dtype=torch.uint8) + rank
    buf.pp_send(x, peer)
    with pytest.raises(RuntimeError, match='still in flight'):
        buf.pp_set_config(4096, 3)
    out = torch.zeros(100, dtype=torch.uint8)
    buf.pp_recv(out, peer)
    assert torch.equal(out, torch.arange(100, dtype=torch.uint8) + peer)
    buf.pp_set_config(4096, 3)
    for k in range(7):              # cursors wrap under the new slot count, on both sides alike
        buf.pp_send(torch.full((k + 1,), k, dtype=torch.uint8), peer)
        got = torch.zeros(k + 1, dtype=torch.uint8)
        buf.pp_recv(got, peer)
        assert bool((got == k).all())
    buf.group.barrier()
    return out


def test_emulated_mismatch_reconfiguration_and_timeout(monkeypatch):
    def body(buf, rank):
        peer = 1 - rank
        out = mismatch_and_reconfiguration(buf, rank, '8192 bytes but the matching pp_send sent 4096 bytes')
        if rank == 0:                   # nobody sends: a bounded wait, diagnosed
            buf.num_gpu_timeout_secs = 0.2
            buf.pp_recv(out, peer)
            with pytest.raises(TimeoutError, match=r'pp send/recv: rank 0 waited for rank 1 .*aux 2\)'):
                buf.synchronize()
    run_ranks(monkeypatch, 2, body)
