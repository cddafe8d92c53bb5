"""jaxify: pytree flattening, the signature cache, inference."""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import registration  # noqa: F401 - registers torch_call's rules before any call
from .convert import UnsupportedDtypeError, call_device, canonical_jax_dtype, jax_dtype, torch_device, torch_dtype
from . import graph_mode
from .graph_mode import resolve_compile_mode
from . import replayed_calls
from .inference import infer_outputs
from .held_layouts import named_tensors
from .module_modes import referenced_modules
from .module_structure import StructureSeen
from .named_bindings import BindingsSeen
from .primitive import torch_call
from .rules.partitioning import local_bases
# Also PyTorch's result tuples as pytrees (NOTE [PyTorch's result tuples]).
from .pytrees import flags_kept, registered_from_torch
from .attention_fast_path import without_attention_fast_path
from .recurrent_cudnn import without_cudnn_in_recurrent_forwards
from .generator_calls import makes_generators
from .random_state import referenced_generators
from .runtime import (
    InputMutationError,
    TorchCallError,
    check_environment,
    integer_scalars_hint,
    mutation_message,
    not_a_tensor,
    not_dense,
    one_in_a_sequence,
    wrong_structure,
)
from .torch_fn import VMAP_METHODS, Aval, BaseFn, TorchFn
from .trial_caches import dicts_named_by

_ONE_LEAF = jax.tree_util.tree_structure(0)  # the output structure of one tensor

_live_functions: weakref.WeakSet = weakref.WeakSet()


def _is_output_leaf(x: Any) -> bool:
    return x is None or isinstance(x, torch.Tensor)


def _tuples_made_plain(out: Any, lists_too: bool = False) -> Any:
    """``out`` with every tuple subclass in it (a namedtuple, ``torch.max``'s
    ``return_types``) made a plain tuple, through tuples, lists and dicts:
    where ``output_shapes`` declares a tuple, a tuple subclass is one. With
    ``lists_too``, every list too: what tells a structure from one that
    differs only in lists against tuples."""
    if isinstance(out, tuple) or (lists_too and type(out) is list):
        return tuple(_tuples_made_plain(o, lists_too) for o in out)
    if type(out) is list:
        return [_tuples_made_plain(o) for o in out]
    if type(out) is dict:
        return {k: _tuples_made_plain(v, lists_too) for k, v in out.items()}
    return out


def _sequence_kinds_differ(out: Any, expected: Any) -> str:
    """A hint for results whose structure differs from ``expected`` (a
    treedef) only in lists against tuples: ``output_shapes=[a, b]`` for a
    function that returns ``(a, b)``; "" otherwise."""
    declared = jax.tree_util.tree_unflatten(expected, [0] * expected.num_leaves)
    returned = jax.tree_util.tree_structure(_tuples_made_plain(out, lists_too=True), is_leaf=_is_output_leaf)
    if returned != jax.tree_util.tree_structure(_tuples_made_plain(declared, lists_too=True)):
        return ""
    return (
        ". The two differ only in lists against tuples: declare output_shapes with the kind of sequence "
        "the function returns (a tuple for `return a, b`), as JAX's outputs follow it"
    )


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
        f"t2j_ad: {name} returns {dtype} for {out_name}, but "
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


def _effects_finder(
    raw: Callable[..., Any],
    in_avals: tuple[Aval, ...],
    name: str,
    device: torch.device,
    modules: tuple[Any, ...],
    dicts: list[dict[Any, Any]],
) -> Callable[[], Any]:
    """What a new trial run of ``raw`` sees it do besides computing its outputs."""
    return lambda: infer_outputs(raw, in_avals, name, device, modules, dicts).effects


def _structure_holds(base: BaseFn, with_its_tensors: bool = False) -> bool:
    """Whether the modules and names ``base``'s function refers to hold what
    they held when its signature was resolved (``with_its_tensors``: each
    parameter and buffer too, for a signature set aside: NOTE [a structure
    seen before]), and, where its own run binds submodules, whether a trial
    run with its flags as they are now binds those it bound then (NOTE [a
    submodule switched by its own forward] in module_structure.py)."""
    structure = base.structure
    if not (structure.holds_with_its_tensors() if with_its_tensors else structure.holds()):
        return False
    if base.find_effects is None or not structure.binds_its_own_submodules():
        return True
    return structure.binds_as_before(base.find_effects)


