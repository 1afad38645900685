"""EP dispatch / combine rank program: bitwise checks against references built from host-gathered inputs, the
argument checks, a timeout check, buffer create/destroy cycles, then DeepEP-style performance lines.

    mpirun -np N python -m deepep_cupy.tests.ep [--num-tokens 4096 --hidden 7168 --num-topk 6 --num-experts 256 ...]

Rank r dispatches `max(1, num_tokens - r)` tokens. Every mode of DeepEP's `enumerate_ep_modes` (handle copy ×
alignment {128, 1} × FP8 × biases {0, 1, 2} × previous event × async × allocate on the communication stream) goes
through plain, expanded, cached and cached-expanded-with-padding dispatch (with and without CPU sync) and both
combines; every output is compared with `deepep_cupy.utils.refs` bit for bit. The references use only inputs
gathered through the host process group, never NCCL or the code under test.
"""

import sys
import time

import numpy as np

from ..runtime import preflight
from . import cli

try:
    import torch
except ImportError as e:  # `--help` works without torch; a run names the extra that brings it
    preflight.exit_if_main(e, __name__, cli.ep_parser)
    raise

from .. import ElasticBuffer
from ..runtime.group import get_group
from ..utils import gate, refs
from ..utils.envs import init_dist
from ..utils.math import align, per_token_cast_to_fp8
from ..utils.testing import bench
from .common import Failure, check, check_equal, expect_error, gather_tensors, process_gpu_bytes


def enumerate_ep_modes(first_only: bool):
    for do_handle_copy in (1, 0):
        for expert_alignment in (128, 1):
            for use_fp8 in (1, 0):
                for num_bias in (0, 1, 2):
                    for with_previous_event in (0, 1):
                        for async_mode in (0, 1):
                            for alloc_on_comm in ((1,) if with_previous_event else (0, 1)):
                                yield (do_handle_copy, expert_alignment, use_fp8, num_bias, with_previous_event,
                                       async_mode, alloc_on_comm)
                                if first_only:
                                    return


class Case:
    """One rank's inputs and the references derived from every rank's inputs."""

    def __init__(self, args, group, rank: int, num_ranks: int, seed: int, num_max_tokens_per_rank: int = None,
                 num_tokens: int = None):
        """`num_max_tokens_per_rank` (default `args.num_tokens`) is the call's M, `num_tokens` this rank's token
        count (default `max(1, M - rank)`; 0 allowed)."""
        self.args, self.group, self.rank, self.num_ranks = args, group, rank, num_ranks
        self.M = args.num_tokens if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        self.H, self.K, self.E = args.hidden, args.num_topk, args.num_experts
        self.L = self.E // num_ranks
        self.seed = seed
        self.N = max(1, self.M - rank) if num_tokens is None else num_tokens
        gen = torch.Generator(device='cuda').manual_seed(seed * 1000 + rank)
        self.x = torch.randn((self.N, self.H), dtype=torch.float32, device='cuda', generator=gen).to(torch.bfloat16)
        torch.manual_seed(seed * 1000 + rank)
        if self.N:
            scores = gate.get_unbalanced_scores(self.N, self.E, num_ranks, self.K, args.unbalanced_ratio,
                                                args.precise_unbalanced_ratio, device='cuda')
            self.topk_idx = torch.topk(scores, self.K, dim=-1, sorted=False).indices.to(torch.int64)
        else:
            self.topk_idx = torch.empty((0, self.K), dtype=torch.int64, device='cuda')
        self.topk_weights = torch.randn((self.N, self.K), dtype=torch.float32, device='cuda', generator=gen)
        if args.masked_ratio > 0:
            mask = torch.rand((self.N, self.K), device='cuda', generator=gen) < args.masked_ratio
            self.topk_idx.masked_fill_(mask, -1)
            self.topk_weights.masked_fill_(mask, 0)
        x_fp8, sf = per_token_cast_to_fp8(self.x)
        # Column-major scale factors, as DeepEP's tests pass them.
        self.x_fp8 = (x_fp8, sf.t().contiguous().t())
        self.biases = [torch.randn((self.N, self.H), dtype=torch.float32, device='cuda', generator=gen)
                       .to(torch.bfloat16) for _ in range(2)]

        # Host-gathered references.
        gathered = gather_tensors(group, (self.x, x_fp8, sf, self.topk_idx, self.topk_weights))
        xs, fp8s, sfs, idxs, ws = zip(*gathered)
        self.ref = refs.dispatch_from_gathered(xs, None, idxs, ws, rank, self.M, self.E)
        self.ref_fp8 = refs.dispatch_from_gathered(fp8s, sfs, idxs, ws, rank, self.M, self.E)
        self.ref_counts = refs.expected_expert_counts(self.ref.recv_topk_idx, self.L)
        self.num_recv = self.ref.recv_x.shape[0]
        self.layouts = {a: refs.expanded_layout(self.ref.recv_topk_idx, self.L, a) for a in (1, 128)}
        # Combine inputs: per received row and top-k slot, deterministic data of the source token.
        src = self.ref.recv_src_token_global_idx.to('cuda').long()
        self.y = refs.generate_pre_combine_data(src, self.M, self.K, self.H, num_ranks, seed)
        local_idx = self.ref.recv_topk_idx.to('cuda')
        self.combine_x = refs.reduce_local_slots(self.y, local_idx)
        self.expected = {}

    def expected_combined(self, num_bias: int, reduce_in_local: bool):
        key = (num_bias, reduce_in_local)
        if key not in self.expected:
            bias = tuple(self.biases[:num_bias]) if num_bias else None
            self.expected[key] = refs.expected_combined_x(self.topk_idx, self.rank, self.M, self.num_ranks, self.E,
                                                          self.H, self.seed, bias=bias,
                                                          reduce_in_local=reduce_in_local)
        return self.expected[key]


