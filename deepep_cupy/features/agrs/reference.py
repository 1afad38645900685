"""Bitwise references of the reductions (numpy, in the kernels' order): what `reduce_scatter` and `all_reduce`
compute, for the rank program and the CPU tests."""

from typing import Sequence

import numpy as np


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even, NaN → 0x7FFF as the GPU's cvt.rn does); uint16 bits."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(0x7FFF), r)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def reduce_reference(pieces: Sequence[np.ndarray], stage_bf16: bool, scale: float, out_bf16: bool) -> np.ndarray:
    """What the kernels compute from the R pieces of one shard (float32, or uint16 bfloat16 bits), in rank order:
    each piece rounded to the staging precision, FP32 sum from piece 0, times `scale` (FP32), then rounded to the
    output precision. Returns float32, or uint16 bits when `out_bf16`."""
    values = []
    for p in pieces:
        v = bf16_bits_to_f32(p) if p.dtype == np.uint16 else np.asarray(p, dtype=np.float32)
        values.append(bf16_bits_to_f32(f32_to_bf16_bits(v)) if stage_bf16 else v)
    acc = values[0].copy()
    for v in values[1:]:
        acc = (acc + v).astype(np.float32)
    acc = (acc * np.float32(scale)).astype(np.float32)
    return f32_to_bf16_bits(acc) if out_bf16 else acc


def reduce_scatter_reference(inputs: Sequence[np.ndarray], rank: int, comm_precision: str = 'fp32',
                             scale: float = 1.0) -> np.ndarray:
    """Rank `rank`'s `reduce_scatter` result from every rank's flattened input (`[R * n]` float32 or uint16 bits)."""
    num_ranks = len(inputs)
    n = inputs[0].size // num_ranks
    bf16 = inputs[0].dtype == np.uint16
    pieces = [np.ravel(x)[rank * n:(rank + 1) * n] for x in inputs]
    return reduce_reference(pieces, bf16 or comm_precision == 'bf16', scale, bf16)


def all_reduce_reference(inputs: Sequence[np.ndarray], scale: float = 1.0) -> np.ndarray:
    """`all_reduce` result (float32, flattened) from every rank's flattened float32 input."""
    return reduce_reference([np.ravel(x) for x in inputs], False, scale, False)
