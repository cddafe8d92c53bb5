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
no call updated it, silently. So the dicts and lists the hooks of the
modules a function refers to (and the global hooks) can reach are noted too
(``HookFilled``), lists included: what a trial run adds to one is taken
back, so a list of activations gets only the real calls' entries; and a
trace that adds a tensor to one is refused (the call runs eagerly, with a
``FallbackWarning``), since only eager calls run the hook.

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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .module_hooks import user_hooks
from .references import reachable

ABSENT = object()  # an entry a table did not, or does not, have


def changed_entries(table: Any, saved: dict[Any, Any]) -> list[tuple[Any, Any, Any]]:
    """``(key, value then, value now)`` of each entry of ``table`` (a dict,
    or a module's table) that is not what ``saved``, a copy made before,
    holds; ``ABSENT`` for a value it did not, or does not, have."""
    changed = []
    for key in [*saved, *(k for k in table.keys() if k not in saved)]:
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
        return [t for v in value.values() for t in _tensors_in(v, depth + 1)]
    return []


def holds_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor, or a tuple, list or dict holding one
    (two levels deep)."""
    return bool(_tensors_in(value))


class HookFilled:
    """A dict or list a module hook can reach (NOTE [what module hooks fill])."""

    __slots__ = ("container",)

    def __init__(self, container: dict[Any, Any] | list[Any]) -> None:
        self.container = container


class CachesKept:
    """The dicts noted, each as it was when first noted; ``take_back`` puts
    back each entry changed since to a value holding a tensor (NOTE [trial
    runs leave caches as they found them]); and the dicts and lists module
    hooks fill (NOTE [what module hooks fill])."""

    def __init__(self) -> None:
        self._saved: dict[int, tuple[dict[Any, Any], dict[Any, Any]]] = {}
        self._hook_filled: dict[int, tuple[Any, Any]] = {}  # id -> (container, a copy)

    def note(self, dicts: Iterable[Any]) -> None:
        for d in dicts:
            if isinstance(d, HookFilled):
                c = d.container
                if id(c) not in self._hook_filled and id(c) not in self._saved:
                    self._hook_filled[id(c)] = (c, type(c)(c))
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

    def filled_by_hooks(self) -> list[str]:
        """What the run put in a dict or list a module hook fills that holds a
        tensor (NOTE [what module hooks fill])."""
        found = []
        for c, saved in self._hook_filled.values():
            if type(c) is dict:
                found += [repr(key) for key, _, new in changed_entries(c, saved) if holds_tensor(new)]
            elif any(holds_tensor(v) for v in _list_changes(c, saved)):
                found.append(f"an entry of a list of {len(c)}")
        return found

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
            if type(c) is dict:
                for key, old, new in changed_entries(c, saved):
                    if holds_tensor(new) or holds_tensor(old):
                        put_back(c, key, old)
            elif any(holds_tensor(v) for v in _list_changes(c, saved)):
                c[:] = saved
        self._hook_filled.clear()


def _list_changes(now: list[Any], saved: list[Any]) -> list[Any]:
    """The entries of ``now`` that are not those of ``saved``, place by place."""
    return [v for i, v in enumerate(now) if i >= len(saved) or saved[i] is not v] + saved[len(now) :]


def dicts_named_by(fn: Callable[..., Any], modules: Iterable[torch.nn.Module] = ()) -> list[dict[Any, Any] | HookFilled]:
    """The dicts ``fn`` can reach: those its code names from its closure or
    globals (or a ``functools.partial``'s arguments, or a bound method's
    ``self`` or a plain object it names holds), the dicts those hold, and
    those the ``modules`` and their submodules hold as attributes; and, as
    ``HookFilled``, the dicts and lists the hooks of those modules, and the
    global ones, can reach (NOTE [what module hooks fill])."""
    found = {id(d): d for d in reachable(fn, lambda obj: type(obj) is dict, stop=(torch.nn.Module,))}
    for d in list(found.values()):  # holder.cache[n] = ... in an object the code names
        for value in d.values() if len(d) <= _ENTRIES else ():
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
    filled = [
        HookFilled(c)
        for hook in user_hooks(subs)
        for c in reachable(hook, lambda obj: type(obj) in (dict, list), stop=(torch.nn.Module,))
        if id(c) not in found
    ]
    return [*found.values(), *{id(h.container): h for h in filled}.values()]


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
