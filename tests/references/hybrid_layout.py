"""Sizes and offsets of the FUSED hybrid design (several scale-up domains joined by NCCL rails; its kernels are not
written: deepep_cupy/features/hybrid/__init__.py lists them). What runs today, the composed path, lays out its rail
area with features/hybrid/plan.py. This layout is the one the fused kernels are to take every offset from, and the
host reference's (`hybrid_reference.py`, `hybrid_messages.py` pack and read rail messages with it). The one-domain
limits come from deepep_cupy.constants and features/ep/layout.py.

Notation: N domains, R ranks per domain, W = N * R ranks, M = num_max_tokens_per_rank, K = top-k, H = hidden.
Rank g = n * R + r (domain n, scale-up index r); the rail of r = the ranks (0, r), (1, r), ..., (N - 1, r).

Data region of a rank's symmetric buffer in hybrid mode (every offset from the buffer's start; regions 4 KiB aligned):

    [scale-up receive slots | combine stage | scratch | rail flags | rail notify send | rail notify recv |
     rail send | rail recv]

- Scale-up receive slots: `[R][N][M]` scale-up messages (`message_bytes`, the one-domain message): region `r * N + n`
  holds what source rank (n, r) sends this rank, slot p = the token's position among (n, r)'s tokens going here.
  Every region `(r, *)` is written over NVLink by this domain's rank r alone (directly for n = own domain, as the
  forwarder of (n, r) otherwise). Worst case like DeepEP V2 (`scaleup_recv = [R][N * M]`).
- Combine stage (at the forwarder): `[N][M][num_stage_slots]` combine rows (`combine_row_bytes`): row `n * M + p` is
  the token of rail peer (n, r) at domain position p (p = its position among (n, r)'s tokens going to this domain);
  the domain's ranks push their partials into its slots over NVLink.
- Scratch: per-block counts of the notify pass (as inside one domain, with W destinations).
- Rail flags: epoch words of the IPC loopback transport (`runtime/rails.py`; unused with NCCL).
- Rail areas, each `[N - 1]` peer regions (peer domain m at region `m - (m > n)` of rank (n, r)), every region =
  a 16-byte header (int32 count, epoch, kind, 0) + payload; NCCL moves header + payload, so every transfer has at
  least 16 bytes and every rail peer issues one send and one receive per peer (`runtime/rails.py`):
    notify: `R * (1 + L_max)` int32 per peer (the counts block of one destination domain);
    send / recv: the larger of M rail messages (dispatch) and `M * num_rail_units` combine rows (combine reuses the
    dispatch's rail areas: both are stream-ordered on every rail peer and a combine needs only the handle).
  DeepEP V2 keeps one scale-out send copy `[M]` (a GIN put reads it for every destination); host-issued NCCL needs
  a contiguous range per peer, so the send side here is `[N - 1][M]`.

Rail message (dispatch, origin → forwarder): `[src token index | K global expert ids | K weights | K expert positions
| R forward slots]` int32/float32, padded to 16 bytes, then scale factors (4 bytes each, padded to 16), then hidden
bytes (padded to 16). The forward slots are the token's slot at each rank of the destination domain (-1: not sent
there), computed by the origin's notify, so the forwarder never scans.
"""

from dataclasses import dataclass
from typing import Dict

from deepep_cupy.constants import BUFFER_ALIGNMENT, NUM_MAX_LOCAL_EXPERTS, NUM_MAX_TOPK, SF_GROUP
from deepep_cupy.features.ep.layout import NOTIFY_TOKENS_PER_BLOCK
from deepep_cupy.runtime.sizes import align, ceil_div

RAIL_HEADER_BYTES = 16            # int32 [count, epoch, kind, 0] at the start of every rail peer region
RAIL_FLAGS_BYTES = 4096           # loopback words, 128 bytes apart: its epoch, ready [N], consumed [N]
RAIL_FLAG_STRIDE = 128
REGION_ALIGNMENT = 4096
# Header kinds (debugging aid: a region holding another kind than expected is a desynchronised rail).
KIND_NOTIFY, KIND_DISPATCH, KIND_COMBINE = 1, 2, 3
# Notify counts of all W sources, `[W][1 + L]` int32, must fit the workspace's EP notify area
# (kernels_cu/common/workspace.cuh kWsEPNotifyBytes; the hybrid notify needs none of the one-domain notify rows, which
# serve DeepEP V1's matrices inside one domain).
NOTIFY_AREA_BYTES = 65536


