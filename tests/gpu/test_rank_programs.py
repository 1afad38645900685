"""Run the rank programs under mpirun when GPUs are present (skipped otherwise). The GPU suite script
(launch/gpu_suite.sh) runs the same programs with more configurations and keeps their logs."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def num_gpus() -> int:
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def run_ranks(n: int, module: str, *args: str, timeout: int = 300):
    if shutil.which('mpirun') is None and not (Path(sys.executable).parent / 'mpirun').exists():
        pytest.skip('mpirun not found')
    cmd = [str(ROOT / 'launch' / 'run_local.sh'), str(n), sys.executable, '-m', module, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f'{cmd}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}'
    return proc.stdout


@pytest.mark.parametrize('n', [1, 2, 4])
def test_barrier_program(n):
    if n == 2 and num_gpus() < 2:
        pytest.skip('needs 2 GPUs')
    out = run_ranks(n, 'deepep_cupy.tests.barrier', '--num-barriers', '100', '--num-rounds', '8')
    assert 'barrier test: PASSED' in out


@pytest.mark.parametrize('module, args', [
    ('deepep_cupy.tests.pp', ('--num-tokens', '1024', '--hidden', '1024', '--num-sends', '64', '--skip-perf-test')),
    ('deepep_cupy.tests.agrs', ('--num-stress-iterations', '2', '--skip-perf-test')),
    ('deepep_cupy.tests.engram', ('--skip-perf-test',)),
    ('deepep_cupy.tests.reduce_grads', ('--skip-perf-test',)),
    ('deepep_cupy.tests.prefetch_weights', ('--skip-perf-test',)),
    ('deepep_cupy.tests.allocation', ()),
])
def test_collective_programs(module, args):
    """Issue 3's rank programs on 2 ranks (sharing one GPU when only one is present)."""
    out = run_ranks(2, module, *args, timeout=600)
    assert 'test: PASSED' in out
