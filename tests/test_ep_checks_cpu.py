"""EP argument checks without a GPU: a buffer whose kernels only record launches, fed CPU torch tensors. Every
invalid call must raise ValueError/TypeError before any kernel is launched (the GPU rank program repeats these
checks on real buffers)."""

import numpy as np
import pytest

torch = pytest.importorskip('torch')

from deepep_cupy.ep import buffer as ep_buffer  # noqa: E402
from deepep_cupy.ep import kernels as ep_kernels  # noqa: E402
from deepep_cupy.ep import layout  # noqa: E402
from deepep_cupy.jit import launch  # noqa: E402
from deepep_cupy.runtime import interop  # noqa: E402
from deepep_cupy.runtime.event import EventOverlap  # noqa: E402

R, M, H, K, E = 2, 64, 256, 4, 16


class RecordingKernel:
    """Packs the arguments like a real launch (type checks included) and records the launch."""

    def __init__(self, spec, log):
        self.spec, self.log, self.converters = spec, log, launch.converters_for(spec)

    def launch(self, grid, block, args, stream=None, shared_mem=0, cooperative=False):
        launch.pack_args(self.spec, args, self.converters)
        self.log.append(self.spec.name)


class RecordingKernels:
    def __init__(self, log):
        self.notify = RecordingKernel(ep_kernels.notify_spec(R, K), log)
        self.dispatch_send = RecordingKernel(ep_kernels.dispatch_send_spec(R, K), log)
        self.dispatch_recv = RecordingKernel(ep_kernels.dispatch_recv_spec(R, K), log)
        self.combine = {lr: RecordingKernel(ep_kernels.combine_spec(R, K, lr), log) for lr in (True, False)}


class _Obj:
    pass


def make_buffer(monkeypatch, num_bytes=1 << 30):
    """An ElasticBuffer whose GPU parts are replaced: CPU tensors, recorded launches, counts from the host."""
    buf = ep_buffer.ElasticBuffer.__new__(ep_buffer.ElasticBuffer)
    log = []
    buf.__dict__.update(
        device=-1, num_scaleup_ranks=R, num_ranks=R, rank_idx=0, num_max_tokens_per_rank=M, num_topk=K,
        _kernels={K: RecordingKernels(log)}, num_device_sms=132, _nvlink_gbs=450.0, prefer_overlap_with_compute=True,
        _destroyed=False, _failed=None, error_record=np.zeros(8, np.int32), host_counts=np.zeros(2000, np.int32),
        num_cpu_timeout_secs=10.0, num_gpu_timeout_secs=10.0, allow_multiple_reduction=True, _host_seq=0,
        num_bytes=num_bytes, _order_events=None, _layout=None, _data_region_owner=None)
    buf.sym = _Obj()
    buf.sym.peer_bases_ptr, buf.sym.local_idx, buf.sym.base = 0x1000, 0, 0x100000
    buf.sym.num_bytes = num_bytes + (2 << 20)
    buf.host_mapped = _Obj()
    buf.host_mapped.ptr = 0x2000
    buf.launches = log
    monkeypatch.setattr(buf, '_streams', lambda like, prev, alloc: (None, None, None), raising=False)
    monkeypatch.setattr(buf, '_finish', lambda kind, cur, comm, a, t: EventOverlap(None), raising=False)
    monkeypatch.setattr(buf, '_wait_host_counts', lambda seq, n: (R * M, R * M * K, [1] * n), raising=False)
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: None)

    def topk_range(ti, stream):     # what topk_range_kernel computes, without a GPU
        x = ti.obj
        return lambda: (int(x.min()), int(x.max())) if x.numel() else (0, 0)
    monkeypatch.setattr(buf, '_topk_range_async', topk_range, raising=False)
    monkeypatch.setattr(interop.Allocator, 'empty',
                        lambda self, shape, dtype, stream=None: torch.zeros(shape, dtype=getattr(torch, dtype)))
    return buf


@pytest.fixture()
def inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand(M, E, generator=g), K).indices
    w = torch.rand(M, K, generator=g)
    return x, idx, w


def test_valid_calls_launch_the_pipeline(monkeypatch, inputs):
    buf = make_buffer(monkeypatch)
    x, idx, w = inputs
    out = buf.dispatch(x, idx, w, num_experts=E)
    assert [n.split('<')[0] for n in buf.launches] == ['deepep::notify_kernel', 'deepep::dispatch_send_kernel',
                                                       'deepep::dispatch_recv_kernel']
    handle = out[3]
    assert out[0].shape == (R * M, H) and handle.num_recv_tokens == R * M
    buf.launches.clear()
    buf.dispatch(x, handle=handle, topk_weights=w)          # cached: no notify
    assert [n.split('<')[0] for n in buf.launches] == ['deepep::dispatch_send_kernel', 'deepep::dispatch_recv_kernel']
    buf.launches.clear()
    combined, combined_w, _ = buf.combine(out[0], handle, topk_weights=out[2], bias=(x, x))
    assert combined.shape == (M, H) and combined_w.shape == (M, K)
    assert [n.split('<')[0] for n in buf.launches] == ['deepep::combine_kernel']


