"""A ``jaxify_module`` call's parametrized tensors, cached for that call alone.

NOTE [a module call's own parametrization cache]
Inside ``torch.nn.utils.parametrize.cached()``, a parametrized tensor
(``orthogonal``'s ``weight``) is computed once, at its first read, and kept
in a module-level dict under ``(id(module), name)`` until the block ends.
``jaxify_module`` binds each call's ``params`` into the module, so the
first call in the block cached the weight of its own parameters, and every
later call read it, whatever parameters it was given: ``jax.value_and_grad``
inside the block took its value from the value call and its reverse pass
read that call's weight, a constant, so the gradient with respect to
``parametrizations.weight.original`` lost every path through the weight
(off by 1.2, silently, where PyTorch's ``backward`` in the same block gives
the gradient); and a training step called twice in one block returned the
first step's loss for the second's parameters. So a module call sets
aside the entries of the modules it binds tensors into, lets its forward
cache and read its own (a weight read twice in one forward is computed
once, as ``cached()`` promises), and puts the set-aside entries back when
the forward ends, dropping its own (walking a copy of the dict's keys:
another thread's forward in the same block adds entries meanwhile).
Outside ``cached()`` (the count ``parametrize`` keeps is 0) nothing is
done: two attribute reads and a reused ``nullcontext`` per call, 0.4 us.
A function that closes over the module (``jaxify(lambda x: model(x))``)
reads the module's own parameters, whose cached weight is right for every
call, and is left alone (NOTE [trial runs leave caches as they found them]
in trial_caches.py covers its trial runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.nn.utils import parametrize


_NOTHING_TO_DO = contextlib.nullcontext()  # outside cached(): no generator to run on every call


def own_parametrization_cache(module_ids: frozenset[int]) -> contextlib.AbstractContextManager[None]:
    """Within the block, ``parametrize.cached()``'s entries for the modules
    whose ids are ``module_ids`` are this call's alone (NOTE [a module call's
    own parametrization cache])."""
    cache = getattr(parametrize, "_cache", None)
    if not getattr(parametrize, "_cache_enabled", 0) or type(cache) is not dict:
        return _NOTHING_TO_DO
    return _entries_of_this_call(cache, module_ids)


@contextlib.contextmanager
def _entries_of_this_call(cache: dict[Any, Any], module_ids: frozenset[int]) -> Iterator[None]:
    # ``list(cache)``, a copy made in one C call: a forward on another thread
    # inside the same block adds its own modules' entries meanwhile, and a
    # walk over the dict itself raised "dictionary changed size during
    # iteration" out of this call's forward.
    set_aside: dict[Any, Any] = {key: cache.pop(key) for key in list(cache) if _of(key, module_ids)}
    try:
        yield
    finally:
        for key in list(cache):
            if _of(key, module_ids):
                cache.pop(key, None)
        cache.update(set_aside)


def _of(key: Any, module_ids: frozenset[int]) -> bool:
    return type(key) is tuple and len(key) == 2 and key[0] in module_ids
