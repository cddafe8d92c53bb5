"""t2j_ad.compat: torch2jax's API on t2j_ad's engine.

The first tests are the examples of torch2jax's README and docstrings, held
against the same math in pure JAX; the rest take its documented behaviour
one point at a time.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import TORCH_DEVICE, assert_tree_allclose

from t2j_ad import FallbackWarning, TorchCallError
from t2j_ad.compat import (
    Size,
    Torch2JaxInputError,
    dtype_j2t,
    dtype_t2j,
    j2t,
    t2j,
    torch2jax,
    torch2jax_with_vjp,
    torch2jax_without_vjp,
    tree_j2t,
    tree_t2j,
)
from t2j_ad.rules import fallbacks

# The hessian of MSELoss takes the double-vjp path (PyTorch's forward-mode
# formula for mse_loss_backward refuses), which says so with a FallbackWarning.
pytestmark = pytest.mark.filterwarnings("ignore::t2j_ad.FallbackWarning")


def randn(*shape, dtype=torch.float32):
    """An example or input tensor where JAX computes (``TORCH_DEVICE``), as a
    torch2jax user on a GPU makes them: ``tree_t2j`` keeps the device."""
    return torch.randn(*shape, dtype=dtype, device=TORCH_DEVICE)


def _cross_entropy(x, y):
    return -jnp.mean(jax.nn.log_softmax(x)[jnp.arange(x.shape[0]), y])


def _mse(a, b):
    return jnp.mean((a - b) ** 2)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# ------------------------------------------------------- README examples


@pytest.mark.parametrize("use_x64", [False, True])
def test_cross_entropy_integer_target_and_linear_model(use_x64):
    # torch2jax_with_vjp's docstring example. torch.randint gives an int64
    # target; with x64 off it reaches JAX as int32 and PyTorch as int64 again.
    with jax.enable_x64(use_x64):
        torch_fn = lambda x, y: torch.nn.CrossEntropyLoss()(x, y)  # noqa: E731
        xt, yt = randn(10, 5), torch.randint(0, 5, (10,), device=TORCH_DEVICE)
        jax_fn = jax.jit(torch2jax_with_vjp(torch_fn, xt, yt))
        x, y = tree_t2j((xt, yt))
        assert y.dtype == (jnp.int64 if use_x64 else jnp.int32)

        assert_tree_allclose(jax_fn(x, y), _cross_entropy(x, y))
        g = jax.grad(jax_fn, argnums=0)(x, y)
        assert g.shape == (10, 5)
        assert_tree_allclose(g, jax.grad(_cross_entropy)(x, y))

        lin_model = lambda z, W, b: z @ W + b  # noqa: E731
        z, W, b = tree_t2j([randn((10, 20)), randn(20, 5), randn(5)])
        dW, db = jax.grad(lambda z, W, b: jax_fn(lin_model(z, W, b), y), argnums=(1, 2))(z, W, b)
        ref_dW, ref_db = jax.grad(lambda z, W, b: _cross_entropy(lin_model(z, W, b), y), argnums=(1, 2))(z, W, b)
        assert (dW.shape, db.shape) == ((20, 5), (5,))
        assert_tree_allclose((dW, db), (ref_dW, ref_db))


def test_multiple_outputs():
    layer = torch.nn.Linear(2, 20).to(TORCH_DEVICE)

    def torch_fn(a, b):
        return a + b, torch.norm(a), layer(a * b)

    shape = (10, 2)
    a, b = randn(shape), randn(shape)
    jax_fn = torch2jax(torch_fn, a, b)
    w, bias = tree_t2j((layer.weight, layer.bias))

    def ref(a, b):
        return a + b, jnp.linalg.norm(a), (a * b) @ w.T + bias

    x, y = tree_t2j((randn(shape), randn(shape)))
    assert_tree_allclose(jax_fn(x, y), ref(x, y))
    assert_tree_allclose(jax.jit(jax_fn)(x, y), ref(x, y))


def test_multiple_outputs_readme_verbatim():
    # The README builds the layer inside the function, so its weights change
    # every call: only the first two outputs have a reference.
    def torch_fn(a, b):
        layer = torch.nn.Linear(2, 20).to(a)
        return a + b, torch.norm(a), layer(a * b)

    a, b = randn(10, 2), randn(10, 2)
    x, y, z = jax.jit(torch2jax(torch_fn, a, b))(*tree_t2j((a, b)))
    assert_tree_allclose((x, y), tree_t2j((a + b, torch.norm(a))))
    assert z.shape == (10, 20)


def test_mse_loss_depth_2():
    xt, yt = randn(6), randn(6)
    jax_fn = torch2jax_with_vjp(lambda a, b: torch.nn.MSELoss()(a, b), xt, yt, depth=2)
    g_fn = jax.grad(jax_fn, argnums=(0, 1))
    x, y = tree_t2j((randn(6), randn(6)))
    ref = jax.grad(_mse, argnums=(0, 1))
    assert_tree_allclose(g_fn(x, y), ref(x, y))
    assert_tree_allclose(jax.jit(g_fn)(x, y), ref(x, y))


def test_mse_loss_beyond_depth():
    # What torch2jax cannot do: forward mode, jax.hessian, batched gradients.
    jax_fn = torch2jax_with_vjp(lambda a, b: torch.nn.MSELoss()(a, b), randn(6), randn(6), depth=2)
    x, y = tree_t2j((randn(6), randn(6)))
    assert_tree_allclose(jax.hessian(jax_fn, argnums=(0, 1))(x, y), jax.hessian(_mse, argnums=(0, 1))(x, y))
    assert_tree_allclose(jax.jacfwd(jax.grad(jax_fn))(x, y), jax.hessian(_mse)(x, y))
    assert_tree_allclose(jax.jvp(jax_fn, (x, y), (y, x)), jax.jvp(_mse, (x, y), (y, x)))
    xs = jnp.stack([x, 2 * x, 3 * x])
    batched = jax.vmap(jax.grad(jax_fn), (0, None))
    assert_tree_allclose(batched(xs, y), jax.vmap(jax.grad(_mse), (0, None))(xs, y))


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_depth_is_accepted_and_ignored(depth):
    jax_fn = torch2jax_with_vjp(lambda x: torch.sin(x).sum(), randn(3), depth=depth)
    x = jnp.array([0.1, 0.7, -1.3])
    third = lambda f: jax.grad(jax.grad(jax.grad(lambda s: f(s * x))))  # noqa: E731
    assert_tree_allclose(third(jax_fn)(0.9), third(lambda v: jnp.sin(v).sum())(0.9))


def test_single_output_ways_of_wrapping():
    def torch_fn(a, b):
        return a + b

    shape = (10, 2)
    a, b = randn(shape), randn(shape)
    wrapped = [
        torch2jax(torch_fn, a, b),
        torch2jax(torch_fn, a, b, output_shapes=Size(a.shape)),
        torch2jax(
            torch_fn,
            jax.ShapeDtypeStruct(a.shape, dtype_t2j(a.dtype)),
            jax.ShapeDtypeStruct(b.shape, dtype_t2j(b.dtype)),
            output_shapes=jax.ShapeDtypeStruct(a.shape, dtype_t2j(a.dtype)),
        ),
        torch2jax(torch_fn, *tree_t2j((a, b))),  # JAX arrays as examples
    ]
    key = jax.random.PRNGKey(0)
    x, y = jax.random.normal(key, shape), jax.random.normal(jax.random.PRNGKey(1), shape)
    for jax_fn in wrapped:
        assert_tree_allclose(jax_fn(x, y), x + y)
        assert_tree_allclose(jax.jit(jax_fn)(x, y), x + y)


# ---------------------------------------------------------- output_shapes


def _counting(fn):
    calls = []

    def counted(*args, **kwargs):
        calls.append(jax.tree.leaves((args, kwargs))[0].device.type)
        return fn(*args, **kwargs)

    return counted, calls


@pytest.mark.parametrize("wrap", [torch2jax, torch2jax_with_vjp])
@pytest.mark.parametrize(
    "output_shapes",
    [Size([4, 3]), jax.ShapeDtypeStruct((4, 3), jnp.float32), (4, 3), [Size([4, 3])]],
    ids=["Size", "ShapeDtypeStruct", "tuple", "list"],
)
def test_output_shapes_given_means_no_inference_run(wrap, output_shapes):
    fn, calls = _counting(lambda x: 2 * x)
    jax_fn = wrap(fn, randn(4, 3), output_shapes=output_shapes)
    assert calls == []
    x = jnp.ones((4, 3))
    out = jax_fn(x)
    assert "meta" not in calls
    expected = 2 * x
    assert_tree_allclose(out, [expected] if isinstance(output_shapes, list) else expected)


@pytest.mark.parametrize("wrap", [torch2jax, torch2jax_with_vjp])
def test_without_output_shapes_runs_once_on_meta(wrap):
    fn, calls = _counting(lambda x: 2 * x)
    jax_fn = wrap(fn, randn(4, 3))
    assert calls == ["meta"]
    assert_tree_allclose(jax_fn(jnp.ones((4, 3))), 2 * jnp.ones((4, 3)))
    assert calls.count("meta") == 1


@pytest.mark.parametrize("wrap", [torch2jax, torch2jax_with_vjp])
def test_inference_runs_on_meta_without_grad_and_calls_with_grad(wrap):
    """torch2jax infers output shapes on meta tensors without grad (its
    suite's test_shape_inference checks it); since calls run with grad mode
    on (NOTE [calls run with grad mode on]), inference ran with it too."""
    seen = []

    def fn(x):
        seen.append((x.device.type, torch.is_grad_enabled()))
        return 2 * x

    jax_fn = wrap(fn, randn(4, 3))
    assert seen == [("meta", False)]
    assert_tree_allclose(jax.grad(lambda x: jax_fn(x).sum())(jnp.ones((4, 3))), 2 * jnp.ones((4, 3)))
    assert seen[1:] and all(on_grad for device, on_grad in seen[1:] if device != "meta"), seen


def _doubled(x):
    return x * 2


def test_output_shapes_of_numpy_integers_are_shapes():
    """np.prod(shape) is a NumPy integer, which has .shape and .dtype: the
    shape (6,) was read as one 0-d int32 output, and the call refused the
    function's (6,) output as "() was expected, as declared by output_shapes"."""
    xt = randn(2, 3)
    flat = torch2jax(lambda x: x.reshape(-1), xt, output_shapes=(np.prod(xt.shape),))
    assert_tree_allclose(flat(jnp.ones((2, 3))), jnp.ones(6))
    doubled = torch2jax(_doubled, xt, output_shapes=tuple(np.array(xt.shape)))
    assert_tree_allclose(doubled(jnp.ones((2, 3))), 2 * jnp.ones((2, 3)))


@pytest.mark.parametrize("wrap", [torch2jax, torch2jax_with_vjp])
def test_a_wrapped_module_level_function_pickles(wrap):
    """pickle failed naming the user's function ("not the same object as
    test_compat._doubled"), which does pickle: the wrapper's closure carried its name."""
    import pickle

    jax_fn = wrap(_doubled, randn(3), output_shapes=Size([3]))
    again = pickle.loads(pickle.dumps(jax_fn))
    x = jnp.arange(3.0)
    assert_tree_allclose(again(x), 2 * x)
    assert_tree_allclose(jax.grad(lambda x: again(x).sum())(x), 2 * jnp.ones(3))


def test_j2t_of_a_float0_gradient_is_refused_by_name():
    """jax.grad(..., allow_int=True) gives integer inputs float0 gradients:
    j2t raised AttributeError: 'TypedNdArray' object has no attribute 'devices'."""
    g = jax.grad(lambda x, i: (x * i).sum(), argnums=1, allow_int=True)(jnp.ones(2), jnp.arange(2))
    for via in ("dlpack", "host"):
        with pytest.raises(TypeError, match="j2t: x has dtype float0"):
            j2t(g, via=via)


def test_output_shapes_pytrees():
    def torch_fn(x, y):
        return {"sum": x + y, "parts": (x.sum(), y.argmax())}

    xt, yt = randn(5), randn(5)
    output_shapes = {
        "sum": Size([5]),
        "parts": [jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)],
    }
    jax_fn = torch2jax(torch_fn, xt, yt, output_shapes=output_shapes)
    x, y = tree_t2j((xt, yt))
    # Leaves are matched in order, so the declared list takes the returned tuple.
    expected = {"sum": x + y, "parts": [x.sum(), y.argmax().astype(jnp.int32)]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # int64 -> int32 as torch2jax does: silently
        assert_tree_allclose(jax_fn(x, y), expected)


def test_bare_shape_takes_the_examples_float_dtype(x64):
    jax_fn = torch2jax(lambda x, i: x[i], randn(5, dtype=torch.float64), torch.tensor(2), output_shapes=Size([]))
    x = jnp.arange(5.0, dtype=jnp.float64)
    out = jax_fn(x, jnp.asarray(2, jnp.int64))
    assert out.dtype == jnp.float64 and float(out) == 2.0


@pytest.mark.parametrize(
    "examples, match",
    [
        ((torch.tensor([1, 2]),), "no floating dtype"),
        ((randn(2), randn(2, dtype=torch.float16)), "float16, float32"),
    ],
)
def test_bare_shape_without_a_unique_float_dtype_is_refused(examples, match):
    with pytest.raises(ValueError, match=match):
        torch2jax(lambda *xs: xs[0], *examples, output_shapes=Size([2]))


def test_output_shapes_bad_leaf_is_named():
    with pytest.raises(TypeError, match=r"output_shapes\[1\] is a str"):
        torch2jax(lambda x: (x, x), randn(2), output_shapes=(Size([2]), "2"))


@pytest.mark.parametrize(
    ("torch_fn", "match"),
    [
        (lambda a: a[:1] * 10, r"output has shape \(1,\), but \(4,\) was expected"),
        (lambda a: a.to(torch.int8), r"output has dtype int8, but float32 was expected"),
        (lambda a: (a, a), r"returned 2 outputs .*expected 1"),
    ],
)
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_results_that_do_not_match_output_shapes_say_what_was_expected(torch_fn, match, mode, monkeypatch):
    # torch2jax's own suite matches "expected" (and "returned 2 outputs"),
    # whichever compile mode T2J_AD_COMPILE sets (graph mode's first call
    # said "returned outputs of structure ...").
    monkeypatch.setenv("T2J_AD_COMPILE", mode)
    x = jnp.arange(4.0, dtype=jnp.float32)
    jax_fn = torch2jax(torch_fn, x, output_shapes=jax.ShapeDtypeStruct((4,), jnp.float32))
    with pytest.raises((jax.errors.JaxRuntimeError, TorchCallError), match=match):
        jax.block_until_ready(jax_fn(x))


# ------------------------------------------------------ example arguments


def test_example_kwargs():
    def torch_fn(x, y=None):
        return (x + 1 - y.reshape(x.shape)) / torch.norm(y)

    xt, yt = randn(10, 2), randn(20)
    x, y = tree_t2j((xt, yt))
    expected = (x + 1 - y.reshape(x.shape)) / jnp.linalg.norm(y)
    for output_shapes in (None, Size([10, 2])):
        jax_fn = torch2jax(torch_fn, xt, example_kw={"y": yt}, output_shapes=output_shapes)
        assert_tree_allclose(jax_fn(x, y=y), expected)
        assert_tree_allclose(jax.jit(jax_fn)(x, y=y), expected)
        with pytest.raises(RuntimeError, match="expected input structure"):
            jax_fn(x, y)


def test_example_argument_that_is_not_an_array_is_named():
    with pytest.raises(TypeError, match=r"example argument \[1\] is a float"):
        torch2jax(lambda x, s: x * s, randn(2), 2.0)


def test_unexpected_keyword_arguments():
    jax_fn = torch2jax(lambda x, y=None: x, randn(2))
    with pytest.raises(RuntimeError, match="Keyword arguments not expected"):
        jax_fn(jnp.ones(2), y=jnp.ones(2))
    with pytest.raises(TypeError, match="Keyword arguments not expected"):
        jax_fn(jnp.ones(2), y=jnp.ones(2))


@pytest.mark.parametrize("wrap", [torch2jax, torch2jax_with_vjp])
@pytest.mark.parametrize(
    "args",
    [(jnp.ones(2),), (jnp.ones(2), jnp.ones(2), jnp.ones(2)), (jnp.ones(2), {"w": jnp.ones(2)})],
    ids=["fewer", "more", "nested"],
)
def test_different_tree_structure_is_refused(wrap, args):
    jax_fn = wrap(lambda x, y: x + y, randn(2), randn(2))
    with pytest.raises(Torch2JaxInputError, match="expected input structure") as info:
        jax_fn(*args)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, TypeError)


