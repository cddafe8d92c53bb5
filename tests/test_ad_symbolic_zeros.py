"""Symbolic zeros stay symbolic: PyTorch differentiates only what JAX asks for.

Two independent counts of which inputs PyTorch is asked to differentiate:

- statically, from the ``torch_call`` equations of ``jax.make_jaxpr``: the
  ``Jvp.wrt`` / ``Vjp.wrt`` (and ``.out``) of each call's transforms;
- at run time, by wrapping ``torch.func.jvp`` and ``functorch_levels.vjp``
  (t2j_ad's ``torch.func.vjp``; NOTE [functorch levels]) and recording how
  many primals each call receives.

Integer and bool inputs and outputs get ``float0`` tangents, as in JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.func
from conftest import assert_tree_allclose

import t2j_ad
from t2j_ad import functorch_levels
from t2j_ad.torch_fn import Jvp, Vjp

MODES = ("eager", "jit")
float0 = jax.dtypes.float0

X = jnp.array([0.3, -1.2, 0.7], jnp.float32)
Y = jnp.array([1.1, 0.4, -0.5], jnp.float32)
W = jnp.array([2.0, -0.5], jnp.float32)
T = jnp.array([0.5, -0.25, 1.0], jnp.float32)


def run(mode: str, fn, *args):
    return (jax.jit(fn) if mode == "jit" else fn)(*args)


def _t_three(x, y, w):
    return torch.sin(x) * y + w.sum(), (x * y).sum() * torch.cos(w)


def _j_three(x, y, w):
    return jnp.sin(x) * y + w.sum(), (x * y).sum() * jnp.cos(w)


# Eager: the runtime-count tests count torch.func calls, which graph replay skips.
t_three = t2j_ad.jaxify(_t_three, compile="eager")


# ---------------------------------------------------------------- jaxpr view


def _subjaxprs(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _subjaxprs(v)


def torch_call_transforms(fn, *args) -> list[tuple]:
    """The transforms tuple of every torch_call in ``make_jaxpr(fn)``,
    including calls nested in pjit, scan, cond, custom_vjp... bodies."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "torch_call":
                found.append(eqn.params["fun"].transforms)
            for v in eqn.params.values():
                for sub in _subjaxprs(v):
                    walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def derivative_steps(fn, *args) -> list:
    """Every Jvp/Vjp transform appearing in a torch_call of ``fn``'s jaxpr."""
    return [t for ts in torch_call_transforms(fn, *args) for t in ts if isinstance(t, (Jvp, Vjp))]


# ------------------------------------------------------------ runtime count


@pytest.fixture
def torch_func_calls(monkeypatch):
    """Records ``("jvp"|"vjp", number of primals, their shapes)`` for every
    forward-mode (``torch.func.jvp``) and reverse-mode
    (``functorch_levels.vjp``) call t2j_ad makes."""
    calls: list[tuple[str, int, tuple]] = []
    real_jvp, real_vjp = torch.func.jvp, functorch_levels.vjp

    def jvp(fn, primals, tangents, *rest, **kw):
        calls.append(("jvp", len(primals), tuple(tuple(p.shape) for p in primals)))
        return real_jvp(fn, primals, tangents, *rest, **kw)

    def vjp(fn, primals, cotangents):
        calls.append(("vjp", len(primals), tuple(tuple(p.shape) for p in primals)))
        return real_vjp(fn, primals, cotangents)

    monkeypatch.setattr(torch.func, "jvp", jvp)
    monkeypatch.setattr(functorch_levels, "vjp", vjp)
    return calls


# ------------------------------------------------------------------- tests


