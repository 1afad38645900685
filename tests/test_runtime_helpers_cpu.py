"""The runtime helpers every feature shares, without a GPU: group sizes read locally, the stream ordering, the
bounded host poll, the dtype table, `previous_event` coercion, and a garbage-collected buffer's local teardown."""

import gc
import time
import weakref

import fakes
import numpy as np
import pytest

from deepep_cupy import ElasticBuffer
from deepep_cupy.features.ep import layout
from deepep_cupy.runtime import dtypes, polling
from deepep_cupy.runtime.event import EventHandle, EventOverlap, as_event_handle
from deepep_cupy.runtime.group import ProcessGroup
from deepep_cupy.runtime.group_size import group_size
from deepep_cupy.runtime.streams import StreamOrder


class NoCollectives(ProcessGroup):
    def allgather_object(self, obj, timeout=None):
        raise AssertionError('a size hint must not communicate')


def test_group_size_of_every_kind_of_group(monkeypatch):
    class TorchLike:
        def size(self):
            return 4

    class MpiLike:
        def Get_size(self):
            return 5
    assert group_size(6) == 6 and group_size(np.int64(3)) == 3 and group_size(NoCollectives(0, 7)) == 7
    assert group_size(TorchLike()) == 4 and group_size(comm=MpiLike()) == 5
    for k in ('OMPI_COMM_WORLD_SIZE', 'PMI_SIZE', 'PMIX_RANK', 'MV2_COMM_WORLD_SIZE', 'MPI_LOCALNRANKS'):
        monkeypatch.delenv(k, raising=False)
    assert group_size() == 1                            # no launcher, no torch.distributed: one process
    with pytest.raises(ValueError, match='either group'):
        group_size(TorchLike(), comm=MpiLike())
    with pytest.raises(TypeError, match='group must be'):
        group_size(object())


def test_buffer_size_hint_needs_no_communication():
    want = layout.buffer_size_hint(7, 128, 7168, 8)
    assert ElasticBuffer.get_buffer_size_hint(NoCollectives(0, 7), 128, 7168, 8) == want
    assert ElasticBuffer.get_buffer_size_hint(7, 128, 7168, 8) == want

    class MpiLike:
        def Get_size(self):
            return 7
    assert ElasticBuffer.get_buffer_size_hint(None, 128, 7168, 8, comm=MpiLike()) == want
    assert ElasticBuffer.get_buffer_size_hint(None, 128, 7168, 8) == layout.buffer_size_hint(1, 128, 7168, 8)


def test_stream_order():
    comm, current, other = fakes.FakeStream('comm'), fakes.FakeStream('current'), fakes.FakeStream('other')
    order = fakes.stream_order(comm)
    assert order.begin(current) is comm and comm.waits == 1
    handle = fakes.FakeEventHandle(other)
    order.begin(current, handle)
    assert comm.waits == 2 and current.waits == 0
    order.end(current)
    assert current.waits == 1
    assert order.finish('cupy', current, False, (1, None)).event is None and current.waits == 2


def test_stream_order_event_marks_torch_tensors(monkeypatch):
    torch = pytest.importorskip('torch')
    from deepep_cupy.runtime import interop, streams
    monkeypatch.setattr(streams, 'EventHandle', fakes.FakeEventHandle)
    monkeypatch.setattr(interop, 'torch_stream', lambda ptr: ('torch stream', ptr))
    marked = []
    monkeypatch.setattr(torch.Tensor, 'record_stream', lambda self, s: marked.append(s))
    comm = fakes.FakeStream('comm')
    order = StreamOrder(comm)
    a, b = torch.zeros(2), torch.zeros(3)
    ev = order.finish('torch', fakes.FakeStream('current'), True, (a, None, b))
    assert ev.extra_tensors == (a, b) and ev.event.stream is comm and marked == [('torch stream', comm.ptr)] * 2
    assert order.event('cupy', (a,), (a, b)).extra_tensors == (a, b) and len(marked) == 2


def test_previous_event_coercion():
    handle = EventHandle.__new__(EventHandle)
    assert as_event_handle(None) is None and as_event_handle(handle) is handle
    assert as_event_handle(EventOverlap(handle)) is handle
    with pytest.raises(TypeError, match='previous_event must be an EventHandle'):
        as_event_handle(object())
    with pytest.raises(TypeError, match='got NoneType'):
        as_event_handle(EventOverlap(None))


@pytest.mark.parametrize('spin', [True, False])
def test_wait_until(spin):
    flag, checks = [0], []
    polling.wait_until(lambda: True, 1.0, None)                 # ready at once: no clock, no check
    t0 = time.monotonic()

    def timed_out():
        raise TimeoutError('gave up')
    with pytest.raises(TimeoutError, match='gave up'):
        polling.wait_until(lambda: flag[0] == 1, 0.05, timed_out, lambda: checks.append(1), spin=spin)
    assert 0.05 <= time.monotonic() - t0 < 2 and checks

    def check():
        flag[0] = 1                                               # e.g. the GPU wrote the word meanwhile
    polling.wait_until(lambda: flag[0] == 1, 1.0, timed_out, check, spin=spin)


