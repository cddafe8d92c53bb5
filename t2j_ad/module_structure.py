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
itself, by a flag it reads, is NOTE [a submodule switched by its own
forward]. The global hooks are part of it even
for a function that names no module (one that makes its module inside,
or reaches it two objects down), since they run on every module.

NOTE [a submodule switched by its own forward]
A forward may bind the name itself on every call, by a flag it reads
(``self.act = self.drop if self.noisy else self.ident``, ``self.active =
self.heads[self.k]``). Nothing watches the flag, plain Python, and the
structure a call finds at its start is the one the previous call left:
after ``net.noisy = True`` the first ``value_and_grad`` (or ``grad``, or a
``jax.jit`` of it traced then) found the structure as before, its rule
bound the calls of a function that draws nothing, and its value call then
bound the dropout, so the derivative, which would have drawn a second
mask, was refused (the next call, finding the dropout bound, was right);
in graph mode, which replays no binding, the value and gradient were the
old head's, silently, until some eager run of the module bound the name.
So the runs that infer a signature's shapes also note the submodules the
function's own run binds to the modules it refers to (the global
registration hook: ``_bindings_made``), and the flags of the modules it
binds them to: their plain attributes that hold a bool, number, string or
None. For a function that binds some, a lookup of its signature outside a
compiled program (a call without ``jax.jit``, a trace) that finds those
flags changed makes one more trial run, with the flags as they are now
(``StructureSeen.binds_as_before``), and resolves the signature again when
it binds other submodules than the runs that resolved it did: the first
call after the flag changed is then right, as a call after the caller
switched the name is, in every compile mode. A trial run on every lookup
cost a small module's plain call 50x (9 ms instead of 0.18 ms); with the
flags compared first, one dict scan per lookup, and the trial run only
after a flag changed. An attribute that changed while the trial run bound
as before is no flag from then on: a step counter the forward keeps
(``self.calls += 1``) beside the flag made a trial run on every call
(4-6x a plain call). A flag read elsewhere (a global, ``self.cfg.noisy``)
is not compared: its first call after a change is refused, or in graph
mode keeps the old head, as before. A flag switched back and forth infers
(and in graph mode traces) again on each switch.
What does not change: a ``jax.jit`` traced before the flag changed keeps
the calls it bound (its derivatives are refused where the function now
draws or writes otherwise, as after ``module.train()``, and its graphs keep
the branch they traced, as for any Python state a function reads); and a
structure the caller changes between a value call and its derivative is
still refused by the derivative's runner (runtime.py), which compares the
structure as it is then.

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

