"""``functorch_levels.vmap`` / ``.vjp`` against ``torch.vmap`` / ``torch.func.vjp``.

They enter functorch's C++ levels directly (NOTE [functorch levels]); every
case here holds their results, errors and the state they leave behind against
the public ``torch.func`` API on the same function. The end-to-end tests run
jaxify'd functions with the direct path switched off, against pure JAX.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.func
from conftest import assert_tree_allclose

import t2j_ad
from t2j_ad import functorch_levels as levels

pytestmark = pytest.mark.skipif(not levels._AVAILABLE, reason="this PyTorch lacks functorch's private level API")


@pytest.fixture(autouse=True)
def direct_path(monkeypatch):
    """Every test here runs the direct path, whatever the environment says."""
    monkeypatch.setattr(levels, "FAST", True)


def randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def assert_same(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype
        torch.testing.assert_close(a, e)


def reference_vjp(fn, primals, cotangents):
    _, pullback = torch.func.vjp(fn, *primals)
    return tuple(pullback(tuple(cotangents)))


def assert_clean_state():
    """No functorch level left open, and every flag back at its default."""
    from torch._C import _functorch

    assert _functorch.maybe_current_level() is None
    assert not _functorch.get_inplace_requires_grad_allowed()
    assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is None


# --------------------------------------------------------------------- vmap

VMAP_CASES = {
    # name: (fn, args, in_dims)
    "unbatched_arg_passed_once": (lambda x, w: (torch.sin(x) * w.sum(),), (randn(5, 3), randn(2)), (0, None)),
    "batch_dim_not_first": (lambda x, w: (x @ w, x.sum()), (randn(3, 5, 4), randn(4, 2)), (1, None)),
    "output_independent_of_batch": (lambda x, w: (w * 2, x.exp()), (randn(5, 3), randn(2)), (0, None)),
    "every_arg_batched": (lambda x, y: (x * y, (x - y).norm()), (randn(4, 3), randn(3, 4)), (0, 1)),
}


@pytest.mark.parametrize("case", VMAP_CASES)
def test_vmap_matches_torch_vmap(case):
    fn, args, in_dims = VMAP_CASES[case]
    size = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
    got = levels.vmap(fn, args, in_dims, size)
    assert_same(got, tuple(torch.vmap(fn, in_dims=in_dims, out_dims=0)(*args)))
    assert_clean_state()


def test_nested_vmap_matches_torch_vmap():
    x, w = randn(4, 5, 3), randn(3)

    def inner(row, w):
        return (torch.tanh(row) @ w,)

    def outer(mat, w):
        return levels.vmap(inner, (mat, w), (0, None), 5)

    got = levels.vmap(outer, (x, w), (0, None), 4)
    expected = torch.vmap(torch.vmap(inner, in_dims=(0, None)), in_dims=(0, None))(x, w)
    assert_same(got, tuple(expected))


def test_vmap_refusals_match_torch_vmap_and_close_the_level():
    x = randn(4, 3)
    for fn in (lambda x: (x * x.sum().item(),), lambda x: (x + torch.rand_like(x),)):
        with pytest.raises(RuntimeError) as public:
            torch.vmap(fn)(x)
        with pytest.raises(RuntimeError) as direct:
            levels.vmap(fn, (x,), (0,), 4)
        assert str(direct.value) == str(public.value)
        assert_clean_state()


class ScaledSin(torch.autograd.Function):
    """A Function with its own vmap staticmethod, which records that it ran."""

    vmap_calls = 0

    @staticmethod
    def forward(x, s):
        return torch.sin(x) * s

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        return g * torch.cos(x) * s, None

    @staticmethod
    def vmap(info, in_dims, x, s):
        ScaledSin.vmap_calls += 1
        x = x.movedim(in_dims[0], 0) if in_dims[0] is not None else x.expand(info.batch_size, *x.shape)
        return ScaledSin.apply(x, s), 0


def test_autograd_function_vmap_staticmethod_runs_on_both_paths():
    x, s = randn(5, 3), randn(())
    fn = lambda x, s: (ScaledSin.apply(x, s),)  # noqa: E731
    before = ScaledSin.vmap_calls
    got = levels.vmap(fn, (x, s), (0, None), 5)
    assert ScaledSin.vmap_calls == before + 1
    assert_same(got, tuple(torch.vmap(fn, in_dims=(0, None))(x, s)))


VMAP_DECOMPOSITION_PROBE = textwrap.dedent(
    """
    import warnings
    import torch
    import torch.func
    from t2j_ad import functorch_levels as levels

    assert levels.FAST
    warnings.simplefilter("error")  # "There is a performance drop ..." fails
    w, x, y = torch.randn(3, 2), torch.randn(5, 4, 3), torch.randn(5, 4, 2)
    loss = lambda w, x, y: torch.nn.functional.mse_loss(x @ w, y)

    def grad(w, x, y):
        return levels.vjp(lambda w: (loss(w, x, y),), (w,), (torch.tensor(1.0),))

    # The first vmap of the process (torch.vmap has not run):
    # mse_loss_backward has only a Python decomposition as its batching rule,
    # which torch.vmap loads lazily on its first call.
    got = levels.vmap(grad, (w, x, y), (None, 0, 0), 5)[0]
    expected = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(w, x, y)
    torch.testing.assert_close(got, expected)
    print("ok")
    """
)


def test_first_vmap_of_a_process_loads_torch_vmaps_decompositions():
    env = dict(os.environ, T2J_AD_FUNCTORCH_FAST="1")
    result = subprocess.run([sys.executable, "-c", VMAP_DECOMPOSITION_PROBE], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# ---------------------------------------------------------------------- vjp

VJP_CASES = {
    # name: (fn, primals, cotangents)
    "two_in_two_out": (
        lambda x, w: (torch.tanh(x @ w), (x**2).sum()),
        (randn(4, 3), randn(3, 2)),
        (randn(4, 2), randn(())),
    ),
    "output_without_grad": (lambda x: (x * 3, torch.ones(2, dtype=x.dtype)), (randn(3),), (randn(3), randn(2))),
    "no_output_has_grad": (lambda x: (torch.ones(2, dtype=x.dtype),), (randn(3),), (randn(2),)),
    "unused_input": (lambda x, w: (x.sin(),), (randn(3), randn(2)), (randn(3),)),
    "complex": (
        lambda z: (z * z.conj() + torch.sin(z),),
        (randn(3, dtype=torch.complex128),),
        (randn(3, dtype=torch.complex128),),
    ),
    "float32": (lambda x: (x.exp().sum(),), (randn(3, dtype=torch.float32),), (randn((), dtype=torch.float32),)),
}


@pytest.mark.parametrize("case", VJP_CASES)
def test_vjp_matches_torch_func_vjp(case):
    fn, primals, cotangents = VJP_CASES[case]
    assert_same(levels.vjp(fn, primals, cotangents), reference_vjp(fn, primals, cotangents))
    assert_clean_state()


def test_one_tensor_passed_twice_gets_a_gradient_per_position():
    x = randn(3)
    fn = lambda a, b: ((a * b.sin()).sum(),)  # noqa: E731
    ct = (randn(()),)
    assert_same(levels.vjp(fn, (x, x), ct), reference_vjp(fn, (x, x), ct))


def test_per_example_gradients_match_torch_func():
    w, x = randn(3, 2), randn(6, 3)

    def loss(w, x):
        return ((torch.tanh(x @ w)) ** 2).sum()

    def grad(w, x):
        return levels.vjp(lambda w: (loss(w, x),), (w,), (torch.ones((), dtype=w.dtype),))

    got = levels.vmap(grad, (w, x), (None, 0), 6)
    expected = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, x)
    assert_same(got, (expected,))


def test_forward_over_reverse_matches_torch_func():
    # jvp of vjp: the Hessian-vector products behind jax.hessian.
    x, t = randn(4), randn(4)
    f = lambda x: (torch.sin(x).prod() * x.norm(),)  # noqa: E731
    one = (torch.ones((), dtype=x.dtype),)

    def grad(vjp):
        return lambda x: vjp(f, (x,), one)[0]

    _, got = torch.func.jvp(grad(levels.vjp), (x,), (t,))
    _, expected = torch.func.jvp(grad(reference_vjp), (x,), (t,))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got, torch.func.hessian(lambda x: f(x)[0])(x) @ t)


def test_reverse_over_reverse_matches_torch_func():
    x, v = randn(4), randn(4)
    f = lambda x: ((x**3).sum() * x[0],)  # noqa: E731
    one = (torch.ones((), dtype=x.dtype),)

    def gradient_dot_v(vjp):
        return lambda x: ((vjp(f, (x,), one)[0] * v).sum(),)

    got = levels.vjp(gradient_dot_v(levels.vjp), (x,), one)
    expected = reference_vjp(gradient_dot_v(reference_vjp), (x,), one)
    assert_same(got, expected)


def test_vjp_refusals_match_torch_func_and_restore_state():
    x = randn(3)

    def integer_output(x):
        return (x.argmax(),)

    def saved_tensor_hooks(x):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return (x.sin(),)

    def raises(x):
        raise ValueError("from the user's function")

    for fn, error in ((integer_output, RuntimeError), (saved_tensor_hooks, RuntimeError), (raises, ValueError)):
        with pytest.raises(error) as public:
            reference_vjp(fn, (x,), (randn(()),))
        with torch.no_grad():  # grad mode must come back as it was
            with pytest.raises(error) as direct:
                levels.vjp(fn, (x,), (randn(()),))
            assert not torch.is_grad_enabled()
        assert str(direct.value) == str(public.value)
        assert_clean_state()


def test_an_outer_saved_tensor_hooks_refusal_survives():
    x = randn(3)
    outer = "an outer library refuses saved tensor hooks"
    with torch.autograd.graph.disable_saved_tensors_hooks(outer):
        levels.vjp(lambda x: (x.sin(),), (x,), (randn(3),))
        assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() == outer


def test_inference_mode_takes_the_public_path(monkeypatch):
    calls = []
    monkeypatch.setattr(levels, "_public_vjp", lambda *a: calls.append("vjp") or reference_vjp(*a))
    x = randn(3)
    fn = lambda x: (x.exp(),)  # noqa: E731
    with torch.inference_mode():
        got = levels.vjp(fn, (x.clone(),), (randn(3),))
    assert calls == ["vjp"] and got[0].shape == (3,)


# --------------------------------------------------- jaxify'd, end to end


def _t_loss(w, x, y):
    return ((torch.tanh(x @ w) - y) ** 2).sum()


def _j_loss(w, x, y):
    return ((jnp.tanh(x @ w) - y) ** 2).sum()


@pytest.mark.parametrize("fast", [True, False], ids=["direct", "public"])
def test_both_paths_match_pure_jax_end_to_end(fast, monkeypatch):
    monkeypatch.setattr(levels, "FAST", fast)
    f = t2j_ad.jaxify(_t_loss, vmap_method="expand_dims")
    key = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(key[0], (3, 2))
    x = jax.random.normal(key[1], (6, 3))
    y = jax.random.normal(key[2], (6, 2))
    per_example = lambda loss: jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))  # noqa: E731
    assert_tree_allclose(per_example(f)(w, x, y), per_example(_j_loss)(w, x, y), rtol=1e-5, atol=1e-5)
    hessian = lambda loss: jax.jit(jax.hessian(loss))  # noqa: E731
    assert_tree_allclose(hessian(f)(w, x, y), hessian(_j_loss)(w, x, y), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------- the switch


def _fast_in_subprocess(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, T2J_AD_FUNCTORCH_FAST=value)
    code = "from t2j_ad import functorch_levels; print(functorch_levels.FAST)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("value, expected", [("0", "False"), ("off", "False"), ("1", "True"), ("", "True")])
def test_environment_switch(value, expected):
    result = _fast_in_subprocess(value)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_bad_switch_value_names_the_variable():
    result = _fast_in_subprocess("sometimes")
    assert result.returncode != 0
    assert "T2J_AD_FUNCTORCH_FAST must be 1 (enter functorch's levels directly, the default) or 0" in result.stderr
    assert "got 'sometimes'" in result.stderr


def test_the_import_check_passes_here_and_catches_a_changed_private_api(monkeypatch):
    assert levels.direct_path_works()

    def changed(tensor, level, extra):  # as if PyTorch had changed the signature
        raise AssertionError("not reached")

    monkeypatch.setattr(levels, "_wrap_for_grad", changed)
    assert not levels.direct_path_works()
    assert levels.FAST  # the check leaves the switch as it found it
    assert_clean_state()


def test_a_forward_mode_call_torn_by_an_interrupt_leaves_forward_ad_usable():
    # NOTE [an interrupt inside forward AD]: Ctrl-C between forward AD's C++
    # call and its Python bookkeeping left the two apart, and every later
    # torch.func.jvp in the process failed. Here the function tears them
    # itself, then is interrupted.
    from torch.autograd import forward_ad

    def torn(x):
        if forward_ad._current_level == -1:
            return x * 2  # the runs that infer shapes
        forward_ad._current_level = 3  # inside jvp's level: as if exiting had been interrupted halfway
        raise KeyboardInterrupt

    x = jnp.linspace(-1.0, 1.0, 4)
    with pytest.raises(BaseException):  # noqa: B017 - the interrupt, however the call reports it
        jax.block_until_ready(jax.jvp(t2j_ad.jaxify(torn), (x,), (jnp.ones(4),)))
    assert forward_ad._current_level == -1
    t = torch.linspace(-1.0, 1.0, 4)
    _, tangent = torch.func.jvp(torch.sin, (t,), (torch.ones(4),))
    assert_tree_allclose(tangent.numpy(), torch.cos(t).numpy())
    f = t2j_ad.jaxify(lambda t: torch.sin(t) * t)
    _, got = jax.jvp(f, (x,), (jnp.ones(4),))
    assert_tree_allclose(got, jnp.cos(x) * x + jnp.sin(x), rtol=1e-6)
