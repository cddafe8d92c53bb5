"""Running a TorchFn on tensors that view XLA's buffers.

Both backends (backends/callback.py and backends/ffi.py) end here: they wrap
XLA's input and output buffers as torch tensors without copying and call
``run_into``.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Sequence

import torch

from .convert import jax_dtype
from .torch_fn import TorchFn, build


class TorchCallError(RuntimeError):
    """An exception raised by the PyTorch function, or a broken result."""


class InputMutationError(TorchCallError):
    """The PyTorch function wrote into one of its inputs."""


# NOTE [torch threads]
# XLA calls us from one of its own worker threads. PyTorch's intra-op thread
# count is per calling thread (OpenMP), so it must be set here, in the
# callback, not once at import. On a small machine XLA's pool and PyTorch's
# pool oversubscribe the cores: per-example gradients on 2 cores ran ~10x
# slower with both at full width.
_threads: int | None = None


def torch_threads() -> int:
    global _threads
    if _threads is None:
        env = os.environ.get("T2J_AD_TORCH_THREADS")
        _threads = int(env) if env else max(1, (os.cpu_count() or 1) // 2)
    return _threads


def set_torch_threads(n: int) -> None:
    """Set how many CPU threads PyTorch uses inside t2j_ad calls."""
    global _threads
    if int(n) < 1:
        raise ValueError(f"set_torch_threads: n must be >= 1, got {n}.")
    _threads = int(n)


def _check_outputs(fun: TorchFn, results: object) -> tuple[torch.Tensor, ...]:
    names = fun.base.out_names if not fun.transforms else tuple(f"output {i}" for i in range(len(fun.out_avals)))
    if not isinstance(results, tuple) or len(results) != len(fun.out_avals):
        raise TorchCallError(
            f"{fun.name} returned {type(results).__name__} of "
            f"{len(results) if isinstance(results, tuple) else '?'} outputs; "
            f"expected {len(fun.out_avals)} (output structure changed between calls?)."
        )
    for name, r, aval in zip(names, results, fun.out_avals):
        if not isinstance(r, torch.Tensor):
            raise TorchCallError(f"{fun.name}: output {name} is a {type(r).__name__}, not a torch.Tensor.")
        if tuple(r.shape) != aval.shape:
            raise TorchCallError(
                f"{fun.name}: output {name} has shape {tuple(r.shape)}, but "
                f"{aval.shape} was declared (output_shapes or the inferred shape)."
            )
    if not fun.transforms:
        for name, r, aval, declared in zip(names, results, fun.out_avals, fun.base.torch_out_dtypes):
            if r.dtype != declared:
                raise TorchCallError(
                    f"{fun.name}: output {name} has dtype {jax_dtype(r.dtype)}, "
                    f"but {jax_dtype(declared)} was declared (output_shapes or the inferred dtype)."
                )
    return results


def _stream_context(stream: int | None):
    if stream:
        return torch.cuda.stream(torch.cuda.ExternalStream(stream))
    return contextlib.nullcontext()


def run_into(
    fun: TorchFn,
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    stream: int | None = None,
) -> None:
    """Run ``fun`` on ``inputs`` and copy its results into ``outputs``.

    ``inputs`` and ``outputs`` view XLA's buffers. Raises ``TorchCallError``
    (with PyTorch's message and traceback text) when PyTorch raises, when the
    results do not match ``fun.out_avals``, or when an input was mutated.
    """
    n = torch_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)

    base = fun.base
    if not base.mutation_checked:
        # Until one run shows the function leaves its inputs alone, hand it
        # copies, so a mutating function cannot change the caller's arrays.
        inputs = [t.clone() for t in inputs]
    versions = [t._version for t in inputs]
    impl = build(fun)
    # No graph for a plain call. A transformed one runs with grad mode on:
    # torch.func.jvp over torch.func.vjp under no_grad silently drops the
    # tangents of tensors the vjp saved (jvp-of-vjp of linalg.solve came out
    # half its value), so Hessians were wrong.
    grad_mode = torch.enable_grad() if fun.transforms else torch.no_grad()
    try:
        with grad_mode, _stream_context(stream):
            results = impl(*inputs)
    except TorchCallError:
        raise
    except Exception as err:
        raise TorchCallError(
            f"the PyTorch function {fun.name} raised {type(err).__name__}: {err}\n\n"
            f"PyTorch traceback:\n{''.join(traceback.format_exception(err))}"
        ) from err
    mutated = [i for i, (t, v) in enumerate(zip(inputs, versions)) if t._version != v]
    if mutated:
        raise InputMutationError(
            f"the PyTorch function {fun.name} mutated input(s) {mutated} in place; "
            f"t2j_ad functions must not write into their inputs (JAX arrays are "
            f"immutable). Clone the input first (x = x.clone()) or use the "
            f"out-of-place op."
        )
    base.mutation_checked = True
    results = _check_outputs(fun, results)
    with _stream_context(stream):
        for out, r in zip(outputs, results):
            if out.numel():
                out.copy_(r)
