"""Hypothesis strategies: argument values in a pair's domain, and stacks of
JAX transforms that apply identically to the PyTorch and the JAX version.

A transform is a frozen dataclass with ``apply(f) -> f'``; every transformed
function keeps the arity of the one it wraps, so transforms stack in any
order. ``grad`` and ``hessian`` need a scalar: they differentiate
``project(f(...))``, a fixed weighted sum of every output leaf (a weighted
sum rather than a plain sum, so ``softmax``, whose entries sum to one, still
has a gradient that says something). ``jvp`` and ``vjp`` push fixed tangents
and cotangents made from the shape alone (``fixed_like``), and ``jet`` fixed
Taylor coefficients the same way (only for pairs whose JAX version
``jax.experimental.jet`` has rules for: ``Pair.jax_jet``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import note
from hypothesis import strategies as st
from jax.experimental.jet import jet

from pairs import PAIRS, Domain, Pair

DTYPES = ("float32", "float64")
VMAP_METHODS = ("auto", "sequential", "expand_dims", "broadcast_all")
BATCH_SIZES = (1, 3)  # small alphabet: see NOTE [small shape alphabet] in pairs.py


def fixed_like(x: Any, salt: float = 0.0) -> jax.Array:
    """A fixed array of ``x``'s shape and dtype with no zero or repeated entries."""
    x = jnp.asarray(x) if not hasattr(x, "shape") else x
    n = int(np.prod(x.shape, dtype=int))
    values = 0.5 + 0.5 * jnp.cos(jnp.arange(n, dtype=x.dtype) * 1.3 + salt)
    return values.reshape(x.shape)


def project(tree: Any) -> jax.Array:
    """A scalar that depends on every entry of every leaf of ``tree``."""
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(jnp.sum(leaf * fixed_like(leaf, salt=i)) for i, leaf in enumerate(leaves))


def _with_arg(f: Callable[..., Any], args: Sequence[Any], k: int) -> Callable[[Any], Any]:
    """``f`` as a function of argument ``k`` alone."""

    def g(x: Any) -> Any:
        return f(*args[:k], x, *args[k + 1 :])

    return g


# -- transforms ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Jit:
    order = 0

    def apply(self, f: Callable[..., Any]) -> Callable[..., Any]:
        return jax.jit(f)

    def __repr__(self) -> str:
        return "jit"


@dataclasses.dataclass(frozen=True)
class Grad:
    argnum: int
    order = 1

    def apply(self, f: Callable[..., Any]) -> Callable[..., Any]:
        return jax.grad(lambda *a: project(f(*a)), argnums=self.argnum)

    def __repr__(self) -> str:
        return f"grad(argnums={self.argnum})"


@dataclasses.dataclass(frozen=True)
class Hessian:
    argnum: int
    order = 2

    def apply(self, f: Callable[..., Any]) -> Callable[..., Any]:
        return jax.hessian(lambda *a: project(f(*a)), argnums=self.argnum)

    def __repr__(self) -> str:
        return f"hessian(argnums={self.argnum})"


@dataclasses.dataclass(frozen=True)
class Jacfwd:
    argnum: int
    order = 1

    def apply(self, f: Callable[..., Any]) -> Callable[..., Any]:
        return jax.jacfwd(f, argnums=self.argnum)

    def __repr__(self) -> str:
        return f"jacfwd(argnums={self.argnum})"


@dataclasses.dataclass(frozen=True)
class Jacrev:
    argnum: int
    order = 1

    def apply(self, f: Callable[..., Any]) -> Callable[..., Any]:
        return jax.jacrev(f, argnums=self.argnum)

    def __repr__(self) -> str:
        return f"jacrev(argnums={self.argnum})"


@dataclasses.dataclass(frozen=True)
class Jvp:
    argnum: int
    order = 1

    def apply(self, f: Callable[..., Any]) -> Callable[..., Any]:
        k = self.argnum

        def jvp_of_f(*args: Any) -> Any:
            x = args[k]
            return jax.jvp(_with_arg(f, args, k), (x,), (fixed_like(x, salt=0.3),))

        return jvp_of_f

    def __repr__(self) -> str:
        return f"jvp(argnums={self.argnum})"


@dataclasses.dataclass(frozen=True)
class Vjp:
    argnum: int
    order = 1

    def apply(self, f: Callable[..., Any]) -> Callable[..., Any]:
        k = self.argnum

        def vjp_of_f(*args: Any) -> Any:
            out, pullback = jax.vjp(_with_arg(f, args, k), args[k])
            (cotangent,) = pullback(jax.tree_util.tree_map(lambda o: fixed_like(o, salt=0.7), out))
            return cotangent

        return vjp_of_f

    def __repr__(self) -> str:
        return f"vjp(argnums={self.argnum})"


