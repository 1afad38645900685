"""Benchmark and profiling helpers for the tests: CUDA-event timing, per-kernel profiler timing, L2 flushing, a GPU
sleep and fd-level output suppression.

Works for torch and CuPy users alike: timing events are CuPy events recorded on `interop.current_stream()` (torch's
current stream once torch has initialised CUDA, else CuPy's). torch is imported lazily and only where it is needed.
"""

import contextlib
import ctypes
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Tuple, Union

from .. import envs
from ..runtime import interop

# Bytes zeroed by `flush_l2_cache` (upstream: 256e6 bytes of int32), far above any GPU's L2.
L2_FLUSH_BYTES = 256_000_000
# Cycles `bench_kineto(barrier_comm_profiling=True)` sleeps before each call (~10 ms at 2 GHz).
BARRIER_SLEEP_CYCLES = 20_000_000

# Per-device caches: the L2 flush buffer (allocated once, never freed) and the compiled sleep module.
_l2_flush_buffers = {}
_sleep_module = None


class BenchResult(NamedTuple):
    """Seconds per call over the timed runs (the first one dropped); unpacks as upstream's `(avg, min, max)`."""
    avg: float
    min: float
    max: float


def flush_l2_cache(enabled: bool = True, stream=None) -> None:
    """Evict the L2 cache by zeroing a 256 MB device buffer (allocated once per device, then reused).

    Args:
        enabled: do nothing when False (so callers can pass their `flush_l2` flag straight through).
        stream: a `cupy.cuda.Stream`-like object to zero on (default: `interop.current_stream()`).
    """
    if not enabled:
        return
    import cupy
    device = cupy.cuda.runtime.getDevice()
    buffer = _l2_flush_buffers.get(device)
    if buffer is None:
        buffer = _l2_flush_buffers[device] = cupy.cuda.memory.alloc(L2_FLUSH_BYTES)
    stream = stream if stream is not None else interop.current_stream()
    cupy.cuda.runtime.memsetAsync(buffer.ptr, 0, L2_FLUSH_BYTES, stream.ptr)


def _kernel_source(name: str) -> str:
    """Text of `kernels_cu/<name>`: from the installed `deepep_cupy.kernels_cu` package, else the checkout."""
    try:
        from importlib.resources import files
        resource = files('deepep_cupy.kernels_cu') / name
        if resource.is_file():
            return resource.read_text()
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        pass
    return (Path(__file__).resolve().parents[2] / 'kernels_cu' / name).read_text()


def sleep_gpu(cycles: Union[int, float], stream=None) -> None:
    """Keep the GPU busy for `cycles` SM clock cycles (one thread spinning on `clock64`); needs no torch.

    Args:
        cycles: number of clock cycles (2e7 is about 10 ms on an H100/H200).
        stream: a `cupy.cuda.Stream`-like object to launch on (default: `interop.current_stream()`).
    """
    import cupy
    import numpy as np
    global _sleep_module
    if _sleep_module is None:
        _sleep_module = cupy.RawModule(code=_kernel_source('testing.cu'))
    kernel = _sleep_module.get_function('sleep_cycles')
    with stream if stream is not None else interop.current_stream():
        kernel((1,), (1,), (np.int64(int(cycles)),))


def bench(fn: Callable[[], object], num_warmups: int = 50, num_tests: int = 50,
          post_fn: Optional[Callable[[], object]] = None, flush_l2: bool = True) -> BenchResult:
    """Time `fn` with CUDA events on the current stream, flushing L2 before every call.

    Args:
        fn: the work to time; it must launch on the current stream (or synchronise with it).
        num_warmups: untimed calls first.
        num_tests: timed calls (at least 2: the first is dropped).
        post_fn: called after each timed call, outside the timed region.
        flush_l2: zero a 256 MB buffer before each call so `fn` starts with a cold L2.

    Returns:
        `BenchResult(avg, min, max)` in seconds.
    """
    if num_tests < 2:
        raise ValueError(f'num_tests must be at least 2 (the first sample is dropped), got {num_tests}')
    import cupy
    import numpy as np
    cupy.cuda.runtime.deviceSynchronize()
    for _ in range(num_warmups):
        fn()
    # Only now: a torch `fn` may have initialised torch's CUDA state during the warm-ups
    stream = interop.current_stream()
    start_events = [cupy.cuda.Event() for _ in range(num_tests)]
    end_events = [cupy.cuda.Event() for _ in range(num_tests)]
    for start, end in zip(start_events, end_events):
        flush_l2_cache(flush_l2, stream)
        start.record(stream)
        fn()
        end.record(stream)
        if post_fn is not None:
            post_fn()
    cupy.cuda.runtime.deviceSynchronize()
    times = np.array([cupy.cuda.get_elapsed_time(s, e) / 1e3 for s, e in zip(start_events, end_events)])[1:]
    return BenchResult(float(times.mean()), float(times.min()), float(times.max()))


