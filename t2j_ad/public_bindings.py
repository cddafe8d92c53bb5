"""A traced aten graph's op calls moved to PyTorch's public bindings.

NOTE [graph ops through the public bindings]
``make_fx`` records each op as an ``OpOverload`` (``torch.ops.aten.mm.default``),
and the graph calls it so. Such a call parses its arguments against the
op's schema in a generic, boxed path: about 3.5 us an op on a CPU, against
about 2 us for the same op through PyTorch's generated public binding
(``torch.mm``, ``Tensor.view``), which parses them in code generated for
that op. A graph of small ops paid that difference on every op, which made
a plain graph-mode call 1.2 - 1.6x slower than the eager call it replays
(the sixth fuzzing pass in BENCHMARKS.md).

So once a graph is traced, each aten op call moves to a public binding of
the same name (``torch``'s functions, ``torch._C._nn``, ``_linalg``,
``_special``, ``_fft``, or a ``Tensor`` method on its first argument) where
that binding provably reaches the same op: it is called on the node's fake
values (what ``make_fx`` recorded for each argument) under a dispatch mode
that records what reaches the dispatcher, and the node moves only if that
is exactly this overload, once, with the node's very arguments (tensors by
identity, the rest by type and value). A binding that resolves to another
overload (``add.Scalar`` for ``add.Tensor``), fills or changes an argument
(a default dtype), runs Python of its own (``Tensor.split``) or calls
several ops keeps the ``OpOverload``. Metadata queries the dispatcher makes
around view ops (``prim.device``) are not ops. Both calls then enter the
dispatcher at the top for the same op and arguments, so the graph computes
what it did; its first run was already checked against eager (NOTE
[checking a trace against eager]) before it is rebound.

Only graph mode's replay is rebound: inductor compiles the aten graph
itself, and a CUDA graph captures kernels, not calls. A graph holding a
tensor constant of a subclass keeps its ``OpOverload``s, as subclasses
may route the two calls differently (``__torch_function__``).

NOTE [a binding's answer, kept]
Checking a node costs a fake call of each candidate binding, about as much
as the node's own trace: 14% of a graph-mode first call in the property
suite. What a generated binding reaches depends on its arguments' kinds,
not their sizes: it picks an overload by the Python types it parses (a
tensor, a scalar, an int list, None), fills defaults for what is absent,
and hands the dispatcher the objects it was given. So each answer is kept
under the op, the binding, and the arguments reduced to what a binding
could tell apart: each tensor to its type, dtype, layout, device type,
dimensions and which other argument it is; each int and float to its type
(sizes, dims and factors, which a binding passes on as given, differ
between signatures); every other value to its type and value. Arguments
that cannot be keyed (unhashable values) are checked every time. The
table is process-wide, dropped whole past a few thousand answers.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # private: NOTE [what a trace leaves behind]
from torch.utils._python_dispatch import TorchDispatchMode

from .fx_sources import recompile

_NAMESPACES = (
    torch._C._VariableFunctions,
    torch._C._nn,
    torch._C._linalg,
    torch._C._special,
    torch._C._fft,
)
_PLAIN_CONSTANTS = (torch.Tensor, torch.nn.Parameter)
_MISSING = object()  # an argument whose node recorded no value


class _Reaching(TorchDispatchMode):
    """Records the ops a call makes, as they reach the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace != "prim":  # prim.device and kin: metadata queries, not ops
            self.ops.append((func, tuple(args), dict(kwargs)))
        return func(*args, **kwargs)


def _recorded(arg: Any) -> Any:
    """``arg`` with each node replaced by the value make_fx recorded for it."""
    if isinstance(arg, torch.fx.Node):
        return arg.meta.get("val", _MISSING)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_recorded(a) for a in arg)
    return arg


def _lacks_values(arg: Any) -> bool:
    if arg is _MISSING:
        return True
    if isinstance(arg, (list, tuple)):
        return any(_lacks_values(a) for a in arg)
    return False


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _bindings(op: torch._ops.OpOverload) -> Iterator[tuple[str, Any]]:
    """("call_function", builtin) and ("call_method", name) candidates."""
    name = op._schema.name.split("::", 1)[1]
    for namespace in _NAMESPACES:
        function = getattr(namespace, name, None)
        if type(function) is types.BuiltinFunctionType:
            yield "call_function", function
    if type(getattr(torch._C.TensorBase, name, None)).__name__ == "method_descriptor":
        yield "call_method", name


