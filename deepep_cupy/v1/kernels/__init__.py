"""DeepEP V1's own kernels' launchers (kernels_cu/legacy_*.cu): `get_dispatch_layout`'s (layout), V1's internode
handle's (internode) and V1's low-latency layouts across domains (internode_ll), with host mirrors
(internode_reference). They need neither the EP engine nor symmetric memory."""
