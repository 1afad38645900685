"""DeepEP V1 `Buffer` / `Config` without a GPU:
- `Config`: defaults, V1's checks, the tables (plus the rank counts this library adds), the size hints;
- the pure sizing of normal mode (`fit_tokens`, `grown_tokens`) and the argument checks (V1's event rule, SMs);
- `get_dispatch_layout`'s plan and launch (recorded kernel);
- the normal-mode pipeline on fake engines whose EP kernels only record launches: the first dispatch lays the engine
  out, V1's handle parts reach the notify / epilogue launches, a dispatch without top-k ids routes by
  `is_token_in_rank` with the caller's per-expert counts, a rank holding too many tokens probes with 0 tokens and
  every rank grows and redoes the call, `num_worst_tokens` sizes the outputs without a host wait, cached dispatch,
  combine with V1's combined weights;
- the `Buffer` methods' checks (built without a GPU)."""

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import fakes  # noqa: E402

from deepep_cupy.features.ep import feature as ep_feature  # noqa: E402
from deepep_cupy.features.ep import kernels as ep_kernels  # noqa: E402
from deepep_cupy.features.ep.layout import EPLayout, buffer_size_hint  # noqa: E402
from deepep_cupy.runtime import interop, workspace  # noqa: E402
from deepep_cupy.runtime.event import EventHandle, EventOverlap  # noqa: E402
from deepep_cupy.v1 import buffer as legacy  # noqa: E402
from deepep_cupy.v1 import normal as legacy_normal  # noqa: E402
from deepep_cupy.v1.buffer import Buffer, Config  # noqa: E402
from deepep_cupy.v1.config import COMBINE_TABLE, DISPATCH_TABLE  # noqa: E402
from deepep_cupy.v1.kernels import layout as legacy_layout  # noqa: E402
from deepep_cupy.v1.normal import LegacyHandle, NormalEngine, NormalMode  # noqa: E402

R, H, K, E = 2, 256, 4, 16
MiB = 1 << 20


# ---- Config ----------------------------------------------------------------------------------------------------------
def test_config_defaults_and_checks():
    c = Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 258)
    c = Config(24, 8, 256)                       # DeepEP's test: three positional arguments
    assert c.num_sms == 24 and c.num_max_nvl_chunked_send_tokens == 8 and c.num_channels == 12
    assert Config(np.int64(24), np.int32(4), 256).num_sms == 24
    for args in ((24, 256, 256), (24, 8, 256, 200, 150), (0, 1, 2)):
        with pytest.raises(ValueError):
            Config(*args)
    for args in ((24.0, 8, 256), (True, 8, 256)):
        with pytest.raises(TypeError):
            Config(*args)
    assert 'num_sms=24' in repr(Config(24, 8, 256))


def test_config_tables():
    for n, row in DISPATCH_TABLE.items():
        c = Buffer.get_dispatch_config(n)
        assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
                c.num_max_rdma_chunked_send_tokens) == (Buffer.num_sms, *row[:3])
    for n, row in COMBINE_TABLE.items():
        assert Buffer.get_combine_config(n).num_max_nvl_chunked_send_tokens == row[0]
    assert DISPATCH_TABLE[2] == (24, 256, 6, 128) and COMBINE_TABLE[8] == (4, 256, 6, 128)
    assert DISPATCH_TABLE[160] == (28, 720, 12, 128) and COMBINE_TABLE[144] == (2, 720, 8, 128)
    # Rank counts DeepEP's intranode kernels lack but this library runs: the next DeepEP size's row.
    assert Buffer.get_dispatch_config(1).num_max_nvl_chunked_send_tokens == 24
    assert Buffer.get_combine_config(6).num_max_nvl_chunked_send_tokens == 4
    for n in (9, 12, 0):
        with pytest.raises(ValueError):
            Buffer.get_dispatch_config(n)
    old = Buffer.num_sms
    try:
        Buffer.set_num_sms(24)
        assert Buffer.num_sms == 24 and Buffer.get_combine_config(8).num_sms == 24
        with pytest.raises(ValueError):
            Buffer.set_num_sms(23)
    finally:
        Buffer.num_sms = old


def test_config_size_hints():
    c = Config(24, 8, 256)
    hint = c.get_nvl_buffer_size_hint(7168 * 2, 8)
    assert hint == buffer_size_hint(8, 12 * 256, 7168, 0) and hint % (2 * MiB) == 0
    # A buffer of the hint's size holds the hinted tokens for any top-k up to 32.
    assert legacy_normal.fit_tokens(8, hint, 7168, 32) >= 12 * 256
    assert c.get_nvl_buffer_size_hint(7168 * 2, 2) < hint
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert c.get_rdma_buffer_size_hint(7168 * 2, 16) % 128 == 0 and c.get_rdma_buffer_size_hint(7168 * 2, 16) > 0
    with pytest.raises(ValueError):
        c.get_nvl_buffer_size_hint(0, 8)


