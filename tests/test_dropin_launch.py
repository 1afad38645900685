"""Every launcher on the CPU: torchrun (real and its variables), SLURM srun variables, hand-set RANK/WORLD_SIZE,
mpirun, DeepEP's torch.multiprocessing.spawn form, with torch (gloo) and without it (our TCP group); a job announcing
more ranks than were started fails with a clear error within the timeout. The ranks are subprocesses running
`tests/launch_prog.py`."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from deepep_cupy.runtime import group as group_mod

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = os.path.join(REPO, 'tests', 'launch_prog.py')
LAUNCH_VARS = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR', 'MASTER_PORT',
               'TORCHELASTIC_RUN_ID', 'TORCHELASTIC_USE_AGENT_STORE', 'NO_TORCH', 'DEEPEP_CUPY_DEVICE',
               *group_mod.MPI_MARKERS)


def base_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(('SLURM_', 'OMPI_', 'PMI', 'MPI_', 'MV2_'))}
    env.update(PYTHONPATH=REPO, DEEPEP_CUPY_CPU_TIMEOUT_SECS='60', CUDA_VISIBLE_DEVICES='', PYTHONUNBUFFERED='1')
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def run_procs(cmds_envs, timeout=180):
    procs = [subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, env in cmds_envs]
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, o, e))
    return out


def results(outputs):
    found = []
    for rc, out, err in outputs:
        assert rc == 0, f'rank failed (rc {rc}):\n{out}\n{err[-3000:]}'
        found += [json.loads(line[len('RESULT '):]) for line in out.splitlines() if line.startswith('RESULT ')]
    return sorted(found, key=lambda r: r['rank'])


def torchrun_env(rank, size, port, **extra):
    return base_env(RANK=rank, WORLD_SIZE=size, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=size, MASTER_ADDR='127.0.0.1',
                    MASTER_PORT=port, TORCHELASTIC_RUN_ID='test', **extra)


def slurm_env(rank, size, port, **extra):
    return base_env(SLURM_PROCID=rank, SLURM_NTASKS=size, SLURM_LOCALID=rank, SLURM_NODEID=0,
                    SLURM_TASKS_PER_NODE=f'{size}', SLURM_JOB_NUM_NODES=1, SLURM_JOB_ID=4242, MASTER_PORT=port,
                    **extra)


# -------------------------------------------------------------------------------------------------------------------
# Reading the launcher's variables (no processes)


def test_detect_launch_torchrun():
    env = {'RANK': '5', 'WORLD_SIZE': '8', 'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '4', 'MASTER_ADDR': 'n0',
           'MASTER_PORT': '29500', 'TORCHELASTIC_RUN_ID': 'x', 'SLURM_PROCID': '0', 'SLURM_NTASKS': '2'}
    launch = group_mod.detect_launch(env)
    assert (launch.launcher, launch.rank, launch.size, launch.local_rank, launch.local_size) == \
        ('torchrun', 5, 8, 1, 4)
    assert (launch.master_addr, launch.master_port) == ('n0', 29500) and 'WORLD_SIZE=8' in launch.origin


def test_detect_launch_mpi_wins_over_slurm():
    env = {'OMPI_COMM_WORLD_SIZE': '4', 'OMPI_COMM_WORLD_RANK': '2', 'OMPI_COMM_WORLD_LOCAL_RANK': '0',
           'OMPI_COMM_WORLD_LOCAL_SIZE': '2', 'SLURM_PROCID': '0', 'SLURM_NTASKS': '4'}
    launch = group_mod.detect_launch(env)
    assert (launch.launcher, launch.rank, launch.size, launch.local_rank, launch.local_size) == ('mpi', 2, 4, 0, 2)
    launch = group_mod.detect_launch({'PMI_SIZE': '3', 'PMI_RANK': '1', 'MPI_LOCALNRANKS': '3', 'MPI_LOCALRANKID': '1'})
    assert (launch.launcher, launch.rank, launch.size, launch.local_rank, launch.local_size) == ('mpi', 1, 3, 1, 3)


def test_detect_launch_slurm():
    env = {'SLURM_PROCID': '7', 'SLURM_NTASKS': '7', 'SLURM_LOCALID': '0', 'SLURM_NODEID': '3',
           'SLURM_TASKS_PER_NODE': '2(x3),1', 'SLURM_JOB_NUM_NODES': '4', 'SLURM_JOB_NODELIST': 'gpu[07-10],cpu1',
           'SLURM_JOB_ID': '123456'}
    launch = group_mod.detect_launch(env)
    assert (launch.launcher, launch.rank, launch.size, launch.local_rank, launch.local_size) == ('slurm', 7, 7, 0, 1)
    assert (launch.master_addr, launch.master_port) == ('gpu07', 20000 + 123456 % 20000)
    env.update(MASTER_ADDR='head', MASTER_PORT='1234', SLURM_NODEID='1')
    launch = group_mod.detect_launch(env)
    assert (launch.master_addr, launch.master_port, launch.local_size) == ('head', 1234, 2)
    # One task: a plain process, not a job
    assert group_mod.detect_launch({'SLURM_PROCID': '0', 'SLURM_NTASKS': '1'}).launcher == 'none'
    single_node = {'SLURM_PROCID': '1', 'SLURM_NTASKS': '4', 'SLURM_LOCALID': '1'}
    assert group_mod.detect_launch(single_node).local_size == 4


def test_detect_launch_env_and_none():
    launch = group_mod.detect_launch({'RANK': '1', 'WORLD_SIZE': '2'})
    assert (launch.launcher, launch.rank, launch.size, launch.master_addr, launch.master_port) == \
        ('env', 1, 2, '127.0.0.1', 8361)
    assert group_mod.detect_launch({}).launcher == 'none'
    assert group_mod.detect_launch({'RANK': '0', 'WORLD_SIZE': '1'}).launcher == 'none'


def test_get_group_refuses_an_unjoined_multi_rank_environment(monkeypatch):
    torch = pytest.importorskip('torch')
    if torch.distributed.is_initialized():
        pytest.skip('torch.distributed already initialised in this process')
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(group_mod, '_default_group', None)
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setenv('LOCAL_RANK', '0')
    with pytest.raises(RuntimeError, match=r'rank 0 of a 2-rank job \(torchrun.*call deepep_cupy.utils.envs.init_dist'):
        group_mod.get_group()


# -------------------------------------------------------------------------------------------------------------------
# Real processes


@pytest.mark.parametrize('num_ranks', [2, 3])
def test_torchrun_variables_join_one_torch_world(num_ranks):
    pytest.importorskip('torch')
    port = free_port()
    out = results(run_procs([([sys.executable, PROG, 'join'], torchrun_env(r, num_ranks, port))
                             for r in range(num_ranks)]))
    assert [r['rank'] for r in out] == list(range(num_ranks))
    for r in out:
        assert r['size'] == num_ranks and r['torch_initialized'] and r['host_backend'] == 'torch'
        assert r['gathered'] == [10 * i for i in range(num_ranks)]
        assert r['group'] == 'ProcessGroup' and r['local_size'] == num_ranks and r['local_seed'] == 7 + r['rank']


@pytest.mark.skipif(shutil.which('torchrun', path=os.path.dirname(sys.executable)) is None, reason='no torchrun')
def test_real_torchrun():
    torchrun = shutil.which('torchrun', path=os.path.dirname(sys.executable))
    cmd = [torchrun, '--nproc-per-node', '2', '--master-port', str(free_port()), PROG, 'join']
    out = results(run_procs([(cmd, base_env())]))
    assert [(r['rank'], r['size'], r['gathered']) for r in out] == [(0, 2, [0, 10]), (1, 2, [0, 10])]
    assert all(r['torch_initialized'] and r['local_rank'] == r['rank'] for r in out)


def test_slurm_variables_join_one_torch_world():
    pytest.importorskip('torch')
    port = free_port()
    out = results(run_procs([([sys.executable, PROG, 'join'], slurm_env(r, 2, port)) for r in range(2)]))
    assert [(r['rank'], r['size'], r['gathered'], r['torch_initialized']) for r in out] == \
        [(0, 2, [0, 10], True), (1, 2, [0, 10], True)]


@pytest.mark.parametrize('make_env', [torchrun_env, slurm_env], ids=['torchrun', 'slurm'])
def test_without_torch_a_tcp_group(make_env):
    port = free_port()
    out = results(run_procs([([sys.executable, PROG, 'join'], make_env(r, 3, port, NO_TORCH=1)) for r in range(3)]))
    for r in out:
        assert (r['size'], r['host_backend'], r['group'], r['torch_initialized']) == (3, 'tcp', 'TcpProcessGroup',
                                                                                      False)
        assert r['gathered'] == [0, 10, 20] and r['local_size'] == 3


def test_refs_dispatch_over_torch_distributed():
    pytest.importorskip('torch')
    port = free_port()
    out = results(run_procs([([sys.executable, PROG, 'refs'], torchrun_env(r, 3, port)) for r in range(3)]))
    assert all(r['refs_ok'] for r in out) and len(out) == 3


def test_deepep_spawn_form():
    pytest.importorskip('torch')
    out = results(run_procs([([sys.executable, PROG, 'spawn', '2'], base_env(MASTER_PORT=free_port()))]))
    assert [(r['rank'], r['size'], r['local_rank']) for r in out] == [(0, 2, 0), (1, 2, 1)]
    for r in out:
        assert r['gathered'] == [0, 1] and r['sum'] == 3.0 and r['group'] == 'ProcessGroup'
        assert r['default_dtype'] == 'torch.bfloat16' and r['backend'] == 'gloo' and r['local_seed'] == 3 + r['rank']


def test_deepep_spawn_form_two_nodes():
    """DeepEP's convention: WORLD_SIZE counts nodes, RANK is the node index, ranks are node * local + local_rank."""
    pytest.importorskip('torch')
    port = free_port()
    out = results(run_procs([([sys.executable, PROG, 'spawn', '1'], base_env(MASTER_PORT=port, WORLD_SIZE=2, RANK=n))
                             for n in range(2)]))
    assert [(r['rank'], r['size'], r['local_rank'], r['gathered']) for r in out] == \
        [(0, 2, 0, [0, 1]), (1, 2, 0, [0, 1])]


