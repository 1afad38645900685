"""DeepEP V2.5's API classes on CPU: `EPBuffer` (EP and load-balancing regions, `defer_epilogue`), `BucketBuffer` /
`BucketSession` (launch arguments of the in-place bucket kernels, result views, sessions), `PPBuffer`, `EngramBuffer`
(layered tables in GPU or host storage) and `deepep_cupy.comm`, built without a GPU: the buffers' attributes are set
by hand, memory is a CPU tensor, kernels are recording fakes with the real launchers' signatures, and every signature
is compared with DeepEP V2.5's (written down by hand from its sources)."""

import inspect
import weakref
from types import SimpleNamespace

import fakes
import numpy as np
import pytest

torch = pytest.importorskip('torch')

import deepep_cupy  # noqa: E402
from deepep_cupy import comm  # noqa: E402
from deepep_cupy.buffers import bucket as bucket_api  # noqa: E402
from deepep_cupy.buffers.allocator import BufferAllocator  # noqa: E402
from deepep_cupy.buffers.base import BufferBase  # noqa: E402
from deepep_cupy.buffers.bucket import BucketBuffer, BucketSession  # noqa: E402
from deepep_cupy.buffers.engram import EngramBuffer  # noqa: E402
from deepep_cupy.buffers.ep import EPBuffer  # noqa: E402
from deepep_cupy.buffers.pp import PPBuffer  # noqa: E402
from deepep_cupy.features.agrs import bucket as bucket_feature  # noqa: E402
from deepep_cupy.features.engram import feature as engram_feature  # noqa: E402
from deepep_cupy.features.engram import plan as engram_plan  # noqa: E402
from deepep_cupy.features.ep import feature as ep_feature  # noqa: E402
from deepep_cupy.features.lb import feature as lb_feature  # noqa: E402
from deepep_cupy.runtime import interop, streams  # noqa: E402
from deepep_cupy.runtime.event import EventOverlap  # noqa: E402

MiB = 1 << 20
WS = 2 * MiB
REQ = inspect.Parameter.empty


class CpuSym:
    """Symmetric memory as a CPU tensor (base = its address; every peer's base is the same memory)."""

    def __init__(self, num_bytes, num_peers=1, local_idx=0):
        self.storage = torch.zeros(num_bytes, dtype=torch.uint8)
        self.base, self.num_bytes = self.storage.data_ptr(), num_bytes
        self.num_peers, self.local_idx = num_peers, local_idx
        self.peer_bases = [self.base] * num_peers
        self.domain_ranks = list(range(num_peers))
        self.peer_bases_ptr = 0x1000

    def local_view(self, offset, count, dtype=np.uint8):
        return self.storage[offset:offset + count]


def make(cls, num_ranks=1, rank=0, num_bytes=4 * MiB, num_extra_bytes=0, **attrs):
    """A V2.5 buffer of class `cls` without a GPU (the attributes `BufferBase.__init__` sets, fakes for the rest)."""
    buf = cls.__new__(cls)
    comm_stream = fakes.FakeStream('comm')
    host_mapped = fakes.FakeHostMapped()
    buf.__dict__.update(
        device=-1, rank_idx=rank, num_ranks=num_ranks, num_scaleup_ranks=num_ranks, num_scaleout_ranks=1,
        scaleup_rank_idx=rank, scaleout_rank_idx=0, num_bytes=num_bytes, num_extra_bytes=num_extra_bytes,
        num_host_bytes=0, host_storage=None, num_device_sms=132, num_gpu_timeout_secs=10.0,
        num_cpu_timeout_secs=10.0, explicitly_destroy=True, _destroyed=False, _failed=None,
        _data_region_owner=None, host_mapped=host_mapped, error_record=host_mapped.view('int32', 8),
        group=fakes.AgreeingGroup(rank, num_ranks), comm_stream=comm_stream,
        stream_order=fakes.stream_order(comm_stream), sym=CpuSym(WS + num_bytes + num_extra_bytes, num_ranks, rank),
        nccl=None, topology=SimpleNamespace(scaleup_peers=list(range(num_ranks)), physical_scaleup=num_ranks),
        allow_hybrid_mode=True)
    buf.__dict__.update(attrs)
    return buf


@pytest.fixture
def no_cuda(monkeypatch):
    """Streams and events without CUDA: the current stream is a fake, events are fake handles."""
    current = fakes.FakeStream('current')
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: current)
    monkeypatch.setattr(interop, 'stream_getter', lambda kind, device: lambda: current)
    monkeypatch.setattr(streams, 'EventHandle', fakes.FakeEventHandle)
    monkeypatch.setattr(engram_feature, 'EventHandle', fakes.FakeEventHandle)
    monkeypatch.setattr(interop, 'torch_stream', lambda handle: None)
    monkeypatch.setattr(torch.Tensor, 'record_stream', lambda self, stream: None)
    return current


