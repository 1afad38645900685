"""Load-balancing rank program: `lb_reduce_grads` (this module) and `lb_prefetch_weights` (`prefetch_weights.py`,
the same program with `--op prefetch`).

    mpirun -np N python -m deepep_cupy.tests.reduce_grads [--num-experts 64 --num-redundant-experts 8
        --num-hidden-bytes 64M --empty-ratio 0.25 --pattern random|ring|spread --num-sms 0]

Correctness, over a sweep of hidden sizes (full 4 KiB work chunks, partial tails, tiny rows) × `--num-rounds`
mappings: every blob carries a distinct key and holds a ramp of small integers shifted by it, so a swapped source or
a chunk offset shows up everywhere and FP32 sums are exact; the expected values are computed on the host from the
mapping alone (never from the code under test) and compared bit for bit. Reduce: `expert_grads` = seed + every copy
hosted for it, the redundant pools are never written. Prefetch: two tensors per call (FP32 weights and BF16 "scales"),
hosted slots get the owner's expert, empty slots and the owner's weights are untouched. One more round with random
FP32 values (host-gathered) checks the documented addition order, and odd rounds pass `previous_event`. Then invalid
or inconsistent arguments must raise on every rank before any kernel, a rank that skips the kernel must make the
others raise TimeoutError, and the performance lines: per-rank and critical-path GB/s, % of NVLink, the peer-copy
floor moving the same bytes per peer with the same SMs, and NCCL all-to-all of the same bytes (one rank per GPU).
"""

import sys
import time
from typing import List, Optional, Tuple

import numpy as np

from ..runtime import preflight
from . import cli

try:
    import torch
except ImportError as e:  # `--help` works without torch; a run names the extra that brings it
    preflight.exit_if_main(e, __name__, lambda: cli.lb_parser('reduce'))
    raise

from ..features.lb.plan import send_bytes_per_peer
from ..runtime.event import EventOverlap
from ..runtime.group import get_group
from ..utils.envs import get_nvlink_gbs, init_dist
from ..utils.testing import bench, bench_kineto
from .allocation import (
    expect_error,
    log,
    make_buffer,
    nccl_all_to_all,
    peer_copy_floor,
    ranks_share_gpu,
)
from .common import Failure, check, check_equal

# Period of the ramp: adjacent 4 KiB work chunks (1024 FP32 values) hold different values.
PATTERN_PERIOD = (1 << 12) - 1
# Hidden sizes in FP32 elements (all multiples of 8: 32-byte rows): several full chunks, partial tails, tiny rows.
CORRECTNESS_HIDDENS = (1 << 20, 1 << 18, 16392, 6144, 3080, 3072, 3064, 5120, 1536, 384, 24)
SCALE_COLUMNS = 16          # BF16 values per expert of the second prefetch tensor (32 bytes)
RANDOM_CHECK_HIDDEN = 3072


