"""All-gather sessions / reduce-scatter / all-reduce rank program (DeepEP's `tests/elastic/test_agrs.py` flags).

    mpirun -np N python -m deepep_cupy.tests.agrs [--num-max-inflight-agrs 4 --num-stress-iterations 4]
    # hybrid mode, 2 domains x 2 ranks on one GPU (rails through the IPC loopback):
    DEEPEP_CUPY_SCALEUP_SIZE=2 DEEPEP_CUPY_RAIL_TRANSPORT=loopback launch/run_local.sh 4 python -m \
        deepep_cupy.tests.agrs --skip-perf-test

Stress: per iteration, a random interleaving (the same on every rank) of batched and single, in-place and copied
gathers of BF16 tensors of shape (32, 64, 2048), fetches (wait handle + clone) in random order, session
destroy/create, and reduce-scatters (FP32 / BF16 inputs, FP32 / BF16 communication, scales) and all-reduces of random
sizes whose results are waited for later. Every rank generates every rank's inputs from seeds (numpy, on the host),
so the references need neither NCCL nor the code under test; gathers must match bit for bit (random bit patterns,
NaNs included), reductions must equal the numpy references of `deepep_cupy.features.agrs.reference` (same FP32
order; with several scale-up domains, e.g. `DEEPEP_CUPY_SCALEUP_SIZE=1`, the hybrid ones: per-domain partials, then
domains in order) bit for bit. Then
CuPy arrays, argument errors, a size mismatch and a missing rank (reported as `TimeoutError`), and the performance
sweep 1 MiB … 64 MiB per rank: all-gather `GB/s = bytes · R · inflight / avg_t` (DeepEP's formula) and reductions
`GB/s = input bytes per rank / t`, next to NCCL's all-gather / reduce-scatter / all-reduce measured in the same run
(skipped when ranks share a GPU).
"""

import random
import sys
import time
import traceback

import numpy as np

from ..runtime import preflight
from . import cli

try:
    import torch
except ImportError as e:  # `--help` works without torch; a run names the extra that brings it
    preflight.exit_if_main(e, __name__, cli.agrs_parser)
    raise

from .. import ElasticBuffer
from ..features.agrs import kernels as agrs_kernels
from ..features.agrs import reference as agrs_reference
from ..runtime.group import get_group
from ..utils.envs import init_dist
from ..utils.testing import bench, flush_l2_cache
from .common import Failure, check, expect_error

STRESS_SHAPE = (32, 64, 2048)
MiB = 1 << 20
# Where the checks put their tensors ('cpu' lets tests/test_agrs_cpu.py run the stress against emulated kernels).
DEVICE = 'cuda'


def make_buffer(group, num_bytes: int, **kwargs):
    """The buffer under test: an `ElasticBuffer`."""
    return ElasticBuffer(group, num_bytes=num_bytes, explicitly_destroy=True, **kwargs)


def sync(buf):
    """Wait, bounded, for the communication stream and the current stream; raises TimeoutError on a GPU timeout."""
    from ..runtime import interop
    buf.synchronize(buf.comm_stream)
    buf.synchronize(interop.current_stream())


def check_bits(got: torch.Tensor, want: torch.Tensor, what: str):
    """Bitwise equality through integer views; reports the first mismatch."""
    check(tuple(got.shape) == tuple(want.shape), f'{what}: shape {tuple(got.shape)} != {tuple(want.shape)}')
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    a, b = got.contiguous().view(view), want.to(got.device).contiguous().view(view)
    diff = a != b
    if bool(diff.any()):
        idx = tuple(diff.nonzero()[0].tolist())
        raise Failure(f'{what}: {int(diff.sum())} mismatches, first at {list(idx)}: got {a[idx].item():#x}, '
                      f'expected {b[idx].item():#x} (raw bits)')


# ---- inputs (every rank can generate every rank's) -----------------------------------------------------------------
def gather_input(seed: int, iteration: int, op: int, rank: int, shape) -> torch.Tensor:
    """Random bit patterns as a CPU bfloat16 tensor (every pattern, NaNs included: gathers move bits)."""
    nbytes = int(np.prod(shape)) * 2
    rng = np.random.default_rng([seed, iteration, op, rank, 1])
    return torch.from_numpy(np.frombuffer(rng.bytes(nbytes), dtype=np.int16).copy()).view(torch.bfloat16).view(shape)


