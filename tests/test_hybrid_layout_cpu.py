"""Sizes of the fused hybrid design (tests/references/hybrid_layout.py): it agrees with the one-domain layout, the
regions are aligned, ordered and disjoint, the slot counts match DeepEP V2's worst case (REFERENCE.md 2.3) and
SCALEOUT.md 3.1's figures, and the size hint covers the layout."""

import pytest
from references import hybrid_layout as hlay

from deepep_cupy.constants import BUFFER_ALIGNMENT
from deepep_cupy.features.ep import layout as ep_layout
from deepep_cupy.runtime import rails
from deepep_cupy.runtime.workspace import EP_NOTIFY, WORKSPACE_BYTES


def test_the_layout_agrees_with_the_one_domain_layout_and_the_rails():
    for name in ('NUM_MAX_TOPK', 'NUM_MAX_LOCAL_EXPERTS', 'SF_GROUP', 'NOTIFY_TOKENS_PER_BLOCK'):
        assert getattr(hlay, name) == getattr(ep_layout, name), name
    for k in (1, 5, 8, 32):
        assert hlay.meta_bytes(k) == ep_layout.meta_bytes(k)
        for hidden, num_sf in ((7168, 56), (2048, 0), (24, 1)):
            assert hlay.message_bytes(2 * hidden, num_sf, k) == ep_layout.message_bytes(2 * hidden, num_sf, k)
            assert hlay.combine_row_bytes(hidden, k) == ep_layout.combine_slot_bytes(hidden, k)
    assert (hlay.RAIL_HEADER_BYTES, hlay.RAIL_FLAG_STRIDE, hlay.RAIL_FLAGS_BYTES) == \
        (rails.HEADER_BYTES, rails.FLAG_STRIDE, rails.FLAGS_BYTES)
    assert hlay.NOTIFY_AREA_BYTES == EP_NOTIFY.num_bytes
    # A rail message is the scale-up message plus R forward slots in its meta
    assert hlay.rail_message_bytes(14336, 56, 8, 8) == hlay.message_bytes(14336, 56, 8) + 32


@pytest.mark.parametrize('N,R,amr', [(2, 1, True), (2, 8, True), (4, 2, False), (8, 8, True)])
def test_regions_are_aligned_ordered_and_disjoint(N, R, amr):
    lay = hlay.HybridLayout(N, R, 1000, 7168, 8, amr, data_offset=WORKSPACE_BYTES)
    regions = [(lay.scaleup_recv_offset, lay.scaleup_recv_bytes), (lay.stage_offset, lay.stage_bytes),
               (lay.scratch_offset, lay.scratch_bytes), (lay.rail_flags_offset, hlay.RAIL_FLAGS_BYTES),
               (lay.rail_notify_send_offset, (N - 1) * lay.notify_region_bytes),
               (lay.rail_notify_recv_offset, (N - 1) * lay.notify_region_bytes),
               (lay.rail_send_offset, (N - 1) * lay.rail_region_bytes),
               (lay.rail_recv_offset, (N - 1) * lay.rail_region_bytes)]
    assert regions[0][0] >= WORKSPACE_BYTES
    for (a, na), (b, _) in zip(regions, regions[1:]):
        assert a % hlay.REGION_ALIGNMENT == 0 and a + na <= b
    assert regions[-1][0] + regions[-1][1] <= lay.end_offset
    assert lay.rail_begin_offset == lay.rail_flags_offset
    assert lay.message_bytes % 16 == 0 and lay.rail_message_bytes % 16 == 0 and lay.rail_region_bytes % 16 == 0
    # Scale-up regions in row order r * N + n, one M-slot region per source rank
    offsets = [lay.scaleup_region_offset(n, r) for r in range(R) for n in range(N)]
    assert offsets == sorted(offsets) and offsets[1] - offsets[0] == 1000 * lay.message_bytes
    assert offsets[-1] + 1000 * lay.message_bytes == lay.scaleup_recv_offset + lay.scaleup_recv_bytes
    # Rail regions: what n sends m sits in region index(n, m) of n's send area, lands in index(m, n) of m's recv area
    areas = lay.rail_areas('data')
    for n in range(N):
        sends = [areas.send_region(n, m) for m in range(N) if m != n]
        assert len(set(sends)) == N - 1 and all(areas.send_offset <= s < areas.recv_offset for s in sends)
        assert {areas.recv_region(n, m) for m in range(N) if m != n} == \
            {areas.recv_offset + i * areas.region_bytes for i in range(N - 1)}
    with pytest.raises(ValueError, match='no rail region for itself'):
        hlay.region_index(1, 1)
    # The combine fits the data rail regions, every unit of every token
    assert lay.rail_region_bytes >= 16 + 1000 * lay.num_rail_units * lay.combine_row_bytes
    assert lay.notify_region_bytes >= 16 + 4 * R * (1 + hlay.NUM_MAX_LOCAL_EXPERTS)


