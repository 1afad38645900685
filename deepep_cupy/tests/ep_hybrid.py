"""Hybrid mode in the EP rank program (deepep_cupy/tests/ep.py switches to it when the buffer has several scale-up
domains, e.g. `DEEPEP_CUPY_SCALEUP_SIZE=1` with ranks sharing a GPU; the rails then go through the IPC loopback):

- `hybrid_case_class(Case)`: the same inputs, with every reference in the hybrid row order
  (`features.hybrid.plan.hybrid_row_order`: source scale-up index, source domain, token), or, with
  `--deterministic`, in DeepEP's `deterministic=True` order (`EPHandle.deterministic_sort`: all rows by
  src_token_global_idx, i.e. `refs.dispatch_from_gathered`'s own order; expanded rows by expert, then that index);
  psum per scale-up index either way (DeepEP's sort rewrites no count), and combine expected as
  `refs.combine(..., num_domains, ..., reduce_in_scaleup=True)`;
- `test_misc`: domain sizes, rail barrier, QPs, the handle's hybrid fields;
- `test_graph`: a 128-token dispatch (no CPU sync) + combine captured in one CUDA graph, replayed on new inputs;
- `test_timeout`: a missing rank gives TimeoutError on every other rank (its rail peers and domain peers name it).
"""

import numpy as np
import torch

from ..features.hybrid.plan import hybrid_row_order
from ..utils import refs
from .common import check, check_equal


def _reorder(ref: refs.DispatchRef, perm: np.ndarray, R: int) -> refs.DispatchRef:
    p = torch.from_numpy(perm)

    def take(t):
        return None if t is None else t[p.to(t.device)]
    per_src = ref.num_recv_tokens_per_rank
    groups = torch.stack([per_src[r::R].sum() for r in range(R)]).to(per_src.dtype)
    return refs.DispatchRef(take(ref.recv_x), take(ref.recv_sf), take(ref.recv_topk_idx), take(ref.recv_topk_weights),
                            take(ref.recv_src_token_global_idx), groups)


