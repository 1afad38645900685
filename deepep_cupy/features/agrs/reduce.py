"""Reduce-scatter and all-reduce (features/agrs/feature.py's `AGRS`; kernels_cu/agrs.cu's reduce and unpack kernels):
a call's signature is checked once (`_check_reduce_scatter` / `_check_all_reduce`: the checks, layout, area, bound
launches); per call the address, scale and epoch are checked or patched, and one `ReductionOverlap` is returned."""

import struct
import sys
from functools import partial

from ...runtime import checks, interop, streams
from ...runtime.event import as_event_handle
from ...runtime.sizes import ceil_div
from .kernels import COMM_PRECISIONS, DEFAULT_REDUCE_SMS, GATHER_UNROLL, GROUP_ELEMS, THREADS
from .plan import all_reduce_shard_elems, reduce_area_offset
from .wait_handle import ReductionOverlap

_X_OUT = struct.Struct('=QQ')       # the reduce kernel's x and out (its first parameters: checked when binding)


class Reductions:
    """Mixed into `AGRS` (uses `_buf`, `kernels`, `hybrid`, `area_offset`, `area_bytes`, `session_capacity`,
    `num_sms`, `reduce_epoch`, `_reduce_launches`, `_reduce_checked` and hybrid.py's steps)."""

    def _reduce_area(self, layout) -> int:
        """Offset (in the symmetric buffer) of the reduction area for `layout` (anything with `num_bytes`)."""
        start = reduce_area_offset(self.session_capacity)
        if start + layout.num_bytes > self.area_bytes:
            need = self._buf.num_bytes - self.area_bytes + start + layout.num_bytes
            raise ValueError(f'this reduction needs {layout.num_bytes} bytes of the reduction area but the buffer has '
                             f'{max(0, self.area_bytes - start)} after the session area ({self.session_capacity} '
                             f'bytes): it needs num_bytes >= {need}; build it with get_agrs_buffer_size_hint(group, '
                             f'session_bytes, get_agrs_reduce_num_bytes(...))')
        return self.area_offset + start

    def _launch_reduce(self, kernel_key, x_ptr, out_ptr, layout, scale, area, is_all_reduce, comm,
                       bound=None) -> int:
        """Launch the reduce kernel `kernel_key` for `layout` (`bound`: its `_reduce_bound`, when the caller kept it);
        returns the call's epoch."""
        # Wraps to 0 like every epoch (wrap-safe compares); skipping 0 would make the next senders wait for a `done`
        # of epoch 0, which no rank publishes.
        self.reduce_epoch = (self.reduce_epoch + 1) & 0xFFFFFFFF
        if bound is None:
            bound = self._reduce_bound(kernel_key, layout, area, is_all_reduce)
        i_x, i_out, i_scale, i_epoch = self._reduce_idx
        bound.u64[i_x], bound.u64[i_out], bound.f32[i_scale], bound.u32[i_epoch] = (x_ptr, out_ptr, scale,
                                                                                    self.reduce_epoch)
        bound(comm)
        return self.reduce_epoch

    def _reduce_bound(self, kernel_key, layout, area, is_all_reduce):
        """The bound launch of reduce kernel `kernel_key` for `layout` at `area` (bound once per layout by name; per
        call the pointers, scale and epoch change)."""
        key = (kernel_key, layout, area, is_all_reduce)
        bound = self._reduce_launches.get(key)
        if bound is None:
            buf = self._buf
            bound = self.kernels[kernel_key].bind(
                layout.num_senders + layout.num_reducers, THREADS, cooperative=True, x=0, out=0,
                num_elems=layout.num_elems, shard_elems=layout.shard_elems, chunk_elems=layout.chunk_elems,
                scale=1.0, num_senders=layout.num_senders, peer_bases=buf.sym.peer_bases_ptr,
                rank=buf.sym.local_idx, recv_offset=area, slot_bytes=layout.slot_bytes,
                gather_offset=area + layout.gather_offset, gather_slot_bytes=layout.gather_slot_bytes,
                is_all_reduce=int(is_all_reduce), epoch=0, error_record=buf.host_mapped.ptr,
                timeout_ns=buf.timeout_ns)
            if len(self._reduce_launches) >= 64:
                self._reduce_launches.clear()
            self._reduce_launches[key] = bound
            self._reduce_idx = tuple(bound.index(n) for n in ('x', 'out', 'scale', 'epoch'))
            assert self._reduce_idx[:2] == (0, 1), 'agrs_reduce_kernel: x and out come first'    # (`_X_OUT`)
        return bound

    def reduce_scatter(self, x, comm_precision: str = 'fp32', scale: float = 1.0, num_sms: int = 0,
                       previous_event=None):
        """Sum every rank's `x` and give rank r the r-th of R equal shards, times `scale`.

        Args:
            x: `[R * n, ...]` or `[R, ...]` (shard r = the r-th slice along dim 0), float32 or bfloat16 (CuPy:
                float32 or uint16), contiguous, n elements per shard a multiple of 8, 16-byte aligned.
            comm_precision: `'fp32'` or `'bf16'` (pieces travel, and enter the sum, rounded to bfloat16);
                bfloat16 inputs always travel as bfloat16. The sum is FP32 in rank order 0..R-1 (deterministic).
            scale: multiplies the FP32 sum before the final rounding.
            num_sms: blocks of the kernel, half senders (at most 32) and half reducers (0: min(device SMs, 64)).
            previous_event: `EventHandle` the communication stream waits for instead of the current stream.

        Returns:
            `EventOverlap`; `wait()` makes the current stream wait and returns the shard: `[n]` for 1-D `x`,
            `[shape[0] / R, ...]` otherwise (`[...]` when shape[0] == R and x has 2+ dims), dtype of `x`.
        """
        buf = self._buf
        if buf._destroyed or buf._failed is not None or buf.error_record[0]:
            self._check_usable()
        # Per call: x's signature (`interop.meta`, inlined for a plain torch tensor) finds what the checks derived
        # from it (`_check_reduce_scatter`, once per signature); what varies is checked here.
        if type(x) is interop.TORCH_TENSOR[0]:
            key, ptr = (x.shape, x.stride(), x.dtype, x.get_device(), comm_precision, num_sms, type(num_sms)), \
                x.data_ptr()
        else:
            sig, ptr = interop.meta(x)       # (a torch signature spliced in: the key above, once meta saw torch)
            key = (*sig, comm_precision, num_sms, type(num_sms)) if type(sig) is tuple else \
                (sig, comm_precision, num_sms, type(num_sms))
        checked = self._reduce_checked.get(key)
        if checked is None:
            checked, ptr = self._check_reduce_scatter(x, key, comm_precision, num_sms)
        torch_x, out_shape, out_dtype, bound, allocator, ptr_of, i_scale, i_epoch, rest = checked
        if ptr % 16:
            raise ValueError(f'x: each shard must hold a multiple of {GROUP_ELEMS} elements and x must be 16-byte '
                             f'aligned, got {rest[3]} elements per shard at address {ptr:#x}')
        if type(scale) is not float or scale - scale != 0.0:      # (a finite float passes as it is)
            scale = checks.check_finite('scale', scale)
        current = interop.current_stream(x)
        if previous_event is None:
            comm = buf.stream_order.begin(current)
            out = allocator.empty(out_shape, out_dtype, None)
        else:
            # The communication stream does not wait for the current stream then, so memory just freed on the
            # current stream (still in use by its queued kernels) must not become `out`: allocate on the
            # communication stream, and let torch's allocator also wait for the current stream's uses of `out`.
            comm = buf.stream_order.begin(current, as_event_handle(previous_event))
            out = allocator.empty(out_shape, out_dtype, comm)
            if torch_x:
                import torch
                out.record_stream(torch.cuda.current_stream())      # `current` (the stream of a torch `x`)
        out_ptr = ptr_of(out)
        if bound is not None:       # (single domain: `_launch_reduce` inline)
            self.reduce_epoch = epoch = (self.reduce_epoch + 1) & 0xFFFFFFFF
            _X_OUT.pack_into(bound.data, 0, ptr, out_ptr)
            bound.f32[i_scale], bound.u32[i_epoch] = scale, epoch
            bound(comm)
        else:
            kernel_key, layout, area, _ = rest
            self._hybrid_reduce_scatter(kernel_key, ptr, out_ptr, out_dtype == 'bfloat16', layout, scale, area, comm)
        keep = (x, out)
        return ReductionOverlap(streams.EventHandle(comm), keep, out, keep if torch_x else (), current, comm)

    def _check_reduce_scatter(self, x, key, comm_precision: str, num_sms: int):
        """`reduce_scatter`'s checks that depend on x's signature only (`key`), and what they derive: `(whether x is a
        torch tensor, output shape and dtype, the bound launch (None in hybrid mode), the allocator and the output's
        address getter, the launch's scale and epoch word indices, (kernel, layout, area, shard elements))`, remembered
        unless x is of an unknown type; and x's address."""
        buf = self._buf
        info = checks.info(x, 'x', buf.device)
        checks.check_dtype(info, 'x', 'float32', 'bfloat16')
        checks.check_contiguous(info, 'x')
        if comm_precision not in COMM_PRECISIONS:
            raise ValueError(f'comm_precision must be one of {COMM_PRECISIONS}, got {comm_precision!r}')
        checks.check_int('num_sms', num_sms)
        num_ranks = buf.num_ranks
        if info.ndim == 0 or info.shape[0] % num_ranks:
            raise ValueError(f'x must have a first dimension divisible by R={num_ranks}, got shape '
                             f'{list(info.shape)}')
        out_shape = (tuple(info.shape[1:]) if info.ndim >= 2 and info.shape[0] == num_ranks
                     else (info.shape[0] // num_ranks, *info.shape[1:]))
        shard = info.numel // num_ranks
        if shard % GROUP_ELEMS:
            raise ValueError(f'x: each shard must hold a multiple of {GROUP_ELEMS} elements and x must be 16-byte '
                             f'aligned, got {shard} elements per shard at address {info.ptr:#x}')
        in_bf16 = info.dtype != 'float32'
        stage_bf16 = in_bf16 or comm_precision == 'bf16'
        layout, kernel_key = self._rs_layout(info.numel, shard, in_bf16, stage_bf16,
                                             min(num_sms or DEFAULT_REDUCE_SMS, buf.num_device_sms))
        area = self._reduce_area(layout)
        # (the launch is kept with the checks: looking it up by its layout hashes a dataclass per call)
        bound = None if self.hybrid else self._reduce_bound(kernel_key, layout, area, False)
        i_scale, i_epoch = (0, 0) if bound is None else self._reduce_idx[2:]
        torch_x = info.kind == 'torch'
        ptr_of = sys.modules['torch'].Tensor.data_ptr if torch_x else partial(interop.data_ptr, name='out')
        checked = (torch_x, out_shape, 'bfloat16' if in_bf16 else 'float32', bound, interop.Allocator(info.kind),
                   ptr_of, i_scale, i_epoch, (kernel_key, layout, area, shard))
        if type(key[0]) is not object:
            if len(self._reduce_checked) >= 64:
                self._reduce_checked.clear()
            self._reduce_checked[key] = checked
        return checked, info.ptr

    def all_reduce(self, x, scale: float = 1.0, num_sms: int = 0, previous_event=None):
        """Sum every rank's `x` in place (FP32, rank order 0..R-1 per element, deterministic), times `scale`.

        Args:
            x: float32 tensor / CuPy array of any shape, contiguous, 16-byte aligned; overwritten with the result.
            scale, num_sms, previous_event: as in `reduce_scatter`.

        Returns:
            `EventOverlap`; `wait()` makes the current stream wait and returns `x`.
        """
        buf = self._buf
        if buf._destroyed or buf._failed is not None or buf.error_record[0]:
            self._check_usable()
        if type(x) is interop.TORCH_TENSOR[0]:
            key, ptr = ('all_reduce', x.shape, x.stride(), x.dtype, x.get_device(), num_sms, type(num_sms)), \
                x.data_ptr()
        else:
            sig, ptr = interop.meta(x)
            key = ('all_reduce', *sig, num_sms, type(num_sms)) if type(sig) is tuple else \
                ('all_reduce', sig, num_sms, type(num_sms))
        checked = self._reduce_checked.get(key)
        if checked is None:
            checked, ptr = self._check_all_reduce(x, key, num_sms)
        kind, numel, layout, area, out_offset, bound, i_scale, i_epoch, unpack, i_unpack_epoch = checked
        if type(scale) is not float or scale - scale != 0.0:      # (a finite float passes as it is)
            scale = checks.check_finite('scale', scale)
        if ptr % 16:
            raise ValueError(f'x must be 16-byte aligned, got address {ptr:#x}')
        event = None if previous_event is None else as_event_handle(previous_event)
        current = interop.current_stream(x)
        comm = buf.stream_order.begin(current, event)
        keep = (x,)
        if numel == 0:
            return ReductionOverlap(streams.EventHandle(comm), keep, x, (), current, comm)
        if bound is not None:       # (single domain: `_launch_reduce` inline, then the unpack when R > 1)
            self.reduce_epoch = epoch = (self.reduce_epoch + 1) & 0xFFFFFFFF
            _X_OUT.pack_into(bound.data, 0, ptr, ptr + out_offset)
            bound.f32[i_scale], bound.u32[i_epoch] = scale, epoch
            bound(comm)
            if unpack is not None:
                unpack.u64[0], unpack.u32[i_unpack_epoch] = ptr, epoch
                unpack(comm)
        else:
            self._hybrid_all_reduce(ptr, numel, layout, out_offset, scale, area, comm)
        return ReductionOverlap(streams.EventHandle(comm), keep, x, keep if kind == 'torch' else (), current, comm)

    def _check_all_reduce(self, x, key, num_sms: int):
        """`all_reduce`'s checks that depend on x's signature only (`key`), and what they derive: `(kind, elements,
        layout, area, the output's offset in x (this rank's shard), the bound reduce launch, its scale and epoch word
        indices, the bound unpack launch (R > 1) and its epoch index; launches None in hybrid mode)`, remembered unless
        x is of an unknown type; and x's address."""
        buf = self._buf
        info = checks.info(x, 'x', buf.device)
        checks.check_dtype(info, 'x', 'float32')
        checks.check_contiguous(info, 'x')
        checks.check_int('num_sms', num_sms)
        numel, num_ranks, rank = info.numel, buf.num_scaleup_ranks, buf.sym.local_idx
        shard = all_reduce_shard_elems(num_ranks, numel)
        layout = self._ar_layout(numel, shard, min(num_sms or DEFAULT_REDUCE_SMS, buf.num_device_sms))
        area = self._reduce_area(layout)
        bound = unpack = None
        i_scale = i_epoch = i_unpack_epoch = 0
        if not self.hybrid and numel:
            bound = self._reduce_bound(('reduce', False, False), layout, area, True)
            i_scale, i_epoch = self._reduce_idx[2:]
            if num_ranks > 1:
                unpack = self.kernels['unpack'].bind(
                    max(1, min(self.num_sms, ceil_div(numel, THREADS * 4 * GATHER_UNROLL))), THREADS, x=0,
                    num_elems=numel, shard_elems=shard, peer_bases=buf.sym.peer_bases_ptr, rank=rank,
                    gather_offset=area + layout.gather_offset, gather_slot_bytes=layout.gather_slot_bytes, epoch=0,
                    publish_done=1, error_record=buf.host_mapped.ptr, timeout_ns=buf.timeout_ns)
                assert unpack.index('x') == 0, 'agrs_unpack_kernel: x comes first'
                i_unpack_epoch = unpack.index('epoch')
        checked = (info.kind, numel, layout, area, rank * shard * 4, bound, i_scale, i_epoch, unpack, i_unpack_epoch)
        if type(key[1]) is not object:
            if len(self._reduce_checked) >= 64:
                self._reduce_checked.clear()
            self._reduce_checked[key] = checked
        return checked, info.ptr

    def _hybrid_all_reduce(self, ptr: int, numel: int, outer, out_offset: int, scale: float, area: int, comm) -> None:
        """Hybrid mode's all-reduce (`outer`: its layout): the in-domain all-reduce first (scale 1), then the rails."""
        buf = self._buf
        layout = outer.inner
        epoch = self._launch_reduce(('reduce', False, False), ptr, ptr + out_offset, layout, 1.0, area, True, comm)
        if buf.num_scaleup_ranks > 1:
            self.kernels['unpack'].launch(
                max(1, min(self.num_sms, ceil_div(numel, THREADS * 4 * GATHER_UNROLL))), THREADS, stream=comm,
                x=ptr, num_elems=numel, shard_elems=layout.shard_elems, peer_bases=buf.sym.peer_bases_ptr,
                rank=buf.sym.local_idx, gather_offset=area + layout.gather_offset,
                gather_slot_bytes=layout.gather_slot_bytes, epoch=epoch, publish_done=0,
                error_record=buf.host_mapped.ptr, timeout_ns=buf.timeout_ns)
        self._hybrid_all_reduce_rails(ptr, numel, outer, scale, area, comm)
        self._publish_done(epoch, comm)