def test_combine_stage_and_rail_units_per_recipe():
    assert (hlay.num_stage_slots(8, 8, True), hlay.num_rail_units(8, 8, True)) == (8, 1)
    assert (hlay.num_stage_slots(2, 8, True), hlay.num_rail_units(2, 8, True)) == (2, 1)
    assert (hlay.num_stage_slots(2, 8, False), hlay.num_rail_units(2, 8, False)) == (8, 8)


def test_slot_counts_match_deepep_v2_and_the_memo():
    # Scale-up receive slots: DeepEP V2's [R][N * M]; the send side is [N - 1][M] (NCCL needs a range per peer)
    for n, r, m in ((2, 8, 4096), (4, 8, 512), (8, 8, 128)):
        ours, v2 = hlay.dispatch_slots(n, r, m), hlay.deepep_v2_dispatch_slots(n, r, m)
        assert ours['scaleup_recv'] == v2['scaleup_recv'] == n * r * m
        assert ours['scaleout_send'] == (n - 1) * v2['scaleout_send']
        assert ours['scaleout_recv'] < v2['scaleout_recv']
    # SCALEOUT.md 3.1: EP64 BF16 at T = 4096 needs ~3.8 GB of scale-up slots (64 x 4096 x 14.5 KB)
    ep64 = hlay.HybridLayout(8, 8, 4096, 7168, 8, True, data_offset=0)
    assert 3.7e9 < ep64.scaleup_recv_bytes < 4.0e9
    assert 14000 < ep64.message_bytes < 15000
    # ... and rail buffers of 2 (N - 1) T messages
    assert ep64.sizes()['rail_data'] == 2 * 7 * ep64.rail_region_bytes
    assert ep64.rail_region_bytes == 16 + 4096 * max(ep64.rail_message_bytes, ep64.combine_row_bytes)


def test_size_hint_covers_the_layout():
    for n, r, m, h, k in ((2, 1, 128, 7168, 8), (2, 4, 4096, 7168, 0), (4, 2, 77, 24, 3)):
        hint = hlay.buffer_size_hint(n, r, m, h, k)
        assert hint % BUFFER_ALIGNMENT == 0
        lay = hlay.HybridLayout(n, r, m, h, k or 32, True, data_offset=WORKSPACE_BYTES)
        assert lay.end_offset - WORKSPACE_BYTES <= hint
        assert hlay.buffer_size_hint(n, r, m, h, k, use_fp8_dispatch=True) == hint
        # At least the one-domain needs of the same world (the scale-up slots are the same, plus the rails)
        assert hint >= ep_layout.buffer_size_hint(n * r, m, h, k) - 2 * BUFFER_ALIGNMENT
    with pytest.raises(ValueError, match='at least 2 domains'):
        hlay.HybridLayout(1, 8, 128, 7168, 8, True, 0)


def test_notify_capacity():
    hlay.check_notify_capacity(8, 8, 256)
    hlay.check_notify_capacity(8, 8, 16000)
    with pytest.raises(ValueError, match='notify counts'):
        hlay.check_notify_capacity(8, 8, 64 * 1024)
