"""Launcher for the peer-copy floor kernel (`kernels_cu/peer_copy.cu`): copies exactly the bytes that must cross to
each peer into the peers' symmetric buffers and waits until every peer's bytes have arrived. Benchmarks
(`perf/ep_bench.py`) time it next to dispatch and combine as the floor no EP kernel can beat.
"""

from typing import Sequence

import numpy as np

from ..jit.launch import PTR, KernelSpec, Param, load_kernels
from ..runtime import workspace

# Symmetric workspace bytes [CTRL_OFFSET, CTRL_OFFSET + CTRL_BYTES) belong to this kernel (see kernels_cu/peer_copy.cu).
CTRL_OFFSET, CTRL_BYTES = workspace.PEER_COPY
THREADS = 512           # kPeerCopyThreads
VECTOR_BYTES = 16       # every per-peer byte count, offset and stride is a multiple of this


def peer_copy_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('peer_copy', f'deepep::peer_copy_kernel<{num_ranks}>', (
        Param('src', PTR), Param('send_bytes', PTR), Param('peer_bases', PTR), Param('rank', np.int32),
        Param('recv_offset', np.uint64), Param('recv_stride', np.uint64), Param('error_record', PTR),
        Param('timeout_ns', np.uint64)))


def all_specs(num_ranks: int):
    """Every specialisation of the family a symmetric buffer of `num_ranks` ranks may request."""
    return [peer_copy_spec(num_ranks)]


def shipped_specs(max_ranks: int):
    """Family name → every specialisation for 1 to `max_ranks` ranks."""
    return {'peer_copy': [peer_copy_spec(n) for n in range(1, max_ranks + 1)]}


class PeerCopy:
    """The peer-copy kernel bound to one symmetric buffer.

    Args:
        sym: `SymmetricMemory` of the scale-up domain (destination buffers and control words).
        error_record_ptr: host-mapped error record the kernel fills on a timeout (the owning buffer's).
        timeout_ns: bound of the final wait for the peers' completion flags.
        min_recv_offset: lowest destination offset allowed (default: past the 2 MiB workspace).
    """

    def __init__(self, sym, error_record_ptr: int, timeout_ns: int, min_recv_offset: int = 2 * 1024 * 1024):
        self.sym = sym
        self.error_record_ptr = int(error_record_ptr)
        self.timeout_ns = int(timeout_ns)
        self.min_recv_offset = int(min_recv_offset)
        self.kernel = load_kernels(all_specs(sym.num_peers))[peer_copy_spec(sym.num_peers).name]

    @classmethod
    def from_buffer(cls, buf) -> 'PeerCopy':
        """The peer copy over a deepep_cupy buffer's symmetric memory, writing past its workspace."""
        return cls(buf.sym, buf.host_mapped.ptr, buf.timeout_ns, min_recv_offset=buf.data_offset)

    def prepare(self, src, send_bytes: Sequence[int], recv_offset: int, recv_stride: int, num_sms: int):
        """Check a copy once and return `launch(stream)` for timing loops (no host work or transfer per launch).

        Args:
            src: contiguous device array (torch tensor or CuPy array) holding the chunks for the peers back to back,
                in peer order, this rank's own chunk left out; at least `sum(send_bytes without this rank)` bytes.
            send_bytes: bytes for each rank of the domain (this rank's entry is ignored), multiples of 16.
            recv_offset: destination byte offset of the region in every peer's buffer (multiple of 16).
            recv_stride: bytes reserved per source rank there (multiple of 16): this rank writes at
                `recv_offset + rank * recv_stride`.
            num_sms: blocks of the grid (one per SM).

        Returns:
            `launch(stream)`, which enqueues the copy on a `cupy.cuda.Stream`-like stream.
        """
        import cupy

        from ..runtime import interop
        num_ranks, rank = self.sym.num_peers, self.sym.local_idx
        send_bytes = [int(b) for b in send_bytes]
        if len(send_bytes) != num_ranks or any(b < 0 or b % VECTOR_BYTES for b in send_bytes):
            raise ValueError(f'send_bytes must be {num_ranks} non-negative multiples of {VECTOR_BYTES}, '
                             f'got {send_bytes}')
        cross = [0 if p == rank else b for p, b in enumerate(send_bytes)]
        info = interop.tensor_info(src, 'src')
        if info.device < 0 or not info.is_contiguous() or info.ptr % VECTOR_BYTES:
            raise ValueError('src must be a contiguous, 16-byte aligned device array')
        if info.nbytes < sum(cross):
            raise ValueError(f'src holds {info.nbytes} bytes, the copy needs {sum(cross)}')
        if recv_offset % VECTOR_BYTES or recv_stride % VECTOR_BYTES:
            raise ValueError(f'recv_offset ({recv_offset}) and recv_stride ({recv_stride}) must be multiples of 16')
        if max(cross) > recv_stride:
            raise ValueError(f'recv_stride={recv_stride} is smaller than the largest chunk ({max(cross)} bytes)')
        if recv_offset < self.min_recv_offset or recv_offset + num_ranks * recv_stride > self.sym.num_bytes:
            raise ValueError(f'destination [{recv_offset}, {recv_offset + num_ranks * recv_stride}) must lie in '
                             f'[{self.min_recv_offset}, {self.sym.num_bytes}) of the symmetric buffer')
        if not isinstance(num_sms, int) or num_sms < 1:
            raise ValueError(f'num_sms must be a positive int, got {num_sms!r}')
        send_bytes_dev = cupy.asarray(np.array(cross, dtype=np.int64))
        launch = self.kernel.prepare(num_sms, THREADS, src=src, send_bytes=send_bytes_dev,
                                     peer_bases=self.sym.peer_bases_ptr, rank=rank, recv_offset=recv_offset,
                                     recv_stride=recv_stride, error_record=self.error_record_ptr,
                                     timeout_ns=self.timeout_ns)

        def run(stream):
            launch(stream)
        run.keep_alive = (src, send_bytes_dev)   # the launch holds raw pointers to both
        return run
