"""launch/multinode_*.sh: the multi-host recipes start G ranks per host laid out host by host, forward deepep_cupy's
and NCCL's variables, and refuse bad arguments (checked with hosts that are all this machine)."""

import os
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One write(2) per rank (atomic on a pipe), so the ranks' lines never interleave.
PRINT_RANK = ('import os; e = os.environ; os.write(1, ("rank %s %s %s\\n" % (e.get("PMI_RANK", e.get('
              '"OMPI_COMM_WORLD_RANK", e.get("RANK"))), e.get("DEEPEP_CUPY_PROBE"), '
              'e.get("NCCL_NVLS_ENABLE"))).encode())')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _run(args, **env):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, 'PATH': os.path.dirname(sys.executable) + os.pathsep + os.environ['PATH'],
                               **env})


@pytest.mark.skipif(shutil.which('mpirun', path=os.path.dirname(sys.executable) + os.pathsep + os.environ['PATH'])
                    is None, reason='no mpirun (the [mpi] extra)')
def test_mpirun_hostfile_lays_out_ranks_and_forwards_variables(tmp_path):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('# two "hosts", both this machine\nlocalhost:1\nlocalhost:1\n')
    out = _run(['launch/multinode_mpirun.sh', str(hostfile), '1', sys.executable, '-c', PRINT_RANK],
               DEEPEP_CUPY_PROBE='yes')
    assert out.returncode == 0, out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith('rank'))
    assert lines == ['rank 0 yes 0', 'rank 1 yes 0']


def test_mpirun_recipe_refuses_a_missing_hostfile(tmp_path):
    out = _run(['launch/multinode_mpirun.sh', str(tmp_path / 'none'), '8', 'true'])
    assert out.returncode == 2 and 'hostfile' in out.stderr


@pytest.mark.parametrize('script', ['launch/multinode_mpirun.sh', 'launch/multinode_torchrun.sh'])
def test_usage(script):
    out = _run([script])
    assert out.returncode == 2 and 'usage' in out.stderr


def test_torchrun_one_node_two_ranks(tmp_path):
    pytest.importorskip('torch')
    if shutil.which('torchrun', path=os.path.dirname(sys.executable) + os.pathsep + os.environ['PATH']) is None:
        pytest.skip('no torchrun')
    prog = tmp_path / 'r.py'
    prog.write_text(PRINT_RANK)
    out = _run(['launch/multinode_torchrun.sh', '1', '0', '127.0.0.1', '2', str(prog)], MASTER_PORT=str(_free_port()),
               DEEPEP_CUPY_PROBE='yes')
    assert out.returncode == 0, out.stderr
    assert sorted(line for line in out.stdout.splitlines() if line.startswith('rank')) == ['rank 0 yes 0',
                                                                                             'rank 1 yes 0']
