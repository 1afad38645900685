#!/usr/bin/env bash
# Start a deepep_cupy (or DeepEP) program on several hosts with torchrun: run this once on EVERY host, with the same
# arguments except NODE_RANK. G ranks per host, laid out host by host (RANK = NODE_RANK * G + LOCAL_RANK), one per GPU.
# Each rank's init_dist() joins the torchrun job; hybrid mode makes every host one scale-up domain and rank r of each
# host joins rail r (one NCCL communicator per rail).
#
#   launch/multinode_torchrun.sh NNODES NODE_RANK MASTER_ADDR G -m deepep_cupy.tests.ep [args...]
#   launch/multinode_torchrun.sh NNODES NODE_RANK MASTER_ADDR G perf/ep_bench.py [args...]
#
# MASTER_PORT (default 29500) must be free on MASTER_ADDR (the host with NODE_RANK 0).
set -euo pipefail
if [ $# -lt 5 ]; then
    echo "usage: $0 NNODES NODE_RANK MASTER_ADDR GPUS_PER_HOST (-m MODULE | SCRIPT) [ARGS...]" >&2
    exit 2
fi
nnodes=$1 node_rank=$2 master=$3 g=$4; shift 4
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export PYTHONUNBUFFERED=1
exec "${TORCHRUN:-torchrun}" --nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$master" \
    --master-port "${MASTER_PORT:-29500}" --nproc-per-node "$g" "$@"
