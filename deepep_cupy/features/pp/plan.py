"""Pipeline-parallel send/recv between ring neighbours (`kernels_cu/pp.cu`): kernel declarations, sizes, the slot
layout and the pair bookkeeping (plain Python, no GPU); the launch path is feature.py.

DeepEP V2's `pp_*` API (`pp_set_config`, `pp_send`, `pp_recv`, `get_pp_buffer_size_hint`). A rank sends
to and receives from its ring neighbours only (rank ± 1 modulo the group size). Every directed pair is a FIFO: the
k-th `pp_recv(x, src)` on rank d receives the k-th `pp_send(t, d)` of rank src, whatever happens in between. The
receiver owns `num_max_inflight_tensors` slots per source neighbour in its symmetric memory; `pp_send` pushes the bytes
straight into the next free slot over NVLink (one kernel) and waits on the GPU, bounded, while all slots are full
(back-pressure: a slot is never overwritten before the receiver copied it out); `pp_recv` waits for the message and
copies it into the tensor. Both run on the buffer's communication stream, ordered after the current stream.
Per-pair counters live on the GPU, so the host launches carry no sequence numbers.

A receiving tensor must have exactly as many bytes as the matching sent tensor. That can only be checked on the
GPU (the size travels in a slot header): on a mismatch nothing is copied, the message is consumed, and the next PP
call on the receiving rank raises `RuntimeError` describing the pair and both sizes.
"""

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ...constants import BUFFER_ALIGNMENT
from ...jit.launch import PTR, KernelSpec, Param
from ...runtime import workspace
from ...runtime.checks import check_int
from ...runtime.sizes import align

# Workspace bytes [CTRL_OFFSET, CTRL_OFFSET + CTRL_BYTES) hold the PP control words (see kernels_cu/pp.cu).
CTRL_OFFSET, CTRL_BYTES = workspace.PP
THREADS = 512                # kPPThreads
UNROLL = 4                   # kPPUnroll
HEADER_BYTES = 16            # kPPHeaderBytes
SLOT_ALIGNMENT = 32          # upstream's PP alignment; also keeps every slot 16-byte aligned for vector stores
HEADER_REGION_ALIGNMENT = 128
NUM_SOURCES = 2              # slot regions per receiver: previous and next rank
NUM_MAX_INFLIGHT_TENSORS = 1 << 16
PHASE_PP = 7                 # kPhasePP
WAIT_SLOT, WAIT_DATA = 1, 2  # aux codes of a PP timeout record (kPPWaitSlot, kPPWaitData)
ERROR_WORDS = 8              # kPPErrorWords
# Control word indices (uint32, kernels_cu/pp.cu): per neighbour index k, word + k.
WORD_NUM_SENT, WORD_NUM_RECV, WORD_SENT_FROM, WORD_CONSUMED_BY = 4, 8, 32, 64
ERROR_RECORD_OFFSET = workspace.HOST_PP_ERROR.offset    # of the PP error record in the buffer's host-mapped memory
DATA_REGION_OWNER = 'PP send/recv'

_P = Param
SEND_SPEC = KernelSpec('pp', 'deepep::pp_send_impl', (
    _P('x', PTR), _P('num_bytes', np.uint64), _P('peer_bases', PTR), _P('rank', np.int32), _P('dst', np.int32),
    _P('dst_slot_idx', np.int32), _P('src_slot_idx_at_dst', np.int32), _P('num_inflight', np.int32),
    _P('headers_offset', np.uint64), _P('slots_offset', np.uint64), _P('slot_bytes', np.uint64),
    _P('error_record', PTR), _P('timeout_ns', np.uint64)))
RECV_SPEC = KernelSpec('pp', 'deepep::pp_recv_impl', (
    _P('x', PTR), _P('num_bytes', np.uint64), _P('peer_bases', PTR), _P('rank', np.int32), _P('src', np.int32),
    _P('src_slot_idx', np.int32), _P('dst_slot_idx_at_src', np.int32), _P('num_inflight', np.int32),
    _P('headers_offset', np.uint64), _P('slots_offset', np.uint64), _P('slot_bytes', np.uint64),
    _P('error_record', PTR), _P('pp_error', PTR), _P('timeout_ns', np.uint64)))

# The NCCL link's helpers (kernels_cu/pp.cu; features/pp/links.py): a bounded one-thread wait on own control words,
# and the counter bump after each NCCL transfer.
WAIT_SPEC = KernelSpec('pp', 'deepep::pp_wait_impl', (
    _P('peer_bases', PTR), _P('rank', np.int32), _P('peer', np.int32), _P('wait_word', np.int32),
    _P('count_word', np.int32), _P('delta', np.int32), _P('aux', np.int32), _P('error_record', PTR),
    _P('timeout_ns', np.uint64)))
BUMP_SPEC = KernelSpec('pp', 'deepep::pp_bump_impl', (_P('word', PTR),))


def all_specs() -> List[KernelSpec]:
    """Every specialisation of the family (the kernels are not templated on the number of ranks)."""
    return [SEND_SPEC, RECV_SPEC, WAIT_SPEC, BUMP_SPEC]


def shipped_specs() -> Dict[str, List[KernelSpec]]:
    """Family name → every `KernelSpec` PP may load, for any group of 1 to 8 ranks."""
    return {'pp': all_specs()}


