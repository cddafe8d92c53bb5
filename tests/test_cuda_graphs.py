"""CUDA graph replay's ordering between calls (NOTE [CUDA graph replay]),
on CPU stand-ins for streams, events and the captured graph: a call on
another stream than the previous call's waits for that call's record of
the event, a call on the same stream queues no wait, and one event serves
every call; the capture runs on a stream of the call's device; the first call
runs the function once, as every later call's replay does. The replay itself on a GPU is checked by the graph-mode tests
run with T2J_AD_COMPILE=graph (scripts/run_gpu_checks.sh)."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch

from t2j_ad import real_writes, runtime
from t2j_ad.cuda_graphs import CudaGraphCall
from t2j_ad.rules.fallbacks import FallbackWarning
from t2j_ad.torch_fn import Aval, BaseFn, TorchFn


class RecordedEvent:
    """Stands in for ``torch.cuda.Event``: numbers each record."""

    made = 0

    def __init__(self) -> None:
        RecordedEvent.made += 1
        self.records: list[tuple[int, str]] = []

    def record(self, stream: RecordedStream) -> None:
        self.records.append((len(self.records) + 1, stream.name))


class RecordedStream:
    """Stands in for XLA's stream as ``external_stream`` wraps it: records
    which record of an event each wait holds to."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waits: list[tuple[int, str]] = []

    def wait_event(self, event: RecordedEvent) -> None:
        self.waits.append(event.records[-1])


class ReplayOnCpu(CudaGraphCall):
    """Captures nothing: the static buffers as ``_first_call`` makes them,
    the first call's results its own run's, and a "graph" whose replay runs
    the function from the static inputs into the static outputs, as a CUDA
    graph replay does."""

    def _first_call(self, inputs):
        self.static_inputs = [torch.empty_like(t) for t in inputs]
        results = tuple(self.run(*inputs))
        self.static_outputs = tuple(torch.empty_like(out) for out in results)
        call = self

        class Graph:
            def replay(self) -> None:
                for static, out in zip(call.static_outputs, call.run(*call.static_inputs)):
                    static.copy_(out)

        self.graph = Graph()
        return results


def _call(graph: CudaGraphCall, stream: RecordedStream, x: torch.Tensor) -> torch.Tensor:
    """One call as the runner makes it (``Runner._replay_cuda_graph``)."""
    out = torch.empty_like(x)
    with graph.lock:
        (result,) = graph(stream, x)
        out.copy_(result)
        graph.finished(stream)
    return out


def test_replays_wait_only_for_a_previous_call_on_another_stream():
    RecordedEvent.made = 0
    graph = ReplayOnCpu(lambda x: (torch.sin(x) * 2,), "sin2", new_event=RecordedEvent)
    a, b = RecordedStream("a"), RecordedStream("b")
    for i, stream in enumerate((a, a, b, b, a)):
        x = torch.linspace(-1.0, 1.0, 8) + i
        torch.testing.assert_close(_call(graph, stream, x), torch.sin(x) * 2)
    # Calls 1-2 on a, 3-4 on b, 5 on a: the third waits for the second's
    # record (on a), the fifth for the fourth's (on b); no other waits.
    assert a.waits == [(4, "b")]
    assert b.waits == [(2, "a")]
    assert RecordedEvent.made == 1
    assert graph.done.records == [(1, "a"), (2, "a"), (3, "b"), (4, "b"), (5, "a")]


