"""Runs of the user's function made only to learn something (a trace, shape
inference) leave the tensors it closes over as they found them.

NOTE [trial runs do not write to real tensors]
Two runs of a user's function are not calls: graph mode's trace, on fake
tensors, and shape inference, on meta tensors or zeros. Both can still write,
for real, to tensors the function closes over. FakeTensorMode computes an op
whose tensor arguments are all real (a closed-over buffer and Python numbers)
for real, as constant propagation, in-place ops included; a meta run does the
same for ops on real 0-d tensors; and a run on zeros is real throughout.
BatchNorm's ``num_batches_tracked += 1`` ran in each: after the first call a
graph-mode module counted 2 batches where PyTorch counts 1, and a module
whose meta run failed (``BatchNorm1d(momentum=None)`` reads the count with
``float()``) averaged a batch of zeros into its running statistics. So these
runs go through a dispatch mode that copies a real tensor's value before its
first in-place write, and puts every such value back when the run ends. The
calls themselves make the writes, once each, as in PyTorch.

A module's ``forward`` may also rebind an attribute to a new tensor
(``self.ema = 0.5 * self.ema + 0.5 * x``): the zeros run halved such an
average, and a trace left the module holding fake tensors for good. So a
module whose ``forward`` runs on the trial run's thread has its parameters,
buffers and tensor attributes noted when it starts, and any it rebound put
back when it ends, returned or raised (PyTorch's global forward hooks). A
graph cannot replay a rebinding, which is Python, so a trace that made one is
refused (``trace_refusals.refuse_rebound_attributes``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # private: see the NOTE


class RealWritesUndone(TorchDispatchMode):
    """Within the block, note each real tensor's value before its first
    in-place write; on leaving it, put every noted value back."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            written = args[i] if i < len(args) else kwargs.get(argument.name)
            if type(written) is torch.Tensor and written.device.type != "meta" and id(written) not in self.saved:
                with _disable_current_modes():  # a real copy, not a fake one
                    self.saved[id(written)] = (written, written.detach().clone())
        return func(*args, **kwargs)

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        with torch.no_grad():
            for tensor, value in self.saved.values():
                tensor.copy_(value)
        self.saved.clear()
        return result


_ABSENT = object()


def _attribute_tables(module: torch.nn.Module) -> tuple[dict[str, Any], ...]:
    return (module._parameters, module._buffers, module.__dict__)


class ModuleAttributesKept:
    """Within the block, each tensor a module's ``forward`` on this thread
    binds to one of its names (parameter, buffer or plain attribute) is
    unbound again when that ``forward`` ends, the old value put back;
    ``rebound`` names each as ``Class.name``."""

    def __init__(self) -> None:
        self.rebound: list[str] = []
        self._thread = threading.get_ident()
        self._open: list[tuple[torch.nn.Module, tuple[dict[str, Any], ...]]] = []

    def _starts(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() == self._thread:
            self._open.append((module, tuple(dict(table) for table in _attribute_tables(module))))

    def _ends(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        for i in range(len(self._open) - 1, -1, -1):  # this module's innermost forward
            if self._open[i][0] is module:
                _, before = self._open.pop(i)
                break
        else:
            return
        for table, saved in zip(_attribute_tables(module), before):
            for name in [*saved, *(n for n in table if n not in saved)]:
                old, new = saved.get(name, _ABSENT), table.get(name, _ABSENT)
                if old is not new and (isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor)):
                    if old is _ABSENT:
                        del table[name]
                    else:
                        table[name] = old
                    self.rebound.append(f"{type(module).__name__}.{name}")

    @contextlib.contextmanager
    def watching(self) -> Iterator[ModuleAttributesKept]:
        hooks = torch.nn.modules.module
        starts = hooks.register_module_forward_pre_hook(self._starts)
        ends = hooks.register_module_forward_hook(self._ends, always_call=True)
        try:
            yield self
        finally:
            starts.remove()
            ends.remove()


@contextlib.contextmanager
def trial_run() -> Iterator[ModuleAttributesKept]:
    """A run of the user's function made only to learn something: the real
    tensors it closes over, and the attributes of the modules it runs, are
    as they were when the block ends (NOTE [trial runs do not write to real
    tensors]); yields what records the attributes it rebound."""
    with ModuleAttributesKept().watching() as attributes, RealWritesUndone():
        yield attributes
