"""torch_call on 4 simulated CPU devices: sharded jit, shard_map, pmap.

See NOTE [partitioning torch_call] in t2j_ad/rules/partitioning.py. Every
result is held against the same math in pure JAX; PyTorch's own view (the
shapes it is called with, the rows it computes) is recorded by the PyTorch
functions themselves.
"""

from __future__ import annotations

import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import t2j_ad
from t2j_ad.backends import registry
from tests.conftest import assert_tree_allclose, finishes_within

B, D = 16, 3


def _mesh(shape=(4,), names=("b",)):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


@pytest.fixture
def mesh():
    return _mesh()


def _data():
    x = jnp.sin(jnp.arange(B * D, dtype=jnp.float32).reshape(B, D))
    w = jnp.linspace(-1.0, 1.0, D, dtype=jnp.float32)
    return w, x


def _torch_loss(rows):
    def loss(w, x):
        if x.device.type != "meta":  # not the shape inference
            rows.append(tuple(x.shape))
        return torch.tanh(x @ w) ** 2

    return loss


def _jax_loss(w, x):
    return jnp.tanh(x @ w) ** 2


def _hlo(fn, *args):
    return fn.lower(*args).compile().as_text()


def _all_gathers(hlo):
    return hlo.count("all-gather")


def _per_example_grads(loss):
    return jax.jit(jax.vmap(jax.grad(loss), (None, 0)))


@pytest.fixture
def partitioner(request):
    """Shardy (JAX 0.10's default, reads the sharding rule) or GSPMD (reads
    the infer_sharding_from_operands callback)."""
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", previous)


@pytest.mark.parametrize(
    "vmap_method, partitioner",
    [("sequential", "shardy"), ("expand_dims", "shardy"), ("sequential", "gspmd")],
    indirect=["partitioner"],
)
def test_per_example_gradients_stay_sharded(mesh, vmap_method, partitioner):
    rows = []
    f = t2j_ad.jaxify(_torch_loss(rows), vmap_method=vmap_method)
    w, x = _data()
    xs = jax.device_put(x, NamedSharding(mesh, P("b")))
    g = _per_example_grads(f)
    assert _all_gathers(_hlo(g, w, xs)) == 0
    out = g(w, xs)
    assert_tree_allclose(out, jax.vmap(jax.grad(_jax_loss), (None, 0))(w, x))
    assert out.sharding.spec == P("b")
    if vmap_method == "sequential":
        # One PyTorch call per row: the 4 devices did 16 rows between them,
        # each its own 4, not 4 x 16 as when the batch is gathered.
        assert len(rows) == B
    g(w, xs)
    assert g._cache_size() == 1  # the partitioned lowering retraces nothing


def test_sequential_rows_without_partitioning_are_replicated(mesh, monkeypatch):
    # The callback backend stays replicated (NOTE [partitioning torch_call]):
    # correct, but every device runs the whole batch.
    monkeypatch.setenv("T2J_AD_BACKEND", "callback")
    rows = []
    f = t2j_ad.jaxify(_torch_loss(rows), vmap_method="sequential")
    w, x = _data()
    xs = jax.device_put(x, NamedSharding(mesh, P("b")))
    out = _per_example_grads(f)(w, xs)
    assert_tree_allclose(out, jax.vmap(jax.grad(_jax_loss), (None, 0))(w, x))
    assert len(rows) == 4 * B


def test_uneven_batch_stays_replicated_and_correct(mesh):
    # 6 rows do not split over 4 devices: the partition callback keeps the
    # call replicated, each device computing all 6.
    rows = []
    f = t2j_ad.jaxify(_torch_loss(rows), vmap_method="sequential")
    w, x = _data()
    xs = jax.device_put(x, NamedSharding(mesh, P("b")))

    def first_six(w, x):
        six = jax.lax.with_sharding_constraint(x[:6], NamedSharding(mesh, P("b")))
        return jax.vmap(jax.grad(f), (None, 0))(w, six)

    assert_tree_allclose(jax.jit(first_six)(w, xs), jax.vmap(jax.grad(_jax_loss), (None, 0))(w, x[:6]))
    assert len(rows) == 4 * 6


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"], indirect=True)
@pytest.mark.parametrize("view", ["first_half", "vmap_over_halves"])
def test_a_batch_split_over_two_dimensions_runs_and_is_correct(mesh, partitioner, view):
    # x.reshape(2, 8, 3) splits the mesh axis over two dimensions, which no
    # PartitionSpec says; JAX's decoding of it failed the whole compilation
    # (NOTE [shardings no PartitionSpec says]).
    f = t2j_ad.jaxify(lambda x: torch.tanh(x) * 2, batch_argnums=0)
    _, x = _data()
    xs = jax.device_put(x, NamedSharding(mesh, P("b")))
    if view == "first_half":
        got, expected = jax.jit(lambda x: f(x.reshape(2, 8, D)[0]))(xs), jnp.tanh(x[:8]) * 2
    else:
        got, expected = jax.jit(lambda x: jax.vmap(f)(x.reshape(2, 8, D)))(xs), jnp.tanh(x).reshape(2, 8, D) * 2
    assert_tree_allclose(got, expected)


