"""Output shapes and dtypes of a PyTorch function, without example arguments.

First on the ``meta`` device (no data, no computation); if an op has no meta
kernel (or the code needs real data: NumPy, ``.item()``), one real call on
zeros. Either run also refuses a function that writes into its inputs there
(a write made only for some values waits for a real call, and the first real
call gets copies of its inputs).

NOTE [inference on the call's device]
A function that closes over a tensor (a weight made with ``device="cuda"``, a
table) fails on meta inputs, because PyTorch refuses to mix a meta tensor with
a real one (0-d tensors aside), so its shapes come from the call on zeros;
and zeros on the CPU fail against a CUDA tensor. So the zeros are made on the
device the call will run on (``convert.call_device``: a concrete argument's
device, else JAX's default device). That is a guess when every argument is
traced: under ``jax.jit``, a call on arrays committed to another device than
JAX's default runs there, and tracers carry no device to tell. So when the
zeros fail on the call's device, the other GPUs PyTorch sees are tried (a
jitted call on ``jax.devices()[1]`` closing over a weight on ``cuda:1``),
then the CPU (``devices_to_try``). Shapes and dtypes do not depend on the
device, so the first device that works answers; if none does, the error
reported is the one from the call's device. Only a function that fails on
every device pays for the extra calls, once per signature.

NOTE [empty outputs inferred on zeros]
JAX needs output shapes fixed by the input shapes and dtypes. A function
whose output shape depends on the input's values (``torch.nonzero``,
``x[x > 0]``) has no meta kernel, so its shapes come from the call on zeros.
A real call that then returns another shape is refused by the runner, but
only if it runs: an output inferred empty on zeros (``nonzero`` of zeros has
no rows) is known to XLA without running anything, so XLA dropped the call
and every call returned that empty array, silently. So when the call on
zeros leaves an output empty, the function runs once more, on ones; an
output whose shape differs there is refused now, naming both shapes. A
function that fails on ones cannot be checked, and is refused too: it may
pass ``output_shapes=``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import torch

from .convert import torch_dtype
from .dropout_layouts import LayoutDependentDraws
from .module_modes import recording_module_modes
from .random_state import RandomOpsSeen
from .real_writes import trial_run
from .replayed_calls import Effects
from .runtime import InputMutationError, TorchCallError
from .torch_fn import Aval


_META = torch.device("meta")
_CPU = torch.device("cpu")


class Inferred(NamedTuple):
    """What inference found: the function's outputs, where it ran, and what
    else it did: drew random numbers, wrote state it keeps (NOTE
    [derivatives replay the value's draws] in replayed_calls.py)."""

    outputs: Any
    device: torch.device  # meta, or where the zeros were
    effects: Effects


def _run(
    fn: Callable[..., Any], avals: Sequence[Aval], device: torch.device, name: str, make: Callable[..., torch.Tensor] = torch.zeros
) -> tuple[Any, Effects]:
    """``fn``'s outputs on inputs made on ``device`` by ``make`` (zeros, or
    empty on meta), and what else it did."""
    make = torch.empty if device == _META else make
    inputs = [make(a.shape, dtype=torch_dtype(a.dtype), device=device) for a in avals]
    versions = [t._version for t in inputs]
    # NOTE [trial runs do not write to real tensors]
    with torch.no_grad(), recording_module_modes() as modes, trial_run() as run, RandomOpsSeen() as random_ops:
        with LayoutDependentDraws() as layouts:
            outputs = fn(*inputs)
    mutated = [i for i, (t, v) in enumerate(zip(inputs, versions)) if t._version != v]
    if mutated:
        raise InputMutationError(
            f"the PyTorch function {name} mutated input(s) {mutated} in place "
            f"(seen while inferring its output shapes); t2j_ad functions must "
            f"not write into their inputs (JAX arrays are immutable). Clone the "
            f"input first (x = x.clone()) or use the out-of-place op."
        )
    effects = Effects(random_ops.seen, run.state_written(), modes.modes(), random_ops.seen and layouts.seen, random_ops.given)
    return outputs, effects


def devices_to_try(device: torch.device) -> list[torch.device]:
    """Where inference makes its zeros, in order: ``device`` (the call's), the
    other GPUs PyTorch sees when it is a GPU, then the CPU (NOTE [inference
    on the call's device])."""
    others: list[torch.device] = []
    if device.type == "cuda":
        others = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return list(dict.fromkeys((device, *others, _CPU)))


def infer_outputs(fn: Callable[..., Any], avals: Sequence[Aval], name: str, device: torch.device = _CPU) -> Inferred:
    """Run ``fn`` on meta tensors, else once on zeros on ``device``, the
    call's (then on the other devices ``devices_to_try`` names: NOTE
    [inference on the call's device]); return what it returned, and where."""
    try:
        outputs, effects = _run(fn, avals, _META, name)
        return Inferred(outputs, _META, effects)
    except InputMutationError:
        raise
    except Exception:  # noqa: BLE001 - no meta kernel, or needs real data
        pass
    first: tuple[torch.device, Exception] | None = None
    for where in devices_to_try(device):
        try:
            outputs, effects = _run(fn, avals, where, name)
        except InputMutationError:
            raise
        except Exception as err:  # noqa: BLE001 - reported below if no device works
            first = first or (where, err)
            continue
        _check_empty_outputs(fn, avals, where, name, outputs)
        return Inferred(outputs, where, effects)
    where, err = first
    raise TorchCallError(
        f"the PyTorch function {name} raised {type(err).__name__}: {err}\n"
        f"(while inferring output shapes on zeros on {where}; pass output_shapes= to "
        f"jaxify to skip inference)"
    ) from err


def _check_empty_outputs(fn: Callable[..., Any], avals: Sequence[Aval], where: torch.device, name: str, outputs: Any) -> None:
    """Refuse a function an output of which the call on zeros left empty,
    unless a call on ones gives every output the same shape (NOTE [empty
    outputs inferred on zeros])."""
    leaves = jax.tree_util.tree_leaves(outputs)
    if not any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in leaves):
        return
    advice = (
        "JAX needs output shapes fixed by the input shapes and dtypes: return a fixed-size result "
        "(torch.nonzero_static(x, size=n), or a mask and torch.where instead of x[mask]), close over a "
        "Python number that sets a shape (functools.partial(f, n=2): as an argument it is a 0-d array), "
        "or pass output_shapes= with the shapes every call returns"
    )
    try:
        on_ones, _ = _run(fn, avals, where, name, torch.ones)
    except InputMutationError:
        raise
    except Exception as err:  # noqa: BLE001 - unknown: refused below, naming the error
        raise TorchCallError(
            f"the PyTorch function {name} returned an empty output on zeros (inferring its output shapes "
            f"on {where}) and raised {type(err).__name__} on ones: {err}. So t2j_ad cannot tell whether "
            f"its output shapes depend on the input values. {advice}."
        ) from err
    if jax.tree_util.tree_structure(on_ones) != jax.tree_util.tree_structure(outputs):
        raise TorchCallError(
            f"the output structure of the PyTorch function {name} depends on its input values: "
            f"{jax.tree_util.tree_structure(outputs)} on zeros, {jax.tree_util.tree_structure(on_ones)} on "
            f"ones (inferring its output shapes on {where}). {advice}."
        )
    for i, (zeros_out, ones_out) in enumerate(zip(leaves, jax.tree_util.tree_leaves(on_ones))):
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in (zeros_out, ones_out)]
        if shapes[0] != shapes[1]:
            raise TorchCallError(
                f"the output shapes of the PyTorch function {name} depend on its input values: output {i} "
                f"has shape {shapes[0]} on zeros and {shapes[1]} on ones (inferring its output shapes on "
                f"{where}). {advice}."
            )
