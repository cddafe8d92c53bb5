"""The tensors a function keeps between calls and updates: finding them at a
call, carrying their values from a value call to its derivatives, and
keeping a derivative call from updating them.

NOTE [derivatives do not write again]
A function may update tensors it keeps between calls: a module in training
mode updates its running statistics in place (``BatchNorm``,
``InstanceNorm(track_running_stats=True)``) and counts its batches,
``spectral_norm`` advances its power iteration and divides the weight by the
new estimate, and a ``forward`` may bind a new tensor to an attribute
(``self.mean = 0.9 * self.mean + ...``). A derivative is a PyTorch call of
its own that runs the forward again (NOTE [every derivative is a PyTorch
function]), so ``jax.grad`` and ``jax.value_and_grad`` made each update
twice, where PyTorch's ``loss.backward()`` makes it once (batch norm counted
two batches a step), and differentiated a forward that started from the
state the value call left: ``spectral_norm``'s gradient was taken at the
next estimate.

So shape inference notes the state the function updated (its trial run sees
every in-place write, ``RealWritesUndone``, and every attribute a
``forward`` rebound, ``ModuleAttributesKept``, in real_writes.py), the
*slots* of a ``StateWrites``:

- a tensor bound to a module whose ``forward`` ran (a parameter, buffer or
  attribute), as the module and the name, because the tensor bound there at
  a call may be another object than at inference (``jaxify_module`` binds
  its parameters in, a module's buffers are copied to each device, the run on meta
  tensors wrote meta copies, and a ``forward`` may bind a new one);
- any other real tensor written in place that no op of the run made (one
  the function closes over), as itself.

The value call makes the updates, once, as PyTorch does, and returns the
bytes of each slot's value from before the update (``pack``, in the token of
NOTE [derivatives replay the value's draws] in replayed_calls.py). A
derivative call starts from those values and leaves the state as it found
it:

- A module's slot is found when the outermost module ``forward`` that holds
  it starts (``module_slots_entered``), before any module under it reads or
  writes it. The derivative call binds a new tensor holding the token's
  value there, for that ``forward``, and binds back what it found when the
  ``forward`` ends; the forward updates the new tensor, never the module's
  own. No tensor autograd saved is ever written (a loop over examples in one
  call, ``jax.grad`` of ``jax.vmap``, saves one per example), and a graph-mode
  trace records the state as computed from the token, so its replays touch
  no module state either. The trial run around a trace ignores those
  bindings (``bound_by_a_replay``).
- A closed-over slot is set in place to the token's value at the start of
  the call, and ``WritesPutBack`` puts back, when the whole call has
  finished (its backward included), the value it had before; putting back
  at the end of the forward instead would bump the version of a tensor the
  backward may have saved, and autograd would refuse it.

What the trial runs did not see is not a slot: a write that depends on the
input's values (a branch neither the run on zeros nor the one on ones took:
NOTE [a second run, on ones] in inference.py), or a function
given ``output_shapes=``, which is never run to learn anything. Their
derivatives write again, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes  # private, as in real_writes.py

from .functorch_levels import outside_transforms
from .module_hooks import own_global_hooks


@dataclasses.dataclass(frozen=True, eq=False)
class StateWrites:
    """The state a function updated (NOTE [derivatives do not write again]).
    The slots are the closed-over tensors, then the module names, each with
    its shape and dtype."""

    closed_over: tuple[torch.Tensor, ...]  # real tensors written in place that no op of the run made
    in_modules: tuple[tuple[torch.nn.Module, str], ...]  # a name a module binds
    layouts: tuple[tuple[torch.Size, torch.dtype], ...]  # of every slot

    def __bool__(self) -> bool:
        return bool(self.layouts)

    def same_slots(self, other: StateWrites) -> bool:
        """Whether ``other`` names the same slots."""
        return self._slot_ids() == other._slot_ids()

    def slots_within(self, other: StateWrites) -> bool:
        """Whether every slot this names, ``other`` names too."""
        tensors, names = self._slot_ids()
        other_tensors, other_names = other._slot_ids()
        return set(tensors) <= set(other_tensors) and set(names) <= set(other_names)

    def _slot_ids(self) -> tuple[list[Any], list[tuple[int, str]]]:
        # By memory: .data of a tensor kept is a new object on every run.
        tensors = [memory_of(t) or id(t) for t in self.closed_over]
        return tensors, [(id(m), n) for m, n in self.in_modules]

    def names(self) -> list[str]:
        """Each slot as its user knows it: ``Class.name`` for a module's, the
        shape and dtype for a tensor the function closes over."""
        closed = [f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)}" for t in self.closed_over]
        return closed + [f"{type(module).__name__}.{name}" for module, name in self.in_modules]

    def slot_bytes(self) -> list[int]:
        """The size of each slot's value, in bytes."""
        return [math.prod(shape) * dtype.itemsize for shape, dtype in self.layouts]


