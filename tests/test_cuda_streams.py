"""Switching PyTorch to XLA's CUDA stream (NOTE [switching to XLA's stream])
and ordering each call with the caller's PyTorch stream (NOTE [ordering with
the caller's PyTorch stream]).

The switch's bookkeeping is checked on every machine against a model of the
state PyTorch keeps: a current device per thread, a current stream per
device, and ``_cuda_setStream`` making the stream's device current (as
``THCPModule_setStream_wrap`` does). The runner's path for a call that
comes with a stream (the CUDA handler's) is checked on CPU tensors with the
switch recorded. The CUDA tests check it all on a real GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import TORCH_DEVICE, assert_tree_allclose, cuda_only

import t2j_ad
from t2j_ad import cuda_streams, graph_mode, runtime
from t2j_ad.cuda_streams import DirectSwitch, StreamRunner, check_direct_switch
from t2j_ad.runtime import _Runner
from t2j_ad.torch_fn import Aval, BaseFn, TorchFn

CUDA = 1  # c10::DeviceType::CUDA


@dataclass(frozen=True)
class Stream:
    """What the switch reads of a ``torch.cuda.Stream``."""

    stream_id: int
    device_index: int
    device_type: int = CUDA

    @property
    def cuda_stream(self) -> int:  # the stream's pointer; here its id stands in
        return self.stream_id


class CudaState:
    """PyTorch's CUDA stream state, through the functions the switch calls
    (``torch._C``'s names) and the public ones ``check_direct_switch`` and
    the fallback use (``torch.cuda``'s names)."""

    def __init__(self, devices: int = 2) -> None:
        self.device = 0
        self.current = {d: (0, d, CUDA) for d in range(devices)}  # default streams
        self.stream_context_entries = 0

    # torch._C
    def _cuda_getDevice(self) -> int:
        return self.device

    def _cuda_getCurrentStream(self, device: int) -> tuple[int, int, int]:
        return self.current[device]

    def _cuda_setStream(self, stream_id: int, device_index: int, device_type: int) -> None:
        self.device = device_index
        self.current[device_index] = (stream_id, device_index, device_type)

    # torch.cuda: these stay right in the variants below, whose C functions differ.
    def current_device(self) -> int:
        return self.device

    def set_device(self, device: int) -> None:
        self.device = device

    def current_stream(self, device: int) -> Stream:
        return Stream(*self.current[device])

    def set_stream(self, stream: Stream) -> None:
        CudaState._cuda_setStream(self, stream.stream_id, stream.device_index, stream.device_type)

    @contextlib.contextmanager
    def stream(self, stream: Stream) -> Iterator[None]:
        """``torch.cuda.StreamContext``'s moves."""
        self.stream_context_entries += 1
        src = self.current_stream(self.device)
        dst = self.current_stream(stream.device_index)
        self.set_stream(stream)
        try:
            yield
        finally:
            self.set_stream(dst)
            self.set_stream(src)


class PackedStreams(CudaState):
    """An older PyTorch: the current stream comes back packed in one integer."""

    def _cuda_getCurrentStream(self, device: int) -> int:  # type: ignore[override]
        stream_id, device_index, _ = self.current[device]
        return stream_id << 8 | device_index


class KeepsDevice(CudaState):
    """A PyTorch whose ``_cuda_setStream`` would not make the stream's device current."""

    def _cuda_setStream(self, stream_id: int, device_index: int, device_type: int) -> None:
        self.current[device_index] = (stream_id, device_index, device_type)


class IgnoresDevice(CudaState):
    """A PyTorch whose ``_cuda_getCurrentStream`` would answer for the current device, whatever it is asked."""

    def _cuda_getCurrentStream(self, device: int) -> tuple[int, int, int]:
        return self.current[self.device]


class NoStreamFunctions:
    """A PyTorch without the C functions (a CPU build, or a renamed API)."""


def _seen(state: CudaState, device: int) -> tuple[int, tuple[int, int, int]]:
    return state.device, state.current[device]


@pytest.mark.parametrize("here", [0, 1])
def test_direct_switch_runs_on_the_stream_and_restores_both_devices(here):
    state = CudaState()
    state._cuda_setStream(7, 0, CUDA)  # device 0 had a stream of its own
    state.device = here
    before = dict(state.current)
    xla = Stream(stream_id=42, device_index=1)
    was_current, inside = DirectSwitch(state).run((42, 1, CUDA), lambda was: (was, _seen(state, 1)))
    assert was_current == before[1]
    assert inside == (1, (42, 1, CUDA))
    assert state.device == here
    assert state.current == before
    assert check_direct_switch(DirectSwitch(state), xla, state) is None


def test_direct_switch_restores_after_an_exception():
    state = CudaState()
    before = dict(state.current)

    def fail(was_current) -> None:
        assert state.current[1] == (42, 1, CUDA)
        raise ValueError("from the PyTorch function")

    with pytest.raises(ValueError, match="from the PyTorch function"):
        DirectSwitch(state).run((42, 1, CUDA), fail)
    assert (state.device, state.current) == (0, before)


class RecordedOrder:
    """Stands in for ``StreamOrder`` (CUDA events): records, for each call,
    the caller's stream it orders with and the stream current while it runs."""

    def __init__(self, state: CudaState) -> None:
        self.state = state
        self.calls: list[tuple[Stream, Stream, tuple[int, int, int]]] = []

    def stream(self, ids: tuple[int, int, int]) -> Stream:
        return Stream(*ids)

    def run(self, caller, target, fn, *args):
        self.calls.append((caller, target, self.state.current[target.device_index]))
        return fn(*args)


def _runner_on(state) -> tuple[StreamRunner, RecordedOrder]:
    # The model's streams stand in for torch.cuda.ExternalStream (the pointer is the id).
    public = state if isinstance(state, CudaState) else CudaState()
    order = RecordedOrder(public)
    return StreamRunner(cuda_c=state, cuda=public, order=order), order


def test_runner_uses_the_direct_switch_once_it_checks_out(recwarn):
    state = CudaState()
    state._cuda_setStream(7, 1, CUDA)  # the caller had a stream of its own on device 1
    state.device = 0
    runner, order = _runner_on(state)
    for stream in (42, 43, 42):
        assert runner.run(Stream(stream, 1), _seen, state, 1) == (1, (stream, 1, CUDA))
        assert _seen(state, 1) == (0, (7, 1, CUDA))
    assert runner.switch is not None and runner.fallback_reason is None
    assert state.stream_context_entries == 0
    assert not [w for w in recwarn if "XLA's CUDA stream" in str(w.message)]
    # Each call is ordered with the caller's stream on the call's device,
    # while XLA's stream is current.
    assert order.calls == [(Stream(7, 1), Stream(s, 1), (s, 1, CUDA)) for s in (42, 43, 42)]


@pytest.mark.parametrize(
    "state, reason",
    [
        (PackedStreams(), r"TypeError"),
        (KeepsDevice(), r"inside, the current \(device, stream\) was \(0, "),
        (IgnoresDevice(), r"the stream it saved for device 1 was \(0, 0, 1\), not \(0, 1, 1\)"),
        (NoStreamFunctions(), r"lacks _cuda_getDevice"),
    ],
    ids=["packed-streams", "keeps-device", "ignores-device", "no-functions"],
)
def test_runner_falls_back_to_the_stream_context(state, reason):
    runner, order = _runner_on(state)
    public = runner._cuda
    with pytest.warns(RuntimeWarning, match=rf"did not check out \(.*{reason}.*torch.cuda.stream"):
        first = runner.run(Stream(42, 1), _seen, public, 1)
    assert first == (1, (42, 1, CUDA))
    assert runner.switch is None and runner.fallback_reason
    assert runner.run(Stream(43, 1), _seen, public, 1) == (1, (43, 1, CUDA))  # no second warning
    assert public.stream_context_entries == 2
    assert _seen(public, 1) == (0, (0, 1, CUDA))
    assert order.calls == [(Stream(0, 1), Stream(s, 1), (s, 1, CUDA)) for s in (42, 43)]


# ------------------------------------- the runner's path for a stream call


def _flat_fn(fn, *, mutation_checked: bool = True, compile: str = "eager") -> TorchFn:
    """A TorchFn of ``fn``, one float32 tensor of 8 in and out, called directly."""
    aval = Aval((8,), np.dtype(np.float32))
    return TorchFn.of(
        BaseFn(
            lambda x: (fn(x),),
            name=fn.__name__,
            vmap_method="auto",
            in_avals=(aval,),
            out_avals=(aval,),
            out_names=(f"{fn.__name__}: output",),
            torch_out_dtypes=(torch.float32,),
            mutation_checked=mutation_checked,
            direct=fn,
            direct_single=True,
            compile=compile,
        )
    )


def sin2(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2


class RecordedSwitch:
    """Stands in for ``cuda_streams``: records what a stream call asks of it."""

    def __init__(self) -> None:
        self.switches: list[tuple[int, int]] = []

    def run_on_stream(self, target, fn, *args):
        self.switches.append((target.stream_id, target.device_index))
        return fn(*args)

    def external_stream(self, stream: int, device: int) -> Stream:
        return Stream(stream, device)


class RecordedGraph:
    """Stands in for a ``cuda_graphs.CudaGraphCall``: replays by calling the function."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.lock = contextlib.nullcontext()
        self.streams: list[Stream] = []

    def __call__(self, stream, *inputs):
        self.streams.append(stream)
        return self.fn(*inputs)

    def finished(self, stream) -> None:
        assert stream is self.streams[-1]


@pytest.fixture
def recorded(monkeypatch) -> RecordedSwitch:
    switch = RecordedSwitch()
    monkeypatch.setattr(runtime, "run_on_stream", switch.run_on_stream)
    monkeypatch.setattr(runtime, "external_stream", switch.external_stream)
    return switch


def test_a_stream_call_runs_through_the_switch(recorded):
    x = torch.linspace(-1.0, 1.0, 8)
    out = torch.empty(8)
    runtime.run_into(_flat_fn(sin2), [x], [out], stream=1234)
    assert recorded.switches == [(1234, x.get_device())]
    torch.testing.assert_close(out, torch.sin(x) * 2)


def test_a_cuda_graph_replays_on_xlas_stream(recorded):
    fun = _flat_fn(sin2)
    graph = RecordedGraph(lambda x: (torch.sin(x) * 2,))
    runtime.runner_for(fun).cuda_graph = graph
    x = torch.linspace(-1.0, 1.0, 8)
    out = torch.empty(8)
    runtime.run_into(fun, [x], [out], stream=1234)
    assert graph.streams == [Stream(1234, x.get_device())]
    torch.testing.assert_close(out, torch.sin(x) * 2)


def _add_one(in_place: bool):
    def add_one(x: torch.Tensor) -> torch.Tensor:
        return x.add_(1.0) if in_place else x + 1.0

    return add_one


@pytest.mark.parametrize("in_place", [True, False], ids=["mutating", "pure"])
def test_a_cuda_graph_replays_only_once_a_call_left_the_inputs_alone(recorded, in_place):
    # A replay reads copies of XLA's buffers, so it cannot see a write into
    # them; a mutating function must be refused on every call, as on the CPU.
    fun = _flat_fn(_add_one(in_place), mutation_checked=False)
    graph = RecordedGraph(lambda x: (x + 1.0,))
    runtime.runner_for(fun).cuda_graph = graph
    x = torch.zeros(8)
    for _ in range(3):
        out = torch.empty(8)
        if in_place:
            with pytest.raises(runtime.InputMutationError, match=r"mutated input\(s\) \[0\]"):
                runtime.run_into(fun, [x], [out], stream=1234)
        else:
            runtime.run_into(fun, [x], [out], stream=1234)
            torch.testing.assert_close(out, torch.ones(8))
    torch.testing.assert_close(x, torch.zeros(8))
    # Mutating: never replayed. Pure: the first call checks, the next two replay.
    assert len(graph.streams) == (0 if in_place else 2)


def test_gpu_calls_of_a_compiled_function_trace_once_per_device(recorded, monkeypatch):
    # NOTE [a compiled function on several devices]: a graph traced for one
    # GPU holds that GPU's constants, so a call on another GPU traces its own.
    # Two GPUs stand in here: the runner of a CUDA build (is_available), calls
    # told they run on GPU 0 or 1.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fun = _flat_fn(sin2, compile="graph")
    runner = runtime.runner_for(fun)
    traced: list[str] = []  # the mode of each trace
    artifact_for = graph_mode.artifact_for

    def recording_artifact_for(mode, *args):
        traced.append(mode)
        return artifact_for(mode, *args)

    monkeypatch.setattr(graph_mode, "artifact_for", recording_artifact_for)
    devices = [0, 1, 0, 1, 1]
    said = iter(devices)
    monkeypatch.setattr(runtime, "_call_device", lambda inputs, outputs: next(said))
    for i in range(len(devices)):
        x = torch.linspace(-1.0, 1.0, 8) + i
        out = torch.empty(8)
        runtime.run_into(fun, [x], [out], stream=1234)
        torch.testing.assert_close(out, torch.sin(x) * 2)
    assert recorded.switches == [(1234, d) for d in devices]
    assert sorted(runner.per_device) == [0, 1]
    gpu0, gpu1 = runner.per_device[0], runner.per_device[1]
    assert traced == ["graph", "graph"]  # once per device, at its first call
    # Each device's runner replays its own trace; the CPU's is still untraced.
    assert gpu0.call.__self__ is not runner and gpu0.call.__func__ is not _Runner._first_compiled_call
    assert gpu1.call.__func__ is not _Runner._first_compiled_call
    assert runner.call.__self__ is runner and runner.call.__func__ is _Runner._first_compiled_call
    x = torch.linspace(-1.0, 1.0, 8)
    out = torch.empty(8)
    runtime.run_into(fun, [x], [out])  # a CPU call: traced by this runner itself
    torch.testing.assert_close(out, torch.sin(x) * 2)
    assert len(traced) == 3 and runner.call.__func__ is not _Runner._first_compiled_call


# ------------------------------------------------------------ on a GPU


@cuda_only
def test_gpu_run_on_stream_switches_and_restores():
    device = TORCH_DEVICE.index
    side = torch.cuda.Stream(device=TORCH_DEVICE)
    default = torch.cuda.current_stream(TORCH_DEVICE).cuda_stream
    seen = cuda_streams.run_on_stream(
        cuda_streams.external_stream(side.cuda_stream, device),
        lambda: (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream),
    )
    assert seen == (device, side.cuda_stream)
    assert torch.cuda.current_stream(TORCH_DEVICE).cuda_stream == default
    # The direct switch checked out on this PyTorch: no fallback to the ~20 us context manager.
    assert cuda_streams._runner.fallback_reason is None
    assert cuda_streams._runner.switch is not None


@cuda_only
def test_gpu_calls_leave_the_callers_stream_alone():
    f = jax.jit(t2j_ad.jaxify(lambda x: torch.sin(x) * 2))
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    side = torch.cuda.Stream(device=TORCH_DEVICE)
    with torch.cuda.stream(side):
        assert_tree_allclose(f(x), jnp.sin(x) * 2)
        assert_tree_allclose(jax.grad(lambda x: f(x).sum())(x), jnp.cos(x) * 2)
        assert torch.cuda.current_stream(TORCH_DEVICE).cuda_stream == side.cuda_stream


def _late(value: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``value`` (1024 entries), ready only after 20 large matmuls queued on
    the current stream: a read that is not ordered after it sees old data."""
    b = base
    for _ in range(20):
        b = b @ base * 1e-3
    return b[0, :1024] * 0 + value


@cuda_only
def test_gpu_call_sees_pytorch_work_queued_before_it():
    # NOTE [ordering with the caller's PyTorch stream]: a weight PyTorch
    # updates on its own stream just before the call.
    base = torch.randn(4096, 4096, device=TORCH_DEVICE)
    weight = torch.zeros(1024, device=TORCH_DEVICE)
    f = jax.jit(t2j_ad.jaxify(lambda x: x + weight, output_shapes=jax.ShapeDtypeStruct((1024,), jnp.float32)))
    x = jnp.zeros(1024, jnp.float32)
    jax.block_until_ready(f(x))
    for i in range(1, 4):
        torch.cuda.synchronize()
        weight.copy_(_late(torch.full((1024,), float(i), device=TORCH_DEVICE), base))
        np.testing.assert_array_equal(np.asarray(f(x)), np.full(1024, i, np.float32))


@cuda_only
def test_pytorch_work_queued_after_a_gpu_call_sees_what_it_wrote():
    # NOTE [ordering with the caller's PyTorch stream]: state the function
    # writes, read by PyTorch right after the call, without blocking on JAX.
    base = torch.randn(4096, 4096, device=TORCH_DEVICE)
    state = torch.zeros(1024, device=TORCH_DEVICE)

    def remember(x: torch.Tensor) -> torch.Tensor:
        state.copy_(_late(x, base))
        return x * 2

    f = jax.jit(t2j_ad.jaxify(remember, output_shapes=jax.ShapeDtypeStruct((1024,), jnp.float32)))
    jax.block_until_ready(f(jnp.zeros(1024, jnp.float32)))
    for i in range(1, 4):
        torch.cuda.synchronize()
        f(jnp.full(1024, float(i), jnp.float32))
        assert float((state * 1).sum().item()) == 1024 * i
