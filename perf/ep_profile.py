"""Where an EP call's time goes (one rank per GPU): host time per call, the GPU timeline of each call's kernels eager
and in a CUDA graph, the plain-copy baseline of the same received bytes, the other features' host time, and a summary
against issue 11's targets.

    launch/run_local.sh 1 python perf/ep_profile.py [--tokens 128,4096] [--num-sms 22] [--variants default,fused]

Per variant (default: the library's defaults, at one rank the no-sync dispatch is the fused kernel; two-kernels:
DEEPEP_CUPY_EP_FUSED_NOTIFY=0, the notify kernel then the dispatch kernel; no-overlap:
DEEPEP_CUPY_EP_DISPATCH_OVERLAP=0; fused: DEEPEP_CUPY_EP_FUSED_NOTIFY=1, the no-sync dispatch as one launch at any
rank count), tokens and dtype (BF16, FP8):
  [host]      host wall time of one call: median from idle (GPU idle and ranks aligned before each call), and per call
              back to back (the best of --host-batches batches' means); CPU-sync dispatches also the median, from
              idle, from the moment the host has the receive counts to the call's return (issue 11's "beyond the
              notify", in the host's clock)
  [wait]      the host's wait for a CPU-sync dispatch's counts: how often the counts were there first, the time in the
              wait, and the round trip counts -> host -> GPU beside a bare GPU-to-host flag's (perf/counts_wait.py;
              default variant, BF16)
  [timeline]  per kernel: median duration; per gap: median idle time between consecutive kernels of a call; span:
              first kernel start to last kernel end (what the GPU sees of one call); medians over the calls. CPU-sync
              calls start with the top-k range check (`range`, on the caller's stream). Graph cases replay a captured
              no-sync dispatch / combine.
  [copy]      a plain device copy of the bytes the dispatch receives (recv_x, scales, top-k ids and weights), and the
              no-sync dispatch span (eager and in a graph) over it
  [features]  host time per call of all_gather (4 x 1 MiB), reduce_scatter (R x 1 MiB), all_reduce (1 MiB),
              engram_fetch and (2+ ranks) pp_send / pp_recv
  [targets]   issue 11's figures with their bounds
  [machine]   this host's speed (CPU, a Python loop step, an empty kernel launch): the [host] rows move with it
  [profile]   (--profile, rank 0) cProfile of the host loop, top functions by own time
  [lines]     (--lines, rank 0) host time per call charged to each statement of dispatch / combine
--side-stream runs every call on a torch side stream instead of the (legacy) default stream.

Two steps in one process: every host figure first ([host], [wait], [features]), then the profiled timelines and the
copies, so that no host figure runs after a profiler session; --host-again measures the [host] rows once more after the
timelines ([host after a profile]), --no-timeline skips the timelines.
"""
import argparse
import ast
import contextlib
import cProfile
import inspect
import io
import os
import pstats
import sys
import textwrap
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from deepep_cupy.runtime import preflight  # noqa: E402  (torch-free: --help needs no GPU)

# Kernel names as the profiler shows them (features/ep/kernels.py, runtime/host_range.py), each matched as a
# substring, and the label printed for it.
KERNELS = (('value_range_kernel', 'range'), ('fused_notify_and_dispatch', 'fused'), ('notify_dispatch', 'notify'),
           ('dispatch_impl_with_dispatch_copy_epilogue_impl', 'dispatch'),
           ('combine_impl_with_combine_reduce_epilogue_impl', 'combine'))
VARIANTS = {'default': {}, 'no-overlap': {'DEEPEP_CUPY_EP_DISPATCH_OVERLAP': '0'},
            'fused': {'DEEPEP_CUPY_EP_FUSED_NOTIFY': '1'},
            'two-kernels': {'DEEPEP_CUPY_EP_FUSED_NOTIFY': '0'}}


def _label(name: str):
    return next((label for key, label in KERNELS if key in name), None)


