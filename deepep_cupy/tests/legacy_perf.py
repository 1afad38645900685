"""Timings of DeepEP V1's `Buffer` next to `ElasticBuffer` on the same inputs and SM count, measured in the same run
(the `legacy_intranode` rank program's performance lines, and `perf/v1_bench.py`'s rows).

- normal mode, eager: dispatch (BF16, FP8), cached dispatch, combine; µs from `bench` (CUDA events, L2 flushed) and
  GB/s as DeepEP's test_intranode counts them (received rows x hidden x 2 bytes, x (1 + 4/128) / 2 for FP8);
- normal mode, CUDA graph: get_dispatch_layout + dispatch(num_worst_tokens) + combine against ElasticBuffer's
  dispatch(do_cpu_sync=False) + combine, µs per replay;
- host µs per call: the Python cost of a call that needs no host wait (num_worst_tokens / do_cpu_sync=False
  dispatch, cached dispatch, combine), the best of `HOST_BATCHES` enqueue loops of `HOST_CALLS` calls;
- each V1 / ElasticBuffer pair is timed alternately, `ROUNDS` times each, the best of each counting; a `[ratio]` line
  gathers the ratios (V1 time / ElasticBuffer time);
- low-latency mode: dispatch and combine eager and in a CUDA graph, and the hooks' send / receive kernels.
"""

import time
from typing import Callable, List

import torch

from ..buffers.elastic import ElasticBuffer
from ..utils.testing import bench
from ..v1.buffer import Buffer, Config
from . import legacy_reference as ref

HOST_CALLS = 100
HOST_BATCHES = 5
ROUNDS = 2          # V1 and ElasticBuffer timed alternately, this many times each (the best of each counts)
FP8_FACTOR = (1 + 4 / 128) / 2


def host_us(fn: Callable[[], object], num_calls: int = HOST_CALLS, num_batches: int = HOST_BATCHES) -> float:
    """Host µs per call of `fn` (no host wait inside `fn`): the best mean of `num_batches` enqueue loops of
    `num_calls` calls each (the best resists other load on the host), the GPU drained between batches."""
    fn()
    best = float('inf')
    for _ in range(num_batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(num_calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / num_calls)
    torch.cuda.synchronize()
    return best * 1e6


def side_by_side(measure: Callable, v1: Callable, eb: Callable, rounds: int = ROUNDS):
    """`(V1 time, ElasticBuffer time)`: `measure(fn)` of each, alternately `rounds` times, the best of each (so that
    neither side is always the one measured first or later, when clocks or the allocator's cache drift)."""
    a = b = float('inf')
    for _ in range(rounds):
        a = min(a, measure(v1))
        b = min(b, measure(eb))
    return a, b


def graph_us(fn: Callable[[], object]) -> float:
    """µs per replay of `fn` captured in a CUDA graph (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return bench(graph.replay, num_warmups=10, num_tests=30)[0] * 1e6


def layout_args(buf: Buffer, case) -> dict:
    """The dispatch's layout arguments: the case's (one domain), or across scale-up domains `get_dispatch_layout`'s,
    which add `num_tokens_per_rdma_rank` (`[num_domains]`) as V1's internode dispatch takes it."""
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(case.topk_idx, case.E)
    if per_rdma is None:
        return case.layout_args()
    return dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert)


