"""`DeferredRecord` without a GPU (runtime/streams.py): the torch tensors a call used on the communication stream are
marked with `record_stream` only when the call's completion is waited for on another stream than the call's, or never
waited for; waited for on the call's stream, no mark. Covers `StreamOrder.scoped_event` (reduce-scatter / all-reduce),
the engram fetch hooks and the all-gather wait handle's use of it."""

import gc

import fakes
import pytest

from deepep_cupy.runtime import interop, streams


class Tensor:
    """Stands for a torch tensor: logs the streams it is marked on."""

    def __init__(self):
        self.marked = []

    def record_stream(self, stream):
        self.marked.append(stream)


@pytest.fixture()
def env(monkeypatch):
    current, other, comm = fakes.FakeStream('current'), fakes.FakeStream('other'), fakes.FakeStream('comm')
    now = {'stream': current}
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: now['stream'])
    monkeypatch.setattr(interop, 'torch_stream', lambda handle: ('torch', handle))
    monkeypatch.setattr(streams, 'EventHandle', fakes.FakeEventHandle)
    order = fakes.stream_order(comm)
    return order, current, other, comm, now


def test_waited_on_the_calls_stream_marks_nothing(env):
    order, current, other, comm, now = env
    x, out = Tensor(), Tensor()
    ev = order.scoped_event('torch', current, (x, out), (x, out))
    ev.register_hook_after_wait(lambda: out)
    assert ev.wait() is out and current.waits == 1
    del ev
    gc.collect()
    assert x.marked == out.marked == []


def test_waited_on_another_stream_marks_once(env):
    order, current, other, comm, now = env
    x = Tensor()
    ev = order.scoped_event('torch', current, (x,), (x,))
    now['stream'] = other
    ev.current_stream_wait()
    now['stream'] = current
    ev.current_stream_wait()            # a second wait (on the call's stream) marks nothing more
    assert other.waits == 1 and current.waits == 1 and x.marked == [('torch', comm.ptr)]
    del ev
    gc.collect()
    assert x.marked == [('torch', comm.ptr)]


def test_dropped_unwaited_marks_and_release_handle_drops_tensors(env):
    order, current, other, comm, now = env
    x = Tensor()
    ev = order.scoped_event('torch', current, (x,), (x,))
    del ev
    gc.collect()
    assert x.marked == [('torch', comm.ptr)]
    y = Tensor()
    ev = order.scoped_event('torch', current, (y,), (y,))
    ev.current_stream_wait(release_handle=True)
    assert ev.event is None and ev.extra_tensors is None and y.marked == []
    with pytest.raises(ValueError, match='no event'):
        ev.current_stream_wait()


def test_cupy_calls_and_unrecorded_tensors_get_a_plain_event(env):
    order, current, other, comm, now = env
    x = Tensor()
    ev = order.scoped_event('cupy', current, (x,), (x,))
    assert type(ev) is streams.EventOverlap and ev.extra_tensors == (x,)
    ev = order.scoped_event('torch', current, (), (x,))
    assert type(ev) is streams.EventOverlap
    del ev
    gc.collect()
    assert x.marked == []


def test_engram_hooks_share_one_deferred_record(env):
    from deepep_cupy.features.engram.feature import EngramFetchHook
    order, current, other, comm, now = env
    indices, sf = Tensor(), Tensor()
    deferred = streams.DeferredRecord((indices, sf), current, comm)
    event = fakes.FakeEventHandle(comm)
    hooks = [EngramFetchHook(event, indices, ('data', layer), (indices,), deferred) for layer in range(2)]
    assert hooks[1]() == ('data', 1) and current.waits == 1
    del deferred, hooks
    gc.collect()
    assert indices.marked == sf.marked == []            # one hook waited on the fetch's stream: ordered
    deferred = streams.DeferredRecord((indices,), current, comm)
    hooks = [EngramFetchHook(event, indices, 'data', (indices,), deferred) for _ in range(2)]
    del deferred
    hooks.pop()
    gc.collect()
    assert indices.marked == []                         # a hook is still alive
    hooks.pop()
    gc.collect()
    assert indices.marked == [('torch', comm.ptr)]      # every hook dropped uncalled
