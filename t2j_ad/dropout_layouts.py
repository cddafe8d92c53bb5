"""Dropout masks laid out the same way in a value call and its replays.

NOTE [dropout masks follow the layout]
The derivatives of a function that draws replay its value call's draws by
setting PyTorch's generator to the state the value started from (NOTE
[derivatives replay the value's draws] in replayed_calls.py), which gives
the same mask only if both calls turn the same numbers into the mask the
same way. ``dropout`` and ``alpha_dropout`` do not, for an input laid out
other than row-major (``x.t()``, ``x.permute(...)``): a plain
call fills the mask in the input's memory order (``empty_like`` keeps its
strides), while under any ``torch.func`` transform, where every replay
runs, PyTorch decomposes them into ``native_dropout``, whose mask is
row-major. Same numbers, another mask: a gradient of ``dropout(x.t())``
was pulled back through a mask the value never used (torch 2.13). So shape
inference notes whether the function gives such an input to one of them
(``LayoutDependentDraws``), and the keeping and replaying calls of such a
function hand them the input made row-major (``row_major_dropout``), where
both ways lay the mask out alike. Other random ops (``bernoulli_``,
``rand_like``, the feature dropouts, whose masks are made fresh) fill the
same layout in both. On CUDA, an out-of-place ``dropout`` runs
``native_dropout``'s fused kernel both ways, on the input as laid out, and
is left alone: made row-major, it drew another mask than PyTorch's own call
(an H200, torch 2.11); the in-place one and ``alpha_dropout`` draw by the
layout there as on the CPU. Only those calls pay for the torch-function mode this
takes (every op goes through Python, a few microseconds each, in eager
mode; a graph replays the ops it recorded).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# The dropouts whose CPU kernel lays the mask out by the input's strides,
# and their in-place forms: functional (``inplace`` argument) and aten.
_FUNCTIONAL = {F.dropout, F.alpha_dropout}
_IN_PLACE = {torch.dropout_, torch.alpha_dropout_}
_ALL = _FUNCTIONAL | _IN_PLACE | {torch.dropout, torch.alpha_dropout}


def _input_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("input")


def _in_place(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func in _FUNCTIONAL:  # (input, p, training, inplace), or inplace= by keyword
        rest = args[1:] if args else ()
        return bool(rest[2]) if len(rest) >= 3 else bool(kwargs.get("inplace", False))
    return func in _IN_PLACE


def _not_row_major(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func not in _ALL:
        return False
    x = _input_of(args, kwargs)
    if not isinstance(x, torch.Tensor) or x.is_contiguous():
        return False
    # On CUDA, an out-of-place dropout runs native_dropout's fused kernel,
    # plainly and under torch.func alike, on the input as it is laid out.
    return not (x.device.type == "cuda" and func in _CUDA_FUSED and not _in_place(func, args, kwargs))


# The dropouts that run native_dropout's fused kernel on CUDA out of place.
_CUDA_FUSED = {F.dropout, torch.dropout}


class LayoutDependentDraws(TorchFunctionMode):
    """Within the block, notes (``seen``) whether a dropout whose mask
    follows the input's layout was given an input not laid out row-major
    (NOTE [dropout masks follow the layout])."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if _not_row_major(func, args, kwargs):
            self.seen = True
        return func(*args, **kwargs)


class _RowMajorDropout(TorchFunctionMode):
    """Within the block, those dropouts get their input row-major; an
    in-place one computes on a row-major copy and writes the result back."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        if not _not_row_major(func, args, kwargs):
            return func(*args, **kwargs)
        x = _input_of(args, kwargs)
        row_major = x.contiguous()
        if args:
            args = (row_major,) + tuple(args[1:])
        else:
            kwargs["input"] = row_major
        result = func(*args, **kwargs)
        if not _in_place(func, args, kwargs):
            return result
        x.copy_(row_major)  # in place on the row-major copy, which holds the result
        return x


def row_major_dropout() -> TorchFunctionMode:
    """A context within which ``dropout`` and ``alpha_dropout`` draw their
    mask in row-major order whatever the input's layout, as they do under
    ``torch.func`` transforms (NOTE [dropout masks follow the layout])."""
    return _RowMajorDropout()
