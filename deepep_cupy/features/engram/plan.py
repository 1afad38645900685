"""Engram (DeepEP V2 `ElasticBuffer.engram_*`, V2.5 `EngramBuffer`), the plain-Python part: kernel declarations, the
size hints and the layout of the fetch output and the tables. Lookup tables (one per layer) split over the ranks of
one scale-up domain: every rank writes its `[num_entries, hidden]` rows of each layer (`write`); any rank then fetches
rows by global index, global row g of a layer being row `g % num_entries` of rank `g // num_entries`. The kernels are
`kernels_cu/engram.cu`; the launch path is feature.py.

Upstream fetches with RDMA reads from tables in host memory (or GPU memory) registered with the NIC. Here the fetch
kernel reads the owners' storage directly: GPU storage (symmetric memory, over NVLink) or host storage (pinned host
segments every rank of the domain has mapped, `runtime/host_storage.py`, over PCIe / C2C). Where the tables live
is decided by the buffer: V2.0 `ElasticBuffer(num_bytes=gpu + cpu, num_cpu_bytes=cpu)` puts them in host storage
(with `num_cpu_bytes=0`, in the last `cpu` bytes of the data region); V2.5 `EngramBuffer(..., use_cpu_rdma_storage)`
in host storage or in a GPU region after the fetch output.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

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
TABLE_ALIGNMENT = 256           # each layer's table starts at a multiple of this in a rank's storage
LAYER_WORDS = 3                 # kEngramLayerWords: (num_entries, table offset, first scale-factor row) per layer
TABLE_DTYPES = dtypes.LOW_PRECISION
SF_DTYPES = ('float32', 'int32')


def write_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('engram', f'deepep::engram_write_kernel<{num_ranks}>', (
        Param('storage', PTR), Param('num_bytes', np.int64), Param('table', PTR), Param('peer_bases', PTR),
        Param('rank', np.int32), Param('error_record', PTR), Param('timeout_ns', np.uint64)))


def fetch_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('engram', f'deepep::engram_fetch_impl<{num_ranks}>', (
        Param('indices', PTR), Param('num_rows', np.int32), Param('rows_per_layer', np.int32),
        Param('num_entries_per_token', np.int32), Param('row_bytes', np.int32), Param('layers', PTR),
        Param('table_bases', PTR), Param('out', PTR), Param('sf', PTR), Param('num_sf', np.int32),
        Param('sf_out', PTR), Param('sf_layer_stride', np.int64), Param('sf_stride_token', np.int64),
        Param('sf_stride_col', np.int64)))


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
    """DeepEP V2.0's `(gpu_bytes, cpu_bytes)`: per entry `align(hidden * itemsize, 32)` bytes; `gpu_bytes` =
    `align(per_entry * num_max_tokens_per_rank, 2 MiB)` (fetch output), `cpu_bytes` = `align(per_entry *
    num_entries, 2 MiB)` (the table). Build the buffer with `num_bytes = gpu_bytes + cpu_bytes` and
    `num_cpu_bytes = cpu_bytes` for a table in host memory (0: in GPU memory).

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


def table_offsets(num_entries_per_layer: Sequence[int], row_bytes: int) -> Tuple[Tuple[int, ...], int]:
    """`(offset of each layer's table, bytes of all of them)` in a rank's storage (tables `TABLE_ALIGNMENT`
    aligned)."""
    offsets, end = [], 0
    for num_entries in num_entries_per_layer:
        end = align(end, TABLE_ALIGNMENT)
        offsets.append(end)
        end += num_entries * row_bytes
    return tuple(offsets), end