def memory_of(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Where a dense tensor's elements are (its storage, as PyTorch's own
    storage object, which a meta tensor has too; offset, shape, strides,
    dtype): the same for ``.data`` and ``.detach()`` of it, new objects on
    every run over the same memory (an EMA updated through ``ema.data``).
    None for a sparse tensor, a subclass, or a functorch wrapper (no storage
    of its own)."""
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
        return None
    try:
        storage = tensor.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):  # a functorch wrapper, or a tensor without storage
        return None
    return ("at", storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


NO_WRITES = StateWrites((), (), ())


def merged(*writes: StateWrites) -> StateWrites:
    """One ``StateWrites`` holding every slot of ``writes``, each once (a
    tensor by its memory, a module's name by the module and the name): the
    function's own slots and those of the jaxified calls it made (NOTE [a
    nested call's effects are its caller's] in real_writes.py)."""
    if len(writes) == 1:
        return writes[0]
    closed: dict[Any, tuple[torch.Tensor, tuple[torch.Size, torch.dtype]]] = {}
    named: dict[tuple[int, str], tuple[torch.nn.Module, str, tuple[torch.Size, torch.dtype]]] = {}
    for each in writes:
        first = len(each.closed_over)
        for tensor, layout in zip(each.closed_over, each.layouts):
            closed.setdefault(memory_of(tensor) or id(tensor), (tensor, layout))
        for (module, name), layout in zip(each.in_modules, each.layouts[first:]):
            named.setdefault((id(module), name), (module, name, layout))
    return StateWrites(
        tuple(tensor for tensor, _ in closed.values()),
        tuple((module, name) for module, name, _ in named.values()),
        tuple(layout for _, layout in closed.values()) + tuple(layout for *_, layout in named.values()),
    )


# (id(module), name) of the bindings replaying calls made for a forward: a
# trial run around a trace leaves them alone (NOTE [derivatives do not write
# again]).
_bound_by_replays: set[tuple[int, str]] = set()


def bound_by_a_replay(module: torch.nn.Module, name: str) -> bool:
    """Whether a replaying call bound ``module.name`` for the forward running."""
    return (id(module), name) in _bound_by_replays


def _table(module: torch.nn.Module, name: str) -> dict[str, object] | None:
    for table in (module._parameters, module._buffers, module.__dict__):
        if name in table:
            return table
    return None


@contextlib.contextmanager
def module_slots_entered(
    writes: StateWrites,
    starts: Callable[[int, torch.nn.Module, str, torch.Tensor], None],
    ends: Callable[[int, torch.nn.Module, str], None] | None = None,
) -> Iterator[None]:
    """Within the block, call ``starts(slot, module, name, tensor)`` for each
    module slot of ``writes`` when the outermost module ``forward`` holding
    it (its module or one above) starts on this thread, with the tensor the
    module binds there, if it has the layout inference saw (else it is not
    that state: no call); and ``ends(slot, module, name)`` for each slot
    when that ``forward`` ends."""
    if not writes.in_modules:
        yield
        return
    first = len(writes.closed_over)
    by_module: dict[int, list[tuple[int, torch.nn.Module, str]]] = {}
    for slot, (module, name) in enumerate(writes.in_modules, start=first):
        by_module.setdefault(id(module), []).append((slot, module, name))
    thread = threading.get_ident()
    running: list[tuple[torch.nn.Module, list[tuple[int, torch.nn.Module, str]]]] = []

    def pre(module: torch.nn.Module, args: object) -> None:
        if threading.get_ident() != thread:
            return
        if running:
            running.append((module, []))
            return
        held = [entry for sub in module.modules() for entry in by_module.get(id(sub), ())]
        running.append((module, held))
        for slot, owner, name in held:
            table = _table(owner, name)
            tensor = None if table is None else table[name]
            if isinstance(tensor, torch.Tensor) and (tensor.shape, tensor.dtype) == writes.layouts[slot]:
                starts(slot, owner, name, tensor)

    def post(module: torch.nn.Module, args: object, output: object) -> None:
        if threading.get_ident() != thread or not running:
            return
        _, held = running.pop()
        if ends is not None:
            for slot, owner, name in held:
                ends(slot, owner, name)

    with own_global_hooks(pre, post):
        yield


class ReplayedBindings:
    """A replaying call's module slots: each bound, for the outermost forward
    holding it, to a tensor of the replay's own (first the token's value,
    then whatever the forward left there), and bound back after it (NOTE
    [derivatives do not write again])."""

    def __init__(self, value_of: Callable[[int], torch.Tensor]) -> None:
        self._value_of = value_of  # slot -> a new tensor holding the token's value
        self._state: dict[int, object] = {}  # slot -> the replay's tensor now
        self._found: dict[int, object] = {}  # slot -> what the module bound when the forward started

    def starts(self, slot: int, module: torch.nn.Module, name: str, found: torch.Tensor) -> None:
        if slot in self._found:
            return
        self._found[slot] = found
        _table(module, name)[name] = self._state[slot] if slot in self._state else self._value_of(slot)
        _bound_by_replays.add((id(module), name))

    def ends(self, slot: int, module: torch.nn.Module, name: str) -> None:
        if slot not in self._found:
            return
        table = _table(module, name)
        if table is not None:
            self._state[slot] = table[name]  # what the forward left, for a later forward of this call
            table[name] = self._found.pop(slot)
        _bound_by_replays.discard((id(module), name))


def pack(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s value, as a new 1-d uint8 tensor (an op a
    graph-mode trace records, reading the tensor when the graph runs)."""
    with outside_transforms():
        return tensor.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def unpack(data: torch.Tensor, layout: tuple[torch.Size, torch.dtype]) -> torch.Tensor:
    """A new tensor with the value whose bytes ``data`` holds (from ``pack``)."""
    shape, dtype = layout
    return data.clone().view(dtype).reshape(shape)


