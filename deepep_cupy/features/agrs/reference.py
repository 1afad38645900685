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


# ---- hybrid mode: N scale-up domains x R ranks, rank g = n * R + r -------------------------------------------------
def _domain_partials(pieces: Sequence[np.ndarray], num_domains: int, stage_bf16: bool) -> list:
    """Per domain m: the FP32 sum of its ranks' pieces in rank order (each rounded to the staging precision)."""
    num_scaleup = len(pieces) // num_domains
    return [reduce_reference(pieces[m * num_scaleup:(m + 1) * num_scaleup], stage_bf16, 1.0, False)
            for m in range(num_domains)]


def hybrid_reduce_scatter_reference(inputs: Sequence[np.ndarray], rank: int, num_domains: int,
                                    comm_precision: str = 'fp32', scale: float = 1.0) -> np.ndarray:
    """Rank `rank`'s `reduce_scatter` result with `num_domains` domains (hybrid mode) from every rank's flattened input
    (`[W * n]` float32 or uint16 bfloat16 bits, W = N * R): the piece of every rank rounded to the staging precision
    (bfloat16 for bfloat16 inputs or comm_precision 'bf16'), per domain an FP32 sum in rank order (the in-domain
    reduce-scatter; the partial stays FP32 and crosses the rail in FP32), then the FP32 sum of the N partials in domain
    order 0..N-1, times `scale`, one rounding to the input precision. With one domain: `reduce_scatter_reference`."""
    num_ranks = len(inputs)
    if num_domains < 1 or num_ranks % num_domains:
        raise ValueError(f'{num_ranks} ranks do not form {num_domains} domains')
    n = inputs[0].size // num_ranks
    bf16 = inputs[0].dtype == np.uint16
    pieces = [np.ravel(x)[rank * n:(rank + 1) * n] for x in inputs]
    partials = _domain_partials(pieces, num_domains, bf16 or comm_precision == 'bf16')
    return reduce_reference(partials, False, scale, bf16)


def hybrid_all_reduce_reference(inputs: Sequence[np.ndarray], num_domains: int, scale: float = 1.0) -> np.ndarray:
    """`all_reduce` with `num_domains` domains (float32, flattened): per domain the FP32 sum of its ranks' inputs in
    rank order, then the FP32 sum of the domain partials in domain order, times `scale` (one rounding: FP32)."""
    num_ranks = len(inputs)
    if num_domains < 1 or num_ranks % num_domains:
        raise ValueError(f'{num_ranks} ranks do not form {num_domains} domains')
    partials = _domain_partials([np.ravel(x) for x in inputs], num_domains, False)
    return reduce_reference(partials, False, scale, False)
