"""Module hooks: the user's, as a module and the global tables hold them,
and t2j_ad's own, which its trial runs and replays add for the length of a
call and which must not count as the user's.

NOTE [a hook added after a call] (module_structure.py) compares the hooks of
a function's modules again only after PyTorch has numbered another hook
(``RemovableHandle.next_id``). The hooks t2j_ad itself adds (a replay of a
``BatchNorm`` in training mode adds two per call) would move that number on
every call, and every call would walk the modules; so they are registered
here (``own_global_hooks``), which counts them and remembers their ids:
``user_hooks_registered`` is the number less ours, and ``user_hooks``
leaves ours out.

NOTE [hooks a trial run registers]
A function may register a hook as it runs: a feature extractor that
registers one, runs the model and removes it, or a module that installs
one on its first ``forward`` behind a flag. A trial run that failed
between the two (the run on the meta device, inside the model) left the
hook on the module for good, and a trial run puts a ``forward``'s flags
back (NOTE [Python state in trial runs] in real_writes.py), so the real
call installed the hook again: every module the function ran then ran its
hook two to four times, in t2j_ad's calls and the user's own PyTorch
calls, and every call resolved its signature again (NOTE [a hook added
after a call]) and added more. So a trial run removes, as it ends, every
hook numbered since it started (PyTorch numbers hooks in order) from the
modules it ran or refers to and from the global tables, the tables of
hooks with keyword arguments, always-called hooks and state-dict hooks
included. A hook another thread registers on one of those modules while a
trial run is on is removed too; a hook on a tensor is not.

A hook that removes itself (a one-shot initialization: a forward-pre hook
that sets a scale from the first batch, then ``handle.remove()``) ran in
the trial run on zeros, which put its write back but not its removal: no
real call ran it, and the scale stayed at its initial value. So a trial
run also puts back, as it ends, the hooks it removed from the modules the
function refers to and from the global tables (``hook_tables_kept``), in
their order; the first real call runs such a hook, as PyTorch's first
call would. A module the function reaches deeper (``outer.inner.model``,
two plain objects down) is not among those it refers to, and its hook
stayed removed: the init never ran on real data. So the tables of every
other module a forward runs under are copied too, the first time the
trial run sees it (in t2j_ad's global forward pre-hook, which runs
before the module's own hooks). A graph-mode trace puts them back as
well, and a trace that ran such a hook gives no graph (NOTE [a hook that
removed itself in a trace] in graph_mode.py).

NOTE [only PyTorch's hook tables]
The tables a trial run removes hooks from were first found by name: every
dict attribute of a module whose name held "hooks". A module of the user's
may keep such a dict of its own, keyed by ints (``self.monitor_hooks =
{id(m): handle}``, ``self.step_hooks = {1000: callback}``), and every key
at or above the number of the next hook (an ``id`` always is) was deleted
by the first call: the user's dict came back empty. So the tables are
PyTorch's alone, found by what they are: the dicts ``nn.Module.__init__``
sets on a fresh module, but those of submodules, parameters and buffers
(``_forward_hooks``, ``_forward_hooks_with_kwargs``, ``_state_dict_hooks``
and the like), and the dicts ``torch.nn.modules.module`` keeps under a
``_global_`` name.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.modules.module as _module_hooks  # public: torch.nn.modules.module.register_module_*_hook
from torch.utils.hooks import RemovableHandle

# The hook tables of a module, and the global ones (forward, forward-pre,
# backward and backward-pre hooks).
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOK_TABLES = tuple(f"_global{name}" for name in _HOOK_TABLES)

# How many hooks t2j_ad has registered, and the ids of those registered now.
# Read and written without a lock: a lost count costs one walk of the modules.
_registered_by_us = [0]
_ids_now: set[int] = set()


def user_hooks_registered() -> int:
    """How many hooks have been registered anywhere but by t2j_ad."""
    return RemovableHandle.next_id - _registered_by_us[0]


def hooks_numbered() -> int:
    """The number PyTorch gives the next hook registered anywhere."""
    return RemovableHandle.next_id


# The tables, keyed by the handles' ids, in which PyTorch keeps a module's
# hooks and their flags (with keyword arguments, always called) and the
# global ones: the dicts nn.Module.__init__ sets but those of submodules,
# parameters and buffers, and the dicts torch.nn.modules.module keeps under
# a ``_global_`` name (NOTE [only PyTorch's hook tables]).
_NOT_HOOK_TABLES = ("_parameters", "_buffers", "_modules")
_EVERY_MODULE_TABLE = tuple(
    name for name, value in vars(torch.nn.Module()).items() if isinstance(value, dict) and name not in _NOT_HOOK_TABLES
)
_EVERY_GLOBAL_TABLE = tuple(
    name for name, value in vars(_module_hooks).items() if name.startswith("_global_") and isinstance(value, dict)
)


def _every_table(module: torch.nn.Module | None) -> list[dict[Any, Any]]:
    """Every table of hooks ``module`` holds (the global ones for None),
    those of hooks with keyword arguments and always-called hooks, keyed by
    the same numbers, included; PyTorch's alone (NOTE [only PyTorch's hook
    tables])."""
    if module is None:
        attributes, names = vars(_module_hooks), _EVERY_GLOBAL_TABLE
    else:
        attributes, names = getattr(module, "__dict__", {}), _EVERY_MODULE_TABLE
    return [table for table in map(attributes.get, names) if isinstance(table, dict)]


def remove_hooks_since(first: int, modules: Iterable[torch.nn.Module]) -> None:
    """Remove every hook numbered ``first`` or later, but t2j_ad's own, from
    ``modules`` and the global tables (NOTE [hooks a trial run registers])."""
    for module in (*modules, None):
        for table in _every_table(module):
            for key in [k for k in table if type(k) is int and k >= first and k not in _ids_now]:
                del table[key]


# A table of hooks, and a copy of it as a trial run found it.
KeptTable = tuple[dict[Any, Any], dict[Any, Any]]


def hook_tables_kept(modules: Iterable[torch.nn.Module], global_tables: bool = True) -> list[KeptTable]:
    """Each table of hooks ``modules`` (and, with ``global_tables``, the
    global tables) hold that has one, with a copy of it: what
    ``put_back_removed_hooks`` puts back (NOTE [hooks a trial run
    registers])."""
    holders = (*modules, None) if global_tables else tuple(modules)
    return [(table, dict(table)) for module in holders for table in _every_table(module) if table]


def put_back_removed_hooks(kept: Iterable[KeptTable]) -> int:
    """Put back in each table the hooks removed since ``hook_tables_kept``
    copied it, in their order, before those added since; how many hooks
    (and flags of theirs) it put back."""
    put_back = 0
    for table, saved in kept:
        removed = len(saved.keys() - table.keys())
        if removed:
            put_back += removed
            added = [(key, value) for key, value in table.items() if key not in saved]
            table.clear()
            table.update(saved)
            table.update(added)
    return put_back


def _where_tables_are(module: torch.nn.Module | None) -> tuple[dict[str, Any], tuple[str, ...]]:
    """What holds ``module``'s hook tables (the global ones for None), and
    their names."""
    if module is None:
        return vars(_module_hooks), _GLOBAL_HOOK_TABLES
    return getattr(module, "__dict__", {}), _HOOK_TABLES


def _tables(module: torch.nn.Module | None) -> list[Any]:
    """``module``'s hook tables; the global ones for None."""
    attributes, names = _where_tables_are(module)
    return [attributes.get(name) for name in names]


