"""Engram: the feature of a buffer (plan.py: declarations, sizes, layout; `kernels_cu/engram.cu`: the protocol).

Upstream keeps the table in host memory and fetches it with RDMA reads; here the table lives in GPU symmetric memory
and the fetch kernel reads the owners' tables over NVLink. `get_engram_storage_size_hint` keeps upstream's
`(gpu_bytes, cpu_bytes)` pair for compatibility: build the buffer with `num_bytes = gpu_bytes + cpu_bytes`; the data
region then holds the fetch output (the first `gpu_bytes`) and the table (the last `cpu_bytes`).
"""

from typing import Any, Dict, Optional, Tuple

import numpy as np

from ...jit.launch import load_kernels
from ...runtime import checks, interop
from ...runtime.event import EventHandle
from ...runtime.host_range import HostRange
from ...runtime.sizes import align
from .plan import (
    HOST_RANGE_OFFSET,
    RANGE_SPEC,
    SF_DTYPES,
    TABLE_DTYPES,
    THREADS,
    EngramLayout,
    all_specs,
    fetch_args,
    fetch_spec,
    grid_for,
    table_dtype_name,
    write_args,
    write_spec,
)

DATA_REGION_OWNER = 'engram'


class EngramFetchHook:
    """Returned by `engram_fetch`; calling it makes the current stream wait for the fetch and returns
    `(data, sf)`. May be called more than once."""

    def __init__(self, event: Optional[EventHandle], like: Any, data: Any, sf: Any, keep_alive: Tuple):
        self._event, self._like, self._result, self._keep_alive = event, like, (data, sf), keep_alive

    def __call__(self):
        if self._event is not None:
            self._event.current_stream_wait(self._like)
        return self._result


