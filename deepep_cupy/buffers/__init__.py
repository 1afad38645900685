"""The API layer: the buffer classes, named like DeepEP's modules (`deep_ep.buffers.X` ↔ `deepep_cupy.buffers.X`).

    base       BufferBase: process group, topology, symmetric memory, streams, GPU barrier
    elastic    ElasticBuffer (DeepEP V2), EPHandle
    ep         EPBuffer (DeepEP V2.5)
    allocator  BufferAllocator and the alignment getters
    shipped    every kernel specialisation the buffers may request (CI compiles them all)
"""
