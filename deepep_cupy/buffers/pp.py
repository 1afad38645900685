"""`PPBuffer`: DeepEP V2.5's pipeline-parallel buffer (`deep_ep.buffers.pp`), the PP feature on a buffer of its own.

Sends and receives go between ring neighbours over NVLink inside a scale-up domain and, when the group forms several
domains (hybrid mode), over a link per cross-domain pair (NCCL, or the CUDA-IPC loopback on one host; upstream: RDMA);
the PP feature (`features/pp`, links.py) lays out the receive slots and launches the `send_impl` / `recv_impl` kernels.
"""

import weakref
from typing import Optional

from ..constants import BUFFER_ALIGNMENT
from ..features.pp.feature import PP
from ..features.pp.plan import PPLayout
from ..runtime.checks import check_int
from ..runtime.sizes import align
from .base import BufferBase, V25Methods

__all__ = ['PPBuffer']


class PPBuffer(V25Methods, BufferBase):
    """Symmetric storage for pipeline-parallel send / recv between ring neighbours.

    Args:
        group: torch.distributed ProcessGroup (or a deepep_cupy `ProcessGroup`); `comm`: an mpi4py communicator.
        num_max_tensor_bytes: most bytes one sent or received tensor may have.
        num_max_inflight_tensors: tensors a sender may be ahead of its receiver per directed pair (more `send`s wait
            on the GPU until the receiver takes the oldest).
        sl_idx: DeepEP's RDMA service level; accepted (between domains NCCL picks its own).
        num_gpu_timeout_secs: bound on GPU waits.
        explicitly_destroy: memory is released by `destroy()` (collective); else when garbage-collected.

    Attributes:
        storage: the receive slots, a uint8 tensor over this rank's data region (torch when torch is installed).
    """

    def __init__(self, group=None, num_max_tensor_bytes: int = 0, num_max_inflight_tensors: int = 1,
                 sl_idx: Optional[int] = None, num_gpu_timeout_secs: float = 100, explicitly_destroy: bool = False,
                 *, comm=None, device: Optional[int] = None, num_cpu_timeout_secs: float = 300):
        check_int('num_max_tensor_bytes', num_max_tensor_bytes, 1)
        check_int('num_max_inflight_tensors', num_max_inflight_tensors, 1)
        self.num_max_tensor_bytes = num_max_tensor_bytes
        self.num_max_inflight_tensors = num_max_inflight_tensors
        self.sl_idx = sl_idx
        self._pp: Optional[PP] = None
        num_bytes = align(PPLayout(num_max_tensor_bytes, num_max_inflight_tensors, 0).num_bytes, BUFFER_ALIGNMENT)
        super().__init__(group=group, comm=comm, num_bytes=num_bytes, num_cpu_timeout_secs=num_cpu_timeout_secs,
                         num_gpu_timeout_secs=num_gpu_timeout_secs, explicitly_destroy=explicitly_destroy,
                         device=device, config={'num_max_tensor_bytes': num_max_tensor_bytes,
                                                'num_max_inflight_tensors': num_max_inflight_tensors})
        try:
            self._pp = PP(weakref.proxy(self))
            self._pp.set_config(num_max_tensor_bytes, num_max_inflight_tensors)
        except BaseException:
            self.destroy()
            raise
        self._storage = None

    def _destroy_features(self) -> None:
        if self._pp is not None:
            self._pp.destroy()
        self._pp = None
        self._storage = None

    @property
    def storage(self):
        if self._destroyed:
            return None
        if self._storage is None:
            from ..runtime import interop
            view = self.sym.local_view(self.data_offset, self.num_bytes)
            try:
                self._storage = interop.to_torch(view)
            except ImportError:
                self._storage = view
        return self._storage

    def send(self, x, dst_rank_idx: int, num_sms: Optional[int] = None) -> None:
        """Send a tensor to a ring neighbour (its next `recv(.., src_rank_idx=this rank)` receives it).

        Args:
            x: contiguous tensor on this rank's GPU, 16-byte aligned, at most `num_max_tensor_bytes` bytes; it must
                not change until the send has run (the current stream waits for it).
            dst_rank_idx: the previous or the next rank of the ring.
            num_sms: blocks of the copy; None: every SM.
        """
        self._pp.send(x, dst_rank_idx, 0 if num_sms is None else num_sms)

    def recv(self, x, src_rank_idx: int, num_sms: Optional[int] = None) -> None:
        """Receive the next tensor a ring neighbour sent to this rank, into `x`.

        Args:
            x: contiguous output on this rank's GPU, 16-byte aligned, exactly as many bytes as the matching send.
            src_rank_idx: the previous or the next rank of the ring.
            num_sms: blocks of the copy; None: every SM.
        """
        self._pp.recv(x, src_rank_idx, 0 if num_sms is None else num_sms)
