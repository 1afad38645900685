"""The fault program's pure parts without a GPU (deepep_cupy/tests/faults.py): the case table, its command line, the
children's environment (a TCP-group job of their own, hybrid host names for nccl), the reading of their records, the
rule that a survivor's error names the phase and the dead peer (checked against the library's own messages), the
judging of a case, and the parent's bound on its children with fake children that die, report or hang."""

import json
import signal
import sys
import time
from types import SimpleNamespace

import fakes
import numpy as np
import pytest

from deepep_cupy.runtime import errors, rails

try:
    from deepep_cupy.runtime.rail_nccl import NcclRailTransport
except ImportError:             # (before the NCCL transport had a module of its own)
    NcclRailTransport = rails.NcclRailTransport
from deepep_cupy.runtime.launcher import detect_launch
from deepep_cupy.tests import cli, faults

GPU, CPU, SLACK = 8.0, 16.0, 10.0


def parse(*argv):
    return cli.faults_parser().parse_args(list(argv))


def test_case_table_and_selection():
    assert tuple(c.name for c in faults.CASES) == cli.FAULT_CASES
    assert [c.name for c in faults.select_cases('ipc', 'all')] == list(cli.FAULT_CASES)
    nccl = [c.name for c in faults.select_cases('nccl', 'all')]
    assert nccl == ['before_dispatch', 'in_dispatch_wait', 'before_combine', 'in_graph_replay']
    assert [c.name for c in faults.select_cases('nccl', ' before_combine,in_graph_replay ')] == [
        'before_combine', 'in_graph_replay']
    with pytest.raises(ValueError, match='unknown case .in_dispach_wait'):
        faults.select_cases('ipc', 'in_dispach_wait')
    with pytest.raises(ValueError, match='in_low_latency runs in mode ipc only'):
        faults.select_cases('nccl', 'in_low_latency')
    for case in faults.CASES:       # every kill point names a step of its workload
        steps = faults.ROUND_STEPS[case.api]
        assert case.start in steps and all(s in steps + ('device_sync',) for s in case.pre), case.name
        assert case.kill in ('now', 'in_host_wait', 'in_flight'), case.name


def test_round_sequence_starts_at_the_fault_step():
    by = faults.CASES_BY_NAME
    assert faults.round_sequence(by['before_combine'], 2) == [
        (1, 'combine'), (1, 'sync'), (2, 'dispatch'), (2, 'combine'), (2, 'sync')]
    assert faults.round_sequence(by['in_low_latency_combine'], 1) == [(1, 'll_combine'), (1, 'wait')]
    assert faults.round_sequence(by['in_graph_replay'], 3) == [(r, s) for r in (1, 2, 3) for s in ('replay', 'sync')]


def test_command_line_defaults_and_choices(capsys):
    args = parse()
    assert (args.mode, args.num_ranks, args.cases, args.victim) == ('ipc', 2, 'all', -1)
    assert (args.num_gpu_timeout_secs, args.num_cpu_timeout_secs, args.slack_secs) == (GPU, CPU, SLACK)
    assert (args.num_tokens, args.hidden, args.num_experts, args.num_topk) == (128, 2048, 64, 4)
    for bad in (('--num-ranks', '3'), ('--mode', 'mpi')):
        with pytest.raises(SystemExit):
            parse(*bad)
    capsys.readouterr()


def test_child_command_line_round_trips():
    args = parse('--mode', 'nccl', '--num-ranks', '4', '--victim', '0', '--num-gpu-timeout-secs', '3',
                 '--delay-secs', '1.5', '--num-tokens', '64', '--seed', '7')
    child = parse(*faults.child_argv(args, faults.CASES_BY_NAME['in_graph_replay']))
    assert child.child == 'in_graph_replay'
    for key in ('mode', 'num_ranks', 'victim', 'num_gpu_timeout_secs', 'num_cpu_timeout_secs', 'delay_secs',
                'num_rounds', 'setup_secs', 'num_tokens', 'hidden', 'num_experts', 'num_topk', 'seed'):
        assert getattr(child, key) == getattr(args, key), key


