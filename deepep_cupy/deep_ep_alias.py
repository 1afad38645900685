"""deepep_cupy under the name `deep_ep`: code that says `import deep_ep` or `from deep_ep.utils.math import ...` runs
on deepep_cupy unchanged, with one module object per module (`sys.modules['deep_ep.utils.envs'] is
sys.modules['deepep_cupy.utils.envs']`, so classes keep one identity).

A meta-path finder maps `deep_ep` to `deepep_cupy` and `deep_ep.X.Y` to `deepep_cupy.X.Y`, except for the DeepEP
module paths in `MODULE_MAP` whose counterpart lives elsewhere. Its loader puts the existing deepep_cupy module into
`sys.modules` under the `deep_ep` name (the module keeps its own name and spec). Nothing happens at import of this
module; `install_as_deep_ep()` (or `python -m deepep_cupy.as_deep_ep`) turns it on, and refuses to shadow a real
DeepEP installation unless forced.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Optional, Tuple

from . import envs

ALIAS = 'deep_ep'
TARGET = 'deepep_cupy'

# Directory holding the `deep_ep/__init__.py` bootstrap that `as_deep_ep` puts on PYTHONPATH for child processes.
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), '_deep_ep_bootstrap')

# DeepEP module path -> deepep_cupy modules to use, first existing one wins. Paths not listed map by the generic rule
# (`deep_ep.buffers.elastic` -> `deepep_cupy.buffers.elastic`, and so on).
MODULE_MAP = {
    'deep_ep.buffers.engram': ('deepep_cupy.buffers.engram', 'deepep_cupy.features.engram'),
    'deep_ep.buffers.pp': ('deepep_cupy.buffers.pp', 'deepep_cupy.features.pp'),
    'deep_ep.buffers.bucket': ('deepep_cupy.buffers.bucket', 'deepep_cupy.features.agrs'),
    'deep_ep.comm': ('deepep_cupy.comm', 'deepep_cupy.utils.comm'),
}

# DeepEP modules with no counterpart, and why (quoted in the error).
NO_COUNTERPART = {
    'deep_ep._C': 'deepep_cupy has no C++ extension: its kernels are compiled at run time with NVRTC',
    'deep_ep.utils.find_pkgs': 'deepep_cupy finds NCCL and NVRTC through CuPy',
}

# DeepEP modules that exist under the alias (for the error message listing what exists).
KNOWN = ('deep_ep', 'deep_ep.utils', 'deep_ep.utils.envs', 'deep_ep.utils.testing', 'deep_ep.utils.gate',
         'deep_ep.utils.refs', 'deep_ep.utils.math', 'deep_ep.utils.event', 'deep_ep.utils.semantic',
         'deep_ep.utils.comm', 'deep_ep.buffers', 'deep_ep.buffers.elastic', 'deep_ep.buffers.ep',
         'deep_ep.buffers.base', 'deep_ep.buffers.allocator', 'deep_ep.buffers.legacy', *MODULE_MAP)


def _exists(name: str) -> bool:
    """Whether module `name` can be imported (imports its parent packages)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError as e:
        # A missing package on the way to `name` means `name` is missing; any other missing module is a real error
        if e.name is not None and (name == e.name or name.startswith(e.name + '.')):
            return False
        raise


def resolve(fullname: str) -> Tuple[Optional[str], str]:
    """The deepep_cupy module standing for DeepEP module `fullname`, or `(None, why not)`."""
    if fullname == ALIAS:
        return TARGET, ''
    if fullname in NO_COUNTERPART:
        return None, NO_COUNTERPART[fullname]
    candidates = MODULE_MAP.get(fullname, (TARGET + fullname[len(ALIAS):],))
    for candidate in candidates:
        if _exists(candidate):
            return candidate, ''
    return None, f'none of {", ".join(candidates)} exists in this deepep_cupy'


def available() -> list:
    """The DeepEP module paths that resolve in this installation."""
    return [name for name in KNOWN if resolve(name)[0] is not None]


class _AliasLoader(importlib.abc.Loader):
    """Loads `deep_ep.X` by importing its deepep_cupy module and putting that very object into `sys.modules`."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        # A throwaway: the import system would overwrite the real module's __spec__ and __loader__ otherwise
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        # The import system returns sys.modules[name] after exec_module: the deepep_cupy module itself
        sys.modules[module.__name__] = importlib.import_module(self.target)


class DeepEPAliasFinder(importlib.abc.MetaPathFinder):
    """Finds `deep_ep` and `deep_ep.*` as their deepep_cupy modules (see `MODULE_MAP`)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIAS and not fullname.startswith(ALIAS + '.'):
            return None
        module, why = resolve(fullname)
        if module is None:
            raise ModuleNotFoundError(
                f'No module named {fullname!r}: deepep_cupy stands in for deep_ep and has no counterpart ({why}). '
                f'Modules it provides: {", ".join(available())}', name=fullname)
        is_package = hasattr(sys.modules.get(module), '__path__') or (
            importlib.util.find_spec(module).submodule_search_locations is not None)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module), is_package=is_package)


