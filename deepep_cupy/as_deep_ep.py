"""Run a DeepEP program on deepep_cupy, unchanged: `import deep_ep` gives deepep_cupy in the program and in every
Python process it starts (`torch.multiprocessing.spawn` children, subprocesses).

    python -m deepep_cupy.as_deep_ep [--force] SCRIPT [ARGS...]
    python -m deepep_cupy.as_deep_ep [--force] -m MODULE [ARGS...]

The program runs as `__main__` with `sys.argv` and `sys.path[0]` as `python SCRIPT` / `python -m MODULE` would set
them. Child processes get `deep_ep` through a bootstrap directory put first on `PYTHONPATH` (and on `sys.path`, which
spawned children copy). With a real DeepEP installed the runner refuses unless `--force` (or
`DEEPEP_CUPY_SHADOW_DEEP_EP=1`) is given. On a torch older than 2.12 the runner also gives `torch.distributed` the
`all_gather_single` / `reduce_scatter_single` names DeepEP's V2.5 programs call (aliases of `all_gather_into_tensor` /
`reduce_scatter_tensor`).
"""

import os
import runpy
import sys

USAGE = __doc__.split('\n\n')[1]


def _usage_error(message: str) -> int:
    print(f'deepep_cupy.as_deep_ep: {message}\nusage:\n{USAGE}', file=sys.stderr)
    return 2


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    force, module = False, None
    while argv and argv[0].startswith('-'):
        option = argv.pop(0)
        if option in ('-h', '--help'):
            print(__doc__)
            return 0
        if option == '--force':
            force = True
        elif option == '-m':
            if not argv:
                return _usage_error('-m needs a module name')
            module = argv.pop(0)
            break
        elif option == '--':
            break
        else:
            return _usage_error(f'unknown option {option}')
    if module is None and not argv:
        return _usage_error('no program given')

    from .deep_ep_alias import BOOTSTRAP_DIR, TORCH_COMPAT_ENV, install_as_deep_ep, torch_compat
    if force:
        os.environ['DEEPEP_CUPY_SHADOW_DEEP_EP'] = '1'      # children inherit the decision
    try:
        install_as_deep_ep(force=force)
    except ImportError as e:
        print(f'deepep_cupy.as_deep_ep: {e} (or pass --force)', file=sys.stderr)
        return 1
    if module is None and not os.path.exists(argv[0]):
        return _usage_error(f"can't open file {argv[0]!r}: no such file")

    # Children import deep_ep from the bootstrap, which imports deepep_cupy: from a checkout (not installed), the
    # directory holding the package must travel too.
    extra = [BOOTSTRAP_DIR, *_package_root_if_not_installed()]
    # DeepEP's V2.5 programs call torch.distributed names of torch 2.12+: alias them on an older torch, here and in
    # the children (see deep_ep_alias.torch_compat).
    os.environ[TORCH_COMPAT_ENV] = '1'
    torch_compat()
    os.environ['PYTHONPATH'] = os.pathsep.join([*extra, *filter(None, [os.environ.get('PYTHONPATH')])])
    sys.path[0] = os.getcwd() if module is not None else os.path.dirname(os.path.abspath(argv[0]))
    sys.path[1:1] = extra
    if module is not None:
        sys.argv = [module, *argv]
        runpy.run_module(module, run_name='__main__', alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name='__main__')
    return 0


def _package_root_if_not_installed() -> list:
    """The directory holding the `deepep_cupy` package, unless it is a site-packages directory."""
    import site
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    site_dirs = [*site.getsitepackages(), site.getusersitepackages()] if hasattr(site, 'getsitepackages') else []
    if any(os.path.realpath(root) == os.path.realpath(d) for d in site_dirs if d):
        return []
    return [root]


if __name__ == '__main__':
    sys.exit(main())
