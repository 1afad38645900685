"""deepep_cupy: expert-parallel (MoE) communication for NVIDIA GPUs, in pure Python.

Importing this package initialises no CUDA context and compiles nothing: the heavy modules load on first use.
"""

__version__ = '0.1.0'

# Public name -> module that defines it; resolved lazily (PEP 562) so `import deepep_cupy` stays cheap.
_LAZY = {
    'BufferBase': 'deepep_cupy.buffer_base',
    'EventOverlap': 'deepep_cupy.runtime.event',
    'EventHandle': 'deepep_cupy.runtime.event',
    'ProcessGroup': 'deepep_cupy.runtime.group',
    'get_group': 'deepep_cupy.runtime.group',
    'topk_idx_t': 'deepep_cupy.constants',
}

__all__ = ['__version__', *_LAZY]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
