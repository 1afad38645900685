"""`EPHandle`: what a dispatch leaves for the matching combine and for cached dispatches (DeepEP V2's fields)."""

from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass
class EPHandle:
    """The layout of one dispatch.

    Public fields (DeepEP V2 names):
        do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the dispatch's settings.
        topk_idx: `[num_tokens, num_topk]`, int64, the dispatch's top-k ids (a copy with `do_handle_copy=True`).
        num_recv_tokens, num_expanded_tokens: rows received (non-expanded / expanded); exact after a CPU sync, the
            worst-case allocation otherwise (the true counts are then only on the GPU).
        num_recv_tokens_per_expert_list: per local expert, received (token, slot) pairs rounded up to
            `expert_alignment` (a Python list; empty without a CPU sync).
        psum_num_recv_tokens_per_scaleup_rank: `[num_ranks]`, int32, inclusive prefix over source ranks of received
            tokens; rows of source s are `[psum[s-1], psum[s])`, `psum[-1]` = received tokens (on the GPU).
        psum_num_recv_tokens_per_expert: `[num_local_experts]`, int32. Non-expanded: inclusive prefix of the aligned
            counts. Expanded: aligned start of expert i plus its count, so expert i's real rows are
            `[align(psum[i-1], A), psum[i])` and the next expert starts at `align(psum[i], A)`.
        num_unaligned_recv_tokens_per_expert: `[num_local_experts]`, int32, received pairs per local expert.
        recv_src_metadata: `[rows, num_topk + 2]`, int32: source global token index (`src_rank * M + index`);
            `src_rank * num_topk + combine slot`; per top-k slot the expanded row (expanded mode) or -1.
        dst_buffer_slot_idx: `[num_tokens, num_ranks]`, int32: slot of each token at each destination rank, or -1.
    """
    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: Any
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: List[int]
    psum_num_recv_tokens_per_scaleup_rank: Any
    psum_num_recv_tokens_per_expert: Any
    num_unaligned_recv_tokens_per_expert: Any
    recv_src_metadata: Any
    dst_buffer_slot_idx: Any
    # Internal
    send_expert_pos: Any = field(repr=False, default=None)
    recv_layout: Any = field(repr=False, default=None)
    num_tokens: int = 0
    num_topk: int = 0
    hidden: int = 0
    kind: str = 'torch'
    buffer_id: int = 0
    do_cpu_sync: bool = True
    topk_weights: Optional[Any] = field(repr=False, default=None)

    @property
    def num_rows(self) -> int:
        """Rows of the dispatch output (and of a matching combine's input)."""
        return self.num_expanded_tokens if self.do_expand else self.num_recv_tokens
