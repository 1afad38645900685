"""vLLM's and SGLang's normal-mode call sequences of `deepep_cupy.tests.serving_replay` (the very functions of
serving_replay_cases.py) on DeepEP V1's `Buffer` across scale-up domains, without a GPU: the Buffer of
tests/legacy_internode_host_path_prog.py (2 domains x 2 ranks, this rank 1; the real V1 adapter, hybrid and
intranode engines' Python; kernels that pack their arguments, CPU torch tensors, a fake rail transport), imported
first (it runs its own checks), with `get_dispatch_layout` answered on the host (`HostLayout`: its kernel's fake
computes nothing). Every sequence must run through and hand back V1's internode shapes: vLLM HT prepare / finalize
(BF16 and block FP8, async or not, DBO's previous event alone), SGLang normal (FP8 with Hopper scales and with
DeepGEMM's UE8M0 column-major TMA-aligned scales, async_finish True and False, two-batch overlap: two handles
outstanding), a rank with 0 tokens. The fake kernels move no data, so nothing is compared bit for bit here (the GPU
run of serving_replay does that). tests/test_serving_replay_cpu.py runs this file in a subprocess (the fakes patch
modules process-wide). Prints `OK` at the end."""
import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, 'tests'), os.path.join(ROOT, 'perf')]
import legacy_internode_host_path_prog as base  # noqa: E402  (its checks run first, then its Buffer serves here)
import torch  # noqa: E402

from deepep_cupy.runtime.event import EventOverlap  # noqa: E402
from deepep_cupy.tests import legacy_reference as ref  # noqa: E402
from deepep_cupy.tests import serving_replay as sr  # noqa: E402
from deepep_cupy.tests import serving_replay_cases as sc  # noqa: E402
from deepep_cupy.v1.buffer import Buffer  # noqa: E402
from deepep_cupy.v1.internode import InternodeHandle  # noqa: E402

buf, N, S, R, H, K, E = base.buf, base.N, base.S, base.R, base.H, base.K, base.E
assert buf.num_domains == N > 1


class HostLayout:
    """`Buffer._layout` answering `get_dispatch_layout` from `legacy_reference.layout` (num_tokens_per_rdma_rank:
    tokens per destination domain); logs each call's event arguments."""

    def __init__(self):
        self.calls = []

    def run(self, order, topk_idx, num_experts, num_ranks, device, previous_event, async_finish,
            allocate_on_comm_stream):
        self.calls.append((previous_event, async_finish, allocate_on_comm_stream))
        per_rank, per_expert, in_rank = ref.layout(topk_idx, num_experts, num_ranks)
        per_domain = in_rank.view(-1, N, S).any(2).sum(0).to(torch.int32)
        event = Buffer.capture() if async_finish else EventOverlap(None)
        return per_rank, per_domain, per_expert, in_rank, event


layout = buf._layout = HostLayout()
ctx = SimpleNamespace(Buffer=Buffer, E=E, H=H, R=R, D=N, rank=base.RANK, what='[host path]')


