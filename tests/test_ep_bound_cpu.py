"""The bound calls of EP (features/ep/bound.py) without a GPU: a call signature is checked once and its launches
bound; later calls with the same signature launch exactly what a fresh plan would (only the per-call pointers
differ), still raise on the per-call checks (address alignment, top-k id range, previous_event's type), never match a
signature that differs in a checked property, and keep no caller array alive."""

import gc
import weakref

import pytest

torch = pytest.importorskip('torch')

import test_ep_checks_cpu as ep_tests  # noqa: E402

from deepep_cupy.features.ep import feature as ep_feature  # noqa: E402
from deepep_cupy.features.ep.handle import EPHandle  # noqa: E402

R, M, H, K, E = ep_tests.R, ep_tests.M, ep_tests.H, ep_tests.K, ep_tests.E

# Arguments that hold addresses (differ between calls with other tensors) or the CPU-sync sequence number.
PER_CALL = {'topk_idx', 'send_pos', 'send_expert_pos', 'recv_layout', 'psum_recv_per_expert', 'cumulative_stats',
            'topk_copy', 'token_of_slot', 'send_count', 'host_seq', 'x', 'sf', 'topk_weights', 'recv_x', 'recv_sf',
            'recv_topk_idx', 'recv_topk_weights', 'recv_src_metadata', 'combined_x', 'combined_topk_weights', 'bias0',
            'bias1'}


def _fixed(entry):
    return entry.name, entry.grid, entry.block, {k: v for k, v in entry.args.items() if k not in PER_CALL}


def _fresh_plan_launches(monkeypatch, call):
    """The launches of `call(buf)` on a buffer that has bound nothing yet."""
    buf = ep_tests.make_buffer(monkeypatch)
    call(buf)
    return [_fixed(e) for e in buf.launches]


@pytest.mark.parametrize('mode', ['cpu-sync', 'no-sync', 'expand', 'fp8'])
def test_a_bound_call_launches_what_a_fresh_plan_launches(monkeypatch, mode):
    x, idx, w = ep_tests.make_inputs()
    kw = dict(num_experts=E)
    if mode != 'cpu-sync':
        kw['do_cpu_sync'] = False
    if mode == 'expand':
        kw.update(do_expand=True, expert_alignment=4)
    xin = (x.to(torch.float8_e4m3fn), torch.ones(M, 2)) if mode == 'fp8' else x
    buf = ep_tests.make_buffer(monkeypatch)
    for _ in range(3):
        buf.launches.clear()
        out = buf.dispatch(xin, idx.clone(), w.clone(), **kw)
        first = [_fixed(e) for e in buf.launches]
    assert len(buf._ep._bound) == 1
    assert first == _fresh_plan_launches(monkeypatch, lambda b: b.dispatch(xin, idx, w, **kw))
    # Cached dispatch and combine with the handle, twice each: bound once, same launches as fresh plans.
    handle = out[3]
    rows = torch.zeros(handle.num_rows, H, dtype=torch.bfloat16)
    for _ in range(2):
        buf.launches.clear()
        again = buf.dispatch(xin, handle=handle, do_expand=kw.get('do_expand', False))
        buf.combine(rows, handle)
    assert len(buf._ep._bound) == 3 and again[3]._origin is not handle._origin
    names = [e.name for e in buf.launches]
    assert names[-1].startswith('deepep::combine') and 'notify' not in ' '.join(names)


