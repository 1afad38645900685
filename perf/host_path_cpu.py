"""Host time per call of the real API (dispatch / combine, DeepEP V1's normal and low-latency calls, all-gather,
reduce-scatter, all-reduce, PP send/recv, engram fetch) without a GPU: every line of deepep_cupy's Python runs as on
a GPU, only the CUDA calls underneath are replaced (tests/fakes.py's buffer; kernels are real `jit.launch.Kernel`s
that pack their arguments, with a driver whose launch is a no-op; CPU torch tensors; streams and events that do
nothing). The notify and range kernels' fakes write their host-mapped records, so the host's polling runs too.

    PYTHONPATH=. python perf/host_path_cpu.py [--calls 2000] [--tokens 128] [--buffer-tokens 4096] [--ranks 1]
        [--json] [--trace]

What it measures is the Python cost (checks, plans, argument packing, bookkeeping) plus CPU torch's allocations;
it does not see the CUDA API calls themselves (`cuLaunchKernel`, the caching allocator, event records), which the
`[api]` line counts per call instead (launches, allocations, event records and stream waits, events created,
`record_stream` calls; tests/test_host_path_cpu.py pins them). This machine's numbers are a lower bound of the GPU
host's (about 2x slower Python there). `--trace` also counts the Python work per call (bytecodes, Python and C
calls in deepep_cupy's frames): deterministic, so a change's effect shows where the timings of a loaded machine drift;
and the bytecodes between a call's first and last launch (the host gap the GPU sees between its kernels).
The low-latency cases (`LL ...`) are perf/ll_side_by_side.py's host rows, with its arguments; a step of one of its
chains (a hook-mode send, a `hook()`, a combine of the last dispatch's handle) is timed and counted alone, the rest
of its chain run untimed between the calls (`settle`).
"""

import argparse
import ctypes
import json
import os
import struct
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, 'tests')):
    if path not in sys.path:
        sys.path.insert(0, path)

import fakes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from deepep_cupy.jit import launch  # noqa: E402
from deepep_cupy.runtime import interop  # noqa: E402

API = {'launch': 0, 'alloc': 0, 'event': 0, 'event_new': 0, 'record_stream': 0}


class FakeDriver:
    """`cupy_backends.cuda.api.driver` stand-in: launches call the kernel's fake (if any) and count."""

    def __init__(self):
        self.on_launch = {}

    def launchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, args, extra):  # noqa: N802 (cupy's name)
        API['launch'] += 1
        if LAUNCH_MARKS is not None:        # (`traced`: the bytecodes counted so far, at each launch)
            LAUNCH_MARKS.append(TRACE_COUNT['opcodes'])
        hook = self.on_launch.get(fn)
        if hook is not None:
            hook(args)

    def launchCooperativeKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, args):  # noqa: N802
        self.launchKernel(fn, gx, gy, gz, bx, by, bz, smem, stream, args, 0)

    @staticmethod
    def funcSetAttribute(*args):  # noqa: N802
        pass

    @staticmethod
    def occupancyMaxActiveBlocksPerMultiprocessor(*args):  # noqa: N802
        return 1


DRIVER = FakeDriver()
LAUNCH_MARKS = None         # while `traced` runs: a list of the bytecode count at each launch of the current call
TRACE_COUNT = {}
_NEXT_FN = [0x100]


def fake_kernel(spec: launch.KernelSpec, device: int = -1) -> launch.Kernel:
    _NEXT_FN[0] += 1
    k = launch.Kernel(spec, SimpleNamespace(ptr=_NEXT_FN[0]), device)
    k._num_sms = 132
    k.max_active_blocks_per_sm = lambda block, shared_mem=0: 1
    return k


_KERNELS = {}


def fake_load_kernels(specs, defines=None, device=None):
    out = {}
    for s in specs:
        k = _KERNELS.get(s.name)
        if k is None:
            k = _KERNELS[s.name] = fake_kernel(s)
            _install_hook(k)
        out[s.name] = k
    return out


def _field(kernel, name, fmt):
    """Reader of one packed parameter of `kernel` from a launch's `args` (the address of the array of pointers to
    each parameter, as cuLaunchKernel takes it)."""
    i = kernel.spec.param_names.index(name)
    size = struct.calcsize(fmt)

    def read(args):
        address = ctypes.c_uint64.from_address(args + 8 * i).value
        # (C calls only: `ctypes.string_at` is a Python function, which `traced` would count as deepep_cupy's work)
        return struct.unpack(fmt, (ctypes.c_char * size).from_address(address).raw)[0]
    return read


