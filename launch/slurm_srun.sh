#!/usr/bin/env bash
# Example SLURM job started by srun WITHOUT MPI (no mpi4py needed): every task's init_dist() reads SLURM_PROCID,
# SLURM_NTASKS, SLURM_LOCALID and the tasks per node, and meets the others at MASTER_ADDR:MASTER_PORT (defaults: the
# job's first node, and a port derived from the job id). Ranks are laid out node by node, one per GPU. Without torch
# the ranks meet over deepep_cupy's TCP group, which admits only ranks holding DEEPEP_CUPY_TCP_SECRET: one random
# secret per job is made here (unless set) and reaches every task through srun's environment.
#
#   sbatch launch/slurm_srun.sh [args of deepep_cupy.tests.ep...]
#   sbatch launch/slurm_srun.sh --deepep PROGRAM.py [ARGS...]    a DeepEP program through the deep_ep runner (it
#                                                               spawns its own ranks: use --ntasks-per-node=1)
#
#SBATCH --job-name=deepep_cupy
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=00:20:00
set -euo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export DEEPEP_CUPY_TCP_SECRET=${DEEPEP_CUPY_TCP_SECRET:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}
if [ "${1:-}" = "--deepep" ]; then
    shift
    # DeepEP's own programs: WORLD_SIZE = number of nodes, RANK = node index (DeepEP's init_dist convention)
    exec srun --cpu-bind=none bash -c 'WORLD_SIZE=$SLURM_NNODES RANK=$SLURM_NODEID exec python -m deepep_cupy.as_deep_ep "$@"' _ "$@"
fi
exec srun --mpi=none --cpu-bind=none python -m deepep_cupy.tests.ep "$@"
