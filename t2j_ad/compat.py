"""The torch2jax package's API on t2j_ad's engine.

``from torch2jax import torch2jax, torch2jax_with_vjp`` becomes
``from t2j_ad.compat import torch2jax, torch2jax_with_vjp``; the rest of the
user's code stays as it is.

NOTE [torch2jax compatibility]
torch2jax wraps a PyTorch function for the shapes of its example arguments
and checks every call against them. This module keeps that surface and its
errors, and hands the work to ``JaxifiedFunction``:

- Calls are checked as torch2jax checks them: keyword arguments only when
  ``example_kw`` was given, and the example arguments' tree structure. Both
  refusals raise ``Torch2JaxInputError``, a ``RuntimeError`` (what torch2jax
  raises) that is also a ``TypeError`` (what t2j_ad raises for bad input).
- Other shapes or dtypes are accepted with a warning, once per new
  signature, as torch2jax does: their output shapes are inferred on meta
  tensors, since ``output_shapes`` describes the example arguments only.
- torch2jax calls the function with the example tensors' torch dtypes and
  gives JAX the outputs in JAX's dtypes: with ``jax_enable_x64`` off, an
  int64 target arrives as int32 and is cast back for PyTorch, and an int64 or
  float64 output is returned in 32 bits. Outputs are matched to
  ``output_shapes`` leaf by leaf, so a list declared for a returned tuple
  fits, as it does in torch2jax.
- The run on meta tensors that infers output shapes runs without grad, as
  torch2jax's does (its suite checks ``torch.is_grad_enabled()`` there); the
  calls themselves run with grad mode on, as every t2j_ad call does.
- There is no ``depth``: every derivative is a PyTorch function that goes
  through the same primitive (NOTE [every derivative is a PyTorch function]
  in torch_fn.py), so ``jax.grad`` composes to any order and ``jax.jvp``,
  ``jax.hessian`` and ``jax.vmap`` of gradients work too. ``depth`` is
  accepted and ignored.
- ``nondiff_argnums`` / ``nondiff_mask`` put ``jax.lax.stop_gradient`` on
  those arguments: their gradients are zeros and PyTorch never differentiates
  with respect to them (symbolic zeros). torch2jax returns zeros
  (``use_zeros=True``) or ``None`` cotangents, which JAX also turns into
  zeros, so both values of ``use_zeros`` give zeros here.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import Size as Size

from . import per_shard
from .api import JaxifiedFunction
from .convert import (
    UnsupportedDtypeError,
    canonical_jax_dtype,
    copy_to_jax,
    copy_to_torch,
    jax_device,
    jax_dtype,
    torch_dtype,
)
from .convert import j2t as _j2t
from .convert import t2j as _t2j

__all__ = [
    "Size",
    "Torch2JaxFunction",
    "Torch2JaxInputError",
    "dtype_j2t",
    "dtype_t2j",
    "j2t",
    "t2j",
    "torch2jax",
    "torch2jax_auto",
    "torch2jax_with_vjp",
    "torch2jax_without_vjp",
    "tree_j2t",
    "tree_t2j",
]


class Torch2JaxInputError(RuntimeError, TypeError):
    """A call that does not fit the example arguments' structure.

    A ``RuntimeError`` as in torch2jax, and a ``TypeError`` as everywhere else
    in t2j_ad, so code written for either catches it.
    """


# --------------------------------------------------------------------- dtypes


def dtype_t2j(dtype: Any) -> np.dtype:
    """The JAX dtype for a torch dtype (other dtypes pass through ``jnp.dtype``)."""
    try:
        return jax_dtype(dtype) if isinstance(dtype, torch.dtype) else np.dtype(jnp.dtype(dtype))
    except (UnsupportedDtypeError, TypeError) as err:
        raise ValueError(f"Unsupported dtype: {dtype} ({err})") from None


def dtype_j2t(dtype: Any) -> torch.dtype:
    """The torch dtype for a JAX/NumPy dtype (torch dtypes pass through)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return torch_dtype(dtype)
    except UnsupportedDtypeError as err:
        raise ValueError(f"Unsupported dtype: {dtype} ({err})") from None


