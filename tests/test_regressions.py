"""Regression tests for engine bugs found by the property suite
(tests/property/). Each test is named after the bug it pins down and checks
the result against pure JAX on the same math."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from conftest import TORCH_DEVICE, assert_tree_allclose, run_in_threads, to_numpy, to_torch

import t2j_ad


def _t_solve(a, b):
    return torch.linalg.solve(a + 3 * torch.eye(a.shape[-1], dtype=a.dtype, device=a.device), b)


def _j_solve(a, b):
    return jnp.linalg.solve(a + 3 * jnp.eye(a.shape[-1], dtype=a.dtype), b)


def _t_det(a):
    return torch.linalg.det(a + 2 * torch.eye(a.shape[-1], dtype=a.dtype, device=a.device))


def _j_det(a):
    return jnp.linalg.det(a + 2 * jnp.eye(a.shape[-1], dtype=a.dtype))


def test_graph_mode_baked_a_layout_branch_its_fake_tensors_got_wrong():
    """compile="graph" traced vmap(jacfwd(det)) over a size-1 batch at a
    middle axis, with vmap_method="broadcast_all", into a graph returning the
    transposed derivative: on torch 2.13's fake tensors a view and a clone
    came out non-contiguous where the real ones are contiguous, and det's jvp
    branches on is_contiguous() (NOTE [checking a trace against eager]).
    Found by a long random run of the property suite in graph mode."""
    a = jnp.asarray(np.random.default_rng(0).uniform(-0.5, 0.5, (3, 1, 3)), jnp.float32)
    f = t2j_ad.jaxify(_t_det, vmap_method="broadcast_all", compile="graph")
    reference = jax.vmap(jax.jacfwd(_j_det), in_axes=1)(a)
    assert_tree_allclose(jax.jit(jax.vmap(jax.jacfwd(f), in_axes=1))(a), reference)


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
    f = t2j_ad.jaxify(lambda w, x: torch.tanh(x @ w) ** 2)
    x = jnp.sin(jnp.arange(24.0, dtype=jnp.float32).reshape(8, 3))
    w = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)
    hessians = jax.jit(jax.vmap(jax.hessian(f), (None, 0)))
    expected = jax.vmap(jax.hessian(lambda w, x: jnp.tanh(x @ w) ** 2), (None, 0))(w, x)
    results = []

    def run(k: int) -> None:
        results.extend(np.asarray(hessians(w, x)) for _ in range(5))

    run_in_threads(run, 4)
    assert len(results) == 20
    for r in results:
        assert_tree_allclose(r, np.asarray(expected), rtol=1e-4, atol=1e-5)


def test_bad_thread_setting_is_a_value_error_in_the_caller():
    """T2J_AD_TORCH_THREADS was parsed with a bare int() inside the custom
    call, so 'abc' came back as "invalid literal for int()" wrapped in a JAX
    runtime error, '0' reached torch.set_num_threads, and
    set_torch_threads(1.5) silently meant 1. Found by tests/test_bad_input.py."""
    import subprocess
    import sys

    import pytest

    code = (
        "import jax.numpy as jnp, t2j_ad\n"
        "try:\n    t2j_ad.jaxify(lambda x: x * 2)(jnp.ones(2))\n"
        "except ValueError as err:\n    print(err)\n"
    )
    for bad in ("abc", "0"):
        env = {**__import__("os").environ, "T2J_AD_TORCH_THREADS": bad}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert f"T2J_AD_TORCH_THREADS must be a whole number from 1 to 2147483647 (PyTorch threads inside t2j_ad calls), got '{bad}'" in done.stdout
    with pytest.raises(TypeError, match="n must be an int, got float"):
        t2j_ad.set_torch_threads(1.5)


def test_unconvertible_arguments_and_bad_output_shapes_name_the_argument():
    """A Python int beyond 64 bits raised OverflowError and a NumPy object
    array JAX's "Error interpreting argument to stage", neither naming the
    argument; output_shapes with a negative dimension reached MLIR
    ("invalid tensor dimension size"). Found by tests/test_bad_input.py."""
    import pytest

    f = t2j_ad.jaxify(lambda x, y: x * y)
    with pytest.raises(TypeError, match=r"argument args\[1\] cannot become a JAX array"):
        f(jnp.ones(2), 2**70)
    with pytest.raises(TypeError, match=r"argument kwargs\['y'\] cannot become a JAX array"):
        f(jnp.ones(2), y=np.array([object()], dtype=object))
    g = t2j_ad.jaxify(lambda x: x, output_shapes=jax.ShapeDtypeStruct((-2,), jnp.float32))
    with pytest.raises(ValueError, match=r"output_shapes has shape \(-2,\)"):
        g(jnp.ones(2))
    assert_tree_allclose(f(jnp.ones(2), 3.0), jnp.full(2, 3.0))


def _t_mlp(x, w1, w2):
    return torch.tanh(x @ w1) @ w2


def _j_mlp(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


def test_vmap_of_vjp_of_vjp_with_a_zero_gradient_stays_inside_its_level():
    """functorch_levels._direct_vjp made the zeros for an input without a
    gradient with zeros_like of the outer primal while its grad level was
    still on top. Under broadcast_all (every primal batched), jacrev of grad
    of an MLP with respect to its last (linear) layer returned a tensor that
    had escaped its vmap level: "Either your tensor may have escaped from
    inside a function being vmapped". Found by the property suite at 60
    examples per pair."""
    args = (jnp.full((2, 3), 0.3), jnp.full((3, 4), 0.2), jnp.full((4, 2), 0.1))

    def second(mlp):
        return jax.jacrev(jax.grad(lambda *a: jnp.sum(mlp(*a) * jnp.arange(1.0, 5.0).reshape(2, 2)), argnums=2), argnums=2)

    ours = t2j_ad.jaxify(_t_mlp, vmap_method="broadcast_all")
    assert_tree_allclose(jax.jit(second(ours))(*args), second(_j_mlp)(*args))


def _t_reduce(x):
    return (x**2 + 1).prod(-1)


def _j_reduce(x):
    return (x**2 + 1).prod(-1)


def test_broadcast_all_passes_copies_not_overlapping_views():
    """broadcast_all passed unbatched arguments as expand() views; the jvp
    of prod under a nested vmap writes in place and refused them ("more than
    one element of the written-to tensor refers to a single memory
    location"). Found by test_vmap_methods_agree at 60 examples."""
    x = jnp.linspace(-1.0, 1.0, 9, dtype=jnp.float32).reshape(3, 3)
    ours = t2j_ad.jaxify(_t_reduce, vmap_method="broadcast_all")
    assert_tree_allclose(
        jax.jit(jax.vmap(jax.jacfwd(ours), in_axes=1))(x), jax.vmap(jax.jacfwd(_j_reduce), in_axes=1)(x)
    )


def test_shape_inference_ran_the_module_and_updated_its_buffers():
    """Inference of a BatchNorm1d(momentum=None) in training mode: its meta
    run added 1 to num_batches_tracked for real (an op on a real 0-d tensor),
    then failed, and the run on zeros averaged a batch of zeros into the
    running statistics (NOTE [trial runs do not write to real tensors])."""
    torch.manual_seed(0)
    module = torch.nn.BatchNorm1d(3, momentum=None).to(TORCH_DEVICE).train()
    twin = torch.nn.BatchNorm1d(3, momentum=None).to(TORCH_DEVICE).train()
    apply, params = t2j_ad.jaxify_module(module, compile="eager")
    for k in range(3):
        x = jnp.arange(12.0).reshape(4, 3) * (k + 1)
        assert_tree_allclose(jax.jit(apply)(params, x), to_numpy(twin(to_torch(x))))
    assert int(module.num_batches_tracked) == int(twin.num_batches_tracked) == 3
    assert_tree_allclose(to_numpy(module.running_mean), to_numpy(twin.running_mean))
    assert_tree_allclose(to_numpy(module.running_var), to_numpy(twin.running_var))
