"""V1 low-latency dispatch across domains (v1/internode_ll.py) over the REAL hybrid feature and intranode engine host
paths without a GPU (perf/host_path_cpu.py's fakes: kernels that pack their arguments, CPU torch tensors, a fake rail
transport): every launch's packed arguments are decoded, and the receive kernels must read exactly what the
intranode dispatch writes and write exactly what the call returns (recv_count, layout_range, src_info, recv_x and
its scales), for BF16 and FP8, 2x1 and 2x2. tests/test_legacy_internode_ll_cpu.py runs this file in a subprocess (the
fakes patch modules process-wide). Prints `OK` at the end."""
import contextlib
import ctypes
import os
import struct
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, 'tests'), os.path.join(ROOT, 'perf')]
import fakes  # noqa: E402
import host_path_cpu as hp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

hp.install()
from deepep_cupy.features.ep import kernels as ek  # noqa: E402
from deepep_cupy.features.ep.feature import EP  # noqa: E402
from deepep_cupy.features.hybrid import feature as hf  # noqa: E402
from deepep_cupy.features.hybrid import kernels as hk  # noqa: E402
from deepep_cupy.jit import launch  # noqa: E402
from deepep_cupy.runtime.rails import ScaleoutTransport, rail_topology  # noqa: E402
from deepep_cupy.v1 import internode_ll as lli  # noqa: E402
from deepep_cupy.v1.kernels import internode_ll as ill  # noqa: E402

LOG = []            # (short kernel name, {parameter: value}) per launch
SPECS = {}          # fake function pointer -> spec
_launch = hp.DRIVER.launchKernel


def _record(fn, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
    spec = SPECS.get(fn)
    if spec is not None:
        values = {}
        for i, p in enumerate(spec.params):
            fmt = '=Q' if p.kind == launch.PTR else '=' + launch._STRUCT_CODES[np.dtype(p.kind).name]
            address = ctypes.c_uint64.from_address(args + 8 * i).value
            values[p.name] = struct.unpack(fmt, (ctypes.c_char * struct.calcsize(fmt)).from_address(address).raw)[0]
        LOG.append((spec.name.split('::')[-1].split('<')[0], values))
    return _launch(fn, gx, gy, gz, bx, by, bz, smem, stream, args, extra)


def _load(specs, defines=None, device=None):
    out = hp.fake_load_kernels(specs, defines, device)
    for s in specs:
        SPECS[out[s.name].function.ptr] = s
    return out


hp.DRIVER.launchKernel = _record
hk.load_kernels = ek.load_kernels = launch.load_kernels = _load


@contextlib.contextmanager
def _on_stream(kind, stream):       # (one fake stream: nothing to switch)
    yield


lli._OnStream = _on_stream
lli._record = lambda kind, stream, tensors: None


class Rails:
    def __init__(self, R, S, rank):
        self.rails = rail_topology(R, S, rank)
        self.base = 0x1000
        self.transport = ScaleoutTransport(self.rails, self.base)

    def exchange(self, plan, stream, after_chunk=None):
        pass

    def barrier(self, stream):
        pass

    def release(self, collective):
        pass


def ptr(t) -> int:
    return t.data_ptr()


def run(N, S, rank, M=16, H=512, K=3, E=None, T=12):
    R = N * S
    E = E or 4 * R
    Mc = M * K
    buf = hp.make_buffer(R, rank, 1 << 30, num_scaleup_ranks=S, num_scaleout_ranks=N, scaleup_rank_idx=rank % S,
                         scaleout_rank_idx=rank // S, num_max_tokens_per_rank=Mc, hidden=H, num_topk=1)
    buf.sym.local_idx, buf.sym.num_peers, buf.deterministic = rank % S, S, False
    inner = EP(buf, N * Mc, H, 1, True, True, 450.0)
    feat = hf.HybridEP(buf, inner, Mc, H, 1, rails=Rails(R, S, rank), host=fakes.FakeHostMapped())
    buf._ep = feat
    engine = SimpleNamespace(ll_kernels=ill.InternodeLLKernels(loaded=_load(list(ill.SPECS))), feature=feat,
                             comm_stream=buf.comm_stream, check_usable=lambda: None, barrier=lambda **kw: None,
                             destroy=lambda: None)
    mode = lli.InternodeLLMode(N, S, -1, False, lambda num_pseudo, hidden: engine)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand(T, E, generator=g), K).indices
    stats = torch.zeros(E // R, dtype=torch.int32)
    for fp8 in (False, True):
        LOG.clear()
        recv, count, handle, _, _ = mode.dispatch(x, idx, M, E, cumulative_local_expert_recv_stats=stats,
                                                  use_fp8=fp8, round_scale=fp8, use_ue8m0=fp8)
        launches = {name: v for name, v in LOG}
        notify, d, lay, sc = (launches['notify_dispatch'], launches['dispatch_impl_with_dispatch_copy_epilogue_impl'],
                              launches['ll_internode_layout'], launches['ll_internode_scatter'])
        what = f'{N}x{S} rank {rank} fp8={fp8}'
        # the receive reads what the intranode dispatch wrote: its rows' top-k, metadata, weights, x (and scales),
        # the received count (the last word of the source prefix sums, which its notify writes)
        assert lay['num_recv'] == notify['recv_layout'] + 4 * (S - 1) == d['recv_layout'] + 4 * (S - 1), what
        for k in (lay, sc):
            assert (k['recv_topk'], k['recv_meta']) == (d['recv_topk_idx'], d['recv_src_metadata']), what
            assert k['num_rows'] == d['num_meta_rows'] == handle.num_rows, what
            assert k['num_recv'] == handle.num_recv_ptr, what
        assert (sc['recv_weights'], sc['recv_x'], sc['recv_sf']) == (d['recv_topk_weights'], d['recv_x'],
                                                                    d['recv_sf']), what
        # ... and writes what the call returns
        x_out, sf_out = recv if fp8 else (recv, None)
        assert lay['recv_count'] == ptr(count) and lay['layout_range'] == ptr(handle[1]), what
        assert lay['cumulative_stats'] == ptr(stats) and lay['begin'] == sc['begin'], what
        assert sc['src_info'] == ptr(handle[0]) and sc['out_x'] == ptr(x_out), what
        assert sc['out_sf'] == (ptr(sf_out) if fp8 else 0) and sc['row_of'] == ptr(handle.row_of), what
        assert launches['ll_internode_prepare']['send_pos'] == ptr(handle.send_pos), what
        print(what, 'receive reads the dispatch outputs, writes the returned tensors')


for shape in ((2, 1), (2, 2)):
    for rank in range(shape[0] * shape[1]):
        run(*shape, rank)
print('OK')
