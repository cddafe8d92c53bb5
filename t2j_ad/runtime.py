"""Running a TorchFn on tensors that view XLA's buffers.

Both backends (backends/callback.py and backends/ffi.py) end here: they wrap
XLA's input and output buffers as torch tensors without copying and call
``run_into``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys
import threading
import traceback
from collections.abc import Sequence

import numpy as np
import torch

from . import graph_mode
from .convert import UnsupportedDtypeError, canonical_jax_dtype, jax_dtype, on_another_device, torch_dtype
from .cuda_streams import external_stream, run_on_stream
from .functorch_levels import forward_ad_levels_kept, functorch_levels_open, outside_functorch_levels
from .held_bindings import apart_from_the_call, bound_among, bound_now
from .kept_inputs import CAN_MOVE, any_kept, kept_by_address, release_kept_inputs, unmovable_kept_input
from .kept_inputs import references as kept_inputs_references
from .malloc_tuning import tune_malloc
from .module_hooks import user_hooks_registered
from .module_locks import taken_after
from .module_structure import StructureSeen
from .real_writes import call_undone, one_trial_run, trial_running
from .replayed_calls import (
    Effects,
    GeneratorAround,
    draws_per_example,
    effects_held,
    effects_now,
    generator_around,
    note_value_call,
    replays_a_call_that_removed_hooks,
    replays_with_fewer_effects,
    token_input,
    traced_for,
    unseen_draws_watch,
)
from .random_state import DrawWatch, unseen_draws_refusal
from .rules.fallbacks import warn_once
from .torch_fn import Jvp, TorchFn, Vmap
from .trace_refusals import own_generator_reason
from .transforms import Flat, build


class TorchCallError(RuntimeError):
    """An exception raised by the PyTorch function, or a broken result.

    Raised to the caller of the jaxify'd function (or the computation that
    runs it) with PyTorch's message and traceback; a result that is not a
    tensor, or whose shape or dtype differ from the declared ``output_shapes``,
    gets a message naming the output. The process keeps working.
    """


class InputMutationError(TorchCallError):
    """The PyTorch function wrote into one of its inputs (``mutated``: their
    flat indices, where known).

    Refused, because JAX arrays are immutable: until a function has run once
    without mutating its inputs it gets copies, so the caller's arrays are
    never changed. Clone the input inside the function (``x = x.clone()``)
    before writing into it.
    """

    mutated: tuple[int, ...] | None = None


# NOTE [calls inside torch.inference_mode]
# A call made on a thread inside ``torch.inference_mode()`` (an eager or
# jitted call on the CPU runs on the caller's thread) got inference tensors,
# which keep no version counter (the check below for a write into an input
# failed with PyTorch's "Inference tensors do not track version counter"),
# and ran in inference mode, where every tensor the function makes is one:
# torch.autograd.grad inside it failed ("does not require grad"), on the
# caller's thread only. The caller's inference mode is no part of the
# function (as its autocast region is not: NOTE [calls run without the
# caller's autocast]), so such a call runs outside it, on copies of its
# inputs, into buffers of its own copied into XLA's (inference tensors,
# written only inside inference mode). The runs that infer output shapes
# leave inference mode too.

# NOTE [torch threads]
# XLA calls us from the thread that runs the program (one of its own on a
# GPU or with asynchronous dispatch). PyTorch's intra-op thread count is per
# calling thread (OpenMP), so it must be set here, in the callback, not once
# at import. On a small machine XLA's pool and PyTorch's
# pool oversubscribe the cores: per-example gradients on 2 cores ran ~10x
# slower with both at full width. The caller's own count is put back after
# the call: on the CPU, XLA runs a program's calls on the thread that called
# it (jitted or not, seen with jax 0.10), so a call left the caller's thread
# at ours and the user's PyTorch code outside calls ran on half the cores
# from then on (0.4 us per call to set and put back).
_threads: int | None = None


_MOST_THREADS = 2**31 - 1  # torch.set_num_threads takes a C int


def torch_threads() -> int:
    global _threads
    if _threads is None:
        env = os.environ.get("T2J_AD_TORCH_THREADS", "").strip()
        if not env:
            _threads = max(1, (os.cpu_count() or 1) // 2)
        elif not (env.isascii() and env.isdigit()) or not 1 <= int(env) <= _MOST_THREADS:
            raise ValueError(
                f"T2J_AD_TORCH_THREADS must be a whole number from 1 to {_MOST_THREADS} (PyTorch "
                f"threads inside t2j_ad calls), got {env!r}; unset it for half the cores."
            )
        else:
            _threads = int(env)
    return _threads


def set_torch_threads(n: int) -> None:
    """Set how many CPU threads PyTorch uses inside t2j_ad calls.

    The default is half the cores, or the environment variable
    ``T2J_AD_TORCH_THREADS``: PyTorch's and XLA's thread pools oversubscribe
    small machines otherwise (NOTE [torch threads]).

    Args:
        n: the number of threads, at least 1.

    Raises:
        TypeError: ``n`` is not an int (a ``bool`` neither).
        ValueError: ``n`` is less than 1, or more than PyTorch's
            ``set_num_threads`` takes (a C ``int``).
    """
    global _threads
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"set_torch_threads: n must be an int, got {type(n).__name__} ({n!r}).")
    if not 1 <= n <= _MOST_THREADS:
        raise ValueError(f"set_torch_threads: n must be from 1 to {_MOST_THREADS}, got {n}.")
    _threads = int(n)


def check_environment() -> None:
    """Read every ``T2J_AD_*`` setting the runtime uses, so that a bad value
    raises a ``ValueError`` naming it in the caller, when a signature is
    first traced, rather than from inside a custom call."""
    torch_threads()
    tune_malloc()
    from . import functorch_levels  # noqa: F401 - reads T2J_AD_FUNCTORCH_FAST at import


def _on_cuda(inputs: Sequence[torch.Tensor]) -> bool:
    """Whether a call's inputs are on a GPU (its first, as the call's device)."""
    return bool(inputs) and inputs[0].is_cuda


def not_a_tensor(fn_name: str, where: str, value: object) -> TorchCallError:
    """The error for an output that is not a tensor; ``where`` names it."""
    cache = (
        " A cache object, such as the one transformers' models return unless called with use_cache=False, "
        "stays on the PyTorch side: leave it out of the result."
        if "cache" in type(value).__name__.lower()
        else ""
    )
    # A result class of the user's own: its fields are found once it is a pytree node.
    node = (
        f" To return a {type(value).__name__} holding tensors, register it as a pytree node: "
        f"jax.tree_util.register_dataclass or torch.utils._pytree.register_dataclass."
        if dataclasses.is_dataclass(value) and not isinstance(value, type)
        else ""
    )
    return TorchCallError(
        f"{fn_name}: {where} is {type(value).__name__} ({value!r:.60}), not a torch.Tensor; "
        f"return tensors only (torch.tensor(value) for numbers).{cache}{node}"
    )


def one_in_a_sequence(fn_name: str, results: tuple[Any, ...] | list[Any]) -> TorchCallError:
    """The error for one tensor returned in a tuple or list of one where one
    tensor, not in a sequence, was declared or inferred."""
    kind = type(results).__name__
    return TorchCallError(
        f"{fn_name} returned a {kind} of 1; expected one tensor, not in a {kind}, as declared by output_shapes "
        f"or found by inference: return the tensor itself, or declare output_shapes as a {kind} of one."
    )


def wrong_structure(fn_name: str, results: object, n_out: int, structures: str = "") -> TorchCallError:
    """The error for results that are not ``n_out`` outputs in the structure
    declared or inferred; ``structures``, what a caller that flattened them
    adds: the structure returned and the one expected."""
    returned = f"{len(results)} outputs (a tuple)" if isinstance(results, tuple) else f"one {type(results).__name__}"
    return TorchCallError(
        f"{fn_name} returned {returned}; expected {n_out} outputs, as declared by output_shapes or found by "
        f"inference (output structure changed between calls?){structures}."
    )


def not_dense(fn_name: str, where: str, value: torch.Tensor) -> TorchCallError | None:
    """The error for an output XLA's buffers cannot take: another layout
    (sparse, MKL-DNN), a nested or a quantized tensor; None for a dense one."""
    if value.is_nested:
        return TorchCallError(
            f"{fn_name}: {where} is a nested tensor; JAX arrays are dense and rectangular, so return "
            f"a dense one: call .to_padded_tensor(0) on it."
        )
    if value.is_quantized:
        return TorchCallError(
            f"{fn_name}: {where} is a quantized tensor ({value.dtype}); JAX has no quantized arrays, so "
            f"return its values: call .dequantize() on it (or .int_repr() for the integers)."
        )
    if value.layout != torch.strided:
        return TorchCallError(
            f"{fn_name}: {where} is a tensor of layout {value.layout}; JAX arrays are dense, so return "
            f"a dense (strided) tensor: call .to_dense() on it."
        )
    return None


# NOTE [forward AD is process-wide]
# PyTorch's forward-mode AD levels (torch.func.jvp, torch.autograd.forward_ad)
# are global to the process, not per thread. XLA runs one custom call per
# device concurrently on its own threads (a sharded jit or pmap over several
# devices), and two jvps entering and leaving levels at once corrupt each
# other: tangents come back zero, or PyTorch raises "forward AD level with an
# invalid index". Calls whose transforms include a Jvp therefore run one at a
# time; everything else runs concurrently.
_forward_ad_lock = threading.Lock()
_forward_ad_held = threading.local()  # .held: this thread holds the lock


def _call_device(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> int:
    for t in (*outputs[:1], *inputs[:1]):
        return t.get_device()
    return torch.cuda.current_device()


# What a call that wrote XLA's buffers itself returns instead of results.
_WRITTEN = object()

# Looked up once: the runner's hot path calls these on every call.
_Tensor = torch.Tensor
_get_num_threads = torch.get_num_threads
_set_num_threads = torch.set_num_threads
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_no_autocast = torch._C._DisableAutocast
_in_inference_mode = torch.is_inference_mode_enabled
_functorch_levels_open = functorch_levels_open


def _dtype_name(dtype: torch.dtype) -> str:
    """JAX's name for ``dtype``, or PyTorch's for one JAX has not (quint8)."""
    try:
        return str(jax_dtype(dtype))
    except UnsupportedDtypeError:
        return str(dtype)


def _cast_on_copy(result: torch.dtype, buffer: torch.dtype) -> bool:
    """Whether a derived call's ``result`` dtype is one that JAX, with
    jax_enable_x64 off, holds as ``buffer``'s (NOTE [64-bit outputs] in api.py)."""
    return _NARROWED.get(result) is buffer and np.dtype(jax_dtype(result)) != canonical_jax_dtype(jax_dtype(result))