def kernel_timeline(trace_events, num_calls: int):
    """`(text, span, parts)` of one call's kernels from a chrome trace: the median over the calls of each kernel's
    duration, of each gap between consecutive kernels and of the span; `parts` = [(label, µs)] with gaps as
    ('gap', µs). (Medians: one call in which the host fell behind would make a mean gap of several µs out of gaps of
    about one, beside a median span that has none.)"""
    events = [e for e in trace_events if e.get('cat') == 'kernel' and _label(e.get('name', ''))]
    events.sort(key=lambda e: e['ts'])
    if not events or len(events) % num_calls:
        return f'None ({len(events)} EP kernels for {num_calls} calls)', None, []
    per_call = len(events) // num_calls
    names = [_label(e['name']) for e in events[:per_call]]
    names = [n if names[:i].count(n) == 0 else f'{n}#{names[:i].count(n) + 1}' for i, n in enumerate(names)]
    durs = np.zeros((num_calls, per_call))
    gaps = np.zeros((num_calls, max(0, per_call - 1)))
    spans = np.zeros(num_calls)
    for c in range(num_calls):
        call = events[c * per_call:(c + 1) * per_call]
        for i, e in enumerate(call):
            durs[c, i] = e['dur']
            if i:
                gaps[c, i - 1] = e['ts'] - (call[i - 1]['ts'] + call[i - 1]['dur'])
        spans[c] = call[-1]['ts'] + call[-1]['dur'] - call[0]['ts']
    durs, gaps = np.median(durs, axis=0), np.median(gaps, axis=0)
    parts = []
    for i, n in enumerate(names):
        if i:
            parts.append(('gap', float(gaps[i - 1])))
        parts.append((n, float(durs[i])))
    text = ' | '.join(f'{n} {v:.1f}' for n, v in parts) + f' | span {np.median(spans):.1f} us (median)'
    return text, float(np.median(spans)), parts


class LineTimer:
    """Re-compile a function with a clock reading after every statement (nested blocks included), so that the time
    between consecutive readings is charged to the statement that just ran."""

    def __init__(self):
        self.totals, self.counts, self.sources, self.last = {}, {}, {}, 0

    def mark(self, key):
        now = time.perf_counter_ns()
        self.totals[key] = self.totals.get(key, 0) + now - self.last
        self.counts[key] = self.counts.get(key, 0) + 1
        self.last = now

    def start(self):
        self.last = time.perf_counter_ns()

    def instrument(self, func, label):
        src_lines, first = inspect.getsourcelines(func)
        tree = ast.parse(textwrap.dedent(''.join(src_lines)))
        fdef = tree.body[0]
        timer = self

        class Marker(ast.NodeTransformer):
            def _wrap(self, body):
                out = []
                for stmt in body:
                    self.generic_visit(stmt)
                    key = (label, stmt.lineno + first - 1)
                    timer.sources[key] = src_lines[stmt.lineno - 1].strip()[:90]
                    mark = ast.parse(f'__line_timer__.mark({key!r})').body[0]
                    if isinstance(stmt, (ast.Return, ast.Raise)):
                        out.extend([mark, stmt])
                    else:
                        out.extend([stmt, mark])
                return out

            def generic_visit(self, node):
                for field in ('body', 'orelse', 'finalbody'):
                    if field in node._fields and isinstance(getattr(node, field), list) and node is not fdef:
                        setattr(node, field, self._wrap(getattr(node, field)))
                for h in getattr(node, 'handlers', []):
                    h.body = self._wrap(h.body)
                return node

        fdef.body = [ast.parse('__line_timer__.start()').body[0]] + Marker()._wrap(fdef.body)
        fdef.decorator_list = []
        ast.fix_missing_locations(tree)
        glb = dict(func.__globals__)
        glb['__line_timer__'] = self
        exec(compile(tree, inspect.getsourcefile(func), 'exec'), glb)
        return glb[func.__name__]

    def report(self, calls, top=14):
        rows = sorted(self.totals.items(), key=lambda kv: -kv[1])[:top]
        return '\n'.join(f'    {v / calls / 1e3:7.1f} us  {k[0]}:{k[1]}  {self.sources.get(k, "")}' for k, v in rows)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help line; the description keeps its line breaks."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='perf/ep_profile.py', description=__doc__, formatter_class=HelpFormatter)
    p.add_argument('--tokens', default='128,4096', help='tokens per rank, comma separated')
    p.add_argument('--num-sms', type=int, default=22, help='SMs per dispatch/combine')
    p.add_argument('--hidden', type=int, default=7168, help='hidden size: elements per token')
    p.add_argument('--num-topk', type=int, default=8, help='experts per token (top-k)')
    p.add_argument('--num-experts', type=int, default=256, help='experts in all')
    p.add_argument('--num-calls', type=int, default=30, help='calls per case')
    p.add_argument('--host-batches', type=int, default=5,
                   help='[host] back to back: the best of this many batches of --num-calls calls')
    p.add_argument('--graph-max-tokens', type=int, default=512, help='also CUDA-graph replays up to this size')
    p.add_argument('--variants', default='default,no-overlap',
                   help=f'dispatch variants, comma separated, of {sorted(VARIANTS)}')
    p.add_argument('--skip-features', action='store_true', help='skip the other features\' host times')
    p.add_argument('--profile', action='store_true', help='cProfile of each case (rank 0)')
    p.add_argument('--no-timeline', action='store_true', help='host times only: no profiled [timeline] or span')
    p.add_argument('--host-again', action='store_true',
                   help='after the timelines, the [host] figures once more ([host after a profile]; not in [targets])')
    p.add_argument('--lines', action='store_true', help='time per statement of dispatch/combine (rank 0)')
    p.add_argument('--side-stream', action='store_true',
                   help='run every call on a torch side stream (non-blocking) instead of the default stream: launches '
                        'and event records on the legacy default stream may cost the host more')
    return p


