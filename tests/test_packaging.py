"""Packaging: a built wheel (non-editable install) carries the kernel sources and finds them at run time."""

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp('wheel')
    proc = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q',
                           '-w', str(out), str(ROOT)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f'pip wheel failed:\n{proc.stdout}\n{proc.stderr}')
    wheels = list(out.glob('deepep_cupy-*.whl'))
    assert len(wheels) == 1
    return wheels[0]


def test_wheel_contains_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(ROOT / 'kernels_cu').as_posix() for p in (ROOT / 'kernels_cu').rglob('*')
               if p.suffix in ('.cu', '.cuh')}
    assert sources, 'no kernel sources in the checkout'
    for s in sources:
        assert f'deepep_cupy/kernels_cu/{s}' in names, s


def test_wheel_contains_every_module_and_the_license(wheel):
    """Every module of the checkout is in the wheel (a new subpackage missing from setup.cfg's list shows up here),
    and so is the MIT license text."""
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / 'deepep_cupy').rglob('*.py')}
    assert modules
    assert sorted(modules - names) == []
    licenses = [n for n in names if n.endswith('.dist-info/licenses/LICENSE')]
    assert licenses, sorted(n for n in names if 'dist-info' in n)
    text = zipfile.ZipFile(wheel).read(licenses[0]).decode()
    assert text.startswith('MIT License') and 'Copyright (c) 2026 the deepep_cupy authors' in text


def test_metadata_classifiers_urls_and_extras(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith('.dist-info/METADATA'))).decode()
    for line in ('License: MIT', 'Classifier: Environment :: GPU :: NVIDIA CUDA :: 12',
                 'Classifier: Environment :: GPU :: NVIDIA CUDA :: 13',
                 'Classifier: Operating System :: POSIX :: Linux',
                 'Classifier: Topic :: Scientific/Engineering :: Artificial Intelligence',
                 'Project-URL: DeepEP, https://github.com/deepseek-ai/DeepEP',
                 'Requires-Dist: matplotlib; extra == "perf"', 'Requires-Dist: torch; extra == "torch"'):
        assert line in meta, line
    # No made-up address: every URL of the metadata (headers and the README as long description) is a real one.
    headers = meta.split('\n\n', 1)[0]
    assert [line for line in headers.splitlines() if 'http' in line] == [
        'Project-URL: DeepEP, https://github.com/deepseek-ai/DeepEP']
    assert 'deepep-cupy/' not in meta and 'TODO' not in meta


def test_installed_wheel_finds_and_compiles_kernels(wheel, tmp_path):
    site = tmp_path / 'site'
    subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps', '--target', str(site), str(wheel)],
                   check=True, capture_output=True)
    code = ('import deepep_cupy.jit.compiler as c; d = c.kernels_dir(); print(d); '
            "m = c.compile_cubin('barrier', ['deepep::barrier_kernel<4>'], arch='90', use_cache=False); "
            'print(len(m.cubin) > 0)')
    # Run from an unrelated directory so the checkout cannot shadow the installed package.
    env = {'PYTHONPATH': str(site), 'PATH': '/usr/bin:/bin', 'HOME': str(tmp_path)}
    proc = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    found, ok = proc.stdout.split()
    assert Path(found).resolve() == (site / 'deepep_cupy' / 'kernels_cu').resolve()
    assert ok == 'True'


# What an installed wheel says to its user: no file of a checkout (launch/, perf/) without "in a checkout", and the
# setup hints in the form that works without one.
WHEEL_TEXTS = r'''
import json, re
from deepep_cupy.runtime import preflight
from deepep_cupy.tests import cli
helps = {name: build().format_help() for name, build in cli.PARSERS.items()}
print(json.dumps({'in_checkout': preflight.in_checkout(), 'pip_install': preflight.pip_install('cu13'),
                  'helps': helps}))
'''


def test_installed_wheel_points_at_no_checkout(wheel, tmp_path):
    site = tmp_path / 'site'
    subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps', '--target', str(site), str(wheel)],
                   check=True, capture_output=True)
    env = {'PYTHONPATH': str(site), 'PATH': '/usr/bin:/bin', 'HOME': str(tmp_path)}
    proc = subprocess.run([sys.executable, '-c', WHEEL_TEXTS], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out['in_checkout'] is False and out['pip_install'] == 'pip install "deepep_cupy[cu13]"'
    assert sum('Start the ranks' in text for text in out['helps'].values()) >= 10
    for name, text in out['helps'].items():
        flat = ' '.join(text.split())
        if 'Start the ranks' in flat:           # every multi-rank program (jit_timing runs in one process)
            assert f'mpirun -np N python -m deepep_cupy.tests.{name} [options]' in flat, name
        for m in re.finditer(r'\b(launch|perf|tools)/', flat):      # not tests/: DeepEP's are named too
            assert flat[:m.start()].endswith(('In a checkout, ', 'in a checkout, ')), (name, flat[m.start() - 40:])
    proc = subprocess.run([sys.executable, '-m', 'deepep_cupy.tests.ep', '--help'], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert 'mpirun -np N python -m deepep_cupy.tests.ep [options]' in proc.stdout
