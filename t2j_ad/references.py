"""What a user's function refers to: the objects its code can reach in a few
steps, for the modules whose training flags it reads (NOTE [a graph per
training mode]) and the dicts it may cache tensors in (NOTE [trial runs
leave caches as they found them])."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

_OWN = __name__.rpartition(".")[0] + "."  # t2j_ad's own objects are not the user's
# The most entries of a dict, list or tuple looked into, and how many steps.
_CONTAINER_ENTRIES = 64
_DEPTH = 2
# Modules whose attributes are not looked into: PyTorch's, JAX's and the
# like hold no cache of the user's.
_LIBRARIES = ("torch", "jax", "numpy", "t2j_ad", "builtins", "math", "functools", "typing")


# How ``bindings`` names the value a closure cell holds.
CELL = object()


def reachable(
    fn: Callable[..., Any],
    wanted: Callable[[Any], bool],
    stop: tuple[type, ...] = (),
    bindings: list[tuple[Any, Any, Any]] | None = None,
) -> list[Any]:
    """The objects ``wanted`` accepts among those ``fn`` reaches: itself, a
    bound method's ``self`` (and what it holds as attributes), what its code
    names from its closure, globals or default arguments (and what it names
    in a module it names, but PyTorch's and the like), a
    ``functools.partial``'s function and arguments, and the entries of a
    dict, list or tuple among those (``models["encoder"]``); each once, up
    to two steps from ``fn``, not looking into an object of a ``stop`` type.
    ``bindings``, if given, gets ``(holder, key, value)`` for each name
    followed on the way (a global, a closure cell, keyed ``CELL``, an entry
    of a dict or list, an attribute) that holds a wanted object, or one on
    the way to one, or a function or other callable: what rebinding that name
    would change (NOTE [a name rebound after a call] in named_bindings.py)."""
    found: dict[int, Any] = {}

    def follow(holder: Any, key: Any, value: Any, depth: int) -> bool:
        leads = visit(value, depth)
        if bindings is not None and (leads or a_callable(value)):
            bindings.append((holder, key, value))
        return leads

    def visit(obj: Any, depth: int) -> bool:
        """Whether ``obj`` is wanted or leads to a wanted object; an object
        that raises when looked at (a dead weak proxy, a lazy object not
        ready) leads nowhere."""
        try:
            return look_into(obj, depth)
        except Exception:  # noqa: BLE001 - the user's objects may raise anything when looked at
            return False

    def look_into(obj: Any, depth: int) -> bool:
        if wanted(obj):
            found.setdefault(id(obj), obj)
            return True
        if depth > _DEPTH or isinstance(obj, stop):
            return False
        leads = False
        if isinstance(obj, (dict, list, tuple)):
            if len(obj) <= _CONTAINER_ENTRIES:
                for key, value in obj.items() if isinstance(obj, dict) else enumerate(obj):
                    leads |= follow(obj, key, value, depth + 1)
            return leads
        if isinstance(obj, functools.partial):
            for inner in (obj.func, *obj.args, *obj.keywords.values()):
                leads |= visit(inner, depth + 1)
            return leads
        owner = getattr(obj, "__self__", None)
        if owner is not None and not isinstance(owner, (type, types.ModuleType)):
            leads |= visit(owner, depth + 1)
        code_of = getattr(obj, "__func__", obj)
        if inspect.isfunction(code_of):
            try:
                names = inspect.getclosurevars(code_of)
            except (TypeError, ValueError):  # nothing to learn from this one
                return leads
            cells = dict(zip(code_of.__code__.co_freevars, code_of.__closure__ or ()))
            for name, value in names.nonlocals.items():
                leads |= follow(cells.get(name), CELL, value, depth + 1)
            for name, value in names.globals.items():
                leads |= follow(code_of.__globals__, name, value, depth + 1)
            for value in (*(code_of.__defaults__ or ()), *(code_of.__kwdefaults__ or {}).values()):
                leads |= visit(value, depth + 1)
            for value in (*names.nonlocals.values(), *names.globals.values()):
                if isinstance(value, types.ModuleType) and users_code(value.__name__):
                    # mystore.param(...): what the code names in a module it names
                    # (Pyro's pyro.param and its param store)
                    for name in code_of.__code__.co_names:
                        if name in vars(value):
                            leads |= follow(vars(value), name, vars(value)[name], depth + 1)
        elif (
            depth
            and not callable(obj)
            and not isinstance(obj, types.ModuleType)
            and type(getattr(obj, "__dict__", None)) is dict
            and not type(obj).__module__.startswith(_OWN)  # jaxify_module's own state, say
        ):
            leads |= visit(obj.__dict__, depth + 1)  # a plain object's attributes
        return leads

    visit(fn, 0)
    return list(found.values())


def users_code(name: str | None) -> bool:
    """Whether a module named ``name`` is the user's (or a library's other
    than PyTorch's, JAX's, NumPy's or Python's own)."""
    return not (name or "").startswith(_LIBRARIES)


def a_callable(value: Any) -> bool:
    """Whether ``value`` is a function or other callable (not a Python
    module); False for one that raises when asked."""
    try:
        return callable(value) and not isinstance(value, types.ModuleType)
    except Exception:  # noqa: BLE001 - a dead weak proxy raises ReferenceError
        return False


def name_key(holder: Any, key: Any) -> tuple[int, Any]:
    """What tells one name (``holder[key]``, as ``bindings`` gives it) from
    another: the holder by identity, and the key (by identity where it is
    neither a string nor an int)."""
    return id(holder), key if type(key) in (str, int) else id(key)


# What held_at answers for a name that holds nothing now.
GONE = object()


def held_at(holder: Any, key: Any) -> Any:
    """What ``holder`` (a closure cell, for ``CELL``; else a dict, list or
    other mapping) holds under ``key`` now; ``GONE`` if nothing, or if
    looking raises (a dict subclass's own ``__getitem__`` may raise anything)."""
    if key is CELL:
        try:
            return holder.cell_contents
        except ValueError:  # an empty cell
            return GONE
    try:
        return holder[key]
    except Exception:  # noqa: BLE001 - the user's containers may raise anything
        return GONE


class Same:
    """An object as a key: equal only to itself, whatever its ``__eq__``."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)
