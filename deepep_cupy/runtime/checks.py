"""Argument checks at the API edge, shared by every feature: user errors raise `ValueError` / `TypeError` naming the
argument, the value and what was expected, before any kernel runs (so the buffer stays usable)."""

import math
from typing import Any, Optional, Tuple

import numpy as np

from .interop import TensorInfo, tensor_info


def check_int(name: str, value: Any, minimum: int = 0) -> int:
    """`value` if it is an int >= `minimum`; `TypeError` / `ValueError` naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f'{name} must be an int, got {type(value).__name__} ({value!r})')
    if value < minimum:
        raise ValueError(f'{name} must be >= {minimum}, got {value}')
    return value


def check_finite(name: str, value: Any) -> float:
    """`value` as a float if it is a finite real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f'{name} must be a number, got {value!r}')
    if not math.isfinite(float(value)):
        raise ValueError(f'{name} must be finite, got {value}')
    return float(value)


def info(x: Any, name: str, device: int) -> TensorInfo:
    """`tensor_info(x)` of an array on `device` (this rank's GPU); `ValueError` naming `name` elsewhere."""
    t = tensor_info(x, name)
    if t.device != device:
        where = 'the host' if t.device < 0 else f'cuda:{t.device}'
        raise ValueError(f'{name} must be on cuda:{device} (this rank\'s GPU), got an array on {where}')
    return t


def check_dtype(t: TensorInfo, name: str, *dtypes: str) -> None:
    if not any(t.dtype_matches(d) for d in dtypes):
        raise TypeError(f'{name} must be {" or ".join(dtypes)}, got {t.dtype}')


def check_shape(t: TensorInfo, name: str, shape: Tuple[Optional[int], ...]) -> None:
    ok = len(t.shape) == len(shape) and all(s is None or s == a for s, a in zip(shape, t.shape))
    if not ok:
        want = '[' + ', '.join('*' if s is None else str(s) for s in shape) + ']'
        raise ValueError(f'{name} must have shape {want}, got {list(t.shape)}')


def check_contiguous(t: TensorInfo, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f'{name} must be contiguous, got shape {list(t.shape)} with strides {list(t.strides)}')


def check_same_kind(kind: str, t: TensorInfo, name: str) -> None:
    if t.kind != kind:
        raise TypeError(f'{name} is a {t.kind} array but the other inputs are {kind} arrays; pass one kind')