def user_hook_ids(module: torch.nn.Module | None) -> tuple[tuple[int, ...], ...]:
    """The handles' ids of ``module``'s hooks (the global ones for None),
    table by table, but t2j_ad's own."""
    return tuple(tuple(key for key in table if key not in _ids_now) if table else () for table in _tables(module))


# The tables of a module's flags for its hooks, keyed by the same numbers
# (``with_kwargs=True``, ``always_call=True``), and the global ones; and the
# attribute saying whether its backward hooks are full ones.
_FLAG_TABLES = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
_GLOBAL_FLAG_TABLES = tuple(f"_global{name}" for name in _FLAG_TABLES)
_FULL_BACKWARD = ("_is_full_backward_hook", "_global_is_full_backward_hook")

# The values a hook's closure or defaults may hold that count as the same
# when equal, not only when the same object (NOTE [a hook registered again]
# in module_structure.py).
_PLAIN_VALUES = (int, float, complex, str, bytes, bool, type(None))
_EMPTY_CELL = object()


def _same_value(a: Any, b: Any) -> bool:
    """The same object, or plain values that print alike (so 0.0 and -0.0,
    or 1 and True, differ, and a NaN is itself)."""
    return a is b or (type(a) is type(b) and type(a) in _PLAIN_VALUES and repr(a) == repr(b))