def unpack_into(tensor: torch.Tensor, data: torch.Tensor) -> None:
    """Set ``tensor`` to the value whose bytes ``data`` holds (from ``pack``)."""
    with torch.no_grad(), outside_transforms():
        tensor.copy_(unpack(data, (tensor.shape, tensor.dtype)))


class WritesPutBack:
    """Around each call (``around``), notes the value of every closed-over
    slot's tensor, and puts it back after the call (NOTE [derivatives do
    not write again])."""

    def __init__(self, writes: StateWrites) -> None:
        self._tensors = writes.closed_over

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        with torch.no_grad(), outside_transforms(), _disable_current_modes():
            saved = [(t, t.detach().clone()) for t in self._tensors]
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, value in saved:
                    tensor.copy_(value)


def recomputed_bindings_kept(
    fn: Callable[..., Any], bindings: tuple[tuple[torch.nn.Module, str], ...]
) -> Callable[..., Any]:
    """``fn`` (a call with transforms), leaving each (module, name) of
    ``bindings``, attributes a hook of PyTorch's binds anew on every call,
    bound as it found them: not to a functorch wrapper of the call's, which
    would outlive its transform (NOTE [attributes PyTorch's hooks recompute]
    in real_writes.py)."""
    if not bindings:
        return fn

    def run(*args: Any) -> Any:
        found = [(table, name, table[name]) for module, name in bindings if (table := _table(module, name)) is not None]
        try:
            return fn(*args)
        finally:
            for table, name, tensor in found:
                if table.get(name) is not tensor:
                    table[name] = tensor

    return run
