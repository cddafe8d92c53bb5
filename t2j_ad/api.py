"""jaxify and jaxify_module: pytree flattening, the signature cache, inference."""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .convert import UnsupportedDtypeError, canonical_jax_dtype, jax_dtype, t2j, torch_dtype
from .inference import infer_outputs
from .primitive import torch_call
from .runtime import TorchCallError, check_environment, not_a_tensor
from .torch_fn import VMAP_METHODS, Aval, BaseFn, TorchFn

_live_functions: weakref.WeakSet = weakref.WeakSet()


def _is_output_leaf(x: Any) -> bool:
    return x is None or isinstance(x, torch.Tensor)


def _arg_name(path: tuple[Any, ...]) -> str:
    """``args[0]['w']`` / ``kwargs['lr']`` for a path into ``(args, kwargs)``."""
    head, rest = path[0], path[1:]
    root = "args" if getattr(head, "idx", 0) == 0 else "kwargs"
    return root + jax.tree_util.keystr(rest)


_SCALARS = (bool, int, float, complex, np.generic)


def _as_array(path: tuple[Any, ...], leaf: Any) -> jax.Array:
    if isinstance(leaf, jax.Array):
        array = leaf
    elif isinstance(leaf, (np.ndarray,) + _SCALARS):
        try:
            array = jnp.asarray(leaf)
        except (TypeError, ValueError, OverflowError) as err:  # object arrays, ints beyond 64 bits
            raise TypeError(f"argument {_arg_name(path)} cannot become a JAX array: {err}") from None
    else:
        raise TypeError(
            f"argument {_arg_name(path)} is a {type(leaf).__name__}; t2j_ad "
            f"functions take pytrees of JAX arrays, NumPy arrays or Python "
            f"scalars. Convert it (torch tensors: t2j_ad.tree_t2j) or close "
            f"over it in the PyTorch function."
        )
    try:
        torch_dtype(array.dtype)
    except UnsupportedDtypeError as err:
        raise TypeError(f"argument {_arg_name(path)}: {err}") from None
    return array


# NOTE [64-bit outputs]
# With jax_enable_x64 off, JAX has no float64/int64/complex128 arrays: it
# computes such values in 32 bits and says so once. A PyTorch function that
# returns a 64-bit tensor is treated the same way: the output's JAX dtype is
# the canonical 32-bit one, the value is cast on the way out, and a warning
# names the output.


def _warn_64bit(name: str, out_name: str, dtype: np.dtype, canonical: np.dtype) -> None:
    warnings.warn(
        f"t2j_ad: {name} returns {dtype} for output {out_name}, but "
        f"jax_enable_x64 is off, so JAX gets it as {canonical}, as JAX does "
        f"with 64-bit values in this mode. Enable x64 "
        f"(jax.config.update('jax_enable_x64', True)) to keep 64 bits.",
        UserWarning,
        stacklevel=4,
    )


class _Signature:
    """What one input signature resolved to: the base function, outputs tree."""

    def __init__(self, base: BaseFn, out_tree: Any):
        self.base = base
        self.out_tree = out_tree