# ---- signatures: DeepEP V2.5's, written down from its sources --------------------------------------------------------

def sig(*params):
    return tuple(params)


DEEPEP_V25 = {
    EPBuffer.__init__: sig(('group', REQ), ('num_bytes', None), ('num_max_tokens_per_rank', 0), ('hidden', 0),
                           ('num_topk', 0), ('use_fp8_dispatch', False), ('lb_allocation_plan_or_num_bytes', 0),
                           ('deterministic', False), ('allow_hybrid_mode', True), ('allow_multiple_reduction', True),
                           ('prefer_overlap_with_compute', True), ('sl_idx', None), ('num_allocated_qps', 0),
                           ('num_cpu_timeout_secs', 300), ('num_gpu_timeout_secs', 100),
                           ('explicitly_destroy', False)),
    EPBuffer.dispatch: sig(('x', REQ), ('topk_idx', None), ('topk_weights', None),
                           ('cumulative_local_expert_recv_stats', None), ('num_experts', None),
                           ('num_max_tokens_per_rank', None), ('expert_alignment', None), ('num_sms', 0),
                           ('num_qps', 0), ('previous_event', None), ('async_with_compute_stream', False),
                           ('allocate_on_comm_stream', False), ('handle', None), ('do_handle_copy', False),
                           ('do_cpu_sync', None), ('do_expand', False), ('do_zero_padding', False),
                           ('use_tma_aligned_col_major_sf', False), ('defer_epilogue', False)),
    EPBuffer.combine: sig(('x', REQ), ('handle', REQ), ('topk_weights', None), ('bias', None), ('num_sms', 0),
                          ('num_qps', 0), ('previous_event', None), ('async_with_compute_stream', False),
                          ('allocate_on_comm_stream', False), ('defer_epilogue', False)),
    EPBuffer.get_buffer_size_hint: sig(('group', REQ), ('num_max_tokens_per_rank', REQ), ('hidden', REQ),
                                       ('num_topk', 0), ('use_fp8_dispatch', False), ('allow_hybrid_mode', True),
                                       ('allow_multiple_reduction', True)),
    EPBuffer.get_theoretical_num_sms: sig(('num_experts', REQ), ('num_topk', REQ), ('num_scaleout_topk', 0),
                                          ('rdma_gbs', 0), ('nvlink_gbs', 0), ('sm_read_gbs', 0),
                                          ('sm_write_gbs', 0)),
    EPBuffer.get_theoretical_num_qps: sig(('num_sms', REQ)),
    EPBuffer.lb_get_theoretical_num_sms: sig(),
    EPBuffer.lb_prefetch_weights: sig(('redundant_expert_weights', REQ), ('expert_weights', REQ),
                                      ('redundancy_mapping', REQ), ('num_sms', 0), ('previous_event', None)),
    EPBuffer.lb_reduce_grads: sig(('redundant_expert_grads', REQ), ('expert_grads', REQ),
                                  ('redundancy_mapping', REQ), ('num_sms', 0), ('previous_event', None)),
    EPBuffer.barrier: sig(('wait_comm_stream', True), ('with_cpu_sync', False), ('sequential', True),
                          ('context_idx', None)),
    BucketBuffer.__init__: sig(('group', REQ), ('allocation_plan_or_num_bytes', REQ), ('sl_idx', None),
                               ('num_gpu_timeout_secs', 100), ('explicitly_destroy', False)),
    BucketBuffer.get_theoretical_num_sms: sig(('op', REQ), ('group', None)),
    BucketBuffer.get_context_idx: sig(('group', None)),
    BucketBuffer.session: sig(),
    BucketBuffer.barrier: sig(('wait_comm_stream', True), ('with_cpu_sync', False), ('sequential', True),
                              ('group', None)),
    BucketBuffer.reduce_scatter: sig(('srcs', REQ), ('comm_precision', 'fp32'), ('scale', 1.0), ('group', None),
                                     ('num_sms', None)),
    BucketBuffer.all_reduce: sig(('srcs', REQ), ('scale', 1.0), ('group', None), ('num_sms', None)),
    BucketBuffer.all_gather: sig(('srcs', REQ), ('dsts', None), ('group', None), ('num_sms', None)),
    BucketSession.allocate: sig(('shapes', REQ), ('dtype', None), ('group', None)),
    PPBuffer.__init__: sig(('group', REQ), ('num_max_tensor_bytes', REQ), ('num_max_inflight_tensors', REQ),
                           ('sl_idx', None), ('num_gpu_timeout_secs', 100), ('explicitly_destroy', False)),
    PPBuffer.send: sig(('x', REQ), ('dst_rank_idx', REQ), ('num_sms', None)),
    PPBuffer.recv: sig(('x', REQ), ('src_rank_idx', REQ), ('num_sms', None)),
    EngramBuffer.__init__: sig(('group', REQ), ('num_gpu_bytes', REQ), ('num_rdma_storage_bytes', REQ),
                               ('use_cpu_rdma_storage', REQ), ('num_allocated_qps', REQ), ('qp_depth', REQ),
                               ('restrict_rd_atomic', False), ('allow_hybrid_mode', True), ('sl_idx', None),
                               ('num_gpu_timeout_secs', 100), ('explicitly_destroy', False)),
    EngramBuffer.get_storage_size_hint: sig(('group', REQ), ('num_entries_per_layer', REQ), ('hidden', REQ),
                                            ('num_max_tokens', REQ), ('num_entries_per_token', REQ),
                                            ('dtype', 'bfloat16'), ('num_sf_packs', 0)),
    EngramBuffer.get_theoretical_config: sig(('group', REQ), ('num_layers', REQ), ('num_max_tokens', REQ),
                                             ('num_entries_per_token', REQ), ('num_max_read_requests_per_qp', 16)),
    EngramBuffer.set_config: sig(('num_entries_per_layer', REQ), ('hidden', REQ), ('num_max_tokens', REQ),
                                 ('num_entries_per_token', REQ), ('dtype', 'bfloat16'), ('num_sf_packs', 0)),
    EngramBuffer.write: sig(('storages', REQ), ('sfs', None)),
    EngramBuffer.fetch: sig(('indices', REQ), ('num_qps', 0), ('use_tma_aligned_col_major_sf', True)),
    comm.barrier: sig(('buffer', REQ), ('wait_comm_stream', True), ('with_cpu_sync', False), ('sequential', True),
                      ('context_idx', None)),
    comm.get_comm_stream: sig(('buffer', REQ)),
    comm.get_physical_domain_size: sig(('group_or_buffer', REQ)),
    comm.get_logical_domain_size: sig(('group_or_buffer', REQ), ('allow_hybrid_mode', None)),
    comm.destroy_all_managed_nccl_comm: sig(),
    BufferBase.print_memory_usage: sig(),
}
# Where ours has a default DeepEP lacks (a caller passing the argument cannot tell), or a dtype default by name.
RELAXED = {('PPBuffer.__init__', 'group'), ('PPBuffer.__init__', 'num_max_tensor_bytes'),
           ('PPBuffer.__init__', 'num_max_inflight_tensors'), ('EngramBuffer.__init__', 'group'),
           ('EngramBuffer.__init__', 'num_gpu_bytes'), ('EngramBuffer.__init__', 'num_rdma_storage_bytes'),
           ('EngramBuffer.__init__', 'use_cpu_rdma_storage'), ('EngramBuffer.__init__', 'num_allocated_qps'),
           ('EngramBuffer.__init__', 'qp_depth'), ('EPBuffer.__init__', 'group')}


