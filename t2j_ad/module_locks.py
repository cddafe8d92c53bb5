"""The lock of each module object: held by every ``jaxify_module`` call of
it while its tensors are swapped in (NOTE [one module, many threads] in
module.py), and by every trial run of a function that refers to it (NOTE
[trial runs wait for module calls] in real_writes.py)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch

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


def acquire(locks: Iterable[threading.RLock]) -> None:
    """Take ``locks`` in the order given (``in_lock_order``'s)."""
    for lock in locks:
        lock.acquire()


def release(locks: Iterable[threading.RLock]) -> None:
    """Release ``locks``, taken in order, in reverse order."""
    for lock in reversed(tuple(locks)):
        lock.release()
