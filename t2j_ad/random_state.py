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
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # private, as in real_writes.py


class RandomOpsSeen(TorchDispatchMode):
    """Within the block, notes whether an op that draws random numbers ran
    (``seen``): shape inference learns so whether a function draws (NOTE
    [derivatives replay the value's draws] in replayed_calls.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen = True
        return func(*args, **(kwargs or {}))


def generators_in_use() -> list[torch.Generator]:
    """PyTorch's default generators: the CPU's, and each CUDA device's once
    CUDA is initialized (asking for them earlier would initialize it)."""
    generators = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators.extend(torch.cuda.default_generators)
    return generators


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Within the block draw and seed freely: each default generator is put
    back as it was when the block ends (NOTE [random state in trial runs])."""
    generators = generators_in_use()
    states = [g.get_state() for g in generators]
    try:
        yield
    finally:
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

