"""Batching (issue 4): ``jax.vmap`` of jaxify'd functions and of their derivatives.

Every numeric test computes the same math twice -- through a PyTorch function
wrapped by ``t2j_ad.jaxify`` and in ``jax.numpy`` -- under the same JAX
transforms, eagerly and under ``jax.jit``, and compares leaf by leaf. The
semantics of each ``vmap_method`` (what PyTorch actually receives) are checked
by PyTorch functions that record their arguments.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import assert_tree_allclose

import t2j_ad
from t2j_ad.rules.batching import torch_call_batch
from t2j_ad.torch_fn import TorchFn, Vmap

MODES = ["eager", "jit"]
METHODS = ["expand_dims", "broadcast_all", "sequential", "auto"]
# The methods that reach PyTorch differently ("auto" is expand_dims for code
# torch.vmap accepts); used where a table times four would only repeat itself.
DISTINCT_METHODS = ["expand_dims", "broadcast_all", "sequential"]

is_batched = torch._C._functorch.is_batchedtensor
# What JAX raises when the PyTorch function fails at run time.
RUNTIME_ERRORS = (t2j_ad.TorchCallError, jax.errors.JaxRuntimeError)
rng = np.random.default_rng(0)


def randn(*shape: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), dtype=jnp.float32)


def run(mode: str, fn, *args):
    """``fn(*args)``, eagerly or through ``jax.jit``."""
    return (jax.jit(fn) if mode == "jit" else fn)(*args)


def fallback_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, t2j_ad.FallbackWarning)]


def torch_call_eqns(jaxpr) -> list:
    """Every torch_call equation in ``jaxpr``, including nested jaxprs."""
    found = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "torch_call"]
    for sub in jax.extend.core.subjaxprs(jaxpr):
        found.extend(torch_call_eqns(sub))
    return found


# ----------------------------------------------------------------- functions
# Each PyTorch function (_t_*) has a pure-JAX twin (_j_*) on the same math,
# and is jaxify'd once per method at module level, so signature inference and
# built transforms are shared by the tests.


def _t_model(w, x):  # w (4, 3), x (4,) -> (3,)
    return torch.tanh(x @ w)


def _j_model(w, x):
    return jnp.tanh(x @ w)


def _t_loss(w, x, y):  # scalar loss of one example
    return ((torch.tanh(x @ w) - y) ** 2).sum()


def _j_loss(w, x, y):
    return ((jnp.tanh(x @ w) - y) ** 2).sum()


def _t_two(x, v):  # x (3,), v (3,) -> (3,)
    return torch.sin(x) * v.sum() + v


def _j_two(x, v):
    return jnp.sin(x) * v.sum() + v


def _t_tree(d, s):  # {"A": (3, 4), "v": (4,)}, scalar -> {"out": (3,), "n": ()}
    return {"out": torch.tanh(d["A"] @ d["v"]) * s, "n": (d["v"] ** 2).sum() + s}


def _j_tree(d, s):
    return {"out": jnp.tanh(d["A"] @ d["v"]) * s, "n": (d["v"] ** 2).sum() + s}


MODEL = {m: t2j_ad.jaxify(_t_model, vmap_method=m) for m in METHODS}
LOSS = {m: t2j_ad.jaxify(_t_loss, vmap_method=m) for m in METHODS}
TWO = {m: t2j_ad.jaxify(_t_two, vmap_method=m) for m in METHODS}
TREE = {m: t2j_ad.jaxify(_t_tree, vmap_method=m) for m in METHODS}


class Recorder:
    """A PyTorch function that records, per call, which arguments arrive as
    ``torch.vmap`` batched tensors, their (per-example) shapes and, for
    plain tensors, their data pointers."""

    def __init__(self):
        self.calls: list[tuple[tuple[bool, ...], tuple[tuple[int, ...], ...], tuple[int | None, ...]]] = []

    def __call__(self, x, w):
        args = (x, w)
        if x.device.type != "meta":  # shape inference is not a call under test
            self.calls.append(
                (
                    tuple(is_batched(a) for a in args),
                    tuple(tuple(a.shape) for a in args),
                    tuple(None if is_batched(a) else a.data_ptr() for a in args),
                )
            )
        return torch.sin(x) * w.sum()


def _j_recorded(x, w):
    return jnp.sin(x) * w.sum()


# ------------------------------------------------------ the four vmap methods


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["expand_dims", "auto"])
def test_expand_dims_is_one_torch_vmap_call_with_unbatched_args_passed_once(method, mode):
    record = Recorder()
    f = t2j_ad.jaxify(record, vmap_method=method, compile="eager")  # counts eager calls into PyTorch; graph replay: tests/test_graph_mode.py
    x, w = randn(5, 3), randn(2)
    f(x[0], w)  # warm the signature cache; not counted below
    record.calls.clear()
    out = run(mode, jax.vmap(f, in_axes=(0, None)), x, w)
    assert_tree_allclose(out, jax.vmap(_j_recorded, in_axes=(0, None))(x, w))
    # One call; x is a torch.vmap batched tensor of per-example shape, w is a
    # plain tensor (in_dims=None) of its own shape, viewing the JAX buffer.
    assert len(record.calls) == 1
    (flags, shapes, pointers), = record.calls
    assert flags == (True, False)
    assert shapes == ((3,), (2,))
    assert pointers[1] == w.unsafe_buffer_pointer()


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_all_is_one_torch_vmap_call_with_every_arg_batched(mode):
    record = Recorder()
    f = t2j_ad.jaxify(record, vmap_method="broadcast_all")
    x, w = randn(5, 3), randn(2)
    f(x[0], w)
    record.calls.clear()
    out = run(mode, jax.vmap(f, in_axes=(0, None)), x, w)
    assert_tree_allclose(out, jax.vmap(_j_recorded, in_axes=(0, None))(x, w))
    assert record.calls == [((True, True), ((3,), (2,)), (None, None))]


@pytest.mark.parametrize("mode", MODES)
def test_sequential_calls_the_unbatched_function_once_per_element(mode):
    record = Recorder()
    f = t2j_ad.jaxify(record, vmap_method="sequential")
    x, w = randn(5, 3), randn(2)
    f(x[0], w)
    record.calls.clear()
    out = run(mode, jax.vmap(f, in_axes=(0, None)), x, w)
    assert_tree_allclose(out, jax.vmap(_j_recorded, in_axes=(0, None))(x, w))
    assert len(record.calls) == 5
    for flags, shapes, _ in record.calls:
        assert flags == (False, False)
        assert shapes == ((3,), (2,))


def test_jaxify_rejects_unknown_vmap_method():
    with pytest.raises(ValueError, match="vmap_method"):
        t2j_ad.jaxify(_t_model, vmap_method="loop")


# ------------------------------------------------------ auto: the fallback


def _t_item(x):  # .item(): torch.vmap refuses it
    return x * x.sum().item()


def _j_item(x):
    return x * x.sum()


def _t_branch(x):  # data-dependent Python control flow: torch.vmap refuses it
    if x.sum() > 0:
        return x * 2
    return -x


def _j_branch(x):
    return jnp.where(x.sum() > 0, x * 2, -x)


def _t_item_loss(x):
    return (x**2).sum() * x.sum().item()


def _j_item_loss(x):
    return (x**2).sum() * jax.lax.stop_gradient(x.sum())


@pytest.mark.parametrize(
    "torch_fn, jax_fn", [(_t_item, _j_item), (_t_branch, _j_branch)], ids=["item", "control_flow"]
)
def test_auto_falls_back_to_sequential_with_one_warning(torch_fn, jax_fn):
    calls = []

    def counted(x):
        calls.append(is_batched(x))
        return torch_fn(x)

    # vmap_method="auto" is the default; eager: the warnings counted are the vmap fallback's alone.
    f = t2j_ad.jaxify(counted, compile="eager")
    x = randn(4, 3)
    x = x.at[1].multiply(-5.0)  # both branches are taken
    f(x[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_tree_allclose(jax.vmap(f)(x), jax.vmap(jax_fn)(x))
        assert_tree_allclose(jax.jit(jax.vmap(f))(x), jax.vmap(jax_fn)(x))
        # A new batch size is a new transform; still no second warning.
        assert_tree_allclose(jax.jit(jax.vmap(f))(x[:3]), jax.vmap(jax_fn)(x[:3]))
    messages = fallback_warnings(caught)
    assert len(messages) == 1, messages
    assert "torch.vmap refused" in messages[0] and "sequential" in messages[0]
    # The fallback is remembered: a later call goes straight to the loop.
    calls.clear()
    jax.block_until_ready(jax.jit(jax.vmap(f))(x[:3]))
    assert calls == [False] * 3


def test_auto_fallback_applies_to_derivatives_too():
    f = t2j_ad.jaxify(_t_item_loss, compile="eager")  # counts the vmap fallback's warnings alone
    x = randn(4, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mode in MODES:
            got = run(mode, jax.vmap(jax.grad(f)), x)
            assert_tree_allclose(got, jax.vmap(jax.grad(_j_item_loss))(x))
    messages = fallback_warnings(caught)
    assert len(messages) == 1 and "torch.vmap refused" in messages[0], messages


def test_explicit_methods_never_fall_back():
    x = randn(4, 3)
    f = t2j_ad.jaxify(_t_item, vmap_method="expand_dims", compile="eager")  # no graph-mode warning either
    with pytest.raises(RUNTIME_ERRORS, match=r"\.item\(\)") as refused:
        jax.block_until_ready(jax.vmap(f)(x))
    # PyTorch's reason, then what would run it
    assert "vmap_method='auto' falls back to a loop" in str(refused.value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jax.vmap(t2j_ad.jaxify(_t_item, vmap_method="sequential", compile="eager"))(x)
    assert_tree_allclose(got, jax.vmap(_j_item)(x))
    assert fallback_warnings(caught) == []


def test_an_explicit_method_names_the_others_when_torch_vmap_raises_a_value_error():
    """torch.vmap refuses an inner vmap's unbatched output (out_dims=None of a
    value that depends on the batch) with a ValueError, which lacked the hint
    its RuntimeErrors get (tenth fuzzing pass); 'auto' loops, as the hint says."""

    def f(u):
        return torch.vmap(lambda r: (r * 2, u.sum()), out_dims=(0, None))(u)

    batch = randn(2, 4, 3)
    with pytest.raises(RUNTIME_ERRORS, match="out_dim is None") as refused:
        jax.block_until_ready(jax.vmap(t2j_ad.jaxify(f, vmap_method="expand_dims", compile="eager"))(batch))
    assert "vmap_method='auto' falls back to a loop" in str(refused.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", t2j_ad.FallbackWarning)
        doubled, totals = jax.vmap(t2j_ad.jaxify(f, compile="eager"))(batch)
    assert_tree_allclose(doubled, batch * 2)
    assert_tree_allclose(totals, batch.sum(axis=(1, 2)))


class _FirstRowVmapRule(torch.autograd.Function):
    """2 * x whose vmap rule returns the first batch row only: the wrong shape,
    as torch 2.13's batching of mse_loss gave under two vmaps that batch its
    arguments at different levels, at batch size 1."""

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2

    @staticmethod
    def vmap(info, in_dims, x):
        return (x.movedim(in_dims[0], 0) * 2)[:1], 0


def test_a_batching_rule_that_returns_the_wrong_shape():
    x = randn(4, 3)
    auto = t2j_ad.jaxify(_FirstRowVmapRule.apply, compile="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_tree_allclose(jax.vmap(auto)(x), 2 * x)  # auto: counted as a refusal, the loop is right
    messages = fallback_warnings(caught)
    assert len(messages) == 1, messages
    assert "torch.vmap returned output 0 with shape (1, 3), but batching gives (4, 3)" in messages[0]
    # expand_dims keeps torch.vmap's answer, and the error says what to do.
    expand_dims = t2j_ad.jaxify(_FirstRowVmapRule.apply, vmap_method="expand_dims", compile="eager")
    expected = r"has shape \(1, 3\), but \(4, 3\) was expected, as JAX's rules give .*'sequential' or 'broadcast_all'"
    with pytest.raises(RUNTIME_ERRORS, match=expected):
        jax.block_until_ready(jax.vmap(expand_dims)(x))


def test_auto_reraises_errors_that_are_not_about_vmap():
    def broken(x):
        raise ValueError("broken on purpose")

    f = t2j_ad.jaxify(broken, output_shapes=jax.ShapeDtypeStruct((3,), jnp.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RUNTIME_ERRORS, match="broken on purpose"):
            jax.block_until_ready(jax.vmap(f)(randn(4, 3)))
    assert fallback_warnings(caught) == []


# ------------------------------------------------------ in_axes and out_axes

# (in_axes for (w, x) of _t_model, out_axes)
AXES = [
    ((None, 0), 0),
    ((None, 1), 0),
    ((None, -1), 0),
    ((0, None), 0),
    ((1, None), 1),
    ((-1, 0), -1),
    ((2, -2), 1),
    ((-3, 0), -2),
]


def _batched(base: jax.Array, axis: int | None, size: int) -> jax.Array:
    """A batch of ``size`` versions of ``base`` stacked along ``axis``."""
    if axis is None:
        return base
    stacked = jnp.stack([base * (1 + 0.1 * i) for i in range(size)])
    return jnp.moveaxis(stacked, 0, axis)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("in_axes, out_axes", AXES, ids=[f"in{a}-out{o}" for a, o in AXES])
def test_in_axes_and_out_axes(in_axes, out_axes, method, mode):
    w = _batched(randn(4, 3), in_axes[0], 5)
    x = _batched(randn(4), in_axes[1], 5)
    got = run(mode, jax.vmap(MODEL[method], in_axes=in_axes, out_axes=out_axes), w, x)
    assert_tree_allclose(got, jax.vmap(_j_model, in_axes=in_axes, out_axes=out_axes)(w, x))


# (in_axes, out_axes) for _t_tree(d, s)
TREE_AXES = [
    (({"A": 1, "v": None}, 0), {"out": -1, "n": 0}),
    (({"A": None, "v": 0}, None), 0),
    ((0, None), {"out": 0, "n": 0}),  # a prefix: every leaf of d at 0
    (({"A": -1, "v": 0}, 0), {"out": 1, "n": 0}),
]


def _tree_inputs(in_axes, size: int):
    d_axes, s_axis = in_axes
    d = {"A": randn(3, 4), "v": randn(4)}
    if not isinstance(d_axes, dict):
        d_axes = {k: d_axes for k in d}
    d = {k: _batched(v, d_axes[k], size) for k, v in d.items()}
    return d, _batched(jnp.float32(1.5), s_axis, size)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", range(len(TREE_AXES)))
def test_pytree_in_axes_and_out_axes(case, method, mode):
    in_axes, out_axes = TREE_AXES[case]
    d, s = _tree_inputs(in_axes, 5)
    got = run(mode, jax.vmap(TREE[method], in_axes=in_axes, out_axes=out_axes), d, s)
    assert_tree_allclose(got, jax.vmap(_j_tree, in_axes=in_axes, out_axes=out_axes)(d, s))


# ------------------------------------------------------------- nested vmap


def _nest2(f):
    # x (a, 3), v (b, 3) -> (b, a, 3)
    return jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(None, 0))


def _nest3(f):
    # x (a, c, 3) batched at 1, v (c, b, 3) batched at 0 -> (b, a, 3, c)
    return jax.vmap(_nest2(f), in_axes=(1, 0), out_axes=-1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS)
def test_nested_vmap_two_levels(method, mode):
    x, v = randn(4, 3), randn(2, 3)
    got = run(mode, _nest2(TWO[method]), x, v)
    assert got.shape == (2, 4, 3)
    assert_tree_allclose(got, _nest2(_j_two)(x, v))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS)
def test_nested_vmap_three_levels(method, mode):
    x, v = randn(4, 2, 3), randn(2, 3, 3)
    got = run(mode, _nest3(TWO[method]), x, v)
    assert got.shape == (3, 4, 3, 2)
    assert_tree_allclose(got, _nest3(_j_two)(x, v))


def test_nested_vmap_is_one_call_of_nested_torch_vmap():
    record = Recorder()
    f = t2j_ad.jaxify(record, vmap_method="expand_dims")
    x, w = randn(4, 2, 3), randn(2, 3, 2)
    f(x[0, 0], w[0, 0])
    record.calls.clear()
    got = jax.jit(_nest3(f))(x, w)
    assert_tree_allclose(got, _nest3(_j_recorded)(x, w))
    assert [flags for flags, _, _ in record.calls] == [(True, True)]
    eqns = torch_call_eqns(jax.make_jaxpr(_nest3(f))(x, w).jaxpr)
    assert [[t.axis_size for t in e.params["fun"].transforms] for e in eqns] == [[4, 3, 2]]


# --------------------------------------- vmap of derivatives, derivatives of vmap

W, X, Y, T = randn(4, 3), randn(5, 4), randn(5, 3), randn(5, 4)

# name -> (transform of (loss, model), arguments)
DERIVATIVES = {
    "vmap(grad)": (lambda loss, model: jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)), (W, X, Y)),
    "vmap(grad) wrt batched": (
        lambda loss, model: jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, 0, 0)),
        (W, X, Y),
    ),
    "grad(vmap)": (
        lambda loss, model: jax.grad(lambda w, x, y: jax.vmap(loss, in_axes=(None, 0, 0))(w, x, y).sum()),
        (W, X, Y),
    ),
    "vmap(hessian)": (lambda loss, model: jax.vmap(jax.hessian(loss), in_axes=(None, 0, 0)), (W, X, Y)),
    "hessian(vmap)": (
        lambda loss, model: jax.hessian(lambda w, x, y: jax.vmap(loss, in_axes=(None, 0, 0))(w, x, y).sum()),
        (W, X, Y),
    ),
    "vmap(jvp)": (
        lambda loss, model: jax.vmap(
            lambda w, x, t: jax.jvp(lambda x: model(w, x), (x,), (t,)), in_axes=(None, 0, 0)
        ),
        (W, X, T),
    ),
    "vmap(jvp) over tangents only": (
        lambda loss, model: jax.vmap(lambda t: jax.jvp(lambda x: model(W, x), (X[0],), (t,))),
        (T,),
    ),
    "vmap(vjp)": (
        lambda loss, model: jax.vmap(
            lambda w, x, y: jax.vjp(model, w, x)[1](y), in_axes=(None, 0, 0)
        ),
        (W, X, Y),
    ),
    "jacrev(vmap)": (lambda loss, model: jax.jacrev(jax.vmap(model, in_axes=(None, 0)), argnums=(0, 1)), (W, X)),
    "jacfwd(vmap)": (lambda loss, model: jax.jacfwd(jax.vmap(model, in_axes=(None, 0)), argnums=(0, 1)), (W, X)),
    "vmap(jacrev)": (lambda loss, model: jax.vmap(jax.jacrev(model, argnums=(0, 1)), in_axes=(None, 0)), (W, X)),
    "vmap(vmap(grad))": (
        lambda loss, model: jax.vmap(jax.vmap(jax.grad(loss), in_axes=(None, 0, None)), in_axes=(None, None, 0)),
        (W, X, Y),
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", DISTINCT_METHODS)
@pytest.mark.parametrize("name", list(DERIVATIVES))
def test_vmap_and_derivatives_compose(name, method, mode):
    transform, args = DERIVATIVES[name]
    got = run(mode, transform(LOSS[method], MODEL[method]), *args)
    assert_tree_allclose(got, transform(_j_loss, _j_model)(*args), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("size", [0, 1])
@pytest.mark.parametrize("mode", MODES)
def test_batch_size_zero_and_one(size, method, mode):
    w, x, y = W, X[:size], Y[:size]
    got = run(mode, jax.vmap(MODEL[method], in_axes=(None, 0)), w, x)
    assert got.shape == (size, 3)
    assert_tree_allclose(got, jax.vmap(_j_model, in_axes=(None, 0))(w, x))
    grads = run(mode, jax.vmap(jax.grad(LOSS[method]), in_axes=(None, 0, 0)), w, x, y)
    assert_tree_allclose(grads, jax.vmap(jax.grad(_j_loss), in_axes=(None, 0, 0))(w, x, y))


@pytest.mark.parametrize("method", DISTINCT_METHODS)
def test_per_example_gradients_in_float64(method, x64):
    w, x, y = (np.asarray(a, dtype=np.float64) for a in (W, X, Y))
    got = jax.jit(jax.vmap(jax.grad(LOSS[method]), in_axes=(None, 0, 0)))(w, x, y)
    assert got.dtype == np.float64
    assert_tree_allclose(got, jax.vmap(jax.grad(_j_loss), in_axes=(None, 0, 0))(w, x, y))


# ---------------------------------------------- the rule with nothing batched


def test_batching_rule_with_no_batched_argument_returns_the_unbatched_call():
    f = MODEL["expand_dims"]
    entry, arrays = f._signature_for((W, X[0]), {})
    fun = TorchFn.of(entry.base)

    def direct(w, x):
        outs, dims = torch_call_batch([w, x], [None, None], fun=fun)
        assert dims == [None]
        return outs

    jaxpr = jax.make_jaxpr(direct)(W, X[0])
    (eqn,) = torch_call_eqns(jaxpr.jaxpr)
    assert eqn.params["fun"] == fun  # no Vmap appended
    assert_tree_allclose(direct(W, X[0])[0], _j_model(W, X[0]))


@pytest.mark.parametrize("mode", MODES)
def test_unbatched_call_inside_vmap_and_jacfwd(mode):
    f = MODEL["expand_dims"]
    # The call on constants inside vmap reaches the batching rule with no
    # batched argument; so does the primal call inside jacfwd.
    closed = jax.vmap(lambda b: f(W, X[0]) + b)
    assert_tree_allclose(run(mode, closed, Y), jax.vmap(lambda b: _j_model(W, X[0]) + b)(Y))
    transforms = [e.params["fun"].transforms for e in torch_call_eqns(jax.make_jaxpr(closed)(Y).jaxpr)]
    assert transforms == [()]
    got = run(mode, jax.jacfwd(f, argnums=1), W, X[0])
    assert_tree_allclose(got, jax.jacfwd(_j_model, argnums=1)(W, X[0]))


# ------------------------------------------------- custom autograd.Function


class _ExpDerivatives(torch.autograd.Function):
    """exp's derivative rules, shared by the two exp Functions below."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y

    @staticmethod
    def jvp(ctx, t):
        (y,) = ctx.saved_tensors
        return t * y


