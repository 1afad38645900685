"""BufferAllocator rank program, plus the helpers the engram and load-balancing rank programs share (buffer
construction, byte-size parsing, the peer-copy floor and NCCL all-to-all baselines).

    mpirun -np N python -m deepep_cupy.tests.allocation

Plans torch and CuPy tensors of odd sizes and dtypes, materialises them in a buffer's load-balancing region and
checks: every offset is 2 MiB aligned and identical on every rank, every tensor is a view of the symmetric buffer at
its planned offset, and a rank reads each peer's tensors (through the IPC mapping) with the values that peer wrote.
Then the misuse cases: a plan that differs between ranks or does not fit raises ValueError on every rank, a plan is
materialised only once.
"""

import sys
from typing import List, Optional

import numpy as np

from ..runtime import preflight
from . import cli

try:
    import torch
except ImportError as e:  # `--help` works without torch; a run names the extra that brings it
    preflight.exit_if_main(e, __name__, cli.allocation_parser)
    raise

from .. import BufferBase, ElasticBuffer
from ..buffers.allocator import BufferAllocator, Placeholder, get_num_allocation_alignment
from ..runtime import interop
from ..runtime.group import get_group
from ..utils.envs import init_dist
from ..utils.testing import bench
from .cli import parse_num_bytes  # noqa: F401  (re-exported)
from .common import Failure, check, expect_error, log  # noqa: F401  (re-exported for engram/reduce_grads)


