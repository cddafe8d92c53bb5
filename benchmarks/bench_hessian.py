"""Hessian of a PyTorch loss: ``jit(jax.hessian)`` through t2j_ad.

MLP 5-14-1 (tanh), mean squared error over a batch of 64; its 99 parameters
are flattened into one vector, so the Hessian is 99 x 99. Contenders, timed
in one run:

- ``t2j_ad``: ``jax.jit(jax.hessian(loss))`` of the jaxify'd PyTorch loss
  (forward over reverse: one batched PyTorch call per level);
- ``torch.func``: ``torch.func.hessian(loss)`` on the same loss;
- ``pure JAX``: the same math written in ``jax.numpy``, for context.

Target (issue 4): t2j_ad at most 1.2x torch.func.

    python benchmarks/bench_hessian.py [--threads 1 2]
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from common import thread_args, markdown_table, print_report, set_threads, time_calls  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.func  # noqa: E402

import t2j_ad  # noqa: E402

BATCH, D_IN, HIDDEN = 64, 5, 14
# W1 (HIDDEN, D_IN), b1 (HIDDEN), W2 (1, HIDDEN), b2 (1)
SHAPES = ((HIDDEN, D_IN), (HIDDEN,), (1, HIDDEN), (1,))
N_PARAMS = sum(int(np.prod(s)) for s in SHAPES)
assert N_PARAMS == 99


def _unflatten(theta, reshape):
    parts, start = [], 0
    for shape in SHAPES:
        size = int(np.prod(shape))
        parts.append(reshape(theta[start : start + size], shape))
        start += size
    return parts


def torch_loss(theta, x, y):
    w1, b1, w2, b2 = _unflatten(theta, torch.reshape)
    h = torch.tanh(x @ w1.T + b1)
    return ((h @ w2.T + b2).squeeze(-1) - y).pow(2).mean()


def jax_loss(theta, x, y):
    w1, b1, w2, b2 = _unflatten(theta, jnp.reshape)
    h = jnp.tanh(x @ w1.T + b1)
    return (((h @ w2.T + b2).squeeze(-1) - y) ** 2).mean()


def make_data(seed: int = 0):
    rng = np.random.default_rng(seed)
    theta = (rng.standard_normal(N_PARAMS) * 0.5).astype(np.float32)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    y = rng.standard_normal(BATCH).astype(np.float32)
    return theta, x, y


def contenders():
    theta, x, y = make_data()
    jtheta, jx, jy = map(jnp.asarray, (theta, x, y))
    ttheta, tx, ty = map(torch.from_numpy, (theta, x, y))

    hessian = jax.jit(jax.hessian(t2j_ad.jaxify(torch_loss)))
    pure = jax.jit(jax.hessian(jax_loss))
    reference = torch.func.hessian(torch_loss)

    # Every contender computes the same Hessian.
    expected = np.asarray(pure(jtheta, jx, jy))
    for got in (hessian(jtheta, jx, jy), reference(ttheta, tx, ty)):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)

    return {
        "t2j_ad": lambda: jax.block_until_ready(hessian(jtheta, jx, jy)),
        "torch.func": lambda: reference(ttheta, tx, ty),
        "pure JAX": lambda: jax.block_until_ready(pure(jtheta, jx, jy)),
    }


def main() -> None:
    args = thread_args(__doc__)

    sections = []
    for n in args.threads:
        set_threads(n)
        timings = time_calls(contenders(), repeats=args.repeats)
        by_name = {t.name: t.median for t in timings}
        summary = f"t2j_ad / torch.func = {by_name['t2j_ad'] / by_name['torch.func']:.2f}x (target <= 1.2x)"
        sections.append((f"PyTorch threads: {n}", markdown_table(timings, "torch.func") + "\n\n" + summary))
    command = "python benchmarks/bench_hessian.py --threads " + " ".join(map(str, args.threads))
    print_report(f"Hessian, MLP {D_IN}-{HIDDEN}-1 ({N_PARAMS} parameters), batch {BATCH}", command, sections)


if __name__ == "__main__":
    main()
