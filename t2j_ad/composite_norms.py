"""Layer, batch and instance norm by plain ops, for derivatives of order two and more.

NOTE [normalizations at second order]
``torch.func`` gets second derivatives through ``layer_norm``,
``batch_norm`` with batch statistics and ``instance_norm`` wrong, by up
to tens in a Hessian's entries, silently (pytorch/pytorch#196700 and
#196699; torch 2.13, every pairing of ``jacfwd`` and ``jacrev``). The
fused kernels return the mean and inverse standard deviation they used as
outputs without derivatives, and the formulas that differentiate their
backward a second time under functorch treat those as constants: in
``jax.hessian`` of ``(F.layer_norm(h, (4,), w) ** 2).sum()`` the
d/dh d/dw block is off by 1.7, so the Hessian is not even symmetric.
First derivatives are right, and so is PyTorch's own double backward
outside functorch (``torch.autograd.functional.hessian``).

So a call with two or more derivative transforms (Jvp or Vjp, however
batched) runs its function with ``torch.nn.functional.layer_norm`` /
``batch_norm`` / ``instance_norm`` (and the ``torch.`` functions they call)
computed by plain ops -- mean, biased variance, ``rsqrt`` -- which every
transform differentiates right to any order. Half-precision inputs are
normalized in float32 as PyTorch's kernels do. Batch statistics still
update the running ones exactly as PyTorch does: the fused op runs once
more on the detached input for that alone, its output unused. Calls of
order zero and one keep the fused kernels. The mode costs a Python hook
per PyTorch call inside the function, in those calls only (a graph-mode
trace records the plain ops, and its replays pay nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_HALF = (torch.float16, torch.bfloat16)


def _normalized(
    x: torch.Tensor, dims: Sequence[int], weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x - mean) * rsqrt(var + eps) over ``dims``, in float32 for half
    inputs, and the mean; ``weight`` and ``bias`` already broadcast."""
    acc = x.float() if x.dtype in _HALF else x
    mean = acc.mean(dims, keepdim=True)
    centered = acc - mean
    out = centered * torch.rsqrt((centered * centered).mean(dims, keepdim=True) + eps)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.to(x.dtype), mean


def _layer_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *_: Any,
    **__: Any,
) -> torch.Tensor:
    n = len(tuple(normalized_shape)) if not isinstance(normalized_shape, int) else 1
    return _normalized(input, tuple(range(input.dim() - n, input.dim())), weight, bias, eps)[0]


def _per_channel(t: torch.Tensor | None, ndim: int) -> torch.Tensor | None:
    """A channel vector broadcast against an (N, C, ...) input."""
    return None if t is None else t.reshape((-1,) + (1,) * (ndim - 2))


def _by_batch_statistics(fused: Callable[..., torch.Tensor], reduced: tuple[int, ...]) -> Callable[..., torch.Tensor]:
    """``fused`` (``torch.batch_norm`` or ``torch.instance_norm``, whose
    signatures are one) by plain ops, normalizing over the dimensions
    ``reduced`` and those from 2 on, where it uses the input's statistics."""

    def norm(
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        use_input_stats: bool,
        momentum: float,
        eps: float,
        cudnn_enabled: bool,
    ) -> torch.Tensor:
        if not use_input_stats and running_mean is not None and running_var is not None:
            # Running statistics are constants: the fused op is right.
            return fused(input, weight, bias, running_mean, running_var, False, momentum, eps, cudnn_enabled)
        if running_mean is not None or running_var is not None:
            with torch.no_grad():  # the running statistics' update alone (NOTE [normalizations at second order])
                fused(input.detach(), None, None, running_mean, running_var, True, momentum, eps, cudnn_enabled)
        ndim = input.dim()
        dims = reduced + tuple(range(2, ndim))
        return _normalized(input, dims, _per_channel(weight, ndim), _per_channel(bias, ndim), eps)[0]

    return norm


_batch_norm = _by_batch_statistics(torch.batch_norm, (0,))
_instance_norm = _by_batch_statistics(torch.instance_norm, ())


def _functional_batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``torch.nn.functional.batch_norm``'s signature."""
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, True)


def _functional_instance_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``torch.nn.functional.instance_norm``'s signature."""
    return _instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, True)


# PyTorch's functions -> the same by plain ops, with the same signature.
_COMPOSITE: dict[Callable[..., Any], Callable[..., torch.Tensor]] = {
    F.layer_norm: _layer_norm,
    torch.layer_norm: _layer_norm,
    F.batch_norm: _functional_batch_norm,
    torch.batch_norm: _batch_norm,
    F.instance_norm: _functional_instance_norm,
    torch.instance_norm: _instance_norm,
}


class _CompositeNorms(TorchFunctionMode):
    # The mode is off inside its own handler, so the fused op a composite
    # calls for the running statistics is PyTorch's.
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return _COMPOSITE.get(func, func)(*args, **(kwargs or {}))


def with_composite_norms(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, run with normalizations by plain ops (NOTE [normalizations at second order])."""

    def run(*args: Any) -> Any:
        with _CompositeNorms():
            return fn(*args)

    return run
