"""t2j_ad's own global module hooks, which its trial runs and replays add
for the length of a call, told apart from the user's.

NOTE [a hook added after a call] (module_structure.py) compares the hooks of
a function's modules again only after PyTorch has numbered another hook
(``RemovableHandle.next_id``). The hooks t2j_ad itself adds (a replay of a
``BatchNorm`` in training mode adds two per call) would move that number on
every call, and every call would walk the modules; so they are registered
here, which counts them and remembers their ids: ``user_hooks_registered``
is the number less ours, and ``ours`` tells one of ours in a hook table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn.modules.module as _module_hooks  # public: torch.nn.modules.module.register_module_*_hook
from torch.utils.hooks import RemovableHandle

# How many hooks t2j_ad has registered, and the ids of those registered now.
# Read and written without a lock: a lost count costs one walk of the modules.
_registered_by_us = [0]
_ids_now: set[int] = set()


def user_hooks_registered() -> int:
    """How many hooks have been registered anywhere but by t2j_ad."""
    return RemovableHandle.next_id - _registered_by_us[0]


def ours(handle_id: Any) -> bool:
    """Whether the hook under ``handle_id`` in a hook table is t2j_ad's."""
    return handle_id in _ids_now


@contextlib.contextmanager
def global_module_hooks(
    forward_pre: Callable[..., Any] | None = None, forward: Callable[..., Any] | None = None
) -> Iterator[None]:
    """Within the block, ``forward_pre(module, args)`` before every module's
    ``forward`` and ``forward(module, args, output)`` after it (also when it
    raises), for every module."""
    handles: list[RemovableHandle] = []
    try:
        if forward_pre is not None:
            _registered_by_us[0] += 1
            handles.append(_module_hooks.register_module_forward_pre_hook(forward_pre))
            _ids_now.add(handles[-1].id)
        if forward is not None:
            _registered_by_us[0] += 1
            handles.append(_module_hooks.register_module_forward_hook(forward, always_call=True))
            _ids_now.add(handles[-1].id)
        yield
    finally:
        for handle in handles:
            handle.remove()
            _ids_now.discard(handle.id)
