"""`BucketBuffer` and `BucketSession`: DeepEP V2.5's bucket collectives (`deep_ep.buffers.bucket`).

A bucket buffer is contiguous symmetric storage registered with one or more groups (communication contexts).
Tensors planned into it (a `BufferAllocator` plan, or views of `storage`) are all-gathered, reduce-scattered and
all-reduced in place by the bucket feature (`features/agrs/bucket.py`, `kernels_cu/bucket.cu`): one cooperative
kernel per tensor on the communication stream, reading the peers' storage directly, nothing staged. A session
(`with buffer.session():`) lets the collectives take tensors outside the storage by staging them in it.

Every rank passes its tensors at the same offsets of its storage (a shared plan does that) and makes the same calls in
the same order. This build needs each group inside one NVLink domain; torch tensors only.
"""

import inspect
import math
import weakref
from typing import List, Optional, Sequence, Union

from ..constants import BUFFER_ALIGNMENT, DEFAULT_NVLINK_GBS
from ..features.agrs.bucket import Bucket, BucketContext, gather_src, theoretical_num_sms
from ..features.barrier import Barrier
from ..runtime import interop
from ..runtime.checks import check_int
from ..runtime.group import get_group
from ..runtime.nvlink import get_nvlink_gbs
from ..runtime.sizes import align
from ..runtime.symmetric import PeerMapping, process_key
from .allocator import RDMA_ALIGNMENT, BufferAllocator
from .base import BufferBase, V25Methods

__all__ = ['BucketBuffer', 'BucketSession']

COLLECTIVES = ('all_gather', 'reduce_scatter', 'all_reduce')
COMM_PRECISIONS = ('fp32', 'bf16')


def _pack(*lists):
    """`(is_packed, list, ...)`: the first argument is a tensor (packed) or a sequence; None becomes `[]`."""
    import torch
    is_packed = isinstance(lists[0], torch.Tensor)
    out = tuple([] if item is None else [item] if isinstance(item, torch.Tensor) else list(item) for item in lists)
    if any(len(item) not in (0, len(out[0])) for item in out):
        raise ValueError(f'srcs and dsts must have the same number of tensors, got {[len(i) for i in out]}')
    return (is_packed, *out)


