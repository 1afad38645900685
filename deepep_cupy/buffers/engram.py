"""`EngramBuffer`: DeepEP V2.5's engram buffer (`deep_ep.buffers.engram`): per-layer lookup tables split over the
ranks of a scale-up domain, fetched by global index.

Memory of one rank: `[workspace | fetch output: num_gpu_bytes | GPU tables: num_rdma_storage_bytes]` in symmetric
memory, or, with `use_cpu_rdma_storage`, the tables in host storage (pinned host segments every rank of the domain
maps, `runtime/host_storage.py`). The engram feature (`features/engram`) does the work; the fetch kernel reads the
owners' storage directly (NVLink or PCIe / C2C) where upstream issues RDMA reads.
"""

import functools
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..features.engram.feature import Engram
from ..features.engram.plan import layered_size_hint
from ..runtime.checks import check_int
from .base import BufferBase, V25Methods

__all__ = ['EngramBuffer']


def _accept_legacy_storage_size(init):
    """DeepEP's keyword alias `num_rdma_storage_size` for `num_rdma_storage_bytes`."""
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        if 'num_rdma_storage_size' in kwargs:
            if 'num_rdma_storage_bytes' in kwargs:
                raise TypeError('Specify only one of num_rdma_storage_bytes and num_rdma_storage_size')
            kwargs['num_rdma_storage_bytes'] = kwargs.pop('num_rdma_storage_size')
        return init(self, *args, **kwargs)
    return wrapper


