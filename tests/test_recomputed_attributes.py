"""An attribute a hook of PyTorch's binds anew on every call is no state:
NOTE [attributes PyTorch's hooks recompute] in real_writes.py.

``torch.nn.utils.prune`` (and the old ``weight_norm`` and ``spectral_norm``)
register a forward pre-hook that binds ``module.weight`` from
``weight_orig`` and a mask before every forward. Taken for state a
function keeps, it made per-example gradients a loop over the examples
(with a warning blaming running statistics) and refused every graph-mode
trace. Every test holds the values against ``torch.func`` on the same
module (``functional_call`` under ``vmap(grad)``), or a PyTorch step.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.utils.prune as prune
from conftest import TORCH_DEVICE, assert_tree_allclose, to_numpy, to_torch

import t2j_ad
from t2j_ad.rules.fallbacks import FallbackWarning


def _l1(net: torch.nn.Sequential) -> None:
    prune.l1_unstructured(net[0], "weight", amount=0.3)


def _random(net: torch.nn.Sequential) -> None:
    prune.random_unstructured(net[0], "weight", amount=0.3)


def _ln_structured(net: torch.nn.Sequential) -> None:
    prune.ln_structured(net[0], "weight", amount=0.5, n=2, dim=0)


def _global(net: torch.nn.Sequential) -> None:
    prune.global_unstructured([(net[0], "weight"), (net[2], "weight")], prune.L1Unstructured, amount=0.3)


def _twice(net: torch.nn.Sequential) -> None:  # a PruningContainer holds both
    prune.l1_unstructured(net[0], "weight", amount=0.3)
    prune.random_unstructured(net[0], "weight", amount=0.3)


def _old_weight_norm(net: torch.nn.Sequential) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for parametrizations.weight_norm
        torch.nn.utils.weight_norm(net[0])


def _old_spectral_norm(net: torch.nn.Sequential) -> None:
    torch.nn.utils.spectral_norm(net[0])
    net.eval()  # no power iteration: the hook only divides by the estimate


REPARAMETRIZED = {
    "l1_unstructured": _l1,
    "random_unstructured": _random,
    "ln_structured": _ln_structured,
    "global_unstructured": _global,
    "pruned_twice": _twice,
    "old_weight_norm": _old_weight_norm,
    "old_spectral_norm_eval": _old_spectral_norm,
}


def _net(reparametrize: Callable[[torch.nn.Sequential], None], dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)
    reparametrize(net)
    return net.to(TORCH_DEVICE)


def _data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    xs = torch.randn(6, 5, generator=generator, dtype=dtype)
    ys = torch.randn(6, 2, generator=generator, dtype=dtype)
    return xs.to(TORCH_DEVICE), ys.to(TORCH_DEVICE)


def _per_example_grads_by_torch_func(net: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> dict:
    """torch.func's per-example gradients of the squared error (on a twin
    of the module: torch.func leaves a functorch wrapper bound in it)."""
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((torch.func.functional_call(net, p, (x[None],)) - y[None]) ** 2).mean()

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    return {k: to_numpy(v) for k, v in grads.items()}


def _fallbacks(run: Callable[[], object]) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = jax.block_until_ready(run())
    return result, [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 1e-5


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("how", list(REPARAMETRIZED))
def test_per_example_gradients_of_a_pruned_module_run_under_torch_vmap(how, mode):
    # Looped over the examples before, announced as state it keeps
    # ("running statistics"), and in graph mode traced not at all.
    net = _net(REPARAMETRIZED[how], torch.float32)
    xs, ys = _data(torch.float32)
    expected = _per_example_grads_by_torch_func(_net(REPARAMETRIZED[how], torch.float32), xs, ys)
    apply, params = t2j_ad.jaxify_module(net, compile=mode)
    per_example = jax.jit(
        jax.vmap(jax.grad(lambda p, x, y: jnp.mean((apply(p, x[None]) - y[None]) ** 2)), in_axes=(None, 0, 0))
    )
    got, messages = _fallbacks(lambda: per_example(params, jnp.asarray(to_numpy(xs)), jnp.asarray(to_numpy(ys))))
    assert messages == []
    assert_tree_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert apply.compile_stats()["eager_fallbacks"] == 0


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("how", ["l1_unstructured", "old_weight_norm"])
def test_per_example_input_gradients_of_a_closed_over_pruned_module_in_float64(how, mode, x64):
    xs, ys = _data(torch.float64)

    def loss_of(net: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda x, y: ((net(x[None]) - y[None]) ** 2).mean()

    twin_loss = loss_of(_net(REPARAMETRIZED[how], torch.float64))
    expected = to_numpy(torch.func.vmap(torch.func.grad(twin_loss))(xs, ys).detach())
    loss = t2j_ad.jaxify(loss_of(_net(REPARAMETRIZED[how], torch.float64)), compile=mode)
    got, messages = _fallbacks(lambda: jax.jit(jax.vmap(jax.grad(loss)))(to_numpy(xs), to_numpy(ys)))
    assert messages == []
    assert_tree_allclose(got, expected, rtol=_tolerance(torch.float64), atol=_tolerance(torch.float64))


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_training_step_of_a_pruned_module_keeps_its_graph_and_matches_pytorch(mode):
    # graph mode refused the trace ("binds a new tensor to Linear.weight").
    net, twin = _net(_l1, torch.float32), _net(_l1, torch.float32)
    xs, ys = _data(torch.float32)
    apply, params = t2j_ad.jaxify_module(net, compile=mode)
    step = jax.jit(jax.value_and_grad(lambda p, x, y: jnp.mean((apply(p, x) - y) ** 2)))
    got, messages = _fallbacks(lambda: step(params, jnp.asarray(to_numpy(xs)), jnp.asarray(to_numpy(ys))))
    value = torch.mean((twin(xs) - ys) ** 2)
    value.backward()
    expected = (to_numpy(value.detach()), {k: to_numpy(p.grad) for k, p in twin.named_parameters()})
    assert messages == []
    assert_tree_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert apply.compile_stats()["eager_fallbacks"] == 0


def test_a_derivative_leaves_the_recomputed_weight_a_plain_tensor():
    # torch.func leaves the hook's last binding, a functorch wrapper of a
    # level gone; a call puts back what the module held.
    net = _net(_l1, torch.float32)
    xs, ys = _data(torch.float32)
    apply, params = t2j_ad.jaxify_module(net)
    per_example = jax.vmap(jax.grad(lambda p, x, y: jnp.mean((apply(p, x[None]) - y[None]) ** 2)), (None, 0, 0))
    jax.block_until_ready(per_example(params, jnp.asarray(to_numpy(xs)), jnp.asarray(to_numpy(ys))))
    held = net[0].weight
    assert not torch._C._functorch.is_functorch_wrapped_tensor(held)
    assert_tree_allclose(to_numpy(held.detach()), to_numpy((net[0].weight_orig * net[0].weight_mask).detach()))


def _old_spectral_norm_training(net: torch.nn.Sequential) -> None:
    torch.nn.utils.spectral_norm(net[0])  # training mode: the hook's power iteration updates weight_u


_LEFT_AS_FOUND = {
    "l1_unstructured": _l1,
    "old_weight_norm": _old_weight_norm,
    "old_spectral_norm_train": _old_spectral_norm_training,
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("how", list(_LEFT_AS_FOUND))
def test_a_graph_mode_call_leaves_the_recomputed_weight_as_it_found_it(how, jit):
    # docs/compile-modes.md: a graph replays the hook's ops, not its binding,
    # so ``module.weight`` is the tensor it held before the call, where
    # PyTorch's forward leaves the weight it computed; results and the
    # power iteration's state are PyTorch's.
    net, twin = _net(_LEFT_AS_FOUND[how], torch.float32), _net(_LEFT_AS_FOUND[how], torch.float32)
    xs, _ = _data(torch.float32)
    apply, params = t2j_ad.jaxify_module(net, compile="graph")
    call = jax.jit(apply) if jit else apply
    found = net[0].weight
    for step in range(2):  # parameters other than the module's own, as in a training loop
        scaled = {k: v * (1.0 + 0.5 * step) for k, v in params.items()}
        got, messages = _fallbacks(lambda: call(scaled, jnp.asarray(to_numpy(xs))))
        expected = torch.func.functional_call(twin, {k: to_torch(v) for k, v in scaled.items()}, (xs,))
        assert messages == []
        assert_tree_allclose(to_numpy(got), to_numpy(expected.detach()), rtol=1e-5, atol=1e-5)
        assert net[0].weight is found
        if how == "old_spectral_norm_train":
            assert_tree_allclose(to_numpy(net[0].weight_u), to_numpy(twin[0].weight_u), rtol=1e-6, atol=1e-6)
    assert apply.compile_stats()["eager_fallbacks"] == 0


def test_a_pruned_module_with_running_statistics_loops_naming_them():
    # The loop stays for real state, and the warning names it, not the
    # pruned weight.
    net, twin = _net(_l1, torch.float32), _net(_l1, torch.float32)
    for module in (net, twin):
        module.insert(1, torch.nn.BatchNorm1d(8).to(TORCH_DEVICE))
        module.train()
    xs, _ = _data(torch.float32)
    apply, params = t2j_ad.jaxify_module(net)
    per_example = jax.jit(jax.vmap(jax.grad(lambda p, x: jnp.sum(apply(p, x) ** 2)), in_axes=(None, 0)))
    batches = jnp.asarray(to_numpy(xs)).reshape(3, 2, 5)
    got, messages = _fallbacks(lambda: per_example(params, batches))
    assert len(messages) == 1, messages
    assert "updates state it keeps (BatchNorm1d.num_batches_tracked, BatchNorm1d.running_mean" in messages[0]
    assert "Linear.weight" not in messages[0]
    expected = []
    for batch in batches:  # PyTorch's loop: one update per example
        twin.zero_grad()
        torch.sum(twin(to_torch(batch)) ** 2).backward()
        expected.append({k: to_numpy(p.grad) for k, p in twin.named_parameters()})
    assert_tree_allclose(got, {k: np.stack([e[k] for e in expected]) for k in expected[0]}, rtol=1e-5, atol=1e-5)
    assert_tree_allclose(to_numpy(net[1].running_mean), to_numpy(twin[1].running_mean), rtol=1e-6, atol=1e-6)


class _MaskedByItsOwnHook(torch.nn.Linear):
    """Binds ``weight`` from ``weight_orig`` and a mask in a hook of its own:
    not known to be pure, so it counts as state, as before."""

    def __init__(self) -> None:
        super().__init__(5, 2)
        self.weight_orig = torch.nn.Parameter(self.weight.detach().clone())
        del self.weight
        self.register_buffer("mask", (torch.arange(10.0).reshape(2, 5) % 3 > 0).float())
        self.weight = self.weight_orig * self.mask
        self.register_forward_pre_hook(lambda m, args: setattr(m, "weight", m.weight_orig * m.mask))


def test_a_users_own_rebinding_hook_still_loops_and_names_the_attribute():
    torch.manual_seed(0)
    module = _MaskedByItsOwnHook().to(TORCH_DEVICE)
    torch.manual_seed(0)
    twin = _MaskedByItsOwnHook().to(TORCH_DEVICE)
    xs, ys = _data(torch.float32)
    expected = _per_example_grads_by_torch_func(twin, xs, ys)
    apply, params = t2j_ad.jaxify_module(module)
    per_example = jax.vmap(jax.grad(lambda p, x, y: jnp.mean((apply(p, x[None]) - y[None]) ** 2)), (None, 0, 0))
    got, messages = _fallbacks(lambda: per_example(params, jnp.asarray(to_numpy(xs)), jnp.asarray(to_numpy(ys))))
    loops = [m for m in messages if "sequential loop" in m]  # graph mode also says it runs eagerly
    assert len(loops) == 1 and "updates state it keeps (_MaskedByItsOwnHook.weight" in loops[0], messages
    assert "torch.nn.utils.parametrize" in loops[0]
    assert_tree_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_old_spectral_norm_in_training_mode_still_iterates_once_per_step():
    # Its hook updates weight_u and weight_v in place: state, replayed as
    # before, while the weight it binds is recomputed from them.
    torch.manual_seed(0)
    module = torch.nn.utils.spectral_norm(torch.nn.Linear(5, 4)).to(TORCH_DEVICE).train()
    with torch.no_grad():  # far from the converged estimate, so each step moves it
        module.weight_u.copy_(torch.nn.functional.normalize(torch.tensor([1.0, -2.0, 0.5, 3.0]), dim=0))
    twin = copy.deepcopy(module)
    xs, _ = _data(torch.float32)
    apply, params = t2j_ad.jaxify_module(module)
    step = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(apply(p, x) ** 2)))
    for _ in range(2):
        got = step(params, jnp.asarray(to_numpy(xs)))
        twin.zero_grad()
        value = torch.sum(twin(xs) ** 2)
        value.backward()
        expected = (to_numpy(value.detach()), {k: to_numpy(p.grad) for k, p in twin.named_parameters()})
        assert_tree_allclose(got, expected, rtol=1e-5, atol=1e-5)
        assert_tree_allclose(to_numpy(module.weight_u), to_numpy(twin.weight_u), rtol=1e-6, atol=1e-6)
