#!/usr/bin/env bash
# The test suite and the benchmarks on a CUDA machine, without network.
#
#   bash scripts/run_gpu_checks.sh [LOG_DIR]      # LOG_DIR: $1, else $OUT, else ./gpu-logs
#
# For a machine whose python3 (or $PYTHON) already has jax with CUDA, a CUDA
# build of torch, and pybind11, scikit-build-core, cmake, ninja, pytest and
# hypothesis (the docs and notebook tests skip, naming what they need, unless
# requirements.txt's mkdocs/nbclient/... are there too). Steps:
#   1. preflight: nvidia-smi -L, the jax and torch versions, jax.devices();
#      stops here unless JAX's default backend is gpu and torch sees CUDA;
#   2. install: t2j_ad itself, editable, compiled against this jaxlib
#      (pip install --no-build-isolation --no-deps --no-index -e .); stops
#      here if that fails;
#   3. the whole suite on the GPU as scripts/run_tests.sh runs it on the CPU:
#      unit and property tests; the core transform tests and the property
#      suite with compile="graph" (CUDA graphs); the core tests on the
#      callback backend (scripts/test_sets.sh names the files). tests/multidevice
#      is left out: its 4 devices are simulated CPU devices;
#   4. tests/test_kept_inputs.py with the kept-input look turned on for CUDA
#      calls (it is off there until such a run passes);
#   5. the benchmarks that make sense on a GPU (all but bench_sharded.py,
#      which simulates 4 CPU devices), at modest sizes.
# About 25 minutes in all with one pytest process per run; with pytest-xdist
# (see PYTEST below) and the three test runs at once (T2J_AD_GPU_CONCURRENT=1)
# about 3 minutes on a 16-core H200 on 2026-11-26, but 9 minutes on a 16-core
# H100 on 2026-11-28 with the suite of then (the unit run 533 s, graph mode
# 272 s, callback 244 s), so a 10-minute command ends before step 4. To split the run (a machine that limits each
# command's time), name the steps to run after preflight and install:
#   T2J_AD_GPU_STEPS="unit-and-property-tests bench-call-latency" bash scripts/run_gpu_checks.sh LOG_DIR
# (the step names are those of the summary). Each step's output goes to the terminal and to
# LOG_DIR/<step>.log; a failing step does not stop the later ones (except 1
# and 2); LOG_DIR/summary.txt lists every step's result, and the exit status is
# nonzero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/test_sets.sh

PY="${PYTHON:-python3}"
LOG_DIR="${1:-${OUT:-./gpu-logs}}"
mkdir -p "$LOG_DIR"
LOG_DIR="$(cd "$LOG_DIR" && pwd)"
# cmake and ninja installed with pip live next to the interpreter.
PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
export PATH
# JAX must not take 75% of the GPU up front: PyTorch allocates on it too.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Full float32 matmuls in JAX, as PyTorch computes them: the benchmarks hold
# every contender against pure JAX (the tests pin this themselves: NOTE [full
# float32 matmuls in tests] in tests/conftest.py).
export JAX_DEFAULT_MATMUL_PRECISION=highest

RESULTS=()
FAILED=0

# outcome NAME STATUS SECONDS LIMIT: the summary's line for a step.
outcome() {
  if [ "$2" -eq 0 ]; then
    echo "passed  $1 ($3 s)"
  else
    local why="exit status $2"
    [ "$2" -eq 124 ] && why="timed out after $4 s"
    echo "FAILED  $1 ($why, $3 s; log: $LOG_DIR/$1.log)"
  fi
}

record() {
  RESULTS+=("$1")
  [[ "$1" == FAILED* ]] && FAILED=1
  return 0
}