@pytest.mark.parametrize('fn', list(DEEPEP_V25), ids=lambda fn: fn.__qualname__)
def test_signatures_match_deepep_v25(fn):
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != 'self']
    want = DEEPEP_V25[fn]
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional[:len(want)]] == [n for n, _ in want], fn.__qualname__
    for p, (name, default) in zip(positional, want):
        if (fn.__qualname__, name) in RELAXED:
            continue
        if default in ('bfloat16',) or (name == 'dtype' and default is None):
            continue            # torch.bfloat16 / torch.float32 there, the name or None here (no torch import)
        assert p.default == default, f'{fn.__qualname__}({name}): {p.default!r} != {default!r}'
    # Anything beyond DeepEP's parameters must be optional and keyword-only (a superset, never a reorder).
    extra = params[len(want):]
    assert all(p.kind == p.KEYWORD_ONLY and p.default is not REQ for p in extra), fn.__qualname__


def test_exports_and_alias_modules():
    for name in ('EPBuffer', 'BucketBuffer', 'BucketSession', 'PPBuffer', 'EngramBuffer', 'BufferAllocator',
                 'get_num_allocation_alignment', 'get_num_rdma_alignment', 'get_num_tma_alignment',
                 'destroy_all_managed_nccl_comm', 'get_physical_domain_size', 'get_logical_domain_size'):
        assert name in dir(deepep_cupy) and getattr(deepep_cupy, name) is not None, name
    assert deepep_cupy.comm is comm and deepep_cupy.BucketBuffer is BucketBuffer
    from deepep_cupy.deep_ep_alias import resolve
    for module in ('bucket', 'pp', 'engram', 'ep'):
        assert resolve(f'deep_ep.buffers.{module}')[0] == f'deepep_cupy.buffers.{module}'
    assert resolve('deep_ep.comm')[0] == 'deepep_cupy.comm'
    from deepep_cupy.utils import comm as utils_comm
    assert utils_comm.barrier is comm.barrier and utils_comm.get_nccl_comm_handle is comm.get_nccl_comm_handle


