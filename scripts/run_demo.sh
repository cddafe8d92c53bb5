#!/usr/bin/env bash
# Set everything up, then run the demo: a PyTorch loss under jax.jit, its
# gradient and its Hessian, checked against torch.func, with timings.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
"${T2J_AD_VENV:-.venv}/bin/python" examples/demo.py
