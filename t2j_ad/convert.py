"""dtype tables and zero-copy conversion between torch tensors and JAX arrays."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

# The dtypes t2j_ad carries across the boundary. Anything else is refused with
# an error rather than silently cast (DESIGN.md, "Contract for bad input").
_PAIRS = [
    (jnp.float16, torch.float16),
    (jnp.bfloat16, torch.bfloat16),
    (jnp.float32, torch.float32),
    (jnp.float64, torch.float64),
    (jnp.int8, torch.int8),
    (jnp.int16, torch.int16),
    (jnp.int32, torch.int32),
    (jnp.int64, torch.int64),
    (jnp.uint8, torch.uint8),
    (jnp.bool_, torch.bool),
    (jnp.complex64, torch.complex64),
    (jnp.complex128, torch.complex128),
]
_J2T: dict[np.dtype, torch.dtype] = {np.dtype(j): t for j, t in _PAIRS}
_T2J: dict[torch.dtype, np.dtype] = {t: np.dtype(j) for j, t in _PAIRS}

SUPPORTED = ", ".join(sorted(d.name for d in _J2T))


class UnsupportedDtypeError(TypeError):
    pass


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype for a NumPy/JAX dtype; refuses unsupported ones."""
    try:
        return _J2T[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise UnsupportedDtypeError(
            f"dtype {dtype} cannot cross into PyTorch; supported dtypes: {SUPPORTED}."
        ) from None


def jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy/JAX dtype for a torch dtype; refuses unsupported ones."""
    try:
        return _T2J[dtype]
    except KeyError:
        raise UnsupportedDtypeError(
            f"torch dtype {dtype} cannot cross into JAX; supported dtypes: {SUPPORTED}."
        ) from None


def canonical_jax_dtype(dtype: np.dtype) -> np.dtype:
    """What JAX itself makes of ``dtype`` (64-bit -> 32-bit when x64 is off)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def j2t(x: Any) -> torch.Tensor:
    """A torch tensor sharing memory with the JAX array ``x`` (via DLPack)."""
    x = jnp.asarray(x)
    torch_dtype(x.dtype)  # refuse unsupported dtypes with our message
    return torch.from_dlpack(x)


def t2j(t: torch.Tensor) -> jax.Array:
    """A JAX array sharing memory with ``t`` where DLPack allows it.

    Tensors that need grad are detached; non-contiguous ones are made
    contiguous first (JAX arrays are dense), which copies.
    """
    jax_dtype(t.dtype)
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return jax.dlpack.from_dlpack(t)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def tree_t2j(tree: Any) -> Any:
    """Every torch tensor in ``tree`` as a JAX array; other leaves unchanged.

    Zero-copy through DLPack: the array shares the tensor's memory (and its
    device), so the tensor must not be written to afterwards.
    """
    return jax.tree_util.tree_map(lambda x: t2j(x) if _is_tensor(x) else x, tree, is_leaf=_is_tensor)


def tree_j2t(tree: Any) -> Any:
    """Every JAX array in ``tree`` as a torch tensor; other leaves unchanged.

    Zero-copy through DLPack: the tensor shares the array's memory (and its
    device); JAX arrays are immutable, so do not write into the tensor.
    """
    return jax.tree_util.tree_map(lambda x: j2t(x) if isinstance(x, jax.Array) else x, tree)
