"""All-gather sessions / reduce-scatter / all-reduce without a GPU: the kernel family compiles for sm_90, every launch
declaration matches its kernel's signature, the control words stay in their workspace range, the size hints follow
DeepEP, the session bookkeeping and reduction layout are right, the numpy references sum in the kernels' order, the
stress-op generator keeps its invariants, and the buffer methods validate arguments and pack launches correctly
(kernels, streams and memory replaced by fakes)."""

import random
import re

import fakes as buffer_fakes
import numpy as np
import pytest

from deepep_cupy import ElasticBuffer
from deepep_cupy.buffers import elastic
from deepep_cupy.features.agrs import feature as agrs_feature
from deepep_cupy.features.agrs import kernels as agrs_kernels
from deepep_cupy.features.agrs import plan as agrs_plan
from deepep_cupy.features.agrs import reference as agrs_reference
from deepep_cupy.jit import compiler, launch
from deepep_cupy.runtime import interop, streams, workspace
from deepep_cupy.runtime.group import ProcessGroup
from deepep_cupy.runtime.group_size import group_size

MiB = 1 << 20


# ---- kernels ---------------------------------------------------------------------------------------------------------
def test_agrs_family_specialisations():
    # Compiled for sm_90 with every other shipped specialisation (tests/test_jit.py).
    specs = agrs_kernels.shipped_specs()['agrs']
    assert len(specs) == 7 * 8 + 5 and len({s.name for s in specs}) == len(specs)      # + 5 of hybrid mode


def test_agrs_launch_declarations_match_kernel_signatures():
    # The signature probe of test_peer_copy.py: NVRTC static_asserts of each parameter's kind against the kernel.
    from test_peer_copy import compile_probe
    compile_probe('agrs', agrs_kernels.shipped_specs()['agrs'])


def test_control_words_and_constants_match_the_kernel():
    source = (compiler.kernels_dir() / 'agrs.cu').read_text()
    for name, value in (('kAgrsThreads', agrs_kernels.THREADS), ('kAgrsGatherUnroll', agrs_kernels.GATHER_UNROLL),
                        ('kAgrsMetaSlots', agrs_kernels.MAX_GATHERS_PER_SESSION),
                        ('kAgrsMaxSenders', agrs_kernels.MAX_SENDERS)):
        assert re.search(rf'\b{name} = {value};', source), name
    for aux, _ in agrs_kernels.AUX_NAMES.items():
        assert re.search(rf'kAgrsAux\w+ = {aux}\b', source)
    # The workspace range assigned to this feature (common/workspace.cuh's map): [24576, 28672).
    assert re.search(r'kAgrsCtrlOffset = kWsAgrsOffset;', source)
    assert re.search(r'kAgrsCtrlBytes = kWsAgrsBytes;', source)
    assert (agrs_kernels.CTRL_OFFSET, agrs_kernels.CTRL_BYTES) == workspace.AGRS == (24576, 4096)


# ---- size hints --------------------------------------------------------------------------------------------------
class _Group(ProcessGroup):
    """Every rank agrees with this one."""

    def allgather_object(self, obj, timeout=None):
        return [obj] * self.size


def test_session_bytes_hint_follows_deepep():
    torch = pytest.importorskip('torch')
    shape = (32, 64, 2048)
    for group, r in ((_Group(0, 2), 2), (8, 8), (_Group(0, 3), 3)):
        got = ElasticBuffer.get_agrs_num_max_session_bytes(group, [shape] * 4, torch.bfloat16)
        assert got == 4 * r * 32 * 64 * 2048 * 2
    # Each region is aligned to 32 bytes on its own.
    assert ElasticBuffer.get_agrs_num_max_session_bytes(3, [(3,), (5, 1)], torch.bfloat16) == 32 + 32
    assert ElasticBuffer.get_agrs_num_max_session_bytes(3, [(3,), (5, 1)], np.float32) == 64 + 64
    assert ElasticBuffer.get_agrs_num_max_session_bytes(2, [(7,)], 'bfloat16') == 32
    assert ElasticBuffer.get_agrs_buffer_size_hint(2, 1) == 2 * MiB
    assert ElasticBuffer.get_agrs_buffer_size_hint(2, 2 * MiB) == 2 * MiB
    assert ElasticBuffer.get_agrs_buffer_size_hint(2, 2 * MiB + 1, 8) == 4 * MiB
    assert ElasticBuffer.get_agrs_buffer_size_hint(2, 2 * MiB - 4096, 4096) == 2 * MiB
    with pytest.raises(ValueError):
        ElasticBuffer.get_agrs_num_max_session_bytes(2, [], torch.bfloat16)
    with pytest.raises(TypeError):
        ElasticBuffer.get_agrs_buffer_size_hint(2, 1.5)


def test_group_size_forms():
    class TorchLike:
        def size(self):
            return 4

    class MpiLike:
        def Get_size(self):
            return 5
    assert group_size(6) == 6 and group_size(_Group(0, 3)) == 3
    assert group_size(TorchLike()) == 4 and group_size(MpiLike()) == 5


