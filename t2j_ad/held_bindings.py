"""Tensors bound into a module for a derivative call stay bound until that
call's reverse pass has run.

NOTE [bindings held through the reverse pass]
``jaxify_module`` binds the parameters a call is given into the module for
its forward and puts the module's own back when the forward returns, as
``torch.func.functional_call`` does. A derivative call runs its reverse pass
after that, and some backwards run the module again: the recomputation of
``torch.utils.checkpoint(use_reentrant=False)`` and the adjoint methods of
torchdiffeq and torchsde (``odeint_adjoint`` evaluates the dynamics again
and differentiates with respect to the parameters its forward found). They
read the module's own parameters there: checkpointed gradients came out at
the stale parameters (off by 1.4 after one optimizer step), and an adjoint
neural ODE's parameter gradients were exactly 0. So a derivative call (a
TorchFn with transforms, ``transforms.build``) runs inside a scope, and a
forward made inside one leaves its bindings, and the module locks that
guard them, to be released when the whole call ends, in reverse order.

NOTE [a nested call's bindings are its own]
A derivative call's forward may call another jaxified function (an outer
``jaxify_module(Outer)`` whose forward calls ``jaxify_module`` of its own
submodule ``self.part``). That nested call is a call of its own (NOTE [a
call inside torch.func transforms] in runtime.py), but it ran inside the
derivative's scope, so its forward left its bindings to the derivative's
end too, and they were released in the reverse order the forwards *ended*
in: the nested forward ends first, so the outer's bindings were put back
first, and then the nested call's "put back" what it had found bound, the
outer call's tensors: the submodule was left holding a plain tensor (a
view of one of the outer call's arrays) where its ``nn.Parameter`` was,
after one ``jax.value_and_grad`` step. And until then the rest of the
outer forward saw the nested call's tensors in ``self.part``, not its
own. So a nested call runs apart from the derivative call around it
(``apart_from_the_call``): its forwards release their bindings as they
end. And the releases left to a derivative call run in the reverse order
the bindings were made in (``place_for_release``, taken when a forward
binds), which is that order for forwards that nest on one thread, however
a nested call reaches the scope.

NOTE [a graph inside a module call's bindings]
A graph holds the tensors its function reaches without taking them as
inputs (a module's parameters, for ``jaxify(lambda t: model.part(t))``)
as the trace found them. Traced while a ``jaxify_module`` call of a module
it runs had that call's tensors bound in it (the function called inside
that module's forward), it kept that call's tensors: the zeros of the
outer call's run that infers its shapes (every later call then gave 0,
silently), or the arrays of one call for every later call; and a graph
traced outside, replayed inside such a call, ran on the module's own
tensors instead of the call's. So a compiled function runs eagerly for a
call that finds a module it runs holding the tensors of a call made on its
thread (``binding_in``, ``bound_among``: where a nested call runs, NOTE [a
call inside torch.func transforms]), as PyTorch would run it there, and
keeps (or traces) its graph for the calls that do not, with one
``FallbackWarning``. On a GPU the look comes before a CUDA graph's replay
too: a graph-mode part of a module, called first on its own, then inside
the module's calls, replayed the CUDA graph captured on its own call, with
the module's own parameters (an H100: 1.67 where PyTorch gives 2.29).
Calls on other threads keep their graphs: a module bound by another
thread's call is NOTE [one module, many threads]. A plain ``if`` on an
empty dict for every other call.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


class _Scope(threading.local):
    pending: list[Callable[[], Any]] | None = None  # releases due when the derivative call ends


_scope = _Scope()


def held_through_the_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a derivative call), releasing the bindings its forwards left
    (``release_after_the_call``) when it returns or raises."""

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        outer, _scope.pending = _scope.pending, []
        try:
            return fn(*args)
        finally:
            pending, _scope.pending = _scope.pending, outer
            for release in reversed(pending):
                release()

    return run


def place_for_release() -> int:
    """Where a release of bindings made now goes among those left to the
    derivative call running on this thread (NOTE [a nested call's bindings
    are its own]); taken before the bindings are made."""
    pending = _scope.pending
    return 0 if pending is None else len(pending)


def release_after_the_call(release: Callable[[], Any], place: int | None = None) -> bool:
    """Leave ``release`` to the derivative call running on this thread, if
    any (True), at ``place`` (``place_for_release()`` when its bindings were
    made: before the releases of bindings made inside them); False where
    none is, and the caller releases now."""
    pending = _scope.pending
    if pending is None:
        return False
    pending.insert(len(pending) if place is None else min(place, len(pending)), release)
    return True


@contextlib.contextmanager
def apart_from_the_call() -> Iterator[None]:
    """Within the block (a nested jaxified call), no derivative call's scope
    is open on this thread: its forwards release their bindings as they end
    (NOTE [a nested call's bindings are its own])."""
    outer, _scope.pending = _scope.pending, None
    try:
        yield
    finally:
        _scope.pending = outer


# (thread, id of a module-id set) -> [how many calls made on that thread have
# their tensors bound in those modules now, the set] (NOTE [a graph inside a
# module call's bindings]). One entry per call, not per module: a call of an
# 81-module network paid 19 us for an entry per module. Read without the
# lock: empty but while a jaxify_module call runs.
bound_now: dict[tuple[int, int], list[Any]] = {}
_bound_lock = threading.Lock()


class binding_in:  # noqa: N801 - a context manager, named as one
    """Within the block, the modules whose ids ``module_ids`` holds count as
    holding a call's tensors, for calls made on this thread (NOTE [a graph
    inside a module call's bindings])."""

    __slots__ = ("_key", "_ids")

    def __init__(self, module_ids: frozenset[int]) -> None:
        self._key = (threading.get_ident(), id(module_ids))
        self._ids = module_ids

    def __enter__(self) -> None:
        with _bound_lock:
            held = bound_now.get(self._key)
            if held is None:
                bound_now[self._key] = [1, self._ids]
            else:
                held[0] += 1

    def __exit__(self, *exc: object) -> None:
        with _bound_lock:
            held = bound_now[self._key]
            held[0] -= 1
            if not held[0]:
                del bound_now[self._key]


def bound_among(modules: Iterable[torch.nn.Module]) -> bool:
    """Whether one of ``modules`` (and the modules under them) holds the
    tensors of a call made on this thread now (NOTE [a graph inside a module
    call's bindings])."""
    thread = threading.get_ident()
    with _bound_lock:
        bound = [ids for (on, _), (_, ids) in bound_now.items() if on == thread]
    return bool(bound) and any(id(sub) in ids for module in modules for sub in module.modules() for ids in bound)
