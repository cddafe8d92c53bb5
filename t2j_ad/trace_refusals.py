"""What a graph-mode trace refuses: values that would leave the graph.

NOTE [values a graph would keep]
A trace runs the function once, on fake tensors, and keeps the aten ops it
issued. Whatever the function's Python computes from a tensor's value is not
an op: the trace would keep the number it got that once, and every replay
would reuse it. Such a function must run eagerly. Two ways in:

- The value of an input. Fake tensors hold none, so ``.item()``, ``if
  x.sum() > 0`` or NumPy on an input already fail the trace; a read that
  slips through as a graph node (``aten._local_scalar_dense``) is refused by
  ``refuse_scalar_reads``.
- The value of a tensor the function closes over (a module's buffer, a
  global tensor). Those are real, and ``make_fx`` treats them as constants:
  it computes ops on them for real and hands Python the real number.
  ``x / float(count)`` with ``count`` bumped in place on every call came back
  as ``x / 1`` on every call, and ``BatchNorm1d(momentum=None)`` in training
  mode averaged by a batch count of 1. So the trace runs inside
  ``refusing_closed_over_reads``: a dispatch mode follows every tensor computed
  from a real one and refuses an aten op that reads such a tensor's value
  into Python (``item``, ``float()``, ``bool()``, ``torch.equal``) or whose
  output shape depends on its values (``nonzero``, boolean indexing,
  ``repeat_interleave``: the trace would keep that shape), and a
  torch-function mode refuses the reads that never reach the dispatcher
  (``.tolist()``, ``.numpy()``, ``numpy.asarray``) of a real tensor.

A function may catch the error such a read raises (``try: n = int(x.max())
except RuntimeError: n = 1``) and go on: the trace then keeps the branch
eager never takes, silently. So each refusal, and each read a fake tensor
cannot answer (``DataDependentOutputException``, ``DynamicOutputShapeException``),
is also noted, and a trace that noted one is refused when the function
returns, caught or not.

Ops on closed-over tensors that keep their values inside the graph are fine:
the graph holds the tensor by reference and sees in-place updates. Constants
the function makes itself (``torch.tensor(2.0)``) are the same on every call,
so reading them is fine too (``aten.lift_fresh`` starts nothing). A tensor
the function makes with ``torch.from_numpy`` is real as well, and reading it
back is refused alike: the price is an eager run, never a wrong result.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (  # private: fake or functorch-wrapped fake; what a fake cannot answer
    DataDependentOutputException,
    DynamicOutputShapeException,
    is_fake,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode  # private, as in real_writes.py

from .jax_in_traces import noting_jax_inside
from .random_state import SeedWatch
from .real_writes import sets_data


class NotTraceable(RuntimeError):
    """The function's Python needs tensor values, so no graph can stand for it."""


_SCALAR_READ = torch.ops.aten._local_scalar_dense.default


def refuse_scalar_reads(graph: torch.fx.GraphModule) -> None:
    """Raise ``NotTraceable`` if ``graph`` reads a scalar back into Python."""
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target is _SCALAR_READ:
            raise NotTraceable(
                "it reads a tensor's value into Python (.item(), float(), int() or bool() of a tensor)"
            )


def refuse_lost_results(graph: torch.fx.GraphModule) -> None:
    """Raise ``NotTraceable`` if ``graph`` holds a fake tensor as a constant:
    a tensor the tracer lost track of (a tensor subclass made inside the
    function, ``as_subclass`` or ``nn.Parameter(x)``, under ``torch.func``
    transforms), which it kept as it was at trace time. Replayed, it holds
    no values: the outputs it reached were never written (uninitialized
    memory in gradients and batches)."""
    for node in graph.graph.nodes:
        if node.op != "get_attr":
            continue
        constant = operator.attrgetter(node.target)(graph)
        if isinstance(constant, torch.Tensor) and is_fake(constant):
            raise NotTraceable(
                "PyTorch's tracer lost track of a tensor it computes (a tensor subclass made inside the function, "
                "as_subclass or nn.Parameter(x), is one) and kept it as a constant of its trace, which holds no values"
            )


def refuse_module_side_effects(rebound: Sequence[str], python_state: Sequence[str]) -> None:
    """Raise ``NotTraceable`` if the trace rebound module attributes (NOTE
    [trial runs do not write to real tensors]) or changed plain ones (NOTE
    [Python state in trial runs]): a graph replays none of that Python."""
    if rebound:
        names = ", ".join(dict.fromkeys(rebound))
        what = f"binds a new tensor to {names}, a Python side effect the graph cannot replay"
        fix = (
            "update the tensor in place instead (self.ema.mul_(0.9).add_(x, alpha=0.1)) to keep the graph, "
            "and use torch.nn.utils.parametrizations for weight or spectral norm"
        )
    elif python_state:
        what = (
            f"changes Python state ({', '.join(dict.fromkeys(python_state))}), which a graph's replay would not: "
            f"the graph would keep the branch the trace took on the state as it was (a one-time init guarded by "
            f"a flag would run on every call)"
        )
        fix = "keep such state in a buffer updated in place to keep the graph"
    else:
        return
    raise NotTraceable(f"a module's forward {what}; {fix}")


