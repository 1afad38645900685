"""Setup errors (`deepep_cupy.runtime.preflight`): each missing piece gives one line that names the fix, printed once
per job (rank 0), with exit status 1. The host parts are faked by monkeypatching, except the no-driver case, which
also runs for real where this machine has no NVIDIA driver."""

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepep_cupy.runtime import preflight
from deepep_cupy.runtime.preflight import SetupError

ROOT = Path(__file__).resolve().parents[1]
REAL_DRIVER_CUDA_VERSION = preflight.driver_cuda_version


def has_driver() -> bool:
    try:
        ctypes.CDLL('libcuda.so.1')
        return True
    except OSError:
        return False


@pytest.fixture
def host(monkeypatch):
    """A fake host where everything works: CUDA 13.0 driver, cupy-cuda13x, NVRTC 13.0, two GPUs."""
    monkeypatch.setattr(preflight, '_cuda_checked', False)
    monkeypatch.setattr(preflight, 'driver_cuda_version', lambda: 13000)
    monkeypatch.setattr(preflight, '_import_cupy', lambda: SimpleNamespace())
    monkeypatch.setattr(preflight, '_cupy_cuda_major', lambda cupy: 13)
    monkeypatch.setattr(preflight, 'installed_cupy', lambda: 'cupy-cuda13x')
    monkeypatch.setattr(preflight, '_nvrtc_version', lambda: (13, 0))
    monkeypatch.setattr(preflight, '_device_count', lambda cupy: 2)
    monkeypatch.setattr(preflight, 'in_checkout', lambda: True)     # hints name `pip install -e ".[...]"`
    for name in preflight.RANK_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def setup_error(fn) -> str:
    with pytest.raises(SetupError) as info:
        fn()
    message = str(info.value)
    assert '\n' not in message, message
    assert info.value.__cause__ is None
    return message


def test_a_working_host_passes_once(host):
    preflight.check_cuda()
    assert preflight._cuda_checked
    host.setattr(preflight, 'driver_cuda_version', lambda: 1 / 0)   # checked once per process: not asked again
    preflight.check_cuda()


def test_no_driver(host):
    host.setattr(preflight, 'driver_cuda_version', REAL_DRIVER_CUDA_VERSION)

    def no_lib():
        raise OSError('libcuda.so.1: cannot open shared object file: No such file or directory')
    host.setattr(preflight, '_load_libcuda', no_lib)
    message = setup_error(preflight.check_cuda)
    assert message.startswith('no NVIDIA driver on this host (libcuda.so.1 cannot be loaded)')
    assert 'python -m pytest -q tests' in message and 'InsufficientDriver' not in message


def test_driver_too_old_for_the_cupy_build_names_the_cu12_extra(host):
    host.setattr(preflight, 'driver_cuda_version', lambda: 12040)
    message = setup_error(preflight.check_cuda)
    assert message.startswith('the NVIDIA driver supports CUDA 12.4, but cupy-cuda13x needs a CUDA 13 driver')
    assert 'use the [cu12] extra' in message
    assert 'pip uninstall -y cupy-cuda13x nvidia-cuda-nvrtc nvidia-nccl-cu13 && pip install -e ".[cu12]"' in message


def test_driver_older_than_cuda_12(host):
    host.setattr(preflight, 'driver_cuda_version', lambda: 11080)
    message = setup_error(preflight.check_cuda)
    assert 'supports CUDA 11.8' in message and 'upgrade the driver' in message


@pytest.mark.parametrize('driver, extra', [(13000, 'cu13'), (12080, 'cu12')])
def test_cupy_missing_names_the_extra_of_the_driver(host, driver, extra):
    host.setattr(preflight, 'driver_cuda_version', lambda: driver)

    def no_cupy():
        raise ModuleNotFoundError("No module named 'cupy'", name='cupy')
    host.setattr(preflight, '_import_cupy', no_cupy)
    message = setup_error(preflight.check_cuda)
    assert message.startswith(f'CuPy is not installed: pip install -e ".[{extra}]"')


def test_this_checkout_is_seen_as_one():
    assert (ROOT / 'setup.cfg').is_file() and preflight.in_checkout()