_ANSWERS: dict[Any, bool] = {}
_MOST_ANSWERS = 4096


def _kind_of(arg: Any, tensors: list[torch.Tensor]) -> Any:
    """``arg`` as a binding could tell it apart: NOTE [a binding's answer, kept]."""
    if isinstance(arg, torch.Tensor):
        for i, seen in enumerate(tensors):
            if seen is arg:
                return ("same tensor as", i)
        tensors.append(arg)
        return (type(arg), arg.dtype, arg.layout, arg.device.type, arg.dim(), arg.requires_grad)
    if isinstance(arg, (list, tuple)):
        return (type(arg), tuple(_kind_of(a, tensors) for a in arg))
    if type(arg) in (int, float):
        return type(arg)
    return (type(arg), arg)


def _argument_kinds(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A node's arguments as a binding could tell them apart (``_kind_of``),
    once for all its candidate bindings; None where they cannot be keyed."""
    tensors: list[torch.Tensor] = []
    kinds = (_kind_of(args, tensors), tuple((k, _kind_of(v, tensors)) for k, v in kwargs.items()))
    try:
        hash(kinds)
    except TypeError:
        return None
    return kinds


def _answer_key(kind: str, binding: Any, op: Any, kinds: Any) -> Any:
    """The key of a check's answer, or None where the arguments' ``kinds`` are None."""
    return None if kinds is None else (op, kind, binding, kinds)


def _reaches(
    fake_mode: FakeTensorMode,
    kind: str,
    binding: Any,
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    kinds: Any,
) -> bool:
    """Whether ``binding`` reaches ``op`` with these very arguments, whose
    ``_argument_kinds`` are ``kinds``; kept (NOTE [a binding's answer, kept])."""
    key = _answer_key(kind, binding, op, kinds)
    answer = _ANSWERS.get(key) if key is not None else None
    if answer is None:
        answer = _checked_reaches(fake_mode, kind, binding, op, args, kwargs)
        if key is not None:
            if len(_ANSWERS) >= _MOST_ANSWERS:
                _ANSWERS.clear()
            _ANSWERS[key] = answer
    return answer


def _checked_reaches(
    fake_mode: FakeTensorMode, kind: str, binding: Any, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    reaching = _Reaching()
    try:
        # Inside the trace's fake mode: a factory binding (torch.randn) makes
        # a fake tensor there, drawing nothing and allocating nothing.
        with fake_mode, reaching:
            if kind == "call_function":
                binding(*args, **kwargs)
            else:
                getattr(args[0], binding)(*args[1:], **kwargs)
    except Exception:  # noqa: BLE001 - this binding does not take these arguments
        return False
    if len(reaching.ops) != 1:
        return False
    reached, reached_args, reached_kwargs = reaching.ops[0]
    return (
        reached is op
        and _same(reached_args, args)
        and reached_kwargs.keys() == kwargs.keys()
        and all(_same(reached_kwargs[k], kwargs[k]) for k in kwargs)
    )


def _plain_constants(graph: torch.fx.GraphModule) -> bool:
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            value = getattr(graph, node.target, None)
            if isinstance(value, torch.Tensor) and type(value) not in _PLAIN_CONSTANTS:
                return False
    return True


def _fake_mode_of(graph: torch.fx.GraphModule) -> FakeTensorMode:
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, FakeTensor):
            return value.fake_mode
    return FakeTensorMode()


def through_public_bindings(graph: torch.fx.GraphModule) -> int:
    """Move ``graph``'s aten op calls to public bindings that reach the same
    op with the same arguments, and recompile it (NOTE [graph ops through
    the public bindings]). How many calls moved. The calls it checks run on
    fake tensors: the caller takes back what they leave in the fake tensors'
    dispatch cache (NOTE [what a trace leaves behind])."""
    if not _plain_constants(graph):
        return 0
    fake_mode = _fake_mode_of(graph)
    moved = 0
    for node in graph.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
            continue
        args, kwargs = _recorded(tuple(node.args)), {k: _recorded(v) for k, v in node.kwargs.items()}
        if _lacks_values(args) or _lacks_values(tuple(kwargs.values())):
            continue
        kinds = _argument_kinds(args, kwargs)
        for kind, binding in _bindings(op):
            if _reaches(fake_mode, kind, binding, op, args, kwargs, kinds):
                node.op, node.target = kind, binding
                moved += 1
                break
    if moved:
        recompile(graph)
    return moved
