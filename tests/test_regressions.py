"""Regression tests for engine bugs found by the property suite
(tests/property/). Each test is named after the bug it pins down and checks
the result against pure JAX on the same math."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from conftest import assert_tree_allclose

import t2j_ad


def _t_solve(a, b):
    return torch.linalg.solve(a + 3 * torch.eye(a.shape[-1], dtype=a.dtype), b)


def _j_solve(a, b):
    return jnp.linalg.solve(a + 3 * jnp.eye(a.shape[-1], dtype=a.dtype), b)


def test_jvp_of_vjp_under_no_grad_dropped_saved_tangents():
    """runtime.run_into ran every PyTorch call under torch.no_grad(). For
    torch.func.jvp over torch.func.vjp that silently drops the tangents of
    tensors the vjp saved, so forward-over-reverse (jax.hessian, jacfwd of
    grad) of linalg.solve lost one term of the product rule: half the value
    at a = 0, and an asymmetric Hessian. Found by test_hessian_is_symmetric."""
    a = jnp.zeros((3, 3), jnp.float32)
    b = jnp.ones(3, jnp.float32)
    w = jnp.array([1.0, 2.0, 3.0], jnp.float32)
    ours = t2j_ad.jaxify(_t_solve)

    def loss(solve):
        return lambda a: jnp.sum(solve(a, b) * w)

    tangent = jnp.eye(3, dtype=jnp.float32)
    assert_tree_allclose(
        jax.jvp(jax.grad(loss(ours)), (a,), (tangent,)),
        jax.jvp(jax.grad(loss(_j_solve)), (a,), (tangent,)),
    )
    hessian = jax.hessian(loss(ours))(a)
    assert_tree_allclose(hessian, jax.hessian(loss(_j_solve))(a))
    matrix = np.asarray(hessian).reshape(9, 9)
    np.testing.assert_allclose(matrix, matrix.T, rtol=1e-5, atol=1e-6)
