"""Fault program: a rank SIGKILLed at a chosen point must never hang the others.

    python -m deepep_cupy.tests.faults [--mode ipc|nccl] [--num-ranks 2|4] [--cases a,b] [--out DIR]

Its own launcher (mpirun ends a job whose rank dies): the parent starts N children of this module (`--child CASE`),
all on GPU 0, joined by the TCP host group (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, a fresh
DEEPEP_CUPY_TCP_SECRET per case). ipc: one scale-up domain (CUDA IPC). nccl: hybrid mode over two domains (rank g in
domain g // R), each domain its own host for deepep_cupy and for NCCL (DEEPEP_CUPY_HOST = NCCL_HOSTID = node<d>), the
rails NCCL over sockets on the loopback.

Each child builds the case's buffer twice: once with long timeouts for a warm-up round (JIT, NCCL set-up), then with
the small ones for a fault-free reference round, which keeps its outputs (the faulted round uses the same inputs).
After a host barrier the victim (default the last rank) kills itself at the case's point; every survivor runs up to
--num-rounds rounds of the workload from there until a call raises, records the error, what its outputs hold, whether
the buffer still serves, destroys it, prints one `[fault-result] {json}` line and exits 0. The parent bounds every
child (--delay-secs + timeout + --slack-secs + 60 s after the victim's death): a child still running then has its
Python stacks dumped into its log (SIGUSR1, faulthandler), is killed and counts as a HANG. Logs:
<out>/<mode>_n<ranks>_<case>_rank<r>.log; every record in <out>/faults_<mode>_n<ranks>.json.
"""

import faulthandler
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from . import cli

RESULT_TAG = '[fault-result] '
PROGRESS_TAG = '[child] '
EXIT_OK, EXIT_SETUP = 0, 3
ERROR_TYPES = ('TimeoutError', 'RuntimeError')
# Words of the phases the library names (runtime/errors.py PHASES and RAIL_EXCHANGES, the host waits' own words)
PHASE_WORDS = ('barrier', 'notify', 'dispatch', 'combine', 'peer copy', 'all-gather', 'reduce-scatter', 'all-reduce',
               'rail exchange', 'low-latency')


# ---- the cases -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FaultCase:
    """One kill point.

    Attributes:
        name: the case (`--cases`).
        api: the workload: `'v2'` ElasticBuffer dispatch (CPU sync) + combine + synchronize, `'graph'` a CUDA graph
            of dispatch (no CPU sync) + combine, `'ll'` V1 Buffer low_latency_dispatch + combine.
        modes: where it applies (`'ipc'`, `'nccl'`; V1 low-latency runs inside one domain only).
        pre: steps every rank runs after the reference round, before the barrier that precedes the fault.
        start: the step the faulted round begins with (victim and survivors).
        kill: `'now'` (before `start`), `'in_host_wait'` (a timer thread, once the victim's main thread waits inside
            `start` on the host), `'in_flight'` (right after `start` returned, its kernels still running).
        delayed: survivors begin `start` --delay-secs after the victim (so that it dies inside its call).
        phases: words one of which the survivors' error must contain (empty: any phase word).
        host_wait: a host wait bounded by num_cpu_timeout_secs may be what reports (hybrid CPU-sync dispatch).
        what: one line for the report.
    """
    name: str
    api: str
    modes: Tuple[str, ...]
    pre: Tuple[str, ...]
    start: str
    kill: str
    delayed: bool
    phases: Tuple[str, ...]
    host_wait: bool
    what: str


BOTH, IPC = ('ipc', 'nccl'), ('ipc',)
CASES = (
    FaultCase('before_dispatch', 'v2', BOTH, (), 'dispatch', 'now', False, ('notify', 'dispatch'), True,
              'the victim dies before a CPU-sync dispatch'),
    FaultCase('in_dispatch_wait', 'v2', BOTH, (), 'dispatch', 'in_host_wait', True, ('notify', 'dispatch', 'combine'),
              True, 'the victim dies inside a CPU-sync dispatch\'s host wait for the counts'),
    FaultCase('before_combine', 'v2', BOTH, ('dispatch', 'device_sync'), 'combine', 'now', False, ('combine',), False,
              'every rank dispatched; the victim dies before combine'),
    FaultCase('in_low_latency', 'll', IPC, (), 'll_dispatch', 'in_flight', True, ('dispatch', 'combine'), False,
              'the victim dies while its V1 low_latency_dispatch kernel waits'),
    FaultCase('in_low_latency_combine', 'll', IPC, ('ll_dispatch', 'device_sync'), 'll_combine', 'in_flight', True,
              ('combine', 'dispatch'), False, 'the victim dies while its V1 low_latency_combine kernel waits'),
    FaultCase('in_graph_replay', 'graph', BOTH, (), 'replay', 'in_flight', True, (), False,
              'the victim dies while its CUDA-graph replay of dispatch + combine waits'),
)
CASES_BY_NAME = {c.name: c for c in CASES}
assert tuple(CASES_BY_NAME) == cli.FAULT_CASES
ROUND_STEPS = {'v2': ('dispatch', 'combine', 'sync'), 'graph': ('replay', 'sync'),
               'll': ('ll_dispatch', 'wait', 'll_combine', 'wait')}


