"""V1 low-latency mode across scale-up domains (v1/kernels/internode_ll.py) through `deep_ep.Buffer`: bitwise
checks against the single-domain host references (deepep_cupy.tests.ll_reference, which the single-domain kernels
equal bit for bit), CUDA-graph capture of call and hook, masks, one buffer serving normal and low-latency modes,
bad input. Domains from the topology (`DEEPEP_CUPY_SCALEUP_SIZE` on one GPU), e.g.

    DEEPEP_CUPY_SCALEUP_SIZE=2 DEEPEP_CUPY_RAIL_TRANSPORT=loopback CUDA_VISIBLE_DEVICES=0 \\
        launch/run_local.sh 4 python3 -m deepep_cupy.tests.legacy_low_latency_internode

Every case runs {local, async_finish, hook} x {BF16, FP8, FP8 round_scale, FP8 UE8M0} x {zero_copy off, on} on
inputs with -1 slots, full, ragged and 0-token ranks; dispatch outputs (recv_count, layout_range, src_info, rows,
scales, the cumulative stats) and the weighted combine are compared bit for bit. Ends with
`legacy low-latency internode test (D x S): PASSED` (exit 0) or `FAILED`.
"""

import sys
import time

from ..runtime import preflight
from . import cli

try:
    import torch
except ImportError as e:  # `--help` works without torch
    preflight.exit_if_main(e, __name__, cli.legacy_low_latency_internode_parser)
    raise

from ..runtime.group import get_group  # noqa: E402
from ..utils.envs import init_dist  # noqa: E402
from ..v1.buffer import Buffer  # noqa: E402
from . import ll_reference as ref  # noqa: E402
from .common import Failure, check, check_equal, expect_error  # noqa: E402
from .legacy_low_latency import MODES, Inputs, combine_expected, combine_input, mode_name, valid_rows_index  # noqa

CALLS = ('local', 'async', 'hook')


def check_dispatch(inp: Inputs, out, mode, M: int, masked, what: str, stats=None) -> None:
    use_fp8, round_scale, use_ue8m0 = mode
    recv, recv_count, handle = out[0], out[1], out[2]
    R, E, H = inp.num_ranks, inp.E, inp.H
    L, T = E // R, R * M
    want = ref.dispatch_reference(inp.xs, inp.topks, inp.rank, E, M, use_fp8, round_scale, use_ue8m0, masked)
    check(isinstance(handle, tuple) and len(handle) == 5 and tuple(handle[2:]) == (M, H, E),
          f'{what}: handle must be (src_info, layout_range, {M}, {H}, {E})')
    check_equal(recv_count.cpu(), want.recv_count, f'{what}: recv_count')
    check_equal(handle[1].cpu(), want.layout_range, f'{what}: layout_range')
    idx = valid_rows_index([e.count for e in want.experts], T).cuda()

    def cat(f):
        return torch.cat([f(e) for e in want.experts])
    check_equal(handle[0].reshape(-1).index_select(0, idx).cpu(), cat(lambda e: e.src_info), f'{what}: src_info')
    if use_fp8:
        x, sf = recv
        cols = H // 512 if use_ue8m0 else H // 128
        check(x.dtype == torch.float8_e4m3fn and tuple(x.shape) == (L, T, H), f'{what}: recv_x shape/dtype')
        check(tuple(sf.shape) == (L, T, cols) and sf.stride() == (cols * T, 1, T) and
              sf.dtype == (torch.int32 if use_ue8m0 else torch.float32), f'{what}: scales layout {sf.stride()}')
        check_equal(x.reshape(-1, H).view(torch.uint8).index_select(0, idx).cpu(),
                    cat(lambda e: e.x.view(torch.uint8)), f'{what}: FP8 rows (bits)')
        check_equal(sf.reshape(L * T, cols).index_select(0, idx).cpu(), cat(lambda e: e.scales), f'{what}: scales')
    else:
        check(recv.dtype == torch.bfloat16 and tuple(recv.shape) == (L, T, H), f'{what}: recv_x shape/dtype')
        check_equal(recv.reshape(-1, H).index_select(0, idx).cpu(), cat(lambda e: e.x), f'{what}: BF16 rows')
    if stats is not None:
        check_equal(stats.cpu(), want.recv_count, f'{what}: cumulative_local_expert_recv_stats')


