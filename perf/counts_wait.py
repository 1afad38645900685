"""What the host's wait for a CPU-sync dispatch's receive counts costs beyond the GPU's notify (issue 11);
perf/ep_profile.py prints it.

Two passes over calls from idle (GPU idle, ranks aligned before each):
  - unprofiled, in the host's clock: whether the counts were already there when the host entered the wait
    (`EP._wait_host_counts`: then it costs one read), and how long the host spent in the wait;
  - profiled (the torch profiler puts kernels and host annotations on one clock): for the calls whose host was in
    the wait before the counts came (checked by a read at entry, no clock needed), the time from the notify kernel's
    end to the host's return from the wait (a zero-length annotation); each call followed by the control below, in
    the same profiled session (two sessions may align the clocks a few µs apart). The same figure for a bare signal, a
    one-thread kernel writing a host-mapped word that the host spins on as the dispatch's wait does, is the floor of
    any GPU-to-host signal (PCIe visibility, the profiler's clock alignment, the annotation's own cost): the dispatch's
    figure over it is what the counts wait costs beyond the notify.
"""

import ctypes
import time

import numpy as np

SEEN, FLAG_SEEN = 'deepep_cupy counts seen', 'deepep_cupy flag seen'      # (the two annotations)
_FLAG_SOURCE = r'''
extern "C" __global__ void counts_wait_flag(int* flag, int value) {
    __threadfence_system();
    *reinterpret_cast<volatile int*>(flag) = value;
}
'''


def _latencies(events, kernel_match, annotation: str, waited):
    """µs from each call's kernel end to its `annotation`, for the calls in `waited` (indices)."""
    kernels = sorted([e for e in events if e.get('cat') == 'kernel' and kernel_match(e.get('name', ''))],
                     key=lambda e: e['ts'])
    seen = sorted([e for e in events if e.get('name') == annotation], key=lambda e: e['ts'])
    if len(kernels) != len(seen):
        raise RuntimeError(f'counts wait: {len(kernels)} kernels and {len(seen)} {annotation!r} in the trace')
    return [seen[i]['ts'] - (kernels[i]['ts'] + kernels[i]['dur']) for i in waited]


def measure(runner, fn, ep, num_calls: int, is_notify):
    """A dict of the CPU-sync dispatch `fn` (of the EP feature `ep`; `is_notify(kernel name)` picks its notify
    kernel) over `num_calls` calls each pass: `ready` (unprofiled calls whose counts were there at the wait's entry),
    `in_wait` (their median µs in the wait), `waited` (profiled calls whose host waited), `after_notify` and `bare`
    (median µs from the kernel's end to the host's return, dispatch and bare signal), `beyond` (their difference;
    0 when no profiled call waited). Ranks: the largest figures, the fewest ready calls."""
    import cupy
    torch = runner.torch
    from deepep_cupy.utils.testing import profiler_trace_events
    record, wait, host_record = torch.profiler.record_function, ep._wait_host_counts, ep._host_record
    ready, in_wait = [], []

    def timed_wait(seq, *a):
        ready.append(host_record[0] == seq)
        t0 = time.perf_counter()
        out = wait(seq, *a)
        in_wait.append(time.perf_counter() - t0)
        return out

    def marked_wait(seq, *a):
        ready.append(host_record[0] == seq)
        out = wait(seq, *a)
        with record(SEEN):
            pass
        return out

    flag = torch.zeros(4, dtype=torch.int32, pin_memory=True)        # (pinned: mapped at its host address)
    word = (ctypes.c_int32 * 1).from_address(flag.data_ptr())
    kernel = cupy.RawKernel(_FLAG_SOURCE, 'counts_wait_flag')

    def bare(value):
        kernel((1,), (1,), (flag.data_ptr(), np.int32(value)),
               stream=cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))
        bare_ready.append(word[0] == value)
        while word[0] != value:
            pass
        with record(FLAG_SEEN):
            pass

    def calls(call):
        for i in range(num_calls):
            runner.aligned()
            call(i)
        runner.aligned()

    bare_ready = []
    bare(1)
    try:
        ep._wait_host_counts = timed_wait
        calls(lambda i: fn())
        num_ready, unprofiled_wait = sum(ready), float(np.median(in_wait)) * 1e6
        # One profiled session, the dispatch and the bare flag in turn (one clock alignment for both).
        ep._wait_host_counts = marked_wait
        ready.clear()
        bare_ready.clear()

        def both(i):
            fn()
            runner.aligned()
            bare(i + 2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            calls(both)
    finally:
        del ep._wait_host_counts
    events = profiler_trace_events(prof)
    waited = [i for i, r in enumerate(ready) if not r]
    after_notify = _latencies(events, is_notify, SEEN, waited)
    floor = _latencies(events, lambda n: 'counts_wait_flag' in n, FLAG_SEEN,
                       [i for i, r in enumerate(bare_ready) if not r])
    group = runner.group

    def worst(v):
        return max(group.allgather_object(v))
    out = dict(ready=min(group.allgather_object(num_ready)), in_wait=worst(unprofiled_wait),
               waited=min(group.allgather_object(len(waited))),
               after_notify=worst(float(np.median(after_notify)) if after_notify else float('nan')),
               bare=worst(float(np.median(floor)) if floor else float('nan')))
    out['beyond'] = worst(out['after_notify'] - out['bare'] if after_notify and floor else 0.0)
    return out
