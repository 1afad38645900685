"""The notify kernel with its grid capped at the co-resident blocks (kernels_cu/ep_notify.cu: a block then takes
several tiles of 256 tokens, counted before the grid barrier and placed after it), on a GPU, ranks sharing it:

- `ElasticBuffer` dispatches (CPU sync, no sync, expanded) whose notify grid is forced down to 1, 3 and 7 blocks give
  bitwise what the uncapped grid gives: the notify's own outputs in the handle (slots, expert positions, receive
  layout, prefix sums), the rows, top-k ids and weights, the metadata, and the combine of the rows; the CPU-sync rows
  also equal the reference from every rank's gathered inputs (DEEPEP_CUPY_EP_FUSED_NOTIFY=0: the notify kernel in
  every mode);
- a rank holding more tokens than the device's co-resident notify blocks cover in one pass (`--large-tokens`, several
  tiles per block at the real cap; before the cap such a dispatch raised, e.g. DeepEP V1's internode mode: a
  cooperative grid of 458 blocks where 396 fit) against the reference and against a forced cap of 5 blocks;
- DeepEP V1's `Buffer` (normal mode), whose notify also writes the channel prefix matrices: every handle tensor and
  output capped at 3 blocks equals the uncapped one.

    launch/run_local.sh 2 python3 tests/notify_grid_prog.py [--num-tokens 20000 --large-tokens 300000]

tests/gpu/test_gpu_ep_notify_grid.py runs it at 1 and 2 ranks. Ends with `notify grid test: PASSED` (exit 0)."""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from deepep_cupy import ElasticBuffer  # noqa: E402
from deepep_cupy.features.ep import feature as ep_feature  # noqa: E402
from deepep_cupy.features.ep import plan as ep_plan  # noqa: E402
from deepep_cupy.features.ep.kernels import NOTIFY_THREADS  # noqa: E402
from deepep_cupy.runtime.group import get_group  # noqa: E402
from deepep_cupy.tests.common import gather_tensors  # noqa: E402
from deepep_cupy.utils import refs  # noqa: E402
from deepep_cupy.utils.envs import init_dist  # noqa: E402

UNCAPPED = ep_plan.notify_grid
MODES = ('cpu-sync', 'no-sync', 'expand')


def force_cap(cap):
    """Notify grids of the next bindings: at most `cap` blocks (None: the device's co-resident blocks, as shipped);
    every bound call is forgotten, so the next call of each signature binds under it."""
    ep_plan.notify_grid = UNCAPPED if cap is None else (lambda n, co_resident: UNCAPPED(n, min(co_resident, cap)))
    ep_feature.set_default_num_sms(0)


def host(a) -> np.ndarray:
    """A numpy copy of a CUDA tensor (bfloat16 as its raw int16 bits)."""
    if a.dtype == torch.bfloat16:
        a = a.view(torch.int16)
    return a.contiguous().cpu().numpy()


def make_inputs(rank: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int, seed: int):
    """`num_tokens - 37 * rank` tokens (tiles not full); about 10% of the top-k slots are -1, and every 97th token
    goes nowhere (all -1)."""
    n = max(1, num_tokens - 37 * rank)
    g = torch.Generator(device='cuda').manual_seed(seed * 1000 + rank)
    x = torch.randn((n, hidden), device='cuda', generator=g).to(torch.bfloat16)
    scores = torch.rand((n, num_experts), device='cuda', generator=g)
    idx = torch.topk(scores, num_topk, dim=1).indices.to(torch.int64)
    idx.masked_fill_(torch.rand((n, num_topk), device='cuda', generator=g) < 0.1, -1)
    idx[::97] = -1
    w = torch.rand((n, num_topk), device='cuda', generator=g)
    return x, idx, w


def notify_grids(buf):
    return sorted(b.notify.grid[0] for b in buf._ep._bound.values() if getattr(b, 'notify', None) is not None)


def dispatch_outputs(buf, x, idx, w, num_experts: int, mode: str) -> dict:
    """Everything a dispatch of `mode` defines, on the host, and the combine of its rows."""
    kw = dict(num_experts=num_experts, do_cpu_sync=mode != 'no-sync')
    if mode == 'expand':
        kw.update(do_expand=True, expert_alignment=4)
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, idx, w, **kw)
    num_recv = int(host(handle.psum_num_recv_tokens_per_scaleup_rank)[-1])
    meta = host(handle.recv_src_metadata)[:num_recv]
    if mode == 'expand':
        rows = meta[:, 2:].ravel()
        rows = np.unique(rows[rows >= 0])
    else:
        rows = np.arange(num_recv)
    out = {name: host(getattr(handle, name)) for name in (
        'dst_buffer_slot_idx', 'send_expert_pos', 'recv_layout', 'psum_num_recv_tokens_per_scaleup_rank',
        'psum_num_recv_tokens_per_expert', 'num_unaligned_recv_tokens_per_expert')}
    out.update(rows=rows, meta=meta, x=host(recv_x)[rows])
    if recv_idx is not None:
        out.update(topk=host(recv_idx)[rows], weights=host(recv_w)[rows])
    combined, _, _ = buf.combine(recv_x, handle)
    out['combined'] = host(combined)
    torch.cuda.synchronize()
    return out


