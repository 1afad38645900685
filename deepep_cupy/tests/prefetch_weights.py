"""`lb_prefetch_weights` rank program: the load-balancing program of `reduce_grads.py` run for the weight prefetch.

    mpirun -np N python -m deepep_cupy.tests.prefetch_weights [--num-experts 64 --num-redundant-experts 8
        --num-hidden-bytes 64M --empty-ratio 0.25 --pattern random|ring|spread --num-sms 0]

Each call prefetches two tensors (FP32 weights and BF16 scales); every hosted slot must hold its owner's expert bit
for bit, empty slots and the owners' weights must be untouched. The same argument, error, timeout and performance
checks as the gradient reduction (the bytes an owner pushes are the bytes it would pull there).
"""

import sys

from ..runtime import preflight
from . import cli

try:
    from .reduce_grads import main as _main
except ImportError as e:  # `--help` works without torch; a run names the extra that brings it
    preflight.exit_if_main(e, __name__, lambda: cli.lb_parser('prefetch'))
    raise


def main(argv=None) -> int:
    return _main(argv, op='prefetch')


if __name__ == '__main__':
    sys.exit(preflight.run(main))
