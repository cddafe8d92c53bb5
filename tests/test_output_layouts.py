"""What a PyTorch function returns, laid out any way PyTorch allows (strided,
expanded, aliasing its input or another output, 0-d, empty, mixed dtypes),
comes back as the same values plainly, under grad and under vmap as jax.numpy gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from conftest import assert_tree_allclose

import t2j_ad


def _torch_layouts(t):
    y = t.exp()
    return {
        "transposed": y.T,
        "expanded": t.sum(0, keepdim=True).expand(4, 3),
        "stepped": y[::2, ::2],
        "as_strided": (t * 1).as_strided((2, 2), (1, 3), 1),
        "input": t,
        "input_view": t[:, 1],
        "twice": (y, y),
        "zero_d": y.sum(),
        "empty": t[:0] * 2,
        "counts": (t > 0).sum(1),
    }


def _jax_layouts(a):
    y = jnp.exp(a)
    return {
        "transposed": y.T,
        "expanded": jnp.broadcast_to(a.sum(0, keepdims=True), (4, 3)),
        "stepped": y[::2, ::2],
        "as_strided": (a.ravel()[jnp.array([[1, 4], [2, 5]])]),
        "input": a,
        "input_view": a[:, 1],
        "twice": (y, y),
        "zero_d": y.sum(),
        "empty": a[:0] * 2,
        "counts": (a > 0).sum(1).astype(jnp.int32),
    }


def test_strided_aliased_and_mixed_outputs_under_grad_and_vmap():
    f = t2j_ad.jaxify(lambda t: {k: (v.int() if k == "counts" else v) for k, v in _torch_layouts(t).items()})
    x = jnp.linspace(-1.0, 1.0, 9).reshape(3, 3)

    def loss(g):
        def scalar(a):
            leaves = [v for v in jax.tree_util.tree_leaves(g(a)) if jnp.issubdtype(v.dtype, jnp.floating)]
            return sum(jnp.sum(jnp.sin(v) * (i + 1)) for i, v in enumerate(leaves))

        return scalar

    # The references jitted: op by op, JAX compiles each of their many ops.
    assert_tree_allclose(f(x), jax.jit(_jax_layouts)(x))
    assert_tree_allclose(jax.jit(jax.grad(loss(f)))(x), jax.jit(jax.grad(loss(_jax_layouts)))(x))
    xs = jnp.stack([x, 0.5 - x])
    assert_tree_allclose(jax.vmap(f)(xs), jax.jit(jax.vmap(_jax_layouts))(xs))


def test_output_shapes_declaring_a_list_for_a_returned_tuple_names_the_kind():
    """output_shapes=[a, b] for ``return a, b``: refused as JAX's pure_callback
    refuses a result structure other than the declared one, with a message
    that says the two differ only in lists against tuples."""
    sds = jax.ShapeDtypeStruct((3,), jnp.float32)
    f = t2j_ad.jaxify(lambda x: (x, x * 2), output_shapes=[sds, sds])
    with pytest.raises(Exception, match="differ only in lists against tuples"):
        f(jnp.ones(3))
    g = t2j_ad.jaxify(lambda x: (x, x * 2), output_shapes=(sds, sds))
    assert_tree_allclose(g(jnp.ones(3)), (jnp.ones(3), 2 * jnp.ones(3)))
    h = t2j_ad.jaxify(lambda x: {"a": x}, output_shapes={"b": sds})  # another structure: no such hint
    with pytest.raises(Exception, match="was expected") as info:
        h(jnp.ones(3))
    assert "lists against tuples" not in str(info.value)
