"""HostRange without a GPU: the polling side of the value-range check (the kernel is replaced by a stub that writes
the host-mapped record, or by one that never does)."""

import numpy as np
import pytest

from deepep_cupy.jit import launch
from deepep_cupy.runtime.host_range import RANGE_THREADS, HostRange, value_range_spec


class FakeHostMapped:
    def __init__(self, num_bytes=16384):
        self.data = np.zeros(num_bytes, dtype=np.uint8)
        self.ptr = 0x7000_0000

    def view(self, dtype, count, offset=0):
        dtype = np.dtype(dtype)
        return self.data[offset:offset + count * dtype.itemsize].view(dtype)


class StubKernel:
    """Launched by parameter name like the real kernel; records the launch (arguments in declaration order) and,
    unless told not to, writes [seq, lo, hi] as value_range_kernel would."""

    def __init__(self, memory, values, offset, write=True):
        self.memory, self.values, self.offset, self.write, self.launches = memory, values, offset, write, []
        self.launch = launch.named_launcher(value_range_spec('ep_notify', 'long long'), self._launch)

    def _launch(self, grid, block, args, stream, shared_mem, cooperative):
        self.launches.append((grid, block, args, stream))
        ptr, num_values, address, seq = args
        if self.write:
            record = self.memory.view('int64', 3, self.offset)
            record[1], record[2] = int(self.values.min()), int(self.values.max())
            record[0] = seq


def test_start_and_wait_returns_the_range_and_advances_the_sequence():
    memory = FakeHostMapped()
    values = np.array([[3, -1, 7], [0, 12, 5]], dtype=np.int64)
    host_range = HostRange(memory, 8192)
    kernel = StubKernel(memory, values, 8192)
    assert host_range.start(kernel, 0x1000, values.size, 'stream', 1.0, 'test')() == (-1, 12)
    assert host_range.start(kernel, 0x1000, values.size, 'stream', 1.0, 'test')() == (-1, 12)
    (grid, block, args, stream), second = kernel.launches[0], kernel.launches[1]
    assert grid == 1 and block == RANGE_THREADS and stream == 'stream'
    assert args == (0x1000, values.size, memory.ptr + 8192, 1) and second[2][3] == 2


def test_empty_input_launches_nothing():
    memory = FakeHostMapped()
    kernel = StubKernel(memory, np.zeros(1, np.int64), 8192)
    assert HostRange(memory, 8192).start(kernel, 0, 0, None, 1.0, 'test')() == (0, 0)
    assert kernel.launches == []


def test_a_stale_record_is_not_taken_and_a_missing_one_times_out():
    memory = FakeHostMapped()
    host_range = HostRange(memory, 8192)
    record = memory.view('int64', 3, 8192)
    record[:] = (5, -7, 99)                 # a record from an earlier call with another sequence number
    host_range.seq = 5
    wait = host_range.start(StubKernel(memory, None, 8192, write=False), 0x1000, 4, None, 0.05, 'topk_idx')
    assert record[0] == 0                   # reset before the launch
    with pytest.raises(TimeoutError, match='range check of topk_idx'):
        wait()


def test_spec_names_parse_at_global_scope():
    # Fixed-width typedefs live inside namespace deepep; the name expression must use builtin types.
    assert value_range_spec('engram', 'int').name == 'deepep::value_range_kernel<int>'
    assert value_range_spec('ep_notify', 'long long').params[1].kind is np.int64
