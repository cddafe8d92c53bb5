"""Memory stays flat while fresh jaxify'd functions come and go.

Each step makes a fresh ``t2j_ad.jaxify`` wrapper (a new PyTorch function, so
a new TorchFn, registry key and XLA executable), calls it under ``jax.jit``
``--calls-per-wrapper`` times, and drops it. Resident memory (RSS) and the
size of the FFI registry are printed along the way; both must level off (the
registry entries go with the executables, see NOTE [registry lifetime] in
t2j_ad/backends/registry.py; what remains is bounded by JAX's own LRU caches).

With ``--compile graph`` each wrapper is ``compile="graph"`` and each step
takes ``jax.value_and_grad``, so every wrapper traces two aten graphs (the
call and its vjp); the live ``torch.fx.GraphModule`` count is printed too, and
must level off as well (graphs die with their function: NOTE [graph mode]).

Targets: flat memory over 100,000 calls creating fresh wrappers (issue 5);
flat memory over 10,000 fresh graph-mode wrappers (issue 14). Every fresh
wrapper costs one XLA compilation (tens of ms), so the default of one call
per wrapper takes about an hour on a small machine.

    python benchmarks/bench_registry_memory.py [--calls 100000] [--calls-per-wrapper 1] [--compile graph]
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
import torch  # noqa: E402

import t2j_ad  # noqa: E402
from t2j_ad.backends import registry  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--calls-per-wrapper", type=int, default=1)
    parser.add_argument("--warmup-wrappers", type=int, default=3000,
                        help="wrappers made before the start RSS is taken (fills JAX's LRU caches)")
    parser.add_argument("--reports", type=int, default=10)
    parser.add_argument("--compile", choices=("eager", "graph"), default="eager",
                        help="graph: each wrapper is compile='graph' and each step also takes its gradient")
    args = parser.parse_args()

    x = jnp.ones(16, jnp.float32)

    def step(i: int) -> None:
        if args.compile == "graph":
            loss = t2j_ad.jaxify(lambda t, i=i: (torch.sin(t) * i + 1).sum(), compile="graph")
            f = jax.jit(jax.value_and_grad(loss))
        else:
            f = jax.jit(t2j_ad.jaxify(lambda t, i=i: t * i + 1))
        for _ in range(args.calls_per_wrapper):
            jax.block_until_ready(f(x))

    def live_graphs() -> int:
        return sum(isinstance(o, torch.fx.GraphModule) for o in gc.get_objects())

    print("### Registry memory: fresh jaxify'd functions\n")
    print(f"`python benchmarks/bench_registry_memory.py {' '.join(sys.argv[1:])}`\n")
    print(environment() + "\n")
    t0 = time.perf_counter()
    for i in range(args.warmup_wrappers):
        step(-i - 1)
    gc.collect()
    start = rss_mb()
    wrappers = args.calls // args.calls_per_wrapper
    print(f"after {args.warmup_wrappers} warm-up wrappers: RSS {start:.1f} MB, registry {registry.size()} entries, "
          f"{live_graphs()} live graphs\n")
    print("| calls | wrappers | RSS (MB) | registry entries | live graphs | elapsed |")
    print("|---:|---:|---:|---:|---:|---:|")
    every = max(1, wrappers // args.reports)
    for w in range(1, wrappers + 1):
        step(w)
        if w % every == 0 or w == wrappers:
            gc.collect()
            print(f"| {w * args.calls_per_wrapper} | {w} | {rss_mb():.1f} | {registry.size()} | {live_graphs()} | "
                  f"{time.perf_counter() - t0:.0f} s |", flush=True)
    gc.collect()
    end = rss_mb()
    jax.clear_caches()
    gc.collect()
    print(f"\nstart RSS {start:.1f} MB, end RSS {end:.1f} MB ({end - start:+.1f} MB over "
          f"{wrappers * args.calls_per_wrapper} calls / {wrappers} fresh wrappers); "
          f"registry {registry.size()} entries and {live_graphs()} live graphs after jax.clear_caches()")


if __name__ == "__main__":
    main()