# ---------------------------------------------------------- shape changes


@pytest.mark.parametrize("declared", [False, True])
def test_other_shapes_rewrap_with_a_warning(declared):
    output_shapes = jax.ShapeDtypeStruct((4, 2), jnp.float32) if declared else None
    jax_fn = torch2jax(lambda x, y: x @ y, randn(4, 3), randn(3, 2), output_shapes=output_shapes)
    x, y = jnp.ones((8, 3)), jnp.arange(15.0).reshape(3, 5)
    with pytest.warns(UserWarning, match="input shapes changed") as record:
        out = jax_fn(x, y)
    assert any("float32[8, 3], float32[3, 5]" in str(w.message) for w in record)
    # torch2jax's wording, one for each case.
    wording = "but `output_shapes` was explicitly provided" if declared else "(not the original concrete inputs)"
    assert any(wording in str(w.message) for w in record)
    assert_tree_allclose(out, x @ y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per new signature; none for the example's
        assert_tree_allclose(jax_fn(x, y), x @ y)
        assert_tree_allclose(jax_fn(jnp.ones((4, 3)), jnp.ones((3, 2))), jnp.full((4, 2), 3.0))


def test_other_shapes_rewrap_with_gradients():
    jax_fn = torch2jax_with_vjp(lambda x, y: x @ y, randn(10, 5), randn(5, 3))
    ref = lambda x, y: jnp.sum(x @ y)  # noqa: E731
    g_fn = jax.jit(jax.grad(lambda x, y: jnp.sum(jax_fn(x, y)), argnums=(0, 1)))
    x, y = tree_t2j((randn(10, 5), randn(5, 3)))
    assert_tree_allclose(g_fn(x, y), jax.grad(ref, argnums=(0, 1))(x, y))
    x2, y2 = tree_t2j((randn(20, 5), randn(5, 7)))
    with pytest.warns(UserWarning, match="input shapes changed"):
        g2 = g_fn(x2, y2)
    assert_tree_allclose(g2, jax.grad(ref, argnums=(0, 1))(x2, y2))


def test_wrapping_inside_jit_for_changing_shapes():
    # torch2jax's README: wrap per trace, from the traced arguments' shapes.
    def torch_fn(a, b):
        return a * b

    @jax.jit
    def compute(a, b, c):
        d = torch2jax_with_vjp(
            torch_fn,
            jax.ShapeDtypeStruct(a.shape, dtype_t2j(a.dtype)),
            jax.ShapeDtypeStruct(b.shape, dtype_t2j(b.dtype)),
            output_shapes=jax.ShapeDtypeStruct(a.shape, dtype_t2j(a.dtype)),
        )(a, b)
        return d - c

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (3, 5):
            a, b = jnp.arange(float(n)), jnp.full((n,), 2.0)
            assert_tree_allclose(compute(a, b, a), a)


# ------------------------------------------------------------ nondiff args


def _scaled(x, y):
    return torch.sum(torch.sin(x) * y)


def _scaled_ref(x, y):
    return jnp.sum(jnp.sin(x) * y)


@pytest.mark.parametrize("use_zeros", [True, False])
@pytest.mark.parametrize(
    "options",
    [{"nondiff_argnums": 1}, {"nondiff_argnums": (1,)}, {"nondiff_mask": [False, True]}],
    ids=["argnum", "argnums", "mask"],
)
def test_nondiff_arguments_get_zero_gradients(options, use_zeros):
    xt, yt = randn(4), randn(4)
    jax_fn = torch2jax_with_vjp(_scaled, xt, yt, use_zeros=use_zeros, **options)
    x, y = tree_t2j((xt, yt))
    ref = lambda x, y: _scaled_ref(x, jax.lax.stop_gradient(y))  # noqa: E731
    gx, gy = jax.grad(jax_fn, argnums=(0, 1))(x, y)
    assert_tree_allclose((gx, gy), jax.grad(ref, argnums=(0, 1))(x, y))
    assert_tree_allclose(gy, jnp.zeros(4))
    # Forward mode agrees: no tangent flows from y.
    assert_tree_allclose(jax.jvp(jax_fn, (x, y), (x, y))[1], jax.jvp(ref, (x, y), (x, y))[1])


def test_nondiff_mask_on_a_pytree_argument():
    def torch_fn(params, x):
        return torch.sum(params["w"] * x + params["b"])

    params = {"w": randn(3), "b": randn(3)}
    jax_fn = torch2jax_with_vjp(torch_fn, params, randn(3), nondiff_mask=[{"w": False, "b": True}, True])
    p, x = tree_t2j((params, randn(3)))
    grads = jax.grad(jax_fn, argnums=(0, 1))(p, x)
    assert_tree_allclose(grads, ({"w": x, "b": jnp.zeros(3)}, jnp.zeros(3)))


def test_nondiff_options_that_do_not_fit_are_refused():
    xt, yt = randn(4), randn(4)
    with pytest.raises(ValueError, match="nondiff_mask has 3 leaves"):
        torch2jax_with_vjp(_scaled, xt, yt, nondiff_mask=[False, True, True])
    with pytest.raises(ValueError, match=r"nondiff_argnums \[2\] out of range"):
        torch2jax_with_vjp(_scaled, xt, yt, nondiff_argnums=2)


# ---------------------------------------------------------- use_torch_vjp


def _spy_on_autograd(monkeypatch):
    calls = []
    real = fallbacks.autograd_vjp

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fallbacks, "autograd_vjp", spy)
    return calls


