"""GPU barrier rank program: correctness, latency, timeout diagnosis and misconfiguration checks.

    mpirun -np N python -m deepep_cupy.tests.barrier [--num-barriers 1000] [--skip-timeout-test]

Correctness: each round, one rank (rotating) sleeps on the GPU and then every rank writes the round number into a
slot of every peer's buffer; after a barrier every rank checks that all slots hold the round number, then a second
barrier keeps the next round's writes out. A barrier that does not wait for the late rank shows up as mismatches.
Then the average barrier time over `--num-barriers` barriers is printed. The timeout test leaves one rank out of a
barrier and checks that every other rank raises `TimeoutError` naming it; the configuration test gives one rank a
different buffer size and checks that every rank raises `ValueError`.
"""

import sys
import time

import numpy as np

from .. import BufferBase
from ..features.barrier import TEST_CHECK_OFFSET, all_specs
from ..jit import launch
from ..runtime import preflight
from ..runtime.group import get_group
from ..utils.envs import init_dist
from . import cli
from .common import log


def test_correctness(buf: BufferBase, num_rounds: int, delay_ns: int) -> int:
    import cupy
    b = buf._barrier
    n, r = buf.num_scaleup_ranks, buf.scaleup_rank_idx
    mismatches = cupy.zeros(1, dtype=np.int32)
    stream = buf.comm_stream
    for i in range(1, num_rounds + 1):
        late = (i % n == r)
        b.test_write.launch(1, 32, stream=stream, peer_bases=buf.sym.peer_bases_ptr, check_offset=TEST_CHECK_OFFSET,
                            rank=r, num_ranks=n, value=i, delay_ns=delay_ns if late else 0)
        b(stream)
        b.test_check.launch(1, 32, stream=stream, peer_bases=buf.sym.peer_bases_ptr, check_offset=TEST_CHECK_OFFSET,
                            rank=r, num_ranks=n, value=i, num_mismatches=mismatches)
        b(stream)
    buf.synchronize()
    return int(mismatches.get()[0])


def bench_barrier(buf: BufferBase, num_barriers: int):
    """Average µs per barrier: (GPU time from a CUDA-graph replay of `num_barriers` barriers, time per barrier
    issued one by one from Python, i.e. including the host launch cost). With several scale-up domains the graph
    holds the intra-domain kernel only and the one-by-one figure is the full `buf.barrier()` (with NCCL)."""
    import cupy
    stream = buf.comm_stream
    full = buf.nccl is not None
    for _ in range(50):
        buf._barrier(stream)
    buf.synchronize()

    # Issued from Python, one launch per barrier.
    buf.group.barrier()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(num_barriers):
        if full:
            buf.barrier(use_comm_stream=True)
        else:
            buf._barrier(stream)
    end.record(stream)
    buf.synchronize()
    issued_us = cupy.cuda.get_elapsed_time(start, end) * 1e3 / num_barriers

    # Replayed from a CUDA graph: the barrier's own latency.
    stream.begin_capture()
    for _ in range(num_barriers):
        buf._barrier(stream)
    graph = stream.end_capture()
    graph.upload(stream)
    buf.synchronize()
    buf.group.barrier()
    start.record(stream)
    graph.launch(stream)
    end.record(stream)
    buf.synchronize()
    graph_us = cupy.cuda.get_elapsed_time(start, end) * 1e3 / num_barriers
    return graph_us, issued_us


def test_timeout(group, timeout_secs: float) -> bool:
    buf = BufferBase(group=group, num_bytes=0, num_gpu_timeout_secs=timeout_secs, explicitly_destroy=True)
    victim = group.size - 1
    outcome = 'skipped (the missing rank)'
    if group.rank != victim:
        t0 = time.monotonic()
        try:
            buf.barrier(with_cpu_sync=True)
            outcome = 'no error'
        except TimeoutError as e:
            ok = f'waited for rank {victim}' in str(e) and 'barrier' in str(e)
            outcome = f'TimeoutError after {time.monotonic() - t0:.1f} s' + ('' if ok else f' (bad message: {e})')
            log(group, f'[timeout] rank {group.rank}: {e}', all_ranks=group.rank == 0)
    outcomes = group.allgather_object(outcome)
    buf.destroy()
    good = all(o.startswith('TimeoutError') and '(bad' not in o for r, o in enumerate(outcomes) if r != victim)
    for r, o in enumerate(outcomes):
        log(group, f'[timeout] rank {r}: {o}')
    return good


def test_wrong_config(group) -> bool:
    num_bytes = (4 if group.rank == 0 else 2) * 1024 * 1024
    try:
        buf = BufferBase(group=group, num_bytes=num_bytes, explicitly_destroy=True)
        buf.destroy()
        outcome = 'no error'
    except ValueError as e:
        outcome = f'ValueError: {e}'
    outcomes = group.allgather_object(outcome)
    log(group, f'[config] rank 0 saw: {outcomes[0]}')
    return all(o.startswith('ValueError') and 'num_bytes' in o for o in outcomes)


def main(argv=None) -> int:
    parser = cli.barrier_parser()
    args = parser.parse_args(argv)
    preflight.check_cuda()

    init_dist()  # joins the job the launcher made (mpirun, torchrun, SLURM)
    group = get_group()
    ok = True
    if not args.skip_config_test and group.size > 1:
        good = test_wrong_config(group)
        log(group, f'[config] mismatched num_bytes raised ValueError on every rank: {"OK" if good else "FAILED"}')
        ok &= good

    t0 = time.perf_counter()
    buf = BufferBase(group=group, num_bytes=2 * 1024 * 1024, num_gpu_timeout_secs=args.num_gpu_timeout_secs,
                     explicitly_destroy=True)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    launch.load_kernels(all_specs(buf.num_scaleup_ranks))
    lookup_us = 1e6 * (time.perf_counter() - t0)
    log(group, f'[init] {group.size} rank(s), scale-up {buf.num_scaleup_ranks}, {buf.topology.num_ranks_per_gpu()} '
               f'rank(s) per GPU; buffer built in {build_s * 1e3:.1f} ms; kernel lookup {lookup_us:.1f} us')

    mismatches = test_correctness(buf, args.num_rounds, int(args.delay_us * 1e3))
    all_mismatches = group.allgather_object(mismatches)
    good = sum(all_mismatches) == 0
    log(group, f'[check] {args.num_rounds} rounds with a late rank: mismatches per rank {all_mismatches}: '
               f'{"OK" if good else "FAILED"}')
    ok &= good

    if not args.skip_perf_test:
        us = bench_barrier(buf, args.num_barriers)
        all_us = group.allgather_object(us)
        for r, (graph_us, issued_us) in enumerate(all_us):
            log(group, f'[perf] rank {r}: {graph_us:.2f} us per barrier (GPU, CUDA-graph replay of '
                       f'{args.num_barriers}); {issued_us:.2f} us per barrier launched one by one from Python')
    buf.destroy()

    # NCCL waits between scale-up domains cannot be bounded from the GPU side: the timeout test covers the IPC barrier.
    if not args.skip_timeout_test and group.size > 1 and buf.num_scaleout_ranks == 1:
        good = test_timeout(group, args.timeout_test_secs)
        log(group, f'[timeout] missing rank reported as TimeoutError on every other rank: {"OK" if good else "FAILED"}')
        ok &= good

    log(group, 'barrier test: PASSED' if ok else 'barrier test: FAILED')
    group.barrier()
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
