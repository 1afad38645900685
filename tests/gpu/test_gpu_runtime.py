"""Single-process GPU tests of the runtime (skipped without a GPU)."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_dlpack_views_share_memory():
    torch = pytest.importorskip('torch')
    from deepep_cupy.runtime import interop
    x = torch.randn(8, 16, device='cuda').to(torch.bfloat16)
    c = interop.to_cupy(x)
    assert c.data.ptr == x.data_ptr() and c.dtype == np.uint16 and c.shape == (8, 16)
    back = interop.to_torch(c, 'bfloat16')
    assert back.data_ptr() == x.data_ptr() and torch.equal(back, x)


def test_allocator_kinds():
    import cupy

    from deepep_cupy.runtime import interop
    a = interop.Allocator('cupy').zeros((3, 4), 'bfloat16')
    assert isinstance(a, cupy.ndarray) and a.dtype == np.uint16 and int(a.sum()) == 0
    torch = pytest.importorskip('torch')
    t = interop.Allocator('torch').empty((3, 4), 'float8_e4m3fn', stream=cupy.cuda.Stream())
    assert t.dtype == torch.float8_e4m3fn and t.is_cuda


def test_event_overlap_waits_and_runs_hook_once():
    import cupy

    from deepep_cupy.runtime.event import EventHandle, EventOverlap
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.arange(1 << 20, dtype=cupy.float32) * 2
    calls = []
    ev = EventOverlap(EventHandle(s), extra_tensors=(x,))
    ev.register_hook_after_wait(lambda: calls.append(1) or 'done')
    with pytest.raises(ValueError, match='already registered'):
        ev.register_hook_after_wait(lambda: None)
    assert ev.wait() == 'done'
    assert float(x[-1]) == 2 * ((1 << 20) - 1)
    ev.current_stream_wait()
    assert calls == [1]
    with EventOverlap(EventHandle(s))(release_handle=True) as ev2:
        pass
    assert ev2.event is None


def test_cooperative_grid_too_large_is_rejected():
    from deepep_cupy.features import barrier
    from deepep_cupy.jit.launch import load_kernel
    k = load_kernel(barrier.TEST_WRITE)
    with pytest.raises(ValueError, match='cooperative grid'):
        k.launch(1_000_000, 32, cooperative=True, peer_bases=0, check_offset=0, rank=0, num_ranks=1, value=0,
                 delay_ns=0)


def test_single_rank_buffer_barrier_and_memory_returns():
    import cupy

    from deepep_cupy import BufferBase
    free0 = cupy.cuda.runtime.memGetInfo()[0]
    for _ in range(10):
        buf = BufferBase(num_bytes=64 << 20, explicitly_destroy=True)
        buf.barrier(with_cpu_sync=True)
        buf.barrier(use_comm_stream=False)
        buf.synchronize(cupy.cuda.get_current_stream())
        buf.destroy()
        buf.destroy()   # idempotent
        with pytest.raises(RuntimeError, match='destroyed'):
            buf.barrier()
    free1 = cupy.cuda.runtime.memGetInfo()[0]
    assert abs(free0 - free1) < (32 << 20), (free0, free1)


def test_dropped_buffer_frees_its_memory():
    """explicitly_destroy=False: a buffer nobody references frees its memory at once (local teardown, no
    collective); with explicitly_destroy=True only destroy() does."""
    import gc
    import weakref

    import cupy

    from deepep_cupy import ElasticBuffer
    free0 = cupy.cuda.runtime.memGetInfo()[0]
    for _ in range(5):
        buf = ElasticBuffer(num_bytes=256 << 20)
        x = cupy.ones(4096, dtype=cupy.float32)
        assert buf.all_reduce(x).wait() is x            # a feature component exists
        buf.barrier(with_cpu_sync=True)
        ref = weakref.ref(buf)
        del buf
        assert ref() is None            # no reference cycle through the features: freed by reference counting
    gc.collect()
    free1 = cupy.cuda.runtime.memGetInfo()[0]
    assert abs(free0 - free1) < (128 << 20), (free0, free1)
    kept = ElasticBuffer(num_bytes=256 << 20, explicitly_destroy=True)
    kept.destroy()


def test_bad_buffer_arguments():
    from deepep_cupy import BufferBase
    with pytest.raises(ValueError, match='multiple of 2097152'):
        BufferBase(num_bytes=1000)
    with pytest.raises(TypeError, match='num_bytes must be an int'):
        BufferBase(num_bytes=2.0)


def test_rail_watchdog_cuda_events_fire_on_a_hung_stream():
    """runtime/rail_watchdog.py with real CUDA events: a stream held by a kernel spinning on a host-mapped flag (a
    stand-in for an NCCL exchange whose peer never arrives) fires the watchdog from its thread; `on_timeout` (the
    transport's abort there) releases the kernel; a completed exchange is retired; a captured one is not watched."""
    import time

    import cupy

    from deepep_cupy.runtime.rail_watchdog import CudaEvents, RailWatchdog
    flag = cupy.cuda.alloc_pinned_memory(4)
    host = np.frombuffer(flag, dtype=np.int32, count=1)
    host[0] = 0
    spin = cupy.RawKernel(r'''
    extern "C" __global__ void spin(volatile int* flag) {
        long long t0 = clock64();
        while (*flag == 0 && clock64() - t0 < 20000000000LL) {}
    }''', 'spin')
    stream = cupy.cuda.Stream(non_blocking=True)
    fired = []

    def on_timeout(phase, peers):
        fired.append((phase, tuple(peers)))
        host[0] = 1                        # the abort: the spinning work returns
        return TimeoutError(f'{phase} {list(peers)}')

    events = CudaEvents(cupy.cuda.runtime.getDevice())
    w = RailWatchdog(0.2, on_timeout, events, poll_s=0.002)
    ptr = cupy.cuda.runtime.hostGetDevicePointer(flag.ptr, 0)
    spin((1,), (1,), (cupy.uint64(ptr),), stream=stream)
    w.watch(stream.ptr, 'combine', [1])
    t0 = time.monotonic()
    while not fired and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert fired == [('combine', (1,))] and isinstance(w.error, TimeoutError)
    stream.synchronize()
    assert time.monotonic() - t0 < 10
    with pytest.raises(TimeoutError, match='combine'):
        w.raise_if_failed()
    w.close()

    # A completed exchange never fires; one enqueued during a capture is not watched.
    w = RailWatchdog(0.2, on_timeout, events, poll_s=0.002)
    w.watch(stream.ptr, 'dispatch', [1])
    stream.synchronize()
    time.sleep(0.4)
    assert w.num_pending == 0 and w.error is None and len(fired) == 1
    graph_stream = cupy.cuda.Stream(non_blocking=True)
    with graph_stream:
        graph_stream.begin_capture()
        w.watch(graph_stream.ptr, 'dispatch', [1])
        graph_stream.end_capture()
    assert w.num_pending == 0
    w.close()
