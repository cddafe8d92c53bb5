"""Runs of the user's function made only to learn something (a trace, shape
inference) leave the tensors it closes over as they found them.

NOTE [trial runs do not write to real tensors]
Two runs of a user's function are not calls: graph mode's trace, on fake
tensors, and shape inference, on meta tensors or zeros. Both can still write,
for real, to tensors the function closes over. FakeTensorMode computes an op
whose tensor arguments are all real (a closed-over buffer and Python numbers)
for real, as constant propagation, in-place ops included; a meta run does the
same for ops on real 0-d tensors; and a run on zeros is real throughout.
BatchNorm's ``num_batches_tracked += 1`` ran in each: after the first call a
graph-mode module counted 2 batches where PyTorch counts 1, and a module
whose meta run failed (``BatchNorm1d(momentum=None)`` reads the count with
``float()``) averaged a batch of zeros into its running statistics. So these
runs go through a dispatch mode that copies a real tensor's value before its
first in-place write, and puts every such value back when the run ends. An
in-place write is an argument the op's schema marks as written, and the
running statistics batch norm's kernels update unmarked
(``_UNDECLARED_WRITES``). The calls themselves make the writes: a value
call once, as in PyTorch, and a derivative call none (NOTE [derivatives do
not write again] in state_writes.py). The same dispatch mode tells which
written tensors the function keeps between calls: one bound to a module
that ran, or one no op of the run made (the storages of every op's fresh
results are noted); the others are its own temporaries.

A module's ``forward`` may also rebind an attribute to a new tensor
(``self.ema = 0.5 * self.ema + 0.5 * x``), or one of a submodule's
(``self.child.ema = ...``): the zeros run halved such an average, and a
trace left the module holding fake tensors for good. So when a module's
``forward`` starts on the trial run's thread (PyTorch's global forward
hooks), the parameters, buffers and tensor attributes of that module and of
every module under it are noted, unless an enclosing ``forward`` noted them,
and any of them rebound is put back when that ``forward`` ends, returned or
raised: inside whatever bound tensors in around the call (jaxify_module's
parameters), which then puts its own back. A graph cannot replay a
rebinding, which is Python, so a trace that made one is refused
(``trace_refusals.refuse_module_side_effects``). A binding the function makes
before any module it reaches runs (a plain function assigning
``model.ema = ...``) is Python state of its own, read once per trace. Each
rebinding is also state the function keeps (``rebound_state``), which its
derivatives must not update again; and a binding a derivative call makes
for the forward it replays is that call's to undo, and left alone here
(NOTE [derivatives do not write again] in state_writes.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # private: see the NOTE

from .jax_in_traces import CalledInsideTrace, note_jax_inside
from .module_locks import locks_of, modules_under, taken_after
from .module_hooks import (
    KeptTable,
    hook_tables_kept,
    hooks_numbered,
    own_global_hooks,
    put_back_removed_hooks,
    recomputing_hook,
    remove_hooks_since,
)
from .random_state import random_state_kept
from .state_writes import StateWrites, bound_by_a_replay, memory_of, merged
from .trial_caches import CachesKept, changed_entries, parametrize_cache, put_back


_aten = torch.ops.aten
# Ops that write arguments their schema does not mark as written: batch
# norm's kernels update the running mean and variance (arguments 3 and 4)
# when their argument 5, ``training``, is true. BatchNorm(momentum=None)'s run
# on zeros averaged a batch of zeros into them for good.
_UNDECLARED_WRITES = {
    _aten.native_batch_norm.default: (3, 4),
    _aten.cudnn_batch_norm.default: (3, 4),
    _aten.miopen_batch_norm.default: (3, 4),
}
_TRAINING_ARGUMENT = 5


def undeclared_writes(func, args: tuple[Any, ...]) -> tuple[int, ...]:  # noqa: ANN001
    """The arguments ``func`` writes without its schema saying so."""
    written = _UNDECLARED_WRITES.get(func, ())
    if written and not (len(args) > _TRAINING_ARGUMENT and args[_TRAINING_ARGUMENT]):
        return ()  # evaluation: the running statistics are read, not written
    return written


# Ops whose schema says their result aliases the argument, but which hand a
# tensor made from Python data to the dispatcher (``torch.tensor([...])``):
# a tensor the call made, not one it keeps.
_FRESH_ALIASES = {_aten.lift_fresh.default}


def _has_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is dense with a storage of its own to read: not the
    storage-less zeros forward-mode AD makes (``torch.func.jvp`` inside the
    function: the tangent of a closed-over tensor), which nothing writes."""
    return tensor.layout == torch.strided and not tensor._is_zerotensor()