def _explicit_mesh():
    return jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Explicit,))


def test_on_explicit_axes_a_vmapped_call_is_typed_sharded_and_runs_per_device():
    # NOTE [results on Explicit axes]: the result was typed without a mesh,
    # and the first JAX operation on it under jax.vmap failed.
    rows = []
    f = t2j_ad.jaxify(_torch_loss(rows), vmap_method="sequential")
    w, x = _data()
    xs = jax.device_put(x, NamedSharding(_explicit_mesh(), P("b")))
    value = jax.jit(jax.vmap(lambda w, x: f(w, x) * 2 + 1, (None, 0)))
    grads = jax.jit(jax.vmap(jax.grad(lambda w, x: f(w, x) ** 2), (None, 0)))
    out = jax.block_until_ready(value(w, xs))
    assert_tree_allclose(out, jax.vmap(lambda x: _jax_loss(w, x) * 2 + 1)(x))
    assert jax.typeof(out).sharding.spec == P("b")
    assert_tree_allclose(grads(w, xs), jax.vmap(jax.grad(lambda w, x: _jax_loss(w, x) ** 2), (None, 0))(w, x))
    assert _all_gathers(_hlo(grads, w, xs)) == 0
    rows.clear()
    jax.block_until_ready(value(w, xs))
    assert len(rows) == B  # 4 rows on each of 4 devices, not 16 on each


