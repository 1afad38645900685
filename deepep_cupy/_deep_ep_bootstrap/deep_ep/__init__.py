"""`deep_ep` bootstrap: `python -m deepep_cupy.as_deep_ep` puts this directory on PYTHONPATH, so `import deep_ep` in
the program and in every Python process it starts gives deepep_cupy (this module replaces itself in `sys.modules`)."""

__deepep_cupy_bootstrap__ = True

from deepep_cupy.deep_ep_alias import install_as_deep_ep  # noqa: E402

install_as_deep_ep()