def select_cases(mode: str, text: str) -> List[FaultCase]:
    """The cases of `--cases` (`all`: every case of the mode); ValueError naming an unknown or inapplicable one."""
    if text.strip() == 'all':
        return [c for c in CASES if mode in c.modes]
    out = []
    for name in (n.strip() for n in text.split(',') if n.strip()):
        case = CASES_BY_NAME.get(name)
        if case is None:
            raise ValueError(f'--cases: unknown case {name!r}; cases: {", ".join(CASES_BY_NAME)}')
        if mode not in case.modes:
            raise ValueError(f'--cases: {name} runs in mode {"/".join(case.modes)} only (V1 low-latency has no hybrid '
                             f'mode), not --mode {mode}')
        out.append(case)
    if not out:
        raise ValueError('--cases names no case')
    return out


def round_sequence(case: FaultCase, num_rounds: int) -> List[Tuple[int, str]]:
    """`(round, step)` a survivor runs from the fault: the workload's rounds, the first begun at `case.start`."""
    steps = ROUND_STEPS[case.api]
    first = steps.index(case.start)
    return [(1, s) for s in steps[first:]] + [(r, s) for r in range(2, num_rounds + 1) for s in steps]


def ranks_per_domain(mode: str, num_ranks: int) -> int:
    return num_ranks // 2 if mode == 'nccl' else num_ranks


def close_ranks(victim: int, num_ranks: int, num_scaleup: int) -> set:
    """Ranks that wait for the victim directly: its domain and its rail (ep_hybrid.test_timeout's rule)."""
    R = num_scaleup
    return {g for g in range(num_ranks) if g // R == victim // R or g % R == victim % R} - {victim}


_PEER_PATTERNS = (r'waited for rank (\d+)', r'peer rank (\d+)\b', r'peer ranks \[([\d, ]*)\]', r'from rank (\d+) at',
                  r'not yet heard from: \[([\d, ]*)\]', r'missing ranks \[([\d, ]*)\]')


def named_ranks(message: str) -> set:
    """The peers an error message names as the ones waited for (not the reporting rank's own `rank N:`)."""
    out = set()
    for pattern in _PEER_PATTERNS:
        for m in re.finditer(pattern, message):
            out.update(int(v) for v in re.findall(r'\d+', m.group(1)))
    return out


def phases_named(message: str) -> List[str]:
    return [w for w in PHASE_WORDS if w in message]


def bound_secs(case: FaultCase, mode: str, gpu_secs: float, cpu_secs: float) -> float:
    """The timeout a survivor's error must come within (before the slack): the GPU timeout, or the CPU timeout
    where a hybrid host wait may be what reports."""
    return max(gpu_secs, cpu_secs) if case.host_wait and mode == 'nccl' else gpu_secs


def in_host_wait(stack: Sequence[str]) -> bool:
    """Whether a stack (function names) is inside a CPU-sync dispatch's host wait for the counts (features/ep
    `_wait_host_counts`; hybrid `_notify` polling in `wait_until`)."""
    return '_wait_host_counts' in stack or ('_notify' in stack and 'wait_until' in stack)


# ---- the parent ----------------------------------------------------------------------------------------------------
_LAUNCH_VARS = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR', 'MASTER_PORT',
                'DEEPEP_CUPY_SCALEUP_SIZE', 'DEEPEP_CUPY_HOST', 'DEEPEP_CUPY_RAIL_TRANSPORT', 'DEEPEP_CUPY_TCP_SECRET',
                'DEEPEP_CUPY_DEVICE', 'DEEPEP_CUPY_CPU_TIMEOUT_SECS', 'NCCL_HOSTID')
