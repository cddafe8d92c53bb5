"""``torch.vmap`` and ``torch.func.vjp`` for flat tuples of tensors.

NOTE [functorch levels]
``torch.vmap`` and ``torch.func.vjp`` are Python wrappers around functorch's
C++ interpreter stack: they flatten pytrees, validate ``in_dims``, wrap each
tensor for the new level, call the function, unwrap, and flatten again. For a
small function that glue is a large part of the call: under
``vmap(vjp(loss))`` for the MLP of benchmarks/bench_per_example_grads.py it
was about 150 of 650 microseconds, more than everything JAX adds around the
call. Every function t2j_ad builds already takes and returns flat tuples of
tensors whose batch dimensions JAX has checked, so ``vmap`` and ``vjp`` here
enter the same C++ levels ``torch.func`` enters (``torch._C._functorch``) and
skip the Python glue. PyTorch dispatches exactly the same operators, with the
same batching and autograd rules; ``tests/test_functorch_levels.py`` holds the
results against ``torch.func`` over the transforms that use them.

What ``torch.func`` does around the levels, and kept here:

- ``vjp``: grad mode on for the forward pass; differentiable inputs made
  ``requires_grad`` at the new level (which functorch allows only inside
  ``set_inplace_requires_grad_allowed``); saved-tensor hooks refused with
  functorch's own message; outputs must be floating point or complex; outputs
  that do not require grad get no cotangent, and inputs without a gradient get
  zeros (``_autograd_grad``). The gradient is taken inside the level with
  ``create_graph=True``, as ``torch.func.grad`` does, so outer levels
  (``jvp`` for Hessians, an outer ``vjp``) can differentiate it.
- ``vmap``: ``randomness="error"`` unless the caller asks for ``"same"`` (a
  replay over tangents: NOTE [derivatives replay the value's draws] in
  replayed_calls.py), batch dimensions added to the batched
  inputs only (unbatched ones are captured, never copied), and every output
  given its batch dimension at 0 (an output that does not depend on the batch
  is expanded, as ``torch.vmap`` does).

``FAST`` is False when this PyTorch lacks one of the private functions used
or they fail a one-time check against ``torch.func`` at import (a tiny
per-example gradient both ways; a PyTorch that changed them warns once), and
when ``T2J_AD_FUNCTORCH_FAST=0``; the public ``torch.vmap`` /
``torch.func.vjp`` then run instead, with the same results. Under inference
mode, which ``torch.func`` handles specially, each call takes the public path.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.func
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from .env_switch import env_switch

Flat = Callable[..., tuple[torch.Tensor, ...]]


def _switch() -> bool:
    return env_switch(
        "T2J_AD_FUNCTORCH_FAST",
        on="enter functorch's levels directly",
        off="always use torch.vmap / torch.func.vjp",
    )


try:  # The private API of torch 2.x; see NOTE [functorch levels].
    from torch._C import _functorch as _levels
    from torch._functorch.vmap import lazy_load_decompositions as _load_decompositions

    _add_batch_dim = _levels._add_batch_dim
    _remove_batch_dim = _levels._remove_batch_dim
    _vmap_increment_nesting = _levels._vmap_increment_nesting
    _vmap_decrement_nesting = _levels._vmap_decrement_nesting
    _grad_increment_nesting = _levels._grad_increment_nesting
    _grad_decrement_nesting = _levels._grad_decrement_nesting
    _wrap_for_grad = _levels._wrap_for_grad
    _unwrap_for_grad = _levels._unwrap_for_grad
    _allow_requires_grad = _levels.set_inplace_requires_grad_allowed
    _requires_grad_allowed = _levels.get_inplace_requires_grad_allowed
    _hooks_message = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message
    _hooks_disable = torch._C._autograd._saved_tensors_hooks_disable
    _hooks_enable = torch._C._autograd._saved_tensors_hooks_enable
    _AVAILABLE = True
except (ImportError, AttributeError):
    _AVAILABLE = False

# Private: the open torch.func transforms, outermost first; without it no
# level is seen (and no jvp staticmethod is seen under two forward levels).
try:
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters as _all_interpreters
    from torch._functorch.pyfunctorch import temporarily_pop_interpreter_stack as _pop_interpreter
except ImportError:
    _all_interpreters = _pop_interpreter = None
# Private: the operator an autograd.Function's apply calls inside torch.func
# transforms, with the Function's class first; a TorchFunctionMode sees it.
try:
    from torch._functorch.autograd_function import custom_function_call
except ImportError:
    custom_function_call = None

FAST: bool = False  # decided at the bottom of this module

_inference_mode = torch.is_inference_mode_enabled
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_zeros_like = torch.zeros_like

# torch.func's message, so a saved-tensor hook fails the same way on both paths.
_HOOKS_REFUSED = (
    "torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks. "
    "Please open an issue with your use case."
)


def _public_vmap(
    fn: Flat, args: Sequence[torch.Tensor], in_dims: tuple[int | None, ...], randomness: str
) -> tuple[torch.Tensor, ...]:
    return tuple(torch.vmap(fn, in_dims=in_dims, out_dims=0, randomness=randomness)(*args))


def vmap(
    fn: Flat, args: Sequence[torch.Tensor], in_dims: tuple[int | None, ...], size: int, randomness: str = "error"
) -> tuple[torch.Tensor, ...]:
    """``torch.vmap(fn, in_dims, out_dims=0, randomness=randomness)(*args)``;
    ``size`` is the batch size.

    ``in_dims`` are nonnegative, and at least one is not None.
    """
    if FAST and not _inference_mode():
        return _direct_vmap(fn, args, in_dims, size, randomness)
    return _public_vmap(fn, args, in_dims, randomness)


def _direct_vmap(
    fn: Flat, args: Sequence[torch.Tensor], in_dims: tuple[int | None, ...], size: int, randomness: str = "error"
) -> tuple[torch.Tensor, ...]:
    level = _vmap_increment_nesting(size, randomness)
    try:
        batched = [a if d is None else _add_batch_dim(a, d, level) for a, d in zip(args, in_dims)]
        outs = fn(*batched)
        return tuple([_remove_batch_dim(o, level, size, 0) for o in outs])
    finally:
        _vmap_decrement_nesting()


def _public_vjp(fn: Flat, primals: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    _, pullback = torch.func.vjp(fn, *primals)
    return tuple(pullback(tuple(cotangents)))


def _check_outputs(outs: Sequence[object]) -> None:
    for o in outs:
        if not isinstance(o, torch.Tensor):
            raise RuntimeError(f"vjp(f, *primals): Expected f to return tensors, got {type(o).__name__}")
        if not (o.is_floating_point() or o.is_complex()):
            # torch.func.vjp's check and wording.
            raise RuntimeError(
                "vjp(f, ...): All outputs of f must be floating-point or complex Tensors, "
                f"got Tensor with dtype {o.dtype}"
            )


def autograd_grad(
    outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad`` of ``outs`` with ``cotangents``, differentiable again.

    Outputs that do not require grad get no cotangent (all of them: every
    gradient is None), and None stands for an input without a gradient, as
    in ``torch.func``'s ``_autograd_grad``; callers turn it into zeros.
    """
    pairs = [(o, c) for o, c in zip(outs, cotangents) if o.requires_grad]
    if not pairs:
        return (None,) * len(inputs)
    return torch.autograd.grad(
        [o for o, _ in pairs],
        inputs,
        [c for _, c in pairs],
        create_graph=True,
        allow_unused=True,
    )


