"""``compile="graph"`` and ``compile="inductor"``: each TorchFn traced once.

NOTE [graph mode]
``torch.func`` is slow for small and medium work not because of the math but
because of Python and dispatch: every call walks the user's Python, wraps
tensors for each functorch level, records an autograd graph and replays it.
``jax.jit`` removes exactly that cost for JAX code by tracing once per input
signature, and a TorchFn (a user function plus its transform stack, with
fixed input avals) is already one signature. So in graph mode the PyTorch
callable ``build`` makes for a TorchFn is traced once, at its first call, with
``make_fx`` in fake-tensor mode into a flat aten graph; every later call runs
the graph. The functorch levels, the autograd tape and the user's Python are
gone from the graph: what is left is the aten ops they issued.

- Fake tensors, never real values. The trace sees shapes and dtypes only, so
  code whose Python depends on tensor values (``if x.sum() > 0``, NumPy,
  ``.item()``) makes the trace fail instead of baking one branch in. A graph
  that reads a scalar back into Python (``aten._local_scalar_dense``, what
  ``.item()`` becomes) is refused too: that value leaves the graph and, on a
  GPU, would stall the stream; such functions stay eager.
- Custom ``autograd.Function`` rules run at trace time, inside the functorch
  transforms, so their ``backward``/``jvp``/``vmap`` (not the derivative of
  their forward) are what the graph holds. ``torch.compile``'s Dynamo over the
  transformed Python would drop them (PyTorch issues 193279, 192985, 172386);
  we never use Dynamo: ``"inductor"`` compiles the traced aten graph itself.
- What cannot be traced or compiled runs eagerly, per TorchFn, announced once
  with a ``FallbackWarning`` naming the function, the transform stack and
  PyTorch's reason. The warning comes only after the eager call succeeded: a
  function that fails eagerly too just raises its own error. Fallback
  decisions made during a failed trace are discarded
  (``rules.fallbacks.provisional``). A trace that made one is traced again,
  on the path decided: ``make_fx`` records every op that ran, so the graph
  held the ops of the attempt that failed (``torch.vmap`` of a ``GRUCell``
  under ``jax.grad``, up to an in-place op that then failed for real on the
  graph's first run, dropping the graph).
- Randomness: the graph replays the aten random ops the eager call would run,
  on PyTorch's global generator, so a seeded run draws the same numbers in
  both modes; inductor is told to keep those ops (``fallback_random``).
  Under ``torch.vmap`` over examples random ops are refused in every mode
  (``randomness="error"``), so ``vmap_method="auto"`` loops. The
  derivatives of a random function replay its value's draws with the
  generator set around the graph (NOTE [the generator around a graph] in
  replayed_calls.py).
- Constants the function closes over (a module's buffers) are held by
  reference, as in eager: in-place updates to them are seen. A trace that
  reads their values into Python is refused (NOTE [values a graph would
  keep] in trace_refusals.py).
- Artifacts live on the ``BaseFn``, keyed by the transform tuple and the
  device (NOTE [a compiled function on several devices] in runtime.py), so
  equal TorchFns share them; they die with the function
  (``t2j_ad.clear_caches()`` drops the signature cache that holds it).
- On CUDA the graph (or the inductor kernel) is captured once into a CUDA
  graph and replayed on XLA's stream (cuda_graphs.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode  # private: NOTE [what a trace leaves behind]

from .functorch_levels import dispatch_keys_kept, innermost_tensor
from .fx_sources import forget_sources, recompile, source_key
from .held_layouts import HeldLayouts
from .module_modes import NO_MODES, ModuleModes, modes_hold, recording_module_modes
from .output_buffers import (
    OutSpecs,
    computing_outputs_in_place,
    row_major_strides,
    writes_into,
    writing_into_outputs,
)
from .public_bindings import through_public_bindings
from .random_state import SeedWatch, generators_in_use
from .module_locks import locks_under, taken_after
from .real_writes import one_trial_run, trial_run, undeclared_writes
from .rules.fallbacks import first_line, provisional, warn_once
from .trace_check import (
    FirstRunFailed,
    FirstRunNotUndone,
    WrittenConstants,
    checked_first_run,
    compiled_disagreement,
    graph_constants,
)
from .tangent_zeros import fold_tangent_zeros, plain_tangent_zeros
from .trace_refusals import (
    NotTraceable,
    refuse_lost_results,
    refuse_module_side_effects,
    refuse_scalar_reads,
    refuse_state_kept_in_objects,
    refusing_closed_over_reads,
    refusing_reseeding,
)

COMPILE_MODES = ("eager", "graph", "inductor")
ENV_VAR = "T2J_AD_COMPILE"

Flat = Callable[..., tuple[torch.Tensor, ...]]


def resolve_compile_mode(value: str | None, where: str) -> str:
    """``value``, or the ``T2J_AD_COMPILE`` default when it is None; checked."""
    if value is None:
        env = os.environ.get(ENV_VAR, "").strip()
        if not env:
            return "eager"
        if env not in COMPILE_MODES:
            raise ValueError(f"{ENV_VAR} must be one of {COMPILE_MODES} (or unset), got {env!r}.")
        return env
    if value not in COMPILE_MODES:
        raise ValueError(f"{where}: compile must be one of {COMPILE_MODES}, got {value!r}.")
    return value


# Forward-mode formulas give inputs without a tangent PyTorch's "efficient"
# zero tensors, whose kernels work out shapes on the meta device; under fake
# tensors that meets the fake device and the trace fails. Marked plain zeros
# trace (NOTE [zero tangents in a graph]).
_DECOMPOSITIONS = {torch.ops.aten._efficientzerotensor.default: plain_tangent_zeros}


# NOTE [fake tensors on a CUDA build without a GPU]
# Entering FakeTensorMode (every make_fx trace, and inductor's compile) on a
# PyTorch built for CUDA that sees no GPU (Linux's default wheel on a CPU
# machine, or CUDA_VISIBLE_DEVICES="") swaps PyTorch's CUDA device guard for a
# fake one, so that CUDA ops can be traced (torch._C._ensureCUDADeviceGuardSet).
# The fake guard belongs to a thread_local of the first thread that enters,
# while the process-wide guard registry keeps its address: once that thread
# exits, the next trace reads freed memory and the process dies (a segfault
# with torch 2.11, at a graph-mode call after one on a thread that had ended).
# XLA's threads and the user's come and go, so the first swap is made on a
# daemon thread of ours, parked for the life of the process; later entries
# find the fake guard in place and leave it. CPU-only builds, and machines
# with a GPU, never swap and start no thread.
_guard_lock = threading.Lock()
_guard_kept = False


def keep_fake_cuda_guard_alive() -> None:
    """Make PyTorch's fake CUDA device guard on a thread that never exits, if
    this PyTorch will swap one in (NOTE [fake tensors on a CUDA build without
    a GPU]); once per process."""
    global _guard_kept
    if _guard_kept:
        return
    with _guard_lock:
        if _guard_kept:
            return
        ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)  # private; absent: nothing to keep
        if ensure is not None and torch.backends.cuda.is_built() and not torch.cuda.is_available():
            done = threading.Event()

            def park() -> None:
                try:
                    ensure()
                finally:
                    done.set()
                threading.Event().wait()

            threading.Thread(target=park, name="t2j_ad-fake-cuda-guard", daemon=True).start()
            done.wait()
        _guard_kept = True


# PyTorch's fake-tensor module logs, at ERROR level with a traceback, a meta
# kernel that raised (an in-place add_ whose shapes a torch.vmap batched, in a
# GRU's per-example gradient): some 18 lines for a trace that then fails and
# runs eagerly, which the FallbackWarning already says, with the reason.
_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")


@contextlib.contextmanager
def _fake_tensor_log_quiet() -> Iterator[None]:
    """Within the block (a trace: one at a time, NOTE [one trial run at a
    time]), the fake-tensor log says nothing below CRITICAL."""
    level = _FAKE_TENSOR_LOG.level
    _FAKE_TENSOR_LOG.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        _FAKE_TENSOR_LOG.setLevel(level)


def _referenced(base: Any) -> tuple[Sequence[dict[Any, Any]], Sequence[torch.nn.Module]]:
    """The dicts and modules ``base``'s function refers to (api sets them)."""
    return getattr(base, "referenced_dicts", ()), getattr(base, "referenced_modules", ())


