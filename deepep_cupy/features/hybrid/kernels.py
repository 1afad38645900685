"""Kernel declarations of the composed hybrid path (`kernels_cu/hybrid.cu`) and the loopback transport's stream
signals built on them (`runtime.rails.StreamSignals`)."""

from typing import Dict, List, Sequence

import numpy as np

from ...constants import TOPK_BUCKETS, topk_bucket
from ...jit.launch import PTR, KernelSpec, Param, load_kernels

FAMILY = 'hybrid'
THREADS = 256               # kHybridThreads
ROUTE_THREADS = 1024        # kHybridRouteThreads
MAX_DOMAINS = 16            # kHybridMaxDomains
MAX_SIGNALS = 8             # kHybridMaxSignals: rail peers one signal / wait launch names
MAX_SORT_RUNS = MAX_DOMAINS * 8     # kHybridMaxRuns: domains x ranks of a domain (kNotifyMaxRanks) a sort transposes
PHASE_AUX = {'notify': 1, 'dispatch': 2, 'combine': 3, 'barrier': 4,
             'all-gather': 5, 'reduce-scatter': 6, 'all-reduce': 7}     # the last three: features/agrs

_P = Param
_X = (_P('x', PTR), _P('x_row_bytes', np.int64), _P('hidden_bytes', np.int32), _P('sf', PTR),
      _P('sf_stride_token', np.int64), _P('sf_stride_col', np.int64), _P('num_sf', np.int32), _P('topk_idx', PTR),
      _P('topk_weights', PTR), _P('num_tokens', np.int32), _P('num_topk', np.int32))
_RAIL = (_P('rail_base', PTR),)


def route_spec(bucket: int) -> KernelSpec:
    return KernelSpec(FAMILY, f'deepep::hybrid_route<{bucket}>', (
        _P('topk_idx', PTR), _P('num_tokens', np.int32), _P('num_topk', np.int32),
        _P('experts_per_domain', np.int32), _P('num_domains', np.int32), _P('domain', np.int32),
        _P('domain_pos', PTR), _P('counts', PTR), *_RAIL, _P('send_offset', np.uint64),
        _P('region_bytes', np.uint64)))


def pack_spec(bucket: int) -> KernelSpec:
    return KernelSpec(FAMILY, f'deepep::hybrid_pack<{bucket}>', (
        *_X, _P('domain_pos', PTR), _P('num_domains', np.int32), _P('domain', np.int32), *_RAIL,
        _P('send_offset', np.uint64), _P('region_bytes', np.uint64)))


def report_spec() -> KernelSpec:
    return KernelSpec(FAMILY, 'deepep::hybrid_report', (
        _P('counts', PTR), *_RAIL, _P('recv_offset', np.uint64), _P('region_bytes', np.uint64),
        _P('num_domains', np.int32), _P('domain', np.int32), _P('host_out', PTR), _P('seq', np.int32)))


def unpack_spec(bucket: int) -> KernelSpec:
    return KernelSpec(FAMILY, f'deepep::hybrid_unpack<{bucket}>', (
        _P('mode', np.int32), *_X, _P('experts_per_domain', np.int32), _P('num_domains', np.int32),
        _P('domain', np.int32), _P('num_max_tokens', np.int32), *_RAIL, _P('recv_offset', np.uint64),
        _P('region_bytes', np.uint64), _P('union_x', PTR), _P('union_sf', PTR), _P('union_topk', PTR),
        _P('union_weights', PTR), _P('fwd_src', PTR), _P('fwd_count', PTR)))


def combine_pack_spec() -> KernelSpec:
    return KernelSpec(FAMILY, 'deepep::hybrid_combine_pack', (
        _P('combined_x', PTR), _P('combined_weights', PTR), _P('hidden', np.int32), _P('num_topk', np.int32),
        _P('fwd_src', PTR), _P('fwd_count', PTR), _P('num_domains', np.int32), _P('domain', np.int32),
        _P('num_max_tokens', np.int32), *_RAIL, _P('send_offset', np.uint64), _P('region_bytes', np.uint64)))


def combine_final_spec(bucket: int) -> KernelSpec:
    return KernelSpec(FAMILY, f'deepep::hybrid_combine_final<{bucket}>', (
        _P('topk_idx', PTR), _P('num_tokens', np.int32), _P('num_topk', np.int32),
        _P('experts_per_domain', np.int32), _P('num_domains', np.int32), _P('domain', np.int32),
        _P('num_max_tokens', np.int32), _P('domain_pos', PTR), _P('combined_x', PTR), _P('combined_weights', PTR),
        _P('hidden', np.int32), *_RAIL, _P('recv_offset', np.uint64), _P('region_bytes', np.uint64),
        _P('bias0', PTR), _P('bias1', PTR), _P('num_bias', np.int32), _P('out_x', PTR), _P('out_weights', PTR),
        _P('token_begin', np.int32)))


