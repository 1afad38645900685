"""tests/hybrid_host_path_prog.py in a subprocess: the hybrid feature over the real intranode engine's host path."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip('torch')


def test_hybrid_host_path_runs_every_mode():
    prog = Path(__file__).with_name('hybrid_host_path_prog.py')
    out = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith('OK'), out.stdout[-3000:] + out.stderr[-3000:]
    assert "plans ['notify', 'dispatch', 'dispatch', 'combine', 'combine', 'notify']" in out.stdout
