"""Partitioning: how XLA's SPMD partitioner splits a torch_call.

NOTE [partitioning torch_call]
Under a ``jax.jit`` whose inputs are sharded over several devices, XLA's SPMD
partitioner has to decide how each op runs per device. An opaque custom call
is replicated: every operand is all-gathered and every device runs PyTorch
on the whole batch. ``partitionable`` wraps the lowering so that a call with
a *mapped axis* is lowered through JAX's ``custom_partitioning`` instead:

* The mapped axis (``batch_map``). A call whose last transform is ``Vmap``
  maps that batch axis elementwise (``Vmap.in_dims``; outputs at 0). A call
  of a function declared batch-mapped (``jaxify(..., batch_argnums=...)``,
  ``BaseFn.batch_in_dims``) maps the leading axis of those inputs and of
  every output; the Jvp / Vjp / inner Vmap transforms above it carry that
  axis along: a tangent is mapped like its primal, a cotangent like its
  output, and the cotangent of a shared input (module parameters) is a sum
  over the mapped axis ("summed" outputs, ``None`` in ``out_dims``).
* The Shardy rule names the mapped axis by one factor ``b`` in every mapped
  operand and result; every other dimension is its own factor, marked
  need-replication, so only the mapped axis is ever split.
* The partition callback reads which mesh axes shard ``b`` and returns a
  per-device lowering: the same ``BaseFn`` and transform stack with the
  mapped size replaced by the local size (``local_fun``; equal by value, so
  recompiles reuse its registry key and built PyTorch callable). Summed
  outputs are ``psum``-ed over those mesh axes. Shared operands are
  replicated, as JAX would. If the size does not divide evenly, the callback
  keeps everything replicated (the call as before).
* Lifetime. XLA calls the partition callback while it compiles, after the
  outer lowering has finished, and JAX lowers the per-device function into a
  throwaway module whose host callbacks die with it. So the outer lowering
  creates a ``ffi.KeepAlive`` tied to the final executable and the callback
  registers the per-device TorchFn into it: its registry entry lives exactly
  as long as the executable (NOTE [registry lifetime] in registry.py).
* Only the FFI backend is partitioned. ``buffer_callback`` names its Python
  callable by an index into the module's host callbacks, which a throwaway
  module cannot provide, so the callback backend stays replicated (correct,
  4x the work on 4 devices).

Without a mapped axis (a plain call not declared batch-mapped, a reduction
such as a loss's gradient) the call stays replicated, as before.

NOTE [shardings no PartitionSpec says]
A reshape can split one mesh axis over two dimensions: a batch of 16 rows on
4 devices, reshaped to (2, 8, ...), has its first dimension split over one
half of the devices and its second over the other, and a slice of it
(``x.reshape(2, 8, 3)[0]``) lives on two of the four. No PartitionSpec of the
mesh says that, and ``custom_partitioning``, which decodes each operand's
sharding into one before calling back, failed inside JAX (an
AssertionError, or IndivisibleError under ``jax.vmap``): the whole
compilation failed. So the callbacks take the shardings undecoded
(``decode_shardings=False``) and decode them themselves
(``_jax_internals.as_named_sharding``); one no spec says counts as
unsharded, and the call runs replicated, its operands gathered, as an
undeclared call would.

NOTE [a call with effects on a mesh]
A call that draws random numbers or updates state it keeps (dropout, a
module in training mode) is marked as having side effects, so that XLA keeps
it (``replayed_calls.kept_by_xla``). XLA's SPMD partitioner refuses such an
op with no sharding or a replicated one ("Side-effect HLO must have
sharding"), so under a ``jax.jit`` over several devices every such call
failed to compile with XLA's internal error, its inputs sharded or not. A
replicated call would run PyTorch on every device, drawing and updating once
per device, and the one sharding XLA takes, MAXIMAL on one device
(``jax.pure_callback``'s), Shardy keeps only for JAX's own callback targets
(it compiled with GSPMD, which JAX is retiring). So such a call without a
mapped axis is refused at lowering, naming the ways that work: one device,
or ``shard_map`` / ``pmap``, where each device runs its own shard. One with
a mapped axis that the partitioner finds unsplit (the batch replicated,
sharded along another dimension, or not dividing evenly) would run whole on
every device, four different masks behind one "replicated" result, the
state updated once per device: the partition callback refuses it too.

NOTE [empty results on a mesh]
A call none of whose results holds an element is marked as having side
effects (``replayed_calls.kept_by_xla``), so that XLA, which replaces such
results by constants, still runs it and a function whose declared empty
result was really another shape is refused. Under a ``jax.jit`` over several
devices XLA's partitioner refuses that mark ("Side-effect HLO must have
sharding", an internal RET_CHECK) for every such call, the empty slice of a
batch included. There the results are the empty constants themselves, and
the function does not run, as a pure function of no output need not.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from .. import backends
from ..backends import ffi
from ..primitive import torch_call
from .._jax_internals import (
    ArrayMapping,
    SdyShardingRule,
    as_named_sharding,
    custom_partitioning,
    lower_fun,
    partitioned_devices,
)
from ..per_shard import entry_axes
from ..mapped_axes import BatchMap, batch_map
from ..replayed_calls import has_side_effects, holds_no_element
from ..torch_fn import BaseFn, TorchFn, Vmap


# Global BaseFn -> {local size: its per-device copy}. Weak keys: the copies
# go with the function; they do not refer back to it.
_local_bases: weakref.WeakKeyDictionary[BaseFn, dict[int, BaseFn]] = weakref.WeakKeyDictionary()
_local_bases_lock = threading.Lock()  # XLA may compile on several threads


def _local_base(base: BaseFn, size: int) -> BaseFn:
    """``base`` with its declared leading axis ``size`` long, made once."""
    with _local_bases_lock:
        by_size = _local_bases.setdefault(base, {})
        local = by_size.get(size)
        if local is None:
            local = by_size[size] = base.with_leading_size(size)
        return local


def local_bases(base: BaseFn) -> list[BaseFn]:
    """The per-device copies of ``base`` made so far (one per local size)."""
    with _local_bases_lock:
        return list(_local_bases.get(base, {}).values())


def local_fun(fun: TorchFn, size: int) -> TorchFn:
    """``fun`` on ``size`` rows of its mapped axis (equal by value on every call)."""
    if fun.transforms and isinstance(fun.transforms[-1], Vmap):
        return fun.parent().append(dataclasses.replace(fun.transforms[-1], axis_size=size))
    local = TorchFn.of(_local_base(fun.base, size))
    if fun.checks_effects:  # NOTE [a value call checked before it runs] in replayed_calls.py
        local = local.checking_effects()
    for t in fun.transforms:
        local = local.append(t)
    return local


def _axes_of(sharding: Any, dim: int) -> tuple[str, ...]:
    spec = getattr(sharding, "spec", None)
    return () if spec is None or dim >= len(spec) else entry_axes(spec[dim])


def _batch_axes(bm: BatchMap, mesh: Any, arg_shapes: Sequence[Any]) -> tuple[str, ...]:
    """The mesh axes the mapped axis is split over; () to stay replicated
    (NOTE [shardings no PartitionSpec says])."""
    for shape, d in zip(arg_shapes, bm.in_dims):
        if d is not None:
            axes = _axes_of(as_named_sharding(shape.sharding, mesh, len(shape.shape)), d)
            if axes:
                n = math.prod(mesh.shape[a] for a in axes)
                return axes if bm.size % n == 0 else ()
    return ()


def _named(mesh: Any, ndim: int, dim: int | None, axes: tuple[str, ...]) -> Any:
    entry = None if not axes else axes[0] if len(axes) == 1 else axes
    return NamedSharding(mesh, PartitionSpec(*[entry if k == dim else None for k in range(ndim)]))


def _sharding_rule(fun: TorchFn, bm: BatchMap) -> Any:
    others: list[str] = []

    def mapping(prefix: str, ndim: int, dim: int | None) -> Any:
        factors = []
        for k in range(ndim):
            if k == dim:
                factors.append("b")
            else:
                factors.append(f"{prefix}_{k}")
                others.append(factors[-1])
        return ArrayMapping(*factors)

    operands = tuple(mapping(f"i{i}", len(a.shape), d) for i, (a, d) in enumerate(zip(fun.in_avals, bm.in_dims)))
    results = tuple(mapping(f"o{j}", len(a.shape), d) for j, (a, d) in enumerate(zip(fun.out_avals, bm.out_dims)))
    return SdyShardingRule(operands, results, need_replication_factors=tuple(others))


def _lower_partitioned(ctx: Any, args: Sequence[Any], fun: TorchFn, bm: BatchMap) -> Sequence[Any]:
    keep = ffi.keep_alive(ctx)

    def call(*xs: Any) -> tuple[Any, ...]:
        return tuple(torch_call(xs, fun))

    def shardings(mesh: Any, axes: tuple[str, ...]):
        ins = tuple(_named(mesh, len(a.shape), d, axes) for a, d in zip(fun.in_avals, bm.in_dims))
        outs = tuple(_named(mesh, len(a.shape), d, axes) for a, d in zip(fun.out_avals, bm.out_dims))
        return ins, outs

    def infer(mesh: Any, arg_shapes: Sequence[Any], result_shape: Any) -> tuple[Any, ...]:
        return shardings(mesh, _batch_axes(bm, mesh, arg_shapes))[1]

    def partition(mesh: Any, arg_shapes: Sequence[Any], result_shape: Any):
        axes = _batch_axes(bm, mesh, arg_shapes)
        if not axes and has_side_effects(fun):  # NOTE [a call with effects on a mesh]
            raise NotImplementedError(_effects_on_a_mesh(fun, math.prod(mesh.shape.values()), mapped=True))
        n = math.prod(mesh.shape[a] for a in axes)
        local = local_fun(fun, bm.size // n) if axes else fun
        keep.register(local)  # alive as long as the executable (see NOTE)
        summed = [d is None and bool(axes) for d in bm.out_dims]

        def lower(*xs: Any) -> tuple[Any, ...]:
            outs = torch_call(xs, local)
            return tuple(jax.lax.psum(o, axes) if s else o for o, s in zip(outs, summed))

        ins, outs = shardings(mesh, axes)
        return mesh, lower, outs, ins

    partitioned = custom_partitioning(call)
    partitioned.def_partition(
        partition,
        infer_sharding_from_operands=infer,
        sharding_rule=_sharding_rule(fun, bm),
        decode_shardings=False,  # NOTE [shardings no PartitionSpec says]
    )
    return lower_fun(lambda *xs: list(partitioned(*xs)))(ctx, *args)


def _ffi_lowers(ctx: Any) -> bool:
    return backends.select() is ffi and not ffi.unsupported(ctx)


def partitionable(lowering: Callable[..., Sequence[Any]]) -> Callable[..., Sequence[Any]]:
    """``lowering`` (torch_call's), partitioned where XLA splits the call.

    See NOTE [partitioning torch_call]: applies under a sharded jit to a call
    with a mapped axis on the FFI backend; everything else is ``lowering``.
    """

    def torch_call_partitioned_lowering(ctx: Any, *args: Any, fun: TorchFn) -> Sequence[Any]:
        if partitioned_devices(ctx) > 1:
            if not has_side_effects(fun) and holds_no_element(fun):
                # NOTE [empty results on a mesh]
                return lower_fun(lambda *xs: [jnp.zeros(a.shape, a.dtype) for a in fun.out_avals])(ctx, *args)
            bm = batch_map(fun)
            if bm is not None and bm.size > 0 and _ffi_lowers(ctx):
                return _lower_partitioned(ctx, args, fun, bm)
            if has_side_effects(fun):  # NOTE [a call with effects on a mesh]
                raise NotImplementedError(_effects_on_a_mesh(fun, partitioned_devices(ctx)))
        return lowering(ctx, *args, fun=fun)

    return torch_call_partitioned_lowering


def _effects_on_a_mesh(fun: TorchFn, devices: int, mapped: bool = False) -> str:
    where = (
        "its batch is not split over the devices (replicated, sharded along another dimension, or not "
        "dividing evenly), so every device would run it on the whole batch, each drawing and updating for "
        "itself. Shard the batch over the mesh along the mapped axis, run it"
        if mapped
        else "XLA cannot run a call with effects once (XLA's SPMD partitioner refuses it). Run it"
    )
    return (
        f"t2j_ad: {fun.name} draws random numbers or updates state it keeps (dropout, a module in training "
        f"mode), and this jax.jit splits its program over {devices} devices, where {where} on one device "
        f"(jax.device_put its inputs to jax.devices()[0]), or per shard, each device drawing and updating for "
        f"its own: inside jax.shard_map over the mesh, or jax.pmap."
    )
