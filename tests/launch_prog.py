"""Rank program for `tests/test_dropin_launch.py`: joins the job the way a launcher announced it and prints one JSON
line per rank. Run under torchrun, mpirun, SLURM-style or hand-set RANK/WORLD_SIZE variables.

    python tests/launch_prog.py join     init_dist() (launcher form), then host collectives
    python tests/launch_prog.py refs     init_dist(), then DeepEP's refs.dispatch over torch.distributed (gloo, CPU),
                                         checked against the gathered reference
    python tests/launch_prog.py spawn N  DeepEP's form: torch.multiprocessing.spawn of N local ranks, each calling
                                         init_dist(local_rank, N)

With NO_TORCH=1 in the environment, `import torch` fails in this process (the TCP host group path).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if os.environ.get('NO_TORCH') == '1':
    class _BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name == 'torch' or name.startswith('torch.'):
                raise ImportError(f'{name} is blocked for this test (NO_TORCH=1)')
            return None
    sys.meta_path.insert(0, _BlockTorch())


def report(**fields):
    # One write per line: ranks sharing a pipe (torchrun, mpirun) must not interleave inside a line
    sys.stdout.write('RESULT ' + json.dumps(fields) + '\n')
    sys.stdout.flush()


def join():
    from deepep_cupy.runtime.group import get_group
    from deepep_cupy.utils import envs
    rank, size, group = envs.init_dist(seed=7)
    pg = get_group()
    gathered = pg.allgather_object(rank * 10)
    pg.barrier()
    torch_ok = 'torch' in sys.modules and __import__('torch.distributed').distributed.is_initialized()
    envs.dist_print(f'rank {rank} printed', once_in_node=False)
    report(rank=rank, size=size, host_backend=pg.backend, group=type(group).__name__, gathered=gathered,
           local_rank=pg.local_rank, local_size=pg.local_size, torch_initialized=torch_ok,
           local_seed=envs.get_local_seed())
    if torch_ok:
        # Every rank past its report, then out without torch's teardown: a rank's gloo / store threads can abort it
        # when rank 0's store goes first ("terminate called without an active exception", rc -6; seen in CI, and
        # once more after this barrier and destroy_process_group were added). What this program tests is the join.
        dist = __import__('torch.distributed').distributed
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def refs():
    import torch

    from deepep_cupy.utils import envs
    from deepep_cupy.utils import refs as refs_mod
    rank, size, _ = envs.init_dist(seed=5)
    num_experts, num_topk, hidden, num_max_tokens = 4 * size, 3, 16, 12

    def inputs(r):
        gen = torch.Generator().manual_seed(1000 + r)
        n = num_max_tokens - r
        x = torch.randn((n, hidden), generator=gen).to(torch.bfloat16)
        topk = torch.stack([torch.randperm(num_experts, generator=gen)[:num_topk] for _ in range(n)])
        topk[torch.rand((n, num_topk), generator=gen) < 0.2] = -1
        w = torch.rand((n, num_topk), generator=gen)
        sf = torch.rand((n, 1), generator=gen)
        return x, topk, w, sf

    all_inputs = [inputs(r) for r in range(size)]
    x, topk, w, sf = all_inputs[rank]
    got = refs_mod.dispatch(x, topk, w, num_max_tokens, num_experts)
    want = refs_mod.dispatch_from_gathered([i[0] for i in all_inputs], None, [i[1] for i in all_inputs],
                                           [i[2] for i in all_inputs], rank, num_max_tokens, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, recv_src, counts = got
    ok = (torch.equal(recv_x, want.recv_x) and torch.equal(recv_topk_idx, want.recv_topk_idx)
          and torch.equal(recv_topk_weights, want.recv_topk_weights)
          and torch.equal(recv_src, want.recv_src_token_global_idx)
          and torch.equal(counts, want.num_recv_tokens_per_rank) and counts.dtype == torch.int32)
    # The (x, sf) form and the DeepEP defaults of generate_pre_combine_data (world size, global seed)
    (fp_x, fp_sf), *_ = refs_mod.dispatch((x, sf), topk, w, num_max_tokens, num_experts)
    ok = ok and torch.equal(fp_x, want.recv_x) and fp_sf.shape == (fp_x.shape[0], 1)
    y = refs_mod.generate_pre_combine_data(recv_src, num_max_tokens, num_topk, hidden)
    ok = ok and torch.equal(y, refs_mod.generate_pre_combine_data(recv_src, num_max_tokens, num_topk, hidden, size, 5))
    report(rank=rank, size=size, refs_ok=bool(ok), num_recv=int(counts.sum()),
           checks=[torch.equal(recv_x, want.recv_x), torch.equal(recv_topk_idx, want.recv_topk_idx),
                   torch.equal(recv_topk_weights, want.recv_topk_weights),
                   torch.equal(recv_src, want.recv_src_token_global_idx),
                   torch.equal(counts, want.num_recv_tokens_per_rank), torch.equal(fp_x, want.recv_x)])
    _leave_together()


def _leave_together():
    """Exit only after every rank is done (the store's host leaving first can fail a slow rank's last collective
    under load; seen once in the CPU suite)."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _spawned(local_rank, num_local_ranks):
    import torch
    import torch.distributed as dist

    from deepep_cupy.utils import envs
    rank, size, group = envs.init_dist(local_rank, num_local_ranks, seed=3)
    gathered = [None] * size
    dist.all_gather_object(gathered, rank, group=group)
    t = torch.tensor([float(rank + 1)], device='cpu', dtype=torch.float32)
    dist.all_reduce(t)
    report(rank=rank, size=size, local_rank=local_rank, group=type(group).__name__, gathered=gathered,
           sum=float(t.item()), default_dtype=str(torch.get_default_dtype()), backend=str(dist.get_backend()),
           local_seed=envs.get_local_seed())
    dist.destroy_process_group()


def spawn(num_local_ranks):
    import torch.multiprocessing as mp
    mp.spawn(_spawned, args=(num_local_ranks,), nprocs=num_local_ranks)


if __name__ == '__main__':
    mode = sys.argv[1]
    if mode == 'join':
        join()
    elif mode == 'refs':
        refs()
    elif mode == 'spawn':
        spawn(int(sys.argv[2]))
    else:
        raise SystemExit(f'unknown mode {mode}')