class Runner:
    """Host and GPU timing of call cases, ranks aligned."""

    def __init__(self, args, group, log, torch):
        self.args, self.group, self.log, self.torch = args, group, log, torch
        self.results = {}
        self.step = 'host'      # set by `main`: 'host' (host figures), 'timeline' (profiled), 'again' (--host-again)

    def aligned(self):
        self.torch.cuda.synchronize()
        self.group.barrier()

    def host(self, fn, num_calls):
        """(median µs from idle, µs per call back to back), max over ranks."""
        for _ in range(5):
            fn()
        host = []
        for _ in range(num_calls):
            self.aligned()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        self.aligned()
        idle = max(self.group.allgather_object(float(np.median(host)) * 1e6))
        # Back to back: the best of a few batches' means (as `timeit` advises: one batch's mean carries whatever else
        # the host did meanwhile, which varied by 1.5x between this machine's runs of the same code).
        loops = []
        for _ in range(self.args.host_batches):
            t0 = time.perf_counter()
            for _ in range(num_calls):
                fn()
            loops.append((time.perf_counter() - t0) / num_calls)
            self.aligned()
        return idle, max(self.group.allgather_object(min(loops) * 1e6))

    def after_counts(self, fn, ep, num_calls):
        """The CPU-sync call `fn`'s host figures around its wait for the counts (`_wait_host_counts`), unprofiled, in
        the host's clock, `num_calls` calls from idle: `tail`, the median µs from the wait's return (the host has the
        counts) to the call's return, the host's share beyond the notify kernel; `ready`, the calls whose counts were
        there when the host entered the wait (then it costs one read and the return); `in_wait`, the median µs in the
        wait. Ranks: the largest times, the fewest ready calls."""
        wait, record = ep._wait_host_counts, ep._host_record
        marks = []

        def timed_wait(seq, *a):
            t0 = time.perf_counter()
            ready = record[0] == seq
            out = wait(seq, *a)
            marks.append((ready, t0, time.perf_counter()))
            return out
        ep._wait_host_counts = timed_wait
        try:
            tails = []
            for _ in range(num_calls):
                self.aligned()
                fn()
                t1 = time.perf_counter()
                if len(marks) != len(tails) + 1:
                    raise RuntimeError(f'a CPU-sync dispatch waited {len(marks) - len(tails)} times for the counts, '
                                       f'not once')
                tails.append(t1 - marks[-1][2])
        finally:
            del ep._wait_host_counts
        self.aligned()
        g = self.group
        return dict(tail=max(g.allgather_object(float(np.median(tails)) * 1e6)),
                    ready=min(g.allgather_object(sum(m[0] for m in marks))),
                    in_wait=max(g.allgather_object(float(np.median([m[2] - m[1] for m in marks])) * 1e6)))

    def timeline(self, fn, num_calls):
        torch = self.torch
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(num_calls):
                fn()
            torch.cuda.synchronize()
        from deepep_cupy.utils.testing import profiler_trace_events
        out = kernel_timeline(profiler_trace_events(prof), num_calls)
        self.aligned()
        return out

    def case(self, label, fn, key=None, timeline=True):
        """The host step's [host] figures of `fn`, or the timeline step's [timeline] (`timeline`: whether it has one),
        kept in `results[key]`."""
        args = self.args
        r = self.results.setdefault(key, {})
        if self.step != 'timeline':
            idle, loop = self.host(fn, args.num_calls)
            tag = '[host]' if self.step == 'host' else '[host after a profile]'
            self.log(f'{tag} {label}: {idle:7.1f} us per call from idle, {loop:7.1f} us per call back to back')
            if self.step == 'host':
                r.update(idle=idle, loop=loop)
            else:
                r.update(loop_after_profile=loop)
        elif timeline:
            tl = self.timeline(fn, args.num_calls)
            for rank, t in enumerate(self.group.allgather_object(tl[0])):
                self.log(f'[timeline] {label} rank {rank}: {t}')
            r.update(span=tl[1], parts=tl[2])

    def copy_us(self, num_bytes):
        """µs of one device copy of `num_bytes` (CUDA events over back-to-back copies)."""
        torch = self.torch
        src = torch.empty(num_bytes, dtype=torch.uint8, device='cuda')
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = self.args.num_calls
        start.record()
        for _ in range(n):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / n


