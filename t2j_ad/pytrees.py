"""What JAX's pytrees make of a PyTorch function's arguments and results
beyond arrays: PyTorch's named result tuples, and Python bools.

NOTE [PyTorch's result tuples]
``torch.max(x, 0)``, ``sort``, ``topk``, ``linalg.slogdet`` and the other ops
of ``torch.return_types`` return a structseq: a tuple subclass with named
fields (``.values``, ``.indices``). JAX's pytrees know tuples and
namedtuples, not structseqs, so such a result was one leaf, refused as "not a
torch.Tensor". Each class is registered as a pytree node whose children are
its fields, so the JAX function returns the same structure, holding JAX
arrays: ``f(x).values`` works as in PyTorch. The registration is JAX's
process-wide pytree registry; a class someone registered first is left as
they registered it.

NOTE [Python bools are flags]
A Python bool argument (``need_weights=True``, ``is_causal=True``, a
``training`` flag) is almost always a flag the function branches on in
Python, and PyTorch's own functions refuse a tensor there (``is_causal must
be bool, not Tensor``). As a 0-d array it would also have been False (zero)
in the shape inference run, so a function returning an extra output for
True was refused with the shapes inferred for False. So a Python bool (not a
NumPy or JAX bool, which stay arrays) reaches the function as it was
passed, and each value is a signature of its own, as ``static_argnums`` is
for ``jax.jit``. Other Python numbers stay 0-d arrays, differentiable and
one signature for every value; one that sets a shape must be closed over.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import torch


def _register_return_types() -> None:
    for cls in getattr(torch.return_types, "all_return_types", ()):
        fields = tuple(getattr(cls, "__match_args__", ()))
        if len(fields) != getattr(cls, "n_sequence_fields", -1):
            continue  # not the structseq layout this registration reads
        keys = tuple(jax.tree_util.GetAttrKey(f) for f in fields)
        try:
            jax.tree_util.register_pytree_with_keys(
                cls,
                lambda r, keys=keys: (tuple(zip(keys, r)), None),
                lambda _, children, cls=cls: cls(tuple(children)),
                flatten_func=lambda r: (tuple(r), None),
            )
        except ValueError:  # registered already (NOTE [PyTorch's result tuples])
            pass


_register_return_types()


class _Flag:
    """A Python bool argument as a pytree node with no children: its value
    is part of the tree structure (the signature), and unflattening gives
    the bool back (NOTE [Python bools are flags])."""

    __slots__ = ("value",)

    def __init__(self, value: bool) -> None:
        self.value = value


jax.tree_util.register_pytree_node(_Flag, lambda f: ((), f.value), lambda value, _: value)


def flags_kept(tree: Any, leaves: Iterable[Any]) -> Any:
    """``tree`` with each Python bool among ``leaves`` (its leaves) made a
    flag the tree structure holds; ``tree`` itself when it has none."""
    if not any(type(leaf) is bool for leaf in leaves):
        return tree
    return jax.tree_util.tree_map(lambda leaf: _Flag(leaf) if type(leaf) is bool else leaf, tree)
