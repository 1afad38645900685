"""Shared pytest setup: tests marked `gpu` (alias `requires_gpu`) are skipped when no CUDA device is visible."""

import functools

import pytest

# `@requires_gpu` and `@pytest.mark.gpu` are the same marker; the skip is decided at collection time below.
requires_gpu = pytest.mark.gpu


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """Whether CuPy sees at least one CUDA device (False without CuPy, a driver or a device)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker('gpu') is not None]
    if gpu_items and not gpu_available():
        skip = pytest.mark.skip(reason='needs a CUDA GPU (cupy.cuda.runtime.getDeviceCount() failed or is 0)')
        for item in gpu_items:
            item.add_marker(skip)
