"""Kernel declarations of the EP families (`kernels_cu/ep_notify.cu`, `ep_dispatch.cu`, `ep_combine.cu`,
`ep_fused.cu`) and the specialisations a buffer can request.

The kernels are templated on the number of scale-up ranks and on a top-k bucket (the smallest of
`constants.TOPK_BUCKETS` that holds the exact top-k); the exact top-k is a run-time argument, `num_topk` ("top-k
buckets" in kernels_cu/common/ep.cuh). 8 rank counts x 6 buckets keep the shipped set small enough to compile in CI.
"""

from typing import Dict, List

import numpy as np

from ...constants import NUM_MAX_LOCAL_EXPERTS, NUM_MAX_TOPK, TOPK_BUCKETS
from ...jit.launch import PTR, KernelSpec, Param, load_kernels
from ...runtime.host_range import value_range_spec
from ...runtime.workspace import EP_CHUNK_SIGNAL, EP_DISPATCH_SIGNAL

NOTIFY_THREADS = 256      # kernels_cu/ep_notify.cu kNotifyThreads (= tokens per block)
DISPATCH_THREADS = 512    # kernels_cu/ep_dispatch.cu kDispatchThreads
PHASE_SEND, PHASE_RECV = 1, 2                       # kernels_cu/ep_dispatch.cu kPhaseSend, kPhaseRecv
COMBINE_THREADS = 512
COMBINE_CHUNK_ROWS = 16                             # rows per released chunk of the combine (kernels_cu/ep_combine.cu)
COMBINE_CHUNK_SIGNAL_BYTES = EP_CHUNK_SIGNAL.num_bytes   # kernels_cu/common/ep.cuh kChunkSignalBytes
NUM_MAX_CHANNELS = 128                              # kernels_cu/common/ep.cuh kNotifyMaxChannels (DeepEP V1 channels)
HOST_MAX_TOKENS_WORD = 3 + NUM_MAX_LOCAL_EXPERTS      # kernels_cu/ep_notify.cu kHostMaxTokensWord (in the host counts)
DISPATCH_CHUNK_SIGNAL_BYTES = EP_DISPATCH_SIGNAL.num_bytes   # kernels_cu/common/ep.cuh kDispatchSignalBytes
SUPPORTED_TOPK = tuple(range(1, NUM_MAX_TOPK + 1))


_P = Param
_COMMON_TAIL = (_P('peer_bases', PTR), _P('rank', np.int32))
_ERR = (_P('error_record', PTR), _P('timeout_ns', np.uint64))


def notify_spec(num_ranks: int, bucket: int) -> KernelSpec:
    return KernelSpec('ep_notify', f'deepep::notify_dispatch<{num_ranks}, {bucket}>', (
        _P('topk_idx', PTR), _P('num_tokens', np.int32), _P('num_topk', np.int32), _P('num_experts', np.int32),
        _P('num_max_tokens_per_rank', np.int32), _P('expert_alignment', np.int32), *_COMMON_TAIL, *_ERR,
        _P('scratch', PTR), _P('send_pos', PTR), _P('send_expert_pos', PTR), _P('recv_layout', PTR),
        _P('psum_recv_per_expert', PTR), _P('do_expand', np.int32), _P('cumulative_stats', PTR),
        _P('host_counts', PTR), _P('host_seq', np.int32), _P('topk_copy', PTR), _P('reported_num_tokens', np.int32),
        _P('expert_counts', PTR), _P('num_channels', np.int32), _P('channel_prefix_matrix', PTR),
        _P('recv_channel_prefix_matrix', PTR), _P('rank_prefix_matrix', PTR), _P('token_of_slot', PTR),
        _P('send_count', PTR)))


def topk_range_spec() -> KernelSpec:
    return value_range_spec('ep_notify', 'long long')


