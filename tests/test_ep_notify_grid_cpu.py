"""The notify kernel's grid without a GPU: a block per 256 tokens, capped at the blocks that can be co-resident (the
launch is cooperative; past the cap a block takes several tiles of tokens, kernels_cu/ep_notify.cu):
- `plan.notify_grid` and `Kernel.co_resident_blocks` (occupancy x SMs, memoised; a larger cooperative grid raises);
- a dispatch of any token count the buffer accepts binds a notify grid within the co-resident blocks: 200k tokens,
  and the inner dispatch of DeepEP V1's internode mode at 2 domains x 1 rank (the hybrid engine's union of N * M rows,
  M from num_nvl_bytes = 2e9: 117040 rows, 458 blocks where an H100 holds 396), CPU sync and not, 1 and 2 ranks;
- the kernel's split of the tiles over the blocks (mirrored here): contiguous ranges in block order covering every tile
  once, so that positions (counts of earlier tokens) do not depend on the grid.
tests/gpu/test_gpu_ep_notify_grid.py runs the capped kernel on a GPU, bitwise against the uncapped grid."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import fakes  # noqa: E402

from deepep_cupy import constants  # noqa: E402
from deepep_cupy.features.ep import feature as ep_feature  # noqa: E402
from deepep_cupy.features.ep import kernels as ep_kernels  # noqa: E402
from deepep_cupy.features.ep import plan as ep_plan  # noqa: E402
from deepep_cupy.jit import launch  # noqa: E402
from deepep_cupy.runtime import interop  # noqa: E402
from deepep_cupy.runtime.sizes import ceil_div  # noqa: E402
from deepep_cupy.v1 import internode as v1_internode  # noqa: E402

H, K, E = 64, 8, 256
CO_RESIDENT = fakes.RecordingKernel.CO_RESIDENT_BLOCKS
NOTIFY = 'deepep::notify_dispatch'
# The failing V1 internode run: 2 domains x 1 rank, Buffer(group, 2e9, 1e9), hidden 2048, top-8: M = 58520 tokens per
# rank, and the intranode dispatch of the hybrid engine gets the N * M union rows.
V1_UNION_ROWS = 2 * v1_internode.internode_tokens(2, 1, int(2e9), int(1e9), 2048, 8)


def test_notify_grid_is_a_block_per_tile_up_to_the_co_resident_blocks():
    assert V1_UNION_ROWS == 117040
    for num_tokens, want in ((0, 1), (1, 1), (256, 1), (257, 2), (101376, 396), (101377, 396), (V1_UNION_ROWS, 396),
                             (200000, 396), (1 << 22, 396)):
        assert ep_plan.notify_grid(num_tokens, 396) == want, num_tokens
    assert ep_plan.notify_grid(5000, 1) == 1 and ep_plan.notify_grid(5000, 7) == 7


def test_co_resident_blocks_are_occupancy_times_sms(monkeypatch):
    """Memoised per (threads, shared memory); the shared memory limit raised before the occupancy is asked for it;
    a cooperative bind beyond the blocks raises ValueError naming both counts."""
    calls = []

    class Driver:
        @staticmethod
        def funcSetAttribute(fn, attr, value):  # noqa: N802 (cupy's name)
            calls.append(('smem', value))

        @staticmethod
        def launchKernel(*args):  # noqa: N802
            calls.append(('plain', args))

        @staticmethod
        def launchCooperativeKernel(*args):  # noqa: N802
            calls.append(('cooperative', args))

    monkeypatch.setattr(launch, '_DRIVER', [Driver])
    spec = ep_kernels.notify_spec(2, constants.topk_bucket(K))
    kernel = launch.Kernel(spec, SimpleNamespace(ptr=0xF00), 0)
    kernel._num_sms = 132

    def occupancy(block, shared_mem=0):
        calls.append(('occupancy', block, shared_mem))
        return 3 if shared_mem < (64 << 10) else 1
    kernel.max_active_blocks_per_sm = occupancy
    assert kernel.co_resident_blocks(256, 10 << 10) == 396
    assert kernel.co_resident_blocks(256, 10 << 10) == 396
    assert calls == [('occupancy', 256, 10 << 10)]
    assert kernel.co_resident_blocks(256, 100 << 10) == 132
    assert calls[1:] == [('smem', 100 << 10), ('occupancy', 256, 100 << 10)]
    args = {p: 0 for p in spec.param_names}
    kernel.bind(396, 256, shared_mem=10 << 10, cooperative=True, **args)
    with pytest.raises(ValueError, match='cooperative grid of 397 blocks exceeds the 396 blocks'):
        kernel.bind(397, 256, shared_mem=10 << 10, cooperative=True, **args)


class Kernels:
    """Recording EP kernels of `num_ranks` ranks (tests/fakes.py), the notify's co-resident blocks as given."""

    def __init__(self, log, num_ranks, co_resident):
        b = constants.topk_bucket(K)
        self.notify = fakes.RecordingKernel(ep_kernels.notify_spec(num_ranks, b), log, co_resident=co_resident)
        self.dispatch = fakes.RecordingKernel(ep_kernels.dispatch_spec(num_ranks, b), log)
        self.combine = {lr: fakes.RecordingKernel(ep_kernels.combine_spec(num_ranks, b, lr), log)
                        for lr in (True, False)}
        self.fused = fakes.RecordingKernel(ep_kernels.fused_dispatch_spec(num_ranks, b), log)

    def fused_dispatch(self):
        return self.fused