def vjp(fn: Flat, primals: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The cotangents of ``primals``: ``torch.func.vjp(fn, *primals)[1](cotangents)``.

    Runs with grad mode on, as t2j_ad's transformed calls do (see
    runtime.py); the result can be differentiated again by outer levels.
    """
    if FAST and not _inference_mode():
        return _direct_vjp(fn, primals, cotangents)
    return _public_vjp(fn, primals, cotangents)


def _direct_vjp(fn: Flat, primals: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    previous_message = _hooks_message()
    _hooks_disable(_HOOKS_REFUSED)
    level = _grad_increment_nesting()
    previous_grad = _is_grad_enabled()
    try:
        _set_grad_enabled(True)
        inputs = [_wrap_for_grad(p, level) for p in primals]
        allowed = _requires_grad_allowed()
        _allow_requires_grad(True)
        try:
            for x in inputs:
                x.requires_grad_()
        finally:
            _allow_requires_grad(allowed)
        outs = fn(*inputs)
        _check_outputs(outs)
        grads = autograd_grad(outs, inputs, cotangents)
        # Zeros for inputs without a gradient are made from the wrapped input
        # and unwrapped like any gradient, as torch.func.vjp does: zeros_like
        # of an outer primal made while this grad level is on top escaped a
        # batching level when that primal was batched (vmap of vjp of vjp),
        # and make_fx could not follow it either (graph mode baked it in as
        # an uninitialised constant).
        return tuple([_unwrap_for_grad(_zeros_like(x) if g is None else g, level) for g, x in zip(grads, inputs)])
    finally:
        _set_grad_enabled(previous_grad)
        _grad_decrement_nesting()
        if previous_message is None:
            _hooks_enable()
        else:
            _hooks_disable(previous_message)


def unbatched_value(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor under ``t``'s ``torch.func`` wrappers (inside a
    gradient transform, every op's result is wrapped at its level), or None
    when one of them is ``torch.vmap``'s: then ``t`` holds one value per
    example, not one value."""
    functorch = torch._C._functorch  # private
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return None
        t = functorch.get_unwrapped(t)
    return t


