"""The lean host path without a GPU: the CUDA API calls each public call makes (perf/host_path_cpu.py's
`[api]` counts, pinned so that they cannot silently grow), the event pool behind `EventHandle`, the per-type fast
path of `interop.current_stream`, and the per-signature PP plan re-checking what is per call."""

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import fakes
import pytest

from deepep_cupy.runtime import event, interop

ROOT = Path(__file__).resolve().parents[1]

# Per call, at most: kernel launches, allocations, event records + stream waits, events created, record_stream calls.
# 128 tokens, hidden 7168, top-8, 256 experts, one rank (perf/host_path_cpu.py's defaults). Lower a bound when a
# change saves a call; raising one needs a reason in the commit.
PINNED = {
    'dispatch cpu-sync': dict(launch=3, alloc=2, event=1, event_new=0, record_stream=0),
    'dispatch no-sync': dict(launch=1, alloc=1, event=1, event_new=0, record_stream=0),    # (the fused kernel)
    'dispatch cached': dict(launch=1, alloc=1, event=1, event_new=0, record_stream=0),
    'dispatch fp8 no-sync': dict(launch=1, alloc=1, event=1, event_new=0, record_stream=0),
    'combine': dict(launch=1, alloc=1, event=1, event_new=0, record_stream=0),
    'combine weights': dict(launch=1, alloc=2, event=1, event_new=0, record_stream=0),
    # DeepEP V1's Buffer (normal mode) on the same engine: what ElasticBuffer's calls make, nothing more
    'V1 dispatch cpu-sync': dict(launch=3, alloc=2, event=1, event_new=0, record_stream=0),
    'V1 dispatch num_worst_tokens': dict(launch=1, alloc=1, event=1, event_new=0, record_stream=0),
    'V1 dispatch cached': dict(launch=1, alloc=1, event=1, event_new=0, record_stream=0),
    'V1 combine weights': dict(launch=1, alloc=2, event=1, event_new=0, record_stream=0),
    # (its memset of the counts counted with the launches; the counts and is_token_in_rank: one allocation each)
    'V1 get_dispatch_layout': dict(launch=2, alloc=2, event=1, event_new=0, record_stream=0),
    'all_gather 4 x 1 MiB (+ session)': dict(launch=1, alloc=0, event=2, event_new=0, record_stream=4),
    'all_gather 4 x 1 MiB (+ wait)': dict(launch=2, alloc=0, event=2, event_new=0, record_stream=0),
    'reduce_scatter 4 MiB': dict(launch=1, alloc=1, event=3, event_new=0, record_stream=2),
    'reduce_scatter 4 MiB (+ wait)': dict(launch=1, alloc=1, event=4, event_new=0, record_stream=0),
    'all_reduce 4 MiB': dict(launch=1, alloc=0, event=3, event_new=0, record_stream=1),
    'all_reduce 4 MiB (+ wait)': dict(launch=1, alloc=0, event=4, event_new=0, record_stream=0),
    'pp_send 1 MiB': dict(launch=1, alloc=0, event=1, event_new=0, record_stream=0),
    'pp_recv 1 MiB': dict(launch=1, alloc=0, event=1, event_new=0, record_stream=0),
    'engram_fetch 128 x 4': dict(launch=2, alloc=0, event=3, event_new=0, record_stream=1),
    'engram_fetch 128 x 4 (+ hook)': dict(launch=2, alloc=0, event=4, event_new=0, record_stream=0),
    # DeepEP V1's low-latency calls (perf/ll_side_by_side.py's host rows, each step of its chains alone): recv_x, FP8
    # scales and the handle's one allocation (bound.py `HandleLayout`; 8 allocations before, 7 with BF16); the combine's
    # output (2 before: its call word, now the handle's without a hook); the stream order DeepEP's: the comm stream
    # waits for the current one, the current one for it (2 records, 2 waits); hook mode: the current stream only.
    'LL dispatch FP8': dict(launch=1, alloc=3, event=4, event_new=0, record_stream=0),
    'LL dispatch BF16': dict(launch=1, alloc=2, event=4, event_new=0, record_stream=0),
    'LL combine': dict(launch=1, alloc=1, event=4, event_new=0, record_stream=0),
    'LL dispatch send (hook)': dict(launch=1, alloc=3, event=0, event_new=0, record_stream=0),
    'LL dispatch hook()': dict(launch=1, alloc=0, event=0, event_new=0, record_stream=0),
    'LL combine send (hook)': dict(launch=1, alloc=2, event=0, event_new=0, record_stream=0),
    'LL combine hook()': dict(launch=1, alloc=0, event=0, event_new=0, record_stream=0),
}


