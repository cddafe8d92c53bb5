"""PyTorch code that torch.func refuses still differentiates through JAX.

- An ``autograd.Function`` without a ``jvp`` staticmethod: forward mode comes
  from the double-vjp trick (also inside ``torch.vmap``).
- An old-style ``autograd.Function`` (``forward(ctx, ...)``): reverse mode
  from ``torch.autograd.grad(create_graph=True)``, forward mode from the
  double-vjp trick on top of it, batching from the sequential loop.
- The two examples of PyTorch's guide "Extending torch.func with
  autograd.Function": NumpySort/NumpyTake (NumPy inside, ``vmap``
  staticmethods) and MyCube (``generate_vmap_rule = True``, no ``jvp``).

Each fallback warns once, naming the function and PyTorch's reason. Every
result is compared with pure JAX on the same math, eagerly and under jit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import ON_GPU, TORCH_DEVICE, assert_tree_allclose, to_numpy, to_torch

import t2j_ad
from t2j_ad import FallbackWarning

MODES = ("eager", "jit")

X = jnp.array([0.3, -1.2, 0.7, 2.0], jnp.float32)
V = jnp.array([0.5, -0.25, 1.0, 0.1], jnp.float32)
X2 = jnp.array([[0.3, -1.2, 0.7], [2.0, 0.1, -0.4]], jnp.float32)


def check(transforms, torch_version, jax_version, *args, **tol):
    """Each transform of ``torch_version`` matches the same transform of
    ``jax_version`` (run under jit), eagerly and under ``jax.jit``."""
    table = dict(transforms)

    def combined(f):
        return lambda *a: {name: tr(f)(*a) for name, tr in table.items()}

    expected = jax.jit(combined(jax_version))(*args)
    for mode in MODES:
        fn = combined(torch_version)
        actual = (jax.jit(fn) if mode == "jit" else fn)(*args)
        for name in table:
            try:
                assert_tree_allclose(actual[name], expected[name], **tol)
            except AssertionError as err:
                raise AssertionError(f"{name} ({mode}): {err}") from None


def fallback_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, FallbackWarning)]


def assert_warned_once(record, *needles: str) -> None:
    """Exactly one FallbackWarning containing every needle."""
    matching = [m for m in fallback_warnings(record) if all(n in m for n in needles)]
    assert len(matching) == 1, (needles, fallback_warnings(record))


def _grad_of_grad(f):
    """Reverse over reverse: the gradient of <grad f(x), V>."""
    return jax.grad(lambda x: jnp.vdot(jax.grad(f)(x), V))


# ------------------------------------------------------------------ MyCube
# From "Extending torch.func with autograd.Function", Example 2 with
# generate_vmap_rule = True: a custom backward, no jvp staticmethod.


class MyCube(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        result = x**3
        dx = 3 * x**2
        return result, dx

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        result, dx = output
        ctx.save_for_backward(x, dx)

    @staticmethod
    def backward(ctx, grad_output, grad_dx):
        x, dx = ctx.saved_tensors
        # Higher-order gradients need the contribution of dx as well.
        result = grad_output * dx + grad_dx * 6 * x
        return result


def my_cube(x):
    result, _ = MyCube.apply(x)
    return result


def _j_cube_loss(x):
    return jnp.sum(jnp.sin(x) * x**3)


def _cube_loss(f):
    return lambda x: jnp.sum(jnp.sin(x) * f(x))


def test_my_cube_grad_grad_of_grad_hessian():
    f = t2j_ad.jaxify(my_cube)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        check(
            {
                "grad": lambda f: jax.grad(f),
                "grad_of_grad": _grad_of_grad,
                "scalar_grad_of_grad": lambda f: lambda x: jax.grad(jax.grad(lambda s: f(s * x).sum()))(1.5),
                "hessian": jax.hessian,
            },
            _cube_loss(f),
            _j_cube_loss,
            X,
        )
    # torch.func.jvp refuses MyCube (no jvp staticmethod): one warning that
    # names the function and PyTorch's reason.
    assert_warned_once(record, "my_cube", "double-vjp", "You must implement the jvp function")


def test_my_cube_forward_mode_and_inside_torch_vmap():
    f = t2j_ad.jaxify(my_cube)
    xs = jnp.stack([X, V, X * V])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        check(
            {
                "jvp": lambda f: lambda x: jax.jvp(f, (x,), (V,)),
                "jacfwd": jax.jacfwd,
                "linearize": lambda f: lambda x: jax.linearize(f, x)[1](V),
                "jacfwd_of_jacfwd": lambda f: jax.jacfwd(jax.jacfwd(f)),
            },
            f,
            lambda x: x**3,
            X,
        )
        # jax.vmap over forward mode: torch.vmap (MyCube's generated vmap
        # rule) of the double-vjp.
        check(
            {
                "vmap_jacfwd": lambda f: jax.vmap(jax.jacfwd(f)),
                "vmap_hessian": lambda f: jax.vmap(jax.hessian(lambda x: jnp.sum(jnp.sin(x) * f(x)))),
            },
            f,
            lambda x: x**3,
            xs,
        )
    assert_warned_once(record, "my_cube", "double-vjp", "You must implement the jvp function")
    # Batched through torch.vmap, not the sequential loop.
    assert not [m for m in fallback_warnings(record) if "sequential" in m]


def test_fallback_warning_is_one_time_per_function():
    f = t2j_ad.jaxify(my_cube)
    jacfwd = jax.jit(jax.jacfwd(f))
    with pytest.warns(FallbackWarning, match="my_cube") as record:
        first = jacfwd(X)
    assert len(fallback_warnings(record)) == 1
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        again = jax.jacfwd(f)(V)  # eager, new transform trace, same function
        second = jacfwd(V)
    assert fallback_warnings(record) == []
    assert_tree_allclose(first, jnp.diag(3 * X**2))
    assert_tree_allclose(second, jnp.diag(3 * V**2))
    assert_tree_allclose(again, second)


# --------------------------------------------- a two-input Function without jvp


class ScaledSin(torch.autograd.Function):
    """``x * sin(y)`` with a hand-written backward and no jvp."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y):
        return x * torch.sin(y)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * torch.sin(y), grad * x * torch.cos(y)


def scaled_sin(x, y):
    return ScaledSin.apply(x, y) ** 2


def _j_scaled_sin(x, y):
    return (x * jnp.sin(y)) ** 2


def test_function_without_jvp_two_inputs():
    f = t2j_ad.jaxify(scaled_sin)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        check(
            {
                "jvp": lambda f: lambda x, y: jax.jvp(f, (x, y), (V, -V)),
                "jvp_y_only": lambda f: lambda x, y: jax.jvp(lambda y: f(x, y), (y,), (V,)),
                "jacfwd": lambda f: jax.jacfwd(f, argnums=(0, 1)),
                "hessian": lambda f: jax.hessian(lambda x, y: f(x, y).sum(), argnums=(0, 1)),
                "vmap_jacfwd": lambda f: lambda x, y: jax.vmap(jax.jacfwd(f), (0, None))(jnp.stack([x, y]), y),
            },
            f,
            _j_scaled_sin,
            X,
            V,
        )
    assert_warned_once(record, "scaled_sin", "double-vjp", "You must implement the jvp function")


# ------------------------------------------------ old-style autograd.Function