def refuse_state_kept_in_objects(
    changed: Sequence[str],
    hook_filled: Sequence[str] = (),
    from_inputs: Sequence[str] = (),
    lists_filled: Sequence[str] = (),
) -> None:
    """Raise ``NotTraceable`` if the trace rebound an entry a dict, or an
    attribute a plain object, it closes over already had, from or to a
    tensor (a KV cache's ``self.k = torch.cat([self.k, x])``): a graph
    replays none of that Python, so later calls would not see it grow; or
    changed a container a module hook fills, ``hook_filled`` (NOTE [what
    module hooks fill] in trial_caches.py); or added an entry computed from
    the function's inputs or a random draw, ``from_inputs`` (NOTE [an entry
    a trace adds, from the inputs] in trial_caches.py, NOTE [what an added
    entry is computed from] in graph_mode.py); or put a tensor into, or took
    one out of, a list it closes over, ``lists_filled`` (NOTE [lists a
    function fills] in trial_caches.py)."""
    if hook_filled:
        raise NotTraceable(
            f"a module hook changes a dict, list or object it names ({', '.join(dict.fromkeys(hook_filled))}: "
            f"saved activations, a call counter), and a graph replays no hook, so only eager calls fill it"
        )
    if lists_filled:
        raise NotTraceable(
            f"it appends a tensor to, or changes the tensors of, {', '.join(dict.fromkeys(lists_filled))} "
            f"(saved inputs or activations), which a graph's replay would not do, so only eager calls fill it; "
            f"keep such state in a preallocated tensor updated in place (buf[step] = x) to keep the graph"
        )
    if from_inputs:
        raise NotTraceable(
            f"it adds an entry computed from its inputs or a random draw ({', '.join(dict.fromkeys(from_inputs))}) "
            f"to a dict or plain object it closes over (state a later call reads, such as a streaming module's "
            f"previous input, saved activations or a table drawn once), which a graph's replay would not write; "
            f"keep such state in a preallocated tensor updated in place (buf.copy_(x)) to keep the graph"
        )
    if changed:
        raise NotTraceable(
            f"it binds a new tensor to {', '.join(dict.fromkeys(changed))} of a dict or plain object it closes over "
            f"(state such as a KV cache), a Python side effect the graph cannot replay; keep such state in a "
            f"preallocated tensor updated in place (cache[:, step] = x) to keep the graph"
        )


_aten = torch.ops.aten
# Ops that hand a tensor's value to Python.
_VALUE_READS = frozenset({_aten._local_scalar_dense.default, _aten.item.default, _aten.equal.default})
# torch.tensor(literal): a fresh constant, the same on every call.
_FRESH_CONSTANTS = frozenset({_aten.lift_fresh.default, _aten.lift_fresh_copy.default})
_MASK_DTYPES = (torch.bool, torch.uint8)
# Python-level reads that never reach the dispatcher.
_PYTHON_READS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__})


def _refusal(what: str) -> NotTraceable:
    return NotTraceable(
        f"it {what} of a tensor it closes over (a module's buffer, a global tensor) or one computed "
        f"from it, which the graph would keep from its trace; use that tensor in tensor ops instead "
        f"(x / count, not x / float(count))"
    )