# ---- EPBuffer ------------------------------------------------------------------------------------------------------

def make_ep(num_bytes=4 * MiB, num_lb_bytes=2 * MiB, num_ranks=1, plan=None):
    buf = make(EPBuffer, num_ranks, num_bytes=num_bytes, num_extra_bytes=num_lb_bytes, num_lb_bytes=num_lb_bytes,
               num_max_tokens_per_rank=0, hidden=0, num_topk=0, allow_multiple_reduction=True,
               prefer_overlap_with_compute=True, num_allocated_qps=129, _nvlink_gbs=450.0, _ep=None)
    buf._lb = lb_feature.LB(weakref.proxy(buf), region=(buf.extra_offset, num_lb_bytes))
    buf._lb._kernels = {}
    return buf


def test_ep_buffer_regions_and_plan():
    plan = BufferAllocator()
    pool = plan.allocate((8, 4096), torch.uint8)
    grads = plan.allocate((8, 1024), torch.float32)
    buf = make_ep(num_bytes=4 * MiB, num_lb_bytes=plan.num_bytes)
    assert buf.extra_offset == WS + 4 * MiB and buf._lb.region() == (WS + 4 * MiB, plan.num_bytes)
    plan.materialize(buf.lb_get_storage('torch'))
    assert pool.data_ptr() == buf.sym.base + WS + 4 * MiB and grads.data_ptr() == pool.data_ptr() + 2 * MiB
    with pytest.raises(RuntimeError, match='fixed at construction'):
        buf._lb.set_region(2 * MiB, 2 * MiB)
    # The EP feature's layout must end inside the EP region although the allocation is bigger (LB region after it).
    ep = ep_feature.EP(weakref.proxy(buf), 0, 0, 0, True, True, 450.0)
    assert ep.settings.sym_num_bytes == WS + 4 * MiB < buf.sym.num_bytes


def test_ep_buffer_dispatch_combine_v25_semantics(monkeypatch, no_cuda):
    buf = make_ep()
    calls = []
    out = ('recv_x', 'recv_topk_idx', 'recv_topk_weights', 'handle')

    class FakeEP:
        def dispatch(self, *args, **kwargs):
            calls.append(('dispatch', args, kwargs))
            return (*out, EventOverlap(fakes.FakeEventHandle()))

        def combine(self, *args, **kwargs):
            calls.append(('combine', args, kwargs))
            return 'combined_x', 'combined_w', EventOverlap(fakes.FakeEventHandle())

    buf._ep = FakeEP()
    with pytest.raises(ValueError, match='do_handle_copy must be False'):
        buf.dispatch('x', do_handle_copy=True)
    with pytest.raises(ValueError, match='async_with_compute_stream'):
        buf.dispatch('x', defer_epilogue=True)
    with pytest.raises(ValueError, match='num_allocated_qps'):
        buf.dispatch('x', num_qps=130)
    assert buf.dispatch('x', 'topk', num_sms=5)[:4] == out
    kwargs = calls[-1][2]
    assert kwargs['num_sms'] == 6 and kwargs['previous_event_before_epilogue'] is None
    assert kwargs['do_handle_copy'] is False
    event = buf.dispatch('x', 'topk', async_with_compute_stream=True, defer_epilogue=True)
    assert isinstance(event, EventOverlap) and event.current_stream_wait() == out
    assert calls[-1][2]['async_with_compute_stream'] is True
    assert buf.combine('y', 'handle', num_sms=3)[:2] == ('combined_x', 'combined_w') and calls[-1][2]['num_sms'] == 4
    event = buf.combine('y', 'handle', async_with_compute_stream=True, defer_epilogue=True)
    assert event.wait() == ('combined_x', 'combined_w')
    with pytest.raises(ValueError, match='async_with_compute_stream'):
        buf.combine('y', 'handle', defer_epilogue=True)


