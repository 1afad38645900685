"""`BufferAllocator`: plan tensors inside a symmetric buffer before the buffer exists (DeepEP V2.5).

A plan hands out placeholders at 2 MiB aligned offsets; once the buffer is built, `materialize(storage)` turns every
placeholder into a real view of the buffer's memory. torch placeholders are `device='meta'` tensors that are swapped
in place (`torch.utils.swap_tensors`), so references taken before materialisation see the real tensor afterwards;
CuPy placeholders are `Placeholder` objects whose `array` attribute is filled in. Every rank of a domain must build
the same plan (the load-balancing buffer checks it), so a tensor sits at the same offset on every rank and peers can
address it.
"""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..constants import BUFFER_ALIGNMENT
from ..runtime import dtypes
from ..runtime.sizes import align

TMA_ALIGNMENT = 32
RDMA_ALIGNMENT = 64


def get_num_allocation_alignment() -> int:
    """Alignment in bytes of every symmetric allocation and of every planned tensor (2 MiB)."""
    return BUFFER_ALIGNMENT


def get_num_tma_alignment() -> int:
    """Alignment in bytes that bulk (TMA) copies need for addresses and sizes (32)."""
    return TMA_ALIGNMENT


def get_num_rdma_alignment() -> int:
    """Alignment in bytes of RDMA transfers (64); kept for API compatibility (this build has no RDMA path)."""
    return RDMA_ALIGNMENT


def _is_torch_dtype(dtype: Any) -> bool:
    import sys
    torch = sys.modules.get('torch')
    return torch is not None and isinstance(dtype, torch.dtype)


def _numpy_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, str) and dtype in dtypes.CUPY_STORAGE:
        return np.dtype(dtypes.CUPY_STORAGE[dtype])
    try:
        return np.dtype(dtype)
    except TypeError:
        raise TypeError(f'dtype must be a torch dtype, a numpy dtype or a dtype name, got {dtype!r}') from None


@dataclass
class Placeholder:
    """A planned CuPy array: `array` is None until the plan is materialised, then a CuPy view of the buffer."""
    shape: Tuple[int, ...]
    dtype: np.dtype
    offset: int
    array: Any = None


@dataclass(frozen=True)
class Allocation:
    """One planned tensor: byte `offset` from the start of the planned region, `shape`, dtype name, `num_bytes`."""
    offset: int
    shape: Tuple[int, ...]
    dtype: str
    num_bytes: int


class BufferAllocator:
    """Plans tensors at aligned offsets of a region that will be created later.

    Attributes:
        alignment: byte alignment of every tensor's offset (`get_num_allocation_alignment()`, 2 MiB).
    """

    def __init__(self, alignment: Optional[int] = None):
        self.alignment = int(alignment or get_num_allocation_alignment())
        if self.alignment <= 0 or self.alignment % 16:
            raise ValueError(f'alignment must be a positive multiple of 16, got {alignment}')
        self._allocations: List[Allocation] = []
        self._placeholders: List[Any] = []
        self._end = 0
        self._materialized = False

    def allocate(self, shape: Sequence[int], dtype: Any):
        """Plan a tensor of `shape` and `dtype` at the next aligned offset.

        Args:
            shape: non-negative sizes.
            dtype: a torch dtype (gives a `device='meta'` torch placeholder), or a numpy dtype / dtype name (gives a
                CuPy `Placeholder`; 'bfloat16' is held as uint16 and float8 as uint8, as CuPy users do).

        Returns:
            the placeholder; after `materialize` it is (torch) or holds in `.array` (CuPy) a view of the buffer.
        """
        if self._materialized:
            raise RuntimeError('this plan was already materialised; make a new BufferAllocator')
        if isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f'shape must have non-negative sizes, got {shape}')
        offset = align(self._end, self.alignment)
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if _is_torch_dtype(dtype):
            import torch
            placeholder = torch.empty(shape, dtype=dtype, device='meta')
            name, itemsize = str(dtype).replace('torch.', ''), placeholder.element_size()
        else:
            np_dtype = _numpy_dtype(dtype)
            placeholder = Placeholder(shape, np_dtype, offset)
            name, itemsize = np_dtype.name, np_dtype.itemsize
        num_bytes = numel * itemsize
        self._allocations.append(Allocation(offset, shape, name, num_bytes))
        self._placeholders.append(placeholder)
        self._end = offset + num_bytes
        return placeholder

    @property
    def num_bytes(self) -> int:
        """Bytes the plan needs: the end of the last tensor rounded up to the alignment (0 for an empty plan)."""
        return align(self._end, self.alignment)

    @property
    def allocations(self) -> Tuple[Allocation, ...]:
        """Every planned tensor, in allocation order."""
        return tuple(self._allocations)

    @property
    def placeholders(self) -> Tuple[Any, ...]:
        """The objects `allocate` returned, in allocation order (real tensors once materialised)."""
        return tuple(self._placeholders)

    @property
    def materialized(self) -> bool:
        return self._materialized

    def signature(self) -> Tuple:
        """A comparable description of the plan (offsets, shapes, dtypes), identical on ranks with identical plans."""
        return (self.alignment, self.num_bytes, tuple((a.offset, a.shape, a.dtype) for a in self._allocations))

    def materialize(self, storage) -> List[Any]:
        """Turn every placeholder into a view of `storage` (once).

        Args:
            storage: `[>= num_bytes]` uint8, a torch CUDA tensor or a CuPy array (either kind serves both kinds of
                placeholder, through DLPack); its start must be aligned to 16 bytes.

        Returns:
            the materialised tensors in allocation order: the torch placeholders themselves (swapped in place; if the
            swap is refused, the new views instead) and the CuPy views.
        """
        from ..runtime import interop
        if self._materialized:
            raise RuntimeError('BufferAllocator.materialize may be called once per plan')
        info = interop.tensor_info(storage, 'storage')
        if info.dtype != 'uint8' or info.ndim != 1 or not info.is_contiguous():
            raise ValueError(f'storage must be a contiguous 1-D uint8 array, got {info.dtype} {list(info.shape)}')
        if info.nbytes < self.num_bytes:
            raise ValueError(f'storage holds {info.nbytes} bytes, the plan needs {self.num_bytes}')
        if info.ptr % 16:
            raise ValueError('storage must start at a 16-byte aligned address')
        torch_storage = cupy_storage = None
        out = []
        for alloc, placeholder in zip(self._allocations, self._placeholders):
            if isinstance(placeholder, Placeholder):
                if cupy_storage is None:
                    cupy_storage = interop.to_cupy(storage)
                view = cupy_storage[alloc.offset:alloc.offset + alloc.num_bytes].view(placeholder.dtype)
                placeholder.array = view.reshape(alloc.shape)
                out.append(placeholder.array)
            else:
                import torch
                if torch_storage is None:
                    torch_storage = storage if interop.is_torch(storage) else interop.to_torch(storage)
                view = torch_storage[alloc.offset:alloc.offset + alloc.num_bytes].view(placeholder.dtype)
                view = view.view(alloc.shape)
                try:
                    torch.utils.swap_tensors(placeholder, view)
                    out.append(placeholder)
                except RuntimeError:
                    out.append(view)
        self._materialized = True
        return out
