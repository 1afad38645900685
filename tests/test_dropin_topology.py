"""Device binding and PCI-bus-id topology without a GPU: CuPy's runtime calls are faked per simulated rank (one thread
per rank, host collectives through shared memory), so per-process CUDA_VISIBLE_DEVICES can be played out."""

import sys
import threading
import types

import pytest

from deepep_cupy.runtime import group as group_mod
from deepep_cupy.runtime import preflight, topology

cupy = pytest.importorskip('cupy')

BUS = ['0000:1B:00.0', '0000:43:00.0', '0000:52:00.0', '0000:61:00.0']


class ThreadGroup(group_mod.ProcessGroup):
    """Ranks of one host as threads; allgather through a shared list."""

    def __init__(self, rank, size, shared):
        super().__init__(rank, size)
        self.local_rank, self.local_size = rank, size
        self.shared = shared

    def allgather_object(self, obj, timeout=None):
        box, barrier = self.shared
        barrier.wait()
        box[self.rank] = obj
        barrier.wait()
        out = list(box)
        barrier.wait()
        return out


class FakeCuda:
    """What each simulated rank's process sees: `visible[rank]` = PCI bus ids by ordinal; P2P between all."""

    def __init__(self, visible, p2p=True):
        self.visible, self.p2p = visible, p2p
        self.local = threading.local()
        self.peer_calls = []

    def install(self, monkeypatch):
        rt = cupy.cuda.runtime
        monkeypatch.setattr(rt, 'getDeviceCount', lambda: len(self.visible[self.local.rank]))
        monkeypatch.setattr(rt, 'deviceGetPCIBusId', lambda d: self.visible[self.local.rank][d])
        monkeypatch.setattr(rt, 'deviceGetByPCIBusId', self.by_bus_id)
        monkeypatch.setattr(rt, 'deviceCanAccessPeer', self.can_access)
        monkeypatch.setattr(cupy.cuda, 'Device', lambda d: types.SimpleNamespace(use=lambda: None))
        monkeypatch.setattr(preflight, '_cuda_checked', True)      # the fake devices stand for a working driver

    def by_bus_id(self, bus):
        devices = self.visible[self.local.rank]
        if bus not in devices:
            raise RuntimeError('cudaErrorInvalidDevice: invalid device ordinal')
        return devices.index(bus)

    def can_access(self, device, peer):
        n = len(self.visible[self.local.rank])
        assert 0 <= device < n and 0 <= peer < n, f'ordinal out of range for this process: {device}, {peer} of {n}'
        self.peer_calls.append((self.local.rank, device, peer))
        return self.p2p


def run_ranks(fake, size, fn):
    shared = ([None] * size, threading.Barrier(size, timeout=20))
    results, errors = [None] * size, [None] * size

    def body(rank):
        fake.local.rank = rank
        try:
            results[rank] = fn(ThreadGroup(rank, size, shared))
        except BaseException as e:  # noqa: BLE001 (checked by the caller; a rank stuck in a collective times out)
            errors[rank] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


@pytest.fixture
def clean_env(monkeypatch):
    for k in ('DEEPEP_CUPY_DEVICE', 'DEEPEP_CUPY_SCALEUP_SIZE', 'CUDA_VISIBLE_DEVICES'):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delitem(sys.modules, 'pynvml', raising=False)
    monkeypatch.setattr(topology, '_torch_current_device', lambda: None)


def test_peer_access_uses_local_ordinals(monkeypatch, clean_env):
    # Every process sees all 4 GPUs, but in a different order (a remapped CUDA_VISIBLE_DEVICES per process):
    # rank r uses ordinal 0, which is BUS[r] for it.
    visible = [BUS[r:] + BUS[:r] for r in range(4)]
    fake = FakeCuda(visible)
    fake.install(monkeypatch)
    results, errors = run_ranks(fake, 4, lambda g: topology.detect_topology(g, 0))
    assert errors == [None] * 4
    assert all(t.physical_scaleup == 4 and t.num_scaleup_ranks == 4 for t in results)
    assert results[0].pci_bus_ids == tuple(BUS)
    # Each rank asked about its peers with ITS ordinals of their GPUs
    for rank, device, peer in fake.peer_calls:
        assert device == 0 and visible[rank][peer] != visible[rank][0]
    assert len(fake.peer_calls) == 4 * 3


def test_no_peer_access_means_scaleup_one(monkeypatch, clean_env):
    fake = FakeCuda([BUS[:2], BUS[:2]], p2p=False)
    fake.install(monkeypatch)
    results, errors = run_ranks(fake, 2, lambda g: topology.detect_topology(g, g.rank))
    assert errors == [None, None]
    assert [t.physical_scaleup for t in results] == [1, 1]


