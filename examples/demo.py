"""t2j_ad demo: a PyTorch loss through jax.jit, its gradient and its Hessian.

Each result is checked against torch.func on the same loss, eagerly
(``compile="eager"``) and with every derived PyTorch function traced once and
replayed (``compile="graph"``); the script prints the agreement and the
timings of both sides, and exits non-zero on mismatch.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import t2j_ad  # noqa: E402

# A small regression MLP (5-14-1) whose 99 parameters live in one flat vector,
# written in plain PyTorch.
SIZES = [(14, 5), (14,), (1, 14), (1,)]
N_PARAMS = sum(int(np.prod(s)) for s in SIZES)


def unflatten(theta: torch.Tensor) -> list[torch.Tensor]:
    parts, start = [], 0
    for shape in SIZES:
        n = int(np.prod(shape))
        parts.append(theta[start : start + n].reshape(shape))
        start += n
    return parts


def torch_loss(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = unflatten(theta)
    hidden = torch.tanh(x @ w1.T + b1)
    pred = (hidden @ w2.T + b2).squeeze(-1)
    return torch.nn.functional.mse_loss(pred, y)


def median_seconds(fn, repeats: int = 30) -> float:
    fn()  # warm up (and compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    t2j_ad.set_torch_threads(1)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    theta = rng.normal(scale=0.5, size=N_PARAMS).astype(np.float32)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = np.sin(x.sum(axis=1)).astype(np.float32)

    tt, tx, ty = (torch.from_numpy(a) for a in (theta, x, y))
    torch_grad = torch.func.grad(torch_loss)
    torch_hessian = torch.func.hessian(torch_loss)

    rows = []
    for mode in ("eager", "graph"):
        loss = t2j_ad.jaxify(torch_loss, compile=mode)
        value = jax.jit(loss)
        grad = jax.jit(jax.grad(loss))
        hessian = jax.jit(jax.hessian(loss))
        rows += [
            (f"loss ({mode})", lambda value=value: value(theta, x, y), lambda: torch_loss(tt, tx, ty)),
            (f"gradient ({mode})", lambda grad=grad: grad(theta, x, y), lambda: torch_grad(tt, tx, ty)),
            (f"Hessian ({mode})", lambda hessian=hessian: hessian(theta, x, y), lambda: torch_hessian(tt, tx, ty)),
        ]
    print(f"t2j_ad demo: PyTorch MLP loss with {N_PARAMS} parameters, batch {len(x)}")
    print(f"{'quantity':<18} {'shape':<10} {'max |diff|':>11} {'t2j_ad (ms)':>12} {'torch.func (ms)':>16} {'ratio':>6}")
    ok = True
    for name, ours, theirs in rows:
        with torch.no_grad():
            expected = theirs().numpy()
        got = np.asarray(jax.block_until_ready(ours()))
        diff = float(np.max(np.abs(got - expected))) if got.size else 0.0
        ok &= bool(np.allclose(got, expected, rtol=1e-4, atol=1e-5))
        t_ours = median_seconds(lambda: jax.block_until_ready(ours()))
        t_theirs = median_seconds(theirs)
        print(
            f"{name:<18} {str(got.shape):<10} {diff:>11.2e} {t_ours * 1e3:>12.3f} "
            f"{t_theirs * 1e3:>16.3f} {t_ours / t_theirs:>6.2f}"
        )
    eigenvalues = np.linalg.eigvalsh(np.asarray(hessian(theta, x, y)))
    print(f"Hessian eigenvalues: min {eigenvalues.min():.4f}, max {eigenvalues.max():.4f}")
    print("agreement with torch.func:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
