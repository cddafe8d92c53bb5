"""Output shapes and dtypes of a PyTorch function, without example arguments.

First on the ``meta`` device (no data, no computation); if an op has no meta
kernel (or the code needs real data: NumPy, ``.item()``), one real call on
zeros. Either run also proves whether the function writes into its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .convert import torch_dtype
from .runtime import InputMutationError, TorchCallError
from .torch_fn import Aval


def _run(fn: Callable[..., Any], avals: Sequence[Aval], device: str, name: str) -> Any:
    make = torch.empty if device == "meta" else torch.zeros
    inputs = [make(a.shape, dtype=torch_dtype(a.dtype), device=device) for a in avals]
    versions = [t._version for t in inputs]
    with torch.no_grad():
        outputs = fn(*inputs)
    mutated = [i for i, (t, v) in enumerate(zip(inputs, versions)) if t._version != v]
    if mutated:
        raise InputMutationError(
            f"the PyTorch function {name} mutated input(s) {mutated} in place "
            f"(seen while inferring its output shapes); t2j_ad functions must "
            f"not write into their inputs (JAX arrays are immutable). Clone the "
            f"input first (x = x.clone()) or use the out-of-place op."
        )
    return outputs


def infer_outputs(fn: Callable[..., Any], avals: Sequence[Aval], name: str) -> Any:
    """Run ``fn`` on meta tensors, else once on zeros; return what it returned."""
    try:
        return _run(fn, avals, "meta", name)
    except InputMutationError:
        raise
    except Exception:  # noqa: BLE001 - no meta kernel, or needs real data
        pass
    try:
        return _run(fn, avals, "cpu", name)
    except InputMutationError:
        raise
    except Exception as err:
        raise TorchCallError(
            f"the PyTorch function {name} raised {type(err).__name__}: {err}\n"
            f"(while inferring output shapes on zeros; pass output_shapes= to "
            f"jaxify to skip inference)"
        ) from err
