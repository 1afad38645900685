"""The low-latency engine's bound calls without a GPU (features/ll/bound.py): a call signature is checked once and
bound, and a bound call still catches per call what its signature cannot (a misaligned address, a foreign handle,
flags and integers of the wrong type, a hook called twice) before any kernel runs; its launches carry every argument
the layout and the call's arrays say (the previous per-call path's, name by name); its outputs are fresh each call."""

import numpy as np
import pytest

torch = pytest.importorskip('torch')

from test_ll_cpu import fake_engine  # noqa: E402,F401  (the engine over a fake BufferBase, recording kernels)

from deepep_cupy.features import ll  # noqa: E402

N, K, H, M, E, L, T, R = 5, 4, 1024, 16, 16, 8, 32, 2


def _inputs(n=N):
    g = torch.Generator().manual_seed(0)
    x = torch.randn((n, H), generator=g).to(torch.bfloat16)
    topk = torch.topk(torch.rand((n, E), generator=g), K).indices
    return x, topk


def _expected_dispatch(eng, x, topk, out, phases, stats=None, wait=None, use_fp8=False, round_scale=False,
                       use_ue8m0=False):
    """Every argument of a dispatch launch, as the per-call path before the bound calls computed them."""
    recv, count, handle = out[0], out[1], out[2]
    recv_x, sf = recv if use_fp8 else (recv, None)
    lay, base = eng.layout, eng.base
    return dict(
        x=x.data_ptr(), topk_idx=topk.data_ptr(), num_tokens=x.shape[0], num_topk=K, hidden=H, num_experts=E,
        num_max_tokens=M, use_fp8=int(use_fp8), round_scale=int(round_scale), use_ue8m0=int(use_ue8m0),
        recv_x=recv_x.data_ptr(), recv_sf=0 if sf is None else sf.data_ptr(), recv_count=count.data_ptr(),
        src_info=handle[0].data_ptr(), layout_range=handle[1].data_ptr(), row_route=handle.row_route.data_ptr(),
        send_pos=handle.send_pos.data_ptr() if x.shape[0] else 0, call_info=handle.call_info.data_ptr(),
        cumulative_stats=0 if stats is None else stats.data_ptr(), wait_stats=0 if wait is None else wait.data_ptr(),
        peer_bases=base.sym.peer_bases_ptr, rank=eng.rank, region_offset=eng.region_offset,
        half_bytes=lay.half_bytes, lists_offset=lay.lists_offset, dslots_offset=lay.dslots_offset,
        slot_tokens=lay.num_max_tokens, msg_bytes=lay.msg_bytes, msg_hidden_offset=lay.msg_hidden_offset,
        shrink=int(eng.enable_shrink), phases=phases, error_record=base.host_mapped.ptr, timeout_ns=base.timeout_ns)


@pytest.mark.parametrize('use_fp8, round_scale, use_ue8m0', [(False, False, False), (True, False, False),
                                                              (True, True, True)])
@pytest.mark.parametrize('hook', [False, True])
def test_bound_dispatch_launches_every_argument(fake_engine, use_fp8, round_scale, use_ue8m0, hook):  # noqa: F811
    eng, log, base = fake_engine
    x, topk = _inputs()
    stats, wait = torch.zeros(L, dtype=torch.int32), torch.zeros(R, dtype=torch.int64)
    seen = []
    for _ in range(3):                  # the first call binds, the others run the bound call
        out = eng.dispatch(x, topk, M, E, stats, wait, use_fp8, round_scale, use_ue8m0, False, hook)
        if hook:
            out[4]()
        phases = [ll.PHASE_SEND, ll.PHASE_RECV] if hook else [ll.PHASE_SEND | ll.PHASE_RECV]
        got = log[-len(phases):]
        for entry, ph in zip(got, phases):
            name, grid, block, smem, stream, args = entry
            assert (name, grid, block, smem) == ('deepep::ll::dispatch<2>', 132, ll.THREADS,
                                                 ll.dispatch_smem_bytes(E, R))
            assert stream == ('current' if hook else 'comm')
            assert args == _expected_dispatch(eng, x, topk, out, ph, stats, wait, use_fp8, round_scale, use_ue8m0)
        seen.append(out)
    assert len(eng._dispatches) == 1
    # Fresh outputs per call: no two calls share recv_x, the scales or the handle's allocation
    ptrs = [(o[0][0] if use_fp8 else o[0]).data_ptr() for o in seen] + [o[2]._g0 for o in seen]
    assert len(set(ptrs)) == len(ptrs)
    recv_count, handle = seen[-1][1], seen[-1][2]
    for t in (recv_count, handle[0], handle[1], handle.row_route, handle.send_pos, handle.call_info):
        assert t.is_contiguous() and (t.data_ptr() - handle._g0) % 256 == 0     # (CUDA's allocations: 512-aligned)
    assert handle[1].dtype == torch.int64 and handle[1].shape == (L, R) and handle.send_pos.shape == (N, K)


