#!/usr/bin/env bash
# Start N ranks of a deepep_cupy program on this host with mpirun.
#
#   launch/run_local.sh N python -m deepep_cupy.tests.ep [args...]
#
# Works with Open MPI (root flags, oversubscription when ranks > cores) and MPICH (the [mpi] extra: pip install mpich).
# MPIRUN=/path/to/mpirun picks another one.
# Each rank binds to GPU (local rank % GPU count) itself; more ranks than GPUs share GPUs (logic tests only).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0) unless the caller set it explicitly.
set -euo pipefail
usage() {
    echo "usage: $0 NUM_RANKS COMMAND [ARGS...]   (NUM_RANKS: a positive integer)" >&2
    [ -n "${1:-}" ] && echo "$0: $1" >&2
    exit 2
}
[ $# -ge 1 ] || usage "no NUM_RANKS and no command"
# Checked here: MPICH's mpirun runs one rank for -np abc or -np 0, without a word.
[[ $1 =~ ^[0-9]{1,6}$ ]] && [ "$((10#$1))" -gt 0 ] || usage "NUM_RANKS must be a positive integer, got '$1'"
[ $# -ge 2 ] || usage "no command to run"
n=$((10#$1)); shift
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export PYTHONUNBUFFERED=1
mpirun=${MPIRUN:-mpirun}
if ! command -v "$mpirun" >/dev/null 2>&1; then
    echo "deepep_cupy: no $mpirun on PATH: pip install -e \".[mpi]\" (mpi4py with MPICH, mpirun lands in the" \
         "environment's bin/; activate it), or start the ranks with torchrun or srun (see the README, Launching)" >&2
    exit 1
fi
extra=()
if "$mpirun" --version 2>&1 | grep -q "Open MPI\|OpenRTE"; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
    # Local runs: no CPU binding (ranks may outnumber cores), shared-memory transport only.
    extra=(--bind-to none --mca btl self,vader,tcp)
fi
exec "$mpirun" "${extra[@]}" -np "$n" "$@"