def _install_hook(kernel):
    """Fakes of the kernels whose host-mapped records the host polls: the range kernel writes [seq, lo, hi], notify
    the counts of a dispatch in which every token is received once (worst case)."""
    name = kernel.spec.name
    if 'value_range_kernel' in name:
        host, seq = _field(kernel, 'host_out', '=Q'), _field(kernel, 'seq', '=q')

        def hook(args):
            rec = np.frombuffer((ctypes.c_int64 * 3).from_address(host(args)), np.int64)
            rec[1], rec[2], rec[0] = 0, 1, seq(args)
        DRIVER.on_launch[kernel.function.ptr] = hook
    elif 'notify_dispatch' in name:
        host, seq = _field(kernel, 'host_counts', '=Q'), _field(kernel, 'host_seq', '=i')
        tokens, experts = _field(kernel, 'num_tokens', '=i'), _field(kernel, 'num_experts', '=i')

        def hook(args):
            address = host(args)
            if address:
                n, e = tokens(args), experts(args)
                rec = np.frombuffer((ctypes.c_int32 * (3 + e)).from_address(address), np.int32)
                rec[1], rec[2] = n, n
                rec[3:3 + e] = n // max(1, e)
                rec[0] = seq(args)
        DRIVER.on_launch[kernel.function.ptr] = hook


class CountingEvent(fakes.FakeEvent):
    def record(self, stream=None):
        API['event'] += 1


class CountingStream(fakes.FakeStream):
    def wait_event(self, event):
        API['event'] += 1


def install(monkeypatch_targets=None):
    """Replace the CUDA layer under deepep_cupy (process-wide; this script only)."""
    from deepep_cupy.features.agrs import feature as agrs_feature
    from deepep_cupy.features.engram import feature as engram_feature
    from deepep_cupy.features.ep import kernels as ep_kernels
    from deepep_cupy.features.pp import feature as pp_feature
    from deepep_cupy.runtime import streams
    launch._DRIVER[:] = [DRIVER]
    for module in (launch, ep_kernels, agrs_feature, engram_feature, pp_feature):
        module.load_kernels = fake_load_kernels
    current = CountingStream('current')
    interop.current_stream = lambda like=None: current
    if hasattr(interop, 'stream_getter'):          # (absent before the bound calls: the harness runs on both)
        interop.stream_getter = lambda kind, device: lambda: current

    cache = {}

    def empty(self, shape, dtype, stream=None):
        # A caching allocator's hit: the same tensor for the same request (CPU allocations of a few MiB would cost
        # page faults that CUDA's caching allocator does not have; the [api] line counts the allocations instead).
        API['alloc'] += 1
        key = (tuple(shape) if isinstance(shape, (tuple, list)) else (shape,), dtype)
        t = cache.get(key)
        if t is None:
            t = cache[key] = torch.empty(shape, dtype=getattr(torch, dtype))
        return t
    interop.Allocator.empty = empty
    if hasattr(interop, 'Carver'):
        interop.Carver.empty = empty
        # (a fixed layout's allocation function: the same counted cache hit, without a Python frame of deepep_cupy)
        interop.Carver.allocator = lambda self, shape, dtype: lambda: empty(self, shape, dtype)
    interop.torch_stream = lambda handle: current
    if hasattr(engram_feature.Engram, '_device_arrays'):     # (V2.5's layered engram: the fetch reads two small
        fake = SimpleNamespace(data=SimpleNamespace(ptr=0x100))    # device arrays that CuPy would make)
        engram_feature.Engram._device_arrays = lambda self, layout, sf_rows: {'layers': fake, 'table_bases': fake}
    def record_stream(self, stream):        # CPU tensors: nothing to record; counted (a CUDA-side call on the GPU)
        API['record_stream'] += 1
    torch.Tensor.record_stream = record_stream
    from deepep_cupy.runtime import event as event_module
    if hasattr(event_module, '_new_event'):
        # The real `EventHandle` (its event pool included) over counting events: `event_new` counts the events
        # created (cudaEventCreate), `event` every record and wait.
        def new_event():
            API['event_new'] += 1
            return CountingEvent()
        event_module._new_event = new_event
        event_module._current_device = lambda: 0
        return

    def new_handle(stream=None):        # (before the event pool: every handle made an event)
        # An `EventHandle` (the event a call returns) costs a cudaEventCreate and a record.
        API['event_new'] += 1
        API['event'] += 1
        return fakes.FakeEventHandle(stream)
    streams.EventHandle = new_handle

    def init_handle(self, stream=None):
        API['event_new'] += 1
        API['event'] += 1
        self.event = CountingEvent()
    event_module.EventHandle.__init__ = init_handle


