"""Constants and kernel declarations of the all-gather / reduce-scatter family (`kernels_cu/agrs.cu`)."""

from typing import Dict, List

import numpy as np

from ...constants import NUM_MAX_SCALEUP_RANKS
from ...jit.launch import PTR, KernelSpec, Param
from ...runtime import workspace

# Workspace bytes [CTRL_OFFSET, CTRL_OFFSET + CTRL_BYTES) hold this feature's control words (kernels_cu/agrs.cu).
CTRL_OFFSET, CTRL_BYTES = workspace.AGRS
THREADS = 512                   # kAgrsThreads
GATHER_UNROLL = 4               # kAgrsGatherUnroll
REGION_ALIGNMENT = 32           # each gather region is align(R * num_bytes, 32)
REDUCE_AREA_ALIGNMENT = 4096    # the reduction area starts at align(num_max_session_bytes, 4096)
MAX_GATHERS_PER_SESSION = 32    # kAgrsMetaSlots: a session never spans more gather epochs than meta slots
GATHER_BATCH = 8                # kAgrsGatherBatch: tensors per agrs_gather_batch_kernel launch
MAX_SENDERS = 32                # kAgrsMaxSenders
MAX_ROUNDS = 65535              # rounds per sender block (chunk flags hold (epoch << 32) + round + 1)
GROUP_ELEMS = 8                 # reductions work on groups of 8 elements; shards start at multiples of 8
CHUNK_MIN_ELEMS, CHUNK_MAX_ELEMS = 2048, 32768
DEFAULT_GATHER_SMS = 32
DEFAULT_REDUCE_SMS = 64
SENDER_SHARE = (1, 2)           # share of a reduction's blocks that send (at most MAX_SENDERS); the rest reduce
# `aux` of an error record (kernels_cu/agrs.cu): which wait gave up.
AUX_NAMES = {1: 'all-gather signal', 2: 'all-gather size mismatch (ranks gathered different sizes)',
             3: 'reduction slots free (previous reduction done)', 4: 'reduce-scatter chunk', 5: 'all-reduce shard'}
COMM_PRECISIONS = ('fp32', 'bf16')
# Hybrid mode: the rail area, workspace region AGRS_RAIL (kernels_cu/agrs.cu kAgrsRail*): the loopback transport's
# flags from 0, the send header, the effective meta word, the receive headers (16 bytes per domain).
RAIL_OFFSET, RAIL_BYTES = workspace.AGRS_RAIL
RAIL_SEND_HEADER, RAIL_META_WORD, RAIL_RECV_HEADER = 2304, 2432, 2560
MAX_DOMAINS = 16                # receive headers that fit the rail area
META_MISMATCH, META_SKIP = 0xFFFFFFFE, 0xFFFFFFFF

_P = Param
_ERR = (_P('error_record', PTR), _P('timeout_ns', np.uint64))
# (input bfloat16, staging bfloat16) pairs the reduce kernel is instantiated for.
REDUCE_VARIANTS = ((False, False), (False, True), (True, True))


def _b(flag: bool) -> str:
    return 'true' if flag else 'false'


def gather_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('agrs', f'deepep::agrs_gather_kernel<{num_ranks}>', (
        _P('src', PTR), _P('num_bytes', np.int64), _P('region_offset', np.uint64), _P('peer_bases', PTR),
        _P('rank', np.int32), _P('write_local', np.int32), _P('do_signal', np.int32), _P('epoch', np.uint32),
        _P('meta', np.uint32), _P('meta_word', PTR)))


def gather_batch_spec(num_ranks: int) -> KernelSpec:
    """Up to GATHER_BATCH tensors per launch: the descriptor table (src, num_bytes, region_offset per slot) by value,
    one scalar parameter per field, grouped by field so that the sizes and offsets of a call are one contiguous run
    of the argument block (features/agrs/feature.py copies them in one slice)."""
    slots = range(GATHER_BATCH)
    return KernelSpec('agrs', f'deepep::agrs_gather_batch_kernel<{num_ranks}>', (
        *[_P(f'src{i}', PTR) for i in slots], *[_P(f'num_bytes{i}', np.int64) for i in slots],
        *[_P(f'region_offset{i}', np.uint64) for i in slots], _P('num_tensors', np.int32),
        _P('write_local_mask', np.uint32), _P('peer_bases', PTR), _P('rank', np.int32), _P('do_signal', np.int32),
        _P('epoch', np.uint32), _P('meta', np.uint32)))


