"""What the DeepEP V1 (legacy) adapter asks of the EP engine beyond V2's dispatch: the parts of V1's handle the
notify exchange and the receive epilogue produce (`LegacyLayout`). Pure: no GPU needed (tests/test_legacy_cpu.py)."""

from dataclasses import dataclass
from typing import Any

from ...runtime import checks
from .kernels import NUM_MAX_CHANNELS


@dataclass(slots=True)
class LegacyLayout:
    """What DeepEP V1's handle needs from a non-cached dispatch beyond the `EPHandle` (the V1 adapter passes one;
    V2 calls pass None). The engine fills the outputs.

    In:
        num_channels: V1's channels (`config.num_sms // 2`, at most NUM_MAX_CHANNELS) of the channel matrices.
        reported_num_tokens: the caller's token count, published to every rank (-1: the dispatched count). The
            adapter dispatches 0 tokens and reports its count when it holds more than the buffer's slots, so that
            every rank learns the overflow from the counts exchange (max_num_tokens) before any token moved.
        expert_counts: `[num_experts]` int32, published instead of the per-expert counts of the top-k ids (V1's
            `num_tokens_per_expert` of a dispatch without top-k, whose ids are synthetic).
    Out:
        rank_prefix_matrix: `[R, R]` int32, `M[i][j]` = tokens ranks 0..i send to rank j.
        channel_prefix_matrix: `[R, C]` int32, per destination, the inclusive prefix over channels (channel c =
            tokens `[c * ceil(N / C), ...)`) of this rank's tokens sent there.
        recv_channel_prefix_matrix: `[R, C]` int32, per source, where its channel c starts inside its block of rows.
        recv_src_idx: `[rows]` int32, the token index at the source of every received row.
        max_num_tokens: after a CPU-sync dispatch, the most tokens any rank reported (-1 without a CPU sync).
    """
    num_channels: int = 0
    reported_num_tokens: int = -1
    expert_counts: Any = None
    rank_prefix_matrix: Any = None
    channel_prefix_matrix: Any = None
    recv_channel_prefix_matrix: Any = None
    recv_src_idx: Any = None
    max_num_tokens: int = -1

    def check(self, num_tokens: int) -> None:
        """ValueError / TypeError naming the setting that is out of range."""
        checks.check_int('num_channels', self.num_channels, 0)
        if self.num_channels > NUM_MAX_CHANNELS:
            raise ValueError(f'config.num_sms / 2 = {self.num_channels} channels; at most {NUM_MAX_CHANNELS}')
        checks.check_int('reported_num_tokens', self.reported_num_tokens, -1)
        if self.reported_num_tokens != -1 and self.reported_num_tokens < num_tokens:
            raise ValueError(f'reported_num_tokens={self.reported_num_tokens} is below the {num_tokens} tokens '
                             f'dispatched')

    def check_expert_counts(self, kind: str, num_experts: int, device: int) -> None:
        if self.expert_counts is None:
            return
        ei = checks.info(self.expert_counts, 'num_tokens_per_expert', device)
        checks.check_same_kind(kind, ei, 'num_tokens_per_expert')
        checks.check_dtype(ei, 'num_tokens_per_expert', 'int32')
        checks.check_shape(ei, 'num_tokens_per_expert', (num_experts,))
        checks.check_contiguous(ei, 'num_tokens_per_expert')


def v1_matrices(b, legacy: LegacyLayout, ws, ws_ptr: int, u, ecp: int) -> None:
    """DeepEP V1's matrices of one call of the bound dispatch `b` (bound.py): views of its workspace allocation `ws`
    after the workspace proper, set on `legacy`; their addresses (and the expert counts' `ecp`) patched into the
    notify launch's argument words `u`."""
    R, C, base, carver = b.num_ranks, b.v1_channels, b.ws_words, b.carver
    ws = carver.as_words(ws)
    legacy.rank_prefix_matrix = carver.view(ws, 'int32', (R, R), base)
    legacy.channel_prefix_matrix = carver.view(ws, 'int32', (R, C), base + R * R)
    legacy.recv_channel_prefix_matrix = carver.view(ws, 'int32', (R, C), base + R * R + R * C)
    mp = ws_ptr + 4 * base
    i = b.notify_v1_idx
    u[i[0]], u[i[1]] = ecp, mp
    u[i[2]], u[i[3]] = (mp + 4 * R * R, mp + 4 * (R * R + R * C)) if C else (0, 0)
