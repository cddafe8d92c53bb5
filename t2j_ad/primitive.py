"""The torch_call primitive: its definition, ``torch_call`` that binds it, and
its abstract evaluation.

The ground floor of the JAX side: it imports no rule. The rules
(``rules/jvp.py``, ``rules/transpose.py``, ``rules/batching.py``,
``rules/partitioning.py``) import ``torch_call`` from here to re-bind it, and
``registration.py``, on top, registers them all on the primitive in one block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._jax_internals import ShapedArray, hold_weakly_in_jax_caches, make_primitive, match_varying, result_aval
from .torch_fn import TorchFn

torch_call_p = make_primitive("torch_call")
hold_weakly_in_jax_caches(TorchFn)


def torch_call(args: Sequence[Any], fun: TorchFn) -> list[Any]:
    """Bind the primitive: run ``fun`` (a TorchFn) on flat JAX arrays."""
    return list(torch_call_p.bind(*match_varying(args), fun=fun))


def torch_call_abstract_eval(*avals: Any, fun: TorchFn) -> list[ShapedArray]:
    """The outputs' shapes and dtypes (``fun`` already knows them), varying
    over the same mesh axes as the inputs inside ``shard_map``."""
    return [result_aval(a.shape, a.dtype, avals) for a in fun.out_avals]