@dataclasses.dataclass(frozen=True)
class Jet:
    """Taylor mode: ``jax.experimental.jet`` of order ``order`` along fixed
    input coefficients of argument ``argnum``."""

    argnum: int
    order: int

    def apply(self, f: Callable[..., Any]) -> Callable[..., Any]:
        k, order = self.argnum, self.order

        def jet_of_f(*args: Any) -> Any:
            x = args[k]
            coefficients = tuple(fixed_like(x, salt=0.2 * (i + 1)) for i in range(order))
            return jet(_with_arg(f, args, k), (x,), (coefficients,))

        return jet_of_f

    def __repr__(self) -> str:
        return f"jet(argnums={self.argnum}, order={self.order})"


@dataclasses.dataclass(frozen=True)
class Vmap:
    in_axes: tuple[int | None, ...]
    size: int
    order = 0

    def apply(self, f: Callable[..., Any]) -> Callable[..., Any]:
        return jax.vmap(f, in_axes=self.in_axes)

    def batched_shapes(self, shapes: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
        """The argument shapes of the vmapped function."""
        out = []
        for shape, axis in zip(shapes, self.in_axes):
            if axis is None:
                out.append(tuple(shape))
            else:
                s = list(shape)
                s.insert(axis % (len(shape) + 1), self.size)
                out.append(tuple(s))
        return tuple(out)

    def __repr__(self) -> str:
        return f"vmap(in_axes={self.in_axes}, size={self.size})"


Transform = Any  # one of the dataclasses above


def apply_stack(f: Callable[..., Any], stack: Sequence[Transform]) -> Callable[..., Any]:
    """``stack[-1](...stack[1](stack[0](f)))``: the first transform is innermost."""
    for t in stack:
        f = t.apply(f)
    return f


def stack_shapes(shapes: Sequence[tuple[int, ...]], stack: Sequence[Transform]) -> tuple[tuple[int, ...], ...]:
    """The argument shapes the fully transformed function takes."""
    shapes = tuple(tuple(s) for s in shapes)
    for t in stack:
        if isinstance(t, Vmap):
            shapes = t.batched_shapes(shapes)
    return shapes


def derivative_order(stack: Sequence[Transform]) -> int:
    return sum(t.order for t in stack)


def forward_free(stack: Sequence[Transform]) -> bool:
    """Whether no transform of ``stack`` runs PyTorch's forward mode."""
    return not any(isinstance(t, (Jvp, Jacfwd, Hessian, Jet)) for t in stack)


def vmap_over_forward_mode(stack: Sequence[Transform]) -> bool:
    """Whether a ``Vmap`` of ``stack`` batches a forward-mode transform under it."""
    return any(isinstance(t, Vmap) and not forward_free(stack[:i]) for i, t in enumerate(stack))


def vmap_levels(stack: Sequence[Transform]) -> int:
    """How many vmaps ``stack`` hands PyTorch: its ``Vmap``s, and the one each
    Jacobian batches its basis with (two for a Hessian)."""
    return sum(2 if isinstance(t, Hessian) else 1 for t in stack if isinstance(t, (Vmap, Jacfwd, Jacrev, Hessian)))


def vmap_methods_for(pair: Pair, stack: Sequence[Transform]) -> tuple[str, ...]:
    """The vmap methods whose results ``pair`` under ``stack`` can be held to:
    all of them, less those a known PyTorch batching bug gets wrong
    (``Pair.batchable_jvp``, ``Pair.vmap_across_levels``)."""
    methods = VMAP_METHODS
    if not pair.batchable_jvp and vmap_over_forward_mode(stack):
        methods = tuple(m for m in methods if m not in ("auto", "expand_dims"))
    if not pair.vmap_across_levels and vmap_levels(stack) >= 2:
        methods = tuple(m for m in methods if m != "expand_dims")
    return methods


# -- strategies ------------------------------------------------------------------


@st.composite
def in_axes(draw: st.DrawFn, shapes: Sequence[tuple[int, ...]]) -> tuple[int | None, ...]:
    """One batch axis (or None) per argument, at least one not None; negative
    axes included."""
    axes = []
    for shape in shapes:
        n = len(shape)
        axes.append(draw(st.one_of(st.none(), st.integers(-(n + 1), n))))
    if all(a is None for a in axes):
        k = draw(st.integers(0, len(shapes) - 1))
        axes[k] = 0
    return tuple(axes)


@st.composite
def transform_stacks(
    draw: st.DrawFn,
    pair: Pair,
    shapes: Sequence[tuple[int, ...]],
    *,
    min_len: int = 1,
    max_len: int = 3,
    max_order: int = 4,
) -> tuple[Transform, ...]:
    """``min_len`` to ``max_len`` transforms in random order, total derivative
    order at most ``max_order`` (each extra order multiplies the PyTorch work)."""
    n = draw(st.integers(min_len, max_len))
    stack: list[Transform] = []
    current = tuple(shapes)
    argnums = st.sampled_from(pair.float_args)
    for _ in range(n):
        budget = max_order - derivative_order(stack)
        if not (pair.differentiable_jvp or forward_free(stack)):
            budget = 0  # nothing differentiates PyTorch's forward-mode formula
        kinds = ["jit", "vmap"] + (["grad", "jacfwd", "jacrev", "jvp", "vjp"] if budget >= 1 else [])
        kinds += ["hessian"] if budget >= 2 else []
        kinds += ["jet"] if budget >= 1 and pair.jax_jet else []
        kind = draw(st.sampled_from(kinds))
        if kind == "jit":
            t: Transform = Jit()
        elif kind == "vmap":
            t = Vmap(draw(in_axes(current)), draw(st.sampled_from(BATCH_SIZES)))
            current = t.batched_shapes(current)
        elif kind == "jet":
            # Orders past the first differentiate PyTorch's forward-mode formula.
            highest = min(budget, 3) if pair.differentiable_jvp else 1
            t = Jet(draw(argnums), draw(st.integers(1, highest)))
        else:
            cls = {"grad": Grad, "hessian": Hessian, "jacfwd": Jacfwd, "jacrev": Jacrev, "jvp": Jvp, "vjp": Vjp}[kind]
            t = cls(draw(argnums))
        stack.append(t)
    return tuple(stack)


def _elements(domain: Domain, dtype: str) -> st.SearchStrategy[Any]:
    if domain.integer:
        return st.integers(int(domain.lo), int(domain.hi))
    width = 32 if dtype == "float32" else 64
    values = st.floats(domain.lo, domain.hi, width=width, allow_nan=False, allow_infinity=False)
    if domain.avoid:
        values = values.filter(lambda v: all(abs(v - a) > domain.margin for a in domain.avoid))
    return values


def arrays(domain: Domain, dtype: str, shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    """Arrays of ``shape`` with values in ``domain``; int32 for integer domains."""
    np_dtype = np.int32 if domain.integer else np.dtype(dtype)
    return hnp.arrays(np_dtype, shape, elements=_elements(domain, dtype))


@st.composite
def argument_values(draw: st.DrawFn, pair: Pair, dtype: str, shapes: Sequence[tuple[int, ...]]) -> tuple[np.ndarray, ...]:
    return tuple(draw(arrays(d, dtype, s)) for d, s in zip(pair.domains, shapes))


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn example: what Hypothesis prints when a property fails."""

    pair: Pair
    dtype: str
    base_shapes: tuple[tuple[int, ...], ...]
    stack: tuple[Transform, ...]
    vmap_method: str
    args: tuple[np.ndarray, ...] = dataclasses.field(compare=False)

    def __repr__(self) -> str:
        args = ", ".join(np.array2string(a, precision=17, separator=", ") for a in self.args)
        return (
            f"Case(pair={self.pair.name}, dtype={self.dtype}, shapes={self.base_shapes}, "
            f"stack={list(self.stack)}, vmap_method={self.vmap_method!r}, args=({args}))"
        )


@st.composite
def cases(
    draw: st.DrawFn,
    pair: Pair | None = None,
    *,
    min_len: int = 1,
    max_len: int = 3,
    max_order: int = 4,
    outer_vmap: bool = False,
    extra_order: int = 0,
) -> Case:
    """A pair's arguments (any pair's, if None) with a transform stack, a
    dtype and a vmap method. ``outer_vmap`` puts a ``Vmap`` last in the stack;
    ``extra_order`` is the derivative order the test adds on top, kept within
    ``pair.max_order``."""
    if pair is None:
        pair = draw(st.sampled_from(PAIRS))
    max_order = min(max_order, pair.max_order - extra_order)
    dtype = draw(st.sampled_from(DTYPES))
    shapes = draw(st.sampled_from(pair.shapes))
    stack = draw(transform_stacks(pair, shapes, min_len=min_len, max_len=max_len, max_order=max_order))
    if extra_order and not pair.differentiable_jvp:
        # The test differentiates the stack again (see Pair.differentiable_jvp).
        stack = tuple(t for t in stack if forward_free((t,)))
    if outer_vmap:
        inner_shapes = stack_shapes(shapes, stack)
        stack = stack + (Vmap(draw(in_axes(inner_shapes)), draw(st.sampled_from(BATCH_SIZES))),)
    method = draw(st.sampled_from(vmap_methods_for(pair, stack)))
    args = draw(argument_values(pair, dtype, stack_shapes(shapes, stack)))
    return Case(pair, dtype, tuple(shapes), stack, method, args)


@functools.lru_cache(maxsize=None)
def transformed(f: Callable[..., Any], stack: tuple[Transform, ...]) -> Callable[..., Any]:
    """``apply_stack`` cached, so a repeated stack (while shrinking) reuses jit's cache."""
    return apply_stack(f, stack)


# Examples executed in this process, by every property test (see
# NOTE [counting examples] in conftest.py).
_examples_run = 0


def examples_run() -> int:
    return _examples_run


def note_reproduction() -> None:
    """Count one executed example, and print, with a failing example, the
    command that reruns it. Every property test calls this first."""
    global _examples_run
    _examples_run += 1
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    profile = os.environ.get("T2J_AD_HYPOTHESIS_PROFILE", "ci")
    note(
        f"reproduce: T2J_AD_HYPOTHESIS_PROFILE={profile} python -m pytest '{test}'  "
        f"(ci is derandomized and reruns the same examples; for a 'long' failure "
        f"add the printed @reproduce_failure(...) decorator to the test)"
    )
