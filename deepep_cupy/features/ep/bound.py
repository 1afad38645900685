"""A checked dispatch / combine bound to its launches: what repeated calls with one signature reuse.

`EP.dispatch` / `EP.combine` key every call by its signature: each input array's kind, shape, strides, dtype and
device (`interop.meta`), the handle's origin (the bound dispatch that made it), the scalar arguments with their types,
and the flags. plan.py's argument checks are functions of that signature alone, except three that stay per call here:
x's address alignment, the top-k id range of a CPU-sync dispatch (read back from the GPU before any EP kernel) and
previous_event's type. A miss runs plan.py's checks and builds a `BoundDispatch` / `BoundCombine` (the kernels'
argument blocks packed once by parameter name, the output layout, the handle's constants); a hit patches this call's
pointers into the blocks and launches.

Why the blocks are patched positionally: a named launch binds and packs every argument on each call (~25 per kernel,
three kernels per dispatch); a dispatch changes about ten pointers. The indices are resolved by name when binding.

Outputs: a call's small arrays (recv_src_metadata, recv_topk_idx, recv_topk_weights; without a CPU sync also the
handle's workspace, first) are views of one allocation (`interop.Carver`; int32 words). recv_x and recv_sf go there
too when together they are at most `CARVED_RECV_MAX_BYTES` (16 MiB: decode sizes, e.g. BF16 at 8 ranks x 128 tokens x
hidden 7168), each at a 256-byte boundary of the allocation (16-byte rows; recv_sf's TMA-aligned column-major storage
keeps its padded columns), so that a no-sync or cached dispatch makes ONE allocation (each costs microseconds of host
time on the GPU host); the allocation is then of recv_x's dtype (recv_x: one `as_strided`; the others: typed views).
Such a view keeps the whole allocation alive, and so does the handle (its metadata and workspace live there): that
memory returns once both are dropped, which at these sizes is cheap. Larger recv_x / recv_sf are allocations of their
own, so that the large output's memory goes back as soon as the caller drops it, whatever happens to the handle.

Order: without a CPU sync every allocation, view and patch comes before the first launch and the launches follow back
to back (no host gap on the GPU); with one the host waits for the counts between the send and the receive launch.
The common cached, no-sync and CPU-sync calls run lean.py's paths (`BoundDispatch.run`), the others `__call__`.

DeepEP V1 calls (a `LegacyLayout`) are bound too (the key holds channels, reported count, the expert counts'
signature). V1's matrices are carved from the handle's workspace allocation after the workspace proper (their
pointers patched with the workspace's), recv_src_idx from the outputs' allocation after the metadata, viewed after the
launches (legacy.py `v1_outputs`); the expert counts' pointer is patched per call; lean.py has V1's lean paths too.
"""

from typing import Any, Dict, List, Optional, Tuple

from ...runtime import interop
from ...runtime.sizes import align, ceil_div
from . import fused as ep_fused
from . import lean as ep_lean
from . import legacy as ep_legacy
from . import plan as ep_plan
from .handle import EPHandle, HandleFields, workspace_layout
from .kernels import (
    COMBINE_CHUNK_ROWS,
    COMBINE_THREADS,
    DISPATCH_THREADS,
    NOTIFY_THREADS,
    PHASE_RECV,
    PHASE_SEND,
    dispatch_chunk_rows,
)
from .patch import GuardIndex as _GuardIndex
from .patch import NotifyV1Index, ReceiveIndex, TorchDtypes
from .patch import Outputs as _Outputs
from .patch import address_patcher as _address_patcher
from .patch import allocate_x as _allocate_x
from .patch import check_guard as _check_guard
from .patch import cupy_views as _cupy_views
from .patch import from_handle as _from_handle
from .patch import output_layout as _output_layout
from .patch import patch_guard as _patch_guard
from .patch import patcher as _patcher
from .patch import wait_counts as _wait_counts

_MAX_SIZES = 64     # output layouts remembered per bound dispatch (CPU-sync counts vary per call)
# recv_x and recv_sf together up to this size are carved out of the small outputs' allocation (see the module
# docstring): 16 MiB holds a decode step's BF16 recv_x at 8 ranks x 128 tokens x hidden 7168 (14 MiB).
CARVED_RECV_MAX_BYTES = 16 << 20
# Pointer arguments patched per call: inputs and workspace parts (known before the send), outputs (after the counts).
_INPUTS, _OUTPUTS = ep_lean.INPUTS, ep_lean.OUTPUTS


