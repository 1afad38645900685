"""DeepEP V2.0's `deep_ep.utils.comm`: NCCL communicator handles and communication helpers. V2.5 moved them to
`deep_ep.comm`; both names give the same functions (`deepep_cupy.comm`)."""

from ..comm import (  # noqa: F401
    NCCLCommHandle,
    barrier,
    destroy_all_managed_nccl_comm,
    get_comm_stream,
    get_logical_domain_size,
    get_nccl_comm_handle,
    get_physical_domain_size,
)

__all__ = ['NCCLCommHandle', 'get_nccl_comm_handle', 'destroy_all_managed_nccl_comm', 'barrier', 'get_comm_stream',
           'get_physical_domain_size', 'get_logical_domain_size']
