"""Dicts a trial run fills with tensors are emptied of them again.

NOTE [trial runs leave caches as they found them]
A function may keep tensors it computed in a dict between calls: a basis
matrix per size in ``self._basis[n]``, rotary tables per ``(n, device,
dtype)`` in a global dict, or ``torch.nn.utils.parametrize.cached()``'s
weights. Shape inference runs the function on the meta device, and a
graph-mode trace on fake tensors, so such a run cached a tensor with no
values: the real call then computed with it (PyTorch's CPU matmul accepts a
meta operand and returns uninitialized memory; a fake one gave garbage
gradients), and so did the user's own PyTorch calls afterwards. So each
trial run notes the dicts the function can reach (those its code names from
its closure or globals, and those its arguments' and referenced modules'
attributes hold; ``dicts_named_by``), those the modules it runs hold as
attributes (noted as each ``forward`` starts), and parametrize's cache, and
when the run ends, takes out every entry it added or changed to a value
holding a tensor, putting the old value back, and in a dict where it did
that, every other entry it changed too (transformers' ``DynamicCache``
layer sets ``is_initialized`` beside its first keys; a flag left set with
the keys put back failed the next call). The objects those dicts hold
(``cache.layers[i]``: a list of objects holding tensors) are looked into
as well. A dict whose entries the run changed but none to or from a tensor
(a call counter) stays as the run left it, as other Python state a trial
run touches does; caches of other kinds (``functools.lru_cache``) are not
seen. A graph-mode trace that changes an entry a dict or object already
had, from or to a tensor (a KV cache grown by ``torch.cat``), is refused:
the graph would not grow it (trace_refusals.refuse_state_kept_in_objects).

NOTE [what module hooks fill]
A forward hook that saves activations (``acts[name] = output.detach()``, or
``acts.append(output)``) fills a dict or list its own code names, which the
function's code never names. Not noted, such a dict kept what each trial
run put there: a meta tensor from the run that infers shapes, until the
first real call wrote over it; and in graph mode the trace's fake tensor,
for good, since a graph replays no hook: reading the activation raised, and
no call updated it, silently. So the containers the hooks of the modules a
function refers to (and the global hooks) can reach are noted too
(``HookFilled``, ``hook_containers``): the dicts (``defaultdict`` and
``OrderedDict`` included), lists and deques the hook's code names; those a
dict among them holds (``acts["fc"].append(...)``, one level); a callable
object's attributes and the containers they hold (the common ``SaveOutput``
class: ``self.outputs.append(o)``, ``self.count += 1``); and the
containers held as attributes by the module a hook is registered on (its
``m`` argument: ``m.acts.append(o)``) and by any module its code names
(``model.acts``), PyTorch's own tables left out. Everything a trial run
changes in one is put back, tensor or not: a list of activations, of
shapes, or a call counter gets only the real calls' entries, as the docs
promise. A trace that changes one is refused (the call runs eagerly, with a
``FallbackWarning``), since only eager calls run the hook. The walk is
bounded (two steps from the hook, ``_ENTRIES`` entries a container) and is
made when a signature is resolved, never per call, and only for modules
with hooks. Not seen: containers deeper than that, state of other kinds
(an attribute of an object a hook's list holds, ``itertools.count``), and
a binding ``m.x = ...`` on a module PyTorch's global forward hooks already
watch (NOTE [Python state in trial runs] in real_writes.py puts that back).
Another thread's real call that fills the same container while a trial
run is on loses its entry when the run puts the container back.

NOTE [an entry a trace adds, from the inputs]
An entry a graph-mode trace adds is a cache filled (a basis per size), and
the graph, which computes it again on every replay, does what the function
does. Not so for one computed from the function's inputs: a streaming
function's ``self.cache["prev"] = x``, read back on the next call, or
activations saved in a global dict. The graph never wrote it, so every
replay computed as on a first call (``[1, 4, 9, 16]`` where PyTorch gives
``[1, 3, 5, 7]``), or the entry was missing after every call, silently.
So the trace also returns the tensors it added (``added_tensors``), and an
entry whose value the graph computes from an input is state: the trace is
refused and the function runs eagerly (graph_mode.py).

NOTE [lists a function fills]
A list (or deque) the function's code names, as it names a dict, and
appends tensors to (``kept.append(x[1:])``, saved inputs, activations,
``x.untyped_storage()``) was not noted: the run that infers shapes left a
meta tensor in it, and a graph-mode trace its fake tensor, after which the
graph, which replays no Python, appended nothing on any later call, so the
list ended with a fake tensor that raised when read, silently. A list grows
on every call, where a dict's entry per key is a cache filled once, so
every change a run makes to such a list that puts in or takes out a tensor
or a storage is put back when the run ends (``ListNamed``), and a trace
that made one is refused: the function runs eagerly, appending on every
call as in PyTorch. A list changed otherwise (shapes or a call count
appended) stays as the run left it, as a dict does, and keeps the graph
(read once per trace, as other Python state). The same holds for a list a
module the function runs holds as an attribute the user set
(``self.saved.append(x)`` in a forward), but not for PyTorch's own
modules' private lists (an RNN's ``_flat_weights``, rebound with its
parameters by every call). A refusal names the list as the code names it,
or as ``Module.attribute``.
"""