class empty_suppress:
    """A context manager that does nothing (what `bench_kineto` uses when output is not suppressed)."""

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


class suppress_stdout_stderr:
    """Silence file descriptors 1 and 2 (C/C++ and CUDA output included) and Python's `sys.stdout`/`sys.stderr`.

    Anything written inside the block is discarded; both are restored on exit, also after an exception. Nests.
    """

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        _flush_c_stdio()
        self._devnull_fd = os.open(os.devnull, os.O_WRONLY)
        self._saved_fds = (os.dup(1), os.dup(2))
        os.dup2(self._devnull_fd, 1)
        os.dup2(self._devnull_fd, 2)
        self._saved_streams = (sys.stdout, sys.stderr)
        self._devnull_file = open(os.devnull, 'w')
        sys.stdout = sys.stderr = self._devnull_file
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        # Drop what C stdio still buffers before the real descriptors come back
        _flush_c_stdio()
        sys.stdout, sys.stderr = self._saved_streams
        self._devnull_file.close()
        for fd, saved in zip((1, 2), self._saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        os.close(self._devnull_fd)
        return False


def _flush_c_stdio() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def _torch_with_cuda():
    """torch, if it imports and sees a GPU; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def bench_kineto(fn: Callable[[], object], kernel_names: Union[str, Tuple[str, ...]], num_tests: int = 30,
                 suppress_kineto_output: bool = False, trace_path: Optional[str] = None, flush_l2: bool = True,
                 barrier_comm_profiling: bool = False, num_kernels_per_period: int = 1,
                 barrier: Optional[Callable[[], object]] = None):
    """Average GPU time of the named kernels launched by `fn`, from torch's profiler (kineto / CUPTI).

    `fn` is called once untimed, then 2 rounds of `num_tests` calls run under a profiler schedule of (wait 0,
    warmup 1, active 1), so only the second round counts. A kernel name matches every profiled kernel whose name
    contains it; the result is the count-weighted mean over all matches, i.e. the time of one launch.

    Without torch or without a CUDA-enabled torch, falls back to timing whole calls of `fn` with CUDA events: every
    name then gets that same whole-call time (the fallback cannot tell kernels apart, so several names do not split
    the time between them), `num_kernels_per_period > 1` repeats it for every phase and `trace_path` is ignored.

    With `DEEPEP_CUPY_USE_NVIDIA_TOOLS=1` (an external profiler is attached) nothing runs and every time is 1 s.

    Args:
        fn: the work to profile.
        kernel_names: one kernel-name substring, or a tuple of them.
        num_tests: calls per profiling round.
        suppress_kineto_output: silence the profiler's own stdout/stderr output.
        trace_path: also write the Chrome trace there.
        flush_l2: zero a 256 MB buffer before every call.
        barrier_comm_profiling: before every call, sleep the GPU ~10 ms then synchronise ranks (`barrier()` if given,
            else a torch.distributed all-reduce when a torch process group exists), so that all ranks start `fn`
            together and host launch skew does not count as kernel time.
        num_kernels_per_period: > 1 when each name matches launches of several alternating phases (e.g. a hooked
            send then recv): their launches, sorted by start time, are split round-robin into that many phases.
        barrier: callable that synchronises the ranks (used with `barrier_comm_profiling`).

    Returns:
        seconds: a float for a string `kernel_names`, else a tuple with one entry per name (0 for a name no kernel
        matches, as DeepEP, with a note on stderr listing the kernels seen); with `num_kernels_per_period > 1` each
        entry is a tuple of per-phase times.
    """
    names = (kernel_names,) if isinstance(kernel_names, str) else kernel_names
    if not isinstance(names, tuple) or not names or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f'kernel_names must be a non-empty string or a tuple of them, got {kernel_names!r}')
    if num_tests < 1:
        raise ValueError(f'num_tests must be positive, got {num_tests}')
    if num_kernels_per_period < 1:
        raise ValueError(f'num_kernels_per_period must be positive, got {num_kernels_per_period}')

    def pack(per_name):
        return tuple(per_name) if isinstance(kernel_names, tuple) else per_name[0]

    if envs.use_nvidia_tools():
        return pack([1.0 if num_kernels_per_period == 1 else (1.0,) * num_kernels_per_period for _ in names])

    torch = _torch_with_cuda()

    def before_call():
        flush_l2_cache(flush_l2)
        if barrier_comm_profiling:
            sleep_gpu(BARRIER_SLEEP_CYCLES)
            if barrier is not None:
                barrier()
            elif torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(torch.ones(1, dtype=torch.float, device='cuda'))

    import cupy
    fn()
    cupy.cuda.runtime.deviceSynchronize()
    if torch is None:
        avg = _time_calls(fn, num_tests, before_call)
        return pack([avg if num_kernels_per_period == 1 else (avg,) * num_kernels_per_period for _ in names])

    with suppress_stdout_stderr() if suppress_kineto_output else contextlib.nullcontext():
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], schedule=schedule) as prof:
            for _ in range(2):
                for _ in range(num_tests):
                    before_call()
                    fn()
                cupy.cuda.runtime.deviceSynchronize()
                prof.step()
    if trace_path is not None:
        prof.export_chrome_trace(trace_path)

    durations = [_average_kernel_time(prof.key_averages(), name) for name in names]
    if num_kernels_per_period > 1:
        trace_events = profiler_trace_events(prof)
        durations = [_split_periods(trace_events, name, num_kernels_per_period) for name in names]
    return pack(durations)


def profiler_trace_events(prof) -> list:
    """The Chrome-trace events of a finished `torch.profiler.profile` (exported through a temporary file, the only
    way torch offers them with their timestamps)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, 'trace.json')
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)['traceEvents']