# ---------------------------------------------------------------- conversion

_VIAS = ("dlpack", "cpu", "host")  # "cpu" and "host": a copy through host memory


def _check_via(via: str) -> None:
    if via not in _VIAS:
        raise ValueError(f"via must be one of {_VIAS}, got {via!r}.")


def t2j(x: torch.Tensor, via: str = "dlpack") -> jax.Array:
    """A JAX array from a torch tensor, on the tensor's device: shared memory
    (``via="dlpack"``) or a copy through host memory (``"cpu"``, ``"host"``)."""
    _check_via(via)
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"t2j: x must be a torch.Tensor, got a {type(x).__module__}.{type(x).__qualname__}; "
            f"make a JAX array of anything else with jnp.asarray(x)."
        )
    if via == "dlpack":
        return _t2j(x)
    return copy_to_jax(x, jax_device(x.device))


def j2t(x: jax.Array, via: str = "dlpack") -> torch.Tensor:
    """A torch tensor from a JAX array, on the array's device: shared memory
    (``via="dlpack"``) or a copy through host memory (``"cpu"``, ``"host"``).

    Raises ``t2j_ad.ArrayConversionError``, a ``RuntimeError`` as in torch2jax, for a
    tracer (inside ``jax.jit``) or an array on several devices.
    """
    _check_via(via)
    if via == "dlpack":
        return _j2t(x)
    return copy_to_torch(x)


def tree_t2j(xs: Any, via: str = "dlpack") -> Any:
    """Every torch tensor in ``xs`` as a JAX array; other leaves unchanged."""
    _check_via(via)
    return jax.tree.map(lambda x: t2j(x, via) if isinstance(x, torch.Tensor) else x, xs)


def tree_j2t(xs: Any, via: str = "dlpack") -> Any:
    """Every JAX array in ``xs`` as a torch tensor; other leaves unchanged."""
    _check_via(via)
    return jax.tree.map(lambda x: j2t(x, via) if isinstance(x, jax.Array) else x, xs)


# ------------------------------------------------------ example arguments


def _example_dtypes(example_inputs: Any) -> list[torch.dtype]:
    """The torch dtype of each example leaf; refuses leaves that are not arrays."""
    dtypes = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(example_inputs)[0]:
        where = f"example argument {jax.tree_util.keystr(path)}"
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"{where} is a {type(leaf).__name__}; torch2jax example arguments are torch "
                f"tensors, JAX arrays or jax.ShapeDtypeStruct."
            )
        try:
            dtype = leaf.dtype if isinstance(leaf, torch.Tensor) else torch_dtype(leaf.dtype)
            jax_dtype(dtype)
        except UnsupportedDtypeError as err:
            raise TypeError(f"{where}: {err}") from None
        dtypes.append(dtype)
    return dtypes


def _canonical(dtype: torch.dtype) -> np.dtype:
    return canonical_jax_dtype(jax_dtype(dtype))


def _signature_key(leaves: Sequence[Any]) -> tuple[Any, ...] | None:
    """(shape, dtype) per leaf as JAX sees it; None when a leaf is no array."""
    key = []
    for x in leaves:
        try:
            aval = jax.typeof(x)
        except TypeError:
            return None
        key.append((tuple(aval.shape), np.dtype(aval.dtype)))
    return tuple(key)


def _format_key(key: tuple[Any, ...]) -> str:
    return ", ".join(f"{dtype.name}{list(shape)}" for shape, dtype in key)


# ------------------------------------------------------------ output shapes


def _is_shape(x: Any) -> bool:
    # NumPy integers too: np.prod(shape) and tuple(np.array(shape)) make them,
    # and as leaves (they have .shape and .dtype) they read as 0-d int outputs.
    return isinstance(x, (list, tuple)) and all(isinstance(d, (int, np.integer)) for d in x)


