"""DeepEP V1 `Buffer` across scale-up domains (first step), one rank per process:
`get_dispatch_layout` bit for bit against the host reference (`features/legacy/internode.py`: every output, including
`num_tokens_per_rdma_rank`), with and without `async_finish`, and what is refused (`dispatch` / `combine` raise
NotImplementedError before any kernel, `low_latency_mode=True` at construction). Domains from the topology
(`DEEPEP_CUPY_SCALEUP_SIZE` on one GPU), e.g.:

    DEEPEP_CUPY_SCALEUP_SIZE=1 DEEPEP_CUPY_RAIL_TRANSPORT=loopback CUDA_VISIBLE_DEVICES=0 \\
        launch/run_local.sh 2 python -m deepep_cupy.tests.legacy_internode
"""

import numpy as np

from ..runtime import preflight
from . import cli

try:
    import torch
except ImportError as e:  # `--help` works without torch; a run names the extra that brings it
    preflight.exit_if_main(e, __name__, cli.legacy_internode_parser)
    raise

from ..buffers.legacy import Buffer  # noqa: E402
from ..features.legacy import internode  # noqa: E402
from ..utils.envs import init_dist  # noqa: E402


def _topk(seed: int, rank: int, num_tokens: int, num_experts: int, num_topk: int) -> torch.Tensor:
    """Rank `rank`'s routing (rank 1 holds no tokens: the 0-token case)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    n = 0 if rank == 1 else num_tokens
    idx = torch.topk(torch.rand(n, num_experts, generator=g), num_topk).indices
    if n:
        idx[::5, -1] = -1
    return idx


def _check(name: str, rank: int, got, want) -> None:
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape or not np.array_equal(got, want):
        where = np.argwhere(got != want)[:1].tolist() if got.shape == want.shape else 'shape'
        raise AssertionError(f'rank {rank}: {name} differs at {where}: got {got.shape} {got.ravel()[:8]}, '
                             f'expected {want.shape} {want.ravel()[:8]}')


def main() -> None:
    args = cli.legacy_internode_parser().parse_args()
    rank, num_ranks, group = init_dist(seed=args.seed)
    buf = Buffer(group, 0, 0, explicitly_destroy=True)
    D, S = buf.num_domains, buf.num_scaleup_ranks
    assert D > 1, f'this program needs several scale-up domains (DEEPEP_CUPY_SCALEUP_SIZE), got {D} x {S}'
    topk = [_topk(args.seed, r, args.num_tokens, args.num_experts, args.num_topk) for r in range(num_ranks)]
    ref = internode.reference_internode([t.numpy() for t in topk], args.num_experts, D, 12)[rank]
    idx = topk[rank].cuda()
    for async_finish in (False, True):
        per_rank, per_domain, per_expert, in_rank, event = buf.get_dispatch_layout(
            idx, args.num_experts, previous_event=Buffer.capture() if async_finish else None,
            async_finish=async_finish, allocate_on_comm_stream=async_finish)
        if async_finish:
            event.current_stream_wait()
        _check('num_tokens_per_rdma_rank', rank, per_domain.cpu().numpy(), ref.num_tokens_per_rdma_rank)
        _check('is_token_in_rank', rank, in_rank.cpu().numpy(), ref.is_token_in_rank)
        _check('num_tokens_per_rank', rank, per_rank.cpu().numpy(), ref.is_token_in_rank.sum(0))
        ids = topk[rank].numpy()
        want_expert = np.bincount(ids[ids >= 0], minlength=args.num_experts)
        _check('num_tokens_per_expert', rank, per_expert.cpu().numpy(), want_expert)
    x = torch.zeros(idx.shape[0], args.hidden, dtype=torch.bfloat16, device='cuda')
    for what, call in (('dispatch', lambda: buf.dispatch(x, topk_idx=idx, num_tokens_per_rank=per_rank,
                                                           num_tokens_per_rdma_rank=per_domain,
                                                           is_token_in_rank=in_rank,
                                                           num_tokens_per_expert=per_expert)),
                       ('combine', lambda: buf.combine(x, None))):
        try:
            call()
        except NotImplementedError as e:
            assert 'scale-up domains' in str(e), e
        else:
            raise AssertionError(f'{what} across domains should raise NotImplementedError (not implemented yet)')
    buf.destroy()
    try:
        Buffer(group, 0, 0, low_latency_mode=True, explicitly_destroy=True)
    except NotImplementedError as e:
        assert 'low-latency mode across scale-up domains' in str(e), e
    else:
        raise AssertionError('low_latency_mode=True across domains should raise NotImplementedError')
    torch.cuda.synchronize()
    print(f'[rank {rank}] legacy internode ({D} x {S}): get_dispatch_layout bitwise, refusals OK', flush=True)


if __name__ == '__main__':
    main()
