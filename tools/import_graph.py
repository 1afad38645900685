"""Which deepep_cupy module imports which, at package level, and whether imports run one way.

    python tools/import_graph.py            # the package-level graph and any upward import
    python tools/import_graph.py --modules  # module-level edges

Layers, from the top: adapter (`deepep_cupy.v1`: DeepEP V1's `Buffer` over the engine; see its __init__) → api
(`deepep_cupy`, `deepep_cupy.buffers`) → features (`deepep_cupy.features`) → runtime / jit (`deepep_cupy.runtime`,
`deepep_cupy.jit`) → base (`deepep_cupy.constants`, `deepep_cupy.envs`). A module may import its own layer's modules
or lower layers' ones; a feature imports no other feature. So the engine (api and below) never imports the V1
adapter, except two modules that sit with it (`ADAPTER_MODULES`): `buffers.legacy`, V1's old import path (the
adapter's module under that name), and `buffers.shipped`, which gathers every layer's kernel specialisations.
`deepep_cupy.utils` and `deepep_cupy.tests` stand beside the library (tests, benchmarks): the library never imports
them. Every import counts, including those inside functions. tests/test_layers.py keeps the rule true.
"""

import argparse
import ast
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

PACKAGE = 'deepep_cupy'
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
BESIDE = ('utils', 'tests')                   # beside the library: may import anything, imported by nothing in it
# Top-level modules of the api layer besides the package itself: the buffers and the `deep_ep` alias with its runner.
API_MODULES = ('buffers', 'deep_ep_alias', 'as_deep_ep', '_deep_ep_bootstrap', 'comm')
# The adapter layer: DeepEP V1 (`deepep_cupy.v1`), and the two modules that sit with it (see the module docstring).
ADAPTERS = ('v1',)
ADAPTER_MODULES = ('buffers.legacy', 'buffers.shipped')
LAYERS = {'adapter': 4, 'api': 3, 'features': 2, 'runtime': 1, 'jit': 1, 'base': 0}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix('').parts)
    if parts[-1] == '__init__':
        parts.pop()
    return '.'.join(parts)


def imports_of(path: Path) -> Set[str]:
    """Every deepep_cupy module `path` imports (absolute or relative, at any depth of the file)."""
    name = module_name(path)
    package = name if path.name == '__init__.py' else name.rpartition('.')[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split('.')[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split('.')
                base = base[:len(base) - node.level + 1]
                target = '.'.join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ''
            if target.split('.')[0] != PACKAGE:
                continue
            # `from pkg import mod` imports a submodule when one exists.
            for a in node.names:
                sub = f'{target}.{a.name}'
                out.add(sub if _exists(sub) else target)
    return out


def _exists(module: str) -> bool:
    rel = Path(*module.split('.')[1:])
    return (ROOT / rel).with_suffix('.py').is_file() or (ROOT / rel / '__init__.py').is_file()


def package_of(module: str) -> str:
    """`deepep_cupy.features.ep.plan` → `features.ep`; top-level modules keep their name."""
    parts = module.split('.')[1:]
    if not parts:
        return '(api)'
    if parts[0] == 'features' and len(parts) > 1:
        return '.'.join(parts[:2])
    return parts[0]


def layer_of(module: str) -> Optional[str]:
    parts = module.split('.')[1:]
    if parts and (parts[0] in ADAPTERS or '.'.join(parts[:2]) in ADAPTER_MODULES):
        return 'adapter'
    if not parts or parts[0] in API_MODULES:
        return 'api'
    if parts[0] in ('features', 'runtime', 'jit'):
        return parts[0]
    if parts[0] in ('constants', 'envs'):
        return 'base'
    if parts[0] in BESIDE:
        return None
    return 'unknown'


def feature_of(module: str) -> Optional[str]:
    parts = module.split('.')[1:]
    return parts[1] if len(parts) > 1 and parts[0] == 'features' else None


def edges() -> List[Tuple[str, str]]:
    out = []
    for path in sorted(ROOT.rglob('*.py')):
        src = module_name(path)
        for dst in sorted(imports_of(path)):
            if dst != src:
                out.append((src, dst))
    return out


def violations(all_edges: List[Tuple[str, str]]) -> List[str]:
    """Imports that break the one-way rule (see the module docstring)."""
    bad = []
    for src, dst in all_edges:
        ls, ld = layer_of(src), layer_of(dst)
        if ls is None:
            continue                                  # utils / tests may import anything
        if ls == 'unknown':
            line = f'{src}: a module outside the layers (put it in v1, buffers, features, runtime, jit or base)'
            if line not in bad:
                bad.append(line)
        elif ld is None:
            bad.append(f'{src} imports {dst}: the library never imports utils or tests')
        elif ld == 'unknown' or LAYERS[ld] > LAYERS[ls]:
            bad.append(f'{src} ({ls}) imports {dst} ({ld}): upward')
        elif ls == ld == 'features' and feature_of(src) and feature_of(dst) and feature_of(src) != feature_of(dst):
            bad.append(f'{src} imports {dst}: one feature imports another')
    return bad


def package_graph(all_edges: List[Tuple[str, str]]) -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {}
    for src, dst in all_edges:
        s, d = package_of(src), package_of(dst)
        graph.setdefault(s, set())
        if s != d:
            graph[s].add(d)
    return graph


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--modules', action='store_true', help='print module-level edges')
    args = parser.parse_args(argv)
    all_edges = edges()
    if args.modules:
        for src, dst in all_edges:
            print(f'{src} -> {dst}')
    else:
        for pkg, deps in sorted(package_graph(all_edges).items()):
            print(f'{pkg:24} -> {", ".join(sorted(deps)) or "-"}')
    bad = violations(all_edges)
    for line in bad:
        print(f'VIOLATION {line}')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
