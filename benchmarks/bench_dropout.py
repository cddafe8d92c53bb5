"""Derivatives of a PyTorch module with dropout: a training step, and a Hessian.

Dropout draws a mask in the value call; every derivative call replays that
mask (NOTE [derivatives replay the value's draws]). Two measurements, each
timing its contenders round-robin in one run:

1. A training step: an MLP 64-256-256-10 with ``Dropout(0.1)`` after each
   hidden layer, batch 256, cross-entropy.

   - ``PyTorch``: ``loss(module(x)).backward()``, the step a PyTorch user runs;
   - ``t2j_ad`` / ``t2j_ad graph``: ``jax.jit(jax.value_and_grad(loss))`` of
     ``jaxify_module``'s apply, eager and ``compile="graph"``;
   - ``t2j_ad graph, no dropout``: the same network with ``Identity`` in
     place of dropout, in graph mode: what drawing and replaying the masks
     cost.

   Each contender's loss and gradients from seed 0 are checked against
   PyTorch's step from seed 0 first.

2. ``jax.jit(jax.hessian(loss))`` with respect to one input of 16 features,
   through the same kind of network (16-32-1, ``Dropout(0.5)``):

   - ``t2j_ad`` / ``t2j_ad graph``: the replay runs once for all directions,
     under ``torch.vmap(randomness="same")``;
   - ``t2j_ad loop``: ``vmap_method="sequential"``, one replay per direction
     (what every mode did before);
   - ``torch.func``: ``torch.func.hessian`` of the same network with the
     value's mask passed in (``torch.func.hessian`` refuses random ops).

   Each contender's Hessian from seed 0 is checked against ``torch.func``'s
   with the mask seed 0 draws.

    python benchmarks/bench_dropout.py [--threads 1 2]
"""

from __future__ import annotations

import copy
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402
    cross_entropy_of,
    markdown_table,
    print_report,
    set_threads,
    thread_args,
    time_calls,
    torch_device,
    torch_done,
    torch_training_step,
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.func  # noqa: E402

import t2j_ad  # noqa: E402

BATCH, D_IN, HIDDEN, CLASSES, P = 256, 64, 256, 10, 0.1
H_IN, H_HIDDEN, H_P = 16, 32, 0.5


