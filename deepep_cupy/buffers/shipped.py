"""Every kernel specialisation the package can request, by family: each feature contributes its own (CI compiles them
all for sm_90, tests/test_jit.py)."""

from typing import Dict, List

from ..constants import NUM_MAX_SCALEUP_RANKS
from ..features import barrier, ll, peer_copy
from ..features.agrs import bucket as bucket_kernels
from ..features.agrs import kernels as agrs_kernels
from ..features.engram import plan as engram_plan
from ..features.ep import kernels as ep_kernels
from ..features.hybrid import kernels as hybrid_kernels
from ..features.lb import plan as lb_plan
from ..features.pp import plan as pp_plan
from ..jit.launch import KernelSpec
from ..v1.kernels import internode as legacy_internode
from ..v1.kernels import internode_ll as legacy_internode_ll
from ..v1.kernels import layout as legacy_layout


def shipped_specs() -> Dict[str, List[KernelSpec]]:
    """Family name → every `KernelSpec` the library may load (all template arguments it may use)."""
    n = NUM_MAX_SCALEUP_RANKS
    specs: Dict[str, List[KernelSpec]] = {}
    for contribution in (barrier.shipped_specs(n), ep_kernels.shipped_specs(n), peer_copy.shipped_specs(n),
                         pp_plan.shipped_specs(), agrs_kernels.shipped_specs(n), engram_plan.shipped_specs(n),
                         lb_plan.shipped_specs(n), ll.shipped_specs(), legacy_layout.shipped_specs(),
                         legacy_internode.shipped_specs(), legacy_internode_ll.shipped_specs(),
                         bucket_kernels.shipped_specs(n),
                         hybrid_kernels.shipped_specs()):
        for family, family_specs in contribution.items():
            specs.setdefault(family, []).extend(family_specs)
    return specs
