"""`deep_ep.utils.event`: the CUDA event classes, re-exported (the same objects as `deepep_cupy.EventHandle` /
`deepep_cupy.EventOverlap`, defined in `deepep_cupy.runtime.event`)."""

from ..runtime.event import EventHandle, EventOverlap

__all__ = ['EventHandle', 'EventOverlap']