from __future__ import annotations

import collections
import functools
import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .module_hooks import user_hook_ids, user_hooks
from .references import reachable

ABSENT = object()  # an entry a table did not, or does not, have


def changed_entries(table: Any, saved: dict[Any, Any]) -> list[tuple[Any, Any, Any]]:
    """``(key, value then, value now)`` of each entry of ``table`` (a dict,
    or a module's table) that is not what ``saved``, a copy made before,
    holds; ``ABSENT`` for a value it did not, or does not, have."""
    changed = []
    # list(table): one C call, so another thread's write into the table
    # meanwhile (a forward filling a shared cache) cannot break the walk.
    for key in [*saved, *(k for k in list(table) if k not in saved)]:
        old, new = saved.get(key, ABSENT), table.get(key, ABSENT)
        if old is not new:
            changed.append((key, old, new))
    return changed


def put_back(table: Any, key: Any, old: Any) -> None:
    """Give ``table[key]`` its value ``old`` again (none, for ``ABSENT``)."""
    if old is ABSENT:
        del table[key]
    else:
        table[key] = old

# The most entries of a container holds_tensor looks into, and how deep.
_ENTRIES = 64
_DEPTH = 2


def _tensors_in(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors ``value`` is, or a tuple, list or dict holds (two levels
    deep, at most ``_ENTRIES`` entries each)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth >= _DEPTH:
        return []
    if isinstance(value, (tuple, list)) and len(value) <= _ENTRIES:
        return [t for v in value for t in _tensors_in(v, depth + 1)]
    if isinstance(value, dict) and len(value) <= _ENTRIES:
        return [t for v in list(value.values()) for t in _tensors_in(v, depth + 1)]
    return []


def holds_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor, or a tuple, list or dict holding one
    (two levels deep)."""
    return bool(_tensors_in(value))


def _holds_tensor_or_storage(value: Any) -> bool:
    """Whether ``value`` holds a tensor (``holds_tensor``) or is a storage
    (``x.untyped_storage()``)."""
    return isinstance(value, (torch.UntypedStorage, torch.TypedStorage)) or holds_tensor(value)


# What a module hook fills: a dict (a subclass too), a list or a deque.
Fillable = dict[Any, Any] | list[Any] | collections.deque[Any]
_FILLABLE = (dict, list, collections.deque)


def fillable(obj: Any) -> bool:
    """Whether ``obj`` is a container a module hook may fill."""
    return isinstance(obj, _FILLABLE)


# What a function's code may fill by appending: a list or a deque.
_LISTS = (list, collections.deque)


class ListNamed:
    """A list or deque the function's code names, or a module it runs holds
    as an attribute (NOTE [lists a function fills]); ``name``, where known,
    as a refusal names it (``kept``, ``Net.saved``)."""

    __slots__ = ("container", "name")

    def __init__(self, container: list[Any] | collections.deque[Any], name: str | None = None) -> None:
        self.container = container
        self.name = name


class HookFilled:
    """A dict, list or deque a module hook can reach (NOTE [what module
    hooks fill])."""

    __slots__ = ("container",)

    def __init__(self, container: Fillable) -> None:
        self.container = container


def _copy_of(container: Fillable) -> dict[Any, Any] | list[Any]:
    """A plain copy of ``container``'s entries, to compare with and put back."""
    return dict(container) if isinstance(container, dict) else list(container)


def _changes_in(container: Fillable, saved: dict[Any, Any] | list[Any]) -> list[str]:
    """What a run changed in ``container`` since ``saved`` was copied: the
    keys of a dict's entries, or one line for a list or deque."""
    if isinstance(container, dict):
        return [repr(key) for key, _, _ in changed_entries(container, saved)]
    if _list_changes(container, saved):
        return [f"an entry of a {type(container).__name__} of {len(container)}"]
    return []


def _put_back_all(container: Fillable, saved: dict[Any, Any] | list[Any]) -> None:
    """Give ``container`` the entries ``saved`` holds again, tensors or not."""
    if isinstance(container, dict):
        for key, old, _ in changed_entries(container, saved):
            put_back(container, key, old)
    elif not _list_changes(container, saved):
        return
    elif isinstance(container, list):
        container[:] = saved
    else:  # a deque
        container.clear()
        container.extend(saved)


class CachesKept:
    """The dicts noted, each as it was when first noted; ``take_back`` puts
    back each entry changed since to a value holding a tensor (NOTE [trial
    runs leave caches as they found them]); and the dicts and lists module
    hooks fill (NOTE [what module hooks fill])."""

    def __init__(self) -> None:
        self._saved: dict[int, tuple[dict[Any, Any], dict[Any, Any]]] = {}
        self._hook_filled: dict[int, tuple[Any, Any]] = {}  # id -> (container, a copy)
        self._lists: dict[int, tuple[Any, list[Any], str | None]] = {}  # NOTE [lists a function fills]

    def note(self, dicts: Iterable[Any]) -> None:
        for d in dicts:
            if isinstance(d, HookFilled):
                c = d.container
                if id(c) not in self._hook_filled and id(c) not in self._saved:
                    self._hook_filled[id(c)] = (c, _copy_of(c))
                    self._lists.pop(id(c), None)  # a hook's: put back whatever changed
            elif isinstance(d, ListNamed):
                c = d.container
                if id(c) not in self._hook_filled and id(c) not in self._lists:
                    self._lists[id(c)] = (c, list(c), d.name)
            elif type(d) is dict and id(d) not in self._saved:
                self._saved[id(d)] = (d, dict(d))
                self._hook_filled.pop(id(d), None)

    def note_attributes(self, module: torch.nn.Module) -> None:
        """Note the dicts ``module`` holds as attributes (its caches)."""
        self.note(module_dicts(module))

    def state_changed(self) -> list[str]:
        """The entries the run changed, among those a dict or object had
        before it, that held or now hold a tensor (``self.k =
        torch.cat([self.k, x])``, a KV cache): state, which a graph would not
        update; an entry added (a cache filled) is not one."""
        return [
            repr(key)
            for d, saved in self._saved.values()
            for key, old, new in changed_entries(d, saved)
            if old is not ABSENT and (holds_tensor(new) or holds_tensor(old))
        ]

    def added_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Each entry the run added to a dict or object (none before), with
        each tensor it holds (NOTE [an entry a trace adds, from the inputs])."""
        return [
            (repr(key), tensor)
            for d, saved in self._saved.values()
            for key, old, new in changed_entries(d, saved)
            if old is ABSENT
            for tensor in _tensors_in(new)
        ]

    def lists_filled(self) -> list[str]:
        """Each list or deque the function names whose tensors or storages the
        run changed (NOTE [lists a function fills]), as one line."""
        return [
            f"the {type(c).__name__} {name}" if name else f"a {type(c).__name__} of {len(saved)} entries it closes over"
            for c, saved, name in self._lists.values()
            if _tensor_changes_in_list(c, saved)
        ]

    def filled_by_hooks(self) -> list[str]:
        """What the run changed, tensor or not, in a container a module hook
        fills (NOTE [what module hooks fill])."""
        return [change for c, saved in self._hook_filled.values() for change in _changes_in(c, saved)]

    def take_back(self) -> None:
        for d, saved in self._saved.values():
            changed = changed_entries(d, saved)
            if any(holds_tensor(new) or holds_tensor(old) for _, old, new in changed):
                # With the Python state that went with it (a cache layer's
                # is_initialized flag beside its tensors).
                for key, old, _ in changed:
                    put_back(d, key, old)
        self._saved.clear()
        for c, saved in self._hook_filled.values():
            _put_back_all(c, saved)  # NOTE [what module hooks fill]
        self._hook_filled.clear()
        for c, saved, _ in self._lists.values():
            if _tensor_changes_in_list(c, saved):  # NOTE [lists a function fills]
                _put_back_all(c, saved)
        self._lists.clear()


def _list_changes(now: list[Any] | collections.deque[Any], saved: list[Any]) -> list[Any]:
    """The entries of ``now`` that are not those of ``saved``, place by place."""
    return [v for i, v in enumerate(now) if i >= len(saved) or saved[i] is not v] + saved[len(now) :]


def _tensor_changes_in_list(now: list[Any] | collections.deque[Any], saved: list[Any]) -> bool:
    """Whether an entry of ``now`` that is not ``saved``'s in its place, or
    one of ``saved``'s it replaced or dropped, holds a tensor or a storage."""
    replaced = [old for i, old in enumerate(saved) if i >= len(now) or now[i] is not old]
    return any(map(_holds_tensor_or_storage, [*_list_changes(now, saved), *replaced]))


def _a_list(obj: Any) -> bool:
    return type(obj) in _LISTS


def dicts_named_by(
    fn: Callable[..., Any], modules: Iterable[torch.nn.Module] = ()
) -> list[dict[Any, Any] | ListNamed | HookFilled]:
    """The dicts ``fn`` can reach: those its code names from its closure or
    globals (or a ``functools.partial``'s arguments, or a bound method's
    ``self`` or a plain object it names holds), the dicts those hold, and
    those the ``modules`` and their submodules hold as attributes; as
    ``ListNamed``, the lists and deques ``fn`` reaches so (NOTE [lists a
    function fills]); and, as ``HookFilled``, the containers the hooks of
    those modules, and the global ones, can reach (NOTE [what module hooks
    fill])."""
    found = {id(d): d for d in reachable(fn, lambda obj: type(obj) is dict, stop=(torch.nn.Module,))}
    for d in list(found.values()):  # holder.cache[n] = ... in an object the code names
        for value in list(d.values()) if len(d) <= _ENTRIES else ():
            # cache.layers[i].keys: the objects a list of it holds, as
            # transformers' DynamicCache holds its tensors
            entries = value if isinstance(value, (list, tuple)) and len(value) <= _ENTRIES else (value,)
            for entry in entries:
                held = _attributes_of(entry) if type(entry) is not dict else entry
                if held is not None:
                    found.setdefault(id(held), held)
    subs = list({id(sub): sub for module in modules for sub in module.modules()}.values())
    for sub in subs:
        for value in module_dicts(sub):
            found.setdefault(id(value), value)
    filled = [HookFilled(c) for c in hook_containers(subs) if id(c) not in found]
    # NOTE [lists a function fills]
    named = _names_in_code(fn)
    lists = {id(c): ListNamed(c, named.get(id(c))) for c in reachable(fn, _a_list, stop=(torch.nn.Module,))}
    for sub in subs:
        for attribute, value in _user_attributes(sub):
            if _a_list(value) and id(value) not in lists:
                lists[id(value)] = ListNamed(value, f"{type(sub).__name__}.{attribute}")
    return [*found.values(), *lists.values(), *filled]


def _names_in_code(fn: Callable[..., Any]) -> dict[int, str]:
    """The name of each list or deque ``fn``'s code names from its closure
    or globals, by the object's id."""
    code_of = getattr(fn, "__func__", fn)
    if not inspect.isfunction(code_of):
        return {}
    names: dict[int, str] = {}
    for name, cell in zip(code_of.__code__.co_freevars, code_of.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        if _a_list(value):
            names.setdefault(id(value), name)
    for name in code_of.__code__.co_names:
        value = code_of.__globals__.get(name)
        if _a_list(value):
            names.setdefault(id(value), name)
    return names


def hook_containers(subs: list[torch.nn.Module]) -> list[Fillable]:
    """The containers the user's hooks on ``subs`` (every module, itself
    included, the function refers to), and the global ones, can fill, each
    once (NOTE [what module hooks fill]); none where no hook is."""
    hooks = user_hooks(subs)
    if not hooks:
        return []
    roots: list[Any] = []
    modules: list[torch.nn.Module] = []
    for hook in hooks:
        for obj in [*reachable(hook, _fillable_or_module, stop=(torch.nn.Module,)), *_object_state(hook)]:
            (modules if isinstance(obj, torch.nn.Module) else roots).append(obj)
    # The modules a hook gets as its argument: every one, for a global hook.
    hooked = subs if any(user_hook_ids(None)) else [sub for sub in subs if any(user_hook_ids(sub))]
    roots += [c for module in [*hooked, *modules] for c in _module_containers(module)]
    return list({id(c): c for c in _with_nested(roots)}.values())


def _fillable_or_module(obj: Any) -> bool:
    return fillable(obj) or isinstance(obj, torch.nn.Module)


# What a hook is, or is a method of, whose attributes are not the hook's state.
_NOT_PLAIN_OBJECTS = (functools.partial, type, types.ModuleType, torch.nn.Module)


def _object_state(hook: Any) -> list[Any]:
    """The attributes (a dict) of the object a hook is (a callable object)
    or is a method of, and the containers among them; and what the code of
    a callable object's ``__call__`` reaches. Nothing for a function or a
    partial, or a module's or class's method."""
    owner = getattr(hook, "__self__", None) if inspect.ismethod(hook) else hook
    if inspect.isroutine(owner) or isinstance(owner, _NOT_PLAIN_OBJECTS):
        return []
    attributes = getattr(owner, "__dict__", None)
    if type(attributes) is not dict:
        return []
    call = getattr(hook, "__call__", None) if owner is hook else None  # a callable object's, bound
    reached = reachable(call, _fillable_or_module, stop=(torch.nn.Module,)) if inspect.ismethod(call) else []
    return [attributes, *(value for value in list(attributes.values()) if fillable(value)), *reached]


def _with_nested(containers: list[Fillable]) -> list[Fillable]:
    """``containers``, and the containers a dict among them holds (one level,
    at most ``_ENTRIES`` entries a dict): ``acts["fc"].append(o)``."""
    nested = [
        value
        for c in containers
        if isinstance(c, dict) and len(c) <= _ENTRIES
        for value in list(c.values())
        if fillable(value)
    ]
    return [*containers, *nested]


@functools.cache
def _module_own_names() -> frozenset[str]:
    """The attributes every module holds: PyTorch's tables of parameters,
    buffers, submodules and hooks."""
    return frozenset(vars(torch.nn.Module()))


def _module_containers(module: torch.nn.Module) -> list[Fillable]:
    """The containers ``module`` holds as attributes the user set
    (``m.acts = []``): ``_user_attributes``'s values."""
    return [value for _, value in _user_attributes(module)]


def _user_attributes(module: torch.nn.Module) -> list[tuple[str, Fillable]]:
    """Each container ``module`` holds as an attribute the user set, with its
    name: neither PyTorch's tables nor, in a module class of PyTorch's own, a
    private attribute (an RNN's ``_flat_weights``)."""
    attributes = getattr(module, "__dict__", None)
    if type(attributes) is not dict:
        return []
    torch_class = type(module).__module__.startswith("torch.")
    return [
        (name, value)
        for name, value in list(attributes.items())
        if fillable(value) and name not in _module_own_names() and not (torch_class and name.startswith("_"))
    ]


def _attributes_of(obj: Any) -> dict[str, Any] | None:
    """The attribute dict of a plain object (not a tensor, module, function
    or class), where it has one."""
    attributes = getattr(obj, "__dict__", None)
    if type(attributes) is not dict or callable(obj) or isinstance(obj, (torch.Tensor, type)):
        return None
    return attributes


# A module's own tables, which real_writes.ModuleAttributesKept keeps.
_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})


def module_dicts(module: torch.nn.Module) -> list[dict[Any, Any]]:
    """The dicts ``module`` holds as attributes, besides its own tables."""
    attributes = getattr(module, "__dict__", None)
    if type(attributes) is not dict:
        return []
    return [v for k, v in attributes.items() if type(v) is dict and k not in _MODULE_TABLES]


def parametrize_cache() -> dict[Any, Any] | None:
    # torch.nn.utils.parametrize.cached() fills this module-level dict.
    from torch.nn.utils import parametrize

    cache = getattr(parametrize, "_cache", None)
    return cache if type(cache) is dict else None