def test_reduce_bytes_hint_covers_the_layouts():
    for r in (1, 2, 3, 8):
        for n in (8, 1000, 123457, 1 << 22):
            ar = ElasticBuffer.get_agrs_reduce_num_bytes(r, n)
            shard = agrs_plan.all_reduce_shard_elems(r, n)
            assert ar == agrs_plan.reduce_layout(r, n, shard, 4, True, 48).num_bytes >= 2 * n * 4 - 1
            rs = ElasticBuffer.get_agrs_reduce_num_bytes(r, r * 8 * n, 'reduce_scatter')
            assert rs == agrs_plan.reduce_layout(r, r * 8 * n, 8 * n, 4, False, 48).num_bytes
            assert ElasticBuffer.get_agrs_reduce_num_bytes(r, r * 8 * n, 'reduce_scatter', 'bf16') <= rs // 2 + 32 * r
    with pytest.raises(ValueError):
        ElasticBuffer.get_agrs_reduce_num_bytes(2, 8, 'gather')


# ---- session bookkeeping -------------------------------------------------------------------------------------------
def test_session_plan_reserves_regions_in_order():
    plan = agrs_plan.SessionPlan(3, 1000, 3)
    with pytest.raises(RuntimeError):
        plan.peek([8])
    plan.open()
    with pytest.raises(RuntimeError):
        plan.open()
    peeked = plan.peek([10, 20])
    assert plan.used_bytes == 0 and plan.num_gathers == 0          # peeking reserves nothing
    regions = plan.reserve([10, 20])
    assert regions == peeked
    assert [(g.offset, g.region_bytes) for g in regions] == [(0, 32), (32, 64)]
    assert regions[1].slot_offset(2) == 32 + 40 and regions[1].end == 96
    with pytest.raises(ValueError, match='num_max_all_gathers_per_session=3'):
        plan.reserve([1, 1])
    with pytest.raises(ValueError, match='num_max_session_bytes=1000'):
        plan.reserve([300])                                         # align(900, 32) = 928 > 1000 - 96
    assert plan.used_bytes == 96 and plan.num_gathers == 2          # failed reservations change nothing
    plan.reserve([0])
    plan.close()
    with pytest.raises(RuntimeError):
        plan.close()
    plan.open()
    assert plan.used_bytes == 0 and plan.num_gathers == 0


def test_gather_meta_tells_disagreeing_ranks_apart():
    a, b = agrs_plan.SessionPlan(2, 1 << 20, 32), agrs_plan.SessionPlan(2, 1 << 20, 32)
    a.open()
    b.open()
    assert agrs_plan.gather_meta(a.reserve([4096])[-1].end) != agrs_plan.gather_meta(b.reserve([8192])[-1].end)
    # One batched call of two tensors versus two calls: the first epochs' metas differ.
    a, b = agrs_plan.SessionPlan(2, 1 << 20, 32), agrs_plan.SessionPlan(2, 1 << 20, 32)
    a.open()
    b.open()
    assert agrs_plan.gather_meta(a.reserve([64, 64])[-1].end) != agrs_plan.gather_meta(b.reserve([64])[-1].end)


def test_gather_grid():
    assert agrs_plan.gather_grid(0, True, 32) == 1
    assert agrs_plan.gather_grid(16, True, 32) == 1
    assert agrs_plan.gather_grid(agrs_kernels.THREADS * agrs_kernels.GATHER_UNROLL * 16 * 5, True, 32) == 5
    assert agrs_plan.gather_grid(64 * MiB, True, 32) == 32
    assert agrs_plan.gather_grid(agrs_kernels.THREADS * 3, False, 32) == 3


