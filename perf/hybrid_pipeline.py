"""Hybrid P2 against P1 in one run ("pipelining ... measured against the sequential version").

    # 2 domains x 1 rank sharing GPU 0, loopback rails (logic-grade figures: the ranks time-slice one GPU)
    CUDA_VISIBLE_DEVICES=0 DEEPEP_CUPY_SCALEUP_SIZE=1 DEEPEP_CUPY_RAIL_TRANSPORT=loopback \\
        launch/run_local.sh 2 python perf/hybrid_pipeline.py
    # 2 domains x 1 rank on two GPUs, NCCL rails
    DEEPEP_CUPY_SCALEUP_SIZE=1 DEEPEP_CUPY_RAIL_TRANSPORT=nccl launch/run_local.sh 2 python perf/hybrid_pipeline.py

One hybrid `ElasticBuffer`; its feature's `pipeline` switch is flipped on every rank alike between the modes, so both
modes run the same inputs on the same buffer. Per (tokens, dtype): first a check that both modes give bitwise the same
dispatch outputs (recv_x, scales, top-k, weights, source metadata; CPU sync and not) and the same combine, then the GPU
span per call of each op (`utils.bench`: CUDA events on the caller's stream around the call, L2 flushed, mean over
calls, max over ranks; the pipelined dispatch's side stream is joined into the caller's stream before the call
returns, so the span covers it) and the ratio P2 / P1 (below 1: the pipeline is faster). P2's combine cuts its rail
exchange in chunks and reduces the tokens whose partials landed on the side stream meanwhile. Exit status 1 if any
output differs.
"""

import argparse
import json
import os
import sys
from typing import Dict, List

OPS = ('dispatch_nosync', 'dispatch_sync', 'combine')
MODES = ('P1', 'P2')


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--tokens', type=lambda s: [int(v) for v in s.split(',') if v], default=[512, 4096])
    p.add_argument('--hidden', type=int, default=7168)
    p.add_argument('--num-topk', type=int, default=8)
    p.add_argument('--num-experts', type=int, default=256)
    p.add_argument('--dtypes', default='bf16', help='comma-separated: bf16, fp8')
    p.add_argument('--chunk-rows', type=int, default=0, help='rail rows per payload chunk (0: automatic)')
    p.add_argument('--num-warmups', type=int, default=5)
    p.add_argument('--num-tests', type=int, default=20)
    p.add_argument('--num-gpu-timeout-secs', type=float, default=60.0)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--out', default='', help='directory for hybrid_pipeline.json (rank 0)')
    return p


def ratio_text(p1: float, p2: float) -> str:
    """`P2 / P1` as text (`n/a` without a P1 time)."""
    return f'{p2 / p1:.3f}' if p1 > 0 else 'n/a'


def row_text(T: int, dtype: str, op: str, times: Dict[str, float]) -> str:
    p1, p2 = times['P1'], times['P2']
    return (f'{T:>6} {dtype:<5} {op:<16} P1 {p1 * 1e6:9.1f} us   P2 {p2 * 1e6:9.1f} us   P2/P1 {ratio_text(p1, p2)}')


def _inputs(T: int, args, rank: int):
    import torch
    g = torch.Generator(device='cpu').manual_seed(args.seed * 1000 + rank * 7 + T)
    x = torch.randn((T, args.hidden), generator=g).to(torch.bfloat16)
    scores = torch.rand((T, args.num_experts), generator=g)
    topk = torch.topk(scores, args.num_topk, dim=1).indices.to(torch.int64)
    w = torch.rand((T, args.num_topk), generator=g)
    return x.cuda(), topk.cuda(), w.cuda()


def _same(a, b) -> bool:
    import torch
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype in (
        torch.float8_e4m3fn,) else a, b.view(torch.uint8) if b.dtype in (torch.float8_e4m3fn,) else b)


def check_modes(buf, hybrid, x_in, topk, w, num_experts: int) -> List[str]:
    """Dispatch (CPU sync and not) and combine in both modes; the names of the outputs that differ."""
    import torch
    outs = {}
    for mode in MODES:
        hybrid.pipeline = mode == 'P2'
        got = {}
        for sync in (True, False):
            rx, rt, rw, h, _ = buf.dispatch(x_in, topk, w, num_experts=num_experts, do_cpu_sync=sync)
            got[sync] = (rx, rt, rw, h.recv_src_metadata if hasattr(h, 'recv_src_metadata') else None)
            if sync:
                handle = h          # the combine below takes the CPU-sync dispatch's rows: its handle
        rx = got[True][0][0] if isinstance(got[True][0], tuple) else got[True][0]
        cx, cw, _ = buf.combine(rx.to(torch.bfloat16), handle, topk_weights=got[True][2])
        outs[mode] = (got, cx, cw)
        torch.cuda.synchronize()
    bad = []
    (g1, c1, w1), (g2, c2, w2) = outs['P1'], outs['P2']
    # Without CPU sync the outputs have the worst-case rows; only the first n (the CPU-sync dispatch's rows, same
    # routing) are written, the rest is whatever the allocator held: compare those n.
    n = (g1[True][0][0] if isinstance(g1[True][0], tuple) else g1[True][0]).shape[0]

    def valid(t, sync):
        if sync or t is None:
            return t
        return tuple(u[:n] for u in t) if isinstance(t, tuple) else t[:n]
    for sync in (True, False):
        for name, a, b in zip(('recv_x', 'recv_topk_idx', 'recv_topk_weights', 'recv_src_metadata'), g1[sync],
                              g2[sync]):
            if not _same(valid(a, sync), valid(b, sync)):
                bad.append(f'{name} (do_cpu_sync={sync})')
    if not _same(c1, c2):
        bad.append('combined_x')
    if not _same(w1, w2):
        bad.append('combined_topk_weights')
    return bad


