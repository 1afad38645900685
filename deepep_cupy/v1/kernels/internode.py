"""DeepEP V1's internode normal mode (several scale-up domains) on the hybrid EP engine (`features/hybrid`): the
design, the construction check, and the launchers of the handle kernels (kernels_cu/legacy_internode.cu); the host
reference of V1's contract and host mirrors of the kernels are `internode_reference.py`, the buffer side (engine,
sizing, growth, handle) is v1/internode.py.

Status: built, CPU-tested (tests/test_legacy_internode_cpu.py: the kernels' host mirrors fed what the hybrid dispatch
leaves equal `reference_internode` on every rank, and the whole host path), not yet run on a GPU (the rank program
deepep_cupy/tests/legacy_internode.py checks every output and handle element against the reference, bit for bit).
`dispatch` without top-k ids raises `NotImplementedError` (V1 derives its per-expert counts from every source's
`num_tokens_per_expert`, which the hybrid path does not carry). Low-latency mode across domains is
v1/kernels/internode_ll.py (its own engine: v1/internode_ll.py).

Ranks and domains. R ranks form D = R / S scale-up domains of S ranks; rank `g = d * S + l` is local rank l of domain
d (V1: `rdma_rank = g // 8`, `nvl_rank = g % 8`, with S = 8; here S is the topology's, so `NUM_MAX_NVL_PEERS`-wide
V1 tensors are S wide). Expert e lives on rank `e // (E / R)`; V1's "RDMA rank" is our domain, its RDMA peers (same
`nvl_rank`) are our rail peers.

V1's contract, as the adapter serves it:

- `get_dispatch_layout` → `num_tokens_per_rdma_rank` `[D]` int32 on the GPU: tokens of this rank with >= 1 expert in
  domain d (a token counts once per domain). Kernel `get_dispatch_layout_domains` after the layout kernel.
- `dispatch(x, num_tokens_per_rdma_rank=..., ...)` is one hybrid dispatch (`HybridEP.dispatch`) of an engine built
  `deterministic=True`, whose order is V1's receive order: rows grouped by global source rank ascending, within a
  source rank in token order (V1 writes each channel, a contiguous token range, at its prefix offset). M (tokens per
  rank) follows V1's normal-mode sizing and growth rule (v1/internode.py): the largest reported count
  rides on word 2 of the rail headers and on the intranode notify (`LegacyLayout.reported_num_tokens`).
  `recv_topk_idx` / weights, `num_recv_tokens_per_expert_list` with `expert_alignment` and `num_worst_tokens` are the
  hybrid dispatch's outputs (local expert ids, -1 and weight 0 elsewhere).
- The handle, V1's 10-tuple in V1's order (C = `config.num_sms // 2` channels, channel c = tokens
  `[c * ceil(N / C), (c + 1) * ceil(N / C))` of the sender):
   0 `is_token_in_rank` `[N, R]` bool: the dispatch's argument.
   1 `rdma_channel_prefix_matrix` `[D, C]` int32: per destination domain, inclusive prefix over channels of this
     rank's tokens sent there (a token once per domain).
   2 `gbl_channel_prefix_matrix` `[R, C]` int32: the same per destination rank.
   3 `recv_rdma_channel_prefix_matrix` `[D, C]` int32: at this rank as forwarder, per source domain s (the rail peer
     (s, l)), inclusive prefix over the peer's channels of its tokens with an expert in this domain.
   4 `recv_rdma_rank_prefix_sum` `[D]` int32: inclusive prefix over source domains of those forwarded token counts.
   5 `recv_gbl_channel_prefix_matrix` `[R, C]` int32: per source rank, the absolute row where its channel c starts.
   6 `recv_gbl_rank_prefix_sum` `[R]` int32: inclusive prefix over source ranks of the rows received (V1 tests read
     it as `handle[-4]`).
   7 `recv_src_meta` `[rows, 8]` uint8: per row, int32 source domain then int32 bitmask of the local ranks of this
     domain the token goes to (V1's `SourceMeta`, little-endian).
   8 `send_rdma_head` `[N, D]` int32: the token's slot among this rank's tokens going to domain d (V1: its RDMA ring
     position), -1 if none of its experts is there: the hybrid handle's `domain_pos` itself.
   9 `send_nvl_head` `[num_rdma_recv_tokens, S]` int32: per token this rank forwarded (source domain, then token
     order: the rows of item 4) and local rank l, its slot among the forwarded tokens going to l (V1: NVL ring
     position), -1 if not sent there. `send_nvl_head.shape[0]` is V1's `num_rdma_recv_tokens`.
  With `num_worst_tokens`, 7 and 9 have that many rows (past the real counts: source domain -1, bitmask 0; -1).
  Positions stand where V1 has ring positions (the composed path has no rings); every element is filled, and code
  reading V1's fields (shapes, prefix sums, source domain, bitmask) sees V1's values. The handle object also keeps the
  `HybridHandle` for combine and cached dispatch.
- How the handle is built, on the GPU, around the hybrid dispatch (`InternodeCall`, its hooks in `HybridEP.dispatch`):
  1, 2, 3, 4, 9 by `legacy_internode_forward` at each rank (its own tokens' top-k ids; as forwarder, its rail rows'
  source tokens `fwd_src`, the union's top-k, and the rail peers' token counts, which `legacy_internode_begin` put in
  word 2 of every rail header); 5, 6, 7 by `legacy_internode_receive` at the receiver, which needs what only the
  forwarders know: each source's token count (V1's channels) and each row's local-rank bitmask. The forwarder writes
  them into every local receiver's slot of the V1 exchange area (an epoch-tagged, acknowledged double buffer in the
  engine's symmetric extra region: kernels_cu/legacy_internode.cu), so no host synchronisation is added
  (num_worst_tokens dispatches stay CUDA-graph capturable) and no slot is overwritten before its reader is done.
- Cached dispatch (`handle` given) = a hybrid cached dispatch of the kept `HybridHandle`: same rows, same order.
- `combine(x, handle, topk_weights, bias)` = the hybrid combine with `reduce_in_scaleup=True`: FP32 in-domain sum at
  the forwarder (rounded once), FP32 across domains plus 0-2 biases at the origin, one rounding;
  `combined_topk_weights` = the FP32 sum over destination ranks of their row's weights (V1's definition): per domain
  by the intranode combine (`weights_over_ranks`), over the domains by `legacy_internode_combine_weights`, each in
  first top-k appearance order. V1 sums in a different order (NVL then RDMA).
- Events (`previous_event`, `async_finish`, `allocate_on_comm_stream`) as intranode (`legacy_normal.check_event_rule`).
"""

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ...jit.launch import PTR, KernelSpec, Param, load_kernels
from ...runtime import interop