def layered_size_hint(num_entries_per_layer: Sequence[int], hidden: int, num_max_tokens: int,
                      num_entries_per_token: int, dtype: Any = 'bfloat16', num_sf_packs: int = 0) -> Tuple[int, int]:
    """DeepEP V2.5's `EngramBuffer.get_storage_size_hint`: `(num_gpu_bytes, num_rdma_storage_bytes)`, both 2 MiB
    aligned: the fetch output of every layer (`layers x num_max_tokens x num_entries_per_token` rows) and the tables
    of every layer of one rank. FP8 scale factors are kept replicated outside the buffer (`num_sf_packs` only checked).
    """
    entries = check_entries(num_entries_per_layer)
    for name, value in (('hidden', hidden), ('num_max_tokens', num_max_tokens),
                        ('num_entries_per_token', num_entries_per_token), ('num_sf_packs', num_sf_packs)):
        check_int(name, value)
    row_bytes = hidden * TABLE_DTYPES[table_dtype_name(dtype)]
    _, num_table_bytes = table_offsets(entries, row_bytes)
    num_out_bytes = len(entries) * num_max_tokens * num_entries_per_token * row_bytes
    return align(max(num_out_bytes, 1), BUFFER_ALIGNMENT), align(max(num_table_bytes, 1), BUFFER_ALIGNMENT)


def check_entries(num_entries_per_layer) -> Tuple[int, ...]:
    """The entries per layer as a tuple of positive ints (a single int is one layer); ValueError otherwise."""
    if isinstance(num_entries_per_layer, (int, np.integer)) and not isinstance(num_entries_per_layer, bool):
        num_entries_per_layer = (num_entries_per_layer,)
    entries = tuple(num_entries_per_layer)
    if not entries:
        raise ValueError('num_entries_per_layer must name at least one layer')
    for i, n in enumerate(entries):
        check_int(f'num_entries_per_layer[{i}]', n, 1)
    return tuple(int(n) for n in entries)


