"""Tests of `deepep_cupy.utils.testing` and `deepep_cupy.utils.envs`.

On CPU: fd-level output suppression, argument checks, the external-profiler placeholders, kernel-source lookup,
import hygiene, single-process `init_dist`, seeding, `dist_print` and NVLink parsing. Marked `gpu` (skipped without a
device): L2 flush, the sleep kernel, `bench`, and `bench_kineto` through torch's profiler and through its fallback.
"""

import ctypes
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from deepep_cupy.runtime import group as group_mod
from deepep_cupy.utils import envs as utils_envs
from deepep_cupy.utils import testing

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# suppress_stdout_stderr
def _write_everywhere(tag: str):
    print(f'py-out-{tag}')
    print(f'py-err-{tag}', file=sys.stderr)
    os.write(1, f'fd-out-{tag}\n'.encode())
    os.write(2, f'fd-err-{tag}\n'.encode())
    libc = ctypes.CDLL(None)
    libc.puts(f'c-out-{tag}'.encode())  # buffered C stdio, flushed on exit of the context manager
    libc.fflush(None)


def test_suppress_stdout_stderr_real_fds(capfd):
    _write_everywhere('before')
    with testing.suppress_stdout_stderr():
        _write_everywhere('inside')
    _write_everywhere('after')
    out, err = capfd.readouterr()
    assert 'inside' not in out and 'inside' not in err
    for tag in ('before', 'after'):
        assert f'py-out-{tag}' in out and f'fd-out-{tag}' in out and f'c-out-{tag}' in out
        assert f'py-err-{tag}' in err and f'fd-err-{tag}' in err


def test_suppress_stdout_stderr_restores_after_exception_and_nests(capfd):
    saved = sys.stdout, sys.stderr
    with pytest.raises(KeyError):
        with testing.suppress_stdout_stderr():
            with testing.suppress_stdout_stderr():
                os.write(1, b'hidden-inner\n')
            os.write(1, b'hidden-outer\n')
            raise KeyError('boom')
    assert (sys.stdout, sys.stderr) == saved
    os.write(1, b'visible\n')
    out, _ = capfd.readouterr()
    assert 'hidden' not in out and 'visible' in out


# Argument checks and placeholders (no GPU needed)
def test_bench_needs_two_tests():
    with pytest.raises(ValueError, match='num_tests'):
        testing.bench(lambda: None, num_tests=1)


def test_bench_kineto_argument_checks():
    with pytest.raises(TypeError, match='kernel_names'):
        testing.bench_kineto(lambda: None, ['dispatch'])
    with pytest.raises(TypeError, match='kernel_names'):
        testing.bench_kineto(lambda: None, ())
    with pytest.raises(ValueError, match='num_kernels_per_period'):
        testing.bench_kineto(lambda: None, 'x', num_kernels_per_period=0)


def test_bench_kineto_external_profiler_placeholders(monkeypatch):
    monkeypatch.setenv('DEEPEP_CUPY_USE_NVIDIA_TOOLS', '1')
    calls = []
    fn = lambda: calls.append(1)
    assert testing.bench_kineto(fn, 'dispatch') == 1.0
    assert testing.bench_kineto(fn, ('dispatch', 'notify')) == (1.0, 1.0)
    assert testing.bench_kineto(fn, ('send',), num_kernels_per_period=2) == ((1.0, 1.0),)
    assert calls == []


def test_sleep_kernel_source_found():
    source = testing._kernel_source('testing.cu')
    assert 'extern "C" __global__ void sleep_cycles(long long cycles)' in source


def test_imports_have_no_side_effects():
    code = ('import sys\n'
            'import deepep_cupy.utils, deepep_cupy.utils.testing, deepep_cupy.utils.envs\n'
            'assert "torch" not in sys.modules and "cupy" not in sys.modules, sorted(sys.modules)\n'
            'assert callable(deepep_cupy.utils.bench) and "torch" not in sys.modules\n')
    subprocess.run([sys.executable, '-c', code], cwd=REPO_ROOT, check=True)