def test_child_environment_is_a_tcp_job_of_its_own():
    base = {'PATH': '/bin', 'OMPI_COMM_WORLD_SIZE': '8', 'PMI_RANK': '3', 'LOCAL_RANK': '5', 'SLURM_PROCID': '1',
            'SLURM_NTASKS': '4', 'TORCHELASTIC_RUN_ID': 'x', 'DEEPEP_CUPY_SCALEUP_SIZE': '1', 'NCCL_HOSTID': 'h',
            'DEEPEP_CUPY_HOST': 'h', 'DEEPEP_CUPY_CPU_TIMEOUT_SECS': '1', 'NCCL_DEBUG': 'INFO', 'PYTHONPATH': '/x'}
    env = faults.child_env(base, 1, 2, 'ipc', 4242, 's' * 64)
    launch = detect_launch(env)
    assert (launch.launcher, launch.rank, launch.size, launch.master_addr, launch.master_port) == (
        'env', 1, 2, '127.0.0.1', 4242)
    for gone in ('OMPI_COMM_WORLD_SIZE', 'PMI_RANK', 'LOCAL_RANK', 'SLURM_PROCID', 'TORCHELASTIC_RUN_ID',
                 'DEEPEP_CUPY_SCALEUP_SIZE', 'NCCL_HOSTID', 'DEEPEP_CUPY_HOST', 'DEEPEP_CUPY_CPU_TIMEOUT_SECS'):
        assert gone not in env, gone
    assert (env['DEEPEP_CUPY_TCP_SECRET'], env['DEEPEP_CUPY_DEVICE'], env['NCCL_NVLS_ENABLE']) == ('s' * 64, '0', '0')
    assert env['NCCL_DEBUG'] == 'INFO' and env['PYTHONPATH'].split(':') == [faults.PACKAGE_ROOT, '/x']
    hosts = []
    for g in range(4):
        e = faults.child_env(base, g, 4, 'nccl', 4242, 's' * 64)
        assert (e['DEEPEP_CUPY_SCALEUP_SIZE'], e['DEEPEP_CUPY_RAIL_TRANSPORT']) == ('2', 'nccl')
        assert e['NCCL_HOSTID'] == e['DEEPEP_CUPY_HOST']
        assert all(e[k] == v for k, v in (('NCCL_P2P_DISABLE', '1'), ('NCCL_SHM_DISABLE', '1'),
                                          ('NCCL_IB_DISABLE', '1'), ('NCCL_SOCKET_IFNAME', 'lo')))
        hosts.append(e['DEEPEP_CUPY_HOST'])
    assert hosts == ['node0', 'node0', 'node1', 'node1']


def gpu_message(rank, waited_for, phase=3, rank_base=0):
    """The library's own GPU timeout text (runtime/errors.py) for scale-up index `rank` giving up on `waited_for`
    (`rank_base`: global rank of the domain's index 0)."""
    record = np.array([1, phase, rank, waited_for, 2, 1, 64, 0], dtype=np.int32)
    with pytest.raises(TimeoutError) as e:
        errors.raise_if_timed_out(record, GPU, rank + rank_base, rank_base)
    return str(e.value)


def rail_messages(rank, victim, num_ranks=2, num_scaleup=1, phase='combine'):
    """The hybrid rails' texts (runtime/rails.py) at `rank`, whose rail peer is `victim`: a host wait's timeout error
    and the watchdog's."""
    topo = rails.rail_topology(num_ranks, num_scaleup, rank)
    fake = SimpleNamespace(abort=lambda: None, destroy=lambda: None)
    transport = NcclRailTransport(topo, 0, fake, nccl=SimpleNamespace(NCCL_UINT8=0))
    host = str(transport.timeout_error('notify', topo.peer_domains[0], CPU))
    transport = NcclRailTransport(topo, 0, fake, nccl=SimpleNamespace(NCCL_UINT8=0))
    transport.watchdog = SimpleNamespace(timeout_s=GPU)
    watchdog = str(transport._watchdog_fired(phase, topo.peer_domains))
    assert str(victim) in host and str(victim) in watchdog
    return host, watchdog


