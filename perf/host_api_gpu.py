"""What one CUDA API call costs from Python on this host (the calls a deepep_cupy call makes besides its own Python):
torch's caching-allocator allocation, a typed view carved out of an allocation, an event record and a stream wait
through CuPy, a kernel launch through CuPy's driver binding, torch's current-stream query.

    python perf/host_api_gpu.py [--calls 20000]

Prints µs per call (best of 5 batches). Weigh host_path_cpu.py's [api] counts with these.

Seen on the 1xH200 host (torch 2.11, CuPy 14, 2026-12-01, the same calls from an inline script): torch.empty on the
GPU 2.9-3.3 us; a carved typed view (view(dtype) + as_strided) 3.2 us, a same-dtype as_strided 1.8 us (so carving an
output out of a shared allocation saves nothing: 1 allocation + 2 carved views 7.9-10.8 us against 2 allocations
5.9-7.0 us); CuPy Event.record 0.9 us, Stream.wait_event 0.5 us, Event() 1.6 us; driver.launchKernel 3.8 us;
torch's current raw stream 0.1 us.
"""

import argparse
import ctypes
import sys
import time


def best(fn, calls):
    for _ in range(min(1000, calls)):
        fn()
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return min(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--calls', type=int, default=20000)
    args = p.parse_args(argv)
    import cupy
    import torch
    from cupy_backends.cuda.api import driver
    dev = torch.device('cuda', 0)
    torch.empty(1, device=dev)
    bf16, i32, f32 = torch.bfloat16, torch.int32, torch.float32
    block = torch.empty(1 << 20, dtype=i32, device=dev)
    raw = torch._C._cuda_getCurrentRawStream
    stream = cupy.cuda.ExternalStream(raw(0))
    comm = cupy.cuda.Stream(non_blocking=True)
    ev = cupy.cuda.Event(disable_timing=True)
    mod = cupy.RawModule(code='extern "C" __global__ void k(int* p) { if (p && threadIdx.x == 0) *p = 1; }')
    fn = mod.get_function('k')
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
    for name, f in cases.items():
        us = best(f, args.calls)
        torch.cuda.synchronize()
        print(f'[api-cost] {name:45s} {us:6.2f} us', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
