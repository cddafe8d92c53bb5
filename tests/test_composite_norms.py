"""Second derivatives through layer, batch and instance norm (NOTE
[normalizations at second order]): torch.func gets them wrong, silently;
t2j_ad computes them by plain ops and agrees with jax.numpy."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TORCH_DEVICE, assert_tree_allclose, to_numpy, to_torch

import t2j_ad

EPS = 1e-5


def _jnp_normalized(x, axes, eps=EPS):
    mean = x.mean(axes, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(axes, keepdims=True) + eps)


# name -> (PyTorch norm, the same in jax.numpy); x is (N, C, L) = (3, 4, 5)
NORMS = {
    "layer_norm": (
        lambda x, w, b: F.layer_norm(x, (4, 5), w, b),
        lambda x, w, b: _jnp_normalized(x, (1, 2)) * w + b,
        (4, 5),
    ),
    "batch_norm": (
        lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
        lambda x, w, b: _jnp_normalized(x, (0, 2)) * w[:, None] + b[:, None],
        (4,),
    ),
    "instance_norm": (
        lambda x, w, b: F.instance_norm(x, weight=w, bias=b),
        lambda x, w, b: _jnp_normalized(x, (2,)) * w[:, None] + b[:, None],
        (4,),
    ),
}

SECOND_ORDER = {
    "hessian": lambda f: jax.hessian(f, argnums=(0, 1, 2)),
    "jacrev_jacrev": lambda f: jax.jacrev(jax.jacrev(f, argnums=(0, 1, 2)), argnums=(0, 1, 2)),
    "jacfwd_jacfwd": lambda f: jax.jacfwd(jax.jacfwd(f, argnums=(0, 1, 2)), argnums=(0, 1, 2)),
}


def _arguments(param_shape):
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.normal(size=(3, 4, 5))),
        jnp.asarray(rng.uniform(0.5, 1.5, size=param_shape)),
        jnp.asarray(rng.normal(size=param_shape)),
    )


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("how", sorted(SECOND_ORDER))
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_second_derivatives_through_a_norm_agree_with_jax(norm, how, mode, x64):
    """Off by up to tens before (the d/dx d/dw block of layer_norm's
    Hessian by 1.7: not symmetric), as torch.func.hessian still is."""
    t_norm, j_norm, param_shape = NORMS[norm]
    f = t2j_ad.jaxify(lambda x, w, b: (t_norm(x, w, b) ** 3).sum(), compile=mode)
    reference = lambda x, w, b: jnp.sum(j_norm(x, w, b) ** 3)  # noqa: E731
    args = _arguments(param_shape)
    transform = SECOND_ORDER[how]
    assert_tree_allclose(transform(f)(*args), transform(reference)(*args), rtol=1e-9, atol=1e-9)
    # The first derivatives keep PyTorch's fused kernels, and are right.
    assert_tree_allclose(jax.grad(f, argnums=(0, 1, 2))(*args), jax.grad(reference, argnums=(0, 1, 2))(*args), rtol=1e-10)


# The aten ops the functions above call, called directly: name -> (the op's
# output, the NORMS entry whose math it is).
DIRECT = {
    "torch.native_layer_norm": (lambda x, w, b: torch.native_layer_norm(x, (4, 5), w, b, EPS)[0], "layer_norm"),
    "aten.layer_norm.default": (lambda x, w, b: torch.ops.aten.layer_norm.default(x, [4, 5], w, b), "layer_norm"),
    "torch.native_batch_norm": (
        lambda x, w, b: torch.native_batch_norm(x, w, b, None, None, True, 0.1, EPS)[0],
        "batch_norm",
    ),
    "aten._native_batch_norm_legit.no_stats": (
        lambda x, w, b: torch.ops.aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, EPS)[0],
        "batch_norm",
    ),
    "aten._batch_norm_impl_index": (
        lambda x, w, b: torch.ops.aten._batch_norm_impl_index(x, w, b, None, None, True, 0.1, EPS, False)[0],
        "batch_norm",
    ),
    "aten._native_batch_norm_legit_functional": (
        lambda x, w, b: torch.ops.aten._native_batch_norm_legit_functional(
            x, w, b, torch.zeros(4, dtype=x.dtype, device=x.device), torch.ones(4, dtype=x.dtype, device=x.device), True, 0.1, EPS
        )[0],
        "batch_norm",
    ),
}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("op", sorted(DIRECT))
def test_second_derivatives_through_an_aten_norm_called_directly(op, mode, x64):
    t_norm, name = DIRECT[op]
    j_norm, param_shape = NORMS[name][1:]
    f = t2j_ad.jaxify(lambda x, w, b: (t_norm(x, w, b) ** 3).sum(), compile=mode)
    args = _arguments(param_shape)
    reference = lambda x, w, b: jnp.sum(j_norm(x, w, b) ** 3)  # noqa: E731
    hessian = SECOND_ORDER["hessian"]
    assert_tree_allclose(hessian(f)(*args), hessian(reference)(*args), rtol=1e-9, atol=1e-9)


def test_torch_func_is_still_wrong_where_t2j_ad_is_right(x64):
    """If a PyTorch release fixes pytorch/pytorch#196700, the plain ops are no
    longer needed: this test then fails, so the workaround can go."""
    t_norm, j_norm, param_shape = NORMS["layer_norm"]
    args = _arguments(param_shape)
    loss = lambda x, w, b: (t_norm(x, w, b) ** 3).sum()  # noqa: E731
    theirs = torch.func.hessian(loss, argnums=(0, 1))(*(to_torch(a) for a in args))
    ours = jax.hessian(lambda x, w, b: jnp.sum(j_norm(x, w, b) ** 3), argnums=(0, 1))(*args)
    assert float(np.max(np.abs(to_numpy(theirs[1][0]) - np.asarray(ours[1][0])))) > 1e-3


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_train_mode_batch_norm_module_updates_its_statistics_once(mode, x64):
    """jax.hessian of a module with BatchNorm in training mode: the Hessian of
    the batch-statistics math, and the running statistics updated once, as
    one PyTorch forward updates them."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    ).double().to(TORCH_DEVICE)
    once = copy.deepcopy(net)
    apply, params = t2j_ad.jaxify_module(net, compile=mode)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 3)))

    def reference(p):
        h = x @ p["0.weight"].T + p["0.bias"]
        h = _jnp_normalized(h, (0,)) * p["1.weight"] + p["1.bias"]
        return jnp.sum((jnp.tanh(h) @ p["3.weight"].T + p["3.bias"]) ** 2)

    hessian = jax.hessian(lambda p: jnp.sum(apply(p, x) ** 2))(params)
    assert_tree_allclose(hessian, jax.hessian(reference)(params), rtol=1e-9, atol=1e-10)
    once(to_torch(x))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(net[1], name), getattr(once[1], name), rtol=1e-12, atol=1e-12)


