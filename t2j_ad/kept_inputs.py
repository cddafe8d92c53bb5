"""Inputs a PyTorch function keeps past its call, moved to memory of their own.

NOTE [inputs kept past a call]
A call's inputs are XLA's buffers, seen by PyTorch without a copy, and XLA
owns them only for the call: after it, XLA frees them, or reuses them for
its next values (the carry of a ``lax.scan``'s next step, the next call's
input). PyTorch code may keep an input, or a view of one, past the call: a
streaming module's ``self.prev = x``, a forward hook that saves activations,
``kept.append(x[1:])``, an autograd graph that saved ``x``. That tensor then
read whatever XLA wrote there next (a streaming difference came out 0 in
every step of a scan), and a write through it changed another JAX array, a
jitted program's constant, or freed heap memory (glibc aborted the process).
In PyTorch the kept tensor would hold the value it had.

So at the end of each call the runner looks at how many tensors share each
input's storage (the input itself, and nothing else once the call has
dropped its results) and how many references the input has (as many as
before the call). More means something kept the input or a view of it.
That storage is then moved, in place, to memory of its own holding the
same bytes (``UntypedStorage._swap_data_ptr_``, which CUDA graph trees use
for the same purpose), so every tensor that views it, wherever it is kept,
reads what it read during the call, and writes to it stay PyTorch's; XLA's
buffer goes back to XLA with the call. It costs a look (about 2 us a call
with one input on a CPU, BENCHMARKS.md), and a copy of an input only
where one was kept.

Calls that run on copies of their inputs (a function's first call, until
it shows it leaves its inputs alone) need no look: the copies are PyTorch's.

A storage's use count also counts PyTorch's own Python object for it, which
any ``x.untyped_storage()`` makes and the storage then keeps while a tensor
views it: graph mode's trace makes one (fake tensors read every input's
storage). So a count above one is looked at once more, with that object in
hand: kept only if more than it and the tensor hold the storage, or more
than the storage holds that object. Without this, every first call of a
graph-mode derivative copied its inputs, and on a PyTorch without
``_swap_data_ptr_`` failed. t2j_ad itself keeps no input past a call
either: not in a loop variable, an autograd graph recorded into the
outputs, a base of the copies made inside ``torch.inference_mode``, a walk
of a module's tables made while a call's tensors were bound into them, or a
recurrent module's weight list (all found that way, with torch 2.11).

PyTorch 2.11 (the GPU machines' build) has no ``_swap_data_ptr_``. There a
function seen keeping an input is handed copies from then on, as on its
first call (``keeps_inputs``, read by runtime.py): the first call, on
copies, is looked at too, so a function that keeps inputs from the start
(a streaming module) never fails; one that starts keeping later fails that
one call, naming the fix.

On CUDA the look is not made yet. On an H100 with torch 2.11 (the
seventeenth session) it found inputs "kept" by calls that keep nothing
(``x.sin() * 3`` under ``jax.grad`` in graph mode), and that PyTorch has no
``UntypedStorage._swap_data_ptr_`` to move them with, so such calls failed.
Both showed on the CPU too with torch 2.11 (``scripts/test_torch_version.sh``)
and are handled as said here: the storage's Python object, made by the
trace, and copies where nothing can be moved. Until the look is run on a
GPU, GPU calls are as before it: a function that keeps an input past the
call must keep a copy (``x.clone()``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

# Private, as CUDA graph trees use them: how many tensors (and storage
# objects) hold a storage, named by its address (read without making a
# storage object: that doubled the look's cost), and a storage's memory
# swapped with another's.
_use_count = torch._C._storage_Use_Count
_storage_address = torch._C._storage_address
CAN_MOVE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

# The input tensor itself.
_CALLS_OWN = 1
# With the storage's Python object in hand: the tensor and that object hold
# the storage; the storage, the caller's name for it, and getrefcount's
# argument hold that object.
_WITH_ITS_OBJECT = 2
_OBJECT_REFS = 3
_refcount = sys.getrefcount


def references(inputs: Sequence[torch.Tensor]) -> list[int]:
    """How many references each input has now, before the call: the same
    tensor kept (``self.prev = x``) shows as one more after it. Counted as
    ``_kept`` counts them: the list's, and the count's argument."""
    return [_refcount(inputs[i]) for i in range(len(inputs))]


def any_kept(inputs: Sequence[torch.Tensor], before: Sequence[int]) -> bool:
    """Whether something other than the call still holds one of ``inputs``
    (the tensor itself, past ``before``'s count, or its storage)."""
    return any(_kept(inputs, i, before) for i in range(len(before)))


def release_kept_inputs(inputs: Sequence[torch.Tensor], before: Sequence[int]) -> int:
    """Move each input's storage that something other than the call still
    holds (the tensor itself, past ``before``'s count, or a view of it) to
    memory of its own (NOTE [inputs kept past a call]); how many moved.
    Only where ``CAN_MOVE``."""
    moved = 0
    for i in range(len(before)):  # no zip: its reused tuple would hold an input
        if _kept(inputs, i, before):
            storage = inputs[i].untyped_storage()
            if storage.nbytes():
                _to_own_memory(storage)
                moved += 1
    return moved


def _kept(inputs: Sequence[torch.Tensor], i: int, before: Sequence[int]) -> bool:
    if _refcount(inputs[i]) > before[i]:
        return True
    address = _storage_address(inputs[i])
    if _use_count(address) <= _CALLS_OWN:
        return False
    # Perhaps only the storage's own Python object (NOTE [inputs kept past a call]).
    storage = inputs[i].untyped_storage()
    return _use_count(address) > _WITH_ITS_OBJECT or _refcount(storage) > _OBJECT_REFS


def unmovable_kept_input() -> RuntimeError:
    """The error for a call on XLA's buffers that kept an input where it
    cannot be moved (NOTE [inputs kept past a call])."""
    return RuntimeError(
        "t2j_ad: the PyTorch function kept one of its inputs (or a view of one) past the call, and "
        f"this PyTorch ({torch.__version__}) cannot move it to memory of its own; XLA reuses that "
        "buffer after the call. Later calls run on copies of the inputs; for this one, keep a copy "
        "instead (x.clone()), or use a PyTorch with UntypedStorage._swap_data_ptr_."
    )


def _to_own_memory(storage: torch.UntypedStorage) -> None:
    own = torch.UntypedStorage(storage.nbytes(), device=storage.device)
    own.copy_(storage)
    storage._swap_data_ptr_(own)  # ``own`` now holds XLA's buffer, and lets it go here