@contextlib.contextmanager
def _fake_cache_taken_back() -> Iterator[None]:
    """Within the block, fake tensors may fill their process-wide dispatch
    cache; what they add goes when it ends (NOTE [what a trace leaves
    behind])."""
    dispatch_cache = FakeTensorMode.cache
    before = set(dispatch_cache)
    try:
        yield
    finally:
        for key in [k for k in dispatch_cache if k not in before]:
            dispatch_cache.pop(key, None)


def _rebound(graph: torch.fx.GraphModule) -> int:
    """``through_public_bindings(graph)``, its fake calls' cache entries taken
    back; one at a time, as traces (NOTE [one trial run at a time])."""
    with one_trial_run(), _fake_cache_taken_back(), _fake_tensor_log_quiet():
        return through_public_bindings(graph)


# NOTE [what an added entry is computed from]
# An entry a trace adds is state when its value comes from the function's
# inputs (NOTE [an entry a trace adds, from the inputs] in trial_caches.py):
# their values, not their shapes. A cache per size made with
# ``torch.zeros_like(x)``, ``x.new_ones(n)`` or ``torch.empty_like(x)``
# reads only ``x``'s shape, dtype and device, the same on every call with
# this signature, and the graph computes it again on each replay as the
# function would; counted as computed from ``x``, it was refused (eagerly,
# slower, with a message about streaming state). So the first argument of
# an op in ``_METADATA_READS`` does not count. What an op writes into does:
# ``buf = torch.zeros_like(x); buf[1:] = x[:-1]`` writes through a view, and
# the graph returns ``buf``'s node (``zeros_like``), not the write's; a
# written tensor's storage (``_storage_of``) counts as computed from what
# the write reads, and so does every view of it. A random draw counts as an
# input: ``cache[n] = torch.randn(n)`` keeps its first draw in eager, while
# a graph that computed it again drew anew on every replay, silently.
_aten = torch.ops.aten
_METADATA_READS = frozenset(
    {
        _aten.zeros_like, _aten.ones_like, _aten.empty_like, _aten.full_like,
        _aten.rand_like, _aten.randn_like, _aten.randint_like,
        _aten.new_zeros, _aten.new_ones, _aten.new_empty, _aten.new_full, _aten.new_empty_strided,
        _aten.sym_size, _aten.sym_stride, _aten.sym_numel, _aten.sym_storage_offset,
    }
)  # fmt: skip


def _nodes_in(value: Any) -> list[torch.fx.Node]:
    """The graph nodes ``value`` (a node argument, or a list or dict of them) holds."""
    nodes: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, nodes.append)
    return nodes


