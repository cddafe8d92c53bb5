"""Per-example gradients of a PyTorch loss: ``jit(vmap(grad))`` through t2j_ad.

MLP 32-64-1 (tanh), squared error, batch 256. Contenders, timed in one run:

- ``t2j_ad expand_dims``: ``jax.jit(jax.vmap(jax.grad(loss)))`` of the jaxify'd
  PyTorch loss with ``vmap_method="expand_dims"`` (one ``torch.vmap`` call);
- ``torch.func``: ``torch.func.vmap(torch.func.grad(loss))`` on the same loss;
- ``t2j_ad sequential``: as the first, with ``vmap_method="sequential"``
  (the loss called once per example);
- ``t2j_ad graph`` / ``t2j_ad inductor``: as the first, with
  ``compile="graph"`` (the derived PyTorch function traced once and replayed)
  and ``compile="inductor"`` (that graph compiled by inductor);
- ``pure JAX``: the same math written in ``jax.numpy``.

Targets: expand_dims at most 1.2x torch.func, at least 20x faster than
sequential (issue 4); graph at most 0.8x torch.func, inductor at most 1.2x
pure JAX (issue 14). The first call of the graph and inductor versions is
reported too (trace and compile time), and the inductor first call again in
a second process, which finds the compiled kernels in PyTorch's disk cache.

    python benchmarks/bench_per_example_grads.py [--threads 1 2]
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

BATCH, D_IN, HIDDEN, D_OUT = 256, 32, 64, 1


def torch_loss(params, x, y):
    w1, b1, w2, b2 = params
    h = torch.tanh(x @ w1.T + b1)
    return ((h @ w2.T + b2 - y) ** 2).sum()


def jax_loss(params, x, y):
    w1, b1, w2, b2 = params
    h = jnp.tanh(x @ w1.T + b1)
    return ((h @ w2.T + b2 - y) ** 2).sum()


def make_data(seed: int = 0):
    rng = np.random.default_rng(seed)
    params = tuple(
        a.astype(np.float32)
        for a in (
            rng.standard_normal((HIDDEN, D_IN)) / np.sqrt(D_IN),
            rng.standard_normal(HIDDEN) * 0.1,
            rng.standard_normal((D_OUT, HIDDEN)) / np.sqrt(HIDDEN),
            rng.standard_normal(D_OUT) * 0.1,
        )
    )
    x = rng.standard_normal((BATCH, D_IN), dtype=np.float32)
    y = rng.standard_normal((BATCH, D_OUT), dtype=np.float32)
    return params, x, y


def per_example(loss):
    return jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))


def contenders(first_calls: list[str], modes: list[str]):
    params, x, y = make_data()
    jparams, jx, jy = jax.tree.map(jnp.asarray, (params, x, y))
    tparams, tx, ty = to_torch(params, x, y)

    expand = per_example(t2j_ad.jaxify(torch_loss, vmap_method="expand_dims"))
    sequential = per_example(t2j_ad.jaxify(torch_loss, vmap_method="sequential"))
    compiled = {}
    for mode in modes:
        jaxified = t2j_ad.jaxify(torch_loss, vmap_method="expand_dims", compile=mode)
        compiled[mode] = per_example(jaxified)
        first_calls.append(
            first_call_costs(mode, jaxified, lambda f=compiled[mode]: jax.block_until_ready(f(jparams, jx, jy)))
        )
    pure = per_example(jax_loss)
    reference = torch.func.vmap(torch.func.grad(torch_loss), in_dims=(None, 0, 0))

    # Every contender computes the same gradients.
    expected = jax.tree.map(np.asarray, pure(jparams, jx, jy))
    for f in (expand, sequential, *compiled.values(), reference):
        got = f(tparams, tx, ty) if f is reference else f(jparams, jx, jy)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g.cpu() if isinstance(g, torch.Tensor) else np.asarray(g), e, rtol=1e-4, atol=1e-5)

    return {
        "t2j_ad expand_dims": lambda: jax.block_until_ready(expand(jparams, jx, jy)),
        **{f"t2j_ad {m}": lambda f=f: jax.block_until_ready(f(jparams, jx, jy)) for m, f in compiled.items()},
        "torch.func": torch_done(lambda: reference(tparams, tx, ty)),
        "t2j_ad sequential": lambda: jax.block_until_ready(sequential(jparams, jx, jy)),
        "pure JAX": lambda: jax.block_until_ready(pure(jparams, jx, jy)),
    }


def probe_first_call() -> None:
    """In a fresh process: the inductor version's first call (common.first_call_probe)."""
    params, x, y = jax.tree.map(jnp.asarray, make_data())
    jaxified = t2j_ad.jaxify(torch_loss, vmap_method="expand_dims", compile="inductor")
    f = per_example(jaxified)
    first_call_probe(jaxified, lambda: jax.block_until_ready(f(params, x, y)))


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
        # The sequential loop is slow; fewer rounds keep the run short.
        slow = {"t2j_ad sequential": max(3, args.repeats // 3)}
        timings = time_calls(contenders(first_calls, args.modes), repeats=args.repeats, repeats_of=slow)
        by_name = {t.name: t.median for t in timings}
        summary = (
            f"expand_dims / torch.func = {by_name['t2j_ad expand_dims'] / by_name['torch.func']:.2f}x "
            f"(target <= 1.2x); sequential / expand_dims = "
            f"{by_name['t2j_ad sequential'] / by_name['t2j_ad expand_dims']:.1f}x (target >= 20x)"
        )
        summary += compiled_modes_summary(by_name, args.modes, inductor_target=1.2)
        costs = "First calls (this process): " + "; ".join(first_calls)
        sections.append((f"PyTorch threads: {n}", markdown_table(timings, "torch.func") + "\n\n" + summary + "\n\n" + costs))
    if "inductor" in args.modes:
        sections.append(second_process_section(__file__))
    command = "python benchmarks/bench_per_example_grads.py " + " ".join(sys.argv[1:])
    print_report(f"Per-example gradients, MLP {D_IN}-{HIDDEN}-{D_OUT}, batch {BATCH}", command, sections)


if __name__ == "__main__":
    main()
