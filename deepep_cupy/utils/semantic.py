"""Small language helpers DeepEP's Python layer uses (`deep_ep.utils.semantic`)."""

import functools
import weakref
from typing import Any, Optional


def value_or(value: Optional[Any], default: Any) -> Any:
    """`value`, or `default` when `value` is None."""
    return default if value is None else value


def weak_lru(maxsize: Optional[int] = 128, typed: bool = False):
    """`functools.lru_cache` for methods, holding only a weak reference to `self` (so the cache never keeps an
    instance alive).

    Args:
        maxsize, typed: as `functools.lru_cache`.
    """
    def decorator(method):
        @functools.lru_cache(maxsize, typed)
        def cached(self_ref, *args, **kwargs):
            return method(self_ref(), *args, **kwargs)

        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            return cached(weakref.ref(self), *args, **kwargs)

        return wrapper

    return decorator