CASES = {
    # name: (transform, the derivative steps its jaxpr must contain). Reverse
    # mode shows only the Vjp: the JVP's tangent call was transposed away.
    "jvp_closed_over_y_w": (
        lambda f: lambda x, y, w: jax.jvp(lambda x: f(x, y, w), (x,), (T,)),
        [Jvp((0,), (0, 1))],
    ),
    "grad_argnums_1": (
        lambda f: jax.grad(lambda x, y, w: f(x, y, w)[1].sum(), argnums=1),
        [Vjp((1,), (1,))],
    ),
    "grad_one_output_of_two": (
        # Output 0 is unused: its cotangent is a symbolic zero, so the VJP
        # restricts to output 1 (Vjp.out) as well as to x (Vjp.wrt).
        lambda f: jax.grad(lambda x, y, w: f(x, y, w)[1].sum()),
        [Vjp((0,), (1,))],
    ),
    "grad_argnums_0_2": (
        lambda f: jax.grad(lambda x, y, w: f(x, y, w)[0].sum(), argnums=(0, 2)),
        [Vjp((0, 2), (0,))],
    ),
    "jacfwd_argnums_2": (
        lambda f: jax.jacfwd(f, argnums=2),
        [Jvp((2,), (0, 1))],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_jaxpr_differentiates_only_what_is_asked(name):
    transform, expected = CASES[name]
    assert derivative_steps(transform(t_three), X, Y, W) == expected
    reference = jax.jit(transform(_j_three))(X, Y, W)
    for mode in MODES:
        assert_tree_allclose(run(mode, transform(t_three), X, Y, W), reference)


def test_hessian_with_respect_to_one_of_three_inputs():
    # Every derivative PyTorch computes, at any order, is w.r.t. x alone.
    # Vjp's inputs are (x, y, w, cotangent): the second-order Jvp of the Vjp
    # function must not differentiate y, w or the (constant) cotangent.
    hess = jax.hessian(lambda x, y, w: f_scalar(x, y, w))
    steps = derivative_steps(hess, X, Y, W)
    assert steps, "no derivative torch_call in the jaxpr"
    for step in steps:
        assert step.wrt == (0,), steps
    reference = jax.jit(jax.hessian(lambda x, y, w: (jnp.sin(x) * y).sum() * jnp.cos(w).sum()))(X, Y, W)
    for mode in MODES:
        assert_tree_allclose(run(mode, hess, X, Y, W), reference)


f_scalar = t2j_ad.jaxify(lambda x, y, w: (torch.sin(x) * y).sum() * torch.cos(w).sum(), compile="eager")


@pytest.mark.parametrize("mode", MODES)
def test_runtime_count_first_order(mode, torch_func_calls):
    run(mode, jax.grad(lambda x, y, w: t_three(x, y, w)[1].sum(), argnums=1), X, Y, W)
    # Reverse mode comes from linearize-then-transpose: one VJP of one input.
    assert torch_func_calls == [("vjp", 1, ((3,),))]
    torch_func_calls.clear()
    run(mode, lambda w, t: jax.jvp(lambda w: t_three(X, Y, w), (w,), (t,)), W, W)
    assert torch_func_calls == [("jvp", 1, ((2,),))]


@pytest.mark.parametrize("mode", MODES)
def test_runtime_count_hessian(mode, torch_func_calls):
    run(mode, jax.hessian(f_scalar), X, Y, W)
    kinds = {kind for kind, _, _ in torch_func_calls}
    assert kinds == {"jvp", "vjp"}, torch_func_calls
    for kind, count, shapes in torch_func_calls:
        assert (count, shapes) == (1, ((3,),)), torch_func_calls


def test_runtime_count_matches_jaxpr_for_fourth_order(torch_func_calls):
    g = lambda s: f_scalar(s * X, Y, W)  # noqa: E731
    for _ in range(4):
        g = jax.grad(g)
    jax.jit(g)(jnp.float32(0.7))
    # Every call differentiates one input (the scaled x), never y or w.
    assert torch_func_calls and all(count == 1 for _, count, _ in torch_func_calls), torch_func_calls
    assert all(step.wrt == (0,) for step in derivative_steps(g, jnp.float32(0.7)))


# ------------------------------------------------------ integer and bool


def _t_mixed(x, n, mask):
    scaled = x * n.to(x.dtype)
    return torch.where(mask, scaled**2, -scaled), n * 2, mask.logical_not()


def _j_mixed(x, n, mask):
    scaled = x * n.astype(x.dtype)
    return jnp.where(mask, scaled**2, -scaled), n * 2, jnp.logical_not(mask)


t_mixed = t2j_ad.jaxify(_t_mixed)
N = jnp.array([1, -2, 3], jnp.int32)
MASK = jnp.array([True, False, True])


def _float0_zeros(a):
    return np.zeros(np.shape(a), float0)


MIXED_TRANSFORMS = {
    "jvp": lambda f: lambda x, n, m: jax.jvp(f, (x, n, m), (T, _float0_zeros(n), _float0_zeros(m))),
    "vjp": lambda f: lambda x, n, m: jax.vjp(f, x, n, m)[1]((T, _float0_zeros(n), _float0_zeros(m))),
    "grad_allow_int": lambda f: jax.grad(lambda x, n, m: f(x, n, m)[0].sum(), argnums=(0, 1, 2), allow_int=True),
    "jacfwd": lambda f: jax.jacfwd(lambda x, n, m: f(x, n, m)[0]),
    "jacrev": lambda f: jax.jacrev(lambda x, n, m: f(x, n, m)[0]),
    "hessian": lambda f: jax.hessian(lambda x, n, m: f(x, n, m)[0].sum()),
}


@pytest.mark.parametrize("name", MIXED_TRANSFORMS)
def test_integer_and_bool_get_float0(name):
    transform = MIXED_TRANSFORMS[name]
    reference = jax.jit(transform(_j_mixed))(X, N, MASK)
    for mode in MODES:
        out = run(mode, transform(t_mixed), X, N, MASK)
        assert_tree_allclose(out, reference)  # checks float0 dtypes leaf by leaf
    # Integer and bool inputs are never differentiated in PyTorch.
    for step in derivative_steps(transform(t_mixed), X, N, MASK):
        assert step.wrt == (0,) and step.out == (0,), step


def test_float0_dtypes_explicitly():
    tangents = jax.jvp(t_mixed, (X, N, MASK), (T, _float0_zeros(N), _float0_zeros(MASK)))[1]
    assert [t.dtype for t in tangents] == [jnp.float32, float0, float0]
    cts = jax.vjp(t_mixed, X, N, MASK)[1]((T, _float0_zeros(N), _float0_zeros(MASK)))
    assert [c.dtype for c in cts] == [jnp.float32, float0, float0]
    grads = jax.grad(lambda x, n, m: t_mixed(x, n, m)[0].sum(), argnums=(1, 2), allow_int=True)(X, N, MASK)
    assert [g.dtype for g in grads] == [float0, float0]


def test_integer_input_under_vmap_of_grad():
    # float0 tangents survive batching too.
    xs = jnp.stack([X, Y])
    grad = jax.vmap(jax.grad(lambda x, n, m: t_mixed(x, n, m)[0].sum()), (0, None, None))
    reference = jax.vmap(jax.grad(lambda x, n, m: _j_mixed(x, n, m)[0].sum()), (0, None, None))
    assert_tree_allclose(jax.jit(grad)(xs, N, MASK), jax.jit(reference)(xs, N, MASK))
