"""Run the README's demo (examples/demo.py) as a test.

The demo checks its loss, gradient and Hessian against torch.func, eagerly
and in graph mode with repeated calls, and exits non-zero on a mismatch, so
running it is the test. It once failed while the suite passed: its
mse_loss, called a second time in graph mode, wrote into XLA's output buffer
with an out= kernel that resizes its out (NOTE [results written into XLA's
buffers] in t2j_ad/output_buffers.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"
TIME_LIMIT_S = 300.0  # a hang guard: the demo takes seconds


def test_the_demo_agrees_with_torch_func():
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    done = subprocess.run(
        [sys.executable, str(DEMO)], capture_output=True, text=True, timeout=TIME_LIMIT_S, env=env, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "agreement with torch.func: OK" in done.stdout
