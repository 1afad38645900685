"""DeepEP V1's `Config` (the performance tuning record of normal-mode calls) and its default tables.

Only `num_sms` means something here: the blocks that send in a dispatch or combine (and V1's channel count,
`num_sms // 2`, of the handle's channel matrices). The chunk sizes are accepted and checked as V1 checks them, and
drive the size hints: V1 streams tokens through per-channel rings of `num_max_nvl_chunked_recv_tokens` slots, this
library needs a slot per token, so the hints size a buffer with one slot for each token V1's rings would hold in
flight (`num_sms // 2 * num_max_nvl_chunked_recv_tokens` tokens per rank). Any token count works with any buffer:
a dispatch that needs more slots grows the buffer (see `normal.py`).
"""

import operator
from typing import Any, Dict, Tuple

from ..constants import NUM_MAX_TOPK
from ..features.ep import layout as ep_layout
from ..features.hybrid import plan as hybrid_plan
from ..runtime.checks import check_int
from ..runtime.sizes import align

NUM_MAX_NVL_PEERS = 8

# DeepEP's tables at HEAD (`deep_ep/buffers/legacy.py`): ranks -> (nvl send, nvl recv, rdma send, rdma recv).
DISPATCH_TABLE: Dict[int, Tuple[int, int, int, int]] = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}
COMBINE_TABLE: Dict[int, Tuple[int, int, int, int]] = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}
# Rank counts this library runs that DeepEP's intranode kernels do not (1, 3, 5, 6, 7): the row of the next
# DeepEP size up (the values only feed the size hints).
EXTRA_RANKS = {1: 2, 3: 4, 5: 8, 6: 8, 7: 8}


def _count(name: str, value: Any) -> int:
    """A positive integer (Python or numpy); TypeError / ValueError naming `name` otherwise."""
    if isinstance(value, bool):
        raise TypeError(f'{name} must be an int, got {value!r}')
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f'{name} must be an int, got {type(value).__name__} ({value!r})') from None
    return check_int(name, value, 1)


class Config:
    """DeepEP V1's performance config of normal-mode calls.

    Args:
        num_sms: SMs of a dispatch or combine (the send blocks here); even.
        num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens: V1's NVLink chunk and ring sizes
            (send < recv); here they only size the hints.
        num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens: V1's RDMA chunk and ring sizes (recv is
            rounded up to a multiple of send; send <= recv / 2); accepted (the rails between domains move a call's
            rows at once).
    """

    __slots__ = ('num_sms', 'num_max_nvl_chunked_send_tokens', 'num_max_nvl_chunked_recv_tokens',
                 'num_max_rdma_chunked_send_tokens', 'num_max_rdma_chunked_recv_tokens')

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        for name, value in (('num_sms', num_sms), ('num_max_nvl_chunked_send_tokens', num_max_nvl_chunked_send_tokens),
                            ('num_max_nvl_chunked_recv_tokens', num_max_nvl_chunked_recv_tokens),
                            ('num_max_rdma_chunked_send_tokens', num_max_rdma_chunked_send_tokens),
                            ('num_max_rdma_chunked_recv_tokens', num_max_rdma_chunked_recv_tokens)):
            _count(name, value)
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            raise ValueError(f'num_max_nvl_chunked_send_tokens ({num_max_nvl_chunked_send_tokens}) must be below '
                             f'num_max_nvl_chunked_recv_tokens ({num_max_nvl_chunked_recv_tokens})')
        rdma_recv = align(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        if num_max_rdma_chunked_send_tokens > rdma_recv // 2:
            raise ValueError(f'num_max_rdma_chunked_send_tokens ({num_max_rdma_chunked_send_tokens}) must be at most '
                             f'half of num_max_rdma_chunked_recv_tokens ({rdma_recv})')
        self.num_sms = operator.index(num_sms)
        self.num_max_nvl_chunked_send_tokens = operator.index(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = operator.index(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = operator.index(num_max_rdma_chunked_send_tokens)
        self.num_max_rdma_chunked_recv_tokens = operator.index(rdma_recv)

    @property
    def num_channels(self) -> int:
        """V1's channels: `num_sms // 2` (each channel a sending and a receiving SM there)."""
        return self.num_sms // 2

    def hint_tokens(self) -> int:
        """Token slots per rank the hints size for: what V1's NVLink rings hold in flight."""
        return max(1, self.num_channels) * self.num_max_nvl_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """`num_nvl_bytes` for this config: this library's bytes for `hint_tokens()` tokens per rank of
        `hidden_bytes // 2` bfloat16 elements (V1's convention: `hidden_bytes = hidden * max(element_size, 2)`) and
        any top-k up to 32, a multiple of 2 MiB. A buffer of this size works for any token count (larger dispatches
        grow it once). More than 8 ranks (DeepEP's internode mode, nodes of 8): the intranode part of the hybrid
        engine, which holds `num_ranks // 8` times the tokens (every node's rail rows)."""
        check_int('hidden_bytes', hidden_bytes, 1)
        check_int('num_ranks', num_ranks, 1)
        hidden = align(hidden_bytes, 16) // 2
        num_nodes = max(1, num_ranks // NUM_MAX_NVL_PEERS)
        return ep_layout.buffer_size_hint(min(num_ranks, NUM_MAX_NVL_PEERS), num_nodes * self.hint_tokens(), hidden,
                                          0)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """`num_rdma_bytes` of normal mode: 0 inside one NVLink domain (<= 8 ranks: no RDMA buffer is needed); more
        than 8 ranks: the hybrid engine's rail memory for `hint_tokens()` tokens per rank (nodes of 8; it bounds
        the rail memory, `internode.py`), a multiple of 2 MiB."""
        check_int('hidden_bytes', hidden_bytes, 1)
        check_int('num_ranks', num_ranks, 1)
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        hidden = align(hidden_bytes, 16) // 2
        return hybrid_plan.rail_area(num_ranks // NUM_MAX_NVL_PEERS, self.hint_tokens(), hidden,
                                     NUM_MAX_TOPK).total_bytes

    def __repr__(self) -> str:
        return (f'Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}'
                f', num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, '
                f'num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, '
                f'num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})')


def table_config(table: Dict[int, Tuple[int, int, int, int]], num_ranks: int, num_sms: int) -> Config:
    """DeepEP's recommended config for `num_ranks` (its table, plus the rank counts of `EXTRA_RANKS`);
    ValueError for a rank count neither knows."""
    check_int('num_ranks', num_ranks, 1)
    row = table.get(num_ranks) or table.get(EXTRA_RANKS.get(num_ranks, -1))
    if row is None:
        raise ValueError(f'Unsupported number of EP ranks: {num_ranks} (DeepEP\'s tables cover '
                         f'{sorted(set(table) | set(EXTRA_RANKS))})')
    return Config(num_sms, *row)