make_case = Case      # hybrid mode (several domains): ep_hybrid.hybrid_case_class(Case, N), set by main


def check_dispatch(case: Case, out, use_fp8: bool, alignment: int, do_expand: bool, exact: bool, what: str,
                   zero_padding: bool = False):
    """Compare one dispatch's outputs with the references."""
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = out
    ref = case.ref_fp8 if use_fp8 else case.ref
    n = case.num_recv
    if use_fp8:
        recv_x, recv_sf = recv_x
    psum_src = handle.psum_num_recv_tokens_per_scaleup_rank.cpu()
    check_equal(psum_src, torch.cumsum(ref.num_recv_tokens_per_rank, 0).to(torch.int32), f'{what} psum per source')
    counts = case.ref_counts
    check_equal(handle.num_unaligned_recv_tokens_per_expert.cpu(), counts, f'{what} unaligned per-expert counts')
    check_equal(handle.psum_num_recv_tokens_per_expert.cpu(),
                refs.psum_num_recv_tokens_per_expert(counts, alignment, do_expand), f'{what} psum per expert')
    if exact:
        check(handle.num_recv_tokens == n, f'{what} num_recv_tokens {handle.num_recv_tokens} != {n}')
        check(handle.num_recv_tokens_per_expert_list == refs.aligned_expert_counts(counts, alignment),
              f'{what} aligned per-expert list')
    meta = handle.recv_src_metadata
    check_equal(meta[:n, 0].cpu(), ref.recv_src_token_global_idx, f'{what} metadata source index')
    if not do_expand:
        check(recv_x.shape[0] == (n if exact else case.num_ranks * case.M), f'{what} rows {recv_x.shape[0]}')
        check_equal(recv_x[:n], ref.recv_x, f'{what} recv_x')
        if use_fp8:
            check_equal(recv_sf[:n], ref.recv_sf, f'{what} recv_sf')
        check_equal(recv_topk_idx[:n].cpu(), ref.recv_topk_idx.to(torch.int64), f'{what} recv_topk_idx')
        if not exact:
            check(bool((recv_topk_idx[n:] == -1).all()), f'{what} tail of recv_topk_idx must be -1')
        if recv_topk_weights is not None:
            local = ref.recv_topk_idx >= 0
            want = torch.where(local, ref.recv_topk_weights, torch.zeros_like(ref.recv_topk_weights))
            check_equal(recv_topk_weights[:n].cpu(), want, f'{what} recv_topk_weights')
    else:
        lay = case.layouts[alignment]
        rows = lay.num_expanded_tokens
        check(handle.num_expanded_tokens == rows if exact else recv_x.shape[0] >= rows, f'{what} expanded rows')
        used = (lay.row_src >= 0).nonzero(as_tuple=True)[0]
        check_equal(recv_x[used.cuda()], ref.recv_x.cuda()[lay.row_src[used].cuda()], f'{what} expanded recv_x')
        if use_fp8:
            check_equal(recv_sf[used.cuda()], ref.recv_sf.cuda()[lay.row_src[used].cuda()], f'{what} expanded sf')
        check_equal(meta[:n, 2:].cpu(), lay.topk_to_expanded_row, f'{what} metadata expanded rows')
        if recv_topk_weights is not None:
            want = ref.recv_topk_weights[lay.row_src[used], lay.row_slot[used]]
            check_equal(recv_topk_weights[used.cuda()].cpu(), want, f'{what} expanded weights')
        if zero_padding:
            gaps = (lay.row_src < 0).nonzero(as_tuple=True)[0].cuda()
            zero = recv_x[gaps].view(torch.uint8) if use_fp8 else recv_x[gaps]
            check(bool((zero == 0).all()), f'{what} zero padding of recv_x')
            if recv_topk_weights is not None:
                check(bool((recv_topk_weights[gaps] == 0).all()), f'{what} zero padding of weights')


