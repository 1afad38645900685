"""Turning the kernels' host-mapped error record into Python exceptions (layout in kernels_cu/common/types.cuh)."""

import numpy as np

ERROR_RECORD_WORDS = 8
PHASES = {1: 'barrier', 2: 'test ring', 3: 'notify', 4: 'dispatch', 5: 'combine', 6: 'peer copy', 7: 'pp send/recv',
          8: 'all-gather/reduce-scatter', 9: 'engram', 10: 'load balancing', 11: 'bucket collective',
          12: 'hybrid rail exchange', 13: 'DeepEP V1 internode handle exchange'}
PHASE_HYBRID_RAIL = 12     # kernels_cu/hybrid.cu: ranks in the record are global already
RAIL_EXCHANGES = {1: 'notify', 2: 'dispatch', 3: 'combine', 4: 'barrier', 5: 'all-gather', 6: 'reduce-scatter',
                  7: 'all-reduce'}
PHASE_DISPATCH = 4
AUX_RAIL_READY = 224       # kernels_cu/ep_dispatch.cu kAuxRailReady: the hybrid pipeline's rows-ready guard


def describe(record: np.ndarray, rank_base: int = 0) -> str:
    """The record in words; `rank_base` turns a domain's scale-up indices into global ranks (hybrid mode)."""
    code = int(record[1])
    phase = PHASES.get(code, f'phase {code}')
    if code == PHASE_HYBRID_RAIL:
        phase += f' ({RAIL_EXCHANGES.get(int(record[6]), "?")})'
        rank_base = 0
    elif code == PHASE_DISPATCH and int(record[6]) == AUX_RAIL_READY:
        phase += ' (hybrid pipeline: rail rows not ready; its rail exchange stalled)'
    return (f'{phase}: rank {int(record[2]) + rank_base} waited for rank {int(record[3]) + rank_base} and gave up '
            f'(expected signal {int(record[4])}, last seen {int(record[5])}, aux {int(record[6])})')


def raise_if_timed_out(record: np.ndarray, timeout_secs: float, rank: int, rank_base: int = 0) -> None:
    """Raise `TimeoutError` if a kernel reported a timeout in `record` (int32 `[8]`, host-mapped)."""
    state = int(record[0])
    if state == 0:
        return
    if state == -1:     # the writer is still filling the record in; it finishes within microseconds
        import time
        time.sleep(0.01)
    raise TimeoutError(f'deepep_cupy rank {rank}: GPU wait timed out after {timeout_secs:g} s in '
                       f'{describe(record, rank_base)}. '
                       f'A peer rank is missing, hung or called a different operation; destroy this buffer.')