@pytest.mark.parametrize('checkout', [True, False])
def test_install_hints_fit_a_checkout_and_a_wheel(host, checkout):
    """In a checkout the hints say `pip install -e ".[extras]"`; an installed wheel has no checkout to point at, so
    they say `pip install "deepep_cupy[extras]"` (pip keeps the installed package and adds the extras)."""
    host.setattr(preflight, 'in_checkout', lambda: checkout)
    host.setattr(preflight, 'suggested_cuda_major', lambda: 13)

    def form(extras):
        return f'pip install -e ".[{extras}]"' if checkout else f'pip install "deepep_cupy[{extras}]"'
    assert preflight.pip_install('cu13,mpi') == form('cu13,mpi')
    for module, extras in (('torch', 'cu13,mpi,torch'), ('cupy', 'cu13'), ('cupy_backends', 'cu13'),
                           ('mpi4py', 'mpi'), ('matplotlib', 'perf')):
        message = str(preflight.missing_module_error(ModuleNotFoundError(f'No module named {module!r}', name=module)))
        assert form(extras) in message and message.count('pip install') == 1, message

    def no_cupy():
        raise ModuleNotFoundError("No module named 'cupy'", name='cupy')
    with host.context() as m:
        m.setattr(preflight, '_import_cupy', no_cupy)
        assert setup_error(preflight.check_cuda).startswith(f'CuPy is not installed: {form("cu13")} (the extra')
    with host.context() as m:
        m.setattr(preflight, 'driver_cuda_version', lambda: 12040)
        assert f'&& {form("cu12")}), or upgrade the driver' in setup_error(preflight.check_cuda)
    with host.context() as m:
        m.setattr(preflight, '_nccl_module', None)

        def no_nccl():
            raise ModuleNotFoundError("No module named 'cupy'", name='cupy')
        m.setattr(preflight, '_import_nccl', no_nccl)
        assert setup_error(preflight.nccl).endswith(f'NCCL is reached through it: {form("cu13")}')
    with host.context() as m:
        m.setattr(preflight, 'driver_cuda_version', REAL_DRIVER_CUDA_VERSION)

        def no_lib():
            raise OSError('no libcuda')
        m.setattr(preflight, '_load_libcuda', no_lib)
        message = setup_error(preflight.check_cuda)      # the CPU tests live in a checkout only
        assert message.startswith('no NVIDIA driver on this host') and ('pytest' in message) == checkout


# Every buffer class, built where CuPy (or NVRTC) is missing, in a process of its own: the one-line SetupError of
# preflight.check_cuda, not CuPy's ModuleNotFoundError. argv[1]: 'no-cupy' (a CUDA 13 driver, CuPy hidden), 'no-nvrtc'
# (a CUDA 13 driver, NVRTC failing to load), 'no-driver' (this host as it is, CuPy hidden).
BUILD_BUFFERS = r'''
import importlib.util, json, sys
torch = importlib.util.find_spec('torch') is not None
if sys.argv[1] in ('no-cupy', 'no-driver'):
    sys.modules['cupy'] = sys.modules['cupy_backends'] = None
import deepep_cupy
from deepep_cupy.runtime import preflight
if sys.argv[1] != 'no-driver':
    preflight.driver_cuda_version = lambda: 13000
if sys.argv[1] == 'no-nvrtc':
    def no_nvrtc():
        raise RuntimeError('Failure finding "libnvrtc.so.13"')
    preflight._nvrtc_version = no_nvrtc
calls = {
    'ElasticBuffer': lambda: deepep_cupy.ElasticBuffer(num_max_tokens_per_rank=128, hidden=256, num_topk=8),
    'ElasticBuffer(num_bytes)': lambda: deepep_cupy.ElasticBuffer(num_bytes=2 << 20),
    'EPBuffer': lambda: deepep_cupy.EPBuffer(num_max_tokens_per_rank=128, hidden=256, num_topk=8),
    'Buffer': lambda: deepep_cupy.Buffer(None, num_nvl_bytes=2 << 20),
    'Buffer(low_latency_mode)': lambda: deepep_cupy.Buffer(None, num_rdma_bytes=2 << 20, low_latency_mode=True),
    'PPBuffer': lambda: deepep_cupy.PPBuffer(None, 2 << 20),
    'EngramBuffer': lambda: deepep_cupy.EngramBuffer(None, 2 << 20, num_allocated_qps=1, qp_depth=1),
    'get_physical_domain_size': lambda: deepep_cupy.get_physical_domain_size(),
}
if torch:           # its storage is a torch tensor: it needs torch before anything else
    calls['BucketBuffer'] = lambda: deepep_cupy.BucketBuffer(None, 2 << 20)
out = {}
for name, call in calls.items():
    try:
        call()
        out[name] = 'no error'
    except Exception as e:
        out[name] = f'{type(e).__module__}.{type(e).__name__}: {e}'
print(json.dumps(out))
'''


