"""A call that draws random numbers or updates state runs as often under
JAX's transforms as the program says: JAX neither drops one whose outputs go
unused nor runs one that reads only loop-invariant values once, before a
``lax.scan`` (NOTE [calls with effects under jax.jit] in replayed_calls.py).

Each result is held against PyTorch running the same draws in a Python loop
(``torch.func`` for the gradients), and PyTorch's global random sequence must
be where that loop leaves it.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.func
from conftest import TORCH_DEVICE, assert_tree_allclose, to_numpy, to_torch

import t2j_ad

_X = jnp.arange(1.0, 9.0)
_STEPS = 3


def _dropout(x):
    return torch.nn.functional.dropout(x, 0.5, training=True)


def _loss(f):
    return lambda x: (f(x) ** 2).sum()


def _scanned(loss):
    """``loss(x)`` summed over a scan of ``_STEPS`` steps that all read the same ``x``."""
    return lambda x: jax.lax.scan(lambda total, _: (total + loss(x), None), 0.0, None, _STEPS)[0]


def _seeded(fn):
    """``fn()`` from seed 0, its results ready, and the next draws after it."""
    torch.manual_seed(0)
    result = jax.block_until_ready(fn())
    return result, torch.rand(3, device=TORCH_DEVICE)


def _torch_gradients_of_each_step():
    """``_STEPS`` gradients of the square loss, one mask each, drawn in order
    from seed 0, summed; and the next draws after them."""
    x = to_torch(_X)
    return _seeded(lambda: sum(torch.func.grad(_loss(_dropout))(x) for _ in range(_STEPS)))


# Each program draws _STEPS dropout masks (or one) but uses none of them.
UNUSED = {
    "top_level": (lambda f: lambda x: (f(x), x + 1)[1], 1),
    "inside_a_nested_jit": (lambda f: lambda x: (jax.jit(f)(x), x + 1)[1], 1),
    "inside_a_scan": (lambda f: lambda x: (jax.lax.scan(lambda c, _: (c, f(x)), 0.0, None, _STEPS), x + 1)[1], _STEPS),
    "inside_a_while_loop": (
        lambda f: lambda x: (jax.lax.while_loop(lambda c: c[0] < _STEPS, lambda c: (c[0] + 1, f(x)), (0, x)), x + 1)[1],
        _STEPS,
    ),
    "inside_a_cond": (lambda f: lambda x: (jax.lax.cond(x[0] > 0, f, lambda y: y, x), x + 1)[1], 1),
    "inside_a_checkpoint": (lambda f: lambda x: (jax.checkpoint(f)(x), x + 1)[1], 1),
}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("where", list(UNUSED))
def test_a_call_whose_outputs_go_unused_still_draws_under_jit(where, mode):
    # JAX dropped it before lowering: the generator stayed where it was, so
    # every later draw differed from PyTorch's.
    program, draws = UNUSED[where]
    jitted = jax.jit(program(t2j_ad.jaxify(_dropout, compile=mode)))
    jax.block_until_ready(jitted(_X))
    out, after = _seeded(lambda: jitted(_X))
    expected_after = _seeded(lambda: [_dropout(to_torch(_X)) for _ in range(draws)])[1]
    assert_tree_allclose(out, _X + 1)
    assert torch.equal(after, expected_after)


def _batch_norm_net(mode):
    """A linear layer and batch norm in training mode, a copy of it for
    PyTorch to run, its jaxify'd apply and params, and a batch."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4)).to(TORCH_DEVICE).train()
    reference = copy.deepcopy(module)
    apply, params = t2j_ad.jaxify_module(module, compile=mode)
    return module, reference, apply, params, jnp.arange(24.0).reshape(3, 8) / 10


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_module_in_training_mode_updates_its_statistics_when_its_output_goes_unused(mode):
    # Recomputing batch-norm statistics by calling the module and dropping
    # its output updated nothing under jax.jit.
    module, reference, apply, params, batch = _batch_norm_net(mode)

    @jax.jit
    def recalibrate(p, x):
        apply(p, x)
        return x.sum()

    for _ in range(2):
        jax.block_until_ready(recalibrate(params, batch))
        reference(to_torch(batch))
    assert int(module[1].num_batches_tracked) == int(reference[1].num_batches_tracked) == 2
    assert_tree_allclose(to_numpy(module[1].running_mean), to_numpy(reference[1].running_mean), rtol=1e-6)
    assert_tree_allclose(to_numpy(module[1].running_var), to_numpy(reference[1].running_var), rtol=1e-6)


