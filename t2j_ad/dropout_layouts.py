"""Dropout masks laid out the same way in a value call and its replays.

NOTE [dropout masks follow the layout]
The derivatives of a function that draws replay its value call's draws by
setting PyTorch's generator to the state the value started from (NOTE
[derivatives replay the value's draws] in replayed_calls.py), which gives
the same mask only if both calls turn the same numbers into the mask the
same way. ``dropout`` and ``alpha_dropout`` do not, for an input laid out
other than row-major (``x.t()``, ``x.permute(...)``) on the CPU: a plain
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
same layout in both. Only those calls pay for the torch-function mode this
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
_OUT_OF_PLACE = {torch.dropout_: torch.dropout, torch.alpha_dropout_: torch.alpha_dropout}
_ALL = _FUNCTIONAL | set(_OUT_OF_PLACE) | set(_OUT_OF_PLACE.values())


def _input_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("input")


def _not_row_major(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func not in _ALL:
        return False
    x = _input_of(args, kwargs)
    return isinstance(x, torch.Tensor) and not x.is_contiguous()


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
        rest = args[1:] if args else ()
        kwargs.pop("input", None)
        if func in _FUNCTIONAL:
            in_place = bool(kwargs.pop("inplace", False))
            if len(rest) >= 3:  # (p, training, inplace) positionally
                in_place, rest = bool(rest[2]), rest[:2]
            result = func(x.contiguous(), *rest, **kwargs)
        else:
            in_place = func in _OUT_OF_PLACE
            result = _OUT_OF_PLACE.get(func, func)(x.contiguous(), *rest, **kwargs)
        if not in_place:
            return result
        x.copy_(result)
        return x


def row_major_dropout() -> TorchFunctionMode:
    """A context within which ``dropout`` and ``alpha_dropout`` draw their
    mask in row-major order whatever the input's layout, as they do under
    ``torch.func`` transforms (NOTE [dropout masks follow the layout])."""
    return _RowMajorDropout()
