"""DeepEP V2.5 API rank program: `BucketBuffer` / `BucketSession`, `EPBuffer` (dispatch / combine beside load balancing
on one buffer, `defer_epilogue`), `PPBuffer` and `EngramBuffer` (GPU and host storage), each checked bit for bit
against references computed on the host from every rank's inputs (no NCCL: ranks may share a GPU).

    mpirun -np N python -m deepep_cupy.tests.v25 [--num-tokens 256 --hidden 2048 --num-topk 8 --num-experts 64]

Buckets: all-reduce, reduce-scatter (FP32 sums in rank order, times the scale: bitwise), all-gather (several dtypes,
in place and from outside the storage), sizes that take the vector and the scalar paths, calls that reuse a bucket
right after the previous one (the barriers' write-after-read protection), a session (tensors outside the storage),
and a second group over the same ranks (a second context). EPBuffer: every output equals `ElasticBuffer`'s, the
deferred epilogue gives the same tensors, `handle.topk_idx is topk_idx`, and prefetching / reducing into the
load-balancing region leaves the EP region alone (and the other way round). Then the timings of the bucket
collectives (ranks sharing a GPU: logic only, use --skip-perf-test).
"""

import sys
import time
from types import SimpleNamespace

import numpy as np

from ..runtime import preflight
from . import cli

try:
    import torch
except ImportError as e:  # `--help` works without torch; a run names the extra that brings it
    preflight.exit_if_main(e, __name__, cli.v25_parser)
    raise

from .. import BucketBuffer, BufferAllocator, ElasticBuffer, EngramBuffer, EPBuffer, PPBuffer
from ..runtime.group import get_group
from ..utils.envs import init_dist
from ..utils.math import per_token_cast_to_fp8
from ..utils.testing import bench
from .common import Failure, check, check_equal, expect_error, gather_tensors, log
from .engram import reference_rows
from .reduce_grads import (
    expected_expert_grads,
    expected_pool,
    expert_key,
    make_pattern,
    make_redundancy_mapping,
    slot_key,
)


def fp32_sum(parts, scale: float) -> torch.Tensor:
    """The bucket kernels' reduction: FP32, ranks in order from 0.0, then times `scale` (CPU)."""
    acc = torch.zeros_like(parts[0])
    for p in parts:
        acc = acc + p
    return acc * torch.tensor(scale, dtype=torch.float32)


# ---- buckets -------------------------------------------------------------------------------------------------------

