"""vLLM's and SGLang's DeepEP V1 backends replayed call for call on `deep_ep` = deepep_cupy, every output
compared bit for bit with host references built from host-gathered inputs (`legacy_reference`, `ll_reference`).

    launch/run_local.sh N python -m deepep_cupy.tests.serving_replay [--num-tokens 128 --num-ll-tokens 32
        --hidden 2048 --num-topk 8 --num-experts 64 --seeds 0 --cases all]

Runs on 1 rank and on 2 or 4 ranks sharing one GPU. `deep_ep` is imported as the frameworks import it, after
`deepep_cupy.install_as_deep_ep()`. Buffers get the arguments the frameworks pass, sized their way from their own
environment variables (`framework_env`). The experts are a stand-in (expert e scales its rows by 2^(e % 4 - 2); normal
mode then weights and sums each token's local slots, as vLLM's TopKWeightAndReduceContiguous does); events, hooks and
streams follow the framework code. One `[case]` line per replayed sequence, `PASS` on rank 0 at the end.

Replayed, per framework (file @ commit read; `~`: a stored excerpt whose commit the index did not report), with
the functions whose deep_ep calls are re-enacted (`serving_replay_cases.py`; README draft: /tmp/readme_serving.md):

- vLLM `vllm/distributed/device_communicators/all2all.py` @0014300: DeepEP{HT,LL}All2AllManager._make_all2all_kwargs,
  get_handle (`Buffer(**kwargs)`, `get_low_latency_rdma_size_hint`), set_num_sms, DeepEPAll2AllManagerBase.destroy.
- vLLM `fused_moe/prepare_finalize/deepep_ht.py` @055e47c: _do_dispatch, _receiver, _finalize (`capture`,
  `get_dispatch_layout`, `dispatch`, `combine(topk_weights=None)`, `event.event` / `current_stream_wait`).
- vLLM `fused_moe/prepare_finalize/deepep_ll.py` @055e47c: prepare_async, _receiver, _finalize
  (`low_latency_dispatch(..., return_recv_hook=True)`, the hook, `low_latency_combine(..., out=)`).
- vLLM `fused_moe/modular_kernel.py` @003d383 (_prepare, _finalize: hooks under DBO), `fused_moe/all2all_utils.py`
  @02bd2a4 (maybe_make_prepare_finalize: use_fp8_dispatch, max tokens), `v1/worker/ubatching.py` ~
  (dbo_get_previous_event), `fused_moe/topk_weight_and_reduce.py` ~ (TopKWeightAndReduceContiguous).
- SGLang `srt/layers/moe/token_dispatcher/deepep.py` @003a81b: DeepEPBuffer.get_deepep_buffer / clean_buffer /
  set_dispatch_mode_*, DeepEPConfig, _DeepEPDispatcherImplNormal and _DeepEPDispatcherImplLowLatency (dispatch_a/b,
  combine_a/b), DeepEPDispatcher (auto: normal for extend batches, low latency for decode).
- SGLang `fused_moe_triton/layer.py` ~ create_moe_dispatcher (async_finish=True, return_recv_hook=True),
  `batch_overlap/operations_strategy.py` ~ (TBO stages), `srt/environ.py` ~ (the max-tokens default).
"""

import os
import sys
import time
import traceback
from typing import Dict, NamedTuple

from ..runtime import preflight
from . import cli

try:
    import torch
except ImportError as e:  # `--help` works without torch; a run names the extra that brings it
    preflight.exit_if_main(e, __name__, cli.serving_replay_parser)
    raise

from . import legacy_low_latency as llp
from . import legacy_reference as ref
from . import ll_reference as llref
from .common import Failure, check, check_equal
from .legacy_intranode import Case, check_dispatch

