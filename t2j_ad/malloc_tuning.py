"""Keep glibc's heap from shrinking and regrowing on every call.

NOTE [heap trimming]
A call that returns megabytes (per-example gradients: 2.1 MB for an MLP
32-64-1 at batch 256) has two large buffers per call that torch.func alone
does not: XLA's output buffer, and PyTorch's result, which is copied into it
and freed. With glibc's starting thresholds, freeing both can leave more than
the trim threshold free at the top of the heap; glibc then returns it to the
OS (``brk`` down), and the next call takes it back (``brk`` up) and touches
every page again: up to about 1,000 page faults per call. With them,
``jit(vmap(grad))`` took a median 1.9x the time of ``torch.func.vmap(grad)``;
without, 1.4x (benchmarks/bench_per_example_grads.py; BENCHMARKS.md).
Whether it happens depends on the process's history: glibc raises its
thresholds on its own the first time a large mmap'd block (up to 32 MiB) is
freed, so a process that ever freed a 16 MiB array never saw it.

``tune_malloc`` puts glibc straight into that state: the mmap threshold at
glibc's own ceiling for it (32 MiB on 64-bit) and the trim threshold at twice
that, which is what glibc's dynamic rule would set. The cost is that up to
64 MiB of free memory at the top of each malloc arena stays in the process
instead of going back to the OS.

It is process-wide, like PyTorch's thread count (see NOTE [torch threads] in
runtime.py), so it is applied once, when t2j_ad first runs a PyTorch
function, and never when the application has made its own choice: an
explicit ``MALLOC_*`` or ``GLIBC_TUNABLES`` malloc setting wins, and
``T2J_AD_TUNE_MALLOC=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable

from .env_switch import env_switch

ENV = "T2J_AD_TUNE_MALLOC"
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, and its dynamic rule's trim
# threshold for it (malloc.c: trim_threshold = 2 * mmap_threshold).
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD

# mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Settings that show the application chose its own malloc behaviour.
_USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold", "glibc.malloc.top_pad")

_outcome: str | None = None


def _enabled() -> bool:
    return env_switch(ENV, on="tune glibc's malloc", off="leave it alone")


def _user_configured() -> bool:
    if any(name in os.environ for name in _USER_ENV):
        return True
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(name in tunables for name in _USER_TUNABLES)


def on_glibc() -> bool:
    """Whether this process's malloc is glibc's, the one these settings tune."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _mallopt() -> Callable[[int, int], int] | None:
    if not on_glibc():
        return None
    fn = getattr(ctypes.CDLL(None), "mallopt", None)
    if fn is not None:
        fn.argtypes = (ctypes.c_int, ctypes.c_int)
        fn.restype = ctypes.c_int
    return fn


def tune_malloc() -> str:
    """Apply the settings of NOTE [heap trimming] once; say what happened.

    Returns ``"tuned"``, or why not: ``"disabled"`` (``T2J_AD_TUNE_MALLOC=0``),
    ``"user-configured"`` (the environment sets glibc's malloc thresholds),
    ``"not-glibc"``, or ``"refused"`` (glibc rejected a value). Later calls
    return the first call's answer.
    """
    global _outcome
    if _outcome is None:
        _outcome = _tune()
    return _outcome


def _tune() -> str:
    if not _enabled():
        return "disabled"
    if _user_configured():
        return "user-configured"
    mallopt = _mallopt()
    if mallopt is None:
        return "not-glibc"
    # mallopt returns 1 on success. Setting either value also stops glibc's
    # dynamic adjustment, so both are set: the trim threshold alone would
    # leave the mmap threshold at 128 KiB and map every large block afresh.
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "refused"
    return "tuned"