_finder = DeepEPAliasFinder()
_warned = False


def _is_bootstrap_path(path: str) -> bool:
    try:
        return os.path.realpath(path or '.') == os.path.realpath(BOOTSTRAP_DIR)
    except (OSError, ValueError):
        return False


def _spec_location(spec) -> str:
    if spec.origin not in (None, 'namespace'):
        return spec.origin
    return ', '.join(spec.submodule_search_locations or ()) or repr(spec)


def find_real_deep_ep() -> Optional[str]:
    """Where a real `deep_ep` would be imported from if deepep_cupy were not standing in (None if nowhere): the
    module already imported, else every import finder except ours, searching the path without our bootstrap."""
    current = sys.modules.get(ALIAS)
    if current is not None and current is not sys.modules.get(TARGET) and \
            not getattr(current, '__deepep_cupy_bootstrap__', False):
        return getattr(current, '__file__', None) or repr(current)
    for finder in sys.meta_path:
        if finder is _finder or isinstance(finder, DeepEPAliasFinder):
            continue
        try:
            if finder is importlib.machinery.PathFinder:
                spec = finder.find_spec(ALIAS, [p for p in sys.path if not _is_bootstrap_path(p)])
            elif hasattr(finder, 'find_spec'):
                spec = finder.find_spec(ALIAS, None)
            else:
                continue
        except (ImportError, ValueError, TypeError, AttributeError):
            continue
        if spec is None:
            continue
        location = _spec_location(spec)
        if any(_is_bootstrap_path(os.path.dirname(p)) for p in (spec.submodule_search_locations or ())):
            continue
        return location
    return None


def install_as_deep_ep(force: bool = False):
    """Make `import deep_ep` (and every `deep_ep.*` module) give deepep_cupy, in this process.

    Idempotent. Refuses to shadow a real DeepEP: if one is installed (or already imported), raises `ImportError`
    naming it, unless `force=True` or `DEEPEP_CUPY_SHADOW_DEEP_EP=1`, in which case it warns once on stderr and
    takes over the name (dropping already imported `deep_ep.*` modules).

    Args:
        force: shadow a real DeepEP installation.

    Returns:
        the `deepep_cupy` module (which `deep_ep` now is).
    """
    global _warned
    target = importlib.import_module(TARGET)
    if sys.modules.get(ALIAS) is target and _finder in sys.meta_path:
        return target
    real = find_real_deep_ep()
    if real is not None:
        if not (force or envs.shadow_deep_ep()):
            raise ImportError(
                f'a real DeepEP is installed ({real}); deepep_cupy will not stand in for deep_ep silently. Uninstall '
                f'it, or call deepep_cupy.install_as_deep_ep(force=True) / set DEEPEP_CUPY_SHADOW_DEEP_EP=1 to '
                f'shadow it.', name=ALIAS)
        if not _warned and not os.environ.get('DEEPEP_CUPY_SHADOW_WARNED'):
            print(f'deepep_cupy: standing in for deep_ep; the real DeepEP at {real} is shadowed', file=sys.stderr,
                  flush=True)
            os.environ['DEEPEP_CUPY_SHADOW_WARNED'] = '1'   # child processes inherit it: one warning per job
        _warned = True
        for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + '.')]:
            module = sys.modules[name]
            if not getattr(module, '__name__', '').startswith(TARGET):
                del sys.modules[name]
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    sys.modules[ALIAS] = target
    return target


def uninstall_deep_ep() -> None:
    """Undo `install_as_deep_ep` in this process: remove the finder and every `deep_ep*` entry of `sys.modules`."""
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + '.')]:
        del sys.modules[name]


# Environment variable the runner sets so that its child processes apply `torch_compat()` too.
TORCH_COMPAT_ENV = 'DEEPEP_CUPY_TORCH_COMPAT'


