"""Running PyTorch on XLA's CUDA stream, as cheaply as the call allows, and
ordered with the stream PyTorch itself was using.

The CUDA handler passes XLA's stream pointer and the runner must make it
PyTorch's current stream for the call and its copies (NOTE [one build for
CPU and GPU] in csrc/torch_call.cc), then put back what was current before.

NOTE [switching to XLA's stream]
Measured on an H100 (jax 0.11, torch 2.11), a jitted ``torch.sin(x) * 2`` on 8
floats cost 221 us, of which wrapping the pointer in a new
``torch.cuda.ExternalStream`` took 10 us and entering and leaving
``torch.cuda.stream(...)`` 19 us: that context manager looks the device up
through ``_lazy_init``, builds Python ``Stream`` objects for the streams it
saves, and compares their devices, all in Python, twice per call.

So the wrapper is made once per (stream, device) (``external_stream``), and
the switch makes the same moves as ``torch.cuda.StreamContext`` with the C
functions that context manager ends in: read the current device; save that
device's current stream and, when the call runs on another device, that
device's too; set XLA's stream (PyTorch makes its device current with it);
and afterwards set the saved streams back, the call's device first and the
thread's own device last, which makes that device current again.

Those functions are PyTorch internals (``torch._C._cuda_getDevice``,
``_cuda_getCurrentStream``, ``_cuda_setStream``). The first switch in the
process therefore checks them against the public API on a no-op: the stream
the switch saved for the call's device must be the one current there (the
ordering below takes the caller's stream from it); inside, the current
stream and device must be XLA's; afterwards, the thread's device and both
devices' streams must be what they were. If a function is missing,
takes other arguments, or any check fails, every call uses
``torch.cuda.stream`` instead, with one warning, and stays correct.

NOTE [ordering with the caller's PyTorch stream]
XLA's stream and the stream PyTorch was using before the call (the current
stream of the call's device on the thread that runs it: for a jitted call,
the caller's, by default PyTorch's default stream) are different streams, and
XLA creates its streams non-blocking, so nothing orders one after the other.
PyTorch state outside the call's arguments then races: a weight or buffer
updated by PyTorch just before the call could be read by the function before
the update lands, and a tensor the function writes could be read by PyTorch
work queued after the call before the write lands. So each call is ordered
both ways, with two CUDA events per thread and device (``StreamOrder``):
before the function runs, XLA's stream waits for what the caller's stream
has queued so far; after it, the caller's stream waits for what XLA's stream
has queued so far, the function's work included. Both waits are on the
device, queued without blocking the host. torch2jax's own suite checks the
same two orders (its ``test_cuda_stream.py``).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# XLA's CUDA stream of each device, wrapped once: a new ExternalStream per
# call cost about 10 us on an H100. Keyed by the device too, so a stream is
# never labelled with another GPU's index (the current device of the calling
# thread need not be the call's).
_external_streams: dict[tuple[int, int], Any] = {}

# CUDA events recorded and waited on by the C methods that torch.cuda.Event's
# record and wait end in: each Python wrapper (and Stream.wait_event, which
# calls Event.wait) cost about a microsecond on an H100's host, four per call.
# A build without CUDA has a placeholder base class: the wrappers then.
_event_base = getattr(torch._C, "_CudaEventBase", None)
_record_event = getattr(_event_base, "record", torch.cuda.Event.record)  # (event, stream)
_wait_event = getattr(_event_base, "wait", torch.cuda.Event.wait)  # (event, stream): stream waits for event


def external_stream(stream: int, device: int) -> Any:
    """``torch.cuda.ExternalStream`` for XLA's stream pointer on GPU ``device``."""
    wrapped = _external_streams.get((stream, device))
    if wrapped is None:
        wrapped = _external_streams.setdefault((stream, device), torch.cuda.ExternalStream(stream, device=device))
    return wrapped


class DirectSwitch:
    """The three C functions ``torch.cuda.StreamContext`` ends in, called
    directly (NOTE [switching to XLA's stream])."""

    __slots__ = ("get_device", "get_stream", "set_stream")

    def __init__(self, cuda: Any) -> None:
        """``cuda``: the object holding the functions (``torch._C``)."""
        self.get_device = cuda._cuda_getDevice
        self.get_stream = cuda._cuda_getCurrentStream  # device -> (stream_id, device_index, device_type)
        self.set_stream = cuda._cuda_setStream  # (stream_id, device_index, device_type)

    def run(self, ids: tuple[int, int, int], fn: Callable[..., T], *args: Any) -> T:
        """``fn(was_current, *args)`` with the stream ``ids`` current, where
        ``was_current`` is the stream (as ids) that was current on ``ids``'
        device before; the streams and the device current before are current
        again afterwards."""
        here = self.get_device()
        saved_here = self.get_stream(here)
        saved_there = self.get_stream(ids[1]) if ids[1] != here else None
        self.set_stream(*ids)
        try:
            return fn(saved_here if saved_there is None else saved_there, *args)
        finally:
            if saved_there is not None:
                self.set_stream(*saved_there)
            self.set_stream(*saved_here)


def _stream_ids(stream: Any) -> tuple[int, int, int]:
    return (stream.stream_id, stream.device_index, stream.device_type)


