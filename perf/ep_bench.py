"""EP benchmark: deepep_cupy dispatch and combine next to their baselines, measured in the same run on the same inputs.

    launch/run_local.sh 2 python perf/ep_bench.py --out DIR [--tokens 128,512,4096,8192] [--num-sms 0,24]
    python perf/ep_bench.py --plot-from DIR/ep_bench.json        # redraw the PNG on a machine with matplotlib
    DEEPEP_CUPY_SCALEUP_SIZE=1 launch/run_local.sh 2 python perf/ep_bench.py --hybrid --out DIR   # ep_bench_hybrid.py

Paths per case (tokens x {bf16, fp8} x num_sms; hidden 7168, top-8, 256 experts, balanced routing by default):
  ours  `ElasticBuffer.dispatch` (do_cpu_sync=True) and `combine` (input: recv_x converted to bfloat16)
  refs  `deepep_cupy.utils.refs.dispatch_nccl` / `combine_nccl` (NCCL all_to_all_single + index ops, what users write)
  a2a   one raw NCCL all_to_all_single of exactly the cross-GPU bytes of the case
  floor the peer-copy kernel (`deepep_cupy.features.peer_copy`) moving exactly the cross-GPU bytes, with the same SM
        count as ours (/floor) and with every SM of the GPU (/flall)
Bytes (`deepep_cupy.utils.bench_bytes`): dispatch token = hidden*itemsize + 4*num_sf + 12*num_topk (hidden, scales,
int64 ids, float32 weights); combine token = 2*hidden. GB/s = DeepEP's logical bytes (rows received by dispatch /
sent back by combine, own rows included) / time; link GB/s = bytes this rank sends to peers / time. Time = the
`bench` average (CUDA events, L2 flushed before each call, first sample dropped) per rank, maximum over ranks; byte
counts are means over ranks. Decode: 128 tokens, FP8 dispatch (do_cpu_sync=False) and BF16 combine, each captured in
its own torch CUDA graph; µs per replay (median of per-replay CUDA events).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)     # run from a checkout without installing

from deepep_cupy.runtime import preflight  # noqa: E402  (torch-free: --help and --plot-from need no GPU)

TARGETS = {'floor_ratio_max': 1.15, 'target_tokens': 4096, 'target_max_sms': 24, 'refs_speedup_min': 5.0,
           'decode_dispatch_us_max': 20.0, 'decode_combine_us_max': 25.0}
PATHS = ('ours', 'floor', 'a2a', 'refs')


def ints(text: str):
    return [int(v) for v in text.split(',') if v.strip()]


def collect(group, fn, *args):
    """Run `fn(*args)` on every rank and agree on the outcome: (this rank's value, None) when every rank succeeded,
    else (None, the errors of the failing ranks) on every rank, so that all ranks take the same branch next."""
    try:
        value, err = fn(*args), None
    except Exception as e:  # one failing path must not stop the others
        value, err = None, f'{type(e).__name__}: {e}'
        traceback.print_exc()
    errors = [f'rank {r}: {e}' for r, e in enumerate(group.allgather_object(err)) if e]
    return (None, '; '.join(errors)) if errors else (value, None)


def timed(group, args, fn):
    """`bench` on every rank: {'us': max over ranks of the per-rank average, 'us_per_rank': [...]} or {'error': ...}."""
    import cupy

    from deepep_cupy.utils.testing import bench
    value, err = collect(group, lambda: bench(fn, args.num_warmups, args.num_tests).avg * 1e6)
    cupy.cuda.runtime.deviceSynchronize()
    if err:
        return {'error': err}
    values = group.allgather_object(value)
    return {'us': max(values), 'us_per_rank': values}


def make_inputs(args, num_tokens: int, rank: int, num_ranks: int):
    import torch

    from deepep_cupy.utils.gate import get_unbalanced_scores
    torch.manual_seed(args.seed * 1000003 + rank * 7919 + num_tokens)
    x = torch.randn(num_tokens, args.hidden, dtype=torch.bfloat16, device='cuda')
    if args.unbalanced_ratio == 1.0:
        scores = torch.randn(num_tokens, args.num_experts, device='cuda').abs() + 1
    else:
        scores = get_unbalanced_scores(num_tokens, args.num_experts, num_ranks, args.num_topk, args.unbalanced_ratio,
                                       device='cuda')
    topk_idx = torch.topk(scores, args.num_topk, dim=-1, sorted=False).indices
    topk_weights = torch.randn(num_tokens, args.num_topk, dtype=torch.float32, device='cuda')
    return x, topk_idx, topk_weights


def same_bits(a, b) -> bool:
    import torch
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def bench_baselines(group, args, comm, floor, buf, x_in, topk_idx, topk_weights, tr):
    """refs, raw a2a and the all-SM floor of one (tokens, dtype); they do not depend on num_sms."""
    import torch

    from deepep_cupy.utils import refs
    out = {}
    if comm is None:
        out['refs'] = out['a2a'] = {'dispatch': {'error': 'no NCCL communicator'}, 'combine': {'error': 'no NCCL'}}
    else:
        def refs_dispatch():
            return refs.dispatch_nccl(x_in, topk_idx, topk_weights, buf.num_max_tokens_per_rank, args.num_experts, comm)
        ref, err = collect(group, refs_dispatch)
        out['refs'] = {'dispatch': timed(group, args, refs_dispatch) if err is None else {'error': err}}
        if err is None:
            ref_x = ref.result.recv_x.to(torch.bfloat16)
            out['refs']['combine'] = timed(group, args, lambda: refs.combine_nccl(ref_x, ref.handle, comm))
            out['refs']['result'] = ref
        else:
            out['refs']['combine'] = {'error': 'refs dispatch failed'}
        out['a2a'] = {}
        for op, t in tr.items():
            send = torch.empty(sum(t.send_bytes), dtype=torch.uint8, device='cuda')
            recv = torch.empty(sum(t.recv_bytes), dtype=torch.uint8, device='cuda')
            out['a2a'][op] = timed(group, args, lambda s=send, r=recv, t=t: comm.all_to_all_single(
                r, s, recv_splits=t.recv_bytes, send_splits=t.send_bytes))
    out['floor_all_sms'] = {op: bench_floor(group, args, floor, buf, t, buf.num_device_sms) for op, t in tr.items()}
    return out


def bench_floor(group, args, floor, buf, t, num_sms: int):
    import torch
    src = torch.randint(0, 256, (max(16, t.cross_bytes),), dtype=torch.uint8, device='cuda')
    stride = max(16, max(t.send_bytes))
    launch, err = collect(group, floor.prepare, src, t.send_bytes, buf.data_offset, (stride + 4095) // 4096 * 4096,
                          num_sms)
    if err:
        return {'error': err}
    from deepep_cupy.runtime import interop
    return timed(group, args, lambda: launch(interop.current_stream()))


def bench_ours(group, args, comm, buf, x_in, topk_idx, topk_weights, num_sms: int, ref):
    """Our dispatch and combine of one case; returns (results, SMs the dispatch used)."""
    import torch

    from deepep_cupy.utils import refs
    kw = dict(topk_idx=topk_idx, topk_weights=topk_weights, num_experts=args.num_experts, num_sms=num_sms)
    first, err = collect(group, lambda: buf.dispatch(x_in, **kw))
    if err:
        return {'dispatch': {'error': err}, 'combine': {'error': 'dispatch failed'}}, None
    recv_x, _, _, handle, _ = first
    res = {'dispatch': timed(group, args, lambda: buf.dispatch(x_in, **kw))}
    x_comb = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).to(torch.bfloat16)
    res['combine'] = timed(group, args, lambda: buf.combine(x_comb, handle, num_sms=num_sms))

    def check():   # cheap sanity check against the NCCL path (both order rows by source rank, then token)
        ours_x = recv_x if isinstance(recv_x, tuple) else (recv_x,)
        refs_x = (ref.result.recv_x,) + ((ref.result.recv_sf,) if ref.result.recv_sf is not None else ())
        combined = buf.combine(x_comb, handle, num_sms=num_sms)[0]
        expect = refs.combine_nccl(ref.result.recv_x.to(torch.bfloat16), ref.handle, comm).combined_x
        return {'dispatch_equals_refs': all(same_bits(a, b) for a, b in zip(ours_x, refs_x)),
                'combine_equals_refs': same_bits(combined, expect)}
    if ref is not None:
        res['check'], err = collect(group, check)
        res['check'] = res['check'] or {'error': err}
    return res, handle.num_sms


def ratio(a, b):
    return a / b if a and b else None


def summarize(case, base, ours, num_ranks_bytes):
    """Add GB/s and ratios to one case (rank means of the byte counts, max over ranks of the time)."""
    for op in ('dispatch', 'combine'):
        o = ours.get(op, {})
        if 'us' not in o:
            continue
        logical, cross = num_ranks_bytes[op]
        o['gbs'] = logical / o['us'] / 1e3
        o['link_gbs'] = cross / o['us'] / 1e3
        o['x_floor'] = ratio(o['us'], case['floor'][op].get('us'))
        o['x_floor_all_sms'] = ratio(o['us'], base['floor_all_sms'][op].get('us'))
        o['refs_speedup'] = ratio(base['refs'][op].get('us'), o['us'])
        o['a2a_speedup'] = ratio(base['a2a'][op].get('us'), o['us'])


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else '-'.rjust(len(format(0.0, spec)))


def row_text(c) -> str:
    cols = [f"{c['num_tokens']:6d} {c['dtype']:>5} {c['num_sms']:3d}"]
    for op in ('dispatch', 'combine'):
        o = c['ours'].get(op, {})
        cols.append(' '.join((fmt(o.get('us'), '8.1f'), fmt(o.get('gbs'), '6.1f'), fmt(o.get('link_gbs'), '6.1f'),
                              fmt(o.get('x_floor'), '6.2f'), fmt(o.get('x_floor_all_sms'), '6.2f'),
                              fmt(o.get('refs_speedup'), '6.2f'),
                              fmt(o.get('a2a_speedup'), '6.2f'))))
    check = c['ours'].get('check')
    ok = check is not None and check.get('dispatch_equals_refs') is True and check.get('combine_equals_refs') is True
    cols.append('-' if check is None else 'ok' if ok else 'error' if 'error' in check else 'MISMATCH')
    return ' | '.join(cols)


_OP_COLS = '      us   GB/s   link /floor /flall  refs/   a2a/'
HEADER = (' ' * 17 + '| ' + 'dispatch'.center(len(_OP_COLS)) + ' | ' + 'combine'.center(len(_OP_COLS)) + ' |\n'
          + f'tokens dtype sms | {_OP_COLS} | {_OP_COLS} | check')


def bench_decode(group, args, timeout):
    """Decode-size calls replayed from CUDA graphs: µs per dispatch replay and per combine replay."""
    import torch

    from deepep_cupy import ElasticBuffer
    from deepep_cupy.utils.math import per_token_cast_to_fp8
    T = args.decode_tokens
    buf = ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=args.hidden, num_topk=args.num_topk,
                        use_fp8_dispatch=True, num_gpu_timeout_secs=timeout, explicitly_destroy=True)
    try:
        x, topk_idx, topk_weights = make_inputs(args, T, group.rank, group.size)
        x_fp8 = per_token_cast_to_fp8(x)
        kw = dict(topk_idx=topk_idx, topk_weights=topk_weights, num_experts=args.num_experts,
                  num_sms=args.decode_num_sms, do_cpu_sync=False)
        for _ in range(max(1, args.num_warmups)):
            eager = buf.dispatch(x_fp8, **kw)
        y = torch.randn(eager[3].num_rows, args.hidden, dtype=torch.bfloat16, device='cuda')
        for _ in range(max(1, args.num_warmups)):
            eager_combined = buf.combine(y, eager[3])[0]
        torch.cuda.synchronize()
        group.barrier()
        graphs = {}
        graphs['dispatch'] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs['dispatch']):
            out = buf.dispatch(x_fp8, **kw)
        graphs['dispatch'].replay()     # capture ran nothing: fill the handle the combine graph reads
        torch.cuda.synchronize()
        group.barrier()
        graphs['combine'] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs['combine']):
            combined = buf.combine(y, out[3])[0]
        result = {'num_tokens': T, 'num_sms': out[3].num_sms}
        for name, graph in graphs.items():
            for _ in range(args.num_warmups):
                graph.replay()
            torch.cuda.synchronize()
            group.barrier()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(args.decode_replays)]
            for start, end in events:
                start.record()
                graph.replay()
                end.record()
            torch.cuda.synchronize()
            us = np.array([s.elapsed_time(e) * 1e3 for s, e in events])
            result[name] = {'us_median': float(np.median(us)), 'us_mean': float(us.mean()), 'us_min': float(us.min())}
            group.barrier()
        num_recv = int(out[3].psum_num_recv_tokens_per_scaleup_rank[-1].item())
        result['check'] = {
            'dispatch_equals_eager': same_bits(out[0][0][:num_recv], eager[0][0][:num_recv])
            and same_bits(out[0][1][:num_recv], eager[0][1][:num_recv]),
            'combine_equals_eager': same_bits(combined, eager_combined)}
        return result
    finally:
        torch.cuda.synchronize()
        buf.destroy()


def nccl_version():
    """NCCL's version number, or why there is none. `cupy.cuda.nccl` is a submodule, an attribute of `cupy.cuda` only
    once imported: reading `cupy.cuda.nccl.get_version()` before anything imported it logged an AttributeError."""
    try:
        from deepep_cupy.runtime import preflight
        return preflight.nccl().get_version()
    except Exception as e:  # no NCCL library: the refs and a2a paths report it too
        return f'{type(e).__name__}: {e}'


def environment(group):
    import cupy
    import torch

    import deepep_cupy
    from deepep_cupy.jit import compiler
    info = {'python': platform.python_version(), 'torch': torch.__version__, 'torch_cuda': torch.version.cuda,
            'cupy': cupy.__version__, 'cuda_runtime': cupy.cuda.runtime.runtimeGetVersion(),
            'cuda_driver': cupy.cuda.runtime.driverGetVersion(), 'nvrtc': list(compiler.nvrtc_version()),
            'deepep_cupy': deepep_cupy.__version__, 'host': platform.node()}
    info['nccl'] = nccl_version()
    try:
        info['git'] = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=ROOT, capture_output=True, text=True,
                                     timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info['git'] = None
    info['gpus'] = group.allgather_object(f'{torch.cuda.current_device()}: {torch.cuda.get_device_name()}')
    return info


def targets_report(results, decode):
    """Each issue target with the measured value and whether it is met."""
    lines = []
    for c in results:
        if c['num_tokens'] != TARGETS['target_tokens'] or c['num_sms'] > TARGETS['target_max_sms']:
            continue
        for op in ('dispatch', 'combine'):
            o = c['ours'].get(op, {})
            for key, limit, better in (('x_floor', TARGETS['floor_ratio_max'], 'le'),
                                       ('x_floor_all_sms', TARGETS['floor_ratio_max'], 'le'),
                                       ('refs_speedup', TARGETS['refs_speedup_min'], 'ge')):
                v = o.get(key)
                met = v is not None and (v <= limit if better == 'le' else v >= limit)
                lines.append((f"{c['num_tokens']} {c['dtype']} {c['num_sms']} SMs {op} {key}", v, limit, met))
    for op in ('dispatch', 'combine'):
        v = (decode or {}).get(op, {}).get('us_median')
        limit = TARGETS[f'decode_{op}_us_max']
        lines.append((f'decode {op} us', v, limit, v is not None and v <= limit))
    return lines


def plot(data, path: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    cases = data['results']
    sms = sorted({c['num_sms_arg'] for c in cases})
    fig, axes = plt.subplots(len(sms), 2, figsize=(14, 4 * len(sms)), squeeze=False)
    for i, s in enumerate(sms):
        sub = [c for c in cases if c['num_sms_arg'] == s]
        labels = [f"{c['num_tokens']}\n{c['dtype']}" for c in sub]
        for j, op in enumerate(('dispatch', 'combine')):
            ax = axes[i][j]
            for k, p in enumerate(PATHS):
                vals = [c[p][op].get('us', np.nan) for c in sub]
                ax.bar(np.arange(len(sub)) + (k - 1.5) * 0.2, vals, 0.2, label=p)
            ax.set_xticks(np.arange(len(sub)), labels)
            ax.set_yscale('log')
            ax.set_ylabel('µs per call (log)')
            ax.set_title(f"{op}, num_sms={s or 'auto'} ({data['config']['num_ranks']} ranks)")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help line; the description keeps its line breaks."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='perf/ep_bench.py', description=__doc__, formatter_class=HelpFormatter)
    p.add_argument('--out', default=None,
                   help='directory for ep_bench.json and ep_bench.png (default: ep_bench_out; with --plot-from: the '
                        'directory of that JSON)')
    p.add_argument('--tokens', type=ints, default=[128, 512, 4096, 8192], help='tokens per rank, comma separated')
    p.add_argument('--dtypes', default='bf16,fp8', help='dispatch input types, comma separated (bf16, fp8)')
    p.add_argument('--num-sms', type=ints, default=[0, 24],
                   help='SM counts to measure, comma separated (0: the library heuristic)')
    p.add_argument('--hidden', type=int, default=7168, help='hidden size: elements per token')
    p.add_argument('--num-topk', type=int, default=8, help='experts per token (top-k)')
    p.add_argument('--num-experts', type=int, default=256, help='experts in all')
    p.add_argument('--unbalanced-ratio', type=float, default=1.0,
                   help='load of the hottest rank relative to the others (1.0: balanced routing)')
    p.add_argument('--num-warmups', type=int, default=20, help='untimed calls before each measurement')
    p.add_argument('--num-tests', type=int, default=50, help='timed calls per measurement')
    p.add_argument('--decode-tokens', type=int, default=128, help='tokens per rank of the CUDA-graph decode case')
    p.add_argument('--decode-num-sms', type=int, default=0, help='SMs of the decode case (0: the library heuristic)')
    p.add_argument('--decode-replays', type=int, default=200, help='graph replays timed in the decode case')
    p.add_argument('--skip-decode', action='store_true', help='skip the CUDA-graph decode case')
    p.add_argument('--num-gpu-timeout-secs', type=float, default=30, help='bound on every GPU wait of the buffer')
    p.add_argument('--seed', type=int, default=0, help='seed of the inputs')
    p.add_argument('--hybrid', action='store_true',
                   help='hybrid-mode rows instead (several scale-up domains): perf/ep_bench_hybrid.py')
    p.add_argument('--ignore-local-traffic', action='store_true', help="--hybrid: DeepEP's SO / SU without own traffic")
    p.add_argument('--plot-from', metavar='JSON',
                   help='only redraw ep_bench.png from this ep_bench.json (no GPU, no MPI; needs the [perf] extra)')
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot_from:
        with open(args.plot_from) as f:
            data = json.load(f)
        out = args.out or os.path.dirname(args.plot_from) or '.'
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, 'ep_bench.png')
        plot(data, path)
        print(f'[ep_bench] wrote {path}')
        return 0
    args.out = args.out or 'ep_bench_out'
    preflight.check_cuda()

    import torch

    from deepep_cupy import ElasticBuffer
    from deepep_cupy.features.peer_copy import PeerCopy
    from deepep_cupy.runtime.group import get_group
    from deepep_cupy.runtime.nccl import create_nccl_comm
    from deepep_cupy.utils import bench_bytes
    from deepep_cupy.utils.envs import init_dist
    from deepep_cupy.utils.math import per_token_cast_to_fp8
    rank, num_ranks, _ = init_dist(seed=args.seed)
    group = get_group()  # host group: MPI under mpirun, else the torch world init_dist joined
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    dtypes = [d for d in args.dtypes.split(',') if d]
    config = {**{k: v for k, v in vars(args).items() if k != 'plot_from'}, 'dtypes': dtypes, 'num_ranks': num_ranks,
              'targets': TARGETS}
    env = environment(group)
    log(f'[ep_bench] {num_ranks} ranks, GPUs {env["gpus"]}; torch {env["torch"]}, cupy {env["cupy"]}, '
        f'NCCL {env["nccl"]}')

    if args.hybrid:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import ep_bench_hybrid
        helpers = {'collect': collect, 'timed': timed, 'make_inputs': make_inputs}
        return ep_bench_hybrid.run(group, args, env, log, helpers)
    buf = ElasticBuffer(group, num_max_tokens_per_rank=max(args.tokens), hidden=args.hidden, num_topk=args.num_topk,
                        num_gpu_timeout_secs=args.num_gpu_timeout_secs, explicitly_destroy=True)
    floor = PeerCopy.from_buffer(buf)
    comm, err = collect(group, create_nccl_comm, group)
    if err:
        log(f'[ep_bench] NCCL communicator failed ({err}); refs and a2a paths skipped')

    results, baselines = [], []
    log(HEADER)
    for num_tokens in args.tokens:
        x, topk_idx, topk_weights = make_inputs(args, num_tokens, rank, num_ranks)
        rows = group.allgather_object(bench_bytes.tokens_per_rank(topk_idx.cpu(), args.num_experts, num_ranks))
        for dtype in dtypes:
            fp8 = dtype == 'fp8'
            x_in = per_token_cast_to_fp8(x) if fp8 else x
            num_sf = x_in[1].shape[1] if fp8 else 0
            tr = {'dispatch': bench_bytes.traffic(rows, rank, bench_bytes.dispatch_bytes_per_token(
                      args.hidden, 1 if fp8 else 2, num_sf, args.num_topk)),
                  'combine': bench_bytes.traffic(rows, rank, bench_bytes.combine_bytes_per_token(args.hidden),
                                                 reverse=True)}
            per_rank = group.allgather_object({op: (t.logical_bytes, t.cross_bytes) for op, t in tr.items()})
            mean_bytes = {op: tuple(float(np.mean([p[op][i] for p in per_rank])) for i in range(2)) for op in tr}
            base = bench_baselines(group, args, comm, floor, buf, x_in, topk_idx, topk_weights, tr)
            ref = base['refs'].pop('result', None)
            baselines.append({'num_tokens': num_tokens, 'dtype': dtype, **base})
            for num_sms in args.num_sms:
                ours, used_sms = bench_ours(group, args, comm, buf, x_in, topk_idx, topk_weights, num_sms, ref)
                used_sms = used_sms or num_sms or buf.num_device_sms
                case = {'num_tokens': num_tokens, 'dtype': dtype, 'num_sms_arg': num_sms, 'num_sms': used_sms,
                        'bytes_per_rank': per_rank, 'ours': ours, 'refs': base['refs'], 'a2a': base['a2a'],
                        'floor': {op: bench_floor(group, args, floor, buf, t, used_sms) for op, t in tr.items()}}
                summarize(case, base, ours, mean_bytes)
                results.append(case)
                log(row_text(case))
                errors = [f'{p} {op}: {case[p][op]["error"]}' for p in PATHS for op in ('dispatch', 'combine')
                          if 'error' in case[p].get(op, {})]
                for e in errors:
                    log(f'    error: {e}')
            group.barrier()
    log('ratios: /floor = ours / peer-copy floor with the same SMs, /flall = ours / peer-copy floor with every SM; '
        'refs/ and a2a/ = baseline time / ours (speed-up)')
    log('baselines (us, dispatch/combine): tokens dtype | refs | raw NCCL a2a | floor with all SMs')
    for b in baselines:
        log(f"  {b['num_tokens']:6d} {b['dtype']:>4} | " + ' | '.join(
            '/'.join(fmt(b[p][op].get('us'), '.1f') for op in ('dispatch', 'combine'))
            for p in ('refs', 'a2a', 'floor_all_sms')))

    decode = None
    if not args.skip_decode:
        local, err = collect(group, bench_decode, group, args, args.num_gpu_timeout_secs)
        decodes = None if err else group.allgather_object(local)
        decode = {'error': err} if err else {
            **decodes[0], 'per_rank': decodes,
            **{op: {'us_median': max(d[op]['us_median'] for d in decodes)} for op in ('dispatch', 'combine')}}
        if err:
            log(f'[decode] error: {err}')
        else:
            log(f"[decode] {decode['num_tokens']} tokens, {decode['num_sms']} SMs, CUDA graph replays: FP8 dispatch "
                f"{decode['dispatch']['us_median']:.1f} us, BF16 combine {decode['combine']['us_median']:.1f} us "
                f"(median per replay, max over ranks); graph equals eager: "
                f"{all(all(d['check'].values()) for d in decodes)}")

    targets = targets_report(results, decode)
    for name, v, limit, met in targets:
        log(f"[target] {name}: {fmt(v, '.2f')} (limit {limit}) {'MET' if met else 'MISSED'}")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        data = {'config': config, 'environment': env, 'results': results, 'baselines': baselines, 'decode': decode,
                'targets': [dict(zip(('name', 'value', 'limit', 'met'), t)) for t in targets]}
        path = os.path.join(args.out, 'ep_bench.json')
        with open(path, 'w') as f:
            json.dump(data, f, indent=1, default=str)
        log(f'[ep_bench] wrote {path}')
        try:
            plot(data, os.path.join(args.out, 'ep_bench.png'))
            log(f"[ep_bench] wrote {os.path.join(args.out, 'ep_bench.png')}")
        except Exception as e:  # e.g. no matplotlib on the GPU machine: the JSON is enough to redraw
            log(f'[ep_bench] no PNG ({type(e).__name__}: {e}); redraw later where the [perf] extra is installed: '
                f'python perf/ep_bench.py --plot-from {path}')
    group.barrier()
    if comm is not None:
        torch.cuda.synchronize()
        comm.destroy()
    buf.destroy()
    return 0


if __name__ == '__main__':
    sys.exit(preflight.run(main))