PROGRESS_SECS = 20.0        # run_modes' progress line: after this long without one


def run_modes(buf: ElasticBuffer, case: Case, first_only: bool, log=None) -> int:
    """All modes of enumerate_ep_modes; returns the number of checked calls. `log`: a progress line through it every
    `PROGRESS_SECS` (slow transports, e.g. NCCL sockets between ranks sharing a GPU, tell slow from stuck)."""
    num_checked = 0
    t0 = last = time.perf_counter()
    modes = list(enumerate_ep_modes(first_only))
    for i, (copy, alignment, use_fp8, num_bias, with_prev, async_mode, alloc_comm) in enumerate(modes):
        now = time.perf_counter()
        if log is not None and now - last >= PROGRESS_SECS:
            log(f'[check] {i} of {len(modes)} modes done ({num_checked} calls, {now - t0:.0f} s)')
            last = now
        tag = (f'[copy={copy} align={alignment} fp8={use_fp8} bias={num_bias} prev={with_prev} async={async_mode} '
               f'alloc_comm={alloc_comm}]')
        x = case.x_fp8 if use_fp8 else case.x

        def call(fn, *a, _prev=with_prev, _async=async_mode, _alloc=alloc_comm, **kw):
            if _prev:
                kw['previous_event'] = buf.capture()
            out = fn(*a, async_with_compute_stream=bool(_async), allocate_on_comm_stream=bool(_alloc), **kw)
            if _async:
                out[-1].current_stream_wait()
            return out

        stats = torch.zeros(case.L, dtype=torch.int32, device='cuda')
        out = call(buf.dispatch, x, case.topk_idx, case.topk_weights, cumulative_local_expert_recv_stats=stats,
                   num_experts=case.E, expert_alignment=alignment, do_handle_copy=bool(copy))
        check_dispatch(case, out, use_fp8, alignment, False, True, f'{tag} dispatch')
        check_equal(stats.cpu(), case.ref_counts, f'{tag} cumulative_local_expert_recv_stats')
        handle = out[3]
        check(torch.equal(handle.topk_idx, case.topk_idx), f'{tag} handle.topk_idx')
        check((handle.topk_idx.data_ptr() != case.topk_idx.data_ptr()) == bool(copy), f'{tag} do_handle_copy')

        out_nosync = call(buf.dispatch, x, case.topk_idx, case.topk_weights, num_experts=case.E,
                          expert_alignment=alignment, do_cpu_sync=False)
        check_dispatch(case, out_nosync, use_fp8, alignment, False, False, f'{tag} dispatch without CPU sync')

        exp = call(buf.dispatch, x, case.topk_idx, case.topk_weights, num_experts=case.E,
                   expert_alignment=alignment, do_expand=True)
        check_dispatch(case, exp, use_fp8, alignment, True, True, f'{tag} expanded dispatch')

        if use_fp8:
            # TMA-aligned column-major scale factors, and an explicit SM count.
            tma = call(buf.dispatch, x, case.topk_idx, case.topk_weights, num_experts=case.E,
                       expert_alignment=alignment, use_tma_aligned_col_major_sf=True, num_sms=4)
            sf = tma[0][1]
            check(sf.stride() == (1, align(sf.shape[0], 4)), f'{tag} column-major sf strides {sf.stride()}')
            check_dispatch(case, tma, use_fp8, alignment, False, True, f'{tag} dispatch with column-major sf')
            num_checked += 1
        cached = call(buf.dispatch, x, handle=handle, topk_weights=case.topk_weights)
        check_dispatch(case, cached, use_fp8, alignment, False, True, f'{tag} cached dispatch')
        # DeepEP's test_ep.py compares these two fields of a handle and of its cached dispatch's handle.
        check_equal(cached[3].dst_buffer_slot_idx, handle.dst_buffer_slot_idx, f'{tag} cached dst_buffer_slot_idx')
        check_equal(cached[3].psum_num_recv_tokens_per_scaleup_rank, handle.psum_num_recv_tokens_per_scaleup_rank,
                    f'{tag} cached psum_num_recv_tokens_per_scaleup_rank')
        cached_exp = call(buf.dispatch, x, handle=exp[3], topk_weights=case.topk_weights, do_expand=True,
                          do_zero_padding=True)
        check_dispatch(case, cached_exp, use_fp8, alignment, True, True, f'{tag} cached expanded dispatch',
                       zero_padding=True)
        num_checked += 5

        # Combine of the non-expanded output (each row = this rank's local sum) and of the expanded output.
        bias = tuple(case.biases[:num_bias]) if num_bias == 2 else (case.biases[0] if num_bias == 1 else None)
        combined, combined_w, _ = call(buf.combine, case.combine_x, handle, topk_weights=out[2], bias=bias,
                                       num_sms=0 if copy else 6)
        check_equal(combined, case.expected_combined(num_bias, True), f'{tag} combine')
        check_equal(combined_w, case.topk_weights, f'{tag} combined_topk_weights')
        lay = case.layouts[alignment]
        exp_x = refs.expand_slots(case.y, lay)
        exp_w = exp[2]
        reduced, reduced_w, _ = call(buf.combine, exp_x, exp[3], topk_weights=exp_w, bias=bias)
        check_equal(reduced, case.expected_combined(num_bias, buf.allow_multiple_reduction),
                    f'{tag} expanded combine')
        check_equal(reduced_w, case.topk_weights, f'{tag} expanded combined_topk_weights')
        num_checked += 2
    return num_checked


