"""Fallbacks for PyTorch code that ``torch.func`` refuses.

NOTE [fallbacks]
``torch.func`` refuses three kinds of code, each with its own error:

- an ``autograd.Function`` without a ``jvp`` staticmethod refuses forward mode
  (``NotImplementedError: You must implement the jvp function ...``). Forward
  mode then comes from the double-vjp trick: ``u -> J^T u`` is linear, so its
  vjp with cotangent ``t`` is ``(J^T)^T t = J t``. It needs only reverse mode
  and works inside ``torch.vmap`` when the Function has a vmap rule.
  It differentiates the Function's backward in its incoming gradient, so a
  backward not differentiable there is refused, on every call (NOTE [a
  backward that drops its cotangent]); so is reverse mode over a reverse
  pass through it (NOTE [a reverse pass differentiated again]).
- an old-style ``autograd.Function`` (``forward(ctx, ...)``, no
  ``setup_context``) refuses every transform. Reverse mode then uses
  ``torch.autograd.grad(..., create_graph=True)``, so it can be differentiated
  again; forward mode is the double-vjp trick on top of that; batching is the
  sequential loop (the ``auto`` vmap method falls back to it).
- code ``torch.vmap`` cannot trace (``.item()``, data-dependent control flow)
  refuses batching; with ``vmap_method="auto"`` it runs sequentially.

A function can also ask for ``torch.autograd.grad`` from the start
(``BaseFn.autograd_vjp``; torch2jax's ``use_torch_vjp=False``). Code on that
path cannot run inside a ``torch.func`` transform, and PyTorch says so; a
level above it (forward mode, the outer pass of the double-vjp trick) then
takes its own fallback, so every order still works.

Each fallback is decided once per function and transform prefix, remembered
on the ``BaseFn`` (so later calls pay no failed attempt), and announced with
one warning that names the function and PyTorch's reason. Inside a graph-mode
trace the decisions and warnings are provisional (``provisional``): they take
effect only if the trace succeeds, because a trace can fail for reasons eager
code never meets (NOTE [graph mode] in graph_mode.py).
"""

from __future__ import annotations

import collections

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.func

from .. import functorch_levels
from . import forward_over_forward


class FallbackWarning(UserWarning):
    """A PyTorch function runs on a slower path that still gives exact results.

    Issued once per function and kind of fallback, naming the function and
    PyTorch's reason: ``torch.vmap`` refused it (a sequential loop runs
    instead), ``torch.func.jvp`` refused it (the double-vjp trick), or
    ``torch.func.vjp`` refused it (``torch.autograd.grad``). See the
    "Errors and fallback warnings" page of the documentation; silence it with
    ``warnings.filterwarnings("ignore", category=t2j_ad.FallbackWarning)``.
    """


# An inner level on the torch.autograd.grad path, run inside a torch.func
# transform (see NOTE [fallbacks]).
_INNER_AUTOGRAD = "inside of a function being transformed by a functorch transform"
# A write into a tensor the function closes over, in a derivative call that
# replays its value call (NOTE [derivatives do not write again] in
# state_writes.py): torch.func refuses it; plain autograd runs it as
# PyTorch's own backward does, and the call puts the tensor back. In a
# derivative call of the function itself the write went unseen by its
# trial run, and the call is refused (``_refuse_unseen_write``).
_CAPTURED_WRITE = "that would mutate a captured Tensor"
_CAPTURED_WRITE_ADVICE = (
    " (The function writes in place into a tensor it closes over, e.g. BatchNorm's running statistics in "
    "training mode.)"
)
_SAVED_TENSOR_HOOKS = "don't yet support saved tensor hooks"
_UNUSED_IN_GRAPH = "appears to not have been used in the graph"
_NO_FORWARD_FORMULA = "Trying to use forward AD with"
# Forward-mode refusals -> the advice the fallback warning adds.
_FORWARD_REFUSALS = {
    "You must implement the jvp function": " Define a jvp staticmethod on the autograd.Function to avoid it.",
    "must override the setup_context staticmethod": "",
    _INNER_AUTOGRAD: "",
    # Some forward-mode formulas write into the efficient zero tangent of an
    # input that has none (torch 2.x: jacfwd(grad(mse_loss)) with the target
    # closed over); reverse mode has no such formula, so the trick works.
    "ZeroTensors are immutable": " (A PyTorch forward-mode formula failed; reverse mode has no such formula.)",
    "doesn't have storage": " (The function reads a tensor's data, e.g. with .numpy(), which torch.func cannot trace.)",
    _CAPTURED_WRITE: _CAPTURED_WRITE_ADVICE,
    # An op with a backward but no forward-mode formula (grid_sample): jacfwd
    # and jax.hessian (forward over reverse) failed where jacrev worked.
    _NO_FORWARD_FORMULA: " (PyTorch has no forward-mode formula for an op here.)",
    # torch.autograd.forward_ad inside the function: PyTorch has one level
    # of forward AD, which torch.func.jvp holds; reverse mode leaves it free.
    "Nested forward mode AD is not supported": " (The function uses torch.autograd.forward_ad itself.)",
    # torch.autograd.grad inside the function: under torch.func.jvp what it
    # differentiates records no graph (a gradient penalty).
    "does not require grad and does not have a grad_fn": " (The function calls torch.autograd.grad itself.)",
}
# Reverse-mode refusals -> the advice the fallback warning adds.
_FUNCTORCH_REFUSALS = {
    "must override the setup_context staticmethod": (
        " Define setup_context (and vmap/jvp) on the autograd.Function to use torch.func."
    ),
    _INNER_AUTOGRAD: "",
    # Reading a tensor's memory (.numpy(), .tolist(), a data pointer) inside
    # torch.func: its wrapper tensors have none. autograd.grad runs the
    # function on plain tensors, where the read works (and is a constant).
    "doesn't have storage": " (The function reads a tensor's data, e.g. with .numpy(), which torch.func cannot trace.)",
    _CAPTURED_WRITE: _CAPTURED_WRITE_ADVICE,
    # torch.utils.checkpoint(use_reentrant=False) sets saved-tensor hooks,
    # which torch.func refuses; plain autograd recomputes as PyTorch does.
    _SAVED_TENSOR_HOOKS: " (torch.utils.checkpoint inside the function sets saved-tensor hooks.)",
    # torch.autograd.grad inside the function with respect to tensors it
    # closes over (a gradient penalty on a module's parameters): under
    # torch.func their uses are wrapped, and autograd finds none.
    _UNUSED_IN_GRAPH: " (The function calls torch.autograd.grad with respect to tensors it closes over.)",
}


