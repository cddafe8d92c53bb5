"""Every use of JAX internals, in one place.

Rule bodies in ``t2j_ad/rules`` never see ``ad.Zero``, ``ad.UndefinedPrimal``
or batching sentinels: the adapters here translate them into plain values or
``None`` on the way in, and back on the way out (STYLE.md item 4). When JAX
moves an internal again, this is the only file that changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

try:  # Taylor mode: its rules live in a registry of the experimental jet module.
    from jax.experimental import jet as _jet
except ImportError:  # pragma: no cover - a JAX without jet: no rule to register
    _jet = None

# JAX >= 0.4.36 exposes the abstract-array class here; older releases kept it
# in jax.core.
from jax.core import ShapedArray

# jax._src.dispatch.apply_primitive is what every lax primitive's impl uses:
# it jit-compiles the single primitive, so eager calls share the lowering.
from jax._src.dispatch import apply_primitive, prim_requires_devices_during_lowering

try:  # JAX >= 0.6: zero-copy CPU/GPU callback on mutable output buffers.
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # pragma: no cover - older JAX; backends/callback.py copes.
    buffer_callback = None

# JAX's internal LRU caches (abstract evaluation among them) key on primitive
# parameters; types listed here are held weakly, so a dead TorchFn does not
# stay alive (with its PyTorch function and registry entry) in those caches.
from jax._src.util import weakref_cache_key_types

# The partitioner's view of a lowering: ShardingContext under a sharded jit
# (the SPMD partitioner runs after lowering), SPMDAxisContext inside
# shard_map and inside a custom partitioning callback, ReplicaAxisContext
# under pmap.
from jax._src.sharding_impls import ShardingContext

# Partitioning a custom call (experimental in JAX 0.10; Shardy reads the
# SdyShardingRule, the GSPMD partitioner the inference callback).
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning

# Varying manual axes (shard_map's check_vma): which mesh axes a value differs
# over. lax ops make their operands agree (auto_insert_reshard inserts pvary,
# whose transpose is psum) and give results the same axes.
from jax._src import core as _core
from jax._src.mesh import get_abstract_mesh

# How jax.checkpoint (remat) splits an equation between the forward pass and
# the backward pass that recomputes it: a rule per primitive.
from jax._src.interpreters import partial_eval as _pe

float0 = jax.dtypes.float0

__all__ = [
    "ArrayMapping",
    "SdyShardingRule",
    "custom_partitioning",
    "Primitive",
    "ShapedArray",
    "buffer_callback",
    "float0",
    "hold_weakly_in_jax_caches",
    "lower_fun",
    "make_primitive",
    "match_varying",
    "partitioned_devices",
    "result_aval",
    "register_rules",
    "require_devices_during_lowering",
]


def hold_weakly_in_jax_caches(cls: type) -> None:
    """Let JAX's internal caches hold parameters of type ``cls`` weakly."""
    weakref_cache_key_types.add(cls)


def make_primitive(name: str) -> Primitive:
    prim = Primitive(name)
    prim.multiple_results = True
    return prim


def lower_fun(fun: Callable[..., Sequence[Any]]) -> Callable[..., Sequence[Any]]:
    """An MLIR lowering rule that traces ``fun`` (JAX code) in place."""
    return mlir.lower_fun(fun, multiple_results=True)


def match_varying(args: Sequence[Any]) -> list[Any]:
    """``args`` varying over the same manual mesh axes (inside shard_map)."""
    return list(_core.auto_insert_reshard(*args))


def result_aval(shape: tuple[int, ...], dtype: Any, ins: Sequence[Any]) -> ShapedArray:
    """A result's aval, varying over the manual axes its inputs vary over."""
    varying = _core.standard_vma_rule("torch_call", *ins)
    if not varying:
        return ShapedArray(shape, dtype)
    sharding = jax.sharding.NamedSharding(get_abstract_mesh(), jax.sharding.PartitionSpec())
    return ShapedArray(shape, dtype, sharding=sharding, manual_axis_type=_core.ManualAxisType(varying=varying))


def require_devices_during_lowering(prim: Primitive) -> None:
    """Make jit hand ``prim``'s lowering the device assignment, as it does for
    ``custom_partitioning`` and ``pure_callback`` (partitioned_devices needs it)."""
    prim_requires_devices_during_lowering.add(prim)


def partitioned_devices(ctx: Any) -> int:
    """How many devices XLA's SPMD partitioner will split this lowering over.

    Greater than 1 only under a sharded ``jax.jit`` (a ``ShardingContext``);
    inside ``shard_map``, ``pmap`` or a partitioning callback the lowering is
    already per device, so 1.
    """
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, ShardingContext):
        return axis_context.num_devices
    return 1


