"""Transpose of a torch_call that is linear in some of its inputs.

The common case is the tangent call made by the JVP rule (last transform
``Jvp``): its transpose is the *inner* function with ``Vjp`` appended, fed the
primals and the output cotangents -- one reverse pass, no forward pass of the
JVP. Any other linear call (a batched JVP, a VJP being transposed back) is
transposed generically: ``Vjp`` appended to the call itself, evaluated with
zeros in its linear inputs, which is exact because the call is linear there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from ..primitive import torch_call
from ..torch_fn import Jvp, TorchFn, Vjp


def torch_call_transpose(
    cts: Sequence[Any | None], args: Sequence[Any | None], linear: Sequence[bool], *, fun: TorchFn
) -> list[Any | None]:
    undefined = [i for i, lin in enumerate(linear) if lin]
    out = tuple(j for j, c in enumerate(cts) if c is not None and fun.out_avals[j].is_inexact)
    result: list[Any | None] = [None] * len(args)
    if not out:
        return result
    given_cts = [cts[j] for j in out]

    last = fun.transforms[-1] if fun.transforms else None
    inner = fun.parent() if isinstance(last, Jvp) else None
    if inner is not None and all(i >= len(inner.in_avals) for i in undefined):
        n = len(inner.in_avals)
        wrt = tuple(last.wrt[i - n] for i in undefined)
        vjp_fun = inner.append(Vjp(wrt, tuple(last.out[j] for j in out)))
        grads = torch_call(list(args[:n]) + given_cts, vjp_fun)
    else:
        filled = [
            jnp.zeros(fun.in_avals[i].shape, fun.in_avals[i].dtype) if lin else a
            for i, (a, lin) in enumerate(zip(args, linear))
        ]
        vjp_fun = fun.append(Vjp(tuple(undefined), out))
        grads = torch_call(filled + given_cts, vjp_fun)
    for i, g in zip(undefined, grads):
        result[i] = g
    return result
