"""(min, max) of an integer array read back for host-side argument checks without a stream synchronisation:
`value_range_kernel` (kernels_cu/common/value_range.cuh) runs on the stream that made the array and writes
[seq, lo, hi] into host-mapped memory; the host polls the sequence number. Used by the CPU-sync dispatch (top-k
ids) and by engram_fetch (indices), which raise before their communication kernels run."""

import ctypes
import struct
from functools import partial
from typing import Callable, Tuple

import numpy as np

from ..jit.launch import PTR, KernelSpec, Param
from .polling import SPIN_POLLS, wait_until

RANGE_THREADS = 1024     # kernels_cu/common/value_range.cuh kRangeThreads
# value_range_kernel's parameters, one contiguous run of 8-byte words (checked when a launch is bound).
_RANGE_ARGS = struct.Struct('=QqQq')


def value_range_spec(family: str, ctype: str) -> KernelSpec:
    """The range kernel for `ctype` ('int' or 'long long': the name expression is parsed at global scope, where
    the kernels' fixed-width typedefs are not visible) as instantiated by `family`'s .cu file."""
    return KernelSpec(family, f'deepep::value_range_kernel<{ctype}>', (
        Param('values', PTR), Param('num_values', np.int64), Param('host_out', PTR), Param('seq', np.int64)))


class HostRange:
    """One [seq, lo, hi] record in a buffer's host-mapped memory (byte `offset`) and the polling side."""

    def __init__(self, host_mapped, offset: int):
        self.values = host_mapped.view('int64', 3, offset)
        # (the same three words through ctypes: reading one gives a Python int, where numpy makes a scalar object)
        self._record = (ctypes.c_int64 * 3).from_buffer(self.values)
        self.address = host_mapped.ptr + offset
        self.seq = 0
        self._bound = {}                # kernel -> (its bound launch, `(values, num_values, host_out, seq) ->` packing)
        self._pending = (0.0, '')       # (timeout_secs, what) of the last start (its seq: `seq`)

    def start(self, kernel, ptr: int, num_values: int, stream, timeout_secs: float,
              what: str) -> Callable[[], Tuple[int, int]]:
        """Launch the range kernel over `num_values` values at `ptr` on `stream`; returns a function that waits
        for the result (TimeoutError naming `what` after `timeout_secs`) and returns (lo, hi)."""
        if num_values == 0:
            return _empty_range
        self.seq = seq = self.seq % 0x7FFFFFFF + 1
        self._record[0] = 0
        bound = self._bound.get(kernel) or self._bind(kernel)
        if bound is not None:       # a bound launch: its four arguments packed at once (launched on every dispatch)
            b, pack = bound
            pack(ptr, num_values, self.address, seq)
            b(stream)
        else:
            kernel.launch(1, RANGE_THREADS, stream=stream, values=ptr, num_values=num_values,
                          host_out=self.address, seq=seq)
        self._pending = (timeout_secs, what)
        return self.wait

    def _bind(self, kernel):
        """`kernel`'s bound launch and the packing of its arguments (remembered), or None for a kernel without `bind`
        (launched by name)."""
        if not hasattr(kernel, 'bind'):
            return None
        b = kernel.bind(1, RANGE_THREADS, values=0, num_values=0, host_out=self.address, seq=0)
        i = b.index('values')
        assert (b.index('num_values'), b.index('host_out'), b.index('seq')) == (i + 1, i + 2, i + 3), \
            'value_range_kernel: its arguments are one run of 8-byte words'
        bound = self._bound[kernel] = (b, partial(_RANGE_ARGS.pack_into, b.data, 8 * i))
        return bound

    def wait(self) -> Tuple[int, int]:
        """Wait for the last started check; (lo, hi)."""
        record = self._record
        if record[0] != self.seq:       # (the common case: the record landed while the host did other work)
            self._poll()
        return record[1], record[2]

    def _poll(self) -> None:
        """Spin until the last started check's record lands (it does within microseconds), then wait with sleeps
        until `timeout_secs`."""
        seq, record = self.seq, self._record
        timeout_secs, what = self._pending
        polls = SPIN_POLLS
        while record[0] != seq and polls:
            polls -= 1
        if not polls:
            def timed_out():
                raise TimeoutError(f'the range check of {what} did not finish within {timeout_secs:g} s '
                                   f'(is earlier work on the current stream hung?)')
            wait_until(lambda: record[0] == seq, timeout_secs, timed_out)


def _empty_range() -> Tuple[int, int]:
    return 0, 0