# Each program differentiates a scan whose steps draw a mask from the same x.
SCANNED_GRADIENTS = {
    "grad": lambda loss: jax.grad(_scanned(loss)),
    "jit_grad": lambda loss: jax.jit(jax.grad(_scanned(loss))),
    "grad_of_a_checkpointed_scan": lambda loss: jax.jit(jax.grad(jax.checkpoint(_scanned(loss)))),
    "grad_of_a_scan_of_checkpoints": lambda loss: jax.jit(jax.grad(_scanned(jax.checkpoint(loss)))),
    "linearize_then_transpose": lambda loss: jax.jit(lambda x: jax.vjp(_scanned(loss), x)[1](1.0)[0]),
    "fori_loop": lambda loss: jax.jit(jax.grad(lambda x: jax.lax.fori_loop(0, _STEPS, lambda i, c: c + loss(x), 0.0))),
}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("program", list(SCANNED_GRADIENTS))
def test_the_gradient_of_a_scan_draws_a_mask_in_each_step(program, mode):
    # The value call read only loop-invariant x, so partial evaluation ran it
    # once before the loop: every step's gradient was that of one mask, where
    # the scan's value (no derivative) drew _STEPS masks.
    grad = SCANNED_GRADIENTS[program](_loss(t2j_ad.jaxify(_dropout, compile=mode)))
    jax.block_until_ready(grad(_X))
    got, after = _seeded(lambda: grad(_X))
    expected, expected_after = _torch_gradients_of_each_step()
    assert_tree_allclose(got, to_numpy(expected), rtol=1e-6)
    assert torch.equal(after, expected_after)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_batch_norm_updates_once_per_step_in_the_gradient_of_a_scan(mode):
    module, reference, apply, params, batch = _batch_norm_net(mode)
    grad = jax.jit(jax.grad(lambda p: _scanned(lambda x: (apply(p, x) ** 2).sum())(batch)))
    got = jax.block_until_ready(grad(params))

    names = [name for name, _ in reference.named_parameters()]
    expected = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}
    for _ in range(_STEPS):
        reference.zero_grad()
        (reference(to_torch(batch)) ** 2).sum().backward()
        for name, p in reference.named_parameters():
            expected[name] += p.grad
    assert sorted(got) == sorted(names)
    # The linear bias before batch norm has a zero gradient: float32 rounding
    # noise there (1e-5), which depends on the reduction order of PyTorch's
    # thread count here, outside calls (the caller's own since calls put it back).
    assert_tree_allclose(got, {k: to_numpy(v) for k, v in expected.items()}, rtol=1e-5, atol=5e-5)
    # Inference ran the module once more (a trial run puts its state back).
    assert int(module[1].num_batches_tracked) == int(reference[1].num_batches_tracked) == _STEPS
    assert_tree_allclose(to_numpy(module[1].running_mean), to_numpy(reference[1].running_mean), rtol=1e-6)


def test_a_call_without_effects_whose_output_goes_unused_is_still_dropped():
    # Only calls that draw or keep state are kept: a pure call whose output
    # goes unused is left out of the program, as any JAX operation is.
    calls = []

    def counted(x):
        calls.append(1)
        return torch.sin(x)

    f = t2j_ad.jaxify(counted, output_shapes=jax.ShapeDtypeStruct(_X.shape, _X.dtype))
    jitted = jax.jit(lambda x: (f(x), x + 1)[1])
    assert_tree_allclose(jitted(_X), _X + 1)
    assert calls == []
    assert "custom_call" not in jitted.lower(_X).as_text()
    assert "custom_call" in jax.jit(f).lower(_X).as_text()


def _late(x):
    """``x`` through enough work that XLA has ``x`` itself ready well before it."""
    return jnp.tanh(jnp.cos(x) @ jnp.ones((x.shape[0], x.shape[0]))).cumsum()


def _custom_jvp_of(f):
    """``f`` as a ``jax.custom_jvp`` (whose JVP is the identity's)."""

    @jax.custom_jvp
    def g(x):
        return f(x)

    g.defjvp(lambda primals, tangents: (g(*primals), tangents[0]))
    return g


