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
first in-place write, and puts every such value back when the run ends. An
in-place write is an argument the op's schema marks as written, and the
running statistics batch norm's kernels update unmarked
(``_UNDECLARED_WRITES``). The calls themselves make the writes, once each,
as in PyTorch.

A module's ``forward`` may also rebind an attribute to a new tensor
(``self.ema = 0.5 * self.ema + 0.5 * x``), or one of a submodule's
(``self.child.ema = ...``): the zeros run halved such an average, and a
trace left the module holding fake tensors for good. So when a module's
``forward`` starts on the trial run's thread (PyTorch's global forward
hooks), the parameters, buffers and tensor attributes of that module and of
every module under it are noted, unless an enclosing ``forward`` noted them,
and any of them rebound is put back when that ``forward`` ends, returned or
raised: inside whatever swapped tensors in around the call
(``functional_call``), which then puts its own back. A graph cannot replay a
rebinding, which is Python, so a trace that made one is refused
(``trace_refusals.refuse_rebound_attributes``). A binding the function makes
before any module it reaches runs (a plain function assigning
``model.ema = ...``) is Python state of its own, read once per trace.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # private: see the NOTE

from .random_state import random_state_kept


_aten = torch.ops.aten
# Ops that write arguments their schema does not mark as written: batch
# norm's kernels update the running mean and variance (arguments 3 and 4) in
# training mode. BatchNorm(momentum=None)'s run on zeros averaged a batch of
# zeros into them for good.
_UNDECLARED_WRITES = {
    _aten.native_batch_norm.default: (3, 4),
    _aten.cudnn_batch_norm.default: (3, 4),
    _aten.miopen_batch_norm.default: (3, 4),
}


class RealWritesUndone(TorchDispatchMode):
    """Within the block, note each real tensor's value before its first
    in-place write; on leaving it, put every noted value back."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        schema = func._schema.arguments
        marked = [i for i, argument in enumerate(schema) if argument.alias_info and argument.alias_info.is_write]
        for i in (*marked, *_UNDECLARED_WRITES.get(func, ())):
            written = args[i] if i < len(args) else kwargs.get(schema[i].name)
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


_Noted = dict[int, tuple[torch.nn.Module, tuple[dict[str, Any], ...]]]  # id -> (module, copies of its tables)


class ModuleAttributesKept:
    """Within the block, each tensor bound to a name (parameter, buffer or
    plain attribute) of a module whose ``forward`` runs on this thread, or of
    a module under it, is unbound again when that ``forward`` ends, the old
    value put back; ``rebound`` names each as ``Class.name``."""

    def __init__(self) -> None:
        self.rebound: list[str] = []
        self._thread = threading.get_ident()
        # One frame per forward running, outermost first: the module, and the
        # modules it was first to note (itself and those under it).
        self._open: list[tuple[torch.nn.Module, _Noted]] = []
        self._noted: set[int] = set()  # ids of the modules some open frame noted

    def _starts(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        noted: _Noted = {}
        if id(module) not in self._noted:  # else an open frame noted it and those under it
            for sub in module.modules():
                if id(sub) not in self._noted:
                    self._noted.add(id(sub))
                    noted[id(sub)] = (sub, tuple(dict(table) for table in _attribute_tables(sub)))
        self._open.append((module, noted))

    def _ends(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        for i in range(len(self._open) - 1, -1, -1):  # this module's innermost forward
            if self._open[i][0] is module:
                self._put_back(self._open.pop(i)[1])
                return

    def _put_back(self, noted: _Noted) -> None:
        for module, before in noted.values():
            self._noted.discard(id(module))
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
            while self._open:  # a forward whose end no hook saw
                self._put_back(self._open.pop()[1])


@contextlib.contextmanager
def trial_run() -> Iterator[ModuleAttributesKept]:
    """A run of the user's function made only to learn something: the real
    tensors it closes over, the attributes of the modules it runs, and
    PyTorch's random state are as they were when the block ends (NOTE [trial
    runs do not write to real tensors], NOTE [random state in trial runs]);
    yields what records the attributes it rebound."""
    with ModuleAttributesKept().watching() as attributes, RealWritesUndone(), random_state_kept():
        yield attributes