def wait_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('agrs', f'deepep::agrs_wait_kernel<{num_ranks}>', (
        _P('peer_bases', PTR), _P('rank', np.int32), _P('epoch', np.uint32), _P('meta', np.uint32), *_ERR))


def reduce_spec(num_ranks: int, in_bf16: bool, stage_bf16: bool) -> KernelSpec:
    return KernelSpec('agrs', f'deepep::agrs_reduce_kernel<{num_ranks}, {_b(in_bf16)}, {_b(stage_bf16)}>', (
        _P('x', PTR), _P('out', PTR), _P('num_elems', np.int64), _P('shard_elems', np.int64),
        _P('chunk_elems', np.int64), _P('scale', np.float32), _P('num_senders', np.int32), _P('peer_bases', PTR),
        _P('rank', np.int32), _P('recv_offset', np.uint64), _P('slot_bytes', np.uint64),
        _P('gather_offset', np.uint64), _P('gather_slot_bytes', np.uint64), _P('is_all_reduce', np.int32),
        _P('epoch', np.uint32), *_ERR))


def unpack_spec(num_ranks: int) -> KernelSpec:
    return KernelSpec('agrs', f'deepep::agrs_unpack_kernel<{num_ranks}>', (
        _P('x', PTR), _P('num_elems', np.int64), _P('shard_elems', np.int64), _P('peer_bases', PTR),
        _P('rank', np.int32), _P('gather_offset', np.uint64), _P('gather_slot_bytes', np.uint64),
        _P('epoch', np.uint32), _P('publish_done', np.int32), *_ERR))


def rail_meta_spec() -> KernelSpec:
    return KernelSpec('agrs', 'deepep::agrs_rail_meta_kernel', (
        _P('rail', PTR), _P('num_domains', np.int32), _P('domain', np.int32), _P('meta', np.uint32),
        _P('mode', np.int32), _P('peer_bases', PTR), _P('rank', np.int32)))


def permute_spec(in_bf16: bool) -> KernelSpec:
    return KernelSpec('agrs', f'deepep::agrs_hybrid_permute_kernel<{_b(in_bf16)}>', (
        _P('x', PTR), _P('xp', PTR), _P('shard_elems', np.int64), _P('num_domains', np.int32),
        _P('num_scaleup', np.int32)))


def sum_spec(out_bf16: bool) -> KernelSpec:
    return KernelSpec('agrs', f'deepep::agrs_hybrid_sum_kernel<{_b(out_bf16)}>', (
        _P('out', PTR), _P('own', PTR), _P('slots', PTR), _P('slot_bytes', np.uint64), _P('num_domains', np.int32),
        _P('domain', np.int32), _P('num_elems', np.int64), _P('scale', np.float32)))


def hybrid_specs() -> List[KernelSpec]:
    """The kernels of hybrid mode (independent of the domain size)."""
    return [rail_meta_spec(), permute_spec(False), permute_spec(True), sum_spec(False), sum_spec(True)]


def all_specs(num_ranks: int) -> List[KernelSpec]:
    """Every specialisation a buffer of `num_ranks` scale-up ranks may request."""
    return ([gather_spec(num_ranks), gather_batch_spec(num_ranks), wait_spec(num_ranks)]
            + [reduce_spec(num_ranks, i, s) for i, s in REDUCE_VARIANTS] + [unpack_spec(num_ranks)])


def shipped_specs(max_ranks: int = NUM_MAX_SCALEUP_RANKS) -> Dict[str, List[KernelSpec]]:
    """Family name → every `KernelSpec` of this feature for 1 to `max_ranks` ranks."""
    return {'agrs': [s for n in range(1, max_ranks + 1) for s in all_specs(n)] + hybrid_specs()}