def _refuse_unseen_write(base: Any, err: BaseException) -> None:
    """Raise if ``err`` is a write into a captured tensor by a derivative
    call of the function itself, not of a replay: a write its trial run did
    not see (NOTE [derivatives do not write again] in state_writes.py)."""
    if _CAPTURED_WRITE not in str(err) or getattr(base, "replays", False):
        return
    raise RuntimeError(
        f"{base.name} writes in place into a tensor it keeps between calls ({first_line(err)}), but the run "
        f"that inferred its output shapes did not see that write: it depends on the input's values (those runs "
        f"are on zeros and on ones), the function was given output_shapes=, or it ran with other training flags when "
        f"jax.jit traced it. Its derivative would write the state a second time, and start from the state its "
        f"value call left. Make the write unconditional (torch.where(cond, update, 0)), leave output_shapes "
        f"out, or trace again after module.train(): jax.clear_caches(), or jax.jit of a new function object, as "
        f"jax.jit(functools.partial(step)) (jax.jit(step) again reuses the trace JAX keeps for step)."
    ) from err


# Ops without a forward-mode formula whose double backward PyTorch gets
# wrong, so the double-vjp trick would be too: PyTorch's refusal stands. The
# sparse constructors' is silently zero (torch 2.13: jacfwd through
# sparse_coo_tensor(...).to_dense() came out 0); _weight_norm_interface's
# (parametrizations.weight_norm) is wrong with respect to the direction v
# (a Hessian-vector product off by 5 - 8 against the same math in jax.numpy;
# PyTorch's own reverse over reverse is off too).
_WRONG_DOUBLE_BACKWARD = ("sparse", "_weight_norm_interface")


# The first line of the error a jaxified function called inside this one
# raises when its own PyTorch call fails: the FFI backend's
# (csrc/torch_call.cc), the callback backend's (JAX's). That failure is the
# inner function's, and so is any PyTorch refusal its text quotes: no
# transform of this function was refused (NOTE [a call inside torch.func
# transforms] in runtime.py). Quoting a captured-tensor write, it blamed this
# function for a state write it never made.
_NESTED_CALL_FAILED = ("t2j_ad: PyTorch call (key", "Error when calling buffer callback")


def _refused(err: BaseException, needles: Iterable[str]) -> bool:
    text = str(err)
    if any(marker in first_line(err) for marker in _NESTED_CALL_FAILED):
        return False
    if _NO_FORWARD_FORMULA in text and any(op in text for op in _WRONG_DOUBLE_BACKWARD):
        return False
    return isinstance(err, (RuntimeError, NotImplementedError)) and any(n in text for n in needles)


def _advice(err: BaseException, refusals: dict[str, str]) -> str:
    """What the warning adds for the refusal ``err`` matched."""
    return next(a for needle, a in refusals.items() if needle in str(err))


class _Provisional:
    """Decisions and warnings made during one trace of ``base``, not yet kept."""

    def __init__(self, base: Any):
        self.base = base
        self.decided: dict[Any, str] = dict(base.__dict__.get("fallbacks", {}))
        self.warnings: dict[Any, str] = {}


_tracing = threading.local()


def _active(base: Any) -> _Provisional | None:
    state = getattr(_tracing, "state", None)
    return state if state is not None and state.base is base else None


@contextlib.contextmanager
def provisional(base: Any) -> Iterator[None]:
    """Keep the fallback decisions and warnings made inside this block (a
    graph-mode trace of ``base``'s functions) only if it raises nothing."""
    outer = getattr(_tracing, "state", None)
    state = _tracing.state = _Provisional(base)
    try:
        yield
    finally:
        _tracing.state = outer
    # Reached only when the block succeeded: commit.
    base.__dict__.setdefault("fallbacks", {}).update(state.decided)
    for kind, message in state.warnings.items():
        warn_once(base, kind, message)


def decisions(base: Any) -> dict[Any, str]:
    """Where the fallback decisions for ``base`` are read and written."""
    state = _active(base)
    return state.decided if state is not None else base.__dict__.setdefault("fallbacks", {})


def warn_once(base: Any, kind: Any, message: str) -> None:
    """Warn with ``message`` the first time ``base`` meets fallback ``kind``."""
    state = _active(base)
    warned = base.__dict__.setdefault("warned", set())
    if kind in warned:
        return
    if state is not None:
        state.warnings.setdefault(kind, message)
        return
    warned.add(kind)
    warnings.warn(message, FallbackWarning, stacklevel=3)


