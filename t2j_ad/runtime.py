"""Running a TorchFn on tensors that view XLA's buffers.

Both backends (backends/callback.py and backends/ffi.py) end here: they wrap
XLA's input and output buffers as torch tensors without copying and call
``run_into``.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Sequence

import numpy as np
import torch

from .convert import jax_dtype
from .malloc_tuning import tune_malloc
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
        env = os.environ.get("T2J_AD_TORCH_THREADS", "").strip()
        if not env:
            _threads = max(1, (os.cpu_count() or 1) // 2)
        elif not env.isdigit() or int(env) < 1:
            raise ValueError(
                f"T2J_AD_TORCH_THREADS must be a whole number >= 1 (PyTorch threads "
                f"inside t2j_ad calls), got {env!r}; unset it for half the cores."
            )
        else:
            _threads = int(env)
    return _threads


def set_torch_threads(n: int) -> None:
    """Set how many CPU threads PyTorch uses inside t2j_ad calls."""
    global _threads
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"set_torch_threads: n must be an int, got {type(n).__name__} ({n!r}).")
    if n < 1:
        raise ValueError(f"set_torch_threads: n must be >= 1, got {n}.")
    _threads = int(n)


def check_environment() -> None:
    """Read every ``T2J_AD_*`` setting the runtime uses, so that a bad value
    raises a ``ValueError`` naming it in the caller, when a signature is
    first traced, rather than from inside a custom call."""
    torch_threads()
    tune_malloc()
    from . import functorch_levels  # noqa: F401 - reads T2J_AD_FUNCTORCH_FAST at import


def not_a_tensor(fn_name: str, where: str, value: object) -> TorchCallError:
    """The error for an output that is not a tensor; ``where`` names it."""
    return TorchCallError(
        f"{fn_name}: {where} is {type(value).__name__} ({value!r:.60}), not a torch.Tensor; "
        f"return tensors only (torch.tensor(value) for numbers)."
    )


def _stream_context(stream: int):
    return torch.cuda.stream(torch.cuda.ExternalStream(stream))


# Looked up once: the runner's hot path calls these on every call.
_Tensor = torch.Tensor
_get_num_threads = torch.get_num_threads
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


class _Runner:
    """Everything a call of one TorchFn needs, computed once.

    Cached on the TorchFn object (``runner_for``); the FFI backend also keeps
    it in a table the C++ handler calls directly (see NOTE [registry
    lifetime] in backends/registry.py). It must therefore not refer to the
    TorchFn itself, only to what it was built from, or that table would keep
    every TorchFn alive.
    """

    def __init__(self, fun: TorchFn):
        self.name = fun.name
        self.base = fun.base
        self.impl = build(fun)
        # A plain call of a function that takes the flat tensors positionally
        # calls it directly, one frame fewer than ``impl`` (see BaseFn.direct).
        self.direct = fun.base.direct if not fun.transforms else None
        self.direct_single = self.direct is not None and fun.base.direct_single
        # No graph for a plain call. A transformed one runs with grad mode on:
        # torch.func.jvp over torch.func.vjp under no_grad silently drops the
        # tangents of tensors the vjp saved (jvp-of-vjp of linalg.solve came
        # out half its value), so Hessians were wrong.
        self.grad_enabled = bool(fun.transforms)
        self.out_avals = fun.out_avals
        self.out_names = (
            fun.base.out_names if not fun.transforms else tuple(f"output {i}" for i in range(len(fun.out_avals)))
        )
        self.n_out = len(fun.out_avals)
        self.shapes = tuple(torch.Size(a.shape) for a in fun.out_avals)
        # Plain calls must return exactly the declared dtypes; derived ones
        # are cast on copy (see NOTE [64-bit outputs] in api.py): None.
        self.dtypes = (None,) * self.n_out if fun.transforms else fun.base.torch_out_dtypes

    def __call__(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int = 0) -> None:
        # The hot path of every call (microseconds matter: see
        # benchmarks/bench_call_latency.py), so it is one flat frame of C
        # calls; everything unusual branches off to a method.
        if stream:
            self._on_stream(inputs, outputs, stream)
            return
        n = _threads or torch_threads()
        if _get_num_threads() != n:
            torch.set_num_threads(n)
        checked = self.base.mutation_checked
        if not checked:
            # Until one run shows the function leaves its inputs alone, hand
            # it copies, so a mutating function cannot change the caller's arrays.
            inputs = [t.clone() for t in inputs]
        previous = _is_grad_enabled()
        _set_grad_enabled(self.grad_enabled)
        try:
            try:
                if self.direct is not None:
                    results = self.direct(*inputs)  # one tensor if direct_single
                else:
                    results = self.impl(*inputs)
            except TorchCallError:
                raise
            except Exception as err:
                raise self._failure(err) from err
            if self.grad_enabled:
                # The copies below must not record a graph into the outputs.
                _set_grad_enabled(False)
            # Inputs arrive fresh (version 0; see run_into), so any in-place
            # write shows as a nonzero version: no snapshot before the call.
            for t in inputs:
                if t._version:
                    self._refuse_mutation(inputs)
            if not checked:
                self.base.mutation_checked = True
            if self.direct_single:
                if type(results) is not _Tensor or results.shape != self.shapes[0] or results.dtype is not self.dtypes[0]:
                    self._check_outputs((results,))  # raises, unless a tensor subclass
                outputs[0].copy_(results)
                return
            if type(results) is not tuple or len(results) != self.n_out:
                self._check_outputs(results)  # raises, naming the problem
            for out, r, shape, dtype in zip(outputs, results, self.shapes, self.dtypes):
                if not isinstance(r, _Tensor) or r.shape != shape or (dtype is not None and r.dtype != dtype):
                    self._check_outputs(results)  # raises, naming the output
                out.copy_(r)
        finally:
            _set_grad_enabled(previous)

    def _on_stream(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int) -> None:
        # PyTorch must run on XLA's stream, for the call and the copies.
        with _stream_context(stream):
            self(inputs, outputs)

    def _failure(self, err: Exception) -> TorchCallError:
        return TorchCallError(
            f"the PyTorch function {self.name} raised {type(err).__name__}: {err}\n\n"
            f"PyTorch traceback:\n{''.join(traceback.format_exception(err))}"
        )

    def _check_outputs(self, results: object) -> None:
        """Raise an error naming the first output that does not match."""
        if not isinstance(results, tuple) or len(results) != self.n_out:
            raise TorchCallError(
                f"{self.name} returned {type(results).__name__} of "
                f"{len(results) if isinstance(results, tuple) else '?'} outputs; "
                f"expected {self.n_out} (output structure changed between calls?)."
            )
        for name, r, aval in zip(self.out_names, results, self.out_avals):
            if not isinstance(r, torch.Tensor):
                raise not_a_tensor(self.name, name, r)
            if tuple(r.shape) != aval.shape:
                raise TorchCallError(
                    f"{self.name}: {name} has shape {tuple(r.shape)}, but "
                    f"{aval.shape} was declared (output_shapes or the inferred shape)."
                )
        for name, r, declared in zip(self.out_names, results, self.dtypes):
            if declared is not None and r.dtype != declared:
                raise TorchCallError(
                    f"{self.name}: {name} has dtype {jax_dtype(r.dtype)}, "
                    f"but {jax_dtype(declared)} was declared (output_shapes or the inferred dtype)."
                )

    def _refuse_mutation(self, inputs: Sequence[torch.Tensor]) -> None:
        mutated = [i for i, t in enumerate(inputs) if t._version]
        raise InputMutationError(
            f"the PyTorch function {self.name} mutated input(s) {mutated} in place; "
            f"t2j_ad functions must not write into their inputs (JAX arrays are "
            f"immutable). Clone the input first (x = x.clone()) or use the "
            f"out-of-place op."
        )


def runner_for(fun: TorchFn) -> _Runner:
    """The cached runner of ``fun`` (one per TorchFn object)."""
    runner = fun.__dict__.get("_runner")
    if runner is None:
        # Process-wide and applied once; see NOTE [heap trimming].
        tune_malloc()
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

    ``inputs`` and ``outputs`` view XLA's buffers. The inputs must be fresh
    tensors, as DLPack imports are: a nonzero ``_version`` after the call is
    taken as an in-place write. Raises ``TorchCallError``
    (with PyTorch's message and traceback text) when PyTorch raises, when the
    results do not match ``fun.out_avals``, or when an input was mutated.
    """
    runner_for(fun)(inputs, outputs, stream or 0)
