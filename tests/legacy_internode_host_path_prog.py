"""DeepEP V1's `Buffer` across scale-up domains on the real hybrid and intranode engines' Python without a GPU:
perf/host_path_cpu.py's fakes (kernels that pack their arguments, CPU torch tensors), a fake rail transport, engines
built without CUDA. Every mode must run through and hand back V1's shapes: CPU-sync and num_worst_tokens dispatches
(BF16, FP8), previous_event / async_finish / allocate_on_comm_stream, cached dispatch, combine (0-2 biases, weights),
a 0-token rank, a rank holding more tokens than the engine (probe, rebuild, redo). tests/test_legacy_internode_cpu.py
runs this file in a subprocess (the fakes patch modules process-wide)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, 'tests'), os.path.join(ROOT, 'perf')]
import fakes  # noqa: E402
import host_path_cpu as hp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

hp.install()
from deepep_cupy.features.ep import kernels as ep_kernels  # noqa: E402
from deepep_cupy.features.ep.feature import EP  # noqa: E402
from deepep_cupy.features.hybrid import feature as hf  # noqa: E402
from deepep_cupy.features.hybrid import kernels as hk  # noqa: E402
from deepep_cupy.runtime.rails import ScaleoutTransport, rail_topology  # noqa: E402
from deepep_cupy.v1.buffer import Buffer, Config  # noqa: E402
from deepep_cupy.v1.internode import InternodeEngine, InternodeHandle, InternodeMode  # noqa: E402
from deepep_cupy.v1.kernels import internode  # noqa: E402

hk.load_kernels = hp.fake_load_kernels
N, S, H, K, E = 2, 2, 256, 4, 32
R, RANK = N * S, 1
FORWARDED = 3           # what the fake report says this rank forwards
made, seq = [], [0]


class Rails:
    def __init__(self):
        self.rails = rail_topology(R, S, RANK)
        self.base, self.plans = 0x1000, []
        self.transport = ScaleoutTransport(self.rails, self.base)

    def exchange(self, plan, stream):
        self.plans.append(plan.phase)

    def barrier(self, stream):
        pass

    def release(self, collective):
        pass


orig_notify = hf.HybridEP._notify


def notify(self, k, counts, stream, *v1):
    seq[0] = (self._seq % 0x7FFFFFFF) + 1
    return orig_notify(self, k, counts, stream, *v1)


hf.HybridEP._notify = notify
hybrid_host = fakes.FakeHostMapped()
v1_host = fakes.FakeHostMapped(4096, 0)
v1_host.ptr = v1_host.data.ctypes.data


def hybrid_report(args):         # hybrid_report: one token each way
    words = hybrid_host.view('int32', 1 + 2 * N)
    words[1:] = 1
    words[0] = seq[0]


def v1_report(args):             # legacy_internode_report: the rail's largest count, the forwarded rows
    words = v1_host.view('int32', 2)
    words[0], words[1] = 0, FORWARDED
    launched['report'].append(1)


hp.DRIVER.on_launch[hp.fake_load_kernels([hk.report_spec()])[hk.report_spec().name].function.ptr] = hybrid_report
v1_kernels = internode.InternodeKernels(loaded=hp.fake_load_kernels(list(internode.SPECS)))
hp.DRIVER.on_launch[v1_kernels.report.function.ptr] = v1_report
launched = {name: [] for name in ('begin', 'report', 'forward', 'receive', 'weights')}
_reported = hp._field(v1_kernels.begin, 'reported_num_tokens', '=i')
_forward_tokens = hp._field(v1_kernels.forward, 'num_tokens', '=i')
_nvl_rows = hp._field(v1_kernels.forward, 'num_nvl_rows', '=i')
_recv_rows = hp._field(v1_kernels.receive, 'num_rows', '=i')
for _name, _read in (('begin', _reported), ('forward', _forward_tokens), ('receive', _recv_rows),
                     ('weights', None)):
    _k = getattr(v1_kernels, _name)
    hp.DRIVER.on_launch[_k.function.ptr] = (lambda name, read: lambda args: launched[name].append(
        read(args) if read else 1))(_name, _read)
largest = [None]        # the intranode notify's largest reported count (None: what the fake wrote)
real_wait = EP._wait_host_counts


def wait(self, seq_, num_local_experts):
    out = real_wait(self, seq_, num_local_experts)
    if largest[0] is not None:
        self.host_counts[ep_kernels.HOST_MAX_TOKENS_WORD] = largest[0]
    return out


EP._wait_host_counts = wait


def make_engine(M, hidden, num_topk):
    fake = hp.make_buffer(R, RANK, 1 << 30, num_scaleup_ranks=S, num_scaleout_ranks=N, scaleup_rank_idx=RANK % S,
                          scaleout_rank_idx=RANK // S, num_max_tokens_per_rank=M, hidden=hidden, num_topk=num_topk)
    fake.sym.local_idx, fake.sym.num_peers = RANK % S, S
    eng = InternodeEngine.__new__(InternodeEngine)
    eng.__dict__.update(fake.__dict__)
    eng.__dict__.update(geometry=(M, hidden, num_topk), deterministic=True, allow_multiple_reduction=True,
                        prefer_overlap_with_compute=True, _nvlink_gbs=450.0, _hybrid=None, _host=None,
                        v1_kernels=v1_kernels)
    eng.area = internode.ExchangeArea(fake.sym.peer_bases_ptr, eng.extra_offset, RANK % S, S,
                                      internode.slot_words(N, M), 0x9000, 0x2000, 10**9, v1_host.view('int32', 2),
                                      v1_host.ptr)
    eng.barrier = lambda **kw: None
    inner = EP(eng, N * M, hidden, num_topk, True, True, 450.0)
    eng._ep = hf.HybridEP(eng, inner, M, hidden, num_topk, rails=Rails(), host=hybrid_host)
    made.append(eng)
    return eng


order = fakes.stream_order(hp.CountingStream('comm'))
buf = Buffer.__new__(Buffer)
buf.__dict__.update(
    _destroyed=False, group=None, rank=RANK, group_size=R, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
    explicitly_destroy=True, enable_shrink=False, device=-1, _stream=None, _order=order, _configs={}, _ll=None,
    _layout=None, _normal=None, num_domains=N, num_scaleup_ranks=S,
    _internode=InternodeMode(N, S, 0, 0, make_engine))

g = torch.Generator().manual_seed(0)
T = 12
x = torch.randn(T, H, generator=g).to(torch.bfloat16)
idx = torch.topk(torch.rand(T, E, generator=g), K).indices
w = torch.rand(T, K, generator=g)
x8 = (x.to(torch.float8_e4m3fn), torch.ones(H // 128, T).t())
owner = idx // (E // R)
in_rank = torch.stack([(owner == r).any(1) for r in range(R)], 1)
lay = dict(num_tokens_per_rank=in_rank.sum(0).int(), is_token_in_rank=in_rank,
           num_tokens_per_rdma_rank=in_rank.view(T, N, S).any(2).sum(0).int(),
           num_tokens_per_expert=torch.stack([(idx == e).sum() for e in range(E)]).int())
C = 12


def check_handle(h, rows, nvl_rows, what):
    assert isinstance(h, InternodeHandle) and len(h) == 10, what
    shapes = [(T, R), (N, C), (R, C), (N, C), (N,), (R, C), (R,), (rows, 8), (T, N), (nvl_rows, S)]
    dtypes = [torch.bool] + [torch.int32] * 6 + [torch.uint8, torch.int32, torch.int32]
    for i, (t, shape, dtype) in enumerate(zip(h, shapes, dtypes)):
        assert tuple(t.shape) == shape and t.dtype == dtype, (what, i, tuple(t.shape), shape, t.dtype)
    assert h[0] is in_rank and h[8] is h.hybrid_handle.domain_pos, what


for fp8 in (False, True):
    for prev, async_finish, alloc in ((False, False, False), (True, False, False), (True, True, True),
                                      (False, True, False)):
        kw = dict(previous_event=Buffer.capture() if prev else None, async_finish=async_finish,
                  allocate_on_comm_stream=alloc, config=Config(24, 8, 256))
        out = buf.dispatch(x8 if fp8 else x, topk_idx=idx, topk_weights=w, expert_alignment=4, **kw, **lay)
        recv_x, recv_idx, recv_w, counts, h, ev = out
        rows = (recv_x[0] if fp8 else recv_x).shape[0]
        check_handle(h, rows, FORWARDED, f'dispatch fp8={fp8} prev={prev} async={async_finish}')
        assert isinstance(counts, list) and recv_idx.shape == (rows, K) and recv_w.shape == (rows, K)
        worst = buf.dispatch(x8 if fp8 else x, topk_idx=idx, topk_weights=w, num_worst_tokens=40, **kw, **lay)
        check_handle(worst[4], 40, 40, 'num_worst_tokens')
        assert worst[3] == [] and (worst[0][0] if fp8 else worst[0]).shape[0] == 40
        cached = buf.dispatch(x8 if fp8 else x, handle=h, **kw)
        assert cached[1:5] == (None, None, None, None)
        for nb in range(3):
            bias = [torch.zeros(T, H, dtype=torch.bfloat16) for _ in range(nb)]
            bias = None if not nb else (bias[0] if nb == 1 else tuple(bias))
            y = torch.zeros(rows, H, dtype=torch.bfloat16)
            cx, cw, cev = buf.combine(y, h, topk_weights=recv_w, bias=bias, **kw)
            assert cx.shape == (T, H) and cw.shape == (T, K)
            cx, cw, _ = buf.combine(y, h, **kw)
            assert cw is None
        print('mode', fp8, prev, async_finish, alloc, rows, 'OK')
# Per mode: 2 non-cached dispatches (begin, forward, receive each), 1 report (CPU sync), 3 weighted combines.
assert [len(launched[k]) for k in ('begin', 'report', 'forward', 'receive', 'weights')] == [16, 8, 16, 16, 24], \
    {k: len(v) for k, v in launched.items()}
assert 40 in launched['receive'] and 2048 in launched['receive']
# A 0-token rank.
z = buf.dispatch(x[:0], topk_idx=idx[:0], topk_weights=w[:0], **dict(lay, is_token_in_rank=in_rank[:0]))
assert z[4][0].shape == (0, R) and z[4][8].shape == (0, N)
cx, cw, _ = buf.combine(torch.zeros(z[0].shape[0], H, dtype=torch.bfloat16), z[4], topk_weights=z[2])
assert cx.shape == (0, H) and cw.shape == (0, K)
# More tokens than the engine holds: probe with 0 tokens, every rank learns the largest count, rebuild, redo.
M0 = made[-1].geometry[0]
n = M0 + 10
big_idx = idx.repeat(n // T + 1, 1)[:n].contiguous()
big_in = in_rank.repeat(n // T + 1, 1)[:n]
largest[0] = N * M0 + n
engines = len(made)
for v in launched.values():
    v.clear()
out = buf.dispatch(x.repeat(n // T + 1, 1)[:n], topk_idx=big_idx, topk_weights=w.repeat(n // T + 1, 1)[:n],
                   **dict(lay, is_token_in_rank=big_in))
largest[0] = None
assert launched['begin'] == [n, n] and launched['forward'] == [0, n] and len(launched['report']) == 2, launched
assert len(made) == engines + 1 and made[-1].geometry[0] >= n and out[4].engine is made[-1], made[-1].geometry
assert buf._internode.num_growths == 1 and buf._internode.tokens_seen == n
assert out[4][0].shape == (n, R)
# num_worst_tokens over capacity: probe (its receive still acknowledges the exchange area), then ValueError.
M1 = made[-1].geometry[0]
n = M1 + 1
for v in launched.values():
    v.clear()
try:
    buf.dispatch(x.repeat(n // T + 1, 1)[:n], topk_idx=idx.repeat(n // T + 1, 1)[:n].contiguous(),
                 num_worst_tokens=64, **dict(lay, is_token_in_rank=in_rank.repeat(n // T + 1, 1)[:n]))
except ValueError as e:
    assert 'warm it up' in str(e), e
else:
    raise AssertionError('num_worst_tokens over capacity must raise')
assert launched['forward'] == [0] and launched['receive'] == [64] and len(made) == engines + 1, launched
# An old handle keeps its engine (combine runs on it).
cx, cw, _ = buf.combine(torch.zeros(z[0].shape[0], H, dtype=torch.bfloat16), z[4], topk_weights=z[2])
assert z[4].engine is not made[-1] and np.isfinite(cx.float().numpy()).all()
print('OK')
