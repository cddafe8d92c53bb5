"""Whether the names a function reads still hold the modules and functions
they held when its signature was resolved.

NOTE [a name rebound after a call]
What a function does besides computing its outputs (its draws and state
writes: NOTE [derivatives replay the value's draws] in replayed_calls.py) is
learnt once per input signature, and NOTE [a submodule replaced after a
call] sees a submodule swapped inside a module. A notebook rebinds the name
instead: ``model = nn.Dropout(0.5)`` in a later cell, where the function
``lambda x: (model(x) ** 2).sum()`` had met an ``nn.Identity``, or a helper
``def noise(x)`` defined again to draw. The function reads the new object on
its next call, but its signature kept the old one's effects:
``jax.value_and_grad`` took the gradient through another dropout mask than
the value's, and a new ``BatchNorm`` updated its statistics twice per step,
silently.

So a resolved signature also remembers what each name on the way from the
function to a module held: a global, a closure variable, an entry of a dict
or list, an attribute of a plain object (as far as ``references.reachable``
looks), and every name that holds a function or other callable
(``ACT = torch.tanh``, set to a dropout in a later cell); the
``forward`` of each module class of the user's among those modules, and
the names it reads in turn (a helper ``act(t)`` a ``forward`` calls); and
the code of each of those functions, which IPython's ``%autoreload``
replaces in place. A call that
finds one rebound resolves the signature again, as after a submodule swap.
A name that holds a number or an array is not remembered: rebinding those
is what a loop does (``step += 1``, ``w = w - lr * g``), and changes no
effect. Neither is a name that holds a tensor, unless the function updates
state in place (``acc.add_(x)``): then a name bound to a fresh tensor
changes what it updates, and a value and its gradient had updated the new
one twice. The look costs one lookup per remembered name per call (most
functions have one or two).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from .references import CELL, reachable, users_code

_GONE = object()


class _Attribute:
    """A key naming an attribute: a function's ``__code__``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


_CODE = _Attribute("__code__")


def _held(holder: Any, key: Any) -> Any:
    """What ``holder`` holds under ``key`` now (``_GONE`` if nothing)."""
    if key is _CODE:
        return getattr(holder, "__code__", _GONE)
    if key is CELL:
        try:
            return holder.cell_contents
        except ValueError:  # an empty cell
            return _GONE
    try:
        return holder[key]
    except (KeyError, IndexError, TypeError):
        return _GONE


def _is_module(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module)


class BindingsSeen:
    """The names on the way from a function to the modules it refers to, and
    those that hold its helper functions, with what each holds now;
    ``hold()``: whether each still holds the same object."""

    __slots__ = ("_bindings", "_to_tensors", "_watching_tensors")

    def __init__(self, fn: Callable[..., Any]) -> None:
        to_tensors: list[tuple[Any, Any, Any]] = []
        reachable(fn, lambda obj: isinstance(obj, torch.Tensor), bindings=to_tensors)
        self._to_tensors = _unique([b for b in to_tensors if not callable(b[2])])
        self._watching_tensors = False
        bindings: list[tuple[Any, Any, Any]] = []
        modules = reachable(fn, _is_module, bindings=bindings)
        classes = {type(sub) for module in modules for sub in module.modules()}
        for cls in classes:
            forward = vars(cls).get("forward")
            if users_code(cls.__module__) and forward is not None:
                bindings.append((vars(cls), "forward", forward))  # Net.forward = other
                reachable(forward, _is_module, bindings=bindings)
        functions = [value for _, _, value in bindings if inspect.isfunction(value)]
        root = getattr(fn, "__func__", fn)
        if inspect.isfunction(root) and users_code(root.__module__):
            functions.append(root)
        bindings += [(function, _CODE, function.__code__) for function in functions]
        self._bindings = _unique(bindings)

    def __len__(self) -> int:
        return len(self._bindings) + (len(self._to_tensors) if self._watching_tensors else 0)

    def watch_tensors(self) -> None:
        """Remember the names on the way to the tensors the function names
        too: it updates one in place (``acc.add_(x)``), so a name bound to a
        fresh one (``acc = torch.zeros(3)`` in a later cell) changes what it
        updates."""
        self._watching_tensors = True

    def _watched(self) -> tuple[tuple[Any, Any, Any], ...]:
        return self._bindings + self._to_tensors if self._watching_tensors else self._bindings

    def hold(self) -> bool:
        for holder, key, value in self._watched():
            if _held(holder, key) is not value:
                return False
        return True

    def now(self) -> tuple[int, ...]:
        """Which objects the names hold now, by identity."""
        return tuple(id(_held(holder, key)) for holder, key, _ in self._watched())


def _unique(bindings: list[tuple[Any, Any, Any]]) -> tuple[tuple[Any, Any, Any], ...]:
    """``bindings``, each name once."""
    unique = {
        (id(holder), key if type(key) in (str, int) else id(key)): (holder, key, value)
        for holder, key, value in bindings
    }
    return tuple(unique.values())
