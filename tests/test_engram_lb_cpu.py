"""Engram, load balancing and BufferAllocator without a GPU: the kernel families compile for sm_90 and match their
launch declarations, the size hints and layouts, the allocator's plans and materialisation (CPU torch tensors), the
host model of the redundancy mapping, and every argument check that runs before a kernel (on a fake buffer whose
"device" is the CPU and whose "symmetric memory" is a CPU tensor)."""

import weakref
from pathlib import Path

import fakes
import numpy as np
import pytest

from deepep_cupy import ElasticBuffer, constants
from deepep_cupy.buffers import allocator
from deepep_cupy.features.engram import plan as engram
from deepep_cupy.features.lb import feature as lb_feature
from deepep_cupy.features.lb import plan as lb
from deepep_cupy.jit import compiler
from deepep_cupy.runtime import workspace
from deepep_cupy.runtime.group import ProcessGroup
from deepep_cupy.runtime.sizes import align

torch = pytest.importorskip('torch')

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


# ---- kernels -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('module', [engram, lb], ids=['engram', 'lb'])
def test_families_match_declarations(module):
    # Compiled for sm_90 with every other shipped specialisation (tests/test_jit.py).
    from test_peer_copy import compile_probe
    for family, specs in module.shipped_specs().items():
        extra = 1 if module is engram else 0                                  # engram's index range kernel
        assert len(specs) == 16 + extra and len({s.name for s in specs}) == 16 + extra   # two kernels x 1..8 ranks
        compile_probe(family, specs)


def test_kernel_constants_match_the_launchers():
    source = (compiler.kernels_dir() / 'lb.cu').read_text()
    assert 'kLBCtrlOffset = kWsLBOffset;' in source and 'kLBCtrlBytes = kWsLBBytes;' in source
    assert f'kLBThreads = {lb.THREADS}' in source
    unroll = int(source.split('kLBUnroll = ')[1].split(';')[0])
    assert lb.CHUNK_BYTES == 32 * unroll * 16
    source = (compiler.kernels_dir() / 'engram.cu').read_text()
    assert 'kEngramCtrlOffset = kWsEngramOffset;' in source and 'kEngramCtrlBytes = kWsEngramBytes;' in source
    assert f'kEngramThreads = {engram.THREADS}' in source and f'kEngramUnroll = {engram.UNROLL}' in source
    # The workspace ranges given to the two features (common/workspace.cuh's map) and nothing beyond.
    assert (engram.CTRL_OFFSET, engram.CTRL_OFFSET + engram.CTRL_BYTES) == (28672, 30720) == \
        (workspace.ENGRAM.offset, workspace.ENGRAM.end)
    assert (lb.CTRL_OFFSET, lb.CTRL_OFFSET + lb.CTRL_BYTES) == (30720, 32768) == (workspace.LB.offset, workspace.LB.end)
    assert engram.HOST_RANGE_OFFSET == workspace.HOST_ENGRAM_RANGE.offset
    # Shared memory of the largest reduce / prefetch launch stays under the 48 KiB default (static part included).
    assert 4 * (4 * constants.NUM_MAX_LOCAL_EXPERTS + lb.NUM_MAX_MAPPING_ENTRIES) <= 40 * 1024


def test_signature_probe_catches_a_wrong_lb_declaration():
    from dataclasses import replace

    from test_peer_copy import compile_probe

    from deepep_cupy.jit.launch import Param
    spec = lb.reduce_grads_spec(2)
    params = list(spec.params)
    params[4] = Param('num_bytes_per_expert', np.int32)
    with pytest.raises(AssertionError, match='num_bytes_per_expert'):
        compile_probe('lb', [replace(spec, params=tuple(params))])


# ---- allocator -----------------------------------------------------------------------------------------------------

def test_alignment_getters():
    assert allocator.get_num_allocation_alignment() == 2 * MiB
    assert allocator.get_num_tma_alignment() == 32
    assert allocator.get_num_rdma_alignment() == 64


def test_plan_offsets_and_sizes():
    plan = allocator.BufferAllocator()
    assert plan.num_bytes == 0 and plan.alignment == 2 * MiB
    a = plan.allocate((3, 5), torch.float32)
    b = plan.allocate(0, torch.bfloat16)
    plan.allocate((MiB + 1,), torch.int16)
    d = plan.allocate((2, 3), 'bfloat16')
    assert a.device.type == 'meta' and a.shape == (3, 5) and b.shape == (0,)
    assert isinstance(d, allocator.Placeholder) and d.dtype == np.uint16 and d.array is None
    assert [x.offset for x in plan.allocations] == [0, 2 * MiB, 2 * MiB, 6 * MiB]
    assert [x.num_bytes for x in plan.allocations] == [60, 0, 2 * MiB + 2, 12]
    assert plan.num_bytes == 8 * MiB
    same = allocator.BufferAllocator()
    for shape, dtype in ((3, 5), torch.float32), (0, torch.bfloat16), ((MiB + 1,), torch.int16), ((2, 3), 'bfloat16'):
        same.allocate(shape, dtype)
    assert same.signature() == plan.signature()
    with pytest.raises(ValueError, match='non-negative'):
        plan.allocate((-1,), torch.float32)
    with pytest.raises(TypeError, match='dtype'):
        plan.allocate((1,), object())


