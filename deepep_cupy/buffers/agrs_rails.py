"""The rails of a hybrid buffer's all-gather / reduce-scatter feature (features/agrs, hybrid mode): this rank's
`RailTopology` and rail transport over its symmetric buffer. Made here, in the buffer layer, because it joins two
features: the agrs feature's rail area (features/agrs/kernels.py RAIL_*) and the loopback's stream signals of the
hybrid feature (features/hybrid/kernels.py)."""

from typing import Any, Optional

from .. import envs
from ..features.agrs.kernels import MAX_DOMAINS, RAIL_RECV_HEADER, RAIL_SEND_HEADER
from ..features.hybrid.kernels import MAX_SIGNALS, KernelSignals, epoch_begin_spec, signal_spec, wait_spec
from ..features.hybrid.plan import choose_transport
from ..jit.launch import load_kernels
from ..runtime import workspace
from ..runtime.rail_nccl import NcclRailTransport
from ..runtime.rails import IpcLoopbackTransport, RailGroup, plan_ranges, rail_topology


class AGRSRails:
    """The rails of a hybrid buffer's all-gather / reduction feature: this rank's `RailTopology` and transport over its
    symmetric buffer (made collectively with the feature; `release` after the streams finished).

    Loopback (ranks sharing GPUs): the rail peers map each other's symmetric buffer (`PeerMapping` over the rail), the
    flags live at `rail_offset` (the rail area). NCCL: one communicator per rail over the same buffer.

    Args:
        buf: the buffer; rail_offset: byte offset of the rail area in the symmetric buffer.
        transport: 'nccl', 'loopback' or 'auto' (default: `DEEPEP_CUPY_RAIL_TRANSPORT`).
        nccl, events: the NCCL module and the rail watchdog's event operations for the NCCL transport (defaults:
            `cupy.cuda.nccl`, CUDA events; tests pass fakes).
    """

    def __init__(self, buf, rail_offset: int, transport: Optional[str] = None, nccl: Any = None, events: Any = None):
        self.rails = rail_topology(buf.num_ranks, buf.num_scaleup_ranks, buf.rank_idx)
        self.rail_offset = rail_offset
        self.mapping = None
        self.transport = None
        n_dom = self.rails.num_domains
        if n_dom > MAX_DOMAINS:
            raise ValueError(f'all-gather / reduce-scatter support at most {MAX_DOMAINS} scale-up domains, got {n_dom}')
        gpus = [buf.topology.nccl_gpu_ids[g] for g in self.rails.rail_ranks]
        self.kind = choose_transport(transport or envs.rail_transport(), gpus)
        kinds = buf.group.allgather_object(self.kind)
        if len(set(kinds)) != 1:
            raise ValueError(f'hybrid all-gather / reduce-scatter: the rails chose different transports '
                             f'{sorted(set(kinds))}; set DEEPEP_CUPY_RAIL_TRANSPORT to one value on every rank')
        base = buf.sym.base
        if self.kind == 'loopback':
            if n_dom - 1 > MAX_SIGNALS:
                raise ValueError(f'the loopback rail transport signals at most {MAX_SIGNALS} rail peers, got '
                                 f'{n_dom - 1}; use fewer domains or NCCL rails')
            from types import SimpleNamespace

            from ..runtime.symmetric import PeerMapping, process_key
            specs = (epoch_begin_spec(), signal_spec(), wait_spec())
            loaded = load_kernels(list(specs))
            kernels = SimpleNamespace(epoch_begin=loaded[specs[0].name], signal=loaded[specs[1].name],
                                      wait=loaded[specs[2].name])
            self.mapping = PeerMapping(RailGroup(buf.group, self.rails.rail_ranks), base, buf.sym.num_bytes,
                                       {process_key(): base})
            signals = KernelSignals(kernels, base + rail_offset, buf.rank_idx, self.rails.rail_ranks,
                                    base + workspace.ERROR_CLAIM.offset,
                                    buf.host_mapped.ptr + workspace.HOST_ERROR_RECORD.offset, buf.timeout_ns)
            self.transport = IpcLoopbackTransport(self.rails, self.mapping.peer_bases, rail_offset, signals)
        else:
            self.transport = NcclRailTransport.create(buf.group, self.rails, base, nccl)
            # A rail peer that never arrives: the host watchdog aborts the communicator after the GPU timeout and the
            # next exchange raises TimeoutError naming the phase and the peers (runtime/rail_watchdog.py).
            self.transport.watch_timeouts(buf.num_gpu_timeout_secs, events)
        self.barrier_plan = self.header_plan('barrier')

    def header_plan(self, phase: str, extra_sends=None, extra_recvs=None):
        """A plan whose first transfer per peer is the 16-byte rail header (send header -> the peer's receive header
        [this domain]), followed by `extra_sends[m]` / `extra_recvs[m]` ranges."""
        n, off = self.rails.domain_idx, self.rail_offset
        sends, recvs = {}, {}
        for m in self.rails.peer_domains:
            sends[m] = [(off + RAIL_SEND_HEADER, off + RAIL_RECV_HEADER + 16 * n, 16)] + list(
                (extra_sends or {}).get(m, ()))
            recvs[m] = [(off + RAIL_RECV_HEADER + 16 * m, off + RAIL_SEND_HEADER, 16)] + list(
                (extra_recvs or {}).get(m, ()))
        return plan_ranges(self.rails, phase, sends, recvs)

    def exchange(self, plan, stream) -> None:
        self.transport.exchange(plan, stream)

    def barrier(self, stream) -> None:
        self.transport.exchange(self.barrier_plan, stream)

    def release(self, collective: bool = True) -> None:
        del collective      # the mapping and the communicator are released locally
        if self.transport is not None:
            self.transport.destroy()
            self.transport = None
        if self.mapping is not None:
            self.mapping.release()
            self.mapping = None


def make(buf, rail_offset: int) -> AGRSRails:
    """`features.agrs.feature.AGRS`'s `make_rails`."""
    return AGRSRails(buf, rail_offset)