class BoundDispatch:
    """A dispatch signature checked by `plan_dispatch`, with its launches bound (see the module docstring).

    Args:
        ep: the EP feature; p: the checked plan of the call that missed; allocate_on_comm_stream,
        async_with_compute_stream: the call's flags. The EP feature is passed to each call, not kept (handles keep
        their bound dispatch: no cycle through the feature); neither are the call's arrays (`without_arrays`).
    """

    def __init__(self, ep, p: ep_plan.DispatchPlan, allocate_on_comm_stream: bool, async_with_compute_stream: bool):
        s = ep.settings
        self.kind, self.fp8, self.cached, self.cpu_sync = p.kind, p.fp8, p.cached, p.do_cpu_sync
        self.do_expand = p.do_expand
        # DeepEP V1 (`p.legacy`): channels of its matrices, else None; its matrices' int32 words after the workspace
        # (even, so that the outputs carved after them keep 8-byte alignment).
        R, lg = s.num_ranks, p.legacy
        self.v1_channels = None if lg is None else lg.num_channels
        self.v1_words = 0 if lg is None else align(R * R + 2 * R * lg.num_channels, 2)
        self.claim = p.new_layout          # claim the data region on the first call that passes every check
        self.key = None
        self.carver = ep.carver(p.kind)
        self.stream = interop.stream_getter(p.kind, p.xi.device)
        self.alloc_on_comm, self.async_ = bool(allocate_on_comm_stream), bool(async_with_compute_stream)
        self.local = not (self.alloc_on_comm or self.async_)     # may run on the caller's stream (streams.py)
        K, L = p.num_topk, p.num_local_experts
        self.num_experts, self.num_local_experts, self.num_topk = p.num_experts, L, K
        self.num_topk_values = p.num_tokens * K
        self.num_ranks = R
        self.num_device_sms = s.num_device_sms
        self.x_dtype = 'float8_e4m3fn' if p.fp8 else 'bfloat16'
        self.sf_dtype = p.sfi.dtype if p.sfi is not None else None
        self._torch_dtypes = None   # torch: the views' dtypes resolved once
        if self.kind == 'torch':
            import torch
            self._torch_dtypes = TorchDtypes(torch.int64, torch.float32, getattr(torch, self.sf_dtype or 'int32'))
        self._sizes: Dict[Tuple[int, int], _Outputs] = {}
        inputs, notify_exprs = self._bind_launches(ep, p)
        self._bind_outputs(ep, p)
        ep_lean.bind_call_patch(self, p, inputs, notify_exprs)
        self._recv_sized = None     # the `_Outputs` whose sizes and grid the receive launch's block holds
        self._recv_free = 0         # and the SMs the grid left free for hybrid P2's side stream
        if self.fixed is not None:  # (sized now: lean.run_no_sync relies on it, `__call__` re-sizes after a guard)
            self._size_recv(self.fixed, 0)
        ep_legacy.bind(self, p)     # DeepEP V1's per-call needs: `v1_counts`, `v1_views`, `v1_int32`
        # `run`: what `EP.dispatch` calls, the lean path chosen for this binding or `__call__` (lean.py)
        ep_lean.bind(self, p)

    def _bind_launches(self, ep, p) -> Tuple[dict, tuple]:
        """The launch structure (one launch, a send and a receive launch, or the fused one), the bound launches, their
        patchers and the words patched by index (the readiness guard's, the receive's sizes); returns the inputs' and
        the notify's (parameter, expression) pairs (`_bind_patchers`)."""
        s, R = ep.settings, self.num_ranks
        kernels = ep.kernels(self.num_topk)
        sym, xi = ep._sym, p.xi
        tail = dict(peer_bases=sym.peer_bases_ptr, rank=sym.local_idx, error_record=ep._host_ptr,
                    timeout_ns=ep._buf.timeout_ns)
        x_row_bytes = xi.strides[0] * xi.itemsize
        self.one_launch = R == 1 or (ep.dispatch_overlap and not p.do_cpu_sync)
        self.num_send_blocks = 0 if R == 1 else min(p.num_sms, s.num_device_sms - 1)
        # DEEPEP_CUPY_EP_FUSED_NOTIFY: the notify and the dispatch in one launch (features/ep/fused.py), bound below
        # with the dispatch's arguments; `notify` is then that launch too (its notify arguments are patched alike).
        self.fused_refusal = ep_fused.fused_refusal(
            p.num_tokens, p.num_experts, R, self.num_send_blocks, s.num_device_sms, p.cached, p.do_cpu_sync,
            self.one_launch, ep.fused_notify, p.do_expand)
        self.fused = self.fused_refusal is None
        self.fused_cooperative = ep.fused_cooperative
        self.num_notify_blocks = ep_fused.fused_notify_blocks(p.num_tokens) if self.fused else 0
        notify_args = self._bind_notify(ep, p, kernels, tail)
        self._bind_dispatch(p, kernels, tail, x_row_bytes, notify_args)
        inputs, notify_exprs = self._bind_patchers(p)
        r = self.recv
        guarded = not self.fused
        guard_idx = (lambda b: _GuardIndex(b.index('ready'), b.index('ready_mod')) if guarded and b is not None
                     else None)
        self.send_guard_idx, self.recv_guard_idx = guard_idx(self.send), guard_idx(r)
        # Whether the send / receive block holds a guard (bound without: patched while a guard is on, or to clear one)
        self._send_guarded = self._recv_guarded = False
        self.recv_idx = ReceiveIndex(r.index('num_out_rows'), r.index('num_meta_rows'), r.index('recv_sf_stride_row'),
                                     r.index('recv_sf_stride_col'))
        self.recv_extra = 0 if self.send is not None else self.num_send_blocks
        return inputs, notify_exprs

    def _bind_outputs(self, ep, p) -> None:
        """The fields every handle of this binding shares, where the outputs start in their allocation, the fixed
        output layout (no CPU sync, not cached: the worst case) and the workspace's allocation."""
        s, R, K, L = ep.settings, self.num_ranks, self.num_topk, self.num_local_experts
        do_cpu_sync = p.handle.do_cpu_sync if p.cached else p.do_cpu_sync
        self.handle_fields = HandleFields(
            do_expand=p.do_expand, num_experts=p.num_experts, expert_alignment=p.expert_alignment,
            num_max_tokens_per_rank=p.num_max_tokens_per_rank, num_sms=p.num_sms, num_tokens=p.num_tokens,
            num_topk=K, hidden=p.hidden, kind=p.kind, buffer_id=s.owner_id, do_cpu_sync=do_cpu_sync, num_ranks=R,
            num_local_experts=L, offsets=self.offsets)
        self.p = p.without_arrays()
        # Where the outputs start in their allocation: after the workspace (and V1's matrices) without a CPU sync, at
        # word 0 of an allocation of their own otherwise.
        self._out_base = 0 if (p.cached or p.do_cpu_sync) else self.ws_words + self.v1_words
        self.fixed = None if (p.cached or p.do_cpu_sync) else self.outputs(*ep_plan.dispatch_counts(p)[:2])
        self.worst_expanded = ep_plan.worst_expanded_rows(R, p.num_max_tokens_per_rank, K, L, p.expert_alignment)
        # int32 words of a non-cached call's workspace allocation (with the worst-case outputs without a CPU sync)
        self.ws_alloc_words = self.ws_words + self.v1_words + (self.fixed.words if self.fixed is not None else 0)
        # (without a CPU sync and recv_x carved: of recv_x's dtype, `Outputs.alloc_dtype`)
        self.ws_alloc_dtype = 'int32' if self.fixed is None else self.fixed.alloc_dtype
        self.ws_alloc_shape = (max(2, self.ws_alloc_words) * (4 // interop.itemsize(self.ws_alloc_dtype)),)

    def _bind_notify(self, ep, p, kernels, tail) -> Optional[dict]:
        """The workspace's layout (a cached dispatch: its handle's) and, without a handle, the notify launch; returns
        the notify's bound arguments (None for a cached dispatch, which has no notify)."""
        if p.cached:
            self.ws_words, self.offsets = 0, p.handle.offsets
            return None
        R, K, L, lg, sym, lay = self.num_ranks, self.num_topk, self.num_local_experts, p.legacy, ep._sym, p.layout
        self.ws_words, self.offsets = workspace_layout(p.num_tokens, R, K, L, p.do_handle_copy)
        reported = p.num_tokens if lg is None or lg.reported_num_tokens < 0 else lg.reported_num_tokens
        notify_args = dict(
            topk_idx=0, num_tokens=p.num_tokens, num_topk=K, num_experts=p.num_experts,
            num_max_tokens_per_rank=p.num_max_tokens_per_rank, expert_alignment=p.expert_alignment,
            scratch=sym.base + lay.scratch_offset, send_pos=0, send_expert_pos=0, recv_layout=0,
            psum_recv_per_expert=0, do_expand=int(p.do_expand), cumulative_stats=0,
            host_counts=ep.host_counts_ptr if p.do_cpu_sync else 0, host_seq=0, topk_copy=0, token_of_slot=0,
            send_count=0, reported_num_tokens=reported, expert_counts=0,
            num_channels=self.v1_channels or 0, channel_prefix_matrix=0, recv_channel_prefix_matrix=0,
            rank_prefix_matrix=0, **tail)
        self.notify = None
        if not self.fused:
            # A block per NOTIFY_THREADS tokens, at most the blocks that can be co-resident (past them a block takes
            # several tiles of tokens: ep_notify.cu); cooperative for several blocks only (one block has no grid
            # barrier to wait in).
            grid = ep_plan.notify_grid(p.num_tokens,
                                       kernels.notify.co_resident_blocks(NOTIFY_THREADS, p.notify_smem_bytes))
            self.notify = kernels.notify.bind(grid, NOTIFY_THREADS, shared_mem=p.notify_smem_bytes,
                                              cooperative=grid > 1, **notify_args)
        return notify_args

    def _bind_patchers(self, p) -> Tuple[dict, tuple]:
        """The generated patchers of the per-call pointers of the send, the receive and the notify launches; returns
        the inputs' and the notify's (parameter, expression) pairs (`lean.bind_call_patch` joins them)."""
        # Per call, the pointers of `_INPUTS`, `_OUTPUTS` and the notify's are patched in before the launches.
        o = self.offsets
        ws_at, inputs = ep_lean.part_exprs(o), ep_lean.input_exprs(o)
        self.send_patch = (_address_patcher(self.send, tuple(inputs.items()), 'input')
                           if self.send is not None else None)
        self.recv_in_patch = _address_patcher(self.recv, tuple(inputs.items()), 'input')
        self.recv_out_patch = _patcher(self.recv, _OUTPUTS)
        notify_exprs = (
            ('topk_idx', 'tp'), ('send_pos', ws_at.send_pos), ('send_expert_pos', ws_at.send_expert_pos),
            ('recv_layout', ws_at.recv_layout), ('psum_recv_per_expert', ws_at.psum_expert), ('cumulative_stats', 'cp'),
            ('topk_copy', ws_at.topk_copy if o.topk_copy >= 0 else '0'), ('token_of_slot', ws_at.token_of_slot),
            ('send_count', ws_at.send_count))
        if p.legacy is not None:    # V1's matrices: the workspace's allocation plus constants (`legacy.matrix_exprs`)
            notify_exprs += ep_legacy.matrix_exprs(self.num_ranks, self.v1_channels, self.ws_words)
        self.notify_patch = None if p.cached else _address_patcher(self.notify, notify_exprs, 'notify')
        self.user_topk = not p.do_handle_copy      # the handle keeps the call's topk_idx itself
        self.topk_copy_bytes = 4 * o.topk_copy     # where the workspace keeps its topk_idx copy (if it has one)
        return inputs, notify_exprs

    def _bind_dispatch(self, p, kernels, tail, x_row_bytes, notify_args) -> None:
        """The dispatch launches (the fused one is `notify` too); the notify's patch indices."""
        R, K, lay, sfi = self.num_ranks, self.num_topk, p.layout, p.sfi
        # The dispatch launches (ep_dispatch.cu): with `one_launch` senders and receivers share one launch (no CPU
        # sync or cached, and at one rank always: there is nothing to send); else a send-only launch before the host
        # waits for the counts and a receive-only one after.
        d = dict(x=0, x_row_bytes=x_row_bytes, hidden_bytes=p.hidden_bytes, num_topk=K,
                 num_max_tokens_per_rank=p.num_max_tokens_per_rank, recv_offset=lay.dispatch_recv_offset, **tail)
        sf_strides = dict(sf_stride_token=sfi.strides[0] if sfi else 0, sf_stride_col=sfi.strides[1] if sfi else 0)
        outs = dict(do_expand=int(p.do_expand), do_zero_padding=int(p.do_zero_padding), num_out_rows=0,
                    num_meta_rows=0, recv_x=0, recv_sf=0, recv_sf_stride_row=0, recv_sf_stride_col=0,
                    recv_topk_idx=0, recv_topk_weights=0, recv_src_metadata=0, recv_src_idx=0, recv_layout=0,
                    num_sf=p.num_sf, num_experts=p.num_experts)
        chunk_rows = dispatch_chunk_rows(p.num_max_tokens_per_rank, R)
        common = dict(sf=0, topk_idx=0, topk_weights=0, send_expert_pos=0, token_of_slot=0, send_count=0,
                      num_tokens=p.num_tokens, chunk_rows=chunk_rows,
                      chunk_stride=ceil_div(p.num_max_tokens_per_rank, chunk_rows), **sf_strides, **outs, **d)
        if self.fused:
            self.send = None
            self.recv = self.notify = kernels.fused_dispatch().bind(
                1, DISPATCH_THREADS, shared_mem=ep_fused.fused_smem_bytes(p.num_experts, R),
                cooperative=self.fused_cooperative, num_send_blocks=self.num_send_blocks,
                num_notify_blocks=self.num_notify_blocks,
                **{**notify_args, **common})
        elif self.one_launch:
            self.send = None
            self.recv = kernels.dispatch.bind(1, DISPATCH_THREADS, phases=PHASE_SEND | PHASE_RECV,
                                              num_send_blocks=self.num_send_blocks, ready=0, ready_mod=0,
                                              **common)
        else:
            self.send = kernels.dispatch.bind(self.num_send_blocks, DISPATCH_THREADS, phases=PHASE_SEND,
                                              num_send_blocks=self.num_send_blocks, ready=0, ready_mod=0,
                                              **common)
            self.recv = kernels.dispatch.bind(1, DISPATCH_THREADS, phases=PHASE_RECV, num_send_blocks=0,
                                              ready=0, ready_mod=0, **common)
        if not p.cached:
            self.notify_v1_idx = NotifyV1Index._make(self.notify.index(n) for n in NotifyV1Index._fields)
            self.notify_seq = self.notify.index('host_seq')

    # ---- output layout -----------------------------------------------------------------------------------------------
    def outputs(self, num_recv: int, num_expanded: int) -> _Outputs:
        """The output sizes and the carving of the small outputs for these receive counts (memoised)."""
        out = self._sizes.get((num_recv, num_expanded))
        if out is not None:
            return out
        o = ep_plan.dispatch_outputs(self.p, num_recv, num_expanded, [], self.num_device_sms)
        out = _output_layout(self.p, o, self.v1_channels is not None, self._out_base, self.x_dtype,
                             CARVED_RECV_MAX_BYTES)
        if len(self._sizes) >= _MAX_SIZES:
            self._sizes.clear()
        self._sizes[(num_recv, num_expanded)] = out
        return out

    # ---- one call ----------------------------------------------------------------------------------------------------
    def __call__(self, ep, x_in, topk_idx, topk_weights, stats, handle: Optional[EPHandle], event, xp: int, sp: int,
                 tp: int, wp: int, cp: int, legacy: Any = None, ecp: int = 0):
        """Run the dispatch for this call's arrays (`x_in` as given; the pointers come from `interop.meta`) on the EP
        feature `ep`. `legacy`: the call's `LegacyLayout` (V1; its outputs are filled), `ecp` its expert counts'
        address (0: none).

        Without a CPU sync (worst-case sizes, or a cached dispatch's known ones) every allocation, view and patch of
        the call's launches comes first and the launches follow back to back, so that the GPU sees no host gap
        between the notify and the dispatch (tests/test_ep_host_order_cpu.py pins it). With a CPU sync the notify
        and the send go first, the host waits for the counts, allocates exact outputs and launches the receive."""
        if xp & 15:
            raise ValueError('x rows must start at 16-byte aligned addresses')
        # Hybrid P2's readiness guard (`EP.ready_guard`: (counter address, rows modulo, SMs left free) or None): checked
        # before any launch, patched into the launches on every call (they are shared by calls with and without it).
        guard = ep.ready_guard
        if guard is not None:
            _check_guard(self, guard)
        carver = self.carver
        current = self.stream()
        cpu_sync, cached = self.cpu_sync, self.cached
        if cpu_sync:
            # The range check needs the GPU: start it first, do the host work that needs no check meanwhile.
            wait_range = ep._start_range(topk_idx, tp, self.num_topk_values, self.num_topk, current)
        comm = ep._order.enter(current, event, self.local)
        alloc_stream = comm if self.alloc_on_comm else None
        if cached:
            ws, ws_ptr, user_topk, tp, psum_expert, out, counts = _from_handle(self, handle, comm)
        else:
            user_topk, psum_expert = topk_idx if self.user_topk else None, None
            ws = carver.empty(self.ws_alloc_shape, self.ws_alloc_dtype, alloc_stream)
            ws_ptr = ws.data_ptr() if self._torch_dtypes is not None else carver.ptr(ws)
        if cpu_sync:
            lo, hi = wait_range()
            if lo < -1 or hi >= self.num_experts:
                raise ValueError(f'topk_idx values must be in [-1, {self.num_experts}), got min {lo}, max {hi}')
        if self.claim:
            ep._claim(self)
        one_patch = self.call_patch         # (no sync, recv_x carved: every block's pointers at once, below)
        if not cached:
            n = self.notify
            if one_patch is None:
                self.notify_patch(n.u64, xp, sp, tp, wp, cp, ws_ptr)       # (V1's matrices too)
            if self.v1_counts:      # (V1's expert counts: the notify publishes them)
                n.u64[self.notify_v1_idx.expert_counts] = ecp
        snd = self.send
        if snd is not None:
            if one_patch is None:
                self.send_patch(snd.u64, xp, sp, tp, wp, cp, ws_ptr)
            if self.send_guard_idx is not None and (guard is not None or self._send_guarded):
                _patch_guard(snd, self.send_guard_idx, guard)
                self._send_guarded = guard is not None
        if cpu_sync:
            out, counts = _wait_counts(self, ep, comm, legacy)
        if cached or cpu_sync:      # exact sizes: the outputs' allocation of their own
            group = carver.empty(out.alloc_shape, out.alloc_dtype, alloc_stream)
            g0 = group.data_ptr() if self._torch_dtypes is not None else carver.ptr(group)
        else:                       # no CPU sync, not cached: worst-case sizes, carved out of the workspace
            out, group, g0, counts = self.fixed, ws, ws_ptr, []
        recv_x, recv_sf, recv_topk_idx, recv_topk_weights = self._receive_outputs(out, group, g0, alloc_stream, guard,
                                                                                  xp, sp, tp, wp, cp, ws_ptr)
        if not cpu_sync:              # the launches back to back: nothing but the launch calls between them
            if not cached and not self.fused:
                n(comm)
            if snd is not None:
                snd(comm)
        self.recv(comm)
        counts = counts.copy() if cpu_sync else counts      # (a host-mapped view: `EP._wait_host_counts`)
        byte_at = out.byte_at
        new_handle = EPHandle._new(self, self.handle_fields, out.num_recv, out.num_expanded, counts, g0 + byte_at.meta,
                                   (group, (carver, out.meta_shape, out.at.meta)), ws, ws_ptr, user_topk, psum_expert)
        if legacy is not None:      # (after the launches: views only, the kernels have their addresses)
            ep_legacy.v1_outputs(self, legacy, new_handle, group, byte_at.src_idx)
        if self.async_:
            event_out = ep_lean.async_event(self, ep, current, x_in, topk_idx, topk_weights, stats, recv_x, recv_sf,
                                          recv_topk_idx, recv_topk_weights, ws, group, user_topk,
                                          None if legacy is None else legacy.expert_counts)
        else:
            event_out = ep._order.leave(self.kind, current, comm, False)
        return ((recv_x, recv_sf) if self.fp8 else recv_x), recv_topk_idx, recv_topk_weights, new_handle, event_out

    def _receive_outputs(self, out: _Outputs, group, g0: int, alloc_stream, guard, xp: int, sp: int, tp: int, wp: int,
                         cp: int, ws_ptr: int):
        """The outputs of the layout `out` and the receive launch's words for them: views of `group` (address `g0`;
        the outputs from its word `_out_base`), recv_x / recv_sf too where `out` carves them, else allocations of
        their own; the receive's pointers (every launch's with `call_patch`), its readiness guard, its sizes and grid.
        Returns `(recv_x, recv_sf, recv_topk_idx, recv_topk_weights)`. recv_src_metadata stays a (pointer, place)
        until someone reads it: the handle makes the view then."""
        td = self._torch_dtypes
        if td is not None:      # torch: Carver.view inline, the views' arguments fixed per layout (`Outputs.views`)
            x_v, sf_v, topk_v, weights_v = out.views
            recv_topk_idx = None if topk_v is None else group.view(td.int64).as_strided(*topk_v)
            recv_topk_weights = None if weights_v is None else group.view(td.float32).as_strided(*weights_v)
            if x_v is not None:       # (the allocation is of recv_x's dtype)
                recv_x = group.as_strided(*x_v)
            recv_sf = None if sf_v is None else group.view(td.sf).as_strided(*sf_v)
        else:
            recv_topk_idx, recv_topk_weights, recv_x, recv_sf = _cupy_views(self.carver, group, out, self.x_dtype,
                                                                             self.sf_dtype)
        xb, sb, tb, wb, mb, ib = out.byte_at
        if xb < 0:      # large: allocations of their own (their memory goes back when the caller drops them)
            (recv_x, recv_sf), (xo, sfo) = _allocate_x(self.carver, out, self.x_dtype, self.sf_dtype,
                                                       self.p.use_tma_aligned_col_major_sf, alloc_stream)
        r = self.recv
        one_patch = self.call_patch
        if one_patch is not None:
            one_patch(xp, sp, tp, wp, cp, ws_ptr)
        else:
            if xb >= 0:
                xo, sfo = g0 + xb, g0 + sb if sb >= 0 else 0
            u = r.u64
            self.recv_in_patch(u, xp, sp, tp, wp, cp, ws_ptr)
            self.recv_out_patch(u, (xo, sfo, g0 + tb if tb >= 0 else 0, g0 + wb if wb >= 0 else 0, g0 + mb,
                                    g0 + ib if ib >= 0 else 0))
        if guard is None and not self._lean_blocked:    # (no guard on, none left in a block, the region claimed)
            free = 0
        else:
            if self.recv_guard_idx is not None and (guard is not None or self._recv_guarded):
                _patch_guard(r, self.recv_guard_idx, guard)
                self._recv_guarded = guard is not None
            self._lean_blocked = self.claim or self._send_guarded or self._recv_guarded
            free = guard[2] if guard is not None else 0     # SMs hybrid P2 leaves to its side stream (checked above)
        if out is not self._recv_sized or free != self._recv_free:     # these sizes' words and grid stay in the block
            self._size_recv(out, free)
        return recv_x, recv_sf, recv_topk_idx, recv_topk_weights

    def _size_recv(self, out: _Outputs, free: int) -> None:
        """The receive launch's words and grid for the sizes `out` (and `free` SMs left to hybrid P2's side stream)."""
        r, idx = self.recv, self.recv_idx
        r.i32[idx.num_out_rows], r.i32[idx.num_meta_rows] = out.num_out_rows, out.num_recv
        r.i64[idx.recv_sf_stride_row], r.i64[idx.recv_sf_stride_col] = out.sf_strides
        # One launch: the senders first, then the receivers (all co-resident, at most one block per SM).
        if self.fused:
            r.grid = (ep_fused.fused_grid(self.num_send_blocks, out.grid, self.num_notify_blocks,
                                          self.num_device_sms), 1, 1)
        else:
            r.grid = (self.recv_extra + min(out.grid, self.num_device_sms - self.recv_extra - free), 1, 1)
        self._recv_sized, self._recv_free = out, free


class BoundCombine:
    """A combine signature checked by `plan_combine`, with its launch bound."""

    def __init__(self, ep, p: ep_plan.CombinePlan, allocate_on_comm_stream: bool, async_with_compute_stream: bool):
        h = p.handle
        self.kind = p.kind
        self.carver = ep.carver(p.kind)
        self.stream = interop.stream_getter(p.kind, p.xi.device)
        self.alloc_on_comm, self.async_ = bool(allocate_on_comm_stream), bool(async_with_compute_stream)
        self.local = not (self.alloc_on_comm or self.async_)     # may run on the caller's stream (streams.py)
        self.num_tokens, self.hidden, self.num_topk = h.num_tokens, p.hidden, h.num_topk
        self.num_x_rows = p.xi.shape[0]
        self.with_weights = p.topk_weights is not None
        self.num_biases = len(p.biases)
        sym = ep._sym
        self.launch = ep.kernels(h.num_topk).combine[p.local_reduce].bind(
            p.num_send_blocks + p.num_reduce_blocks, COMBINE_THREADS, x=0, hidden=p.hidden, topk_weights=0,
            do_expand=int(h.do_expand), recv_src_metadata=0, recv_layout=0, send_pos=0, topk_idx=0,
            num_tokens=h.num_tokens, num_topk=h.num_topk, num_experts=h.num_experts,
            num_max_tokens_per_rank=h.num_max_tokens_per_rank, num_slots=p.num_slots, bias0=0, bias1=0,
            combined_x=0, combined_topk_weights=0, with_weights=int(self.with_weights),
            weights_over_ranks=int(p.weights_over_ranks), num_send_blocks=p.num_send_blocks,
            chunk_rows=COMBINE_CHUNK_ROWS, chunk_stride=p.chunk_stride,
            peer_bases=sym.peer_bases_ptr, rank=sym.local_idx, combine_offset=ep.layout.combine_recv_offset,
            error_record=ep._host_ptr, timeout_ns=ep._buf.timeout_ns)
        # The workspace parts' byte offsets (the handle's origin, and so its offsets, are part of the call's key)
        o = h.offsets
        self.ws_at = (4 * o.recv_layout, 4 * o.send_pos, 4 * o.topk_copy)
        self.idx = tuple(self.launch.index(n) for n in (
            'x', 'topk_weights', 'recv_src_metadata', 'recv_layout', 'send_pos', 'topk_idx', 'bias0', 'bias1',
            'combined_x', 'combined_topk_weights'))

    def __call__(self, ep, x, handle: EPHandle, topk_weights, biases: List[Any], event, xp: int, wp: int,
                 bias_ptrs: List[int]):
        carver, h = self.carver, handle
        if xp & 15:
            raise ValueError('x must start at a 16-byte aligned address')
        if self.num_x_rows != h.num_rows:
            raise ValueError(f'x must have shape [{h.num_rows}, {self.hidden}], got [{self.num_x_rows}, '
                             f'{self.hidden}]')
        current = self.stream()
        comm = ep._order.enter(current, event, self.local)
        alloc_stream = comm if self.alloc_on_comm else None
        combined_x = carver.empty((self.num_tokens, self.hidden), 'bfloat16', alloc_stream)
        combined_w = None
        if self.with_weights:
            combined_w = carver.empty((self.num_tokens, self.num_topk), 'float32', alloc_stream)
        b, i = self.launch, self.idx
        u = b.u64
        ws, (layout_at, send_pos_at, topk_at) = h.workspace_ptr, self.ws_at
        u[i[0]], u[i[1]], u[i[2]], u[i[3]] = xp, wp, h._meta_ptr, ws + layout_at
        u[i[4]], u[i[5]] = ws + send_pos_at, ws + topk_at if h._topk_idx is None else h.topk_idx_ptr
        u[i[6]] = bias_ptrs[0] if self.num_biases else 0
        u[i[7]] = bias_ptrs[1] if self.num_biases > 1 else 0
        u[i[8]] = carver.ptr(combined_x)
        u[i[9]] = carver.ptr(combined_w) if combined_w is not None else 0
        b(comm)
        if self.async_:
            event_out = ep._order.finish(self.kind, current, True,
                                         (x, topk_weights, *biases, combined_x, combined_w, h.metadata_owner,
                                          h.workspace, h._topk_idx))
        else:
            event_out = ep._order.leave(self.kind, current, comm, False)
        return combined_x, combined_w, event_out