def meta_bytes(num_topk: int) -> int:
    """Meta of a scale-up message: src token index, K expert ids, K weights, K expert positions (16-byte padded)."""
    return align(4 + 12 * num_topk, 16)


def message_bytes(hidden_bytes: int, num_sf: int, num_topk: int) -> int:
    """Bytes of one scale-up (NVLink) dispatch message, the one-domain message."""
    return meta_bytes(num_topk) + align(4 * num_sf, 16) + align(hidden_bytes, 16)


def rail_meta_bytes(num_topk: int, num_scaleup_ranks: int) -> int:
    """Meta of a rail message: the scale-up meta plus R int32 forward slots (16-byte padded)."""
    return align(4 + 12 * num_topk + 4 * num_scaleup_ranks, 16)


def rail_message_bytes(hidden_bytes: int, num_sf: int, num_topk: int, num_scaleup_ranks: int) -> int:
    """Bytes of one rail (NCCL) dispatch message."""
    return rail_meta_bytes(num_topk, num_scaleup_ranks) + align(4 * num_sf, 16) + align(hidden_bytes, 16)


def combine_row_bytes(hidden: int, num_topk: int) -> int:
    """One combine row `[H bfloat16 | K float32 weights]`, each part 16-byte padded (the one-domain slot)."""
    return align(2 * hidden, 16) + align(4 * num_topk, 16)


def num_stage_slots(num_scaleup_ranks: int, num_topk: int, allow_multiple_reduction: bool) -> int:
    """Combine stage slots per forwarded token: one per destination rank of the domain (`min(R, K)`, ranks numbered
    by first top-k appearance) when every rank reduces its own experts first; one per top-k slot (`K`, slot = k)
    when `allow_multiple_reduction=False` lets an expanded combine send every partial."""
    return min(num_scaleup_ranks, num_topk) if allow_multiple_reduction else num_topk


def num_rail_units(num_scaleup_ranks: int, num_topk: int, allow_multiple_reduction: bool) -> int:
    """Combine rows per (token, domain) on the rail: 1 when the forwarder reduces its domain (DeepEP's
    `reduce_in_scaleup`), else the stage's slots passed through."""
    return 1 if allow_multiple_reduction else num_stage_slots(num_scaleup_ranks, num_topk, False)


def notify_block_words(num_scaleup_ranks: int, num_local_experts: int) -> int:
    """int32 words of the counts block one origin sends one destination domain: per rank l of that domain
    `[tokens to l, (token, slot) pairs to each of l's L experts]`."""
    return num_scaleup_ranks * (1 + num_local_experts)


def check_notify_capacity(num_domains: int, num_scaleup_ranks: int, num_experts: int) -> None:
    """`ValueError` when the notify counts of all W sources (`W * (1 + L)` int32) overflow the notify area."""
    num_ranks = num_domains * num_scaleup_ranks
    words = num_ranks + num_experts
    if 4 * words > NOTIFY_AREA_BYTES:
        raise ValueError(f'hybrid notify: {num_ranks} ranks and {num_experts} experts need {4 * words} bytes of '
                         f'notify counts, more than the {NOTIFY_AREA_BYTES} the workspace holds')


def region_index(self_domain: int, peer_domain: int) -> int:
    """Index of `peer_domain`'s region among a rank's `N - 1` rail peer regions (its own domain has none)."""
    if peer_domain == self_domain:
        raise ValueError(f'domain {self_domain} has no rail region for itself')
    return peer_domain - (peer_domain > self_domain)