def test_a_half_precision_layer_norm_normalizes_in_float32():
    """bfloat16 inputs, normalized in float32 as PyTorch's kernel does: the
    Hessian-vector product agrees with float32 jax.numpy to bfloat16's
    precision, and comes back in bfloat16."""
    f = t2j_ad.jaxify(lambda x: (F.layer_norm(x, (8,)) ** 3).sum())
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8)), jnp.bfloat16)
    v = jnp.ones_like(x)
    hvp = jax.jvp(jax.grad(f), (x,), (v,))[1]
    assert hvp.dtype == jnp.bfloat16
    reference = lambda x: jnp.sum(_jnp_normalized(x, (1,)) ** 3)  # noqa: E731
    expected = jax.jvp(jax.grad(reference), (x.astype(jnp.float32),), (v.astype(jnp.float32),))[1]
    np.testing.assert_allclose(np.asarray(hvp, np.float32), expected, rtol=0.05, atol=0.05)


def test_a_torchscript_module_that_normalizes_is_refused_at_second_order(x64):
    """TorchScript hides its norms from the plain-op mode: a scripted
    LayerNorm's parameter Hessian was off by 50, silently. It is refused,
    naming the module; first derivatives run, and a scripted module whose
    batch norm uses running statistics (eval mode) keeps its Hessian."""
    torch.manual_seed(0)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(3, 5)))
    layer_normed = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.LayerNorm(5)).double().to(TORCH_DEVICE)
    apply, params = t2j_ad.jaxify_module(torch.jit.script(layer_normed))
    loss = lambda p: jnp.sum(apply(p, x) ** 3)  # noqa: E731
    with pytest.raises(Exception, match=r"TorchScript module Sequential \(aten::layer_norm\) normalizes inside"):
        jax.block_until_ready(jax.hessian(loss)(params))
    expected = torch.func.grad(lambda p: (torch.func.functional_call(layer_normed, p, (to_torch(x),)) ** 3).sum())(
        {k: to_torch(v) for k, v in params.items()}
    )
    assert_tree_allclose(jax.grad(loss)(params), {k: to_numpy(v) for k, v in expected.items()}, rtol=1e-10)

    batch_normed = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4)).double().eval()
    with torch.no_grad():
        batch_normed[1].running_mean.uniform_(-1, 1)
        batch_normed[1].running_var.uniform_(0.5, 2)
    apply, params = t2j_ad.jaxify_module(torch.jit.script(batch_normed).to(TORCH_DEVICE))
    mean, var = (jnp.asarray(to_numpy(getattr(batch_normed[1], n))) for n in ("running_mean", "running_var"))

    def reference(p):
        h = x @ p["0.weight"].T + p["0.bias"]
        return jnp.sum(((h - mean) / jnp.sqrt(var + EPS) * p["1.weight"] + p["1.bias"]) ** 3)

    assert_tree_allclose(
        jax.hessian(lambda p: jnp.sum(apply(p, x) ** 3))(params), jax.hessian(reference)(params), rtol=1e-9, atol=1e-10
    )