_NARROWED = {
    torch.float64: torch.float32,
    torch.int64: torch.int32,
    torch.uint64: torch.uint32,
    torch.complex128: torch.complex64,
}


# NOTE [a failing call's inputs stay put]
# A failing call's traceback holds its inputs (the frames of the user's
# function, of ``jaxify_module``'s forward), so the look at the end of the
# call (NOTE [inputs kept past a call] in kept_inputs.py) found them kept.
# Where inputs cannot be moved it already passed over a failing call ("not
# a failing call's traceback"), and only its look for holders by address
# did where they can; the move itself still ran. A call that fails inside
# a caller's trial run is an expected one: a module whose forward calls,
# through JAX, a ``jaxify_module`` of its own submodule runs it, in its run
# on meta tensors, with meta buffers bound into the submodule, and it
# fails there. Its inputs there are its caller's arrays, passed without a
# copy (the nested ``params``), and after the move those arrays held heap
# garbage: every later call of the nested function computed garbage (a
# scale of 2 read back as 1e-45). The move itself was not to blame: it ran
# inside the caller's trial run, whose ``RealWritesUndone`` took its copy
# for a write and, as the run ended, put back the uninitialized memory it
# copied into, which the swap had made the caller's buffer (NOTE [the
# move's copy is no write of the run around] in kept_inputs.py). A
# failing top-level call moves outside any run, so its arrays stayed
# intact. That copy is now made unseen by the run, for calls that fail or
# keep on purpose alike; still, a traceback is no keeper (its frames never
# read a tensor again), so a failing call moves nothing. A function that
# kept an input on purpose and then raised (``self.prev = x; raise``) is
# left holding a view of XLA's buffer, as such a call already was where
# inputs cannot be moved.


