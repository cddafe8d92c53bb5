"""What a graph-mode trace notes of JAX run inside it.

NOTE [JAX inside a trace]
A PyTorch function may call JAX: a jaxified function (``tree_j2t(inner(v))``,
or ``np.asarray(inner(v))``), or any JAX computation whose result it
converts with ``t2j_ad.tree_j2t``. ``make_fx`` cannot see into JAX: the
call runs for real while the trace runs, and its result enters the graph as
a constant, kept for every replay. That constant was garbage (NaN, 1e15)
when the jaxified function closed over a submodule of the ``jaxify_module``
being traced, whose parameters the trace had bound to stand-ins; and stale
when it read a tensor updated in place after the trace (a module's weight),
which graph mode otherwise follows (NOTE [values a graph would keep] in
trace_refusals.py). Neither was announced. So a trace notes each such call
and conversion made on its thread (``noting_jax_inside``), and is refused
when the function returns or raises: it runs eagerly, with a
``FallbackWarning`` naming the reason. A jaxified function called in a
trace is not run at all (``CalledInsideTrace``): it would compute from the
stand-ins, and a graph-mode one would trace on them, and keep running
eagerly for having held them. A JAX computation cannot be traced by
PyTorch at all, so any ``tree_j2t`` in a trace counts, even of an array
that would stay the same (the price is an eager run, never a wrong result);
a jaxified function run by JAX on another thread is caught by its result's
``tree_j2t``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class _OpenTraces(threading.local):
    noted: list[str] | None = None  # what the innermost trace open on this thread noted


_open = _OpenTraces()


@contextlib.contextmanager
def noting_jax_inside() -> Iterator[list[str]]:
    """Yields the list of JAX calls and conversions (their descriptions)
    made on this thread within the block: a trace (NOTE [JAX inside a
    trace])."""
    found: list[str] = []
    outer, _open.noted = _open.noted, found
    try:
        yield found
    finally:
        _open.noted = outer


class CalledInsideTrace(RuntimeError):
    """A jaxified function called while a graph-mode trace is open on this
    thread, which is refused for it (NOTE [JAX inside a trace])."""

    def __init__(self) -> None:
        super().__init__(
            "t2j_ad: a jaxified function called inside a graph-mode trace does not run there; the trace is "
            "refused and the calling function runs eagerly (compile='graph' cannot trace JAX)"
        )


def note_jax_inside(what: str) -> bool:
    """Note ``what`` (a JAX call or conversion) for the trace open on this
    thread, if any; whether there was one (NOTE [JAX inside a trace])."""
    noted = _open.noted
    if noted is None:
        return False
    noted.append(what)
    return True
