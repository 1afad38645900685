"""vLLM's and SGLang's DeepEP V1 backends replayed call for call on `deep_ep` = deepep_cupy, every output
compared bit for bit with host references built from host-gathered inputs (`legacy_reference`, `ll_reference`).

    launch/run_local.sh N python -m deepep_cupy.tests.serving_replay [--num-tokens 128 --num-ll-tokens 32
        --hidden 2048 --num-topk 8 --num-experts 64 --seeds 0 --cases all]

Runs on 1 rank and on 2 or 4 ranks sharing one GPU inside one scale-up domain, and across several (DeepEP's
internode mode: 2x1, 2x2, 4x1, 2x4 domains x ranks; on one GPU the domains come from `DEEPEP_CUPY_SCALEUP_SIZE`, the
ranks per domain, with `DEEPEP_CUPY_RAIL_TRANSPORT=loopback` or `nccl`), e.g. 2 domains x 2 ranks:

    DEEPEP_CUPY_SCALEUP_SIZE=2 DEEPEP_CUPY_RAIL_TRANSPORT=loopback CUDA_VISIBLE_DEVICES=0 \\
        launch/run_local.sh 4 python3 -m deepep_cupy.tests.serving_replay

`deep_ep` is imported as the frameworks import it, after `deepep_cupy.install_as_deep_ep()`. Buffers get the
arguments the frameworks pass, sized their way from their own environment variables (`framework_env`); several
domains stand for several nodes (vLLM's `internode`: not every rank on rank 0's node). The experts are a stand-in
(expert e scales its rows by 2^(e % 4 - 2); normal mode then weights and sums each token's local slots, as vLLM's
TopKWeightAndReduceContiguous does); events, hooks and streams follow the framework code. One `[case]` line per
replayed sequence (`OK`, or `SKIP` and why: `serving_replay_cases.skip_reasons`), `PASS` on rank 0 at the end.

Across domains every case is checked against the internode references, as the internode rank programs check: normal
mode by `legacy_internode.check_dispatch` (rows in V1's receive order, counts, every element of the 10-element handle
against `internode_reference`) and a two-level combine reference (`expected_combine`: per domain, then the domains'
partials, `legacy_reference.domain_orders`); the layout's `num_tokens_per_rdma_rank` too; low-latency mode by
`legacy_low_latency_internode.check_dispatch` (the single-domain layouts and numerics, without the single-domain
engine's internal row routes).

Replayed, per framework (file @ commit read; `~`: a stored excerpt whose commit the index did not report), with
the functions whose deep_ep calls are re-enacted (`serving_replay_cases.py`; README draft: /tmp/readme_serving.md):

- vLLM `vllm/distributed/device_communicators/all2all.py` @0014300: DeepEP{HT,LL}All2AllManager._make_all2all_kwargs
  (HT internode branch: `num_rdma_bytes` = the NVLink bytes, `num_qps_per_rank` = the manager's num_sms // 2, unless
  VLLM_DEEPEP_HIGH_THROUGHPUT_FORCE_INTRA_NODE; LL: one branch), get_handle (`Buffer(**kwargs)`,
  `get_low_latency_rdma_size_hint`), set_num_sms, DeepEPAll2AllManagerBase.destroy.
- vLLM `fused_moe/prepare_finalize/deepep_ht.py` @055e47c: _do_dispatch, _receiver, _finalize (`capture`,
  `get_dispatch_layout`, `dispatch`, `combine(topk_weights=None)`, `event.event` / `current_stream_wait`).
- vLLM `fused_moe/prepare_finalize/deepep_ll.py` @055e47c: prepare_async, _receiver, _finalize
  (`low_latency_dispatch(..., return_recv_hook=True)`, the hook, `low_latency_combine(..., out=)`).
- vLLM `fused_moe/modular_kernel.py` @003d383 (_prepare, _finalize: hooks under DBO), `fused_moe/all2all_utils.py`
  @02bd2a4 (maybe_make_prepare_finalize: use_fp8_dispatch, max tokens), `v1/worker/ubatching.py` ~
  (dbo_get_previous_event), `fused_moe/topk_weight_and_reduce.py` ~ (TopKWeightAndReduceContiguous).
- SGLang `srt/layers/moe/token_dispatcher/deepep.py` @003a81b: DeepEPBuffer.get_deepep_buffer / clean_buffer /
  set_dispatch_mode_*, DeepEPConfig, _DeepEPDispatcherImplNormal and _DeepEPDispatcherImplLowLatency (dispatch_a/b,
  combine_a/b), DeepEPDispatcher (auto: normal for extend batches, low latency for decode). get_deepep_buffer has no
  internode branch: its sizes follow `group.size()` alone (`Config.get_rdma_buffer_size_hint` is 0 up to 8 ranks, as
  DeepEP's, so normal mode across 2-8 ranks gets `num_rdma_bytes` 0: no bound on the rail memory).
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
from .legacy_internode import check_dispatch as check_dispatch_across
from .legacy_intranode import Case, check_dispatch
from .legacy_low_latency_internode import check_dispatch as check_ll_dispatch_across

VLLM_RANK_CONFIGS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)     # deepep_ht.py: available_rank_configs
VLLM_LL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)    # deepep_ll.py: SUPPORTED_HIDDEN_SIZES
VLLM_MANAGER_NUM_SMS = 20           # DeepEPAll2AllManagerBase.num_sms: set_num_sms never goes above it
SGLANG_EXPERT_ALIGNMENT = 128       # _dispatch_core with DeepGEMM (SGLang's normal-mode combine_a requires DeepGEMM)
# The frameworks' own knobs (vllm/envs.py, sglang/srt/environ.py), not deepep_cupy settings: the replay mirrors them.
ENV_DEFAULTS = {'VLLM_DEEPEP_BUFFER_SIZE_MB': 1024, 'VLLM_MOE_DP_CHUNK_SIZE': 256,
                'VLLM_DEEPEP_LOW_LATENCY_USE_MNNVL': 0, 'VLLM_DEEPEP_HIGH_THROUGHPUT_FORCE_INTRA_NODE': 0,
                'VLLM_DBO_COMM_SMS': 20, 'SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK': 128}
BF16, FP8, FP8_UE8M0 = (False, False, False), (True, False, False), (True, True, True)   # LL (use_fp8, round, ue8m0)


# ---- host-side logic (CPU-tested) ----------------------------------------------------------------------------------
def framework_env(environ=None) -> Dict[str, int]:
    """The frameworks' environment variables the replay sizes by, as integers (the MNNVL and force-intra-node flags
    0/1), with their defaults; ValueError naming a variable that is not an integer."""
    environ = os.environ if environ is None else environ
    out = {}
    for name, default in ENV_DEFAULTS.items():
        text = environ.get(name, '').strip()
        try:
            out[name] = int(text) if text else default
        except ValueError:
            raise ValueError(f'{name}={text!r}: expected an integer (the framework\'s default is {default})') from None
    return out


def vllm_ht_buffer_kwargs(cpu_group, env, internode: bool = False) -> dict:
    """DeepEPHTAll2AllManager._make_all2all_kwargs. internode (the manager's `internode`: ranks on several nodes, here
    several scale-up domains), unless VLLM_DEEPEP_HIGH_THROUGHPUT_FORCE_INTRA_NODE: RDMA bytes as many as the NVLink
    ones, `num_sms // 2` QPs (the manager's num_sms, 20: set_num_sms never changes it); else no RDMA bytes, one QP."""
    num_nvl_bytes = env['VLLM_DEEPEP_BUFFER_SIZE_MB'] * 1024 * 1024
    if internode and not env['VLLM_DEEPEP_HIGH_THROUGHPUT_FORCE_INTRA_NODE']:
        num_rdma_bytes, num_qps_per_rank = num_nvl_bytes, VLLM_MANAGER_NUM_SMS // 2
    else:
        num_rdma_bytes, num_qps_per_rank = 0, 1
    return dict(group=cpu_group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes, low_latency_mode=False,
                num_qps_per_rank=num_qps_per_rank, explicitly_destroy=True)


def vllm_ll_buffer_kwargs(cpu_group, Buffer, env, hidden: int, num_ranks: int, num_experts: int,
                          fault_tolerance: bool = False) -> dict:
    """DeepEPLLAll2AllManager._make_all2all_kwargs, inside a node and across nodes alike (max tokens =
    FusedMoEConfig.max_num_tokens = VLLM_MOE_DP_CHUNK_SIZE; fault_tolerance: ParallelConfig.enable_fault_tolerance)."""
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
    """DeepEPBuffer.get_deepep_buffer's arguments (inside a node and across nodes alike: by `num_ranks` only). mode:
    'normal' | 'low_latency' | 'auto'; param_bytes: 1 for FP8 dispatch, 2 for BF16; configs: DeepEPConfig's
    (normal_dispatch, normal_combine) from --deepep-config, or None."""
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


def grows(num_nvl_bytes: int, num_ranks: int, num_tokens: int, hidden: int, num_topk: int, num_domains: int = 1,
          num_rdma_bytes: int = 0) -> bool:
    """Whether a dispatch of `num_tokens` per rank needs more slots than a V1 Buffer of `num_nvl_bytes` (and, across
    `num_domains` scale-up domains, `num_rdma_bytes`) lays out at its first dispatch (deepep_cupy's sizing:
    `v1/normal.py`, across domains `v1/internode.py` `internode_tokens`)."""
    if num_domains > 1:
        from ..v1.internode import internode_tokens
        return num_tokens > internode_tokens(num_domains, num_ranks // num_domains, num_nvl_bytes, num_rdma_bytes,
                                             hidden, num_topk)
    from ..buffers.base import BUFFER_ALIGNMENT
    from ..runtime.sizes import align
    from ..v1.normal import fit_tokens
    return num_tokens > fit_tokens(num_ranks, align(num_nvl_bytes, BUFFER_ALIGNMENT), hidden, max(num_topk, num_ranks))


def token_limit(num_ranks: int, num_domains: int = 1) -> int:
    """The most tokens per rank a V1 Buffer ever holds (`v1/normal.py` `max_tokens`; across domains
    `v1/internode.py` `token_limit`: the intranode engine holds every domain's rows)."""
    if num_domains > 1:
        from ..v1.internode import token_limit as across
        return across(num_domains, num_ranks // num_domains)
    from ..v1.normal import max_tokens
    return max_tokens(num_ranks)


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
                     num_ranks: int, num_domains: int = 1) -> torch.Tensor:
    """`combined_x` of one rank's tokens: each destination rank d's `expert_rows` of them (its local slots), summed in
    FP32 in the order the V1 combine sums ranks (of their last top-k slot: `legacy_reference.dest_orders`), rounded
    once. Across `num_domains` scale-up domains V1's two levels (`legacy_reference.domain_orders`): per destination
    domain the FP32 sum of its ranks' rows in that order, rounded to bfloat16 (at its forwarder), then the FP32 sum of
    those partials in order of each domain's last top-k slot, rounded once. base: `[N, H]` float32 (the rank's own
    rows); topk_idx: `[N, K]`; weights: `[N, K]` float32."""
    L, n = num_experts // num_ranks, topk_idx.shape[0]
    own = ref.owners(topk_idx, num_experts, num_ranks)
    rows = torch.stack([expert_rows(base, torch.where(own == d, topk_idx - d * L, -1), weights, d, L)
                        for d in range(num_ranks)])
    acc = torch.zeros(base.shape, dtype=torch.float32)
    if num_domains == 1:
        by_last, _ = ref.dest_orders(topk_idx, num_experts, num_ranks)
        for i in range(num_ranks):
            d = by_last[:, i]
            acc = torch.where((d >= 0).unsqueeze(1), acc + rows[d.clamp(min=0), torch.arange(n)].float(), acc)
        return acc.to(torch.bfloat16)
    by_last, _ = ref.domain_orders(topk_idx, num_experts, num_ranks, num_domains)
    for i in range(num_domains):
        part = torch.zeros_like(acc)
        for j in range(num_ranks // num_domains):
            d = by_last[:, i, j]
            part = torch.where((d >= 0).unsqueeze(1), part + rows[d.clamp(min=0), torch.arange(n)].float(), part)
        acc = torch.where((by_last[:, i, 0] >= 0).unsqueeze(1), acc + part.to(torch.bfloat16).float(), acc)
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


class DomainCase(Case):
    """The replay's inputs (`legacy_intranode.Case`: ranks with 0 tokens, any token count) across `num_domains`
    scale-up domains, with what `legacy_internode.check_dispatch` reads besides: `D`, `S`, `ref(kind)`,
    `handle_ref(num_channels)` (`internode_reference.reference_internode`), and `layout` (the 4 tensors of the
    framework's `get_dispatch_layout`, set by `check_normal`: the handle must hold its is_token_in_rank)."""

    def __init__(self, group, num_domains: int, *args, **kwargs):
        super().__init__(group, *args, **kwargs)
        self.D, self.S = num_domains, self.R // num_domains
        self._handles = {}

    def ref(self, kind: str, with_topk: bool = True) -> ref.DispatchRef:
        return super().ref(kind, with_topk)

    def handle_ref(self, num_channels: int):
        if num_channels not in self._handles:
            from ..v1.kernels.internode_reference import reference_internode
            self._handles[num_channels] = reference_internode([t.numpy() for t in self.topks], self.E, self.D,
                                                              num_channels)[self.rank]
        return self._handles[num_channels]


def check_layout(case: Case, layout, num_channels: int, what: str) -> None:
    """The framework's `get_dispatch_layout` outputs `(num_tokens_per_rank, num_tokens_per_rdma_rank,
    num_tokens_per_expert, is_token_in_rank)` against `legacy_reference.layout`; num_tokens_per_rdma_rank: None inside
    one domain, across domains `reference_internode`'s."""
    per_rank, per_rdma, per_expert, in_rank = layout
    want_rank, want_expert, want_in = ref.layout(case.topks[case.rank], case.E, case.R)
    check_equal(in_rank.cpu(), want_in, f'{what} get_dispatch_layout: is_token_in_rank')
    check_equal(per_rank.cpu(), want_rank, f'{what} get_dispatch_layout: num_tokens_per_rank')
    check_equal(per_expert.cpu(), want_expert, f'{what} get_dispatch_layout: num_tokens_per_expert')
    if isinstance(case, DomainCase):
        want_rdma = torch.from_numpy(case.handle_ref(num_channels).num_tokens_per_rdma_rank)
        check(per_rdma is not None, f'{what} get_dispatch_layout: num_tokens_per_rdma_rank is None across domains')
        check_equal(per_rdma.cpu(), want_rdma, f'{what} get_dispatch_layout: num_tokens_per_rdma_rank')
    else:
        check(per_rdma is None, f'{what} get_dispatch_layout: num_tokens_per_rdma_rank must be None in one domain')


def check_normal(case, kind, out, layout, alignment, num_sms, what):
    """A normal-mode dispatch's layout, outputs and handle (C = num_sms // 2 channels): inside one domain
    `legacy_intranode.check_dispatch` (V1's 6-element handle), across domains `legacy_internode.check_dispatch`
    (the 10-element internode handle)."""
    check_layout(case, layout, num_sms // 2, what)
    if isinstance(case, DomainCase):
        case.layout = layout
        check_dispatch_across(case, out, kind, alignment, num_sms // 2, f'{what} dispatch')
    else:
        check_dispatch(case, out, kind, True, alignment, num_sms // 2, f'{what} dispatch', is_token_in_rank=layout[3])


def normal_experts(ctx, out) -> torch.Tensor:
    return expert_rows(base_of(out[0]), out[1], out[2], ctx.rank, ctx.E // ctx.R)


def check_combined(case: Case, kind: str, combined: torch.Tensor, what: str) -> None:
    host = case.xs[case.rank] if kind == 'bf16' else (case.host[kind][0][case.rank], case.host[kind][1][case.rank])
    want = expected_combine(base_of(host), case.topks[case.rank], case.ws[case.rank], case.E, case.R,
                            getattr(case, 'D', 1))
    check_equal(combined.cpu(), want, f'{what} combine: combined_x')


class Context:
    """What every case needs: groups, deep_ep's classes, sizes, the topology (`D` scale-up domains of `S` ranks), the
    framework environment, the current seed; the inputs and the checks of that topology."""

    def __init__(self, args, group, torch_group, cpu_group, Buffer, env, num_domains: int = 1):
        self.args, self.group, self.torch_group, self.cpu_group, self.Buffer, self.env = (
            args, group, torch_group, cpu_group, Buffer, env)
        self.rank, self.R = group.rank, group.size
        self.D, self.S = num_domains, group.size // num_domains
        self.H, self.K, self.E = args.hidden, args.num_topk, args.num_experts
        self.seed, self.what = 0, ''

    def _zero(self, zero):
        return ({r for r in range(self.R) if r % 2 == 1} or {0}) if zero else set()

    def case(self, offset: int, zero=False, num_tokens=None) -> Case:
        """Normal-mode inputs; across domains a `DomainCase` (its checks are the internode programs')."""
        dims = (num_tokens or self.args.num_tokens, self.H, self.K, self.E, self.seed * 100 + offset)
        if self.D > 1:
            return DomainCase(self.group, self.D, *dims, zero_ranks=self._zero(zero))
        return Case(self.group, *dims, zero_ranks=self._zero(zero))

    def ll_inputs(self, offset: int, zero=False):
        n = 0 if self.rank in self._zero(zero) else max(0, self.args.num_ll_tokens - self.rank)
        return llp.Inputs(self.group, self.rank, self.R, n, self.H, self.K, self.E, self.seed * 100 + offset)

    def check_ll_dispatch(self, inp, out, mode, M: int, what: str) -> None:
        """A low-latency dispatch against `ll_reference` (no rank masked): inside one domain
        `legacy_low_latency.check_dispatch` (with the engine's row routes), across domains
        `legacy_low_latency_internode.check_dispatch` (the same layouts, no row routes: that engine has none)."""
        (check_ll_dispatch_across if self.D > 1 else llp.check_dispatch)(inp, out, mode, M, (), what)

    def check_buffer(self, buffer) -> None:
        """A buffer the replay built sees the topology the replay checks against."""
        got = (buffer.num_domains, buffer.num_scaleup_ranks)
        check(got == (self.D, self.S), f'{self.what}: the Buffer runs {got[0]} domains x {got[1]} ranks, the replay '
                                       f'expected {self.D} x {self.S} (get_logical_domain_size)')


def main(argv=None) -> int:
    from .serving_replay_cases import BLOCKS, select_cases, skip_reasons
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

    from .. import envs
    from ..runtime.group import get_group
    from ..utils.envs import init_dist
    rank, R, torch_group = init_dist(seed=0)
    group = get_group()
    cpu_group = torch.distributed.new_group(backend='gloo')     # vLLM's GroupCoordinator.cpu_group
    # The domains every Buffer of the replay runs (a host collective; the Buffer's own rule, allow_hybrid_mode=True)
    D, S = deep_ep.get_logical_domain_size(group)
    if args.num_experts % R:
        args.num_experts = R * max(1, args.num_experts // R)
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    limit = min(env['VLLM_MOE_DP_CHUNK_SIZE'], env['SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK'])
    if args.num_ll_tokens > limit:
        raise SystemExit(f'--num-ll-tokens {args.num_ll_tokens} is above the frameworks\' low-latency maximum {limit}')
    from ..v1 import buffer as legacy
    check(Buffer is legacy.Buffer and Config is legacy.Config and deep_ep.EventOverlap is deepep_cupy.EventOverlap,
          'deep_ep must be deepep_cupy, with the V1 names vLLM\'s annotations evaluate (Buffer, Config, EventOverlap)')
    where = (f'{D} scale-up domains x {S} ranks (internode mode; rails {envs.rail_transport()})' if D > 1 else
             'one scale-up domain')
    log(f'[init] {R} ranks in {where}; deep_ep = deepep_cupy; groups: torch '
        f'{torch.distributed.get_backend(torch_group)}, vLLM cpu_group gloo; hidden {args.hidden}, '
        f'top-{args.num_topk}, {args.num_experts} experts; tokens {args.num_tokens} normal / {args.num_ll_tokens} '
        f'low-latency (rank r: minus r); env {env}')
    ctx = Context(args, group, torch_group, cpu_group, Buffer, env, num_domains=D)
    skip = skip_reasons(selected, args.hidden, args.num_prefill_tokens or prefill_tokens(Buffer, R), R, D)
    for c in selected:
        if c.name in skip:
            log(f'[case] {c.name}: {c.what} ... SKIP {skip[c.name]}')

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

    def build(make):
        holder = make(ctx)
        ctx.check_buffer(holder.buffer)
        return holder

    ok, count = True, 0
    for seed in [int(s) for s in args.seeds.split(',') if s.strip()]:
        ctx.seed = seed
        for block, make in BLOCKS.items():
            cases = [c for c in selected if c.block == block and c.name not in skip]
            if not cases or not ok:
                continue
            ctx.what = f'[{block} seed {seed}]'
            ok, holder = attempt(f'{cases[0].name} (building the {block} buffer)', build, make)
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
    topo = f'{D} x {S}'
    skipped = f', {len(skip)} case(s) skipped' if skip else ''
    log(f'serving replay ({topo}): PASS ({count} sequences{skipped})' if ok else f'serving replay ({topo}): FAIL')
    return 0 if ok else 1


if __name__ == '__main__':
    # Run the package's module, not this __main__ copy: serving_replay_cases imports its helpers from the former.
    from deepep_cupy.tests import serving_replay
    sys.exit(preflight.run(serving_replay.main))