def _cell_contents(function: types.FunctionType) -> list[Any]:
    """What each cell of ``function``'s closure holds (``_EMPTY_CELL`` for
    one not bound yet)."""
    contents = []
    for cell in function.__closure__ or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:
            contents.append(_EMPTY_CELL)
    return contents


def _names_read(code: types.CodeType) -> set[str]:
    """The global (and attribute) names ``code`` and the code nested in it
    read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_read(const)
    return names


def _globals_read(hook: Any) -> tuple[Any, ...]:
    """What the module globals ``hook`` names hold now, by name (nothing
    for a hook that is no function or method)."""
    function = getattr(hook, "__func__", hook)
    if not isinstance(function, types.FunctionType):
        return ()
    return tuple(function.__globals__.get(name, _EMPTY_CELL) for name in sorted(_names_read(function.__code__)))


def _cells_read(hook: Any) -> list[Any]:
    """What ``hook``'s closure holds now (nothing for a hook that is no
    function or method)."""
    function = getattr(hook, "__func__", hook)
    return _cell_contents(function) if isinstance(function, types.FunctionType) else []


def _same_values(a: Iterable[Any], b: Iterable[Any]) -> bool:
    a, b = list(a), list(b)
    return len(a) == len(b) and all(map(_same_value, a, b))


def _same_function(a: types.FunctionType, b: types.FunctionType) -> bool:
    """One code object, module globals, defaults and closure contents."""
    kw_a, kw_b = a.__kwdefaults__ or {}, b.__kwdefaults__ or {}
    return (
        a.__code__ is b.__code__
        and a.__globals__ is b.__globals__
        and _same_values(a.__defaults__ or (), b.__defaults__ or ())
        and kw_a.keys() == kw_b.keys()
        and _same_values(kw_a.values(), (kw_b[k] for k in kw_a))
        and _same_values(_cell_contents(a), _cell_contents(b))
    )


def same_hook(a: Any, b: Any) -> bool:
    """Whether hooks ``a`` and ``b`` do the same, given the same globals
    (NOTE [a hook registered again] in module_structure.py): one object; a
    function made again from the same code with the same defaults and
    closure contents; a method of one object bound again. Anything else
    only as one object."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, types.MethodType):
        return a.__self__ is b.__self__ and same_hook(a.__func__, b.__func__)
    return isinstance(a, types.FunctionType) and _same_function(a, b)


class SameHook:
    """A hook as a module's structure holds it: equal to another that does
    the same (``same_hook``) and whose globals held the same when each was
    seen; it keeps the hook alive, so no other object takes its id
    meanwhile."""

    __slots__ = ("hook", "globals_read", "cells_read")

    def __init__(self, hook: Any) -> None:
        self.hook = hook
        # Read now: the hook reads them when it runs, and a graph keeps them.
        self.globals_read = _globals_read(hook)
        # Its closure's contents now too: hooks made again by one call of
        # the function around them share its cells, so comparing the cells
        # as they are later finds them alike whatever they held.
        self.cells_read = _cells_read(hook)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SameHook)
            and same_hook(self.hook, other.hook)
            and _same_values(self.globals_read, other.globals_read)
            and _same_values(self.cells_read, other.cells_read)
        )

    def __hash__(self) -> int:
        function = getattr(self.hook, "__func__", self.hook)
        code = getattr(function, "__code__", None) if isinstance(function, types.FunctionType) else None
        return hash(code) if code is not None else id(self.hook)

    def __repr__(self) -> str:
        return f"SameHook({self.hook!r})"


