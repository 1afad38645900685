"""All-gather / reduce-scatter / all-reduce across scale-up domains: the hybrid steps of the feature (feature.py `AGRS`
inherits them).

Hybrid mode (N scale-up domains x R ranks, rank g = n * R + r; rails as in runtime/rails.py): the data region as in
feature.py; a 4 KiB rail area in the workspace (AGRS_RAIL: the loopback transport's flags, the rail headers). Rail
exchanges are host-issued on the communication stream, in program order (every rail peer issues the same ones),
through the rails buffers/agrs_rails.py makes (the buffer's one transport: a buffer's data region belongs to one
feature, so a hybrid EP buffer never runs these); nothing is staged outside the symmetric buffer.
- all_gather: gather regions hold W = N * R slots in global rank order. Rank g stores its tensor in slot g of its
  domain (the intranode gather kernel), sends slot g to its N - 1 rail peers and receives theirs into slots (m, r)
  (one rail exchange per call; a 16-byte header carries the call's meta, so ranks that gathered different sizes are
  reported across domains too), then stores the N - 1 received shards into the slots (m, r) of its domain peers; the
  last launch signals (the wait handle waits for the R domain peers, as in one domain).
- reduce_scatter: the input reordered to `[R][N][n]` FP32 (exact), the in-domain reduce-scatter of it (scale 1, FP32
  result: rank (n, r) holds domain n's partial of the shards (m, r) for every m), the rail exchange of the partials
  (FP32, so one rounding in all), then the sum over domains in order 0..N-1, times scale, one rounding
  (`reference.hybrid_reduce_scatter_reference`).
- all_reduce: the in-domain all-reduce (scale 1), the rail exchange of the whole domain partial (each rank with its N
  - 1 rail peers: (N - 1) * size bytes per rank, R times what a reduce-scatter-based scheme would send), then the sum
  over domains in order, times scale (`reference.hybrid_all_reduce_reference`).
A rail wait that times out records the phase and the rail peer; the next call (or the wait handle) raises
`TimeoutError` naming them and aborts the transport.
"""

import weakref
from typing import Any, Callable, Dict, Optional

from ...jit.launch import load_kernels
from ...runtime.rails import plan_ranges
from ...runtime.sizes import ceil_div
from .kernels import (
    GROUP_ELEMS,
    RAIL_META_WORD,
    RAIL_OFFSET,
    THREADS,
    hybrid_specs,
    permute_spec,
    rail_meta_spec,
    sum_spec,
)
from .plan import gather_grid, hybrid_all_reduce_layout, hybrid_reduce_scatter_layout, reduce_layout


