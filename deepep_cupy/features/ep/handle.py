"""`EPHandle`: what a dispatch leaves for the matching combine and for cached dispatches (DeepEP V2's fields)."""

import functools
import operator
from typing import Any, List, NamedTuple, Optional, Tuple


class WorkspaceOffsets(NamedTuple):
    """int32 word offset of each part of a dispatch's handle workspace (`workspace_layout`), in this order (a part's
    index is its `EPHandle.ptr` number)."""
    send_pos: int           # `[N, R]`, the slot of each token at each destination (dst_buffer_slot_idx)
    send_expert_pos: int    # `[N, K]`
    recv_layout: int        # `[R + 2L + RL + 2]`
    psum_expert: int        # `[L]`
    topk_copy: int          # `[N, K]` int64 at an even offset, or -1 without a copy
    token_of_slot: int      # `[R, N]`, the token in each slot at each destination
    send_count: int         # `[R]`, tokens sent to each destination


class HandleFields(NamedTuple):
    """The fields of an `EPHandle` fixed per bound dispatch (DeepEP V2 names; see `EPHandle`): one record shared by
    every handle the bound dispatch makes (`BoundDispatch.handle_fields`)."""
    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    num_tokens: int
    num_topk: int
    hidden: int
    kind: str
    buffer_id: int
    do_cpu_sync: bool
    num_ranks: int
    num_local_experts: int
    offsets: WorkspaceOffsets


