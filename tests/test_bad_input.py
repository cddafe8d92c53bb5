"""The contract for bad input (DESIGN.md): each case gets a clear error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as nn

import t2j_ad

# What JAX raises when a callback fails at run time.
RUNTIME_ERRORS = (t2j_ad.TorchCallError, jax.errors.JaxRuntimeError)


def two_args(x, y):
    return x + y


def test_wrong_number_of_arguments_is_a_type_error():
    f = t2j_ad.jaxify(two_args)
    with pytest.raises(TypeError, match=r"two_args\(x, y\).*missing a required argument: 'y'"):
        f(jnp.ones(2))
    with pytest.raises(TypeError, match="too many positional arguments"):
        f(jnp.ones(2), jnp.ones(2), jnp.ones(2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'z'"):
        f(jnp.ones(2), jnp.ones(2), z=jnp.ones(2))


@pytest.mark.parametrize(
    ("leaf", "kind"),
    [("a string", "str"), (object(), "object"), (torch.ones(2), "Tensor")],
)
def test_non_array_leaf_names_its_key_path(leaf, kind):
    f = t2j_ad.jaxify(lambda tree: tree["w"][1])
    with pytest.raises(TypeError, match=rf"argument args\[0\]\['w'\]\[1\] is a {kind}"):
        f({"w": [jnp.ones(2), leaf]})


def test_unsupported_dtype_is_refused_not_cast():
    f = t2j_ad.jaxify(lambda x: x)
    with pytest.raises(TypeError, match=r"argument args\[0\].*uint32 cannot cross into PyTorch"):
        f(jnp.ones(2, jnp.uint32))


def test_wrong_tree_structure_for_module_params_names_the_key():
    apply, params = t2j_ad.jaxify_module(nn.Linear(3, 2))
    x = jnp.ones((1, 3))
    missing = {"weight": params["weight"]}
    with pytest.raises(TypeError, match=r"missing params\['bias'\]"):
        apply(missing, x)
    with pytest.raises(TypeError, match=r"unexpected params\['extra'\]"):
        apply({**params, "extra": jnp.ones(1)}, x)
    with pytest.raises(TypeError, match="params is a list"):
        apply([params["weight"], params["bias"]], x)
    with pytest.raises(TypeError, match=r"params\['weight'\] has shape \(3, 2\)"):
        apply({**params, "weight": jnp.ones((3, 2))}, x)


def raises_value_error(x):
    if x.device.type != "meta" and bool((x > 100).any()):
        raise ValueError("input too large for this model")
    return x * 2


@pytest.mark.parametrize("use_jit", [False, True])
def test_exception_inside_torch_is_reraised_and_process_keeps_working(use_jit):
    f = t2j_ad.jaxify(raises_value_error)
    call = jax.jit(f) if use_jit else f
    with pytest.raises(RUNTIME_ERRORS, match="input too large for this model") as info:
        jax.block_until_ready(call(jnp.full(3, 1000.0)))
    assert "ValueError" in str(info.value)
    assert "raises_value_error" in str(info.value)  # PyTorch traceback text
    np.testing.assert_allclose(call(jnp.ones(3)), 2 * np.ones(3))


def test_exception_at_trace_time_carries_torch_message():
    def bad_shapes(x):
        return x @ torch.ones(5, 7)

    with pytest.raises(t2j_ad.TorchCallError, match="cannot be multiplied"):
        jax.jit(t2j_ad.jaxify(bad_shapes))(jnp.ones((2, 3)))


def add_one_in_place(x):
    x.add_(1)
    return x * 2


def test_in_place_mutation_is_refused_at_inference():
    x = jnp.arange(3.0)
    with pytest.raises(t2j_ad.InputMutationError, match=r"mutated input\(s\) \[0\] in place"):
        t2j_ad.jaxify(add_one_in_place)(x)
    np.testing.assert_array_equal(np.asarray(x), [0.0, 1.0, 2.0])


@pytest.mark.parametrize("use_jit", [False, True])
def test_in_place_mutation_is_refused_at_run_time_and_arrays_keep_values(use_jit):
    # output_shapes skips inference, so the run-time guard must catch it.
    f = t2j_ad.jaxify(add_one_in_place, output_shapes=jax.ShapeDtypeStruct((3,), jnp.float32))
    x = jnp.arange(3.0)
    call = jax.jit(f) if use_jit else f
    with pytest.raises(RUNTIME_ERRORS, match="mutated input"):
        jax.block_until_ready(call(x))
    np.testing.assert_array_equal(np.asarray(x), [0.0, 1.0, 2.0])


@pytest.mark.parametrize(
    ("fn", "what"),
    [
        (lambda x: (x, 1.5), r"output\[1\] is float"),
        (lambda x: {"a": x, "b": None}, r"output\['b'\] is NoneType"),
        (lambda x: [x, "label"], r"output\[1\] is str"),
    ],
)
def test_non_tensor_outputs_name_the_output(fn, what):
    with pytest.raises(t2j_ad.TorchCallError, match=what):
        t2j_ad.jaxify(fn)(jnp.ones(2))


def test_non_tensor_output_with_output_shapes_names_the_output():
    f = t2j_ad.jaxify(
        lambda x: (x, 2.0),
        output_shapes=(jax.ShapeDtypeStruct((2,), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32)),
    )
    with pytest.raises(RUNTIME_ERRORS, match=r"output\[1\] is float"):
        jax.block_until_ready(f(jnp.ones(2)))


@pytest.mark.parametrize(
    ("declared", "what"),
    [
        (jax.ShapeDtypeStruct((3,), jnp.float32), r"output has shape \(2,\), but \(3,\) was declared"),
        (jax.ShapeDtypeStruct((2,), jnp.int32), "output has dtype float32, but int32 was declared"),
        ((jax.ShapeDtypeStruct((2,), jnp.float32),), "structure"),
    ],
)
def test_output_shapes_mismatch_names_the_output(declared, what):
    f = t2j_ad.jaxify(lambda x: x * 2, output_shapes=declared)
    with pytest.raises(RUNTIME_ERRORS, match=what):
        jax.block_until_ready(jax.jit(f)(jnp.ones(2)))


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="vmap_method must be one of"):
        t2j_ad.jaxify(lambda x: x, vmap_method="parallel")
    with pytest.raises(TypeError, match="torch_fn must be callable"):
        t2j_ad.jaxify(3)
    with pytest.raises(TypeError, match=r"output_shapes\[0\] is a int"):
        t2j_ad.jaxify(lambda x: x, output_shapes=[3])(jnp.ones(2))


def test_tensor_subclass_output_is_accepted_and_checked():
    # The runtime's one-tensor fast path compares exact types; a subclass
    # (here nn.Parameter) takes the general check, which accepts it.
    f = t2j_ad.jaxify(lambda x: torch.nn.Parameter(torch.sin(x) * 2))
    x = jnp.linspace(-1.0, 1.0, 5)
    np.testing.assert_allclose(jax.jit(f)(x), jnp.sin(x) * 2, rtol=1e-6)
    g = t2j_ad.jaxify(
        lambda x: torch.nn.Parameter(x[:2]), output_shapes=jax.ShapeDtypeStruct((5,), jnp.float32)
    )
    with pytest.raises(RUNTIME_ERRORS, match=r"has shape \(2,\), but \(5,\) was declared"):
        jax.block_until_ready(jax.jit(g)(x))