def reduce_input(seed: int, iteration: int, op: int, rank: int, num_elems: int, bf16: bool) -> np.ndarray:
    """Normal values, float32 or bfloat16 bits (uint16)."""
    x = np.random.default_rng([seed, iteration, op, rank, 2]).standard_normal(num_elems, dtype=np.float32)
    return agrs_reference.f32_to_bf16_bits(x) if bf16 else x


def rs_reference(buf, inputs, rank: int, comm_precision: str, scale: float) -> np.ndarray:
    """The reduce-scatter reference for this buffer's domains (hybrid order with several)."""
    if buf.num_scaleout_ranks > 1:
        return agrs_reference.hybrid_reduce_scatter_reference(inputs, rank, buf.num_scaleout_ranks, comm_precision,
                                                              scale)
    return agrs_reference.reduce_scatter_reference(inputs, rank, comm_precision, scale)


def ar_reference(buf, inputs, scale: float = 1.0) -> np.ndarray:
    """The all-reduce reference for this buffer's domains (hybrid order with several)."""
    if buf.num_scaleout_ranks > 1:
        return agrs_reference.hybrid_all_reduce_reference(inputs, buf.num_scaleout_ranks, scale)
    return agrs_reference.all_reduce_reference(inputs, scale)


def to_device(a: np.ndarray) -> torch.Tensor:
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(DEVICE)
    return torch.from_numpy(a.copy()).to(DEVICE)


# ---- stress ----------------------------------------------------------------------------------------------------------
def reduction_params(rng: random.Random, num_ranks: int) -> dict:
    kind = rng.choice(('rs', 'ar'))
    if kind == 'rs':
        return {'kind': 'rs', 'num_elems': num_ranks * 8 * rng.randint(1, 6000), 'bf16_input': rng.random() < 0.3,
                'comm_precision': rng.choice(agrs_kernels.COMM_PRECISIONS),
                'scale': rng.choice((1.0, 0.5, 1 / num_ranks, 3.0)),
                'two_dim': rng.random() < 0.5}
    return {'kind': 'ar', 'num_elems': rng.randint(1, 100_000), 'scale': rng.choice((1.0, 1 / num_ranks, 0.1))}


def generate_stress_ops(rng: random.Random, num_gathers: int, limit: int, num_reductions: int, num_ranks: int):
    """A random interleaving of ('create',), ('ag', ids, inplace, batched), ('fetch', id), ('destroy',),
    ('reduce', id, params), ('reduce_wait', id): every gather is issued once and fetched once, a session never holds
    more than `limit` tensors, sessions are destroyed only with nothing in flight."""
    ops = [('create',)]
    unprocessed = list(range(num_gathers))
    rng.shuffle(unprocessed)
    inflight, pending = [], []
    in_session, next_reduction = 0, 0
    while unprocessed or inflight or next_reduction < num_reductions or pending:
        choices = []
        if unprocessed and in_session < limit:
            choices.append('ag')
        if inflight:
            choices.append('fetch')
        if not inflight and in_session > 0:
            choices.append('destroy')
        if next_reduction < num_reductions:
            choices.append('reduce')
        if pending:
            choices.append('reduce_wait')
        op = rng.choice(choices)
        if op == 'ag':
            k = rng.randint(1, min(limit - in_session, len(unprocessed)))
            batch = tuple(unprocessed[-k:])
            del unprocessed[-k:]
            ops.append(('ag', batch, rng.random() < 0.5, rng.random() < 0.5))
            inflight.extend(batch)
            in_session += k
        elif op == 'fetch':
            ops.append(('fetch', inflight.pop(rng.randrange(len(inflight)))))
        elif op == 'destroy':
            ops += [('destroy',), ('create',)]
            in_session = 0
        elif op == 'reduce':
            ops.append(('reduce', next_reduction, reduction_params(rng, num_ranks)))
            pending.append(next_reduction)
            next_reduction += 1
        else:
            ops.append(('reduce_wait', pending.pop(rng.randrange(len(pending)))))
    ops.append(('destroy',))
    return ops


