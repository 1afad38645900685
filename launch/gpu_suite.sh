#!/usr/bin/env bash
# The GPU suite, for the GPU machine: install this checkout (no deps: the packages are preinstalled there), run every
# rank program with 1 GPU, with all GPUs (one rank per GPU), and with 4 and 8 ranks sharing the GPUs (logic only),
# then the benchmarks. Logs go under $OUT (default ./out): suite.log (everything), summary.txt (one line per step).
#
#   bash launch/gpu_suite.sh [STAGE...]      STAGE in: info jit barrier pytest ep bench coll tune (default: all but tune)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG=$OUT/suite.log
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export DEEPEP_CUPY_JIT_CACHE_DIR=${DEEPEP_CUPY_JIT_CACHE_DIR:-/tmp/deepep_cupy_jit}
PY=${PYTHON:-python3}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(info jit barrier pytest ep bench coll)
want() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

# step NAME TIMEOUT_S COMMAND...: run, log, record PASS/FAIL with the wall time.
step() {
    local name=$1 limit=$2; shift 2
    echo "=== [$name] $*" | tee -a "$LOG"
    local t0=$(date +%s%N)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local dt=$(( ($(date +%s%N) - t0) / 1000000 ))
    local verdict=PASS; [ "$rc" -ne 0 ] && verdict="FAIL(rc=$rc)"
    printf '%-40s %-12s %8d ms\n' "$name" "$verdict" "$dt" | tee -a "$SUMMARY" "$LOG"
}

$PY -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | tail -2 | tee -a "$LOG"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
R="launch/run_local.sh"

if want info; then
    { nvidia-smi; nvidia-smi topo -m; $PY -c "import cupy, numpy, sys; print('python', sys.version.split()[0],
'cupy', cupy.__version__, 'numpy', numpy.__version__); import torch; print('torch', torch.__version__);
import mpi4py; print('mpi4py', mpi4py.__version__); from cupy.cuda import nccl; print('nccl', nccl.get_version());
from cupy_backends.cuda.libs import nvrtc; print('nvrtc', nvrtc.getVersion())"; mpirun --version | head -1; } \
        >> "$LOG" 2>&1
    tail -n 12 "$LOG"
fi
if want jit; then
    rm -rf "$DEEPEP_CUPY_JIT_CACHE_DIR"
    step "jit timing (cold/warm)" 300 $PY -m deepep_cupy.tests.jit_timing
fi
if want barrier; then
    step "barrier np=1" 120 $R 1 $PY -m deepep_cupy.tests.barrier
    [ "$NGPU" -ge 2 ] && step "barrier np=$NGPU (1 rank/GPU)" 180 $R "$NGPU" $PY -m deepep_cupy.tests.barrier
    [ "$NGPU" -ge 2 ] && step "barrier np=$NGPU scale-up 1 (NCCL between domains)" 180 \
        env DEEPEP_CUPY_SCALEUP_SIZE=1 $R "$NGPU" $PY -m deepep_cupy.tests.barrier
    step "barrier np=2 on 1 GPU" 180 env CUDA_VISIBLE_DEVICES=0 $R 2 $PY -m deepep_cupy.tests.barrier
    step "barrier np=4 (shared GPUs)" 300 $R 4 $PY -m deepep_cupy.tests.barrier --num-barriers 200 --num-rounds 16
    step "barrier np=8 (shared GPUs)" 300 $R 8 $PY -m deepep_cupy.tests.barrier --num-barriers 100 --num-rounds 16
fi
if want pytest; then
    step "pytest GPU tests" 300 $PY -m pytest -q -x tests/gpu tests/test_runtime_cpu.py
