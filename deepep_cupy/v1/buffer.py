"""DeepEP V1's `Buffer` and `Config` (`deep_ep.buffers.legacy`; `deep_ep.Buffer`, `deep_ep.Config`), inside one NVLink
domain of up to 8 ranks, on this library's engines:

- normal (high-throughput) mode: `get_dispatch_layout`, `dispatch`, `combine` on the EP engine (`normal.py`:
  sizing, growth, the V1 handle);
- low-latency mode: `low_latency_*` on the low-latency engine (`low_latency.py`).

A buffer made with `low_latency_mode=True` serves both (SGLang's `auto`): each mode has memory of its own
(`num_nvl_bytes` and `num_rdma_bytes`), so switching needs no cleaning; both share one communication stream.
Several scale-up (NVLink) domains (DeepEP's internode mode): normal mode on the hybrid engine (`internode.py`;
the design: `v1/kernels/internode.py`): `get_dispatch_layout` with `num_tokens_per_rdma_rank`, `dispatch`
(BF16 / FP8, top-k ids required, expert alignment, `num_worst_tokens`, cached) with V1's 10-element internode
handle, `combine` (biases, V1's combined weights); the engine is built by the first dispatch (collective), when
hidden and top-k are known. Low-latency mode across domains (`internode_ll.py`; the design:
`v1/kernels/internode_ll.py`): every `low_latency_*` call with the single-domain layouts and numerics, on an
engine of its own built by the first low-latency call, so a buffer serves both modes there too.
"""

import sys
from typing import Optional

from ..buffers.base import BufferBase, _acquire_stream, _release_stream, check_configuration
from ..features.ll import CONTROL_BYTES as LL_CONTROL_BYTES
from ..runtime import dtypes, interop
from ..runtime.checks import check_int
from ..runtime.event import EventHandle, EventOverlap
from ..runtime.group import get_group
from ..runtime.nvlink import get_nvlink_gbs
from ..runtime.streams import StreamOrder
from ..runtime.topology import detect_topology, select_device
from .config import COMBINE_TABLE, DISPATCH_TABLE, NUM_MAX_NVL_PEERS, Config, table_config
from .internode import InternodeEngine, InternodeMode, expected_internode_handle
from .internode_ll import InternodeLLMode, LLInternodeEngine
from .kernels.internode import check_domains, no_topk_refusal
from .kernels.layout import DispatchLayout
from .low_latency import LowLatencyMethods, LowLatencyMode
from .normal import (
    LegacyHandle,
    NormalEngine,
    NormalMode,
    check_dispatch_scalars,
    check_event_rule,
    check_num_sms,
    expected_handle_type,
)

__all__ = ['Buffer', 'Config']

DEFAULT_NVLINK_GBS = 450.0
NUM_CPU_TIMEOUT_SECS = 300
NUM_GPU_TIMEOUT_SECS = 100