class OldCube(torch.autograd.Function):
    """Old style: ``forward(ctx, ...)``, no setup_context. Every torch.func
    transform refuses it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3 * x**2


def old_cube(x):
    return OldCube.apply(x)


def test_old_style_function_grad_grad_of_grad():
    f = t2j_ad.jaxify(old_cube)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        check(
            {
                "grad": lambda f: jax.grad(f),
                "grad_of_grad": _grad_of_grad,
                "third_order": lambda f: lambda x: jax.grad(jax.grad(jax.grad(lambda s: f(s * x).sum())))(0.5),
                "vjp": lambda f: lambda x: jax.vjp(lambda x: jnp.sin(x) * f(x).sum(), x)[1](V),
            },
            _cube_loss(f),
            _j_cube_loss,
            X,
        )
    assert_warned_once(record, "old_cube", "torch.autograd.grad", "setup_context")


def test_old_style_function_jacfwd_hessian():
    f = t2j_ad.jaxify(old_cube)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        check(
            {
                "jvp": lambda f: lambda x: jax.jvp(f, (x,), (V,)),
                "jacfwd": jax.jacfwd,
                "jacrev": jax.jacrev,
                "hessian": lambda f: jax.hessian(lambda x: jnp.sum(jnp.sin(x) * f(x))),
            },
            f,
            lambda x: x**3,
            X,
        )
    messages = fallback_warnings(record)
    assert_warned_once(record, "old_cube", "torch.autograd.grad", "setup_context")
    assert_warned_once(record, "old_cube", "double-vjp", "setup_context")
    # jacrev/hessian batch with torch.vmap, which refuses old-style Functions.
    assert_warned_once(record, "old_cube", "sequential")
    assert len(messages) == 3, messages


class OnceDifferentiableCube(OldCube):
    """OldCube, with a backward that cannot be differentiated again."""

    backward = staticmethod(torch.autograd.function.once_differentiable(OldCube.backward))


def test_forward_mode_through_a_once_differentiable_backward_is_refused_not_zero():
    # The double-vjp trick differentiates the backward again; autograd found
    # the cotangents unused and forward mode came out zero, silently.
    f = t2j_ad.jaxify(lambda x: OnceDifferentiableCube.apply(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # torch.autograd.grad and the loop, announced
        assert_tree_allclose(jax.jacrev(f)(X), jax.jacrev(lambda x: x**3)(X), rtol=1e-5)
        with pytest.raises(Exception, match="once_differentiable"):
            jax.block_until_ready(jax.jvp(f, (X,), (V,)))


class SetupContextOnceDifferentiableCube(torch.autograd.Function):
    """x**3 with ``setup_context`` and a backward that cannot be
    differentiated again (no jvp staticmethod, so forward mode is the
    double-vjp trick)."""

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3 * x**2


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian"])
def test_forward_mode_through_a_once_differentiable_backward_with_setup_context_is_refused_not_zero(transform):
    # Under torch.func such a backward leaves no trace in the reverse pass's
    # graph: jax.jacfwd and jax.hessian came out zero, silently.
    f = t2j_ad.jaxify(lambda x: SetupContextOnceDifferentiableCube.apply(x))
    run = {
        "jvp": lambda: jax.jvp(f, (X,), (V,)),
        "jacfwd": lambda: jax.jacfwd(f)(X),
        "hessian": lambda: jax.hessian(lambda x: f(x).sum())(X),
    }[transform]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # the double-vjp trick and the loop, announced
        assert_tree_allclose(jax.jacrev(f)(X), jax.jacrev(lambda x: x**3)(X), rtol=1e-5)
        with pytest.raises(Exception, match="backward of SetupContextOnceDifferentiableCube is marked @once_differentiable"):
            jax.block_until_ready(run())


def test_forward_over_reverse_through_a_once_differentiable_backward_is_refused_where_torch_func_jvp_goes_through(
    monkeypatch,
):
    # torch 2.11's torch.func.jvp of the reverse pass went through such a
    # backward and gave zero tangents (jax.hessian on an H200), where torch
    # 2.13's refuses. Stand in for 2.11: a jvp that runs the function and
    # returns zeros.
    def silent_jvp(fn, primals, tangents):
        outs = fn(*primals)
        return outs, tuple(torch.zeros_like(o) for o in outs)

    monkeypatch.setattr(torch.func, "jvp", silent_jvp)
    f = t2j_ad.jaxify(lambda x: SetupContextOnceDifferentiableCube.apply(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        with pytest.raises(Exception, match="backward of SetupContextOnceDifferentiableCube is marked @once_differentiable"):
            jax.block_until_ready(jax.hessian(lambda x: f(x).sum())(X))


class OnceDifferentiableCubeWithJvp(SetupContextOnceDifferentiableCube):
    """The same, with a jvp staticmethod: forward mode over its reverse pass
    runs the backward on dual numbers, which its no_grad does not stop."""

    @staticmethod
    def jvp(ctx, x_t):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * x_t

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])


def test_forward_over_reverse_through_a_once_differentiable_backward_with_a_jvp_is_right():
    f = t2j_ad.jaxify(lambda x: OnceDifferentiableCubeWithJvp.apply(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        got = jax.hessian(lambda x: f(x).sum())(X)
    assert_tree_allclose(got, jax.hessian(lambda x: (x**3).sum())(X), rtol=1e-5)


# ------------------------------------ a backward that drops its cotangent
# NOTE [a backward that drops its cotangent] in t2j_ad/rules/fallbacks.py.
# The double-vjp trick differentiates a Function's backward in its incoming
# gradient; one computed outside autograd gave zeros, with a warning that
# called the results exact (eleventh fuzzing pass, F1 and F3).


class NumpyBackwardSin(torch.autograd.Function):
    """Old style: sin, with its backward in NumPy."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sin(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.from_numpy(np.cos(to_numpy(x.detach())) * to_numpy(grad.detach())).to(x.device)


