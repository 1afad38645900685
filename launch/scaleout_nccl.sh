#!/usr/bin/env bash
# Hybrid mode with NCCL rails, on one host: domain d runs on GPU d % (GPU count) and acts as host "node<d>"
# (DEEPEP_CUPY_HOST), so every rail joins two domains and the rail transport is NCCL (one communicator per rail, no
# world communicator). With fewer GPUs than domains (one GPU: logic only), domain d also names its own NCCL host
# (NCCL_HOSTID=node<d>), so NCCL accepts rail members on one GPU and joins them with its socket transport over the
# loopback (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo). Each shape runs twice: NCCL as it chooses (P2P over NVLink), then with
# NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, i.e. the socket transport over the loopback interface (what crosses a
# network between real nodes). Logic only (--skip-perf-test). Logs under $OUT (default ./out/scaleout_nccl).
#
#   bash launch/scaleout_nccl.sh [SHAPE...]        SHAPE = NxR (domains x ranks per domain), default: 2x1 2x2 2x4
#
# Each shape also runs with the pipelined dispatch (P2: DEEPEP_CUPY_HYBRID_PIPELINE=1, 32 rows per payload chunk;
# P2_ARGS: more arguments for its runs where domains share GPUs, e.g. --test-first-only: many more NCCL groups per call),
# and at the end perf/hybrid_pipeline.py times P2 against P1 at 2x1 (512 and 4096 tokens, hidden 7168; bitwise check
# of both first; skip with PIPELINE_PERF=0).
#
# Timings of the same 2x1 shape (hybrid dispatch / combine rows next to the one-domain path and refs' NCCL all-to-all,
# DeepEP's SO / SU GB/s, a per-stage [timeline]; launch/gpu_suite.sh bench runs it):
#   DEEPEP_CUPY_SCALEUP_SIZE=1 DEEPEP_CUPY_RAIL_TRANSPORT=nccl launch/run_local.sh 2 python perf/ep_bench.py --hybrid
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/scaleout_nccl}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export DEEPEP_CUPY_JIT_CACHE_DIR=${DEEPEP_CUPY_JIT_CACHE_DIR:-/tmp/deepep_cupy_jit}
PY=${PYTHON:-python3}
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
shapes=("$@")
[ ${#shapes[@]} -eq 0 ] && shapes=(2x1 2x2 2x4)
ARGS="--num-gpu-timeout-secs 60 --num-cpu-timeout-secs 120 --num-tokens 256 --hidden 2048 --num-experts 64 \
--skip-perf-test --num-create-destroy 1"
fails=0

# run NAME NUM_DOMAINS RANKS_PER_DOMAIN [VAR=VALUE...]: one rank program ($PROG, default the EP rank program); each
# rank finds its domain from its MPI rank (Open MPI or MPICH) and takes that domain's GPU and host name.
run() {
    local name=$1 n=$2 r=$3; shift 3
    local log="$OUT/${name//[^A-Za-z0-9_.-]/_}.log"
    local prog=${PROG:-"-m deepep_cupy.tests.ep $ARGS"}
    echo "=== [$name] ($n domains x $r ranks, NCCL rails)" | tee "$log"
    local hostid=''
    [ "$n" -gt "$NGPU" ] && hostid='NCCL_HOSTID=node$d'
    # past RUN_TIMEOUT: SIGUSR1 to every process of the run (each rank dumps its threads' Python stacks into the log),
    # SIGKILL 15 s later
    env "$@" DEEPEP_CUPY_RAIL_TRANSPORT=nccl timeout -s USR1 --kill-after=15 "${RUN_TIMEOUT:-900}" launch/run_local.sh \
        $((n * r)) bash -c "g=\${OMPI_COMM_WORLD_RANK:-\${PMI_RANK:-0}}; d=\$((g / $r)); export \
        DEEPEP_CUPY_HOST=node\$d $hostid DEEPEP_CUPY_DEVICE=\$((d % $NGPU)); exec $PY $prog" >> "$log" 2>&1
    local rc=$?
    tail -3 "$log"
    if [ $rc -ne 0 ]; then echo "FAIL(rc=$rc) $name"; fails=$((fails + 1)); else echo "PASS $name"; fi
}

if [ "$NGPU" -lt 1 ]; then
    echo "scaleout_nccl.sh needs a GPU; found none" >&2
    exit 2
fi
SOCKETS="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo"
for shape in "${shapes[@]}"; do
    n=${shape%x*}; r=${shape#*x}
    if [ "$n" -gt "$NGPU" ]; then
        # Domains share GPUs: NCCL between them only as separate NCCL hosts, over sockets.
        # shellcheck disable=SC2086
        run "hybrid $shape NCCL socket (an NCCL host per domain, sharing GPUs)" "$n" "$r" $SOCKETS
        # shellcheck disable=SC2086
        # (NCCL's connection set-up and proxy in the log: where a rank of a pipelined run waits)
        PROG="${PROG:-"-m deepep_cupy.tests.ep $ARGS"} ${P2_ARGS:-}" \
            run "hybrid $shape NCCL P2 pipelined (an NCCL host per domain)" "$n" "$r" $SOCKETS \
            DEEPEP_CUPY_HYBRID_PIPELINE=1 DEEPEP_CUPY_HYBRID_PIPELINE_ROWS=32 NCCL_DEBUG=INFO \
            NCCL_DEBUG_SUBSYS=INIT,P2P,NET,PROXY
        continue
    fi
    run "hybrid $shape NCCL" "$n" "$r"
    run "hybrid $shape NCCL socket (P2P and SHM off)" "$n" "$r" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
        NCCL_SOCKET_IFNAME=lo
    run "hybrid $shape NCCL P2 pipelined" "$n" "$r" DEEPEP_CUPY_HYBRID_PIPELINE=1 DEEPEP_CUPY_HYBRID_PIPELINE_ROWS=32
done
if [ "${PIPELINE_PERF:-1}" != 0 ] && [ "$NGPU" -ge 2 ]; then      # timings: one rank per GPU only
    PROG="perf/hybrid_pipeline.py --out $OUT" run "hybrid 2x1 NCCL P2 vs P1 perf" 2 1
fi
echo "scaleout_nccl: $fails failed"
[ $fails -eq 0 ]
