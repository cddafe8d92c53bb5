"""Taylor mode: ``jax.experimental.jet`` of jaxify'd functions (NOTE [jet by
nested JVPs] in t2j_ad/rules/jet.py), held against ``jet`` of the same math
in pure JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import assert_tree_allclose
from jax.experimental.jet import jet

import t2j_ad


def _t_two_outputs(x, y):
    return torch.sin(x) * torch.exp(y), (x * y).sum()


def _j_two_outputs(x, y):
    return jnp.sin(x) * jnp.exp(y), (x * y).sum()


def _series(x, order, salt=0.0):
    """``order`` fixed, distinct coefficients shaped like ``x``."""
    return tuple(jnp.cos(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) * (1.3 + k) + salt) for k in range(order))


X = jnp.linspace(0.1, 1.0, 5)
Y = jnp.linspace(-1.0, 0.5, 5)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_series_match_pure_jax(order, jit):
    f = t2j_ad.jaxify(_t_two_outputs)
    series = (_series(X, order), _series(Y, order, salt=0.5))

    def taylor(fn):
        run = lambda x, y: jet(fn, (x, y), series)  # noqa: E731
        return (jax.jit(run) if jit else run)(X, Y)

    assert_tree_allclose(taylor(f), taylor(_j_two_outputs), rtol=1e-5 * 4**order, atol=1e-5 * 4**order)


def test_order_one_is_the_jvp():
    f = t2j_ad.jaxify(_t_two_outputs)
    t = (jnp.ones_like(X), X)
    outs, series = jet(f, (X, Y), ((t[0],), (t[1],)))
    primal, tangent = jax.jvp(f, (X, Y), t)
    assert_tree_allclose(outs, primal)
    assert_tree_allclose([terms[0] for terms in series], list(tangent))


def test_one_call_per_order_under_jit():
    # Nested JVPs bind the lower orders more than once; jit keeps one of each.
    f = t2j_ad.jaxify(lambda x: torch.tanh(x) * x)
    for order in (1, 3):
        text = jax.jit(lambda x: jet(f, (x,), (_series(x, order),))).lower(X).as_text()
        assert text.count("custom_call") == order + 1, text


def test_integer_inputs_stay_fixed_and_integer_outputs_get_no_series():
    f = t2j_ad.jaxify(lambda x, n: (x**3 * n, n + 1))
    n = jnp.arange(5, dtype=jnp.int32)
    (value, count), (value_series, count_series) = jet(lambda x: f(x, n), (X,), (_series(X, 3),))
    ref_value, ref_series = jet(lambda x: x**3 * n, (X,), (_series(X, 3),))
    assert_tree_allclose(value, ref_value)
    assert_tree_allclose(value_series, ref_series)
    np.testing.assert_array_equal(count, n + 1)
    for term in count_series:
        np.testing.assert_array_equal(term, jnp.zeros_like(n))


def test_float64(x64):
    f = t2j_ad.jaxify(_t_two_outputs)
    x, y = X.astype(jnp.float64), Y.astype(jnp.float64)
    series = (_series(x, 3), _series(y, 3))
    assert_tree_allclose(jet(f, (x, y), series), jet(_j_two_outputs, (x, y), series))


def test_composes_with_grad_and_vmap():
    f = t2j_ad.jaxify(_t_two_outputs)

    def second_coefficient(fn):
        return lambda x: jet(lambda x: fn(x, Y)[0], (x,), (_series(x, 2),))[1][1].sum()

    xs = jnp.stack([X, X + 0.5, X - 0.3])
    for transform in (jax.grad, lambda g: jax.vmap(g), lambda g: jax.jit(jax.vmap(jax.grad(g)))):
        got = transform(second_coefficient(f))(xs if transform is not jax.grad else X)
        want = transform(second_coefficient(_j_two_outputs))(xs if transform is not jax.grad else X)
        assert_tree_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_jet_of_vmap_and_of_grad():
    f = t2j_ad.jaxify(lambda x: torch.sin(x) * x**2)
    g = lambda x: jnp.sin(x) * x**2  # noqa: E731
    xs = jnp.stack([X, X + 0.5])
    series = (_series(xs, 3),)
    assert_tree_allclose(jet(jax.vmap(f), (xs,), series), jet(jax.vmap(g), (xs,), series), rtol=1e-4, atol=1e-4)
    grad_f = jax.grad(lambda x: f(x).sum())
    grad_g = jax.grad(lambda x: g(x).sum())
    series = (_series(X, 2),)
    assert_tree_allclose(jet(grad_f, (X,), series), jet(grad_g, (X,), series), rtol=1e-4, atol=1e-4)


def test_module_parameters_and_inputs():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    apply, params = t2j_ad.jaxify_module(net)
    w1, b1 = params["0.weight"], params["0.bias"]
    w2, b2 = params["2.weight"], params["2.bias"]

    def reference(x):
        return jnp.tanh(x @ w1.T + b1) @ w2.T + b2

    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    series = (_series(x, 3),)
    got = jet(lambda x: apply(params, x), (x,), series)
    assert_tree_allclose(got, jet(reference, (x,), series), rtol=1e-4, atol=1e-4)
