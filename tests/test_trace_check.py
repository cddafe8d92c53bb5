"""A traced graph is checked against eager where its layouts differ from the
trace's (NOTE [checking a trace against eager] in t2j_ad/trace_check.py).

Stand-ins force the check (a layout divergence) or a wrong graph, which no
PyTorch version is guaranteed to give; results are held against pure JAX or
against the same function run eagerly. The case that found it (jacfwd of det
under a size-1 vmap) is in tests/test_regressions.py.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import TORCH_DEVICE, assert_tree_allclose, to_numpy
from torch.fx.experimental.proxy_tensor import make_fx

import t2j_ad
from t2j_ad import graph_mode, trace_check
from t2j_ad.rules.fallbacks import FallbackWarning


def _fallbacks(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, FallbackWarning)]


def _diverge_always(monkeypatch):
    run = trace_check.run_checking_layouts
    monkeypatch.setattr(trace_check, "run_checking_layouts", lambda graph, inputs: (run(graph, inputs)[0], "a stand-in"))


def test_a_graph_that_disagrees_with_eager_is_dropped_with_one_warning(monkeypatch):
    original = graph_mode.trace

    def wrong_trace(fn, inputs, grad_enabled, *referenced):
        return original(lambda x: (x * 3,), inputs, grad_enabled, *referenced)  # the function doubles

    monkeypatch.setattr(graph_mode, "trace", wrong_trace)
    _diverge_always(monkeypatch)
    f = jax.jit(t2j_ad.jaxify(lambda x: x * 2, compile="graph"))
    x = jnp.arange(4.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert_tree_allclose(f(x), x * 2)
        assert_tree_allclose(f(x + 1), (x + 1) * 2)
    (message,) = _fallbacks(record)
    assert "dropped the traced graph" in message
    assert "disagreed with the eager call on output 0" in message and "(a stand-in)" in message
    assert "Python control flow" not in message  # the trace worked: no advice about tracing


def test_a_graph_that_agrees_is_kept_and_leaves_the_generator_where_eager_does(monkeypatch):
    _diverge_always(monkeypatch)

    def noisy(x):
        return x * 2 + torch.rand_like(x)

    x = jnp.zeros(4)
    drawn = {}
    for mode in ("eager", "graph"):
        f = jax.jit(t2j_ad.jaxify(noisy, compile=mode))
        torch.manual_seed(1234)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            first = np.asarray(f(x))  # graph mode: traced, checked, then run
        drawn[mode] = (first, to_numpy(torch.rand(2, device=TORCH_DEVICE)))
    np.testing.assert_array_equal(drawn["graph"][0], drawn["eager"][0])
    np.testing.assert_array_equal(drawn["graph"][1], drawn["eager"][1])
    torch.manual_seed(1234)
    np.testing.assert_array_equal(drawn["graph"][0], to_numpy(torch.rand(4, device=TORCH_DEVICE)))


def _traced(fn, *inputs) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _relabel(graph: torch.fx.GraphModule, name: str, strides: tuple[int, ...]) -> None:
    """Make ``graph``'s trace-time record of node ``name`` claim ``strides``."""
    node = next(n for n in graph.graph.nodes if n.name == name)
    fake = node.meta["val"]
    with fake.fake_mode:
        node.meta["val"] = torch.empty_strided(fake.shape, strides, dtype=fake.dtype)


def _divergence(graph, inputs):
    return trace_check.run_checking_layouts(graph, inputs)[1]


def test_the_first_node_laid_out_unlike_its_trace_is_named():
    x = torch.randn(2, 3)
    graph = _traced(lambda x: ((x * 2).t().contiguous() + 1,), x)
    results, divergence = trace_check.run_checking_layouts(graph, [x])
    assert divergence is None
    torch.testing.assert_close(results[0], (x * 2).t() + 1)
    names = [n.name for n in graph.graph.nodes if n.op == "call_function"]
    clone = next(n for n in names if n.startswith("clone"))
    _relabel(graph, clone, (1, 3))  # real: (2, 1), contiguous (3, 2)
    divergence = _divergence(graph, [x])
    assert divergence is not None and divergence.startswith(clone) and "(2, 1)" in divergence


def test_strides_of_size_one_dims_are_not_a_divergence():
    x = torch.randn(1, 3)
    graph = _traced(lambda x: (x * 2,), x)
    mul = next(n.name for n in graph.graph.nodes if n.name.startswith("mul"))
    _relabel(graph, mul, (7, 1))  # the size-1 dim's stride means nothing
    assert _divergence(graph, [x]) is None