def test_ep_buffer_qps_and_lb(monkeypatch):
    buf = make_ep()
    assert buf.get_theoretical_num_qps(8) == 129 and buf.get_theoretical_num_qps(4) == 65
    buf.allow_hybrid_mode = False
    assert buf.get_theoretical_num_qps(20) == 9
    seen = []
    monkeypatch.setattr(buf._lb, 'prefetch_weights', lambda *a: seen.append(a) or 'event')
    monkeypatch.setattr(buf._lb, 'theoretical_num_sms', lambda: 20)
    assert buf.lb_prefetch_weights('dst', 'src', 'map', num_sms=7) == 'event' and seen[-1][3] == 8
    buf.lb_prefetch_weights('dst', 'src', 'map')
    assert seen[-1][3] == 20
    empty = make_ep(num_lb_bytes=0)
    with pytest.raises(RuntimeError, match='no load-balancing region'):
        empty.lb_reduce_grads('dst', 'src', 'map')


# ---- BucketBuffer ----------------------------------------------------------------------------------------------------

def make_bucket(num_ranks=2, rank=1, storage_bytes=3 * MiB, plan=None):
    num_bytes = 4 * MiB
    buf = make(BucketBuffer, num_ranks, rank, num_bytes=num_bytes, storage_num_bytes=storage_bytes, sl_idx=None,
               groups=['g0'], contexts=[], _nvlink_gbs=450.0)
    buf._bucket = bucket_feature.Bucket(weakref.proxy(buf))
    buf._bucket.contexts = buf.contexts
    log = []
    ctx = bucket_feature.BucketContext.__new__(bucket_feature.BucketContext)
    ctx.__dict__.update(index=0, group='g0', pg=buf.group, num_ranks=num_ranks, rank_idx=rank,
                        peer_bases_ptr=buf.sym.peer_bases_ptr, ctrl_offset=bucket_feature.context_offset(0),
                        physical=(1, num_ranks), mapping=None, num_barriers=0, barrier=None,
                        kernels={op: fakes.RecordingKernel(bucket_feature.kernel_spec(op, num_ranks), log)
                                 for op in bucket_feature.OPS})
    buf.contexts.append(ctx)
    buf.storage = buf.sym.storage[WS:WS + storage_bytes]
    if plan is not None:
        plan.materialize(buf.storage)
    return buf, log


def test_bucket_theoretical_num_sms():
    model = bucket_feature.theoretical_num_sms
    # NVLink groups: destination GB/s = nvlink / ranks, SMs = max(dst / 180, dst / 45), at least 6 (RS) / 4 (AR).
    assert model('reduce_scatter', 1, 8, 810.0, 0, 132) == 6
    assert model('reduce_scatter', 1, 2, 810.0, 0, 132) == 10
    assert model('all_reduce', 1, 8, 810.0, 0, 132) == 4 and model('all_reduce', 1, 2, 810.0, 0, 132) == 10
    assert model('all_gather', 1, 8, 810.0, 0, 132) == 0
    assert model('all_reduce', 1, 1, 8100.0, 0, 132) == 132            # capped by the device
    assert model('reduce_scatter', 2, 4, 810.0, 50.0, 132) == 8
    with pytest.raises(ValueError, match='op must be'):
        model('broadcast', 1, 2, 810.0, 0, 132)
    assert bucket_feature.context_offset(1) == bucket_feature.CTRL_OFFSET + 1024
    with pytest.raises(ValueError, match='at most 16 groups'):
        bucket_feature.context_offset(16)


