"""The call sequences of DeepEP V1's users on a V1 `Buffer`, checked bit for bit (part of the `legacy_intranode` rank
program; see COMPAT.md for the callers):

- 0-token ranks (DP idle ranks) through the whole mode matrix;
- vLLM `deepep_high_throughput` under dual-batch overlap: layout and dispatch of two micro-batches with
  `previous_event` alone (no async, no allocation on the communication stream), then both combines;
- SGLang `deepep` normal mode: layout, dispatch and combine asynchronous with `allocate_on_comm_stream`,
  expert_alignment 128;
- a dispatch with more tokens than the buffer's slots: every rank grows the buffer and redoes it; a handle made before
  the growth still combines;
- one buffer made with `low_latency_mode=True` serving normal and low-latency calls in turn (SGLang `auto`), the
  low-latency ones with and without receive hooks (the hook pattern of vLLM / SGLang);
- `num_worst_tokens` decode captured in a CUDA graph with get_dispatch_layout and combine, replayed on new inputs;
- CuPy arrays in, CuPy arrays out;
- invalid calls.
"""

import time

import torch

from ..v1.buffer import Buffer, Config
from . import legacy_low_latency as ll_prog
from . import legacy_reference as ref
from .common import check, check_equal, expect_error
from .legacy_intranode import Case, check_dispatch, run_modes


def run_all(buf: Buffer, group, args):
    """Every scenario; yields a log line per scenario."""
    R, H, K, E = group.size, args.hidden, args.num_topk, args.num_experts
    small = min(args.num_tokens, 256)
    t0 = time.perf_counter()
    zero = Case(group, small, H, K, E, args.seed + 1, zero_ranks={r for r in range(R) if r % 2 == 1} or {0})
    n = run_modes(buf, zero, args.num_sms, '0-token ranks')
    yield f'[scenario] 0-token ranks: {n} modes bitwise equal ({time.perf_counter() - t0:.1f} s)'
    t0 = time.perf_counter()
    vllm_dual_batch_overlap(buf, group, args, small)
    yield f'[scenario] vLLM high-throughput with dual-batch overlap (previous_event alone): OK ' \
          f'({time.perf_counter() - t0:.1f} s)'
    t0 = time.perf_counter()
    sglang_normal(buf, group, args, small)
    yield f'[scenario] SGLang normal (async, allocate_on_comm_stream, alignment 128): OK ' \
          f'({time.perf_counter() - t0:.1f} s)'
    t0 = time.perf_counter()
    growths = growth(group, args)
    yield f'[scenario] a dispatch above the buffer\'s slots: grown {growths} time(s), results and an older handle\'s ' \
          f'combine bitwise equal ({time.perf_counter() - t0:.1f} s)'
    if H % 128 == 0:
        t0 = time.perf_counter()
        both_modes(group, args)
        yield f'[scenario] one low_latency_mode buffer serving normal and low-latency calls (hooks too): OK ' \
              f'({time.perf_counter() - t0:.1f} s)'
    t0 = time.perf_counter()
    cuda_graph(buf, group, args)
    yield f'[scenario] num_worst_tokens decode in a CUDA graph, replayed on new inputs: OK ' \
          f'({time.perf_counter() - t0:.1f} s)'
    cupy_arrays(buf, group, args)
    yield '[scenario] CuPy arrays in, CuPy arrays out: OK'


def _combine_check(buf, case, handle, recv_x, kind, what, **kw):
    y = case.combine_input(recv_x, kind, True)
    combined, combined_w, event = buf.combine(y, handle, **kw)
    if kw.get('async_finish'):
        event.current_stream_wait()
    check_equal(combined.cpu(), case.expected_combine(True, [])[0], f'{what}: combined_x')
    return combined_w


