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
one call, naming the fix. Where the input is kept by its address, the move
cannot help either: NOTE [inputs kept by their address].

NOTE [the move's copy is no write of the run around]
``own.copy_(storage)`` is an ``aten.copy_`` into a tensor around ``own``,
and PyTorch dispatches it to the modes on the stack. A call made inside
another function's trial run (``call_undone`` in real_writes.py) ends,
and moves what it kept, inside that run's ``RealWritesUndone``: the copy
was noted as an in-place write of a tensor no op of the run made, and
its value before (``own``'s fresh, uninitialized memory) saved. The swap
then gave that tensor XLA's buffer (the caller's JAX array, passed
without a copy), and the run's end "put back" the saved value into it:
the caller's array read heap garbage from then on (a scale of 2 read
back as 1e-45, or 8e35), and the run reported state "updated differently
on zeros than on ones" (the copy counted as a closed-over write). A
nested call that keeps its input (``kept.append(w)``, ``self.prev = x``)
did this on every call inside a trial run; a failing nested call, whose
traceback held its inputs, did it too (NOTE [a failing call's inputs
stay put] in runtime.py). A top-level call moves outside any run, which
is why its arrays stayed intact. So the copy runs with the modes set
aside: it is t2j_ad's, no write of the user's function.

NOTE [inputs kept by their address]
The move reaches what holds the storage: every tensor viewing it. A NumPy
array made from an input (``x.numpy()``, ``np.asarray(x)``, the common
``self.log.append(x.detach().cpu().numpy())``), a memoryview of one, and a
tensor made from either or through DLPack (``torch.from_numpy(x.numpy())``,
``torch.from_dlpack(x)``: a storage of its own around the same memory) hold
the memory's address, taken when they were made; the move leaves them on
XLA's buffer, which they then read after XLA reused it, and write into
(a segfault). Such a holder keeps a tensor viewing the storage alive, as
anything keeping the input does (NumPy's array holds ``x.detach()``), so the
look counts the input as kept; the holder itself is told apart only by
looking for it (``held_by_address``): among the tensors in Python's two
younger generations (what the call made, unless a collection moved it:
NOTE [the caller's own views]
A collection during the call can move a caller's tensor after the mark
(NOTE [what the call made, in Python's generation lists]): the caller's
``tree_j2t`` view, held by a dict made after it, with about 700 container
allocations in the call, which real functions make, was taken for a holder
the call made, and a streaming function's call failed, naming NumPy arrays
it never made (the review of the twentieth session). So ``j2t`` and
``tree_j2t`` note what they hand out (``note_callers_view``, a weak set),
and the look passes over those: a view of a JAX array the caller holds
keeps that array's buffer alive through JAX, and no call made it. A
caller's own ``torch.from_dlpack(x)`` is not noted, and is told by its
place in the lists only.

NOTE [a collection during the look's call]), one around the input's memory
with a storage of its own (not another input's: NOTE [inputs sharing one
buffer]), or one viewing the input's storage held by more than
the objects Python's collector sees hold it and PyTorch's own holders (a
NumPy array is no object the collector sees; a list, a dict, an attribute,
a frame, an autograd graph or a view are). Where one is found, the function
runs on copies from then on, as on a PyTorch that cannot move inputs; the
call that ran on XLA's buffers fails, naming the fix (keep ``.copy()``). The
first call, on copies, is looked at for this too, so a function that keeps
such arrays from the start (logging its inputs) never fails.

Looking for holders costs a pass over every object Python tracks (about
50 ms with PyTorch and JAX loaded) where a view of the input was made in
the call, so it is made only on calls that kept an input, and only on the
first ``_KEEPING_CALLS_LOOKED_INTO`` of them a function makes: a streaming
module's later calls move what they keep as before. A function that starts
keeping such an array after that, or that keeps the address in another
form (``x.data_ptr()`` through ctypes, a DLPack capsule not yet consumed, a
JAX array made from it), is not found: keep a copy (``x.numpy().copy()``).

On CUDA the look is not made yet. On an H100 with torch 2.11 (the
seventeenth session) it found inputs "kept" by calls that keep nothing
(``x.sin() * 3`` under ``jax.grad`` in graph mode), and that PyTorch has no
``UntypedStorage._swap_data_ptr_`` to move them with, so such calls failed.
Both showed on the CPU too with torch 2.11 (``scripts/test_torch_version.sh``)
and are handled as said here: the storage's Python object, made by the
trace, and copies where nothing can be moved. Until the look is run on a
GPU, GPU calls are as before it: a function that keeps an input past the
call must keep a copy (``x.clone()``).

NOTE [inputs sharing one buffer]
XLA may pass one buffer as two inputs: ``f(x, x)``, or, under ``jax.jit``,
``f(x, x.reshape(3, 2))``. Each input is then a tensor with a storage of its
own around the same memory, so a function keeping ``a.detach()`` and
``b.detach()`` leaves, for the look at ``a``, a tensor around ``a``'s memory
with a storage of its own: ``b``'s, which is what ``from_numpy`` and
``from_dlpack`` make. It is no holder by address: ``b``'s storage is
looked at, and moved where kept, as ``a``'s is, each to memory of its own
(two JAX values, which PyTorch's writes after the call must not join). So
the look passes over tensors viewing another input's storage; without
this, such a function failed its second call, naming NumPy arrays it
never made (the review of the ninth fuzzing pass's fixes).

NOTE [what the call made, in Python's generation lists]
A tensor the caller made from the JAX array it passes
(``t2j_ad.tree_j2t(x)``, ``torch.from_dlpack(x)``) and holds during a call
that keeps its input has a storage of its own around the input's memory,
as a ``from_dlpack`` holder made in the call has; it holds the buffer
through JAX, a reference of its own, and is no holder the call made. Such
a call failed, naming NumPy arrays (the review of the ninth fuzzing pass's
fixes). Nothing about the two tensors tells them apart (counting the input
storage's uses does not: ``from_dlpack``'s capsule keeps ``x.detach()``'s
Python tensor alive), but when they were made does. Python's collector
appends what it starts tracking (every tensor, when made) to the end of
its youngest generation's list, and a collection appends the survivors of
a generation to the end of the next one's, so its lists, oldest generation
first, run from older to newer. The runner's ``references`` list, made
just before the call and held by the runner's frame through it, marks
where the call's objects begin (a ``mark``): a tensor of a storage of its
own counts only where listed after it (in its generation's list, or in a
younger generation). A collection can move an object to the end of its
list (one that only objects of that list reach, listed after it), which
makes it look newer, never older: the mark, held from outside the lists,
stays where it is, so a holder the call made is always found; a caller's
tensor so moved would be taken for one (NOTE [the caller's own views]).

NOTE [a collection during the look's call]
Python's collector moves what survives a collection of its generation 1 to
the oldest (generation 2), as ``gc.collect()``, ``gc.collect(1)`` or about
7,000 net allocations in the call do (thresholds 700 and 10). A holder by
address made before that (the call's ``self.log.append(x.numpy())``) is then
no longer among the young generations' objects, and a look at those only
missed it: the logged arrays read XLA's reused buffers (the review of the
ninth fuzzing pass's fixes). The look's mark tells when (NOTE [what the
call made, in Python's generation lists]): made before anything the call
made, it is in a generation at least as old as theirs, so it leaves the
young generations whenever the call's objects do. So where the mark is not
among the young generations' objects, the look passes over the oldest's
too (a few hundred thousand objects with PyTorch and JAX loaded: about 0.1
to 0.3 s more on a 2-core CPU at load 8, one to three times a look's
cost), and only then: a look that finds the mark young costs what it did,
and calls that keep nothing make no look. No gc callback and no count
read before each call: the hot path is unchanged (the mark is the list
each call made already).
"""

from __future__ import annotations

import gc
import weakref
import sys
from collections.abc import Sequence
from typing import Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes  # private, as in real_writes.py

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
# NOTE [inputs kept by their address]: how many of a function's calls that
# keep an input are looked at for what holds its address.
_KEEPING_CALLS_LOOKED_INTO = 3
# Python's young generations: what a call made, unless a collection moved
# it to the oldest (NOTE [a collection during the look's call]).
_YOUNG_GENERATIONS = (0, 1)
_OLDEST_GENERATION = 2


def references(inputs: Sequence[torch.Tensor]) -> list[int]:
    """How many references each input has now, before the call: the same
    tensor kept (``self.prev = x``) shows as one more after it. Counted as
    ``_kept`` counts them: the list's, and the count's argument."""
    return [_refcount(inputs[i]) for i in range(len(inputs))]


def any_kept(inputs: Sequence[torch.Tensor], before: Sequence[int]) -> bool:
    """Whether something other than the call still holds one of ``inputs``
    (the tensor itself, past ``before``'s count, or its storage)."""
    return any(_kept(inputs, i, before) for i in range(len(before)))


class Keeper(Protocol):
    """What the look counts on a function (``TorchFn``): how many of its
    calls that kept an input were looked at for holders of its address."""

    keeping_calls_looked_into: int


def release_kept_inputs(
    inputs: Sequence[torch.Tensor], before: Sequence[int], fn: Keeper, handling: BaseException | None
) -> bool:
    """Move each input's storage that something other than the call still
    holds (the tensor itself, past ``before``'s count, or a view of it) to
    memory of its own (NOTE [inputs kept past a call]). Only where
    ``CAN_MOVE``. Whether one of them is also held by its address, which the
    move does not reach, on the first calls of ``fn`` that keep one, unless
    the call failed (``sys.exception()`` is not ``handling``, the exception
    the caller handles: a traceback is no keeper) (NOTE [inputs kept by
    their address])."""
    look: bool | None = None  # decided at the call's first kept input
    by_address = False
    for i in range(len(before)):  # no zip: its reused tuple would hold an input
        if _kept(inputs, i, before):
            storage = inputs[i].untyped_storage()
            if storage.nbytes():
                if look is None:
                    look = sys.exception() is handling and _one_more_look(fn)
                if look and not by_address:
                    by_address = held_by_address(inputs, i, before)  # before the move: the address is XLA's
                _to_own_memory(storage)
    return by_address


def _one_more_look(fn: Keeper) -> bool:
    """Whether this call of ``fn``, which kept an input, is looked at for
    holders of its address: one of its first ``_KEEPING_CALLS_LOOKED_INTO``."""
    if fn.keeping_calls_looked_into >= _KEEPING_CALLS_LOOKED_INTO:
        return False
    fn.keeping_calls_looked_into += 1
    return True


def kept_by_address(inputs: Sequence[torch.Tensor], before: Sequence[int], fn: Keeper) -> bool:
    """Whether one of ``inputs`` that something other than the call still
    holds is held by its address (NOTE [inputs kept by their address]), on
    the first calls of ``fn`` that keep one."""
    if not _one_more_look(fn):
        return False
    return any(_kept(inputs, i, before) and held_by_address(inputs, i, before) for i in range(len(before)))


def held_by_address(inputs: Sequence[torch.Tensor], i: int, mark: object) -> bool:
    """Whether something the call made holds the memory of ``inputs[i]`` by
    its address: a tensor around that memory with a storage of its own, or a
    tensor viewing its storage held by an object Python's collector does not
    see, a NumPy array (NOTE [inputs kept by their address]). ``mark`` is an
    object Python's collector tracks, made just before the call and held
    through it (the list ``references`` made): what its generation lists
    hold after it, the call made (NOTE [what the call made, in Python's
    generation lists]). Looks in Python's two younger generations, and in
    the oldest too where a collection moved the call's objects there (NOTE
    [a collection during the look's call]). Costly: only for an input found
    kept."""
    if not inputs[i].data_ptr():
        return False
    look = _AddressLook(inputs, i, mark)
    for generation in _YOUNG_GENERATIONS:
        if look.finds_own_storage_in(gc.get_objects(generation)):
            return True
    if not look.mark_seen and look.finds_own_storage_in(gc.get_objects(_OLDEST_GENERATION)):
        return True
    return look.viewed_unseen()


# NOTE [the caller's own views]: the tensors ``t2j_ad.j2t`` and ``tree_j2t``
# handed out, by id, each weakly (not a WeakSet: it compares a tensor with
# ``==``, elementwise).
_callers_views: dict[int, weakref.ref[torch.Tensor]] = {}


def note_callers_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, noted as a view of a JAX array the caller made (NOTE [the
    caller's own views]): no holder a call made."""
    key = id(tensor)
    _callers_views[key] = weakref.ref(tensor, lambda ref, key=key: _forget_view(key, ref))
    return tensor


def _forget_view(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    if _callers_views.get(key) is ref:  # not a newer tensor's entry at the same address
        del _callers_views[key]


def _a_callers_view(obj: object) -> bool:
    """Whether ``obj`` is a tensor ``note_callers_view`` noted."""
    ref = _callers_views.get(id(obj))
    return ref is not None and ref() is obj


class _AddressLook:
    """One look for what holds ``inputs[i]``'s memory by its address, over
    the objects of one generation after another, the youngest first."""

    def __init__(self, inputs: Sequence[torch.Tensor], i: int, mark: object) -> None:
        self.input = inputs[i]
        self.start = inputs[i].data_ptr()
        self.end = self.start + inputs[i].untyped_storage().nbytes()
        self.address = _storage_address(inputs[i])
        self.own = {id(t) for t in inputs}
        # NOTE [inputs sharing one buffer]: another input's storage is no holder.
        self.other_inputs = {_storage_address(t) for t in inputs} - {self.address}
        self.viewing: list[torch.Tensor] = []
        self.mark = mark
        # Whether ``mark`` was among the objects looked at: made before the
        # call, it left the young generations only if the call's own objects
        # did too (NOTE [a collection during the look's call]).
        self.mark_seen = False

    def finds_own_storage_in(self, objects: list[object]) -> bool:
        """Whether one of ``objects``, in the order of a generation's list,
        is a tensor the call made (listed after ``mark``, or in a generation
        younger than its) around the input's memory with a storage of its
        own (``from_numpy``, ``from_dlpack``). The tensors viewing the
        input's storage are kept for ``viewed_unseen``. ``objects`` is the
        caller's to drop: it holds every tensor in it."""
        mark_in_younger = self.mark_seen
        before_mark = False  # such a tensor listed before ``mark`` in ``objects``
        for obj in objects:
            if obj is self.mark:
                self.mark_seen = True
                continue
            if not issubclass(type(obj), torch.Tensor) or id(obj) in self.own:  # type(): no __class__ run
                continue
            if _a_callers_view(obj):  # NOTE [the caller's own views]
                continue
            try:
                address = _storage_address(obj)
                if address == self.address:
                    self.viewing.append(obj)
                elif (
                    not mark_in_younger
                    and address not in self.other_inputs
                    and self.start <= obj.data_ptr() < self.end
                    and obj.device == self.input.device
                ):
                    if self.mark_seen:
                        return True
                    before_mark = True
            except Exception:  # noqa: BLE001 - a wrapper (functorch's, a subclass's) may have no storage
                continue
        # Listed before ``mark`` in its own list, made before the call: the caller's.
        return before_mark and not self.mark_seen

    def viewed_unseen(self) -> bool:
        """Whether a tensor viewing the input's storage is held by an object
        Python's collector does not see (``_held_unseen``)."""
        viewing, self.viewing = self.viewing, []
        return bool(viewing) and _held_unseen(viewing)


def _held_unseen(tensors: list[torch.Tensor]) -> bool:
    """Whether one of ``tensors`` has more references than the objects
    Python's collector sees holding it, and PyTorch's own holders (an
    autograd graph, a view's base: one reference for all of them) explain."""
    seen = [0] * len(tensors)
    for holder in gc.get_referrers(*tensors):
        for k in range(len(tensors)):
            seen[k] += sum(1 for held in gc.get_referents(holder) if held is tensors[k])
    holder = None
    # getrefcount's argument is none of ``seen``; ``tensors`` is one of them.
    return any(
        _refcount(tensors[k]) - 1 - seen[k] - (tensors[k]._use_count() > 1) > 0 for k in range(len(tensors))
    )


def _kept(inputs: Sequence[torch.Tensor], i: int, before: Sequence[int]) -> bool:
    if _refcount(inputs[i]) > before[i]:
        return True
    address = _storage_address(inputs[i])
    if _use_count(address) <= _CALLS_OWN:
        return False
    # Perhaps only the storage's own Python object (NOTE [inputs kept past a call]).
    storage = inputs[i].untyped_storage()
    return _use_count(address) > _WITH_ITS_OBJECT or _refcount(storage) > _OBJECT_REFS


def unmovable_kept_input(by_address: bool = False) -> RuntimeError:
    """The error for a call on XLA's buffers that kept an input where it
    cannot be moved (NOTE [inputs kept past a call]), or by its address
    (NOTE [inputs kept by their address])."""
    if by_address:
        return RuntimeError(
            "t2j_ad: the PyTorch function kept one of its inputs past the call by its memory's address: a NumPy "
            "array of it (x.numpy(), np.asarray(x)), a memoryview, or a tensor made from one "
            "(torch.from_numpy, torch.from_dlpack). XLA reuses that buffer after the call, and such a holder "
            "cannot be moved to memory of its own. Later calls run on copies of the inputs; what this call "
            "kept reads memory XLA reuses, so drop it (or reset the state that holds it), and keep a copy "
            "instead (x.numpy().copy(), x.clone())."
        )
    return RuntimeError(
        "t2j_ad: the PyTorch function kept one of its inputs (or a view of one) past the call, and "
        f"this PyTorch ({torch.__version__}) cannot move it to memory of its own; XLA reuses that "
        "buffer after the call. Later calls run on copies of the inputs; what this call kept reads "
        "memory XLA reuses, so drop it (or reset the state that holds it: module.prev = None), and keep "
        "a copy instead (x.clone()), or use a PyTorch with UntypedStorage._swap_data_ptr_."
    )


def _to_own_memory(storage: torch.UntypedStorage) -> None:
    own = torch.UntypedStorage(storage.nbytes(), device=storage.device)
    with _disable_current_modes():  # NOTE [the move's copy is no write of the run around]
        own.copy_(storage)
    storage._swap_data_ptr_(own)  # ``own`` now holds XLA's buffer, and lets it go here