# step NAME LIMIT_SECONDS COMMAND...: run COMMAND, its output to the terminal
# and to LOG_DIR/NAME.log, killed after LIMIT_SECONDS; record the outcome.
# With IN_BACKGROUND set, it runs in the background, its output to the log
# only, and collect_steps records the outcome once it has ended.
step() {
  local name=$1 limit=$2
  shift 2
  if [ -n "${T2J_AD_GPU_STEPS:-}" ] && [ "$name" != preflight ] && [ "$name" != install ] &&
    [[ " $T2J_AD_GPU_STEPS " != *" $name "* ]]; then
    RESULTS+=("skipped $name (not in T2J_AD_GPU_STEPS)")
    return 0
  fi
  echo
  local start=$SECONDS
  if [ -n "${IN_BACKGROUND:-}" ]; then
    echo "== $name, in the background (log: $LOG_DIR/$name.log): $* =="
    (
      timeout -k 30 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
      outcome "$name" "$?" $((SECONDS - start)) "$limit" >"$LOG_DIR/$name.outcome"
    ) &
    return 0
  fi
  echo "== $name: $* =="
  timeout -k 30 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  record "$(outcome "$name" "$rc" $((SECONDS - start)) "$limit")"
  return "$rc"
}

# collect_steps NAME...: wait for the steps run in the background and record
# their outcomes (a step T2J_AD_GPU_STEPS left out was recorded already).
collect_steps() {
  wait
  local name
  for name in "$@"; do
    if [ -f "$LOG_DIR/$name.outcome" ]; then
      record "$(cat "$LOG_DIR/$name.outcome")"
      rm -f "$LOG_DIR/$name.outcome"
    fi
  done
}

summary() {
  {
    echo
    echo "== summary (logs in $LOG_DIR) =="
    printf '%s\n' "${RESULTS[@]}"
    [ "$#" -gt 0 ] && echo "$*"
  } | tee "$LOG_DIR/summary.txt"
}