def test_materialize_swaps_placeholders_in_place():
    plan = allocator.BufferAllocator()
    a = plan.allocate((3, 5), torch.float32)
    b = plan.allocate((4,), torch.bfloat16)
    held = [a, b]
    storage = torch.zeros(plan.num_bytes, dtype=torch.uint8)
    out = plan.materialize(storage)
    assert out[0] is a and held[1] is b and a.device.type == 'cpu' and a.dtype == torch.float32
    assert a.data_ptr() == storage.data_ptr() and b.data_ptr() == storage.data_ptr() + 2 * MiB
    a.fill_(1.0)
    assert storage[:4].tolist() == [0, 0, 128, 63]
    with pytest.raises(RuntimeError, match='once'):
        plan.materialize(storage)
    with pytest.raises(RuntimeError, match='already materialised'):
        plan.allocate((1,), torch.float32)


def test_materialize_checks_the_storage():
    plan = allocator.BufferAllocator()
    plan.allocate((3 * MiB,), torch.uint8)
    with pytest.raises(ValueError, match='holds'):
        plan.materialize(torch.zeros(2 * MiB, dtype=torch.uint8))
    with pytest.raises(ValueError, match='uint8'):
        plan.materialize(torch.zeros(MiB, dtype=torch.float32))
    assert not plan.materialized


# ---- engram host logic ---------------------------------------------------------------------------------------------

def test_engram_size_hint():
    # The seed's defaults: 524288 entries x 128 BF16, 512 tokens x 24 entries per fetch.
    assert engram.storage_size_hint(524288, 128, 512 * 24) == (4 * MiB, 128 * MiB)
    assert engram.storage_size_hint(524288, 128, 512 * 24, torch.float8_e4m3fn) == (2 * MiB, 64 * MiB)
    # Entries are padded to 32 bytes: 100 BF16 = 200 -> 224 bytes.
    assert engram.storage_size_hint(10000, 100, 1000, 'bfloat16') == (2 * MiB, 4 * MiB)
    assert engram.storage_size_hint(0, 128, 0) == (0, 0)
    assert ElasticBuffer.get_engram_storage_size_hint(1, 128, 1) == (2 * MiB, 2 * MiB)
    with pytest.raises(TypeError, match='bfloat16 or float8'):
        engram.storage_size_hint(1, 128, 1, torch.float32)
    with pytest.raises(ValueError, match='num_entries'):
        engram.storage_size_hint(-1, 128, 1)