def test_bucket_in_place_collectives(no_cuda):
    plan = BufferAllocator()
    a = plan.allocate((2 * 4096,), torch.float32)
    b = plan.allocate((2 * 3080,), torch.float32)
    buf, log = make_bucket(num_ranks=2, rank=1, storage_bytes=plan.num_bytes, plan=plan)
    base, storage = buf.sym.base, buf.storage.data_ptr()
    assert a.data_ptr() == storage == base + WS and b.data_ptr() == storage + 2 * MiB

    handle = buf.all_reduce([a, b], scale=0.25)
    assert handle.num_sms == buf.get_theoretical_num_sms('all_reduce') == 6        # 450 GB/s NVLink, 2 ranks
    assert [(e.name.split('<')[0], e.args['offset'], e.args['num'], e.args['epoch']) for e in log] == [
        ('deepep::bucket_all_reduce_impl', WS, 8192, 1), ('deepep::bucket_all_reduce_impl', WS + 2 * MiB, 6160, 4)]
    assert all(e.cooperative and e.grid == 6 and e.args['rank'] == 1 and abs(e.args['scale'] - 0.25) < 1e-7
               for e in log)
    dsts = handle.wait()
    assert dsts[0] is a and dsts[1] is b

    log.clear()
    handle = buf.reduce_scatter(a, num_sms=12, comm_precision='bf16')
    shard = handle.wait()
    assert handle.num_sms == 12 and log[0].grid == 12 and log[0].args['epoch'] == 7
    assert shard.data_ptr() == a.data_ptr() + 1 * shard.nbytes and shard.shape == (4096,)

    log.clear()
    src = a[4096:]                                          # rank 1's shard: gathered in place
    gathered = buf.all_gather([src], num_sms=0).wait()
    assert log[0].args['src'] == 0 and log[0].args['offset'] == WS and log[0].args['num'] == 4096 * 4
    assert log[0].args['epoch'] == 9 and gathered[0].data_ptr() == a.data_ptr() and gathered[0].numel() == 8192
    external = torch.ones(3080)
    gathered = buf.all_gather(external, dsts=b, num_sms=None).wait()
    assert log[1].args['src'] == external.data_ptr() and log[1].args['offset'] == WS + 2 * MiB
    assert gathered.data_ptr() == b.data_ptr() and handle_num_sms_is_zero(buf, external, b)
    assert buf.contexts[0].num_barriers == 2 * 3 + 2 + 2 + 2 + 2

    with pytest.raises(ValueError, match='belong to this BucketBuffer'):
        buf.all_reduce(torch.zeros(8))
    with pytest.raises(TypeError, match='float32'):
        buf.reduce_scatter(a.view(torch.int32))
    with pytest.raises(ValueError, match='shards'):
        buf.reduce_scatter(a[:8191])
    with pytest.raises(ValueError, match='rank-1 shard'):
        buf.all_gather(a[:10])                               # its gathered region would start before the storage
    with pytest.raises(ValueError, match='holds'):
        buf.all_gather(external, dsts=a)
    with pytest.raises(ValueError, match='comm_precision'):
        buf.reduce_scatter(a, comm_precision='fp8')
    with pytest.raises(ValueError, match='not one of'):
        buf.all_reduce(a, group='other')


def handle_num_sms_is_zero(buf, src, dst) -> bool:
    return buf.all_gather(src, dsts=dst).num_sms == 0


def test_bucket_session_stages_outside_tensors(no_cuda):
    buf, log = make_bucket(num_ranks=2, rank=1, storage_bytes=3 * MiB)
    storage = buf.storage.data_ptr()
    src = torch.arange(32, dtype=torch.float32).view(8, 4)
    with buf.session() as session:
        with pytest.raises(RuntimeError, match='do not nest'):
            buf.session().__enter__()
        shard = buf.reduce_scatter(src).wait()
        # Staged at the storage start (a copy of src), reduced there; the result is rank 1's shard of the copy.
        assert log[-1].args['offset'] == WS and log[-1].args['num'] == 32
        assert shard.data_ptr() == storage + 16 * 4 and torch.equal(buf.storage[:128].view(torch.float32), src.view(-1))
        reduced = buf.all_reduce(torch.full((10,), 2.0)).wait()
        assert log[-1].args['offset'] == WS + 128 and reduced.data_ptr() == storage + 128
        out = torch.zeros(2, 3, 4)
        result = buf.all_gather(torch.ones(3, 4), dsts=out).wait()
        assert result is out and log[-1].args['offset'] == WS + 192 and log[-1].args['num'] == 48
        # The kernel staged into the storage; wait() copied the staged region into the caller's tensor.
        assert torch.equal(out.view(-1), buf.storage[192:288].view(torch.float32))
        t = session.allocate((3, 5))
        assert t.data_ptr() == storage + 320 and t.shape == (3, 5) and t.dtype == torch.float32
        pair = session.allocate([(2,), (4,)], dtype=torch.bfloat16)
        assert [p.data_ptr() - storage for p in pair] == [384, 448]
        with pytest.raises(ValueError, match='not one of'):
            session.allocate((2,), group='other')
        with pytest.raises(RuntimeError, match='out of storage'):
            session.allocate((3 * MiB,))
    assert 'all_gather' not in buf.__dict__ and isinstance(buf.session(), BucketSession)
    assert bucket_api.BucketSession is BucketSession


