"""Helpers shared by the rank programs: failures, bitwise checks, expected-error checks, host gathers, logging.

torch is imported by the helpers that compare or gather tensors, so CuPy-only programs (the barrier) can use the rest.
"""

from typing import Callable, List


class Failure(AssertionError):
    pass


def check(cond: bool, what: str):
    if not cond:
        raise Failure(what)


def check_equal(got, want, what: str):
    """Bitwise equality of two torch tensors (through an integer view), reporting the first mismatch."""
    import torch
    if got.shape != want.shape:
        raise Failure(f'{what}: shape {tuple(got.shape)} != expected {tuple(want.shape)}')
    if got.dtype != want.dtype:
        raise Failure(f'{what}: dtype {got.dtype} != expected {want.dtype}')
    a, b = got.contiguous(), want.to(got.device).contiguous()
    if a.element_size() in (1, 2, 4, 8) and a.is_floating_point():
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(view), b.view(view)
    diff = (a != b)
    if diff.any():
        idx = tuple(diff.nonzero()[0].tolist())
        raise Failure(f'{what}: {int(diff.sum())} mismatches, first at {list(idx)}: got {a[idx].item()}, '
                      f'expected {b[idx].item()} (as {a.dtype} bits)')


def gather_tensors(group, tensors):
    """Every rank's copy of `tensors` (CPU torch tensors), through the host process group. Tensors travel as numpy
    arrays of their raw bytes (torch cannot unpickle float8 tensors everywhere)."""
    import torch
    packed = tuple((str(t.dtype).replace('torch.', ''), t.view(torch.uint8).cpu().numpy() if t.element_size() == 1
                    else t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
                    .cpu().numpy()) for t in tensors)
    out = []
    for rank_tensors in group.allgather_object(packed):
        out.append(tuple(torch.from_numpy(a).view(getattr(torch, d)) for d, a in rank_tensors))
    return out


def expect_error(tried: List[str], name: str, exc: type, fn: Callable[[], object]) -> None:
    """Run `fn` and require it to raise `exc`; record the message in `tried`."""
    try:
        fn()
    except exc as e:
        tried.append(f'{name}: {type(e).__name__}: {e}')
        return
    except Exception as e:  # noqa: BLE001
        raise Failure(f'{name}: expected {exc.__name__}, got {type(e).__name__}: {e}') from e
    raise Failure(f'{name}: expected {exc.__name__}, nothing was raised')


def log(group, msg: str, all_ranks: bool = False) -> None:
    """Print on rank 0 (or on every rank)."""
    if all_ranks or group.rank == 0:
        print(msg, flush=True)


def process_gpu_bytes() -> int:
    """GPU memory this process holds: NVML's per-process figure when NVML lists this process (ranks sharing a GPU,
    or other jobs on it, then do not count), else the device's used memory (`cudaMemGetInfo`)."""
    import os

    import cupy
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            bus = cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.runtime.getDevice())
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    return int(p.usedGpuMemory)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001  (no NVML, or it cannot see this process: fall back)
        pass
    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free