# The tensors whose in-place writes a run notes and puts back: plain ones and
# parameters (a bare ``nn.Parameter`` an EMA updates in place, a weight a
# one-shot initialization hook scales: not put back, a trial run's write
# stayed, three times over on a first call); not the subclasses a trace or
# a transform wraps them in.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class RealWritesUndone(TorchDispatchMode):
    """Within the block, note each real tensor's value before its first
    in-place write; on leaving it, put every noted value back. Also tells
    which tensors kept between calls the block wrote (``state_written``):
    those no op of the block made, and those bound to a module
    (``owner_of``: the module and name a tensor is bound to, if any)."""

    def __init__(self, owner_of: Callable[[torch.Tensor], tuple[torch.nn.Module, str] | None] | None = None) -> None:
        super().__init__()
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._owner_of = owner_of
        self._made: set[int] = set()  # data pointers of the storages ops of the block made
        self._closed_over: dict[int, torch.Tensor] = {}
        # (module id, name) -> (module, name, shape, dtype)
        self._in_modules: dict[tuple[int, str], tuple[torch.nn.Module, str, torch.Size, torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        schema = func._schema.arguments
        marked = [i for i, argument in enumerate(schema) if argument.alias_info and argument.alias_info.is_write]
        for i in (*marked, *undeclared_writes(func, args)):
            argument = args[i] if i < len(args) else kwargs.get(schema[i].name)
            # A list for the foreach ops (torch._foreach_lerp_ of EMA weights).
            for written in argument if isinstance(argument, (list, tuple)) else (argument,):
                if isinstance(written, torch.Tensor):
                    self._note_written(written)
        result = func(*args, **kwargs)
        self._note_made(func, result)
        return result

    def _note_written(self, written: torch.Tensor) -> None:
        self._note_state(written)
        if (
            type(written) in _PLAIN_TENSORS
            and written.device.type != "meta"
            and id(written) not in self.saved
            and not self._made_here(written)  # a temporary of the run: nothing to put back
        ):
            with _disable_current_modes():  # a real copy, not a fake one
                self.saved[id(written)] = (written, written.detach().clone())

    def _note_made(self, func, result: Any) -> None:  # noqa: ANN001
        """Note the storages of the tensors ``func`` made (not views of its arguments)."""
        returns = func._schema.returns
        results = result if isinstance(result, (tuple, list)) else (result,)
        for returned, r in zip(returns, results):
            fresh = returned.alias_info is None or func in _FRESH_ALIASES
            if fresh and type(r) is torch.Tensor and r.device.type != "meta" and _has_storage(r):
                self._made.add(r.untyped_storage().data_ptr())

    def _made_here(self, tensor: torch.Tensor) -> bool:
        """Whether an op of the block made ``tensor``'s storage (a dense tensor's)."""
        return _has_storage(tensor) and tensor.untyped_storage().data_ptr() in self._made

    def _note_state(self, written: torch.Tensor) -> None:
        """Note ``written`` as kept between calls if a module holds it or no op made it."""
        whole = written._base if written._base is not None else written
        owner = self._owner_of(whole) if self._owner_of is not None else None
        if owner is not None:
            self._in_modules.setdefault((id(owner[0]), owner[1]), (*owner, whole.shape, whole.dtype))
        elif (
            type(whole) in _PLAIN_TENSORS
            and whole.device.type != "meta"
            and whole.layout == torch.strided  # a sparse tensor has no storage to compare
            and whole.numel()
            and not self._made_here(whole)
        ):
            self._closed_over.setdefault(id(whole), whole)

    def state_written(self, rebound: list[tuple[torch.nn.Module, str, torch.Tensor]] = ()) -> StateWrites:
        """The tensors kept between calls that the block wrote in place, and
        the ``rebound`` names of modules (module, name, the tensor before)."""
        closed_over = tuple(self._closed_over.values())
        in_modules = dict(self._in_modules)
        for module, name, old in rebound:
            in_modules.setdefault((id(module), name), (module, name, old.shape, old.dtype))
        in_modules = tuple(in_modules.values())
        layouts = tuple((t.shape, t.dtype) for t in closed_over)
        layouts += tuple((shape, dtype) for *_, shape, dtype in in_modules)
        return StateWrites(closed_over, tuple((module, name) for module, name, *_ in in_modules), layouts)

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        with torch.no_grad():
            for tensor, value in self.saved.values():
                tensor.copy_(value)
        self.saved.clear()
        return result


def _attribute_tables(module: torch.nn.Module) -> tuple[dict[str, Any], ...]:
    return (module._parameters, module._buffers, module.__dict__)


# id -> (module, copies of its tables, what each tensor bound in them holds:
# its name, the tensor, an alias of its elements, and where they are).
_Noted = dict[int, tuple[torch.nn.Module, tuple[dict[str, Any], ...], list[tuple[str, torch.Tensor, torch.Tensor, Any]]]]


def _elements_of(value: Any) -> tuple[torch.Tensor, Any] | None:
    """An alias of a dense tensor's elements (``.data``) and where they are;
    None for anything else (NOTE [elements swapped through .data])."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    with _disable_current_modes():  # a trace's fake mode would make the alias fake
        try:
            alias = value.data
        except RuntimeError:  # a torch.vmap-batched tensor (params under jax.vmap): none to swap
            return None
    at = memory_of(alias)
    return None if at is None else (alias, at)


# NOTE [elements swapped through .data]
# ``self.scale.data = 1 / x.std(0)`` (Glow's ActNorm and nflows' data-dependent
# initialization) keeps the tensor bound to the module and swaps the elements
# under it, without an op the dispatch mode sees and without rebinding the
# name. The run on zeros swapped in 1 / 0 and set ``initialized``, so the
# real first call skipped the initialization and returned inf, and the module
# stayed broken in plain PyTorch too. So each tensor noted with its module
# keeps an alias of its elements, which ``.data =`` puts back where it was
# swapped; the swap counts as a rebinding (``Class.name.data``), which a graph
# cannot replay either.


# ``Tensor.data``, whose setter a TorchFunctionMode sees as this descriptor's ``__set__``.
_DATA = torch._C.TensorBase.__dict__["data"]


def sets_data(func: Any) -> bool:
    """Whether ``func``, as a TorchFunctionMode sees it, is ``Tensor.data``'s setter."""
    return getattr(func, "__self__", None) is _DATA and getattr(func, "__name__", "") == "__set__"


class _DataSwapsUndone(TorchFunctionMode):
    """Within the block, notes each tensor whose elements are swapped with
    ``.data =`` (any tensor, however deep the function reached it: a
    closed-over accumulator, ``st.inner.count``, a buffer of a module it
    names but does not run), with an alias of those it had;
    ``undo()`` gives each back its own (NOTE [elements swapped through
    .data]: the runs that infer shapes put a closed-over accumulator three
    steps ahead, and a trace left one holding a fake tensor, failing every
    call, in plain PyTorch too)."""

    def __init__(self) -> None:
        super().__init__()
        self._swapped: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, Any]]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if sets_data(func) and args:
            tensor = args[0]
            if id(tensor) not in self._swapped:
                elements = _elements_of(tensor)
                if elements is not None:
                    self._swapped[id(tensor)] = (tensor, elements)
        return func(*args, **(kwargs or {}))

    def undo(self) -> None:
        for tensor, (alias, at) in reversed(list(self._swapped.values())):
            now = _elements_of(tensor)
            if now is None or now[1] != at:
                with _disable_current_modes():
                    tensor.data = alias
        self._swapped.clear()