def test_named_ranks_reads_the_librarys_messages():
    assert faults.named_ranks(gpu_message(0, 3)) == {3}
    assert faults.phases_named(gpu_message(0, 3)) == ['notify']
    host, watchdog = rail_messages(0, 1)
    assert faults.named_ranks(host) == {1} and 'notify' in faults.phases_named(host)
    assert faults.named_ranks(watchdog) == {1} and 'combine' in faults.phases_named(watchdog)
    tcp = ('rank 0: the all-gather input from rank 2 at 127.0.0.1:4242: the connection closed after 0 of 9 bytes '
           '(ranks not yet heard from: [2, 3]; a peer is hung)')
    assert faults.named_ranks(tcp) == {2, 3}
    assert faults.named_ranks('deepep_cupy rank 1: Dispatch CPU wait for the receive counts timed out') == set()


def test_close_ranks_are_the_victims_domain_and_rail():
    assert faults.close_ranks(3, 4, 2) == {1, 2}         # nccl 2 x 2: rail peer 1, domain peer 2; not rank 0
    assert faults.close_ranks(1, 2, 1) == {0}            # nccl 2 x 1
    assert faults.close_ranks(3, 4, 4) == {0, 1, 2}      # ipc: one domain, everyone waits for it directly
    assert faults.close_ranks(0, 4, 2) == {1, 2}


def test_host_wait_recognised_from_a_stack():
    assert faults.in_host_wait(['wait_until', '_wait_host_counts', 'run_cpu_sync', 'dispatch', 'run'])
    assert faults.in_host_wait(['_wait_host_counts', 'dispatch'])          # still spinning before wait_until
    assert faults.in_host_wait(['wait_until', '_notify', 'dispatch'])      # hybrid: the rail counts
    assert not faults.in_host_wait(['wait_until', 'synchronize', 'sync'])
    assert not faults.in_host_wait(['sleep', 'main_child', 'main'])


def test_result_lines_are_read_from_a_log():
    rec = {'role': 'survivor', 'rank': 0, 'error': 'x'}
    log = f'noise\n{faults.PROGRESS_TAG}12:00:00 set up\n{faults.RESULT_TAG}{{"role": "old"}}\n' \
          f'{faults.RESULT_TAG}{json.dumps(rec)}\nTraceback...\n'
    assert faults.parse_result(log) == rec
    assert faults.last_progress(log) == '12:00:00 set up'
    assert faults.parse_result(f'{faults.RESULT_TAG}{{"role": "surv') is None       # cut short by a kill
    assert faults.parse_result('nothing') is None and faults.last_progress('') == 'before its first progress line'


def victim_outcome(rank, **record):
    rec = dict(role='victim', rank=rank, kill_time=100.0, where='before dispatch', **record)
    return faults.ChildOutcome(rank, -signal.SIGKILL, False, 1.0, rec, 'fault step begins')


def survivor_outcome(rank, message, secs=8.1, etype='TimeoutError', destroy='returned', returncode=0, hung=False):
    rec = dict(role='survivor', rank=rank, error_type=etype, error=message, raised_by='dispatch (round 1)',
               t_step=100.0, t_error=100.0 + secs, secs_in_step=secs, outputs='none returned', usable='unusable',
               destroy=destroy)
    return faults.ChildOutcome(rank, returncode, hung, secs + 1, rec, 'destroy() begins')


def judge(case, outcomes, mode='ipc', victim=None):
    n = len(outcomes)
    return faults.judge(faults.CASES_BY_NAME[case], mode, n, n - 1 if victim is None else victim, outcomes, GPU, CPU,
                        SLACK)


