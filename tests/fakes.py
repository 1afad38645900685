"""Stand-ins for the GPU parts of a buffer, shared by the CPU tests: recording kernels with the real launchers' named
signatures, fake streams and events, host-mapped memory in a numpy array, and an `ElasticBuffer` built without a GPU
(its features are the real components; only kernels, streams and memory are replaced)."""

from types import SimpleNamespace
from typing import Any, Callable, List, Optional

import numpy as np

from deepep_cupy import envs
from deepep_cupy.buffers.elastic import ElasticBuffer
from deepep_cupy.jit import launch
from deepep_cupy.runtime.group import ProcessGroup
from deepep_cupy.runtime.streams import StreamOrder


class RecordingKernel:
    """A kernel whose `launch` / `prepare` have the real launchers' keyword signatures (so a missing, extra or
    misspelled argument raises TypeError as on a GPU), packs the arguments like a real launch (exact types) and
    records each launch as `Launch` (or calls `run(args)` with the arguments by name). `co_resident`: the blocks that
    can be resident at once (`Kernel.co_resident_blocks`); a larger cooperative grid raises ValueError, as on a GPU."""

    # An H100's 132 SMs x 3 blocks (the notify kernel's occupancy at top-8 and 256 experts)
    CO_RESIDENT_BLOCKS = 396

    def __init__(self, spec: launch.KernelSpec, log: Optional[List] = None, run: Optional[Callable] = None,
                 co_resident: int = CO_RESIDENT_BLOCKS):
        self.spec, self.log, self.run = spec, log if log is not None else [], run
        self.co_resident = co_resident
        self.converters = launch.converters_for(spec)
        self.launch = launch.named_launcher(spec, self._launch)
        self.prepare = launch.named_launcher(spec, self._prepare, with_stream=False, what='prepare')
        self.bind = launch.named_launcher(spec, self._bind, with_stream=False, what='bind')

    def co_resident_blocks(self, num_threads: int, shared_mem: int = 0) -> int:
        return self.co_resident

    def _check_cooperative(self, grid, cooperative) -> None:
        num_blocks = int(np.prod(grid))
        if cooperative and num_blocks > self.co_resident:
            raise ValueError(f'{self.spec.name}: cooperative grid of {num_blocks} blocks exceeds the '
                             f'{self.co_resident} blocks that can be co-resident on this device')

    def _launch(self, grid, block, args, stream, shared_mem, cooperative):
        self._check_cooperative(grid, cooperative)
        launch.pack_args(self.spec, args, self.converters)
        named = dict(zip(self.spec.param_names, args))
        self.log.append(SimpleNamespace(name=self.spec.name, grid=grid, block=block, args=named, stream=stream,
                                        shared_mem=shared_mem, cooperative=cooperative))
        if self.run is not None:
            self.run(named)

    def _prepare(self, grid, block, args, shared_mem, cooperative):
        self._launch(grid, block, args, None, shared_mem, cooperative)
        return lambda stream: None

    def _bind(self, grid, block, args, shared_mem, cooperative):
        """A real `BoundLaunch` (packed like the GPU's); each call records the packed arguments by name."""
        self._check_cooperative(grid, cooperative)
        packed = launch.pack_args(self.spec, args, self.converters)
        layout, offsets = launch.arg_struct(self.spec)
        bound = launch.BoundLaunch(self.spec, layout, offsets, grid, block, shared_mem, cooperative, self._go_bound)
        layout.pack_into(bound.data, 0, *packed)
        return bound

    def _go_bound(self, bound, stream):
        self._check_cooperative(bound.grid, bound.cooperative)     # (a grid patched after binding, as on a GPU)
        named = bound.values()
        grid = bound.grid[0] if bound.grid[1:] == (1, 1) else bound.grid
        block = bound.block[0] if bound.block[1:] == (1, 1) else bound.block
        self.log.append(SimpleNamespace(name=self.spec.name, grid=grid, block=block, args=named, stream=stream,
                                        shared_mem=bound.shared_mem, cooperative=bound.cooperative))
        if self.run is not None:
            self.run(named)


class FakeStream:
    def __init__(self, name: str = 'stream'):
        self.name, self.ptr, self.waits = name, id(self), 0

    def record(self):
        return FakeEvent()

    def wait_event(self, event):
        self.waits += 1

    def synchronize(self):
        pass

    def is_capturing(self):
        return False


class FakeEvent:
    done = True

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class FakeEventHandle:
    """`EventHandle` without CUDA (monkeypatch `deepep_cupy.runtime.streams.EventHandle` with it)."""

    def __init__(self, stream=None):
        self.stream = stream

    def stream_wait(self, stream):
        stream.wait_event(self)

    def current_stream_wait(self, like=None):
        from deepep_cupy.runtime import interop
        interop.current_stream(like).wait_event(self)


