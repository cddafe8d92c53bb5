"""PyTorch's random state in runs made only to learn something.

NOTE [random state in trial runs]
PyTorch's random ops draw from process-wide generators (the CPU's, and one
per CUDA device). Two things follow for the runs of a user's function that
are not calls (graph mode's trace, shape inference):

- They leave those generators as they found them. A run on zeros draws real
  numbers (a meta run or a trace on fake tensors draws none), and a function
  may seed; either would shift every draw after it away from PyTorch's
  sequence for the same seed.
- A trace must see a function that sets the random state. The graph replays
  each random op on the generator as it is at the call, and cannot replay
  Python's ``torch.manual_seed``, ``set_rng_state`` or ``fork_rng``: a
  function that seeds before drawing gave the same noise on every eager call
  and new noise on every replay. So the trace runs with each generator seeded
  to a fresh 63-bit number (the sentinel), and any random op, and the trace's
  end, that finds a generator's initial seed changed shows the function set
  it (``initial_seed`` changes with seeding and with ``set_rng_state``, never
  with draws, so a draw on another thread does not count). A random op given
  an explicit ``generator=`` is refused as well: a generator the function
  makes and seeds each call would be made once, by the trace, and advance
  from replay to replay.

A generator passed as ``generator=`` is the user's own: shape inference
puts it back as well, after counting the draws made from it, and the value
call and its replays record and set its state before each such draw
(``GeneratorStatesKept``, ``GeneratorStatesReplayed``; NOTE [derivatives
replay the value's draws] in replayed_calls.py). The same generator reaches
a random op as a new Python object each time, so it is known only by the
draws made from it, in order.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # private, as in real_writes.py

from .references import reachable


def _given_generator(func: Any, kwargs: dict[str, Any] | None) -> torch.Generator | None:
    """The generator a random op was given as ``generator=``, if any."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return None
    return (kwargs or {}).get("generator")


def _own_generator(func: Any, kwargs: dict[str, Any] | None) -> torch.Generator | None:
    """The generator a random op was given as ``generator=``, unless it is
    one of PyTorch's default ones (``generator=torch.default_generator``),
    which the draw watch counts as such (NOTE [draws the trial runs did not
    see])."""
    generator = _given_generator(func, kwargs)
    return None if generator is None or _is_default_generator(generator) else generator


def _is_default_generator(generator: torch.Generator) -> bool:
    """Whether ``generator`` is one of PyTorch's default generators. Each op
    gets a new Python object for the same generator, so they are told apart
    by the C++ generator they wrap (``_cdata``, private)."""
    device = generator.device
    if device.type == "cpu":
        return generator._cdata == torch.default_generator._cdata
    if device.type == "cuda" and torch.cuda.is_initialized():
        return generator._cdata == torch.cuda.default_generators[device.index or 0]._cdata
    return False


