"""``t2j_ad.compat``'s ``out_specs``: one PyTorch call per shard over Explicit axes.

See NOTE [per-shard calls over Explicit axes] in t2j_ad/per_shard.py. Every
value is compared with the same math in jax.numpy on the same sharded arrays.
"""

from __future__ import annotations

import re
import threading
import warnings

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from t2j_ad.compat import torch2jax, torch2jax_with_vjp
from tests.conftest import assert_tree_allclose

_COLLECTIVE = re.compile(r"\s(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def _mesh(shape=(4,), names=("x",), kind=AxisType.Explicit):
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def _data(mesh, x_spec=P("x")):
    x = jax.random.normal(jax.random.key(0), (16, 8))
    w = jax.random.normal(jax.random.key(1), (8, 3))
    return jax.device_put(x, NamedSharding(mesh, x_spec)), jax.device_put(w, NamedSharding(mesh, P()))


class _Calls:
    """The shapes PyTorch was called with, meta-tensor shape inference left out."""

    def __init__(self):
        self.shapes, self._lock = [], threading.Lock()

    def __call__(self, t: torch.Tensor) -> None:
        if not t.is_meta:
            with self._lock:
                self.shapes.append(tuple(t.shape))


def _collectives(fn, *args, mesh):
    with jax.set_mesh(mesh):
        hlo = jax.jit(fn).lower(*args).compile().as_text()
    return sorted(m.group(1) for m in _COLLECTIVE.finditer(hlo))


@pytest.mark.parametrize("use_jit", [True, False])
def test_each_device_runs_its_own_rows(use_jit):
    mesh = _mesh()
    x, w = _data(mesh)
    calls = _Calls()
    f = torch2jax(lambda x, w: calls(x) or torch.tanh(x @ w), x, w, out_specs=P("x"))
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error")  # the per-shard shapes are not "new shapes"
        y = jax.block_until_ready((jax.jit(f) if use_jit else f)(x, w))  # the calls are asynchronous
        ref = jnp.tanh(x @ w)
    assert calls.shapes == [(4, 8)] * 4
    assert jax.typeof(y).sharding.spec == P("x", None)
    assert_tree_allclose(y, ref)


def test_gradients_keep_the_inputs_shardings_and_sum_the_weight_over_shards():
    mesh = _mesh()
    x, w = _data(mesh)
    f = torch2jax_with_vjp(lambda x, w: torch.sin(x @ w), x, w, out_specs=P("x"))

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w) ** 2)

    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
        refs = jax.grad(loss(lambda x, w: jnp.sin(x @ w)), argnums=(0, 1))(x, w)
        # Nothing is gathered: the weight's cotangent is summed (one all-reduce).
        assert _collectives(jax.grad(loss(f), argnums=(0, 1)), x, w, mesh=mesh) == ["all-reduce"]
        assert _collectives(f, x, w, mesh=mesh) == []
    assert [jax.typeof(g).sharding.spec for g in grads] == [P("x", None), P(None, None)]
    assert_tree_allclose(grads, refs, rtol=1e-4, atol=1e-4)


def test_declared_output_shapes_are_split_and_never_inferred():
    mesh = _mesh()
    x, w = _data(mesh)
    devices = []
    shapes = (jax.ShapeDtypeStruct((16, 3), x.dtype), jax.ShapeDtypeStruct((16, 8), x.dtype))
    f = torch2jax_with_vjp(
        lambda x, w: devices.append(x.device.type) or (x @ w, 2 * x),
        x,
        w,
        output_shapes=shapes,
        out_specs=(P("x"), P("x")),
    )
    with jax.set_mesh(mesh):
        y, z = jax.block_until_ready(jax.jit(f)(x, w))
        gw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w)[0] ** 2), argnums=1))(x, w)
        gw_ref = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)
    assert "meta" not in devices
    assert_tree_allclose((y, z, gw), (x @ w, 2 * x, gw_ref), rtol=1e-4, atol=1e-4)


def test_inferred_per_shard_shapes_and_a_prefix_spec():
    mesh = _mesh()
    rows = jnp.arange(32.0).reshape(16, 2)
    x = jax.device_put(rows, NamedSharding(mesh, P("x")))
    f = torch2jax(lambda a: (a[:1], 2 * a), x, out_specs=P("x"))  # one spec for both outputs
    with jax.set_mesh(mesh):
        first_rows, doubled = jax.jit(f)(x)
    assert_tree_allclose((first_rows, doubled), (rows[::4], 2 * rows))  # one row per shard


def test_partially_manual_over_the_axes_in_use():
    mesh = _mesh((2, 2), ("x", "y"))
    x, w = _data(mesh)
    calls = _Calls()
    f = torch2jax(lambda x, w: calls(x) or x @ w, x, w, out_specs=P("x"))
    with jax.set_mesh(mesh):
        y = jax.block_until_ready(jax.jit(f)(x, w))
    assert calls.shapes == [(8, 8)] * 4  # split along "x", replicated along "y"
    assert_tree_allclose(y, x @ w)


def test_replicated_inputs_and_no_mesh_call_once_on_the_whole_arrays():
    mesh = _mesh()
    x, w = _data(mesh, x_spec=P())
    calls = _Calls()
    f = torch2jax(lambda x, w: calls(x) or x @ w, x, w)
    with jax.set_mesh(mesh):
        y = jax.block_until_ready(jax.jit(f)(x, w))
    assert set(calls.shapes) == {(16, 8)}  # on every device, as XLA runs a replicated op
    assert jax.typeof(y).sharding.spec == P(None, None)
    g = torch2jax(lambda x, w: x @ w, x, w, out_specs=P("x"))
    plain_x, plain_w = jnp.asarray(x), jnp.asarray(w)
    assert_tree_allclose((y, g(plain_x, plain_w)), (x @ w, plain_x @ plain_w))
    # Under the mesh too: out_specs naming an axis no input is sharded over
    # ran the whole call on each device and stacked the four results.
    with jax.set_mesh(mesh):
        out = jax.block_until_ready(jax.jit(g)(x, w))
    assert out.shape == (x @ w).shape
    assert_tree_allclose(out, x @ w)


def test_refusals_name_the_fix():
    mesh = _mesh()
    x, w = _data(mesh)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"Explicit mesh axes \['x'\], but no out_specs.*reshard"):
            jax.jit(torch2jax(lambda x, w: x @ w, x, w))(x, w)
        too_short = jax.ShapeDtypeStruct((3,), x.dtype)
        f = torch2jax(lambda x, w: x @ w, x, w, output_shapes=too_short, out_specs=P("x"))
        with pytest.raises(ValueError, match=r"\(3,\) cannot be partitioned by"):
            jax.jit(f)(x, w)
    auto = _mesh(kind=AxisType.Auto)
    x, w = _data(auto)
    with jax.set_mesh(auto), pytest.raises(ValueError, match=r"Auto mesh axes \['x'\].*batch_argnums"):
        jax.jit(torch2jax(lambda x, w: x @ w, x, w, out_specs=P("x")))(x, w)
