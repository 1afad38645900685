"""The README's two usage examples (torch, CuPy), run as written on 2 ranks under mpirun (skipped without GPUs).

The examples are taken from README.md's ```python blocks under "### From torch" and "### From CuPy"; the torch one
calls a `run_local_experts` of the user's, defined here as the identity."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_example(heading: str) -> str:
    text = (ROOT / 'README.md').read_text()
    section = text.split(heading, 1)[1]
    match = re.search(r'```python\n(.*?)```', section, re.S)
    assert match, f'no python block after {heading!r}'
    return match.group(1)


def test_examples_are_in_the_readme():
    assert 'buf.dispatch(' in readme_example('### From torch')
    assert 'buf.dispatch(' in readme_example('### From CuPy')


@pytest.mark.gpu
@pytest.mark.parametrize('heading, prelude, needs', [
    ('### From torch', 'def run_local_experts(x, topk_idx, topk_weights):\n    return x\n\n', 'torch'),
    ('### From CuPy', '', 'cupy'),
])
def test_readme_example_runs_on_two_ranks(tmp_path, heading, prelude, needs):
    pytest.importorskip(needs)
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip('needs 2 GPUs')
    if shutil.which('mpirun') is None and not (Path(sys.executable).parent / 'mpirun').exists():
        pytest.skip('mpirun not found')
    script = tmp_path / 'example.py'
    script.write_text(prelude + readme_example(heading) + "\nprint('example done', flush=True)\n")
    cmd = [str(ROOT / 'launch' / 'run_local.sh'), '2', sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, f'{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}'
    assert proc.stdout.count('example done') == 2
