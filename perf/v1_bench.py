"""DeepEP V1 `Buffer` benchmark: normal and low-latency mode, eager and CUDA graph, hook send / receive, each next to
`ElasticBuffer` on the same inputs and SM count, measured in the same run (ratios = V1 time / ElasticBuffer time).

    launch/run_local.sh N python perf/v1_bench.py [--tokens 128,4096] [--num-sms 24] [--ll-tokens 128] [--out DIR]

Rows (per rank; see deepep_cupy/tests/legacy_perf.py for the definitions):
  [layout]  get_dispatch_layout µs
  [perf]    dispatch FP8 / BF16 and cached dispatch, combine: V1 µs and DeepEP's GB/s, ElasticBuffer µs, ratio
  [host]    host µs per call without a host wait (num_worst_tokens dispatch, cached dispatch, combine: V1,
            ElasticBuffer, ratio; layout)
  [graph]   layout + dispatch(num_worst_tokens) + combine in a CUDA graph vs ElasticBuffer's no-sync decode path
  [ratio]   every V1 / ElasticBuffer ratio of the rows above in one line (each pair timed alternately in this run)
  [ll]      low-latency FP8 dispatch + BF16 combine: eager, kernel times, hook send + recv, CUDA graph; next to
            ElasticBuffer's decode (do_cpu_sync=False, FP8) dispatch + combine in a CUDA graph
Hidden 7168, top-8, 256 experts (288 for low latency) by default, as DeepEP's tests. `--out DIR` writes
DIR/v1_bench.json (every rank's lines per case).

Across scale-up domains (several hosts, or DEEPEP_CUPY_SCALEUP_SIZE below the rank count) the same rows time V1's
internode mode (layout with `num_tokens_per_rdma_rank`) beside ElasticBuffer's hybrid engine, and the low-latency
rows give each call's span and the hooks' send / receive spans (a call is several kernels there) instead of kernel
times; on one GPU with ranks sharing it they are logic-grade only:

    DEEPEP_CUPY_SCALEUP_SIZE=1 launch/run_local.sh 2 python perf/v1_bench.py --tokens 128 --ll-tokens 128
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)     # run from a checkout without installing

from deepep_cupy.runtime import preflight  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--tokens', default='128,4096', help='normal-mode tokens per rank, comma separated')
    p.add_argument('--hidden', type=int, default=7168, help='hidden size')
    p.add_argument('--num-topk', type=int, default=8, help='top-k')
    p.add_argument('--num-experts', type=int, default=256, help='experts (normal mode)')
    p.add_argument('--num-sms', type=int, default=24, help='SMs of every normal-mode call, both APIs')
    p.add_argument('--ll-tokens', type=int, default=128, help='low-latency tokens per rank (0: skip)')
    p.add_argument('--ll-experts', type=int, default=288, help='experts (low-latency mode)')
    p.add_argument('--seed', type=int, default=0, help='input seed')
    p.add_argument('--out', default='', help='directory for v1_bench.json')
    return p


def domains(buf) -> str:
    """`' in D scale-up domains'` for a V1 Buffer across domains (its internode mode), else nothing."""
    mode = getattr(buf, '_internode', None) or getattr(buf, '_ll_internode', None)
    return f' in {mode.num_domains} scale-up domains' if mode is not None else ''


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    preflight.check_cuda()
    import torch

    from deepep_cupy.buffers.elastic import ElasticBuffer
    from deepep_cupy.runtime.group import get_group
    from deepep_cupy.tests import legacy_low_latency as ll_prog
    from deepep_cupy.tests import legacy_perf
    from deepep_cupy.tests.legacy_intranode import Case
    from deepep_cupy.utils.envs import init_dist
    from deepep_cupy.v1.buffer import Buffer

    rank, R, _ = init_dist(seed=args.seed)
    group = get_group()
    E = R * max(1, args.num_experts // R)
    results = {}

    def emit(key, lines):
        gathered = group.allgather_object(lines)
        results[key] = gathered
        if rank == 0:
            for rank_lines in gathered:
                for line in rank_lines:
                    print(line, flush=True)

    for tokens in [int(t) for t in args.tokens.split(',') if t.strip()]:
        case = Case(group, tokens, args.hidden, args.num_topk, E, args.seed)
        buf = Buffer(group, int(2e9), 0, explicitly_destroy=True)
        eb = ElasticBuffer(group, num_max_tokens_per_rank=tokens, hidden=args.hidden, num_topk=args.num_topk,
                           explicitly_destroy=True)
        try:
            if rank == 0:
                print(f'== normal mode: {tokens} tokens, hidden {args.hidden}, top-{args.num_topk}, {E} experts, '
                      f'{R} ranks{domains(buf)}, {args.num_sms} SMs ==', flush=True)
            emit(f'normal_{tokens}', legacy_perf.normal_rows(buf, eb, case, args.num_sms, group))
        finally:
            torch.cuda.synchronize()
            buf.destroy()
            eb.destroy()
    if args.ll_tokens:
        M, H, LE = args.ll_tokens, args.hidden, R * max(1, args.ll_experts // R)
        rdma = Buffer.get_low_latency_rdma_size_hint(M, H, R, LE)
        buf = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=LE // R, explicitly_destroy=True)
        eb = ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=args.num_topk,
                           explicitly_destroy=True)
        try:
            inp = ll_prog.Inputs(group, rank, R, M, H, args.num_topk, LE, args.seed)
            if rank == 0:
                print(f'== low-latency mode: {M} tokens, hidden {H}, top-{args.num_topk}, {LE} experts'
                      f'{domains(buf)} ==', flush=True)
            lines = legacy_perf.low_latency_rows(buf, inp, M, group)
            fp8 = inp.x.float()
            from deepep_cupy.utils.math import per_token_cast_to_fp8
            x8 = per_token_cast_to_fp8(fp8.to(torch.bfloat16))
            w = inp.topk_weights

            def eb_decode():
                o = eb.dispatch(x8, inp.topk_idx, w, num_experts=LE, do_cpu_sync=False)
                eb.combine(o[0][0].float().to(torch.bfloat16), o[3])
            group.barrier()
            g = legacy_perf.graph_us(eb_decode)
            lines.append(f'[ll] rank {rank} | ElasticBuffer decode (no CPU sync, FP8) dispatch + combine, CUDA graph: '
                         f'{g:.1f} us')
            emit('low_latency', lines)
        finally:
            torch.cuda.synchronize()
            buf.destroy()
            eb.destroy()
    if args.out and rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, 'v1_bench.json'), 'w') as f:
            json.dump({'args': vars(args), 'ranks': R, 'results': results}, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(preflight.run(main))