def torch_compat() -> None:
    """What DeepEP's test programs need from torch.distributed beyond an older torch or gloo:

    - `all_gather_single` and `reduce_scatter_single` (torch 2.12+) as aliases of `all_gather_into_tensor` /
      `reduce_scatter_tensor`, which take the same arguments (only names torch lacks are added);
    - `all_gather_into_tensor(out, x)` with `out` shaped `[world, *x.shape]` on a gloo group (ranks sharing a GPU get
      gloo from `init_dist`): NCCL accepts that shape, gloo wants `[world * x.shape[0], ...]`, so the output is passed
      as that view of the same memory (DeepEP's `tests/legacy/test_low_latency.py` gathers top-k this way).

    - ranks sharing GPUs in programs that bring their own `init_dist` (DeepEP v1.2.1's `tests/utils.py`:
      `init_process_group('nccl', device_id=cuda:local_rank)`, `torch.cuda.set_device(local_rank)`): see
      `share_gpu_compat`.

    Nothing happens without torch. The runner (`python -m deepep_cupy.as_deep_ep`) applies it in the program and in
    its child processes; library code never."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    share_gpu_compat()
    gather = getattr(dist, 'all_gather_into_tensor', None)
    if gather is not None and not getattr(gather, '_deepep_cupy_compat', False):
        def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
            if (output_tensor.dim() == input_tensor.dim() + 1 and input_tensor.dim() >= 1
                    and output_tensor.is_contiguous() and dist.get_backend(group) == 'gloo'):
                output_tensor = output_tensor.view(-1, *input_tensor.shape[1:])
            return gather(output_tensor, input_tensor, group=group, async_op=async_op)
        all_gather_into_tensor._deepep_cupy_compat = True
        all_gather_into_tensor.__doc__ = gather.__doc__
        dist.all_gather_into_tensor = all_gather_into_tensor
    for name, same in (('all_gather_single', 'all_gather_into_tensor'),
                       ('reduce_scatter_single', 'reduce_scatter_tensor')):
        if not hasattr(dist, name) and hasattr(dist, same):
            setattr(dist, name, getattr(dist, same))


def _shared_index(index, num_devices: int):
    """A device index past the visible devices, taken modulo their count (ranks sharing GPUs); others unchanged."""
    if isinstance(index, int) and not isinstance(index, bool) and num_devices > 0 and index >= num_devices:
        return index % num_devices, True
    return index, False


def share_gpu_compat() -> None:
    """Let a program that binds local rank i to `cuda:i` run with more local ranks than visible GPUs (logic runs on one
    GPU; the runner only): `torch.cuda.set_device(i)` and `init_process_group(device_id=cuda:i)` with i past the
    visible devices take `i % device_count`. A rank whose device was remapped, or every rank when
    `DEEPEP_CUPY_NCCL_HOST_PER_RANK=1` (several would-be nodes on one machine, whose local rank 0s share GPU 0), names
    its own NCCL host (`NCCL_HOSTID=deepep_cupy_rank<rank>` and NCCL's socket transports:
    `envs.emulate_nccl_host`) before an NCCL process group starts, so NCCL connects ranks it would otherwise
    refuse ("Duplicate GPU"). Indices that are valid keep their meaning, so a program on enough GPUs runs as before.
    Idempotent."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return
    set_device = torch.cuda.set_device
    if not getattr(set_device, '_deepep_cupy_compat', False):
        def shared_set_device(device):
            index = device.index if isinstance(device, torch.device) else device
            index, moved = _shared_index(index, torch.cuda.device_count())
            return set_device(index if moved else device)
        shared_set_device._deepep_cupy_compat = True
        shared_set_device.__doc__ = set_device.__doc__
        torch.cuda.set_device = shared_set_device
    init = dist.init_process_group
    if getattr(init, '_deepep_cupy_compat', False):
        return

    def shared_init_process_group(*args, **kwargs):
        moved = False
        device_id = kwargs.get('device_id')
        if isinstance(device_id, torch.device) and device_id.type == 'cuda':
            index, moved = _shared_index(device_id.index, torch.cuda.device_count())
            if moved:
                kwargs['device_id'] = torch.device('cuda', index)
        backend = kwargs.get('backend', args[0] if args else None)
        rank = kwargs.get('rank', -1)
        if ((moved or envs.nccl_host_per_rank()) and isinstance(backend, str) and 'nccl' in backend
                and isinstance(rank, int) and rank >= 0 and not envs.nccl_hosts_emulated()):
            envs.emulate_nccl_host(f'deepep_cupy_rank{rank}')
        return init(*args, **kwargs)
    shared_init_process_group._deepep_cupy_compat = True
    shared_init_process_group.__doc__ = init.__doc__
    dist.init_process_group = shared_init_process_group
