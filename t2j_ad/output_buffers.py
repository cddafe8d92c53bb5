"""Graphs that write their results into XLA's output buffers.

NOTE [results written into XLA's buffers]
A compiled graph returns fresh tensors, which the runner then copies into
the output buffers XLA gave the call: one more pass over every output, where
XLA writes its own results in place. For per-example gradients (a 2 MB
weight gradient) the copies took 160 of a 445 us call, more than the
compiled kernels themselves (125 us). So on the CPU a graph takes one more
argument per output, a buffer laid out as XLA's (row-major; the C++ handler
hands DLPack no strides), and ends by copying each result into its buffer
(``writing_into_outputs``). Inductor then stores a result straight into it
(an extern bmm gets it as out=, a fused kernel writes there): the call took
145 us. A replayed aten graph would only move the copy, so there the op
that allocates a result is rewritten to its out= overload, writing into
the buffer, where the result is that op's value or a view of it laid out
alike and the op is one whose out= kernel leaves a right-sized out as it is
(``REWRITTEN_OPS``; XLA's buffers cannot be resized, which mse_loss.out
tried); the other results are copied (``computing_outputs_in_place``). The
runner uses such a graph once a call has shown that the function leaves
its inputs alone, after checking once that XLA's buffers are laid out as
expected; it copies results otherwise. Results cast on copy (64-bit into
32-bit buffers) keep the copy. On CUDA a CUDA graph replays into its own
static outputs (NOTE [CUDA graph replay]) and keeps returning results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .fx_sources import forget_with, recompile

OutSpecs = Sequence[tuple[torch.Size, torch.dtype]]  # each output buffer's shape and dtype


def row_major_strides(out_specs: OutSpecs) -> tuple[tuple[int, ...], ...]:
    """The strides of XLA's output buffers of ``out_specs``, row-major."""
    return tuple(torch.empty(shape, dtype=dtype, device="meta").stride() for shape, dtype in out_specs)


_INTO_BUFFER = "t2j_ad_into_buffer"  # meta key of the copies writing_into_outputs appends


def writing_into_outputs(graph: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """``graph`` taking one more argument per output, a buffer, into which it
    copies that result (cast to the buffer's dtype), returning nothing; its
    constants are ``graph``'s own objects. None if an output is not a tensor
    the graph computes or takes."""
    body = torch.fx.Graph()
    results = body.graph_copy(graph.graph, {})
    if not isinstance(results, (tuple, list)) or not all(isinstance(r, torch.fx.Node) for r in results):
        return None
    last = [node for node in body.nodes if node.op == "placeholder"][-1:]
    buffers = []
    for i in range(len(results)):
        with body.inserting_after(buffers[-1] if buffers else (last[0] if last else None)):
            buffers.append(body.placeholder(f"out_{i}"))
    for buffer, result in zip(buffers, results):
        body.call_function(torch.ops.aten.copy_.default, (buffer, result)).meta[_INTO_BUFFER] = True
    body.output(())
    into = torch.fx.GraphModule(graph, body)  # get_attr constants: graph's objects, not copies
    forget_with(into)
    return into


def computing_outputs_in_place(into: torch.fx.GraphModule) -> int:
    """Rewrite ``into`` (from ``writing_into_outputs``) so that the op that
    allocates a result writes it into its buffer (its ``out=`` overload),
    where the result is that op's value, or a view of it, laid out alike; the
    copy into that buffer goes. How many results it rewrote."""
    graph = into.graph
    claimed: set[torch.fx.Node] = set()
    rewritten = 0
    for copy in [node for node in graph.nodes if node.meta.get(_INTO_BUFFER)]:
        buffer, result = copy.args
        source = result
        while (up := _aliased_argument(source)) is not None:
            source = up
        out_op = _out_overload(source)
        if source in claimed or out_op is None or not _same_layout(source, result):
            continue
        out_name = next(a.name for a in out_op._schema.arguments if a.is_out)
        with graph.inserting_before(source):
            target = graph.call_function(torch.ops.aten.view.default, (buffer, list(source.meta["val"].shape)))
            written = graph.call_function(out_op, source.args, {**source.kwargs, out_name: target})
        written.meta = dict(source.meta)
        source.replace_all_uses_with(written)
        graph.erase_node(source)
        graph.erase_node(copy)
        claimed.add(written)
        rewritten += 1
    if rewritten:
        graph.lint()
        recompile(into)
    return rewritten


def _aliased_argument(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose memory ``node``'s result is (a view, an in-place op),
    if any."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not node.args:
        return None
    returns, arguments = target._schema.returns, target._schema.arguments
    aliases = target is torch.ops.aten._unsafe_view.default or (
        len(returns) == 1
        and returns[0].alias_info is not None
        and arguments[0].alias_info is not None
        and returns[0].alias_info.before_set == arguments[0].alias_info.before_set
    )
    first = node.args[0]
    return first if aliases and isinstance(first, torch.fx.Node) else None


_aten = torch.ops.aten
# Ops whose out= overload is a structured kernel: given an out of the right
# size and dtype, it neither resizes nor restrides it (PyTorch's resize_out
# restrides "only if a resize occurred"). A hand-written out= kernel may
# resize its out along the way (mse_loss.out computes the elementwise loss
# in it first), which XLA's fixed-size buffers refuse, and may restride it.
# tests/test_graph_mode.py writes each into a fixed-size buffer.
REWRITTEN_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.bmm.default,
        _aten.addmm.default,
        _aten.baddbmm.default,
        _aten.add.Tensor,
        _aten.sub.Tensor,
        _aten.mul.Tensor,
        _aten.div.Tensor,
        _aten.pow.Tensor_Scalar,
        _aten.neg.default,
        _aten.exp.default,
        _aten.log.default,
        _aten.tanh.default,
        _aten.sigmoid.default,
        _aten.gelu.default,
        _aten.silu.default,
        _aten.tanh_backward.default,
        _aten.sigmoid_backward.default,
        _aten.threshold_backward.default,
        _aten.gelu_backward.default,
        _aten.silu_backward.default,
        _aten.sum.dim_IntList,
        _aten.mean.dim,
        _aten._softmax.default,
        _aten._log_softmax.default,
        _aten._softmax_backward_data.default,
        _aten._log_softmax_backward_data.default,
    }
)


