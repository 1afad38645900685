"""Constants and limits shared by the Python layer and the kernels (the kernels receive them as template arguments or
check them against their own `constexpr`s). One table: a feature imports no other feature, so a limit two features
share lives here. tests/test_kernel_interfaces_cpu.py checks each limit that the kernels also hold against their
C++ value."""

# dtype of top-k expert indices (DeepEP's default build: int64); as a torch dtype name.
topk_idx_t = 'int64'

# Every symmetric allocation is a multiple of this (DeepEP's elastic alignment, 2 MiB).
BUFFER_ALIGNMENT = 2 * 1024 * 1024

# At most this many ranks in one scale-up (NVLink) domain (kernels_cu/common/ep.cuh kNotifyMaxRanks).
NUM_MAX_SCALEUP_RANKS = 8

# At most this many experts per rank (kernels_cu/common/ep.cuh kNotifyMaxLocalExperts: the notify counts).
NUM_MAX_LOCAL_EXPERTS = 1024

# At most this many top-k slots per token (a top-k slot is a lane of a warp).
NUM_MAX_TOPK = 32

# The top-k values the EP and hybrid kernels are compiled for (their kMaxTopk template argument); a call runs in the
# smallest that holds its top-k (`topk_bucket`).
TOPK_BUCKETS = (1, 2, 4, 8, 16, 32)

# Scale factors: at most one 4-byte element per this many channels (float32 scales; packed UE8M0 needs fewer).
SF_GROUP = 128

# NVLink bandwidth (GB/s) the SM-count heuristics assume when nvidia-smi reports no NVLink.
DEFAULT_NVLINK_GBS = 450.0


def topk_bucket(num_topk: int) -> int:
    """The kMaxTopk the kernels are compiled with for a top-k of `num_topk` (1..NUM_MAX_TOPK)."""
    for bucket in TOPK_BUCKETS:
        if num_topk <= bucket:
            return bucket
    raise ValueError(f'num_topk must be in [1, {NUM_MAX_TOPK}], got {num_topk}')
