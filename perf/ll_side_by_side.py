"""DeepEP v1.2.1's low-latency kernels beside ours on one GPU: identical inputs, the same timing code, each library
in its own process, outputs compared bit for bit.

    tools/fetch_deepep_src.sh build          # once per GPU machine: DeepEP v1.2.1 into /tmp/deepep_v121
    python3 perf/ll_side_by_side.py [--num-tokens 128 --hidden 7168 --num-topk 8 --num-experts 256] [--out DIR]

The parent writes seeded inputs (CPU, `--seed`) to DIR/inputs.pt, then runs one child per library, one after the
other (`--lib deepep`: PYTHONPATH=--deepep-prefix, so `import deep_ep` is DeepEP's and its `deep_ep_cpp` module;
`--lib ours`: `deepep_cupy.Buffer` from this checkout). Each child is one rank (torch.distributed, world size 1,
`--backend`), builds `Buffer(group, 0, get_low_latency_rdma_size_hint(M, H, 1, E), low_latency_mode=True,
num_qps_per_rank=E)` as DeepEP's tests/test_low_latency.py does, and

- runs the checked calls: dispatch BF16, FP8, FP8 round_scale, FP8 UE8M0, FP8 with the hook; combine (plain and
  with the hook) of `y = bf16(recv_bf16 * expert_scale[e])` on the BF16 dispatch's handle, and combine of
  `bf16(cast_back(recv_fp8) * expert_scale[e])` on the FP8 dispatch's handle; saves the valid rows (DIR/LIB_outputs.pt);
- times, with M = --num-tokens, FP8 dispatch and BF16 combine unless named otherwise:
    graph_*   a CUDA graph of --graph-calls calls (even: both libraries alternate two buffers per call, so a graph
              replayed back to back must hold an even number of calls), µs per call (median of --graph-reps replays);
    kernel_*  torch.profiler kernel time per call (kernels matched by name `dispatch` / `combine`), as DeepEP's
              bench_kineto (a GPU sleep first, so launches queue ahead of the GPU); kernel_all_iter: every kernel
              of one dispatch + combine iteration;
    hook_*    the same with return_recv_hook=True: send and receive kernels (a GPU sleep of --hook-sleep-cycles
              between send and hook(), so the receive finds its data, as DeepEP's test runs a GEMM there);
    host_*    host µs per call (median), the GPU synchronised before each call: dispatch, combine, the hook-mode send
              calls and the hook() calls;
    eager_dispatch_combine  CUDA events around dispatch + combine, L2 flushed before each (DeepEP's `bench`).

The parent prints `metric | DeepEP | ours | ratio` (ratio = ours / DeepEP: below 1 is ours faster), the checks, and
writes DIR/ll_side_by_side.json. What is compared, per checked call:
- dispatch: recv_count and cumulative stats exactly; each expert's valid rows as a set keyed by (source rank, source
  token) from layout_range / src_info (DeepEP orders an expert's rows by atomic arrival, ours by token), each key's
  row (FP8 bytes / BF16 bits) and scales (float32 / packed UE8M0 bits) exactly; layout_range's per-rank counts;
- combine: combined_x [num_tokens, hidden] bit for bit (its value does not depend on the row order: each (token,
  expert) input row is a function of the token and the expert only).
With an FP8 or combine mismatch, the parent also says which arithmetic each library follows (recipe lines): FP8
scales `amax * (1/448)` (DeepEP v1.2.1's kernel) or `amax / 448` (DeepEP V2's torch recipe), combine with fused
multiply-adds or `acc + w * row` rounded twice. Exit status: 0 when both children ran and every check passed (with
--allow-mismatch: when both ran).
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBS = ('deepep', 'ours')
LIB_TITLES = {'deepep': 'DeepEP', 'ours': 'ours'}
INT_MASK = (1 << 32) - 1

# (key, label): the table's rows, in order.
METRICS = (
    ('graph_dispatch_fp8', 'graph: dispatch FP8 (us/call)'),
    ('graph_dispatch_bf16', 'graph: dispatch BF16 (us/call)'),
    ('graph_combine', 'graph: combine (us/call)'),
    ('graph_dispatch_combine', 'graph: dispatch FP8 + combine (us/iter)'),
    ('graph_dispatch_combine_hook', 'graph: the same with hooks (us/iter)'),
    ('kernel_dispatch_fp8', 'kernel: dispatch FP8 (us)'),
    ('kernel_dispatch_bf16', 'kernel: dispatch BF16 (us)'),
    ('kernel_combine', 'kernel: combine (us)'),
    ('kernel_all_iter', 'kernel: all kernels of dispatch + combine (us)'),
    ('hook_dispatch_send', 'hook kernel: dispatch send (us)'),
    ('hook_dispatch_recv', 'hook kernel: dispatch recv (us)'),
    ('hook_combine_send', 'hook kernel: combine send (us)'),
    ('hook_combine_recv', 'hook kernel: combine recv (us)'),
    ('host_dispatch_fp8', 'host: dispatch FP8 (us)'),
    ('host_dispatch_bf16', 'host: dispatch BF16 (us)'),
    ('host_combine', 'host: combine (us)'),
    ('host_dispatch_send', 'host: dispatch send, hook mode (us)'),
    ('host_dispatch_hook', 'host: dispatch hook() (us)'),
    ('host_combine_send', 'host: combine send, hook mode (us)'),
    ('host_combine_hook', 'host: combine hook() (us)'),
    ('eager_dispatch_combine', 'eager: dispatch FP8 + combine, events (us)'),
)

# Checked dispatch calls: name -> (use_fp8, round_scale, use_ue8m0, return_recv_hook).
DISPATCH_CASES = {
    'dispatch_bf16': (False, False, False, False),
    'dispatch_fp8': (True, False, False, False),
    'dispatch_fp8_round': (True, True, False, False),
    'dispatch_fp8_ue8m0': (True, True, True, False),
    'dispatch_fp8_hook': (True, False, False, True),
}
COMBINE_CASES = ('combine_bf16', 'combine_bf16_hook', 'combine_fp8')


# ---------------------------------------------------------------------------------------------------------------------
# Arguments

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--num-tokens', type=int, default=128, help='tokens (= num_max_dispatch_tokens_per_rank)')
    p.add_argument('--hidden', type=int, default=7168, help='hidden size (DeepEP: 2048, 2560, 4096, 5120, 6144, '
                                                            '7168 or 8192)')
    p.add_argument('--num-topk', type=int, default=8, help='top-k')
    p.add_argument('--num-experts', type=int, default=256, help='experts')
    p.add_argument('--num-masked', type=int, default=10, help='top-k entries set to -1 (as DeepEP\'s test)')
    p.add_argument('--seed', type=int, default=0, help='input seed')
    p.add_argument('--graph-calls', type=int, default=10, help='calls per CUDA graph (even)')
    p.add_argument('--graph-reps', type=int, default=50, help='timed replays per graph')
    p.add_argument('--prof-iters', type=int, default=30, help='iterations in the profiled round')
    p.add_argument('--host-iters', type=int, default=100, help='calls per host-time figure')
    p.add_argument('--hook-sleep-cycles', type=int, default=100000, help='GPU sleep between a send and its hook()')
    p.add_argument('--libs', default='deepep,ours', help='libraries to run, in this order (deepep, ours)')
    p.add_argument('--deepep-prefix', default=os.environ.get('DEEPEP_V121_PREFIX', '/tmp/deepep_v121'),
                   help='where tools/fetch_deepep_src.sh build put DeepEP v1.2.1')
    p.add_argument('--backend', default='gloo', choices=('gloo', 'nccl'), help='torch.distributed backend')
    p.add_argument('--child-timeout', type=int, default=400, help='seconds per library process')
    p.add_argument('--allow-mismatch', action='store_true', help='exit 0 even when a bitwise check fails')
    p.add_argument('--out', default=os.path.join(ROOT, 'out', 'll_side_by_side'), help='directory for the files')
    # A child's own arguments (set by the parent).
    p.add_argument('--lib', choices=LIBS, help=argparse.SUPPRESS)
    p.add_argument('--port', type=int, default=0, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    for name in ('num_tokens', 'hidden', 'num_topk', 'num_experts', 'graph_calls', 'graph_reps', 'prof_iters',
                 'host_iters'):
        if getattr(args, name) < 1:
            p.error(f'--{name.replace("_", "-")} must be positive, got {getattr(args, name)}')
    if args.graph_calls % 2:
        p.error(f'--graph-calls must be even (both libraries alternate two buffers), got {args.graph_calls}')
    if args.hidden % 512:
        p.error(f'--hidden must be a multiple of 512 (UE8M0 scales pack 4 groups of 128), got {args.hidden}')
    if args.num_topk > args.num_experts:
        p.error(f'--num-topk {args.num_topk} exceeds --num-experts {args.num_experts}')
    if args.num_masked < 0 or args.num_masked > args.num_tokens * args.num_topk:
        p.error(f'--num-masked must be in [0, num_tokens * num_topk], got {args.num_masked}')
    libs = tuple(s.strip() for s in args.libs.split(',') if s.strip())
    bad = [s for s in libs if s not in LIBS]
    if bad or not libs or len(set(libs)) != len(libs):
        p.error(f'--libs must name some of {", ".join(LIBS)} once each, got {args.libs!r}')
    args.libs = libs
    return args


# ---------------------------------------------------------------------------------------------------------------------
# Pure helpers: inputs, packing, comparison, table

def make_inputs(num_tokens: int, hidden: int, num_topk: int, num_experts: int, num_masked: int, seed: int) -> dict:
    """Seeded CPU inputs: x `[N, H]` bfloat16 (randn * 0.1, DeepEP's perf case), topk_idx `[N, K]` int64 (distinct
    experts, top-k of random scores, `num_masked` random entries -1), topk_weights `[N, K]` float32 (|randn|),
    expert_scale `[E]` float32 (1 + e / E: makes the combine inputs differ per expert)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((num_tokens, hidden), generator=g) * 0.1).to(torch.bfloat16)
    scores = torch.randn((num_tokens, num_experts), generator=g).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=True)[1].to(torch.int64)
    flat = torch.randperm(num_tokens * num_topk, generator=g)[:num_masked]
    topk_idx.view(-1)[flat] = -1
    topk_weights = torch.randn((num_tokens, num_topk), generator=g).abs().float()
    expert_scale = 1 + torch.arange(num_experts, dtype=torch.float32) / num_experts
    return {'x': x, 'topk_idx': topk_idx, 'topk_weights': topk_weights, 'expert_scale': expert_scale, 'seed': seed}