def make_pattern(hidden: int, key: int) -> np.ndarray:
    """`[hidden]` FP32 ramp of period `PATTERN_PERIOD` shifted by `key`, centred on zero (small integers: exact)."""
    return (((np.arange(hidden, dtype=np.int64) + key) % PATTERN_PERIOD) - PATTERN_PERIOD // 2).astype(np.float32)


def make_scale_pattern(key: int) -> np.ndarray:
    """`[SCALE_COLUMNS]` FP32 values in [-125, 125] (exact in BF16) that depend on `key` modulo 251."""
    return (((np.arange(SCALE_COLUMNS, dtype=np.int64) * 7 + key) % 251) - 125).astype(np.float32)


def expert_key(expert_idx: int) -> int:
    """Key of a domain-local expert's own blob (non-negative)."""
    return expert_idx


def slot_key(rank_idx: int, slot: int, num_redundant: int) -> int:
    """Key of a redundant slot's blob (negative: never equal to an expert key)."""
    return -1 - (rank_idx * num_redundant + slot)


def make_redundancy_mapping(num_ranks: int, num_redundant: int, num_experts: int, empty_ratio: float, seed: int,
                            pattern: str = 'random') -> np.ndarray:
    """`[num_ranks, num_redundant]` int32, identical on every rank (built from `seed` alone).

    `random`: each slot hosts a uniformly drawn expert of another rank, or is empty with probability `empty_ratio`.
    `ring`: rank r hosts only experts of rank r + 1 (one peer per owner); `spread`: slot c of rank r hosts an expert
    of rank r + 1 + c mod (R - 1) (all peers). Both give every owner exactly `num_redundant` copies, no empty slot.
    """
    num_local = num_experts // num_ranks
    if num_ranks == 1:
        return np.full((1, num_redundant), -1, dtype=np.int32)
    rows = np.arange(num_ranks)[:, None]
    slots = np.arange(num_redundant)[None, :]
    if pattern in ('ring', 'spread'):
        offset = 1 if pattern == 'ring' else 1 + slots % (num_ranks - 1)
        table = (rows + offset) % num_ranks * num_local + slots % num_local
    elif pattern == 'random':
        rng = np.random.default_rng(seed)
        table = rng.integers(0, num_experts - num_local, size=(num_ranks, num_redundant))
        table = table + (table >= rows * num_local) * num_local       # skip the row's own block
        table[rng.random((num_ranks, num_redundant)) < empty_ratio] = -1
    else:
        raise ValueError(f'unknown pattern {pattern!r}')
    table = table.astype(np.int32)
    assert not ((table >= 0) & (table // num_local == rows)).any(), 'a rank must never host its own experts'
    return table


def expected_expert_grads(mapping: np.ndarray, rank_idx: int, num_local: int, hidden: int) -> np.ndarray:
    """The seed of every local expert plus each copy hosted for it, added in ascending (rank, slot) order."""
    out = np.stack([make_pattern(hidden, expert_key(rank_idx * num_local + j)) for j in range(num_local)])
    num_redundant = mapping.shape[1]
    for (r, c), e in np.ndenumerate(mapping):
        if e >= 0 and e // num_local == rank_idx:
            out[e % num_local] += make_pattern(hidden, slot_key(r, c, num_redundant))
    return out


def expected_pool(mapping: np.ndarray, rank_idx: int, make) -> np.ndarray:
    """What a rank's redundant pool holds after a prefetch: hosted slots the owner's expert blob `make(key)`, the
    others their seed."""
    num_redundant = mapping.shape[1]
    return np.stack([make(expert_key(int(e)) if e >= 0 else slot_key(rank_idx, c, num_redundant))
                     for c, e in enumerate(mapping[rank_idx])])


class LBTest:
    """State of one run: the buffer, the planned pools and the local tensors for every hidden size."""

    def __init__(self, args, group, op: str):
        from ..buffers.allocator import BufferAllocator
        self.args, self.group, self.op = args, group, op
        self.rank, self.num_ranks = group.rank, group.size
        self.E, self.C = args.num_experts, args.num_redundant_experts
        self.L = self.E // self.num_ranks
        self.perf_hidden = args.num_hidden_bytes // 4
        self.hiddens = (*CORRECTNESS_HIDDENS, RANDOM_CHECK_HIDDEN, self.perf_hidden)
        check(all(h * 4 % 32 == 0 for h in self.hiddens), 'every expert row must be a multiple of 32 bytes')
        check(self.E + self.num_ranks * self.C < PATTERN_PERIOD, 'blob keys must be distinct modulo the period')
        plan = BufferAllocator()
        self.pools = [plan.allocate((self.C, h), torch.float32) for h in self.hiddens]
        self.scale_pools = [plan.allocate((self.C, SCALE_COLUMNS), torch.bfloat16) for _ in self.hiddens]
        self.buf = make_buffer(group, plan.num_bytes, num_gpu_timeout_secs=args.num_gpu_timeout_secs)
        views = self.buf.lb_set_plan(plan)
        self.pools, self.scale_pools = views[:len(self.hiddens)], views[len(self.hiddens):]
        self.num_sms = args.num_sms or self.buf.lb_get_theoretical_num_sms()
        self.locals = [torch.empty((self.L, h), dtype=torch.float32, device='cuda') for h in self.hiddens]
        self.local_scales = [torch.empty((self.L, SCALE_COLUMNS), dtype=torch.bfloat16, device='cuda')
                             for _ in self.hiddens]

    def call(self, k: int, mapping: torch.Tensor, previous_event=None, **kwargs) -> EventOverlap:
        if self.op == 'reduce':
            return self.buf.lb_reduce_grads(self.pools[k], self.locals[k], mapping, num_sms=self.num_sms,
                                            previous_event=previous_event, **kwargs)
        return self.buf.lb_prefetch_weights([self.pools[k], self.scale_pools[k]], [self.locals[k],
                                            self.local_scales[k]], mapping, num_sms=self.num_sms,
                                            previous_event=previous_event, **kwargs)

    def seed(self, k: int) -> None:
        hidden, r, L, C = self.hiddens[k], self.rank, self.L, self.C
        experts = [expert_key(r * L + j) for j in range(L)]
        slots = [slot_key(r, c, C) for c in range(C)]
        self.locals[k].copy_(torch.from_numpy(np.stack([make_pattern(hidden, e) for e in experts])))
        self.pools[k].copy_(torch.from_numpy(np.stack([make_pattern(hidden, s) for s in slots]).reshape(C, hidden)))
        self.local_scales[k].copy_(torch.from_numpy(np.stack([make_scale_pattern(e) for e in experts])))
        self.scale_pools[k].copy_(torch.from_numpy(np.stack([make_scale_pattern(s) for s in slots])))

    def check_round(self, k: int, mapping: np.ndarray, what: str) -> None:
        hidden, r, L = self.hiddens[k], self.rank, self.L
        seed_locals = np.stack([make_pattern(hidden, expert_key(r * L + j)) for j in range(L)])
        seed_pool = np.stack([make_pattern(hidden, slot_key(r, c, self.C)) for c in range(self.C)])
        seed_pool = seed_pool.reshape(self.C, hidden)
        if self.op == 'reduce':
            check_equal(self.locals[k].cpu(), torch.from_numpy(expected_expert_grads(mapping, r, L, hidden)),
                        f'{what}: expert_grads')
            check_equal(self.pools[k].cpu(), torch.from_numpy(seed_pool), f'{what}: redundant pool (must be unchanged)')
        else:
            want = expected_pool(mapping, r, lambda key: make_pattern(hidden, key))
            check_equal(self.pools[k].cpu(), torch.from_numpy(want), f'{what}: redundant weights')
            want = expected_pool(mapping, r, make_scale_pattern)
            check_equal(self.scale_pools[k].cpu().float(), torch.from_numpy(want), f'{what}: redundant scales')
            check_equal(self.locals[k].cpu(), torch.from_numpy(seed_locals), f'{what}: expert_weights (unchanged)')

    def run_checks(self, pattern: str, num_rounds: int) -> int:
        num_checked = 0
        for k, hidden in enumerate(self.hiddens[:len(CORRECTNESS_HIDDENS)]):
            for round_idx in range(num_rounds):
                mapping = make_redundancy_mapping(self.num_ranks, self.C, self.E, self.args.empty_ratio,
                                                  self.args.seed + round_idx, pattern)
                self.seed(k)
                torch.cuda.synchronize()
                self.group.barrier()
                self.call(k, torch.from_numpy(mapping).cuda(),
                          previous_event=self.buf.capture() if round_idx % 2 else None).wait()
                torch.cuda.synchronize()
                self.check_round(k, mapping, f'{pattern} hidden={hidden} round={round_idx}')
                self.group.barrier()        # nobody reseeds a pool that a peer may still check
                num_checked += 1
        return num_checked

    def run_random_values(self) -> None:
        """Random FP32 data (not exact): the result must equal a host sum in ascending (rank, slot) order."""
        k = len(CORRECTNESS_HIDDENS)
        hidden, r, L, C = self.hiddens[k], self.rank, self.L, self.C
        mapping = make_redundancy_mapping(self.num_ranks, C, self.E, 0.0, self.args.seed + 1000, 'random')
        gen = torch.Generator().manual_seed(self.args.seed * 7919 + r)
        local = torch.randn((L, hidden), generator=gen)
        pool = torch.randn((C, hidden), generator=gen)
        scales = torch.randn((L, SCALE_COLUMNS), generator=gen).to(torch.bfloat16)
        self.locals[k].copy_(local)
        self.pools[k].copy_(pool)
        self.local_scales[k].copy_(scales)
        gathered = self.group.allgather_object((local.numpy(), pool.numpy(), scales.float().numpy()))
        torch.cuda.synchronize()
        self.group.barrier()
        self.call(k, torch.from_numpy(mapping).cuda()).wait()
        torch.cuda.synchronize()
        if self.op == 'reduce':
            want = local.numpy().copy()
            for (rr, c), e in np.ndenumerate(mapping):
                if e >= 0 and e // L == r:
                    want[e % L] += gathered[rr][1][c]
            check_equal(self.locals[k].cpu(), torch.from_numpy(want), 'random values: expert_grads')
        else:
            want, want_scales = pool.numpy().copy(), np.zeros((C, SCALE_COLUMNS), dtype=np.float32)
            for c, e in enumerate(mapping[r]):
                if e >= 0:
                    want[c] = gathered[e // L][0][e % L]
                    want_scales[c] = gathered[e // L][2][e % L]
            check_equal(self.pools[k].cpu(), torch.from_numpy(want), 'random values: redundant weights')
            hosted = torch.from_numpy(mapping[r] >= 0)
            check_equal(self.scale_pools[k].cpu().float()[hosted], torch.from_numpy(want_scales)[hosted],
                        'random values: redundant scales')
        self.group.barrier()

    def run_errors(self) -> List[str]:
        """Bad or inconsistent arguments raise on every rank before any kernel runs; the buffer stays usable."""
        R, C, E, k = self.num_ranks, self.C, self.E, len(CORRECTNESS_HIDDENS) - 1
        good = make_redundancy_mapping(R, C, E, self.args.empty_ratio, self.args.seed, 'random')
        tried = []

        def with_mapping(table):
            return lambda: self.call(k, torch.from_numpy(np.ascontiguousarray(table)).cuda())

        if R > 1:
            own = good.copy()
            own[0, 0] = 0                          # expert 0 belongs to rank 0
            expect_error(tried, 'rank hosts its own expert', ValueError, with_mapping(own))
            differs = good.copy()
            if self.rank == 0:
                differs[R - 1, 0] = -1 if good[R - 1, 0] >= 0 else 0
            expect_error(tried, 'mapping differs on rank 0', ValueError, with_mapping(differs))
        too_big = good.copy()
        too_big[-1, -1] = E
        expect_error(tried, 'expert id out of range', ValueError, with_mapping(too_big))
        below = good.copy()
        below[0, -1] = -2
        expect_error(tried, 'expert id below -1', ValueError, with_mapping(below))
        expect_error(tried, 'mapping int64', TypeError, lambda: self.call(k, torch.from_numpy(good).long().cuda()))
        expect_error(tried, 'mapping wrong shape', ValueError,
                     with_mapping(np.concatenate([good, np.full((R, 1), -1, np.int32)], axis=1)))
        mapping = torch.from_numpy(good).cuda()
        outside = torch.zeros_like(self.pools[k])
        local = self.locals[k]
        if self.op == 'reduce':
            expect_error(tried, 'redundant grads outside the buffer', ValueError,
                         lambda: self.buf.lb_reduce_grads(outside, local, mapping))
            expect_error(tried, 'expert_grads float64', TypeError,
                         lambda: self.buf.lb_reduce_grads(self.pools[k], local.double(), mapping))
            expect_error(tried, 'expert_grads hidden differs', ValueError,
                         lambda: self.buf.lb_reduce_grads(self.pools[k], self.locals[k - 1], mapping))
        else:
            expect_error(tried, 'redundant weights outside the buffer', ValueError,
                         lambda: self.buf.lb_prefetch_weights(outside, local, mapping))
            expect_error(tried, 'tensor lists of different lengths', ValueError,
                         lambda: self.buf.lb_prefetch_weights([self.pools[k]], [local, local], mapping))
            expect_error(tried, 'dtypes differ', TypeError,
                         lambda: self.buf.lb_prefetch_weights(self.pools[k], local.view(torch.int32), mapping))
            expect_error(tried, 'empty tensor list', ValueError,
                         lambda: self.buf.lb_prefetch_weights([], [], mapping))
        # Still usable, and still right.
        self.seed(k)
        torch.cuda.synchronize()
        self.group.barrier()
        self.call(k, mapping).wait()
        torch.cuda.synchronize()
        self.check_round(k, good, 'after the error cases')
        self.group.barrier()
        return tried

    def run_perf(self, pattern: str) -> Tuple[List[str], Optional[float]]:
        k = len(self.hiddens) - 1
        num_bytes = self.perf_hidden * 4
        mapping = make_redundancy_mapping(self.num_ranks, self.C, self.E, self.args.empty_ratio, self.args.seed,
                                          pattern)
        mapping_dev = torch.from_numpy(mapping).cuda()
        # Copies per owner: what each owner pulls (reduce) or pushes (prefetch); the largest is the critical path.
        per_owner = np.bincount(mapping[mapping >= 0] // self.L, minlength=self.num_ranks).tolist()
        mine, critical = per_owner[self.rank], max(per_owner) * num_bytes
        self.locals[k].zero_()
        self.pools[k].zero_()
        torch.cuda.synchronize()
        self.group.barrier()
        if self.op == 'reduce':
            fn = lambda: self.buf.lb_reduce_grads(self.pools[k], self.locals[k], mapping_dev,
                                                  num_sms=self.num_sms).wait()
        else:
            fn = lambda: self.buf.lb_prefetch_weights(self.pools[k], self.locals[k], mapping_dev,
                                                      num_sms=self.num_sms).wait()
        t = bench(fn).avg
        # The kernel alone (profiler): the call above also pays the host checks (mapping read-back, all-gather).
        kernel = bench_kineto(fn, 'lb_reduce_grads_kernel' if self.op == 'reduce' else 'lb_prefetch_kernel',
                              num_tests=10)
        nvlink = get_nvlink_gbs() or float('nan')
        name = 'reduce grads' if self.op == 'reduce' else 'prefetch weights'
        mine_bytes = mine * num_bytes
        line = (f'[perf] rank {self.rank} {name} {pattern} ({self.num_sms} SMs): kernel {kernel * 1e6:8.1f} us, call '
                f'{t * 1e6:8.1f} us | this rank {mine_bytes / 1e6:.1f} MB @ {mine_bytes / kernel / 1e9:6.1f} '
                f'GB/s | critical path {critical / 1e6:.1f} MB @ {critical / kernel / 1e9:6.1f} GB/s '
                f'({critical / kernel / 1e9 / nvlink * 100:5.1f}% of NVLink; call: {critical / t / 1e9:6.1f} GB/s)')
        ratio = None
        if not self.args.skip_baselines and not ranks_share_gpu(self.buf):
            send = send_bytes_per_peer(mapping, self.rank, self.L, num_bytes, self.op)
            recv = [send_bytes_per_peer(mapping, p, self.L, num_bytes, self.op)[self.rank]
                    for p in range(self.num_ranks)]
            floor = peer_copy_floor(self.group, send, self.num_sms)
            if floor is not None:
                ratio = floor / kernel
                line += (f' | peer-copy floor {floor * 1e6:8.1f} us (kernel = {ratio:.2f}, call = {floor / t:.2f} x '
                         f'floor speed)')
            a2a = nccl_all_to_all(self.group, send, recv)
            line += f' | NCCL all-to-all {a2a * 1e6:8.1f} us ({a2a / t:.2f} x)'
        return [line], ratio

    def destroy(self) -> None:
        del self.pools, self.scale_pools
        self.buf.destroy()


def test_timeout(args, group, op: str) -> bool:
    """The last rank passes the host checks but launches nothing: every other rank must raise TimeoutError naming
    the load-balancing phase and that rank."""
    from ..buffers.allocator import BufferAllocator
    plan = BufferAllocator()
    C, L = args.num_redundant_experts, args.num_experts // group.size
    pool = plan.allocate((C, 64), torch.float32)
    buf = make_buffer(group, plan.num_bytes, num_gpu_timeout_secs=args.timeout_test_secs)
    buf.lb_set_plan(plan)
    local = torch.zeros((L, 64), dtype=torch.float32, device='cuda')
    mapping = torch.from_numpy(make_redundancy_mapping(group.size, C, args.num_experts, 0.0, 0, 'ring')).cuda()
    victim = group.size - 1
    outcome = 'skipped (the missing rank)'
    if group.rank == victim:
        buf._lb.run = lambda call: EventOverlap(None)
    try:
        ev = (buf.lb_reduce_grads(pool, local, mapping) if op == 'reduce' else
              buf.lb_prefetch_weights(pool, local, mapping))
        if group.rank != victim:
            ev.wait()
            buf.synchronize()
            outcome = 'no error'
    except TimeoutError as e:
        good = f'waited for rank {victim}' in str(e) and 'load balancing' in str(e)
        outcome = 'TimeoutError' if good else f'bad message: {e}'
        if group.rank == 0:
            print(f'[timeout] rank 0: {e}', flush=True)
    outcomes = group.allgather_object(outcome)
    del pool
    buf.destroy()
    return all(o == 'TimeoutError' for r, o in enumerate(outcomes) if r != victim)


def main(argv=None, op: str = 'reduce') -> int:
    name = 'reduce_grads' if op == 'reduce' else 'prefetch_weights'
    p = cli.lb_parser(op)
    args = p.parse_args(argv)
    preflight.check_cuda()

    rank, num_ranks, _ = init_dist(seed=args.seed)
    group = get_group()  # host group: MPI under mpirun, else the torch world init_dist joined
    if args.num_experts % num_ranks:
        args.num_experts = num_ranks * max(1, args.num_experts // num_ranks)
    t0 = time.perf_counter()
    test = LBTest(args, group, op)
    log(group, f'[init] {num_ranks} ranks, {test.buf.topology.num_ranks_per_gpu()} per GPU; {args.num_experts} '
               f'experts ({test.L} local), {test.C} redundant slots per rank; hidden sweep '
               f'{list(CORRECTNESS_HIDDENS)} FP32, perf {test.perf_hidden} FP32 ({args.num_hidden_bytes / 1e6:.1f} MB '
               f'per expert); {test.num_sms} SMs; LB region {test.buf._lb.num_bytes >> 20} MiB; built in '
               f'{time.perf_counter() - t0:.2f} s')
    ok = True
    try:
        if not args.skip_check:
            t0 = time.perf_counter()
            patterns = ('random', 'ring', 'spread') if num_ranks > 2 else ('random', 'ring')
            n = sum(test.run_checks(pattern, args.num_rounds) for pattern in patterns)
            test.run_random_values()
            log(group, f'[check] {n} calls over {len(CORRECTNESS_HIDDENS)} hidden sizes x {args.num_rounds} rounds x '
                       f'{list(patterns)}, plus random FP32 values: bitwise equal to the host references '
                       f'({time.perf_counter() - t0:.1f} s)')
        if not args.skip_error_test:
            tried = test.run_errors()
            log(group, f'[errors] {len(tried)} invalid calls raised on every rank before any kernel; the buffer still '
                       f'works:')
            for line in tried:
                log(group, f'    {line}')
        if not args.skip_perf_test:
            lines, ratio = test.run_perf(args.pattern)
            for rank_lines in group.allgather_object(lines):
                for line in rank_lines:
                    log(group, line)
            ratios = group.allgather_object(ratio)
            if all(r is not None for r in ratios):
                worst = min(ratios)
                log(group, f'[target] {args.pattern}: slowest rank\'s kernel at {worst:.2f} x the peer-copy floor '
                           f'speed (target >= 0.80 on the ring pattern): {"MET" if worst >= 0.8 else "NOT MET"}')
    except Failure as e:
        print(f'[rank {rank}] FAILED: {e}', flush=True)
        ok = False
    test.destroy()
    ok = all(group.allgather_object(ok))
    if ok and not args.skip_timeout_test and num_ranks > 1:
        good = test_timeout(args, group, op)
        log(group, f'[timeout] a missing rank gives TimeoutError on every other rank: {"OK" if good else "FAILED"}')
        ok &= good
    ok = all(group.allgather_object(ok))
    log(group, f'{name} test: PASSED' if ok else f'{name} test: FAILED')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