class ExpWithVmapRule(_ExpDerivatives):
    """exp with a hand-written vmap staticmethod that counts its calls."""

    vmap_calls: list[tuple[int | None, ...]] = []

    @staticmethod
    def forward(x):
        return x.exp()

    @staticmethod
    def vmap(info, in_dims, x):
        ExpWithVmapRule.vmap_calls.append(tuple(in_dims))
        return ExpWithVmapRule.apply(x), in_dims[0]


class ScaleNeedsAllBatched(torch.autograd.Function):
    """x * s whose vmap rule refuses unbatched arguments, as some do."""

    vmap_calls: list[tuple[int | None, ...]] = []

    @staticmethod
    def forward(x, s):
        return x * s

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError

    @staticmethod
    def vmap(info, in_dims, x, s):
        ScaleNeedsAllBatched.vmap_calls.append(tuple(in_dims))
        if None in in_dims:
            raise RuntimeError("ScaleNeedsAllBatched.vmap needs every argument batched")
        x = x.movedim(in_dims[0], 0)
        s = s.movedim(in_dims[1], 0)
        return ScaleNeedsAllBatched.apply(x, s.reshape(s.shape + (1,) * (x.dim() - s.dim()))), 0


class ExpGenerated(_ExpDerivatives):
    """exp whose vmap rule PyTorch generates from forward."""

    generate_vmap_rule = True
    forward_calls: list[tuple[bool, tuple[int, ...]]] = []

    @staticmethod
    def forward(x):
        if x.device.type != "meta":
            ExpGenerated.forward_calls.append((is_batched(x), tuple(x.shape)))
        return x.exp()