def test_graph_constants_are_the_tensors_a_graph_holds_by_reference():
    norm = torch.nn.BatchNorm1d(3).train()
    graph = graph_mode.trace(lambda x: (norm(x),), [torch.randn(4, 3)], False)
    found = {id(t) for t in trace_check.graph_constants(graph)}
    assert found == {id(t) for t in (*norm.parameters(), *norm.buffers())}


def _accumulating(state):
    def accumulate(x):
        state.add_(x.sum())
        return x * state

    return accumulate


@pytest.mark.parametrize("graph_is_wrong", [False, True], ids=["agrees", "disagrees"])
def test_a_checked_first_call_updates_state_once(monkeypatch, graph_is_wrong):
    # The first run's update stands; the check's runs put the state back.
    _diverge_always(monkeypatch)
    if graph_is_wrong:
        original = graph_mode.trace
        monkeypatch.setattr(
            graph_mode, "trace", lambda fn, inputs, grad, *referenced: original(lambda x: (fn(x)[0] + 1,), inputs, grad, *referenced)
        )
    x = jnp.array([1.0, 2.0])
    eager_state = torch.zeros((), device=TORCH_DEVICE)
    eager = jax.jit(t2j_ad.jaxify(_accumulating(eager_state), compile="eager"))
    expected = [np.asarray(eager(x)) for _ in range(2)]
    state = torch.zeros((), device=TORCH_DEVICE)
    f = jax.jit(t2j_ad.jaxify(_accumulating(state), compile="graph"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if graph_is_wrong:
            # Its update cannot be undone, so the call cannot return eager's results.
            with pytest.raises(Exception, match="cannot be undone"):
                jax.block_until_ready(f(x))
            np.testing.assert_array_equal(np.asarray(f(x)), expected[1])  # eagerly, from then on
        else:
            np.testing.assert_array_equal([np.asarray(f(x)) for _ in range(2)], expected)
    assert float(state) == float(eager_state) == 6.0
    assert len(_fallbacks(record)) == int(graph_is_wrong)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_rounding_passes_and_a_transposed_result_does_not(dtype):
    a = torch.tensor([[4.0, -1.0], [0.5, 4.4]], dtype=dtype)
    ulp = torch.finfo(dtype).eps * 4
    assert trace_check._mismatch(a, a * (1 + ulp)) is None
    assert "off by up to" in trace_check._mismatch(a, a.t().contiguous())


def test_special_values_and_integers_must_match_exactly():
    a = torch.tensor([1.0, float("inf"), float("nan")])
    assert trace_check._mismatch(a, a.clone()) is None
    assert "NaN or infinite" in trace_check._mismatch(a, torch.tensor([1.0, float("inf"), 0.0]))
    assert "NaN or infinite" in trace_check._mismatch(a, torch.tensor([1.0, -float("inf"), float("nan")]))
    n = torch.tensor([1, 2, 3])
    assert trace_check._mismatch(n, n.clone()) is None
    assert trace_check._mismatch(n, n + 1) == "different values"
    assert "where eager gives (3,)" in trace_check._mismatch(n, n[:2])


# ------------------------- a first run that fails on its inputs (NOTE [a first
# run that fails on its inputs] in t2j_ad/graph_mode.py)

_NOT_POSITIVE_DEFINITE = "not positive-definite"


def _cholesky_sum(a):
    return torch.linalg.cholesky(a).sum()


def _counting_traces(monkeypatch) -> list[int]:
    traces = []
    original = graph_mode.trace

    def counted(*args, **kwargs):
        traces.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(graph_mode, "trace", counted)
    return traces


_CALLS = {
    "jit(grad)": lambda f: jax.jit(jax.grad(f)),
    "grad": jax.grad,
    "jit": jax.jit,
    "plain": lambda f: f,
}


@pytest.mark.parametrize("call", list(_CALLS))
def test_a_first_run_that_fails_on_its_inputs_as_eager_does_keeps_the_graph(monkeypatch, call):
    # cholesky of a matrix that is not positive definite raises in eager
    # PyTorch too. That first call's graph was dropped for good, every later
    # call ran eagerly, and a FallbackWarning blamed the graph's first run.
    # Now the call raises eager's error, with no warning, the graph is kept,
    # and failing calls after it trace no more.
    good = jnp.eye(3) * 2.0 + 0.5
    bad = -good
    eager = _CALLS[call](t2j_ad.jaxify(_cholesky_sum, compile="eager"))
    with pytest.raises(Exception, match=_NOT_POSITIVE_DEFINITE) as eager_refusal:
        jax.block_until_ready(eager(bad))
    traces = _counting_traces(monkeypatch)
    jaxified = t2j_ad.jaxify(_cholesky_sum, compile="graph")
    f = _CALLS[call](jaxified)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        traced = []
        for _ in range(3):  # a function failing on most inputs is not traced per call
            with pytest.raises(type(eager_refusal.value), match=_NOT_POSITIVE_DEFINITE):
                jax.block_until_ready(f(bad))
            traced.append(len(traces))
        for scale in (1.0, 2.0):
            got = f(good * scale)
            a = torch.tensor(np.asarray(good * scale), device=TORCH_DEVICE)
            expected = torch.func.grad(_cholesky_sum)(a) if "grad" in call else _cholesky_sum(a)
            assert_tree_allclose(got, to_numpy(expected), rtol=1e-5, atol=1e-5)
        traced.append(len(traces))
        with pytest.raises(type(eager_refusal.value), match=_NOT_POSITIVE_DEFINITE):
            jax.block_until_ready(f(bad))  # the kept graph's error, as eager's
        traced.append(len(traces))
    # On a GPU the graph's error check reads cholesky's info on the host,
    # which a CUDA graph capture cannot: one warning says the graph runs as
    # an aten graph instead (NOTE [CUDA graph replay]). The trace stands.
    assert [m for m in _fallbacks(record) if "could not be captured as a CUDA graph" not in m] == []
    # Traced at the first failing call; without jax.jit, jax.grad's
    # derivative is first called (and traced) by the first good call.
    assert traced[0] == traced[1] == traced[2] >= 1 and traced[3] == traced[4]
    stats = jaxified.compile_stats()
    assert stats["graphs"] >= 1 and stats["eager_fallbacks"] == 0


def _effects_unmarked_as_torch_2_11_has_them(monkeypatch):
    """FX's purity as torch 2.11 has it: ``_linalg_check_errors``, which
    returns nothing, is not marked as having effects (torch 2.13 marks it)."""
    is_impure = torch.fx.Node.is_impure
    check = torch.ops.aten._linalg_check_errors.default

    def unmarked(node, *args, **kwargs):
        return node.target is not check and is_impure(node, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Node, "is_impure", unmarked)


@pytest.mark.parametrize("call", ["plain", "jit(grad)"])
def test_a_check_that_returns_nothing_stays_in_the_graph(monkeypatch, call):
    # NOTE [a check that returns nothing] in t2j_ad/graph_mode.py: with torch
    # 2.11 (the H100 run) dead-code elimination dropped cholesky's error
    # check, and the graph returned NaN for a matrix that is not positive
    # definite, where eager PyTorch raises: in the first run, and in every
    # replay after a first call that worked.
    _effects_unmarked_as_torch_2_11_has_them(monkeypatch)
    good = jnp.eye(3) * 2.0 + 0.5
    bad = -good
    a = torch.tensor(np.asarray(good), device=TORCH_DEVICE)
    expected = torch.func.grad(_cholesky_sum)(a) if "grad" in call else _cholesky_sum(a)
    for mode, first in [("eager", good), ("graph", bad), ("graph", good)]:
        f = _CALLS[call](t2j_ad.jaxify(_cholesky_sum, compile=mode))
        if first is good:  # then replays of the graph
            assert_tree_allclose(f(good), to_numpy(expected), rtol=1e-5, atol=1e-5)
        for _ in range(2):
            # JAX raises a JaxRuntimeError or a ValueError by its dispatch path, eager's too
            with pytest.raises(Exception, match=_NOT_POSITIVE_DEFINITE):
                jax.block_until_ready(f(bad))


def test_a_first_run_that_fails_where_eager_works_drops_the_graph(monkeypatch):
    # The trace is at fault: the graph is dropped with one warning and the
    # call returns eager's results, drawn from the random state the failed
    # run started in (the failed run had drawn before it raised), as
    # compile="eager" draws them from the same seed.
    original = graph_mode.trace

    def failing_trace(fn, inputs, grad_enabled, *referenced):
        drawn_then_failing = lambda a: (torch.linalg.cholesky(a + torch.rand_like(a)).sum(),)  # noqa: E731
        return original(drawn_then_failing, inputs, grad_enabled, *referenced)

    def noisy_sum(a):
        return (a + torch.rand_like(a)).sum()

    bad = -jnp.eye(3) * 4.0
    expected = {}
    for mode in ("eager", "graph"):
        if mode == "graph":
            monkeypatch.setattr(graph_mode, "trace", failing_trace)
        jaxified = t2j_ad.jaxify(noisy_sum, compile=mode)
        f = jax.jit(jaxified)
        torch.manual_seed(1234)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            values = [np.asarray(f(bad * scale)) for scale in (1.0, 2.0)]
        expected[mode] = (values, to_numpy(torch.rand(2, device=TORCH_DEVICE)))
    np.testing.assert_array_equal(expected["graph"][0], expected["eager"][0])
    np.testing.assert_array_equal(expected["graph"][1], expected["eager"][1])  # the generator left alike
    (message,) = _fallbacks(record)
    assert "dropped the traced graph" in message and "its first run failed" in message
    assert _NOT_POSITIVE_DEFINITE in message
    stats = jaxified.compile_stats()
    assert stats["graphs"] == 0 and stats["eager_fallbacks"] == 1


class _NormedThenCholesky(torch.nn.Module):
    """Batch norm in training mode (running statistics written without the
    version counter seeing it, the batch count by ``add_``), dropout, then
    a Cholesky factor that fails where ``a`` is not positive definite."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.lin(x))).sum() + torch.linalg.cholesky(a).sum()


_ROWS = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32)


def _after_calls(mode: str, a: jax.Array) -> tuple[list[Any], dict[str, np.ndarray], np.ndarray]:
    """Each of two jitted calls' result (or error type) of a fresh
    ``_NormedThenCholesky`` in compile ``mode`` on ``a``, its buffers after
    them, and the generator's next draws."""
    module = _NormedThenCholesky().to(TORCH_DEVICE)
    apply, params = t2j_ad.jaxify_module(module, compile=mode)
    step = jax.jit(apply)
    torch.manual_seed(1234)
    got: list[Any] = []
    for scale in (1.0, 2.0):
        try:
            got.append(np.asarray(step(params, _ROWS * scale, a)))
        except Exception as err:  # noqa: BLE001 - compared with eager's
            got.append(type(err))
    buffers = {name: to_numpy(b) for name, b in module.named_buffers()}
    return got, buffers, to_numpy(torch.rand(4, device=TORCH_DEVICE))


def _same_as_eager(graph: tuple[Any, ...], eager: tuple[Any, ...]) -> None:
    for got, expected in zip(graph[0], eager[0]):
        if isinstance(expected, type):
            assert got is expected
        else:
            np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert_tree_allclose(graph[1], eager[1], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(graph[2], eager[2])  # the generator left alike


def test_a_first_run_that_fails_as_eager_does_leaves_kept_state_as_eager_does():
    # NOTE [a first run that fails on its inputs]: the graph's first run
    # updated batch norm's running statistics and its batch count, then
    # raised at the Cholesky factor; the eager run that tells whose error
    # it is updated them again (two batches counted for each failing call,
    # where compile="eager" counts one).
    bad = -jnp.eye(3)
    eager = _after_calls("eager", bad)
    assert eager[0][0] is eager[0][1] and issubclass(eager[0][0], Exception)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        graph = _after_calls("graph", bad)
    _same_as_eager(graph, eager)
    assert _fallbacks(record) == []  # the inputs' error: the graph is kept


def test_a_first_run_that_fails_where_eager_works_leaves_kept_state_as_eager_does(monkeypatch):
    # The graph is dropped and the call returns eager's results, but what
    # its failed first run wrote into batch norm's running statistics and
    # batch count stayed, and the eager run wrote them again.
    good = jnp.eye(3) * 2.0
    eager = _after_calls("eager", good)
    original = graph_mode.trace

    def failing_trace(fn, inputs, grad_enabled, *referenced):
        def written_then_failing(*args):
            results = fn(*args)  # the module's forward: its writes, then a failure the function has not
            torch.linalg.cholesky(-torch.eye(3, device=args[0].device))
            return results

        return original(written_then_failing, inputs, grad_enabled, *referenced)

    monkeypatch.setattr(graph_mode, "trace", failing_trace)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        graph = _after_calls("graph", good)
    _same_as_eager(graph, eager)
    (message,) = _fallbacks(record)
    assert "dropped the traced graph" in message and "its first run failed" in message


def test_a_graph_checked_after_a_layout_leaves_batch_norm_statistics_as_eager_does(monkeypatch):
    # NOTE [checking a trace against eager]: a first run that wrote state
    # is compared with eager and with a second graph run, each from the
    # state it left, which is put back after each. Batch norm's kernels
    # write the running statistics without moving their version counters,
    # so they were not put back: three updates of the running mean for
    # one call (the batch count, written by add_, was right).
    good = jnp.eye(3) * 2.0
    eager = _after_calls("eager", good)
    _diverge_always(monkeypatch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        graph = _after_calls("graph", good)
    _same_as_eager(graph, eager)
    assert _fallbacks(record) == []  # the graph agrees with eager: kept
