"""Where a no-sync dispatch's GPU time goes, one rank alone on the GPU: per-kernel durations (torch profiler) of
CUDA-graph replays, for a decode-sized buffer (num_max_tokens_per_rank = the token count) and a large one, beside the
floor of an empty kernel and of a plain copy of the received bytes. With --ncu-pass the script only runs a few
dispatches per size (for `ncu -k regex:'notify|dispatch_impl'`).

    python3 perf/kernel_probe.py [--tokens 128,4096] [--buffer-tokens 128,4096] [--calls 50] [--ncu-pass]
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'perf'))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--tokens', default='128,4096')
    p.add_argument('--buffer-tokens', default='',
                   help='num_max_tokens_per_rank per case, comma separated (default: the token count, and 4096)')
    p.add_argument('--hidden', type=int, default=7168)
    p.add_argument('--num-topk', type=int, default=8)
    p.add_argument('--num-experts', type=int, default=256)
    p.add_argument('--calls', type=int, default=50)
    p.add_argument('--ncu-pass', action='store_true')
    args = p.parse_args()

    import cupy
    import torch
    from ep_profile import kernel_timeline

    from deepep_cupy import ElasticBuffer
    from deepep_cupy.runtime.interop import external_stream
    from deepep_cupy.utils.testing import profiler_trace_events

    def timeline(fn, n):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        return kernel_timeline(profiler_trace_events(prof), n)

    def all_kernels(fn, n):
        """Mean duration per kernel name (every kernel, not only the EP ones)."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        out = {}
        for e in profiler_trace_events(prof):
            if e.get('cat') in ('kernel', 'gpu_memcpy'):
                out.setdefault(e['name'][:60], []).append(e['dur'])
        return {k: (sum(v) / len(v), len(v)) for k, v in out.items()}

    # The floor: an empty kernel, replayed in a graph of 10.
    empty = cupy.RawKernel('extern "C" __global__ void empty_probe() {}', 'empty_probe')
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    empty((1,), (32,), ())
    torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=s):
        cs = external_stream(torch.cuda.current_stream().cuda_stream)
        with cs:
            for _ in range(10):
                empty((1,), (32,), ())
    g.replay()
    torch.cuda.synchronize()
    if not args.ncu_pass:
        for _name, (us, n) in all_kernels(g.replay, 5).items():
            print(f'[floor] empty kernel in a graph: {us:.2f} us ({n} launches)')
    tokens = [int(t) for t in args.tokens.split(',')]
    cases = []
    for t in tokens:
        if args.buffer_tokens:
            for m in args.buffer_tokens.split(','):
                if int(m) >= t:
                    cases.append((t, int(m)))
        else:
            cases += [(t, t)] + ([(t, 4096)] if t < 4096 else [])
    for num_tokens, m in cases:
        buf = ElasticBuffer(None, num_max_tokens_per_rank=m, hidden=args.hidden, num_topk=args.num_topk,
                            num_gpu_timeout_secs=30, explicitly_destroy=True)
        try:
            torch.manual_seed(num_tokens)
            x = torch.randn(num_tokens, args.hidden, dtype=torch.bfloat16, device='cuda')
            scores = torch.randn(num_tokens, args.num_experts, device='cuda').abs() + 1
            topk_idx = torch.topk(scores, args.num_topk, dim=-1, sorted=False).indices
            w = torch.randn(num_tokens, args.num_topk, dtype=torch.float32, device='cuda')
            kw = dict(topk_idx=topk_idx, topk_weights=w, num_experts=args.num_experts, do_cpu_sync=False)
            for _ in range(3):
                out = buf.dispatch(x, **kw)
            torch.cuda.synchronize()
            if args.ncu_pass:
                for _ in range(3):
                    buf.dispatch(x, **kw)
                torch.cuda.synchronize()
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = buf.dispatch(x, **kw)
            graph.replay()
            torch.cuda.synchronize()
            text, span, _ = timeline(graph.replay, args.calls)
            print(f'[graph] {num_tokens:5d} tokens, buffer M={m:5d}: {text}')
            text, span_e, _ = timeline(lambda b=buf, x=x, kw=kw: b.dispatch(x, **kw), args.calls)
            print(f'[eager] {num_tokens:5d} tokens, buffer M={m:5d}: {text}')
            received = out[0].shape[0] * out[0].shape[1] * 2
            src = torch.empty(num_tokens * args.hidden * 2, dtype=torch.uint8, device='cuda')
            dst = torch.empty_like(src)
            cg = torch.cuda.CUDAGraph()
            dst.copy_(src)
            torch.cuda.synchronize()
            with torch.cuda.graph(cg):
                dst.copy_(src)
            cg.replay()
            torch.cuda.synchronize()
            ks = all_kernels(cg.replay, args.calls)
            copy = sum(v[0] for v in ks.values())
            print(f'[copy] {num_tokens:5d} tokens: plain copy of the {src.numel() / 1e6:.2f} MB sent (recv_x rows '
                  f'{out[0].shape[0]}, {received / 1e6:.2f} MB worst case) in a graph: {copy:.1f} us; graph span '
                  f'{span:.1f} us = {span / copy:.2f}x')
        finally:
            torch.cuda.synchronize()
            buf.destroy()


if __name__ == '__main__':
    main()