def test_ranks_sharing_a_gpu(monkeypatch, clean_env):
    fake = FakeCuda([BUS[:1]] * 3, p2p=False)
    fake.install(monkeypatch)
    results, errors = run_ranks(fake, 3, lambda g: topology.detect_topology(g, 0))
    assert errors == [None] * 3
    assert results[0].physical_scaleup == 3 and results[0].num_ranks_per_gpu() == 3
    assert fake.peer_calls == []


def test_hidden_peer_gpus_raise_a_clear_error_on_every_rank(monkeypatch, clean_env):
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '0')
    fake = FakeCuda([[BUS[0]], [BUS[1]]])      # each process sees only its own GPU
    fake.install(monkeypatch)
    _, errors = run_ranks(fake, 2, lambda g: topology.detect_topology(g, 0))
    for e in errors:
        assert isinstance(e, RuntimeError), e
        msg = str(e)
        assert 'CUDA_VISIBLE_DEVICES' in msg and 'cannot see the GPU of rank(s) [1]' in msg
        assert 'torch.cuda.set_device' in msg and 'DEEPEP_CUPY_DEVICE' in msg and 'DEEPEP_CUPY_SCALEUP_SIZE=1' in msg


def test_hidden_peers_with_scaleup_one_use_nccl(monkeypatch, clean_env):
    monkeypatch.setenv('DEEPEP_CUPY_SCALEUP_SIZE', '1')
    fake = FakeCuda([[BUS[0]], [BUS[1]]])
    fake.install(monkeypatch)
    results, errors = run_ranks(fake, 2, lambda g: topology.detect_topology(g, 0))
    assert errors == [None, None]
    assert [(t.physical_scaleup, t.num_scaleup_ranks, t.num_scaleout_ranks) for t in results] == [(2, 1, 2)] * 2


def _fake_nvml(status_ok):
    nvml = types.SimpleNamespace(NVML_P2P_CAPS_INDEX_READ=0, NVML_P2P_STATUS_OK=0, calls=[])
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None

    def handle(bus):
        nvml.calls.append(bus)
        return bus
    nvml.nvmlDeviceGetHandleByPciBusId = handle
    nvml.nvmlDeviceGetP2PStatus = lambda a, b, cap: 0 if status_ok else 2
    return nvml


def test_nvml_topology_for_hidden_gpus(monkeypatch, clean_env):
    # NVML says the hidden peers are not P2P-capable: separate domains, no IPC, no error
    nvml = _fake_nvml(False)
    monkeypatch.setitem(sys.modules, 'pynvml', nvml)
    fake = FakeCuda([[BUS[0]], [BUS[1]]])
    fake.install(monkeypatch)
    results, errors = run_ranks(fake, 2, lambda g: topology.detect_topology(g, 0))
    assert errors == [None, None] and [t.physical_scaleup for t in results] == [1, 1]
    assert '00000000:1B:00.0' in nvml.calls      # NVML's 8-digit domain spelling

    # NVML says they are connected: one domain, which CUDA IPC cannot serve: the clear error
    monkeypatch.setitem(sys.modules, 'pynvml', _fake_nvml(True))
    _, errors = run_ranks(fake, 2, lambda g: topology.detect_topology(g, 0))
    assert all(isinstance(e, RuntimeError) and 'CUDA_VISIBLE_DEVICES' in str(e) for e in errors), errors


def _single(local_rank):
    g = group_mod.SingleProcessGroup()
    g.local_rank = local_rank
    return g


def test_select_device_order(monkeypatch, clean_env):
    fake = FakeCuda([BUS[:4]])
    fake.install(monkeypatch)
    fake.local.rank = 0
    assert topology.select_device(_single(6)) == 2                       # local rank modulo the visible devices
    monkeypatch.setenv('DEEPEP_CUPY_DEVICE', '3')
    assert topology.select_device(_single(6)) == 3                       # DEEPEP_CUPY_DEVICE
    monkeypatch.setattr(topology, '_torch_current_device', lambda: 1)
    assert topology.select_device(_single(6)) == 1                       # torch's current device wins
    assert topology.select_device(_single(6), device=0) == 0             # an explicit device wins over all
    with pytest.raises(ValueError, match='not a visible CUDA device'):
        topology.select_device(_single(0), device=4)


def test_torch_current_device_only_when_initialised(monkeypatch):
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: False,
                                                                  current_device=lambda: 5))
    monkeypatch.setitem(sys.modules, 'torch', fake_torch)
    assert topology._torch_current_device() is None
    fake_torch.cuda.is_initialized = lambda: True
    assert topology._torch_current_device() == 5
