"""DeepEP-compatible utilities added for the drop-in surface: envs (RDMA / NVLink bandwidth, EnvOverride, checks),
semantic, comm (handles, barrier, domain sizes of a buffer), testing.parse_num_bytes / empty_suppress, math's DeepEP
semantics."""

import gc
import os
import types

import pytest

from deepep_cupy.runtime import nvlink
from deepep_cupy.utils import comm, semantic, testing
from deepep_cupy.utils import envs as utils_envs

IBSTAT = """CA 'mlx5_0'
\tCA type: MT4129
\tPort 1:
\t\tState: Active
\t\tRate: 400
CA 'mlx5_1'
\tCA type: MT4131
\tPort 1:
\t\tRate: 200
"""


def test_ibstat_parsing():
    assert utils_envs.parse_ibstat_rate(IBSTAT, 'mlx5_0') == 400
    assert utils_envs.parse_ibstat_rate(IBSTAT, 'mlx5_1') == 200
    assert utils_envs.parse_ibstat_rate(IBSTAT, 'mlx5_9') is None


@pytest.fixture
def fake_tools(monkeypatch):
    outputs = {}
    monkeypatch.setattr(utils_envs, '_run', lambda args: outputs.get(args[0]))
    monkeypatch.setattr(nvlink, '_run', lambda args: outputs.get(args[0]))
    caches = (utils_envs.get_rdma_gbs, utils_envs.get_nvlink_gbs, nvlink.get_nvlink_gbs,
              utils_envs.check_fast_rdma_atomic_support)
    for f in caches:
        f.cache_clear()
    yield outputs
    for f in caches:
        f.cache_clear()


def test_rdma_gbs_and_fallbacks(fake_tools):
    fake_tools['ibstat'] = IBSTAT
    assert utils_envs.get_rdma_gbs() == 50.0 and utils_envs.get_rdma_gbs('mlx5_1') == 25.0
    assert not utils_envs.check_fast_rdma_atomic_support() and utils_envs.check_fast_rdma_atomic_support('mlx5_1')
    fake_tools.clear()
    utils_envs.get_rdma_gbs.cache_clear()
    fake_tools['nvidia-smi'] = 'GPU 0: NVIDIA H200 (UUID: x)\n\t Link 0: 26.562 GB/s\n\t Link 1: 26.562 GB/s\n'
    assert utils_envs.get_rdma_gbs() == pytest.approx(2 * 26.562 * 0.9)     # no NIC: NVLink carries it
    fake_tools.clear()
    utils_envs.get_rdma_gbs.cache_clear()
    utils_envs.get_nvlink_gbs.cache_clear()
    nvlink.get_nvlink_gbs.cache_clear()
    assert utils_envs.get_rdma_gbs() == utils_envs.FALLBACK_LINK_GBS > 0     # never 0: DeepEP's test_pp divides by it
    assert utils_envs.get_sm_read_gbs() == 180 and utils_envs.get_sm_write_gbs() == 45


def test_env_override(monkeypatch):
    monkeypatch.setenv('DEEPEP_TEST_A', 'old')
    monkeypatch.delenv('DEEPEP_TEST_B', raising=False)
    with utils_envs.EnvOverride([('DEEPEP_TEST_A', 'new', True), ('DEEPEP_TEST_B', 'b', True),
                                 ('DEEPEP_TEST_C', 'c', False)]):
        assert (os.environ['DEEPEP_TEST_A'], os.environ['DEEPEP_TEST_B']) == ('new', 'b')
        assert 'DEEPEP_TEST_C' not in os.environ
    assert os.environ['DEEPEP_TEST_A'] == 'old' and 'DEEPEP_TEST_B' not in os.environ


def test_check_torch_deterministic():
    torch = pytest.importorskip('torch')
    utils_envs.check_torch_deterministic()
    saved = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    try:
        torch.utils.deterministic.fill_uninitialized_memory = True
        with pytest.raises(RuntimeError, match='fill_uninitialized_memory'):
            utils_envs.check_torch_deterministic()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = saved


def test_semantic():
    assert semantic.value_or(None, 3) == 3 and semantic.value_or(0, 3) == 0

    class Thing:
        calls = 0

        @semantic.weak_lru(maxsize=8)
        def square(self, x):
            Thing.calls += 1
            return x * x

    t = Thing()
    assert t.square(3) == 9 and t.square(3) == 9 and Thing.calls == 1
    import weakref
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None          # the cache held only a weak reference


