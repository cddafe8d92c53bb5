"""The one block that registers every rule of the torch_call primitive.

The top floor of the JAX side: the primitive (``primitive.py``) and its rules
(``rules/``) sit below and never import this module. ``api.py`` imports it, so
the rules are in place before any function is jaxify'd.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import backends
from ._jax_internals import (
    in_program_order,
    refused_in_scalar_computations,
    lower_nested_calls_in_place,
    register_remat_rule,
    register_rules,
    require_devices_during_lowering,
    run_every_call,
)
from .primitive import torch_call_abstract_eval, torch_call_p
from .replayed_calls import has_side_effects, is_value_call
from .rules.batching import torch_call_batch
from .rules.jet import torch_call_jet
from .rules.jvp import torch_call_jvp
from .rules.partitioning import partitionable
from .rules.transpose import torch_call_transpose
from .split_derivatives import torch_call_impl
from .torch_fn import TorchFn


def torch_call_lowering(ctx: Any, *args: Any, fun: TorchFn) -> Sequence[Any]:
    """Lower one torch_call with the selected backend (C++ FFI or callback)."""
    return backends.select().lower(ctx, *args, fun=fun)


def _has_side_effects(params: dict[str, Any]) -> bool:
    return has_side_effects(params["fun"])


register_rules(
    torch_call_p,
    impl=torch_call_impl,  # NOTE [a derivative called apart from its value] in split_derivatives.py
    abstract_eval=torch_call_abstract_eval,
    jvp=torch_call_jvp,
    transpose=torch_call_transpose,
    batch=torch_call_batch,
    jet=torch_call_jet,
    # NOTE [partitioning torch_call]; NOTE [calls with effects under jax.jit]
    lowering=refused_in_scalar_computations(
        partitionable(in_program_order(torch_call_lowering, has_effects=_has_side_effects)),
        name_of=lambda params: repr(params["fun"].name),
    ),
)
require_devices_during_lowering(torch_call_p)  # the partitioned lowering reads the mesh
# NOTE [a value call runs once]: jax.checkpoint never runs one again.
register_remat_rule(torch_call_p, never_recomputed=lambda params: is_value_call(params["fun"].base))
# NOTE [calls with effects under jax.jit]: JAX neither drops a call that
# draws or keeps state nor moves it out of a loop.
run_every_call(torch_call_p, has_effects=_has_side_effects, name_of=lambda params: repr(params["fun"].name))
lower_nested_calls_in_place(torch_call_p, has_effects=_has_side_effects)