class JaxifiedFunction:
    """A PyTorch function callable from JAX under every transform.

    ``autograd_vjp=True`` computes reverse mode with ``torch.autograd.grad``
    instead of trying ``torch.func.vjp`` first (see NOTE [fallbacks]).
    """

    def __init__(
        self, torch_fn: Callable[..., Any], vmap_method: str, output_shapes: Any, *, autograd_vjp: bool = False
    ):
        if not callable(torch_fn):
            raise TypeError(f"jaxify: torch_fn must be callable, got {type(torch_fn).__name__}.")
        if vmap_method not in VMAP_METHODS:
            raise ValueError(f"jaxify: vmap_method must be one of {VMAP_METHODS}, got {vmap_method!r}.")
        self.torch_fn = torch_fn
        self.vmap_method = vmap_method
        self.output_shapes = output_shapes
        self.autograd_vjp = autograd_vjp
        self.name = getattr(torch_fn, "__qualname__", None) or getattr(torch_fn, "__name__", None) or repr(torch_fn)
        try:
            self._signature: inspect.Signature | None = inspect.signature(torch_fn)
        except (TypeError, ValueError):  # builtins such as torch.sin
            self._signature = None
        self._cache: dict[Any, _Signature] = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, torch_fn, updated=())
        _live_functions.add(self)

    def __repr__(self) -> str:
        return f"<jaxified {self.name}>"

    # -- signature cache ---------------------------------------------------

    def _check_arity(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._signature is None:
            return
        try:
            self._signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{self.name}{self._signature}: {err}") from None

    def _raw_fn(self, in_tree: Any) -> Callable[..., Any]:
        torch_fn = self.torch_fn
        if in_tree == jax.tree_util.tree_structure((tuple(range(in_tree.num_leaves)), {})):
            return torch_fn  # positional leaves only: nothing to rebuild

        def raw(*tensors: torch.Tensor) -> Any:
            args, kwargs = jax.tree_util.tree_unflatten(in_tree, tensors)
            return torch_fn(*args, **kwargs)

        return raw

    def _flat_fn(self, raw: Callable[..., Any]) -> Callable[..., tuple[Any, ...]]:
        name = self.name

        def flat(*tensors: torch.Tensor) -> tuple[Any, ...]:
            out = raw(*tensors)
            # Fast paths for the common output structures; anything unusual
            # goes through the general check below.
            if flat.single_tensor and isinstance(out, torch.Tensor):  # type: ignore[attr-defined]
                return (out,)
            if flat.flat_tuple and type(out) is tuple and len(out) == flat.flat_tuple:
                if all(isinstance(o, torch.Tensor) for o in out):
                    return out
            with_paths, tree = jax.tree_util.tree_flatten_with_path(out, is_leaf=_is_output_leaf)
            expected = flat.out_tree
            if expected is not None and tree != expected:
                raise TorchCallError(
                    f"{name} returned outputs of structure {tree}, but {expected} was declared (output_shapes or inference)."
                )
            for path, leaf in with_paths:
                if not isinstance(leaf, torch.Tensor):
                    raise not_a_tensor(name, f"output{jax.tree_util.keystr(path)}", leaf)
            return tuple(leaf for _, leaf in with_paths)

        flat.out_tree = None
        flat.single_tensor = False
        flat.flat_tuple = 0
        return flat

    def _resolve(self, in_tree: Any, in_avals: tuple[Aval, ...]) -> _Signature:
        check_environment()
        raw = self._raw_fn(in_tree)
        flat = self._flat_fn(raw)
        if self.output_shapes is not None:
            with_paths, out_tree = jax.tree_util.tree_flatten_with_path(self.output_shapes)
            declared = []
            for path, leaf in with_paths:
                if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
                    raise TypeError(
                        f"jaxify: output_shapes{jax.tree_util.keystr(path)} is a "
                        f"{type(leaf).__name__}; expected jax.ShapeDtypeStruct (or anything with .shape and .dtype)."
                    )
                where = f"output_shapes{jax.tree_util.keystr(path)}"
                shape = tuple(leaf.shape)
                if not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
                    raise ValueError(f"jaxify: {where} has shape {shape}; dimensions must be ints >= 0.")
                try:
                    dtype = np.dtype(leaf.dtype)
                    declared.append((jax.tree_util.keystr(path), shape, dtype, torch_dtype(dtype)))
                except (TypeError, UnsupportedDtypeError) as err:
                    raise TypeError(f"jaxify: {where}: {err}") from None
            mutation_checked = False
        else:
            inferred = infer_outputs(raw, in_avals, self.name)
            with_paths, out_tree = jax.tree_util.tree_flatten_with_path(inferred, is_leaf=_is_output_leaf)
            declared = []
            for path, leaf in with_paths:
                where = f"output{jax.tree_util.keystr(path)}"
                if not isinstance(leaf, torch.Tensor):
                    raise not_a_tensor(self.name, where, leaf)
                try:
                    dtype = jax_dtype(leaf.dtype)
                except UnsupportedDtypeError as err:
                    raise TorchCallError(f"{self.name}: {where}: {err}") from None
                declared.append((jax.tree_util.keystr(path), tuple(leaf.shape), dtype, leaf.dtype))
            mutation_checked = True
        out_avals = []
        for path, shape, dtype, _ in declared:
            canonical = canonical_jax_dtype(dtype)
            if canonical != dtype:
                _warn_64bit(self.name, f"output{path}", dtype, canonical)
            out_avals.append(Aval(shape, canonical))
        flat.out_tree = out_tree
        flat.single_tensor = out_tree == jax.tree_util.tree_structure(0)
        n_out = out_tree.num_leaves
        if n_out and out_tree == jax.tree_util.tree_structure(tuple(range(n_out))):
            flat.flat_tuple = n_out
        # Positional leaves only and flat results: the runtime may call the
        # user's function itself (BaseFn.direct).
        direct = raw if raw is self.torch_fn and (flat.single_tensor or flat.flat_tuple) else None
        base = BaseFn(
            flat,
            name=self.name,
            vmap_method=self.vmap_method,
            in_avals=in_avals,
            out_avals=tuple(out_avals),
            out_names=tuple(f"output{p}" for p, *_ in declared),
            torch_out_dtypes=tuple(t for *_, t in declared),
            mutation_checked=mutation_checked,
            autograd_vjp=self.autograd_vjp,
            direct=direct,
            direct_single=direct is not None and flat.single_tensor,
        )
        return _Signature(base, out_tree)

    def signature_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Signature, list[jax.Array]]:
        """The cached (or freshly inferred) signature entry, and flat arrays."""
        self._check_arity(args, kwargs)
        with_paths, in_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
        arrays = [_as_array(path, leaf) for path, leaf in with_paths]
        in_avals = tuple(Aval(tuple(a.shape), np.dtype(a.dtype)) for a in arrays)
        key = (in_tree, in_avals)
        entry = self._cache.get(key)
        if entry is None:
            with self._lock:
                entry = self._cache.get(key)
                if entry is None:
                    entry = self._resolve(in_tree, in_avals)
                    self._cache[key] = entry
        return entry, arrays

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        entry, arrays = self.signature_for(args, kwargs)
        outs = torch_call(arrays, TorchFn.of(entry.base))
        return jax.tree_util.tree_unflatten(entry.out_tree, outs)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()


