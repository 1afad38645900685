"""DeepEP V1 `Buffer`, normal mode: rank program with bitwise checks against host references built from host-gathered
inputs, the call sequences of vLLM's and SGLang's backends, then DeepEP-style performance lines next to ElasticBuffer.

    mpirun -np N python -m deepep_cupy.tests.legacy_intranode [--num-tokens 4096 --hidden 7168 --num-topk 8
        --num-experts 256 --num-sms 24 --skip-perf-test ...]

Works with 1 rank and with 2, 4, 8 ranks sharing one GPU (logic only). Rank r dispatches `max(1, num_tokens - r)`
tokens with about 10% of their top-k slots -1. The mode matrix (as DeepEP's test_intranode): previous event x async x
{BF16, FP8 float32 scales (column-major), FP8 UE8M0 (packed int32)} x {with, without top-k}, expert alignment 1 / 128,
allocate_on_comm_stream where V1 allows it; each dispatch is followed by num_worst_tokens (with top-k), a cached
dispatch and a combine (0, 1, 2 biases; weights as dispatched, or with the non-local slots overwritten as DeepEP's
test does); every output and every element of the handle is compared bit for bit with `legacy_reference`. The
scenarios are in `legacy_scenarios.py`, the timings in `legacy_perf.py`.
"""

import sys
import time

from ..runtime import preflight
from . import cli

try:
    import torch
except ImportError as e:  # `--help` works without torch; a run names the extra that brings it
    preflight.exit_if_main(e, __name__, cli.legacy_intranode_parser)
    raise

from ..runtime.group import get_group
from ..utils.envs import init_dist
from ..utils.math import per_token_cast_to_fp8
from ..v1.buffer import Buffer, Config
from . import legacy_reference as ref
from .common import Failure, check, check_equal, gather_tensors

KINDS = ('bf16', 'fp8', 'ue8m0')


class Case:
    """One rank's inputs (GPU) and every rank's inputs on the host (for the references).

    Args:
        num_tokens: tokens of rank 0 (rank r: max(1, num_tokens - r)); zero_ranks: ranks with no tokens at all.
    """

    def __init__(self, group, num_tokens: int, hidden: int, num_topk: int, num_experts: int, seed: int,
                 zero_ranks=()):
        self.rank, self.R = group.rank, group.size
        self.H, self.K, self.E = hidden, num_topk, num_experts
        self.N = N = 0 if self.rank in zero_ranks else max(1, num_tokens - self.rank)
        gen = torch.Generator(device='cuda').manual_seed(seed * 1000 + self.rank)
        self.x = torch.randn((N, hidden), device='cuda', generator=gen).to(torch.bfloat16)
        scores = torch.randn((N, num_experts), device='cuda', generator=gen).abs() + 1
        self.topk_idx = torch.topk(scores, num_topk, dim=-1, sorted=False).indices.to(torch.int64)
        masked = torch.rand((N, num_topk), device='cuda', generator=gen) < 0.1
        self.topk_idx.masked_fill_(masked, -1)
        self.topk_weights = torch.randn((N, num_topk), device='cuda', generator=gen)
        q, sf = per_token_cast_to_fp8(self.x)
        q8, sf8 = per_token_cast_to_fp8(self.x, use_ue8m0=True, round_scale=True)
        # Column-major scales, as DeepEP's tests pass them.
        self.inputs = {'bf16': self.x, 'fp8': (q, sf.t().contiguous().t()), 'ue8m0': (q8, sf8.t().contiguous().t())}
        per_rank, per_expert, in_rank = ref.layout(self.topk_idx.cpu(), num_experts, self.R)
        self.layout = (per_rank.cuda(), per_expert.cuda(), in_rank.cuda())
        g = gather_tensors(group, (self.x, q, sf, q8, sf8, self.topk_idx, self.topk_weights))
        self.xs, qs, sfs, q8s, sf8s, self.topks, self.ws = (list(t) for t in zip(*g))
        self.host = {'bf16': (self.xs, None), 'fp8': (qs, sfs), 'ue8m0': (q8s, sf8s)}
        lay = [ref.layout(t, num_experts, self.R) for t in self.topks]
        self.in_ranks = [item[2] for item in lay]
        self.per_experts = [item[1] for item in lay]
        self.rank_prefix = ref.rank_prefix_matrix(self.in_ranks)
        self.send_head = ref.send_head(self.in_ranks[self.rank])
        self._refs = {}

    def layout_args(self):
        per_rank, per_expert, in_rank = self.layout
        return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    def topk_for(self, with_topk: bool, rank: int = None) -> torch.Tensor:
        r = self.rank if rank is None else rank
        return self.topks[r] if with_topk else ref.synthetic_topk(self.in_ranks[r], self.E)

    def ref(self, kind: str, with_topk: bool) -> ref.DispatchRef:
        key = (kind, with_topk)
        if key not in self._refs:
            xs, sfs = self.host[kind]
            topks = [self.topk_for(with_topk, r) for r in range(self.R)]
            self._refs[key] = ref.dispatch(xs, sfs, topks, self.ws if with_topk else None, self.in_ranks, self.rank,
                                           self.E, None if with_topk else self.per_experts)
        return self._refs[key]

    def combine_input(self, recv_x, kind: str, with_topk: bool):
        """What this rank sends back: from the received rows on the GPU (BF16, no host sync), else the reference's
        BF16 rows."""
        if kind == 'bf16':
            return ref.combine_rows(recv_x, self.rank)
        return ref.combine_rows(self.ref('bf16', with_topk).recv_x, self.rank).cuda()

    def expected_combine(self, with_topk: bool, biases, weight_fill=None):
        """`(combined_x, combined_topk_weights or None)` this rank must get; weight_fill: None (no weights), 0.0
        (the dispatch's weights) or 'rank' (non-local slots overwritten with (d + 1) / 2)."""
        topk = self.topk_for(with_topk)
        wof = None
        if weight_fill is not None:
            own = ref.owners(topk, self.E, self.R)
            w = self.ws[self.rank]

            def wof(d):
                fill = 0.0 if weight_fill == 0.0 else (d + 1) * 0.5
                return torch.where(own == d, w, torch.full_like(w, fill))
        return ref.combine(self.xs[self.rank], topk, self.E, self.R, [b.cpu() for b in biases], wof)


