"""PP send/recv rank program: random-timing ring stress, back-pressure, CuPy, events, argument errors, size
mismatch, reconfiguration and timeout checks, then DeepEP-style performance lines.

    mpirun -np N python -m deepep_cupy.tests.pp [--num-tokens 4096 --hidden 7168 --num-max-inflight-tensors 4
        --num-stress-iterations 4 --num-sends 128 --num-sleep-cycles 1e7]

Stress (DeepEP's test_pp): every iteration draws `--num-sends` messages between random ring neighbours with random
send times and a receive time shortly after, the same schedule on every rank; each rank runs its sends and receives
in time order with GPU sleeps in between and checks every received tensor bit for bit. Here a quarter of the
messages have a random byte count (a 1-D uint8 tensor) instead of the full `[num_tokens, hidden]` bfloat16 shape, and
a schedule that cannot complete under the documented semantics (a send waits while `num_max_inflight_tensors`
messages of its pair are unreceived, one stream per rank) is re-drawn: about 0.5% of 2-rank schedules are such.
Message contents are regenerated on the receiver from a per-message seed, so no reference needs NCCL or the code
under test. `--num-processes` is accepted for DeepEP compatibility and ignored (start the ranks with mpirun).

Hybrid mode (several scale-up domains, e.g. `DEEPEP_CUPY_SCALEUP_SIZE=1` with ranks sharing a GPU): the same checks,
the ring crossing domains through the links of features/pp/links.py (`DEEPEP_CUPY_RAIL_TRANSPORT=loopback` on one
GPU, NCCL between GPUs); the timeout checks then wait on a cross-domain neighbour when rank 1 is in another domain.
"""

import random
import sys
import time
from typing import List, NamedTuple, Optional

import numpy as np

from ..runtime import preflight
from . import cli

try:
    import torch
except ImportError as e:  # `--help` works without torch; a run names the extra that brings it
    preflight.exit_if_main(e, __name__, cli.pp_parser)
    raise

from .. import ElasticBuffer
from ..features.pp.plan import get_pp_buffer_size_hint, neighbours
from ..runtime.group import get_group
from ..utils.envs import init_dist
from ..utils.testing import bench_kineto, sleep_gpu
from .common import Failure, check

FULL_SIZE_FRACTION = 0.75
TIMESTAMP_RANGE = 10 ** 8
RECV_DELAY_RANGE = 3 * 10 ** 6


def make_buffer(group, num_bytes: int, **kwargs):
    """The buffer under test: an `ElasticBuffer` (hybrid mode allowed: several domains when
    `DEEPEP_CUPY_SCALEUP_SIZE` cuts the ranks into domains; one NVLink domain otherwise)."""
    return ElasticBuffer(group, num_bytes=num_bytes, allow_hybrid_mode=True, explicitly_destroy=True, **kwargs)


# ---- schedules (pure Python, unit-tested in tests/test_pp_cpu.py) ----------------------------------------------------
class Message(NamedTuple):
    src: int
    dst: int
    idx: int            # position in the FIFO of the pair (src, dst)
    num_bytes: int      # the full size: a [num_tokens, hidden] bfloat16 tensor; else a 1-D uint8 tensor


class Op(NamedTuple):
    timestamp: int
    kind: str           # 'send' or 'recv'
    peer: int
    message: Message