def _input_names(in_tree: Any, n: int) -> tuple[str, ...]:
    """The key path of each of the ``n`` flat inputs of ``(args, kwargs)``
    trees ``in_tree``, as ``args[0]['weight']``, for errors that name one."""
    numbered = jax.tree_util.tree_unflatten(in_tree, range(n))
    return tuple(
        ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])
        for path, _ in jax.tree_util.tree_flatten_with_path(numbered)[0]
    )


def _checked_output_shapes(output_shapes: Any) -> Any:
    """``output_shapes``, refused at once where it declares no output or a
    leaf that is no shape and dtype."""
    if output_shapes is None:
        return None
    with_paths = jax.tree_util.tree_flatten_with_path(output_shapes)[0]
    if not with_paths:
        raise ValueError(
            f"jaxify: output_shapes is {output_shapes!r}, which declares no output: JAX drops a call with "
            f"no outputs, so the function would never run. Declare what it returns, or leave output_shapes "
            f"out (a function that returns nothing and updates state is found to, and runs on every call)."
        )
    for path, leaf in with_paths:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"jaxify: output_shapes{jax.tree_util.keystr(path)} is a "
                f"{type(leaf).__name__}; expected jax.ShapeDtypeStruct (or anything with .shape and .dtype)."
            )
    return output_shapes


# How deep result classes registered with PyTorch's pytrees may nest
# (CLIPOutput holds its towers' BaseModelOutputWithPooling).
_NESTED_RESULT_CLASSES = 8