def _normalize_output_shapes(output_shapes: Any, example_dtypes: Sequence[torch.dtype]) -> Any:
    """``output_shapes`` as a pytree of ``jax.ShapeDtypeStruct`` in JAX's dtypes.

    A leaf with a dtype keeps it; a bare shape (``torch.Size``, a tuple of
    ints) gets the example arguments' floating dtype, as in torch2jax.
    """
    with_paths, tree = jax.tree_util.tree_flatten_with_path(output_shapes, is_leaf=_is_shape)
    structs = []
    for path, leaf in with_paths:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            structs.append(jax.ShapeDtypeStruct(tuple(leaf.shape), canonical_jax_dtype(dtype_t2j(leaf.dtype))))
        elif _is_shape(leaf):
            dtype = _default_float(example_dtypes, f"output_shapes{jax.tree_util.keystr(path)}")
            structs.append(jax.ShapeDtypeStruct(tuple(int(d) for d in leaf), dtype))
        else:
            raise TypeError(
                f"output_shapes{jax.tree_util.keystr(path)} is a {type(leaf).__name__}; give "
                f"output shapes as torch.Size or jax.ShapeDtypeStruct (or pytrees of them)."
            )
    return jax.tree.unflatten(tree, structs)


def _default_float(example_dtypes: Sequence[torch.dtype], where: str) -> np.dtype:
    floats = sorted({_canonical(d).name for d in example_dtypes if d.is_floating_point})
    if len(floats) != 1:
        found = f"floating dtypes {', '.join(floats)}" if floats else "no floating dtype"
        raise ValueError(
            f"{where} is a shape without a dtype, and the example arguments have {found}, so "
            f"its dtype cannot be guessed; give it as jax.ShapeDtypeStruct(shape, dtype)."
        )
    return np.dtype(floats[0])


# --------------------------------------------------------- the torch side