# utils.envs
@pytest.fixture
def fresh_envs_state(monkeypatch):
    for name in ('_group', '_local_rank', '_local_seed', '_global_seed'):
        monkeypatch.setattr(utils_envs, name, None)


def test_seed_getters_before_init(fresh_envs_state):
    with pytest.raises(RuntimeError, match='init_seed'):
        utils_envs.get_local_seed()
    with pytest.raises(RuntimeError, match='init_seed'):
        utils_envs.get_global_seed()


def test_init_dist_single_process(fresh_envs_state, capsys, monkeypatch):
    torch = pytest.importorskip('torch')
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip('torch.distributed already initialised')
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'TORCHELASTIC_RUN_ID', 'SLURM_PROCID', *group_mod.MPI_MARKERS):
        monkeypatch.delenv(k, raising=False)
    rank, world_size, group = utils_envs.init_dist(seed=5)
    # torch is installed: a one-process torch.distributed world (gloo on a CPU-only machine)
    assert (rank, world_size, group) == (0, 1, dist.group.WORLD) and dist.get_world_size() == 1
    assert utils_envs.get_local_seed() == 5 and utils_envs.get_global_seed() == 5
    first = (torch.rand(3), random.random(), np.random.rand())
    utils_envs.init_seed(5)
    second = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]
    utils_envs.dist_print('hello', once_in_node=True)
    utils_envs.dist_print()
    assert capsys.readouterr().out == 'hello\n\n'
    with pytest.raises(ValueError, match='local_rank'):
        utils_envs.init_dist(local_rank=2, num_local_ranks=2)
    dist.destroy_process_group()


def test_init_seed_adds_rank(fresh_envs_state):
    class FakeGroup:
        rank, local_rank = 3, 1

        def barrier(self):
            pass

    utils_envs.init_seed(10, FakeGroup())
    assert utils_envs.get_local_seed() == 13 and utils_envs.get_global_seed() == 10


NVLINK_OUTPUT = """GPU 0: NVIDIA H800 (UUID: GPU-aaaa)
\t Link 0: 26.562 GB/s
\t Link 1: 26.562 GB/s
\t Link 2: <inactive>
\t Link 3: 50 GB/s
GPU 1: NVIDIA H800 (UUID: GPU-bbbb)
\t Link 0: 100 GB/s
"""


def test_parse_nvlink_gbs():
    assert utils_envs.parse_nvlink_gbs(NVLINK_OUTPUT) == pytest.approx(26.562 * 2 + 50)
    assert utils_envs.parse_nvlink_gbs('') == 0.0
    assert utils_envs.parse_nvlink_gbs('GPU 0: PCIe card (UUID: x)\n') == 0.0


def _clear_nvlink_caches():
    from deepep_cupy.runtime import nvlink
    utils_envs.get_nvlink_gbs.cache_clear()
    nvlink.get_nvlink_gbs.cache_clear()


def test_get_nvlink_gbs_without_nvidia_smi(monkeypatch, tmp_path):
    """No nvidia-smi: the library's probe reads 0, DeepEP's utility a nominal link (its programs divide by it)."""
    from deepep_cupy.runtime import nvlink
    monkeypatch.setenv('PATH', str(tmp_path))
    _clear_nvlink_caches()
    try:
        assert nvlink.get_nvlink_gbs() == 0.0
        assert utils_envs.get_nvlink_gbs() == pytest.approx(utils_envs.FALLBACK_LINK_GBS * 0.9)
    finally:
        _clear_nvlink_caches()


def test_get_nvlink_gbs_with_fake_nvidia_smi(monkeypatch, tmp_path):
    script = tmp_path / 'nvidia-smi'
    script.write_text(f'#!/bin/sh\ncat <<"EOF"\n{NVLINK_OUTPUT}EOF\n')
    script.chmod(0o755)
    monkeypatch.setenv('PATH', f'{tmp_path}{os.pathsep}{os.environ["PATH"]}')
    _clear_nvlink_caches()
    try:
        assert utils_envs.get_nvlink_gbs() == pytest.approx((26.562 * 2 + 50) * 0.9)
        assert utils_envs.get_nvlink_gbs(1.0) == pytest.approx(26.562 * 2 + 50)
    finally:
        _clear_nvlink_caches()