def test_per_call_checks_still_raise_on_a_bound_signature(monkeypatch):
    x, idx, w = ep_tests.make_inputs()
    buf = ep_tests.make_buffer(monkeypatch)
    good = buf.dispatch(x, idx, w, num_experts=E)
    buf.launches.clear()
    # Same shape, strides, dtype and device, but rows 2 bytes off a 16-byte boundary.
    flat = torch.zeros(M * H + 8, dtype=torch.bfloat16)
    shifted = flat[1:1 + M * H].view(M, H)
    with pytest.raises(ValueError, match='16-byte aligned'):
        buf.dispatch(shifted, idx, w, num_experts=E)
    (b,) = buf._ep._bound.values()
    assert b.run.__name__ == 'run_cpu_sync'     # (the bound CPU-sync call's lean path checks the range too)
    with pytest.raises(ValueError, match=r'topk_idx values must be in \[-1, 16\)'):
        buf.dispatch(x, torch.full_like(idx, E), w, num_experts=E)
    assert not [e.name for e in buf.launches if 'notify' in e.name or 'dispatch' in e.name], 'no EP kernel ran'
    with pytest.raises(TypeError, match='previous_event must be an EventHandle'):
        buf.dispatch(x, idx, w, num_experts=E, previous_event=object(), allocate_on_comm_stream=True)
    # Scalars that compare equal to the bound ones but have another type are checked afresh.
    with pytest.raises(TypeError, match='num_experts must be an int'):
        buf.dispatch(x, idx, w, num_experts=float(E))
    with pytest.raises(TypeError, match='num_sms must be an int'):
        buf.dispatch(x, idx, w, num_experts=E, num_sms=True)
    buf.dispatch(x, idx, w, num_experts=E, num_sms=1)
    with pytest.raises(TypeError, match='num_sms must be an int'):
        buf.dispatch(x, idx, w, num_experts=E, num_sms=True)
    # Another signature of a bound call: checked afresh.
    with pytest.raises(TypeError, match='topk_weights must be float32'):
        buf.dispatch(x, idx, w.double(), num_experts=E)
    rows = torch.zeros(good[3].num_rows, H, dtype=torch.bfloat16)
    buf.launches.clear()
    buf.combine(rows, good[3])
    assert [e.name.split('<')[0] for e in buf.launches] == ['deepep::combine_impl_with_combine_reduce_epilogue_impl']
    buf.launches.clear()
    with pytest.raises(ValueError, match='16-byte aligned'):
        buf.combine(torch.zeros(rows.numel() + 8, dtype=torch.bfloat16)[1:1 + rows.numel()].view(rows.shape),
                    good[3])
    assert buf.launches == []


def test_a_bound_combine_checks_the_rows_of_each_handle(monkeypatch):
    x, idx, w = ep_tests.make_inputs()
    buf = ep_tests.make_buffer(monkeypatch)
    calls = iter([(R * M, R * M * K), (R * M - 3, R * M * K)])
    monkeypatch.setattr(buf._ep, '_wait_host_counts', lambda seq, n: (*next(calls), [1] * n))
    h1 = buf.dispatch(x, idx, w, num_experts=E)[3]
    h2 = buf.dispatch(x, idx, w, num_experts=E)[3]
    assert h1._origin is h2._origin and (h1.num_recv_tokens, h2.num_recv_tokens) == (R * M, R * M - 3)
    rows = torch.zeros(R * M, H, dtype=torch.bfloat16)
    buf.combine(rows, h1)
    buf.launches.clear()
    with pytest.raises(ValueError, match=rf'x must have shape \[{R * M - 3}, {H}\]'):
        buf.combine(rows, h2)
    assert buf.launches == []
    buf.combine(rows[:R * M - 3], h2)
    # A handle made by hand is never bound (its fields are not a dispatch's constants).
    hand = ep_tests._handle(h1.buffer_id)
    before = dict(buf._ep._bound)
    buf.combine(rows, hand)
    assert buf._ep._bound == before


def test_bound_calls_keep_no_caller_array_alive(monkeypatch):
    x, idx, w = ep_tests.make_inputs()
    buf = ep_tests.make_buffer(monkeypatch)
    x2, idx2, w2 = x.clone(), idx.clone(), w.clone()
    refs = [weakref.ref(t) for t in (x2, idx2, w2)]
    out = buf.dispatch(x2, idx2, w2, num_experts=E, do_handle_copy=True)
    del x2, idx2, w2
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert isinstance(out[3], EPHandle) and len(buf._ep._bound) == 1
    buf._ep.destroy()
    assert buf._ep._bound == {}


def test_the_first_dispatch_claims_the_region_only_once_its_checks_pass(monkeypatch):
    x, idx, _ = ep_tests.make_inputs()
    buf = ep_tests.fakes.make_buffer(R, 0, 1 << 30)             # no MoE settings: the first dispatch lays out
    monkeypatch.setattr(ep_feature, 'EPKernels', lambda num_ranks, bucket: ep_tests.RecordingKernels([]))
    current = ep_tests.fakes.FakeStream('current')
    monkeypatch.setattr(ep_tests.interop, 'stream_getter', lambda kind, device: lambda: current)
    ep = buf._ep_feature()
    monkeypatch.setattr(ep, '_start_range', lambda t, ptr, n, k, stream: ep_tests.cpu_range_of(t))
    monkeypatch.setattr(ep, '_wait_host_counts', lambda seq, n: (R * M, R * M * K, [1] * n))
    with pytest.raises(ValueError, match='topk_idx values'):
        buf.dispatch(x, torch.full_like(idx, -2), num_experts=E, num_max_tokens_per_rank=M)
    assert buf._data_region_owner is None and ep.layout is None and ep._bound == {}
    buf.dispatch(x, idx, num_experts=E, num_max_tokens_per_rank=M)
    assert buf._data_region_owner == ep_feature.DATA_REGION_OWNER and ep.layout is not None and len(ep._bound) == 1


