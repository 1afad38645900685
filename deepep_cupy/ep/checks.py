"""Argument checks of dispatch / combine: every user error raises `ValueError` / `TypeError` naming the argument,
before any kernel runs, so the buffer stays usable."""

from typing import Any, Optional, Tuple

from ..runtime.interop import TensorInfo, tensor_info
from ..validation import check_int  # noqa: F401  (re-exported for the EP API)


def info(x: Any, name: str, device: int) -> TensorInfo:
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