def make_mlp(dropout: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    drop = (lambda: torch.nn.Dropout(P)) if dropout else torch.nn.Identity
    return torch.nn.Sequential(
        torch.nn.Linear(D_IN, HIDDEN),
        torch.nn.ReLU(),
        drop(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        drop(),
        torch.nn.Linear(HIDDEN, CLASSES),
    ).to(torch_device())




def step_contenders() -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    onehot = np.eye(CLASSES, dtype=np.float32)[rng.integers(0, CLASSES, BATCH)]
    tx, tonehot = (torch.from_numpy(a).to(torch_device()) for a in (x, onehot))
    jx, jonehot = jnp.asarray(x), jnp.asarray(onehot)
    reference = make_mlp().train()
    steps = {}
    for name, module, mode in [
        ("t2j_ad", make_mlp().train(), "eager"),
        ("t2j_ad graph", make_mlp().train(), "graph"),
        ("t2j_ad graph, no dropout", make_mlp(dropout=False).train(), "graph"),
    ]:
        apply, params = t2j_ad.jaxify_module(module, compile=mode)
        steps[name] = (jax.jit(jax.value_and_grad(cross_entropy_of(apply))), params)

    # One step of each from seed 0: the loss and gradients of PyTorch's step
    # from seed 0 (the same masks); without dropout, of no masks.
    for name, (step, params) in steps.items():
        twin = copy.deepcopy(reference) if "no dropout" not in name else make_mlp(dropout=False)
        torch.manual_seed(0)
        value, grads = torch_training_step(twin, tx, tonehot)
        torch.manual_seed(0)
        got_value, got_grads = step(params, jx, jonehot)
        np.testing.assert_allclose(float(got_value), float(value.detach()), rtol=1e-5, err_msg=name)
        for key, g in grads.items():
            np.testing.assert_allclose(np.asarray(got_grads[key]), g.cpu().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)

    def ours(name: str):  # noqa: ANN202
        step, params = steps[name]
        return lambda: jax.block_until_ready(step(params, jx, jonehot))

    pytorch = torch_done(lambda: torch_training_step(reference, tx, tonehot))
    return {"PyTorch": pytorch, **{name: ours(name) for name in steps}}


def hessian_contenders() -> dict:
    torch.manual_seed(1)
    net = torch.nn.Sequential(
        torch.nn.Linear(H_IN, H_HIDDEN), torch.nn.Tanh(), torch.nn.Dropout(H_P), torch.nn.Linear(H_HIDDEN, 1)
    )
    net = net.to(torch_device()).train()
    w1, b1, w2, b2 = (p.detach() for p in net.parameters())  # torch.func's reference builds no autograd graph
    x = np.linspace(-1.0, 1.0, H_IN, dtype=np.float32)
    torch.manual_seed(0)
    mask = torch.nn.functional.dropout(torch.ones(H_HIDDEN, device=torch_device()), H_P)  # seed 0's, scaled

    def masked(x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(torch.nn.functional.linear(x, w1, b1)) * mask
        return torch.sin(torch.nn.functional.linear(hidden, w2, b2)).sum()

    tx = torch.from_numpy(x).to(torch_device())
    expected = torch.func.hessian(masked)(tx).cpu().numpy()
    hessians = {}
    for name, mode, method in [
        ("t2j_ad", "eager", "auto"),
        ("t2j_ad graph", "graph", "auto"),
        ("t2j_ad loop", "eager", "sequential"),
    ]:
        apply, params = t2j_ad.jaxify_module(net, compile=mode, vmap_method=method)
        hessian = jax.jit(jax.hessian(lambda x, apply=apply, params=params: jnp.sin(apply(params, x)).sum()))
        jx = jnp.asarray(x)
        torch.manual_seed(0)
        np.testing.assert_allclose(np.asarray(hessian(jx)), expected, rtol=1e-4, atol=1e-5, err_msg=name)
        hessians[name] = (lambda hessian=hessian, jx=jx: jax.block_until_ready(hessian(jx)))
    return {"torch.func": torch_done(lambda: torch.func.hessian(masked)(tx)), **hessians}


def main() -> None:
    args = thread_args(__doc__)
    sections = []
    for n in args.threads:
        set_threads(n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", t2j_ad.FallbackWarning)
            steps = time_calls(step_contenders(), repeats=args.repeats)
            hessians = time_calls(hessian_contenders(), repeats=args.repeats, repeats_of={"t2j_ad loop": 5})
        s = {t.name: t.median for t in steps}
        h = {t.name: t.median for t in hessians}
        step_summary = (
            f"t2j_ad / PyTorch = {s['t2j_ad'] / s['PyTorch']:.2f}x; "
            f"graph / PyTorch = {s['t2j_ad graph'] / s['PyTorch']:.2f}x; "
            f"graph / graph without dropout = {s['t2j_ad graph'] / s['t2j_ad graph, no dropout']:.2f}x"
        )
        hessian_summary = (
            f"t2j_ad / torch.func = {h['t2j_ad'] / h['torch.func']:.2f}x; "
            f"graph / torch.func = {h['t2j_ad graph'] / h['torch.func']:.2f}x; "
            f"loop / t2j_ad = {h['t2j_ad loop'] / h['t2j_ad']:.1f}x"
        )
        sections.append(
            (
                f"PyTorch threads: {n}",
                f"Training step, MLP {D_IN}-{HIDDEN}-{HIDDEN}-{CLASSES}, Dropout({P}), batch {BATCH}:\n\n"
                + markdown_table(steps, "PyTorch")
                + "\n\n"
                + step_summary
                + f"\n\n`jit(hessian)` in one input, MLP {H_IN}-{H_HIDDEN}-1, Dropout({H_P}):\n\n"
                + markdown_table(hessians, "torch.func")
                + "\n\n"
                + hessian_summary,
            )
        )
    command = "python benchmarks/bench_dropout.py --threads " + " ".join(map(str, args.threads))
    print_report("Derivatives of a module with dropout", command, sections)


if __name__ == "__main__":
    main()