DISPATCH = 'deepep::dispatch_impl_with_dispatch_copy_epilogue_impl'


def _phases(log):
    return [(e.name.split('<')[0], e.args.get('phases'), e.args.get('num_send_blocks')) for e in log]


def test_dispatch_launch_structure_per_mode_and_knob(monkeypatch):
    x, idx, w = ep_tests.make_inputs()
    both = ep_tests.ep_kernels.PHASE_SEND | ep_tests.ep_kernels.PHASE_RECV
    send, recv = ep_tests.ep_kernels.PHASE_SEND, ep_tests.ep_kernels.PHASE_RECV
    notify = ('deepep::notify_dispatch', None, None)
    buf = ep_tests.make_buffer(monkeypatch)
    buf.dispatch(x, idx, w, num_experts=E, num_sms=4, do_cpu_sync=False)
    assert _phases(buf.launches) == [notify, (DISPATCH, both, 4)]
    # Overlap off: a no-sync dispatch runs like a CPU-sync one, send then receive.
    monkeypatch.setenv('DEEPEP_CUPY_EP_DISPATCH_OVERLAP', '0')
    buf = ep_tests.make_buffer(monkeypatch)
    out = buf.dispatch(x, idx, w, num_experts=E, num_sms=4, do_cpu_sync=False)
    assert _phases(buf.launches) == [notify, (DISPATCH, send, 4), (DISPATCH, recv, 0)]
    buf.launches.clear()
    buf.combine(torch.zeros(out[3].num_rows, H, dtype=torch.bfloat16), out[3])
    assert [n for n, _, _ in _phases(buf.launches)] == ['deepep::combine_impl_with_combine_reduce_epilogue_impl']


def test_one_rank_dispatches_in_one_launch_without_senders(monkeypatch):
    """At one rank every token stays: one launch of receivers only, whatever the mode (after the notify kernel: with
    the fused kernel off, which a one-rank no-sync dispatch takes by default, tests/test_ep_fused_cpu.py)."""
    monkeypatch.setenv('DEEPEP_CUPY_EP_FUSED_NOTIFY', '0')
    x, idx, w = ep_tests.make_inputs()
    b = ep_tests.constants.topk_bucket(K)
    log = []

    class OneRankKernels:
        notify = ep_tests.fakes.RecordingKernel(ep_tests.ep_kernels.notify_spec(1, b), log)
        topk_range = None
        dispatch = ep_tests.fakes.RecordingKernel(ep_tests.ep_kernels.dispatch_spec(1, b), log)
        combine = {lr: ep_tests.fakes.RecordingKernel(ep_tests.ep_kernels.combine_spec(1, b, lr), log)
                   for lr in (True, False)}
    buf = ep_tests.fakes.make_buffer(1, 0, 1 << 30, num_max_tokens_per_rank=M, num_topk=K)
    monkeypatch.setattr(ep_feature, 'EPKernels', lambda num_ranks, bucket: OneRankKernels)
    current = ep_tests.fakes.FakeStream('current')
    monkeypatch.setattr(ep_tests.interop, 'stream_getter', lambda kind, device: lambda: current)
    ep = buf._ep_feature()
    monkeypatch.setattr(ep, '_start_range', lambda t, ptr, n, k, stream: ep_tests.cpu_range_of(t))
    monkeypatch.setattr(ep, '_wait_host_counts', lambda seq, n: (M, M * K, [1] * n))
    both = ep_tests.ep_kernels.PHASE_SEND | ep_tests.ep_kernels.PHASE_RECV
    for cpu_sync in (True, False):
        log.clear()
        out = buf.dispatch(x, idx, w, num_experts=E, num_sms=22, do_cpu_sync=cpu_sync)
        assert _phases(log) == [('deepep::notify_dispatch', None, None), (DISPATCH, both, 0)]
        assert log[1].grid == ep_tests.ep_plan.epilogue_blocks(M, 2 * H, 132)
    log.clear()
    buf.combine(torch.zeros(out[3].num_rows, H, dtype=torch.bfloat16), out[3], num_sms=10)
    assert log[0].args['num_send_blocks'] == 0
    assert log[0].grid == min(10, ep_tests.ep_plan.epilogue_blocks(M, 2 * H, 132))


