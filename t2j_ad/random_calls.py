"""The derivatives of a function that draws random numbers replay the draws
of its value.

NOTE [derivatives replay the value's draws]
A derivative is a PyTorch call of its own (NOTE [every derivative is a
PyTorch function]) that runs the function's forward again. For a function
that draws random numbers (dropout), the second forward drew new numbers:
``jax.grad`` of a loss that needs the value (a sum of squares) seeded the
gradient with one dropout mask and pulled it back through another, so the
gradient was that of no mask at all (with ``p=0.5``, half the true one on
average), and ``jax.value_and_grad`` or ``jax.jvp`` paired a value with the
derivative of another draw. ``torch.utils.checkpoint`` meets the same
problem in its recompute, and restores the random state for it.

So the JVP rule of such a function (``draws_random``: a random op ran when
its outputs were inferred; a function whose ``output_shapes`` skipped that
run is not known to draw, and keeps the old behaviour) binds two other
functions of the same base:

- ``keeping_state``: the function, returning also the state of the call
  device's generator *before* it ran, as bytes (``STATE_BYTES``, the CPU
  generator's size; a CUDA generator's 16 bytes are zero-padded). It draws
  from PyTorch's global generator as the function itself does, so the
  numbers after a given ``torch.manual_seed`` are PyTorch's.
- ``replaying_state``: the function with that state as one more input,
  after its own: it sets the generator to the state, runs, and puts the
  generator back, so it draws the value's numbers and leaves the global
  sequence where the value call left it. Deterministic, so derivatives of
  it (its Jvp, the transpose's Vjp, a Hessian's Jvp of that Vjp) take the
  ordinary rules and all replay the same draws.

The JVP rule of ``keeping_state`` itself (an outer derivative over the value
call) maps back to the same pair. Both run eagerly in every compile mode,
with one ``FallbackWarning`` in graph mode: a graph would keep the generator
state it read while tracing. Batched (``jax.vmap``), the state is batched
too, one per example, in the loop that random ops need under ``jax.vmap``.
Tensors updated in place (running statistics) are still updated once per
call: docs/transforms.md says so. Calls of either kind hold one process-wide
lock: a replaying call sets the generator every thread draws from, so a
value call on another thread (a pmap over CPU devices) would otherwise draw
the replayed numbers, or have its own draws undone when the replay puts the
generator back.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from .functorch_levels import outside_transforms, wrapped_by_a_transform
from .torch_fn import Aval, BaseFn

# The CPU generator's state (mt19937), the largest a generator has.
STATE_BYTES = int(torch.default_generator.get_state().numel())
_STATE_AVAL = Aval((STATE_BYTES,), np.dtype(np.uint8))
# Held by every keeping and replaying call (NOTE [derivatives replay the
# value's draws]); reentrant, for a call that reaches another on its thread.
_generator_lock = threading.RLock()


def draws_random(base: BaseFn) -> bool:
    """Whether ``base`` draws random numbers, as its shape inference saw.
    False when ``output_shapes`` skipped inference: the function is then
    never run to learn anything (as torch2jax promises), so its derivatives
    draw again, as before."""
    return bool(base.draws_random)


def _generator(inputs: Sequence[torch.Tensor]) -> torch.Generator:
    """The default generator of the call's device (the first input's)."""
    device = inputs[0].device if inputs else torch.device("cpu")
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else 0]
    return torch.default_generator


def _variant(base: BaseFn, fn, *, in_avals, out_avals, out_names, torch_out_dtypes) -> BaseFn:  # noqa: ANN001
    variant = BaseFn(
        fn,
        name=base.name,
        vmap_method=base.vmap_method,
        in_avals=in_avals,
        out_avals=out_avals,
        out_names=out_names,
        torch_out_dtypes=torch_out_dtypes,
        mutation_checked=base.mutation_checked,
        inferred_on=base.inferred_on,
        autograd_vjp=base.autograd_vjp,
        compile="eager",  # a graph would keep the state it read while tracing
    )
    variant.random_root = base  # type: ignore[attr-defined]
    return variant


def _made_once(base: BaseFn, key: str, make) -> BaseFn:  # noqa: ANN001
    """The variant ``make(root)`` of ``base``'s root function, cached there under ``key``."""
    root = getattr(base, "random_root", base)
    made = root.__dict__.get(key)
    if made is None:
        made = root.__dict__.setdefault(key, make(root))
    return made


def keeping_state(base: BaseFn) -> BaseFn:
    """``base``, returning also its device generator's state from before it
    ran (NOTE [derivatives replay the value's draws]); made once."""
    return _made_once(base, "keeping_state", _keeping_state)


def replaying_state(base: BaseFn) -> BaseFn:
    """``base`` with a generator state as one more input, run from that
    state (NOTE [derivatives replay the value's draws]); made once."""
    return _made_once(base, "replaying_state", _replaying_state)


def _keeping_state(base: BaseFn) -> BaseFn:
    fn = base.fn

    def keeping(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with _generator_lock:
            with outside_transforms():  # bytes, whatever transforms this call runs under
                state = _generator(inputs).get_state()
                kept = torch.zeros(STATE_BYTES, dtype=torch.uint8)
                kept[: state.numel()] = state
                kept = kept.to(inputs[0].device if inputs else kept.device)
            return (*fn(*inputs), kept)

    made = _variant(
        base,
        keeping,
        in_avals=base.in_avals,
        out_avals=base.out_avals + (_STATE_AVAL,),
        out_names=base.out_names + ("the random state",),
        torch_out_dtypes=base.torch_out_dtypes + (torch.uint8,),
    )
    made.draws_random = True
    return made


def _replaying_state(base: BaseFn) -> BaseFn:
    fn = base.fn

    def replaying(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        *args, state = inputs
        if wrapped_by_a_transform(state):
            # One state per example: torch.vmap would batch it (random ops
            # refuse torch.vmap anyway), so vmap_method="auto" loops.
            raise RuntimeError(
                f"{base.name} draws random numbers, which torch.vmap refuses; "
                f"vmap_method='sequential' runs one example at a time"
            )
        generator = _generator(args)
        with _generator_lock:
            now = generator.get_state()
            with outside_transforms():  # a slice and a copy: plain tensors inside transforms too
                # A fresh copy: set_state reads a tensor with a storage offset
                # (one example's row of a batch) from the wrong place, or crashes.
                generator.set_state(state[: now.numel()].to("cpu", copy=True))
            try:
                return fn(*args)
            finally:
                generator.set_state(now)

    made = _variant(
        base,
        replaying,
        in_avals=base.in_avals + (_STATE_AVAL,),
        out_avals=base.out_avals,
        out_names=base.out_names,
        torch_out_dtypes=base.torch_out_dtypes,
    )
    made.draws_random = False  # deterministic given its state
    return made