def check_dispatch(case: Case, out, kind: str, with_topk: bool, alignment: int, num_channels: int, what: str,
                   num_worst_tokens: int = 0, is_token_in_rank=None):
    """Compare a non-cached dispatch's outputs and handle with the references."""
    recv_x, recv_idx, recv_w, counts, handle, _ = out
    r = case.ref(kind, with_topk)
    n = r.recv_x.shape[0]
    rows = num_worst_tokens or n
    if kind == 'bf16':
        check(not isinstance(recv_x, tuple), f'{what}: BF16 recv_x must be a tensor')
        data, sf = recv_x, None
    else:
        data, sf = recv_x
        check(sf.dtype == (torch.int32 if kind == 'ue8m0' else torch.float32) and sf.shape[0] == rows and
              sf.stride(1) == 1, f'{what}: scales must be row-major [{rows}, P], got {sf.dtype} {list(sf.shape)} '
                                 f'strides {sf.stride()}')
        check_equal(sf[:n].cpu(), r.recv_sf, f'{what}: recv scales')
    check(data.shape == (rows, case.H), f'{what}: recv_x shape {list(data.shape)}, expected [{rows}, {case.H}]')
    check_equal(data[:n].cpu(), r.recv_x, f'{what}: recv_x')
    if with_topk:
        check(recv_idx.shape == (rows, case.K) and recv_w.shape == (rows, case.K), f'{what}: top-k shapes')
        check_equal(recv_idx[:n].cpu(), r.recv_topk_idx, f'{what}: recv_topk_idx')
        check_equal(recv_w[:n].cpu(), r.recv_topk_weights, f'{what}: recv_topk_weights')
        if num_worst_tokens:
            check(bool((recv_idx[n:] == -1).all()), f'{what}: recv_topk_idx rows past the real count must be -1')
    else:
        check(recv_idx is None and recv_w is None, f'{what}: no top-k outputs without top-k ids')
    want = [] if num_worst_tokens else ref.aligned(r.expert_counts, alignment)
    check(counts == want, f'{what}: num_recv_tokens_per_expert_list {counts} != {want}')
    check(isinstance(handle, tuple) and len(handle) == 6, f'{what}: the handle is a 6-tuple')
    rpm, cpm, rcpm, src_idx, itr, head = handle
    check_equal(rpm.cpu(), case.rank_prefix, f'{what}: handle[0] rank_prefix_matrix')
    check_equal(cpm.cpu(), ref.channel_prefix_matrix(case.in_ranks[case.rank], num_channels),
                f'{what}: handle[1] channel_prefix_matrix')
    check_equal(rcpm.cpu(), ref.recv_channel_prefix_matrix(case.in_ranks, case.rank, num_channels),
                f'{what}: handle[2] recv_channel_prefix_matrix')
    check(src_idx.shape == (rows,), f'{what}: handle[3] shape {list(src_idx.shape)}')
    check_equal(src_idx[:n].cpu(), r.recv_src_idx, f'{what}: handle[3] recv_src_idx')
    check(itr is (is_token_in_rank if is_token_in_rank is not None else case.layout[2]), f'{what}: handle[4]')
    check_equal(head.cpu(), case.send_head, f'{what}: handle[5] send_head')


