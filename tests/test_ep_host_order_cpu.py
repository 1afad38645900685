"""The host side of a dispatch (features/ep/bound.py) without a GPU, as the GPU timeline sees it:
- order: without a CPU sync every allocation, view and argument patch comes before the first launch and the launches
  follow back to back (no host gap between the notify and the dispatch), for each launch structure (one launch,
  send + receive, the fused launch, a cached dispatch); a CPU-sync dispatch keeps notify, send,
  the wait for the counts, then the receive, its outputs allocated after the wait or, speculated for the last call's
  sizes (lean path, outputs carved), before it (kept on a hit, freed before the right ones on a miss);
- one allocation: decode-sized recv_x / recv_sf are carved out of the call's small-outputs allocation (no-sync: the
  workspace's), 256-byte aligned, disjoint from every other output, with the shapes, strides and dtypes (and kernel
  arguments but for the addresses) of separately allocated ones; above `CARVED_RECV_MAX_BYTES` they are separate
  (also made before the first launch);
- the lean paths (features/ep/lean.py, carved or not) launch what the general `__call__` launches."""

import contextlib
import functools
import sys
import weakref

import pytest

torch = pytest.importorskip('torch')

import fakes  # noqa: E402
import test_ep_checks_cpu as ep_tests  # noqa: E402

from deepep_cupy.features.ep import bound as ep_bound  # noqa: E402
from deepep_cupy.features.ep import lean as ep_lean  # noqa: E402
from deepep_cupy.features.ep import legacy as ep_legacy  # noqa: E402
from deepep_cupy.features.ep import patch as ep_patch  # noqa: E402
from deepep_cupy.jit import launch as jit_launch  # noqa: E402
from deepep_cupy.runtime import interop, streams  # noqa: E402

R, M, H, K, E = ep_tests.R, ep_tests.M, ep_tests.H, ep_tests.K, ep_tests.E
BOUND_FILE = ep_bound.__file__
LAUNCH_CODE = jit_launch.BoundLaunch.__call__.__code__


def _allocate(carver, shape, dtype):
    """What `Carver.allocator`'s function does, as a Python frame the profiler sees (the real one is a partial of
    torch.empty: no frame; test_carver_allocator_makes_what_empty_makes checks it)."""
    return carver.empty(shape, dtype)


ALLOC_CODES = {interop.Carver.words.__code__: 'alloc', interop.Carver.empty.__code__: 'alloc',
               _allocate.__code__: 'alloc'}
# The per-call functions of bound.py and patch.py (a first call also binds: `__init__` and what it calls are not
# recorded)
PER_CALL = {(BOUND_FILE, n) for n in ('__call__', '_receive_outputs', '_size_recv')} | \
    {(ep_lean.__file__, n) for n in ('run_cached', 'run_no_sync', 'run_cpu_sync', 'run_no_sync_v1', 'run_cpu_sync_v1',
                                    'prepare_receive', 'receive_event', 'views')} | \
    {(ep_legacy.__file__, 'v1_outputs')} | \
    {(ep_patch.__file__, n) for n in ('cupy_views', 'allocate_x', 'patch_guard', 'check_guard', 'from_handle',
                                     'wait_counts')}


def record_host_calls(fn):
    """`fn()`'s result and the calls made from the per-call frames of bound.py and patch.py, in order: 'launch' (a
    `BoundLaunch` call), 'alloc' (`Carver.words` / `.empty`), else the called function's name: 'name()' for Python
    functions (the argument patchers' 'patch()', the host's 'wait_host_counts()'), 'name' for C functions (torch's
    `view`, `as_strided`, `data_ptr`...)."""
    seen = []

    def profiler(frame, event, arg):
        if event == 'call':
            caller = frame.f_back
            if caller is not None and (caller.f_code.co_filename, caller.f_code.co_name) in PER_CALL:
                code = frame.f_code
                seen.append('launch' if code is LAUNCH_CODE else ALLOC_CODES.get(code, code.co_name + '()'))
        elif event == 'c_call' and (frame.f_code.co_filename, frame.f_code.co_name) in PER_CALL:
            seen.append(getattr(arg, '__name__', repr(arg)))
    sys.setprofile(profiler)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, seen