MAX_DOMAINS = 16                # features/hybrid/kernels.py MAX_DOMAINS (kV1MaxDomains)
MAX_SCALEUP_RANKS = 8           # kV1MaxScaleup: the intranode engine's ranks per domain
NUM_MAX_CHANNELS = 128          # V1 channels (config.num_sms // 2), as intranode


def check_domains(num_ranks: int, num_domains: int, num_scaleup_ranks: int, low_latency_mode: bool,
                  max_scaleup_ranks: int) -> None:
    """Refuse, at construction, what the topology cannot serve (yet): NotImplementedError naming it."""
    if num_domains <= 1:
        if num_ranks > max_scaleup_ranks:
            raise NotImplementedError(f'{num_ranks} ranks in one NVLink domain: DeepEP V1 runs at most '
                                      f'{max_scaleup_ranks} ranks per domain')
        return
    assert num_domains * num_scaleup_ranks == num_ranks, (num_domains, num_scaleup_ranks, num_ranks)
    if num_domains > MAX_DOMAINS or num_scaleup_ranks > MAX_SCALEUP_RANKS:
        modes = 'normal and low-latency modes' if low_latency_mode else 'normal mode'
        raise NotImplementedError(f'{num_ranks} ranks in {num_domains} scale-up domains of {num_scaleup_ranks}: '
                                  f'{modes} across domains run at most {MAX_DOMAINS} domains of at most '
                                  f'{MAX_SCALEUP_RANKS} ranks')


