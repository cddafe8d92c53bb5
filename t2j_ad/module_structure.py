"""Whether the modules a function refers to still hold the submodules,
parameters and buffers they held when its signature was resolved.

NOTE [a submodule replaced after a call]
What a function does besides computing its outputs (its draws and state
writes: NOTE [derivatives replay the value's draws] in replayed_calls.py) is
learnt once per input signature, by the run that infers its shapes. Swapping
a submodule afterwards (``model.drop = nn.Dropout(0.5)`` where an
``Identity`` was, a fresh ``BatchNorm``) changed it, unseen: the gradient
was taken through another dropout mask than the value's, or the new
running statistics were updated twice per step, silently. So a resolved
signature remembers the structure of the modules the function refers to,
and a call that finds it changed resolves the signature again (and a
program ``jax.jit`` compiled before is refused by its derivative calls, as
after a change of training mode).

Comparing the structure on every call would walk every submodule. Instead,
PyTorch's global registration hooks count every submodule, parameter or
buffer registered anywhere (assigning one to a module registers it), and
only a call that finds the count moved compares the structure: one integer
compare per call otherwise. Deleting an attribute (``del model.drop``)
registers nothing and is not seen; neither is a Python flag the function
reads.

NOTE [a submodule switched by name]
A module may hold one of its submodules under a second name and switch it
(``self.active = self.heads[1]``, ``self.act = self.drop if self.noisy
else self.ident``): assigning a module registers it, so the count moves,
but ``modules()`` yields each module once, so the walk found the same
modules and took nothing for changed: a graph kept the old head, and
eager derivatives drew where the value had not. So the structure holds
each module's children by name too. A forward that switches the name
itself, by a flag it reads, switches it in the value's call, after the
derivative's rule was traced: that first ``value_and_grad`` after the flag
changed is refused, and the next one is right. The global hooks are part of it even
for a function that names no module (one that makes its module inside,
or reaches it two objects down), since they run on every module.

NOTE [a hook added after a call]
A module hook is part of what the module does: a forward hook that applies
dropout to the output, or updates a running statistic, registered after the
function's first call (on one of its modules, or for every module with
``register_module_forward_hook``), changed what the function draws and
writes unseen, like a submodule swapped: ``jax.value_and_grad`` took the
gradient through another mask than the value's, and a hook writing state
was refused with reasons that did not apply. So the structure holds the
forward, forward-pre, backward and backward-pre hooks of each submodule and
the global ones (but t2j_ad's own, which its trial runs and replays add for
a while: module_hooks.py), and every hook registered anywhere but by t2j_ad
moves a count too (PyTorch numbers each ``RemovableHandle``), so a call
compares the structure only after one was.

NOTE [a hook removed after a call]
A hook removed registers nothing, and was first not seen: the function
then draws or writes less than its signature says, which replays nothing
wrong in eager mode. But in graph mode the plain call's graph, traced
with the hook, kept running it, while a derivative traced afresh ran
without it: ``jax.value_and_grad`` gave the value of one function and the
gradient of another, silently. So the structure also remembers where each
hook it holds is (a module's table and the handle's id:
``module_hooks.user_hook_places``), and every call looks that each is
still there: one dict lookup per hook, nothing for modules without hooks.
A call that finds one gone resolves the signature again, as after a hook
added; a graph traced before is then not used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.modules.module as _module_hooks  # public: torch.nn.modules.module.register_module_*_hook

from .module_hooks import hooks_still_in_place, user_hook_ids, user_hook_places, user_hooks_registered
from .named_bindings import BindingsSeen

# How many submodules, parameters and buffers have been registered on any
# module since import; read without a lock (a stale read only costs a walk).
_registered = [0]


def _count(*_: Any) -> None:
    _registered[0] += 1


_module_hooks.register_module_module_registration_hook(_count)
_module_hooks.register_module_parameter_registration_hook(_count)
_module_hooks.register_module_buffer_registration_hook(_count)


def _registrations() -> tuple[int, int]:
    """How many submodules, parameters and buffers, and how many hooks, have
    been registered so far (NOTE [a hook added after a call])."""
    return _registered[0], user_hooks_registered()


def _submodules(modules: Sequence[Any]) -> list[Any]:
    """Every submodule of ``modules``, each root's in order."""
    return [sub for root in modules for sub in root.modules()]


def _structure(modules: Sequence[Any]) -> tuple[Any, ...]:
    """Each submodule of ``modules`` (by identity) with the names of its
    parameters and buffers, in order, each of its children by name (NOTE [a
    submodule switched by name]), and its hooks; and the global hooks, which
    reach modules the function makes or does not name too."""
    return (
        *(
            (
                id(sub),
                tuple(sub._parameters.keys()),
                tuple(sub._buffers.keys()),
                tuple((name, id(child)) for name, child in sub._modules.items()),
                user_hook_ids(sub),
            )
            for sub in _submodules(modules)
        ),
        user_hook_ids(None),
    )


class ModuleChangedError(TypeError):
    """A module changed after ``jaxify_module`` so that a call cannot run it
    as asked (a parameter ``params`` names is gone); raised as it is, also
    from the runs that infer output shapes."""


class StructureSeen:
    """The structure of ``modules`` now, and what the names ``bindings``
    remembers hold (NOTE [a name rebound after a call] in named_bindings.py);
    ``holds()`` says whether both still are as they were."""

    __slots__ = ("_modules", "_registered", "_structure", "_hooks", "_bindings")

    def __init__(self, modules: Sequence[Any], bindings: BindingsSeen | None = None) -> None:
        self._modules = tuple(modules)
        self._registered = _registrations()
        self._structure = _structure(self._modules)
        # NOTE [a hook removed after a call]
        self._hooks = user_hook_places(_submodules(self._modules))
        self._bindings = bindings

    def now(self) -> tuple[Any, ...]:
        """The structure of the modules, and what the names hold, as they are now."""
        return _structure(self._modules), () if self._bindings is None else self._bindings.now()

    def watches_names(self) -> bool:
        """Whether it remembers what some name the function reads holds."""
        return self._bindings is not None and len(self._bindings) > 0

    def names_hold(self) -> bool:
        """Whether the names it remembers hold what they held."""
        return self._bindings is None or self._bindings.hold()

    def watch_names_it_rebinds(self, rebase: bool = True) -> None:
        """Watch by code the names that hold another object already: the
        function's own runs rebound them (``state.on_done = lambda: ...``),
        as it will on every call (NOTE [a name the function rebinds, watched
        by its code] in named_bindings.py); with ``rebase``, whatever code
        they hold now, else only those that hold the code they held."""
        if self._bindings is not None:
            self._bindings.watch_moved_by_code(rebase)

    def watch_tensor_names(self, written: Sequence[torch.Tensor]) -> None:
        """Remember the names that hold ``written`` too, the tensors the
        function updates in place (NOTE [a name rebound after a call])."""
        if self._bindings is not None:
            self._bindings.watch_tensors(written)

    def holds(self) -> bool:
        if self._bindings is not None and not self._bindings.hold():
            return False
        if self._hooks and not hooks_still_in_place(self._hooks):  # NOTE [a hook removed after a call]
            return False
        registered = _registrations()
        if registered == self._registered:
            return True
        if _structure(self._modules) != self._structure:
            return False
        self._registered = registered  # something else was registered: nothing to walk next time
        return True