def invalid_cases(buf, other_handle, x, idx, w):
    idx_strided = torch.empty((M, 2 * K), dtype=idx.dtype)[:, ::2]
    idx_strided.copy_(idx)
    good = buf.dispatch(x, idx, w, num_experts=E)
    handle = good[3]
    buf.launches.clear()
    return [
        ('x float32', TypeError, lambda: buf.dispatch(x.float(), idx, w, num_experts=E)),
        ('x 1-D', ValueError, lambda: buf.dispatch(x[0], idx, w, num_experts=E)),
        ('x strided rows', ValueError, lambda: buf.dispatch(x[:, ::2], idx, w, num_experts=E)),
        ('x hidden not 16-byte aligned', ValueError, lambda: buf.dispatch(x[:, :12], idx, w, num_experts=E)),
        ('x not an array', TypeError, lambda: buf.dispatch(x.numpy().view(np.int16), idx, w, num_experts=E)),
        ('topk_idx int32', TypeError, lambda: buf.dispatch(x, idx.int(), w, num_experts=E)),
        ('topk_idx too large', ValueError, lambda: buf.dispatch(x, torch.full_like(idx, E), w, num_experts=E)),
        ('topk_idx below -1', ValueError, lambda: buf.dispatch(x, torch.full_like(idx, -2), w, num_experts=E)),
        ('topk_idx non-contiguous', ValueError, lambda: buf.dispatch(x, idx_strided, w, num_experts=E)),
        ('topk_idx wrong rows', ValueError, lambda: buf.dispatch(x, idx[:-1], w, num_experts=E)),
        ('topk_weights shape', ValueError, lambda: buf.dispatch(x, idx, w[:, :1], num_experts=E)),
        ('topk_weights dtype', TypeError, lambda: buf.dispatch(x, idx, w.double(), num_experts=E)),
        ('num_tokens > num_max_tokens_per_rank', ValueError,
         lambda: buf.dispatch(x, idx, w, num_experts=E, num_max_tokens_per_rank=M - 1)),
        ('num_experts not a multiple of ranks', ValueError, lambda: buf.dispatch(x, idx, w, num_experts=E + 1)),
        ('num_experts missing', ValueError, lambda: buf.dispatch(x, idx, w)),
        ('expert_alignment 0', ValueError, lambda: buf.dispatch(x, idx, w, num_experts=E, expert_alignment=0)),
        ('do_zero_padding without do_expand', ValueError,
         lambda: buf.dispatch(x, idx, w, num_experts=E, do_zero_padding=True)),
        ('sf rows', ValueError, lambda: buf.dispatch((x.to(torch.float8_e4m3fn), torch.ones(1, 2)), idx, w,
                                                     num_experts=E)),
        ('sf dtype', TypeError, lambda: buf.dispatch((x.to(torch.float8_e4m3fn), torch.ones(M, 2).double()), idx,
                                                     w, num_experts=E)),
        ('cached dispatch with topk_idx', ValueError, lambda: buf.dispatch(x, idx, handle=handle)),
        ('cached dispatch with other alignment', ValueError,
         lambda: buf.dispatch(x, handle=handle, expert_alignment=7)),
        ('cached dispatch with CPU sync', ValueError, lambda: buf.dispatch(x, handle=handle, do_cpu_sync=True)),
        ('handle from another buffer (dispatch)', ValueError, lambda: buf.dispatch(x, handle=other_handle)),
        ('handle from another buffer (combine)', ValueError, lambda: buf.combine(good[0], other_handle)),
        ('handle of the wrong type', TypeError, lambda: buf.combine(good[0], (1, 2))),
        ('combine x rows', ValueError, lambda: buf.combine(good[0][:1], handle)),
        ('combine x dtype', TypeError, lambda: buf.combine(good[0].float(), handle)),
        ('combine bias shape', ValueError, lambda: buf.combine(good[0], handle, bias=x[:, :8])),
        ('combine three biases', ValueError, lambda: buf.combine(good[0], handle, bias=(x, x, x))),
        ('combine weights shape', ValueError, lambda: buf.combine(good[0], handle, topk_weights=w[:, :1])),
        ('combine num_sms negative', ValueError, lambda: buf.combine(good[0], handle, num_sms=-1)),
    ]


def test_invalid_inputs_raise_before_any_kernel(monkeypatch, inputs):
    x, idx, w = inputs
    other = make_buffer(monkeypatch)
    other_handle = other.dispatch(x, idx, w, num_experts=E)[3]
    buf = make_buffer(monkeypatch)
    for name, exc, fn in invalid_cases(buf, other_handle, x, idx, w):
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
    buf = make_buffer(monkeypatch, num_bytes=2 << 20)
    assert layout.buffer_size_hint(R, M, hidden, K) > 2 << 20
    with pytest.raises(ValueError, match='too small'):
        buf.dispatch(x, idx, w, num_experts=E)
    assert buf.launches == []


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
                 'recv_layout': ((2 * R + 2 * L + R * L + 2,), torch.int32),
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