def test_engram_layout():
    gpu, cpu = engram.storage_size_hint(524288, 128, 512 * 24)
    lay = engram.EngramLayout.in_data_region(2 * MiB, gpu + cpu, 4, 524288, 128, 'bfloat16')
    assert lay.row_bytes == 256 and lay.table_bytes == 128 * MiB and lay.table_offsets == (0,)
    assert lay.out_offset == 2 * MiB and lay.out_bytes == gpu and lay.storage_offset == 2 * MiB + gpu
    assert lay.num_global_entries == 4 * 524288 and lay.num_layers == 1
    assert lay.check_fetch(1, 512, 24) == 512 * 24
    assert lay.check_fetch(1, 0, 24) == 0
    with pytest.raises(ValueError, match='fetch output'):
        lay.check_fetch(1, gpu // 256 + 1, 1)
    with pytest.raises(ValueError, match='2 layers'):
        lay.check_fetch(2, 1, 1)
    with pytest.raises(ValueError, match='get_engram_storage_size_hint'):
        engram.EngramLayout.in_data_region(2 * MiB, cpu, 4, 524288 + 1, 128, 'bfloat16')
    # Host storage: the whole data region is output, the tables start at the storage base.
    lay = engram.EngramLayout.build(4, (524288,), 128, 'bfloat16', (2 * MiB, gpu), None, cpu)
    assert lay.storage_offset is None and lay.out_bytes == gpu and lay.table_offsets == (0,)
    with pytest.raises(ValueError, match='storage size hint'):
        engram.EngramLayout.build(4, (524288 + 1,), 128, 'bfloat16', (2 * MiB, gpu), None, cpu)


def test_engram_layered_layout_and_hint():
    # DeepEP V2.5 test_engram's defaults: layers of 524288 and 524309 entries x 256 BF16, 512 tokens x 24 entries.
    gpu, storage = engram.layered_size_hint([524288, 524309], 256, 512, 24, torch.bfloat16)
    assert gpu == align(2 * 512 * 24 * 512, 2 * MiB) == 12 * MiB
    offsets, num_table_bytes = engram.table_offsets([524288, 524309], 512)
    assert offsets == (0, 524288 * 512) and num_table_bytes == (524288 + 524309) * 512
    assert storage == align(num_table_bytes, 2 * MiB)
    # Odd row counts keep every table TABLE_ALIGNMENT aligned.
    offsets, end = engram.table_offsets([3, 5, 1], 48)
    assert offsets == (0, 256, 512) and end == 512 + 48
    lay = engram.EngramLayout.build(2, [524288, 524309], 256, 'bfloat16', (2 * MiB, gpu), 2 * MiB + gpu, storage)
    assert lay.num_layers == 2 and lay.num_global_entries == 2 * 524309
    assert lay.check_fetch(2, 512, 24) == 512 * 24
    with pytest.raises(ValueError, match='fetch output'):
        lay.check_fetch(2, 513, 24)
    words = engram.layer_words(lay, [0, 2 * 524288])
    assert words.dtype == np.int64 and words.tolist() == [[524288, 0, 0], [524309, 524288 * 512, 2 * 524288]]
    assert engram.layer_words(lay).tolist()[1] == [524309, 524288 * 512, 0]
    assert engram.layered_size_hint(7, 64, 1, 1) == (2 * MiB, 2 * MiB)
    with pytest.raises(ValueError, match='at least one layer'):
        engram.layered_size_hint([], 64, 1, 1)
    with pytest.raises(ValueError, match=r'num_entries_per_layer\[1\]'):
        engram.layered_size_hint([4, 0], 64, 1, 1)


# ---- a buffer without a GPU ----------------------------------------------------------------------------------------

class FakeGroup(ProcessGroup):
    """`size` ranks seen from `rank`; the other ranks' all-gather contributions come from `others(r, obj)`."""

    def __init__(self, rank=0, size=1, others=None):
        super().__init__(rank, size)
        self.others = others or (lambda r, obj: obj)
        self.num_collectives = 0

    def allgather_object(self, obj, timeout=None):
        self.num_collectives += 1
        return [obj if r == self.rank else self.others(r, obj) for r in range(self.size)]


class FakeSym:
    def __init__(self, storage, num_peers, local_idx):
        self.storage, self.base, self.num_bytes = storage, storage.data_ptr(), storage.numel()
        self.num_peers, self.local_idx = num_peers, local_idx

    def local_view(self, offset, count, dtype=np.uint8):
        return self.storage[offset:offset + count]


def FakeBuffer(num_ranks=2, rank=0, num_bytes=8 * MiB, group=None):
    """An `ElasticBuffer` without a GPU (tests/fakes.py) whose "symmetric memory" is a CPU tensor (device -1 is what
    CPU tensors report); its load-balancing kernels are never loaded."""
    storage = torch.zeros(2 * MiB + num_bytes, dtype=torch.uint8)
    buf = fakes.make_buffer(num_ranks, rank, num_bytes, group=group or FakeGroup(rank, num_ranks),
                            sym=FakeSym(storage, num_ranks, rank))
    buf._lb = lb_feature.LB(weakref.proxy(buf))
    buf._lb._kernels = {}
    return buf


# ---- engram argument checks ----------------------------------------------------------------------------------------

def test_engram_write_checks():
    buf = FakeBuffer(num_ranks=2, num_bytes=6 * MiB)
    table = torch.zeros((1024, 128), dtype=torch.bfloat16)
    layout, si, sfi = buf._engram_feature()._check_write([table], None)
    assert layout.storage_offset == 2 * MiB + 4 * MiB and layout.out_bytes == 4 * MiB and sfi is None
    fp8 = torch.zeros((1024, 128), dtype=torch.float8_e4m3fn)
    _, _, sfi = buf._engram_feature()._check_write([fp8], [torch.zeros((2048, 1))])
    assert sfi[0].shape == (2048, 1)
    cases = [((table.float(), None), TypeError, 'bfloat16 or float8'),
             ((table[0], None), ValueError, '2-D'),
             ((table[:, :100], None), ValueError, 'contiguous'),
             ((torch.zeros((16, 4), dtype=torch.bfloat16), None), ValueError, 'multiple of 16'),
             ((table, torch.zeros((2048, 1))), ValueError, 'float8_e4m3fn tables'),
             ((fp8, torch.zeros((1024, 1))), ValueError, r'num_ranks \* num_entries = 2048'),
             ((fp8, torch.zeros((2048, 1), dtype=torch.float64)), TypeError, 'sf must be float32 or int32'),
             ((fp8, torch.zeros((2048, 2))[:, :1]), ValueError, 'sf must be contiguous'),
             ((torch.zeros((5 * 8192, 128), dtype=torch.bfloat16), None), ValueError, 'get_engram_storage_size_hint')]
    for (storage, sf), exc, match in cases:
        with pytest.raises(exc, match=match):
            buf._engram_feature()._check_write([storage], None if sf is None else [sf])
    with pytest.raises(ValueError, match='one table per layer'):
        buf._engram_feature()._check_write([], None)
    with pytest.raises(ValueError, match='sfs has 2 entries'):
        buf._engram_feature()._check_write([fp8], [torch.zeros((2048, 1))] * 2)


def test_engram_write_raises_on_every_rank_before_any_kernel():
    # Another rank writes a table of a different size: this rank (whose arguments are fine) must raise too.
    group = FakeGroup(0, 2, others=lambda r, obj: (None, ((999,), 128, 'bfloat16', None)))
    buf = FakeBuffer(num_ranks=2, group=group)
    with pytest.raises(ValueError, match='same shapes and dtype'):
        buf.engram_write(torch.zeros((1024, 128), dtype=torch.bfloat16))
    # Another rank rejected its arguments.
    group = FakeGroup(0, 2, others=lambda r, obj: ("TypeError('storage must be ...')", None))
    buf = FakeBuffer(num_ranks=2, group=group)
    with pytest.raises(ValueError, match='rank 1 rejected'):
        buf.engram_write(torch.zeros((1024, 128), dtype=torch.bfloat16))
    # A local error is raised after taking part in the all-gather (so the other ranks do not hang).
    group = FakeGroup(0, 2)
    buf = FakeBuffer(num_ranks=2, group=group)
    with pytest.raises(TypeError):
        buf.engram_write(torch.zeros((1024, 128), dtype=torch.float32))
    assert group.num_collectives == 1 and buf._data_region_owner is None


def test_engram_fetch_checks(monkeypatch):
    buf = FakeBuffer(num_ranks=2, num_bytes=6 * MiB)
    indices = torch.zeros((4, 3), dtype=torch.int32)
    with pytest.raises(RuntimeError, match='write the tables first'):
        buf.engram_fetch(indices)
    layout = engram.EngramLayout.in_data_region(buf.data_offset, buf.num_bytes, 2, 1024, 128, 'bfloat16')
    feature = buf._engram_feature()
    feature.layout, feature.written = layout, True
    from deepep_cupy.runtime import interop
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: None)
    monkeypatch.setattr(interop, 'stream_getter', lambda kind, device: lambda: None)
    monkeypatch.setattr(feature, '_index_range', lambda x, ptr, n, stream: lambda: (int(x.min()), int(x.max())))
    cases = [(indices.long(), TypeError, 'int32'), (indices[0], ValueError, '2-D'),
             (indices.t(), ValueError, 'contiguous'),
             (torch.zeros((4 * MiB // 256 + 1, 1), dtype=torch.int32), ValueError, 'fetch output'),
             (torch.full((4, 3), 2048, dtype=torch.int32), ValueError, r'\[0, 2048\)'),
             (torch.full((4, 3), -1, dtype=torch.int32), ValueError, 'min -1')]
    for idx, exc, match in cases:
        with pytest.raises(exc, match=match):
            buf.engram_fetch(idx)
    with pytest.raises(ValueError, match='num_qps'):
        buf.engram_fetch(indices, num_qps=-1)


def test_engram_index_range_bound_launch_packs_like_a_bind_by_name():
    """The index range check's `HostRange` with a kernel that binds (engram's and the CPU-sync dispatch's path): per
    call its four arguments are packed in one struct, byte for byte what a bind by name packs; the record is reset
    before the launch and read back as Python ints; a record that never lands times out naming the array."""
    from deepep_cupy.runtime.host_range import RANGE_THREADS, HostRange

    host = fakes.FakeHostMapped()
    offset = engram.HOST_RANGE_OFFSET
    record = host.view('int64', 3, offset)
    values = np.array([5, -3, 11, 7], dtype=np.int64)

    def land(args):             # what value_range_kernel writes: lo and hi, then the sequence number
        record[1], record[2] = int(values.min()), int(values.max())
        record[0] = args['seq']
    kernel = fakes.RecordingKernel(engram.RANGE_SPEC, run=land)
    host_range = HostRange(host, offset)
    for seq in (1, 2):
        lo_hi = host_range.start(kernel, 0x5000 + seq, values.size, 'stream', 1.0, 'indices')()
        assert lo_hi == (-3, 11) and all(type(v) is int for v in lo_hi)
        (b, _), = host_range._bound.values()
        named = kernel.bind(1, RANGE_THREADS, values=0x5000 + seq, num_values=values.size,
                            host_out=host.ptr + offset, seq=seq)
        assert bytes(b.data) == bytes(named.data) and kernel.log[-1].args['seq'] == seq
    assert len(kernel.log) == 2 and kernel.log[-1].stream == 'stream'
    kernel.run = None
    wait = host_range.start(kernel, 0x5000, values.size, None, 0.05, 'engram indices')
    assert record[0] == 0                   # reset before the launch
    with pytest.raises(TimeoutError, match='range check of engram indices'):
        wait()


# ---- load balancing: host model of the mapping -----------------------------------------------------------------------

def test_theoretical_num_sms():
    assert lb.theoretical_num_sms(478 * 0.9) == 10          # ceil(430.2 / 45) = 10
    assert lb.theoretical_num_sms(900) == 20
    assert lb.theoretical_num_sms(100) == 4                 # ceil(2.2) = 3 -> aligned to 4
    assert lb.theoretical_num_sms(0) == 10                  # no NVLink reported: 450 GB/s assumed
    assert lb.theoretical_num_sms(10000, num_device_sms=133) == 132


def test_mapping_checks_and_work_lists():
    L = 4
    mapping = np.array([[4, -1, 9, 5],        # rank 0 hosts experts of ranks 1, 2, 1
                        [0, 8, 3, -1],        # rank 1 hosts experts of ranks 0, 2, 0
                        [1, 0, 7, 0]], dtype=np.int32)
    lb.check_mapping_values(mapping, L)
    assert lb.owned_entries(mapping, 0, L) == [(1, 0, 0), (1, 2, 3), (2, 0, 1), (2, 1, 0), (2, 3, 0)]
    assert lb.copies_per_expert(mapping, 0, L) == {0: [(1, 0), (2, 1), (2, 3)], 3: [(1, 2)], 1: [(2, 0)]}
    assert lb.count_work(mapping, 0, L) == (5, 3) and lb.count_work(mapping, 2, L) == (2, 2)
    assert lb.send_bytes_per_peer(mapping, 0, L, 32, 'prefetch') == [0, 64, 96]
    assert lb.send_bytes_per_peer(mapping, 0, L, 32, 'reduce') == [0, 64, 32]
    assert lb.send_bytes_per_peer(mapping, 2, L, 32, 'reduce') == [96, 32, 0]
    bad = mapping.copy()
    bad[1, 3] = 12
    with pytest.raises(ValueError, match=r'redundancy_mapping\[1, 3\] = 12.*\[0, 12\)'):
        lb.check_mapping_values(bad, L)
    bad[1, 3] = -2
    with pytest.raises(ValueError, match=r'\[1, 3\] = -2'):
        lb.check_mapping_values(bad, L)
    bad[1, 3] = 6
    with pytest.raises(ValueError, match='own experts'):
        lb.check_mapping_values(bad, L)


# ---- load balancing: argument checks ---------------------------------------------------------------------------------

def _lb_buffer(num_ranks=2, rank=0, group=None, hidden=64, num_redundant=3, L=4):
    buf = FakeBuffer(num_ranks=num_ranks, rank=rank, group=group)
    plan = allocator.BufferAllocator()
    pool = plan.allocate((num_redundant, hidden), torch.float32)
    weights = plan.allocate((num_redundant, 16), torch.bfloat16)
    out = buf.lb_set_plan(plan)
    assert out[0] is pool and pool.data_ptr() == buf.sym.base + buf.data_offset
    grads = torch.zeros((L, hidden), dtype=torch.float32)
    mapping = torch.full((num_ranks, num_redundant), -1, dtype=torch.int32)
    mapping[1 - rank if num_ranks == 2 else 0, 0] = rank * L + 1
    return buf, pool, weights, grads, mapping


def test_lb_set_plan_claims_the_region_and_checks_the_plan():
    buf, pool, *_ = _lb_buffer()
    assert buf._data_region_owner == 'load balancing' and buf._lb.num_bytes == 4 * MiB
    with pytest.raises(RuntimeError, match='load balancing'):
        buf.claim_data_region('engram')
    big = allocator.BufferAllocator()
    big.allocate((9 * MiB,), torch.uint8)
    with pytest.raises(ValueError, match='plan needs'):
        FakeBuffer().lb_set_plan(big)
    other = FakeGroup(0, 2, others=lambda r, obj: 2 * MiB)
    with pytest.raises(ValueError, match='identical on every rank'):
        FakeBuffer(group=other).lb_set_plan(4 * MiB)
    assert FakeBuffer().lb_set_plan(4 * MiB).numel() == 4 * MiB


def test_lb_reduce_check_accepts_valid_arguments():
    buf, pool, _, grads, mapping = _lb_buffer()
    call = buf._lb.check('reduce', pool, grads, mapping, 6)
    assert call.num_redundant == 3 and call.num_local_experts == 4 and call.num_sms == 6 and call.kind == 'torch'
    assert call.pairs[0].pool_offset == 2 * MiB and call.pairs[0].num_bytes_per_expert == 256
    assert call.pairs[0].src is grads and call.host_mapping.dtype == np.int32
    assert buf._lb.check('reduce', pool, grads, mapping, 0).num_sms == lb.theoretical_num_sms(
        __import__('deepep_cupy.runtime.nvlink', fromlist=['x']).get_nvlink_gbs(), 132)


def test_lb_reduce_check_rejects_bad_arguments():
    buf, pool, weights, grads, mapping = _lb_buffer()
    own = mapping.clone()
    own[0, 1] = 2                                       # expert 2 belongs to rank 0
    big = torch.full((2, 2049), -1, dtype=torch.int32)
    cases = [((pool, grads.double(), mapping), TypeError, 'expert_grads must be float32'),
             ((pool, grads[:, :32], mapping), ValueError, 'contiguous'),
             ((pool, torch.zeros((4, 32)), mapping), ValueError, 'hidden 64 but expert_grads has 32'),
             ((torch.zeros((3, 64)), grads, mapping), ValueError, 'load-balancing region'),
             ((pool, grads, mapping.long()), TypeError, 'redundancy_mapping must be int32'),
             ((pool, grads, mapping[:1]), ValueError, r'num_nvlink_ranks=2'),
             ((pool, grads, mapping.t().contiguous().t()), ValueError, 'contiguous'),
             ((pool, grads, own), ValueError, 'own experts'),
             ((pool, grads, torch.full((2, 3), 8, dtype=torch.int32)), ValueError, r'\[0, 8\)'),
             ((pool, grads, big), ValueError, 'at most 4096'),
             ((pool, torch.zeros((0, 64)), mapping), ValueError, 'between 1 and'),
             ((pool[:2], grads, mapping), ValueError, 'num_redundant=3')]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            buf._lb.check('reduce', *args, 0)
    with pytest.raises(ValueError, match='num_sms'):
        buf._lb.check('reduce', pool, grads, mapping, -1)
    # Rows of 16 bytes (hidden 4) are not a multiple of 32.
    buf2, *_ = _lb_buffer(hidden=4)
    with pytest.raises(ValueError, match='multiple of 32'):
        buf2._lb.check('reduce', buf2.sym.storage[2 * MiB:2 * MiB + 48].view(torch.float32).view(3, 4),
                       torch.zeros((4, 4)), mapping, 0)


def test_lb_prefetch_check():
    buf, pool, weights, grads, mapping = _lb_buffer()
    src = torch.zeros((4, 16), dtype=torch.bfloat16)
    call = buf._lb.check('prefetch', [pool, weights], [grads, src], mapping, 0)
    assert [p.num_bytes_per_expert for p in call.pairs] == [256, 32]
    assert [p.pool_offset for p in call.pairs] == [2 * MiB, 4 * MiB]
    assert buf._lb.check('prefetch', pool, grads, mapping, 0).pairs[0].dst is pool
    cases = [(([], [], mapping), ValueError, 'non-empty'),
             (([pool], [grads, src], mapping), ValueError, 'has 1 tensors but expert_weights has 2'),
             ((pool, grads.view(torch.int32), mapping), TypeError, 'same dtype'),
             (([pool, weights], [grads, torch.zeros((5, 16), dtype=torch.bfloat16)], mapping), ValueError,
              r'expert_weights\[1\] has 5 experts'),
             ((weights, torch.zeros((4, 32), dtype=torch.bfloat16), mapping), ValueError, 'must be equal')]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            buf._lb.check('prefetch', *args, 0)


def test_lb_check_is_collective():
    # Another rank holds a different mapping: every rank raises, naming the disagreement.
    def other(r, obj):
        rank, err, sig = obj
        return (r, err, sig[:2] + ('ffff',) + sig[3:])
    group = FakeGroup(0, 2)
    buf, pool, _, grads, mapping = _lb_buffer(group=group)
    group.others = other
    with pytest.raises(ValueError, match='disagree'):
        buf._lb.check('reduce', pool, grads, mapping, 0)
    # Another rank calls the other operation.
    group.others = lambda r, obj: (r, None, ('prefetch',) + obj[2][1:])
    with pytest.raises(ValueError, match='disagree'):
        buf._lb.check('reduce', pool, grads, mapping, 0)
    # Another rank's arguments were rejected.
    group.others = lambda r, obj: (r, "ValueError('bad')", None)
    with pytest.raises(ValueError, match='rank 1 rejected'):
        buf._lb.check('reduce', pool, grads, mapping, 0)
    # A local error still takes part in the all-gather, then raises the local error.
    group.others = lambda r, obj: (r, None, obj[2])
    before = group.num_collectives
    with pytest.raises(TypeError):
        buf._lb.check('reduce', pool, grads.double(), mapping, 0)
    assert group.num_collectives == before + 1
    # Ranks of another scale-up domain may use their own mapping.
    group.others = lambda r, obj: (r + 2, None, ('reduce', 'something else'))
    assert buf._lb.check('reduce', pool, grads, mapping, 0).op == 'reduce'


def test_lb_grid_sizes():
    assert lb._grid(0, 10) == 1 and lb._grid(16, 10) == 1 and lb._grid(17, 10) == 2 and lb._grid(10 ** 6, 10) == 10


# ---- rank-program helpers --------------------------------------------------------------------------------------------

def test_redundancy_mapping_patterns():
    from deepep_cupy.tests.reduce_grads import make_redundancy_mapping
    R, C, E = 4, 8, 64
    L = E // R
    ring = make_redundancy_mapping(R, C, E, 0.25, 0, 'ring')
    assert ring.dtype == np.int32 and (ring >= 0).all()
    assert ((ring // L) == (np.arange(R)[:, None] + 1) % R).all()
    assert np.bincount((ring // L).ravel(), minlength=R).tolist() == [C] * R
    spread = make_redundancy_mapping(R, C, E, 0.25, 0, 'spread')
    assert np.bincount((spread // L).ravel(), minlength=R).tolist() == [C] * R
    assert all(len(set((spread[r] // L).tolist())) == R - 1 for r in range(R))
    rnd = make_redundancy_mapping(R, C, E, 0.25, 3, 'random')
    assert np.array_equal(rnd, make_redundancy_mapping(R, C, E, 0.25, 3, 'random'))
    assert (rnd == -1).any() and (rnd >= 0).any()
    for m in (ring, spread, rnd):
        lb.check_mapping_values(m, L)
    assert (make_redundancy_mapping(1, C, E, 0.0, 0, 'random') == -1).all()


def test_expected_reduction_is_exact_and_ordered():
    from deepep_cupy.tests.reduce_grads import expected_expert_grads, make_pattern, slot_key
    mapping = np.array([[-1, 2], [1, 1]], dtype=np.int32)      # L = 2: rank 0 owns experts 0, 1; rank 1 owns 2, 3
    out = expected_expert_grads(mapping, 0, 2, 24)
    assert np.array_equal(out[0], make_pattern(24, 0))
    assert np.array_equal(out[1], make_pattern(24, 1) + make_pattern(24, slot_key(1, 0, 2)) +
                          make_pattern(24, slot_key(1, 1, 2)))
    assert np.array_equal(make_pattern(24, -5), make_pattern(24, (1 << 12) - 1 - 5))


def test_engram_reference_rows():
    from deepep_cupy.tests.engram import reference_rows
    N, R = 5, 3
    tables = [np.arange(N * 2, dtype=np.int16).reshape(N, 2) + 100 * r for r in range(R)]
    indices = [np.array([[0, 14], [7, 5]]), np.array([[3, 3]]), np.array([[10, 1], [2, 9]])]

    class Group:
        """Runs the three ranks' calls in lockstep (each all-gather sees every rank's object)."""
        size = R

    results = [None] * R
    # Simulate the two all-gathers by computing what each rank contributes.
    first = [idx.reshape(-1) for idx in indices]
    shipped = [[tables[o][idx[idx // N == o] % N] for idx in first] for o in range(R)]
    for me in range(R):
        g = Group()
        g.rank = me
        answers = iter([first, shipped])
        g.allgather_object = lambda obj, answers=answers: next(answers)
        results[me] = reference_rows(g, tables[me], indices[me], N)
    for me in range(R):
        flat = indices[me].reshape(-1)
        want = np.stack([tables[g // N][g % N] for g in flat])
        assert np.array_equal(results[me], want)


def test_parse_num_bytes():
    from deepep_cupy.tests.allocation import parse_num_bytes
    assert parse_num_bytes('64M') == 64 * MiB and parse_num_bytes('512K') == 512 * 1024
    assert parse_num_bytes('4096') == 4096 and parse_num_bytes('1G') == 1 << 30 and parse_num_bytes('2MiB') == 2 * MiB
    with pytest.raises(Exception, match='byte count'):
        parse_num_bytes('lots')


def test_rank_programs_import_and_parse_arguments():
    import importlib
    for name in ('engram', 'reduce_grads', 'prefetch_weights', 'allocation'):
        module = importlib.import_module(f'deepep_cupy.tests.{name}')
        assert callable(module.main) and module.__doc__


# ---- launch arguments against the kernel declarations ----------------------------------------------------------------

def test_lb_launch_plan_matches_the_specs():
    pack_args = fakes.pack_named
    buf, pool, weights, grads, mapping = _lb_buffer()           # rank 0 owns expert 1, hosted in slot 0 of rank 1
    src = torch.zeros((4, 16), dtype=torch.bfloat16)
    call = buf._lb.check('prefetch', [pool, weights], [grads, src], mapping, 6)
    plan = lb.launch_plan(call, 2, 0, 0x1000, 0x2000, 10 ** 9)
    assert [p.spec.name for p in plan] == ['deepep::lb_prefetch_kernel<2>'] * 2
    for p in plan:
        packed = pack_args(p.spec, p.args)
        assert p.shared_mem == 4 * 2 * 3 and p.grid == 1
    flags = [(int(pack_args(p.spec, p.args)[6]), int(pack_args(p.spec, p.args)[7])) for p in plan]
    assert flags == [(1, 0), (0, 1)]                             # ready signals first, done signals last
    assert int(packed[3]) == src.data_ptr() and int(packed[5]) == 4 * MiB and int(packed[4]) == 32
    one = lb.launch_plan(buf._lb.check('prefetch', pool, grads, mapping, 6), 2, 0, 0x1000, 0x2000, 10 ** 9)
    assert len(one) == 1 and tuple(int(v) for v in pack_args(one[0].spec, one[0].args)[6:8]) == (1, 1)
    call = buf._lb.check('reduce', pool, grads, mapping, 6)
    (p,) = lb.launch_plan(call, 2, 0, 0x1000, 0x2000, 10 ** 9)
    packed = pack_args(p.spec, p.args)
    # Entry lists int32 [4 L + R C] = 88 bytes, rounded to 128, then 3 stages of 16 warps x 4 KiB.
    assert p.spec.name == 'deepep::lb_reduce_grads_kernel<2>' and p.shared_mem == 128 + 3 * 16 * 4096
    assert int(packed[3]) == grads.data_ptr() and int(packed[4]) == 256 and int(packed[5]) == 2 * MiB
    assert (int(packed[6]), int(packed[7])) == (3, 128)
    assert int(packed[9]) == 0 and int(packed[8]) == 0x1000


def test_lb_reduce_stages_fit_the_shared_memory():
    assert lb.reduce_grads_shared_mem(2, 3, 4) == (3, 128, 128 + 3 * 65536)
    # The largest entry lists (L = 1024, R * C = 4096: 32 KiB) still leave room for three stages on sm_90.
    assert lb.reduce_grads_shared_mem(8, 512, 1024) == (3, 32768, 32768 + 3 * 65536)
    assert lb.reduce_grads_shared_mem(8, 512, 1024, 99 * 1024)[0] == 1      # a 99 KiB device: one stage


def test_lb_grid_follows_the_work():
    buf = FakeBuffer(num_ranks=2)
    plan = allocator.BufferAllocator()
    pool = plan.allocate((8, 1 << 16), torch.float32)           # 256 KiB per expert = 64 work chunks
    buf.lb_set_plan(plan)
    grads = torch.zeros((4, 1 << 16))
    mapping = torch.full((2, 8), -1, dtype=torch.int32)
    mapping[1, :3] = torch.tensor([0, 1, 1], dtype=torch.int32)
    call = buf._lb.check('reduce', pool, grads, mapping, 100)
    assert lb.launch_plan(call, 2, 0, 0, 0, 1)[0].grid == 8       # 2 experts x 64 chunks / 16 per block
    call = buf._lb.check('prefetch', pool, grads, mapping, 100)
    assert lb.launch_plan(call, 2, 0, 0, 0, 1)[0].grid == 12      # 3 slots x 64 chunks / 16
    assert lb.launch_plan(buf._lb.check('reduce', pool, grads, mapping, 5), 2, 0, 0, 0, 1)[0].grid == 5


def test_lb_previous_event_is_checked_collectively():
    group = FakeGroup(0, 2)
    buf, pool, _, grads, mapping = _lb_buffer(group=group)
    before = group.num_collectives
    with pytest.raises(TypeError, match='previous_event'):
        buf._lb.check('reduce', pool, grads, mapping, 0, previous_event=object())
    assert group.num_collectives == before + 1


def test_engram_launch_arguments_match_the_specs():
    pack_args = fakes.pack_named
    layout = engram.EngramLayout.build(2, (1024, 1000), 128, 'float8_e4m3fn', (2 * MiB, 2 * MiB), 4 * MiB, 2 * MiB)
    storage = torch.zeros((1000, 128), dtype=torch.uint8)
    packed = pack_args(engram.write_spec(2), engram.write_args(layout, 1, storage, 0x10000, 0x1000, 1, 0x2000,
                                                                10 ** 9))
    assert int(packed[1]) == 128 * 1000 and int(packed[2]) == 0x10000 + 128 * 1024 and int(packed[4]) == 1
    indices, sf, sf_out = (torch.zeros((2, 5, 3), dtype=torch.int32), torch.zeros((4048, 2)), torch.zeros((2, 5, 6)))
    packed = pack_args(engram.fetch_spec(2), engram.fetch_args(layout, indices, 2, 5, 3, 0x3000, 0x4000, 0x5000, sf,
                                                                2, sf_out, (30, 6, 1)))
    assert [int(v) for v in packed[1:5]] == [30, 15, 3, 128]
    assert [int(v) for v in packed[5:8]] == [0x3000, 0x4000, 0x5000]
    assert int(packed[8]) == sf.data_ptr() and int(packed[9]) == 2 and int(packed[10]) == sf_out.data_ptr()
    assert [int(v) for v in packed[11:]] == [30, 6, 1]
    packed = pack_args(engram.fetch_spec(2), engram.fetch_args(layout, indices, 2, 0, 3, 1, 1, 1, None, 2, None,
                                                                (0, 0, 0)))
    assert int(packed[1]) == 0 and int(packed[2]) == 1 and int(packed[8]) == 0 and int(packed[9]) == 0
    assert engram.grid_for(0, 132) == 1 and engram.grid_for(12288 * 16, 132) == 48
    assert engram.grid_for(10 ** 8, 132) == 132 and engram.grid_for(10 ** 8, 7) == 7


def test_load_balancing_refuses_several_domains():
    """Across scale-up domains load balancing raises a clear NotImplementedError naming the limit."""
    from types import SimpleNamespace

    import pytest

    from deepep_cupy.features.lb.feature import LB
    with pytest.raises(NotImplementedError, match='load balancing over 2 scale-up domains'):
        LB(SimpleNamespace(num_scaleout_ranks=2))
    assert LB(SimpleNamespace(num_scaleout_ranks=1)).num_bytes is None
