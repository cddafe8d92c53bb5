#!/usr/bin/env bash
# Set everything up, then the packaging check (an sdist and a wheel built with
# python -m build, the wheel installed into a fresh venv and smoke-tested),
# then the whole test suite on the default (C++ FFI) backend (the strict docs
# build and the link check included: tests/test_docs.py); tests/multidevice on
# 4 simulated CPU devices (XLA_FLAGS must be set before JAX starts, hence its
# own run); the core transform tests and the property suite again with every
# PyTorch function traced (compile="graph"); then the core tests again on the
# Python callback backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/test_sets.sh
PY="${T2J_AD_VENV:-.venv}/bin/python"
# The tests follow JAX's default platform; .venv has the CPU torch, so JAX is
# pinned to the CPU here too (on a CUDA machine: scripts/run_gpu_checks.sh).
export JAX_PLATFORMS=cpu T2J_AD_TORCH_THREADS=1
# The three long runs spread their tests over pytest-xdist workers, one a core
# (T2J_AD_TEST_WORKERS=0 runs them in this process); each worker is a process
# of its own with PyTorch at one thread, so they do not oversubscribe.
WORKERS=(-n "${T2J_AD_TEST_WORKERS:-2}")
# Each pytest run appends the number of property examples it executed here
# (NOTE [counting examples] in tests/property/conftest.py); summed at the end.
T2J_AD_EXAMPLE_COUNT_FILE="$(mktemp)"
export T2J_AD_EXAMPLE_COUNT_FILE
print_example_count() {
  echo "property examples this run: $(awk '{ n += $1 } END { print n + 0 }' "$T2J_AD_EXAMPLE_COUNT_FILE")"
  rm -f "$T2J_AD_EXAMPLE_COUNT_FILE"
}
# JAX's persistent compilation cache, in a directory of this run's own
# (scripts/compilation_cache.sh).
source scripts/compilation_cache.sh
start_compilation_cache
finish() {
  print_example_count
  rm -rf "$JAX_COMPILATION_CACHE_DIR"
}
trap finish EXIT

echo "== packaging: sdist + wheel, installed into a fresh venv =="
bash scripts/check_wheel.sh

echo "== full suite, default backend =="
"$PY" -m pytest tests -q -p no:cacheprovider --ignore=tests/multidevice "${WORKERS[@]}" "$@"

echo "== 4 simulated devices: sharded jit, shard_map, pmap, 2 processes =="
XLA_FLAGS=--xla_force_host_platform_device_count=4 "$PY" -m pytest tests/multidevice -q -p no:cacheprovider "$@"

echo "== core transform tests and property suite, compile='graph' =="
T2J_AD_COMPILE=graph T2J_AD_HYPOTHESIS_EXAMPLES="$GRAPH_MODE_EXAMPLES" "$PY" -m pytest -q -p no:cacheprovider \
  "${WORKERS[@]}" "${GRAPH_MODE_TESTS[@]}" "$@"

echo "== core tests, callback backend =="
T2J_AD_BACKEND=callback "$PY" -m pytest -q -p no:cacheprovider "${WORKERS[@]}" "${CALLBACK_TESTS[@]}" "$@"
