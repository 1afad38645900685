"""Hybrid-mode rows of the EP benchmark (`perf/ep_bench.py --hybrid`): EP across several scale-up domains.

    DEEPEP_CUPY_SCALEUP_SIZE=1 launch/run_local.sh 2 python perf/ep_bench.py --hybrid --out DIR    # 2 domains x 1 rank

Per (tokens, dtype), on the buffer's domains (N > 1; one domain: nothing to measure, said so):
  hybrid     `ElasticBuffer.dispatch` with CPU sync (sync) and without (nosync), and `combine` (recv_x as bfloat16,
             recv_topk_weights passed, as DeepEP's test_ep does)
  onedomain  the same calls on a buffer of the same ranks without `DEEPEP_CUPY_SCALEUP_SIZE` (when that makes one
             domain; else skipped with the reason)
  refs       `refs.dispatch_nccl` / `combine_nccl` (skipped with the reason when ranks share a GPU: NCCL refuses two
             ranks of one communicator on one GPU)
Columns: host µs per call (median of single calls, GPU drained between them), GPU µs per call (`bench`: CUDA events,
L2 flushed, max over ranks), GB/s in DeepEP's metrics (tests/elastic/test_ep.py), byte counts of the hybrid split for
every path (same routing, same work):
  SO  dispatch: tokens sent to each scale-out domain with at least one of their experts, summed over domains (own
      domain included unless --ignore-local-traffic; 0 with one domain); combine: distinct destination ranks per token
      (own domain's ranks excluded with --ignore-local-traffic); times the bytes per token.
  SU  rows this rank receives (all sources, own domain included; with --ignore-local-traffic without the sources of
      this rank's scale-up index); combine sends the same rows back.
  rail  what the hybrid path really puts on the rails: one row per (token, other domain), either direction.
Bytes per token: dispatch hidden * itemsize + 4 * num_sf + 12 * num_topk; combine 2 * hidden + 4 * num_topk.
Rank means of the byte counts, max over ranks of the time. Then `[timeline]`: one hybrid dispatch (CPU sync) and
one combine under torch.profiler, GPU time per stage (kernel names of features/hybrid/kernels.py and features/ep)
and the span from the first kernel's start to the last one's end (median over calls).

Pure parts (byte accounting, row text, skip reasons, stage timeline) need no GPU: tests/test_ep_bench_hybrid_cpu.py.
"""

import json
import os
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

OPS = ('dispatch_sync', 'dispatch_nosync', 'combine')