def as_bits(t):
    """The bit pattern of `t` as an integer tensor of the same width (NaN and -0 compare by bits)."""
    import torch
    widths = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool):
        return t
    return t.contiguous().view(widths[t.element_size()])


def pack_dispatch(recv_x, recv_scales, recv_count, src_info, layout_range, stats=None) -> dict:
    """The valid rows of one low-latency dispatch, on the CPU, with their keys.

    Args:
        recv_x: `[L, T, H]` float8_e4m3fn or bfloat16; recv_scales: `[L, T, G]` (any strides) or None.
        recv_count: `[L]` int32; src_info: `[L, T]` int32 (source token); layout_range: `[L, R]` int64
            (`begin << 32 | count` of each source rank's rows).
        stats: `[L]` int32 cumulative_local_expert_recv_stats, or None.

    Returns:
        dict: counts `[L]`, layout_counts `[L, R]`, expert `[S]`, key `[S]` int64 (`rank << 32 | token`), rows
        `[S, H]` bits, scales `[S, G]` bits (or None), stats; S = sum(counts), rows in the library's order.
    """
    import torch
    counts = recv_count.detach().to('cpu', torch.int64)
    lr = layout_range.detach().to('cpu', torch.int64)
    L, R = lr.shape
    rank_of = torch.full(src_info.shape, -1, dtype=torch.int64)
    for r in range(R):
        begin, count = lr[:, r] >> 32, lr[:, r] & INT_MASK
        for e in range(L):
            b, c = int(begin[e]), int(count[e])
            rank_of[e, b:b + c] = r
    src = src_info.detach().to('cpu', torch.int64)
    rows, scales, experts, keys = [], [], [], []
    for e in range(L):
        c = int(counts[e])
        if c == 0:
            continue
        rows.append(as_bits(recv_x[e, :c]).cpu())
        if recv_scales is not None:
            scales.append(as_bits(recv_scales[e, :c].contiguous()).cpu())
        experts.append(torch.full((c,), e, dtype=torch.int64))
        keys.append((rank_of[e, :c] << 32) | src[e, :c])
    H = recv_x.shape[-1]
    cat = (lambda xs, shape, dtype: torch.cat(xs) if xs else torch.empty(shape, dtype=dtype))
    return {
        'counts': counts, 'layout_counts': lr & INT_MASK,
        'expert': cat(experts, (0,), torch.int64), 'key': cat(keys, (0,), torch.int64),
        'rows': cat(rows, (0, H), as_bits(recv_x[:0, :0]).dtype),
        'scales': None if recv_scales is None else cat(scales, (0, recv_scales.shape[-1]), torch.int32),
        'stats': None if stats is None else stats.detach().to('cpu', torch.int64),
    }


