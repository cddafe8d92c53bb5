"""Whether a graph traced on fake tensors computes what the eager call does.

NOTE [checking a trace against eager]
A trace runs on fake tensors, whose strides come from PyTorch's meta
functions. Where those differ from what the real kernels give, a formula
that branches on layout bakes the wrong branch into the graph. Seen with
torch 2.13 and 2.14.1: ``view`` of a permuted tensor with a size-1 dim, then
``clone`` of an ``expand`` of it, is non-contiguous on fake tensors and
contiguous on real ones; the jvp of ``linalg.det`` reads its LU factors as
those of A or of A^T by ``A.is_contiguous()``; so the graph of jacfwd of det
under a size-1 vmap over a middle axis (vmap_method="broadcast_all")
returned the transposed derivative.

Every layout decision a trace makes reads the fake strides of some node of
the graph, so if every node's real result is laid out as its fake one was,
the eager call would have decided the same way. A graph's first run, the
first call's own, therefore goes through an interpreter that compares each
node's real strides with the fake ones it was traced with (dims of size 0 or
1 aside: their strides mean nothing). Only where one differs is the graph
checked against an eager run of the function (its Python runs a second time
for such graphs alone), from the random state the first run started in. A
graph that agrees keeps the first run's results and state; one that
disagrees is dropped, the call returns the eager results, and the function
runs eagerly from then on, announced by the usual FallbackWarning. Where the
first run has written to tensors the function closes over (a module's
running statistics: their version counters moved, or their values, for
the tensors the graph writes into, as batch norm's kernels do without
moving the counters), that state cannot be set
back: eager and a second graph run are then compared from the state the
first run left, which is put back after each, and a graph that disagrees
fails that one call (``FirstRunNotUndone``) rather than hand back results
it cannot vouch for. Graph and eager run the same aten kernels, so they
agree to rounding: the tolerance, half the dtype's digits relative to the
output's largest entry, leaves room only for kernels that are not
deterministic (atomic adds on a GPU), and none for a layout mix-up. A
first run that raises is followed by the eager call on the same inputs,
which tells an error of the inputs' values from one of the trace (NOTE [a
first run that fails on its inputs] in graph_mode.py).

NOTE [checking inductor against the trace]
Inductor compiles the checked graph into kernels of its own, which can be
wrong where the graph is right: torch 2.13 on the CPU ran a fused kernel
reading dropout's mask before the ``bernoulli_`` that fills it, after
``layer_norm`` and ``gelu`` (NaN from the second call on: the first call
returns the graph's results), and inductor's ``avg_pool2d(ceil_mode=True)``
backward is wrong (pytorch/pytorch#198119). So in ``compile="inductor"`` the
compiled function runs once more at the first call, and its results are
compared with a second run of the graph, both from the random state and the
written tensors the first run left, put back after each (the tolerance as
above, which leaves room for inductor's reordered float arithmetic). Where
they disagree the function runs the traced graph instead, as
``compile="graph"`` would, and a FallbackWarning names the output.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

Flat = Callable[..., tuple[torch.Tensor, ...]]


def _layout(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
    """Shape, and the strides that mean something (None for dims of size 0 or 1)."""
    return tuple(t.shape), tuple(s if n > 1 else None for n, s in zip(t.shape, t.stride()))


class _LayoutChecker(torch.fx.Interpreter):
    """Runs a traced graph, noting the first node whose real result is laid
    out other than its fake one was at trace time."""

    def __init__(self, graph: torch.fx.GraphModule):
        super().__init__(graph)
        self.diverged: str | None = None

    def run_node(self, node: torch.fx.Node) -> Any:
        result = super().run_node(node)
        traced = node.meta.get("val")
        if (
            self.diverged is None
            and isinstance(traced, torch.Tensor)
            and isinstance(result, torch.Tensor)
            and result.layout == traced.layout == torch.strided
            and _layout(traced) != _layout(result)
        ):
            self.diverged = (
                f"{node.name} has shape {tuple(result.shape)} and strides {result.stride()}, "
                f"traced as {tuple(traced.shape)} and {traced.stride()}"
            )
        return result


def _as_tuple(results: Any) -> tuple[Any, ...]:
    return tuple(results) if isinstance(results, (tuple, list)) else (results,)


def _mismatch(expected: torch.Tensor, actual: torch.Tensor, reference: str = "eager") -> str | None:
    """How ``actual`` differs from ``expected`` (``reference``'s) beyond rounding; None if it does not."""
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return f"{tuple(actual.shape)} {actual.dtype} where {reference} gives {tuple(expected.shape)} {expected.dtype}"
    if not (expected.is_floating_point() or expected.is_complex()):
        return None if torch.equal(expected, actual) else "different values"
    tolerance = torch.finfo(expected.dtype).eps ** 0.5
    wide = torch.complex128 if expected.is_complex() else torch.float64
    e, a = expected.detach().to(wide), actual.detach().to(wide)
    finite = torch.isfinite(e) & torch.isfinite(a)
    if not bool(finite.all()):
        special = ~finite
        if not torch.equal(torch.isnan(e), torch.isnan(a)) or not torch.equal(
            torch.nan_to_num(e[special]), torch.nan_to_num(a[special])
        ):
            return f"NaN or infinite entries where {reference} has others"
        e, a = e[finite], a[finite]
    if e.numel() == 0:
        return None
    difference = float((e - a).abs().max())
    scale = max(float(e.abs().max()), float(a.abs().max()))
    if difference <= tolerance * scale:
        return None
    return f"entries off by up to {difference:.3g}, largest entry {scale:.3g}"


def graph_constants(graph: torch.fx.GraphModule) -> list[torch.Tensor]:
    """The tensors ``graph`` holds by reference (what the function closes over)."""
    found: dict[int, torch.Tensor] = {}
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(graph)
            if isinstance(value, torch.Tensor):
                found[id(value)] = value
    return list(found.values())


class WrittenConstants:
    """The tensors a graph holds by reference (``graph_constants``), with
    their versions when made; ``since()``: those written in place since."""

    def __init__(self, graph: torch.fx.GraphModule) -> None:
        self._constants = graph_constants(graph)
        self._versions = [t._version for t in self._constants]

    def since(self) -> list[torch.Tensor]:
        return [t for t, version in zip(self._constants, self._versions) if t._version != version]


class FirstRunNotUndone(RuntimeError):
    """A graph disagreed with eager after its first run had written to tensors
    the function updates in place: that call cannot be given eager's results.
    ``reason`` says how it disagreed."""

    def __init__(self, reason: str, written: int):
        self.reason = reason
        super().__init__(
            f"on its first call the traced graph {reason}, and that call had already "
            f"updated {written} tensor(s) the function writes in place (such as a module's buffers), "
            f"which cannot be undone; so the call fails. Later calls run eagerly. Pass compile='eager' "
            f"for this function to avoid this."
        )


class FirstRunFailed(Exception):
    """A graph's first run raised ``error``. The eager call on the same
    inputs, from the random state that run started in, then returned
    ``results``, or raised ``eager_error`` as well: an error of the inputs'
    values, not of the trace (NOTE [a first run that fails on its inputs]
    in graph_mode.py)."""

    def __init__(self, error: Exception, results: Any = None, eager_error: Exception | None = None):
        super().__init__(str(error))
        self.error = error
        self.results = results
        self.eager_error = eager_error


class _State:
    """The random generators of the CPU (unless ``generators`` is False) and
    of ``devices``, and ``tensors``' values, as they are now: ``restore()``
    sets them back."""

    def __init__(self, devices: Sequence[int], tensors: Sequence[torch.Tensor] = (), generators: bool = True):
        self.devices = devices
        self.tensors = tensors
        self.cpu = torch.get_rng_state() if generators else None
        self.cuda = [torch.cuda.get_rng_state(d) for d in devices]
        self.values = [t.detach().clone() for t in tensors]

    def changed(self, exclude: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """Those of ``tensors`` whose values changed since, but those in
        ``exclude``: batch norm's kernels write its running statistics
        without moving their version counters, which ``WrittenConstants``
        reads."""
        excluded = {id(t) for t in exclude}
        return [
            tensor
            for tensor, value in zip(self.tensors, self.values)
            if id(tensor) not in excluded and not torch.equal(tensor, value)
        ]

    def restore(self) -> None:
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        for device, state in zip(self.devices, self.cuda):
            torch.cuda.set_rng_state(state, device)
        with torch.no_grad():
            for tensor, value in zip(self.tensors, self.values):
                tensor.copy_(value)


def checked_first_run(
    impl: Flat,
    graph: torch.fx.GraphModule,
    inputs: Sequence[torch.Tensor],
    grad_enabled: bool,
    kept: Sequence[torch.Tensor] = (),
) -> tuple[Any, str | None]:
    """The first call of ``graph``, traced from ``impl`` (the eager callable,
    run with grad mode ``grad_enabled``), on ``inputs``: its results, and why
    the graph must be dropped (the results are then ``impl``'s), or None
    (NOTE [checking a trace against eager]). Raises ``FirstRunNotUndone``
    when the graph is wrong but its first run has already updated state,
    and ``FirstRunFailed`` when the first run raises, after putting back
    what it wrote into ``kept`` (the tensors the graph holds and writes
    into: NOTE [a first run that fails on its inputs] in graph_mode.py),
    whose values also show the writes no version counter saw."""
    devices = sorted({t.device.index or 0 for t in inputs if t.is_cuda})
    constants = WrittenConstants(graph)
    before = _State(devices)
    kept_before = _State((), kept, generators=False)
    try:
        results, diverged = run_checking_layouts(graph, inputs)
    except Exception as error:  # noqa: BLE001 - eager's run on the inputs says whose error it is
        failed = error
    else:
        failed = None
    if failed is not None:
        kept_before.restore()  # the eager run starts from the state the failed run started from
        _run_eagerly_after(failed, impl, inputs, grad_enabled, before)
    if diverged is None:
        return results, None
    written = constants.since() + kept_before.changed(exclude=constants.since())

    def eager() -> Any:
        with torch.autograd.set_grad_enabled(grad_enabled):
            return impl(*[t.clone() for t in inputs])

    if not written:
        after = _State(devices)
        before.restore()  # the eager run draws the numbers the first run drew
        expected = eager()
        reason = _disagreement(_as_tuple(expected), _as_tuple(results))
        if reason is None:
            after.restore()
            return results, None
        return expected, f"on its first call it {reason}, after a layout the trace did not foresee ({diverged})"
    # The first run has updated state (a module's buffers) that cannot be set
    # back: compare eager and graph from the state it left, and keep that state.
    left = _State(devices, written)
    expected = eager()
    left.restore()
    with torch.no_grad():
        again = graph.forward(*[t.clone() for t in inputs])
    left.restore()
    reason = _disagreement(_as_tuple(expected), _as_tuple(again))
    if reason is None:
        return results, None
    raise FirstRunNotUndone(f"{reason}, after a layout the trace did not foresee ({diverged})", len(written))


def _run_eagerly_after(
    failed: Exception, impl: Flat, inputs: Sequence[torch.Tensor], grad_enabled: bool, before: _State
) -> NoReturn:
    """Raise ``FirstRunFailed`` for a graph's first run that raised
    ``failed``, with what the eager call makes of the same ``inputs``, from
    the random state ``before`` that run started in: the call's results, as
    the runner would have run eagerly, or its own error. Run outside the
    ``except`` of ``failed``, so eager's error does not carry the graph's as
    its context."""
    before.restore()
    try:
        with torch.autograd.set_grad_enabled(grad_enabled):
            results = impl(*inputs)
    except Exception as eager_error:  # noqa: BLE001 - the call's own error, raised by the caller
        raise FirstRunFailed(failed, eager_error=eager_error) from None
    raise FirstRunFailed(failed, results=results) from None


def compiled_disagreement(
    graph: torch.fx.GraphModule, compiled: Flat, inputs: Sequence[torch.Tensor], written: Sequence[torch.Tensor]
) -> str | None:
    """How ``compiled`` (inductor's kernels for ``graph``) differs from
    ``graph`` on ``inputs``, each run from the random state and the values
    of ``written`` (the tensors the first run wrote) the first run left,
    which are put back after each; None where they agree (NOTE [checking
    inductor against the trace])."""
    devices = sorted({t.device.index or 0 for t in inputs if t.is_cuda})
    left = _State(devices, written)
    with torch.no_grad():
        expected = graph.forward(*[t.clone() for t in inputs])
    left.restore()
    try:
        with torch.no_grad():
            actual = compiled(*[t.clone() for t in inputs])
    finally:
        left.restore()
    return _disagreement(_as_tuple(expected), _as_tuple(actual), "the traced graph")


def run_checking_layouts(graph: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> tuple[Any, str | None]:
    """``graph``'s results on ``inputs``, and its first node whose real result
    is laid out other than at trace time (None if none is)."""
    checker = _LayoutChecker(graph)
    with torch.no_grad():
        results = checker.run(*inputs)
    return (tuple(results) if isinstance(results, list) else results), checker.diverged


def _disagreement(expected: tuple[Any, ...], actual: tuple[Any, ...], reference: str = "eager") -> str | None:
    """How ``actual`` differs from ``expected``, the results of ``reference``
    ("eager": the eager call; or "the traced graph"); None where they agree."""
    call = "the eager call" if reference == "eager" else reference
    if len(actual) != len(expected):
        return f"returned {len(actual)} outputs where {call} returns {len(expected)}"
    for i, (e, a) in enumerate(zip(expected, actual)):
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
            mismatch = _mismatch(e, a, reference)
            if mismatch is not None:
                return f"disagreed with {call} on output {i} ({mismatch})"
    return None
