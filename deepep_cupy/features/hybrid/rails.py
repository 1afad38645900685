"""`HybridRails`: a rank's rail memory and transport for the hybrid feature (feature.py): NCCL rails, or the IPC
loopback of ranks sharing a GPU, over the rail area (`plan.RailArea`)."""

from typing import Optional

from ... import envs
from ...runtime import workspace
from ...runtime.rail_nccl import NcclRailTransport
from ...runtime.rails import IpcLoopbackTransport, plan_exchange, rail_topology
from . import plan as hplan
from .kernels import MAX_SIGNALS, KernelSignals


class HybridRails:
    """This rank's rail memory and transport (made collectively with the buffer; released by `release`)."""

    def __init__(self, buf, area: hplan.RailArea, kernels, transport: Optional[str] = None):
        import cupy
        topo = buf.topology
        self.rails = rail_topology(buf.num_ranks, buf.num_scaleup_ranks, buf.rank_idx)
        gpus = [topo.nccl_gpu_ids[g] for g in self.rails.rail_ranks]
        self.kind = hplan.choose_transport(transport or envs.rail_transport(), gpus)
        self.area, self.mem, self.own_ptr = area, None, 0
        kinds = buf.group.allgather_object(self.kind)
        if len(set(kinds)) != 1:
            raise ValueError(f'hybrid mode: the rails chose different transports {sorted(set(kinds))}; set '
                             f'DEEPEP_CUPY_RAIL_TRANSPORT to one value on every rank')
        if self.kind == 'loopback':
            if self.rails.num_domains - 1 > MAX_SIGNALS:
                raise ValueError(f'the loopback rail transport signals at most {MAX_SIGNALS} rail peers, got '
                                 f'{self.rails.num_domains - 1}; use fewer domains or NCCL rails')
            from ...runtime.symmetric import SymmetricMemory
            self.mem = SymmetricMemory(buf.group, list(self.rails.rail_ranks), area.total_bytes)
            self.base = self.mem.base
            signals = KernelSignals(kernels, self.base + area.flags_offset, buf.rank_idx,
                                    self.rails.rail_ranks, buf.sym.base + workspace.ERROR_CLAIM.offset,
                                    buf.host_mapped.ptr + workspace.HOST_ERROR_RECORD.offset, buf.timeout_ns)
            self.transport = IpcLoopbackTransport(self.rails, self.mem.peer_bases, area.flags_offset, signals)
        else:
            self.own_ptr = self.base = cupy.cuda.runtime.malloc(area.total_bytes)
            cupy.cuda.runtime.memset(self.base, 0, area.total_bytes)
            cupy.cuda.runtime.deviceSynchronize()
            self.transport = NcclRailTransport.create(buf.group, self.rails, self.base)
            self.transport.watch_timeouts(buf.num_gpu_timeout_secs)
        peers = self.rails.peer_domains
        self.barrier_plan = plan_exchange(self.rails, area, 'barrier', {m: 0 for m in peers}, {m: 0 for m in peers})

    def exchange(self, plan, stream, after_chunk=None) -> None:
        """Enqueue `plan` on `stream`; `after_chunk(c, stream)`, when given, runs after chunk c's group is enqueued
        (the transport's hook, set for this exchange only)."""
        transport = self.transport
        if after_chunk is None:
            transport.exchange(plan, stream)
            return
        transport.after_chunk = after_chunk
        try:
            transport.exchange(plan, stream)
        finally:
            transport.after_chunk = None

    def barrier(self, stream) -> None:
        self.transport.exchange(self.barrier_plan, stream)

    def release(self, collective: bool) -> None:
        if self.transport is not None:
            self.transport.destroy()
            self.transport = None
        if self.mem is not None:
            if collective:
                self.mem.destroy()
            else:
                self.mem.release_local()
            self.mem = None
        if self.own_ptr:
            import cupy
            cupy.cuda.runtime.free(self.own_ptr)
            self.own_ptr = 0