@pytest.mark.parametrize("mode", MODES)
def test_autograd_function_vmap_staticmethod_is_used(mode):
    f = t2j_ad.jaxify(lambda x: ExpWithVmapRule.apply(x) * 2, vmap_method="expand_dims")
    x = randn(5, 3)
    ExpWithVmapRule.vmap_calls.clear()
    assert_tree_allclose(run(mode, jax.vmap(f), x), jax.vmap(lambda x: jnp.exp(x) * 2)(x))
    assert ExpWithVmapRule.vmap_calls == [(0,)]
    # Derivatives of it batch through the same rule.
    ExpWithVmapRule.vmap_calls.clear()
    loss = lambda x: f(x).sum()  # noqa: E731
    got = run(mode, jax.vmap(jax.grad(loss)), x)
    assert_tree_allclose(got, jax.vmap(jax.grad(lambda x: (jnp.exp(x) * 2).sum()))(x))
    assert ExpWithVmapRule.vmap_calls and all(d == (0,) for d in ExpWithVmapRule.vmap_calls)


@pytest.mark.parametrize("mode", MODES)
def test_autograd_function_that_needs_every_argument_batched_uses_broadcast_all(mode):
    fn = lambda x, s: ScaleNeedsAllBatched.apply(x, s)  # noqa: E731
    x, s = randn(5, 3), jnp.float32(2.5)
    expected = jax.vmap(lambda x, s: x * s, in_axes=(0, None))(x, s)
    ScaleNeedsAllBatched.vmap_calls.clear()
    got = run(mode, jax.vmap(t2j_ad.jaxify(fn, vmap_method="broadcast_all"), in_axes=(0, None)), x, s)
    assert_tree_allclose(got, expected)
    assert ScaleNeedsAllBatched.vmap_calls == [(0, 0)]
    # expand_dims hands the rule in_dims=None for s, which this rule refuses.
    with pytest.raises(RUNTIME_ERRORS, match="needs every argument batched"):
        jax.block_until_ready(
            run(mode, jax.vmap(t2j_ad.jaxify(fn, vmap_method="expand_dims"), in_axes=(0, None)), x, s)
        )