def out_overload(op: Any) -> Any:
    """The ``out=`` overload of ``op`` (an overload in ``REWRITTEN_OPS``)
    taking the same arguments, if it has one."""
    schema = op._schema
    arguments = [(a.name, str(a.type)) for a in schema.arguments]
    packet = op.overloadpacket
    for name in packet.overloads():
        overload = getattr(packet, name)
        outs = [a for a in overload._schema.arguments if a.is_out]
        rest = [(a.name, str(a.type)) for a in overload._schema.arguments if not a.is_out]
        if len(outs) == 1 and rest == arguments and len(overload._schema.returns) == 1:
            return overload
    return None


def _out_overload(node: torch.fx.Node) -> Any:
    """The ``out=`` overload of ``node``'s op, if it is one to rewrite."""
    if node.op != "call_function" or node.target not in REWRITTEN_OPS:
        return None
    return out_overload(node.target)


def _same_layout(source: torch.fx.Node, result: torch.fx.Node) -> bool:
    """Whether ``result``, laid out row-major in its buffer, is ``source``'s
    value written into that buffer: the same memory (the trace's fake
    tensors say), entries in the same order, read the same way (one dtype,
    no lazy conjugation or negation)."""
    a, b = source.meta.get("val"), result.meta.get("val")
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())
        and a.dtype == b.dtype
        and a.numel() == b.numel()
        and a.is_contiguous()
        and b.is_contiguous()
        and a.storage_offset() == b.storage_offset() == 0
        and not (a.is_conj() or b.is_conj() or a.is_neg() or b.is_neg())
    )


def writes_into(graph: torch.fx.GraphModule, inputs: Sequence[torch.Tensor], out_specs: OutSpecs) -> bool:
    """Whether ``graph`` may write into buffers of ``out_specs``: on the CPU,
    when it returns exactly those shapes and dtypes (a call whose results
    differ, or are cast on copy, keeps the runner's checks and copies)."""
    if not inputs or inputs[0].device.type != "cpu":
        return False
    (results,) = [node.args[0] for node in graph.graph.nodes if node.op == "output"]
    if not isinstance(results, (tuple, list)) or len(results) != len(out_specs):
        return False
    traced = [r.meta.get("val") if isinstance(r, torch.fx.Node) else None for r in results]
    return all(
        isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == dtype
        for t, (shape, dtype) in zip(traced, out_specs)
    )
