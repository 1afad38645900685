#!/usr/bin/env bash
# The GPU suite, for the GPU machine: install this checkout (no deps: the packages are preinstalled there), then run
# the rank programs, DeepEP's own test programs through the `deep_ep` runner, every launcher and the benchmarks.
# Logs go under $OUT (default ./out): suite.log (everything, lane by lane), summary.txt (one line per step).
#
#   bash launch/gpu_suite.sh [STAGE...]
#
# Stages (default: all but tune and firsthour):
#   info       versions, nvidia-smi
#   jit        cold and warm JIT timing
#   perf1      one rank alone on the GPU: the EP and low-latency rank programs with their perf lines, perf/ep_profile.py,
#              and the same for the pre-refactor snapshot in .baseline/ when it exists (side by side, same run)
#   ep         EP rank program: top-k buckets at one rank, 2/4/8 ranks sharing the GPUs, one rank per GPU, pressure;
#              the carved dispatch outputs' GPU pytest (ephost_lane)
#   hybrid     EP across scale-up domains (hybrid mode), ranks sharing GPU 0, rails through the IPC loopback:
#              2x1, 2x2, 2x4, 4x1 (domains x ranks, DEEPEP_CUPY_SCALEUP_SIZE), pressure, CUDA graph, timeout, errors
#              (launch/scaleout_nccl.sh runs NCCL rails across two GPUs); the same with the pipelined dispatch (P2,
#              DEEPEP_CUPY_HYBRID_PIPELINE=1) and perf/hybrid_pipeline.py (P2 against P1); all-gather / reduce-scatter
#              / all-reduce and PP send/recv 2x1, 2x2, 4x1, DeepEP's test_agrs.py and V2.5 test_pp.py 2x1 (lanes)
#   ll         low-latency rank program at 2/4/8 ranks sharing the GPUs (and one rank per GPU)
#   legacy     V1 Buffer (normal mode) rank program, 2/4/8 ranks and the dispatch knobs (legacy1: one rank, alone)
#   v25        the V2.5 API rank program (EPBuffer + load balancing, BucketBuffer, PPBuffer, EngramBuffer), 1/2/4 ranks
#   coll       PP, all-gather / reduce-scatter / all-reduce, engram, load balancing, allocation, barrier
#   deepep     DeepEP's own V2.0 and V1 test programs (.upstream/) through `python -m deepep_cupy.as_deep_ep`
#   deepep25   DeepEP's V2.5 test programs, the same way
#   gate       DeepEP's tests/utils/test_gate.py (minutes; GATE_TIMEOUT bounds it)
#   launchers  the EP rank program under torchrun and under SLURM-style variables (2 ranks)
#   host       the lean host path's GPU pieces (event pool across a graph capture, current_stream); its timings are
#              perf1's ep_profile and perf/host_api_gpu.py
#   pytest     the GPU pytest tests (alone, after the lanes: they read the device's free memory)
#   bench      perf/ep_bench.py and perf/ep_profile.py with one rank per GPU (needs 2 GPUs), and perf/ep_bench.py
#              --hybrid on 2 domains x 1 rank (DEEPEP_CUPY_SCALEUP_SIZE=1, NCCL rails across the two GPUs)
#   tune       reduce-scatter sweep and load-balancing ring patterns (needs 2 GPUs)
#   mps        hybrid P2 vs P1 (perf/hybrid_pipeline.py) with the two ranks on GPU 0 under CUDA MPS (not by default)
#   firsthour  the README's commands in a fresh virtual environment (next to the preinstalled packages)
#   frameworks Megatron-Core's MoE layer on our deep_ep (tests.megatron_moe: EP=1, and EP=2 with both ranks on GPU 0,
#              Megatron's NCCL groups through per-rank NCCL_HOSTIDs; megatron-core from a wheel in .whl/ when it is not
#              installed) and the vLLM / SGLang call replay (tests.serving_replay) at 1, 2 and 4 ranks sharing GPU 0
#   nccl1      scale-out over real NCCL on one GPU (each domain its own NCCL_HOSTID, NCCL's sockets over lo):
#              launch/scaleout_nccl.sh 2x1 (all modes, graph, errors, missing rank) and 2x2 (deterministic), P1 and
#              P2 each; PP 2x1 over NCCL links and all-gather / reduce-scatter 2x1 over NCCL rails, with their
#              timeout cases; beside them EP 4x1 and 2x4, PP and all-gather 2x2, the barrier 2x1, and DeepEP's
#              test_ep.py (2x1, 2x2), test_agrs.py and V2.5 pp/test_pp.py over NCCL rails; NCCL references at np=2
#              (perf/ep_bench.py's refs and a2a paths, DeepEP V2.5's bucket programs) (parallel beside faults)
#   internode  V1 Buffer across scale-up domains (tests.legacy_internode, tests.legacy_low_latency_internode): 2x1,
#              2x2, 4x1, 2x4 over loopback rails, 2x2 (normal mode) over NCCL rails (parallel); then alone, DeepEP's
#              own internode programs as two would-be nodes on this host (launch/nodes_on_one_host.sh): HEAD
#              legacy/test_internode.py and v1.2.1 test_internode.py at 2 x 8 ranks, legacy/test_low_latency.py and
#              v1.2.1 test_low_latency.py at 2 x 2, over loopback rails and over NCCL rails
#   faults     tests.faults: a rank SIGKILLed before a dispatch, inside a dispatch's host wait, before a combine,
#              inside a low-latency call, inside a CUDA-graph replay; 2 and 4 ranks, CUDA IPC and NCCL rails
#   fuse       the fused notify + dispatch (DEEPEP_CUPY_EP_FUSED_NOTIFY=1; the library default only at one rank
#              without expansion): the EP rank program at 1/2/4/8 ranks sharing GPU 0 (bit-exact checks; no-sync
#              dispatches take the fused kernel), the missing-rank check without CPU sync, the V1 adapter and DeepEP's
#              test_ep.py with it (parallel; perf1 profiles the fused default and the two kernels alone)
# SUITE_SECS=N bounds the whole run to N seconds (each step's limit shrinks to what is left; steps with no time left
# are recorded as SKIP(time)): set it a little under a device call's limit.
# STEP_FILTER=REGEX keeps only the steps whose names match (e.g. STEP_FILTER='test_pp|gate' ... deepep gate);
# STEP_EXCLUDE=REGEX drops the steps whose names match (e.g. STEP_EXCLUDE='MPS|baseline'); STEP_LIST=FILE keeps only
# the steps named in FILE, one exact name per line. launch/verify_steps.txt is the verification of a one-GPU machine in
# one device call (~7 min: every logic lane at once on one GPU runs out of its memory, so it leaves some steps out):
#   STEP_LIST=launch/verify_steps.txt bash launch/gpu_suite.sh perf1 ep legacy fuse coll hybrid host deepep deepep25 ll
# Stages marked parallel below run their steps in lanes at the same time (logic only: ranks share the GPU anyway);
# perf1 and bench run alone.
set -uo pipefail
[ -n "${STEP_LIST:-}" ] && STEP_LIST=$(realpath "$STEP_LIST")
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG=$OUT/suite.log
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
SUITE_END=$(( $(date +%s) + ${SUITE_SECS:-0} ))
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export DEEPEP_CUPY_JIT_CACHE_DIR=${DEEPEP_CUPY_JIT_CACHE_DIR:-/tmp/deepep_cupy_jit}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=${PYTHON:-python3}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(info jit perf1 ep ll legacy coll hybrid fuse deepep deepep25 gate launchers host pytest
                                   bench frameworks)
want() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

# step NAME TIMEOUT_S COMMAND...: run, log, record PASS/FAIL with the wall time. Each step's output lands in suite.log
# as soon as the step ends (under a lock: lanes run steps at the same time), so a run cut short keeps what finished.
step() {
    local name=$1 limit=$2; shift 2
    # STEP_FILTER (a bash regex) keeps only the steps whose names match it: re-runs of a few steps of several stages.
    [ -n "${STEP_FILTER:-}" ] && ! [[ $name =~ $STEP_FILTER ]] && return 0
    [ -n "${STEP_EXCLUDE:-}" ] && [[ $name =~ $STEP_EXCLUDE ]] && return 0
    [ -n "${STEP_LIST:-}" ] && ! grep -qxF -- "$name" "$STEP_LIST" && return 0
    # SUITE_SECS: the whole run's budget (a device call's limit). A step gets at most what is left of it less 20 s, so
    # that it ends (with its stack dumps) before the call does; a step with under 30 s left is recorded as skipped.
    if [ -n "${SUITE_SECS:-}" ]; then
        local left=$(( SUITE_END - $(date +%s) - 20 ))
        if [ "$left" -lt 30 ]; then
            { flock 9; printf '%-58s %-12s %8d ms\n' "$name" "SKIP(time)" 0 >> "$SUMMARY"; } \
                9>> /tmp/deepep_cupy_gpu_suite.lock
            return 0
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    # (the step's log stays under $OUT/running/ until it ends: a run cut short brings back what the running steps
    # printed)
    local tmp; mkdir -p "$OUT/running"; tmp=$(mktemp -p "$OUT/running")
    echo "=== [$name] $*" >> "$tmp"
    local t0; t0=$(date +%s%N)
    # Past the limit every process of the step gets SIGUSR1 (our rank programs dump each thread's Python stack and go
    # on, anything else ends), then SIGKILL 15 s later.
    timeout -s USR1 --kill-after=15 "$limit" "$@" >> "$tmp" 2>&1
    local rc=$?
    local dt=$(( ($(date +%s%N) - t0) / 1000000 ))
    local verdict=PASS; [ "$rc" -ne 0 ] && verdict="FAIL(rc=$rc)"
    local line; line=$(printf '%-58s %-12s %8d ms' "$name" "$verdict" "$dt")
    echo "$line" >> "$tmp"
    { flock 9; cat "$tmp" >> "$LOG"; echo "$line" >> "$SUMMARY"; } 9>> /tmp/deepep_cupy_gpu_suite.lock
    rm -f "$tmp"
}
# lane FUNCTION [ARGS]: run in the background until `join`. LANES_MAX (default: no bound) caps the lanes running at
# once: an 80 GB H100 runs out of memory with five lanes of big rank programs beside each other.
lane() {
    if [ -n "${LANES_MAX:-}" ]; then
        while [ "$(jobs -rp | wc -l)" -ge "$LANES_MAX" ]; do wait -n; done
    fi
    ( export MASTER_PORT; "$@" ) &
}
join() { wait; }

