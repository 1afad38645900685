"""DeepEP V1 `Buffer` across scale-up domains (DeepEP's internode normal mode), one rank per process: every output
bit for bit against host references built from host-gathered inputs (`v1/kernels/internode_reference.py`
`reference_internode` for V1's 10-element handle, `legacy_reference.dispatch` for the rows, a two-level host
reduction for combine). Domains from the topology (`DEEPEP_CUPY_SCALEUP_SIZE` on one GPU), e.g.

    DEEPEP_CUPY_SCALEUP_SIZE=2 DEEPEP_CUPY_RAIL_TRANSPORT=loopback CUDA_VISIBLE_DEVICES=0 \\
        launch/run_local.sh 4 python3 -m deepep_cupy.tests.legacy_internode --num-tokens 512 --hidden 2048

Checked: `get_dispatch_layout` (with `num_tokens_per_rdma_rank`); the mode matrix previous event x async x {BF16,
FP8 float32 scales (column-major), FP8 UE8M0} with expert alignment 1 / 128 and allocate_on_comm_stream where V1
allows it, each dispatch followed by a num_worst_tokens dispatch, a cached dispatch and a combine (0, 1, 2 biases;
weights as dispatched or with the non-local slots overwritten); rank 1 holds no tokens; a second buffer that grows
(a rank holding more tokens than one pass holds), combine of a handle from before the growth, num_worst_tokens over
capacity (that rank raises, the others finish); invalid calls raising before any kernel (the buffer stays usable);
a `low_latency_mode=True` Buffer builds across domains. Ends with `legacy internode test: PASSED` (exit 0) or `FAILED`.
"""

import sys
import time

from ..runtime import preflight
from . import cli

try:
    import torch
except ImportError as e:  # `--help` works without torch; a run names the extra that brings it
    preflight.exit_if_main(e, __name__, cli.legacy_internode_parser)
    raise

from ..runtime.group import get_group  # noqa: E402
from ..utils.envs import init_dist  # noqa: E402
from ..utils.math import per_token_cast_to_fp8  # noqa: E402
from ..v1.buffer import Buffer, Config  # noqa: E402
from ..v1.kernels import internode_reference as iref  # noqa: E402
from . import legacy_reference as ref  # noqa: E402
from .common import Failure, check, check_equal, expect_error, gather_tensors  # noqa: E402

KINDS = ('bf16', 'fp8', 'ue8m0')


