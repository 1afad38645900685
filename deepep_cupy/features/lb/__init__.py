"""Load balancing with redundant experts: weight prefetch and gradient reduction over a redundancy mapping."""