def test_parse_num_bytes_and_empty_suppress():
    assert testing.parse_num_bytes('64M') == 64 << 20 and testing.parse_num_bytes('1GiB') == 1 << 30
    assert testing.parse_num_bytes(' 512k ') == 512 << 10 and testing.parse_num_bytes('1048576') == 1 << 20
    for bad in ('abc', '0', '-1M', '1X'):
        with pytest.raises(ValueError):
            testing.parse_num_bytes(bad)
    with testing.empty_suppress() as s:
        assert isinstance(s, testing.empty_suppress)


class FakeBuffer:
    def __init__(self):
        self.calls = []

    def get_physical_domain_size(self):
        return (1, 4)

    def get_logical_domain_size(self):
        return (2, 2)

    def barrier(self, use_comm_stream=True, with_cpu_sync=False):
        self.calls.append((use_comm_stream, with_cpu_sync))

    def get_comm_stream(self):
        return 'stream'


def test_comm_helpers_on_a_buffer(monkeypatch):
    buf = FakeBuffer()
    assert comm.get_physical_domain_size(buf) == (1, 4) and comm.get_logical_domain_size(buf) == (2, 2)
    comm.barrier(buf, wait_comm_stream=False, with_cpu_sync=True)
    assert buf.calls == [(False, True)]
    with pytest.raises(ValueError, match='single context'):
        comm.barrier(buf, context_idx=1)

    class WithSequential(FakeBuffer):
        def barrier(self, use_comm_stream=True, with_cpu_sync=False, sequential=False):
            self.calls.append(sequential)
    seq = WithSequential()
    comm.barrier(seq)
    assert seq.calls == [True]


def test_nccl_comm_handle_reuses_torchs_communicator(monkeypatch):
    torch = pytest.importorskip('torch')
    backend = types.SimpleNamespace(_comm_ptr=lambda: 0xABC)

    class FakeTorchGroup:
        def _get_backend(self, device):
            assert device == torch.device('cuda')
            return backend

    group = FakeTorchGroup()
    handle = comm.get_nccl_comm_handle(group)
    assert handle.get() == 0xABC and not handle.managed and comm.get_nccl_comm_handle(group) is handle
    comm.destroy_all_managed_nccl_comm()
    assert comm.get_nccl_comm_handle(group) is not handle
    comm.destroy_all_managed_nccl_comm()

    destroyed = []
    ours = types.SimpleNamespace(comm=types.SimpleNamespace(ptr=0x123), destroy=lambda: destroyed.append(1))
    managed = comm.NCCLCommHandle(ours, True)
    assert managed.get() == 0x123
    del managed
    gc.collect()
    assert destroyed == [1]


def test_math_deepep_semantics():
    torch = pytest.importorskip('torch')
    from deepep_cupy.utils import math as m
    a, b = torch.tensor([5], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    assert m.hash_tensors(a, (b, None), [a]) == 5 ^ 3 ^ 5          # XOR, nested, None skipped (DeepEP)
    assert m.safe_div(0, 0) == 0 and m.safe_div(3, 2) == 1.5
    x = torch.randn(4, 256)
    q, sf = m.per_token_cast_to_fp8(x)
    assert torch.equal(m.per_token_cast_back(q, x_scales=sf), m.per_token_cast_back(q, sf))


def test_nvlink_gbs_never_zero(fake_tools):
    """No NVLink reported: DeepEP's perf lines divide by get_nvlink_gbs(), so ours falls back to a nominal link; the
    runtime probe the library uses stays exact."""
    assert nvlink.get_nvlink_gbs() == 0.0
    assert utils_envs.get_nvlink_gbs() == pytest.approx(utils_envs.FALLBACK_LINK_GBS * 0.9)
    fake_tools['nvidia-smi'] = 'GPU 0: NVIDIA H200 (UUID: x)\n\t Link 0: 26.562 GB/s\n'
    utils_envs.get_nvlink_gbs.cache_clear()
    nvlink.get_nvlink_gbs.cache_clear()
    assert utils_envs.get_nvlink_gbs() == pytest.approx(26.562 * 0.9)


def test_torch_compat_aliases(monkeypatch):
    """The runner's torch.distributed aliases for DeepEP's V2.5 programs: added only where torch lacks the names."""
    dist = pytest.importorskip('torch.distributed')
    from deepep_cupy.deep_ep_alias import torch_compat
    monkeypatch.setattr(dist, 'all_gather_into_tensor', dist.all_gather_into_tensor)     # restored afterwards
    for name in ('all_gather_single', 'reduce_scatter_single'):
        if hasattr(dist, name):
            monkeypatch.delattr(dist, name)
    torch_compat()
    assert dist.all_gather_single is dist.all_gather_into_tensor
    assert dist.reduce_scatter_single is dist.reduce_scatter_tensor


GLOO_GATHER = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, sys.argv[1])
from deepep_cupy.deep_ep_alias import torch_compat