def _values_read(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes whose values ``node`` reads: all it reads, less the first
    argument of an op that reads only that one's metadata."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.overloadpacket in _METADATA_READS:
        return _nodes_in((node.args[1:], node.kwargs))
    return node.all_input_nodes


def _written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes whose tensors ``node``'s op writes into (``copy_``'s
    ``self``, an ``out=``)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    written: list[torch.fx.Node] = []
    for i, argument in enumerate(target._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written += _nodes_in(node.args[i] if i < len(node.args) else node.kwargs.get(argument.name))
    return written


def _storage_of(node: torch.fx.Node, storages: dict[torch.fx.Node, torch.fx.Node]) -> torch.fx.Node:
    """The node that made the memory ``node``'s tensor lies in: for a view
    (``slice``), an in-place op's result (``copy_``) or an item of a list of
    views (``split``), that of the tensor it aliases; ``storages``: each
    earlier node's."""
    target = node.target
    aliased = node.args[0] if node.args and target is operator.getitem else None
    if isinstance(target, torch._ops.OpOverload) and target._schema.returns:
        if target._schema.returns[0].alias_info is not None:
            aliased = next(iter(_written(node)), node.args[0] if node.args else None)
    return storages[aliased] if isinstance(aliased, torch.fx.Node) else node


def constants_written(graph: torch.fx.GraphModule) -> list[torch.Tensor]:
    """The tensors ``graph`` holds by reference (``graph_constants``) that its
    ops write into, directly or through a view (a module's running
    statistics): what its checked first run puts back where it raises (NOTE
    [a first run that fails on its inputs])."""
    storages: dict[torch.fx.Node, torch.fx.Node] = {}
    found: dict[int, torch.Tensor] = {}
    for node in graph.graph.nodes:
        storages[node] = _storage_of(node, storages)
        # batch norm's kernels write the running statistics unannounced
        unannounced = [node.args[i] for i in undeclared_writes(node.target, node.args) if i < len(node.args)]
        for written in (*_written(node), *unannounced):
            owner = storages.get(written) if isinstance(written, torch.fx.Node) else None
            if owner is not None and owner.op == "get_attr":
                value = operator.attrgetter(owner.target)(graph)
                if isinstance(value, torch.Tensor):
                    found[id(value)] = value
    return list(found.values())


def _draws(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _from_inputs_or_draws(graph: torch.fx.GraphModule) -> Callable[[torch.fx.Node], bool]:
    """Whether a node of ``graph`` holds values computed from an input or a
    random draw (NOTE [what an added entry is computed from]), found in one
    pass over the nodes in order (each after what it reads), with no
    recursion, which a long chain would overflow."""
    storages: dict[torch.fx.Node, torch.fx.Node] = {}
    computed: set[torch.fx.Node] = set()  # nodes, and storages written from one

    def from_inputs(node: torch.fx.Node) -> bool:
        return node in computed or storages.get(node) in computed

    for node in graph.graph.nodes:
        storages[node] = _storage_of(node, storages)
        if node.op == "placeholder" or _draws(node) or any(from_inputs(n) for n in _values_read(node)):
            computed.add(node)
            computed.update(storages[n] for n in _written(node))
    return from_inputs


def _added_outputs_dropped(graph: torch.fx.GraphModule) -> list[bool]:
    """For a graph traced from ``with_added`` (in ``trace``), which returns
    the function's results and the tensors its trace added to dicts: whether
    each added tensor is computed from an input or a random draw (NOTE
    [what an added entry is computed from]); the graph then returns the
    function's results alone."""
    output = graph.graph.output_node()
    results, added = output.args[0]
    output.args = (results,)
    from_inputs = _from_inputs_or_draws(graph)
    return [isinstance(node, torch.fx.Node) and from_inputs(node) for node in added]


# NOTE [an added entry's wrappers]
# Under a derivative or batching transform (jax.grad, jax.jvp, jax.vmap) the
# traced function runs inside torch.func levels, so a tensor it keeps in a
# dict (``state["prev"] = x.detach() * 1``) is a functorch wrapper around
# the fake tensor make_fx recorded. Returned as it was, make_fx took the
# wrapper for a tensor from outside the trace (a graph constant), with no
# edge to an input: the entry passed for a cache filled, the graph never
# wrote it, and every replay computed as on a first call (gradients [2, 8,
# 18, 32] under jax.jit(jax.grad(f)) where PyTorch gives [2, 1, 4, 9]),
# silently. So ``with_added`` returns the tensor under the wrappers
# (functorch_levels.innermost_tensor), and a derivative trace is refused as
# a plain call's is.


# NOTE [a hook that removed itself in a trace]
# A one-shot hook (a forward pre-hook that sets a scale from the first
# batch, then ``handle.remove()``) runs in the trace of the function's first
# call and removes itself. The trace kept it removed, and its graph the
# hook's ops, so that the graph's first run was PyTorch's first call; but a
# compiled ``jax.jit`` runs its graph on every call while the modules keep
# the hooks the graph found as it was made (NOTE [the hooks a graph ran] in
# module_modes.py), which were those without it: the init re-ran from every
# batch (off by 1.55 and 2.29 on the second and third calls), silently. And
# a trace that failed after the hook ran (a value read in the forward) left
# it removed, so the eager call that stood in for the graph never ran the
# init. So a trace puts such a hook back, as every trial run does (NOTE
# [hooks a trial run registers] in module_hooks.py), and gives no graph: the
# call that traced runs eagerly, runs the hook for real and so removes it,
# as PyTorch's first call does; the next call finds it gone (the graph's
# modules hold other hooks than the eager run assumed) and traces without
# it. That eager run is no fallback: it is neither cached nor announced.


class HookRemovedInTrace(NotTraceable):
    """A hook the trace ran removed itself (NOTE [a hook that removed itself in a trace])."""

    def __init__(self) -> None:
        super().__init__("a hook it ran removed itself (a one-shot hook), so this call runs eagerly, once")


def trace(
    fn: Flat,
    inputs: Sequence[torch.Tensor],
    grad_enabled: bool,
    dicts: Sequence[dict[Any, Any]] = (),
    modules: Sequence[torch.nn.Module] = (),
) -> torch.fx.GraphModule:
    """``fn`` traced on fake versions of ``inputs`` into an aten graph;
    ``dicts``: those the function can reach, which keep no fake tensor
    (NOTE [trial runs leave caches as they found them]); ``modules``: those
    it refers to (NOTE [trial runs wait for module calls])."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def run() -> torch.fx.GraphModule:
        # NOTE [trial runs do not write to real tensors]
        with torch.autograd.set_grad_enabled(grad_enabled), trial_run(dicts, modules) as attributes:
            # _allow_non_fake_inputs: tensors the function closes over (module
            # buffers) become graph constants, held by reference; their values
            # stay out of Python (NOTE [values a graph would keep]). NOTE
            # [random state in trial runs]: a function that seeds is refused;
            # the trial run puts the generators back.
            seeds = SeedWatch(generators_in_use())
            refusing = refusing_reseeding(refusing_closed_over_reads(fn), seeds)

            added: list[str] = []  # the names of the entries whose tensors with_added returns

            def with_added(*args: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
                # NOTE [an entry a trace adds, from the inputs] in trial_caches.py;
                # NOTE [an added entry's wrappers]
                results = refusing(*args)
                entries = attributes.added_tensors()
                added[:] = [name for name, _ in entries]
                return results, [innermost_tensor(t) for _, t in entries]

            graph = make_fx(with_added, _DECOMPOSITIONS, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)
            from_inputs = [name for name, computed in zip(added, _added_outputs_dropped(graph)) if computed]
            # Before the trial run puts it back:
            refuse_state_kept_in_objects(
                attributes.cache_state(), attributes.hook_filled(), from_inputs, attributes.lists_filled()
            )
        if attributes.hooks_put_back:  # NOTE [a hook that removed itself in a trace]
            raise HookRemovedInTrace()
        refuse_module_side_effects(attributes.rebound, attributes.python_state)
        return graph

    # NOTE [what a trace leaves behind]: make_fx sets a fresh, uniquely named
    # ContextVar per call (config.patch), which would stay in this thread's
    # context for good, and fake tensors fill a process-wide dispatch cache
    # keyed by each function's constants. Both grew without bound over fresh
    # functions (benchmarks/bench_registry_memory.py --compile graph): trace
    # in a throwaway context, and take back the cache entries the trace added.
    # NOTE [a failed trace's dispatch keys]
    with _fake_cache_taken_back(), _fake_tensor_log_quiet(), dispatch_keys_kept():
        graph = contextvars.copy_context().run(run)
    # Drop what no output needs: the primal work a derivative discards, and
    # the shape checks of PyTorch's ZeroTensor fallback (meta-device copies,
    # which fail if replayed). Random ops count as impure, so the graph draws
    # the same numbers as eager; an op that returns nothing stays (NOTE [a
    # check that returns nothing]).
    fold_tangent_zeros(graph)
    graph.graph.eliminate_dead_code(is_impure_node=_kept_when_unused)
    recompile(graph)
    refuse_scalar_reads(graph)
    refuse_lost_results(graph)
    return graph


# NOTE [a check that returns nothing]
# ``torch.linalg.cholesky`` traces as ``linalg_cholesky_ex``, whose factor
# the graph returns, and ``_linalg_check_errors`` of its ``info``, which
# returns nothing and raises where the matrix is not positive definite. FX's
# dead-code elimination keeps a node whose result is unused only where
# PyTorch marks its op as having effects, and torch 2.11 does not mark that
# one (torch 2.13 does): on the H100 run (torch 2.11) the graph of a
# Cholesky factor of a matrix that is not positive definite returned NaN
# where eager PyTorch raises, its first run passed for a working one, and a
# trace that failed on those inputs was never told from one that did not
# (NOTE [a first run that fails on its inputs]). An aten op that returns
# nothing and writes nothing can only be there for what it does besides
# (check, raise, print), so the trace keeps every such node, whatever the
# PyTorch version marks.


def _kept_when_unused(node: torch.fx.Node) -> bool:
    """Whether dead-code elimination keeps ``node`` though nothing reads its
    result: FX's own rule, or an aten op that returns nothing (NOTE [a check
    that returns nothing])."""
    if node.is_impure():
        return True
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and not target._schema.returns


def compile_with_inductor(graph: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> Flat:
    """The traced aten graph compiled by inductor (no Dynamo: NOTE [graph mode])."""
    from torch._guards import TracingContext, tracing
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # Inductor's on-disk graph cache keys on the shape environment of the
    # tracing context Dynamo would have set up, and skips itself without
    # one; the shapes here are static, so an empty environment is exact.
    context = TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
    with torch.no_grad(), config.patch(fallback_random=True), tracing(context):
        compiled = compile_fx(graph, list(inputs))

    def run(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(compiled(*args))

    return run


class Artifact:
    """What one TorchFn runs on one device, while the modules it ran keep
    their training flags: a callable, or eager with a reason."""

    __slots__ = (
        "run",
        "run_into",
        "into_strides",
        "reason",
        "traced",
        "cuda_graph",
        "trace_seconds",
        "compile_seconds",
        "modes",
        "layouts",
        "once",
    )

    def __init__(self, run: Flat | None, reason: str | None = None, traced: bool = False):
        self.run = run
        # run_into(inputs, outputs): the results written into ``outputs``,
        # buffers with strides ``into_strides`` (NOTE [results written into
        # XLA's buffers]); None where only ``run`` exists.
        self.run_into: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None] | None = None
        self.into_strides: tuple[tuple[int, ...], ...] = ()
        self.reason = reason  # why it runs eagerly, when run is None
        self.traced = traced  # whether it runs eagerly although the trace worked
        self.cuda_graph: Any = None  # cuda_graphs.CudaGraphCall, on CUDA
        self.trace_seconds = 0.0
        self.compile_seconds = 0.0
        self.modes: ModuleModes = NO_MODES  # NOTE [a graph per training mode]
        self.layouts: HeldLayouts | None = None  # NOTE [the layouts a graph assumed]
        # Whether it runs eagerly for the call that made it alone (while its
        # modules keep their modes), neither cached nor announced (NOTE [a
        # hook that removed itself in a trace], NOTE [a setting changed every
        # step]).
        self.once = False

    def holds(self) -> bool:
        """Whether what the graph assumed beyond its inputs still holds: the
        training flags and forwards of the modules it ran (NOTE [a forward
        replaced after a trace]), the layouts of the tensors it holds."""
        return modes_hold(self.modes) and (self.layouts is None or self.layouts.hold())

    def eager_call(self, impl: Flat) -> Flat:
        """What a runner calls for this artifact when it runs eagerly
        (``run`` is None): ``impl`` itself."""
        return impl


class EagerForSettings(Artifact):
    """Eager, while the modules ``modes`` recorded keep all but their
    setting (rates of dropout, hooks, children), at settings other than
    those of the graphs kept for them (``kept_settings``) that have not
    settled (``seen``): each new setting runs eagerly without a lookup
    (NOTE [a setting changed every step])."""

    __slots__ = ("kept_settings", "seen")

    def __init__(self, modes: ModuleModes, kept_settings: list[tuple[Any, ...]], seen: SettingsSeen) -> None:
        super().__init__(None, "its dropout rates, hooks or submodules keep changing")
        self.modes = modes
        self.kept_settings = kept_settings
        self.seen = seen
        self.once = True

    def holds(self) -> bool:
        if not self.modes.hold_but_setting():
            return False
        setting = self.modes.setting_now()
        return setting not in self.kept_settings and self.seen.run_eagerly(setting)

    def eager_call(self, impl: Flat) -> Flat:
        """``impl``, each run timed into ``seen``'s eager seconds: its own
        time alone, not the caller's work between calls (NOTE [a setting
        changed every step])."""
        seen = self.seen

        def timed(*inputs: torch.Tensor) -> Any:
            start = time.perf_counter()
            try:
                return impl(*inputs)
            finally:
                seen.ran_eagerly_for(time.perf_counter() - start)

        return timed


class TracedGraph:
    """A traced graph before its checked first run: the graph, the tensors it
    holds by reference (``held``), their layouts as the trace saw them, and
    the seconds the trace took."""

    __slots__ = ("graph", "held", "layouts", "seconds")

    def __init__(self, graph: torch.fx.GraphModule, held: list[torch.Tensor], layouts: HeldLayouts, seconds: float):
        self.graph = graph
        self.held = held
        self.layouts = layouts
        self.seconds = seconds


class UncheckedGraph(Artifact):
    """A traced graph whose checked first runs so far raised, as the eager
    call on their inputs did: checked again at the next call, not traced
    again (NOTE [a first run that fails on its inputs])."""

    __slots__ = ("traced_graph",)

    def __init__(self, traced_graph: TracedGraph) -> None:
        super().__init__(None, "its first runs so far failed on their inputs, as eager did", traced=True)
        self.traced_graph = traced_graph
        self.trace_seconds = traced_graph.seconds
        self.layouts = traced_graph.layouts if len(traced_graph.layouts) else None


# NOTE [a first run that fails on its inputs]
# A graph's first run (checked: NOTE [checking a trace against eager] in
# trace_check.py) can raise because of its inputs' values alone:
# ``torch.linalg.cholesky`` of a matrix that is not positive definite
# raises in eager PyTorch too. Taken for a fault of the trace, such an
# error dropped the graph for good: every later call ran eagerly
# (``compile_stats()``: graphs 0, eager_fallbacks 1), with a
# FallbackWarning blaming the graph's first run. So a first run that
# raises is followed by the eager call on the same inputs, from the random
# state that run started in (``trace_check.FirstRunFailed``). Where eager
# returns, the trace is at fault, as before: the graph is dropped, the call
# returns eager's results, and the warning says so. Where eager raises
# too, the error is the inputs': the call raises eager's error, as
# ``compile="eager"`` does, with no warning, and the traced graph is kept
# unchecked (``UncheckedGraph``), in the cache for its setting; the next
# call that finds it runs the check again on its own inputs, without a new
# trace. That is the bound: a function that fails on most of its inputs is
# traced once in all, and each failing call costs a run of the graph (up
# to its error, through the layout-checking interpreter) and an eager run,
# about twice eager's time, until a call that works keeps the graph.
# ``compile_stats()`` counts an unchecked graph neither as a graph nor as
# an eager fallback (its trace's seconds count). What the failed run wrote
# into tensors the function keeps before it raised (a module's running
# statistics, its batch count) was not put back before the eager run, which
# wrote them again: two batches counted for one call, where
# ``compile="eager"`` counts one. So the first run notes, before it runs,
# the values of the tensors the graph holds and writes into
# (``constants_written``: an op's written arguments by its schema, through
# views, and batch norm's running statistics, which its kernels write
# unannounced), and puts them back where it raises, before the eager run,
# whether eager then works or raises too.


def _build_artifact(
    mode: str, impl: Flat, base: Any, inputs: Sequence[torch.Tensor], grad_enabled: bool, out_specs: OutSpecs
) -> tuple[Artifact, Any]:
    """The artifact, and the first call's results when it ran (None if not;
    the error that call must raise, if it cannot return a result)."""
    keep_fake_cuda_guard_alive()
    start = time.perf_counter()
    try:
        decided = dict(base.__dict__.get("fallbacks", {}))
        with provisional(base):
            graph = trace(impl, inputs, grad_enabled, *_referenced(base))
        if base.__dict__.get("fallbacks", {}) != decided:  # NOTE [graph mode]: without the failed attempt
            with provisional(base):
                graph = trace(impl, inputs, grad_enabled, *_referenced(base))
    except OSError:  # not a trace's refusal: a time limit's TimeoutError, say, kept no eager path
        raise
    except HookRemovedInTrace as err:  # NOTE [a hook that removed itself in a trace]
        artifact = Artifact(None, _reason(err))
        artifact.once = True
        return artifact, None
    except Exception as err:  # noqa: BLE001 - any failure: run eagerly (NOTE [graph mode])
        return Artifact(None, _reason(err)), None
    seconds = time.perf_counter() - start
    # NOTE [the layouts a graph assumed]: as the trace saw them.
    held = graph_constants(graph)  # what the graph holds by reference
    named = getattr(base, "named_tensors", None)  # where the tensors its function names are now
    layouts = HeldLayouts(held, named=named() if named is not None else ())
    traced = TracedGraph(graph, held, layouts, seconds)
    return _checked_artifact(mode, impl, base, traced, inputs, grad_enabled, out_specs)


def _checked_artifact(
    mode: str,
    impl: Flat,
    base: Any,
    traced: TracedGraph,
    inputs: Sequence[torch.Tensor],
    grad_enabled: bool,
    out_specs: OutSpecs,
) -> tuple[Artifact, Any]:
    """The artifact of ``traced`` after its checked first run on ``inputs``,
    and that call's results (None if it has none; the error it must raise,
    if it cannot return a result)."""
    graph, held, layouts = traced.graph, traced.held, traced.layouts
    constants = WrittenConstants(graph) if mode == "inductor" else None
    try:
        # NOTE [checking a trace against eager]; NOTE [a first run that fails on its inputs]
        first, dropped = checked_first_run(impl, graph, inputs, grad_enabled, constants_written(graph))
    except FirstRunNotUndone as err:  # eagerly from the next call; this one fails
        return Artifact(None, f"on its first call it {err.reason}", traced=True), err
    except FirstRunFailed as err:  # NOTE [a first run that fails on its inputs]
        if err.eager_error is not None:
            return UncheckedGraph(traced), err.eager_error
        return Artifact(None, f"its first run failed: {_reason(err.error)}", traced=True), err.results
    except Exception as err:  # noqa: BLE001 - the check's own runs fail: eagerly
        return Artifact(None, f"its first run failed: {_reason(err)}", traced=True), None
    if dropped is not None:
        return Artifact(None, dropped, traced=True), first
    checked = time.perf_counter()
    replayed = mode == "graph"  # the traced graph replays: its ops move to public bindings below
    artifact = Artifact(graph.forward)
    if mode == "inductor":
        try:
            _compile(artifact, graph, inputs, out_specs)
        except Exception as err:  # noqa: BLE001 - the trace stands: its graph runs (as compile="graph")
            wrong: str | None = f"could not be made ({_reason(err)})"
        else:
            try:
                wrong = compiled_disagreement(graph, artifact.run, inputs, constants.since())
            except Exception as err:  # noqa: BLE001 - inductor's kernels fail where the graph runs
                wrong = f"failed ({_reason(err)}) where the traced graph runs"
            if wrong is not None:
                wrong = f"{wrong.removeprefix('its ')}, which agrees with eager"
        if wrong is not None:  # NOTE [checking inductor against the trace] in trace_check.py
            warn_once(
                base,
                ("inductor disagreed",),
                f"t2j_ad: compile='inductor': inductor's compiled kernels for {base.name!r} {wrong}, so it runs "
                f"the traced graph (as compile='graph'). Results are exact; only speed differs.",
            )
            artifact = Artifact(graph.forward)
            mode = "graph"
    if mode != "inductor" and writes_into(graph, inputs, out_specs):
        _replay_in_place(artifact, graph, out_specs, rebind=replayed)
    if replayed and _rebound(graph):  # NOTE [graph ops through the public bindings]
        artifact.run = graph.forward
    artifact.layouts = layouts if len(layouts) else None
    artifact.trace_seconds = traced.seconds
    artifact.compile_seconds = time.perf_counter() - checked if mode == "inductor" else 0.0
    if inputs and inputs[0].is_cuda:
        from .cuda_graphs import CudaGraphCall

        artifact.cuda_graph = CudaGraphCall(artifact.run, base.name, held=held)
    return artifact, first


def _compile(
    artifact: Artifact, graph: torch.fx.GraphModule, inputs: Sequence[torch.Tensor], out_specs: OutSpecs
) -> None:
    """Set ``artifact``'s callables to ``graph`` compiled by inductor, on the
    CPU writing into the output buffers where that can be done (NOTE [results
    written into XLA's buffers])."""
    into = writing_into_outputs(graph) if writes_into(graph, inputs, out_specs) else None
    if into is not None:
        buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in out_specs]
        try:
            compiled = compile_with_inductor(into, [*inputs, *buffers])
        except Exception:  # noqa: BLE001 - compile the graph as it is
            into = None
    if into is None:
        artifact.run = compile_with_inductor(graph, inputs)
        return

    def run_into(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        compiled(*inputs, *outputs)

    def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = tuple(torch.empty(shape, dtype=dtype) for shape, dtype in out_specs)
        compiled(*inputs, *outputs)
        return outputs

    artifact.run, artifact.run_into = run, run_into
    artifact.into_strides = row_major_strides(out_specs)


def _replay_in_place(
    artifact: Artifact, graph: torch.fx.GraphModule, out_specs: OutSpecs, rebind: bool
) -> None:
    """Give ``artifact`` a replay of ``graph`` whose ops write results into
    the output buffers, where it has such ops (NOTE [results written into
    XLA's buffers]); a replay that would only copy into them gains nothing.
    ``rebind``: its ops move to public bindings (NOTE [graph ops through
    the public bindings])."""
    into = writing_into_outputs(graph)
    if into is None:
        return
    if not computing_outputs_in_place(into):
        forget_sources([source_key(into)])
        return
    if rebind:
        _rebound(into)

    def run_into(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        # forward, not the module's __call__: that prints the graph's code to
        # stderr on every failing call, whether the caller catches it or not.
        into.forward(*inputs, *outputs)

    artifact.run_into = run_into
    artifact.into_strides = row_major_strides(out_specs)


def _reason(err: BaseException) -> str:
    reason = first_line(err)
    if _raised_checking_a_distribution(err):
        reason += (
            " (in torch.distributions' checks of a distribution's arguments or sample, which read values: pass "
            "validate_args=False to the distribution, or call "
            "torch.distributions.Distribution.set_default_validate_args(False), to trace it)"
        )
    return reason


# Where torch.distributions checks values (a distribution's __init__ and
# _validate_sample): a trace cannot read them, so such a function runs eagerly.
_DISTRIBUTION_CHECKS = (os.path.join("torch", "distributions", "distribution.py"), ("__init__", "_validate_sample"))


def _raised_checking_a_distribution(err: BaseException | None) -> bool:
    """Whether ``err`` (or an exception it chains) passed through
    ``_DISTRIBUTION_CHECKS``. Its frames may be cleared (NOTE [a failed
    trace's dispatch keys]); their code objects stay."""
    seen: set[int] = set()
    path, names = _DISTRIBUTION_CHECKS
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        tb = err.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if code.co_name in names and code.co_filename.endswith(path):
                return True
            tb = tb.tb_next
        err = err.__cause__ or err.__context__
    return False


def artifact_for(
    mode: str,
    impl: Flat,
    base: Any,
    transforms: tuple[Any, ...],
    inputs: Sequence[torch.Tensor],
    grad_enabled: bool,
    out_specs: OutSpecs,
) -> tuple[Artifact, Any]:
    """The traced (and for ``inductor`` compiled) form of one TorchFn, made at
    its first call and cached on ``base`` by transforms, device and the
    training flags of the modules it runs (NOTE [a graph per training
    mode]); and the results of that first call when this call made it and ran
    it (None if not: the caller runs the artifact itself)."""
    where = (transforms, inputs[0].device if inputs else None)
    cache: dict[Any, Artifact] = base.__dict__.setdefault("graphs", {})  # read by artifacts()
    artifact, _ = _holding(cache, where)
    if artifact is not None and not isinstance(artifact, UncheckedGraph):
        return artifact, None
    # Its own lock, not base.lock: build() takes that one, and a trace (an
    # inductor compile: seconds) must not hold up other TorchFns' builds.
    # The trace takes the trial-run lock, which comes first (NOTE [lock
    # order] in runtime.py): a forward-mode call holding it waited here for
    # this lock while the thread holding this lock waited for it. The locks
    # of the modules its trial run takes come with it, a busy one waited for
    # without it (NOTE [waiting for a lock without the trial-run lock] in
    # module_locks.py): the trace could not let the trial-run lock go.
    lock: threading.Lock = base.__dict__.setdefault("graph_lock", threading.Lock())
    with taken_after(one_trial_run(), locks_under(_referenced(base)[1])), lock:
        artifact, moved = _holding(cache, where)
        if isinstance(artifact, UncheckedGraph):  # NOTE [a first run that fails on its inputs]
            artifact, first = _checked_again(mode, impl, base, cache, where, artifact, inputs, grad_enabled, out_specs)
            if isinstance(first, BaseException):
                raise first
            return artifact, first
        if artifact is not None:
            return artifact, None
        if moved and _retraced_for_layouts(base, where) > _RETRACES_FOR_LAYOUTS:
            # NOTE [the layouts a graph assumed]: a tensor that changes size
            # on every call (a memory bank grown by torch.cat) would trace
            # on every call, slower than eager by far.
            artifact = Artifact(
                None,
                f"a tensor it closes over changed its size, strides or dtype after {_RETRACES_FOR_LAYOUTS} of "
                f"its traces (w.data = ... of another shape), and each change traces again",
            )
            cache[(*where, "layouts keep changing")] = artifact
            return artifact, None
        seen = _settings_seen(base, where)
        own, others = _kept_but_for_setting(cache, where, seen)
        kept = own + others
        seen.cost_known_from(kept)
        now = kept[0].modes.setting_now() if kept else None
        if any(now == artifact.modes.setting() for artifact in others):
            now = None  # another resolution's modules, as they were: what changed is no part of the setting
        if not seen.trace_new_setting(now):
            return _eager_for_settings(base, own, others, seen), None  # NOTE [a setting changed every step]
        with recording_module_modes(getattr(base, "referenced_modules", ())) as recorder:
            artifact, first = _build_artifact(mode, impl, base, inputs, grad_enabled, out_specs)
        artifact.modes = recorder.modes()
        if artifact.run is not None:
            seen.trace_cost = _cost_of(artifact)  # NOTE [a setting changed every step]
        if artifact.once:  # NOTE [a hook that removed itself in a trace]
            return artifact, first
        _keep(base, cache, where, artifact, moved)
        seen.kept(artifact)
    # FirstRunNotUndone, or eager's error (NOTE [a first run that fails on its inputs])
    if isinstance(first, BaseException):
        raise first
    return artifact, first


def _checked_again(
    mode: str,
    impl: Flat,
    base: Any,
    cache: dict[Any, Artifact],
    where: tuple[Any, Any],
    unchecked: UncheckedGraph,
    inputs: Sequence[torch.Tensor],
    grad_enabled: bool,
    out_specs: OutSpecs,
) -> tuple[Artifact, Any]:
    """The graph ``unchecked`` holds, whose first runs so far raised on
    their inputs as eager did, checked on this call's ``inputs``: its
    artifact, kept in ``cache`` in place of ``unchecked`` (or ``unchecked``,
    when this run raised too), and this call's results or error (NOTE [a
    first run that fails on its inputs]). Called under ``base``'s graph lock."""
    artifact, first = _checked_artifact(mode, impl, base, unchecked.traced_graph, inputs, grad_enabled, out_specs)
    if isinstance(artifact, UncheckedGraph):
        return unchecked, first
    artifact.modes = unchecked.modes
    for key in [key for key, kept in cache.items() if kept is unchecked]:
        del cache[key]
    _keep(base, cache, where, artifact, [])
    return artifact, first


# NOTE [a setting changed every step]
# A graph is kept per setting of the modules it ran (NOTE [a graph per
# training mode] in module_modes.py), and a training loop may change three
# parts of that setting on every step:
# - a dropout's rate (NOTE [a dropout's rate is part of its mode] in
#   module_modes.py), which a graph holds as constants of its ops
#   (``bernoulli_(1 - p)``, ``div_(1 - p)``): a rate annealed every step
#   (``m.drop.p = 0.5 * 0.99 ** step``) traced the value call and its
#   derivative again on every step: ``jax.jit(jax.value_and_grad(loss))``
#   of an MLP 32-64-10 with dropout took 140-200 ms a step where eager
#   took 1-1.5 ms (benchmarks/bench_module_changes.py, the 2-core CPU
#   machine);
# - its hooks (NOTE [the hooks a graph ran] in module_modes.py), which a
#   graph holds as ops and constants: a forward hook registered anew on
#   every step with another number (``h.remove(); h =
#   m[2].register_forward_hook(lambda mod, a, out, f=1 + 1e-3 * step: out
#   * f)``) traced both again on every step too: 120 graphs in 60 steps of
#   an MLP 32-64-4 with dropout, 162-173 ms a step where eager took 5-7 ms
#   (the fuzzer's repro, the same machine; with what follows, 8 graphs and
#   5-9 ms a step, eager's own). The same hook registered again is the
#   same setting and keeps its graph (NOTE [a hook registered again] in
#   module_structure.py);
# - its children (NOTE [the submodules a graph ran] in module_modes.py),
#   whose ops and weights a graph holds: a fresh head every step
#   (``net[2] = nn.Linear(64, 4)`` with new weights: a hypernetwork, a
#   notebook cell run again) traced both on every step as well: 120
#   graphs in 60 steps of the same MLP under ``jax.jit``, some 30x
#   eager's time (166 ms a step where eager took 5.5 ms; with what
#   follows, 8 graphs and eager's time). A graph is still used only while
#   the children it ran hold (``ModuleModes.hold``); they are aside only
#   in what the modules of a kept graph must keep for a new setting to
#   count here (``hold_but_setting``).
# Taking the rate in as an input of the graph would need each constant a
# rate became (``1 - p``, ``1 / (1 - p)``, an RNN's or an attention
# kernel's ``dropout_p``) told apart from equal constants of other ops,
# and a rate in a tensor draws other masks than PyTorch's float one
# (``bernoulli_`` from the same seed); a hook, or a child's forward, is
# Python, which a trace runs once. So once ``_RETRACES_FOR_SETTINGS`` new settings in a row of
# one transform stack and device differed from its kept graphs' in their
# rates, hooks or children alone (``ModuleModes.setting``; the modules'
# flags and forwards holding: ``hold_but_setting``), a further such
# setting is not traced: an ``EagerForSettings`` runs it eagerly (the
# masks PyTorch draws from the same seed, the hooks as they are, as every
# eager call), neither cached nor announced, and goes on doing so, with
# no lookup, for each new setting while the modules keep all else. Its
# kept graphs stay in use: a setting one was traced with takes it back
# (a few settings alternating keep their graphs), and a setting that
# changes more (``model.eval()``, a ``forward`` replaced) finds or traces
# its own, as before, and starts the count again.
# ``compile_stats()["eager_for_rates"]``, ``["eager_for_hooks"]`` and
# ``["eager_for_submodules"]`` count how often a TorchFn went on eagerly
# so: for new submodules where its children were none of its kept
# graphs', else for new hooks where its hooks were none of theirs, else
# for new rates.
# Reading the hooks as what they run (``module_hooks.SameHook``, a few us
# a hook) and copying the tables of children is done again only once
# something was registered or a hook left its place since the last read,
# or a table held when traced changed (``ModuleModes.setting_now``, as
# NOTE [the hooks a graph ran] compares its structure), so an annealed
# rate whose hooks stay reads one count, its hooks' places and its
# tables of children per call.
# Without ``jax.jit`` a call resolves its signature for the structure of
# its modules as it is (NOTE [a hook added after a call] in
# module_structure.py), and a new hook or submodule is a new structure:
# a new ``BaseFn``, with no kept graphs and no counts of its own, so
# ``jax.value_and_grad(f)`` called in a Python loop with a hook made anew
# every step still traced both calls on every step (120 graphs in 60
# steps, 3-5x eager's time: 390-450 ms a step where eager took 90-120 ms
# on the shared 2-core machine, a fresh head every step 550 ms where
# eager took 180 ms; with what follows, 8 graphs and eager's time). So the
# resolutions of one input signature share what they saw
# (``share_settings_seen``, from api.py): one ``SettingsSeen`` per
# function of the signature (the function itself, its keeping or its
# replaying function: NOTE [derivatives replay the value's draws] in
# replayed_calls.py), transform stack and device, which also holds the
# artifacts its last few traces kept (``recent``, ``_RECENT_KEPT``, which
# keeps that many graphs and their modules alive beyond the caches),
# whichever resolution made them. A resolution with no graph of its own
# that holds but for its setting counts a new setting against those, as
# the jitted loop counts against its own, and runs it eagerly after
# three in a row; one whose setting, read through those artifacts'
# modules, is one of theirs changed something else (a name the function
# reads bound to a new module: NOTE [a name rebound after a call]), and
# is traced, the count started again, as before. The resolution of a
# hook or submodule that then stays is the one every call takes (NOTE [a
# structure seen before] in module_structure.py), whose eager runs settle
# it and trace it. The graphs of another resolution are not taken back
# by this one (a setting seen before is found among the resolutions set
# aside, with its graphs).
# A setting that then stays (the end of a schedule, each plateau of a
# step decay: ``p = 0.5 * 0.5 ** (step // 100)``, a hook kept from some
# step on) ran eagerly for good at first, at eager speed, until something
# else about the modules changed. So the settings an ``EagerForSettings``
# runs are counted too (``SettingsSeen``): the same setting run eagerly,
# with no other new setting run eagerly between, has settled once it ran
# on ``_EAGER_CALLS_TO_SETTLE`` calls and for as long, all those eager
# runs together, as a trace of the TorchFn takes
# (``_SETTLE_COST_SECONDS``, None: the trace and compile seconds of its
# last trace for this transform stack and device, else of its kept graphs
# of other settings); that call traces it, its graph replayed from then
# on. The cost is the ski-rental bound: tracing after 3 calls instead took
# some 90 ms a trace (a value and its derivative are two) to save 0.3 ms a
# step of an MLP 32-64-10 under ``jax.jit(jax.value_and_grad)``, so with
# plateaus of 25 steps graph mode took 6x eager's time over them. Waiting
# until eager time reaches the trace's own, a plateau costs at most about
# twice what eager would (its eager runs, then one trace), however short,
# and a long one (an epoch, the end of a schedule) still gets its graph
# after a few hundred steps. Each eager run is timed alone
# (``EagerForSettings.eager_call``: ``time.perf_counter`` around the run
# the runner makes, 0.1 us), not the time between calls, which holds the
# caller's other work. The settled trace starts the count again, as a
# setting that changes more does, so an annealing that resumes traces
# ``_RETRACES_FOR_SETTINGS`` new settings again before it runs eagerly,
# and a step decay traces once per plateau long enough (per TorchFn).
# Calls are counted as checks: each check a runner makes before a call
# while it runs eagerly is one (``_Runner`` checks twice under forward
# AD's lock, which meets the count sooner; the seconds are the runs').
# Threads calling at once may lose a count or add a run's seconds to the
# next setting, which moves only when the trace comes.
_RETRACES_FOR_SETTINGS = 3
_EAGER_CALLS_TO_SETTLE = 3
# How many of the artifacts traced last a ``SettingsSeen`` holds for the
# other resolutions of the signature: enough to find one whose modules
# hold but for the setting.
_RECENT_KEPT = _RETRACES_FOR_SETTINGS + 1
# The eager seconds a setting that stays runs before its trace (None: its
# trace's own; tests set it).
_SETTLE_COST_SECONDS: float | None = None


class SettingsSeen:
    """What one transform stack and device of a function, in every
    resolution of its input signature, saw of settings that changed rates
    of dropout, hooks or children alone (NOTE [a setting changed every
    step]): how many such new settings in a row were traced (``traced``),
    the setting run eagerly last (``eager_setting``), on how many calls
    (``eager_calls``) and for how long (``eager_seconds``), the seconds its
    last trace took (``trace_cost``; 0 before one), and the artifacts its
    last few traces kept (``recent``), which another resolution's own
    cache does not hold."""

    __slots__ = ("traced", "eager_setting", "eager_calls", "eager_seconds", "trace_cost", "recent")

    def __init__(self) -> None:
        self.traced = 0
        self.eager_setting: tuple[Any, ...] | None = None
        self.eager_calls = 0
        self.eager_seconds = 0.0
        self.trace_cost = 0.0
        self.recent: list[Artifact] = []

    def cost_known_from(self, kept: Sequence[Artifact]) -> None:
        """Before its first trace, take the cost of the latest of the graphs
        ``kept`` for other settings for that of a trace."""
        if not self.trace_cost and kept:
            self.trace_cost = _cost_of(kept[-1])

    def kept(self, artifact: Artifact) -> None:
        """Note ``artifact``, just traced and kept, among the last
        ``_RECENT_KEPT``."""
        self.recent = [*self.recent, artifact][-_RECENT_KEPT:]

    def trace_new_setting(self, setting_alone: tuple[Any, ...] | None) -> bool:
        """Whether to trace a new setting of the modules, which changed the
        kept graphs' rates, hooks or children alone, to ``setting_alone``
        (None: it changed more, or no graph was kept), and count it."""
        if setting_alone is None or self._settled(setting_alone):
            self.traced, self.eager_setting, self.eager_calls, self.eager_seconds = 0, None, 0, 0.0
            return True
        self.traced += 1
        return self.traced <= _RETRACES_FOR_SETTINGS

    def run_eagerly(self, setting: tuple[Any, ...]) -> bool:
        """Count one more eager call at ``setting``; whether it runs eagerly
        (False: it settled, and the call traces it)."""
        if setting == self.eager_setting:
            self.eager_calls += 1
        else:
            self.eager_setting, self.eager_calls, self.eager_seconds = setting, 1, 0.0
        return not self._settled(setting)

    def ran_eagerly_for(self, seconds: float) -> None:
        """Add one eager run's ``seconds`` to the setting run eagerly last."""
        self.eager_seconds += seconds

    def _settled(self, setting: tuple[Any, ...]) -> bool:
        cost = self.trace_cost if _SETTLE_COST_SECONDS is None else _SETTLE_COST_SECONDS
        return (
            setting == self.eager_setting
            and self.eager_calls >= _EAGER_CALLS_TO_SETTLE
            and self.eager_seconds >= cost
        )


def _cost_of(artifact: Artifact) -> float:
    """The seconds ``artifact`` took to trace and compile."""
    return artifact.trace_seconds + artifact.compile_seconds


def _holds_but_for_setting(artifact: Artifact) -> bool:
    """Whether ``artifact``'s function ran modules, and all it assumed
    holds but the rates of their dropouts, their hooks and their children
    (NOTE [a setting changed every step])."""
    return (
        len(artifact.modes) > 0
        and artifact.modes.hold_but_setting()
        and (artifact.layouts is None or artifact.layouts.hold())
    )


def _kept_but_for_setting(
    cache: dict[Any, Artifact], where: tuple[Any, Any], seen: SettingsSeen
) -> tuple[list[Artifact], list[Artifact]]:
    """The artifacts cached for ``where`` (transforms, device) that would
    hold but for their setting, and those of the last traces ``seen`` kept,
    in other resolutions of the signature, that would (NOTE [a setting
    changed every step])."""
    own = [artifact for key, artifact in list(cache.items()) if key[:2] == where and _holds_but_for_setting(artifact)]
    others = [
        artifact
        for artifact in seen.recent
        if not any(artifact is mine for mine in own) and _holds_but_for_setting(artifact)
    ]
    return own, others


def share_settings_seen(base: Any, shared: dict[Any, SettingsSeen]) -> None:
    """Count what ``base``'s TorchFns, and those of its keeping and
    replaying functions, see of settings in ``shared``, the dict every
    resolution of one input signature of a jaxified function shares (NOTE
    [a setting changed every step])."""
    base.__dict__["settings_seen"] = shared


def _settings_seen(base: Any, where: tuple[Any, Any]) -> SettingsSeen:
    """What ``where`` (transforms, device) of ``base`` saw of settings
    changed alone, counted with what the same TorchFn of the other
    resolutions of its signature saw (``share_settings_seen``; NOTE [a
    setting changed every step])."""
    root = getattr(base, "effects_root", None) or base
    seen: dict[Any, SettingsSeen] = root.__dict__.setdefault("settings_seen", {})
    # The function of the root it is (itself, its keeping or its replaying
    # function), by its avals, which a per-device copy changes.
    which = (root is not base, getattr(base, "replays", False), base.in_avals, base.out_avals)
    return seen.setdefault((*which, *where), SettingsSeen())


def _eager_for_settings(base: Any, own: list[Artifact], others: list[Artifact], seen: SettingsSeen) -> Artifact:
    """An artifact that runs eagerly while the modules ``own`` and
    ``others`` ran keep all but their setting, at settings none of ``own``
    (the artifacts ``base`` keeps) was traced with, until one settles
    (``seen``); neither cached nor announced, and counted as an eager run
    for new submodules where the children now are none of the artifacts',
    else for new hooks where the hooks are none of theirs, else for new
    rates (NOTE [a setting changed every step])."""
    kept = own + others
    modes = kept[0].modes
    settings = [artifact.modes.setting() for artifact in kept]
    now = modes.setting_now()
    if all(now[2] != setting[2] for setting in settings):
        eager_for = "eager_for_submodules"
    elif all(now[1] != setting[1] for setting in settings):
        eager_for = "eager_for_hooks"
    else:
        eager_for = "eager_for_rates"
    _counted_more(base, eager_for=eager_for)
    seen.run_eagerly(now)  # this call's
    return EagerForSettings(modes, [artifact.modes.setting() for artifact in own], seen)


def record_eager(base: Any, transforms: tuple[Any, ...], reason: str) -> None:
    """Count one TorchFn of ``base`` that runs eagerly without a trace, for
    ``reason`` (``compile_stats()``'s ``eager_fallbacks``)."""
    cache: dict[Any, Artifact] = base.__dict__.setdefault("graphs", {})
    cache.setdefault((transforms, "not traced", ()), Artifact(None, reason))


# How many traces of one TorchFn a change of its held tensors' layouts may
# cause before it runs eagerly.
_RETRACES_FOR_LAYOUTS = 3


def _holding(cache: dict[Any, Artifact], where: tuple[Any, Any]) -> tuple[Artifact | None, list[Any]]:
    """The artifact cached for ``where`` (transforms, device) whose modules
    have the training flags they were traced with, and whose held tensors
    their layouts, if any; and the keys of those found for these flags
    whose held tensors changed layout (none when one holds)."""
    moved: list[Any] = []
    for key, artifact in list(cache.items()):
        if key[:2] == where:
            if artifact.holds():
                return artifact, []
            if artifact.layouts is not None and modes_hold(artifact.modes):
                moved.append(key)
    return None, moved


def _keep(base: Any, cache: dict[Any, Artifact], where: tuple[Any, Any], artifact: Artifact, moved: list[Any]) -> None:
    """Cache ``artifact``, traced for ``where``: in place of the artifacts
    ``moved`` names, whose modes held but not their held tensors' layouts
    (NOTE [the layouts a graph assumed]), counted as dropped; beside those
    of other settings, the oldest beyond ``_GRAPHS_KEPT`` dropped (NOTE
    [how many graphs a function keeps]). Called under ``base``'s graph lock."""
    for key in moved:
        if key in cache:
            _counted_more(base, dropped=cache.pop(key))
    # Its own key, never one in use: graphs of settings its modules' ids,
    # flags and rates do not tell apart (hooks, forwards) stand beside it.
    setting = (tuple((id(m), flag) for m, flag in artifact.modes), artifact.modes.rates())
    cache[(*where, setting, id(artifact))] = artifact
    _drop_the_oldest(base, cache, where)


def _retraced_for_layouts(base: Any, where: tuple[Any, Any]) -> int:
    """Count one more trace of ``where`` caused by a held tensor's new
    layout; how many so far."""
    counts: dict[Any, int] = base.__dict__.setdefault("retraced_for_layouts", {})
    counts[where] = counts.get(where, 0) + 1
    return counts[where]


def artifacts(base: Any) -> list[Artifact]:
    """Every artifact made so far for ``base``'s TorchFns and kept (NOTE
    [how many graphs a function keeps])."""
    return list(base.__dict__.get("graphs", {}).values())


# What compile_stats() reports, per function: graphs traced (and run),
# TorchFns that run eagerly, how often one went on eagerly for new rates of
# dropout, new hooks and new submodules (NOTE [a setting changed every
# step]), seconds spent tracing and compiling.
STATS = (
    "graphs",
    "eager_fallbacks",
    "eager_for_rates",
    "eager_for_hooks",
    "eager_for_submodules",
    "trace_seconds",
    "compile_seconds",
)


def no_stats() -> dict[str, float]:
    """``compile_stats()`` of nothing made."""
    return {
        "graphs": 0,
        "eager_fallbacks": 0,
        "eager_for_rates": 0,
        "eager_for_hooks": 0,
        "eager_for_submodules": 0,
        "trace_seconds": 0.0,
        "compile_seconds": 0.0,
    }


def stats_of(base: Any) -> dict[str, float]:
    """``compile_stats()`` of what ``base``'s TorchFns made: the artifacts
    kept, and what ``base`` counted of those no longer kept (``counted``:
    those ``_drop_the_oldest`` dropped, NOTE [how many graphs a function
    keeps]; how often they went on eagerly for new rates, hooks or
    submodules, NOTE [a setting changed every step])."""
    counted = dict(base.__dict__.get("counted") or no_stats())
    for artifact in artifacts(base):
        _count(counted, artifact)
    return counted


def _count(stats: dict[str, float], artifact: Artifact) -> None:
    """Add ``artifact`` to ``stats``: a graph or an eager fallback, and what
    its trace and compile cost."""
    if not isinstance(artifact, UncheckedGraph):  # NOTE [a first run that fails on its inputs]
        stats["graphs" if artifact.run is not None else "eager_fallbacks"] += 1
    stats["trace_seconds"] += artifact.trace_seconds
    stats["compile_seconds"] += artifact.compile_seconds


# NOTE [how many graphs a function keeps]
# A function's graphs are kept per transform stack and device, one for each
# setting of what they assumed (training flags, forwards, children, hooks:
# NOTE [a graph per training mode], NOTE [the submodules a graph ran]), so
# that a setting that comes back takes back its graph. A compiled jax.jit
# program given a fresh head every step (``net[2] = nn.Linear(...)``, a
# sweep) traced one more on every step, and kept every one with its head
# alive: 4.3 MB a step for a 1024 x 1024 head, without end. So each
# transform stack and device keeps the graphs of its last few settings
# (``_GRAPHS_KEPT``), dropping the oldest; ``compile_stats()`` still
# counts what the dropped ones cost, from counts the function keeps
# (``counted``), one dict however many were dropped, as a jaxified
# function counts the signatures it drops (its ``_dropped_stats``): a stub
# artifact kept per dropped graph grew by one on every step, without end.
# A per-device copy of the function (``BaseFn.with_leading_size``) starts
# with no counts of its own: sharing the function's, it had each drop made
# before it counted twice, since ``compile_stats()`` adds the copies' in.
# Each graph is cached under a key of its own. Keyed by its modules' ids,
# training flags and rates alone, a graph traced for a setting those do
# not tell apart (a hook, an own ``forward`` set and deleted again)
# replaced the graph of the setting before: a loop alternating a hooked
# step and one without under a compiled ``jax.jit(jax.value_and_grad(f))``
# traced on every step, 16 traces in 8 steps, where each setting now takes
# back its graph (4 traces, on the first two steps). A new graph takes the
# place of another only where that one's modes hold but its held tensors'
# layouts do not (NOTE [the layouts a graph assumed]), and the one replaced
# is counted as dropped: ``compile_stats()`` counted a replaced graph's
# trace as never made (1 graph, and the latest trace's seconds, for a
# parameter traced at three sizes).
_GRAPHS_KEPT = 8


def _drop_the_oldest(base: Any, cache: dict[Any, Artifact], where: tuple[Any, Any]) -> None:
    """Keep ``_GRAPHS_KEPT`` traced artifacts of ``where`` in ``cache``, the
    newest, and count those dropped in ``base``'s ``counted`` (NOTE
    [how many graphs a function keeps]). Called under ``base``'s graph lock."""
    traced = [key for key in cache if key[:2] == where and len(key) == 4]
    for key in traced[: max(0, len(traced) - _GRAPHS_KEPT)]:
        _counted_more(base, dropped=cache.pop(key))


def _counted_more(base: Any, dropped: Artifact | None = None, eager_for: str | None = None) -> None:
    """Add to ``base``'s ``counted`` (what ``compile_stats()`` counts of what
    its cache does not hold) the artifact ``dropped`` from its cache (NOTE
    [how many graphs a function keeps]) and one eager run for a new setting,
    counted under the ``eager_for`` key (``eager_for_rates``,
    ``eager_for_hooks`` or ``eager_for_submodules``: NOTE [a setting
    changed every step]). Called under ``base``'s graph lock; replaced
    whole, as ``stats_of`` reads it without the lock."""
    counts = dict(base.__dict__.get("counted") or no_stats())
    if dropped is not None:
        _count(counts, dropped)
    if eager_for is not None:
        counts[eager_for] += 1
    base.__dict__["counted"] = counts


# Words in a trace's failure that say it read a tensor's value into Python
# (a FakeTensor where Python wanted a number: a size taken from a value).
_VALUE_READ_WORDS = (
    "data-dependent", "data dependent", "datadependent", "item", "numpy", "value", "scalar", "faketensor"
)


def announce_fallback(base: Any, name: str, mode: str, transforms: tuple[Any, ...], artifact: Artifact) -> None:
    """One ``FallbackWarning`` per function and transform stack, saying why
    ``artifact`` runs eagerly."""
    stack = " > ".join(type(t).__name__ for t in transforms) or "plain call"
    if artifact.traced:
        what = f"dropped the traced graph of {name!r}"
        advice = "."
    else:
        what = f"could not trace {name!r}"
        reads_values = any(word in artifact.reason.lower() for word in _VALUE_READ_WORDS)
        advice = (
            ", or keep tensor values out of Python control flow (no .item(), NumPy or `if tensor`) to trace it."
            if reads_values
            else "."  # seeding, a rebinding, a nested torch.compile: the reason says what to do
        )
    warn_once(
        base,
        ("compile", mode, transforms),
        f"t2j_ad: compile={mode!r} {what} (transforms: {stack}), so it runs eagerly: {artifact.reason.rstrip('.')}. "
        f"Results are the same; only speed differs. Pass compile='eager' to silence this{advice}",
    )