def _mpirun():
    path = os.path.join(os.path.dirname(sys.executable), 'mpirun')
    return path if os.path.exists(path) else None


@pytest.mark.mpi
@pytest.mark.skipif(_mpirun() is None, reason='no mpirun next to the Python interpreter')
def test_mpirun_joins_mpi_and_torch():
    pytest.importorskip('mpi4py')
    pytest.importorskip('torch')
    out = results(run_procs([([_mpirun(), '-np', '2', sys.executable, PROG, 'join'], base_env())]))
    assert [(r['rank'], r['size'], r['gathered']) for r in out] == [(0, 2, [0, 10]), (1, 2, [0, 10])]
    assert all(r['host_backend'] == 'mpi' and r['torch_initialized'] and r['group'] == 'ProcessGroup' for r in out)


# -------------------------------------------------------------------------------------------------------------------
# A job announcing more ranks than were started


@pytest.mark.parametrize('make_env,variables', [(torchrun_env, 'WORLD_SIZE=2'), (slurm_env, 'SLURM_NTASKS=2')],
                         ids=['torchrun', 'slurm'])
@pytest.mark.parametrize('no_torch', [0, 1], ids=['torch', 'no-torch'])
def test_missing_rank_is_a_clear_error_within_the_timeout(make_env, variables, no_torch):
    env = make_env(0, 2, free_port(), NO_TORCH=no_torch, DEEPEP_CUPY_CPU_TIMEOUT_SECS=3)
    start = time.monotonic()
    (rc, out, err), = run_procs([([sys.executable, PROG, 'join'], env)], timeout=60)
    elapsed = time.monotonic() - start
    assert rc != 0 and 'RESULT' not in out
    last = err.strip().splitlines()[-1]
    assert last.startswith('TimeoutError') and 'missing ranks [1]' in last and variables in last, last
    assert elapsed < 30


def test_rank_zero_missing_is_a_clear_error():
    env = torchrun_env(1, 2, free_port(), DEEPEP_CUPY_CPU_TIMEOUT_SECS=3, NO_TORCH=1)
    (rc, _, err), = run_procs([([sys.executable, PROG, 'join'], env)], timeout=60)
    last = err.strip().splitlines()[-1]
    assert rc != 0 and 'could not reach rank 0' in last and 'WORLD_SIZE=2' in last, last