_LAUNCH_PREFIXES = ('OMPI_', 'PMI_', 'PMIX_', 'MV2_', 'SLURM_', 'TORCHELASTIC_', 'MPI_LOCAL')
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(base: Dict[str, str], rank: int, num_ranks: int, mode: str, port: int, secret: str) -> Dict[str, str]:
    """A child's environment: the parent's without any launcher's variables, plus a TCP-group job of its own (RANK /
    WORLD_SIZE by hand, a loopback MASTER_ADDR), GPU 0, and for nccl its domain's host names and NCCL's sockets."""
    env = {k: v for k, v in base.items() if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    env.update(RANK=str(rank), WORLD_SIZE=str(num_ranks), MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port),
               DEEPEP_CUPY_TCP_SECRET=secret, DEEPEP_CUPY_DEVICE='0', PYTHONUNBUFFERED='1', NCCL_NVLS_ENABLE='0',
               TORCH_SYMM_MEM_DISABLE_MULTICAST='1', NVSHMEM_DISABLE_NVLS='1')
    env['PYTHONPATH'] = os.pathsep.join(p for p in (PACKAGE_ROOT, base.get('PYTHONPATH', '')) if p)
    if mode == 'nccl':
        R = ranks_per_domain(mode, num_ranks)
        host = f'node{rank // R}'
        env.update(DEEPEP_CUPY_SCALEUP_SIZE=str(R), DEEPEP_CUPY_HOST=host, NCCL_HOSTID=host,
                   DEEPEP_CUPY_RAIL_TRANSPORT='nccl', NCCL_P2P_DISABLE='1', NCCL_SHM_DISABLE='1', NCCL_IB_DISABLE='1',
                   NCCL_SOCKET_IFNAME='lo')
        env.setdefault('NCCL_DEBUG', 'WARN')
    return env


def child_argv(args, case: FaultCase) -> List[str]:
    """The child's command line after `python -m deepep_cupy.tests.faults`."""
    return ['--child', case.name, '--mode', args.mode, '--num-ranks', str(args.num_ranks), '--victim',
            str(args.victim), '--num-gpu-timeout-secs', str(args.num_gpu_timeout_secs), '--num-cpu-timeout-secs',
            str(args.num_cpu_timeout_secs), '--delay-secs', str(args.delay_secs), '--num-rounds', str(args.num_rounds),
            '--setup-secs', str(args.setup_secs), '--num-tokens', str(args.num_tokens), '--hidden', str(args.hidden),
            '--num-experts', str(args.num_experts), '--num-topk', str(args.num_topk), '--seed', str(args.seed)]


def parse_result(text: str) -> Optional[dict]:
    """The last `[fault-result] {json}` line of a child's log (None: it wrote none, or not whole)."""
    for line in reversed(text.splitlines()):
        if line.startswith(RESULT_TAG):
            try:
                return json.loads(line[len(RESULT_TAG):])
            except ValueError:
                return None
    return None


def last_progress(text: str) -> str:
    lines = [line[len(PROGRESS_TAG):] for line in text.splitlines() if line.startswith(PROGRESS_TAG)]
    return lines[-1] if lines else 'before its first progress line'


class ChildOutcome(NamedTuple):
    rank: int
    returncode: Optional[int]
    hung: bool
    secs: float                 # from the start of the case to the child's end (or its kill)
    record: Optional[dict]
    progress: str               # its last progress line


def supervise(procs: Dict[int, subprocess.Popen], victim: int, setup_secs: float, after_fault_secs: float,
              poll_secs: float = 0.05, dump_grace_secs: float = 2.0) -> Dict[int, Tuple[Optional[int], bool, float]]:
    """Wait for every child, bounded: `after_fault_secs` after the victim ended (before it: `setup_secs` more). A
    child still running then gets SIGUSR1 (its faulthandler dumps every thread's stack into its log), then SIGKILL.
    Returns rank -> (exit status, hung, seconds)."""
    start = time.monotonic()
    done: Dict[int, Tuple[Optional[int], bool, float]] = {}
    fault_at = None
    while len(done) < len(procs):
        now = time.monotonic()
        for g, p in procs.items():
            if g not in done and p.poll() is not None:
                done[g] = (p.returncode, False, now - start)
        if fault_at is None and victim in done:
            fault_at = now
        deadline = (fault_at if fault_at is not None else start + setup_secs) + after_fault_secs
        if now > deadline:
            hung = [g for g in procs if g not in done]
            for g in hung:
                _signal(procs[g], signal.SIGUSR1)
            time.sleep(dump_grace_secs)
            for g in hung:
                _signal(procs[g], signal.SIGKILL)
                procs[g].wait()
                done[g] = (procs[g].returncode, True, time.monotonic() - start)
            break
        time.sleep(poll_secs)
    return done


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (ProcessLookupError, OSError):
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def log_path(out_dir: str, mode: str, num_ranks: int, case: str, rank: int) -> str:
    return os.path.join(out_dir, f'{mode}_n{num_ranks}_{case}_rank{rank}.log')


