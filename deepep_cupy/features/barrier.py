"""The GPU barrier of a symmetric buffer (`kernels_cu/barrier.cu`) and its test kernels."""

import numpy as np

from ..jit.launch import PTR, KernelSpec, Param, load_kernels
from ..runtime import workspace

# Workspace regions of the barrier's epochs and of the test kernels' check slots (common/workspace.cuh).
SIGNAL_OFFSET = workspace.BARRIER.offset
TEST_CHECK_OFFSET = workspace.BARRIER_TEST.offset


def barrier_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('barrier', f'deepep::barrier_kernel<{num_ranks}>', (
        Param('peer_bases', PTR), Param('signal_offset', np.uint64), Param('rank', np.int32),
        Param('error_record', PTR), Param('timeout_ns', np.uint64)))


TEST_WRITE = KernelSpec('barrier', 'deepep::ring_test_write', (
    Param('peer_bases', PTR), Param('check_offset', np.uint64), Param('rank', np.int32), Param('num_ranks', np.int32),
    Param('value', np.uint32), Param('delay_ns', np.uint64)))
TEST_CHECK = KernelSpec('barrier', 'deepep::ring_test_check', (
    Param('peer_bases', PTR), Param('check_offset', np.uint64), Param('rank', np.int32), Param('num_ranks', np.int32),
    Param('value', np.uint32), Param('num_mismatches', PTR)))


def all_specs(num_ranks: int, with_tests: bool = True):
    """Every specialisation of the family a buffer of `num_ranks` scale-up ranks may request."""
    return [barrier_spec(num_ranks)] + ([TEST_WRITE, TEST_CHECK] if with_tests else [])


def shipped_specs(max_ranks: int):
    """Family name → every specialisation for 1 to `max_ranks` ranks."""
    return {'barrier': [barrier_spec(n) for n in range(1, max_ranks + 1)] + [TEST_WRITE, TEST_CHECK]}


class Barrier:
    """The GPU barrier of one symmetric buffer (epochs in the buffer's workspace; see kernels_cu/barrier.cu).

    Args:
        sym: the symmetric memory (`num_peers`, `local_idx`, `peer_bases_ptr`).
        signal_offset: workspace offset of the barrier's words (another one per communication context of a buffer
            mapped by several groups).
    """

    def __init__(self, sym, error_record_ptr: int, timeout_ns: int, with_tests: bool = False,
                 signal_offset: int = SIGNAL_OFFSET):
        self.sym = sym
        self.error_record_ptr = error_record_ptr
        self.timeout_ns = int(timeout_ns)
        kernels = load_kernels(all_specs(sym.num_peers, with_tests))
        self.kernel = kernels[barrier_spec(sym.num_peers).name]
        self.test_write = kernels.get(TEST_WRITE.name)
        self.test_check = kernels.get(TEST_CHECK.name)
        self._launch = self.kernel.prepare(1, 32, peer_bases=self.sym.peer_bases_ptr, signal_offset=signal_offset,
                                           rank=self.sym.local_idx, error_record=self.error_record_ptr,
                                           timeout_ns=self.timeout_ns)

    def __call__(self, stream):
        self._launch(stream)
