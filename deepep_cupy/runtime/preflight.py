"""Setup checks that answer in one line: what this host lacks and which install extra brings it.

The library calls `check_cuda()` where it first touches CUDA (`runtime.topology.select_device`), so a missing driver,
a driver too old for the installed CuPy, a missing NVRTC or no visible GPU raise `SetupError` instead of CuPy's
tracebacks (which end in a misleading `cudaErrorInsufficientDriver` on a host with no driver at all). `nccl()` does the
same for NCCL where NCCL is needed.

Rank programs and perf scripts run their `main` through `run()`: a `SetupError`, or a missing optional package, is
printed once per job (by rank 0, read from the launcher's environment) and the process exits with status 1, instead
of one traceback per rank.
"""

import ctypes
import importlib.metadata
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, Optional

# Launchers' rank variables, in the order they are trusted (mpirun: Open MPI, MPICH/Hydra, PMIx; torchrun; srun).
RANK_ENV_VARS = ('OMPI_COMM_WORLD_RANK', 'PMI_RANK', 'PMIX_RANK', 'RANK', 'SLURM_PROCID')

# The install extra for each CUDA major version, and the packages behind it.
CUDA_EXTRAS = {
    13: {'extra': 'cu13', 'cupy': 'cupy-cuda13x', 'nvrtc': 'nvidia-cuda-nvrtc==13.0.*', 'nccl': 'nvidia-nccl-cu13'},
    12: {'extra': 'cu12', 'cupy': 'cupy-cuda12x', 'nvrtc': 'nvidia-cuda-nvrtc-cu12', 'nccl': 'nvidia-nccl-cu12'},
}
DEFAULT_CUDA_MAJOR = 13


class SetupError(RuntimeError):
    """This host or environment cannot run the request (a package, the driver or a GPU is missing). The message is
    one line that names the fix."""


def job_rank() -> Optional[int]:
    """This process's rank in the job as the launcher announced it, or None when started without a launcher."""
    for name in RANK_ENV_VARS:
        value = os.environ.get(name, '').strip()
        if value.isdigit():
            return int(value)
    return None


def report(error: BaseException, file=None) -> None:
    """Print `deepep_cupy: <message>` once per job: on rank 0, or when no launcher announced a rank."""
    if job_rank() in (None, 0):
        message = str(error)
        prefix = '' if message.startswith('deepep_cupy') else 'deepep_cupy: '
        print(prefix + message, file=file or sys.stderr, flush=True)


def _cuda_version_text(version: int) -> str:
    return f'{version // 1000}.{version % 1000 // 10}'


def in_checkout() -> bool:
    """Whether deepep_cupy runs from a source checkout (the package's parent directory holds setup.cfg), not from an
    installed wheel."""
    return (Path(__file__).resolve().parents[2] / 'setup.cfg').is_file()


def pip_install(extras: str) -> str:
    """The command that adds `extras` (e.g. `'cu13,mpi'`) to this installation: `pip install -e ".[cu13,mpi]"` in a
    checkout (run in its root), `pip install "deepep_cupy[cu13,mpi]"` for an installed wheel (pip keeps the installed
    deepep_cupy and adds what the extras bring)."""
    return f'pip install -e ".[{extras}]"' if in_checkout() else f'pip install "deepep_cupy[{extras}]"'


def _install_hint(major: int) -> str:
    return pip_install(CUDA_EXTRAS.get(major, CUDA_EXTRAS[DEFAULT_CUDA_MAJOR])['extra'])


def _load_libcuda():
    """The NVIDIA driver's user-space library (raises OSError when there is no driver)."""
    return ctypes.CDLL('libcuda.so.1')


def driver_cuda_version() -> int:
    """The newest CUDA version the installed NVIDIA driver supports, as 1000 * major + 10 * minor (13000 for 13.0).

    Raises:
        SetupError: no driver (libcuda.so.1 cannot be loaded).
    """
    try:
        lib = _load_libcuda()
    except OSError:
        cpu_tests = '; the CPU tests need no GPU: python -m pytest -q tests -m "not slow"' if in_checkout() else ''
        raise SetupError(f'no NVIDIA driver on this host (libcuda.so.1 cannot be loaded): run on a machine with an '
                         f'NVIDIA GPU and its driver (nvidia-smi must work){cpu_tests}') from None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        raise SetupError('the NVIDIA driver did not report its CUDA version (cuDriverGetVersion failed): check that '
                         'nvidia-smi works on this host') from None
    return version.value