@pytest.fixture(scope='module')
def api_counts():
    """perf/host_path_cpu.py's counts per case (its own process: it replaces the CUDA layer process-wide)."""
    torch = pytest.importorskip('torch')
    del torch
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / 'perf' / 'host_path_cpu.py'), '--calls', '100', '--json'],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line[len('[json] '):]) for line in proc.stdout.splitlines() if line.startswith('[json] ')]
    return {r['case']: r for r in rows}


@pytest.mark.parametrize('case', sorted(PINNED))
def test_api_calls_per_call_do_not_grow(api_counts, case):
    assert case in api_counts, f'perf/host_path_cpu.py printed no case {case!r} (cases: {sorted(api_counts)})'
    got = api_counts[case]
    over = {k: (got[k], bound) for k, bound in PINNED[case].items() if got[k] > bound + 1e-9}
    assert not over, f'{case}: per-call CUDA API calls above their pinned bounds (got, bound): {over}'


def test_no_public_call_creates_an_event(api_counts):
    made = {case: r['event_new'] for case, r in api_counts.items() if r['event_new']}
    assert not made, f'calls that create a CUDA event per call (the pool should serve them): {made}'


# Python work per call (`--trace` bytecodes; deterministic for one CPython version: counted on 3.11, the CI's) of the EP
# cases, pinned like the API counts: lower a bound when a change saves work, raising one needs a reason. Issue #11 took
# them from (895 cached, 939 no-sync, 1018 fp8 no-sync, 1399 cpu-sync, 490 combine) to these. The cached bound was
# 540 (535) until the cached and CPU-sync lean paths shared their receive (`lean.finish`, 568: the call and the views
# of any layout; a cached size whose recv_x is not carved no longer takes the general call), which took the CPU-sync
# dispatch from 1204 to 1017 (its host work after the counts from 481 to about 340); the range kernel per top-k
# remembered: 972; the receive's input pointers patched while the GPU counts (after the counts: 306): 992. The
# receive's outputs and handle prepared before the wait for the last call's sizes (`lean.prepare_receive`, speculated;
# `finish` split into it and the launch / event of each path) moved the CPU-sync dispatch's work after the counts from
# 306 bytecodes (7 C calls) to 90 (none: the receive's launch and the event), its total staying at 960; the cached
# dispatch, sharing `prepare_receive`, went from 568 to 564.
PINNED_BYTECODES = {'dispatch cached': 570, 'dispatch no-sync': 630, 'dispatch fp8 no-sync': 700,
                    'dispatch cpu-sync': 980, 'combine': 450}
# A CPU-sync dispatch's bytecodes after the host has the counts (`--trace`'s `after_counts`: its host time beyond the
# notify kernel, the goal of 25 us on the GPU host; 306 before the speculated receive, 90 with it), at most:
# a repeated size (perf/host_path_cpu.py's calls repeat theirs). 100 -> 104: the counts' numpy copy left the wait
# (`EP._wait_host_counts`) for after the receive's launch (102): the same work, no longer between the counts' arrival
# and the launch.
PINNED_AFTER_COUNTS = {'dispatch cpu-sync': 104}
# Of those, the bytecodes before the receive's launch (`--trace`'s `to_launch`: what the GPU waits for between the
# counts and the receive), at most.
PINNED_TO_LAUNCH = {'dispatch cpu-sync': 45}

