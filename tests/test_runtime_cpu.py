"""Runtime pieces that run without a GPU: import side effects, process group, interop descriptions, env vars."""

import subprocess
import sys

import numpy as np
import pytest

from deepep_cupy import envs
from deepep_cupy.runtime import errors, group, interop


def test_import_has_no_side_effects():
    code = ('import sys, deepep_cupy; '
            'print(int("cupy" in sys.modules), int("torch" in sys.modules), int("mpi4py" in sys.modules))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ['0', '0', '0']


def test_lazy_public_names():
    import deepep_cupy
    assert deepep_cupy.EventOverlap.__name__ == 'EventOverlap'
    with pytest.raises(AttributeError):
        deepep_cupy.NoSuchName  # noqa: B018


def test_single_process_group(monkeypatch):
    for k in ('OMPI_COMM_WORLD_SIZE', 'PMI_SIZE', 'PMIX_RANK', 'MV2_COMM_WORLD_SIZE', 'MPI_LOCALNRANKS'):
        monkeypatch.delenv(k, raising=False)
    g = group.get_group()
    assert isinstance(g, group.SingleProcessGroup)
    assert (g.rank, g.size, g.local_rank, g.local_size, g.num_hosts) == (0, 1, 0, 1, 1)
    assert g.allgather_object({'a': 1}) == [{'a': 1}]
    assert g.broadcast_object('x') == 'x'
    g.check_same('value', 3)
    assert group.get_group(g) is g


def test_group_and_comm_together_is_an_error():
    with pytest.raises(ValueError, match='either group'):
        group.get_group(group=object(), comm=object())


def test_check_same_message_names_ranks():
    class Fake(group.ProcessGroup):
        def allgather_object(self, obj, timeout=None):
            return [obj, obj + 1, obj]
    pattern = r'num_bytes must be identical on every rank.*ranks \[0, 2\]: 4; ranks \[1\]: 5'
    with pytest.raises(ValueError, match=pattern):
        Fake(0, 3).check_same('num_bytes', 4)


def test_tensor_info_torch_cpu():
    torch = pytest.importorskip('torch')
    x = torch.zeros(4, 6, dtype=torch.bfloat16)
    info = interop.tensor_info(x, 'x')
    assert (info.kind, info.shape, info.strides, info.dtype, info.device) == ('torch', (4, 6), (6, 1), 'bfloat16', -1)
    assert info.is_contiguous() and info.nbytes == 48 and info.itemsize == 2
    assert not interop.tensor_info(x.t(), 'x').is_contiguous()
    assert interop.tensor_info(x[:, :1], 'x').strides == (6, 1)


def test_tensor_info_rejects_other_types():
    with pytest.raises(TypeError, match='x must be a torch.Tensor or a cupy.ndarray, got ndarray'):
        interop.tensor_info(np.zeros(3), 'x')


def test_env_parsing(monkeypatch):
    monkeypatch.setenv('DEEPEP_CUPY_SCALEUP_SIZE', '2')
    assert envs.scaleup_size() == 2
    monkeypatch.setenv('DEEPEP_CUPY_SCALEUP_SIZE', 'two')
    with pytest.raises(ValueError, match='DEEPEP_CUPY_SCALEUP_SIZE'):
        envs.scaleup_size()
    monkeypatch.setenv('DEEPEP_CUPY_JIT_DEBUG', 'yes')
    assert envs.jit_debug()
    monkeypatch.setenv('DEEPEP_CUPY_JIT_CACHE_DIR', '/tmp/x/../y')
    assert envs.jit_cache_dir() == '/tmp/y'


def test_error_record_message():
    record = np.array([1, 1, 0, 3, 7, 6, 0, 0], dtype=np.int32)
    with pytest.raises(TimeoutError, match='barrier: rank 0 waited for rank 3 .*expected signal 7, last seen 6'):
        errors.raise_if_timed_out(record, 5.0, 0)
    errors.raise_if_timed_out(np.zeros(8, dtype=np.int32), 5.0, 0)


def test_external_stream_wraps_a_raw_handle():
    pytest.importorskip('cupy')
    s = interop.external_stream(0x1234)
    assert s.ptr == 0x1234 and interop.external_stream(0x1234) is s


def test_torch_process_group_backend(tmp_path):
    """The torch.distributed backend (gloo, one process) behind the same interface."""
    torch = pytest.importorskip('torch')
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip('torch.distributed already initialised')
    dist.init_process_group('gloo', init_method=f'file://{tmp_path}/rdzv', world_size=1, rank=0)
    try:
        g = group.get_group(group=dist.group.WORLD)
        assert isinstance(g, group.TorchProcessGroup) and g.backend == 'torch'
        assert (g.rank, g.size, g.local_rank, g.local_size) == (0, 1, 0, 1)
        assert g.allgather_object({'k': torch.tensor([1, 2])})[0]['k'].tolist() == [1, 2]
        assert g.broadcast_object('id') == 'id'
        g.barrier()
        g.check_same('num_bytes', 2 << 20)
    finally:
        dist.destroy_process_group()
