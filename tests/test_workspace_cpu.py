"""The workspace / host-mapped memory map: kernels_cu/common/workspace.cuh is the one source, runtime/workspace.py its
Python mirror. This test reads the header's constants and checks that both agree, that the regions are disjoint,
aligned and inside their area, and that every feature takes its words from the map."""

import re

import pytest

from deepep_cupy import constants
from deepep_cupy.buffers import base
from deepep_cupy.features import barrier, peer_copy
from deepep_cupy.features.agrs import kernels as agrs
from deepep_cupy.features.engram import plan as engram
from deepep_cupy.features.ep import feature as ep
from deepep_cupy.features.ep import kernels as ep_kernels
from deepep_cupy.features.lb import plan as lb
from deepep_cupy.features.pp import plan as pp
from deepep_cupy.jit import compiler
from deepep_cupy.runtime import errors, workspace


def header_constants():
    """`name -> value` of every `constexpr uint64_t k... = <decimal>;` of the header."""
    text = (compiler.kernels_dir() / 'common' / 'workspace.cuh').read_text()
    return {name: int(value) for name, value in re.findall(r'constexpr uint64_t (k\w+) = (\d+);', text)}


def test_header_and_mirror_agree():
    c = header_constants()
    assert c.pop('kWorkspaceBytes') == workspace.WORKSPACE_BYTES
    assert c.pop('kHostMappedBytes') == workspace.HOST_MAPPED_BYTES
    for prefix, table in (('kWs', workspace.WORKSPACE), ('kHost', workspace.HOST_MAPPED)):
        for name, region in table.items():
            assert c.pop(f'{prefix}{name}Offset') == region.offset, name
            assert c.pop(f'{prefix}{name}Bytes') == region.num_bytes, name
    assert c == {}, f'constants of the header without a mirror: {sorted(c)}'


@pytest.mark.parametrize('table, total', [(workspace.WORKSPACE, workspace.WORKSPACE_BYTES),
                                          (workspace.HOST_MAPPED, workspace.HOST_MAPPED_BYTES)])
def test_regions_are_disjoint_aligned_and_inside(table, total):
    regions = list(table.values())
    assert regions == sorted(regions)
    for a, b in zip(regions, regions[1:]):
        assert a.end <= b.offset, (a, b)
    assert all(r.offset % 16 == 0 and r.num_bytes > 0 for r in regions)
    assert regions[-1].end <= total


def test_features_take_their_words_from_the_map():
    assert (peer_copy.CTRL_OFFSET, peer_copy.CTRL_BYTES) == workspace.PEER_COPY
    assert (pp.CTRL_OFFSET, pp.CTRL_BYTES) == workspace.PP and pp.ERROR_RECORD_OFFSET == workspace.HOST_PP_ERROR.offset
    assert (agrs.CTRL_OFFSET, agrs.CTRL_BYTES) == workspace.AGRS
    assert (engram.CTRL_OFFSET, engram.CTRL_BYTES) == workspace.ENGRAM
    assert engram.HOST_RANGE_OFFSET == workspace.HOST_ENGRAM_RANGE.offset
    assert (lb.CTRL_OFFSET, lb.CTRL_BYTES) == workspace.LB
    assert barrier.SIGNAL_OFFSET == workspace.BARRIER.offset
    assert barrier.TEST_CHECK_OFFSET == workspace.BARRIER_TEST.offset
    assert ep.HOST_COUNTS_OFFSET == workspace.HOST_EP_COUNTS.offset
    assert ep.HOST_RANGE_OFFSET == workspace.HOST_EP_RANGE.offset
    assert ep_kernels.COMBINE_CHUNK_SIGNAL_BYTES == workspace.EP_CHUNK_SIGNAL.num_bytes
    assert base.WORKSPACE_BYTES == workspace.WORKSPACE_BYTES and base.HOST_MAPPED_BYTES == workspace.HOST_MAPPED_BYTES
    # What the regions hold fits them.
    assert 4 * errors.ERROR_RECORD_WORDS <= workspace.HOST_ERROR_RECORD.num_bytes
    assert 4 * (3 + constants.NUM_MAX_LOCAL_EXPERTS) <= workspace.HOST_EP_COUNTS.num_bytes


def test_kernels_use_the_map_not_numbers():
    """Each family's control area is declared from the map (`k...CtrlOffset = kWs...Offset`), and no kernel file
    spells a workspace offset as a number."""
    root = compiler.kernels_dir()
    for family, name in (('peer_copy', 'PeerCopy'), ('pp', 'PP'), ('agrs', 'Agrs'), ('engram', 'Engram'),
                         ('lb', 'LB')):
        source = (root / f'{family}.cu').read_text()
        assert re.search(rf'k{name}CtrlOffset = kWs{name}Offset;', source), family
        assert re.search(rf'k{name}CtrlBytes = kWs{name}Bytes;', source), family
    ep_header = (root / 'common' / 'ep.cuh').read_text()
    for name in ('kCtrlOffset = kWsEPCtrlOffset', 'kNotifyOffset = kWsEPNotifyOffset',
                 'kChunkSignalOffset = kWsEPChunkSignalOffset', 'kChunkSignalBytes = kWsEPChunkSignalBytes'):
        assert name in ep_header
    assert 'kErrorClaimOffset = kWsErrorClaimOffset' in (root / 'common' / 'timeout.cuh').read_text()
    numbers = {str(r.offset) for r in workspace.WORKSPACE.values() if r.offset >= 4096}
    for path in [*root.glob('*.cu'), *(root / 'common').glob('*.cuh')]:
        if path.name == 'workspace.cuh':
            continue
        code = re.sub(r'//[^\n]*', '', path.read_text())
        found = numbers & set(re.findall(r'\b\d+\b', code))
        assert not found, f'{path.name} spells workspace offsets {sorted(found)}: use common/workspace.cuh'