# DeepEP V1's Buffer (normal mode, the same 128 tokens): bytecodes per call, pinned like V2's. Through the general
# `BoundDispatch.__call__` they were 2350 (CPU-sync, 415 of them between the counts and the receive's launch, where
# V2's lean path has 39), 1974 (num_worst_tokens), 695 (cached), 607 (combine with weights); the V1 lean paths
# (features/ep/lean.py `run_cpu_sync_v1`, `run_no_sync_v1`: V1's matrices' pointers in the generated patchers, its
# views after the launches) and the adapter's per-call checks took them to 1646 (39 before the launch), 1226, 677,
# 589. The adapter's per-signature entries (v1/normal.py `NormalMode.lean_dispatch`: a repeated dispatch signature
# runs its EP bound dispatch without a second key in `EP.dispatch`; the handle made without `LegacyHandle.__new__`;
# the Buffer's checks where they can act; the CPU-sync call's views of the workspace while the GPU counts) took them
# to 1290 (294 after the counts, from 325), 857, 643, 562; get_dispatch_layout, checked and bound once per signature
# (v1/kernels/layout.py `DispatchLayout.run`), from 912 to 284.
PINNED_BYTECODES_V1 = {'V1 dispatch cpu-sync': 1240, 'V1 dispatch num_worst_tokens': 800, 'V1 dispatch cached': 620,
                       'V1 combine weights': 540, 'V1 get_dispatch_layout': 295}
PINNED_TO_LAUNCH_V1 = {'V1 dispatch cpu-sync': 45}
PINNED_AFTER_COUNTS_V1 = {'V1 dispatch cpu-sync': 245}
# C calls per call (torch ops among them: on the GPU host the costlier part), at most: 34, 26, 12, 14, 17 before.
# Beyond ElasticBuffer's same call V1 makes the handle's five tensors (views) and, without a carved int32 workspace, an
# int32 view of it (or of the outputs' allocation), and the per-expert list.
PINNED_C_CALLS_V1 = {'V1 dispatch cpu-sync': 28, 'V1 dispatch num_worst_tokens': 22, 'V1 dispatch cached': 9,
                     'V1 combine weights': 11, 'V1 get_dispatch_layout': 7}
# The adapter's own bytecodes per call beyond ElasticBuffer's same call on the same engine (issue: V1 normal mode
# within 5% of ElasticBuffer): (V1 case, V2 case) -> at most. 669, 613, 101, 94 before the entries; 316, 247, 75, 70
# with them (what is left: V1's arguments and signature, its handle and outputs, the Buffer's checks).
PINNED_V1_OVER_V2 = {('V1 dispatch cpu-sync', 'dispatch cpu-sync'): 255,
                     ('V1 dispatch num_worst_tokens', 'dispatch no-sync'): 180,
                     ('V1 dispatch cached', 'dispatch cached'): 45, ('V1 combine weights', 'combine weights'): 40}


# DeepEP V1's low-latency calls (128 tokens, hidden 7168, top-8, 256 experts, one rank): bytecodes per call, pinned like
# V2's. Through the planner, parameter dictionaries and a packed launch per call they were 3976 (FP8 dispatch), 3920
# (BF16), 3171 (combine), 6298 (dispatch send with a hook: a second packed launch, the receive's), 75 (its hook()),
# 5122 (combine send with a hook), 75 (its hook()); the bound calls (features/ll/bound.py: a signature checked and
# bound once, a generated patch of the pointers per call, receive blocks reused once their hook ran) took them to
# 445, 429, 385, 511, 50, 454, 50.
PINNED_BYTECODES_LL = {'LL dispatch FP8': 460, 'LL dispatch BF16': 445, 'LL combine': 400,
                       'LL dispatch send (hook)': 525, 'LL dispatch hook()': 60, 'LL combine send (hook)': 475,
                       'LL combine hook()': 60}


# The same 128-token calls on perf/ep_profile.py's buffer (num_max_tokens_per_rank 4096: a no-sync dispatch's
# worst-case recv_x, 4096 x 7168 BF16, is too large to carve, so it is an allocation of its own beside the workspace's;
# features/ep/lean.py's `run_no_sync` through `call_patch_x`, 916 / 995 bytecodes through the general call before):
# bytecodes and allocations per call.
PINNED_BYTECODES_4096 = {'dispatch cached': 570, 'dispatch no-sync': 640, 'dispatch fp8 no-sync': 710,
                         'dispatch cpu-sync': 980}
