"""JVP: the primal by torch_call, the tangent by torch_call with Jvp appended.

The tangent call is linear in its tangent inputs, so JAX's partial evaluation
splits it off cleanly and transpose.py can turn it into a Vjp call: reverse
mode is JAX's own linearize-then-transpose. A function that draws random
numbers, or updates state it keeps, binds instead a primal call that also
returns a token (the generator state and the kept state it started from) and
a tangent call that replays it (NOTE [derivatives replay the value's draws]
in replayed_calls.py).

NOTE [a call linear in its tangents]
A Jvp call is linear in its tangent inputs, and a Vjp call in its
cotangent inputs. Where every tangent JAX brings to such a call is on
those inputs (``jax.jacobian`` of ``t -> jvp(f, (x,), (t,))``: the
``tangent_solve`` of ``lax.custom_root``; forward mode through a
``vjp`` function alone), the tangent of its outputs is the same call
with those tangents in their place: one call of the same order, not the
order above. It also depends on the primals only, not on the point the
linear inputs had: ``lax.custom_root``'s reverse mode failed in JAX
("open an issue") because the matrix its ``tangent_solve`` computed
depended, through the call, on the right-hand side being transposed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from ..primitive import torch_call
from ..replayed_calls import Effects, effects, effects_watched, keeping_and_replaying
from ..torch_fn import Jvp, TorchFn, Vjp, Vmap


def torch_call_jvp(
    primals: Sequence[Any], tangents: Sequence[Any | None], *, fun: TorchFn
) -> tuple[list[Any], list[Any | None]]:
    seen = effects(fun.base) if all(type(t) is Vmap for t in fun.transforms) else None
    if seen:
        return _jvp_replaying(primals, tangents, fun, seen)
    # NOTE [a value call checked before it runs] in replayed_calls.py
    value = fun.checking_effects() if seen is not None and effects_watched(fun.base) else fun
    return torch_call(primals, value), _tangents(primals, tangents, fun)


def _tangents(primals: Sequence[Any], tangents: Sequence[Any | None], fun: TorchFn) -> list[Any | None]:
    """The tangents of ``fun``'s outputs at ``primals``, by ``fun`` with Jvp appended."""
    # Symbolic zeros (None) and non-float inputs are closed over, not
    # differentiated; integer and bool outputs get float0 zeros.
    wrt = tuple(i for i, t in enumerate(tangents) if t is not None and fun.in_avals[i].is_inexact)
    out = tuple(j for j, a in enumerate(fun.out_avals) if a.is_inexact)
    out_tangents: list[Any | None] = [None] * len(fun.out_avals)
    if not wrt or not out:
        return out_tangents
    n = _linear_after(fun)
    if n is not None and min(wrt) >= n:
        # NOTE [a call linear in its tangents]
        filled = [
            t if t is not None else jnp.zeros(a.shape, a.dtype)
            for t, a in zip(tangents[n:], fun.in_avals[n:])
        ]
        computed = torch_call(list(primals[:n]) + filled, fun)
        computed = [computed[j] for j in out]
    else:
        computed = torch_call(list(primals) + [tangents[i] for i in wrt], fun.append(Jvp(wrt, out)))
    for j, t in zip(out, computed):
        out_tangents[j] = t
    return out_tangents


def _linear_after(fun: TorchFn) -> int | None:
    """How many inputs ``fun``'s last transform's parent has, where that
    transform makes it linear in the inputs after them (Jvp: in its
    tangents; Vjp: in its cotangents); None for any other function."""
    if fun.transforms and isinstance(fun.transforms[-1], (Jvp, Vjp)):
        return len(fun.parent().in_avals)
    return None


def _jvp_replaying(
    primals: Sequence[Any], tangents: Sequence[Any | None], fun: TorchFn, seen: Effects
) -> tuple[list[Any], list[Any | None]]:
    """NOTE [derivatives replay the value's draws]: the value call returns a
    token (the generator state and the kept state it started from), and the
    tangent call replays it. ``fun`` is the function batched by ``jax.vmap`` (its
    transforms are Vmaps), and may itself be such a value call (an outer
    derivative over it), whose outputs end with the token."""
    keeping, replaying = keeping_and_replaying(fun.base, seen)
    kept, replayed = TorchFn.of(keeping), TorchFn.of(replaying)
    for vmap in fun.transforms:  # the token is batched, one per example
        kept = kept.append(vmap)
        replayed = replayed.append(Vmap(vmap.in_dims + (0,), vmap.axis_size, vmap.method))
    *outs, token = torch_call(primals, kept)
    out_tangents = _tangents([*primals, token], [*tangents, None], replayed)
    if fun.base is keeping:
        outs.append(token)
        out_tangents.append(None)  # an integer output: float0 zeros
    return outs, out_tangents
