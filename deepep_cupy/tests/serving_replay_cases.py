"""The call sequences of `serving_replay` (the rank program; its docstring has the table of what is replayed, file
and commit): vLLM's DeepEP managers and prepare/finalize classes, SGLang's DeepEPBuffer and dispatchers, re-enacted
call for call on `deep_ep` = deepep_cupy, each result checked bit for bit against the host references of
`serving_replay`; then the case list (`CASES`), grouped by the buffer (one framework configuration) each runs on.

Every case is `run(ctx, holder)`: `ctx` a `serving_replay.Context`, `holder` the block's buffer owner (`VllmManager`,
`SGLangBuffer`); it raises `Failure` naming the case (`ctx.what`), the tensor, the first mismatch. The same sequences
run inside one scale-up domain and across several (`ctx.D`): the framework code has no other branch than vLLM's HT
buffer arguments, and `ctx` picks the inputs and checks of the topology. `skip_reasons` says which cases a run
leaves out, and why.
"""

import gc
from types import SimpleNamespace
from typing import Callable, Dict, NamedTuple

import torch

from . import legacy_low_latency as llp
from .common import check, check_equal
from .legacy_intranode import Case
from .serving_replay import (
    BF16,
    FP8,
    FP8_UE8M0,
    SGLANG_EXPERT_ALIGNMENT,
    VLLM_LL_HIDDEN_SIZES,
    VLLM_MANAGER_NUM_SMS,
    check_combined,
    check_normal,
    grows,
    normal_experts,
    normal_input,
    prefill_tokens,
    sglang_buffer_sizes,
    token_limit,
    vllm_configs,
    vllm_ht_buffer_kwargs,
    vllm_ll_buffer_kwargs,
)


# ---- vLLM ---------------------------------------------------------------------------------------------------------
class VllmManager:
    """DeepEPHTAll2AllManager / DeepEPLLAll2AllManager: get_handle's `Buffer(**kwargs)`, set_num_sms, destroy."""

    def __init__(self, ctx, low_latency: bool, fault_tolerance: bool = False):
        self.ctx = ctx
        self.kwargs = (vllm_ll_buffer_kwargs(ctx.cpu_group, ctx.Buffer, ctx.env, ctx.H, ctx.R, ctx.E, fault_tolerance)
                       if low_latency else vllm_ht_buffer_kwargs(ctx.cpu_group, ctx.env, internode=ctx.D > 1))
        self.buffer = ctx.Buffer(**self.kwargs)

    def set_num_sms(self, num_sms: int) -> None:
        self.ctx.Buffer.set_num_sms(min(num_sms, VLLM_MANAGER_NUM_SMS))

    def close(self) -> None:
        self.buffer.destroy()


def vllm_ht_dispatch(buf, case, kind, config, previous_event=None, dbo=False):
    """DeepEPHTPrepareAndFinalize._do_dispatch (previous_event: dbo_get_previous_event's, None without DBO). Returns
    `(dispatch outputs, the layout's (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
    is_token_in_rank))`."""
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(
        topk_idx=case.topk_idx, num_experts=case.E, previous_event=previous_event, async_finish=False,
        allocate_on_comm_stream=False)
    out = buf.dispatch(x=normal_input(case, kind), handle=None, num_tokens_per_rank=per_rank,
                       num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=case.topk_idx, topk_weights=case.topk_weights, expert_alignment=1, config=config,
                       previous_event=previous_event, async_finish=not dbo, allocate_on_comm_stream=False)
    return out, (per_rank, per_rdma, per_expert, in_rank)