$PY -m pip install -q -e . --no-deps --no-build-isolation >> "$LOG" 2>&1 || echo "pip install failed" | tee -a "$SUMMARY"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
R="launch/run_local.sh"
ONE="env CUDA_VISIBLE_DEVICES=0"      # logic runs: every rank on GPU 0
# NCCL between ranks sharing a GPU (each its own NCCL_HOSTID): sockets over the loopback, no P2P / SHM / IB
SOCK="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo"

if want info; then
    { nvidia-smi; nvidia-smi topo -m; $PY -c "import cupy, numpy, sys; print('python', sys.version.split()[0],
'cupy', cupy.__version__, 'numpy', numpy.__version__); import torch; print('torch', torch.__version__);
import mpi4py; print('mpi4py', mpi4py.__version__); from cupy.cuda import nccl; print('nccl', nccl.get_version());
from cupy_backends.cuda.libs import nvrtc; print('nvrtc', nvrtc.getVersion())"; mpirun --version | head -1; } \
        >> "$LOG" 2>&1
fi
if want jit; then
    rm -rf "$DEEPEP_CUPY_JIT_CACHE_DIR"
    step "jit timing (cold/warm)" 300 $PY -m deepep_cupy.tests.jit_timing
fi

EP="$PY -m deepep_cupy.tests.ep --num-gpu-timeout-secs 60 --num-cpu-timeout-secs 120"
LL="$PY -m deepep_cupy.tests.legacy_low_latency --num-gpu-timeout-secs 60"
if want perf1; then
    # Alone on the GPU: one rank, checks then perf lines; the snapshot before the refactor beside it when present.
    step "ep np=1 (perf)" 240 $ONE $R 1 $EP --num-create-destroy 5
    # (at one rank the default no-sync dispatch is the fused kernel: beside it, the notify and dispatch kernels; the
    # host rows again after the profiled timelines, beside the ones taken before any profiler ran)
    step "ep_profile np=1 (default vs two kernels)" 240 $ONE $R 1 $PY perf/ep_profile.py --tokens 128,4096 \
        --variants default,two-kernels --host-again
    # Kernel spans of CUDA-graph replays with a decode-sized buffer and a 4096-token one, beside an empty kernel and a
    # plain copy (perf/kernel_probe.py; decode and copy-ratio figures).
    step "kernel_probe np=1 (graph spans, decode and 4096 buffers)" 200 $ONE $PY perf/kernel_probe.py
    # What each CUDA API call costs from Python here (weighs perf/host_path_cpu.py's [api] counts).
    step "host API costs (perf/host_api_gpu.py)" 300 $ONE $PY perf/host_api_gpu.py
    step "ep_profile np=1 on a side stream (host path)" 240 $ONE $R 1 $PY perf/ep_profile.py --tokens 128 \
        --variants default --side-stream
    # Two ranks sharing GPU 0, for the host rows a single rank cannot give: PP send / recv (<= 25 us per
    # call); its kernel figures are logic-grade (both ranks' kernels share the GPU).
    step "ep_profile np=2 (sharing GPU 0: PP and the features' host rows)" 240 $ONE $R 2 $PY perf/ep_profile.py \
        --tokens 128 --variants default --graph-max-tokens 0
    if [ -d .baseline/deepep_cupy ]; then
        step "baseline: ep np=1 (perf)" 240 bash -c "cd .baseline && CUDA_VISIBLE_DEVICES=0 $ROOT/$R 1 \
            $PY -m deepep_cupy.tests.ep --num-gpu-timeout-secs 60 --num-cpu-timeout-secs 120 --num-create-destroy 0 \
            --skip-timeout-test"
        step "baseline: ep_profile np=1" 180 bash -c "cd .baseline && CUDA_VISIBLE_DEVICES=0 $ROOT/$R 1 \
            $PY perf/ep_profile.py --tokens 128,4096"
    fi
    [ -f deepep_cupy/tests/legacy_low_latency.py ] && step "ll np=1 (perf)" 240 $ONE $R 1 $LL
    # Where the low-latency kernels' time goes: variants of ep_ll.cu's measurement hooks beside the shipped kernels,
    # and Nsight Compute's sections of one FP8 dispatch, one BF16 dispatch and one combine (after two warm-up rounds)
    step "ll variants np=1 (perf/ll_variants.py)" 300 $ONE $PY perf/ll_variants.py --out "$OUT"
    command -v ncu > /dev/null && step "ll ncu np=1 (perf/ll_ncu.py, ours)" 300 $ONE ncu --clock-control none \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section LaunchStats --section SchedulerStats -k regex:'dispatch|combine' --launch-skip 6 --launch-count 3 \
        $PY perf/ll_ncu.py
    # DeepEP v1.2.1's low-latency kernels beside ours, each in its own process, same inputs: needs .deepep_src
    # (tools/fetch_deepep_src.sh export, then carried to the GPU machine)
    if [ -d .deepep_src/v1.2.1 ]; then
        step "DeepEP v1.2.1 build (private prefix)" 420 bash tools/fetch_deepep_src.sh build
        step "ll side by side np=1 (DeepEP v1.2.1 vs ours)" 600 $ONE $PY perf/ll_side_by_side.py \
            --out "$OUT/ll_side_by_side"
    fi
    [ -f deepep_cupy/tests/legacy_intranode.py ] && step "legacy intranode np=1 (perf)" 240 $ONE $R 1 \
        $PY -m deepep_cupy.tests.legacy_intranode
    # Engram with the tables in pinned host memory: fetch GB/s and rows/s beside the GPU-storage path, same run.
    step "engram host storage np=1 (perf)" 240 $ONE $R 1 $PY -m deepep_cupy.tests.engram --use-cpu-storage
    step "v25 API np=1 (perf)" 240 $ONE $R 1 $PY -m deepep_cupy.tests.v25
fi


if want legacy1 && [ -f deepep_cupy/tests/legacy_intranode.py ]; then
    step "legacy intranode np=1 (perf)" 240 $ONE $R 1 $PY -m deepep_cupy.tests.legacy_intranode
fi

