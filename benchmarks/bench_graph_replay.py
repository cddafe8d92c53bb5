"""Graph mode's replay of small ops: plain calls and gradients against eager.

A residual MLP of small ops (8 blocks of a 32x32 matmul, ``layer_norm``,
``tanh`` and an add; batch 16), the size where per-op overhead, not math,
sets the time. Contenders, timed interleaved in one run:

- ``PyTorch``: the function called on torch tensors, no JAX;
- ``t2j_ad``: ``jax.jit`` of the jaxify'd function, eager;
- ``t2j_ad graph``: the same with ``compile="graph"``, whose replay calls
  each op through PyTorch's public binding where it reaches the same op
  (NOTE [graph ops through the public bindings]);
- ``t2j_ad graph, OpOverload calls``: graph mode with that step left out
  (every op called as ``torch.ops.aten.<op>.<overload>``, as before it);
- the same four for ``jax.grad`` (``torch.func.grad`` for PyTorch).

Every contender's value and gradient are checked against PyTorch's first.

    python benchmarks/bench_graph_replay.py [--threads 1]
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from common import markdown_table, print_report, set_threads, thread_args, time_calls, torch_done  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import t2j_ad  # noqa: E402
from t2j_ad import graph_mode  # noqa: E402

BATCH, WIDTH, BLOCKS = 16, 32, 8


def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = x
    for k in range(BLOCKS):
        h = torch.nn.functional.layer_norm(torch.tanh(h @ w[k]) + h, (WIDTH,))
    return (h**2).mean()


def _without_public_bindings(fn):  # noqa: ANN001, ANN202
    """``fn`` whose first call (the trace) keeps the OpOverload calls."""

    def call(*args):  # noqa: ANN002, ANN202
        kept = graph_mode.through_public_bindings
        graph_mode.through_public_bindings = lambda graph: 0
        try:
            return fn(*args)
        finally:
            graph_mode.through_public_bindings = kept

    return call


def contenders() -> dict:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((BLOCKS, WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    tw, tx = torch.from_numpy(w), torch.from_numpy(x)
    jw, jx = jnp.asarray(w), jnp.asarray(x)
    want_value = loss(tw, tx)
    want_grad = torch.func.grad(loss)(tw, tx)
    fns = {
        "t2j_ad": t2j_ad.jaxify(loss),
        "t2j_ad graph": t2j_ad.jaxify(loss, compile="graph"),
        "t2j_ad graph, OpOverload calls": t2j_ad.jaxify(loss, compile="graph"),
    }
    calls = {"PyTorch": torch_done(lambda: loss(tw, tx))}
    grad_calls = {"PyTorch": torch_done(lambda: torch.func.grad(loss)(tw, tx))}
    for name, f in fns.items():
        value, grad = jax.jit(f), jax.jit(jax.grad(f))
        if name.endswith("OpOverload calls"):
            value, grad = _without_public_bindings(value), _without_public_bindings(grad)
        np.testing.assert_allclose(float(value(jw, jx)), float(want_value), rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(grad(jw, jx)), want_grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
        calls[name] = (lambda v: lambda: jax.block_until_ready(v(jw, jx)))(value)
        grad_calls[name] = (lambda g: lambda: jax.block_until_ready(g(jw, jx)))(grad)
    return calls, grad_calls


def _summary(timings) -> str:  # noqa: ANN001
    by = {t.name: t.median for t in timings}
    return (
        f"graph / eager = {by['t2j_ad graph'] / by['t2j_ad']:.2f}x; "
        f"graph with OpOverload calls / eager = {by['t2j_ad graph, OpOverload calls'] / by['t2j_ad']:.2f}x"
    )


def main() -> None:
    args = thread_args(__doc__)
    sections = []
    for n in args.threads:
        set_threads(n)
        calls, grad_calls = contenders()
        values = time_calls(calls, repeats=args.repeats)
        grads = time_calls(grad_calls, repeats=args.repeats)
        tables = ((f"Plain calls, PyTorch threads: {n}", values), (f"`jax.grad`, PyTorch threads: {n}", grads))
        for heading, timings in tables:
            sections.append((heading, markdown_table(timings, "t2j_ad") + "\n\n" + _summary(timings)))
    command = "python benchmarks/bench_graph_replay.py --threads " + " ".join(map(str, args.threads))
    print_report(f"Graph replay of small ops: {BLOCKS} residual blocks, batch {BATCH} x {WIDTH}", command, sections)


if __name__ == "__main__":
    main()
