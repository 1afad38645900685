"""`StreamOrder`'s local path without a GPU: a synchronous call runs on the caller's stream, and the order (the
tail and the mark) keeps every later call, host wait and teardown behind every kernel the buffer enqueued, whichever
stream each ran on, and the communication stream never waits for more than it did when everything ran on it.
Streams log what was enqueued on them: ('wait', (event name, stream it was recorded on))."""

import fakes

from deepep_cupy.runtime import streams
from deepep_cupy.runtime.streams import StreamOrder


class LogStream(fakes.FakeStream):
    def __init__(self, name):
        super().__init__(name)
        self.log = []

    def wait_event(self, event):
        self.log.append(('wait', (event.name, event.on)))


class LogEvent:
    def __init__(self, name):
        self.name, self.on = name, None

    def record(self, stream=None):
        self.on = stream.name


def make(monkeypatch, always=False):
    monkeypatch.setenv('DEEPEP_CUPY_ALWAYS_COMM_STREAM', '1' if always else '0')
    comm = LogStream('comm')
    order = StreamOrder(comm)
    order._enter, order._leave, order._mark = LogEvent('enter'), LogEvent('leave'), LogEvent('mark')
    return order, comm


def call(order, s, **kw):
    """A synchronous call on `s`: the stream it ran on."""
    ran = order.enter(s, kw.get('previous_event'), local=True)
    assert order.leave('cupy', s, ran, False).event is None
    return ran


def test_local_calls_on_one_stream_record_one_mark_and_wait_for_nothing(monkeypatch):
    order, comm = make(monkeypatch)
    s = LogStream('s')
    assert call(order, s) is s        # the first: joins the communication stream once
    assert comm.log == [('wait', ('enter', 's'))] and s.log == [('wait', ('leave', 'comm'))]
    for _ in range(3):
        assert call(order, s) is s
    assert comm.log == [('wait', ('enter', 's'))] and s.log == [('wait', ('leave', 'comm'))]
    assert order._mark.on == 's' and order._marked


def test_the_communication_stream_waits_for_the_last_local_kernels_before_its_next_work(monkeypatch):
    order, comm = make(monkeypatch)
    s = LogStream('s')
    call(order, s)
    comm.log.clear(), s.log.clear()
    monkeypatch.setattr(streams, 'EventHandle', fakes.FakeEventHandle)
    ran = order.enter(s, None, local=False)              # an asynchronous call: on the communication stream
    assert ran is comm and comm.log == [('wait', ('mark', 's')), ('wait', ('enter', 's'))]
    assert order.leave('cupy', s, ran, True).event is not None and s.log == []
    assert call(order, s) is s and s.log == [('wait', ('leave', 'comm'))]     # joined after the async work


def test_previous_event_waits_for_the_mark_not_for_the_current_stream(monkeypatch):
    order, comm = make(monkeypatch)
    s = LogStream('s')
    call(order, s)
    comm.log.clear()
    handle = fakes.FakeEventHandle(None)
    handle.name, handle.on = 'previous', 'other'
    assert order.enter(s, handle, local=True) is comm     # previous_event: never local
    assert comm.log == [('wait', ('mark', 's')), ('wait', ('previous', 'other'))]
    order.leave('cupy', s, comm, False)
    comm.log.clear()
    call(order, s)
    assert comm.log == [] and order.settle() is comm and comm.log == [('wait', ('mark', 's'))]
    assert order.settle() is comm and comm.log == [('wait', ('mark', 's'))]      # waited once
    order.end(s)
    order.begin(s)                                         # nothing local since: no mark to wait for
    assert comm.log[1:] == [('wait', ('enter', 's'))]


def test_a_new_stream_joins_after_the_previous_ones_kernels(monkeypatch):
    order, comm = make(monkeypatch)
    a, b = LogStream('a'), LogStream('b')
    call(order, a)
    comm.log.clear()
    assert call(order, b) is b
    assert comm.log == [('wait', ('mark', 'a')), ('wait', ('enter', 'b'))] and b.log == [('wait', ('leave', 'comm'))]


def test_always_comm_stream_keeps_deepeps_order(monkeypatch):
    order, comm = make(monkeypatch, always=True)
    s = LogStream('s')
    for _ in range(2):
        assert call(order, s) is comm
    assert comm.log == [('wait', ('enter', 's'))] * 2 and s.log == [('wait', ('leave', 'comm'))] * 2
    assert order._mark.on is None


class CaptureStream(LogStream):
    """A stream whose capture state the test sets (CUDA refuses waits across a capture boundary)."""

    def __init__(self, name, capturing=False):
        super().__init__(name)
        self.capturing = capturing

    def is_capturing(self):
        return self.capturing


def test_a_mark_recorded_inside_a_capture_is_not_waited_for_after_it(monkeypatch):
    """Found on 1xH200: a local call captured in a graph, then an eager call: comm.wait_event(mark) failed with
    cudaErrorInvalidValue (the mark is a node of the graph)."""
    order, comm = make(monkeypatch)
    comm.__class__ = CaptureStream
    comm.capturing = False
    s = CaptureStream('s', capturing=True)
    call(order, s)                       # captured
    s.capturing = False                  # the capture ended
    comm.log.clear()
    order.enter(s, None, local=False)
    assert ('wait', ('mark', 's')) not in comm.log and not order._marked
    order._marked, order._mark_captured = True, True
    order.settle()
    assert ('wait', ('mark', 's')) not in comm.log


def test_an_eager_mark_is_not_waited_for_by_a_stream_joined_to_a_capture(monkeypatch):
    """Found on 1xH200 (V1's CUDA-graph scenario): an eager local call, then calls inside a capture that had joined
    the communication stream: comm.wait_event(mark) raised cudaErrorStreamCaptureIsolation."""
    order, comm = make(monkeypatch)
    comm.__class__ = CaptureStream
    comm.capturing = False
    s = CaptureStream('s')
    call(order, s)                       # eager
    comm.capturing = True                # an earlier call of the capture joined it
    comm.log.clear()
    order.enter(CaptureStream('g', capturing=True), None, local=False)
    assert ('wait', ('mark', 's')) not in comm.log and not order._marked


def test_marks_are_waited_for_on_the_same_side_of_a_capture(monkeypatch):
    order, comm = make(monkeypatch)
    comm.__class__ = CaptureStream
    comm.capturing = False
    s = CaptureStream('s')
    call(order, s)                       # eager mark, eager communication stream: ordered
    comm.log.clear()
    order.enter(s, None, local=False)
    assert comm.log[0] == ('wait', ('mark', 's'))
    g = CaptureStream('g', capturing=True)
    order._tail = g
    call(order, g)                       # captured mark, the capture still running: the wait joins it
    comm.log.clear()
    order.enter(g, None, local=False)
    assert comm.log[0] == ('wait', ('mark', 'g'))