# ---- P2: the split rows (pipelined dispatch) ---------------------------------------------------------------------
def pack_split_spec(bucket: int) -> KernelSpec:
    return KernelSpec(FAMILY, f'deepep::hybrid_pack_split<{bucket}>', (
        *_X, _P('domain_pos', PTR), _P('num_domains', np.int32), _P('domain', np.int32),
        _P('num_max_tokens', np.int32), *_RAIL, _P('send_offset', np.uint64), _P('region_bytes', np.uint64)))


def unpack_meta_spec(bucket: int) -> KernelSpec:
    return KernelSpec(FAMILY, f'deepep::hybrid_unpack_meta<{bucket}>', (
        _P('num_topk', np.int32), _P('num_sf', np.int32), _P('hidden_bytes', np.int32),
        _P('experts_per_domain', np.int32), _P('num_domains', np.int32), _P('domain', np.int32),
        _P('num_max_tokens', np.int32), *_RAIL, _P('recv_offset', np.uint64), _P('region_bytes', np.uint64),
        _P('union_topk', PTR), _P('union_weights', PTR), _P('fwd_src', PTR), _P('fwd_count', PTR), _P('ready', PTR)))


def unpack_payload_spec() -> KernelSpec:
    return KernelSpec(FAMILY, 'deepep::hybrid_unpack_payload', (
        _P('num_topk', np.int32), _P('num_sf', np.int32), _P('hidden_bytes', np.int32), _P('num_domains', np.int32),
        _P('domain', np.int32), _P('num_max_tokens', np.int32), _P('row_begin', np.int32), _P('row_end', np.int32),
        *_RAIL, _P('recv_offset', np.uint64), _P('region_bytes', np.uint64), _P('union_x', PTR),
        _P('union_sf', PTR)))


def ready_spec() -> KernelSpec:
    return KernelSpec(FAMILY, 'deepep::hybrid_ready', (_P('ready', PTR), _P('value', np.uint32)))


# ---- deterministic=True: DeepEP's row order (deterministic.py) ---------------------------------------------------
def sort_keys_spec() -> KernelSpec:
    return KernelSpec(FAMILY, 'deepep::hybrid_sort_keys', (
        _P('meta', PTR), _P('num_topk', np.int32), _P('num_meta_rows', np.int32), _P('num_recv', PTR),
        _P('keys', PTR), _P('num_rows', np.int32)))


def sort_plan_spec() -> KernelSpec:
    return KernelSpec(FAMILY, 'deepep::hybrid_sort_plan', (
        _P('keys', PTR), _P('key_stride', np.int32), _P('group_end', PTR), _P('num_groups', np.int32),
        _P('alignment', np.int32), _P('num_rows', np.int32), _P('num_domains', np.int32),
        _P('num_scaleup_ranks', np.int32), _P('num_max_tokens', np.int32), _P('row_src', PTR), _P('row_dst', PTR)))


def sort_rows_spec() -> KernelSpec:
    return KernelSpec(FAMILY, 'deepep::hybrid_sort_rows', (
        _P('src', PTR), _P('dst', PTR), _P('index', PTR), _P('num_index', np.int32), _P('num_rows', np.int32),
        _P('num_cols', np.int32), _P('elem_bytes', np.int32), _P('row_stride', np.int64), _P('col_stride', np.int64),
        _P('mode', np.int32)))


def sort_meta_spec() -> KernelSpec:
    return KernelSpec(FAMILY, 'deepep::hybrid_sort_meta', (
        _P('meta', PTR), _P('out', PTR), _P('row_src', PTR), _P('num_index', np.int32), _P('num_rows', np.int32),
        _P('num_topk', np.int32), _P('exp_dst', PTR), _P('num_exp_rows', np.int32), _P('num_domains', np.int32),
        _P('num_scaleup_ranks', np.int32), _P('num_max_tokens', np.int32)))


_ADDRS = tuple(_P(f'a{i}', np.uint64) for i in range(MAX_SIGNALS))
_PEERS = tuple(_P(f'p{i}', np.int32) for i in range(MAX_SIGNALS))


def epoch_begin_spec() -> KernelSpec:
    return KernelSpec(FAMILY, 'deepep::rail_epoch_begin', (_P('epoch', PTR),))


def signal_spec() -> KernelSpec:
    return KernelSpec(FAMILY, 'deepep::rail_signal', (_P('epoch', PTR), _P('num', np.int32), *_ADDRS))


def wait_spec() -> KernelSpec:
    return KernelSpec(FAMILY, 'deepep::rail_wait', (
        _P('epoch', PTR), _P('num', np.int32), _P('aux', np.int32), _P('rank', np.int32), _P('claim', PTR),
        _P('error_record', PTR), _P('timeout_ns', np.uint64), *_ADDRS, *_PEERS))