def make_buffer(monkeypatch):
    """tests/test_ep_checks_cpu.py's buffer; a CPU-sync call's counts are those of every rank sending what this one
    sends (from the top-k ids its range check saw: a token with ids of -1 only, or a slot of -1, is not sent)."""
    monkeypatch.setattr(interop.Carver, 'allocator',
                        lambda self, shape, dtype: functools.partial(_allocate, self, shape, dtype))
    buf = ep_tests.make_buffer(monkeypatch)
    checked = []

    def start_range(topk_idx, ptr, n, k, stream):
        checked.append(topk_idx)
        return ep_tests.cpu_range_of(topk_idx)

    def wait_host_counts(seq, n):       # (named: the recorded sequence shows it as 'wait')
        sent = checked[-1] >= 0
        return R * int(sent.any(1).sum()), R * int(sent.sum()), [1] * n
    monkeypatch.setattr(buf._ep, '_start_range', start_range)
    monkeypatch.setattr(buf._ep, '_wait_host_counts', wait_host_counts)
    return buf


def masked(idx, rows: int):
    """`idx` with the top-k ids of its first `rows` tokens set to -1 (a CPU-sync dispatch then receives fewer)."""
    idx = idx.clone()
    idx[:rows] = -1
    return idx


def assert_launches_back_to_back(seen, num_launches):
    """Every call before the first launch, the launches consecutive, no allocation or view after them."""
    first = seen.index('launch')
    last = len(seen) - 1 - seen[::-1].index('launch')
    assert seen[first:last + 1] == ['launch'] * num_launches, seen
    after = seen[last + 1:]
    assert not {'alloc', 'view', 'as_strided', 'patch()', 'cupy_views()', 'allocate_x()'} & set(after), after
    assert 'alloc' in seen[:first] and 'as_strided' in seen[:first], seen