def generate_stress_ops(num_ranks: int, num_sends: int, full_bytes: int, rng: random.Random) -> List[List[Op]]:
    """Every rank's operations, in time order (DeepEP's generator plus random sizes). The k-th receive of a pair is
    matched with its k-th send and is always later in time."""
    sends, recv_times = {}, {}
    for _ in range(num_sends):
        src = rng.randint(0, num_ranks - 1)
        dst = (src + (1 if rng.randint(0, 1) else -1)) % num_ranks
        st = rng.randint(0, TIMESTAMP_RANGE)
        rt = st + rng.randint(1, RECV_DELAY_RANGE)
        size = full_bytes if rng.random() < FULL_SIZE_FRACTION else rng.randint(1, full_bytes)
        sends.setdefault((src, dst), []).append((st, size))
        recv_times.setdefault((src, dst), []).append(rt)
    ops: List[List[Op]] = [[] for _ in range(num_ranks)]
    for (src, dst), items in sends.items():
        for k, ((st, size), rt) in enumerate(zip(sorted(items), sorted(recv_times[(src, dst)]))):
            m = Message(src, dst, k, size)
            ops[src].append(Op(st, 'send', dst, m))
            ops[dst].append(Op(rt, 'recv', src, m))
    for rank_ops in ops:
        rank_ops.sort(key=lambda op: (op.timestamp, op.kind != 'send', op.peer, op.message.idx))
    return ops


def schedule_deadlocks(ops: List[List[Op]], capacity: int) -> bool:
    """Whether the schedule cannot complete when each rank runs its operations in order on one stream, a send waits
    while `capacity` earlier messages of its pair are unreceived and a receive waits for its message."""
    pos = [0] * len(ops)
    num_sent, num_recv = {}, {}
    progress = True
    while progress:
        progress = False
        for r, rank_ops in enumerate(ops):
            while pos[r] < len(rank_ops):
                op = rank_ops[pos[r]]
                m = op.message
                pair = (m.src, m.dst)
                if op.kind == 'send' and num_recv.get(pair, 0) < m.idx + 1 - capacity:
                    break
                if op.kind == 'recv' and num_sent.get(pair, 0) < m.idx + 1:
                    break
                (num_sent if op.kind == 'send' else num_recv)[pair] = m.idx + 1
                pos[r] += 1
                progress = True
    return any(p < len(rank_ops) for p, rank_ops in zip(pos, ops))


def feasible_stress_ops(num_ranks: int, num_sends: int, full_bytes: int, capacity: int, seed: int):
    """`(ops, num_redraws)`: the first schedule from seeds `seed, seed + 1, ...` that can complete."""
    for attempt in range(1000):
        ops = generate_stress_ops(num_ranks, num_sends, full_bytes, random.Random(seed + attempt))
        if not schedule_deadlocks(ops, capacity):
            return ops, attempt
    raise RuntimeError(f'no feasible PP schedule for {num_ranks} ranks, capacity {capacity}')


def message_seed(seed: int, iteration: int, m: Message) -> int:
    return ((((seed * 1000003 + iteration) * 131 + m.src) * 131 + m.dst) * 1000003 + m.idx) % (2 ** 63)


def make_message(m: Message, seed: int, iteration: int, shape) -> torch.Tensor:
    """The tensor of message m: random bits (bfloat16 viewed from int16, or uint8), the same on sender and receiver."""
    g = torch.Generator(device='cuda')
    g.manual_seed(message_seed(seed, iteration, m))
    if m.num_bytes == int(np.prod(shape)) * 2:
        return torch.randint(-2 ** 15, 2 ** 15, shape, dtype=torch.int16, device='cuda', generator=g) \
            .view(torch.bfloat16)
    return torch.randint(0, 256, (m.num_bytes,), dtype=torch.uint8, device='cuda', generator=g)


