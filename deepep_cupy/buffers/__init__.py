"""The API layer: the buffer classes, named like DeepEP's modules (`deep_ep.buffers.X` ↔ `deepep_cupy.buffers.X`).

    base       BufferBase: process group, topology, symmetric memory, streams, GPU barrier
    elastic    ElasticBuffer (DeepEP V2), EPHandle
    ep         EPBuffer (DeepEP V2.5): dispatch / combine and load balancing
    bucket     BucketBuffer, BucketSession (DeepEP V2.5): in-place all-gather, reduce-scatter, all-reduce
    pp         PPBuffer (DeepEP V2.5): pipeline-parallel send / recv
    engram     EngramBuffer (DeepEP V2.5): layered lookup tables in GPU or host storage
    legacy     Buffer and Config (DeepEP V1): the old import path of the V1 adapter, deepep_cupy/v1 (this module IS
               `deepep_cupy.v1.buffer`)
    allocator  BufferAllocator and the alignment getters
    shipped    every kernel specialisation the buffers may request (CI compiles them all)
"""