@contextlib.contextmanager
def _data_swaps_undone() -> Iterator[None]:
    """Within the block, ``.data =`` swaps are noted; when it ends, undone."""
    swaps = _DataSwapsUndone()
    try:
        with swaps:
            yield
    finally:
        swaps.undo()


class ModuleAttributesKept:
    """Within the block, each tensor bound to a name (parameter, buffer or
    plain attribute) of a module whose ``forward`` runs on this thread, or of
    a module under it, is unbound again when that ``forward`` ends, the old
    value put back; ``rebound`` names each as ``Class.name``."""

    def __init__(
        self,
        caches: CachesKept | None = None,
        found: Iterable[torch.nn.Module] = (),
        first_seen: Callable[[torch.nn.Module], None] | None = None,
    ) -> None:
        # Called with each module a forward runs under, the first time one
        # does, before that module's own hooks run (NOTE [hooks a trial run
        # registers] in module_hooks.py).
        self._first_seen = first_seen
        # Where the dicts of each module noted are noted too (NOTE [trial
        # runs leave caches as they found them] in trial_caches.py).
        self._caches = caches
        # The modules the function refers to, with copies of their tables as
        # the run found them; and (id(module), table, name) -> the tensor
        # bound there (NOTE [trial runs wait for module calls]).
        self._as_found = [
            (m, tuple(dict(table) for table in _attribute_tables(m)))
            for m in found
            if not isinstance(m, torch.jit.ScriptModule)
        ]
        self._found = {
            (id(m), k, name): value
            for m, tables in self._as_found
            for k, table in enumerate(tables)
            for name, value in table.items()
            if isinstance(value, torch.Tensor)
        }
        self.rebound: list[str] = []
        # Plain attributes the run changed and that were put back, as
        # ``Class.name`` (NOTE [Python state in trial runs]).
        self.python_state: list[str] = []
        # Each rebinding as (module, name, the tensor bound before): state
        # the function keeps (NOTE [derivatives do not write again]).
        self.rebound_state: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        # (id(module), name) -> (module, name) of each attribute a hook of
        # PyTorch's bound anew (NOTE [attributes PyTorch's hooks recompute]).
        self.recomputed: dict[tuple[int, str], tuple[torch.nn.Module, str]] = {}
        self._thread = threading.get_ident()
        # One frame per forward running, outermost first: the module, the
        # modules it was first to note (itself and those under it), and the
        # module and name each tensor bound in those was bound to.
        self._open: list[tuple[torch.nn.Module, _Noted, dict[int, tuple[torch.nn.Module, str]]]] = []
        self._noted: set[int] = set()  # ids of the modules some open frame noted
        self.seen_modules: dict[int, torch.nn.Module] = {}  # every module a forward ran under, by id

    def _watches_now(self) -> bool:
        """Whether this is the innermost trial run open on the thread
        running a forward: only it notes and puts back what the forward
        binds (NOTE [a forward is the innermost trial run's])."""
        return threading.get_ident() == self._thread and _watcher.kept is self

    def _starts(self, module: torch.nn.Module, args: Any) -> None:
        if not self._watches_now():
            return
        noted: _Noted = {}
        owners: dict[int, tuple[torch.nn.Module, str]] = {}
        if id(module) not in self._noted:  # else an open frame noted it and those under it
            for sub in module.modules():
                if id(sub) not in self.seen_modules:
                    self.seen_modules[id(sub)] = sub
                    if self._first_seen is not None:
                        self._first_seen(sub)
                # A TorchScript module's forward cannot rebind its attributes from
                # Python, and its tables are wrappers without dict methods.
                if id(sub) not in self._noted and not isinstance(sub, torch.jit.ScriptModule):
                    self._noted.add(id(sub))
                    if self._caches is not None:
                        self._caches.note_attributes(sub)
                    tables = tuple(dict(table) for table in _attribute_tables(sub))
                    elements = []
                    for table in tables[:2]:  # parameters and buffers
                        for name, value in table.items():
                            held = _elements_of(value)
                            if held is not None:
                                elements.append((name, value, *held))
                    noted[id(sub)] = (sub, tables, elements)
                    for table in tables:
                        for name, value in table.items():
                            if isinstance(value, torch.Tensor):
                                owners.setdefault(id(value), (sub, name))
                                at = memory_of(value)
                                if at is not None:
                                    owners.setdefault(at, (sub, name))
        self._open.append((module, noted, owners))

    def _ends(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._watches_now():  # a frame it opened ends while it is innermost again
            return
        for i in range(len(self._open) - 1, -1, -1):  # this module's innermost forward
            if self._open[i][0] is module:
                self._put_back(self._open.pop(i)[1])
                return

    def _put_back(self, noted: _Noted) -> None:
        for module, before, elements in noted.values():
            self._noted.discard(id(module))
            for name, tensor, alias, at in elements:
                held = _elements_of(tensor)
                if held is not None and held[1] != at:
                    tensor.data = alias  # NOTE [elements swapped through .data]
                    self.rebound.append(f"{type(module).__name__}.{name}.data")
            for k, (table, saved) in enumerate(zip(_attribute_tables(module), before)):
                for name, old, new in changed_entries(table, saved):
                    if not (isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor)):
                        if table is module.__dict__:
                            put_back(table, name, old)  # NOTE [Python state in trial runs]
                            self._note_python_state(module, name)
                        continue
                    if new is not None and self._found.get((id(module), k, name)) is new:
                        continue  # as the run found it: put back by whatever bound around the forward
                    if bound_by_a_replay(module, name):
                        continue  # the replay binds it back itself (NOTE [derivatives do not write again])
                    put_back(table, name, old)
                    if _recomputed(module, table, name, old, new):
                        # NOTE [attributes PyTorch's hooks recompute]
                        self.recomputed.setdefault((id(module), name), (module, name))
                        continue
                    self.rebound.append(f"{type(module).__name__}.{name}")
                    if isinstance(old, torch.Tensor):
                        self.rebound_state.append((module, name, old))

    def owner_of(self, tensor: torch.Tensor) -> tuple[torch.nn.Module, str] | None:
        """The module (of those noted now) and name ``tensor`` is bound to, if
        any: the tensor itself, or another over the same memory, as
        ``.data`` and ``.detach()`` make (``self.ema.data.mul_(0.5)``)."""
        at = memory_of(tensor)
        for _, _, owners in self._open:
            owner = owners.get(id(tensor))
            if owner is None and at is not None:
                owner = owners.get(at)
            if owner is not None:
                return owner
        return None

    def _end_open_forwards(self, depth: int) -> None:
        """End each forward still open above the first ``depth``: those whose
        end no hook saw (NOTE [forwards a KeyboardInterrupt ends])."""
        while len(self._open) > depth:
            self._put_back(self._open.pop()[1])

    @contextlib.contextmanager
    def watching(self) -> Iterator[ModuleAttributesKept]:
        outer, _watcher.kept = _watcher.kept, self
        try:
            with own_global_hooks(self._starts, self._ends):
                yield self
        finally:
            _watcher.kept = outer
            self._end_open_forwards(0)
            self._put_back_as_found()

    def _put_back_as_found(self) -> None:
        """Put back what the run changed, outside any forward, in the modules
        the function refers to (a method such as rotary embeddings'
        ``rotate_queries_or_keys``: NOTE [Python state in trial runs])."""
        for module, before in self._as_found:
            for table, saved in zip(_attribute_tables(module), before):
                for name, old, new in changed_entries(table, saved):
                    put_back(table, name, old)
                    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
                        self.rebound.append(f"{type(module).__name__}.{name}")
                    else:
                        self._note_python_state(module, name)

    def _note_python_state(self, module: torch.nn.Module, name: str) -> None:
        """Count ``module.name``, a plain attribute the run changed (and
        that was put back), in ``python_state``, unless its forward renews
        it from its tensors before reading it (NOTE [a recurrent module's
        weight list])."""
        if not _renewed_by_forward(module, name):
            self.python_state.append(f"{type(module).__name__}.{name}")


