"""The torch_call primitive: abstract evaluation, lowering, and the one block
that registers every rule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import backends
from ._jax_internals import (
    ShapedArray,
    hold_weakly_in_jax_caches,
    make_primitive,
    match_varying,
    register_rules,
    require_devices_during_lowering,
    result_aval,
)
from .rules.batching import torch_call_batch
from .rules.jvp import torch_call_jvp
from .rules.partitioning import partitionable
from .rules.transpose import torch_call_transpose
from .torch_fn import TorchFn

torch_call_p = make_primitive("torch_call")
hold_weakly_in_jax_caches(TorchFn)


def torch_call(args: Sequence[Any], fun: TorchFn) -> list[Any]:
    """Bind the primitive: run ``fun`` (a TorchFn) on flat JAX arrays."""
    return list(torch_call_p.bind(*match_varying(args), fun=fun))


def torch_call_abstract_eval(*avals: Any, fun: TorchFn) -> list[ShapedArray]:
    return [result_aval(a.shape, a.dtype, avals) for a in fun.out_avals]


def torch_call_lowering(ctx: Any, *args: Any, fun: TorchFn) -> Sequence[Any]:
    return backends.select().lower(ctx, *args, fun=fun)


register_rules(
    torch_call_p,
    impl=None,  # eager calls compile the single primitive, like lax ops
    abstract_eval=torch_call_abstract_eval,
    jvp=torch_call_jvp,
    transpose=torch_call_transpose,
    batch=torch_call_batch,
    lowering=partitionable(torch_call_lowering),  # NOTE [partitioning torch_call]
)
require_devices_during_lowering(torch_call_p)  # the partitioned lowering reads the mesh
