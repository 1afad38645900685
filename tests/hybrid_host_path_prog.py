"""The hybrid path on the real intranode engine's Python (plans, bound calls, handles) without a GPU:
perf/host_path_cpu.py's fakes under deepep_cupy (kernels that pack their arguments, CPU torch tensors), a fake rail
transport. Every dispatch mode (CPU sync or not, BF16 / FP8, expanded, cached) and combine (biases, weights), per-call
M and 0 tokens must run through; tests/test_hybrid_host_path_cpu.py runs this file in a subprocess (the fakes patch
modules process-wide)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, 'tests'), os.path.join(ROOT, 'perf')]
import fakes  # noqa: E402
import host_path_cpu as hp  # noqa: E402
import torch  # noqa: E402

hp.install()
from deepep_cupy.features.ep.feature import EP  # noqa: E402
from deepep_cupy.features.hybrid import feature as hf  # noqa: E402
from deepep_cupy.features.hybrid import kernels as hk  # noqa: E402
from deepep_cupy.runtime.rails import ScaleoutTransport, rail_topology  # noqa: E402

hk.load_kernels = hp.fake_load_kernels
N, R, M, H, K, E = 2, 2, 16, 256, 4, 32
rank = 1
buf = hp.make_buffer(N * R, rank, 1 << 30, num_scaleup_ranks=R, num_scaleout_ranks=N, scaleup_rank_idx=rank % R,
                     scaleout_rank_idx=rank // R, num_max_tokens_per_rank=M, hidden=H, num_topk=K)
buf.sym.local_idx = rank % R
buf.sym.num_peers = R


class Rails:
    def __init__(self):
        self.rails = rail_topology(N * R, R, rank)
        self.base, self.plans = 0x1000, []
        self.transport = ScaleoutTransport(self.rails, self.base)

    def exchange(self, plan, stream):
        self.plans.append(plan.phase)

    def barrier(self, stream):
        pass

    def release(self, collective):
        pass


host = fakes.FakeHostMapped()
# the report kernel's fake: counts 1 each way
rep = hk.report_spec().name
k = hp.fake_load_kernels([hk.report_spec()])[rep]


def hook(args):          # the report kernel: one token each way
    words = host.view('int32', 1 + 2 * N)
    words[1:] = 1
    words[0] = hf_seq[0]


hf_seq = [0]
orig = hf.HybridEP._notify


def notify(self, k, counts, stream, *v1):
    hf_seq[0] = (self._seq % 0x7FFFFFFF) + 1
    return orig(self, k, counts, stream, *v1)


hf.HybridEP._notify = notify
hp.DRIVER.on_launch[k.function.ptr] = hook
inner = EP(buf, N * M, H, K, True, True, 450.0)
feat = hf.HybridEP(buf, inner, M, H, K, rails=Rails(), host=host)
buf._ep = feat
g = torch.Generator().manual_seed(0)
T = 12
x = torch.randn(T, H, generator=g).to(torch.bfloat16)
idx = torch.topk(torch.rand(T, E, generator=g), K).indices
w = torch.rand(T, K, generator=g)
x8 = (x.to(torch.float8_e4m3fn), torch.ones(H // 128, T).t())
stats = torch.zeros(E // (N * R), dtype=torch.int32)
for sync in (True, False):
    for fp8 in (False, True):
        for expand in (False, True):
            out = buf.dispatch(x8 if fp8 else x, idx, w, num_experts=E, do_cpu_sync=sync, do_expand=expand,
                               expert_alignment=128 if expand else None, cumulative_local_expert_recv_stats=stats)
            h = out[3]
            rows = out[0][0].shape[0] if fp8 else out[0].shape[0]
            meta = h.recv_src_metadata
            print('dispatch', sync, fp8, expand, rows, tuple(meta.shape), h.psum_num_recv_tokens_per_scaleup_rank.shape,
                  h.num_recv_tokens, h.num_experts, h.num_max_tokens_per_rank, h.do_expand)
            cached = buf.dispatch(x, handle=h, topk_weights=w)
            y = torch.zeros(rows, H, dtype=torch.bfloat16)
            ww = out[2]
            cx, cw, ev = buf.combine(y, h, topk_weights=ww, bias=(x, x))
            print('  combine', tuple(cx.shape), None if cw is None else tuple(cw.shape))
            cx, cw, ev = buf.combine(y, h)
out = buf.dispatch(x, idx, w, num_experts=E, num_max_tokens_per_rank=8 if T <= 8 else 12)
print('tmaf', tuple(out[3].token_metadata_at_forward.shape))
a = buf.dispatch(x, idx, w, num_experts=E, async_with_compute_stream=True, allocate_on_comm_stream=True)
a[4].current_stream_wait()
c = buf.combine(torch.zeros(a[0].shape[0], H, dtype=torch.bfloat16), a[3], topk_weights=a[2],
                async_with_compute_stream=True)
c[2].current_stream_wait()
print('async', tuple(c[0].shape))
z = buf.dispatch(x[:0], idx[:0], w[:0], num_experts=E)
cx, cw, _ = buf.combine(torch.zeros(z[0].shape[0], H, dtype=torch.bfloat16), z[3], topk_weights=z[2])
print('zero tokens', tuple(cx.shape))
print('plans', feat.rails.plans[:6])
print('OK')