# NOTE [Python state in trial runs]
# A module's forward keeps Python state beside its tensors: a cache's length
# (rotary embeddings fill a buffer of frequencies and note how far in an
# int), a tuple of tensors (PyTorch Geometric's GCNConv(cached=True) keeps
# the normalized graph of its first call), a flag saying a lazy setup ran
# (Pyro's autoguides). The run on zeros put back the buffer's values but
# left the length, so the real calls rotated by zeros; kept the graph of an
# all-zeros edge_index; and left the flag set over the tensors it unbound.
# So every plain attribute a forward in a trial run rebinds is put back
# when that forward ends, as its tensors are; and what the run changed in
# the modules the function refers to, outside any forward (rotary
# embeddings' cache is filled by a method, ``rotate_queries_or_keys``), is
# put back when the run ends. A trace that changed such an attribute is
# refused (``trace_refusals.refuse_module_side_effects``): a graph replays none of
# the forward's Python, so it would keep the branch the trace took on the
# state as found (a data-dependent init guarded by ``self.initialized``
# re-initialized the parameters on every replay), where eager calls see
# the state the first call left.


def _recomputed(module: torch.nn.Module, table: dict[str, Any], name: str, old: Any, new: Any) -> bool:
    """Whether ``module.name``, a plain attribute rebound from the tensor
    ``old`` to the tensor ``new``, is one a hook of PyTorch's computes anew on
    every call (NOTE [attributes PyTorch's hooks recompute])."""
    return (
        table is module.__dict__
        and isinstance(old, torch.Tensor)
        and isinstance(new, torch.Tensor)
        and recomputing_hook(module, name) is not None
    )


