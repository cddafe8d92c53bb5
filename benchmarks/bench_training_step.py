"""A training step of a module with batch norm in training mode.

A small convolutional network (two 3x3 convolutions, each followed by
``BatchNorm2d`` and ReLU, global average pooling, a linear head), batch 32 of
3x16x16 images, cross-entropy loss. Batch norm updates its running statistics
in place, so each step is a value call that makes the updates and a
derivative call that runs its forward on tensors of its own holding the
state the value call started from (NOTE [derivatives do not write again]).
Contenders, timed in one run:

- ``PyTorch``: ``loss(module(x)).backward()``, the step a PyTorch user runs;
- ``t2j_ad``: ``jax.jit(jax.value_and_grad(loss))`` of ``jaxify_module``'s apply;
- ``t2j_ad graph``: the same with ``compile="graph"``;
- ``t2j_ad no statistics``: the first with ``BatchNorm2d(track_running_stats=
  False)``: the same math in training mode (batch statistics), no state to
  update, plain value and vjp calls: what the replay costs.

Every contender's loss and gradients are checked against PyTorch's first,
and the state after one step of each against a twin's.

    python benchmarks/bench_training_step.py [--threads 1 2]
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

import t2j_ad  # noqa: E402

BATCH, CHANNELS, SIDE, CLASSES = 32, 16, 16, 10


def make_module(track_running_stats: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, CHANNELS, 3, padding=1),
        torch.nn.BatchNorm2d(CHANNELS, track_running_stats=track_running_stats),
        torch.nn.ReLU(),
        torch.nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1),
        torch.nn.BatchNorm2d(CHANNELS, track_running_stats=track_running_stats),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(CHANNELS, CLASSES),
    ).to(torch_device())


def make_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, 3, SIDE, SIDE)).astype(np.float32)
    labels = rng.integers(0, CLASSES, BATCH)
    return x, np.eye(CLASSES, dtype=np.float32)[labels]




def contenders() -> dict:
    x, onehot = make_data()
    tx, tonehot = (torch.from_numpy(a).to(torch_device()) for a in (x, onehot))
    jx, jonehot = jnp.asarray(x), jnp.asarray(onehot)
    reference = make_module().train()
    modules = {"t2j_ad": (make_module().train(), "eager"), "t2j_ad graph": (make_module().train(), "graph")}
    steps = {}
    for name, (module, mode) in modules.items():
        apply, params = t2j_ad.jaxify_module(module, compile=mode)
        steps[name] = (module, jax.jit(jax.value_and_grad(cross_entropy_of(apply))), params)
    stateless = make_module(track_running_stats=False).train()
    apply, stateless_params = t2j_ad.jaxify_module(stateless)
    stateless_step = jax.jit(jax.value_and_grad(cross_entropy_of(apply)))

    # One checked step of each: the same loss and gradients as PyTorch's, and
    # the running statistics updated once, as PyTorch's step updates them.
    twin = copy.deepcopy(reference)
    value, grads = torch_training_step(twin, tx, tonehot)
    for name, (module, step, params) in steps.items():
        got_value, got_grads = step(params, jx, jonehot)
        np.testing.assert_allclose(float(got_value), float(value.detach()), rtol=1e-5, err_msg=name)
        for key, g in grads.items():
            np.testing.assert_allclose(np.asarray(got_grads[key]), g.cpu().numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
        for (key, b), (_, want) in zip(module.named_buffers(), twin.named_buffers()):
            np.testing.assert_allclose(
                b.cpu().numpy(), want.cpu().numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{name} {key}"
            )
    # The same math without running statistics: the same loss and gradients.
    got_value, _ = stateless_step(stateless_params, jx, jonehot)
    np.testing.assert_allclose(float(got_value), float(value.detach()), rtol=1e-5, err_msg="no statistics")

    def ours(name: str):  # noqa: ANN202
        _, step, params = steps[name]
        return lambda: jax.block_until_ready(step(params, jx, jonehot))

    return {
        "PyTorch": torch_done(lambda: torch_training_step(reference, tx, tonehot)),
        "t2j_ad": ours("t2j_ad"),
        "t2j_ad graph": ours("t2j_ad graph"),
        "t2j_ad no statistics": lambda: jax.block_until_ready(stateless_step(stateless_params, jx, jonehot)),
    }


def main() -> None:
    args = thread_args(__doc__)
    sections = []
    for n in args.threads:
        set_threads(n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", t2j_ad.FallbackWarning)  # torch.autograd.grad, announced
            timings = time_calls(contenders(), repeats=args.repeats)
        by_name = {t.name: t.median for t in timings}
        summary = (
            f"t2j_ad / PyTorch = {by_name['t2j_ad'] / by_name['PyTorch']:.2f}x; "
            f"graph / PyTorch = {by_name['t2j_ad graph'] / by_name['PyTorch']:.2f}x; "
            f"t2j_ad / t2j_ad no statistics = {by_name['t2j_ad'] / by_name['t2j_ad no statistics']:.2f}x"
        )
        sections.append((f"PyTorch threads: {n}", markdown_table(timings, "PyTorch") + "\n\n" + summary))
    command = "python benchmarks/bench_training_step.py --threads " + " ".join(map(str, args.threads))
    print_report(
        f"Training step with batch norm, batch {BATCH} of 3x{SIDE}x{SIDE}, {CHANNELS} channels", command, sections
    )


if __name__ == "__main__":
    main()
