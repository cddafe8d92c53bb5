"""Taylor mode (``jax.experimental.jet``): the series by nested JVPs.

NOTE [jet by nested JVPs]
``jet`` hands a primitive the truncated input polynomials
``x_i(t) = x_i + c_i1 t + c_i2 t^2 + ...`` (its rules see plain coefficients,
the factorial scaling is done by ``jet`` itself) and asks for the output
polynomials' coefficients ``g^(k)(0) / k!`` of ``g(t) = f(x(t))``. PyTorch has
no Taylor mode, but ``g^(k)(0)`` is ``k`` nested JVPs of ``g`` in the scalar
``t``, and each JVP of ``torch_call`` is ``torch_call`` with ``Jvp`` appended
(rules/jvp.py). So the rule differentiates the polynomial path with
``jax.jvp``, ``order`` times, and every coefficient is again computed by
PyTorch (``torch.func.jvp`` nested ``k`` deep). The cost grows as ``2^order``
evaluations of the function, as nested forward mode does; Taylor mode proper
would grow as ``order^2``, which only a Taylor-mode rule for each PyTorch op
could give. Orders up to four or so are what jet is used for.

Non-float inputs do not move along the path (they are closed over, as JVPs
close over them), and non-float outputs get no series.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..primitive import torch_call
from ..torch_fn import TorchFn


def _with_next_derivative(derivatives: Callable[[Any], list[list[Any]]]) -> Callable[[Any], list[list[Any]]]:
    """From ``t -> [g(t), g'(t), ..., g^(k)(t)]`` make the same list up to ``g^(k+1)(t)``."""

    def extended(t: Any) -> list[list[Any]]:
        values, tangents = jax.jvp(derivatives, (t,), (jnp.ones_like(t),))
        return values + [tangents[-1]]

    return extended


def torch_call_jet(
    primals: Sequence[Any], series: Sequence[Sequence[Any]], *, fun: TorchFn
) -> tuple[list[Any], list[list[Any] | None]]:
    """``fun``'s outputs and their Taylor coefficients (NOTE [jet by nested
    JVPs]); ``None`` for the series of a non-float output."""
    order = len(series[0]) if series else 0
    moving = [a.is_inexact for a in fun.in_avals]

    def path(t: Any) -> list[Any]:
        # x + c_1 t + c_2 t^2 + ...; t**k keeps the inputs' dtype (t is weakly typed).
        return [
            x + sum(c * t**k for k, c in enumerate(coefficients, start=1)) if moves else x
            for x, coefficients, moves in zip(primals, series, moving)
        ]

    derivatives: Callable[[Any], list[list[Any]]] = lambda t: [torch_call(path(t), fun)]
    for _ in range(order):
        derivatives = _with_next_derivative(derivatives)
    by_order = derivatives(jnp.asarray(0.0))
    outs = by_order[0]
    series_out: list[list[Any] | None] = [
        [by_order[k][j] / math.factorial(k) for k in range(1, order + 1)] if aval.is_inexact else None
        for j, aval in enumerate(fun.out_avals)
    ]
    return outs, series_out