def run_case(args, case: FaultCase, command: Optional[Callable[[int], List[str]]] = None) -> List[ChildOutcome]:
    """Start the case's children (`command(rank)`: their argv, default this module with `--child`), wait for them,
    bounded, and read their records."""
    W, victim = args.num_ranks, args.victim % args.num_ranks
    port, secret = free_port(), secrets.token_hex(32)
    os.makedirs(args.out, exist_ok=True)
    procs, logs = {}, {}
    for g in range(W):
        argv = command(g) if command else [sys.executable, '-m', 'deepep_cupy.tests.faults', *child_argv(args, case)]
        logs[g] = log_path(args.out, args.mode, W, case.name, g)
        with open(logs[g], 'w') as f:
            procs[g] = subprocess.Popen(argv, env=child_env(dict(os.environ), g, W, args.mode, port, secret),
                                        stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    bound = bound_secs(case, args.mode, args.num_gpu_timeout_secs, args.num_cpu_timeout_secs)
    try:
        status = supervise(procs, victim, args.setup_secs, args.delay_secs + bound + args.slack_secs + 60)
    finally:        # the parent interrupted (Ctrl-C, a step's timeout): no child outlives it
        for p in procs.values():
            if p.poll() is None:
                _signal(p, signal.SIGKILL)
                p.wait()
    out = []
    for g in range(W):
        with open(logs[g], errors='replace') as f:
            text = f.read()
        rc, hung, secs = status[g]
        out.append(ChildOutcome(g, rc, hung, secs, parse_result(text), last_progress(text)))
    return out


def judge(case: FaultCase, mode: str, num_ranks: int, victim: int, outcomes: Sequence[ChildOutcome],
          gpu_secs: float, cpu_secs: float, slack_secs: float) -> Tuple[List[str], List[str]]:
    """`(problems, notes)` of a case: the victim died by SIGKILL where intended; every survivor exited 0 by itself,
    raised TimeoutError / RuntimeError naming a phase and the victim (a rank outside the victim's domain and rail
    may name another rank, itself held up) within the bound plus the slack, and destroy() returned."""
    problems, notes = [], []
    v = outcomes[victim]
    vr = v.record or {}
    if v.hung:
        problems.append(f'victim r{victim}: HANG, never died ({v.progress})')
    elif vr.get('role') == 'setup_failed':
        problems.append(f'victim r{victim}: setup failed: {vr.get("error")}')
    elif v.returncode != -signal.SIGKILL:
        problems.append(f'victim r{victim}: exit status {v.returncode}, not SIGKILL ({v.progress})')
    if vr.get('role') == 'victim':
        notes.append(f'victim r{victim} killed {vr.get("where")}')
        if case.kill == 'in_host_wait' and not vr.get('in_wait'):
            problems.append(f'victim r{victim}: not inside the host wait when killed ({vr.get("where")})')
        if case.kill == 'in_flight' and not vr.get('in_flight'):
            problems.append(f'victim r{victim}: its call had finished before the kill (not inside it)')
    elif not v.hung and vr.get('role') != 'setup_failed':
        problems.append(f'victim r{victim}: no kill record ({v.progress})')
    kill_time = vr.get('kill_time')
    bound = bound_secs(case, mode, gpu_secs, cpu_secs)
    close = close_ranks(victim, num_ranks, ranks_per_domain(mode, num_ranks))
    for o in outcomes:
        if o.rank == victim:
            continue
        r, who = o.record or {}, f'r{o.rank}'
        if o.hung:
            where = 'at exit, after its record' if r.get('role') == 'survivor' else f'in: {o.progress}'
            problems.append(f'{who}: HANG, killed after {o.secs:.0f} s ({where}; stacks in its log)')
        if r.get('role') == 'setup_failed':
            problems.append(f'{who}: setup failed (exit {o.returncode}): {r.get("error")}')
            continue
        if not o.hung and o.returncode != EXIT_OK:
            problems.append(f'{who}: exit status {o.returncode} ({o.progress})')
        if r.get('role') != 'survivor':
            if not o.hung:
                problems.append(f'{who}: no result record ({o.progress})')
            continue
        etype, msg = r.get('error_type'), r.get('error') or ''
        secs = r.get('secs_in_step')
        after_kill = '' if kill_time is None or r.get('t_error') is None else \
            f', {r["t_error"] - kill_time:.1f} s after the kill'
        named, phases = named_ranks(msg), phases_named(msg)
        took = '-' if secs is None else f'{secs:.1f}'
        summary = (f'{who}: {etype or "no error"} in {r.get("raised_by")} after {took} s{after_kill} '
                   f'[phase {"/".join(phases) or "?"}, names {sorted(named) or "nobody"}]; outputs: '
                   f'{r.get("outputs")}; buffer: {r.get("usable")}; destroy {r.get("destroy")}; exit {o.returncode}')
        notes.append(summary)
        if etype not in ERROR_TYPES:
            problems.append(f'{who}: {"nothing raised" if etype is None else etype} (expected TimeoutError or '
                            f'RuntimeError): {msg[:200]}')
            continue
        wanted = case.phases or PHASE_WORDS
        if not any(p in phases for p in wanted):
            problems.append(f'{who}: the message names no phase of {"/".join(wanted)}')
        if victim not in named and (o.rank in close or not named - {o.rank}):
            problems.append(f'{who}: the message does not name rank {victim}'
                            + (' (it waits for it directly)' if o.rank in close else ''))
        if secs is not None and secs > bound + slack_secs:
            problems.append(f'{who}: error after {secs:.1f} s, over {bound:g} s + {slack_secs:g} s slack')
        if r.get('destroy') != 'returned':
            problems.append(f'{who}: destroy() {r.get("destroy")}')
    return problems, notes


def main_parent(args) -> int:
    try:
        cases = select_cases(args.mode, args.cases)
    except ValueError as e:
        print(f'faults: {e}', file=sys.stderr)
        return 2
    if not -args.num_ranks <= args.victim < args.num_ranks:
        print(f'faults: --victim {args.victim} is not a rank of {args.num_ranks}', file=sys.stderr)
        return 2
    # SIGTERM (a step's timeout) ends the parent through its finally blocks, which kill the children
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    W, victim = args.num_ranks, args.victim % args.num_ranks
    print(f'[fault] mode {args.mode}, {W} ranks on GPU 0 ({ranks_per_domain(args.mode, W)} per domain), victim r'
          f'{victim}, GPU timeout {args.num_gpu_timeout_secs:g} s, CPU timeout {args.num_cpu_timeout_secs:g} s, slack '
          f'{args.slack_secs:g} s; logs in {args.out}', flush=True)
    report, failed = [], []
    for case in cases:
        t0 = time.monotonic()
        outcomes = run_case(args, case)
        problems, notes = judge(case, args.mode, W, victim, outcomes, args.num_gpu_timeout_secs,
                                args.num_cpu_timeout_secs, args.slack_secs)
        secs = time.monotonic() - t0
        verdict = 'FAILED' if problems else 'OK'
        print(f'[fault] {args.mode} {case.name} ranks={W}: {verdict} ({"; ".join(problems + notes)}) {secs:.1f} s',
              flush=True)
        for o in outcomes:
            if o.record and o.record.get('error'):
                print(f'    r{o.rank} {o.record.get("error_type")}: {o.record["error"]}', flush=True)
        if problems:
            failed.append(case.name)
        report.append({'case': case.name, 'what': case.what, 'verdict': verdict, 'problems': problems, 'secs': secs,
                       'children': [o._asdict() for o in outcomes]})
    with open(os.path.join(args.out, f'faults_{args.mode}_n{W}.json'), 'w') as f:
        json.dump({'args': vars(args), 'cases': report}, f, indent=1)
    print(f'[fault] summary {args.mode} ranks={W}: {len(cases) - len(failed)} of {len(cases)} cases OK'
          + (f'; FAILED: {", ".join(failed)}' if failed else ''), flush=True)
    return 0 if not failed else 1


# ---- the children --------------------------------------------------------------------------------------------------
def progress(msg: str) -> None:
    print(f'{PROGRESS_TAG}{time.strftime("%H:%M:%S")} {msg}', flush=True)


def emit(record: dict) -> None:
    print(RESULT_TAG + json.dumps(record), flush=True)


def die(record: dict) -> None:
    """The victim: its record, then SIGKILL (no handler, no clean-up: as a crash)."""
    record['kill_time'] = time.time()
    emit(record)
    os.kill(os.getpid(), signal.SIGKILL)


class StreamStuck(Exception):
    """The current stream did not finish within the bound and nothing was raised (a hang the library missed)."""


def wait_stream(torch, limit_secs: float) -> None:
    """Wait for the current stream, bounded (V1 has no bounded synchronize of its own)."""
    event = torch.cuda.Event()
    event.record()
    deadline = time.monotonic() + limit_secs
    while not event.query():
        if time.monotonic() > deadline:
            raise StreamStuck(f'the current stream did not finish within {limit_secs:g} s and nothing was raised')
        time.sleep(0.001)


def stream_busy(torch) -> bool:
    event = torch.cuda.Event()
    event.record()
    time.sleep(0.01)
    return not event.query()


def describe_outputs(torch, outputs: Dict[str, object], reference: Dict[str, object]) -> str:
    """Each output a faulted call returned, bit for bit against the fault-free round's (same inputs)."""
    if not outputs:
        return 'none returned (the first call raised)'
    if stream_busy(torch):
        return f'{", ".join(outputs)} returned, not read (the stream is still busy)'
    parts = []
    for name, got in outputs.items():
        want = reference.get(name)
        if want is None or tuple(got.shape) != tuple(want.shape):
            parts.append(f'{name} {list(got.shape)} (fault-free {None if want is None else list(want.shape)})')
            continue
        n = got.shape[0]
        a, b = got.contiguous().view(torch.uint8).view(n, -1), want.contiguous().view(torch.uint8).view(n, -1)
        same = int((a == b).all(dim=1).sum())
        untouched = int((a == 0xFF).all(dim=1).sum())
        parts.append(f'{name} {list(got.shape)}: {same} of {n} rows as fault-free' +
                     (f', {untouched} never written' if untouched else ''))
    return '; '.join(parts)


class Workload:
    """One buffer and the calls of a round; `out` holds what the calls since the last `clear()` returned."""

    def __init__(self, args, group, torch):
        self.args, self.group, self.torch = args, group, torch
        W = group.size
        self.M, self.H, self.K = args.num_tokens, args.hidden, args.num_topk
        self.E = W * max(1, args.num_experts // W)
        g = torch.Generator(device='cuda').manual_seed(args.seed * 1000 + group.rank)
        self.x = torch.randn((self.M, self.H), dtype=torch.bfloat16, device='cuda', generator=g)
        scores = torch.rand((self.M, self.E), device='cuda', generator=g)
        self.topk_idx = scores.topk(self.K, dim=1).indices.to(torch.int64)
        self.topk_weights = torch.rand((self.M, self.K), dtype=torch.float32, device='cuda', generator=g)
        self.out: Dict[str, object] = {}
        self.reference: Dict[str, object] = {}

    def keep_reference(self) -> None:
        self.torch.cuda.synchronize()
        self.reference = {k: v.clone() for k, v in self.out.items()}
        self.out = {}

    def run(self, step: str) -> None:
        if step == 'device_sync':
            self.torch.cuda.synchronize()
        else:
            getattr(self, step)()


class V2(Workload):
    """ElasticBuffer: a CPU-sync dispatch, a combine of the received rows, a bounded synchronize."""

    def build(self, gpu_secs: float, cpu_secs: float) -> None:
        from .. import ElasticBuffer
        self.buf = ElasticBuffer(self.group, num_max_tokens_per_rank=self.M, hidden=self.H, num_topk=self.K,
                                 num_gpu_timeout_secs=gpu_secs, num_cpu_timeout_secs=cpu_secs, explicitly_destroy=True)

    def dispatch(self) -> None:
        recv_x, recv_idx, recv_w, handle, _ = self.buf.dispatch(self.x, self.topk_idx, self.topk_weights,
                                                                num_experts=self.E)
        self.handle = (recv_x, recv_w, handle)
        self.out.update(recv_x=recv_x, recv_topk_idx=recv_idx)

    def combine(self) -> None:
        recv_x, recv_w, handle = self.handle
        self.out['combined_x'] = self.buf.combine(recv_x, handle, topk_weights=recv_w)[0]

    def sync(self) -> None:
        from ..runtime import interop
        self.buf.synchronize(interop.current_stream())

    def usable(self) -> str:
        if self.buf.is_usable():
            return 'is_usable() True'
        try:
            self.buf.check_usable()
            return 'is_usable() False, yet check_usable() raised nothing'
        except Exception as e:  # noqa: BLE001
            return f'unusable: every call raises {type(e).__name__} ({str(e)[:80]})'

    def destroy(self) -> None:
        self.buf.destroy()


class Graph(V2):
    """A CUDA graph of a dispatch without CPU sync and a combine of its rows, replayed on the same inputs."""

    def build(self, gpu_secs: float, cpu_secs: float) -> None:
        torch = self.torch
        super().build(gpu_secs, cpu_secs)

        def step():
            recv_x, recv_idx, recv_w, handle, _ = self.buf.dispatch(self.x, self.topk_idx, self.topk_weights,
                                                                    num_experts=self.E, do_cpu_sync=False,
                                                                    num_max_tokens_per_rank=self.M)
            return recv_x, recv_idx, self.buf.combine(recv_x, handle, topk_weights=recv_w)[0]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()                          # outside the capture: kernels, bound calls, allocator
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.group.barrier()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static = dict(zip(('recv_x', 'recv_topk_idx', 'combined_x'), step()))
        torch.cuda.synchronize()
        self.group.barrier()

    def replay(self) -> None:
        if self.reference:                  # the faulted round: outputs preset to 0xFF bytes (NaN / -1)
            for t in self.static.values():
                t.view(self.torch.uint8).fill_(0xFF)
        self.graph.replay()
        self.out.update(self.static)

    def destroy(self) -> None:
        self.graph = None
        self.static = {}
        super().destroy()


class LL(Workload):
    """V1 `Buffer` in low-latency mode: low_latency_dispatch (BF16), a bounded wait, low_latency_combine."""

    def build(self, gpu_secs: float, cpu_secs: float) -> None:
        from ..v1 import buffer as legacy
        # V1's Buffer takes no timeouts (DeepEP's signature): its module constants give them, read at construction.
        legacy.NUM_GPU_TIMEOUT_SECS, legacy.NUM_CPU_TIMEOUT_SECS = gpu_secs, cpu_secs
        self.gpu_secs = gpu_secs
        W = self.group.size
        num_bytes = legacy.Buffer.get_low_latency_rdma_size_hint(self.M, self.H, W, self.E)
        self.buf = legacy.Buffer(self.group, num_rdma_bytes=num_bytes, low_latency_mode=True, explicitly_destroy=True)

    def ll_dispatch(self) -> None:
        recv_x, recv_count, handle, _, _ = self.buf.low_latency_dispatch(self.x, self.topk_idx, self.M, self.E,
                                                                         use_fp8=False)
        self.handle = (recv_x, handle)
        self.out.update(recv_count=recv_count)

    def ll_combine(self) -> None:
        recv_x, handle = self.handle
        combined = self.torch.empty((self.M, self.H), dtype=self.torch.bfloat16, device='cuda')
        combined.view(self.torch.uint8).fill_(0xFF)
        self.out['combined_x'] = self.buf.low_latency_combine(recv_x, self.topk_idx, self.topk_weights, handle,
                                                              out=combined)[0]

    def wait(self) -> None:
        wait_stream(self.torch, self.gpu_secs + 30)

    def usable(self) -> str:
        t0 = time.monotonic()
        try:
            self.ll_dispatch()
            self.wait()
            return 'a further low_latency_dispatch raised nothing'
        except Exception as e:  # noqa: BLE001
            return (f'the next low_latency_dispatch raises {type(e).__name__} after {time.monotonic() - t0:.1f} s '
                    f'({str(e)[:80]})')

    def destroy(self) -> None:
        self.buf.destroy()


WORKLOADS = {'v2': V2, 'graph': Graph, 'll': LL}


def stack_of(thread_id: int) -> List[str]:
    frame, names = sys._current_frames().get(thread_id), []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


def kill_in_host_wait(record: dict, main_id: int, hold_secs: float, limit_secs: float) -> None:
    """Timer thread of the victim: once the main thread has been inside the host wait for `hold_secs`, die."""
    deadline, entered, stack = time.monotonic() + limit_secs, None, []
    while time.monotonic() < deadline:
        stack = stack_of(main_id)
        if in_host_wait(stack):
            entered = entered or time.monotonic()
            if time.monotonic() - entered >= hold_secs:
                die(dict(record, in_wait=True, where=f'inside the host wait ({" <- ".join(stack[:4])})'))
        else:
            entered = None
        time.sleep(0.002)
    die(dict(record, in_wait=False, where=f'after {limit_secs:g} s outside the host wait ({" <- ".join(stack[:4])})'))


def main_child(args) -> int:
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    case = CASES_BY_NAME[args.child]
    rank, W = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    victim = args.victim % W
    base = {'rank': rank, 'case': case.name, 'mode': args.mode, 'pid': os.getpid()}
    progress(f'rank {rank} of {W}, case {case.name} ({case.what}), victim r{victim}')
    try:
        import torch

        from ..runtime.launcher import detect_launch
        from ..runtime.tcp_group import TcpProcessGroup
        torch.cuda.set_device(0)
        launch = detect_launch()
        group = TcpProcessGroup(launch.rank, launch.size, launch.master_addr, launch.master_port,
                                timeout=args.setup_secs, origin=launch.origin)
        work = WORKLOADS[case.api](args, group, torch)
        t0 = time.monotonic()
        warm = min(60.0, args.setup_secs)
        work.build(warm, warm)                   # JIT and NCCL set-up under long timeouts
        for step in ROUND_STEPS[case.api]:
            work.run(step)
        torch.cuda.synchronize()
        work.out = {}
        work.destroy()
        group.barrier()
        work.build(args.num_gpu_timeout_secs, args.num_cpu_timeout_secs)
        for step in ROUND_STEPS[case.api]:
            work.run(step)
        work.keep_reference()
        for step in case.pre:
            work.run(step)
        work.out = {}
        group.barrier()
        progress(f'set up in {time.monotonic() - t0:.1f} s; fault step begins ({case.start})')
    except BaseException as e:  # noqa: BLE001 (a setup failure of any kind ends this child with its record)
        emit(dict(base, role='setup_failed', error=f'{type(e).__name__}: {e}'))
        import traceback
        traceback.print_exc()
        return EXIT_SETUP

    if rank == victim:
        record = dict(base, role='victim')
        if case.kill == 'now':
            die(dict(record, where=f'before {case.start}'))
        if case.kill == 'in_host_wait':
            threading.Thread(target=kill_in_host_wait, args=(record, threading.get_ident(), 0.5,
                                                              0.8 * args.delay_secs), daemon=True).start()
            work.run(case.start)
            die(dict(record, in_wait=False, where=f'after {case.start} returned (the timer missed it)'))
        work.run(case.start)
        busy = stream_busy(torch)
        time.sleep(0.3)
        die(dict(record, in_flight=busy and stream_busy(torch), where=f'with {case.start} in flight on the GPU'
                 if busy else f'after {case.start} had finished on the GPU'))

    if case.delayed:
        time.sleep(args.delay_secs)
    t_step, err, raised_by = time.time(), None, None
    for round_idx, step in round_sequence(case, args.num_rounds):
        try:
            work.run(step)
        except Exception as e:  # noqa: BLE001 (judged by the parent: only TimeoutError / RuntimeError pass)
            err, raised_by = e, f'{step} (round {round_idx})'
            break
    t_error = time.time()
    record = dict(base, role='survivor', error_type=None if err is None else type(err).__name__,
                  error=None if err is None else str(err), raised_by=raised_by, t_step=t_step,
                  t_error=None if err is None else t_error, secs_in_step=None if err is None else t_error - t_step)
    progress(f'{record["error_type"]} in {raised_by}: {record["error"]}')
    for key, fn in (('outputs', lambda: describe_outputs(torch, work.out, work.reference)), ('usable', work.usable)):
        try:
            record[key] = fn()
        except Exception as e:  # noqa: BLE001
            record[key] = f'({key} not known: {type(e).__name__}: {e})'
    progress('destroy() begins')
    t0 = time.monotonic()
    try:
        work.destroy()
        record['destroy'] = 'returned'
    except Exception as e:  # noqa: BLE001
        record['destroy'] = f'raised {type(e).__name__}: {e}'
    record['destroy_secs'] = time.monotonic() - t0
    progress(f'destroy() {record["destroy"]} after {record["destroy_secs"]:.1f} s; exiting')
    emit(record)
    return EXIT_OK


def main(argv=None) -> int:
    args = cli.faults_parser().parse_args(argv)
    return main_child(args) if args.child else main_parent(args)


if __name__ == '__main__':
    sys.exit(main())