# GPU
@pytest.mark.gpu
def test_flush_and_sleep_timed_by_bench():
    import cupy
    testing.flush_l2_cache()
    testing.flush_l2_cache(enabled=False)
    cupy.cuda.runtime.deviceSynchronize()
    short = testing.bench(lambda: testing.sleep_gpu(1e5), num_warmups=2, num_tests=10)
    long = testing.bench(lambda: testing.sleep_gpu(1e7), num_warmups=2, num_tests=10, flush_l2=False)
    assert isinstance(long, testing.BenchResult)
    avg, low, high = long
    assert 0 < low <= avg <= high
    # 1e7 cycles at 1-2 GHz: 5-10 ms; 100 times the short sleep
    assert 1e-3 < avg < 0.1
    assert long.avg > 20 * short.avg


@pytest.mark.gpu
def test_bench_post_fn_and_cupy_work():
    import cupy
    x = cupy.zeros(1 << 24, dtype=cupy.float32)
    calls = []
    result = testing.bench(lambda: x.fill(1), num_warmups=1, num_tests=5, post_fn=lambda: calls.append(1))
    assert calls == [1] * 5 and 0 < result.min <= result.avg <= result.max < 1


@pytest.mark.gpu
def test_bench_kineto_torch_profiler(tmp_path, capsys):
    torch = pytest.importorskip('torch')
    if not torch.cuda.is_available():
        pytest.skip('torch without CUDA: covered by the fallback test')
    x = torch.zeros(1 << 22, device='cuda')

    def fn():
        testing.sleep_gpu(2e5)
        x.add_(1)

    trace = tmp_path / 'trace.json'
    t_sleep = testing.bench_kineto(fn, 'sleep_cycles', num_tests=5, suppress_kineto_output=True, trace_path=str(trace))
    assert trace.exists() and isinstance(t_sleep, float) and 2e-5 < t_sleep < 1e-2
    t_sleep2, t_add = testing.bench_kineto(fn, ('sleep_cycles', 'elementwise'), num_tests=5)
    assert t_add < t_sleep2
    assert testing.bench_kineto(fn, 'no_such_kernel', num_tests=2) == 0        # DeepEP: 0 when nothing matches
    assert 'no profiled kernel name contains' in capsys.readouterr().err

    def two_phases():
        testing.sleep_gpu(2e4)
        testing.sleep_gpu(2e6)

    (fast, slow), = testing.bench_kineto(two_phases, ('sleep_cycles',), num_tests=4, num_kernels_per_period=2)
    assert slow > 20 * fast
    assert testing.bench_kineto(two_phases, 'sleep_cycles', num_tests=2, barrier_comm_profiling=True,
                                barrier=lambda: None) > 0


@pytest.mark.gpu
def test_bench_kineto_fallback(monkeypatch):
    monkeypatch.setattr(testing, '_torch_with_cuda', lambda: None)
    fn = lambda: testing.sleep_gpu(1e6)
    t = testing.bench_kineto(fn, 'sleep_cycles', num_tests=5)
    assert 1e-4 < t < 1e-1
    both = testing.bench_kineto(fn, ('a', 'b'), num_tests=3, flush_l2=False)
    assert len(both) == 2 and both[0] == both[1] > 0
    (p0, p1), = testing.bench_kineto(fn, ('a',), num_tests=2, num_kernels_per_period=2)
    assert p0 == p1 > 0


def test_profiler_trace_events_of_a_cpu_profile():
    torch = pytest.importorskip('torch')
    from deepep_cupy.utils.testing import profiler_trace_events
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8).add_(1)
    events = profiler_trace_events(prof)
    assert any('add_' in e.get('name', '') for e in events)
    assert all('ts' in e for e in events if e.get('ph') == 'X')
