"""EP argument checks without a GPU, on two levels:
- the pure plan (`features/ep/plan.py`): every invalid dispatch / combine raises ValueError / TypeError naming the
  argument, from the buffer's settings and CPU torch tensors alone (no buffer object at all);
- the EP feature of a buffer whose kernels only record launches: valid calls launch the pipeline (by parameter name,
  packed like real launches), invalid ones raise before any kernel and leave the buffer usable.
The GPU rank program repeats these checks on real buffers."""

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import fakes  # noqa: E402

from deepep_cupy import constants  # noqa: E402
from deepep_cupy.features.ep import feature as ep_feature  # noqa: E402
from deepep_cupy.features.ep import kernels as ep_kernels  # noqa: E402
from deepep_cupy.features.ep import layout  # noqa: E402
from deepep_cupy.features.ep import plan as ep_plan  # noqa: E402
from deepep_cupy.features.ep.handle import EPHandle, workspace_layout  # noqa: E402
from deepep_cupy.runtime import interop  # noqa: E402

R, M, H, K, E = 2, 64, 256, 4, 16
MiB = 1 << 20


def settings(num_bytes=1 << 30, owner_id=1, **kw) -> ep_plan.EPSettings:
    values = dict(device=-1, num_ranks=R, rank=0, owner_id=owner_id, num_max_tokens_per_rank=M, num_topk=K,
                  num_bytes=num_bytes, data_offset=2 * MiB, sym_num_bytes=num_bytes + 2 * MiB, num_device_sms=132,
                  allow_multiple_reduction=True, prefer_overlap_with_compute=True, nvlink_gbs=450.0)
    values.update(kw)
    return ep_plan.EPSettings(**values)


def cpu_range_of(x):
    """What the range kernel computes, on the host."""
    return lambda: (int(x.min()), int(x.max())) if x.numel() else (0, 0)


def cpu_range(ti):
    return cpu_range_of(ti.obj)


def plan(s, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None, num_experts=None,
         num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, previous_event=None,
         allocate_on_comm_stream=False, handle=None, do_handle_copy=True, do_cpu_sync=None, do_expand=False,
         do_zero_padding=False, use_tma_aligned_col_major_sf=False, lay=None):
    """`plan_dispatch` with `ElasticBuffer.dispatch`'s keywords."""
    return ep_plan.plan_dispatch(s, lay, x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                                 num_max_tokens_per_rank, expert_alignment, num_sms, previous_event,
                                 allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync, do_expand,
                                 do_zero_padding, use_tma_aligned_col_major_sf, cpu_range)


