"""Host references of designs the package does not ship kernels for (today: the fused hybrid design of
deepep_cupy/features/hybrid/__init__.py), kept beside the tests that check them; the library never imports them."""
