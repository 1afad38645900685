"""NCCL bootstrap without a GPU: the unique-id exchange over a fake group, and a real `mpirun -np 4` run of the MPI
process group plus the id exchange (`tests/mpi_bootstrap_prog.py`)."""

import os
import subprocess
import sys

import pytest

from deepep_cupy.runtime import nccl
from deepep_cupy.runtime.group import ProcessGroup, SingleProcessGroup

pytest.importorskip('cupy')


class FakeGroup(ProcessGroup):
    """Rank `rank` of a group whose broadcast returns `root_value` (what rank 0 would have sent)."""

    def __init__(self, rank, size, root_value):
        super().__init__(rank, size)
        self.root_value = root_value
        self.broadcasts = []

    def allgather_object(self, obj, timeout=None):
        raise AssertionError('exchange_unique_id should broadcast, not all-gather')

    def broadcast_object(self, obj, root=0, timeout=None):
        self.broadcasts.append((obj, root))
        return obj if self.rank == root else self.root_value


def test_exchange_unique_id_single_process():
    uid = nccl.exchange_unique_id(SingleProcessGroup())
    assert len(uid) == 128


def test_exchange_unique_id_only_root_makes_it(monkeypatch):
    from cupy.cuda import nccl as cupy_nccl
    made = []
    monkeypatch.setattr(cupy_nccl, 'get_unique_id', lambda: made.append(1) or b'\x07' * 128)
    root = FakeGroup(0, 3, None)
    assert nccl.exchange_unique_id(root) == b'\x07' * 128
    assert root.broadcasts == [(b'\x07' * 128, 0)] and made == [1]
    other = FakeGroup(2, 3, b'\x09' * 128)
    assert nccl.exchange_unique_id(other) == b'\x09' * 128
    assert other.broadcasts == [(None, 0)] and made == [1]


def test_nccl_comm_destroy_is_idempotent():
    class FakeNcclCommunicator:
        destroyed = 0

        def destroy(self):
            self.destroyed += 1

    raw = FakeNcclCommunicator()
    comm = nccl.NcclComm(raw, 0, 1)
    comm.destroy()
    comm.destroy()
    assert raw.destroyed == 1 and comm.comm is None
    with pytest.raises(RuntimeError, match='destroyed'):
        comm._stream_ptr(None, None)


def _mpirun():
    path = os.path.join(os.path.dirname(sys.executable), 'mpirun')
    return path if os.access(path, os.X_OK) else None


@pytest.mark.mpi
@pytest.mark.skipif(_mpirun() is None, reason='no mpirun next to the Python interpreter')
def test_mpi_bootstrap_four_ranks():
    pytest.importorskip('mpi4py')
    num_ranks = 4
    prog = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'mpi_bootstrap_prog.py')
    proc = subprocess.run([_mpirun(), '-np', str(num_ranks), sys.executable, prog],
                          capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for rank in range(num_ranks):
        assert f'rank {rank}/{num_ranks}: bootstrap OK' in proc.stdout, output