def check_same(got: dict, want: dict, what: str) -> None:
    for name, value in want.items():
        if not np.array_equal(got[name], value):
            diff = np.argwhere(got[name] != value) if got[name].shape == value.shape else None
            first = None if diff is None or not len(diff) else tuple(diff[0])
            raise AssertionError(f'{what}: {name} differs from the uncapped grid (shape {got[name].shape} vs '
                                 f'{value.shape}; first mismatch at {first})')


def check_reference(got: dict, ref, what: str) -> None:
    checks = (('x', host(ref.recv_x)), ('topk', ref.recv_topk_idx.numpy()),
              ('meta column 0', ref.recv_src_token_global_idx.numpy()))
    for name, want in checks:
        value = got['meta'][:, 0] if name == 'meta column 0' else got[name]
        if value.shape != want.shape or not np.array_equal(value, want):
            raise AssertionError(f'{what}: {name} differs from the reference ({value.shape} vs {want.shape})')


def check_v2(group, rank: int, args, num_tokens: int, hidden: int, caps, what: str, tiled: bool = False) -> None:
    """`tiled`: the device's co-resident blocks (cap None) must not cover this rank's tiles in one pass."""
    E, K = args.num_experts, args.num_topk
    x, idx, w = make_inputs(rank, num_tokens, hidden, E, K, args.seed)
    xs, idxs, ws = (list(t) for t in zip(*gather_tensors(group, (x, idx, w))))
    ref = refs.dispatch_from_gathered(xs, None, idxs, ws, rank, num_tokens, E)
    tiles = -(-x.shape[0] // NOTIFY_THREADS)
    buf = ElasticBuffer(group, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=K, explicitly_destroy=True)
    try:
        want = {}
        for cap in caps:
            force_cap(cap)
            for mode in MODES:
                got = dispatch_outputs(buf, x, idx, w, E, mode)
                tag = f'{what} cap={cap} {mode}'
                if mode == 'cpu-sync':
                    check_reference(got, ref, tag)
                if mode in want:
                    check_same(got, want[mode], tag)
                else:
                    want[mode] = got
            grids = notify_grids(buf)
            assert grids, f'{what}: no notify launch was bound'
            if cap is not None:
                assert all(g == min(tiles, cap) for g in grids), f'{what} cap={cap}: notify grids {grids}'
            elif tiled:
                assert max(grids) < tiles, (f'{what}: {tiles} tiles fit the {max(grids)} co-resident blocks: pass '
                                            f'more --large-tokens to cap the grid')
            print(f'[rank {rank}] {what}: {x.shape[0]} tokens ({tiles} tiles), cap={cap}, notify grids {grids}: '
                  f'equal', flush=True)
    finally:
        force_cap(None)
        buf.destroy()


def check_v1(group, rank: int, args) -> None:
    from deepep_cupy.v1.buffer import Buffer, Config
    E, K = args.num_experts, args.num_topk
    x, idx, w = make_inputs(rank, args.num_tokens, args.hidden, E, K, args.seed + 1)
    buf = Buffer(group, int(1e9), 0, explicitly_destroy=True)
    try:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        outs = []
        for cap in (None, 3):
            force_cap(cap)
            recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
                x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, config=Config(24, 8, 256))
            combined, _, _ = buf.combine(recv_x, handle)
            torch.cuda.synchronize()
            outs.append([host(recv_x), host(recv_idx), host(recv_w), np.array(counts), host(combined)] +
                        [host(t) for t in handle if isinstance(t, torch.Tensor)])
        for i, (a, b) in enumerate(zip(*outs)):
            assert np.array_equal(a, b), f'V1 Buffer: output / handle element {i} differs between the grids'
        print(f'[rank {rank}] V1 Buffer: {x.shape[0]} tokens, capped at 3 blocks: equal', flush=True)
    finally:
        force_cap(None)
        buf.destroy()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--num-tokens', type=int, default=20000)
    p.add_argument('--hidden', type=int, default=256)
    p.add_argument('--num-topk', type=int, default=8)
    p.add_argument('--num-experts', type=int, default=64)
    p.add_argument('--large-tokens', type=int, default=300000, help='tokens of the large case (0: skip it)')
    p.add_argument('--large-hidden', type=int, default=128)
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args()
    # The notify kernel in every mode: the fused notify + dispatch (the default at one rank without expansion) runs
    # the notify's work with a block per tile always (features/ep/fused.py), never capped.
    os.environ['DEEPEP_CUPY_EP_FUSED_NOTIFY'] = '0'
    rank, _, _ = init_dist(seed=args.seed)
    group = get_group()
    check_v2(group, rank, args, args.num_tokens, args.hidden, (None, 1, 3, 7), 'ElasticBuffer')
    if args.large_tokens:
        check_v2(group, rank, args, args.large_tokens, args.large_hidden, (None, 5), 'ElasticBuffer large',
                 tiled=True)
    check_v1(group, rank, args)
    group.barrier()
    if rank == 0:
        print('notify grid test: PASSED', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
