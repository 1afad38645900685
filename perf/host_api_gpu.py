"""What one CUDA API call costs from Python on this host (the calls a deepep_cupy call makes besides its own Python):
torch's caching-allocator allocation, a typed view carved out of an allocation, an event record and a stream wait
through CuPy, a kernel launch through CuPy's driver binding, torch's current-stream query.

    python perf/host_api_gpu.py [--calls 20000]

Prints µs per call (best of 5 rounds, each timed in batches of 200 calls with the GPU drained before each batch).
Weigh host_path_cpu.py's [api] counts with these.

Seen on the 1xH200 host (torch 2.11, CuPy 14, 2026-12-01, the same calls from an inline script): torch.empty on the
GPU 2.9-3.3 us; a carved typed view (view(dtype) + as_strided) 3.2 us, a same-dtype as_strided 1.8 us (so carving an
output out of a shared allocation saves nothing: 1 allocation + 2 carved views 7.9-10.8 us against 2 allocations
5.9-7.0 us); CuPy Event.record 0.9 us, Stream.wait_event 0.5 us, Event() 1.6 us; driver.launchKernel 3.8 us;
torch's current raw stream 0.1 us. (Those were timed back to back without draining the GPU: 20000 empty kernels
fill the launch queue, so the launch row may have measured the GPU's rate of empty kernels, not the host's cost.)

The rows after those: other ways to launch (ctypes `cuLaunchKernel` with preset argument types; CuPy's binding with
one packed parameter buffer through `extra`), the jit launcher's own paths, and per-call pieces of deepep_cupy's hot
paths (`record_stream`, `is_capturing`, `interop.current_stream` / `meta`, a pooled `EventHandle`). On the CPU host a
ctypes call of an 11-argument no-op C function costs 1.0-1.5 us of Python alone (CuPy's Cython binding ~0.1 us), so
ctypes is not expected to win.
"""

