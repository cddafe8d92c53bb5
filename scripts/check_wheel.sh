#!/usr/bin/env bash
# Build an sdist and a wheel the way a user or a release would
# (python -m build: the wheel is built from the sdist, so a file missing from
# the sdist fails here), install the wheel into a fresh virtual environment
# with the pinned torch and jax (those of .venv, linked), and run
# scripts/wheel_smoke.py there.
#
# --no-isolation: the build uses the pinned jax, jaxlib, pybind11,
# scikit-build-core, cmake and ninja already in .venv. An isolated build would
# install jax and jaxlib (about 100 MB) plus the build tools into a throwaway
# environment on every run, unpinned (build-system.requires has no versions),
# so it would be slower and could compile against another jaxlib than the one
# installed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${T2J_AD_VENV:-.venv}/bin/python"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

export PATH="$(cd "$(dirname "$PY")" && pwd):$PATH"   # cmake and ninja from .venv
SECONDS=0
"$PY" -m build --no-isolation --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 \
  || { cat "$WORK/build.log"; exit 1; }
echo "built $(cd "$WORK/dist" && ls | tr '\n' ' ')in ${SECONDS}s"

"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
# The pinned torch, jax and the rest come from .venv, linked rather than
# installed again (unpacking torch took half this check): every entry of
# .venv's site-packages but t2j_ad's own (its editable install) and the .pth
# files is linked into one folder the fresh venv puts on its path. pip then
# finds the wheel's requirements met there, at the pinned versions, and
# installs the wheel itself into the venv's own site-packages.
site_of() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
mkdir "$WORK/pinned"
for entry in "$(site_of "$PY")"/*; do
  case "$(basename "$entry")" in
    t2j_ad* | _editable_skbc_t2j_ad* | *.pth | __pycache__) ;;
    *) ln -s "$entry" "$WORK/pinned/" ;;
  esac
done
echo "$WORK/pinned" >"$(site_of "$VPY")/t2j_ad_check_pinned.pth"
pip_install() { "$VPY" -m pip install --quiet --disable-pip-version-check --no-compile -c "$ROOT/constraints.txt" "$@"; }
pip_install "$WORK"/dist/t2j_ad-*.whl
echo "fresh venv with .venv's torch and jax and the wheel in ${SECONDS}s"
# Run from outside the repository so the installed wheel is imported, not ./t2j_ad.
(cd "$WORK" && env -u PYTHONPATH "$VPY" "$ROOT/scripts/wheel_smoke.py")