VLLM_RANK_CONFIGS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)     # deepep_ht.py: available_rank_configs
VLLM_LL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)    # deepep_ll.py: SUPPORTED_HIDDEN_SIZES
VLLM_MANAGER_NUM_SMS = 20           # DeepEPAll2AllManagerBase.num_sms: set_num_sms never goes above it
SGLANG_EXPERT_ALIGNMENT = 128       # _dispatch_core with DeepGEMM (SGLang's normal-mode combine_a requires DeepGEMM)
# The frameworks' own knobs (vllm/envs.py, sglang/srt/environ.py), not deepep_cupy settings: the replay mirrors them.
ENV_DEFAULTS = {'VLLM_DEEPEP_BUFFER_SIZE_MB': 1024, 'VLLM_MOE_DP_CHUNK_SIZE': 256,
                'VLLM_DEEPEP_LOW_LATENCY_USE_MNNVL': 0, 'VLLM_DBO_COMM_SMS': 20,
                'SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK': 128}
BF16, FP8, FP8_UE8M0 = (False, False, False), (True, False, False), (True, True, True)   # LL (use_fp8, round, ue8m0)


# ---- host-side logic (CPU-tested) ----------------------------------------------------------------------------------
def framework_env(environ=None) -> Dict[str, int]:
    """The frameworks' environment variables the replay sizes by, as integers (the MNNVL flag 0/1), with their
    defaults; ValueError naming a variable that is not an integer."""
    environ = os.environ if environ is None else environ
    out = {}
    for name, default in ENV_DEFAULTS.items():
        text = environ.get(name, '').strip()
        try:
            out[name] = int(text) if text else default
        except ValueError:
            raise ValueError(f'{name}={text!r}: expected an integer (the framework\'s default is {default})') from None
    return out


def vllm_ht_buffer_kwargs(cpu_group, env) -> dict:
    """DeepEPHTAll2AllManager._make_all2all_kwargs inside one node (not internode: no RDMA bytes, one QP)."""
    return dict(group=cpu_group, num_nvl_bytes=env['VLLM_DEEPEP_BUFFER_SIZE_MB'] * 1024 * 1024, num_rdma_bytes=0,
                low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)


def vllm_ll_buffer_kwargs(cpu_group, Buffer, env, hidden: int, num_ranks: int, num_experts: int,
                          fault_tolerance: bool = False) -> dict:
    """DeepEPLLAll2AllManager._make_all2all_kwargs (max tokens = FusedMoEConfig.max_num_tokens = VLLM_MOE_DP_CHUNK_SIZE;
    fault_tolerance: ParallelConfig.enable_fault_tolerance)."""
    rdma = Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=env['VLLM_MOE_DP_CHUNK_SIZE'],
                                                 hidden=hidden, num_ranks=num_ranks, num_experts=num_experts)
    return dict(group=cpu_group, num_nvl_bytes=env['VLLM_DEEPEP_BUFFER_SIZE_MB'] * 1024 * 1024, num_rdma_bytes=rdma,
                low_latency_mode=True, num_qps_per_rank=num_experts // num_ranks,
                allow_nvlink_for_low_latency_mode=True, allow_mnnvl=bool(env['VLLM_DEEPEP_LOW_LATENCY_USE_MNNVL']),
                explicitly_destroy=True, enable_shrink=bool(fault_tolerance))


def vllm_configs(Buffer, num_dispatchers: int):
    """DeepEPHTPrepareAndFinalize._get_dispatch_config / _get_combine_config: DeepEP's table, None off the list."""
    if num_dispatchers not in VLLM_RANK_CONFIGS:
        return None, None
    return Buffer.get_dispatch_config(num_dispatchers), Buffer.get_combine_config(num_dispatchers)


class SGLangSizes(NamedTuple):
    num_nvl_bytes: int
    num_rdma_bytes: int
    low_latency_mode: bool
    num_qps_per_rank: int