class Case:
    """One rank's inputs (GPU) and every rank's on the host. Rank r holds `num_tokens - r` tokens (rank 1 none, rank
    0 `tokens_of_rank0` when given); about 10% of the top-k slots are -1."""

    def __init__(self, group, num_domains: int, num_tokens: int, hidden: int, num_topk: int, num_experts: int,
                 seed: int, tokens_of_rank0: int = 0):
        self.rank, self.R, self.D = group.rank, group.size, num_domains
        self.S = self.R // num_domains
        self.H, self.K, self.E = hidden, num_topk, num_experts
        n = max(1, num_tokens - self.rank)
        self.N = N = 0 if self.rank == 1 else (tokens_of_rank0 if self.rank == 0 and tokens_of_rank0 else n)
        gen = torch.Generator(device='cuda').manual_seed(seed * 1000 + self.rank)
        self.x = torch.randn((N, hidden), device='cuda', generator=gen).to(torch.bfloat16)
        scores = torch.randn((N, num_experts), device='cuda', generator=gen).abs() + 1
        self.topk_idx = torch.topk(scores, num_topk, dim=-1, sorted=False).indices.to(torch.int64)
        self.topk_idx.masked_fill_(torch.rand((N, num_topk), device='cuda', generator=gen) < 0.1, -1)
        self.topk_weights = torch.randn((N, num_topk), device='cuda', generator=gen)
        q, sf = per_token_cast_to_fp8(self.x)
        q8, sf8 = per_token_cast_to_fp8(self.x, use_ue8m0=True, round_scale=True)
        self.inputs = {'bf16': self.x, 'fp8': (q, sf.t().contiguous().t()), 'ue8m0': (q8, sf8.t().contiguous().t())}
        g = gather_tensors(group, (self.x, q, sf, q8, sf8, self.topk_idx, self.topk_weights))
        self.xs, qs, sfs, q8s, sf8s, self.topks, self.ws = (list(t) for t in zip(*g))
        self.host = {'bf16': (self.xs, None), 'fp8': (qs, sfs), 'ue8m0': (q8s, sf8s)}
        self.in_ranks = [ref.layout(t, num_experts, self.R)[2] for t in self.topks]
        self.max_tokens = max(t.shape[0] for t in self.xs)
        self._refs, self._handles = {}, {}
        self.layout = None

    def ref(self, kind: str) -> ref.DispatchRef:
        if kind not in self._refs:
            xs, sfs = self.host[kind]
            self._refs[kind] = ref.dispatch(xs, sfs, self.topks, self.ws, self.in_ranks, self.rank, self.E)
        return self._refs[kind]

    def handle_ref(self, num_channels: int) -> iref.InternodeHandleRef:
        if num_channels not in self._handles:
            self._handles[num_channels] = iref.reference_internode([t.numpy() for t in self.topks], self.E, self.D,
                                                                   num_channels)[self.rank]
        return self._handles[num_channels]

    def layout_args(self):
        per_rank, per_domain, per_expert, in_rank = self.layout
        return dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert)

    def _orders(self):
        """`legacy_reference.domain_orders` of this rank's tokens (cached)."""
        if getattr(self, '_order_cache', None) is None:
            self._order_cache = ref.domain_orders(self.topks[self.rank], self.E, self.R, self.D)
        return self._order_cache

    def expected_combine(self, biases, weight_fill=None):
        """`(combined_x, combined_topk_weights or None)` of this rank's tokens: per destination domain (in order of
        its last top-k slot) the FP32 sum from 0 of its ranks' rows `combine_rows(x, d)` (ranks in order of their
        last top-k slot), rounded to bfloat16; at the origin FP32 bias_0 + bias_1, then those partials, one rounding.
        Weights: FP32 from 0 over the domains (first top-k slot order) of each domain's FP32 sum from 0 over its
        ranks (first top-k slot order) of what each returns (`weight_fill`: 0.0 = the dispatch's, 'rank' = the
        non-local slots overwritten with (d + 1) / 2)."""
        x, topk = self.xs[self.rank], self.topks[self.rank]
        by_last, by_first = self._orders()
        acc = torch.zeros((x.shape[0], self.H), dtype=torch.float32)
        for b in biases:
            acc = acc + b.float()
        for i in range(self.D):
            part = torch.zeros_like(acc)
            for j in range(self.S):
                d = by_last[:, i, j]
                rows = (x.float() * ((d + 1).to(torch.float32) * 0.25).unsqueeze(1)).to(torch.bfloat16).float()
                part = torch.where((d >= 0).unsqueeze(1), part + rows, part)
            acc = torch.where((by_last[:, i, 0] >= 0).unsqueeze(1), acc + part.to(torch.bfloat16).float(), acc)
        if weight_fill is None:
            return acc.to(torch.bfloat16), None
        own, w = ref.owners(topk, self.E, self.R), self.ws[self.rank]
        total = torch.zeros(topk.shape, dtype=torch.float32)
        for i in range(self.D):
            inner = torch.zeros_like(total)
            for j in range(self.S):
                d = by_first[:, i, j].unsqueeze(1)
                fill = torch.zeros_like(w) if weight_fill == 0.0 else ((d + 1).to(torch.float32) * 0.5).expand_as(w)
                got = torch.where(own == d, w, fill)
                inner = torch.where(d >= 0, inner + got, inner)
            total = torch.where(by_first[:, i, :1] >= 0, total + inner, total)
        return acc.to(torch.bfloat16), total