def dispatch_spec(num_ranks: int, bucket: int) -> KernelSpec:
    """The dispatch kernel: senders and receivers in one launch, or either role alone (`phases`). `ready`,
    `ready_mod`: the readiness guard of hybrid P2 (`EP.ready_guard`; 0: off)."""
    return KernelSpec('ep_dispatch', f'deepep::dispatch_impl_with_dispatch_copy_epilogue_impl<{num_ranks}, {bucket}>', (
        _P('x', PTR), _P('x_row_bytes', np.int64), _P('hidden_bytes', np.int32), _P('sf', PTR),
        _P('sf_stride_token', np.int64), _P('sf_stride_col', np.int64), _P('num_sf', np.int32), _P('topk_idx', PTR),
        _P('topk_weights', PTR), _P('send_expert_pos', PTR), _P('token_of_slot', PTR), _P('send_count', PTR),
        _P('recv_layout', PTR), _P('num_tokens', np.int32), _P('num_topk', np.int32), _P('num_experts', np.int32),
        _P('num_max_tokens_per_rank', np.int32), _P('do_expand', np.int32), _P('do_zero_padding', np.int32),
        _P('num_out_rows', np.int32), _P('num_meta_rows', np.int32), _P('recv_x', PTR), _P('recv_sf', PTR),
        _P('recv_sf_stride_row', np.int64), _P('recv_sf_stride_col', np.int64), _P('recv_topk_idx', PTR),
        _P('recv_topk_weights', PTR), _P('recv_src_metadata', PTR), _P('recv_src_idx', PTR), _P('phases', np.int32),
        _P('num_send_blocks', np.int32), _P('chunk_rows', np.int32), _P('chunk_stride', np.int32), *_COMMON_TAIL,
        _P('recv_offset', np.uint64), *_ERR, _P('ready', PTR), _P('ready_mod', np.int32)))


def fused_dispatch_spec(num_ranks: int, bucket: int) -> KernelSpec:
    """The notify and the dispatch in one launch (`kernels_cu/ep_fused.cu`, `DEEPEP_CUPY_EP_FUSED_NOTIFY`): the
    union of the two kernels' parameters (same names) and `num_notify_blocks`."""
    return KernelSpec('ep_fused', f'deepep::fused_notify_and_dispatch<{num_ranks}, {bucket}>', (
        _P('x', PTR), _P('x_row_bytes', np.int64), _P('hidden_bytes', np.int32), _P('sf', PTR),
        _P('sf_stride_token', np.int64), _P('sf_stride_col', np.int64), _P('num_sf', np.int32), _P('topk_idx', PTR),
        _P('topk_weights', PTR), _P('num_tokens', np.int32), _P('num_topk', np.int32), _P('num_experts', np.int32),
        _P('num_max_tokens_per_rank', np.int32), _P('expert_alignment', np.int32), _P('scratch', PTR),
        _P('send_pos', PTR), _P('send_expert_pos', PTR), _P('token_of_slot', PTR), _P('send_count', PTR),
        _P('recv_layout', PTR), _P('psum_recv_per_expert', PTR), _P('do_expand', np.int32),
        _P('cumulative_stats', PTR), _P('host_counts', PTR), _P('host_seq', np.int32), _P('topk_copy', PTR),
        _P('reported_num_tokens', np.int32), _P('expert_counts', PTR), _P('num_channels', np.int32),
        _P('channel_prefix_matrix', PTR), _P('recv_channel_prefix_matrix', PTR), _P('rank_prefix_matrix', PTR),
        _P('do_zero_padding', np.int32), _P('num_out_rows', np.int32), _P('num_meta_rows', np.int32),
        _P('recv_x', PTR), _P('recv_sf', PTR), _P('recv_sf_stride_row', np.int64), _P('recv_sf_stride_col', np.int64),
        _P('recv_topk_idx', PTR), _P('recv_topk_weights', PTR), _P('recv_src_metadata', PTR), _P('recv_src_idx', PTR),
        _P('num_send_blocks', np.int32), _P('num_notify_blocks', np.int32), _P('chunk_rows', np.int32),
        _P('chunk_stride', np.int32), *_COMMON_TAIL, _P('recv_offset', np.uint64), *_ERR))