@pytest.mark.parametrize("use_torch_vjp", [True, False])
def test_use_torch_vjp_false_takes_the_autograd_grad_path(monkeypatch, use_torch_vjp):
    calls = _spy_on_autograd(monkeypatch)
    xt, yt = randn(4), randn(4)
    jax_fn = torch2jax_with_vjp(_scaled, xt, yt, use_torch_vjp=use_torch_vjp)
    x, y = tree_t2j((xt, yt))
    assert_tree_allclose(jax.grad(jax_fn, argnums=(0, 1))(x, y), jax.grad(_scaled_ref, argnums=(0, 1))(x, y))
    assert bool(calls) == (not use_torch_vjp)
    # Higher orders and forward-over-reverse still work on that path.
    assert_tree_allclose(jax.hessian(jax_fn)(x, y), jax.hessian(_scaled_ref)(x, y))
    second = lambda f: jax.grad(jax.grad(lambda s: f(s * x, y)))  # noqa: E731
    assert_tree_allclose(second(jax_fn)(0.5), second(_scaled_ref)(0.5))


class _OldStyleCube(torch.autograd.Function):
    """forward(ctx, ...) without setup_context: torch.func refuses it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


@pytest.mark.filterwarnings("default::t2j_ad.FallbackWarning")
def test_old_style_autograd_function_with_use_torch_vjp_false():
    cube_ref = lambda x: jnp.sum(x**3)  # noqa: E731
    x = jnp.array([0.5, -1.0, 2.0])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jax_fn = torch2jax_with_vjp(lambda x: _OldStyleCube.apply(x).sum(), randn(3), use_torch_vjp=False)
        assert_tree_allclose(jax.grad(jax_fn)(x), jax.grad(cube_ref)(x))
    assert not [w for w in record if issubclass(w.category, FallbackWarning)]
    # The default tries torch.func.vjp first, and says it fell back.
    with pytest.warns(FallbackWarning, match="reverse mode"):
        jax_fn = torch2jax_with_vjp(lambda x: _OldStyleCube.apply(x).sum(), randn(3))
        assert_tree_allclose(jax.grad(jax_fn)(x), jax.grad(cube_ref)(x))
    assert_tree_allclose(jax.hessian(jax_fn)(x), jax.hessian(cube_ref)(x))


# ------------------------------------------------- sharding and batching


@pytest.mark.parametrize("wrap", [torch2jax, torch2jax_with_vjp, torch2jax_without_vjp])
def test_output_sharding_spec_is_a_deprecated_name_for_out_specs(wrap):
    spec = jax.sharding.PartitionSpec()
    with pytest.warns(UserWarning, match="deprecated; pass out_specs"):
        jax_fn = wrap(_scaled, randn(4), randn(4), output_sharding_spec=spec)
    x, y = jnp.linspace(-1.0, 1.0, 4), jnp.arange(4.0)
    # Without a mesh the call runs once on the whole arrays, as without a spec
    # (per-shard calls: tests/multidevice/test_compat_out_specs.py).
    assert_tree_allclose(jax.jit(jax_fn)(x, y), _scaled_ref(x, y))
    with pytest.raises(ValueError, match="give out_specs only"):
        wrap(_scaled, randn(4), randn(4), output_sharding_spec=spec, out_specs=spec)


@pytest.mark.parametrize("vmap_method", ["sequential", "expand_dims", "broadcast_all"])
def test_vmap_methods(vmap_method):
    jax_fn = torch2jax_with_vjp(_scaled, randn(4), randn(4), vmap_method=vmap_method)
    xs, y = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), jnp.arange(4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # batched calls keep the example's shapes
        assert_tree_allclose(jax.vmap(jax_fn, (0, None))(xs, y), jax.vmap(_scaled_ref, (0, None))(xs, y))
        assert_tree_allclose(
            jax.vmap(jax.grad(jax_fn), (0, None))(xs, y), jax.vmap(jax.grad(_scaled_ref), (0, None))(xs, y)
        )


@pytest.mark.parametrize(("use_torch_vmap", "calls_for_3_rows"), [(True, 1), (False, 3)])
def test_use_torch_vmap_is_the_older_vmap_method(use_torch_vmap, calls_for_3_rows):
    calls = []

    def scaled(x, y):
        if not x.is_meta:
            calls.append(1)
        return _scaled(x, y)

    jax_fn = torch2jax_with_vjp(scaled, randn(4), randn(4), use_torch_vmap=use_torch_vmap)
    xs, y = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), jnp.arange(4.0)
    assert_tree_allclose(jax.vmap(jax_fn, (0, None))(xs, y), jax.vmap(_scaled_ref, (0, None))(xs, y))
    assert len(calls) == calls_for_3_rows  # True: one torch.vmap call; False: a loop
    with pytest.raises(ValueError, match="give vmap_method only"):
        torch2jax_with_vjp(_scaled, randn(4), randn(4), use_torch_vmap=True, vmap_method="broadcast_all")


# --------------------------------------------------- dtypes and conversion


def test_dtype_tables():
    pairs = [
        (torch.float16, jnp.float16),
        (torch.bfloat16, jnp.bfloat16),
        (torch.float32, jnp.float32),
        (torch.float64, jnp.float64),
        (torch.int8, jnp.int8),
        (torch.int32, jnp.int32),
        (torch.int64, jnp.int64),
        (torch.uint8, jnp.uint8),
        (torch.bool, jnp.bool_),
        (torch.complex64, jnp.complex64),
    ]
    for t, j in pairs:
        assert dtype_t2j(t) == jnp.dtype(j)
        assert dtype_j2t(j) == t
        assert dtype_j2t(jnp.dtype(j)) == t
        assert dtype_j2t(t) is t  # torch dtypes pass through
        assert dtype_t2j(j) == jnp.dtype(j)  # JAX dtypes pass through
    with pytest.raises(ValueError, match="Unsupported dtype"):
        dtype_t2j(torch.quint8)
    with pytest.raises(ValueError, match="Unsupported dtype"):
        dtype_j2t(np.dtype("U4"))


@pytest.mark.parametrize("via", ["dlpack", "cpu"])
def test_tree_conversions(via):
    tree = {"a": randn(3, 2), "b": [torch.arange(4, dtype=torch.int32, device=TORCH_DEVICE)], "c": "kept"}
    jax_tree = tree_t2j(tree, via=via)
    assert isinstance(jax_tree["a"], jax.Array) and jax_tree["c"] == "kept"
    back = tree_j2t(jax_tree, via=via)
    torch.testing.assert_close(back["a"], tree["a"])
    torch.testing.assert_close(back["b"][0], tree["b"][0])
    assert Size is torch.Size
    with pytest.raises(ValueError, match="via must be one of"):
        tree_t2j(tree, via="gpu")


_NUMPY_LACKS = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz]


@pytest.mark.parametrize("via", ["dlpack", "cpu", "host"])
@pytest.mark.parametrize("dtype", _NUMPY_LACKS + [torch.float8_e8m0fnu], ids=str)
def test_dtypes_numpy_lacks_cross_both_ways_by_every_route(dtype, via):
    # Tensor.numpy() and torch.from_numpy refuse these, so a copy through
    # host memory crosses as same-width integers (bit-compatible formats).
    values = torch.tensor([[1.0, 2.0], [0.5, 4.0]], device=TORCH_DEVICE).to(dtype)
    got = t2j(values, via=via)
    assert got.dtype == dtype_t2j(dtype)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), values.float().cpu().numpy())
    back = j2t(got, via=via)
    assert back.dtype == dtype and back.device == values.device
    bits = torch.uint8 if dtype.itemsize == 1 else torch.int16
    assert torch.equal(back.view(bits), values.view(bits))


def test_t2j_of_something_else_than_a_tensor_says_so():
    for bad in (np.ones(3), [1.0, 2.0]):
        with pytest.raises(TypeError, match=r"t2j: x must be a torch.Tensor, got a .*jnp.asarray\(x\)"):
            t2j(bad)


# ------------------------------------------------ torch2jax 0.8's additions


def test_torch2jax_takes_depth_and_is_differentiable():
    xt = torch.randn(5)
    for depth in (0, 1, 2):
        jax_fn = torch2jax(lambda x: torch.sin(x).sum(), xt, depth=depth)
        x = jnp.asarray(xt.numpy())
        assert_tree_allclose(jax.grad(jax_fn)(x), jnp.cos(x))


def test_torch2jax_without_vjp_is_torch2jax():
    xt, yt = torch.randn(3, 4), torch.randn(4)
    jax_fn = jax.jit(torch2jax_without_vjp(lambda x, y: x @ y, xt, yt, output_shapes=Size([3])))
    x, y = tree_t2j((xt, yt))
    assert_tree_allclose(jax_fn(x, y), x @ y)


def test_torch2jax_auto_takes_its_examples_from_the_first_call():
    from t2j_ad.compat import torch2jax_auto

    calls = []

    def torch_fn(x, y):
        calls.append((tuple(x.shape), x.dtype))
        return torch.tanh(x) * y

    jax_fn = torch2jax_auto(torch_fn)
    x, y = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3), jnp.float32(2.0)
    assert_tree_allclose(jax.jit(jax_fn)(x, y), jnp.tanh(x) * y)
    grad = jax.jit(jax.grad(lambda x: jax_fn(x, y).sum()))(x)
    assert_tree_allclose(grad, jax.grad(lambda x: (jnp.tanh(x) * y).sum())(x))
    assert ((2, 3), torch.float32) in calls
    with pytest.warns(UserWarning):  # another shape: accepted, as torch2jax does, with a warning
        assert_tree_allclose(jax_fn(x[0], y), jnp.tanh(x[0]) * y)


def test_torch_vjp_that_cannot_read_data_falls_back():
    # torch2jax 0.8 falls back to torch.autograd.grad when torch.func.vjp
    # refuses; so does t2j_ad (with a FallbackWarning).
    def torch_fn(x):
        return x * torch.from_numpy(np.cos(x.detach().cpu().numpy())).to(x.device)

    jax_fn = torch2jax_with_vjp(torch_fn, torch.ones(4), depth=1)
    x = jnp.linspace(0.0, 1.0, 4, dtype=jnp.float32)
    got = jax.grad(lambda x: jax_fn(x).sum())(x)
    assert_tree_allclose(got, jnp.cos(x))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"nondiff_mask": "no"}, r"nondiff_mask must hold bools.*'no'"),
        ({"nondiff_argnums": "0"}, r"nondiff_argnums must be an int or a sequence of ints"),
        ({"nondiff_argnums": 0.0}, r"nondiff_argnums must be an int or a sequence of ints"),
        ({"use_torch_vjp": "no"}, r"use_torch_vjp must be True or False"),
        ({"use_torch_vmap": "no"}, r"use_torch_vmap must be True or False"),
    ],
)
def test_torch2jax_with_vjp_refuses_options_of_the_wrong_type(options, message):
    # A string was a truthy leaf: nondiff_mask='no' made the argument
    # non-differentiable, use_torch_vjp='no' meant yes.
    x = jnp.ones(3)
    with pytest.raises(TypeError, match=message):
        torch2jax_with_vjp(lambda x: x * 2, x, **options)