def first_line(err: BaseException) -> str:
    """``err``'s type and the first line of its message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


# --------------------------------------------------------------------- reverse


def autograd_vjp(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    primals: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """``J^T c`` by ``torch.autograd.grad`` with ``create_graph=True``."""
    with torch.enable_grad():
        # A fresh autograd node per input, even when the caller passed one
        # tensor twice, so each input gets its own gradient; inputs that
        # already carry a graph (an outer fallback level) stay connected.
        xs = [p.view_as(p) if p.requires_grad else p.detach().requires_grad_(True) for p in primals]
        grads = functorch_levels.autograd_grad(fn(*xs), xs, cotangents)
    return tuple(torch.zeros_like(p) if g is None else g for g, p in zip(grads, primals))


# Where a BaseFn keeps the name of an autograd.Function with a
# @once_differentiable backward (and no jvp) in its autograd graph, or None,
# as its first reverse pass found it: a fact about the function, not a
# fallback decision (a trace that makes a decision is traced again).
_ONCE_DIFFERENTIABLE_SEEN = "once_differentiable_backward"


def _noting_once_differentiable(
    fn: Callable[..., tuple[torch.Tensor, ...]], noted: dict[str, Any]
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``fn``, noting in ``noted`` (a BaseFn's ``__dict__``) on its first
    run whether its outputs' autograd graph holds a Function whose backward
    is ``@once_differentiable`` (forward mode over such a reverse pass
    refuses: ``_refuse_marked_reverse_pass``)."""

    def noting(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = fn(*xs)
        noted[_ONCE_DIFFERENTIABLE_SEEN] = _once_differentiable_in(outs, without_jvp=True)
        return outs

    return noting


def _once_differentiable_in(outs: Any, without_jvp: bool = False) -> str | None:
    """The class name of an autograd.Function behind ``outs`` whose backward
    is ``@once_differentiable`` (and, with ``without_jvp``, that has no jvp
    staticmethod: with one, forward mode runs that backward on dual
    numbers, which no_grad does not stop); None when there is none."""
    for node in _graph_nodes(outs if isinstance(outs, (tuple, list)) else (outs,)):
        # The autograd.Function of a custom node (the user's, under torch.func too).
        function = functorch_levels.user_function(getattr(node, "_forward_cls", None))
        if getattr(getattr(function, "backward", None), "__code__", None) is not _ONCE_DIFFERENTIABLE_CODE:
            continue
        if not without_jvp or getattr(function, "jvp", None) is torch.autograd.Function.jvp:
            return function.__name__
    return None


# What a refused second derivative is, for its message: forward mode by the
# double-vjp trick (a backward that dropped its cotangent there makes it
# zero), reverse mode over a reverse pass (NOTE [a reverse pass
# differentiated again]), forward mode over a reverse pass (NOTE [a reverse
# pass differentiated in forward mode]).
_FORWARD_OVER_REVERSE = "forward"
_REVERSE_OVER_REVERSE = "reverse"
_JVP_OVER_REVERSE = "jvp of a reverse pass"


def reverse_mode(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    primals: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor],
    *,
    base: Any,
    key: Any,
    over_reverse: bool = False,
    second_derivative: str = _REVERSE_OVER_REVERSE,
) -> tuple[torch.Tensor, ...]:
    """Cotangents of ``primals``: ``torch.func.vjp`` (NOTE [functorch levels]), else ``autograd.grad``.
    ``over_reverse``: ``fn`` holds a reverse pass (a gradient of a gradient), whose backwards are
    watched while this pass differentiates them (NOTE [a reverse pass differentiated again]), and
    refused as ``second_derivative`` says (the double-vjp trick over a reverse pass is forward mode).
    Run inside forward mode over a reverse pass, this pass's backwards are watched for it (NOTE [a
    reverse pass differentiated in forward mode])."""
    differentiated, kind = _differentiated_now()
    watches = _tangent_watches_now()
    if over_reverse:
        fn = _differentiating(fn, second_derivative)
    if not differentiated and not watches:
        return _reverse_pass(fn, primals, cotangents, base=base, key=key)
    dropped: list[type] = []  # Functions whose backward dropped a cotangent an outer pass differentiates
    reaching = _ReachingInputs(differentiated) if differentiated else None
    try:
        watched = _watching_backwards(fn, dropped if reaching else None, reaching, watches)
        grads = _reverse_pass(watched, primals, cotangents, base=base, key=key)
    finally:
        if reaching is not None:
            reaching.end()
    _refuse_dropped_cotangent(base, dropped, second_derivative=kind)
    return grads


def _reverse_pass(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    primals: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor],
    *,
    base: Any,
    key: Any,
) -> tuple[torch.Tensor, ...]:
    """``reverse_mode`` without the watch."""
    decided = decisions(base)
    if _ONCE_DIFFERENTIABLE_SEEN not in base.__dict__:
        fn = _noting_once_differentiable(fn, base.__dict__)
    if not base.autograd_vjp and decided.get(("vjp", key)) != "autograd":
        try:
            return functorch_levels.vjp(fn, primals, cotangents)
        except (RuntimeError, NotImplementedError) as err:
            if not _refused(err, _FUNCTORCH_REFUSALS):
                raise
            _refuse_unseen_write(base, err)
            decided[("vjp", key)] = "autograd"
            warn_once(
                base,
                "vjp",
                f"t2j_ad: reverse mode of {base.name!r} falls back to "
                f"torch.autograd.grad because torch.func.vjp refused it "
                f"({first_line(err)}). Results are exact.{_advice(err, _FUNCTORCH_REFUSALS)}",
            )
    return autograd_vjp(fn, primals, cotangents)


# --------------------------------------------------------------------- forward


