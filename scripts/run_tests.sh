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
PY="${T2J_AD_VENV:-.venv}/bin/python"
export JAX_PLATFORMS=cpu T2J_AD_TORCH_THREADS=1
# Each pytest run appends the number of property examples it executed here
# (NOTE [counting examples] in tests/property/conftest.py); summed at the end.
T2J_AD_EXAMPLE_COUNT_FILE="$(mktemp)"
export T2J_AD_EXAMPLE_COUNT_FILE
print_example_count() {
  echo "property examples this run: $(awk '{ n += $1 } END { print n + 0 }' "$T2J_AD_EXAMPLE_COUNT_FILE")"
  rm -f "$T2J_AD_EXAMPLE_COUNT_FILE"
}
trap print_example_count EXIT

echo "== packaging: sdist + wheel, installed into a fresh venv =="
bash scripts/check_wheel.sh

echo "== full suite, default backend =="
"$PY" -m pytest tests -q -p no:cacheprovider --ignore=tests/multidevice "$@"

echo "== 4 simulated devices: sharded jit, shard_map, pmap, 2 processes =="
XLA_FLAGS=--xla_force_host_platform_device_count=4 "$PY" -m pytest tests/multidevice -q -p no:cacheprovider "$@"

echo "== core transform tests and property suite, compile='graph' =="
# Fewer property examples than the eager run above (60 per pair): the same
# math, every example traced; CI's 20-minute budget has room for 8 per pair.
T2J_AD_COMPILE=graph T2J_AD_HYPOTHESIS_EXAMPLES=8 "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_ad.py tests/test_batching.py tests/test_module.py tests/test_ad_fallbacks.py tests/property "$@"

echo "== core tests, callback backend =="
T2J_AD_BACKEND=callback "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_api.py tests/test_module.py tests/test_bad_input.py tests/test_ad.py tests/test_batching.py "$@"
