"""Layer, batch and instance norm by plain ops, for derivatives of order two and more.

NOTE [normalizations at second order]
``torch.func`` gets second derivatives through ``layer_norm``,
``batch_norm`` with batch statistics and ``instance_norm`` wrong, by up
to tens in a Hessian's entries, silently (pytorch/pytorch#196700 and
#196699; torch 2.13, every pairing of ``jacfwd`` and ``jacrev``): in
``jax.hessian`` of ``(F.layer_norm(h, (4,), w) ** 2).sum()`` the
d/dh d/dw block is off by 1.7, so the Hessian is not even symmetric. The
fused kernels hand their backward the mean and inverse standard deviation
as outputs without derivatives, and the issues trace the error to the
formulas that differentiate that backward again. First derivatives are
right, and so is PyTorch's own double backward outside functorch
(``torch.autograd.functional.hessian``).

So a call with two or more derivative transforms (Jvp or Vjp, however
batched) runs its function with ``torch.nn.functional.layer_norm`` /
``batch_norm`` / ``instance_norm``, the ``torch.`` functions they call and
the aten ops under those (``torch.native_layer_norm``,
``torch.ops.aten.native_batch_norm``, ``_native_batch_norm_legit``: code
that calls them directly got the same wrong numbers) computed by plain
ops -- mean, biased variance, ``rsqrt`` -- which every transform
differentiates right to any order. Half-precision inputs are
normalized in float32 as PyTorch's kernels do. Batch statistics still
update the running ones exactly as PyTorch does: the fused op runs once
more on the detached input for that alone, its output unused. Calls of
order zero and one keep the fused kernels. The mode costs a Python hook
per PyTorch call inside the function, in those calls only (a graph-mode
trace records the plain ops, and its replays pay nothing). TorchScript
code runs below any Python mode, so a scripted module that normalizes by
its input's statistics is refused at second order, by name (its parameter
Hessian was off by 50); first derivatives and eval-mode batch norm run.

NOTE [the mode's handler under torch.compile]
A ``torch.compile``d function meets the mode in one of two ways. Where
Dynamo compiles the function's code, it traces the mode's handler inline,
like any mode active at the call, and the graph holds the plain ops. Where
it has given up on that code -- for good, once it met the code under a
dispatch mode (t2j_ad's trial runs enter several) or failed to compile it
(a functorch-wrapped view, as an order-two call's inputs are) -- the
function runs as Python, but Dynamo's frame hook stays on for the frames it
calls, and the first of those at each PyTorch call is the handler's. Dynamo
compiled the handler then, on functorch-wrapped tensors, and failed
(``AssertionError: False != True`` converting one to a fake tensor, after a
recompile per op): ``jax.hessian`` of a compiled function raised, and
``jax.jacrev(jax.jacrev(...))`` took the error for a refusal of
``torch.vmap`` and batched sequentially. So the handler's code, and what it
calls, is marked never to be compiled as a frame of its own
(``_handler_never_compiled_alone``): it runs as Python, as it does under
plain PyTorch where Dynamo gave up on the function. The mark is on the code
object, read by Dynamo's frame hook only; tracing the function inline
ignores it, so a function Dynamo does compile still gets the plain ops.
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x - mean) * rsqrt(var + eps) over ``dims``, in float32 for half
    inputs, with the mean and rsqrt(var + eps) (``dims`` kept, in ``x``'s
    dtype, as PyTorch's kernels return them, and like theirs without a
    derivative: at order 1 they have none, so none at order 2 either);
    ``weight`` and ``bias`` already broadcast."""
    acc = x.float() if x.dtype in _HALF else x
    mean = acc.mean(dims, keepdim=True)
    centered = acc - mean
    rstd = torch.rsqrt((centered * centered).mean(dims, keepdim=True) + eps)
    out = centered * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.to(x.dtype), mean.detach().to(x.dtype), rstd.detach().to(x.dtype)


def _native_layer_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.native_layer_norm``'s signature and results."""
    n = len(tuple(normalized_shape)) if not isinstance(normalized_shape, int) else 1
    return _normalized(input, tuple(range(input.dim() - n, input.dim())), weight, bias, eps)


