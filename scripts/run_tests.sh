#!/usr/bin/env bash
# Set everything up, then run the whole test suite: everything on the default
# (C++ FFI) backend, then the core tests again on the Python callback backend.
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

echo "== full suite, default backend =="
"$PY" -m pytest tests -q -p no:cacheprovider "$@"

echo "== core tests, callback backend =="
T2J_AD_BACKEND=callback "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_api.py tests/test_module.py tests/test_bad_input.py tests/test_ad.py tests/test_batching.py "$@"
