"""What an all-gather call's tensor signatures decide in the session's state (features/agrs/feature.py looks it up
per call): the argument checks, the regions, the grids, the packed launch arguments and the output views."""

import struct
from functools import partial
from typing import NamedTuple, Optional, Tuple

from ...runtime import checks
from .kernels import GATHER_BATCH
from .plan import gather_grid, gather_meta

# agrs_gather_batch_kernel's num_bytes0..7, region_offset0..7 and num_tensors: one contiguous run of its argument block
# (features/agrs/kernels.py `gather_batch_spec`; the feature checks the layout when it binds the launch).
BATCH_PACK = struct.Struct(f'={GATHER_BATCH}q{GATHER_BATCH}Qi')


class GatherTensor(NamedTuple):
    """One tensor of an all-gather call in the session's state (`gather_entry`)."""
    slot_ptr: int                       # this rank's slot of its region (the address of an in-place source)
    num_bytes: int
    region_offset: int                  # its region's offset from the start of the session area
    grid: Tuple[int, int, int]          # its gather's grid for a 16-byte aligned source
    byte_grid: Tuple[int, int, int]     # for any other source (the byte path)
    aligned: bool                       # num_bytes is a multiple of 16


class GatherPlan(NamedTuple):
    """What the rarer paths of an all-gather call read of its entry (`gather_entry`'s last field)."""
    kind: str                           # 'torch' or 'cupy'
    tensors: Tuple[GatherTensor, ...]
    free_start: int                     # the session area's free part starts here (an address)
    regions: tuple                      # the tensors' regions (`plan.peek`)
    batches: Optional[tuple]            # `gather_batches`' launches (None in hybrid mode)


def single_batch_pack(per, mask: int, tail: tuple) -> tuple:
    """A call of at most GATHER_BATCH tensors `per` (as in `gather_entry`) in one launch: `(struct, constants)` such
    that `struct.pack_into(block, 0, *sources, *constants, epoch, meta)` writes agrs_gather_batch_kernel's whole
    argument block: the first num_tensors sources, zeros for the other source slots, the sizes, offsets, count, the
    write_local_mask `mask`, `tail` (peer_bases and rank, as bound), do_signal = 1, epoch and meta (one run without
    padding; the feature checks that when it binds)."""
    n = len(per)
    assert 0 < n <= GATHER_BATCH, n
    pad = (0,) * (GATHER_BATCH - n)
    return (struct.Struct(f'={n}Q{8 * (GATHER_BATCH - n)}x{GATHER_BATCH}q{GATHER_BATCH}QiIQiiII'),
            (*[f.num_bytes for f in per], *pad, *[f.region_offset for f in per], *pad, n, mask, *tail, 1))


def gather_batches(per) -> tuple:
    """The launches of a call's tensors `per` (as in `gather_entry`): `(first, end, packed sizes, offsets and count,
    grid for 16-byte aligned sources)` per GATHER_BATCH tensors; the grid is the largest any of them needs."""
    out = []
    for lo in range(0, len(per), GATHER_BATCH):
        chunk = per[lo:lo + GATHER_BATCH]
        pad = [0] * (GATHER_BATCH - len(chunk))
        pack = BATCH_PACK.pack(*[f.num_bytes for f in chunk], *pad, *[f.region_offset for f in chunk], *pad,
                               len(chunk))
        grid = (max([(f.grid if f.aligned else f.byte_grid)[0] for f in chunk]), 1, 1)
        out.append((lo, lo + len(chunk), pack, grid))
    return tuple(out)


def gather_entry(feature, items, single: bool, metas, key):
    """What an `all_gather` call of `feature` (the AGRS feature) with these signatures decides in the session's
    current state (`key`): its argument checks (raising before anything runs) and, first what every call reads,
    `(the one launch's pack (`single_batch_pack`'s struct bound to the block at 0, its constants for `mask`, the grid
    if 16-byte aligned; None in hybrid mode or for more than GATHER_BATCH tensors), mask (every tensor copied), the
    highest source address that cannot reach the free area, free area end, the session's bytes and gathers after
    it, meta, outputs, whether the sources are torch tensors (tracked by the wait handle), `GatherPlan` (kind, a
    `GatherTensor` per tensor, free area start, regions, the launches))`; remembered when every signature is one
    (`interop.meta`).
    Sets the pointers of `metas` that `interop.meta` could not read."""
    buf, plan = feature._buf, feature.plan
    if not items:
        raise ValueError('tensors must be a tensor or a non-empty list of tensors')
    facts = []
    known = feature._infos
    for i, (t, (sig, _)) in enumerate(zip(items, metas)):
        f = known.get(sig)
        if f is None:
            name = 'tensors' if single else f'tensors[{i}]'
            info = checks.info(t, name, buf.device)
            checks.check_contiguous(info, name)
            f = (info.kind, info.nbytes, info.dtype, tuple(info.shape))
            if type(sig) is not object:
                known[sig] = f
            metas[i] = (sig, info.ptr)       # (`interop.meta` gives no pointer for other array types)
        if facts and f[0] != facts[0][0]:
            raise TypeError(f'tensors[{i}] is a {f[0]} array but the other inputs are {facts[0][0]} arrays; '
                            f'pass one kind')
        facts.append(f)
    sizes = [f[1] for f in facts]
    regions = plan.peek(sizes)
    rank, num_ranks, base, area, num_sms = buf.rank_idx, buf.num_ranks, feature.data_base, feature.area_offset, \
        feature.num_sms
    per = tuple(GatherTensor(base + r.offset + rank * n, n, area + r.offset, (gather_grid(n, True, num_sms), 1, 1),
                             (gather_grid(n, False, num_sms), 1, 1), n % 16 == 0) for n, r in zip(sizes, regions))
    kind = facts[0][0]
    outputs = tuple([feature._gathered(kind, r.offset, num_ranks * f[1], f[2], (num_ranks, *f[3]))
                     for f, r in zip(facts, regions)])
    end = regions[-1].end
    batches = None if feature.hybrid else gather_batches(per)
    mask = (1 << len(sizes)) - 1
    pack = consts = grid = None
    if batches is not None and len(batches) == 1:
        b = feature._batch_launch or feature._bind_batch_launch()
        layout, consts = single_batch_pack(per, mask, feature._batch_tail)
        pack, grid = partial(layout.pack_into, b.data, 0), batches[0][3]
    free_start = base + plan.used_bytes
    # A source at or below `free_start - max(sizes)` ends before the free area (it is neither an in-place slot, which
    # lies in the free area, nor overlapping it): a call whose sources all lie there, or all at or above the area's end,
    # copies every tensor without looking at each.
    e = (pack, consts, grid, mask, free_start - max(sizes), base + plan.capacity, end, plan.num_gathers + len(sizes),
         gather_meta(end), outputs, kind == 'torch', GatherPlan(kind, per, free_start, regions, batches))
    if not any(type(m[0]) is object for m in metas):
        entries = feature._gather_entries
        if len(entries) >= 256:
            entries.clear()
        entries[key] = e
    return e