# Each program makes calls that draw, none reading another's result, the
# first of them on an input that is ready last.
IN_ORDER = {
    "late_input_first": lambda f: lambda x: (f(_late(x)), f(x)),
    "three": lambda f: lambda x: (f(_late(x) * 3), f(jnp.tanh(x)), f(x)),
    "value_and_gradient": lambda f: lambda x: (f(_late(x)), jax.grad(lambda y: (f(y) ** 2).sum())(x)),
    "nested_jits": lambda f: lambda x: (jax.jit(f)(_late(x)), jax.jit(f)(x)),
    "inside_a_checkpoint": lambda f: lambda x: (f(_late(x)), jax.checkpoint(f)(x)),
    "inside_a_custom_jvp": lambda f: lambda x: (_custom_jvp_of(f)(_late(x)), f(x)),
    # lax.cond, scan and fori_loop hold calls of their own (a cond is lowered
    # in place, its first call taking the last one before it; a loop's
    # private function counts as one call for the calls after it).
    "then_a_cond": lambda f: lambda x: (f(_late(x)), jax.lax.cond(x[0] > -100, f, lambda v: v, x)),
    "a_cond_first": lambda f: lambda x: (jax.lax.cond(x[0] > -100, f, lambda v: v, _late(x)), f(x)),
    "a_call_in_either_branch": lambda f: lambda x: (
        f(_late(x)),
        jax.lax.cond(x[0] > -100, f, lambda v: f(v) * 2, x),
        f(jnp.sin(x)),
    ),
    "nested_conds": lambda f: lambda x: (
        f(_late(x)),
        jax.lax.cond(x[0] > -100, lambda v: jax.lax.cond(v[1] > -100, f, lambda u: u, v), lambda v: v, x),
    ),
    "a_scan_first": lambda f: lambda x: (jax.lax.scan(lambda c, _: (c, f(c)), _late(x), None, 2)[1], f(x)),
    "a_fori_loop_first": lambda f: lambda x: (jax.lax.fori_loop(0, 2, lambda i, c: f(c), _late(x)), f(x)),
    # A nested jit with shardings of its own stays a function apart: the
    # calls after it take its results.
    "a_nested_jit_with_shardings_first": lambda f: lambda x: (
        jax.jit(f, in_shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))(_late(x)),
        f(x),
    ),
    "then_a_scan": lambda f: lambda x: (f(_late(x)), jax.lax.scan(lambda c, _: (c, f(c)), x, None, 2)[1]),
    "then_a_fori_loop": lambda f: lambda x: (f(_late(x)), jax.lax.fori_loop(0, 2, lambda i, c: f(c), x)),
}


def _torch_late(x):
    return torch.tanh(torch.cos(x) @ torch.ones((x.shape[0], x.shape[0]), device=x.device)).cumsum(0)


def _torch_late_input_first(f):
    return lambda x: (f(_torch_late(x)), f(x))


# PyTorch has no nested jit, checkpoint or custom_jvp to run the second call in.
TORCH_IN_ORDER = {
    "late_input_first": _torch_late_input_first,
    "nested_jits": _torch_late_input_first,
    "inside_a_checkpoint": _torch_late_input_first,
    "inside_a_custom_jvp": _torch_late_input_first,
    "three": lambda f: lambda x: (f(_torch_late(x) * 3), f(torch.tanh(x)), f(x)),
    "value_and_gradient": lambda f: lambda x: (f(_torch_late(x)), torch.func.grad(lambda y: (f(y) ** 2).sum())(x)),
    "then_a_cond": _torch_late_input_first,
    "a_cond_first": _torch_late_input_first,
    "a_call_in_either_branch": lambda f: lambda x: (f(_torch_late(x)), f(x), f(torch.sin(x))),
    "nested_conds": _torch_late_input_first,
    "a_scan_first": lambda f: lambda x: (torch.stack([f(_torch_late(x)) for _ in range(2)]), f(x)),
    "a_fori_loop_first": lambda f: lambda x: (f(f(_torch_late(x))), f(x)),
    "a_nested_jit_with_shardings_first": _torch_late_input_first,
    "then_a_scan": lambda f: lambda x: (f(_torch_late(x)), torch.stack([f(x) for _ in range(2)])),
    "then_a_fori_loop": lambda f: lambda x: (f(_torch_late(x)), f(f(x))),
}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("program", list(IN_ORDER))
def test_calls_that_draw_run_in_program_order_under_jit(program, mode):
    # XLA ran a call whose input was ready first before one the program
    # makes earlier: each drew the other's numbers. Inside a nested jit, a
    # checkpoint or a custom_jvp the call was lowered apart from the
    # caller's, out of reach of the order.
    noise = t2j_ad.jaxify(lambda x: x + torch.randn_like(x), compile=mode)
    jitted = jax.jit(IN_ORDER[program](noise))
    jax.block_until_ready(jitted(_X))
    got, after = _seeded(lambda: jitted(_X))
    expected, expected_after = _seeded(lambda: TORCH_IN_ORDER[program](lambda x: x + torch.randn_like(x))(to_torch(_X)))
    assert_tree_allclose(got, tuple(to_numpy(e) for e in expected), rtol=1e-5)
    assert torch.equal(after, expected_after)