# ---- byte accounting (DeepEP's test_ep definitions) ---------------------------------------------------------------
def hybrid_tokens(topk_idx, rows: Sequence[Sequence[int]], rank: int, num_experts: int, num_domains: int,
                  num_scaleup: int, ignore_local: bool = False) -> Dict[str, int]:
    """Token counts of one rank for SO / SU / rail.

    Args:
        topk_idx: this rank's `[T, K]` global expert ids (-1: none), numpy or a CPU tensor.
        rows: `rows[src][dst]` tokens rank src dispatches to rank dst (`bench_bytes.tokens_per_rank` of every rank).
        rank: this rank, `domain * num_scaleup + scaleup index`.
        num_experts, num_domains, num_scaleup: E, N, R (W = N * R ranks, E / W experts each).
        ignore_local: DeepEP's --ignore-local-traffic.

    Returns:
        {'dispatch_so', 'combine_so', 'su', 'rail'}: tokens (multiply by the bytes per token of the op).
    """
    idx = np.asarray(topk_idx).astype(np.int64)
    N, R = num_domains, num_scaleup
    W = N * R
    if num_experts % W:
        raise ValueError(f'num_experts ({num_experts}) must be a multiple of the ranks ({W})')
    own = rank // R
    valid = idx >= 0
    dom = np.where(valid, idx // (num_experts // N), -1)
    dst = np.where(valid, idx // (num_experts // W), -1)

    def per_token_distinct(values, keep):
        return sum(len({int(v) for v, k in zip(row, krow) if k}) for row, krow in zip(values, keep))
    dispatch_so = 0 if N == 1 else per_token_distinct(dom, valid & ((dom != own) | (not ignore_local)))
    local_rank = (dst >= own * R) & (dst < (own + 1) * R)
    combine_so = per_token_distinct(dst, valid & ~(local_rank & ignore_local))
    if N == 1 and not ignore_local:
        combine_so = 0
    su = sum(int(rows[s][rank]) for s in range(W) if not (ignore_local and s % R == rank % R))
    rail = per_token_distinct(dom, valid & (dom != own))
    return {'dispatch_so': dispatch_so, 'combine_so': combine_so, 'su': su, 'rail': rail}


def hybrid_bytes(tokens: Dict[str, int], hidden: int, itemsize: int, num_sf: int, num_topk: int) -> Dict[str, dict]:
    """{'dispatch': {'so', 'su', 'rail'}, 'combine': {...}} bytes of one rank from `hybrid_tokens`."""
    d = hidden * itemsize + 4 * num_sf + 12 * num_topk
    c = 2 * hidden + 4 * num_topk
    return {'dispatch': {'so': tokens['dispatch_so'] * d, 'su': tokens['su'] * d, 'rail': tokens['rail'] * d},
            'combine': {'so': tokens['combine_so'] * c, 'su': tokens['su'] * c, 'rail': tokens['rail'] * c}}


def add_rates(row: dict, nbytes: Dict[str, float]) -> dict:
    """GB/s of one row from its GPU µs: so_gbs, su_gbs, rail_gbs (None without a time)."""
    us = row.get('us')
    for key in ('so', 'su', 'rail'):
        row[f'{key}_gbs'] = nbytes[key] / us / 1e3 if us else None
    return row


# ---- skip reasons -------------------------------------------------------------------------------------------------
def refs_skip_reason(gpus: Sequence, comm_error: Optional[str] = None) -> Optional[str]:
    """Why the refs (NCCL all-to-all) rows cannot run, or None. `gpus`: per rank, its GPU as NCCL tells GPUs apart
    (`Topology.nccl_gpu_ids`: NCCL host and bus id; ranks sharing a GPU as different NCCL hosts are accepted)."""
    seen = {}
    for r, g in enumerate(gpus):
        if g in seen:
            return (f'ranks {seen[g]} and {r} share GPU {g} as one NCCL host: NCCL refuses two ranks of one '
                    f'communicator there (give each rank its own NCCL_HOSTID); refs rows skipped')
        seen[g] = r
    if comm_error:
        return f'NCCL communicator failed ({comm_error}); refs rows skipped'
    return None


def hybrid_skip_reason(num_domains: int) -> Optional[str]:
    if num_domains <= 1:
        return ('the buffer has one scale-up domain: no hybrid rows (set DEEPEP_CUPY_SCALEUP_SIZE to cut the GPUs '
                'of a host into domains, e.g. DEEPEP_CUPY_SCALEUP_SIZE=1)')
    return None


def one_domain_skip_reason(scaleup_env: Optional[str], num_domains: Optional[int], error: Optional[str]) -> \
        Optional[str]:
    """Why the one-domain rows of the same ranks are missing, or None."""
    if not scaleup_env:
        return 'the ranks span several scale-up domains without DEEPEP_CUPY_SCALEUP_SIZE: no one-domain path'
    if error:
        return f'one-domain buffer failed ({error})'
    if num_domains != 1:
        return f'without DEEPEP_CUPY_SCALEUP_SIZE the ranks still form {num_domains} domains: no one-domain path'
    return None


# ---- row text -----------------------------------------------------------------------------------------------------
def _f(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else '-'.rjust(len(format(0.0, spec)))


HEADER = 'tokens dtype path      op              |  host us   GPU us | SO GB/s SU GB/s rail GB/s'


def row_text(r: dict) -> str:
    text = (f"{r['num_tokens']:6d} {r['dtype']:>5} {r['path']:9s} {r['op']:15s} | {_f(r.get('host_us'), '8.1f')} "
            f"{_f(r.get('us'), '8.1f')} | {_f(r.get('so_gbs'), '7.1f')} {_f(r.get('su_gbs'), '7.1f')} "
            f"{_f(r.get('rail_gbs'), '9.1f')}")
    if r.get('error'):
        text += f"  error: {r['error']}"
    return text


# ---- GPU timeline -------------------------------------------------------------------------------------------------
# Kernel names as the profiler shows them (features/hybrid/kernels.py, features/ep/kernels.py, NCCL), matched as
# substrings in this order, and the stage they belong to.
STAGES = (('hybrid_route', 'route'), ('hybrid_pack', 'pack'), ('hybrid_report', 'report'),
          ('hybrid_unpack', 'unpack'), ('hybrid_combine_pack', 'combine_pack'),
          ('hybrid_combine_final', 'combine_final'), ('rail_epoch_begin', 'rail'), ('rail_signal', 'rail'),
          ('rail_wait', 'rail'), ('nccl', 'rail'), ('value_range_kernel', 'intranode'),
          ('notify_dispatch', 'intranode'), ('fused_notify_and_dispatch', 'intranode'),
          ('dispatch_impl', 'intranode'), ('combine_impl', 'intranode'))


def stage_of(name: str) -> Optional[str]:
    low = name.lower()
    return next((stage for key, stage in STAGES if key.lower() in low), None)


def stage_timeline(events) -> dict:
    """One call's GPU stages from chrome-trace events (kernels and memcpys): {'stages': [(stage, µs, kernels)] in
    order of first start, 'span': first start to last end (µs), 'other': µs of kernels of no known stage}."""
    evs = sorted((e for e in events if e.get('cat') in ('kernel', 'gpu_memcpy')), key=lambda e: e['ts'])
    if not evs:
        return {'stages': [], 'span': None, 'other': 0.0}
    stages: Dict[str, list] = {}
    other = 0.0
    for e in evs:
        s = 'copy' if e.get('cat') == 'gpu_memcpy' else stage_of(e.get('name', ''))
        if s is None:
            other += e['dur']
            continue
        acc = stages.setdefault(s, [0.0, 0])
        acc[0] += e['dur']
        acc[1] += 1
    span = max(e['ts'] + e['dur'] for e in evs) - evs[0]['ts']
    return {'stages': [(s, v[0], v[1]) for s, v in stages.items()], 'span': float(span), 'other': other}


def merge_timelines(calls: List[dict]) -> dict:
    """Median over calls of every stage's µs and of the span (stage order of the first call)."""
    if not calls or not calls[0]['stages']:
        return {'stages': [], 'span': None, 'other': 0.0}
    order = [s for s, _, _ in calls[0]['stages']]
    per = {s: [dict((n, v) for n, v, _ in c['stages']).get(s, 0.0) for c in calls] for s in order}
    counts = {s: k for s, _, k in calls[0]['stages']}
    return {'stages': [(s, float(np.median(per[s])), counts[s]) for s in order],
            'span': float(np.median([c['span'] for c in calls])),
            'other': float(np.median([c['other'] for c in calls]))}


def timeline_text(label: str, t: dict) -> str:
    if not t.get('stages'):
        return f'[timeline] {label}: no kernels in the trace'
    parts = [f"{s} {us:.1f}" + (f' (x{k})' if k > 1 else '') for s, us, k in t['stages']]
    if t.get('other'):
        parts.append(f"other {t['other']:.1f}")
    return f"[timeline] {label}: " + ' | '.join(parts) + f" | span {_f(t.get('span'), '.1f')} us"


def profile_calls(fn, num_calls: int) -> dict:
    """Run `fn` `num_calls` times, each under its own torch.profiler session; the merged stage timeline."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from deepep_cupy.utils.testing import profiler_trace_events
    calls = []
    for _ in range(num_calls):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        calls.append(stage_timeline(profiler_trace_events(prof)))
    return merge_timelines(calls)


# ---- GPU measurement ------------------------------------------------------------------------------------------------
def host_us(fn, num_calls: int) -> float:
    """Median host µs of single calls (the GPU drained before each, so no queue hides the launch cost)."""
    import torch
    times = []
    for _ in range(num_calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return float(np.median(times))


def measure(group, args, helpers, fns: Dict[str, object]) -> Dict[str, dict]:
    """Per op: {'host_us', 'us', 'us_per_rank'} or {'error'} (every rank takes the same branch)."""
    collect, timed = helpers['collect'], helpers['timed']
    out = {}
    for op, fn in fns.items():
        t = timed(group, args, fn)
        host, err = collect(group, host_us, fn, max(3, args.num_tests // 5))
        if err is None:
            t['host_us'] = max(group.allgather_object(host))
        out[op] = t
    return out


def _calls(buf, x_in, topk_idx, topk_weights, num_experts):
    """(dispatch sync, dispatch nosync, combine) callables of one buffer, from one CPU-sync dispatch."""
    import torch
    kw = dict(topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts)
    recv_x, _, recv_w, handle, _ = buf.dispatch(x_in, do_cpu_sync=True, **kw)
    x_comb = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).to(torch.bfloat16)
    return {'dispatch_sync': lambda: buf.dispatch(x_in, do_cpu_sync=True, **kw),
            'dispatch_nosync': lambda: buf.dispatch(x_in, do_cpu_sync=False, **kw),
            'combine': lambda: buf.combine(x_comb, handle, topk_weights=recv_w)}


def _refs_calls(comm, num_max_tokens, num_experts, x_in, topk_idx, topk_weights):
    """(dispatch, combine) callables of the NCCL all-to-all reference, from one reference dispatch."""
    import torch

    from deepep_cupy.utils import refs

    def dispatch():
        return refs.dispatch_nccl(x_in, topk_idx, topk_weights, num_max_tokens, num_experts, comm)
    ref = dispatch()
    ref_x = ref.result.recv_x.to(torch.bfloat16)
    return {'dispatch_sync': dispatch, 'combine': lambda: refs.combine_nccl(ref_x, ref.handle, comm)}


def _make_buffer(group, args, environ_drop: Optional[str] = None):
    from deepep_cupy import ElasticBuffer
    saved = os.environ.pop(environ_drop, None) if environ_drop else None
    try:
        return ElasticBuffer(group, num_max_tokens_per_rank=max(args.tokens), hidden=args.hidden,
                             num_topk=args.num_topk, num_gpu_timeout_secs=args.num_gpu_timeout_secs,
                             explicitly_destroy=True)
    finally:
        if saved is not None:
            os.environ[environ_drop] = saved


def run(group, args, env: dict, log, helpers) -> int:
    """The --hybrid benchmark; writes DIR/ep_bench_hybrid.json on rank 0. `helpers`: ep_bench's collect, timed,
    make_inputs (passed in so that imports run one way: ep_bench -> this module)."""
    import torch

    from deepep_cupy.runtime.nccl import create_nccl_comm
    from deepep_cupy.utils import bench_bytes
    from deepep_cupy.utils.math import per_token_cast_to_fp8
    collect, make_inputs = helpers['collect'], helpers['make_inputs']
    rank, W = group.rank, group.size
    buf = _make_buffer(group, args)
    N, R = buf.num_scaleout_ranks, buf.num_scaleup_ranks
    reason = hybrid_skip_reason(N)
    if reason:
        log(f'[hybrid] skipped: {reason}')
        buf.destroy()
        return 0
    log(f'[hybrid] {N} domains x {R} ranks, rail transport {buf._ep_feature().rails.kind}')
    scaleup_env = os.environ.get('DEEPEP_CUPY_SCALEUP_SIZE')
    one, err = (collect(group, _make_buffer, group, args, 'DEEPEP_CUPY_SCALEUP_SIZE') if scaleup_env
                else (None, None))
    one_reason = one_domain_skip_reason(scaleup_env, one.num_scaleout_ranks if one is not None else None, err)
    if one_reason:
        log(f'[hybrid] onedomain rows skipped: {one_reason}')
    gpus = list(buf.topology.nccl_gpu_ids)        # (NCCL host, bus id) per rank: what NCCL tells apart
    comm, comm_err = (None, None)
    refs_reason = refs_skip_reason(gpus)
    if refs_reason is None:
        comm, comm_err = collect(group, create_nccl_comm, group)
        refs_reason = refs_skip_reason(gpus, comm_err)
    if refs_reason:
        log(f'[hybrid] {refs_reason}')
    rows, timelines = [], {}
    dtypes = [d for d in args.dtypes.split(',') if d]
    log(HEADER)
    for T in args.tokens:
        x, topk_idx, topk_weights = make_inputs(args, T, rank, W)
        rows_matrix = group.allgather_object(bench_bytes.tokens_per_rank(topk_idx.cpu(), args.num_experts, W))
        tokens = hybrid_tokens(topk_idx.cpu(), rows_matrix, rank, args.num_experts, N, R, args.ignore_local_traffic)
        for dtype in dtypes:
            fp8 = dtype == 'fp8'
            x_in = per_token_cast_to_fp8(x) if fp8 else x
            nb = hybrid_bytes(tokens, args.hidden, 1 if fp8 else 2, x_in[1].shape[1] if fp8 else 0, args.num_topk)
            per_rank = group.allgather_object(nb)
            mean = {op: {k: float(np.mean([p[op][k] for p in per_rank])) for k in nb[op]} for op in nb}
            paths = [('hybrid', buf)] + ([('onedomain', one)] if one_reason is None else [])
            for path, b in paths:
                fns, err = collect(group, _calls, b, x_in, topk_idx, topk_weights, args.num_experts)
                res = {op: {'error': err} for op in OPS} if err else measure(group, args, helpers, fns)
                for op in OPS:
                    rows.append(add_rates({'num_tokens': T, 'dtype': dtype, 'path': path, 'op': op, **res[op]},
                                          mean['combine' if op == 'combine' else 'dispatch']))
                    log(row_text(rows[-1]))
                if path == 'hybrid' and err is None and T == max(args.tokens) and dtype == dtypes[0]:
                    for op in ('dispatch_sync', 'combine'):
                        t, terr = collect(group, profile_calls, fns[op], 5)
                        timelines[op] = t if terr is None else {'error': terr}
                del fns
            if refs_reason is None:
                fns, err = collect(group, _refs_calls, comm, buf.num_max_tokens_per_rank, args.num_experts, x_in,
                                   topk_idx, topk_weights)
                res = measure(group, args, helpers, fns) if err is None else {}
                for op in ('dispatch_sync', 'combine'):
                    r = res.get(op, {'error': err})
                    rows.append(add_rates({'num_tokens': T, 'dtype': dtype, 'path': 'refs', 'op': op, **r},
                                          mean['combine' if op == 'combine' else 'dispatch']))
                    log(row_text(rows[-1]))
            group.barrier()
    T = max(args.tokens)
    for op, t in timelines.items():
        name = 'dispatch (CPU sync)' if op == 'dispatch_sync' else 'combine'
        label = f'hybrid {name} {T} {dtypes[0]}'
        log(f'[timeline] {label}: error: {t["error"]}' if 'error' in t else timeline_text(label, t))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        data = {'config': {**{k: v for k, v in vars(args).items() if k != 'plot_from'}, 'num_ranks': W,
                           'num_domains': N, 'num_scaleup': R, 'rail_transport': buf._ep_feature().rails.kind},
                'environment': env, 'skipped': {'onedomain': one_reason, 'refs': refs_reason}, 'rows': rows,
                'timelines': timelines}
        path = os.path.join(args.out, 'ep_bench_hybrid.json')
        with open(path, 'w') as f:
            json.dump(data, f, indent=1, default=str)
        log(f'[hybrid] wrote {path}')
    group.barrier()
    torch.cuda.synchronize()
    if comm is not None:
        comm.destroy()
    if one is not None:
        one.destroy()
    buf.destroy()
    return 0
