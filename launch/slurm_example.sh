#!/usr/bin/env bash
# Example SLURM job for several hosts (8 GPUs each). Ranks must be laid out host by host, one per GPU.
#
#   sbatch launch/slurm_example.sh
#
#SBATCH --job-name=deepep_cupy
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=00:20:00
set -euo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# srun starts one process per GPU; mpi4py picks up the PMI environment, and each rank binds to GPU
# SLURM_LOCALID through its local rank (override with DEEPEP_CUPY_DEVICE).
srun --mpi=pmix --cpu-bind=none python -m deepep_cupy.tests.ep "$@"