def test_judge_passes_a_good_case_and_fails_each_broken_rule():
    good = [survivor_outcome(0, gpu_message(0, 1)), victim_outcome(1)]
    problems, notes = judge('before_dispatch', good)
    assert problems == [] and 'names [1]' in notes[-1] and 'destroy returned' in notes[-1]
    broken = {
        'names another rank': ([survivor_outcome(0, gpu_message(0, 2)), victim_outcome(1)],
                               'does not name rank 1 (it waits for it directly)'),
        'no phase': ([survivor_outcome(0, 'rank 0 waited for rank 1'), victim_outcome(1)], 'names no phase'),
        'wrong phase': ([survivor_outcome(0, gpu_message(0, 1, phase=5)), victim_outcome(1)],
                        'names no phase of notify/dispatch'),
        'too slow': ([survivor_outcome(0, gpu_message(0, 1), secs=GPU + SLACK + 1), victim_outcome(1)], 'over 8 s'),
        'nothing raised': ([survivor_outcome(0, None, etype=None), victim_outcome(1)], 'nothing raised'),
        'wrong type': ([survivor_outcome(0, 'bad', etype='ValueError'), victim_outcome(1)], 'ValueError (expected'),
        'destroy raised': ([survivor_outcome(0, gpu_message(0, 1), destroy='raised ConnectionError: x'),
                            victim_outcome(1)], 'destroy() raised ConnectionError'),
        'hang': ([survivor_outcome(0, gpu_message(0, 1), hung=True, returncode=-9), victim_outcome(1)],
                 'HANG, killed after'),
        'exit status': ([survivor_outcome(0, gpu_message(0, 1), returncode=1), victim_outcome(1)], 'exit status 1'),
        'victim lived': ([survivor_outcome(0, gpu_message(0, 1)), victim_outcome(1)._replace(returncode=0)],
                         'not SIGKILL'),
        'no record': ([faults.ChildOutcome(0, 0, False, 1.0, None, 'x'), victim_outcome(1)], 'no result record'),
    }
    for what, (outcomes, expected) in broken.items():
        problems, _ = judge('before_dispatch', outcomes)
        assert any(expected in p for p in problems), (what, problems)


def test_judge_checks_where_the_victim_died():
    missed = [survivor_outcome(0, gpu_message(0, 1)), victim_outcome(1, in_wait=False)]
    assert any('not inside the host wait' in p for p in judge('in_dispatch_wait', missed)[0])
    assert judge('in_dispatch_wait', [missed[0], victim_outcome(1, in_wait=True)])[0] == []
    late = [survivor_outcome(0, gpu_message(0, 1, phase=4)), victim_outcome(1, in_flight=False)]
    assert any('had finished before the kill' in p for p in judge('in_graph_replay', late)[0])
    assert judge('in_graph_replay', [late[0], victim_outcome(1, in_flight=True)])[0] == []
    setup = faults.ChildOutcome(1, 3, False, 1.0, {'role': 'setup_failed', 'error': 'SetupError: no GPU'}, 'x')
    assert any('setup failed: SetupError' in p for p in judge('before_dispatch', [missed[0], setup])[0])


def test_judge_lets_a_rank_away_from_the_victim_name_another_held_up_rank():
    """nccl 2 x 2, victim 3: rank 0 (neither its domain nor its rail) may name rank 1, rank 1 (its rail) may not."""
    _, watchdog = rail_messages(1, 3, num_ranks=4, num_scaleup=2, phase='notify')
    msg_for = {0: gpu_message(0, 1), 1: watchdog, 2: gpu_message(0, 1, rank_base=2)}
    assert 'rank 2 waited for rank 3' in msg_for[2]
    outcomes = [survivor_outcome(g, msg_for[g], secs=CPU) for g in range(3)] + [victim_outcome(3)]
    problems, _ = judge('before_dispatch', outcomes, mode='nccl')
    assert problems == [], problems
    outcomes[1] = survivor_outcome(1, gpu_message(1, 0), secs=CPU)
    problems, _ = judge('before_dispatch', outcomes, mode='nccl')
    assert problems == ['r1: the message does not name rank 3 (it waits for it directly)']
    outcomes[1] = survivor_outcome(1, msg_for[1], secs=CPU + SLACK + 1)    # the CPU bound counts for hybrid CPU sync
    assert any('over 16 s + 10 s slack' in p for p in judge('before_dispatch', outcomes, mode='nccl')[0])