PINNED_ALLOCS_4096 = {'dispatch cached': 1, 'dispatch no-sync': 2, 'dispatch fp8 no-sync': 3}


def _traced_rows(*extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / 'perf' / 'host_path_cpu.py'), '--calls', '50', '--trace',
                           '--json', *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r['case']: r for r in (json.loads(line[len('[json] '):]) for line in proc.stdout.splitlines()
                                   if line.startswith('[json] '))}


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason='bytecode counts are pinned for CPython 3.11')
def test_ep_python_work_per_call_does_not_grow():
    pytest.importorskip('torch')
    rows = _traced_rows('--only', ','.join(PINNED_BYTECODES))
    over = {case: (rows[case]['opcodes'], bound) for case, bound in PINNED_BYTECODES.items()
            if rows[case]['opcodes'] > bound}
    assert not over, f'bytecodes per call above their pinned bounds (got, bound): {over}'
    _assert_after_counts(rows)


def _assert_after_counts(rows, after=PINNED_AFTER_COUNTS, to_launch=PINNED_TO_LAUNCH):
    over = {case: (rows[case]['after_counts'], bound) for case, bound in after.items()
            if not 0 < rows[case]['after_counts'] <= bound}
    assert not over, f'bytecodes after the counts per call outside (0, pinned bound] (got, bound): {over}'
    over = {case: (rows[case]['to_launch'], bound) for case, bound in to_launch.items()
            if not 0 < rows[case]['to_launch'] <= bound}
    assert not over, f'bytecodes between the counts and the receive\'s launch outside (0, pinned bound]: {over}'


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason='bytecode counts are pinned for CPython 3.11')
def test_v1_python_work_per_call_does_not_grow():
    pytest.importorskip('torch')
    rows = _traced_rows('--only', 'V1 ,' + ','.join(v2 for _, v2 in PINNED_V1_OVER_V2))
    over = {case: (rows[case]['opcodes'], bound) for case, bound in PINNED_BYTECODES_V1.items()
            if rows[case]['opcodes'] > bound}
    assert not over, f'V1 bytecodes per call above their pinned bounds (got, bound): {over}'
    _assert_after_counts(rows, PINNED_AFTER_COUNTS_V1, PINNED_TO_LAUNCH_V1)
    over = {case: (rows[case]['c_calls'], bound) for case, bound in PINNED_C_CALLS_V1.items()
            if rows[case]['c_calls'] > bound}
    assert not over, f'V1 C calls per call above their pinned bounds (got, bound): {over}'
    over = {pair: (rows[pair[0]]['opcodes'] - rows[pair[1]]['opcodes'], bound)
            for pair, bound in PINNED_V1_OVER_V2.items() if rows[pair[0]]['opcodes'] - rows[pair[1]]['opcodes'] > bound}
    assert not over, f'V1 bytecodes per call beyond ElasticBuffer\'s same call above their bounds (got, bound): {over}'


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason='bytecode counts are pinned for CPython 3.11')
def test_ll_python_work_per_call_does_not_grow():
    pytest.importorskip('torch')
    rows = _traced_rows('--only', 'LL ')
    assert set(rows) == set(PINNED_BYTECODES_LL), sorted(rows)
    over = {case: (rows[case]['opcodes'], bound) for case, bound in PINNED_BYTECODES_LL.items()
            if rows[case]['opcodes'] > bound}
    assert not over, f'low-latency bytecodes per call above their pinned bounds (got, bound): {over}'


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason='bytecode counts are pinned for CPython 3.11')
def test_ep_python_work_per_call_on_a_large_buffer_does_not_grow():
    pytest.importorskip('torch')
    rows = _traced_rows('--buffer-tokens', '4096', '--only', ','.join(PINNED_BYTECODES_4096))
    over = {case: (rows[case]['opcodes'], bound) for case, bound in PINNED_BYTECODES_4096.items()
            if rows[case]['opcodes'] > bound}
    assert not over, f'bytecodes per call (4096-token buffer) above their pinned bounds (got, bound): {over}'
    _assert_after_counts(rows)
    over = {case: (rows[case]['alloc'], bound) for case, bound in PINNED_ALLOCS_4096.items()
            if rows[case]['alloc'] > bound + 1e-9}
    assert not over, f'allocations per call (4096-token buffer) above their pinned bounds (got, bound): {over}'


