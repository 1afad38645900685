"""`deep_ep` bootstrap: `python -m deepep_cupy.as_deep_ep` puts this directory on PYTHONPATH, so `import deep_ep` in
the program and in every Python process it starts gives deepep_cupy (this module replaces itself in `sys.modules`)."""

__deepep_cupy_bootstrap__ = True

import os  # noqa: E402

from deepep_cupy.deep_ep_alias import TORCH_COMPAT_ENV, install_as_deep_ep, torch_compat  # noqa: E402

install_as_deep_ep()
if os.environ.get(TORCH_COMPAT_ENV) == '1':     # set by the runner
    torch_compat()
