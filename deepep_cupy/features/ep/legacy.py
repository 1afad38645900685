"""What the DeepEP V1 adapter (deepep_cupy/v1; its __init__ documents the whole hook) asks of the EP engine beyond V2's
dispatch: the parts of V1's handle the notify exchange and the receive epilogue produce (`LegacyLayout`), and the
bound dispatch's V1 parts. It stays in the engine: the engine checks and fills `LegacyLayout`, and the rest runs in
the per-call path. Pure: no GPU needed (tests/test_legacy_cpu.py)."""

from dataclasses import dataclass
from typing import Any, Tuple

from ...runtime import checks
from ...runtime.interop import contiguous_strides
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
        send_head: `[N, R]` int32, the slot of each token at each destination rank, or -1 (the handle's
            dst_buffer_slot_idx).
        max_num_tokens: after a CPU-sync dispatch, the most tokens any rank reported (-1 without a CPU sync).
        handle_views: torch, the engine's own: the new `EPHandle`'s views made before it exists (`workspace_views`:
            its int32 workspace, send_head as its dst_buffer_slot_idx), handed to it.
    """
    num_channels: int = 0
    reported_num_tokens: int = -1
    expert_counts: Any = None
    rank_prefix_matrix: Any = None
    channel_prefix_matrix: Any = None
    recv_channel_prefix_matrix: Any = None
    recv_src_idx: Any = None
    send_head: Any = None
    max_num_tokens: int = -1
    handle_views: Any = None

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


def matrix_exprs(num_ranks: int, num_channels: int, ws_words: int) -> Tuple[Tuple[str, str], ...]:
    """The notify's V1 matrix pointers as (parameter, expression) pairs of the bound dispatch's generated patchers
    (features/ep/patch.py): the matrices are int32 words of the workspace allocation `ws` from word `ws_words` (after
    the workspace proper), rank_prefix_matrix `[R, R]`, then the channel matrices `[R, C]` each (none without
    channels: their pointers stay 0, as bound)."""
    R, C, mp = num_ranks, num_channels, 4 * ws_words
    exprs = (('rank_prefix_matrix', f'ws + {mp}'),)
    if C:
        exprs += (('channel_prefix_matrix', f'ws + {mp + 4 * R * R}'),
                  ('recv_channel_prefix_matrix', f'ws + {mp + 4 * (R * R + R * C)}'))
    return exprs


def view_args(num_ranks: int, num_channels: int, ws_words: int, num_tokens: int, send_pos_word: int) -> tuple:
    """The `as_strided` arguments (shape, strides, int32 word offset) of V1's matrices and send_head in the workspace
    allocation (`matrix_exprs`; send_head is the handle's dst_buffer_slot_idx `[N, R]`, workspace part 0), and the
    handle's view key of dst_buffer_slot_idx (`EPHandle._view`'s, of part send_pos)."""
    R, C, base = num_ranks, num_channels, ws_words
    shapes = ((R, R), (R, C), (R, C), (num_tokens, R))
    offsets = (base, base + R * R, base + R * R + R * C, send_pos_word)
    return tuple((s, contiguous_strides(s), o) for s, o in zip(shapes, offsets)) + (('send_pos', shapes[3], 0),)


def bind(b, p) -> None:
    """DeepEP V1's part of the bound dispatch `b` of the checked plan `p` (bound.py, at the end of its binding):
    `v1_counts` (the expert counts' pointer is patched per call), `v1_views` (`view_args`; None: not a non-cached V1
    call), `v1_int32` (torch's int32, else None), `v1_ws_int32` (the workspace's allocation is int32: no view of it
    per call), `v1_meta_cols` (recv_src_metadata's words per row: recv_src_idx follows it, patch.py `output_layout`)
    and `v1_fixed_views` (torch without a CPU sync: the `as_strided` arguments of V1's five outputs in the workspace's
    allocation, `view_args` with recv_src_idx's place, then send_head's view key; else None)."""
    lg = p.legacy
    b.v1_counts = lg is not None and lg.expert_counts is not None
    b.v1_views = b.v1_int32 = b.v1_fixed_views = None
    b.v1_ws_int32 = b.ws_alloc_dtype == 'int32'
    b.v1_meta_cols = b.num_topk + 2
    if lg is not None and not p.cached:
        b.v1_views = view_args(b.num_ranks, lg.num_channels, b.ws_words, p.num_tokens, b.offsets.send_pos)
        if b.kind == 'torch':
            import torch
            b.v1_int32 = torch.int32
            f = b.fixed
            if f is not None:
                rpm, cpm, rcpm, head, head_key = b.v1_views
                b.v1_fixed_views = (rpm, cpm, rcpm, ((f.num_recv,), (1,), f.byte_at[5] >> 2), head, head_key)


def v1_outputs(b, legacy: LegacyLayout, handle, group, src_byte: int) -> None:
    """DeepEP V1's parts of one call of the bound dispatch `b` (bound.py; after its launches: the kernels took their
    addresses from the patchers), set on `legacy`: the matrices and send_head, views of the new `handle`'s workspace
    allocation (`view_args`), and recv_src_idx, of the outputs' allocation `group` from byte `src_byte`. Torch: one
    int32 view of each allocation, shared with the handle's own views (dst_buffer_slot_idx is send_head). In two parts
    (`workspace_views`, `receive_views`): a CPU-sync lean call makes the first while the GPU counts."""
    receive_views(b, legacy, handle, group, src_byte, workspace_views(b, legacy, handle.workspace))


def workspace_views(b, legacy: LegacyLayout, ws):
    """`v1_outputs`' views of the workspace allocation `ws` (they exist before the counts): the matrices and, torch,
    send_head and the new handle's views (`LegacyLayout.handle_views`). Returns torch's int32 view of `ws` (None:
    CuPy)."""
    rpm, cpm, rcpm, head, head_key = b.v1_views
    if b._torch_dtypes is not None:
        w = ws if b.v1_ws_int32 else ws.view(b.v1_int32)
        legacy.rank_prefix_matrix = w.as_strided(*rpm)
        legacy.channel_prefix_matrix = w.as_strided(*cpm)
        legacy.recv_channel_prefix_matrix = w.as_strided(*rcpm)
        legacy.send_head = send_head = w.as_strided(*head)
        legacy.handle_views = {'int32': w, head_key: send_head}
        return w
    carver = b.carver
    legacy.rank_prefix_matrix = carver.view(ws, 'int32', rpm[0], rpm[2])
    legacy.channel_prefix_matrix = carver.view(ws, 'int32', cpm[0], cpm[2])
    legacy.recv_channel_prefix_matrix = carver.view(ws, 'int32', rcpm[0], rcpm[2])
    return None


def receive_views(b, legacy: LegacyLayout, handle, group, src_byte: int, w) -> None:
    """The rest of `v1_outputs` once the new `handle` exists: recv_src_idx (a view of `group` from byte `src_byte`);
    torch: the handle's views shared (`w`: `workspace_views`' int32 view of its workspace); CuPy: send_head, the
    handle's dst_buffer_slot_idx."""
    if b._torch_dtypes is not None:
        i32 = b.v1_int32
        g = w if group is handle.workspace else group if group.dtype is i32 else group.view(i32)
        legacy.recv_src_idx = g.as_strided((handle.num_recv_tokens,), (1,), src_byte >> 2)
        handle._views = legacy.handle_views
        return
    legacy.send_head = handle.dst_buffer_slot_idx
    legacy.recv_src_idx = b.carver.view(group, 'int32', (handle.num_recv_tokens,), src_byte >> 2)