@pytest.mark.parametrize('mode, message', [
    ('no-cupy', 'CuPy is not installed: pip install -e ".[cu13]" (the extra for this host\'s CUDA 13.0 driver)'),
    ('no-nvrtc', 'NVRTC (libnvrtc.so.13), the CUDA compiler deepep_cupy uses at run time, cannot be loaded '
                 '(RuntimeError): pip install "nvidia-cuda-nvrtc==13.0.*" (part of the [cu13] extra)'),
    ('no-driver', 'no NVIDIA driver on this host (libcuda.so.1 cannot be loaded)')])
def test_every_buffer_class_without_cupy_raises_the_setup_error(mode, message):
    if mode == 'no-nvrtc':
        pytest.importorskip('cupy')
    if mode == 'no-driver' and has_driver():
        pytest.skip('this machine has an NVIDIA driver')
    env = {'PATH': '/usr/bin:/bin', 'PYTHONPATH': str(ROOT), 'HOME': '/tmp'}
    proc = subprocess.run([sys.executable, '-c', BUILD_BUFFERS, mode], capture_output=True, text=True, cwd='/',
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) >= 8
    for name, result in results.items():
        assert result.startswith(f'deepep_cupy.runtime.preflight.SetupError: {message}'), (name, result)
        assert '\n' not in result, (name, result)


@pytest.mark.parametrize('cupy_major, package', [(13, 'nvidia-cuda-nvrtc==13.0.*'), (12, 'nvidia-cuda-nvrtc-cu12')])
def test_nvrtc_missing_names_the_package(host, cupy_major, package):
    host.setattr(preflight, 'driver_cuda_version', lambda: 13000)
    host.setattr(preflight, '_cupy_cuda_major', lambda cupy: cupy_major)

    def no_nvrtc():
        raise RuntimeError('Failure finding "libnvrtc.so.13 or libnvrtc.so.12"')
    host.setattr(preflight, '_nvrtc_version', no_nvrtc)
    message = setup_error(preflight.check_cuda)
    assert message.startswith(f'NVRTC (libnvrtc.so.{cupy_major}), the CUDA compiler deepep_cupy uses at run time, '
                              f'cannot be loaded')
    assert f'pip install "{package}" (part of the [cu{cupy_major}] extra)' in message


def test_nvrtc_newer_than_the_driver(host):
    host.setattr(preflight, 'driver_cuda_version', lambda: 12080)
    host.setattr(preflight, '_cupy_cuda_major', lambda cupy: 12)
    host.setattr(preflight, '_nvrtc_version', lambda: (13, 0))
    assert 'NVRTC 13 produces kernels this CUDA 12.8 driver cannot load' in setup_error(preflight.check_cuda)


def test_no_visible_device(host):
    host.setattr(preflight, '_device_count', lambda cupy: 0)
    host.setenv('CUDA_VISIBLE_DEVICES', '')
    assert setup_error(preflight.check_cuda) == ("no CUDA device is visible to this process "
                                                 "(CUDA_VISIBLE_DEVICES=''): check nvidia-smi and CUDA_VISIBLE_DEVICES")


@pytest.mark.parametrize('cupy_name, package', [('cupy-cuda13x', 'nvidia-nccl-cu13 (part of the [cu13] extra)'),
                                                ('cupy-cuda12x', 'nvidia-nccl-cu12 (part of the [cu12] extra)')])
def test_nccl_missing_names_the_package(host, cupy_name, package):
    host.setattr(preflight, '_nccl_module', None)
    host.setattr(preflight, 'installed_cupy', lambda: cupy_name)
    host.setattr(preflight, '_import_nccl', lambda: SimpleNamespace(available=False))
    message = setup_error(preflight.nccl)
    assert message.startswith('NCCL (libnccl.so.2) is not installed') and message.endswith(f'pip install {package}')
    found = SimpleNamespace(available=True)
    host.setattr(preflight, '_import_nccl', lambda: found)
    assert preflight.nccl() is found and preflight.nccl() is found


def test_nccl_users_get_the_setup_error(host):
    from deepep_cupy.runtime import nccl
    host.setattr(preflight, '_nccl_module', None)
    host.setattr(preflight, '_import_nccl', lambda: SimpleNamespace(available=False))
    with pytest.raises(SetupError, match='NCCL'):
        nccl._nccl()


def test_select_device_checks_the_host_first(host):
    from deepep_cupy.runtime import topology
    from deepep_cupy.runtime.group import SingleProcessGroup

    def no_lib():
        raise OSError('no libcuda')
    host.setattr(preflight, 'driver_cuda_version', REAL_DRIVER_CUDA_VERSION)
    host.setattr(preflight, '_load_libcuda', no_lib)
    with pytest.raises(SetupError, match='no NVIDIA driver'):
        topology.select_device(SingleProcessGroup())


