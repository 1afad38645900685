"""What `ElasticBuffer` and `EPBuffer` share for several scale-up domains (hybrid mode, features/hybrid): the size of
the intranode part and the composition of the two features (the intranode engine over the domain, laid out for the
forwarder's union input of N * M tokens, under the hybrid feature)."""

import weakref

from ..features.ep import layout as ep_layout
from ..features.ep.feature import EP
from ..features.hybrid.feature import HybridEP


def derived_num_bytes(size_hint, pg, device, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                      use_fp8_dispatch: bool, allow_hybrid_mode: bool, allow_multiple_reduction: bool) -> int:
    """A constructor's `num_bytes` when the caller gave none: the class's `size_hint` (its `get_buffer_size_hint`),
    raised with `allow_hybrid_mode` to what the intranode part needs when the group forms several domains (N * M
    tokens over R ranks; a host collective: it detects the topology, as the buffer will)."""
    if not (num_max_tokens_per_rank and hidden):
        raise ValueError('give num_bytes, or num_max_tokens_per_rank and hidden so the size can be derived')
    num_bytes = size_hint(pg, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, allow_hybrid_mode,
                          allow_multiple_reduction)
    if not allow_hybrid_mode or pg.size <= 1:
        return num_bytes
    from ..runtime.topology import detect_topology, select_device
    topo = detect_topology(pg, select_device(pg, device), True)
    if topo.num_scaleout_ranks <= 1:
        return num_bytes
    return max(num_bytes, ep_layout.buffer_size_hint(topo.num_scaleup_ranks,
                                                     topo.num_scaleout_ranks * num_max_tokens_per_rank, hidden,
                                                     num_topk, allow_multiple_reduction))


def make_hybrid_ep(buf) -> HybridEP:
    """The EP feature of a buffer over several domains (collective: it makes the rails)."""
    if not (buf.num_max_tokens_per_rank and buf.hidden):
        raise ValueError(f'{buf.num_scaleout_ranks} scale-up domains (hybrid mode): give num_max_tokens_per_rank and '
                         f'hidden at construction (they size the rail buffers)')
    proxy = weakref.proxy(buf)
    inner = EP(proxy, buf.num_scaleout_ranks * buf.num_max_tokens_per_rank, buf.hidden, buf.num_topk,
               buf.allow_multiple_reduction, buf.prefer_overlap_with_compute, buf._nvlink_gbs)
    return HybridEP(proxy, inner, buf.num_max_tokens_per_rank, buf.hidden, buf.num_topk)


def release(buf, collective: bool) -> None:
    """`BufferBase._release_extra` of a buffer whose destroyed EP feature (`buf._hybrid`) or all-gather / reduction
    feature (`buf._agrs_rails`) may hold rails."""
    hybrid, buf._hybrid = getattr(buf, '_hybrid', None), None
    agrs_rails, buf._agrs_rails = getattr(buf, '_agrs_rails', None), None      # features/agrs `AGRSRails`
    buf._rail_barrier = None
    if hybrid is not None:
        hybrid.release(collective)
    if agrs_rails is not None:
        agrs_rails.release(collective)


def _transports(buf):
    """The rail transports of a buffer's EP feature (`buf._ep`, a `HybridEP`) and all-gather / reduction feature
    (`buf._agrs_rails`)."""
    ep = getattr(buf, '_ep', None)
    for rails in (ep.rails if isinstance(ep, HybridEP) else None, getattr(buf, '_agrs_rails', None)):
        transport = getattr(rails, 'transport', None)
        if transport is not None:
            yield transport


def failed(buf) -> bool:
    """`BufferBase._transports_failed`: whether a rail transport gave up (aborted after a timeout)."""
    return any(t.aborted for t in _transports(buf))


def check(buf) -> None:
    """`BufferBase._check_transports`: raise a rail transport's failure (its watchdog's error, NCCL's, or that it
    was aborted)."""
    for transport in _transports(buf):
        transport.check()


def abort(buf) -> None:
    """`BufferBase._abort_transports`: abort the rail transports (before the teardown waits for the streams). An
    NCCL transport's watchdog is stopped first, so that it cannot abort the communicator at the same time."""
    for transport in list(_transports(buf)):
        watchdog = getattr(transport, 'watchdog', None)
        if watchdog is not None:
            watchdog.close()
        if not transport.aborted:
            transport.abort()


class RailHooks:
    """`BufferBase`'s teardown and failure hooks for a buffer whose features may hold rails (`ElasticBuffer` and
    `EPBuffer` inherit them, before `BufferBase`)."""

    def _release_extra(self, collective: bool) -> None:
        release(self, collective)

    def _transports_failed(self) -> bool:
        return failed(self)

    def _abort_transports(self) -> None:
        abort(self)

    def _check_transports(self) -> None:
        check(self)