class _ClosedOverFollower(TorchDispatchMode):
    """Follows tensors computed from real (closed-over) ones; refuses aten
    ops that would read their values or take a shape from them."""

    def __init__(self, noted: list[NotTraceable]) -> None:
        super().__init__()
        self._derived: dict[int, weakref.ref[torch.Tensor]] = {}
        self._noted = noted  # each refusal and unanswerable read, caught by the function or not

    def from_closed_over(self, t: torch.Tensor) -> bool:
        if not is_fake(t):
            return True
        ref = self._derived.get(id(t))
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        followed = func not in _FRESH_CONSTANTS and any(
            self.from_closed_over(a) for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
        )
        if followed:
            if func in _VALUE_READS:
                raise _noted(self._noted, _refusal(f"reads the value ({func})"))
            if torch.Tag.dynamic_output_shape in func.tags and self._shape_from_values(func, args):
                raise _noted(self._noted, _refusal(f"takes a shape from the values ({func})"))
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            _noted(self._noted, _unanswerable(func, type(err).__name__))
            raise
        if func in _VALUE_READS and isinstance(out, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            # A value the trace does not know (a symbol): whatever Python does
            # with it next fails or guards, and the read stays in the graph
            # only if its result is used.
            _noted(self._noted, _unanswerable(func, "a value the trace does not know"))
        if followed:
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    self._derived[id(o)] = weakref.ref(o)
        return out

    def _shape_from_values(self, func: Any, args: tuple[Any, ...]) -> bool:
        if func is _aten.index.Tensor:  # only boolean masks decide the shape
            indices = args[1] if len(args) > 1 else ()
            return any(
                isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES and self.from_closed_over(i) for i in indices
            )
        return True


def _noted(noted: list[NotTraceable], refusal: NotTraceable) -> NotTraceable:
    noted.append(refusal)
    return refusal


def _unanswerable(func: Any, why: str) -> NotTraceable:
    return NotTraceable(
        f"it reads a tensor's value into Python, or takes a shape from its values ({func}: {why}); "
        f"a function that catches the error this raises in a trace is refused too"
    )


class _PythonReadRefuser(TorchFunctionMode):
    """Refuses ``.tolist()``, ``.numpy()`` and ``__array__`` of a real tensor,
    and notes those of a fake one, which fail, and ``.data =``, which a
    trace does not record."""

    def __init__(self, noted: list[NotTraceable]) -> None:
        super().__init__()
        self._noted = noted

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if sets_data(func):
            # Noted, not raised: the rebinding itself still happens (t2j_ad's
            # own put-back of a module's elements goes through here too).
            _noted(
                self._noted,
                NotTraceable(
                    "it rebinds a tensor's elements with `.data =`, which PyTorch's tracer does not record, so "
                    "the graph would compute with the old ones; use the new tensor itself (y = x * 2)"
                ),
            )
            return func(*args, **(kwargs or {}))
        if func in _PYTHON_READS and args and isinstance(args[0], torch.Tensor):
            if not is_fake(args[0]):
                raise _noted(self._noted, _refusal(f"reads the values (Tensor.{func.__name__})"))
            try:
                return func(*args, **(kwargs or {}))
            except Exception as err:
                _noted(self._noted, _unanswerable(f"Tensor.{func.__name__}", type(err).__name__))
                raise
        return func(*args, **(kwargs or {}))


def _jax_inside(what: str) -> NotTraceable:
    return NotTraceable(
        f"it {what}: a JAX computation, which PyTorch's tracer cannot see into, so the graph would keep its "
        f"result from the trace as a constant; jaxify the whole computation as one PyTorch function to keep a graph"
    )


def refusing_closed_over_reads(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, where a read of a closed-over tensor's value raises
    ``NotTraceable``, and so does its return after any read it caught
    (NOTE [values a graph would keep]), or after a JAX call or conversion
    (NOTE [JAX inside a trace] in jax_in_traces.py): what ``make_fx``
    traces."""

    def traced(*args: Any) -> Any:
        noted: list[NotTraceable] = []
        with noting_jax_inside() as jax_inside, _PythonReadRefuser(noted), _ClosedOverFollower(noted):
            try:
                result = fn(*args)
            except Exception:
                if jax_inside:  # NOTE [JAX inside a trace] in jax_in_traces.py: the call raised
                    raise _jax_inside(jax_inside[0]) from None
                raise
        if jax_inside:
            noted.append(_jax_inside(jax_inside[0]))
        if noted:
            raise noted[0]
        return result

    return traced


class _RandomDrawChecker(TorchDispatchMode):
    """Refuses a random op that finds PyTorch's random state set since the
    trace began, or that draws from an explicit generator (NOTE [random
    state in trial runs] in random_state.py)."""

    def __init__(self, seeds: SeedWatch) -> None:
        super().__init__()
        self.seeds = seeds

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            if any(isinstance(a, torch.Generator) for a in pytree.tree_leaves((args, kwargs))):
                raise NotTraceable(own_generator_reason(f"{func}, generator="))
            if self.seeds.reseeded():
                raise _reseeding()
        return func(*args, **kwargs)


def own_generator_reason(draw: str) -> str:
    """Why a function that draws from a generator it was given (``draw``
    names the op) runs eagerly in graph mode."""
    return (
        f"it draws from a torch.Generator of its own ({draw}), which the graph would hold as the trace left "
        f"it and advance from replay to replay; draw from PyTorch's global generator (seeded outside the "
        f"function) to keep the graph"
    )


def _reseeding() -> NotTraceable:
    return NotTraceable(
        "it sets PyTorch's random state (torch.manual_seed, torch.set_rng_state, torch.random.fork_rng), "
        "which the graph cannot replay: each replay would draw on from the state it finds; seed outside "
        "the function to keep the graph"
    )


def refusing_reseeding(fn: Callable[..., Any], seeds: SeedWatch) -> Callable[..., Any]:
    """``fn``, where setting PyTorch's random state (``seeds`` sees it), or
    drawing from a generator of its own, raises ``NotTraceable`` (NOTE
    [random state in trial runs] in random_state.py)."""

    def traced(*args: Any) -> Any:
        with _RandomDrawChecker(seeds):
            out = fn(*args)
        if seeds.reseeded():  # after its last draw, a side effect all the same
            raise _reseeding()
        return out

    return traced
