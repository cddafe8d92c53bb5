#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned, tested versions and build t2j_ad.
#
# torch goes in first and pinned: any unpinned torch requirement would pull a
# multi-GB CUDA build. The C++ extension is built with --no-build-isolation so
# its build sees the pinned jax/pybind11 already installed (and never torch).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${T2J_AD_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# The build's cmake and ninja come from the venv (PyPI), not the system.
export PATH="$(cd "$VENV/bin" && pwd):$PATH"
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check -c constraints.txt "$@"; }

pip_install --upgrade pip
pip_install "torch==$(grep -E '^torch==' constraints.txt | cut -d= -f3)"
pip_install -r requirements.txt
pip_install --no-build-isolation -e .
"$PY" -c "import t2j_ad, t2j_ad.backends as b; print('t2j_ad ready; backend:', b.select().__name__.rsplit('.', 1)[-1])"
