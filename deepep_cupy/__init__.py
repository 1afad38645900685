"""deepep_cupy: expert-parallel (MoE) communication for NVIDIA GPUs, in pure Python.

Importing this package initialises no CUDA context and compiles nothing: the heavy modules load on first use.
"""

__version__ = '0.1.0'

# Public name -> module that defines it; resolved lazily (PEP 562) so `import deepep_cupy` stays cheap.
_LAZY = {
    'ElasticBuffer': 'deepep_cupy.buffers.elastic',
    'EPBuffer': 'deepep_cupy.buffers.ep',
    'EPHandle': 'deepep_cupy.buffers.elastic',
    'BucketBuffer': 'deepep_cupy.buffers.bucket',
    'BucketSession': 'deepep_cupy.buffers.bucket',
    'PPBuffer': 'deepep_cupy.buffers.pp',
    'EngramBuffer': 'deepep_cupy.buffers.engram',
    'BufferBase': 'deepep_cupy.buffers.base',
    'BufferAllocator': 'deepep_cupy.buffers.allocator',
    'get_num_allocation_alignment': 'deepep_cupy.buffers.allocator',
    'get_num_tma_alignment': 'deepep_cupy.buffers.allocator',
    'get_num_rdma_alignment': 'deepep_cupy.buffers.allocator',
    'EventOverlap': 'deepep_cupy.runtime.event',
    'EventHandle': 'deepep_cupy.runtime.event',
    'ProcessGroup': 'deepep_cupy.runtime.group',
    'get_physical_domain_size': 'deepep_cupy.runtime.topology',
    'get_logical_domain_size': 'deepep_cupy.runtime.topology',
    'get_group': 'deepep_cupy.runtime.group',
    'install_as_deep_ep': 'deepep_cupy.deep_ep_alias',
    'destroy_all_managed_nccl_comm': 'deepep_cupy.comm',
    # DeepEP's V1 API: the V1 adapter (deepep_cupy/v1; its old path `deepep_cupy.buffers.legacy` is the same module)
    'Buffer': 'deepep_cupy.v1.buffer',
    'Config': 'deepep_cupy.v1.buffer',
}

# Public name -> module that IS the value (DeepEP V2.5's `deep_ep.comm`).
_LAZY_MODULES = {
    'comm': 'deepep_cupy.comm',
}

__all__ = ['__version__', 'topk_idx_t', *_LAZY, *_LAZY_MODULES]


def __getattr__(name):
    if name == 'topk_idx_t':
        # torch.int64 when torch is installed (DeepEP's default build), else numpy's int64.
        try:
            import torch
            return torch.int64
        except ImportError:
            import numpy
            return numpy.int64
    import importlib
    if name in _LAZY_MODULES:
        return importlib.import_module(_LAZY_MODULES[name])
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + '.')):
            raise
        # hasattr() and un-deferred annotations (`buffer: deep_ep.Buffer`) expect AttributeError for a missing name
        raise AttributeError(f'{__name__}.{name} is not available: {module} is not part of this installation') from e
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES) | {'topk_idx_t'})
