"""JAX compositions around a jaxified call: vmap's batch axes, control flow,
checkpointing and custom rules, each held against the same math in jax.numpy."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import assert_tree_allclose

import t2j_ad

METHODS = ["auto", "expand_dims", "broadcast_all", "sequential"]


# NOTE [each example laid out as an unbatched input] in t2j_ad/rules/batching.py


@pytest.mark.parametrize("method", METHODS)
def test_an_example_batched_on_another_axis_is_laid_out_as_an_unbatched_input(method):
    # Windows by as_strided with row-major strides: right for every unbatched
    # call (JAX hands PyTorch row-major buffers); under vmap(in_axes=1) each
    # example was a strided view, and the windows read other examples' entries.
    windows = t2j_ad.jaxify(lambda t: t.as_strided((3, 2), (1, 1)) * 1.0, vmap_method=method)
    reference = lambda t: jnp.stack([t[0:2], t[1:3], t[2:4]])  # noqa: E731
    x = jnp.arange(8.0).reshape(4, 2)
    assert_tree_allclose(windows(x[:, 1]), reference(x[:, 1]))
    # was [[0, 1], [1, 2], [2, 3]] for the first example: x.ravel()'s entries
    assert_tree_allclose(jax.vmap(windows, in_axes=1)(x), jax.vmap(reference, in_axes=1)(x))


@pytest.mark.parametrize("method", METHODS)
def test_view_of_an_example_a_jax_producer_batched_last(method):
    # W @ a under jax.vmap leaves the batch on axis 1: the example reached
    # PyTorch as a strided view, and view(-1) failed where the unbatched call works.
    flat = t2j_ad.jaxify(lambda t: t.view(-1).sin(), vmap_method=method)
    reference = lambda t: jnp.sin(t.reshape(-1))  # noqa: E731
    w = jnp.arange(12.0).reshape(3, 4) / 10
    a = jnp.arange(40.0).reshape(2, 4, 5) / 7
    assert_tree_allclose(jax.vmap(lambda v: flat(w @ v))(a), jax.vmap(lambda v: reference(w @ v))(a))
    loss = lambda f: lambda v: (f(w @ v) ** 2).sum()  # noqa: E731
    assert_tree_allclose(jax.vmap(jax.grad(loss(flat)))(a), jax.vmap(jax.grad(loss(reference)))(a))


def test_nested_vmaps_on_other_axes_with_a_view():
    flat = t2j_ad.jaxify(lambda t, u: t.view(-1) * u.sum())
    reference = lambda t, u: t.reshape(-1) * u.sum()  # noqa: E731
    x = jnp.arange(60.0).reshape(3, 4, 5) / 9
    u = jnp.arange(6.0).reshape(2, 3)
    inner = lambda f: jax.vmap(f, in_axes=(1, None))  # noqa: E731
    outer = lambda f: jax.vmap(inner(f), in_axes=(None, 0))  # noqa: E731
    assert_tree_allclose(outer(flat)(x, u), outer(reference)(x, u))


@pytest.mark.usefixtures("x64")
def test_a_torch_vmap_rule_promoting_by_the_batched_rank_falls_back_to_the_loop():
    # Each example: where(0-d float32, 0-d float32, 0-d float64) is float64;
    # torch.vmap's rule promoted by the batched (1-d) rank and gave float32,
    # which the call refused (a TorchCallError) instead of taking the loop.
    f = t2j_ad.jaxify(lambda a, b: torch.where(a > 2, a, b))
    a, b = jnp.array([1.1, 2.2, 3.3], jnp.float32), jnp.array(1.0 / 3, jnp.float64)
    with pytest.warns(t2j_ad.FallbackWarning, match="each example's call gives torch.float64"):
        batched = jax.vmap(f, (0, None))(a, b)
    assert batched.dtype == jnp.float64
    assert_tree_allclose(batched, jnp.where(a > 2, a.astype(jnp.float64), b))


def test_scan_cond_and_checkpoint_around_calls_agree_with_jax():
    step = t2j_ad.jaxify(lambda h, w: torch.tanh(h * w) + 0.5 * torch.sin(h))
    ref_step = lambda h, w: jnp.tanh(h * w) + 0.5 * jnp.sin(h)  # noqa: E731

    def program(f):
        def run(h, ws):
            body = jax.checkpoint(lambda c, w: (jax.lax.cond(w.sum() > 0, f, lambda c, w: c * w, c, w), c.sum()))
            h, ys = jax.lax.scan(body, h, ws)
            return (h**2).sum() + ys.sum()

        return run

    h = jnp.linspace(-1.0, 1.0, 3)
    ws = jnp.array([[0.3, -0.7, 1.1], [-0.2, -0.4, -0.1], [0.5, 0.5, 0.5]])
    assert_tree_allclose(jax.grad(program(step), (0, 1))(h, ws), jax.grad(program(ref_step), (0, 1))(h, ws))


def test_integer_and_symbolic_zero_tangents_beside_float_ones():
    f = t2j_ad.jaxify(lambda a, n, c: (a * n.to(a.dtype) + c.sin(), (a > 0).int().sum(dtype=torch.int32)))
    ref = lambda a, n, c: (a * n.astype(a.dtype) + jnp.sin(c), (a > 0).astype(jnp.int32).sum())  # noqa: E731
    a, n, c = jnp.linspace(-1.0, 1.0, 3), jnp.array([1, 2, 3]), jnp.array([0.1, 0.2, 0.3])
    tangents = (a, np.zeros(n.shape, jax.dtypes.float0), jnp.zeros_like(c))
    got, want = jax.jvp(f, (a, n, c), tangents), jax.jvp(ref, (a, n, c), tangents)
    assert_tree_allclose(got[0][0], want[0][0])
    assert_tree_allclose(got[1][0], want[1][0])
    assert np.asarray(got[1][1]).dtype == jax.dtypes.float0
    g = jax.grad(lambda a, n: f(a, n, c)[0].sum(), (0, 1), allow_int=True)(a, n)
    assert_tree_allclose(g[0], n.astype(a.dtype))
    assert np.asarray(g[1]).dtype == jax.dtypes.float0


# NOTE [each example of the loop from offset 0] in t2j_ad/transforms.py


@pytest.mark.parametrize("method", METHODS + ["auto, looping"])
def test_windows_from_an_explicit_storage_offset_read_each_examples_own_entries(method):
    # as_strided's storage_offset counts from the storage's start: 0 is an
    # unbatched input's first entry, and torch.vmap's example's. The loop's
    # example was a view at offset i * stride, and every example read the
    # first example's entries, silently.
    def windows(t):
        return t.as_strided((3, 2), (1, 1), 0) * 1.0

    def looping(t):  # data-dependent Python: torch.vmap refuses, 'auto' loops
        return windows(t) * (1.0 if t.sum().item() > 0 else -1.0)

    def reference(t):
        return jnp.stack([t[0:2], t[1:3], t[2:4]])

    if method == "auto, looping":
        f = t2j_ad.jaxify(looping)
        ref = lambda t: reference(t) * jnp.where(t.sum() > 0, 1.0, -1.0)  # noqa: E731
    else:
        f, ref = t2j_ad.jaxify(windows, vmap_method=method), reference
    x = jnp.arange(12.0).reshape(3, 4) - 7.5
    loss = lambda g: lambda t: (g(t) ** 2 * t[:3, None]).sum()  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", t2j_ad.FallbackWarning)
        assert_tree_allclose(jax.vmap(f)(x), jax.vmap(ref)(x))
        assert_tree_allclose(jax.vmap(f, in_axes=1)(x.T), jax.vmap(ref)(x))
        assert_tree_allclose(jax.vmap(jax.grad(loss(f)))(x), jax.vmap(jax.grad(loss(ref)))(x))


def test_a_write_into_an_example_of_the_loop_is_still_refused():
    # The loop hands an example not at offset 0 a copy; a write into it is
    # copied back, so the runtime's version check refuses it as before.
    def writes(t):
        if t.device.type != "meta":  # not while inferring the output shapes
            t.add_(1.0)
        return t * 2

    f = t2j_ad.jaxify(writes, vmap_method="sequential")
    for _ in range(2):  # the first call, on copies, and a later one
        with pytest.raises(Exception, match="mutated input"):
            jax.block_until_ready(jax.vmap(f)(jnp.arange(6.0).reshape(3, 2)))
