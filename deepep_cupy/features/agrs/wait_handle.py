"""The wait handle `all_gather` returns (features/agrs/feature.py)."""

from typing import Any, Optional, Tuple

from ...runtime import interop
from ...runtime.streams import DeferredRecord


class AGRSWaitHandle:
    """Returned by `all_gather`: call it (on the stream that will read the outputs) before using the outputs. It
    launches one small kernel that waits, bounded, until every rank's bytes of that call have arrived.

    The handle keeps the call's sources alive until it is called. `deferred`: the torch sources the gather kernels
    read on the communication stream (`runtime/streams.py` `DeferredRecord`): the wait kernel returns only after
    this rank's own gather signalled, i.e. after the gather kernels finished reading the sources, so called on the
    stream of the call the handle orders their last use there and no `record_stream` is needed; called on another
    stream, or dropped uncalled, it marks them as used on the communication stream."""

    def __init__(self, feature: Any, session_idx: int, epoch: int, meta: int, like: Any,
                 keep_alive: Tuple[Any, ...], deferred: Optional[DeferredRecord] = None):
        self._feature, self._session_idx, self._epoch, self._meta = feature, session_idx, epoch, meta
        self._like, self._keep_alive, self._deferred = like, keep_alive, deferred

    def __call__(self) -> None:
        st = self._feature
        buf = st._buf
        if st.session_idx != self._session_idx or not st.plan.is_open:
            raise RuntimeError('this all-gather\'s session was destroyed: call the wait handle before '
                               'destroy_agrs_session() (the outputs are invalid now)')
        if buf._destroyed or buf._failed is not None or buf.error_record[0]:
            st._check_usable()
        stream = interop.current_stream(self._like)
        if self._deferred is not None:
            self._deferred.waited_on(stream)
        w = st._wait_launch
        if w is None:       # bound by name once; per call the epoch and meta change
            w = st._wait_launch = st.kernels['wait'].bind(
                1, 32, peer_bases=buf.sym.peer_bases_ptr, rank=buf.sym.local_idx, epoch=0, meta=0,
                error_record=buf.host_mapped.ptr, timeout_ns=buf.timeout_ns)
            st._wait_idx = (w.index('epoch'), w.index('meta'))
        w.u32[st._wait_idx[0]], w.u32[st._wait_idx[1]] = self._epoch, self._meta
        w(stream)
        self._deferred = None
        self._keep_alive = ()
