"""TorchFn: a flat PyTorch callable plus a hashable tuple of transforms.

NOTE [every derivative is a PyTorch function]
A jaxify'd function reaches JAX as one primitive, ``torch_call``, whose only
parameter is a ``TorchFn``. The JVP, transpose and batching rules never run
PyTorch themselves: they bind ``torch_call`` again with one more transform
appended (``Jvp``, ``Vjp`` or ``Vmap``). At run time ``build`` (transforms.py)
turns the tuple into one PyTorch callable by applying ``torch.func.jvp``, ``torch.func.vjp``
and ``torch.vmap`` in order (the last two entered at functorch's C++ levels
directly; NOTE [functorch levels]). Because the derived function is again a
``TorchFn``, the rules apply to it again, so derivatives and batches compose
to any depth without a ``depth`` parameter.

Everything here is hashable and equal by value, so retracing the same program
produces equal primitive parameters and hits jit's caches (STYLE.md item 5).
The user's callable itself is wrapped in ``BaseFn``, equal by identity.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Union

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Aval:
    """Shape and dtype of one flat input or output."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def is_inexact(self) -> bool:
        # jax.dtypes knows the ml_dtypes floats (bfloat16, the float8 formats) NumPy does not.
        return jax.dtypes.issubdtype(self.dtype, np.inexact)

    @property
    def is_complex(self) -> bool:
        return np.issubdtype(self.dtype, np.complexfloating)

    def batched(self, axis_size: int, dim: int | None) -> Aval:
        if dim is None:
            return self
        shape = list(self.shape)
        shape.insert(dim, axis_size)
        return Aval(tuple(shape), self.dtype)


@dataclasses.dataclass(frozen=True)
class Jvp:
    """Forward mode. Inputs: primals, then one tangent per ``wrt`` input.
    Outputs: the tangents of the ``out`` outputs."""

    wrt: tuple[int, ...]
    out: tuple[int, ...]

    def avals(self, ins: tuple[Aval, ...], outs: tuple[Aval, ...]):
        return ins + tuple(ins[i] for i in self.wrt), tuple(outs[j] for j in self.out)


@dataclasses.dataclass(frozen=True)
class Vjp:
    """Reverse mode. Inputs: primals, then one cotangent per ``out`` output.
    Outputs: the cotangents of the ``wrt`` inputs."""

    wrt: tuple[int, ...]
    out: tuple[int, ...]

    def avals(self, ins: tuple[Aval, ...], outs: tuple[Aval, ...]):
        return ins + tuple(outs[j] for j in self.out), tuple(ins[i] for i in self.wrt)


@dataclasses.dataclass(frozen=True)
class Vmap:
    """Batching. ``in_dims[i]`` is input i's batch dimension (None: unbatched).
    Every output gets its batch dimension at 0. ``method`` is one of
    ``VMAP_METHODS``."""

    in_dims: tuple[int | None, ...]
    axis_size: int
    method: str

    def avals(self, ins: tuple[Aval, ...], outs: tuple[Aval, ...]):
        # ins are the *unbatched* avals of the function being vmapped.
        batched_ins = tuple(a.batched(self.axis_size, d) for a, d in zip(ins, self.in_dims))
        return batched_ins, tuple(a.batched(self.axis_size, 0) for a in outs)


Transform = Union[Jvp, Vjp, Vmap]
VMAP_METHODS = ("sequential", "expand_dims", "broadcast_all", "auto")