# ---- pure sizing and checks ---------------------------------------------------------------------------------------
def test_fit_and_grow():
    for num_bytes in (2 * MiB, 64 * MiB, 2 * 10**9):
        m = legacy_normal.fit_tokens(8, num_bytes, 7168, 8)
        assert m % legacy_normal.TOKEN_ALIGNMENT == 0
        if m:
            assert EPLayout(8, m, 7168, 8, True, 0).end_offset <= num_bytes
        assert EPLayout(8, m + legacy_normal.TOKEN_ALIGNMENT, 7168, 8, True, 0).end_offset > num_bytes
    assert legacy_normal.fit_tokens(8, 2 * 10**9, 7168, 8) >= 4096          # DeepEP's test: 2e9 bytes, 4096 tokens
    assert legacy_normal.fit_tokens(8, 1 << 40, 128, 1) == legacy_normal.max_tokens(8)
    assert legacy_normal.grown_tokens(1, 8) == legacy_normal.DEFAULT_TOKENS
    assert legacy_normal.grown_tokens(5000, 8) == 6400 and legacy_normal.grown_tokens(5121, 8) == 6400 + 256
    with pytest.raises(ValueError):
        legacy_normal.grown_tokens(legacy_normal.max_tokens(8) + 1, 8)
    assert legacy_normal.max_tokens(8) * 8 // ep_kernels.COMBINE_CHUNK_ROWS * 4 <= ep_kernels.COMBINE_CHUNK_SIGNAL_BYTES


def test_event_rule_and_sms():
    legacy_normal.check_event_rule(None, False, False)
    legacy_normal.check_event_rule(object(), False, False)       # vLLM's dual-batch overlap: previous_event alone
    legacy_normal.check_event_rule(object(), True, True)
    for prev, async_finish in ((None, True), (object(), False), (None, False)):
        with pytest.raises(ValueError, match='allocate_on_comm_stream'):
            legacy_normal.check_event_rule(prev, async_finish, True)
    assert legacy_normal.check_num_sms(Config(24, 8, 256)) == 24
    with pytest.raises(ValueError):
        legacy_normal.check_num_sms(Config(23, 8, 256))


def test_host_counts_have_room_for_the_max_word():
    assert 4 * (ep_kernels.HOST_MAX_TOKENS_WORD + 1) <= workspace.HOST_EP_COUNTS.num_bytes


# ---- get_dispatch_layout ------------------------------------------------------------------------------------------
def test_layout_plan():
    idx = torch.zeros(10, K, dtype=torch.int64)
    p = legacy_layout.plan_layout(idx, E, R, -1)
    assert (p.num_tokens, p.num_topk, p.grid, p.smem_bytes) == (10, K, 1, 4 * (E + R))
    assert legacy_layout.plan_layout(torch.zeros(0, K, dtype=torch.int64), E, R, -1).grid == 1
    assert legacy_layout.plan_layout(torch.zeros(1000, K, dtype=torch.int64), E, R, -1).grid == 4
    cases = [(idx.int(), E, TypeError), (idx[0], E, ValueError), (idx[:, ::2], E, ValueError), (idx, E + 1, ValueError),
             (idx, 0, ValueError), (idx, 10**6, ValueError)]
    for t, e, exc in cases:
        with pytest.raises(exc):
            legacy_layout.plan_layout(t, e, R, -1)
    with pytest.raises(ValueError):
        legacy_layout.plan_layout(idx, 130, 65, -1)


# ---- normal mode on fake engines ----------------------------------------------------------------------------------
class RecordingKernels:
    def __init__(self, num_ranks, bucket, log):
        self.notify = fakes.RecordingKernel(ep_kernels.notify_spec(num_ranks, bucket), log)
        self.topk_range = None
        self.dispatch = fakes.RecordingKernel(ep_kernels.dispatch_spec(num_ranks, bucket), log)
        self.combine = {lr: fakes.RecordingKernel(ep_kernels.combine_spec(num_ranks, bucket, lr), log)
                        for lr in (True, False)}


class World:
    """Recorded launches, engines made, and what the host counts report (`max`: the largest token count)."""

    def __init__(self, monkeypatch):
        self.log, self.made, self.barriers = [], [], []
        self.max = None
        world = self
        monkeypatch.setattr(ep_feature, 'EPKernels',
                            lambda num_ranks, bucket: RecordingKernels(num_ranks, bucket, world.log))
        current = fakes.FakeStream('current')
        monkeypatch.setattr(interop, 'current_stream', lambda like=None: current)
        monkeypatch.setattr(interop, 'stream_getter', lambda kind, device: lambda: current)
        monkeypatch.setattr(interop.Allocator, 'empty',
                            lambda self, shape, dtype, stream=None: torch.zeros(shape, dtype=getattr(torch, dtype)))
        monkeypatch.setattr(legacy_layout, '_memset_async', lambda ptr, n, stream: world.log.append('memset'))

        def wait(ep, seq, num_local_experts):
            ep.host_counts[ep_kernels.HOST_MAX_TOKENS_WORD] = world.max if world.max is not None else 0
            return R * ep.settings.num_max_tokens_per_rank, 0, [1] * num_local_experts
        monkeypatch.setattr(ep_feature.EP, '_wait_host_counts', wait)
        monkeypatch.setattr(ep_feature.EP, '_start_range',
                            lambda ep, ti, ptr, n, k, stream: (lambda: (int(ti.min()), int(ti.max())) if n
                                                               else (0, 0)))

    def make_engine(self, num_bytes):
        eng = NormalEngine.__new__(NormalEngine)
        eng.__dict__.update(fakes.make_buffer(R, 0, num_bytes).__dict__)
        eng.__dict__.update(_nvlink_gbs=450.0, ep=None, geometry=(0, 0, 0))
        eng.barrier = lambda **kw: self.barriers.append(num_bytes)
        self.made.append(eng)
        return eng

    def names(self):
        out = [e.name.split('<')[0].split('::')[-1] for e in self.log if not isinstance(e, str)]
        self.log.clear()
        return out

    def launch(self, name):
        return [e for e in self.log if not isinstance(e, str) and name in e.name][-1]


