"""The README's first screen holds for a new user: CI (.ci/run) runs its CPU test command byte for byte, in an
environment checked to have no torch, before torch is installed; the first screen and setup.cfg name no made-up
address. Each check also runs on mutated copies, so it is shown to fail when the files drift apart."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_TORCH = 'python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec(\'torch\') is not None)"'
CI_FUNCTION = 'readme_test_command() {'


def first_screen(readme: str) -> str:
    return readme[:readme.index('\n## Status')]


def readme_test_command(readme: str) -> str:
    """The CPU test line of the first screen's first bash block."""
    block = re.search(r'```bash\n(.*?)```', first_screen(readme), re.S)
    assert block, 'no bash block in the first screen'
    lines = [line for line in block.group(1).splitlines() if 'pytest' in line and not line.startswith('#')]
    assert len(lines) == 1, lines
    return lines[0]


def ci_problems(readme: str, ci: str) -> list:
    """What keeps .ci/run from running the README's test command verbatim without torch (empty: nothing)."""
    command = readme_test_command(readme)
    lines = ci.splitlines()
    problems = []
    if lines.count(CI_FUNCTION) != 1:
        return [f'.ci/run defines no single {CI_FUNCTION!r}']
    start = lines.index(CI_FUNCTION)
    body = lines[start + 1:lines.index('}', start)]
    if [line.strip() for line in body] != [command]:
        problems.append(f'.ci/run runs {body!r}, the README says {command!r}')
    if any(line.strip() == command for i, line in enumerate(lines) if not start < i < start + 1 + len(body)):
        problems.append('the README command also appears outside readme_test_command')
    calls = [i for i, line in enumerate(lines) if line.startswith('readme_test_command ||')]
    checks = [i for i, line in enumerate(lines) if line.startswith(NO_TORCH)]
    venvs = [i for i, line in enumerate(lines) if line.startswith('fresh_venv ')]
    torch_installs = [i for i, line in enumerate(lines) if 'torch==' in line and not line.lstrip().startswith('#')]
    if len(calls) != 1:
        return problems + [f'readme_test_command is called {len(calls)} times, not once']
    call = calls[0]
    if not any(i < call for i in checks) or not any(i > call for i in checks):
        problems.append('no torch-less check both before and after the README command')
    before = [i for i in venvs if i < call]
    if not before:
        problems.append('the README command runs outside a fresh environment')
    elif any(before[-1] < i < call for i in torch_installs):
        problems.append('torch is installed into the environment of the README command')
    if not torch_installs or min(torch_installs) < call:
        problems.append('torch is installed before the torch-less step')
    elif not any(call < i < min(torch_installs) for i in venvs):
        problems.append('the CPU torch goes into the torch-less environment (no fresh_venv in between)')
    for step in ('ruff check .', 'python -m pytest -q tests -m "not slow"', 'python -m pytest -q tests -m slow'):
        if not any(line.strip() == step and i > min(torch_installs or [len(lines)]) for i, line in enumerate(lines)):
            problems.append(f'{step!r} does not run after the CPU torch is installed')
    if 'DEEPEP_CUPY_JIT_CACHE_DIR=$1/' not in ci or 'mktemp -d' not in ci:
        problems.append('the environments are not fresh (mktemp) with an empty kernel cache each')
    return problems


def address_problems(readme: str, setup_cfg: str) -> list:
    """Made-up addresses or left-over TODOs in the first screen or setup.cfg (empty: none)."""
    screen = first_screen(readme)
    problems = []
    if 'TODO' in screen or 'TODO' in setup_cfg:
        problems.append('a TODO is left')
    if 'git clone' in screen:
        problems.append('the first screen clones from an address')
    if 'In a checkout of this repository' not in screen:
        problems.append('the first screen does not start from a checkout')
    urls = re.findall(r'https?://\S+', setup_cfg)
    if urls != ['https://github.com/deepseek-ai/DeepEP']:
        problems.append(f'setup.cfg has URLs {urls}')
    if re.search(r'^url\s*=', setup_cfg, re.M):
        problems.append('setup.cfg has a url = line')
    return problems


