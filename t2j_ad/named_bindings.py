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
that tensor in place (``acc.add_(x)``): then a name bound to a fresh one
changes what it updates, and a value and its gradient had updated the new
one twice. A module's plain attributes that hold functions
(``nn.TransformerEncoderLayer``'s ``activation``), and a ``forward`` set
on one of the user's modules later, count as names too, and so does the
``__call__`` of a callable object of the user's. A name the function's own
run binds afresh (``state.on_done = lambda: ...``) changes on every call,
so it is watched by code (below). The runs that infer output shapes show
most such names; a module's attribute (``self.act = lambda ...`` in a
``forward``) they put back, so a call that finds the names as remembered
at its start, and rebound at its end, looks at those too (runtime.py):
every call had resolved its signature again, 60-140x slower. The look
costs one lookup per remembered name per call (most functions have one or
two).

NOTE [a name the function rebinds, watched by its code]
Such a name was first forgotten, which missed a function that chooses what
it binds: ``self.act = drop if self.noisy else ident``, or a fresh
``lambda`` of one code or another, after ``noisy`` was set; the gradient
then went through another dropout mask than the value's, for good. So a
name the function's own run rebinds is watched by the code of what it
holds (``_code_key``: a function's code and, one level down, what its
closure holds; a ``partial``'s function and the names of its arguments; a
method's function and object; the type of any other object): a fresh
``lambda`` of the same code every call holds, and one of other code is a
name rebound, looked at again as above. A call that rebinds a name to
something of other code than it held (another thread's rebinding during
the call, or a flag the function reads switched) leaves it watched as
before, so the next call resolves the signature again.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .references import GONE, Same, a_callable, held_at, name_key, reachable, users_code
from .state_writes import memory_of


class _Attribute:
    """A key naming an attribute: a function's ``__code__``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


_CODE = _Attribute("__code__")


def _held(holder: Any, key: Any) -> Any:
    """What ``holder`` holds under ``key`` now (``GONE`` if nothing)."""
    if key is _CODE:
        try:
            return holder.__code__
        except Exception:  # noqa: BLE001 - a proxy's attribute access may raise anything
            return GONE
    return held_at(holder, key)


class _ByCode:
    """What a name watched by code held: the ``_code_key`` of it (NOTE [a
    name the function rebinds, watched by its code])."""

    __slots__ = ("key",)

    def __init__(self, key: Any) -> None:
        self.key = key


def _cell_key(cell: Any) -> Any:
    try:
        held = cell.cell_contents
    except ValueError:  # an empty cell
        return None
    return held.__code__ if inspect.isfunction(held) else type(held)


def _code_key(obj: Any) -> Any:
    """What makes two objects bound to a name do the same (NOTE [a name the
    function rebinds, watched by its code]); hashable."""
    if inspect.isfunction(obj):
        return (obj.__code__, tuple(_cell_key(c) for c in obj.__closure__ or ()))
    if isinstance(obj, functools.partial):
        return ("partial", _code_key(obj.func), len(obj.args), tuple(sorted(obj.keywords)))
    if inspect.ismethod(obj):
        return ("method", _code_key(obj.__func__), id(obj.__self__))
    if inspect.isbuiltin(obj) or isinstance(obj, type):
        return ("the same", id(obj))
    return ("of type", type(obj))


def _is_module(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module)


class BindingsSeen:
    """The names on the way from a function to the modules it refers to, and
    those that hold its helper functions, with what each holds now;
    ``hold()``: whether each still holds the same object."""

    __slots__ = ("_fn", "_bindings")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        bindings: list[tuple[Any, Any, Any]] = []
        modules = reachable(fn, _is_module, bindings=bindings)
        subs = list({id(sub): sub for module in modules for sub in module.modules()}.values())
        for sub in subs:
            attributes = vars(sub)
            for name, value in attributes.items():
                # A function a module keeps as a plain attribute
                # (nn.TransformerEncoderLayer's activation), or a forward set on it.
                if a_callable(value) and not isinstance(value, (torch.nn.Module, type)):
                    bindings.append((attributes, name, value))
            if "forward" not in attributes and (users_code(type(sub).__module__) or any(sub is m for m in modules)):
                bindings.append((attributes, "forward", GONE))  # net.forward = other, later
        for cls in {type(sub) for sub in subs}:
            for klass in cls.__mro__:  # a forward inherited from a base class of the user's
                if not users_code(klass.__module__):
                    break
                forward = vars(klass).get("forward", GONE)
                bindings.append((vars(klass), "forward", forward))  # Net.forward = other
                if forward is not GONE:
                    reachable(forward, _is_module, bindings=bindings)
                    break
        functions = [value for _, _, value in bindings if inspect.isfunction(value)]
        root = fn.func if isinstance(fn, functools.partial) else fn
        root = getattr(root, "__func__", root)
        call = vars(type(root)).get("__call__") if not inspect.isfunction(root) else None
        if inspect.isfunction(call) and users_code(type(root).__module__):  # a callable object of the user's
            bindings.append((vars(type(root)), "__call__", call))
            reachable(call, _is_module, bindings=bindings)
            root = call
        if inspect.isfunction(root) and users_code(root.__module__):
            functions.append(root)
        bindings += [(function, _CODE, function.__code__) for function in functions]
        self._bindings = _unique(bindings)

    def __len__(self) -> int:
        return len(self._bindings)

    def watch_tensors(self, written: Sequence[torch.Tensor]) -> None:
        """Remember the names on the way to ``written`` too, the tensors the
        function updates in place (``acc.add_(x)``): a name bound to a fresh
        one (``acc = torch.zeros(3)`` in a later cell) changes what it
        updates. Only those: a name bound to another tensor the function
        only reads (a schedule, the params of ``functional_call``) changes
        no effect."""
        ids = {id(t) for t in written}
        memories = {memory_of(t) for t in written} - {None}

        def updated(obj: Any) -> bool:
            return isinstance(obj, torch.Tensor) and (id(obj) in ids or memory_of(obj) in memories)

        found: list[tuple[Any, Any, Any]] = []
        reachable(self._fn, updated, bindings=found)
        self._bindings = _unique([*self._bindings, *(b for b in found if not a_callable(b[2]))])

    def watch_moved_by_code(self, rebase: bool) -> None:
        """Watch by code the names that hold another object now (NOTE [a
        name the function rebinds, watched by its code]): with ``rebase``
        (the runs that infer shapes rebound them), by the code of what they
        hold now; else (a call rebound them), each that holds something of
        the code it held, and the others stay as they were."""
        watched = []
        for holder, key, value in self._bindings:
            now = _held(holder, key)
            if now is not value and type(value) is not _ByCode:
                if rebase or _code_key(now) == _code_key(value):
                    value = _ByCode(_code_key(now))
            watched.append((holder, key, value))
        self._bindings = tuple(watched)

    def hold(self) -> bool:
        return all(map(_holds, self._bindings))

    def now(self) -> tuple[Any, ...]:
        """Which objects the names hold now, by identity (kept alive with
        what they key, so no other object takes their ids), or by code
        where watched so."""
        return tuple(
            _code_key(_held(holder, key)) if type(value) is _ByCode else Same(_held(holder, key))
            for holder, key, value in self._bindings
        )


def _unique(bindings: list[tuple[Any, Any, Any]]) -> tuple[tuple[Any, Any, Any], ...]:
    """``bindings``, each name once, and only those that can be read back
    (a dict whose ``__getitem__`` raises is no name to look at per call)."""
    unique = {name_key(holder, key): (holder, key, value) for holder, key, value in bindings}
    return tuple(filter(_holds, unique.values()))


def _holds(binding: tuple[Any, Any, Any]) -> bool:
    """Whether a name still holds what it held (by code, where watched so)."""
    holder, key, value = binding
    now = _held(holder, key)
    return now is value or (type(value) is _ByCode and _code_key(now) == value.key)