def _time_calls(fn, num_tests: int, before_call: Callable[[], None]) -> float:
    """Mean seconds per call of `fn` measured with CUDA events (the fallback of `bench_kineto`)."""
    import cupy
    stream = interop.current_stream()
    times = []
    for _ in range(num_tests):
        before_call()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        times.append((start, end))
    cupy.cuda.runtime.deviceSynchronize()
    return sum(cupy.cuda.get_elapsed_time(s, e) for s, e in times) / 1e3 / num_tests


def _is_device_event(event) -> bool:
    device_type = getattr(event, 'device_type', None)
    return getattr(device_type, 'name', str(device_type)).upper() != 'CPU'


def _average_kernel_time(averages, name: str) -> float:
    """Count-weighted mean duration in seconds of the profiled kernels whose name contains `name`."""
    total_us, count = 0.0, 0
    for event in averages:
        if name in event.key and _is_device_event(event):
            total_us += getattr(event, 'device_time_total', None) or getattr(event, 'cuda_time_total', 0)
            count += event.count
    if count == 0:
        # DeepEP returns 0 here; say why, since callers usually divide by it next
        seen = sorted({e.key for e in averages if _is_device_event(e)})
        print(f'bench_kineto: no profiled kernel name contains {name!r} (returning 0); kernels seen: {seen}',
              file=sys.stderr, flush=True)
        return 0.0
    return total_us / count / 1e6


def _split_periods(trace_events, name: str, num_kernels_per_period: int) -> Tuple[float, ...]:
    """Per-phase mean kernel durations in seconds: matching launches sorted by start time, phase = index mod period."""
    events = sorted((e for e in trace_events if e.get('cat') == 'kernel' and name in e.get('name', '')),
                    key=lambda e: e['ts'])
    durations = [e['dur'] / 1e6 for e in events]
    if not durations or len(durations) % num_kernels_per_period != 0:
        raise RuntimeError(f'{len(durations)} launches of kernels matching {name!r} do not split into periods of '
                           f'{num_kernels_per_period}')
    num_periods = len(durations) // num_kernels_per_period
    return tuple(sum(durations[i::num_kernels_per_period]) / num_periods for i in range(num_kernels_per_period))


def parse_num_bytes(text: str) -> int:
    """A byte count with an optional binary suffix: `1G`, `64M`, `512k`, `1.5GiB`, `1048576` (DeepEP V2.5).

    Raises:
        ValueError: not a byte count, or not positive.
    """
    match = re.fullmatch(r'\s*([0-9.]+)\s*([kmgt])?(?:i?b)?\s*', text, re.IGNORECASE)
    if match is None:
        raise ValueError(f'{text!r} is not a byte count; expected e.g. 1G, 64M, 512K, 1048576')
    scale = {None: 1, 'k': 1 << 10, 'm': 1 << 20, 'g': 1 << 30, 't': 1 << 40}[(match.group(2) or '').lower() or None]
    try:
        value = int(float(match.group(1)) * scale)
    except ValueError as e:
        raise ValueError(f'{text!r} has an unparseable number') from e
    if value <= 0:
        raise ValueError(f'byte count must be positive, got {value}')
    return value