def first_mismatch(got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """None if bitwise equal, else where they first differ (bit patterns, so NaN payloads compare too)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    a, b = got.reshape(-1).view(view), want.reshape(-1).view(view)
    if a.shape != b.shape:
        return f'{a.numel()} elements, expected {b.numel()}'
    if torch.equal(a, b):
        return None
    diff = (a != b).nonzero()
    i = int(diff[0])
    return f'{diff.numel()} elements differ, first at flat index {i}: got {int(a[i])}, expected {int(b[i])}'


# ---- correctness -----------------------------------------------------------------------------------------------------
def run_stress(buf, args, shape, rank: int, num_ranks: int) -> int:
    full_bytes = int(np.prod(shape)) * 2
    total = 0
    for it in range(args.num_stress_iterations):
        ops, redraws = feasible_stress_ops(num_ranks, args.num_sends, full_bytes, args.num_max_inflight_tensors,
                                           args.seed * 7919 + it * 1009)
        prev_ts = 0
        for j, op in enumerate(ops[rank]):
            m = op.message
            if op.kind == 'send':
                buf.pp_send(make_message(m, args.seed, it, shape), op.peer, num_sms=args.num_sms)
            else:
                want = make_message(m, args.seed, it, shape)
                got = torch.empty_like(want)
                got.view(torch.uint8).fill_(0xA5)       # poison: a receive that copies nothing shows up
                buf.pp_recv(got, op.peer, num_sms=args.num_sms)
                bad = first_mismatch(got, want)
                check(bad is None, f'rank {rank}: stress iteration {it}, op {j}: message #{m.idx} from rank {m.src} '
                                   f'({m.num_bytes} bytes): {bad}')
            if op.timestamp > prev_ts:
                sleep_gpu(int((op.timestamp - prev_ts) / TIMESTAMP_RANGE * args.num_sleep_cycles))
                prev_ts = op.timestamp
        total += len(ops[rank])
        if rank == 0 and redraws:
            print(f'[stress] iteration {it}: {redraws} schedule(s) re-drawn (could not complete)', flush=True)
    buf.synchronize()
    return total


def run_back_pressure(buf, args, rank: int, num_ranks: int, shape) -> None:
    """A sender runs `num_max_inflight_tensors + 2` messages ahead of a receiver that first sleeps ~25 ms: with every
    slot full the sender must wait on the GPU, never overwrite. Round 0: even ranks send to the next rank; round 1:
    odd ranks send to the previous rank (disjoint pairs, so no ring of waiting senders can form)."""
    n = args.num_max_inflight_tensors + 2
    small = (max(1, shape[0] // 4), shape[1])
    num_bytes = small[0] * small[1] * 2
    for round_idx, step in enumerate((1, -1)):
        parity, salt = round_idx, 10 ** 6 + round_idx
        if rank % 2 == parity and 0 <= rank + step < num_ranks:
            for k in range(n):
                buf.pp_send(make_message(Message(rank, rank + step, k, num_bytes), args.seed, salt, small), rank + step)
        src = rank - step
        if 0 <= src < num_ranks and src % 2 == parity:
            sleep_gpu(5e7)
            for k in range(n):
                want = make_message(Message(src, rank, k, num_bytes), args.seed, salt, small)
                got = torch.empty_like(want)
                buf.pp_recv(got, src)
                bad = first_mismatch(got, want)
                check(bad is None, f'rank {rank}: back-pressure round {round_idx}, message {k} from {src}: {bad}')
        buf.synchronize()
        buf.group.barrier()


def run_cupy_and_events(buf, rank: int, num_ranks: int) -> None:
    """CuPy arrays in and out (two messages per rank, both neighbours); async sends and receives with events and
    previous_event (torch)."""
    import cupy
    prev_idx, next_idx = neighbours(rank, num_ranks)
    limit = buf._pp.layout.num_max_tensor_bytes
    rows = min(4096, limit // 256)          # the float32 message has 256-byte rows

    def payload(src, salt):
        return (cupy.arange(rows * 64, dtype=cupy.uint32).reshape(rows, 64) * 2654435761 + src * 97 + salt) \
            .astype(cupy.uint16)
    buf.pp_send(payload(rank, 1), next_idx)
    buf.pp_send(payload(rank, 2).astype(cupy.float32), prev_idx)
    got_prev = cupy.empty((rows, 64), dtype=cupy.uint16)
    got_next = cupy.empty((rows, 64), dtype=cupy.float32)
    buf.pp_recv(got_prev, prev_idx)         # with 2 ranks: the first message of the single pair, in FIFO order
    buf.pp_recv(got_next, next_idx)
    check(bool((got_prev == payload(prev_idx, 1)).all()), f'rank {rank}: CuPy uint16 message from {prev_idx}')
    check(bool((got_next == payload(next_idx, 2).astype(cupy.float32)).all()),
          f'rank {rank}: CuPy float32 message from {next_idx}')

    numel = min(1 << 20, limit // 4)
    x = torch.arange(numel, dtype=torch.int32, device='cuda') * (rank + 3)
    ev = buf.pp_send(x, next_idx, async_with_compute_stream=True)
    ev.current_stream_wait()
    out = torch.empty_like(x)
    ev = buf.pp_recv(out, prev_idx, previous_event=buf.capture(), async_with_compute_stream=True)
    ev.current_stream_wait()
    want = torch.arange(numel, dtype=torch.int32, device='cuda') * (prev_idx + 3)
    check(torch.equal(out, want), f'rank {rank}: async receive from {prev_idx}')
    buf.synchronize()


def run_errors(buf, args, rank: int, num_ranks: int) -> List[str]:
    """Invalid calls raise before any kernel runs (the per-pair counters do not move); then a size mismatch is
    reported by the next PP call; a reconfiguration with a message in flight is refused; the buffer keeps working."""
    prev_idx, next_idx = neighbours(rank, num_ranks)
    limit = buf._pp.layout.num_max_tensor_bytes
    good = torch.zeros(1024, dtype=torch.uint8, device='cuda')
    raw = torch.zeros(64, dtype=torch.uint8, device='cuda')
    cases = [
        ('x over num_max_tensor_bytes', ValueError, lambda: buf.pp_send(
            torch.empty(limit + 1, dtype=torch.uint8, device='cuda'), next_idx)),
        ('x on the host', ValueError, lambda: buf.pp_send(torch.zeros(16), next_idx)),
        ('x not contiguous', ValueError, lambda: buf.pp_recv(torch.zeros(8, 8, device='cuda')[:, ::2], prev_idx)),
        ('x not 16-byte aligned', ValueError, lambda: buf.pp_send(raw[1:17], next_idx)),
        ('x not an array', TypeError, lambda: buf.pp_send(np.zeros(4), next_idx)),
        ('x of an unsupported dtype', TypeError, lambda: buf.pp_send(torch.zeros(4, dtype=torch.complex64,
                                                                                 device='cuda'), next_idx)),
        ('dst is this rank', ValueError, lambda: buf.pp_send(good, rank)),
        ('dst out of range', ValueError, lambda: buf.pp_send(good, num_ranks)),
        ('dst not an int', TypeError, lambda: buf.pp_send(good, float(next_idx))),
        ('src negative', ValueError, lambda: buf.pp_recv(good, -1)),
        ('num_sms negative', ValueError, lambda: buf.pp_send(good, next_idx, num_sms=-1)),
        ('previous_event of the wrong type', TypeError, lambda: buf.pp_send(good, next_idx, previous_event=1)),
        ('pp_set_config larger than the buffer', ValueError, lambda: buf.pp_set_config(buf.num_bytes, 1)),
    ]
    if num_ranks >= 4:
        cases.append(('dst not a neighbour', ValueError, lambda: buf.pp_send(good, (rank + 2) % num_ranks)))
    counts = (dict(buf._pp.num_sent), dict(buf._pp.num_recv))
    tried = []
    for name, exc, fn in cases:
        try:
            fn()
            raise Failure(f'rank {rank}: {name}: no error')
        except exc as e:
            tried.append(f'{name}: {type(e).__name__}: {e}')
        check((buf._pp.num_sent, buf._pp.num_recv) == counts, f'rank {rank}: {name}: a kernel was launched')

    # Size mismatch: 4096 bytes sent, an 8192-byte tensor receives; reported by the next PP call, nothing copied.
    buf.pp_send(torch.full((4096,), 7, dtype=torch.uint8, device='cuda'), next_idx)
    poisoned = torch.full((8192,), 0xAB, dtype=torch.uint8, device='cuda')
    buf.pp_recv(poisoned, prev_idx)
    buf.synchronize()
    try:
        buf.pp_send(good, next_idx)
        raise Failure(f'rank {rank}: a size mismatch was not reported')
    except RuntimeError as e:
        check('8192 bytes' in str(e) and '4096 bytes' in str(e), f'rank {rank}: mismatch message: {e}')
        tried.append(f'size mismatch (reported by the next call): RuntimeError: {e}')
    check(bool((poisoned == 0xAB).all()), f'rank {rank}: a mismatched receive wrote into the tensor')

    # Reconfiguration: refused on every rank while a message is in flight, accepted once it is received.
    buf.pp_send(good, next_idx)
    try:
        buf.pp_set_config(limit, args.num_max_inflight_tensors)
        raise Failure(f'rank {rank}: pp_set_config accepted a message in flight')
    except RuntimeError as e:
        tried.append(f'pp_set_config with a message in flight: RuntimeError: {e}')
    out = torch.empty_like(good)
    buf.pp_recv(out, prev_idx)
    buf.pp_set_config(4096, 2)
    check(buf._pp.layout.num_max_inflight_tensors == 2, 'reconfiguration')
    buf.pp_set_config(limit, args.num_max_inflight_tensors)
    x = torch.arange(777, dtype=torch.uint8, device='cuda') + rank
    buf.pp_send(x, next_idx)
    buf.pp_recv(out[:777], prev_idx)
    check(torch.equal(out[:777], torch.arange(777, dtype=torch.uint8, device='cuda') + prev_idx),
          f'rank {rank}: exchange after the error cases')
    buf.synchronize()
    return tried


def run_timeouts(group, args) -> bool:
    """Rank 0 receives from rank 1, which never sends; then rank 0 sends one message more than the slots hold to rank
    1, which never receives. Both must end in a TimeoutError naming rank 1 (aux 2, then aux 1)."""
    ok = True
    for what, aux in (('recv', 2), ('send', 1)):
        buf = make_buffer(group, get_pp_buffer_size_hint(1 << 20, 2), num_gpu_timeout_secs=args.timeout_test_secs)
        buf.pp_set_config(1 << 20, 2)
        outcome = 'not involved'
        if group.rank == 0:
            x = torch.zeros(1 << 20, dtype=torch.uint8, device='cuda')
            try:
                if what == 'recv':
                    buf.pp_recv(x, 1)
                else:
                    for _ in range(3):
                        buf.pp_send(x, 1)
                buf.synchronize()
                outcome = 'no error'
            except TimeoutError as e:
                good = 'waited for rank 1' in str(e) and f'aux {aux}' in str(e) and 'pp' in str(e)
                outcome = 'TimeoutError' if good else f'bad message: {e}'
                print(f'[timeout] rank 0, {what}: {e}', flush=True)
        outcomes = group.allgather_object(outcome)
        buf.destroy()
        ok &= outcomes[0] == 'TimeoutError'
    return ok


# ---- performance -----------------------------------------------------------------------------------------------------
def perf(buf, args, group, shape) -> List[str]:
    """Per-kernel times (profiler) of 1-3 concurrent tensors sent to the next rank and received from the previous one,
    next to the peer-copy floor (the same bytes to the next rank, plain copy kernel) and NCCL send/recv."""
    from ..features.peer_copy import PeerCopy
    from ..runtime import interop
    rank, num_ranks = group.rank, group.size
    prev_idx, next_idx = neighbours(rank, num_ranks)
    num_bytes = int(np.prod(shape)) * 2
    num_tests = args.num_perf_tests
    sends = [torch.randn(shape, device='cuda').to(torch.bfloat16) for _ in range(3)]
    recvs = [torch.empty(shape, dtype=torch.bfloat16, device='cuda') for _ in range(3)]
    # GPU sleep covering ~1.5x the transfer at 300 GB/s and a 2 GHz clock (DeepEP hides its RDMA latency the same way).
    sleep_cycles = int(num_bytes / 300e9 * 2e9 * 1.5)
    kineto = dict(num_tests=num_tests, barrier_comm_profiling=True, barrier=buf.barrier, suppress_kineto_output=True)
    lines, best, best_recv = [], {}, {}
    for hide in (True, False):
        for n in (1, 2, 3):
            if n > args.num_max_inflight_tensors:
                continue

            def loop(n=n, hide=hide):
                for t in sends[:n]:
                    buf.pp_send(t, next_idx, num_sms=args.num_sms)
                if hide:
                    sleep_gpu(sleep_cycles * n)
                for t in recvs[:n]:
                    buf.pp_recv(t, prev_idx, num_sms=args.num_sms)
            send_t, recv_t = bench_kineto(loop, ('send_impl', 'recv_impl'), **kineto)
            best[(hide, n)] = send_t
            best_recv[(hide, n)] = recv_t
            latency = 'hidden' if hide else 'exposed'
            lines.append(f'[perf] rank {rank} | {n} x {num_bytes / 1e6:.1f} MB, latency {latency}: '
                         f'send {send_t * 1e6:.1f} us ({num_bytes / send_t / 1e9:.0f} GB/s; DeepEP formula '
                         f'{2 * num_bytes / send_t / 1e9:.0f}), recv {recv_t * 1e6:.1f} us '
                         f'({num_bytes / recv_t / 1e9:.0f} GB/s; DeepEP formula '
                         f'{(2 if hide else 1) * num_bytes / recv_t / 1e9:.0f})')
    buf.synchronize()
    group.barrier()

    # Floor: the same bytes to the next rank with the plain peer-copy kernel (writes into the idle PP region).
    num_sms = min(args.num_sms or buf.num_device_sms, buf.num_device_sms)
    floor_t = None
    if buf.num_scaleout_ranks > 1:
        lines.append(f'[perf] rank {rank} | peer-copy floor skipped: the next rank may be in another domain')
    elif num_bytes % 16 == 0 and buf.data_offset + num_ranks * num_bytes <= buf.sym.num_bytes:
        send_bytes = [num_bytes if p == next_idx else 0 for p in range(num_ranks)]
        copy = PeerCopy.from_buffer(buf).prepare(sends[0], send_bytes, buf.data_offset, num_bytes, num_sms)
        floor_t = bench_kineto(lambda: copy(interop.current_stream()), 'peer_copy', **kineto)
        ratio = floor_t / best[(True, 1)]
        both = floor_t / (best[(True, 1)] + best_recv[(True, 1)])
        lines.append(f'[perf] rank {rank} | peer-copy floor {floor_t * 1e6:.1f} us '
                     f'({num_bytes / floor_t / 1e9:.0f} GB/s, {num_sms} SMs): one send at {ratio:.0%} of the floor '
                     f'(target >= 80%: {"met" if ratio >= 0.8 else "NOT met"}); send + recv at {both:.0%}')
    else:
        lines.append(f'[perf] rank {rank} | peer-copy floor skipped: needs 16-byte multiples and {num_ranks} x '
                     f'{num_bytes} bytes in the buffer')
    buf.synchronize()
    group.barrier()

    if buf.topology.num_ranks_per_gpu() == 1:
        from ..runtime.nccl import create_nccl_comm
        nccl = create_nccl_comm(group)
        try:
            rows = shape[0]
            send_splits = [rows if p == next_idx else 0 for p in range(num_ranks)]
            recv_splits = [rows if p == prev_idx else 0 for p in range(num_ranks)]
            nccl_t = bench_kineto(lambda: nccl.all_to_all_single(recvs[0], sends[0], recv_splits, send_splits),
                                  'nccl', **kineto)
            lines.append(f'[perf] rank {rank} | NCCL send/recv {nccl_t * 1e6:.1f} us '
                         f'({num_bytes / nccl_t / 1e9:.0f} GB/s): one PP send takes {best[(True, 1)] / nccl_t:.2f}x')
        finally:
            torch.cuda.synchronize()
            nccl.destroy()
    return lines


def main(argv=None) -> int:
    p = cli.pp_parser()
    args = p.parse_args(argv)
    preflight.check_cuda()
    if args.num_tokens * args.hidden * 2 < 65536 or args.num_tokens < 4:
        p.error('the checks need tensors of at least 64 KiB and 4 rows (--num-tokens x --hidden x 2 bytes)')
    if args.num_max_inflight_tensors < 1:
        p.error('--num-max-inflight-tensors must be at least 1')

    rank, num_ranks, _ = init_dist(seed=args.seed)
    group = get_group()  # host group: MPI under mpirun, else the torch world init_dist joined
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    shape = (args.num_tokens, args.hidden)
    num_max_tensor_bytes = int(np.prod(shape)) * 2
    t0 = time.perf_counter()
    buf = make_buffer(group, get_pp_buffer_size_hint(num_max_tensor_bytes, args.num_max_inflight_tensors),
                      num_gpu_timeout_secs=args.num_gpu_timeout_secs)
    ok = True
    if num_ranks == 1:
        try:
            buf.pp_set_config(num_max_tensor_bytes, args.num_max_inflight_tensors)
            ok = False
            log('[init] 1 rank: pp_set_config did not raise')
        except ValueError as e:
            log(f'[init] 1 rank: pp_set_config raised ValueError as it should: {e}')
        buf.destroy()
        log('pp test: PASSED' if ok else 'pp test: FAILED')
        return 0 if ok else 1

    buf.pp_set_config(num_max_tensor_bytes, args.num_max_inflight_tensors)
    if buf.num_scaleout_ranks > 1:
        kinds = [f'{rank}->{nb.peer}: {nb.kind}' for nb in buf._pp.hybrid.neighbours.values()]
        for rank_kinds in group.allgather_object(kinds):
            log(f'[init] hybrid {buf.num_scaleout_ranks} domains x {buf.num_scaleup_ranks} ranks, links '
                f'{", ".join(rank_kinds)}')
    log(f'[init] {num_ranks} ranks, {buf.topology.num_ranks_per_gpu()} per GPU, {type(buf).__name__} of '
        f'{buf.num_bytes / 2 ** 20:.0f} MiB (PP uses {buf._pp.layout.num_bytes / 2 ** 20:.0f}), ready in '
        f'{time.perf_counter() - t0:.2f} s; tensors {list(shape)} bfloat16, {args.num_max_inflight_tensors} in flight')
    try:
        t0 = time.perf_counter()
        n = run_stress(buf, args, shape, rank, num_ranks)
        counts = group.allgather_object(n)
        log(f'[stress] {args.num_stress_iterations} iterations x {args.num_sends} random sends with GPU sleeps: '
            f'{sum(counts)} operations bitwise correct ({time.perf_counter() - t0:.1f} s)')
        run_back_pressure(buf, args, rank, num_ranks, shape)
        log(f'[back-pressure] {args.num_max_inflight_tensors + 2} messages ahead of a sleeping receiver: no overwrite')
        run_cupy_and_events(buf, rank, num_ranks)
        log('[check] CuPy arrays, async events and previous_event: bitwise equal')
        if not args.skip_error_test:
            tried = run_errors(buf, args, rank, num_ranks)
            log(f'[errors] {len(tried)} invalid calls raised (before any kernel where the host can tell):')
            for line in tried:
                log(f'    {line}')
        if not args.skip_perf_test:
            if buf.topology.num_ranks_per_gpu() > 1:
                log('[perf] skipped: ranks share GPUs (a correctness-only run)')
            else:
                for rank_lines in group.allgather_object(perf(buf, args, group, shape)):
                    for line in rank_lines:
                        log(line)
    except Failure as e:
        print(f'[rank {rank}] FAILED: {e}', flush=True)
        ok = False
    ok = all(group.allgather_object(ok))
    buf.destroy()
    if ok and not args.skip_timeout_test:
        good = run_timeouts(group, args)
        log(f'[timeout] missing receive and missing send reported as TimeoutError naming the peer: '
            f'{"OK" if good else "FAILED"}')
        ok &= good
    ok = all(group.allgather_object(ok))
    log('pp test: PASSED' if ok else 'pp test: FAILED')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
