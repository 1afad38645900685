"""Megatron-Core's MoE layer, unmodified, on `deep_ep` = deepep_cupy: the flex token dispatcher with its DeepEP
backend against the same layer with the all-to-all dispatcher, forward and backward, several training steps.

    mpirun -np 2 python -m deepep_cupy.tests.megatron_moe        # EP=2 (both ranks may share one GPU)
    python -m deepep_cupy.tests.megatron_moe                     # EP=1 (Megatron's fused_a2a functions alone)

Needs `megatron-core` (0.19.x: torch, numpy and packaging; no Transformer Engine, no Apex: the local spec). At EP > 1
two `MoELayer`s are built from the local spec, one with `moe_token_dispatcher_type='alltoall'`, one with `'flex'` and
`moe_flex_dispatcher_backend='deepep'` (which imports `deep_ep.Buffer` in `fused_a2a.py` and calls
`get_dispatch_layout`, `dispatch`, cached `dispatch` and `combine` asynchronously on the communication stream), the
second loading the first's weights. Each step runs both on the same input and output gradient, compares the output,
the input gradient and every parameter gradient, then applies the same SGD step to both. Cases: top-1 dropless
(bitwise: every sum has one term), top-k dropless and top-k with token dropping (capacity factor 1; the two
dispatchers sum an expert's k contributions in another order, so BF16 rounding may differ: each tensor within
`TOLERANCE`, and the bitwise share is printed). `--api v2` runs the same cases through Megatron main's DeepEP V2
calls on `ElasticBuffer` (`tests/megatron_v2.py`).

Megatron's flex/DeepEP dispatcher asserts TP x EP > 1, so at EP=1 the program drives fused_a2a's `fused_dispatch`
and `fused_combine` (Megatron's autograd functions, unmodified) around a per-token function and checks outputs and
gradients bitwise against the same function applied without them.

Ranks sharing a GPU get NCCL for Megatron's process groups through per-rank `NCCL_HOSTID`s
(`deepep_cupy.utils.envs.emulate_nccl_host`); deep_ep's buffer itself runs over CUDA IPC inside the GPU.
"""

import os
import sys
import time

from ..runtime import preflight
from . import cli

TOLERANCE = 'calc_diff <= 1e-5 and |a - b| <= 2**-6 * max|a| per tensor (two BF16 ulps of its largest element)'


try:
    import torch
except ImportError as e:
    preflight.exit_if_main(e, __name__, cli.megatron_moe_parser)
    raise


def log(*args) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(*args, flush=True)


class Failure(AssertionError):
    pass


def compare(name: str, a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """True when bitwise equal; raises when `exact` is asked and they differ, or when outside TOLERANCE."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise Failure(f'{name}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}')
    if torch.equal(a, b):
        return True
    fa, fb = a.double(), b.double()
    d = (fa - fb).abs()
    first = tuple(int(i) for i in (d > 0).nonzero()[0])
    where = f'first difference at {first}: all-to-all {fa[first].item()!r}, flex/deep_ep {fb[first].item()!r}'
    if exact:
        raise Failure(f'{name}: not bitwise equal; {where}')
    denom = (fa * fa + fb * fb).sum().item()
    diff = 0.0 if denom == 0 else 1 - 2 * (fa * fb).sum().item() / denom
    bound = 2 ** -6 * max(fa.abs().max().item(), fb.abs().max().item())
    if diff > 1e-5 or d.max().item() > bound:
        raise Failure(f'{name}: calc_diff {diff:.3g}, max |diff| {d.max().item():.3g} > {bound:.3g}; {where}')
    return False


def shared_gpu_setup() -> str:
    """Per-rank NCCL hosts when this job's ranks outnumber the GPUs (before torch.distributed starts NCCL)."""
    from ..runtime.launcher import detect_launch
    from ..utils import envs as utils_envs
    launch = detect_launch()
    size, rank = max(launch.size, 1), max(launch.rank, 0)
    if size > 1 and torch.cuda.device_count() < size and not utils_envs.nccl_hosts_emulated():
        utils_envs.emulate_nccl_host(f'megatron_rank{rank}')
        return f'{size} ranks on {torch.cuda.device_count()} GPU(s): NCCL_HOSTID per rank, sockets over lo'
    return f'{size} ranks on {torch.cuda.device_count()} GPU(s)'


def make_config(ep: int, dispatcher: str, topk: int, capacity, args):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(
        num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn_hidden, moe_ffn_hidden_size=args.ffn_hidden,
        num_attention_heads=4, num_moe_experts=args.num_experts, moe_router_topk=topk,
        moe_token_dispatcher_type=dispatcher, moe_flex_dispatcher_backend='deepep', moe_router_dtype='fp32',
        moe_router_load_balancing_type='none', moe_expert_capacity_factor=capacity, moe_router_pre_softmax=topk == 1,
        expert_model_parallel_size=ep, tensor_model_parallel_size=1, use_cpu_initialization=True,
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)


def build_layer(config):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    return get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)(
        config=config).cuda()