def user_hooks_seen(module: torch.nn.Module | None) -> tuple[Any, ...]:
    """``module``'s hooks (the global ones for None), but t2j_ad's own, table
    by table and in order, each as a ``SameHook`` with its flags, and
    whether its backward hooks are full ones: what it runs, whatever the
    handles' ids (NOTE [a hook registered again] in module_structure.py)."""
    attributes, names = _where_tables_are(module)
    flag_tables = [attributes.get(name) or () for name in (_GLOBAL_FLAG_TABLES if module is None else _FLAG_TABLES)]
    tables = tuple(
        tuple(
            (SameHook(hook), tuple(key in flags for flags in flag_tables))
            for key, hook in (attributes.get(name) or {}).items()
            if key not in _ids_now
        )
        for name in names
    )
    return (*tables, attributes.get(_FULL_BACKWARD[module is None]))


# Where a hook is: the attributes holding its table, the table's name, and
# the handle's id (NOTE [a hook removed after a call] in module_structure.py).
HookPlace = tuple[dict[str, Any], str, int]


def user_hook_places(modules: Iterable[torch.nn.Module]) -> tuple[HookPlace, ...]:
    """Where each hook of ``modules`` and each global one is, but t2j_ad's
    own, as ``user_hook_ids`` reads them."""
    places: list[HookPlace] = []
    for module in (*modules, None):
        attributes, names = _where_tables_are(module)
        for name in names:
            table = attributes.get(name)
            places += [(attributes, name, key) for key in table or () if key not in _ids_now]
    return tuple(places)


def hooks_still_in_place(places: Sequence[HookPlace]) -> bool:
    """Whether every hook ``places`` names is still in its table (at once
    where it names none)."""
    return not places or all(key in (attributes.get(name) or ()) for attributes, name, key in places)


def user_hooks(modules: Iterable[torch.nn.Module]) -> list[Callable[..., Any]]:
    """The hooks of ``modules`` and the global ones, but t2j_ad's own."""
    return [
        hook
        for module in (*modules, None)
        for table in _tables(module)
        if table
        for key, hook in list(table.items())
        if key not in _ids_now
    ]


@functools.cache
def _recomputing_hook_types() -> tuple[tuple[type, str, str], ...]:
    """PyTorch's reparametrizations by a forward pre-hook: each hook's type,
    the attribute naming what it binds, and the utility that registers it
    (NOTE [attributes PyTorch's hooks recompute] in real_writes.py)."""
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return (
        (BasePruningMethod, "_tensor_name", "torch.nn.utils.prune"),
        (WeightNorm, "name", "torch.nn.utils.weight_norm"),
        (SpectralNorm, "name", "torch.nn.utils.spectral_norm"),
    )


def recomputing_hook(module: torch.nn.Module, name: str) -> str | None:
    """The PyTorch utility whose forward pre-hook on ``module`` binds
    ``module.name`` anew on every call, computed from the module's own
    tensors (``torch.nn.utils.prune``'s ``weight = weight_orig *
    weight_mask``), if one does; else None (NOTE [attributes PyTorch's hooks
    recompute] in real_writes.py)."""
    for hook in (getattr(module, "_forward_pre_hooks", None) or {}).values():
        for hook_type, names_it, utility in _recomputing_hook_types():
            if isinstance(hook, hook_type) and getattr(hook, names_it, None) == name:
                return utility
    return None


@contextlib.contextmanager
def own_global_hooks(
    forward_pre: Callable[..., Any] | None = None, forward: Callable[..., Any] | None = None
) -> Iterator[None]:
    """Within the block, ``forward_pre(module, args)`` before every module's
    ``forward`` and ``forward(module, args, output)`` after it (also when it
    raises), for every module."""
    handles: list[RemovableHandle] = []
    try:
        if forward_pre is not None:
            _registered_by_us[0] += 1
            handles.append(_module_hooks.register_module_forward_pre_hook(forward_pre))
            _ids_now.add(handles[-1].id)
        if forward is not None:
            _registered_by_us[0] += 1
            handles.append(_module_hooks.register_module_forward_hook(forward, always_call=True))
            _ids_now.add(handles[-1].id)
        yield
    finally:
        for handle in handles:
            handle.remove()
            _ids_now.discard(handle.id)