def _torch_side(fn: Callable[..., Any], torch_dtypes: Sequence[torch.dtype], out_tree: Any) -> Callable[..., Any]:
    """``fn`` as torch2jax calls it (see NOTE [torch2jax compatibility])."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, in_tree = jax.tree.flatten((args, kwargs))
        leaves = [_as_example_dtype(t, dt) for t, dt in zip(leaves, torch_dtypes)]
        args, kwargs = jax.tree.unflatten(in_tree, leaves)
        if any(type(t) is torch.Tensor and t.is_meta for t in leaves):
            with torch.no_grad():  # the inference run, as torch2jax makes it
                out = fn(*args, **kwargs)
        else:
            out = fn(*args, **kwargs)
        out = jax.tree.map(_as_jax_dtype, out)
        if out_tree is not None:
            outs = jax.tree.leaves(out)
            if len(outs) == out_tree.num_leaves:
                return jax.tree.unflatten(out_tree, outs)
        return out  # the engine names what does not fit

    return call


def _as_example_dtype(t: Any, dtype: torch.dtype) -> Any:
    if isinstance(t, torch.Tensor) and t.dtype != dtype and _canonical(t.dtype) == _canonical(dtype):
        return t.to(dtype)
    return t


def _as_jax_dtype(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    try:
        canonical = torch_dtype(_canonical(t.dtype))
    except UnsupportedDtypeError:
        return t  # refused by the engine with its own message
    return t if canonical == t.dtype else t.to(canonical)


# ------------------------------------------------------------ the wrapper

# torch2jax's wording (its tests match it), so filters written for it keep working.
_SHAPES_CHANGED = (
    "torch2jax: input shapes changed. The torch function will be re-run on placeholder (meta) tensors "
    "(not the original concrete inputs) to infer output shapes for the new input shapes."
    "\nExpecting: {expected}\nActual:    {actual}"
)
_SHAPES_CHANGED_DECLARED = (
    "torch2jax: input shapes changed, but `output_shapes` was explicitly provided. Output shapes for the new "
    "inputs will be inferred by re-running the torch function on placeholder (meta) tensors."
    "\nExpecting: {expected}\nActual:    {actual}"
)


class Torch2JaxFunction:
    """What ``torch2jax`` and ``torch2jax_with_vjp`` return: a JAX function.

    Call it with arguments shaped like the example arguments; it works under
    ``jax.jit`` and every JAX transform, to any order. A call with other
    shapes or dtypes wraps the function again for them, with a warning.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        example_args: tuple[Any, ...],
        example_kw: dict[str, Any] | None,
        *,
        output_shapes: Any,
        vmap_method: str,
        nondiff: Sequence[bool] | None = None,
        autograd_vjp: bool = False,
        out_specs: Any = None,
    ):
        if not callable(fn):
            raise TypeError(f"torch2jax: fn must be callable, got {type(fn).__name__}.")
        self._has_kw = example_kw is not None
        examples = (example_args, example_kw) if self._has_kw else example_args
        torch_dtypes = _example_dtypes(examples)
        leaves, self._in_tree = jax.tree.flatten(examples)
        # The examples as JAX sees them (an int64 tensor is int32 with x64 off).
        structs = [jax.ShapeDtypeStruct(tuple(x.shape), _canonical(dt)) for x, dt in zip(leaves, torch_dtypes)]
        self._example_key = _signature_key(structs)
        self._nondiff = tuple(nondiff) if nondiff is not None and any(nondiff) else None
        self._warned: set[Any] = set()
        self._out_specs = out_specs
        self._fn, self._torch_dtypes = fn, torch_dtypes
        self._options = options = dict(vmap_method=vmap_method, autograd_vjp=autograd_vjp)
        # Per-shard functions for the declared output shapes, by per-shard shapes.
        self._declared_shards: dict[Any, JaxifiedFunction] = {}
        # Any signature, output shapes inferred by the engine and cached per signature.
        self._inferred = JaxifiedFunction(_torch_side(fn, torch_dtypes, None), output_shapes=None, **options)
        self._name = f"torch2jax({self._inferred.name})"  # for the errors
        if output_shapes is None:
            self._declared = self._declared_shapes = None
            # torch2jax finds the output shapes when it wraps; so do we, on meta
            # tensors first (the engine's inference), and keep them cached.
            structs = jax.tree.unflatten(self._in_tree, structs)
            args_s, kw_s = structs if self._has_kw else (structs, {})
            jax.eval_shape(lambda a, k: self._inferred(*a, **k), args_s, kw_s)
        else:
            self._declared_shapes = _normalize_output_shapes(output_shapes, torch_dtypes)
            self._declared = self._for_shapes(self._declared_shapes)
        functools.update_wrapper(self, fn, updated=())

    def __repr__(self) -> str:
        return f"<torch2jax {self._inferred.name}>"

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the function and the examples as meta tensors of the
        # examples' torch dtypes (its closures do not pickle; pickle blamed the
        # user's function, whose name they carry). Needs fn to pickle.
        shapes = [shape for shape, _ in self._example_key]  # made of the examples' structs: never None
        metas = [torch.empty(s, dtype=dt, device="meta") for s, dt in zip(shapes, self._torch_dtypes)]
        examples = jax.tree.unflatten(self._in_tree, metas)
        args, kw = examples if self._has_kw else (examples, None)
        options = dict(
            output_shapes=self._declared_shapes, nondiff=self._nondiff, out_specs=self._out_specs, **self._options
        )
        return (_rebuilt, (self._fn, tuple(args), kw, options))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs and not self._has_kw:
            raise Torch2JaxInputError(
                f"Keyword arguments not expected! Got {sorted(kwargs)}; pass example_kw= to "
                f"torch2jax to declare keyword arguments."
            )
        given = (args, kwargs) if self._has_kw else args
        leaves, tree = jax.tree.flatten(given)
        if tree != self._in_tree:
            what = "(args, kw)" if self._has_kw else "args"
            raise Torch2JaxInputError(
                f"Provided {what} of structure\n{tree}\ndo not match the torch2jax function's "
                f"expected input structure (that of the example arguments)\n{self._in_tree}"
            )
        if self._nondiff is not None:
            leaves = [jax.lax.stop_gradient(x) if m else x for x, m in zip(leaves, self._nondiff)]
            given = jax.tree.unflatten(tree, leaves)
            args, kwargs = given if self._has_kw else (given, {})
        key = _signature_key(leaves)
        declared = key == self._example_key and self._declared is not None
        if not declared:
            self._warn_new_signature(key)
        shard_plan = per_shard.plan(leaves, self._out_specs, name=self._name)
        if shard_plan is None:
            return (self._declared if declared else self._inferred)(*args, **kwargs)
        # NOTE [per-shard calls over Explicit axes] in per_shard.py
        fn = self._declared_per_shard(shard_plan.mesh) if declared else self._inferred

        def one_shard(*shard_leaves: Any) -> Any:
            given = jax.tree.unflatten(tree, shard_leaves)
            args, kwargs = given if self._has_kw else (given, {})
            return fn(*args, **kwargs)

        return per_shard.call_per_shard(one_shard, leaves, shard_plan, self._out_specs)

    def _for_shapes(self, output_shapes: Any) -> JaxifiedFunction:
        """The function with the given output shapes (no inference)."""
        torch_side = _torch_side(self._fn, self._torch_dtypes, jax.tree.structure(output_shapes))
        return JaxifiedFunction(torch_side, output_shapes=output_shapes, **self._options)

    def _declared_per_shard(self, mesh: Any) -> JaxifiedFunction:
        """The function with the declared output shapes split by ``out_specs`` over ``mesh``."""
        shapes = per_shard.local_shapes(self._declared_shapes, self._out_specs, mesh, name=self._name)
        key = tuple((s.shape, s.dtype) for s in jax.tree.leaves(shapes))
        if key not in self._declared_shards:
            self._declared_shards[key] = self._for_shapes(shapes)
        return self._declared_shards[key]

    def _warn_new_signature(self, key: tuple[Any, ...] | None) -> None:
        """Warn once per signature that is not the example arguments'."""
        if key is None or key == self._example_key or key in self._warned:
            return
        self._warned.add(key)
        message = _SHAPES_CHANGED_DECLARED if self._declared else _SHAPES_CHANGED
        warnings.warn(
            message.format(expected=_format_key(self._example_key), actual=_format_key(key)),
            UserWarning,
            stacklevel=3,
        )


