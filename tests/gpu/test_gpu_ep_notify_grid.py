"""The notify kernel's capped grid on a GPU (tests/notify_grid_prog.py): dispatches with the notify grid forced down
to a few blocks, and a rank holding more tokens than the co-resident notify blocks cover in one pass, bitwise equal
to the uncapped grid and to the references; at one rank (alone) and at two ranks sharing the GPUs (mpirun). Skipped
without a GPU."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
PROG = ROOT / 'tests' / 'notify_grid_prog.py'


def _run(cmd, timeout: int = 600) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f'{cmd}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}'
    assert 'notify grid test: PASSED' in proc.stdout, proc.stdout[-4000:]
    return proc.stdout


def test_one_rank():
    _run([sys.executable, str(PROG)])


def test_two_ranks():
    if shutil.which('mpirun') is None and not (Path(sys.executable).parent / 'mpirun').exists():
        pytest.skip('mpirun not found')
    _run([str(ROOT / 'launch' / 'run_local.sh'), '2', sys.executable, str(PROG)])