def double_vjp_jvp(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    primals: Sequence[torch.Tensor],
    tangents: Sequence[torch.Tensor],
    *,
    base: Any,
    key: Any,
    over_reverse: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``J t`` from reverse mode alone (see NOTE [fallbacks]). ``over_reverse``:
    ``fn`` holds a reverse pass, which the pullback differentiates in reverse
    mode, watched as NOTE [a reverse pass differentiated again] says."""
    if decisions(base).get(("once differentiable", key)):
        with torch.enable_grad():
            outs = fn(*primals)
    else:
        outs = _outputs_refusing_once_differentiable(fn, primals, base, key)
    seeds = tuple(torch.zeros_like(o) for o in outs)
    dropped: list[type] = []  # Functions whose backward dropped its cotangent, this call

    def pullback(*u: torch.Tensor) -> tuple[torch.Tensor, ...]:
        watched = _watching_backwards(fn, dropped)
        grads = reverse_mode(
            watched, primals, u, base=base, key=key, over_reverse=over_reverse, second_derivative=_JVP_OVER_REVERSE
        )
        _refuse_once_differentiable(base, key, grads)
        _refuse_dropped_cotangent(base, dropped)
        return grads

    return reverse_mode(pullback, seeds, tangents, base=base, key=("outer",) + tuple(key))


# The code of the wrapper torch.autograd.function.once_differentiable puts
# around a backward (functools.wraps copies the backward's name onto it).
_ONCE_DIFFERENTIABLE_CODE = torch.autograd.function.once_differentiable(lambda ctx, *grads: grads).__code__


def _graph_nodes(tensors: Iterable[Any]) -> Iterator[Any]:
    """Every autograd node behind ``tensors``, each once, nearest first."""
    seen: set[Any] = set()
    nodes = collections.deque(getattr(t, "grad_fn", None) for t in tensors if isinstance(t, torch.Tensor))
    while nodes:
        node = nodes.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        nodes.extend(child for child, _ in node.next_functions)


# NOTE [a reverse pass differentiated again]
# Reverse mode over a reverse pass (``jax.jacrev(jax.grad(f))``, the
# gradient of ``jax.grad(f)(x) @ v``, ``jax.vjp`` of ``jax.vjp``, batched
# or not: a TorchFn ``f + Vjp + ... + Vjp``) differentiates the inner
# reverse pass with autograd, through each autograd.Function's backward as
# that backward computed its result. A backward that leaves autograd on its
# way from its incoming gradient ``g`` to its result (NOTE [a backward that
# drops its cotangent]) hides the part of the second derivative that goes
# through ``g``, which depends on the outer pass's inputs (``2 sin(x)`` for
# ``sin(x)**2``): the second derivative came out wrong, with no error, as
# PyTorch's own ``torch.autograd.functional.hessian`` does. So a reverse
# pass over a reverse pass (``over_reverse``) notes, per thread, the inputs
# it differentiates while its function runs, and every reverse pass run
# inside it is watched with the double-vjp trick's hooks and refused, naming
# the Function, when one of its backwards dropped a cotangent. What counts
# as connected is a cotangent that reaches those inputs in the autograd graph
# (at any torch.func level), not one that requires grad: the inner pass takes
# its own gradient with ``create_graph=True``, so every cotangent that
# depends on its own inputs requires grad, and one that depends on no input
# of the outer pass loses nothing (``jax.jacrev`` in ``w`` of ``jax.grad`` in
# ``x``, the cotangent a function of ``x`` alone). A cotangent that reaches
# no differentiated input at all (``f(x).sum()``: a constant) is not looked
# at, so a backward computed in NumPy or under ``torch.no_grad()`` that also
# drops its dependence on the saved input (``cos(x)``) is not seen there: its
# result, requiring no grad, looks like that of a backward whose result is
# truly constant in ``x`` (``g * (x > 0)``). ``@once_differentiable`` says so
# itself, and such a backward whose node saved a tensor that reaches a
# differentiated input is refused too. Each node's answer is remembered for
# the rest of the pass (``_ReachingInputs``), so a chain of Functions walks
# its graph once; first-order reverse mode and forward over reverse (the
# double-vjp trick's own watch) pay nothing for it.

# The inputs that reverse passes running over a reverse pass differentiate,
# and what the innermost of them computes (``_REVERSE_OVER_REVERSE``, or
# ``_JVP_OVER_REVERSE`` for the double-vjp trick's pullback), per thread
# (NOTE [a reverse pass differentiated again]).
_differentiated = threading.local()


def _differentiated_now() -> tuple[tuple[torch.Tensor, ...], str]:
    return getattr(_differentiated, "inputs", ()), getattr(_differentiated, "kind", _REVERSE_OVER_REVERSE)


def _differentiating(fn: Callable[..., tuple[torch.Tensor, ...]], kind: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``fn``, noting while it runs the inputs its caller differentiates
    and ``kind``: the reverse passes it runs are watched (NOTE [a reverse
    pass differentiated again])."""

    def differentiating(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outer, outer_kind = _differentiated_now()
        _differentiated.inputs = outer + tuple(x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad)
        _differentiated.kind = kind
        try:
            return fn(*xs)
        finally:
            _differentiated.inputs, _differentiated.kind = outer, outer_kind

    return differentiating


# NOTE [a backward that drops its cotangent]
# The double-vjp trick (NOTE [fallbacks]) differentiates the reverse pass
# ``u -> J^T u`` with respect to its cotangent ``u``; an autograd.Function's
# backward that leaves autograd on its way from ``g`` to its result (NumPy,
# ``g.detach()``, ``@torch.no_grad()``, ``@once_differentiable``) cuts that
# path, autograd finds ``u`` unused, and forward mode came out zero (or a
# Hessian lost a part) with no error: PyTorch's own
# ``torch.autograd.functional.jvp`` gives the same zeros; ``torch.func``
# refuses such a Function. Whether it happens depends on the branch a call
# takes, so it is looked at on every call of the trick, not once: a hook on
# each custom Function node of the call's forward graph sees, when the
# reverse pass runs that node's backward, its incoming cotangents and its
# results. A backward dropped its cotangent when some cotangent is
# connected to ``u`` (requires grad) and some result is a float tensor, yet
# no result reaches any such cotangent in the autograd graph, walked at
# every torch.func level (under ``torch.func.vjp`` the dependence on ``u`` is
# recorded at the outer level, under the inner level's wrappers). A gradient
# that is legitimately nothing is not refused: a result of None (no
# gradient for that input), an incoming cotangent already cut upstream by
# an op whose derivative is zero (``round``: its backward gives zeros that
# require no grad, so the Function's cotangent does not require grad), an
# integer output (its cotangent cannot require grad), or a backward that
# reads only some of its outputs' cotangents. Where every cotangent the
# backward was given is connected to ``u``, each float result must reach
# one: a result for one input computed in NumPy beside a differentiable one
# for another (``sin(x) * s``, ``s``'s gradient in NumPy) dropped its part,
# and forward mode in that input came out zero while the other result
# passed the check. Where some cotangent is not connected (an output whose
# gradient was cut, or unused), a result may rightly depend on that one
# alone, and one result reaching a connected cotangent is enough. A backward that returns a
# fresh constant (``torch.zeros_like(g)``) for a result that is truly zero
# is refused too; return None for it instead. The walk costs one pass over
# the call's forward graph and, per custom node, a search of its backward's
# graph that stops at the first cotangent it reaches. Reverse mode over a
# reverse pass differentiates the same backwards, and the same hooks watch
# them there (NOTE [a reverse pass differentiated again]).


def _watching_backwards(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    dropped: list[type] | None,
    reaching: _ReachingInputs | None = None,
    tangent_watches: Sequence[_TangentWatch] = (),
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``fn``, with a hook on every autograd.Function node behind its
    outputs that appends to ``dropped`` (unless None) the Function whose
    backward dropped its cotangent (NOTE [a backward that drops its
    cotangent]); with ``reaching``, a cotangent counts only where it reaches
    the inputs an outer reverse pass differentiates (NOTE [a reverse pass
    differentiated again]). Each node is also shown to each of
    ``tangent_watches``: forward mode over this reverse pass (NOTE [a
    reverse pass differentiated in forward mode])."""

    def watching(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if dropped is not None:
            dropped.clear()  # a retry (torch.autograd.grad after torch.func refused) starts afresh
        outs = fn(*xs)
        for node in _graph_nodes(outs if isinstance(outs, (tuple, list)) else (outs,)):
            function = functorch_levels.user_function(getattr(node, "_forward_cls", None))
            if function is None:
                continue
            if dropped is not None:
                # Looked at now, not in the hook: a hook holding its node would keep the graph alive.
                reads = reaching is not None and _once_differentiable_reads(node, function, reaching)
                node.register_hook(_dropped_cotangent_hook(function, dropped, reaching, reads))
            for watch in tangent_watches:
                watch.watch(node, function)
        return outs

    return watching


def _dropped_cotangent_hook(
    function: type, dropped: list[type], reaching: _ReachingInputs | None, once_differentiable_reads: bool
) -> Callable[..., None]:
    def hook(results: Sequence[torch.Tensor | None], cotangents: Sequence[torch.Tensor | None]) -> None:
        if reaching is not None and reaching.ended:
            return
        if _backward_dropped_cotangent(results, cotangents, reaching, once_differentiable_reads):
            dropped.append(function)

    return hook


def _once_differentiable_reads(node: Any, function: type, reaching: _ReachingInputs) -> bool:
    """Whether ``function``'s backward is ``@once_differentiable`` and its
    node saved a tensor that reaches the inputs an outer reverse pass
    differentiates: its result depends on them outside autograd (NOTE [a
    reverse pass differentiated again])."""
    if getattr(getattr(function, "backward", None), "__code__", None) is not _ONCE_DIFFERENTIABLE_CODE:
        return False
    return any(reaching(t) for t in node.saved_tensors if isinstance(t, torch.Tensor))


def _backward_dropped_cotangent(
    results: Sequence[torch.Tensor | None],
    cotangents: Sequence[torch.Tensor | None],
    reaching: _ReachingInputs | None = None,
    once_differentiable_reads: bool = False,
) -> bool:
    """Whether a backward given ``cotangents`` returned ``results`` none of
    which depends on a cotangent that requires grad (NOTE [a backward that
    drops its cotangent]); with ``reaching``, on a cotangent that reaches
    the inputs an outer reverse pass differentiates, and any float result
    of a ``@once_differentiable`` backward that reads them
    (``once_differentiable_reads``: NOTE [a reverse pass differentiated
    again])."""
    floats = [r for r in results if isinstance(r, torch.Tensor) and (r.is_floating_point() or r.is_complex())]
    if not floats:
        return False
    if once_differentiable_reads:
        return True
    given = [g for g in cotangents if isinstance(g, torch.Tensor)]
    connected = [g for g in given if g.requires_grad and (reaching is None or reaching(g))]
    if not connected:
        return False
    if len(connected) == len(given):  # each result must reach one (NOTE [a backward that drops its cotangent])
        return not all(_reaches([r], connected) for r in floats)
    return not _reaches(floats, connected)


def _reaches(tensors: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> bool:
    """Whether the autograd graph behind ``tensors`` holds one of ``targets``
    (by the node that made it, or, for a leaf, its AccumulateGrad node), at
    any ``torch.func`` level: each wrapper layer's graph is walked (NOTE [a
    backward that drops its cotangent]). Breadth first (``_graph_nodes``), since a backward's
    result is near its cotangent."""
    layers = [layer for t in targets for layer in functorch_levels.wrapped_layers(t)]
    target_nodes = {layer.grad_fn for layer in layers if layer.grad_fn is not None}
    target_leaves = {id(layer) for layer in layers if layer.grad_fn is None}
    starts = [layer for t in tensors for layer in functorch_levels.wrapped_layers(t)]
    if any(id(layer) in target_leaves for layer in starts):
        return True
    return any(
        node in target_nodes or id(getattr(node, "variable", None)) in target_leaves for node in _graph_nodes(starts)
    )


class _ReachingInputs:
    """Whether a tensor's autograd graph, at any ``torch.func`` level, holds
    one of ``inputs`` (as ``_reaches``), each node's answer remembered for
    the rest of one reverse pass: the cotangents of a chain of Functions
    share their graph below, walked once (NOTE [a reverse pass
    differentiated again])."""

    def __init__(self, inputs: Sequence[torch.Tensor]):
        layers = [layer for t in inputs for layer in functorch_levels.wrapped_layers(t)]
        self._nodes = {layer.grad_fn for layer in layers if layer.grad_fn is not None}
        self._leaves = {id(layer) for layer in layers if layer.grad_fn is None}
        self._known: dict[Any, bool] = {}
        self.ended = False

    def __call__(self, tensor: torch.Tensor) -> bool:
        layers = list(functorch_levels.wrapped_layers(tensor))
        if any(id(layer) in self._leaves for layer in layers):
            return True
        return any(self._node_reaches(layer.grad_fn) for layer in layers if layer.grad_fn is not None)

    def end(self) -> None:
        """End the pass: drop the remembered nodes (hooks on the graph hold
        this object, and a cycle through autograd's C++ nodes is never
        collected) and stop the hooks, which an outer ``torch.autograd.grad``
        over the same graph would run again."""
        self.ended = True
        self._known.clear()

    def _node_reaches(self, root: Any) -> bool:
        known = self._known
        stack = [root]
        while stack:  # depth first, iterative: a graph can be deeper than Python's recursion limit
            node = stack[-1]
            if node in known:
                stack.pop()
                continue
            if node in self._nodes or id(getattr(node, "variable", None)) in self._leaves:
                known[node] = True
                stack.pop()
                continue
            children = [child for child, _ in node.next_functions if child is not None]
            if any(known.get(child) for child in children):
                known[node] = True
                stack.pop()
                continue
            pending = [child for child in children if child not in known]
            if pending:
                stack.extend(pending)
                continue
            known[node] = False
            stack.pop()
        return known[root]


def _refuse_dropped_cotangent(
    base: Any, dropped: Sequence[type], second_derivative: str = _FORWARD_OVER_REVERSE
) -> None:
    """Raise if this call's reverse pass ran a backward that dropped its
    cotangent: forward mode by the double-vjp trick would be zero there;
    reverse mode over it (``second_derivative=_REVERSE_OVER_REVERSE``) would
    lose the part of the second derivative through that cotangent."""
    if not dropped:
        return
    function = dropped[0]
    once_differentiable = getattr(getattr(function, "backward", None), "__code__", None) is _ONCE_DIFFERENTIABLE_CODE
    if second_derivative == _REVERSE_OVER_REVERSE:
        raise _reverse_over_reverse_error(base, function.__name__, once_differentiable)
    if second_derivative == _JVP_OVER_REVERSE:
        raise _jvp_over_reverse_error(base, function, on_dual_numbers=False)
    if once_differentiable:
        raise _once_differentiable_error(base, function.__name__)
    raise RuntimeError(
        f"t2j_ad: forward mode of {base.name!r} needs the derivative of its reverse pass (a Hessian's "
        f"inner gradient, or the double-vjp trick where torch.func.jvp refuses), but the backward of "
        f"{function.__name__} is not differentiable in its incoming gradient: its result does not depend "
        f"on it in PyTorch's autograd graph (computed in NumPy, from grad.detach(), or under "
        f"torch.no_grad()), so forward mode would come out zero. Give {function.__name__} a jvp "
        f"staticmethod (with setup_context), compute its backward with differentiable torch ops on the "
        f"incoming gradient, or use reverse mode (jax.jacrev, jax.grad) instead of jax.jvp / jax.jacfwd. "
        f"(A backward whose result for an input is truly zero should return None for it.)"
    )


def _reverse_over_reverse_error(base: Any, function: str, once_differentiable: bool) -> RuntimeError:
    why = (
        "is marked @once_differentiable and cannot be differentiated again"
        if once_differentiable
        else "is not differentiable in its incoming gradient: its result does not depend on it in PyTorch's "
        "autograd graph (computed in NumPy, from grad.detach(), or under torch.no_grad())"
    )
    fix = (
        "drop @once_differentiable if the backward is differentiable, or compute it"
        if once_differentiable
        else "compute it"
    )
    return RuntimeError(
        f"t2j_ad: reverse mode over the reverse pass of {base.name!r} (jax.jacrev(jax.grad(f)), jax.grad of a "
        f"gradient, jax.vjp of jax.vjp) differentiates the backward of {function}, but that backward {why}, so "
        f"the second derivative would lose the part that goes through it. In {function}'s backward, {fix} with "
        f"differentiable torch ops on the incoming gradient and the saved tensors; or take first derivatives "
        f"alone through it. (A backward whose result for an input is truly zero should return None for it.)"
    )


def _once_differentiable_error(base: Any, function: str) -> RuntimeError:
    return RuntimeError(
        f"t2j_ad: forward mode of {base.name!r} needs the derivative of its reverse pass (a "
        f"Hessian's inner gradient, or the double-vjp trick where torch.func.jvp refuses), but the "
        f"backward of {function} is marked "
        f"@once_differentiable and cannot be differentiated again: forward mode would come out "
        f"zero. Give that autograd.Function a jvp staticmethod (with setup_context), drop "
        f"@once_differentiable if its backward is differentiable, or use reverse mode "
        f"(jax.jacrev, jax.grad) instead of jax.jvp / jax.jacfwd."
    )


def _outputs_refusing_once_differentiable(
    fn: Callable[..., tuple[torch.Tensor, ...]], primals: Sequence[torch.Tensor], base: Any, key: Any
) -> tuple[torch.Tensor, ...]:
    """``fn(*primals)``, run with its autograd graph recorded, refused if an
    ``autograd.Function`` in that graph has a ``@once_differentiable``
    backward: the double-vjp trick differentiates that backward, which
    PyTorch runs under ``no_grad`` and, for a Function with
    ``setup_context`` under ``torch.func``, without a trace of it in the
    reverse pass's graph, so forward mode came out zero. Its graph is the
    same at every call, so it is looked at once per transform."""
    try:
        with torch.enable_grad():
            xs = [p.detach().requires_grad_(True) if p.is_floating_point() or p.is_complex() else p for p in primals]
            outs = fn(*xs)
    except RuntimeError:  # e.g. requires_grad_ on a tensor a torch.func level batches
        # Grad mode on, as every call runs (NOTE [calls run with grad mode on]
        # in runtime.py): torch.autograd.grad inside the function needs it.
        with torch.enable_grad():
            return fn(*primals)  # _refuse_once_differentiable looks at the reverse pass instead
    marked = _once_differentiable_in(outs)
    if marked:
        raise _once_differentiable_error(base, marked)
    return tuple(o.detach() for o in outs)


def _refuse_once_differentiable(base: Any, key: Any, grads: Sequence[torch.Tensor]) -> None:
    """Raise if the reverse pass ``grads`` came from passes through a backward
    marked ``@once_differentiable`` (an old-style Function's, which leaves an
    error node in the reverse pass's graph): the double-vjp trick
    differentiates it again, and autograd, finding the cotangents unused,
    gave zeros. Looked at once per transform; a later call that reaches such
    a backward down another branch is refused by ``_refuse_dropped_cotangent``
    (NOTE [a backward that drops its cotangent])."""
    decided = decisions(base)
    if decided.get(("once differentiable", key)):
        return
    for node in _graph_nodes(grads):
        if node.name() == "torch::autograd::Error":  # once_differentiable's DelayedError
            raise _once_differentiable_error(base, "an autograd.Function it runs")
    decided[("once differentiable", key)] = True


def forward_mode(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    primals: Sequence[torch.Tensor],
    tangents: Sequence[torch.Tensor],
    *,
    base: Any,
    key: Any,
    over_reverse: bool = False,
    over_forward: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Output tangents: ``torch.func.jvp``, else the double-vjp trick.
    ``over_reverse``: ``fn`` holds a reverse pass (a Hessian's inner
    gradient), refused if that pass runs a ``@once_differentiable``
    backward (``_refuse_marked_reverse_pass``) or a backward that drops
    its incoming gradient (NOTE [a reverse pass differentiated in forward
    mode]). ``over_forward``: ``fn`` holds forward mode, and a Function's
    ``jvp`` staticmethod under both takes the double-vjp trick (NOTE [a jvp
    staticmethod under a second forward level] in forward_over_forward.py)."""
    decided = decisions(base)
    out_tangents = None
    if decided.get(("jvp", key)) != "double_vjp":
        watch = forward_over_forward.JvpStaticmethodWatch() if over_forward else None
        run = fn if watch is None else forward_over_forward.watched(fn, watch)
        try:
            if over_reverse:
                out_tangents = _jvp_over_reverse(run, primals, tangents, base=base, key=key)
            else:
                out_tangents = tuple(torch.func.jvp(run, tuple(primals), tuple(tangents))[1])
        except (RuntimeError, NotImplementedError) as err:
            if not _refused(err, _FORWARD_REFUSALS):
                raise
            _refuse_unseen_write(base, err)
            decided[("jvp", key)] = "double_vjp"
            advice = _advice(err, _FORWARD_REFUSALS)
            # Over a reverse pass that fell back to torch.autograd.grad, the
            # refusal is of that fallback's requires_grad_(), not of the user's code.
            why = (
                "its reverse pass runs on torch.autograd.grad (the reverse-mode fallback), which "
                "torch.func.jvp cannot go through"
                if over_reverse and "autograd" in {v for (kind, _), v in decided.items() if kind == "vjp"}
                else f"torch.func.jvp refused it ({first_line(err)})"
            )
            warn_once(
                base,
                "jvp",
                f"t2j_ad: forward mode of {base.name!r} falls back to the "
                f"double-vjp trick because {why}. Results are exact; it costs two "
                f"reverse passes.{advice}",
            )
        if watch is not None and watch.seen is not None:
            if not forward_over_forward.has_backward(watch.seen):
                raise forward_over_forward.no_backward_refusal(base.name, watch.seen)
            decided[("jvp", key)] = "double_vjp"
            decided[("jvp staticmethod", key)] = watch.seen
            warn_once(base, "jvp over jvp", forward_over_forward.switch_warning(base.name, watch.seen))
            out_tangents = None
    if out_tangents is None:
        function = decided.get(("jvp staticmethod", key))
        try:
            out_tangents = double_vjp_jvp(fn, primals, tangents, base=base, key=key, over_reverse=over_reverse)
        except RuntimeError as err:
            nested = any(marker in first_line(err) for marker in _NESTED_CALL_FAILED)
            if function is None or nested or not str(err).startswith("t2j_ad: "):
                raise
            raise forward_over_forward.refusal(base.name, function, err) from err
    if over_reverse:
        _refuse_marked_reverse_pass(base)
    return out_tangents


# NOTE [a reverse pass differentiated in forward mode]
# Forward mode over a reverse pass (``jax.hessian``, ``jax.jacfwd`` or
# ``jax.jvp`` of ``jax.grad``, batched or not: a TorchFn ``... + Vjp + ... +
# Jvp``) runs the reverse pass under ``torch.func.jvp``, each
# autograd.Function's backward included, on dual numbers: a Function's
# ``jvp`` staticmethod gives the tangent of its forward, never of its
# backward. A backward that leaves forward AD on its way from its incoming
# gradient ``g`` to its result (``g.detach()``, NumPy) drops ``g``'s tangent,
# which depends on the Jvp's inputs (``2 cos(x)`` for ``sin(x)**2``), and the
# second derivative lost that part, with no error, as PyTorch's own
# ``torch.func.hessian`` does. (Where ``torch.func.jvp`` refuses the pass, the
# double-vjp trick differentiates it in reverse mode, watched as NOTE [a
# reverse pass differentiated again] says.) So each reverse pass run inside
# such a ``jvp`` is watched with the double-vjp trick's walk: a hook on each
# custom Function node keeps the cotangents the backward was given and its
# results (a tangent cannot be read while the reverse pass's gradient level
# is on top), and once the pass is over, with the ``jvp`` level innermost
# again, their tangents (``forward_ad.unpack_dual``) go through the same
# test as NOTE [a backward that drops its cotangent], on the tangents in
# place of the tensors: the backward dropped a cotangent that has a tangent
# when no float result's tangent depends on that tangent. The dependence is
# seen in an autograd graph: the ``jvp`` runs inside a gradient level of its
# own at which the tangents it is given require grad
# (``functorch_levels.with_graphs_recorded``), so every tangent computed from
# them records how. A result with no tangent at all dropped it
# (``g.detach() * 2``, a tensor made anew; a backward that reads a tensor's
# memory, NumPy, makes ``torch.func.jvp`` refuse, and the double-vjp trick
# runs instead); one whose tangent records no graph was computed with
# grad mode off (``@torch.no_grad()``, ``@once_differentiable``), which does
# not stop forward AD: its tangent is right and is let through (a backward
# under ``no_grad`` that also detaches ``g`` is then not seen). Recording
# costs a level and a node per op, so a ``jvp`` starts without it, and the
# first custom Function node its reverse pass meets stops that run
# (``_TangentsNotRecorded``); the ``jvp`` runs again recording, and so does
# every later call of that transform (a decision kept on the function, so
# graph-mode traces keep it too). A ``jvp`` over a reverse pass through no
# autograd.Function pays one walk of that pass's graph.


class _TangentsNotRecorded(Exception):
    """Raised where a ``jvp`` over a reverse pass that records no tangent
    graphs meets an autograd.Function's backward: run it again recording
    (NOTE [a reverse pass differentiated in forward mode]). Not a
    RuntimeError, which the fallbacks would take for PyTorch's refusal."""

    def __init__(self, watch: _TangentWatch):
        super().__init__("t2j_ad: forward mode over a reverse pass runs again with its tangents' graphs recorded")
        self.watch = watch


class _TangentWatch:
    """The backwards that the reverse passes inside one ``jvp`` ran, with
    the cotangents they were given and their results (NOTE [a reverse pass
    differentiated in forward mode])."""

    def __init__(self, recording: bool):
        self.recording = recording
        self.backwards: list[tuple[type, tuple[Any, ...], tuple[Any, ...]]] = []
        self.ended = False

    def watch(self, node: Any, function: type) -> None:
        """Keep what ``node``'s backward is given and returns, or stop the run."""
        if not self.recording:
            raise _TangentsNotRecorded(self)

        def hook(results: Sequence[torch.Tensor | None], cotangents: Sequence[torch.Tensor | None]) -> None:
            if not self.ended:  # an outer torch.autograd.grad over the same graph runs it again
                self.backwards.append((function, tuple(cotangents), tuple(results)))

        node.register_hook(hook)

    def dropped(self) -> type | None:
        """The first Function whose backward dropped a cotangent's tangent,
        or None; read while this ``jvp``'s level is the innermost."""
        return next((f for f, given, results in self.backwards if _backward_dropped_tangent(results, given)), None)


_tangent_watches = threading.local()


def _tangent_watches_now() -> tuple[_TangentWatch, ...]:
    return getattr(_tangent_watches, "active", ())


def _jvp_over_reverse(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    primals: Sequence[torch.Tensor],
    tangents: Sequence[torch.Tensor],
    *,
    base: Any,
    key: Any,
) -> tuple[torch.Tensor, ...]:
    """``torch.func.jvp`` of the reverse pass ``fn``, refused where one of its
    backwards drops its incoming gradient's tangent (NOTE [a reverse pass
    differentiated in forward mode])."""
    decided = decisions(base)
    watch = _TangentWatch(recording=bool(decided.get(("tangent graphs", key))))
    try:
        return _watched_jvp(fn, primals, tangents, base, watch)
    except _TangentsNotRecorded as stop:
        if stop.watch is not watch:  # an outer jvp's
            raise
    decided[("tangent graphs", key)] = True
    return _watched_jvp(fn, primals, tangents, base, _TangentWatch(recording=True))


def _watched_jvp(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    primals: Sequence[torch.Tensor],
    tangents: Sequence[torch.Tensor],
    base: Any,
    watch: _TangentWatch,
) -> tuple[torch.Tensor, ...]:
    """``torch.func.jvp`` of ``fn`` with ``watch`` on its reverse passes, inside
    a gradient level of its own where ``watch`` records tangent graphs."""

    def watched(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outer = _tangent_watches_now()
        _tangent_watches.active = outer + (watch,)
        try:
            outs = fn(*xs)
            dropped = watch.dropped()
        finally:
            _tangent_watches.active = outer
            watch.ended = True
            watch.backwards.clear()  # hooks on the graph hold the watch: no cycle outlives the call
        if dropped is not None:
            raise _jvp_over_reverse_error(base, dropped, on_dual_numbers=True)
        return outs

    def jvp(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.func.jvp(watched, tuple(primals), ts)[1])

    if watch.recording:
        return functorch_levels.with_graphs_recorded(jvp, tuple(tangents))
    return jvp(*tangents)


def _backward_dropped_tangent(results: Sequence[Any], cotangents: Sequence[Any]) -> bool:
    """Whether a backward given ``cotangents`` returned ``results`` none of
    whose tangents depends on a cotangent's tangent, where one has a
    tangent: ``_backward_dropped_cotangent`` on the tangents' graphs (NOTE
    [a reverse pass differentiated in forward mode]). Read while the
    ``jvp`` level that holds the tangents is the innermost."""
    result_tangents: list[Any] = []
    for r in results:
        if not (isinstance(r, torch.Tensor) and (r.is_floating_point() or r.is_complex())):
            result_tangents.append(r)
            continue
        tangent = functorch_levels.jvp_tangent(r)
        recorded = _recording_layer(tangent)
        if tangent is not None and recorded is None:  # grad mode was off, which forward AD goes through
            return False
        result_tangents.append(_NO_TANGENT if recorded is None else recorded)
    given = [_recorded_tangent(g) if isinstance(g, torch.Tensor) else g for g in cotangents]
    return _backward_dropped_cotangent(result_tangents, given)


def _recorded_tangent(t: torch.Tensor) -> torch.Tensor:
    """``t``'s tangent at its layer that records a graph, else ``_NO_TANGENT``."""
    recorded = _recording_layer(functorch_levels.jvp_tangent(t))
    return _NO_TANGENT if recorded is None else recorded


# Stands for a tangent a tensor does not have, or one that records no graph:
# a float tensor that reaches nothing.
_NO_TANGENT = torch.zeros(())


def _recording_layer(t: torch.Tensor | None) -> torch.Tensor | None:
    """The layer of ``t`` (at any ``torch.func`` level) that requires grad, or None."""
    if t is None:
        return None
    return next((layer for layer in functorch_levels.wrapped_layers(t) if layer.requires_grad), None)


def _jvp_over_reverse_error(base: Any, function: type, on_dual_numbers: bool) -> RuntimeError:
    """The refusal of forward mode over a reverse pass through ``function``'s
    backward, run on dual numbers by ``torch.func.jvp`` (``on_dual_numbers``)
    or differentiated in reverse mode by the double-vjp trick."""
    once_differentiable = getattr(getattr(function, "backward", None), "__code__", None) is _ONCE_DIFFERENTIABLE_CODE
    if once_differentiable:
        return _once_differentiable_error(base, function.__name__)
    name = function.__name__
    with_jvp = getattr(function, "jvp", None) is not torch.autograd.Function.jvp
    jvp_note = (
        f" {name}'s jvp staticmethod does not help here: it gives the derivative of its forward, not of its "
        f"backward."
        if with_jvp
        else ""
    )
    how = (
        "its result carries none of that gradient's tangent (computed from grad.detach(), or made anew)"
        if on_dual_numbers
        else "its result does not depend on it in PyTorch's autograd graph (computed in NumPy, from "
        "grad.detach(), or under torch.no_grad())"
    )
    return RuntimeError(
        f"t2j_ad: forward mode over the reverse pass of {base.name!r} (jax.hessian, jax.jacfwd or jax.jvp of "
        f"jax.grad) differentiates the backward of {name} in its incoming gradient, but the backward of {name} "
        f"is not differentiable in its incoming gradient: {how}, so the second derivative would lose the part "
        f"that goes through it (PyTorch's torch.func.hessian loses it too, silently).{jvp_note} In {name}'s "
        f"backward, compute its result with differentiable torch ops on the incoming gradient; or take first "
        f"derivatives alone through it (jax.grad, jax.jvp). (A backward whose result for an input is truly zero "
        f"should return None for it.)"
    )


def _refuse_marked_reverse_pass(base: Any) -> None:
    """Raise if ``base``'s reverse pass runs an autograd.Function whose
    backward is ``@once_differentiable`` and that has no jvp staticmethod,
    as its first reverse pass noted. Forward mode over that reverse pass
    (a Hessian's) gave zeros without an error where torch.func.jvp went
    through it (torch 2.11 on an H200) or the double-vjp trick ran under a
    batching level, where the check on its first run cannot mark inputs as
    requiring grad; torch 2.13's torch.func.jvp refuses, and the unbatched
    double-vjp trick refuses by name."""
    marked = base.__dict__.get(_ONCE_DIFFERENTIABLE_SEEN)
    if marked:
        raise _once_differentiable_error(base, marked)


# --------------------------------------------------------------------- batching


def vmap_auto(
    vectorized: Callable[..., tuple[torch.Tensor, ...]],
    sequential: Callable[..., tuple[torch.Tensor, ...]],
    args: Sequence[torch.Tensor],
    *,
    base: Any,
    key: Any,
) -> tuple[torch.Tensor, ...]:
    """``torch.vmap``, falling back to the sequential loop when it refuses."""
    decided = decisions(base)
    if decided.get(("vmap", key)) == "sequential":
        return sequential(*args)
    try:
        return vectorized(*args)
    except Exception as vmap_err:  # noqa: BLE001 - any refusal; see below
        # torch.vmap refuses in many ways (.item(), control flow, ops without
        # batching rules, Functions without vmap rules). If the loop works the
        # refusal was about vmap; if it fails too, the loop's error is the
        # user's real error and propagates. Not an OSError: vmap refuses with
        # none, and a time limit's signal handler raises TimeoutError, which
        # the loop would have swallowed, keeping the loop for good.
        if isinstance(vmap_err, (OSError, _TangentsNotRecorded)):
            raise
        result = sequential(*args)
        decided[("vmap", key)] = "sequential"
        warn_once(
            base,
            "vmap",
            f"t2j_ad: torch.vmap refused {base.name!r} ({first_line(vmap_err)}); "
            f"batching it with a sequential loop instead. Pass "
            f"vmap_method='sequential' to silence this, or make the function "
            f"vmap-compatible for speed.",
        )
        return result
