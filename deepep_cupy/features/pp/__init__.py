"""Pipeline-parallel send/recv between ring neighbours (plan.py: sizes and bookkeeping; feature.py: the launch path)."""
