"""The derivatives of a function with side effects replay its value call:
the same random draws, and no second write into the state it keeps.

NOTE [derivatives replay the value's draws]
A derivative is a PyTorch call of its own (NOTE [every derivative is a
PyTorch function]) that runs the function's forward again. For a function
that draws random numbers (dropout), the second forward drew new numbers:
``jax.grad`` of a loss that needs the value (a sum of squares) seeded the
gradient with one dropout mask and pulled it back through another, so the
gradient was that of no mask at all (with ``p=0.5``, half the true one on
average), and ``jax.value_and_grad`` or ``jax.jvp`` paired a value with the
derivative of another draw. ``torch.utils.checkpoint`` meets the same
problem in its recompute, and restores the random state for it. A function
that writes into tensors it keeps between calls (running statistics) wrote
again in every derivative call (NOTE [derivatives do not write again] in
state_writes.py).

So the JVP rule of such a function (``effects``: what shape inference saw it
do; a function whose ``output_shapes`` skipped that run is not known to have
any, and keeps the old behaviour), and of the function batched by
``jax.vmap`` first, binds two other functions of the same base:

- ``keeping``: the function, returning also one more output, the *token*:
  bytes holding the state of the call device's generator *before* it ran
  (``STATE_BYTES``, the CPU generator's size; a CUDA generator's 16 bytes
  are zero-padded), for a function that draws, then the state of each
  generator passed as ``generator=`` before each draw from it (NOTE [random
  state in trial runs] in random_state.py), then the value each tensor it
  writes had before it wrote it (NOTE [derivatives do not write again]
  in state_writes.py). It draws from PyTorch's global generator as the
  function itself does, so the numbers after a given ``torch.manual_seed``
  are PyTorch's, and it makes the function's writes, once.
- ``replaying``: the function with the token as one more input, after its
  own. It sets the generator and the tensors it writes to the token's
  values, runs, and puts them back as it found them, so it draws the
  value's numbers and computes from the value's state, and leaves the
  global sequence and the state where the value call left them.
  Deterministic and without effects, so derivatives of it (its Jvp, the
  transpose's Vjp, a Hessian's Jvp of that Vjp) take the ordinary rules and
  all replay the same call.

The token ties every derivative call to the value call: JAX cannot leave the
value call out (``jax.grad`` of a loss linear in the outputs needs no value
under ``jax.jit``), and runs it first. The JVP rule of ``keeping`` itself (an
outer derivative over the value call) maps back to the same pair. In graph
mode both keep their graphs (NOTE [the generator around a graph]). Batched
(``jax.vmap``), the token is batched too, one per example, in the loop that
random ops and running statistics need under ``jax.vmap``. Batched over
tangents alone (a Jacobian or a Hessian: the token unbatched), a replay runs
under ``torch.vmap`` with ``randomness="same"``: it draws the value's numbers
once for every tangent, as each tangent's own replay would (on CUDA, a
function that draws loops over the tangents instead: NOTE [dropout on CUDA
under torch.vmap] in transforms.py). Calls of either
kind hold one process-wide lock: a replaying call sets the generator every
thread draws from, and puts back tensors another thread's value call would
write meanwhile (a pmap over CPU devices).

NOTE [the generator around a graph]
A graph (``compile="graph"`` or ``"inductor"``) replays the aten ops the
trace recorded, random ones included, which draw from PyTorch's generator
as it is when the graph runs; Python that reads or sets the generator runs
once, at trace time, and the graph would keep what it read then. So for a
call that runs the function once (a plain ``keeping`` call, a replay whose
token no ``jax.vmap`` batches), the runner itself reads the generator state
before the call and writes it into the token the call returned (``keeping``),
or sets the generator from the token before the call and back after it
(``replaying``): ``GeneratorAround``, around each call, eager or graph. The
function then leaves the generator alone on its first run within one pass
of the derived function (one eager run, one trace: ``GeneratorAround.passes``
counts them). A second run within a pass (a loop over tangents that
``torch.vmap`` refused, or ``vmap_method="sequential"``) sets the generator
from the token itself, as in eager mode; a trace that meets one fails, so
that derived function runs eagerly with a ``FallbackWarning``, since an
unrolled loop would draw on where each run must start again. A call that
runs the function once per example (its token batched by ``jax.vmap``: each
example replays its own value's draws) sets the generator itself for each
example, and runs eagerly in every compile mode, said once by a
``FallbackWarning`` (``draws_per_example``). On a GPU such graphs run without
CUDA-graph capture, whose replays the runner could not wrap.

NOTE [calls with effects under jax.jit]
To JAX a call is pure: it may merge two, drop one, run one once where the
program says many times, or run two in either order. A call that draws or
keeps state must run as often as the program says, and in its order, as in
PyTorch, so four places keep it:

- XLA merges equal operations on equal operands and drops those whose
  results nobody uses. Under ``jax.jit`` two calls of a function that draws
  on the same inputs came back with the same numbers (``jax.value_and_grad``
  of ``(d(x) * d(x)).sum()`` squared one mask, where PyTorch multiplies two),
  and a module in training mode called twice updated its running statistics
  once. So the custom call of such a function is lowered as having side
  effects, which XLA neither merges nor drops.
- XLA orders operations only by their data. A call whose input was ready
  first ran first, so two calls drew each other's numbers, and a module
  that counts its calls saw them in another order. So each such call is
  handed, as one more operand, the first result of the one lowered before
  it into the same block, and ignores it (``_jax_internals.in_program_order``;
  the runner drops it, ``_Runner.n_in``). An optimization barrier does not
  do it: XLA on the CPU drops barriers and their control dependencies. A
  call inside a nested ``jax.jit``, ``jax.checkpoint`` or ``custom_jvp``
  was lowered apart from its caller's block (a function of its own, or
  lowered once and copied in), so those are lowered in place when they hold
  such a call (``_jax_internals.lower_nested_calls_in_place``; a nested jit
  only where it says nothing of shardings or layouts), and so are
  ``lax.cond``, ``lax.scan`` and while loops (JAX lowers each once, aside,
  too) and a ``closed_call`` holding such a call (how JAX wraps a loop's
  body). The first such call in a branch or a loop's body takes the last
  one before the cond or loop (their regions may use values from before
  them), and a cond or loop that holds one counts as such a call for the
  calls after it in its block: they take all its results, since XLA
  forwards a loop's unchanged carries past the loop. Without that, a call
  in a cond ran before the call the program makes first, drawing its
  numbers, and calls after a scan ran before the scan's. Still ordered by
  their data alone: the per-device calls of a sharded ``jit``.
- Before lowering, JAX's dead-code elimination dropped a call none of whose
  outputs the jitted function uses, and a ``jit``, ``scan``, ``cond`` or
  ``while_loop`` none of whose outputs it uses: the call drew nothing, and a
  module called to recompute its batch-norm statistics updated nothing. Its
  rule now keeps such a call, and the rules of the primitives that hold
  jaxprs keep one that holds such a call
  (``_jax_internals.run_every_call``).
- ``lax.scan``'s partial evaluation (``jax.grad`` or ``jax.checkpoint`` of a
  scan) runs the loop-invariant part of the loop's forward pass once,
  before the loop. A value call that read only loop-invariant inputs drew
  one mask for every step, where the scan's value drew one per step. Under
  ``jax.grad`` a loop whose forward pass holds such a call, at any depth,
  now hoists nothing (its other loop-invariant residuals are computed and
  saved in each step, memory that grows with the length); under
  ``jax.checkpoint`` the call itself stays in the loop. ``while_loop``'s
  partial evaluation (``jax.linearize``) runs the whole loop again inside
  the linear function, where such a call would draw or update again; that
  is refused with an error naming the call.
- ``jax.vmap`` of a ``lax.cond`` whose predicate it batches runs every
  branch for every example and selects, and of a ``while_loop`` whose
  predicate it batches, every step until the last example is done: a call
  in them counted 3 where the program made 1. Refused, naming the call, as
  JAX refuses its own IO callbacks there
  (``_jax_internals._refuse_batched_predicates``).

A call is an effect to JAX only in these rules, not in its type: a JAX
effect would cost every jitted call of such a function JAX's Python
dispatch path (90 us more per call of a jitted dropout on the CPU, 125 us
instead of 34 us), and calls without effects are left to JAX. A JAX whose
internals have moved keeps its own behaviour there.

NOTE [a value call runs once]
``jax.checkpoint`` (remat) runs the forward pass again in the backward pass
instead of saving its results. Run again, a value call drew new numbers and
wrote the state again, and its new token made the derivatives replay the
second draw: the gradient of another mask than the value's, and batch norm
updated twice. So a ``keeping`` call is never run again under
``jax.checkpoint``, whatever its policy: its outputs and token are saved,
as for a policy that saves them (``_jax_internals.register_remat_rule``).
The replaying calls are deterministic, and follow the policy.

What a function does depends on the training flags of the modules it runs
(dropout draws only in training mode), so the effects are found again, by
another trial run, when the JVP rule meets flags other than inference saw.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from .dropout_layouts import row_major_dropout
from .functorch_levels import outside_transforms, unbatched_value
from .module_modes import NO_MODES, ModuleModes, modes_hold
from .random_state import DrawWatch, GeneratorStatesKept, GeneratorStatesReplayed, unreplayable_given_draws
from .state_writes import (
    NO_WRITES,
    ReplayedBindings,
    StateWrites,
    WritesPutBack,
    module_slots_entered,
    pack,
    unpack,
    unpack_into,
)
from .torch_fn import Aval, BaseFn, TorchFn, Vmap

# The CPU generator's state (mt19937), the largest a generator has.
STATE_BYTES = int(torch.default_generator.get_state().numel())
# Held by every keeping and replaying call (NOTE [derivatives replay the
# value's draws]); reentrant, for a call that reaches another on its thread.
_effects_lock = threading.RLock()
# Per thread: the key of the variant whose runner read or set the generator
# around the pass running now, and how often the function has run in it
# (NOTE [the generator around a graph]).
_pass = threading.local()


@dataclasses.dataclass(frozen=True, eq=False)
class Effects:
    """What a function does besides computing its outputs, as a trial run
    saw it: whether it draws random numbers, what state it writes in place,
    and the training flags of the modules it ran then."""

    draws_random: bool
    writes: StateWrites
    modes: ModuleModes
    # Whether it gives a dropout whose mask follows the input's layout an
    # input not laid out row-major (NOTE [dropout masks follow the layout]).
    draws_by_layout: bool = False
    # How many of its draws are from generators passed as ``generator=``
    # (NOTE [random state in trial runs] in random_state.py).
    given_draws: int = 0
    # Each (module, name) a hook of PyTorch's binds anew on every call, from
    # the module's own tensors: no state (NOTE [attributes PyTorch's hooks
    # recompute] in real_writes.py).
    recomputed: tuple[tuple[torch.nn.Module, str], ...] = ()

    def __bool__(self) -> bool:
        return self.draws_random or bool(self.writes)

    def same_as(self, other: Effects) -> bool:
        """Whether ``other`` draws and updates as this does (the same slots)."""
        return self is other or (
            self.draws_random == other.draws_random
            and self.draws_by_layout == other.draws_by_layout
            and self.given_draws == other.given_draws
            and self.writes.same_slots(other.writes)
        )

    def within(self, other: Effects) -> bool:
        """Whether the ``keeping`` and ``replaying`` functions made for
        ``other`` keep and replay these effects too: this draws only where
        ``other`` does, and updates only slots ``other`` updates (NOTE [fewer
        effects than a program was traced for])."""
        return self is other or (
            (not self.draws_random or (other.draws_random and self.draws_by_layout == other.draws_by_layout))
            and self.given_draws == other.given_draws
            and self.writes.slots_within(other.writes)
        )


NO_EFFECTS = Effects(False, NO_WRITES, NO_MODES)


def effects(base: BaseFn) -> Effects:
    """What ``base`` does besides computing its outputs (NOTE [derivatives
    replay the value's draws]): as its shape inference saw, or, when the
    modules it runs have other training flags now, as a new trial run sees.
    None of it when ``output_shapes`` skipped inference: the function is
    then never run to learn anything (as torch2jax promises), and its
    derivatives draw and write again, as before."""
    seen: Effects | None = base.effects
    if seen is None or getattr(base, "replays", False):
        return NO_EFFECTS
    structure = getattr(base, "structure", None)
    if getattr(base, "effects_root", None) is not None or (
        modes_hold(seen.modes) and (structure is None or structure.holds())
    ):
        return seen  # a keeping function keeps the effects it was made for
    with base.lock:
        by_modes = base.__dict__.setdefault("effects_by_modes", {})
        # NOTE [a submodule replaced after a call] in module_structure.py
        # NOTE [a forward replaced after a trace] in module_modes.py
        key = (seen.modes.now(), None if structure is None else structure.now())
        found = by_modes.get(key)
        if found is None:
            if len(by_modes) >= _EFFECTS_KEPT:  # a name a loop binds afresh each step: no end of keys
                by_modes.clear()
            found = by_modes[key] = base.find_effects()
    return found


# How many settings of a function's flags, submodules and names the effects
# of are kept (NOTE [a name rebound after a call]).
_EFFECTS_KEPT = 16


def effects_held() -> threading.RLock:
    """The lock every keeping and replaying call holds, and every plain call
    of a function that draws (NOTE [lock order] in runtime.py)."""
    return _effects_lock


def _generator(inputs: Sequence[torch.Tensor]) -> torch.Generator:
    """The default generator of the call's device (the first input's)."""
    device = inputs[0].device if inputs else torch.device("cpu")
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else 0]
    return torch.default_generator


def _token_pieces(seen: Effects) -> list[int]:
    """The size in bytes of each piece of the token, in order: the generator
    state (if the function draws), the state of a given generator before
    each draw from it, then the value of every slot written."""
    return [STATE_BYTES] * (seen.draws_random + seen.given_draws) + seen.writes.slot_bytes()


def _generator_pieces(seen: Effects) -> int:
    """How many pieces of the token hold generator states (the first ones)."""
    return int(seen.draws_random) + seen.given_draws


def _padded(state: torch.Tensor) -> torch.Tensor:
    """A generator's state as one token piece (a CUDA generator's 16 bytes zero-padded)."""
    piece = torch.zeros(STATE_BYTES, dtype=torch.uint8)
    piece[: state.numel()] = state
    return piece


def _state_in(token: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """The generator state whose ``size`` bytes start at ``start`` in
    ``token``, as a fresh CPU tensor: ``set_state`` reads a tensor with a
    storage offset (one example's row of a batch) from the wrong place, or
    crashes. A slice and a copy made outside transforms, so plain tensors
    inside them too."""
    with outside_transforms():
        return token[start : start + size].to("cpu", copy=True)


def token_input(base: BaseFn) -> int | None:
    """Where a ``replaying`` function's token is among the inputs of every
    TorchFn of it (its last input of its own, ahead of the tangents and
    cotangents transforms append); None for any other function."""
    return len(base.in_avals) - 1 if getattr(base, "replays", False) else None


def _token_aval(seen: Effects) -> Aval:
    return Aval((sum(_token_pieces(seen)),), np.dtype(np.uint8))


def _variant(
    base: BaseFn,
    fn: Callable[..., Any],
    seen: Effects,
    *,
    in_avals: tuple[Aval, ...],
    out_avals: tuple[Aval, ...],
    out_names: tuple[str, ...],
    torch_out_dtypes: tuple[Any, ...],
    put_back: WritesPutBack | None,
    replays: bool,
    key: object,
) -> BaseFn:
    """A function of ``base``'s root with the effects ``seen``; its calls hold
    the lock and, with ``put_back``, put back what they wrote. ``key`` tells
    ``fn`` that its runner handles the generator (``_first_run_in_pass``)."""
    variant = BaseFn(
        fn,
        name=base.name,
        # A loop over examples updates kept state once per example (NOTE
        # [derivatives do not write again]); a replay batched over examples
        # loops too (transforms._make_vmap), over tangents it need not.
        vmap_method="sequential" if seen.writes and not replays else base.vmap_method,
        in_avals=in_avals,
        out_avals=out_avals,
        out_names=out_names,
        torch_out_dtypes=torch_out_dtypes,
        mutation_checked=base.mutation_checked,
        inferred_on=base.inferred_on,
        inferred_runs=base.inferred_runs,
        autograd_vjp=base.autograd_vjp,
        compile=base.compile,
    )
    variant.effects_root = base  # type: ignore[attr-defined]
    variant.keeps_inputs = base.keeps_inputs  # NOTE [inputs kept past a call]: its calls run on copies too
    variant.referenced_modules = getattr(base, "referenced_modules", ())  # type: ignore[attr-defined]
    variant.referenced_dicts = getattr(base, "referenced_dicts", ())  # type: ignore[attr-defined]
    variant.replays = replays  # type: ignore[attr-defined]
    variant.generator_key = key  # type: ignore[attr-defined]
    variant.effects = seen
    variant.find_effects = base.find_effects

    @contextlib.contextmanager
    def call_effects() -> Iterator[None]:
        with _effects_lock:
            if put_back is None:
                yield
            else:
                with put_back.around():
                    yield

    variant.call_effects = call_effects
    return variant


def keeping_and_replaying(base: BaseFn, seen: Effects) -> tuple[BaseFn, BaseFn]:
    """The ``keeping`` and ``replaying`` functions of ``base``'s root
    function for the effects ``seen`` (NOTE [derivatives replay the value's
    draws]); made once for each."""
    root = getattr(base, "effects_root", base)
    with root.lock:
        made = root.__dict__.setdefault("replayed_calls", {})
        pair = made.get(id(seen))
        if pair is None:
            pair = made[id(seen)] = (_keeping(root, seen), _replaying(root, seen), seen)
    return pair[0], pair[1]


# NOTE [fewer effects than a program was traced for]
# A jitted derivative runs its ``keeping`` and ``replaying`` calls for the
# effects the JVP rule saw when ``jax.jit`` traced it. A call that finds
# other effects now (after ``module.train()``, a hook added) is refused, since
# it would draw or update a second time what the token does not hold. A
# function that now does less was refused too: a one-shot initialization
# hook (a forward pre-hook that sets a scale from the first batch, then
# ``handle.remove()``) writes its buffer in the first value call only, and
# every later step of ``jax.jit(jax.value_and_grad(f))`` was refused until
# ``jax.clear_caches()``, blaming a training mode or a hook added (F4 of the
# review of the twentieth session). But the token of the effects traced for
# holds every slot and generator state the function now writes or draws
# from: the keeping call saves them, and the replay sets them back and runs
# as the value call ran. So a keeping call whose effects are within those
# it was traced for runs, and notes its token with the effects it ran with
# (``note_value_call``); its replay runs where the effects are still those.
# A replay whose value call ran with other effects is refused as before:
# the function changed between the two (a head the caller swapped, NOTE [a
# submodule switched by its own forward] in module_structure.py; a one-shot
# hook that removed itself in the value call, NOTE [a hook that removed
# itself in a value call]), and the replay would differentiate another
# function than the value's. Only the latest keeping call is noted: a
# replay of an earlier one with fewer effects than traced is refused, which
# costs a refusal, never a wrong result.

# NOTE [a hook that removed itself in a value call]
# PyTorch's ``loss.backward()`` after the first call of a module with a
# one-shot hook differentiates the forward that ran the hook; t2j_ad's
# derivative is a call of its own (NOTE [every derivative is a PyTorch
# function] in torch_fn.py) that runs the forward again, after the hook is
# gone. Rather than a gradient of the forward without the hook, such a
# replay is refused (NOTE [fewer effects than a program was traced for]),
# and the message names the hook: a keeping call that finds a hook of its
# modules gone after it ran notes that too. The first call is then best
# made plain (``f(x)``), which runs the hook once, as PyTorch's first call.


@dataclasses.dataclass(frozen=True)
class _ValueCall:
    """The latest ``keeping`` call of a function: its token's bytes, the
    effects it ran with where they were fewer than traced for (else None),
    and whether a hook of its modules removed itself in it."""

    token: bytes
    effects: Effects | None
    removed_hooks: bool


def note_value_call(base: BaseFn, token: torch.Tensor, fewer: Effects | None, removed_hooks: bool) -> None:
    """Note the ``keeping`` call of ``base``'s root that returned ``token``,
    having run with the effects ``fewer`` than traced for, or None, and
    whether a hook removed itself in it (NOTE [fewer effects than a program
    was traced for]); forget it where neither holds."""
    root = getattr(base, "effects_root", base)
    noted = _ValueCall(_token_bytes(token), fewer, removed_hooks) if fewer is not None or removed_hooks else None
    root.__dict__["latest_value_call"] = noted


def replays_with_fewer_effects(base: BaseFn, token: torch.Tensor, now: Effects) -> bool:
    """Whether ``token`` is that of the latest ``keeping`` call of ``base``'s
    root, which ran with the effects ``now`` (NOTE [fewer effects than a
    program was traced for])."""
    noted = getattr(base, "effects_root", base).__dict__.get("latest_value_call")
    return noted is not None and noted.effects is now and noted.token == _token_bytes(token)


def replays_a_call_that_removed_hooks(base: BaseFn, token: torch.Tensor) -> bool:
    """Whether ``token`` is that of the latest ``keeping`` call of ``base``'s
    root, in which a hook removed itself (NOTE [a hook that removed itself
    in a value call])."""
    noted = getattr(base, "effects_root", base).__dict__.get("latest_value_call")
    return noted is not None and noted.removed_hooks and noted.token == _token_bytes(token)


def _token_bytes(token: torch.Tensor) -> bytes:
    with outside_transforms():
        return token.detach().to("cpu", copy=True).numpy().tobytes()


# NOTE [a value call checked before it runs]
# A derivative that ``jax.jit`` traced while the function neither drew nor
# updated state it keeps (its modules in eval mode) took the plain rules:
# its value call is the function itself, its derivative the function with
# Jvp or Vjp appended. After ``module.train()`` (a dropout's rate set, a
# hook added, a name rebound) the derivative is refused, since it would
# draw or update a second time (NOTE [fewer effects than a program was
# traced for]); but the value call ran before it, as a plain call, and made
# its updates and draws: two refused ``jax.jit(step)`` calls of Linear +
# BatchNorm1d left ``num_batches_tracked`` at 2 and the running statistics
# moved, and dropout's draws moved the generator, where a call refused
# before its forward leaves them as they were. That value call returns no
# token to put them back from (the program was traced without one), and a
# plain call cannot tell a derivative's value call from a forward alone,
# which after ``module.train()`` is PyTorch's own training-mode forward and
# runs. So the JVP rule binds the value call of a function whose effects
# it would find again after such a change (``effects_watched``: it runs
# modules, or reads names it remembers) as ``TorchFn.checks_effects``: its
# runner checks the effects as a derivative's does, and refuses the call,
# before the forward runs, where the function now draws or updates state
# (the error of the derivative, with the same advice). The module and the
# generator are then left as the refused call found them. Same base and
# transforms as the plain call: its graph in graph mode is the plain call's
# (one trace), and the cost is that check per value call, as each
# derivative call already pays (one lookup per module it ran). The
# ``Vmap``s appended to it keep the mark; the derivatives do not need it.


def effects_watched(base: BaseFn) -> bool:
    """Whether ``base``'s effects are found again when the settings they
    depend on change (the training flags of the modules it runs, or names it
    reads: NOTE [a value call checked before it runs]); those of a function
    given ``output_shapes=`` are never found."""
    root = getattr(base, "effects_root", None) or base
    seen = root.effects
    structure = getattr(root, "structure", None)
    return seen is not None and bool(seen.modes or (structure is not None and structure.watches_names()))


def traced_for(base: BaseFn) -> Effects:
    """The effects the rules that bound a call of ``base`` saw: those a
    ``keeping`` or ``replaying`` function was made for, none for the
    function itself (its derivatives take the plain rules only then)."""
    return base.effects if getattr(base, "effects_root", None) is not None else NO_EFFECTS


def effects_now(base: BaseFn) -> Effects:
    """The effects of ``base``'s function with the training flags as they are now."""
    return effects(getattr(base, "effects_root", base))


def has_side_effects(fun: TorchFn) -> bool:
    """Whether a call of ``fun`` draws random numbers or updates state it
    keeps, so that neither JAX nor XLA may merge two such calls on equal
    inputs into one, drop one whose results go unused, move one out of a
    loop, or run two out of the program's order (NOTE [calls with effects
    under jax.jit]). A replay draws and writes nothing it does not put back."""
    return not getattr(fun.base, "replays", False) and bool(effects_now(fun.base))


def holds_no_element(fun: TorchFn) -> bool:
    """Whether no output of ``fun`` holds an element (every one is empty)."""
    return not any(int(np.prod(a.shape)) for a in fun.out_avals)


def kept_by_xla(fun: TorchFn) -> bool:
    """Whether XLA must see a call of ``fun`` as having side effects: when it
    has them, and when no output holds an element. XLA replaces a result of
    no elements by a constant and drops the call, so a function whose
    declared empty output was really another shape never ran to be refused."""
    return has_side_effects(fun) or holds_no_element(fun)


def is_value_call(base: BaseFn) -> bool:
    """Whether ``base`` is a ``keeping`` function: a value call that makes
    the draws and writes its derivatives replay (NOTE [a value call runs
    once])."""
    return getattr(base, "effects_root", None) is not None and not getattr(base, "replays", False)


def unseen_draws_watch(fun: TorchFn) -> DrawWatch | None:
    """The generators a call of ``fun`` must not draw from, where it is a
    derivative (or a replay's) of a function whose trial runs saw it draw
    from none of them: PyTorch's default ones, those its code names (NOTE
    [draws the trial runs did not see] in random_state.py), those it makes
    (NOTE [generators a function makes]); None for any other call, and for
    a function given ``output_shapes=``."""
    base = fun.base
    if base.effects is None or all(isinstance(t, Vmap) for t in fun.transforms) or is_value_call(base):
        return None
    root = getattr(base, "effects_root", None) or base
    seen = base.effects if root is not base else effects_now(base)  # a variant's: what its token holds
    own = getattr(root, "referenced_generators", ()) if not seen.given_draws else ()
    inner = not seen.given_draws and getattr(root, "makes_generators", False)
    if seen.draws_random and not own and not inner:
        return None
    return DrawWatch(not seen.draws_random, own, inner)


def variants(base: BaseFn) -> list[BaseFn]:
    """The keeping and replaying functions made of ``base`` so far."""
    return [variant for *pair, _ in list(base.__dict__.get("replayed_calls", {}).values()) for variant in pair]


def _keeping(base: BaseFn, seen: Effects) -> BaseFn:
    fn = base.fn
    writes = seen.writes
    sizes = _token_pieces(seen)
    first = _generator_pieces(seen)  # the piece of the first slot
    key = object()

    def keeping(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        device = inputs[0].device if inputs else torch.device("cpu")
        pieces: list[torch.Tensor | None] = [None] * len(sizes)
        if seen.draws_random:
            with outside_transforms():  # bytes, whatever transforms this call runs under
                if _first_run_in_pass(key):  # the runner writes the state in
                    pieces[0] = torch.zeros(STATE_BYTES, dtype=torch.uint8)
                else:
                    pieces[0] = _padded(_generator(inputs).get_state())
        for slot, tensor in enumerate(writes.closed_over):
            pieces[first + slot] = pack(tensor)

        def starts(slot: int, module: torch.nn.Module, name: str, found: torch.Tensor) -> None:
            if pieces[first + slot] is None:  # before anything under the forward updates it
                pieces[first + slot] = pack(found)

        given = GeneratorStatesKept() if seen.given_draws else contextlib.nullcontext()
        with module_slots_entered(writes, starts), _mask_layouts(seen), given:
            outputs = fn(*inputs)
        if seen.given_draws:
            if len(given.states) != seen.given_draws:
                raise unreplayable_given_draws(base.name, f"{len(given.states)} times", seen.given_draws)
            pieces[int(seen.draws_random) : first] = [_padded(state) for state in given.states]
        with outside_transforms():
            for at, size in enumerate(sizes):
                piece = pieces[at]  # None: a slot whose module did not run (never replayed)
                pieces[at] = torch.zeros(size, dtype=torch.uint8, device=device) if piece is None else piece.to(device)
            token = torch.cat(pieces)
        return (*outputs, token)

    return _variant(
        base,
        keeping,
        seen,
        in_avals=base.in_avals,
        out_avals=base.out_avals + (_token_aval(seen),),
        out_names=base.out_names + ("the state it started from",),
        torch_out_dtypes=base.torch_out_dtypes + (torch.uint8,),
        put_back=None,
        replays=False,
        key=key,
    )


def _replaying(base: BaseFn, seen: Effects) -> BaseFn:
    fn = base.fn
    writes = seen.writes
    # Where each piece of the token starts (and where the last ends): the
    # given generators' states after the default one's, then the slots.
    starts = list(itertools.accumulate(_token_pieces(seen), initial=0))
    given_starts = starts[int(seen.draws_random) :]
    offsets = starts[_generator_pieces(seen) :]
    key = object()

    def replaying(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        *args, token = inputs
        plain = unbatched_value(token)
        if plain is None:
            # One token per example: torch.vmap would batch it, so the
            # function runs in the loop over examples (NOTE [derivatives
            # replay the value's draws]).
            raise per_example_refusal(base.name)

        def value_of(slot: int) -> torch.Tensor:
            return unpack(plain[offsets[slot] : offsets[slot + 1]], writes.layouts[slot])

        for slot, tensor in enumerate(writes.closed_over):
            unpack_into(tensor, plain[offsets[slot] : offsets[slot + 1]])

        def given_state(draw: int, size: int) -> torch.Tensor:
            return _state_in(plain, given_starts[draw], size)

        bindings = ReplayedBindings(value_of)
        replayed = (
            GeneratorStatesReplayed(given_state, seen.given_draws, base.name)
            if seen.given_draws
            else contextlib.nullcontext()
        )
        with module_slots_entered(writes, bindings.starts, bindings.ends), _mask_layouts(seen), replayed:
            if not seen.draws_random or _first_run_in_pass(key):  # else the runner set the generator
                return fn(*args)
            if isinstance(plain, FakeTensor):
                raise RuntimeError(
                    f"{base.name} runs more than once in one call (a loop over tangents or examples, or a "
                    f"fallback that runs it again: torch.autograd.grad after torch.func.vjp refused), and each "
                    f"run replays the value call's random draws by setting PyTorch's generator, which a graph "
                    f"cannot do between runs"
                )
            generator = _generator(args)
            now = generator.get_state()
            generator.set_state(_state_in(plain, 0, now.numel()))
            try:
                return fn(*args)
            finally:
                generator.set_state(now)

    return _variant(
        base,
        replaying,
        seen,
        in_avals=base.in_avals + (_token_aval(seen),),
        out_avals=base.out_avals,
        out_names=base.out_names,
        torch_out_dtypes=base.torch_out_dtypes,
        put_back=WritesPutBack(writes) if writes.closed_over else None,
        replays=True,
        key=key,
    )


def _mask_layouts(seen: Effects) -> contextlib.AbstractContextManager[Any]:
    """Where the function's dropouts lay their masks out by the input's
    layout, a context that makes them row-major in the value call and every
    replay alike (NOTE [dropout masks follow the layout])."""
    return row_major_dropout() if seen.draws_by_layout else contextlib.nullcontext()


def _first_run_in_pass(key: object) -> bool:
    """Whether the runner of the variant with ``key`` handles the generator
    around the pass running now, and this is the function's first run in it
    (NOTE [the generator around a graph])."""
    if getattr(_pass, "key", None) is not key:
        return False
    _pass.runs += 1
    return _pass.runs == 1


class GeneratorAround:
    """The generator handled by the runner of a call that runs a variant's
    function once (NOTE [the generator around a graph]): for a replay, set
    from the token input at ``token`` before the call and put back after it;
    for a value call (``token`` None), read before the call and written into
    the token, its last output, after it."""

    def __init__(self, key: object, token: int | None):
        self.key = key
        self.token = token

    def passes(self, impl: Callable[..., Any]) -> Callable[..., Any]:
        """``impl``, telling the function its first run in each pass that the
        runner handles the generator."""
        key = self.key

        def one_pass(*inputs: torch.Tensor) -> Any:
            outer = getattr(_pass, "key", None), getattr(_pass, "runs", 0)
            _pass.key, _pass.runs = key, 0
            try:
                return impl(*inputs)
            finally:
                _pass.key, _pass.runs = outer

        return one_pass

    @contextlib.contextmanager
    def around(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> Iterator[None]:
        """Around one call, on the stream it runs on (the token may be
        written by the work queued before it)."""
        generator = _generator(inputs)
        now = generator.get_state()
        if self.token is None:
            yield
            outputs[-1][: now.numel()].copy_(now)
            return
        generator.set_state(_state_in(inputs[self.token], 0, now.numel()))
        try:
            yield
        finally:
            generator.set_state(now)


def generator_around(fun: TorchFn) -> GeneratorAround | None:
    """How ``fun``'s runner handles the generator around each call, if it
    does: ``fun`` is a plain call of a ``keeping`` function that draws, or a
    call of a ``replaying`` one whose token no ``jax.vmap`` batches (NOTE
    [the generator around a graph])."""
    base = fun.base
    if getattr(base, "effects_root", None) is None or not base.effects.draws_random:
        return None
    if not base.replays:
        return None if fun.transforms else GeneratorAround(base.generator_key, None)
    token = token_input(base)
    if any(isinstance(t, Vmap) and t.in_dims[token] is not None for t in fun.transforms):
        return None
    return GeneratorAround(base.generator_key, token)


def per_example_refusal(name: str) -> RuntimeError:
    """The error of a function that draws or keeps state, whose derivatives
    ``jax.vmap`` batches per example under a ``vmap_method`` that asks for
    ``torch.vmap``: its replays set a state per example, which torch.vmap
    cannot."""
    return RuntimeError(
        f"{name} draws random numbers or updates state it keeps, which torch.vmap cannot "
        f"replay per example; vmap_method='sequential' runs one example at a time"
    )


def draws_per_example(fun: TorchFn) -> bool:
    """Whether ``fun`` runs a variant that draws once per example of a
    ``jax.vmap``, setting or reading the generator itself for each (NOTE
    [the generator around a graph]): it runs eagerly."""
    base = fun.base
    return (
        getattr(base, "effects_root", None) is not None
        and base.effects.draws_random
        and generator_around(fun) is None
    )
