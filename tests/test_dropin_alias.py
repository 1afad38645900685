"""The `deep_ep` name: one module object per module, find_spec, the runner (script and -m forms) with a
torch.multiprocessing.spawn child and a subprocess, refusal to shadow a real DeepEP. Each case runs in a fresh
interpreter, so this process never gets the alias."""

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_with(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ('DEEPEP_CUPY_SHADOW_DEEP_EP', 'DEEPEP_CUPY_SHADOW_WARNED', 'PYTHONPATH')}
    env['PYTHONPATH'] = os.pathsep.join([REPO, *extra.pop('path', [])])
    env.update(extra)
    return env


def run_py(code, cwd=None, **env):
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], capture_output=True, text=True,
                          env=env_with(**env), cwd=cwd or REPO, timeout=120)


def test_one_module_object_per_module():
    pytest.importorskip('torch')     # deep_ep.utils.math and refs need torch
    proc = run_py('''
        import importlib.util, sys
        assert importlib.util.find_spec('deep_ep') is None
        import deepep_cupy
        assert deepep_cupy.install_as_deep_ep() is deepep_cupy
        assert deepep_cupy.install_as_deep_ep() is deepep_cupy          # idempotent
        assert importlib.util.find_spec('deep_ep') is not None
        import deep_ep
        from deep_ep import ElasticBuffer, EPHandle
        from deep_ep.utils.envs import init_dist
        from deep_ep.utils import EventHandle, EventOverlap
        import deep_ep.utils.math, deep_ep.utils.refs, deep_ep.utils.event, deep_ep.buffers.elastic, deep_ep.comm
        assert deep_ep is deepep_cupy
        for name in ('utils', 'utils.envs', 'utils.math', 'utils.refs', 'utils.event'):
            assert sys.modules['deep_ep.' + name] is sys.modules['deepep_cupy.' + name], name
        assert sys.modules['deepep_cupy.utils.envs'].__spec__.name == 'deepep_cupy.utils.envs'
        assert sys.modules['deepep_cupy.utils.envs'].__name__ == 'deepep_cupy.utils.envs'
        assert EventOverlap is deepep_cupy.EventOverlap and EventHandle is deepep_cupy.EventHandle
        assert init_dist is deepep_cupy.utils.envs.init_dist
        assert deep_ep.buffers.elastic.ElasticBuffer is ElasticBuffer is deepep_cupy.ElasticBuffer
        assert deep_ep.comm is sys.modules['deepep_cupy.comm']
        assert importlib.util.find_spec('deep_ep.utils.math') is not None
        assert 'cupy' not in sys.modules                                  # the alias initialises no CUDA
        print('OK')
    ''')
    assert proc.returncode == 0 and proc.stdout.strip() == 'OK', proc.stderr


def test_unknown_module_names_what_exists():
    proc = run_py('''
        import deepep_cupy
        deepep_cupy.install_as_deep_ep()
        for name in ('deep_ep.no_such_module', 'deep_ep._C'):
            try:
                __import__(name)
            except ModuleNotFoundError as e:
                assert e.name == name, e.name
                assert 'deep_ep.utils.envs' in str(e) and 'deep_ep.buffers.elastic' in str(e), str(e)
            else:
                raise AssertionError(name)
        import deep_ep
        assert not hasattr(deep_ep, 'no_such_name')
        print('OK')
    ''')
    assert proc.returncode == 0 and proc.stdout.strip() == 'OK', proc.stderr


def test_v1_buffer_and_config():
    proc = run_py('''
        import sys
        import deepep_cupy
        deepep_cupy.install_as_deep_ep()
        import deep_ep
        from deep_ep.buffers.legacy import Buffer, Config
        assert deep_ep.Buffer is Buffer and deep_ep.Config is Config
        assert Buffer.__module__ == 'deepep_cupy.v1.buffer'
        assert sys.modules['deep_ep.buffers.legacy'] is sys.modules['deepep_cupy.buffers.legacy']
        assert Config(24, 8, 256).num_sms == 24 and Buffer.num_sms == 20 and Buffer.is_sm90_compiled()
        print('OK')
    ''')
    assert proc.returncode == 0 and proc.stdout.strip() == 'OK', proc.stderr


def test_missing_v1_names_are_attribute_errors():
    """vLLM evaluates `deep_ep.Buffer` in annotations and `hasattr` probes: never anything but AttributeError."""
    proc = run_py('''
        import deepep_cupy, importlib.util
        deepep_cupy.install_as_deep_ep()
        import deep_ep
        if importlib.util.find_spec('deepep_cupy.buffers') and importlib.util.find_spec('deepep_cupy.v1'):
            print('OK')       # the V1 buffer is there
        else:
            assert not hasattr(deep_ep, 'Buffer') and not hasattr(deep_ep, 'Config')
            try:
                deep_ep.Buffer
            except AttributeError as e:
                assert 'deepep_cupy.v1.buffer' in str(e)
                print('OK')
    ''')
    assert proc.returncode == 0 and proc.stdout.strip() == 'OK', proc.stderr


PROGRAM = '''
import os, subprocess, sys
import deep_ep
import deep_ep.utils.envs
import helper_mod                      # the script's own directory is sys.path[0]


def child(i, out):
    import sys
    import deep_ep
    import deep_ep.utils.envs
    same = sys.modules['deep_ep.utils.envs'] is sys.modules['deepep_cupy.utils.envs']
    with open(os.path.join(out, f'child{i}'), 'w') as f:
        f.write(f'{deep_ep.__name__} {same}')


if __name__ == '__main__':
    out = sys.argv[1]
    print('main', __name__, os.path.basename(sys.argv[0]), sys.argv[1:], deep_ep.__name__, helper_mod.X)
    import torch.multiprocessing as mp
    mp.spawn(child, args=(out,), nprocs=2)
    code = 'import deep_ep, sys; print(deep_ep.__name__, sys.modules["deep_ep"] is sys.modules["deepep_cupy"])'
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    print('subprocess', r.stdout.strip(), r.stderr[-500:])
    for i in range(2):
        print('spawned', open(os.path.join(out, f'child{i}')).read())
'''


