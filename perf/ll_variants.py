"""Where the low-latency kernels' time goes, by variants: the same one-rank FP8 dispatch and BF16 combine
(ll_side_by_side's inputs and graph timing) with kernels_cu/ep_ll.cu compiled under its measurement hooks, each
variant beside the shipped kernels in one run.

    python3 perf/ll_variants.py [--variants base,gpu_scope,...] [--num-tokens 128 --hidden 7168 ...] [--out DIR]

Variants (the -D values of ep_ll.cu's header; `base` is the shipped kernel):
    base          no -D
    gpu_scope     DEEPEP_LL_GPU_SCOPE=1: signals at GPU scope instead of system scope (one GPU only)
    seg2, seg7    DEEPEP_LL_SEG_BATCH=2 / 7 segments loaded per lane before any is converted (shipped: 4)
    blocks2       DEEPEP_LL_MIN_BLOCKS=2 and two blocks per SM launched
    own_tokens    DEEPEP_LL_OWN_TOKENS=1: our own tokens received by token (read and cast once), not by row
    own_tokens_gpu  both that and gpu_scope
    parts2/4/7    DEEPEP_LL_PART_SEGS=2 / 4 / 7 segments (of 512 channels) per warp item (shipped: enough items for
                  every warp: 1 or 2 segments at 128 tokens)
    no_data       DEEPEP_LL_PROBE_NO_DATA=1: the receive phases move no row bytes (outputs invalid): the rest's time
    no_data_gpu   both of the above
Per variant: CUDA-graph µs per call of FP8 dispatch, BF16 combine and dispatch + combine (median of --graph-reps
replays of --graph-calls calls), and whether its outputs equal base's bit for bit (FP8 recv_x and scales, also with
round_scale and UE8M0, counts, the combine of a BF16 dispatch; `n/a` for the probes). One line per variant, the
ratio to base beside each figure; `--out DIR` writes DIR/ll_variants.json.
"""

import argparse
import json
import os
import socket
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, 'perf')):
    if path not in sys.path:
        sys.path.insert(0, path)

VARIANTS = {
    'base': ({}, 1),
    'gpu_scope': ({'DEEPEP_LL_GPU_SCOPE': 1}, 1),
    'seg2': ({'DEEPEP_LL_SEG_BATCH': 2}, 1),
    'seg7': ({'DEEPEP_LL_SEG_BATCH': 7}, 1),
    'blocks2': ({'DEEPEP_LL_MIN_BLOCKS': 2}, 2),
    'own_tokens': ({'DEEPEP_LL_OWN_TOKENS': 1}, 1),
    'own_tokens_gpu': ({'DEEPEP_LL_OWN_TOKENS': 1, 'DEEPEP_LL_GPU_SCOPE': 1}, 1),
    'parts2': ({'DEEPEP_LL_PART_SEGS': 2}, 1),
    'parts4': ({'DEEPEP_LL_PART_SEGS': 4}, 1),
    'parts7': ({'DEEPEP_LL_PART_SEGS': 7}, 1),
    'no_data': ({'DEEPEP_LL_PROBE_NO_DATA': 1}, 1),
    'no_data_gpu': ({'DEEPEP_LL_PROBE_NO_DATA': 1, 'DEEPEP_LL_GPU_SCOPE': 1}, 1),
}
PROBES = ('no_data', 'no_data_gpu')
LL_FAMILY = 'ep_ll'


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--variants', default=','.join(VARIANTS), help='comma separated, from: ' + ', '.join(VARIANTS))
    p.add_argument('--num-tokens', type=int, default=128)
    p.add_argument('--hidden', type=int, default=7168)
    p.add_argument('--num-topk', type=int, default=8)
    p.add_argument('--num-experts', type=int, default=256)
    p.add_argument('--graph-calls', type=int, default=10, help='calls per CUDA graph (even: two halves alternate)')
    p.add_argument('--graph-reps', type=int, default=50)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--out', default='')
    return p