# ---- the event pool ----------------------------------------------------------------------------------------------
class _Event:
    made = 0

    def __init__(self):
        _Event.made += 1
        self.records = []

    def record(self, stream=None):
        self.records.append(stream.name)


@pytest.fixture()
def pool(monkeypatch):
    device = {'now': 0}
    _Event.made = 0
    monkeypatch.setattr(event, '_FREE_EVENTS', {})
    monkeypatch.setattr(event, '_new_event', _Event)
    monkeypatch.setattr(event, '_current_device', lambda: device['now'])
    return device


def test_event_handles_reuse_the_events_of_dropped_handles_of_their_stream(pool):
    s, t = fakes.FakeStream('s'), fakes.FakeStream('t')
    h = event.EventHandle(s)
    first = h.event
    assert first.records == ['s'] and _Event.made == 1
    del h
    h = event.EventHandle(s)
    assert h.event is first and first.records == ['s', 's'] and _Event.made == 1      # recorded again
    held = event.EventHandle(s)
    assert held.event is not first and _Event.made == 2        # a live handle's event is never shared
    other = event.EventHandle(t)
    assert other.event not in (first, held.event) and _Event.made == 3      # another stream: its own events
    del other
    pool['now'] = 1
    on_device_1 = event.EventHandle(t)
    assert _Event.made == 4 and on_device_1.event.records == ['t']      # same stream handle, another device
    del h, held, on_device_1
    gc.collect()
    assert sorted(len(v) for v in event._FREE_EVENTS.values()) == [1, 1, 2]


def test_event_pool_is_bounded_and_tolerates_handles_made_without_init(pool):
    s = fakes.FakeStream('s')
    handles = [event.EventHandle(s) for _ in range(3 * event._MAX_FREE_PER_STREAM)]
    del handles
    gc.collect()
    assert [len(v) for v in event._FREE_EVENTS.values()] == [event._MAX_FREE_PER_STREAM]
    bare = event.EventHandle.__new__(event.EventHandle)
    bare.stream_wait = lambda stream: None        # (tests set attributes on bare handles)
    del bare                                    # no pool key: nothing returned, no error
    made = _Event.made
    ev = event.EventOverlap(event.EventHandle(s))
    assert _Event.made == made and len(event._FREE_EVENTS[(s.ptr, 0)]) == event._MAX_FREE_PER_STREAM - 1
    assert ev.event.event.records == ['s', 's']     # a pooled event, recorded again


# ---- interop.current_stream's fast path ------------------------------------------------------------------------------
def test_current_stream_learns_a_fast_path_per_array_type(monkeypatch):
    torch = pytest.importorskip('torch')
    handles = {'cuda:0': 7, 'cuda:1': 9}
    monkeypatch.setattr(interop, '_CURRENT_STREAM_OF', {})
    monkeypatch.setattr(interop, '_EXTERNAL_STREAMS', {})
    monkeypatch.setattr(interop, 'external_stream', lambda h: interop._EXTERNAL_STREAMS.setdefault(h, ('stream', h)))
    monkeypatch.setattr(torch._C, '_cuda_getCurrentRawStream', lambda d: handles[f'cuda:{d}'], raising=False)
    monkeypatch.setattr(torch._C, '_cuda_getDevice', lambda: 1, raising=False)
    x = torch.zeros(4)              # a CPU tensor: the current device's stream
    assert interop.current_stream(x) == ('stream', 9)
    assert interop._CURRENT_STREAM_OF[torch.Tensor] is not None
    handles['cuda:1'] = 11          # the current stream changed: the fast path asks again
    assert interop.current_stream(x) == ('stream', 11)
    monkeypatch.setattr(torch.Tensor, 'get_device', lambda self: 0)
    assert interop.current_stream(x) == ('stream', 7)       # a tensor on cuda:0: that device's stream


