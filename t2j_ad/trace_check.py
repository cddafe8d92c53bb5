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
the eager call would have decided the same way. The first run of each graph
therefore goes through an interpreter that compares each node's real strides
with the fake ones it was traced with (dims of size 0 or 1 aside: their
strides mean nothing). Only where they differ is the graph checked against
an eager run on copies of the same inputs, so the user's Python runs once
more only for such graphs; both runs start from the same random state (they
draw the same numbers, and the caller's generator is left where it was). A
graph that disagrees is dropped and the function runs eagerly, announced by
the usual FallbackWarning. Graph and eager run the same aten kernels, so they
agree to rounding: the tolerance, half the dtype's digits relative to the
output's largest entry, leaves room only for kernels that are not
deterministic (atomic adds on a GPU), and none for a layout mix-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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
            and result.layout == torch.strided
            and _layout(traced) != _layout(result)
        ):
            self.diverged = (
                f"{node.name} has shape {tuple(result.shape)} and strides {result.stride()}, "
                f"traced as {tuple(traced.shape)} and {traced.stride()}"
            )
        return result


def layout_divergence(graph: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> str | None:
    """The first node of ``graph`` whose real result on ``inputs`` is laid out
    other than at trace time; None if none is."""
    checker = _LayoutChecker(graph)
    with torch.no_grad():
        checker.run(*inputs)
    return checker.diverged


def _as_tuple(results: Any) -> tuple[Any, ...]:
    return tuple(results) if isinstance(results, (tuple, list)) else (results,)


def _mismatch(expected: torch.Tensor, actual: torch.Tensor) -> str | None:
    """How ``actual`` differs from ``expected`` beyond rounding; None if it does not."""
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return f"{tuple(actual.shape)} {actual.dtype} where eager gives {tuple(expected.shape)} {expected.dtype}"
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
            return "NaN or infinite entries where eager has others"
        e, a = e[finite], a[finite]
    if e.numel() == 0:
        return None
    difference = float((e - a).abs().max())
    scale = max(float(e.abs().max()), float(a.abs().max()))
    if difference <= tolerance * scale:
        return None
    return f"entries off by up to {difference:.3g}, largest entry {scale:.3g}"


def disagreement(
    impl: Flat, graph: torch.fx.GraphModule, inputs: Sequence[torch.Tensor], grad_enabled: bool
) -> str | None:
    """Why ``graph``, traced from ``impl`` (the eager callable, run with grad
    mode ``grad_enabled``), does not compute what ``impl`` computes on
    ``inputs``; None when it does (NOTE [checking a trace against eager])."""
    devices = sorted({t.device.index or 0 for t in inputs if t.is_cuda})
    with torch.random.fork_rng(devices=devices):
        diverged = layout_divergence(graph, [t.clone() for t in inputs])
    if diverged is None:
        return None
    with torch.random.fork_rng(devices=devices), torch.autograd.set_grad_enabled(grad_enabled):
        expected = _as_tuple(impl(*[t.clone() for t in inputs]))
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        actual = _as_tuple(graph(*[t.clone() for t in inputs]))
    if len(actual) != len(expected):
        return f"the traced graph returned {len(actual)} outputs where the eager call returns {len(expected)}"
    for i, (e, a) in enumerate(zip(expected, actual)):
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
            mismatch = _mismatch(e, a)
            if mismatch is not None:
                return (
                    f"on its first call it disagreed with the eager call on output {i} ({mismatch}), "
                    f"after a layout the trace did not foresee ({diverged})"
                )
    return None