host_lane() {
    # The lean host path's GPU-side pieces: pooled events (eager and across a graph capture) and
    # current_stream's fast path. The EP / coll / deepep lanes check the calls themselves bit for bit.
    step "host: event pool + current_stream (GPU pytest)" 180 $ONE $PY -m pytest -q -x tests/gpu/test_gpu_runtime.py \
        -k "pooled or current_stream"
}
v25_lane() {
    local n
    for n in 1 2 4; do
        step "v25 API np=$n (sharing 1 GPU)" 300 $ONE $R $n $PY -m deepep_cupy.tests.v25 --skip-perf-test
    done
}
ep_lane_topk() {
    local k
    for k in 1 9 32; do
        step "ep np=1 top-$k" 120 $ONE $R 1 $EP --num-tokens 256 --hidden 1024 --num-topk $k --skip-perf-test \
            --skip-timeout-test --num-create-destroy 0
    done
    # Hidden 640: 80 chunks of 16 bytes per row, not a multiple of the warp's 32 (the combine's chunk loops shuffle
    # across the warp: warp-uniform passes, ep_combine.cu; a lane-strided loop hung at hidden 128).
    step "ep np=1 hidden 640 (row chunks not a multiple of 32)" 120 $ONE $R 1 $EP --num-tokens 256 --hidden 640 \
        --skip-perf-test --skip-timeout-test --num-create-destroy 0
}
ep_lane_shared() {
    step "ep np=2 (sharing 1 GPU)" 300 $ONE $R 2 $EP --num-tokens 512 --hidden 2048 --skip-perf-test \
        --num-create-destroy 2
    step "ep np=2 hidden 640 (sharing)" 300 $ONE $R 2 $EP --num-tokens 256 --hidden 640 --skip-perf-test \
        --skip-timeout-test --num-create-destroy 0
    step "ep np=2 allow_multiple_reduction=0 (sharing)" 300 $ONE $R 2 $EP --allow-multiple-reduction 0 \
        --num-tokens 256 --hidden 2048 --skip-perf-test --skip-timeout-test --num-create-destroy 0 --masked-ratio 0.2
    step "ep np=4 (sharing 1 GPU)" 300 $ONE $R 4 $EP --num-tokens 256 --hidden 2048 --skip-perf-test \
        --num-create-destroy 1
    step "ep np=8 (sharing 1 GPU)" 400 $ONE $R 8 $EP --num-tokens 128 --hidden 1024 --skip-perf-test \
        --num-create-destroy 1 --test-first-only
    step "ep np=2 pressure 100 seeds (sharing)" 300 $ONE $R 2 $EP --num-tokens 256 --hidden 1024 \
        --do-pressure-test --skip-perf-test --skip-timeout-test --num-create-destroy 0 --unbalanced-ratio 2 \
        --precise-unbalanced-ratio --num-topk 8
    # The dispatch knob (deepep_cupy/envs.py): send and receive as two launches.
    step "ep np=2 DISPATCH_OVERLAP=0 (sharing)" 300 env DEEPEP_CUPY_EP_DISPATCH_OVERLAP=0 $ONE $R 2 $EP \
        --num-tokens 256 --hidden 2048 --skip-perf-test --skip-timeout-test --num-create-destroy 0
}
ephost_lane() {
    # The EP dispatch host path: decode-sized recv_x / recv_sf carved out of the call's one allocation,
    # bitwise equal to separate allocations (torch and CuPy; BF16, FP8, TMA-aligned scales; CPU sync, no sync,
    # expanded, cached) and outliving the handle. The host-side order (everything before the launches, launches back
    # to back) is pinned on the CPU (tests/test_ep_host_order_cpu.py); perf1's ep_profile shows the gap it closes.
    step "ep host: carved dispatch outputs (GPU pytest)" 300 $ONE $PY -m pytest -q -x tests/gpu/test_gpu_ep_carve.py
    # The lean dispatch paths chosen at binding (BoundDispatch.run) against the general call, bitwise.
    step "ep host: lean cached / no-sync paths (GPU pytest)" 300 $ONE $PY -m pytest -q -x tests/gpu/test_gpu_ep_lean.py
}
hybrid_lane() {
    # Several scale-up domains on GPU 0: DEEPEP_CUPY_SCALEUP_SIZE cuts the ranks into domains, the rails between
    # them go through the IPC loopback transport (NCCL refuses two ranks of a communicator on one GPU).
    local H="--num-tokens 256 --hidden 2048 --num-experts 64 --skip-perf-test" shape su np
    for shape in 2x1:1:2 2x2:2:4 2x4:4:8 4x1:1:4; do
        IFS=: read -r shape su np <<< "$shape"
        step "hybrid $shape np=$np + timeout (loopback rails, sharing 1 GPU)" 600 env DEEPEP_CUPY_SCALEUP_SIZE=$su \
            DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R $np $EP $H --skip-error-test --skip-graph-test \
            --num-create-destroy 1 $([ $np -ge 8 ] && echo --test-first-only)
    done
    # deterministic=True: DeepEP's one sort of all received rows by source token (2 x 2: rows move)
    step "hybrid 2x2 np=4 deterministic all modes (loopback rails)" 400 env DEEPEP_CUPY_SCALEUP_SIZE=2 \
        DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R 4 $EP $H --deterministic --skip-timeout-test --num-create-destroy 0
    # 2 x 4 over every mode (the shape loop above runs its first mode only: 8 ranks on one GPU take a while)
    step "hybrid 2x4 np=8 all modes (loopback rails, sharing 1 GPU)" 400 env DEEPEP_CUPY_SCALEUP_SIZE=4 \
        DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R 8 $EP --num-tokens 128 --hidden 1024 --num-experts 64 \
        --skip-perf-test --skip-error-test --skip-graph-test --skip-timeout-test --num-create-destroy 0
    step "hybrid 2x2 np=4 pressure 100 seeds (loopback)" 600 env DEEPEP_CUPY_SCALEUP_SIZE=2 \
        DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R 4 $EP $H --skip-check --skip-error-test --skip-graph-test \
        --skip-timeout-test --num-create-destroy 0 --do-pressure-test --num-pressure-seeds 100 --unbalanced-ratio 2 \
        --num-topk 8
    for shape in 2x2:2:4 4x1:1:4; do
        IFS=: read -r shape su np <<< "$shape"
        step "hybrid $shape np=$np CUDA graph (M=128, loopback)" 400 env DEEPEP_CUPY_SCALEUP_SIZE=$su \
            DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R $np $EP $H --skip-check --skip-error-test \
            --skip-timeout-test --num-create-destroy 0
    done
    # DeepEP's own test_ep.py in hybrid mode (its default --allow-hybrid-mode 1): 2 domains x 1 rank on GPU 0.
    [ -d .upstream ] && step "DeepEP elastic/test_ep.py np=2 hybrid 2x1 (loopback, checks)" 400 env MASTER_PORT=18761 \
        DEEPEP_CUPY_SCALEUP_SIZE=1 DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $PY -m deepep_cupy.as_deep_ep \
        .upstream/head/tests/elastic/test_ep.py --num-processes 2 --num-tokens 256 --hidden 2048 --skip-perf-test
    [ -d .upstream ] && step "DeepEP elastic/test_ep.py np=4 hybrid 2x2 (loopback, checks)" 500 env MASTER_PORT=18762 \
        DEEPEP_CUPY_SCALEUP_SIZE=2 DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $PY -m deepep_cupy.as_deep_ep \
        .upstream/head/tests/elastic/test_ep.py --num-processes 4 --num-tokens 128 --hidden 2048 --skip-perf-test
    # Its perf section in hybrid mode (first mode; SO / SU GB/s lines; ranks share the GPU: logic-grade figures)
    [ -d .upstream ] && step "DeepEP elastic/test_ep.py np=2 hybrid 2x1 (loopback, first mode, perf)" 300 env \
        MASTER_PORT=18763 DEEPEP_CUPY_SCALEUP_SIZE=1 DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $PY -m \
        deepep_cupy.as_deep_ep .upstream/head/tests/elastic/test_ep.py --num-processes 2 --test-first-only
    # The hybrid rows of ep_bench through the loopback (ranks share GPU 0: the rows, timeline and byte accounting run;
    # the figures are logic-grade, refs skipped: NCCL refuses two ranks of one GPU)
    step "ep_bench --hybrid 2x1 np=2 (loopback, sharing)" 400 env DEEPEP_CUPY_SCALEUP_SIZE=1 \
        DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R 2 $PY perf/ep_bench.py --hybrid --out "$OUT/hybrid_loopback" \
        --tokens 128,4096 --num-warmups 5 --num-tests 10
    step "hybrid 2x2 np=4 argument errors (loopback)" 300 env DEEPEP_CUPY_SCALEUP_SIZE=2 \
        DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R 4 $EP $H --skip-check --skip-graph-test --skip-timeout-test \
        --num-create-destroy 0
}
hybrid_pipeline_lane() {
    # P2: the pipelined hybrid dispatch and combine (DEEPEP_CUPY_HYBRID_PIPELINE=1; dispatch: metadata first, payload
    # in chunks on a side stream, the intranode dispatch guarded per row; combine: chunked rail exchange, the final
    # reduction per landed chunk on the side stream). 32 rows per chunk: 8 chunks at 256 tokens (auto makes one chunk
    # at this hidden size; the auto step below covers it). Same bit-exact checks as hybrid_lane.
    local H="--num-tokens 256 --hidden 2048 --num-experts 64 --skip-perf-test" shape su np
    local P2="DEEPEP_CUPY_RAIL_TRANSPORT=loopback DEEPEP_CUPY_HYBRID_PIPELINE=1 DEEPEP_CUPY_HYBRID_PIPELINE_ROWS=32"
    for shape in 2x1:1:2 2x2:2:4 4x1:1:4; do
        IFS=: read -r shape su np <<< "$shape"
        step "hybrid P2 $shape np=$np + timeout (loopback)" 600 env DEEPEP_CUPY_SCALEUP_SIZE=$su $P2 $ONE $R $np \
            $EP $H --skip-error-test --skip-graph-test --num-create-destroy 1
    done
    step "hybrid P2 2x1 np=2 auto chunk rows (loopback)" 400 env DEEPEP_CUPY_SCALEUP_SIZE=1 \
        DEEPEP_CUPY_RAIL_TRANSPORT=loopback DEEPEP_CUPY_HYBRID_PIPELINE=1 $ONE $R 2 $EP $H --skip-error-test \
        --skip-graph-test --skip-timeout-test --num-create-destroy 0
    step "hybrid P2 2x2 np=4 CUDA graph (M=128, loopback)" 400 env DEEPEP_CUPY_SCALEUP_SIZE=2 $P2 $ONE $R 4 $EP $H \
        --skip-check --skip-error-test --skip-timeout-test --num-create-destroy 0
    step "hybrid P2 2x2 np=4 pressure 100 seeds (loopback)" 600 env DEEPEP_CUPY_SCALEUP_SIZE=2 $P2 $ONE $R 4 $EP $H \
        --skip-check --skip-error-test --skip-graph-test --skip-timeout-test --num-create-destroy 0 \
        --do-pressure-test --num-pressure-seeds 100 --unbalanced-ratio 2 --num-topk 8
}
pp_hybrid_lane() {
    # PP send/recv with the ring crossing scale-up domains (features/pp/links.py): ranks on GPU 0 cut into domains by
    # DEEPEP_CUPY_SCALEUP_SIZE, the cross-domain pairs over the IPC loopback link (NCCL refuses ranks sharing a GPU).
    local shape su np
    for shape in 2x1:1:2 2x2:2:4 4x1:1:4; do
        IFS=: read -r shape su np <<< "$shape"
        step "pp hybrid $shape np=$np + timeout (loopback, sharing 1 GPU)" 400 env DEEPEP_CUPY_SCALEUP_SIZE=$su \
            DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R $np $PY -m deepep_cupy.tests.pp --skip-perf-test
    done
    # DeepEP V2.5's pp/test_pp.py builds a PPBuffer (hybrid mode allowed): 2 domains x 1 rank. (head's
    # elastic/test_pp.py asks for allow_hybrid_mode=False, i.e. one domain: it cannot run across domains.)
    [ -d .upstream ] && step "DeepEP v25 pp/test_pp.py np=2 hybrid 2x1 (loopback)" 400 env MASTER_PORT=18961 \
        DEEPEP_CUPY_SCALEUP_SIZE=1 DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $PY -m deepep_cupy.as_deep_ep \
        .upstream/v25/tests/pp/test_pp.py --num-processes 2 --num-stress-iterations 2
    # Two GPUs or more: 2 domains x 1 rank, one GPU each, the cross-domain pairs over NCCL (a communicator per
    # direction), then through NCCL's socket transport.
    if [ "$NGPU" -ge 2 ]; then
        step "pp hybrid 2x1 np=2 NCCL links (1 rank/GPU)" 400 env DEEPEP_CUPY_SCALEUP_SIZE=1 \
            DEEPEP_CUPY_RAIL_TRANSPORT=nccl $R 2 $PY -m deepep_cupy.tests.pp --skip-perf-test
        step "pp hybrid 2x1 np=2 NCCL links over sockets" 400 env DEEPEP_CUPY_SCALEUP_SIZE=1 \
            DEEPEP_CUPY_RAIL_TRANSPORT=nccl NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket \
            NCCL_SOCKET_IFNAME=lo $R 2 $PY -m deepep_cupy.tests.pp --skip-perf-test --num-tokens 1024 --hidden 2048
    fi
}
agrs_hybrid_lane() {
    # All-gather / reduce-scatter / all-reduce across scale-up domains (features/agrs hybrid mode) on GPU 0: the rank
    # program's checks are bitwise against the hybrid references, then its size-mismatch and missing-rank cases
    # (TimeoutError on every other rank, rails included).
    local shape su np
    for shape in 2x1:1:2 2x2:2:4 4x1:1:4; do
        IFS=: read -r shape su np <<< "$shape"
        step "agrs hybrid $shape np=$np + failures (loopback rails, sharing 1 GPU)" 600 env \
            DEEPEP_CUPY_SCALEUP_SIZE=$su DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R $np $PY -m deepep_cupy.tests.agrs \
            --skip-perf-test
    done
    # DeepEP's own test_agrs.py (all-gather stress + its timing loop) with 2 domains x 1 rank.
    [ -d .upstream ] && step "DeepEP elastic/test_agrs.py np=2 hybrid 2x1 (loopback)" 400 env MASTER_PORT=18861 \
        DEEPEP_CUPY_SCALEUP_SIZE=1 DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $PY -m deepep_cupy.as_deep_ep \
        .upstream/head/tests/elastic/test_agrs.py --num-processes 2
}
ll_lane() {
    local n
    for n in 2 8; do
        step "ll np=$n (sharing 1 GPU)" 300 $ONE $R $n $LL --num-tokens 64 --hidden 2048 --num-experts 64 \
            --skip-perf-test
    done
}
legacy_lane() {
    local n
    for n in 2 4 8; do
        step "legacy intranode np=$n (sharing 1 GPU)" 300 $ONE $R $n $PY -m deepep_cupy.tests.legacy_intranode \
            --num-tokens 512 --hidden 2048 --skip-perf-test
    done
    # V1's receive-side outputs (recv_src_idx, num_worst_tokens rows) with send and receive as two launches too.
    step "legacy intranode np=2 DISPATCH_OVERLAP=0 (sharing)" 300 env DEEPEP_CUPY_EP_DISPATCH_OVERLAP=0 $ONE $R 2 \
        $PY -m deepep_cupy.tests.legacy_intranode --num-tokens 512 --hidden 2048 --skip-perf-test
}
legacy_internode_lane() {
    # V1 Buffer across scale-up domains at one shape (domains x ranks) over loopback rails: normal mode over the hybrid
    # engine (every handle element, rows, combine against the host reference), low-latency mode (pseudo-token hybrid
    # calls, against the single-domain references) and vLLM's and SGLang's V1 call sequences (against the internode
    # references)
    local shape=$1 s np IL="$PY -m deepep_cupy.tests.legacy_internode --num-tokens 512 --hidden 2048"
    s=${shape#*x}; np=$(( ${shape%x*} * s ))
    local env="DEEPEP_CUPY_SCALEUP_SIZE=$s DEEPEP_CUPY_RAIL_TRANSPORT=loopback"
    step "legacy internode $shape np=$np loopback rails" 300 env $env $ONE $R $np $IL
    step "legacy low-latency internode $shape np=$np loopback rails" 300 env $env $ONE $R $np \
        $PY -m deepep_cupy.tests.legacy_low_latency_internode
    step "serving replay internode $shape np=$np loopback rails" 600 env $env $ONE $R $np \
        $PY -m deepep_cupy.tests.serving_replay
}
legacy_internode_more_lane() {
    # perf/v1_bench.py's internode rows (the two-GPU bench stage's), as a logic run: 2 domains sharing GPU 0; normal
    # mode 2x2 over NCCL rails (sockets)
    step "v1_bench 2x1 np=2 loopback rails (internode rows, logic-grade)" 300 env DEEPEP_CUPY_SCALEUP_SIZE=1 \
        DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R 2 $PY perf/v1_bench.py --tokens 128 --hidden 2048
    local host='g=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}; export NCCL_HOSTID=rank$g;'
    step "legacy internode 2x2 np=4 NCCL rails" 300 env $SOCK MASTER_PORT=21061 DEEPEP_CUPY_SCALEUP_SIZE=2 \
        DEEPEP_CUPY_RAIL_TRANSPORT=nccl $ONE $R 4 bash -c "$host exec $PY -m deepep_cupy.tests.legacy_internode \
        --num-tokens 512 --hidden 2048"
}
coll_lane() {
    local np=$1 prog
    step "allocation np=$np" 300 $ONE $R $np $PY -m deepep_cupy.tests.allocation
    for prog in pp agrs engram reduce_grads prefetch_weights; do
        step "$prog np=$np (sharing 1 GPU)" 300 $ONE $R $np $PY -m deepep_cupy.tests.$prog --skip-perf-test
    done
    step "engram fp8 np=$np (sharing 1 GPU)" 300 $ONE $R $np $PY -m deepep_cupy.tests.engram --use-fp8 --skip-perf-test
    step "engram host storage np=$np (sharing 1 GPU)" 300 $ONE $R $np $PY -m deepep_cupy.tests.engram \
        --use-cpu-storage --skip-perf-test
    step "engram host storage fp8 np=$np (sharing 1 GPU)" 300 $ONE $R $np $PY -m deepep_cupy.tests.engram \
        --use-cpu-storage --use-fp8 --skip-perf-test
    step "v25 API np=$np (sharing 1 GPU)" 400 $ONE $R $np $PY -m deepep_cupy.tests.v25 --skip-perf-test
    step "barrier np=$np (sharing 1 GPU)" 300 $ONE $R $np $PY -m deepep_cupy.tests.barrier --num-barriers 100 \
        --num-rounds 8 --skip-perf-test
}
frameworks_lane() {
    # megatron-core's wheel travels in .whl/ (it is not in the GPU image); installed into a folder of its own.
    local site=/tmp/deepep_cupy_frameworks_site wheel
    wheel=$(ls .whl/megatron_core-*.whl 2>/dev/null | tail -1)
    [ -n "$wheel" ] && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheel" >> "$LOG" 2>&1
    local MP="env PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}"
    if $MP $PY -c 'import megatron.core' 2>/dev/null; then
        step "megatron MoE EP=1 (fused_a2a, np=1)" 300 $MP $ONE $R 1 $PY -m deepep_cupy.tests.megatron_moe
        step "megatron MoE EP=2 v1+v2 (flex/deep_ep vs alltoall, sharing GPU 0)" 600 $MP $ONE $R 2 $PY \
            -m deepep_cupy.tests.megatron_moe
    else
        echo "megatron-core is neither installed nor in .whl/: the Megatron steps did not run" | tee -a "$LOG"
        step "megatron MoE (megatron-core missing)" 10 false
    fi
    if [ -f deepep_cupy/tests/serving_replay.py ]; then
        for n in 1 2 4; do
            step "serving replay np=$n (vLLM / SGLang call sequences, sharing GPU 0)" 400 $ONE $R $n $PY \
                -m deepep_cupy.tests.serving_replay
        done
    fi
}
nccl1_lane() {
    # Domain d = node<d> for us (DEEPEP_CUPY_HOST) and for NCCL (NCCL_HOSTID), so NCCL accepts two rail members on one
    # GPU and joins them with sockets over the loopback (launch/scaleout_nccl.sh sets both). Each EP shape runs P1 and
    # P2 (pipelined).
    local EPA="-m deepep_cupy.tests.ep --num-gpu-timeout-secs 20 --num-cpu-timeout-secs 40 --num-tokens 128 \
--hidden 1024 --num-experts 64 --skip-perf-test"
    # (P2 over sockets between ranks sharing the GPU: the first mode only, its many small NCCL groups are slow there)
    step "nccl1: ep hybrid 2x1 NCCL rails, all modes, graph, errors, missing rank (P1, P2)" 340 env \
        OUT="$OUT/nccl1_2x1" RUN_TIMEOUT=160 PYTHONFAULTHANDLER=1 PIPELINE_PERF=0 P2_ARGS=--test-first-only \
        PROG="$EPA --num-create-destroy 1" $ONE bash launch/scaleout_nccl.sh 2x1
    step "nccl1: ep hybrid 2x2 NCCL rails, all modes, deterministic, pressure, graph (P1, P2)" 340 env \
        OUT="$OUT/nccl1_2x2" RUN_TIMEOUT=160 PYTHONFAULTHANDLER=1 PIPELINE_PERF=0 P2_ARGS=--test-first-only \
        PROG="$EPA --num-create-destroy 0 --deterministic --skip-timeout-test --skip-error-test --do-pressure-test \
--num-pressure-seeds 8" $ONE bash launch/scaleout_nccl.sh 2x2
}
nccl1_pp_lane() {
    # PP 2x1 over NCCL links and all-gather / reduce-scatter 2x1 over NCCL rails, with their timeout / failure cases
    local host='g=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}; export DEEPEP_CUPY_HOST=node$g NCCL_HOSTID=node$g;'
    # (ports of their own: a rank of a run the step before killed may still hold the lane's)
    step "nccl1: pp hybrid 2x1 NCCL links + timeout" 150 env $SOCK MASTER_PORT=19061 DEEPEP_CUPY_SCALEUP_SIZE=1 \
        DEEPEP_CUPY_RAIL_TRANSPORT=nccl PYTHONFAULTHANDLER=1 \
        $ONE $R 2 bash -c "$host exec $PY -m deepep_cupy.tests.pp --skip-perf-test --num-tokens 256 --hidden 2048"
    step "nccl1: agrs hybrid 2x1 NCCL rails + failures" 200 env $SOCK MASTER_PORT=19161 DEEPEP_CUPY_SCALEUP_SIZE=1 \
        DEEPEP_CUPY_RAIL_TRANSPORT=nccl PYTHONFAULTHANDLER=1 \
        $ONE $R 2 bash -c "$host exec $PY -m deepep_cupy.tests.agrs --skip-perf-test"
}
nccl1_more_lane() {
    # The other EP shapes over real NCCL on one GPU (beside nccl1_lane): 4x1 and 2x4 (launch/scaleout_nccl.sh gives
    # each rank its own NCCL host)
    local EPA="-m deepep_cupy.tests.ep --num-gpu-timeout-secs 30 --num-cpu-timeout-secs 60 --num-tokens 128 \
--hidden 1024 --num-experts 64 --skip-perf-test --num-create-destroy 0 --skip-timeout-test"
    step "nccl1: ep hybrid 4x1 NCCL rails, all modes, graph (P1, P2)" 400 env OUT="$OUT/nccl1_4x1" RUN_TIMEOUT=190 \
        PIPELINE_PERF=0 PROG="$EPA" P2_ARGS=--test-first-only $ONE bash launch/scaleout_nccl.sh 4x1
    step "nccl1: ep hybrid 2x4 NCCL rails, first mode, graph (P1, P2)" 400 env OUT="$OUT/nccl1_2x4" RUN_TIMEOUT=190 \
        PIPELINE_PERF=0 PROG="$EPA --test-first-only" $ONE bash launch/scaleout_nccl.sh 2x4
}
nccl1_coll_lane() {
    # PP and all-gather / reduce-scatter 2x2 and the barrier 2x1 over real NCCL on one GPU (each rank its own host)
    local host='g=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}; export NCCL_HOSTID=rank$g;'
    step "nccl1: pp hybrid 2x2 NCCL links + timeout" 200 env $SOCK MASTER_PORT=19261 DEEPEP_CUPY_SCALEUP_SIZE=2 \
        DEEPEP_CUPY_RAIL_TRANSPORT=nccl $ONE $R 4 bash -c "$host exec $PY -m deepep_cupy.tests.pp --skip-perf-test \
        --num-tokens 256 --hidden 2048"
    step "nccl1: agrs hybrid 2x2 NCCL rails + failures" 300 env $SOCK MASTER_PORT=19361 DEEPEP_CUPY_SCALEUP_SIZE=2 \
        DEEPEP_CUPY_RAIL_TRANSPORT=nccl $ONE $R 4 bash -c "$host exec $PY -m deepep_cupy.tests.agrs --skip-perf-test"
    step "nccl1: barrier hybrid 2x1 over NCCL" 200 env $SOCK MASTER_PORT=19461 DEEPEP_CUPY_SCALEUP_SIZE=1 \
        DEEPEP_CUPY_RAIL_TRANSPORT=nccl $ONE $R 2 bash -c "$host exec $PY -m deepep_cupy.tests.barrier"
}
nccl1_deepep_lane() {
    # DeepEP's own programs in hybrid mode over real NCCL rails on one GPU (init_dist gives each rank its own NCCL host
    # when NCCL rails share a GPU)
    [ -d .upstream ] || { echo "no .upstream/ (DeepEP's programs): skipped" >> "$LOG"; return; }
    local RUN="$PY -m deepep_cupy.as_deep_ep" NC="DEEPEP_CUPY_RAIL_TRANSPORT=nccl"
    step "nccl1: DeepEP elastic/test_ep.py np=2 hybrid 2x1 NCCL (checks)" 500 env MASTER_PORT=19561 $NC \
        DEEPEP_CUPY_SCALEUP_SIZE=1 $ONE $RUN .upstream/head/tests/elastic/test_ep.py --num-processes 2 \
        --num-tokens 256 --hidden 2048 --skip-perf-test
    step "nccl1: DeepEP elastic/test_ep.py np=4 hybrid 2x2 NCCL (checks)" 600 env MASTER_PORT=19661 $NC \
        DEEPEP_CUPY_SCALEUP_SIZE=2 $ONE $RUN .upstream/head/tests/elastic/test_ep.py --num-processes 4 \
        --num-tokens 128 --hidden 2048 --skip-perf-test
}
nccl1_deepep2_lane() {
    # DeepEP's test_agrs.py and V2.5 pp/test_pp.py in hybrid mode over real NCCL rails on one GPU
    [ -d .upstream ] || return
    local RUN="$PY -m deepep_cupy.as_deep_ep" NC="DEEPEP_CUPY_RAIL_TRANSPORT=nccl"
    step "nccl1: DeepEP elastic/test_agrs.py np=2 hybrid 2x1 NCCL" 400 env MASTER_PORT=19761 $NC \
        DEEPEP_CUPY_SCALEUP_SIZE=1 $ONE $RUN .upstream/head/tests/elastic/test_agrs.py --num-processes 2
    step "nccl1: DeepEP v25 pp/test_pp.py np=2 hybrid 2x1 NCCL" 400 env MASTER_PORT=19861 $NC \
        DEEPEP_CUPY_SCALEUP_SIZE=1 $ONE $RUN .upstream/v25/tests/pp/test_pp.py --num-processes 2 \
        --num-stress-iterations 2
}
nccl_refs_lane() {
    # Programs whose own references need NCCL, at np=2 on one GPU: every rank its own NCCL host (DeepEP's init_dist
    # with DEEPEP_CUPY_NCCL_HOST_PER_RANK=1; our programs through NCCL_HOSTID=rank<g>), NCCL over sockets. Logic only.
    local host='g=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}; export NCCL_HOSTID=rank$g;'
    step "nccl refs: ep_bench np=2 (refs and a2a over NCCL, logic)" 300 env $SOCK MASTER_PORT=19961 $ONE $R 2 \
        bash -c "$host exec $PY perf/ep_bench.py --out $OUT/nccl_refs --tokens 128,512 --num-warmups 2 --num-tests 3"
    step "nccl refs: ep_bench --hybrid 2x1 np=2 (loopback rails, refs over NCCL)" 300 env $SOCK MASTER_PORT=20061 \
        DEEPEP_CUPY_SCALEUP_SIZE=1 DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R 2 bash -c "$host exec $PY \
        perf/ep_bench.py --hybrid --out $OUT/nccl_refs_hybrid --tokens 128 --num-warmups 2 --num-tests 3"
    [ -d .upstream ] || { echo "no .upstream/ (DeepEP's programs): skipped" >> "$LOG"; return; }
    local t p=20161
    for t in bucket/test_reduce_scatter.py bucket/test_all_gather.py bucket/test_session.py bucket/test_mixed.py; do
        step "nccl refs: DeepEP v25 $t np=2 (its references over NCCL)" 400 env MASTER_PORT=$p \
            DEEPEP_CUPY_NCCL_HOST_PER_RANK=1 PYTHONFAULTHANDLER=1 $ONE $PY -m deepep_cupy.as_deep_ep \
            .upstream/v25/tests/$t --num-processes 2
        p=$((p + 100))
    done
}
faults_lane() {
    # A rank SIGKILLed at each kill point: the program starts its own ranks on GPU 0 (a dead rank ends an mpirun job);
    # every survivor must raise naming the phase and the dead peer, destroy and exit by itself. Logs: $OUT/faults*.
    local F="$PY -m deepep_cupy.tests.faults"
    case "${1:-}" in
    nccl2) step "faults nccl 2x1 (a rank killed at each point)" 300 $ONE $F --mode nccl --num-ranks 2 --out "$OUT/faults" ;;
    nccl4) step "faults nccl 2x2 (a rank killed at each point)" 400 $ONE $F --mode nccl --num-ranks 4 --out "$OUT/faults" ;;
    ipc2) step "faults ipc np=2 (a rank killed at each point)" 300 $ONE $F --mode ipc --num-ranks 2 --out "$OUT/faults" ;;
    ipc4)
    step "faults ipc np=4 (a rank killed at each point)" 300 $ONE $F --mode ipc --num-ranks 4 --out "$OUT/faults"
    step "faults ipc np=4 victim rank 0 (the TCP group's root)" 300 $ONE $F --mode ipc --num-ranks 4 --victim 0 \
        --out "$OUT/faults_victim0" ;;
    esac
}
deepep_lane() {
    local U=.upstream RUN="$PY -m deepep_cupy.as_deep_ep"
    [ -d $U ] || { echo "no .upstream/ (DeepEP's programs): skipped" >> "$LOG"; return; }
    # test_ep.py times every one of its 144 modes (bench_kineto sleeps ~10 ms per call): checks over all modes
    # without the perf section, then the perf section on the first mode at full size.
    step "DeepEP elastic/test_ep.py np=1 (all modes, checks)" 300 $ONE $RUN $U/head/tests/elastic/test_ep.py \
        --num-processes 1 --num-tokens 1024 --hidden 2048 --skip-perf-test
    step "DeepEP elastic/test_ep.py np=1 (first mode, perf)" 200 $ONE $RUN $U/head/tests/elastic/test_ep.py \
        --num-processes 1 --test-first-only
    # (174 s beside the other lanes in one run, past 300 s in one with the deepep25 lane beside it too)
    step "DeepEP elastic/test_ep.py np=2 (sharing, checks)" 500 $ONE $RUN $U/head/tests/elastic/test_ep.py \
        --num-processes 2 --num-tokens 256 --hidden 2048 --skip-perf-test
    step "DeepEP elastic/test_agrs.py np=1" 300 $ONE $RUN $U/head/tests/elastic/test_agrs.py --num-processes 1
    step "DeepEP elastic/test_barrier.py np=1" 300 $ONE $RUN $U/head/tests/elastic/test_barrier.py --num-processes 1
    step "DeepEP elastic/test_pp.py np=2 (sharing)" 300 $ONE $RUN $U/head/tests/elastic/test_pp.py --num-processes 2
    step "DeepEP elastic/test_engram.py np=1" 300 $ONE $RUN $U/head/tests/elastic/test_engram.py --num-processes 1
    step "DeepEP elastic/test_engram.py --use-fp8 np=1" 300 $ONE $RUN $U/head/tests/elastic/test_engram.py \
        --num-processes 1 --use-fp8
    # Two ranks sharing the GPU (their torch.distributed use is at most an all_gather_into_tensor, which gloo serves).
    for t in test_agrs test_barrier test_engram; do
        step "DeepEP elastic/$t.py np=2 (sharing)" 300 $ONE $RUN $U/head/tests/elastic/$t.py --num-processes 2
    done
}
deepep_legacy_lane() {
    local U=.upstream RUN="$PY -m deepep_cupy.as_deep_ep"
    [ -d $U ] || return
    step "DeepEP legacy/test_intranode.py np=1" 400 bash -c "cd $U/head/tests/legacy && CUDA_VISIBLE_DEVICES=0 \
        $RUN test_intranode.py --num-processes 1"
    step "DeepEP legacy/test_low_latency.py np=1" 400 bash -c "cd $U/head/tests/legacy && CUDA_VISIBLE_DEVICES=0 \
        $RUN test_low_latency.py --num-processes 1"
    step "DeepEP v1 test_intranode.py np=1" 400 bash -c "cd $U/v1/tests && CUDA_VISIBLE_DEVICES=0 \
        $RUN test_intranode.py --num-processes 1"
    step "DeepEP v1 test_low_latency.py np=1" 400 bash -c "cd $U/v1/tests && CUDA_VISIBLE_DEVICES=0 \
        $RUN test_low_latency.py --num-processes 1"
    # Two ranks sharing the GPU: init_dist gives them a gloo group, which serves these programs' CUDA all_reduce /
    # all_gather calls (the runner passes gloo a [world * T, K] view where they gather into [world, T, K]).
    step "DeepEP legacy/test_intranode.py np=2 (sharing)" 400 bash -c "cd $U/head/tests/legacy && \
        CUDA_VISIBLE_DEVICES=0 $RUN test_intranode.py --num-processes 2"
    step "DeepEP legacy/test_low_latency.py np=2 (sharing)" 400 bash -c "cd $U/head/tests/legacy && \
        CUDA_VISIBLE_DEVICES=0 $RUN test_low_latency.py --num-processes 2"
    # v1.2.1's programs bring their own init_dist (NCCL, device_id=cuda:local_rank): the runner maps local ranks past
    # the visible GPUs to GPU 0 and gives each such rank its own NCCL host (deep_ep_alias.share_gpu_compat).
    step "DeepEP v1 test_intranode.py np=2 (sharing)" 400 bash -c "cd $U/v1/tests && CUDA_VISIBLE_DEVICES=0 \
        $RUN test_intranode.py --num-processes 2"
    step "DeepEP v1 test_low_latency.py np=2 (sharing)" 400 bash -c "cd $U/v1/tests && CUDA_VISIBLE_DEVICES=0 \
        $RUN test_low_latency.py --num-processes 2"
}
# DeepEP's internode programs, unmodified, as two would-be nodes on this host (WORLD_SIZE=2 nodes, RANK = node index,
# each spawning its local ranks), every rank on GPU 0; scale-up domains of the local rank count, rails over the
# loopback or over NCCL (sockets; every rank its own NCCL host: DEEPEP_CUPY_NCCL_HOST_PER_RANK). Alone after the
# lanes: 16 processes and DeepEP's int(2e9) + int(1e9)-byte buffers.
deepep_internode_steps() {
    local U=.upstream RUN="$PY -m deepep_cupy.as_deep_ep" N="launch/nodes_on_one_host.sh 2" rails
    [ -d $U ] || return
    local base="CUDA_VISIBLE_DEVICES=0 DEEPEP_CUPY_NCCL_HOST_PER_RANK=1"
    for rails in loopback nccl; do
        local env8="$base DEEPEP_CUPY_SCALEUP_SIZE=8 DEEPEP_CUPY_RAIL_TRANSPORT=$rails"
        local env2="$base DEEPEP_CUPY_SCALEUP_SIZE=2 DEEPEP_CUPY_RAIL_TRANSPORT=$rails"
        step "DeepEP legacy/test_internode.py 2 nodes x 8 ($rails rails, sharing)" 600 env $env8 MASTER_PORT=22061 \
            $N $RUN $U/head/tests/legacy/test_internode.py --num-processes 8 --num-tokens 1024 --hidden 2048
        step "DeepEP v1 test_internode.py 2 nodes x 8 ($rails rails, sharing)" 600 env $env8 MASTER_PORT=22161 \
            bash -c "cd $U/v1/tests && ../../../$N $RUN test_internode.py --num-processes 8 --num-tokens 1024 \
            --hidden 2048"
        step "DeepEP legacy/test_low_latency.py 2 nodes x 2 ($rails rails, sharing)" 400 env $env2 \
            MASTER_PORT=22261 $N $RUN $U/head/tests/legacy/test_low_latency.py --num-processes 2
        step "DeepEP v1 test_low_latency.py 2 nodes x 2 ($rails rails, sharing)" 400 env $env2 MASTER_PORT=22361 \
            bash -c "cd $U/v1/tests && ../../../$N $RUN test_low_latency.py --num-processes 2"
    done
}
deepep_v25_lane() {
    local U=.upstream RUN="$PY -m deepep_cupy.as_deep_ep" t
    [ -d $U ] || return
    local V=$U/v25/tests
    # V2.5's test_ep.py also times every mode: checks over all modes, then the perf section on the first mode.
    step "DeepEP v25 ep/test_ep.py np=1 (all modes, checks)" 300 $ONE $RUN $V/ep/test_ep.py --num-processes 1 \
        --num-tokens 1024 --hidden 2048 --skip-perf-test
    step "DeepEP v25 ep/test_ep.py np=1 (first mode, perf)" 200 $ONE $RUN $V/ep/test_ep.py --num-processes 1 \
        --test-first-only
    # One rank (NCCL): every V2.5 program that runs with one rank (test_allocation wants an even count, test_pp two
    # ranks, the load-balancing programs a peer to host experts).
    for t in comm/test_barrier.py engram/test_engram.py bucket/test_all_gather.py \
             bucket/test_reduce_scatter.py bucket/test_all_reduce.py bucket/test_session.py; do
        step "DeepEP v25 $t np=1" 300 $ONE $RUN $V/$t --num-processes 1
    done
    step "DeepEP v25 engram/test_engram.py --use-cpu-rdma-storage np=1" 300 $ONE $RUN $V/engram/test_engram.py \
        --num-processes 1 --use-cpu-rdma-storage
    step "DeepEP v25 engram/test_engram.py --use-fp8 --use-cpu-rdma-storage np=1" 300 $ONE $RUN \
        $V/engram/test_engram.py --num-processes 1 --use-fp8 --use-cpu-rdma-storage
    step "DeepEP v25 bucket/test_mixed.py np=1" 400 $ONE $RUN $V/bucket/test_mixed.py --num-processes 1 \
        --num-bytes 64M --num-rounds 3 --num-tests 24
    step "DeepEP v25 bucket/test_perf.py np=1" 400 $ONE $RUN $V/bucket/test_perf.py --num-processes 1 \
        --num-bytes 1M 16M --nccl-profiles auto
}
deepep_v25_np2_lane() {
    local U=.upstream RUN="$PY -m deepep_cupy.as_deep_ep" t
    [ -d $U ] || return
    local V=$U/v25/tests
    # Two ranks sharing the GPU (gloo): the programs whose own torch.distributed calls gloo serves (no CUDA
    # all-gather / reduce-scatter / all-to-all references).
    for t in ep/test_ep.py comm/test_barrier.py buffer/test_allocation.py pp/test_pp.py bucket/test_all_reduce.py \
             ep/test_prefetch_weights.py ep/test_reduce_grads.py; do
        [ $t = ep/test_ep.py ] && set -- --skip-perf-test || set --
        step "DeepEP v25 $t np=2 (sharing)" 400 $ONE $RUN $V/$t --num-processes 2 $(case $t in
            ep/test_ep.py) echo --num-tokens 512 --hidden 2048;;
            ep/test_prefetch_weights.py|ep/test_reduce_grads.py) echo --num-hidden-bytes 4M;;
            bucket/test_all_reduce.py) echo --num-bytes 64M;; esac) "$@"
    done
    step "DeepEP v25 engram/test_engram.py --skip-check --use-cpu-rdma-storage np=2 (sharing)" 300 $ONE $RUN \
        $V/engram/test_engram.py --num-processes 2 --skip-check --use-cpu-rdma-storage
}
firsthour_lane() {
    # The README's commands as a new user runs them on this host, from a fresh clone (no registry here: --no-deps next
    # to the preinstalled packages, in a fresh virtual environment that sees them).
    local T; T=$(mktemp -d); local V=$T/venv C=$T/deepep_cupy
    step "firsthour: fresh clone" 120 bash -c "git clone -q '$ROOT' '$C' 2>/dev/null || { mkdir -p '$C' && \
        tar -C '$ROOT' --exclude=./.upstream --exclude=./.baseline -cf - . | tar -C '$C' -xf - && \
        echo 'no .git in this copy: the checkout copied instead of cloned'; }"
    # The preinstalled packages live in a virtual environment of their own on the GPU machine (python3 is
    # /opt/torch/.venv/bin/python3), which --system-site-packages does not reach: a .pth file points the fresh venv at
    # the site-packages of the interpreter that made it.
    step "firsthour: fresh venv + offline install" 300 bash -c "cd '$C' && $PY -m venv --without-pip \
        --system-site-packages $V && $PY -c 'import site; print(chr(10).join(site.getsitepackages()))' > \
        \$($V/bin/python -c 'import site; print(site.getsitepackages()[0])')/preinstalled.pth && \
        $V/bin/python -m pip install -q -e . --no-deps --no-build-isolation && \
        $V/bin/python -c 'import numpy, cupy, torch, mpi4py, pytest; print(\"fresh venv sees the preinstalled packages\")'"
    step "firsthour: --help without a GPU check" 60 bash -c "cd '$C' && $V/bin/python -m deepep_cupy.tests.ep --help"
    step "firsthour: launch/run_local.sh 2 python -m deepep_cupy.tests.ep" 600 bash -c "cd '$C' && \
        PATH='$V/bin':\$PATH CUDA_VISIBLE_DEVICES=0 $R 2 python -m deepep_cupy.tests.ep"
    step "firsthour: python -m pytest -q tests -m 'not slow'" 360 bash -c "cd '$C' && \
        $V/bin/python -m pytest -q tests -m 'not slow'"
    step "firsthour: no GPU visible (one line expected)" 60 bash -c "cd '$C' && ! CUDA_VISIBLE_DEVICES= $R 2 \
        $V/bin/python -m deepep_cupy.tests.barrier"
}
launchers_lane() {
    local A="--num-tokens 256 --hidden 2048 --skip-perf-test --num-create-destroy 1"
    step "ep under torchrun np=2 (sharing)" 300 $ONE launch/torchrun.sh 2 -m deepep_cupy.tests.ep $A
    step "ep under SLURM variables np=2 (sharing)" 300 $ONE bash -c "pids=(); for r in 0 1; do SLURM_PROCID=\$r \
        SLURM_NTASKS=2 SLURM_LOCALID=\$r SLURM_TASKS_PER_NODE=2 SLURM_NODELIST=localhost MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=29555 $PY -m deepep_cupy.tests.ep $A & pids+=(\$!); done; rc=0; \
        for p in \${pids[@]}; do wait \$p || rc=1; done; exit \$rc"
}

