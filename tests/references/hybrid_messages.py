"""Byte formats of the FUSED hybrid design, as numpy: the host reference of what its pack and forward kernels
write (layouts in hybrid_layout.py), used by the CPU tests to push real bytes through the rail transports' plans.

Every rail peer region: `[header | payload]`, header = int32 `[count, epoch, kind, 0]` (16 bytes). Payloads:
notify = the counts block `[R][1 + L]` int32; dispatch = `count` rail messages; combine = `count * units` combine
rows. Rail message: `[src token index | K expert ids | K weights | K expert positions | R forward slots]` padded to
16 bytes, scale factors (uint32 each) padded to 16, hidden bytes padded to 16. Scale-up message: the same without
the forward slots (features/ep's one-domain message, kernels_cu/common/ep.cuh `MessageLayout`).
"""

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from deepep_cupy.runtime.sizes import align

from . import hybrid_layout as lay
from .hybrid_reference import HybridDispatch


def write_header(buf: np.ndarray, offset: int, count: int, epoch: int, kind: int) -> None:
    buf[offset:offset + lay.RAIL_HEADER_BYTES].view(np.int32)[:] = (count, epoch, kind, 0)


def read_header(buf: np.ndarray, offset: int) -> Tuple[int, int, int]:
    """`(count, epoch, kind)` of the header at `offset`."""
    words = buf[offset:offset + lay.RAIL_HEADER_BYTES].view(np.int32)
    return int(words[0]), int(words[1]), int(words[2])


@dataclass(frozen=True)
class MessageFormat:
    """Field offsets of a dispatch message (`num_forward` = R for a rail message, 0 for a scale-up one)."""
    num_topk: int
    num_forward: int
    num_sf: int
    hidden_bytes: int

    @property
    def meta_bytes(self) -> int:
        return align(4 + 12 * self.num_topk + 4 * self.num_forward, 16)

    @property
    def sf_offset(self) -> int:
        return self.meta_bytes

    @property
    def hidden_offset(self) -> int:
        return self.sf_offset + align(4 * self.num_sf, 16)

    @property
    def bytes(self) -> int:
        return self.hidden_offset + align(self.hidden_bytes, 16)

    def pack(self, buf: np.ndarray, offset: int, src_token_idx: int, expert_ids: np.ndarray, weights: np.ndarray,
             expert_pos: np.ndarray, forward_slots: Optional[np.ndarray], sf: Optional[np.ndarray],
             hidden: np.ndarray) -> None:
        """Write one message (`hidden` as uint8 bytes, `sf` as uint32 words) at `offset`."""
        K = self.num_topk
        words = buf[offset:offset + self.meta_bytes].view(np.int32)
        words[0] = src_token_idx
        words[1:1 + K] = expert_ids
        words[1 + K:1 + 2 * K] = np.asarray(weights, dtype=np.float32).view(np.int32)
        words[1 + 2 * K:1 + 3 * K] = expert_pos
        if self.num_forward:
            words[1 + 3 * K:1 + 3 * K + self.num_forward] = forward_slots
        if self.num_sf:
            buf[offset + self.sf_offset:offset + self.sf_offset + 4 * self.num_sf].view(np.uint32)[:] = sf
        buf[offset + self.hidden_offset:offset + self.hidden_offset + self.hidden_bytes] = hidden

    def unpack(self, buf: np.ndarray, offset: int) -> Dict[str, np.ndarray]:
        K = self.num_topk
        words = buf[offset:offset + self.meta_bytes].view(np.int32)
        out = {'src_token_idx': int(words[0]), 'expert_ids': words[1:1 + K].copy(),
               'weights': words[1 + K:1 + 2 * K].view(np.float32).copy(),
               'expert_pos': words[1 + 2 * K:1 + 3 * K].copy(),
               'forward_slots': words[1 + 3 * K:1 + 3 * K + self.num_forward].copy(),
               'sf': buf[offset + self.sf_offset:offset + self.sf_offset + 4 * self.num_sf].view(np.uint32).copy(),
               'hidden': buf[offset + self.hidden_offset:offset + self.hidden_offset + self.hidden_bytes].copy()}
        return out


def formats(layout: lay.HybridLayout, num_sf: int, hidden_bytes: int) -> Tuple[MessageFormat, MessageFormat]:
    """`(rail, scale-up)` message formats of a call (at most the layout's sizes)."""
    rail = MessageFormat(layout.num_topk, layout.num_scaleup_ranks, num_sf, hidden_bytes)
    scaleup = MessageFormat(layout.num_topk, 0, num_sf, hidden_bytes)
    assert rail.bytes == lay.rail_message_bytes(hidden_bytes, num_sf, layout.num_topk, layout.num_scaleup_ranks)
    assert scaleup.bytes == lay.message_bytes(hidden_bytes, num_sf, layout.num_topk)
    assert rail.bytes <= layout.rail_message_bytes and scaleup.bytes <= layout.message_bytes
    return rail, scaleup


