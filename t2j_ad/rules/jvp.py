"""JVP: the primal by torch_call, the tangent by torch_call with Jvp appended.

The tangent call is linear in its tangent inputs, so JAX's partial evaluation
splits it off cleanly and transpose.py can turn it into a Vjp call: reverse
mode is JAX's own linearize-then-transpose. A function that draws random
numbers binds instead a primal call that also returns the generator state it
started from, and a tangent call that replays that state (NOTE [derivatives
replay the value's draws] in random_calls.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..primitive import torch_call
from ..random_calls import draws_random, keeping_state, replaying_state
from ..torch_fn import Jvp, TorchFn
from .fallbacks import warn_once


def torch_call_jvp(
    primals: Sequence[Any], tangents: Sequence[Any | None], *, fun: TorchFn
) -> tuple[list[Any], list[Any | None]]:
    if not fun.transforms and draws_random(fun.base):
        if fun.base.compile != "eager":
            warn_once(
                fun.base,
                "random derivatives",
                f"t2j_ad: compile={fun.base.compile!r}: the derivatives of {fun.base.name!r}, and the value call "
                f"they start from, run eagerly: it draws random numbers, and its derivatives replay the value "
                f"call's draws by setting PyTorch's generator, which a graph cannot do. Results are exact; only "
                f"speed differs. Pass the randomness in as an input (a dropout mask) to keep the graph.",
            )
        return _jvp_replaying_draws(primals, tangents, fun)
    return torch_call(primals, fun), _tangents(primals, tangents, fun)


def _tangents(primals: Sequence[Any], tangents: Sequence[Any | None], fun: TorchFn) -> list[Any | None]:
    """The tangents of ``fun``'s outputs at ``primals``, by ``fun`` with Jvp appended."""
    # Symbolic zeros (None) and non-float inputs are closed over, not
    # differentiated; integer and bool outputs get float0 zeros.
    wrt = tuple(i for i, t in enumerate(tangents) if t is not None and fun.in_avals[i].is_inexact)
    out = tuple(j for j, a in enumerate(fun.out_avals) if a.is_inexact)
    out_tangents: list[Any | None] = [None] * len(fun.out_avals)
    if not wrt or not out:
        return out_tangents
    computed = torch_call(list(primals) + [tangents[i] for i in wrt], fun.append(Jvp(wrt, out)))
    for j, t in zip(out, computed):
        out_tangents[j] = t
    return out_tangents


def _jvp_replaying_draws(
    primals: Sequence[Any], tangents: Sequence[Any | None], fun: TorchFn
) -> tuple[list[Any], list[Any | None]]:
    """NOTE [derivatives replay the value's draws]: the value call keeps the
    generator state it started from, and the tangent call replays it.
    ``fun`` may itself be such a value call (an outer derivative over it),
    whose outputs end with the state."""
    keeping = keeping_state(fun.base)
    *outs, state = torch_call(primals, TorchFn.of(keeping))
    out_tangents = _tangents([*primals, state], [*tangents, None], TorchFn.of(replaying_state(fun.base)))
    if fun.base is keeping:
        outs.append(state)
        out_tangents.append(None)  # an integer output: float0 zeros
    return outs, out_tangents