def _sorted(packed: dict):
    """Rows of `packed` sorted by (expert, key)."""
    import torch
    order = torch.argsort(packed['expert'] * (1 << 40) + packed['key'], stable=True)
    return (packed['expert'][order], packed['key'][order], packed['rows'][order],
            None if packed['scales'] is None else packed['scales'][order])


def _first_diff(a, b) -> Tuple[int, ...]:
    import torch
    idx = torch.nonzero(a != b)
    return tuple(int(i) for i in idx[0])


def compare_dispatch(name: str, ref: dict, got: dict) -> dict:
    """Compare two `pack_dispatch` results (`ref` DeepEP's, `got` ours) bit for bit, row sets keyed by
    (expert, source rank, source token). Returns {'name', 'ok', 'detail', 'num_rows', 'num_diff'}."""
    import torch

    def result(ok: bool, detail: str, num_diff: int = 0) -> dict:
        return {'name': name, 'ok': ok, 'detail': detail, 'num_rows': int(ref['key'].numel()), 'num_diff': num_diff}

    if not torch.equal(ref['counts'], got['counts']):
        e = _first_diff(ref['counts'], got['counts'])[0]
        return result(False, f'recv_count differs: expert {e}: DeepEP {int(ref["counts"][e])}, '
                             f'ours {int(got["counts"][e])}')
    if (ref['stats'] is None) != (got['stats'] is None) or (
            ref['stats'] is not None and not torch.equal(ref['stats'], got['stats'])):
        return result(False, 'cumulative_local_expert_recv_stats differs')
    if not torch.equal(ref['layout_counts'], got['layout_counts']):
        e, r = _first_diff(ref['layout_counts'], got['layout_counts'])
        return result(False, f'layout_range counts differ: expert {e}, rank {r}: DeepEP '
                             f'{int(ref["layout_counts"][e, r])}, ours {int(got["layout_counts"][e, r])}')
    e_a, k_a, rows_a, sf_a = _sorted(ref)
    e_b, k_b, rows_b, sf_b = _sorted(got)
    if not (torch.equal(e_a, e_b) and torch.equal(k_a, k_b)):
        i = _first_diff(torch.stack([e_a, k_a]), torch.stack([e_b, k_b]))[1]
        return result(False, f'row sets differ: sorted row {i}: DeepEP (expert {int(e_a[i])}, rank '
                             f'{int(k_a[i]) >> 32}, token {int(k_a[i]) & INT_MASK}), ours (expert {int(e_b[i])}, '
                             f'rank {int(k_b[i]) >> 32}, token {int(k_b[i]) & INT_MASK})')
    for what, a, b in (('rows', rows_a, rows_b), ('scales', sf_a, sf_b)):
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            return result(False, f'{what}: shapes/dtypes differ ({None if a is None else (tuple(a.shape), a.dtype)} '
                                 f'vs {None if b is None else (tuple(b.shape), b.dtype)})')
        if not torch.equal(a, b):
            n = int((a != b).sum())
            i, c = _first_diff(a, b)
            return result(False, f'{what} differ in {n} of {a.numel()} elements; first: expert {int(e_a[i])}, '
                                 f'token {int(k_a[i]) & INT_MASK} (rank {int(k_a[i]) >> 32}), column {c}: DeepEP '
                                 f'bits {int(a[i, c]):#x}, ours {int(b[i, c]):#x}', n)
    return result(True, f'{int(ref["key"].numel())} rows identical')