def test_bound_combine_launches_every_argument(fake_engine):  # noqa: F811
    eng, log, base = fake_engine
    x, topk = _inputs()
    w = torch.rand((N, K))
    y = torch.zeros((L, T, H), dtype=torch.bfloat16)
    out_t = torch.zeros((N, H), dtype=torch.bfloat16)
    cost = torch.zeros(R, dtype=torch.int64)
    _, _, handle, _, _ = eng.dispatch(x, topk, M, E)
    lay = eng.layout
    for zero_copy, out, hook in ((False, None, False), (True, None, False), (False, out_t, True), (True, out_t, True),
                                 (False, None, False)):
        half = eng._num_combines % 2
        combined, _, recv_hook = eng.combine(y, topk, w, handle, zero_copy=zero_copy, return_recv_hook=hook, out=out,
                                             combine_wait_recv_cost_stats=cost)
        assert out is None or combined is out
        if hook:
            recv_hook()
        entries = log[-2:] if hook else log[-1:]
        for entry, ph in zip(entries, [ll.PHASE_SEND, ll.PHASE_RECV] if hook else [ll.PHASE_SEND | ll.PHASE_RECV]):
            name, grid, block, smem, stream, args = entry
            assert (name, smem, stream) == ('deepep::ll::combine<2>', ll.combine_smem_bytes(E, R),
                                            'current' if hook else 'comm')
            call_info = args.pop('call_info')
            if hook:        # a call word of its own, which the receive phase reads back
                assert call_info not in (0, handle.call_info.data_ptr())
            else:           # written, never read: the handle's shared word
                assert call_info == handle._g0 + 4 * handle._sig.combine_call_info
            assert args == dict(
                x=eng._staging_ptr(half) if zero_copy else y.data_ptr(), recv_count=handle.recv_count.data_ptr(),
                row_route=handle.row_route.data_ptr(), layout_range=handle[1].data_ptr(),
                send_pos=handle.send_pos.data_ptr(), topk_idx=topk.data_ptr(), topk_weights=w.data_ptr(),
                combined_x=combined.data_ptr(), num_tokens=N, num_topk=K, hidden=H, num_experts=E, num_max_tokens=M,
                wait_stats=cost.data_ptr(), peer_bases=base.sym.peer_bases_ptr, rank=eng.rank,
                region_offset=eng.region_offset, half_bytes=lay.half_bytes, cflags_offset=lay.cflags_offset,
                cslots_offset=lay.cslots_offset, slot_segs=lay.num_segs, shrink=0, phases=ph,
                error_record=base.host_mapped.ptr, timeout_ns=base.timeout_ns)