@dataclass(frozen=True)
class HybridLayout:
    """Offsets (bytes, from the start of the symmetric buffer) of the hybrid regions for one configuration."""
    num_domains: int                   # N
    num_scaleup_ranks: int             # R
    num_max_tokens_per_rank: int       # M
    hidden: int
    num_topk: int                      # K (the size hint's 0 means 32)
    allow_multiple_reduction: bool
    data_offset: int                   # start of the data region (after the workspace)

    def __post_init__(self):
        if self.num_domains < 2 or self.num_scaleup_ranks < 1:
            raise ValueError(f'hybrid mode needs at least 2 domains of at least 1 rank, got {self.num_domains} x '
                             f'{self.num_scaleup_ranks}')
        if not 1 <= self.num_topk <= NUM_MAX_TOPK:
            raise ValueError(f'num_topk must be in [1, {NUM_MAX_TOPK}], got {self.num_topk}')

    # ---- sizes of the units ----
    @property
    def num_ranks(self) -> int:
        return self.num_domains * self.num_scaleup_ranks

    @property
    def max_num_sf(self) -> int:
        return ceil_div(self.hidden, SF_GROUP)

    @property
    def message_bytes(self) -> int:
        """Largest scale-up message (bfloat16 hidden and the most scale factors)."""
        return message_bytes(2 * self.hidden, self.max_num_sf, self.num_topk)

    @property
    def rail_message_bytes(self) -> int:
        return rail_message_bytes(2 * self.hidden, self.max_num_sf, self.num_topk, self.num_scaleup_ranks)

    @property
    def combine_row_bytes(self) -> int:
        return combine_row_bytes(self.hidden, self.num_topk)

    @property
    def num_stage_slots(self) -> int:
        return num_stage_slots(self.num_scaleup_ranks, self.num_topk, self.allow_multiple_reduction)

    @property
    def num_rail_units(self) -> int:
        return num_rail_units(self.num_scaleup_ranks, self.num_topk, self.allow_multiple_reduction)

    # ---- symmetric (NVLink) regions ----
    @property
    def scaleup_recv_offset(self) -> int:
        return align(self.data_offset, REGION_ALIGNMENT)

    @property
    def scaleup_recv_bytes(self) -> int:
        return self.num_ranks * self.num_max_tokens_per_rank * self.message_bytes

    def scaleup_region_offset(self, src_domain: int, src_scaleup_idx: int) -> int:
        """Start of the receive region of source rank (src_domain, src_scaleup_idx): region `r * N + n`."""
        region = src_scaleup_idx * self.num_domains + src_domain
        return self.scaleup_recv_offset + region * self.num_max_tokens_per_rank * self.message_bytes

    @property
    def stage_offset(self) -> int:
        return align(self.scaleup_recv_offset + self.scaleup_recv_bytes, REGION_ALIGNMENT)

    @property
    def stage_bytes(self) -> int:
        return self.num_domains * self.num_max_tokens_per_rank * self.num_stage_slots * self.combine_row_bytes

    def stage_slot_offset(self, stage_row: int, slot: int) -> int:
        return self.stage_offset + (stage_row * self.num_stage_slots + slot) * self.combine_row_bytes

    @property
    def scratch_offset(self) -> int:
        return align(self.stage_offset + self.stage_bytes, REGION_ALIGNMENT)

    @property
    def scratch_bytes(self) -> int:
        num_blocks = max(1, ceil_div(self.num_max_tokens_per_rank, NOTIFY_TOKENS_PER_BLOCK))
        return num_blocks * (self.num_ranks * NUM_MAX_LOCAL_EXPERTS + self.num_ranks) * 4

    # ---- rail regions ----
    @property
    def rail_flags_offset(self) -> int:
        return align(self.scratch_offset + self.scratch_bytes, REGION_ALIGNMENT)

    @property
    def notify_region_bytes(self) -> int:
        return align(RAIL_HEADER_BYTES + 4 * notify_block_words(self.num_scaleup_ranks, NUM_MAX_LOCAL_EXPERTS), 16)

    @property
    def rail_notify_send_offset(self) -> int:
        return align(self.rail_flags_offset + RAIL_FLAGS_BYTES, REGION_ALIGNMENT)

    @property
    def rail_notify_recv_offset(self) -> int:
        return align(self.rail_notify_send_offset + (self.num_domains - 1) * self.notify_region_bytes,
                     REGION_ALIGNMENT)

    @property
    def rail_region_bytes(self) -> int:
        """One peer region of the rail send / recv areas: header + the larger payload of dispatch and combine."""
        payload = max(self.num_max_tokens_per_rank * self.rail_message_bytes,
                      self.num_max_tokens_per_rank * self.num_rail_units * self.combine_row_bytes)
        return align(RAIL_HEADER_BYTES + payload, 16)

    @property
    def rail_send_offset(self) -> int:
        return align(self.rail_notify_recv_offset + (self.num_domains - 1) * self.notify_region_bytes,
                     REGION_ALIGNMENT)

    @property
    def rail_recv_offset(self) -> int:
        return align(self.rail_send_offset + (self.num_domains - 1) * self.rail_region_bytes, REGION_ALIGNMENT)

    @property
    def end_offset(self) -> int:
        return align(self.rail_recv_offset + (self.num_domains - 1) * self.rail_region_bytes, REGION_ALIGNMENT)

    @property
    def rail_begin_offset(self) -> int:
        """Start of the rail regions (one contiguous range to register with NCCL)."""
        return self.rail_flags_offset

    def rail_areas(self, area: str) -> 'RailAreas':
        """The peer regions of one rail area: `'notify'` or `'data'` (dispatch and combine)."""
        if area == 'notify':
            return RailAreas(self.num_domains, self.rail_notify_send_offset, self.rail_notify_recv_offset,
                             self.notify_region_bytes)
        if area == 'data':
            return RailAreas(self.num_domains, self.rail_send_offset, self.rail_recv_offset, self.rail_region_bytes)
        raise ValueError(f"area must be 'notify' or 'data', got {area!r}")

    def sizes(self) -> Dict[str, int]:
        """Bytes of every region (for print_memory_usage and the docs)."""
        n1 = self.num_domains - 1
        return {'scaleup_recv': self.scaleup_recv_bytes, 'combine_stage': self.stage_bytes,
                'scratch': self.scratch_bytes, 'rail_flags': RAIL_FLAGS_BYTES,
                'rail_notify': 2 * n1 * self.notify_region_bytes, 'rail_data': 2 * n1 * self.rail_region_bytes}


