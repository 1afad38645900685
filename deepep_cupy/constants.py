"""Constants shared by the Python layer and the kernels (the kernels receive them as template arguments)."""

# dtype of top-k expert indices (DeepEP's default build: int64); as a torch dtype name.
topk_idx_t = 'int64'

# Every symmetric allocation is a multiple of this (DeepEP's elastic alignment, 2 MiB).
BUFFER_ALIGNMENT = 2 * 1024 * 1024

# At most this many ranks in one scale-up (NVLink) domain.
NUM_MAX_SCALEUP_RANKS = 8