def jaxify(
    torch_fn: Callable[..., Any] | None = None,
    *,
    vmap_method: str = "auto",
    output_shapes: Any = None,
) -> Any:
    """Wrap a PyTorch function as a JAX function.

    ``jaxify(fn)``, ``@jaxify`` or ``@jaxify(vmap_method=...)``. The result
    takes pytrees of JAX arrays (NumPy arrays and Python scalars accepted) and
    returns the pytree ``fn`` returns, as JAX arrays. It works under
    ``jax.jit`` and every JAX transform. Output shapes are inferred per input
    signature (meta device, else one call on zeros) unless ``output_shapes``
    (a pytree of ``jax.ShapeDtypeStruct``) is given.
    """
    if torch_fn is None:
        return functools.partial(jaxify, vmap_method=vmap_method, output_shapes=output_shapes)
    return JaxifiedFunction(torch_fn, vmap_method, output_shapes)


def _check_params(params: Any, expected: Mapping[str, jax.Array]) -> None:
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params is a {type(params).__name__}; expected the dict of "
            f"{len(expected)} parameters returned by jaxify_module (name -> array)."
        )
    missing = [k for k in expected if k not in params]
    extra = [k for k in params if k not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append("missing " + ", ".join(f"params[{k!r}]" for k in missing))
        if extra:
            parts.append("unexpected " + ", ".join(f"params[{k!r}]" for k in extra))
        raise TypeError(
            f"params does not match the module's parameters: {'; '.join(parts)}. "
            f"Pass the dict returned by jaxify_module (or one with the same keys)."
        )
    for k, ref in expected.items():
        value = params[k]
        shape = getattr(value, "shape", None)
        if shape is None:
            raise TypeError(f"params[{k!r}] is a {type(value).__name__}; expected an array of shape {ref.shape}.")
        if tuple(shape) != tuple(ref.shape):
            raise TypeError(f"params[{k!r}] has shape {tuple(shape)}; the module's parameter has shape {tuple(ref.shape)}.")


def jaxify_module(module: torch.nn.Module, *, vmap_method: str = "auto") -> tuple[Callable[..., Any], dict[str, jax.Array]]:
    """``apply, params`` for a ``torch.nn.Module``.

    ``params`` maps each name of ``module.named_parameters()`` to a JAX array
    (a copy, so later in-place training of the module does not change it).
    ``apply(params, *args, **kwargs)`` runs the module through
    ``torch.func.functional_call``, with its buffers passed as constants, so JAX
    can differentiate with respect to ``params``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"jaxify_module: module must be a torch.nn.Module, got {type(module).__name__}.")
    params = {name: t2j(p.detach().clone()) for name, p in module.named_parameters()}
    buffers = dict(module.named_buffers())

    def forward(params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(module, (params, buffers), args, kwargs)

    forward.__qualname__ = f"{type(module).__name__}.forward"
    jaxified = JaxifiedFunction(forward, vmap_method, None)

    def apply(params: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        _check_params(params, reference)
        return jaxified(dict(params), *args, **kwargs)

    reference = dict(params)
    apply.jaxified = jaxified  # type: ignore[attr-defined]
    apply.__qualname__ = forward.__qualname__
    return apply, params


def clear_caches() -> None:
    """Forget every inferred signature, built PyTorch transform, registry entry
    and JAX compilation cache, so memory held for past calls is released."""
    for f in list(_live_functions):
        f.clear_cache()
    try:
        from .backends import registry
    except ImportError:
        registry = None
    if registry is not None:
        registry.clear()
    jax.clear_caches()