def _layer_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    cudnn_enable: bool = True,
) -> torch.Tensor:
    """``torch.layer_norm``'s signature."""
    return _native_layer_norm(input, normalized_shape, weight, bias, eps)[0]


def _per_channel(t: torch.Tensor | None, ndim: int) -> torch.Tensor | None:
    """A channel vector broadcast against an (N, C, ...) input."""
    return None if t is None else t.reshape((-1,) + (1,) * (ndim - 2))


def _by_input_statistics(
    with_running: Callable[..., tuple[torch.Tensor, ...]], update: Callable[..., torch.Tensor], reduced: tuple[int, ...]
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """A norm with ``torch.native_batch_norm``'s signature and results that
    normalizes ``input`` by its own statistics over the dimensions
    ``reduced`` and those from 2 on, by plain ops; ``update``
    (``torch.batch_norm`` or ``torch.instance_norm``) updates the running
    statistics, on the detached input (NOTE [normalizations at second
    order]). Where it normalizes by the running statistics, constants,
    ``with_running`` (PyTorch's fused op) computes it."""

    def norm(
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        use_input_stats: bool,
        momentum: float,
        eps: float,
    ) -> tuple[torch.Tensor, ...]:
        if not use_input_stats and running_mean is not None and running_var is not None:
            return with_running(input, weight, bias, running_mean, running_var, momentum, eps)
        if running_mean is not None or running_var is not None:
            with torch.no_grad():
                update(input.detach(), None, None, running_mean, running_var, True, momentum, eps, True)
        ndim = input.dim()
        dims = reduced + tuple(range(2, ndim))
        out, mean, rstd = _normalized(input, dims, _per_channel(weight, ndim), _per_channel(bias, ndim), eps)
        return out, mean.reshape(-1), rstd.reshape(-1)

    return norm


_native_batch_norm = _by_input_statistics(
    lambda x, w, b, mean, var, momentum, eps: torch.native_batch_norm(x, w, b, mean, var, False, momentum, eps),
    torch.batch_norm,
    (0,),
)
_native_instance_norm = _by_input_statistics(
    lambda x, w, b, mean, var, momentum, eps: (torch.instance_norm(x, w, b, mean, var, False, momentum, eps, True),),
    torch.instance_norm,
    (),
)


def _native_batch_norm_legit(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, *rest: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch._native_batch_norm_legit``'s two signatures: with running
    statistics, or without (``training, momentum, eps``)."""
    running = (None, None) if len(rest) == 3 else ()
    return _native_batch_norm(input, weight, bias, *running, *rest)


def _batch_norm_impl_index(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    cudnn_enabled: bool,
) -> tuple[Any, ...]:
    """``aten._batch_norm_impl_index``: the native kernel's results, an empty
    reserve and the native implementation's index (0)."""
    out, mean, rstd = _native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return out, mean, rstd, torch.empty(0, dtype=torch.uint8, device=input.device), 0


def _native_batch_norm_legit_functional(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """``aten._native_batch_norm_legit_functional``: the running statistics
    updated in new tensors, the given ones left alone."""
    new_mean, new_var = running_mean.clone(), running_var.clone()
    out, mean, rstd = _native_batch_norm(input, weight, bias, new_mean, new_var, training, momentum, eps)
    return out, mean, rstd, new_mean, new_var


def _output_of(native: Callable[..., tuple[torch.Tensor, ...]]) -> Callable[..., torch.Tensor]:
    """``torch.batch_norm`` / ``torch.instance_norm`` (one signature) by ``native``."""

    def norm(
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        use_input_stats: bool,
        momentum: float,
        eps: float,
        cudnn_enabled: bool = True,
    ) -> torch.Tensor:
        return native(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps)[0]

    return norm


_batch_norm = _output_of(_native_batch_norm)
_instance_norm = _output_of(_native_instance_norm)


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


# PyTorch's functions, and the aten ops they call, -> the same by plain ops,
# with the same signature (an aten op's packet and overloads alike, but for
# those that write into an out= tensor).
_aten = torch.ops.aten
_COMPOSITE: dict[Callable[..., Any], Callable[..., Any]] = {
    F.layer_norm: _layer_norm,
    F.batch_norm: _functional_batch_norm,
    F.instance_norm: _functional_instance_norm,
    torch.layer_norm: _layer_norm,
    torch.native_layer_norm: _native_layer_norm,
    torch.batch_norm: _batch_norm,
    torch.native_batch_norm: _native_batch_norm,
    torch._native_batch_norm_legit: _native_batch_norm_legit,
    torch.instance_norm: _instance_norm,
    **{
        op: composite
        for packet, composite in (
            (_aten.layer_norm, _layer_norm),
            (_aten.native_layer_norm, _native_layer_norm),
            (_aten.batch_norm, _batch_norm),
            (_aten.native_batch_norm, _native_batch_norm),
            (_aten._native_batch_norm_legit, _native_batch_norm_legit),
            (_aten._native_batch_norm_legit_functional, _native_batch_norm_legit_functional),
            (_aten._batch_norm_impl_index, _batch_norm_impl_index),
            (_aten.instance_norm, _instance_norm),
        )
        for op in (packet, *(getattr(packet, name) for name in packet.overloads() if "out" not in name))
    },
}


class _CompositeNorms(TorchFunctionMode):
    # The mode is off inside its own handler, so the fused op a composite
    # calls for the running statistics is PyTorch's. Dynamo never compiles
    # this handler as a frame of its own (NOTE [the mode's handler under
    # torch.compile]).
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return _COMPOSITE.get(func, func)(*args, **(kwargs or {}))


def _handler_never_compiled_alone(handler: Callable[..., Any]) -> None:
    """Dynamo's frame hook runs ``handler``'s frames, and every frame they
    call, as Python, never compiling them (NOTE [the mode's handler under
    torch.compile]); inline tracing is unaffected. Through Dynamo's
    per-code frame strategy (private; a PyTorch without it has nothing to
    mark)."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        return
    set_code_exec_strategy(handler.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


_handler_never_compiled_alone(_CompositeNorms.__torch_function__)


def with_composite_norms(fn: Callable[..., Any], modules: Sequence[torch.nn.Module] = ()) -> Callable[..., Any]:
    """``fn``, run with normalizations by plain ops (NOTE [normalizations at
    second order]); ``modules``: those it refers to. A TorchScript module
    among them that normalizes by its input's statistics hides those calls
    from the mode: ``fn`` then raises a ``ValueError`` naming it (no
    fallback of PyTorch errors takes it for a refusal of torch.func's)."""
    scripted = _scripted_norms(modules)

    def run(*args: Any) -> Any:
        if scripted:
            raise ValueError(
                f"{', '.join(scripted)} normalizes inside TorchScript, where torch.func's second derivatives of "
                f"it are wrong (pytorch/pytorch#196700) and t2j_ad cannot compute them by plain ops as it does "
                f"in Python code. Pass the module as it was before torch.jit.script, or take first derivatives "
                f"only."
            )
        with _CompositeNorms():
            return fn(*args)

    return run


# The ops a TorchScript graph normalizes by its input's statistics with
# (batch_norm does in training mode only).
_SCRIPTED_OPS = ("aten::layer_norm", "aten::native_layer_norm", "aten::instance_norm")


def _scripted_norms(modules: Sequence[torch.nn.Module]) -> list[str]:
    """The outermost TorchScript modules in ``modules`` (and their
    submodules) whose code, inlined, normalizes by its input's statistics,
    each with those ops."""
    found: list[str] = []
    covered: set[int] = set()
    for top in modules:
        for sub in top.modules():
            if id(sub) in covered or not isinstance(sub, torch.jit.ScriptModule):
                continue
            covered.update(id(m) for m in sub.modules())
            try:
                graph = str(sub.inlined_graph)
            except (AttributeError, RuntimeError):  # a container without a forward
                continue
            ops = [op for op in _SCRIPTED_OPS if op in graph]
            if sub.training and "aten::batch_norm" in graph:
                ops.append("aten::batch_norm in training mode")
            if ops:
                found.append(f"the TorchScript module {sub.original_name} ({', '.join(ops)})")
    return found