class Engram:
    """The engram feature of one buffer: the table's layout (set by `write`), a private copy of the replicated scale
    factors, views of the fetch output and the index range check.

    Args:
        buf: the buffer (a `BufferBase`).
    """

    def __init__(self, buf):
        self._buf = buf
        self.layout: Optional[EngramLayout] = None
        self.sf: Any = None                 # private copy of the replicated scale factors, or None
        self.sf_dtype: Optional[str] = None
        self.num_sf = 0
        self._out_views: Dict[str, Any] = {}
        self._host_range: Optional[HostRange] = None
        self._loaded: Optional[Dict[str, Any]] = None
        self._fetch_kernel = None

    def destroy(self) -> None:
        self.layout, self.sf, self._out_views = None, None, {}

    def _kernels(self):
        if self._loaded is None:       # kept: building the specs and their names costs ~20 us per call
            self._loaded = load_kernels(all_specs(self._buf.num_scaleup_ranks))
        return self._loaded

    def _check_write(self, storage, sf) -> Tuple[EngramLayout, Any, Any]:
        buf = self._buf
        si = checks.info(storage, 'storage', buf.device)
        dtype = table_dtype_name(si.dtype) if si.kind == 'cupy' else si.dtype
        if dtype not in TABLE_DTYPES:
            raise TypeError(f'storage must be bfloat16 or float8_e4m3fn, got {si.dtype}')
        if si.ndim != 2:
            raise ValueError(f'storage must be 2-D [num_entries, hidden], got {list(si.shape)}')
        checks.check_contiguous(si, 'storage')
        num_entries, hidden = si.shape
        if num_entries < 1 or (hidden * TABLE_DTYPES[dtype]) % 16 or hidden < 1:
            raise ValueError(f'storage: need num_entries >= 1 and hidden * itemsize a positive multiple of 16 bytes, '
                             f'got {num_entries} x {hidden} {dtype}')
        if si.ptr % 16:
            raise ValueError('storage must start at a 16-byte aligned address')
        if num_entries * buf.num_scaleup_ranks >= 2 ** 31:
            raise ValueError(f'storage: {num_entries} entries per rank x {buf.num_scaleup_ranks} ranks overflow int32 '
                             f'global indices')
        sfi = None
        if sf is not None:
            if dtype != 'float8_e4m3fn':
                raise ValueError('sf: scale factors belong to float8_e4m3fn tables; pass sf=None for bfloat16')
            sfi = checks.info(sf, 'sf', buf.device)
            checks.check_same_kind(si.kind, sfi, 'sf')
            checks.check_dtype(sfi, 'sf', *SF_DTYPES)
            total = num_entries * buf.num_scaleup_ranks
            if sfi.ndim != 2 or sfi.shape[0] != total or sfi.shape[1] < 1:
                raise ValueError(f'sf must be [num_ranks * num_entries = {total}, num_packs] (replicated on every '
                                 f'rank), got {list(sfi.shape)}')
            checks.check_contiguous(sfi, 'sf')
        layout = EngramLayout.build(buf.data_offset, buf.num_bytes, buf.num_scaleup_ranks, num_entries, hidden, dtype)
        return layout, si, sfi

    def write(self, storage, sf=None) -> None:
        """Copy this rank's rows into its table (collective over the domain: every rank calls it with tables of the
        same shape and dtype). Waits until no peer still fetches from the old table, and returns once the current
        stream is ordered after every rank's new table (fetches issued later see it).

        Args:
            storage: `[num_entries, hidden]` bfloat16 or float8_e4m3fn (CuPy: uint16 / uint8), contiguous, on this
                GPU; `hidden * itemsize` a multiple of 16 bytes.
            sf: for float8 tables, the scale factors of EVERY rank's rows, replicated on every rank:
                `[num_ranks * num_entries, num_packs]` float32 (or int32 packed UE8M0), contiguous. None: no scales.
        """
        buf = self._buf
        buf.check_usable()
        if buf.num_scaleout_ranks > 1:
            raise NotImplementedError('engram over several scale-up domains (RDMA) is not implemented; the table is '
                                      'read over NVLink inside one domain')
        error, signature = None, None
        try:
            layout, si, sfi = self._check_write(storage, sf)
            signature = (layout.num_entries, layout.hidden, layout.dtype, None if sfi is None else
                         (sfi.shape[1], sfi.dtype))
        except (ValueError, TypeError) as e:
            error = e
        everyone = buf.group.allgather_object((None if error is None else repr(error), signature),
                                              timeout=buf.num_cpu_timeout_secs)
        if error is not None:
            raise error
        bad = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
        if bad:
            raise ValueError(f'engram_write: rank {bad[0][0]} rejected its arguments ({bad[0][1]})')
        if any(s != signature for _, s in everyone):
            detail = '; '.join(f'rank {r}: {s}' for r, (_, s) in enumerate(everyone))
            raise ValueError(f'engram_write: every rank must write a table of the same shape and dtype (and pass sf '
                             f'alike): (num_entries, hidden, dtype, (num_packs, sf dtype)) = {detail}')
        buf.claim_data_region(DATA_REGION_OWNER)

        write = self._kernels()[write_spec(buf.num_scaleup_ranks).name]
        current = interop.current_stream(storage)
        comm = buf.stream_order.begin(current)
        sf_copy = None
        if sfi is not None:
            import cupy
            sf_copy = interop.Allocator(si.kind).empty(sfi.shape, sfi.dtype, stream=comm)
            cupy.cuda.runtime.memcpyAsync(interop.tensor_info(sf_copy).ptr, sfi.ptr, sfi.nbytes,
                                          cupy.cuda.runtime.memcpyDefault, comm.ptr)
        write.launch(grid_for(layout.table_bytes // 16, buf.num_device_sms), THREADS, stream=comm,
                     **write_args(layout, storage, buf.sym.peer_bases_ptr, buf.sym.local_idx, buf.host_mapped.ptr,
                                  buf.timeout_ns))
        # The caller may reuse `storage` (and sf) right after: order its stream after the copy.
        buf.stream_order.end(current)
        self.layout, self.sf = layout, sf_copy
        self.sf_dtype, self.num_sf = (None, 0) if sfi is None else (sfi.dtype, sfi.shape[1])
        self._out_views = {}

    def _output(self, kind: str, num_tokens: int, width: int):
        """`[num_tokens, width]` view of the fetch output area in the table's dtype (torch or CuPy)."""
        layout = self.layout
        views = self._out_views
        if kind not in views:
            u8 = self._buf.sym.local_view(layout.out_offset, layout.out_bytes)
            views[kind] = interop.to_torch(u8) if kind == 'torch' else u8
        nbytes = num_tokens * width * TABLE_DTYPES[layout.dtype]
        flat = views[kind][:nbytes]
        if kind == 'torch':
            import torch
            return flat.view(getattr(torch, layout.dtype)).view(num_tokens, width)
        return flat.view(np.uint16 if layout.dtype == 'bfloat16' else np.uint8).reshape(num_tokens, width)

    def _index_range(self, ii, stream):
        """Start reading (min, max) of the indices back to the host (`HostRange`: one small kernel on `stream`, no
        stream synchronisation); returns a function that waits for them."""
        buf = self._buf
        if self._host_range is None:
            self._host_range = HostRange(buf.host_mapped, HOST_RANGE_OFFSET)
        return self._host_range.start(self._kernels()[RANGE_SPEC.name], ii.ptr, ii.numel, stream,
                                      buf.num_cpu_timeout_secs, f'engram_fetch on rank {buf.rank_idx} (indices)')

    def fetch(self, indices, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False,
              check_indices: bool = True) -> EngramFetchHook:
        """Gather rows of the domain's table (not collective: each rank fetches on its own).

        Args:
            indices: `[num_tokens, num_entries_per_token]` int32, contiguous, on this GPU; global entry ids in
                `[0, num_ranks * num_entries)`.
            num_qps: blocks of the fetch kernel (upstream: RDMA queue pairs); 0: every SM, fewer for small fetches.
            use_tma_aligned_col_major_sf: scale factors column-major with the token dimension padded to 4.
            check_indices: read the indices' range back before the launch (the host waits for the current stream to
                reach this call) and raise ValueError if one is out of range. False skips it; out-of-range rows come
                out zero.

        Returns:
            a hook; `hook()` makes the current stream wait and returns `(data, sf)`: `data` is `[num_tokens,
            num_entries_per_token * hidden]` in the table's dtype, a view of this buffer's fetch output area (valid
            until the next fetch on this buffer), `sf` `[num_tokens, num_entries_per_token * num_packs]` (float32 /
            int32, a new tensor) or None without scale factors.
        """
        buf = self._buf
        buf.check_usable()
        layout = self.layout
        if layout is None:
            raise RuntimeError('engram_fetch: call engram_write first (no table was written on this buffer)')
        ii = checks.info(indices, 'indices', buf.device)
        kind = ii.kind
        checks.check_dtype(ii, 'indices', 'int32')
        if ii.ndim != 2:
            raise ValueError(f'indices must be 2-D [num_tokens, num_entries_per_token], got {list(ii.shape)}')
        checks.check_contiguous(ii, 'indices')
        checks.check_int('num_qps', num_qps)
        num_tokens, n = ii.shape
        num_rows = layout.check_fetch(num_tokens, n)
        current = interop.current_stream(indices)
        if check_indices and num_rows:
            lo, hi = self._index_range(ii, current)()
            if lo < 0 or hi >= layout.num_global_entries:
                raise ValueError(f'indices must be in [0, {layout.num_global_entries}) (num_ranks x num_entries), '
                                 f'got min {lo}, max {hi}')

        alloc = interop.Allocator(kind)
        sf_out, sf_strides = None, (0, 0)
        if self.sf is not None:
            width = n * self.num_sf
            if use_tma_aligned_col_major_sf:
                padded = align(num_tokens, 4)
                sf_storage = alloc.empty((width, padded), self.sf_dtype)
                sf_out = sf_storage.t()[:num_tokens] if kind == 'torch' else sf_storage.T[:num_tokens]
                sf_strides = (1, padded)
            else:
                sf_out = alloc.empty((num_tokens, width), self.sf_dtype)
                sf_strides = (width, 1)
        data = self._output(kind, num_tokens, n * layout.hidden)
        if num_rows == 0:
            return EngramFetchHook(None, indices, data, sf_out, ())

        fetch = self._fetch_kernel
        if fetch is None:
            fetch = self._fetch_kernel = self._kernels()[fetch_spec(buf.num_scaleup_ranks).name]
        comm = buf.stream_order.begin(current)
        fetch.launch(grid_for(num_rows * (layout.row_bytes // 16), num_qps or buf.num_device_sms), THREADS,
                     stream=comm, **fetch_args(layout, indices, num_tokens, n, self.sf, self.num_sf, sf_out,
                                               sf_strides, buf.sym.peer_bases_ptr, buf.sym.local_idx))
        if kind == 'torch':
            s = interop.torch_stream(comm.ptr)
            for t in (indices, sf_out):
                if t is not None:
                    t.record_stream(s)
        return EngramFetchHook(EventHandle(comm), indices, data, sf_out, (indices, self.sf))
