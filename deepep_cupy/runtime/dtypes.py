"""The one dtype table: canonical names shared by the torch and CuPy sides, their sizes, and how CuPy holds the
dtypes it lacks (bfloat16 as uint16, float8 as uint8)."""

from typing import Any

import numpy as np

# Bytes per element of every dtype a buffer accepts (torch names; numpy spells the common ones alike).
ITEMSIZE = {
    'bfloat16': 2, 'float8_e4m3fn': 1, 'float32': 4, 'float16': 2, 'float64': 8, 'int32': 4, 'int64': 8, 'int16': 2,
    'int8': 1, 'uint8': 1, 'bool': 1, 'uint16': 2, 'uint32': 4, 'uint64': 8,
}
# The numpy dtype a CuPy array uses to hold each dtype CuPy lacks.
CUPY_STORAGE = {'bfloat16': 'uint16', 'float8_e4m3fn': 'uint8', 'float8_e5m2': 'uint8'}
# What a CuPy array of this numpy dtype may stand for.
CUPY_ALIASES = {'uint16': ('uint16', 'bfloat16'), 'uint8': ('uint8', 'float8_e4m3fn', 'bool')}
# bfloat16 and float8 tables (engram) and their CuPy stand-ins.
LOW_PRECISION = {'bfloat16': 2, 'float8_e4m3fn': 1}


def itemsize(name: str) -> int:
    return ITEMSIZE[name]


_STORAGE_CACHE = {}


def cupy_storage(name: str) -> np.dtype:
    """The numpy dtype of a CuPy array holding `name` data (`'bfloat16'` → uint16, `'bool'` → bool_)."""
    dtype = _STORAGE_CACHE.get(name)
    if dtype is None:
        dtype = _STORAGE_CACHE[name] = np.dtype(CUPY_STORAGE.get(name, name))
    return dtype


def is_torch_dtype(dtype: Any) -> bool:
    return type(dtype).__module__.split('.')[0] == 'torch'


def torch_name(dtype: Any) -> str:
    """`'bfloat16'` for `torch.bfloat16`."""
    return str(dtype).replace('torch.', '')


def low_precision_name(dtype: Any) -> str:
    """`'bfloat16'` or `'float8_e4m3fn'` for a torch dtype, a name, or CuPy's stand-ins (uint16, uint8);
    `TypeError` otherwise."""
    if isinstance(dtype, str):
        name = dtype
    elif is_torch_dtype(dtype):
        name = torch_name(dtype)
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    name = {'uint16': 'bfloat16', 'uint8': 'float8_e4m3fn'}.get(name, name)
    if name not in LOW_PRECISION:
        raise TypeError(f'dtype must be bfloat16 or float8_e4m3fn (CuPy: uint16 or uint8), got {dtype}')
    return name


def describe(dtype: Any):
    """`(kind, name, itemsize)` of a torch dtype (kind 'torch', its name) or a numpy dtype / dtype name (kind 'cupy',
    the numpy name CuPy holds it in: 'bfloat16' and 'float8_e4m3fn' as uint16 / uint8); `TypeError` if unsupported."""
    if is_torch_dtype(dtype):
        name = torch_name(dtype)
        if name not in ITEMSIZE:
            raise TypeError(f'dtype: unsupported torch dtype {dtype}')
        return 'torch', name, ITEMSIZE[name]
    if isinstance(dtype, str) and dtype in LOW_PRECISION:
        return 'cupy', CUPY_STORAGE[dtype], ITEMSIZE[dtype]
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f'dtype must be a torch dtype or a numpy dtype, got {dtype!r}') from None
    if np_dtype.name not in ITEMSIZE:
        raise TypeError(f'dtype: unsupported dtype {np_dtype}')
    return 'cupy', np_dtype.name, np_dtype.itemsize