# NOTE [attributes PyTorch's hooks recompute]
# ``torch.nn.utils.prune`` (l1_unstructured, random_unstructured,
# ln_structured, global_unstructured, a custom BasePruningMethod) renames
# ``weight`` to ``weight_orig``, a parameter, beside ``weight_mask``, a
# buffer, and registers a forward pre-hook that binds the plain attribute
# ``module.weight = weight_orig * weight_mask`` before every forward; the old
# ``torch.nn.utils.weight_norm`` and ``spectral_norm`` do the same from
# ``weight_g`` and ``weight_v``, and from ``weight_orig`` and the power
# iteration's vectors. The run noted every such binding as state the
# function keeps (``rebound_state``), as it notes ``self.ema = 0.9 *
# self.ema + ...``: per-example gradients of a pruned model ran as a loop
# over the examples (28-166x torch.func's time; 72x eager and 25x graph for
# a pruned 32-64-10 MLP at batch 64), with a warning that blamed running
# statistics the model does not have, and every graph-mode trace of it was
# refused, for a rebinding a graph never needs to replay. But such an
# attribute is no state: the hook computes it from the module's own
# parameters and buffers before the forward reads it, the value the last
# call left is never read, and a derivative that runs the forward again
# computes it again from the same tensors. So an attribute a hook of one
# of these types (``module_hooks.recomputing_hook``) names is put back as
# any rebinding, but noted apart (``recomputed``), neither as state nor as a
# Python side effect a trace must replay: torch.vmap batches the function
# and a graph computes the attribute as the hook's ops. What those hooks
# write in place stays state (``spectral_norm``'s power iteration in
# training mode updates ``weight_u`` and ``weight_v``: a loop over the
# examples, one update each, as before). A call with transforms puts back
# what such an attribute held when it started (``state_writes.
# recomputed_bindings_kept``): else a derivative's functorch wrapper, or
# torch.vmap's batched tensor, stayed bound in the user's module after the
# call (as torch.func leaves it). A graph-mode call leaves it as it found
# it too: a graph replays the hook's ops, not its binding, and binding the
# call's value would cost every call (the hook run again on the call's
# parameters, or a weight-sized output kept out of the graph), for a value
# no forward reads; docs/compile-modes.md says so and how to read it. A
# hook of the user's own that rebinds ``module.weight`` from
# ``weight_orig`` is not known to be pure, and counts as state, as before.


# PyTorch's private names for a recurrent module's weight list and the weak
# references it is renewed by (torch.nn.RNNBase, since PyTorch 1.x).
_RECURRENT_WEIGHT_LISTS = frozenset({"_flat_weights", "_flat_weight_refs"})