HANGING_CHILD = ('import faulthandler, signal, time; faulthandler.register(signal.SIGUSR1, all_threads=True); '
                 'print("[child] 00:00:00 destroy() begins", flush=True); time.sleep(120)')
DYING_CHILD = 'import os, signal, time; time.sleep(0.2); os.kill(os.getpid(), signal.SIGKILL)'


def test_the_parent_bounds_a_hanging_child_and_dumps_its_stacks(tmp_path):
    logs = [open(tmp_path / f'r{g}.log', 'w') for g in range(2)]
    import subprocess
    procs = {0: subprocess.Popen([sys.executable, '-c', HANGING_CHILD], stdout=logs[0], stderr=subprocess.STDOUT),
             1: subprocess.Popen([sys.executable, '-c', DYING_CHILD], stdout=logs[1], stderr=subprocess.STDOUT)}
    t0 = time.monotonic()
    status = faults.supervise(procs, 1, setup_secs=30, after_fault_secs=1.0, dump_grace_secs=1.0)
    took = time.monotonic() - t0
    assert status[1][:2] == (-signal.SIGKILL, False)
    assert status[0][:2] == (-signal.SIGKILL, True) and took < 10, (status, took)
    text = (tmp_path / 'r0.log').read_text()
    assert 'time.sleep(120)' in text or 'File "<string>"' in text, text       # faulthandler's dump
    assert faults.last_progress(text) == '00:00:00 destroy() begins'


def test_the_parent_bounds_children_whose_victim_never_dies(tmp_path):
    import subprocess
    procs = {g: subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']) for g in range(2)}
    t0 = time.monotonic()
    status = faults.supervise(procs, 1, setup_secs=0.5, after_fault_secs=0.5, dump_grace_secs=0.1)
    assert all(status[g][1] for g in range(2)) and time.monotonic() - t0 < 10


FAKE_CHILD = r'''
import json, os, signal, sys, time
rank, victim = int(os.environ['RANK']), int(os.environ['WORLD_SIZE']) - 1
tag = sys.argv[1]
assert len(os.environ['DEEPEP_CUPY_TCP_SECRET']) >= 16 and os.environ['MASTER_PORT'].isdigit()
if rank == victim:
    print(tag + json.dumps({'role': 'victim', 'rank': rank, 'kill_time': time.time(), 'where': 'before dispatch'}),
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.3)
msg = sys.argv[2].replace('RANK', str(rank)).replace('VICTIM', str(victim))
print(tag + json.dumps({'role': 'survivor', 'rank': rank, 'error_type': 'TimeoutError', 'error': msg,
                        'raised_by': 'dispatch (round 1)', 't_step': time.time(), 't_error': time.time() + 0.1,
                        'secs_in_step': 0.1, 'outputs': 'none', 'usable': 'unusable', 'destroy': 'returned'}),
      flush=True)
'''


def fake_run(tmp_path, message, num_ranks=2):
    args = parse('--num-ranks', str(num_ranks), '--out', str(tmp_path), '--cases', 'before_dispatch')
    case = faults.CASES_BY_NAME['before_dispatch']
    outcomes = faults.run_case(args, case, command=lambda g: [sys.executable, '-c', FAKE_CHILD, faults.RESULT_TAG,
                                                              message])
    return outcomes, faults.judge(case, 'ipc', num_ranks, num_ranks - 1, outcomes, GPU, CPU, SLACK)[0]


def test_a_case_end_to_end_with_fake_children(tmp_path):
    good = ('deepep_cupy rank RANK: GPU wait timed out after 8 s in notify: rank RANK waited for rank VICTIM and '
            'gave up')
    outcomes, problems = fake_run(tmp_path, good, num_ranks=4)
    assert problems == [] and [o.returncode for o in outcomes] == [0, 0, 0, -signal.SIGKILL]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f'ipc_n4_before_dispatch_rank{g}.log' for g in range(4)]
    _, problems = fake_run(tmp_path, 'deepep_cupy rank RANK: GPU wait timed out after 8 s in notify')
    assert problems == ['r0: the message does not name rank 1 (it waits for it directly)']