@functools.lru_cache(maxsize=256)
def workspace_layout(num_tokens: int, num_ranks: int, num_topk: int, num_local_experts: int,
                     with_topk_copy: bool) -> Tuple[int, WorkspaceOffsets]:
    """int32 words (even) of a dispatch's handle workspace and the word offset of each part (`WorkspaceOffsets`:
    send_pos [N, R], send_expert_pos [N, K], recv_layout [R + 2L + RL + 2], psum_expert [L], topk copy [N, K] int64
    at an even offset, or -1 without a copy, token_of_slot [R, N] (the token in each slot at each destination),
    send_count [R] (tokens sent to each destination))."""
    n, r, k, n_l = num_tokens, num_ranks, num_topk, num_local_experts
    offsets = [0, n * r, n * r + n * k]
    offsets.append(offsets[-1] + r + 2 * n_l + r * n_l + 2)
    end = offsets[-1] + n_l
    end += end % 2
    offsets.append(end if with_topk_copy else -1)
    if with_topk_copy:
        end += 2 * n * k
    offsets.append(end)
    end += r * n
    offsets.append(end)
    end += r
    end += end % 2
    return max(end, 2), WorkspaceOffsets(*offsets)


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
        token_metadata_at_forward, channel_linked_list: hybrid-mode state of DeepEP; None inside one scale-up domain
            (always, in this build).

    The small per-dispatch arrays (slots, expert positions, the receive layout, the top-k copy) share one
    allocation, the workspace; their tensors are views made on first access (the kernels take addresses), so that
    a dispatch call does not pay for views nobody reads.
    """

    # Per dispatch: the counts, the metadata, the workspace, the top-k. `_c`: the fields fixed per bound dispatch (one
    # `HandleFields` shared by every handle it makes; read through the properties below), so that making a handle
    # stores a dozen slots instead of two dozen. `_views` is set on first use.
    __slots__ = ('_c', 'num_recv_tokens', 'num_expanded_tokens', '_counts', '_meta', '_meta_ptr', '_meta_of',
                 'workspace', 'workspace_ptr', '_topk_idx', '_psum_expert', '_views', '_origin')

    def __init__(self, *, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: List[int], recv_src_metadata: Any, num_tokens: int, num_topk: int,
                 hidden: int, kind: str, buffer_id: int, do_cpu_sync: bool, num_ranks: int, workspace: Any,
                 workspace_ptr: int, offsets: WorkspaceOffsets, topk_idx: Optional[Any] = None,
                 psum_expert: Optional[Any] = None):
        if type(offsets) is not WorkspaceOffsets:
            offsets = WorkspaceOffsets(*offsets)
        self._c = HandleFields(
            do_expand=do_expand, num_experts=num_experts, expert_alignment=expert_alignment,
            num_max_tokens_per_rank=num_max_tokens_per_rank, num_sms=num_sms, num_tokens=num_tokens,
            num_topk=num_topk, hidden=hidden, kind=kind, buffer_id=buffer_id, do_cpu_sync=do_cpu_sync,
            num_ranks=num_ranks, num_local_experts=num_experts // num_ranks, offsets=offsets)
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self._counts = num_recv_tokens_per_expert_list
        self._meta, self._meta_of = recv_src_metadata, None
        self._meta_ptr = recv_src_metadata.data_ptr() if kind == 'torch' else recv_src_metadata.data.ptr
        self.workspace = workspace
        self.workspace_ptr = workspace_ptr
        self._topk_idx = topk_idx          # the user's tensor (no copy), else a view of the workspace on access
        self._psum_expert = psum_expert    # set when a cached dispatch switched modes
        # The bound dispatch that made the handle (None for a handle made here): its fields in `_c` are that
        # dispatch's constants, so later calls with this handle key their cached checks on it (features/ep/bound.py).
        self._origin = None

    @classmethod
    def _new(cls, origin, fields: HandleFields, num_recv_tokens: int, num_expanded_tokens: int, counts: Any,
             meta_ptr: int, meta_of: Tuple, workspace: Any, workspace_ptr: int, topk_idx: Any, psum_expert: Any):
        """A handle from a bound dispatch (`origin`) without keyword binding: `fields` is `origin.handle_fields`
        (`HandleFields`), kept as the handle's `_c`.
        recv_src_metadata is made on first access from `meta_of` = (allocation, (allocator, shape, int32 word
        offset)): the inner tuple is fixed per output layout, so that a call builds a pair; the kernels take
        `meta_ptr`."""
        h = cls.__new__(cls)
        h._c, h._origin = fields, origin
        h.num_recv_tokens, h.num_expanded_tokens, h._counts = num_recv_tokens, num_expanded_tokens, counts
        h._meta, h._meta_ptr, h._meta_of = None, meta_ptr, meta_of
        h.workspace, h.workspace_ptr, h._topk_idx, h._psum_expert = workspace, workspace_ptr, topk_idx, psum_expert
        return h

    # The fields fixed per bound dispatch (DeepEP V2 names; see the class docstring), read-only: `HandleFields`'s,
    # each read by a C getter (no Python frame per read).
    do_expand = property(operator.attrgetter('_c.do_expand'))
    num_experts = property(operator.attrgetter('_c.num_experts'))
    expert_alignment = property(operator.attrgetter('_c.expert_alignment'))
    num_max_tokens_per_rank = property(operator.attrgetter('_c.num_max_tokens_per_rank'))
    num_sms = property(operator.attrgetter('_c.num_sms'))
    num_tokens = property(operator.attrgetter('_c.num_tokens'))
    num_topk = property(operator.attrgetter('_c.num_topk'))
    hidden = property(operator.attrgetter('_c.hidden'))
    kind = property(operator.attrgetter('_c.kind'))
    buffer_id = property(operator.attrgetter('_c.buffer_id'))
    do_cpu_sync = property(operator.attrgetter('_c.do_cpu_sync'))
    num_ranks = property(operator.attrgetter('_c.num_ranks'))
    num_local_experts = property(operator.attrgetter('_c.num_local_experts'))
    offsets = property(operator.attrgetter('_c.offsets'))

    @property
    def num_recv_tokens_per_expert_list(self) -> List[int]:
        """Per local expert, received (token, slot) pairs rounded up to `expert_alignment` (a Python list; empty
        without a CPU sync). A CPU-sync dispatch keeps a numpy copy of the counts and makes the list on first access
        (256 numpy scalars to Python ints cost microseconds on the dispatch's critical path)."""
        counts = self._counts
        if type(counts) is not list:
            counts = self._counts = counts.tolist()
        return counts

    @property
    def recv_src_metadata(self):
        """`[rows, num_topk + 2]` int32 (see the class docstring); a view made on first access."""
        if self._meta is None:
            base, (carver, shape, offset) = self._meta_of
            self._meta = carver.view(base, 'int32', shape, offset)
        return self._meta

    @property
    def metadata_owner(self) -> Any:
        """The allocation holding recv_src_metadata (what an asynchronous combine keeps alive)."""
        return self._meta if self._meta_of is None else self._meta_of[0]

    # ---- addresses for the kernels ---------------------------------------------------------------------------------
    def ptr(self, part: int) -> int:
        """Device address of workspace part `part` (its index in `WorkspaceOffsets`: 0 send_pos, 1 send_expert_pos,
        2 recv_layout, 3 psum_expert, 4 topk copy, 5 token_of_slot, 6 send_count)."""
        return self.workspace_ptr + 4 * self.offsets[part]

    @property
    def topk_idx_ptr(self) -> int:
        if self._topk_idx is not None:
            t = self._topk_idx
            return t.data_ptr() if self._c.kind == 'torch' else t.data.ptr
        return self.workspace_ptr + 4 * self._c.offsets.topk_copy

    # ---- views ----------------------------------------------------------------------------------------------------
    def _views_of(self) -> dict:
        """The views made so far (by key), made on first use."""
        try:
            return self._views
        except AttributeError:
            views = self._views = {}
            return views

    def _workspace_int32(self):
        """The workspace allocation as int32 (a no-sync dispatch's is of recv_x's dtype when recv_x is carved out of
        it: features/ep/bound.py)."""
        views = self._views_of()
        ws = views.get('int32')
        if ws is None:
            ws = self.workspace
            if self.kind == 'torch':
                import torch
                if ws.dtype != torch.int32:
                    ws = ws.view(torch.int32)
            elif ws.dtype.itemsize != 4 or ws.dtype.kind != 'i':
                import cupy
                ws = ws.view(cupy.int32)
            views['int32'] = ws
        return ws

    def _view(self, part: str, shape: Tuple[int, ...], int64: bool = False, start: int = 0):
        """The view `shape` of workspace part `part` (a `WorkspaceOffsets` field) from its word `start`, made once."""
        key = (part, shape, start)
        views = self._views_of()
        v = views.get(key)
        if v is None:
            words = 1
            for s in shape:
                words *= s
            words *= 2 if int64 else 1
            begin = getattr(self._c.offsets, part) + start
            ws = self._workspace_int32()
            if self.kind == 'torch' and not int64 and ws.storage_offset() == 0:
                # One as_strided on the 1-D workspace (a slice and a view cost twice as much).
                steps, step = [], 1
                for n in reversed(shape):
                    steps.append(step)
                    step *= n
                v = ws.as_strided(shape, tuple(reversed(steps)), begin)
                views[key] = v
                return v
            flat = ws[begin:begin + words]
            if self.kind == 'torch':
                import torch
                v = (flat.view(torch.int64) if int64 else flat).view(shape)
            else:
                import cupy
                v = (flat.view(cupy.int64) if int64 else flat).reshape(shape)
            views[key] = v
        return v

    @property
    def topk_idx(self):
        if self._topk_idx is not None:
            return self._topk_idx
        return self._view('topk_copy', (self.num_tokens, self.num_topk), int64=True)

    @property
    def dst_buffer_slot_idx(self):
        return self._view('send_pos', (self.num_tokens, self.num_ranks))

    @property
    def send_expert_pos(self):
        return self._view('send_expert_pos', (self.num_tokens, self.num_topk))

    @property
    def recv_layout(self):
        r, n_l = self.num_ranks, self.num_local_experts
        return self._view('recv_layout', (r + 2 * n_l + r * n_l + 2,))

    @property
    def psum_num_recv_tokens_per_scaleup_rank(self):
        return self._view('recv_layout', (self.num_ranks,))

    @property
    def num_unaligned_recv_tokens_per_expert(self):
        return self._view('recv_layout', (self.num_local_experts,), start=self.num_ranks)

    @property
    def psum_num_recv_tokens_per_expert(self):
        if self._psum_expert is not None:
            return self._psum_expert
        return self._view('psum_expert', (self.num_local_experts,))

    @property
    def token_metadata_at_forward(self):
        return None

    @property
    def channel_linked_list(self):
        return None

    @property
    def num_rows(self) -> int:
        """Rows of the dispatch output (and of a matching combine's input)."""
        return self.num_expanded_tokens if self._c.do_expand else self.num_recv_tokens

    def __repr__(self) -> str:
        return (f'EPHandle(do_expand={self.do_expand}, num_experts={self.num_experts}, '
                f'expert_alignment={self.expert_alignment}, num_max_tokens_per_rank={self.num_max_tokens_per_rank}, '
                f'num_sms={self.num_sms}, num_tokens={self.num_tokens}, num_topk={self.num_topk}, '
                f'num_recv_tokens={self.num_recv_tokens}, num_expanded_tokens={self.num_expanded_tokens}, '
                f'do_cpu_sync={self.do_cpu_sync})')
