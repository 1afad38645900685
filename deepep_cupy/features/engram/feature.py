"""Engram: the feature of a buffer (plan.py: declarations, sizes, layout; `kernels_cu/engram.cu`: the protocol).

Upstream fetches rows with RDMA reads; here the fetch kernel reads the owners' storage directly: GPU storage (the
symmetric buffer, over NVLink) or host storage (`runtime/host_storage.py`: pinned host segments every rank of the
domain has mapped). One kernel serves both: it takes a table of the ranks' storage addresses. DeepEP V2.0's single
table (`engram_write` / `engram_fetch`) is the one-layer case of V2.5's layered tables (`set_config`, `write`,
`fetch` of `[layers, T, n]` indices).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...jit.launch import load_kernels
from ...runtime import checks, interop
from ...runtime.event import EventHandle
from ...runtime.host_range import HostRange
from ...runtime.sizes import align
from ...runtime.streams import DeferredRecord
from .hooks import EngramFetchHook, SoleFetchHook
from .plan import (
    HOST_RANGE_OFFSET,
    RANGE_SPEC,
    SF_DTYPES,
    TABLE_DTYPES,
    THREADS,
    EngramLayout,
    all_specs,
    check_entries,
    fetch_args,
    fetch_spec,
    grid_for,
    layer_words,
    table_dtype_name,
    write_args,
    write_spec,
)

DATA_REGION_OWNER = 'engram'


class _Fetch:
    """A fetch signature's checks and launch (the indices' kind, shape, strides, dtype and device, num_qps, the
    scale factors' layout, layered), valid while the tables (layout, scale factors, device arrays) stay. The launch
    is bound by the first call that passes the index range check (`bind`)."""

    __slots__ = ('layout', 'sf', 'device', 'kind', 'stream', 'num_layers', 'num_tokens', 'n', 'rows',
                 'numel', 'bind', 'launch', 'i_indices', 'i_sf_out', 'outputs', 'no_sf', 'num_global_entries',
                 'col_major', 'layered')

    def __init__(self, tables: tuple, kind: str, stream, num_layers: int, num_tokens: int, n: int, rows: int,
                 numel: int, bind):
        self.layout, self.sf, self.device = tables      # what it was bound for, compared by identity
        self.kind, self.stream = kind, stream
        self.num_layers, self.num_tokens, self.n, self.rows, self.numel = num_layers, num_tokens, n, rows, numel
        self.bind, self.launch, self.i_indices, self.i_sf_out = bind, None, 0, 0
        self.outputs = None         # the layers' output views (`Engram._output`), made by the first call
        self.no_sf = [None] * num_layers
        self.num_global_entries = tables[0].num_global_entries
        self.col_major = self.layered = False      # (the call's flags, set by `Engram._plan_fetch`)


def _layer_hooks(c: _Fetch, datas, sf_outs, event, indices, keep, record, current, comm) -> List[EngramFetchHook]:
    """The hooks of a fetch of several layers (`c`), one per layer: `datas` (and `sf_outs`) its outputs; the hooks
    share one deferred record of `record` (torch: the arrays used on `comm`, allocated on `current`)."""
    deferred = DeferredRecord(record, current, comm) if record else None
    if not c.layered or c.sf is not None:
        return [EngramFetchHook(event, indices, (data, sf), keep, deferred) for data, sf in zip(datas, sf_outs)]
    return [EngramFetchHook(event, indices, data, keep, deferred) for data in datas]


class Engram:
    """The engram feature of one buffer: the tables' layout, where the storage is, a private copy of the replicated
    scale factors, views of the fetch output and the index range check.

    Args:
        buf: the buffer (a `BufferBase`).
        out_region: `(symmetric offset, bytes)` of the fetch output. None: DeepEP V2.0's split of the data region
            (tables at its end, the output before them; or, with `host_storage`, the whole data region).
        storage_region: `(symmetric offset, bytes)` of GPU storage for the tables (V2.5 `EngramBuffer`).
        host_storage: a `HostStorage` holding the tables in host memory instead.
    """

    def __init__(self, buf, out_region: Optional[Tuple[int, int]] = None,
                 storage_region: Optional[Tuple[int, int]] = None, host_storage: Any = None):
        self._buf = buf
        self._out_region, self._storage_region, self.host_storage = out_region, storage_region, host_storage
        self.layout: Optional[EngramLayout] = None         # set by `configure` (V2.5) or by the first write (V2.0)
        self.configured = False
        self.written = False
        self.sf: Any = None                 # private copy of every layer's replicated scale factors, or None
        self.sf_dtype: Optional[str] = None
        self.num_sf = 0
        self._device: dict = {}             # device arrays of the written layout: 'layers', 'table_bases'
        self._out_views: dict = {}
        self._host_range: Optional[HostRange] = None
        self._loaded: Optional[Dict[str, Any]] = None
        self._fetch_kernel = None
        self._fetch_calls: Dict[tuple, _Fetch] = {}     # a fetch's call signature -> its checked, bound launch

    def destroy(self) -> None:
        self.layout, self.sf, self._out_views, self._device, self.host_storage = None, None, {}, {}, None

    def _kernels(self):
        if self._loaded is None:       # kept: building the specs and their names costs ~20 us per call
            self._loaded = load_kernels(all_specs(self._buf.num_scaleup_ranks))
        return self._loaded

    # ---- layout ------------------------------------------------------------------------------------------------
    def _layout_for(self, num_entries_per_layer, hidden: int, dtype: str) -> EngramLayout:
        buf = self._buf
        if self._out_region is None and self.host_storage is None and self._storage_region is None:
            (num_entries,) = num_entries_per_layer
            return EngramLayout.in_data_region(buf.data_offset, buf.num_bytes, buf.num_scaleup_ranks, num_entries,
                                               hidden, dtype)
        out = self._out_region or (buf.data_offset, buf.num_bytes)
        if self.host_storage is not None:
            return EngramLayout.build(buf.num_scaleup_ranks, num_entries_per_layer, hidden, dtype, out, None,
                                      self.host_storage.num_bytes)
        offset, num_bytes = self._storage_region
        return EngramLayout.build(buf.num_scaleup_ranks, num_entries_per_layer, hidden, dtype, out, offset, num_bytes)

    def configure(self, num_entries_per_layer, hidden: int, dtype: Any = 'bfloat16', num_sf_packs: int = 0,
                  num_max_rows: int = 0) -> None:
        """Fix the tables' shapes (V2.5 `set_config`; collective: every rank passes the same values).

        Args:
            num_entries_per_layer: entries per rank of each layer's table.
            hidden: elements per row; dtype: bfloat16 or float8_e4m3fn.
            num_sf_packs: 4-byte scale-factor packs per entry of FP8 tables (0: none).
            num_max_rows: rows one fetch returns per layer (tokens x entries per token), checked against the output.
        """
        buf = self._buf
        entries = check_entries(num_entries_per_layer)
        checks.check_int('hidden', hidden, 1)
        checks.check_int('num_sf_packs', num_sf_packs)
        checks.check_int('num_max_rows', num_max_rows)
        name = table_dtype_name(dtype)
        # Compare first: with equal arguments every rank passes (or fails) the checks below alike.
        buf.group.check_same('engram set_config(num_entries_per_layer, hidden, dtype, num_sf_packs, rows)',
                             (entries, hidden, name, num_sf_packs, num_max_rows), timeout=buf.num_cpu_timeout_secs)
        if (hidden * TABLE_DTYPES[name]) % 16:
            raise ValueError(f'hidden * itemsize must be a multiple of 16 bytes, got {hidden} x {name}')
        if num_sf_packs and name != 'float8_e4m3fn':
            raise ValueError('num_sf_packs: scale factors belong to float8_e4m3fn tables')
        if max(entries) * buf.num_scaleup_ranks >= 2 ** 31:
            raise ValueError(f'num_entries_per_layer: {max(entries)} entries per rank x {buf.num_scaleup_ranks} ranks '
                             f'overflow int32 global indices')
        layout = self._layout_for(entries, hidden, name)
        layout.check_fetch(layout.num_layers, num_max_rows, 1)
        if self._out_region is None:
            buf.claim_data_region(DATA_REGION_OWNER)
        self.layout, self.configured, self.written = layout, True, False
        self.num_sf = num_sf_packs
        self._device, self._out_views = {}, {}

    # ---- write -------------------------------------------------------------------------------------------------
    def _check_layer(self, storage, sf, layer: int, num_layers: int):
        buf = self._buf
        tag = '' if num_layers == 1 else f'[{layer}]'
        si = checks.info(storage, f'storage{tag}', buf.device)
        dtype = table_dtype_name(si.dtype) if si.kind == 'cupy' else si.dtype
        if dtype not in TABLE_DTYPES:
            raise TypeError(f'storage{tag} must be bfloat16 or float8_e4m3fn, got {si.dtype}')
        if si.ndim != 2:
            raise ValueError(f'storage{tag} must be 2-D [num_entries, hidden], got {list(si.shape)}')
        checks.check_contiguous(si, f'storage{tag}')
        num_entries, hidden = si.shape
        if num_entries < 1 or (hidden * TABLE_DTYPES[dtype]) % 16 or hidden < 1:
            raise ValueError(f'storage{tag}: need num_entries >= 1 and hidden * itemsize a positive multiple of 16 '
                             f'bytes, got {num_entries} x {hidden} {dtype}')
        if si.ptr % 16:
            raise ValueError(f'storage{tag} must start at a 16-byte aligned address')
        if num_entries * buf.num_scaleup_ranks >= 2 ** 31:
            raise ValueError(f'storage{tag}: {num_entries} entries per rank x {buf.num_scaleup_ranks} ranks overflow '
                             f'int32 global indices')
        sfi = None
        if sf is not None:
            if dtype != 'float8_e4m3fn':
                raise ValueError(f'sf{tag}: scale factors belong to float8_e4m3fn tables; pass sf=None for bfloat16')
            sfi = checks.info(sf, f'sf{tag}', buf.device)
            checks.check_same_kind(si.kind, sfi, f'sf{tag}')
            checks.check_dtype(sfi, f'sf{tag}', *SF_DTYPES)
            total = num_entries * buf.num_scaleup_ranks
            if sfi.ndim != 2 or sfi.shape[0] != total or sfi.shape[1] < 1:
                raise ValueError(f'sf{tag} must be [num_ranks * num_entries = {total}, num_packs] (replicated on every '
                                 f'rank), got {list(sfi.shape)}')
            checks.check_contiguous(sfi, f'sf{tag}')
        return si, sfi, dtype

    def _check_write(self, storages: Sequence[Any], sfs: Optional[Sequence[Any]]):
        """Local checks of a write: `(layout, storage infos, sf infos or None)`."""
        if not storages:
            raise ValueError('storages must hold one table per layer')
        if sfs is not None and len(sfs) != len(storages):
            raise ValueError(f'sfs has {len(sfs)} entries but storages has {len(storages)} (one per layer)')
        infos = [self._check_layer(s, None if sfs is None else sfs[i], i, len(storages))
                 for i, s in enumerate(storages)]
        sis, sfis = [i[0] for i in infos], [i[1] for i in infos]
        dtypes_, hiddens = {i[2] for i in infos}, {si.shape[1] for si in sis}
        if len(dtypes_) > 1 or len(hiddens) > 1 or len({si.kind for si in sis}) > 1:
            raise ValueError('storages: every layer must have the same hidden size, dtype and array kind')
        if len({sfi is None for sfi in sfis}) > 1 or len({(sfi.shape[1], sfi.dtype) for sfi in sfis if sfi}) > 1:
            raise ValueError('sfs: give scale factors for every layer or for none, all with the same packs and dtype')
        entries, hidden, dtype = tuple(si.shape[0] for si in sis), sis[0].shape[1], infos[0][2]
        if self.configured:
            layout = self.layout
            if (entries, hidden, dtype) != (layout.num_entries, layout.hidden, layout.dtype):
                raise ValueError(f'storages: set_config gave {list(layout.num_entries)} entries x {layout.hidden} '
                                 f'{layout.dtype}, got {list(entries)} x {hidden} {dtype}')
            if self.num_sf and (sfis[0] is None or sfis[0].shape[1] != self.num_sf):
                raise ValueError(f'sfs: set_config gave num_sf_packs={self.num_sf}; pass [num_ranks * num_entries, '
                                 f'{self.num_sf}] scale factors for every layer')
        else:
            layout = self._layout_for(entries, hidden, dtype)
        return layout, sis, (None if sfis[0] is None else sfis)

    def write(self, storages: Sequence[Any], sfs: Optional[Sequence[Any]] = None) -> None:
        """Copy this rank's rows of every layer into its storage (collective over the domain: every rank calls it with
        tables of the same shapes and dtype). Waits until no peer still fetches from the old tables, and returns once
        the current stream is ordered after every rank's new tables (fetches issued later see them).

        Args:
            storages: per layer, `[num_entries, hidden]` bfloat16 or float8_e4m3fn (CuPy: uint16 / uint8),
                contiguous, on this GPU; `hidden * itemsize` a multiple of 16 bytes.
            sfs: for float8 tables, per layer the scale factors of EVERY rank's rows, replicated on every rank:
                `[num_ranks * num_entries, num_packs]` float32 (or int32 packed UE8M0), contiguous. None: no scales.
        """
        buf = self._buf
        buf.check_usable()
        if buf.num_scaleout_ranks > 1:
            raise NotImplementedError('engram over several scale-up domains (RDMA) is not implemented; the tables are '
                                      'read inside one domain')
        error, signature = None, None
        try:
            layout, sis, sfis = self._check_write(storages, sfs)
            signature = (layout.num_entries, layout.hidden, layout.dtype,
                         None if sfis is None else (sfis[0].shape[1], sfis[0].dtype))
        except (ValueError, TypeError) as e:
            error = e
        everyone = buf.group.allgather_object((None if error is None else repr(error), signature),
                                              timeout=buf.num_cpu_timeout_secs)
        if error is not None:
            raise error
        bad = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
        if bad:
            raise ValueError(f'engram write: rank {bad[0][0]} rejected its arguments ({bad[0][1]})')
        if any(s != signature for _, s in everyone):
            detail = '; '.join(f'rank {r}: {s}' for r, (_, s) in enumerate(everyone))
            raise ValueError(f'engram write: every rank must write tables of the same shapes and dtype (and pass sf '
                             f'alike): (num_entries, hidden, dtype, (num_packs, sf dtype)) = {detail}')
        if self._out_region is None:
            buf.claim_data_region(DATA_REGION_OWNER)

        kind = sis[0].kind
        write = self._kernels()[write_spec(buf.num_scaleup_ranks).name]
        current = interop.current_stream(storages[0])
        comm = buf.stream_order.begin(current)
        sf_copy, sf_rows = self._copy_sf(sfis, kind, comm)
        base = self.host_storage.base if self.host_storage is not None else buf.sym.base + layout.storage_offset
        for layer, storage in enumerate(storages):
            write.launch(grid_for(layout.num_entries[layer] * layout.row_bytes // 16, buf.num_device_sms), THREADS,
                         stream=comm, **write_args(layout, layer, storage, base, buf.sym.peer_bases_ptr,
                                                   buf.sym.local_idx, buf.host_mapped.ptr, buf.timeout_ns))
        self._device = self._device_arrays(layout, sf_rows)
        # The caller may reuse the storages (and sfs) right after: order its stream after the copies.
        buf.stream_order.end(current)
        self.layout, self.sf, self.written = layout, sf_copy, True
        self.sf_dtype, self.num_sf = (None, self.num_sf) if sfis is None else (sfis[0].dtype, sfis[0].shape[1])
        self._out_views = {}

    def _copy_sf(self, sfis, kind: str, comm):
        """A private copy of every layer's replicated scale factors, one table (rows of layer l from row
        `offsets[l]`), made on the communication stream; `(copy, offsets)` or `(None, None)`."""
        if sfis is None:
            return None, None
        import cupy
        offsets = list(np.cumsum([0] + [sfi.shape[0] for sfi in sfis[:-1]]))
        copy = interop.Allocator(kind).empty((sum(sfi.shape[0] for sfi in sfis), sfis[0].shape[1]), sfis[0].dtype,
                                             stream=comm)
        dst = interop.tensor_info(copy).ptr
        row_bytes = sfis[0].shape[1] * 4
        for offset, sfi in zip(offsets, sfis):
            cupy.cuda.runtime.memcpyAsync(dst + int(offset) * row_bytes, sfi.ptr, sfi.nbytes,
                                          cupy.cuda.runtime.memcpyDefault, comm.ptr)
        return copy, [int(o) for o in offsets]

    def _device_arrays(self, layout: EngramLayout, sf_rows) -> dict:
        """The fetch kernel's per-layer words and the table of the ranks' storage addresses, on this GPU."""
        import cupy
        if self.host_storage is not None:
            bases = self.host_storage.addrs
        else:
            bases = [b + layout.storage_offset for b in self._buf.sym.peer_bases]
        return {'layers': cupy.asarray(layer_words(layout, sf_rows)),
                'table_bases': cupy.asarray(np.array(bases, dtype=np.uint64))}

    # ---- fetch -------------------------------------------------------------------------------------------------
    def _output(self, kind: str, num_layers: int, num_tokens: int, width: int) -> List[Any]:
        """Per layer, a `[num_tokens, width]` view of the fetch output area in the tables' dtype (torch or CuPy)."""
        layout = self.layout
        views = self._out_views
        key = (kind, num_layers, num_tokens, width)
        out = views.get(key)        # the same views for every fetch of this shape (reset with the tables)
        if out is not None:
            return out
        if kind not in views:
            u8 = self._buf.sym.local_view(layout.out_offset, layout.out_bytes)
            views[kind] = interop.to_torch(u8) if kind == 'torch' else u8
        nbytes = num_tokens * width * TABLE_DTYPES[layout.dtype]
        out = []
        for layer in range(num_layers):
            flat = views[kind][layer * nbytes:(layer + 1) * nbytes]
            if kind == 'torch':
                import torch
                out.append(flat.view(getattr(torch, layout.dtype)).view(num_tokens, width))
            else:
                out.append(flat.view(np.uint16 if layout.dtype == 'bfloat16' else np.uint8).reshape(num_tokens, width))
        if len(views) >= 64:
            views.clear()
        views[key] = out
        return out

    def _index_range(self, indices, ptr: int, numel: int, stream):
        """Start reading (min, max) of `indices` (at `ptr`, `numel` values) back to the host (`HostRange`: one small
        kernel on `stream`, no stream synchronisation); returns a function that waits for them."""
        host_range = self._host_range or self._start_range()
        return host_range.start(self._range_kernel, ptr, numel, stream, self._buf.num_cpu_timeout_secs,
                                self._range_what)

    def _start_range(self) -> HostRange:
        """The index range check's `HostRange` and kernel (made by the first checked fetch)."""
        buf = self._buf
        self._host_range = HostRange(buf.host_mapped, HOST_RANGE_OFFSET)
        self._range_kernel = self._kernels()[RANGE_SPEC.name]
        self._range_what = f'engram fetch on rank {buf.rank_idx} (indices)'
        return self._host_range

    def _plan_fetch(self, indices, num_qps: int, col_major: bool, layered: bool, tables: tuple) -> _Fetch:
        """The checks of a fetch that depend on its signature only, and its launch bound by name."""
        buf, layout = self._buf, self.layout
        ii = checks.info(indices, 'indices', buf.device)
        checks.check_dtype(ii, 'indices', 'int32')
        want = 3 if layered else 2
        if ii.ndim != want:
            shape = '[num_layers, num_tokens, num_entries_per_token]' if layered else \
                '[num_tokens, num_entries_per_token]'
            raise ValueError(f'indices must be {want}-D {shape}, got {list(ii.shape)}')
        checks.check_contiguous(ii, 'indices')
        checks.check_int('num_qps', num_qps)
        num_layers, num_tokens, n = ii.shape if layered else (1, *ii.shape)
        rows = layout.check_fetch(num_layers, num_tokens, n)
        sf_strides = (0, 0, 0)
        if self.sf is not None:
            width, padded = n * self.num_sf, align(num_tokens, 4)
            sf_strides = (width * padded, 1, padded) if col_major else (num_tokens * width, width, 1)

        def bind(c: _Fetch, iptr: int):
            """The launch (bound by the first call that passed the range check) with the indices' address `iptr`."""
            fetch = self._fetch_kernel
            if fetch is None:
                fetch = self._fetch_kernel = self._kernels()[fetch_spec(buf.num_scaleup_ranks).name]
            dev = self._device
            b = c.launch = fetch.bind(
                grid_for(num_layers * rows * (layout.row_bytes // 16), num_qps or buf.num_device_sms), THREADS,
                **fetch_args(layout, 0, num_layers, num_tokens, n, int(dev['layers'].data.ptr),
                             int(dev['table_bases'].data.ptr), buf.sym.base + layout.out_offset, self.sf, self.num_sf,
                             None, sf_strides))
            c.i_indices, c.i_sf_out = b.index('indices'), b.index('sf_out')
            b.u64[c.i_indices] = iptr
            return b
        c = _Fetch(tables, ii.kind, interop.stream_getter(ii.kind, ii.device), num_layers, num_tokens, n, rows,
                   ii.numel, bind)
        c.col_major, c.layered = col_major, layered
        return c

    def fetch(self, indices, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False,
              check_indices: bool = True, layered: bool = False) -> List[EngramFetchHook]:
        """Gather rows of the domain's tables (not collective: each rank fetches on its own).

        Args:
            indices: `[num_layers, num_tokens, num_entries_per_token]` (`layered`) or `[num_tokens,
                num_entries_per_token]` (one table) int32, contiguous, on this GPU; global entry ids in
                `[0, num_ranks * num_entries)` of their layer.
            num_qps: blocks of the fetch kernel (upstream: RDMA queue pairs); 0: every SM, fewer for small fetches.
            use_tma_aligned_col_major_sf: scale factors column-major with the token dimension padded to 4.
            check_indices: read the indices' range back before the launch (the host waits for the current stream to
                reach this call) and raise ValueError if one is outside `[0, num_ranks * max(num_entries))`. Rows of
                indices outside their own layer's range come out zero.
            layered: the indices have a layer dimension; the hooks then return `data` or `(data, sf)` (V2.5),
                else `(data, sf)` (V2.0).

        Returns:
            one hook per layer; `hook()` makes the current stream wait. `data` is `[num_tokens,
            num_entries_per_token * hidden]` in the tables' dtype, a view of this buffer's fetch output area (valid
            until the next fetch on this buffer); `sf` is `[num_tokens, num_entries_per_token * num_packs]`
            (float32 / int32, new memory), None without scale factors.

        Calls are checked and their launch bound once per signature (`_plan_fetch`); a repeated call patches the
        indices' (and the scale-factor output's) address.
        """
        buf = self._buf
        if buf._destroyed or buf._failed is not None or buf.error_record[0]:
            buf.check_usable()          # (its three conditions read here first: the call costs ~1 us)
        # (the flags enter the key as given: values that compare equal have equal truth values)
        if type(indices) is interop.TORCH_TENSOR[0]:      # (`interop.meta` inline; its signature spliced in below)
            key = (indices.shape, indices.stride(), indices.dtype, indices.get_device(), num_qps, type(num_qps),
                   use_tma_aligned_col_major_sf, layered)
            iptr = indices.data_ptr()
        else:
            sig, iptr = interop.meta(indices)
            key = (*sig, num_qps, type(num_qps), use_tma_aligned_col_major_sf, layered) if type(sig) is tuple else \
                (sig, num_qps, type(num_qps), use_tma_aligned_col_major_sf, layered)
        c = self._fetch_calls.get(key)
        layout, sf_table, device_arrays = self.layout, self.sf, self._device
        if c is None or c.layout is not layout or c.sf is not sf_table or c.device is not device_arrays:
            c = self._new_fetch(key, indices, num_qps, use_tma_aligned_col_major_sf, layered)
        kind, rows = c.kind, c.rows
        current = c.stream()
        # The range check needs the GPU: start it first, do the host work that launches nothing meanwhile (the
        # outputs, the communication stream's wait for this stream, the indices' address); raise before the launch.
        wait_range = self._index_range(indices, iptr, c.numel, current) if check_indices and rows else None
        datas = c.outputs
        if datas is None:
            datas = c.outputs = self._output(kind, c.num_layers, c.num_tokens, c.n * layout.hidden)
        if sf_table is None:
            sf_outs, sf_out = c.no_sf, None
        else:
            sf_outs, sf_out, _ = self._sf_outputs(kind, c.num_layers, c.num_tokens, c.n, c.col_major)
        b = c.launch        # (bound by the first call that passed the range check)
        if rows:
            comm = buf.stream_order.begin(current)
            if b is not None:
                b.u64[c.i_indices] = iptr
        if wait_range is not None:
            lo, hi = wait_range()
            if lo < 0 or hi >= c.num_global_entries:
                raise ValueError(f'indices must be in [0, {c.num_global_entries}) (num_ranks x num_entries), '
                                 f'got min {lo}, max {hi}')
        event, keep, record = None, (), ()
        if rows:
            if b is None:
                b = c.bind(c, iptr)
            if sf_out is not None:
                b.u64[c.i_sf_out] = sf_out.data_ptr() if kind == 'torch' else sf_out.data.ptr
            b(comm)
            if kind == 'torch':     # (`indices` and `sf_out` are allocated on `current`, used on `comm`)
                record = (indices,) if sf_out is None else (indices, sf_out)
            event, keep = EventHandle(comm), (indices, sf_table, device_arrays)
        if len(datas) == 1:
            result = datas[0] if c.layered and sf_table is None else (datas[0], sf_outs[0])
            return [SoleFetchHook(event, indices, result, keep, record, current, comm if rows else None)]
        return _layer_hooks(c, datas, sf_outs, event, indices, keep, record, current, comm if rows else None)

    def _new_fetch(self, key: tuple, indices, num_qps: int, col_major, layered) -> _Fetch:
        """A fetch signature met for the first time, or one whose tables changed: checked (`_plan_fetch`) and
        remembered under `key` when the key is a signature (`interop.meta` gives anything else a fresh object)."""
        layout = self.layout
        # (a written layout comes with new device arrays, so a remembered call is never one of unwritten tables)
        if layout is None or not self.written:
            raise RuntimeError('engram fetch: write the tables first (no table was written on this buffer)')
        c = self._plan_fetch(indices, num_qps, bool(col_major), bool(layered), (layout, self.sf, self._device))
        if type(key[0]) is not object:
            if len(self._fetch_calls) >= 64:
                self._fetch_calls.clear()
            self._fetch_calls[key] = c
        return c

    def _sf_outputs(self, kind: str, num_layers: int, num_tokens: int, n: int, col_major: bool):
        """Per layer `[num_tokens, n * num_sf]` scale-factor outputs in one allocation, that allocation and its
        (layer, token, column) strides in elements."""
        alloc = interop.Allocator(kind)
        width = n * self.num_sf
        if col_major:
            padded = align(num_tokens, 4)
            storage = alloc.empty((num_layers, width, padded), self.sf_dtype)
            views = [storage[layer].t()[:num_tokens] if kind == 'torch' else storage[layer].T[:num_tokens]
                     for layer in range(num_layers)]
            return views, storage, (width * padded, 1, padded)
        storage = alloc.empty((num_layers, num_tokens, width), self.sf_dtype)
        return [storage[layer] for layer in range(num_layers)], storage, (num_tokens * width, width, 1)