class Hooks:
    """The variant under test: `-D` values for the low-latency family and blocks per SM, applied where the engine
    loads its kernels (`jit.launch.load_kernels`) and binds its launches (`features.ll.bound._bind_pair`)."""

    def __init__(self):
        from deepep_cupy.features.ll import bound
        from deepep_cupy.jit import launch
        self.defines, self.blocks_per_sm = {}, 1
        load, bind = launch.load_kernels, bound._bind_pair

        def load_kernels(specs, defines=None, device=None):
            if self.defines and specs and all(s.family == LL_FAMILY for s in specs):
                defines = {**(defines or {}), **self.defines}
            return load(specs, defines, device)

        def bind_pair(kernel, grid, smem, named, hook):
            return bind(kernel, grid * self.blocks_per_sm, smem, named, hook)
        launch.load_kernels, bound._bind_pair = load_kernels, bind_pair


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.graph_calls % 2:
        raise SystemExit('--graph-calls must be even')
    names = [v.strip() for v in args.variants.split(',') if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f'--variants: unknown {unknown}; known: {", ".join(VARIANTS)}')
    if 'base' not in names:
        names.insert(0, 'base')

    import torch
    import torch.distributed as dist
    from ll_side_by_side import make_inputs

    import deepep_cupy
    hooks = Hooks()
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', world_size=1, rank=0)
    group = dist.new_group([0])
    M, H, K, E = args.num_tokens, args.hidden, args.num_topk, args.num_experts
    inp = make_inputs(M, H, K, E, 0, args.seed)
    x, topk_idx, topk_weights = inp['x'].cuda(), inp['topk_idx'].cuda(), inp['topk_weights'].cuda()
    Buffer = deepep_cupy.Buffer
    num_bytes = Buffer.get_low_latency_rdma_size_hint(M, H, 1, E)

    def graph_us(fn, n_calls: int) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(n_calls):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n_calls):
                fn()
        torch.cuda.synchronize()
        for _ in range(3):
            g.replay()
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(args.graph_reps)]
        for s0, e0 in evs:
            s0.record()
            g.replay()
            e0.record()
        torch.cuda.synchronize()
        del g
        return statistics.median(s0.elapsed_time(e0) for s0, e0 in evs) * 1e3 / n_calls

    def outputs(buf):
        """The checked outputs of one FP8 dispatch and of the BF16 combine of a BF16 dispatch."""
        rows = []
        for fp8 in ({}, {'round_scale': True, 'use_ue8m0': True}):
            recv, count, _, _, _ = buf.low_latency_dispatch(x, topk_idx, M, E, use_fp8=True, **fp8)
            torch.cuda.synchronize()
            for j in range(recv[0].shape[0]):           # valid rows only: the rest is stale by contract
                c = int(count[j])
                rows.append((recv[0][j, :c].view(torch.uint8).clone(), recv[1][j, :c].clone()))
        rb, _, hb, _, _ = buf.low_latency_dispatch(x, topk_idx, M, E, use_fp8=False)
        comb, _, _ = buf.low_latency_combine(rb, topk_idx, topk_weights, hb)
        torch.cuda.synchronize()
        return {'count': count.clone(), 'rows': rows, 'combined': comb.clone()}

    def same(a, b) -> bool:
        if not torch.equal(a['count'], b['count']) or not torch.equal(a['combined'], b['combined']):
            return False
        return all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a['rows'], b['rows']))

    def timings(buf) -> dict:
        n = args.graph_calls
        rb, _, hb, _, _ = buf.low_latency_dispatch(x, topk_idx, M, E, use_fp8=False)
        torch.cuda.synchronize()

        def step():
            o = buf.low_latency_dispatch(x, topk_idx, M, E, use_fp8=True)
            buf.low_latency_combine(rb, topk_idx, topk_weights, o[2])
        return {'dispatch_fp8': graph_us(lambda: buf.low_latency_dispatch(x, topk_idx, M, E, use_fp8=True), n),
                'combine': graph_us(lambda: buf.low_latency_combine(rb, topk_idx, topk_weights, hb), n),
                'dispatch_combine': graph_us(step, n // 2)}

    results, ref = {}, None
    for name in names:
        hooks.defines, hooks.blocks_per_sm = VARIANTS[name]
        buf = Buffer(group, num_nvl_bytes=0, num_rdma_bytes=num_bytes, low_latency_mode=True, num_qps_per_rank=E,
                     explicitly_destroy=True)
        try:
            got = outputs(buf)
            if name == 'base':
                ref = got
            row = dict(timings(buf), exact='n/a' if name in PROBES else ('yes' if same(ref, got) else 'NO'))
        finally:
            torch.cuda.synchronize()
            buf.destroy()
        results[name] = row
        b = results['base']
        figures = ' | '.join(f'{label} {row[key]:6.2f} us ({row[key] / b[key]:.3f})' for key, label in (
            ('dispatch_fp8', 'dispatch FP8'), ('combine', 'combine'), ('dispatch_combine', 'dispatch + combine')))
        defines, blocks = VARIANTS[name]
        print(f'[variant] {name:12s} | {figures} | bitwise as base: {row["exact"]} | {defines or "shipped"}'
              f'{f", {blocks} blocks/SM" if blocks > 1 else ""}', flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, 'll_variants.json'), 'w') as f:
            json.dump({'args': vars(args), 'device': torch.cuda.get_device_name(), 'results': results}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == '__main__':
    sys.exit(main())