preflight() {
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "(no nvidia-smi on PATH)"; fi
  "$PY" - <<'EOF'
import sys

import jax
import jaxlib
import torch

print("python", sys.version.split()[0])
print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("torch", torch.__version__, "built for CUDA", torch.version.cuda)
print("jax.devices():", jax.devices())
problems = []
if jax.default_backend() != "gpu":
    problems.append(
        f"JAX's default backend is {jax.default_backend()!r}, not 'gpu': install jax with CUDA "
        "(jax[cuda12]) and leave JAX_PLATFORMS unset."
    )
if not torch.cuda.is_available():
    problems.append(
        f"torch.cuda.is_available() is False: torch {torch.__version__} is a CPU build or sees no GPU; "
        "install a CUDA build of torch."
    )
for problem in problems:
    print("NOT A CUDA MACHINE FOR THESE CHECKS:", problem, file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
}

install() {
  "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . &&
    "$PY" -c "import t2j_ad.backends as b, t2j_ad.backends.ffi as f; print('t2j_ad backend', b.select().__name__, 'FFI platforms', sorted(f.platforms()))"
}

export PY
export -f preflight install  # for the bash that timeout starts
step preflight 300 bash -c preflight || { summary "stopped: no GPU for both JAX and PyTorch"; exit 1; }
step install 900 bash -c install || { summary "stopped: t2j_ad did not install"; exit 1; }

# One JAX compilation cache for the test runs and the benchmarks
# (scripts/compilation_cache.sh), removed when the script ends.
source scripts/compilation_cache.sh
start_compilation_cache
trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT

# -v names each test as it ends, so a run cut short still names its failures;
# -rfEs lists failures, errors and skips (with reasons) at the end;
# --durations names the slowest tests, for the next run's planning.
PYTEST=("$PY" -m pytest -v -p no:cacheprovider -rfEs --durations=25)
# The first run's property examples per test: 20 here, against 60 in CI. A
# GPU machine is lent for minutes, and these tests check the GPU path of the
# same math the CPU runs hold to 60 (T2J_AD_GPU_EXAMPLES sets another count).
GPU_EXAMPLES="${T2J_AD_GPU_EXAMPLES:-20}"
# pytest-xdist, where installed, spreads each run over worker processes that
# share the GPU: half the cores (at most 8) when the runs take turns, and
# with T2J_AD_GPU_CONCURRENT=1, where the three runs go at once, a half, a
# fifth and an eighth of them (an H200 machine with 16 cores ran them so,
# 9, 3 and 2 workers, in about 3 minutes). T2J_AD_TEST_WORKERS sets every
# run's count instead.
CORES=$(nproc 2>/dev/null || echo 2)
XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST=1
# workers NUMERATOR DENOMINATOR: pytest's -n for that share of the cores, or nothing without xdist.
workers() {
  [ -n "$XDIST" ] || return 0
  local n=$((CORES * $1 / $2))
  n=$((n < 1 ? 1 : (n > 8 ? 8 : n)))
  echo "-n ${T2J_AD_TEST_WORKERS:-$n}"
}
if [ -n "${T2J_AD_GPU_CONCURRENT:-}" ]; then
  SHARES=("1 2" "1 5" "1 8")
  IN_BACKGROUND=1
else
  SHARES=("1 2" "1 2" "1 2")
fi
# shellcheck disable=SC2046 # workers prints "-n N" or nothing: split on purpose
step unit-and-property-tests 1500 env T2J_AD_HYPOTHESIS_EXAMPLES="$GPU_EXAMPLES" \
  "${PYTEST[@]}" $(workers ${SHARES[0]}) tests --ignore=tests/multidevice
# shellcheck disable=SC2046
step graph-mode-tests 900 env T2J_AD_COMPILE=graph T2J_AD_HYPOTHESIS_EXAMPLES="$GRAPH_MODE_EXAMPLES" \
  "${PYTEST[@]}" $(workers ${SHARES[1]}) "${GRAPH_MODE_TESTS[@]}"
# shellcheck disable=SC2046
step callback-backend-tests 600 env T2J_AD_BACKEND=callback "${PYTEST[@]}" $(workers ${SHARES[2]}) "${CALLBACK_TESTS[@]}"
IN_BACKGROUND=""
collect_steps unit-and-property-tests graph-mode-tests callback-backend-tests
# Not yet on for CUDA calls: the look for inputs kept past a call (NOTE
# [inputs kept past a call]). Its tests, with the look turned on for CUDA, say
# whether it can be.
step kept-inputs-on-cuda 300 env T2J_AD_TEST_KEPT_INPUTS_ON_CUDA=1 "${PYTEST[@]}" tests/test_kept_inputs.py

# The benchmarks run on the CPU unless JAX_PLATFORMS says otherwise
# (benchmarks/common.py); here they run on the GPU.
BENCH=(env "JAX_PLATFORMS=cuda,cpu" "$PY")
step bench-call-latency 600 "${BENCH[@]}" benchmarks/bench_call_latency.py --large-mb 64 --repeats 11
step bench-per-example-grads 600 "${BENCH[@]}" benchmarks/bench_per_example_grads.py --threads 1 --repeats 5
step bench-hessian 600 "${BENCH[@]}" benchmarks/bench_hessian.py --threads 1 --repeats 5
step bench-training-step 600 "${BENCH[@]}" benchmarks/bench_training_step.py --threads 1 --repeats 5
step bench-dropout 600 "${BENCH[@]}" benchmarks/bench_dropout.py --threads 1 --repeats 5
step bench-soak 600 "${BENCH[@]}" benchmarks/bench_soak.py --calls 20000 --wrappers 1000 --warmup-wrappers 300 --reports 4
step bench-registry-memory 600 "${BENCH[@]}" benchmarks/bench_registry_memory.py --calls 1000 --warmup-wrappers 300 --reports 4
step bench-registry-memory-graph 600 "${BENCH[@]}" benchmarks/bench_registry_memory.py --compile graph \
  --calls 300 --warmup-wrappers 100 --reports 3

summary "not run here: tests/multidevice and benchmarks/bench_sharded.py (4 simulated CPU devices; CI runs the tests)"
exit "$FAILED"
