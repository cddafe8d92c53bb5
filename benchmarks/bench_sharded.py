"""Sharded per-example gradients on 4 simulated CPU devices: PyTorch work per device.

MLP 32-64-1 (tanh), squared error, global batch 256, mesh of 4 devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``, set here).
``jax.jit(jax.vmap(jax.grad(loss), (None, 0, 0)))`` of the jaxify'd loss:

- ``sharded``: the batch placed with ``NamedSharding(mesh, P("b"))``; the
  partitioned custom call runs each device's 64 rows (NOTE [partitioning
  torch_call]);
- ``replicated``: the batch placed with ``P()``, which is what a call that
  cannot be partitioned gets (before this change, the sharded batch was
  all-gathered into exactly this): every device runs all 256 rows;
- ``pure JAX sharded``: the same math in ``jax.numpy``, batch ``P("b")``.

PyTorch's work is counted by the loss itself: calls (one per ``torch.vmap``
call), and rows (with ``vmap_method="sequential"``, one call per row).
The simulated devices share this machine's cores, so the wall times say how
much CPU work each variant costs in all, not what 4 real devices would take.

    python benchmarks/bench_sharded.py [--threads 1] [--repeats 15]
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from common import markdown_table, print_report, set_threads, thread_args, time_calls  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import t2j_ad  # noqa: E402

BATCH, D_IN, HIDDEN = 256, 32, 64
calls: list[int] = []  # one entry per PyTorch call of the loss (a torch.vmap call counts once)


def torch_loss(params, x, y):
    if x.device.type != "meta":
        calls.append(1)
    w1, b1, w2, b2 = params
    return ((torch.tanh(x @ w1 + b1) @ w2 + b2 - y) ** 2).sum()


def jax_loss(params, x, y):
    w1, b1, w2, b2 = params
    return ((jnp.tanh(x @ w1 + b1) @ w2 + b2 - y) ** 2).sum()


def per_example(loss):
    return jax.jit(jax.vmap(jax.grad(loss), (None, 0, 0)))


def main() -> None:
    args = thread_args(__doc__)
    mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((D_IN, HIDDEN), (HIDDEN,), (HIDDEN, 1), (1,))]
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    y = rng.standard_normal((BATCH, 1)).astype(np.float32)
    put = lambda spec: [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, y)]  # noqa: E731
    rep = jax.device_put(params, NamedSharding(mesh, P()))
    sharded, replicated = put(P("b")), put(P())

    counts = [
        "| variant | PyTorch calls per step | rows per step, all devices | rows per device | all-gathers in HLO |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, data in (("sharded", sharded), ("replicated", replicated)):
        work = {}
        for method in ("expand_dims", "sequential"):
            g = per_example(t2j_ad.jaxify(torch_loss, vmap_method=method))
            gathers = g.lower(rep, *data).compile().as_text().count("all-gather")
            jax.block_until_ready(g(rep, *data))  # compile, infer shapes
            calls.clear()
            jax.block_until_ready(g(rep, *data))
            work[method] = len(calls)
        rows = work["sequential"]  # one call a row
        counts.append(f"| {name} | {work['expand_dims']} | {rows} | {rows // 4} | {gathers} |")

    sections = [("PyTorch work (counted by the loss)", "\n".join(counts))]
    f = t2j_ad.jaxify(torch_loss, vmap_method="expand_dims")
    expected = per_example(jax_loss)(params, x, y)
    for data in (sharded, replicated):
        got = per_example(f)(rep, *data)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for n in args.threads:
        set_threads(n)
        g, j = per_example(f), per_example(jax_loss)
        timings = time_calls(
            {
                "sharded": lambda: jax.block_until_ready(g(rep, *sharded)),
                "replicated": lambda: jax.block_until_ready(g(rep, *replicated)),
                "pure JAX sharded": lambda: jax.block_until_ready(j(rep, *sharded)),
            },
            repeats=args.repeats,
        )
        sections.append((f"Wall time per step, {n} PyTorch thread(s) per call", markdown_table(timings, "sharded")))
    print_report(
        f"Sharded per-example gradients, MLP {D_IN}-{HIDDEN}-1, batch {BATCH}, 4 simulated CPU devices",
        "python benchmarks/bench_sharded.py --threads 1",
        sections,
    )


if __name__ == "__main__":
    main()
