"""A module changed by the user between calls, or by PyTorch's own hooks.

Three measurements, each timing its contenders round-robin in one run:

1. Per-example gradients of a pruned MLP 32-64-10 (``torch.nn.utils.prune.
   l1_unstructured`` on both layers, whose forward pre-hooks bind ``weight =
   weight_orig * weight_mask`` before every call), batch 64, cross-entropy:
   ``jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))`` of
   ``jaxify_module``'s apply, eager and ``compile="graph"``, against
   ``torch.func.vmap(torch.func.grad(...))`` of ``functional_call`` on the
   same module, and against ``vmap_method="sequential"``, the loop over the
   examples these calls ran before NOTE [attributes PyTorch's hooks
   recompute].
2. A notebook loop that registers a forward hook, calls, and removes the
   hook again (``h = net[0].register_forward_hook(save); f(x); h.remove()``),
   ``jax.value_and_grad`` of a jaxify'd loss without ``jax.jit``: each
   handle is new, and the calls now keep their signature (NOTE [a hook
   registered again]); ``the same, no hook`` is the loop without one. The
   ``jit graph`` pair is that loop around a compiled ``jax.jit`` of
   ``value_and_grad`` in ``compile="graph"``: the same hook back keeps its
   graph (NOTE [the hooks a graph ran] in module_modes.py), where it traced
   again on every step before.
3. A head swapped every step (``net.head = heads[step % 2]``), then
   ``jax.value_and_grad`` without ``jax.jit``, eager and graph: a head that
   comes back takes back its signature and graphs (NOTE [a structure seen
   before]); ``no swap`` is the same step on one head.
4. A dropout rate annealed every step (``net.drop.p = 0.5 * 0.99 **
   step``) in an MLP 32-64-10, batch 64, ``jax.jit(jax.value_and_grad(
   loss))`` of ``jaxify_module``'s apply, eager and graph, against
   ``torch.func.grad_and_value`` of ``functional_call`` on the same
   schedule; ``fixed rate`` is the same step at 0.5. A graph holds its
   rate, so each new rate traced again, until NOTE [a setting changed every
   step] (graph_mode.py) ran new rates eagerly after three in a row (and
   traces a rate again once it stays for as long as its trace takes).

Each contender's result is checked against ``torch.func`` or PyTorch on the
same module first.

    python benchmarks/bench_module_changes.py [--threads 1 2]
"""

from __future__ import annotations

import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402
    markdown_table,
    print_report,
    set_threads,
    thread_args,
    time_calls,
    torch_device,
    torch_done,
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.func  # noqa: E402
import torch.nn.utils.prune as prune  # noqa: E402

import t2j_ad  # noqa: E402

BATCH, D_IN, HIDDEN, CLASSES = 64, 32, 64, 10


def pruned_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES))
    prune.l1_unstructured(net[0], "weight", amount=0.3)
    prune.l1_unstructured(net[2], "weight", amount=0.3)
    return net.to(torch_device())


def pruned_contenders() -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, BATCH)
    tx, ty = torch.from_numpy(x).to(torch_device()), torch.from_numpy(y).to(torch_device())
    jx, jy = jnp.asarray(x), jnp.asarray(y)
    reference = pruned_mlp()  # a pruned module does not deepcopy (its weight is no leaf)
    torch_params = {k: p.detach() for k, p in reference.named_parameters()}

    def torch_loss(params, x, y):
        logits = torch.func.functional_call(reference, params, (x[None],))
        return torch.nn.functional.cross_entropy(logits, y[None])

    torch_grads = torch.func.vmap(torch.func.grad(torch_loss), in_dims=(None, 0, 0))
    expected = {k: g.cpu().numpy() for k, g in torch_grads(torch_params, tx, ty).items()}

    contenders = {"torch.func": torch_done(lambda: torch_grads(torch_params, tx, ty))}
    for name, mode, method in [
        ("t2j_ad", "eager", "auto"),
        ("t2j_ad graph", "graph", "auto"),
        ("t2j_ad loop (as before)", "eager", "sequential"),
    ]:
        apply, params = t2j_ad.jaxify_module(pruned_mlp(), compile=mode, vmap_method=method)

        def loss(params, x, y, apply=apply):
            logits = apply(params, x[None])
            return -jax.nn.log_softmax(logits)[0, y]

        grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))
        got = grads(params, jx, jy)
        for key, g in expected.items():
            np.testing.assert_allclose(np.asarray(got[key]), g, rtol=1e-4, atol=1e-6, err_msg=name)
        contenders[name] = lambda grads=grads, params=params: jax.block_until_ready(grads(params, jx, jy))
    return contenders


