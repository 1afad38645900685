"""(min, max) of an integer array read back for host-side argument checks without a stream synchronisation:
`value_range_kernel` (kernels_cu/common/value_range.cuh) runs on the stream that made the array and writes
[seq, lo, hi] into host-mapped memory; the host polls the sequence number. Used by the CPU-sync dispatch (top-k
ids) and by engram_fetch (indices), which raise before their communication kernels run."""

from typing import Callable, Tuple

import numpy as np

from ..jit.launch import PTR, KernelSpec, Param
from .polling import SPIN_POLLS, wait_until

RANGE_THREADS = 1024     # kernels_cu/common/value_range.cuh kRangeThreads


def value_range_spec(family: str, ctype: str) -> KernelSpec:
    """The range kernel for `ctype` ('int' or 'long long': the name expression is parsed at global scope, where
    the kernels' fixed-width typedefs are not visible) as instantiated by `family`'s .cu file."""
    return KernelSpec(family, f'deepep::value_range_kernel<{ctype}>', (
        Param('values', PTR), Param('num_values', np.int64), Param('host_out', PTR), Param('seq', np.int64)))


class HostRange:
    """One [seq, lo, hi] record in a buffer's host-mapped memory (byte `offset`) and the polling side."""

    def __init__(self, host_mapped, offset: int):
        self.values = host_mapped.view('int64', 3, offset)
        self.address = host_mapped.ptr + offset
        self.seq = 0
        self._bound = {}                # kernel -> (bound launch, word indices of values, num_values, seq)
        self._pending = (0, 0.0, '')    # (seq, timeout_secs, what) of the last start

    def start(self, kernel, ptr: int, num_values: int, stream, timeout_secs: float,
              what: str) -> Callable[[], Tuple[int, int]]:
        """Launch the range kernel over `num_values` values at `ptr` on `stream`; returns a function that waits
        for the result (TimeoutError naming `what` after `timeout_secs`) and returns (lo, hi)."""
        if num_values == 0:
            return _empty_range
        self.seq = seq = self.seq % 0x7FFFFFFF + 1
        self.values[0] = 0
        bound = self._bound.get(kernel)
        if bound is None and hasattr(kernel, 'bind'):
            b = kernel.bind(1, RANGE_THREADS, values=0, num_values=0, host_out=self.address, seq=0)
            bound = self._bound[kernel] = (b, b.index('values'), b.index('num_values'), b.index('seq'))
        if bound is not None:       # a bound launch: three arguments patched (launched on every dispatch)
            b, i_values, i_num, i_seq = bound
            b.u64[i_values], b.i64[i_num], b.i64[i_seq] = ptr, num_values, seq
            b(stream)
        else:
            kernel.launch(1, RANGE_THREADS, stream=stream, values=ptr, num_values=num_values,
                          host_out=self.address, seq=seq)
        self._pending = (seq, timeout_secs, what)
        return self.wait

    def wait(self) -> Tuple[int, int]:
        """Wait for the last started check; (lo, hi)."""
        seq, timeout_secs, what = self._pending
        values = self.values
        polls = SPIN_POLLS
        while values[0] != seq and polls:       # the common case: the record lands within microseconds
            polls -= 1
        if not polls:
            def timed_out():
                raise TimeoutError(f'the range check of {what} did not finish within {timeout_secs:g} s '
                                   f'(is earlier work on the current stream hung?)')
            wait_until(lambda: int(values[0]) == seq, timeout_secs, timed_out)
        return int(values[1]), int(values[2])


def _empty_range() -> Tuple[int, int]:
    return 0, 0