def _calls(buf, x_in, topk, w, num_experts: int, y, handle):
    """The timed calls of one (tokens, dtype, mode)."""
    return {'dispatch_nosync': lambda: buf.dispatch(x_in, topk, w, num_experts=num_experts, do_cpu_sync=False),
            'dispatch_sync': lambda: buf.dispatch(x_in, topk, w, num_experts=num_experts, do_cpu_sync=True),
            'combine': lambda: buf.combine(y, handle)}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from deepep_cupy import ElasticBuffer
    from deepep_cupy.features.hybrid.feature import HybridEP
    from deepep_cupy.runtime.group import get_group
    from deepep_cupy.utils.envs import init_dist
    from deepep_cupy.utils.math import per_token_cast_to_fp8
    from deepep_cupy.utils.testing import bench
    rank, num_ranks, _ = init_dist(seed=args.seed)
    group = get_group()
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    buf = ElasticBuffer(group, num_max_tokens_per_rank=max(args.tokens), hidden=args.hidden, num_topk=args.num_topk,
                        num_gpu_timeout_secs=args.num_gpu_timeout_secs, explicitly_destroy=True)
    ep = buf._ep_feature()
    hybrid = ep if isinstance(ep, HybridEP) else None
    if hybrid is None:
        log('[hybrid_pipeline] skipped: one scale-up domain (set DEEPEP_CUPY_SCALEUP_SIZE to make several)')
        buf.destroy()
        return 0
    hybrid.pipeline_rows = args.chunk_rows
    log(f'[hybrid_pipeline] {buf.num_scaleout_ranks} domains x {buf.num_scaleup_ranks} ranks, rail transport '
        f'{hybrid.rails.kind}, hidden {args.hidden}, top-{args.num_topk}, {args.num_experts} experts, chunk rows '
        f'{args.chunk_rows or "auto"}')
    rows, failures = [], 0
    for T in args.tokens:
        x, topk, w = _inputs(T, args, rank)
        for dtype in [d for d in args.dtypes.split(',') if d]:
            x_in = per_token_cast_to_fp8(x) if dtype == 'fp8' else x
            bad = check_modes(buf, hybrid, x_in, topk, w, args.num_experts)
            bad_all = [b for r in group.allgather_object(bad) for b in r]
            if bad_all:
                failures += 1
                log(f'[hybrid_pipeline] {T} {dtype}: P2 differs from P1 in {sorted(set(bad_all))}')
            else:
                log(f'[hybrid_pipeline] {T} {dtype}: P2 outputs bitwise equal to P1 (dispatch both syncs, combine)')
            times: Dict[str, Dict[str, float]] = {op: {} for op in OPS}
            for mode in MODES:
                hybrid.pipeline = mode == 'P2'
                _, _, _, handle, _ = buf.dispatch(x_in, topk, w, num_experts=args.num_experts, do_cpu_sync=True)
                rx = buf.dispatch(x_in, handle=handle, topk_weights=w)[0]
                y = (rx[0] if isinstance(rx, tuple) else rx).to(torch.bfloat16)
                fns = _calls(buf, x_in, topk, w, args.num_experts, y, handle)
                for op in OPS:
                    group.barrier()
                    t = bench(fns[op], num_warmups=args.num_warmups, num_tests=args.num_tests).avg
                    times[op][mode] = max(group.allgather_object(t))
            hybrid.pipeline = False
            for op in OPS:
                rows.append({'num_tokens': T, 'dtype': dtype, 'op': op, 'P1_s': times[op]['P1'],
                             'P2_s': times[op]['P2'], 'ratio': times[op]['P2'] / times[op]['P1']})
                log(row_text(T, dtype, op, times[op]))
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, 'hybrid_pipeline.json')
        with open(path, 'w') as f:
            json.dump({'config': vars(args), 'num_ranks': num_ranks, 'rail_transport': hybrid.rails.kind,
                       'rows': rows, 'failures': failures}, f, indent=1)
        log(f'[hybrid_pipeline] wrote {path}')
    group.barrier()
    torch.cuda.synchronize()
    buf.destroy()
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