@pytest.mark.parametrize("mode", MODES)
def test_autograd_function_with_generated_vmap_rule(mode):
    f = t2j_ad.jaxify(lambda x: ExpGenerated.apply(x) + 1, vmap_method="expand_dims")
    x = randn(5, 3)
    f(x[0])
    ExpGenerated.forward_calls.clear()
    assert_tree_allclose(run(mode, jax.vmap(f), x), jax.vmap(lambda x: jnp.exp(x) + 1)(x))
    # One forward, on a batched tensor: torch.vmap ran the generated rule.
    assert ExpGenerated.forward_calls == [(True, (3,))]
    got = run(mode, jax.vmap(jax.grad(lambda x: f(x).sum())), x)
    assert_tree_allclose(got, jax.vmap(jax.grad(lambda x: (jnp.exp(x) + 1).sum()))(x))
    got = run(mode, jax.vmap(jax.jacfwd(f)), x)
    assert_tree_allclose(got, jax.vmap(jax.jacfwd(lambda x: jnp.exp(x) + 1))(x))


# ------------------------------- one batched PyTorch call per derivative level


def _t_counted(x):
    _t_counted.calls += 1
    return torch.sin(x) * x.sum()


_t_counted.calls = 0


def _j_counted(x):
    return jnp.sin(x) * x.sum()


