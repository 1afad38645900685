"""A small NCCL communicator over `cupy.cuda.nccl`, bootstrapped through the host process group.

Rank 0 makes a unique id, the `ProcessGroup` broadcasts it, every rank creates its communicator on the current CUDA
device. The collectives take torch tensors or CuPy arrays (raw pointers through `interop.tensor_info`, so bfloat16 and
float8 tensors work without a CuPy dtype) and run on a CuPy stream, by default the current stream of the send buffer
(torch's current stream for torch tensors). Pure data movement (all-to-all, all-gather) counts bytes, so any dtype
works; reductions map the dtype to an NCCL type.

Used for the scale-out transport and for the NCCL reference paths in `deepep_cupy.utils.refs`; never needed by the
NVLink fast path.
"""

import sys
import threading
from collections.abc import Sequence
from typing import Any, Optional

from . import interop
from .group import ProcessGroup


def _nccl():
    from .preflight import nccl
    return nccl()      # SetupError naming the package when libnccl is missing


def _nccl_dtype(dtype: str, name: str) -> int:
    """The NCCL data type for a canonical dtype name; `TypeError` naming `name` when NCCL cannot reduce it."""
    nccl = _nccl()
    table = {
        'float32': 'NCCL_FLOAT32', 'float16': 'NCCL_FLOAT16', 'float64': 'NCCL_FLOAT64', 'bfloat16': 'NCCL_BFLOAT16',
        'int32': 'NCCL_INT32', 'int64': 'NCCL_INT64', 'int8': 'NCCL_INT8', 'uint8': 'NCCL_UINT8',
        'uint32': 'NCCL_UINT32', 'uint64': 'NCCL_UINT64',
    }
    value = getattr(nccl, table.get(dtype, ''), None)
    if value is None:
        raise TypeError(f'{name}: NCCL cannot reduce dtype {dtype} (with this CuPy build)')
    return value


def _nccl_op(op: str) -> int:
    nccl = _nccl()
    ops = {'sum': nccl.NCCL_SUM, 'prod': nccl.NCCL_PROD, 'max': nccl.NCCL_MAX, 'min': nccl.NCCL_MIN,
           'avg': nccl.NCCL_AVG}
    if op not in ops:
        raise ValueError(f'op must be one of {sorted(ops)}, got {op!r}')
    return ops[op]


def _device_info(x: Any, name: str) -> interop.TensorInfo:
    info = interop.tensor_info(x, name)
    if info.device < 0:
        raise ValueError(f'{name} must be on a CUDA device, got a host array')
    if not info.is_contiguous():
        raise ValueError(f'{name} must be contiguous, got shape {info.shape} with strides {info.strides}')
    return info


def _row_bytes(info: interop.TensorInfo) -> int:
    if not info.shape:
        raise ValueError('all_to_all_single needs arrays with at least one dimension')
    num_row_elems = 1
    for s in info.shape[1:]:
        num_row_elems *= s
    return num_row_elems * info.itemsize


ABORT_WAIT_SECS = 20.0


class AbortThread:
    """`comm.abort()` (`ncclCommAbort`) in a daemon thread, started at once; `wait` joins it, bounded.

    NCCL may hold an abort up while its kernels are in flight: on 1xH100 over NCCL sockets, a rank whose peer had
    already aborted and closed its sockets blocked inside `ncclCommAbort`, and a rank whose rail peer died during a
    CUDA-graph replay waited there the whole 20 s bound. So a failure path reports its error without waiting for
    the abort, and waits for it only where it must: before freeing memory NCCL's kernels may still use.

    Args:
        comm: the communicator (anything with `abort()`).
        what: how warnings name it.
        lock: held around the abort when given (acquired with a 10 s bound: the holder of an enqueue finishes it
            first; past that the abort goes ahead, better than a hang).
    """

    def __init__(self, comm: Any, what: str, lock: Optional[threading.Lock] = None):
        self.what, self.failure = what, None
        self.thread = threading.Thread(target=self._run, args=(comm, lock), name='deepep_cupy-nccl-abort',
                                       daemon=True)
        self.thread.start()

    def _run(self, comm: Any, lock: Optional[threading.Lock]) -> None:
        locked = lock.acquire(timeout=10.0) if lock is not None else False
        try:
            comm.abort()
        except Exception as e:  # noqa: BLE001 (reported by wait: the abort is the failure path already)
            self.failure = e
        finally:
            if locked:
                lock.release()

    def wait(self, limit: float = ABORT_WAIT_SECS) -> bool:
        """Join the abort for at most `limit` seconds; whether it returned (a warning on stderr when it did not, or
        failed: the communicator is then left to the process's exit)."""
        self.thread.join(limit)
        if self.thread.is_alive():
            print(f'deepep_cupy: ncclCommAbort of {self.what} did not return within {limit:.0f} s; left to the '
                  f'process exit', file=sys.stderr, flush=True)
            return False
        if self.failure is not None:
            print(f'deepep_cupy: ncclCommAbort of {self.what} failed: {self.failure}', file=sys.stderr, flush=True)
            self.failure = None
        return True