def _call(buf: Buffer, fn, config, prev: bool, async_finish: bool, alloc: bool, **kw):
    """`fn(**kw)` with one mode's event arguments; waits for the event when asynchronous."""
    if prev:
        kw['previous_event'] = buf.capture()
    out = fn(config=config, async_finish=async_finish, allocate_on_comm_stream=alloc, **kw)
    if async_finish:
        out[-1].current_stream_wait()
    return out


def run_mode(buf: Buffer, case: Case, num_sms: int, i: int, prev: bool, async_finish: bool, kind: str,
             with_topk: bool, what: str) -> None:
    """One mode: dispatch, num_worst_tokens (with top-k), cached dispatch, combine; all checked."""
    config = Config(num_sms, 8, 256)
    alignment = 128 if i % 2 else 1
    alloc = prev and async_finish and i % 3 != 2
    tag = f'[{what} {kind} topk={with_topk} prev={prev} async={async_finish} alloc={alloc} align={alignment}]'
    ev = (config, prev, async_finish, alloc)
    kw = dict(x=case.inputs[kind], expert_alignment=alignment, **case.layout_args())
    if with_topk:
        kw.update(topk_idx=case.topk_idx, topk_weights=case.topk_weights)
    out = _call(buf, buf.dispatch, *ev, **kw)
    check_dispatch(case, out, kind, with_topk, alignment, num_sms // 2, tag)
    handle = out[4]
    if with_topk:
        worst = max(1, case.R * max(t.shape[0] for t in case.xs)) + i
        out_w = _call(buf, buf.dispatch, *ev, num_worst_tokens=worst, **kw)
        check_dispatch(case, out_w, kind, with_topk, alignment, num_sms // 2, f'{tag} num_worst_tokens',
                       num_worst_tokens=worst)
    cached = _call(buf, buf.dispatch, *ev, x=case.inputs[kind], handle=handle)
    check(cached[1:5] == (None, None, None, None), f'{tag} cached: (recv_x, None x 4, event)')
    got, want = (cached[0], out[0]) if kind == 'bf16' else (cached[0][0], out[0][0])
    check_equal(got, want, f'{tag} cached recv_x')
    if kind != 'bf16':
        check_equal(cached[0][1], out[0][1], f'{tag} cached scales')
    # Combine: 0, 1, 2 biases; weights as dispatched, or overwritten like DeepEP's test.
    biases = [torch.randn((case.N, case.H), device='cuda').to(torch.bfloat16) for _ in range(i % 3)]
    bias = None if not biases else (biases[0] if len(biases) == 1 else tuple(biases))
    y = case.combine_input(out[0], kind, with_topk)
    fill, weights = None, None
    if with_topk:
        fill = 0.0 if i % 2 else 'rank'
        weights = out[2] if fill == 0.0 else ref.weights_rows(out[2], out[1], case.rank)
    combined, combined_w, _ = _call(buf, buf.combine, *ev, x=y, handle=handle, topk_weights=weights, bias=bias)
    want_x, want_w = case.expected_combine(with_topk, biases, fill)
    check_equal(combined.cpu(), want_x, f'{tag} combined_x')
    if with_topk:
        check_equal(combined_w.cpu(), want_w, f'{tag} combined_topk_weights')
    else:
        check(combined_w is None, f'{tag} no combined weights without top-k')


def run_modes(buf: Buffer, case: Case, num_sms: int, what: str = 'modes') -> int:
    """DeepEP's test_intranode matrix: previous event x async x {BF16, FP8, FP8 UE8M0} x {with, without top-k}."""
    modes = [(prev, async_finish, kind, with_topk) for prev in (False, True) for async_finish in (False, True)
             for kind in KINDS for with_topk in (False, True)]
    for i, mode in enumerate(modes):
        run_mode(buf, case, num_sms, i, *mode, what)
    return len(modes)


def check_layout(buf: Buffer, case: Case) -> None:
    """get_dispatch_layout against the reference: plain, and asynchronous on the communication stream."""
    want = ref.layout(case.topk_idx.cpu(), case.E, case.R)
    for prev, async_finish, alloc in ((False, False, False), (True, True, True), (True, False, False)):
        kw = {'previous_event': buf.capture()} if prev else {}
        per_rank, rdma, per_expert, in_rank, event = buf.get_dispatch_layout(
            case.topk_idx, case.E, async_finish=async_finish, allocate_on_comm_stream=alloc, **kw)
        if async_finish:
            event.current_stream_wait()
        what = f'get_dispatch_layout(prev={prev}, async={async_finish}, alloc={alloc})'
        check(rdma is None, f'{what}: num_tokens_per_rdma_rank is None inside one NVLink domain')
        check_equal(per_rank.cpu(), want[0], f'{what}: num_tokens_per_rank')
        check_equal(per_expert.cpu(), want[1], f'{what}: num_tokens_per_expert')
        check_equal(in_rank.cpu(), want[2], f'{what}: is_token_in_rank')


def main(argv=None) -> int:
    p = cli.legacy_intranode_parser()
    args = p.parse_args(argv)
    preflight.check_cuda()
    from . import legacy_perf, legacy_scenarios

    rank, R, torch_group = init_dist(seed=args.seed)
    group = get_group()
    if args.num_experts % R:
        args.num_experts = R * max(1, args.num_experts // R)
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    t0 = time.perf_counter()
    buf = Buffer(torch_group if torch_group is not None else group, int(2e9), 0, explicitly_destroy=True)
    log(f'[init] {R} ranks, Buffer(group, 2e9) built in {time.perf_counter() - t0:.2f} s; tokens {args.num_tokens}, '
        f'hidden {args.hidden}, top-{args.num_topk}, {args.num_experts} experts, {args.num_sms} SMs')
    ok = True
    try:
        check(buf.group is (torch_group if torch_group is not None else group) and buf.rank == rank and
              buf.group_size == R, 'Buffer.group is the caller\'s object; rank and group_size')
        case = Case(group, args.num_tokens, args.hidden, args.num_topk, args.num_experts, args.seed)
        if not args.skip_check:
            t0 = time.perf_counter()
            check_layout(buf, case)
            n = run_modes(buf, case, args.num_sms)
            torch.cuda.synchronize()
            log(f'[check] get_dispatch_layout and {n} dispatch modes (+ num_worst_tokens, cached, combine) bitwise '
                f'equal to the references ({time.perf_counter() - t0:.1f} s)')
        if not args.skip_scenario_test:
            for line in legacy_scenarios.run_all(buf, group, args):
                log(line)
        if not args.skip_error_test:
            tried = legacy_scenarios.test_errors(buf, case)
            log(f'[errors] {len(tried)} invalid calls raised before any kernel ran; the buffer still works:')
            for line in tried:
                log(f'    {line}')
        if not args.skip_perf_test:
            lines = group.allgather_object(legacy_perf.perf(buf, case, group, args))
            for rank_lines in lines:
                for line in rank_lines:
                    log(line)
    except Failure as e:
        print(f'[rank {rank}] FAILED: {e}', flush=True)
        ok = False
    torch.cuda.synchronize()
    buf.destroy()
    ok = all(group.allgather_object(ok))
    log('legacy intranode test: PASSED' if ok else 'legacy intranode test: FAILED')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
