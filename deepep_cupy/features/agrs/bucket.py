"""Bucket collectives (DeepEP V2.5 `BucketBuffer`): in-place all-gather, reduce-scatter and all-reduce on tensors in
a buffer's registered storage, per communication context (`kernels_cu/bucket.cu` for the protocol).

A context is one group of ranks inside the buffer's NVLink domain: a table of the ranks' allocation bases (the
buffer's own symmetric memory for its first group; `PeerMapping`s for the others), this rank's index, a slice of the
workspace for its control words (and the words of its `barrier()`) and the count of in-kernel barriers so far. Each
call is one cooperative launch; ranks pull what they need from the peers' storage, so nothing is staged.
"""

import math
from typing import Any, Dict, List

import numpy as np

from ...constants import NUM_MAX_SCALEUP_RANKS
from ...jit.launch import PTR, KernelSpec, Param, load_kernels
from ...runtime import workspace
from ...runtime.sizes import align

CTRL_OFFSET, CTRL_BYTES = workspace.BUCKET        # kBucketCtrlOffset / kBucketCtrlBytes
CONTEXT_BYTES = 1024                              # kBucketContextBytes
BARRIER_OFFSET = 512                              # kBucketBarrierOffset: the barrier kernel's words in a slice
MAX_CONTEXTS = CTRL_BYTES // CONTEXT_BYTES
THREADS = 512                                     # kBucketThreads
OPS = ('all_gather', 'reduce_scatter', 'all_reduce')
NUM_BARRIERS = {'all_gather': 2, 'reduce_scatter': 2, 'all_reduce': 3}
DEFAULT_GATHER_SMS = 32                           # blocks of an all-gather (DeepEP: copy engines, `num_sms` 0)
SM_READ_GBS, SM_WRITE_GBS = 180.0, 45.0


def kernel_spec(op: str, num_ranks: int) -> KernelSpec:
    return KernelSpec('bucket', f'deepep::bucket_{op}_impl<{num_ranks}>', (
        Param('peer_bases', PTR), Param('rank', np.int32), Param('ctrl_offset', np.uint64), Param('epoch', np.uint32),
        Param('offset', np.uint64), Param('num', np.int64), Param('src', PTR), Param('scale', np.float32),
        Param('error_record', PTR), Param('timeout_ns', np.uint64)))


def all_specs(num_ranks: int) -> List[KernelSpec]:
    """Every specialisation a context of `num_ranks` ranks may request."""
    return [kernel_spec(op, num_ranks) for op in OPS]


def shipped_specs(max_ranks: int = NUM_MAX_SCALEUP_RANKS) -> Dict[str, List[KernelSpec]]:
    """Family name -> every `KernelSpec` of this module, for contexts of 1 to `max_ranks` ranks."""
    return {'bucket': [s for n in range(1, max_ranks + 1) for s in all_specs(n)]}


def context_offset(index: int) -> int:
    """Workspace offset of context `index`'s control words."""
    if not 0 <= index < MAX_CONTEXTS:
        raise ValueError(f'a BucketBuffer supports at most {MAX_CONTEXTS} groups, got group index {index}')
    return CTRL_OFFSET + index * CONTEXT_BYTES


def theoretical_num_sms(op: str, num_rdma_ranks: int, num_nvl_ranks: int, nvlink_gbs: float, rdma_gbs: float,
                        num_device_sms: int) -> int:
    """DeepEP V2.5's `BucketBuffer.get_theoretical_num_sms` for a group of `num_rdma_ranks x num_nvl_ranks`:
    all-gather 0 (DeepEP: copy engines); reduce-scatter / all-reduce from the NVLink (or RDMA) bandwidth per
    destination and the SM read / write rates (180 / 45 GB/s). A group of one rank gets the NVLink formula with one
    rank (DeepEP raises there). At most the device's SMs."""
    if op == 'all_gather':
        return 0
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    r, n = num_rdma_ranks, num_nvl_ranks
    if op == 'reduce_scatter':
        if r > 1 and n > 1:
            dst = min(nvlink_gbs / n, rdma_gbs * r / (r - 1))
            sms = align(max(8, math.ceil(1.2 * max(2 * dst / SM_READ_GBS, 2 * dst / SM_WRITE_GBS))), 2)
        elif r > 1:
            algorithm = rdma_gbs * r / (r - 1)
            sms = align(max(6, math.ceil(max(algorithm / SM_READ_GBS, algorithm / r / SM_WRITE_GBS))), 2)
        else:
            dst = nvlink_gbs / n
            sms = align(max(6, math.ceil(max(dst / SM_READ_GBS, dst / SM_WRITE_GBS))), 2)
    else:
        if r > 1 and n > 1:
            dst = min(nvlink_gbs / n, rdma_gbs * r / (2 * (r - 1)))
            sms = align(max(6, math.ceil(max(3 * dst / SM_READ_GBS, 3 * dst / SM_WRITE_GBS))), 2)
        elif r > 1:
            sms = align(max(6, math.ceil(max(rdma_gbs / 2 / SM_READ_GBS, rdma_gbs / 2 / SM_WRITE_GBS))), 2)
        else:
            dst = nvlink_gbs / n
            sms = align(max(4, math.ceil(max(dst / SM_READ_GBS, dst / SM_WRITE_GBS))), 2)
    return min(sms, num_device_sms)