class _Runner:
    """Everything a call of one TorchFn needs, computed once.

    Cached on the TorchFn object (``runner_for``); the FFI backend also keeps
    it in a table the C++ handler calls directly (see NOTE [registry
    lifetime] in backends/registry.py). It must therefore not refer to the
    TorchFn itself, only to what it was built from, or that table would keep
    every TorchFn alive.
    """

    def __init__(self, fun: TorchFn):
        self.name = fun.name
        self.base = fun.base
        self.transforms = fun.transforms
        self.impl = self._built(fun)
        self.compile = self._compile_mode(fun)
        # NOTE [calls run with grad mode on]
        # Every eager call runs with PyTorch's grad mode on, as PyTorch runs a
        # function by default (and as XLA's threads start out). A plain call
        # under no_grad gave another value than its derivatives wherever code
        # branches on grad mode: an eval-mode TransformerEncoder takes its
        # nested-tensor fast path only without grad, and zeroed padded rows
        # that jax.value_and_grad's value kept; torch.autograd.grad inside
        # the function (a gradient penalty) failed. A transformed call needs
        # it anyway: torch.func.jvp over torch.func.vjp under no_grad silently
        # drops the tangents of tensors the vjp saved (jvp-of-vjp of
        # linalg.solve came out half its value). A replayed graph holds every
        # derivative explicitly and runs without (_first_compiled_call).
        self.grad_enabled = True
        # NOTE [calls run without the caller's autocast]
        # A torch.autocast region the caller of a JAX function is in is no
        # part of that function: under jax.jit, XLA may run the call later or
        # on a thread of its own, outside the region, and the signature cache
        # and the meta-device inference of jaxify_module never saw it, so an
        # outer region made a Linear return bfloat16 where float32 had been
        # inferred (refused as a meta-kernel bug) and a graph traced inside one
        # kept computing in bfloat16 after it. Every call, trial run and trace
        # runs with autocast off (one C check per call, 0.2 us); torch.autocast
        # inside the function applies as in PyTorch.
        # What each call runs: the user's function itself for a plain eager
        # call that takes the flat tensors positionally (one frame fewer than
        # ``impl``; see BaseFn.direct), returning one tensor if
        # ``direct_single``; else ``impl``. In graph mode the first call
        # traces and replaces it (NOTE [graph mode] in graph_mode.py).
        direct = fun.base.direct if not fun.transforms and self.compile == "eager" else None
        self.direct_single = direct is not None and fun.base.direct_single
        otherwise = self._first_compiled_call if self.compile != "eager" else self.impl
        # Not ``direct or``: a module may be falsy (an empty nn.Sequential).
        self.call = direct if direct is not None else otherwise
        self.cuda_graph = None  # cuda_graphs.CudaGraphCall, set by the first call
        # call_into(inputs, outputs): a compiled graph writing XLA's output
        # buffers itself, set by the first call where there is one (NOTE
        # [results written into XLA's buffers] in output_buffers.py).
        self.call_into = None
        self.into_artifact: graph_mode.Artifact | None = None
        self.out_avals = fun.out_avals
        self.out_names = (
            fun.base.out_names if not fun.transforms else tuple(f"output {i}" for i in range(len(fun.out_avals)))
        )
        self.n_out = len(fun.out_avals)
        self.shapes = tuple(torch.Size(a.shape) for a in fun.out_avals)
        # Calls must return exactly the dtypes inferred or declared (derived
        # ones those of XLA's buffers), or with jax_enable_x64 off the 64-bit
        # kind of one, cast on copy (NOTE [64-bit outputs] in api.py): a
        # batched call of a function declared int32 that returns floats was
        # cast; output_shapes declaring the float32 that f(x) shows for a
        # float64 result was refused, though JAX has no float64 in that mode.
        self.dtypes = (
            tuple(torch_dtype(a.dtype) for a in fun.out_avals) if fun.transforms else fun.base.torch_out_dtypes
        )
        self.forward_ad = any(isinstance(t, Jvp) for t in fun.transforms)
        self._untraced = (self.grad_enabled, self.forward_ad)  # restored by _forget_graph
        # A call with effects gets one more input, the result of the call with
        # effects before it, which only orders the two (NOTE [calls with
        # effects under jax.jit]); it is dropped on the way in.
        self.n_in = len(fun.in_avals)
        # The graph in use, while it assumes something beyond its inputs: the
        # training flags of the modules it ran (NOTE [a graph per training
        # mode]), the layouts of the tensors it holds (NOTE [the layouts a
        # graph assumed]); None when there is none.
        self.assumed: graph_mode.Artifact | None = None
        # Outputs on another device than the call's are refused by name. On a
        # CPU-only PyTorch the only other device is meta, which copy_ refuses
        # anyway, so only a CUDA build pays for comparing devices per output.
        self.other_devices = torch.cuda.is_available()
        # NOTE [a compiled function on several devices]
        # A graph holds its device's constants (a module's buffers, the device
        # of every factory op) and a CUDA graph its device's buffers, so a
        # compiled function traces and captures once per device. This runner
        # keeps the CPU's; a GPU call goes to a runner of its own device (a
        # copy of this one as it is now, before any call: ``_on_device``). One
        # TorchFn meets several devices in a pmap or sharded jit over GPUs, and
        # when one function is called on CPU and GPU arrays.
        self.per_device: dict[int, _Runner] | None = None
        self._unused: _Runner | None = None
        if self.compile != "eager" and self.other_devices:
            self._unused = copy.copy(self)  # copied while its per_device is None
            self.per_device = {}

    # Whether a compiled call on a GPU may be captured as a CUDA graph.
    captures_cuda_graphs = True

    def _built(self, fun: TorchFn) -> Flat:
        """The PyTorch callable of ``fun`` (transforms.build)."""
        return build(fun)

    def _compile_mode(self, fun: TorchFn) -> str:
        """How ``fun`` runs: its function's compile mode."""
        return fun.base.compile

    def __call__(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int = 0) -> None:
        # The hot path of every call (microseconds matter: see
        # benchmarks/bench_call_latency.py), so it is one flat frame of C
        # calls; everything unusual branches off to a method.
        if len(inputs) != self.n_in:
            inputs = inputs[: self.n_in]
        if trial_running.depth and outputs is not trial_running.call_outputs:
            self._inside_trial_run(inputs, outputs, stream)  # a call is no part of the run around it
            return
        if _any_autocast():
            # NOTE [calls run without the caller's autocast]
            with _no_autocast():
                self(inputs, outputs, stream)
            return
        if _in_inference_mode():
            self._outside_inference_mode(inputs, outputs, stream)
            return
        if _functorch_levels_open():
            self._outside_functorch_levels(inputs, outputs, stream)
            return
        if stream:
            self._on_stream(inputs, outputs, stream)
            return
        if bound_now and self.call is not self.impl and self._runs_a_bound_module():
            self._eagerly_inside_bindings(inputs, outputs, stream)  # NOTE [a graph inside a module call's bindings]
            return
        if self.assumed is not None and not self.assumed.holds():
            self._forget_graph()
        if self.forward_ad and not getattr(_forward_ad_held, "held", False):
            self._serialized(inputs, outputs)
            return
        n = _threads or torch_threads()
        base = self.base
        checked = base.mutation_checked
        copying = not checked or base.keeps_inputs
        if copying:
            # Until one run shows the function leaves its inputs alone, hand
            # it copies, so a mutating function cannot change the caller's
            # arrays; and for good to one that keeps them where they cannot
            # be moved (NOTE [inputs kept past a call]).
            originals = inputs
            inputs = [t.clone() for t in inputs]
            # The copies' memory, whatever ``.data =`` rebinds the copies to.
            copied = [t.detach() for t in inputs] if not checked else None
        # NOTE [inputs kept past a call]: on the CPU; on CUDA not yet (see the NOTE).
        # The first call, on copies, too: NOTE [inputs kept by their address].
        held = (
            kept_inputs_references(inputs)
            if (not copying or not base.keeps_inputs) and not (self.other_devices and _on_cuda(inputs))
            else None
        )
        # An exception the caller is handling (a call made in its except or
        # finally block): sys.exception() shows it in the finally below too.
        handling = sys.exception() if held is not None else None
        threads = _get_num_threads()
        if threads != n:
            _set_num_threads(n)  # NOTE [torch threads]: for this call only, put back below
        previous = _is_grad_enabled()
        grad_enabled = self.grad_enabled  # as the call runs: its first compiled call turns it off for the next
        _set_grad_enabled(grad_enabled)
        try:
            try:
                if checked and self.call_into is not None:
                    self.call_into(inputs, outputs)
                    results = _WRITTEN
                else:
                    results = self.call(*inputs)  # one tensor if direct_single
            except TorchCallError:
                raise
            except Exception as err:
                raise self._failure(err) from err
            if grad_enabled:
                # The copies below must not record a graph into the outputs
                # (one that saved an input: kept past the call).
                _set_grad_enabled(False)
            # Inputs arrive fresh (version 0; see run_into), so any in-place
            # write shows as a nonzero version: no snapshot before the call.
            versioned = True
            try:
                for t in inputs:
                    if t._version:
                        self._refuse_mutation(inputs)
            except TorchCallError:
                raise
            except RuntimeError:
                if not any(t.is_inference() for t in inputs):
                    raise
                # NOTE [calls inside torch.inference_mode]: no version to read,
                # so this call shows nothing; unchecked, it had copies.
                versioned = False
            if not checked and versioned:
                self._refuse_unseen_writes(originals, copied)  # NOTE [writes the version counter misses]
                base.mutation_checked = True
            if results is _WRITTEN:
                return
            try:
                if self.direct_single:
                    out = outputs[0]
                    if (
                        type(results) is not _Tensor
                        or results.shape != self.shapes[0]
                        or results.dtype is not self.dtypes[0]
                        or (self.other_devices and results.get_device() != out.get_device())
                    ):
                        if isinstance(results, (tuple, list)) and len(results) == 1:
                            raise one_in_a_sequence(self.name, results)
                        # Raises (a tuple: naming the count), unless a tensor subclass.
                        self._check_outputs(results if isinstance(results, tuple) else (results,), outputs)
                    out.copy_(results)
                    return
                if type(results) is not tuple or len(results) != self.n_out:
                    self._check_outputs(results, outputs)  # raises, naming the problem
                other_devices = self.other_devices
                for out, r, shape, dtype in zip(outputs, results, self.shapes, self.dtypes):
                    if (
                        not isinstance(r, _Tensor)
                        or r.shape != shape
                        or (dtype is not None and r.dtype != dtype)
                        or (other_devices and r.get_device() != out.get_device())
                    ):
                        self._check_outputs(results, outputs)  # raises, naming the output
                    out.copy_(r)
            except TorchCallError:
                raise
            except Exception:
                # copy_ refused (a meta tensor): name the output if that is why.
                try:
                    self._check_outputs(results if isinstance(results, tuple) else (results,), outputs)
                except TorchCallError as named:
                    raise named from None
                raise
        finally:
            _set_grad_enabled(previous)
            if threads != n:
                _set_num_threads(threads)
            if held is not None:
                results = t = r = copied = None  # may view or be an input: the call's own, not kept
                failing = sys.exception() is not handling  # NOTE [a failing call's inputs stay put]
                if not copying and CAN_MOVE:
                    if not failing and release_kept_inputs(inputs, held, base, handling):
                        base.keeps_inputs = True  # NOTE [inputs kept by their address]
                        raise unmovable_kept_input(by_address=True)
                elif not failing and any_kept(inputs, held):  # not a failing call's traceback
                    if not CAN_MOVE or kept_by_address(inputs, held, base):  # CAN_MOVE: the first call, on copies
                        base.keeps_inputs = True
                        if not copying:
                            raise unmovable_kept_input()

    def _serialized(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int = 0) -> None:
        # NOTE [forward AD is process-wide]; a call about to trace takes the
        # trial-run lock its trace takes first (NOTE [lock order]), and waits
        # for a busy forward-AD lock without it (NOTE [waiting for a lock
        # without the trial-run lock] in module_locks.py).
        tracing = self.call == self._first_compiled_call
        with taken_after(one_trial_run(), (_forward_ad_lock,)) if tracing else _forward_ad_lock:
            _forward_ad_held.held = True
            try:
                with forward_ad_levels_kept():  # NOTE [an interrupt inside forward AD]
                    self(inputs, outputs, stream)
            finally:
                _forward_ad_held.held = False

    def _inside_trial_run(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int) -> None:
        """The call, made inside another function's trial run, run outside it
        as a trial run of its own, which puts back what it wrote (NOTE [a call
        inside a trial run] in real_writes.py)."""
        if self.forward_ad and not getattr(_forward_ad_held, "held", False):
            # The forward-AD lock before the modules' locks the run takes (NOTE [lock order]).
            self._serialized(inputs, outputs, stream)
            return
        dicts, modules = _referenced(self.base)
        with call_undone(outputs, dicts, modules, self._draws) as own:
            self(inputs, own, stream)

    def _runs_a_bound_module(self) -> bool:
        """Whether a module this compiled function runs holds a
        ``jaxify_module`` call's tensors now (NOTE [a graph inside a module
        call's bindings] in held_bindings.py)."""
        return self.compile != "eager" and bound_among(_referenced(self.base)[1])

    def _eagerly_inside_bindings(
        self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int
    ) -> None:
        """The call run eagerly, on the tensors the modules hold now, its
        graph neither traced nor used (NOTE [a graph inside a module call's
        bindings] in held_bindings.py)."""
        eager = self.__dict__.get("_eager")
        if eager is None:
            eager = copy.copy(self)
            eager._forget_graph()  # as before any graph, then eager for good
            eager.call, eager.compile, eager.per_device, eager._unused = self.impl, "eager", None, None
            self._eager = eager
        root = getattr(self.base, "effects_root", None) or self.base
        warn_once(
            root,
            ("inside bindings", self.compile),
            f"t2j_ad: compile={self.compile!r}: {root.name!r} runs eagerly in its calls made while a "
            f"jaxify_module call of a module it runs has that call's tensors bound in it (a call inside that "
            f"module's forward): a graph would hold the module's tensors as the trace found them, not the "
            f"call's. Results are exact; only speed differs. Pass what it reads of the module as inputs, or "
            f"call it outside the module's forward, to keep a graph.",
        )
        _Runner.__call__(eager, inputs, outputs, stream)

    def _draws(self) -> tuple[bool, int]:
        """Whether this runner's function draws from PyTorch's generator, and
        how often from generators passed as ``generator=``, as its effects
        say: told to the trial run of a function that calls it (NOTE [a
        nested call's effects are its caller's] in real_writes.py)."""
        found = effects_now(self.base)
        return found.draws_random, found.given_draws

    def _on_stream(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int) -> None:
        # PyTorch must run on XLA's stream, for the call and the copies.
        device = _call_device(inputs, outputs)
        target = external_stream(stream, device)
        runner = self if self.per_device is None else self._on_device(device)
        run_on_stream(target, runner._on_current_stream, target, inputs, outputs)

    def _on_device(self, device: int) -> _Runner:
        """The runner of GPU ``device`` (NOTE [a compiled function on several devices])."""
        runner = self.per_device.get(device)
        if runner is None:
            fresh = copy.copy(self._unused)
            fresh.call = fresh._first_compiled_call  # bound to the copy, not to this runner
            runner = self.per_device.setdefault(device, fresh)
        return runner

    def _on_current_stream(
        self, target: torch.cuda.Stream, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
    ) -> None:
        if self.assumed is not None and not self.assumed.holds():
            self._forget_graph()
        # A replay reads copies of the inputs, so the eager check must first
        # have seen the function leave them alone (NOTE [CUDA graph replay]);
        # inside a trial run, the run must see the call's ops (NOTE [no CUDA
        # graph inside a trial run]); inside a module call's bindings the
        # call runs eagerly, on the tensors bound now, which a CUDA graph,
        # holding those of its capture, would not read (NOTE [a graph inside
        # a module call's bindings] in held_bindings.py).
        if (
            self.cuda_graph is None
            or trial_running.depth
            or (bound_now and self._runs_a_bound_module())
            or not self.base.mutation_checked
            or not self._replay_cuda_graph(inputs, outputs, target)
        ):
            self(inputs, outputs)

    def _first_compiled_call(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Trace (and compile) this TorchFn, then run it; eagerly if that fails."""
        out_specs = tuple((shape, torch_dtype(a.dtype)) for shape, a in zip(self.shapes, self.out_avals))
        # Traced with grad mode as a transformed call needs it, whatever a
        # concurrent first call has since set self.grad_enabled to.
        artifact, first = graph_mode.artifact_for(
            self.compile, self.impl, self.base, self.transforms, inputs, self._untraced[0], out_specs
        )
        self.assumed = artifact if artifact.modes or artifact.layouts is not None else None
        if artifact.run is None:
            # Eager, announced only once the eager call has worked: a function
            # that fails eagerly too raises its own error, no warning. A graph
            # dropped after its first run hands back that call's results.
            # Timed while it runs for settings (NOTE [a setting changed every step] in graph_mode.py).
            eager = artifact.eager_call(self.impl)
            results = eager(*inputs) if first is None else first
            self.call = eager
            if not artifact.once:  # NOTE [a hook that removed itself in a trace], NOTE [a setting changed every step] in graph_mode.py
                graph_mode.announce_fallback(self.base, self.name, self.compile, self.transforms, artifact)
            return results
        self.call = artifact.run
        self.cuda_graph = artifact.cuda_graph if self.captures_cuda_graphs else None
        if artifact.run_into is not None:
            self.into_artifact, self.call_into = artifact, self._first_call_into
        # The graph holds every derivative explicitly: no autograd at replay,
        # and no forward-AD level to serialize (NOTE [forward AD is
        # process-wide]); the trace itself ran under the lock.
        self.grad_enabled = False
        self.forward_ad = False
        if first is not None:
            return first
        # NOTE [a graph first replayed by another runner]: without grad mode,
        # as every replay runs; this call's grad mode was set before it.
        with torch.no_grad():
            return artifact.run(*inputs)

    # NOTE [a graph first replayed by another runner]
    # A graph outlives the runner that traced it (graph_mode's caches: a
    # fresh jax.jit of the same step, a structure seen before), and a new
    # runner's first call finds it traced and replays it at once. That call
    # ran with the grad mode every eager first call starts with (on: NOTE
    # [calls run with grad mode on]), where a replay runs without: the
    # graph's in-place write into a parameter the function closes over
    # (``with torch.no_grad(): self.w.mul_(0.9)`` in a forward, which the
    # trace records without its no_grad region) was refused, "a leaf
    # Variable that requires grad is being used in an in-place operation",
    # on the second step of a loop that jits its step afresh, and every
    # other graph recorded an autograd graph it never used.

    def _first_call_into(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Write into XLA's buffers from now on if they are laid out as the
        compiled graph expects, else copy results into them as usual (NOTE
        [results written into XLA's buffers] in output_buffers.py)."""
        artifact = self.into_artifact
        if tuple(o.stride() for o in outputs) == artifact.into_strides:
            self.call_into = artifact.run_into
            artifact.run_into(inputs, outputs)
        else:
            self.call_into = None
            for out, r in zip(outputs, self.call(*inputs)):
                out.copy_(r)

    def _forget_graph(self) -> None:
        """Back to before the first call: a module the graph in use ran has
        changed its training flag, or a tensor it holds its layout, so the
        next call finds, or traces, the graph for them as they are now (NOTE
        [a graph per training mode], NOTE [the layouts a graph assumed])."""
        self.grad_enabled, self.forward_ad = self._untraced  # before call: a thread seeing one sees both
        self.assumed = None
        self.cuda_graph = None
        self.call_into = self.into_artifact = None
        self.call = self._first_compiled_call

    # NOTE [no CUDA graph inside a trial run]
    # A jaxified function called inside another's trial run (its shape
    # inference on zeros and ones, or a graph-mode trace) runs as a trial run
    # of its own, which watches the call's ops to put back the state it
    # writes and to tell the caller what it drew and wrote (NOTE [a call
    # inside a trial run], NOTE [a nested call's effects are its caller's] in
    # real_writes.py). A CUDA graph's replay runs none of those ops through
    # PyTorch's dispatcher, and its capture fills the generator's seed and
    # offset tensors: on an H100, a graph-mode inner function captured on the
    # caller's run on zeros and replayed on its run on ones, so the two runs
    # "wrote differently" and the caller was refused, and a training-mode
    # BatchNorm inside, replayed in trial runs that could not put its
    # statistics back, counted 5 steps in 2. So inside a trial run the call
    # runs its aten graph (or eagerly), never the CUDA graph, and captures
    # none; its real calls replay the CUDA graph as before.

    def _replay_cuda_graph(
        self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: torch.cuda.Stream
    ) -> bool:
        """One call by CUDA graph replay on ``stream``, XLA's and the current
        one (NOTE [CUDA graph replay]); False when capture failed, so the
        caller runs the aten graph instead. Raises the error of a first
        call's run, which was the call."""
        graph = self.cuda_graph
        with graph.lock:
            try:
                results = graph(stream, *inputs)
            except TorchCallError:
                raise
            except Exception as err:  # the first call's own run: the call's error (NOTE [CUDA graph replay])
                raise self._failure(err) from err
            if results is None:
                self.cuda_graph = None
                return False
            for out, r in zip(outputs, results):
                out.copy_(r)
            graph.finished(stream)
        return True

    def _failure(self, err: Exception) -> TorchCallError:
        notes = "".join(f"\n{note}" for note in getattr(err, "__notes__", ()))  # e.g. module._note_recast_params
        return TorchCallError(
            f"the PyTorch function {self.name} raised {type(err).__name__}: {err}{notes}\n\n"
            f"PyTorch traceback:\n{''.join(traceback.format_exception(err))}"
        )

    def _check_outputs(self, results: object, outputs: Sequence[torch.Tensor]) -> None:
        """Raise an error naming the first output that does not match."""
        if not isinstance(results, tuple) or len(results) != self.n_out:
            raise wrong_structure(self.name, results, self.n_out)
        for name, r, aval in zip(self.out_names, results, self.out_avals):
            if not isinstance(r, torch.Tensor):
                raise not_a_tensor(self.name, name, r)
            unfit = not_dense(self.name, name, r)
            if unfit is not None:
                raise unfit
            if tuple(r.shape) != aval.shape:
                raise TorchCallError(
                    f"{self.name}: {name} has shape {tuple(r.shape)}, but "
                    f"{aval.shape} was expected, as {self._expected_because()}."
                )
        for name, r, declared in zip(self.out_names, results, self.dtypes):
            cast = _cast_on_copy(r.dtype, declared)
            if declared is not None and r.dtype != declared and not cast:
                raise TorchCallError(
                    f"{self.name}: {name} has dtype {_dtype_name(r.dtype)}, "
                    f"but {jax_dtype(declared)} was expected, as {self._expected_because()}."
                )
        for name, r, out in zip(self.out_names, results, outputs):
            if r.device != out.device:
                raise TorchCallError(on_another_device(self.name, name, r.device, out.device))

    def _expected_because(self) -> str:
        """Why the expected output shapes are what they are, and what to do
        when PyTorch returned others: the end of ``_check_outputs``' errors."""
        where = self.base.inferred_on
        if where is None:
            own = "declared by output_shapes"
        elif where.type == "meta":
            own = "inferred on PyTorch's meta device"
        else:
            own = f"inferred by calls {self.base.inferred_runs} on {where}"
        if self.transforms:
            return (
                f"JAX's rules give for {self.name} from the function's own output shapes ({own}). "
                f"Where those are right, a batching or derivative rule of PyTorch's is wrong for an op here "
                f"(torch.vmap of an op whose arguments two vmaps batch at different levels, for one): "
                f"vmap_method='sequential' or 'broadcast_all' avoids torch.vmap's own rules"
            )
        if where is None:
            return own
        if where.type == "meta":
            return (
                f"{own}. Output shapes and dtypes must depend on the input shapes and dtypes alone (all JAX "
                f"knows when it traces). Either the function reads Python state that changed since (a module "
                f"it runs cast to another dtype, model.double(), or a global size set again in a later cell: "
                f"call t2j_ad.clear_caches() after such a change), or it branches "
                f"on the device (if x.device.type == 'cpu': x = x.float()), which is 'meta' there, or a meta "
                f"kernel of an op here differs from its real one, a PyTorch bug (torch 2.11's "
                f"linalg.vector_norm with dim=-1 over a size-1 dimension is one): pass output_shapes= with "
                f"the real shapes and dtypes"
            )
        hint = integer_scalars_hint(getattr(self.base, "in_names", ()), self.base.in_avals)
        return (
            f"{own}; output shapes and dtypes must depend on the input shapes and dtypes alone, which is all "
            f"JAX knows when it traces. So it reads Python state that changed since its first call: a module it runs "
            f"cast to another dtype or given parameters of another shape (model.double(), w.data = ...), or a "
            f"global size set again; call t2j_ad.clear_caches() after such a change" + (f".{hint.rstrip('.')}" if hint else "")
        )

    def _outside_functorch_levels(
        self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int
    ) -> None:
        """NOTE [a call inside torch.func transforms]
        A PyTorch function may call JAX (``tree_j2t(inner(...))``) inside a
        ``torch.func`` transform: ``torch.func.grad`` in the user's code, or
        the derivative t2j_ad builds when JAX differentiates an outer
        jaxified function. XLA runs the nested call on that thread, inside
        the transform's levels, so functorch took the runner's ``copy_`` of
        the result into XLA's output buffer for a write into a tensor the
        transform captured and refused it, and the outer derivative blamed
        the outer function for a state write it never made. To PyTorch a
        JAX result is a constant, as that of a jitted pure-JAX function in
        the same place is (which worked): its derivative is zero. So the
        call runs outside the levels, as a call of its own, and they are
        put back after it (NOTE [calls run without the caller's autocast]
        is the same rule for autocast). A tensor the nested function reads
        from the transform (a module's parameter the outer call bound, under
        its levels' wrappers) would need a derivative through JAX that
        PyTorch cannot take (outside the levels, functorch reads such a
        tensor as a plain one: a gradient of zero, silently), so an op on
        one is refused, naming the function. The outer derivative runs the
        nested call again; what it draws and writes is the outer function's,
        which that derivative replays (NOTE [a nested call's effects are its
        caller's] in real_writes.py)."""
        # NOTE [a nested call's bindings are its own] in held_bindings.py
        with outside_functorch_levels(self._differentiated_inside), apart_from_the_call():
            self(inputs, outputs, stream)

    def _differentiated_inside(self) -> TorchCallError:
        """The error for a nested call that reads a tensor a ``torch.func``
        transform around it differentiates or batches (NOTE [a call inside
        torch.func transforms])."""
        return TorchCallError(
            f"{self.name} is a jaxified function called inside a torch.func transform (torch.func.grad or "
            f"torch.vmap, or the derivative of an outer jaxified function that JAX differentiates), and it reads a "
            f"tensor that transform differentiates or batches (one the outer function computed, or a module "
            f"parameter it bound). PyTorch cannot differentiate or batch through a JAX computation: to PyTorch "
            f"its result is a constant. Jaxify the whole computation as one PyTorch function instead of calling "
            f"a jaxified function from inside it, or pass what it reads as an input (t2j_ad.tree_t2j(w.detach())) "
            f"if a constant is meant."
        )

    def _outside_inference_mode(
        self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int
    ) -> None:
        """The call, made on a thread inside ``torch.inference_mode`` (NOTE
        [calls inside torch.inference_mode]), run outside it on copies."""
        with torch.inference_mode(False):
            # stack-and-select, not clone: a clone of an inference tensor
            # starts at version 1, which reads as a write into the input.
            # Detached: the selected view's base would read as a view kept
            # past the call (NOTE [inputs kept past a call]).
            fresh = [torch.stack([t])[0].detach() for t in inputs]
            buffers = [torch.empty_like(o) for o in outputs]
            self(fresh, buffers, stream)
        for out, buffer in zip(outputs, buffers):
            out.copy_(buffer)  # XLA's buffers are inference tensors: written inside inference mode

    def _refuse_unseen_writes(self, originals: Sequence[torch.Tensor], copies: Sequence[torch.Tensor]) -> None:
        """NOTE [writes the version counter misses]
        PyTorch counts an in-place write on the tensor's version, and the
        check above reads it; a few writes go past it: ``batch_norm`` in
        training mode writing its running statistics (an input passed as
        ``running_mean``, as a functional batch-norm step does with
        ``functional_call(model, {**params, **batch_stats}, x)``), writes
        through ``.data`` or ``untyped_storage()``. Such a write changed the
        caller's immutable JAX arrays from the second call on, and jitted
        programs' constants with them. The first call runs on copies, so its
        copies are compared with the inputs, bit for bit, once: a write
        there is refused as any other, and the function keeps running on
        copies (a write made only on some later call stays unseen, as
        docs/transforms.md says)."""
        # ``copies``: aliases of the copies' memory, so a tensor rebound
        # through ``.data =`` (its memory left alone) is no write.
        written = [i for i, (a, b) in enumerate(zip(originals, copies)) if not _same_bits(a, b)]
        if written:
            names = getattr(self.base, "in_names", None) if not self.transforms else None
            where = (
                " without PyTorch's version counter seeing it (batch_norm's running statistics in "
                "training mode, .data, untyped_storage())"
            )
            raise InputMutationError(mutation_message(self.name, written, names, where))

    def _refuse_mutation(self, inputs: Sequence[torch.Tensor]) -> None:
        mutated = [i for i, t in enumerate(inputs) if t._version]
        names = getattr(self.base, "in_names", None) if not self.transforms else None
        raise InputMutationError(mutation_message(self.name, mutated, names))


def integer_scalars_hint(in_names: Sequence[str], in_avals: Sequence[Any]) -> str:
    """The end of an error about output shapes, where 0-d integer inputs
    (Python ints among them) may be meant as sizes; "" if there are none."""
    names = [n for n, a in zip(in_names, in_avals) if a.shape == () and np.issubdtype(a.dtype, np.integer)]
    if not names:
        return ""
    if len(names) == 1:
        which = f"{names[0]} is a 0-d integer, which reaches PyTorch as a 0-d tensor whose value JAX traces"
    else:
        which = f"{', '.join(names)} are 0-d integers, which reach PyTorch as 0-d tensors whose values JAX traces"
    return (
        f" Note: {which} (a Python int too), not as an int; output shapes are inferred with "
        f"{'it' if len(names) == 1 else 'them'} 0, then 1. A size, count or padding must be fixed when JAX "
        f"traces: keep it in the PyTorch function (t2j_ad.jaxify(functools.partial(fn, n=8)); for a module, "
        f"a forward that passes it) instead of passing it through JAX."
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape and dtype hold the same bytes (NaNs alike)."""
    if not a.numel():
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def mutation_message(name: str, mutated: Sequence[int], names: Sequence[str] | None = None, where: str = "") -> str:
    """The text of an ``InputMutationError``: the flat inputs ``mutated``,
    by their key paths ``names`` where known."""
    which = f"{list(mutated)}" if names is None else ", ".join(names[i] for i in mutated if i < len(names))
    params = names is not None and any(names[i].startswith("args[0][") for i in mutated if i < len(names))
    return (
        f"the PyTorch function {name} mutated input(s) {which} in place{where}; t2j_ad functions must not "
        f"write into their inputs (JAX arrays are immutable). Clone the input first (x = x.clone()) or use the "
        f"out-of-place op."
        + (
            " Under jaxify_module, args[0] is params: the module's forward writes into its own parameter (as "
            "nn.Embedding(max_norm=...) renormalizes its weight in place), which it cannot do to the arrays "
            "JAX passes; renormalize outside the module, or jaxify a function that closes over it."
            if params
            else ""
        )
    )


# How many calls of a function that rebind none of its names make its
# runner stop looking at them (_RunnerWatchingNames).
_CALLS_TO_STOP_LOOKING = 3


class _RunnerWatchingNames(_Runner):
    """The runner of a call of a function that reads names it remembers:
    those the call itself rebinds (a forward's ``self.act = lambda ...``),
    as every call will, are forgotten after it, so that no call finds them
    rebound and resolves the signature again, 60-140x slower (NOTE [a name
    rebound after a call] in named_bindings.py). A call that finds them
    rebound at its start (by the caller, under ``jax.jit``) forgets none.
    After a few calls that rebind none, it stops looking (two lookups per
    name and call, about 1 us): a later rebinding resolves the signature
    again, as any rebinding does."""

    def __init__(self, fun: TorchFn) -> None:
        self.names: StructureSeen | None = _names_watched(fun)
        self.calls_rebinding_none = 0
        super().__init__(fun)

    def __call__(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int = 0) -> None:
        names = self.names
        as_seen = names is not None and not trial_running.depth and names.names_hold()
        self._run(inputs, outputs, stream)
        if not as_seen:
            return
        if not names.names_hold():
            names.watch_names_it_rebinds(rebase=False)
            return
        self.calls_rebinding_none += 1
        if self.calls_rebinding_none >= _CALLS_TO_STOP_LOOKING:
            self.names = None

    def _run(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int) -> None:
        _Runner.__call__(self, inputs, outputs, stream)


class _RunnerWatchingDraws(_RunnerWatchingNames):
    """The runner of a derivative call (or a replay) of a function whose
    trial runs saw it draw from no generator or from none passed as
    ``generator=``: a call that draws from those after all is refused
    (NOTE [draws the trial runs did not see] in random_state.py)."""

    def __init__(self, fun: TorchFn) -> None:
        self.draws_watched: DrawWatch | None = unseen_draws_watch(fun)
        super().__init__(fun)

    def _run(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int) -> None:
        watch = self.draws_watched
        if watch is None or not self._watches_here(stream):
            self._run_once(inputs, outputs, stream)
            return
        before = watch.before()
        given = None
        if watch.inner:  # NOTE [generators a function makes] in random_state.py
            with watch.given_draws_noted() as given:
                self._run_once(inputs, outputs, stream)
        else:
            self._run_once(inputs, outputs, stream)
        source = watch.drew_here(lambda: self._run_again(inputs)) if watch.drew(before) else None
        if source is None and given is not None:
            source = watch.drew_unrepeatably(lambda: self._run_again(inputs), given)
        if source is not None:
            watch.put_back(before, given)  # the refused call had no effect on them
            raise TorchCallError(str(unseen_draws_refusal(self.base.name, source)))

    def _watches_here(self, stream: int) -> bool:
        """Whether the call runs here as it is, not again by ``_Runner.__call__``
        in a context of its own (a trial run's, a stream's, outside autocast,
        inference mode, functorch's levels, or under the forward-AD lock),
        where it is watched instead."""
        return not (
            trial_running.depth
            or stream
            or _any_autocast()
            or _in_inference_mode()
            or _functorch_levels_open()
            or (self.forward_ad and not getattr(_forward_ad_held, "held", False))
        )

    def _run_again(self, inputs: Sequence[torch.Tensor]) -> None:
        """The function once more, eagerly, on copies of ``inputs``, its
        results dropped: to see whether it draws on this thread."""
        call_effects = self.base.call_effects  # a replay puts back the state it sets
        with torch.enable_grad(), call_effects() if call_effects is not None else contextlib.nullcontext():
            self.impl(*[t.clone() for t in inputs[: self.n_in]])

    def _run_once(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int) -> None:
        _Runner.__call__(self, inputs, outputs, stream)


# NOTE [a hook that removed itself in a jitted call]
# A function that neither draws nor keeps state has no token (NOTE [a hook
# that removed itself in a value call] in replayed_calls.py): under
# ``jax.jit(jax.value_and_grad(f))`` its value call ran a stateless one-shot
# hook (``return out * 2`` then its own ``handle.remove()``) and its
# derivative, a call of its own in the same program, ran without it: the
# value of one function and the gradient of another, silently (the twelfth
# fuzzing pass). Which of the two runs first is XLA's choice where the
# cotangent does not depend on the value. So each call of a derivative (a
# ``Jvp`` or ``Vjp``) and each value call bound by the JVP rule (NOTE [a
# value call checked before it runs] in replayed_calls.py) looks, after it
# ran, whether a hook of the modules it runs left its place in it
# (``ModuleModes.hooks_in_place``: one dict lookup per hook), and is
# refused if one did: the hook ran once, as PyTorch's first call runs it,
# and every later step runs without it, value and derivative alike. A
# plain call (``f(x)``, and ``jax.jit(f)``) is no value call of a
# derivative and runs such a hook unrefused. Without ``jax.jit`` the same
# refusal comes first; the derivative's binding would refuse it otherwise
# (NOTE [a derivative called apart from its value] in
# split_derivatives.py). A function that runs no module, and whose hook is
# a global one, is not watched. A call in which a hook was registered too is
# not refused: a forward that replaces its own hook on every call (removes
# the last call's, registers a new one) runs alike in the value call and
# its derivative. A hook that only observes (returns None) is refused like
# one that changes the output: which it is shows only as it runs.


def one_shot_hook_refusal(name: str) -> TorchCallError:
    """The error of a value call of a derivative, or a derivative call, of
    ``name`` in which a hook of its modules removed itself (NOTE [a hook
    that removed itself in a jitted call])."""
    return TorchCallError(
        f"{name}: a hook of the modules it runs was removed during this call, the value call of a derivative "
        f"or a derivative (a one-shot hook, such as an initialization from the first batch that then calls "
        f"handle.remove(), or a hook that removes another), so the value and the derivative, each a call of "
        f"the function of its own, would be those of different functions, even where the hook only "
        f"observes: t2j_ad cannot tell. Make the function's first call a plain one (f(x), outside jax.grad "
        f"and jax.value_and_grad), which runs the hook once as PyTorch's first call does; its later "
        f"derivatives run as the function is then."
    )


class _RunnerWithEffects(_RunnerWatchingDraws):
    """The runner of a call of a function that draws random numbers or
    updates state it keeps, or that ran modules whose training flags decide
    whether it does (NOTE [derivatives replay the value's draws] in
    replayed_calls.py):

    - Under ``jax.jit`` a derivative, or a value call that keeps the state
      its derivatives replay, runs again after ``module.train()`` or
      ``.eval()``, with which the function may draw or update other than the
      JVP rule saw: a derivative would then draw or write a second time, so
      the call is refused.
    - A value call that updates state holds off trial runs on other threads
      (NOTE [one trial run at a time]), which put back what they wrote when
      they end and would undo this call's updates.
    - A keeping or replaying call holds the lock of such calls and puts
      back what it writes (``BaseFn.call_effects``), around the whole call.
    - A keeping or replaying call that runs the function once reads or sets
      the generator around the call, on the stream it runs on, so that it
      may run a graph; one that runs it once per example of a ``jax.vmap``
      runs eagerly (NOTE [the generator around a graph] in replayed_calls.py).
    """

    def __init__(self, fun: TorchFn) -> None:
        # Set before the base class copies this runner for other devices.
        self.checks_flags, self.holds_off_trial_runs, self.draws_alone = _effect_duties(fun)
        # A keeping call: its token is its last output of its own.
        self.keeps_token = fun.base.call_effects is not None and not getattr(fun.base, "replays", False)
        self.generator: GeneratorAround | None = generator_around(fun)
        self.captures_cuda_graphs = self.generator is None
        super().__init__(fun)

    def _built(self, fun: TorchFn) -> Flat:
        impl = build(fun)
        return impl if self.generator is None else self.generator.passes(impl)

    def _compile_mode(self, fun: TorchFn) -> str:
        mode = fun.base.compile
        if mode != "eager" and draws_per_example(fun):
            graph_mode.record_eager(fun.base, fun.transforms, "it draws random numbers once per example")
            root = fun.base.effects_root
            warn_once(
                root,
                ("random per example", mode),
                f"t2j_ad: compile={mode!r}: the calls of {root.name!r} batched by jax.vmap around its derivatives "
                f"(per-example gradients) run eagerly: it draws random numbers, and each example replays its own "
                f"value's draws by setting PyTorch's generator, which a graph cannot do between examples. "
                f"Results are exact; only speed differs. Pass the randomness in as an input (a dropout mask) to "
                f"keep the graph.",
            )
            return "eager"
        if mode != "eager" and getattr(fun.base, "effects_root", None) is not None and fun.base.effects.given_draws:
            # Every call of it, not only the plain one whose trace refuses the
            # draw: a derivative's trace failed first on the generator states
            # it replays, and its warning gave that internal error instead.
            reason = own_generator_reason("generator=")
            graph_mode.record_eager(fun.base, fun.transforms, reason)
            root = fun.base.effects_root
            warn_once(
                root,
                ("own generator", mode),
                f"t2j_ad: compile={mode!r} runs {root.name!r} and its derivatives eagerly: {reason}. "
                f"Results are the same; only speed differs. Pass compile='eager' to silence this.",
            )
            return "eager"
        return mode

    def _run_again(self, inputs: Sequence[torch.Tensor]) -> None:
        # A replay draws from the generator its runner set from the token,
        # as the call did (NOTE [generators a function makes] in random_state.py).
        generator = self.generator
        with generator.around(inputs, ()) if generator is not None else contextlib.nullcontext():
            super()._run_again(inputs)

    def _run_once(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], stream: int) -> None:
        # An order input (_Runner.n_in) trails the function's own: the
        # generator reads the token by its index, and _Runner drops it.
        # NOTE [fewer effects than a program was traced for] in replayed_calls.py
        now = effects_now(self.base) if self.checks_flags else None
        traced = traced_for(self.base)
        fewer = None if now is None or now.same_as(traced) else now
        if fewer is not None:
            self._refuse_other_effects(inputs, fewer, traced)
        # NOTE [a hook that removed itself in a value call] in replayed_calls.py;
        # the calls of a derivative of a function that keeps no token too (NOTE
        # [a hook that removed itself in a jitted call]).
        hooks_kept = now is not None and now.modes.hooks_in_place()
        hooks_registered = user_hooks_registered() if hooks_kept else None
        call_effects = self.base.call_effects
        # On a GPU, the generator is handled in the nested call on XLA's stream.
        generator = self.generator if not stream else None
        if call_effects is None:
            call_effects = effects_held if self.draws_alone else contextlib.nullcontext
        with one_trial_run() if self.holds_off_trial_runs else contextlib.nullcontext():
            with call_effects():
                with generator.around(inputs, outputs) if generator is not None else contextlib.nullcontext():
                    _Runner.__call__(self, inputs, outputs, stream)
        removed = hooks_kept and not now.modes.hooks_in_place()
        token_at = len(self.base.out_avals) - 1
        if now is not None and self.keeps_token and len(outputs) > token_at:
            note_value_call(self.base, outputs[token_at], fewer, removed)
        elif removed and user_hooks_registered() == hooks_registered:
            # A forward that replaces its own hook on every call (removes the
            # last call's, registers a new one) runs alike in the value call
            # and its derivative.
            raise one_shot_hook_refusal(self.name)

    def _refuse_other_effects(self, inputs: Sequence[torch.Tensor], now: Effects, traced: Effects) -> None:
        """Refuse a call that finds effects ``now`` other than those the rules
        that bound it saw (``traced``), but a keeping call whose effects are
        within those, and the replay of the latest such call while they hold
        (NOTE [fewer effects than a program was traced for] in
        replayed_calls.py)."""
        at = token_input(self.base)
        if at is not None and replays_a_call_that_removed_hooks(self.base, inputs[at]):
            raise TorchCallError(
                f"{self.name}: a hook of the modules it runs removed itself in the value call whose derivative "
                f"this is (a one-shot hook, such as an initialization from the first batch that then calls "
                f"handle.remove()), so the derivative, which runs the function again, would run it without the "
                f"hook and differentiate another function than the value's. Make the function's first call a "
                f"plain one (f(x), outside jax.grad and jax.value_and_grad), which runs the hook once as "
                f"PyTorch's first call does; its later derivatives run as the function is then."
            )
        if now.within(traced):
            if at is None and self.keeps_token:
                return
            if at is not None and replays_with_fewer_effects(self.base, inputs[at], now):
                return
        raise TorchCallError(
            f"{self.name}: the modules it runs changed training mode (module.train() or .eval()) or a "
            f"dropout's rate (model.drop.p = 0.5), or "
            f"had a submodule replaced or a hook added, since jax.jit traced it (or a name it reads now "
            f"holds another module, function or state tensor: model = ..., a helper defined again, "
            f"acc = torch.zeros(3); or its own run bound one, as self.act = drop if self.noisy else ident "
            f"does), and now the function draws random numbers or updates state it keeps other than it "
            f"did, which its derivatives would draw or update a second time. Trace again after such a "
            f"change: call jax.clear_caches(), or jax.jit a new function object, as "
            f"jax.jit(functools.partial(step)) for the step you jitted (jax.jit(step) again reuses the trace "
            f"JAX keeps for step, and is refused again). Without jax.jit, the next call of the transform "
            f"traces again by itself."
        )


# NOTE [lock order]
# A call may take these locks, always in this order: the trial-run lock
# (real_writes.one_trial_run: NOTE [one trial run at a time]), the lock of
# calls with effects (replayed_calls.effects_held: NOTE [derivatives replay
# the value's draws]), the forward-AD lock (NOTE [forward AD is
# process-wide]), a function's graph lock (held while its first compiled
# call traces: graph_mode.artifact_for), then a module's own (NOTE [one
# module, many threads]). A graph-mode trace takes the trial-run lock inside
# the call that traces, so a call that takes any of the others first takes
# the trial-run lock: a keeping or replaying call, a plain call of a function
# that draws, a forward-mode call about to trace, and artifact_for itself. A
# jaxify'd function called inside a call's function (a module's forward)
# takes it after the locks that call holds; so a trial run, or a
# forward-mode call about to trace, waits for a busy module or forward-AD
# lock without holding it (NOTE [waiting for a lock without the trial-run
# lock] in module_locks.py, NOTE [calls made inside a module's forward] in
# module.py): a module call nesting a first call, and a first call of a
# function closing over that module on another thread, each waited for the
# other. Taken the other way round, the first call of a
# random function's value in graph mode (the effects lock, then the trace's
# trial-run lock) and a batch-norm step on another thread (the trial-run
# lock, then the effects lock) would each wait for the other; and a
# forward-mode first call (the trial-run lock, then the graph lock) waited
# for another transform's trace (the graph lock, then the trial-run lock),
# which tests/test_concurrency.py caught.


def _referenced(base: object) -> tuple[Sequence[dict], Sequence[torch.nn.Module]]:
    """The dicts and modules ``base``'s function refers to (api sets them on
    each BaseFn, replayed_calls on its variants)."""
    return getattr(base, "referenced_dicts", ()), getattr(base, "referenced_modules", ())


def _effect_duties(fun: TorchFn) -> tuple[bool, bool, bool]:
    """Whether a call of ``fun`` checks the modules' training flags, whether
    it holds off trial runs, and whether it is a plain call of a function
    that draws (``_RunnerWithEffects``)."""
    base, effects = fun.base, fun.base.effects
    derivative = any(not isinstance(t, Vmap) for t in fun.transforms)
    variant = base.call_effects is not None  # a keeping or replaying call
    # NOTE [a name rebound after a call]: a function that runs no module may
    # name a helper that is defined again.
    watched = bool(effects is not None and (effects.modes or _names_watched(fun) is not None))
    # NOTE [a value call checked before it runs] in replayed_calls.py
    checks_flags = watched and (derivative or variant or fun.checks_effects)
    # Its draws must not fall between a value call's read of the generator
    # and the value's own draws, nor within a replay (on another thread); a
    # trial run, which puts the generator back, must not fall within its own.
    draws_alone = not variant and bool(effects and effects.draws_random)
    # A trial run on zeros would undo a value call's updates (NOTE [one trial
    # run at a time]); and the trial-run lock comes first (NOTE [lock order]).
    holds_off_trial_runs = (not derivative and bool(effects and effects.writes)) or variant or draws_alone
    return checks_flags, holds_off_trial_runs, draws_alone


def structure_of(fun: TorchFn) -> StructureSeen | None:
    """What ``fun``'s function found its modules (and the names it reads)
    holding when its signature was resolved, where it keeps that: on the
    function whose effects it shares (a keeping or replaying variant's
    root), else on its own base."""
    base = fun.base
    return getattr(getattr(base, "effects_root", None) or base, "structure", None)


def _names_watched(fun: TorchFn) -> StructureSeen | None:
    """What the names ``fun``'s function reads hold, where it remembers some
    (NOTE [a name rebound after a call])."""
    structure = structure_of(fun)
    return structure if structure is not None and structure.watches_names() else None


def _runner_class(fun: TorchFn) -> type[_Runner]:
    """``_RunnerWithEffects`` where one of its duties applies, else
    ``_RunnerWatchingDraws`` for a derivative that must not draw, else
    ``_RunnerWatchingNames`` where the function reads names it remembers,
    else the plain runner."""
    if fun.base.call_effects is not None or any(_effect_duties(fun)):  # every keeping and replaying call
        return _RunnerWithEffects
    if unseen_draws_watch(fun) is not None:  # NOTE [draws the trial runs did not see] in random_state.py
        return _RunnerWatchingDraws
    return _RunnerWatchingNames if _names_watched(fun) is not None else _Runner


def runner_for(fun: TorchFn) -> _Runner:
    """The cached runner of ``fun`` (one per TorchFn object)."""
    runner = fun.__dict__.get("_runner")
    if runner is None:
        # Process-wide and applied once; see NOTE [heap trimming].
        tune_malloc()
        runner = _runner_class(fun)(fun)
        # TorchFn is frozen; the runner is a cache, not part of its value.
        object.__setattr__(fun, "_runner", runner)
    return runner


def run_into(
    fun: TorchFn,
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    stream: int | None = None,
) -> None:
    """Run ``fun`` on ``inputs`` and copy its results into ``outputs``.

    ``inputs`` and ``outputs`` view XLA's buffers. The inputs must be fresh
    tensors, as DLPack imports are: a nonzero ``_version`` after the call is
    taken as an in-place write. Raises ``TorchCallError``
    (with PyTorch's message and traceback text) when PyTorch raises, when the
    results do not match ``fun.out_avals``, or when an input was mutated.
    """
    runner_for(fun)(inputs, outputs, stream or 0)