def run_layer_case(name: str, ep: int, topk: int, capacity, exact: bool, args) -> str:
    """Both dispatchers on the same weights, inputs and output gradients, `args.num_steps` SGD steps."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(args.seed)
    ref = build_layer(make_config(ep, 'alltoall', topk, capacity, args))
    flex = build_layer(make_config(ep, 'flex', topk, capacity, args))
    flex.load_state_dict(ref.state_dict(), strict=True)
    params = [(n, p, dict(flex.named_parameters())[n]) for n, p in ref.named_parameters()]
    num_equal = num_tensors = 0
    gen = torch.Generator(device='cuda').manual_seed(args.seed * 7919 + rank)
    for step in range(args.num_steps):
        x = torch.randn((args.num_tokens, 1, args.hidden), device='cuda', generator=gen).to(torch.bfloat16)
        dy = torch.randn((args.num_tokens, 1, args.hidden), device='cuda', generator=gen).to(torch.bfloat16)
        outs = []
        for layer in (ref, flex):
            xi = x.clone().requires_grad_(True)
            layer.zero_grad(set_to_none=True)
            y, _ = layer(xi)
            y.backward(dy)
            outs.append((y.detach(), xi.grad))
        tensors = [('output', outs[0][0], outs[1][0]), ('input grad', outs[0][1], outs[1][1])]
        tensors += [(f'grad {n}', p.grad, q.grad) for n, p, q in params if p.grad is not None or q.grad is not None]
        for what, a, b in tensors:
            if a is None or b is None:
                raise Failure(f'{name} step {step} rank {rank}: {what} is None on one side')
            num_equal += compare(f'{name} step {step} rank {rank}: {what}', a, b, exact)
            num_tensors += 1
        with torch.no_grad():
            for _, p, q in params:
                p -= args.lr * p.grad
                q -= args.lr * q.grad
    torch.cuda.synchronize()
    counts = torch.tensor([num_equal, num_tensors], device='cuda')
    torch.distributed.all_reduce(counts)
    within = '' if exact else ', all within tolerance'
    return (f'[case] {name}: {args.num_steps} steps, output, input grad and {len(params)} parameter grads: '
            f'{counts[0].item()}/{counts[1].item()} tensors bitwise equal{within}')


def run_ep1(args) -> str:
    """EP=1: fused_a2a's dispatch and combine around g(x) = x * (1 + sum_k w_k c_{e_k}), bitwise against g alone."""
    from megatron.core.transformer.moe import fused_a2a
    group = torch.distributed.group.WORLD
    gen = torch.Generator(device='cuda').manual_seed(args.seed)
    n, h, e, k = args.num_tokens, args.hidden, args.num_experts, args.num_topk
    scale = torch.rand(e, device='cuda', generator=gen)
    for step in range(args.num_steps):
        x = torch.randn((n, h), device='cuda', generator=gen).to(torch.bfloat16)
        idx = torch.topk(torch.rand((n, e), device='cuda', generator=gen), k, dim=-1).indices
        idx[torch.rand((n, k), device='cuda', generator=gen) < 0.2] = -1    # dropped slots, as Megatron masks them
        w = torch.rand((n, k), device='cuda', generator=gen)
        dy = torch.randn((n, h), device='cuda', generator=gen).to(torch.bfloat16)

        def g(rows, ids, probs):
            coef = (probs * torch.where(ids >= 0, scale[ids.clamp(min=0)], 0)).sum(-1, keepdim=True)
            return (rows.float() * (1 + coef)).to(torch.bfloat16)

        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        yr = g(xr, idx, wr)
        yr.backward(dy)
        xf, wf = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        recv_x, recv_idx, recv_w, counts, handle = fused_a2a.fused_dispatch(xf, idx, wf, e, group, True, True)
        yf, _ = fused_a2a.fused_combine(g(recv_x, recv_idx, recv_w), group, handle, True, True)
        yf.backward(dy)
        received = (idx >= 0).any(-1)
        expect_counts = torch.bincount(idx[idx >= 0], minlength=e).cpu()
        if not torch.equal(counts.cpu().long(), expect_counts):
            raise Failure(f'EP=1 step {step}: tokens per expert {counts.tolist()} != {expect_counts.tolist()}')
        compare(f'EP=1 step {step}: received rows', recv_x, x[received], True)
        compare(f'EP=1 step {step}: output', yf[received], yr[received], True)
        compare(f'EP=1 step {step}: input grad', xf.grad[received], xr.grad[received], True)
        compare(f'EP=1 step {step}: probs grad', wf.grad[received], wr.grad[received], True)
    torch.cuda.synchronize()
    return (f'[case] EP=1 fused_dispatch/fused_combine (async, comm stream): {args.num_steps} steps, received rows, '
            f'counts, output, input and probs grads bitwise equal')