def test_dtype_table():
    torch = pytest.importorskip('torch')
    assert dtypes.cupy_storage('bfloat16') == np.uint16 and dtypes.cupy_storage('float8_e4m3fn') == np.uint8
    assert dtypes.cupy_storage('bool') == np.bool_ and dtypes.cupy_storage('float32') == np.float32
    assert dtypes.describe(torch.bfloat16) == ('torch', 'bfloat16', 2)
    assert dtypes.describe('bfloat16') == ('cupy', 'uint16', 2)
    assert dtypes.describe(np.float32) == ('cupy', 'float32', 4)
    assert dtypes.low_precision_name(np.uint8) == 'float8_e4m3fn' and dtypes.low_precision_name('uint16') == 'bfloat16'
    with pytest.raises(TypeError):
        dtypes.describe(torch.complex64)
    with pytest.raises(TypeError):
        dtypes.low_precision_name(torch.float32)


class _Sym:
    def __init__(self, log):
        self.log = log

    def release_local(self):
        self.log.append('release_local')

    def destroy(self, timeout=None):
        self.log.append('destroy (collective)')


def _dropped_buffer(explicitly_destroy, log):
    buf = fakes.make_buffer(sym=_Sym(log), explicitly_destroy=explicitly_destroy)
    buf.host_mapped.free = lambda: log.append('free host-mapped')
    buf._pp_feature()                 # a feature component exists: it must not keep the buffer alive
    return weakref.ref(buf)


def test_a_dropped_buffer_frees_its_memory_locally(monkeypatch):
    from deepep_cupy.buffers import base
    monkeypatch.setattr(base, '_release_stream', lambda device, stream: None)
    log = []
    ref = _dropped_buffer(False, log)
    assert ref() is None                        # freed by reference counting: no cycle through the feature
    assert log == ['release_local', 'free host-mapped']
    log.clear()
    ref = _dropped_buffer(True, log)            # explicitly_destroy: only destroy() releases (collectively)
    gc.collect()
    assert ref() is None and log == []


def test_teardown_never_raises_from_the_finalizer(monkeypatch):
    log = []
    buf = fakes.make_buffer(sym=_Sym(log), explicitly_destroy=False)

    def broken():
        raise RuntimeError('the CUDA context is gone')
    buf.host_mapped.free = broken
    del buf                                     # no exception escapes __del__
    gc.collect()
    assert log == ['release_local']


def test_meta_signatures_decide_the_checks():
    torch = pytest.importorskip('torch')
    from deepep_cupy.runtime import interop
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    sig, ptr = interop.meta(x)
    assert ptr == x.data_ptr() and sig == interop.meta(torch.ones(4, 8, dtype=torch.bfloat16))[0]
    for other in (x.float(), x.t(), x[:, :4], torch.zeros(4, 9, dtype=torch.bfloat16), x.view(-1)):
        assert interop.meta(other)[0] != sig
    assert interop.meta(None) == (None, 0)
    a, b = interop.meta(object())[0], interop.meta(object())[0]
    assert type(a) is object and a != b          # never matches anything cached
    assert interop.meta(x[1:])[1] == x.data_ptr() + 8 * 2      # the pointer is the per-call part


def test_carver_views_share_one_allocation():
    torch = pytest.importorskip('torch')
    from deepep_cupy.runtime import interop
    carver = interop.Carver('torch', -1)
    base = carver.words(18)
    meta = carver.view(base, 'int32', (2, 3), 0)          # words 0..5
    idx = carver.view(base, 'int64', (2, 2), 6)           # words 6..13
    w = carver.view(base, 'float32', (4,), 14)            # words 14..17
    meta.fill_(7)
    idx.copy_(torch.tensor([[1, 2], [3, 4]]))
    w.fill_(0.5)
    assert base[:6].tolist() == [7] * 6 and base[6:14].view(torch.int64).tolist() == [1, 2, 3, 4]
    assert base[14:18].view(torch.float32).tolist() == [0.5] * 4
    assert idx.data_ptr() == base.data_ptr() + 24 and idx.is_contiguous() and w.untyped_storage().data_ptr() == \
        base.untyped_storage().data_ptr()
    assert carver.empty((3, 5), 'bfloat16').dtype == torch.bfloat16 and carver.ptr(base) == base.data_ptr()


def test_contiguous_strides_match_numpy():
    import numpy as np

    from deepep_cupy.runtime.interop import contiguous_strides
    for shape in [(), (5,), (3, 4), (2, 3, 7)]:
        expected = tuple(s // 4 for s in np.empty(shape, dtype=np.int32).strides)
        assert contiguous_strides(shape) == expected
