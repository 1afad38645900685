"""The wait handle `all_gather` returns (features/agrs/feature.py)."""

from typing import Any, Optional, Tuple

from ...runtime import interop


class AGRSWaitHandle:
    """Returned by `all_gather`: call it (on the stream that will read the outputs) before using the outputs. It
    launches one small kernel that waits, bounded, until every rank's bytes of that call have arrived.

    The handle keeps the call's sources alive until it is called. `record`: `(stream of the call, communication
    stream)` when the sources are torch tensors that torch's allocator has not been told about yet: the wait kernel
    returns only after this rank's own gather signalled, i.e. after the gather kernels finished reading the sources.
    Called on the stream of the call, the sources' last use is therefore ordered on that stream (as any kernel of it
    would be) and no `record_stream` is needed; called on another stream, or dropped without being called, the
    handle marks them as used on the communication stream first (`record_stream` takes effect when the memory is
    freed, so marking them late is as good as at the launch)."""

    def __init__(self, feature: Any, session_idx: int, epoch: int, meta: int, like: Any,
                 keep_alive: Tuple[Any, ...], record: Optional[Tuple[Any, Any]] = None):
        self._feature, self._session_idx, self._epoch, self._meta = feature, session_idx, epoch, meta
        self._like, self._keep_alive, self._record = like, keep_alive, record

    def _record_streams(self) -> None:
        record, self._record = self._record, None
        if record is not None and self._keep_alive:
            s = interop.torch_stream(record[1].ptr)
            for t in self._keep_alive:
                t.record_stream(s)

    def __del__(self):
        try:
            self._record_streams()
        except Exception:       # interpreter shutdown, or made without __init__: nothing left to protect
            pass

    def __call__(self) -> None:
        st = self._feature
        buf = st._buf
        if st.session_idx != self._session_idx or not st.plan.is_open:
            raise RuntimeError('this all-gather\'s session was destroyed: call the wait handle before '
                               'destroy_agrs_session() (the outputs are invalid now)')
        st._check_usable()
        stream = interop.current_stream(self._like)
        record = self._record
        if record is not None and stream is not record[0] and stream.ptr != record[0].ptr:
            self._record_streams()
        w = st._wait_launch
        if w is None:       # bound by name once; per call the epoch and meta change
            w = st._wait_launch = st.kernels['wait'].bind(
                1, 32, peer_bases=buf.sym.peer_bases_ptr, rank=buf.sym.local_idx, epoch=0, meta=0,
                error_record=buf.host_mapped.ptr, timeout_ns=buf.timeout_ns)
            st._wait_idx = (w.index('epoch'), w.index('meta'))
        w.u32[st._wait_idx[0]], w.u32[st._wait_idx[1]] = self._epoch, self._meta
        w(stream)
        self._record = None
        self._keep_alive = ()