@pytest.mark.parametrize('env, rank', [({}, None), ({'OMPI_COMM_WORLD_RANK': '3'}, 3), ({'PMI_RANK': '0'}, 0),
                                       ({'PMIX_RANK': '2'}, 2), ({'RANK': '1'}, 1), ({'SLURM_PROCID': '5'}, 5),
                                       ({'OMPI_COMM_WORLD_RANK': '2', 'RANK': '0'}, 2)])
def test_job_rank_from_the_launcher(host, env, rank):
    for k, v in env.items():
        host.setenv(k, v)
    assert preflight.job_rank() == rank


@pytest.mark.parametrize('env, printed', [({}, True), ({'PMI_RANK': '0'}, True), ({'PMI_RANK': '1'}, False),
                                          ({'RANK': '7'}, False)])
def test_run_reports_once_per_job(host, capsys, env, printed):
    for k, v in env.items():
        host.setenv(k, v)

    def main():
        raise SetupError('no CUDA device is visible to this process: check nvidia-smi')
    assert preflight.run(main) == 1
    err = capsys.readouterr().err
    assert err == ('deepep_cupy: no CUDA device is visible to this process: check nvidia-smi\n' if printed else '')


@pytest.mark.parametrize('module, extra', [('torch', '.[cu13,mpi,torch]'), ('mpi4py', '.[mpi]'),
                                           ('cupy', '.[cu13]'), ('matplotlib', '.[perf]')])
def test_run_names_the_extra_of_a_missing_package(host, capsys, module, extra):
    host.setattr(preflight, 'suggested_cuda_major', lambda: 13)

    def main():
        raise ModuleNotFoundError(f'No module named {module!r}', name=module)
    assert preflight.run(main) == 1
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and f'pip install -e "{extra}"' in err


def test_run_passes_other_errors_and_results_through(host):
    assert preflight.run(lambda a: a + 1, 41) == 42

    def main():
        raise ModuleNotFoundError("No module named 'not_an_extra'", name='not_an_extra')
    with pytest.raises(ModuleNotFoundError):
        preflight.run(main)


def run_program(module: str, *args: str, env=None, block_torch: bool = False):
    """Run `python -m module args` from an unrelated directory (torch hidden when `block_torch`)."""
    code = ('import runpy, sys\n'
            + ("sys.modules['torch'] = None\n" if block_torch else '')
            + f'sys.argv = [{module!r}] + sys.argv[1:]\n'
            + f'runpy.run_module({module!r}, run_name="__main__", alter_sys=True)\n')
    full_env = {k: v for k, v in os.environ.items() if k not in preflight.RANK_ENV_VARS}
    full_env.update(PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, '-c', code, *args], capture_output=True, text=True, env=full_env,
                          cwd='/', timeout=120)


@pytest.mark.parametrize('rank, printed', [(None, True), ('0', True), ('1', False)])
def test_rank_program_without_torch_says_which_extra(rank, printed):
    proc = run_program('deepep_cupy.tests.ep', '--num-tokens', '128', block_torch=True,
                       env={'PMI_RANK': rank} if rank is not None else None)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ''
    if printed:
        assert proc.stderr.startswith('deepep_cupy: PyTorch is not installed, and this program needs it: '
                                      'pip install -e ".[cu')
        assert proc.stderr.count('\n') == 1, proc.stderr
    else:
        assert proc.stderr == ''


def test_rank_program_without_torch_still_checks_its_arguments():
    proc = run_program('deepep_cupy.tests.ep', '--no-such-flag', block_torch=True)
    assert proc.returncode == 2 and 'unrecognized arguments: --no-such-flag' in proc.stderr


@pytest.mark.skipif(has_driver(), reason='this machine has an NVIDIA driver')
def test_no_driver_for_real_is_one_line_once_per_job():
    """The barrier program needs only CuPy, so this runs in the torch-less test environment as well."""
    pytest.importorskip('cupy')
    for rank, printed in (('0', True), ('1', False)):
        proc = run_program('deepep_cupy.tests.barrier', env={'OMPI_COMM_WORLD_RANK': rank})
        assert proc.returncode == 1
        if printed:
            assert proc.stderr.startswith('deepep_cupy: no NVIDIA driver on this host (libcuda.so.1 cannot be loaded)')
            assert proc.stderr.count('\n') == 1, proc.stderr
        else:
            assert proc.stderr == ''