# ---- PP: the plan of a call signature, re-checked per call ----------------------------------------------------------
def test_pp_reuses_a_signatures_plan_and_rechecks_per_call_facts(monkeypatch):
    torch = pytest.importorskip('torch')
    from test_pp_cpu import make_buffer

    from deepep_cupy.buffers.base import WORKSPACE_BYTES
    from deepep_cupy.features.pp import plan as pp_plan
    buf = make_buffer(monkeypatch, num_ranks=4, rank=1)
    buf.pp_set_config(4096, 2)
    pp = buf._pp
    calls = []
    real_plan = pp.plan
    monkeypatch.setattr(pp, 'plan', lambda *a: calls.append(a[0]) or real_plan(*a))
    x = torch.zeros(1024, dtype=torch.uint8)
    buf.pp_send(x, 2)
    buf.pp_send(torch.zeros(1024, dtype=torch.uint8), 2)
    assert calls == [True] and len(buf.launches) == 2 and buf.launches[1][2]['num_bytes'] == 1024
    cached = weakref.ref(x)
    del x
    gc.collect()
    assert cached() is None                     # the remembered plan does not keep the tensor alive
    big = torch.zeros(2048, dtype=torch.uint8)
    with pytest.raises(ValueError, match='16-byte'):
        buf.pp_send(big[1:1025], 2)             # same signature, misaligned address
    with pytest.raises(TypeError, match='previous_event'):
        buf.pp_send(big[:1024], 2, previous_event=object())
    assert calls == [True] and len(buf.launches) == 2
    buf.pp_recv(big[:1024], 2)                  # another direction: planned
    pp.layout = pp_plan.PPLayout(8192, 2, WORKSPACE_BYTES)      # a new layout: planned again
    buf.pp_send(big[:1024], 2)
    assert calls == [True, False, True] and len(buf.launches) == 4
    assert buf.launches[-1][2]['x'] == big.data_ptr()


_GATHER_SCRIPT = r'''
import numpy as np, torch
import host_path_cpu as h
h.install()
buf = h.make_buffer(1, 0, 64 << 20)
ag = buf._agrs_feature()
ag.set_config(16 << 20, 32)
tensors = [torch.zeros(1 << 18) for _ in range(2)]
outs = []
for _ in range(2):                      # the second session's call finds the first one's entry
    ag.create_session()
    *gathered, wait = ag.all_gather(tensors)
    wait()
    outs.append(gathered)
    ag.plan.close()
assert len(ag._gather_entries) == 1, ag._gather_entries
assert all(a is b for a, b in zip(*outs))          # the same output views (one region, one shape)
# A hit still checks this call's pointers: a source in the part of the session area the call writes is refused, before
# anything is reserved or launched; the in-place slot of the same region is taken without a copy.
ag.create_session()
inside = torch.from_numpy(buf.sym.local_view(ag.area_offset + (2 << 20), 1 << 20).view(np.float32))
launches = h.API['launch']
try:
    ag.all_gather([tensors[0], inside])
    raise AssertionError('no ValueError')
except ValueError as e:
    assert 'agrs_get_inplace_tensor in order' in str(e), e
assert ag.plan.used_bytes == 0 and h.API['launch'] == launches and ag._gather_entries
slot = torch.from_numpy(buf.sym.local_view(ag.area_offset, 1 << 20).view(np.float32))
*_, wait = ag.all_gather([slot, tensors[1]])
assert wait._keep_alive == (tensors[1],)            # the in-place source is neither kept nor recorded
ag.plan.close()
# Sources are marked as used on the communication stream only when the handle cannot order their last use: called on
# the stream of the call, nothing; on another stream, or dropped uncalled, each kept (not in-place) source once.
ag.create_session()
del wait                                            # (the handle above, dropped uncalled: its source marked now)
marked = h.API['record_stream']
*_, wait = ag.all_gather(tensors)
wait()
assert h.API['record_stream'] == marked and wait._keep_alive == ()
*_, wait = ag.all_gather(tensors)
same = h.interop.current_stream
h.interop.current_stream = lambda like=None: h.CountingStream('other')
wait()
h.interop.current_stream = same
assert h.API['record_stream'] == marked + 2
slot = torch.from_numpy(buf.sym.local_view(ag.area_offset + ag.plan.used_bytes, 1 << 20).view(np.float32))
*_, wait = ag.all_gather([slot, tensors[0]])
del wait
assert h.API['record_stream'] == marked + 3        # dropped uncalled: the copied source only
ag.plan.close()
ag.set_config(8 << 20, 32)                          # a new plan: the entries of the old one go
assert ag._gather_entries == {}
print('OK')
'''