def test_bound_calls_check_per_call(fake_engine):  # noqa: F811
    eng, log, base = fake_engine
    x, topk = _inputs()
    eng.dispatch(x, topk, M, E)
    n = len(log)
    # Same signature (shape, strides, dtype, device), another address: 16-byte alignment checked per call
    big = torch.zeros((N * H + 8,), dtype=torch.bfloat16)
    shifted = big[1:1 + N * H].view(N, H)
    assert shifted.stride() == x.stride() and shifted.data_ptr() % 16
    with pytest.raises(ValueError, match='16-byte aligned'):
        eng.dispatch(shifted, topk, M, E)
    # Flags and integers equal to a bound key's but of another type: the planner's TypeError
    for kwargs, match in ((dict(use_fp8=1), 'use_fp8 must be a bool'), (dict(async_finish=0), 'async_finish'),
                          (dict(round_scale=0), 'round_scale')):
        with pytest.raises(TypeError, match=match):
            eng.dispatch(x, topk, M, E, **{'use_fp8': True, **kwargs})
    eng.dispatch(x, topk, M, E, use_fp8=True)
    with pytest.raises(TypeError, match='use_fp8 must be a bool'):
        eng.dispatch(x, topk, M, E, use_fp8=1)
    with pytest.raises(TypeError, match='num_max_dispatch_tokens_per_rank must be an int'):
        eng.dispatch(x, topk, float(M), E)
    # Wrong dtype, strides, shape, kind: another signature, checked by the planner
    for bad, err, match in ((x.float(), TypeError, 'x must be bfloat16'),
                            (torch.zeros((H, N), dtype=torch.bfloat16).t(), ValueError, 'x must be contiguous'),
                            (np.zeros((N, H)), TypeError, 'torch.Tensor or a cupy.ndarray')):
        with pytest.raises(err, match=match):
            eng.dispatch(bad, topk, M, E)
    with pytest.raises(TypeError, match='topk_idx must be int64'):
        eng.dispatch(x, topk.int(), M, E)
    assert len(log) == n + 1, 'no kernel may run for a bad call'
    # bound_only: None for a signature never bound, nothing launched
    assert eng.dispatch(x[:3], topk[:3], M, E, bound_only=True) is None and len(log) == n + 1
    # Combine: alignment, a handle from another engine on a bound signature, a hook called twice
    _, _, handle, _, _ = eng.dispatch(x, topk, M, E)
    w = torch.rand((N, K))
    y = torch.zeros((L, T, H), dtype=torch.bfloat16)
    eng.combine(y, topk, w, handle)
    n = len(log)
    big = torch.zeros((L * T * H + 8,), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match='x must start at a 16-byte aligned'):
        eng.combine(big[1:1 + L * T * H].view(L, T, H), topk, w, handle)
    out_big = torch.zeros((N * H + 8,), dtype=torch.bfloat16)
    eng.combine(y, topk, w, handle, out=out_big[:N * H].view(N, H))
    with pytest.raises(ValueError, match='out must start at a 16-byte aligned'):
        eng.combine(y, topk, w, handle, out=out_big[1:1 + N * H].view(N, H))
    foreign = ll.LLHandle(*handle, **{**handle.__dict__, 'engine_id': 0})
    with pytest.raises(ValueError, match='another buffer'):
        eng.combine(y, topk, w, foreign)
    with pytest.raises(TypeError, match='handle must be'):
        eng.combine(y, topk, w, tuple(handle))
    with pytest.raises(TypeError, match='topk_weights must be float32'):
        eng.combine(y, topk, w.double(), handle)
    assert len(log) == n + 1
    _, _, hook = eng.combine(y, topk, w, handle, return_recv_hook=True)
    hook()
    n = len(log)
    with pytest.raises(RuntimeError, match='already called'):
        hook()
    assert len(log) == n


def test_pending_hooks_hold_their_own_arguments(fake_engine):  # noqa: F811
    """Two sends in flight, their hooks called in either order: each receive launches its own call's arguments (a
    receive block is taken per send and returned once its hook ran)."""
    eng, log, base = fake_engine
    x, topk = _inputs()
    a = eng.dispatch(x, topk, M, E, use_fp8=False, return_recv_hook=True)
    b = eng.dispatch(x, topk, M, E, use_fp8=False, return_recv_hook=True)
    b[4]()
    assert log[-1][5]['recv_x'] == b[0].data_ptr() and log[-1][5]['phases'] == ll.PHASE_RECV
    a[4]()
    assert log[-1][5]['recv_x'] == a[0].data_ptr() and log[-1][5]['call_info'] == a[2].call_info.data_ptr()
    (bound,) = eng._dispatches.values()
    assert len(bound.recv_free) == 2