def test_buckets(group, rank: int, R: int, seed: int) -> int:
    gen = torch.Generator(device='cuda').manual_seed(seed * 1000 + rank)
    plan = BufferAllocator()
    sizes = (R * 4096, R * 3080, R * 37, 1003)                  # vector paths, then scalar paths (odd shards)
    buckets = [plan.allocate((n,), torch.float32) for n in sizes]
    gathers = {dt: plan.allocate((R * 48,), dt) for dt in (torch.bfloat16, torch.int32, torch.uint8)}
    buf = BucketBuffer(group, plan, explicitly_destroy=True)
    num_checked = 0
    try:
        check(buf.storage.numel() == plan.num_bytes and buckets[0].data_ptr() == buf.storage.data_ptr(),
              'plan materialised into the storage')
        for scale in (1.0, 0.25, -0.5):
            inputs = [torch.randn(n, device='cuda', generator=gen) for n in sizes]
            everyone = gather_tensors(group, inputs)
            for b, x in zip(buckets, inputs):
                b.copy_(x)
            dsts = buf.all_reduce(buckets, scale=scale).wait()
            for i, (b, d) in enumerate(zip(buckets, dsts)):
                check(d.data_ptr() == b.data_ptr(), 'all_reduce in place')
                check_equal(d.cpu(), fp32_sum([e[i] for e in everyone], scale), f'all_reduce bucket {i} x{scale}')
            for b, x in zip(buckets[:3], inputs[:3]):
                b.copy_(x)
            shards = buf.reduce_scatter(buckets[:3], scale=scale, num_sms=6).wait()
            for i, (b, s) in enumerate(zip(buckets[:3], shards)):
                n = sizes[i] // R
                check(s.data_ptr() == b.data_ptr() + rank * s.nbytes, 'reduce_scatter shard pointer')
                want = fp32_sum([e[i][rank * n:(rank + 1) * n] for e in everyone], scale)
                check_equal(s.cpu(), want, f'reduce_scatter bucket {i} x{scale}')
            # Gather the shards back (an all-reduce in two calls): reuses the buckets at once.
            gathered = buf.all_gather(shards).wait()
            for i, g in enumerate(gathered):
                n = sizes[i] // R
                want = torch.cat([fp32_sum([e[i][r * n:(r + 1) * n] for e in everyone], scale) for r in range(R)])
                check(g.data_ptr() == buckets[i].data_ptr(), 'all_gather in place')
                check_equal(g.cpu(), want, f'all_gather of the reduce_scatter shards, bucket {i}')
            num_checked += 3
        for dt, bucket in gathers.items():
            mine = (torch.arange(48, device='cuda') + 100 * rank).to(dt)
            external = buf.all_gather(mine, dsts=bucket).wait()
            check_equal(external.cpu(), torch.cat([(torch.arange(48) + 100 * r).to(dt) for r in range(R)]),
                        f'all_gather {dt} from outside the storage')
            bucket.view(R, 48)[rank].copy_(mine + 1)
            check_equal(buf.all_gather(bucket.view(R, 48)[rank]).wait().cpu(),
                        torch.cat([(torch.arange(48) + 100 * r).to(dt) + 1 for r in range(R)]), f'all_gather {dt}')
            num_checked += 2
        num_checked += test_session(buf, group, rank, R, gen)
        tried = []
        expect_error(tried, 'all_reduce outside the storage', ValueError,
                     lambda: buf.all_reduce(torch.zeros(8, device='cuda')))
        expect_error(tried, 'reduce_scatter of a size the group does not divide', ValueError,
                     lambda: buf.reduce_scatter(buckets[0][:R * 4096 - 1]) if R > 1 else
                     buf.reduce_scatter(torch.zeros(8, device='cuda')))
        buf.barrier(with_cpu_sync=True)
    finally:
        buf.destroy()
    num_checked += test_second_group(group, rank, R)
    return num_checked


def test_session(buf, group, rank: int, R: int, gen) -> int:
    n = R * 256
    x = torch.randn(n, device='cuda', generator=gen)
    everyone = gather_tensors(group, [x])
    with buf.session() as session:
        shard = buf.reduce_scatter(x.view(-1, 4)).wait()
        check_equal(shard.cpu(), fp32_sum([e[0][rank * 256:(rank + 1) * 256] for e in everyone], 1.0),
                    'session reduce_scatter')
        reduced = buf.all_reduce(x).wait()
        check_equal(reduced.cpu(), fp32_sum([e[0] for e in everyone], 1.0), 'session all_reduce')
        out = torch.empty((R, 256), device='cuda')
        result = buf.all_gather(x[:256], dsts=out).wait()
        check(result is out, 'session all_gather returns the given dsts')
        check_equal(out.cpu(), torch.stack([e[0][:256] for e in everyone]), 'session all_gather')
        staged = session.allocate((R, 64), group=None)
        staged[rank].copy_(x[:64])
        check_equal(buf.all_gather(staged[rank]).wait().cpu(), torch.cat([e[0][:64] for e in everyone]),
                    'session.allocate + in-place all_gather')
    return 4


