"""A buffer's `group` and `comm` arguments: an mpi4py communicator passed as `group` (DeepEP's `group` is a torch
ProcessGroup) or anything else that is not a process group raises a `TypeError` naming the argument, on every buffer
class, before torch or CUDA is touched."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepep_cupy.runtime import group

ROOT = Path(__file__).resolve().parents[1]


class MpiLike:
    """What an mpi4py communicator offers (the duck type the check looks for)."""

    rank, size = 0, 1

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, obj):
        return [obj]


class TorchLike:
    """What a torch.distributed ProcessGroup offers: rank() and size() methods."""

    def rank(self):
        return 0

    def size(self):
        return 1


def type_error(**kwargs) -> str:
    with pytest.raises(TypeError) as info:
        group.get_group(**kwargs)
    message = str(info.value)
    assert '\n' not in message
    return message


def test_an_mpi_communicator_as_group_names_both_arguments():
    message = type_error(group=MpiLike())
    assert message.startswith('group: got an mpi4py communicator (test_group_args_cpu.MpiLike)')
    assert 'torch.distributed ProcessGroup' in message and 'as comm=' in message


@pytest.mark.parametrize('value, shown', [(object(), 'got object'), (3, 'got int'), ('world', 'got str'),
                                          ([1, 2], 'got list')])
def test_a_group_that_is_no_process_group(value, shown):
    message = type_error(group=value)
    assert message.startswith('group must be None, a torch.distributed ProcessGroup or a deepep_cupy ProcessGroup')
    assert message.endswith(shown)


def test_a_comm_that_is_no_mpi_communicator():
    assert type_error(comm=object()) == 'comm must be None or an mpi4py communicator, got object'
    message = type_error(comm=TorchLike())
    assert '(a torch.distributed ProcessGroup goes to group=)' in message


def test_process_groups_still_pass(monkeypatch):
    single = group.SingleProcessGroup()
    assert group.get_group(single) is single
    made = []
    monkeypatch.setattr(group, 'TorchProcessGroup', lambda g: made.append(g) or 'torch group')
    torch_like = TorchLike()
    assert group.get_group(torch_like) == 'torch group' and made == [torch_like]
    monkeypatch.setattr(group, 'MPIProcessGroup', lambda c, timeout=None: ('mpi group', c))
    mpi_like = MpiLike()
    assert group.get_group(comm=mpi_like) == ('mpi group', mpi_like)


# Every buffer class with a real mpi4py communicator passed positionally as `group`; torch hidden, except for
# BucketBuffer, whose storage is a torch tensor (it imports torch first).
PROGRAM = r'''
import json, sys
if sys.argv[1] == 'no-torch':
    sys.modules['torch'] = None
from mpi4py import MPI
import deepep_cupy
calls = {
    'ElasticBuffer': lambda: deepep_cupy.ElasticBuffer(MPI.COMM_WORLD, num_max_tokens_per_rank=128, hidden=256,
                                                       num_topk=8),
    'EPBuffer': lambda: deepep_cupy.EPBuffer(MPI.COMM_WORLD, num_max_tokens_per_rank=128, hidden=256, num_topk=8),
    'Buffer': lambda: deepep_cupy.Buffer(MPI.COMM_WORLD, num_nvl_bytes=2 << 20),
    'PPBuffer': lambda: deepep_cupy.PPBuffer(MPI.COMM_WORLD, 2 << 20),
    'EngramBuffer': lambda: deepep_cupy.EngramBuffer(MPI.COMM_WORLD, 2 << 20, num_allocated_qps=1, qp_depth=1),
    'BucketBuffer': lambda: deepep_cupy.BucketBuffer(MPI.COMM_WORLD, 2 << 20),
}
names = ['BucketBuffer'] if sys.argv[1] == 'torch' else [n for n in calls if n != 'BucketBuffer']
out = {}
for name in names:
    try:
        calls[name]()
        out[name] = 'no error'
    except Exception as e:
        out[name] = f'{type(e).__name__}: {e}'
print(json.dumps(out))
'''


@pytest.mark.parametrize('mode', ['no-torch', 'torch'])
def test_every_buffer_class_refuses_an_mpi_communicator_as_group(mode):
    pytest.importorskip('mpi4py')
    if mode == 'torch':
        pytest.importorskip('torch')
    env = {'PATH': '/usr/bin:/bin', 'PYTHONPATH': str(ROOT), 'HOME': '/tmp'}
    proc = subprocess.run([sys.executable, '-c', PROGRAM, mode], capture_output=True, text=True, cwd='/',
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == (1 if mode == 'torch' else 5)
    for name, result in results.items():
        assert result.startswith('TypeError: group: got an mpi4py communicator (mpi4py.MPI.Intracomm)'), (name, result)
        assert 'as comm=' in result, (name, result)
