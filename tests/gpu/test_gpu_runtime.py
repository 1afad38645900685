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


def test_event_handles_reuse_pooled_events_eagerly_and_across_a_graph_capture():
    """The event pool (runtime/event.py): a dropped handle's event serves the next handle of its stream, orders
    another stream after the work before it, and an event last recorded inside a (finished) graph capture records
    eagerly again, and the reverse."""
    import cupy

    from deepep_cupy.runtime import event
    from deepep_cupy.runtime.event import EventHandle
    s, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    n = 1 << 22
    x, y, z = (cupy.zeros(n, dtype=cupy.float32) for _ in range(3))
    cupy.cuda.Device().synchronize()          # (made on the default stream; s and other do not wait for it)
    h = EventHandle(s)
    first = h.event
    del h
    for round_ in range(3):
        with s:
            cupy.add(cupy.arange(n, dtype=cupy.float32), round_, out=x)
        h = EventHandle(s)
        assert h.event is first               # the pooled event, recorded again
        h.stream_wait(other)
        with other:
            cupy.multiply(x, 2, out=y)
        other.synchronize()
        assert float(y[-1]) == 2 * (n - 1 + round_) and float(y[0]) == 2 * round_
        del h
    with s:
        cupy.add(x, 1, out=z)                 # warm (compiled) before the capture
    s.synchronize()
    s.begin_capture()
    with s:
        cupy.add(x, 1, out=z)
    captured = EventHandle(s)                 # recorded inside the capture (a pooled event)
    assert captured.event is first
    del captured
    graph = s.end_capture()
    eager = EventHandle(s)                    # the event last recorded in the capture, recorded eagerly again
    assert eager.event is first
    eager.synchronize()
    assert eager.query()
    with s:
        z.fill(0)
    graph.launch(s)
    eager2 = EventHandle(s)                   # another pooled or new event after the replay
    eager2.stream_wait(other)
    with other:
        cupy.multiply(z, 1, out=y)
    other.synchronize()
    assert float(y[-1]) == float(x[-1]) + 1
    assert all(len(v) <= event._MAX_FREE_PER_STREAM for v in event._FREE_EVENTS.values())


def test_current_stream_fast_path_follows_torchs_current_stream():
    torch = pytest.importorskip('torch')
    from deepep_cupy.runtime import interop
    x, cpu = torch.zeros(4, device='cuda'), torch.zeros(4)
    for _ in range(3):          # the first call learns the type's fast path, the others take it
        assert interop.current_stream(x).ptr == torch.cuda.current_stream().cuda_stream
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            assert interop.current_stream(x).ptr == s.cuda_stream
            assert interop.current_stream(cpu).ptr == s.cuda_stream      # a CPU tensor: the current device's
        assert interop.current_stream(x).ptr == torch.cuda.current_stream().cuda_stream


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
    from deepep_cupy.runtime.symmetric import HostMappedMemory
    flag = HostMappedMemory(4096)          # mapped host memory: the same address on the GPU (UVA)
    host = flag.view('int32', 1)
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
    spin((1,), (1,), (cupy.uint64(flag.ptr),), stream=stream)
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
    flag.free()
