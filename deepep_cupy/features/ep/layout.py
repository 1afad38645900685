"""Sizes and offsets of the EP (dispatch/combine) regions in the symmetric buffer: one source of truth for the
Python side, the size hints and the kernels (which receive every offset as an argument).

Symmetric buffer of a rank: `[workspace (2 MiB) | dispatch receive slots | combine receive slots | local scratch]`.

- Dispatch receive slots: `[num_ranks source][num_max_tokens_per_rank slot]` messages. A message is
  `[meta | scale factors | hidden]`: meta = src token index (int32), top-k global expert ids (int32 × K),
  top-k weights (float32 × K), per-slot position of the token among the source's tokens of that expert
  (int32 × K), padded to 16 bytes; scale factors 4 bytes each (float32, or int32 holding 4 packed UE8M0 bytes).
- Combine receive slots: `[num_max_tokens_per_rank token][num_slots]` rows of `[hidden bfloat16 | weights]`, where
  `num_slots = min(num_ranks, K)` when every combine reduces per rank first (one partial row per destination
  rank of a token) and `K` when `allow_multiple_reduction=False` lets an expanded combine send every top-k partial.
- Local scratch: per-block counters of the layout pass.
"""

from dataclasses import dataclass

from ...constants import BUFFER_ALIGNMENT, NUM_MAX_LOCAL_EXPERTS, NUM_MAX_TOPK, SF_GROUP
from ...runtime.sizes import align, ceil_div

# The notify kernel handles this many tokens per block (a warp per 32 tokens).
NOTIFY_TOKENS_PER_BLOCK = 256


def meta_bytes(num_topk: int) -> int:
    return align(4 + 12 * num_topk, 16)


def message_bytes(hidden_bytes: int, num_sf: int, num_topk: int) -> int:
    """Bytes of one dispatch message (16-byte aligned)."""
    return meta_bytes(num_topk) + align(4 * num_sf, 16) + align(hidden_bytes, 16)


def combine_slot_bytes(hidden: int, num_topk: int) -> int:
    """Bytes of one combine slot: `[hidden bfloat16 | num_topk float32 weights]`, each part padded to 16 bytes (the
    kernels' `CombineSlots`, kernels_cu/common/ep.cuh)."""
    return align(2 * hidden, 16) + align(4 * num_topk, 16)


def num_combine_slots(num_ranks: int, num_topk: int, allow_multiple_reduction: bool) -> int:
    return min(num_ranks, num_topk) if allow_multiple_reduction else num_topk


@dataclass(frozen=True)
class EPLayout:
    """Offsets (bytes, from the start of the symmetric buffer) of the EP regions for one buffer configuration."""
    num_ranks: int
    num_max_tokens_per_rank: int
    hidden: int
    num_topk: int
    allow_multiple_reduction: bool
    data_offset: int        # start of the region after the workspace

    @property
    def max_num_sf(self) -> int:
        return ceil_div(self.hidden, SF_GROUP)

    @property
    def max_message_bytes(self) -> int:
        return message_bytes(2 * self.hidden, self.max_num_sf, self.num_topk)

    @property
    def dispatch_recv_offset(self) -> int:
        return self.data_offset

    @property
    def dispatch_recv_bytes(self) -> int:
        return self.num_ranks * self.num_max_tokens_per_rank * self.max_message_bytes

    @property
    def num_combine_slots(self) -> int:
        return num_combine_slots(self.num_ranks, self.num_topk, self.allow_multiple_reduction)

    @property
    def combine_slot_bytes(self) -> int:
        return combine_slot_bytes(self.hidden, self.num_topk)

    @property
    def combine_recv_offset(self) -> int:
        return align(self.dispatch_recv_offset + self.dispatch_recv_bytes, 4096)

    @property
    def combine_recv_bytes(self) -> int:
        return self.num_max_tokens_per_rank * self.num_combine_slots * self.combine_slot_bytes

    @property
    def scratch_offset(self) -> int:
        return align(self.combine_recv_offset + self.combine_recv_bytes, 4096)

    def scratch_bytes(self, num_experts: int) -> int:
        num_blocks = max(1, ceil_div(self.num_max_tokens_per_rank, NOTIFY_TOKENS_PER_BLOCK))
        return num_blocks * (num_experts + self.num_ranks) * 4

    @property
    def end_offset(self) -> int:
        """End of the regions, assuming at most NUM_MAX_LOCAL_EXPERTS experts per rank for the scratch."""
        return self.scratch_offset + align(self.scratch_bytes(self.num_ranks * NUM_MAX_LOCAL_EXPERTS), 4096)


def buffer_size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                     allow_multiple_reduction: bool = True) -> int:
    """Bytes of symmetric memory (beyond the workspace) that dispatch/combine need, rounded up to 2 MiB.
    `num_topk=0` sizes for the largest supported top-k (32), as DeepEP does."""
    layout = EPLayout(num_ranks, num_max_tokens_per_rank, hidden, num_topk or NUM_MAX_TOPK, allow_multiple_reduction,
                      data_offset=0)
    return align(layout.end_offset, BUFFER_ALIGNMENT)