def normal_rows(buf: Buffer, eb: ElasticBuffer, case, num_sms: int, group) -> List[str]:
    """One line per path: V1 next to ElasticBuffer, ratio V1 / ElasticBuffer (time), each pair measured alternately in
    this run (`side_by_side`); a `[ratio]` line sums them up (the V1 adapter's target: within 1.05)."""
    rank, E = case.rank, case.E
    cfg = Config(num_sms, 8, 256)
    lay = layout_args(buf, case)
    idx, w = case.topk_idx, case.topk_weights
    lines, ratios = [], {}

    def gpu(fn):
        return bench(fn)[0]
    t_layout = bench(lambda: buf.get_dispatch_layout(idx, E))[0]
    lines.append(f'[layout] rank {rank}: {t_layout * 1e6:.1f} us')
    for kind in ('fp8', 'bf16'):
        x = case.inputs[kind]
        out = buf.dispatch(x, topk_idx=idx, topk_weights=w, config=cfg, **lay)
        eout = eb.dispatch(x, idx, w, num_experts=E, num_sms=num_sms)
        rows = out[1].shape[0]
        nbytes = rows * case.H * 2 * (FP8_FACTOR if kind == 'fp8' else 1)
        t1, t2 = side_by_side(gpu, lambda x=x: buf.dispatch(x, topk_idx=idx, topk_weights=w, config=cfg, **lay),
                              lambda x=x: eb.dispatch(x, idx, w, num_experts=E, num_sms=num_sms))
        c1, c2 = side_by_side(gpu, lambda x=x, h=out[4]: buf.dispatch(x, handle=h, config=cfg),
                              lambda x=x, h=eout[3]: eb.dispatch(x, handle=h, num_sms=num_sms))
        ratios[f'dispatch {kind.upper()}'], ratios[f'cached {kind.upper()}'] = t1 / t2, c1 / c2
        lines.append(f'[perf] rank {rank} | dispatch {kind.upper():4s}: V1 {nbytes / 1e9 / t1:.0f} GB/s (NVL), '
                     f'{t1 * 1e6:.1f} us | ElasticBuffer {t2 * 1e6:.1f} us | ratio {t1 / t2:.3f} | cached V1 '
                     f'{c1 * 1e6:.1f} us, ElasticBuffer {c2 * 1e6:.1f} us, ratio {c1 / c2:.3f}')
    y = ref.combine_rows(out[0], rank)
    ccfg = Config(num_sms, 4, 256)
    t1, t2 = side_by_side(gpu, lambda: buf.combine(y, out[4], config=ccfg),
                          lambda: eb.combine(y, eout[3], num_sms=num_sms))
    ratios['combine'] = t1 / t2
    nbytes = rows * case.H * 2
    lines.append(f'[perf] rank {rank} | combine: V1 {nbytes / 1e9 / t1:.0f} GB/s (NVL), {t1 * 1e6:.1f} us | '
                 f'ElasticBuffer {t2 * 1e6:.1f} us | ratio {t1 / t2:.3f}')
    # Host cost per call (no host wait), same inputs.
    worst = case.R * max(t.shape[0] for t in case.xs)
    h = {
        'dispatch (no CPU sync)': side_by_side(
            host_us, lambda: buf.dispatch(case.x, topk_idx=idx, topk_weights=w, num_worst_tokens=worst, config=cfg,
                                          **lay),
            lambda: eb.dispatch(case.x, idx, w, num_experts=E, num_sms=num_sms, do_cpu_sync=False)),
        'cached dispatch': side_by_side(host_us, lambda: buf.dispatch(case.x, handle=out[4], config=cfg),
                                        lambda: eb.dispatch(case.x, handle=eout[3], num_sms=num_sms)),
        'combine': side_by_side(host_us, lambda: buf.combine(y, out[4], config=ccfg),
                                lambda: eb.combine(y, eout[3], num_sms=num_sms)),
    }
    for k, (a, b) in h.items():
        ratios[f'host {k}'] = a / b
    layout_host = host_us(lambda: buf.get_dispatch_layout(idx, E))
    lines.append(f'[host] rank {rank} | ' + ' | '.join(f'{k}: V1 {a:.1f} us, ElasticBuffer {b:.1f} us, ratio '
                                                       f'{a / b:.3f}' for k, (a, b) in h.items()) +
                 f' | get_dispatch_layout: V1 {layout_host:.1f} us')
    # CUDA graphs: the decode path (no host sync) of each API.
    by = case.combine_input

    def v1_step():
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        o = buf.dispatch(case.x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                         is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                         num_worst_tokens=worst, config=cfg)
        buf.combine(by(o[0], 'bf16', True), o[4], config=ccfg)

    def eb_step():
        o = eb.dispatch(case.x, idx, w, num_experts=E, num_sms=num_sms, do_cpu_sync=False)
        eb.combine(by(o[0], 'bf16', True), o[3], num_sms=num_sms)
    group.barrier()
    g1 = graph_us(v1_step)
    group.barrier()
    g2 = graph_us(eb_step)
    ratios['graph'] = g1 / g2
    lines.append(f'[graph] rank {rank} | layout + dispatch(num_worst_tokens) + combine: V1 {g1:.1f} us | '
                 f'ElasticBuffer dispatch(no CPU sync) + combine {g2:.1f} us | ratio {g1 / g2:.3f}')
    lines.append(f'[ratio] rank {rank} | V1 / ElasticBuffer: ' + ', '.join(f'{k} {v:.3f}' for k, v in ratios.items()))
    return lines


def perf(buf: Buffer, case, group, args) -> List[str]:
    """The rank program's performance lines (normal mode; ElasticBuffer built here on the same group)."""
    eb = ElasticBuffer(group, num_max_tokens_per_rank=max(t.shape[0] for t in case.xs), hidden=case.H,
                       num_topk=case.K, explicitly_destroy=True)
    try:
        return normal_rows(buf, eb, case, args.num_sms, group)
    finally:
        torch.cuda.synchronize()
        eb.destroy()