@dataclass(frozen=True)
class RailAreas:
    """A rail area's send and receive regions (the same offsets on every rank: the buffer is symmetric)."""
    num_domains: int
    send_offset: int
    recv_offset: int
    region_bytes: int

    def send_region(self, self_domain: int, peer_domain: int) -> int:
        """Offset of the region holding what `self_domain` sends `peer_domain`."""
        return self.send_offset + region_index(self_domain, peer_domain) * self.region_bytes

    def recv_region(self, self_domain: int, peer_domain: int) -> int:
        """Offset of the region receiving what `peer_domain` sends `self_domain`."""
        return self.recv_offset + region_index(self_domain, peer_domain) * self.region_bytes


def buffer_size_hint(num_domains: int, num_scaleup_ranks: int, num_max_tokens_per_rank: int, hidden: int,
                     num_topk: int = 0, use_fp8_dispatch: bool = False, allow_multiple_reduction: bool = True) -> int:
    """Bytes of symmetric memory (beyond the workspace) hybrid dispatch/combine need, rounded up to 2 MiB: what
    `get_buffer_size_hint` returns with several scale-up domains. `num_topk=0` sizes for 32 (as DeepEP);
    `use_fp8_dispatch` changes nothing (the bfloat16 messages are the larger), as inside one domain."""
    del use_fp8_dispatch
    lay = HybridLayout(num_domains, num_scaleup_ranks, num_max_tokens_per_rank, hidden, num_topk or NUM_MAX_TOPK,
                       allow_multiple_reduction, data_offset=0)
    return align(lay.end_offset, BUFFER_ALIGNMENT)


def deepep_v2_dispatch_slots(num_domains: int, num_scaleup_ranks: int, num_max_tokens_per_rank: int) -> Dict[str, int]:
    """DeepEP V2's hybrid dispatch token slots (REFERENCE.md 2.3, `calculate_buffer_size`), for comparison:
    scale-up receive `R * (N * M)`, scale-out send `M`, scale-out receive `N * (M + 1280)`."""
    n, r, m = num_domains, num_scaleup_ranks, num_max_tokens_per_rank
    return {'scaleup_recv': r * n * m, 'scaleout_send': m, 'scaleout_recv': n * (m + 1280)}


def dispatch_slots(num_domains: int, num_scaleup_ranks: int, num_max_tokens_per_rank: int) -> Dict[str, int]:
    """This design's dispatch token slots, named as `deepep_v2_dispatch_slots`."""
    n, r, m = num_domains, num_scaleup_ranks, num_max_tokens_per_rank
    return {'scaleup_recv': r * n * m, 'scaleout_send': (n - 1) * m, 'scaleout_recv': (n - 1) * m}