class JaxifiedFunction:
    """A PyTorch function callable from JAX under every transform.

    What ``jaxify`` returns (``jaxify_module``'s ``apply`` holds one as
    ``apply.jaxified``). Calling it flattens the arguments, looks their
    signature (tree structure, shapes, dtypes) up in a per-function cache,
    inferring the outputs on a miss, and binds one ``torch_call``.

    Make one with ``jaxify``. The constructor has two keywords of its own:
    ``autograd_vjp=True`` is what ``t2j_ad.compat``'s
    ``torch2jax_with_vjp(use_torch_vjp=False)`` passes: reverse mode with
    ``torch.autograd.grad`` instead of trying ``torch.func.vjp`` first (see
    NOTE [fallbacks]); ``params_first=True`` is what ``jaxify_module``
    passes, so that messages count ``batch_argnums`` after the params.

    ``copy.deepcopy`` gives the function itself, as for Python functions;
    ``pickle`` stores the PyTorch function and the options, so it pickles
    where the PyTorch function does, and its caches start empty.
    """

    def __init__(
        self,
        torch_fn: Callable[..., Any],
        vmap_method: str,
        output_shapes: Any,
        *,
        autograd_vjp: bool = False,
        batch_argnums: int | tuple[int, ...] | None = None,
        compile: str | None = None,
        params_first: bool = False,
    ):
        if not callable(torch_fn):
            raise TypeError(f"jaxify: torch_fn must be callable, got {type(torch_fn).__name__}.")
        if vmap_method not in VMAP_METHODS:
            raise ValueError(f"jaxify: vmap_method must be one of {VMAP_METHODS}, got {vmap_method!r}.")
        self.batch_argnums = check_batch_argnums(batch_argnums)
        # jaxify_module's forward takes params first; its messages count the
        # arguments after them, as the user's batch_argnums does.
        self._argnum_shift = 1 if params_first else 0
        self.torch_fn = torch_fn
        self.vmap_method = vmap_method
        self.compile = resolve_compile_mode(compile, "jaxify")
        self.output_shapes = _checked_output_shapes(output_shapes)
        self.autograd_vjp = autograd_vjp
        self.name = getattr(torch_fn, "__qualname__", None) or getattr(torch_fn, "__name__", None) or repr(torch_fn)
        try:
            self._signature: inspect.Signature | None = inspect.signature(torch_fn)
        except (TypeError, ValueError):  # builtins such as torch.sin
            self._signature = None
        self._cache: dict[Any, _Signature] = {}
        # NOTE [a structure seen before] in module_structure.py: per input
        # signature, the last few resolutions set aside, most recent first;
        # and what compile_stats() counted of those dropped beyond them.
        self._set_aside: dict[Any, list[_Signature]] = {}
        self._dropped_stats = graph_mode.no_stats()
        # Per input signature, what graph mode saw of settings changed
        # alone, shared by its resolutions (NOTE [a setting changed every
        # step] in graph_mode.py).
        self._settings_seen: dict[Any, dict[Any, Any]] = {}
        self._lock = threading.RLock()  # a function may call its own wrapper while inferring
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
            method = next(iter(self._signature.parameters), None) == "self"
            hint = (
                " (It takes self: @t2j_ad.jaxify on a method does not bind the object, as a jaxify'd "
                "function is no method; wrap the bound method instead, t2j_ad.jaxify(obj.method), or "
                "jaxify_module for a module's forward.)"
                if method
                else ""
            )
            raise TypeError(f"{self.name}{self._signature}: {err}{hint}") from None

    def __deepcopy__(self, memo: dict[int, Any]) -> JaxifiedFunction:
        # As copy.deepcopy does for functions (and jax.jit's wrappers): the
        # same function; its lock and caches are no state to copy.
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as what makes it (the PyTorch function must pickle); the
        # caches are rebuilt by the first calls.
        return (
            _rebuilt,
            (self.torch_fn, self.vmap_method, self.output_shapes, self.autograd_vjp, self.batch_argnums, self.compile),
        )

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
                with_paths, tree = jax.tree_util.tree_flatten_with_path(_tuples_made_plain(out), is_leaf=_is_output_leaf)
            if expected is not None and tree != expected:
                # The runner's errors for a plain call's results, which graph
                # mode's eager runs and derived calls reach here instead.
                if expected == _ONE_LEAF and isinstance(out, (tuple, list)) and len(out) == 1:
                    raise one_in_a_sequence(name, out)
                raise wrong_structure(
                    name,
                    out,
                    expected.num_leaves,
                    f": it returned the structure {tree}, where {expected} was expected"
                    f"{_sequence_kinds_differ(out, expected)}",
                )
            for path, leaf in with_paths:
                if not isinstance(leaf, torch.Tensor):
                    raise not_a_tensor(name, f"output{jax.tree_util.keystr(path)}", leaf)
            return tuple(leaf for _, leaf in with_paths)

        flat.out_tree = None
        flat.single_tensor = False
        flat.flat_tuple = 0
        return flat

    def _resolve(self, in_tree: Any, in_avals: tuple[Aval, ...], arrays: list[jax.Array]) -> _Signature:
        check_environment()
        # Their training flags count too (NOTE [a graph per training mode]).
        modules = referenced_modules(self.torch_fn)
        # NOTE [recurrent modules without cuDNN]: every run of the function, trial runs too.
        raw = without_cudnn_in_recurrent_forwards(self._raw_fn(in_tree), modules)
        # NOTE [the attention fast path in a function's calls]: every run of it too.
        raw = without_attention_fast_path(raw, modules, self.torch_fn)
        flat = self._flat_fn(raw)
        # Before the runs below, which may register (lazy modules). NOTE [a
        # name rebound after a call]
        structure = StructureSeen(modules, BindingsSeen(self.torch_fn))
        dicts = dicts_named_by(self.torch_fn, modules)  # NOTE [trial runs leave caches as they found them]
        in_names = _input_names(in_tree, len(in_avals))
        if self.output_shapes is not None:
            with_paths, out_tree = jax.tree_util.tree_flatten_with_path(self.output_shapes)
            declared = []
            for path, leaf in with_paths:
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
            inferred_on = inferred_runs = None
            effects = None
        else:
            # NOTE [inference on the call's device] in inference.py
            call_on = torch_device(call_device(arrays))
            try:
                with structure.noting_its_own_bindings():  # NOTE [a submodule switched by its own forward]
                    inferred = infer_outputs(raw, in_avals, self.name, call_on, modules, dicts)
            except InputMutationError as err:
                if err.mutated is None:
                    raise
                where = " (seen while inferring its output shapes)"
                raise InputMutationError(mutation_message(self.name, err.mutated, in_names, where)) from None
            except TorchCallError as err:
                hint = integer_scalars_hint(in_names, in_avals)
                if not hint:
                    raise
                raise TorchCallError(f"{err}{hint}") from err
            inferred_on, inferred_runs = inferred.device, inferred.runs
            effects = inferred.effects
            if effects.writes.closed_over:  # NOTE [a name rebound after a call]: acc = torch.zeros(3) later
                structure.watch_tensor_names(effects.writes.closed_over)
            structure.watch_names_it_rebinds()
            with_paths, out_tree = jax.tree_util.tree_flatten_with_path(inferred.outputs, is_leaf=_is_output_leaf)
            for _ in range(_NESTED_RESULT_CLASSES):  # NOTE [PyTorch's pytree nodes in results]: one level a time
                if not registered_from_torch(leaf for _, leaf in with_paths):
                    break
                with_paths, out_tree = jax.tree_util.tree_flatten_with_path(inferred.outputs, is_leaf=_is_output_leaf)
            declared = []
            for path, leaf in with_paths:
                where = f"output{jax.tree_util.keystr(path)}"
                if not isinstance(leaf, torch.Tensor):
                    raise not_a_tensor(self.name, where, leaf)
                unfit = not_dense(self.name, where, leaf)
                if unfit is not None:
                    raise unfit
                try:
                    dtype = jax_dtype(leaf.dtype)
                except UnsupportedDtypeError as err:
                    raise TorchCallError(f"{self.name}: {where}: {err}") from None
                declared.append((jax.tree_util.keystr(path), tuple(leaf.shape), dtype, leaf.dtype))
            # The inference run saw meta tensors or zeros, not the call's
            # values: a write made only for some values (if (x > 0).any():
            # x.mul_(2)) waits for them. So the first call gets copies too.
            mutation_checked = False
        out_avals = []
        for path, shape, dtype, _ in declared:
            canonical = canonical_jax_dtype(dtype)
            if canonical != dtype:
                _warn_64bit(self.name, f"output{path}", dtype, canonical)
            out_avals.append(Aval(shape, canonical))
        flat.out_tree = out_tree
        flat.single_tensor = out_tree == _ONE_LEAF
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
            inferred_on=inferred_on,
            inferred_runs=inferred_runs,
            autograd_vjp=self.autograd_vjp,
            direct=direct,
            direct_single=direct is not None and flat.single_tensor,
            batch_in_dims=self._batch_in_dims(in_tree, in_avals, out_avals),
            compile=self.compile,
            effects=effects,
            # NOTE [derivatives replay the value's draws]: the effects for
            # the modules' training flags as they are now.
            find_effects=None if effects is None else _effects_finder(raw, in_avals, self.name, call_on, modules, dicts),
        )
        base.referenced_modules = modules  # type: ignore[attr-defined]
        # NOTE [draws the trial runs did not see] in random_state.py
        base.referenced_generators = referenced_generators(self.torch_fn, modules)  # type: ignore[attr-defined]
        base.makes_generators = makes_generators(self.torch_fn, modules)  # type: ignore[attr-defined]
        if self.compile != "eager":  # NOTE [the layouts a graph assumed]
            # Found again by each trace: a notebook binds new weights to the names.
            base.named_tensors = functools.partial(named_tensors, self.torch_fn)  # type: ignore[attr-defined]
        base.structure = structure  # type: ignore[attr-defined]
        base.referenced_dicts = dicts  # type: ignore[attr-defined]
        base.in_names = in_names  # type: ignore[attr-defined]
        return _Signature(base, out_tree)

    def _batch_in_dims(
        self, in_tree: Any, in_avals: tuple[Aval, ...], out_avals: list[Aval]
    ) -> tuple[int | None, ...] | None:
        """BaseFn.batch_in_dims for ``batch_argnums``; checks the leading axes agree."""
        if self.batch_argnums is None:
            return None
        args, _ = jax.tree_util.tree_unflatten(in_tree, range(len(in_avals)))
        shift = self._argnum_shift
        declared = tuple(i - shift for i in self.batch_argnums)
        declared_text = declared[0] if len(declared) == 1 else declared
        after = " after params" if shift else ""
        mapped = set()
        for i in self.batch_argnums:
            if i >= len(args):
                raise ValueError(
                    f"jaxify: batch_argnums names argument {i - shift}, but {self.name} was called with "
                    f"{len(args) - shift} positional argument(s){after}; pass the batched arguments "
                    f"positionally, counting from 0{after}."
                )
            # The flat input positions in it (a flag, NOTE [Python bools are flags], has none).
            mapped.update(k for k in jax.tree_util.tree_leaves(args[i]) if type(k) is int)
        sizes = {in_avals[k].shape[0] if in_avals[k].shape else None for k in mapped}
        sizes |= {a.shape[0] if a.shape else None for a in out_avals}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                f"jaxify: batch_argnums={declared_text} declares that {self.name} maps the leading "
                f"axis of those arguments to the leading axis of every output, but the leading sizes "
                f"are {sorted(sizes, key=str)} (None: a scalar). Declare only arguments and functions "
                f"whose every array and output shares one leading batch axis, or leave batch_argnums out."
            )
        return tuple(0 if k in mapped else None for k in range(len(in_avals)))

    def _signature_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Signature, list[jax.Array]]:
        """The cached (or freshly inferred) signature entry, and flat arrays."""
        self._check_arity(args, kwargs)
        tree = (args, kwargs)
        with_paths, in_tree = jax.tree_util.tree_flatten_with_path(tree)
        flagged = flags_kept(tree, (leaf for _, leaf in with_paths))  # NOTE [Python bools are flags]
        if flagged is not tree:
            with_paths, in_tree = jax.tree_util.tree_flatten_with_path(flagged)
        arrays = [_as_array(path, leaf) for path, leaf in with_paths]
        in_avals = tuple(Aval(tuple(a.shape), np.dtype(a.dtype)) for a in arrays)
        # Output dtypes follow jax_enable_x64 (NOTE [64-bit outputs]): a flag
        # turned on later must not find the 32-bit outputs resolved before.
        key = (in_tree, in_avals, jax.config.jax_enable_x64)
        entry = self._cache.get(key)
        # NOTE [a submodule replaced after a call] in module_structure.py
        if entry is None or not _structure_holds(entry.base):
            with self._lock:
                entry = self._cache.get(key)
                if entry is None or not _structure_holds(entry.base):
                    entry = self._resolved_again(key, entry, in_tree, in_avals, arrays)
                    self._cache[key] = entry
        return entry, arrays

    def _resolved_again(
        self, key: Any, left: _Signature | None, in_tree: Any, in_avals: tuple[Aval, ...], arrays: list[jax.Array]
    ) -> _Signature:
        """The signature of ``key`` for the structure of the modules now: one
        set aside whose structure is back (NOTE [a structure seen before] in
        module_structure.py), else resolved afresh; ``left``, the one whose
        structure changed, is set aside. Called under ``self._lock``."""
        set_aside = self._set_aside.setdefault(key, [])
        entry = next((e for e in set_aside if _structure_holds(e.base, with_its_tensors=True)), None)
        if entry is not None:
            set_aside.remove(entry)
        else:
            entry = self._resolve(in_tree, in_avals, arrays)
            if self.compile != "eager":
                # NOTE [a setting changed every step] in graph_mode.py: a
                # hook or a submodule made anew every step is a new
                # structure, resolved again, every step.
                graph_mode.share_settings_seen(entry.base, self._settings_seen.setdefault(key, {}))
        if left is not None:
            set_aside.insert(0, left)
            for dropped in set_aside[_STRUCTURES_KEPT:]:
                for name, value in _stats_of(_bases_of(dropped)).items():
                    self._dropped_stats[name] += value
            del set_aside[_STRUCTURES_KEPT:]
        return entry

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        entry, arrays = self._signature_for(args, kwargs)
        outs = torch_call(arrays, TorchFn.of(entry.base))
        return jax.tree_util.tree_unflatten(entry.out_tree, outs)

    def clear_cache(self) -> None:
        """Forget this function's inferred signatures: its next call outside a
        compiled program infers (and in graph mode traces) again. A
        ``jax.jit`` compiled before keeps the program, and the graphs, it
        holds; ``t2j_ad.clear_caches`` also clears JAX's caches of such
        programs, for every function."""
        with self._lock:
            self._cache.clear()
            self._set_aside.clear()
            self._settings_seen.clear()
            self._dropped_stats = graph_mode.no_stats()

    def compile_stats(self) -> dict[str, float]:
        """What ``compile="graph"``/``"inductor"`` made so far, over every input
        signature and transform stack: ``graphs`` (traced TorchFns, one per
        setting of the training flags of the modules they run),
        ``eager_fallbacks`` (TorchFns that run eagerly: their trace failed,
        or they replay random draws once per example), ``eager_for_rates``,
        ``eager_for_hooks`` and ``eager_for_submodules`` (how often a
        TorchFn went on eagerly for dropout rates, module hooks, or
        submodules that keep changing, rather than trace each: NOTE [a
        setting changed every step] in graph_mode.py), ``trace_seconds``
        and ``compile_seconds`` (inductor) spent;
        the per-device functions of a sharded ``jax.jit`` included, and those
        made for the structures its modules had before (NOTE [a structure
        seen before] in module_structure.py). ``clear_cache`` starts them
        from zero."""
        entries = [*list(self._cache.values()), *(e for kept in list(self._set_aside.values()) for e in list(kept))]
        dropped = dict(self._dropped_stats)
        counted = _stats_of(b for entry in entries for b in _bases_of(entry))
        return {name: counted[name] + dropped[name] for name in graph_mode.STATS}


