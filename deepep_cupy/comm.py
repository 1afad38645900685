"""Communication helpers of DeepEP V2.5's `deep_ep.comm` (and V2.0's `deep_ep.utils.comm`, which
`deepep_cupy.utils.comm` re-exports): NCCL communicator handles, the GPU barrier and communication stream of a buffer,
the domain sizes of a group or a buffer.

deepep_cupy needs NCCL only between scale-up domains; inside one it talks over CUDA IPC. `get_nccl_comm_handle`
therefore reuses torch's communicator when the group has one, else creates one of ours (`runtime.nccl`) over the
group's host collectives.
"""

import os
from typing import Any, Optional, Tuple

from .runtime import topology
from .runtime.group import ProcessGroup, get_group

__all__ = ['NCCLCommHandle', 'get_nccl_comm_handle', 'destroy_all_managed_nccl_comm', 'barrier', 'get_comm_stream',
           'get_physical_domain_size', 'get_logical_domain_size']


class NCCLCommHandle:
    """A raw NCCL communicator, owned (destroyed with this handle) when deepep_cupy created it.

    Attributes:
        nccl_comm: the raw `ncclComm_t` as an int, or our `NcclComm` object when `managed`.
        managed: whether this handle created the communicator and destroys it when dropped.
    """

    def __init__(self, nccl_comm: Any, managed: bool):
        self.nccl_comm = nccl_comm
        self.managed = managed

    def __del__(self):
        if self.managed and hasattr(self.nccl_comm, 'destroy'):
            try:
                self.nccl_comm.destroy()
            except Exception:  # noqa: BLE001 (interpreter shutdown: the library may be gone)
                pass

    def get(self) -> int:
        """The raw `ncclComm_t` value."""
        comm = getattr(self.nccl_comm, 'comm', None)
        if comm is not None:
            return int(comm.ptr)
        return int(self.nccl_comm)


_storage = {}


def get_nccl_comm_handle(group, force_new_comm: bool = False) -> NCCLCommHandle:
    """The NCCL communicator of `group`, cached per group: torch's own when the group is an NCCL torch group (and
    `EP_REUSE_NCCL_COMM` is not 0), else a new one of ours over the group's ranks (a collective).

    Args:
        group: a torch.distributed ProcessGroup or a `ProcessGroup`.
        force_new_comm: always create a new, owned communicator and bypass the cache.
    """
    if not force_new_comm and group in _storage:
        return _storage[group]
    if not force_new_comm and not isinstance(group, ProcessGroup) and os.environ.get('EP_REUSE_NCCL_COMM', '1') != '0':
        try:
            import torch
            backend = group._get_backend(torch.device('cuda'))
        except Exception:  # noqa: BLE001 (no CUDA backend on this group: make our own communicator)
            backend = None
        if backend is not None and hasattr(backend, '_comm_ptr'):
            _storage[group] = NCCLCommHandle(backend._comm_ptr(), False)
            return _storage[group]
    from .runtime.nccl import create_nccl_comm
    handle = NCCLCommHandle(create_nccl_comm(get_group(group)), True)
    _storage[object() if force_new_comm else group] = handle
    return handle


def destroy_all_managed_nccl_comm() -> None:
    """Drop every cached communicator handle (the owned ones destroy their communicator)."""
    _storage.clear()


def barrier(buffer: Any, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True,
            context_idx: Optional[int] = None) -> None:
    """A GPU barrier over the ranks of `buffer` (V2.5's `deep_ep.comm.barrier`).

    Args:
        buffer: a deepep_cupy buffer.
        wait_comm_stream: run on the communication stream, ordered after the current stream and before what follows
            on it (else on the current stream).
        with_cpu_sync: the host waits too.
        sequential: DeepEP's flag for one-by-one signalling; passed on when the buffer takes it.
        context_idx: the communication context (group) of a buffer with several (`BucketBuffer`); None: its first.
            Buffers with one context take None or 0.
    """
    context_barrier = getattr(buffer, 'context_barrier', None)
    if context_barrier is not None:         # the V2.5 buffers: one barrier per context
        context_barrier(context_idx, wait_comm_stream, with_cpu_sync, sequential)
        return
    if context_idx not in (None, 0):
        raise ValueError(f'context_idx={context_idx}: deepep_cupy buffers have a single context')
    import inspect
    kwargs = {'use_comm_stream': wait_comm_stream, 'with_cpu_sync': with_cpu_sync}
    if 'sequential' in inspect.signature(buffer.barrier).parameters:
        kwargs['sequential'] = sequential
    buffer.barrier(**kwargs)


def get_comm_stream(buffer: Any):
    """The buffer's communication stream: a `torch.cuda.Stream` (external) when torch has CUDA, else the CuPy
    stream."""
    order = getattr(buffer, 'stream_order', None)      # settled: synchronous calls may have run on the caller's stream
    if order is not None:
        stream = order.settle()
    else:
        stream = buffer.comm_stream if hasattr(buffer, 'comm_stream') else buffer.get_comm_stream()
    try:
        import torch
    except ImportError:
        return stream
    if isinstance(stream, torch.cuda.Stream) or not torch.cuda.is_available():
        return stream
    from .runtime.interop import torch_stream
    return torch_stream(stream.ptr)


def get_physical_domain_size(group_or_buffer: Any) -> Tuple[int, int]:
    """`(num_scaleout, num_scaleup)` of the hardware, for a process group (a collective) or a buffer."""
    if hasattr(group_or_buffer, 'get_physical_domain_size'):
        return group_or_buffer.get_physical_domain_size()
    return topology.get_physical_domain_size(group_or_buffer)


def get_logical_domain_size(group_or_buffer: Any, allow_hybrid_mode: Optional[bool] = None) -> Tuple[int, int]:
    """`(num_scaleout, num_scaleup)` a buffer uses: the buffer's own, or for a group what a buffer with
    `allow_hybrid_mode` (default True) would use (a collective)."""
    if hasattr(group_or_buffer, 'get_logical_domain_size'):
        return group_or_buffer.get_logical_domain_size()
    return topology.get_logical_domain_size(group_or_buffer, True if allow_hybrid_mode is None else allow_hybrid_mode)
