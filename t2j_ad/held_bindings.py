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
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any


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


def release_after_the_call(release: Callable[[], Any]) -> bool:
    """Leave ``release`` to the derivative call running on this thread, if
    any (True); False where none is, and the caller releases now."""
    if _scope.pending is None:
        return False
    _scope.pending.append(release)
    return True
