"""Smoke test of an installed t2j_ad wheel (run by scripts/check_wheel.sh).

Checks that the package imports from the installed location, that its C++
extension holds both the CPU and the CUDA handler and is the backend used,
and that jit of grad of a jaxify'd PyTorch function equals pure JAX.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import t2j_ad  # noqa: E402
from t2j_ad import backends  # noqa: E402
from t2j_ad.backends import ffi  # noqa: E402


def main() -> int:
    installed = Path(t2j_ad.__file__).resolve()
    assert "site-packages" in installed.parts, f"t2j_ad imported from {installed}, not the installed wheel"
    assert backends.select() is ffi, f"backend is {backends.select().__name__}, expected the FFI backend"
    assert ffi.platforms() == {"cpu", "cuda"}, f"handlers for {sorted(ffi.platforms())}, expected cpu and cuda"

    @t2j_ad.jaxify
    def loss(w, x):
        return torch.sum(torch.tanh(x @ w) ** 2)

    def reference(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w = jnp.linspace(-1.0, 1.0, 5)
    x = jnp.arange(15.0).reshape(3, 5) / 15.0
    grad = jax.jit(jax.grad(loss))
    np.testing.assert_allclose(grad(w, x), jax.grad(reference)(w, x), rtol=1e-5, atol=1e-6)
    hlo = grad.lower(w, x).as_text()
    assert f"custom_call @{ffi.TARGET}" in hlo, "the jitted gradient does not call the FFI handler"
    print(f"wheel smoke test passed: t2j_ad {t2j_ad.__version__} from {installed.parent}, "
          f"torch {torch.__version__}, jax {jax.__version__}, FFI backend for {sorted(ffi.platforms())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