class Buffer(LowLatencyMethods):
    """DeepEP V1's expert-parallel communication buffer: normal-mode (high-throughput) dispatch / combine and
    low-latency dispatch / combine inside one NVLink domain (up to 8 ranks, ranks may share a GPU for tests); both
    modes across several domains (DeepEP's internode mode, `internode.py`; low latency:
    `internode_ll.py`).

    Args:
        group: a `torch.distributed` ProcessGroup (any backend: only host collectives go through it), or None with
            `comm`; neither: the launch's world (mpirun, init_dist, torch.distributed).
        num_nvl_bytes: memory of normal mode (rounded up to 2 MiB). Its size sets how many tokens a dispatch moves
            without growing it (`Config.get_nvl_buffer_size_hint`); a dispatch needing more grows it once (all
            ranks together). 0: allocated at the first dispatch. Across domains: the intranode part's.
        num_rdma_bytes: memory of low-latency mode (`get_low_latency_rdma_size_hint`); 0: at the first call. Across
            domains (normal mode): bounds the rail memory (`Config.get_rdma_buffer_size_hint`); 0: no bound; the
            low-latency engine there is sized by its first call (M, hidden, top-k), not by this value.
        low_latency_mode: enable the low-latency calls (normal mode works either way).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric: NVSHMEM / RDMA settings of
            DeepEP; accepted, no effect (everything goes over NVLink through CUDA IPC).
        explicitly_destroy: `destroy()` releases the memory (collective); without it, dropping the buffer does (the
            memory of each rank is freed locally).
        enable_shrink: the mask calls (DeepEP's shrink mode) of low-latency mode.
        comm: an mpi4py communicator, when `group` is None.

    Attributes:
        group (the object passed: `group`, else `comm`), rank, group_size, num_nvl_bytes, num_rdma_bytes,
        low_latency_mode, explicitly_destroy, enable_shrink; class attribute `num_sms` (SMs of normal-mode calls with
        the default configs).
    """

    num_sms: int = 20
    # The last `Buffer.num_sms` `_config` checked as the SM count of the default dispatch / combine config (0: none)
    _dispatch_sms = _combine_sms = 0
    num_domains: int = 1            # scale-up domains (set at construction)
    num_scaleup_ranks: int = 0      # ranks per domain (set at construction)
    _internode: Optional[InternodeMode] = None      # normal mode across domains

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 use_fabric: Optional[bool] = None):
        del num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric
        check_int('num_nvl_bytes', num_nvl_bytes)
        check_int('num_rdma_bytes', num_rdma_bytes)
        self._destroyed = True      # until construction completes
        self.group = group if group is not None else comm
        self._pg = pg = get_group(group, comm, timeout=NUM_CPU_TIMEOUT_SECS)
        self.rank, self.group_size = pg.rank, pg.size
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        self.nvshmem_qp_depth = 1024
        self.design = check_configuration(pg, 'Buffer configuration', {
            'num_nvl_bytes': num_nvl_bytes, 'num_rdma_bytes': num_rdma_bytes, 'low_latency_mode': self.low_latency_mode,
            'enable_shrink': self.enable_shrink}, NUM_CPU_TIMEOUT_SECS)
        self.device = device = select_device(pg)
        topology = detect_topology(pg, device, allow_hybrid_mode=True)
        self.num_domains = num_domains = topology.num_scaleout_ranks
        self.num_scaleup_ranks = topology.num_scaleup_ranks
        check_domains(self.group_size, num_domains, self.num_scaleup_ranks, self.low_latency_mode, NUM_MAX_NVL_PEERS)
        self._stream = stream = _acquire_stream(device)
        self._order = StreamOrder(stream, self.design.always_comm_stream)
        self._layout = DispatchLayout(device, num_domains=num_domains)
        self._configs = {}
        self._normal = self._ll = None
        nvlink_gbs = get_nvlink_gbs() or DEFAULT_NVLINK_GBS
        if num_domains > 1:
            S = self.num_scaleup_ranks

            def make_internode(num_tokens: int, hidden: int, num_topk: int) -> InternodeEngine:
                return InternodeEngine(pg, num_tokens, hidden, num_topk, num_domains, S, stream, device, nvlink_gbs,
                                       NUM_CPU_TIMEOUT_SECS, NUM_GPU_TIMEOUT_SECS)
            # (no engine memory yet: the first dispatch builds it, once hidden and top-k are known)
            self._internode = InternodeMode(num_domains, S, num_nvl_bytes, num_rdma_bytes, make_internode)
            if self.low_latency_mode:
                def make_ll_internode(num_pseudo: int, hidden: int) -> LLInternodeEngine:
                    return LLInternodeEngine(pg, num_pseudo, hidden, num_domains, S, stream, device, nvlink_gbs,
                                             NUM_CPU_TIMEOUT_SECS, NUM_GPU_TIMEOUT_SECS)
                # (built by the first low-latency call, when M, hidden and top-k are known)
                self._ll_internode = InternodeLLMode(num_domains, S, device, enable_shrink, make_ll_internode)
            self._destroyed = False
            return

        def make_engine(num_bytes: int) -> NormalEngine:
            return NormalEngine(pg, num_bytes, stream, device, nvlink_gbs, NUM_CPU_TIMEOUT_SECS, NUM_GPU_TIMEOUT_SECS)

        def make_base(num_bytes: int) -> BufferBase:
            return BufferBase(group=pg, num_bytes=num_bytes, num_cpu_timeout_secs=NUM_CPU_TIMEOUT_SECS,
                              num_gpu_timeout_secs=NUM_GPU_TIMEOUT_SECS, explicitly_destroy=False, device=device,
                              comm_stream=stream)
        try:
            self._normal = NormalMode(self.group_size, device, num_nvl_bytes, make_engine)
            if self.low_latency_mode:
                self._ll = LowLatencyMode(self.group_size, num_rdma_bytes, enable_shrink, make_base)
        except BaseException:
            self._release()
            raise
        self._destroyed = False

    # ---- lifetime ------------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError('this deepep_cupy Buffer was destroyed')

    def _release(self) -> None:
        for mode in (self._normal, self._ll, self._internode, self._ll_internode):
            if mode is not None:
                mode.destroy()
        self._normal = self._ll = self._internode = self._ll_internode = None
        if getattr(self, '_stream', None) is not None:
            _release_stream(self.device, self._stream)
            self._stream = None

    def destroy(self) -> None:
        """Release the memory of both modes (collective: every rank calls it). Only for `explicitly_destroy=True`."""
        if not self.explicitly_destroy:
            raise RuntimeError('destroy() needs a Buffer built with explicitly_destroy=True (DeepEP V1 rule)')
        if self._destroyed:
            return
        self._destroyed = True
        self._release()

    # ---- static / utility methods (DeepEP V1) ---------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether FP8 dispatch is available: always (kernels are compiled for the running GPU)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SMs of normal-mode calls made with the default configs (even)."""
        check_int('new_num_sms', new_num_sms, 2)
        if new_num_sms % 2 != 0:
            raise ValueError(f'The SM count must be even, got {new_num_sms}')
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An `EventOverlap` of an event recorded on the current stream (pass it as `previous_event`)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch config for `num_ranks` ranks (with `Buffer.num_sms`); ValueError for a rank
        count DeepEP's table lacks (this library adds 1, 3, 5, 6 and 7)."""
        return table_config(DISPATCH_TABLE, num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine config for `num_ranks` ranks (see `get_dispatch_config`)."""
        return table_config(COMBINE_TABLE, num_ranks, Buffer.num_sms)

    def _config(self, config: Optional[Config], which: str) -> int:
        """The SM count of `config`, else of the default config (cached per `Buffer.num_sms`). The default config's
        is `Buffer.num_sms` itself (`table_config`) once checked for this rank count: the last one checked is kept as
        `_dispatch_sms` / `_combine_sms`, which dispatch and combine compare inline."""
        if config is None:
            key = (which, Buffer.num_sms)
            num_sms = self._configs.get(key)
            if num_sms is None:     # (the checked SM count of the default config, remembered)
                table = DISPATCH_TABLE if which == 'dispatch' else COMBINE_TABLE
                num_sms = self._configs[key] = check_num_sms(table_config(table, self.group_size, Buffer.num_sms))
            if which == 'dispatch':
                self._dispatch_sms = num_sms
            else:
                self._combine_sms = num_sms
            return num_sms
        num_sms = config.num_sms        # (read per call: a Config may be changed between calls)
        if num_sms.__class__ is int and num_sms >= 2 and not num_sms & 1:     # (`check_num_sms` where it passes)
            return num_sms
        return check_num_sms(config)

    def get_comm_stream(self):
        """The communication stream: a `torch.cuda.Stream` (an ExternalStream) when torch is installed, else the
        `cupy.cuda.Stream`."""
        self._check_alive()
        self._order.settle()        # (synchronous calls may have run on the caller's stream: runtime/streams.py)
        for mode in (self._normal, self._internode, self._ll_internode):
            if mode is not None and mode.engine is not None:
                mode.engine.stream_order.settle()
        if 'torch' in sys.modules or _torch_installed():
            return interop.torch_stream(self._stream.ptr)
        return self._stream

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        """A view of this rank's memory of one mode as a tensor of `dtype` (a CuPy array for a numpy dtype), from
        element `offset`; `size` (a torch.Size or tuple) takes the first elements in that shape.

        The memory handed out holds no control word, so zeroing it between calls is safe: normal mode (default)
        gives its whole slot region (every signal lives in a separate workspace); `use_rdma_buffer=True` gives the
        low-latency engine's zero-copy staging area once a low-latency call ran (before, the memory past the
        engine's control area, which the first call lays out: do not keep such a view past it).
        """
        self._check_alive()
        kind, name, itemsize = dtypes.describe(dtype)
        base, start, num_bytes = self._local_region(use_rdma_buffer)
        check_int('offset', offset)
        count = max(0, num_bytes // itemsize - offset)
        if base is None or count == 0:
            flat = interop.Allocator(kind).empty((0,), name)
        else:
            raw = base.sym.local_view(start + offset * itemsize, count * itemsize)
            if kind == 'torch':
                flat = interop.to_torch(raw).view(dtype)
            else:
                flat = raw.view(name)
        if size is None:
            return flat
        shape = tuple(size)
        numel = 1
        for s in shape:
            numel *= s
        if numel > flat.shape[0]:
            raise ValueError(f'size {list(shape)} needs {numel} elements; the buffer holds {flat.shape[0]}')
        return flat[:numel].reshape(shape) if kind == 'cupy' else flat[:numel].view(shape)

    def _local_region(self, use_rdma_buffer: bool):
        """`(buffer base, byte offset, bytes)` of the region `get_local_buffer_tensor` hands out."""
        if not use_rdma_buffer:
            mode = self._normal if self._normal is not None else self._internode
            eng = mode.engine if mode is not None else None
            if eng is None:
                return None, 0, 0
            return eng, eng.data_offset, min(eng.num_bytes, self.num_nvl_bytes) if self.num_nvl_bytes else eng.num_bytes
        ll = self._ll
        if ll is None or ll.base is None:
            return None, 0, 0
        if ll.engine is not None and not ll._placeholder:
            eng = ll.engine
            return ll.base, eng._staging_offset(0), 2 * eng.layout.staging_half_bytes
        return ll.base, ll.base.data_offset + LL_CONTROL_BYTES, ll.base.num_bytes - LL_CONTROL_BYTES

    # ---- normal mode --------------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """The layout of a dispatch, on the GPU (no host synchronisation, CUDA-graph capturable).

        Args:
            topk_idx: `[num_tokens, num_topk]` int64 (`deep_ep.topk_idx_t`), contiguous; -1 selects nothing.
            num_experts: experts in all (a multiple of the number of ranks).
            previous_event: an `EventOverlap` the communication stream waits for (else: the current stream).
            async_finish: return an event instead of making the current stream wait.
            allocate_on_comm_stream: allocate the outputs on the communication stream (needs previous_event and
                async_finish).

        Returns:
            `(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank, num_tokens_per_expert [E] int32,
            is_token_in_rank [N, R] bool, event)`: tokens sent to each rank (a token once per rank owning one of its
            experts), tokens sent to each scale-up domain (`[num_domains]` int32, a token once per domain holding
            one of its experts; None inside one domain, as V1), (token, slot) pairs of each expert, whether each
            token goes to each rank. The counts are views of one allocation.
        """
        if self._destroyed:
            self._check_alive()
        if previous_event is not None or allocate_on_comm_stream:      # (`check_event_rule` where it acts)
            previous_event = check_event_rule(previous_event, async_finish, allocate_on_comm_stream)
        # (checked and bound once per signature: `DispatchLayout.run`)
        return self._layout.run(self._order, topk_idx, num_experts, self.group_size, self.device, previous_event,
                                async_finish, allocate_on_comm_stream)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send each token to every rank owning one of its experts (once per rank).

        Args:
            x: `[num_tokens, hidden]` bfloat16, or `(x_fp8 [num_tokens, hidden] float8_e4m3fn, scales [num_tokens, P])`
                with float32 scales or int32 packed UE8M0 ones, any strides; rows contiguous, `hidden * itemsize` a
                multiple of 16. CuPy arrays too (bfloat16 as uint16, FP8 as uint8).
            handle: a handle of an earlier dispatch: cached dispatch (same layout, no CPU sync; topk_idx and
                topk_weights must be None).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert: the outputs of
                `get_dispatch_layout` (required without a handle, num_tokens_per_rdma_rank only across domains, as
                DeepEP; the rank counts are not read; is_token_in_rank routes when there are no top-k ids and is
                kept in the handle; num_tokens_per_expert gives the number of experts, and the per-expert counts
                without top-k ids).
            topk_idx: `[num_tokens, num_topk]` int64, or None (route by is_token_in_rank; inside one domain only).
            topk_weights: `[num_tokens, num_topk]` float32, or None.
            expert_alignment: per-expert received counts rounded up to this.
            num_worst_tokens: > 0: no CPU sync (CUDA-graph capturable), outputs of exactly this many rows (rows past
                the real count: recv_topk_idx -1, the rest unspecified), list empty; needs top-k ids, and at least
                the rows this rank receives. Every rank's token count must fit the buffer (see `normal.py`).
            config: `Config` (its num_sms sets the sending SMs); default `get_dispatch_config(group_size)`.
            previous_event: an `EventOverlap` the communication stream waits for (else: the current stream).
            async_finish: return an event instead of making the current stream wait.
            allocate_on_comm_stream: allocate outputs on the communication stream (needs previous_event and
                async_finish).

        Returns:
            `(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)`: recv_x like
            x (FP8: `(x, scales [rows, P])` row-major), rows grouped by source rank (rank i's rows are
            `[handle[0][i-1][rank], handle[0][i][rank])`), then in token order; recv_topk_idx `[rows, num_topk]`
            local expert ids or -1; recv_topk_weights float32, 0 where -1 (both None without top-k ids); the list:
            received (token, slot) pairs per local expert, aligned (a Python list; empty with num_worst_tokens);
            handle: see `normal.LegacyHandle` (across domains: V1's internode 10-tuple,
            `internode.InternodeHandle`; its `recv_gbl_rank_prefix_sum`, `handle[-4]`, bounds each source's
            rows). Cached: `(recv_x, None, None, None, None, event)`.
        """
        if self._destroyed:
            self._check_alive()
        if previous_event is not None or allocate_on_comm_stream:      # (`check_event_rule` where it acts)
            previous_event = check_event_rule(previous_event, async_finish, allocate_on_comm_stream)
        if config is None:      # (`_config` inline where it has the answer)
            num_sms = Buffer.num_sms
            if num_sms != self._dispatch_sms:
                num_sms = self._config(None, 'dispatch')
        else:
            num_sms = config.num_sms
            if num_sms.__class__ is not int or num_sms < 2 or num_sms & 1:
                num_sms = check_num_sms(config)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError('a cached dispatch (handle given) takes no topk_idx / topk_weights')
            if self.num_domains > 1:
                return InternodeMode.cached_dispatch(x, expected_internode_handle(handle), num_sms, previous_event,
                                                     async_finish, allocate_on_comm_stream)
            if type(handle) is not LegacyHandle:
                handle = expected_handle_type(handle)       # (its TypeError; a LegacyHandle holds an EPHandle)
            # (V1's cached dispatch: `(recv_x, None, None, None, None, event)`)
            recv_x, _, _, _, event = handle.ep.dispatch(
                x, num_sms=num_sms, previous_event=previous_event, async_with_compute_stream=async_finish,
                allocate_on_comm_stream=allocate_on_comm_stream, handle=handle.ep_handle,
                allow_previous_event_alone=True)
            return recv_x, None, None, None, None, event
        normal = self._normal
        if normal is not None and num_tokens_per_rank is not None and is_token_in_rank is not None:
            # (one domain: by signature, `NormalMode.lean_dispatch`; None: no top-k ids, other array types)
            out = normal.lean_dispatch(x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                       expert_alignment, num_worst_tokens, num_sms, previous_event, async_finish,
                                       allocate_on_comm_stream)
            if out is not None:
                return out
        internode = self.num_domains > 1
        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            for name, value in (('num_tokens_per_rank', num_tokens_per_rank), ('is_token_in_rank', is_token_in_rank),
                                ('num_tokens_per_expert', num_tokens_per_expert)):
                if value is None:
                    raise ValueError(f'{name} is required without a handle (get_dispatch_layout gives it)')
        if internode and num_tokens_per_rdma_rank is None:
            raise ValueError('num_tokens_per_rdma_rank is required across scale-up domains without a handle '
                             '(get_dispatch_layout gives it)')
        if topk_idx is None and topk_weights is not None:
            raise ValueError('topk_weights needs topk_idx')
        check_dispatch_scalars(expert_alignment, num_worst_tokens, topk_idx is not None)
        num_experts = interop.shape_of(num_tokens_per_expert, 'num_tokens_per_expert')[0]
        if internode:
            if topk_idx is None:
                raise NotImplementedError(no_topk_refusal(self.num_domains, self.num_scaleup_ranks))
            return self._internode.dispatch(x, is_token_in_rank, topk_idx, topk_weights, expert_alignment,
                                            num_worst_tokens, num_experts, num_sms, previous_event, async_finish,
                                            allocate_on_comm_stream)
        return self._normal.dispatch(x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                     expert_alignment, num_worst_tokens, num_experts, num_sms, previous_event,
                                     async_finish, allocate_on_comm_stream)

    def combine(self, x, handle, topk_weights=None, bias=None, config: Optional[Config] = None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send every received row back to its token's rank and sum there, UNWEIGHTED: `combined_x[t]` = the sum,
        in FP32, of bias_0, bias_1 and the row of every rank the token went to (in order of each rank's last top-k
        slot; ascending ranks without top-k ids), rounded to bfloat16 once. Across domains the sum has two levels:
        per domain, its ranks' rows in that order (FP32, rounded to bfloat16 once at the domain's forwarder), then at
        the origin bias_0, bias_1 and the domains' partials in order of each domain's last top-k slot (FP32, rounded
        once).

        Args:
            x: `[rows, hidden]` bfloat16, contiguous, rows aligned with the dispatch's recv_x (each row this rank's
                result for that token, router weights already applied by the caller).
            handle: the dispatch's handle.
            topk_weights: `[rows, num_topk]` float32, optional: `combined_topk_weights[t][k]` = the FP32 sum over the
                token's destination ranks (first top-k appearance order; across domains per domain, then over the
                domains in that order) of their row's value for slot k (V1's definition; equal to the owner's value
                when the others hold 0, as dispatch returns them).
            bias: None, a `[num_tokens, hidden]` bfloat16 tensor, or a tuple of two.
            config: `Config` (its num_sms sets the sending SMs); default `get_combine_config(group_size)`.
            previous_event, async_finish, allocate_on_comm_stream: as in `dispatch`.

        Returns:
            `(combined_x [num_tokens, hidden] bfloat16, combined_topk_weights [num_tokens, num_topk] float32 or
            None, event)`.
        """
        if self._destroyed:
            self._check_alive()
        if previous_event is not None or allocate_on_comm_stream:      # (`check_event_rule` where it acts)
            previous_event = check_event_rule(previous_event, async_finish, allocate_on_comm_stream)
        if config is None:      # (`_config` inline where it has the answer)
            num_sms = Buffer.num_sms
            if num_sms != self._combine_sms:
                num_sms = self._config(None, 'combine')
        else:
            num_sms = config.num_sms
            if num_sms.__class__ is not int or num_sms < 2 or num_sms & 1:
                num_sms = check_num_sms(config)
        if self.num_domains > 1:
            return InternodeMode.combine(x, expected_internode_handle(handle), topk_weights, bias, num_sms,
                                         previous_event, async_finish, allocate_on_comm_stream)
        if type(handle) is not LegacyHandle:
            handle = expected_handle_type(handle)       # (its TypeError; a LegacyHandle holds an EPHandle)
        if topk_weights is not None and not handle.with_topk:
            raise ValueError('topk_weights given to combine, but the dispatch of this handle had no top-k ids')
        return handle.ep.combine(x, handle.ep_handle, topk_weights=topk_weights, bias=bias, num_sms=num_sms,
                                 previous_event=previous_event, async_with_compute_stream=async_finish,
                                 allocate_on_comm_stream=allocate_on_comm_stream, weights_over_ranks=True,
                                 allow_previous_event_alone=True)

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                           is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, config: Optional[Config] = None, previous_event=None,
                           async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP V1's internode dispatch (`dispatch` of a Buffer across scale-up domains); inside one domain
        NotImplementedError, as DeepEP runs its internode kernels only across nodes."""
        if self.num_domains <= 1:
            raise NotImplementedError(_INTERNODE)
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, 0, config,
                             previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config: Optional[Config] = None,
                          previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP V1's internode combine (`combine` of a Buffer across scale-up domains); inside one domain
        NotImplementedError."""
        if self.num_domains <= 1:
            raise NotImplementedError(_INTERNODE)
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)


_INTERNODE = ('DeepEP V1\'s internode calls (internode_dispatch / internode_combine) serve a Buffer across scale-up '
              f'domains; this one runs inside one NVLink domain of up to {NUM_MAX_NVL_PEERS} ranks: call dispatch / '
              f'combine')


def _torch_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec('torch') is not None