def _tangent_or_none(tangent: Any) -> Any:
    # A symbolic zero, or a concrete float0 tangent (what integer inputs get),
    # both mean "do not differentiate this input".
    if type(tangent) is ad.Zero:
        return None
    if getattr(tangent, "dtype", None) == float0:
        return None
    return tangent


def _zero_like_output(aval: ShapedArray) -> ad.Zero:
    return ad.Zero(aval.to_tangent_aval())


def register_remat_rule(prim: Primitive, never_recomputed: Callable[[dict[str, Any]], bool]) -> None:
    """Split ``prim`` under ``jax.checkpoint`` as JAX splits any primitive
    (run again in the backward pass unless the checkpoint policy saves its
    outputs), except a call whose parameters ``never_recomputed`` accepts:
    its outputs are always saved, and it runs once."""

    def rule(saveable: Callable[..., Any], unks_in: Sequence[bool], inst_in: Sequence[bool], eqn: Any) -> Any:
        n = len(eqn.outvars)
        # Known inputs the backward pass reads: residuals of the forward pass.
        read_later = [v for v, inst in zip(eqn.invars, inst_in) if type(v) is _core.Var and not inst]
        if any(unks_in):  # a tangent call: only in the backward pass
            return None, eqn, [True] * n, [True] * n, read_later
        if never_recomputed(eqn.params):
            return eqn, None, [False] * n, [False] * n, []
        policy = _pe.ensure_enum(saveable(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params))
        if isinstance(policy, _pe.SaveableType):
            return eqn, None, [False] * n, [False] * n, []
        return eqn, eqn, [False] * n, [True] * n, read_later  # recomputed (so is an offloading policy's)

    _pe.partial_eval_jaxpr_custom_rules[prim] = rule


def register_rules(
    prim: Primitive,
    *,
    impl: Callable[..., Sequence[Any]] | None,
    abstract_eval: Callable[..., Sequence[ShapedArray]],
    jvp: Callable[..., tuple[Sequence[Any], Sequence[Any]]],
    transpose: Callable[..., Sequence[Any]],
    batch: Callable[..., tuple[Sequence[Any], Sequence[int | None]]],
    jet: Callable[..., tuple[Sequence[Any], Sequence[Sequence[Any] | None]]],
    lowering: Callable[..., Sequence[Any]],
) -> None:
    """Register plain-valued rules on ``prim`` through adapters.

    The rule signatures the adapters expect:

    - ``jvp(primals, tangents, **params) -> (outs, out_tangents)``, where an
      input tangent of ``None`` is a symbolic zero and an output tangent of
      ``None`` means "zero".
    - ``transpose(cts, args, linear, **params) -> input_cts``: ``cts`` has
      ``None`` for zero cotangents, ``args`` has ``None`` where the input is
      linear (``linear[i]`` is True), and the result has one entry per input
      (``None`` for a zero cotangent or a non-linear input).
    - ``batch(args, dims, **params) -> (outs, out_dims)``: ``None`` dims are
      unbatched.
    - ``jet(primals, series, **params) -> (outs, out_series)``: ``series``
      has one list of Taylor coefficients per input (zeros where ``jet`` had
      none), ``out_series`` one per output, ``None`` for "zero".
    """
    if impl is None:
        prim.def_impl(lambda *args, **params: apply_primitive(prim, *args, **params))
    else:
        prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)

    def jvp_adapter(primals, tangents, **params):
        tangents = [_tangent_or_none(t) for t in tangents]
        outs, out_tangents = jvp(list(primals), tangents, **params)
        out_avals = abstract_eval(*[jax.typeof(p) for p in primals], **params)
        out_tangents = [
            _zero_like_output(aval) if t is None else t
            for t, aval in zip(out_tangents, out_avals)
        ]
        return outs, out_tangents

    def transpose_adapter(cts, *args, **params):
        linear = [ad.is_undefined_primal(a) for a in args]
        values = [None if lin else a for a, lin in zip(args, linear)]
        cts = [None if type(ct) is ad.Zero else ct for ct in cts]
        in_cts = transpose(cts, values, linear, **params)
        result = []
        for a, lin, ct in zip(args, linear, in_cts):
            if not lin:
                result.append(None)
            elif ct is None:
                result.append(ad.Zero(a.aval.to_tangent_aval()))
            else:
                result.append(ct)
        return result

    def batch_adapter(args, dims, **params):
        return batch(list(args), list(dims), **params)

    def jet_adapter(primals, series, **params):
        outs, out_series = jet(list(primals), [list(s) for s in series], **params)
        return outs, [_jet.zero_series if s is None else s for s in out_series]

    ad.primitive_jvps[prim] = jvp_adapter
    ad.primitive_transposes[prim] = transpose_adapter
    batching.primitive_batchers[prim] = batch_adapter
    if _jet is not None:
        _jet.jet_rules[prim] = jet_adapter
    mlir.register_lowering(prim, lowering)
