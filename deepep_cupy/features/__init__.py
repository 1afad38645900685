"""The features of a buffer, one component each: EP dispatch/combine (`ep`), PP send/recv (`pp`), all-gather sessions
and reductions (`agrs`), engram (`engram`) and load balancing (`lb`), plus the GPU barrier and the peer-copy floor.

A component owns its state and its `destroy()`; the API classes in `deepep_cupy.buffers` create it on first use and
delegate to it. Components stand on the runtime and the JIT only: no component imports another, nor the API layer.
"""
