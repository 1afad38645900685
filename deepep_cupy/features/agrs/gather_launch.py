"""The launches of an all-gather call (features/agrs/feature.py `AGRS.all_gather`): agrs_gather_batch_kernel's bound
launch per GATHER_BATCH tensors in a single domain, agrs_gather_kernel's for hybrid mode's steps (hybrid.py)."""

import operator
import struct
from functools import reduce
from typing import List, NamedTuple

from .gather_entry import BATCH_PACK, GatherTensor, single_batch_pack
from .kernels import GATHER_BATCH, THREADS


class GatherLaunchIndex(NamedTuple):
    """The words of agrs_gather_kernel's arguments that hybrid mode patches per launch (its parameter names)."""
    src: int
    num_bytes: int
    region_offset: int
    write_local: int
    do_signal: int
    epoch: int
    meta: int


class BatchIndex(NamedTuple):
    """Where the per-call arguments of agrs_gather_batch_kernel's block go (`GatherLaunches._bind_batch_launch`)."""
    src_packs: List[struct.Struct]      # [n]: the struct of the first n sources (from the block's start)
    packed: slice                       # bytes of the sizes, offsets and count (`gather_entry.BATCH_PACK`)
    write_local_mask: int               # u32 word
    do_signal: int                      # i32 word
    epoch: int                          # u32 word
    meta: int                           # u32 word


class GatherLaunches:
    """Mixed into `AGRS` (uses `_buf`, `kernels`, `_gather_launch`, `_batch_launch`, `_batch_grid`)."""

    def _single_gather_launch(self):
        """agrs_gather_kernel's bound launch (hybrid mode: one launch per tensor and step, re-patched each time)."""
        g = self._gather_launch
        if g is None:
            buf = self._buf
            g = self._gather_launch = self.kernels['gather'].bind(
                1, THREADS, src=0, num_bytes=0, region_offset=0, peer_bases=buf.sym.peer_bases_ptr,
                rank=buf.sym.local_idx, write_local=0, do_signal=0, epoch=0, meta=0, meta_word=0)
            self._gather_launch_idx = GatherLaunchIndex._make(g.index(n) for n in GatherLaunchIndex._fields)
        return g

    def _bind_batch_launch(self):
        """agrs_gather_batch_kernel's bound launch (packed by name once; calls patch the sources, sizes, offsets,
        count, mask, signal, epoch and meta by position, checked here)."""
        buf = self._buf
        table = {f'{f}{i}': 0 for i in range(GATHER_BATCH) for f in ('src', 'num_bytes', 'region_offset')}
        b = self.kernels['gather_batch'].bind(
            1, THREADS, **table, num_tensors=0, write_local_mask=0, peer_bases=buf.sym.peer_bases_ptr,
            rank=buf.sym.local_idx, do_signal=0, epoch=0, meta=0)
        start = b.index('num_bytes0') * 8
        # The packed runs `gather_entry` makes: the sources, the sizes, the offsets, the count and the mask,
        # contiguous from the start of the block; the signal flag, epoch and meta, contiguous too; and for the one
        # launch of a call (`single_batch_pack`) the whole block, peer_bases and rank (re-packed as bound) in between.
        assert b.index('src0') == 0 and start == 8 * GATHER_BATCH, 'agrs_gather_batch_kernel: the sources come first'
        assert b.index('region_offset0') * 8 == start + 8 * GATHER_BATCH and \
            b.index('num_tensors') * 4 == start + 16 * GATHER_BATCH and \
            b.index('write_local_mask') == b.index('num_tensors') + 1, 'agrs_gather_batch_kernel argument layout'
        tail = b.index('do_signal')
        assert b.index('epoch') == tail + 1 and b.index('meta') == tail + 2, 'agrs_gather_batch_kernel argument layout'
        assert b.index('peer_bases') * 2 == b.index('write_local_mask') + 1 and \
            b.index('rank') == b.index('peer_bases') * 2 + 2 and tail == b.index('rank') + 1 and \
            single_batch_pack((GatherTensor(0, 0, 0, (1, 1, 1), (1, 1, 1), True),), 0, (0, 0))[0].size == \
            4 * (tail + 3), \
            'agrs_gather_batch_kernel argument layout'
        src_pack = [struct.Struct(f'={n}Q') for n in range(GATHER_BATCH + 1)]     # the first n sources
        self._batch_idx = BatchIndex(src_pack, slice(start, start + BATCH_PACK.size), b.index('write_local_mask'),
                                     tail, tail + 1, tail + 2)
        self._batch_bytes = memoryview(b.data).cast('B')
        self._batch_tail = (b.u64[b.index('peer_bases')], b.i32[b.index('rank')])     # (as bound)
        self._batch_launch = b
        return b

    def _gather_batches(self, comm, batches, per, ptrs, mask: int, epoch: int, meta: int) -> None:
        """The launches of one all-gather call of more than GATHER_BATCH tensors (single domain; fewer take
        `AGRS.all_gather`'s one-launch path): agrs_gather_batch_kernel per GATHER_BATCH tensors (`batches`:
        `gather_entry`'s (first tensor, end, packed sizes / offsets / count, grid) each), the last one signalling. Per
        call only the sources, the in-place mask, the epoch and meta are patched."""
        b = self._batch_launch or self._bind_batch_launch()
        src_pack, packed, i_mask, i_signal, i_epoch, i_meta = self._batch_idx
        u32, data = b.u32, b.data
        u32[i_epoch], u32[i_meta] = epoch, meta
        misaligned = reduce(operator.or_, ptrs, 0) & 15
        last = len(batches) - 1
        for j, (lo, hi, pack, grid) in enumerate(batches):
            src_pack[hi - lo].pack_into(data, 0, *ptrs[lo:hi])
            self._batch_bytes[packed] = pack
            u32[i_mask], b.i32[i_signal] = (mask >> lo) & 0xFF, 1 if j == last else 0
            b.grid = self._batch_grid = grid if not misaligned else self._misaligned_grid(per, ptrs, lo, hi)
            b(comm)

    @staticmethod
    def _misaligned_grid(per, ptrs, lo: int, hi: int):
        """The grid of tensors lo..hi-1 when a source is off 16 bytes (it takes the byte path, with its own grid)."""
        return (max([(f.grid if f.aligned and not ptr & 15 else f.byte_grid)[0]
                     for ptr, f in zip(ptrs[lo:hi], per[lo:hi])]), 1, 1)