import argparse
import ctypes
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def best(fn, calls, sync=None, batch: int = 200):
    """µs per call: the best of 5 rounds of `calls` calls, each round timed in batches of `batch` calls with the GPU
    drained (`sync`, untimed) before each batch, so that launches never wait for a full launch queue (20000 empty
    kernels back to back measure the GPU's kernel rate, not the host's cost)."""
    for _ in range(min(1000, calls)):
        fn()
    out = []
    for _ in range(5):
        total = 0.0
        for _ in range(max(1, calls // batch)):
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            total += time.perf_counter() - t0
        out.append(total / (max(1, calls // batch) * batch) * 1e6)
    return min(out)


def ctypes_launcher(fn_ptr: int, stream_ptr: int, params_addr: int):
    """`cuLaunchKernel` from libcuda through ctypes with preset argument types (the alternative to CuPy's binding)."""
    try:
        lib = ctypes.CDLL('libcuda.so.1')
    except OSError as e:
        reason = str(e)

        def missing():
            raise RuntimeError(f'libcuda.so.1 not loadable: {reason}')
        return missing
    f = lib.cuLaunchKernel
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3

    def go():
        rc = f(fn_ptr, 1, 1, 1, 32, 1, 1, 0, stream_ptr, params_addr, None)
        if rc:
            raise RuntimeError(f'cuLaunchKernel returned {rc}')
    return go


def extra_cases(args, cupy, torch, driver, fn, stream, comm, block, dev):
    """The other ways to make the same calls, and the per-call pieces of deepep_cupy's own hot paths."""
    from deepep_cupy.jit import launch
    from deepep_cupy.runtime import interop
    from deepep_cupy.runtime.event import EventHandle
    arg = ctypes.c_uint64(0)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    # cuLaunchKernel's `extra`: one packed parameter buffer instead of an array of pointers to each parameter.
    size = ctypes.c_size_t(8)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(arg), 2, ctypes.addressof(size), 0)
    s_ptr, extra_addr = stream.ptr, ctypes.addressof(extra)
    kernel = launch.Kernel(launch.KernelSpec('host_api_gpu', 'k', (launch.Param('p', launch.PTR),)), fn, dev.index)
    bound = kernel.bind(1, 32, p=0)
    x = torch.empty((128, 7168), dtype=torch.bfloat16, device=dev)
    i64 = torch.int64
    ev_comm = cupy.cuda.Event(disable_timing=True)
    return {
        'ctypes cuLaunchKernel (empty kernel)': ctypes_launcher(fn.ptr, s_ptr, ctypes.addressof(params)),
        'cupy driver.launchKernel, extra param buffer': lambda: driver.launchKernel(fn.ptr, 1, 1, 1, 32, 1, 1, 0,
                                                                                    s_ptr, 0, extra_addr),
        'jit BoundLaunch(stream) (empty kernel)': lambda: bound(stream),
        # The rows above launch on torch's current stream, the legacy default stream unless the caller set one (the
        # driver orders it against every blocking stream); the same launch on a non-blocking stream:
        'cupy driver.launchKernel, non-blocking stream': lambda: driver.launchKernel(fn.ptr, 1, 1, 1, 32, 1, 1, 0,
                                                                                     comm.ptr,
                                                                                     ctypes.addressof(params), 0),
        'cupy Event.record(non-blocking stream)': lambda: ev_comm.record(comm),
        'jit Kernel.launch by name (empty kernel)': lambda: kernel.launch(1, 32, stream=stream, p=0),
        'x.new_empty [128, 7168] bf16': lambda: x.new_empty((128, 7168)),
        'block.view(int64) (typed view only)': lambda: block.view(i64),
        'Tensor.record_stream(comm)': lambda: x.record_stream(interop.torch_stream(comm.ptr)),
        'cupy ExternalStream.is_capturing': lambda: stream.is_capturing(),
        'interop.current_stream(torch tensor)': lambda: interop.current_stream(x),
        'interop.meta(torch tensor)': lambda: interop.meta(x),
        'EventHandle(comm), dropped (pooled event)': lambda: EventHandle(comm),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--calls', type=int, default=20000)
    args = p.parse_args(argv)
    import cupy
    import torch
    from cupy_backends.cuda.api import driver

    from deepep_cupy.runtime.interop import external_stream
    dev = torch.device('cuda', 0)
    torch.empty(1, device=dev)
    bf16, i32, f32 = torch.bfloat16, torch.int32, torch.float32
    block = torch.empty(1 << 20, dtype=i32, device=dev)
    raw = torch._C._cuda_getCurrentRawStream
    stream = external_stream(raw(0))
    comm = cupy.cuda.Stream(non_blocking=True)
    ev = cupy.cuda.Event(disable_timing=True)
    mod = cupy.RawModule(code='extern "C" __global__ void k(int* p) { if (p && threadIdx.x == 0) *p = 1; }')
    fn = mod.get_function('k')
    fn = getattr(fn, 'kernel', fn)          # a RawKernel's loaded function (`.ptr`: the CUfunction)
    arg = ctypes.c_uint64(0)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    params_addr = ctypes.addressof(params)
    s_ptr = stream.ptr
    cases = {
        'torch.empty [128, 7168] bf16 (cuda)': lambda: torch.empty((128, 7168), dtype=bf16, device=dev),
        'torch.empty [1000] int32 (cuda)': lambda: torch.empty((1000,), dtype=i32, device=dev),
        'carved view: block.view(bf16).as_strided': lambda: block.view(bf16).as_strided((128, 7168), (7168, 1), 0),
        'carved view: block.as_strided (same dtype)': lambda: block.as_strided((128, 8), (8, 1), 4096),
        'carved view: block.view(f32).as_strided': lambda: block.view(f32).as_strided((128, 8), (8, 1), 4096),
        'cupy Event.record(stream)': lambda: ev.record(stream),
        'cupy Stream.wait_event': lambda: comm.wait_event(ev),
        'cupy driver.launchKernel (empty kernel)': lambda: driver.launchKernel(fn.ptr, 1, 1, 1, 32, 1, 1, 0, s_ptr,
                                                                                params_addr, 0),
        'cupy.cuda.Event() (create)': lambda: cupy.cuda.Event(disable_timing=True),
        'torch._C._cuda_getCurrentRawStream': lambda: raw(0),
    }
    try:
        cases.update(extra_cases(args, cupy, torch, driver, fn, stream, comm, block, dev))
    except Exception as e:          # the original rows still run
        print(f'[api-cost] the extra rows could not be set up: {type(e).__name__}: {e}', flush=True)
    for name, f in cases.items():
        try:
            us = best(f, args.calls, torch.cuda.synchronize)
        except Exception as e:          # one failing row (a binding missing on this host) does not stop the others
            print(f'[api-cost] {name:45s} failed: {type(e).__name__}: {e}', flush=True)
            continue
        torch.cuda.synchronize()
        print(f'[api-cost] {name:45s} {us:6.2f} us', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
