"""Command lines: every option of every rank program and perf script has help text and shows its default, `--help`
works without torch (and without a GPU), and a few behaviours the README promises."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deepep_cupy.tests import cli

ROOT = Path(__file__).resolve().parents[1]
PERF_SCRIPTS = ('ep_bench', 'ep_profile', 'profile_dispatch', 'reduce_scatter_sweep')


def load_perf_script(name: str):
    spec = importlib.util.spec_from_file_location(f'perf_{name}', ROOT / 'perf' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def all_parsers():
    out = [(f'deepep_cupy.tests.{name}', build) for name, build in cli.PARSERS.items()]
    out += [(f'perf/{name}.py', lambda name=name: load_perf_script(name).build_parser()) for name in PERF_SCRIPTS]
    return out


def check_parser(parser: argparse.ArgumentParser, what: str):
    assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter), what
    summary = (parser.description or '').strip().split('\n\n')[0]
    assert summary.endswith(('.', ')')), f'{what}: description cut short: {summary!r}'
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert options, what
    for action in options:
        assert action.help and action.help.strip(), f'{what} {action.option_strings}: no help text'
    text = parser.format_help()
    assert text.count('(default:') >= len(options), f'{what}: some option does not show its default'


def test_rank_program_files_cover_every_parser():
    helpers = {'__init__', 'cli', 'common', 'll_reference', 'legacy_reference', 'legacy_scenarios', 'legacy_perf',
               'ep_hybrid', 'serving_replay_cases', 'megatron_v2'}
    programs = {p.stem for p in (ROOT / 'deepep_cupy' / 'tests').glob('*.py')} - helpers
    assert programs == set(cli.PARSERS)


@pytest.mark.parametrize('what, build', all_parsers(), ids=[w for w, _ in all_parsers()])
def test_every_option_has_help_and_a_default(what, build):
    check_parser(build(), what)


def test_deepep_flags_and_defaults_of_the_ep_program():
    args = cli.ep_parser().parse_args([])
    assert (args.num_tokens, args.hidden, args.num_topk, args.num_experts, args.num_sms) == (4096, 7168, 6, 256, 0)
    assert (args.num_gpu_timeout_secs, args.num_cpu_timeout_secs, args.unbalanced_ratio) == (100, 100, 1.0)
    for flag in ('--skip-check', '--skip-perf-test', '--test-first-only', '--do-pressure-test',
                 '--precise-unbalanced-ratio', '--masked-ratio', '--seed'):
        assert flag in cli.ep_parser().format_help()


@pytest.mark.parametrize('name', sorted(set(cli.PARSERS) - {'jit_timing'}))
def test_every_rank_program_takes_skip_perf_test(name):
    assert cli.PARSERS[name]().parse_args(['--skip-perf-test']).skip_perf_test


def test_byte_counts():
    assert cli.parse_num_bytes('64M') == 64 << 20 and cli.parse_num_bytes('512K') == 512 << 10
    assert cli.parse_num_bytes('4096') == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_num_bytes('lots')


@pytest.mark.parametrize('name', sorted(cli.PARSERS))
def test_help_works_without_torch(name):
    """`python -m deepep_cupy.tests.NAME --help` with torch hidden (as in the test environment without it)."""
    code = ("import runpy, sys; sys.modules['torch'] = None; "
            f"sys.argv = ['{name}', '--help']; runpy.run_module('deepep_cupy.tests.{name}', run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS='120')
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, cwd='/', timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f'usage: python -m deepep_cupy.tests.{name}')
    assert '(default:' in proc.stdout


def test_plot_from_honours_out(tmp_path, monkeypatch):
    bench = load_perf_script('ep_bench')
    drawn = []
    monkeypatch.setattr(bench, 'plot', lambda data, path: drawn.append((data, path)))
    src = tmp_path / 'run' / 'ep_bench.json'
    src.parent.mkdir()
    src.write_text(json.dumps({'results': []}))
    assert bench.main(['--plot-from', str(src), '--out', str(tmp_path / 'plots')]) == 0
    assert drawn[-1] == ({'results': []}, str(tmp_path / 'plots' / 'ep_bench.png'))
    assert (tmp_path / 'plots').is_dir()
    assert bench.main(['--plot-from', str(src)]) == 0      # without --out: next to the JSON
    assert drawn[-1][1] == str(src.parent / 'ep_bench.png')


def test_ep_bench_reads_the_nccl_version():
    """The committed logs printed `NCCL AttributeError("module 'cupy.cuda' has no attribute 'nccl'")`; in a fresh
    process (nothing has imported `cupy.cuda.nccl` yet) the version now comes back."""
    pytest.importorskip('cupy')
    code = ('import importlib.util, sys; spec = importlib.util.spec_from_file_location("b", sys.argv[1]); '
            'b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b); print(repr(b.nccl_version()))')
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, '-W', 'ignore', '-c', code, str(ROOT / 'perf' / 'ep_bench.py')],
                          capture_output=True, text=True, env=env, cwd='/', timeout=60)
    assert proc.returncode == 0, proc.stderr
    version = eval(proc.stdout)
    assert 'AttributeError' not in str(version)
    assert isinstance(version, int) or version.startswith('SetupError: NCCL (libnccl.so.2) is not installed')


def test_counts_wait_converts_probe_clocks_and_reports_a_missing_signal():
    """perf/counts_wait.py `round_trips_us`: each call's SM clocks in µs at the clock rate of all the probes together
    (their clocks over their globaltimer ns); a probe that never saw the host-mapped word or the ack raises, naming
    which and the call."""
    cw = load_perf_script('counts_wait')
    # 2 GHz over both probes (30000 + 10000 clocks in 15000 + 5000 ns): 3000 clocks = 1.5 us, 1000 = 0.5 us
    assert cw.round_trips_us([[3000, 30000, 15000], [1000, 10000, 5000]], 'bare') == [1.5, 0.5]
    assert cw.round_trips_us(np.zeros((0, 3), np.int64), 'bare') == []
    with pytest.raises(RuntimeError, match='bare call 1: the probe never saw the host ack'):
        cw.round_trips_us([[3000, 30000, 15000], [-2, 0, 0]], 'bare')
    with pytest.raises(RuntimeError, match='round_trip call 0: the probe never saw the host-mapped word'):
        cw.round_trips_us([[-1, 0, 0]], 'round_trip')


def test_counts_wait_probe_kernels_compile_for_sm90():
    """The probe and the bare flag of perf/counts_wait.py compile (NVRTC, sm_90): the perf scripts' kernels run only on
    the GPU host, so CI checks their source here."""
    cupy_compiler = pytest.importorskip('cupy.cuda.compiler')
    cw = load_perf_script('counts_wait')
    prog = cupy_compiler._NVRTCProgram(cw.PROBE_SOURCE, 'counts_wait.cu', method='ptx')
    ptx = prog.compile(['-arch=compute_90'])[0]     # (the PTX, the name mapping)
    ptx = ptx if isinstance(ptx, str) else ptx.decode()
    assert '.entry counts_wait_probe' in ptx and '.entry counts_wait_flag' in ptx and '%globaltimer' in ptx


def test_ep_profile_takes_host_figures_and_timelines_in_separate_steps():
    """perf/ep_profile.py `Runner.case`: the host step measures host figures only, the timeline step profiles only the
    cases that have a timeline, the again step keeps its host figure apart (`loop_after_profile`), and the summary
    reads each from its step."""
    ep = load_perf_script('ep_profile')
    args = ep.build_parser().parse_args(['--tokens', '128,4096'])
    lines = []
    runner = ep.Runner(args, group=None, log=lines.append, torch=None)
    calls = []
    runner.host = lambda fn, n: (calls.append('host'), (40.0, 30.0))[1]
    runner.timeline = lambda fn, n: (calls.append('timeline'), ('fused 9.0 | span 9.0 us', 9.0, [('fused', 9.0)]))[1]

    class Group:
        @staticmethod
        def allgather_object(v):
            return [v]
    runner.group = Group()
    key = ('default', 128, 'bf16', 'dispatch no-sync')
    runner.case('no-sync', None, key=key)
    runner.case('gather', None, key='all_gather', timeline=False)
    assert calls == ['host', 'host'] and runner.results[key] == dict(idle=40.0, loop=30.0)
    runner.step = 'timeline'
    runner.case('no-sync', None, key=key)
    runner.case('gather', None, key='all_gather', timeline=False)
    assert calls[2:] == ['timeline'] and runner.results['all_gather'] == dict(idle=40.0, loop=30.0)
    assert runner.results[key] == dict(idle=40.0, loop=30.0, span=9.0, parts=[('fused', 9.0)])
    runner.step = 'again'
    runner.host = lambda fn, n: (44.0, 33.0)
    for name in ('dispatch no-sync', 'dispatch cached', 'combine', 'dispatch graph'):
        runner.case(name, None, key=('default', 128, 'bf16', name))
    assert runner.results[key]['loop'] == 30.0 and runner.results[key]['loop_after_profile'] == 33.0
    assert lines[-1].startswith('[host after a profile] dispatch graph')
    del lines[:]
    ep.summary(runner, args, lines.append)
    assert '[targets] host, no-sync dispatch, 128 tokens, back to back: 30.0 us (target <= 35 us) OK' in lines
    # (the span over the copy to 2 places: 1.29 is not "1.3"; FP8 too where measured)
    runner.results[('default', 4096, 'bf16', 'dispatch no-sync')] = dict(span=39.6)
    runner.results[('default', 4096, 'fp8', 'dispatch no-sync')] = dict(span=23.0)
    runner.results[('copy', 4096, 'bf16')], runner.results[('copy', 4096, 'fp8')] = dict(us=30.7), dict(us=17.4)
    del lines[:]
    ep.summary(runner, args, lines.append)
    assert '[targets] dispatch span / plain copy, 4096 tokens bf16 no-sync: 1.29 x (target <= 1.3 x) OK' in lines
    assert '[targets] dispatch span / plain copy, 4096 tokens fp8 no-sync: 1.32 x (target <= 1.3 x) over' in lines
    assert any(line.startswith('[targets] (not a target) the same host rows after the profiled timelines')
               and 'dispatch no-sync 33.0 us' in line for line in lines)


def test_ep_profile_timeline_parts_are_medians():
    """perf/ep_profile.py `kernel_timeline`: per kernel and per gap the median over the calls, so that one call whose
    second launch came late (the host behind) does not show as a gap of several µs in every call."""
    ep = load_perf_script('ep_profile')
    events = []
    for c, late in enumerate((0.0, 0.0, 40.0)):        # the third call's dispatch starts 40 us late
        t0 = 1000.0 * c
        events.append({'cat': 'kernel', 'name': 'notify_dispatch<1, 8>', 'ts': t0, 'dur': 9.0})
        events.append({'cat': 'kernel', 'name': 'dispatch_impl_with_dispatch_copy_epilogue_impl<1>',
                       'ts': t0 + 10.0 + late, 'dur': 33.0 + c})
    events.append({'cat': 'cuda_runtime', 'name': 'notify_dispatch<1, 8>', 'ts': 5.0, 'dur': 1.0})     # not a kernel
    text, span, parts = ep.kernel_timeline(events, 3)
    assert parts == [('notify', 9.0), ('gap', 1.0), ('dispatch', 34.0)]
    assert span == 44.0 and text.endswith('span 44.0 us (median)')
    assert ep.kernel_timeline(events[:-2], 3)[1] is None       # (5 kernels for 3 calls: no timeline)