def test_cpu_sync_counts_become_a_list_on_first_access(monkeypatch):
    import numpy as np
    x, idx, w = ep_tests.make_inputs()
    buf = ep_tests.make_buffer(monkeypatch)
    counts = np.array([3, 0, 5, 8, 1, 2, 4, 9], dtype=np.int32)
    monkeypatch.setattr(buf._ep, '_wait_host_counts', lambda seq, n: (R * M, R * M * K, counts[:n].copy()))
    h = buf.dispatch(x, idx, w, num_experts=E)[3]
    listed = h.num_recv_tokens_per_expert_list
    assert listed == counts[:E // R].tolist() and type(listed) is list and all(type(v) is int for v in listed)
    assert h.num_recv_tokens_per_expert_list is listed


@pytest.mark.parametrize('cap_all', [False, True])
def test_combine_grid_follows_the_cap_all_sms_knob(monkeypatch, cap_all):
    monkeypatch.setenv('DEEPEP_CUPY_COMBINE_CAP_ALL_SMS', '1' if cap_all else '0')
    x, idx, w = ep_tests.make_inputs()
    buf = ep_tests.make_buffer(monkeypatch)
    handle = buf.dispatch(x, idx, w, num_experts=E, num_sms=20)[3]
    rows = torch.zeros(handle.num_rows, H, dtype=torch.bfloat16)
    for num_sms in (24, 0):
        buf.launches.clear()
        buf.combine(rows, handle, num_sms=num_sms)
        (launch,) = [e for e in buf.launches if e.name.startswith('deepep::combine')]
        send, grid = launch.args['num_send_blocks'], launch.grid
        grid = grid if type(grid) is int else grid[0]
        want = ep_tests.ep_plan.combine_blocks(num_sms, 20, R, M, H, 132, cap_all)
        assert (send, grid - send) == want
        if cap_all:
            assert grid <= (num_sms or 20) and send == (num_sms or 20) // 2
        else:
            assert send == (num_sms or 20)


@pytest.mark.parametrize('always', [False, True])
def test_synchronous_calls_run_on_the_current_stream(monkeypatch, always):
    """runtime/streams.py's local path through the bound calls: a synchronous dispatch / combine without
    previous_event launches on the current stream with no event wait after the first call (the first joins the
    communication stream once); asynchronous calls and previous_event stay on the communication stream and order the
    next local call after them. DEEPEP_CUPY_ALWAYS_COMM_STREAM=1: always the communication stream."""
    from deepep_cupy.runtime import streams
    from deepep_cupy.runtime.event import EventHandle
    monkeypatch.setattr(streams, 'EventHandle', ep_tests.fakes.FakeEventHandle)
    monkeypatch.setattr(ep_tests.interop, 'torch_stream', lambda handle: None)
    monkeypatch.setattr(torch.Tensor, 'record_stream', lambda self, stream: None)
    x, idx, w = ep_tests.make_inputs()
    buf = ep_tests.make_buffer(monkeypatch)
    buf.stream_order.local = not always         # (what DEEPEP_CUPY_ALWAYS_COMM_STREAM sets when a buffer is made)
    comm, current = buf.stream_order.comm, ep_tests.interop.stream_getter('torch', 0)()
    local = comm if always else current

    def run(fn):
        """(names of the streams launched on, (waits of comm, waits of current), result) of `fn()`."""
        buf.launches.clear()
        waits = (comm.waits, current.waits)
        out = fn()
        return {e.stream.name for e in buf.launches}, (comm.waits - waits[0], current.waits - waits[1]), out

    def dispatch(**kw):
        return buf.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False, **kw)

    assert run(dispatch)[:2] == ({local.name}, (1, 1))                  # the first call joins once
    every = (1, 1) if always else (0, 0)
    for _ in range(2):
        ran, waits, out = run(dispatch)
        assert ran == {local.name} and waits == every
        rows = torch.zeros(out[3].num_rows, H, dtype=torch.bfloat16)
        assert run(lambda rows=rows, h=out[3]: buf.combine(rows, h))[:2] == ({local.name}, every)
    ran, waits, res = run(lambda: buf.combine(rows, out[3], async_with_compute_stream=True))
    assert ran == {'comm'} and waits == (1 if always else 2, 0) and res[2].event is not None     # (+ the mark)
    assert run(dispatch)[:2] == ({local.name}, (1, 1))                  # after async work: joined again
    handle = EventHandle.__new__(EventHandle)
    handle.stream_wait = lambda stream: stream.wait_event(None)
    ran, waits, _ = run(lambda: dispatch(previous_event=handle, allocate_on_comm_stream=True))
    assert ran == {'comm'} and waits == (1 if always else 2, 1)        # (+ the last local dispatch's mark)