# How many resolutions for earlier structures of its modules a jaxified
# function keeps per input signature (NOTE [a structure seen before] in
# module_structure.py): a few, for heads swapped back and forth, since each
# holds its graphs and its programs in JAX's caches.
_STRUCTURES_KEPT = 4


def _bases_of(entry: _Signature) -> list[BaseFn]:
    """The BaseFns of one signature: its own, its keeping and replaying
    variants, and their per-device functions of a sharded ``jax.jit``."""
    family = (entry.base, *replayed_calls.variants(entry.base))
    return [b for base in family for b in (base, *local_bases(base))]


def _stats_of(bases: Iterable[BaseFn]) -> dict[str, float]:
    """``compile_stats()`` of what ``bases`` made: the sum of each one's
    (``graph_mode.stats_of``: its graphs kept and those dropped)."""
    total = graph_mode.no_stats()
    for base in bases:
        for name, value in graph_mode.stats_of(base).items():
            total[name] += value
    return total


def _rebuilt(
    torch_fn: Callable[..., Any],
    vmap_method: str,
    output_shapes: Any,
    autograd_vjp: bool,
    batch_argnums: tuple[int, ...] | None,
    compile: str,
) -> JaxifiedFunction:
    """A ``JaxifiedFunction`` unpickled (``JaxifiedFunction.__reduce__``)."""
    return JaxifiedFunction(
        torch_fn, vmap_method, output_shapes, autograd_vjp=autograd_vjp, batch_argnums=batch_argnums, compile=compile
    )