def sglang_buffer_sizes(Buffer, num_ranks: int, hidden: int, param_bytes: int, mode: str,
                        num_max_dispatch_tokens_per_rank: int, num_experts: int, configs=(None, None)) -> SGLangSizes:
    """DeepEPBuffer.get_deepep_buffer's arguments. mode: 'normal' | 'low_latency' | 'auto'; param_bytes: 1 for FP8
    dispatch, 2 for BF16; configs: DeepEPConfig's (normal_dispatch, normal_combine) from --deepep-config, or None."""
    nvl = rdma = 0
    if mode in ('normal', 'auto'):
        for config in (configs[0] or Buffer.get_dispatch_config(num_ranks),
                       configs[1] or Buffer.get_combine_config(num_ranks)):
            nvl = max(config.get_nvl_buffer_size_hint(hidden * param_bytes, num_ranks), nvl)
            rdma = max(config.get_rdma_buffer_size_hint(hidden * param_bytes, num_ranks), rdma)
    if mode in ('low_latency', 'auto'):
        rdma = max(Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                         num_experts), rdma)
    num_sms = configs[0].num_sms if configs[0] is not None else Buffer.num_sms       # DeepEPConfig.num_sms
    qps = {'normal': num_sms, 'low_latency': num_experts // num_ranks,
           'auto': max(num_sms, num_experts // num_ranks)}[mode]
    return SGLangSizes(nvl, rdma, mode != 'normal', qps)


def prefill_tokens(Buffer, num_ranks: int) -> int:
    """Tokens per rank of the prefill-growth case: what V1's rings hold in flight with DeepEP's default configs
    ((num_sms / 2) channels x num_max_nvl_chunked_recv_tokens), the count the size hints are for in BF16; SGLang
    sizes its FP8 buffer by `hidden * 1` bytes, half of it."""
    return max(c.num_sms // 2 * c.num_max_nvl_chunked_recv_tokens
               for c in (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)))


def grows(num_nvl_bytes: int, num_ranks: int, num_tokens: int, hidden: int, num_topk: int) -> bool:
    """Whether a dispatch of `num_tokens` per rank needs more slots than a V1 Buffer of `num_nvl_bytes` lays out
    (deepep_cupy's sizing, `v1/normal.py`)."""
    from ..buffers.base import BUFFER_ALIGNMENT
    from ..runtime.sizes import align
    from ..v1.normal import fit_tokens
    return num_tokens > fit_tokens(num_ranks, align(num_nvl_bytes, BUFFER_ALIGNMENT), hidden, max(num_topk, num_ranks))


def tma_aligned_col_major(sf: torch.Tensor) -> torch.Tensor:
    """`sf` `[N, P]` as SGLang's per-token-group quant returns it with DeepGEMM's UE8M0 scales: the same values,
    column-major with the token stride rounded up to 4 (strides `(1, align(N, 4))`)."""
    n, p = sf.shape
    store = torch.zeros((p, -(-n // 4) * 4), dtype=sf.dtype, device=sf.device)
    store[:, :n] = sf.t()
    return store.t()[:n]


def expert_rows(base: torch.Tensor, local_idx: torch.Tensor, weights: torch.Tensor, rank: int,
                num_local_experts: int) -> torch.Tensor:
    """The experts' stand-in in normal mode, weighted and summed over the local slots: `[rows, H]` bfloat16, for k
    ascending `acc += f32(bf16(bf16(base * 2^(e % 4 - 2)) * w_k))` where slot k is local (elementwise operations only,
    so the GPU and the host compute the same bits).

    Args:
        base: `[rows, H]` float32, the rows (FP8 ones dequantised); local_idx: `[rows, K]` local expert ids or -1;
        weights: `[rows, K]` float32; rank: the experts' rank.
    """
    acc = torch.zeros_like(base)
    for k in range(local_idx.shape[1]):
        e = local_idx[:, k]
        out = (base * llref.expert_factor(e.clamp(min=0) + rank * num_local_experts).unsqueeze(1)).to(torch.bfloat16)
        term = (out.float() * weights[:, k:k + 1]).to(torch.bfloat16).float()
        acc = torch.where((e >= 0).unsqueeze(1), acc + term, acc)
    return acc.to(torch.bfloat16)


def expected_combine(base: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor, num_experts: int,
                     num_ranks: int) -> torch.Tensor:
    """`combined_x` of one rank's tokens: each destination rank d's `expert_rows` of them (its local slots), summed in
    FP32 in the order the V1 combine sums ranks (of their last top-k slot: `legacy_reference.dest_orders`), rounded
    once. base: `[N, H]` float32 (the rank's own rows); topk_idx: `[N, K]`; weights: `[N, K]` float32."""
    L, n = num_experts // num_ranks, topk_idx.shape[0]
    own = ref.owners(topk_idx, num_experts, num_ranks)
    rows = torch.stack([expert_rows(base, torch.where(own == d, topk_idx - d * L, -1), weights, d, L)
                        for d in range(num_ranks)])
    by_last, _ = ref.dest_orders(topk_idx, num_experts, num_ranks)
    acc = torch.zeros(base.shape, dtype=torch.float32)
    for i in range(num_ranks):
        d = by_last[:, i]
        acc = torch.where((d >= 0).unsqueeze(1), acc + rows[d.clamp(min=0), torch.arange(n)].float(), acc)
    return acc.to(torch.bfloat16)


def base_of(x) -> torch.Tensor:
    """The float32 rows of a BF16 tensor or an `(x_fp8, scales)` pair (dequantised)."""
    return llref.dequantize(*x).float() if isinstance(x, tuple) else x.float()


# ---- what the frameworks pass and receive ---------------------------------------------------------------------------
def normal_input(case: Case, kind: str):
    """x as passed: 'bf16'; 'fp8' (vLLM block FP8, SGLang on Hopper: 128-channel float32 scales, row-major);
    'ue8m0' (SGLang with DeepGEMM's UE8M0: packed int32 scales, column-major and TMA-aligned)."""
    if kind == 'bf16':
        return case.x
    q, sf = case.inputs[kind]
    return (q, sf.contiguous()) if kind == 'fp8' else (q, tma_aligned_col_major(sf))


def check_normal(case, kind, out, in_rank, alignment, num_sms, what):
    check_dispatch(case, out, kind, True, alignment, num_sms // 2, f'{what} dispatch', is_token_in_rank=in_rank)


def normal_experts(ctx, out) -> torch.Tensor:
    return expert_rows(base_of(out[0]), out[1], out[2], ctx.rank, ctx.E // ctx.R)


def check_combined(case: Case, kind: str, combined: torch.Tensor, what: str) -> None:
    host = case.xs[case.rank] if kind == 'bf16' else (case.host[kind][0][case.rank], case.host[kind][1][case.rank])
    want = expected_combine(base_of(host), case.topks[case.rank], case.ws[case.rank], case.E, case.R)
    check_equal(combined.cpu(), want, f'{what} combine: combined_x')


class Context:
    """What every case needs: groups, deep_ep's classes, sizes, the framework environment, the current seed."""

    def __init__(self, args, group, torch_group, cpu_group, Buffer, env):
        self.args, self.group, self.torch_group, self.cpu_group, self.Buffer, self.env = (
            args, group, torch_group, cpu_group, Buffer, env)
        self.rank, self.R = group.rank, group.size
        self.H, self.K, self.E = args.hidden, args.num_topk, args.num_experts
        self.seed, self.what = 0, ''

    def _zero(self, zero):
        return ({r for r in range(self.R) if r % 2 == 1} or {0}) if zero else set()

    def case(self, offset: int, zero=False, num_tokens=None) -> Case:
        return Case(self.group, num_tokens or self.args.num_tokens, self.H, self.K, self.E,
                    self.seed * 100 + offset, zero_ranks=self._zero(zero))

    def ll_inputs(self, offset: int, zero=False):
        n = 0 if self.rank in self._zero(zero) else max(0, self.args.num_ll_tokens - self.rank)
        return llp.Inputs(self.group, self.rank, self.R, n, self.H, self.K, self.E, self.seed * 100 + offset)


def main(argv=None) -> int:
    from .serving_replay_cases import BLOCKS, select_cases
    parser = cli.serving_replay_parser()
    args = parser.parse_args(argv)
    try:
        selected = select_cases(args.cases)
    except ValueError as e:
        parser.error(str(e))
    env = framework_env()
    preflight.check_cuda()
    import deepep_cupy
    deepep_cupy.install_as_deep_ep()        # what sitecustomize / `python -m deepep_cupy.as_deep_ep` does
    import deep_ep
    from deep_ep import Buffer, Config

    from ..runtime.group import get_group
    from ..utils.envs import init_dist
    rank, R, torch_group = init_dist(seed=0)
    group = get_group()
    cpu_group = torch.distributed.new_group(backend='gloo')     # vLLM's GroupCoordinator.cpu_group
    if args.num_experts % R:
        args.num_experts = R * max(1, args.num_experts // R)
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    skip = set()
    if args.hidden not in VLLM_LL_HIDDEN_SIZES:
        skip |= {c.name for c in selected if c.block.startswith('vllm_ll')}
        log(f'[skip] vLLM LL cases: hidden {args.hidden} is not in vLLM\'s list {VLLM_LL_HIDDEN_SIZES}')
    limit = min(env['VLLM_MOE_DP_CHUNK_SIZE'], env['SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK'])
    if args.num_ll_tokens > limit:
        raise SystemExit(f'--num-ll-tokens {args.num_ll_tokens} is above the frameworks\' low-latency maximum {limit}')
    from ..v1 import buffer as legacy
    check(Buffer is legacy.Buffer and Config is legacy.Config and deep_ep.EventOverlap is deepep_cupy.EventOverlap,
          'deep_ep must be deepep_cupy, with the V1 names vLLM\'s annotations evaluate (Buffer, Config, EventOverlap)')
    log(f'[init] {R} ranks; deep_ep = deepep_cupy; groups: torch {torch.distributed.get_backend(torch_group)}, vLLM '
        f'cpu_group gloo; hidden {args.hidden}, top-{args.num_topk}, {args.num_experts} experts; tokens '
        f'{args.num_tokens} normal / {args.num_ll_tokens} low-latency (rank r: minus r); env {env}')
    ctx = Context(args, group, torch_group, cpu_group, Buffer, env)

    def attempt(name: str, fn, *fn_args):
        """`(ok, fn(*fn_args))` on every rank; ok when no rank failed (a failing rank prints its error, named)."""
        error = value = None
        try:
            value = fn(*fn_args)
            torch.cuda.synchronize()
        except Failure as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001  (named with its case, then every rank stops)
            traceback.print_exc()
            error = f'{type(e).__name__}: {e}'
        if error is not None:
            print(f'[rank {rank}] [case] {name} (seed {ctx.seed}) FAILED: {error}', flush=True)
        return not any(e is not None for e in group.allgather_object(error)), value

    ok, count = True, 0
    for seed in [int(s) for s in args.seeds.split(',') if s.strip()]:
        ctx.seed = seed
        for block, make in BLOCKS.items():
            cases = [c for c in selected if c.block == block and c.name not in skip]
            if not cases or not ok:
                continue
            ok, holder = attempt(f'{cases[0].name} (building the {block} buffer)', make, ctx)
            for c in cases if ok else ():
                ctx.what, t0 = f'[{c.name} seed {seed}]', time.perf_counter()
                ok, detail = attempt(c.name, c.run, ctx, holder)
                if not ok:
                    break
                count += 1
                log(f'[case] {c.name}: {c.what}{f" ({detail})" if detail else ""} ... OK '
                    f'({time.perf_counter() - t0:.1f} s)')
            if ok:
                ok, _ = attempt(f'{block} (teardown)', holder.close)
    log(f'serving replay: PASS ({count} sequences)' if ok else 'serving replay: FAIL')
    return 0 if ok else 1


if __name__ == '__main__':
    # Run the package's module, not this __main__ copy: serving_replay_cases imports its helpers from the former.
    from deepep_cupy.tests import serving_replay
    sys.exit(preflight.run(serving_replay.main))
