"""Recurrent modules run without cuDNN in t2j_ad's calls.

NOTE [recurrent modules without cuDNN]
On CUDA, ``nn.LSTM``, ``GRU`` and ``RNN`` take cuDNN's path, which reads
their weights' memory in two places, and ``torch.func``'s wrapped tensors
and a trace's fake tensors have none (pytorch/pytorch#103161, #105982;
pytorch/functorch#629):

- the forward renews its weight list whenever its tables hold other
  tensors than the list (NOTE [a recurrent module's weight list] in
  real_writes.py: every ``jaxify_module`` call, ``functional_call``, a
  trace), and ``flatten_parameters`` then compares the weights'
  ``data_ptr()``: "Cannot access data pointer of Tensor that doesn't have
  storage" (torch 2.11 on an H100);
- ``_VF.lstm`` (and ``gru``, ``rnn_tanh``, ``rnn_relu``) is a composite
  whose cuDNN branch looks for the weights' flat buffer through
  ``weights[0].storage()``, and a ``torch.func`` transform lifts even the
  module's own plain parameters to wrappers of its level there: "Cannot
  access storage of TensorWrapper" in every derivative call.

So no LSTM, GRU or RNN on the GPU had a derivative through t2j_ad by
``torch.func``: a closure over one failed ``jax.grad`` outright (the second
error), ``jaxify_module`` fell back to ``torch.autograd.grad`` with a
warning (the first error, which the fallback takes for a read of a
tensor's data), and graph mode traced neither, not even the value call.
PyTorch's own workaround is ``torch.backends.cudnn.flags(enabled=False)``:
``torch.backends.cudnn.is_acceptable`` (flatten_parameters) and
``at::cudnn_is_acceptable`` (the composite) both answer no first thing when
cuDNN is off, and the module runs PyTorch's own kernels (on CUDA a fused
cell per time step, ``_thnn_fused_lstm_cell``), which every transform and
a trace take. So each ``forward`` of a recurrent module inside a t2j_ad
call runs with cuDNN off, switched off by a global forward pre-hook and
back on by a forward hook, only for the recurrent module's own forward:
a convolution beside it keeps cuDNN. All of them, value calls included,
not only the derivative calls and traces that fail: a value call and its
derivatives then compute with one kernel, and a stacked module's dropout
between layers draws from PyTorch's generator, which t2j_ad replays (NOTE
[derivatives replay the value's draws] in replayed_calls.py), where
cuDNN's dropout draws from a state of its own, seeded from the generator
only when first used or after a reseed: a gradient taken through another
mask than the value's.

The cost: the recurrent module's forward runs PyTorch's kernels instead of
cuDNN's sequence kernel (not measured: slower by the launches of a cell per
time step, which a graph captured as a CUDA graph replays at once), and the
functions that refer to one (``module_modes.referenced_modules`` and their
submodules, when the signature is resolved) run their eager calls and traces
with the two global hooks on, a few microseconds per module called in them;
a graph's replay runs no forward and pays nothing. Functions without one, and
a PyTorch without cuDNN (the CPU build: ``CUDNN_PRESENT``), pay nothing.
cuDNN's switch is PyTorch's process-wide one (``at::globalContext``): while a
recurrent forward of a call runs, a cuDNN op on another thread runs PyTorch's
kernel too; a count held under a lock switches it back on when the last such
forward ends, to what it was before the first. A recurrent module reached
only deeper than ``referenced_modules`` looks, or run by its ``forward``
called directly (``self.rnn.forward(x)`` runs no hook), or ``torch._VF``
called directly, keeps cuDNN and fails as before. The weight lists
``jaxify_module`` renews after a call (``module._weight_lists_renewed``) are
renewed with cuDNN off too: a flatten there copied every weight into a new
buffer after each call, for nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .module_hooks import own_global_hooks
from .settings_held_off import HeldOff

# Whether this PyTorch could run cuDNN's recurrent kernels at all.
CUDNN_PRESENT = torch.backends.cudnn.is_available()

_RECURRENT = torch.nn.RNNBase


def _set_cudnn(enabled: bool) -> None:
    torch.backends.cudnn.enabled = enabled


# cuDNN's process-wide switch, off while any recurrent forward of a t2j_ad
# call runs on any thread, back to what it was when the last ends.
_switch = HeldOff(lambda: torch.backends.cudnn.enabled, _set_cudnn)


@contextlib.contextmanager
def cudnn_off() -> Iterator[None]:
    """Within the block, cuDNN is off (NOTE [recurrent modules without cuDNN])."""
    _switch.off()
    try:
        yield
    finally:
        _switch.back()


@contextlib.contextmanager
def recurrent_forwards_without_cudnn() -> Iterator[None]:
    """Within the block, each recurrent module's ``forward`` on this thread
    runs with cuDNN off, and nothing else does."""
    thread = threading.get_ident()
    running = [0]  # recurrent forwards begun here and not yet ended

    def starts(module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, _RECURRENT) and threading.get_ident() == thread:
            _switch.off()
            running[0] += 1

    def ends(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(module, _RECURRENT) and threading.get_ident() == thread and running[0]:
            running[0] -= 1
            _switch.back()

    try:
        with own_global_hooks(starts, ends):
            yield
    finally:
        # A forward a BaseException ended ran no forward hook (NOTE
        # [forwards a KeyboardInterrupt ends] in real_writes.py).
        for _ in range(running[0]):
            _switch.back()


def runs_recurrent_modules(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether ``modules`` or a submodule of theirs is an LSTM, GRU or RNN."""
    return any(isinstance(sub, _RECURRENT) for module in modules for sub in module.modules())


def without_cudnn_in_recurrent_forwards(
    fn: Callable[..., Any], modules: Sequence[torch.nn.Module]
) -> Callable[..., Any]:
    """``fn``, whose recurrent modules' forwards run with cuDNN off (NOTE
    [recurrent modules without cuDNN]); ``fn`` itself where ``modules`` (the
    modules it refers to) hold none, or PyTorch has no cuDNN."""
    if not CUDNN_PRESENT or not runs_recurrent_modules(modules):
        return fn

    def without_cudnn(*args: Any, **kwargs: Any) -> Any:
        with recurrent_forwards_without_cudnn():
            return fn(*args, **kwargs)

    return without_cudnn
