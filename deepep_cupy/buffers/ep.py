"""`EPBuffer`: DeepEP V2.5's name for the EP buffer (`deep_ep.buffers.ep`)."""

from .elastic import ElasticBuffer, EPHandle

__all__ = ['EPBuffer', 'EPHandle']


class EPBuffer(ElasticBuffer):
    """DeepEP V2.5's name for the EP buffer (same machinery and arguments as `ElasticBuffer`)."""