def compare_exact(name: str, ref, got) -> dict:
    """`ref` (DeepEP) and `got` (ours) `[N, H]` tensors bit for bit. Returns the same dict as `compare_dispatch`."""
    import torch
    a, b = as_bits(ref.cpu()), as_bits(got.cpu())
    out = {'name': name, 'num_rows': int(a.shape[0]) if a.dim() else 1, 'num_diff': 0}
    if a.shape != b.shape or a.dtype != b.dtype:
        return {**out, 'ok': False, 'detail': f'shapes/dtypes differ: {tuple(a.shape)} {a.dtype} vs '
                                              f'{tuple(b.shape)} {b.dtype}'}
    if torch.equal(a, b):
        return {**out, 'ok': True, 'detail': f'{a.numel()} elements identical'}
    n = int((a != b).sum())
    idx = _first_diff(a, b)
    fa, fb = ref.cpu().float(), got.cpu().float()
    return {**out, 'ok': False, 'num_diff': n,
            'detail': f'{n} of {a.numel()} elements differ (max |diff| {float((fa - fb).abs().max()):.3g}); first at '
                      f'{list(idx)}: DeepEP {float(fa[idx]):.8g} ({int(a[idx]):#x}), ours {float(fb[idx]):.8g} '
                      f'({int(b[idx]):#x})'}


def compare_outputs(ref: dict, got: dict) -> List[dict]:
    """Every check of two children's saved outputs (`ref` DeepEP's, `got` ours)."""
    checks = []
    for name in DISPATCH_CASES:
        if name in ref and name in got:
            checks.append(compare_dispatch(name, ref[name], got[name]))
    for name in COMBINE_CASES:
        if name in ref and name in got:
            checks.append(compare_exact(name, ref[name], got[name]))
    missing = sorted((set(DISPATCH_CASES) | set(COMBINE_CASES)) - (set(ref) & set(got)))
    for name in missing:
        checks.append({'name': name, 'ok': False, 'num_rows': 0, 'num_diff': 0,
                       'detail': 'missing from ' + ' and '.join(t for t, d in (('DeepEP', ref), ('ours', got))
                                                                 if name not in d)})
    return checks


