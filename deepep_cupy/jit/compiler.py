"""Run-time compilation of the kernels in `kernels_cu/` with NVRTC (through CuPy), cached on disk.

A kernel is named by its family (the `.cu` file, e.g. `'barrier'`) and a C++ name expression that instantiates a
template (e.g. `'deepep::barrier_kernel<8>'`). The generated translation unit is one line, `#include "<family>.cu"`;
NVRTC instantiates the name expressions. The cache key covers everything that changes the binary: the hash of the
whole `kernels_cu/` tree (headers included), the family, the name expressions, the options (`-D` values included),
the target arch and the NVRTC version. Within a host, one process compiles a key while the others wait on a file lock
and then load the published cubin (build → lock → re-check → compile → atomic publish).

Compiling needs no GPU (`compile_cubin(..., arch='90')`); loading does.
"""

import fcntl
import functools
import hashlib
import importlib.resources
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

from .. import envs

# Bump when the cache layout or the way sources are assembled changes.
_CACHE_FORMAT = 1
# No --use_fast_math: it flushes denormals, and combine must be bitwise equal to torch's FP32 reference.
_BASE_OPTIONS = ('-std=c++17', '-default-device', '-DDEEPEP_CUPY_NVRTC=1')


class JITCompileError(RuntimeError):
    """A kernel specialisation failed to compile; the message holds the NVRTC log (file:line), the specialisation
    and the options."""


@functools.lru_cache(maxsize=None)
def kernels_dir() -> Path:
    """The directory holding the `.cu` sources: the package's `kernels_cu` (wheel or editable install), or the
    checkout's top-level `kernels_cu/` when the package is imported from a checkout."""
    checkout = Path(__file__).resolve().parents[2] / 'kernels_cu'
    if (checkout / 'common').is_dir():
        return checkout
    try:
        path = Path(str(importlib.resources.files('deepep_cupy.kernels_cu')))
        if (path / 'common').is_dir():
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    raise FileNotFoundError('deepep_cupy: kernel sources (kernels_cu/) not found next to the package nor installed '
                            'as deepep_cupy.kernels_cu; reinstall the package')


def _source_files(root: Path):
    return sorted(p for p in root.rglob('*') if p.is_file() and p.suffix in ('.cu', '.cuh'))


def tree_hash(root: Optional[Path] = None) -> str:
    """SHA-256 over the relative paths and contents of every `.cu`/`.cuh` file under `root` (default: the kernels).
    Memoised per (path, mtimes) so editing a header during a session is seen."""
    root = Path(root) if root is not None else kernels_dir()
    files = _source_files(root)
    stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)
    return _tree_hash_cached(str(root), stamp)


@functools.lru_cache(maxsize=8)
def _tree_hash_cached(root: str, stamp) -> str:
    h = hashlib.sha256()
    for path, _, _ in stamp:
        h.update(os.path.relpath(path, root).encode())
        h.update(b'\0')
        h.update(Path(path).read_bytes())
        h.update(b'\0')
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> Tuple[int, int]:
    from cupy_backends.cuda.libs import nvrtc
    return tuple(nvrtc.getVersion())


def device_arch(device: Optional[int] = None) -> str:
    """Compute capability of a device as `'90'`."""
    import cupy
    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    return dev.compute_capability


def _options(arch: str, defines: Dict[str, object], extra: Sequence[str]) -> Tuple[str, ...]:
    opts = list(_BASE_OPTIONS)
    opts.append(f'-arch=sm_{arch}')
    opts.append(f'-I{kernels_dir()}')
    if envs.jit_lineinfo():
        opts.append('-lineinfo')
    for k in sorted(defines):
        opts.append(f'-D{k}={defines[k]}')
    opts.extend(extra)
    return tuple(opts)


@dataclass(frozen=True)
class CompiledModule:
    """A compiled cubin and the mangled name of each requested name expression."""
    key: str
    cubin: bytes
    lowered: Dict[str, str]
    from_cache: bool
    seconds: float


def cache_key(family: str, name_expressions: Sequence[str], options: Sequence[str]) -> str:
    meta = {
        'format': _CACHE_FORMAT,
        'tree': tree_hash(),
        'family': family,
        'names': list(name_expressions),
        'options': [o for o in options if not o.startswith('-I')],
        'nvrtc': list(nvrtc_version()),
    }
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:32]


