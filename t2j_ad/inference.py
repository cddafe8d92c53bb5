"""Output shapes and dtypes of a PyTorch function, without example arguments.

First on the ``meta`` device (no data, no computation); if an op has no meta
kernel (or the code needs real data: NumPy, ``.item()``), a real call on
zeros, then one on ones (NOTE [a second run, on ones]); on ones alone if
zeros fail (NOTE [inference on ones when zeros fail]). Either way it also
refuses a function that writes into its inputs there (a write made only
for some values waits for a real call, and the first real call gets copies
of its inputs).

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

NOTE [a second run, on ones]
A function whose shapes come from the call on zeros has code that needs
values (no meta kernel, ``.item()``, NumPy, ``if x.sum() > 0``), and what it
does may depend on them. So it runs once more, on ones, for two things:

- Empty outputs. JAX needs output shapes fixed by the input shapes and
  dtypes. A real call that returns other shapes than inferred is refused by
  the runner, but only if it runs: an output inferred empty on zeros
  (``nonzero`` of zeros has no rows) is known to XLA without running
  anything, so XLA dropped the call and every call returned that empty
  array, silently. An output whose shape differs on ones is refused now,
  naming both shapes (any output: a shape set by an argument's value, as
  ``F.pad(x, (n, n))``, is refused here rather than by the first real call);
  when the run on ones fails, a function with an output empty on zeros
  cannot be checked and is refused too (it may pass ``output_shapes=``).
- Effects. A draw, an in-place write or a rebinding made only for some
  values (``if (x > 0).any(): x = dropout(x)``) was not seen on zeros, so
  the function's derivatives drew a new mask and wrote the state again,
  silently. Effects seen on ones and not on zeros are the function's (a
  derivative replays what its value call did, whichever branch that took);
  two runs that each draw or write, differently, are refused. A failure on
  ones leaves the effects seen on zeros. Values that neither zeros nor ones
  reach stay unseen (NOTE [derivatives replay the value's draws] in
  replayed_calls.py).

NOTE [inference on ones when zeros fail]
Some functions refuse zeros, for reasons of their own: a
``torch.distributions`` object checks its arguments (``Normal(mu,
sigma)`` with ``sigma`` an input: a scale of 0 is invalid; so are a
``Gamma``'s zero concentration, a ``Dirichlet``'s), and a validation reads
values, so the meta run fails too. Every such call was refused until the
user passed ``output_shapes=``. So when the run on zeros fails on every
device, the function runs on ones (same device order), and its shapes and
effects come from there. Nothing checks them against a second run: an
output empty on ones is refused (``nonzero`` of a mask), as an empty output
is when the second run fails; any other shape that depends on the values is
refused by the first real call that returns another (the runner checks
every output). Effects made only for values other than ones stay unseen,
as those neither zeros nor ones reach do above. If ones fail too, the error
names what each run raised.

NOTE [trial runs outside the caller's trace]
A function's first call often comes inside the caller's ``jax.jit`` (or
``jax.grad``, ``make_jaxpr``, ``lower``), and the trial runs above are made
then, while JAX traces. A PyTorch function that does JAX work of its own
(another jaxified function it calls, a ``jnp`` op on a NumPy copy) had that
work staged into the caller's program: the conversion to NumPy met a tracer
and the first call failed, or an inner function that keeps state ran, with
the trial runs' zeros and ones, on every run of the compiled program. A
real call runs on XLA's thread, outside any trace; so the trial runs run
outside it too (``outside_jax_traces``), and JAX evaluates their work at
once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import torch
from torch.overrides import TorchFunctionMode

from ._jax_internals import outside_jax_traces
from .convert import torch_dtype
from .dropout_layouts import LayoutDependentDraws
from .module_modes import UninitializedModuleError, recording_module_modes
from .module_structure import ModuleChangedError
from .random_state import RandomOpsSeen
from .real_writes import apart_from_trial_runs, trial_run, trial_running
from .replayed_calls import Effects
from .rules.fallbacks import first_line
from .runtime import InputMutationError, TorchCallError, mutation_message
from .torch_fn import Aval


# Refusals a trial run raises for the function itself, never taken for a
# missing meta kernel or an op that needs real data.
_RAISED_AS_THEY_ARE = (InputMutationError, UninitializedModuleError, ModuleChangedError)

_META = torch.device("meta")
_CPU = torch.device("cpu")


class Inferred(NamedTuple):
    """What inference found: the function's outputs, where it ran, and what
    else it did: drew random numbers, wrote state it keeps (NOTE
    [derivatives replay the value's draws] in replayed_calls.py)."""

    outputs: Any
    device: torch.device  # meta, or where the zeros (or ones) were
    effects: Effects
    runs: str = "on zeros and on ones"  # the real calls it took, for the runtime's errors


def _run(
    fn: Callable[..., Any],
    avals: Sequence[Aval],
    device: torch.device,
    name: str,
    make: Callable[..., torch.Tensor] = torch.zeros,
    modules: Sequence[torch.nn.Module] = (),
    dicts: Sequence[dict[Any, Any]] = (),
) -> tuple[Any, Effects]:
    """``fn``'s outputs on inputs made on ``device`` by ``make`` (zeros, or
    empty on meta), and what else it did; ``modules``: those it refers to
    (``module_modes.referenced_modules``)."""
    make = torch.empty if device == _META else make
    seen_autocast = _RefuseAutocast() if device == _META else contextlib.nullcontext()
    # Apart from the trial run of a function that calls this one, if any
    # (NOTE [a nested call's effects are its caller's] in real_writes.py).
    callers = apart_from_trial_runs() if trial_running.depth else contextlib.nullcontext()
    # Outside torch.inference_mode, whose tensors keep no version to check
    # (NOTE [calls inside torch.inference_mode] in runtime.py).
    with callers, torch.inference_mode(False):
        inputs = [make(a.shape, dtype=torch_dtype(a.dtype), device=device) for a in avals]
        versions = [t._version for t in inputs]
        # NOTE [trial runs do not write to real tensors]
        # Grad mode on and autocast off, as the call it infers for runs (NOTE
        # [calls run with grad mode on], NOTE [calls run without the caller's
        # autocast] in runtime.py).
        with torch.enable_grad(), torch._C._DisableAutocast(), recording_module_modes(modules) as modes, trial_run(dicts, modules) as run, RandomOpsSeen() as random_ops:
            with LayoutDependentDraws() as layouts, seen_autocast, outside_jax_traces():
                outputs = fn(*inputs)
    mutated = [i for i, (t, v) in enumerate(zip(inputs, versions)) if t._version != v]
    if mutated:
        err = InputMutationError(mutation_message(name, mutated, where=" (seen while inferring its output shapes)"))
        err.mutated = tuple(mutated)
        raise err
    # A jaxified call the function made draws and writes as the function
    # does (NOTE [a nested call's effects are its caller's] in real_writes.py).
    effects = Effects(
        random_ops.seen or run.nested_draws,
        run.state_written(),
        modes.modes(),
        random_ops.seen and layouts.seen,
        random_ops.given + run.nested_given_draws,
        run.recomputed,
    )
    return outputs, effects


class _AutocastOnMeta(Exception):
    """A meta run met an autocast region the function entered itself."""


class _RefuseAutocast(TorchFunctionMode):
    """Stops a run on meta tensors at the first op inside an autocast region
    the function enters itself (``with torch.autocast("cpu", ...)``): that
    region casts the real device's tensors and not meta ones, so the meta
    run would infer the uncast dtypes and every call would be refused. The
    run on zeros, on the call's device, infers what the calls return. (The
    caller's own region is off in trial runs: NOTE [calls run without the
    caller's autocast] in runtime.py.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if _any_autocast():
            raise _AutocastOnMeta(f"{func} ran inside an autocast region")
        return func(*args, **(kwargs or {}))


_any_autocast = torch._C._is_any_autocast_enabled


def devices_to_try(device: torch.device) -> list[torch.device]:
    """Where inference makes its zeros, in order: ``device`` (the call's), the
    other GPUs PyTorch sees when it is a GPU, then the CPU (NOTE [inference
    on the call's device])."""
    others: list[torch.device] = []
    if device.type == "cuda":
        others = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return list(dict.fromkeys((device, *others, _CPU)))


def infer_outputs(
    fn: Callable[..., Any],
    avals: Sequence[Aval],
    name: str,
    device: torch.device = _CPU,
    modules: Sequence[torch.nn.Module] = (),
    dicts: Sequence[dict[Any, Any]] = (),
) -> Inferred:
    """Run ``fn`` on meta tensors, else on zeros (and ones: NOTE [a second
    run, on ones]) on ``device``, the call's (then on the other devices
    ``devices_to_try`` names: NOTE [inference on the call's device]); return
    what it returned, and where. ``dicts``: those ``fn`` can reach
    (``trial_caches.dicts_named_by``). ``modules``: the modules ``fn`` refers to,
    whose training flags its effects depend on (NOTE [a graph per training
    mode] in module_modes.py)."""
    try:
        outputs, effects = _run(fn, avals, _META, name, modules=modules, dicts=dicts)
        return Inferred(outputs, _META, effects)
    except _RAISED_AS_THEY_ARE:
        raise
    except Exception:  # noqa: BLE001 - no meta kernel, or needs real data
        pass
    first: tuple[torch.device, Exception] | None = None
    for where in devices_to_try(device):
        try:
            outputs, effects = _run(fn, avals, where, name, modules=modules, dicts=dicts)
        except _RAISED_AS_THEY_ARE:
            raise
        except Exception as err:  # noqa: BLE001 - reported below if no device works
            first = first or (where, err)
            continue
        return Inferred(outputs, where, _checked_on_ones(fn, avals, where, name, outputs, effects, modules, dicts))
    # NOTE [inference on ones when zeros fail]
    on_ones: Exception | None = None
    for where in devices_to_try(device):
        try:
            outputs, effects = _run(fn, avals, where, name, torch.ones, modules, dicts)
        except _RAISED_AS_THEY_ARE:
            raise
        except Exception as err:  # noqa: BLE001 - reported below with the error on zeros
            on_ones = on_ones or err
            continue
        _refuse_unchecked_empty(name, where, outputs)
        return Inferred(outputs, where, effects, "on ones alone (it failed on zeros)")
    where, err = first
    raise TorchCallError(
        f"the PyTorch function {name} raised {type(err).__name__}: {err}\n"
        f"(while inferring output shapes on zeros on {where}; on ones it raised {first_line(on_ones)}; pass "
        f"output_shapes= to jaxify or jaxify_module to skip inference)"
    ) from err


_FIXED_SHAPES_ADVICE = (
    "JAX needs output shapes fixed by the input shapes and dtypes: return a fixed-size result "
    "(torch.nonzero_static(x, size=n), or a mask and torch.where instead of x[mask]), "
    "or pass output_shapes= with the shapes every call returns"
)


def _first_empty(outputs: Any) -> tuple[int, torch.Tensor] | None:
    """The first output with no elements, and its index; None if none."""
    for i, leaf in enumerate(jax.tree_util.tree_leaves(outputs)):
        if isinstance(leaf, torch.Tensor) and leaf.numel() == 0:
            return i, leaf
    return None


def _refuse_unchecked_empty(name: str, where: torch.device, outputs: Any) -> None:
    """Raise for an empty output of a function inferred on ones alone
    (NOTE [inference on ones when zeros fail])."""
    empty = _first_empty(outputs)
    if empty is not None:
        i, leaf = empty
        raise TorchCallError(
            f"the PyTorch function {name} failed on zeros and returned an empty output {i} (shape "
            f"{tuple(leaf.shape)}) on ones (inferring its output shapes on {where}), so t2j_ad cannot tell "
            f"whether its output shapes depend on the input values. {_FIXED_SHAPES_ADVICE}."
        )


def _checked_on_ones(
    fn: Callable[..., Any],
    avals: Sequence[Aval],
    where: torch.device,
    name: str,
    outputs: Any,
    on_zeros: Effects,
    modules: Sequence[torch.nn.Module],
    dicts: Sequence[dict[Any, Any]],
) -> Effects:
    """The effects of a function whose shapes the call on zeros gave, also
    as a call on ones sees them; raises for an output whose shape depends
    on the input's values (NOTE [a second run, on ones])."""
    empty = _first_empty(outputs) is not None
    try:
        on_ones, ones_effects = _run(fn, avals, where, name, torch.ones, modules, dicts)
    except _RAISED_AS_THEY_ARE:
        raise
    except Exception as err:  # noqa: BLE001 - only an empty output needs the run on ones
        if not empty:
            return on_zeros
        raise TorchCallError(
            f"the PyTorch function {name} returned an empty output on zeros (inferring its output shapes "
            f"on {where}) and raised {type(err).__name__} on ones: {err}. So t2j_ad cannot tell whether "
            f"its output shapes depend on the input values. {_FIXED_SHAPES_ADVICE}."
        ) from err
    # Every output, not only empty ones: a shape set by an input's value
    # (F.pad(x, (n, n)) with n an argument) is refused here, naming both
    # shapes, rather than by the first real call.
    _check_shapes_agree(name, where, outputs, on_ones)
    if on_zeros.same_as(ones_effects) or not ones_effects:
        return on_zeros
    if not on_zeros:
        return ones_effects
    raise TorchCallError(
        f"the PyTorch function {name} draws random numbers or updates state it keeps differently on zeros "
        f"than on ones (inferring its output shapes on {where}), so its derivatives cannot replay what its "
        f"value call does. Make its draws and in-place writes the same whatever the input's values (draw, "
        f"then select with torch.where(cond, dropped, x); update with torch.where(cond, update, 0))."
    )


def _check_shapes_agree(name: str, where: torch.device, on_zeros: Any, on_ones: Any) -> None:
    """Raise unless the outputs on zeros and on ones have one structure and
    the same shapes (NOTE [a second run, on ones])."""
    if jax.tree_util.tree_structure(on_ones) != jax.tree_util.tree_structure(on_zeros):
        raise TorchCallError(
            f"the output structure of the PyTorch function {name} depends on its input values: "
            f"{jax.tree_util.tree_structure(on_zeros)} on zeros, {jax.tree_util.tree_structure(on_ones)} on "
            f"ones (inferring its output shapes on {where}). {_FIXED_SHAPES_ADVICE}."
        )
    for i, (zeros_out, ones_out) in enumerate(zip(jax.tree_util.tree_leaves(on_zeros), jax.tree_util.tree_leaves(on_ones))):
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) and not t.is_nested else None for t in (zeros_out, ones_out)]
        if shapes[0] != shapes[1]:
            raise TorchCallError(
                f"the output shapes of the PyTorch function {name} depend on its input values: output {i} "
                f"has shape {shapes[0]} on zeros and {shapes[1]} on ones (inferring its output shapes on "
                f"{where}). {_FIXED_SHAPES_ADVICE}."
            )
