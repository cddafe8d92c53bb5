"""The training flags of the modules a trace ran: one graph per setting.

NOTE [a graph per training mode]
A module's ``forward`` reads ``self.training`` in Python (``Dropout``,
``BatchNorm``, any module of your own), so a trace keeps the branch of the
flag it saw. A graph traced in training mode kept dropping out and
normalizing by batch statistics after ``module.eval()``, where eager calls
follow the flag. So while a function is traced, PyTorch's global forward
pre-hook records every module whose ``forward`` runs on the tracing thread,
with its flag, and the graph is used only while those flags hold: a call that
finds one changed looks up, or traces, the graph for the flags as they are
now (``torch.compile`` guards on the same flag). Checking costs one attribute
read per recorded module per call, and nothing for functions that call no
module. A module whose method the function calls directly (``jaxify(
model.forward)``, ``model.encode(x)`` reading ``self.training``) runs no
hook, so the modules the function refers to (a bound method's ``self``, the
modules its code names from its closure, globals or default arguments,
those of a ``functools.partial``, and those in a dict, list, tuple or plain
object it names: ``referenced_modules``) are recorded too, each with its
submodules (a method may read ``self.head.training``), with their flags when
the trace starts. Other Python state a function reads (a global number, an
attribute of its own) is read once per trace, as under ``jax.jit``.

NOTE [a dropout's rate is part of its mode]
A dropout module reads its rate ``p`` in Python as it reads its flag, and a
notebook sets it between calls (``model.drop.p = 0.5`` where it was 0.0,
to turn dropout on). Unseen, a graph kept the rate it was traced with, and
eager derivatives of a function that drew nothing at ``p = 0`` drew afresh
at 0.5 rather than replaying the value's draws: ``jax.value_and_grad`` took
the gradient through another mask than the value's (off by 0.67),
silently. So the mode of a dropout module (``nn.Dropout`` and its kin) is
its flag and its rate, and that of a ``MultiheadAttention`` its flag and
its ``dropout``: a changed rate is a changed mode, with a graph and effects
of its own. Checking costs one tuple made per such module per call; a
module of any other kind is checked by its flag alone, as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.modules.lazy import LazyModuleMixin

from .module_hooks import own_global_hooks
from .references import reachable

# A module's mode: its training flag, and for a dropout its rate too
# (NOTE [a dropout's rate is part of its mode]).
Mode = bool | tuple[bool, float]
# Each module a trace ran, with its mode then, in the order they ran.
ModuleModes = tuple[tuple[torch.nn.Module, Mode], ...]

# The modules whose forward reads a rate of dropout, and that attribute's name.
_RATED = ((torch.nn.modules.dropout._DropoutNd, "p"), (torch.nn.MultiheadAttention, "dropout"))


def mode_of(module: torch.nn.Module) -> Mode:
    """``module``'s training flag, with its rate of dropout where its
    forward reads one (NOTE [a dropout's rate is part of its mode])."""
    training = bool(module.training)
    for kind, rate in _RATED:
        if isinstance(module, kind):
            return training, getattr(module, rate)
    return training



class UninitializedModuleError(ValueError):
    """A lazy module (``nn.LazyLinear``) first ran in a trial run."""


def refuse_uninitialized(module: torch.nn.Module) -> None:
    """Raise ``UninitializedModuleError`` if ``module`` is a lazy module
    that has not made its parameters yet."""
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        # The trial run that infers shapes, or traces, puts PyTorch's
        # generators back afterwards: every lazy layer would draw the same
        # initial weights, and on the meta device none at all.
        raise UninitializedModuleError(
            f"t2j_ad: the lazy module {type(module).__name__} has not made its parameters yet. t2j_ad "
            f"first runs a function on stand-in inputs, which would make them from those, on their "
            f"device, with PyTorch's random generators put back afterwards. Run the module once in "
            f"PyTorch on an example input before calling it from JAX (model(torch.zeros(batch, features)))."
        )


class _Recorder:
    """The modules whose ``forward`` ran on one thread, and their flags."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.seen: dict[int, tuple[torch.nn.Module, bool]] = {}

    def __call__(self, module: torch.nn.Module, args: object) -> None:
        if threading.get_ident() == self.thread and id(module) not in self.seen:
            refuse_uninitialized(module)
            self.seen[id(module)] = (module, mode_of(module))

    def modes(self) -> ModuleModes:
        return tuple(self.seen.values())


def referenced_modules(fn: Callable[..., Any]) -> tuple[torch.nn.Module, ...]:
    """The modules ``fn`` refers to: itself, a bound method's ``self``, what
    its code names from its closure, globals or default arguments (and the
    modules in a dict, list, tuple or plain object it names), and a
    ``functools.partial``'s function and arguments (NOTE [a graph per
    training mode]; ``references.reachable``)."""
    return tuple(reachable(fn, lambda obj: isinstance(obj, torch.nn.Module)))


@contextlib.contextmanager
def recording_module_modes(referenced: Sequence[torch.nn.Module] = ()) -> Iterator[_Recorder]:
    """Within the block, record the modules whose ``forward`` runs on this
    thread (``.modes()`` of what it yields), and the ``referenced`` ones
    with their flags now."""
    recorder = _Recorder()
    for module in referenced:
        # With its submodules: model.encode(x) may read self.head.training.
        for sub in module.modules():
            recorder(sub, ())
    with own_global_hooks(forward_pre=recorder):
        yield recorder


def modes_hold(modes: ModuleModes) -> bool:
    """Whether every recorded module still has the mode it had: its
    training flag, and a dropout's rate too."""
    for module, mode in modes:
        if module.training is mode:  # the common case: one flag, unchanged
            continue
        if mode.__class__ is bool:
            if bool(module.training) != mode:
                return False
        elif mode_of(module) != mode:
            return False
    return True