def make_inputs():
    """x `[M, H]` bfloat16, top-K expert ids of E and their weights (seed 0): also test_ep_bound / _fused's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand(M, E, generator=g), K).indices
    w = torch.rand(M, K, generator=g)
    return x, idx, w


@pytest.fixture()
def inputs():
    return make_inputs()


# ---- the pure plan -----------------------------------------------------------------------------------------------
def test_dispatch_plan_sizes_a_valid_call(inputs):
    x, idx, w = inputs
    p = plan(settings(), x, idx, w, num_experts=E)
    assert (p.num_tokens, p.hidden, p.num_topk, p.num_local_experts, p.num_experts) == (M, H, K, E // R, E)
    assert p.do_cpu_sync and not p.cached and p.new_layout and p.kind == 'torch' and not p.fp8
    assert p.layout == layout.EPLayout(R, M, H, K, True, 2 * MiB)
    assert p.num_sms == ep_plan.theoretical_num_sms(R, E, K, 450.0, 132) and p.num_sms % 2 == 0
    assert p.notify_smem_bytes == ep_plan.notify_smem_bytes(E, R)
    # Worst-case sizes without a CPU sync, and the outputs they give.
    p = plan(settings(), x, idx, w, num_experts=E, do_cpu_sync=False, do_expand=True, expert_alignment=8)
    num_recv, num_expanded, aligned = ep_plan.dispatch_counts(p)
    assert num_recv == R * M and aligned == []
    assert num_expanded == ep_plan.worst_expanded_rows(R, M, K, E // R, 8) == layout.align(R * M * K + 7 * 8, 8)
    out = ep_plan.dispatch_outputs(p, num_recv, num_expanded, aligned, 132)
    assert out.num_out_rows == num_expanded and out.topk_idx_shape is None and out.topk_weights_shape == (num_expanded,)
    assert out.metadata_shape == (R * M, K + 2) and out.sf_shape is None
    fp8 = plan(settings(), (x.to(torch.float8_e4m3fn), torch.ones(M, 2)), idx, w, num_experts=E,
               use_tma_aligned_col_major_sf=True)
    out = ep_plan.dispatch_outputs(fp8, 5, 9, [5], 132)
    assert fp8.fp8 and out.sf_shape == (2, 8) and out.sf_strides == (1, 8) and out.topk_idx_shape == (5, K)


def test_sm_and_qp_policy():
    assert ep_plan.theoretical_num_sms(1, 256, 8, 450.0, 132) == 4
    sms = ep_plan.theoretical_num_sms(8, 256, 8, 450.0, 132)
    assert 4 <= sms <= 132 and sms % 2 == 0
    assert ep_plan.theoretical_num_sms(8, 256, 8, 450.0, 132, prefer_overlap_with_compute=False) >= 64
    assert ep_plan.theoretical_num_sms(8, 256, 8, 1e6, 132) == 132
    # DeepEP: 0 allocated QPs resolve to 17 (direct) / 129 (hybrid); direct min(num_sms, 9), hybrid num_sms * 16 + 1.
    assert ep_plan.resolve_num_allocated_qps(0, False) == 17 and ep_plan.resolve_num_allocated_qps(0, True) == 129
    assert ep_plan.resolve_num_allocated_qps(33, False) == 33
    assert ep_plan.theoretical_num_qps(24, False, 17) == 9 and ep_plan.theoretical_num_qps(4, False, 17) == 4
    assert ep_plan.theoretical_num_qps(4, True, 129) == 65 and ep_plan.theoretical_num_qps(24, True, 129) == 129
    assert ep_plan.theoretical_num_qps(24, False, 5) == 5


def test_combine_blocks_follow_num_sms():
    # num_sms (explicit, else the dispatch's) send; the reducers take the SMs left; one rank sends nothing.
    assert ep_plan.combine_blocks(24, 20, 8, 4096, 7168, 132) == (24, 108)
    assert ep_plan.combine_blocks(24, 20, 1, 4096, 7168, 132) == (0, 132)
    assert ep_plan.combine_blocks(1, 20, 2, 4096, 7168, 132) == (1, 131)
    assert ep_plan.combine_blocks(500, 20, 2, 4096, 7168, 132) == (131, 1)
    assert ep_plan.combine_blocks(0, 20, 8, 4096, 7168, 132) == (20, 112)
    assert ep_plan.combine_blocks(0, 20, 1, 4096, 7168, 132) == (0, 132)
    assert ep_plan.combine_blocks(0, 20, 8, 4, 7168, 132) == (20, 4)
    for args in ((24, 20, 8, 4096, 7168, 132), (3, 4, 2, 128, 2048, 132), (0, 4, 4, 128, 7168, 132)):
        send, reduce = ep_plan.combine_blocks(*args)
        assert reduce >= 1 and send + reduce <= args[-1]


def test_combine_blocks_cap_every_sm_when_asked():
    # DEEPEP_CUPY_COMBINE_CAP_ALL_SMS: num_sms (explicit, else the dispatch's) caps senders and reducers together.
    cap = dict(cap_all_sms=True)
    assert ep_plan.combine_blocks(24, 20, 8, 4096, 7168, 132, **cap) == (12, 12)
    assert ep_plan.combine_blocks(0, 20, 8, 4096, 7168, 132, **cap) == (10, 10)
    assert ep_plan.combine_blocks(4, 20, 1, 4096, 7168, 132, **cap) == (0, 4)
    assert ep_plan.combine_blocks(1, 20, 2, 4096, 7168, 132, **cap) == (1, 1)      # one of each role at least
    assert ep_plan.combine_blocks(500, 20, 2, 4096, 7168, 132, **cap) == (66, 66)
    assert ep_plan.combine_blocks(24, 20, 8, 4, 7168, 132, **cap) == (12, 4)        # no more reducers than rows need
    for n in range(2, 133):
        for ranks in (1, 2, 8):
            send, reduce = ep_plan.combine_blocks(n, 20, ranks, 4096, 7168, 132, **cap)
            assert send + reduce <= n and reduce >= 1 and (send >= 1) == (ranks > 1)


def test_topk_buckets():
    assert [constants.topk_bucket(k) for k in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 32]
    with pytest.raises(ValueError):
        constants.topk_bucket(33)
    # One set of kernels per (ranks, bucket): the shipped set covers every top-k of 1..32.
    shipped = ep_kernels.shipped_specs(8)
    names = {s.name for specs in shipped.values() for s in specs}
    for n in range(1, 9):
        for k in ep_kernels.SUPPORTED_TOPK:
            for specs in ep_kernels.specs_for(n, constants.topk_bucket(k)).values():
                assert {s.name for s in specs} <= names
    # notify, dispatch, two combines, the fused notify and dispatch per (ranks, bucket); one shared range kernel.
    assert sum(len(v) for v in shipped.values()) == 8 * 6 * 5 + 1


def invalid_cases(dispatch, combine, handle, other_handle, recv, x, idx, w):
    """Every invalid call of `dispatch` / `combine` (the buffer's methods, or the plans with the same keywords);
    `handle` comes from a dispatch of (x, idx) on the same buffer, `recv` is its output."""
    idx_strided = torch.empty((M, 2 * K), dtype=idx.dtype)[:, ::2]
    idx_strided.copy_(idx)
    return [
        ('x float32', TypeError, lambda: dispatch(x.float(), idx, w, num_experts=E)),
        ('x 1-D', ValueError, lambda: dispatch(x[0], idx, w, num_experts=E)),
        ('x strided rows', ValueError, lambda: dispatch(x[:, ::2], idx, w, num_experts=E)),
        ('x hidden not 16-byte aligned', ValueError, lambda: dispatch(x[:, :12], idx, w, num_experts=E)),
        ('x not an array', TypeError, lambda: dispatch(x.numpy().view(np.int16), idx, w, num_experts=E)),
        ('topk_idx int32', TypeError, lambda: dispatch(x, idx.int(), w, num_experts=E)),
        ('topk_idx too large', ValueError, lambda: dispatch(x, torch.full_like(idx, E), w, num_experts=E)),
        ('topk_idx below -1', ValueError, lambda: dispatch(x, torch.full_like(idx, -2), w, num_experts=E)),
        ('topk_idx non-contiguous', ValueError, lambda: dispatch(x, idx_strided, w, num_experts=E)),
        ('topk_idx wrong rows', ValueError, lambda: dispatch(x, idx[:-1], w, num_experts=E)),
        ('topk_weights shape', ValueError, lambda: dispatch(x, idx, w[:, :1], num_experts=E)),
        ('topk_weights dtype', TypeError, lambda: dispatch(x, idx, w.double(), num_experts=E)),
        ('num_tokens > num_max_tokens_per_rank', ValueError,
         lambda: dispatch(x, idx, w, num_experts=E, num_max_tokens_per_rank=M - 1)),
        ('num_experts not a multiple of ranks', ValueError, lambda: dispatch(x, idx, w, num_experts=E + 1)),
        ('num_experts missing', ValueError, lambda: dispatch(x, idx, w)),
        ('expert_alignment 0', ValueError, lambda: dispatch(x, idx, w, num_experts=E, expert_alignment=0)),
        ('do_zero_padding without do_expand', ValueError,
         lambda: dispatch(x, idx, w, num_experts=E, do_zero_padding=True)),
        ('sf rows', ValueError, lambda: dispatch((x.to(torch.float8_e4m3fn), torch.ones(1, 2)), idx, w,
                                                 num_experts=E)),
        ('sf dtype', TypeError, lambda: dispatch((x.to(torch.float8_e4m3fn), torch.ones(M, 2).double()), idx,
                                                 w, num_experts=E)),
        ('previous_event without allocate_on_comm_stream', ValueError,
         lambda: dispatch(x, idx, w, num_experts=E, previous_event=object())),
        ('previous_event of the wrong type', TypeError,
         lambda: dispatch(x, idx, w, num_experts=E, previous_event=object(), allocate_on_comm_stream=True)),
        ('cached dispatch with topk_idx', ValueError, lambda: dispatch(x, idx, handle=handle)),
        ('cached dispatch with other alignment', ValueError, lambda: dispatch(x, handle=handle, expert_alignment=7)),
        ('cached dispatch with CPU sync', ValueError, lambda: dispatch(x, handle=handle, do_cpu_sync=True)),
        ('handle from another buffer (dispatch)', ValueError, lambda: dispatch(x, handle=other_handle)),
        ('handle from another buffer (combine)', ValueError, lambda: combine(recv, other_handle)),
        ('handle of the wrong type', TypeError, lambda: combine(recv, (1, 2))),
        ('combine x rows', ValueError, lambda: combine(recv[:1], handle)),
        ('combine x dtype', TypeError, lambda: combine(recv.float(), handle)),
        ('combine bias shape', ValueError, lambda: combine(recv, handle, bias=x[:, :8])),
        ('combine three biases', ValueError, lambda: combine(recv, handle, bias=(x, x, x))),
        ('combine weights shape', ValueError, lambda: combine(recv, handle, topk_weights=w[:, :1])),
        ('combine num_sms negative', ValueError, lambda: combine(recv, handle, num_sms=-1)),
    ]


def plan_calls(s):
    """`dispatch` / `combine` of the pure plans, with the buffer methods' keywords."""
    lay = layout.EPLayout(R, M, H, K, True, 2 * MiB)

    def combine(x, handle, topk_weights=None, bias=None, num_sms=0, previous_event=None,
                allocate_on_comm_stream=False):
        return ep_plan.plan_combine(s, lay, x, handle, topk_weights, bias, num_sms, previous_event,
                                    allocate_on_comm_stream)
    return (lambda *a, **k: plan(s, *a, lay=lay, **k)), combine


def _handle(owner_id, num_recv=R * M):
    """A handle as a CPU-sync dispatch of (M tokens, top-K) leaves it (torch, non-expanded)."""
    words, offsets = workspace_layout(M, R, K, E // R, True)
    ws = torch.zeros(words, dtype=torch.int32)
    return EPHandle(do_expand=False, num_experts=E, expert_alignment=1, num_max_tokens_per_rank=M, num_sms=20,
                    num_recv_tokens=num_recv, num_expanded_tokens=num_recv * K, num_recv_tokens_per_expert_list=[1],
                    recv_src_metadata=torch.zeros(num_recv, K + 2, dtype=torch.int32), num_tokens=M, num_topk=K,
                    hidden=H, kind='torch', buffer_id=owner_id, do_cpu_sync=True, num_ranks=R, workspace=ws,
                    workspace_ptr=ws.data_ptr(), offsets=offsets)


def test_plan_rejects_every_invalid_call(inputs):
    x, idx, w = inputs
    dispatch, combine = plan_calls(settings(owner_id=1))
    recv = torch.zeros(R * M, H, dtype=torch.bfloat16)
    cases = invalid_cases(dispatch, combine, _handle(owner_id=1), _handle(owner_id=2), recv, x, idx, w)
    assert len(cases) == 33
    for _name, exc, fn in cases:
        with pytest.raises(exc):
            fn()
    # and accepts the valid ones
    assert dispatch(x, idx, w, num_experts=E).num_topk == K
    assert combine(recv, _handle(owner_id=1), topk_weights=torch.zeros(R * M, K), bias=(x, x)).num_slots == R


def test_plan_size_checks(inputs):
    _, idx, w = inputs
    x = torch.zeros(M, 8192, dtype=torch.bfloat16)
    assert layout.buffer_size_hint(R, M, 8192, K) > 2 << 20
    with pytest.raises(ValueError, match='too small'):
        plan(settings(num_bytes=2 << 20), x, idx, w, num_experts=E)
    with pytest.raises(ValueError, match='built for num_topk=2'):
        plan(settings(num_topk=2), x, idx, w, num_experts=E)
    with pytest.raises(ValueError, match='at most 1024'):
        plan(settings(), x, idx, w, num_experts=4096)
    with pytest.raises(ValueError, match='at most 4096'):
        plan(settings(num_ranks=8), x, idx, w, num_experts=8 * 1024)


# ---- the EP feature of a buffer whose kernels only record launches ------------------------------------------------
class RecordingKernels:
    def __init__(self, log, num_ranks=R):
        b, r = constants.topk_bucket(K), num_ranks
        self.notify = fakes.RecordingKernel(ep_kernels.notify_spec(r, b), log)
        self.dispatch = fakes.RecordingKernel(ep_kernels.dispatch_spec(r, b), log)
        self.combine = {lr: fakes.RecordingKernel(ep_kernels.combine_spec(r, b, lr), log) for lr in (True, False)}
        self.fused = fakes.RecordingKernel(ep_kernels.fused_dispatch_spec(r, b), log)

    def fused_dispatch(self):
        return self.fused


def make_buffer(monkeypatch, num_bytes=1 << 30, num_ranks=R):
    """An `ElasticBuffer` without a GPU (tests/fakes.py) with MoE settings: CPU tensors, recorded launches, counts
    from the host (of `num_ranks` ranks, R unless said)."""
    buf = fakes.make_buffer(num_ranks, 0, num_bytes, num_max_tokens_per_rank=M, num_topk=K)
    log = []
    buf.launches = log
    monkeypatch.setattr(ep_feature, 'EPKernels',
                        lambda num_ranks, bucket: RecordingKernels(log, num_ranks))
    current = fakes.FakeStream('current')
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: current)
    monkeypatch.setattr(interop, 'stream_getter', lambda kind, device: lambda: current)
    ep = buf._ep_feature()
    monkeypatch.setattr(ep, '_wait_host_counts',
                        lambda seq, n: (num_ranks * M, num_ranks * M * K, [1] * n))
    monkeypatch.setattr(ep, '_start_range', lambda topk_idx, ptr, n, k, stream: cpu_range_of(topk_idx))
    return buf


def _names(log):
    return [entry.name.split('<')[0] for entry in log]


def test_valid_calls_launch_the_pipeline(monkeypatch, inputs):
    buf = make_buffer(monkeypatch)
    x, idx, w = inputs
    dispatch = 'deepep::dispatch_impl_with_dispatch_copy_epilogue_impl'
    # CPU sync: the send is a launch of its own (before the host waits for the counts), the receive another.
    out = buf.dispatch(x, idx, w, num_experts=E, num_sms=6)
    assert _names(buf.launches) == ['deepep::notify_dispatch', dispatch, dispatch]
    assert all(entry.args['num_topk'] == K for entry in buf.launches)
    send, recv = buf.launches[1:]
    assert (send.args['phases'], send.args['num_send_blocks'], send.grid) == (ep_kernels.PHASE_SEND, 6, 6)
    assert (recv.args['phases'], recv.args['num_send_blocks']) == (ep_kernels.PHASE_RECV, 0)
    assert send.args['chunk_rows'] == recv.args['chunk_rows'] == ep_kernels.dispatch_chunk_rows(M, R)
    handle = out[3]
    assert out[0].shape == (R * M, H) and handle.num_recv_tokens == R * M
    assert handle.token_metadata_at_forward is None and handle.channel_linked_list is None
    assert send.args['token_of_slot'] == handle.ptr(5) and recv.args['send_count'] == handle.ptr(6)
    buf.launches.clear()
    buf.dispatch(x, handle=handle, topk_weights=w)          # cached: no notify; send and receive in one launch
    (one,) = buf.launches
    assert _names(buf.launches) == [dispatch] and one.args['phases'] == ep_kernels.PHASE_SEND | ep_kernels.PHASE_RECV
    assert one.args['num_send_blocks'] == 6 and 6 < one.grid <= 132
    buf.launches.clear()
    combined, combined_w, _ = buf.combine(out[0], handle, topk_weights=out[2], bias=(x, x))
    assert combined.shape == (M, H) and combined_w.shape == (M, K)
    assert _names(buf.launches) == ['deepep::combine_impl_with_combine_reduce_epilogue_impl']
    launch = buf.launches[0]
    assert launch.args['num_send_blocks'] + 1 <= launch.grid and launch.args['num_slots'] == min(R, K)


def test_invalid_inputs_raise_before_any_kernel(monkeypatch, inputs):
    x, idx, w = inputs
    other = make_buffer(monkeypatch)
    other_handle = other.dispatch(x, idx, w, num_experts=E)[3]
    buf = make_buffer(monkeypatch)
    good = buf.dispatch(x, idx, w, num_experts=E)
    buf.launches.clear()
    for name, exc, fn in invalid_cases(buf.dispatch, buf.combine, good[3], other_handle, good[0], x, idx, w):
        with pytest.raises(exc):
            fn()
        assert buf.launches == [], f'{name}: a kernel was launched before the error'
    # The buffer still works afterwards.
    out = buf.dispatch(x, idx, w, num_experts=E)
    assert out[0].shape == (R * M, H)


def test_buffer_too_small_is_a_value_error(monkeypatch, inputs):
    _, idx, w = inputs
    hidden = 8192
    x = torch.zeros(M, hidden, dtype=torch.bfloat16)
    buf = fakes.make_buffer(R, 0, 2 << 20, num_max_tokens_per_rank=M)
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: fakes.FakeStream('current'))
    monkeypatch.setattr(ep_feature, 'EPKernels', lambda num_ranks, bucket: RecordingKernels([]))
    ep = buf._ep_feature()
    monkeypatch.setattr(ep, '_start_range', lambda topk_idx, ptr, n, k, stream: cpu_range_of(topk_idx))
    assert layout.buffer_size_hint(R, M, hidden, K) > 2 << 20
    with pytest.raises(ValueError, match='too small'):
        buf.dispatch(x, idx, w, num_experts=E)
    assert buf._data_region_owner is None