def no_topk_refusal(num_domains: int, num_scaleup_ranks: int) -> str:
    """The NotImplementedError message of a dispatch without top-k ids across domains."""
    return (f'dispatch without topk_idx across {num_domains} scale-up domains of {num_scaleup_ranks} ranks is not '
            f'implemented in deepep_cupy (its per-expert counts would need every source\'s num_tokens_per_expert); '
            f'pass topk_idx (and topk_weights), as vLLM, SGLang and Megatron-Core do')


# ---- kernels (kernels_cu/legacy_internode.cu) ----------------------------------------------------------------------
FAMILY = 'legacy_internode'
THREADS = 1024                  # kV1Threads: legacy_internode_forward / _receive run one block
WEIGHT_THREADS = 256            # kV1WeightThreads
MAX_WEIGHT_BLOCKS = 1024
AREA_ACK_OFFSET = 32            # kV1AckOffset (int32 words of the V1 exchange area)
AREA_SLOTS_OFFSET = 64          # kV1SlotsOffset
SLOT_COUNTS, SLOT_MASKS = 16, 32    # kV1SlotCounts, kV1SlotMasks (words of a slot)

_P = Param
_RAIL = (_P('rail_base', PTR),)
BEGIN_SPEC = KernelSpec(FAMILY, 'deepep::legacy_internode_begin', (
    *_RAIL, _P('send_offset', np.uint64), _P('region_bytes', np.uint64), _P('num_domains', np.int32),
    _P('domain', np.int32), _P('reported_num_tokens', np.int32), _P('area', PTR), _P('call_words', PTR)))
REPORT_SPEC = KernelSpec(FAMILY, 'deepep::legacy_internode_report', (
    *_RAIL, _P('recv_offset', np.uint64), _P('region_bytes', np.uint64), _P('num_domains', np.int32),
    _P('domain', np.int32), _P('counts', PTR), _P('host_out', PTR)))
FORWARD_SPEC = KernelSpec(FAMILY, 'deepep::legacy_internode_forward', (
    _P('topk_idx', PTR), _P('num_tokens', np.int32), _P('num_topk', np.int32), _P('num_experts', np.int32),
    _P('num_domains', np.int32), _P('domain', np.int32), _P('num_scaleup', np.int32), _P('rank', np.int32),
    _P('fwd_src', PTR), _P('fwd_count', PTR), _P('union_topk', PTR), _P('num_max_tokens', np.int32),
    _P('num_channels', np.int32), *_RAIL, _P('recv_offset', np.uint64), _P('region_bytes', np.uint64),
    _P('peer_bases', PTR), _P('area_offset', np.uint64), _P('slot_words', np.int64), _P('call_words', PTR),
    _P('rdma_channel_prefix_matrix', PTR), _P('gbl_channel_prefix_matrix', PTR),
    _P('recv_rdma_channel_prefix_matrix', PTR), _P('recv_rdma_rank_prefix_sum', PTR), _P('send_nvl_head', PTR),
    _P('num_nvl_rows', np.int32), _P('error_record', PTR), _P('timeout_ns', np.uint64)))
RECEIVE_SPEC = KernelSpec(FAMILY, 'deepep::legacy_internode_receive', (
    _P('recv_meta', PTR), _P('meta_stride', np.int64), _P('num_rows', np.int32), _P('num_recv', PTR),
    _P('num_domains', np.int32), _P('num_scaleup', np.int32), _P('rank', np.int32), _P('num_max_tokens', np.int32),
    _P('num_channels', np.int32), _P('peer_bases', PTR), _P('area_offset', np.uint64), _P('slot_words', np.int64),
    _P('call_words', PTR), _P('recv_gbl_rank_prefix_sum', PTR), _P('recv_gbl_channel_prefix_matrix', PTR),
    _P('recv_src_meta', PTR), _P('error_record', PTR), _P('timeout_ns', np.uint64)))
WEIGHTS_SPEC = KernelSpec(FAMILY, 'deepep::legacy_internode_combine_weights', (
    _P('topk_idx', PTR), _P('num_tokens', np.int32), _P('num_topk', np.int32), _P('experts_per_domain', np.int32),
    _P('num_domains', np.int32), _P('domain', np.int32), _P('num_max_tokens', np.int32), _P('domain_pos', PTR),
    _P('combined_weights', PTR), _P('hidden', np.int32), *_RAIL, _P('recv_offset', np.uint64),
    _P('region_bytes', np.uint64), _P('out_weights', PTR)))