def _renewed_by_forward(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module.name`` is a list its forward renews from the
    module's tables before reading it (NOTE [a recurrent module's weight list])."""
    return isinstance(module, torch.nn.RNNBase) and name in _RECURRENT_WEIGHT_LISTS


# NOTE [a recurrent module's weight list]
# torch.nn.RNNBase keeps a list of its weights (``_flat_weights``, with weak
# references to them in ``_flat_weight_refs``), which its forward renews
# (``_update_flat_weights``) whenever its tables hold other tensors than the
# list does, before it reads the list. Every binding of a call's tensors
# does that: jaxify_module's (NOTE [binding tensors into a module] in
# module.py), torch.func.functional_call's, and a parametrization's (each
# read of a parametrized weight computes a new tensor). So the list is put
# back as any plain attribute (NOTE [Python state in trial runs]), but it
# is no Python state a trace refuses: either branch of the renewal leaves
# the list holding the tensors the module's tables hold, which a graph
# takes in as its inputs or computes, so no replay depends on the branch
# the trace took. Counted, it refused every LSTM, GRU and RNN under
# jaxify_module(compile="graph"), each run eagerly with a warning blaming
# the user's forward for t2j_ad's own binding.


# NOTE [forwards a KeyboardInterrupt ends]
# PyTorch runs a forward hook registered with always_call=True when the
# forward raises an Exception, not a BaseException: after a KeyboardInterrupt
# (Ctrl-C in a notebook during a slow first call) no hook saw the end of the
# forwards it cut short, so their frames were ended only when the trial run
# ended. By then jaxify_module had put the module's own parameters back in
# place of the trial's meta or fake ones, and ending the frames "put back"
# the trial's tensors over them, as rebindings: the module kept meta tensors,
# or fake ones that plain PyTorch then computed with silently. So whatever
# binds tensors into a module around its call ends, inside its own binding,
# the forwards that started there and did not end (``forwards_end_here``).
class _Watcher(threading.local):
    # The innermost trial run open on this thread: the one watching its
    # forwards (NOTE [a forward is the innermost trial run's]).
    kept: ModuleAttributesKept | None = None


_watcher = _Watcher()


# NOTE [a forward is the innermost trial run's]
# Trial runs nest on one thread: a jaxified function first called inside
# another's trial run infers its shapes in a run of its own, and its call is
# a trial run of its own (``call_undone``) around its trace, another (NOTE
# [a call inside a trial run]). Each run's ``ModuleAttributesKept`` hooks
# every module's forward process-wide, and PyTorch calls the hooks in the
# order they were registered: outermost run first. So when a nested graph-mode
# function's module rebound a buffer (``self.ema = 0.5 * self.ema + ...``),
# the outer run's hook put it back first, and the trace's own found nothing
# rebound: the trace was not refused (NOTE [trial runs do not write to real
# tensors]), and its graph, which cannot replay the rebinding, ran every
# later call with the buffer as it was, never updated, even for plain calls
# of the caller; the caller's run had counted the rebinding as its own
# state instead of the nested run's (NOTE [a nested call's effects are its
# caller's]). So a forward is watched by the innermost trial run open on
# its thread alone (``_watcher.kept``): the trace refuses the rebinding and
# the function runs eagerly; its eager call, in ``call_undone``'s run, puts
# it back and tells the caller's run (``state_for_caller``). A forward that
# started in an outer run, around the nested call, ends in that run again,
# which puts back what it bound.


@contextlib.contextmanager
def forwards_end_here() -> Iterator[None]:
    """Within the block, a module forward that starts in it and whose end no
    hook saw (a KeyboardInterrupt) ends when the block exits, what it rebound
    put back (NOTE [forwards a KeyboardInterrupt ends])."""
    kept = _watcher.kept
    depth = len(kept._open) if kept is not None else 0
    try:
        yield
    finally:
        if kept is not None:
            kept._end_open_forwards(depth)


class TrialRun:
    """What a trial run found: the module attributes it rebound, and the
    tensors kept between calls that it wrote (once the run has ended)."""

    def __init__(self, attributes: ModuleAttributesKept, writes: RealWritesUndone, caches: CachesKept) -> None:
        self._attributes = attributes
        self._writes = writes
        self._caches = caches
        # What the jaxified calls made inside the run do (NOTE [a nested
        # call's effects are its caller's]): whether one draws from
        # PyTorch's generator, how often from generators passed as
        # ``generator=``, and the state they update.
        self.nested_draws = False
        self.nested_given_draws = 0
        self._nested_writes: list[StateWrites] = []
        # How many hooks the run removed (a hook that removes itself) and
        # put back as it ended (NOTE [hooks a trial run registers] in
        # module_hooks.py); set once it has.
        self.hooks_put_back = 0

    def note_nested(self, draws: bool, given_draws: int, writes: StateWrites) -> None:
        """Count what a jaxified call made inside the run does as the run's
        own (NOTE [a nested call's effects are its caller's])."""
        self.nested_draws = self.nested_draws or draws
        self.nested_given_draws += given_draws
        self._nested_writes.append(writes)

    def state_for_caller(self) -> StateWrites:
        """The state this run (a jaxified call's, inside its caller's trial
        run) updated, as its caller keeps it (NOTE [a nested call's effects
        are its caller's]): a tensor written in place as the tensor itself,
        also one bound to a module (a graph of the called function writes
        it without running the module's ``forward``), and a name a
        ``forward`` bound anew as the module's name; and what the jaxified
        calls made inside this run updated, as they told it (NOTE [a nested
        call's effects reach every caller])."""
        in_place = self._writes.state_written()
        rebound = self._attributes.rebound_state
        renamed = {(id(module), name) for module, name, _ in rebound}
        tensors = list(in_place.closed_over)
        for module, name in in_place.in_modules:
            bound = next((t[name] for t in _attribute_tables(module) if name in t), None)
            if (id(module), name) not in renamed and isinstance(bound, torch.Tensor):
                tensors.append(bound)
        own = StateWrites(
            tuple(tensors),
            tuple((module, name) for module, name, _ in rebound),
            tuple((t.shape, t.dtype) for t in tensors) + tuple((old.shape, old.dtype) for *_, old in rebound),
        )
        # NOTE [a nested call's effects reach every caller]
        return merged(own, *self._nested_writes)

    @property
    def rebound(self) -> list[str]:
        """Each attribute rebound, as ``Class.name``."""
        return self._attributes.rebound

    @property
    def python_state(self) -> list[str]:
        """Each plain attribute changed and put back, as ``Class.name``."""
        return self._attributes.python_state

    def cache_state(self) -> list[str]:
        """Each entry of a dict, or attribute of a plain object, the function
        reaches that the run changed from or to a tensor (while the run is on:
        it is put back when the run ends)."""
        return self._caches.state_changed()

    def added_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Each entry the run added to a dict or object the function reaches,
        with each tensor it holds (NOTE [an entry a trace adds, from the
        inputs] in trial_caches.py)."""
        return self._caches.added_tensors()

    def lists_filled(self) -> list[str]:
        """Each list the function names whose tensors the run changed (NOTE
        [lists a function fills] in trial_caches.py)."""
        return self._caches.lists_filled()

    def hook_filled(self) -> list[str]:
        """What the run put, holding a tensor, in a dict or list a module hook
        fills (NOTE [what module hooks fill] in trial_caches.py)."""
        return self._caches.filled_by_hooks()

    def state_written(self) -> StateWrites:
        """The state the run updated: tensors kept between calls written in
        place, and tensors a ``forward`` bound in place of a module's (NOTE
        [derivatives do not write again] in state_writes.py)."""
        own = self._writes.state_written(self._attributes.rebound_state)
        return merged(own, *self._nested_writes)

    @property
    def recomputed(self) -> tuple[tuple[torch.nn.Module, str], ...]:
        """Each (module, name) a hook of PyTorch's bound anew from the
        module's own tensors (NOTE [attributes PyTorch's hooks recompute])."""
        return tuple(self._attributes.recomputed.values())


# NOTE [one trial run at a time]
# Trial runs change process-wide state for their length: a trace seeds
# PyTorch's generators to its sentinel, and every trial run puts the
# generators back as it found them when it ends. Two at once on different
# threads (a jitted value and its gradient called first from two threads)
# undid each other's seeding, so a trace took the other's restore for the
# function setting the random state, and refused a function that never
# touches it; make_fx is not reentrant across threads either. Trial runs are
# rare (once per signature and per transform), so they take turns. A call
# that updates state a trial run on zeros also writes (running statistics)
# holds them off as well: the run on zeros put back the statistics it found,
# undoing the updates another thread's calls made meanwhile.
_one_trial_run = threading.RLock()


class _TrialRunning(threading.local):
    depth = 0  # trial runs open on this thread
    # The outputs of the call ``call_undone`` runs, while it runs: that call
    # is no trial run's inner call (NOTE [a call inside a trial run]).
    call_outputs: list[torch.Tensor] | None = None
    # The innermost trial run open on this thread, told what a jaxified call
    # made inside it does (NOTE [a nested call's effects are its caller's]).
    run: TrialRun | None = None


# Read by the runner on every call: a call made inside a trial run runs
# outside it, undone (``call_undone``).
trial_running = _TrialRunning()


@contextlib.contextmanager
def _in_trial_run() -> Iterator[None]:
    trial_running.depth += 1
    try:
        yield
    finally:
        trial_running.depth -= 1


@contextlib.contextmanager
def outside_trial_runs() -> Iterator[None]:
    """Within the block, none of this thread's trial runs is open: their
    dispatch modes are off. A jaxify'd function called from inside another
    one's trial run (a PyTorch function that calls JAX) ran inside them: they
    took its copy into XLA's output buffer for a write to put back when the
    run ended, after XLA had freed the buffer (glibc aborted the process).
    A graph-mode trace around it is refused, and the call does not run
    (NOTE [JAX inside a trace] in jax_in_traces.py)."""
    if note_jax_inside("calls a jaxified function"):
        raise CalledInsideTrace()
    with apart_from_trial_runs():
        yield


@contextlib.contextmanager
def apart_from_trial_runs() -> Iterator[None]:
    """Within the block, none of this thread's trial runs is open, nor are
    their dispatch modes on: for a call inside one (``outside_trial_runs``),
    and for the shape inference of a jaxified function first called inside
    one (NOTE [a nested call's effects are its caller's])."""
    depth, trial_running.depth = trial_running.depth, 0
    run, trial_running.run = trial_running.run, None
    try:
        with _disable_current_modes():
            yield
    finally:
        trial_running.depth = depth
        trial_running.run = run


# NOTE [a call inside a trial run]
# A PyTorch function that calls another jaxify'd function (through
# ``tree_t2j`` / ``tree_j2t``) makes a real call of it in each of its own
# trial runs: the run on zeros (and on ones) that infers its shapes, and a
# trace. That call runs outside the trial run's dispatch modes
# (``outside_trial_runs``): they took its copy into XLA's output buffer for
# a write to put back when the run ended, after XLA had freed the buffer
# (glibc aborted the process), and a trace's fake and proxy modes are no
# place for a real call. But then nothing put back what the inner call
# wrote: an inner BatchNorm in training mode counted 2 batches after the
# outer function's first call, its running mean a batch of zeros off, where
# PyTorch counts 1. So such a call is itself a trial run of the inner
# function, outside the outer one (``call_undone``): its writes to the
# tensors it keeps, its modules' attributes, its caches and PyTorch's random
# state are put back when it ends, as the outer run puts back its own. It
# writes its results into outputs of its own, made inside that run (so none
# is taken for state to put back), copied into XLA's once the run has ended,
# outside every mode. A call nested deeper (the inner function calling a
# third) is a trial run's inner call again, and goes the same way; the call
# ``call_undone`` runs is told by its outputs (``trial_running.call_outputs``).
# The inner function's own first call still infers, traces and caches what it
# finds for good: that is the runtime's, not the function's state. The lock
# this takes first, the trial-run lock, is held already by the trial run
# around (NOTE [lock order]); the modules' locks come last.


# NOTE [a nested call's effects are its caller's]
# The call a trial run makes of another jaxified function (NOTE [a call
# inside a trial run]) runs again in each of its caller's real calls, and in
# each derivative call of the caller: ``torch.func.vjp`` runs the caller's
# forward again, and the nested call inside it runs outside the levels, as a
# call of its own (NOTE [a call inside torch.func transforms] in
# runtime.py). So a nested function that draws (dropout) drew a new mask in
# the caller's derivative call, and ``jax.value_and_grad`` of the caller
# gave the value of one mask and the gradient of another; a nested
# training-mode BatchNorm updated its statistics twice a step. The caller's
# trial run never saw either: the nested call is a trial run of its own,
# outside the caller's modes. So what the nested call does is counted as the
# caller's: ``call_undone`` tells the caller's trial run (``note_nested``)
# whether the nested function draws, as its own effects say (its shape
# inference saw it: ``effects_of``), and the state the nested run wrote
# (``state_for_caller``). The caller's derivatives then replay its value
# call around the nested call too (NOTE [derivatives replay the value's
# draws] in replayed_calls.py): they set PyTorch's generator to the state
# the value call started from, so the nested call draws the value's numbers
# again, and set the tensors it writes to the values they had before the
# value call, putting back after it what the value left (NOTE [derivatives
# do not write again] in state_writes.py). A tensor a module's ``forward``
# wrote in place is such a tensor, not the module's name, since a
# graph-mode nested function writes it without running the ``forward``; a
# name a ``forward`` bound anew stays the module's (such a function runs
# eagerly: NOTE [trial runs do not write to real tensors]). A nested
# function given ``output_shapes=`` was never run to learn its draws, and
# its draws are not counted (its writes are). The nested function's own
# shape inference, when its first call comes inside the caller's trial run,
# runs apart from that run (``apart_from_trial_runs``): inside its modes,
# the caller's run took the nested inference's draws on meta tensors and its
# writes on zeros for the caller's own, on whichever of the caller's runs
# met the nested function first (the run on zeros, not the run on ones: two
# runs that "write differently", refused).


# NOTE [a nested call's effects reach every caller]
# Nested calls go deeper than one level: an outer function calls a jaxified
# middle one, which calls a jaxified training-mode BatchNorm. Inside the
# outer's trial run the middle's call is a trial run of its own
# (``call_undone``), and the BatchNorm's call, inside that, one more, which
# tells the middle's run what it wrote (``note_nested``). The middle's run
# then told the outer's run only what it wrote itself (``state_for_caller``
# left out ``_nested_writes``): the outer's derivative call ran the middle,
# and with it the BatchNorm, again, with nothing set back, and the
# statistics were updated twice a step (``num_batches_tracked`` 2 where
# PyTorch counts 1; spectral_norm's power iteration two steps ahead). So
# what a run was told by the calls made inside it is part of what it tells
# its own caller, at any depth (NOTE [a nested call's effects are its
# caller's]).


@contextlib.contextmanager
def call_undone(
    outputs: Sequence[torch.Tensor],
    dicts: Iterable[Any] = (),
    modules: Iterable[torch.nn.Module] = (),
    effects_of: Callable[[], tuple[bool, int]] = lambda: (False, 0),
) -> Iterator[list[torch.Tensor]]:
    """Within the block, a call made inside a trial run writes its results
    into the outputs it yields, in a trial run of its own outside the one
    around (``dicts``, ``modules``: those its function refers to), which puts
    back everything it wrote when it ends; then they are copied into
    ``outputs`` (NOTE [a call inside a trial run]). The run around is told
    what the call did: ``effects_of()`` gives whether its function draws and
    how often from generators passed as ``generator=`` (NOTE [a nested
    call's effects are its caller's])."""
    caller = trial_running.run
    with outside_trial_runs():
        with trial_run(dicts, modules) as nested:
            own = [torch.empty_like(out) for out in outputs]  # made in the run: nothing to put back
            around, trial_running.call_outputs = trial_running.call_outputs, own
            try:
                yield own
            finally:
                trial_running.call_outputs = around
        for out, result in zip(outputs, own):
            out.copy_(result)
        if caller is not None:
            draws, given_draws = effects_of()
            caller.note_nested(draws, given_draws, nested.state_for_caller())


def one_trial_run() -> threading.RLock:
    """The lock trial runs hold: held by a call that updates state, it holds
    off trial runs on other threads, which would put back what it wrote when
    they end (NOTE [one trial run at a time])."""
    return _one_trial_run


# NOTE [trial runs wait for module calls]
# A function that closes over a module (``jaxify(lambda x: model(x))``) ran
# its trial runs while a ``jaxify_module`` call of the same module on another
# thread (or on XLA's, a pmap's calls dispatched just before) had bound that
# call's tensors into it: its forward noted them, the other call put the
# module's own back, and the end of the forward "put back" the other call's,
# views of XLA buffers freed soon after, for good. So a trial run holds the
# locks every ``jaxify_module`` call of the modules the function refers to
# holds (and of their submodules that hold tensors), taken after the
# trial-run lock as a call that updates state takes them, a busy one waited
# for without the trial-run lock (NOTE [waiting for a lock without the
# trial-run lock] in module_locks.py); and an entry that
# holds, when a forward ends, the tensor the run found there is left alone
# (an outer binding that a KeyboardInterrupt unwound, such as the user's own
# ``torch.func.functional_call``, put it back: NOTE [forwards a
# KeyboardInterrupt ends]).


@contextlib.contextmanager
def trial_run(dicts: Iterable[Any] = (), modules: Iterable[torch.nn.Module] = ()) -> Iterator[TrialRun]:
    """A run of the user's function made only to learn something: the real
    tensors it closes over, the attributes of the modules it runs, the
    tensors in ``dicts`` and in those modules' dicts (its caches), the
    elements of any tensor it swaps with ``.data =``, and PyTorch's random
    state are as they were when the block ends (NOTE [trial runs do not
    write to real tensors], NOTE [random state in trial runs], NOTE [trial
    runs leave caches as they found them], NOTE [elements swapped through
    .data]); yields what records the attributes it rebound and the state it
    wrote. One at a time in the process (NOTE [one trial run at a time]).
    The hooks it removed from the modules it ran or refers to, and from the
    global tables, are put back too; ``TrialRun.hooks_put_back`` counts
    them once it has ended (NOTE [hooks a trial run registers])."""
    under = modules_under(modules)  # walked once: what it keeps, and whose locks it holds
    # NOTE [waiting for a lock without the trial-run lock] in module_locks.py
    with taken_after(_one_trial_run, locks_of(under)), _in_trial_run(), _data_swaps_undone():
        caches = CachesKept()
        first_hook = hooks_numbered()
        hooks = hook_tables_kept(under)
        kept = ModuleAttributesKept(caches, under, _keeping_hooks_of_others(under, hooks))
        run: TrialRun | None = None
        try:
            caches.note([*dicts, parametrize_cache()])
            with kept.watching() as attributes:
                writes = RealWritesUndone(attributes.owner_of)
                with writes, random_state_kept():
                    run = TrialRun(attributes, writes, caches)
                    around, trial_running.run = trial_running.run, run
                    try:
                        yield run
                    finally:
                        trial_running.run = around
        finally:
            caches.take_back()
            # NOTE [hooks a trial run registers] in module_hooks.py
            remove_hooks_since(first_hook, [*under, *kept.seen_modules.values()])
            put_back = put_back_removed_hooks(hooks)
            if run is not None:
                run.hooks_put_back = put_back


def _keeping_hooks_of_others(
    under: Sequence[torch.nn.Module], hooks: list[KeptTable]
) -> Callable[[torch.nn.Module], None]:
    """What adds to ``hooks`` the tables of a module a trial run's forward
    runs under but ``under`` (those the function refers to) leaves out, the
    first time it does (NOTE [hooks a trial run registers] in
    module_hooks.py: ``outer.inner.model``)."""
    referred = {id(module) for module in under}

    def keep(module: torch.nn.Module) -> None:
        if id(module) not in referred:
            hooks.extend(hook_tables_kept([module], global_tables=False))

    return keep