def _rebuilt(fn: Callable[..., Any], args: tuple[Any, ...], kw: Any, options: dict[str, Any]) -> Torch2JaxFunction:
    """A pickled ``Torch2JaxFunction`` made again (``Torch2JaxFunction.__reduce__``)."""
    return Torch2JaxFunction(fn, args, kw, **options)


# --------------------------------------------------------------- the API


def _resolve_out_specs(out_specs: Any, output_sharding_spec: Any, name: str) -> Any:
    """``out_specs``, or the deprecated ``output_sharding_spec`` standing for it (as in torch2jax 0.8)."""
    if output_sharding_spec is None:
        return out_specs
    if out_specs is not None:
        raise ValueError(f"{name}: give out_specs only; output_sharding_spec is its deprecated name.")
    warnings.warn(
        f"{name}(output_sharding_spec=...) is deprecated; pass out_specs=... (the same PartitionSpec).",
        UserWarning,
        stacklevel=3,
    )
    return output_sharding_spec


def torch2jax(
    fn: Callable[..., Any],
    *example_args: Any,
    example_kw: dict[str, Any] | None = None,
    output_shapes: Any = None,
    output_sharding_spec: Any = None,
    vmap_method: str = "sequential",
    depth: int = 2,
    out_specs: Any = None,
) -> Torch2JaxFunction:
    """A JAX function calling the PyTorch function ``fn``, as torch2jax's ``torch2jax``.

    Args:
        fn: the PyTorch function; called as ``fn(*args, **kw)``.
        *example_args: example arguments (torch tensors, JAX arrays or
            ``jax.ShapeDtypeStruct``), or pytrees of them.
        example_kw: example keyword arguments; without them the function
            takes none.
        output_shapes: the outputs' shapes (``torch.Size``,
            ``jax.ShapeDtypeStruct``, or pytrees of them). When given, ``fn``
            is not run to infer them; otherwise it runs once, on meta tensors
            where it can.
        output_sharding_spec: the deprecated name of ``out_specs`` (warns).
        vmap_method: how a batch reaches PyTorch under ``jax.vmap``:
            ``"sequential"``, ``"expand_dims"``, ``"broadcast_all"`` or ``"auto"``.
        depth: accepted for compatibility and ignored, as in
            ``torch2jax_with_vjp`` (torch2jax 0.8 made ``torch2jax``
            differentiable to ``depth``; ``depth=0`` was forward only).
        out_specs: for inputs sharded over a mesh's Explicit axes: the
            outputs' ``PartitionSpec`` (a tree prefix of the outputs). The
            function then runs once per shard, on each device's block, inside
            ``jax.shard_map``; ``output_shapes`` stay global and are split by
            it. Without it such inputs raise a ``ValueError`` (the call would
            gather them). See NOTE [per-shard calls over Explicit axes].

    The result is differentiable to any order, in forward and reverse mode
    (see ``torch2jax_with_vjp``).
    """
    del depth  # NOTE [torch2jax compatibility]
    return Torch2JaxFunction(
        fn,
        example_args,
        example_kw,
        output_shapes=output_shapes,
        vmap_method=vmap_method,
        out_specs=_resolve_out_specs(out_specs, output_sharding_spec, "torch2jax"),
    )