def make_buffer(world, num_nvl_bytes=2 * MiB):
    """A `Buffer` without a GPU: the real normal mode on fake engines, the real layout launcher on a recording
    kernel."""
    buf = Buffer.__new__(Buffer)
    buf.__dict__.update(
        _destroyed=False, group=None, rank=0, group_size=R, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=0,
        low_latency_mode=False, explicitly_destroy=True, enable_shrink=False, device=-1, _stream=None,
        _order=fakes.stream_order(fakes.FakeStream('comm')), _configs={}, _ll=None,
        _layout=legacy_layout.DispatchLayout(-1, kernel=fakes.RecordingKernel(legacy_layout.LAYOUT_SPEC, world.log)),
        _normal=NormalMode(R, -1, num_nvl_bytes, world.make_engine))
    return buf


def fake_event() -> EventOverlap:
    """What `Buffer.capture()` returns, without CUDA."""
    ev = EventHandle.__new__(EventHandle)
    ev.stream, ev.event = None, fakes.FakeEvent()
    return EventOverlap(ev)


def ptr(value) -> int:
    """A recorded pointer argument (an int, or the tensor passed)."""
    return value if isinstance(value, int) else value.data_ptr()


@pytest.fixture()
def inputs():
    g = torch.Generator().manual_seed(0)
    N = 300
    x = torch.randn(N, H, generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand(N, E, generator=g), K).indices
    idx[::7, 1] = -1
    w = torch.rand(N, K, generator=g)
    owner = torch.where(idx >= 0, idx // (E // R), -1)
    in_rank = torch.stack([(owner == r).any(1) for r in range(R)], 1)
    per_expert = torch.stack([(idx == e).sum() for e in range(E)]).int()
    per_rank = in_rank.sum(0).int()
    return x, idx, w, in_rank, per_expert, per_rank


def test_get_dispatch_layout_launch(monkeypatch, inputs):
    world = World(monkeypatch)
    buf = make_buffer(world)
    _, idx, *_ = inputs
    per_rank, rdma, per_expert, in_rank, event = buf.get_dispatch_layout(idx, E)
    assert rdma is None and event.event is None
    assert per_rank.shape == (R,) and per_expert.shape == (E,) and in_rank.shape == (300, R)
    assert per_rank.dtype == per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
    assert world.log[0] == 'memset'
    launch = world.launch('get_dispatch_layout')
    assert launch.grid == 2 and launch.shared_mem == 4 * (E + R) and launch.args['num_ranks'] == R
    assert ptr(launch.args['num_tokens_per_expert']) == ptr(launch.args['num_tokens_per_rank']) + 4 * R
    with pytest.raises(ValueError, match='allocate_on_comm_stream'):
        buf.get_dispatch_layout(idx, E, allocate_on_comm_stream=True)


def _layout_args(inputs):
    _, idx, w, in_rank, per_expert, per_rank = inputs
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def test_dispatch_lays_out_and_fills_the_handle(monkeypatch, inputs):
    world = World(monkeypatch)
    buf = make_buffer(world)
    x, idx, w, in_rank, *_ = inputs
    assert len(world.made) == 1 and world.made[0].ep is None          # memory at construction, layout at dispatch
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                                   config=Config(24, 8, 256), **_layout_args(inputs))
    dispatch = 'dispatch_impl_with_dispatch_copy_epilogue_impl'
    assert world.names() == ['notify_dispatch', dispatch, dispatch]       # CPU sync: send, then receive
    eng = world.made[0]
    M = eng.geometry[0]
    assert eng.geometry == (legacy_normal.fit_tokens(R, 2 * MiB, H, K), H, K) and M >= 300
    assert isinstance(handle, LegacyHandle) and len(handle) == 6
    rpm, cpm, rcpm, src_idx, itr, send_head = handle
    assert rpm.shape == (R, R) and cpm.shape == (R, 12) and rcpm.shape == (R, 12)
    assert src_idx.shape == (R * M,) and src_idx.dtype == torch.int32 and itr is in_rank
    assert send_head.shape == (300, R) and send_head.dtype == torch.int32
    assert recv_x.shape == (R * M, H) and recv_idx.shape == (R * M, K) and counts == [1] * (E // R)
    assert handle.with_topk and handle.engine is eng and event.event is None


def test_dispatch_launch_arguments(monkeypatch, inputs):
    world = World(monkeypatch)
    buf = make_buffer(world)
    x, idx, w, *_ = inputs
    _, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, config=Config(24, 8, 256),
                                         **_layout_args(inputs))
    notify, recv = world.launch('notify_dispatch'), world.launch('dispatch_copy_epilogue_impl')
    assert notify.args['num_channels'] == 12 and notify.args['reported_num_tokens'] == 300
    assert ptr(notify.args['rank_prefix_matrix']) == handle[0].data_ptr()
    assert ptr(notify.args['channel_prefix_matrix']) == handle[1].data_ptr()
    assert ptr(notify.args['recv_channel_prefix_matrix']) == handle[2].data_ptr()
    assert notify.args['expert_counts'] == 0 and notify.args['host_counts'] != 0
    assert ptr(recv.args['recv_src_idx']) == handle[3].data_ptr()
    send = [e for e in world.log if not isinstance(e, str) and e.name == recv.name][-2]
    assert send.args['phases'] == ep_kernels.PHASE_SEND and send.grid == 24