def test_on_explicit_axes_a_declared_call_runs_per_device_with_the_collectives_of_pure_jax():
    rows = []
    f = t2j_ad.jaxify(lambda x: _torch_loss(rows)(torch.ones(D, dtype=x.dtype), x), batch_argnums=0)
    _, x = _data()
    xs = jax.device_put(x, NamedSharding(_explicit_mesh(), P("b")))

    def both(loss):
        return lambda x: loss(x) * 2 + x.sum()

    ours, pure = jax.jit(both(f)), jax.jit(both(lambda x: _jax_loss(jnp.ones(D), x)))
    out = jax.block_until_ready(ours(xs))
    assert_tree_allclose(out, pure(x))
    assert jax.typeof(out).sharding.spec == jax.typeof(pure(xs)).sharding.spec == P("b")
    assert _all_gathers(_hlo(ours, xs)) == _all_gathers(_hlo(pure, xs)) == 0
    rows.clear()  # the shape inference ran on the whole (zeros)
    jax.block_until_ready(ours(xs))
    assert rows == [(B // 4, D)] * 4


def test_per_example_hessians_and_jvps(mesh):
    f = t2j_ad.jaxify(lambda w, x: (torch.tanh(x @ w) ** 2))
    w, x = _data()
    xs = jax.device_put(x, NamedSharding(mesh, P("b")))
    hess = jax.jit(jax.vmap(jax.hessian(f), (None, 0)))
    assert _all_gathers(_hlo(hess, w, xs)) == 0
    assert_tree_allclose(hess(w, xs), jax.vmap(jax.hessian(_jax_loss), (None, 0))(w, x), rtol=1e-4, atol=1e-5)
    tangent = jnp.ones_like(w)
    jvp = jax.jit(jax.vmap(lambda w, x: jax.jvp(lambda w: f(w, x), (w,), (tangent,)), (None, 0)))
    expected = jax.vmap(lambda w, x: jax.jvp(lambda w: _jax_loss(w, x), (w,), (tangent,)), (None, 0))(w, x)
    assert_tree_allclose(jvp(w, xs), expected)


def test_two_dimensional_mesh():
    mesh = _mesh((2, 2), ("x", "y"))
    rows = []
    f = t2j_ad.jaxify(_torch_loss(rows), vmap_method="sequential")
    w, x = _data()
    for spec in (P(("x", "y")), P("x")):
        rows.clear()
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        g = _per_example_grads(f)
        assert _all_gathers(_hlo(g, w, xs)) == 0
        assert_tree_allclose(g(w, xs), jax.vmap(jax.grad(_jax_loss), (None, 0))(w, x))
        # Split over both axes: 16 rows in all; over "x" alone, the two
        # devices along "y" hold the same rows and both compute them.
        assert len(rows) == (B if spec == P(("x", "y")) else 2 * B)


class _Mlp(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.shapes = shapes
        self.fc1 = torch.nn.Linear(D, 5)
        self.fc2 = torch.nn.Linear(5, 2)

    def forward(self, x):
        if x.device.type != "meta":
            self.shapes.append(tuple(x.shape))
        return self.fc2(torch.tanh(self.fc1(x)))


def _jax_mlp(p, x):
    h = jnp.tanh(x @ p["fc1.weight"].T + p["fc1.bias"])
    return h @ p["fc2.weight"].T + p["fc2.bias"]


def _module(mesh, **kwargs):
    torch.manual_seed(0)
    shapes = []
    apply, params = t2j_ad.jaxify_module(_Mlp(shapes), **kwargs)
    return apply, jax.device_put(params, NamedSharding(mesh, P())), shapes


def _mse(apply):
    return lambda p, x, y: jnp.mean((apply(p, x) - y) ** 2)


def test_declared_module_forward_and_grad(mesh):
    apply, params, shapes = _module(mesh, batch_argnums=0)
    _, x = _data()
    y = jnp.cos(jnp.arange(B * 2, dtype=jnp.float32).reshape(B, 2))
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("b"))) for a in (x, y))
    forward = jax.jit(apply)
    assert _all_gathers(_hlo(forward, params, xs)) == 0
    out = forward(params, xs)
    assert out.sharding.spec == P("b")
    assert_tree_allclose(out, _jax_mlp(params, x))
    assert shapes == [(B // 4, D)] * 4  # each device's call saw its own rows

    step = jax.jit(jax.value_and_grad(_mse(apply)))
    # The parameter gradient is a sum over rows: one all-reduce of it, no
    # gather of the batch.
    assert _all_gathers(_hlo(step, params, xs, ys)) == 0
    shapes.clear()
    assert_tree_allclose(step(params, xs, ys), jax.value_and_grad(_mse(_jax_mlp))(params, x, y))
    assert set(shapes) == {(B // 4, D)}


def test_undeclared_call_is_replicated_and_correct(mesh):
    apply, params, shapes = _module(mesh)
    _, x = _data()
    xs = jax.device_put(x, NamedSharding(mesh, P("b")))
    out = jax.jit(apply)(params, xs)
    assert_tree_allclose(out, _jax_mlp(params, x))
    assert set(shapes) == {(B, D)}  # every device ran the whole batch


def test_partitioned_entries_live_as_long_as_the_executable(mesh):
    # NOTE [registry lifetime]: the per-device TorchFn is registered while XLA
    # compiles, into the outer lowering's holder. It must survive the
    # throwaway lowering it was made in and go with the executable.
    w, x = _data()
    xs = jax.device_put(x, NamedSharding(mesh, P("b")))
    jax.clear_caches()
    gc.collect()
    baseline = registry.size()
    f = t2j_ad.jaxify(lambda w, x: torch.tanh(x @ w) ** 2)
    compiled = _per_example_grads(f).lower(w, xs).compile()
    del f
    jax.clear_caches()
    gc.collect()
    assert registry.size() > baseline
    assert_tree_allclose(compiled(w, xs), jax.vmap(jax.grad(_jax_loss), (None, 0))(w, x))
    del compiled
    gc.collect()
    assert registry.size() == baseline


def _recording_sin2():
    shapes = []

    def fn(x):
        if x.device.type != "meta":
            shapes.append(tuple(x.shape))
        return torch.sin(x) * 2

    return t2j_ad.jaxify(fn), shapes


def test_shard_map_sees_the_local_shard(mesh):
    f, shapes = _recording_sin2()
    _, x = _data()
    mapped = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("b"), out_specs=P("b")))
    assert_tree_allclose(mapped(x), jnp.sin(x) * 2)
    assert shapes == [(B // 4, D)] * 4
    grad = jax.jit(jax.shard_map(jax.grad(lambda x: f(x).sum()), mesh=mesh, in_specs=P("b"), out_specs=P("b")))
    assert_tree_allclose(grad(x), 2 * jnp.cos(x))


def test_pmap_sees_the_local_shard():
    f, shapes = _recording_sin2()
    _, x = _data()
    x4 = x.reshape(4, B // 4, D)
    assert_tree_allclose(jax.pmap(f)(x4), jnp.sin(x4) * 2)
    assert shapes == [(B // 4, D)] * 4
    assert_tree_allclose(jax.pmap(jax.grad(lambda x: f(x).sum()))(x4), 2 * jnp.cos(x4))


def test_shard_map_gradient_of_a_replicated_weight(mesh):
    # The weight is the same on every device and x varies: torch_call makes
    # them agree (pvary), so the weight's cotangent is summed over devices.
    f = t2j_ad.jaxify(lambda w, x: torch.tanh(x @ w) ** 2)
    w, x = _data()

    def local_loss(w, x):
        return jax.lax.psum(f(w, x).sum(), "b")

    grad = jax.jit(jax.shard_map(jax.grad(local_loss), mesh=mesh, in_specs=(P(), P("b")), out_specs=P()))
    assert_tree_allclose(grad(w, x), jax.grad(lambda w: _jax_loss(w, x).sum())(w))


def test_graph_mode_traces_the_local_batch_and_stays_sharded(mesh, monkeypatch):
    # compile="graph" under a sharded jit: each device replays a graph traced
    # for its own rows (NOTE [graph mode]); nothing is gathered.
    from t2j_ad import graph_mode

    traced_shapes = []
    original = graph_mode.trace

    def recording(fn, inputs, grad_enabled, *referenced):
        traced_shapes.append([tuple(t.shape) for t in inputs])
        return original(fn, inputs, grad_enabled, *referenced)

    monkeypatch.setattr(graph_mode, "trace", recording)
    f = t2j_ad.jaxify(lambda w, x: torch.tanh(x @ w) ** 2, vmap_method="expand_dims", compile="graph")
    w, x = _data()
    xs = jax.device_put(x, NamedSharding(mesh, P("b")))
    g = _per_example_grads(f)
    assert _all_gathers(_hlo(g, w, xs)) == 0
    for scale in (1.0, -0.5):
        out = g(w * scale, xs)
        assert_tree_allclose(out, jax.vmap(jax.grad(_jax_loss), (None, 0))(w * scale, x))
        assert out.sharding.spec == P("b")
    assert traced_shapes, "nothing was traced"
    assert all((B // 4, D) in shapes for shapes in traced_shapes), traced_shapes


def test_compile_stats_count_the_graphs_of_each_devices_rows(mesh):
    # A declared function runs per device as a copy of itself sized for the
    # device's rows; its graphs count in compile_stats like the function's own.
    w, x = _data()
    stats = {}
    for where, rows in (("one device", x), ("sharded", jax.device_put(x, NamedSharding(mesh, P("b"))))):
        f = t2j_ad.jaxify(lambda w, x: torch.tanh(x @ w), batch_argnums=1, compile="graph")
        grad = jax.jit(jax.grad(lambda w, x: (f(w, x) ** 2).sum()))
        assert_tree_allclose(grad(w, rows), jax.grad(lambda w: _jax_loss(w, x).sum())(w))
        stats[where] = f.compile_stats()
    assert stats["sharded"]["graphs"] == stats["one device"]["graphs"] >= 2, stats  # the value call and its VJP
    assert stats["sharded"]["eager_fallbacks"] == 0, stats


def test_pmap_gradients_of_a_random_function_replay_each_devices_draws():
    # NOTE [derivatives replay the value's draws]: XLA runs the 4 devices'
    # calls on its own threads at once; each device's derivative call must
    # replay the mask its own value call drew while the others draw and
    # replay theirs (without the lock, 27 runs of 30 mixed them up). With
    # the mask m (scaled by 2 at p=0.5), y = (sin x + x) m, and the pullback
    # of 2y is 2y (cos x + 1) m = 4y (cos x + 1) wherever the masks agree.
    f = t2j_ad.jaxify(lambda x: torch.nn.functional.dropout(torch.sin(x) + x, 0.5, training=True))

    def value_and_pullback(x):
        y, pullback = jax.vjp(f, x)
        return y, pullback(2 * y)[0]

    x4 = jnp.arange(4 * 64 * 256, dtype=jnp.float32).reshape(4, 64, 256) / 1000 + 1.0
    for _ in range(10):
        y, g = jax.pmap(value_and_pullback)(x4)
        assert_tree_allclose(g, 4 * y * (jnp.cos(x4) + 1), rtol=1e-4, atol=1e-4)
        assert 0 < int(jnp.sum(y == 0)) < y.size  # it did drop some


class _Average(torch.nn.Module):
    """Scales its input by a running average it updates in place first."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("average", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.average.mul_(0.5).add_(0.5)
        return x * self.average


def test_pmap_gradients_of_a_stateful_module_start_from_each_devices_state():
    # NOTE [derivatives do not write again]: the 4 devices' value calls update
    # the average in turn, in an order XLA's threads choose; each device's
    # derivative must start from the state its own value call started from
    # (dy/dx is the average its value used: y / x) and leave the state as
    # the value calls left it: 4 updates from 0 give 1 - 1/16, not 1 - 1/256.
    module = _Average()
    apply, params = t2j_ad.jaxify_module(module)

    def value_and_pullback(x):
        y, pullback = jax.vjp(lambda x: apply(params, x), x)
        return y, pullback(jnp.ones_like(y))[0]

    x4 = jnp.arange(1, 4 * 8 + 1, dtype=jnp.float32).reshape(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", t2j_ad.FallbackWarning)  # torch.autograd.grad for the captured write
        for step in range(1, 4):
            y, g = jax.pmap(value_and_pullback)(x4)
            assert_tree_allclose(g, y / x4, rtol=1e-6)
            used = sorted(float(a) for a in (y / x4)[:, 0])
            assert np.allclose(used, [1 - 0.5 ** (4 * (step - 1) + k) for k in range(1, 5)]), used
            assert float(module.average) == pytest.approx(1 - 0.5 ** (4 * step))


def test_a_call_with_effects_under_a_sharded_jit_is_refused_naming_shard_map(mesh):
    """NOTE [a call with effects on a mesh]: dropout, or a module in training
    mode, under a jax.jit over the mesh failed to compile with XLA's
    internal error ("Side-effect HLO must have sharding"), its inputs
    sharded or not; inside shard_map each device runs its own shard."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3).train()
    apply, params = t2j_ad.jaxify_module(bn, device=NamedSharding(mesh, P()))
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    drop = t2j_ad.jaxify(lambda x: torch.nn.functional.dropout(x, 0.5))
    for spec in (P(), P("b")):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        with pytest.raises(NotImplementedError, match=r"BatchNorm1d.forward draws random numbers .* over 4 devices.*jax.shard_map"):
            jax.jit(apply)(params, xs)
        with pytest.raises(NotImplementedError, match=r"over 4 devices.*jax.shard_map"):
            jax.jit(drop)(xs)
    per_shard = jax.jit(
        jax.shard_map(lambda p, x: apply(p, x), mesh=mesh, in_specs=(P(), P("b")), out_specs=P("b"))
    )(params, jax.device_put(x, NamedSharding(mesh, P("b"))))
    shards = x.reshape(4, 2, 3)  # each device normalizes its own 2 rows, as BatchNorm does in training
    mean, var = shards.mean(1, keepdims=True), shards.var(1, keepdims=True)
    expected = ((shards - mean) / np.sqrt(var + bn.eps)).reshape(8, 3)
    np.testing.assert_allclose(np.asarray(per_shard), expected, rtol=1e-4, atol=1e-5)
    assert int(bn.num_batches_tracked) == 4  # one update per device's call, as 4 PyTorch calls make


def test_a_mapped_call_with_effects_whose_batch_is_not_split_is_refused(mesh):
    """A vmapped dropout or a declared training-mode module whose batch is
    replicated over the mesh ran once per device on the whole batch: four
    different masks behind one "replicated" result, value and gradient from
    different masks, and state updated four times."""
    drop = t2j_ad.jaxify(lambda x: torch.nn.functional.dropout(x, 0.5, training=True), vmap_method="sequential")
    apply, params = t2j_ad.jaxify_module(torch.nn.BatchNorm1d(3).train(), batch_argnums=0)
    x = np.ones((16, 3), np.float32)
    for spec in (P(), P(None, "b")):
        xs = jax.device_put(np.ones((16, 4), np.float32), NamedSharding(mesh, spec))
        with pytest.raises(Exception, match=r"draws random numbers .* over 4 devices.*not split.*jax.shard_map"):
            jax.jit(jax.value_and_grad(lambda x: jax.vmap(drop)(x).sum()))(xs)
    with pytest.raises(Exception, match=r"BatchNorm1d.forward draws random numbers .*not split"):
        jax.jit(apply)(params, jax.device_put(x, NamedSharding(mesh, P())))
    # Split along the mapped axis, each device draws for its own rows: one mask per row.
    xs = jax.device_put(np.ones((16, 4), np.float32), NamedSharding(mesh, P("b")))
    value, grad = jax.jit(jax.value_and_grad(lambda x: jax.vmap(drop)(x).sum()))(xs)
    assert float(value) == pytest.approx(float(grad.sum()))  # y = 2 m x, dy/dx = 2 m


def test_on_explicit_axes_cotangents_have_their_primals_sharded_types():
    # A cotangent must have its primal's type; a call's results are typed
    # whole unless mapped, so jax.grad with respect to a sharded input of an
    # undeclared call (or a parameter sharded over a model axis) failed
    # inside JAX: "Expected cotangent type float32[16@b,3] but got float32[16,3]".
    mesh = _explicit_mesh()
    x = np.arange(48, dtype=np.float32).reshape(16, 3) / 10
    xs = jax.device_put(x, NamedSharding(mesh, P("b")))
    f = t2j_ad.jaxify(lambda x: torch.sin(x) * 2)
    grad = jax.jit(jax.grad(lambda x: f(x).sum()))(xs)
    assert_tree_allclose(grad, 2 * np.cos(x), rtol=1e-6)
    assert jax.typeof(grad).sharding.spec == P("b", None)
    jac = jax.jit(jax.jacrev(lambda x: f(x).sum(1)))(xs)
    assert_tree_allclose(jac, jax.jacrev(lambda x: (jnp.sin(x) * 2).sum(1))(x), rtol=1e-6)
    # Two axes: the batch on one, a weight on the other, declared and not.
    grid = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    ws = jax.device_put(w, NamedSharding(grid, P(None, "model")))
    xd = jax.device_put(x[:8], NamedSharding(grid, P("data")))
    g = t2j_ad.jaxify(lambda x, w: torch.tanh(x @ w))
    expected = jax.grad(lambda x, w: (jnp.tanh(x @ w) ** 2).sum(), (0, 1))(x[:8], w)
    for fn in (g, t2j_ad.jaxify(lambda x, w: torch.tanh(x @ w), batch_argnums=0)):
        got = jax.jit(jax.grad(lambda x, w: (fn(x, w) ** 2).sum(), (0, 1)))(xd, ws)
        assert_tree_allclose(got, expected, rtol=1e-5, atol=1e-6)
        assert jax.typeof(got[1]).sharding.spec == P(None, "model")


def test_calls_with_empty_results_under_a_jit_over_the_mesh_return_them(mesh):
    # NOTE [empty results on a mesh]: XLA's partitioner refused the side-effect
    # mark such a call carries, with an internal RET_CHECK.
    f = t2j_ad.jaxify(lambda x: torch.sin(x))
    empty = np.zeros((0, 3), np.float32)
    for spec in (P(), P("b")):
        assert jax.jit(f)(jax.device_put(empty, NamedSharding(mesh, spec))).shape == (0, 3)
    g = t2j_ad.jaxify(lambda x: x[:, :0])
    x = jax.device_put(np.ones((8, 3), np.float32), NamedSharding(mesh, P("b")))
    out, total = jax.jit(lambda x: (g(x), x.sum()))(x)
    assert out.shape == (8, 0) and float(total) == 24.0
    grads = jax.jit(jax.vmap(jax.grad(lambda x: f(x).sum())))(jax.device_put(empty, NamedSharding(mesh, P("b"))))
    assert grads.shape == (0, 3)


def test_a_pmap_of_a_module_apply_inside_a_first_call():
    # The outer function's first call holds the trial-run lock for its trial
    # runs; the pmap inside runs the apply on XLA's device threads, and every
    # eager module call took that lock first: each waited for the thread that
    # waited for them, for good (NOTE [calls made inside a module's forward]).
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 3)
    apply, params = t2j_ad.jaxify_module(linear)
    per_device = jax.pmap(lambda v: apply(params, v))
    x4 = jnp.sin(jnp.arange(4 * 2 * 3, dtype=jnp.float32)).reshape(4, 2, 3)
    outer = t2j_ad.jaxify(lambda x: x * torch.from_numpy(np.asarray(per_device(x4))).sum())
    y = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)
    got = [finishes_within(lambda: np.asarray(outer(y)), seconds=30) for _ in range(2)]
    with torch.no_grad():
        want = torch.from_numpy(np.asarray(y)) * linear(torch.from_numpy(np.asarray(x4))).sum()
    for value in got:
        np.testing.assert_allclose(value, want.numpy(), rtol=1e-5, atol=1e-5)


def test_a_pmap_of_forward_mode_calls_inside_a_first_call():
    # Every forward-mode call took the trial-run lock, held here by the outer
    # function's first call while the pmap's device threads ran the jvps.
    inner = t2j_ad.jaxify(lambda t: torch.sin(t))
    per_device = jax.pmap(lambda v: jax.jvp(inner, (v,), (jnp.ones_like(v),))[1])
    x4 = jnp.linspace(-2.0, 2.0, 12, dtype=jnp.float32).reshape(4, 3)
    outer = t2j_ad.jaxify(lambda x: x * torch.from_numpy(np.asarray(per_device(x4))).sum())
    y = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)
    got = [finishes_within(lambda: np.asarray(outer(y)), seconds=30) for _ in range(2)]
    t = torch.from_numpy(np.asarray(x4))
    _, tangent = torch.func.jvp(torch.sin, (t,), (torch.ones_like(t),))
    want = torch.from_numpy(np.asarray(y)) * tangent.sum()
    for value in got:
        np.testing.assert_allclose(value, want.numpy(), rtol=1e-5, atol=1e-5)


def test_compile_stats_count_graphs_dropped_before_a_sharded_call_once(mesh, monkeypatch):
    # The per-device copy of a function (BaseFn.with_leading_size) shared its
    # record of the graphs the function had dropped (NOTE [how many graphs a
    # function keeps]), so compile_stats counted each of them twice once a
    # sharded jax.jit had run it per device. A graph per dropout rate: more
    # rates than graphs kept, each traced (not run eagerly as an annealing
    # is after a few: NOTE [a setting changed every step]).
    from t2j_ad import graph_mode

    monkeypatch.setattr(graph_mode, "_RETRACES_FOR_SETTINGS", 100)

    net = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Dropout(0.5))
    f = t2j_ad.jaxify(lambda x: net(x), batch_argnums=0, compile="graph")
    sharded_only = t2j_ad.jaxify(lambda x: net(x), batch_argnums=0, compile="graph")
    _, x = _data()
    xs = jax.device_put(x, NamedSharding(mesh, P("b")))
    rates = [0.05 * (k + 1) for k in range(graph_mode._GRAPHS_KEPT + 3)] + [0.0]
    for k, rate in enumerate(rates):
        net[1].p = rate
        torch.manual_seed(k)
        got = f(x)
        torch.manual_seed(k)
        assert_tree_allclose(got, net(torch.as_tensor(np.asarray(x))).detach().numpy())
    assert f.compile_stats()["graphs"] == len(rates)
    expected = net(torch.as_tensor(np.asarray(x))).detach().numpy()  # rate 0: no draws
    assert_tree_allclose(jax.jit(f)(xs), expected)
    assert_tree_allclose(jax.jit(sharded_only)(xs), expected)
    per_device = sharded_only.compile_stats()["graphs"]
    assert per_device >= 1
    assert f.compile_stats()["graphs"] == len(rates) + per_device, (f.compile_stats(), per_device)
