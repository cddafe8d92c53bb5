"""What JAX's pytrees make of a PyTorch function's arguments and results
beyond arrays: PyTorch's named result tuples, result classes registered
with PyTorch's pytrees, and Python bools.

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

NOTE [PyTorch's pytree nodes in results]
A library may register its result classes with PyTorch's pytrees, which
``torch.func`` then looks through: transformers' ``ModelOutput`` (what
every model returns by default, a dict subclass) and its caches. JAX's
pytrees do not know them, so such a result was one leaf, refused as "not a
torch.Tensor". A result class PyTorch's registry has and JAX's lacks, of
a library (not PyTorch's, JAX's or Python's own: ``torch.Size`` stays a
leaf), holding only tensors, is registered with JAX the first time a
result holds one, with PyTorch's own flatten and unflatten functions (and
its keys, as JAX's), so the JAX function returns the same class, holding
JAX arrays (``f(x).logits``). A class JAX already knows is left as
registered there.

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
import torch.utils._pytree as torch_pytree  # private, but what libraries register their results with


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


class _TorchContext:
    """A PyTorch pytree node's context (a list of keys, say) as JAX's aux
    data, which JAX hashes and compares."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _TorchContext):
            return False
        try:
            return bool(self.value == other.value)
        except Exception:  # noqa: BLE001 - no plain answer: the same only if identical
            return self.value is other.value

    def __hash__(self) -> int:
        return hash(repr(self.value))


def _jax_key(key: Any, index: int) -> Any:
    """PyTorch's pytree key as JAX's."""
    if isinstance(key, torch_pytree.MappingKey):
        return jax.tree_util.DictKey(key.key)
    if isinstance(key, torch_pytree.SequenceKey):
        return jax.tree_util.SequenceKey(key.idx)
    if isinstance(key, torch_pytree.GetAttrKey):
        return jax.tree_util.GetAttrKey(key.name)
    return jax.tree_util.FlattenedIndexKey(index)


# Classes PyTorch's pytrees know that are not results of a library's own
# (torch.Size, collections.deque): registering them with JAX's process-wide
# registry would change what JAX makes of them everywhere (a torch.Size
# argument would become a node of ints).
_NOT_RESULTS = ("builtins", "collections", "torch", "jax", "numpy", "typing")


def _a_libraries_result(cls: type, leaf: Any) -> bool:
    """Whether ``leaf``, of a class PyTorch's pytrees know, is a library's
    result class holding tensors only (NOTE [PyTorch's pytree nodes in
    results])."""
    if (cls.__module__ or "").split(".")[0] in _NOT_RESULTS:
        return False
    held = torch_pytree.tree_leaves(leaf)
    return bool(held) and all(isinstance(t, torch.Tensor) or t is None for t in held)


def _round_trips(leaf: Any, flatten: Any, unflatten: Any, flatten_with_keys: Any) -> bool:
    """Whether ``leaf`` flattens (with keys too, where given) and unflattens
    back to its own class."""
    try:
        children, context = flatten(leaf)
        if flatten_with_keys is not None:
            pairs, keyed_context = flatten_with_keys(leaf)
            if len(pairs) != len(children) or keyed_context != context:
                return False
        return type(unflatten(context, children)) is type(leaf)
    except Exception:  # noqa: BLE001 - any failure: not a node to register
        return False


def registered_from_torch(leaves: Iterable[Any]) -> bool:
    """Register with JAX's pytrees each class among ``leaves`` (values JAX
    took for leaves) that PyTorch's pytrees know (NOTE [PyTorch's pytree
    nodes in results]); whether any was."""
    registered = False
    for leaf in {type(leaf): leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)}.values():
        cls = type(leaf)
        node = torch_pytree.SUPPORTED_NODES.get(cls)
        if node is None or not _a_libraries_result(cls, leaf):
            continue

        def flatten(obj: Any, node: Any = node) -> tuple[list[Any], _TorchContext]:
            children, context = node.flatten_fn(obj)
            return list(children), _TorchContext(context)

        def unflatten(context: _TorchContext, children: Iterable[Any], node: Any = node) -> Any:
            return node.unflatten_fn(list(children), context.value)

        def flatten_with_keys(obj: Any, node: Any = node) -> tuple[list[tuple[Any, Any]], _TorchContext]:
            # The context unflatten_fn takes is flatten_fn's: flatten_with_keys_fn
            # may give another (register_dataclass's leaves out the None fields).
            children, context = node.flatten_fn(obj)
            pairs, _ = node.flatten_with_keys_fn(obj)
            keys = [key for key, _ in pairs] if len(pairs) == len(children) else [None] * len(children)
            return [(_jax_key(key, i), child) for i, (key, child) in enumerate(zip(keys, children))], _TorchContext(
                context
            )

        if not _round_trips(leaf, flatten, unflatten, flatten_with_keys if node.flatten_with_keys_fn else None):
            continue  # JAX's registry is process-wide, with no way back: only a node that works
        try:
            if node.flatten_with_keys_fn is not None:
                jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten_func=flatten)
            else:
                jax.tree_util.register_pytree_node(cls, flatten, unflatten)
        except ValueError:  # registered meanwhile (NOTE [PyTorch's pytree nodes in results])
            pass
        registered = True
    return registered


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