class BucketBuffer(V25Methods, BufferBase):
    """Contiguous symmetric storage registered with one or more communication groups (DeepEP V2.5).

    Args:
        group: a torch ProcessGroup (or a deepep_cupy `ProcessGroup`), or a list of them (one context each; the
            first one's ranks hold the memory, every group must lie inside one NVLink domain).
        allocation_plan_or_num_bytes: a `BufferAllocator` plan (its placeholders become views of `storage`) or the
            storage's size in bytes (> 0; the symmetric allocation is rounded up to 2 MiB).
        sl_idx: RDMA service level; accepted (no RDMA traffic inside one NVLink domain).
        num_gpu_timeout_secs: bound on GPU waits.
        explicitly_destroy: memory is released by `destroy()` (collective); else when garbage-collected.

    Attributes:
        groups: the groups, in context order; contexts: one `BucketContext` per group.
        storage: `[num_bytes]` uint8 torch tensor, this rank's registered storage.
    """

    def __init__(self, group, allocation_plan_or_num_bytes: Union[BufferAllocator, int], sl_idx: Optional[int] = None,
                 num_gpu_timeout_secs: float = 100, explicitly_destroy: bool = False, *, comm=None,
                 device: Optional[int] = None, num_cpu_timeout_secs: float = 300):
        import torch
        plan = allocation_plan_or_num_bytes if isinstance(allocation_plan_or_num_bytes, BufferAllocator) else None
        if plan is not None and plan.materialized:
            raise ValueError('allocation_plan_or_num_bytes: this plan was already materialised')
        num_bytes = plan.num_bytes if plan is not None else check_int('allocation_plan_or_num_bytes',
                                                                      allocation_plan_or_num_bytes)
        if num_bytes <= 0:
            raise ValueError(f'the storage must have a positive size, got {num_bytes} bytes')
        self.groups = list(group) if isinstance(group, (list, tuple)) else [group]
        if not self.groups:
            raise ValueError('group: give a group or a non-empty list of groups')
        self.storage_num_bytes = num_bytes
        self.sl_idx = sl_idx
        self.contexts: List[BucketContext] = []
        self._bucket: Optional[Bucket] = None
        self.storage = None
        super().__init__(group=self.groups[0], comm=comm, num_bytes=align(num_bytes, BUFFER_ALIGNMENT),
                         num_cpu_timeout_secs=num_cpu_timeout_secs, num_gpu_timeout_secs=num_gpu_timeout_secs,
                         explicitly_destroy=explicitly_destroy, device=device,
                         config={'num_groups': len(self.groups), 'storage_bytes': num_bytes})
        try:
            if self.num_scaleout_ranks > 1:
                raise NotImplementedError(f'{self.num_scaleout_ranks} scale-up domains: bucket collectives across '
                                          f'NVLink domains (RDMA) are not implemented; use groups inside one domain')
            self._nvlink_gbs = get_nvlink_gbs() or DEFAULT_NVLINK_GBS
            self._bucket = Bucket(weakref.proxy(self))
            self._bucket.contexts = self.contexts           # one list: contexts appended below are the feature's
            self._build_contexts()
            self.storage = interop.to_torch(self.sym.local_view(self.data_offset, num_bytes))
            if plan is not None:
                plan.materialize(self.storage)
            torch.cuda.synchronize()
        except BaseException:
            self.destroy()
            raise

    def _build_contexts(self) -> None:
        sym = self.sym
        self.contexts.append(BucketContext(0, self.groups[0], self.group, sym.peer_bases_ptr, sym.local_idx,
                                           (1, self.num_scaleup_ranks)))
        if len(self.groups) == 1:
            return
        # Processes whose allocations this one maps already (its own domain): not opened twice.
        keys = self.group.allgather_object(process_key(), timeout=self.num_cpu_timeout_secs)
        known = {keys[r]: base for r, base in zip(sym.domain_ranks, sym.peer_bases)}
        for index, g in enumerate(self.groups[1:], start=1):
            pg = get_group(g, timeout=self.num_cpu_timeout_secs)
            hosts = {h for h, _ in pg.allgather_object(process_key(), timeout=self.num_cpu_timeout_secs)}
            if len(hosts) > 1:
                raise NotImplementedError(f'group {index} spans {len(hosts)} hosts: bucket collectives need every '
                                          f'group inside one NVLink domain')
            mapping = PeerMapping(pg, sym.base, sym.num_bytes, known)
            ctx = BucketContext(index, g, pg, mapping.peer_bases_ptr, pg.rank, (1, pg.size), mapping)
            ctx.barrier = Barrier(ctx, self.host_mapped.ptr, self.timeout_ns, signal_offset=ctx.barrier_offset)
            self.contexts.append(ctx)

    def _destroy_features(self) -> None:
        if self._bucket is not None:
            self._bucket.destroy()
        self._bucket = None
        self.contexts = []
        self.storage = None

    # ---- contexts, SMs, barrier --------------------------------------------------------------------------------
    def get_context_idx(self, group=None) -> int:
        """The context of `group` (None: the only one; a buffer with several groups needs it named)."""
        if group is None:
            if len(self.groups) != 1:
                raise ValueError('group is required when the buffer has several groups')
            return 0
        for idx, g in enumerate(self.groups):
            if g is group:
                return idx
        raise ValueError('group is not one of this buffer\'s groups')

    def get_theoretical_num_sms(self, op: str, group=None) -> int:
        """SMs of a collective (DeepEP V2.5's bandwidth model; 'all_gather' gives 0: no SM count is chosen)."""
        ctx = self.contexts[self.get_context_idx(group)]
        rdma, nvl = ctx.get_physical_domain_size()
        return theoretical_num_sms(op, rdma, nvl, self._nvlink_gbs, self._nvlink_gbs, self.num_device_sms)

    def context_barrier(self, context_idx: Optional[int], wait_comm_stream: bool, with_cpu_sync: bool,
                        sequential: bool) -> None:
        idx = 0 if context_idx is None else context_idx
        if idx == 0:
            BufferBase.barrier(self, wait_comm_stream, with_cpu_sync, sequential)
            return
        self.check_usable()
        current = interop.current_stream()
        stream = self.stream_order.begin(current) if wait_comm_stream else current
        self.contexts[idx].barrier(stream)
        if wait_comm_stream:
            self.stream_order.end(current)
        if with_cpu_sync:
            self.synchronize(stream)

    def barrier(self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True,
                group=None) -> None:
        """GPU barrier over the ranks of `group` (None: the only group)."""
        self.context_barrier(self.get_context_idx(group), wait_comm_stream, with_cpu_sync, sequential)

    def session(self) -> 'BucketSession':
        """A session (`with buffer.session() as s:`) in which the collectives accept tensors outside the storage."""
        return BucketSession(self)

    # ---- the collectives ---------------------------------------------------------------------------------------
    def _tensor(self, t, name: str, registered: bool):
        """`(info, offset from the allocation base or None)` of a torch CUDA tensor of this rank."""
        import torch
        if not isinstance(t, torch.Tensor):
            raise TypeError(f'{name} must be a torch tensor, got {type(t).__name__}')
        info = interop.tensor_info(t, name)
        if info.device != self.device:
            raise ValueError(f'{name} must be on cuda:{self.device}, got {t.device}')
        if not info.is_contiguous():
            raise ValueError(f'{name} must be contiguous')
        begin = self.sym.base + self.data_offset
        inside = begin <= info.ptr and info.ptr + info.nbytes <= begin + self.storage_num_bytes
        if registered and not inside:
            raise ValueError(f'{name} must belong to this BucketBuffer\'s storage (or use a session)')
        return info, (info.ptr - self.sym.base if inside else None)

    def _finish(self, kind_tensors, external, result, num_sms: int):
        event = self.stream_order.event('torch', external, kind_tensors)
        event.register_hook_after_wait(lambda: result)
        event.num_sms = num_sms
        return event

    def _sms(self, op: str, ctx_idx: int, num_sms: Optional[int]) -> int:
        if num_sms is None:
            return self.get_theoretical_num_sms(op, self.groups[ctx_idx])
        return check_int('num_sms', num_sms)

    def reduce_scatter(self, srcs, comm_precision: str = 'fp32', scale: float = 1.0, group=None,
                       num_sms: Optional[int] = None):
        """Reduce-scatter in place: rank r's shard r of each source becomes `scale` x the sum of every rank's shard r
        (FP32, ranks in order; inside one NVLink domain the pieces travel in FP32 whatever `comm_precision` says).

        Args:
            srcs: float32 tensor(s) in the storage, contiguous, numel a multiple of the group size.
            comm_precision: 'fp32' or 'bf16' (DeepEP: the RDMA transfer precision).
            scale: multiplies the sum. group: the group (needed with several). num_sms: blocks (None: the model's).

        Returns:
            `EventOverlap` with `num_sms`; `wait()` returns each source's shard, a 1-D view of the storage at
            `src.data_ptr() + rank * shard_bytes` (one tensor or a list, as `srcs`).
        """
        if comm_precision not in COMM_PRECISIONS:
            raise ValueError(f'comm_precision must be one of {COMM_PRECISIONS}, got {comm_precision!r}')
        return self._reduce('reduce_scatter', srcs, scale, group, num_sms)

    def all_reduce(self, srcs, scale: float = 1.0, group=None, num_sms: Optional[int] = None):
        """All-reduce in place: every source becomes `scale` x the sum over ranks (FP32, ranks in order).

        Args:
            srcs: float32 tensor(s) in the storage, contiguous; overwritten with the result.
            scale, group, num_sms: as in `reduce_scatter`.

        Returns:
            `EventOverlap` with `num_sms`; `wait()` returns the sources.
        """
        return self._reduce('all_reduce', srcs, scale, group, num_sms)

    def _reduce(self, op: str, srcs, scale: float, group, num_sms: Optional[int]):
        import torch
        self.check_usable()
        is_packed, items = _pack(srcs)
        if not items:
            raise ValueError('srcs must be a tensor or a non-empty sequence of tensors')
        ctx_idx = self.get_context_idx(group)
        ctx = self.contexts[ctx_idx]
        num_sms = self._sms(op, ctx_idx, num_sms)
        work, results = [], []
        for i, t in enumerate(items):
            name = 'srcs' if is_packed else f'srcs[{i}]'
            info, offset = self._tensor(t, name, True)
            if t.dtype != torch.float32:
                raise TypeError(f'{name} must be float32, got {t.dtype}')
            if op == 'reduce_scatter':
                if info.numel % ctx.num_ranks:
                    raise ValueError(f'{name}: {info.numel} elements do not split into {ctx.num_ranks} shards')
                shard = info.numel // ctx.num_ranks
                results.append(t.view(-1)[ctx.rank_idx * shard:(ctx.rank_idx + 1) * shard])
            else:
                results.append(t)
            work.append((offset, info.numel))
        comm = self.stream_order.begin(interop.current_stream(items[0]))
        for offset, numel in work:
            if numel:
                self._bucket.launch(ctx, op, offset, numel, 0, scale, num_sms, comm)
        return self._finish(items, (), results[0] if is_packed else results, num_sms)

    def all_gather(self, srcs, dsts=None, group=None, num_sms: Optional[int] = None):
        """All-gather: every rank's shard into every rank's copy of the gathered tensor.

        Args:
            srcs: this rank's shard(s). Without `dsts`, each must be the `rank`-th shard of a tensor in the storage
                (gathered in place). With `dsts`, any contiguous tensor on this GPU (copied into the shard first).
            dsts: the gathered tensors, in the storage, `dst.nbytes == group.size() * src.nbytes`, same dtype.
            group: the group (needed with several). num_sms: blocks (None or 0: a default; DeepEP uses copy engines).

        Returns:
            `EventOverlap` with `num_sms`; `wait()` returns the gathered tensor(s) as 1-D views of the storage in the
            sources' dtype.
        """
        self.check_usable()
        is_packed, items, targets = _pack(srcs, dsts)
        if not items:
            raise ValueError('srcs must be a tensor or a non-empty sequence of tensors')
        ctx_idx = self.get_context_idx(group)
        ctx = self.contexts[ctx_idx]
        R, r = ctx.num_ranks, ctx.rank_idx
        num_sms = self._sms('all_gather', ctx_idx, num_sms)
        work, results, external = [], [], []
        for i, t in enumerate(items):
            name = 'srcs' if is_packed else f'srcs[{i}]'
            info, offset = self._tensor(t, name, not targets)
            shard_bytes = info.nbytes
            if targets:
                dname = 'dsts' if is_packed else f'dsts[{i}]'
                dinfo, region = self._tensor(targets[i], dname, True)
                if targets[i].dtype != t.dtype:
                    raise TypeError(f'{dname} ({targets[i].dtype}) and {name} ({t.dtype}) must have the same dtype')
                if dinfo.nbytes != R * shard_bytes:
                    raise ValueError(f'{dname} holds {dinfo.nbytes} bytes, the group gathers {R} x {shard_bytes}')
            else:
                region = offset - r * shard_bytes
                if region < self.data_offset or region + R * shard_bytes > self.data_offset + self.storage_num_bytes:
                    raise ValueError(f'{name} is not the rank-{r} shard of a tensor inside the storage')
            src = gather_src(self.sym.base + region, r, shard_bytes, info.ptr)
            if src and offset is None:
                external.append(t)
            work.append((region, shard_bytes, src))
            start = region - self.data_offset
            results.append(self.storage[start:start + R * shard_bytes].view(t.dtype))
        comm = self.stream_order.begin(interop.current_stream(items[0]))
        for region, shard_bytes, src in work:
            if shard_bytes:
                self._bucket.launch(ctx, 'all_gather', region, shard_bytes, src, 1.0,
                                    num_sms or min(32, self.num_device_sms), comm)
        return self._finish(items + targets, external, results[0] if is_packed else results, num_sms)