def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
    """Symmetric bytes (2 MiB aligned) for PP: `align(align(bytes, 32) * inflight * 2 * 2, 2 MiB)`, DeepEP's
    formula (send and receive buffers for the previous and the next rank). This implementation keeps receive slots
    only and needs about half of it (`PPLayout.num_bytes`); the hint is kept so sizes match upstream."""
    check_int('num_max_tensor_bytes', num_max_tensor_bytes, 1)
    check_int('num_max_inflight_tensors', num_max_inflight_tensors, 1)
    return align(align(num_max_tensor_bytes, SLOT_ALIGNMENT) * num_max_inflight_tensors * 2 * 2, BUFFER_ALIGNMENT)


@dataclass(frozen=True)
class PPLayout:
    """Where a receiver keeps its slots (byte offsets from the symmetric base, identical on every rank).

    `[headers: NUM_SOURCES x inflight x HEADER_BYTES, padded][slots: NUM_SOURCES x inflight x slot_bytes]` from
    `data_offset`; source index 0 is the previous rank, 1 the next one (see `neighbour_slot_idx`)."""
    num_max_tensor_bytes: int
    num_max_inflight_tensors: int
    data_offset: int

    @property
    def slot_bytes(self) -> int:
        return align(self.num_max_tensor_bytes, SLOT_ALIGNMENT)

    @property
    def headers_offset(self) -> int:
        return self.data_offset

    @property
    def slots_offset(self) -> int:
        return self.data_offset + align(NUM_SOURCES * self.num_max_inflight_tensors * HEADER_BYTES,
                                         HEADER_REGION_ALIGNMENT)

    @property
    def end_offset(self) -> int:
        return self.slots_offset + NUM_SOURCES * self.num_max_inflight_tensors * self.slot_bytes

    @property
    def num_bytes(self) -> int:
        """Bytes of the data region this layout needs."""
        return self.end_offset - self.data_offset

    def slot_offset(self, source_idx: int, slot: int) -> int:
        return self.slots_offset + (source_idx * self.num_max_inflight_tensors + slot) * self.slot_bytes

    def header_offset(self, source_idx: int, slot: int) -> int:
        return self.headers_offset + (source_idx * self.num_max_inflight_tensors + slot) * HEADER_BYTES


def neighbours(rank_idx: int, num_ranks: int) -> Tuple[int, int]:
    """`(previous, next)` rank of `rank_idx` on the ring of `num_ranks` ranks."""
    return (rank_idx - 1) % num_ranks, (rank_idx + 1) % num_ranks


def neighbour_slot_idx(rank_idx: int, peer_rank_idx: int, num_ranks: int) -> int:
    """Index (0: previous rank, 1: next rank) under which `rank_idx` files its neighbour `peer_rank_idx`. With two
    ranks the previous and the next rank are the same one: index 0. `ValueError` if they are not neighbours."""
    prev_idx, next_idx = neighbours(rank_idx, num_ranks)
    if peer_rank_idx == rank_idx or peer_rank_idx not in (prev_idx, next_idx):
        raise ValueError(f'rank {peer_rank_idx} is not a ring neighbour of rank {rank_idx} ({num_ranks} ranks)')
    return 0 if peer_rank_idx == prev_idx else 1


def unmatched_messages(counts: Sequence[Tuple[Dict[int, int], Dict[int, int]]]) -> List[Tuple[int, int, int, int]]:
    """Directed pairs whose sends and receives differ.

    Args:
        counts: per rank, `(num_sent, num_recv)`: dicts from peer rank to the messages sent to / received from it.

    Returns:
        `(src, dst, num_sent, num_received)` for every pair with pending (or over-received) messages.
    """
    out = []
    for src, (num_sent, _) in enumerate(counts):
        peers = set(num_sent) | {dst for dst, (_, num_recv) in enumerate(counts) if src in num_recv}
        for dst in sorted(peers):
            sent, received = num_sent.get(dst, 0), counts[dst][1].get(src, 0)
            if sent != received:
                out.append((src, dst, sent, received))
    return out


def describe_mismatch(record: Sequence[int], rank_idx: int, rank_base: int = 0) -> str:
    """The message for a PP error record (layout in kernels_cu/pp.cu, `kPPErrorWords`); `rank_base` turns the
    recorded source (a peer-table index: global rank - the domain's first rank) into a global rank."""
    src, seq = int(record[1]) + rank_base, int(record[2]) & 0xFFFFFFFF
    expected = (int(record[3]) & 0xFFFFFFFF) | ((int(record[4]) & 0xFFFFFFFF) << 32)
    sent = (int(record[5]) & 0xFFFFFFFF) | ((int(record[6]) & 0xFFFFFFFF) << 32)
    sent_seq = int(record[7]) & 0xFFFFFFFF
    text = (f'deepep_cupy rank {rank_idx}: pp_recv of message #{seq} from rank {src} got a tensor of {expected} bytes '
            f'but the matching pp_send sent {sent} bytes; nothing was copied into that tensor (sends and receives of '
            f'a pair are matched in call order and must have equal sizes)')
    if sent_seq != seq:
        text += f'. The slot held message #{sent_seq}: the PP protocol lost step (internal error)'
    return text


TIMEOUT_HINT = (f'[PP: aux {WAIT_SLOT} = pp_send found no free slot (the receiver has not called pp_recv for an '
                f'older message), aux {WAIT_DATA} = pp_recv found no message (the sender has not called pp_send); '
                f'expected/seen are message counts of the pair]')