@pytest.fixture
def program(tmp_path):
    pytest.importorskip('torch')
    prog_dir = tmp_path / 'prog'
    prog_dir.mkdir()
    (prog_dir / 'main.py').write_text(PROGRAM)
    (prog_dir / 'helper_mod.py').write_text('X = 42\n')
    out = tmp_path / 'out'
    out.mkdir()
    return prog_dir, out


def check_program_output(proc, out):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"main __main__ main.py ['{out}'] deepep_cupy 42", lines
    assert 'subprocess deepep_cupy True ' in lines
    assert lines.count('spawned deepep_cupy True') == 2, lines


def test_runner_script(program):
    prog_dir, out = program
    proc = subprocess.run([sys.executable, '-m', 'deepep_cupy.as_deep_ep', str(prog_dir / 'main.py'), str(out)],
                          capture_output=True, text=True, env=env_with(), cwd='/', timeout=180)
    check_program_output(proc, out)


def test_runner_module_from_a_checkout(program):
    """`-m MODULE`, and deepep_cupy not installed: found from the working directory only (no PYTHONPATH)."""
    prog_dir, out = program
    env = env_with(path=[str(prog_dir)])
    env['PYTHONPATH'] = str(prog_dir)           # deepep_cupy itself comes from the cwd (the checkout)
    proc = subprocess.run([sys.executable, '-m', 'deepep_cupy.as_deep_ep', '-m', 'main', str(out)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith('main __main__ main.py') and lines.count('spawned deepep_cupy True') == 2, lines


def test_runner_usage_errors():
    proc = subprocess.run([sys.executable, '-m', 'deepep_cupy.as_deep_ep'], capture_output=True, text=True,
                          env=env_with(), timeout=60)
    assert proc.returncode == 2 and 'no program given' in proc.stderr and 'usage' in proc.stderr
    proc = subprocess.run([sys.executable, '-m', 'deepep_cupy.as_deep_ep', '/no/such/file.py'], capture_output=True,
                          text=True, env=env_with(), timeout=60)
    assert proc.returncode == 2 and 'no such file' in proc.stderr


@pytest.fixture
def real_deep_ep(tmp_path):
    site = tmp_path / 'site'
    (site / 'deep_ep').mkdir(parents=True)
    (site / 'deep_ep' / '__init__.py').write_text('REAL = True\n')
    return site


def test_refuses_to_shadow_a_real_deep_ep(real_deep_ep):
    proc = run_py('''
        import deepep_cupy
        try:
            deepep_cupy.install_as_deep_ep()
        except ImportError as e:
            print(e)
        import deep_ep
        print('real' if getattr(deep_ep, 'REAL', False) else 'ours')
    ''', path=[str(real_deep_ep)])
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()
    assert str(real_deep_ep / 'deep_ep' / '__init__.py') in first
    assert 'force=True' in first and 'DEEPEP_CUPY_SHADOW_DEEP_EP=1' in first
    assert second == 'real'


def test_refuses_when_a_real_deep_ep_is_already_imported(real_deep_ep):
    proc = run_py('''
        import deep_ep, deepep_cupy
        try:
            deepep_cupy.install_as_deep_ep()
        except ImportError as e:
            print('refused', 'site/deep_ep' in str(e))
    ''', path=[str(real_deep_ep)])
    assert proc.stdout.strip() == 'refused True', proc.stderr


@pytest.mark.parametrize('how', ['force', 'env'])
def test_shadowing_when_asked_warns_once(real_deep_ep, how):
    proc = run_py(f'''
        import deep_ep, deepep_cupy, sys                 # the real one is imported first
        deepep_cupy.install_as_deep_ep({'force=True' if how == 'force' else ''})
        deepep_cupy.install_as_deep_ep({'force=True' if how == 'force' else ''})
        import deep_ep
        import deep_ep.utils.envs
        print(deep_ep is deepep_cupy, sys.modules['deep_ep.utils.envs'] is sys.modules['deepep_cupy.utils.envs'])
    ''', path=[str(real_deep_ep)], **({'DEEPEP_CUPY_SHADOW_DEEP_EP': '1'} if how == 'env' else {}))
    assert proc.returncode == 0 and proc.stdout.strip() == 'True True', proc.stderr
    assert proc.stderr.count('is shadowed') == 1 and str(real_deep_ep) in proc.stderr


def test_runner_refuses_then_forces(real_deep_ep, tmp_path):
    script = tmp_path / 'p.py'
    script.write_text('import deep_ep, subprocess, sys\n'
                      'print(deep_ep.__name__)\n'
                      'subprocess.run([sys.executable, "-c", "import deep_ep; print(deep_ep.__name__)"])\n')
    env = env_with(path=[str(real_deep_ep)])
    proc = subprocess.run([sys.executable, '-m', 'deepep_cupy.as_deep_ep', str(script)], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 1 and 'a real DeepEP is installed' in proc.stderr and '--force' in proc.stderr
    proc = subprocess.run([sys.executable, '-m', 'deepep_cupy.as_deep_ep', '--force', str(script)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ['deepep_cupy', 'deepep_cupy']
    assert proc.stderr.count('is shadowed') == 1                 # the child inherits the decision and stays quiet