def read(name: str) -> str:
    return (ROOT / name).read_text()


def test_ci_runs_the_readme_command_without_torch():
    assert ci_problems(read('README.md'), read('.ci/run')) == []


def test_the_first_screen_names_no_made_up_address():
    assert address_problems(read('README.md'), read('setup.cfg')) == []


def test_the_ci_torch_check_fails_where_torch_is_found(tmp_path):
    """The check's own command exits with status 1 where torch can be imported, 0 where it cannot."""
    code = NO_TORCH[len('python -c "'):-1]
    (tmp_path / 'torch').mkdir()
    (tmp_path / 'torch' / '__init__.py').write_text('')
    env = {'PATH': '/usr/bin:/bin', 'PYTHONPATH': str(tmp_path)}
    assert subprocess.run([sys.executable, '-c', code], env=env, cwd=tmp_path).returncode == 1
    # -S: no site-packages, so no torch (whether or not this environment has one)
    assert subprocess.run([sys.executable, '-S', '-c', code], env={'PATH': '/usr/bin:/bin'},
                          cwd='/').returncode == 0


COMMAND = 'pip install -e ".[cu13,mpi,test]" && python -m pytest -q tests -m "not slow"'


@pytest.mark.parametrize('mutate, problem', [
    (lambda r, c: (r, c.replace('-m "not slow"\n}', '-m "not  slow"\n}')), '.ci/run runs'),
    (lambda r, c: (r.replace(COMMAND, COMMAND + ' -x'), c), '.ci/run runs'),
    (lambda r, c: (r, c.replace(COMMAND + '\n}', COMMAND + '\n    true\n}')), '.ci/run runs'),
    (lambda r, c: (r, c.replace(NO_TORCH, 'true', 1)), 'no torch-less check both before and after'),
    (lambda r, c: (r, c.replace(NO_TORCH, 'true')), 'no torch-less check both before and after'),
    (lambda r, c: (r, c.replace('fresh_venv "$WORK/torch"\n', '')), 'the CPU torch goes into the torch-less'),
    (lambda r, c: (r, c.replace('readme_test_command ||', 'python -m pip install -q "torch==2.13.0"\n'
                                'readme_test_command ||')), 'torch is installed'),
    (lambda r, c: (r, c.replace('readme_test_command ||', 'true ||')), 'called 0 times'),
    (lambda r, c: (r, c.replace('ruff check .\n', '')), "'ruff check .' does not run"),
    (lambda r, c: (r, c.replace('python -m pytest -q tests -m slow\n', '')), "-m slow' does not run"),
    (lambda r, c: (r, c.replace('DEEPEP_CUPY_JIT_CACHE_DIR=$1/', 'DEEPEP_CUPY_JIT_CACHE_DIR=/tmp/')), 'not fresh'),
])
def test_the_ci_check_fails_on_mutated_copies(mutate, problem):
    readme, ci = mutate(read('README.md'), read('.ci/run'))
    assert (readme, ci) != (read('README.md'), read('.ci/run')), 'the mutation changed nothing'
    problems = ci_problems(readme, ci)
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize('mutate, problem', [
    (lambda r, s: (r.replace('In a checkout of this repository', 'git clone https://example.org/x && cd x\n'), s),
     'clones from an address'),
    (lambda r, s: ('<!-- TODO(lead): confirm -->\n' + r, s), 'a TODO is left'),
    (lambda r, s: (r, s.replace('project_urls =', 'url = https://github.com/someone/deepep_cupy\nproject_urls =')),
     'setup.cfg has URLs'),
])
def test_the_address_check_fails_on_mutated_copies(mutate, problem):
    readme, setup_cfg = mutate(read('README.md'), read('setup.cfg'))
    problems = address_problems(readme, setup_cfg)
    assert any(problem in p for p in problems), problems