def check_direct_switch(switch: DirectSwitch, target: Any, cuda: Any = torch.cuda) -> str | None:
    """Why ``switch`` does not switch to ``target`` (a stream of ``cuda``) the
    way ``cuda.stream`` does, checked on a no-op through ``cuda``'s public
    functions; None when it does. After a failed check, the device and
    streams current before are set back through the public functions."""
    device = target.device_index
    here = cuda.current_device()
    # The call's device first, the thread's own last: setting a stream makes
    # its device current.
    saved = [cuda.current_stream(d) for d in dict.fromkeys((device, here))]
    expected = (device, target.cuda_stream)
    try:
        was_current, inside = switch.run(
            _stream_ids(target),
            lambda was_current: (was_current, (cuda.current_device(), cuda.current_stream(device).cuda_stream)),
        )
        after = (cuda.current_device(), [cuda.current_stream(s.device_index).cuda_stream for s in saved])
        before = (here, [s.cuda_stream for s in saved])
        if was_current != _stream_ids(saved[0]):
            reason = f"the stream it saved for device {device} was {was_current}, not {_stream_ids(saved[0])}"
        elif inside != expected:
            reason = f"inside, the current (device, stream) was {inside}, not {expected}"
        elif after != before:
            reason = f"afterwards, the device and streams were {after}, not {before}"
        else:
            return None
    except Exception as err:  # noqa: BLE001 - any failure means: use cuda.stream
        reason = f"{type(err).__name__}: {err}"
    for stream in saved:
        cuda.set_stream(stream)
    cuda.set_device(here)
    return reason


class StreamOrder:
    """Orders a call on XLA's stream with the caller's PyTorch stream, both
    ways (NOTE [ordering with the caller's PyTorch stream])."""

    def __init__(self) -> None:
        self._local = threading.local()  # .events: device -> (before, after)
        self._streams: dict[tuple[int, int, int], Any] = {}

    def stream(self, ids: tuple[int, int, int]) -> Any:
        """The ``torch.cuda.Stream`` with ``ids`` (stream_id, device_index,
        device_type), made once."""
        found = self._streams.get(ids)
        if found is None:
            found = self._streams.setdefault(
                ids, torch.cuda.Stream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])
            )
        return found

    def _events(self, device: int) -> tuple[Any, Any]:
        # Per thread: two threads recording one event would each wait on the
        # other's stream. Per device: an event records on its own device only.
        events = getattr(self._local, "events", None)
        if events is None:
            events = self._local.events = {}
        pair = events.get(device)
        if pair is None:
            pair = events[device] = (torch.cuda.Event(), torch.cuda.Event())
        return pair

    def run(self, caller: Any, target: Any, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (which queues work on ``target``, the current stream)
        after ``caller``'s queued work, and ``caller`` after it."""
        before, after = self._events(target.device_index)
        _record_event(before, caller)
        _wait_event(before, target)
        try:
            return fn(*args)
        finally:
            _record_event(after, target)
            _wait_event(after, caller)


class StreamRunner:
    """Runs calls on XLA's stream, ordered with the caller's PyTorch stream:
    by ``DirectSwitch`` once it has passed ``check_direct_switch``, else by
    ``cuda.stream``."""

    def __init__(self, cuda_c: Any = None, cuda: Any = torch.cuda, order: StreamOrder | None = None) -> None:
        self._cuda_c = cuda_c  # None: torch._C, looked up at the first call
        self._cuda = cuda
        self._order = StreamOrder() if order is None else order
        self._lock = threading.Lock()
        self._checked = False
        self.switch: DirectSwitch | None = None  # set once the check passed
        self.fallback_reason: str | None = None

    def _check(self, target: Any) -> None:
        with self._lock:
            if self._checked:
                return
            try:
                switch = DirectSwitch(torch._C if self._cuda_c is None else self._cuda_c)
            except AttributeError as err:
                reason: str | None = f"PyTorch {torch.__version__} lacks {err.name or err}"
            else:
                reason = check_direct_switch(switch, target, self._cuda)
            if reason is None:
                self.switch = switch
            else:
                self.fallback_reason = reason
                warnings.warn(
                    f"t2j_ad: switching to XLA's CUDA stream through PyTorch's C functions did not "
                    f"check out ({reason}); every GPU call uses torch.cuda.stream(...) instead, which "
                    f"is correct and about 20 us slower per call.",
                    RuntimeWarning,
                    stacklevel=4,
                )
            self._checked = True

    def run(self, target: Any, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` with ``target`` (XLA's stream, wrapped) current."""
        switch = self.switch
        if switch is None and not self._checked:
            self._check(target)
            switch = self.switch
        if switch is not None:
            return switch.run(_stream_ids(target), self._ordered, target, fn, *args)
        caller = self._cuda.current_stream(target.device_index)
        with self._cuda.stream(target):
            return self._order.run(caller, target, fn, *args)

    def _ordered(self, was_current: tuple[int, int, int], target: Any, fn: Callable[..., T], *args: Any) -> T:
        # The caller's stream as the direct switch saved it: no second lookup.
        order = self._order
        return order.run(order.stream(was_current), target, fn, *args)


_runner = StreamRunner()


def run_on_stream(target: Any, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with ``target``, XLA's stream as ``external_stream``
    wraps it, as PyTorch's current stream (NOTE [switching to XLA's stream]),
    ordered both ways with the stream PyTorch had current on its device (NOTE
    [ordering with the caller's PyTorch stream])."""
    return _runner.run(target, fn, *args)
