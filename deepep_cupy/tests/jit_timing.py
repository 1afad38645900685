"""JIT and start-up timings: `import deepep_cupy`, cold compile of the kernels one buffer needs (empty cache), and a
warm start (a second process that finds them in the cache).

    python -m deepep_cupy.tests.jit_timing [--num-ranks 2 --num-topk 8]
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from ..runtime import preflight
from . import cli

_CHILD = r'''
import json, sys, time
t0 = time.perf_counter()
import deepep_cupy
t_import = time.perf_counter() - t0
from deepep_cupy import constants
from deepep_cupy.features import barrier
from deepep_cupy.features.ep import kernels as ep_kernels
from deepep_cupy.jit import launch
import cupy
cupy.cuda.Device(0).use()
cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))   # create the CUDA context outside the timed region
num_ranks, num_topk = int(sys.argv[1]), int(sys.argv[2])
families = {'barrier': barrier.all_specs(num_ranks),
            **ep_kernels.specs_for(num_ranks, constants.topk_bucket(num_topk))}
out = {'import_s': t_import, 'families': {}}
t_all = time.perf_counter()
for family, specs in families.items():
    t = time.perf_counter()
    launch.load_kernels(specs)
    out['families'][family] = {'seconds': time.perf_counter() - t, 'num_kernels': len(specs)}
out['all_s'] = time.perf_counter() - t_all
out['process_s'] = time.perf_counter() - t0
print('RESULT ' + json.dumps(out))
'''


def run_child(cache_dir: str, num_ranks: int, num_topk: int) -> dict:
    env = dict(os.environ, DEEPEP_CUPY_JIT_CACHE_DIR=cache_dir)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, '-c', _CHILD, str(num_ranks), str(num_topk)], env=env,
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f'child failed:\n{proc.stdout}\n{proc.stderr}')
    line = [x for x in proc.stdout.splitlines() if x.startswith('RESULT ')][-1]
    result = json.loads(line[len('RESULT '):])
    result['wall_s'] = wall
    return result


def main(argv=None) -> int:
    parser = cli.jit_timing_parser()
    args = parser.parse_args(argv)
    preflight.check_cuda()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, '-c', 'import time; t = time.perf_counter(); import deepep_cupy; '
                           'import sys; print(time.perf_counter() - t); '
                           'print(int("cupy" in sys.modules), int("torch" in sys.modules))'],
                          capture_output=True, text=True, check=True)
    import_s, heavy = proc.stdout.split('\n', 1)
    print(f'[import] import deepep_cupy: {float(import_s) * 1e3:.1f} ms (cupy, torch imported: {heavy.split()}); '
          f'whole interpreter {1e3 * (time.perf_counter() - t0):.0f} ms')
    with tempfile.TemporaryDirectory(prefix='deepep_cupy_jit_') as cache:
        cold = run_child(cache, args.num_ranks, args.num_topk)
        warm = run_child(cache, args.num_ranks, args.num_topk)
    print(f'[jit] kernels of a buffer with {args.num_ranks} ranks and top-{args.num_topk}:')
    for name, r in (('cold', cold), ('warm', warm)):
        fams = ', '.join(f'{f} {v["num_kernels"]} kernels {v["seconds"] * 1e3:.1f} ms'
                         for f, v in r['families'].items())
        print(f'[jit] {name}: all families {r["all_s"] * 1e3:.1f} ms ({fams}); process start to kernels ready '
              f'{r["process_s"] * 1e3:.0f} ms; wall incl. interpreter {r["wall_s"] * 1e3:.0f} ms')
    ok = warm['all_s'] < 1.0
    print(f'[jit] warm start under 1 s: {"OK" if ok else "FAILED"}')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(preflight.run(main))
