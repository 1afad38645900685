"""What the host's wait for a CPU-sync dispatch's receive counts costs beyond the GPU's notify (issue 11), measured in
one profiled timeline (perf/ep_profile.py prints it).

The torch profiler puts the GPU's kernels and the host's annotated ranges on one clock. Per call, from idle:
  - the notify kernel's end (GPU) and the host's wait for the counts (`EP._wait_host_counts`, annotated: entry and
    return);
  - the wait's cost beyond the notify = return - max(entry, notify end): how long after the later of "the notify is
    done" and "the host is ready for the counts" the host has them.
The control runs the same measurement on a bare signal: a one-thread kernel that writes a host-mapped word, the host
spinning on it as the dispatch's wait does. The control is the floor of any GPU-to-host signal (PCIe visibility,
profiler clock conversion); the dispatch's figure over the control is what the counts wait costs beyond the notify.
"""

import ctypes

import numpy as np

ANNOTATION = 'deepep_cupy counts wait'
_FLAG_SOURCE = r'''
extern "C" __global__ void counts_wait_flag(int* flag, int value) {
    __threadfence_system();
    *reinterpret_cast<volatile int*>(flag) = value;
}
'''


def _costs(events, kernel_match, num_calls: int):
    """`(per-call costs in µs, calls where the host entered the wait before the kernel ended)` from a trace."""
    kernels = sorted([e for e in events if e.get('cat') == 'kernel' and kernel_match(e.get('name', ''))],
                     key=lambda e: e['ts'])
    waits = sorted([e for e in events if e.get('name') == ANNOTATION], key=lambda e: e['ts'])
    if len(kernels) != num_calls or len(waits) != num_calls:
        raise RuntimeError(f'counts wait: {len(kernels)} kernels and {len(waits)} waits in the trace for '
                           f'{num_calls} calls')
    costs, early = [], 0
    for k, w in zip(kernels, waits):
        end, enter, seen = k['ts'] + k['dur'], w['ts'], w['ts'] + w['dur']
        early += enter < end
        costs.append(seen - max(enter, end))
    return costs, early


def measure(runner, fn, ep, num_calls: int, is_notify):
    """`(dispatch µs, control µs, calls of the dispatch whose host waited for the notify)`: medians of the cost beyond
    the kernel's end (see the module's doc) over `num_calls` calls of the CPU-sync dispatch `fn` (of the EP feature
    `ep`; `is_notify(kernel name)` picks its notify kernel) and of the control, each from idle."""
    import cupy
    torch = runner.torch
    from deepep_cupy.utils.testing import profiler_trace_events
    record = torch.profiler.record_function
    wait = ep._wait_host_counts

    def annotated_wait(*a):
        with record(ANNOTATION):
            return wait(*a)

    flag = torch.zeros(4, dtype=torch.int32, pin_memory=True)        # (pinned: mapped at its host address)
    word = (ctypes.c_int32 * 1).from_address(flag.data_ptr())
    kernel = cupy.RawKernel(_FLAG_SOURCE, 'counts_wait_flag')

    def control(value):
        kernel((1,), (1,), (flag.data_ptr(), np.int32(value)), stream=cupy.cuda.ExternalStream(
            torch.cuda.current_stream().cuda_stream))
        with record(ANNOTATION):
            while word[0] != value:
                pass

    control(1)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ep._wait_host_counts = annotated_wait
    try:
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(num_calls):
                runner.aligned()
                fn()
            runner.aligned()
    finally:
        del ep._wait_host_counts
    dispatch, early = _costs(profiler_trace_events(prof), is_notify, num_calls)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(num_calls):
            runner.aligned()
            control(i + 2)
        runner.aligned()
    bare, _ = _costs(profiler_trace_events(prof), lambda n: 'counts_wait_flag' in n, num_calls)
    group = runner.group
    return (max(group.allgather_object(float(np.median(dispatch)))),
            max(group.allgather_object(float(np.median(bare)))), min(group.allgather_object(early)))