def _finish(call: str, event, hook) -> None:
    check((hook is not None) == (call == 'hook'), 'a hook comes back iff return_recv_hook')
    if call == 'hook':
        hook()
    elif call == 'async':
        event.current_stream_wait()


def run_case(buf: Buffer, inp: Inputs, M: int, call: str, mode, zero_copy: bool, what: str, masked=()) -> None:
    use_fp8, round_scale, use_ue8m0 = mode
    L = inp.E // inp.num_ranks
    flags = dict(async_finish=call == 'async', return_recv_hook=call == 'hook')
    stats = torch.zeros(L, dtype=torch.int32, device='cuda')
    out = buf.low_latency_dispatch(inp.x, inp.topk_idx, M, inp.E, cumulative_local_expert_recv_stats=stats,
                                   use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, **flags)
    _finish(call, out[3], out[4])
    check_dispatch(inp, out, mode, M, masked, what, stats)
    y = combine_input(inp, out, mode, M)
    x_arg = y
    if zero_copy:
        buf.get_next_low_latency_combine_buffer(out[2])[:, :, :] = y
        x_arg = torch.full_like(y, float('nan'))     # must not be read
    dest = torch.empty((inp.N, inp.H), dtype=torch.bfloat16, device='cuda')
    combined, event, hook = buf.low_latency_combine(x_arg, inp.topk_idx, inp.topk_weights, out[2],
                                                    zero_copy=zero_copy, out=dest, **flags)
    _finish(call, event, hook)
    check(combined.data_ptr() == dest.data_ptr(), f'{what}: combine must write into out')
    check_equal(combined.cpu(), combine_expected(inp, mode, masked), f'{what}: combined_x')


def run_matrix(buf: Buffer, inp: Inputs, M: int, label: str) -> int:
    n = 0
    for call in CALLS:
        for mode in MODES:
            for zero_copy in (False, True):
                run_case(buf, inp, M, call, mode, zero_copy, f'{label} {call} {mode_name(*mode)} zc={zero_copy}')
                n += 1
    return n


def run_graph(buf: Buffer, group, args, M: int, hook: bool, mode, seeds) -> None:
    """dispatch (+ hook) + combine (+ hook) captured in one CUDA graph, replayed on fresh inputs."""
    rank, R = group.rank, group.size
    first = Inputs(group, rank, R, args.num_tokens, args.hidden, args.num_topk, args.num_experts, seeds[0])
    x, topk_idx, topk_w = first.x.clone(), first.topk_idx.clone(), first.topk_weights.clone()
    use_fp8, round_scale, use_ue8m0 = mode

    def step():
        out = buf.low_latency_dispatch(x, topk_idx, M, args.num_experts, use_fp8=use_fp8, round_scale=round_scale,
                                       use_ue8m0=use_ue8m0, return_recv_hook=hook)
        if hook:
            out[4]()
        y = combine_input(first, out, mode, M)
        combined, _, recv_hook = buf.low_latency_combine(y, topk_idx, topk_w, out[2], return_recv_hook=hook)
        if hook:
            recv_hook()
        return out, combined

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    group.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, combined = step()
    for seed in seeds:
        inp = Inputs(group, rank, R, args.num_tokens, args.hidden, args.num_topk, args.num_experts, seed)
        x.copy_(inp.x)
        topk_idx.copy_(inp.topk_idx)
        topk_w.copy_(inp.topk_weights)
        graph.replay()
        torch.cuda.synchronize()
        what = f'graph hook={hook} {mode_name(*mode)} seed {seed}'
        check_dispatch(inp, out, mode, M, (), what)
        check_equal(combined.cpu(), combine_expected(inp, mode), f'{what}: combined_x')
    group.barrier()