def pack_notify(layout: lay.HybridLayout, d: HybridDispatch, rank: int, buf: np.ndarray, epoch: int) -> Dict[int, int]:
    """The notify kernel's rail part at `rank`: block m into the notify send region of every peer domain m. Returns
    the payload bytes per peer (the same for every peer: the exchange is fixed-size)."""
    areas, shape = layout.rail_areas('notify'), d.shape
    n = shape.domain_of(rank)
    block = d.routings[rank].notify_blocks
    payload = {}
    for m in range(shape.num_domains):
        if m == n:
            continue
        off = areas.send_region(n, m)
        write_header(buf, off, block[m].size, epoch, lay.KIND_NOTIFY)
        data = block[m].astype(np.int32).ravel().view(np.uint8)
        buf[off + lay.RAIL_HEADER_BYTES:off + lay.RAIL_HEADER_BYTES + data.size] = data
        payload[m] = align(data.size, 16)
    return payload


def pack_dispatch(layout: lay.HybridLayout, d: HybridDispatch, rank: int, buf: np.ndarray, x: np.ndarray,
                  weights: Optional[np.ndarray], sf: Optional[np.ndarray], epoch: int) -> Dict[int, int]:
    """The pack kernel at `rank`: every token for another domain m, once, at its rail position in the send region
    for m, with its header. `x` is `[T, hidden_bytes]` uint8, `sf` `[T, num_sf]` uint32. Returns the exact payload
    bytes per peer (the static plan sends the whole region instead)."""
    shape, areas, rt = d.shape, layout.rail_areas('data'), d.routings[rank]
    n, R, K = shape.domain_of(rank), shape.num_scaleup_ranks, shape.num_topk
    num_sf = 0 if sf is None else sf.shape[1]
    rail, _ = formats(layout, num_sf, x.shape[1])
    payload = {}
    for m in range(shape.num_domains):
        if m == n:
            continue
        off = areas.send_region(n, m) + lay.RAIL_HEADER_BYTES
        tokens = np.nonzero(rt.domain_pos[:, m] >= 0)[0]
        for t in tokens:
            w = weights[t] if weights is not None else np.zeros(K, dtype=np.float32)
            rail.pack(buf, off + int(rt.domain_pos[t, m]) * rail.bytes, int(t), rt.topk_idx[t], w,
                      rt.send_expert_pos[t], rt.send_pos[t, m * R:(m + 1) * R], None if sf is None else sf[t], x[t])
        write_header(buf, off - lay.RAIL_HEADER_BYTES, tokens.size, epoch, lay.KIND_DISPATCH)
        payload[m] = tokens.size * rail.bytes
    return payload


def forward(layout: lay.HybridLayout, shape, rank: int, bufs: Sequence[np.ndarray], num_sf: int, hidden_bytes: int,
            epoch: int) -> np.ndarray:
    """The forward kernel at `rank` = (m, r): read every rail receive region (count from its header), write each
    message as a scale-up message into region (r, n) of every rank (m, l) named by its forward slots (`bufs` are the
    buffers of all ranks, as the IPC mappings give them). Returns `token_metadata_at_forward` `[N, M, 1 + K]`."""
    areas = layout.rail_areas('data')
    m, r = shape.domain_of(rank), shape.scaleup_idx_of(rank)
    rail, scaleup = formats(layout, num_sf, hidden_bytes)
    meta = np.full((shape.num_domains, shape.num_max_tokens_per_rank, 1 + shape.num_topk), -1, dtype=np.int32)
    for n in range(shape.num_domains):
        if n == m:
            continue
        off = areas.recv_region(m, n)
        count, got_epoch, kind = read_header(bufs[rank], off)
        assert (got_epoch, kind) == (epoch, lay.KIND_DISPATCH), f'stale rail region from domain {n} at rank {rank}'
        for p in range(count):
            msg = rail.unpack(bufs[rank], off + lay.RAIL_HEADER_BYTES + p * rail.bytes)
            meta[n, p, 0], meta[n, p, 1:] = msg['src_token_idx'], msg['expert_ids']
            for lo, slot in enumerate(msg['forward_slots'].tolist()):
                if slot >= 0:
                    dst = shape.rank_of(m, lo)
                    at = layout.scaleup_region_offset(n, r) + slot * layout.message_bytes
                    scaleup.pack(bufs[dst], at, msg['src_token_idx'], msg['expert_ids'], msg['weights'],
                                 msg['expert_pos'], None, msg['sf'], msg['hidden'])
    return meta
