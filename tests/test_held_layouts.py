"""A graph is used only while the tensors it holds keep the layouts it was
traced with (NOTE [the layouts a graph assumed]): held against the same
function called eagerly and against ``jax.numpy``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import TORCH_DEVICE, assert_tree_allclose, to_numpy, to_torch

import t2j_ad
from t2j_ad.held_layouts import HeldLayouts, named_tensors
from t2j_ad.references import held_at
from t2j_ad.rules.fallbacks import FallbackWarning


def _both_modes(fn):
    return {mode: jax.jit(t2j_ad.jaxify(fn, compile=mode)) for mode in ("eager", "graph")}


def test_a_size_read_from_a_resized_parameter_is_read_again(traces):
    # The graph kept x * 4 after w.data = ones(2): eager gives x * 2.
    w = torch.nn.Parameter(torch.ones(4, device=TORCH_DEVICE))

    def f(x):
        return x * w.shape[0]

    calls = _both_modes(f)
    x = jnp.arange(3.0)
    for size in (4, 2, 2, 5):
        w.data = torch.ones(size, device=TORCH_DEVICE)
        for call in calls.values():
            assert_tree_allclose(call(x), x * size)
    assert len(traces) == 3  # one per size the graph met, the repeated 2 replayed


def test_compile_stats_count_the_graphs_a_resized_parameter_replaced(traces):
    """A graph for old layouts is replaced by the one traced for the new
    (NOTE [the layouts a graph assumed]), under the same key:
    ``compile_stats()`` kept the graph's count and the latest trace's
    seconds alone (1 graph for 3 traces); each trace made is counted
    (NOTE [how many graphs a function keeps])."""
    w = torch.nn.Parameter(torch.ones(4, device=TORCH_DEVICE))
    f = t2j_ad.jaxify(lambda x: x * w.shape[0], compile="graph")
    g = jax.jit(f)
    x = jnp.arange(3.0)
    seconds = []
    for size in (4, 2, 2, 5):
        w.data = torch.ones(size, device=TORCH_DEVICE)
        assert_tree_allclose(g(x), x * size)
        seconds.append(f.compile_stats()["trace_seconds"])
    assert len(traces) == 3
    assert f.compile_stats()["graphs"] == len(traces)
    assert seconds[0] < seconds[1] == seconds[2] < seconds[3]  # each trace's seconds added, none replaced


def test_a_resized_tensor_the_graph_holds_is_traced_again():
    # b is a graph constant: its new size reached b.sum() but not the size
    # the graph had read from it.
    b = torch.ones(4, device=TORCH_DEVICE)

    def f(x):
        return x * b.numel() + b.sum()

    calls = _both_modes(f)
    x = jnp.arange(3.0)
    for size in (4, 6):
        b.data = torch.ones(size, device=TORCH_DEVICE)
        expected = x * size + size
        for call in calls.values():
            assert_tree_allclose(call(x), expected)


def test_gradients_follow_a_resized_parameter():
    w = torch.nn.Parameter(torch.arange(1.0, 5.0, device=TORCH_DEVICE))

    def loss(x):
        return (x[: w.shape[0]] * w).sum() * w.shape[0]

    grads = {mode: jax.jit(jax.grad(call)) for mode, call in _both_modes(loss).items()}
    x = jnp.arange(6.0)
    for values in (torch.arange(1.0, 5.0), torch.arange(1.0, 3.0)):
        w.data = values.to(TORCH_DEVICE)
        n = values.shape[0]
        expected = jnp.zeros(6).at[:n].set(jnp.asarray(values.numpy()) * n)
        for grad in grads.values():
            assert_tree_allclose(grad(x), expected)


def test_a_transposed_parameter_traces_again_instead_of_failing_a_view():
    # The graph's reshape was a view of a contiguous weight; a transposed
    # weight failed it ("view size is not compatible").
    w = torch.nn.Parameter(torch.arange(6.0, device=TORCH_DEVICE).reshape(2, 3))

    def f(x):
        return x * w.reshape(-1).sum() + w.reshape(-1)[:3].sum()

    calls = _both_modes(f)
    x = jnp.ones(2)
    for weight in (torch.arange(6.0).reshape(2, 3), torch.arange(6.0).reshape(3, 2).T):
        w.data = weight.to(TORCH_DEVICE)
        expected = x * float(weight.sum()) + float(weight.reshape(-1)[:3].sum())
        for call in calls.values():
            assert_tree_allclose(call(x), expected)


def test_a_new_value_of_the_same_layout_keeps_the_graph(traces):
    # A hand-written SGD step on a closed-over parameter: no trace per step.
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, device=TORCH_DEVICE, dtype=torch.float64))
    with jax.enable_x64(True):
        loss = jax.jit(jax.value_and_grad(t2j_ad.jaxify(lambda x: ((x * w) ** 2).sum(), compile="graph")))
        x = jnp.arange(1.0, 4.0, dtype=jnp.float64)
        for _ in range(4):
            value, _ = loss(x)
            (reference,) = torch.autograd.grad(((to_torch(x) * w) ** 2).sum(), w)
            expected = float(((to_numpy(w) * np.asarray(x)) ** 2).sum())
            np.testing.assert_allclose(float(value), expected, rtol=1e-12)
            w.data = w.data - 0.1 * reference
    assert len(traces) == 2  # the value, and its derivative: each once


def test_held_layouts_see_size_stride_offset_and_dtype():
    base = torch.zeros(12)
    t = base[:6]
    held = HeldLayouts([t, t])  # one tensor, looked at once
    assert len(held) == 1 and held.hold()
    t.data = torch.zeros(6)  # same layout, other memory
    assert held.hold()
    for change in (
        lambda: torch.zeros(5),
        lambda: torch.zeros(12)[::2],
        lambda: torch.zeros(7)[1:],
        lambda: torch.zeros(6, dtype=torch.float64),
    ):
        t.data = change()
        assert not held.hold()
        t.data = torch.zeros(6)
        assert held.hold()


def test_held_layouts_skip_tensors_without_strides():
    sparse = torch.eye(3).to_sparse()
    held = HeldLayouts([sparse, torch.ones(2)])
    assert len(held) == 1 and held.hold()


def test_named_tensors_are_where_the_function_finds_its_tensors():
    w = torch.ones(2)
    table = {"b": torch.zeros(3)}
    module = torch.nn.Linear(2, 2)

    def f(x):
        return module(x) * w + table["b"].sum()

    found = [held_at(holder, key) for holder, key in named_tensors(f)]
    assert {id(t) for t in found} == {id(w), id(table["b"])}  # a module's own tensors: its own business


def test_a_tensor_that_changes_size_every_call_stops_tracing(traces):
    # A memory bank grown between calls traced on every call, 25-50x slower
    # than eager; after a few such traces the function runs eagerly.
    bank = torch.ones(1, device=TORCH_DEVICE)

    def f(x):
        return x * bank.sum() + bank.shape[0]

    g = jax.jit(t2j_ad.jaxify(f, compile="graph"))
    x = jnp.arange(3.0)
    with pytest.warns(FallbackWarning, match="changed its size, strides or dtype"):
        for size in range(1, 9):
            bank.data = torch.ones(size, device=TORCH_DEVICE)
            assert_tree_allclose(g(x), x * size + size)
    assert len(traces) == 4  # the first trace, and three for new sizes


def test_a_tensor_the_function_only_names_is_not_kept_alive():
    # Weakly looked at: a notebook that binds new weights to the name frees
    # the old ones (a graph kept a copy of every closed-over model's weights).
    import gc
    import weakref

    box = {"w": torch.ones(4, device=TORCH_DEVICE)}
    probe = weakref.ref(box["w"])
    f = t2j_ad.jaxify(lambda x: x * box["w"].shape[0], compile="graph")
    x = jnp.arange(3.0)
    assert_tree_allclose(f(x), 4 * x)
    box["w"] = torch.ones(2, device=TORCH_DEVICE)
    gc.collect()
    assert probe() is None
    assert_tree_allclose(f(x), 2 * x)
    box["w"] = torch.ones(7, device=TORCH_DEVICE)  # the tensor named now is looked at, not the first
    assert_tree_allclose(f(x), 7 * x)
