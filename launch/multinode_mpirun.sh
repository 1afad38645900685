#!/usr/bin/env bash
# Start a deepep_cupy program on several hosts with mpirun and a hostfile: G ranks per host, laid out host by host
# (rank = host index * G + local index), one per GPU. Hybrid mode: every host is one scale-up (NVLink) domain, and
# rank r of each host joins rail r (one NCCL communicator per rail, made from ids sent over MPI).
#
#   launch/multinode_mpirun.sh HOSTFILE G python -m deepep_cupy.tests.ep [args...]
#
# HOSTFILE: one host per line (Open MPI: "host slots=G"; MPICH: "host:G"), the first one runs rank 0.
# Works with Open MPI and MPICH's mpiexec (the [mpi] extra); MPIRUN=/path/to/mpirun picks another one. Every host needs
# the same checkout and environment at the same path. NCCL picks the NIC nearest each GPU; NCCL_SOCKET_IFNAME /
# NCCL_IB_HCA steer it. NVLink multicast stays off (NCCL_NVLS_ENABLE=0) unless set.
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 HOSTFILE GPUS_PER_HOST COMMAND [ARGS...]" >&2
    exit 2
fi
hostfile=$1 g=$2; shift 2
[ -r "$hostfile" ] || { echo "deepep_cupy: hostfile $hostfile is not readable" >&2; exit 2; }
hosts=$(grep -cv '^\s*\(#\|$\)' "$hostfile")
n=$((hosts * g))
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export PYTHONUNBUFFERED=1
mpirun=${MPIRUN:-mpirun}
command -v "$mpirun" >/dev/null 2>&1 || { echo "deepep_cupy: no $mpirun on PATH: pip install -e \".[mpi]\"" >&2; exit 1; }
envs=(NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS PYTHONUNBUFFERED)
for v in $(compgen -e | grep -E '^(DEEPEP_CUPY_|NCCL_)' || true); do envs+=("$v"); done
if "$mpirun" --version 2>&1 | grep -q "Open MPI\|OpenRTE"; then
    fwd=(); for v in "${envs[@]}"; do fwd+=(-x "$v"); done
    exec "$mpirun" --hostfile "$hostfile" -np "$n" --map-by "ppr:$g:node" --bind-to none "${fwd[@]}" "$@"
fi
# MPICH (hydra)
exec "$mpirun" -f "$hostfile" -n "$n" -ppn "$g" -genvlist "$(IFS=,; echo "${envs[*]}")" "$@"