class _GeneratorsFound(TorchDispatchMode):
    """A mode that notes generators it sees, each with its state then
    (``found``), and can put them back as it found them (``put_back``: its
    first sight of each; a generator seen twice, through two objects, ends
    at the state before the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[torch.Generator, torch.Tensor]] = []

    def _note(self, generator: torch.Generator) -> None:
        self.found.append((generator, generator.get_state()))

    def put_back(self) -> None:
        """Each generator noted, as it was found; then forget them."""
        try:
            for generator, state in reversed(self.found):
                generator.set_state(state)
        finally:
            self.found = []


class _GeneratorsPutBack(_GeneratorsFound):
    """A mode that puts every generator it saw back as it found it when the
    block ends."""

    def __exit__(self, *exc: Any) -> Any:
        self.put_back()
        return super().__exit__(*exc)


def draws(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether the op ``func``, called with ``args`` and ``kwargs``, draws
    random numbers: PyTorch tags it so, unless it takes a ``dropout_p`` and
    gets 0. The kernels of scaled_dot_product_attention carry the tag at
    dropout_p=0 too and draw nothing there: an eval-mode TransformerEncoder
    given both a causal and a padding mask was taken for a function that
    draws, and its per-example gradients were refused or ran eagerly."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            p = kwargs["dropout_p"] if "dropout_p" in kwargs else args[i] if i < len(args) else argument.default_value
            return p != 0
    return True


class RandomOpsSeen(_GeneratorsPutBack):
    """Within the block, notes whether an op that draws random numbers ran
    (``seen``), and counts the draws from generators passed as
    ``generator=`` (``given``), which it puts back when the block ends:
    shape inference learns so whether a function draws (NOTE [derivatives
    replay the value's draws] in replayed_calls.py). ``plain`` counts the
    draws from PyTorch's default generators (no ``generator=``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False
        self.given = 0
        self.plain = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        drawing = draws(func, args, kwargs or {})
        self.seen = self.seen or drawing
        generator = _given_generator(func, kwargs)
        if generator is not None:
            self.given += 1
            self._note(generator)
        elif drawing:
            self.plain += 1
        return func(*args, **(kwargs or {}))


def unreplayable_given_draws(name: str, drawn: str, inferred: int) -> RuntimeError:
    """The error of a function that drew ``drawn`` from generators passed as
    ``generator=`` where shape inference saw ``inferred`` draws: its
    derivatives cannot match each draw to the value's."""
    return RuntimeError(
        f"{name} drew {drawn} from generators passed as generator=, where {inferred} were seen when its "
        f"shapes were inferred, so its derivatives cannot replay the value's draws; draw from them a fixed "
        f"number of times, whatever the input's values"
    )


class GeneratorStatesKept(TorchDispatchMode):
    """Within the block, the state of each generator passed as
    ``generator=`` just before each draw from it, in order (``states``):
    what a value call's replays set (NOTE [random state in trial runs])."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        generator = _given_generator(func, kwargs)
        if generator is not None:
            self.states.append(generator.get_state())
        return func(*args, **(kwargs or {}))


class GeneratorStatesReplayed(_GeneratorsPutBack):
    """Within the block, each draw from a generator passed as
    ``generator=`` starts from the state its value call recorded for it
    (``state_of(i)``: the i-th such draw's, for the generator's state size);
    each generator is put back as it was found when the block ends."""

    def __init__(self, state_of: Callable[[int, int], torch.Tensor], draws: int, name: str) -> None:
        super().__init__()
        self._state_of = state_of
        self._draws = draws
        self._name = name
        self._at = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        generator = _given_generator(func, kwargs)
        if generator is not None:
            if self._at == self._draws:
                raise unreplayable_given_draws(self._name, "more times", self._draws)
            self._note(generator)
            now = generator.get_state()
            generator.set_state(self._state_of(self._at, now.numel()))
            self._at += 1
        return func(*args, **(kwargs or {}))


def generators_in_use() -> list[torch.Generator]:
    """PyTorch's default generators: the CPU's, and each CUDA device's once
    CUDA is initialized (asking for them earlier would initialize it)."""
    generators = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators.extend(torch.cuda.default_generators)
    return generators


@contextlib.contextmanager
def random_state_kept(only_if: Callable[[], bool] | None = None) -> Iterator[None]:
    """Within the block draw and seed freely: each default generator is put
    back as it was when the block ends (NOTE [random state in trial runs]);
    with ``only_if``, only where it says so then."""
    generators = generators_in_use()
    states = [g.get_state() for g in generators]
    try:
        yield
    finally:
        if only_if is None or only_if():
            for generator, state in zip(generators, states):
                generator.set_state(state)


class SeedWatch:
    """Seeds ``generators`` to a fresh sentinel, then tells whether anything
    set them since. Made inside a block that puts them back
    (``random_state_kept``; a trial run's)."""

    def __init__(self, generators: list[torch.Generator]) -> None:
        self.sentinel = secrets.randbits(63)
        self._generators = generators
        for generator in generators:
            generator.manual_seed(self.sentinel)

    def reseeded(self) -> bool:
        """Whether a generator's state was set (seeded, restored) since."""
        return any(g.initial_seed() != self.sentinel for g in self._generators)



# NOTE [draws the trial runs did not see]
# A function's effects are what its shape inference saw it do, on zeros and
# on ones (NOTE [derivatives replay the value's draws] in replayed_calls.py).
# One that draws only for other values (``dropout(x) if x.max() > 2 else
# x``) was taken for one that draws nothing: ``jax.value_and_grad`` kept no
# token, and its derivative call ran the forward again and drew a second,
# fresh mask, so the gradient was that of no mask at all (off by 29-48 on a
# 16-entry input) and PyTorch's generator went two draws on, without a word
# (F4 of a fuzzing pass); the same with a generator of the
# function's own, where the refusal "drew N times ... where M were seen"
# needs M > 0 to be raised. An unseen write into a tensor it keeps was
# refused all along (torch.func refuses it; "did not see that write").
#
# So a derivative call (or a replay) of a function whose effects say it
# does not draw from a generator watches that generator: PyTorch's default
# ones where it draws from none, and the generators its code names
# (``referenced_generators``) where it draws from none passed as
# ``generator=``. Their states before and after the call are compared
# (``DrawWatch``; never on a plain call, whose draws are PyTorch's own:
# 4-5 us alone, 13-17 us more on a jitted ``jax.grad`` of ``sin(x) * 2`` on
# an (8,) input, 160 us before, on a shared 2-core CPU: ``get_state``
# copies the CPU generator's 5 KB). A generator is process-wide, so a
# change may be another thread's draw (a data loader's shuffle while XLA
# runs the step): the call is then run again, on copies of its inputs,
# under a mode that sees this thread's random ops and stops the run at its
# first draw from them (``_ForwardDrawsSeen``; NOTE [the sure run leaves
# other threads' draws]), and refused only where that run reaches one.
# The derivative has drawn already and cannot be undone into a right one:
# the value call kept no token. So it is refused, naming the function and
# the fix: make the draw happen whatever the input's values
# (``torch.where(cond, dropout(x), x)``), so that the trial runs see it and
# the derivatives replay the value's draws. The refused call leaves the
# watched generators, and those it drew from as ``generator=``, as it
# found them (``DrawWatch.put_back``): a caller who catches the error
# draws on as if it never ran, as after PyTorch's own forward alone (it
# was one draw ahead, or more; a draw another thread made during the
# refused call is undone with it). A draw inside autograd's
# backward pass (a custom Function whose backward draws: a stochastic
# gradient estimator) is no such draw: the value call never ran that
# backward, so there is no draw of the value's to replay, and it ran
# before this check came, as in PyTorch. The sure run counts only draws
# outside a backward pass (``_ForwardDrawsSeen``: PyTorch's graph task id
# is -1 there); such a function pays that run on every derivative call. A
# generator the function makes in the call is watched otherwise (NOTE
# [generators a function makes]); one the modules it runs hold (``self.gen``
# made in ``__init__``) is watched as one its code names. One it reaches in
# another way, and a function given ``output_shapes=`` (no effects known;
# its derivatives draw again, as documented), stay unwatched.
#
# ``generator=torch.default_generator``, passed explicitly, is PyTorch's
# generator all the same: a draw from it counted as one from a generator
# passed in, watched by neither watch, and the gradient went through a
# second mask (off by 0.28 from ``torch.func``). The watch tells PyTorch's
# default generators by the C++ generator they wrap (``_own_generator``,
# ``_is_default_generator``), as each op gets a new Python object for them.

# NOTE [generators a function makes]
# A function may make a generator in each call (``g = torch.Generator()``)
# and draw from it only for some input values: no generator to watch exists
# before the call (NOTE [draws the trial runs did not see]). Seeded the same
# way in every run (``.manual_seed(0)``, a seed read from the input,
# PyTorch's own default seed), the derivative draws the value's numbers
# again and is right, as ``torch.func`` on the same draws. Seeded otherwise
# (``g.seed()``, the time, a counter), the derivative drew other numbers and
# differentiated another mask, without a word (every ``jax.grad``,
# ``value_and_grad`` and ``vjp``, eager and graph mode). A seed drawn from
# PyTorch's generator is a draw of its own, watched or replayed as such. So
# where the code a call runs (the function, the user's code it reaches, the
# ``forward`` of the modules it runs and the methods that names, their
# hooks; not PyTorch's) calls ``torch.Generator`` (``makes_generators``,
# once per signature: NOTE [the code a call runs makes a generator] in
# generator_calls.py; nothing is found that a library makes), a watched
# derivative call also notes the state of each generator passed as
# ``generator=`` before each of its draws (``GivenDrawStates``: a mode on every op of such a function's
# derivative calls alone; one on every derivative call would cost 70 us, on
# a 120 us ``torch.func.vjp`` of ``sin(x) * 2``). Where it drew from one,
# the call is run again, as the sure run is, and stopped once it has reached
# each of those draws from the same state, or at the first from another
# (``_GivenDrawsCompared``): refused there, with the fix, as above. A
# function whose trial runs drew from such generators keeps their states in
# its token and is replayed (NOTE [derivatives replay the value's draws] in
# replayed_calls.py), whatever their seeds.
#
# That run again ran the function's Python a second time on every
# derivative call of a function seeded alike in every run (its prints, its
# counters), and cost a second forward. The states a run again found
# repeated are kept (``DrawWatch._repeated``, the last
# ``_REPEATED_KEPT`` sets): a later call whose draws start from those same
# states, in order, drew the numbers already seen to repeat, and is not run
# again. A function seeded alike runs again once (once per input where it
# seeds from the input); one seeded otherwise draws from states never seen
# before and is run again, and refused, as before. The run again is a
# sample of the seeding, as that cache is: a seed that repeats by chance
# (``random.choice((1, 2))``) passes either.


def referenced_generators(
    fn: Callable[..., Any], modules: Sequence[torch.nn.Module] = ()
) -> tuple[torch.Generator, ...]:
    """The ``torch.Generator`` objects ``fn``'s code names (in its closure,
    globals, default arguments, a module's attributes: ``references.reachable``),
    and those the ``modules`` it runs (with their submodules) hold
    (``self.gen`` made in ``__init__``), which a derivative call watches
    (NOTE [draws the trial runs did not see])."""
    found = {id(g): g for g in reachable(fn, _is_generator)}
    for module in modules:
        for sub in module.modules():
            found.update((id(g), g) for g in reachable(vars(sub), _is_generator))
    return tuple(found.values())


def _is_generator(obj: Any) -> bool:
    return isinstance(obj, torch.Generator)


class DrawWatch:
    """The generators a call must not draw from (NOTE [draws the trial runs
    did not see]): their states before a call (``before``), and whether a
    call drew from them (``drew``, cheap; ``drew_here``, sure); where
    ``inner``, whether it drew from generators it makes other than a run
    again does (``drew_unrepeatably``; NOTE [generators a function makes])."""

    def __init__(self, plain: bool, own: Sequence[torch.Generator], inner: bool = False) -> None:
        self.plain = plain  # PyTorch's default generators
        self.own = tuple(own)  # those passed as generator=
        self.inner = inner  # the draws from generators it may make itself
        # The states of draws a run again found repeated (NOTE [generators a function makes]).
        self._repeated: collections.deque[tuple[bytes, ...]] = collections.deque(maxlen=_REPEATED_KEPT)
        # Without CUDA the generators never change: found once, not per call.
        self._fixed = None if plain and torch.cuda.is_available() else self._generators()

    def _generators(self) -> list[torch.Generator]:
        return [*generators_in_use(), *self.own] if self.plain else list(self.own)

    def before(self) -> list[tuple[torch.Generator, bytes]]:
        """Each watched generator with its state now."""
        generators = self._fixed if self._fixed is not None else self._generators()
        return [(generator, _state_bytes(generator)) for generator in generators]

    @staticmethod
    def drew(before: Sequence[tuple[torch.Generator, bytes]]) -> bool:
        """Whether a watched generator moved since ``before``: by this call,
        or by another thread (``drew_here`` tells which)."""
        return any(_state_bytes(generator) != state for generator, state in before)

    def drew_here(self, run: Callable[[], Any]) -> str | None:
        """What ``run`` draws from on this thread, of the watched kinds of
        generator (as ``unseen_draws_refusal`` names it), or None. ``run`` is
        stopped before its first such draw, and PyTorch's generators are put
        back only where this thread drew from them: another thread's draws
        made meanwhile stand (NOTE [the sure run leaves other threads'
        draws])."""
        seen = _ForwardDrawsSeen(plain=self.plain, given=bool(self.own))
        with random_state_kept(only_if=lambda: seen.seen), contextlib.suppress(_WatchedDrawReached), seen:
            run()
        if seen.reached is None:
            return None
        return "PyTorch's random generator" if seen.reached == "plain" else "a generator passed as generator="

    @staticmethod
    def given_draws_noted() -> GivenDrawStates:
        """A mode to run the call in, where ``inner``: it notes the call's
        draws from generators passed as ``generator=``."""
        return GivenDrawStates()

    def drew_unrepeatably(self, run: Callable[[], Any], given: GivenDrawStates) -> str | None:
        """Where the call drew from generators passed as ``generator=``
        (``given``), whether ``run``, the call again, draws from them from
        other states: ``run`` is stopped at its first draw from another
        state, or once it has reached each of the call's draws, and never
        makes that draw; the source, as ``unseen_draws_refusal`` names it,
        or None (NOTE [generators a function makes]). PyTorch's generators
        are put back where this thread drew from them. Draws from states a
        run again found repeated before are not run again."""
        if not given.found:
            return None
        expected = tuple(_bytes(state) for _, state in given.found)
        if expected in self._repeated:
            return None
        compared = _GivenDrawsCompared(expected)
        with random_state_kept(only_if=lambda: compared.plain > 0), contextlib.suppress(_WatchedDrawReached), compared:
            run()
        if compared.differ:
            return _MADE_GENERATOR
        self._repeated.append(expected)
        return None

    @staticmethod
    def put_back(before: Sequence[tuple[torch.Generator, bytes]], given: GivenDrawStates | None) -> None:
        """Each generator the refused call drew from as ``generator=``
        (``given``), then each watched one (``before``), as the call found
        it (NOTE [draws the trial runs did not see])."""
        if given is not None:
            given.put_back()
        for generator, state in before:
            if _state_bytes(generator) != state:
                generator.set_state(_state_from(state))


class GivenDrawStates(_GeneratorsFound):
    """Within the block, each generator passed as ``generator=`` to a draw
    made outside autograd's backward pass, with its state just before the
    draw (``found``), in order (NOTE [generators a function makes])."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        generator = _own_generator(func, kwargs)
        if generator is not None and _forward_draw(func, args, kwargs):
            self._note(generator)
        return func(*args, **(kwargs or {}))


# NOTE [the sure run leaves other threads' draws]
# The sure run (``DrawWatch.drew_here``) put PyTorch's generators back as
# it found them when it ended (``random_state_kept``). A generator is
# process-wide, and that run comes exactly when another thread draws
# meanwhile (NOTE [draws the trial runs did not see]): every draw that
# thread made during the run was undone, and it drew the same numbers again
# (1.5 million of 2.2 million ``torch.rand(1)`` draws of a thread beside a
# jitted ``jax.grad`` loop were repeats, against the 14 thousand chance
# collisions before). So the run is stopped before its first draw of a
# watched kind (``_WatchedDrawReached``), which it never makes, and the
# generators are put back only where this thread did draw (a backward's
# draws, or those of a kind not watched): a thread drawing while such a
# function runs again can still lose those few draws.


def _forward_draw(func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> bool:
    """Whether the op ``func`` draws random numbers (``draws``) outside
    autograd's backward pass (NOTE [draws the trial runs did not see])."""
    return draws(func, args, kwargs or {}) and torch._C._current_graph_task_id() == -1  # private: -1 outside a backward


class _WatchedDrawReached(Exception):
    """Raised by ``_ForwardDrawsSeen`` before a draw of a watched kind."""


class _ForwardDrawsSeen(RandomOpsSeen):
    """``RandomOpsSeen`` for the sure run: the first draw of a watched kind
    (from PyTorch's generators where ``plain``, from one passed as
    ``generator=`` where ``given``) made outside autograd's backward pass is
    not made: the run is stopped there (``reached`` says which kind). A
    custom Function's backward that draws (a stochastic gradient estimator)
    replays no draw of the value's, which never ran it (NOTE [draws the trial
    runs did not see]). ``seen`` says whether a draw was made at all."""

    def __init__(self, plain: bool, given: bool) -> None:
        super().__init__()
        self._watched = {"plain": plain, "given": given}
        self.reached: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if _forward_draw(func, args, kwargs):
            kind = "plain" if _own_generator(func, kwargs) is None else "given"
            if self._watched[kind]:
                self.reached = kind
                raise _WatchedDrawReached(kind)
        return super().__torch_dispatch__(func, types, args, kwargs)


class _GivenDrawsCompared(RandomOpsSeen):
    """``RandomOpsSeen`` for the run that tells whether a call's draws from
    generators passed as ``generator=`` repeat: each such draw made outside
    autograd's backward pass must find its generator in the state the
    call's found (``expected``, in order). The run is stopped at the first
    that does not (``differ`` stays True), or at the last expected, not
    made (``differ`` False); one that ends with fewer such draws differs
    too (NOTE [generators a function makes])."""

    def __init__(self, expected: Sequence[bytes]) -> None:
        super().__init__()
        self._expected = expected
        self._at = 0
        self.differ = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        generator = _own_generator(func, kwargs)
        if generator is not None and _forward_draw(func, args, kwargs):
            if _state_bytes(generator) != self._expected[self._at]:
                raise _WatchedDrawReached("given")
            self._at += 1
            if self._at == len(self._expected):
                self.differ = False
                raise _WatchedDrawReached("given")
        return super().__torch_dispatch__(func, types, args, kwargs)


def _state_bytes(generator: torch.Generator) -> bytes:
    """``generator``'s state, as bytes."""
    return _bytes(generator.get_state())


def _bytes(state: torch.Tensor) -> bytes:
    """A generator's ``state`` (a CPU byte tensor), as bytes: read from its
    memory, several microseconds less than through ``.numpy()`` within a
    call."""
    return ctypes.string_at(state.data_ptr(), state.numel())


def _state_from(state: bytes) -> torch.Tensor:
    """A generator state read by ``_state_bytes``, as ``set_state`` takes it."""
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def unseen_draws_refusal(name: str, source: str) -> RuntimeError:
    """The error of a derivative call of ``name`` that drew from ``source``
    where its trial runs drew nothing from it (NOTE [draws the trial runs
    did not see])."""
    return RuntimeError(
        f"{name} drew random numbers from {source} in a derivative call (jax.grad, jax.value_and_grad, "
        f"jax.jvp), but the runs that inferred its output shapes, on zeros and on ones, drew none from it: "
        f"its draws depend on the input's values. The derivative runs the function again and drew new "
        f"numbers, so it would differentiate another draw than the value's (a gradient through another "
        f"dropout mask). {_UNSEEN_DRAW_FIX.get(source, _UNSEEN_DRAW_FIX[None])}, so that its derivatives replay "
        f"the value's draws."
    )


# How many sets of states found repeated a ``DrawWatch`` keeps (NOTE
# [generators a function makes]): a few inputs a function seeds from.
_REPEATED_KEPT = 8

# How ``unseen_draws_refusal`` names a generator the function makes.
_MADE_GENERATOR = "a torch.Generator it makes itself, seeded otherwise from run to run,"

# What ``unseen_draws_refusal`` advises, by what the function drew from.
_UNSEEN_DRAW_FIX = {
    None: (
        "Make the draw happen whatever the input's values (torch.where(cond, dropout(x), x) rather than "
        "dropout(x) if cond else x)"
    ),
    "a generator passed as generator=": (
        "Draw from it a fixed number of times whatever the input's values (mask what you do not need: "
        "torch.where(cond, x * mask, x))"
    ),
    _MADE_GENERATOR: (
        "Draw from it a fixed number of times whatever the input's values (mask what you do not need: "
        "torch.where(cond, x * mask, x)), or seed it the same way in every run (torch.Generator().manual_seed(0), "
        "or a seed read from the input)"
    ),
}