def torch2jax_without_vjp(
    fn: Callable[..., Any],
    *example_args: Any,
    example_kw: dict[str, Any] | None = None,
    output_shapes: Any = None,
    output_sharding_spec: Any = None,
    vmap_method: str = "sequential",
    out_specs: Any = None,
) -> Torch2JaxFunction:
    """torch2jax's forward-only wrapper: here ``torch2jax`` itself, whose
    result is also differentiable (a superset of what torch2jax offers)."""
    return torch2jax(
        fn,
        *example_args,
        example_kw=example_kw,
        output_shapes=output_shapes,
        vmap_method=vmap_method,
        out_specs=_resolve_out_specs(out_specs, output_sharding_spec, "torch2jax_without_vjp"),
    )


def torch2jax_auto(torch_fn: Callable[..., Any], output_shapes: Any = None, **kwargs: Any) -> Callable[..., Any]:
    """A JAX function of ``torch_fn`` with no example arguments, as
    torch2jax's ``torch2jax_auto``: the first call's argument shapes and
    dtypes serve as the examples, and later calls with other shapes are
    accepted as ``torch2jax`` accepts them (with a warning, outputs inferred
    again). ``kwargs`` go to ``torch2jax_with_vjp``.
    """
    wrapped: list[Torch2JaxFunction] = []
    lock = threading.Lock()

    def call(*args: Any) -> Any:
        if not wrapped:
            examples = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), args)
            with lock:
                if not wrapped:
                    wrapped.append(torch2jax_with_vjp(torch_fn, *examples, output_shapes=output_shapes, **kwargs))
        return wrapped[0](*args)

    functools.update_wrapper(call, torch_fn)
    return call


def _nondiff_mask(example_args: tuple[Any, ...], nondiff_argnums: Any, nondiff_mask: Any) -> list[bool] | None:
    """One flag per example leaf: True where gradients are zeros."""
    if nondiff_argnums is not None:
        # As in torch2jax, nondiff_argnums names whole arguments and wins over nondiff_mask.
        argnums = (nondiff_argnums,) if isinstance(nondiff_argnums, int) else nondiff_argnums
        if not isinstance(argnums, Sequence) or isinstance(argnums, str) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in argnums
        ):
            raise TypeError(
                f"torch2jax_with_vjp: nondiff_argnums must be an int or a sequence of ints (argument "
                f"indices), got {nondiff_argnums!r}."
            )
        argnums = tuple(argnums)
        bad = [i for i in argnums if not -len(example_args) <= i < len(example_args)]
        if bad:
            raise ValueError(f"nondiff_argnums {bad} out of range for {len(example_args)} example arguments.")
        argnums = {i % len(example_args) for i in argnums}
        nondiff_mask = [jax.tree.map(lambda _: i in argnums, arg) for i, arg in enumerate(example_args)]
    if nondiff_mask is None:
        return None
    flags = jax.tree.leaves(nondiff_mask)
    not_bools = [f for f in flags if not isinstance(f, (bool, np.bool_))]
    if not_bools:
        raise TypeError(
            f"torch2jax_with_vjp: nondiff_mask must hold bools, one per example array, in a tree like "
            f"example_args; it holds {not_bools[0]!r} ({type(not_bools[0]).__name__})."
        )
    n = len(jax.tree.leaves(example_args))
    if len(flags) != n:
        raise ValueError(
            f"nondiff_mask has {len(flags)} leaves, but the example arguments have {n}; give one "
            f"bool per array, in a tree like example_args."
        )
    return [bool(m) for m in flags]