def abort_bounded(comm: Any, what: str, limit: float = ABORT_WAIT_SECS) -> bool:
    """`comm.abort()` (`ncclCommAbort`) from a helper thread, waited for at most `limit` seconds; returns whether it
    returned. The timeout path must not hang where NCCL does (`AbortThread`). Past the bound the communicator is left
    to the process's exit (a warning on stderr says so), and the caller goes on failing cleanly."""
    return AbortThread(comm, what).wait(limit)


def exchange_unique_id(group: ProcessGroup) -> Any:
    """Make an NCCL unique id on rank 0 and broadcast it to every rank of `group` (host collective, no GPU needed).

    Args:
        group: the host process group; every rank must call this.

    Returns:
        the 128-byte id in the form `cupy.cuda.nccl.NcclCommunicator` accepts (`bytes` since CuPy 14, a tuple of
        128 ints before), identical on every rank.
    """
    uid = _nccl().get_unique_id() if group.rank == 0 else None
    return group.broadcast_object(uid, root=0)


class NcclComm:
    """An NCCL communicator of one process per GPU, with collectives on torch tensors or CuPy arrays.

    Attributes:
        rank: this process's rank (same as in the process group it was made from).
        size: number of ranks.
        comm: the `cupy.cuda.nccl.NcclCommunicator`, or None after `destroy()`.
    """

    def __init__(self, comm, rank: int, size: int):
        self.comm = comm
        self.rank = rank
        self.size = size

    def _stream_ptr(self, stream, like: Any) -> int:
        if self.comm is None:
            raise RuntimeError('this NcclComm was destroyed')
        return (stream if stream is not None else interop.current_stream(like)).ptr

    def all_to_all_single(self, recv: Any, send: Any, recv_splits: Optional[Sequence[int]] = None,
                          send_splits: Optional[Sequence[int]] = None, stream=None) -> None:
        """All-to-all of rows (dim 0): rows `[sum(send_splits[:r]), ...)` of `send` go to rank r, and rank r's rows
        land at `[sum(recv_splits[:r]), ...)` of `recv`. Grouped NCCL send/recv of bytes, so any dtype works.

        Args:
            recv: `[num_recv_rows, ...]`, contiguous CUDA array; rows of the same byte size as `send`'s.
            send: `[num_send_rows, ...]`, contiguous CUDA array.
            recv_splits: rows from each rank (`size` ints); None splits `recv` evenly.
            send_splits: rows to each rank (`size` ints); None splits `send` evenly.
            stream: a CuPy stream; default `interop.current_stream(send)`.
        """
        send_info, recv_info = _device_info(send, 'send'), _device_info(recv, 'recv')
        row_bytes = _row_bytes(send_info)
        if _row_bytes(recv_info) != row_bytes:
            raise ValueError(f'recv rows ({_row_bytes(recv_info)} bytes) must match send rows ({row_bytes} bytes)')
        send_splits = self._check_splits(send_splits, send_info.shape[0], 'send_splits')
        recv_splits = self._check_splits(recv_splits, recv_info.shape[0], 'recv_splits')
        stream_ptr = self._stream_ptr(stream, send)
        nccl = _nccl()
        send_offset = recv_offset = 0
        nccl.groupStart()
        try:
            for peer in range(self.size):
                num_send_bytes, num_recv_bytes = send_splits[peer] * row_bytes, recv_splits[peer] * row_bytes
                if num_send_bytes > 0:
                    self.comm.send(send_info.ptr + send_offset, num_send_bytes, nccl.NCCL_UINT8, peer, stream_ptr)
                if num_recv_bytes > 0:
                    self.comm.recv(recv_info.ptr + recv_offset, num_recv_bytes, nccl.NCCL_UINT8, peer, stream_ptr)
                send_offset += num_send_bytes
                recv_offset += num_recv_bytes
        finally:
            nccl.groupEnd()

    def _check_splits(self, splits: Optional[Sequence[int]], num_rows: int, name: str) -> list:
        if splits is None:
            if num_rows % self.size != 0:
                raise ValueError(f'{name}=None needs dim 0 ({num_rows}) divisible by the group size ({self.size})')
            return [num_rows // self.size] * self.size
        splits = [int(s) for s in splits]
        if len(splits) != self.size or any(s < 0 for s in splits) or sum(splits) != num_rows:
            raise ValueError(f'{name} must be {self.size} non-negative row counts summing to {num_rows}, '
                             f'got {splits}')
        return splits

    def all_gather(self, recv: Any, send: Any, stream=None) -> None:
        """Gather every rank's `send` into `recv` in rank order (bytes, any dtype).

        Args:
            recv: `[size * n, ...]` (any shape of `size` times `send`'s bytes), contiguous CUDA array.
            send: contiguous CUDA array of n elements.
            stream: a CuPy stream; default `interop.current_stream(send)`.
        """
        send_info, recv_info = _device_info(send, 'send'), _device_info(recv, 'recv')
        if recv_info.nbytes != self.size * send_info.nbytes:
            raise ValueError(f'recv must hold {self.size} x {send_info.nbytes} bytes, got {recv_info.nbytes}')
        self.comm.allGather(send_info.ptr, recv_info.ptr, send_info.nbytes, _nccl().NCCL_UINT8,
                            self._stream_ptr(stream, send))

    def all_reduce(self, recv: Any, send: Any, op: str = 'sum', stream=None) -> None:
        """Element-wise reduction of every rank's `send` into `recv` (may be the same array).

        Args:
            recv: contiguous CUDA array, same dtype and size as `send`.
            send: contiguous CUDA array.
            op: `'sum'`, `'prod'`, `'max'`, `'min'` or `'avg'`.
            stream: a CuPy stream; default `interop.current_stream(send)`.
        """
        send_info, recv_info = _device_info(send, 'send'), _device_info(recv, 'recv')
        if recv_info.dtype != send_info.dtype or recv_info.numel != send_info.numel:
            raise ValueError(f'recv ({recv_info.dtype}, {recv_info.numel} elements) must match send '
                             f'({send_info.dtype}, {send_info.numel} elements)')
        self.comm.allReduce(send_info.ptr, recv_info.ptr, send_info.numel, _nccl_dtype(send_info.dtype, 'send'),
                            _nccl_op(op), self._stream_ptr(stream, send))

    def reduce_scatter(self, recv: Any, send: Any, op: str = 'sum', stream=None) -> None:
        """Reduce every rank's `send` element-wise and give rank r the r-th of `size` equal chunks.

        Args:
            recv: contiguous CUDA array of n elements.
            send: contiguous CUDA array of `size * n` elements, same dtype.
            op: `'sum'`, `'prod'`, `'max'`, `'min'` or `'avg'`.
            stream: a CuPy stream; default `interop.current_stream(send)`.
        """
        send_info, recv_info = _device_info(send, 'send'), _device_info(recv, 'recv')
        if recv_info.dtype != send_info.dtype or send_info.numel != self.size * recv_info.numel:
            raise ValueError(f'send ({send_info.dtype}, {send_info.numel} elements) must be {self.size} x recv '
                             f'({recv_info.dtype}, {recv_info.numel} elements)')
        self.comm.reduceScatter(send_info.ptr, recv_info.ptr, recv_info.numel, _nccl_dtype(send_info.dtype, 'send'),
                                _nccl_op(op), self._stream_ptr(stream, send))

    def destroy(self) -> None:
        """Free the communicator (idempotent). Every rank should call it, after its work on the streams is done."""
        if self.comm is not None:
            comm, self.comm = self.comm, None
            comm.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
        return False

    def __repr__(self):
        return f'NcclComm(rank={self.rank}, size={self.size}, alive={self.comm is not None})'


def create_nccl_comm(group: ProcessGroup) -> NcclComm:
    """Create an NCCL communicator over the ranks of `group` on the current CUDA device (collective).

    Args:
        group: the host process group; every rank must call this, each with its own GPU selected.

    Returns:
        `NcclComm` with the same rank numbering as `group`.
    """
    uid = exchange_unique_id(group)
    return NcclComm(_nccl().NcclCommunicator(group.size, uid, group.rank), group.rank, group.size)