def test_dispatch_without_topk_routes_by_is_token_in_rank(monkeypatch, inputs):
    world = World(monkeypatch)
    buf = make_buffer(world)
    x, _, _, in_rank, per_expert, _ = inputs
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(x, **_layout_args(inputs))
    assert recv_idx is None and recv_w is None and not handle.with_topk
    notify = world.launch('notify_dispatch')
    assert ptr(notify.args['expert_counts']) == per_expert.data_ptr() and notify.args['num_topk'] == R
    synthetic = buf._normal.synthetic_topk(in_rank, E)
    want = torch.where(in_rank, torch.arange(R) * (E // R), -1)
    assert torch.equal(synthetic, want)
    with pytest.raises(ValueError, match='no top-k'):
        buf.combine(recv_x, handle, topk_weights=torch.zeros(recv_x.shape[0], R))


def _fixed(entry):
    """A recorded launch without the arguments that hold addresses or the CPU-sync sequence number."""
    skip = {'topk_idx', 'send_pos', 'send_expert_pos', 'recv_layout', 'psum_recv_per_expert', 'cumulative_stats',
            'topk_copy', 'token_of_slot', 'send_count', 'host_seq', 'x', 'sf', 'topk_weights', 'recv_x', 'recv_sf',
            'recv_topk_idx', 'recv_topk_weights', 'recv_src_metadata', 'recv_src_idx', 'expert_counts',
            'rank_prefix_matrix', 'channel_prefix_matrix', 'recv_channel_prefix_matrix'}
    return entry.name, entry.grid, {k: v for k, v in entry.args.items() if k not in skip}


def test_v1_calls_are_bound_per_signature(monkeypatch, inputs):
    """A V1 dispatch's LegacyLayout is part of the call signature (channels, reported count, the expert counts'
    signature): a repeated call launches what the first did, with this call's matrices, recv_src_idx and expert
    counts patched in; the bound call keeps no caller array; V2 calls of the same shapes are bound apart."""
    import gc
    import weakref
    world = World(monkeypatch)
    buf = make_buffer(world)
    x, idx, w, in_rank, per_expert, per_rank = inputs
    outs, launches = [], []
    for _ in range(3):
        world.log.clear()
        outs.append(buf.dispatch(x, topk_idx=idx, topk_weights=w, config=Config(24, 8, 256), **_layout_args(inputs)))
        launches.append([_fixed(e) for e in world.log if not isinstance(e, str)])
    ep = world.made[0].ep
    assert launches[0] == launches[1] == launches[2] and len(ep._bound) == 1
    notify, recv = world.launch('notify_dispatch'), world.launch('dispatch_copy_epilogue_impl')
    h1, h2 = outs[1][4], outs[2][4]
    assert h1[0].data_ptr() != h2[0].data_ptr() and h1[3].data_ptr() != h2[3].data_ptr()
    assert ptr(notify.args['rank_prefix_matrix']) == h2[0].data_ptr()
    assert ptr(notify.args['channel_prefix_matrix']) == h2[1].data_ptr()
    assert ptr(notify.args['recv_channel_prefix_matrix']) == h2[2].data_ptr()
    assert ptr(recv.args['recv_src_idx']) == h2[3].data_ptr()
    # The matrices live after the handle's workspace; recv_src_idx after the metadata: no overlaps.
    ws = h2.ep_handle.workspace
    assert h2[0].data_ptr() >= ws.data_ptr() + 4 * h2.ep_handle.offsets[-1]
    assert h2[2].data_ptr() + 4 * h2[2].numel() <= ws.data_ptr() + 4 * ws.numel()
    meta = h2.ep_handle.recv_src_metadata
    assert h2[3].data_ptr() >= meta.data_ptr() + 4 * meta.numel()
    b = next(iter(ep._bound.values()))
    assert b.p.legacy is None and b.v1_channels == 12
    # Without top-k: the expert counts are a signature of their own, patched per call, not kept.
    counts = per_expert.clone()
    ref = weakref.ref(counts)
    buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_rank=per_rank, num_tokens_per_expert=counts)
    assert ptr(world.launch('notify_dispatch').args['expert_counts']) == counts.data_ptr() and len(ep._bound) == 2
    del counts
    gc.collect()
    assert ref() is None
    # The same shapes through V2 (no LegacyLayout): another signature, no V1 outputs.
    world.log.clear()
    ep.dispatch(x, idx, w, num_experts=E)
    assert len(ep._bound) == 3
    notify = world.launch('notify_dispatch')
    assert notify.args['num_channels'] == 0 and notify.args['rank_prefix_matrix'] == 0
    assert world.launch('dispatch_copy_epilogue_impl').args['recv_src_idx'] == 0
    # Another reported count (a probe) or another channel count: checked afresh.
    with pytest.raises(ValueError, match='reported_num_tokens'):
        ep.dispatch(x, idx, w, num_experts=E, legacy=legacy_normal.LegacyLayout(12, 299))
    with pytest.raises(TypeError, match='LegacyLayout'):
        ep.dispatch(x, idx, w, num_experts=E, legacy=object())
    with pytest.raises(ValueError, match='channels'):
        ep.dispatch(x, idx, w, num_experts=E, legacy=legacy_normal.LegacyLayout(10 ** 3, 300))


def test_too_many_tokens_probe_grow_and_redo(monkeypatch, inputs):
    world = World(monkeypatch)
    buf = make_buffer(world)
    x, idx, w, in_rank, per_expert, per_rank = inputs
    M0 = legacy_normal.fit_tokens(R, 2 * MiB, H, K)
    n = M0 + 100
    big = dict(x=x.repeat(n // 300 + 1, 1)[:n], topk_idx=idx.repeat(n // 300 + 1, 1)[:n].contiguous(),
               topk_weights=w.repeat(n // 300 + 1, 1)[:n].contiguous(),
               is_token_in_rank=in_rank.repeat(n // 300 + 1, 1)[:n], num_tokens_per_rank=per_rank,
               num_tokens_per_expert=per_expert)
    world.max = n
    out = buf.dispatch(**big)
    notifies = [e for e in world.log if not isinstance(e, str) and 'notify' in e.name]
    assert notifies[0].args['num_tokens'] == 0 and notifies[0].args['reported_num_tokens'] == n   # the probe
    assert notifies[1].args['num_tokens'] == n
    assert len(world.made) == 2 and world.barriers == [2 * MiB]           # old engine quiesced, then replaced
    grown = world.made[1]
    assert grown.geometry[0] >= legacy_normal.grown_tokens(n, R) and out[4].engine is grown
    assert grown.num_bytes == legacy_normal.needed_bytes(R, legacy_normal.grown_tokens(n, R), H, K)
    # A peer holding more than M: this rank dispatched its tokens, then everyone grows and redoes.
    world.log.clear()
    world.max = grown.geometry[0] + 1
    buf.dispatch(x, topk_idx=idx, topk_weights=w, **_layout_args(inputs))
    notifies = [e for e in world.log if not isinstance(e, str) and 'notify' in e.name]
    assert [e.args['num_tokens'] for e in notifies] == [300, 300] and len(world.made) == 3
    assert buf._normal.num_growths == 2


def test_num_worst_tokens(monkeypatch, inputs):
    world = World(monkeypatch)
    buf = make_buffer(world)
    x, idx, w, *_ = inputs
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=777,
                                                               **_layout_args(inputs))
    assert recv_x.shape[0] == recv_idx.shape[0] == recv_w.shape[0] == handle[3].shape[0] == 777 and counts == []
    notify, recv = world.launch('notify_dispatch'), world.launch('dispatch_copy_epilogue_impl')
    assert notify.args['host_counts'] == 0
    assert recv.args['num_meta_rows'] == 777 and handle.ep_handle.num_rows == 777
    with pytest.raises(ValueError, match='needs topk_idx'):
        buf.dispatch(x, num_worst_tokens=10, **_layout_args(inputs))
    # More tokens than slots without a CPU sync: probe (peers do not hang), then a clear error.
    M = world.made[0].geometry[0]
    n = M + 1
    world.log.clear()
    with pytest.raises(ValueError, match='warm it up'):
        buf.dispatch(x.repeat(n // 300 + 1, 1)[:n], topk_idx=idx.repeat(n // 300 + 1, 1)[:n].contiguous(),
                     num_worst_tokens=10, num_tokens_per_rank=inputs[5], num_tokens_per_expert=inputs[4],
                     is_token_in_rank=inputs[3].repeat(n // 300 + 1, 1)[:n])
    assert world.launch('notify_dispatch').args['num_tokens'] == 0


def test_cached_dispatch_and_combine(monkeypatch, inputs):
    world = World(monkeypatch)
    buf = make_buffer(world)
    x, idx, w, *_ = inputs
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **_layout_args(inputs))
    world.log.clear()
    out = buf.dispatch(x, handle=handle, config=Config(24, 8, 256))
    assert out[1:5] == (None, None, None, None) and out[0].shape == recv_x.shape
    assert world.names() == ['dispatch_impl_with_dispatch_copy_epilogue_impl']      # one launch: send and receive
    with pytest.raises(ValueError, match='cached'):
        buf.dispatch(x, handle=handle, topk_idx=idx)
    combined, combined_w, event = buf.combine(recv_x, handle, topk_weights=recv_w, bias=(x, x))
    assert combined.shape == (300, H) and combined_w.shape == (300, K)
    launch = world.launch('combine_impl')
    # config.num_sms SMs send (DeepEP's meaning); the reducers take the SMs left.
    assert launch.args['weights_over_ranks'] == 1 and launch.args['num_send_blocks'] == Buffer.num_sms
    assert launch.grid > Buffer.num_sms
    # previous_event alone is legal (vLLM's dual-batch overlap), V2's rule does not apply.
    buf.combine(recv_x, handle, previous_event=fake_event())
    buf.dispatch(x, topk_idx=idx, topk_weights=w, previous_event=fake_event(), **_layout_args(inputs))
    with pytest.raises(TypeError):
        buf.combine(recv_x, tuple(handle))


def test_default_config_sm_counts_follow_buffer_num_sms(monkeypatch, inputs):
    """Without a config, dispatch and combine take `Buffer.num_sms` (the default config's, checked once per value by
    `Buffer._config` and then compared inline): a new value is checked and used by the next call; a config's SM
    count is checked per call (the Config may change between calls)."""
    world = World(monkeypatch)
    buf = make_buffer(world)
    x, idx, w, *_ = inputs
    for num_sms in (24, 20, 24):
        monkeypatch.setattr(Buffer, 'num_sms', num_sms)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **_layout_args(inputs))
        assert handle.ep_handle.num_sms == num_sms and buf._dispatch_sms == num_sms
        buf.combine(recv_x, handle, topk_weights=recv_w)
        assert world.launch('combine_impl').args['num_send_blocks'] == num_sms and buf._combine_sms == num_sms
        cached = buf.dispatch(x, handle=handle)
        assert cached[0].shape == recv_x.shape
    monkeypatch.setattr(Buffer, 'num_sms', 5)       # (assigned, not through set_num_sms: checked at the next call)
    with pytest.raises(ValueError, match='even'):
        buf.dispatch(x, topk_idx=idx, topk_weights=w, **_layout_args(inputs))
    with pytest.raises(ValueError, match='even'):
        buf.combine(recv_x, handle, topk_weights=recv_w)
    config = Config(24, 8, 256)
    buf.combine(recv_x, handle, topk_weights=recv_w, config=config)
    config.num_sms = 7
    with pytest.raises(ValueError, match='even'):
        buf.combine(recv_x, handle, topk_weights=recv_w, config=config)
    config.num_sms = 24.0
    with pytest.raises((TypeError, ValueError)):
        buf.dispatch(x, handle=handle, config=config)


def test_larger_topk_lays_out_again_on_the_same_memory(monkeypatch, inputs):
    world = World(monkeypatch)
    buf = make_buffer(world, num_nvl_bytes=64 * MiB)
    x, idx, w, *_ = inputs
    buf.dispatch(x, topk_idx=idx, topk_weights=w, **_layout_args(inputs))
    first = world.made[0].ep
    idx8 = torch.cat([idx, idx], 1)
    buf.dispatch(x, topk_idx=idx8, topk_weights=torch.cat([w, w], 1), **_layout_args(inputs))
    assert len(world.made) == 1 and world.made[0].ep is not first and world.made[0].geometry[2] == 2 * K


def test_buffer_checks(monkeypatch, inputs):
    world = World(monkeypatch)
    buf = make_buffer(world)
    x, idx, w, in_rank, per_expert, per_rank = inputs
    with pytest.raises(ValueError, match='is_token_in_rank'):
        buf.dispatch(x, topk_idx=idx, num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert)
    with pytest.raises(ValueError, match='topk_weights needs'):
        buf.dispatch(x, topk_weights=w, **_layout_args(inputs))
    with pytest.raises(ValueError, match='allocate_on_comm_stream'):
        buf.dispatch(x, topk_idx=idx, allocate_on_comm_stream=True, **_layout_args(inputs))
    with pytest.raises(ValueError, match='even'):
        buf.dispatch(x, topk_idx=idx, config=Config(5, 4, 256), **_layout_args(inputs))
    with pytest.raises(NotImplementedError, match='internode'):
        buf.internode_dispatch(x)
    with pytest.raises(NotImplementedError, match='internode'):
        buf.internode_combine(x, None)
    with pytest.raises(RuntimeError, match='low_latency_mode'):
        buf.low_latency_dispatch(x, idx, 128, E)
    assert Buffer.is_sm90_compiled() is True
    buf.explicitly_destroy = False
    with pytest.raises(RuntimeError, match='explicitly_destroy'):
        buf.destroy()
    buf.explicitly_destroy = True
    buf._normal.destroy = lambda: None
    buf.destroy()
    with pytest.raises(RuntimeError, match='destroyed'):
        buf.dispatch(x, topk_idx=idx, **_layout_args(inputs))
    assert legacy.Buffer is Buffer
    buf2 = make_buffer(World(monkeypatch))        # (the scalars' checks where the fast check lets them through)
    with pytest.raises(TypeError, match='expert_alignment'):
        buf2.dispatch(x, topk_idx=idx, expert_alignment=True, **_layout_args(inputs))
    with pytest.raises(ValueError, match='num_worst_tokens'):
        buf2.dispatch(x, topk_idx=idx, num_worst_tokens=-1, **_layout_args(inputs))


def _relative(value, bases):
    """A recorded argument or a tensor's address made (name, offset) inside one of `bases` ((name, address,
    bytes)); other addresses 'elsewhere'."""
    if type(value) is not int:
        return value
    for name, base, size in bases:
        if base <= value < base + size:
            return name, value - base
    return 'elsewhere' if value > 1 << 40 else value


def _describe(t, bases):
    if t is None or not isinstance(t, torch.Tensor):
        return t
    return tuple(t.shape), t.stride(), t.dtype, _relative(t.data_ptr(), bases)


@pytest.mark.parametrize('case', ['cpu-sync', 'cpu-sync fp8', 'no top-k', 'worst', 'worst fp8', 'worst no weights',
                                  'cpu-sync async', 'no top-k async', 'worst async', 'cpu-sync one-rank',
                                  'worst fp8 large', 'cpu-sync large'])
def test_v1_lean_paths_match_the_general_call(monkeypatch, inputs, case):
    """A V1 dispatch's lean paths (features/ep/lean.py `run_no_sync_v1` with `num_worst_tokens`, `run_cpu_sync_v1`
    otherwise; an asynchronous call with expert counts keeps the general call, whose event holds them) launch what the
    general `BoundDispatch.__call__` launches (every argument, V1's matrices' pointers included; addresses relative to
    the handle's workspace and the outputs' allocation) and return the same outputs and V1 handle (shapes, strides,
    dtypes, places; send_head is the EP handle's dst_buffer_slot_idx), the same growth count; 'large': recv_x (and
    recv_sf) too large to carve out of the small outputs' allocation. The adapter's per-signature entries
    (`NormalMode.lean_dispatch`: a repeated call with top-k ids runs its bound dispatch without `EP.dispatch`) give
    what its checked path (through `EP.dispatch`) gives."""
    from deepep_cupy.features.ep import bound as ep_bound
    from deepep_cupy.features.ep import lean as ep_lean
    from deepep_cupy.runtime import streams
    if case.endswith('large'):
        monkeypatch.setattr(ep_bound, 'CARVED_RECV_MAX_BYTES', 0)
    if case.endswith('async'):      # (no CUDA here: the event is the tensors it would hold)
        monkeypatch.setattr(streams.StreamOrder, 'event', lambda self, kind, record=(), keep=(): keep)
    world = World(monkeypatch)
    buf = make_buffer(world)
    x, idx, w, in_rank, per_expert, per_rank = inputs
    x8 = (x.to(torch.float8_e4m3fn), torch.ones(x.shape[0], H // 128))
    xin = x8 if 'fp8' in case else x
    kw = dict(config=Config(24, 8, 256), async_finish=case.endswith('async'), **_layout_args(inputs))
    if 'no top-k' not in case:
        kw.update(topk_idx=idx, topk_weights=None if 'no weights' in case else w)
    if case.startswith('worst'):
        kw['num_worst_tokens'] = 777
    if case.endswith('one-rank'):
        kw['config'] = Config(2, 8, 256)
    for _ in range(2):              # binds (the second call: the adapter's entry, once torch tensors were seen)
        buf.dispatch(xin, **kw)
    ep = world.made[-1].ep
    (b,) = [v for v in ep._bound.values() if v.v1_channels is not None]
    lean = (b.run_v1 is not ep_bound.BoundDispatch.__call__)
    assert lean == (case != 'no top-k async')
    if lean:
        assert b.run_v1 is (ep_lean.run_no_sync_v1 if case.startswith('worst') else ep_lean.run_cpu_sync_v1)
    lean_dispatch, ep_calls = NormalMode.lean_dispatch, []
    real_ep_dispatch = ep_feature.EP.dispatch
    monkeypatch.setattr(ep_feature.EP, 'dispatch', lambda *a, **k: ep_calls.append(1) or real_ep_dispatch(*a, **k))
    runs = []
    for mode in ('lean', 'checked', 'general'):
        # (checked: `Buffer.dispatch` without the adapter's entries; general: the entries, `BoundDispatch.__call__`)
        monkeypatch.setattr(NormalMode, 'lean_dispatch', (lambda self, *a: None) if mode == 'checked' else
                            lean_dispatch)
        if mode == 'general':
            b.run_v1 = ep_bound.BoundDispatch.__call__
        runs.append([])
        ep_calls.clear()
        for _ in range(3):          # (CPU-sync: the second and third speculate on the sizes)
            world.log.clear()
            out = buf.dispatch(xin, **kw)
            handle = out[4]
            eh = handle.ep_handle
            group = eh._meta_of[0]
            bases = [('ws', eh.workspace.data_ptr(), eh.workspace.untyped_storage().nbytes()),
                     ('out', group.data_ptr(), group.untyped_storage().nbytes())]
            xs = out[0] if type(out[0]) is tuple else (out[0],)
            bases += [(f'own{k}', t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                      for k, t in enumerate(xs) if t.untyped_storage().data_ptr() != group.untyped_storage().data_ptr()]
            assert case.endswith('large') == (len(bases) > 2)
            launches = [(e.name, e.grid, {k: _relative(v, bases) for k, v in e.args.items() if k != 'host_seq'})
                        for e in world.log if not isinstance(e, str)]
            event = out[5] if type(out[5]) is tuple else None
            runs[-1].append((launches, [_describe(t, bases) for t in xs + out[1:3]], out[3],
                             [_describe(t, bases) for t in handle], handle[5] is eh.dst_buffer_slot_idx,
                             handle[4] is in_rank, eh.num_recv_tokens, eh.num_expanded_tokens,
                             None if event is None else [_describe(t, bases) for t in event if t is not None]))
        assert buf._normal.num_growths == 0
        # (the entries serve every call with top-k ids: EP.dispatch only when the adapter's checked path runs)
        assert len(ep_calls) == (3 if mode == 'checked' or 'no top-k' in case else 0)
    assert runs[0] == runs[1] == runs[2]
    assert all(r[4] and r[5] for r in runs[0])
    assert len(buf._normal._lean) == (0 if 'no top-k' in case else 1)
    assert runs[0][0][0][0][2]['rank_prefix_matrix'][0] == 'ws'


def test_v1_signature_entries_check_per_call_grow_and_go(monkeypatch, inputs):
    """A remembered V1 dispatch signature (`NormalMode.lean_dispatch`'s entry) still raises, naming the argument and
    before any kernel, on what is per call (layout tensors missing, a scalar of another type, the previous event's
    type, x's alignment, the top-k range); grows and redoes the call when a peer holds more tokens than M (the next
    call has an entry on the grown engine); and its entry goes when the EP component forgets its bound calls."""
    world = World(monkeypatch)
    buf = make_buffer(world)
    x, idx, w, in_rank, per_expert, per_rank = inputs
    kw = dict(topk_idx=idx, topk_weights=w, **_layout_args(inputs))
    for _ in range(2):
        buf.dispatch(x, **kw)
        buf.dispatch(x, previous_event=fake_event(), **kw)
    normal = buf._normal
    assert len(normal._lean) == 2
    world.log.clear()
    shifted = torch.empty(x.numel() + 8, dtype=x.dtype)[1:1 + x.numel()].view(x.shape)     # 2 bytes off
    shifted.copy_(x)
    bad_idx = idx.clone()
    bad_idx[3, 0] = E
    for exc, match, args in [
            (ValueError, 'is_token_in_rank is required', dict(kw, is_token_in_rank=None)),
            (ValueError, 'num_tokens_per_expert is required', dict(kw, num_tokens_per_expert=None)),
            (TypeError, 'expert_alignment', dict(kw, expert_alignment=True)),
            (TypeError, 'expert_alignment', dict(kw, expert_alignment=[1])),
            (TypeError, 'num_worst_tokens', dict(kw, num_worst_tokens=2.0)),
            (TypeError, 'previous_event', dict(kw, previous_event=EventOverlap(object()))),
            (ValueError, '16-byte aligned', dict(kw, x=shifted)),
            (ValueError, 'topk_idx values', dict(kw, topk_idx=bad_idx))]:
        with pytest.raises(exc, match=match):
            buf.dispatch(args.pop('x', x), **args)
    assert not [e for e in world.log if not isinstance(e, str)], 'a kernel ran before the error'
    # A peer holding more than M: the remembered call grows and redoes on the checked path.
    M = world.made[0].geometry[0]
    world.max = M + 1
    out = buf.dispatch(x, **kw)
    world.max = None
    assert normal.num_growths == 1 and len(world.made) == 2 and out[4].engine is world.made[1]
    assert normal.tokens_seen == M + 1
    ep = world.made[1].ep
    (entry,) = normal._lean.values()
    assert entry[1] is ep and entry[2] is ep._bound and entry[0] in ep._bound.values()
    out2 = buf.dispatch(x, **kw)
    assert out2[4].engine is world.made[1] and normal.num_growths == 1
    # The EP component forgot its bound calls (`set_default_num_sms`): the entry goes, the next call binds anew.
    ep_feature.set_default_num_sms(0)
    buf.dispatch(x, **kw)
    (entry2,) = normal._lean.values()
    assert entry2[2] is ep._bound and entry2[0] is not entry[0]


# ---- low-latency mode: when the engine is laid out ------------------------------------------------------------------
class FakeLLEngine:
    made = []

    def __init__(self, base, num_max_tokens, hidden, num_experts, enable_shrink=False):
        from deepep_cupy.features.ll import LLLayout
        self.base, self.enable_shrink, self.cleaned = base, enable_shrink, 0
        self.layout = LLLayout(num_max_tokens, hidden, R, num_experts, 32)
        FakeLLEngine.made.append(self)

    def clean_buffer(self, *args):
        self.cleaned += 1

    def dispatch(self, *args, bound_only=False):
        # (bound_only: the Buffer's path for bound signatures, features/ll/bound.py; this fake binds none)
        return None if bound_only else ('dispatch', self) + args

    def combine(self, *args):
        return ('combine', self) + args


def test_low_latency_engine_life(monkeypatch):
    from deepep_cupy.features.ll import get_rdma_size_hint
    from deepep_cupy.v1 import low_latency as legacy_ll
    monkeypatch.setattr(legacy_ll, 'LowLatencyEngine', FakeLLEngine)
    FakeLLEngine.made = []
    bases = []

    def make_base(num_bytes):
        b = fakes.make_buffer(R, 0, num_bytes)
        b.destroy = lambda: bases.append(('destroyed', num_bytes))
        bases.append(num_bytes)
        return b

    hint = get_rdma_size_hint(128, 1024, R, E)
    buf = Buffer.__new__(Buffer)
    buf.__dict__.update(_destroyed=False, group_size=R, device=-1,
                        _ll=legacy_ll.LowLatencyMode(R, hint, True, make_base))
    assert bases == [hint] and buf._ll.engine is None
    # Masks before any call: a placeholder engine on this rank (local), replaced by the first call without a clean.
    placeholder = buf._mask_engine('low_latency_clean_mask_buffer')
    x = torch.zeros(64, 1024, dtype=torch.bfloat16)
    out = buf.low_latency_dispatch(x, torch.zeros(64, K, dtype=torch.int64), 128, E)
    eng = out[1]
    assert eng is not placeholder and eng.cleaned == 0 and eng.layout.num_max_tokens == 128 and bases == [hint]
    assert buf.low_latency_dispatch(x, None, 64, E)[1] is eng          # smaller M: the same engine
    assert buf.low_latency_combine(x, None, None, None)[1] is eng
    # Within the maxima: the same engine; beyond them: laid out again (here on a larger memory).
    x2 = torch.zeros(64, 512, dtype=torch.bfloat16)
    again = buf.low_latency_dispatch(x2, None, 96, E)[1]
    assert again is eng
    bigger = buf.low_latency_dispatch(x, None, 256, E)[1]
    assert bigger is not eng and bigger.layout.num_max_tokens == 256
    assert bases[-2:] == [('destroyed', hint), get_rdma_size_hint(256, 1024, R, E)]
    with pytest.raises(ValueError):
        buf.low_latency_dispatch(x, None, 128, E + 1)
    with pytest.raises(NotImplementedError, match='NVFP4'):
        buf.low_latency_dispatch(x, None, 128, E, use_nvfp4=True)
    with pytest.raises(NotImplementedError, match='overlap'):
        buf.low_latency_combine(x, None, None, None, overlap=True)
    assert Buffer.get_low_latency_rdma_size_hint(128, 1024, R, E) == hint
    buf._ll.enable_shrink = False
    with pytest.raises(RuntimeError, match='enable_shrink'):
        buf.low_latency_clean_mask_buffer()