fuse_lane() {
    # The fused notify + dispatch: logic at 1/2/4/8 ranks sharing GPU 0 (its timeline runs alone in perf1).
    local F="env DEEPEP_CUPY_EP_FUSED_NOTIFY=1 CUDA_VISIBLE_DEVICES=0"
    # One rank: 4096 tokens = 8 notify blocks (their grid barrier); the smallest and largest top-k buckets.
    step "fuse: ep np=1 4096 tokens" 300 $F $R 1 $EP --skip-perf-test --num-create-destroy 0
    # (top-1 with 30% of the ids -1: as many tokens received by nobody, which the self-counting receivers skip)
    step "fuse: ep np=1 top-1" 120 $F $R 1 $EP --num-tokens 256 --hidden 1024 --num-topk 1 --skip-perf-test \
        --num-create-destroy 0 --masked-ratio 0.3
    step "fuse: ep np=1 top-32" 120 $F $R 1 $EP --num-tokens 700 --hidden 1024 --num-topk 32 --skip-perf-test \
        --num-create-destroy 0
    # One rank, 100 seeds of no-sync dispatches whose receivers count for themselves (not expanded): 3 notify blocks,
    # the last one partial (block 0 publishes the epoch, no ticket); top-2 with half the ids -1 (a quarter of the
    # tokens received by nobody).
    step "fuse: ep np=1 pressure 1100 tokens" 300 $F $R 1 $EP --num-tokens 1100 --hidden 1024 --num-topk 2 \
        --masked-ratio 0.5 --do-pressure-test --skip-perf-test --skip-timeout-test --num-create-destroy 0
    # One rank, 100 seeds with no id masked: every token received, the receivers' speculative copy confirmed (the
    # masked runs above take its miss path).
    step "fuse: ep np=1 pressure 2048 tokens unmasked" 300 $F $R 1 $EP --num-tokens 2048 --hidden 1024 \
        --do-pressure-test --skip-perf-test --skip-timeout-test --num-create-destroy 0
    # One rank, 34 notify blocks of 132 receivers (fewer than 3/4 others): the notify blocks receive too (their counts
    # published before their notify work).
    # (first mode only: its no-sync dispatch takes the fused kernel; all 144 modes' host references at 17000 tokens
    # outlasted 300 s beside the other lanes)
    step "fuse: ep np=1 17000 tokens (notify blocks receive)" 300 $F $R 1 $EP --num-tokens 17000 --hidden 128 \
        --skip-perf-test --num-create-destroy 0 --test-first-only
    # DeepEP V1 at one rank: channel prefixes (a second grid barrier), 8 notify blocks.
    [ -f deepep_cupy/tests/legacy_intranode.py ] && step "fuse: legacy intranode np=1 4096 tokens" 300 $F $R 1 \
        $PY -m deepep_cupy.tests.legacy_intranode --num-tokens 4096 --hidden 2048 --skip-perf-test
}
fuse_lane_shared() {
    local F="env DEEPEP_CUPY_EP_FUSED_NOTIFY=1 CUDA_VISIBLE_DEVICES=0"
    # Ranks sharing the GPU: the exchange, sends before the layout, the missing-rank check without CPU sync.
    step "fuse: ep np=2 (sharing)" 300 $F $R 2 $EP --num-tokens 512 --hidden 2048 --skip-perf-test \
        --num-create-destroy 0 --timeout-test-no-sync
    step "fuse: ep np=2 1100 tokens masked (sharing)" 300 $F $R 2 $EP --num-tokens 1100 --hidden 1024 \
        --skip-perf-test --skip-timeout-test --num-create-destroy 0 --masked-ratio 0.2
    step "fuse: ep np=4 (sharing)" 300 $F $R 4 $EP --num-tokens 256 --hidden 2048 --skip-perf-test \
        --num-create-destroy 0 --timeout-test-no-sync
    step "fuse: ep np=8 (sharing)" 400 $F $R 8 $EP --num-tokens 128 --hidden 1024 --skip-perf-test \
        --num-create-destroy 0 --test-first-only
    step "fuse: ep np=2 pressure 100 seeds (sharing)" 300 $F $R 2 $EP --num-tokens 256 --hidden 1024 \
        --do-pressure-test --skip-perf-test --skip-timeout-test --num-create-destroy 0 --unbalanced-ratio 2 \
        --precise-unbalanced-ratio --num-topk 8
    step "fuse: ep np=2 plain launch (FUSED_COOPERATIVE=0)" 300 env DEEPEP_CUPY_EP_FUSED_COOPERATIVE=0 $F $R 2 \
        $EP --num-tokens 512 --hidden 2048 --skip-perf-test --skip-timeout-test --num-create-destroy 0
    [ -f deepep_cupy/tests/legacy_intranode.py ] && step "fuse: legacy intranode np=2 (sharing)" 300 $F $R 2 \
        $PY -m deepep_cupy.tests.legacy_intranode --num-tokens 512 --hidden 2048 --skip-perf-test
    if [ -d .upstream ]; then
        step "fuse: DeepEP elastic/test_ep.py np=2 (sharing, checks)" 500 $F $PY -m deepep_cupy.as_deep_ep \
            .upstream/head/tests/elastic/test_ep.py --num-processes 2 --num-tokens 256 --hidden 2048 --skip-perf-test
    fi
}
# After perf1 (alone), every requested logic lane runs at the same time (the ranks of a lane share the GPU anyway;
# these runs check results, they time nothing that is reported).
if want ep; then
    lane ep_lane_topk
    lane ep_lane_shared
    lane ephost_lane
