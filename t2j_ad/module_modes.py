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
now (``torch.compile`` guards on the same flag). Checking costs one dict
lookup per recorded module per call (NOTE [a forward replaced after a
trace] adds one more), and nothing for functions that call no module. A
module whose method the function calls directly (``jaxify(
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
silently. So what is recorded of a dropout module (``nn.Dropout`` and its
kin) is its flag and its rate, and of a ``MultiheadAttention`` or a
recurrent module (``nn.LSTM``, ``GRU``, ``RNN``, which drop out between
stacked layers) its flag and its ``dropout``: a changed rate is a changed mode, with a graph and
effects of its own. Checking reads one attribute per such module per call;
modules of other kinds add nothing.
A rate annealed every step (scheduled dropout) then found the effects
again on every step, a trial run each (20-30 ms a step where a step took
1-2 ms): the effects (what a function draws and writes) are kept by
whether each dropout draws, which changes only at 0 (and 1), while a
graph, which holds the rate as a constant, is traced per rate (NOTE [how
many graphs a function keeps] in graph_mode.py bounds how many are kept),
for a few rates in a row: after those, new rates run eagerly until one
stays for as long as its trace would take, which is traced (NOTE [a
setting changed every step] in graph_mode.py; ``hold_but_setting``).

NOTE [a forward replaced after a trace]
A graph holds the ops of the ``forward`` each module ran when it was
traced. A notebook cell that then replaces one (``lin.forward = lambda z:
...`` on an instance, LoRA-style; ``nn.Tanh.forward = new_fn`` on a
class) left the graph replaying the old one: value and gradient stale, no
warning, where eager calls run the new one. NOTE [a name rebound after a
call] (named_bindings.py) sees such a change only on the user's own
modules and on those the function names, not on PyTorch's built-in
submodules. So what is recorded of each module a trace ran is also the
``forward`` it held as an attribute of its own (None for most), and of
each of their classes the ``forward`` it defines or inherits; a graph is
used only while they are the same, as its training flags are, and the
effects of a function (what it draws and writes: NOTE [derivatives
replay the value's draws] in replayed_calls.py) are found again for the
forwards as they are now. The check stays near the cost of the flags'
alone: each module's flag, then its own ``forward`` entry, read from its
``__dict__`` for all modules at once in C (``map(dict.get, ...)``) and
compared as lists, and one lookup per class. On the 40-layer module of
benchmarks/bench_call_latency.py (81 modules, a jitted graph-mode call
of about 345 us on the 2-core CPU machine) the check that read the flags
in a Python loop cost about 10 us a call, and this one about 14 us.

NOTE [the submodules a graph ran]
A graph holds the ops of the submodules each module ran when it was
traced. Under ``jax.jit`` its program keeps calling that graph after
``net.head = other_head`` (or ``net.active = net.heads[1]``): the swap
changes no training flag or ``forward`` of the modules the trace ran, so
``jax.jit(jax.value_and_grad(f))`` in graph mode kept replaying the first
head, silently (1.0528 where PyTorch gives 1.5137), where eager calls read
``net.head`` as it is. (Without ``jax.jit``, each call resolves its
signature for the structure as it is: NOTE [a submodule switched by name]
in module_structure.py.) So what is recorded of each module a trace ran is
also its table of children, by name and identity (a copy, which keeps
them alive, so a new module at a dead one's address never matches), and a
graph is used only while each table holds them: a swap traces the graph of
the new head, and a head swapped back takes back its own graph, kept
beside it under the modules it ran. Checking compares the tables in C, one
dict comparison per module that held children when traced; on the
81-module network of benchmarks/bench_call_latency.py, one table of 80,
about 1 us a call. A child given to a module that had none (an empty
``nn.Sequential`` appended to, which its forward then runs) is seen by
NOTE [the hooks a graph ran], as any registration is.
A fresh head given on every step (``net[2] = nn.Linear(...)`` with new
weights: a hypernetwork, a notebook cell run again) is then a new
setting on every step, as a hook made anew is: the children are part of
the setting a graph is keyed by (``setting``), and such a setting runs
eagerly after a few traced (NOTE [a setting changed every step] in
graph_mode.py).
A submodule a forward picks by a flag it reads (``self.act = self.drop
if self.noisy else self.ident``) is bound by the forward, which a replay
does not run: the flag is Python state a graph reads once per trace
(NOTE [a graph per training mode]).

NOTE [the hooks a graph ran]
A graph holds the ops of the hooks that ran with its modules, and of
those that rebind their tensors: ``torch.nn.utils.prune`` (a forward
pre-hook binding ``weight = weight_orig * weight_mask``, NOTE [attributes
PyTorch's hooks recompute] in real_writes.py) applied after a ``jax.jit``
of ``value_and_grad`` compiled left the program replaying the unpruned
graph, silently (-0.7076 where PyTorch gives -0.1963, and an unmasked
gradient); a hook added or removed, or a child appended to a container
empty when traced, the same. Without ``jax.jit`` a call resolves its
signature again (NOTE [a hook added after a call] and NOTE [a submodule
replaced after a call] in module_structure.py); a compiled program does
not. So what is recorded of the modules a trace ran is also how many
submodules, parameters, buffers and hooks had been registered anywhere
(``module_structure.registrations``, two counters), where their hooks are
(one dict lookup per hook, to see one removed), and, compared only once
the counters moved, every module's children and every hook of theirs and
the global ones as what they run (NOTE [a hook registered again]): a
graph is used only while those hold, and otherwise the graph for the
modules as they are now is found or traced, as for a changed training
flag. A registration elsewhere that changes none of them costs one
comparison, then the counters are taken as they are. A function that ran
no module assumes none of this: a global hook added after a ``jax.jit``
of it compiled is Python state read once per trace (docs/compile-modes.md).
A hook found gone from its place was first taken for a change at once,
where the signature's structure compares the hooks as what they run
(NOTE [a hook registered again] in module_structure.py): a notebook loop
registering the same hook around every call (``h =
net[2].register_forward_hook(save); step(x); h.remove()``) under a
compiled ``jax.jit`` traced its graphs again on every step: right
values, but 86-184 ms a step where the loop without the hook takes
0.27-0.47 ms (the ``jit graph`` pair of benchmarks/bench_module_changes.py,
on the shared 2-core CPU machine). So a hook gone makes the structure be
compared, as a registration does, by the one check both use
(``module_structure.nothing_moved``): the same hook back in its place
keeps the graph (0.74-0.80 ms a step); another hook (other code, or the same
code closing over another value), or none, does not; a one-shot hook is
as NOTE [a hook that removed itself in a trace] in graph_mode.py says.
Another hook registered on every step (``lambda m, a, out, f=1 + 1e-3 *
step: out * f``, the old one removed) is then a new setting on every
step, as an annealed dropout rate is: the hooks are part of the setting
a graph is keyed by, with the rates and the children, beside its
modules' flags and forwards (``setting``, ``setting_now``,
``hold_but_setting``), and such a setting runs eagerly after a few
traced (NOTE [a setting changed every step] in graph_mode.py).
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from typing import Any

import torch
from torch.nn.modules.lazy import LazyModuleMixin

from .module_hooks import hooks_still_in_place, own_global_hooks, user_hook_places, user_hooks_seen
from .module_structure import nothing_moved, registrations
from .references import Same, reachable

_TRAINING = operator.attrgetter("training")


def _class_forwards(classes: Sequence[type]) -> list[Any]:
    """The ``forward`` each of ``classes`` defines or inherits."""
    return [getattr(cls, "forward", None) for cls in classes]


def _own_forward(module: torch.nn.Module) -> Any:
    """The ``forward`` set on ``module`` itself (``lin.forward = ...``), or None."""
    return getattr(module, "__dict__", {}).get("forward")


# The modules whose forward reads a rate of dropout, and that attribute's
# name (NOTE [a dropout's rate is part of its mode]).
_RATED = (
    (torch.nn.modules.dropout._DropoutNd, "p"),
    (torch.nn.MultiheadAttention, "dropout"),
    (torch.nn.RNNBase, "dropout"),  # between the layers of a stacked LSTM, GRU or RNN
)


def _rate_attribute(module: torch.nn.Module) -> str | None:
    """The name of the attribute ``module``'s forward reads its rate of
    dropout from, or None."""
    for kind, name in _RATED:
        if isinstance(module, kind):
            return name
    return None


def _flag_in_its_dict(module: torch.nn.Module) -> bool:
    """Whether ``module.training`` is what its ``__dict__`` holds (no class
    of it defines ``training``: a property, say)."""
    return not hasattr(type(module), "training") and "training" in getattr(module, "__dict__", {})


class ModuleModes:
    """Each module a trace ran, in the order they ran, with its training flag
    then, and the ``forward`` it and its class held (NOTE [a graph per
    training mode], NOTE [a forward replaced after a trace]); iterating
    gives each module with its flag."""

    __slots__ = (
        "modules",
        "_flags",
        "_attributes",
        "_own_forwards",
        "_plain",
        "_plain_flags",
        "_others",
        "_other_flags",
        "_classes",
        "_class_forwards",
        "_rated",
        "_rates",
        "_parents",
        "_children",
        "_held_children",
        "_registered",
        "_hook_places",
        "_structure",
        "_setting_read",
    )

    def __init__(self, seen: Sequence[tuple[torch.nn.Module, bool, Any]] = ()) -> None:
        self.modules = tuple(module for module, _, _ in seen)
        self._flags = [flag for _, flag, _ in seen]
        self._attributes = [getattr(module, "__dict__", {}) for module in self.modules]
        self._own_forwards = [forward for _, _, forward in seen]
        # The flags read from the modules' dicts where they are there (most
        # modules: a dict lookup), else as attributes.
        plain = [_flag_in_its_dict(module) for module in self.modules]
        self._plain = [a for a, p in zip(self._attributes, plain) if p]
        self._plain_flags = [flag for flag, p in zip(self._flags, plain) if p]
        self._others = [module for module, p in zip(self.modules, plain) if not p]
        self._other_flags = [flag for flag, p in zip(self._flags, plain) if not p]
        self._classes = tuple({type(module): None for module in self.modules})
        self._class_forwards = _class_forwards(self._classes)
        # NOTE [a dropout's rate is part of its mode]
        named = ((module, _rate_attribute(module)) for module in self.modules)
        self._rated = [(module, name) for module, name in named if name is not None]
        self._rates = self._rates_now()
        # NOTE [the submodules a graph ran]: of the modules that hold some,
        # copies of their tables of children, which keep the children alive.
        tables = [getattr(module, "__dict__", {}).get("_modules") for module in self.modules]
        self._parents = [attributes for attributes, table in zip(self._attributes, tables) if table]
        self._children = [dict(table) for table in tables if table]
        self._held_children = [bool(table) for table in tables]
        # NOTE [the hooks a graph ran]: what was registered anywhere so far,
        # where the modules' hooks are, and the structure to compare once
        # something more was registered.
        self._registered = registrations()
        self._hook_places = user_hook_places(self.modules)
        self._structure = self._structure_now()
        # The hooks and every module's children as ``setting_now`` last read
        # them, with what was registered then and where the hooks were (NOTE
        # [a setting changed every step] in graph_mode.py).
        self._setting_read = (self._registered, self._hook_places, self._structure[1], self._structure[0])

    def _structure_now(self) -> tuple[Any, ...]:
        """Every module's children, and its hooks and the global ones as what
        they run (NOTE [the hooks a graph ran])."""
        return self._every_child_table(), self._hooks_seen()

    def _every_child_table(self) -> tuple[dict[str, Any], ...]:
        """A copy of every module's table of children, as it is now."""
        return tuple(dict(getattr(module, "__dict__", {}).get("_modules") or {}) for module in self.modules)

    def _hooks_seen(self) -> tuple[Any, ...]:
        """Every module's hooks and the global ones as what they run, as
        they are now (NOTE [a hook registered again] in module_structure.py)."""
        return tuple(map(user_hooks_seen, (*self.modules, None)))

    def _structure_holds(self) -> bool:
        """Whether the modules hold the children and hooks they held, where
        something was registered since or a hook left its place (NOTE [the
        hooks a graph ran]), the same hooks back counting as held (NOTE [a
        hook registered again] in module_structure.py); if so, nothing is
        compared again until something more is registered or removed."""
        registered = registrations()
        if nothing_moved(registered, self._registered, self._hook_places):
            return True
        structure = self._structure_now()
        if structure != self._structure:
            return False
        # Held as they are now, so hooks made again in a loop do not keep
        # the first alive (as StructureSeen.holds does).
        self._structure = structure
        self._registered = registered
        self._hook_places = user_hook_places(self.modules)
        return True

    def hooks_in_place(self) -> bool:
        """Whether each hook the modules held when last compared is still in
        its table (NOTE [the hooks a graph ran])."""
        return hooks_still_in_place(self._hook_places)

    def _children_now(self) -> list[Any]:
        """The table of children (``_modules``) of each module that held
        some, as it is now."""
        return list(map(dict.get, self._parents, repeat("_modules")))

    def _rates_now(self) -> list[Any]:
        return [getattr(module, name) for module, name in self._rated]

    def rates(self) -> tuple[Any, ...]:
        """The rates of dropout recorded, in order (NOTE [a dropout's rate is
        part of its mode])."""
        return tuple(self._rates)

    def rates_now(self) -> tuple[Any, ...]:
        """The rates of dropout of the modules recorded, as they are now."""
        return tuple(self._rates_now())

    def setting(self) -> tuple[Any, ...]:
        """What a graph is keyed by beyond its modules' flags and forwards,
        as recorded: the rates of dropout, the hooks as what they run, and
        every module's children (NOTE [a setting changed every step] in
        graph_mode.py)."""
        return self.rates(), self._structure[1], self._structure[0]

    def setting_now(self) -> tuple[Any, ...]:
        """``setting`` as it is now; the hooks and children read again only
        once something was registered or a hook left its place since they
        were last read, or a table of children held when traced changed
        (NOTE [the hooks a graph ran], NOTE [the submodules a graph ran])."""
        registered = registrations()
        since, places, hooks, tables = self._setting_read
        if not nothing_moved(registered, since, places) or self._children_now() != self._children_in(tables):
            hooks, tables = self._hooks_seen(), self._every_child_table()
            self._setting_read = (registered, user_hook_places(self.modules), hooks, tables)
        return self.rates_now(), hooks, tables

    def _children_in(self, tables: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
        """Of ``tables`` (``_every_child_table``), those of the modules that
        held children when traced, as ``_children_now`` lists them."""
        return [table for table, held in zip(tables, self._held_children) if held]

    def __len__(self) -> int:
        return len(self.modules)

    def __iter__(self) -> Iterator[tuple[torch.nn.Module, bool]]:
        return zip(self.modules, self._flags)

    def hold(self) -> bool:
        """Whether every module still has the training flag it had, it and
        its class the ``forward`` they held, and it the children and hooks
        it held; each read for all modules at once, in C (NOTE [a forward
        replaced after a trace], NOTE [the submodules a graph ran], NOTE
        [the hooks a graph ran])."""
        return (
            self._flags_and_forwards_hold()
            and (not self._rated or self._rates_now() == self._rates)
            and self._structure_kept()
        )

    def hold_but_setting(self) -> bool:
        """Whether all but the ``setting`` holds: each module's flag, its
        own ``forward`` and its class's; the rates of dropout, the hooks
        and every module's children aside (NOTE [a setting changed every
        step] in graph_mode.py)."""
        return self._flags_and_forwards_hold()

    def _flags_and_forwards_hold(self) -> bool:
        """Whether each module's flag, its own ``forward`` and its class's hold."""
        return (
            list(map(dict.get, self._plain, repeat("training"))) == self._plain_flags
            and list(map(_TRAINING, self._others)) == self._other_flags
            and list(map(dict.get, self._attributes, repeat("forward"))) == self._own_forwards
            and _class_forwards(self._classes) == self._class_forwards
        )

    def _structure_kept(self) -> bool:
        """Whether each module's children and hooks hold, a hook gone and
        back counting as held (NOTE [the submodules a graph ran], NOTE [the
        hooks a graph ran])."""
        return self._children_now() == self._children and self._structure_holds()

    def now(self) -> tuple[Any, ...]:
        """The training flags and forwards as they are now, by identity (kept
        alive with what they key), and whether each dropout draws: what
        effects found for them are kept by (NOTE [a dropout's rate is part
        of its mode])."""
        return (
            tuple(map(_TRAINING, self.modules)),
            tuple(Same(forward) for forward in map(_own_forward, self.modules)),
            tuple(Same(forward) for forward in _class_forwards(self._classes)),
            tuple(map(_how_it_draws, self._rates_now())),
        )


def _how_it_draws(rate: Any) -> Any:
    """What a dropout's rate says of its draws: none at 0 (and at 1, all
    dropped), else the same draws at any rate between."""
    return rate if isinstance(rate, (int, float)) and rate in (0, 1) else "between 0 and 1"


NO_MODES = ModuleModes()


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
        self.seen: dict[int, tuple[torch.nn.Module, bool, Any]] = {}

    def __call__(self, module: torch.nn.Module, args: object) -> None:
        if threading.get_ident() == self.thread and id(module) not in self.seen:
            refuse_uninitialized(module)
            self.seen[id(module)] = (module, bool(module.training), _own_forward(module))

    def modes(self) -> ModuleModes:
        return ModuleModes(tuple(self.seen.values()))


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
    """Whether every recorded module still has the training flag, and the
    ``forward``, it had (NOTE [a forward replaced after a trace])."""
    return modes.hold()