fi
if want ep && [ -f deepep_cupy/tests/ep.py ]; then
    EP="$PY -m deepep_cupy.tests.ep --num-gpu-timeout-secs 30 --num-cpu-timeout-secs 60"
    # Smoke first (small, first mode only): when it fails, the long runs would only repeat the failure.
    step "ep smoke np=$NGPU" 120 $R "$NGPU" $EP --num-tokens 256 --hidden 2048 --test-first-only --skip-perf-test \
        --skip-timeout-test --num-create-destroy 0
    if grep -q "ep smoke.*FAIL" "$SUMMARY"; then stages=(); fi
    [ "$NGPU" -ge 2 ] && want ep && step "ep np=$NGPU (1 rank/GPU)" 420 $R "$NGPU" $EP
    [ "$NGPU" -ge 2 ] && want ep && step "ep np=$NGPU allow_multiple_reduction=0" 300 $R "$NGPU" $EP \
        --allow-multiple-reduction 0 --num-tokens 1024 --hidden 4096 --skip-perf-test --skip-timeout-test \
        --num-create-destroy 0 --masked-ratio 0.2
    [ "$NGPU" -ge 2 ] && want ep && step "ep np=$NGPU pressure (100 seeds)" 300 $R "$NGPU" $EP --num-tokens 512 \
        --hidden 2048 --do-pressure-test --skip-perf-test --skip-timeout-test --num-create-destroy 0 --unbalanced-ratio 2 \
        --precise-unbalanced-ratio --num-topk 8
    want ep && step "ep np=1" 300 $R 1 $EP --num-create-destroy 20
    want ep && step "ep np=4 (shared GPUs)" 300 $R 4 $EP --num-tokens 256 --hidden 2048 --skip-perf-test --num-create-destroy 5
    want ep && step "ep np=8 (shared GPUs)" 400 $R 8 $EP --num-tokens 128 --hidden 1024 --skip-perf-test --num-create-destroy 2 \
        --test-first-only
fi
if want bench && [ -f perf/ep_bench.py ] && [ "$NGPU" -ge 2 ]; then
    step "ep_bench np=$NGPU" 600 $R "$NGPU" $PY perf/ep_bench.py --out "$OUT"
    step "ep_profile np=$NGPU" 300 $R "$NGPU" $PY perf/ep_profile.py
fi
if want coll; then
    # Collectives, PP, engram and load balancing (issue 3): one rank per GPU with performance, then 4 and 8 ranks
    # sharing the GPUs (logic only).
    for prog in allocation pp agrs engram reduce_grads prefetch_weights; do
        step "$prog np=$NGPU" 300 $R "$NGPU" $PY -m deepep_cupy.tests.$prog
    done
    step "engram fp8 np=$NGPU" 300 $R "$NGPU" $PY -m deepep_cupy.tests.engram --use-fp8
    for np in ${COLL_SHARED_NPS-4 8}; do       # COLL_SHARED_NPS= (empty): one rank per GPU only
        step "allocation np=$np (shared GPUs)" 300 $R $np $PY -m deepep_cupy.tests.allocation
        for prog in pp agrs engram reduce_grads prefetch_weights; do
            step "$prog np=$np (shared GPUs)" 300 $R $np $PY -m deepep_cupy.tests.$prog --skip-perf-test
        done
    done
fi
if want tune && [ "$NGPU" -ge 2 ]; then
    # Not in the default list: the reduce-scatter sweep behind agrs.py's defaults, and the load-balancing ring pattern.
    step "reduce-scatter sweep np=$NGPU" 300 $R "$NGPU" $PY perf/reduce_scatter_sweep.py
    step "reduce-scatter host profile np=$NGPU" 120 $R "$NGPU" $PY perf/reduce_scatter_sweep.py --host-only --profile
    step "reduce_grads ring np=$NGPU" 300 $R "$NGPU" $PY -m deepep_cupy.tests.reduce_grads --pattern ring --skip-check \
        --skip-error-test --skip-timeout-test
    step "prefetch_weights ring np=$NGPU" 300 $R "$NGPU" $PY -m deepep_cupy.tests.prefetch_weights --pattern ring \
        --skip-check --skip-error-test --skip-timeout-test
fi
echo "=== summary" | tee -a "$LOG"
cat "$SUMMARY"
! grep -q FAIL "$SUMMARY"