fi
want hybrid && lane hybrid_lane
want hybrid && lane hybrid_pipeline_lane
want hybrid && lane pp_hybrid_lane
want hybrid && lane agrs_hybrid_lane
want fuse && lane fuse_lane
want fuse && lane fuse_lane_shared
want ll && [ -f deepep_cupy/tests/legacy_low_latency.py ] && lane ll_lane
want legacy && [ -f deepep_cupy/tests/legacy_intranode.py ] && lane legacy_lane
if want coll; then
    for np in ${COLL_NPS-2 4}; do lane coll_lane $np; done
fi
want launchers && lane launchers_lane
want host && lane host_lane
want v25 && [ -f deepep_cupy/tests/v25.py ] && lane v25_lane
# DeepEP's programs rendezvous at MASTER_PORT (default 8361): one port per lane, as they run at the same time.
want deepep && MASTER_PORT=18361 lane deepep_lane
want deepep && MASTER_PORT=18461 lane deepep_legacy_lane
want deepep25 && MASTER_PORT=18561 lane deepep_v25_lane
want deepep25 && MASTER_PORT=18661 lane deepep_v25_np2_lane
# DeepEP's gate test (no ranks) runs for minutes: beside the others, bounded.
want gate && [ -d .upstream ] && lane step "DeepEP utils/test_gate.py" ${GATE_TIMEOUT:-420} $ONE $PY \
    -m deepep_cupy.as_deep_ep .upstream/head/tests/utils/test_gate.py
