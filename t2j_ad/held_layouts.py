"""The sizes and strides of the tensors a graph holds without taking them as
inputs: a graph is used only while they hold.

NOTE [the layouts a graph assumed]
A graph holds the tensors its function closes over (a parameter named in a
closure, a module's buffer) by reference, so the next replay sees an
in-place update to one, as an eager call does. Their sizes and strides are
the trace's, though: the trace read them into Python (``w.shape[0]``, a
``reshape`` to a size computed from them, ``numel()``, a branch on
``is_contiguous()``), and the graph keeps what it read. After
``w.data = torch.ones(2)`` on a parameter traced with 4 entries, a replay
of ``x * w.shape[0]`` computed ``x * 4`` where eager computes ``x * 2``, and
``x[: len(w)] * w`` failed inside the graph; a reshape traced as a view
failed once the parameter was replaced by a transposed tensor.

So each graph records the size, stride, storage offset and dtype of every
tensor it holds (``get_attr`` constants) and of the tensor at every name its
function reaches a tensor by without taking it as an input
(``references.reachable``: a closure cell, a global, a dict entry, a plain
object's attribute; looked up again on each call, and not kept alive: a
notebook binds new weights to the name), and is used only while they hold: a call that finds one changed traces again, as for a
module's training flag (NOTE [a graph per training mode]), and the graph
for the old layouts is dropped. ``.data =`` with a tensor of the same
layout (a hand-written SGD step) keeps the graph. A function whose held
tensors change layout after three such traces (a memory bank grown between
calls) runs eagerly from then on, announced once: a trace per call is far
slower than eager. The look costs a few
tenths of a microsecond per tensor per call, and nothing for a function
that holds none (``jaxify_module``'s parameters are inputs, not held).
On CUDA, a captured CUDA graph fixed the held tensors' addresses as well
(NOTE [CUDA graph replay]).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .references import held_at, name_key, reachable

_sizes = torch.Tensor.size
_strides = torch.Tensor.stride
_offsets = torch.Tensor.storage_offset
_dtype = operator.attrgetter("dtype")


def named_tensors(fn: Callable[..., Any]) -> list[tuple[Any, Any]]:
    """Where the tensors ``fn`` names without taking them as arguments are
    (a closure cell, a global, a dict entry, a plain object's attribute:
    ``(holder, key)`` for ``references.held_at``), so each call can look at
    the tensor there now (NOTE [the layouts a graph assumed])."""
    bindings: list[tuple[Any, Any, Any]] = []
    reachable(fn, _a_tensor, bindings=bindings)
    return list({name_key(h, k): (h, k) for h, k, v in bindings if _a_tensor(v)}.values())


def _a_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _strided(tensor: torch.Tensor) -> bool:
    # Sparse and nested tensors have no strides to read.
    return tensor.layout == torch.strided and not tensor.is_nested


def _layouts(tensors: tuple[torch.Tensor, ...]) -> tuple[list[Any], ...]:
    return (
        list(map(_sizes, tensors)),
        list(map(_strides, tensors)),
        list(map(_offsets, tensors)),
        list(map(_dtype, tensors)),
    )


class HeldLayouts:
    """The layouts of ``tensors`` (held) and of the tensors at ``named``
    (``named_tensors``: looked up again on every call, since a notebook
    binds new weights to a name, and not kept alive) now; ``hold()``:
    whether they still have them."""

    __slots__ = ("_tensors", "_named", "_seen")

    def __init__(self, tensors: Iterable[torch.Tensor], named: Sequence[tuple[Any, Any]] = ()) -> None:
        self._tensors = tuple({id(t): t for t in tensors if _strided(t)}.values())
        self._named = tuple((h, k) for h, k in named if isinstance(t := held_at(h, k), torch.Tensor) and _strided(t))
        self._seen = _layouts(self._now())

    def __len__(self) -> int:
        return len(self._tensors) + len(self._named)

    def _now(self) -> tuple[Any, ...]:
        return self._tensors + tuple(held_at(h, k) for h, k in self._named) if self._named else self._tensors

    def hold(self) -> bool:
        """Whether every tensor has the size, stride, storage offset and
        dtype it had (and every name still holds a tensor)."""
        try:
            return _layouts(self._now()) == self._seen
        except (RuntimeError, TypeError, AttributeError):  # no strides now (sparse, nested), or no tensor
            return False
