"""The wait handle `all_gather` returns (features/agrs/feature.py)."""

from typing import Any, Tuple

from ...runtime import interop


class AGRSWaitHandle:
    """Returned by `all_gather`: call it (on the stream that will read the outputs) before using the outputs. It
    launches one small kernel that waits, bounded, until every rank's bytes of that call have arrived."""

    def __init__(self, feature: Any, session_idx: int, epoch: int, meta: int, like: Any,
                 keep_alive: Tuple[Any, ...]):
        self._feature, self._session_idx, self._epoch, self._meta = feature, session_idx, epoch, meta
        self._like, self._keep_alive = like, keep_alive

    def __call__(self) -> None:
        st = self._feature
        buf = st._buf
        if st.session_idx != self._session_idx or not st.plan.is_open:
            raise RuntimeError('this all-gather\'s session was destroyed: call the wait handle before '
                               'destroy_agrs_session() (the outputs are invalid now)')
        st._check_usable()
        stream = interop.current_stream(self._like)
        w = st._wait_launch
        if w is None:       # bound by name once; per call the epoch and meta change
            w = st._wait_launch = st.kernels['wait'].bind(
                1, 32, peer_bases=buf.sym.peer_bases_ptr, rank=buf.sym.local_idx, epoch=0, meta=0,
                error_record=buf.host_mapped.ptr, timeout_ns=buf.timeout_ns)
            st._wait_idx = (w.index('epoch'), w.index('meta'))
        w.u32[st._wait_idx[0]], w.u32[st._wait_idx[1]] = self._epoch, self._meta
        w(stream)
        self._keep_alive = ()
