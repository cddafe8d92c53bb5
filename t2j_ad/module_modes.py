"""The training flags of the modules a trace ran: one graph per setting.

NOTE [a graph per training mode]
A module's ``forward`` reads ``self.training`` in Python (``Dropout``,
``BatchNorm``, any module of your own), so a trace keeps the branch of the
flag it saw. A graph traced in training mode kept dropping out and
normalizing by batch statistics after ``module.eval()``, where eager calls
follow the flag. So while a function is traced, PyTorch's global forward
pre-hook records every module whose ``forward`` runs on the tracing thread,
with its flag, and the graph is used only while those flags hold: a call that
finds one changed looks up, or traces, the graph for the flags as they are
now (``torch.compile`` guards on the same flag). Checking costs one attribute
read per recorded module per call, and nothing for functions that call no
module. Other Python state a function reads (a global number, an attribute of
its own) is read once per trace, as under ``jax.jit``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

# Each module a trace ran, with its training flag then, in the order they ran.
ModuleModes = tuple[tuple[torch.nn.Module, bool], ...]


class _Recorder:
    """The modules whose ``forward`` ran on one thread, and their flags."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.seen: dict[int, tuple[torch.nn.Module, bool]] = {}

    def __call__(self, module: torch.nn.Module, args: object) -> None:
        if threading.get_ident() == self.thread and id(module) not in self.seen:
            self.seen[id(module)] = (module, bool(module.training))

    def modes(self) -> ModuleModes:
        return tuple(self.seen.values())


@contextlib.contextmanager
def recording_module_modes() -> Iterator[_Recorder]:
    """Within the block, record the modules whose ``forward`` runs on this
    thread (``.modes()`` of what it yields)."""
    recorder = _Recorder()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(recorder)
    try:
        yield recorder
    finally:
        handle.remove()


def modes_hold(modes: ModuleModes) -> bool:
    """Whether every recorded module still has the training flag it had."""
    for module, training in modes:
        if module.training != training:
            return False
    return True
