"""A traced (or compiled) TorchFn captured once as a CUDA graph, replayed on
XLA's stream (NOTE [graph mode] in graph_mode.py).

NOTE [CUDA graph replay]
A CUDA graph fixes the addresses it reads and writes, while XLA hands every
call new buffers. So the graph is captured over static input tensors of its
own (in a private memory pool), and each call copies XLA's inputs into them,
replays the graph, and copies the graph's static outputs into XLA's output
buffers -- all three on the current stream, which the runner has set to
XLA's. The first call runs the function on a side stream of the call's
device, which warms it up for capture (lazy cuBLAS handles, allocator
growth must not happen during capture), and captures it on that stream. That
run is the call itself: its results are the call's, and the capture, which
runs nothing, is first replayed by the next call. A function that draws or
updates state it keeps thus draws and updates once per call (the warm-up
was a run of its own, before a replay made the call: found on an H200, a
batch-norm module counted 3 batches after 2 calls, and a plain call of
dropout left PyTorch's generator two draws on). The runner replays only once a
call has shown that the function leaves its inputs alone: a replay reads
copies, so it could not see a write into XLA's buffers to refuse it.

Where that first run raises, the error is the call's, raised as any call's
(``torch.linalg.cholesky`` of a matrix that is not positive definite, the
inputs' fault): nothing is captured, and the next call runs and captures
again. That run was given up as a capture that failed, with a warning
naming the inputs' error, and the caller ran the function a second time to
raise it, which updated kept state (a batch norm's statistics) or drew a
second time in one call (NOTE [a first run that fails on its inputs] in
graph_mode.py for a trace's first run).

The static buffers are shared by every call of this TorchFn, so the
copy-replay-copy sequence holds a lock, and a call on another stream than
the previous call's first waits for the event that call recorded: the
previous replay's output copy must finish before new inputs overwrite the
static buffers. On the same stream (XLA's compute stream, call after call)
stream order already ensures that, and no wait is queued. The event is made
once and recorded again by each call: a wait queued on a stream holds to the
record before it, whatever is recorded later.
A function that cannot be captured (an op that synchronizes with the host)
keeps running the aten graph itself, without a CUDA graph, with one warning.
So does one whose held tensors (what it closes over) moved to other memory
since the capture (``w.data = w - lr * g``): the capture fixed their old
addresses, and a replay would read memory they no longer own; the aten
graph reads them where they are (NOTE [the layouts a graph assumed]).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .rules.fallbacks import FallbackWarning, first_line

Flat = Callable[..., tuple[torch.Tensor, ...]]

_one_capture = threading.Lock()
_address = torch.Tensor.data_ptr


class CudaGraphCall:
    """``run`` (a graph replay or an inductor kernel) as one CUDA graph."""

    def __init__(
        self,
        run: Flat,
        name: str,
        new_event: Callable[[], Any] = torch.cuda.Event,
        held: Sequence[torch.Tensor] = (),
    ):
        """``new_event``: makes the event that orders calls on different
        streams; ``held``: the tensors ``run`` holds (its constants), whose
        addresses the capture fixes."""
        self.run = run
        self.name = name
        self.held = tuple(held)
        self.addresses: list[int] = []  # the held tensors' at capture
        self.lock = threading.Lock()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed = False
        self.static_inputs: list[torch.Tensor] = []
        self.static_outputs: tuple[torch.Tensor, ...] = ()
        self._new_event = new_event
        self.done: Any = None  # recorded by the previous call ...
        self.done_on: Any = None  # ... on this stream

    def _first_call(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """This call, run on a side stream (the capture's warm-up), then the
        capture; the call's results. Raises what the run itself raises,
        capturing nothing (NOTE [CUDA graph replay])."""
        current = torch.cuda.current_stream()
        static_inputs = [torch.empty_like(t) for t in inputs]
        side = torch.cuda.Stream(device=current.device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                for static, t in zip(static_inputs, inputs):
                    static.copy_(t)
                results = tuple(self.run(*static_inputs))
        finally:
            current.wait_stream(side)  # XLA's later work, and the error's reader, after what it queued
        for r in results:
            if r.is_cuda:
                r.record_stream(current)  # read there, by the copies into XLA's buffers
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: XLA's own threads keep launching work while this
            # one captures; "global" would make their CUDA calls fail
            # meanwhile. stream=side: torch.cuda.graph's default capture
            # stream is made once per process, on the device current then;
            # entering it makes that device current, so another GPU's kernels
            # would run uncaptured and every replay would hand back the
            # capture's outputs.
            # One capture at a time in the process: two threads' first calls
            # capturing at once failed on an H200 ("operation failed due to a
            # previous error during capture").
            with _one_capture, torch.cuda.graph(
                graph, pool=torch.cuda.graph_pool_handle(), stream=side, capture_error_mode="thread_local"
            ):
                outs = self.run(*static_inputs)
        except Exception as err:  # noqa: BLE001 - capture refused: later calls run without it
            self._refused(err)
            return results
        self.static_inputs = static_inputs
        self.static_outputs = tuple(outs)
        self.graph = graph
        return results

    def _refused(self, err: Exception) -> None:
        self._give_up(f"could not be captured as a CUDA graph ({first_line(err)})")

    def _give_up(self, why: str) -> None:
        self.failed = True
        self.graph = None
        warnings.warn(
            f"t2j_ad: the graph of {self.name!r} {why}; it runs as a plain aten graph on XLA's stream instead.",
            FallbackWarning,
            stacklevel=4,
        )

    def __call__(self, stream: torch.cuda.Stream, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """This call's results: a replay's static outputs, or the first
        call's own; None when the function must run without a CUDA graph.
        Raises what a first call's run raises. ``stream`` is the current
        stream, passed in because ``torch.cuda.current_stream()`` costs
        microseconds per call. The caller copies the result while holding
        ``lock`` and then calls ``finished``."""
        if self.failed:
            return None
        if self.graph is None:
            results = self._first_call(inputs)
            self.addresses = list(map(_address, self.held))
            return results
        if self.held and list(map(_address, self.held)) != self.addresses:
            self._give_up(
                "holds a tensor that moved to other memory since its CUDA graph was captured (as `.data =` "
                "moves one), which the capture would read at its old address"
            )
            return None
        if self.done_on is not None and self.done_on is not stream:
            stream.wait_event(self.done)
        for static, t in zip(self.static_inputs, inputs):
            static.copy_(t)
        self.graph.replay()
        return self.static_outputs

    def finished(self, stream: torch.cuda.Stream) -> None:
        """Record that this call's reads of the static outputs are queued on ``stream``."""
        if self.graph is not None:
            if self.done is None:
                self.done = self._new_event()
            self.done.record(stream)
            self.done_on = stream
