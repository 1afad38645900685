"""Reduce-scatter / all-reduce tuning sweep (one rank per GPU): GB/s of `reduce_scatter` and `all_reduce` over the
block count, the share of sending blocks and the chunk size, next to NCCL's reduce-scatter measured in the same run;
then the host time of one call (what bounds small reductions).

    mpirun -np 2 python perf/reduce_scatter_sweep.py [--sizes-mib 16,64] [--num-tests 20]

Prints one line per configuration on rank 0 (the slowest rank's time). The defaults of `deepep_cupy.features.agrs`
(`DEFAULT_REDUCE_SMS`, `SENDER_SHARE`, `CHUNK_MAX_ELEMS`) come from this sweep.
"""
import argparse
import cProfile
import io
import itertools
import pstats
import sys
import time

from deepep_cupy import ElasticBuffer
from deepep_cupy.features.agrs import plan as agrs  # reduce_layout reads SENDER_SHARE / CHUNK_MAX_ELEMS here
from deepep_cupy.runtime import preflight
from deepep_cupy.runtime.group import get_group
from deepep_cupy.runtime.nccl import create_nccl_comm
from deepep_cupy.utils.envs import init_dist
from deepep_cupy.utils.testing import bench

MiB = 1 << 20


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help line; the description keeps its line breaks."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='perf/reduce_scatter_sweep.py', description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument('--sizes-mib', default='16,64', help='input MiB per rank, comma separated')
    p.add_argument('--num-sms', default='48,64,96,128', help='block counts to sweep, comma separated')
    p.add_argument('--sender-shares', default='1/2,2/3', help='shares of the blocks that send, comma separated')
    p.add_argument('--chunk-max-elems', default='32768,65536', help='chunk sizes (elements) to sweep, comma separated')
    p.add_argument('--num-tests', type=int, default=20, help='timed calls per configuration')
    p.add_argument('--host-only', action='store_true', help='only the host time per call')
    p.add_argument('--profile', action='store_true', help='cProfile the host-time loops (rank 0 prints the top)')
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    preflight.check_cuda()
    import torch

    from deepep_cupy.tests.allocation import make_buffer
    rank, num_ranks, _ = init_dist()
    group = get_group()  # host group: MPI under mpirun, else the torch world init_dist joined
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    worst = lambda t: max(group.allgather_object(t))     # noqa: E731
    sizes = [int(s) * MiB for s in args.sizes_mib.split(',')]
    reduce_bytes = ElasticBuffer.get_agrs_reduce_num_bytes(group, max(sizes) // 4, 'all_reduce')
    buf = make_buffer(group, ElasticBuffer.get_agrs_buffer_size_hint(group, 0, reduce_bytes))
    nccl = create_nccl_comm(group)
    defaults = agrs.SENDER_SHARE, agrs.CHUNK_MAX_ELEMS
    try:
        for num_bytes in ([] if args.host_only else sizes):
            n = num_bytes // 4 // (8 * num_ranks) * (8 * num_ranks)
            x = torch.randn((n,), dtype=torch.float32, device='cuda')
            out = torch.empty((n // num_ranks,), dtype=torch.float32, device='cuda')
            base = worst(bench(lambda out=out, x=x: nccl.reduce_scatter(out, x), num_warmups=3,
                               num_tests=args.num_tests)[0])
            log(f'[nccl] reduce-scatter {num_bytes // MiB} MiB per rank: {num_bytes / base / 1e9:.1f} GB/s, '
                f'{base * 1e6:.1f} us')
            for sms, share, chunk in itertools.product(args.num_sms.split(','), args.sender_shares.split(','),
                                                       args.chunk_max_elems.split(',')):
                agrs.SENDER_SHARE = tuple(int(v) for v in share.split('/'))
                agrs.CHUNK_MAX_ELEMS = int(chunk)
                layout = agrs.reduce_layout(num_ranks, n, n // num_ranks, 4, False, int(sms))
                t = worst(bench(lambda x=x, s=int(sms): buf.reduce_scatter(x, num_sms=s).wait(), num_warmups=3,
                                num_tests=args.num_tests)[0])
                t_ar = worst(bench(lambda x=x, s=int(sms): buf.all_reduce(x, 1.0 / num_ranks, num_sms=s).wait(),
                                   num_warmups=3, num_tests=args.num_tests)[0])
                log(f'[sweep] {num_bytes // MiB:>3} MiB, {int(sms):>3} SMs ({layout.num_senders} send, '
                    f'{layout.num_reducers} reduce), chunk {int(chunk) * 4 // 1024} KiB: reduce-scatter '
                    f'{num_bytes / t / 1e9:6.1f} GB/s {t * 1e6:7.1f} us ({base / t:.2f} x NCCL) | all-reduce '
                    f'{num_bytes / t_ar / 1e9:6.1f} GB/s {t_ar * 1e6:7.1f} us')
            agrs.SENDER_SHARE, agrs.CHUNK_MAX_ELEMS = defaults
        # Host time per call: the CPU cost of one reduce_scatter on a small input (no synchronisation inside).
        small = torch.randn((num_ranks * 8 * 1024,), dtype=torch.float32, device='cuda')
        for name, fn in (('reduce_scatter', lambda: buf.reduce_scatter(small).wait()),
                         ('all_reduce', lambda: buf.all_reduce(small).wait())):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            profiler = cProfile.Profile() if args.profile else None
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            for _ in range(200):
                fn()
            host = (time.perf_counter() - t0) / 200
            if profiler is not None:
                profiler.disable()
            torch.cuda.synchronize()
            log(f'[host] {name} of {small.numel() * 4 // 1024} KiB: {host * 1e6:.1f} us of host time per call')
            if profiler is not None and rank == 0:
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats('tottime').print_stats(25)
                print(text.getvalue(), flush=True)
    finally:
        nccl.destroy()
        buf.destroy()
    return 0


if __name__ == '__main__':
    sys.exit(preflight.run(main))
