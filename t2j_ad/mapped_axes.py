"""The axis a TorchFn maps elementwise, through its transforms.

A call whose last transform is ``Vmap`` maps that batch axis; a function
declared batch-mapped (``jaxify(..., batch_argnums=...)``) maps the leading
axis of those inputs and of every output, carried through the transforms
above it (NOTE [partitioning torch_call] in rules/partitioning.py). The
partitioner splits a call along it, and under a mesh's Explicit axes the
call's result types are sharded along it (NOTE [results on Explicit axes]
in primitive.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .torch_fn import Jvp, TorchFn, Vjp, Vmap


@dataclasses.dataclass(frozen=True)
class BatchMap:
    """The mapped axis of each input and output of a TorchFn.

    ``in_dims[i]``: the axis of input i (None: shared, replicated).
    ``out_dims[j]``: the axis of output j (None: summed over the mapped axis).
    """

    in_dims: tuple[int | None, ...]
    out_dims: tuple[int | None, ...]
    size: int


def _through(t: Any, in_dims: tuple[int | None, ...], out_dims: tuple[int | None, ...]):
    """The mapped axes after transform ``t`` (see NOTE [partitioning torch_call])."""
    if isinstance(t, Jvp):
        return in_dims + tuple(in_dims[i] for i in t.wrt), tuple(out_dims[j] for j in t.out)
    if isinstance(t, Vjp):
        return in_dims + tuple(out_dims[j] for j in t.out), tuple(in_dims[i] for i in t.wrt)
    # Vmap inserts its own axis: at v in a vmapped input, at 0 in every output.
    ins = tuple(d if d is None or v is None or v > d else d + 1 for d, v in zip(in_dims, t.in_dims))
    return ins, tuple(None if d is None else d + 1 for d in out_dims)


def batch_map(fun: TorchFn) -> BatchMap | None:
    """The axis ``fun`` maps elementwise, or None when it has none."""
    if fun.transforms and isinstance(fun.transforms[-1], Vmap):
        v = fun.transforms[-1]
        return BatchMap(v.in_dims, (0,) * len(fun.out_avals), v.axis_size)
    base = fun.base
    if base.batch_in_dims is None:
        return None
    in_dims: tuple[int | None, ...] = base.batch_in_dims
    out_dims: tuple[int | None, ...] = (0,) * len(base.out_avals)
    for t in fun.transforms:
        in_dims, out_dims = _through(t, in_dims, out_dims)
    return BatchMap(in_dims, out_dims, base.out_avals[0].shape[0])