def run_normal(buf: Buffer, inp: Inputs, what: str) -> None:
    """A normal-mode dispatch + combine on the same buffer: combined_x[t] = the sum over the token's domains of
    bf16(m_d * x[t]) (m_d ranks of domain d hold it; both sums are exact in FP32), rounded once."""
    D, S, R, E = buf.num_domains, buf.num_scaleup_ranks, inp.num_ranks, inp.E
    per_rank, per_domain, per_expert, in_rank, _ = buf.get_dispatch_layout(inp.topk_idx, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(inp.x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                              topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)
    combined, _, _ = buf.combine(recv_x, handle)
    owners = torch.where(inp.topk_host >= 0, inp.topk_host // (E // R), -1)
    want = torch.zeros((inp.N, inp.H), dtype=torch.float32)
    for d in range(D):
        m = torch.stack([(owners == d * S + s).any(1) for s in range(S)], 1).sum(1).float() if inp.N else \
            torch.zeros(0)
        want += (inp.x_host.float() * m.unsqueeze(1)).to(torch.bfloat16).float()
    check_equal(combined.cpu(), want.to(torch.bfloat16), f'{what}: normal-mode combined_x')


def test_errors(buf: Buffer, inp: Inputs, M: int):
    tried = []
    x, t, E = inp.x, inp.topk_idx, inp.E
    expect_error(tried, 'float32 x', TypeError, lambda: buf.low_latency_dispatch(x.float(), t, M, E))
    if inp.N > 1:
        expect_error(tried, 'M below the tokens', ValueError, lambda: buf.low_latency_dispatch(x, t, inp.N - 1, E))
    expect_error(tried, 'experts not a multiple of the ranks', ValueError,
                 lambda: buf.low_latency_dispatch(x, t, M, E + 1))
    expect_error(tried, 'UE8M0 without round_scale', ValueError,
                 lambda: buf.low_latency_dispatch(x, t, M, E, use_ue8m0=True))
    expect_error(tried, 'hook and async_finish', ValueError,
                 lambda: buf.low_latency_dispatch(x, t, M, E, async_finish=True, return_recv_hook=True))
    expect_error(tried, 'int32 topk_idx', TypeError, lambda: buf.low_latency_dispatch(x, t.int(), M, E))
    out = buf.low_latency_dispatch(x, t, M, E, use_fp8=False)
    y = torch.zeros_like(out[0])
    expect_error(tried, 'a foreign handle', TypeError,
                 lambda: buf.low_latency_combine(y, t, inp.topk_weights, tuple(out[2])))
    expect_error(tried, 'float64 weights', TypeError,
                 lambda: buf.low_latency_combine(y, t, inp.topk_weights.double(), out[2]))
    expect_error(tried, 'use_logfmt', NotImplementedError,
                 lambda: buf.low_latency_combine(y, t, inp.topk_weights, out[2], use_logfmt=True))
    buf.low_latency_combine(y, t, inp.topk_weights, out[2])      # the buffer still works
    return tried


def test_masks(group, torch_group, args, M: int) -> str:
    rank, R = group.rank, group.size
    buf = Buffer(torch_group if torch_group is not None else group, 0, 0, low_latency_mode=True,
                 explicitly_destroy=True, enable_shrink=True)
    try:
        masked = (R - 1,)
        buf.low_latency_update_mask_buffer(R - 1, True)
        status = torch.zeros(R, dtype=torch.int32, device='cuda')
        buf.low_latency_query_mask_buffer(status)
        check(status.tolist() == [0] * (R - 1) + [1], f'mask status {status.tolist()}')
        inp = Inputs(group, rank, R, M, args.hidden, args.num_topk, args.num_experts, args.seed + 5)
        for mode in ((False, False, False), (True, True, False)):
            out = buf.low_latency_dispatch(inp.x, inp.topk_idx, M, inp.E, use_fp8=mode[0], round_scale=mode[1])
            y = combine_input(inp, out, mode, M)
            combined, _, _ = buf.low_latency_combine(y, inp.topk_idx, inp.topk_weights, out[2])
            if rank not in masked:          # every rank masks the last: it receives and adds nothing
                check_dispatch(inp, out, mode, M, masked, f'masked {mode_name(*mode)}')
                check_equal(combined.cpu(), combine_expected(inp, mode, masked), f'masked {mode_name(*mode)} combine')
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_query_mask_buffer(status)
        check(status.tolist() == [0] * R, 'clean_mask_buffer')
        torch.cuda.synchronize()
    finally:
        buf.destroy()
    return f'rank {R - 1} masked on every rank: the others\' dispatch and combine equal the masked references'


def main(argv=None) -> int:
    args = cli.legacy_low_latency_internode_parser().parse_args(argv)
    preflight.check_cuda()
    rank, R, torch_group = init_dist(seed=args.seed)
    group = get_group()
    if args.num_experts % R:
        args.num_experts = R * max(1, args.num_experts // R)
    M, E, H, K = args.num_tokens, args.num_experts, args.hidden, args.num_topk
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    hint = Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=M, hidden=H, num_ranks=R,
                                                 num_experts=E)
    buf = Buffer(torch_group if torch_group is not None else group, int(2e8), hint, low_latency_mode=True,
                 num_qps_per_rank=E // R, explicitly_destroy=True)
    D, S = buf.num_domains, buf.num_scaleup_ranks
    ok = True
    try:
        check(D > 1, f'this program needs several scale-up domains (DEEPEP_CUPY_SCALEUP_SIZE), got {D} x {S}')
        log(f'[init] {R} ranks = {D} domains x {S}; tokens {M}, hidden {H}, top-{K}, {E} experts')
        main_inp = Inputs(group, rank, R, M, H, K, E, args.seed)
        if not args.skip_check:
            t0 = time.perf_counter()
            run_normal(buf, main_inp, 'before low-latency')
            n = run_matrix(buf, main_inp, M, 'full')
            ragged = Inputs(group, rank, R, max(0, M - 3 * rank - 1), H, K, E, args.seed + 1)
            n += run_matrix(buf, ragged, M, 'ragged')
            zero = Inputs(group, rank, R, 0 if rank % 2 == 1 else M, H, K, E, args.seed + 2)
            n += run_matrix(buf, zero, M, '0-token ranks')
            run_normal(buf, ragged, 'after low-latency')
            torch.cuda.synchronize()
            log(f'[check] {n} low-latency dispatch + combine pairs bitwise equal to the single-domain references; '
                f'normal mode on the same buffer before and after OK ({time.perf_counter() - t0:.1f} s)')
            tried = test_errors(buf, main_inp, M)
            log(f'[errors] {len(tried)} invalid calls raised before any kernel ran; the buffer still works:')
            for line in tried:
                log(f'    {line}')
        if not args.skip_graph_test:
            t0 = time.perf_counter()
            for hook in (False, True):
                for mode in ((True, False, False), (False, False, False), (True, True, True)):
                    run_graph(buf, group, args, M, hook, mode, [args.seed + 10, args.seed + 11])
            log(f'[graph] dispatch + combine captured (with and without hooks) and replayed on new inputs: bitwise '
                f'equal ({time.perf_counter() - t0:.1f} s)')
    except Failure as e:
        print(f'[rank {rank}] FAILED: {e}', flush=True)
        ok = False
    torch.cuda.synchronize()
    buf.destroy()
    ok = all(group.allgather_object(ok))
    if ok and not args.skip_mask_test:
        try:
            log(f'[masks] {test_masks(group, torch_group, args, M)}: OK')
        except Failure as e:
            print(f'[rank {rank}] masks FAILED: {e}', flush=True)
            ok = False
        ok = all(group.allgather_object(ok))
    log(f'legacy low-latency internode test ({D} x {S}): PASSED' if ok else
        f'legacy low-latency internode test ({D} x {S}): FAILED')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
