"""What watching a derivative call for draws costs a small call.

A derivative call of a function whose trial runs saw it draw nothing reads
PyTorch's generator state before and after it runs, so that a draw only some
input values reach is refused rather than differentiated through a second
mask (NOTE [draws the trial runs did not see] in t2j_ad/random_state.py).
This times ``jax.jit(jax.grad(lambda v: f(v).sum()))`` of ``f = jaxify(lambda
t: torch.sin(t) * 2)`` on 8 floats, the smallest derivative call, with the
watch on (as shipped) and off (the runner built without it), against the
same gradient in ``jax.numpy`` and eager ``torch.func.grad``, round-robin in
one process. Plain calls never take the watch.

    python benchmarks/bench_draw_watch.py [--threads 1 2]
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
import torch.func  # noqa: E402

import t2j_ad  # noqa: E402
from t2j_ad import runtime  # noqa: E402

SIZE = 8


def jitted_grad(watched: bool):
    """``jax.jit(jax.grad)`` of the jaxified ``sin(t) * 2``, its derivative's
    runner built with the draw watch or without it, compiled and run once."""
    f = t2j_ad.jaxify(lambda t: torch.sin(t) * 2)
    grad = jax.jit(jax.grad(lambda v: f(v).sum()))
    x = jnp.arange(SIZE, dtype=jnp.float32)
    shipped = runtime.unseen_draws_watch
    if not watched:
        runtime.unseen_draws_watch = lambda fun: None
    try:
        jax.block_until_ready(grad(x))  # the runners are built here
    finally:
        runtime.unseen_draws_watch = shipped
    return lambda: jax.block_until_ready(grad(x))


def contenders() -> dict:
    x = jnp.arange(SIZE, dtype=jnp.float32)
    tx = torch.arange(SIZE, dtype=torch.float32)
    jnp_grad = jax.jit(jax.grad(lambda v: (jnp.sin(v) * 2).sum()))
    torch_grad = torch.func.grad(lambda t: (torch.sin(t) * 2).sum())
    watched, unwatched = jitted_grad(True), jitted_grad(False)
    expected = np.asarray(jnp_grad(x))
    for name, fn in [("watched", watched), ("unwatched", unwatched)]:
        np.testing.assert_allclose(np.asarray(fn()), expected, rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(torch_grad(tx).numpy(), expected, rtol=1e-6)
    return {
        "jax.numpy": lambda: jax.block_until_ready(jnp_grad(x)),
        "torch.func": torch_done(lambda: torch_grad(tx)),
        "t2j_ad, draws watched": watched,
        "t2j_ad, watch off": unwatched,
    }


def main() -> None:
    args = thread_args(__doc__)
    sections = []
    for n in args.threads:
        set_threads(n)
        timings = time_calls(contenders(), repeats=args.repeats)
        t = {timing.name: timing.median for timing in timings}
        sections.append(
            (
                f"PyTorch threads: {n}",
                f"`jax.jit(jax.grad)` of `sin(x) * 2` on {SIZE} floats:\n\n"
                + markdown_table(timings, "t2j_ad, watch off")
                + f"\n\nwatched / watch off = {t['t2j_ad, draws watched'] / t['t2j_ad, watch off']:.2f}x "
                f"(+{(t['t2j_ad, draws watched'] - t['t2j_ad, watch off']) * 1e6:.1f} us a call)",
            )
        )
    command = "python benchmarks/bench_draw_watch.py --threads " + " ".join(map(str, args.threads))
    print_report("Watching a derivative call for draws", command, sections)


if __name__ == "__main__":
    main()