want firsthour && lane firsthour_lane
want frameworks && MASTER_PORT=18761 lane frameworks_lane
want nccl1 && MASTER_PORT=18861 lane nccl1_lane
want nccl1 && lane nccl1_more_lane
want nccl1 && lane nccl1_coll_lane
want nccl1 && lane nccl1_deepep_lane
want nccl1 && lane nccl1_pp_lane
want nccl1 && lane nccl1_deepep2_lane
want nccl1 && lane nccl_refs_lane
for f in nccl2 nccl4 ipc2 ipc4; do want faults && lane faults_lane $f; done
for shape in 2x1 2x2 4x1 2x4; do want internode && lane legacy_internode_lane $shape; done
want internode && lane legacy_internode_more_lane
join
# P2 against P1 in one run (bitwise check of both, then GPU span per call and the ratio), alone after the lanes: 2
# domains x 1 rank sharing GPU 0, 512 and 4096 tokens, hidden 7168, top-8, 256 experts (logic-grade figures: the two
# ranks time-slice one GPU; launch/scaleout_nccl.sh runs it with NCCL rails on two GPUs).
want internode && deepep_internode_steps
want hybrid && step "hybrid P2 vs P1 perf/hybrid_pipeline.py 2x1 np=2 (loopback)" 600 env DEEPEP_CUPY_SCALEUP_SIZE=1 \
    DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R 2 $PY perf/hybrid_pipeline.py --out "$OUT"