def torch2jax_with_vjp(
    torch_fn: Callable[..., Any],
    *example_args: Any,
    depth: int = 2,
    nondiff_argnums: int | Sequence[int] | None = None,
    nondiff_mask: Any = None,
    output_shapes: Any = None,
    use_zeros: bool = True,
    use_torch_vjp: bool = True,
    output_sharding_spec: Any = None,
    vmap_method: str = "sequential",
    out_specs: Any = None,
    use_torch_vmap: bool | None = None,
) -> Torch2JaxFunction:
    """A differentiable JAX function calling ``torch_fn``, as torch2jax's ``torch2jax_with_vjp``.

    Args:
        torch_fn: the PyTorch function, as ``fn`` in ``torch2jax``.
        *example_args: example arguments, as in ``torch2jax``.
        depth: accepted for compatibility and ignored: derivatives of every
            order work, in reverse and forward mode (``jax.hessian``,
            ``jax.jacfwd``) and under ``jax.vmap``.
        nondiff_argnums: indices of whole arguments whose gradients are zeros.
        nondiff_mask: a pytree like ``example_args`` of bools, True where the
            gradient is zeros. ``nondiff_argnums`` wins when both are given.
        output_shapes: as in ``torch2jax``.
        use_zeros: accepted; gradients of non-differentiable arguments are
            zeros either way (torch2jax's ``None`` cotangents are zeros in JAX).
        use_torch_vjp: False computes reverse mode with
            ``torch.autograd.grad`` instead of ``torch.func.vjp``, for code
            ``torch.func`` refuses (old-style ``autograd.Function``).
        output_sharding_spec: the deprecated name of ``out_specs`` (warns).
        vmap_method: as in ``torch2jax``.
        out_specs: as in ``torch2jax``: run once per shard over Explicit axes.
        use_torch_vmap: torch2jax's older switch, before ``vmap_method``:
            True is ``vmap_method="expand_dims"`` (one ``torch.vmap`` call),
            False is ``"sequential"``. Give one of the two.
    """
    del depth, use_zeros  # see the docstring and NOTE [torch2jax compatibility]
    for name, flag in (("use_torch_vjp", use_torch_vjp), ("use_torch_vmap", use_torch_vmap)):
        if flag is not None and not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"torch2jax_with_vjp: {name} must be True or False, got {flag!r}.")
    if use_torch_vmap is not None:
        if vmap_method != "sequential":
            raise ValueError(
                "torch2jax_with_vjp: give vmap_method only; use_torch_vmap is its older form "
                "(True: 'expand_dims', False: 'sequential')."
            )
        vmap_method = "expand_dims" if use_torch_vmap else "sequential"
    out_specs = _resolve_out_specs(out_specs, output_sharding_spec, "torch2jax_with_vjp")
    return Torch2JaxFunction(
        torch_fn,
        example_args,
        None,
        output_shapes=output_shapes,
        vmap_method=vmap_method,
        nondiff=_nondiff_mask(example_args, nondiff_argnums, nondiff_mask),
        autograd_vjp=not use_torch_vjp,
        out_specs=out_specs,
    )