def vllm_ht_receiver(ctx, out) -> None:
    """_receiver: the event wait, then the outputs as vLLM uses them (global ids, ExpertTokensMetadata)."""
    if out[5].event is not None:
        out[5].current_stream_wait()
    offset = ctx.rank * (ctx.E // ctx.R)
    ids = torch.where(out[1] == -1, ctx.E - 1 if offset == 0 else 0, out[1] + offset)
    counts = torch.tensor(out[3], dtype=torch.int32, device=ids.device)      # make_from_list
    check(ids.shape == out[1].shape and counts.numel() == ctx.E // ctx.R, 'vLLM receiver: ids and counts shapes')


def vllm_ht_finalize(buf, handle, y, config, output, do_async: bool, previous_event=None, dbo=False) -> None:
    """_finalize: combine without weights (applied before), then the receiver's wait and copy into `output`."""
    combined_x, _, event = buf.combine(x=y, handle=handle, topk_weights=None, config=config,
                                       previous_event=previous_event, async_finish=do_async and not dbo,
                                       allocate_on_comm_stream=False)
    if do_async and event.event is not None:
        event.current_stream_wait()
    output.copy_(combined_x, non_blocking=True)


def vllm_ht(ctx, mgr, kind, zero=False, finalize_async=True):
    d_cfg, c_cfg = vllm_configs(ctx.Buffer, ctx.R)
    case = ctx.case(1, zero=zero)
    out, layout = vllm_ht_dispatch(mgr.buffer, case, kind, d_cfg)
    vllm_ht_receiver(ctx, out)
    check_normal(case, kind, out, layout, 1, (d_cfg or ctx.Buffer).num_sms, ctx.what)
    output = torch.empty_like(case.x)
    vllm_ht_finalize(mgr.buffer, out[4], normal_experts(ctx, out), c_cfg, output, finalize_async)
    check_combined(case, kind, output, ctx.what)


def vllm_ht_dbo(ctx, mgr, kind='fp8'):
    """Two micro-batches (UBatchContext): each captures its previous event on its compute stream and yields; both
    dispatch on vLLM's comm stream before either combines (two handles outstanding)."""
    saved = ctx.Buffer.num_sms
    mgr.set_num_sms(ctx.env['VLLM_DBO_COMM_SMS'])      # DBO's SM control (ubatch_utils) -> set_num_sms
    try:
        d_cfg, c_cfg = vllm_configs(ctx.Buffer, ctx.R)
        cases = [ctx.case(2), ctx.case(3)]
        main, comm = torch.cuda.current_stream(), torch.cuda.Stream()
        compute = [torch.cuda.Stream(), torch.cuda.Stream()]
        for s in (*compute, comm):
            s.wait_stream(main)
        prev = []
        for u in (0, 1):                # dbo_get_previous_event(buffer.capture), then yield_and_switch to comm
            with torch.cuda.stream(compute[u]):
                prev.append(mgr.buffer.capture())
        outs, ys, outputs, prev_c = [], [], [], []
        for u in (0, 1):                # on comm: layout + dispatch; switch_to_compute_sync; receiver; experts
            comm.wait_stream(compute[u])
            with torch.cuda.stream(comm):
                outs.append(vllm_ht_dispatch(mgr.buffer, cases[u], kind, d_cfg, prev[u], dbo=True))
            compute[u].wait_stream(comm)
            with torch.cuda.stream(compute[u]):
                vllm_ht_receiver(ctx, outs[u][0])
                ys.append(normal_experts(ctx, outs[u][0]))
                outputs.append(torch.empty_like(cases[u].x))
                prev_c.append(mgr.buffer.capture())        # _finalize's dbo_get_previous_event, then yield
        for u in (0, 1):                # on comm: combine; the receiver copies on comm, then back to compute
            comm.wait_stream(compute[u])
            with torch.cuda.stream(comm):
                vllm_ht_finalize(mgr.buffer, outs[u][0][4], ys[u], c_cfg, outputs[u], True, prev_c[u], dbo=True)
            compute[u].wait_stream(comm)
        for s in compute:
            main.wait_stream(s)
        torch.cuda.synchronize()
        for u in (0, 1):
            what = f'{ctx.what} micro-batch {u}'
            check_normal(cases[u], kind, outs[u][0], outs[u][1], 1, (d_cfg or ctx.Buffer).num_sms, what)
            check_combined(cases[u], kind, outputs[u], what)
    finally:
        ctx.Buffer.set_num_sms(saved)


def vllm_ll_prepare(buf, inp, M: int, mode):
    """DeepEPLLPrepareAndFinalize.prepare_async: (expert_x, expert_num_tokens, handle, _, hook)."""
    return buf.low_latency_dispatch(inp.x, inp.topk_idx, M, inp.E, use_fp8=mode[0], round_scale=mode[2],
                                    use_ue8m0=mode[2], async_finish=False, return_recv_hook=True)


def vllm_ll_finalize(buf, inp, handle, y, do_recv_hook: bool):
    """_finalize (weights applied in the combine; output = modular kernel's empty_like(hidden_states))."""
    output = torch.empty_like(inp.x)
    _, _, recv_hook = buf.low_latency_combine(y, inp.topk_idx, inp.topk_weights, handle, async_finish=False,
                                              zero_copy=False, return_recv_hook=do_recv_hook, out=output)
    check((recv_hook is not None) == do_recv_hook, 'vLLM LL combine: a hook returned iff return_recv_hook')
    return output, recv_hook


def vllm_ll(ctx, mgr, mode, zero=False, finalize_async=True, offset=4):
    M = ctx.env['VLLM_MOE_DP_CHUNK_SIZE']
    inp = ctx.ll_inputs(offset, zero=zero)
    out = vllm_ll_prepare(mgr.buffer, inp, M, mode)
    out[4]()                            # modular kernel _prepare without DBO: hook(), then the receiver
    ctx.check_ll_dispatch(inp, out, mode, M, f'{ctx.what} dispatch')
    output, hook = vllm_ll_finalize(mgr.buffer, inp, out[2], llp.combine_input(inp, out, mode, M), finalize_async)
    if hook is not None:
        hook()
    check_equal(output.cpu(), llp.combine_expected(inp, mode), f'{ctx.what} combine: combined_x')


def vllm_ll_dbo(ctx, mgr, mode=FP8):
    """DBO: a hook is registered for the other micro-batch and run by its next dbo_maybe_run_recv_hook; a yield
    makes the other micro-batch's stream wait for this one's. Order: D0, hook D0, D1, hook D1, C0, hook C0, C1,
    hook C1 (D1 in flight while D0's results are in use)."""
    M = ctx.env['VLLM_MOE_DP_CHUNK_SIZE']
    inps = [ctx.ll_inputs(5), ctx.ll_inputs(6)]
    main, s = torch.cuda.current_stream(), [torch.cuda.Stream(), torch.cuda.Stream()]
    for st in s:
        st.wait_stream(main)
    with torch.cuda.stream(s[0]):       # ub0 _prepare: send D0, register its hook, yield
        d0 = vllm_ll_prepare(mgr.buffer, inps[0], M, mode)
    s[1].wait_stream(s[0])
    with torch.cuda.stream(s[1]):       # ub1 _prepare: D0's hook, send D1, yield
        d0[4]()
        d1 = vllm_ll_prepare(mgr.buffer, inps[1], M, mode)
    s[0].wait_stream(s[1])
    with torch.cuda.stream(s[0]):       # ub0: receiver, experts, _finalize: D1's hook, send C0, yield
        y0 = llp.combine_input(inps[0], d0, mode, M)
        d1[4]()
        o0, h0 = vllm_ll_finalize(mgr.buffer, inps[0], d0[2], y0, True)
    s[1].wait_stream(s[0])
    with torch.cuda.stream(s[1]):       # ub1: receiver, experts, _finalize: C0's hook, send C1, yield
        y1 = llp.combine_input(inps[1], d1, mode, M)
        h0()
        o1, h1 = vllm_ll_finalize(mgr.buffer, inps[1], d1[2], y1, True)
    s[0].wait_stream(s[1])
    with torch.cuda.stream(s[0]):       # ub0's next _prepare: C1's hook
        h1()
    main.wait_stream(s[0])
    torch.cuda.synchronize()
    for u, (inp, d, o) in enumerate(((inps[0], d0, o0), (inps[1], d1, o1))):
        ctx.check_ll_dispatch(inp, d, mode, M, f'{ctx.what} micro-batch {u} dispatch')
        check_equal(o.cpu(), llp.combine_expected(inp, mode), f'{ctx.what} micro-batch {u} combine: combined_x')


def ll_cuda_graph(ctx, M: int, mode, step: Callable) -> None:
    """Decode under CUDA graphs, as both frameworks capture it: `step(inputs)` (dispatch, its hook, the experts, the
    combine, its hook) warmed up on a side stream, captured once, replayed on new inputs copied into the captured
    tensors. `step` returns `(dispatch outputs, combined_x)`."""
    first = ctx.ll_inputs(20)
    static = SimpleNamespace(x=first.x.clone(), topk_idx=first.topk_idx.clone(),
                             topk_weights=first.topk_weights.clone(), E=first.E, shapes=first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    ctx.group.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, combined = step(static)
    for offset in (21, 22):
        inp = ctx.ll_inputs(offset)
        for name in ('x', 'topk_idx', 'topk_weights'):
            getattr(static, name).copy_(getattr(inp, name))
        graph.replay()
        torch.cuda.synchronize()
        ctx.check_ll_dispatch(inp, out, mode, M, f'{ctx.what} replay {offset} dispatch')
        check_equal(combined.cpu(), llp.combine_expected(inp, mode), f'{ctx.what} replay {offset} combine: combined_x')
        ctx.group.barrier()


def vllm_ll_cuda_graph(ctx, mgr, mode=FP8):
    M = ctx.env['VLLM_MOE_DP_CHUNK_SIZE']

    def step(inp):
        out = vllm_ll_prepare(mgr.buffer, inp, M, mode)
        out[4]()
        output, hook = vllm_ll_finalize(mgr.buffer, inp, out[2], llp.combine_input(inp.shapes, out, mode, M), True)
        hook()
        return out, output
    ll_cuda_graph(ctx, M, mode, step)


def vllm_ll_fault_tolerance(ctx, mgr, mode=FP8):
    """--enable-fault-tolerance: a buffer with enable_shrink; query_active_mask, a round, clean_buffers (the local
    RDMA buffer zeroed, the masks cleaned), another round. Across domains the masks are this rank's own and no rank
    is masked automatically (v1/kernels/internode_ll.py), which no case relies on: the replayed calls are the same."""
    mask = torch.zeros(ctx.R, device='cuda', dtype=torch.int32)
    mgr.buffer.low_latency_query_mask_buffer(mask)
    check(mask.tolist() == [0] * ctx.R, f'{ctx.what}: no rank masked at the start, got {mask.tolist()}')
    vllm_ll(ctx, mgr, mode)
    local = mgr.buffer.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True)
    local.zero_()
    torch.cuda.synchronize()
    mgr.buffer.low_latency_clean_mask_buffer()
    torch.cuda.synchronize()
    vllm_ll(ctx, mgr, mode, offset=7)
    mgr.buffer.low_latency_query_mask_buffer(mask)
    check(mask.tolist() == [0] * ctx.R, f'{ctx.what}: no rank masked after clean_buffers, got {mask.tolist()}')
    if ctx.D > 1:       # (no low-latency memory of its own there: the composed path keeps no signal between calls)
        return f'clean_buffers zeroed a {local.numel()}-byte local RDMA view; masks local, no automatic shrink'
    return None


# ---- SGLang -------------------------------------------------------------------------------------------------------
class SGLangBuffer:
    """DeepEPBuffer (SGLang's class-level singleton): the buffer of one server's --deepep-mode, its dispatch-mode flag
    and clean_buffer at each normal -> low-latency switch. Never destroyed by SGLang; `close` drops it."""

    def __init__(self, ctx, mode: str, param_bytes: int = 1):
        self.ctx, self.dispatch_mode, self.cleans = ctx, None, 0
        self.M = ctx.env['SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK']
        self.sizes = sglang_buffer_sizes(ctx.Buffer, ctx.torch_group.size(), ctx.H, param_bytes, mode, self.M, ctx.E)
        self.buffer = ctx.Buffer(ctx.torch_group, self.sizes.num_nvl_bytes, self.sizes.num_rdma_bytes,
                                 low_latency_mode=self.sizes.low_latency_mode,
                                 num_qps_per_rank=self.sizes.num_qps_per_rank, allow_mnnvl=True)

    def normal(self):
        self.dispatch_mode = 'normal'
        return self.buffer

    def low_latency(self):
        if self.dispatch_mode == 'normal' and self.buffer.low_latency_mode:
            self.buffer.clean_low_latency_buffer(self.M, self.ctx.H, self.ctx.E)
            self.cleans += 1
        self.dispatch_mode = 'low_latency'
        return self.buffer

    def close(self) -> None:
        torch.cuda.synchronize()
        self.ctx.group.barrier()
        self.buffer = None
        gc.collect()
        self.ctx.group.barrier()


class SGLangNormal:
    """_DeepEPDispatcherImplNormal (async_finish=True from create_moe_dispatcher; False is the class default)."""

    def __init__(self, ctx, state: SGLangBuffer, async_finish: bool = True):
        self.ctx, self.state, self.async_finish, self.handle = ctx, state, async_finish, None

    def dispatch_a(self, x, topk_ids, topk_weights):
        return x, topk_ids.to(torch.int64), topk_weights, (self.ctx.Buffer.capture() if self.async_finish else None)

    def dispatch_b(self, x, topk_ids, topk_weights, previous_event):
        buffer = self.state.normal()
        per_rank, per_rdma, per_expert, in_rank, previous_event = buffer.get_dispatch_layout(
            topk_ids, self.ctx.E, previous_event=previous_event, async_finish=self.async_finish,
            allocate_on_comm_stream=previous_event is not None)
        out = buffer.dispatch(x, topk_idx=topk_ids, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
                              num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert, previous_event=previous_event,
                              async_finish=self.async_finish,
                              allocate_on_comm_stream=(previous_event is not None) and self.async_finish,
                              expert_alignment=SGLANG_EXPERT_ALIGNMENT, config=None)
        self.handle = out[4]
        if self.async_finish:
            out[5].current_stream_wait()
        return out, (per_rank, per_rdma, per_expert, in_rank)

    def combine_a(self, y):
        return y, (self.ctx.Buffer.capture() if self.async_finish else None)

    def combine_b(self, y, previous_event):
        combined_x, _, event = self.state.normal().combine(
            y, self.handle, async_finish=self.async_finish, previous_event=previous_event,
            allocate_on_comm_stream=previous_event is not None, config=None)
        if self.async_finish:
            event.current_stream_wait()
        self.handle = None
        return combined_x


class SGLangLowLatency:
    """_DeepEPDispatcherImplLowLatency (return_recv_hook=True from create_moe_dispatcher)."""

    def __init__(self, ctx, state: SGLangBuffer, mode, return_recv_hook: bool = True):
        self.ctx, self.state, self.mode, self.hook, self.handle = ctx, state, mode, return_recv_hook, None

    def dispatch_a(self, x, topk_ids):
        buffer = self.state.low_latency()
        opts = dict(round_scale=self.mode[2], use_ue8m0=self.mode[2]) if self.mode[0] else {}
        out = buffer.low_latency_dispatch(x, topk_ids.to(torch.int64), self.state.M, self.ctx.E, use_fp8=self.mode[0],
                                          async_finish=not self.hook, return_recv_hook=self.hook, **opts)
        self.handle = out[2]
        return out

    def dispatch_b(self, out) -> None:
        out[4]() if self.hook else out[3].current_stream_wait()

    def combine_a(self, y, topk_ids, topk_weights):
        out = self.state.low_latency().low_latency_combine(x=y, topk_idx=topk_ids, topk_weights=topk_weights,
                                                           handle=self.handle, async_finish=not self.hook,
                                                           return_recv_hook=self.hook)
        self.handle = None
        return out

    def combine_b(self, combined, event, hook):
        hook() if self.hook else event.current_stream_wait()
        return combined


def sglang_normal_round(ctx, disp: SGLangNormal, case: Case, kind: str, what: str) -> None:
    out, layout = disp.dispatch_b(*disp.dispatch_a(normal_input(case, kind), case.topk_idx, case.topk_weights))
    check_normal(case, kind, out, layout, SGLANG_EXPERT_ALIGNMENT, ctx.Buffer.num_sms, what)
    check_combined(case, kind, disp.combine_b(*disp.combine_a(normal_experts(ctx, out))), what)


def sglang_ll_round(ctx, disp: SGLangLowLatency, inp, what: str) -> None:
    out = disp.dispatch_a(inp.x, inp.topk_idx)
    disp.dispatch_b(out)
    ctx.check_ll_dispatch(inp, out, disp.mode, disp.state.M, f'{what} dispatch')
    y = llp.combine_input(inp, out, disp.mode, disp.state.M)
    combined = disp.combine_b(*disp.combine_a(y, inp.topk_idx, inp.topk_weights))
    check_equal(combined.cpu(), llp.combine_expected(inp, disp.mode), f'{what} combine: combined_x')


def sglang_normal(ctx, state, kind='fp8', zero=False, async_finish=True):
    sglang_normal_round(ctx, SGLangNormal(ctx, state, async_finish), ctx.case(7, zero=zero), kind, ctx.what)


def sglang_normal_tbo(ctx, state, kind='fp8'):
    """Prefill TBO (delta_stages 0): dispatch_a A, dispatch_a B, dispatch_b + experts + combine_a A, the same for B,
    combine_b A, combine_b B: two dispatchers (two handles) on the one buffer."""
    a, b = SGLangNormal(ctx, state), SGLangNormal(ctx, state)
    ca, cb = ctx.case(8), ctx.case(9)
    sa = a.dispatch_a(normal_input(ca, kind), ca.topk_idx, ca.topk_weights)
    sb = b.dispatch_a(normal_input(cb, kind), cb.topk_idx, cb.topk_weights)
    oa, ia = a.dispatch_b(*sa)
    ya = a.combine_a(normal_experts(ctx, oa))
    ob, ib = b.dispatch_b(*sb)
    yb = b.combine_a(normal_experts(ctx, ob))
    ra, rb = a.combine_b(*ya), b.combine_b(*yb)
    for tag, c, o, i, r in (('A', ca, oa, ia, ra), ('B', cb, ob, ib, rb)):
        check_normal(c, kind, o, i, SGLANG_EXPERT_ALIGNMENT, ctx.Buffer.num_sms, f'{ctx.what} sub-batch {tag}')
        check_combined(c, kind, r, f'{ctx.what} sub-batch {tag}')


def normal_mode(buffer):
    """The V1 Buffer's normal mode: `NormalMode` inside one domain, `InternodeMode` across domains (both count their
    growths in `num_growths`)."""
    return buffer._normal if buffer._normal is not None else buffer._internode


def sglang_prefill_growth(ctx, state, kind='fp8'):
    n = ctx.args.num_prefill_tokens or prefill_tokens(ctx.Buffer, ctx.R)
    expect = grows(state.sizes.num_nvl_bytes, ctx.R, n, ctx.H, ctx.K, ctx.D, state.sizes.num_rdma_bytes)
    before = normal_mode(state.buffer).num_growths
    sglang_normal_round(ctx, SGLangNormal(ctx, state), ctx.case(10, num_tokens=n), kind, ctx.what)
    grown = normal_mode(state.buffer).num_growths - before
    check(grown > 0 or not expect, f'{ctx.what}: {n} tokens per rank exceed the buffer\'s slots, yet it did not grow')
    return f'{n} tokens per rank, buffer grown {grown} time(s)'


def sglang_ll(ctx, state, mode, zero=False):
    sglang_ll_round(ctx, SGLangLowLatency(ctx, state, mode), ctx.ll_inputs(11, zero=zero), ctx.what)


def sglang_ll_cuda_graph(ctx, state, mode=FP8):
    disp = SGLangLowLatency(ctx, state, mode)

    def step(inp):
        out = disp.dispatch_a(inp.x, inp.topk_idx)
        disp.dispatch_b(out)
        y = llp.combine_input(inp.shapes, out, mode, state.M)
        return out, disp.combine_b(*disp.combine_a(y, inp.topk_idx, inp.topk_weights))
    ll_cuda_graph(ctx, state.M, mode, step)


def sglang_auto(ctx, state):
    """--deepep-mode auto: one buffer; decode (low latency) and prefill (normal) alternate as is_extend_in_batch
    does, clean_low_latency_buffer at each normal -> low-latency switch."""
    normal, low = SGLangNormal(ctx, state), SGLangLowLatency(ctx, state, FP8)
    for step, phase in enumerate(('decode', 'prefill', 'decode', 'decode', 'prefill', 'decode')):
        what = f'{ctx.what} step {step} ({phase})'
        if phase == 'prefill':
            sglang_normal_round(ctx, normal, ctx.case(12 + step), 'fp8', what)
        else:
            sglang_ll_round(ctx, low, ctx.ll_inputs(12 + step), what)
    check(state.cleans == 2, f'{ctx.what}: {state.cleans} clean_low_latency_buffer calls, expected 2')


# ---- the case list ------------------------------------------------------------------------------------------------
class ReplayCase(NamedTuple):
    name: str
    block: str              # the buffer (one framework configuration) it runs on
    what: str
    run: Callable
    default: bool = True


# Block -> its buffer's owner (built collectively when a selected case needs it), in the order the blocks run.
BLOCKS = {'vllm_ht': lambda ctx: VllmManager(ctx, False), 'vllm_ll': lambda ctx: VllmManager(ctx, True),
          'vllm_ll_ft': lambda ctx: VllmManager(ctx, True, fault_tolerance=True),
          'sglang_normal': lambda ctx: SGLangBuffer(ctx, 'normal'),
          'sglang_ll': lambda ctx: SGLangBuffer(ctx, 'low_latency'),
          'sglang_auto': lambda ctx: SGLangBuffer(ctx, 'auto')}
_C = ReplayCase
CASES = (
    _C('vllm_ht_bf16', 'vllm_ht', 'vLLM HT, BF16, prepare_async + finalize_async', lambda c, m: vllm_ht(c, m, 'bf16')),
    _C('vllm_ht_fp8', 'vllm_ht', 'vLLM HT, block FP8', lambda c, m: vllm_ht(c, m, 'fp8')),
    _C('vllm_ht_sync_finalize', 'vllm_ht', 'vLLM HT, prepare + finalize (synchronous combine)',
       lambda c, m: vllm_ht(c, m, 'fp8', finalize_async=False)),
    _C('vllm_ht_dbo', 'vllm_ht', 'vLLM HT under dual-batch overlap (two micro-batches)', vllm_ht_dbo),
    _C('vllm_ht_idle_ranks', 'vllm_ht', 'vLLM HT, odd ranks with an empty DP chunk',
       lambda c, m: vllm_ht(c, m, 'bf16', zero=True)),
    _C('vllm_ll_bf16', 'vllm_ll', 'vLLM LL, BF16, recv hooks', lambda c, m: vllm_ll(c, m, BF16)),
    _C('vllm_ll_fp8', 'vllm_ll', 'vLLM LL, FP8 dispatch', lambda c, m: vllm_ll(c, m, FP8)),
    _C('vllm_ll_fp8_ue8m0', 'vllm_ll', 'vLLM LL, FP8 with packed UE8M0 scales',
       lambda c, m: vllm_ll(c, m, FP8_UE8M0)),
    _C('vllm_ll_sync_finalize', 'vllm_ll', 'vLLM LL, finalize without a recv hook',
       lambda c, m: vllm_ll(c, m, FP8, finalize_async=False)),
    _C('vllm_ll_dbo', 'vllm_ll', 'vLLM LL under dual-batch overlap (hooks across micro-batches)', vllm_ll_dbo),
    _C('vllm_ll_idle_ranks', 'vllm_ll', 'vLLM LL, odd ranks with 0 tokens', lambda c, m: vllm_ll(c, m, FP8, zero=True)),
    _C('vllm_ll_cuda_graph', 'vllm_ll', 'vLLM LL decode captured in a CUDA graph, replayed', vllm_ll_cuda_graph),
    _C('vllm_ll_fault_tolerance', 'vllm_ll_ft', 'vLLM LL with --enable-fault-tolerance (masks, clean_buffers)',
       vllm_ll_fault_tolerance),
    _C('sglang_normal_fp8', 'sglang_normal', 'SGLang normal, FP8 (Hopper scales)', sglang_normal),
    _C('sglang_normal_ue8m0', 'sglang_normal', 'SGLang normal, FP8 UE8M0 (column-major TMA-aligned scales)',
       lambda c, s: sglang_normal(c, s, 'ue8m0')),
    _C('sglang_normal_tbo', 'sglang_normal', 'SGLang normal under two-batch overlap (prefill)', sglang_normal_tbo),
    _C('sglang_normal_idle_ranks', 'sglang_normal', 'SGLang normal, odd ranks idle (0 tokens)',
       lambda c, s: sglang_normal(c, s, zero=True)),
    _C('sglang_normal_prefill_growth', 'sglang_normal', 'SGLang normal, a prefill above the FP8-sized buffer',
       sglang_prefill_growth),
    _C('sglang_normal_sync', 'sglang_normal', 'SGLang normal with async_finish=False (the class default)',
       lambda c, s: sglang_normal(c, s, async_finish=False)),
    _C('sglang_ll_fp8', 'sglang_ll', 'SGLang low_latency, FP8, recv hooks', lambda c, s: sglang_ll(c, s, FP8)),
    _C('sglang_ll_ue8m0', 'sglang_ll', 'SGLang low_latency, FP8 UE8M0 (DeepGEMM on Blackwell)',
       lambda c, s: sglang_ll(c, s, FP8_UE8M0)),
    _C('sglang_ll_bf16', 'sglang_ll', 'SGLang low_latency, BF16 dispatch', lambda c, s: sglang_ll(c, s, BF16)),
    _C('sglang_ll_idle_ranks', 'sglang_ll', 'SGLang low_latency, odd ranks idle',
       lambda c, s: sglang_ll(c, s, FP8, zero=True)),
    _C('sglang_ll_cuda_graph', 'sglang_ll', 'SGLang low_latency decode captured in a CUDA graph, replayed',
       sglang_ll_cuda_graph),
    _C('sglang_auto', 'sglang_auto', 'SGLang auto: one buffer, decode and prefill alternating', sglang_auto),
)


def skip_reasons(cases, hidden: int, num_prefill_tokens: int, num_ranks: int, num_domains: int = 1) -> Dict[str, str]:
    """`{case name: why this run leaves it out}` for `cases` (ReplayCase) on `num_ranks` ranks in `num_domains`
    scale-up domains: vLLM's low-latency cases off its hidden sizes (vLLM refuses them), and the prefill case when its
    `num_prefill_tokens` per rank exceed what a V1 Buffer of this topology ever holds (`serving_replay.token_limit`).
    Every other sequence runs across domains too: the V1 Buffer serves each call there (v1/internode.py,
    v1/internode_ll.py); what differs (low-latency masks local to a rank, no automatic shrink: v1/kernels/
    internode_ll.py) no replayed sequence exercises."""
    out = {}
    limit = token_limit(num_ranks, num_domains)
    where = f'{num_domains} scale-up domains of {num_ranks // num_domains}' if num_domains > 1 else \
        f'{num_ranks} ranks in one domain'
    for c in cases:
        if c.block.startswith('vllm_ll') and hidden not in VLLM_LL_HIDDEN_SIZES:
            out[c.name] = f'hidden {hidden} is not in vLLM\'s low-latency list {VLLM_LL_HIDDEN_SIZES}'
        elif c.name == 'sglang_normal_prefill_growth' and num_prefill_tokens > limit:
            out[c.name] = (f'{num_prefill_tokens} tokens per rank: a V1 Buffer of {where} holds at most {limit} '
                           f'per rank')
    return out


def select_cases(text: str):
    """The cases named in `text` (comma-separated; 'all': every default case), in the list's order."""
    names = [n.strip() for n in text.split(',') if n.strip()]
    known = {c.name for c in CASES}
    unknown = [n for n in names if n not in known and n != 'all']
    if unknown:
        raise ValueError(f'unknown case(s) {unknown}; known: {", ".join(sorted(known))}')
    return [c for c in CASES if c.name in names or ('all' in names and c.default)]