def test_main_reports_one_line_per_case_and_fails_on_a_bad_case(tmp_path, monkeypatch, capsys):
    by_case = {'before_dispatch': [survivor_outcome(0, gpu_message(0, 1)), victim_outcome(1)],
               'before_combine': [survivor_outcome(0, gpu_message(0, 1, phase=5), destroy='raised X: y'),
                                  victim_outcome(1)]}
    monkeypatch.setattr(faults, 'run_case', lambda args, case: by_case[case.name])
    assert faults.main(['--out', str(tmp_path), '--cases', 'before_dispatch']) == 0
    out = capsys.readouterr().out
    assert '[fault] ipc before_dispatch ranks=2: OK (' in out and '1 of 1 cases OK' in out
    assert faults.main(['--out', str(tmp_path), '--cases', 'before_dispatch,before_combine']) == 1
    out = capsys.readouterr().out
    assert '[fault] ipc before_combine ranks=2: FAILED (r0: destroy() raised X: y' in out
    assert 'FAILED: before_combine' in out
    report = json.loads((tmp_path / 'faults_ipc_n2.json').read_text())
    assert [c['verdict'] for c in report['cases']] == ['OK', 'FAILED']
    assert faults.main(['--out', str(tmp_path), '--mode', 'nccl', '--cases', 'in_low_latency']) == 2
    assert faults.main(['--out', str(tmp_path), '--victim', '5']) == 2


def test_a_failed_buffer_meets_live_peers_and_gives_up_on_dead_ones(monkeypatch, capsys):
    """BufferBase.destroy after a timeout: the rails are aborted first, the communication stream is waited for
    (bounded) instead of the device, and the collective teardown's host barriers run soft: with the peers alive (the
    rank that was only missing destroys as a healthy one) every barrier pairs with theirs, as from a healthy rank
    (1xH100: skipping them paired the missing rank's teardown barrier with its peer's next all-gather:
    MPI_ERR_TRUNCATE, then a hang); with a peer dead (the TCP group's barrier raised ConnectionError on 1xH100) the
    first barrier fails and the rest are skipped. A healthy buffer's barriers still raise."""
    from deepep_cupy.buffers import base, hybrid
    from deepep_cupy.features.hybrid.feature import HybridEP
    from deepep_cupy.runtime import symmetric

    calls = []

    class Watchdog:
        def close(self):
            calls.append('watchdog closed')

    class Transport:
        aborted, watchdog = False, Watchdog()

        def abort(self):
            calls.append('abort')
            self.aborted = True

    class Group:
        def __init__(self, dead):
            self.dead = dead

        def barrier(self, timeout=None):
            calls.append(f'barrier {timeout:g}')
            if self.dead:
                raise ConnectionError('the root closed the connection')

    class Runtime:      # cupy.cuda.runtime, without a GPU
        @staticmethod
        def deviceSynchronize():
            calls.append('device synchronised')

        @staticmethod
        def free(ptr):
            calls.append('free')

    cupy = pytest.importorskip('cupy')
    monkeypatch.setattr(cupy.cuda, 'runtime', Runtime)
    monkeypatch.setattr(base, '_release_stream', lambda device, stream: None)

    def make(failed, record, rails_failed=False, dead=False):
        group = Group(dead)
        sym = symmetric.SymmetricMemory.__new__(symmetric.SymmetricMemory)
        sym.group, sym.base, sym._opened, sym._table, sym.peer_bases = group, 0x7000, [], None, []
        buf = fakes.make_buffer(group=group, sym=sym, num_cpu_timeout_secs=7.0)
        buf._failed, buf.error_record[0] = failed, record
        buf._transports_failed = lambda: rails_failed
        buf._abort_transports = lambda: calls.append('abort transports')
        buf._wait_comm_stream = lambda: calls.append('comm stream waited')
        buf._wait_device_idle = lambda: calls.append('device idle')
        buf.host_mapped.free = lambda: calls.append('free host-mapped')
        return buf

    soft_alive = ['abort transports', 'comm stream waited', 'device idle', 'barrier 7', 'free', 'barrier 7',
                  'free host-mapped']
    for failed, record, rails_failed in (('dispatch CPU wait timed out', 0, False), (None, 1, False), (None, 0, True)):
        calls.clear()
        make(failed, record, rails_failed).destroy()
        assert calls == soft_alive, (failed, record, calls)
    calls.clear()
    buf = make('dispatch CPU wait timed out', 0, dead=True)
    buf.destroy()
    assert calls == ['abort transports', 'comm stream waited', 'device idle', 'barrier 7', 'free',
                     'free host-mapped'], calls
    assert buf._destroyed and buf.sym.base == 0
    buf.destroy()                                           # idempotent
    assert calls[-1] == 'free host-mapped'
    calls.clear()
    buf = make('dispatch CPU wait timed out', 0)            # the context is lost (NCCL faulted after its abort):
    buf._wait_device_idle = lambda: calls.append('device idle') or RuntimeError('cudaErrorIllegalAddress')
    buf.destroy()                                           # destroy returns, frees nothing, says why
    assert calls == ['abort transports', 'comm stream waited', 'device idle'], calls
    assert 'freed nothing (RuntimeError: cudaErrorIllegalAddress)' in capsys.readouterr().err
    assert buf._destroyed
    calls.clear()
    buf = make('dispatch CPU wait timed out', 0)            # the device stays busy past the bound: the same

    def busy():
        calls.append('device idle')
        raise TimeoutError('device 0 was still busy 38 s into the teardown of a failed buffer')
    buf._wait_device_idle = busy
    buf.destroy()
    assert calls == ['abort transports', 'comm stream waited', 'device idle'], calls
    assert 'freed nothing (TimeoutError: device 0 was still busy' in capsys.readouterr().err
    calls.clear()
    make(None, 0).destroy()                                 # healthy: the collective teardown as before
    assert calls == ['device synchronised', 'device synchronised', 'barrier 7', 'free', 'barrier 7',
                     'free host-mapped'], calls
    calls.clear()
    with pytest.raises(ConnectionError):                    # healthy: a failing barrier raises
        make(None, 0, dead=True).destroy()

    ep = HybridEP.__new__(HybridEP)
    ep.rails = SimpleNamespace(transport=Transport())
    calls.clear()
    hybrid.abort(SimpleNamespace(_ep=ep, _agrs_rails=SimpleNamespace(transport=None)))
    hybrid.abort(SimpleNamespace(_ep=ep))                   # aborted already: the watchdog stops, no second abort
    assert calls == ['watchdog closed', 'abort', 'watchdog closed']
    assert hybrid.failed(SimpleNamespace(_ep=ep)) and not hybrid.failed(SimpleNamespace(_ep=None))