def run_stress(buf, args, iteration: int) -> int:
    """One stress iteration; returns the number of checked results. Raises Failure on a mismatch."""
    rank, num_ranks = buf.rank_idx, buf.num_ranks
    rng = random.Random(args.seed * 1000 + iteration)
    num_gathers = args.num_stress_gathers
    ops = generate_stress_ops(rng, num_gathers, args.num_max_inflight_agrs, args.num_stress_reductions, num_ranks)
    tensors = [gather_input(args.seed, iteration, i, rank, STRESS_SHAPE).to(DEVICE) for i in range(num_gathers)]
    outputs, handles, results = {}, {}, {}
    reductions, reduction_results = {}, {}
    for op in ops:
        if op[0] == 'create':
            buf.create_agrs_session()
        elif op[0] == 'destroy':
            buf.destroy_agrs_session()
        elif op[0] == 'ag':
            _, ids, inplace, batched = op
            srcs = [tensors[i] for i in ids]
            if inplace:
                views = buf.agrs_get_inplace_tensor(tuple(t.shape for t in srcs), torch.bfloat16)
                for v, t in zip(views, srcs):
                    v.copy_(t)
                srcs = views
            if batched:
                *outs, handle = buf.all_gather(srcs)
                for i, out in zip(ids, outs):
                    outputs[i], handles[i] = out, handle
            else:
                for i, t in zip(ids, srcs):
                    outputs[i], handles[i] = buf.all_gather(t)
        elif op[0] == 'fetch':
            i = op[1]
            handles.pop(i)()
            results[i] = outputs.pop(i).clone()
        elif op[0] == 'reduce':
            _, rid, p = op
            if p['kind'] == 'rs':
                x = to_device(reduce_input(args.seed, iteration, 1000 + rid, rank, p['num_elems'], p['bf16_input']))
                if p['two_dim']:
                    x = x.view(num_ranks, -1)
                event = buf.reduce_scatter(x, comm_precision=p['comm_precision'], scale=p['scale'],
                                           num_sms=args.num_sms)
            else:
                x = to_device(reduce_input(args.seed, iteration, 1000 + rid, rank, p['num_elems'], False))
                event = buf.all_reduce(x, scale=p['scale'], num_sms=args.num_sms)
            reductions[rid] = (event, p)
        else:
            event, p = reductions.pop(op[1])
            reduction_results[op[1]] = (event.wait().clone(), p)
    sync(buf)

    for i in range(num_gathers):
        ref = torch.stack([gather_input(args.seed, iteration, i, r, STRESS_SHAPE) for r in range(num_ranks)])
        check_bits(results[i], ref, f'rank {rank}: stress gather mismatch at seed={args.seed}, iteration={iteration}, '
                                    f'op={i}')
    for rid, (got, p) in sorted(reduction_results.items()):
        if p['kind'] == 'rs':
            inputs = [reduce_input(args.seed, iteration, 1000 + rid, r, p['num_elems'], p['bf16_input'])
                      for r in range(num_ranks)]
            want = rs_reference(buf, inputs, rank, p['comm_precision'], p['scale'])
        else:
            inputs = [reduce_input(args.seed, iteration, 1000 + rid, r, p['num_elems'], False)
                      for r in range(num_ranks)]
            want = ar_reference(buf, inputs, p['scale'])
        check_bits(got.reshape(-1), to_device(want), f'rank {rank}: {p} mismatch at seed={args.seed}, '
                                                     f'iteration={iteration}, reduction={rid}')
    return num_gathers + len(reduction_results)