def check_handle(case: Case, handle, num_channels: int, what: str, num_worst_tokens: int = 0, in_rank=None):
    """Every element of V1's internode handle against `reference_internode`."""
    h = case.handle_ref(num_channels)
    check(isinstance(handle, tuple) and len(handle) == 10, f'{what}: the handle is a 10-tuple')
    check(handle[0] is (in_rank if in_rank is not None else case.layout[3]), f'{what}: handle[0] is is_token_in_rank')
    names = ('rdma_channel_prefix_matrix', 'gbl_channel_prefix_matrix', 'recv_rdma_channel_prefix_matrix',
             'recv_rdma_rank_prefix_sum', 'recv_gbl_channel_prefix_matrix', 'recv_gbl_rank_prefix_sum')
    for i, name in enumerate(names, 1):
        check_equal(handle[i].cpu(), torch.from_numpy(getattr(h, name).astype('int32')), f'{what}: handle[{i}] {name}')
    n, f = h.recv_src_meta.shape[0], h.send_nvl_head.shape[0]
    meta, nvl = handle[7].cpu(), handle[9].cpu()
    check(meta.dtype == torch.uint8 and meta.shape == (num_worst_tokens or n, 8),
          f'{what}: handle[7] recv_src_meta {meta.dtype} {list(meta.shape)}')
    check_equal(meta[:n], torch.from_numpy(h.recv_src_meta), f'{what}: handle[7] recv_src_meta')
    check_equal(handle[8].cpu(), torch.from_numpy(h.send_rdma_head), f'{what}: handle[8] send_rdma_head')
    check(nvl.shape == (num_worst_tokens or f, case.S), f'{what}: handle[9] send_nvl_head shape {list(nvl.shape)}')
    check_equal(nvl[:f], torch.from_numpy(h.send_nvl_head), f'{what}: handle[9] send_nvl_head')
    if num_worst_tokens:
        check(bool((nvl[f:] == -1).all()), f'{what}: send_nvl_head rows past the forwarded count must be -1')
        pad = meta[n:].view(torch.int32).reshape(-1, 2)
        check(bool((pad[:, 0] == -1).all() and (pad[:, 1] == 0).all()), f'{what}: recv_src_meta padding rows')
    check(int(handle[-4][-1]) == n, f'{what}: handle[-4][-1] = {int(handle[-4][-1])} rows, expected {n}')


def check_dispatch(case: Case, out, kind: str, alignment: int, num_channels: int, what: str,
                   num_worst_tokens: int = 0):
    recv_x, recv_idx, recv_w, counts, handle, _ = out
    r = case.ref(kind)
    n = r.recv_x.shape[0]
    rows = num_worst_tokens or n
    if kind == 'bf16':
        check(not isinstance(recv_x, tuple), f'{what}: BF16 recv_x must be a tensor')
        data = recv_x
    else:
        data, sf = recv_x
        check(sf.dtype == (torch.int32 if kind == 'ue8m0' else torch.float32) and sf.shape[0] == rows and
              sf.stride(1) == 1, f'{what}: scales must be row-major [{rows}, P], got {sf.dtype} {list(sf.shape)}')
        check_equal(sf[:n].cpu(), r.recv_sf, f'{what}: recv scales')
    check(data.shape == (rows, case.H), f'{what}: recv_x shape {list(data.shape)}, expected [{rows}, {case.H}]')
    check_equal(data[:n].cpu(), r.recv_x, f'{what}: recv_x')
    check(recv_idx.shape == (rows, case.K) and recv_w.shape == (rows, case.K), f'{what}: top-k shapes')
    check_equal(recv_idx[:n].cpu(), r.recv_topk_idx, f'{what}: recv_topk_idx')
    check_equal(recv_w[:n].cpu(), r.recv_topk_weights, f'{what}: recv_topk_weights')
    if num_worst_tokens:
        check(bool((recv_idx[n:] == -1).all()), f'{what}: recv_topk_idx rows past the real count must be -1')
    want = [] if num_worst_tokens else ref.aligned(r.expert_counts, alignment)
    check(counts == want, f'{what}: num_recv_tokens_per_expert_list {counts} != {want}')
    check_handle(case, handle, num_channels, what, num_worst_tokens)


def _call(buf: Buffer, fn, config, prev: bool, async_finish: bool, alloc: bool, **kw):
    if prev:
        kw['previous_event'] = buf.capture()
    out = fn(config=config, async_finish=async_finish, allocate_on_comm_stream=alloc, **kw)
    if async_finish:
        out[-1].current_stream_wait()
    return out