def vllm_dual_batch_overlap(buf: Buffer, group, args, num_tokens: int) -> None:
    """vLLM's `DeepEPHTPrepareAndFinalize` under DBO: per micro-batch get_dispatch_layout and dispatch with the
    previous micro-batch's event (async_finish=False, allocate_on_comm_stream=False), FP8 block scales; combines
    after both dispatches, with topk_weights=None and the default combine config."""
    R = group.size
    cases = [Case(group, num_tokens, args.hidden, args.num_topk, args.num_experts, args.seed + s) for s in (2, 3)]
    config = Buffer.get_dispatch_config(R)
    outs = []
    for c in cases:
        prev = buf.capture()
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(
            topk_idx=c.topk_idx, num_experts=c.E, previous_event=prev, async_finish=False,
            allocate_on_comm_stream=False)
        out = buf.dispatch(x=c.inputs['fp8'], handle=None, num_tokens_per_rank=per_rank,
                           num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=c.topk_idx, topk_weights=c.topk_weights,
                           expert_alignment=1, config=config, previous_event=buf.capture(), async_finish=False,
                           allocate_on_comm_stream=False)
        outs.append((out, in_rank))
    for i, (c, (out, in_rank)) in enumerate(zip(cases, outs)):
        check_dispatch(c, out, 'fp8', True, 1, config.num_sms // 2, f'vLLM DBO micro-batch {i}',
                       is_token_in_rank=in_rank)
    for i, (c, (out, _)) in enumerate(zip(cases, outs)):
        w = _combine_check(buf, c, out[4], out[0], 'fp8', f'vLLM DBO combine {i}', topk_weights=None,
                           config=Buffer.get_combine_config(R), previous_event=buf.capture(), async_finish=False,
                           allocate_on_comm_stream=False)
        check(w is None, 'vLLM combine without weights returns None weights')