# ---- CuPy, argument errors, failures ---------------------------------------------------------------------------------
def test_cupy(buf, args):
    import cupy
    rank, num_ranks = buf.rank_idx, buf.num_ranks
    x = cupy.asarray(np.arange(4096, dtype=np.uint16) + np.uint16(rank * 7))
    with buf.agrs_new_session():
        out, handle = buf.all_gather(x)
        handle()
        got = cupy.asnumpy(out)
    check(isinstance(out, cupy.ndarray) and out.dtype == np.uint16 and out.shape == (num_ranks, 4096),
          f'CuPy all_gather output {type(out).__name__} {out.dtype} {out.shape}')
    want = np.stack([np.arange(4096, dtype=np.uint16) + np.uint16(r * 7) for r in range(num_ranks)])
    check(np.array_equal(got, want), f'rank {rank}: CuPy all_gather mismatch')
    inputs = [reduce_input(args.seed, 0, 99, r, num_ranks * 1024, False) for r in range(num_ranks)]
    out = buf.reduce_scatter(cupy.asarray(inputs[rank]), comm_precision='bf16', scale=0.25).wait()
    check(isinstance(out, cupy.ndarray) and out.dtype == np.float32, 'CuPy reduce_scatter output type')
    want = rs_reference(buf, inputs, rank, 'bf16', 0.25)
    check(np.array_equal(cupy.asnumpy(out).view(np.uint32), want.view(np.uint32)),
          f'rank {rank}: CuPy reduce_scatter mismatch')
    y = cupy.asarray(inputs[rank][:3001])
    got = buf.all_reduce(y).wait()
    check(got is y, 'all_reduce returns its input')
    want = ar_reference(buf, [a[:3001] for a in inputs])
    check(np.array_equal(cupy.asnumpy(y).view(np.uint32), want.view(np.uint32)),
          f'rank {rank}: CuPy all_reduce mismatch')


def _many_input(k: int, rank: int, n: int, dtype) -> torch.Tensor:
    """Tensor k of `rank` in `test_many_tensors` (on the host: the reference needs every rank's)."""
    return (torch.arange(n, dtype=torch.int64) * (k + 3) + rank * 11 + k).remainder(251).to(dtype)


def test_many_tensors(buf, args, session_bytes: int) -> int:
    """All-gathers of more tensors than one batched launch holds (agrs_gather_batch_kernel takes 8): 11 tensors in one
    call (the first in place, one of an odd size, one 16-byte aligned in size but not in address: the byte path),
    then 9 (8 + 1) waited on a side stream, and a reduce-scatter waited on a side stream (the sources and outputs
    marked as used on the communication stream then). Every output checked bit for bit; returns the number checked."""
    rank, num_ranks = buf.rank_idx, buf.num_ranks
    buf.agrs_set_config(session_bytes, 24, num_sms=args.num_sms)
    kinds = [(256, torch.float32), (1001, torch.uint8), (256, torch.uint8), (64, torch.bfloat16), (300, torch.int32),
             (16, torch.uint8), (77, torch.bfloat16), (512, torch.uint8), (1, torch.float32), (410, torch.int32),
             (2, torch.uint8)]        # (about 8 KiB per rank with the second call: fits the stress session)
    checked = 0
    with buf.agrs_new_session():
        srcs = [_many_input(k, rank, n, dt).to(DEVICE) for k, (n, dt) in enumerate(kinds)]
        view = buf.agrs_get_inplace_tensor((kinds[0][0],), kinds[0][1])
        view.copy_(srcs[0])
        srcs[0] = view
        shifted = torch.zeros(kinds[2][0] + 16, dtype=torch.uint8, device=DEVICE)
        shifted[1:1 + kinds[2][0]].copy_(srcs[2])
        srcs[2] = shifted[1:1 + kinds[2][0]]          # 256 bytes at an odd address
        *outs, handle = buf.all_gather(srcs)
        handle()
        second = [_many_input(20 + k, rank, 16 + 16 * k, torch.float32).to(DEVICE) for k in range(9)]
        *outs2, handle2 = buf.all_gather(second)
        side = torch.cuda.Stream() if DEVICE == 'cuda' else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                handle2()
            torch.cuda.current_stream().wait_stream(side)
        else:
            handle2()
        del second, handle2
        for k, ((n, dt), out) in enumerate(zip(kinds, outs)):
            want = torch.stack([_many_input(k, r, n, dt) for r in range(num_ranks)])
            check_bits(out.cpu(), want, f'rank {rank}: 11-tensor all_gather, tensor {k} ({n} x {dt})')
        for k, out in enumerate(outs2):
            want = torch.stack([_many_input(20 + k, r, 16 + 16 * k, torch.float32) for r in range(num_ranks)])
            check_bits(out.cpu(), want, f'rank {rank}: 9-tensor all_gather waited on a side stream, tensor {k}')
        checked += len(outs) + len(outs2)
    inputs = [reduce_input(args.seed, 0, 77, r, num_ranks * 2048, False) for r in range(num_ranks)]
    event = buf.reduce_scatter(to_device(inputs[rank]))
    if DEVICE == 'cuda':
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            got = event.wait().clone()
        torch.cuda.current_stream().wait_stream(side)
    else:
        got = event.wait().clone()
    del event
    check_bits(got, to_device(rs_reference(buf, inputs, rank, 'fp32', 1.0)),
               f'rank {rank}: reduce_scatter waited on a side stream')
    buf.agrs_set_config(session_bytes, args.num_max_inflight_agrs, num_sms=args.num_sms)
    return checked + 1