def test_bucket_context_index_and_comm_barrier(monkeypatch, no_cuda):
    buf, _ = make_bucket()
    buf.groups = ['g0', 'g1']
    assert buf.get_context_idx(buf.groups[1]) == 1
    with pytest.raises(ValueError, match='group is required'):
        buf.get_context_idx()
    seen = []
    monkeypatch.setattr(BufferBase, 'barrier', lambda self, *a: seen.append(('base', a)))
    buf.contexts.append(SimpleNamespace(barrier=lambda stream: seen.append(('ctx1', stream.name))))
    buf.barrier(group=buf.groups[0], with_cpu_sync=False)
    comm.barrier(buf, wait_comm_stream=False, context_idx=1)
    assert seen == [('base', (True, False, True)), ('ctx1', 'current')]


# ---- PPBuffer --------------------------------------------------------------------------------------------------------

def test_pp_buffer_delegates(monkeypatch):
    buf = make(PPBuffer, 2, 0, num_max_tensor_bytes=1000, num_max_inflight_tensors=2, _storage=None)
    calls = []
    buf._pp = SimpleNamespace(send=lambda *a: calls.append(('send', a)), recv=lambda *a: calls.append(('recv', a)))
    assert buf.send('x', 1) is None and buf.recv('y', 1, num_sms=4) is None
    assert calls == [('send', ('x', 1, 0)), ('recv', ('y', 1, 4))]
    assert buf.storage.numel() == buf.num_bytes and buf.storage.data_ptr() == buf.sym.base + WS
    assert buf.runtime is buf and buf.main_context is buf and buf.context is buf
    buf._destroyed = True
    assert buf.runtime is None and buf.storage is None


def test_memory_usage(capsys):
    buf = make(EngramBuffer, 2, 0, num_bytes=4 * MiB, num_extra_bytes=2 * MiB)
    buf.num_host_bytes = 8 * MiB
    assert buf.memory_usage() == {'workspace': WS, 'data': 4 * MiB, 'extra': 2 * MiB, 'host': 8 * MiB,
                                  'host_mapped': 65536}
    buf.print_memory_usage()
    assert 'buffer 4.0 MiB, extra 2.0 MiB' in capsys.readouterr().out


# ---- EngramBuffer ----------------------------------------------------------------------------------------------------

class FakeHostStorage:
    def __init__(self, num_bytes, num_peers):
        self.num_bytes, self.base = num_bytes, 0x5000_0000
        self.addrs = [self.base + r * 0x1000_0000 for r in range(num_peers)]


def make_engram(cpu: bool, monkeypatch, num_ranks=2, rank=1):
    gpu, storage = engram_plan.layered_size_hint([1000, 1001], 64, 16, 3)
    buf = make(EngramBuffer, num_ranks, rank, num_bytes=gpu, num_extra_bytes=0 if cpu else storage,
               num_allocated_qps=20, qp_depth=16, use_cpu_rdma_storage=cpu)
    host = FakeHostStorage(storage, num_ranks) if cpu else None
    buf._engram = engram_feature.Engram(weakref.proxy(buf), out_region=(WS, gpu),
                                        storage_region=None if cpu else (buf.extra_offset, storage),
                                        host_storage=host)
    log = []
    kernels = {s.name: fakes.RecordingKernel(s, log) for s in engram_plan.all_specs(num_ranks)}
    monkeypatch.setattr(buf._engram, '_kernels', lambda: kernels)
    arrays = {}

    def device_arrays(layout, sf_rows):
        arrays.update(layers=engram_plan.layer_words(layout, sf_rows), bases=(
            host.addrs if cpu else [b + layout.storage_offset for b in buf.sym.peer_bases]))
        ptr = SimpleNamespace(data=SimpleNamespace(ptr=0xAB00))
        return {'layers': ptr, 'table_bases': SimpleNamespace(data=SimpleNamespace(ptr=0xCD00))}
    monkeypatch.setattr(buf._engram, '_device_arrays', device_arrays)
    return buf, log, arrays, (gpu, storage)


