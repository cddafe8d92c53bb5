"""Properties that need no reference implementation, checked on the jaxify'd
PyTorch version of every pair (wrapped in at most one transform drawn at
random, so the properties also hold for derivatives and batches):

- ``vmap(f)(X)`` equals stacking ``f(x)`` over the batch;
- jvp/vjp duality: ``<vjp(u), t> == <u, jvp(t)>``;
- the Hessian is symmetric;
- the vmap methods (sequential, expand_dims, broadcast_all, auto) agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import TOLERANCES, assert_tree_allclose
from hypothesis import given, settings
from hypothesis import strategies as st
from pairs import torch_version
from strategies import (
    Case,
    apply_stack,
    cases,
    derivative_order,
    note_reproduction,
    project,
    transformed,
    vmap_methods_for,
)

# Each property samples the pair too, so it gets a few examples per pair.
EXAMPLES = 2 * settings.default.max_examples


def _tolerance(case: Case, extra_order: int = 0) -> float:
    """Same implementation on both sides: only rounding differs, growing a
    little with the derivative order."""
    base = TOLERANCES[case.dtype][0]
    return base * 4 ** (derivative_order(case.stack) + extra_order)


def _random_like(rng: np.random.Generator, x: jax.Array) -> jax.Array:
    return jnp.asarray(rng.standard_normal(x.shape), dtype=x.dtype)


@settings(max_examples=EXAMPLES)
@given(case=cases(min_len=0, max_len=1, max_order=1, outer_vmap=True))
def test_vmap_equals_stacked_rows(case: Case) -> None:
    note_reproduction()
    *inner, vmap = case.stack
    with jax.enable_x64(case.dtype == "float64"):
        f = jax.jit(transformed(torch_version(case.pair, case.vmap_method), tuple(inner)))
        args = tuple(jnp.asarray(a) for a in case.args)
        batched = jax.jit(jax.vmap(f, in_axes=vmap.in_axes))(*args)
        rows = [
            f(*(a if axis is None else jnp.take(a, i, axis=axis) for a, axis in zip(args, vmap.in_axes)))
            for i in range(vmap.size)
        ]
        stacked = jax.tree_util.tree_map(lambda *r: jnp.stack(r), *rows)
        tol = _tolerance(case)
        assert_tree_allclose(batched, stacked, rtol=tol, atol=tol)


@settings(max_examples=EXAMPLES)
@given(case=cases(min_len=0, max_len=1, max_order=1, extra_order=1), argpick=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_jvp_vjp_duality(case: Case, argpick: int, seed: int) -> None:
    note_reproduction()
    k = case.pair.float_args[argpick % len(case.pair.float_args)]
    rng = np.random.default_rng(seed)
    with jax.enable_x64(case.dtype == "float64"):
        f = transformed(torch_version(case.pair, case.vmap_method), case.stack)
        args = tuple(jnp.asarray(a) for a in case.args)

        def of_k(x):
            return f(*args[:k], x, *args[k + 1 :])

        t = _random_like(rng, args[k])
        out_shapes = jax.eval_shape(of_k, args[k])
        u = jax.tree_util.tree_map(lambda o: _random_like(rng, o), out_shapes)

        @jax.jit
        def both_sides(x, t, u):
            _, pushed = jax.jvp(of_k, (x,), (t,))
            (pulled,) = jax.vjp(of_k, x)[1](u)
            lhs = jnp.vdot(pulled, t)
            rhs = sum(jnp.vdot(a, b) for a, b in zip(jax.tree_util.tree_leaves(u), jax.tree_util.tree_leaves(pushed)))
            return lhs, rhs

        lhs, rhs = both_sides(args[k], t, u)
        scale = 1.0 + float(jnp.abs(lhs))
        tol = _tolerance(case, extra_order=1) * 10
        np.testing.assert_allclose(float(lhs) / scale, float(rhs) / scale, rtol=0, atol=tol)


@settings(max_examples=EXAMPLES)
@given(case=cases(min_len=0, max_len=1, max_order=1, extra_order=2), argpick=st.integers(0, 2))
def test_hessian_is_symmetric(case: Case, argpick: int) -> None:
    note_reproduction()
    k = case.pair.float_args[argpick % len(case.pair.float_args)]
    with jax.enable_x64(case.dtype == "float64"):
        f = transformed(torch_version(case.pair, case.vmap_method), case.stack)
        args = tuple(jnp.asarray(a) for a in case.args)
        hessian = jax.jit(jax.hessian(lambda *a: project(f(*a)), argnums=k))(*args)
        n = args[k].size
        matrix = np.asarray(hessian).reshape(n, n)
        tol = _tolerance(case, extra_order=2)
        np.testing.assert_allclose(matrix, matrix.T, rtol=tol, atol=tol)


@settings(max_examples=EXAMPLES)
@given(case=cases(min_len=0, max_len=1, max_order=1, outer_vmap=True))
def test_vmap_methods_agree(case: Case) -> None:
    note_reproduction()
    with jax.enable_x64(case.dtype == "float64"):
        args = tuple(jnp.asarray(a) for a in case.args)
        methods = vmap_methods_for(case.pair, case.stack)
        results = {m: jax.jit(apply_stack(torch_version(case.pair, m), case.stack))(*args) for m in methods}
        tol = _tolerance(case)
        for method in methods:
            assert_tree_allclose(results[method], results["sequential"], rtol=tol, atol=tol)