def make_case(T: int, seed: int):
    """What serving_replay's inputs hand the sequences (x, its FP8 casts, top-k ids and weights)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand(T, E, generator=g), K).indices if T else torch.zeros((0, K), dtype=torch.int64)
    sf = torch.rand(T, H // 128, generator=g) + 0.5
    packed = torch.full((T, -(-H // 512)), 0x7F7F7F7F, dtype=torch.int32)       # UE8M0 exponents of 1.0
    q = x.to(torch.float8_e4m3fn)
    return SimpleNamespace(x=x, topk_idx=idx, topk_weights=torch.rand(T, K, generator=g), E=E,
                           inputs={'fp8': (q, sf), 'ue8m0': (q, packed)})


def check_dispatch(out, lay, case, what):
    """V1's internode outputs: rows, top-k, counts, the 10-element handle holding the layout's is_token_in_rank."""
    recv_x, recv_idx, recv_w, counts, handle, _ = out
    rows = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape[0]
    assert isinstance(handle, InternodeHandle) and len(handle) == 10, what
    assert handle[0] is lay[3] and tuple(lay[1].shape) == (N,), what
    assert tuple(recv_idx.shape) == tuple(recv_w.shape) == (rows, K) and isinstance(counts, list), what
    assert tuple(handle[8].shape) == (case.x.shape[0], N), what
    return rows


# ---- vLLM HT: DeepEPHTPrepareAndFinalize (prepare_async / finalize_async, synchronous finalize, DBO) ---------------
d_cfg, c_cfg = sr.vllm_configs(Buffer, R)
VLLM_MODES = [(kind, dbo, do_async) for kind in ('bf16', 'fp8')       # DBO: finalize_async, events off
              for dbo, do_async in ((False, True), (False, False), (True, True))]
for i, (kind, dbo, do_async) in enumerate(VLLM_MODES):
    case = make_case(12, seed=i)
    prev = Buffer.capture() if dbo else None        # dbo_get_previous_event(buffer.capture)
    layout.calls.clear()
    out, lay = sc.vllm_ht_dispatch(buf, case, kind, d_cfg, prev, dbo=dbo)
    what = f'vLLM HT {kind} dbo={dbo} async={do_async}'
    assert layout.calls == [(prev, False, False)], (what, layout.calls)
    assert (out[5].event is None) == dbo, what     # async_finish = not dbo_enabled()
    sc.vllm_ht_receiver(ctx, out)
    rows = check_dispatch(out, lay, case, what)
    output = torch.empty_like(case.x)
    y = torch.zeros(rows, H, dtype=torch.bfloat16)
    sc.vllm_ht_finalize(buf, out[4], y, c_cfg, output, do_async, Buffer.capture() if dbo else None, dbo=dbo)
    print(what, rows, 'rows: OK')

# ---- SGLang normal: _DeepEPDispatcherImplNormal (async_finish True from create_moe_dispatcher, False the default) ---
state = SimpleNamespace(normal=lambda: buf)
for kind in ('fp8', 'ue8m0'):
    for async_finish in (True, False):
        case = make_case(12, seed=7)
        disp = sc.SGLangNormal(ctx, state, async_finish)
        layout.calls.clear()
        out, lay = disp.dispatch_b(*disp.dispatch_a(sc.normal_input(case, kind), case.topk_idx, case.topk_weights))
        what = f'SGLang normal {kind} async_finish={async_finish}'
        assert [(p is not None, a, c) for p, a, c in layout.calls] == [(async_finish, async_finish, async_finish)]
        rows = check_dispatch(out, lay, case, what)
        if kind == 'ue8m0':
            assert sc.normal_input(case, kind)[1].stride() == (1, 12), what      # TMA-aligned column-major
        combined = disp.combine_b(*disp.combine_a(torch.zeros(rows, H, dtype=torch.bfloat16)))
        assert tuple(combined.shape) == (12, H) and disp.handle is None, what
        print(what, rows, 'rows: OK')

# SGLang prefill two-batch overlap: dispatch_a A, dispatch_a B, dispatch_b A, combine_a A, dispatch_b B, combine_a B,
# combine_b A, combine_b B (two handles outstanding on the one buffer)
a, b = sc.SGLangNormal(ctx, state), sc.SGLangNormal(ctx, state)
ca, cb = make_case(12, seed=8), make_case(9, seed=9)
sa = a.dispatch_a(sc.normal_input(ca, 'fp8'), ca.topk_idx, ca.topk_weights)
sb = b.dispatch_a(sc.normal_input(cb, 'fp8'), cb.topk_idx, cb.topk_weights)
oa, la = a.dispatch_b(*sa)
ya = a.combine_a(torch.zeros(check_dispatch(oa, la, ca, 'TBO A'), H, dtype=torch.bfloat16))
ob, lb = b.dispatch_b(*sb)
yb = b.combine_a(torch.zeros(check_dispatch(ob, lb, cb, 'TBO B'), H, dtype=torch.bfloat16))
assert oa[4] is not ob[4] and tuple(a.combine_b(*ya).shape) == (12, H) and tuple(b.combine_b(*yb).shape) == (9, H)
print('SGLang normal two-batch overlap: OK')

# A rank with 0 tokens (vLLM's idle DP rank, SGLang's idle rank), both frameworks' sequences
empty = make_case(0, seed=10)
out, lay = sc.vllm_ht_dispatch(buf, empty, 'bf16', d_cfg)
sc.vllm_ht_finalize(buf, out[4], torch.zeros(check_dispatch(out, lay, empty, 'vLLM 0 tokens'), H,
                                             dtype=torch.bfloat16), c_cfg, torch.empty_like(empty.x), True)
disp = sc.SGLangNormal(ctx, state)
out, lay = disp.dispatch_b(*disp.dispatch_a(sc.normal_input(empty, 'fp8'), empty.topk_idx, empty.topk_weights))
rows = check_dispatch(out, lay, empty, 'SGLang 0 tokens')
assert tuple(disp.combine_b(*disp.combine_a(torch.zeros(rows, H, dtype=torch.bfloat16))).shape) == (0, H)
print('0-token rank: OK')
print('OK')
