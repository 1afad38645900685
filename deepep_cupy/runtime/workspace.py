"""Python mirror of `kernels_cu/common/workspace.cuh`: where each user's words live in the symmetric workspace (the
first 2 MiB of every rank's symmetric buffer) and in a buffer's host-mapped memory. tests/test_workspace_cpu.py
reads the header and checks that both tables agree; change them together."""

from typing import Dict, NamedTuple


class Region(NamedTuple):
    """`num_bytes` bytes at byte `offset`."""
    offset: int
    num_bytes: int

    @property
    def end(self) -> int:
        return self.offset + self.num_bytes


# ---- symmetric workspace (kWs<Name>Offset / kWs<Name>Bytes) -----------------------------------------------------
WORKSPACE_BYTES = 2 * 1024 * 1024
BARRIER = Region(0, 512)                    # barrier.cu
ERROR_CLAIM = Region(512, 512)              # common/timeout.cuh
BARRIER_TEST = Region(4096, 4096)           # barrier.cu test kernels
EP_CTRL = Region(8192, 8192)                # common/ep.cuh
PEER_COPY = Region(16384, 4096)             # peer_copy.cu
PP = Region(20480, 4096)                    # pp.cu
AGRS = Region(24576, 4096)                  # agrs.cu
ENGRAM = Region(28672, 2048)                # engram.cu
LB = Region(30720, 2048)                    # lb.cu
BUCKET = Region(32768, 16384)               # bucket.cu (a slice per BucketBuffer communication context)
EP_NOTIFY = Region(65536, 65536)            # common/ep.cuh
EP_CHUNK_SIGNAL = Region(131072, 1 << 20)   # ep_combine.cu
EP_DISPATCH_SIGNAL = Region(1179648, 1 << 19)   # ep_dispatch.cu
AGRS_RAIL = Region(1703936, 4096)           # agrs.cu, hybrid mode: the loopback rail flags and the rail headers

# ---- host-mapped memory (kHost<Name>Offset / kHost<Name>Bytes) --------------------------------------------------
HOST_MAPPED_BYTES = 64 * 1024
HOST_ERROR_RECORD = Region(0, 1024)         # common/types.cuh
HOST_EP_COUNTS = Region(1024, 7168)         # ep_notify.cu
HOST_EP_RANGE = Region(8192, 64)            # common/value_range.cuh (top-k ids)
HOST_ENGRAM_RANGE = Region(8256, 64)        # common/value_range.cuh (engram indices)
HOST_PP_ERROR = Region(8320, 64)            # pp.cu

# The header's names for each region, in address order.
WORKSPACE: Dict[str, Region] = {
    'Barrier': BARRIER, 'ErrorClaim': ERROR_CLAIM, 'BarrierTest': BARRIER_TEST, 'EPCtrl': EP_CTRL,
    'PeerCopy': PEER_COPY, 'PP': PP, 'Agrs': AGRS, 'Engram': ENGRAM, 'LB': LB, 'Bucket': BUCKET,
    'EPNotify': EP_NOTIFY, 'EPChunkSignal': EP_CHUNK_SIGNAL, 'EPDispatchSignal': EP_DISPATCH_SIGNAL,
    'AgrsRail': AGRS_RAIL,
}
HOST_MAPPED: Dict[str, Region] = {
    'ErrorRecord': HOST_ERROR_RECORD, 'EPCounts': HOST_EP_COUNTS, 'EPRange': HOST_EP_RANGE,
    'EngramRange': HOST_ENGRAM_RANGE, 'PPError': HOST_PP_ERROR,
}