class BucketContext:
    """One communication context of a bucket buffer (see the module docstring).

    Args:
        index: position among the buffer's groups (selects the workspace slice).
        group: the caller's group object (a torch ProcessGroup or a `ProcessGroup`), as given.
        pg: its host `ProcessGroup`.
        peer_bases_ptr: device table of the ranks' allocation bases (uint64 `[size]`).
        local_idx: this rank's index in the group.
        physical: `(num_rdma_ranks, num_nvl_ranks)` of the group.
        mapping: the `PeerMapping` to release with the context (None for the buffer's own symmetric memory).
    """

    def __init__(self, index: int, group: Any, pg: Any, peer_bases_ptr: int, local_idx: int, physical,
                 mapping: Any = None):
        self.index, self.group, self.pg = index, group, pg
        self.num_ranks, self.rank_idx = pg.size, local_idx
        self.peer_bases_ptr = peer_bases_ptr
        self.ctrl_offset = context_offset(index)
        self.physical = tuple(physical)
        self.mapping = mapping
        self.num_barriers = 0                       # in-kernel barriers so far (identical on every rank)
        loaded = load_kernels(all_specs(self.num_ranks))
        self.kernels = {op: loaded[kernel_spec(op, self.num_ranks).name] for op in OPS}
        self.barrier = None                         # the context's GPU barrier (set by the buffer)

    @property
    def local_idx(self) -> int:
        return self.rank_idx

    @property
    def num_peers(self) -> int:
        return self.num_ranks

    @property
    def barrier_offset(self) -> int:
        """Workspace offset of the words of this context's barrier kernel."""
        return self.ctrl_offset + BARRIER_OFFSET

    def get_physical_domain_size(self):
        """`(num_rdma_ranks, num_nvl_ranks)` of this context's group."""
        return self.physical

    def get_logical_domain_size(self):
        return self.physical

    def release(self) -> None:
        if self.mapping is not None:
            self.mapping.release()
            self.mapping = None


class Bucket:
    """The bucket collectives of one buffer: its contexts and the launches.

    Args:
        buf: the buffer (a `BufferBase`); its data region is the registered storage.
    """

    def __init__(self, buf):
        self._buf = buf
        self.contexts: List[BucketContext] = []

    def destroy(self) -> None:
        for ctx in self.contexts:
            ctx.release()
        self.contexts = []

    def launch(self, ctx: BucketContext, op: str, offset: int, num: int, src_ptr: int, scale: float, num_sms: int,
               stream) -> None:
        """One collective on `stream` (the communication stream, ordered after the caller's).

        Args:
            ctx: the context (group).
            op: 'all_gather', 'reduce_scatter' or 'all_reduce'.
            offset: byte offset of the tensor (the gathered tensor for all-gather) from the allocation base.
            num: bytes of one shard (all-gather) or fp32 elements of the tensor (reductions).
            src_ptr: all-gather only: address of this rank's source when it is not already its shard (else 0).
            scale: factor of the reductions' sums.
            num_sms: blocks of the cooperative launch (at most the device's SMs).
        """
        buf = self._buf
        epoch = (ctx.num_barriers + 1) & 0xFFFFFFFF
        ctx.kernels[op].launch(max(1, min(num_sms, buf.num_device_sms)), THREADS, stream=stream, cooperative=True,
                               peer_bases=ctx.peer_bases_ptr, rank=ctx.rank_idx, ctrl_offset=ctx.ctrl_offset,
                               epoch=epoch, offset=offset, num=num, src=src_ptr, scale=float(scale),
                               error_record=buf.host_mapped.ptr, timeout_ns=buf.timeout_ns)
        ctx.num_barriers += NUM_BARRIERS[op]


def gather_src(region_ptr: int, rank: int, shard_bytes: int, src_ptr: int) -> int:
    """The all-gather kernel's `src`: 0 when the source already is this rank's shard of the region (in place)."""
    return 0 if src_ptr == region_ptr + rank * shard_bytes else src_ptr
