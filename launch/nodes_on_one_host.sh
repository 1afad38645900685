#!/usr/bin/env bash
# Start NUM_NODES copies of a DeepEP-style program on this host as if each were a node of its own: copy i gets
# WORLD_SIZE=NUM_NODES (nodes), RANK=i (node index), MASTER_ADDR=127.0.0.1 and one MASTER_PORT, as DeepEP's
# `init_dist` reads them; each copy spawns its own local ranks (`--num-processes`). Logic runs only: every rank of
# every would-be node shares this host's GPUs.
#
#   launch/nodes_on_one_host.sh NUM_NODES COMMAND [ARGS...]
#   e.g. DEEPEP_CUPY_SCALEUP_SIZE=8 launch/nodes_on_one_host.sh 2 \
#            python3 -m deepep_cupy.as_deep_ep .upstream/head/tests/legacy/test_internode.py --num-processes 8
#
# Each line of output is prefixed with `[node i]`. Exits with the first failing copy's status (the others are
# stopped NODE_GRACE_SECS, default 20, later: they would wait for the failed one until their own timeouts), else 0.
set -uo pipefail
usage() {
    echo "usage: $0 NUM_NODES COMMAND [ARGS...]   (NUM_NODES: a positive integer)" >&2
    [ -n "${1:-}" ] && echo "$0: $1" >&2
    exit 2
}
[ $# -ge 2 ] || usage "need NUM_NODES and a command"
[[ $1 =~ ^[0-9]{1,3}$ ]] && [ "$((10#$1))" -gt 0 ] || usage "NUM_NODES must be a positive integer, got '$1'"
n=$((10#$1)); shift
port=${MASTER_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export PYTHONUNBUFFERED=1
pids=()
for ((i = 0; i < n; i++)); do
    ( WORLD_SIZE=$n RANK=$i MASTER_ADDR=127.0.0.1 MASTER_PORT=$port exec "$@" ) \
        > >(sed -u "s/^/[node $i] /") 2>&1 &
    pids+=($!)
done
status=0
killer=
remaining=$n
while [ "$remaining" -gt 0 ]; do
    wait -n "${pids[@]}" 2>/dev/null
    rc=$?
    remaining=$((remaining - 1))
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
        status=$rc
        echo "[nodes] a node exited with status $rc; stopping the others in ${NODE_GRACE_SECS:-20} s" >&2
        ( sleep "${NODE_GRACE_SECS:-20}"; for p in "${pids[@]}"; do pkill -TERM -P "$p" 2>/dev/null; \
          kill -TERM "$p" 2>/dev/null; done ) &
        killer=$!
    fi
done
[ -n "$killer" ] && kill "$killer" 2>/dev/null
exit $status
