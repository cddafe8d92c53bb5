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
tensor it holds (``get_attr`` constants) and of every tensor its function
reaches without taking it as an input (``references.reachable``: closures,
globals, default arguments, a bound method's object), and is used only
while they hold: a call that finds one changed traces again, as for a
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
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .references import reachable

_sizes = torch.Tensor.size
_strides = torch.Tensor.stride
_offsets = torch.Tensor.storage_offset
_dtype = operator.attrgetter("dtype")


def referenced_tensors(fn: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
    """The tensors ``fn`` refers to without taking them as arguments (its
    closure, globals, default arguments, a bound method's object: NOTE [the
    layouts a graph assumed])."""
    return tuple(reachable(fn, lambda obj: isinstance(obj, torch.Tensor)))


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
    """The layouts ``tensors`` have now; ``hold()``: whether they still do."""

    __slots__ = ("_tensors", "_seen")

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        unique = {id(t): t for t in tensors if _strided(t)}
        self._tensors = tuple(unique.values())
        self._seen = _layouts(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def hold(self) -> bool:
        """Whether every tensor has the size, stride, storage offset and
        dtype it had."""
        try:
            return _layouts(self._tensors) == self._seen
        except RuntimeError:  # one became sparse or nested (``.data =``): no strides now
            return False
