"""Expert-parallel dispatch and combine inside one scale-up (NVLink) domain."""