def make_buffer(monkeypatch, num_ranks: int, num_tokens: int, co_resident: int = CO_RESIDENT):
    """An `ElasticBuffer` without a GPU for `num_tokens` tokens per rank (tests/fakes.py), launches recorded."""
    buf = fakes.make_buffer(num_ranks, 0, 4 << 30, num_max_tokens_per_rank=num_tokens, num_topk=K)
    buf.launches = log = []
    monkeypatch.setattr(ep_feature, 'EPKernels', lambda n, bucket: Kernels(log, n, co_resident))
    current = fakes.FakeStream('current')
    monkeypatch.setattr(interop, 'current_stream', lambda like=None: current)
    monkeypatch.setattr(interop, 'stream_getter', lambda kind, device: lambda: current)
    ep = buf._ep_feature()
    monkeypatch.setattr(ep, '_wait_host_counts', lambda seq, n: (num_ranks * num_tokens, num_ranks * num_tokens * K,
                                                                 [1] * n))
    monkeypatch.setattr(ep, '_start_range', lambda t, ptr, n, k, stream: lambda: (int(t.min()), int(t.max())))
    return buf


def inputs(num_tokens: int):
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(num_tokens, H, dtype=torch.bfloat16)
    idx = torch.randint(0, E, (num_tokens, K), generator=g)
    idx[::7, -1] = -1
    return x, idx, torch.rand(num_tokens, K, generator=g)


@pytest.mark.parametrize('num_tokens', [V1_UNION_ROWS, 200000])
@pytest.mark.parametrize('num_ranks', [1, 2])
@pytest.mark.parametrize('cpu_sync', [True, False])
def test_a_dispatch_of_many_tokens_binds_a_co_resident_notify_grid(monkeypatch, num_tokens, num_ranks, cpu_sync):
    """(At one rank without CPU sync the fused kernel is the default where it fits: not at these sizes, more notify
    blocks than SMs, so the notify kernel runs there too.)"""
    buf = make_buffer(monkeypatch, num_ranks, num_tokens)
    x, idx, w = inputs(num_tokens)
    for _ in range(2):          # the first call binds, the second runs the bound launches
        buf.launches.clear()
        buf.dispatch(x, idx, w, num_experts=E, do_cpu_sync=cpu_sync)
        (notify,) = [entry for entry in buf.launches if entry.name.startswith(NOTIFY)]
        assert notify.grid == CO_RESIDENT < ceil_div(num_tokens, ep_kernels.NOTIFY_THREADS)
        assert notify.cooperative and notify.block == ep_kernels.NOTIFY_THREADS
        assert notify.args['num_tokens'] == num_tokens
        assert notify.shared_mem == ep_plan.notify_smem_bytes(E, num_ranks)


def test_the_cap_follows_the_kernel_and_small_grids_stay(monkeypatch):
    """The kernel's own co-resident count (here 7), and below the cap a block per tile, one block not cooperative."""
    for num_tokens, co_resident, grid in ((5000, 7, 7), (1000, 7, 4), (200, 7, 1)):
        buf = make_buffer(monkeypatch, 2, num_tokens, co_resident)
        x, idx, w = inputs(num_tokens)
        buf.dispatch(x, idx, w, num_experts=E)
        (notify,) = [entry for entry in buf.launches if entry.name.startswith(NOTIFY)]
        assert (notify.grid, notify.cooperative) == (grid, grid > 1), num_tokens


def tiles_of(block: int, num_blocks: int, num_tokens: int, tile: int = ep_kernels.NOTIFY_THREADS) -> range:
    """kernels_cu/ep_notify.cu notify_body's tiles of `block` (several per block when the grid is capped)."""
    num_tiles = max(1, ceil_div(num_tokens, tile))
    per_block = ceil_div(num_tiles, num_blocks)
    if per_block == 1:
        return range(block, block + 1)
    first = min(num_tiles, block * per_block)
    return range(first, min(num_tiles, first + per_block))


@pytest.mark.parametrize('num_tokens', [0, 1, 255, 256, 257, 5000, 101377, V1_UNION_ROWS])
def test_the_blocks_take_contiguous_tiles_in_order(num_tokens):
    """Grids from 1 block to a block per tile (`notify_grid`'s): the blocks' tiles concatenated in block order are the
    tiles in order, each once."""
    num_tiles = max(1, ceil_div(num_tokens, ep_kernels.NOTIFY_THREADS))
    for num_blocks in sorted(n for n in {1, 2, 3, 7, 396, num_tiles - 1, num_tiles} if 1 <= n <= num_tiles):
        covered = [t for b in range(num_blocks) for t in tiles_of(b, num_blocks, num_tokens)]
        assert covered == list(range(num_tiles)), (num_tokens, num_blocks)


def test_positions_do_not_depend_on_the_grid():
    """A host model of the two passes (count each block's tiles, exchange the block totals, place each tile from the
    block's base): every token's slot at each destination is the count of earlier tokens going there, for any grid."""
    rng = np.random.default_rng(0)
    num_tokens, num_ranks = 3000, 4
    dst = rng.random((num_tokens, num_ranks)) < 0.4
    want = np.where(dst, np.cumsum(dst, axis=0) - 1, -1)
    T = ep_kernels.NOTIFY_THREADS
    for num_blocks in (1, 3, 5, 12):
        totals = [sum(dst[t * T:(t + 1) * T].sum(0) for t in tiles_of(b, num_blocks, num_tokens)) for b in
                  range(num_blocks)]
        got = np.full_like(want, -1)
        for b in range(num_blocks):
            base = sum(totals[:b], np.zeros(num_ranks, dtype=np.int64))
            for t in tiles_of(b, num_blocks, num_tokens):
                rows = dst[t * T:(t + 1) * T]
                got[t * T:(t + 1) * T] = np.where(rows, base + np.cumsum(rows, axis=0) - 1, -1)
                base = base + rows.sum(0)
        assert np.array_equal(got, want), num_blocks
