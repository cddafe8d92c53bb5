"""Lowering backends for ``torch_call``.

``ffi`` (the C++ custom call in csrc/, zero-copy) is the default when its
extension is built; ``callback`` (``jax.experimental.buffer_callback``, else
``jax.pure_callback``) is the pure-Python fallback. ``T2J_AD_BACKEND=ffi`` or
``=callback`` forces one.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

_warned_missing_ffi = False


def _ffi_module() -> ModuleType | None:
    try:
        from . import ffi
    except ImportError:
        return None
    return ffi if ffi.available() else None


def select() -> ModuleType:
    """The backend module to lower with: it has ``lower(ctx, *args, fun)``."""
    global _warned_missing_ffi
    from . import callback

    forced = os.environ.get("T2J_AD_BACKEND", "").strip().lower()
    if forced == "callback":
        return callback
    if forced not in ("", "ffi"):
        raise ValueError(f"T2J_AD_BACKEND must be 'ffi' or 'callback', got {forced!r}.")
    ffi = _ffi_module()
    if ffi is not None:
        return ffi
    if forced == "ffi":
        raise RuntimeError(
            "T2J_AD_BACKEND=ffi, but the t2j_ad C++ extension is not built. "
            "Reinstall the package (pip install --no-build-isolation -e .) or "
            "unset T2J_AD_BACKEND to use the callback backend."
        )
    if not _warned_missing_ffi:
        _warned_missing_ffi = True
        warnings.warn(
            "t2j_ad: the C++ extension is not built; using the slower Python "
            "callback backend. Reinstall the package to build it.",
            RuntimeWarning,
            stacklevel=3,
        )
    return callback