class BaseFn:
    """The user's PyTorch function, flattened: tensors in, tuple of tensors out.

    Equal by identity: one per jaxify'd function and input signature.
    """

    def __init__(
        self,
        fn: Callable[..., tuple[Any, ...]],
        *,
        name: str,
        vmap_method: str,
        in_avals: tuple[Aval, ...],
        out_avals: tuple[Aval, ...],
        out_names: tuple[str, ...],
        torch_out_dtypes: tuple[Any, ...],
        mutation_checked: bool,
        inferred_on: Any = None,
        inferred_runs: str | None = None,
        autograd_vjp: bool = False,
        direct: Callable[..., Any] | None = None,
        direct_single: bool = False,
        batch_in_dims: tuple[int | None, ...] | None = None,
        compile: str = "eager",
        effects: Any = None,
        find_effects: Callable[[], Any] | None = None,
    ):
        self.fn = fn
        # How each TorchFn of this function runs: "eager", "graph" or
        # "inductor" (NOTE [graph mode] in graph_mode.py).
        self.compile = compile
        # The user's function itself, when it takes the flat tensors
        # positionally and returns them flat: one tensor (``direct_single``)
        # or a tuple of tensors. The runtime calls it directly for plain calls,
        # skipping ``fn``'s frame (it checks the results itself); None when
        # ``fn`` has to rebuild arguments or flatten results.
        self.direct = direct
        self.direct_single = direct_single
        self.name = name
        self.vmap_method = vmap_method
        self.in_avals = in_avals
        self.out_avals = out_avals
        # Human-readable key path of each flat output, for error messages.
        self.out_names = out_names
        # The dtype PyTorch returns for each output (may be 64-bit where JAX
        # runs in 32-bit mode; see NOTE [64-bit outputs] in api.py).
        self.torch_out_dtypes = torch_out_dtypes
        # False until one run has shown the function leaves its inputs alone;
        # until then the runtime hands it copies (see runtime.py).
        self.mutation_checked = mutation_checked
        # True once a call kept one of its inputs on a PyTorch that cannot
        # move it (NOTE [inputs kept past a call] in kept_inputs.py), or by
        # its address (NOTE [inputs kept by their address]): from then on
        # the runtime hands it copies.
        self.keeps_inputs = False
        # How many of its calls that kept an input were looked at for what
        # holds the input's address (NOTE [inputs kept by their address]).
        self.keeping_calls_looked_into = 0
        # Where out_avals were inferred: torch.device("meta"), the device of
        # the zeros, or None when output_shapes declared them (the runtime's
        # shape and dtype errors say which, and what to do).
        self.inferred_on = inferred_on
        # The real calls that inferred them there ("on zeros and on ones", or
        # "on ones alone ..."), where inferred_on is a real device.
        self.inferred_runs = inferred_runs
        # Reverse mode by torch.autograd.grad from the start, never trying
        # torch.func.vjp (see NOTE [fallbacks] in rules/fallbacks.py).
        self.autograd_vjp = autograd_vjp
        # Declared batch-mapped (jaxify's batch_argnums): 0 for each flat
        # input whose leading axis the function maps elementwise, None for the
        # others; None when not declared. Every output is mapped at axis 0.
        # (NOTE [partitioning torch_call] in rules/partitioning.py.)
        self.batch_in_dims = batch_in_dims
        # What the function does besides computing its outputs (draws
        # random numbers, writes state it keeps), as its shape inference saw
        # (a replayed_calls.Effects); None when output_shapes skipped that
        # run. ``find_effects`` runs another trial run for the modules'
        # training flags as they are now (NOTE [derivatives replay the
        # value's draws] in replayed_calls.py).
        self.effects = effects
        self.find_effects = find_effects
        # A context manager each call of this function runs in, or None:
        # the lock and the put-back of writes of replayed calls.
        self.call_effects: Callable[[], Any] | None = None
        # By transforms; a second-order chain's key starts with a mark (transforms.build).
        self.built: dict[tuple[Any, ...], Callable[..., tuple[Any, ...]]] = {}
        self.lock = threading.Lock()

    def with_leading_size(self, size: int) -> BaseFn:
        """A new BaseFn of the same function on ``size`` rows of its mapped axis."""
        local = copy.copy(self)
        local.in_avals = tuple(
            a if d is None else Aval((size,) + a.shape[1:], a.dtype) for a, d in zip(self.in_avals, self.batch_in_dims)
        )
        local.out_avals = tuple(Aval((size,) + a.shape[1:], a.dtype) for a in self.out_avals)
        # What was built or traced for the other avals does not carry over
        # (the traced graphs: NOTE [graph mode] in graph_mode.py).
        local.built = {}
        local.__dict__.pop("graphs", None)
        # Its own counts of graphs dropped and of eager runs for settings,
        # not self's, which compile_stats() would count twice; its own
        # settings seen (NOTE [how many graphs a function keeps], NOTE [a
        # setting changed every step] in graph_mode.py).
        local.__dict__.pop("counted", None)
        local.__dict__.pop("settings_seen", None)
        local.__dict__.pop("graph_lock", None)
        # Nor do the functions that keep and replay its calls (NOTE
        # [derivatives replay the value's draws] in replayed_calls.py).
        local.__dict__.pop("replayed_calls", None)
        local.lock = threading.Lock()
        return local

    def __repr__(self) -> str:
        return f"BaseFn({self.name})"


@dataclasses.dataclass(frozen=True)
class TorchFn:
    """``base`` with ``transforms`` applied in order; avals of the result.

    ``checks_effects``: the value call of a derivative, which the runtime
    refuses before it runs where the function now draws or updates state
    other than when the JVP rule bound it (NOTE [a value call checked
    before it runs] in replayed_calls.py); kept by the ``Vmap``s appended
    to it, not by derivatives (those check anyway).
    """

    base: BaseFn
    transforms: tuple[Transform, ...]
    in_avals: tuple[Aval, ...]
    out_avals: tuple[Aval, ...]
    checks_effects: bool = False

    @classmethod
    def of(cls, base: BaseFn) -> TorchFn:
        return cls(base, (), base.in_avals, base.out_avals)

    def append(self, transform: Transform) -> TorchFn:
        ins, outs = transform.avals(self.in_avals, self.out_avals)
        checks = self.checks_effects and isinstance(transform, Vmap)
        return TorchFn(self.base, self.transforms + (transform,), ins, outs, checks)

    def checking_effects(self) -> TorchFn:
        """This function as the value call of a derivative (``checks_effects``)."""
        return dataclasses.replace(self, checks_effects=True)

    def parent(self) -> TorchFn:
        """This function without its last transform."""
        fun = TorchFn(self.base, (), self.base.in_avals, self.base.out_avals, self.checks_effects)
        for t in self.transforms[:-1]:
            fun = fun.append(t)
        return fun

    @property
    def name(self) -> str:
        if not self.transforms:
            return self.base.name
        inner = self.base.name
        for t in self.transforms:
            inner = f"{type(t).__name__.lower()}({inner})"
        return inner
