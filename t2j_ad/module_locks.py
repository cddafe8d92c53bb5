"""The lock of each module object: held by every ``jaxify_module`` call of
it while its tensors are swapped in (NOTE [one module, many threads] in
module.py), and by every trial run of a function that refers to it (NOTE
[trial runs wait for module calls] in real_writes.py)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import torch


class LockLike(Protocol):
    """A ``threading.Lock`` or ``threading.RLock``."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...

    def __enter__(self) -> bool: ...

    def __exit__(self, *exc: object) -> None: ...


_module_locks: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_module_locks_lock = threading.Lock()


def lock_of(module: torch.nn.Module) -> threading.RLock:
    """The lock every ``jaxify_module`` of ``module`` holds around a call."""
    with _module_locks_lock:
        lock = _module_locks.get(module)
        if lock is None:
            lock = _module_locks[module] = threading.RLock()
        return lock


def in_lock_order(modules: Iterable[torch.nn.Module]) -> tuple[threading.RLock, ...]:
    """The locks of ``modules``, each once, in the one global order every
    holder of several takes them in (by the locks' ids)."""
    return tuple(sorted({id(lock): lock for lock in map(lock_of, modules)}.values(), key=id))


def modules_under(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """``modules`` and every module under them, each once, in the order
    ``torch.nn.Module.modules`` walks them."""
    return list(dict.fromkeys(sub for module in modules for sub in module.modules()))


def locks_of(under: Iterable[torch.nn.Module]) -> tuple[threading.RLock, ...]:
    """The locks a trial run holds, given ``under``, the modules under those
    its function refers to (``modules_under``): those of each that holds
    tensors, in lock order (NOTE [trial runs wait for module calls] in
    real_writes.py)."""
    return in_lock_order(m for m in under if m._parameters or m._buffers)


def locks_under(modules: Iterable[torch.nn.Module]) -> tuple[threading.RLock, ...]:
    """The locks a trial run of a function referring to ``modules`` holds
    (``locks_of`` the modules under them)."""
    return locks_of(modules_under(modules))


def acquire(locks: Iterable[LockLike]) -> None:
    """Take ``locks`` in the order given (``in_lock_order``'s)."""
    for lock in locks:
        lock.acquire()


def release(locks: Iterable[LockLike]) -> None:
    """Release ``locks``, taken in order, in reverse order."""
    for lock in reversed(tuple(locks)):
        lock.release()


# NOTE [waiting for a lock without the trial-run lock]
# A trial run (or a forward-mode call about to trace) takes the trial-run
# lock, then the locks of the modules it refers to (or the forward-AD lock).
# A ``jaxify_module`` call holds its module's locks, and nothing else, while
# its forward runs; a jaxify'd function called in that forward may then take
# the trial-run lock (its own first call's trial run, or a call updating
# state that holds trial runs off: NOTE [one trial run at a time] in
# real_writes.py). Had the trial run waited for the module's locks while
# holding the trial-run lock, each would wait for the other, for good. So a
# holder of the trial-run lock that finds one of the others busy lets the
# trial-run lock go while it waits for that one (taking and releasing it,
# holding nothing), then starts again from the trial-run lock: it never
# waits holding it. The module call is never made to take the trial-run lock
# up front, which would make every call on another thread that the forward
# waits for (a ``jax.pmap`` run by XLA on its device threads, a thread pool)
# wait for the lock the forward's own thread holds, for good. Only a thread
# that held the trial-run lock before (a call inside another function's trial
# run, a graph-mode trace) cannot let it go: that one waits, as before.


@contextlib.contextmanager
def taken_after(first: threading.RLock, locks: Sequence[LockLike]) -> Iterator[None]:
    """Within the block, ``first`` and then ``locks`` (in ``in_lock_order``'s
    order) are held; a busy one of ``locks`` is waited for without holding
    ``first``, unless this thread held ``first`` already (NOTE [waiting for a
    lock without the trial-run lock])."""
    # RLock._is_owned: CPython's, as threading.Condition uses it.
    may_let_go = not first._is_owned()
    while True:
        first.acquire()
        if not may_let_go:
            acquire(locks)
            break
        busy = _busy_among(locks)
        if busy is None:
            break
        first.release()
        with busy:  # waits for it, holding nothing
            pass
    try:
        yield
    finally:
        release(locks)
        first.release()


def _busy_among(locks: Sequence[LockLike]) -> LockLike | None:
    """Takes each of ``locks`` without waiting and returns None; or, if one
    is busy, releases those it took and returns that one."""
    taken: list[LockLike] = []
    for lock in locks:
        if not lock.acquire(blocking=False):
            release(taken)
            return lock
        taken.append(lock)
    return None