class DeviceStream:
    """Stands in for a ``torch.cuda.Stream``: its device and what it waited for."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.waited: list[DeviceStream] = []

    def wait_stream(self, other: DeviceStream) -> None:
        self.waited.append(other)


def _stub_cuda(monkeypatch, xla: DeviceStream, capturing: list[bool], replays: list[str] | None = None):
    """torch.cuda's streams, graphs and capture as CPU stand-ins: the current
    stream is ``xla``; streams made are returned; each capture is listed
    (its stream and error mode), ``capturing[0]`` is True within it (where a
    real capture runs no kernel), and a replay appends to ``replays``."""
    made: list[DeviceStream] = []
    captures: list[tuple[DeviceStream, str]] = []

    def new_stream(device: str) -> DeviceStream:
        made.append(DeviceStream(device))
        return made[-1]

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        captures.append((stream, capture_error_mode))
        capturing[0] = True
        try:
            yield
        finally:
            capturing[0] = False

    class Graph:
        def replay(self) -> None:
            replays.append("replay")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: xla)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return made, captures


def test_capture_runs_on_a_side_stream_of_the_calls_device(monkeypatch):
    # torch.cuda.graph's own default capture stream lives on whichever device
    # was current when it was first made; capturing another GPU's call there
    # would record none of its kernels.
    xla = DeviceStream("cuda:1")  # the call's (current) stream
    made, captures = _stub_cuda(monkeypatch, xla, [False])
    call = CudaGraphCall(lambda x: (torch.sin(x) * 2,), "sin2", new_event=RecordedEvent)
    x = torch.linspace(-1.0, 1.0, 8)
    (result,) = call(xla, x)
    (side,) = made
    assert side.device == "cuda:1"
    assert captures == [(side, "thread_local")]
    # The first run on the side stream follows XLA's queued work, and XLA's stream follows it.
    assert side.waited == [xla] and xla.waited == [side]
    torch.testing.assert_close(result, torch.sin(x) * 2)
    torch.testing.assert_close(call.static_inputs[0], x)


def test_the_first_call_runs_the_function_once_and_later_calls_replay_once(monkeypatch):
    # The warm-up before the capture was a run of its own, and the first
    # call's results came from a replay after it: a function that updates
    # state or draws ran twice in that call (an H200: a batch-norm module
    # counted 3 batches after 2 calls).
    xla = DeviceStream("cuda:0")
    capturing, runs = [False], []
    _stub_cuda(monkeypatch, xla, capturing, replays=runs)

    def doubled(x):
        if not capturing[0]:  # a capture records kernels and runs none
            runs.append("run")
        return (x * 2,)

    call = CudaGraphCall(doubled, "doubled", new_event=RecordedEvent)
    x = torch.arange(4.0)
    (result,) = call(xla, x)
    torch.testing.assert_close(result, x * 2)
    assert runs == ["run"]
    assert call(xla, x + 1) is call.static_outputs
    assert runs == ["run", "replay"]


def test_a_first_run_that_raises_raises_and_a_later_call_captures(monkeypatch):
    # NOTE [CUDA graph replay]: the first call's run is the call, so its
    # error is the call's; nothing is captured, and a later call that works
    # captures. It was given up as a failed capture, with a warning.
    xla = DeviceStream("cuda:0")
    _, captures = _stub_cuda(monkeypatch, xla, [False])

    def refuses_negatives(x):
        if bool((x < 0).any()):
            raise ValueError("negative")
        return (x * 2,)

    call = CudaGraphCall(refuses_negatives, "refuses_negatives", new_event=RecordedEvent)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with pytest.raises(ValueError, match="negative"):
            call(xla, -torch.ones(2))
        assert not call.failed and call.graph is None and captures == []
        (result,) = call(xla, torch.ones(2))
    torch.testing.assert_close(result, torch.full((2,), 2.0))
    assert call.graph is not None and len(captures) == 1


def _cholesky_call(counted: list[int], capturing: list[bool]) -> TorchFn:
    """A TorchFn of a Cholesky factor's sum, a 2 x 2 float32 matrix in,
    counting its runs outside captures (as a batch norm counts batches)."""

    def cholesky_sum(a: torch.Tensor) -> torch.Tensor:
        if not capturing[0]:
            counted.append(1)
        return torch.linalg.cholesky(a).sum()

    return TorchFn.of(
        BaseFn(
            lambda a: (cholesky_sum(a),),
            name="cholesky_sum",
            vmap_method="auto",
            in_avals=(Aval((2, 2), np.dtype(np.float32)),),
            out_avals=(Aval((), np.dtype(np.float32)),),
            out_names=("cholesky_sum: output",),
            torch_out_dtypes=(torch.float32,),
            mutation_checked=True,
            direct=cholesky_sum,
            direct_single=True,
        )
    )


def _runner_with_a_cuda_graph(monkeypatch):
    """The runner of ``_cholesky_call`` on CPU stand-ins for CUDA (XLA's
    stream current, the call run on it), holding a ``CudaGraphCall``; with
    its runs outside captures counted, the captures and the replays listed."""
    xla = DeviceStream("cuda:0")
    capturing, replays = [False], []
    _, captures = _stub_cuda(monkeypatch, xla, capturing, replays=replays)
    target = RecordedStream("xla")  # XLA's stream as the runner wraps it
    monkeypatch.setattr(runtime, "external_stream", lambda stream, device: target)
    monkeypatch.setattr(runtime, "run_on_stream", lambda target, fn, *args: fn(*args))
    counted: list[int] = []
    fun = _cholesky_call(counted, capturing)
    runner = runtime.runner_for(fun)
    runner.cuda_graph = CudaGraphCall(runner.impl, "cholesky_sum", new_event=RecordedEvent)
    return fun, runner, counted, captures, replays


def test_a_first_call_that_raises_on_its_inputs_runs_once_and_keeps_its_cuda_graph(monkeypatch):
    # The runner ran the function a second time to raise the first call's
    # error, so what it updates (a batch norm's statistics) or draws was
    # updated or drawn twice in that call; and the CUDA graph was given up
    # for good, with a warning blaming the capture for the inputs' error.
    fun, runner, counted, captures, replays = _runner_with_a_cuda_graph(monkeypatch)
    good = torch.eye(2) * 4.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with pytest.raises(runtime.TorchCallError, match="cholesky_sum raised .*not positive-definite"):
            runtime.run_into(fun, [-good], [torch.empty(())], stream=1234)
        assert counted == [1]  # as eager PyTorch runs it: once
        out = torch.empty(())
        for _ in range(2):
            runtime.run_into(fun, [good], [out], stream=1234)
            torch.testing.assert_close(out, torch.linalg.cholesky(good).sum())
    assert counted == [1, 1] and len(captures) == 1 and replays == ["replay"]


def test_a_cuda_graph_whose_held_tensor_moved_is_no_longer_replayed():
    # NOTE [the layouts a graph assumed]: the capture fixed w's address;
    # after w.data = ... a replay would read the memory w no longer owns, so
    # the call runs the aten graph instead.
    w = torch.ones(3)
    call = ReplayOnCpu(lambda x: (x * w,), "f", new_event=RecordedEvent, held=[w])
    stream = RecordedStream("xla")
    x = torch.arange(3.0)
    assert torch.equal(call(stream, x)[0], x)  # the first call's own run
    call.finished(stream)
    w.add_(1.0)  # in place: the same memory, replayed
    assert torch.equal(call(stream, x)[0], 2 * x)
    call.finished(stream)
    w.data = torch.full((3,), 5.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert call(stream, x) is None
        assert call(stream, x) is None  # once given up, for good, warned once
    messages = [str(r.message) for r in record if issubclass(r.category, FallbackWarning)]
    assert len(messages) == 1 and "moved to other memory" in messages[0]


def test_a_call_inside_a_trial_run_neither_captures_nor_replays_its_cuda_graph(monkeypatch):
    # NOTE [no CUDA graph inside a trial run]: a trial run watches the call's
    # ops to put back what it writes and to tell its caller what it drew; a
    # capture fills the generator's tensors and a replay runs no op through
    # PyTorch (an H100: a graph-mode function called inside another's shape
    # inference "wrote differently" on zeros than on ones, and a BatchNorm
    # replayed in trial runs counted 5 steps in 2).
    fun, runner, counted, captures, replays = _runner_with_a_cuda_graph(monkeypatch)
    good = torch.eye(2) * 4.0
    expected = torch.linalg.cholesky(good).sum()

    def call() -> torch.Tensor:
        out = torch.empty(())
        runtime.run_into(fun, [good], [out], stream=1234)
        return out

    with real_writes.trial_run():
        torch.testing.assert_close(call(), expected)
    assert captures == [] and replays == [] and counted == [1]  # the aten graph ran, in the run's sight
    for _ in range(2):  # real calls: the first captures, the second replays
        torch.testing.assert_close(call(), expected)
    assert len(captures) == 1 and replays == ["replay"] and counted == [1, 1]
    with real_writes.trial_run():
        torch.testing.assert_close(call(), expected)
    assert len(captures) == 1 and replays == ["replay"] and counted == [1, 1, 1]


def test_a_call_inside_a_module_calls_bindings_does_not_replay_its_cuda_graph(monkeypatch):
    # NOTE [a graph inside a module call's bindings]: inside a jaxify_module
    # call that has bound its tensors in a module the function runs, the
    # call runs on the tensors bound now; a CUDA graph replays what its
    # capture held (an H100: a graph-mode part of the module, called first
    # on its own, gave 1.67 inside the module's calls where PyTorch gives 2.29).
    fun, runner, counted, captures, replays = _runner_with_a_cuda_graph(monkeypatch)
    good = torch.eye(2) * 4.0
    out = torch.empty(())
    for _ in range(2):  # captured, then replayed
        runtime.run_into(fun, [good], [out], stream=1234)
    assert len(captures) == 1 and replays == ["replay"] and counted == [1]
    # As a call made inside such a module call finds it (the runner's own look).
    monkeypatch.setitem(runtime.bound_now, (0, 0), [])
    monkeypatch.setattr(runner, "_runs_a_bound_module", lambda: True)
    eager_runs: list[int] = []

    def eagerly_inside_bindings(inputs, outputs, stream):  # the runner's eager run, counted
        eager_runs.append(stream)
        outputs[0].copy_(fun.base.direct(*inputs))

    monkeypatch.setattr(runner, "_eagerly_inside_bindings", eagerly_inside_bindings)
    runtime.run_into(fun, [good], [out], stream=1234)
    torch.testing.assert_close(out, torch.linalg.cholesky(good).sum())
    assert replays == ["replay"] and eager_runs == [0] and counted == [1, 1]