def main() -> int:
    args = cli.megatron_moe_parser().parse_args()
    setup = shared_gpu_setup()
    import deepep_cupy
    deepep_cupy.install_as_deep_ep()
    from ..utils.envs import init_dist
    rank, num_ranks, _ = init_dist()
    try:
        import megatron.core
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.moe import fused_a2a
    except ImportError as e:
        raise preflight.SetupError(f'megatron-core is not installed ({e}): pip install "megatron-core==0.19.*" '
                                   '(it needs torch, numpy and packaging)') from None
    ok, t0 = True, time.perf_counter()
    log(f'[init] megatron-core {megatron.core.__version__}, torch {torch.__version__}, {setup}; backend '
        f'{torch.distributed.get_backend()}; deep_ep is deepep_cupy: {fused_a2a.Buffer.__module__}')
    try:
        if num_ranks == 1:
            log(run_ep1(args))
        else:
            ep = num_ranks
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                                     expert_model_parallel_size=ep)
            model_parallel_cuda_manual_seed(args.seed)
            apis = ('v1', 'v2') if args.api == 'both' else (args.api,)
            for api in apis:
                if api == 'v2':
                    from . import megatron_v2
                    megatron_v2.install()
                    os.environ.setdefault(megatron_v2.MAX_TOKENS_ENV, str(args.num_tokens))
                    os.environ.setdefault(megatron_v2.HIDDEN_ENV, str(args.hidden))
                    os.environ.setdefault(megatron_v2.NUM_TOPK_ENV, str(max(args.num_topk, 1)))
                cases = (('top-1 dropless', 1, None, True), (f'top-{args.num_topk} dropless', args.num_topk, None,
                                                             False),
                         (f'top-{args.num_topk} capacity 1.0 (token dropping)', args.num_topk, 1.0, False))
                for name, topk, capacity, exact in cases:
                    log(run_layer_case(f'EP={ep} {api} {name}', ep, topk, capacity, exact, args))
                if api == 'v2':
                    from . import megatron_v2
                    log(f'[v2] ElasticBuffer built {megatron_v2.State.num_builds} time(s) for every case (Megatron '
                        f'rebuilds when buffer.group != group); set_num_sms({megatron_v2.State.num_sms_set})')
                    if megatron_v2.State.num_builds != 1:
                        raise Failure(f'ElasticBuffer built {megatron_v2.State.num_builds} times, expected once')
                    megatron_v2.release()
            log(f'[tolerance] cases not marked bitwise: {TOLERANCE}')
    except Failure as e:
        print(f'[rank {rank}] FAILED: {e}', flush=True)
        ok = False
    torch.cuda.synchronize()
    flag = torch.tensor([0 if ok else 1], device='cuda')
    torch.distributed.all_reduce(flag)
    ok = flag.item() == 0
    log(f'megatron MoE test ({time.perf_counter() - t0:.1f} s): ' + ('PASSED' if ok else 'FAILED'))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
