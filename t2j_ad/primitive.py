"""The torch_call primitive: its definition, ``torch_call`` that binds it, and
its abstract evaluation.

The ground floor of the JAX side: it imports no rule. The rules
(``rules/jvp.py``, ``rules/transpose.py``, ``rules/batching.py``,
``rules/partitioning.py``) import ``torch_call`` from here to re-bind it, and
``registration.py``, on top, registers them all on the primitive in one block.

NOTE [results on Explicit axes]
On a mesh whose axes are Explicit (``jax.make_mesh``'s default from JAX 0.10
on), every value's type says how it is sharded, and each operation must say
how its results are. A call's results were typed without a mesh, so under
``jax.vmap`` of a batch sharded over such an axis the first JAX operation
on a result failed ("Resource axis: b of P('b', None) is not found in
mesh: ()"; ``jax.pure_callback`` fails the same way), and a declared
function's results were typed whole, so JAX gathered them. So results are
typed on the inputs' mesh: along the axis the call maps elementwise
(``mapped_axes.batch_map``: the ``jax.vmap`` axis, or ``batch_argnums``'
leading axis) sharded as that axis of the first mapped input that is
sharded; every other dimension, and every result of a call that maps no
axis, whole. The partitioner then runs such a call per device (NOTE
[partitioning torch_call]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._jax_internals import (
    ShapedArray,
    explicit_mesh,
    hold_weakly_in_jax_caches,
    make_primitive,
    match_varying,
    result_aval,
    spec_entry,
)
from .mapped_axes import batch_map
from .torch_fn import TorchFn

torch_call_p = make_primitive("torch_call")
hold_weakly_in_jax_caches(TorchFn)


def torch_call(args: Sequence[Any], fun: TorchFn) -> list[Any]:
    """Bind the primitive: run ``fun`` (a TorchFn) on flat JAX arrays."""
    return list(torch_call_p.bind(*match_varying(args), fun=fun))


def torch_call_abstract_eval(*avals: Any, fun: TorchFn) -> list[ShapedArray]:
    """The outputs' shapes and dtypes (``fun`` already knows them), varying
    over the same mesh axes as the inputs inside ``shard_map``, and sharded
    along the axis the call maps on a mesh's Explicit axes (NOTE [results on
    Explicit axes])."""
    mapped: list[tuple[int, Any] | None] = [None] * len(fun.out_avals)
    bm = batch_map(fun) if explicit_mesh(avals) is not None else None
    if bm is not None:
        entries = [spec_entry(a, d) for a, d in zip(avals, bm.in_dims) if d is not None]
        entry = next((e for e in entries if e is not None), None)
        if entry is not None:
            mapped = [None if d is None else (d, entry) for d in bm.out_dims]
    return [result_aval(a.shape, a.dtype, avals, m) for a, m in zip(fun.out_avals, mapped)]
