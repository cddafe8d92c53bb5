"""The table the C++ handler dispatches into: integer key -> TorchFn.

NOTE [registry lifetime]
A compiled XLA program names the PyTorch function it calls by an integer
attribute, ``key``; the C++ handler passes the key to the Python dispatcher
(backends/ffi.py), which looks it up here. Nothing ever turns the integer
into a pointer, so a stale key is an error, not a crash.

* Stable keys. Equal TorchFns (same ``BaseFn``, transforms and avals) get
  the same key, so retracing produces the same HLO and hits jit's caches.
* Weak entries. The table holds only weak references. What keeps an entry
  alive is the compiled program itself: the lowering hands a strong
  reference to the registered TorchFn to
  ``ctx.module_context.add_host_callback``, the mechanism ``jax.pure_callback``
  and ``buffer_callback`` use for their Python callables. JAX gives that list
  to the runtime executable (``LoadedExecutable``), which owns it for exactly
  its own lifetime -- including when only jit's C++ fast path still holds the
  executable. (``add_keepalive`` would not do: it is tied to the Python
  wrapper, which can die first.) So an entry lives while some executable can
  call it or something else (a jaxpr, a jaxify'd function) holds the TorchFn,
  and is dropped by a weakref callback as soon as neither does.
* Lowerings inside partitioning. Under a sharded jit XLA asks for each
  device's lowering while it compiles, into a throwaway module whose host
  callbacks die with it. The outer lowering therefore hands its own holder
  (``ffi.KeepAlive``, tied to the final executable) to the partition
  callback, which registers the per-device TorchFn into it: the entry lives
  exactly as long as that executable (NOTE [partitioning torch_call] in
  rules/partitioning.py).
* The hot table. ``runners`` maps a key to its TorchFn's runner (see
  runtime.py) once the key has been dispatched; the C++ handler looks the
  key up there itself and calls the runner, skipping every Python frame of
  the dispatcher. A runner does not refer to its TorchFn, so this table
  keeps nothing alive: its entry goes when the TorchFn's weakref fires.
* Compiled for another machine. A compile-only client (AOT
  cross-compilation for a described topology, ``jax.experimental.topologies``)
  takes host callbacks only as capsules and refused the holder; its
  executables never run in this process (they are inspected or serialized),
  so the holder of such a lowering is kept for the process's life instead
  (``ffi.keep_alive``): that many TorchFns stay alive, one per such lowering.
* Keys are never reused, so a dispatch of a key whose entry is gone can only
  fail with a clear error, never run the wrong function. Nothing clears the
  table: ``t2j_ad.clear_caches()`` drops JAX's caches of compiled programs,
  whose entries then go with them, while a program still held (an
  ahead-of-time ``compiled``, or one running on another thread) keeps
  working. (It once cleared the table too, which broke both.)

Host callbacks also keep such executables out of JAX's persistent compilation
cache, which is what we want: keys are meaningful only in this process.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

_lock = threading.Lock()
_keys = itertools.count(1)
# TorchFn -> key. Looked up by value (an equal TorchFn finds the entry of the
# first one registered, the "canonical" instance); held weakly.
_key_of: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
# key -> weak reference to the canonical TorchFn. Plain dict: the dispatcher's
# hot path is one dict lookup and one weakref call.
_fun_of: dict[int, weakref.ref] = {}
# key -> runner, filled by the dispatcher on a key's first call and read by
# the C++ handler (backends/ffi.py hands it this very dict object).
runners: dict[int, Any] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    # Runs from the garbage collector, possibly while ``register`` holds the
    # lock, so it must not take it. Only removes the entry it created.
    if _fun_of.get(key) is ref:
        del _fun_of[key]
        runners.pop(key, None)


def register(fun: Any) -> tuple[int, Any]:
    """The key for ``fun`` and the canonical TorchFn registered under it.

    Callers must keep the canonical instance alive for as long as the key may
    be dispatched (the FFI lowering ties it to the executable).
    """
    with _lock:
        key = _key_of.get(fun)
        if key is not None:
            ref = _fun_of.get(key)
            canonical = ref() if ref is not None else None
            if canonical is not None:
                return key, canonical
        key = next(_keys)
        _key_of[fun] = key
        _fun_of[key] = weakref.ref(fun, lambda ref, key=key: _forget(key, ref))
        return key, fun


def lookup(key: int) -> Any:
    """The TorchFn registered under ``key``; ``LookupError`` when there is none."""
    ref = _fun_of.get(key)
    fun = ref() if ref is not None else None
    if fun is None:
        raise LookupError(
            f"t2j_ad: no PyTorch function is registered under key {key}: a "
            f"program compiled in this process keeps its functions registered "
            f"while it lives, so this one was compiled elsewhere (a serialized "
            f"executable) or the key was forged. Re-trace the function: call "
            f"jax.clear_caches() and call it again, or re-run .lower().compile()."
        )
    return fun


def size() -> int:
    """Number of live entries."""
    return len(_fun_of)