def fp8_scale_recipes(x, round_scale: bool) -> Dict[str, object]:
    """Per-token, per-128-channel FP8 scales of `x` `[N, H]` bfloat16 by the two recipes: 'v1_kernel' (DeepEP
    v1.2.1: `amax * float(1/448)`, round_scale `2^ceil(log2(amax * float(1/448)))`) and 'v2_torch' (DeepEP V2's
    utils/math.py: `amax / 448`, round_scale via the exponent of `amax / 448`). float32 `[N, H/128]`."""
    import torch
    n, h = x.shape
    amax = x.reshape(n, h // 128, 128).abs().float().amax(dim=2).clamp(min=1e-4)
    inv448 = torch.tensor(1 / 448, dtype=torch.float32)
    out = {'v1_kernel': amax * inv448, 'v2_torch': amax / 448}
    if round_scale:
        for k, v in out.items():
            bits = v.view(torch.int32)
            exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
            out[k] = (exponent << 23).view(torch.float32)
    return out


def scale_recipe_match(packed: dict, x, round_scale: bool) -> Dict[str, float]:
    """Fraction of the received float32 scales of `packed` (one dispatch's `pack_dispatch`) equal, bit for bit, to
    each recipe of `fp8_scale_recipes` on the source rows (one rank: the key's token indexes `x`)."""
    recipes = fp8_scale_recipes(x, round_scale)
    tokens = packed['key'] & INT_MASK
    got = packed['scales']
    return {k: float((as_bits(v[tokens]) == got).float().mean()) if got.numel() else 1.0 for k, v in recipes.items()}


def combine_references(x, topk_idx, topk_weights, expert_scale) -> Dict[str, object]:
    """The BF16 combine's result for the inputs (one rank; row of (t, k) = bf16(x[t] * expert_scale[e])), by the
    two arithmetics: 'fma' (`acc = fma(w, row, acc)`, emulated in float64: exact product, one rounding of the sum;
    a double rounding makes it differ from a true FMA in rare ties) and 'mul_add' (`acc + w * row`, two roundings)."""
    import torch
    n, h = x.shape
    acc_fma = torch.zeros((n, h), dtype=torch.float32)
    acc_two = torch.zeros((n, h), dtype=torch.float32)
    for k in range(topk_idx.shape[1]):
        e = topk_idx[:, k]
        valid = (e >= 0).view(-1, 1)
        row = (x.float() * expert_scale[e.clamp(min=0)].view(-1, 1)).to(torch.bfloat16).float()
        w = topk_weights[:, k].view(-1, 1)
        fma = (acc_fma.double() + w.double() * row.double()).float()
        two = acc_two + w * row
        acc_fma = torch.where(valid, fma, acc_fma)
        acc_two = torch.where(valid, two, acc_two)
    return {'fma': acc_fma.to(torch.bfloat16), 'mul_add': acc_two.to(torch.bfloat16)}


def ratio(deepep: Optional[float], ours: Optional[float]) -> Optional[float]:
    """ours / DeepEP (time: below 1 is ours faster), or None when either is missing or DeepEP's is not positive."""
    if deepep is None or ours is None or deepep <= 0:
        return None
    return ours / deepep


def format_table(timings: Dict[str, Dict[str, Optional[float]]]) -> str:
    """`metric | DeepEP | ours | ratio` over `METRICS` (timings: lib -> key -> µs; missing values print n/a)."""
    def num(v: Optional[float], fmt: str) -> str:
        return 'n/a' if v is None else format(v, fmt)

    rows = [('metric', 'DeepEP', 'ours', 'ratio')]
    for key, label in METRICS:
        d, o = timings.get('deepep', {}).get(key), timings.get('ours', {}).get(key)
        rows.append((label, num(d, '.2f'), num(o, '.2f'), num(ratio(d, o), '.3f')))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for j, r in enumerate(rows):
        lines.append(' | '.join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if j == 0:
            lines.append('-|-'.join('-' * w for w in widths))
    return '\n'.join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Child: one library, one rank

def _log(lib: str, msg: str) -> None:
    print(f'[{lib}] {msg}', flush=True)


def _import_buffer(lib: str, prefix: str):
    if lib == 'deepep':
        import deep_ep
        import deep_ep_cpp  # noqa: F401 (DeepEP's C++ module: this is DeepEP, not an alias)
        where = os.path.dirname(os.path.abspath(deep_ep.__file__))
        if os.path.realpath(where) != os.path.realpath(os.path.join(prefix, 'deep_ep')):
            raise RuntimeError(f'deep_ep comes from {where}, not {prefix}/deep_ep '
                               f'(PYTHONPATH={os.environ.get("PYTHONPATH")})')
        return deep_ep.Buffer, f'DeepEP {where}'
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import deepep_cupy
    return deepep_cupy.Buffer, f'deepep_cupy {getattr(deepep_cupy, "__version__", "?")} {deepep_cupy.__file__}'


def _kernel_regex(name: str):
    """Matches a profiled kernel's name: `void ns::NAME<...>(...)`, `NAME(...)`, `NAME` or a mangled `...8NAMEI...`."""
    return re.compile(rf'(?:^|[\s:]){name}\s*(?:[<(]|$)|{len(name)}{name}[IEv]')


def kernel_times(events: list, num_iters: int, names: Sequence[str], period: int = 1,
                 exclude: Sequence[str] = ()) -> Tuple[Dict[str, Optional[List[float]]], Dict[str, float]]:
    """Per-iteration kernel µs from Chrome-trace events of `num_iters` iterations.

    Returns:
        (per name: `period` phase times, the name's launches sorted by start split round-robin, or None when the
        launch count is not a multiple of num_iters * period; every kernel name (not matching `exclude`) -> µs per
        iteration, with key '*' their sum).
    """
    kernels = [e for e in events if e.get('cat') == 'kernel' and 'dur' in e]
    out = {}
    for name in names:
        rx = _kernel_regex(name)
        durs = [e['dur'] for e in sorted((e for e in kernels if rx.search(e['name'])), key=lambda e: e['ts'])]
        if not durs or len(durs) % (num_iters * period):
            out[name] = None
        else:
            out[name] = [sum(durs[j::period]) / num_iters for j in range(period)]
    table: Dict[str, float] = {}
    for e in kernels:
        if any(x in e['name'] for x in exclude):
            continue
        table[e['name']] = table.get(e['name'], 0.0) + e['dur'] / num_iters
    table['*'] = sum(table.values())
    return out, table


def child_main(args: argparse.Namespace) -> int:
    import tempfile

    import torch
    import torch.distributed as dist

    lib = args.lib
    Buffer, where = _import_buffer(lib, args.deepep_prefix)
    torch.cuda.set_device(0)
    dist.init_process_group(args.backend, init_method=f'tcp://127.0.0.1:{args.port}', world_size=1, rank=0)
    group = dist.new_group([0])
    inp = torch.load(os.path.join(args.out, 'inputs.pt'))
    x = inp['x'].cuda()
    topk_idx, topk_weights = inp['topk_idx'].cuda(), inp['topk_weights'].cuda()
    M, H = x.shape
    E, R = args.num_experts, 1
    L = E // R
    expert_scale = inp['expert_scale'].cuda()[:L]
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    buf = Buffer(group, num_nvl_bytes=0, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                 num_qps_per_rank=E // R, explicitly_destroy=True)
    _log(lib, f'{where} | {torch.cuda.get_device_name()} | num_rdma_bytes {num_rdma_bytes / 1e6:.1f} MB')

    def dispatch(use_fp8=True, round_scale=False, use_ue8m0=False, hook=False, stats=None):
        recv, count, handle, event, h = buf.low_latency_dispatch(
            x, topk_idx, M, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, async_finish=False, return_recv_hook=hook)
        return recv, count, handle, h

    def combine(y, handle, hook=False):
        out, event, h = buf.low_latency_combine(y, topk_idx, topk_weights, handle, async_finish=False,
                                                return_recv_hook=hook)
        return out, h

    # -- the checked calls --
    saved = {}
    y = None
    for name, (use_fp8, round_scale, use_ue8m0, hook) in DISPATCH_CASES.items():
        stats = torch.zeros((L,), dtype=torch.int32, device='cuda')
        recv, count, handle, h = dispatch(use_fp8, round_scale, use_ue8m0, hook, stats)
        if h is not None:
            h()
        torch.cuda.synchronize()
        rx, sf = recv if use_fp8 else (recv, None)
        saved[name] = pack_dispatch(rx, sf, count, handle[0], handle[1], stats)
        if name == 'dispatch_bf16':
            y = (recv.float() * expert_scale.view(-1, 1, 1)).to(torch.bfloat16)
            saved['combine_bf16'] = combine(y, handle)[0].clone().cpu()
            out, h = combine(y, handle, hook=True)
            h()
            saved['combine_bf16_hook'] = out.clone().cpu()
        elif name == 'dispatch_fp8':
            back = (rx.float().view(L, -1, H // 128, 128) * sf.float().unsqueeze(-1)).view(L, -1, H)
            y8 = (back * expert_scale.view(-1, 1, 1)).to(torch.bfloat16)
            del back
            saved['combine_fp8'] = combine(y8, handle)[0].clone().cpu()
            del y8
        torch.cuda.synchronize()
    torch.save(saved, os.path.join(args.out, f'{lib}_outputs.pt'))
    _log(lib, 'checked calls done, outputs saved')

    # -- timings --
    res: Dict[str, Optional[float]] = {}
    sleep = torch.cuda._sleep
    cur = torch.cuda.current_stream

    def step(hook: bool):
        recv, count, handle, h = dispatch(True, hook=hook)
        if hook:
            h()
        out, h = combine(y, handle, hook=hook)
        if hook:
            h()

    _, _, fixed_handle, _ = dispatch(False)

    def graph_us(fn, n_calls: int) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(cur())
        with torch.cuda.stream(side):
            for _ in range(n_calls):
                fn()
        cur().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n_calls):
                fn()
        torch.cuda.synchronize()
        for _ in range(3):
            g.replay()
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(args.graph_reps)]
        for s, e in evs:
            s.record()
            g.replay()
            e.record()
        torch.cuda.synchronize()
        t = statistics.median(s.elapsed_time(e) for s, e in evs) * 1e3 / n_calls
        del g
        torch.cuda.empty_cache()
        return t

    n = args.graph_calls
    graphs = {
        'graph_dispatch_fp8': (lambda: dispatch(True), n),
        'graph_dispatch_bf16': (lambda: dispatch(False), n),
        'graph_combine': (lambda: combine(y, fixed_handle), n),
        'graph_dispatch_combine': (lambda: step(False), n // 2),
        'graph_dispatch_combine_hook': (lambda: step(True), n // 2),
    }
    for key, (fn, calls) in graphs.items():
        try:
            res[key] = graph_us(fn, calls)
        except Exception as e:      # a graph that cannot be captured is a finding, not the end of the run
            res[key] = None
            _log(lib, f'{key}: {type(e).__name__}: {e}')
            torch.cuda.synchronize()
    _log(lib, 'graphs done')

    def profile(fn, iters: int) -> list:
        fn()
        torch.cuda.synchronize()
        schedule = torch.profiler.schedule(wait=1, warmup=0, active=1, repeat=1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], schedule=schedule) as prof:
            for _ in range(2):
                sleep(20_000_000)   # ~10 ms: the launches below queue up behind it
                for _ in range(iters):
                    fn()
                torch.cuda.synchronize()
                prof.step()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, 'trace.json')
            prof.export_chrome_trace(path)
            with open(path) as f:
                return json.load(f)['traceEvents']

    it = args.prof_iters
    spin = ('sleep', 'spin')
    k, table = kernel_times(profile(lambda: step(False), it), it, ('dispatch', 'combine'), exclude=spin)
    res['kernel_dispatch_fp8'] = k['dispatch'] and k['dispatch'][0]
    res['kernel_combine'] = k['combine'] and k['combine'][0]
    res['kernel_all_iter'] = table['*']
    kernels = {'dispatch_fp8_combine': table}
    k, table = kernel_times(profile(lambda: dispatch(False), it), it, ('dispatch',), exclude=spin)
    res['kernel_dispatch_bf16'] = k['dispatch'] and k['dispatch'][0]
    kernels['dispatch_bf16'] = table

    def hooked():
        recv, count, handle, h = dispatch(True, hook=True)
        sleep(args.hook_sleep_cycles)
        h()
        out, h = combine(y, handle, hook=True)
        sleep(args.hook_sleep_cycles)
        h()

    k, table = kernel_times(profile(hooked, it), it, ('dispatch', 'combine'), period=2, exclude=spin)
    for name in ('dispatch', 'combine'):
        send_recv = k[name] or [None, None]
        res[f'hook_{name}_send'], res[f'hook_{name}_recv'] = send_recv
    kernels['hooks'] = table
    _log(lib, 'profiles done')

    def host_us(fns: Sequence) -> List[float]:
        """Median host µs of each callable of a chain `fns` (each takes the previous one's result), GPU idle."""
        times = [[] for _ in fns]
        for i in range(args.host_iters + 5):
            torch.cuda.synchronize()
            value = None
            for j, fn in enumerate(fns):
                t0 = time.perf_counter()
                value = fn(value)
                if i >= 5:
                    times[j].append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        return [statistics.median(t) for t in times]

    res['host_dispatch_fp8'], res['host_combine'] = host_us(
        [lambda _: dispatch(True), lambda d: combine(y, d[2])])
    res['host_dispatch_bf16'], = host_us([lambda _: dispatch(False)])
    res['host_dispatch_send'], res['host_dispatch_hook'], res['host_combine_send'], res['host_combine_hook'] = host_us(
        [lambda _: dispatch(True, hook=True), lambda d: (d[3](), d)[1], lambda d: combine(y, d[2], hook=True),
         lambda c: c[1]()])

    cache = torch.empty(int(256e6 // 4), dtype=torch.int32, device='cuda')
    evs = []
    for _ in range(args.host_iters):
        cache.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step(False)
        e.record()
        evs.append((s, e))
    torch.cuda.synchronize()
    res['eager_dispatch_combine'] = statistics.mean(s.elapsed_time(e) for s, e in evs[1:]) * 1e3
    _log(lib, 'host times done')

    info = {'lib': lib, 'where': where, 'device': torch.cuda.get_device_name(), 'torch': torch.__version__,
            'num_rdma_bytes': num_rdma_bytes, 'timings_us': res, 'kernels_us_per_iter': kernels}
    with open(os.path.join(args.out, f'{lib}_timings.json'), 'w') as f:
        json.dump(info, f, indent=1)
    torch.cuda.synchronize()
    buf.destroy()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# Parent

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def child_env(lib: str, prefix: str, base: Optional[dict] = None) -> dict:
    """The environment of a child: DeepEP's prefix first on PYTHONPATH for `deepep`, this checkout for `ours`; the
    `deep_ep` bootstrap of deepep_cupy.as_deep_ep removed either way (it would shadow DeepEP)."""
    env = dict(os.environ if base is None else base)
    keep = [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p and '_deep_ep_bootstrap' not in p]
    first = prefix if lib == 'deepep' else ROOT
    env['PYTHONPATH'] = os.pathsep.join([first, *[p for p in keep if p != first]])
    env.setdefault('PYTHONUNBUFFERED', '1')
    return env


def child_command(args: argparse.Namespace, lib: str, port: int) -> List[str]:
    cmd = [sys.executable, os.path.abspath(__file__), '--lib', lib, '--port', str(port), '--out', args.out]
    for name in ('num_tokens', 'hidden', 'num_topk', 'num_experts', 'num_masked', 'seed', 'graph_calls', 'graph_reps',
                 'prof_iters', 'host_iters', 'hook_sleep_cycles', 'deepep_prefix', 'backend'):
        cmd += [f'--{name.replace("_", "-")}', str(getattr(args, name))]
    return cmd


def parent_main(args: argparse.Namespace) -> int:
    import torch
    os.makedirs(args.out, exist_ok=True)
    inp = make_inputs(args.num_tokens, args.hidden, args.num_topk, args.num_experts, args.num_masked, args.seed)
    torch.save(inp, os.path.join(args.out, 'inputs.pt'))
    print(f'== low-latency side by side: 1 rank, {args.num_tokens} tokens, hidden {args.hidden}, top-{args.num_topk}, '
          f'{args.num_experts} experts, seed {args.seed}; libraries {", ".join(args.libs)} ==', flush=True)
    if 'deepep' in args.libs and not os.path.isdir(os.path.join(args.deepep_prefix, 'deep_ep')):
        print(f'DeepEP v1.2.1 is not built in {args.deepep_prefix}: run tools/fetch_deepep_src.sh build', flush=True)
    status, infos, outputs = {}, {}, {}
    for lib in args.libs:
        for f in (f'{lib}_timings.json', f'{lib}_outputs.pt'):
            if os.path.exists(os.path.join(args.out, f)):
                os.remove(os.path.join(args.out, f))
        t0 = time.time()
        try:
            rc = subprocess.run(child_command(args, lib, _free_port()), env=child_env(lib, args.deepep_prefix),
                                timeout=args.child_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 'timeout'
        status[lib] = {'rc': rc, 'wall_s': round(time.time() - t0, 1)}
        print(f'[{lib}] exit {rc} after {status[lib]["wall_s"]} s', flush=True)
        tj, to = os.path.join(args.out, f'{lib}_timings.json'), os.path.join(args.out, f'{lib}_outputs.pt')
        if os.path.exists(tj):
            with open(tj) as f:
                infos[lib] = json.load(f)
        if os.path.exists(to):
            outputs[lib] = torch.load(to)

    timings = {lib: info['timings_us'] for lib, info in infos.items()}
    print('\nratio = ours / DeepEP (time: below 1 is ours faster); us per call unless noted; devices: ' +
          ', '.join(f'{LIB_TITLES[k]} {v["device"]}' for k, v in infos.items()))
    print(format_table(timings), flush=True)

    checks, recipes = [], {}
    if 'deepep' in outputs and 'ours' in outputs:
        checks = compare_outputs(outputs['deepep'], outputs['ours'])
        print()
        for c in checks:
            print(f'[check] {c["name"]}: {"PASS" if c["ok"] else "FAIL"}: {c["detail"]}', flush=True)
        if not all(c['ok'] for c in checks):
            recipes = explain_recipes(inp, outputs)
            for line in recipes.get('lines', []):
                print(f'[recipe] {line}', flush=True)
    else:
        print('\n[check] skipped: outputs of both libraries are needed', flush=True)

    result = {'config': {k: v for k, v in vars(args).items() if k not in ('lib', 'port')}, 'status': status,
              'libs': infos, 'ratios': {k: ratio(timings.get('deepep', {}).get(k), timings.get('ours', {}).get(k))
                                        for k, _ in METRICS},
              'checks': checks, 'recipes': recipes}
    result['config']['libs'] = list(args.libs)
    path = os.path.join(args.out, 'll_side_by_side.json')
    with open(path, 'w') as f:
        json.dump(result, f, indent=1)
    print(f'\nwrote {path}', flush=True)
    ran = all(status[lib]['rc'] == 0 for lib in args.libs)
    checked = bool(checks) and all(c['ok'] for c in checks)
    return 0 if ran and (checked or args.allow_mismatch or len(args.libs) < 2) else 1


def explain_recipes(inp: dict, outputs: Dict[str, dict]) -> dict:
    """Which FP8 scale recipe and which combine arithmetic each library's outputs follow (fractions of equal bits)."""
    lines, data = [], {}
    for case, round_scale in (('dispatch_fp8', False), ('dispatch_fp8_round', True)):
        for lib, out in outputs.items():
            if case in out and out[case]['scales'] is not None:
                m = scale_recipe_match(out[case], inp['x'], round_scale)
                data[f'{case}/{lib}'] = m
                lines.append(f'{case} scales of {LIB_TITLES[lib]}: ' +
                             ', '.join(f'{k} {v * 100:.2f}%' for k, v in m.items()) + ' equal')
    refs = combine_references(inp['x'], inp['topk_idx'], inp['topk_weights'], inp['expert_scale'])
    for lib, out in outputs.items():
        if 'combine_bf16' in out:
            got = as_bits(out['combine_bf16'])
            m = {k: float((as_bits(v) == got).float().mean()) for k, v in refs.items()}
            data[f'combine_bf16/{lib}'] = m
            lines.append(f'combine_bf16 of {LIB_TITLES[lib]}: ' +
                         ', '.join(f'{k} reference {v * 100:.2f}%' for k, v in m.items()) + ' equal')
    return {'lines': lines, 'match': data}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return child_main(args) if args.lib else parent_main(args)


if __name__ == '__main__':
    sys.exit(main())
