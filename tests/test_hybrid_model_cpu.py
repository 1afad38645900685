"""perf/hybrid_model.py: the scale-out performance model reproduces SCALEOUT.md §4's inputs (p_node, rail and NVLink
bytes per rank) and orders its schedules (P2 never slower than P1)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'perf'))
import hybrid_model as hm  # noqa: E402


@pytest.mark.parametrize('nodes, p_node', [(2, 0.997), (4, 0.904), (8, 0.662)])
def test_p_node_matches_the_memo(nodes, p_node):
    assert hm.Routing(4096, 7168, 256, 8, 8, nodes).p_node == pytest.approx(p_node, abs=1e-3)


@pytest.mark.parametrize('nodes, rail_mb, nvlink_mb', [(2, 31, 175), (4, 83, 195), (8, 142, 206)])
def test_dispatch_bytes_match_the_memo(nodes, rail_mb, nvlink_mb):
    res = hm.model(hm.Machine(), hm.Routing(4096, 7168, 256, 8, 8, nodes))
    assert res[('dispatch', 'P1')]['rail_mb'] == pytest.approx(rail_mb, rel=0.05)
    assert res[('dispatch', 'P1')]['nvlink_mb'] == pytest.approx(nvlink_mb, rel=0.05)


@pytest.mark.parametrize('tokens', [128, 4096])
@pytest.mark.parametrize('nodes', [2, 4])
def test_pipelining_never_loses(tokens, nodes):
    res = hm.model(hm.Machine(), hm.Routing(tokens, 7168, 256, 8, 8, nodes))
    for op in ('dispatch', 'combine'):
        assert 0 < res[(op, 'P2')]['us'] <= res[(op, 'P1')]['us']


def test_one_domain_sends_nothing_over_the_rails():
    res = hm.model(hm.Machine(), hm.Routing(4096, 7168, 256, 8, 8, 1))
    assert res[('dispatch', 'P1')]['rail_mb'] == 0


def test_cli_prints_both_node_counts(capsys):
    assert hm.main(['--nodes', '2', '4']) == 0
    out = capsys.readouterr().out
    assert '8x2 (EP16)' in out and '8x4 (EP32)' in out and 'published' in out
