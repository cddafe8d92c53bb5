"""Batching: torch_call with Vmap appended, in the function's vmap_method.

Unbatched arguments keep ``None`` as their dim and are passed to PyTorch once
(``expand_dims``); the sequential loop, ``broadcast_all`` and the ``auto``
fallback are all implemented on the PyTorch side (transforms.py), so every
method is a single torch_call and a single XLA custom call. Batched arguments
go in with their batch axis first (NOTE [each example laid out as an
unbatched input]). Outputs come back batched at dimension 0.

NOTE [each example laid out as an unbatched input]
An unbatched call hands PyTorch XLA's row-major buffers: contiguous
tensors, which PyTorch code may assume (``x.view(-1)``,
``x.view(x.size(0), -1)``, windows by ``as_strided`` with row-major
strides). JAX batches an argument along whichever axis its producer left
the batch on (``in_axes=1``; ``W @ a`` under ``jax.vmap`` has it last), and
``torch.vmap(in_dims=1)``, or the loop's ``select(1, i)``, shows each example
as a strided view of that buffer: ``view`` failed ("view size is not
compatible with input tensor's size and stride") where the unbatched call
worked, and ``as_strided`` read other examples' entries, silently. So each
batched argument is moved to axis 0 first, in JAX (a transpose XLA may fuse
into its producer), and every ``Vmap`` maps axis 0: each example is then a
contiguous slice of a row-major buffer, as an unbatched call's input is.
That costs a copy of each argument JAX batched elsewhere than axis 0 (a
4 MB float32 one, about 0.4 ms on a 2-core VM); axis 0 costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from ..primitive import torch_call
from ..torch_fn import TorchFn, Vmap


def torch_call_batch(
    args: Sequence[Any], dims: Sequence[int | None], *, fun: TorchFn
) -> tuple[list[Any], list[int | None]]:
    if all(d is None for d in dims):
        # JAX does call batching rules with nothing batched (inside jacfwd).
        return torch_call(args, fun), [None] * len(fun.out_avals)
    # NOTE [each example laid out as an unbatched input]
    args = [a if d is None or d == 0 else jnp.moveaxis(a, int(d), 0) for a, d in zip(args, dims)]
    size = next(a.shape[0] for a, d in zip(args, dims) if d is not None)
    in_dims = tuple(None if d is None else 0 for d in dims)
    batched = fun.append(Vmap(in_dims, int(size), fun.base.vmap_method))
    return torch_call(args, batched), [0] * len(fun.out_avals)
