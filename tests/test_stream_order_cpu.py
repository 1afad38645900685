"""`StreamOrder`'s local path without a GPU: a synchronous call runs on the caller's stream, and the order (the
"tail") keeps every later call, host wait and teardown behind every kernel the buffer enqueued, whichever stream
each ran on. Streams log what was enqueued on them: ('wait', name of the stream the event was recorded on)."""

import fakes

from deepep_cupy.runtime import streams
from deepep_cupy.runtime.streams import StreamOrder


class LogStream(fakes.FakeStream):
    def __init__(self, name):
        super().__init__(name)
        self.log = []

    def wait_event(self, event):
        self.log.append(('wait', event.on))


class LogEvent:
    on = None

    def record(self, stream=None):
        self.on = stream.name


def make(monkeypatch, always=False):
    monkeypatch.setenv('DEEPEP_CUPY_ALWAYS_COMM_STREAM', '1' if always else '0')
    comm = LogStream('comm')
    order = StreamOrder(comm)
    order._enter, order._leave = LogEvent(), LogEvent()
    return order, comm


def test_local_calls_on_one_stream_record_no_event_after_the_first(monkeypatch):
    order, comm = make(monkeypatch)
    s = LogStream('s')
    assert order.enter(s, None, local=True) is s        # first: join the communication stream once
    assert comm.log == [('wait', 's')] and s.log == [('wait', 'comm')]
    for _ in range(3):
        ran = order.enter(s, None, local=True)
        assert ran is s and order.leave('torch', s, ran, False).event is None
    assert comm.log == [('wait', 's')] and s.log == [('wait', 'comm')]


def test_work_on_the_communication_stream_is_joined_before_the_next_local_call(monkeypatch):
    order, comm = make(monkeypatch)
    s = LogStream('s')
    order.enter(s, None, local=True)
    comm.log.clear(), s.log.clear()
    monkeypatch.setattr(streams, 'EventHandle', fakes.FakeEventHandle)
    ran = order.enter(s, None, local=False)              # an asynchronous call: on the communication stream
    assert ran is comm and comm.log == [('wait', 's')]
    assert order.leave('cupy', s, ran, True).event is not None and s.log == []
    assert order.enter(s, None, local=True) is s and s.log == [('wait', 'comm')]


def test_a_new_stream_waits_for_the_previous_one_through_the_communication_stream(monkeypatch):
    order, comm = make(monkeypatch)
    a, b = LogStream('a'), LogStream('b')
    order.enter(a, None, local=True)
    comm.log.clear()
    assert order.enter(b, None, local=True) is b
    assert comm.log == [('wait', 'a'), ('wait', 'b')] and b.log == [('wait', 'comm')]


def test_previous_event_and_settle_fold_the_tail_into_the_communication_stream(monkeypatch):
    order, comm = make(monkeypatch)
    s = LogStream('s')
    order.enter(s, None, local=True)
    comm.log.clear()
    handle = fakes.FakeEventHandle(LogStream('other'))
    handle.on = 'other'
    assert order.enter(s, handle, local=True) is comm     # previous_event: never local
    assert comm.log == [('wait', 's'), ('wait', 'other')]
    order.leave('cupy', s, comm, False)
    comm.log.clear()
    order.enter(s, None, local=True)
    assert comm.log == [] and order.settle() is comm and comm.log == [('wait', 's')]
    assert order.settle() is comm and comm.log == [('wait', 's')]      # folded once


def test_always_comm_stream_keeps_deepeps_order(monkeypatch):
    order, comm = make(monkeypatch, always=True)
    s = LogStream('s')
    for _ in range(2):
        ran = order.enter(s, None, local=True)
        assert ran is comm
        order.leave('cupy', s, ran, False)
    assert comm.log == [('wait', 's')] * 2 and s.log == [('wait', 'comm')] * 2