def run_mode(buf: Buffer, case: Case, num_sms: int, i: int, prev: bool, async_finish: bool, kind: str) -> None:
    """One mode: dispatch, num_worst_tokens, cached dispatch, combine; all checked."""
    config = Config(num_sms, 8, 256, 16, 128)
    C = num_sms // 2
    alignment = 128 if i % 2 else 1
    alloc = prev and async_finish and i % 3 != 2
    tag = f'[{kind} prev={prev} async={async_finish} alloc={alloc} align={alignment}]'
    ev = (config, prev, async_finish, alloc)
    kw = dict(x=case.inputs[kind], expert_alignment=alignment, topk_idx=case.topk_idx,
              topk_weights=case.topk_weights, **case.layout_args())
    out = _call(buf, buf.dispatch, *ev, **kw)
    check_dispatch(case, out, kind, alignment, C, tag)
    worst = case.R * case.max_tokens + i
    out_w = _call(buf, buf.dispatch, *ev, num_worst_tokens=worst, **kw)
    check_dispatch(case, out_w, kind, alignment, C, f'{tag} num_worst_tokens', worst)
    handle = out[4]
    cached = _call(buf, buf.dispatch, *ev, x=case.inputs[kind], handle=handle)
    check(cached[1:5] == (None, None, None, None), f'{tag} cached: (recv_x, None x 4, event)')
    got, want = (cached[0], out[0]) if kind == 'bf16' else (cached[0][0], out[0][0])
    check_equal(got, want, f'{tag} cached recv_x')
    if kind != 'bf16':
        check_equal(cached[0][1], out[0][1], f'{tag} cached scales')
    biases = [torch.randn((case.N, case.H), device='cuda').to(torch.bfloat16) for _ in range(i % 3)]
    bias = None if not biases else (biases[0] if len(biases) == 1 else tuple(biases))
    rows = ref.combine_rows(case.ref('bf16').recv_x, case.rank).cuda()
    fill = 0.0 if i % 2 else 'rank'
    weights = out[2] if fill == 0.0 else ref.weights_rows(out[2], out[1], case.rank)
    for h, what in ((handle, 'combine'), (out_w[4], 'combine of the num_worst_tokens handle')):
        y = rows if h is handle else torch.cat([rows, rows.new_zeros((worst - rows.shape[0], case.H))])
        wts = weights if h is handle else torch.cat([weights, weights.new_zeros((worst - weights.shape[0], case.K))])
        combined, combined_w, _ = _call(buf, buf.combine, *ev, x=y, handle=h, topk_weights=wts, bias=bias)
        want_x, want_w = case.expected_combine([b.cpu() for b in biases], fill)
        check_equal(combined.cpu(), want_x, f'{tag} {what}: combined_x')
        check_equal(combined_w.cpu(), want_w, f'{tag} {what}: combined_topk_weights')
    combined, combined_w, _ = _call(buf, buf.combine, *ev, x=rows, handle=handle, bias=bias)
    check(combined_w is None, f'{tag} combine without weights returns None weights')
    check_equal(combined.cpu(), case.expected_combine([b.cpu() for b in biases])[0], f'{tag} combined_x (no weights)')


def check_layout(buf: Buffer, case: Case, num_channels: int) -> None:
    """get_dispatch_layout against the references, plain and asynchronous; keeps the plain outputs."""
    h = case.handle_ref(num_channels)
    per_expert_want = ref.layout(case.topk_idx.cpu(), case.E, case.R)[1]
    for async_finish in (False, True):
        out = buf.get_dispatch_layout(case.topk_idx, case.E, previous_event=buf.capture() if async_finish else None,
                                      async_finish=async_finish, allocate_on_comm_stream=async_finish)
        if async_finish:
            out[-1].current_stream_wait()
        per_rank, per_domain, per_expert, in_rank, _ = out
        what = f'get_dispatch_layout(async={async_finish})'
        check_equal(per_domain.cpu(), torch.from_numpy(h.num_tokens_per_rdma_rank), f'{what}: num_tokens_per_rdma_rank')
        check_equal(in_rank.cpu(), torch.from_numpy(h.is_token_in_rank), f'{what}: is_token_in_rank')
        check_equal(per_rank.cpu(), torch.from_numpy(h.is_token_in_rank.sum(0).astype('int32')),
                    f'{what}: num_tokens_per_rank')
        check_equal(per_expert.cpu(), per_expert_want, f'{what}: num_tokens_per_expert')
        if not async_finish:
            case.layout = (per_rank, per_domain, per_expert, in_rank)


