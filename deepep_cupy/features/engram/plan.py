"""Engram (DeepEP V2 `ElasticBuffer.engram_*`), the plain-Python part: kernel declarations, the size hint and the
layout of the fetch output and the table. A lookup table split over the ranks of one scale-up domain: every rank
writes its `[num_entries, hidden]` rows once (`engram_write`); any rank then fetches rows by global index
(`engram_fetch`), global row g being row `g % num_entries` of rank `g // num_entries`. The kernels are
`kernels_cu/engram.cu`; the launch path is feature.py.

Upstream keeps the table in host memory and fetches it with RDMA reads; here the table lives in GPU symmetric memory
and the fetch kernel reads the owners' tables over NVLink. `get_engram_storage_size_hint` keeps upstream's
`(gpu_bytes, cpu_bytes)` pair for compatibility: build the buffer with `num_bytes = gpu_bytes + cpu_bytes`; the data
region then holds the fetch output (the first `gpu_bytes`) and the table (the last `cpu_bytes`).
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import numpy as np

from ...constants import BUFFER_ALIGNMENT, NUM_MAX_SCALEUP_RANKS
from ...jit.launch import PTR, KernelSpec, Param
from ...runtime import dtypes, workspace
from ...runtime.checks import check_int
from ...runtime.host_range import value_range_spec
from ...runtime.sizes import align, ceil_div

# Symmetric workspace bytes [CTRL_OFFSET, CTRL_OFFSET + CTRL_BYTES) belong to kernels_cu/engram.cu.
CTRL_OFFSET, CTRL_BYTES = workspace.ENGRAM
THREADS = 512                   # kEngramThreads
UNROLL = 8                      # kEngramUnroll
ENTRY_ALIGNMENT = 32            # bytes per entry in upstream's size hint
TABLE_DTYPES = dtypes.LOW_PRECISION
SF_DTYPES = ('float32', 'int32')


def write_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('engram', f'deepep::engram_write_kernel<{num_ranks}>', (
        Param('storage', PTR), Param('num_bytes', np.int64), Param('table_offset', np.uint64),
        Param('peer_bases', PTR), Param('rank', np.int32), Param('error_record', PTR), Param('timeout_ns', np.uint64)))


def fetch_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('engram', f'deepep::engram_fetch_impl<{num_ranks}>', (
        Param('indices', PTR), Param('num_rows', np.int32), Param('num_entries_per_token', np.int32),
        Param('row_bytes', np.int32), Param('num_entries', np.int32), Param('table_offset', np.uint64),
        Param('out_offset', np.uint64), Param('sf', PTR), Param('num_sf', np.int32), Param('sf_out', PTR),
        Param('sf_stride_token', np.int64), Param('sf_stride_col', np.int64), Param('peer_bases', PTR),
        Param('rank', np.int32)))


RANGE_SPEC = value_range_spec('engram', 'int')
HOST_RANGE_OFFSET = workspace.HOST_ENGRAM_RANGE.offset    # the index range check's record in host-mapped memory


def all_specs(num_ranks: int) -> List[KernelSpec]:
    """Every specialisation a buffer of `num_ranks` scale-up ranks may request."""
    return [write_spec(num_ranks), fetch_spec(num_ranks), RANGE_SPEC]


def shipped_specs(max_ranks: int = NUM_MAX_SCALEUP_RANKS) -> Dict[str, List[KernelSpec]]:
    """Family name → every `KernelSpec` of this module, for 1 to `max_ranks` ranks per domain."""
    per_rank = [s for n in range(1, max_ranks + 1) for s in (write_spec(n), fetch_spec(n))]
    return {'engram': per_rank + [RANGE_SPEC]}


table_dtype_name = dtypes.low_precision_name


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
    per_entry = align(hidden * TABLE_DTYPES[table_dtype_name(dtype)], ENTRY_ALIGNMENT)
    return (align(per_entry * num_max_tokens_per_rank, BUFFER_ALIGNMENT),
            align(per_entry * num_entries, BUFFER_ALIGNMENT))


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
        region = align(table_bytes, BUFFER_ALIGNMENT)
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
               timeout_ns: int) -> Dict[str, Any]:
    """Arguments of `engram_write_kernel` by name (see `write_spec`)."""
    return {'storage': storage, 'num_bytes': layout.table_bytes, 'table_offset': layout.table_offset,
            'peer_bases': peer_bases_ptr, 'rank': rank, 'error_record': error_record_ptr, 'timeout_ns': timeout_ns}


def fetch_args(layout: EngramLayout, indices, num_tokens: int, num_entries_per_token: int, sf, num_sf: int, sf_out,
               sf_strides: Tuple[int, int], peer_bases_ptr: int, rank: int) -> Dict[str, Any]:
    """Arguments of `engram_fetch_impl` by name (see `fetch_spec`); `sf` / `sf_out` None without scale factors."""
    return {'indices': indices, 'num_rows': num_tokens * num_entries_per_token,
            'num_entries_per_token': num_entries_per_token, 'row_bytes': layout.row_bytes,
            'num_entries': layout.num_entries, 'table_offset': layout.table_offset, 'out_offset': layout.out_offset,
            'sf': 0 if sf is None else sf, 'num_sf': num_sf if sf is not None else 0,
            'sf_out': 0 if sf_out is None else sf_out, 'sf_stride_token': sf_strides[0],
            'sf_stride_col': sf_strides[1], 'peer_bases': peer_bases_ptr, 'rank': rank}


def grid_for(num_vectors: int, num_blocks: int) -> int:
    """Blocks for a copy of `num_vectors` 16-byte vectors: at most `num_blocks`, fewer when each thread would
    otherwise get less than `UNROLL` vectors."""
    return max(1, min(num_blocks, ceil_div(num_vectors, THREADS * UNROLL)))