# Eager: these count calls of the Python function, which graph replay skips.
COUNTED = {m: t2j_ad.jaxify(_t_counted, vmap_method=m, compile="eager") for m in ("expand_dims", "sequential")}
JACOBIANS = {
    "jacrev": jax.jacrev,
    "jacfwd": jax.jacfwd,
    "hessian": lambda f: jax.hessian(lambda x: f(x).sum()),
}


def _runtime_calls(fn, x) -> int:
    jax.block_until_ready(fn(x))  # trace, infer, compile
    _t_counted.calls = 0
    jax.block_until_ready(fn(x))
    return _t_counted.calls


@pytest.mark.parametrize("name", list(JACOBIANS))
def test_jacobians_make_one_batched_call_per_level(name):
    jacobian = JACOBIANS[name]
    levels = 2 if name == "hessian" else 1
    eqn_counts, runtime, runtime_eager = {}, {}, {}
    for n in (3, 8):
        x = randn(n)
        fn = jacobian(COUNTED["expand_dims"])
        assert_tree_allclose(jax.jit(fn)(x), jacobian(_j_counted)(x))
        eqns = torch_call_eqns(jax.make_jaxpr(fn)(x).jaxpr)
        eqn_counts[n] = len(eqns)
        # Every batched call covers a whole basis (size n, or 1 for the
        # cotangent of a scalar), never one basis vector per call.
        for eqn in eqns:
            sizes = [t.axis_size for t in eqn.params["fun"].transforms if isinstance(t, Vmap)]
            assert len(sizes) <= levels and set(sizes) <= {1, n}, eqn.params["fun"].transforms
        # What actually runs: the compiled program's custom calls, each
        # calling the PyTorch function once.
        hlo = jax.jit(fn).lower(x).compile().as_text()
        custom_calls = len(re.findall(r"custom-call\(", hlo))
        runtime[n] = _runtime_calls(jax.jit(fn), x)
        assert runtime[n] == custom_calls
        runtime_eager[n] = _runtime_calls(fn, x)
    assert eqn_counts[3] == eqn_counts[8] <= 2 * levels + 1
    assert runtime[3] == runtime[8] == 1
    assert runtime_eager[3] == runtime_eager[8] == eqn_counts[3]
    # The counter does count: the sequential method calls once per vector.
    x = randn(3)
    assert _runtime_calls(jax.jit(jacobian(COUNTED["sequential"])), x) >= 3


