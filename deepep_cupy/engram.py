"""Engram (DeepEP V2 `ElasticBuffer.engram_*`): a lookup table split over the ranks of one scale-up domain. Every
rank writes its `[num_entries, hidden]` rows once (`engram_write`); any rank then fetches rows by global index
(`engram_fetch`), global row g being row `g % num_entries` of rank `g // num_entries`. `EngramMixin` adds this to the
buffer classes; the kernels are `kernels_cu/engram.cu`.

Upstream keeps the table in host memory and fetches it with RDMA reads; here the table lives in GPU symmetric memory
and the fetch kernel reads the owners' tables over NVLink. `get_engram_storage_size_hint` keeps upstream's
`(gpu_bytes, cpu_bytes)` pair for compatibility: build the buffer with `num_bytes = gpu_bytes + cpu_bytes`; the data
region then holds the fetch output (the first `gpu_bytes`) and the table (the last `cpu_bytes`).
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .constants import BUFFER_ALIGNMENT
from .jit.launch import PTR, KernelSpec, Param, load_kernels
from .runtime import interop
from .runtime.event import EventHandle
from .runtime.host_range import HostRange, value_range_spec
from .validation import check_int

# Symmetric workspace bytes [CTRL_OFFSET, CTRL_OFFSET + CTRL_BYTES) belong to kernels_cu/engram.cu.
CTRL_OFFSET = 28672
CTRL_BYTES = 2048
THREADS = 512                   # kEngramThreads
UNROLL = 8                      # kEngramUnroll
ENTRY_ALIGNMENT = 32            # bytes per entry in upstream's size hint
TABLE_DTYPES = {'bfloat16': 2, 'float8_e4m3fn': 1}
SF_DTYPES = ('float32', 'int32')
_CUPY_NAMES = {'uint16': 'bfloat16', 'uint8': 'float8_e4m3fn'}


def write_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('engram', f'deepep::engram_write_kernel<{num_ranks}>', (
        Param('storage', PTR), Param('num_bytes', np.int64), Param('table_offset', np.uint64),
        Param('peer_bases', PTR), Param('rank', np.int32), Param('error_record', PTR), Param('timeout_ns', np.uint64)))


def fetch_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('engram', f'deepep::engram_fetch_kernel<{num_ranks}>', (
        Param('indices', PTR), Param('num_rows', np.int32), Param('num_entries_per_token', np.int32),
        Param('row_bytes', np.int32), Param('num_entries', np.int32), Param('table_offset', np.uint64),
        Param('out_offset', np.uint64), Param('sf', PTR), Param('num_sf', np.int32), Param('sf_out', PTR),
        Param('sf_stride_token', np.int64), Param('sf_stride_col', np.int64), Param('peer_bases', PTR),
        Param('rank', np.int32)))


RANGE_SPEC = value_range_spec('engram', 'int')
HOST_RANGE_OFFSET = 8256      # byte offset of the index range check's record in the buffer's host-mapped memory


def all_specs(num_ranks: int) -> List[KernelSpec]:
    """Every specialisation a buffer of `num_ranks` scale-up ranks may request."""
    return [write_spec(num_ranks), fetch_spec(num_ranks), RANGE_SPEC]


def shipped_specs() -> Dict[str, List[KernelSpec]]:
    """Family name → every `KernelSpec` of this module, for 1 to 8 ranks per domain."""
    from .constants import NUM_MAX_SCALEUP_RANKS
    per_rank = [s for n in range(1, NUM_MAX_SCALEUP_RANKS + 1) for s in (write_spec(n), fetch_spec(n))]
    return {'engram': per_rank + [RANGE_SPEC]}


def _align(x: int, y: int) -> int:
    return (x + y - 1) // y * y


def table_dtype_name(dtype: Any) -> str:
    """`'bfloat16'` or `'float8_e4m3fn'` for a torch dtype, a name, or CuPy's stand-ins (uint16, uint8)."""
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.split('.')[0] == 'torch':
        name = str(dtype).replace('torch.', '')
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    name = _CUPY_NAMES.get(name, name)
    if name not in TABLE_DTYPES:
        raise TypeError(f'dtype must be bfloat16 or float8_e4m3fn (CuPy: uint16 or uint8), got {dtype}')
    return name


def storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                      dtype: Any = 'bfloat16') -> Tuple[int, int]:
    """Upstream's `(gpu_bytes, cpu_bytes)`: per entry `align(hidden * itemsize, 32)` bytes; `gpu_bytes` =
    `align(per_entry * num_max_tokens_per_rank, 2 MiB)` (fetch output), `cpu_bytes` = `align(per_entry *
    num_entries, 2 MiB)` (the table). This build keeps both in GPU memory: size the buffer `gpu_bytes + cpu_bytes`.

    Args:
        num_entries: rows of each rank's table.
        hidden: elements per row.
        num_max_tokens_per_rank: most rows one fetch returns (tokens × entries per token).
        dtype: bfloat16 or float8_e4m3fn (torch dtype or name).
    """
    for name, value in (('num_entries', num_entries), ('hidden', hidden),
                        ('num_max_tokens_per_rank', num_max_tokens_per_rank)):
        check_int(name, value)
    per_entry = _align(hidden * TABLE_DTYPES[table_dtype_name(dtype)], ENTRY_ALIGNMENT)
    return (_align(per_entry * num_max_tokens_per_rank, BUFFER_ALIGNMENT),
            _align(per_entry * num_entries, BUFFER_ALIGNMENT))


@dataclass(frozen=True)
class EngramLayout:
    """Where the fetch output and the table sit in the symmetric buffer (byte offsets from its base).

    The table takes the last `align(num_entries * row_bytes, 2 MiB)` bytes of the data region (the size hint's
    `cpu_bytes`), the output everything before it; rows are contiguous (`row_bytes = hidden * itemsize`)."""
    num_ranks: int
    num_entries: int
    hidden: int
    dtype: str
    row_bytes: int
    out_offset: int
    out_bytes: int
    table_offset: int
    table_bytes: int

    @classmethod
    def build(cls, data_offset: int, num_bytes: int, num_ranks: int, num_entries: int, hidden: int,
              dtype: str) -> 'EngramLayout':
        row_bytes = hidden * TABLE_DTYPES[dtype]
        table_bytes = num_entries * row_bytes
        region = _align(table_bytes, BUFFER_ALIGNMENT)
        if region > num_bytes:
            raise ValueError(f'storage: a table of {num_entries} x {hidden} {dtype} needs {region} bytes but the '
                             f'buffer has {num_bytes}; size it with get_engram_storage_size_hint (gpu_bytes + '
                             f'cpu_bytes)')
        return cls(num_ranks, num_entries, hidden, dtype, row_bytes, data_offset, num_bytes - region,
                   data_offset + num_bytes - region, table_bytes)

    @property
    def num_global_entries(self) -> int:
        return self.num_ranks * self.num_entries

    def check_fetch(self, num_tokens: int, num_entries_per_token: int) -> int:
        """Rows of a fetch of `[num_tokens, num_entries_per_token]` indices; ValueError if the output does not fit."""
        num_rows = num_tokens * num_entries_per_token
        if num_rows * self.row_bytes > self.out_bytes:
            raise ValueError(f'indices: {num_tokens} x {num_entries_per_token} rows of {self.row_bytes} bytes need '
                             f'{num_rows * self.row_bytes} bytes of fetch output, the buffer has {self.out_bytes} '
                             f'(get_engram_storage_size_hint\'s gpu_bytes for num_max_tokens_per_rank >= {num_rows})')
        if num_rows * (self.row_bytes // 16) >= 2 ** 31 - 2 ** 24:     # int32 vector indices in the kernel
            raise ValueError(f'indices: {num_rows} rows are too many for one fetch')
        return num_rows


def write_args(layout: EngramLayout, storage, peer_bases_ptr: int, rank: int, error_record_ptr: int,
               timeout_ns: int) -> Tuple:
    """Arguments of `engram_write_kernel` (see `write_spec`)."""
    return (storage, layout.table_bytes, layout.table_offset, peer_bases_ptr, rank, error_record_ptr, timeout_ns)


def fetch_args(layout: EngramLayout, indices, num_tokens: int, num_entries_per_token: int, sf, num_sf: int, sf_out,
               sf_strides: Tuple[int, int], peer_bases_ptr: int, rank: int) -> Tuple:
    """Arguments of `engram_fetch_kernel` (see `fetch_spec`); `sf` / `sf_out` None without scale factors."""
    return (indices, num_tokens * num_entries_per_token, num_entries_per_token, layout.row_bytes, layout.num_entries,
            layout.table_offset, layout.out_offset, 0 if sf is None else sf, num_sf if sf is not None else 0,
            0 if sf_out is None else sf_out, sf_strides[0], sf_strides[1], peer_bases_ptr, rank)


def grid_for(num_vectors: int, num_blocks: int) -> int:
    """Blocks for a copy of `num_vectors` 16-byte vectors: at most `num_blocks`, fewer when each thread would
    otherwise get less than `UNROLL` vectors."""
    return max(1, min(num_blocks, -(-num_vectors // (THREADS * UNROLL))))


@dataclass
class _EngramState:
    layout: EngramLayout
    sf: Any                  # private copy of the replicated scale factors, or None
    sf_dtype: Optional[str]
    num_sf: int


class EngramFetchHook:
    """Returned by `engram_fetch`; calling it makes the current stream wait for the fetch and returns
    `(data, sf)`. May be called more than once."""

    def __init__(self, event: Optional[EventHandle], like: Any, data: Any, sf: Any, keep_alive: Tuple):
        self._event, self._like, self._result, self._keep_alive = event, like, (data, sf), keep_alive

    def __call__(self):
        if self._event is not None:
            self._event.current_stream_wait(self._like)
        return self._result


class EngramMixin:
    """Engram over the ranks of one scale-up domain (mixed into the buffer classes; `self` is a `BufferBase`).
    State lives in `_engram_*` attributes set by `engram_write`."""

    get_engram_storage_size_hint = staticmethod(storage_size_hint)

    def _engram_check_write(self, storage, sf) -> Tuple[EngramLayout, Any, Any]:
        from .ep import checks
        si = checks.info(storage, 'storage', self.device)
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
        if num_entries * self.num_scaleup_ranks >= 2 ** 31:
            raise ValueError(f'storage: {num_entries} entries per rank x {self.num_scaleup_ranks} ranks overflow int32 '
                             f'global indices')
        sfi = None
        if sf is not None:
            if dtype != 'float8_e4m3fn':
                raise ValueError('sf: scale factors belong to float8_e4m3fn tables; pass sf=None for bfloat16')
            sfi = checks.info(sf, 'sf', self.device)
            checks.check_same_kind(si.kind, sfi, 'sf')
            checks.check_dtype(sfi, 'sf', *SF_DTYPES)
            total = num_entries * self.num_scaleup_ranks
            if sfi.ndim != 2 or sfi.shape[0] != total or sfi.shape[1] < 1:
                raise ValueError(f'sf must be [num_ranks * num_entries = {total}, num_packs] (replicated on every '
                                 f'rank), got {list(sfi.shape)}')
            checks.check_contiguous(sfi, 'sf')
        layout = EngramLayout.build(self.data_offset, self.num_bytes, self.num_scaleup_ranks, num_entries, hidden,
                                    dtype)
        return layout, si, sfi

    def engram_write(self, storage, sf=None) -> None:
        """Copy this rank's rows into its table (collective over the domain: every rank calls it with tables of the
        same shape and dtype). Waits until no peer still fetches from the old table, and returns once the current
        stream is ordered after every rank's new table (fetches issued later see it).

        Args:
            storage: `[num_entries, hidden]` bfloat16 or float8_e4m3fn (CuPy: uint16 / uint8), contiguous, on this
                GPU; `hidden * itemsize` a multiple of 16 bytes.
            sf: for float8 tables, the scale factors of EVERY rank's rows, replicated on every rank:
                `[num_ranks * num_entries, num_packs]` float32 (or int32 packed UE8M0), contiguous. None: no scales.
        """
        self.check_usable()
        if self.num_scaleout_ranks > 1:
            raise NotImplementedError('engram over several scale-up domains (RDMA) is not implemented; the table is '
                                      'read over NVLink inside one domain')
        error, signature = None, None
        try:
            layout, si, sfi = self._engram_check_write(storage, sf)
            signature = (layout.num_entries, layout.hidden, layout.dtype, None if sfi is None else
                         (sfi.shape[1], sfi.dtype))
        except (ValueError, TypeError) as e:
            error = e
        everyone = self.group.allgather_object((None if error is None else repr(error), signature),
                                               timeout=self.num_cpu_timeout_secs)
        if error is not None:
            raise error
        bad = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
        if bad:
            raise ValueError(f'engram_write: rank {bad[0][0]} rejected its arguments ({bad[0][1]})')
        if any(s != signature for _, s in everyone):
            detail = '; '.join(f'rank {r}: {s}' for r, (_, s) in enumerate(everyone))
            raise ValueError(f'engram_write: every rank must write a table of the same shape and dtype (and pass sf '
                             f'alike): (num_entries, hidden, dtype, (num_packs, sf dtype)) = {detail}')
        self.claim_data_region('engram')

        kernels = load_kernels(all_specs(self.num_scaleup_ranks))
        write = kernels[write_spec(self.num_scaleup_ranks).name]
        current, comm = interop.current_stream(storage), self.comm_stream
        comm.wait_event(current.record())
        sf_copy = None
        if sfi is not None:
            import cupy
            sf_copy = interop.Allocator(si.kind).empty(sfi.shape, sfi.dtype, stream=comm)
            cupy.cuda.runtime.memcpyAsync(interop.tensor_info(sf_copy).ptr, sfi.ptr, sfi.nbytes,
                                          cupy.cuda.runtime.memcpyDefault, comm.ptr)
        write.launch(grid_for(layout.table_bytes // 16, self.num_device_sms), THREADS,
                     write_args(layout, storage, self.sym.peer_bases_ptr, self.sym.local_idx, self.host_mapped.ptr,
                                self.timeout_ns), stream=comm)
        # The caller may reuse `storage` (and sf) right after: order its stream after the copy.
        current.wait_event(comm.record())
        self._engram_state = _EngramState(layout, sf_copy, None if sfi is None else sfi.dtype,
                                          0 if sfi is None else sfi.shape[1])
        self._engram_out_views = {}

    def _engram_output(self, kind: str, num_tokens: int, width: int):
        """`[num_tokens, width]` view of the fetch output area in the table's dtype (torch or CuPy)."""
        layout = self._engram_state.layout
        views = self._engram_out_views
        if kind not in views:
            u8 = self.sym.local_view(layout.out_offset, layout.out_bytes)
            views[kind] = interop.to_torch(u8) if kind == 'torch' else u8
        nbytes = num_tokens * width * TABLE_DTYPES[layout.dtype]
        flat = views[kind][:nbytes]
        if kind == 'torch':
            import torch
            return flat.view(getattr(torch, layout.dtype)).view(num_tokens, width)
        return flat.view(np.uint16 if layout.dtype == 'bfloat16' else np.uint8).reshape(num_tokens, width)

    def _engram_index_range(self, ii, stream):
        """Start reading (min, max) of the indices back to the host (`HostRange`: one small kernel on `stream`, no
        stream synchronisation); returns a function that waits for them."""
        host_range = getattr(self, '_engram_host_range', None)
        if host_range is None:
            host_range = self._engram_host_range = HostRange(self.host_mapped, HOST_RANGE_OFFSET)
        kernel = load_kernels(all_specs(self.num_scaleup_ranks))[RANGE_SPEC.name]
        return host_range.start(kernel, ii.ptr, ii.numel, stream, self.num_cpu_timeout_secs,
                                f'engram_fetch on rank {self.rank_idx} (indices)')

    def engram_fetch(self, indices, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False,
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
        from .ep import checks
        self.check_usable()
        state: Optional[_EngramState] = getattr(self, '_engram_state', None)
        if state is None:
            raise RuntimeError('engram_fetch: call engram_write first (no table was written on this buffer)')
        layout = state.layout
        ii = checks.info(indices, 'indices', self.device)
        kind = ii.kind
        checks.check_dtype(ii, 'indices', 'int32')
        if ii.ndim != 2:
            raise ValueError(f'indices must be 2-D [num_tokens, num_entries_per_token], got {list(ii.shape)}')
        checks.check_contiguous(ii, 'indices')
        check_int('num_qps', num_qps)
        num_tokens, n = ii.shape
        num_rows = layout.check_fetch(num_tokens, n)
        current = interop.current_stream(indices)
        if check_indices and num_rows:
            lo, hi = self._engram_index_range(ii, current)()
            if lo < 0 or hi >= layout.num_global_entries:
                raise ValueError(f'indices must be in [0, {layout.num_global_entries}) (num_ranks x num_entries), '
                                 f'got min {lo}, max {hi}')

        alloc = interop.Allocator(kind)
        sf_out, sf_strides = None, (0, 0)
        if state.sf is not None:
            width = n * state.num_sf
            if use_tma_aligned_col_major_sf:
                padded = _align(num_tokens, 4)
                sf_storage = alloc.empty((width, padded), state.sf_dtype)
                sf_out = sf_storage.t()[:num_tokens] if kind == 'torch' else sf_storage.T[:num_tokens]
                sf_strides = (1, padded)
            else:
                sf_out = alloc.empty((num_tokens, width), state.sf_dtype)
                sf_strides = (width, 1)
        data = self._engram_output(kind, num_tokens, n * layout.hidden)
        if num_rows == 0:
            return EngramFetchHook(None, indices, data, sf_out, ())

        kernels = load_kernels(all_specs(self.num_scaleup_ranks))
        fetch = kernels[fetch_spec(self.num_scaleup_ranks).name]
        comm = self.comm_stream
        comm.wait_event(current.record())
        fetch.launch(grid_for(num_rows * (layout.row_bytes // 16), num_qps or self.num_device_sms), THREADS,
                     fetch_args(layout, indices, num_tokens, n, state.sf, state.num_sf, sf_out, sf_strides,
                                self.sym.peer_bases_ptr, self.sym.local_idx), stream=comm)
        if kind == 'torch':
            s = interop.torch_stream(comm.ptr)
            for t in (indices, sf_out):
                if t is not None:
                    t.record_stream(s)
        return EngramFetchHook(EventHandle(comm), indices, data, sf_out, (indices, state.sf))
