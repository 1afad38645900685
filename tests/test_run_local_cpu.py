"""launch/run_local.sh refuses a rank count that is not a positive integer, and a missing command, with its usage line
and exit status 2 (MPICH's mpirun itself runs one rank for `-np abc` or `-np 0`)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.dirname(sys.executable) + os.pathsep + os.environ['PATH']
PRINT_RANK = ('import os; e = os.environ; '
              'os.write(1, ("rank %s\\n" % e.get("PMI_RANK", e.get("OMPI_COMM_WORLD_RANK"))).encode())')


def _run(*args):
    return subprocess.run(['launch/run_local.sh', *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, 'PATH': PATH})


@pytest.mark.parametrize('args, reason', [
    ((), 'no NUM_RANKS and no command'),
    (('abc', 'true'), "NUM_RANKS must be a positive integer, got 'abc'"),
    (('0', 'true'), "NUM_RANKS must be a positive integer, got '0'"),
    (('00', 'true'), "NUM_RANKS must be a positive integer, got '00'"),
    (('-2', 'true'), "NUM_RANKS must be a positive integer, got '-2'"),
    (('1.5', 'true'), "NUM_RANKS must be a positive integer, got '1.5'"),
    (('2 ', 'true'), "NUM_RANKS must be a positive integer, got '2 '"),
    (('',), "NUM_RANKS must be a positive integer, got ''"),
    (('2',), 'no command to run'),
])
def test_bad_arguments_give_the_usage_and_status_2(args, reason):
    out = _run(*args)
    assert out.returncode == 2 and out.stdout == ''
    assert out.stderr.startswith('usage: launch/run_local.sh NUM_RANKS COMMAND [ARGS...]'), out.stderr
    assert out.stderr.splitlines()[-1] == f'launch/run_local.sh: {reason}'


@pytest.mark.skipif(shutil.which('mpirun', path=PATH) is None, reason='no mpirun (the [mpi] extra)')
def test_a_good_rank_count_starts_that_many_ranks():
    out = _run('02', sys.executable, '-c', PRINT_RANK)
    assert out.returncode == 0, out.stderr
    assert sorted(line for line in out.stdout.splitlines() if line.startswith('rank')) == ['rank 0', 'rank 1']
