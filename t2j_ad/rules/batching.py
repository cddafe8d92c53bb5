"""Batching: torch_call with Vmap appended, in the function's vmap_method.

Unbatched arguments keep ``None`` as their dim and are passed to PyTorch once
(``expand_dims``); the sequential loop, ``broadcast_all`` and the ``auto``
fallback are all implemented on the PyTorch side (transforms.py), so every
method is a single torch_call and a single XLA custom call. Outputs come back
batched at dimension 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..primitive import torch_call
from ..torch_fn import TorchFn, Vmap


def torch_call_batch(
    args: Sequence[Any], dims: Sequence[int | None], *, fun: TorchFn
) -> tuple[list[Any], list[int | None]]:
    if all(d is None for d in dims):
        # JAX does call batching rules with nothing batched (inside jacfwd).
        return torch_call(args, fun), [None] * len(fun.out_avals)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    in_dims = tuple(None if d is None else int(d) for d in dims)
    batched = fun.append(Vmap(in_dims, int(size), fun.base.vmap_method))
    return torch_call(args, batched), [0] * len(fun.out_avals)
