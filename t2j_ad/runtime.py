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


def _check_outputs(fun: TorchFn, results: object) -> None:
    """Raise an error naming the first output that does not match ``fun``."""
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
        for name, r, declared in zip(names, results, fun.base.torch_out_dtypes):
            if r.dtype != declared:
                raise TorchCallError(
                    f"{fun.name}: output {name} has dtype {jax_dtype(r.dtype)}, "
                    f"but {jax_dtype(declared)} was declared (output_shapes or the inferred dtype)."
                )


def _stream_context(stream: int | None):
    if stream:
        return torch.cuda.stream(torch.cuda.ExternalStream(stream))
    return contextlib.nullcontext()


class _Runner:
    """Everything ``run_into`` needs for one TorchFn, computed once.

    Cached on the TorchFn object: the FFI registry and the callback closure
    hand back the same object on every call, so the hot path is one
    attribute lookup, one PyTorch call, cheap checks and the copies.
    """

    def __init__(self, fun: TorchFn):
        self.fun = fun
        self.impl = build(fun)
        # No graph for a plain call. A transformed one runs with grad mode on:
        # torch.func.jvp over torch.func.vjp under no_grad silently drops the
        # tangents of tensors the vjp saved (jvp-of-vjp of linalg.solve came
        # out half its value), so Hessians were wrong.
        self.grad_enabled = bool(fun.transforms)
        self.n_out = len(fun.out_avals)
        self.shapes = tuple(torch.Size(a.shape) for a in fun.out_avals)
        # Plain calls must return exactly the declared dtypes; derived ones
        # are cast on copy (see NOTE [64-bit outputs] in api.py).
        self.dtypes = None if fun.transforms else fun.base.torch_out_dtypes

    def __call__(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int | None) -> None:
        if stream:
            # PyTorch must run on XLA's stream, for the call and the copies.
            with _stream_context(stream):
                self._run(inputs, outputs)
        else:
            self._run(inputs, outputs)

    def _run(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        # The hot path of every call (microseconds matter: see
        # benchmarks/bench_call_latency.py): a few C calls per tensor.
        n = _threads if _threads is not None else torch_threads()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        base = self.fun.base
        if not base.mutation_checked:
            # Until one run shows the function leaves its inputs alone, hand
            # it copies, so a mutating function cannot change the caller's arrays.
            inputs = [t.clone() for t in inputs]
        versions = [t._version for t in inputs]
        previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(self.grad_enabled)
        try:
            results = self.impl(*inputs)
        except TorchCallError:
            raise
        except Exception as err:
            raise TorchCallError(
                f"the PyTorch function {self.fun.name} raised {type(err).__name__}: {err}\n\n"
                f"PyTorch traceback:\n{''.join(traceback.format_exception(err))}"
            ) from err
        finally:
            torch._C._set_grad_enabled(previous)
        if [t._version for t in inputs] != versions:
            self._refuse_mutation(inputs, versions)
        base.mutation_checked = True
        if type(results) is not tuple or len(results) != self.n_out:
            _check_outputs(self.fun, results)  # raises, naming the problem
        dtypes = self.dtypes
        for i, (out, r) in enumerate(zip(outputs, results)):
            if (
                not isinstance(r, torch.Tensor)
                or r.shape != self.shapes[i]
                or (dtypes is not None and r.dtype != dtypes[i])
            ):
                _check_outputs(self.fun, results)  # raises, naming the output
            out.copy_(r)

    def _refuse_mutation(self, inputs: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
        mutated = [i for i, (t, v) in enumerate(zip(inputs, versions)) if t._version != v]
        raise InputMutationError(
            f"the PyTorch function {self.fun.name} mutated input(s) {mutated} in place; "
            f"t2j_ad functions must not write into their inputs (JAX arrays are "
            f"immutable). Clone the input first (x = x.clone()) or use the "
            f"out-of-place op."
        )


def runner_for(fun: TorchFn) -> _Runner:
    """The cached runner of ``fun`` (one per TorchFn object)."""
    runner = fun.__dict__.get("_runner")
    if runner is None:
        runner = _Runner(fun)
        # TorchFn is frozen; the runner is a cache, not part of its value.
        object.__setattr__(fun, "_runner", runner)
    return runner


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
    runner_for(fun)(inputs, outputs, stream)
