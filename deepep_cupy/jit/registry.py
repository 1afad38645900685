"""Every kernel specialisation the package can request, by family (CI compiles all of them for sm_90)."""

from typing import Dict, List

from ..constants import NUM_MAX_SCALEUP_RANKS
from .launch import KernelSpec


def shipped_specs() -> Dict[str, List[KernelSpec]]:
    """Family name → every `KernelSpec` the library may load (all template arguments it may use)."""
    from .. import barrier
    specs: Dict[str, List[KernelSpec]] = {'barrier': []}
    for n in range(1, NUM_MAX_SCALEUP_RANKS + 1):
        specs['barrier'].append(barrier.barrier_spec(n))
    specs['barrier'] += [barrier.TEST_WRITE, barrier.TEST_CHECK]
    from ..ep import kernels as ep_kernels
    for n in range(1, NUM_MAX_SCALEUP_RANKS + 1):
        for k in ep_kernels.SUPPORTED_TOPK:
            for family, family_specs in ep_kernels.specs_for(n, k).items():
                known = specs.setdefault(family, [])
                known.extend(s for s in family_specs if s not in known)    # shared kernels (topk_range) once
    from .. import peer_copy
    specs['peer_copy'] = [peer_copy.peer_copy_spec(n) for n in range(1, NUM_MAX_SCALEUP_RANKS + 1)]
    from .. import agrs, engram, lb, pp
    from ..features import ll
    for module in (pp, agrs, engram, lb, ll):
        for family, family_specs in module.shipped_specs().items():
            specs.setdefault(family, []).extend(family_specs)
    return specs
