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


def test_concurrent_forward_mode_calls_do_not_share_levels():
    """PyTorch's forward-AD levels are process-wide. XLA runs one custom call
    per device on its own thread (sharded jit, pmap), and jitted calls from
    several Python threads run concurrently too: two torch.func.jvp calls at
    once left tangents zero or raised "no level exists". Found by the
    per-example Hessian test on 4 devices; NOTE [forward AD is process-wide]."""
    import threading

    f = t2j_ad.jaxify(lambda w, x: torch.tanh(x @ w) ** 2)
    x = jnp.sin(jnp.arange(24.0, dtype=jnp.float32).reshape(8, 3))
    w = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)
    hessians = jax.jit(jax.vmap(jax.hessian(f), (None, 0)))
    expected = jax.vmap(jax.hessian(lambda w, x: jnp.tanh(x @ w) ** 2), (None, 0))(w, x)
    results, errors = [], []

    def run():
        try:
            results.extend(np.asarray(hessians(w, x)) for _ in range(5))
        except Exception as err:  # reported below, with the others
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(results) == 20
    for r in results:
        assert_tree_allclose(r, np.asarray(expected), rtol=1e-4, atol=1e-5)
