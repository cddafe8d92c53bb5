"""NOTE [graph ops through the public bindings]: a traced graph's aten op
calls move to PyTorch's public bindings only where the binding reaches the
same op with the same arguments; the graph computes what it did."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import t2j_ad
from t2j_ad import public_bindings
from t2j_ad.graph_mode import artifacts
from t2j_ad.public_bindings import through_public_bindings


def _aten_targets(graph: torch.fx.GraphModule) -> set[str]:
    return {
        str(n.target)
        for n in graph.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
    }


def _many_ops(w, x, idx):
    h = torch.tanh(x @ w)
    h = torch.nn.functional.gelu(h) + h.t().reshape(h.shape) * 2.0
    h = torch.nn.functional.layer_norm(h, h.shape[-1:])
    a, b = h.split(2, dim=0)
    picked = torch.index_select(h, 0, idx) / 3
    total = torch.cat([a, b, picked]).clamp(-1.0, 1.0).sum(0)
    return total, torch.ones(3, dtype=torch.float32) * h.mean(), h.new_zeros(2).add_(1.5)


def test_a_rebound_graph_computes_what_the_traced_graph_did():
    w, x, idx = torch.randn(4, 4), torch.randn(4, 4), torch.tensor([0, 2, 3])
    traced = make_fx(_many_ops, tracing_mode="fake")(w, x, idx)
    rebound = make_fx(_many_ops, tracing_mode="fake")(w, x, idx)
    before = _aten_targets(rebound)
    moved = through_public_bindings(rebound)
    assert moved > 10
    left = _aten_targets(rebound)
    assert "aten.mm.default" in before and "aten.mm.default" not in left  # torch.mm reaches it
    assert "torch.mm(" in rebound.code and "torch._C._nn.gelu(" in rebound.code
    # torch.mul(t, 2.0) would reach mul.Tensor, not the graph's mul.Scalar:
    # such calls keep their OpOverload.
    assert {"aten.mul.Scalar", "aten.div.Scalar"} & before <= left
    for got, want in zip(rebound(w, x, idx), traced(w, x, idx)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The factory calls carried their dtype: a later default dtype changes nothing.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for got, want in zip(rebound(w, x, idx), traced(w, x, idx)):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        torch.set_default_dtype(previous)


def _layer(w, x):
    h = torch.nn.functional.gelu(torch.tanh(x @ w)) + x * 2.0
    return torch.nn.functional.layer_norm(h, h.shape[-1:]).sum(0), h.mean()


def test_a_graph_of_other_sizes_is_rebound_from_the_kept_answers(monkeypatch):
    # NOTE [a binding's answer, kept]: the same ops on tensors of other sizes
    # make no fake call, move the same nodes, and compute what the trace did.
    first = make_fx(_layer, tracing_mode="fake")(torch.randn(4, 4), torch.randn(3, 4))
    ops = _aten_targets(first)
    moved_first = through_public_bindings(first)
    checked = []
    original = public_bindings._checked_reaches

    def counting(*args):
        checked.append(args[3])
        return original(*args)

    monkeypatch.setattr(public_bindings, "_checked_reaches", counting)
    w, x = torch.randn(6, 6), torch.randn(2, 6)
    traced = make_fx(_layer, tracing_mode="fake")(w, x)
    rebound = make_fx(_layer, tracing_mode="fake")(w, x)
    assert _aten_targets(rebound) == ops  # the same ops, on other sizes
    assert through_public_bindings(rebound) == moved_first > 3
    assert checked == []
    assert "torch.mm(" in rebound.code and "torch._C._nn.gelu(" in rebound.code
    for got, want in zip(rebound(w, x), traced(w, x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_answers_are_kept_apart_by_what_a_binding_can_tell_apart():
    def key(kind, binding, op, args, kwargs):
        return public_bindings._answer_key(kind, binding, op, public_bindings._argument_kinds(args, kwargs))

    op, a, b = torch.ops.aten.add.Tensor, torch.ones(3), torch.ones(3)
    assert key("call_function", torch.add, op, (a, b), {}) == key("call_function", torch.add, op, (torch.ones(7), a), {})
    assert key("call_function", torch.add, op, (a, b), {"alpha": 2}) == key("call_function", torch.add, op, (a, b), {"alpha": 5})
    different = [
        key("call_function", torch.add, op, (a, a), {}),  # one tensor twice
        key("call_function", torch.add, op, (a, b.double()), {}),
        key("call_function", torch.add, op, (a, torch.ones(3, 1)), {}),
        key("call_function", torch.add, op, (a, 1), {}),
        key("call_function", torch.add, op, (a, 1.0), {}),
        key("call_function", torch.add, op, (a, True), {}),
        key("call_function", torch.add, op, (a, b), {"alpha": 2}),
        key("call_function", torch.add, op, (a, b), {"alpha": torch.float64}),
        key("call_method", "add", op, (a, b), {}),
    ]
    assert len(set(different + [key("call_function", torch.add, op, (a, b), {})])) == len(different) + 1
    assert key("call_function", torch.add, op, (a, {"unhashable": 1}), {}) is None


def test_rebinding_draws_nothing_and_the_graph_draws_as_traced():
    def noisy(x):
        return torch.nn.functional.dropout(x * 2, 0.5, training=True) + torch.randn(x.shape)

    x = torch.ones(64)
    traced = make_fx(noisy, tracing_mode="fake")(x)
    rebound = make_fx(noisy, tracing_mode="fake")(x)
    state = torch.get_rng_state()
    through_public_bindings(rebound)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(3)
    want = traced(x)
    torch.manual_seed(3)
    got = rebound(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_graph_with_a_subclass_constant_keeps_its_op_calls():
    class Tagged(torch.Tensor):
        pass

    weight = torch.ones(3).as_subclass(Tagged)
    graph = make_fx(lambda x: torch.sin(x) * weight.as_subclass(torch.Tensor), tracing_mode="fake",
                    _allow_non_fake_inputs=True)(torch.ones(3))
    plain = sum(isinstance(getattr(graph, n.target), torch.Tensor) for n in graph.graph.nodes if n.op == "get_attr")
    if not plain:
        pytest.skip("make_fx held no tensor constant for this function in this PyTorch")
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            setattr(graph, node.target, getattr(graph, node.target).as_subclass(Tagged))
    assert through_public_bindings(graph) == 0


def test_graph_mode_replays_through_public_bindings_and_agrees_with_eager():
    def loss(w, x):
        h = x
        for _ in range(4):
            h = torch.nn.functional.layer_norm(torch.relu(h @ w) + h, h.shape[-1:])
        return (h**2).mean()

    graph_fn = t2j_ad.jaxify(loss, compile="graph")
    eager_fn = t2j_ad.jaxify(loss)
    w = jnp.asarray(np.random.default_rng(0).normal(size=(6, 6)) * 0.3, jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 6)), jnp.float32)
    np.testing.assert_allclose(jax.jit(graph_fn)(w, x), jax.jit(eager_fn)(w, x), rtol=1e-6)
    np.testing.assert_allclose(
        jax.jit(jax.grad(graph_fn))(w, x), jax.jit(jax.grad(eager_fn))(w, x), rtol=1e-5, atol=1e-6
    )
    (signature,) = graph_fn._cache.values()
    replayed = [a for a in artifacts(signature.base) if a.run is not None]
    assert replayed
    for artifact in replayed:
        graph = artifact.run.__self__
        assert "torch.mm(" in graph.code and "torch.ops.aten.mm.default" not in graph.code