def suggested_cuda_major() -> int:
    """The CUDA major version whose extra fits this host's driver (13 when the driver cannot be read)."""
    try:
        major = driver_cuda_version() // 1000
    except SetupError:
        return DEFAULT_CUDA_MAJOR
    return major if major in CUDA_EXTRAS else DEFAULT_CUDA_MAJOR


def installed_cupy() -> Optional[str]:
    """The installed CuPy distribution's name (e.g. `cupy-cuda13x`), read from package metadata without importing."""
    for dist in ('cupy-cuda13x', 'cupy-cuda12x', 'cupy'):
        try:
            importlib.metadata.version(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _import_cupy():
    import cupy
    return cupy


def _cupy_cuda_major(cupy) -> int:
    """The CUDA major version CuPy was built for."""
    return int(cupy.cuda.runtime.runtimeGetVersion()) // 1000


def _nvrtc_version():
    from cupy_backends.cuda.libs import nvrtc
    return tuple(nvrtc.getVersion())


def _device_count(cupy) -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError as e:
        if 'NoDevice' in str(e):
            return 0
        raise SetupError(f'CUDA cannot start on this host: {e} (nvidia-smi shows whether the driver and GPUs are '
                         f'healthy)') from None


_cuda_checked = False


def check_cuda() -> None:
    """Check, once per process, that this host can run deepep_cupy's kernels: an NVIDIA driver, CuPy built for a CUDA
    major version the driver supports, NVRTC, and at least one visible GPU.

    Raises:
        SetupError: with a one-line message naming the fix (the install extra to use, or what to check).
    """
    global _cuda_checked
    if _cuda_checked:
        return
    driver = driver_cuda_version()
    driver_major = driver // 1000
    if driver_major < min(CUDA_EXTRAS):
        raise SetupError(f'the NVIDIA driver supports CUDA {_cuda_version_text(driver)}, but deepep_cupy needs a '
                         f'driver for CUDA 12 or 13 (R525 or newer; R580 or newer for CUDA 13): upgrade the driver')
    try:
        cupy = _import_cupy()
    except ImportError:
        raise SetupError(f'CuPy is not installed: {_install_hint(driver_major)} (the extra for this host\'s CUDA '
                         f'{_cuda_version_text(driver)} driver)') from None
    cupy_major = _cupy_cuda_major(cupy)
    cupy_name = installed_cupy() or f'CuPy for CUDA {cupy_major}'
    if driver_major < cupy_major:
        fit = CUDA_EXTRAS.get(driver_major, CUDA_EXTRAS[min(CUDA_EXTRAS)])
        wrong = CUDA_EXTRAS.get(cupy_major, {})
        remove = ' '.join(p.split('=')[0] for p in (wrong.get('cupy', cupy_name), wrong.get('nvrtc', ''),
                                                      wrong.get('nccl', '')) if p)
        raise SetupError(f'the NVIDIA driver supports CUDA {_cuda_version_text(driver)}, but {cupy_name} needs a CUDA '
                         f'{cupy_major} driver: use the [{fit["extra"]}] extra (pip uninstall -y {remove} && '
                         f'{pip_install(fit["extra"])}), or upgrade the driver')
    packages = CUDA_EXTRAS.get(cupy_major, CUDA_EXTRAS[DEFAULT_CUDA_MAJOR])
    try:
        nvrtc_major = _nvrtc_version()[0]
    except Exception as e:  # noqa: BLE001 (CuPy raises its loader's own error types)
        raise SetupError(f'NVRTC (libnvrtc.so.{cupy_major}), the CUDA compiler deepep_cupy uses at run time, cannot be '
                         f'loaded ({type(e).__name__}): pip install "{packages["nvrtc"]}" (part of the '
                         f'[{packages["extra"]}] extra)') from None
    if nvrtc_major > driver_major:
        raise SetupError(f'NVRTC {nvrtc_major} produces kernels this CUDA {_cuda_version_text(driver)} driver cannot '
                         f'load: install the NVRTC of the [cu{driver_major}] extra, or upgrade the driver')
    num_devices = _device_count(cupy)
    if num_devices == 0:
        visible = os.environ.get('CUDA_VISIBLE_DEVICES')
        where = f' (CUDA_VISIBLE_DEVICES={visible!r})' if visible is not None else ''
        raise SetupError(f'no CUDA device is visible to this process{where}: check nvidia-smi and '
                         f'CUDA_VISIBLE_DEVICES')
    _cuda_checked = True


def _import_nccl():
    with warnings.catch_warnings():     # CuPy warns at import when libnccl is missing; nccl() says more
        warnings.simplefilter('ignore')
        from cupy.cuda import nccl
    return nccl


_nccl_module = None


def nccl():
    """`cupy.cuda.nccl`, checked (once per process) to have found the NCCL library.

    Raises:
        SetupError: NCCL is missing (names the package of the installed CUDA extra).
    """
    global _nccl_module
    if _nccl_module is not None:
        return _nccl_module
    packages = CUDA_EXTRAS[12 if installed_cupy() == 'cupy-cuda12x' else DEFAULT_CUDA_MAJOR]
    try:
        module = _import_nccl()
    except ImportError:
        raise SetupError(f'CuPy is not installed, and NCCL is reached through it: '
                         f'{pip_install(packages["extra"])}') from None
    if not getattr(module, 'available', True):
        raise SetupError(f'NCCL (libnccl.so.2) is not installed, and this needs it (scale-out transport, NCCL '
                         f'baselines): pip install {packages["nccl"]} (part of the [{packages["extra"]}] extra)')
    _nccl_module = module
    return module


# Optional packages the programs import: the message, with `{install}` for the command that adds the extras (`{cuda}`:
# the CUDA extra that fits this host's driver).
MISSING_MODULE_HINTS = {
    'torch': ('{cuda},mpi,torch', 'PyTorch is not installed, and this program needs it: {install} (PyPI\'s default '
                                  'torch is a CUDA build of several GB; see the README for other builds)'),
    'cupy': ('{cuda}', 'CuPy is not installed: {install} (use [cu12] for a CUDA 12 driver, [cu13] for CUDA 13)'),
    'cupy_backends': ('{cuda}', 'CuPy is not installed: {install} (use [cu12] for a CUDA 12 driver, [cu13] for '
                                'CUDA 13)'),
    'mpi4py': ('mpi', 'mpi4py is not installed, and ranks started by mpirun talk through it: {install} (mpi4py with '
                      'MPICH), or start the ranks with torchrun (see the README, Launching)'),
    'matplotlib': ('perf', 'matplotlib is not installed, and the plot needs it: {install}'),
}


def missing_module_error(error: ImportError) -> Optional[SetupError]:
    """A `SetupError` naming the install extra for a missing optional package, or None for any other import error."""
    name = (getattr(error, 'name', None) or '').split('.')[0]
    if name not in MISSING_MODULE_HINTS:
        return None
    extras, hint = MISSING_MODULE_HINTS[name]
    extras = extras.format(cuda=CUDA_EXTRAS[suggested_cuda_major()]['extra'])
    return SetupError(hint.format(install=pip_install(extras)))


def exit_if_main(error: ImportError, module_name: str, build_parser: Callable) -> None:
    """For a rank program's `except ImportError` around its imports of optional packages.

    Run as a script (`module_name == '__main__'`), the command line is parsed first, so `--help` and argument errors
    work without the package; then the missing package is reported once per job, naming its extra, and the process
    exits with status 1. Imported as a module, or for any other import error, this returns and the caller re-raises.
    """
    setup = missing_module_error(error)
    if module_name != '__main__' or setup is None:
        return
    build_parser().parse_args()
    report(setup)
    sys.exit(1)


def run(main: Callable[..., int], *args) -> int:
    """Run a program's `main(*args)`: a `SetupError` or a missing optional package is reported once per job, as one
    line, and gives exit status 1; everything else propagates unchanged. SIGUSR1 dumps every thread's Python stack
    to stderr and the program goes on (launch/gpu_suite.sh and launch/scaleout_nccl.sh send it to a run past its time
    before they stop it, so a hang shows where each rank waited; mpirun forwards it to the ranks)."""
    _dump_stacks_on_sigusr1()
    try:
        return main(*args)
    except SetupError as e:
        report(e)
    except ImportError as e:
        setup = missing_module_error(e)
        if setup is None:
            raise
        report(setup)
    return 1


def _dump_stacks_on_sigusr1() -> None:
    import faulthandler
    import signal
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    except (AttributeError, ValueError, RuntimeError):     # no SIGUSR1 (Windows), or not the main thread
        pass
