"""Every use of JAX internals, in one place.

Rule bodies in ``t2j_ad/rules`` never see ``ad.Zero``, ``ad.UndefinedPrimal``
or batching sentinels: the adapters here translate them into plain values or
``None`` on the way in, and back on the way out (STYLE.md item 4). When JAX
moves an internal again, this is the only file that changes.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
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

# A partitioner's sharding, read as a PartitionSpec of a mesh (what
# custom_partitioning decodes, failing where none says it: NOTE [shardings
# no PartitionSpec says] in rules/partitioning.py).
from jax._src.sharding_impls import parse_flatten_op_sharding

# Partitioning a custom call (experimental in JAX 0.10; Shardy reads the
# SdyShardingRule, the GSPMD partitioner the inference callback).
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning

# Varying manual axes (shard_map's check_vma): which mesh axes a value differs
# over. lax ops make their operands agree (auto_insert_reshard inserts pvary,
# whose transpose is psum) and give results the same axes.
from jax._src import core as _core
from jax._src.mesh import get_abstract_mesh

# How jax.checkpoint (remat) splits an equation between the forward pass and
# the backward pass that recomputes it: a rule per primitive. The same module
# holds the dead-code rules (which equations jit drops) and the rules that
# decide which equations partial evaluation runs ahead of the rest.
from jax._src.interpreters import partial_eval as _pe

# vmap of a while loop: whether it batches the predicate (batch_jaxpr, as
# JAX's own batching rule finds out).
from jax._src.interpreters import batching as _batching

# MLIR as JAX builds it: the block a lowering rule emits into.
from jax._src.lib.mlir import ir

# For NOTE [calls with effects under jax.jit]: lax.scan's partial evaluation,
# which moves loop-invariant work out of the loop; jax.jit, jax.checkpoint
# and custom_jvp inside jax.jit, and how JAX lowers a jaxpr into its
# caller's block (custom_jvp's lowering). Where a JAX has moved them, what
# needs them keeps JAX's own behaviour (run_every_call and
# lower_nested_calls_in_place check for None).
try:
    from jax._src.lax.control_flow import loops as _loops
except ImportError:  # pragma: no cover - another JAX layout
    _loops = None
try:
    from jax._src import ad_checkpoint as _ad_checkpoint
    from jax._src import custom_derivatives as _custom_derivatives
    from jax._src import pjit as _pjit
except ImportError:  # pragma: no cover - another JAX layout
    _ad_checkpoint = _custom_derivatives = _pjit = None
try:
    from jax._src.lax.control_flow import conditionals as _conditionals
except ImportError:  # pragma: no cover - another JAX layout
    _conditionals = None
try:
    from jax._src.named_sharding import UnspecifiedValue
except ImportError:  # pragma: no cover - older JAX kept it here
    try:
        from jax._src.sharding_impls import UnspecifiedValue
    except ImportError:
        UnspecifiedValue = None

# A client that compiles for a described topology (AOT cross-compilation,
# jax.experimental.topologies) and runs nothing: it takes host callbacks
# only as capsules (NOTE [registry lifetime] in backends/registry.py).
try:
    from jax._src.lib import _jax as _jaxlib_ext

    _CompileOnlyClient = getattr(_jaxlib_ext, "CompileOnlyPyClient", None)
except ImportError:  # pragma: no cover - another jaxlib layout
    _CompileOnlyClient = None

float0 = jax.dtypes.float0


__all__ = [
    "ArrayMapping",
    "as_named_sharding",
    "SdyShardingRule",
    "custom_partitioning",
    "Primitive",
    "ShapedArray",
    "buffer_callback",
    "compiles_only",
    "outside_jax_traces",
    "float0",
    "hold_weakly_in_jax_caches",
    "lower_fun",
    "make_primitive",
    "match_varying",
    "partitioned_devices",
    "result_aval",
    "explicit_mesh",
    "spec_entry",
    "register_rules",
    "require_devices_during_lowering",
    "in_program_order",
    "refused_in_scalar_computations",
    "lower_nested_calls_in_place",
    "run_every_call",
]


def compiles_only(module_context: Any) -> bool:
    """Whether ``module_context`` (a lowering's ``ctx.module_context``) is
    lowered for a compile-only client, whose executables never run here."""
    backend = getattr(module_context, "backend", None)
    return _CompileOnlyClient is not None and isinstance(backend, _CompileOnlyClient)


def outside_jax_traces() -> contextlib.AbstractContextManager[None]:
    """A context in which JAX evaluates each operation at once, whatever trace
    is current outside it (NOTE [trial runs outside the caller's trace] in
    inference.py)."""
    return _core.eval_context()


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


def result_aval(shape: tuple[int, ...], dtype: Any, ins: Sequence[Any], mapped: tuple[int, Any] | None = None) -> ShapedArray:
    """A result's aval: varying over the manual axes its inputs vary over
    (inside ``shard_map``); on the Explicit mesh its inputs are typed on,
    with dimension ``mapped[0]`` sharded as ``mapped[1]`` says (a
    PartitionSpec entry) and the others whole (NOTE [results on Explicit
    axes] in primitive.py)."""
    varying = _core.standard_vma_rule("torch_call", *ins)
    if varying:
        sharding = jax.sharding.NamedSharding(get_abstract_mesh(), jax.sharding.PartitionSpec())
        return ShapedArray(shape, dtype, sharding=sharding, manual_axis_type=_core.ManualAxisType(varying=varying))
    mesh = explicit_mesh(ins)
    if mesh is None:
        return ShapedArray(shape, dtype)
    spec = [None] * len(shape)
    if mapped is not None and mapped[0] < len(shape):
        spec[mapped[0]] = mapped[1]
    return ShapedArray(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))


def explicit_mesh(avals: Sequence[Any]) -> Any:
    """The mesh with Explicit axes that some of ``avals`` are typed on, or None."""
    for aval in avals:
        mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types:
            return mesh
    return None


def sharded_as(value: Any, aval: Any) -> Any:
    """``value`` resharded to the type ``aval`` has on a mesh's Explicit axes
    (a cotangent must have its primal's type); ``value`` where ``aval`` is
    typed on no such mesh or the two agree."""
    want = getattr(aval, "sharding", None)
    if explicit_mesh([aval]) is None or getattr(jax.typeof(value), "sharding", None) == want:
        return value
    return jax.sharding.reshard(value, want)


def spec_entry(aval: Any, dim: int) -> Any:
    """The PartitionSpec entry ``aval``'s type gives dimension ``dim`` (None: whole)."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    return None if spec is None or dim >= len(spec) else spec[dim]


def require_devices_during_lowering(prim: Primitive) -> None:
    """Make jit hand ``prim``'s lowering the device assignment, as it does for
    ``custom_partitioning`` and ``pure_callback`` (partitioned_devices needs it)."""
    prim_requires_devices_during_lowering.add(prim)


def as_named_sharding(sharding: Any, mesh: Any, ndim: int) -> jax.sharding.NamedSharding | None:
    """``sharding``, as ``custom_partitioning`` hands it over with
    ``decode_shardings=False`` (a ``GSPMDSharding``), as a ``NamedSharding``
    of ``mesh``; None where no ``PartitionSpec`` of ``mesh`` says it (NOTE
    [shardings no PartitionSpec says] in rules/partitioning.py) or the mesh
    is empty."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    if sharding is None or getattr(mesh, "empty", True):
        return None
    try:
        spec = parse_flatten_op_sharding(sharding._to_xla_hlo_sharding(ndim), mesh)[0]
    except Exception:  # noqa: BLE001 - JAX asserts or raises IndivisibleError: no spec says it
        return None
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec, *((None,) * (ndim - len(spec)))))


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


def run_every_call(
    prim: Primitive, has_effects: Callable[[dict[str, Any]], bool], name_of: Callable[[dict[str, Any]], str]
) -> None:
    """Make JAX run each equation of ``prim`` whose parameters
    ``has_effects`` accepts as often as the program says, under any
    transform (NOTE [calls with effects under jax.jit] in
    ``replayed_calls.py``):

    - jit's dead-code elimination keeps such an equation when its outputs go
      unused, and keeps a ``jit``, ``scan``, ``cond``, ``while_loop``,
      ``custom_jvp``, ``checkpoint``... that holds one;
    - ``lax.scan``'s partial evaluation (``grad`` of a scan, ``checkpoint``
      of a scan) leaves such an equation in the loop when it only reads
      loop-invariant values, where it would otherwise run once, before the
      loop;
    - partial evaluation of a ``while_loop`` that holds one with some
      inputs unknown (``jax.linearize``) is refused: JAX runs the whole loop
      again inside the linear function, so the call would run again there
      (``name_of`` names it in the error).

    A JAX without these internals keeps its own behaviour there."""

    holds_one_in = functools.partial(_holds_one, prim, has_effects)
    while_p = getattr(_loops, "while_p", None)
    _keep_unused_calls(prim, has_effects, holds_one_in, while_p)
    _refuse_while_loops_run_again(_loop_run_again_refusal(prim, has_effects, name_of), while_p)
    _keep_calls_in_scans(prim, has_effects, holds_one_in)
    _refuse_batched_predicates(prim, has_effects, name_of, while_p)


def _refuse_batched_predicates(
    prim: Primitive, has_effects: Callable[[dict[str, Any]], bool], name_of: Callable[[dict[str, Any]], str], while_p: Any
) -> None:
    """Refuse ``jax.vmap`` of a ``lax.cond`` or ``while_loop`` whose predicate
    the vmap batches and that holds an equation of ``prim`` with effects
    (NOTE [calls with effects under jax.jit] in ``replayed_calls.py``): JAX
    then runs every branch for every example and selects, and a loop's body
    until the last example is done, so the call would draw or update where
    the program says it does not. JAX refuses its own IO effects there."""

    def named(jaxprs: Sequence[Any]) -> str | None:
        found = _first_call_with_effects(prim, has_effects, jaxprs)
        return None if found is None else name_of(found)

    def refusal(name: str, where: str) -> NotImplementedError:
        return NotImplementedError(
            f"t2j_ad: {name} draws random numbers or updates state it keeps, inside a {where} whose "
            f"predicate jax.vmap batches: JAX runs such a {where} as a select, every branch (every step) "
            f"for every example, so the call would run where the program says it does not. Keep the "
            f"predicate unbatched (the same for every example), or make the call outside the {where} and "
            f"select its result with jnp.where."
        )

    cond_p = getattr(_conditionals, "cond_p", None)
    cond_rule = batching.fancy_primitive_batchers.get(cond_p) if cond_p is not None else None
    if cond_rule is not None:

        def cond_batching(axis_data: Any, args: Any, dims: Any, **params: Any) -> Any:
            if dims[0] is not None:  # an unmapped operand's dim is None
                name = named([branch.jaxpr for branch in params["branches"]])
                if name is not None:
                    raise refusal(name, "lax.cond")
            return cond_rule(axis_data, args, dims, **params)

        batching.fancy_primitive_batchers[cond_p] = cond_batching
    while_rule = batching.fancy_primitive_batchers.get(while_p) if while_p is not None else None
    if while_rule is not None:

        def while_batching(axis_data: Any, args: Any, dims: Any, **params: Any) -> Any:
            name = named([params["body_jaxpr"].jaxpr, params["cond_jaxpr"].jaxpr])
            if name is not None and _while_predicate_batched(axis_data, dims, **params):
                raise refusal(name, "lax.while_loop")
            return while_rule(axis_data, args, dims, **params)

        batching.fancy_primitive_batchers[while_p] = while_batching


def _while_predicate_batched(
    axis_data: Any, dims: Sequence[Any], *, cond_nconsts: int, cond_jaxpr: Any, body_nconsts: int, body_jaxpr: Any
) -> bool:
    """Whether ``jax.vmap`` batches a while loop's predicate: the fixpoint
    over the carries JAX's own batching rule computes."""
    batched = [d is not None for d in dims]
    cconst_bat = batched[:cond_nconsts]
    bconst_bat = batched[cond_nconsts : cond_nconsts + body_nconsts]
    carry_bat = batched[cond_nconsts + body_nconsts :]
    for _ in range(1 + len(carry_bat)):
        _, carry_out = _batching.batch_jaxpr(body_jaxpr, axis_data, bconst_bat + carry_bat, instantiate=carry_bat)
        if list(carry_out) == carry_bat:
            break
        carry_bat = [a or b for a, b in zip(carry_bat, carry_out)]
    _, (pred_bat,) = _batching.batch_jaxpr(cond_jaxpr, axis_data, cconst_bat + carry_bat, instantiate=False)
    return bool(pred_bat)


def _keep_unused_calls(
    prim: Primitive, has_effects: Callable[[dict[str, Any]], bool], holds_one_in: Callable[[Any], bool], while_p: Any
) -> None:
    """Dead-code rules: ``prim``'s keeps an equation ``has_effects``
    accepts; every rule of a primitive that holds jaxprs keeps an equation
    that holds one, as if all its outputs were used."""
    dce_rules = getattr(_pe, "dce_rules", None)
    if dce_rules is None:
        return

    def own_rule(used_outs: list[bool], eqn: Any) -> tuple[list[bool], Any]:
        if any(used_outs) or has_effects(eqn.params):
            return [True] * len(eqn.invars), eqn
        return [False] * len(eqn.invars), None

    def keeping(rule: Callable[..., Any]) -> Callable[..., Any]:
        def container_rule(used_outs: list[bool], eqn: Any) -> Any:
            if not any(used_outs) and any(map(holds_one_in, _core.jaxprs_in_params(eqn.params))):
                used_outs = [True] * len(eqn.outvars)  # as if the program read it all
            return rule(used_outs, eqn)

        return container_rule

    for container, rule in list(dce_rules.items()):
        dce_rules[container] = keeping(rule)
    default = getattr(_pe, "_default_dce_rule", None)
    if while_p is not None and default is not None and while_p not in dce_rules:
        dce_rules[while_p] = keeping(default)  # while_loop has no rule of its own
    dce_rules[prim] = own_rule


def _refuse_while_loops_run_again(refusal: Callable[[Sequence[bool], dict[str, Any]], None], while_p: Any) -> None:
    """``while_loop``'s partial-evaluation rules, its own and the one under
    ``jax.checkpoint``, each checked by ``refusal`` first."""
    while_partial_eval = _pe.custom_partial_eval_rules.get(while_p)
    if while_partial_eval is not None:

        def while_rule(trace: Any, *tracers: Any, **params: Any) -> Any:
            refusal([not t.pval.is_known() for t in tracers], params)
            return while_partial_eval(trace, *tracers, **params)

        _pe.custom_partial_eval_rules[while_p] = while_rule
    while_remat_rule = _pe.partial_eval_jaxpr_custom_rules.get(while_p)
    if while_remat_rule is not None:

        def while_checkpointed(saveable: Any, unks_in: Sequence[bool], inst_in: Any, eqn: Any) -> Any:
            refusal(unks_in, eqn.params)
            return while_remat_rule(saveable, unks_in, inst_in, eqn)

        _pe.partial_eval_jaxpr_custom_rules[while_p] = while_checkpointed


def _keep_calls_in_scans(
    prim: Primitive, has_effects: Callable[[dict[str, Any]], bool], holds_one_in: Callable[[Any], bool]
) -> None:
    """``lax.scan``'s hoisting of loop-invariant work out of the loop, off
    for a loop that holds an equation ``has_effects`` accepts (under
    ``jax.grad``); under ``jax.checkpoint``, such an equation is not known
    before the loop."""
    hoisting = getattr(_loops, "_scan_known_hoisting", None)
    if hoisting is not None:
        _loops._scan_known_hoisting = _hoisting_none_that_holds(hoisting, holds_one_in)
    custom_scan_rule = _pe.partial_eval_jaxpr_custom_rules.get(getattr(_loops, "scan_p", None))
    if custom_scan_rule is None:
        return

    def partial_eval_rule(trace: Any, *tracers: Any, **params: Any) -> Any:
        if _hoisting.depth and has_effects(params):
            tracers = tuple(trace.instantiate_const(t) for t in tracers)  # not known: stays in the loop
        return trace.default_process_primitive(prim, tracers, params)

    # Under jax.checkpoint the scan rule hoists by partial evaluation: there
    # such a call is kept apart from what is known before the loop.
    _pe.partial_eval_jaxpr_custom_rules[_loops.scan_p] = _while_hoisting(custom_scan_rule)
    _pe.custom_partial_eval_rules[prim] = partial_eval_rule


def _loop_run_again_refusal(
    prim: Primitive,
    has_effects: Callable[[dict[str, Any]], bool],
    name_of: Callable[[dict[str, Any]], str],
) -> Callable[[Sequence[bool], dict[str, Any]], None]:
    """A check for ``while_loop``'s partial evaluation (its own rule, and
    its rule under ``jax.checkpoint``): it refuses a loop whose body or
    condition holds a call that must run once per step when some of the
    loop's inputs are unknown. JAX then runs the whole loop again in the
    unknown part (jax.linearize's linear function), where such a call would
    draw or update again, and the derivatives would be those of other draws."""

    def refuse(unknowns: Sequence[bool], params: dict[str, Any]) -> None:
        if not any(unknowns):
            return
        found = _first_call_with_effects(prim, has_effects, (params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr))
        if found is not None:
            raise NotImplementedError(
                f"t2j_ad: {name_of(found)} draws random numbers or updates state it keeps, and runs in "
                f"a lax.while_loop being linearized (jax.linearize; reverse mode, which JAX refuses for "
                f"while_loop anyway): JAX runs the whole loop again inside the linear function, where "
                f"each call would draw or update again and the derivatives would be those of other "
                f"draws. Use jax.jvp or jax.jacfwd (forward mode runs the loop once), or lax.scan / "
                f"lax.fori_loop with static bounds, which JAX linearizes without running it again."
            )

    return refuse


def _hoisting_none_that_holds(hoisting: Callable[..., Any], holds_one_in: Callable[[Any], bool]) -> Callable[..., Any]:
    """lax.scan's hoisting of loop-invariant work out of the loop (under
    ``jax.grad``), except in a loop whose forward pass holds a call that
    must run in every step: there nothing is hoisted (JAX's own way to turn
    it off), however deep the call sits (in a ``jit``, ``custom_jvp``...)."""

    @functools.wraps(hoisting)
    def wrapper(jaxpr_known: Any, known_consts: Any, num_res: int, *more: Any) -> Any:
        # JAX 0.11 passes one more count (residuals that are not hoisted
        # anyway); both return one flag per hoistable residual, the third
        # argument's count, and take the loop's jaxpr back unchanged.
        if holds_one_in(getattr(jaxpr_known, "jaxpr", jaxpr_known)):
            return jaxpr_known, known_consts, [False] * num_res, []
        return hoisting(jaxpr_known, known_consts, num_res, *more)

    return wrapper


def in_program_order(
    lowering: Callable[..., Sequence[Any]], has_effects: Callable[[dict[str, Any]], bool]
) -> Callable[..., Sequence[Any]]:
    """``lowering`` (an MLIR lowering rule), made to run each call whose
    parameters ``has_effects`` accepts after the last such call lowered
    before it: that call's first result is handed to it as one more operand,
    which the call ignores (NOTE [calls with effects under jax.jit]). XLA
    keeps no other order between two calls with side effects: it drops
    optimization barriers and their control dependencies on the CPU. A
    ``lax.cond``, ``lax.scan`` or while loop that holds such a call counts as
    one for the calls after it in its own block (all its results are handed
    on: XLA forwards a loop's unchanged carries past the loop), and the
    first such call in a branch or a loop's body goes after the last one
    before the cond or loop (the region captures its results). Not under a
    sharded ``jax.jit``."""

    def rule(ctx: Any, *args: Any, **params: Any) -> Sequence[Any]:
        if not has_effects(params) or partitioned_devices(ctx) > 1:
            # Under a sharded jit one more operand, sharded, would be gathered.
            return lowering(ctx, *args, **params)
        # Lives as long as the module being lowered (ModuleContext has no other room).
        room = getattr(ctx.module_context, "cached_primitive_lowerings", None)
        if room is None:  # pragma: no cover - a JAX without it: XLA's order
            return lowering(ctx, *args, **params)
        order = room.setdefault(_LAST_CALL_WITH_EFFECTS, _ProgramOrder())
        block = ir.InsertionPoint.current.block
        before = order.available(block)
        if before is not None:
            values, avals = before
            ctx = ctx.replace(avals_in=(*ctx.avals_in, *avals))
            args = (*args, *values)
        outs = lowering(ctx, *args, **params)
        if outs:
            first = outs[0]
            order.lowered(block, ((first[0] if isinstance(first, (list, tuple)) else first,), (ctx.avals_out[0],)))
        return outs

    return rule


# Ops whose regions are the scalar computation XLA applies element by element
# (a reducer, a scatter's combiner, a sort's comparator): XLA's CPU compiler
# aborts the process on a custom call there (a Check failure in its
# computation partitioner, as for jax.pure_callback).
_SCALAR_COMPUTATION_OPS = frozenset(
    {
        "stablehlo.reduce",
        "stablehlo.reduce_window",
        "stablehlo.scatter",
        "stablehlo.select_and_scatter",
        "stablehlo.sort",
        "stablehlo.all_reduce",
        "stablehlo.reduce_scatter",
        "stablehlo.map",
    }
)


def refused_in_scalar_computations(
    lowering: Callable[..., Sequence[Any]], name_of: Callable[[dict[str, Any]], str]
) -> Callable[..., Sequence[Any]]:
    """``lowering``, refusing with a ``ValueError`` to lower a call into the
    region of an op in ``_SCALAR_COMPUTATION_OPS`` (``lax.reduce`` with a
    jaxified reducer, say), which XLA cannot compile and aborts on."""

    def rule(ctx: Any, *args: Any, **params: Any) -> Sequence[Any]:
        op = ir.InsertionPoint.current.block.owner
        while op is not None:
            name = op.operation.name
            if name in _SCALAR_COMPUTATION_OPS:
                raise ValueError(
                    f"t2j_ad: the PyTorch function {name_of(params)} is called inside the computation of a "
                    f"{name.split('.', 1)[1]} (the function lax.reduce, lax.reduce_window, a scatter or "
                    f"lax.sort applies to each pair of elements). XLA compiles that computation on its own "
                    f"and cannot run a custom call there. Reduce in PyTorch instead: call the function on "
                    f"the whole array (x.sum(0), torch.cumsum, ...)."
                )
            if name in ("func.func", "builtin.module"):
                break
            parent = op.operation.parent
            op = parent if parent is None else parent.opview
        return lowering(ctx, *args, **params)

    return rule


_LAST_CALL_WITH_EFFECTS = ("t2j_ad", "the last call with effects in each block")

# Ops whose regions (a cond's branches, a while loop's condition and body)
# may use values defined before the op.
_CAPTURING_OPS = frozenset({"stablehlo.case", "stablehlo.if", "stablehlo.while"})


class _ProgramOrder:
    """For one module being lowered: the value each call with effects must
    follow, per block (``in_program_order``)."""

    def __init__(self) -> None:
        # block -> (values, avals): the last call with effects in it so far, or
        # the last op in it that holds one (in its regions, or in the private
        # function a func.call calls: a nested jit kept apart, say).
        self.last: dict[Any, tuple[tuple[Any, ...], tuple[Any, ...]]] = {}
        # block -> how many of its operations have been looked at for such calls.
        self.seen: dict[Any, int] = {}
        # cond or loop op -> (values, avals) | None: what the calls in its
        # regions follow, as it was in the op's own block before the op.
        self.entering: dict[Any, tuple[tuple[Any, ...], tuple[Any, ...]] | None] = {}
        # The private functions that hold a call with effects, as func.call
        # names them, and the calls with effects lowered so far.
        self.holding: set[str] = set()
        self.calls: set[Any] = set()
        # MLIR element type (as text) -> the dtype of an aval, made in the
        # module's context on first use.
        self.dtypes: dict[str, np.dtype] = {}

    def available(self, block: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """What a call lowered at the end of ``block`` goes after."""
        found = self._latest_in(block)
        if found is not None:
            return found
        op = _region_owner(block, _CAPTURING_OPS)
        if op is None:
            return None
        if op not in self.entering:
            self.entering[op] = self.available(op.block)
        return self.entering[op]

    def _latest_in(self, block: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """The last call (or op) with effects in ``block``, counting calls
        of private functions that hold one, lowered since it was last looked at."""
        ops = block.operations
        count, start = len(ops), self.seen.get(block, 0)
        if self.holding:
            for i in range(count - 1, start - 1, -1):
                op = ops[i].operation
                if self._holds(op):
                    held = self._results(op)
                    if held is not None:
                        self.last[block] = held
                        break
        self.seen[block] = count
        return self.last.get(block)

    def _calls_held(self, op: Any) -> bool:
        """Whether ``op`` is a call with effects or calls a private function holding one."""
        if op in self.calls:
            return True
        return op.name == "func.call" and ir.FlatSymbolRefAttr(op.attributes["callee"]).value in self.holding

    def _holds(self, op: Any) -> bool:
        """Whether ``op`` runs a call with effects: it is one, calls a private
        function that holds one, or holds either in its regions (a loop)."""
        if self._calls_held(op):
            return True
        walk_result = getattr(ir, "WalkResult", None)
        if not len(op.regions) or walk_result is None:
            return False
        found = []

        def visit(inner: Any) -> Any:
            if self._calls_held(inner):
                found.append(inner)
                return walk_result.INTERRUPT
            return walk_result.ADVANCE

        op.walk(visit)
        return bool(found)

    def _results(self, op: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """``op``'s array results and their avals, or None when it has none."""
        if not self.dtypes:
            self.dtypes = {str(mlir.dtype_to_ir_type(dtype)): dtype for dtype in _ORDER_DTYPES}
        values, avals = [], []
        for value in op.results:
            try:
                tensor = ir.RankedTensorType(value.type)
            except (TypeError, ValueError):
                continue  # a token, say
            dtype = self.dtypes.get(str(tensor.element_type))
            if dtype is not None:
                values.append(value)
                avals.append(ShapedArray(tuple(tensor.shape), dtype))
        return (tuple(values), tuple(avals)) if values else None

    def lowered(self, block: Any, result: tuple[tuple[Any, ...], tuple[Any, ...]]) -> None:
        """A call with effects was lowered into ``block``; ``result``: its
        first result and aval, each in a one-element tuple. The ops around
        the block now hold one."""
        self.last[block] = result
        self.seen[block] = len(block.operations)
        self.calls.add(result[0][0].owner)
        op = _region_owner(block, _CAPTURING_OPS)
        while op is not None:
            outer = op.block
            if op not in self.entering:
                self.entering[op] = self.available(outer)  # before the op counts in its block
            held = self._results(op)
            if held is not None:
                self.last[outer] = held
                self.seen[outer] = len(outer.operations)
            block, op = outer, _region_owner(outer, _CAPTURING_OPS)
        function = getattr(block, "owner", None)
        function = getattr(function, "operation", function)
        if function is not None and function.name == "func.func" and _is_private(function):
            # Only a private function is called from elsewhere in the module.
            self.holding.add(ir.StringAttr(function.attributes["sym_name"]).value)


def _is_private(function: Any) -> bool:
    attributes = function.attributes
    visibility = attributes["sym_visibility"] if "sym_visibility" in attributes else None
    return "sym_name" in attributes and visibility is not None and ir.StringAttr(visibility).value == "private"


def _region_owner(block: Any, names: frozenset[str]) -> Any:
    """The operation whose region holds ``block``, if it is one of ``names``."""
    owner = getattr(block, "owner", None)
    op = getattr(owner, "operation", owner)
    return op if op is not None and op.name in names else None


_ORDER_DTYPES = tuple(
    np.dtype(name)
    for name in (
        "float32", "float64", "float16", "int32", "int64", "int8", "int16", "uint8", "uint16", "uint32",
        "uint64", "bool", "complex64", "complex128",
    )
)


def lower_nested_calls_in_place(prim: Primitive, has_effects: Callable[[dict[str, Any]], bool]) -> None:
    """Lower the calls of ``prim`` that ``has_effects`` accepts inside a
    ``jax.jit``, ``jax.checkpoint`` or ``custom_jvp`` within a jitted
    function into the caller's block, so that ``in_program_order`` orders
    them with the caller's own (NOTE [calls with effects under jax.jit]):

    - JAX lowers a nested ``jax.jit`` to a call of a function of its own; one
      that holds such a call, and says nothing of shardings, layouts or
      compiler options, outside a sharded jit, is lowered inline instead (it
      computes the same);
    - JAX lowers each ``checkpoint``, ``custom_jvp``, ``lax.cond``,
      ``lax.scan`` and while loop once, aside, and copies the result into
      the caller; they are lowered in place each time instead (lowering 100
      scans and 100 fori_loops of plain JAX took no longer: 0.32 - 0.36 s
      against 0.33 - 0.49 s);
    - a ``closed_call`` (how JAX wraps a loop's body) is a function of its
      own; one that holds such a call is lowered inline.

    A JAX whose internals have moved keeps its own lowering."""
    lowerings = getattr(mlir, "_lowerings", {})
    platform_rules = getattr(mlir, "_platform_specific_lowerings", {})

    def own_rule(p: Any) -> Any:
        if p is None or any(p in rules for rules in platform_rules.values()):
            return None
        return lowerings.get(p)

    copied_aside = (
        getattr(_ad_checkpoint, "remat_p", None),
        getattr(_custom_derivatives, "custom_jvp_call_p", None),
        getattr(_conditionals, "cond_p", None),
        getattr(_loops, "scan_p", None),
        getattr(_loops, "while_p", None),
    )
    for copied in copied_aside:
        entry = own_rule(copied)
        if entry is not None:
            _register_lowering_in_place(copied, entry.rule, inline=entry.inline)

    inline = getattr(_custom_derivatives, "_custom_jvp_vjp_call_lowering", None)
    if inline is None:
        return

    def inlined_when_holding(p: Any, jaxpr_of: Callable[[dict[str, Any]], Any], also: Callable[..., bool]) -> None:
        """``p``'s lowering, inline instead where its jaxpr (``jaxpr_of`` its
        parameters, a ClosedJaxpr) holds such a call and ``also`` accepts its
        parameters, outside a sharded jit."""
        entry = own_rule(p)
        if entry is None:
            return

        def rule(ctx: Any, *args: Any, **params: Any) -> Sequence[Any]:
            jaxpr = jaxpr_of(params)
            if partitioned_devices(ctx) <= 1 and also(params) and _holds_one(prim, has_effects, jaxpr.jaxpr):
                return inline(ctx, *args, call_jaxpr=jaxpr)
            return entry.rule(ctx, *args, **params)

        _register_lowering_in_place(p, rule, inline=entry.inline)

    def closed(jaxpr: Any) -> Any:
        return jaxpr if hasattr(jaxpr, "consts") else _core.ClosedJaxpr(jaxpr, ())

    closed_call_p = getattr(_core, "closed_call_p", None)
    inlined_when_holding(closed_call_p, lambda params: closed(params["call_jaxpr"]), lambda params: True)
    if UnspecifiedValue is None:
        return

    def plain(params: dict[str, Any]) -> bool:
        shardings = (*params.get("in_shardings", ()), *params.get("out_shardings", ()))
        layouts = (*params.get("in_layouts", ()), *params.get("out_layouts", ()))
        return (
            all(isinstance(s, UnspecifiedValue) for s in shardings)
            and all(layout is None for layout in layouts)
            and not params.get("compiler_options_kvs")
        )

    inlined_when_holding(getattr(_pjit, "jit_p", None), lambda params: params["jaxpr"], plain)


def _register_lowering_in_place(prim: Primitive, rule: Callable[..., Any], inline: bool = True) -> None:
    """Register ``rule`` as ``prim``'s lowering, run in the caller's block
    each time: not through JAX's lowering cache, which lowers an equation
    once, aside, and copies the result for equal ones (a JAX without that
    cache has no ``cacheable``)."""
    try:
        mlir.register_lowering(prim, rule, inline=inline, cacheable=False)
    except TypeError:  # pragma: no cover - no lowering cache to stay out of
        mlir.register_lowering(prim, rule, inline=inline)


class _Hoisting(threading.local):
    depth = 0


_hoisting = _Hoisting()


def _while_hoisting(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun``, saying while it runs that what partial evaluation finds
    known runs once, before a loop."""

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _hoisting.depth += 1
        try:
            return fun(*args, **kwargs)
        finally:
            _hoisting.depth -= 1

    return wrapper


def _holds_one(prim: Primitive, has_effects: Callable[[dict[str, Any]], bool], jaxpr: Any) -> bool:
    """Whether ``jaxpr`` holds, at any depth, an equation of ``prim`` whose
    parameters ``has_effects`` accepts."""
    return any(has_effects(params) for params in _calls_in(prim, jaxpr))


def _first_call_with_effects(
    prim: Primitive, has_effects: Callable[[dict[str, Any]], bool], jaxprs: Sequence[Any]
) -> dict[str, Any] | None:
    """The parameters of the first ``prim`` equation in ``jaxprs``, at any
    depth, that ``has_effects`` accepts; None when there is none."""
    return next((params for jaxpr in jaxprs for params in _calls_in(prim, jaxpr) if has_effects(params)), None)


def _calls_in(prim: Primitive, jaxpr: Any) -> list[dict[str, Any]]:
    """The parameters of each ``prim`` equation in ``jaxpr``, at any depth
    (``prim``: the one primitive ``run_every_call`` is given)."""
    cached = _found_calls.get(jaxpr)
    if cached is None:
        cached = []
        for eqn in jaxpr.eqns:
            if eqn.primitive is prim:
                cached.append(eqn.params)
            else:
                for inner in _core.jaxprs_in_params(eqn.params):
                    cached.extend(_calls_in(prim, inner))
        _found_calls[jaxpr] = cached
    return cached


# Jaxprs do not change: what each holds is found once, for as long as it lives.
_found_calls: weakref.WeakKeyDictionary[Any, list[dict[str, Any]]] = weakref.WeakKeyDictionary()


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
                # On Explicit axes a cotangent has its primal's type, where a
                # call's results are typed whole unless mapped (NOTE [results
                # on Explicit axes] in primitive.py).
                result.append(sharded_as(ct, a.aval))
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
    # in_program_order reads the block the lowering emits into.
    _register_lowering_in_place(prim, lowering)