def check_batch_argnums(batch_argnums: Any) -> tuple[int, ...] | None:
    if batch_argnums is None:
        return None
    nums = (batch_argnums,) if isinstance(batch_argnums, int) else batch_argnums
    valid = lambda i: isinstance(i, int) and not isinstance(i, bool) and i >= 0  # noqa: E731
    if not isinstance(nums, (tuple, list)) or not all(valid(i) for i in nums):
        raise TypeError(
            f"jaxify: batch_argnums must be a non-negative int or a tuple of them "
            f"(positions of the batched arguments), got {batch_argnums!r}."
        )
    return tuple(sorted(set(nums)))


def jaxify(
    torch_fn: Callable[..., Any] | None = None,
    *,
    vmap_method: str = "auto",
    output_shapes: Any = None,
    batch_argnums: int | tuple[int, ...] | None = None,
    compile: str | None = None,
) -> Any:
    """Wrap a PyTorch function as a JAX function.

    ``jaxify(fn)``, ``@jaxify`` or ``@jaxify(vmap_method=...)``. The result
    takes pytrees of JAX arrays (NumPy arrays and Python numbers accepted, as
    0-d arrays; a Python bool is passed to ``fn`` as it is, a flag, each
    value its own signature) and returns the pytree ``fn`` returns, as JAX
    arrays (PyTorch's named result tuples, ``torch.return_types``, keep
    their fields, as do result classes registered with PyTorch's pytrees,
    such as transformers' ``ModelOutput``). It works under
    ``jax.jit`` and every JAX transform (``grad``, ``jacfwd``, ``jacrev``,
    ``hessian``, ``jvp``, ``linearize``, ``vmap``, ``lax.scan``,
    ``checkpoint``), composed to any depth: each derivative or batch is
    computed by PyTorch itself (``torch.func.jvp``, ``torch.func.vjp``,
    ``torch.vmap``).

    Args:
        torch_fn: the PyTorch function: tensors (or pytrees of tensors) in,
            a tensor or a pytree of tensors out. Omit it to get a decorator.
        vmap_method: how a batch reaches PyTorch under ``jax.vmap``:
            ``"expand_dims"`` (one ``torch.vmap`` call, unbatched arguments
            passed once), ``"broadcast_all"`` (one ``torch.vmap`` call, every
            argument batched), ``"sequential"`` (a loop; works for any code)
            or ``"auto"`` (``expand_dims``, falling back to ``sequential``
            with one ``FallbackWarning`` when ``torch.vmap`` refuses).
        output_shapes: a pytree of ``jax.ShapeDtypeStruct`` for the outputs.
            Without it the outputs are inferred once per input signature, on
            PyTorch's ``meta`` device (real calls on zeros, then on ones, if
            an op has no meta kernel).
        batch_argnums: positions of arguments whose leading axis ``fn`` maps
            elementwise: every array in them and every output share one
            leading batch axis, and row i of each output depends only on row
            i of those arguments (the others are shared, e.g. weights). A
            sharded ``jax.jit`` then runs ``fn`` on each device's rows
            instead of gathering the batch (docs/multi-device.md).
        compile: how each derived PyTorch function (the function with its
            transform stack: gradient, batch, ...) runs: ``"eager"`` op by
            op; ``"graph"`` traced once into an aten graph (fake tensors)
            and replayed, as a CUDA graph on GPUs; ``"inductor"`` that graph
            compiled by inductor. Functions that cannot be traced run
            eagerly with one ``FallbackWarning`` (docs/compile-modes.md).
            None (the default) takes ``T2J_AD_COMPILE`` from the
            environment, else ``"eager"``.

    Returns:
        A ``JaxifiedFunction`` (or, without ``torch_fn``, a decorator making one).

    Raises:
        TypeError: ``torch_fn`` is not callable, ``batch_argnums`` is not a
            non-negative int or a tuple of them, or a leaf of
            ``output_shapes`` has no ``.shape`` and ``.dtype``.
        ValueError: ``vmap_method`` is not one of the four methods,
            ``compile`` (or ``T2J_AD_COMPILE``) is not one of the three
            modes, or ``output_shapes`` declares no output (``()``).
    """
    if torch_fn is None:
        return functools.partial(
            jaxify, vmap_method=vmap_method, output_shapes=output_shapes, batch_argnums=batch_argnums, compile=compile
        )
    return JaxifiedFunction(torch_fn, vmap_method, output_shapes, batch_argnums=batch_argnums, compile=compile)


def clear_caches() -> None:
    """Forget every inferred signature, built PyTorch transform and graph,
    and JAX's compilation caches, so memory held for past calls is released.

    Jaxify'd functions keep working: the next call infers and compiles again.
    A program you still hold (``jax.jit(f).lower(x).compile()``), or one
    running on another thread, keeps what it calls and works on; its
    registry entries go when it does (NOTE [registry lifetime] in
    backends/registry.py).
    """
    for f in list(_live_functions):
        f.clear_cache()
    jax.clear_caches()