NOTE [a hook registered again]
A notebook loop registers a hook around every call (``h =
net.fc.register_forward_hook(save); out = f(x); h.remove()``): each handle
has a new id, so the structure, which held the hooks by their handles'
ids, changed on every call, and every call inferred its output shapes
again (and in graph mode traced again). So the structure holds each hook
as what it runs (``module_hooks.SameHook``): the same function object, or
a function made again from the same code object, with the same module
globals, defaults and closure contents (each the same object, or equal
plain numbers and strings, and so each global it names: ``lambda m, a, o:
o * 2`` defined again in the loop is the same hook, ``lambda m, a, o: o *
scale`` after ``scale`` changed is not, whether ``scale`` is a global or
a variable it closes over, since a graph traced with the hook holds the
number; the globals and the closure's contents are read when the hook is
seen, since hooks made again by one call of an enclosing function share
its cells: ``for s in (2.0, 3.0): h = lin.register_forward_hook(lambda m,
a, o: o * s)`` compared alike, and a graph kept 2.0), or a method bound
again to the same object; with its
flags (``with_kwargs``, ``always_call``, a full backward hook or not), in
its table's order. A call that finds a hook's handle gone therefore
compares the structure, and where the same hooks are back in the same
places it keeps its signature and only notes where they are now. A hook
that does something else (``o * 2`` replaced by ``o * 3``, another
object's method) is another structure, resolved again. What a hook reads
further (an attribute of an object it closes over: ``o * cfg.scale``) is
no more seen than when the one hook stays registered, nor than in the
function itself (README, "Notebooks").

NOTE [a structure seen before]
Swapping a submodule back and forth (``net.head = head_a`` then ``head_b``
each step, ``net.active = net.heads[i]``) resolved the signature again on
every swap: it inferred output shapes, traced its graphs again in graph
mode, and made a new ``BaseFn``, so a new ``TorchFn`` and a new program in
JAX's caches (about 2.9 MB a swap, until ``jax.clear_caches()``). So a
jaxified function keeps, per input signature, the resolutions of the last
few structures it left (``_STRUCTURES_KEPT`` in api.py), and a structure
change first looks there: one whose structure holds again
(``holds_with_its_tensors``) is taken back, with its ``TorchFn``, its
graphs and its place in JAX's caches. Only an exact match counts: the same
submodule objects (held weakly: a module dropped is never matched by
another at its address), parameter and buffer names, children, hooks (NOTE
[a hook registered again]) and names the function reads, and every
parameter and buffer the same tensor, of the shape and dtype it had when
the signature was resolved; anything else resolves again, as before. The
resolutions kept hold their graphs; ``compile_stats()`` counts them, and
keeps the counts of those it drops beyond the few kept.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.modules.module as _module_hooks  # public: torch.nn.modules.module.register_module_*_hook
from torch.nn.parameter import is_lazy

from .module_hooks import HookPlace, hooks_still_in_place, user_hook_places, user_hooks_registered, user_hooks_seen
from .named_bindings import BindingsSeen

# How many submodules, parameters and buffers have been registered on any
# module since import; read without a lock (a stale read only costs a walk).
_registered = [0]
# One list per block watching now (``_bindings_made``): each submodule bound
# to a module within it, as (module, name, submodule), from any thread.
_bindings_watched: list[list[tuple[Any, str, Any]]] = []


def _count(*_: Any) -> None:
    _registered[0] += 1


def _count_and_note(module: Any, name: str, submodule: Any) -> None:
    """Count a submodule registered, and note it for the runs watched now
    (NOTE [a submodule switched by its own forward])."""
    _registered[0] += 1
    for made in _bindings_watched:
        made.append((module, name, submodule))


_module_hooks.register_module_module_registration_hook(_count_and_note)
_module_hooks.register_module_parameter_registration_hook(_count)
_module_hooks.register_module_buffer_registration_hook(_count)


def registrations() -> tuple[int, int]:
    """How many submodules, parameters and buffers, and how many hooks, have
    been registered so far (NOTE [a hook added after a call])."""
    return _registered[0], user_hooks_registered()


def nothing_moved(registered: tuple[int, int], since: tuple[int, int], places: Sequence[HookPlace]) -> bool:
    """Whether nothing was registered between the counts ``since`` and
    ``registered`` (``registrations()`` then and now) and every hook
    ``places`` names is still in its table, so that the structure need not
    be compared (NOTE [a hook removed after a call]); where this is False,
    the structure is compared hook by hook as what they run, and the same
    hooks back in their places hold (NOTE [a hook registered again])."""
    return registered == since and hooks_still_in_place(places)


def _submodules(modules: Sequence[Any]) -> list[Any]:
    """Every submodule of ``modules``, each root's in order."""
    return [sub for root in modules for sub in root.modules()]


def _structure(submodules: Sequence[Any]) -> tuple[Any, ...]:
    """Each of ``submodules`` (by identity) with the names of its parameters
    and buffers, in order, each of its children by name (NOTE [a submodule
    switched by name]), and its hooks as what they run (NOTE [a hook
    registered again]); and the global hooks, which reach modules the
    function makes or does not name too."""
    return (
        *(
            (
                id(sub),
                tuple(sub._parameters.keys()),
                tuple(sub._buffers.keys()),
                tuple((name, id(child)) for name, child in sub._modules.items()),
                user_hooks_seen(sub),
            )
            for sub in submodules
        ),
        user_hooks_seen(None),
    )


def _weak_refs(objects: Sequence[Any]) -> tuple[Any, ...]:
    """A weak reference to each of ``objects`` (the object itself where it
    takes none)."""
    refs = []
    for obj in objects:
        try:
            refs.append(weakref.ref(obj))
        except TypeError:
            refs.append(lambda obj=obj: obj)
    return tuple(refs)


def _still(refs: Sequence[Any], objects: Sequence[Any]) -> bool:
    """Whether ``refs`` (``_weak_refs``) reach ``objects``, in order."""
    return len(refs) == len(objects) and all(ref() is obj for ref, obj in zip(refs, objects))


def _tensors(submodules: Sequence[Any]) -> list[Any]:
    """The parameters and buffers of ``submodules``, in order (None where a
    name holds none)."""
    return [t for sub in submodules for table in (sub._parameters, sub._buffers) for t in table.values()]


def _layout(tensor: Any) -> Any:
    """The shape and dtype of ``tensor``; None for none, and a lazy module's
    parameter, which has neither yet, as uninitialized."""
    if tensor is None:
        return None
    if is_lazy(tensor):
        return "uninitialized"
    return tuple(tensor.shape), tensor.dtype


def _layouts(tensors: Sequence[Any]) -> tuple[Any, ...]:
    """The shape and dtype of each of ``tensors``."""
    return tuple(map(_layout, tensors))


@contextlib.contextmanager
def _bindings_made() -> Iterator[list[tuple[Any, str, Any]]]:
    """Within the block, each submodule bound to a module, as (module, name,
    submodule), in order (NOTE [a submodule switched by its own forward])."""
    made: list[tuple[Any, str, Any]] = []
    _bindings_watched.append(made)
    try:
        yield made
    finally:
        del _bindings_watched[next(i for i, m in enumerate(_bindings_watched) if m is made)]


# A submodule bound by a function's own run: (id(module), name) -> the submodule.
_OwnBindings = dict[tuple[int, str], Any]


def _same_bindings(now: _OwnBindings, before: _OwnBindings) -> bool:
    return now.keys() == before.keys() and all(now[slot] is before[slot] for slot in now)


# The types of the plain attributes taken for flags (NOTE [a submodule
# switched by its own forward]).
_FLAG_TYPES = (bool, int, float, str, type(None))


def _flags_of(modules: Sequence[Any], not_flags: frozenset[str] = frozenset()) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """The plain attributes of ``modules`` that hold a bool, number, string
    or None (``self.noisy``, ``self.k``), by name, in order; but those named
    in ``not_flags`` (``"index.name"``: attributes found to change without
    changing what the function binds, a step counter)."""
    return tuple(
        tuple(
            (name, value)
            for name, value in vars(module).items()
            if type(value) in _FLAG_TYPES and f"{i}.{name}" not in not_flags
        )
        for i, module in enumerate(modules)
    )


def _changed(before: tuple[Any, ...], now: tuple[Any, ...]) -> frozenset[str]:
    """The attributes (``"index.name"``) whose value differs between two
    ``_flags_of`` readings, or that only one of them has."""
    changed: set[str] = set()
    for i, (a, b) in enumerate(zip(before, now)):
        was, is_now = dict(a), dict(b)
        changed |= {f"{i}.{name}" for name in was.keys() | is_now.keys() if was.get(name, _NONE) != is_now.get(name, _NONE)}
    return frozenset(changed)


_NONE = object()  # an attribute one reading has and the other not


class ModuleChangedError(TypeError):
    """A module changed after ``jaxify_module`` so that a call cannot run it
    as asked (a parameter ``params`` names is gone); raised as it is, also
    from the runs that infer output shapes."""


class StructureSeen:
    """The structure of ``modules`` now, and what the names ``bindings``
    remembers hold (NOTE [a name rebound after a call] in named_bindings.py);
    ``holds()`` says whether both still are as they were."""

    __slots__ = (
        "_modules",
        "_registered",
        "_structure",
        "_submodules",
        "_tensors",
        "_layouts",
        "_hooks",
        "_bindings",
        "_own_bindings",
        "_binders",
        "_flags",
        "_not_flags",
    )

    def __init__(self, modules: Sequence[Any], bindings: BindingsSeen | None = None) -> None:
        self._modules = tuple(modules)
        self._registered = registrations()
        submodules = _submodules(self._modules)
        self._structure = _structure(submodules)
        # NOTE [a structure seen before]: the objects, not only their ids.
        self._submodules = _weak_refs(submodules)
        tensors = _tensors(submodules)
        self._tensors = _weak_refs([t for t in tensors if t is not None])
        self._layouts = _layouts(tensors)
        # NOTE [a hook removed after a call]
        self._hooks = user_hook_places(submodules)
        self._bindings = bindings
        # NOTE [a submodule switched by its own forward]: what the function's
        # own run binds, the modules it binds them to, and their flags then.
        self._own_bindings: _OwnBindings = {}
        self._binders: tuple[Any, ...] = ()
        self._flags: tuple[Any, ...] = ()
        self._not_flags: frozenset[str] = frozenset()

    @contextlib.contextmanager
    def noting_its_own_bindings(self) -> Iterator[None]:
        """Around the runs that infer the function's shapes: note which
        submodules its own run binds to its modules, and the flags of the
        modules it binds them to (NOTE [a submodule switched by its own
        forward])."""
        with _bindings_made() as made:
            yield
        own = self._of_its_modules(made)
        self._binders = tuple({id(module): module for module, _, _ in own}.values())
        self._own_bindings = {(id(module), name): sub for module, name, sub in own}
        self._flags = _flags_of(self._binders, self._not_flags)

    def binds_its_own_submodules(self) -> bool:
        """Whether the function's own run binds submodules to its modules
        (``self.act = self.drop if self.noisy else self.ident``)."""
        return bool(self._own_bindings)

    def binds_as_before(self, trial_run: Callable[[], object]) -> bool:
        """Whether the function binds the submodules its runs bound when the
        signature was resolved (NOTE [a submodule switched by its own
        forward]): yes while the modules it binds them to keep their flags,
        else as ``trial_run``, a trial run of the function with the flags as
        they are now, binds; a run that fails binds otherwise (the
        signature is resolved again, and names the failure)."""
        flags = _flags_of(self._binders, self._not_flags)
        if flags == self._flags:
            return True
        with _bindings_made() as made:
            try:
                trial_run()
            except Exception:  # noqa: BLE001 - resolving the signature again reports it
                return False
        now = {(id(module), name): sub for module, name, sub in self._of_its_modules(made)}
        if not _same_bindings(now, self._own_bindings):
            return False
        # What changed without changing the bindings is no flag, but state
        # the forward keeps (``self.step += 1``): compared on, it would
        # cost a trial run on every call.
        self._not_flags |= _changed(self._flags, flags)
        self._flags = _flags_of(self._binders, self._not_flags)
        return True

    def _of_its_modules(self, made: list[tuple[Any, str, Any]]) -> list[tuple[Any, str, Any]]:
        """The bindings of ``made`` to the function's modules (those another
        thread made to other modules meanwhile left out); the last one of a
        name wins where the dict is built."""
        ids = {id(sub) for sub in _submodules(self._modules)}
        return [(module, name, sub) for module, name, sub in made if id(module) in ids]

    def now(self) -> tuple[Any, ...]:
        """The structure of the modules, and what the names hold, as they are now."""
        return _structure(_submodules(self._modules)), () if self._bindings is None else self._bindings.now()

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
        return self.modules_hold()

    def runs_modules(self) -> bool:
        """Whether the function runs any module it names."""
        return bool(self._modules)

    def modules_hold(self) -> bool:
        """``holds()`` for the modules alone, the names the function reads
        aside (NOTE [a derivative called apart from its value] in
        split_derivatives.py)."""
        registered = registrations()
        if nothing_moved(registered, self._registered, self._hooks):
            return True
        submodules = _submodules(self._modules)
        structure = _structure(submodules)
        if structure != self._structure or not _still(self._submodules, submodules):
            return False
        # Something else was registered, or the same hooks again (NOTE [a
        # hook registered again]): nothing to walk next time. Held as they
        # are now, so hooks made again in a loop do not keep the first alive.
        self._structure = structure
        self._hooks = user_hook_places(submodules)
        self._registered = registered
        return True

    def holds_with_its_tensors(self) -> bool:
        """``holds()``, and each parameter and buffer is the tensor it was
        when the signature was resolved, of that shape and dtype: a
        resolution set aside may be taken back (NOTE [a structure seen
        before])."""
        if not self.holds():
            return False
        tensors = _tensors(_submodules(self._modules))
        return _still(self._tensors, [t for t in tensors if t is not None]) and _layouts(tensors) == self._layouts
