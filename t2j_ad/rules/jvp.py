"""JVP: the primal by torch_call, the tangent by torch_call with Jvp appended.

The tangent call is linear in its tangent inputs, so JAX's partial evaluation
splits it off cleanly and transpose.py can turn it into a Vjp call: reverse
mode is JAX's own linearize-then-transpose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..primitive import torch_call
from ..torch_fn import Jvp, TorchFn


def torch_call_jvp(
    primals: Sequence[Any], tangents: Sequence[Any | None], *, fun: TorchFn
) -> tuple[list[Any], list[Any | None]]:
    outs = torch_call(primals, fun)
    # Symbolic zeros (None) and non-float inputs are closed over, not
    # differentiated; integer and bool outputs get float0 zeros.
    wrt = tuple(i for i, t in enumerate(tangents) if t is not None and fun.in_avals[i].is_inexact)
    out = tuple(j for j, a in enumerate(fun.out_avals) if a.is_inexact)
    out_tangents: list[Any | None] = [None] * len(fun.out_avals)
    if not wrt or not out:
        return outs, out_tangents
    tangent_fun = fun.append(Jvp(wrt, out))
    computed = torch_call(list(primals) + [tangents[i] for i in wrt], tangent_fun)
    for j, t in zip(out, computed):
        out_tangents[j] = t
    return outs, out_tangents