@pytest.mark.parametrize('structure, env, num_launches', [
    ('one launch', {}, 2),
    ('send + receive', {'DEEPEP_CUPY_EP_DISPATCH_OVERLAP': '0'}, 3),
    ('fused', {'DEEPEP_CUPY_EP_FUSED_NOTIFY': '1'}, 1),
])
@pytest.mark.parametrize('fp8, tma', [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize('carved', [True, False])
def test_no_sync_dispatch_prepares_everything_then_launches_back_to_back(monkeypatch, structure, env, num_launches,
                                                                         fp8, tma, carved):
    """Also with worst-case outputs too large to carve (`carved` False: recv_x and recv_sf are allocations of their
    own, made before the first launch too; the lean path `run_no_sync` with `call_patch_x` where it applies)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if not carved:
        monkeypatch.setattr(ep_bound, 'CARVED_RECV_MAX_BYTES', 0)
    x, idx, w = ep_tests.make_inputs()
    xin = (x.to(torch.float8_e4m3fn), torch.ones(M, 2)) if fp8 else x
    buf = make_buffer(monkeypatch)
    # the workspace, recv_x and recv_sf in one allocation; not carved: recv_x's and recv_sf's own after it
    allocs = 1 if carved else 2 + fp8
    for _ in range(3):           # the first call binds; the bound ones must keep the order too
        buf.launches.clear()
        out, seen = record_host_calls(lambda: buf.dispatch(xin, idx, w, num_experts=E, num_sms=4,
                                                           do_cpu_sync=False, use_tma_aligned_col_major_sf=tma))
        assert len(buf.launches) == num_launches
        assert_launches_back_to_back(seen, num_launches)
        assert seen.count('alloc') == allocs, seen
    (b,) = buf._ep._bound.values()
    if structure == 'fused':
        assert b.fused
    if structure in ('one launch', 'fused'):        # (the lean paths: no separate send launch)
        assert b.run is ep_lean.run_no_sync and (b.call_patch_x is None) == carved
    # Cached with the handle: the send (if any) and the receive back to back after the one allocation.
    cached = 2 if structure == 'send + receive' else 1
    buf.launches.clear()
    _, seen = record_host_calls(lambda: buf.dispatch(xin, handle=out[3], use_tma_aligned_col_major_sf=tma))
    assert len(buf.launches) == cached
    assert_launches_back_to_back(seen, cached)
    assert seen.count('alloc') == allocs, seen


@pytest.mark.parametrize('carved', [True, False])
def test_cpu_sync_dispatch_waits_for_the_counts_between_send_and_receive(monkeypatch, carved):
    """The workspace, the notify, the send, the wait for the counts, the receive: its outputs are allocated after the
    wait, or (lean path, outputs carved, once two calls in a row had the same sizes) before it for the last call's
    sizes; kept when the counts repeat them (a hit: nothing but the receive's launch after the wait), else dropped
    before the right ones are allocated (a miss; the next call then does not speculate). Outputs too large to carve
    (recv_x an allocation of its own) are never speculated."""
    if not carved:
        monkeypatch.setattr(ep_bound, 'CARVED_RECV_MAX_BYTES', 0)
    x, idx, w = ep_tests.make_inputs()
    buf = make_buffer(monkeypatch)
    live = []           # per allocation: the earlier allocations still alive then
    made = []

    def allocate(carver, shape, dtype):
        live.append(sum(r() is not None for r in made))
        t = carver.empty(shape, dtype)
        made.append(weakref.ref(t))
        return t
    monkeypatch.setattr(interop.Carver, 'allocator',
                        lambda self, shape, dtype: functools.partial(allocate, self, shape, dtype))
    monkeypatch.setitem(ALLOC_CODES, allocate.__code__, 'alloc')
    fewer = masked(idx, 5)
    # (the first call is the general `__call__`'s, the second the lean path's first: no sizes met yet; 'repeat': the
    # same sizes as the call before, which did not speculate: the next one will)
    calls = ['first', 'learn', 'repeat', 'hit', 'miss', 'repeat', 'hit', 'miss', 'repeat', 'hit']
    for what, ids in zip(calls, (idx, idx, idx, idx, fewer, fewer, fewer, idx, idx, idx)):
        made.clear()
        live.clear()
        out, seen = record_host_calls(lambda ids=ids: buf.dispatch(x, ids, w, num_experts=E, num_sms=4))
        assert out[3].num_recv_tokens == R * (M - 5 * (ids is fewer)), what
        order = [s for s in seen if s in ('launch', 'alloc', 'wait_host_counts()')]
        if not carved:      # (the outputs' allocation, then recv_x's own, after the wait)
            expect = ['wait_host_counts()', 'alloc', 'alloc']
        elif what in ('first', 'learn', 'repeat'):
            expect = ['wait_host_counts()', 'alloc']
        else:
            expect = ['alloc', 'wait_host_counts()'] + ['alloc'] * (what == 'miss')
        assert order == ['alloc', 'launch', 'launch'] + expect + ['launch'], (what, seen)
        if carved and what == 'miss':       # the speculated group is gone when the right one is allocated
            assert live == [0, 1, 1], live
    (b,) = buf._ep._bound.values()
    assert b.run is ep_lean.run_cpu_sync


def test_cpu_sync_dispatch_does_not_ask_whether_its_stream_captures(monkeypatch):
    """A CPU-sync dispatch cannot be captured into a CUDA graph (its host waits for what its kernels wrote): the lean
    path leaves through `StreamOrder.leave(..., captured=False)`, which records the mark behind the receive as not
    captured without asking the stream (a cached dispatch, which a graph may capture, asks)."""
    asked = []
    monkeypatch.setattr(fakes.FakeStream, 'is_capturing', lambda self: asked.append(self.name) or False)
    x, idx, w = ep_tests.make_inputs()
    buf = make_buffer(monkeypatch)
    out = buf.dispatch(x, idx, w, num_experts=E)
    buf.dispatch(x, handle=out[3])
    order = buf._ep._order
    for _ in range(2):      # (the lean path's first call, then a speculated one)
        order._mark_captured, order._marked = True, False       # (as after a captured call)
        asked.clear()
        buf.dispatch(x, idx, w, num_experts=E)
        assert asked == [] and order._marked and not order._mark_captured
    (b,) = [v for v in buf._ep._bound.values() if not v.cached]
    assert b.run is ep_lean.run_cpu_sync
    buf.dispatch(x, handle=out[3])
    assert asked == ['current']


def _outputs(buf, xin, idx, w, **kw):
    out = buf.dispatch(xin, idx, w, num_experts=E, num_sms=4, **kw)
    recv = [e for e in buf.launches if 'recv_x' in e.args][-1]
    return out, recv


def _span(t):
    """[first byte, end) of what a view reaches."""
    end = t.data_ptr() + t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
    return t.data_ptr(), end


@pytest.mark.parametrize('mode', ['no-sync', 'cpu-sync', 'cached', 'expand'])
@pytest.mark.parametrize('fp8, tma', [(False, False), (True, False), (True, True)])
def test_small_recv_x_is_carved_like_an_allocation_of_its_own(monkeypatch, mode, fp8, tma):
    x, idx, w = ep_tests.make_inputs()
    xin = (x.to(torch.float8_e4m3fn), torch.ones(M, 2)) if fp8 else x
    kw = dict(use_tma_aligned_col_major_sf=tma)
    if mode != 'cpu-sync':
        kw['do_cpu_sync'] = False
    if mode == 'expand':
        kw.update(do_expand=True, expert_alignment=4)
    results, carve = {}, ep_bound.CARVED_RECV_MAX_BYTES
    for limit in (carve, 0):       # carved, then separate allocations
        monkeypatch.setattr(ep_bound, 'CARVED_RECV_MAX_BYTES', limit)
        buf = make_buffer(monkeypatch)
        out, recv = _outputs(buf, xin, idx.clone(), w.clone(), **kw)
        if mode == 'cached':
            buf.launches.clear()
            out = buf.dispatch(xin, handle=out[3], use_tma_aligned_col_major_sf=tma)
            recv = [e for e in buf.launches if 'recv_x' in e.args][-1]
        results[limit] = out, recv
    (carved, recv_c), (alone, recv_a) = results[carve], results[0]
    pairs = [(carved[0][0], alone[0][0]), (carved[0][1], alone[0][1])] if fp8 else [(carved[0], alone[0])]
    for c, a in pairs + [(carved[1], alone[1]), (carved[2], alone[2])]:
        if a is None:
            assert c is None
            continue
        assert (c.shape, c.stride(), c.dtype, c.is_contiguous()) == (a.shape, a.stride(), a.dtype, a.is_contiguous())
    pointers = {'recv_x', 'recv_sf', 'recv_topk_idx', 'recv_topk_weights', 'recv_src_metadata', 'recv_src_idx', 'x',
                'sf', 'topk_idx', 'topk_weights', 'send_pos', 'send_expert_pos', 'token_of_slot', 'send_count',
                'recv_layout'}
    assert {k: v for k, v in recv_c.args.items() if k not in pointers} == \
        {k: v for k, v in recv_a.args.items() if k not in pointers}
    recv_x, recv_sf = carved[0] if fp8 else (carved[0], None)
    handle = carved[3]
    group = handle.metadata_owner        # the small outputs' allocation (no-sync: the workspace's)
    if mode == 'no-sync' or mode == 'expand':
        assert group is handle.workspace
    assert recv_c.args['recv_x'] == recv_x.data_ptr()
    assert recv_x.untyped_storage().data_ptr() == group.data_ptr()
    assert (recv_x.data_ptr() - group.data_ptr()) % 256 == 0
    alone_x = alone[0][0] if fp8 else alone[0]
    assert alone_x.untyped_storage().data_ptr() != alone[3].metadata_owner.data_ptr()
    views = [recv_x, carved[1], carved[2], handle.recv_src_metadata]
    if recv_sf is not None:
        assert recv_c.args['recv_sf'] == recv_sf.data_ptr()
        assert recv_sf.untyped_storage().data_ptr() == group.data_ptr()
        assert (recv_sf.data_ptr() - group.data_ptr()) % 256 == 0
        if tma:
            assert recv_sf.stride() == (1, ep_tests.ep_plan.align(recv_sf.shape[0], 4))
        views.append(recv_sf)
    if mode in ('no-sync', 'expand'):
        views += [handle.dst_buffer_slot_idx, handle.send_expert_pos, handle.recv_layout, handle.topk_idx]
    spans = sorted(_span(v) for v in views if v is not None)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans       # disjoint
    assert spans[-1][1] <= group.data_ptr() + group.untyped_storage().nbytes()
    assert group.dtype == recv_x.dtype          # the allocation is of recv_x's dtype: recv_x is one as_strided


def test_large_recv_x_stays_an_allocation_of_its_own(monkeypatch):
    x, idx, w = ep_tests.make_inputs()
    recv_bytes = R * M * H * 2
    monkeypatch.setattr(ep_bound, 'CARVED_RECV_MAX_BYTES', recv_bytes - 1)
    buf = make_buffer(monkeypatch)
    (recv_x, _, _, handle, _), seen = record_host_calls(lambda: buf.dispatch(x, idx, w, num_experts=E,
                                                                             do_cpu_sync=False))
    assert seen.count('alloc') == 2
    assert recv_x.untyped_storage().data_ptr() != handle.workspace.data_ptr()
    monkeypatch.setattr(ep_bound, 'CARVED_RECV_MAX_BYTES', recv_bytes)
    buf = make_buffer(monkeypatch)
    (recv_x, _, _, handle, _), seen = record_host_calls(lambda: buf.dispatch(x, idx, w, num_experts=E,
                                                                             do_cpu_sync=False))
    assert seen.count('alloc') == 1
    assert recv_x.untyped_storage().data_ptr() == handle.workspace.data_ptr()


@pytest.mark.parametrize('cpu_sync', [True, False])
def test_odd_sizes_keep_the_allocation_viewable_as_int64(monkeypatch, cpu_sync):
    """Odd receive counts, an odd top-k and one FP8 scale column: the outputs' allocation still has an even number of
    int32 words (recv_topk_idx is an int64 view of it)."""
    x, idx, w = ep_tests.make_inputs()
    idx, w = idx[:, :3].contiguous(), w[:, :3].contiguous()
    xin = (x.to(torch.float8_e4m3fn), torch.ones(M, 1))
    buf = make_buffer(monkeypatch)
    monkeypatch.setattr(buf._ep, '_wait_host_counts', lambda seq, n: (5, 7, [1] * n))
    out = buf.dispatch(xin, idx, w, num_experts=E, do_cpu_sync=cpu_sync)
    rows = 5 if cpu_sync else R * M
    assert out[0][0].shape == (rows, H) and out[0][1].shape == (rows, 1) and out[1].shape == (rows, 3)
    assert out[1].dtype == torch.int64 and out[3].metadata_owner.untyped_storage().nbytes() % 8 == 0



@pytest.mark.parametrize('tma', [False, True])
def test_no_received_rows_still_give_fp8_scales(monkeypatch, tma):
    """A CPU-sync FP8 dispatch that receives no token: recv_x and recv_sf are empty tensors, not None (the carved
    layout once skipped a scale storage of zero words; DeepEP's 0-token-rank cases caught it on the GPU)."""
    x, idx, w = ep_tests.make_inputs()
    xin = (x.to(torch.float8_e4m3fn), torch.ones(M, 2))
    buf = make_buffer(monkeypatch)
    monkeypatch.setattr(buf._ep, '_wait_host_counts', lambda seq, n: (0, 0, [0] * n))
    out = buf.dispatch(xin, idx, w, num_experts=E, do_cpu_sync=True, use_tma_aligned_col_major_sf=tma)
    recv_x, recv_sf = out[0]
    assert recv_x.shape == (0, H) and recv_sf is not None and recv_sf.shape == (0, 2)
    assert recv_sf.dtype == torch.float32 and out[1].shape == (0, K)
    cached = buf.dispatch(xin, handle=out[3])
    assert cached[0][1] is not None and cached[0][1].shape == (0, 2)

@pytest.mark.parametrize('tma', [False, True])
def test_cupy_views_sit_where_the_torch_views_do(monkeypatch, tma):
    """The CuPy path (`patch.cupy_views`, no GPU here: a carver recording its views) carves each output at the byte
    offset, with the shape, dtype and element strides of the torch path's view."""
    from deepep_cupy.features.ep import patch
    x, idx, w = ep_tests.make_inputs()
    xin = (x.to(torch.float8_e4m3fn), torch.ones(M, 1))
    buf = make_buffer(monkeypatch)
    out = buf.dispatch(xin, idx, w, num_experts=E, do_cpu_sync=False, use_tma_aligned_col_major_sf=tma)
    (b,) = buf._ep._bound.values()
    group = out[3].workspace
    torch_views = [out[1], out[2], out[0][0], out[0][1]]

    class Recorder:
        def view(self, base, dtype, shape, word_offset, strides=None):
            return dtype, tuple(shape), 4 * word_offset, strides or interop.contiguous_strides(tuple(shape))
    got = patch.cupy_views(Recorder(), group, b.fixed, 'float8_e4m3fn', 'float32')
    names = {torch.int64: 'int64', torch.float32: 'float32', torch.float8_e4m3fn: 'float8_e4m3fn'}
    for view, (dtype, shape, byte_offset, strides) in zip(torch_views, got):
        assert (names[view.dtype], tuple(view.shape), view.data_ptr() - group.data_ptr(), tuple(view.stride())) == \
            (dtype, shape, byte_offset, tuple(strides))


@pytest.mark.parametrize('env', [{}, {'DEEPEP_CUPY_EP_DISPATCH_OVERLAP': '0'}, {'DEEPEP_CUPY_EP_FUSED_NOTIFY': '1'}])
@pytest.mark.parametrize('fp8', [False, True])
def test_one_patch_of_a_no_sync_dispatch_writes_what_the_block_patches_do(monkeypatch, env, fp8):
    """A no-sync dispatch with recv_x carved patches every launch's pointers with one generated function
    (`BoundDispatch.call_patch`): the same arguments (addresses relative to the workspace) as block by block."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    x, idx, w = ep_tests.make_inputs()
    xin = (x.to(torch.float8_e4m3fn), torch.ones(M, 2)) if fp8 else x
    buf = make_buffer(monkeypatch)
    runs = []
    for one in (True, False):
        buf.launches.clear()
        out = buf.dispatch(xin, idx, w, num_experts=E, num_sms=4, do_cpu_sync=False)
        (b,) = buf._ep._bound.values()
        assert (b.call_patch is not None) == one
        ws, size = out[3].workspace_ptr, out[3].workspace.untyped_storage().nbytes()
        runs.append([(e.name, e.grid, {k: ('ws', v - ws) if type(v) is int and ws <= v < ws + size else v
                                       for k, v in e.args.items()}) for e in buf.launches])
        b.call_patch, b.run = None, ep_bound.BoundDispatch.__call__     # the next call: block by block
    assert runs[0] == runs[1]
    assert any(v[0] == 'ws' for v in runs[0][-1][2].values() if type(v) is tuple)


def _relative(args, bases):
    """A launch's arguments with each address inside one of `bases` ((name, address, bytes)) made (name, offset)."""
    out = {}
    for k, v in args.items():
        for name, base, size in bases:
            if type(v) is int and base <= v < base + size:
                v = (name, v - base)
                break
        out[k] = v
    return out


HANDLE_SLOTS = ('_c', '_origin', 'num_recv_tokens', 'num_expanded_tokens', '_counts', '_meta', '_psum_expert')


@pytest.mark.parametrize('case', ['no-sync', 'no-sync fp8', 'no-sync large', 'no-sync fp8 large',
                                  'no-sync fp8 tma large', 'no-sync fp8 large on comm', 'cached', 'cached expanded',
                                  'cached from cpu-sync', 'cached no handle copy', 'cached large', 'cached fp8 large',
                                  'cpu-sync', 'cpu-sync fp8', 'cpu-sync fp8 tma', 'cpu-sync expanded', 'cpu-sync large',
                                  'cpu-sync fp8 tma large', 'cpu-sync large on comm', 'cpu-sync sizes change',
                                  'cpu-sync fp8 tma sizes change', 'cpu-sync expanded sizes change',
                                  'cpu-sync large sizes change', 'cpu-sync fp8 sizes change on comm',
                                  'cpu-sync async', 'cpu-sync fp8 sizes change async', 'cached async',
                                  'cached fp8 large async'])
def test_lean_paths_match_the_general_call(monkeypatch, case):
    """`BoundDispatch.run`'s lean paths (`run_cached`, `run_no_sync`, `run_cpu_sync`, also for outputs too large to
    carve: 'large', no-sync through `call_patch_x`, the others through `prepare_receive`'s own allocations of recv_x and
    recv_sf) launch what `__call__` launches (every argument; addresses relative to the workspace, the outputs'
    allocation and recv_x's / recv_sf's own; 'on comm': allocated on the comm stream), return outputs of the same
    shapes, strides, dtypes and places, and make a handle with the same slots (they set `EPHandle._new`'s slots
    inline); 'async': the event holds the same tensors. A CPU-sync call speculates that the last call's sizes repeat:
    'sizes change' runs calls whose counts differ from the last ones and repeat them (some tokens' top-k ids masked to
    -1: fewer tokens; then some slots: as many tokens, fewer expanded rows): a miss, a hit after it, a miss back, a
    miss on the expanded count alone, a hit, a miss."""
    large = 'large' in case
    if large:
        monkeypatch.setattr(ep_bound, 'CARVED_RECV_MAX_BYTES', 0)
    if case.endswith('on comm'):    # (no CUDA here: an allocation ordered on a stream is a plain one)
        monkeypatch.setattr(interop, 'torch_stream', lambda ptr: None)
        monkeypatch.setattr(torch.cuda, 'stream', lambda stream: contextlib.nullcontext())
    is_async = case.endswith('async')
    if is_async:        # (no CUDA here: the event is the tensors it would hold)
        monkeypatch.setattr(streams.StreamOrder, 'event', lambda self, kind, record=(), keep=(): keep)
    x, idx, w = ep_tests.make_inputs()
    buf = make_buffer(monkeypatch)
    expand = 'expanded' in case
    xin = (x.to(torch.float8_e4m3fn), torch.ones(M, 2)) if 'fp8' in case else x
    tma = 'tma' in case
    sync = case == 'cached from cpu-sync'
    cached = case.startswith('cached')
    first = buf.dispatch(xin if cached else x, idx, w, num_experts=E, do_cpu_sync=sync, do_expand=expand,
                         do_handle_copy=case != 'cached no handle copy')
    handle = first[3]
    lean_run = ep_lean.run_cached if cached else ep_lean.run_cpu_sync if 'cpu-sync' in case else ep_lean.run_no_sync
    fewer, slots = masked(idx, 5), idx.clone()
    slots[:7, -1] = -1      # (as many tokens received, fewer (token, expert) pairs)
    calls = (fewer, fewer, idx, slots, slots, idx) if 'sizes change' in case else (idx,)

    def call(ids):
        if cached:
            return buf.dispatch(xin, handle=handle, do_expand=expand, async_with_compute_stream=is_async)
        return buf.dispatch(xin, ids, w, num_experts=E, do_cpu_sync='cpu-sync' in case, do_expand=expand,
                            use_tma_aligned_col_major_sf=tma, allocate_on_comm_stream=case.endswith('on comm'),
                            async_with_compute_stream=is_async)
    call(idx)       # binds (and a cached call learns its sizes)
    runs = []
    for lean in (True, False):
        b = [v for v in buf._ep._bound.values() if v.run is not ep_bound.BoundDispatch.__call__ or not lean][-1]
        assert b.run is lean_run
        assert lean_run is not ep_lean.run_no_sync or (b.call_patch_x is not None) == large
        if not lean:
            b.run = ep_bound.BoundDispatch.__call__
        runs.append([])
        for ids in calls:
            buf.launches.clear()
            out = call(ids)
            h = out[3]
            group = h._meta_of[0]
            tensors = [t for t in (out[0] if type(out[0]) is tuple else (out[0],)) + out[1:3]]
            # recv_x's and recv_sf's storage when not carved (each its own allocation, at its start)
            own = [t.untyped_storage() for t in tensors[:2] if t is not None and t.dim() == 2 and
                   t.untyped_storage().data_ptr() != group.untyped_storage().data_ptr()]
            assert len(own) == (('fp8' in case) + 1 if large else 0)
            x0 = xin[0] if type(xin) is tuple else xin
            bases = [('ws', h.workspace_ptr, h.workspace.untyped_storage().nbytes()),
                     ('out', group.data_ptr(), group.untyped_storage().nbytes()),
                     ('x', x0.data_ptr(), x0.untyped_storage().nbytes()),
                     ('ids', ids.data_ptr(), ids.untyped_storage().nbytes())]
            bases += [(f'own{k}', s.data_ptr(), s.nbytes()) for k, s in enumerate(own)]

            def describe(t, bases=bases):
                return t.shape, t.stride(), t.dtype, _relative({0: t.data_ptr()}, bases)[0]
            # (a CPU-sync notify's host_seq counts the calls: the two differ by design)
            runs[-1].append(([(e.name, e.grid, {k: v for k, v in _relative(e.args, bases).items() if k != 'host_seq'})
                              for e in buf.launches],
                             [None if t is None else (t.shape, t.stride(), t.dtype, t.is_contiguous(),
                                                      _relative({0: t.data_ptr()}, bases)[0]) for t in tensors],
                             {s: getattr(h, s) for s in HANDLE_SLOTS}, h._meta_ptr - group.data_ptr(),
                             h.recv_src_metadata.shape, h.topk_idx.shape,
                             [describe(t) for t in out[4]] if is_async else (type(out[4]).__name__, out[4].event)))
        b.run = lean_run
    assert all(r[0] for r in runs[0]) and runs[0] == runs[1]
    if len(calls) > 1:      # (the counts differ as masked)
        sizes = [(r[2]['num_recv_tokens'], r[2]['num_expanded_tokens']) for r in runs[0]]
        fewer_sizes, full, slots_sizes = (R * (M - 5), R * (M - 5) * K), (R * M, R * M * K), (R * M, R * (M * K - 7))
        assert sizes == [fewer_sizes, fewer_sizes, full, slots_sizes, slots_sizes, full]
    if large:       # (the kernel writes recv_x / recv_sf into their own allocations)
        recv_args = runs[0][0][0][-1][2]
        assert recv_args['recv_x'] == ('own0', 0)
        assert recv_args['recv_sf'] == (('own1', 0) if 'fp8' in case else 0)


@pytest.mark.parametrize('shape, dtype', [((3, 5), 'bfloat16'), ((7,), 'int32'), ((2, 4), 'float8_e4m3fn')])
def test_carver_allocator_makes_what_empty_makes(shape, dtype):
    """`Carver.allocator(shape, dtype)` (the lean paths' allocation, a partial of torch.empty) makes what
    `Carver.empty(shape, dtype)` makes: shape, dtype, device; a new array per call."""
    carver = interop.Carver('torch', -1)
    make = carver.allocator(shape, dtype)
    a, b, ref = make(), make(), carver.empty(shape, dtype)
    assert isinstance(make, functools.partial)
    assert (a.shape, a.dtype, a.device) == (ref.shape, ref.dtype, ref.device) == (b.shape, b.dtype, b.device)
    assert a.data_ptr() != b.data_ptr() or a.numel() == 0
