"""Host-side profile of one rank's dispatch/combine calls (where the Python time goes).

    launch/run_local.sh 1 python perf/profile_dispatch.py [--num-tokens 128] [--calls 200]
"""

import argparse
import cProfile
import io
import pstats
import sys
import time

from deepep_cupy import ElasticBuffer
from deepep_cupy.runtime import preflight
from deepep_cupy.runtime.group import get_group
from deepep_cupy.utils.envs import init_dist


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help line; the description keeps its line breaks."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='perf/profile_dispatch.py', description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument('--num-tokens', type=int, default=128, help='tokens of this rank')
    p.add_argument('--hidden', type=int, default=7168, help='hidden size: bfloat16 elements per token')
    p.add_argument('--num-topk', type=int, default=8, help='experts per token (top-k)')
    p.add_argument('--num-experts', type=int, default=256, help='experts in all')
    p.add_argument('--calls', type=int, default=200, help='calls timed per case, and profiled')
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    preflight.check_cuda()
    import torch
    rank, num_ranks, _ = init_dist()
    group = get_group()  # host group: MPI under mpirun, else the torch world init_dist joined
    buf = ElasticBuffer(group, num_max_tokens_per_rank=args.num_tokens, hidden=args.hidden, num_topk=args.num_topk,
                        explicitly_destroy=True)
    x = torch.randn(args.num_tokens, args.hidden, device='cuda').to(torch.bfloat16)
    idx = torch.topk(torch.rand(args.num_tokens, args.num_experts, device='cuda'), args.num_topk).indices
    w = torch.rand(args.num_tokens, args.num_topk, device='cuda')
    out = buf.dispatch(x, idx, w, num_experts=args.num_experts)
    comb_x = out[0].clone()
    for name, fn in (('dispatch cpu-sync', lambda: buf.dispatch(x, idx, w, num_experts=args.num_experts)),
                     ('dispatch no-sync', lambda: buf.dispatch(x, idx, w, num_experts=args.num_experts,
                                                               do_cpu_sync=False)),
                     ('dispatch cached', lambda: buf.dispatch(x, handle=out[3], topk_weights=w)),
                     ('combine', lambda: buf.combine(comb_x, out[3]))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        group.barrier()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        t_host = (time.perf_counter() - t0) / args.calls
        torch.cuda.synchronize()
        t_all = (time.perf_counter() - t0) / args.calls
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        t_gpu = start.elapsed_time(end) / args.calls / 1e3
        if rank == 0:
            print(f'[profile] {name}: host {t_host * 1e6:.1f} us/call, host+drain {t_all * 1e6:.1f} us/call, '
                  f'events {t_gpu * 1e6:.1f} us/call', flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        buf.dispatch(x, idx, w, num_experts=args.num_experts)
    prof.disable()
    if rank == 0:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats('tottime').print_stats(22)
        print(s.getvalue()[:6000], flush=True)
    buf.destroy()
    return 0


if __name__ == '__main__':
    sys.exit(preflight.run(main))
