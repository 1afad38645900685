"""DeepEP V1 (legacy) pieces that need neither the EP engine nor symmetric memory: `get_dispatch_layout`'s kernel."""