class EngramBuffer(V25Methods, BufferBase):
    """GPU fetch buffer with GPU or host storage for the tables (DeepEP V2.5).

    Args:
        group: torch.distributed ProcessGroup (or a deepep_cupy `ProcessGroup`); `comm`: an mpi4py communicator.
        num_gpu_bytes: bytes of the fetch output (a multiple of 2 MiB; `get_storage_size_hint`'s first value).
        num_rdma_storage_bytes: bytes of one rank's tables (a multiple of 2 MiB; the hint's second value).
        use_cpu_rdma_storage: keep the tables in host memory (pinned, shared by the ranks of the domain) instead of
            GPU memory.
        num_allocated_qps: most blocks a fetch may use (upstream: RDMA queue pairs; `get_theoretical_config`).
        qp_depth, restrict_rd_atomic: upstream's RDMA queue settings; accepted (no RDMA here).
        allow_hybrid_mode, sl_idx: accepted (one scale-up domain, no RDMA traffic).
        num_gpu_timeout_secs: bound on GPU waits.
        explicitly_destroy: memory is released by `destroy()` (collective); else when garbage-collected.
    """

    @_accept_legacy_storage_size
    def __init__(self, group=None, num_gpu_bytes: int = 0, num_rdma_storage_bytes: int = 0,
                 use_cpu_rdma_storage: bool = False, num_allocated_qps: int = 0, qp_depth: int = 0,
                 restrict_rd_atomic: bool = False, allow_hybrid_mode: bool = True, sl_idx: Optional[int] = None,
                 num_gpu_timeout_secs: float = 100, explicitly_destroy: bool = False, *, comm=None,
                 device: Optional[int] = None, num_cpu_timeout_secs: float = 300):
        for name, value in (('num_gpu_bytes', num_gpu_bytes), ('num_rdma_storage_bytes', num_rdma_storage_bytes)):
            check_int(name, value)
        if num_allocated_qps <= 0 or qp_depth <= 0:
            raise ValueError('num_allocated_qps and qp_depth must be positive: pass those of get_theoretical_config')
        self.num_gpu_bytes = num_gpu_bytes
        self.num_rdma_storage_bytes = num_rdma_storage_bytes
        self.use_cpu_rdma_storage = bool(use_cpu_rdma_storage)
        self.num_allocated_qps, self.qp_depth = int(num_allocated_qps), int(qp_depth)
        self.restrict_rd_atomic = bool(restrict_rd_atomic)
        self.sl_idx = sl_idx
        self.nccl_comm_handle = None
        self._engram: Optional[Engram] = None
        cpu = self.use_cpu_rdma_storage
        super().__init__(group=group, comm=comm, num_bytes=num_gpu_bytes,
                         num_extra_bytes=0 if cpu else num_rdma_storage_bytes,
                         num_host_bytes=num_rdma_storage_bytes if cpu else 0, allow_hybrid_mode=allow_hybrid_mode,
                         num_cpu_timeout_secs=num_cpu_timeout_secs, num_gpu_timeout_secs=num_gpu_timeout_secs,
                         explicitly_destroy=explicitly_destroy, device=device,
                         config={'use_cpu_rdma_storage': cpu, 'num_allocated_qps': self.num_allocated_qps})
        self.num_rdma_ranks, self.num_nvlink_ranks = self.num_scaleout_ranks, self.num_scaleup_ranks
        self._engram = Engram(weakref.proxy(self), out_region=(self.data_offset, num_gpu_bytes),
                              storage_region=None if cpu else (self.extra_offset, num_rdma_storage_bytes),
                              host_storage=self.host_storage)

    def _destroy_features(self) -> None:
        if self._engram is not None:
            self._engram.destroy()
        self._engram = None

    @staticmethod
    def get_storage_size_hint(group, num_entries_per_layer: List[int], hidden: int, num_max_tokens: int,
                              num_entries_per_token: int, dtype: Any = 'bfloat16',
                              num_sf_packs: int = 0) -> Tuple[int, int]:
        """`(num_gpu_bytes, num_rdma_storage_bytes)`, 2 MiB aligned: the fetch output of every layer (`layers x
        num_max_tokens x num_entries_per_token` rows) and one rank's tables of every layer. FP8 scale factors are
        replicated by the caller and kept outside the buffer (`num_sf_packs` is checked by `set_config`). `group`
        is accepted for DeepEP compatibility (the sizes do not depend on it)."""
        del group
        return layered_size_hint(num_entries_per_layer, hidden, num_max_tokens, num_entries_per_token, dtype,
                                 num_sf_packs)

    @staticmethod
    def get_theoretical_config(group, num_layers: int, num_max_tokens: int, num_entries_per_token: int,
                               num_max_read_requests_per_qp: int = 16) -> Tuple[int, int, bool]:
        """`(num_qps, qp_depth, restrict_rd_atomic)` for the constructor: `num_qps` = the device's SMs (blocks a fetch
        may use; a fetch launches fewer when it has few rows), `qp_depth` = `num_max_read_requests_per_qp`, no atomic
        restriction (no RDMA here). The layer and row counts are accepted for DeepEP compatibility."""
        del group, num_layers, num_max_tokens, num_entries_per_token
        import cupy
        return int(cupy.cuda.Device().attributes['MultiProcessorCount']), int(num_max_read_requests_per_qp), False

    def set_config(self, num_entries_per_layer: Sequence[int], hidden: int, num_max_tokens: int,
                   num_entries_per_token: int, dtype: Any = 'bfloat16', num_sf_packs: int = 0) -> None:
        """Fix the tables' shapes (collective: every rank passes the same values; checked against the sizes).

        Args:
            num_entries_per_layer: entries per rank of each layer's table.
            hidden: elements per row; dtype: bfloat16 or float8_e4m3fn.
            num_max_tokens, num_entries_per_token: the largest fetch (`[layers, num_max_tokens,
                num_entries_per_token]` indices).
            num_sf_packs: 4-byte scale-factor packs per entry of FP8 tables (0: none).
        """
        self.check_usable()
        check_int('num_max_tokens', num_max_tokens)
        check_int('num_entries_per_token', num_entries_per_token)
        self._engram.configure(num_entries_per_layer, hidden, dtype, num_sf_packs,
                               num_max_tokens * num_entries_per_token)

    def write(self, storages: Sequence[Any], sfs: Optional[Sequence[Any]] = None) -> None:
        """Copy this rank's rows of every layer into its storage (collective; see `set_config` for the shapes).

        Args:
            storages: per layer, `[num_entries, hidden]` bfloat16 or float8_e4m3fn, contiguous, on this GPU.
            sfs: for FP8 tables, per layer the replicated scale factors of every rank's rows, `[num_ranks *
                num_entries, num_sf_packs]` float32 (or int32 packed UE8M0). None: no scale factors.
        """
        if not isinstance(storages, (list, tuple)):
            storages = [storages]
        if sfs is not None and not isinstance(sfs, (list, tuple)):
            sfs = [sfs]
        self._engram.write(storages, sfs)

    def fetch(self, indices, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = True, *,
              check_indices: bool = True) -> List[Callable]:
        """Fetch rows of every layer (not collective) and return one wait hook per layer.

        Args:
            indices: `[num_layers, num_tokens, num_entries_per_token]` int32, contiguous, on this GPU; global entry
                ids of their layer, `[0, num_ranks * num_entries)`.
            num_qps: blocks of the fetch kernel, at most `num_allocated_qps` (0: all of them).
            use_tma_aligned_col_major_sf: FP8 scale factors column-major with the token dimension padded to 4.
            check_indices: read the indices' range back before the launch (a host wait for the current stream) and
                raise ValueError when one is outside every layer's range.

        Returns:
            per layer a hook; `hook()` (any order, any number of times) makes the current stream wait and returns
            `data` `[num_tokens, num_entries_per_token * hidden]` (a view of the fetch output, valid until the next
            fetch), or `(data, sf)` for tables with scale factors (`sf` `[num_tokens, num_entries_per_token *
            num_sf_packs]`).
        """
        check_int('num_qps', num_qps)
        num_qps = num_qps or self.num_allocated_qps
        if num_qps > self.num_allocated_qps:
            raise ValueError(f'num_qps={num_qps} exceeds num_allocated_qps={self.num_allocated_qps} (allocated QPs are '
                             f'not enough)')
        return self._engram.fetch(indices, num_qps, use_tma_aligned_col_major_sf, check_indices, layered=True)
