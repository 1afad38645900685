"""What Megatron-Core needs of deep_ep beyond the call signatures, without a GPU: `ElasticBuffer.set_num_sms`,
a buffer's `group` comparing equal to the torch group passed (Megatron rebuilds its buffer when
`buffer.group != group`), NCCL between ranks sharing a GPU (per-rank `NCCL_HOSTID`), and the Megatron rank program's
command line and comparison rule."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_megatron_program_help_works_without_torch_or_megatron():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = ("import sys; sys.modules['torch'] = None; sys.modules['megatron'] = None; "
            "import runpy; sys.argv = ['megatron_moe', '--help']; "
            "runpy.run_module('deepep_cupy.tests.megatron_moe', run_name='__main__')")
    proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '--num-tokens' in proc.stdout and "'v2' ElasticBuffer" in proc.stdout


def _fake_torch(num_devices: int):
    cuda = types.SimpleNamespace(is_available=lambda: num_devices > 0, device_count=lambda: num_devices)
    return types.SimpleNamespace(cuda=cuda)


def test_torch_backend_takes_nccl_on_a_shared_gpu_only_with_per_rank_hosts(monkeypatch):
    from deepep_cupy.utils import envs as utils_envs
    monkeypatch.delenv('NCCL_HOSTID', raising=False)
    assert utils_envs.torch_backend(2, _fake_torch(2)) == utils_envs.TORCH_BACKEND_OWN_GPUS
    assert utils_envs.torch_backend(2, _fake_torch(1)) == utils_envs.TORCH_BACKEND_SHARED_GPUS
    monkeypatch.setenv('NCCL_HOSTID', ' ')
    assert utils_envs.torch_backend(2, _fake_torch(1)) == utils_envs.TORCH_BACKEND_SHARED_GPUS
    monkeypatch.setenv('NCCL_HOSTID', 'node1')
    assert utils_envs.torch_backend(2, _fake_torch(1)) == utils_envs.TORCH_BACKEND_OWN_GPUS
    assert utils_envs.torch_backend(2, _fake_torch(0)) == utils_envs.TORCH_BACKEND_SHARED_GPUS


def test_emulate_nccl_host_sets_the_host_and_keeps_the_callers_transports(monkeypatch):
    from deepep_cupy.utils import envs as utils_envs
    for name in ('NCCL_HOSTID', *utils_envs.NCCL_SHARED_GPU_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv('NCCL_SOCKET_IFNAME', 'eth9')
    utils_envs.emulate_nccl_host('rank3')
    assert os.environ['NCCL_HOSTID'] == 'rank3' and utils_envs.nccl_hosts_emulated()
    assert os.environ['NCCL_P2P_DISABLE'] == os.environ['NCCL_SHM_DISABLE'] == os.environ['NCCL_IB_DISABLE'] == '1'
    assert os.environ['NCCL_SOCKET_IFNAME'] == 'eth9'
    for bad in ('', 'a b'):
        with pytest.raises(ValueError, match='host must be'):
            utils_envs.emulate_nccl_host(bad)


def test_a_buffers_torch_group_wrapper_equals_the_torch_group_it_wraps():
    torch = pytest.importorskip('torch')
    import torch.distributed as dist

    from deepep_cupy.runtime.group import TorchProcessGroup
    started = not dist.is_initialized()
    if started:
        dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = dist.group.WORLD
        other = dist.new_group([0])
        pg = TorchProcessGroup(world)
        assert pg == world and world == pg and not (pg != world) and not (world != pg)
        assert pg != other and other != pg and pg != object()
        assert pg == TorchProcessGroup(world) and hash(pg) == hash(TorchProcessGroup(world))
        assert TorchProcessGroup(other) != pg
        del torch
    finally:
        if started:
            dist.destroy_process_group()


class _FakeFeature:
    def __init__(self, settings):
        self.settings, self._bound = settings, {'signature': object()}


def test_set_num_sms_reaches_live_buffers_and_later_ones(monkeypatch):
    pytest.importorskip('torch')
    sys.path.insert(0, str(ROOT / 'tests'))
    from test_ep_checks_cpu import make_inputs, plan, settings

    from deepep_cupy import ElasticBuffer
    from deepep_cupy.features.ep import feature as ep_feature
    from deepep_cupy.features.ep import plan as ep_plan
    monkeypatch.setattr(ep_feature, '_default_num_sms', 0)
    live = _FakeFeature(settings())
    ep_feature._live_features.add(live)
    x, idx, w = make_inputs()
    policy = plan(settings(), x, idx, w, num_experts=16).num_sms
    assert policy == ep_plan.theoretical_num_sms(2, 16, 4, 450.0, 132)
    try:
        ElasticBuffer.set_num_sms(policy + 6)
        assert live.settings.default_num_sms == policy + 6 and live._bound == {}
        assert ep_feature._default_num_sms == policy + 6
        assert plan(live.settings, x, idx, w, num_experts=16).num_sms == policy + 6
        assert plan(live.settings, x, idx, w, num_experts=16, num_sms=10).num_sms == 10     # a call's own wins
        ElasticBuffer.set_num_sms(0)
        assert plan(live.settings, x, idx, w, num_experts=16).num_sms == policy
        with pytest.raises(TypeError, match='new_num_sms'):
            ElasticBuffer.set_num_sms(2.0)
        with pytest.raises(ValueError, match='new_num_sms'):
            ElasticBuffer.set_num_sms(-1)
    finally:
        ep_feature._live_features.discard(live)
        ep_feature.set_default_num_sms(0)


def test_megatron_comparison_rule():
    torch = pytest.importorskip('torch')
    sys.argv = ['x']
    from deepep_cupy.tests import megatron_moe as m
    a = torch.full((1000,), 2.0, dtype=torch.bfloat16)
    a[2] = 4.0
    assert m.compare('t', a, a.clone(), exact=True) is True
    b = a.clone()
    b[2] = 4.03125          # one BF16 ulp at 4
    assert m.compare('t', a, b, exact=False) is False
    with pytest.raises(m.Failure, match='not bitwise equal; first difference at \\(2,\\)'):
        m.compare('t', a, b, exact=True)
    c = a.clone()
    c[2] = 4.125            # four ulps: beyond the bound
    with pytest.raises(m.Failure, match='calc_diff'):
        m.compare('t', a, c, exact=False)
    with pytest.raises(m.Failure, match='shape/dtype'):
        m.compare('t', a, a.float(), exact=False)


@pytest.mark.parametrize('transport,per_rank,num_devices,emulated', [
    ('nccl', '', 1, True), ('nccl', '', 2, False), ('loopback', '', 1, False), ('auto', '', 1, False),
    ('auto', '1', 1, True), ('auto', '1', 2, False), ('auto', '0', 1, False)])
def test_deepeps_init_dist_gives_each_rank_an_nccl_host_for_nccl_rails_on_shared_gpus(monkeypatch, transport, per_rank,
                                                                                      num_devices, emulated):
    """DeepEP's programs in hybrid mode with NCCL rails on one GPU: init_dist (DeepEP's form) makes every rank its
    own NCCL host before torch's NCCL starts, so NCCL accepts the ranks; never otherwise."""
    torch = pytest.importorskip('torch')
    import torch.distributed as dist

    from deepep_cupy.utils import envs as utils_envs
    for name in ('NCCL_HOSTID', *utils_envs.NCCL_SHARED_GPU_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv('DEEPEP_CUPY_RAIL_TRANSPORT', transport)
    monkeypatch.setenv(utils_envs.NCCL_HOST_PER_RANK_ENV, per_rank)
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', '1')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: num_devices)
    monkeypatch.setattr(utils_envs, '_bind_device', lambda local_rank, torch: None)
    seen = {}
    monkeypatch.setattr(dist, 'is_initialized', lambda: False)
    monkeypatch.setattr(utils_envs.group_mod, 'init_torch_distributed',
                        lambda rank, size, addr, port, backend, origin=None: seen.update(
                            rank=rank, backend=backend, host=os.environ.get('NCCL_HOSTID')))
    monkeypatch.setattr(dist, 'new_group', lambda ranks: 'group')
    monkeypatch.setattr(dist, 'get_rank', lambda: 1)
    monkeypatch.setattr(dist, 'get_world_size', lambda: 2)
    monkeypatch.setattr(utils_envs.group_mod, 'TorchProcessGroup', lambda g: g)
    utils_envs._init_spawned(1, 2, torch)
    assert seen['rank'] == 1
    assert seen['host'] == ('deepep_cupy_rank1' if emulated else None)
    assert seen['backend'] == (utils_envs.TORCH_BACKEND_OWN_GPUS if emulated or num_devices >= 2
                               else utils_envs.TORCH_BACKEND_SHARED_GPUS)