def test_errors(buf: Buffer, case: Case, num_sms: int):
    """Invalid calls every rank makes alike: each raises before any kernel; then a dispatch still checks."""
    tried = []
    lay, x, idx, w = case.layout_args(), case.x, case.topk_idx, case.topk_weights
    expect = lambda name, exc, fn: expect_error(tried, name, exc, fn)  # noqa: E731
    expect('x float32', TypeError, lambda: buf.dispatch(x.float(), topk_idx=idx, topk_weights=w, **lay))
    expect('topk_idx int32', TypeError, lambda: buf.dispatch(x, topk_idx=idx.int(), topk_weights=w, **lay))
    expect('topk_weights float64', TypeError, lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w.double(), **lay))
    expect('without topk_idx', NotImplementedError, lambda: buf.dispatch(x, **lay))
    expect('without num_tokens_per_rdma_rank', ValueError,
           lambda: buf.dispatch(x, topk_idx=idx, **dict(lay, num_tokens_per_rdma_rank=None)))
    expect('allocate_on_comm_stream alone', ValueError,
           lambda: buf.dispatch(x, topk_idx=idx, allocate_on_comm_stream=True, **lay))
    good = buf.dispatch(x, topk_idx=idx, topk_weights=w, config=Config(num_sms, 8, 256), **lay)
    expect('cached dispatch with topk_idx', ValueError, lambda: buf.dispatch(x, handle=good[4], topk_idx=idx))
    expect('combine with a plain tuple', TypeError, lambda: buf.combine(good[0], tuple(good[4])))
    expect('combine x of the wrong rows', ValueError, lambda: buf.combine(good[0][:0], good[4]))
    expect('combine bias of the wrong rows', ValueError,
           lambda: buf.combine(good[0], good[4], bias=torch.zeros(case.N + 1, case.H, dtype=torch.bfloat16,
                                                                  device='cuda')))
    out = buf.dispatch(x, topk_idx=idx, topk_weights=w, config=Config(num_sms, 8, 256), **lay)
    check_dispatch(case, out, 'bf16', 1, num_sms // 2, 'dispatch after the error cases')
    return tried


def run_growth(torch_group, group, args) -> list:
    """A buffer without num_nvl_bytes (M = 1024 at its first dispatch): rank 0 then holds more tokens than that
    (probe, every rank grows and redoes, bitwise); the first handle's combine after the growth; num_worst_tokens over
    capacity (rank 0 raises, the others finish); a dispatch after it."""
    lines = []
    buf = Buffer(torch_group if torch_group is not None else group, 0, 0, explicitly_destroy=True)
    try:
        D = buf.num_domains
        small = Case(group, D, 64, args.hidden, args.num_topk, args.num_experts, args.seed + 1)
        check_layout(buf, small, args.num_sms // 2)
        first = buf.dispatch(small.x, topk_idx=small.topk_idx, topk_weights=small.topk_weights,
                             config=Config(args.num_sms, 8, 256), **small.layout_args())
        check_dispatch(small, first, 'bf16', 1, args.num_sms // 2, '[growth] first dispatch')
        M0 = buf._internode.engine.geometry[0]
        big = Case(group, D, 64, args.hidden, args.num_topk, args.num_experts, args.seed + 2, tokens_of_rank0=M0 + 300)
        check_layout(buf, big, args.num_sms // 2)
        out = buf.dispatch(big.inputs['fp8'], topk_idx=big.topk_idx, topk_weights=big.topk_weights,
                           config=Config(args.num_sms, 8, 256), **big.layout_args())
        check_dispatch(big, out, 'fp8', 1, args.num_sms // 2, '[growth] dispatch after the growth')
        M1 = buf._internode.engine.geometry[0]
        check(buf._internode.num_growths == 1 and M1 >= M0 + 300, f'[growth] M {M0} -> {M1}, '
              f'{buf._internode.num_growths} growths')
        rows = ref.combine_rows(small.ref('bf16').recv_x, small.rank).cuda()
        combined, _, _ = buf.combine(rows, first[4], config=Config(args.num_sms, 8, 256))
        check_equal(combined.cpu(), small.expected_combine([])[0],
                    '[growth] combine of a handle from before the growth')
        lines.append(f'[growth] rank 0 with {M0 + 300} tokens grew M {M0} -> {M1} and redid the dispatch (bitwise); '
                     f'the older handle still combines')
        over = Case(group, D, 64, args.hidden, args.num_topk, args.num_experts, args.seed + 3,
                    tokens_of_rank0=M1 + 1)
        check_layout(buf, over, args.num_sms // 2)
        kw = dict(topk_idx=over.topk_idx, topk_weights=over.topk_weights, num_worst_tokens=over.R * over.max_tokens,
                  config=Config(args.num_sms, 8, 256), **over.layout_args())
        if over.rank == 0:
            tried = []
            expect_error(tried, 'num_worst_tokens over capacity', ValueError, lambda: buf.dispatch(over.x, **kw))
            lines.append(f'[growth] {tried[0][:120]}...')
        else:
            rest = buf.dispatch(over.x, **kw)
            check(rest[0].shape[0] == over.R * over.max_tokens, '[growth] num_worst_tokens rows of the other ranks')
        again = buf.dispatch(small.x, topk_idx=small.topk_idx, topk_weights=small.topk_weights,
                             config=Config(args.num_sms, 8, 256), **small.layout_args())
        check_dispatch(small, again, 'bf16', 1, args.num_sms // 2, '[growth] dispatch after num_worst over capacity')
    finally:
        torch.cuda.synchronize()
        buf.destroy()
    return lines


def main(argv=None) -> int:
    args = cli.legacy_internode_parser().parse_args(argv)
    preflight.check_cuda()
    rank, R, torch_group = init_dist(seed=args.seed)
    group = get_group()
    if args.num_experts % R:
        args.num_experts = R * max(1, args.num_experts // R)
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    ok = True
    buf = Buffer(torch_group if torch_group is not None else group, int(2e9), int(1e9), explicitly_destroy=True)
    D, S = buf.num_domains, buf.num_scaleup_ranks
    try:
        check(D > 1, f'this program needs several scale-up domains (DEEPEP_CUPY_SCALEUP_SIZE), got {D} x {S}')
        log(f'[init] {R} ranks = {D} domains x {S}; tokens {args.num_tokens}, hidden {args.hidden}, '
            f'top-{args.num_topk}, {args.num_experts} experts, {args.num_sms} SMs')
        case = Case(group, D, args.num_tokens, args.hidden, args.num_topk, args.num_experts, args.seed)
        t0 = time.perf_counter()
        check_layout(buf, case, args.num_sms // 2)
        modes = [(prev, async_finish, kind) for prev in (False, True) for async_finish in (False, True)
                 for kind in KINDS]
        for i, mode in enumerate(modes):
            run_mode(buf, case, args.num_sms, i, *mode)
        torch.cuda.synchronize()
        log(f'[check] get_dispatch_layout and {len(modes)} dispatch modes (+ num_worst_tokens, cached, combine with '
            f'0-2 biases and weights), every element of the 10-element handle, bitwise equal to the references '
            f'({time.perf_counter() - t0:.1f} s)')
        tried = test_errors(buf, case, args.num_sms)
        log(f'[errors] {len(tried)} invalid calls raised before any kernel ran; the buffer still works:')
        for line in tried:
            log(f'    {line}')
        for line in run_growth(torch_group, group, args):
            log(line)
    except Failure as e:
        print(f'[rank {rank}] FAILED: {e}', flush=True)
        ok = False
    torch.cuda.synchronize()
    buf.destroy()
    try:
        # low-latency mode across domains is served now (tests.legacy_low_latency_internode checks it): it builds
        Buffer(torch_group if torch_group is not None else group, 0, 0, low_latency_mode=True,
               explicitly_destroy=True).destroy()
    except Exception as e:      # noqa: BLE001 (reported, then the run fails)
        print(f'[rank {rank}] FAILED: low_latency_mode=True across domains: {type(e).__name__}: {e}', flush=True)
        ok = False
    ok = all(group.allgather_object(ok))
    log(f'legacy internode test ({D} x {S}): PASSED' if ok else f'legacy internode test ({D} x {S}): FAILED')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
