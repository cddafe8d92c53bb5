"""Hessian of a PyTorch loss: ``jit(jax.hessian)`` through t2j_ad.

MLP 5-14-1 (tanh), mean squared error over a batch of 64; its 99 parameters
are flattened into one vector, so the Hessian is 99 x 99. Contenders, timed
in one run:

- ``t2j_ad``: ``jax.jit(jax.hessian(loss))`` of the jaxify'd PyTorch loss
  (forward over reverse: one batched PyTorch call per level);
- ``torch.func``: ``torch.func.hessian(loss)`` on the same loss;
- ``t2j_ad graph`` / ``t2j_ad inductor``: as the first, with
  ``compile="graph"`` and ``compile="inductor"``;
- ``pure JAX``: the same math written in ``jax.numpy``.

Targets: t2j_ad at most 1.2x torch.func (issue 4); graph at most 0.8x
torch.func, inductor at most 1.0x pure JAX (issue 14). First-call costs are
reported as in bench_per_example_grads.py.

    python benchmarks/bench_hessian.py [--threads 1 2]
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402
    compiled_modes_summary,
    first_call_costs,
    first_call_probe,
    fresh_inductor_cache,
    markdown_table,
    print_report,
    second_process_section,
    set_threads,
    thread_args,
    time_calls,
    to_torch,
    torch_done,
)

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


def contenders(first_calls: list[str], modes: list[str]):
    theta, x, y = make_data()
    jtheta, jx, jy = map(jnp.asarray, (theta, x, y))
    ttheta, tx, ty = to_torch(theta, x, y)

    hessian = jax.jit(jax.hessian(t2j_ad.jaxify(torch_loss)))
    compiled = {}
    for mode in modes:
        jaxified = t2j_ad.jaxify(torch_loss, compile=mode)
        compiled[mode] = jax.jit(jax.hessian(jaxified))
        first_calls.append(
            first_call_costs(mode, jaxified, lambda f=compiled[mode]: jax.block_until_ready(f(jtheta, jx, jy)))
        )
    pure = jax.jit(jax.hessian(jax_loss))
    reference = torch.func.hessian(torch_loss)

    # Every contender computes the same Hessian.
    expected = np.asarray(pure(jtheta, jx, jy))
    for got in (hessian(jtheta, jx, jy), *(f(jtheta, jx, jy) for f in compiled.values())):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(reference(ttheta, tx, ty).cpu().numpy(), expected, rtol=1e-4, atol=1e-5)

    return {
        "t2j_ad": lambda: jax.block_until_ready(hessian(jtheta, jx, jy)),
        **{f"t2j_ad {m}": lambda f=f: jax.block_until_ready(f(jtheta, jx, jy)) for m, f in compiled.items()},
        "torch.func": torch_done(lambda: reference(ttheta, tx, ty)),
        "pure JAX": lambda: jax.block_until_ready(pure(jtheta, jx, jy)),
    }


def probe_first_call() -> None:
    """In a fresh process: the inductor version's first call (common.first_call_probe)."""
    theta, x, y = map(jnp.asarray, make_data())
    jaxified = t2j_ad.jaxify(torch_loss, compile="inductor")
    f = jax.jit(jax.hessian(jaxified))
    first_call_probe(jaxified, lambda: jax.block_until_ready(f(theta, x, y)))


def main() -> None:
    args = thread_args(__doc__)
    if args.first_call_probe:
        probe_first_call()
        return
    fresh_inductor_cache()

    sections = []
    for n in args.threads:
        set_threads(n)
        first_calls: list[str] = []
        timings = time_calls(contenders(first_calls, args.modes), repeats=args.repeats)
        by_name = {t.name: t.median for t in timings}
        summary = (
            f"t2j_ad / torch.func = {by_name['t2j_ad'] / by_name['torch.func']:.2f}x (target <= 1.2x)"
        )
        summary += compiled_modes_summary(by_name, args.modes, inductor_target=1.0)
        costs = "First calls (this process): " + "; ".join(first_calls)
        sections.append((f"PyTorch threads: {n}", markdown_table(timings, "torch.func") + "\n\n" + summary + "\n\n" + costs))
    if "inductor" in args.modes:
        sections.append(second_process_section(__file__))
    command = "python benchmarks/bench_hessian.py " + " ".join(sys.argv[1:])
    print_report(f"Hessian, MLP {D_IN}-{HIDDEN}-1 ({N_PARAMS} parameters), batch {BATCH}", command, sections)


if __name__ == "__main__":
    main()
