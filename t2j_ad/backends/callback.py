"""The Python callback backend.

``jax.experimental.buffer_callback`` hands us XLA's buffers; on CPU they are
wrapped as torch tensors through DLPack without copying, and results are
written straight into the output buffers. Older JAX falls back to
``jax.pure_callback``, which copies inputs and outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import torch

from .._jax_internals import buffer_callback, lower_fun
from ..convert import torch_dtype
from ..replayed_calls import kept_by_xla
from ..runtime import run_into
from ..torch_fn import TorchFn


def _result_shapes(fun: TorchFn) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in fun.out_avals]


def _via_buffer_callback(fun: TorchFn, on_gpu: bool):
    def callback(exec_ctx: Any, outs: Sequence[Any], *ins: Any) -> None:
        # The context has a stream only on GPU; asking for it on CPU raises.
        stream = exec_ctx.stream if on_gpu else None
        run_into(
            fun,
            [torch.from_dlpack(b) for b in ins],
            [torch.from_dlpack(b) for b in outs],
            stream=stream,
        )

    # NOTE [calls with effects under jax.jit] in replayed_calls.py
    return buffer_callback(callback, _result_shapes(fun), has_side_effect=kept_by_xla(fun))


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16; reinterpret bits.
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _via_pure_callback(fun: TorchFn):
    def callback(*ins: Any) -> tuple[np.ndarray, ...]:
        outs = [torch.empty(a.shape, dtype=torch_dtype(a.dtype)) for a in fun.out_avals]
        run_into(fun, [torch.from_dlpack(x) for x in ins], outs)
        return tuple(_to_numpy(o) for o in outs)

    shapes = _result_shapes(fun)
    return lambda *args: jax.pure_callback(callback, shapes, *args, vmap_method="sequential")


def lower(ctx: Any, *args: Any, fun: TorchFn) -> Sequence[Any]:
    on_gpu = ctx.module_context.platforms[0] in ("cuda", "rocm")
    call = _via_buffer_callback(fun, on_gpu) if buffer_callback is not None else _via_pure_callback(fun)
    return lower_fun(lambda *xs: call(*xs))(ctx, *args)