class HybridSteps:
    """The hybrid-mode steps of `AGRS` (its attributes: `_buf`, `rails`, `hybrid_kernels`, `kernels`, `area_offset`,
    `data_base`, `num_domains`, `domain`, `num_sms`, `_gather_launch_idx`, `_launch_reduce`)."""

    def _init_domains(self, buf, rails: Any, make_rails: Optional[Callable[[Any, int], Any]]) -> None:
        """The session area's offset in the symmetric buffer and its bytes with the reduction area (the data region);
        in hybrid mode the kernels, the rails (`rails`, or `make_rails(buf, rail_offset)`: collective; the rail area
        is workspace region AGRS_RAIL) and the buffer's rail barrier (unless the EP feature set one)."""
        self.hybrid = buf.num_scaleout_ranks > 1
        self.num_domains, self.domain = buf.num_scaleout_ranks, buf.scaleout_rank_idx
        self.area_offset, self.area_bytes = buf.data_offset, buf.num_bytes
        self.rails = None
        if not self.hybrid:
            return
        self.hybrid_kernels = self.load_hybrid_kernels()
        if rails is None:
            if make_rails is None:
                raise ValueError('hybrid mode: the all-gather / reduction feature needs its rails (make_rails)')
            rails = make_rails(buf, RAIL_OFFSET)
        self.rails = rails
        if getattr(buf, '_rail_barrier', None) is None:
            ref = weakref.ref(self)
            buf._rail_barrier = lambda stream: ref() is not None and ref().rails.barrier(stream)

    def _check_usable(self) -> None:
        """The buffer's check; a recorded GPU timeout in hybrid mode also aborts the rail transport (NCCL work still
        queued returns instead of hanging)."""
        try:
            self._buf.check_usable()
        except TimeoutError as e:
            if self.rails is not None and self.rails.transport is not None and not self.rails.transport.aborted:
                self.rails.transport.abort()
                raise TimeoutError(f'{e} The {self.rails.transport.name} rail transport was aborted.') from None
            raise

    def _hand_over_rails(self) -> None:
        """`destroy`: the buffer releases the rails once no kernel runs (buffers/hybrid.py `release`)."""
        if self.rails is not None:
            self._buf._agrs_rails, self.rails = self.rails, None

    def _rs_layout(self, num_elems: int, shard: int, in_bf16: bool, stage_bf16: bool, num_sms: int):
        """`(layout, reduce kernel key)` of a reduce-scatter; hybrid: the in-domain step reduces the reordered FP32
        input."""
        R = self._buf.num_scaleup_ranks
        if self.hybrid:
            return (hybrid_reduce_scatter_layout(self.num_domains, R, shard, 2 if stage_bf16 else 4, num_sms),
                    ('reduce', False, stage_bf16))
        layout = reduce_layout(R, num_elems, shard, 2 if stage_bf16 else 4, False, num_sms)
        return layout, ('reduce', in_bf16, stage_bf16)

    def _ar_layout(self, num_elems: int, shard: int, num_sms: int):
        R = self._buf.num_scaleup_ranks
        if self.hybrid:
            return hybrid_all_reduce_layout(self.num_domains, R, num_elems, num_sms)
        return reduce_layout(R, num_elems, shard, 4, True, num_sms)

    @staticmethod
    def load_hybrid_kernels() -> Dict[Any, Any]:
        loaded = load_kernels(hybrid_specs())
        kernels = {'rail_meta': loaded[rail_meta_spec().name]}
        for flag in (False, True):
            kernels[('permute', flag)] = loaded[permute_spec(flag).name]
            kernels[('sum', flag)] = loaded[sum_spec(flag).name]
        return kernels

    def _hybrid_gather(self, g, comm, ptrs, sizes, regions, inplace, meta) -> None:
        """The launches and the rail exchange of one hybrid all-gather call (see the module docstring)."""
        buf, rails = self._buf, self.rails
        i_src, i_bytes, i_region, i_local, i_signal, _, _ = self._gather_launch_idx
        i_word = g.index('meta_word')
        R, r, n = buf.num_scaleup_ranks, buf.sym.local_idx, self.domain
        gr = buf.rank_idx
        area, base, num_sms = self.area_offset, self.data_base, self.num_sms
        rail_ptr = buf.sym.base + rails.rail_offset

        def go(src, nbytes, region_offset, write_local, signal):
            g.u64[i_src], g.i64[i_bytes], g.u64[i_region] = src, nbytes, region_offset
            g.i32[i_local], g.i32[i_signal] = write_local, signal
            g.u64[i_word] = rail_ptr + RAIL_META_WORD if signal else 0
            g.grid = (gather_grid(nbytes, nbytes % 16 == 0 and src % 16 == 0, num_sms), 1, 1)
            g(comm)

        # 1. This rank's tensors into slot g of every rank of its domain (its own slot only when not in place).
        for ptr, nbytes, region, exact in zip(ptrs, sizes, regions, inplace):
            go(ptr, nbytes, area + region.offset + n * R * nbytes, 0 if exact else 1, 0)
        # 2. The rail: slot g to every rail peer, their slots (m, r) from them; the header carries the call's meta.
        meta_args = dict(rail=rail_ptr, num_domains=self.num_domains, domain=n, meta=meta,
                         peer_bases=buf.sym.peer_bases_ptr, rank=r)
        self.hybrid_kernels['rail_meta'].launch(1, 32, stream=comm, mode=0, **meta_args)
        sends, recvs = {}, {}
        for m in rails.rails.peer_domains:
            sends[m] = [(area + reg.offset + gr * nb, area + reg.offset + gr * nb, nb)
                        for reg, nb in zip(regions, sizes)]
            recvs[m] = [(area + reg.offset + (m * R + r) * nb, area + reg.offset + (m * R + r) * nb, nb)
                        for reg, nb in zip(regions, sizes)]
        rails.exchange(rails.header_plan('all-gather', sends, recvs), comm)
        self.hybrid_kernels['rail_meta'].launch(1, 32, stream=comm, mode=1, **meta_args)
        # 3. The received shards into slots (m, r) of every domain peer; the last launch signals with the checked meta.
        todo = [(m, i) for m in rails.rails.peer_domains for i in range(len(sizes))]
        for j, (m, i) in enumerate(todo):
            nb, reg = sizes[i], regions[i]
            go(base + reg.offset + (m * R + r) * nb, nb, area + reg.offset + m * R * nb, 0, int(j == len(todo) - 1))

    def _grid(self, num_elems: int) -> int:
        return max(1, min(4 * self._buf.num_device_sms, ceil_div(num_elems, THREADS)))

    def _hybrid_reduce_scatter(self, kernel_key, x_ptr, out_ptr, bf16: bool, layout, scale, area, comm) -> None:
        """Reorder, in-domain reduce-scatter (FP32 partials, scale 1), rail exchange of the partials, final sum."""
        buf, rails = self._buf, self.rails
        N, R, n_dom = self.num_domains, buf.num_scaleup_ranks, self.domain
        n, sym = layout.shard_elems, buf.sym.base
        xp, send, recv = sym + area + layout.xp_offset, area + layout.send_offset, area + layout.recv_offset
        self.hybrid_kernels[('permute', bf16)].launch(self._grid(N * R * n), THREADS, stream=comm, x=x_ptr, xp=xp,
                                                      shard_elems=n, num_domains=N, num_scaleup=R)
        # Mode 2: done[me] is published after the rail step below (which reuses the reduction area).
        epoch = self._launch_reduce(kernel_key, xp, sym + send, layout.inner, 1.0, area, 2, comm)
        sends = {m: [(send + m * n * 4, recv + n_dom * n * 4, n * 4)] for m in rails.rails.peer_domains}
        recvs = {m: [(recv + m * n * 4, send + n_dom * n * 4, n * 4)] for m in rails.rails.peer_domains}
        rails.exchange(plan_ranges(rails.rails, 'reduce-scatter', sends, recvs), comm)
        self.hybrid_kernels[('sum', bf16)].launch(
            self._grid(n), THREADS, stream=comm, out=out_ptr, own=sym + send + n_dom * n * 4, slots=sym + recv,
            slot_bytes=n * 4, num_domains=N, domain=n_dom, num_elems=n, scale=float(scale))
        self._publish_done(epoch, comm)

    def _publish_done(self, epoch: int, comm) -> None:
        """Hybrid mode, after the rail step of reduction `epoch`: done[me] at every domain peer (an unpack launch with
        nothing to copy), so that no peer's next reduction writes into the area before this rank is through with it."""
        buf = self._buf
        if buf.num_scaleup_ranks > 1:
            self.kernels['unpack'].launch(1, THREADS, stream=comm, x=0, num_elems=0, shard_elems=GROUP_ELEMS,
                                          peer_bases=buf.sym.peer_bases_ptr, rank=buf.sym.local_idx, gather_offset=0,
                                          gather_slot_bytes=0, epoch=epoch, publish_done=1,
                                          error_record=buf.host_mapped.ptr, timeout_ns=buf.timeout_ns)

    @staticmethod
    def _copy(dst: int, src: int, num_bytes: int, stream) -> None:
        """Device-to-device copy on `stream` (tests replace it)."""
        import cupy
        rt = cupy.cuda.runtime
        rt.memcpyAsync(dst, src, num_bytes, rt.memcpyDeviceToDevice, stream.ptr)

    def _hybrid_all_reduce_rails(self, x_ptr, numel, layout, scale, area, comm) -> None:
        """After the in-domain all-reduce: this domain's partial (x) to every rail peer, theirs into slots, the sum."""
        buf, rails = self._buf, self.rails
        n_dom, sym = self.domain, buf.sym.base
        slots, nbytes = area + layout.slots_offset, numel * 4
        own = slots + n_dom * layout.slot_bytes
        self._copy(sym + own, x_ptr, nbytes, comm)
        sends = {m: [(own, own, nbytes)] for m in rails.rails.peer_domains}
        recvs = {m: [(slots + m * layout.slot_bytes, slots + m * layout.slot_bytes, nbytes)]
                 for m in rails.rails.peer_domains}
        rails.exchange(plan_ranges(rails.rails, 'all-reduce', sends, recvs), comm)
        self.hybrid_kernels[('sum', False)].launch(
            self._grid(numel), THREADS, stream=comm, out=x_ptr, own=x_ptr, slots=sym + slots,
            slot_bytes=layout.slot_bytes, num_domains=self.num_domains, domain=n_dom, num_elems=numel,
            scale=float(scale))
