"""Output shapes and dtypes of a PyTorch function, without example arguments.

First on the ``meta`` device (no data, no computation); if an op has no meta
kernel (or the code needs real data: NumPy, ``.item()``), one real call on
zeros. Either run also proves whether the function writes into its inputs.

NOTE [inference on the call's device]
A function that closes over a tensor (a weight made with ``device="cuda"``, a
table) fails on meta inputs, because PyTorch refuses to mix a meta tensor with
a real one (0-d tensors aside), so its shapes come from the call on zeros;
and zeros on the CPU fail against a CUDA tensor. So the zeros are made on the
device the call will run on (``convert.call_device``: a concrete argument's
device, else JAX's default device). That is a guess when every argument is traced: under
``jax.jit``, a call on arrays committed to another device than JAX's default
runs there. So when the call's device is not the CPU and the zeros fail
there, the CPU is tried too; if both fail, the error reported is the one from
the call's device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .convert import torch_dtype
from .runtime import InputMutationError, TorchCallError
from .torch_fn import Aval


_META = torch.device("meta")
_CPU = torch.device("cpu")


def _run(fn: Callable[..., Any], avals: Sequence[Aval], device: torch.device, name: str) -> Any:
    make = torch.empty if device == _META else torch.zeros
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


def infer_outputs(fn: Callable[..., Any], avals: Sequence[Aval], name: str, device: torch.device = _CPU) -> Any:
    """Run ``fn`` on meta tensors, else once on zeros on ``device``, the
    call's (then on the CPU's: NOTE [inference on the call's device]); return
    what it returned."""
    try:
        return _run(fn, avals, _META, name)
    except InputMutationError:
        raise
    except Exception:  # noqa: BLE001 - no meta kernel, or needs real data
        pass
    first: tuple[torch.device, Exception] | None = None
    for where in dict.fromkeys((device, _CPU)):
        try:
            return _run(fn, avals, where, name)
        except InputMutationError:
            raise
        except Exception as err:  # noqa: BLE001 - reported below if no device works
            first = first or (where, err)
    where, err = first
    raise TorchCallError(
        f"the PyTorch function {name} raised {type(err).__name__}: {err}\n"
        f"(while inferring output shapes on zeros on {where}; pass output_shapes= to "
        f"jaxify to skip inference)"
    ) from err
