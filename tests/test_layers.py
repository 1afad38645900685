"""The package's shape: imports run one way (adapter (V1) → api → features → runtime / jit → base; no feature
imports another; the library never imports `utils` or `tests`), and no library file grows past ~500 lines. The
import graph comes from tools/import_graph.py (`python tools/import_graph.py` prints it)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def _tool():
    spec = importlib.util.spec_from_file_location('import_graph', ROOT / 'tools' / 'import_graph.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_imports_run_one_way():
    tool = _tool()
    edges = tool.edges()
    assert len(edges) > 50
    assert tool.violations(edges) == []


def test_the_rule_catches_upward_and_sideways_imports():
    tool = _tool()
    bad = tool.violations([('deepep_cupy.jit.launch', 'deepep_cupy.features.ep.kernels'),
                           ('deepep_cupy.features.lb.feature', 'deepep_cupy.features.ep.plan'),
                           ('deepep_cupy.runtime.interop', 'deepep_cupy.buffers.base'),
                           ('deepep_cupy.features.ep.feature', 'deepep_cupy.utils.envs'),
                           ('deepep_cupy.buffers.elastic', 'deepep_cupy.features.ep.feature'),
                           ('deepep_cupy.features.ep.feature', 'deepep_cupy.features.ep.plan'),
                           ('deepep_cupy.utils.envs', 'deepep_cupy.buffers.elastic'),
                           # the V1 adapter sits above the engine: the engine never imports it, it imports the engine
                           ('deepep_cupy.features.ep.plan', 'deepep_cupy.v1.kernels.layout'),
                           ('deepep_cupy.buffers.elastic', 'deepep_cupy.v1.buffer'),
                           ('deepep_cupy.v1.normal', 'deepep_cupy.features.ep.feature'),
                           ('deepep_cupy.v1.internode', 'deepep_cupy.buffers.hybrid'),
                           ('deepep_cupy.buffers.legacy', 'deepep_cupy.v1.buffer')])
    assert len(bad) == 6 and all('upward' in b or 'another' in b or 'never imports' in b for b in bad)


def test_no_library_file_is_too_long():
    library = [p for p in (ROOT / 'deepep_cupy').rglob('*.py')
               if not {'tests', 'utils'} & set(p.relative_to(ROOT / 'deepep_cupy').parts)]
    assert len(library) > 30
    long = {str(p.relative_to(ROOT)): n for p in library if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