def run_variant(variant, runner, args, group, timer):
    import torch

    from deepep_cupy import ElasticBuffer
    from deepep_cupy.utils.math import per_token_cast_to_fp8
    log = runner.log
    saved = {k: os.environ.get(k) for k in ('DEEPEP_CUPY_EP_DISPATCH_OVERLAP', 'DEEPEP_CUPY_EP_FUSED_NOTIFY')}
    os.environ.update(VARIANTS[variant])
    tokens = [int(t) for t in args.tokens.split(',')]
    try:
        buf = ElasticBuffer(group, num_max_tokens_per_rank=max(tokens), hidden=args.hidden, num_topk=args.num_topk,
                            num_gpu_timeout_secs=30, explicitly_destroy=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    rank = group.rank
    try:
        for num_tokens in tokens:
            torch.manual_seed(rank * 7919 + num_tokens)
            x = torch.randn(num_tokens, args.hidden, dtype=torch.bfloat16, device='cuda')
            scores = torch.randn(num_tokens, args.num_experts, device='cuda').abs() + 1
            topk_idx = torch.topk(scores, args.num_topk, dim=-1, sorted=False).indices
            topk_weights = torch.randn(num_tokens, args.num_topk, dtype=torch.float32, device='cuda')
            for dtype in ('bf16', 'fp8'):
                x_in = per_token_cast_to_fp8(x) if dtype == 'fp8' else x
                kw = dict(topk_idx=topk_idx, topk_weights=topk_weights, num_experts=args.num_experts,
                          num_sms=args.num_sms)
                recv = buf.dispatch(x_in, **kw)
                handle = recv[3]
                received = sum(t.numel() * t.element_size() for t in
                               ((recv[0] if dtype == 'bf16' else recv[0][0]), None if dtype == 'bf16' else recv[0][1],
                                recv[1], recv[2]) if t is not None)
                y = torch.randn(handle.num_rows, args.hidden, dtype=torch.bfloat16, device='cuda')
                cases = {
                    'dispatch cpu-sync': lambda x_in=x_in, kw=kw: buf.dispatch(x_in, **kw),
                    'dispatch no-sync': lambda x_in=x_in, kw=kw: buf.dispatch(x_in, do_cpu_sync=False, **kw),
                    'dispatch cached': lambda x_in=x_in, h=handle: buf.dispatch(x_in, handle=h),
                    'combine': lambda y=y, h=handle: buf.combine(y, h),
                }
                if num_tokens <= args.graph_max_tokens:
                    # CUDA graphs of a no-sync dispatch and of its combine (no host path at all).
                    runner.aligned()
                    graphs = {'dispatch': torch.cuda.CUDAGraph(), 'combine': torch.cuda.CUDAGraph()}
                    with torch.cuda.graph(graphs['dispatch']):
                        out = buf.dispatch(x_in, do_cpu_sync=False, **kw)
                    graphs['dispatch'].replay()
                    runner.aligned()
                    y_graph = torch.randn(out[3].num_rows, args.hidden, dtype=torch.bfloat16, device='cuda')
                    with torch.cuda.graph(graphs['combine']):
                        buf.combine(y_graph, out[3])
                    runner.aligned()
                    cases['dispatch graph'] = graphs['dispatch'].replay
                    cases['combine graph'] = graphs['combine'].replay
                for name, fn in cases.items():
                    label = f'{variant:10s} {num_tokens:5d} {dtype} {name:17s}'
                    runner.case(label, fn, key=(variant, num_tokens, dtype, name))
                    if runner.step != 'host':
                        continue
                    if name == 'dispatch cpu-sync':
                        a = runner.after_counts(fn, buf._ep, args.num_calls)
                        runner.results[(variant, num_tokens, dtype, name)]['after_counts'] = a['tail']
                        log(f'[host] {label}: {a["tail"]:7.1f} us per call from idle after the host has the counts')
                        if variant == 'default' and dtype == 'bf16':
                            from counts_wait import measure
                            w = measure(runner, fn, buf._ep, args.num_calls)
                            runner.results[('counts wait', num_tokens)] = w
                            log(f'[wait] {label}: counts already there at the wait\'s entry in {a["ready"]} of '
                                f'{args.num_calls} calls, {a["in_wait"]:.1f} us in the wait (median, unprofiled); '
                                f'the host entered the wait first in {w["waited"]} of {args.num_calls} probed calls: '
                                f'round trip counts -> host -> GPU {w["round_trip"]:.2f} us, a bare GPU-to-host '
                                f'flag\'s {w["bare"]:.2f} us (medians, GPU clock)')
                    if args.lines:
                        timer.totals.clear()
                        for _ in range(args.num_calls):
                            fn()
                        runner.aligned()
                        log(f'[lines] {label}: host time per call by statement\n' + timer.report(args.num_calls))
                    if args.profile:
                        prof_c = cProfile.Profile()
                        prof_c.enable()
                        for _ in range(args.num_calls):
                            fn()
                        prof_c.disable()
                        runner.aligned()
                        if rank == 0:
                            s = io.StringIO()
                            pstats.Stats(prof_c, stream=s).sort_stats('tottime').print_stats(18)
                            log(f'[profile] {label}\n' + s.getvalue())
                if runner.step != 'timeline':
                    continue
                key = ('copy', num_tokens, dtype)
                if key not in runner.results:
                    runner.results[key] = dict(bytes=received, us=runner.copy_us(received))
                copy = runner.results[key]
                spans = [runner.results.get((variant, num_tokens, dtype, n), {}).get('span')
                         for n in ('dispatch no-sync', 'dispatch graph')]
                ratios = ', '.join(f'{n} span {s:.1f} us = {s / copy["us"]:.2f}x' for n, s in
                                   zip(('eager no-sync', 'graph'), spans) if s)
                log(f'[copy] {variant:10s} {num_tokens:5d} {dtype}: plain copy of the {copy["bytes"] / 1e6:.2f} MB '
                    f'received: {copy["us"]:.1f} us; {ratios}')
    finally:
        torch.cuda.synchronize()
        buf.destroy()


def run_features(runner, args, group):
    """Host time per call of the other features' calls (one buffer each: one feature per buffer)."""
    import torch

    from deepep_cupy import ElasticBuffer
    R = group.size
    mib = 1 << 20
    session = ElasticBuffer.get_agrs_num_max_session_bytes(group, [(mib // 4,)] * 32, torch.float32)
    reduce_bytes = max(ElasticBuffer.get_agrs_reduce_num_bytes(group, R * mib, 'reduce_scatter'),
                       ElasticBuffer.get_agrs_reduce_num_bytes(group, mib, 'all_reduce'))
    buf = ElasticBuffer(group, num_bytes=ElasticBuffer.get_agrs_buffer_size_hint(group, session, reduce_bytes),
                        explicitly_destroy=True)
    try:
        buf.agrs_set_config(session, 32)
        tensors = [torch.randn(mib // 4, device='cuda') for _ in range(4)]
        state = {'n': 0}

        def gather():
            if state['n'] == 8:          # 8 calls of 4 tensors fill a session of 32 gathers
                buf.destroy_agrs_session()
                state['n'] = 0
            if state['n'] == 0:
                buf.create_agrs_session()
            state['n'] += 1
            *_, wait = buf.all_gather(tensors)
            wait()
        runner.case('[features] all_gather 4 x 1 MiB (+ wait)', gather, key='all_gather', timeline=False)
        if state['n']:
            buf.destroy_agrs_session()
        xs = torch.randn(R * mib // 4, device='cuda')
        runner.case('[features] reduce_scatter 4 MiB x R fp32', lambda: buf.reduce_scatter(xs).wait(),
                    key='reduce_scatter', timeline=False)
        xa = torch.randn(mib // 4, device='cuda')
        runner.case('[features] all_reduce 1 MiB fp32', lambda: buf.all_reduce(xa).wait(), key='all_reduce',
                    timeline=False)
    finally:
        torch.cuda.synchronize()
        buf.destroy()
    gpu_bytes, cpu_bytes = ElasticBuffer.get_engram_storage_size_hint(4096, 1024, 512)
    buf = ElasticBuffer(group, num_bytes=gpu_bytes + cpu_bytes, explicitly_destroy=True)
    try:
        buf.engram_write(torch.randn(4096, 1024, device='cuda').to(torch.bfloat16))
        idx = torch.randint(0, 4096 * R, (128, 4), dtype=torch.int32, device='cuda')
        runner.case('[features] engram_fetch 128 x 4 rows', lambda: buf.engram_fetch(idx)(), key='engram_fetch',
                    timeline=False)
    finally:
        torch.cuda.synchronize()
        buf.destroy()
    if R >= 2:
        buf = ElasticBuffer(group, num_bytes=ElasticBuffer.get_pp_buffer_size_hint(mib, 4), explicitly_destroy=True)
        try:
            buf.pp_set_config(mib, 4)
            x = torch.randn(mib // 4, device='cuda')
            nxt, prv = (group.rank + 1) % R, (group.rank - 1) % R

            def pingpong():
                buf.pp_send(x, nxt)
                buf.pp_recv(x, prv)
            runner.case('[features] pp_send + pp_recv 1 MiB (two calls)', pingpong, key='pp', timeline=False)
        finally:
            torch.cuda.synchronize()
            buf.destroy()


def summary(runner, args, log):
    """Issue 11's figures (1 GPU) against their bounds; `-` where this run has no figure."""
    res = runner.results
    tokens = [int(t) for t in args.tokens.split(',')]
    small, large = min(tokens), max(tokens)

    def get(key, field):
        v = res.get(key, {}).get(field)
        return v

    def line(what, value, bound, unit='us'):
        if value is None:
            log(f'[targets] {what}: -')
        else:
            log(f'[targets] {what}: {value:.{2 if unit == "x" else 1}f} {unit} (target <= {bound} {unit}) '
                f'{"OK" if value <= bound else "over"}')
    v = 'default'
    line(f'host, no-sync dispatch, {small} tokens, back to back', get((v, small, 'bf16', 'dispatch no-sync'), 'loop'),
         35)
    line(f'host, cached dispatch, {small} tokens', get((v, small, 'bf16', 'dispatch cached'), 'loop'), 25)
    line(f'host, combine, {small} tokens', get((v, small, 'bf16', 'combine'), 'loop'), 20)
    # CPU sync: host time from the moment it has the counts (the notify kernel done and its counts seen) to the
    # call's return, in the host's clock (the profiled timeline's gaps are not the unprofiled host's).
    line(f'host, CPU-sync dispatch beyond notify, {small} tokens (counts seen .. return)',
         get((v, small, 'bf16', 'dispatch cpu-sync'), 'after_counts'), 25)
    for n in sorted({small, large}):
        wait = res.get(('counts wait', n))
        line(f'host wait for the counts beyond the notify, {n} tokens (over a bare GPU-to-host flag; 0: the counts '
             f'were there before the host asked)', wait and wait['beyond'], 1)
    for name in ('all_gather', 'reduce_scatter', 'all_reduce', 'engram_fetch', 'pp'):
        if name in res:
            line(f'host, {name}', res[name]['loop'], 25 * (2 if name == 'pp' else 1))
    for w in ('default', 'two-kernels', 'fused'):      # (the other variants when run)
        tag = '' if w == 'default' else f' [{w}]'
        for dtype in ('bf16', 'fp8'):
            span, copy = get((w, large, dtype, 'dispatch no-sync'), 'span'), get(('copy', large, dtype), 'us')
            if (w == 'default' and dtype == 'bf16') or span is not None:
                ratio = span / copy if span and copy else None
                line(f'dispatch span / plain copy, {large} tokens {dtype} no-sync{tag}', ratio, 1.3, 'x')
        graph = get((w, small, 'bf16', 'dispatch graph'), 'span')
        if w == 'default' or graph is not None:
            line(f'decode dispatch span in a graph, {small} tokens{tag}', graph, 10)
    line(f'decode combine span in a graph, {small} tokens', get((v, small, 'bf16', 'combine graph'), 'span'), 7)
    after = [(n, get((v, small, 'bf16', n), 'loop_after_profile')) for n in ('dispatch no-sync', 'dispatch cached',
                                                                            'combine', 'dispatch graph')]
    if all(a is not None for _, a in after):
        log(f'[targets] (not a target) the same host rows after the profiled timelines, {small} tokens bf16, back to '
            f'back: ' + ', '.join(f'{n} {a:.1f} us' for n, a in after))
    # The cached dispatch kernel against the uncached one: a CPU-sync call's receive launch runs the same kernel (the
    # no-sync call's may be the fused kernel, which also counts)
    cached = dict(get((v, large, 'bf16', 'dispatch cached'), 'parts') or [])
    uncached = dict(get((v, large, 'bf16', 'dispatch cpu-sync'), 'parts') or [])
    if cached.get('dispatch') and uncached.get('dispatch'):
        log(f'[targets] cached dispatch kernel {cached["dispatch"]:.1f} us vs uncached {uncached["dispatch"]:.1f} us '
            f'({large} tokens bf16, the CPU-sync call\'s receive; target: as fast)')
    for variant in VARIANTS:
        for mode in ('dispatch cpu-sync', 'dispatch no-sync'):
            s = get((variant, large, 'bf16', mode), 'span')
            if s:
                log(f'[targets] span {variant:10s} {large} bf16 {mode}: {s:.1f} us')


def machine_line(torch) -> str:
    """This host's speed, for reading the [host] rows of runs on different machine starts (their times moved by up to
    1.5x between starts with the same code): the CPU, a pure-Python loop, an empty kernel's launch from CuPy."""
    import cupy

    from deepep_cupy.runtime.interop import external_stream
    model = next((line.split(':', 1)[1].strip() for line in open('/proc/cpuinfo') if line.startswith('model name')),
                 '?')

    def best(fn, n):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn(n)
            times.append((time.perf_counter() - t0) / n)
        return min(times)

    def py_loop(n):
        x = 0
        for i in range(n):
            x += i
    kernel = cupy.RawKernel('extern "C" __global__ void machine_empty() {}', 'machine_empty')
    stream = external_stream(torch.cuda.current_stream().cuda_stream)

    def launches(n):
        for _ in range(n):
            kernel((1,), (32,), (), stream=stream)
        stream.synchronize()
    launches(10)
    return (f'[machine] {model}, {os.cpu_count()} CPUs: a Python loop step {best(py_loop, 200000) * 1e9:.0f} ns, an '
            f'empty kernel launch (CuPy, back to back) {best(launches, 2000) * 1e6:.2f} us')


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    preflight.check_cuda()

    import torch

    from deepep_cupy.features.ep.bound import BoundCombine, BoundDispatch
    from deepep_cupy.features.ep.feature import EP
    from deepep_cupy.runtime.group import get_group
    from deepep_cupy.utils.envs import init_dist
    rank, num_ranks, _ = init_dist(seed=0)
    group = get_group()  # host group: MPI under mpirun, else the torch world init_dist joined
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    timer = LineTimer()
    if args.lines:
        for cls, name in ((EP, 'dispatch'), (EP, 'combine'), (BoundDispatch, '__call__'), (BoundCombine, '__call__')):
            setattr(cls, name, timer.instrument(getattr(cls, name), f'{cls.__name__}.{name}'))
    runner = Runner(args, group, log, torch)
    log(machine_line(torch))
    side = torch.cuda.stream(torch.cuda.Stream()) if args.side_stream else contextlib.nullcontext()
    with side:
        if args.side_stream:
            log(f'[stream] every call on a side stream ({torch.cuda.current_stream().cuda_stream:#x})')
        for variant in args.variants.split(','):
            if variant not in VARIANTS:
                raise SystemExit(f'--variants: unknown variant {variant!r}; choose from {sorted(VARIANTS)}')
        # Every host figure before the process's first profiled session, the timelines after (see the docstring).
        steps = ['host'] + ([] if args.no_timeline else ['timeline']) + (['again'] if args.host_again else [])
        for step in steps:
            runner.step = step
            for variant in args.variants.split(','):
                run_variant(variant, runner, args, group, timer)
            if step != 'timeline' and not args.skip_features:
                run_features(runner, args, group)
    summary(runner, args, log)
    return 0


if __name__ == '__main__':
    sys.exit(preflight.run(main))