def stream_order(comm) -> StreamOrder:
    """A `StreamOrder` over a fake stream, with fake events (no CUDA)."""
    order = StreamOrder(comm)
    order._enter, order._leave, order._mark = FakeEvent(), FakeEvent(), FakeEvent()
    return order


class FakeHostMapped:
    """Host-mapped memory as a numpy array (the kernels' records are written by the tests)."""

    def __init__(self, num_bytes: int = 65536, ptr: int = 0x2000):
        self.data = np.zeros(num_bytes, dtype=np.uint8)
        self.ptr, self.num_bytes = ptr, num_bytes

    def view(self, dtype, count, offset=0):
        dtype = np.dtype(dtype)
        return self.data[offset:offset + count * dtype.itemsize].view(dtype)

    def free(self):
        pass


class AgreeingGroup(ProcessGroup):
    """`size` ranks seen from `rank`; every other rank contributes what `others(r, obj)` returns (default: the same)."""

    def __init__(self, rank: int = 0, size: int = 1, others=None):
        super().__init__(rank, size)
        self.others = others or (lambda r, obj: obj)
        self.num_collectives = 0
        self.calls = []

    def allgather_object(self, obj, timeout=None):
        self.num_collectives += 1
        self.calls.append(('allgather', obj))
        return [obj if r == self.rank else self.others(r, obj) for r in range(self.size)]

    def check_same(self, what, value, timeout=None):
        self.calls.append(('check_same', what, value))
        super().check_same(what, value, timeout)
        self.calls.pop()            # the all-gather inside is not a call of its own


def make_buffer(num_ranks: int = 2, rank: int = 0, num_bytes: int = 64 << 20, device: int = -1,
                group: Any = None, sym: Any = None, comm: Any = None, **attrs) -> ElasticBuffer:
    """An `ElasticBuffer` built without a GPU: the attributes `BufferBase.__init__` would set, fakes for the streams
    and host-mapped memory (device -1 is what CPU tensors report). `attrs` override any attribute."""
    buf = ElasticBuffer.__new__(ElasticBuffer)
    comm = comm if comm is not None else FakeStream('comm')
    host_mapped = FakeHostMapped()
    if sym is None:
        sym = SimpleNamespace(peer_bases_ptr=0x1000, local_idx=rank, base=0x7000_0000_0000,
                              num_bytes=(2 << 20) + num_bytes, num_peers=num_ranks)
    buf.__dict__.update(
        device=device, rank_idx=rank, num_ranks=num_ranks, num_scaleup_ranks=num_ranks, num_scaleout_ranks=1,
        scaleup_rank_idx=rank, scaleout_rank_idx=0, num_bytes=num_bytes, num_device_sms=132,
        num_gpu_timeout_secs=10.0, num_cpu_timeout_secs=10.0, explicitly_destroy=True, _destroyed=False,
        _failed=None, _data_region_owner=None, host_mapped=host_mapped, error_record=host_mapped.view('int32', 8),
        group=group if group is not None else AgreeingGroup(rank, num_ranks), comm_stream=comm,
        stream_order=stream_order(comm), sym=sym, nccl=None,
        topology=SimpleNamespace(scaleup_peers=list(range(num_ranks))), num_max_tokens_per_rank=0, hidden=0,
        num_topk=0, allow_multiple_reduction=True, prefer_overlap_with_compute=True, num_allocated_qps=17,
        _nvlink_gbs=450.0, _ep=None, _pp=None, _agrs=None, _engram=None, _lb=None,
        design=envs.DesignKnobs.from_env())
    buf.__dict__.update(attrs)
    return buf


def pack_named(spec: launch.KernelSpec, named: dict):
    """`launch.pack_args` of arguments given by name: exactly the declared names, packed in declaration order."""
    assert set(named) == set(spec.param_names), (sorted(set(named) ^ set(spec.param_names)), spec.name)
    return launch.pack_args(spec, [named[n] for n in spec.param_names])


class ThreadExchange:
    """allgather_object for ranks running as threads of this process (`ThreadGroup`)."""

    def __init__(self, size: int, timeout: float = 30):
        import threading
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots = [None] * size

    def allgather(self, rank, obj):
        self.barrier.wait()         # everyone has read the previous round
        self.slots[rank] = obj
        self.barrier.wait()         # everyone has written this round
        return list(self.slots)


class ThreadGroup(ProcessGroup):
    """A rank of a group whose ranks are threads sharing one `ThreadExchange`."""

    def __init__(self, rank, size, exchange: ThreadExchange):
        super().__init__(rank, size)
        self.exchange = exchange

    def allgather_object(self, obj, timeout=None):
        return self.exchange.allgather(self.rank, obj)
