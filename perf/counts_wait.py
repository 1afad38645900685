"""What the host's wait for a CPU-sync dispatch's receive counts costs beyond the GPU's notify (issue 11);
perf/ep_profile.py prints it beside its unprofiled host figures (`Runner.after_counts`: whether the counts were already
there when the host entered `EP._wait_host_counts`, and the time spent in it).

A round trip in the GPU's clock, no profiler (a profiled session aligns the host's and the GPU's clocks only to a few
µs, which is more than the figure). Before each call, a one-thread probe kernel on a side stream spins on the
host-mapped word the notify kernel writes last (the counts' sequence number); once it holds the call's number, the probe
spins on an ack word that the host writes the moment its wait returns. The probe's time between the two is the counts'
GPU-to-host visibility, the host's wait beyond it, and the ack's host-to-GPU visibility. The same round trip for a bare
signal (a one-thread kernel writing a host-mapped word that the host spins on, then acks) has everything but the
wait's own work: the dispatch's round trip over the bare one is what the wait costs beyond the notify. Only calls whose
host entered the wait before the counts came count (read at entry, no clock needed).
"""

import ctypes

import numpy as np

PROBE_SOURCE = r'''
__device__ __forceinline__ long long global_ns() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// out[0]: SM clocks from `word` == value to `ack` == ack_value; out[1], out[2]: SM clocks and globaltimer ns over the
// probe (their ratio converts out[0]); out[0] = -1 or -2: `word` or `ack` never came within timeout_ns.
extern "C" __global__ void counts_wait_probe(const int* word, int value, const int* ack, int ack_value,
                                             long long timeout_ns, long long* out) {
    const volatile int* w = word;
    const volatile int* a = ack;
    const long long g0 = global_ns(), c0 = clock64();
    long long seen, acked;
    for (;;) {
        const int v = *w;
        seen = clock64();
        if (v == value) break;
        if (global_ns() - g0 > timeout_ns) { out[0] = -1; return; }
    }
    for (;;) {
        const int v = *a;
        acked = clock64();
        if (v == ack_value) break;
        if (global_ns() - g0 > timeout_ns) { out[0] = -2; return; }
    }
    out[0] = acked - seen;
    out[1] = acked - c0;
    out[2] = global_ns() - g0;
}

extern "C" __global__ void counts_wait_flag(int* flag, int value) {
    __threadfence_system();
    *reinterpret_cast<volatile int*>(flag) = value;
}
'''
TIMEOUT_NS = 50_000_000


def round_trips_us(records, what: str):
    """µs of each probe record (out[0..2] of `counts_wait_probe`, one row per call), converted with the SM clock
    measured over all of them (the probes' clocks over their globaltimer ns); a record whose word or ack never came
    raises, naming `what`."""
    records = np.asarray(records, dtype=np.int64).reshape(-1, 3)
    if len(records) == 0:
        return []
    for i, (cycles, _, _) in enumerate(records):
        if cycles < 0:
            raise RuntimeError(f'counts wait: {what} call {i}: the probe never saw '
                               f'{"the host-mapped word" if cycles == -1 else "the host ack"} within '
                               f'{TIMEOUT_NS / 1e6:g} ms')
    ghz = records[:, 1].sum() / max(records[:, 2].sum(), 1)
    return list(records[:, 0] / ghz / 1e3)


def measure(runner, fn, ep, num_calls: int):
    """A dict for the CPU-sync dispatch `fn` of the EP feature `ep`, `num_calls` calls each from idle, then as many bare
    signals: `waited` (calls whose host entered the wait before the counts came), `round_trip` and `bare` (their
    median µs; nan where none waited), `beyond` (the difference; 0 when no call waited). Ranks: the largest figures,
    the fewest waits."""
    import cupy

    from deepep_cupy.runtime.interop import external_stream
    torch = runner.torch
    wait, host_record = ep._wait_host_counts, ep._host_record
    words = torch.zeros(4, dtype=torch.int32, pin_memory=True)    # flag, ack (pinned: mapped at their host address)
    flag_ptr, ack_ptr = words.data_ptr(), words.data_ptr() + 4
    flag, ack = (ctypes.c_int32 * 1).from_address(flag_ptr), (ctypes.c_int32 * 1).from_address(ack_ptr)
    module = cupy.RawModule(code=PROBE_SOURCE)
    probe, flag_kernel = module.get_function('counts_wait_probe'), module.get_function('counts_wait_flag')
    side = cupy.cuda.Stream(non_blocking=True)
    main = external_stream(torch.cuda.current_stream().cuda_stream)
    out = cupy.zeros((num_calls, 3), dtype=cupy.int64)
    waited, entered_first = [], []

    def acked_wait(seq, *a):
        entered_first.append(host_record[0] != seq)
        result = wait(seq, *a)
        ack[0] = seq
        return result

    def start_probe(i, word_ptr, value):
        ack[0] = 0
        probe((1,), (1,), (word_ptr, np.int32(value), ack_ptr, np.int32(value), np.int64(TIMEOUT_NS),
                           out[i:].data.ptr), stream=side)

    def dispatch(i):
        seq = ep._host_seq % 0x7FFFFFFF + 1       # (`EP._next_host_seq`: the number this call's notify writes)
        start_probe(i, ep.host_counts_ptr, seq)
        fn()
        if ep._host_seq != seq:
            raise RuntimeError(f'counts wait: the call used sequence number {ep._host_seq}, not {seq}')

    def bare(i):
        value = i + 1
        flag[0] = 0
        start_probe(i, flag_ptr, value)
        flag_kernel((1,), (1,), (flag_ptr, np.int32(value)), stream=main)
        entered_first.append(flag[0] != value)
        while flag[0] != value:
            pass
        ack[0] = value

    figures = {}
    try:
        ep._wait_host_counts = acked_wait
        for name, call in (('round_trip', dispatch), ('bare', bare)):
            entered_first.clear()
            for i in range(num_calls):
                runner.aligned()
                call(i)
            side.synchronize()
            runner.aligned()
            if len(entered_first) != num_calls:
                raise RuntimeError(f'counts wait: {len(entered_first)} waits in {num_calls} calls')
            first = [i for i, f in enumerate(entered_first) if f]
            trips = round_trips_us(out.get()[first], name)
            if name == 'round_trip':
                waited = first
            figures[name] = float(np.median(trips)) if trips else float('nan')
    finally:
        del ep._wait_host_counts
    group = runner.group

    def worst(v):
        return max(group.allgather_object(v))
    result = dict(waited=min(group.allgather_object(len(waited))), round_trip=worst(figures['round_trip']),
                  bare=worst(figures['bare']))
    result['beyond'] = worst(figures['round_trip'] - figures['bare'] if waited else 0.0)
    return result
