"""A call run once per shard over a mesh's Explicit axes, given ``out_specs``.

NOTE [per-shard calls over Explicit axes]
With JAX's explicit sharding (``jax.make_mesh`` defaults to Explicit axes
from JAX 0.10 on) every array's type carries its ``PartitionSpec``. A PyTorch
call is opaque to the partitioner, so the only way JAX could run it on a
sharded input is to gather the input first. torch2jax's ``out_specs`` lets
the user say instead what the call means per shard: the call is wrapped in
``jax.shard_map``, manual over exactly the Explicit axes that the inputs are
sharded over (or that ``out_specs`` names), with ``in_specs`` read from the
inputs' types. Each device then runs PyTorch on its own block and nothing
is gathered; the other axes of the mesh stay automatic (partially manual).

Derivatives need nothing more: the primitive's results vary over the manual
axes its inputs vary over (``result_aval`` in ``_jax_internals.py``), so
``shard_map``'s transpose sums a replicated input's cotangent (a weight's
gradient) over the shards, with one all-reduce.

Refused, with a ``ValueError`` that names the fix:

- inputs sharded over Explicit axes and no ``out_specs``: running on the
  global arrays would be a silent all-gather (what torch2jax refuses too);
- ``out_specs`` naming Auto axes: the partitioner would gather the inputs
  of the opaque call. ``t2j_ad.jaxify(fn, batch_argnums=...)`` is the way to
  split a call over Auto axes (docs/multi-device.md);
- declared global output shapes that ``out_specs`` does not divide.

Without a mesh, or with every input replicated, the call runs once on the
global arrays, as it would without ``out_specs``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

__all__ = ["ShardPlan", "call_per_shard", "entry_axes", "local_shapes", "plan"]


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one entry of a ``PartitionSpec`` shards a dimension over."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec_axes(spec: P) -> frozenset[str]:
    """Every mesh axis that ``spec`` shards some dimension over."""
    return frozenset(axis for entry in spec for axis in entry_axes(entry))


def _axes_of_type(mesh: Any, axis_type: AxisType) -> frozenset[str]:
    return frozenset(name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == axis_type)


@dataclass(frozen=True)
class ShardPlan:
    """How one call is split: the mesh, one spec per input, the manual axes."""

    mesh: Any
    in_specs: tuple[P, ...]
    manual_axes: frozenset[str]


def plan(leaves: Sequence[Any], out_specs: Any, *, name: str) -> ShardPlan | None:
    """The per-shard plan for a call on ``leaves``, or None to call once on the global arrays.

    ``name`` is the function's name, for the errors.
    """
    mesh = jax.sharding.get_abstract_mesh()
    in_specs, manual = [], frozenset()
    for x in leaves:
        sharding = getattr(jax.typeof(x), "sharding", None)
        spec = getattr(sharding, "spec", None)
        in_specs.append(spec if spec is not None else P())
        if spec is None or sharding.mesh.empty:
            continue
        explicit = _spec_axes(spec) & _axes_of_type(sharding.mesh, AxisType.Explicit)
        if explicit:
            mesh, manual = sharding.mesh, manual | explicit
    if out_specs is not None and not mesh.empty:
        named = frozenset().union(*map(_spec_axes, jax.tree.leaves(out_specs, is_leaf=_is_spec)))
        auto = named & _axes_of_type(mesh, AxisType.Auto)
        if auto:
            raise ValueError(
                f"{name}: out_specs shards over the Auto mesh axes {sorted(auto)}, but a per-shard "
                f"PyTorch call needs Explicit axes (over Auto axes XLA would gather the inputs of "
                f"the opaque call). Make the mesh with axis_types=(jax.sharding.AxisType.Explicit, ...), "
                f"call inside jax.shard_map, or split over Auto axes with "
                f"t2j_ad.jaxify(fn, batch_argnums=...)."
            )
        if manual:  # with every input replicated, once on the global arrays (see the NOTE)
            manual |= named & _axes_of_type(mesh, AxisType.Explicit)
    if not manual:
        return None
    if out_specs is None:
        raise ValueError(
            f"{name}: the inputs are sharded over the Explicit mesh axes {sorted(manual)}, but no "
            f"out_specs was given. A PyTorch function is opaque to JAX, so either pass "
            f"out_specs=... (a PartitionSpec, or a tree of them, for the outputs) to run it once "
            f"per shard, or replicate the inputs, e.g. jax.sharding.reshard(x, P()), to run it "
            f"on the whole arrays."
        )
    return ShardPlan(mesh, tuple(in_specs), manual)


def local_shapes(shapes: Any, out_specs: Any, mesh: Any, *, name: str) -> Any:
    """The per-shard shapes of the global ``shapes``, split by ``out_specs`` over ``mesh``.

    ``out_specs`` is a tree prefix of ``shapes`` (one spec may stand for
    several outputs), as in ``jax.shard_map``.
    """

    def local(shape: jax.ShapeDtypeStruct, spec: P) -> jax.ShapeDtypeStruct:
        parts = [math.prod(mesh.shape[axis] for axis in entry_axes(entry)) for entry in spec]
        if len(parts) > len(shape.shape) or any(d % k for d, k in zip(shape.shape, parts)):
            raise ValueError(
                f"{name}: the declared output shape {tuple(shape.shape)} cannot be partitioned by "
                f"{spec} over the mesh {dict(mesh.shape)}; give output_shapes whose sharded "
                f"dimensions divide by the mesh axes' sizes, or leave output_shapes=None to infer "
                f"the per-shard shapes."
            )
        parts += [1] * (len(shape.shape) - len(parts))
        return jax.ShapeDtypeStruct(tuple(d // k for d, k in zip(shape.shape, parts)), shape.dtype)

    specs = jax.tree.broadcast(out_specs, shapes, is_leaf=_is_spec)
    return jax.tree.map(local, shapes, specs)


def call_per_shard(call: Callable[..., Any], leaves: Sequence[Any], shard_plan: ShardPlan, out_specs: Any) -> Any:
    """``call(*leaves)`` run once per shard: ``jax.shard_map`` over the plan's manual axes."""
    mapped = jax.shard_map(
        call,
        mesh=shard_plan.mesh,
        in_specs=shard_plan.in_specs,
        out_specs=out_specs,
        axis_names=set(shard_plan.manual_axes),
    )
    return mapped(*leaves)