def sglang_normal(buf: Buffer, group, args, num_tokens: int) -> None:
    """SGLang's `_DeepEPDispatcherImplNormal`: layout and dispatch asynchronous on the communication stream with
    `allocate_on_comm_stream=previous_event is not None`, expert_alignment 128 (DeepGEMM), the layout's event as the
    dispatch's previous_event; combine asynchronous too."""
    c = Case(group, num_tokens, args.hidden, args.num_topk, args.num_experts, args.seed + 4)
    per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(
        c.topk_idx, c.E, previous_event=buf.capture(), async_finish=True, allocate_on_comm_stream=True)
    out = buf.dispatch(c.inputs['ue8m0'], topk_idx=c.topk_idx, topk_weights=c.topk_weights,
                       num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                       num_tokens_per_expert=per_expert, previous_event=event, async_finish=True,
                       allocate_on_comm_stream=True, expert_alignment=128, config=Config(args.num_sms, 8, 256))
    out[-1].current_stream_wait()
    check_dispatch(c, out, 'ue8m0', True, 128, args.num_sms // 2, 'SGLang normal dispatch', is_token_in_rank=in_rank)
    _combine_check(buf, c, out[4], out[0], 'ue8m0', 'SGLang normal combine', async_finish=True,
                   previous_event=buf.capture(), allocate_on_comm_stream=True)


def growth(group, args) -> int:
    """A buffer built without memory lays out DEFAULT_TOKENS slots; a dispatch of more grows it on every rank."""
    from ..v1.normal import DEFAULT_TOKENS
    buf = Buffer(group, 0, explicitly_destroy=True)
    try:
        first = Case(group, 64, args.hidden, args.num_topk, args.num_experts, args.seed + 6)
        out0 = buf.dispatch(first.x, topk_idx=first.topk_idx, topk_weights=first.topk_weights,
                            **first.layout_args())
        check_dispatch(first, out0, 'bf16', True, 1, Buffer.num_sms // 2, 'growth: before')
        big = Case(group, DEFAULT_TOKENS + 200 + group.size, args.hidden, args.num_topk, args.num_experts,
                   args.seed + 7)
        out = buf.dispatch(big.x, topk_idx=big.topk_idx, topk_weights=big.topk_weights, **big.layout_args())
        check_dispatch(big, out, 'bf16', True, 1, Buffer.num_sms // 2, 'growth: the large dispatch')
        _combine_check(buf, big, out[4], out[0], 'bf16', 'growth: combine after')
        _combine_check(buf, first, out0[4], out0[0], 'bf16', 'growth: the older handle\'s combine')
        check(out[4].engine is not out0[4].engine, 'growth: the large dispatch ran on a new engine')
        return buf._normal.num_growths
    finally:
        torch.cuda.synchronize()
        buf.destroy()


class _LowLatencyView:
    """The V1 Buffer's low-latency methods under the engine's names (for `legacy_low_latency.run_case`)."""

    def __init__(self, buf: Buffer):
        self.dispatch = buf.low_latency_dispatch
        self.combine = buf.low_latency_combine
        self.get_next_combine_buffer = buf.get_next_low_latency_combine_buffer


def both_modes(group, args) -> None:
    """SGLang `auto`: one buffer sized for both modes; normal, clean, low-latency (hook and not), normal again."""
    R, H, K, E = group.size, args.hidden, args.num_topk, args.num_experts
    M = min(args.num_tokens, 128)
    cfg = Config(args.num_sms, 8, 256)
    nvl = max(cfg.get_nvl_buffer_size_hint(H * 2, R), Buffer.get_combine_config(R).get_nvl_buffer_size_hint(H * 2, R))
    rdma = Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    buf = Buffer(group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=E // R, explicitly_destroy=True)
    try:
        for round_ in range(2):
            c = Case(group, M, H, K, E, args.seed + 8 + round_)
            out = buf.dispatch(c.inputs['fp8'], topk_idx=c.topk_idx, topk_weights=c.topk_weights, config=cfg,
                               **c.layout_args())
            check_dispatch(c, out, 'fp8', True, 1, args.num_sms // 2, f'both modes: normal round {round_}')
            _combine_check(buf, c, out[4], out[0], 'fp8', f'both modes: normal combine {round_}')
            buf.clean_low_latency_buffer(M, H, E)
            inp = ll_prog.Inputs(group, group.rank, R, M, H, K, E, args.seed + 20 + round_)
            for hook in (False, True):
                for mode in ((True, False, False), (False, False, False)):
                    ll_prog.run_case(_LowLatencyView(buf), inp, M, hook, mode, hook,
                                     f'both modes: low-latency round {round_} hook={hook}')
    finally:
        torch.cuda.synchronize()
        buf.destroy()


def cuda_graph(buf: Buffer, group, args) -> None:
    """get_dispatch_layout + dispatch(num_worst_tokens) + combine captured in one CUDA graph (no host sync inside),
    replayed on new inputs copied into the captured tensors."""
    R, rank = group.size, group.rank
    n = min(args.num_tokens, 128)
    first = Case(group, n, args.hidden, args.num_topk, args.num_experts, args.seed + 30)
    x, topk, w = first.x.clone(), first.topk_idx.clone(), first.topk_weights.clone()
    worst = R * n
    config = Config(args.num_sms, 8, 256)

    def step():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, first.E)
        out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, num_worst_tokens=worst,
                           config=config)
        combined, combined_w, _ = buf.combine(ref.combine_rows(out[0], rank), out[4], topk_weights=out[2],
                                              config=config)
        return out, in_rank, combined, combined_w

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                      # warm-up outside the capture: layout, allocator, kernels
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    group.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, in_rank, combined, combined_w = step()
    for seed in (args.seed + 31, args.seed + 32):
        c = Case(group, n, args.hidden, args.num_topk, args.num_experts, seed)
        x.copy_(c.x)
        topk.copy_(c.topk_idx)
        w.copy_(c.topk_weights)
        graph.replay()
        torch.cuda.synchronize()
        what = f'CUDA graph replay (seed {seed})'
        check_equal(in_rank.cpu(), c.layout[2].cpu(), f'{what}: is_token_in_rank')
        check_dispatch(c, out, 'bf16', True, 1, args.num_sms // 2, what, num_worst_tokens=worst,
                       is_token_in_rank=in_rank)
        want_x, want_w = c.expected_combine(True, [], 0.0)
        check_equal(combined.cpu(), want_x, f'{what}: combined_x')
        check_equal(combined_w.cpu(), want_w, f'{what}: combined_topk_weights')
        group.barrier()


def cupy_arrays(buf: Buffer, group, args) -> None:
    import cupy

    from ..runtime.interop import to_cupy, to_torch
    c = Case(group, min(args.num_tokens, 128), args.hidden, args.num_topk, args.num_experts, args.seed + 40)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(to_cupy(c.topk_idx), c.E)
    check(isinstance(in_rank, cupy.ndarray), 'CuPy get_dispatch_layout returns CuPy arrays')
    check_equal(to_torch(in_rank).cpu().bool(), c.layout[2].cpu(), 'CuPy is_token_in_rank')
    out = buf.dispatch(to_cupy(c.x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                       num_tokens_per_expert=per_expert, topk_idx=to_cupy(c.topk_idx),
                       topk_weights=to_cupy(c.topk_weights))
    r = c.ref('bf16', True)
    check(isinstance(out[0], cupy.ndarray), 'CuPy dispatch returns CuPy arrays')
    check_equal(to_torch(out[0], 'bfloat16').cpu(), r.recv_x, 'CuPy recv_x')
    check_equal(to_torch(out[1]).cpu(), r.recv_topk_idx, 'CuPy recv_topk_idx')
    y = to_cupy(ref.combine_rows(to_torch(out[0], 'bfloat16'), group.rank))
    combined, combined_w, _ = buf.combine(y, out[4], topk_weights=out[2])
    want_x, want_w = c.expected_combine(True, [], 0.0)
    check_equal(to_torch(combined, 'bfloat16').cpu(), want_x, 'CuPy combined_x')
    check_equal(to_torch(combined_w).cpu(), want_w, 'CuPy combined_topk_weights')


def test_errors(buf: Buffer, case: Case) -> list:
    """Invalid calls raise before any kernel runs (ValueError / TypeError / NotImplementedError / RuntimeError)."""
    tried = []
    x, idx, w, lay = case.x, case.topk_idx, case.topk_weights, case.layout_args()

    def expect(name, exc, fn):
        expect_error(tried, name, exc, fn)

    expect('dispatch without the layout tensors', ValueError, lambda: buf.dispatch(x, topk_idx=idx))
    expect('allocate_on_comm_stream without previous_event', ValueError,
           lambda: buf.dispatch(x, topk_idx=idx, async_finish=True, allocate_on_comm_stream=True, **lay))
    expect('num_worst_tokens without top-k', ValueError, lambda: buf.dispatch(x, num_worst_tokens=8, **lay))
    expect('odd config.num_sms', ValueError, lambda: buf.dispatch(x, topk_idx=idx, config=Config(7, 4, 256), **lay))
    expect('x float32', TypeError, lambda: buf.dispatch(x.float(), topk_idx=idx, topk_weights=w, **lay))
    expect('topk_weights float64', TypeError, lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w.double(), **lay))
    good = buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay)
    expect('cached dispatch with topk_idx', ValueError, lambda: buf.dispatch(x, handle=good[4], topk_idx=idx))
    expect('combine with a plain tuple', TypeError, lambda: buf.combine(good[0], tuple(good[4])))
    expect('combine x of the wrong rows', ValueError, lambda: buf.combine(good[0][:0], good[4]))
    if case.R > 1:
        expect('get_dispatch_layout num_experts not a multiple of ranks', ValueError,
               lambda: buf.get_dispatch_layout(idx, case.E + 1))
    expect('internode_dispatch', NotImplementedError, lambda: buf.internode_dispatch(x))
    expect('low_latency_dispatch without low_latency_mode', RuntimeError,
           lambda: buf.low_latency_dispatch(x, idx, 128, case.E))
    expect('set_num_sms odd', ValueError, lambda: Buffer.set_num_sms(25))
    expect('Config nvl send >= recv', ValueError, lambda: Config(24, 256, 256))
    out = buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay)
    check_dispatch(case, out, 'bf16', True, 1, Buffer.num_sms // 2, 'dispatch after the error cases')
    return tried