SPECS = (BEGIN_SPEC, REPORT_SPEC, FORWARD_SPEC, RECEIVE_SPEC, WEIGHTS_SPEC)


def shipped_specs():
    """Family name → every specialisation (one each: the sizes are run-time arguments)."""
    return {FAMILY: list(SPECS)}


def slot_words(num_domains: int, num_max_tokens: int) -> int:
    """int32 words of one slot of the V1 exchange area (tag, counts, a bitmask per union row), a multiple of 32."""
    return -(-(SLOT_MASKS + num_domains * num_max_tokens) // 32) * 32


def area_bytes(num_scaleup_ranks: int, num_domains: int, num_max_tokens: int) -> int:
    """Bytes of the V1 exchange area: the epoch, the acks, two slots per local forwarder."""
    return 4 * (AREA_SLOTS_OFFSET + 2 * num_scaleup_ranks * slot_words(num_domains, num_max_tokens))


class InternodeKernels:
    """The loaded kernels (attributes named after them; loaded when the engine is built, never inside a call)."""

    def __init__(self, device: Optional[int] = None, loaded=None):
        loaded = loaded if loaded is not None else load_kernels(list(SPECS), device=device)
        self.begin = loaded[BEGIN_SPEC.name]
        self.report = loaded[REPORT_SPEC.name]
        self.forward = loaded[FORWARD_SPEC.name]
        self.receive = loaded[RECEIVE_SPEC.name]
        self.weights = loaded[WEIGHTS_SPEC.name]


@dataclass
class ExchangeArea:
    """Where an engine's V1 exchange area is: `peer_bases_ptr` (device table of the scale-up peers' symmetric bases),
    `area_offset` (bytes, the same on every peer), `rank` (this rank's scale-up index), `num_scaleup_ranks`,
    `slot_words`, the local area's device address `local_ptr`; the error record (host-mapped) and GPU timeout of the
    engine; `host_words` `[2]` int32 host-mapped (legacy_internode_report) and its address."""
    peer_bases_ptr: int
    area_offset: int
    rank: int
    num_scaleup_ranks: int
    slot_words: int
    local_ptr: int
    error_record_ptr: int
    timeout_ns: int
    host_words: Any
    host_ptr: int


def _ptr(a) -> int:
    if a is None:
        return 0
    return a.data_ptr() if interop.is_torch(a) else a.data.ptr


class V1Options:
    """DeepEP V1's rules for a hybrid dispatch (`HybridEP.dispatch(v1=...)`; a cached one passes this class's
    instance): previous_event without allocate_on_comm_stream, `num_worst` rows without a CPU sync, and the hooks of
    V1's internode handle, which do nothing here (`InternodeCall` builds the handle)."""

    num_worst = 0

    def routed(self, feat, stream) -> None:
        pass

    def notified(self, feat, stream, counts) -> None:
        pass

    def forward(self, feat, stream, topk_idx, union_topk, fwd_src, fwd_count, num_max_tokens: int):
        return None


class InternodeCall(V1Options):
    """One non-cached V1 dispatch across domains: the hooks the hybrid dispatch calls, then `receive` for the
    receiver's handle parts. Launches, on the hybrid dispatch's (current) stream: `routed` (begin, after hybrid_route)
    → `notified` (report, CPU sync, after the rail notify exchange) → `forward` (before the intranode dispatch); then
    `receive` (after the hybrid dispatch returned: its stream is the caller's choice).

    Args:
        kernels: `InternodeKernels`; area: the engine's `ExchangeArea`; kind: 'torch' or 'cupy' (the call's arrays).
        num_tokens: the tokens this rank dispatches; reported_num_tokens: the count it reports (more than it
            dispatches when it probes a capacity overflow with 0 tokens: v1/internode.py).
        num_experts, num_channels: the call's; num_worst_tokens: > 0 without a CPU sync (the output rows).
        make_legacy: `make_legacy(num_channels, reported_num_tokens)` -> the intranode dispatch's V1 record
            (features/ep/legacy.py `LegacyLayout`, given by the buffer layer: a feature imports no other feature).
        alloc_stream: the stream the receiver's outputs are allocated on (None: the current one).

    After the dispatch: `max_num_tokens` (CPU sync: the most tokens any rank reported, -1 without), `forwarded`
    (the forward side's handle parts and their allocation), `call_words` (the call's epoch, read by `receive`).
    """

    def __init__(self, kernels: InternodeKernels, area: ExchangeArea, kind: str, num_tokens: int,
                 reported_num_tokens: int, num_experts: int, num_channels: int, num_worst_tokens: int,
                 make_legacy, alloc_stream=None):
        self.k, self.area, self.kind = kernels, area, kind
        self.num_tokens, self.reported_num_tokens = num_tokens, reported_num_tokens
        self.num_experts, self.num_channels, self.num_worst = num_experts, num_channels, num_worst_tokens
        self.make_legacy = make_legacy
        self.alloc = interop.Allocator(kind)
        self.alloc_stream = alloc_stream
        self.call_words = self.forwarded = self.inner_legacy = None
        self.union_rows = 0
        self._rail_max = self._num_forwarded = -1

    @property
    def max_num_tokens(self) -> int:
        """After a CPU-sync dispatch: the most tokens any rank of the job reported (its intranode notify spread each
        rail's largest through every domain); -1 without a CPU sync."""
        if self.inner_legacy is None or self.inner_legacy.max_num_tokens < 0:
            return -1
        return self.inner_legacy.max_num_tokens - self.union_rows

    # -- hooks of HybridEP.dispatch --
    def routed(self, feat, stream) -> None:
        """After hybrid_route (before any rail exchange): the reported count into the rail headers, the epoch."""
        self.call_words = self.alloc.empty((4,), 'int32')
        area = feat.area
        self.k.begin.launch(1, 1, stream=stream, rail_base=feat.rails.base, send_offset=area.send_offset,
                            region_bytes=area.region_bytes, num_domains=feat.N, domain=feat.domain,
                            reported_num_tokens=self.reported_num_tokens, area=self.area.local_ptr,
                            call_words=self.call_words)

    def notified(self, feat, stream, counts) -> None:
        """CPU sync, after the rail notify exchange, before hybrid_report (whose host wait covers this report)."""
        self.area.host_words[:] = -1
        area = feat.area
        self.k.report.launch(1, 1, stream=stream, rail_base=feat.rails.base, recv_offset=area.recv_offset,
                             region_bytes=area.region_bytes, num_domains=feat.N, domain=feat.domain, counts=counts,
                             host_out=self.area.host_ptr)

    def forward(self, feat, stream, topk_idx, union_topk, fwd_src, fwd_count, num_max_tokens: int):
        """Before the intranode dispatch: the forward side's handle parts and the exchange area's slots. Returns the
        intranode dispatch's V1 record: with a CPU sync it reports `N * M + the largest count of this rank's rail`
        (this rank's and its rail peers', from the report), so that after the intranode notify every rank knows the
        job's largest count; None without a CPU sync."""
        N, S, C, a = feat.N, self.area.num_scaleup_ranks, self.num_channels, self.area
        R = N * S
        if self.num_worst:
            nvl_rows = self.num_worst
        else:
            self._rail_max, self._num_forwarded = int(a.host_words[0]), int(a.host_words[1])
            if self._num_forwarded < 0:
                raise RuntimeError('the V1 internode report did not arrive before the hybrid notify\'s')
            nvl_rows = self._num_forwarded
        words = 2 * N * C + R * C + N
        flat = self.alloc.empty((words + nvl_rows * S,), 'int32')
        rdma = flat[:N * C].reshape(N, C)
        gbl = flat[N * C:N * C + R * C].reshape(R, C)
        recv_rdma = flat[N * C + R * C:2 * N * C + R * C].reshape(N, C)
        recv_rdma_sum = flat[2 * N * C + R * C:words]
        send_nvl_head = flat[words:].reshape(nvl_rows, S)
        self.forwarded = (rdma, gbl, recv_rdma, recv_rdma_sum, send_nvl_head, flat)
        self.k.forward.launch(
            1, THREADS, stream=stream, topk_idx=topk_idx, num_tokens=self.num_tokens,
            num_topk=interop.shape_of(topk_idx)[1], num_experts=self.num_experts, num_domains=N, domain=feat.domain,
            num_scaleup=S, rank=a.rank, fwd_src=fwd_src, fwd_count=fwd_count, union_topk=union_topk,
            num_max_tokens=num_max_tokens, num_channels=C, rail_base=feat.rails.base,
            recv_offset=feat.area.recv_offset, region_bytes=feat.area.region_bytes, peer_bases=a.peer_bases_ptr,
            area_offset=a.area_offset, slot_words=a.slot_words, call_words=self.call_words,
            rdma_channel_prefix_matrix=rdma, gbl_channel_prefix_matrix=gbl, recv_rdma_channel_prefix_matrix=recv_rdma,
            recv_rdma_rank_prefix_sum=recv_rdma_sum, send_nvl_head=send_nvl_head, num_nvl_rows=nvl_rows,
            error_record=a.error_record_ptr, timeout_ns=a.timeout_ns)
        if self.num_worst:
            return None
        self.union_rows = N * num_max_tokens
        self.inner_legacy = self.make_legacy(0, self.union_rows + max(self.reported_num_tokens, self._rail_max))
        return self.inner_legacy

    # -- after the hybrid dispatch --
    def receive(self, stream, recv_meta, num_rows: int, num_recv_ptr: int, num_domains: int, num_max_tokens: int):
        """The receiver's handle parts, on `stream` (after the rows are in DeepEP's order). `recv_meta`: `[rows,
        K + 2]` int32, column 0 the rows' global source index; `num_recv_ptr`: the received count's device address.
        Returns `(recv_gbl_rank_prefix_sum [R], recv_gbl_channel_prefix_matrix [R, C], recv_src_meta [rows, 8]
        uint8, allocation)`."""
        a, C = self.area, self.num_channels
        S = a.num_scaleup_ranks
        R = num_domains * S
        flat = self.alloc.empty((R + R * C + 2 * num_rows,), 'int32', self.alloc_stream)
        psum, chan = flat[:R], flat[R:R + R * C].reshape(R, C)
        meta = flat[R + R * C:]
        self.k.receive.launch(
            1, THREADS, stream=stream, recv_meta=recv_meta, meta_stride=interop.shape_of(recv_meta)[1],
            num_rows=num_rows, num_recv=num_recv_ptr, num_domains=num_domains, num_scaleup=S, rank=a.rank,
            num_max_tokens=num_max_tokens, num_channels=C, peer_bases=a.peer_bases_ptr, area_offset=a.area_offset,
            slot_words=a.slot_words, call_words=self.call_words, recv_gbl_rank_prefix_sum=psum,
            recv_gbl_channel_prefix_matrix=chan, recv_src_meta=meta, error_record=a.error_record_ptr,
            timeout_ns=a.timeout_ns)
        if self.kind == 'torch':
            import torch
            src_meta = meta.view(torch.uint8).reshape(num_rows, 8)
        else:
            import cupy
            src_meta = meta.view(cupy.uint8).reshape(num_rows, 8)
        return psum, chan, src_meta, flat


def combine_weights(kernels: InternodeKernels, feat, hybrid_handle, out_weights, hidden: int, stream) -> None:
    """V1's combined_topk_weights after a hybrid combine of `hybrid_handle` (`legacy_internode_combine_weights`),
    written into `out_weights` `[T, K]` float32, on `stream` (the hybrid combine's, right after it: the kernel reads
    the rail rows it received)."""
    h = hybrid_handle
    T, K = interop.shape_of(h.topk_idx)
    if not T:
        return
    area = feat.area
    kernels.weights.launch(max(1, min(MAX_WEIGHT_BLOCKS, -(-T // WEIGHT_THREADS))), WEIGHT_THREADS, stream=stream,
                           topk_idx=h.topk_idx, num_tokens=T, num_topk=K, experts_per_domain=h.num_experts // feat.N,
                           num_domains=feat.N, domain=feat.domain, num_max_tokens=h.num_max_tokens_per_rank,
                           domain_pos=h.domain_pos, combined_weights=h.keep_combine[1], hidden=hidden,
                           rail_base=feat.rails.base, recv_offset=area.recv_offset, region_bytes=area.region_bytes,
                           out_weights=out_weights)