def test_one_feature_per_data_region(monkeypatch, inputs):
    x, idx, w = inputs
    buf = make_buffer(monkeypatch)
    buf.dispatch(x, idx, w, num_experts=E)
    with pytest.raises(RuntimeError, match='already used by EP dispatch/combine'):
        buf.claim_data_region('pp send/recv')


def test_handle_workspace_views(monkeypatch, inputs):
    """The handle's small arrays are disjoint views of one workspace allocation, with DeepEP's shapes and dtypes."""
    buf = make_buffer(monkeypatch)
    x, idx, w = inputs
    L = E // R
    for copy in (True, False):
        handle = buf.dispatch(x, idx, w, num_experts=E, do_handle_copy=copy)[3]
        views = {'dst_buffer_slot_idx': ((M, R), torch.int32), 'send_expert_pos': ((M, K), torch.int32),
                 'recv_layout': ((R + 2 * L + R * L + 2,), torch.int32),
                 'psum_num_recv_tokens_per_expert': ((L,), torch.int32)}
        if copy:
            views['topk_idx'] = ((M, K), torch.int64)
        spans = []
        ws = handle.workspace
        for name, (shape, dtype) in views.items():
            v = getattr(handle, name)
            assert tuple(v.shape) == shape and v.dtype == dtype, name
            assert v.untyped_storage().data_ptr() == ws.untyped_storage().data_ptr(), name
            begin = v.data_ptr()
            spans.append((begin, begin + v.numel() * v.element_size(), name))
            assert begin % v.element_size() == 0
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
        assert spans[-1][1] <= ws.data_ptr() + ws.numel() * 4
        assert handle.psum_num_recv_tokens_per_scaleup_rank.data_ptr() == handle.recv_layout.data_ptr()
        assert handle.num_unaligned_recv_tokens_per_expert.data_ptr() == handle.recv_layout.data_ptr() + 4 * R
        assert (handle.topk_idx is idx) == (not copy)
        assert handle.topk_idx_ptr == handle.topk_idx.data_ptr()
        assert handle.topk_idx is handle.topk_idx      # views are made once


def test_surface_of_the_buffer(monkeypatch):
    """DeepEP V2's QP and barrier surface on the buffer."""
    buf = make_buffer(monkeypatch)
    assert buf.get_theoretical_num_qps(24) == 9 and buf.get_theoretical_num_qps(3) == 3
    buf.num_allocated_qps = 4
    assert buf.get_theoretical_num_qps(24) == 4
    barriers = []
    buf._barrier = barriers.append
    buf.barrier(sequential=False)
    buf.barrier(True, False, True)
    assert barriers == [buf.comm_stream, buf.comm_stream]