def specs_for(bucket: int) -> List[KernelSpec]:
    return [route_spec(bucket), pack_spec(bucket), report_spec(), unpack_spec(bucket), combine_pack_spec(),
            combine_final_spec(bucket), epoch_begin_spec(), signal_spec(), wait_spec(), pack_split_spec(bucket),
            unpack_meta_spec(bucket), unpack_payload_spec(), ready_spec(), sort_keys_spec(), sort_plan_spec(),
            sort_rows_spec(), sort_meta_spec()]


def shipped_specs() -> Dict[str, List[KernelSpec]]:
    """Family name -> every specialisation (one per top-k bucket)."""
    out: List[KernelSpec] = []
    for bucket in TOPK_BUCKETS:
        out.extend(s for s in specs_for(bucket) if s not in out)
    return {FAMILY: out}


class HybridKernels:
    """The loaded kernels for one top-k bucket (attributes named after the kernels)."""

    def __init__(self, num_topk: int):
        bucket = topk_bucket(num_topk)
        loaded = load_kernels(specs_for(bucket))
        self.route = loaded[route_spec(bucket).name]
        self.pack = loaded[pack_spec(bucket).name]
        self.report = loaded[report_spec().name]
        self.unpack = loaded[unpack_spec(bucket).name]
        self.combine_pack = loaded[combine_pack_spec().name]
        self.combine_final = loaded[combine_final_spec(bucket).name]
        self.epoch_begin = loaded[epoch_begin_spec().name]
        self.signal = loaded[signal_spec().name]
        self.wait = loaded[wait_spec().name]
        self.pack_split = loaded[pack_split_spec(bucket).name]
        self.unpack_meta = loaded[unpack_meta_spec(bucket).name]
        self.unpack_payload = loaded[unpack_payload_spec().name]
        self.ready = loaded[ready_spec().name]
        self.sort_keys = loaded[sort_keys_spec().name]
        self.sort_plan = loaded[sort_plan_spec().name]
        self.sort_rows = loaded[sort_rows_spec().name]
        self.sort_meta = loaded[sort_meta_spec().name]


def _padded(values: Sequence[int], what: str) -> List[int]:
    values = [int(v) for v in values]
    if len(values) > MAX_SIGNALS:
        raise ValueError(f'a rail signal names at most {MAX_SIGNALS} {what}, got {len(values)}')
    return values + [0] * (MAX_SIGNALS - len(values))


class KernelSignals:
    """`runtime.rails.StreamSignals` on the GPU: the epoch word at `epoch_ptr` (device memory, so CUDA-graph replays
    advance it), release stores and bounded waits that report (hybrid rail, this rank, the peer's global rank).

    Args:
        kernels: an object with `epoch_begin`, `signal`, `wait` launchers (`HybridKernels`, or fakes).
        epoch_ptr: this rank's epoch word (`IpcLoopbackTransport.epoch_word`).
        rank: this rank (global); peer_rank_of_domain: rail member per domain (global ranks).
        claim_ptr, error_record_ptr, timeout_ns: the buffer's error claim word, host-mapped record and GPU bound.
    """

    def __init__(self, kernels, epoch_ptr: int, rank: int, peer_rank_of_domain: Sequence[int], claim_ptr: int,
                 error_record_ptr: int, timeout_ns: int):
        self.k, self.epoch_ptr, self.rank = kernels, int(epoch_ptr), int(rank)
        self.peer_rank_of_domain = [int(g) for g in peer_rank_of_domain]
        self.claim_ptr, self.error_record_ptr, self.timeout_ns = int(claim_ptr), int(error_record_ptr), int(timeout_ns)

    def begin(self, stream) -> None:
        self.k.epoch_begin.launch(1, 1, stream=stream, epoch=self.epoch_ptr)

    def signal(self, addrs, stream) -> None:
        a = _padded(addrs, 'addresses')
        self.k.signal.launch(1, 32, stream=stream, epoch=self.epoch_ptr, num=len(addrs),
                             **{f'a{i}': a[i] for i in range(MAX_SIGNALS)})

    def wait(self, addrs, peers, phase: str, stream) -> None:
        a = _padded(addrs, 'addresses')
        p = _padded([self.peer_rank_of_domain[d] for d in peers], 'peers')
        aux = PHASE_AUX.get(phase.replace('rail ', ''), 0)
        self.k.wait.launch(1, 32, stream=stream, epoch=self.epoch_ptr, num=len(addrs), aux=aux, rank=self.rank,
                           claim=self.claim_ptr, error_record=self.error_record_ptr, timeout_ns=self.timeout_ns,
                           **{f'a{i}': a[i] for i in range(MAX_SIGNALS)}, **{f'p{i}': p[i] for i in range(MAX_SIGNALS)})
