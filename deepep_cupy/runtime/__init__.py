"""Runtime substrate: process group, topology, device binding, symmetric memory, NCCL, streams/events, interop."""