def test_small_m_and_empty_ranks(buf: ElasticBuffer, args, group, rank: int, num_ranks: int) -> int:
    """What integrations do that the mode matrix does not: a per-call `num_max_tokens_per_rank` smaller than the
    buffer's (vLLM's decode passes the next power of two of the batch, no CPU sync), and ranks with 0 tokens (DP
    ranks with an empty batch). Both checked bit for bit, dispatch (plain, expanded, cached) and combine."""
    num_checked = 0
    m_small = max(1, 1 << max(0, (args.num_tokens // 3).bit_length() - 1))      # a power of two below M
    cases = (('per-call num_max_tokens_per_rank', make_case(args, group, rank, num_ranks, args.seed + 7, m_small)),
             ('0-token ranks', make_case(args, group, rank, num_ranks, args.seed + 8, None,
                                    0 if rank % 2 == 1 or num_ranks == 1 else max(1, args.num_tokens - rank))))
    for what, case in cases:
        m = case.M
        for do_cpu_sync in (False, True):
            tag = f'[{what}={m}, cpu_sync={int(do_cpu_sync)}]'
            out = buf.dispatch(case.x, case.topk_idx, case.topk_weights, num_experts=case.E,
                               num_max_tokens_per_rank=m, do_cpu_sync=do_cpu_sync)
            check_dispatch(case, out, False, 1, False, do_cpu_sync, f'{tag} dispatch')
            exp = buf.dispatch(case.x, case.topk_idx, case.topk_weights, num_experts=case.E,
                               num_max_tokens_per_rank=m, do_cpu_sync=do_cpu_sync, do_expand=True,
                               expert_alignment=128)
            check_dispatch(case, exp, False, 128, True, do_cpu_sync, f'{tag} expanded dispatch')
            cached = buf.dispatch(case.x_fp8, handle=out[3], topk_weights=case.topk_weights)
            check_dispatch(case, cached, True, 1, False, do_cpu_sync, f'{tag} cached FP8 dispatch')
            combine_x = case.combine_x
            if not do_cpu_sync:     # worst-case rows: the real ones first, the rest ignored by combine
                combine_x = torch.zeros((out[0].shape[0], case.H), dtype=torch.bfloat16, device='cuda')
                combine_x[:case.num_recv] = case.combine_x
            combined, combined_w, _ = buf.combine(combine_x, out[3], topk_weights=out[2])
            check_equal(combined, case.expected_combined(0, True), f'{tag} combine')
            check_equal(combined_w, case.topk_weights, f'{tag} combined_topk_weights')
            num_checked += 4
    return num_checked


def test_errors(buf: ElasticBuffer, case: Case) -> list:
    """Invalid inputs raise ValueError/TypeError before any kernel runs; returns the cases tried."""
    x, idx, w, E = case.x, case.topk_idx, case.topk_weights, case.E
    good = buf.dispatch(x, idx, w, num_experts=E)
    handle = good[3]
    tried = []

    def expect(name, exc, fn):
        expect_error(tried, name, exc, fn)

    expect('x float32', TypeError, lambda: buf.dispatch(x.float(), idx, w, num_experts=E))
    expect('x 1-D', ValueError, lambda: buf.dispatch(x[0], idx, w, num_experts=E))
    expect('x on the host', ValueError, lambda: buf.dispatch(x.cpu(), idx, w, num_experts=E))
    expect('x strided rows', ValueError, lambda: buf.dispatch(x[:, ::2], idx, w, num_experts=E))
    expect('x hidden not 16-byte aligned', ValueError, lambda: buf.dispatch(x[:, :12], idx, w, num_experts=E))
    expect('topk_idx int32', TypeError, lambda: buf.dispatch(x, idx.int(), w, num_experts=E))
    expect('topk_idx too large', ValueError, lambda: buf.dispatch(x, torch.full_like(idx, E), w, num_experts=E))
    expect('topk_idx below -1', ValueError, lambda: buf.dispatch(x, torch.full_like(idx, -2), w, num_experts=E))
    # One bad id among good ones, last and first (the range kernel's unrolled loads and their tail)
    for name, at, bad in (('last', -1, E), ('first', 0, -2)):
        one_bad = idx.clone()
        one_bad.view(-1)[at] = bad
        expect(f'topk_idx one bad id ({name})', ValueError,
               lambda one_bad=one_bad: buf.dispatch(x, one_bad, w, num_experts=E))
    expect('topk_idx wrong rows', ValueError, lambda: buf.dispatch(x, idx[:-1], w, num_experts=E) if x.shape[0] > 1
           else buf.dispatch(x, idx.repeat(2, 1), w, num_experts=E))
    idx_strided = torch.empty((idx.shape[0], 2 * idx.shape[1]), dtype=idx.dtype, device=idx.device)[:, ::2]
    idx_strided.copy_(idx)
    expect('topk_idx non-contiguous', ValueError, lambda: buf.dispatch(x, idx_strided, w, num_experts=E))
    w_wide = torch.cat([w, w[:, :1]], dim=1)       # one column too many (any top-k, 1 included)
    expect('topk_weights shape', ValueError, lambda: buf.dispatch(x, idx, w_wide, num_experts=E))
    expect('topk_weights dtype', TypeError, lambda: buf.dispatch(x, idx, w.double(), num_experts=E))
    expect('num_tokens > num_max_tokens_per_rank', ValueError,
           lambda: buf.dispatch(x, idx, w, num_experts=E, num_max_tokens_per_rank=max(1, x.shape[0] - 1))
           if x.shape[0] > 1 else buf.dispatch(x.repeat(case.M + 1, 1), idx.repeat(case.M + 1, 1),
                                               w.repeat(case.M + 1, 1), num_experts=E))
    if case.num_ranks > 1:
        expect('num_experts not a multiple of ranks', ValueError, lambda: buf.dispatch(x, idx, w, num_experts=E + 1))
    expect('num_experts missing', ValueError, lambda: buf.dispatch(x, idx, w))
    expect('previous_event without allocate_on_comm_stream', ValueError,
           lambda: buf.dispatch(x, idx, w, num_experts=E, previous_event=buf.capture()))
    expect('cached dispatch with topk_idx', ValueError, lambda: buf.dispatch(x, idx, handle=handle))
    expect('cached dispatch with other alignment', ValueError,
           lambda: buf.dispatch(x, handle=handle, expert_alignment=handle.expert_alignment + 1))
    expect('sf rows', ValueError, lambda: buf.dispatch((case.x_fp8[0], case.x_fp8[1][:0]), idx, w, num_experts=E))
    expect('combine x rows', ValueError, lambda: buf.combine(case.combine_x[:0], handle))
    expect('combine x dtype', TypeError, lambda: buf.combine(case.combine_x.float(), handle))
    expect('combine bias shape', ValueError, lambda: buf.combine(case.combine_x, handle, bias=case.biases[0][:, :8]))
    expect('combine three biases', ValueError, lambda: buf.combine(case.combine_x, handle, bias=tuple(case.biases) * 2))
    expect('combine weights shape', ValueError, lambda: buf.combine(case.combine_x, handle, topk_weights=w_wide))
    expect('handle of the wrong type', TypeError, lambda: buf.combine(case.combine_x, (1, 2)))
    return tried


def test_cupy(buf: ElasticBuffer, case: Case):
    """The same dispatch and combine with CuPy arrays (bfloat16 as uint16): outputs are CuPy arrays, bitwise equal
    to the references."""
    import cupy

    from ..runtime.interop import to_cupy, to_torch
    x, idx, w = to_cupy(case.x), to_cupy(case.topk_idx), to_cupy(case.topk_weights)
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=case.E)
    check(isinstance(recv_x, cupy.ndarray) and recv_x.dtype == np.uint16, 'CuPy dispatch returns uint16 CuPy arrays')
    check_equal(to_torch(recv_x, 'bfloat16'), case.ref.recv_x, 'CuPy recv_x')
    check_equal(to_torch(recv_idx).cpu(), case.ref.recv_topk_idx.to(torch.int64), 'CuPy recv_topk_idx')
    combined, combined_w, _ = buf.combine(to_cupy(case.combine_x), handle, topk_weights=recv_w)
    check(isinstance(combined, cupy.ndarray), 'CuPy combine returns CuPy arrays')
    check_equal(to_torch(combined, 'bfloat16'), case.expected_combined(0, True), 'CuPy combine')
    check_equal(to_torch(combined_w), case.topk_weights, 'CuPy combined_topk_weights')


def test_misc(buf: ElasticBuffer, case: Case):
    """The rest of the buffer API: streams, barrier, domain sizes, the SM heuristic, the V2.5 class name."""
    from .. import EPBuffer
    check(buf.get_comm_stream() is buf.comm_stream, 'get_comm_stream')
    buf.barrier()
    buf.barrier(use_comm_stream=False, with_cpu_sync=True)
    check(buf.get_physical_domain_size() == (1, case.num_ranks), 'get_physical_domain_size')
    check(buf.get_logical_domain_size() == (1, case.num_ranks), 'get_logical_domain_size')
    num_sms = buf.get_theoretical_num_sms(case.E, case.K)
    check(2 <= num_sms <= 132 and num_sms % 2 == 0, f'get_theoretical_num_sms {num_sms}')
    check(buf.num_allocated_qps == 17 and buf.get_theoretical_num_qps(num_sms) == min(num_sms, 9),
          f'QPs: {buf.num_allocated_qps} allocated, {buf.get_theoretical_num_qps(num_sms)} for {num_sms} SMs')
    buf.barrier(sequential=False)
    hint = ElasticBuffer.get_buffer_size_hint(buf.group, case.M, case.H, case.K)
    check(hint % (2 << 20) == 0 and hint <= buf.num_bytes or case.K < buf.num_topk, 'get_buffer_size_hint')
    import deepep_cupy
    check(deepep_cupy.get_physical_domain_size(buf.group) == (1, case.num_ranks), 'module get_physical_domain_size')
    check(deepep_cupy.get_logical_domain_size(buf.group) == (1, case.num_ranks), 'module get_logical_domain_size')
    # The V2.5 class, and the SM heuristic when compute overlap does not matter (at least 64 SMs).
    other = EPBuffer(buf.group, num_max_tokens_per_rank=case.M, hidden=case.H, num_topk=case.K,
                     prefer_overlap_with_compute=False, use_fp8_dispatch=True, explicitly_destroy=True)
    try:
        check(not isinstance(other, ElasticBuffer) and other.num_lb_bytes == 0, 'EPBuffer: V2.5 class, no LB region')
        if case.num_ranks > 1:
            sms = other.get_theoretical_num_sms(case.E, case.K)
            check(sms >= min(64, other.num_device_sms), f'prefer_overlap_with_compute=False gives {sms} SMs')
        out = other.dispatch(case.x, case.topk_idx, case.topk_weights, num_experts=case.E)
        check_dispatch(case, out, False, 1, False, True, 'EPBuffer dispatch')
        check(out[3].topk_idx is case.topk_idx, 'EPBuffer handle keeps topk_idx itself (V2.5)')
        check(out[3].token_metadata_at_forward is None and out[3].channel_linked_list is None,
              'EPHandle hybrid-mode fields are None inside one domain')
        try:
            buf.combine(case.combine_x, out[3])
            raise Failure('a handle from another buffer was accepted')
        except ValueError:
            pass
    finally:
        other.destroy()


def test_timeout(args, group, case: Case) -> bool:
    """The last rank skips a dispatch: every other rank must raise TimeoutError naming a phase and that rank."""
    buf = ElasticBuffer(group, num_max_tokens_per_rank=case.M, hidden=case.H, num_topk=case.K,
                        num_gpu_timeout_secs=args.timeout_test_secs, explicitly_destroy=True)
    victim = group.size - 1
    outcome = 'skipped (the missing rank)'
    if group.rank != victim:
        try:
            buf.dispatch(case.x, case.topk_idx, case.topk_weights, num_experts=case.E,
                         do_cpu_sync=not args.timeout_test_no_sync)
            if args.timeout_test_no_sync:      # no host wait inside the dispatch: wait here, bounded
                buf.synchronize()
                buf.check_usable()
            outcome = 'no error'
        except TimeoutError as e:
            outcome = 'TimeoutError' if f'waited for rank {victim}' in str(e) else f'bad message: {e}'
            if group.rank == 0:
                print(f'[timeout] rank 0: {e}', flush=True)
    outcomes = group.allgather_object(outcome)
    buf.destroy()
    return all(o == 'TimeoutError' for r, o in enumerate(outcomes) if r != victim)


def test_create_destroy(args, group, case: Case, num_cycles: int) -> tuple:
    torch.cuda.synchronize()
    used0 = process_gpu_bytes()
    t0 = time.perf_counter()
    for _ in range(num_cycles):
        buf = ElasticBuffer(group, num_max_tokens_per_rank=case.M, hidden=case.H, num_topk=case.K,
                            explicitly_destroy=True)
        buf.destroy()
    group.barrier()
    used1 = process_gpu_bytes()
    return used1 - used0, (time.perf_counter() - t0) / max(1, num_cycles)


def perf(buf: ElasticBuffer, case: Case, args):
    """DeepEP-style per-rank performance lines (times from CUDA events, L2 flushed between calls)."""
    lines = []
    for use_fp8 in (True, False):
        x = case.x_fp8 if use_fp8 else case.x
        out = buf.dispatch(x, case.topk_idx, case.topk_weights, num_experts=case.E, num_sms=args.num_sms)
        recv_x, recv_idx, recv_w, handle, _ = out
        rows = recv_idx.shape[0]
        rx = recv_x[0] if use_fp8 else recv_x
        per_token = (rx.element_size() * rx.shape[1] + (recv_x[1].shape[1] * 4 if use_fp8 else 0)
                     + recv_idx.shape[1] * (8 + 4))
        t = bench(lambda x=x: buf.dispatch(x, case.topk_idx, case.topk_weights, num_experts=case.E,
                                           num_sms=args.num_sms))[0]
        t_nosync = bench(lambda x=x: buf.dispatch(x, case.topk_idx, case.topk_weights, num_experts=case.E,
                                                  num_sms=args.num_sms, do_cpu_sync=False))[0]
        t_cached = bench(lambda x=x, h=handle: buf.dispatch(x, handle=h, topk_weights=case.topk_weights))[0]
        su = per_token * rows
        lines.append(f'[perf] rank {case.rank} | dispatch {"FP8 " if use_fp8 else "BF16"}: {su / t / 1e9:.0f} GB/s '
                     f'(SU), {t * 1e6:.1f} us, {su} bytes | no CPU sync {t_nosync * 1e6:.1f} us | cached '
                     f'{t_cached * 1e6:.1f} us | SMs {handle.num_sms}')
    comb_x = case.combine_x
    t = bench(lambda: buf.combine(comb_x, handle, topk_weights=recv_w))[0]
    cbytes = rows * (comb_x.shape[1] * 2 + recv_w.shape[1] * 4)
    lines.append(f'[perf] rank {case.rank} | combine: {cbytes / t / 1e9:.0f} GB/s (SU), {t * 1e6:.1f} us, '
                 f'{cbytes} bytes')
    return lines


def dispatch_paths(buf: ElasticBuffer) -> str:
    """Bound dispatch signatures fused into one launch (DEEPEP_CUPY_EP_FUSED_NOTIFY), and why the others are not."""
    ep = getattr(buf._ep, 'inner', buf._ep)         # hybrid mode: the intranode engine inside the composed path
    bound = [b for b in getattr(ep, '_bound', {}).values() if hasattr(b, 'fused_refusal')]
    why = sorted({b.fused_refusal for b in bound if not b.fused})
    return f'{sum(b.fused for b in bound)} of {len(bound)} bound dispatches fused (one launch); others: {why}'


def main(argv=None) -> int:
    p = cli.ep_parser()
    args = p.parse_args(argv)
    preflight.check_cuda()

    rank, num_ranks, _ = init_dist(seed=args.seed)
    group = get_group()  # host group: MPI under mpirun, else the torch world init_dist joined
    if args.num_experts % num_ranks:
        args.num_experts = num_ranks * max(1, args.num_experts // num_ranks)
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    t0 = time.perf_counter()
    buf = ElasticBuffer(group, num_max_tokens_per_rank=args.num_tokens, hidden=args.hidden, num_topk=args.num_topk,
                        deterministic=args.deterministic, allow_multiple_reduction=bool(args.allow_multiple_reduction),
                        num_gpu_timeout_secs=args.num_gpu_timeout_secs,
                        num_cpu_timeout_secs=args.num_cpu_timeout_secs, explicitly_destroy=True)
    log(f'[init] {num_ranks} ranks, {buf.topology.num_ranks_per_gpu()} per GPU, buffer {buf.num_bytes / 2**20:.0f} '
        f'MiB, built (kernels compiled/loaded) in {time.perf_counter() - t0:.2f} s; tokens {args.num_tokens}, hidden '
        f'{args.hidden}, top-{args.num_topk}, {args.num_experts} experts')
    global make_case
    hybrid = buf.num_scaleout_ranks > 1
    if hybrid:
        from . import ep_hybrid
        make_case = ep_hybrid.hybrid_case_class(Case, buf.num_scaleout_ranks)
        log(f'[init] hybrid mode: {buf.num_scaleout_ranks} domains x {buf.num_scaleup_ranks} ranks, rails over '
            f'{buf._ep.rails.kind}; rows in hybrid order, combine reduced in each domain first')
    ok = True
    case = None
    try:
        case = make_case(args, group, rank, num_ranks, args.seed)
        if not args.skip_check:
            t0 = time.perf_counter()
            n = run_modes(buf, case, args.test_first_only, log)
            torch.cuda.synchronize()
            log(f'[check] {n} dispatch/combine calls bitwise equal to the references '
                f'({time.perf_counter() - t0:.1f} s)')
        if not args.skip_check:
            t0 = time.perf_counter()
            n = test_small_m_and_empty_ranks(buf, args, group, rank, num_ranks)
            torch.cuda.synchronize()
            log(f'[check] per-call num_max_tokens_per_rank below the buffer\'s and 0-token ranks: {n} calls bitwise '
                f'equal ({time.perf_counter() - t0:.1f} s)')
            (ep_hybrid.test_misc if hybrid else test_misc)(buf, case)
            test_cupy(buf, case)
            log('[check] CuPy arrays in, CuPy arrays out: bitwise equal')
            log(f'[check] dispatch kernels: {dispatch_paths(buf)}')
        if not args.skip_error_test:
            tried = test_errors(buf, case)
            out = buf.dispatch(case.x, case.topk_idx, case.topk_weights, num_experts=case.E)
            check_dispatch(case, out, False, 1, False, True, 'dispatch after the error cases')
            log(f'[errors] {len(tried)} invalid calls raised before any kernel ran; the buffer still works:')
            for line in tried:
                log(f'    {line}')
        if args.do_pressure_test:
            t0 = time.perf_counter()
            for s in range(1, args.num_pressure_seeds + 1):
                pc = make_case(args, group, rank, num_ranks, args.seed + s)
                run_modes(buf, pc, True)
            log(f'[pressure] {args.num_pressure_seeds} seeds, zero mismatches ({time.perf_counter() - t0:.1f} s)')
        if hybrid and not args.skip_graph_test:
            ep_hybrid.test_graph(buf, args, group, make_case)
            log('[graph] hybrid dispatch (no CPU sync) + combine in one CUDA graph, 2 replays bitwise equal')
        if not args.skip_perf_test:
            lines = group.allgather_object(perf(buf, case, args))
            for rank_lines in lines:
                for line in rank_lines:
                    log(line)
    except Failure as e:
        print(f'[rank {rank}] FAILED: {e}', flush=True)
        ok = False
    buf.destroy()
    ok = all(group.allgather_object(ok))

    if ok and case is not None and not args.skip_timeout_test and num_ranks > 1:
        good = ep_hybrid.test_timeout(args, group, case, ElasticBuffer) if hybrid else test_timeout(args, group, case)
        log(f'[timeout] a missing rank gives TimeoutError on every other rank: {"OK" if good else "FAILED"}')
        ok &= good
    if ok and case is not None and args.num_create_destroy:
        leaked, per_cycle = test_create_destroy(args, group, case, args.num_create_destroy)
        leaks = group.allgather_object(leaked)
        good = all(abs(v) < (64 << 20) for v in leaks)
        log(f'[memory] {args.num_create_destroy} create/destroy cycles: GPU memory change per rank '
            f'{[round(v / 2**20, 1) for v in leaks]} MiB, {per_cycle * 1e3:.1f} ms per cycle: '
            f'{"OK" if good else "FAILED"}')
        ok &= good
    ok = all(group.allgather_object(ok))
    log('ep test: PASSED' if ok else 'ep test: FAILED')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