def test_errors(buf, args) -> list:
    """Invalid calls must raise before any kernel runs and leave the buffer usable."""
    tried = []
    t = torch.zeros(STRESS_SHAPE, dtype=torch.bfloat16, device=DEVICE)

    def expect(name, exc, fn):
        expect_error(tried, name, exc, fn)

    expect('all_gather outside a session', RuntimeError, lambda: buf.all_gather(t))
    expect('destroy without a session', RuntimeError, buf.destroy_agrs_session)
    expect('33 gathers per session', ValueError, lambda: buf.agrs_set_config(1 << 20, 33))
    expect('session bytes over num_bytes', ValueError, lambda: buf.agrs_set_config(buf.num_bytes + 32))
    stale = []
    with buf.agrs_new_session():
        expect('second session', RuntimeError, buf.create_agrs_session)
        if DEVICE == 'cuda':
            expect('host tensor', ValueError, lambda: buf.all_gather(t.cpu()))
            expect('mixed kinds', TypeError, lambda: buf.all_gather([t, __import__('cupy').zeros(8)]))
        expect('non-contiguous', ValueError, lambda: buf.all_gather(t.transpose(0, 1)))
        expect('too many tensors', ValueError, lambda: buf.all_gather([t] * (args.num_max_inflight_agrs + 1)))
        big = torch.zeros(buf._agrs.plan.capacity // buf.num_ranks + 64, dtype=torch.uint8, device=DEVICE)
        expect('too many bytes', ValueError, lambda: buf.all_gather(big))
        views = buf.agrs_get_inplace_tensor((STRESS_SHAPE, STRESS_SHAPE), torch.bfloat16)
        expect('in-place views out of order', ValueError, lambda: buf.all_gather(views[1]))
        expect('bad shapes', ValueError, lambda: buf.agrs_get_inplace_tensor([], torch.bfloat16))
        out, handle = buf.all_gather(views[0])      # a valid gather, so the session is not empty
        stale.append(handle)
        handle()
    expect('wait handle after destroy', RuntimeError, stale[0])
    x = torch.zeros(buf.num_ranks * 64, dtype=torch.float32, device=DEVICE)
    expect('reduce_scatter int32', TypeError, lambda: buf.reduce_scatter(x.int()))
    expect('reduce_scatter shard not a multiple of 8', ValueError,
           lambda: buf.reduce_scatter(torch.zeros(buf.num_ranks * 12, device=DEVICE)))
    expect('reduce_scatter first dim', ValueError,
           lambda: buf.reduce_scatter(torch.zeros(buf.num_ranks * 64 + 1, device=DEVICE)))
    expect('reduce_scatter comm_precision', ValueError, lambda: buf.reduce_scatter(x, comm_precision='fp16'))
    expect('reduce_scatter scale', TypeError, lambda: buf.reduce_scatter(x, scale='1'))
    expect('all_reduce bfloat16', TypeError, lambda: buf.all_reduce(x.bfloat16()))
    expect('all_reduce too large', ValueError,
           lambda: buf.all_reduce(torch.zeros(buf.num_bytes // 2, dtype=torch.float32, device=DEVICE)))
    # Still usable: more gathers (one of an odd size: byte path, unaligned slots) and a reduction, checked.
    with buf.agrs_new_session():
        y = torch.full((1024,), buf.rank_idx, dtype=torch.int32, device=DEVICE)
        odd = (torch.arange(1001, dtype=torch.int32) * 7 + buf.rank_idx).to(torch.uint8).to(DEVICE)
        out_odd, h_odd = buf.all_gather(odd)
        out, handle = buf.all_gather(y)
        h_odd()
        handle()
        check(torch.equal(out.cpu(), torch.arange(buf.num_ranks, dtype=torch.int32)[:, None].expand(-1, 1024)),
              'gather after the error cases')
        want = ((torch.arange(1001, dtype=torch.int32)[None] * 7 + torch.arange(buf.num_ranks)[:, None])
                .to(torch.uint8))
        check(torch.equal(out_odd.cpu(), want), 'odd-sized gather (1001 bytes per rank)')
    got = buf.all_reduce(torch.ones(777, device=DEVICE)).wait()
    check(bool((got == buf.num_ranks).all()), 'all_reduce after the error cases')
    return tried


def test_failures(args, group) -> bool:
    """Ranks gathering different sizes, then a rank that never gathers: the others get TimeoutError (bounded)."""
    outcomes = []
    for case in ('mismatch', 'missing'):
        buf = make_buffer(group, ElasticBuffer.get_agrs_buffer_size_hint(group, 2 * MiB),
                          num_gpu_timeout_secs=args.timeout_test_secs)
        buf.agrs_set_config(2 * MiB, 4)
        victim = group.size - 1
        buf.create_agrs_session()
        outcome = 'skipped (the missing rank)'
        if case == 'mismatch' or group.rank != victim:
            n = 4096 if (case == 'mismatch' and group.rank == 0) else 8192
            out, handle = buf.all_gather(torch.zeros(n, dtype=torch.uint8, device=DEVICE))
            handle()
            try:
                sync(buf)
                outcome = 'no error'
            except TimeoutError as e:
                # Size mismatch: the ranks that compare sizes report it (aux 2). Across domains a rank may instead
                # time out waiting for a domain peer that stopped at the mismatch (aux 1): some rank must say aux 2.
                hybrid = buf.num_scaleout_ranks > 1     # several scale-up domains
                good = 'all-gather' in str(e) and (case == 'missing' or 'aux 2' in str(e) or hybrid)
                outcome = f'TimeoutError{"" if good else f" (unexpected message: {e})"}'
                if case == 'mismatch' and hybrid and 'aux 2' in str(e):
                    outcome += ' [size mismatch named]'
                if group.rank == 0:
                    print(f'[failure] {case}, rank 0: {e}', flush=True)
        outcomes.append((case, outcome))
        num_domains = buf.num_scaleout_ranks
        buf.destroy()
    every = group.allgather_object(outcomes)
    good = True
    named = False
    for rank_outcomes in every:
        for case, outcome in rank_outcomes:
            named |= case == 'mismatch' and outcome.endswith('[size mismatch named]')
            outcome = outcome.replace(' [size mismatch named]', '')
            if not outcome.startswith('skipped'):
                good &= outcome == 'TimeoutError'
    if num_domains > 1:
        good &= named       # across domains: at least one rank named the size mismatch
    if group.rank == 0:
        for r, rank_outcomes in enumerate(every):
            print(f'[failure] rank {r}: {rank_outcomes}', flush=True)
    return good


# ---- performance -----------------------------------------------------------------------------------------------------
def time_sessions(buf, tensors, inplace: bool, batched: bool, num_tests: int) -> float:
    """DeepEP's loop: per test, a session with `len(tensors)` gathers, timed from after the L2 flush to after the
    session's destroy; returns the average seconds (first test dropped)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
    for i in range(num_tests):
        with buf.agrs_new_session():
            srcs = tensors
            if inplace:
                srcs = buf.agrs_get_inplace_tensor(tuple(t.shape for t in tensors), tensors[0].dtype)
                for v, t in zip(srcs, tensors):
                    v.copy_(t)
            flush_l2_cache()
            starts[i].record()
            if batched:
                handles = [buf.all_gather(list(srcs))[-1]]
            else:
                handles = [buf.all_gather(t)[1] for t in srcs]
            for h in handles:
                h()
        ends[i].record()
    sync(buf)
    return float(np.mean([s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)][1:]))


def time_nccl_gathers(nccl, tensors, num_ranks: int, num_tests: int) -> float:
    recvs = [torch.empty((num_ranks, *t.shape), dtype=t.dtype, device='cuda') for t in tensors]
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
    for i in range(num_tests):
        flush_l2_cache()
        starts[i].record()
        for t, r in zip(tensors, recvs):
            nccl.all_gather(r, t)
        ends[i].record()
    torch.cuda.synchronize()
    return float(np.mean([s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)][1:]))


def perf_reductions(buf, args, nccl, num_bytes: int, num_tests: int, worst):
    """`(name, GB/s, seconds, NCCL GB/s or None)` per reduction of `num_bytes` FP32 input bytes per rank."""
    num_ranks = buf.num_ranks
    num_elems = num_bytes // 4 // (8 * num_ranks) * (8 * num_ranks)      # shards of a multiple of 8 elements
    x = torch.randn((num_elems,), dtype=torch.float32, device='cuda')
    out = torch.empty((num_elems // num_ranks,), dtype=torch.float32, device='cuda')
    cases = (
        ('reduce-scatter fp32', lambda: buf.reduce_scatter(x, num_sms=args.num_sms).wait(),
         lambda: nccl.reduce_scatter(out, x)),
        ('reduce-scatter bf16-comm', lambda: buf.reduce_scatter(x, 'bf16', num_sms=args.num_sms).wait(), None),
        ('all-reduce fp32', lambda: buf.all_reduce(x, 1.0 / num_ranks, num_sms=args.num_sms).wait(),
         lambda: nccl.all_reduce(x, x)))
    rows = []
    for name, ours, theirs in cases:
        t = worst(bench(ours, num_warmups=3, num_tests=num_tests)[0])
        base = None
        if nccl is not None and theirs is not None:
            base = num_bytes / worst(bench(theirs, num_warmups=3, num_tests=num_tests)[0])
        rows.append((name, num_bytes / t, t, base))
    return rows


def perf(buf, args, group, nccl, num_tests: int) -> dict:
    """Per-size lines; returns {(op, bytes per rank): (our GB/s, NCCL GB/s or None)} (all-gather: the best mode)."""
    num_ranks, inflight = buf.num_ranks, args.num_max_inflight_agrs
    log = (lambda s: print(s, flush=True)) if group.rank == 0 else (lambda s: None)
    worst = lambda t: max(group.allgather_object(t))     # noqa: E731  (slowest rank)
    best = {}
    for num_bytes in (2 ** p for p in range(20, 27)):
        tensors = [torch.randn((num_bytes // 2,), dtype=torch.bfloat16, device='cuda') for _ in range(inflight)]
        base = None
        if nccl is not None:
            base = num_bytes * num_ranks * inflight / worst(time_nccl_gathers(nccl, tensors, num_ranks, num_tests))
        for inplace in (False, True):
            for batched in (False, True):
                t = worst(time_sessions(buf, tensors, inplace, batched, num_tests))
                gbs = num_bytes * num_ranks * inflight / t
                ratio = f' | NCCL {base / 1e9:.1f} GB/s, ratio {gbs / base:.2f}' if base else ''
                log(f'[perf] all-gather {num_bytes // MiB:>2} MiB x {inflight}, in-place {int(inplace)}, batched '
                    f'{int(batched)}: {gbs / 1e9:.1f} GB/s, avg {t / inflight * 1e6:.1f} us per gather{ratio}')
                best[('all-gather', num_bytes)] = max(best.get(('all-gather', num_bytes), (0, base))[0], gbs), base
        del tensors

        for name, gbs, t, base in perf_reductions(buf, args, nccl, num_bytes, num_tests, worst):
            ratio = f' | NCCL {base / 1e9:.1f} GB/s, ratio {gbs / base:.2f}' if base else ''
            log(f'[perf] {name} {num_bytes // MiB:>2} MiB per rank: {gbs / 1e9:.1f} GB/s, {t * 1e6:.1f} us{ratio}')
            best[(name, num_bytes)] = gbs, base
    return best


def main(argv=None) -> int:
    p = cli.agrs_parser()
    args = p.parse_args(argv)
    preflight.check_cuda()

    rank, num_ranks, _ = init_dist(seed=args.seed)
    group = get_group()  # host group: MPI under mpirun, else the torch world init_dist joined
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    inflight = args.num_max_inflight_agrs
    timeouts = {'num_gpu_timeout_secs': args.num_gpu_timeout_secs, 'num_cpu_timeout_secs': args.num_cpu_timeout_secs}
    ok = True
    shared = None
    try:
        if not args.skip_check:
            session = ElasticBuffer.get_agrs_num_max_session_bytes(group, [STRESS_SHAPE] * inflight, torch.bfloat16)
            reduce_bytes = max(ElasticBuffer.get_agrs_reduce_num_bytes(group, 100_000, 'all_reduce'),
                               ElasticBuffer.get_agrs_reduce_num_bytes(group, num_ranks * 8 * 6000, 'reduce_scatter'))
            t0 = time.perf_counter()
            buf = make_buffer(group, ElasticBuffer.get_agrs_buffer_size_hint(group, session, reduce_bytes), **timeouts)
            buf.agrs_set_config(session, inflight, num_sms=args.num_sms)
            shared = buf.topology.num_ranks_per_gpu() > 1
            log(f'[init] {num_ranks} ranks, {buf.topology.num_ranks_per_gpu()} per GPU, {type(buf).__name__} of '
                f'{buf.num_bytes / MiB:.0f} MiB (session {session / MiB:.0f} MiB), built in '
                f'{time.perf_counter() - t0:.2f} s')
            try:
                for it in range(args.num_stress_iterations):
                    t0 = time.perf_counter()
                    n = run_stress(buf, args, it)
                    log(f'[stress] seed {args.seed}, iteration {it}: {n} results bitwise equal to the references '
                        f'({time.perf_counter() - t0:.1f} s)')
                test_cupy(buf, args)
                log('[check] CuPy arrays in, CuPy arrays out: bitwise equal')
                n = test_many_tensors(buf, args, session)
                log(f'[check] all-gathers of 11 and 9 tensors (batched launches of 8), a side-stream wait: {n} results '
                    f'bitwise equal')
                tried = test_errors(buf, args)
                log(f'[errors] {len(tried)} invalid calls raised before any kernel ran; the buffer still works:')
                for line in tried:
                    log(f'    {line}')
            finally:
                buf.destroy()
    except Failure as e:
        print(f'[rank {rank}] FAILED: {e}', flush=True)
        ok = False
    except Exception as e:      # a GPU timeout or an API error: report it and still reach the summary
        traceback.print_exc()
        print(f'[rank {rank}] FAILED: {type(e).__name__}: {e}', flush=True)
        ok = False
    ok = all(group.allgather_object(ok))

    if ok and not args.skip_failure_test and num_ranks > 1:
        good = test_failures(args, group)
        log(f'[failure] size mismatch and missing rank reported as TimeoutError: {"OK" if good else "FAILED"}')
        ok &= good

    if ok and not args.skip_perf_test:
        shape = (2 ** 25,)
        session = ElasticBuffer.get_agrs_num_max_session_bytes(group, [shape] * inflight, torch.bfloat16)
        reduce_bytes = ElasticBuffer.get_agrs_reduce_num_bytes(group, 2 ** 24, 'all_reduce')
        buf = make_buffer(group, ElasticBuffer.get_agrs_buffer_size_hint(group, session, reduce_bytes), **timeouts)
        try:
            buf.agrs_set_config(session, inflight, num_sms=args.num_sms)
            shared = buf.topology.num_ranks_per_gpu() > 1
            num_tests = min(args.num_perf_tests, 3) if shared else args.num_perf_tests
            nccl = None
            if shared:
                log('[perf] ranks share GPUs: timings are not meaningful and the NCCL baseline is skipped')
            else:
                from ..runtime.nccl import create_nccl_comm
                nccl = create_nccl_comm(group)
            best = perf(buf, args, group, nccl, num_tests)
            if nccl is not None:
                for name in ('all-gather', 'reduce-scatter fp32'):
                    gbs, base = best[(name, 64 * MiB)]
                    log(f'[target] {name} at 64 MiB per rank: {gbs / 1e9:.1f} GB/s vs NCCL {base / 1e9:.1f} GB/s: '
                        f'{"MET" if gbs >= base else "NOT MET"}')
                nccl.destroy()
        finally:
            buf.destroy()

    ok = all(group.allgather_object(ok))
    log('agrs test: PASSED' if ok else 'agrs test: FAILED')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
