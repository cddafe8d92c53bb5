"""The tensors a function keeps between calls and writes in place: finding
them at a call, carrying their values from a value call to its derivatives,
and putting back what a derivative call wrote.

NOTE [derivatives do not write again]
A function may write in place into tensors it keeps between calls: a module
in training mode updates its running statistics (``BatchNorm``,
``InstanceNorm(track_running_stats=True)``) and counts its batches, and
``spectral_norm`` advances its power iteration and divides the weight by the
new estimate. A derivative is a PyTorch call of its own that runs the forward
again (NOTE [every derivative is a PyTorch function]), so ``jax.grad`` and
``jax.value_and_grad`` made each update twice, where PyTorch's
``loss.backward()`` makes it once (batch norm counted two batches a step),
and differentiated a forward that started from the state the value call
left: ``spectral_norm``'s gradient was taken at the next estimate.

So shape inference notes which such tensors the function wrote (its trial
run sees every in-place write: ``RealWritesUndone`` in real_writes.py), the
*slots* of a ``StateWrites``:

- a tensor bound to a module whose ``forward`` ran (a parameter, buffer or
  attribute), as the module and the name, because the tensor bound there at
  a call may be another object than at inference (``functional_call`` swaps
  tensors in, a module's buffers are copied to each device, and the run on
  meta tensors wrote meta copies). At a call it is found when that module's
  ``forward`` starts (``slots_found``), before the module writes it;
- any other real tensor that no op of the run made (one the function closes
  over), as itself.

The value call makes the writes, once, as PyTorch does, and returns the
bytes of each slot's value from before it wrote (``pack``, in the token of
NOTE [derivatives replay the value's draws] in replayed_calls.py). Every
derivative call sets each slot to those bytes when it is found, so its
forward is the value call's, and when it has finished (its backward
included) puts back the value the slot had when it started, the one the
value call left (``WritesPutBack``). Putting back at the end of the forward
instead would bump the version of a tensor the backward may have saved, and
autograd would refuse it. A graph-mode replay runs no ``forward`` to find a
module's tensors in: its graph sets them (the trace recorded the copy into
the constants it found) and ``WritesPutBack`` puts back the tensors earlier
calls found.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes  # private, as in real_writes.py

from .functorch_levels import outside_transforms


@dataclasses.dataclass(frozen=True, eq=False)
class StateWrites:
    """What a function wrote in place, of the tensors it keeps between calls
    (NOTE [derivatives do not write again]). The slots are the closed-over
    tensors, then the module names, each with its shape and dtype."""

    closed_over: tuple[torch.Tensor, ...]  # real tensors no op of the run made
    in_modules: tuple[tuple[torch.nn.Module, str], ...]  # bound to a module's name
    layouts: tuple[tuple[torch.Size, torch.dtype], ...]  # of every slot

    def __bool__(self) -> bool:
        return bool(self.layouts)

    def slot_bytes(self) -> list[int]:
        """The size of each slot's value, in bytes."""
        return [math.prod(shape) * dtype.itemsize for shape, dtype in self.layouts]


NO_WRITES = StateWrites((), (), ())


def _bound(module: torch.nn.Module, name: str) -> object:
    for table in (module._parameters, module._buffers, module.__dict__):
        if name in table:
            return table[name]
    return None


@contextlib.contextmanager
def slots_found(writes: StateWrites, found: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Within the block, call ``found(slot, tensor)`` for each slot's tensor
    of ``writes`` as it is found on this thread: a closed-over one at once,
    one bound to a module when that module's ``forward`` starts (each time
    it starts, and only if it has the slot's layout)."""
    for slot, tensor in enumerate(writes.closed_over):
        found(slot, tensor)
    if not writes.in_modules:
        yield
        return
    first = len(writes.closed_over)
    slots: dict[int, tuple[torch.nn.Module, list[tuple[int, str]]]] = {}
    for slot, (module, name) in enumerate(writes.in_modules, start=first):
        slots.setdefault(id(module), (module, []))[1].append((slot, name))
    thread = threading.get_ident()

    def starts(module: torch.nn.Module, args: object) -> None:
        entry = slots.get(id(module))
        if entry is None or threading.get_ident() != thread:
            return
        for slot, name in entry[1]:
            tensor = _bound(module, name)
            if isinstance(tensor, torch.Tensor) and (tensor.shape, tensor.dtype) == writes.layouts[slot]:
                found(slot, tensor)

    hook = torch.nn.modules.module.register_module_forward_pre_hook(starts)
    try:
        yield
    finally:
        hook.remove()


def pack(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s value, as a new 1-d uint8 tensor (an op a
    graph-mode trace records, reading the tensor when the graph runs)."""
    with outside_transforms():
        return tensor.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def unpack_into(tensor: torch.Tensor, data: torch.Tensor) -> None:
    """Set ``tensor`` to the value whose bytes ``data`` holds (from ``pack``)."""
    with torch.no_grad(), outside_transforms():
        tensor.copy_(data.clone().view(tensor.dtype).reshape(tensor.shape))


# The tensors a call really writes (a trace's fake tensors are subclasses too).
_REAL = (torch.Tensor, torch.nn.Parameter)


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A real copy of ``tensor``, outside any transform or trace running."""
    with torch.no_grad(), outside_transforms(), _disable_current_modes():
        return tensor.detach().clone()


class WritesPutBack:
    """Around each call (``around``), notes the value of every slot's tensor
    found (``save``, before the call sets or writes it), and puts it back
    after the call (NOTE [derivatives do not write again]). Calls must not
    overlap (replayed_calls.py holds one lock around them)."""

    def __init__(self, writes: StateWrites) -> None:
        # Every tensor found so far: the closed-over ones, and those found
        # bound to a module at a call (a graph replay runs no forward).
        self._known: dict[int, torch.Tensor] = {id(t): t for t in writes.closed_over}
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def save(self, tensor: torch.Tensor) -> None:
        """Note ``tensor``'s value now, to put back after the call."""
        if self._saved is None or id(tensor) in self._saved or type(tensor) not in _REAL:
            return  # outside a call, noted already, or a trace's fake tensor
        self._known.setdefault(id(tensor), tensor)
        self._saved[id(tensor)] = (tensor, _snapshot(tensor))

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        if self._saved is not None:  # a call inside one (the runner's forward-mode lock re-enters it)
            yield
            return
        self._saved = {}
        try:
            for tensor in list(self._known.values()):
                self.save(tensor)
            yield
        finally:
            saved, self._saved = self._saved, None
            with torch.no_grad():
                for tensor, value in saved.values():
                    tensor.copy_(value)
