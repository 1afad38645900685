"""`EPSettings`: what the EP plans (plan.py, dispatch_checks.py) know of the buffer, as plain values."""

from dataclasses import dataclass


@dataclass(frozen=True)
class EPSettings:
    """What the plans know of the buffer (plain values)."""
    device: int                        # this rank's CUDA device (-1 in CPU tests)
    num_ranks: int                     # R: ranks of the scale-up domain
    rank: int                          # this rank's index in it
    owner_id: int                      # identity of the EP component (a handle names the buffer that made it)
    num_max_tokens_per_rank: int       # the buffer's default M
    num_topk: int                      # the buffer's top-k (0: any up to 32)
    num_bytes: int                     # bytes of the data region
    data_offset: int                   # where the data region starts in the symmetric buffer
    sym_num_bytes: int                 # end of the data region in the symmetric buffer (its size without extras)
    num_device_sms: int
    allow_multiple_reduction: bool
    prefer_overlap_with_compute: bool
    nvlink_gbs: float
    default_num_sms: int = 0           # SMs of a dispatch given num_sms=0 (`ElasticBuffer.set_num_sms`; 0: the policy)