def test_wait_device_idle_is_bounded_and_returns_a_lost_context(monkeypatch):
    """The failed teardown's device wait: idle -> None, a sticky CUDA error -> returned (not raised), a device that
    stays busy -> TimeoutError at the bound (the helper thread is left behind, a daemon)."""
    import threading

    from deepep_cupy.runtime import streams
    cupy = pytest.importorskip('cupy')
    release = threading.Event()
    behaviour = {}

    class Runtime:
        @staticmethod
        def setDevice(device):                  # noqa: N802 (CUDA's name)
            behaviour['device'] = device

        @staticmethod
        def deviceSynchronize():                # noqa: N802
            mode = behaviour['mode']
            if mode == 'lost':
                raise RuntimeError('cudaErrorIllegalAddress')
            if mode == 'busy':
                release.wait(5.0)

    monkeypatch.setattr(cupy.cuda, 'runtime', Runtime)
    behaviour['mode'] = 'idle'
    assert streams.wait_device_idle(3, 1.0) is None and behaviour['device'] == 3
    behaviour['mode'] = 'lost'
    assert 'cudaErrorIllegalAddress' in str(streams.wait_device_idle(0, 1.0))
    behaviour['mode'] = 'busy'
    try:
        with pytest.raises(TimeoutError, match='still busy 0.1 s into the teardown'):
            streams.wait_device_idle(0, 0.1)
    finally:
        release.set()