STATISTICS = {
    "native_layer_norm mean": lambda x: torch.native_layer_norm(x, (4, 5), None, None, EPS)[1],
    "native_layer_norm rstd": lambda x: torch.native_layer_norm(x, (4, 5), None, None, EPS)[2],
    "native_batch_norm save_invstd": lambda x: torch.native_batch_norm(x, None, None, None, None, True, 0.1, EPS)[2],
}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("output", sorted(STATISTICS))
def test_the_statistics_outputs_have_no_derivative_at_any_order(output, mode, x64):
    # PyTorch's kernels give mean and rstd no derivative, so the gradient is
    # 0; the plain ops gave them one at order 2, a Hessian of 2.2 for a zero
    # gradient (torch.func.hessian: 0).
    f = t2j_ad.jaxify(lambda x: (STATISTICS[output](x) ** 2).sum(), compile=mode)
    x = _arguments((4,))[0]
    expected = torch.func.hessian(lambda x: (STATISTICS[output](x) ** 2).sum())(to_torch(x))
    assert_tree_allclose(jax.grad(f)(x), np.zeros(x.shape), atol=0)
    assert_tree_allclose(jax.hessian(f)(x), to_numpy(expected), atol=0)
    assert not np.any(np.asarray(jax.hessian(f)(x)))


# In a process of its own: once Dynamo has run, torch.distributions' value
# checks trace under make_fx for the rest of the process, which other tests
# rely on not doing.
_COMPILED_PROBE = textwrap.dedent(
    """
    import json, warnings
    import jax, numpy as np, torch
    import torch.nn.functional as F
    import t2j_ad
    jax.config.update("jax_enable_x64", True)

    def loss(x):
        return (F.layer_norm(x.sin(), (4,)) ** 3).sum()

    compiled = torch.compile(loss, backend="eager")
    x = np.random.default_rng(4).normal(size=(2, 4))
    t = torch.as_tensor(x)
    expected = [
        torch.func.grad(compiled)(t),
        torch.func.hessian(compiled)(t),
        torch.func.jacrev(torch.func.jacrev(compiled))(t),
    ]
    report = {}
    for mode in ("eager", "graph"):
        f = t2j_ad.jaxify(compiled, compile=mode)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = [jax.grad(f)(x), jax.hessian(f)(x), jax.jacrev(jax.jacrev(f))(x)]
        report[mode] = {
            "errors": [float(np.abs(np.asarray(g) - e.numpy()).max()) for g, e in zip(got, expected)],
            "fallbacks": [str(w.message) for w in record if issubclass(w.category, t2j_ad.FallbackWarning)],
        }
    print(json.dumps(report))
    """
)


def test_second_derivatives_of_a_torch_compiled_function():
    """A torch.compile'd function, norm inside (NOTE [the mode's handler under
    torch.compile]): Dynamo compiled the mode's handler on functorch tensors,
    so jax.hessian raised an AssertionError and jacrev of jacrev ran
    sequentially after a FallbackWarning. Now both agree with torch.func, in
    eager mode without a FallbackWarning; graph mode, whose trace Dynamo
    refuses, announces that each call runs eagerly, and agrees too."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILED_PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stderr[-3000:]}"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for mode, found in report.items():
        assert max(found["errors"]) < 1e-9, (mode, found["errors"])
    assert report["eager"]["fallbacks"] == []
    graph = report["graph"]["fallbacks"]
    assert graph and all("could not trace" in m and "runs eagerly" in m for m in graph)
