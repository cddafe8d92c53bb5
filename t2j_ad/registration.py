"""The one block that registers every rule of the torch_call primitive.

The top floor of the JAX side: the primitive (``primitive.py``) and its rules
(``rules/``) sit below and never import this module. ``api.py`` imports it, so
the rules are in place before any function is jaxify'd.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import backends
from ._jax_internals import register_remat_rule, register_rules, require_devices_during_lowering
from .primitive import torch_call_abstract_eval, torch_call_p
from .replayed_calls import is_value_call
from .rules.batching import torch_call_batch
from .rules.jet import torch_call_jet
from .rules.jvp import torch_call_jvp
from .rules.partitioning import partitionable
from .rules.transpose import torch_call_transpose
from .torch_fn import TorchFn


def torch_call_lowering(ctx: Any, *args: Any, fun: TorchFn) -> Sequence[Any]:
    """Lower one torch_call with the selected backend (C++ FFI or callback)."""
    return backends.select().lower(ctx, *args, fun=fun)


register_rules(
    torch_call_p,
    impl=None,  # eager calls compile the single primitive, like lax ops
    abstract_eval=torch_call_abstract_eval,
    jvp=torch_call_jvp,
    transpose=torch_call_transpose,
    batch=torch_call_batch,
    jet=torch_call_jet,
    lowering=partitionable(torch_call_lowering),  # NOTE [partitioning torch_call]
)
require_devices_during_lowering(torch_call_p)  # the partitioned lowering reads the mesh
# NOTE [a value call runs once]: jax.checkpoint never runs one again.
register_remat_rule(torch_call_p, never_recomputed=lambda params: is_value_call(params["fun"].base))
