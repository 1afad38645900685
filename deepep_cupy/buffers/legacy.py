"""DeepEP V1's old import path (`deep_ep.buffers.legacy`): this module IS `deepep_cupy.v1.buffer`, the V1 adapter's
`Buffer` and `Config` (see deepep_cupy/v1/__init__.py). It puts that very module object in `sys.modules` under this
name, as the `deep_ep` alias does, so `deepep_cupy.buffers.legacy.Buffer is deepep_cupy.v1.buffer.Buffer` and a
module attribute set through either name (the timeouts, say) is seen by both."""

import sys

from ..v1 import buffer as _buffer

sys.modules[__name__] = _buffer
