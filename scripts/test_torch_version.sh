#!/usr/bin/env bash
# The unit and property suite under another PyTorch, on the CPU:
#
#   bash scripts/test_torch_version.sh 2.11.0 [pytest options, e.g. -k kept -x]
#
# The GPU machines hold torch 2.11 (a CUDA build); PyPI's torch wheel for
# Linux is such a build, and runs on a CPU, so what differs in that PyTorch
# shows here without a GPU (the seventeenth session's 155 GPU failures were
# mostly one such difference: NOTE [inputs kept past a call]). The venv,
# .venv-torch-VERSION, takes that torch and the rest pinned by
# constraints.txt; its CUDA libraries make it several GB, so CI does not run
# this. It runs the source tree as scripts/setup_env.sh built it: the C++
# extension links jaxlib, not torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:?usage: bash scripts/test_torch_version.sh VERSION [pytest arguments], e.g. 2.11.0}"
shift
bash scripts/setup_env.sh  # the extension, built in place
VENV=".venv-torch-$VERSION"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
grep -v '^torch==' constraints.txt > "$CONSTRAINTS"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$CONSTRAINTS" "torch==$VERSION" -r requirements.txt
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
# The source tree, for the examples and notebooks the tests run in processes of their own too.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS=cpu T2J_AD_TORCH_THREADS=1
"$VENV/bin/python" -m pytest tests -q -p no:cacheprovider --ignore=tests/multidevice -n "${T2J_AD_TEST_WORKERS:-2}" "$@"
