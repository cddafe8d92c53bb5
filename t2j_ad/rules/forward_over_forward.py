"""Forward mode over forward mode through an autograd.Function's ``jvp`` staticmethod.

NOTE [a jvp staticmethod under a second forward level]
PyTorch runs an ``autograd.Function``'s ``jvp`` staticmethod with forward AD
off (``torch._C._is_fwd_grad_enabled()`` is False inside it, at every
level), so the tangent it returns carries no tangent of an outer forward
level: forward mode over forward mode (``jax.jacfwd(jax.jacfwd(f))``,
``jax.jvp`` of ``jax.jvp``, ``jax.jvp`` of ``jax.jvp(jax.grad(f))``, jet:
a TorchFn with two ``Jvp``, whatever lies between them) lost every part of
the second derivative that goes through that formula, its dependence on
the primal and on the inner tangent alike (``sin`` with ``jvp`` ``cos(x) *
t``: ``jax.jacfwd(jax.jacfwd(f))`` came out 0, not ``-sin(x)``), with no
error; ``torch.func.jacfwd(torch.func.jacfwd(f))`` gives the same zeros.
Grad mode stays on in the formula, so a reverse level over it records it,
and reverse mode over forward mode (``jax.jacrev(jax.jacfwd(f))``) is right.
So a ``Jvp`` over another one (``over_forward``) runs ``torch.func.jvp``
with a watch (``JvpStaticmethodWatch``, a TorchFunctionMode entered at the
start of its level) that sees each Function's call (functorch's
``custom_function_call``, the Function's class first) and notes one that
has a ``jvp`` staticmethod and an input that is a dual number with a
tangent at this level and at a ``jvp`` level inside it (each level's
tangent read with the levels inside it popped, under which it does not
show; an inner ``jvp`` lifts its primal through the outer levels, a layer
there with no tangent, which does not count): the inner level's formula
is lost to this one. Then that ``Jvp`` takes the double-vjp trick instead (NOTE [fallbacks]
in fallbacks.py: two reverse passes, over which the formula is
differentiated right), on that call (run again) and on every later call of
that transform (a decision kept on the function), with one warning; a
Function with no ``backward`` of its own gives the trick nothing to
differentiate, and is refused by name (``no_backward_refusal``). A
Function whose input is no dual number at this level (a closed-over input,
``jax.jacfwd`` in ``w`` of ``jax.jacfwd`` in ``x``), or at none inside it,
loses nothing and changes nothing. The trick differentiates the Function's
backward in its incoming gradient; where that backward is not
differentiable there, the trick's refusal is raised with this cause named
(``refusal``): reverse mode for the outer order avoids both. (A Function
whose jvp and backward disagree, a straight-through estimator or a
gradient reversal, then gets the outer order from its backward, as
``jax.jacrev(jax.jacfwd(f))`` does, even where its formula ignores the
primal and nothing would be lost: the warning says so. Not watched: a
``torch.func.jvp`` the user's function makes itself, under a first-order
JAX ``jvp``, which loses the same part, as ``torch.func`` alone does.)
First-order calls, and a second order whose inner order is reverse mode
(``jax.hessian``), run no watch; a watched call pays the mode's dispatch
of each op (6% of a bare ``torch.func.jvp`` of ``jvp`` of a 4-layer MLP;
within noise through ``jax.jit``), and nothing once the trick is decided.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from .. import functorch_levels

Flat = Callable[..., tuple[torch.Tensor, ...]]


class JvpStaticmethodWatch(TorchFunctionMode):
    """Notes, in ``seen``, the first autograd.Function with a ``jvp``
    staticmethod called on a dual number of this watch's level and of a
    ``jvp`` level inside it (NOTE [a jvp staticmethod under a second
    forward level])."""

    def __init__(self) -> None:
        super().__init__()
        self.level: int | None = None
        self.seen: type | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is functorch_levels.custom_function_call and self.seen is None and self.level is not None:
            function = args[0]
            if getattr(function, "jvp", None) is not torch.autograd.Function.jvp:
                levels = functorch_levels.jvp_levels_of([*args[1:], *(kwargs or {}).values()])
                if self.level in levels and max(levels) > self.level:
                    self.seen = function
        return func(*args, **(kwargs or {}))


def watched(fn: Flat, watch: JvpStaticmethodWatch) -> Flat:
    """``fn``, run with ``watch`` on, at the level of the ``torch.func.jvp``
    that calls it."""

    def watching(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        watch.level = functorch_levels.innermost_jvp_level()
        with watch:
            return fn(*xs)

    return watching


def has_backward(function: type) -> bool:
    """Whether ``function`` defines a ``backward`` (or ``vjp``) of its own,
    from which the double-vjp trick could take the outer level."""
    base = torch.autograd.Function
    return function.backward is not base.backward or function.vjp is not base.vjp


def _lost_through(name: str, function: type) -> str:
    """What the refusals say first: why the outer forward level of ``name``
    cannot go through ``function``'s ``jvp`` staticmethod."""
    return (
        f"t2j_ad: forward mode of {name!r} over its forward mode (jax.jacfwd(jax.jacfwd(f)), jax.jvp of "
        f"jax.jvp) goes through the jvp staticmethod of {function.__name__}, which PyTorch runs with forward "
        f"AD off, so the outer forward level would lose its derivative (torch.func.jacfwd(torch.func.jacfwd(f)) "
        f"does, silently)"
    )