# The GPU pytest tests alone: their memory checks read the device's free memory, which other lanes' ranks change.
want pytest && step "pytest GPU tests" 400 $PY -m pytest -q -x tests/gpu tests/test_runtime_cpu.py
if want ep && [ "$NGPU" -ge 2 ]; then
    step "ep np=$NGPU (1 rank/GPU)" 420 $R "$NGPU" $EP
    step "ep np=$NGPU pressure (100 seeds)" 300 $R "$NGPU" $EP --num-tokens 512 --hidden 2048 --do-pressure-test \
        --skip-perf-test --skip-timeout-test --num-create-destroy 0 --unbalanced-ratio 2 --precise-unbalanced-ratio \
        --num-topk 8
fi
if want bench && [ "$NGPU" -ge 2 ]; then
    step "ep_bench np=$NGPU" 600 $R "$NGPU" $PY perf/ep_bench.py --out "$OUT"
    step "ep_profile np=$NGPU" 300 $R "$NGPU" $PY perf/ep_profile.py
    # Hybrid rows (2 domains x 1 rank, NCCL rails), the one-domain buffer of the same 2 ranks and refs beside them
    step "ep_bench --hybrid 2x1 np=2 (NCCL rails)" 600 env DEEPEP_CUPY_SCALEUP_SIZE=1 DEEPEP_CUPY_RAIL_TRANSPORT=nccl \
        $R 2 $PY perf/ep_bench.py --hybrid --out "$OUT/hybrid" --tokens 128,512,4096 --num-warmups 10 --num-tests 30
    [ -f deepep_cupy/tests/legacy_low_latency.py ] && step "ll np=$NGPU (perf)" 300 $R "$NGPU" $LL
    # V1 Buffer across domains (2 x 1 rank, NCCL rails): internode normal-mode rows beside ElasticBuffer's hybrid
    # engine, low-latency spans, hooks and graphs
    step "v1_bench 2x1 np=2 (V1 internode rows, NCCL rails)" 600 env DEEPEP_CUPY_SCALEUP_SIZE=1 \
        DEEPEP_CUPY_RAIL_TRANSPORT=nccl $R 2 $PY perf/v1_bench.py --tokens 128,4096 --out "$OUT/v1_internode"
