"""deepep_cupy: expert-parallel (MoE) communication for NVIDIA GPUs, in pure Python.

Importing this package initialises no CUDA context and compiles nothing: the heavy modules load on first use.
"""

__version__ = '0.1.0'

# Public name -> module that defines it; resolved lazily (PEP 562) so `import deepep_cupy` stays cheap.
_LAZY = {
    'ElasticBuffer': 'deepep_cupy.buffers.elastic',
    'EPBuffer': 'deepep_cupy.buffers.ep',
    'EPHandle': 'deepep_cupy.buffers.elastic',
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
}

__all__ = ['__version__', 'topk_idx_t', *_LAZY]


def __getattr__(name):
    if name == 'topk_idx_t':
        # torch.int64 when torch is installed (DeepEP's default build), else numpy's int64.
        try:
            import torch
            return torch.int64
        except ImportError:
            import numpy
            return numpy.int64
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