@pytest.mark.parametrize('num_ranks', [1, 2, 3, 8])
@pytest.mark.parametrize('shard', [0, 8, 2048, 6000 * 8, 1 << 21, 1 << 24])
@pytest.mark.parametrize('num_sms', [2, 3, 48, 132])
def test_reduce_layout_covers_every_shard(num_ranks, shard, num_sms):
    for stage in (2, 4):
        lay = agrs_plan.reduce_layout(num_ranks, num_ranks * shard, shard, stage, stage == 4, num_sms)
        assert lay.chunk_elems % agrs_kernels.GROUP_ELEMS == 0 and lay.chunk_elems >= agrs_kernels.CHUNK_MIN_ELEMS
        assert 1 <= lay.num_senders <= agrs_kernels.MAX_SENDERS and lay.num_reducers >= 1
        assert lay.num_senders + lay.num_reducers <= max(num_sms, 2)
        num_chunks = -(-shard // lay.chunk_elems)
        assert num_chunks <= max(1, lay.num_senders) * agrs_kernels.MAX_ROUNDS
        assert lay.slot_bytes % 32 == 0 and lay.slot_bytes >= shard * stage
        assert lay.gather_offset % 32 == 0 and lay.gather_slot_bytes % 32 == 0
        assert lay.num_bytes == num_ranks * (lay.slot_bytes + lay.gather_slot_bytes)
        if stage == 4:
            assert lay.gather_offset == num_ranks * lay.slot_bytes and lay.gather_slot_bytes >= shard * 4


def test_all_reduce_shards_cover_any_size():
    for r in (1, 2, 3, 8):
        for n in (1, 7, 8, 9, 100, 12345):
            c = agrs_plan.all_reduce_shard_elems(r, n)
            assert c % 8 == 0 and r * c >= n and (r - 1) * c < n + 8 * r


# ---- references ------------------------------------------------------------------------------------------------------
def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip('torch')
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 1e3,
                        np.array([0.0, -0.0, 1.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, 1.00390625,
                                  1.01171875, 1.0 + 2 ** -8 + 2 ** -20], dtype=np.float32),
                        # exact ties between two bfloat16 values: nearest even wins
                        (np.arange(1, 200, dtype=np.uint32) << 16 | 0x8000).view(np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(agrs_reference.f32_to_bf16_bits(x), want)
    assert agrs_reference.f32_to_bf16_bits(np.array([np.nan], dtype=np.float32))[0] == 0x7FFF
    assert np.array_equal(agrs_reference.bf16_bits_to_f32(want),
                          torch.from_numpy(want.view(np.int16)).view(torch.bfloat16).float().numpy())


def _ordered_sum(values, scale):
    acc = np.float32(values[0])
    for v in values[1:]:
        acc = np.float32(acc + np.float32(v))
    return np.float32(acc * np.float32(scale))


def test_reduce_scatter_reference_sums_in_rank_order():
    rng = np.random.default_rng(1)
    num_ranks, n = 4, 16
    inputs = [rng.standard_normal(num_ranks * n).astype(np.float32) * 10 ** rng.integers(-3, 8) for _ in range(4)]
    for rank in range(num_ranks):
        got = agrs_reference.reduce_scatter_reference(inputs, rank, 'fp32', 0.5)
        assert got.dtype == np.float32 and got.shape == (n,)
        for i in range(n):
            assert got[i] == _ordered_sum([x[rank * n + i] for x in inputs], 0.5)
    # Order matters in FP32, and the reference keeps rank order: (1e8 + 1) - 1e8 = 0, not 1.
    cancel = [np.array([v] * 3, dtype=np.float32) for v in (1e8, 1.0, -1e8)]
    assert agrs_reference.reduce_scatter_reference(cancel, 0)[0] == 0.0
    assert agrs_reference.all_reduce_reference([cancel[0], cancel[2], cancel[1]])[0] == 1.0


def test_reduce_references_bf16_paths():
    rng = np.random.default_rng(2)
    num_ranks, n = 3, 8
    fp32 = [rng.standard_normal(num_ranks * n).astype(np.float32) for _ in range(num_ranks)]
    got = agrs_reference.reduce_scatter_reference(fp32, 1, 'bf16', 2.0)
    rounded = [agrs_reference.bf16_bits_to_f32(agrs_reference.f32_to_bf16_bits(x)) for x in fp32]
    assert got.dtype == np.float32
    assert np.array_equal(got, np.array([_ordered_sum([x[n + i] for x in rounded], 2.0) for i in range(n)]))
    bf16 = [agrs_reference.f32_to_bf16_bits(x) for x in fp32]
    got = agrs_reference.reduce_scatter_reference(bf16, 2, 'fp32', 1.0)    # bf16 inputs travel as bf16, come back bf16
    assert got.dtype == np.uint16
    want = [_ordered_sum([agrs_reference.bf16_bits_to_f32(x)[2 * n + i] for x in bf16], 1.0) for i in range(n)]
    assert np.array_equal(got, agrs_reference.f32_to_bf16_bits(np.array(want, dtype=np.float32)))
    x = [rng.standard_normal(13).astype(np.float32) for _ in range(num_ranks)]
    assert np.array_equal(agrs_reference.all_reduce_reference(x, 0.25),
                          np.array([_ordered_sum([v[i] for v in x], 0.25) for i in range(13)]))


# ---- the stress-op generator -----------------------------------------------------------------------------------------
@pytest.mark.parametrize('seed', range(6))
def test_stress_ops_invariants(seed):
    pytest.importorskip('torch')
    from deepep_cupy.tests import agrs as prog
    limit, num_gathers, num_reductions = 4, 16, 8
    ops = prog.generate_stress_ops(random.Random(seed), num_gathers, limit, num_reductions, 4)
    assert ops[0] == ('create',) and ops[-1] == ('destroy',)
    in_session, inflight, issued, fetched, reductions, waited = 0, set(), [], [], set(), []
    session_open = False
    kinds = set()
    for op in ops:
        if op[0] == 'create':
            assert not session_open
            session_open, in_session = True, 0
        elif op[0] == 'destroy':
            assert session_open and not inflight
            session_open = False
        elif op[0] == 'ag':
            _, ids, inplace, batched = op
            kinds.add((inplace, batched, len(ids) > 1))
            assert session_open and ids
            in_session += len(ids)
            assert in_session <= limit
            inflight.update(ids)
            issued.extend(ids)
        elif op[0] == 'fetch':
            assert op[1] in inflight
            inflight.remove(op[1])
            fetched.append(op[1])
        elif op[0] == 'reduce':
            reductions.add(op[1])
            p = op[2]
            if p['kind'] == 'rs':
                assert p['num_elems'] % (4 * 8) == 0 and p['comm_precision'] in agrs_kernels.COMM_PRECISIONS
        else:
            assert op[1] in reductions and op[1] not in waited
            waited.append(op[1])
    assert sorted(issued) == sorted(fetched) == list(range(num_gathers))
    assert sorted(waited) == list(range(num_reductions)) and not session_open
    assert len(kinds) >= 2


# ---- the buffer methods, with fakes for the GPU ----------------------------------------------------------------
class _FakeKernel(buffer_fakes.RecordingKernel):
    """Launched by name; checks the arguments against the declaration and logs (name, grid, block, arguments by
    name, stream, cooperative)."""

    def _launch(self, grid, block, args, stream, shared_mem, cooperative):
        launch.pack_args(self.spec, args)       # count and kinds must match the declaration
        self.log.append((self.spec.name.split('<')[0].split('::')[1], grid, block,
                         dict(zip(self.spec.param_names, args)), stream, cooperative))

    def _go_bound(self, bound, stream):        # a bound launch (packed like the GPU's), logged alike
        self.log.append((self.spec.name.split('<')[0].split('::')[1], bound.grid[0], bound.block[0], bound.values(),
                         stream, bound.cooperative))


_FakeStream = buffer_fakes.FakeStream
_FakeEvent = buffer_fakes.FakeEvent
_FakeEventHandle = buffer_fakes.FakeEventHandle


class _FakeAGRS(agrs_feature.AGRS):
    """The feature with fake kernels that check their arguments, and views as descriptions."""

    def load_kernels(self, n):
        self.log = []
        kernels = {'gather': _FakeKernel(agrs_kernels.gather_spec(n), self.log),
                   'gather_batch': _FakeKernel(agrs_kernels.gather_batch_spec(n), self.log),
                   'wait': _FakeKernel(agrs_kernels.wait_spec(n), self.log),
                   'unpack': _FakeKernel(agrs_kernels.unpack_spec(n), self.log)}
        for i, s in agrs_kernels.REDUCE_VARIANTS:
            kernels[('reduce', i, s)] = _FakeKernel(agrs_kernels.reduce_spec(n, i, s), self.log)
        return kernels

    def view(self, kind, offset, num_bytes, dtype_name, shape):
        return ('view', kind, offset, num_bytes, dtype_name, shape)


class _FakeArray:
    _next = 0x10_0000_0000

    def __init__(self, shape, dtype='float32', ptr=None, device=0, strides=None):
        if ptr is None:
            ptr = _FakeArray._next
            _FakeArray._next += 1 << 32
        size = interop.itemsize(dtype)
        strides = strides or tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
        self.info = interop.TensorInfo('cupy', ptr, tuple(shape), strides, dtype, device, self)
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * size


class _FakeAllocator:
    def __init__(self, kind):
        self.kind = kind

    def empty(self, shape, dtype, stream=None):
        return _FakeArray(shape, dtype)


def _Buf(num_ranks=2, rank=0, num_bytes=64 * MiB):
    """An `ElasticBuffer` without a GPU (tests/fakes.py) on device 0, counting claims and barriers."""
    buf = buffer_fakes.make_buffer(num_ranks, rank, num_bytes, device=0, group=_Group(rank, num_ranks),
                                   num_gpu_timeout_secs=1.0)
    buf.barriers, buf.claimed = 0, []

    def barrier(use_comm_stream=True, with_cpu_sync=False, sequential=True):
        buf.barriers += 1
    buf.claim_data_region = buf.claimed.append
    buf.barrier = barrier
    return buf


@pytest.fixture()
def fakes(monkeypatch):
    from deepep_cupy.runtime import checks, event
    current = _FakeStream('current')
    real_info = interop.tensor_info

    def fake_info(x, name='tensor'):
        return x.info if isinstance(x, _FakeArray) else real_info(x, name)
    monkeypatch.setattr(elastic, 'AGRS', _FakeAGRS)
    monkeypatch.setattr(checks, 'tensor_info', fake_info)
    monkeypatch.setattr(interop, 'tensor_info', fake_info)
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: current)
    monkeypatch.setattr(interop, 'Allocator', _FakeAllocator)
    monkeypatch.setattr(streams, 'EventHandle', _FakeEventHandle)
    monkeypatch.setattr(event, 'EventHandle', _FakeEventHandle)
    return current


def test_set_config_checks_before_any_work(fakes):
    buf = _Buf()
    with pytest.raises(ValueError, match='<= 32'):
        buf.agrs_set_config(MiB, 33)
    with pytest.raises(ValueError, match='exceeds'):
        buf.agrs_set_config(buf.num_bytes + 1)
    with pytest.raises(TypeError):
        buf.agrs_set_config(MiB, 4, num_sms=1.0)
    assert not buf.claimed and buf.barriers == 0
    with pytest.raises(RuntimeError, match='agrs_set_config'):
        buf.create_agrs_session()
    buf.agrs_set_config(8 * MiB, 4)
    assert buf.claimed and buf.barriers == 1 and buf._agrs.num_sms == 32
    buf.create_agrs_session()
    with pytest.raises(RuntimeError, match='destroy'):
        buf.agrs_set_config(8 * MiB, 4)
    with pytest.raises(RuntimeError, match='already open'):
        buf.create_agrs_session()
    buf.destroy_agrs_session()
    assert buf.barriers == 2
    with pytest.raises(RuntimeError, match='no all-gather session'):
        buf.destroy_agrs_session()


def test_all_gather_launches_and_outputs(fakes):
    buf = _Buf(num_ranks=4, rank=2)
    buf.agrs_set_config(8 * MiB, 4)
    st = buf._agrs
    with pytest.raises(RuntimeError, match='open session'):
        buf.all_gather(_FakeArray((16,)))
    with buf.agrs_new_session():
        a, b = _FakeArray((32, 64), 'uint16'), _FakeArray((10,), 'float32')
        out, handle = buf.all_gather(a)
        assert out == ('view', 'cupy', 0, 4 * 4096, 'uint16', (4, 32, 64))
        (g,) = st.log
        assert g[0] == 'agrs_gather_batch_kernel' and g[4] is buf.comm_stream and not g[5]
        assert g[3]['region_offset0'] == buf.data_offset and g[3]['write_local_mask'] == 1 and g[3]['do_signal'] == 1
        assert g[3]['num_tensors'] == 1 and g[3]['src0'] == a.info.ptr and g[3]['num_bytes0'] == 4096
        assert g[3]['epoch'] == 1 and g[3]['meta'] == 4 * 4096 // 32 and g[3]['rank'] == 2
        assert g[1] == agrs_plan.gather_grid(4096, True, 32)
        assert fakes.waits == 0 and buf.comm_stream.waits == 1
        handle()
        w = st.log[-1]
        assert w[0] == 'agrs_wait_kernel' and w[4] is fakes and (w[1], w[2]) == (1, 32)
        assert (w[3]['epoch'], w[3]['meta']) == (1, 4 * 4096 // 32)

        # A list: one launch for the call, one epoch and meta, tensors in order; the grid the largest one needs.
        st.log.clear()
        *outs, handle = buf.all_gather([b, a])
        assert [o[2] for o in outs] == [4 * 4096, 4 * 4096 + 160] and len(st.log) == 1
        (g,) = st.log
        assert g[3]['num_tensors'] == 2 and g[3]['do_signal'] == 1 and g[3]['epoch'] == 2
        assert (g[3]['src0'], g[3]['src1']) == (b.info.ptr, a.info.ptr)
        assert (g[3]['num_bytes0'], g[3]['num_bytes1']) == (40, 4096)
        assert (g[3]['region_offset0'], g[3]['region_offset1']) == (buf.data_offset + 4 * 4096,
                                                                    buf.data_offset + 4 * 4096 + 160)
        assert g[3]['write_local_mask'] == 3 and g[1] == agrs_plan.gather_grid(4096, True, 32)
        assert g[3]['meta'] == (4 * 4096 + 160 + 4 * 4096) // 32
        with pytest.raises(ValueError, match='num_max_all_gathers_per_session=4'):
            buf.all_gather([a, a])
    with pytest.raises(RuntimeError, match='destroyed'):
        handle()
    assert buf.barriers == 2


def test_all_gather_batches_beyond_capacity_in_place_and_misaligned(fakes):
    """Ten tensors: two batched launches (8 + 2), only the last signalling; the in-place source's bit is clear in its
    launch's mask; a source off 16 bytes takes the byte path's grid."""
    buf = _Buf(num_ranks=2, rank=1)
    buf.agrs_set_config(8 * MiB, 32)
    st = buf._agrs
    n = 64 * 1024                      # bytes per tensor: the grid of the 16-byte path is smaller than the byte path's
    with buf.agrs_new_session():
        slot = _FakeArray((n,), 'uint8', ptr=st.data_base + 1 * n)      # rank 1's slot of the first region
        srcs = [slot] + [_FakeArray((n,), 'uint8') for _ in range(9)]
        *outs, handle = buf.all_gather(srcs)
        assert len(outs) == 10 and len(st.log) == 2
        first, second = (e[3] for e in st.log)
        assert (first['num_tensors'], second['num_tensors']) == (8, 2)
        assert (first['do_signal'], second['do_signal']) == (0, 1) and first['epoch'] == second['epoch'] == 1
        assert first['write_local_mask'] == 0xFE and second['write_local_mask'] == 0x3
        assert [first[f'src{i}'] for i in range(8)] + [second['src0'], second['src1']] == [t.info.ptr for t in srcs]
        assert second['region_offset1'] == buf.data_offset + 9 * 2 * n and second['num_bytes1'] == n
        assert st.log[0][1] == agrs_plan.gather_grid(n, True, 32) < agrs_plan.gather_grid(n, False, 32)
        st.log.clear()
        odd = _FakeArray((n,), 'uint8', ptr=_FakeArray((1,)).info.ptr + 1)
        buf.all_gather([_FakeArray((n,), 'uint8'), odd])
        (g,) = st.log
        assert g[1] == agrs_plan.gather_grid(n, False, 32) and g[3]['src1'] % 16 == 1
    del handle


def test_all_gather_one_launch_packs_the_block_a_named_bind_packs(fakes):
    """The one-launch path packs agrs_gather_batch_kernel's whole argument block in one struct (features/agrs/
    gather_entry.py `single_batch_pack`): byte for byte the block of a bind by name with the call's values (unused
    source slots zero, peer_bases and rank as bound), also when a source is its in-place slot (mask bit clear) and
    after a call of another size (the stale slots are zeroed again)."""
    buf = _Buf(num_ranks=2, rank=1)
    buf.agrs_set_config(MiB, 8)
    st = buf._agrs
    base = buf.sym.base + buf.data_offset

    def expected(srcs, sizes, offsets, mask, epoch, meta):
        pad = [0] * (agrs_kernels.GATHER_BATCH - len(srcs))
        named = {f'{f}{i}': v for f, vs in (('src', [*srcs, *pad]), ('num_bytes', [*sizes, *pad]),
                                            ('region_offset', [*offsets, *pad])) for i, v in enumerate(vs)}
        return bytes(st.kernels['gather_batch'].bind(
            1, agrs_kernels.THREADS, **named, num_tensors=len(srcs), write_local_mask=mask, peer_bases=0x1000, rank=1,
            do_signal=1, epoch=epoch, meta=meta).data)

    with buf.agrs_new_session():
        a, b, c = _FakeArray((8, 4), 'float32'), _FakeArray((3,), 'float32'), _FakeArray((5,), 'float32')
        buf.all_gather([a, b, c])
        offsets = [buf.data_offset, buf.data_offset + 256, buf.data_offset + 288]
        assert bytes(st._batch_launch.data) == expected([a.info.ptr, b.info.ptr, c.info.ptr], [128, 12, 20], offsets,
                                                        7, 1, 352 // 32)
        slot = _FakeArray((3,), 'float32', ptr=base + 352 + 12)     # rank 1's slot of the next first region
        buf.all_gather([slot, a])
        assert bytes(st._batch_launch.data) == expected([slot.info.ptr, a.info.ptr], [12, 128],
                                                        [buf.data_offset + 352, buf.data_offset + 384], 2, 2, 640 // 32)
        assert [e[1] for e in st.log] == [agrs_plan.gather_grid(128, True, 32)] * 2


def test_all_gather_in_place_and_overlap_checks(fakes):
    buf = _Buf(num_ranks=2, rank=1)
    buf.agrs_set_config(MiB, 8)
    st = buf._agrs
    base = buf.sym.base + buf.data_offset
    with buf.agrs_new_session():
        views = buf.agrs_get_inplace_tensor([(8, 4), (3,)], np.float32)
        assert views == [('view', 'cupy', 128, 128, 'float32', (8, 4)), ('view', 'cupy', 256 + 12, 12, 'float32',
                                                                          (3,))]
        assert buf.agrs_get_inplace_tensor((8, 4), 'bfloat16') == ('view', 'cupy', 64, 64, 'uint16', (8, 4))
        first = _FakeArray((8, 4), 'float32', ptr=base + 128)
        second = _FakeArray((3,), 'float32', ptr=base + 256 + 12)
        with pytest.raises(ValueError, match='agrs_get_inplace_tensor in order'):
            buf.all_gather(second)
        with pytest.raises(ValueError, match='contiguous'):
            buf.all_gather(_FakeArray((4, 8), 'float32', strides=(1, 4)))
        with pytest.raises(ValueError, match='cuda:0'):
            buf.all_gather(_FakeArray((4,), 'float32', device=1))
        assert not st.log and st.plan.used_bytes == 0          # nothing launched or reserved by the failures
        buf.all_gather([first, second])
        (g,) = st.log
        assert g[3]['write_local_mask'] == 0 and (g[3]['src0'], g[3]['src1']) == (base + 128, base + 268)
        # Reading an earlier region (a gathered output) is fine and copies.
        st.log.clear()
        buf.all_gather(_FakeArray((8, 4), 'float32', ptr=base))
        assert st.log[0][3]['write_local_mask'] == 1 and st.log[0][3]['region_offset0'] == buf.data_offset + 288


def test_reduce_scatter_checks_and_launch(fakes):
    buf = _Buf(num_ranks=4, rank=3, num_bytes=4 * MiB)
    buf.agrs_set_config(2 * MiB, 4)
    st = buf._agrs
    st.log.clear()
    with pytest.raises(TypeError, match='float32 or bfloat16'):
        buf.reduce_scatter(_FakeArray((64,), 'int32'))
    with pytest.raises(ValueError, match='multiple of 8'):
        buf.reduce_scatter(_FakeArray((4 * 12,), 'float32'))
    with pytest.raises(ValueError, match='divisible'):
        buf.reduce_scatter(_FakeArray((66,), 'float32'))
    with pytest.raises(ValueError, match='comm_precision'):
        buf.reduce_scatter(_FakeArray((64,), 'float32'), comm_precision='fp16')
    with pytest.raises(TypeError, match='scale'):
        buf.reduce_scatter(_FakeArray((64,), 'float32'), scale=None)
    with pytest.raises(ValueError, match='reduction area'):
        buf.reduce_scatter(_FakeArray((4 * 2 ** 19,), 'float32'))      # 8 MiB of slots, 2 MiB free
    assert not st.log and st.reduce_epoch == 0 and buf.comm_stream.waits == 0

    x = _FakeArray((4, 1024), 'float32')
    event = buf.reduce_scatter(x, comm_precision='bf16', scale=0.5)
    (r,) = st.log
    assert r[0] == 'agrs_reduce_kernel' and r[5] and r[4] is buf.comm_stream
    assert launch.pack_args(agrs_kernels.reduce_spec(4, False, True), list(r[3].values()))   # bf16-staging variant
    a = r[3]
    assert (a['num_elems'], a['shard_elems'], a['scale'], a['epoch'], a['is_all_reduce']) == (4096, 1024, 0.5, 1, 0)
    assert a['recv_offset'] == buf.data_offset + 2 * MiB and a['slot_bytes'] == 2048 and a['rank'] == 3
    assert r[1] == a['num_senders'] + 1                         # one chunk: one sender and one reducer
    out = event.wait()
    assert out.info.shape == (1024,) and out.info.dtype == 'float32' and a['out'] == out.info.ptr
    assert event.extra_tensors == (x, out)
    out = buf.reduce_scatter(_FakeArray((8 * 4,), 'bfloat16')).wait()
    assert out.info.shape == (8,) and out.info.dtype == 'bfloat16' and st.log[-1][3]['epoch'] == 2
    assert buf.reduce_scatter(_FakeArray((8, 16), 'float32')).wait().info.shape == (2, 16)


def test_reduce_scatter_with_previous_event_allocates_on_the_comm_stream(fakes, monkeypatch):
    # The communication stream then does not wait for the current stream: `out` must not reuse memory just freed there.
    streams = []

    class Alloc(_FakeAllocator):
        def empty(self, shape, dtype, stream=None):
            streams.append(stream)
            return super().empty(shape, dtype, stream)
    monkeypatch.setattr(interop, 'Allocator', Alloc)
    buf = _Buf(num_ranks=2, rank=0)
    x = _FakeArray((2, 64), 'float32')
    buf.reduce_scatter(x).wait()
    assert buf.comm_stream.waits == 1                           # ordered after the current stream
    buf.reduce_scatter(x, previous_event=_FakeEventHandle()).wait()
    assert buf.comm_stream.waits == 2 and streams == [None, buf.comm_stream]


def test_all_reduce_launches_reduce_then_unpack(fakes):
    buf = _Buf(num_ranks=3, rank=1, num_bytes=4 * MiB)
    st = buf._agrs_feature()
    with pytest.raises(TypeError, match='float32'):
        buf.all_reduce(_FakeArray((10,), 'bfloat16'))
    x = _FakeArray((1001,), 'float32')
    assert buf.all_reduce(x, scale=0.25).wait() is x
    reduce, unpack = st.log
    shard = agrs_plan.all_reduce_shard_elems(3, 1001)
    assert shard == 336 and reduce[3]['shard_elems'] == unpack[3]['shard_elems'] == shard
    assert reduce[3]['out'] == x.info.ptr + shard * 4 and reduce[3]['is_all_reduce'] == 1
    assert reduce[3]['recv_offset'] == buf.data_offset                # no session configured: the area starts at 0
    assert unpack[3]['gather_offset'] == reduce[3]['gather_offset'] == buf.data_offset + 3 * reduce[3]['slot_bytes']
    assert unpack[3]['epoch'] == reduce[3]['epoch'] == 1 and not unpack[5]
    assert buf.claimed == ['all-gather / reduce-scatter']


# ---- the rank program's stress and error checks, against the real host code with emulated kernels -----------------
def _EmuKernel(spec, fn):
    """A kernel launched by name that runs its effect `fn(arguments by name)` on host memory at launch (gathers and
    reductions exchange data collectively, so every rank must launch them in the same order, as on the GPU)."""
    return buffer_fakes.RecordingKernel(spec, run=fn)


class _HostAGRS(agrs_feature.AGRS):
    def __init__(self, buf, **kwargs):
        super().__init__(buf, **kwargs)
        import torch
        self._bytes['torch'] = torch.from_numpy(buf.mem[buf.data_offset:])
        self.signal, self.meta, self.shards, self.rank = {}, {}, {}, buf.sym.local_idx

    def load_kernels(self, n):
        buf = self._buf
        kernels = {'gather': _EmuKernel(agrs_kernels.gather_spec(n), lambda a: self._gather(buf, a)),
                   'gather_batch': _EmuKernel(agrs_kernels.gather_batch_spec(n), lambda a: self._gather_batch(buf, a)),
                   'wait': _EmuKernel(agrs_kernels.wait_spec(n), lambda a: self._wait(buf, a)),
                   'unpack': _EmuKernel(agrs_kernels.unpack_spec(n), lambda a: self._unpack(buf, a))}
        for i, s in agrs_kernels.REDUCE_VARIANTS:
            kernels[('reduce', i, s)] = _EmuKernel(agrs_kernels.reduce_spec(n, i, s),
                                                   lambda a, i=i, s=s: self._reduce(buf, a, i, s))
        return kernels

    @staticmethod
    def _gather(buf, a):
        import ctypes
        data = ctypes.string_at(a['src'], a['num_bytes'])
        rows = buf.group.allgather_object((a['region_offset'], a['num_bytes'], data, a['do_signal'], a['epoch'],
                                           a['meta']))
        st = buf._agrs
        for r, (offset, n, d, signal, epoch, meta) in enumerate(rows):
            if r != st.rank or a['write_local']:
                buf.mem[offset + r * n:offset + (r + 1) * n] = np.frombuffer(d, np.uint8)
            if signal:
                st.signal[r], st.meta[(r, epoch % 32)] = epoch, meta

    @classmethod
    def _gather_batch(cls, buf, a):
        # agrs_gather_batch_kernel: its tensors one after another, the signal (if any) after the last one.
        n = a['num_tensors']
        assert 1 <= n <= agrs_kernels.GATHER_BATCH and a['write_local_mask'] < 1 << n
        for t in range(n):
            cls._gather(buf, dict(src=a[f'src{t}'], num_bytes=a[f'num_bytes{t}'],
                                  region_offset=a[f'region_offset{t}'], write_local=(a['write_local_mask'] >> t) & 1,
                                  do_signal=a['do_signal'] if t == n - 1 else 0, epoch=a['epoch'], meta=a['meta']))

    @staticmethod
    def _wait(buf, a):
        st = buf._agrs
        for p in range(buf.num_ranks):
            if st.signal.get(p, 0) < a['epoch'] or st.meta[(p, a['epoch'] % 32)] != a['meta']:
                raise TimeoutError(f'emulated GPU wait: rank {p} did not signal epoch {a["epoch"]} with the same '
                                   f'meta ({st.signal.get(p)}, {st.meta.get((p, a["epoch"] % 32))} != {a["meta"]})')

    @staticmethod
    def _reduce(buf, a, in_bf16, stage_bf16):
        import ctypes
        st = buf._agrs
        dtype = np.uint16 if in_bf16 else np.float32
        num_elems, c = a['num_elems'], a['shard_elems']
        x = np.frombuffer(ctypes.string_at(a['x'], num_elems * np.dtype(dtype).itemsize), dtype=dtype).copy()
        xs = buf.group.allgather_object(x)
        lo = min(num_elems, st.rank * c)
        hi = min(num_elems, lo + c)
        result = agrs_reference.reduce_reference([v[lo:hi] for v in xs], stage_bf16, a['scale'], in_bf16)
        ctypes.memmove(a['out'], result.tobytes(), result.nbytes)
        st.shards[a['epoch']] = buf.group.allgather_object(result) if a['is_all_reduce'] else None

    @staticmethod
    def _unpack(buf, a):
        import ctypes
        st = buf._agrs
        for p, shard in enumerate(st.shards.pop(a['epoch'])):
            if p != st.rank and shard.size:
                ctypes.memmove(a['x'] + p * a['shard_elems'] * 4, shard.tobytes(), shard.nbytes)


def _HostBuffer(group, num_bytes):
    """An `ElasticBuffer` without a GPU (tests/fakes.py) whose symmetric memory is a numpy array."""
    from types import SimpleNamespace
    mem = np.zeros((2 << 20) + num_bytes, dtype=np.uint8)
    sym = SimpleNamespace(base=mem.ctypes.data, local_idx=group.rank, peer_bases_ptr=0x1000, num_bytes=mem.size,
                          num_peers=group.size)
    buf = buffer_fakes.make_buffer(group.size, group.rank, num_bytes, group=group, sym=sym, num_gpu_timeout_secs=1.0,
                                   num_cpu_timeout_secs=60.0)
    buf.mem = mem
    buf.claim_data_region = lambda owner: None
    buf.barrier = lambda use_comm_stream=True, with_cpu_sync=False, sequential=True: group.barrier()
    buf.synchronize = lambda stream=None: None
    return buf


@pytest.mark.parametrize('num_ranks', [2, 3])
def test_rank_program_stress_on_emulated_kernels(num_ranks, monkeypatch):
    torch = pytest.importorskip('torch')
    from argparse import Namespace
    from concurrent.futures import ThreadPoolExecutor

    from deepep_cupy.tests import agrs as prog
    current = _FakeStream('current')
    monkeypatch.setattr(elastic, 'AGRS', _HostAGRS)
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: current)
    monkeypatch.setattr(interop, 'Allocator', lambda kind: type('A', (), {'empty': staticmethod(
        lambda shape, dtype, stream=None: torch.empty(shape, dtype=getattr(torch, dtype)))})())
    monkeypatch.setattr(streams, 'EventHandle', _FakeEventHandle)
    monkeypatch.setattr(torch.cuda, 'ExternalStream', lambda ptr: None)
    monkeypatch.setattr(torch.Tensor, 'record_stream', lambda self, stream: None)
    monkeypatch.setattr(prog, 'DEVICE', 'cpu')
    monkeypatch.setattr(prog, 'STRESS_SHAPE', (4, 8, 64))
    args = Namespace(seed=7, num_stress_gathers=12, num_stress_reductions=10, num_max_inflight_agrs=4, num_sms=0)
    exchange = buffer_fakes.ThreadExchange(num_ranks)

    def rank_main(rank):
        group = buffer_fakes.ThreadGroup(rank, num_ranks, exchange)
        session = ElasticBuffer.get_agrs_num_max_session_bytes(group, [prog.STRESS_SHAPE] * 4, torch.bfloat16)
        reduce_bytes = max(ElasticBuffer.get_agrs_reduce_num_bytes(group, 100_000),
                           ElasticBuffer.get_agrs_reduce_num_bytes(group, num_ranks * 8 * 6000, 'reduce_scatter'))
        buf = _HostBuffer(group, ElasticBuffer.get_agrs_buffer_size_hint(group, session, reduce_bytes))
        buf.agrs_set_config(session, 4)
        checked = sum(prog.run_stress(buf, args, it) for it in range(2))
        checked += prog.test_many_tensors(buf, args, session)
        tried = prog.test_errors(buf, args)
        return checked, tried

    with ThreadPoolExecutor(num_ranks) as pool:
        results = list(pool.map(rank_main, range(num_ranks)))
    for checked, tried in results:
        assert checked == 2 * (12 + 10) + 11 + 9 + 1
        assert len(tried) >= 15 and all(': ' in line for line in tried)


def test_emulation_catches_a_wrong_reference(monkeypatch):
    """The emulated stress really compares: a corrupted reference must fail."""
    pytest.importorskip('torch')
    from deepep_cupy.tests import agrs as prog
    real = agrs_reference.all_reduce_reference
    monkeypatch.setattr(agrs_reference, 'all_reduce_reference', lambda inputs, scale=1.0: real(inputs, scale) + 1)
    with pytest.raises(prog.Failure, match='mismatch'):
        test_rank_program_stress_on_emulated_kernels(2, monkeypatch)