def small_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES))


def check_value_and_grad(value_and_grad, loss, x: np.ndarray, name: str) -> None:
    value, grad = value_and_grad(jnp.asarray(x))
    expected_grad, expected_value = torch.func.grad_and_value(loss)(torch.from_numpy(x).to(torch_device()))
    np.testing.assert_allclose(float(value), expected_value.item(), rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(np.asarray(grad), expected_grad.detach().cpu().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def hook_contenders() -> dict:
    x = np.random.default_rng(1).standard_normal((16, D_IN)).astype(np.float32)
    jx = jnp.asarray(x)
    contenders = {}
    for name, mode, jitted, hooked in [
        ("hook around each call", "eager", False, True),
        ("the same, no hook", "eager", False, False),
        ("hook around each call, jit graph", "graph", True, True),
        ("the same, no hook, jit graph", "graph", True, False),
    ]:
        net = small_mlp().to(torch_device())
        saved = []

        def save(module, args, output, saved=saved):
            saved.append(output.detach().clone())

        def loss(x, net=net):
            return (net(x) ** 2).mean()

        value_and_grad = jax.value_and_grad(t2j_ad.jaxify(loss, compile=mode))
        if jitted:
            value_and_grad = jax.jit(value_and_grad)

        def step(net=net, value_and_grad=value_and_grad, hooked=hooked, saved=saved, save=save):
            handle = net[0].register_forward_hook(save) if hooked else None
            try:
                out = jax.block_until_ready(value_and_grad(jx))
            finally:
                if handle is not None:
                    handle.remove()
            saved.clear()
            return out

        step()
        check_value_and_grad(value_and_grad, loss, x, name)
        contenders[name] = step
    return contenders


class Headed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(D_IN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def swap_contenders() -> dict:
    x = np.random.default_rng(2).standard_normal((16, D_IN)).astype(np.float32)
    jx = jnp.asarray(x)
    contenders = {}
    for name, mode, swapping in [
        ("swap every step", "eager", True),
        ("swap every step, graph", "graph", True),
        ("no swap", "eager", False),
        ("no swap, graph", "graph", False),
    ]:
        torch.manual_seed(0)
        net = Headed().to(torch_device())
        heads = [net.head, torch.nn.Linear(HIDDEN, CLASSES).to(torch_device())]

        def loss(x, net=net):
            return (net(x) ** 2).mean()

        value_and_grad = jax.value_and_grad(t2j_ad.jaxify(loss, compile=mode))
        counter = [0]

        def step(net=net, heads=heads, value_and_grad=value_and_grad, counter=counter, swapping=swapping):
            if swapping:
                counter[0] += 1
                net.head = heads[counter[0] % 2]
            return jax.block_until_ready(value_and_grad(jx))

        for _ in range(2):  # both heads seen, each checked
            step()
            check_value_and_grad(value_and_grad, loss, x, name)
        contenders[name] = step
    return contenders


class Dropped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(D_IN, HIDDEN)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.tanh(self.body(x))))


def annealed_rate(step: int) -> float:
    return 0.5 * 0.99**step


def dropped_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return Dropped().to(torch_device()).train()


def check_seeded(value_and_grad, params, jx, net: torch.nn.Module, tx: torch.Tensor, name: str) -> None:
    """``value_and_grad(params, jx)`` from seed 0 equals
    ``torch.func.grad_and_value`` of the same loss on ``net`` from seed 0
    (the same mask)."""
    torch_params = {k: p.detach() for k, p in net.named_parameters()}

    def torch_loss(p, x):
        return (torch.func.functional_call(net, p, (x,)) ** 2).mean()

    torch.manual_seed(0)
    value, grads = jax.block_until_ready(value_and_grad(params, jx))
    torch.manual_seed(0)
    expected_grads, expected_value = torch.func.grad_and_value(torch_loss)(torch_params, tx)
    np.testing.assert_allclose(float(value), expected_value.item(), rtol=1e-5, err_msg=name)
    for key, g in expected_grads.items():
        np.testing.assert_allclose(np.asarray(grads[key]), g.cpu().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def rate_contenders() -> dict:
    x = np.random.default_rng(3).standard_normal((BATCH, D_IN)).astype(np.float32)
    jx, tx = jnp.asarray(x), torch.from_numpy(x).to(torch_device())
    contenders = {}
    for name, annealing in [("torch.func, annealed", True), ("torch.func, fixed rate", False)]:
        net = dropped_net()
        params = {k: p.detach() for k, p in net.named_parameters()}

        def torch_loss(p, x, net=net):
            return (torch.func.functional_call(net, p, (x,)) ** 2).mean()

        step_of = torch.func.grad_and_value(torch_loss)
        counter = [0]

        def step(net=net, params=params, step_of=step_of, counter=counter, annealing=annealing):
            if annealing:
                counter[0] += 1
                net.drop.p = annealed_rate(counter[0])
            return torch_done(lambda: step_of(params, tx))()

        contenders[name] = step
    for name, mode, annealing in [
        ("annealed, eager", "eager", True),
        ("annealed, graph", "graph", True),
        ("fixed rate, eager", "eager", False),
        ("fixed rate, graph", "graph", False),
    ]:
        net = dropped_net()
        apply, params = t2j_ad.jaxify_module(net, compile=mode)

        def loss(params, x, apply=apply):
            return (apply(params, x) ** 2).mean()

        value_and_grad = jax.jit(jax.value_and_grad(loss))
        counter = [0]

        def step(net=net, params=params, value_and_grad=value_and_grad, counter=counter, annealing=annealing):
            if annealing:
                counter[0] += 1
                net.drop.p = annealed_rate(counter[0])
            return jax.block_until_ready(value_and_grad(params, jx))

        for _ in range(6):  # past the rates a graph traces: each step checked
            step()
            check_seeded(value_and_grad, params, jx, net, tx, name)
        contenders[name] = step
    return contenders


def main() -> None:
    args = thread_args(__doc__)
    sections = []
    for n in args.threads:
        set_threads(n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", t2j_ad.FallbackWarning)
            pruned = time_calls(pruned_contenders(), repeats=args.repeats, repeats_of={"t2j_ad loop (as before)": 5})
            hooks = time_calls(hook_contenders(), repeats=args.repeats)
            swaps = time_calls(swap_contenders(), repeats=args.repeats)
            rates = time_calls(rate_contenders(), repeats=args.repeats)
        p = {t.name: t.median for t in pruned}
        h = {t.name: t.median for t in hooks}
        s = {t.name: t.median for t in swaps}
        r = {t.name: t.median for t in rates}
        sections.append(
            (
                f"PyTorch threads: {n}",
                f"Per-example gradients, pruned MLP {D_IN}-{HIDDEN}-{CLASSES}, batch {BATCH}:\n\n"
                + markdown_table(pruned, "torch.func")
                + f"\n\nt2j_ad / torch.func = {p['t2j_ad'] / p['torch.func']:.2f}x; "
                f"graph / torch.func = {p['t2j_ad graph'] / p['torch.func']:.2f}x; "
                f"loop / t2j_ad = {p['t2j_ad loop (as before)'] / p['t2j_ad']:.0f}x"
                + "\n\n`value_and_grad` with a hook registered and removed around each call:\n\n"
                + markdown_table(hooks, "the same, no hook")
                + f"\n\nwith the hook / without = {h['hook around each call'] / h['the same, no hook']:.2f}x; "
                f"jit graph {h['hook around each call, jit graph'] / h['the same, no hook, jit graph']:.2f}x"
                + "\n\n`value_and_grad` with the head swapped every step:\n\n"
                + markdown_table(swaps, "no swap")
                + f"\n\nswapping / not: eager {s['swap every step'] / s['no swap']:.2f}x, "
                f"graph {s['swap every step, graph'] / s['no swap, graph']:.2f}x"
                + "\n\n`jax.jit(jax.value_and_grad)` with a dropout rate annealed every step:\n\n"
                + markdown_table(rates, "torch.func, annealed")
                + f"\n\nannealed: graph / eager = {r['annealed, graph'] / r['annealed, eager']:.2f}x, "
                f"graph / torch.func = {r['annealed, graph'] / r['torch.func, annealed']:.2f}x; "
                f"annealed / fixed rate: graph {r['annealed, graph'] / r['fixed rate, graph']:.2f}x, "
                f"eager {r['annealed, eager'] / r['fixed rate, eager']:.2f}x",
            )
        )
    command = "python benchmarks/bench_module_changes.py --threads " + " ".join(map(str, args.threads))
    print_report("A module changed between calls", command, sections)


if __name__ == "__main__":
    main()