def no_backward_refusal(name: str, function: type) -> RuntimeError:
    """The error of forward mode over forward mode through ``function``'s
    ``jvp`` staticmethod where ``function`` has no ``backward``."""
    return RuntimeError(
        f"{_lost_through(name, function)}; t2j_ad takes that level from two reverse passes instead, but "
        f"{function.__name__} defines no backward. Define backward (and setup_context's save_for_backward) on {function.__name__}, "
        f"or write its forward with torch ops and no autograd.Function."
    )


def switch_warning(name: str, function: type) -> str:
    """The warning of a ``Jvp`` that takes the double-vjp trick for ``function``."""
    return (
        f"t2j_ad: forward mode of {name!r} over its forward mode (jax.jacfwd(jax.jacfwd(f)), jax.jvp of "
        f"jax.jvp) falls back to the double-vjp trick because it goes through the jvp staticmethod of "
        f"{function.__name__}, which PyTorch runs with forward AD off: an outer forward level would lose its "
        f"derivative (torch.func.jacfwd(torch.func.jacfwd(f)) does, silently). Results are exact where its "
        f"backward agrees with its jvp (the outer order is taken from the backward, as "
        f"jax.jacrev(jax.jacfwd(f)) takes it); it costs two reverse passes. Reverse mode for the outer order "
        f"(jax.jacrev(jax.jacfwd(f)), jax.hessian) avoids it."
    )


def refusal(name: str, function: type, err: RuntimeError) -> RuntimeError:
    """The double-vjp trick's refusal ``err``, with why it ran: ``function``'s
    ``jvp`` staticmethod under a second forward level."""
    return RuntimeError(
        f"{_lost_through(name, function)}. t2j_ad takes that level from two reverse passes instead, which differentiate "
        f"backwards in their incoming gradients, but {_refused_backward(err)}. Take the outer derivative in "
        f"reverse mode (jax.jacrev(jax.jacfwd(f)), or jax.hessian), or compute that backward with "
        f"differentiable torch ops on its incoming gradient."
    )


def _refused_backward(err: RuntimeError) -> str:
    """The clause of the double-vjp trick's refusal ``err`` that names the
    backward and why it is refused (fallbacks.py's messages), else all of it."""
    text = str(err)
    start = text.find("the backward of ")
    ends = [i for i in (text.find(", so ", start), text.find(": forward mode would", start)) if i > start]
    return text[start : min(ends)] if start >= 0 and ends else text