class NoGradBackwardTanh(torch.autograd.Function):
    """tanh with setup_context, its backward under ``@torch.no_grad()``."""

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    @torch.no_grad()
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class DetachedGradientSin(torch.autograd.Function):
    """sin with setup_context, its backward in torch ops on ``grad.detach()``."""

    @staticmethod
    def forward(x):
        return torch.sin(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.cos(x) * grad.detach()


DROPPING_BACKWARDS = {
    NumpyBackwardSin: jnp.sin,
    NoGradBackwardTanh: jnp.tanh,
    DetachedGradientSin: jnp.sin,
}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian"])
@pytest.mark.parametrize("function", list(DROPPING_BACKWARDS), ids=lambda c: c.__name__)
def test_forward_mode_through_a_backward_that_drops_its_gradient_is_refused_not_zero(function, transform, mode):
    f = t2j_ad.jaxify(lambda x: function.apply(x) ** 2, compile=mode)
    run = {
        "jvp": lambda: jax.jvp(f, (X,), (V,)),
        "jacfwd": lambda: jax.jacfwd(f)(X),
        "hessian": lambda: jax.hessian(lambda x: f(x).sum())(X),
    }[transform]
    reference = DROPPING_BACKWARDS[function]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # the fallbacks, announced
        # First order in reverse mode needs no derivative of the backward.
        expected_gradient = jax.grad(lambda x: (reference(x) ** 2).sum())(X)
        assert_tree_allclose(jax.grad(lambda x: f(x).sum())(X), expected_gradient, rtol=1e-5)
        refusal = f"backward of {function.__name__} is not differentiable in its incoming gradient"
        with pytest.raises(Exception, match=refusal):
            jax.block_until_ready(run())


class PartlyNumpyBackwardScaledSin(torch.autograd.Function):
    """sin(x) * s with setup_context, no jvp: its backward gives x's gradient
    in torch ops and s's in NumPy."""

    @staticmethod
    def forward(x, s):
        return torch.sin(x) * s

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, s = ctx.saved_tensors
        grad_s = (np.sin(to_numpy(x.detach())) * to_numpy(grad.detach())).sum()
        return torch.cos(x) * s * grad, torch.tensor(grad_s, dtype=s.dtype, device=s.device).reshape(s.shape)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_forward_mode_through_a_backward_that_drops_one_inputs_part_is_refused_not_zero(mode):
    # The check asked whether any result reached the cotangent: x's did, so
    # jax.jvp in s came out zero (sin(x) in jax.numpy).
    f = t2j_ad.jaxify(PartlyNumpyBackwardScaledSin.apply, compile=mode)
    reference = lambda x, s: jnp.sin(x) * s  # noqa: E731
    s = jnp.array(1.5, jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # the double-vjp trick, announced
        assert_tree_allclose(
            jax.grad(lambda x, s: f(x, s).sum(), (0, 1))(X, s),
            jax.grad(lambda x, s: reference(x, s).sum(), (0, 1))(X, s),
            rtol=1e-5,
        )
        refusal = "backward of PartlyNumpyBackwardScaledSin is not differentiable in its incoming gradient"
        with pytest.raises(Exception, match=refusal):
            jax.block_until_ready(jax.jvp(f, (X, s), (jnp.zeros_like(X), jnp.array(1.0, jnp.float32))))


def once_differentiable_for_positive_sums(x):
    """x**3 through a @once_differentiable backward where x sums above 0,
    through a differentiable one elsewhere."""
    return OnceDifferentiableCube.apply(x) if x.sum() > 0 else OldCube.apply(x)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("transform", ["jvp", "hessian"])
def test_a_once_differentiable_backward_reached_on_a_later_call_is_refused_not_zero(transform, mode):
    # The refusal was decided on the first call of each transform: a later
    # call down the other branch gave zeros.
    f = t2j_ad.jaxify(once_differentiable_for_positive_sums, compile=mode)
    run = {
        "jvp": lambda x: jax.jvp(f, (x,), (V,))[1],
        "hessian": lambda x: jax.hessian(lambda x: f(x).sum())(x),
    }[transform]
    expected = {
        "jvp": lambda x: jax.jvp(lambda x: x**3, (x,), (V,))[1],
        "hessian": jax.hessian(lambda x: (x**3).sum()),
    }[transform]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        assert_tree_allclose(run(-jnp.abs(X)), expected(-jnp.abs(X)), rtol=1e-5)
        with pytest.raises(Exception, match="backward of OnceDifferentiableCube is marked @once_differentiable"):
            jax.block_until_ready(run(jnp.abs(X)))


class SinWithUnusedInput(torch.autograd.Function):
    """(sin(x), an integer count) with setup_context, no jvp: its backward
    gives None for ``scale``, which the outputs do not depend on, and reads
    no gradient of the integer output."""

    @staticmethod
    def forward(x, scale):
        return torch.sin(x), (x > 0).sum()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad, grad_count):
        (x,) = ctx.saved_tensors
        return torch.cos(x) * grad, None


def sin_with_zero_gradients(x, scale):
    """The Function's sin, its count, and round of it: a derivative that is
    zero, not one that a backward dropped."""
    y, count = SinWithUnusedInput.apply(x, scale)
    return y * 2, count, torch.round(SinWithUnusedInput.apply(x, scale)[0] * 3)


def sin_with_zero_gradients_reference(x, scale):
    y = jnp.sin(x)
    return y * 2, (x > 0).sum(), jnp.round(y * 3)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_forward_mode_through_a_differentiable_backward_with_zero_gradients_is_right(mode, x64):
    f = t2j_ad.jaxify(sin_with_zero_gradients, compile=mode)
    x, scale = jnp.array([0.3, -1.2, 2.0]), jnp.array(1.5)
    first = lambda g: lambda x, s: g(x, s)[0]  # noqa: E731
    third = lambda g: lambda x, s: g(x, s)[2]  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # the double-vjp trick, announced
        for out in (first, third):
            for argnums in (0, 1, (0, 1)):
                assert_tree_allclose(
                    jax.jacfwd(out(f), argnums)(x, scale),
                    jax.jacfwd(out(sin_with_zero_gradients_reference), argnums)(x, scale),
                    rtol=1e-12,
                )
            np.testing.assert_allclose(
                jax.hessian(lambda x: out(f)(x, scale).sum())(x),
                jax.hessian(lambda x: out(sin_with_zero_gradients_reference)(x, scale).sum())(x),
                rtol=1e-12,
                atol=1e-14,
            )
        tangents = jax.jvp(f, (x, scale), (V[:3].astype(x.dtype), jnp.array(1.0)))[1]
        expected = jax.jvp(sin_with_zero_gradients_reference, (x, scale), (V[:3].astype(x.dtype), jnp.array(1.0)))[1]
        np.testing.assert_allclose(tangents[0], expected[0], rtol=1e-12)
        np.testing.assert_allclose(tangents[2], expected[2], rtol=1e-12)
        assert tangents[1].dtype == jax.dtypes.float0


# ------------------------------ reverse over reverse through such a backward
# NOTE [a reverse pass differentiated again] in t2j_ad/rules/fallbacks.py.
# jax.jacrev(jax.grad(f)) differentiates the reverse pass through each
# Function's backward as it computed its result: one that drops its
# gradient lost the part of the second derivative through it, silently.

X_BATCH = jnp.stack([X, X / 2 + 0.1])

REVERSE_OVER_REVERSE = {
    "jacrev(grad)": lambda loss: jax.jacrev(jax.grad(loss))(X),
    "grad(grad @ v)": lambda loss: jax.grad(lambda x: jax.grad(loss)(x) @ V)(X),
    "vjp(vjp)": lambda loss: jax.vjp(lambda x: jax.vjp(loss, x)[1](jnp.float32(1.0))[0], X)[1](V)[0],
    "vmap(jacrev(grad))": lambda loss: jax.vmap(jax.jacrev(jax.grad(loss)))(X_BATCH),
    "jit(jacrev(grad))": lambda loss: jax.jit(jax.jacrev(jax.grad(loss)))(X),
}


class DetachedGradientSinWithJvp(DetachedGradientSin):
    """DetachedGradientSin with a jvp staticmethod, which reverse over
    reverse never runs: its backward is still differentiated."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def jvp(ctx, x_t):
        (x,) = ctx.saved_tensors
        return torch.cos(x) * x_t


DROPPING_BACKWARDS_IN_REVERSE = {**DROPPING_BACKWARDS, DetachedGradientSinWithJvp: jnp.sin}


def _squared_losses(function: type, reference: Callable[[jax.Array], jax.Array], mode: str):
    """``(function(x) ** 2).sum()`` jaxified, and the same of ``reference``
    (the JAX function ``function`` computes) in JAX."""
    loss = t2j_ad.jaxify(lambda x: (function.apply(x) ** 2).sum(), compile=mode)
    return loss, lambda x: (reference(x) ** 2).sum()


def _first_order_agrees(loss, reference_loss) -> None:
    """First order needs no derivative of the backward: right, eagerly and batched."""
    assert_tree_allclose(jax.grad(loss)(X), jax.grad(reference_loss)(X), rtol=1e-5)
    assert_tree_allclose(jax.vmap(jax.grad(loss))(X_BATCH), jax.vmap(jax.grad(reference_loss))(X_BATCH), rtol=1e-5)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("transform", list(REVERSE_OVER_REVERSE))
@pytest.mark.parametrize("function", list(DROPPING_BACKWARDS_IN_REVERSE), ids=lambda c: c.__name__)
def test_reverse_over_reverse_through_a_backward_that_drops_its_gradient_is_refused_not_wrong(
    function, transform, mode
):
    # (sin(x)**2).sum(): the gradient 2 sin(x) cos(x) reaches sin's backward
    # as 2 sin(x); the Hessian lost the 2 cos(x)**2 that goes through it.
    loss, reference_loss = _squared_losses(function, DROPPING_BACKWARDS_IN_REVERSE[function], mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # the fallbacks, announced
        _first_order_agrees(loss, reference_loss)
        refusal = (
            f"reverse mode over the reverse pass of .* backward of {function.__name__}, "
            "but that backward is not differentiable in its incoming gradient"
        )
        with pytest.raises(Exception, match=refusal) as refused:
            jax.block_until_ready(REVERSE_OVER_REVERSE[transform](loss))
    assert "with differentiable torch ops on the incoming gradient" in str(refused.value)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize(
    "function", [OnceDifferentiableCube, SetupContextOnceDifferentiableCube], ids=lambda c: c.__name__
)
def test_reverse_over_reverse_through_a_once_differentiable_backward_is_refused_not_wrong(function, mode):
    # x**3 summed: the gradient reaching the backward is a constant, which
    # no autograd graph connects to x, but the backward reads x under
    # no_grad: the Hessian came out zero.
    loss = t2j_ad.jaxify(lambda x: function.apply(x).sum(), compile=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        assert_tree_allclose(jax.grad(loss)(X), jax.grad(lambda x: (x**3).sum())(X), rtol=1e-5)
        refusal = f"backward of {function.__name__}, but that backward is marked @once_differentiable"
        for transform in ("jacrev(grad)", "grad(grad @ v)"):
            with pytest.raises(Exception, match=refusal) as refused:
                jax.block_until_ready(REVERSE_OVER_REVERSE[transform](loss))
            assert "drop @once_differentiable if the backward is differentiable" in str(refused.value)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_the_gradient_in_the_cotangent_through_a_backward_that_drops_it_is_refused_not_zero(mode):
    # jax.vjp differentiated in its cotangent: linear, through the backward alone.
    f = t2j_ad.jaxify(lambda x: DetachedGradientSin.apply(x) ** 2, compile=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        with pytest.raises(Exception, match="backward of DetachedGradientSin, but that backward is not differentiable"):
            jax.block_until_ready(jax.grad(lambda c: jax.vjp(f, X)[1](c)[0] @ V)(V))


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize(
    "function", [NumpyBackwardSin, DetachedGradientSin, SetupContextOnceDifferentiableCube], ids=lambda c: c.__name__
)
def test_reverse_over_reverse_that_loses_nothing_through_such_a_backward_is_right(function, mode):
    # jax.jacrev in w of jax.grad in x: the gradient reaching the backward
    # depends on x alone, which the outer pass does not differentiate.
    reference = {
        NumpyBackwardSin: jnp.sin,
        DetachedGradientSin: jnp.sin,
        SetupContextOnceDifferentiableCube: lambda x: x**3,
    }
    f = t2j_ad.jaxify(lambda x, w: (function.apply(x) ** 2).sum() + (w * x**2).sum(), compile=mode)
    expected = lambda x, w: (reference[function](x) ** 2).sum() + (w * x**2).sum()  # noqa: E731
    w = V * 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        assert_tree_allclose(
            jax.jacrev(lambda w: jax.grad(f)(X, w))(w), jax.jacrev(lambda w: jax.grad(expected)(X, w))(w), rtol=1e-5
        )
        if function is DetachedGradientSin:
            # The gradient reaching the backward is a constant, and its part
            # through x is computed in torch ops: right.
            g = t2j_ad.jaxify(lambda x: function.apply(x).sum(), compile=mode)
            assert_tree_allclose(jax.jacrev(jax.grad(g))(X), jax.hessian(lambda x: jnp.sin(x).sum())(X), rtol=1e-5)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_reverse_over_reverse_through_a_differentiable_backward_with_zero_gradients_is_right(mode, x64):
    # A backward giving None for an input, an integer output, a gradient cut
    # by round: nothing is dropped, nothing is refused.
    f = t2j_ad.jaxify(sin_with_zero_gradients, compile=mode)
    x, scale = jnp.array([0.3, -1.2, 2.0]), jnp.array(1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        for out in (0, 2):
            for argnums in (0, 1, (0, 1)):
                loss = lambda g: lambda x, s: (g(x, s)[out] ** 2).sum() * s  # noqa: E731
                assert_tree_allclose(
                    jax.jacrev(jax.grad(loss(f), argnums), argnums)(x, scale),
                    jax.jacrev(jax.grad(loss(sin_with_zero_gradients_reference), argnums), argnums)(x, scale),
                    rtol=1e-12,
                )


# ------------------------------ forward over reverse through such a backward
# NOTE [a reverse pass differentiated in forward mode] in
# t2j_ad/rules/fallbacks.py. jax.hessian runs the reverse pass under
# torch.func.jvp, each backward on dual numbers: a Function's jvp
# staticmethod never applies to its backward, and one that drops its
# gradient lost the part of the second derivative through it, silently (as
# torch.func.hessian does).


class NumpyBackwardSinWithJvp(torch.autograd.Function):
    """sin with setup_context and a jvp, its backward in NumPy (torch.func.jvp
    cannot read its tensors: the double-vjp trick runs instead)."""

    @staticmethod
    def forward(x):
        return torch.sin(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.from_numpy(np.cos(to_numpy(x.detach())) * to_numpy(grad.detach())).to(x.device)

    @staticmethod
    def jvp(ctx, x_t):
        (x,) = ctx.saved_tensors
        return torch.cos(x) * x_t


class DetachedGradientDoubleWithJvp(torch.autograd.Function):
    """2x with a jvp, its backward ``grad.detach() * 2``: a result with no
    tangent at all."""

    @staticmethod
    def forward(x):
        return 2 * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad.detach() * 2

    @staticmethod
    def jvp(ctx, x_t):
        return 2 * x_t


DROPPING_BACKWARDS_WITH_A_JVP = {
    DetachedGradientSinWithJvp: jnp.sin,
    NumpyBackwardSinWithJvp: jnp.sin,
    DetachedGradientDoubleWithJvp: lambda x: 2 * x,
}

FORWARD_OVER_REVERSE = {
    "hessian": lambda loss: jax.hessian(loss)(X),
    "jacfwd(grad)": lambda loss: jax.jacfwd(jax.grad(loss))(X),
    "jvp(grad)": lambda loss: jax.jvp(jax.grad(loss), (X,), (V,))[1],
    "vmap(hessian)": lambda loss: jax.vmap(jax.hessian(loss))(X_BATCH),
    "jit(hessian)": lambda loss: jax.jit(jax.hessian(loss))(X),
}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("transform", list(FORWARD_OVER_REVERSE))
@pytest.mark.parametrize("function", list(DROPPING_BACKWARDS_WITH_A_JVP), ids=lambda c: c.__name__)
def test_forward_over_reverse_through_a_backward_that_drops_its_gradient_is_refused_not_wrong(
    function, transform, mode
):
    # (sin(x)**2).sum(): jax.hessian lost the 2 cos(x)**2 that goes through
    # sin's backward (torch.func.hessian loses it too), with no error.
    loss, reference_loss = _squared_losses(function, DROPPING_BACKWARDS_WITH_A_JVP[function], mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # the fallbacks, announced
        _first_order_agrees(loss, reference_loss)
        assert_tree_allclose(jax.jvp(loss, (X,), (V,)), jax.jvp(reference_loss, (X,), (V,)), rtol=1e-5)
        refusal = (
            f"forward mode over the reverse pass of .* backward of {function.__name__} "
            "is not differentiable in its incoming gradient"
        )
        with pytest.raises(Exception, match=refusal) as refused:
            jax.block_until_ready(FORWARD_OVER_REVERSE[transform](loss))
    assert "with differentiable torch ops on the incoming gradient" in str(refused.value)
    assert f"{function.__name__}'s jvp staticmethod does not help here" in str(refused.value)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_forward_over_reverse_in_a_gradient_scaled_by_another_input_through_such_a_backward_is_refused(mode):
    # The gradient reaching the backward is w, a closed-over input of the
    # inner reverse pass: d/dw of the gradient in x came out zero (no tangent
    # reaches the result), the mixed block of the full Hessian lost cos(x).
    f = t2j_ad.jaxify(lambda x, w: (DetachedGradientSinWithJvp.apply(x) * w).sum(), compile=mode)
    w = V * 3
    refusal = "backward of DetachedGradientSinWithJvp is not differentiable in its incoming gradient"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        with pytest.raises(Exception, match=refusal):
            jax.block_until_ready(jax.jacfwd(lambda w: jax.grad(f)(X, w))(w))
        with pytest.raises(Exception, match=refusal):
            jax.block_until_ready(jax.hessian(f, (0, 1))(X, w))


class SinWithUnusedInputAndJvp(SinWithUnusedInput):
    """SinWithUnusedInput with a jvp: forward mode over its reverse pass runs
    its backward on dual numbers, where None, an integer output and a
    gradient cut by round are nothing dropped."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def jvp(ctx, x_t, scale_t):
        (x,) = ctx.saved_tensors
        return torch.cos(x) * x_t, None


class ReluWithJvp(torch.autograd.Function):
    """relu, its backward ``g * (x > 0)``: a derivative that is truly zero
    in x, and linear in g."""

    @staticmethod
    def forward(x):
        return torch.relu(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x > 0)

    @staticmethod
    def jvp(ctx, x_t):
        (x,) = ctx.saved_tensors
        return x_t * (x > 0)


class NoGradBackwardSinWithJvp(DetachedGradientSinWithJvp):
    """sin with a jvp, its backward under ``@torch.no_grad()``: forward AD goes
    through no_grad, so forward mode over its reverse pass is right."""

    @staticmethod
    @torch.no_grad()
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.cos(x) * grad


def with_jvp_functions(x, w):
    """(sin(x)**2 through a differentiable backward) + relu(x)**3 + sin(x)**2
    through a no_grad backward, scaled by w, and sin_with_zero_gradients'
    outputs (a None gradient, an integer output, round) through
    SinWithUnusedInputAndJvp."""
    y, count = SinWithUnusedInputAndJvp.apply(x, w)
    rounded = torch.round(SinWithUnusedInputAndJvp.apply(x, w)[0] * 3)
    smooth = (y**2).sum() + (ReluWithJvp.apply(x) ** 3).sum() + (NoGradBackwardSinWithJvp.apply(x) ** 2 * w).sum()
    return smooth + (rounded * x).sum() + count.to(x.dtype) * 0


def with_jvp_functions_reference(x, w):
    y = jnp.sin(x)
    smooth = (y**2).sum() + (jnp.maximum(x, 0) ** 3).sum() + (jnp.sin(x) ** 2 * w).sum()
    return smooth + (jnp.round(y * 3) * x).sum() + (x > 0).sum().astype(x.dtype) * 0


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_forward_over_reverse_through_differentiable_backwards_with_a_jvp_is_right(mode, x64):
    # Nothing is dropped: no refusal, and every second derivative matches jax.numpy.
    f = t2j_ad.jaxify(with_jvp_functions, compile=mode)
    x, w = jnp.array([0.3, -1.2, 2.0]), jnp.array([1.5, -0.5, 0.25])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # the sequential loop, announced
        for argnums in (0, 1, (0, 1)):
            assert_tree_allclose(
                jax.hessian(f, argnums)(x, w), jax.hessian(with_jvp_functions_reference, argnums)(x, w), rtol=1e-12
            )
        assert_tree_allclose(
            jax.jvp(lambda x: jax.grad(f)(x, w), (x,), (V[:3].astype(x.dtype),)),
            jax.jvp(lambda x: jax.grad(with_jvp_functions_reference)(x, w), (x,), (V[:3].astype(x.dtype),)),
            rtol=1e-12,
        )
        xs = jnp.stack([x, x / 2 - 0.3])
        assert_tree_allclose(
            jax.jit(jax.vmap(jax.hessian(f), (0, None)))(xs, w),
            jax.vmap(jax.hessian(with_jvp_functions_reference), (0, None))(xs, w),
            rtol=1e-12,
        )


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_forward_over_reverse_that_loses_nothing_through_a_backward_that_drops_its_gradient_is_right(mode):
    # jax.jacfwd in w of jax.grad in x: the gradient reaching the backward
    # (2 sin(x)) carries no tangent in w, so nothing goes through it.
    f = t2j_ad.jaxify(lambda x, w: (DetachedGradientSinWithJvp.apply(x) ** 2).sum() + (w * x**2).sum(), compile=mode)
    expected = lambda x, w: (jnp.sin(x) ** 2).sum() + (w * x**2).sum()  # noqa: E731
    w = V * 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        assert_tree_allclose(
            jax.jacfwd(lambda w: jax.grad(f)(X, w))(w), jax.jacfwd(lambda w: jax.grad(expected)(X, w))(w), rtol=1e-5
        )
        # The gradient reaching the backward is a constant: its part through x is in torch ops.
        g = t2j_ad.jaxify(lambda x: DetachedGradientSinWithJvp.apply(x).sum(), compile=mode)
        assert_tree_allclose(jax.hessian(g)(X), jax.hessian(lambda x: jnp.sin(x).sum())(X), rtol=1e-5)


# ------------------------------- forward over forward through a jvp staticmethod
# NOTE [a jvp staticmethod under a second forward level] in
# t2j_ad/rules/forward_over_forward.py. PyTorch runs a Function's jvp
# staticmethod with forward AD off: jax.jacfwd(jax.jacfwd(f)) through it came
# out 0 where it is -sin(x), silently (torch.func.jacfwd(torch.func.jacfwd(f))
# too). The outer forward level now takes the double-vjp trick.


class SinWithJvp(NumpyBackwardSinWithJvp):
    """sin with a jvp staticmethod and a differentiable backward."""

    generate_vmap_rule = True

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.cos(x)


def _nested_jvps(f, order: int):
    """``jax.jvp`` of ``jax.jvp`` ... of ``f`` (``order`` of them) at X, each along V."""
    for _ in range(order):
        f = (lambda g: lambda x: jax.jvp(g, (x,), (V,))[1])(f)
    return f(X)


_X64 = np.asarray(X, np.float64)
_V64 = np.asarray(V, np.float64)
# Transforms of sin(x)**2 -> their values at X (along V), in closed form:
# its derivatives are sin(2x), 2 cos(2x), -4 sin(2x).
FORWARD_OVER_FORWARD = {
    "jacfwd(jacfwd)": (
        lambda f: jax.jacfwd(jax.jacfwd(f))(X),
        np.einsum("ij,ik,i->ijk", np.eye(4), np.eye(4), 2 * np.cos(2 * _X64)),
    ),
    "jvp(jvp(jvp))": (lambda f: _nested_jvps(f, 3), -4 * np.sin(2 * _X64) * _V64**3),
    "jvp(jvp(grad))": (
        lambda f: _nested_jvps(jax.grad(lambda x: f(x).sum()), 2),
        -4 * np.sin(2 * _X64) * _V64**2,
    ),
}


def test_forward_over_forward_through_a_jvp_staticmethod_is_right():
    f = t2j_ad.jaxify(lambda x: SinWithJvp.apply(x) ** 2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        # First order runs the jvp staticmethod as it did: no fallback.
        np.testing.assert_allclose(_nested_jvps(f, 1), np.sin(2 * _X64) * _V64, rtol=1e-5)
        assert fallback_warnings(record) == []
        for name, (transform, expected) in FORWARD_OVER_FORWARD.items():
            np.testing.assert_allclose(transform(f), expected, rtol=1e-5, atol=1e-6, err_msg=name)
    assert_warned_once(record, "over its forward mode", "jvp staticmethod of SinWithJvp", "Results are exact")


class DetachedGradientSinWithJvpAndVmap(SinWithJvp):
    """SinWithJvp, its backward computed from ``grad.detach()``."""

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad.detach() * torch.cos(x)


def test_forward_over_forward_through_a_jvp_staticmethod_whose_backward_drops_its_gradient_is_refused():
    # The double-vjp trick differentiates the backward in its gradient, which
    # grad.detach() cuts: refused, naming the cause. Reverse mode for the
    # outer order goes through the jvp staticmethod alone and is right.
    f = t2j_ad.jaxify(lambda x, w: DetachedGradientSinWithJvpAndVmap.apply(x) ** 2 * w)
    w = V * 3
    second = 2 * np.cos(2 * _X64) * np.asarray(w, np.float64)  # d2/dx2 of sin(x)**2 * w
    np.testing.assert_allclose(
        jax.jacrev(jax.jacfwd(f))(X, w), np.einsum("ij,ik,i->ijk", np.eye(4), np.eye(4), second), rtol=1e-5, atol=1e-6
    )
    # jax.jvp in w of jax.jvp in x: the Function's input has a layer of the
    # outer level (the inner jvp lifts it there) but no tangent in w, so
    # nothing is lost and nothing falls back (the first version did).
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        in_w = jax.jvp(lambda w: jax.jvp(lambda x: f(x, w), (X,), (V,))[1], (w,), (V,))[1]
    np.testing.assert_allclose(in_w, np.sin(2 * _X64) * _V64**2, rtol=1e-5, atol=1e-6)
    assert fallback_warnings(record) == []
    refusal = "over its forward mode .* jvp staticmethod of DetachedGradientSinWithJvpAndVmap"
    with pytest.raises(Exception, match=refusal) as refused:
        jax.block_until_ready(_nested_jvps(lambda x: f(x, w), 2))
    message = str(refused.value)
    assert "the backward of DetachedGradientSinWithJvpAndVmap is not differentiable in its incoming gradient" in message
    assert "Take the outer derivative in reverse mode (jax.jacrev(jax.jacfwd(f))" in message



class ForwardOnlySin(SinWithJvp):
    """SinWithJvp without its backward: PyTorch's own, which raises."""

    backward = staticmethod(torch.autograd.Function.backward)


def test_forward_over_forward_through_a_function_without_a_backward_is_refused_by_name():
    # First order runs the jvp staticmethod; the second forward level has no
    # reverse pass to take its derivative from: refused naming the Function,
    # where the first version raised PyTorch's internal errors.
    f = t2j_ad.jaxify(lambda x: ForwardOnlySin.apply(x) ** 2)
    np.testing.assert_allclose(_nested_jvps(f, 1), np.sin(2 * _X64) * _V64, rtol=1e-5)
    with pytest.raises(Exception, match="jvp staticmethod of ForwardOnlySin, .* ForwardOnlySin defines no backward"):
        jax.block_until_ready(_nested_jvps(f, 2))


# ------------------------------------------------------- NumpySort/NumpyTake
# From "Extending torch.func with autograd.Function", Example 1 with the vmap
# staticmethods of "Defining the vmap staticmethod". (The guide's second
# listing of NumpySort.backward uses ind/ind_inv without reading them from
# ctx.saved_tensors; the first listing's backward is used here.)


def to_numpy(tensor):
    return tensor.cpu().numpy()


class NumpySort(torch.autograd.Function):
    @staticmethod
    def forward(x, dim):
        device = x.device
        x = to_numpy(x)
        ind = np.argsort(x, axis=dim)
        ind_inv = np.argsort(ind, axis=dim)
        result = np.take_along_axis(x, ind, axis=dim)
        return (
            torch.tensor(result, device=device),
            torch.tensor(ind, device=device),
            torch.tensor(ind_inv, device=device),
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, dim = inputs
        _, ind, ind_inv = output
        ctx.mark_non_differentiable(ind, ind_inv)
        ctx.save_for_backward(ind, ind_inv)
        ctx.dim = dim

    @staticmethod
    def backward(ctx, grad_output, _0, _1):
        ind, ind_inv = ctx.saved_tensors
        return NumpyTake.apply(grad_output, ind_inv, ind, ctx.dim), None

    @staticmethod
    def vmap(info, in_dims, x, dim):
        x_bdim, _ = in_dims
        x = x.movedim(x_bdim, 0)
        dim = dim if dim >= 0 else dim + x.dim() - 1
        return NumpySort.apply(x, dim + 1), (0, 0, 0)


class NumpyTake(torch.autograd.Function):
    @staticmethod
    def forward(x, ind, ind_inv, dim):
        device = x.device
        x = to_numpy(x)
        ind = to_numpy(ind)
        return torch.tensor(np.take_along_axis(x, ind, dim), device=device)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ind, ind_inv, dim = inputs
        ctx.save_for_backward(ind, ind_inv)
        ctx.dim = dim

    @staticmethod
    def backward(ctx, grad_output):
        ind, ind_inv = ctx.saved_tensors
        result = NumpyTake.apply(grad_output, ind_inv, ind, ctx.dim)
        return result, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, ind, ind_inv, dim):
        x_bdim, ind_bdim, ind_inv_bdim, _ = in_dims
        logical_dim = x.dim() if x_bdim is None else x_bdim - 1
        dim = dim if dim >= 0 else dim + logical_dim

        def maybe_expand_bdim_at_front(x, x_bdim):
            if x_bdim is None:
                return x.expand(info.batch_size, *x.shape)
            return x.movedim(x_bdim, 0)

        x = maybe_expand_bdim_at_front(x, x_bdim)
        ind = maybe_expand_bdim_at_front(ind, ind_bdim)
        ind_inv = maybe_expand_bdim_at_front(ind_inv, ind_inv_bdim)
        return NumpyTake.apply(x, ind, ind_inv, dim + 1), 0


def numpy_sort(x, dim=-1):
    result, _, _ = NumpySort.apply(x, dim)
    return result


def _sort_loss(f):
    # Nonlinear around the sort, so second derivatives are not all zero.
    weights = jnp.arange(1.0, 1.0 + X.size, dtype=jnp.float32).reshape(X.shape)
    return lambda x: jnp.sum(weights * f(x) ** 3)


def test_numpy_sort_sanity_check_of_the_guide():
    x = torch.randn(2, 3)
    grad_x = torch.func.grad(lambda x: numpy_sort(x).sum())(x)
    assert torch.allclose(grad_x, torch.ones_like(x))
    assert torch.allclose(torch.vmap(numpy_sort)(x), numpy_sort(x, 1))


def test_numpy_sort_grad_and_second_order():
    f = t2j_ad.jaxify(numpy_sort)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        check(
            {
                "grad": lambda f: jax.grad(_sort_loss(f)),
                "grad_of_grad": lambda f: _grad_of_grad(_sort_loss(f)),
                "hessian": lambda f: jax.hessian(_sort_loss(f)),
                "hvp": lambda f: lambda x: jax.jvp(jax.grad(_sort_loss(f)), (x,), (V,))[1],
                "jacrev": jax.jacrev,
            },
            f,
            jnp.sort,
            X,
        )
    # NumpySort has no jvp: second order runs the double-vjp trick, under
    # torch.vmap through the guide's vmap staticmethods (no sequential loop).
    assert_warned_once(record, "numpy_sort", "double-vjp", "You must implement the jvp function")
    assert not [m for m in fallback_warnings(record) if "sequential" in m]


def test_numpy_sort_along_an_axis_of_a_matrix():
    f = t2j_ad.jaxify(lambda x: numpy_sort(x, 1) * torch.tanh(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        check(
            {
                "grad": lambda f: jax.grad(lambda x: jnp.sum(f(x) ** 2)),
                "hessian": lambda f: jax.hessian(lambda x: jnp.sum(f(x) ** 2)),
                "vmap_grad": lambda f: jax.vmap(jax.grad(lambda x: jnp.sum(f(x[None]) ** 2))),
            },
            f,
            lambda x: jnp.sort(x, axis=1) * jnp.tanh(x),
            X2,
        )


# ------------------------------------------------- reading a tensor's data
# Code that reads a tensor's memory (.numpy() of its input, for a constant)
# works eagerly but not inside torch.func, whose wrapper tensors have no
# storage. Reverse mode falls back to torch.autograd.grad, forward mode to
# the double-vjp trick on top of it; the NumPy value is a constant to both.


def _scaled_by_numpy(x: torch.Tensor) -> torch.Tensor:
    scale = torch.from_numpy(np.cos(x.detach().cpu().numpy())).to(x.device)
    return (x * scale).sum()


def _scaled_jax(x: jax.Array) -> jax.Array:
    return (x * jax.lax.stop_gradient(jnp.cos(x))).sum()


def test_function_reading_numpy_differentiates():
    f = t2j_ad.jaxify(_scaled_by_numpy)
    transforms = [("grad", jax.grad), ("jacfwd", jax.jacfwd), ("hessian", jax.hessian)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        check(transforms, f, _scaled_jax, X)
        batch = jnp.stack([X, V])
        assert_tree_allclose(jax.vmap(jax.grad(f))(batch), jax.vmap(jax.grad(_scaled_jax))(batch))
    assert_warned_once(record, "reverse mode of '_scaled_by_numpy'", "doesn't have storage", ".numpy()")
    assert_warned_once(record, "forward mode of '_scaled_by_numpy'", "doesn't have storage")


def test_torch_utils_checkpoint_inside_falls_back_to_autograd_and_matches_it(x64):
    """torch.utils.checkpoint(use_reentrant=False) sets saved-tensor hooks,
    which torch.func refuses: every reverse-mode transform failed."""
    import torch.utils.checkpoint as checkpoint

    def body(z):
        return torch.tanh(z) * z.exp()

    def loss(x):
        return (checkpoint.checkpoint(body, x, use_reentrant=False) ** 2).sum()

    x = jnp.array([0.3, -1.2, 0.7])
    f = t2j_ad.jaxify(loss)
    with pytest.warns(t2j_ad.FallbackWarning, match="saved-tensor hooks"):
        grad = jax.grad(f)(x)
    tx = torch.tensor([0.3, -1.2, 0.7], dtype=torch.float64)
    np.testing.assert_allclose(grad, torch.func.grad(lambda x: (body(x) ** 2).sum())(tx).numpy(), rtol=1e-12)
    np.testing.assert_allclose(
        jax.hessian(f)(x), torch.autograd.functional.hessian(lambda x: (body(x) ** 2).sum(), tx).numpy(), rtol=1e-10
    )


def test_a_gradient_penalty_on_closed_over_parameters_falls_back_to_autograd_and_matches_it(x64):
    """torch.autograd.grad inside the function with respect to a module's
    parameters it closes over: under torch.func their uses are wrapped, so
    every transform failed ("appears to not have been used in the graph",
    and in forward mode "does not require grad"); plain autograd runs it."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2).double().to(TORCH_DEVICE)

    def penalized(x):
        y = (net(x) ** 2).sum()
        grads = torch.autograd.grad(y, list(net.parameters()), create_graph=True)
        return sum((g**2).sum() for g in grads)

    x = jnp.array([0.3, -1.2, 0.7])
    f = t2j_ad.jaxify(penalized)
    tx = to_torch(x).requires_grad_()
    (expected_grad,) = torch.autograd.grad(penalized(tx), tx)
    expected_hessian = torch.autograd.functional.hessian(penalized, to_torch(x), create_graph=True).detach()
    expected_grad = expected_grad.detach()
    with pytest.warns(t2j_ad.FallbackWarning, match="torch.autograd.grad with respect to tensors it closes over"):
        grad = jax.grad(f)(x)
    np.testing.assert_allclose(grad, to_numpy(expected_grad), rtol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", t2j_ad.FallbackWarning)
        np.testing.assert_allclose(jax.jacfwd(f)(x), to_numpy(expected_grad), rtol=1e-12)
        np.testing.assert_allclose(jax.hessian(f)(x), to_numpy(expected_hessian), rtol=1e-10, atol=1e-12)


def test_an_op_without_a_forward_mode_formula_gets_forward_mode_by_double_vjp(x64):
    """grid_sample has a backward but no forward-mode formula: jax.jacfwd and
    jax.hessian (forward over reverse) failed where jax.jacrev worked."""
    image = torch.randn(1, 1, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(TORCH_DEVICE)

    def warped(theta):
        grid = torch.nn.functional.affine_grid(theta.reshape(1, 2, 3), (1, 1, 4, 4), align_corners=False)
        return torch.nn.functional.grid_sample(image, grid, align_corners=False).pow(2).mean()

    theta = jnp.array([1.0, 0.1, 0.05, -0.1, 0.9, 0.02])
    f = t2j_ad.jaxify(warped)
    # Plain autograd's double backward: torch 2.11's torch.func.jacrev of
    # jacrev fails in grid_sampler_2d_backward's batching rule.
    try:
        expected = torch.autograd.functional.hessian(warped, to_torch(theta))
    except RuntimeError as err:
        if "grid_sampler_2d_backward is not implemented" not in str(err):
            raise
        # This PyTorch (2.11, on the CPU and on CUDA) has no derivative of
        # grid_sample's backward, which the double vjp needs: its own error,
        # never zeros. On a GPU the error comes when the result is waited on.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", t2j_ad.FallbackWarning)
            for derivative in (jax.hessian, jax.jacfwd):
                with pytest.raises(Exception, match="grid_sampler_2d_backward is not implemented"):
                    jax.block_until_ready(derivative(f)(theta))
        return
    with pytest.warns(t2j_ad.FallbackWarning, match="no forward-mode formula"):
        hessian = jax.hessian(f)(theta)
    np.testing.assert_allclose(hessian, to_numpy(expected), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(jax.jacfwd(f)(theta), to_numpy(torch.func.grad(warped)(to_torch(theta))), rtol=1e-10)


def test_no_forward_formula_of_a_sparse_constructor_stays_an_error(x64):
    """PyTorch's double backward through sparse_coo_tensor is silently zero,
    so the double-vjp trick would give zero tangents: PyTorch's error stands
    (torch 2.13 on the CPU, 2.11 on CUDA, where it comes when the result is
    waited on). A PyTorch whose jvp goes through gives the true Jacobian;
    never zeros."""
    index = torch.tensor([[0, 1, 2], [1, 0, 2]])

    def f(x):
        dense = torch.sparse_coo_tensor(index.to(x.device), x[:3], (3, 3)).to_dense()
        return (dense @ torch.arange(3.0, dtype=x.dtype, device=x.device)).pow(2).sum() * x[3]

    x = jnp.array([1.0, 0.1, 0.5, 2.0])
    jf = t2j_ad.jaxify(f)
    np.testing.assert_allclose(jax.grad(jf)(x), jax.grad(lambda x: (x[0] ** 2 + 4 * x[2] ** 2) * x[3])(x))
    try:
        jacobian = jax.block_until_ready(jax.jacfwd(jf)(x))
    except Exception as err:  # noqa: BLE001 - PyTorch's own refusal, checked below
        assert "Trying to use forward AD with _sparse_coo_tensor" in str(err), err
    else:
        np.testing.assert_allclose(jacobian, jax.jacfwd(lambda x: (x[0] ** 2 + 4 * x[2] ** 2) * x[3])(x), rtol=1e-12)


def test_no_forward_formula_of_weight_norm_stays_an_error(x64):
    """parametrizations.weight_norm runs _weight_norm_interface, whose double
    backward PyTorch gets wrong with respect to the direction v: the
    double-vjp trick gave a Hessian-vector product off by 5 - 8, under a
    warning that said "Results are exact". PyTorch's refusal stands."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    module = weight_norm(torch.nn.Linear(4, 3).double()).to(TORCH_DEVICE)
    apply, params = t2j_ad.jaxify_module(module)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4)))

    def reference(p):  # the same math in jax.numpy: w = g * v / |v| by rows
        v, g = p["parametrizations.weight.original1"], p["parametrizations.weight.original0"]
        return jnp.sum(jnp.tanh(x @ (g * v / jnp.linalg.norm(v, axis=1, keepdims=True)).T + p["bias"]) ** 2)

    def torch_loss(p):  # the same module in PyTorch, on the same device: the same kernels
        return (torch.tanh(torch.func.functional_call(module, p, (to_torch(x),))) ** 2).sum()

    loss = lambda p: jnp.sum(jnp.tanh(apply(p, x)) ** 2)  # noqa: E731
    grad = jax.grad(loss)(params)
    expected = torch.func.grad(torch_loss)({k: to_torch(v) for k, v in params.items()})
    assert_tree_allclose(grad, {k: jnp.asarray(to_numpy(v)) for k, v in expected.items()}, rtol=1e-10, atol=1e-12)
    # PyTorch's CUDA kernel of _weight_norm_interface takes the norm's square
    # root in float32 (sqrtf), for float64 too: off jax.numpy's by about 1e-7.
    rtol, atol = (1e-6, 1e-6) if ON_GPU else (1e-10, 1e-12)
    assert_tree_allclose(grad, jax.grad(reference)(params), rtol=rtol, atol=atol)
    with pytest.raises(Exception, match="Trying to use forward AD with _weight_norm_interface"):
        jax.block_until_ready(jax.jvp(jax.grad(loss), (params,), (jax.tree.map(jnp.ones_like, params),)))


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_forward_ad_used_inside_the_function_gets_forward_mode_by_double_vjp(mode, x64):
    """torch.autograd.forward_ad inside the function (a tangent computed by
    PyTorch's own dual numbers): jax.jacfwd and jax.hessian failed with
    "Nested forward mode AD is not supported", as torch.func.jacfwd does,
    though reverse over reverse works."""
    import torch.autograd.forward_ad as forward_ad

    def f(x):
        with forward_ad.dual_level():
            value, tangent = forward_ad.unpack_dual(torch.sin(forward_ad.make_dual(x, torch.ones_like(x))))
        return (tangent * value).sum()

    def reference(x):
        return (jnp.cos(x) * jnp.sin(x)).sum()

    x = jnp.array([0.3, -1.2, 2.0])
    jf = t2j_ad.jaxify(f, compile=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", t2j_ad.FallbackWarning)
        np.testing.assert_allclose(jax.jacfwd(jf)(x), jax.grad(reference)(x), rtol=1e-12)
        np.testing.assert_allclose(jax.hessian(jf)(x), jax.hessian(reference)(x), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_forward_ad_inside_the_function_over_a_closed_over_tensor(mode, x64):
    """torch.func.jvp (or dual numbers) inside the function, of an expression
    with a closed-over tensor: every call failed at shape inference ("access
    the data pointer on an invalid python storage"), because the closed-over
    tensor's tangent is a zero tensor without a storage and the look for state
    writes read its address (tenth fuzzing pass)."""
    import torch.autograd.forward_ad as forward_ad

    c = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, device=TORCH_DEVICE)

    def by_jvp(x):
        return torch.func.jvp(lambda r: torch.sin(r) * c, (x,), (x,))[1]

    def by_duals(x):
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(x, torch.ones_like(x))
            return forward_ad.unpack_dual(torch.sin(dual) * c).tangent

    cj = jnp.asarray(to_numpy(c))
    references = {by_jvp: lambda x: jnp.cos(x) * x * cj, by_duals: lambda x: jnp.cos(x) * cj}
    x = jnp.array([0.3, -1.2, 2.0])
    batch = jnp.stack([x, 2 * x])
    for fn, reference in references.items():
        jf = t2j_ad.jaxify(fn, compile=mode)
        np.testing.assert_allclose(jf(x), to_numpy(fn(to_torch(x))), rtol=1e-12)
        loss = lambda x, jf=jf: jf(x).sum()  # noqa: E731
        np.testing.assert_allclose(jax.grad(loss)(x), jax.grad(lambda x: reference(x).sum())(x), rtol=1e-12)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", t2j_ad.FallbackWarning)  # torch.vmap has no rule for make_dual
            np.testing.assert_allclose(jax.vmap(jf)(batch), jax.vmap(reference)(batch), rtol=1e-12)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_requires_grad_flag_set_on_an_input_does_not_reach_the_next_run(mode, x64):
    """The PyTorch idiom of a residual by torch.autograd.grad (a PINN's u_x):
    set requires_grad on the input unless it is set. The double-vjp fallback
    runs the function more than once on the same closed-over input, and the
    first run's flag skipped, in the next, the call that makes torch.func
    refuse the function: jax.hessian failed inside PyTorch ("appears to not
    have been used in the graph")."""

    def f(w, x):
        x = x if x.requires_grad else x.requires_grad_(True)
        u = torch.tanh(x * w).sum()
        return (torch.autograd.grad(u, x, create_graph=True)[0] ** 2).sum()

    def reference(w, x):
        return (jax.grad(lambda x: jnp.tanh(x * w).sum())(x) ** 2).sum()

    jf = t2j_ad.jaxify(f, compile=mode)
    w, x, v = jnp.array([0.7, -0.3]), jnp.array([0.5, 1.5]), jnp.array([1.0, -2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", t2j_ad.FallbackWarning)
        np.testing.assert_allclose(jax.hessian(jf)(w, x), jax.hessian(reference)(w, x), rtol=1e-12)
        hvp = jax.jvp(jax.grad(lambda w: jf(w, x)), (w,), (v,))[1]
        np.testing.assert_allclose(hvp, jax.jvp(jax.grad(lambda w: reference(w, x)), (w,), (v,))[1], rtol=1e-12)


class _OldStyleDouble(torch.autograd.Function):
    """An old-style Function (no setup_context): torch.func refuses it."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def test_forward_mode_over_the_reverse_fallback_names_that_fallback():
    # The warning blamed Tensor.requires_grad_(), which the user's code never
    # calls: t2j_ad's own torch.autograd.grad fallback does.
    f = t2j_ad.jaxify(lambda x: (_OldStyleDouble.apply(x) ** 3).sum())
    x = jnp.arange(1.0, 4.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", FallbackWarning)
        jax.jit(jax.grad(f))(x)
        hessian = jax.jit(jax.hessian(f))(x)
    # As torch.autograd's double backward: the doubling backward on both passes.
    t = torch.arange(1.0, 4.0, requires_grad=True)
    (g,) = torch.autograd.grad((_OldStyleDouble.apply(t) ** 3).sum(), t, create_graph=True)
    expected = torch.stack([torch.autograd.grad(g[i], t, retain_graph=True)[0] for i in range(3)])
    assert_tree_allclose(hessian, to_numpy(expected), rtol=1e-6)
    forward = [str(w.message) for w in seen if "forward mode" in str(w.message)]
    assert forward and all("reverse pass runs on torch.autograd.grad" in m for m in forward)
    assert not any("requires_grad_" in m for m in forward)