def test_second_group(group, rank: int, R: int) -> int:
    """A buffer registered with two groups over the same ranks: the second context maps the same storage."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return 0
    other = dist.new_group(list(range(R)), backend='gloo')
    plan = BufferAllocator()
    bucket = plan.allocate((R * 1024,), torch.float32)
    buf = BucketBuffer([group, other], plan, explicitly_destroy=True)
    try:
        check(len(buf.contexts) == 2, 'two contexts')
        x = torch.full((R * 1024,), float(rank + 1), device='cuda')
        bucket.copy_(x)
        out = buf.all_reduce(bucket, group=other).wait()
        check_equal(out.cpu(), torch.full((R * 1024,), float(R * (R + 1) // 2)), 'all_reduce on the second group')
        buf.barrier(group=other, with_cpu_sync=True)
        out = buf.all_reduce(bucket, group=group, scale=0.5).wait()
        check_equal(out.cpu(), torch.full((R * 1024,), R * R * (R + 1) / 4), 'then on the first group')
    finally:
        buf.destroy()
    return 2


# ---- EPBuffer ------------------------------------------------------------------------------------------------------

def test_ep_and_lb(group, rank: int, R: int, args) -> int:
    from .ep import Case, check_dispatch
    case_args = SimpleNamespace(num_tokens=args.num_tokens, hidden=args.hidden, num_topk=args.num_topk,
                                num_experts=args.num_experts, unbalanced_ratio=1.0, precise_unbalanced_ratio=False,
                                masked_ratio=0.1)
    case = Case(case_args, group, rank, R, args.seed)
    L, C, hidden = case.L, 4, 2048
    mapping = make_redundancy_mapping(R, C, case.E, 0.25, args.seed, 'random')
    plan = BufferAllocator()
    pool = plan.allocate((C, hidden), torch.float32)
    grads_pool = plan.allocate((C, hidden), torch.float32)
    buf = EPBuffer(group, num_max_tokens_per_rank=case.M, hidden=case.H, num_topk=case.K,
                   lb_allocation_plan_or_num_bytes=plan, explicitly_destroy=True)
    ref_buf = ElasticBuffer(group, num_max_tokens_per_rank=case.M, hidden=case.H, num_topk=case.K,
                            explicitly_destroy=True)
    num_checked = 0
    try:
        check(pool.data_ptr() == buf.sym.base + buf.extra_offset, 'the LB plan sits right after the EP region')
        mapping_t = torch.from_numpy(mapping).cuda()
        weights = torch.from_numpy(np.stack([make_pattern(hidden, expert_key(rank * L + j)) for j in range(L)])).cuda()
        pool.copy_(torch.from_numpy(np.stack([make_pattern(hidden, slot_key(rank, c, C)) for c in range(C)])))
        grads_pool.copy_(pool)
        buf.lb_prefetch_weights(pool, weights, mapping_t).wait()
        want_pool = torch.from_numpy(expected_pool(mapping, rank, lambda k: make_pattern(hidden, k)))
        check_equal(pool.cpu(), want_pool, 'lb_prefetch_weights pool')

        tried = []
        expect_error(tried, 'do_handle_copy=True', ValueError,
                     lambda: buf.dispatch(case.x, case.topk_idx, num_experts=case.E, do_handle_copy=True))
        for defer in (False, True):
            out = buf.dispatch(case.x, case.topk_idx, case.topk_weights, num_experts=case.E,
                               async_with_compute_stream=defer, defer_epilogue=defer, num_sms=5)
            out = (*out.current_stream_wait(), out) if defer else out
            check_dispatch(case, out, False, 1, False, True, f'EPBuffer dispatch (defer_epilogue={defer})')
            handle = out[3]
            check(handle.topk_idx is case.topk_idx and handle.num_sms == 6, 'handle keeps topk_idx; num_sms even')
            cached = buf.dispatch(case.x, handle=handle)
            check(cached[3].topk_idx is case.topk_idx, 'cached handle keeps topk_idx')
            res = buf.combine(case.combine_x, handle, topk_weights=out[2], async_with_compute_stream=defer,
                              defer_epilogue=defer)
            combined, combined_w = res.wait() if defer else res[:2]
            check_equal(combined, case.expected_combined(0, True), f'EPBuffer combine (defer_epilogue={defer})')
            check_equal(combined_w, case.topk_weights, 'EPBuffer combined_topk_weights')
            num_checked += 3
        # Zero padding: the alignment gaps are otherwise unspecified (whatever the allocation held).
        ref = ref_buf.dispatch(case.x_fp8, case.topk_idx, case.topk_weights, num_experts=case.E, do_expand=True,
                               expert_alignment=128, do_zero_padding=True)
        got = buf.dispatch(case.x_fp8, case.topk_idx, case.topk_weights, num_experts=case.E, do_expand=True,
                           expert_alignment=128, do_zero_padding=True)
        for i, (a, b) in enumerate(zip((*got[0], got[2]), (*ref[0], ref[2]))):
            check_equal(a, b, f'EPBuffer expanded FP8 dispatch output {i} vs ElasticBuffer')
        check_equal(pool.cpu(), want_pool, 'the LB pool after dispatch / combine (regions do not overlap)')
        grads = torch.from_numpy(np.stack([make_pattern(hidden, expert_key(rank * L + j)) for j in range(L)])).cuda()
        buf.lb_reduce_grads(grads_pool, grads, mapping_t).wait()
        check_equal(grads.cpu(), torch.from_numpy(expected_expert_grads(mapping, rank, L, hidden)), 'lb_reduce_grads')
        again = buf.dispatch(case.x, case.topk_idx, case.topk_weights, num_experts=case.E)
        check_dispatch(case, again, False, 1, False, True, 'EPBuffer dispatch after the LB calls')
        num_checked += 4
    finally:
        del plan, pool, grads_pool
        buf.destroy()
        ref_buf.destroy()
    return num_checked


# ---- PPBuffer and EngramBuffer -------------------------------------------------------------------------------------

def test_pp(group, rank: int, R: int) -> int:
    if R < 2:
        tried = []
        expect_error(tried, 'PPBuffer with one rank', ValueError, lambda: PPBuffer(group, 1 << 20, 2))
        return 0
    buf = PPBuffer(group, num_max_tensor_bytes=1 << 20, num_max_inflight_tensors=2, explicitly_destroy=True)
    try:
        nxt, prv = (rank + 1) % R, (rank - 1) % R
        for n in (1, 1000, 1 << 18):
            sent = torch.arange(n, dtype=torch.float32, device='cuda') + 1000 * rank
            buf.send(sent, nxt)
            got = torch.empty(n, device='cuda')
            buf.recv(got, prv)
            check_equal(got.cpu(), torch.arange(n, dtype=torch.float32) + 1000 * prv, f'PPBuffer {n} floats')
    finally:
        buf.destroy()
    return 3


def test_engram(group, rank: int, R: int, args, use_cpu: bool, use_fp8: bool) -> int:
    entries, hidden, T, n = [args.num_entries, args.num_entries + 13], 128, 32, 6
    dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
    packs = hidden // 128 if use_fp8 else 0
    gpu, storage = EngramBuffer.get_storage_size_hint(group, entries, hidden, T, n, dtype, packs)
    qps, depth, restrict = EngramBuffer.get_theoretical_config(group, len(entries), T, n)
    buf = EngramBuffer(group, gpu, storage, use_cpu, qps, depth, restrict, explicitly_destroy=True)
    what = f'EngramBuffer ({"host" if use_cpu else "GPU"} storage, {"FP8" if use_fp8 else "BF16"})'
    try:
        buf.set_config(entries, hidden, T, n, dtype, packs)
        gen = torch.Generator(device='cuda').manual_seed(args.seed * 1000 + rank)
        tables, sfs, bits = [], [] if use_fp8 else None, []
        for e in entries:
            bf16 = torch.randn((e, hidden), device='cuda', generator=gen).to(torch.bfloat16)
            table = bf16
            if use_fp8:
                table, sf = per_token_cast_to_fp8(bf16)
                sfs.append(torch.cat([s for (s,) in gather_tensors(group, [sf])]).cuda())
            tables.append(table)
            bits.append(table.cpu().view(torch.uint8 if use_fp8 else torch.int16).numpy())
        buf.write(tables, sfs)
        indices = torch.stack([torch.randint(0, R * e, (T, n), dtype=torch.int32, device='cuda', generator=gen)
                               for e in entries])
        hooks = buf.fetch(indices)
        for layer in reversed(range(len(entries))):
            result = hooks[layer]()
            data, sf = result if use_fp8 else (result, None)
            ref = reference_rows(group, bits[layer], indices[layer].cpu().numpy(), entries[layer])
            want = torch.from_numpy(ref.reshape(T, -1)).view(dtype)
            check_equal(data.cpu(), want, f'{what} layer {layer}')
            if use_fp8:
                check_equal(sf.cpu(), sfs[layer].cpu()[indices[layer].cpu().long().view(-1)].view(T, -1),
                            f'{what} layer {layer} sf')
    finally:
        buf.destroy()
    return len(entries)


# ---- timings -------------------------------------------------------------------------------------------------------

def perf_buckets(group, R: int, num_bytes: int):
    plan = BufferAllocator()
    bucket = plan.allocate((num_bytes // 4,), torch.float32)
    buf = BucketBuffer(group, plan, explicitly_destroy=True)
    lines = []
    try:
        bucket.normal_()
        shard = bucket.view(R, -1)[group.rank]
        for name, fn in (('all_reduce', lambda: buf.all_reduce(bucket).wait()),
                         ('reduce_scatter', lambda: buf.reduce_scatter(bucket).wait()),
                         ('all_gather', lambda: buf.all_gather(shard).wait())):
            t = max(group.allgather_object(bench(fn).avg))
            lines.append(f'[perf] {name:14s} {num_bytes >> 20} MiB: {t * 1e6:8.1f} us, {num_bytes / t / 1e9:6.1f} GB/s '
                         f'(algorithm bytes / time, slowest rank)')
    finally:
        buf.destroy()
    return lines


def main(argv=None) -> int:
    p = cli.v25_parser()
    args = p.parse_args(argv)
    preflight.check_cuda()
    rank, num_ranks, _ = init_dist(seed=args.seed)
    group = get_group()  # host group: MPI under mpirun, else the torch world init_dist joined
    log(group, f'[init] {num_ranks} ranks; tokens {args.num_tokens}, hidden {args.hidden}, top-{args.num_topk} of '
               f'{args.num_experts} experts')
    ok = True
    try:
        t0 = time.perf_counter()
        n = test_buckets(group, rank, num_ranks, args.seed)
        log(group, f'[check] BucketBuffer: {n} collectives bitwise equal to the host references '
                   f'({time.perf_counter() - t0:.1f} s)')
        n = test_ep_and_lb(group, rank, num_ranks, args)
        log(group, f'[check] EPBuffer: {n} dispatch / combine / load-balancing checks on one buffer')
        n = test_pp(group, rank, num_ranks)
        log(group, f'[check] PPBuffer: {n} send / recv pairs')
        n = sum(test_engram(group, rank, num_ranks, args, cpu, fp8) for cpu in (False, True) for fp8 in (False, True))
        log(group, f'[check] EngramBuffer: {n} layers fetched bit for bit (GPU and host storage, BF16 and FP8)')
        if not args.skip_perf_test:
            for line in perf_buckets(group, num_ranks, args.perf_bytes):
                log(group, line)
    except Failure as e:
        print(f'[rank {rank}] FAILED: {e}', flush=True)
        ok = False
    ok = all(group.allgather_object(ok))
    log(group, 'v25 test: PASSED' if ok else 'v25 test: FAILED')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
