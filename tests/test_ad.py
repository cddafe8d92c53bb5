"""Every JAX differentiation transform on jaxify'd functions, against pure JAX.

Each test runs the same math twice -- once through a PyTorch function wrapped
by ``t2j_ad.jaxify``, once written in ``jax.numpy`` -- under the same JAX
transform, eagerly and under ``jax.jit``, and compares the results leaf by
leaf (values, shapes and dtypes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import assert_tree_allclose, to_numpy, to_torch
from jax.experimental.ode import odeint

import t2j_ad

MODES = ("eager", "jit")


def run(mode: str, fn, *args):
    """``fn(*args)``, eagerly or through ``jax.jit``."""
    return (jax.jit(fn) if mode == "jit" else fn)(*args)


def check(transforms, torch_version, jax_version, *args, **tol):
    """Each transform of ``torch_version`` matches the same transform of
    ``jax_version``, eagerly and under ``jax.jit``.

    ``transforms`` is one transform (function -> function) or a dict of them;
    all are evaluated in one program, so the jit run compiles once. The
    pure-JAX reference always runs under ``jax.jit``: jit does not change its
    values, and one compilation costs far less than one per eager op.
    Returns ``{mode: results}``.
    """
    single = callable(transforms)
    table = {"result": transforms} if single else dict(transforms)

    def combined(f):
        return lambda *a: {name: tr(f)(*a) for name, tr in table.items()}

    expected = jax.jit(combined(jax_version))(*args)
    results = {}
    for mode in MODES:
        actual = run(mode, combined(torch_version), *args)
        for name in table:
            try:
                assert_tree_allclose(actual[name], expected[name], **tol)
            except AssertionError as err:
                raise AssertionError(f"{name} ({mode}): {err}") from None
        results[mode] = actual["result"] if single else actual
    return results


# ----------------------------------------------------------------- functions
# Each PyTorch function (t_*) is jaxify'd once at module level, so signature
# inference and built transforms are shared by every test.

def _t_scalar(x, y):
    return (torch.sin(x) * y**2).sum() + torch.exp(x * y).sum() / 3


def _j_scalar(x, y):
    return (jnp.sin(x) * y**2).sum() + jnp.exp(x * y).sum() / 3


def _t_vector(x, y):
    return torch.tanh(x) * y + x**2 * torch.cos(y)


def _j_vector(x, y):
    return jnp.tanh(x) * y + x**2 * jnp.cos(y)


def _t_tree(x, y):
    # Nested pytree output; "const" depends on no input, "only_y" not on x.
    return {
        "a": torch.sin(x) * y,
        "nested": {"b": (x * torch.cos(y)).sum(), "pair": (x**3, torch.exp(y))},
        "only_y": y * 2.0,
        "const": torch.ones(2, device=x.device),
    }


def _j_tree(x, y):
    return {
        "a": jnp.sin(x) * y,
        "nested": {"b": (x * jnp.cos(y)).sum(), "pair": (x**3, jnp.exp(y))},
        "only_y": y * 2.0,
        "const": jnp.ones(2),
    }


t_scalar = t2j_ad.jaxify(_t_scalar)
t_vector = t2j_ad.jaxify(_t_vector)
t_tree = t2j_ad.jaxify(_t_tree)

X = jnp.array([0.3, -1.2, 0.7], jnp.float32)
Y = jnp.array([1.1, 0.4, -0.5], jnp.float32)
T = jnp.array([0.5, -0.25, 1.0], jnp.float32)  # a tangent / direction


# ------------------------------------------------------ first-order transforms

SCALAR_TRANSFORMS = {
    "grad_argnums_0": lambda f: jax.grad(f),
    "grad_argnums_1": lambda f: jax.grad(f, argnums=1),
    "grad_argnums_tuple": lambda f: jax.grad(f, argnums=(0, 1)),
    "grad_argnums_reversed": lambda f: jax.grad(f, argnums=(1, 0)),
    "value_and_grad": lambda f: jax.value_and_grad(f, argnums=(0, 1)),
    "jacrev": lambda f: jax.jacrev(f, argnums=(0, 1)),
    "jacfwd": lambda f: jax.jacfwd(f, argnums=(0, 1)),
    "hessian": lambda f: jax.hessian(f, argnums=(0, 1)),
    "jvp": lambda f: lambda x, y: jax.jvp(f, (x, y), (T, 2 * T)),
    "vjp": lambda f: lambda x, y: jax.vjp(f, x, y)[1](jnp.float32(1.5)),
    "linearize": lambda f: lambda x, y: jax.linearize(f, x, y)[1](T, -T),
}


def test_scalar_function_transforms():
    check(SCALAR_TRANSFORMS, t_scalar, _j_scalar, X, Y)


def _with_aux(f):
    def loss(x, y):
        v = f(x, y)
        return (v**2).sum(), {"v": v, "norm": jnp.linalg.norm(v)}

    return loss


VECTOR_TRANSFORMS = {
    "jacrev": lambda f: jax.jacrev(f, argnums=(0, 1)),
    "jacfwd": lambda f: jax.jacfwd(f, argnums=(0, 1)),
    "jvp": lambda f: lambda x, y: jax.jvp(f, (x, y), (T, T * T)),
    "vjp": lambda f: lambda x, y: jax.vjp(f, x, y)[1](T),
    "linearize": lambda f: lambda x, y: jax.linearize(f, x, y)[1](T, Y),
    "grad_has_aux": lambda f: jax.grad(_with_aux(f), argnums=(0, 1), has_aux=True),
    "value_and_grad_has_aux": lambda f: jax.value_and_grad(_with_aux(f), argnums=1, has_aux=True),
}


def test_vector_function_transforms():
    check(VECTOR_TRANSFORMS, t_vector, _j_vector, X, Y)


# ------------------------------------------------------------- higher orders


def _nth_grad(f, n):
    """The n-th derivative of s -> sum(f(s*X, Y)), a scalar function."""
    g = lambda s: f(s * X, Y).sum()  # noqa: E731
    for _ in range(n):
        g = jax.grad(g)
    return g


def test_grad_of_grad_to_fourth_order():
    orders = {f"order_{n}": (lambda n: lambda f: _nth_grad(f, n))(n) for n in range(1, 5)}
    check(orders, t_scalar, _j_scalar, jnp.float32(0.8), rtol=1e-4, atol=1e-4)


def _hvp_forward_over_reverse(f):
    return lambda x, v: jax.jvp(jax.grad(lambda x: f(x, Y)), (x,), (v,))


def _hvp_reverse_over_forward(f):
    return lambda x, v: jax.grad(lambda x: jax.jvp(lambda x: f(x, Y), (x,), (v,))[1])(x)


def _hvp_reverse_over_reverse(f):
    return lambda x, v: jax.grad(lambda x: jnp.vdot(jax.grad(lambda x: f(x, Y))(x), v))(x)


def test_third_order_and_hessian_vector_products():
    out = check(
        {
            "jacfwd_of_hessian": lambda f: lambda x, v: jax.jacfwd(jax.hessian(lambda x: f(x, Y)))(x),
            "hvp_forward_over_reverse": _hvp_forward_over_reverse,
            "hvp_reverse_over_forward": _hvp_reverse_over_forward,
            "hvp_reverse_over_reverse": _hvp_reverse_over_reverse,
        },
        t_scalar,
        _j_scalar,
        X,
        T,
        rtol=1e-4,
        atol=1e-4,
    )
    assert out["jit"]["jacfwd_of_hessian"].shape == (3, 3, 3)


def test_hessian_of_vector_function_composed_with_jax_ops():
    loss = lambda f: lambda x: jnp.sum(f(x, Y) ** 3) + jnp.prod(f(Y, x))  # noqa: E731
    check(lambda f: jax.hessian(loss(f)), t_vector, _j_vector, X, rtol=1e-4, atol=1e-4)


def _transpose_of_batched_jvp(f):
    """``jax.linear_transpose`` of a vmapped JVP. The linear torch_call is
    Vmap(Jvp(f)), whose last transform is not Jvp, so the transpose rule
    takes its generic path (Vjp appended to the call itself)."""

    def fn(xs, cts):
        tangent_map = lambda ts: jax.vmap(lambda x, t: jax.jvp(lambda x: f(x, Y), (x,), (t,))[1])(xs, ts)  # noqa: E731
        return jax.linear_transpose(tangent_map, xs)(cts)[0]

    return fn


def test_generic_transpose_path():
    xs, cts = jnp.stack([X, Y]), jnp.stack([T, -T])
    check(
        {
            "transpose": _transpose_of_batched_jvp,
            "grad_through_it": lambda f: jax.grad(lambda xs, cts: jnp.sum(_transpose_of_batched_jvp(f)(xs, cts) ** 2), argnums=(0, 1)),
        },
        t_vector,
        _j_vector,
        xs,
        cts,
    )
    jaxpr = jax.make_jaxpr(_transpose_of_batched_jvp(t_vector))(xs, cts).jaxpr
    chains = [[type(t).__name__ for t in e.params["fun"].transforms] for e in jaxpr.eqns if e.primitive.name == "torch_call"]
    assert ["Jvp", "Vmap", "Vjp"] in chains, chains


# ------------------------------------------------- inside JAX control flow


def _scanned(f):
    def loss(x, y):
        def step(carry, w):
            out = f(carry, y * w)
            return out, out.sum()

        final, sums = jax.lax.scan(step, x, jnp.array([1.0, 0.5, -0.3]))
        return final.sum() + (sums**2).sum()

    return loss


def test_inside_scan():
    check(
        {
            "grad": lambda f: jax.grad(_scanned(f), argnums=(0, 1)),
            "jacfwd": lambda f: jax.jacfwd(_scanned(f)),
        },
        t_vector,
        _j_vector,
        X,
        Y,
    )


def _branchy(f):
    def loss(x, p):
        return jax.lax.cond(p > 0, lambda x: f(x, Y).sum(), lambda x: jnp.sin(x).sum() * f(Y, x).sum(), x)

    return loss


@pytest.mark.parametrize("p", [1.0, -1.0], ids=["true_branch", "false_branch"])
def test_inside_cond(p):
    check(
        {"grad": lambda f: jax.grad(_branchy(f)), "hessian": lambda f: jax.hessian(_branchy(f))},
        t_vector,
        _j_vector,
        X,
        jnp.float32(p),
    )


def _looped(f):
    def fn(x, n):
        def body(state):
            i, v = state
            return i + 1, f(v, Y) * 0.5

        return jax.lax.while_loop(lambda s: s[0] < n, body, (0, x))[1]

    return fn


def test_inside_while_loop_forward_mode():
    check(
        {
            "jvp": lambda f: lambda x, n: jax.jvp(lambda x: _looped(f)(x, n), (x,), (T,)),
            "jacfwd": lambda f: jax.jacfwd(_looped(f)),
        },
        t_vector,
        _j_vector,
        X,
        jnp.int32(3),
    )


def _remat(f):
    @jax.checkpoint
    def block(x, y):
        return jnp.sin(f(x, y)).sum() * f(y, x).sum()

    return block


def test_inside_checkpoint():
    check(
        {
            "grad": lambda f: jax.grad(_remat(f), argnums=(0, 1)),
            "hessian": lambda f: jax.hessian(_remat(f)),
        },
        t_vector,
        _j_vector,
        X,
        Y,
    )


def _integrated(f):
    """An ODE with ``f`` in its vector field, solved by JAX's adaptive
    Runge-Kutta ``odeint`` (a while loop), differentiated by its adjoint
    method (a custom_vjp that integrates backwards)."""

    def field(state, t, y):
        return -0.7 * state + jnp.sin(t) * f(state, y)

    def final(x, y):
        return odeint(field, x, jnp.linspace(0.0, 1.0, 3), y)[-1]

    return final


def test_inside_odeint():
    check(
        {
            "solve": lambda f: _integrated(f),
            "adjoint_grad": lambda f: jax.grad(lambda x, y: _integrated(f)(x, y).sum(), argnums=(0, 1)),
        },
        t_vector,
        _j_vector,
        X,
        Y,
        rtol=1e-4,
        atol=1e-4,
    )


def _t_cubic(x, th):
    return x**3 + th * x - 1.0


def _j_cubic(x, th):
    return x**3 + th * x - 1.0


t_cubic = t2j_ad.jaxify(_t_cubic)
TH = jnp.array([1.0, 2.0, 0.5], jnp.float32)


def _rooted(f):
    """The root of ``f(., th)`` by ``lax.custom_root``, with the
    ``tangent_solve`` JAX's docstring gives for a vector root: the Jacobian
    of the linearized residual, by ``jax.jacobian``, then a dense solve."""

    def root(th):
        def newton(residual, x0):
            return jax.lax.fori_loop(0, 30, lambda i, x: x - residual(x) / (3 * x**2 + th), x0)

        def tangent_solve(g, y):
            return jnp.linalg.solve(jax.jacobian(g)(y), y)

        return jax.lax.custom_root(lambda x: f(x, th), jnp.ones_like(th), newton, tangent_solve)

    return root


def test_inside_custom_root_with_a_jacobian_tangent_solve():
    """jax.grad failed in JAX's transpose of the linear solve ("open an
    issue"): the matrix tangent_solve computed depended, through the Jvp
    call, on the right-hand side. A Jvp call is linear in its tangents, so
    its own tangent is the same call (NOTE [a call linear in its tangents])."""
    check(
        {
            "root": _rooted,
            "grad": lambda f: jax.grad(lambda th: jnp.sum(_rooted(f)(th) ** 2)),
            "jacfwd": lambda f: jax.jacfwd(_rooted(f)),
        },
        t_cubic,
        _j_cubic,
        TH,
        rtol=1e-5,
    )


def test_the_tangent_of_a_call_in_its_linear_inputs_is_the_call_itself():
    """Forward mode through a Jvp in its tangent, or a Vjp in its cotangent,
    binds the same call again (first order; batched over jacfwd's basis),
    not Jvp appended to it."""
    tangent = lambda f: lambda t: jax.jvp(lambda x: f(x, Y), (X,), (t,))[1]  # noqa: E731
    cotangent = lambda f: lambda c: jax.vjp(lambda x: f(x, Y), X)[1](c)[0]  # noqa: E731
    transforms = {"of_jvp": lambda f: jax.jacfwd(tangent(f)), "of_vjp": lambda f: jax.jacfwd(cotangent(f))}
    check(transforms, t_vector, _j_vector, T)
    for linear, last in ((tangent, "Jvp"), (cotangent, "Vjp")):
        jaxpr = jax.make_jaxpr(jax.jacfwd(linear(t_vector)))(T).jaxpr
        chains = [[type(t).__name__ for t in e.params["fun"].transforms] for e in jaxpr.eqns if e.primitive.name == "torch_call"]
        derivatives = [[name for name in chain if name in ("Jvp", "Vjp")] for chain in chains]
        assert [last] in derivatives and all(d in ([], [last]) for d in derivatives), chains


def _clipped(f):
    """A user's custom_vjp around f: cotangents of x clipped to [-0.1, 0.1]."""

    @jax.custom_vjp
    def g(x, y):
        return f(x, y)

    def fwd(x, y):
        return f(x, y), (x, y)

    def bwd(res, ct):
        _, pullback = jax.vjp(f, *res)
        gx, gy = pullback(ct)
        return jnp.clip(gx, -0.1, 0.1), gy

    g.defvjp(fwd, bwd)
    return lambda x, y: (g(x, y) ** 2).sum()


def test_inside_user_custom_vjp():
    out = check(lambda f: jax.grad(_clipped(f), argnums=(0, 1)), t_vector, _j_vector, X, Y)
    for mode in MODES:
        assert float(jnp.abs(out[mode][0]).max()) <= 0.1 + 1e-7


# -------------------------------------- multiple, pytree and unused outputs


def _vjp_all_leaves(f):
    def fn(x, y):
        out, pullback = jax.vjp(f, x, y)
        return out, pullback(jax.tree.map(lambda o: jnp.full_like(o, 0.7), out))

    return fn


def _grad_of_leaf(key):
    def transform(f):
        def loss(x, y):
            out = f(x, y)
            leaf = out["nested"]["pair"][0] if key == "pair" else out[key]
            return jnp.sum(leaf)

        return jax.grad(loss, argnums=(0, 1))

    return transform


def test_pytree_outputs():
    # Leaves that do not depend on an input ("const"; "only_y" w.r.t. x) come
    # back as exact zeros, where PyTorch's own gradient is None.
    out = check(
        {
            "jacrev": lambda f: jax.jacrev(f, argnums=(0, 1)),
            "jacfwd": lambda f: jax.jacfwd(f, argnums=(0, 1)),
            "vjp": _vjp_all_leaves,
            "jvp": lambda f: lambda x, y: jax.jvp(f, (x, y), (T, -T)),
            "grad_a": _grad_of_leaf("a"),
            "grad_pair": _grad_of_leaf("pair"),
            "grad_only_y": _grad_of_leaf("only_y"),
            "grad_const": _grad_of_leaf("const"),
        },
        t_tree,
        _j_tree,
        X,
        Y,
    )
    for results in out.values():
        for jac in (results["jacrev"], results["jacfwd"]):
            np.testing.assert_array_equal(jac["const"][0], np.zeros((2, 3)))
            np.testing.assert_array_equal(jac["const"][1], np.zeros((2, 3)))
            np.testing.assert_array_equal(jac["only_y"][0], np.zeros((3, 3)))
        np.testing.assert_array_equal(results["grad_only_y"][0], np.zeros(3))
        np.testing.assert_array_equal(results["grad_const"], np.zeros((2, 3)))


def _t_independent(x, y):
    # Nothing depends on y; the first output depends on no input at all.
    return torch.full((2,), 3.0, device=x.device), x * 2.0


def _j_independent(x, y):
    return jnp.full((2,), 3.0), x * 2.0


t_independent = t2j_ad.jaxify(_t_independent)


def test_outputs_independent_of_inputs_give_zeros():
    out = check(
        {
            "grad": lambda f: jax.grad(lambda x, y: f(x, y)[0].sum() + f(x, y)[1].sum(), argnums=(0, 1)),
            "jacrev": lambda f: jax.jacrev(f, argnums=(0, 1)),
            "jacfwd": lambda f: jax.jacfwd(f, argnums=(0, 1)),
            "hessian": lambda f: jax.hessian(lambda x, y: f(x, y)[1].sum() ** 2, argnums=(0, 1)),
        },
        t_independent,
        _j_independent,
        X,
        Y,
    )
    for results in out.values():
        np.testing.assert_array_equal(results["grad"][1], np.zeros(3))
        np.testing.assert_array_equal(results["jacrev"][0][0], np.zeros((2, 3)))
        np.testing.assert_array_equal(results["jacfwd"][1][1], np.zeros((3, 3)))


def _t_argmax(x):
    return torch.sin(x) * 2.0, torch.argmax(x).to(torch.int32), x.sum()


def _j_argmax(x):
    return jnp.sin(x) * 2.0, jnp.argmax(x).astype(jnp.int32), x.sum()


t_argmax = t2j_ad.jaxify(_t_argmax)


def _uses_argmax(f):
    def loss(x):
        vals, idx, total = f(x)
        return vals[idx] * total + vals.sum()

    return loss


def test_integer_output_alongside_float_outputs():
    out = check(
        {
            "grad": lambda f: jax.grad(_uses_argmax(f)),
            "hessian": lambda f: jax.hessian(_uses_argmax(f)),
            "jvp": lambda f: lambda x: jax.jvp(f, (x,), (T,)),
            "jacfwd": lambda f: jax.jacfwd(lambda x: (f(x)[0], f(x)[2])),
            "jacrev": lambda f: jax.jacrev(lambda x: (f(x)[0], f(x)[2])),
        },
        t_argmax,
        _j_argmax,
        X,
    )
    for results in out.values():
        # The integer output's tangent is float0.
        assert results["jvp"][1][1].dtype == jax.dtypes.float0


# --------------------------------------------------------------- dtypes

DTYPES = ["float16", "bfloat16", "float32", "float64"]


def _t_poly(x):
    return (torch.sin(x) * x + x**2).sum()


def _j_poly(x):
    return (jnp.sin(x) * x + x**2).sum()


t_poly = t2j_ad.jaxify(_t_poly)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_dtype_matches_input(dtype, request):
    if dtype == "float64":
        request.getfixturevalue("x64")
    x = jnp.asarray(np.array([0.5, -1.0, 2.0]), dtype=jnp.dtype(dtype))
    out = check(
        {
            "grad": jax.grad,
            "vjp": lambda f: lambda x: jax.vjp(f, x)[1](jnp.ones((), x.dtype)),
            "jvp": lambda f: lambda x: jax.jvp(f, (x,), (x,)),
            "jacfwd": jax.jacfwd,
            "hessian": jax.hessian,
        },
        t_poly,
        _j_poly,
        x,
    )
    for results in out.values():
        for leaf in jax.tree.leaves(results):
            assert leaf.dtype == jnp.dtype(dtype)


# --------------------------------------------------------------- complex


def _t_real_of_complex(z):
    return (torch.abs(z) ** 2 * torch.cos(z.real) + (torch.sin(z) * z.conj()).imag).sum()


def _j_real_of_complex(z):
    return (jnp.abs(z) ** 2 * jnp.cos(z.real) + (jnp.sin(z) * z.conj()).imag).sum()


def _t_holomorphic(z):
    return z**2 * torch.sin(z) + torch.exp(z) / 3


def _j_holomorphic(z):
    return z**2 * jnp.sin(z) + jnp.exp(z) / 3


def _t_real_to_complex(x):
    return torch.exp(1j * x) * x


def _j_real_to_complex(x):
    return jnp.exp(1j * x) * x


t_real_of_complex = t2j_ad.jaxify(_t_real_of_complex)
t_holomorphic = t2j_ad.jaxify(_t_holomorphic)
t_real_to_complex = t2j_ad.jaxify(_t_real_to_complex)
Z = jnp.array([0.3 + 0.4j, -1.0 + 0.2j, 0.5 - 0.7j], jnp.complex64)
TZ = jnp.array([1.0 - 0.5j, 0.2 + 0.3j, -0.4 + 1.0j], jnp.complex64)


def test_complex_grad_of_real_loss():
    check(
        {
            "grad": jax.grad,
            "vjp": lambda f: lambda z: jax.vjp(f, z)[1](jnp.float32(1.0)),
            "jvp": lambda f: lambda z: jax.jvp(f, (z,), (TZ,)),
            # Second order of a non-holomorphic function: grad of a real
            # directional derivative.
            "grad_of_jvp": lambda f: jax.grad(lambda z: jax.jvp(f, (z,), (TZ,))[1]),
        },
        t_real_of_complex,
        _j_real_of_complex,
        Z,
    )


HOLOMORPHIC_TRANSFORMS = {
    "jvp": lambda f: lambda z: jax.jvp(f, (z,), (TZ.astype(z.dtype),)),
    "vjp": lambda f: lambda z: jax.vjp(f, z)[1](TZ.astype(z.dtype)),
    "grad": lambda f: jax.grad(lambda z: f(z).sum(), holomorphic=True),
    "jacrev": lambda f: jax.jacrev(f, holomorphic=True),
    "jacfwd": lambda f: jax.jacfwd(f, holomorphic=True),
    "hessian": lambda f: jax.hessian(lambda z: f(z).sum(), holomorphic=True),
}


def test_complex_holomorphic():
    check(HOLOMORPHIC_TRANSFORMS, t_holomorphic, _j_holomorphic, Z)


def test_real_input_complex_output():
    check(
        {
            "vjp": lambda f: lambda x: jax.vjp(f, x)[1](TZ),
            "jvp": lambda f: lambda x: jax.jvp(f, (x,), (T,)),
            "grad": lambda f: jax.grad(lambda x: jnp.abs(f(x)).sum() + f(x).imag.sum()),
        },
        t_real_to_complex,
        _j_real_to_complex,
        X,
    )


def test_complex128(x64):
    z = Z.astype(jnp.complex128)
    check(jax.grad, t_real_of_complex, _j_real_of_complex, z)
    check(HOLOMORPHIC_TRANSFORMS, t_holomorphic, _j_holomorphic, z, rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------- bad input


t_int_arg = t2j_ad.jaxify(lambda x, n: (x * n).sum())


@pytest.mark.parametrize("mode", MODES)
def test_grad_with_respect_to_integer_argument_is_jax_error(mode):
    n = jnp.arange(3, dtype=jnp.int32)
    reference = lambda x, n: (x * n).sum()  # noqa: E731
    with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs") as ours:
        run(mode, jax.grad(t_int_arg, argnums=1), X, n)
    with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs") as jaxs:
        run(mode, jax.grad(reference, argnums=1), X, n)
    assert str(ours.value) == str(jaxs.value)
    # The float argument still differentiates.
    assert_tree_allclose(run(mode, jax.grad(t_int_arg), X, n), n.astype(jnp.float32))


def _t_detached(x, y):
    return (x.detach() * y).sum() + (y**2).sum(), x.detach() * 3.0


def _j_detached(x, y):
    return (jax.lax.stop_gradient(x) * y).sum() + (y**2).sum(), jax.lax.stop_gradient(x) * 3.0


t_detached = t2j_ad.jaxify(_t_detached)


def test_detached_input_gives_zero_gradient():
    out = check(
        {
            "grad": lambda f: jax.grad(lambda x, y: f(x, y)[0], argnums=(0, 1)),
            "jacrev": lambda f: jax.jacrev(f, argnums=(0, 1)),
            "jacfwd": lambda f: jax.jacfwd(f, argnums=(0, 1)),
            "hessian": lambda f: jax.hessian(lambda x, y: f(x, y)[0], argnums=(0, 1)),
        },
        t_detached,
        _j_detached,
        X,
        Y,
    )
    for results in out.values():
        np.testing.assert_array_equal(results["grad"][0], np.zeros(3))
        np.testing.assert_array_equal(results["jacrev"][1][0], np.zeros((3, 3)))


# -------------------------------------------- a jaxified function called inside


_inner_sines = t2j_ad.jaxify(lambda v: torch.sin(v) * 2)
_CONSTANT = jnp.linspace(0.5, 1.5, 3, dtype=jnp.float32)


def _t_weighted_by_jax(x):
    """A PyTorch function whose weights come from a jaxified function: a
    constant to every transform around it."""
    return (x**2 * t2j_ad.tree_j2t(_inner_sines(_CONSTANT)).to(x.device)).sum()


def _t_weighted_reference(x):
    return (x**2 * (torch.sin(to_torch(_CONSTANT)) * 2).to(x.device)).sum()


def _j_weighted(x):
    return (x**2 * jnp.sin(_CONSTANT) * 2).sum()


@pytest.mark.parametrize(
    "outer",
    [
        "torch.func.grad",
        "torch.vmap(torch.func.grad)",
        "jax.grad",
        "jax.jit(jax.grad)",
        "jax.hessian",
    ],
)
def test_a_jaxified_function_called_inside_a_derivative_is_a_constant_there(outer):
    """A jaxified function called inside a torch.func transform (the user's
    torch.func.grad, or the derivative of an outer jaxified function JAX
    differentiates) ran inside its levels: functorch refused the runner's
    copy into XLA's output buffer as a write into a captured tensor, and the
    outer derivative blamed the outer function for "writes in place into a
    tensor it keeps between calls". A jitted pure-JAX function in the same
    place worked (NOTE [a call inside torch.func transforms])."""
    x = jnp.asarray([1.0, -2.0, 3.0], jnp.float32)
    if outer.startswith("torch"):
        transform = {
            "torch.func.grad": torch.func.grad,
            "torch.vmap(torch.func.grad)": lambda f: torch.vmap(torch.func.grad(f)),
        }[outer]
        xs = to_torch(x) if outer == "torch.func.grad" else to_torch(jnp.stack([x, 2 * x]))
        got = transform(_t_weighted_by_jax)(xs)
        assert_tree_allclose(to_numpy(got), to_numpy(transform(_t_weighted_reference)(xs)))
        return
    transform = {
        "jax.grad": jax.grad,
        "jax.jit(jax.grad)": lambda f: jax.jit(jax.grad(f)),
        "jax.hessian": jax.hessian,
    }[outer]
    assert_tree_allclose(transform(t2j_ad.jaxify(_t_weighted_by_jax))(x), transform(_j_weighted)(x))


class _OuterWithJaxInside(torch.nn.Module):
    """A module whose forward calls a jaxified closure over its own submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.sub = torch.nn.Linear(3, 3)
        self.inner = t2j_ad.jaxify(lambda v: self.sub(v))

    def forward(self, x):
        return self.lin(x) + t2j_ad.tree_j2t(self.inner(jnp.ones((4, 3), jnp.float32))).sum()


_HELD: dict[str, torch.Tensor] = {}
_inner_reading_held = t2j_ad.jaxify(lambda v: v * _HELD["w"])


def _t_jax_reads_the_differentiated_tensor(w):
    _HELD["w"] = w
    return (w * t2j_ad.tree_j2t(_inner_reading_held(jnp.ones(3, jnp.float32)))).sum()


def _module_gradient() -> dict:
    torch.manual_seed(0)
    apply, params = t2j_ad.jaxify_module(_OuterWithJaxInside())
    return jax.grad(lambda p: apply(p, jnp.ones((1, 3), jnp.float32)).sum())(params)


@pytest.mark.parametrize(
    "outer",
    [
        lambda: torch.func.grad(_t_jax_reads_the_differentiated_tensor)(torch.tensor([1.0, 2.0, 3.0])),
        lambda: torch.vmap(_t_jax_reads_the_differentiated_tensor)(torch.ones(2, 3)),
        lambda: jax.grad(t2j_ad.jaxify(_t_jax_reads_the_differentiated_tensor))(jnp.array([1.0, 2.0, 3.0])),
        _module_gradient,
    ],
    ids=["torch.func.grad", "torch.vmap", "jax.grad", "jax.grad of jaxify_module"],
)
def test_a_jaxified_function_reading_what_a_transform_around_it_maps_is_refused_by_name(outer):
    """A nested jaxified function that reads a tensor the transform around it
    differentiates or batches (w itself; a parameter jaxify_module bound into
    the submodule it closes over) cannot be differentiated through JAX. Run
    inside the levels it failed with the captured-write message (blaming a
    state write); run outside them, functorch read the wrapped tensor as a
    plain one, a gradient of zero where torch.func.grad of w * w gives 2 w.
    It must fail, naming the function and the fix."""
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError, t2j_ad.TorchCallError)) as err:
        outer()
    text = str(err.value)
    assert "PyTorch cannot differentiate or batch through a JAX computation" in text, text[-2000:]
    assert "Jaxify the whole computation" in text and "<lambda> is a jaxified function" in text
    assert "writes in place into a tensor it keeps" not in text