def run(rank, port):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch_compat()
    dist.init_process_group('gloo', rank=rank, world_size=2)
    x = torch.full((4, 3), rank)
    out = torch.empty((2, 4, 3), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x)             # NCCL's shape convention, on gloo
    assert out[:, :, :].tolist() == [[[0] * 3] * 4, [[1] * 3] * 4], out
    flat = torch.empty((8, 3), dtype=x.dtype)
    dist.all_gather_into_tensor(flat, x)            # gloo's own convention still works
    assert torch.equal(flat.view(2, 4, 3), out)
    dist.destroy_process_group()

if __name__ == '__main__':
    mp.spawn(run, args=(int(sys.argv[2]),), nprocs=2)
"""


def test_torch_compat_gathers_into_a_world_leading_tensor_on_gloo(tmp_path):
    """DeepEP's tests/legacy/test_low_latency.py gathers [world, T, K] on 2 ranks sharing a GPU (gloo): found on
    1xH200 ('ProcessGroupGloo::allgather: invalid tensor size'); the runner's shim passes the [world * T, K] view."""
    pytest.importorskip('torch.distributed')
    import socket
    import subprocess
    import sys
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    script = tmp_path / 'gather.py'
    script.write_text(GLOO_GATHER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, str(script), root, str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_share_gpu_compat_maps_devices_and_names_nccl_hosts(monkeypatch):
    """DeepEP v1.2.1's own init_dist binds local rank i to cuda:i with NCCL: on one GPU the runner maps i past the
    visible devices to i % count and makes such a rank (or every rank with DEEPEP_CUPY_NCCL_HOST_PER_RANK=1) its own
    NCCL host; valid indices and non-NCCL groups keep their meaning."""
    torch = pytest.importorskip('torch')
    import torch.distributed as dist

    from deepep_cupy.deep_ep_alias import share_gpu_compat
    calls = []
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    monkeypatch.setattr(torch.cuda, 'set_device', lambda d: calls.append(('set_device', d)))
    monkeypatch.setattr(dist, 'init_process_group', lambda *a, **k: calls.append(('init', a, k,
                                                                                  os.environ.get('NCCL_HOSTID'))))
    for name in ('NCCL_HOSTID', 'DEEPEP_CUPY_NCCL_HOST_PER_RANK', 'NCCL_P2P_DISABLE', 'NCCL_SHM_DISABLE',
                 'NCCL_IB_DISABLE', 'NCCL_SOCKET_IFNAME'):
        monkeypatch.setenv(name, '')                    # (recorded, so that what the compat sets is undone)
        monkeypatch.delenv(name)
    share_gpu_compat()
    share_gpu_compat()                                  # idempotent: wrapped once
    torch.cuda.set_device(0)
    torch.cuda.set_device(5)
    torch.cuda.set_device(torch.device('cuda', 3))
    assert calls == [('set_device', 0), ('set_device', 0), ('set_device', 0)]
    calls.clear()
    dist.init_process_group(backend='nccl', init_method='tcp://x', world_size=8, rank=0,
                            device_id=torch.device('cuda', 0))
    assert calls[-1][2]['device_id'] == torch.device('cuda', 0) and calls[-1][3] is None
    dist.init_process_group(backend='gloo', world_size=8, rank=7, device_id=torch.device('cuda', 7))
    assert calls[-1][2]['device_id'] == torch.device('cuda', 0) and calls[-1][3] is None    # gloo: no NCCL host
    dist.init_process_group(backend='nccl', world_size=8, rank=7, device_id=torch.device('cuda', 7))
    assert calls[-1][2]['device_id'] == torch.device('cuda', 0) and calls[-1][3] == 'deepep_cupy_rank7'
    assert os.environ['NCCL_SOCKET_IFNAME'] == 'lo' and os.environ['NCCL_P2P_DISABLE'] == '1'
    monkeypatch.delenv('NCCL_HOSTID')
    monkeypatch.setenv('DEEPEP_CUPY_NCCL_HOST_PER_RANK', '1')
    dist.init_process_group(backend='nccl', world_size=16, rank=8, device_id=torch.device('cuda', 0))
    assert calls[-1][3] == 'deepep_cupy_rank8'          # node 1's local rank 0: GPU 0 too, its own host