def wrapped_layers(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t``, then each tensor under its ``torch.func`` wrappers, outermost
    first: each layer's autograd graph is that of its level, and a
    dependence recorded at an outer level is seen only on the layer under
    the inner levels' wrappers (NOTE [a backward that drops its cotangent]
    in rules/fallbacks.py)."""
    functorch = torch._C._functorch  # private
    yield t
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
        yield t


def jvp_tangent(t: torch.Tensor) -> torch.Tensor | None:
    """The tangent that the innermost ``torch.func`` level, a ``jvp`` level,
    holds for ``t`` (at ``t``'s layer of that level), or None where it holds
    none. ``t`` may come from levels above that have already ended (a
    backward's gradient, kept by a hook of the reverse pass the ``jvp``
    ran): their dead wrappers are passed over. Read while another level is
    on top, the tangent would not be seen (under a gradient level) or the
    read would fail (under a batching level): NOTE [a reverse pass
    differentiated in forward mode] in rules/fallbacks.py."""
    level = innermost_jvp_level()
    if level is None:
        return None
    layer = next((x for x in wrapped_layers(t) if torch._C._functorch.maybe_get_level(x) == level), None)
    return None if layer is None else torch.autograd.forward_ad.unpack_dual(layer).tangent


def innermost_jvp_level() -> int | None:
    """The level of the innermost ``torch.func`` transform when it is a
    ``jvp``, else None."""
    functorch = torch._C._functorch  # private
    top = functorch.peek_interpreter_stack()
    return top.level() if top is not None and top.key() == functorch.TransformType.Jvp else None


def jvp_levels_of(tensors: Sequence[object]) -> set[int]:
    """The levels of the ``jvp`` transforms now open at which one of
    ``tensors`` is a dual number with a tangent (its layer of that level,
    under the inner levels' wrappers, read with those levels popped: read
    under them, no tangent of an outer level shows; a tensor an inner
    ``jvp`` lifted through an outer level has a layer there but no
    tangent): NOTE [a jvp staticmethod under a second forward level] in
    rules/forward_over_forward.py."""
    functorch = torch._C._functorch  # private
    if _all_interpreters is None or _pop_interpreter is None:
        return set()
    layers = [
        (functorch.maybe_get_level(layer), layer)
        for t in tensors
        if isinstance(t, torch.Tensor)
        for layer in wrapped_layers(t)
    ]
    found = set()
    with contextlib.ExitStack() as popped:
        for interpreter in reversed(_all_interpreters()):  # innermost first
            level = interpreter.level()
            if interpreter.key() == functorch.TransformType.Jvp and any(
                at == level and torch.autograd.forward_ad.unpack_dual(layer).tangent is not None
                for at, layer in layers
            ):
                found.add(level)
            popped.enter_context(_pop_interpreter())
    return found


def with_graphs_recorded(fn: Flat, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``fn(*tensors)``, run inside a gradient level of its own at which
    each floating-point or complex tensor of ``tensors`` requires grad: all
    that ``fn`` computes from them records its autograd graph at that level,
    which no backward ever runs (``torch.func.vjp`` without its pullback).
    The outputs come back below the level."""
    floats = [i for i, t in enumerate(tensors) if t.is_floating_point() or t.is_complex()]
    if not floats:
        return fn(*tensors)

    def on_floats(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        full = list(tensors)
        for i, v in zip(floats, values):
            full[i] = v
        return fn(*full)

    outs, _ = torch.func.vjp(on_floats, *[tensors[i] for i in floats])
    return tuple(outs)


def innermost_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor under all of ``t``'s ``torch.func`` wrappers, ``torch.vmap``'s
    included (then one value per example, along a batch dimension). A
    wrapper outlives its level: one a function keeps in a dict after a
    gradient transform ended still holds the tensor it wrapped, which a
    ``make_fx`` trace recorded (NOTE [an added entry's wrappers] in
    graph_mode.py)."""
    functorch = torch._C._functorch  # private
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def user_function(node_class: type | None) -> type | None:
    """The user's ``autograd.Function`` behind an autograd node's
    ``_forward_cls``: inside a ``torch.func`` transform that is the class
    functorch generates per level (``<Name>Generated``), whose ``backward``
    calls the user's from its closure (``autograd_function``)."""
    backward = getattr(node_class, "backward", None)
    if node_class is None or not getattr(node_class, "__name__", "").endswith("Generated"):
        return node_class
    names = getattr(getattr(backward, "__code__", None), "co_freevars", ())  # private layout
    if "autograd_function" in names:
        cell = backward.__closure__[names.index("autograd_function")]
        found = cell.cell_contents
        if isinstance(found, type) and issubclass(found, torch.autograd.Function):
            return found
    return node_class


def outside_transforms() -> contextlib.AbstractContextManager[None]:
    """Within the block, ops on tensors make plain tensors even inside
    ``torch.func`` transforms, which otherwise wrap every result at their
    level (a wrapped tensor has no storage to read bytes from)."""
    disable = getattr(torch._C, "_DisableFuncTorch", None)  # private
    return disable() if disable is not None else contextlib.nullcontext()


# Whether this thread is inside a torch.func transform: one C check per call
# (40 ns), made by every runner call (NOTE [a call inside torch.func
# transforms]). Private; a PyTorch without it has no levels to leave.
functorch_levels_open: Callable[[], bool] = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


class _OuterWrappersRefused(TorchFunctionMode):
    """Raises ``refusal()`` at an op, made outside every ``torch.func``
    level, that takes a tensor one of them wrapped: a tensor of the levels
    taken off the stack, whose derivative or batch the op would drop."""

    def __init__(self, refusal: Callable[[], BaseException]) -> None:
        super().__init__()
        self._refusal = refusal

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if torch._C._functorch.peek_interpreter_stack() is None and any(  # private
            isinstance(a, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(a)
            for a in pytree.tree_leaves((args, kwargs))
        ):
            raise self._refusal()
        return func(*args, **kwargs)


@contextlib.contextmanager
def outside_functorch_levels(refusal: Callable[[], BaseException]) -> Iterator[None]:
    """Within the block, no ``torch.func`` level is open on this thread: the
    levels around it are taken off functorch's stack, and put back, the same
    objects, when it ends; an op outside any level that takes a tensor they
    wrapped raises ``refusal()`` (NOTE [a call inside torch.func transforms]
    in runtime.py)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack  # private

    with temporarily_clear_interpreter_stack(), _OuterWrappersRefused(refusal):
        yield


@contextlib.contextmanager
def dispatch_keys_kept() -> Iterator[None]:
    """The thread's dispatch keys, included and excluded, as they were before
    the block, also after it failed.

    NOTE [a failed trace's dispatch keys]
    A graph-mode trace of jax.jvp over a module that updates a buffer with
    ``lerp_(end, <tensor weight>)`` under no_grad failed inside PyTorch (an
    INTERNAL ASSERT in ``_fw_primal``) and left the calling thread with
    ADInplaceOrView, Autograd, Functionalize, the functorch and Python keys
    excluded: from then on the eager fallback, and every ``torch.func.jvp``
    on that thread, t2j_ad's or not, hit the same assert. The keys were set
    by a guard object in one of the error's frames, which, freed with the
    error after the trace had returned, put back what it had saved inside
    the failed op. So a trace frees its error's frames before it ends
    (``_free_frames``: the message stays, the frames' locals go), then puts
    the thread's local dispatch key sets back where they changed.
    """
    tls = torch._C
    included, excluded = tls._dispatch_tls_local_include_set(), tls._dispatch_tls_local_exclude_set()
    try:
        yield
    except BaseException as err:
        _free_frames(err)
        raise
    finally:
        now_in, now_ex = tls._dispatch_tls_local_include_set(), tls._dispatch_tls_local_exclude_set()
        if (now_in.raw_repr(), now_ex.raw_repr()) != (included.raw_repr(), excluded.raw_repr()):
            for key in torch._C.DispatchKey.__members__.values():
                if now_ex.has(key) != excluded.has(key):
                    tls._dispatch_tls_set_dispatch_key_excluded(key, excluded.has(key))
                if now_in.has(key) != included.has(key):
                    tls._dispatch_tls_set_dispatch_key_included(key, included.has(key))


@contextlib.contextmanager
def forward_ad_levels_kept() -> Iterator[None]:
    """PyTorch's forward-AD levels as they were before the block, also after
    it failed.

    NOTE [an interrupt inside forward AD]
    ``torch.autograd.forward_ad`` keeps its current level twice: in C++,
    and in the module variable ``_current_level``, set in Python right after
    the C++ call that enters or exits a level. A ``KeyboardInterrupt`` (or a
    signal handler's exception) landing between the two in a ``jax.jacfwd``
    call left them apart, and from then on every ``torch.func.jvp``,
    ``jacfwd`` and ``hessian`` in the process failed ("Entering a new
    forward AD level but the current level is not valid"), and t2j_ad's
    forward mode fell back to reverse mode for good, blaming the user's
    function. So a forward-mode call that fails, entered with no level
    current, exits the level C++ may still hold (it holds one at a time) and
    sets ``_current_level`` back. Calls that enter forward AD run one at a
    time (NOTE [forward AD is process-wide] in runtime.py), so no other
    call's level is among them.
    """
    from torch.autograd import forward_ad

    level = forward_ad._current_level
    try:
        yield
    except BaseException:
        if level == -1:
            try:
                torch._C._exit_dual_level(level=0)
            except RuntimeError:  # none held: only the Python side was off
                pass
            forward_ad._current_level = -1
        raise


def _free_frames(err: BaseException) -> None:
    """Drop the locals of the frames ``err`` and the exceptions it chains
    hold: a guard object PyTorch keeps in a local sets the dispatch keys it
    saved when it is freed, which would otherwise be whenever ``err`` is."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__


def direct_path_works() -> bool:
    """Whether the direct path computes a tiny per-example gradient as ``torch.func`` does."""
    try:
        w = torch.linspace(-1.0, 1.0, 3, dtype=torch.float64)
        x = torch.linspace(0.0, 2.0, 6, dtype=torch.float64).reshape(2, 3)

        def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x * w).sum()

        def grad(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return _direct_vjp(lambda w: (loss(w, x),), (w,), (torch.ones((), dtype=w.dtype),))

        got = _direct_vmap(grad, (w, x), (None, 0), 2)[0]
        expected = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, x)
        return got.shape == expected.shape and bool(torch.allclose(got, expected))
    except Exception:  # noqa: BLE001 - any failure means: do not use it
        return False


if _AVAILABLE and _switch():
    # torch.vmap registers Python decompositions (batching rules of ops that
    # have none in C++) on its first call, which the direct path never makes.
    _load_decompositions()
    FAST = direct_path_works()
    if not FAST:
        warnings.warn(
            f"t2j_ad: PyTorch {torch.__version__}'s private functorch functions did not "
            f"compute a test gradient as torch.func does; t2j_ad uses the public "
            f"torch.vmap / torch.func.vjp instead (same results, more time per call). "
            f"Set T2J_AD_FUNCTORCH_FAST=0 to silence this.",
            RuntimeWarning,
            stacklevel=2,
        )