def make_buffer(group, num_bytes: int, num_gpu_timeout_secs: float = 100, **kwargs):
    """The buffer of the engram / load-balancing rank programs: an `ElasticBuffer`. `num_bytes` is rounded up to
    2 MiB."""
    alignment = get_num_allocation_alignment()
    num_bytes = max(alignment, (num_bytes + alignment - 1) // alignment * alignment)
    return ElasticBuffer(group=group, num_bytes=num_bytes, num_gpu_timeout_secs=num_gpu_timeout_secs,
                         explicitly_destroy=True, **kwargs)


def ranks_share_gpu(buf) -> bool:
    return buf.topology.num_ranks_per_gpu() > 1


def peer_copy_floor(group, send_bytes: List[int], num_sms: int) -> Optional[float]:
    """Seconds per call of the peer-copy kernel moving `send_bytes[p]` bytes from this rank to each peer p (the
    floor any NVLink kernel moving the same bytes is compared with), or None when no rank sends anything."""
    import cupy

    from ..features.peer_copy import PeerCopy
    me = group.rank
    cross = [0 if p == me else (b + 15) // 16 * 16 for p, b in enumerate(send_bytes)]
    stride = max(group.allgather_object(max(cross)))
    if stride == 0:
        return None
    floor_buf = BufferBase(group=group, num_bytes=(group.size * stride + (2 << 20) - 1) // (2 << 20) * (2 << 20),
                           explicitly_destroy=True)
    try:
        src = cupy.zeros(max(16, sum(cross)), dtype=np.uint8)
        run = PeerCopy.from_buffer(floor_buf).prepare(src, cross, floor_buf.data_offset, stride, num_sms)
        t = bench(lambda: run(interop.current_stream())).avg
        floor_buf.synchronize()
    finally:
        floor_buf.destroy()
    return t


def nccl_all_to_all(group, send_bytes: List[int], recv_bytes: List[int]) -> float:
    """Seconds per NCCL all-to-all moving the same bytes (one rank per GPU only)."""
    import cupy

    from ..runtime.nccl import create_nccl_comm
    comm = create_nccl_comm(group)
    try:
        send = cupy.zeros(max(1, sum(send_bytes)), dtype=np.uint8)[:sum(send_bytes)]
        recv = cupy.zeros(max(1, sum(recv_bytes)), dtype=np.uint8)[:sum(recv_bytes)]
        t = bench(lambda: comm.all_to_all_single(recv, send, recv_splits=recv_bytes, send_splits=send_bytes,
                                                 stream=interop.current_stream())).avg
        cupy.cuda.runtime.deviceSynchronize()
    finally:
        comm.destroy()
    return t


# ---- the allocation test ------------------------------------------------------------------------------------------

def plan_tensors(plan: BufferAllocator):
    """A plan with torch and CuPy tensors of odd sizes and several dtypes (identical on every rank)."""
    return [plan.allocate((3, 5), torch.float32), plan.allocate((0,), torch.bfloat16),
            plan.allocate((7, 3, 129), torch.bfloat16), plan.allocate(1000, torch.int8),
            plan.allocate((2, 3), 'float32'), plan.allocate((4097,), torch.float8_e4m3fn),
            plan.allocate((65, 64), 'bfloat16'), plan.allocate((3,), torch.int64)]


def _as_bytes(t) -> np.ndarray:
    if isinstance(t, Placeholder):
        t = t.array
    if interop.is_torch(t):
        return t.contiguous().view(torch.uint8).view(-1).cpu().numpy()
    return t.view(np.uint8).ravel().get()


def _fill(t, rank: int, idx: int) -> None:
    """Bytes `(rank * 37 + idx * 11 + position) % 251` into a tensor."""
    arr = t.array if isinstance(t, Placeholder) else t
    nbytes = _as_bytes(arr).size
    pattern = ((np.arange(nbytes) + rank * 37 + idx * 11) % 251).astype(np.uint8)
    if interop.is_torch(arr):
        arr.view(torch.uint8).view(-1).copy_(torch.from_numpy(pattern).to(arr.device))
    else:
        import cupy
        arr.view(np.uint8).ravel()[:] = cupy.asarray(pattern)


def test_plan(group, timeout: float) -> List[str]:
    import cupy
    lines = []
    plan = BufferAllocator()
    tensors = plan_tensors(plan)
    check(all(a.offset % get_num_allocation_alignment() == 0 for a in plan.allocations), 'offsets are 2 MiB aligned')
    check(all(t.device.type == 'meta' for t in tensors if interop.is_torch(t)), 'torch placeholders are meta tensors')
    buf = make_buffer(group, plan.num_bytes, num_gpu_timeout_secs=timeout)
    try:
        out = buf.lb_set_plan(plan)
        check(len(out) == len(tensors), 'lb_set_plan returns every planned tensor')
        base = buf.sym.base + buf.data_offset
        for k, (t, alloc) in enumerate(zip(tensors, plan.allocations)):
            arr = t.array if isinstance(t, Placeholder) else t
            info = interop.tensor_info(arr)
            check(info.device == buf.device, f'tensor {k} lives on this GPU')
            check(tuple(info.shape) == alloc.shape, f'tensor {k} shape {info.shape} != planned {alloc.shape}')
            if alloc.num_bytes:
                check(info.ptr == base + alloc.offset,
                      f'tensor {k} at offset {info.ptr - base}, planned {alloc.offset}')
        offsets = group.allgather_object([a.offset for a in plan.allocations])
        check(all(o == offsets[0] for o in offsets), 'offsets are identical on every rank')
        for k, t in enumerate(tensors):
            _fill(t, group.rank, k)
        cupy.cuda.runtime.deviceSynchronize()
        buf.barrier(with_cpu_sync=True)
        # Read every peer's copy through its IPC mapping: the same offset names the same tensor everywhere.
        for p in range(buf.num_scaleup_ranks):
            for k, alloc in enumerate(plan.allocations):
                if not alloc.num_bytes:
                    continue
                # device_id: the peer's memory is mapped into this rank's context (IPC), whichever GPU holds it.
                mem = cupy.cuda.UnownedMemory(buf.sym.peer_ptr(p, buf.data_offset + alloc.offset), alloc.num_bytes,
                                              buf, buf.device)
                got = cupy.ndarray((alloc.num_bytes,), np.uint8, cupy.cuda.MemoryPointer(mem, 0)).get()
                want = ((np.arange(alloc.num_bytes) + buf.sym.domain_ranks[p] * 37 + k * 11) % 251).astype(np.uint8)
                check(np.array_equal(got, want), f'rank {group.rank} reads tensor {k} of rank {p}: wrong bytes')
        lines.append(f'[plan] {len(tensors)} tensors in {plan.num_bytes >> 20} MiB: aligned, symmetric, peers read '
                     f'each other\'s values: OK')

        tried = []
        expect_error(tried, 'materialize twice', RuntimeError, lambda: plan.materialize(buf.lb_get_storage()))
        expect_error(tried, 'allocate after materialize', RuntimeError, lambda: plan.allocate(4, torch.float32))
        big = BufferAllocator()
        big.allocate((buf.num_bytes + 1,), torch.uint8)
        expect_error(tried, 'plan larger than the buffer', ValueError, lambda: buf.lb_set_plan(big))
        odd = BufferAllocator()
        odd.allocate((group.rank + 1, 4), torch.float32)
        if group.size > 1:
            expect_error(tried, 'plans differ between ranks', ValueError, lambda: buf.lb_set_plan(odd))
        storage = buf.lb_set_plan(4 << 20) if buf.num_bytes >= 4 << 20 else buf.lb_set_plan(buf.num_bytes)
        check(interop.tensor_info(storage).ptr == base, 'lb_set_plan(num_bytes) returns the region')
        lines.append(f'[errors] {len(tried)} misuses raised on every rank:')
        lines += [f'    {t}' for t in tried]
    finally:
        buf.destroy()
    return lines


def main(argv=None) -> int:
    parser = cli.allocation_parser()
    args = parser.parse_args(argv)
    preflight.check_cuda()
    rank, num_ranks, _ = init_dist()
    group = get_group()  # host group: MPI under mpirun, else the torch world init_dist joined
    ok = True
    try:
        for line in test_plan(group, args.num_gpu_timeout_secs):
            log(group, line)
    except Failure as e:
        print(f'[rank {rank}] FAILED: {e}', flush=True)
        ok = False
    ok = all(group.allgather_object(ok))
    log(group, 'allocation test: PASSED' if ok else 'allocation test: FAILED')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