fi
if want tune && [ "$NGPU" -ge 2 ]; then
    step "reduce-scatter sweep np=$NGPU" 300 $R "$NGPU" $PY perf/reduce_scatter_sweep.py
    step "reduce_grads ring np=$NGPU" 300 $R "$NGPU" $PY -m deepep_cupy.tests.reduce_grads --pattern ring --skip-check \
        --skip-error-test --skip-timeout-test
    step "prefetch_weights ring np=$NGPU" 300 $R "$NGPU" $PY -m deepep_cupy.tests.prefetch_weights --pattern ring \
        --skip-check --skip-error-test --skip-timeout-test
fi
# Hybrid P2 against P1 with the two ranks' kernels running concurrently on GPU 0 under CUDA MPS (without it the two
# processes are time-sliced and every figure is a multiple of the slice): started here, stopped right after.
if want mps && command -v nvidia-cuda-mps-control > /dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/deepep_cupy_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/deepep_cupy_mps_log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if CUDA_VISIBLE_DEVICES=0 nvidia-cuda-mps-control -d; then
        step "hybrid P2 vs P1 perf/hybrid_pipeline.py 2x1 np=2 (loopback, MPS)" 240 env DEEPEP_CUPY_SCALEUP_SIZE=1 \
            DEEPEP_CUPY_RAIL_TRANSPORT=loopback $ONE $R 2 $PY perf/hybrid_pipeline.py --out "$OUT/mps"
        # EP2 decode with both ranks' kernels concurrent (HBM stands in for NVLink): a proxy of the two-GPU graph
        # spans (EP2 decode figures), default and fused notify.
        step "ep_profile np=2 128 tokens (MPS, sharing GPU 0)" 240 $ONE $R 2 $PY perf/ep_profile.py --tokens 128 \
            --variants default,fused --skip-features
        echo quit | nvidia-cuda-mps-control
    else
        echo "MPS daemon did not start" >> "$SUMMARY"
    fi
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi
echo "=== summary" >> "$LOG"
cat "$SUMMARY" | tee -a "$LOG"
! grep -q FAIL "$SUMMARY"