@pytest.mark.parametrize("vmap_method", ["sequential", "expand_dims"])
def test_vmap_over_an_empty_batch(vmap_method):
    # No row to compute: the outputs are empty arrays of the batched shapes.
    f = t2j_ad.jaxify(lambda x: (torch.sin(x), x.sum()), vmap_method=vmap_method)
    x = jnp.zeros((0, 3), jnp.float32)
    assert_tree_allclose(jax.jit(jax.vmap(f))(x), jax.vmap(lambda x: (jnp.sin(x), x.sum()))(x))


@pytest.mark.parametrize("compile", ["eager", "graph"])
def test_a_time_limit_raised_during_a_first_vmap_attempt_is_not_taken_for_a_refusal(compile):
    # A notebook's time limit (a signal handler raising TimeoutError) fired
    # inside the first torch.vmap attempt or the trace: the call went on by
    # the sequential loop (or eagerly), swallowing it, and kept that path.
    fired = []

    def slow(t):
        if not fired:
            fired.append(1)
            raise TimeoutError("cell time limit exceeded")
        return torch.sin(t) * 2

    f = jax.jit(jax.vmap(t2j_ad.jaxify(slow, output_shapes=jax.ShapeDtypeStruct((3,), jnp.float32), compile=compile)))
    xs = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Exception, match="cell time limit exceeded"):
            jax.block_until_ready(f(xs))
        assert_tree_allclose(f(xs), jnp.sin(xs) * 2, rtol=1e-6)
    assert not [str(w.message) for w in caught if issubclass(w.category, t2j_ad.FallbackWarning)]
