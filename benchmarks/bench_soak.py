"""Soak: many calls of one jitted function and many fresh wrappers, with RSS.

Two phases, each after a warm-up, with resident memory (RSS) and the FFI
registry's size taken before and after:

1. ``--calls`` calls of one ``jax.jit(jaxify(f))`` and as many of its
   gradient (``jax.jit(jax.grad(...))``), alternating; every result is
   checked against the same math in pure JAX at the end of each report
   interval.
2. ``--wrappers`` fresh ``jaxify`` wrappers, each jitted, called once and
   dropped (each is a new TorchFn, registry key and XLA executable).

Both must leave memory flat: a leak of a few hundred bytes a call would show
as tens of MB over 100,000 calls. The reliability table in BENCHMARKS.md
records the numbers.

    python benchmarks/bench_soak.py [--calls 100000] [--wrappers 10000]
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from common import environment, rss_mb  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import t2j_ad  # noqa: E402
from t2j_ad.backends import registry  # noqa: E402


def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w) ** 2).sum()


def loss_jax(w: jax.Array, x: jax.Array) -> jax.Array:
    return (jnp.tanh(x @ w) ** 2).sum()


def _row(label: str, n: int, start: float, t0: float) -> str:
    gc.collect()
    rss = rss_mb()
    return f"| {label} | {n} | {rss:.1f} | {rss - start:+.1f} | {registry.size()} | {time.perf_counter() - t0:.0f} s |"


def soak_calls(calls: int, reports: int) -> tuple[float, float]:
    """Phase 1; returns (start, end) RSS in MiB."""
    f = jax.jit(t2j_ad.jaxify(loss))
    g = jax.jit(jax.grad(t2j_ad.jaxify(loss)))
    w = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    x = jnp.linspace(-2.0, 2.0, 32, dtype=jnp.float32).reshape(4, 8)
    want_f, want_g = loss_jax(w, x), jax.grad(loss_jax)(w, x)
    for _ in range(1000):  # warm-up: compilation, allocator, caches
        jax.block_until_ready((f(w, x), g(w, x)))
    gc.collect()
    start, t0 = rss_mb(), time.perf_counter()
    per_report = max(1, calls // (2 * reports))  # (f, grad f) pairs between reports
    done = 0
    while done < calls:
        n = min(per_report, (calls - done + 1) // 2)
        for _ in range(n):
            out_f, out_g = f(w, x), g(w, x)
        jax.block_until_ready((out_f, out_g))
        np.testing.assert_allclose(out_f, want_f, rtol=1e-5)
        np.testing.assert_allclose(out_g, want_g, rtol=1e-5, atol=1e-6)
        done += 2 * n
        print(_row("calls", done, start, t0), flush=True)
    return start, rss_mb()


def soak_wrappers(wrappers: int, warmup: int, reports: int) -> tuple[float, float]:
    """Phase 2; returns (start, end) RSS in MiB."""
    x = jnp.ones(16, jnp.float32)

    def step(i: int) -> None:
        out = jax.jit(t2j_ad.jaxify(lambda t, i=i: t * i + 1))(x)
        np.testing.assert_allclose(out, np.full(16, i + 1.0, np.float32))

    for i in range(warmup):  # fills JAX's bounded LRU caches first
        step(-i - 1)
    gc.collect()
    start, t0 = rss_mb(), time.perf_counter()
    every = max(1, wrappers // reports)
    for i in range(1, wrappers + 1):
        step(i)
        if i % every == 0 or i == wrappers:
            print(_row("fresh wrappers", i, start, t0), flush=True)
    return start, rss_mb()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--wrappers", type=int, default=10_000)
    parser.add_argument("--warmup-wrappers", type=int, default=3000)
    parser.add_argument("--reports", type=int, default=5)
    args = parser.parse_args()
    t2j_ad.set_torch_threads(1)

    print("### Soak: calls and fresh wrappers\n")
    print(f"`python benchmarks/bench_soak.py {' '.join(sys.argv[1:])}`\n")
    print(environment() + "\n")
    print("| phase | done | RSS (MB) | RSS growth since start (MB) | registry entries | elapsed |")
    print("|---|---:|---:|---:|---:|---:|")
    c0, c1 = soak_calls(args.calls, args.reports)
    w0, w1 = soak_wrappers(args.wrappers, args.warmup_wrappers, args.reports)
    jax.clear_caches()
    gc.collect()
    print(
        f"\n{args.calls} calls (half of them the gradient): RSS {c0:.1f} -> {c1:.1f} MB ({c1 - c0:+.1f} MB); "
        f"{args.wrappers} fresh wrappers: RSS {w0:.1f} -> {w1:.1f} MB ({w1 - w0:+.1f} MB); "
        f"registry {registry.size()} entries after jax.clear_caches()"
    )


if __name__ == "__main__":
    main()