def span_us(timed: Callable[[], object], before: Callable[[], object] = lambda: None, num_tests: int = 30) -> float:
    """Median µs between CUDA events around `timed()` on the current stream, `before()` run untimed ahead of each
    (a hook's send call, for the receive alone). Whatever `timed` launches on other streams must join the current one
    (as V1's calls do without `async_finish`)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(num_tests + 3):
        before()
        start.record()
        timed()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def low_latency_rows(buf: Buffer, inp, M: int, group) -> List[str]:
    """Low-latency dispatch (FP8) and combine: eager (`bench`), CUDA graph, and hook send / receive kernels
    (`bench_kineto`), on a V1 Buffer built with low_latency_mode. Across scale-up domains (a call is several kernels:
    the hybrid engine's and V1's layout kernels), the spans of each call and of the hooks' send and receive halves
    instead of kernel times (`span_us`)."""
    from ..utils.testing import bench_kineto
    rank, E = inp.rank, inp.E
    out = buf.low_latency_dispatch(inp.x, inp.topk_idx, M, E)
    torch.cuda.synchronize()
    y = out[0][0].float().to(torch.bfloat16) if isinstance(out[0], tuple) else out[0]

    def both(hook: bool):
        o = buf.low_latency_dispatch(inp.x, inp.topk_idx, M, E, use_fp8=True, return_recv_hook=hook)
        if hook:
            o[4]()
        _, _, h = buf.low_latency_combine(y, inp.topk_idx, inp.topk_weights, o[2], return_recv_hook=hook)
        if hook:
            h()

    lines = [f'[ll] rank {rank} | eager dispatch + combine: {bench(lambda: both(False))[0] * 1e6:.1f} us']
    if getattr(buf, '_ll_internode', None) is not None:
        return lines + internode_low_latency_rows(buf, inp, M, y, both, group)
    barrier = (lambda: group.barrier())
    d, c = bench_kineto(lambda: both(False), kernel_names=('dispatch', 'combine'), barrier_comm_profiling=True,
                        suppress_kineto_output=True, barrier=barrier)
    lines.append(f'[ll] rank {rank} | kernels: dispatch {d * 1e6:.1f} us, combine {c * 1e6:.1f} us')
    d, c = bench_kineto(lambda: both(True), kernel_names=('dispatch', 'combine'), barrier_comm_profiling=True,
                        suppress_kineto_output=True, num_kernels_per_period=2, barrier=barrier)
    lines.append(f'[ll] rank {rank} | hooks: dispatch send {d[0] * 1e6:.1f} + recv {d[1] * 1e6:.1f} us, combine send '
                 f'{c[0] * 1e6:.1f} + recv {c[1] * 1e6:.1f} us')
    group.barrier()
    lines.append(f'[ll] rank {rank} | CUDA graph: dispatch + combine {graph_us(lambda: both(False)):.1f} us, with '
                 f'hooks {graph_us(lambda: both(True)):.1f} us')
    return lines


def internode_low_latency_rows(buf: Buffer, inp, M: int, y, both: Callable[[bool], None], group) -> List[str]:
    """`low_latency_rows` across scale-up domains: spans (CUDA events; every rank starts each sample after a host
    barrier) of dispatch, combine, the hook-mode send calls and their `hook()` receives, and CUDA graphs."""
    rank, E = inp.rank, inp.E
    state = {}

    def synced(fn):
        def run():
            torch.cuda.synchronize()
            group.barrier()
            fn()
        return run

    def dispatch(hook=False):
        state['d'] = buf.low_latency_dispatch(inp.x, inp.topk_idx, M, E, use_fp8=True, return_recv_hook=hook)

    def combine(hook=False):
        state['c'] = buf.low_latency_combine(y, inp.topk_idx, inp.topk_weights, state['d'][2], return_recv_hook=hook)

    dispatch()
    torch.cuda.synchronize()
    d = span_us(dispatch, synced(lambda: None))
    c = span_us(combine, synced(dispatch))
    ds = span_us(lambda: dispatch(True), synced(lambda: None))
    dr = span_us(lambda: state['d'][4](), synced(lambda: dispatch(True)))
    cs = span_us(lambda: combine(True), synced(dispatch))
    cr = span_us(lambda: state['c'][2](), synced(lambda: (dispatch(), combine(True))))
    lines = [f'[ll] rank {rank} | across domains, spans: dispatch {d:.1f} us, combine {c:.1f} us',
             f'[ll] rank {rank} | across domains, hooks: dispatch send {ds:.1f} + recv {dr:.1f} us, combine send '
             f'{cs:.1f} + recv {cr:.1f} us']
    group.barrier()
    lines.append(f'[ll] rank {rank} | CUDA graph: dispatch + combine {graph_us(lambda: both(False)):.1f} us, with '
                 f'hooks {graph_us(lambda: both(True)):.1f} us')
    return lines