def hybrid_case_class(Case, num_domains: int):
    """A `Case` subclass whose references follow the row order of a hybrid dispatch over `num_domains` domains:
    grouped by source scale-up index, or DeepEP's sorted one when the buffer is deterministic (`--deterministic`)."""

    class HybridCase(Case):
        def __init__(self, args, group, rank, num_ranks, seed, num_max_tokens_per_rank=None, num_tokens=None):
            super().__init__(args, group, rank, num_ranks, seed, num_max_tokens_per_rank, num_tokens)
            self.num_domains, R = num_domains, num_ranks // num_domains
            src = self.ref.recv_src_token_global_idx.long().numpy()
            if args.deterministic:      # DeepEP's order is the reference's: sorted by src_token_global_idx
                perm = np.arange(src.size)
            else:
                perm = hybrid_row_order(src // self.M, src % self.M, R)
            self.ref, self.ref_fp8 = _reorder(self.ref, perm, R), _reorder(self.ref_fp8, perm, R)
            self.layouts = {a: refs.expanded_layout(self.ref.recv_topk_idx, self.L, a) for a in (1, 128)}
            src = self.ref.recv_src_token_global_idx.to('cuda').long()
            self.y = refs.generate_pre_combine_data(src, self.M, self.K, self.H, num_ranks, seed)
            self.combine_x = refs.reduce_local_slots(self.y, self.ref.recv_topk_idx.to('cuda'))
            self.expected = {}

        def expected_combined(self, num_bias: int, reduce_in_local: bool):
            # The composed path always reduces inside each domain first (DeepEP's reduce_in_scaleup=True).
            if not reduce_in_local:
                raise ValueError('hybrid mode checks need --allow-multiple-reduction 1')
            key = (num_bias, True)
            if key not in self.expected:
                bias = tuple(self.biases[:num_bias]) if num_bias else None
                self.expected[key] = refs.expected_combined_x(
                    self.topk_idx, self.rank, self.M, self.num_ranks, self.E, self.H, self.seed,
                    num_scaleout_ranks=self.num_domains, bias=bias, reduce_in_local=True, reduce_in_scaleup=True)
            return self.expected[key]

    return HybridCase


def test_misc(buf, case) -> None:
    """Domain sizes, the barrier across domains (rails), QPs, the handle's hybrid fields."""
    import deepep_cupy
    N, W = case.num_domains, case.num_ranks
    R = W // N
    check(buf.get_logical_domain_size() == (N, R), f'get_logical_domain_size {buf.get_logical_domain_size()}')
    check(deepep_cupy.get_logical_domain_size(buf.group) == (N, R), 'module get_logical_domain_size')
    buf.barrier()
    buf.barrier(use_comm_stream=False, with_cpu_sync=True)
    num_sms = buf.get_theoretical_num_sms(case.E, case.K)
    check(num_sms >= 2, f'get_theoretical_num_sms {num_sms}')
    check(buf.num_allocated_qps == 129, f'hybrid mode allocates 129 QPs, got {buf.num_allocated_qps}')
    out = buf.dispatch(case.x, case.topk_idx, case.topk_weights, num_experts=case.E)
    h = out[3]
    check(tuple(h.psum_num_recv_tokens_per_scaleup_rank.shape) == (R,), 'psum per scale-up index is [R]')
    tmaf = h.token_metadata_at_forward
    check(tuple(tmaf.shape) == (N, case.M, 1 + case.K), f'token_metadata_at_forward shape {tuple(tmaf.shape)}')
    # Own-domain rows of the forwarder (this rank): the tokens of this rank with an expert in this domain, ascending
    n = buf.scaleout_rank_idx
    epd = case.E // N
    own = ((case.topk_idx >= n * epd) & (case.topk_idx < (n + 1) * epd)).any(dim=1).nonzero().flatten().cpu()
    check_equal(tmaf[n, :own.numel(), 0].cpu().long(), own, 'token_metadata_at_forward (own domain)')
    if case.args.deterministic:
        # DeepEP's deterministic_sort: one sort of every row by src_token_global_idx (so not grouped by scale-up index
        # where R > 1), counts untouched (check_dispatch compares the psum per scale-up index with every call); the
        # reference checks compare every output with that order bit for bit.
        src = h.recv_src_metadata[:case.num_recv, 0].cpu().long()
        check(bool((src[1:] > src[:-1]).all()), 'deterministic: rows sorted by src_token_global_idx (DeepEP)')
        grouped = hybrid_row_order((src // case.M).numpy(), (src % case.M).numpy(), R)
        moved = int((grouped != np.arange(src.numel())).sum())
        if buf.rank_idx == 0:
            print(f'[deterministic] rank 0: {moved} of {src.numel()} rows are not where the grouped order puts them',
                  flush=True)
    buf.barrier()


def test_graph(buf, args, group, make_case) -> None:
    """Dispatch without CPU sync (M = 128) and combine captured in one CUDA graph, replayed twice on new inputs copied
    into the captured tensors; outputs bitwise equal to the references."""
    rank, num_ranks = group.rank, group.size
    M = min(128, args.num_tokens)
    first = make_case(args, group, rank, num_ranks, args.seed + 20, M)
    x, topk, w = first.x.clone(), first.topk_idx.clone(), first.topk_weights.clone()
    rows = num_ranks * M
    cx = torch.zeros((rows, args.hidden), dtype=torch.bfloat16, device='cuda')

    def step():
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk, w, num_experts=first.E,
                                                           num_max_tokens_per_rank=M, do_cpu_sync=False)
        combined, combined_w, _ = buf.combine(cx, handle, topk_weights=recv_w)
        return recv_x, recv_idx, recv_w, handle, combined, combined_w

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                      # warm-up outside the capture (kernels, bound calls, allocator)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    group.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, recv_idx, recv_w, handle, combined, combined_w = step()
    group.barrier()
    for seed in (args.seed + 21, args.seed + 22):
        c = make_case(args, group, rank, num_ranks, seed, M)
        x.copy_(c.x)
        topk.copy_(c.topk_idx)
        w.copy_(c.topk_weights)
        cx.zero_()
        cx[:c.num_recv].copy_(c.combine_x)
        graph.replay()
        torch.cuda.synchronize()
        what = f'CUDA graph replay (seed {seed})'
        n = c.num_recv
        check_equal(recv_x[:n], c.ref.recv_x, f'{what}: recv_x')
        check_equal(recv_idx[:n].cpu(), c.ref.recv_topk_idx.to(torch.int64), f'{what}: recv_topk_idx')
        handle._meta = None
        check_equal(handle.recv_src_metadata[:n, 0].cpu(), c.ref.recv_src_token_global_idx, f'{what}: metadata')
        check_equal(combined, c.expected_combined(0, True), f'{what}: combined_x')
        check_equal(combined_w, c.topk_weights, f'{what}: combined_topk_weights')
        group.barrier()


def test_timeout(args, group, case, ElasticBuffer) -> bool:
    """The last rank skips a dispatch: every other rank raises TimeoutError; its rail peers and the ranks of its
    domain name it (the others may name a rank that was itself held up: they wait for it inside their domain)."""
    # The host bound matters with NCCL rails (a missing NCCL peer is only seen by the host's bounded notify wait;
    # the loopback's GPU waits report first): a few GPU timeouts, not the default 300 s.
    buf = ElasticBuffer(group, num_max_tokens_per_rank=case.M, hidden=case.H, num_topk=case.K,
                        num_gpu_timeout_secs=args.timeout_test_secs,
                        num_cpu_timeout_secs=max(20.0, 4 * args.timeout_test_secs), explicitly_destroy=True)
    W, N = group.size, buf.num_scaleout_ranks
    R = W // N
    victim = W - 1
    close = {g for g in range(W) if g // R == victim // R or g % R == victim % R} - {victim}
    outcome = 'skipped (the missing rank)'
    if group.rank != victim:
        try:
            buf.dispatch(case.x, case.topk_idx, case.topk_weights, num_experts=case.E)
            outcome = 'no error'
        except TimeoutError as e:
            named = f'waited for rank {victim}' in str(e) or f'peer rank {victim} ' in str(e)
            outcome = 'TimeoutError' if named or group.rank not in close else f'bad message: {e}'
            if group.rank in (0, R - 1, W - R):
                print(f'[timeout] rank {group.rank}: {e}', flush=True)
    outcomes = group.allgather_object(outcome)
    buf.destroy()
    bad = {r: o for r, o in enumerate(outcomes) if r != victim and o != 'TimeoutError'}
    if bad and group.rank == 0:
        print(f'[timeout] unexpected outcomes: {bad}', flush=True)
    return not bad
