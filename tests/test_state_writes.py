"""Derivatives do not write again into the state a function keeps: NOTE
[derivatives do not write again] in state_writes.py.

A module in training mode updates its running statistics once per step in
PyTorch (``loss.backward()`` runs no second forward). Every test holds the
values, the gradients and the state after the step against a twin module
stepped by PyTorch's own autograd (``torch.func`` refuses a write into a
captured tensor), or against pure JAX.
"""

from __future__ import annotations

import copy
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import TORCH_DEVICE, assert_tree_allclose, to_numpy, to_torch

import t2j_ad
from t2j_ad.rules.fallbacks import FallbackWarning

_X = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)) * 2.0 + 1.0, jnp.float32)


def _normalized() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Tanh()).to(TORCH_DEVICE)


def _stepped_by_autograd(  # noqa: ANN001 - loss: torch tensors in, a scalar out
    module: torch.nn.Module, x: jax.Array, loss
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The loss and parameter gradients of one training step of ``module``."""
    module.zero_grad()
    value = loss(module(to_torch(x)))
    value.backward()
    return to_numpy(value.detach()), {name: to_numpy(p.grad) for name, p in module.named_parameters()}


def _state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: to_numpy(b) for name, b in module.named_buffers()}


def _steps_match_pytorch(step, params, module, twin, inputs, loss=None, grads_only=False) -> None:  # noqa: ANN001
    """Each of ``step``'s results (value and gradients, or gradients only)
    and ``module``'s state after it equal those of a step of ``twin`` by
    PyTorch's autograd, input after input."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # loops and eager fallbacks, announced
        for x in inputs:
            got = jax.block_until_ready(step(params, x))
            value, grads = _stepped_by_autograd(twin, x, loss or _square)
            assert_tree_allclose(got, grads if grads_only else (value, grads), rtol=1e-5, atol=1e-5)
            assert_tree_allclose(_state(module), _state(twin), rtol=1e-6, atol=1e-6)


def _square(out):  # noqa: ANN001, ANN202 - torch tensors and JAX arrays alike
    return (out**2).sum()


def _weighted(out):  # noqa: ANN001, ANN202 - linear in the outputs: jit needs no value call
    return (out * (jnp.arange(4.0) if isinstance(out, jax.Array) else torch.arange(4.0, device=out.device))).sum()


STEPS = {
    "value_and_grad": (lambda apply: jax.value_and_grad(lambda p, x: _square(apply(p, x))), _square),
    "jit_value_and_grad": (lambda apply: jax.jit(jax.value_and_grad(lambda p, x: _square(apply(p, x)))), _square),
    "jit_grad_linear": (lambda apply: jax.jit(jax.grad(lambda p, x: _weighted(apply(p, x)))), _weighted),
}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("step", list(STEPS))
def test_a_training_step_updates_batch_norm_statistics_once(step, mode):
    module = _normalized().train()
    twin = copy.deepcopy(module)
    apply, params = t2j_ad.jaxify_module(module, compile=mode)
    transform, torch_loss = STEPS[step]
    # three steps: the first call traces in graph mode; later ones replay
    _steps_match_pytorch(transform(apply), params, module, twin, [_X] * 3, torch_loss, step == "jit_grad_linear")
    assert int(module[1].num_batches_tracked) == 3


def test_a_counter_the_function_closes_over_counts_each_step_once():
    # Not a module: a tensor the function closes over and writes, found by
    # inference as one that no op of its run made.
    count = torch.zeros((), device=TORCH_DEVICE)

    def counted(x):
        count.add_(1.0)
        return torch.sin(x) * x

    jf = t2j_ad.jaxify(counted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        value, grad = jax.value_and_grad(lambda x: jf(x).sum())(_X)
        assert float(count) == 1.0
        hessian = jax.hessian(lambda x: jf(x).sum())(_X[0])
        assert float(count) == 2.0  # eager jax.hessian makes one value call too
    assert_tree_allclose((value, grad), (jnp.sum(jnp.sin(_X) * _X), jnp.cos(_X) * _X + jnp.sin(_X)), rtol=1e-5)
    x = _X[0]
    assert_tree_allclose(hessian, jnp.diag(2 * jnp.cos(x) - x * jnp.sin(x)), rtol=1e-5, atol=1e-6)


def test_a_temporary_written_in_place_is_not_state():
    # In-place ops on tensors the function made (an in-place ReLU, a
    # buffer it allocates) are no state: its derivatives keep the plain rules.
    def temporaries(x):
        y = torch.relu_(x * 2.0)
        scratch = torch.zeros(x.shape, device=x.device)
        scratch.add_(y).mul_(torch.tensor(3.0, device=x.device))
        return scratch

    jf = t2j_ad.jaxify(temporaries)
    got = jax.grad(lambda x: jf(x).sum())(_X)
    entry = jf._cache[next(iter(jf._cache))]
    assert not entry.base.effects, entry.base.effects
    assert_tree_allclose(got, jnp.where(_X > 0, 6.0, 0.0))


def test_spectral_norm_is_differentiated_at_the_estimate_its_value_used():
    # spectral_norm's power iteration advances u and v in place in training
    # mode; a derivative call advanced it again, and differentiated the
    # weight divided by the next estimate.
    torch.manual_seed(0)
    module = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(3, 4)).to(TORCH_DEVICE).train()
    norm = module.parametrizations.weight[0]
    with torch.no_grad():  # far from the converged estimate the constructor leaves, so each step moves it
        norm._u.copy_(torch.nn.functional.normalize(torch.tensor([1.0, -2.0, 0.5, 3.0]), dim=0))
        norm._v.copy_(torch.nn.functional.normalize(torch.tensor([2.0, 1.0, -1.0]), dim=0))
    twin = copy.deepcopy(module)
    apply, params = t2j_ad.jaxify_module(module)
    step = jax.jit(jax.value_and_grad(lambda p, x: _square(apply(p, x))))
    _steps_match_pytorch(step, params, module, twin, [_X] * 2)


def test_a_module_inferred_in_eval_mode_updates_once_in_training_mode():
    # Inference in eval mode saw no writes; the JVP rule finds the flags
    # changed and runs another trial run.
    module = _normalized().eval()
    twin = copy.deepcopy(module)
    apply, params = t2j_ad.jaxify_module(module)
    jax.block_until_ready(apply(params, _X))
    module.train()
    twin.train()
    _steps_match_pytorch(jax.value_and_grad(lambda p, x: _square(apply(p, x))), params, module, twin, [_X])


def test_forward_mode_of_a_training_module_writes_once():
    # The value call updates the statistics once; the tangent call runs its
    # forward on tensors of its own (torch.func.jvp refused a write into the
    # module's, "would mutate a captured Tensor").
    module = _normalized().train()
    twin = copy.deepcopy(module).train()
    apply, params = t2j_ad.jaxify_module(module)
    tangent = jnp.cos(_X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        value, out_tangent = jax.jvp(lambda x: apply(params, x), (_X,), (tangent,))
    torch_params = {k: to_torch(v) for k, v in params.items()}
    x = to_torch(_X).requires_grad_(True)
    out = torch.func.functional_call(twin, torch_params, (x,))  # updates the twin's statistics once
    # J t by the double-vjp trick in plain autograd
    seed = torch.zeros_like(out, requires_grad=True)
    (pulled,) = torch.autograd.grad(out, x, seed, create_graph=True)
    (expected_tangent,) = torch.autograd.grad(pulled, seed, to_torch(tangent))
    expected = (to_numpy(out.detach()), to_numpy(expected_tangent))
    assert_tree_allclose((value, out_tangent), expected, rtol=1e-5, atol=1e-5)
    assert_tree_allclose(_state(module), _state(twin), rtol=1e-6, atol=1e-6)


def test_under_jax_checkpoint_a_step_updates_once():
    # jax.checkpoint runs the forward pass again in the backward pass; the
    # value call is never run again (NOTE [a value call runs once]).
    module = _normalized().train()
    twin = copy.deepcopy(module)
    apply, params = t2j_ad.jaxify_module(module)
    step = jax.jit(jax.value_and_grad(jax.checkpoint(lambda p, x: _square(apply(p, x)))))
    _steps_match_pytorch(step, params, module, twin, [_X] * 2)


class _Rebinds(torch.nn.Module):
    """Binds a new running mean each call, and scales by it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("mean", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.mean = 0.5 * self.mean + 0.5 * h.detach().mean(0)
        return h * (1.0 + self.mean)


class _Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 + self.buf)


class _WritesIntoItsChild(torch.nn.Module):
    """Updates a child's buffer before (or without) calling the child."""

    def __init__(self, call_child: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.holder = _Holder()
        self.call_child = call_child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad():
            self.holder.buf.mul_(0.5).add_(h.mean(0))
        return self.holder(h) if self.call_child else h * (1.0 + self.holder.buf)


@pytest.mark.parametrize(
    "make",
    [_Rebinds, lambda: _WritesIntoItsChild(call_child=True), lambda: _WritesIntoItsChild(call_child=False)],
    ids=["forward_rebinds_its_buffer", "parent_writes_before_the_child_runs", "parent_writes_a_child_never_run"],
)
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_state_a_forward_binds_or_writes_outside_its_own_module_is_updated_once(make, mode):
    # The state is found when the outermost forward holding it starts, and a
    # derivative binds a tensor of its own there (NOTE [derivatives do not
    # write again]); a rebinding counts as an update. Each of these updated
    # twice per step before, with gradients taken at the updated state.
    torch.manual_seed(0)
    module = make().to(TORCH_DEVICE)
    twin = copy.deepcopy(module)
    apply, params = t2j_ad.jaxify_module(module, compile=mode)
    step = jax.jit(jax.value_and_grad(lambda p, x: _square(apply(p, x))))
    # graph mode refuses a rebinding forward (eager, announced)
    _steps_match_pytorch(step, params, module, twin, [_X[:, :3] * (k + 1) for k in range(3)])


class _Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.count.add_(1.0)
        return self.lin(x) * self.count


def test_per_example_gradients_update_state_once_per_example_as_a_loop():
    # torch.vmap makes an unbatched in-place write once for the whole batch;
    # a loop over the examples makes it once per example, each example
    # differentiated at its own state.
    module = _Counter().to(TORCH_DEVICE)
    twin = copy.deepcopy(module)
    apply, params = t2j_ad.jaxify_module(module)
    per_example = jax.jit(jax.vmap(jax.grad(lambda p, x: _square(apply(p, x))), in_axes=(None, 0)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jax.block_until_ready(per_example(params, _X))
    messages = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(messages) == 1 and "updates state it keeps" in messages[0], messages
    expected = [_stepped_by_autograd(twin, row, _square)[1] for row in _X]
    assert_tree_allclose(got, {k: np.stack([e[k] for e in expected]) for k in expected[0]}, rtol=1e-5, atol=1e-5)
    assert float(module.count) == float(twin.count) == len(_X)


@pytest.mark.parametrize("method", ["expand_dims", "broadcast_all"])
def test_per_example_gradients_under_a_torch_vmap_method_are_refused_before_any_update(method):
    # The value call looped over the examples, updating the state once per
    # example, and only then did its replays refuse torch.vmap: a call that
    # returned nothing had counted 3 steps.
    module = _Counter().to(TORCH_DEVICE)
    apply, params = t2j_ad.jaxify_module(module, vmap_method=method)
    per_example = jax.vmap(jax.grad(lambda p, x: _square(apply(p, x))), in_axes=(None, 0))
    with pytest.raises(Exception, match="cannot replay per example; vmap_method='sequential'"):
        jax.block_until_ready(per_example(params, _X))
    assert float(module.count) == 0


def test_batching_a_training_batch_norm_counts_each_example_once():
    # Batch norm counts the batch, then refuses a batched input: torch.vmap's
    # failed attempt left its count behind before the loop (4 for 3 examples).
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv1d(3, 3, 1), torch.nn.BatchNorm1d(3, momentum=None)).to(TORCH_DEVICE)
    twin = copy.deepcopy(module)
    apply, params = t2j_ad.jaxify_module(module)
    xs = jnp.asarray(np.random.default_rng(1).normal(size=(3, 1, 3, 5)), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        got = jax.vmap(apply, in_axes=(None, 0))(params, xs)
        gradient = jax.grad(lambda p: _square(jax.vmap(apply, in_axes=(None, 0))(p, xs)))(params)
    with torch.no_grad():
        expected = torch.stack([twin(x) for x in to_torch(xs)])
    assert_tree_allclose(got, to_numpy(expected), rtol=1e-5, atol=1e-5)
    twin.zero_grad()
    _square(torch.stack([twin(x) for x in to_torch(xs)])).backward()
    assert_tree_allclose(gradient, {n: to_numpy(p.grad) for n, p in twin.named_parameters()}, rtol=1e-5, atol=1e-5)
    assert_tree_allclose(_state(module), _state(twin), rtol=1e-6, atol=1e-6)
    assert int(module[1].num_batches_tracked) == 6


def test_batch_norm_in_eval_mode_updates_nothing_and_keeps_the_plain_rules():
    module = _normalized().eval()
    apply, params = t2j_ad.jaxify_module(module)
    before = _state(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # torch.func throughout
        jax.grad(lambda p, x: _square(apply(p, x)))(params, _X)
    entry = apply.jaxified._cache[next(iter(apply.jaxified._cache))]
    assert not entry.base.effects, entry.base.effects
    assert_tree_allclose(_state(module), before)


class _WritesWhen(torch.nn.Module):
    """Writes its buffer only where ``x.sum()`` passes ``threshold``."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if bool(x.sum() > self.threshold):
            with torch.no_grad():
                self.total.add_(h.mean(0))
        return h * (1.0 + self.total)


def test_a_write_made_only_for_some_values_is_made_once_and_differentiated_as_in_pytorch():
    # NOTE [a second run, on ones]: the run on zeros took the branch without
    # the write, the run on ones the other; the derivative replays the write.
    module = _WritesWhen(0.0).to(TORCH_DEVICE)
    reference = copy.deepcopy(module)
    apply, params = t2j_ad.jaxify_module(module)
    x = jnp.abs(_X[:, :3]) + 1.0
    grads = jax.grad(lambda p, x: _square(apply(p, x)))(params, x)
    _square(reference(to_torch(x))).backward()
    expected = {name: jnp.asarray(to_numpy(p.grad)) for name, p in reference.named_parameters()}
    assert_tree_allclose(grads, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module.total, reference.total)  # written once


def test_a_write_neither_zeros_nor_ones_make_is_refused_by_name():
    # The runs on zeros and on ones both took the branch without the write,
    # so the derivative would write a second time.
    apply, params = t2j_ad.jaxify_module(_WritesWhen(50.0).to(TORCH_DEVICE))
    with pytest.raises(Exception, match=r"did not see that write.*torch.where.*jax.clear_caches\(\).*functools.partial\(step\)"):
        jax.block_until_ready(jax.grad(lambda p, x: _square(apply(p, x)))(params, jnp.abs(_X[:, :3]) + 10.0))


def test_a_jitted_derivative_traced_in_eval_mode_is_refused_after_train():
    # Traced in eval mode, where the module neither draws nor updates, the
    # derivative takes the plain rules; after module.train() it would draw a
    # second dropout mask and update batch norm twice.
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(4))
    module = module.to(TORCH_DEVICE).eval()
    apply, params = t2j_ad.jaxify_module(module)
    step = jax.jit(jax.value_and_grad(lambda p, x: _square(apply(p, x))))
    jax.block_until_ready(step(params, _X))
    module.train()
    with pytest.raises(Exception, match="changed training mode"):
        jax.block_until_ready(step(params, _X))
    module.eval()
    jax.block_until_ready(step(params, _X))  # back in the mode it was traced in


@pytest.mark.parametrize("how", ["clear_caches", "partial", "lambda"])
def test_following_the_advice_after_train_traces_again(how):
    # The refusal advised "jax.clear_caches(), or a new jax.jit of it"; but
    # JAX keeps a trace per Python function, so jax.jit(step) of the same
    # step reused the eval-mode trace and was refused again. What the
    # message advises now (jax.clear_caches(), or jax.jit of a new function
    # object) traces again, and the step then matches PyTorch's autograd.
    module = _normalized().eval()
    apply, params = t2j_ad.jaxify_module(module)

    def step(p, x):
        return jax.value_and_grad(lambda p: _square(apply(p, x)))(p)

    jax.block_until_ready(jax.jit(step)(params, _X))
    module.train()
    twin = copy.deepcopy(module)
    for _ in range(2):  # a new jax.jit of the same step reuses its trace
        with pytest.raises(Exception, match="changed training mode") as refused:
            jax.block_until_ready(jax.jit(step)(params, _X))
    message = str(refused.value)
    assert "jax.clear_caches()" in message and "jax.jit(functools.partial(step))" in message
    assert "reuses the trace" in message
    assert_tree_allclose(_state(module), _state(twin), rtol=0, atol=0)  # NOTE [a value call checked before it runs]
    if how == "clear_caches":
        jax.clear_caches()
        retraced = jax.jit(step)
    elif how == "partial":
        retraced = jax.jit(functools.partial(step))
    else:
        retraced = jax.jit(lambda *a: step(*a))
    _steps_match_pytorch(retraced, params, module, twin, [_X, _X * 0.5 + 1.0])


def _generator_state() -> torch.Tensor:
    return torch.cuda.get_rng_state(TORCH_DEVICE) if TORCH_DEVICE.type == "cuda" else torch.get_rng_state()


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_step_refused_after_train_leaves_the_module_and_the_generator_as_it_found_them(mode):
    # NOTE [a value call checked before it runs]: traced in eval mode, the
    # step's value call was a plain call, which ran after module.train()
    # before its derivative was refused: two refused steps counted two
    # batches, moved the running statistics and drew two dropout masks from
    # the generator. Held against a twin that ran none of those calls, and
    # then a step traced again against the twin's step by PyTorch's autograd.
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(4))
    module = module.to(TORCH_DEVICE).eval()
    apply, params = t2j_ad.jaxify_module(module, compile=mode)

    def step(p, x):
        return jax.value_and_grad(lambda p: _square(apply(p, x)))(p)

    jax.block_until_ready(jax.jit(step)(params, _X))
    module.train()
    twin = copy.deepcopy(module)
    generator = _generator_state()
    for _ in range(2):
        with pytest.raises(Exception, match="changed training mode"):
            jax.block_until_ready(jax.jit(step)(params, _X))
    assert_tree_allclose(_state(module), _state(twin), rtol=0, atol=0)
    assert torch.equal(_generator_state(), generator)  # as if the calls never ran
    retraced = jax.jit(functools.partial(step))
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        got = jax.block_until_ready(retraced(params, _X))
    torch.manual_seed(5)
    expected = _stepped_by_autograd(twin, _X, _square)
    assert_tree_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert_tree_allclose(_state(module), _state(twin), rtol=1e-6, atol=1e-6)


def test_a_jitted_derivative_traced_in_train_mode_runs_in_eval_mode():
    # NOTE [fewer effects than a program was traced for]: in eval mode the
    # module neither draws nor updates, which the token of the train-mode
    # program covers; it was refused as a change of mode. Held against
    # torch.func in eval mode, and the running statistics left alone.
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(4))
    module = module.to(TORCH_DEVICE)
    apply, params = t2j_ad.jaxify_module(module)
    step = jax.jit(jax.value_and_grad(lambda p, x: _square(apply(p, x))))
    jax.block_until_ready(step(params, _X))
    module.eval()
    statistics = module[2].running_mean.clone()
    value, grads = step(params, _X)
    own = {name: p.detach() for name, p in module.named_parameters()}
    expected_grads, expected_value = torch.func.grad_and_value(
        lambda p: _square(torch.func.functional_call(module, p, (to_torch(_X),)))
    )(own)
    np.testing.assert_allclose(value, expected_value.item(), rtol=1e-5)
    assert_tree_allclose(grads, {k: jnp.asarray(to_numpy(v)) for k, v in expected_grads.items()}, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module[2].running_mean, statistics)


def test_a_jacobian_replays_its_value_once_for_every_direction():
    # jax.jacfwd batches the tangents, not the token: one torch.vmap over
    # the directions replays the one value call. It ran a loop over the
    # directions before (a Hessian of a batch-norm net was 9x slower in
    # graph mode than without running statistics).
    module = _Counter().to(TORCH_DEVICE)
    runs = []
    module.register_forward_pre_hook(lambda m, args: runs.append(1))
    twin = copy.deepcopy(module)
    apply, params = t2j_ad.jaxify_module(module, compile="eager")
    x = _X[:2, :3]
    jax.block_until_ready(apply(params, x))  # inference and a first call
    runs.clear()
    jacobian = jax.jacfwd(lambda x: apply(params, x))(x)
    assert len(runs) == 2, runs  # the value call, and one tangent call for all 6 directions
    twin.count.add_(1.0)  # the first call above
    tx = to_torch(x)
    expected = torch.autograd.functional.jacobian(lambda x: twin(x), tx)
    assert_tree_allclose(jacobian, to_numpy(expected), rtol=1e-5, atol=1e-6)
    assert float(module.count) == float(twin.count)


class _AveragesThrough(torch.nn.Module):
    """An average kept in a buffer, updated through an alias of it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("average", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alias = self.average.data if self.how == "data" else self.average.detach()
        alias.mul_(0.5).add_(x.detach())
        return (x * self.average).sum()


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("how", ["data", "detach"])
def test_a_buffer_written_through_data_or_detach_is_the_modules_state(how, mode):
    # The write's tensor is another object over the buffer's memory: it was
    # taken for a tensor the function closes over, and the derivative
    # refused with "did not see that write".
    module = _AveragesThrough(how).to(TORCH_DEVICE)
    twin = copy.deepcopy(module)
    apply, params = t2j_ad.jaxify_module(module, compile=mode)
    for step in range(2):
        x = jnp.arange(1.0, 4.0) * (step + 1)
        value, grad = jax.value_and_grad(lambda x: apply(params, x))(x)
        tx = to_torch(x).requires_grad_()
        expected = twin(tx)
        expected.backward()
        assert_tree_allclose((value, grad), (to_numpy(expected.detach()), to_numpy(tx.grad)))
        torch.testing.assert_close(module.average, twin.average)  # updated once per step



# ------------------------------------- a jaxified call inside, that keeps state

_NESTED_INPUT = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)), jnp.float32)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("how", ["value_and_grad", "jit_value_and_grad"])
@pytest.mark.parametrize("inner_first", [True, False], ids=["inner_called_first", "inner_first_called_inside"])
def test_a_nested_jaxified_call_that_keeps_state_updates_it_once_a_step(inner_first, how, mode):
    """A PyTorch function that calls a jaxified training-mode BatchNorm: the
    derivative call of the outer runs its forward again, and the nested
    call in it updated the statistics again (6 updates in 3 steps), since
    the outer's inference never saw the write (the nested call is a trial
    run of its own). Held against the same composition in plain PyTorch,
    one forward and one backward a step (NOTE [a nested call's effects are
    its caller's] in real_writes.py)."""
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(3).to(TORCH_DEVICE)
    inner = t2j_ad.jaxify(lambda t: norm(t), compile=mode)
    if inner_first:  # else its shapes are inferred inside the outer's trial runs
        jax.block_until_ready(inner(_NESTED_INPUT))
    twin = copy.deepcopy(norm)

    def outer(x):
        return (x * t2j_ad.tree_j2t(inner(_NESTED_INPUT)).clone()).tanh().sum()

    step = jax.value_and_grad(t2j_ad.jaxify(outer, compile=mode))
    step = jax.jit(step) if how == "jit_value_and_grad" else step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # a function that calls JAX runs eagerly, announced
        for _ in range(3):
            got = jax.block_until_ready(step(_X[:4]))
            x = to_torch(_X[:4]).requires_grad_()
            value = (x * twin(to_torch(_NESTED_INPUT)).detach()).tanh().sum()
            value.backward()
            assert_tree_allclose(got, (to_numpy(value.detach()), to_numpy(x.grad)), rtol=1e-5, atol=1e-5)
            assert_tree_allclose(_state(norm), _state(twin), rtol=1e-6, atol=1e-6)
    assert int(norm.num_batches_tracked) == 3 + inner_first  # one a step


class _RebindsItsAverage(torch.nn.Module):
    """Keeps an average by binding a new tensor to its buffer each call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        self.ema = 0.5 * self.ema + 0.5 * t.mean(0)
        return t - self.ema


def _jaxified_inner(module: torch.nn.Module, inner: str, mode: str):  # noqa: ANN202 - a JAX function of one array
    if inner == "jaxify":
        return t2j_ad.jaxify(lambda t: module(t), compile=mode)
    apply, params = t2j_ad.jaxify_module(module, compile=mode)
    return lambda t: apply(params, t)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("how", ["call", "value_and_grad", "jit_value_and_grad"])
@pytest.mark.parametrize("inner", ["jaxify", "jaxify_module"])
@pytest.mark.parametrize("inner_first", [True, False], ids=["inner_called_first", "inner_first_called_inside"])
def test_a_nested_jaxified_call_that_rebinds_a_buffer_updates_it_once_a_step(inner_first, inner, how, mode):
    """A PyTorch function that calls a jaxified module whose ``forward``
    binds a new tensor to its buffer. First called inside the outer's trial
    run, a graph-mode inner was traced inside that run too, whose hooks put
    the rebinding back before the trace's own saw it: the trace was not
    refused, and its graph never updated the buffer (it stayed 0). Held
    against the same composition in plain PyTorch, one update a step (NOTE
    [a forward is the innermost trial run's] in real_writes.py)."""
    module = _RebindsItsAverage().to(TORCH_DEVICE)
    twin = copy.deepcopy(module)
    nested = _jaxified_inner(module, inner, mode)
    if inner_first:  # else its shapes are inferred, and it is traced, inside the outer's trial runs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)  # the rebinding, refused by the trace, announced
            jax.block_until_ready(nested(_NESTED_INPUT))
        twin(to_torch(_NESTED_INPUT))

    def outer(x):
        return (x * t2j_ad.tree_j2t(nested(_NESTED_INPUT)).clone()).tanh().sum()

    call = t2j_ad.jaxify(outer, compile=mode)
    step = call if how == "call" else jax.value_and_grad(call)
    step = jax.jit(step) if how == "jit_value_and_grad" else step
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", FallbackWarning)  # a function that calls JAX runs eagerly, announced
        for _ in range(3):
            got = jax.block_until_ready(step(_X[:4]))
            x = to_torch(_X[:4]).requires_grad_()
            value = (x * twin(to_torch(_NESTED_INPUT)).detach()).tanh().sum()
            value.backward()
            expected = to_numpy(value.detach()) if how == "call" else (to_numpy(value.detach()), to_numpy(x.grad))
            assert_tree_allclose(got, expected, rtol=1e-5, atol=1e-5)
            assert_tree_allclose(_state(module), _state(twin), rtol=1e-6, atol=1e-6)
    if mode == "graph" and not inner_first:  # the inner's trace refused the rebinding, by name
        assert any("binds a new tensor to _RebindsItsAverage.ema" in str(w.message) for w in seen)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("how", ["value_and_grad", "jit_value_and_grad"])
@pytest.mark.parametrize("inner_first", [True, False], ids=["inner_called_first", "inner_first_called_inside"])
def test_a_jaxified_call_two_levels_down_that_keeps_state_updates_it_once_a_step(inner_first, how, mode):
    """A PyTorch function that calls a jaxified one that calls a jaxified
    training-mode BatchNorm: the middle call's trial run was told what the
    BatchNorm wrote, but told the outer's only what it wrote itself, so the
    outer's derivative call ran both again and the statistics were updated
    twice a step. Held against the same composition in plain PyTorch (NOTE
    [a nested call's effects reach every caller] in real_writes.py)."""
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(3).to(TORCH_DEVICE)
    inner = t2j_ad.jaxify(lambda t: norm(t), compile=mode)
    if inner_first:  # else its shapes are inferred inside the middle's trial runs, inside the outer's
        jax.block_until_ready(inner(_NESTED_INPUT))
    twin = copy.deepcopy(norm)
    middle = t2j_ad.jaxify(lambda t: t * t2j_ad.tree_j2t(inner(_NESTED_INPUT)).clone(), compile=mode)

    def outer(x):
        return (x * t2j_ad.tree_j2t(middle(_NESTED_INPUT)).clone()).tanh().sum()

    step = jax.value_and_grad(t2j_ad.jaxify(outer, compile=mode))
    step = jax.jit(step) if how == "jit_value_and_grad" else step
    nested_input = to_torch(_NESTED_INPUT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # functions that call JAX run eagerly, announced
        for _ in range(3):
            got = jax.block_until_ready(step(_X[:4]))
            x = to_torch(_X[:4]).requires_grad_()
            value = (x * (nested_input * twin(nested_input)).detach()).tanh().sum()
            value.backward()
            assert_tree_allclose(got, (to_numpy(value.detach()), to_numpy(x.grad)), rtol=1e-5, atol=1e-5)
            assert_tree_allclose(_state(norm), _state(twin), rtol=1e-6, atol=1e-6)
    assert int(norm.num_batches_tracked) == 3 + inner_first  # one a step


class _ShiftedScale(torch.nn.Module):
    """A parameter and a buffer, both read by the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((3,), 2.0))
        self.register_buffer("shift", torch.ones(3))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.scale + self.shift


class _CallsItsPartThroughJax(torch.nn.Module):
    """Runs its submodule through another ``jaxify_module`` of it."""

    def __init__(self, part: torch.nn.Module, run_part) -> None:  # noqa: ANN001 - a JAX function of no arguments
        super().__init__()
        self.part = part
        object.__setattr__(self, "run_part", run_part)  # a plain function, not module state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * t2j_ad.tree_j2t(self.run_part()).clone()


def test_a_nested_call_failing_in_its_callers_trial_run_leaves_the_callers_arrays_alone():
    """A module whose forward calls, through JAX, a ``jaxify_module`` of its
    own submodule: the outer's run on meta tensors binds meta buffers into
    the submodule, and the nested call fails there, as it may (the outer
    then infers on zeros). But the failing call's inputs, the nested
    ``params`` (the caller's own JAX arrays, not copies), held only by the
    failing exception's traceback, were taken for kept and moved to memory
    of their own, and the caller's array came out holding freed memory: the
    nested call computed garbage ever after. Held against the same
    composition in plain PyTorch (NOTE [a failing call's inputs stay put]
    in runtime.py)."""
    part = _ShiftedScale().to(TORCH_DEVICE)
    apply_part, part_params = t2j_ad.jaxify_module(part)
    jax.block_until_ready(apply_part(part_params, _NESTED_INPUT))  # first called on its own
    expected_part = part(to_torch(_NESTED_INPUT)).detach()
    outer = _CallsItsPartThroughJax(part, lambda: apply_part(part_params, _NESTED_INPUT))
    apply, params = t2j_ad.jaxify_module(outer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # a function that calls JAX runs eagerly, announced
        for _ in range(2):
            got = jax.block_until_ready(apply(params, _X[:4]))
            assert_tree_allclose(got, to_numpy(to_torch(_X[:4]) * expected_part), rtol=1e-6, atol=1e-6)
            assert_tree_allclose(part_params, {"scale": np.full(3, 2.0, np.float32)})


class _RunsItsPartThenReadsIt(torch.nn.Module):
    """Runs its submodule through JAX (another ``jaxify_module`` of it,
    given its own ``params``), then reads the submodule's weight, the one
    the outer call bound."""

    def __init__(self, part: torch.nn.Module, run_part) -> None:  # noqa: ANN001 - a JAX function of no arguments
        super().__init__()
        self.part = part
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))
        object.__setattr__(self, "run_part", run_part)  # a plain function, not module state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        through_jax = t2j_ad.tree_j2t(self.run_part()).clone() if self.run_part is not None else None
        if through_jax is None:  # the plain PyTorch twin: the same part on the same input, a constant
            through_jax = self.part(to_torch(_NESTED_INPUT)).detach()
        return (x * self.scale * through_jax + x * self.part.weight).tanh().sum()


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("how", ["value_and_grad", "jit_value_and_grad"])
@pytest.mark.parametrize("inner_first", [True, False], ids=["inner_called_first", "inner_first_called_inside"])
def test_a_module_calling_a_jaxify_module_of_its_own_part_keeps_the_parts_parameters(inner_first, how, mode):
    """An outer ``jaxify_module`` whose forward calls, through JAX, a
    ``jaxify_module`` of its own training-mode BatchNorm, and then the
    BatchNorm itself: under ``jax.value_and_grad`` the nested call's
    bindings were left to the outer derivative's end and put back after the
    outer's, so the BatchNorm kept a plain tensor, one of the outer call's
    arrays, where its ``weight`` Parameter was; and the outer forward's own
    read of the BatchNorm's weight after the nested call found the nested
    call's tensor, not the one it bound. Values, gradients, statistics and the Parameter objects held
    against the same composition in plain PyTorch (NOTE [a nested call's
    bindings are its own] in held_bindings.py)."""
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(3).to(TORCH_DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.8, 1.2, 3))
        norm.bias.copy_(torch.linspace(-0.1, 0.1, 3))
    own = dict(norm.named_parameters())
    apply_part, part_params = t2j_ad.jaxify_module(norm, compile=mode)
    twin = _RunsItsPartThenReadsIt(copy.deepcopy(norm), None).to(TORCH_DEVICE)
    if inner_first:  # else its shapes are inferred inside the outer's trial runs
        jax.block_until_ready(apply_part(part_params, _NESTED_INPUT))
        twin.part(to_torch(_NESTED_INPUT))
    outer = _RunsItsPartThenReadsIt(norm, lambda: apply_part(part_params, _NESTED_INPUT)).to(TORCH_DEVICE)
    apply, params = t2j_ad.jaxify_module(outer, compile=mode)
    step = jax.value_and_grad(apply)
    step = jax.jit(step) if how == "jit_value_and_grad" else step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # functions that call JAX run eagerly, announced
        for _ in range(3):
            got = jax.block_until_ready(step(params, _X[:4]))
            twin.zero_grad()
            value = twin(to_torch(_X[:4]))
            value.backward()
            grads = {name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in twin.named_parameters()}
            expected = (to_numpy(value.detach()), {name: to_numpy(g) for name, g in grads.items()})  # part.bias: unused
            assert_tree_allclose(got, expected, rtol=1e-5, atol=1e-5)
            assert_tree_allclose(_state(norm), _state(twin.part), rtol=1e-6, atol=1e-6)
            assert dict(norm.named_parameters()) == own  # the same Parameter objects, nothing else
            assert all(type(p) is torch.nn.Parameter for p in norm.parameters())
            assert_tree_allclose(
                {k: to_numpy(p.detach()) for k, p in norm.named_parameters()},
                {k: to_numpy(p.detach()) for k, p in twin.part.named_parameters()},
            )


class _Switched(torch.nn.Module):
    """Binds its activation by a flag on every call (NOTE [a submodule
    switched by its own forward] in module_structure.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.noisy = True
        self.smooth, self.rectified = torch.nn.Tanh(), torch.nn.ReLU()
        self.act = self.rectified
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        self.act = self.smooth if self.noisy else self.rectified
        return self.act(self.lin(t))


class _ScalesByItsPart(torch.nn.Module):
    """Scales its input by its submodule's output on a fixed input, got
    through JAX (``run_part``) or, in its plain PyTorch twin, directly."""

    def __init__(self, part: torch.nn.Module, run_part) -> None:  # noqa: ANN001 - a JAX function of no arguments, or None
        super().__init__()
        self.part = part
        object.__setattr__(self, "run_part", run_part)  # a plain function, not module state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.run_part is None:
            by = self.part(to_torch(_NESTED_INPUT)).detach()  # a JAX result is a constant to PyTorch
        else:
            by = t2j_ad.tree_j2t(self.run_part()).clone()
        return (x * by).tanh().sum()


@pytest.mark.parametrize("case", ["switched_part", "outer_given_output_shapes", "part_called_first"])
@pytest.mark.parametrize("how", ["call", "jit", "value_and_grad_x"])
def test_a_graph_of_a_modules_part_called_inside_the_modules_call_runs_on_that_calls_tensors(how, case):
    """A graph-mode ``jaxify`` of a module's submodule, first called inside
    the module's ``jaxify_module`` forward: traced while the outer call had
    its tensors bound in the submodule, the graph kept them: the zeros of
    the outer's run that infers shapes (every call gave 0, silently, for a
    submodule switched by its own forward, whose trace came in that run), or
    else the parameters of the first call it was traced in, for every later
    call (a plain part, under an outer given ``output_shapes=``, which runs
    no trial run first); and a graph traced outside, called first on its
    own, ran on the module's own parameters inside the module's calls, not
    on the call's. Each step passes other parameters; held against the module run
    on them by ``torch.func.functional_call`` (NOTE [a graph inside a module
    call's bindings] in held_bindings.py)."""
    torch.manual_seed(0)
    part = (_Switched() if case == "switched_part" else torch.nn.Linear(3, 3)).to(TORCH_DEVICE)
    run_part = t2j_ad.jaxify(lambda t: part(t), compile="graph")
    if case == "part_called_first":
        jax.block_until_ready(run_part(_NESTED_INPUT))
    twin = _ScalesByItsPart(copy.deepcopy(part), None)
    shapes = jax.ShapeDtypeStruct((), jnp.float32) if case == "outer_given_output_shapes" else None
    outer = _ScalesByItsPart(part, lambda: run_part(_NESTED_INPUT))
    apply, params = t2j_ad.jaxify_module(outer, compile="graph", output_shapes=shapes)
    step = {"call": apply, "jit": jax.jit(apply), "value_and_grad_x": jax.value_and_grad(apply, argnums=1)}[how]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # functions that call JAX run eagerly, announced
        for k in range(3):
            stepped = {name: p * (1.0 + 0.5 * k) for name, p in params.items()}
            got = jax.block_until_ready(step(stepped, _X[:4]))
            x = to_torch(_X[:4]).requires_grad_()
            value = torch.func.functional_call(twin, {n: to_torch(p) for n, p in stepped.items()}, (x,))
            value.backward()
            expected = to_numpy(value.detach())
            if how == "value_and_grad_x":
                expected = (expected, to_numpy(x.grad))
            assert_tree_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # Outside the module's calls the graph runs, on the module's own parameters.
    assert_tree_allclose(run_part(_NESTED_INPUT), to_numpy(part(to_torch(_NESTED_INPUT)).detach()), rtol=1e-6, atol=1e-6)