def test_all_gather_entry_is_reused_and_pointers_checked_per_call():
    """all_gather's per-signature entry (features/agrs/gather_entry.py) with real (CPU) torch tensors, which the
    feature's own CPU tests (fake arrays: no signature) never reach."""
    pytest.importorskip('torch')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / 'perf'), str(ROOT / 'tests')]))
    proc = subprocess.run([sys.executable, '-c', _GATHER_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and 'OK' in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_trace_counts_the_python_work():
    """`--trace` reports the Python work per call (bytecodes, Python and C calls) in the JSON lines."""
    pytest.importorskip('torch')
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / 'perf' / 'host_path_cpu.py'), '--calls', '50', '--trace',
                           '--json', '--only', 'dispatch cached'], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line[len('[json] '):]) for line in proc.stdout.splitlines() if line.startswith('[json] ')]
    assert [r['case'] for r in rows] == ['dispatch cached', 'V1 dispatch cached']
    assert rows[0]['opcodes'] > 100 and rows[0]['py_calls'] >= 5 and rows[0]['c_calls'] >= 1


def test_no_sync_dispatch_launches_back_to_back():
    """A no-sync dispatch prepares every allocation, view and argument patch before its first launch (features/ep/
    bound.py): between its notify and dispatch launches runs only the launch calls' own Python (~30 bytecodes each
    on the direct path), which `--trace` counts as `gap` (it was ~330 bytecodes and an allocation before). With the
    two kernels, as at several ranks (one rank's default is the fused kernel, ONE launch: PINNED above)."""
    pytest.importorskip('torch')
    env = dict(os.environ, PYTHONPATH=str(ROOT), DEEPEP_CUPY_EP_FUSED_NOTIFY='0')
    proc = subprocess.run([sys.executable, str(ROOT / 'perf' / 'host_path_cpu.py'), '--calls', '50', '--trace',
                           '--json', '--only', 'no-sync,num_worst_tokens'], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r['case']: r for r in (json.loads(line[len('[json] '):]) for line in proc.stdout.splitlines()
                                   if line.startswith('[json] '))}
    assert set(rows) == {'dispatch no-sync', 'dispatch fp8 no-sync', 'V1 dispatch num_worst_tokens'}
    for case, r in rows.items():
        assert r['launch'] == 2 and 0 < r['gap'] <= 100, (case, r)


_REDUCE_SCRIPT = r'''
import torch
import host_path_cpu as h
h.install()
buf = h.make_buffer(1, 0, 64 << 20)
ag = buf._agrs_feature()
ag.set_config(8 << 20, 32)
x = torch.zeros(1 << 20)
ev = buf.reduce_scatter(x)
out = ev.wait()
assert out.shape == (1 << 20,) and ev.wait() is None        # the result once, as the hook it replaces
ev.register_hook_after_wait(lambda: 'hook')                 # (a hook may follow the result, none precede it)
assert ev.wait() == 'hook'
ev = buf.reduce_scatter(x)
try:
    ev.register_hook_after_wait(lambda: None)
    raise AssertionError('no ValueError')
except ValueError as e:
    assert 'already registered' in str(e), e
assert ev.current_stream_wait(release_handle=True) is not None and ev.event is None and ev.extra_tensors is None
assert len(ag._reduce_checked) == 1                         # one signature, checked once
((*_, bound, _, _, _, _, rest),) = ag._reduce_checked.values()
area = bound.values()['recv_offset']
assert area == ag.area_offset + (8 << 20) and rest[2] == area
# A hit still checks the address (same signature, off 16 bytes) and the scale, before any launch.
big = torch.zeros((1 << 20) + 4)
launches = h.API['launch']
for bad, kwargs, match in ((big[1:(1 << 20) + 1], {}, '16-byte'), (x, dict(scale=float('nan')), 'scale')):
    try:
        buf.reduce_scatter(bad, **kwargs)
        raise AssertionError('no error')
    except ValueError as e:
        assert match in str(e), e
assert h.API['launch'] == launches
# The tensors used on the communication stream are marked there only when the wait cannot order them: waited on the
# call's stream, nothing; on another stream, or dropped unwaited, x and out (all_reduce: x) once.
marked = h.API['record_stream']
buf.reduce_scatter(x).wait()
buf.all_reduce(x).wait()
assert h.API['record_stream'] == marked
ev = buf.reduce_scatter(x)
same = h.interop.current_stream
h.interop.current_stream = lambda like=None: h.CountingStream('other')
ev.wait()
h.interop.current_stream = same
assert h.API['record_stream'] == marked + 2
buf.reduce_scatter(x)
buf.all_reduce(x)
assert h.API['record_stream'] == marked + 5
# A new session size moves the reduction area: the checked signatures and their launches go with the old one.
ag.set_config(16 << 20, 32)
assert not ag._reduce_checked
buf.reduce_scatter(x).wait()
((*_, bound, _, _, _, _, rest),) = ag._reduce_checked.values()
assert bound.values()['recv_offset'] == ag.area_offset + (16 << 20)
print('OK')
'''