class BucketSession:
    """A session in which `BucketBuffer`'s collectives accept tensors outside the storage: they are staged in the
    storage (from its start, `get_num_rdma_alignment()` aligned), the collective runs there and `wait()` copies the
    results to the given destinations. Entering a session overwrites what the storage holds where it stages (make
    sure nothing there is still needed); sessions do not nest and use one group.

        with buffer.session() as session:
            out = buffer.reduce_scatter(external_tensor, group=g).wait()
            staged = session.allocate((n, 4), group=g)      # a tensor in the storage, for in-place calls
    """

    def __init__(self, buffer: BucketBuffer):
        self.buffer = buffer
        self.alignment = RDMA_ALIGNMENT
        self.num_allocated_bytes = 0
        self.context_idx: Optional[int] = None

    def __enter__(self) -> 'BucketSession':
        if any(name in self.buffer.__dict__ for name in COLLECTIVES):
            raise RuntimeError('BucketBuffer sessions do not nest')
        self.num_allocated_bytes, self.context_idx = 0, None
        for name in COLLECTIVES:
            setattr(self.buffer, name, self._wrap(name))
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        for name in COLLECTIVES:
            self.buffer.__dict__.pop(name, None)

    def _wrap(self, name: str):
        method = getattr(type(self.buffer), name)
        signature = inspect.signature(method)

        def collective(*args, **kwargs):
            arguments = signature.bind(self.buffer, *args, **kwargs).arguments
            arguments.pop('self')
            return self._collective(name, method, **arguments)
        collective.__doc__ = method.__doc__
        return collective

    def _allocate(self, num_bytes: int, dtype):
        buf = self.buffer
        offset = self.num_allocated_bytes
        if num_bytes <= 0 or offset + align(num_bytes, self.alignment) > buf.storage_num_bytes:
            raise RuntimeError(f'BucketBuffer session out of storage: {num_bytes} more bytes after {offset}, the '
                               f'storage has {buf.storage_num_bytes}')
        self.num_allocated_bytes += align(num_bytes, self.alignment)
        return buf.storage.narrow(0, offset, num_bytes).view(dtype)

    def _check_group(self, group) -> int:
        idx = self.buffer.get_context_idx(group)
        if self.context_idx not in (None, idx):
            raise ValueError('every collective of a session must use the same group')
        self.context_idx = idx
        return idx

    def allocate(self, shapes: Union[Sequence[int], Sequence[Sequence[int]]], dtype=None, group=None):
        """Tensor(s) of `shapes` (one shape or a sequence of shapes) in the storage, `dtype` default float32."""
        import torch
        dtype = torch.float32 if dtype is None else dtype
        self._check_group(group)
        batched = isinstance(shapes[0], (tuple, list, torch.Size))
        shapes = list(shapes) if batched else [shapes]
        itemsize = torch.empty((), dtype=dtype).element_size()
        tensors = [self._allocate(math.prod(s) * itemsize, dtype).view(tuple(s)) for s in shapes]
        return tuple(tensors) if batched else tensors[0]

    def _collective(self, name: str, method, srcs, dsts=None, group=None, **kwargs):
        import torch
        buf = self.buffer
        ctx_idx = self._check_group(group)
        ctx = buf.contexts[ctx_idx]
        R, r = ctx.num_ranks, ctx.rank_idx
        shards_in, shards_out = {'all_gather': (R, 1), 'reduce_scatter': (1, R), 'all_reduce': (1, 1)}[name]
        is_packed, items, targets = _pack(srcs, dsts)
        begin = buf.storage.data_ptr()
        end = begin + buf.storage_num_bytes

        def registered(t) -> bool:
            return begin <= t.data_ptr() < end

        staged_srcs, staged_dsts, copies = [], [], []
        for i, src in enumerate(items):
            dst = targets[i] if targets else None
            if dst is not None:
                if dst.dtype != src.dtype or not dst.is_contiguous():
                    raise ValueError(f'{name}: dsts[{i}] must be contiguous with the dtype of srcs[{i}]')
                if dst.nbytes * shards_out != src.nbytes * shards_in:
                    raise ValueError(f'{name}: dsts[{i}] holds {dst.nbytes} bytes, expected '
                                     f'{src.nbytes * shards_in // shards_out}')
            nbytes = src.nbytes * shards_in
            if registered(src):
                region = buf.storage.narrow(0, src.data_ptr() - begin - (r % shards_in) * src.nbytes, nbytes)
            elif dst is not None and registered(dst):
                region = buf.storage.narrow(0, dst.data_ptr() - begin - (r % shards_out) * dst.nbytes, nbytes)
            else:
                region = self._allocate(nbytes, torch.uint8)
            region = region.view(src.dtype)
            src_view = region.view(shards_in, -1)[r % shards_in].view(src.shape)
            dst_view = region.view(shards_out, -1)[r % shards_out]
            if not registered(src) and name != 'all_gather':
                copies.append((src_view, src))
            staged_srcs.append(src_view)
            staged_dsts.append(dst_view.view(dst.shape) if dst is not None else dst_view)
        for dst_view, src in copies:
            dst_view.copy_(src)
        if name == 'all_gather':
            # Sources outside the storage are copied into their shard by the kernel (one NVLink domain).
            handle = method(buf, items, dsts=staged_dsts, group=group, **kwargs)
        else:
            handle = method(buf, staged_srcs, group=group, **kwargs)
        outputs = targets if targets else staged_dsts
        inner = handle.hook_after_wait
        handle.hook_after_wait = None

        def hook():
            results = inner()
            for out, res in zip(outputs, results):
                if out.data_ptr() != res.data_ptr():
                    out.view(-1).copy_(res.view(out.dtype).view(-1))
            return outputs[0] if is_packed else outputs
        handle.register_hook_after_wait(hook)
        return handle