@pytest.mark.parametrize('cpu', [False, True], ids=['gpu-storage', 'host-storage'])
def test_engram_buffer_layers(cpu, monkeypatch, no_cuda):
    buf, log, arrays, (gpu, storage) = make_engram(cpu, monkeypatch)
    buf.set_config([1000, 1001], 64, 16, 3, torch.bfloat16)
    layout = buf._engram.layout
    assert layout.num_entries == (1000, 1001) and layout.table_offsets == (0, 128000)
    assert layout.out_offset == WS and layout.out_bytes == gpu
    assert layout.storage_offset == (None if cpu else WS + gpu)
    tables = [torch.zeros((1000, 64), dtype=torch.bfloat16), torch.zeros((1001, 64), dtype=torch.bfloat16)]
    buf.write(tables)
    base = 0x5000_0000 if cpu else buf.sym.base + WS + gpu
    assert [(e.args['table'], e.args['num_bytes']) for e in log] == [(base, 128000), (base + 128000, 128128)]
    assert arrays['layers'].tolist() == [[1000, 0, 0], [1001, 128000, 0]]
    assert arrays['bases'] == ([0x5000_0000, 0x6000_0000] if cpu else [base, base])
    log.clear()
    indices = torch.zeros((2, 16, 3), dtype=torch.int32)
    monkeypatch.setattr(buf._engram, '_index_range', lambda x, ptr, n, stream: lambda: (0, 2001))
    hooks = buf.fetch(indices)
    assert len(hooks) == 2 and len(log) == 1
    args = log[0].args
    assert (args['num_rows'], args['rows_per_layer'], args['num_entries_per_token'], args['row_bytes']) == \
        (96, 48, 3, 128)
    assert args['out'] == buf.sym.base + WS and args['layers'] == 0xAB00 and args['table_bases'] == 0xCD00
    assert log[0].grid == 1                                   # 96 rows x 8 vectors: one block's work
    data = [h() for h in hooks]
    assert all(d.shape == (16, 192) and d.dtype == torch.bfloat16 for d in data)
    assert data[1].data_ptr() == data[0].data_ptr() + 16 * 192 * 2
    # A repeated signature reuses its bound launch: only the indices' address changes.
    other = torch.zeros((2, 16, 3), dtype=torch.int32)
    log.clear()
    buf.fetch(other)
    assert args['indices'] == indices.data_ptr() and log[0].args['indices'] == other.data_ptr()
    assert {k: v for k, v in log[0].args.items() if k != 'indices'} == {k: v for k, v in args.items() if k != 'indices'}
    assert log[0].grid == 1
    with pytest.raises(ValueError, match='3-D'):
        buf.fetch(indices[0])
    with pytest.raises(ValueError, match='1 layers'):
        buf.fetch(indices[:1])
    with pytest.raises(ValueError, match='num_allocated_qps'):
        buf.fetch(indices, num_qps=21)
    with pytest.raises(ValueError, match='set_config gave'):
        buf.write([tables[0], tables[0]])
    monkeypatch.setattr(buf._engram, '_index_range', lambda x, ptr, n, stream: lambda: (0, 2002))
    with pytest.raises(ValueError, match=r'\[0, 2002\)'):
        buf.fetch(indices)


def test_engram_buffer_fp8_scale_factor_outputs(monkeypatch, no_cuda):
    buf, log, _, _ = make_engram(False, monkeypatch)
    buf.set_config([1000, 1001], 64, 16, 3, torch.float8_e4m3fn, 1)
    feature = buf._engram
    feature.written, feature.sf, feature.sf_dtype, feature._device = True, torch.zeros((4002, 1)), 'float32', {
        'layers': SimpleNamespace(data=SimpleNamespace(ptr=1)),
        'table_bases': SimpleNamespace(data=SimpleNamespace(ptr=2))}
    monkeypatch.setattr(interop.Allocator, 'empty', lambda self, shape, dtype, stream=None:
                        torch.zeros(shape, dtype=getattr(torch, dtype)))
    hooks = buf.fetch(torch.zeros((2, 5, 3), dtype=torch.int32), check_indices=False)
    data, sf = hooks[1]()
    assert data.shape == (5, 3 * 64) and sf.shape == (5, 3) and sf.stride() == (1, 8)       # column-major, padded
    assert (log[0].args['sf_layer_stride'], log[0].args['sf_stride_token'], log[0].args['sf_stride_col']) == (24, 1, 8)
    _, sf = buf.fetch(torch.zeros((2, 5, 3), dtype=torch.int32), use_tma_aligned_col_major_sf=False,
                      check_indices=False)[0]()
    assert sf.stride() == (3, 1) and log[1].args['sf_layer_stride'] == 15
    with pytest.raises(ValueError, match='num_sf_packs=1'):
        buf.write([torch.zeros((1000, 64), dtype=torch.float8_e4m3fn)] * 1 + [torch.zeros((1001, 64),
                  dtype=torch.float8_e4m3fn)])


def test_engram_buffer_hints_and_config():
    gpu, storage = EngramBuffer.get_storage_size_hint(None, [524288, 524309], 256, 512, 24, torch.bfloat16)
    assert (gpu, storage) == engram_plan.layered_size_hint([524288, 524309], 256, 512, 24)
    with pytest.raises(ValueError, match='get_theoretical_config'):
        EngramBuffer(None, gpu, storage, False, 0, 16)
    with pytest.raises(TypeError, match='only one of'):
        EngramBuffer(None, gpu, num_rdma_storage_bytes=1, num_rdma_storage_size=1)
