#!/usr/bin/env bash
# Start N ranks of a deepep_cupy (or DeepEP) program on this host with torchrun instead of mpirun.
#
#   launch/torchrun.sh N -m deepep_cupy.tests.ep [args...]        a rank program (calls init_dist())
#   launch/torchrun.sh N perf/ep_bench.py [args...]                a script
#
# Every rank's init_dist() joins the torchrun job (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and initialises
# torch.distributed: NCCL + gloo when each rank has its own GPU, gloo alone when ranks share GPUs (N > GPU count,
# logic tests only). Each rank binds to GPU LOCAL_RANK % GPU count (DEEPEP_CUPY_DEVICE overrides).
# Several hosts: run it on each with TORCHRUN_ARGS="--nnodes H --node-rank I --master-addr HOST0 --master-port P".
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 NUM_RANKS (-m MODULE | SCRIPT) [ARGS...]" >&2
    exit 2
fi
n=$1; shift
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export PYTHONUNBUFFERED=1
torchrun=${TORCHRUN:-torchrun}
# shellcheck disable=SC2086
exec "$torchrun" ${TORCHRUN_ARGS:---standalone} --nproc-per-node "$n" "$@"
