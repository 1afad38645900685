"""The design knobs (envs.DesignKnobs) without a GPU: read once per buffer, compared across its ranks in the
configuration all-gather the buffer makes anyway (buffers/base.py `check_configuration`), the error naming each knob
that differs and the ranks of each value; the features read the buffer's copy, not the environment."""

import dataclasses

import fakes
import pytest

from deepep_cupy import envs
from deepep_cupy.buffers import base

KNOBS = {f.name: f'DEEPEP_CUPY_{f.name.upper()}' for f in dataclasses.fields(envs.DesignKnobs)}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in KNOBS.values():
        monkeypatch.delenv(name, raising=False)


def test_knobs_read_from_the_environment(monkeypatch):
    assert envs.DesignKnobs.from_env() == envs.DesignKnobs()      # the defaults are the unset environment's
    monkeypatch.setenv('DEEPEP_CUPY_EP_FUSED_NOTIFY', '0')
    monkeypatch.setenv('DEEPEP_CUPY_ALWAYS_COMM_STREAM', '1')
    monkeypatch.setenv('DEEPEP_CUPY_HYBRID_PIPELINE_ROWS', '64')
    d = envs.DesignKnobs.from_env()
    assert (d.ep_fused_notify, d.always_comm_stream, d.hybrid_pipeline_rows) == (False, True, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.always_comm_stream = False
    assert set(KNOBS) == {'ep_dispatch_overlap', 'ep_fused_notify', 'ep_fused_cooperative', 'combine_cap_all_sms',
                          'always_comm_stream', 'hybrid_pipeline', 'hybrid_pipeline_rows'}
    for name in KNOBS.values():
        assert hasattr(envs, name[len('DEEPEP_CUPY_'):].lower())     # each knob has its documented reader


def _rank1_differs(**changes):
    """A group of 3 seen from rank 0 whose rank 1 sets `changes` (DesignKnobs fields) differently."""
    def others(r, obj):
        settings, wire = obj
        if r != 1:
            return obj
        return settings, dataclasses.replace(envs.DesignKnobs(*wire), **changes).wire()
    return fakes.AgreeingGroup(0, 3, others)


def test_a_buffer_refuses_ranks_whose_design_knobs_differ():
    group = _rank1_differs(ep_fused_notify=True, always_comm_stream=True)
    pattern = (r"DEEPEP_CUPY_EP_FUSED_NOTIFY \(ranks \[0, 2\]: unset; ranks \[1\]: True\), "
               r"DEEPEP_CUPY_ALWAYS_COMM_STREAM \(ranks \[0, 2\]: False; ranks \[1\]: True\): .*must be set alike "
               r"on every rank of a buffer \(this is rank 0\)")
    with pytest.raises(ValueError, match=pattern):
        base.BufferBase(group=group)        # raised before any CUDA work
    assert group.num_collectives == 1       # the configuration's own all-gather carries the knobs


def test_the_configuration_and_the_knobs_share_one_all_gather(monkeypatch):
    monkeypatch.setenv('DEEPEP_CUPY_EP_DISPATCH_OVERLAP', '0')
    group = fakes.AgreeingGroup(0, 4)
    design = base.check_configuration(group, 'X configuration', {'num_bytes': 2}, 1.0)
    assert design == envs.DesignKnobs(ep_dispatch_overlap=False)
    assert group.calls == [('allgather', ({'num_bytes': 2}, design.wire()))]
    # the other settings keep their message
    other = fakes.AgreeingGroup(0, 2, lambda r, obj: ({'num_bytes': 4}, obj[1]))
    with pytest.raises(ValueError, match=r'X configuration must be identical on every rank'):
        base.check_configuration(other, 'X configuration', {'num_bytes': 2}, 1.0)
    with pytest.raises(ValueError, match=r'DEEPEP_CUPY_HYBRID_PIPELINE_ROWS \(ranks \[0, 2\]: 0; ranks \[1\]: 8\)'):
        base.check_configuration(_rank1_differs(hybrid_pipeline_rows=8), 'X configuration', {}, 1.0)


def test_features_read_the_buffers_knobs_not_the_environment(monkeypatch):
    monkeypatch.setenv('DEEPEP_CUPY_EP_DISPATCH_OVERLAP', '0')
    monkeypatch.setenv('DEEPEP_CUPY_COMBINE_CAP_ALL_SMS', '1')
    buf = fakes.make_buffer()
    monkeypatch.delenv('DEEPEP_CUPY_EP_DISPATCH_OVERLAP')         # changed after the buffer was made: not seen
    monkeypatch.delenv('DEEPEP_CUPY_COMBINE_CAP_ALL_SMS')
    ep = buf._ep_feature()
    assert (ep.dispatch_overlap, ep.combine_cap_all_sms) == (False, True)
