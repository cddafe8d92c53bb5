"""The zero tangents of a traced graph stay zeros where eager's do.

NOTE [zero tangents in a graph]
PyTorch's forward mode gives an input without a tangent an "efficient" zero
tensor (``aten._efficientzerotensor``), whose kernels short-circuit: a
product with one is zero whatever the other factor, as JAX's symbolic zeros
are. A trace cannot keep those (their kernels work out shapes on the meta
device, which fails under fake tensors), so ``graph_mode.trace`` makes plain
zeros instead, and a replay multiplied them out: ``0 * inf`` is NaN, so
``jax.jvp`` of ``x * w`` in graph mode gave NaN where ``x`` was infinite, and
one NaN entry of ``x`` made a whole ``jacfwd`` row NaN, where eager,
``torch.func`` and JAX give finite numbers. So the trace makes them with
``tangent_zeros``, an op of ours that marks them, and ``fold_tangent_zeros``
follows them through the ops that keep a zero zero (views, negation, sums,
copies) and replaces each product that takes one (``mul``, ``div`` of one,
``mm`` and its kin) by plain zeros, as eager's kernels do; then the marks
become ``aten.zeros``. A zero that meets any other op is taken as it is.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


@torch.library.custom_op("t2j_ad::tangent_zeros", mutates_args=())
def tangent_zeros(size: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that stand for a missing tangent (NOTE [zero tangents in a graph])."""
    return torch.zeros(size, dtype=dtype, device=device)


@tangent_zeros.register_fake
def _(size: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device=device)


_MARK = torch.ops.t2j_ad.tangent_zeros.default

# A zero first argument gives a zero result.
_KEEP_ZERO = frozenset(
    {
        aten.neg.default,
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.expand.default,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.unsqueeze.default,
        aten.clone.default,
        aten.alias.default,
        aten.detach.default,
        aten._to_copy.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.diagonal.default,
        aten.sum.default,
        aten.sum.dim_IntList,
        aten.mean.dim,
        aten.flip.default,
        aten.repeat.default,
        aten.div.Tensor,
        aten.div.Scalar,
        aten.mul.Scalar,
    }
)
# Any zero tensor argument gives a zero result.
_PRODUCTS = frozenset(
    {aten.mul.Tensor, aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default, aten.matmul.default}
)
# Zero when every tensor argument is.
_SUMS = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.cat.default})


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    for a in (*node.args, *node.kwargs.values()):
        for item in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(item, torch.fx.Node):
                found.append(item)
    return found


def _is_zero(node: torch.fx.Node, zero: set[torch.fx.Node]) -> bool:
    target = node.target
    if target is _MARK:
        return True
    args = _tensor_args(node)
    if not args:
        return False
    if target in _KEEP_ZERO:
        return isinstance(node.args[0], torch.fx.Node) and node.args[0] in zero
    if target in _PRODUCTS:
        return any(a in zero for a in args)
    if target in _SUMS:
        return all(a in zero for a in args)
    return False


def fold_tangent_zeros(graph: torch.fx.GraphModule) -> None:
    """Replace each product of a marked zero by plain zeros, and the marks
    by ``aten.zeros`` (NOTE [zero tangents in a graph]); the caller then
    drops what no output needs and recompiles."""
    zero: set[torch.fx.Node] = set()
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or not _is_zero(node, zero):
            continue
        zero.add(node)
        val = node.meta.get("val")
        folds = node.target in _PRODUCTS or node.target in _SUMS or node.target is _MARK
        if not folds or not isinstance(val, torch.Tensor) or not val.is_contiguous():
            continue
        with graph.graph.inserting_before(node):
            zeros = graph.graph.call_function(
                aten.zeros.default, (list(val.shape),), {"dtype": val.dtype, "device": val.device}
            )
        zeros.meta.update(node.meta)
        node.replace_all_uses_with(zeros)
        zero.add(zeros)


def plain_tangent_zeros(
    size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None
) -> torch.Tensor:
    """``aten._efficientzerotensor`` in a trace: marked zeros."""
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    return tangent_zeros(list(size), dtype, device if device is not None else torch.device("cpu"))