def dispatch_chunk_rows(num_max_tokens_per_rank: int, num_ranks: int) -> int:
    """Slots per released chunk of a dispatch: 4 to 16 (about M / 32, so that decode-size calls still spread over
    the sending blocks), more when the signals of M slots would not fit their workspace region. A function of values
    every rank shares (the receivers compute a slot's chunk with the sender's chunk size)."""
    rows = min(16, max(4, -(-num_max_tokens_per_rank // 32)))
    while num_ranks * -(-num_max_tokens_per_rank // rows) * 4 > DISPATCH_CHUNK_SIGNAL_BYTES:
        rows *= 2
    return rows


def _b(flag: bool) -> str:
    return 'true' if flag else 'false'


def combine_spec(num_ranks: int, bucket: int, local_reduce: bool) -> KernelSpec:
    return KernelSpec('ep_combine', f'deepep::combine_impl_with_combine_reduce_epilogue_impl<{num_ranks}, {bucket}, '
                                    f'{_b(local_reduce)}>', (
        _P('x', PTR), _P('hidden', np.int32), _P('topk_weights', PTR), _P('do_expand', np.int32),
        _P('recv_src_metadata', PTR), _P('recv_layout', PTR), _P('send_pos', PTR), _P('topk_idx', PTR),
        _P('num_tokens', np.int32), _P('num_topk', np.int32), _P('num_experts', np.int32),
        _P('num_max_tokens_per_rank', np.int32), _P('num_slots', np.int32), _P('bias0', PTR), _P('bias1', PTR),
        _P('combined_x', PTR), _P('combined_topk_weights', PTR), _P('with_weights', np.int32),
        _P('weights_over_ranks', np.int32), _P('num_send_blocks', np.int32), _P('chunk_rows', np.int32),
        _P('chunk_stride', np.int32), *_COMMON_TAIL, _P('combine_offset', np.uint64), *_ERR))


def specs_for(num_ranks: int, bucket: int, fused: bool = True) -> Dict[str, List[KernelSpec]]:
    """Every EP kernel a buffer of `num_ranks` ranks needs for a top-k in `bucket`, by family (with the fused notify
    and dispatch unless `fused` is False)."""
    specs = {
        'ep_notify': [notify_spec(num_ranks, bucket), topk_range_spec()],
        'ep_dispatch': [dispatch_spec(num_ranks, bucket)],
        'ep_combine': [combine_spec(num_ranks, bucket, lr) for lr in (True, False)],
    }
    if fused:
        specs['ep_fused'] = [fused_dispatch_spec(num_ranks, bucket)]
    return specs


def shipped_specs(max_ranks: int) -> Dict[str, List[KernelSpec]]:
    """Family name → every EP specialisation for 1 to `max_ranks` ranks and every top-k bucket."""
    out: Dict[str, List[KernelSpec]] = {}
    for n in range(1, max_ranks + 1):
        for bucket in TOPK_BUCKETS:
            for family, family_specs in specs_for(n, bucket).items():
                known = out.setdefault(family, [])
                known.extend(s for s in family_specs if s not in known)    # shared kernels (topk_range) once
    return out


class EPKernels:
    """The loaded EP kernels for one (num_ranks, top-k bucket); the fused one on request (`fused_dispatch`)."""

    def __init__(self, num_ranks: int, bucket: int):
        self.num_ranks, self.bucket = num_ranks, bucket
        self._fused = None
        loaded = {}
        for family_specs in specs_for(num_ranks, bucket, fused=False).values():
            loaded.update(load_kernels(family_specs))
        self.notify = loaded[notify_spec(num_ranks, bucket).name]
        self.topk_range = loaded[topk_range_spec().name]
        self.dispatch = loaded[dispatch_spec(num_ranks, bucket).name]
        self.combine = {lr: loaded[combine_spec(num_ranks, bucket, lr).name] for lr in (True, False)}

    def fused_dispatch(self):
        """The notify and the dispatch in one kernel (`DEEPEP_CUPY_EP_FUSED_NOTIFY`), loaded on first use."""
        if self._fused is None:
            spec = fused_dispatch_spec(self.num_ranks, self.bucket)
            self._fused = load_kernels([spec])[spec.name]
        return self._fused
