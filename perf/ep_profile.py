"""Where an EP call's time goes (one rank per GPU): host time per call, a cProfile of the host path, and the GPU
timeline of each call's kernels (durations and the gaps between them) from a torch-profiler trace.

    launch/run_local.sh 2 python perf/ep_profile.py [--tokens 128,4096] [--num-sms 22] [--profile]

Per case (tokens x {dispatch with CPU sync, dispatch without, combine}; BF16, and FP8 for decode):
  [host]      median wall time of one call from Python (GPU idle and ranks aligned before each call)
  [timeline]  per kernel: mean duration; per gap: mean idle time between consecutive kernels of a call; span: first
              kernel start to last kernel end (what the GPU sees of one call)
  [profile]   (--profile, rank 0) cProfile of the host loop, top functions by own time
  [lines]     (--lines, rank 0) host time per call charged to each statement of dispatch / combine
"""
import argparse
import ast
import cProfile
import inspect
import io
import json
import os
import pstats
import sys
import tempfile
import textwrap
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from deepep_cupy.runtime import preflight  # noqa: E402  (torch-free: --help needs no GPU)

# Kernel names as the profiler shows them (features/ep/kernels.py); each name is matched as a substring.
KERNELS = ('notify_dispatch', 'dispatch_copy_epilogue_impl', 'dispatch_impl', 'combine_impl')


def kernel_timeline(trace_events, num_calls: int):
    """Mean duration per kernel and mean gap between consecutive kernels of one call, from a chrome trace."""
    events = [e for e in trace_events if e.get('cat') == 'kernel' and any(k in e.get('name', '') for k in KERNELS)]
    events.sort(key=lambda e: e['ts'])
    if not events or len(events) % num_calls:
        return None
    per_call = len(events) // num_calls
    names = [next(k for k in KERNELS if k in e['name']) for e in events[:per_call]]
    durs = np.zeros(per_call)
    gaps = np.zeros(max(0, per_call - 1))
    spans = []
    for c in range(num_calls):
        call = events[c * per_call:(c + 1) * per_call]
        for i, e in enumerate(call):
            durs[i] += e['dur']
            if i:
                gaps[i - 1] += e['ts'] - (call[i - 1]['ts'] + call[i - 1]['dur'])
        spans.append(call[-1]['ts'] + call[-1]['dur'] - call[0]['ts'])
    durs /= num_calls
    gaps /= num_calls
    parts = []
    for i, n in enumerate(names):
        if i:
            parts.append(f'gap {gaps[i - 1]:.1f}')
        parts.append(f'{n.replace("_kernel", "")} {durs[i]:.1f}')
    return ' | '.join(parts) + f' | span {np.median(spans):.1f} us (median)'


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
    p.add_argument('--graph-max-tokens', type=int, default=512, help='also CUDA-graph replays up to this size')
    p.add_argument('--profile', action='store_true', help='cProfile of each case (rank 0)')
    p.add_argument('--lines', action='store_true', help='time per statement of dispatch/combine (rank 0)')
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    preflight.check_cuda()

    import torch

    from deepep_cupy import ElasticBuffer
    from deepep_cupy.features.ep.feature import EP
    from deepep_cupy.runtime.group import get_group
    from deepep_cupy.utils.envs import init_dist
    from deepep_cupy.utils.math import per_token_cast_to_fp8
    rank, num_ranks, _ = init_dist(seed=0)
    group = get_group()  # host group: MPI under mpirun, else the torch world init_dist joined
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    tokens = [int(t) for t in args.tokens.split(',')]
    timer = LineTimer()
    if args.lines:
        for name in ('dispatch', '_launch_dispatch', 'combine'):
            setattr(EP, name, timer.instrument(getattr(EP, name), name))
    buf = ElasticBuffer(group, num_max_tokens_per_rank=max(tokens), hidden=args.hidden, num_topk=args.num_topk,
                        num_gpu_timeout_secs=30, explicitly_destroy=True)

    def aligned():
        torch.cuda.synchronize()
        group.barrier()

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
                y = torch.randn(handle.num_rows, args.hidden, dtype=torch.bfloat16, device='cuda')
                cases = {
                    'dispatch cpu-sync': lambda x_in=x_in, kw=kw: buf.dispatch(x_in, **kw),
                    'dispatch no-sync': lambda x_in=x_in, kw=kw: buf.dispatch(x_in, do_cpu_sync=False, **kw),
                    'dispatch cached': lambda x_in=x_in, h=handle: buf.dispatch(x_in, handle=h),
                    'combine': lambda y=y, h=handle: buf.combine(y, h),
                }
                if num_tokens <= args.graph_max_tokens:
                    # CUDA graphs of a no-sync dispatch and of its combine (no host path at all).
                    aligned()
                    graphs = {'dispatch': torch.cuda.CUDAGraph(), 'combine': torch.cuda.CUDAGraph()}
                    with torch.cuda.graph(graphs['dispatch']):
                        out = buf.dispatch(x_in, do_cpu_sync=False, **kw)
                    graphs['dispatch'].replay()
                    aligned()
                    y_graph = torch.randn(out[3].num_rows, args.hidden, dtype=torch.bfloat16, device='cuda')
                    with torch.cuda.graph(graphs['combine']):
                        buf.combine(y_graph, out[3])
                    aligned()
                    cases['dispatch graph'] = graphs['dispatch'].replay
                    cases['combine graph'] = graphs['combine'].replay
                for name, fn in cases.items():
                    label = f'{num_tokens:5d} {dtype} {name:17s}'
                    for _ in range(5):
                        fn()
                    # Host wall time per call, GPU idle before each.
                    host = []
                    for _ in range(args.num_calls):
                        aligned()
                        t0 = time.perf_counter()
                        fn()
                        host.append(time.perf_counter() - t0)
                    aligned()
                    worst = max(group.allgather_object(float(np.median(host)) * 1e6))
                    # Back-to-back calls, host time per call (GPU overlapped).
                    t0 = time.perf_counter()
                    for _ in range(args.num_calls):
                        fn()
                    loop = (time.perf_counter() - t0) / args.num_calls
                    aligned()
                    loop = max(group.allgather_object(loop * 1e6))
                    # GPU timeline of back-to-back calls.
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(args.num_calls):
                            fn()
                        torch.cuda.synchronize()
                    with tempfile.TemporaryDirectory() as tmp:
                        path = os.path.join(tmp, 'trace.json')
                        prof.export_chrome_trace(path)
                        with open(path) as f:
                            tl = kernel_timeline(json.load(f)['traceEvents'], args.num_calls)
                    aligned()
                    log(f'[host] {label}: {worst:7.1f} us per call from idle, {loop:7.1f} us per call back to back')
                    tls = group.allgather_object(tl)
                    for r, t in enumerate(tls):
                        log(f'[timeline] {label} rank {r}: {t}')
                    if args.lines:
                        timer.totals.clear()
                        for _ in range(args.num_calls):
                            fn()
                        aligned()
                        log(f'[lines] {label}: host time per call by statement\n' + timer.report(args.num_calls))
                    if args.profile:
                        prof_c = cProfile.Profile()
                        prof_c.enable()
                        for _ in range(args.num_calls):
                            fn()
                        prof_c.disable()
                        aligned()
                        if rank == 0:
                            s = io.StringIO()
                            pstats.Stats(prof_c, stream=s).sort_stats('tottime').print_stats(18)
                            log(f'[profile] {label}\n' + s.getvalue())
    finally:
        torch.cuda.synchronize()
        buf.destroy()
    return 0


if __name__ == '__main__':
    sys.exit(preflight.run(main))
