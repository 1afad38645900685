"""The house in numbers: files and lines per layer, environment knobs, shipped kernel specialisations, the longest
functions, and the import graph's upward edges (the figures a note on the code's shape gives before and after).

    python tools/house_numbers.py [--top 10] [--over 80] [--json]

Layers as tools/import_graph.py defines them (adapter, api, features, runtime / jit, base; utils and tests beside
the library); lines are physical lines of the `.py` files, kernels (`kernels_cu/`) counted apart. Knobs: the
`DEEPEP_CUPY_*` variables `deepep_cupy/envs.py` reads. Specialisations: `buffers.shipped.shipped_specs()` (imports
the package, no GPU needed).
"""

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import function_lengths  # noqa: E402
import import_graph  # noqa: E402


def layer_lines() -> dict:
    """`{layer: (files, lines)}` over the package's `.py` files, and `kernels` over `kernels_cu/`."""
    out = defaultdict(lambda: [0, 0])
    for path in sorted(import_graph.ROOT.rglob('*.py')):
        module = import_graph.module_name(path)
        layer = import_graph.layer_of(module) or module.split('.')[1]      # None: utils / tests, beside
        with open(path, encoding='utf-8') as f:
            n = sum(1 for _ in f)
        out[layer][0] += 1
        out[layer][1] += n
    for path in sorted((REPO / 'kernels_cu').rglob('*')):
        if path.suffix in ('.cu', '.cuh'):
            with open(path, encoding='utf-8') as f:
                out['kernels'][0] += 1
                out['kernels'][1] += sum(1 for _ in f)
    return {k: tuple(v) for k, v in out.items()}


def knobs() -> list:
    text = (import_graph.ROOT / 'envs.py').read_text(encoding='utf-8')
    return sorted(set(re.findall(r"DEEPEP_CUPY_[A-Z0-9_]+", text)))


def specialisations() -> dict:
    from deepep_cupy.buffers.shipped import shipped_specs
    return {family: len(specs) for family, specs in shipped_specs().items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--top', type=int, default=10, help='longest functions listed (features/)')
    p.add_argument('--over', type=int, default=80, help='count the functions of features/ longer than this')
    p.add_argument('--json', action='store_true')
    args = p.parse_args(argv)
    lines = layer_lines()
    rows = function_lengths.function_lengths(str(import_graph.ROOT / 'features'))
    everything = function_lengths.function_lengths(str(import_graph.ROOT))
    specs = specialisations()
    upward = import_graph.violations(import_graph.edges())
    result = {
        'layers': {k: {'files': f, 'lines': n} for k, (f, n) in sorted(lines.items())},
        'knobs': knobs(),
        'specialisations': specs,
        'features_functions_over': sum(1 for r in rows if r[0] > args.over),
        'package_functions_over': sum(1 for r in everything if r[0] > args.over),
        'longest_features': [(n, name, os.path.relpath(path, REPO)) for n, name, path, _ in rows[:args.top]],
        'upward_imports': upward,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for k, v in result['layers'].items():
        print(f'[layers] {k:10s} {v["files"]:4d} files {v["lines"]:7d} lines')
    print(f'[knobs] {len(result["knobs"])} DEEPEP_CUPY_* variables read by envs.py')
    print(f'[specialisations] {sum(specs.values())} shipped (' +
          ', '.join(f'{f} {n}' for f, n in sorted(specs.items())) + ')')
    print(f'[functions] over {args.over} lines: {result["features_functions_over"]} in features/, '
          f'{result["package_functions_over"]} in the package')
    for n, name, path in result['longest_features']:
        print(f'[longest] {n:4d}  {name}  {path}')
    print(f'[imports] {len(upward)} upward import(s)' + ''.join(f'\n  {v}' for v in upward))
    return 0


if __name__ == '__main__':
    sys.exit(main())