class _Counter(torch.nn.Module):
    """Scales its input by how many times it has been called."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return x * self.calls


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("nested", [False, True])
def test_calls_of_a_module_that_updates_its_state_run_in_program_order_under_jit(nested, mode):
    counter = _Counter().to(TORCH_DEVICE)
    apply, params = t2j_ad.jaxify_module(counter, compile=mode)
    call = jax.jit(apply) if nested else apply  # a jitted step called from a jitted loop
    jitted = jax.jit(lambda x: (call(params, _late(x)), call(params, x)))
    first, second = jitted(_X)
    assert_tree_allclose(first, _late(_X) * 1)
    assert_tree_allclose(second, _X * 2)
    first, second = jitted(_X)
    assert_tree_allclose((first, second), (_late(_X) * 3, _X * 4))
    assert float(counter.calls) == 4


def _in_a_while_loop(f):
    """``f(x) * x`` as the one step of a ``lax.while_loop``."""
    return lambda x: jax.lax.while_loop(lambda s: s[0] < 1, lambda s: (s[0] + 1, f(s[1]) * s[1]), (0, x))[1]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_forward_mode_through_a_while_loop_that_draws_replays_its_mask(mode):
    f = t2j_ad.jaxify(_dropout, compile=mode)
    ones = jnp.ones_like(_X)
    got, after = _seeded(lambda: jax.jvp(_in_a_while_loop(f), (_X,), (ones,)))
    expected, expected_after = _seeded(
        lambda: torch.func.jvp(lambda x: _dropout(x) * x, (to_torch(_X),), (to_torch(ones),))
    )
    assert_tree_allclose(got, tuple(to_numpy(e) for e in expected), rtol=1e-6)
    assert torch.equal(after, expected_after)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_linearizing_a_while_loop_that_draws_is_refused(checkpointed, mode):
    # JAX linearizes a while_loop by running the whole loop again inside the
    # linear function: each call of it drew new masks, and the tangents were
    # those of other masks than the value's. Under jax.checkpoint JAX failed
    # a bare assertion.
    f = t2j_ad.jaxify(_dropout, compile=mode)
    loop = _in_a_while_loop(f)
    with pytest.raises(Exception, match="runs in a lax.while_loop being linearized"):
        jax.linearize(jax.checkpoint(loop) if checkpointed else loop, _X)


class _CountsCalls(torch.nn.Module):
    """Counts its calls in a buffer (state it keeps: a call with effects)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x * 2


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_vmap_of_a_cond_or_while_loop_with_a_batched_predicate_around_a_call_with_effects_is_refused(mode):
    # JAX runs every branch (every step) for every example and selects: the
    # counter counted 3 where the program makes 1 call (predicates [T, F, F]).
    counter = _CountsCalls().to(TORCH_DEVICE)
    apply, params = t2j_ad.jaxify_module(counter, compile=mode)
    xs = jnp.array([1.0, -1.0, -2.0])

    def in_cond(x):
        return jax.lax.cond(x > 0, lambda x: apply(params, x), lambda x: x, x)

    def in_while(x):
        return jax.lax.while_loop(lambda c: c[0] < x, lambda c: (c[0] + 1.0, apply(params, c[1])), (0.0, x))[1]

    for fn, where in ((in_cond, "lax.cond"), (in_while, "lax.while_loop")):
        with pytest.raises(NotImplementedError, match=rf"'_CountsCalls.forward' draws .* inside a {where} whose predicate jax.vmap batches"):
            jax.vmap(fn)(xs)
    assert float(counter.calls) == 0
    # With the predicate the same for every example, the cond stays a cond:
    # one update per example, as a loop in PyTorch makes.
    got = jax.vmap(lambda x: jax.lax.cond(xs[0] > 0, lambda x: apply(params, x), lambda x: x, x))(xs)
    assert_tree_allclose(got, xs * 2)
    assert float(counter.calls) == 3
    # A cond without such a call is vmapped as JAX does.
    pure = t2j_ad.jaxify(torch.sin, compile=mode)
    assert_tree_allclose(jax.vmap(lambda x: jax.lax.cond(x > 0, pure, jnp.cos, x))(xs), jnp.where(xs > 0, jnp.sin(xs), jnp.cos(xs)))
