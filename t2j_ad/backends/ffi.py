"""The FFI backend: ``torch_call`` lowered to our own XLA custom call.

The handler (csrc/torch_call.cc, built into ``t2j_ad._ffi_ext``) wraps XLA's
input and output buffers as torch tensors without copying (DLPack) and looks
the call's integer key up in ``registry.runners``. It calls the runner found
there, or ``_dispatch`` below for a key it has not seen, which finds the
TorchFn in ``registry`` (see NOTE [registry lifetime] there). The runner
(runtime.py) runs PyTorch and copies the results into the output buffers.
"""

from __future__ import annotations

import atexit
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import torch

from .._jax_internals import compiles_only
from ..replayed_calls import kept_by_xla
from ..runtime import runner_for
from . import registry

try:
    from .. import _ffi_ext
except ImportError:  # not built: backends.select() falls back to callback.
    _ffi_ext = None

TARGET = "t2j_ad_torch_call"

# jax platform name (as in ctx.module_context.platforms) -> the name
# register_ffi_target expects, for the handlers this build contains.
_PLATFORM_NAMES = {"cpu": "cpu", "cuda": "CUDA"}

# torch.from_dlpack on a capsule only forwards to this; calling it directly
# skips a hasattr and a Python frame on every buffer of every call.
_from_dlpack = getattr(torch._C, "_from_dlpack", torch.from_dlpack)

_lock = threading.Lock()
_registered: frozenset[str] | None = None  # jax platform names with a handler
_warned_platforms: set[str] = set()


def _dispatch(key: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor], stream: int) -> None:
    """Called by the C++ handler, with the GIL held, for a key it has no runner for.

    That is a key's first call (afterwards the handler finds the runner in
    ``registry.runners`` and calls it directly) or a key that is not
    registered (``registry.lookup`` raises, naming the fix).
    """
    fun = registry.lookup(key)
    runner = runner_for(fun)
    # ``fun`` is alive here, so its entry is too, and its weakref callback
    # will remove this runner again.
    registry.runners[key] = runner.__call__  # a bound method: the cheapest call from C
    runner(inputs, outputs, stream)


def install_dispatcher() -> None:
    """Point the C++ handler at ``_dispatch`` and the registry's runner table."""
    _ffi_ext.set_dispatcher(_dispatch, runners=registry.runners, wrap=_from_dlpack)


def _finish_queued_calls() -> None:
    """Wait, at exit, for the computations still queued that make live
    arrays: the extension's own exit hook, which runs after this one
    (registered later, run earlier), drops the dispatcher, and a call XLA
    ran after that failed with "no Python dispatcher is registered" instead
    of running (its state updates lost). A computation whose results were
    freed already (printed, then dropped) makes no live array: JAX's
    runtime tokens wait for those (``jax.effects_barrier``), which JAX's own
    exit hook waited on only after the dispatcher was gone."""
    for array in jax.live_arrays():
        try:
            array.block_until_ready()
        except Exception:  # noqa: BLE001 - its error was the caller's to see; exiting anyway
            pass
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - as above
        pass


if _ffi_ext is not None:
    atexit.register(_finish_queued_calls)


def _register_targets() -> frozenset[str]:
    """Register the handlers with XLA and install the dispatcher, once."""
    global _registered
    with _lock:
        if _registered is None:
            handlers = _ffi_ext.handlers()
            jax.ffi.register_ffi_target(TARGET, handlers["cpu"], platform="cpu")
            registered = {"cpu"}
            # Every build holds the CUDA handler too (NOTE [one build for CPU
            # and GPU] in csrc/torch_call.cc). A CPU jaxlib accepts a CUDA
            # target and keeps it unused; should a jaxlib refuse it, CUDA
            # calls take the callback backend (see lower()) and CPU is unharmed.
            for platform, name in _PLATFORM_NAMES.items():
                if platform == "cpu" or name not in handlers:
                    continue
                try:
                    jax.ffi.register_ffi_target(TARGET, handlers[name], platform=name)
                except Exception:  # noqa: BLE001 - any refusal leaves that platform out
                    continue
                registered.add(platform)
            install_dispatcher()
            _registered = frozenset(registered)
        return _registered


def available() -> bool:
    """Whether the C++ extension is built (and its targets registered)."""
    if _ffi_ext is None:
        return False
    try:
        _register_targets()
    except Exception as err:  # e.g. a jaxlib whose FFI rejects our handler
        warnings.warn(f"t2j_ad: could not register the FFI handler: {err}", RuntimeWarning)
        return False
    return True


def platforms() -> frozenset[str]:
    """The JAX platforms this build has a handler for (``cpu``, maybe ``cuda``)."""
    return _register_targets() if available() else frozenset()


class KeepAlive:
    """Holds TorchFns for as long as a compiled executable exists.

    Passed to ``add_host_callback`` only for its lifetime (NOTE [registry
    lifetime] in registry.py); XLA never calls it. ``register`` adds an entry
    to the registry and holds it here, also after the lowering that made this
    object (the partitioning callback registers per-device functions into the
    outer lowering's holder while XLA compiles).
    """

    __slots__ = ("funs",)

    def __init__(self) -> None:
        self.funs: list[Any] = []

    def register(self, fun: Any) -> int:
        """The registry key of ``fun``, its entry now held by this object."""
        key, canonical = registry.register(fun)
        self.funs.append(canonical)
        return key

    def __call__(self, *args: Any) -> None:
        raise RuntimeError("t2j_ad: internal keep-alive object was called")


# Holders of what was lowered for a compile-only client, for the process's
# life (NOTE [registry lifetime] in registry.py).
_compiled_elsewhere: list[KeepAlive] = []


def keep_alive(ctx: Any) -> KeepAlive:
    """A fresh holder tied to the executable that ``ctx`` is lowered into."""
    keep = KeepAlive()
    if compiles_only(ctx.module_context):
        _compiled_elsewhere.append(keep)
    else:
        ctx.module_context.add_host_callback(keep)
    return keep


def unsupported(ctx: Any) -> list[str]:
    """The platforms of ``ctx`` this build has no handler for."""
    supported = platforms()
    return [p for p in ctx.module_context.platforms if p not in supported]


def lower(ctx: Any, *args: Any, fun: Any) -> Sequence[Any]:
    """MLIR lowering of ``torch_call`` to the ``t2j_ad_torch_call`` custom call."""
    missing = unsupported(ctx)
    if missing:
        # E.g. ROCm, an extension built with -DT2J_AD_CUDA=OFF, or a jaxlib
        # that refused to register the CUDA handler.
        from . import callback

        new = [p for p in missing if p not in _warned_platforms]
        if new:
            _warned_platforms.update(new)
            warnings.warn(
                f"t2j_ad: the C++ extension has no handler for platform(s) {new} "
                f"(it was built for {sorted(platforms())}); using the callback "
                f"backend there (slower).",
                RuntimeWarning,
                stacklevel=2,
            )
        return callback.lower(ctx, *args, fun=fun)
    key = keep_alive(ctx).register(fun)
    # NOTE [calls with effects under jax.jit] in replayed_calls.py
    lowering = jax.ffi.ffi_lowering(TARGET, has_side_effect=kept_by_xla(fun))
    return lowering(ctx, *args, key=np.int64(key))
