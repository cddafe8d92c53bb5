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
"""

from __future__ import annotations

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