def make_buffer(num_ranks: int, rank: int, num_bytes: int, **attrs):
    buf = fakes.make_buffer(num_ranks, rank, num_bytes, comm=CountingStream('comm'), **attrs)
    hm = buf.host_mapped
    hm.ptr = hm.data.ctypes.data            # kernels' fakes write the records at the address the host polls
    buf.stream_order._enter, buf.stream_order._leave, buf.stream_order._mark = (CountingEvent(), CountingEvent(),
                                                                                 CountingEvent())
    buf._barrier = lambda stream: None
    region = np.zeros(num_bytes, dtype=np.uint8)
    buf.sym.local_view = lambda offset, n: region[offset - buf.data_offset:offset - buf.data_offset + n]
    buf.sym.base = region.ctypes.data - buf.data_offset
    return buf


def _settle(fn):
    """`fn.settle()` (a step of a chain: the rest of the chain, run after each call; `fn.prime()` once first: what
    the step's first call needs), untimed and uncounted; None for a case without one."""
    settle = getattr(fn, 'settle', None)
    if settle is None:
        return None

    def run(what=settle):
        saved = dict(API)
        what()
        API.update(saved)
    run(fn.prime)
    return run


def timed(fn, calls: int):
    """Best µs per call over batches of 50 calls (`calls` in all; the minimum resists other load on the machine),
    and the CUDA API calls per call. A step of a chain (`fn.settle`: the rest of the chain) is timed call by call,
    the rest of its chain run between the calls untimed."""
    settle = _settle(fn)
    for _ in range(min(200, calls)):
        fn()
        if settle is not None:
            settle()
    for key in API:
        API[key] = 0
    per_batch, batch = [], 50
    clock = time.perf_counter
    for _ in range(max(1, calls // batch)):
        if settle is None:
            t0 = clock()
            for _ in range(batch):
                fn()
            per_batch.append((clock() - t0) / batch)
            continue
        spent = 0.0
        for _ in range(batch):
            t0 = clock()
            fn()
            spent += clock() - t0
            settle()
        per_batch.append(spent / batch)
    n = max(1, calls // batch) * batch
    return min(per_batch) * 1e6, {k: v / n for k, v in API.items()}


def traced(fn, calls: int = 200):
    """Python work per call, counted (deterministic, unlike the timings on a loaded machine): bytecode instructions
    executed in deepep_cupy's frames (and the standard library's they call), Python calls and C calls made from them;
    this harness's and tests/fakes.py's frames are not counted (they stand in for CUDA). `gap`: the bytecodes between
    a call's first and last kernel launch (the host gap the GPU sees between them; 0 for one launch). `after_counts`:
    a CPU-sync dispatch's bytecodes after the host has the counts (`EP._wait_host_counts` returned: its host time
    beyond the notify, perf/ep_profile.py's `[host] ... after the host has the counts`; 0 without a wait) and
    `c_after_counts` its C calls then (torch ops, launches, event records: most of that time on the GPU host);
    `to_launch`: of those, the bytecodes before the receive's launch (what the GPU waits for between the counts and
    the receive; the rest runs while the receive does)."""
    global LAUNCH_MARKS
    from deepep_cupy.features.ep.feature import EP
    skip = (os.path.abspath(__file__), os.path.abspath(fakes.__file__))
    count = TRACE_COUNT
    count.clear()
    count.update(opcodes=0, py_calls=0, c_calls=0, gap=0, after_counts=0, c_after_counts=0, to_launch=0)
    real_wait, counted = EP._wait_host_counts, []

    def wait_host_counts(self, *a):       # (this file's frame: not counted)
        out = real_wait(self, *a)
        counted.append((count['opcodes'], count['c_calls']))
        return out

    def tracer(frame, event, arg):
        if frame.f_code.co_filename in skip:
            return None
        frame.f_trace_opcodes = True
        if event == 'opcode':
            count['opcodes'] += 1
        elif event == 'call':
            count['py_calls'] += 1
        return tracer

    def profiler(frame, event, arg):
        if event == 'c_call' and frame.f_code.co_filename not in skip:
            count['c_calls'] += 1
    settle = _settle(fn)
    for _ in range(min(200, calls)):
        fn()
        if settle is not None:
            settle()
    LAUNCH_MARKS = marks = []
    EP._wait_host_counts = wait_host_counts
    sys.settrace(tracer)
    sys.setprofile(profiler)
    try:
        for _ in range(calls):
            marks.clear()
            counted.clear()
            fn()
            if marks:
                count['gap'] += marks[-1] - marks[0]
            if counted:
                count['after_counts'] += count['opcodes'] - counted[-1][0]
                count['c_after_counts'] += count['c_calls'] - counted[-1][1]
                count['to_launch'] += next((m for m in marks if m >= counted[-1][0]), count['opcodes']) - \
                    counted[-1][0]
            if settle is not None:      # (untraced)
                sys.settrace(None)
                sys.setprofile(None)
                settle()
                sys.settrace(tracer)
                sys.setprofile(profiler)
    finally:
        sys.settrace(None)
        sys.setprofile(None)
        LAUNCH_MARKS = None
        EP._wait_host_counts = real_wait
    return {k: v / calls for k, v in count.items()}


def ep_cases(args):
    # (--buffer-tokens: a buffer for more tokens than the calls send, e.g. perf/ep_profile.py's 4096, whose no-sync
    # worst-case recv_x is too large to carve out of the workspace's allocation)
    buf = make_buffer(args.ranks, 0, 1 << 30, num_max_tokens_per_rank=args.buffer_tokens or args.tokens,
                      hidden=args.hidden, num_topk=args.topk)
    g = torch.Generator().manual_seed(0)
    n = args.tokens
    x = torch.randn(n, args.hidden, generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand(n, args.experts, generator=g), args.topk).indices
    w = torch.rand(n, args.topk, generator=g)
    x8 = (x.to(torch.float8_e4m3fn), torch.ones(n, args.hidden // 128))
    out = buf.dispatch(x, idx, w, num_experts=args.experts, num_sms=22)
    handle = out[3]
    y = torch.zeros(handle.num_rows, args.hidden, dtype=torch.bfloat16)
    return {
        'dispatch cpu-sync': lambda: buf.dispatch(x, idx, w, num_experts=args.experts, num_sms=22),
        'dispatch no-sync': lambda: buf.dispatch(x, idx, w, num_experts=args.experts, num_sms=22, do_cpu_sync=False),
        'dispatch cached': lambda: buf.dispatch(x, handle=handle),
        'dispatch fp8 no-sync': lambda: buf.dispatch(x8, idx, w, num_experts=args.experts, num_sms=22,
                                                     do_cpu_sync=False),
        'combine': lambda: buf.combine(y, handle),
        'combine weights': lambda: buf.combine(y, handle, topk_weights=out[2]),
    }


def v1_cases(args):
    """DeepEP V1's `Buffer` (normal mode: its engine laid out by the first dispatch) with the same tokens; the
    layout tensors made once, as V1 callers get them from `get_dispatch_layout`, which is a case too (its memset of
    the counts, a CUDA call, is counted with the launches)."""
    try:
        from deepep_cupy.v1.buffer import Buffer
        from deepep_cupy.v1.kernels import layout as v1_layout
        from deepep_cupy.v1.normal import NormalEngine, NormalMode
    except ImportError:                 # (absent before the V1 Buffer: the harness runs on both)
        return {}

    def memset(ptr, num_bytes, stream):     # (cudaMemsetAsync)
        API['launch'] += 1
    v1_layout._memset_async = memset
    R, E = args.ranks, args.experts

    def make_engine(num_bytes):
        eng = NormalEngine.__new__(NormalEngine)
        eng.__dict__.update(make_buffer(R, 0, num_bytes).__dict__)
        eng.__dict__.update(_nvlink_gbs=450.0, ep=None, geometry=(0, 0, 0))
        eng.barrier = lambda **kw: None
        return eng
    order = fakes.stream_order(CountingStream('comm'))
    order._enter, order._leave, order._mark = CountingEvent(), CountingEvent(), CountingEvent()
    buf = Buffer.__new__(Buffer)
    buf.__dict__.update(
        _destroyed=False, group=None, rank=0, group_size=R, num_nvl_bytes=1 << 30, num_rdma_bytes=0,
        low_latency_mode=False, explicitly_destroy=True, enable_shrink=False, device=-1, _stream=None, _order=order,
        _configs={}, _ll=None, _layout=v1_layout.DispatchLayout(-1, kernel=fake_kernel(v1_layout.LAYOUT_SPEC)),
        _normal=NormalMode(R, -1, 1 << 30, make_engine))
    g = torch.Generator().manual_seed(0)
    n = args.tokens
    x = torch.randn(n, args.hidden, generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand(n, E, generator=g), args.topk).indices
    w = torch.rand(n, args.topk, generator=g)
    owner = idx // (E // R)
    in_rank = torch.stack([(owner == r).any(1) for r in range(R)], 1)
    layout = dict(num_tokens_per_rank=in_rank.sum(0).int(), is_token_in_rank=in_rank,
                  num_tokens_per_expert=torch.stack([(idx == e).sum() for e in range(E)]).int())
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    return {
        'V1 dispatch cpu-sync': lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout),
        'V1 dispatch num_worst_tokens': lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                             num_worst_tokens=R * n, **layout),
        'V1 dispatch cached': lambda: buf.dispatch(x, handle=handle),
        'V1 combine weights': lambda: buf.combine(recv_x, handle, topk_weights=recv_w),
        'V1 get_dispatch_layout': lambda: buf.get_dispatch_layout(idx, E),
    }


def ll_cases(args):
    """DeepEP V1's `Buffer` in low-latency mode (its engine laid out by the first call, on a fake `BufferBase` sized by
    `get_low_latency_rdma_size_hint`): the calls perf/ll_side_by_side.py's host rows time, with its arguments and its
    chains, each step timed alone (the case's `settle`, untimed, runs the rest of the chain): FP8 / BF16 dispatch;
    combine of the last FP8 dispatch's handle; with `return_recv_hook=True` the dispatch's send, its `hook()`, the
    combine's send (of that dispatch's handle) and its `hook()`."""
    try:
        from deepep_cupy.features.ll import feature as ll_feature
        from deepep_cupy.v1.buffer import Buffer
        from deepep_cupy.v1.low_latency import LowLatencyMode
    except ImportError:                 # (absent before the V1 Buffer: the harness runs on both)
        return {}
    ll_feature.LowLatencyEngine._events = lambda self: (CountingEvent(), CountingEvent())
    R, E, M, H = args.ranks, args.experts, args.tokens, args.hidden
    L = E // R
    buf = Buffer.__new__(Buffer)
    buf.__dict__.update(
        _destroyed=False, group=None, rank=0, group_size=R, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=True,
        explicitly_destroy=True, enable_shrink=False, device=-1, _stream=None, _configs={}, _normal=None,
        _layout=None, _ll=LowLatencyMode(R, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), False,
                                         lambda num_bytes: make_buffer(R, 0, num_bytes)))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand(M, E, generator=g), args.topk).indices
    w = torch.rand(M, args.topk, generator=g)
    y = torch.zeros(L, R * M, H, dtype=torch.bfloat16)

    # (perf/ll_side_by_side.py's `dispatch` and `combine`)
    def dispatch(use_fp8=True, hook=False):
        recv, count, handle, event, h = buf.low_latency_dispatch(
            x, idx, M, E, cumulative_local_expert_recv_stats=None, use_fp8=use_fp8, round_scale=False,
            use_ue8m0=False, async_finish=False, return_recv_hook=hook)
        return recv, count, handle, h

    def combine(y, handle, hook=False):
        out, event, h = buf.low_latency_combine(y, idx, w, handle, async_finish=False, return_recv_hook=hook)
        return out, h

    def step(fn, settle, prime=None):
        fn.settle, fn.prime = settle, prime or settle
        return fn

    last = {}

    def new_dispatch():
        last['d'] = dispatch(True)

    def new_hooked():       # the hook chain up to the dispatch's send
        last['h'] = dispatch(True, hook=True)

    def new_hooked_combine():
        new_hooked()
        last['h'][3]()
        last['c'] = combine(y, last['h'][2], hook=True)
    return {
        'LL dispatch FP8': lambda: dispatch(True),
        'LL dispatch BF16': lambda: dispatch(False),
        'LL combine': step(lambda: combine(y, last['d'][2]), new_dispatch),
        'LL dispatch send (hook)': step(lambda: last.__setitem__('h', dispatch(True, hook=True)),
                                        lambda: last['h'][3](), lambda: None),
        'LL dispatch hook()': step(lambda: last['h'][3](), new_hooked),
        'LL combine send (hook)': step(lambda: last.__setitem__('c', combine(y, last['h'][2], hook=True)),
                                       lambda: (last['c'][1](), new_hooked(), last['h'][3]()),
                                       lambda: (new_hooked(), last['h'][3]())),
        'LL combine hook()': step(lambda: last['c'][1](), new_hooked_combine),
    }


def agrs_cases(args):
    buf = make_buffer(args.ranks, 0, 64 << 20)
    ag = buf._agrs_feature()
    ag.set_config(16 << 20, 32)
    tensors = [torch.zeros(1 << 18, dtype=torch.float32) for _ in range(4)]        # 4 x 1 MiB

    def gather4():
        ag.create_session()
        ag.all_gather(tensors)
        ag.plan.close()
    def gather4_wait():        # as perf/ep_profile.py times it: the wait handle's launch too
        ag.create_session()
        *_, wait = ag.all_gather(tensors)
        wait()
        ag.plan.close()
    x = torch.zeros(1 << 20, dtype=torch.float32)
    return {
        'all_gather 4 x 1 MiB (+ session)': gather4,
        'all_gather 4 x 1 MiB (+ wait)': gather4_wait,
        'reduce_scatter 4 MiB': lambda: buf.reduce_scatter(x),
        'reduce_scatter 4 MiB (+ wait)': lambda: buf.reduce_scatter(x).wait(),     # as perf/ep_profile.py times it
        'all_reduce 4 MiB': lambda: buf.all_reduce(x),
        'all_reduce 4 MiB (+ wait)': lambda: buf.all_reduce(x).wait(),
    }


def pp_cases(args):
    buf = make_buffer(2, 0, 64 << 20)
    buf.pp_set_config(1 << 20, 4)
    x = torch.zeros(1 << 18, dtype=torch.float32)
    return {'pp_send 1 MiB': lambda: buf.pp_send(x, 1), 'pp_recv 1 MiB': lambda: buf.pp_recv(x, 1)}


def engram_cases(args):
    buf = make_buffer(args.ranks, 0, 64 << 20)
    table = torch.zeros(4096, 1024, dtype=torch.bfloat16)
    buf.engram_write(table)
    indices = torch.zeros(128, 4, dtype=torch.int32)
    return {'engram_fetch 128 x 4': lambda: buf.engram_fetch(indices),
            'engram_fetch 128 x 4 (+ hook)': lambda: buf.engram_fetch(indices)()}    # as perf/ep_profile.py


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--calls', type=int, default=2000)
    p.add_argument('--tokens', type=int, default=128)
    p.add_argument('--buffer-tokens', type=int, default=None,
                   help='num_max_tokens_per_rank of the dispatch / combine cases\' buffer (default: --tokens)')
    p.add_argument('--hidden', type=int, default=7168)
    p.add_argument('--topk', type=int, default=8)
    p.add_argument('--experts', type=int, default=256)
    p.add_argument('--ranks', type=int, default=1)
    p.add_argument('--only', default='', help='comma-separated substrings of case names')
    p.add_argument('--json', action='store_true', help='also print each case as one JSON line ([json] {...})')
    p.add_argument('--trace', action='store_true', help='also count the Python work per call ([trace]: bytecode '
                   'instructions, Python and C calls in deepep_cupy; deterministic where timings are noisy)')
    args = p.parse_args(argv)
    install()
    only = [s for s in args.only.split(',') if s]
    for make in (ep_cases, v1_cases, ll_cases, agrs_cases, pp_cases, engram_cases):
        for name, fn in make(args).items():
            if only and not any(s in name for s in only):
                continue
            us, api = timed(fn, args.calls)
            print(f'[host-cpu] {name:34s} {us:7.1f} us per call   [api] launches {api["launch"]:.1f}, '
                  f'allocations {api["alloc"]:.1f}, event records/waits {api["event"]:.1f} '
                  f'(new events {api["event_new"]:.1f}), record_stream {api["record_stream"]:.1f}', flush=True)
            work = {}
            if args.trace:
                work = traced(fn)
                print(f'[trace]    {name:34s} {work["opcodes"]:7.0f} bytecodes, {work["py_calls"]:5.1f} Python calls, '
                      f'{work["c_calls"]:5.1f} C calls per call; {work["gap"]:5.0f} bytecodes between the first and '
                      f'last launch' + (f', {work["after_counts"]:4.0f} bytecodes and {work["c_after_counts"]:4.1f} '
                                        f'C calls after the counts ({work["to_launch"]:.0f} before the receive\'s '
                                        f'launch)' if work['after_counts'] else ''), flush=True)
            if args.json:
                print('[json] ' + json.dumps(dict(case=name, us=us, **api, **work)), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
