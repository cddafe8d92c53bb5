"""A derivative called apart from its value call, outside ``jax.jit``: the
pullback ``jax.vjp`` returns, the function ``jax.linearize`` returns.

NOTE [a derivative called apart from its value]
``y, pullback = jax.vjp(f, x)`` runs the value call at once and the
derivative only when ``pullback(ct)`` is called; ``jax.linearize`` the
same. A derivative is a call of its own that runs the function again (NOTE
[every derivative is a PyTorch function] in torch_fn.py), with the modules
as they are then. A forward hook removed in between (``handle.remove()``)
was not in the derivative, and one registered in between was: the gradient
was that of another function than the value's (off by 6.57 in the twelfth
fuzzing pass), silently, in eager and graph mode alike. PyTorch's
``backward`` differentiates the forward it recorded. A one-shot hook (one
that calls its own ``handle.remove()``) did the same within one
``jax.value_and_grad``: its value call ran the hook, its derivative did
not.

Running the derivative with the value call's hooks would take putting
removed hooks back into the modules' tables for a while, which other
threads and the hooks themselves see (the reverted attempt of the twelfth
fuzzing pass, BENCHMARKS.md). So such a derivative is refused instead, as
its call is bound: each call of the primitive outside a compiled program
goes through ``torch_call_impl``, and a derivative (a TorchFn with a
``Jvp`` or ``Vjp``) whose signature's structure no longer holds (NOTE [a
hook added after a call], NOTE [a hook removed after a call] and NOTE [a
submodule replaced after a call] in module_structure.py: one integer
compare and one dict lookup per hook while nothing moved) raises
``ModulesChangedSinceValueError``, naming the function and the fix (call
``jax.vjp`` again). The same hook registered again in between (NOTE [a
hook registered again]) holds, and runs. A submodule replaced in between
is refused alike. A name the function reads, rebound in between, is not
compared here: a forward may rebind one on every call (``self.act = ...``,
NOTE [a name the function rebinds, watched by its code] in
named_bindings.py), and where that changes what it draws or writes the
derivative's runner refuses it. A function whose
own forward binds its submodules (``self.active = self.heads[self.k]``,
NOTE [a submodule switched by its own forward]) changes the structure in
its value call itself, and is not checked. Nor is a function that runs no
module: a global hook registered in between (``torch.utils.module_tracker``,
which ``FlopCounterMode`` enters) reaches no module of its. A hook that only
observes (an activation capture, returning None) removed in between is
refused too, which costs the "register, forward, remove, backward"
pattern a reorder (call the pullback, then remove the hook): whether a
hook changes what it sees shows only as it runs.

A derivative bound with its value call (``jax.grad``, ``jax.jvp``,
``jax.value_and_grad`` without ``jax.jit``) binds it right after the
value call: only a change the value call made itself is seen there, a
one-shot hook (or a forward that installs a hook on its first run, which
is refused on that first derivative call too). Under ``jax.jit`` nothing
is bound as it runs: the value call and its derivatives run in one
program, with the modules as they are then, and a one-shot hook is NOTE
[a hook that removed itself in a jitted call]. Not seen: a pullback of a
function ``jax.jit`` compiled (``jax.vjp(jax.jit(f), x)``), whose calls
are bound when traced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._jax_internals import apply_primitive
from .primitive import torch_call_p
from .runtime import TorchCallError, structure_of
from .torch_fn import Jvp, TorchFn, Vjp


class ModulesChangedSinceValueError(TorchCallError):
    """The modules a function runs changed between its value call and a
    derivative called apart from it: a hook added or removed, a submodule,
    parameter or buffer registered or replaced (NOTE [a derivative called
    apart from its value])."""


def _changed_since_value(fun: TorchFn) -> bool:
    """Whether ``fun`` is a derivative whose signature's structure no longer
    holds: its modules' hooks or submodules changed since the signature was
    resolved."""
    if not any(isinstance(t, (Jvp, Vjp)) for t in fun.transforms):
        return False
    structure = structure_of(fun)
    # A forward that binds its own submodules (NOTE [a submodule switched by
    # its own forward]) changes the structure in its value call itself; a
    # function that runs no module is untouched by a global hook registered
    # in between (torch.utils.module_tracker's, FlopCounterMode's).
    return (
        structure is not None
        and structure.runs_modules()
        and not structure.binds_its_own_submodules()
        and not structure.modules_hold()
    )


def refusal(name: str) -> ModulesChangedSinceValueError:
    """The error of a derivative of ``name`` called after its modules changed
    since its value call."""
    return ModulesChangedSinceValueError(
        f"{name}: the modules it runs changed between its value call and this derivative: a hook added or "
        f"removed (handle.remove() between jax.vjp or jax.linearize and a call of the function it returned), "
        f"a submodule replaced, or a parameter or buffer registered (by the value call itself, as a forward "
        f"that registers one or installs a hook on its first run). The derivative runs the function again, "
        f"as the modules are now, and would differentiate another function than the value's (PyTorch's "
        f"backward differentiates the forward it recorded), even where the hook only observes: t2j_ad cannot "
        f"tell. Call the function jax.vjp (or jax.linearize) returned before changing the modules, or call "
        f"jax.vjp again after; where the value call changed them itself, make the function's first call a "
        f"plain one (f(x), outside jax.grad), which does so once as PyTorch's first call does."
    )


def torch_call_impl(*args: Any, fun: TorchFn) -> Sequence[Any]:
    """The primitive outside a compiled program: compiled alone, as lax ops
    are, after refusing a derivative whose modules changed since its value
    call (NOTE [a derivative called apart from its value])."""
    if _changed_since_value(fun):
        raise refusal(repr(fun.base.name))
    return apply_primitive(torch_call_p, *args, fun=fun)