def test_reductions_reuse_checked_signatures_and_track_their_tensors():
    """reduce_scatter / all_reduce with real (CPU) torch tensors (the feature's own CPU tests use fake arrays, which
    have no signature): a signature is checked once, its address and the scale per call; the returned event gives the
    result once and orders the tensors it used without `record_stream` when waited on the call's stream; a new session
    size drops the checked signatures (their reduction area moved)."""
    pytest.importorskip('torch')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / 'perf'), str(ROOT / 'tests')]))
    proc = subprocess.run([sys.executable, '-c', _REDUCE_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and 'OK' in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


# Python work per call of the collectives (perf/host_path_cpu.py --trace: bytecodes executed in deepep_cupy, CPython
# 3.11's instruction set), at most; the goals for them and the counts when they were set (coll6; all_gather and
# engram_fetch: coll7), with a few percent of room. Lower a bound when a change saves work; raising one needs a reason
# in the commit.
BYTECODES = {
    'all_gather 4 x 1 MiB (+ session)': 405,     # 390 (475 before, 864 before that)
    'all_gather 4 x 1 MiB (+ wait)': 430,        # 417 (513 before, 947 before that; goal 430: 25 us on the GPU host)
    'reduce_scatter 4 MiB': 450,                 # 442 (606 before)
    'reduce_scatter 4 MiB (+ wait)': 450,        # 446 (647 before; goal 450)
    'all_reduce 4 MiB': 450,                     # 431 (609 before; goal 450)
    'all_reduce 4 MiB (+ wait)': 450,            # 444 (659 before)
    'pp_send 1 MiB': 310,                        # 297 (496 before; goal 400)
    'pp_recv 1 MiB': 310,                        # 296 (495 before; goal 400)
    'engram_fetch 128 x 4': 568,                 # 546 (574 before, 740 before that; goal 550)
    'engram_fetch 128 x 4 (+ hook)': 581,        # 559 (587 before, 757 before that)
}


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason='bytecode counts are pinned for CPython 3.11')
def test_collectives_python_work_does_not_grow():
    """The bytecodes per call of all_gather, reduce_scatter, all_reduce, pp_send / pp_recv and engram_fetch stay under
    their bounds (deterministic, unlike timings on a loaded machine)."""
    pytest.importorskip('torch')
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / 'perf' / 'host_path_cpu.py'), '--calls', '50', '--trace',
                           '--json', '--only', 'all_gather,reduce_scatter,all_reduce,pp_,engram'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r['case']: r for r in (json.loads(line[len('[json] '):]) for line in proc.stdout.splitlines()
                                   if line.startswith('[json] '))}
    assert set(rows) == set(BYTECODES), sorted(rows)
    over = {case: (rows[case]['opcodes'], bound) for case, bound in BYTECODES.items() if rows[case]['opcodes'] > bound}
    assert not over, f'bytecodes per call above their bounds (got, bound): {over}'