def _debug(msg: str):
    if envs.jit_debug():
        print(f'[deepep_cupy.jit pid={os.getpid()}] {msg}', file=sys.stderr, flush=True)


def _nvrtc_compile(family: str, name_expressions: Sequence[str], options: Sequence[str]):
    from cupy.cuda import compiler
    src = f'#include "{family}.cu"\n'
    prog = compiler._NVRTCProgram(src, f'deepep_cupy_{family}.cu', name_expressions=list(name_expressions),
                                  method='cubin')
    try:
        cubin, lowered = prog.compile(tuple(options))
    except compiler.CompileException as e:
        log = e.get_message() if hasattr(e, 'get_message') else str(e)
        raise JITCompileError(f'deepep_cupy: failed to compile kernel family {family!r} for '
                              f'{list(name_expressions)}\noptions: {" ".join(options)}\n{log}') from None
    return bytes(cubin), dict(lowered)


def compile_cubin(family: str, name_expressions: Sequence[str], arch: Optional[str] = None,
                  defines: Optional[Dict[str, object]] = None, extra_options: Sequence[str] = (),
                  use_cache: Optional[bool] = None) -> CompiledModule:
    """Compile (or fetch from the disk cache) one specialisation set of a kernel family.

    Args:
        family: the `.cu` file name under `kernels_cu/` without extension.
        name_expressions: C++ expressions naming the kernels to instantiate, e.g. `'deepep::barrier_kernel<8>'`.
        arch: target compute capability like `'90'` (default: the current device's).
        defines: `-D` macros (part of the cache key).
        extra_options: further NVRTC options (part of the cache key).
        use_cache: read/write the disk cache (default: unless `DEEPEP_CUPY_JIT_DISABLE_CACHE`).

    Returns:
        `CompiledModule` with the cubin and the lowered (mangled) kernel names.
    """
    if not (kernels_dir() / f'{family}.cu').is_file():
        raise ValueError(f'family: no kernel source {family}.cu in {kernels_dir()}')
    arch = arch or device_arch()
    options = _options(arch, defines or {}, extra_options)
    key = cache_key(family, name_expressions, options)
    use_cache = (not envs.jit_disable_cache()) if use_cache is None else use_cache
    start = time.perf_counter()
    if not use_cache:
        cubin, lowered = _nvrtc_compile(family, name_expressions, options)
        seconds = time.perf_counter() - start
        _debug(f'compiled {family} {list(name_expressions)} in {seconds:.3f} s (cache disabled)')
        return CompiledModule(key, cubin, lowered, False, seconds)

    cache = Path(envs.jit_cache_dir())
    cache.mkdir(parents=True, exist_ok=True)
    cubin_path, meta_path = cache / f'{family}-{key}.cubin', cache / f'{family}-{key}.json'

    def load():
        try:
            meta = json.loads(meta_path.read_text())
            data = cubin_path.read_bytes()
        except (OSError, ValueError):
            return None
        if hashlib.sha256(data).hexdigest() != meta.get('sha256'):
            return None     # torn or corrupted entry: rebuild it
        return data, meta['lowered']

    hit = load()
    if hit is None:
        with open(cache / f'{family}-{key}.lock', 'a+') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                hit = load()    # another process may have published while we waited
                if hit is None:
                    cubin, lowered = _nvrtc_compile(family, name_expressions, options)
                    _publish(cubin_path, cubin)
                    _publish(meta_path, json.dumps({
                        'sha256': hashlib.sha256(cubin).hexdigest(), 'lowered': lowered, 'family': family,
                        'names': list(name_expressions), 'options': list(options)}).encode())
                    seconds = time.perf_counter() - start
                    _debug(f'compiled {family} {list(name_expressions)} in {seconds:.3f} s -> {cubin_path.name}')
                    return CompiledModule(key, cubin, lowered, False, seconds)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    seconds = time.perf_counter() - start
    _debug(f'cache hit {family} {list(name_expressions)} ({seconds * 1e3:.1f} ms)')
    return CompiledModule(key, hit[0], hit[1], True, seconds)


def _publish(path: Path, data: bytes):
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + '.tmp')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