@dataclass(frozen=True)
class EngramLayout:
    """The tables of every layer and the fetch output.

    Attributes:
        num_ranks: ranks of the domain; num_entries: entries per rank, per layer; hidden, dtype, row_bytes (=
            hidden * itemsize, a multiple of 16).
        table_offsets: each layer's table, bytes from the start of a rank's storage (identical on every rank);
            table_bytes: bytes of all tables of one rank.
        storage_offset: symmetric-memory offset of the storage (GPU storage), None for host storage.
        out_offset, out_bytes: the fetch output area in this rank's symmetric memory.
    """
    num_ranks: int
    num_entries: Tuple[int, ...]
    hidden: int
    dtype: str
    row_bytes: int
    table_offsets: Tuple[int, ...]
    table_bytes: int
    storage_offset: Optional[int]
    out_offset: int
    out_bytes: int

    @classmethod
    def build(cls, num_ranks: int, num_entries_per_layer, hidden: int, dtype: str, out_region: Tuple[int, int],
              storage_offset: Optional[int], storage_bytes: int) -> 'EngramLayout':
        """A layout whose tables live in a storage of `storage_bytes` per rank (at symmetric offset `storage_offset`,
        or None for host storage) and whose output is `out_region` (offset, bytes)."""
        entries = check_entries(num_entries_per_layer)
        row_bytes = hidden * TABLE_DTYPES[dtype]
        offsets, table_bytes = table_offsets(entries, row_bytes)
        if table_bytes > storage_bytes:
            raise ValueError(f'storage: tables of {list(entries)} x {hidden} {dtype} need {table_bytes} bytes per rank '
                             f'but the storage has {storage_bytes}; size it with the storage size hint')
        return cls(num_ranks, entries, hidden, dtype, row_bytes, offsets, table_bytes, storage_offset, *out_region)

    @classmethod
    def in_data_region(cls, data_offset: int, num_bytes: int, num_ranks: int, num_entries: int, hidden: int,
                       dtype: str) -> 'EngramLayout':
        """DeepEP V2.0 with the table in GPU memory: the table takes the last `align(num_entries * row_bytes, 2 MiB)`
        bytes of the data region (the size hint's `cpu_bytes`), the output everything before it."""
        row_bytes = hidden * TABLE_DTYPES[dtype]
        region = align(num_entries * row_bytes, BUFFER_ALIGNMENT)
        if region > num_bytes:
            raise ValueError(f'storage: a table of {num_entries} x {hidden} {dtype} needs {region} bytes but the '
                             f'buffer has {num_bytes}; size it with get_engram_storage_size_hint (gpu_bytes + '
                             f'cpu_bytes)')
        return cls.build(num_ranks, (num_entries,), hidden, dtype, (data_offset, num_bytes - region),
                         data_offset + num_bytes - region, region)

    @property
    def num_layers(self) -> int:
        return len(self.num_entries)

    @property
    def num_global_entries(self) -> int:
        """Valid global indices of the largest layer (`[0, num_ranks * max(num_entries))`)."""
        return self.num_ranks * max(self.num_entries)

    def check_fetch(self, num_layers: int, num_tokens: int, num_entries_per_token: int) -> int:
        """Rows per layer of a fetch of `[num_layers, num_tokens, num_entries_per_token]` indices; ValueError if the
        output does not fit or the layers disagree."""
        if num_layers != self.num_layers:
            raise ValueError(f'indices: {num_layers} layers, the tables have {self.num_layers}')
        rows = num_tokens * num_entries_per_token
        if num_layers * rows * self.row_bytes > self.out_bytes:
            raise ValueError(f'indices: {num_layers} x {num_tokens} x {num_entries_per_token} rows of {self.row_bytes} '
                             f'bytes need {num_layers * rows * self.row_bytes} bytes of fetch output, the buffer has '
                             f'{self.out_bytes} (the size hint\'s GPU bytes for num_max_tokens x entries per token >= '
                             f'{rows})')
        if num_layers * rows * (self.row_bytes // 16) >= 2 ** 31 - 2 ** 24:     # int32 vector indices in the kernel
            raise ValueError(f'indices: {num_layers * rows} rows are too many for one fetch')
        return rows


def layer_words(layout: EngramLayout, sf_row_offsets: Optional[Sequence[int]] = None) -> np.ndarray:
    """The kernel's per-layer words, int64 `[layers, LAYER_WORDS]`: entries per rank, table offset, first row of the
    layer in the replicated scale-factor table."""
    sf_rows = sf_row_offsets or [0] * layout.num_layers
    return np.array([[n, off, sf] for n, off, sf in zip(layout.num_entries, layout.table_offsets, sf_rows)],
                    dtype=np.int64).reshape(layout.num_layers, LAYER_WORDS)


def write_args(layout: EngramLayout, layer: int, storage, storage_base: int, peer_bases_ptr: int, rank: int,
               error_record_ptr: int, timeout_ns: int) -> Dict[str, Any]:
    """Arguments of `engram_write_kernel` by name (see `write_spec`) for `layer`; `storage_base` is the address of
    this rank's storage (GPU or host)."""
    return {'storage': storage, 'num_bytes': layout.num_entries[layer] * layout.row_bytes,
            'table': storage_base + layout.table_offsets[layer], 'peer_bases': peer_bases_ptr, 'rank': rank,
            'error_record': error_record_ptr, 'timeout_ns': timeout_ns}


def fetch_args(layout: EngramLayout, indices, num_layers: int, num_tokens: int, num_entries_per_token: int,
               layers_ptr: int, table_bases_ptr: int, out_ptr: int, sf, num_sf: int, sf_out,
               sf_strides: Tuple[int, int, int]) -> Dict[str, Any]:
    """Arguments of `engram_fetch_impl` by name (see `fetch_spec`); `sf` / `sf_out` None without scale factors;
    `sf_strides` = (layer, token, column) strides of `sf_out` in elements."""
    rows = num_tokens * num_entries_per_token
    return {'indices': indices, 'num_rows': num_layers * rows, 'rows_per_layer': max(rows, 1),
            'num_entries_per_token': num_entries_per_token, 'row_bytes': layout.row_bytes, 'layers': layers_ptr,
            'table_bases': table_bases_ptr, 'out': out_ptr, 'sf': 0 if sf is None else sf,
            'num_sf': num_sf if sf is not None else 0, 'sf_out': 0 if sf_out is None else sf_out,
            'sf_layer_stride': sf_strides[0], 'sf_stride_token': sf_strides[1], 'sf_stride_col': sf_strides[2]}


def grid_for(num_vectors: int, num_blocks: int) -> int:
    """Blocks for a copy of `num_vectors` 16-byte vectors: at most `num_blocks`, fewer when each thread would
    otherwise get less than `UNROLL` vectors."""
    return max(1, min(num_blocks, ceil_div(num_vectors, THREADS * UNROLL)))
