"""dtype tables and zero-copy conversion between torch tensors and JAX arrays."""

from __future__ import annotations

import warnings

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .jax_in_traces import note_jax_inside
from .kept_inputs import note_callers_view

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
    # PyTorch's wider unsigned dtypes carry values across (copies, views,
    # comparisons), though few PyTorch ops compute on them.
    (jnp.uint16, torch.uint16),
    (jnp.uint32, torch.uint32),
    (jnp.uint64, torch.uint64),
    (jnp.bool_, torch.bool),
    (jnp.complex64, torch.complex64),
    (jnp.complex128, torch.complex128),
    # The float8 formats both sides have. They carry values across; few
    # PyTorch ops compute on them (cast with .float() inside the function).
    (jnp.float8_e4m3fn, torch.float8_e4m3fn),
    (jnp.float8_e4m3fnuz, torch.float8_e4m3fnuz),
    (jnp.float8_e5m2, torch.float8_e5m2),
    (jnp.float8_e5m2fnuz, torch.float8_e5m2fnuz),
    (jnp.float8_e8m0fnu, torch.float8_e8m0fnu),
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


class ArrayConversionError(RuntimeError, TypeError):
    """A JAX value with no single buffer to share with PyTorch.

    A ``RuntimeError`` (what torch2jax raises for it) and a ``TypeError``
    (what JAX raises for a tracer used as an array), so code written for
    either catches it.
    """


def on_another_device(function: str, output: str, device: torch.device, call_device: torch.device) -> str:
    """The error for an output of ``function`` on ``device`` in a call on
    ``call_device``: value calls and reverse passes refuse it alike."""
    return (
        f"{function}: {output} is on device {device}, but this call runs on {call_device} "
        f"(where its inputs and XLA's output buffers are). t2j_ad does not move results "
        f"between devices behind your back: make the tensor on the inputs' device "
        f"(torch.zeros(..., device=x.device), or .to(x.device))."
    )


def _refuse_float0(x: Any) -> None:
    """Refuse JAX's float0, which ``jnp.asarray`` cannot even hold."""
    if getattr(x, "dtype", None) == jax.dtypes.float0:
        raise UnsupportedDtypeError(
            "j2t: x has dtype float0, the dtype of the gradient of an integer input (jax.grad(..., allow_int=True)), "
            "which holds no numbers to share with PyTorch; leave such leaves out, or pass "
            "jnp.zeros(x.shape, the input's dtype) for them."
        )


def single_device(x: Any) -> tuple[jax.Array, jax.Device]:
    """``x`` as a JAX array, and the one device it lives on.

    Raises:
        ArrayConversionError: ``x`` is a tracer (inside ``jax.jit``, ``grad``
            or ``vmap`` it holds no numbers) or lives on several devices.
    """
    x = jnp.asarray(x)
    try:
        devices = x.devices()
    except jax.errors.ConcretizationTypeError:
        raise ArrayConversionError(
            "j2t: x is a traced value (inside jax.jit, jax.grad or jax.vmap), which holds no numbers "
            "to share with PyTorch. Convert concrete arrays outside the transform, or wrap the PyTorch "
            "code with t2j_ad.jaxify to run it inside."
        ) from None
    if len(devices) != 1:
        raise ArrayConversionError(
            f"j2t: x is split or replicated over {len(devices)} devices, and a torch tensor lives on one. "
            f"Convert its shards one by one ([j2t(s.data) for s in x.addressable_shards]) or move it to "
            f"one device first (jax.device_put(x, jax.devices()[0]))."
        )
    (device,) = devices
    return x, device


def default_device() -> jax.Device:
    """JAX's default device as it stands here: what ``jax.default_device(...)``
    or ``jax_default_device`` set (a device, or a platform name), else the
    first device of the default backend."""
    chosen = jax.config.jax_default_device
    if isinstance(chosen, jax.Device):
        return chosen
    return jax.devices(chosen)[0] if chosen else jax.devices()[0]


def call_device(arrays: Sequence[Any]) -> jax.Device:
    """The device a call on ``arrays`` runs on: the first concrete array's
    (the lowest id, for one over several devices); JAX's default device when
    every array is traced (under ``jax.jit``, ``grad`` or ``vmap``), which is
    where jit puts a computation on uncommitted arrays."""
    for a in arrays:
        try:
            devices = a.devices()
        except jax.errors.ConcretizationTypeError:  # a tracer holds no device
            continue
        return min(devices, key=lambda d: d.id)
    return default_device()


def torch_device(device: jax.Device) -> torch.device:
    """The torch device for a (local) JAX device: ``cuda:<n>`` or ``cpu``."""
    if device.platform == "gpu":
        return torch.device("cuda", device.local_hardware_id)
    return torch.device("cpu")


def jax_device(device: torch.device) -> jax.Device:
    """The local JAX device for a torch device, as ``torch_device`` maps them:
    the GPU whose ``local_hardware_id`` is the CUDA index (not a position in
    ``jax.local_devices()``, which may hold only some GPUs), else JAX's CPU.

    Raises:
        ValueError: JAX has no local GPU with that CUDA index.
    """
    if device.type != "cuda":
        return jax.local_devices(backend="cpu")[0]
    index = device.index if device.index is not None else torch.cuda.current_device()
    gpus = jax.local_devices(backend="gpu")
    for candidate in gpus:
        if candidate.local_hardware_id == index:
            return candidate
    raise ValueError(
        f"torch device {device} has no JAX device: JAX's local GPUs have CUDA indices "
        f"{[d.local_hardware_id for d in gpus]}. Move the tensor to one of those (.to('cuda:N')), "
        f"or let JAX see that GPU (CUDA_VISIBLE_DEVICES, jax.distributed.initialize(local_device_ids=...))."
    )


def j2t(x: Any) -> torch.Tensor:
    """A torch tensor sharing memory with the JAX array ``x`` (via DLPack),
    on ``x``'s device.

    Raises:
        ArrayConversionError: as ``single_device``.
        UnsupportedDtypeError: ``x``'s dtype has no torch counterpart.
    """
    _refuse_float0(x)
    x, device = single_device(x)
    torch_dtype(x.dtype)  # refuse unsupported dtypes with our message
    note_jax_inside("converts a JAX array to a tensor (t2j_ad.tree_j2t)")  # NOTE [JAX inside a trace]
    if device.platform != "cpu":
        x.block_until_ready()  # NOTE [a failed computation read through DLPack]
    return note_callers_view(torch.from_dlpack(x))  # NOTE [the caller's own views] in kept_inputs.py


# NOTE [a failed computation read through DLPack]
# On a GPU, JAX hands back a call's arrays before the computation has run
# on the device, and a computation that failed (a PyTorch function that
# raised inside a jaxified call) reports its error through those arrays:
# reading one with NumPy or ``block_until_ready`` raises it. ``torch.from_dlpack``
# on a GPU array does neither: JAX only makes PyTorch's stream wait for the
# buffer, and the error is never raised, so PyTorch went on with a buffer
# nothing had written. A jaxified function called inside another's PyTorch
# code (``tree_j2t(inner(x))``), refused there (it read a tensor the outer
# derivative differentiates: NOTE [a call inside torch.func transforms] in
# runtime.py), so returned garbage and the outer call no error, where the
# CPU, whose DLPack export waits for the array, raised the refusal (an H100
# run at jax 0.11.2, torch 2.11). So ``j2t`` waits for a GPU array before it
# shares it, which raises the computation's error as reading it in JAX
# would. The cost is the wait: PyTorch's work on the tensor no longer
# overlaps the computation that makes it. On the CPU the export waits
# already.


def copy_to_torch(x: Any) -> torch.Tensor:
    """A torch tensor holding a copy of the JAX array ``x``, made through
    host memory, on the torch device matching ``x``'s (raises as ``j2t``)."""
    _refuse_float0(x)
    x, device = single_device(x)
    dtype = torch_dtype(x.dtype)
    note_jax_inside("copies a JAX array to a tensor (t2j_ad.compat's j2t)")  # NOTE [JAX inside a trace]
    value = np.array(x)
    if _numpy_lacks(dtype):
        host = torch.from_numpy(value.view(_SAME_WIDTH_INT[dtype.itemsize][0])).view(dtype)
    else:
        host = torch.from_numpy(value)
    return host.to(torch_device(device))


# The integer type of each width, NumPy's and torch's: the bits of a floating
# type NumPy lacks cross between them as these (_numpy_lacks).
_SAME_WIDTH_INT = {1: (np.uint8, torch.uint8), 2: (np.int16, torch.int16)}


def _numpy_lacks(dtype: torch.dtype) -> bool:
    """Whether NumPy lacks ``dtype``: bfloat16 and the float8 formats, which
    JAX takes from ml_dtypes (bit-compatible with torch's) and which
    ``Tensor.numpy`` and ``torch.from_numpy`` refuse."""
    return dtype == torch.bfloat16 or (dtype.is_floating_point and dtype.itemsize == 1)


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
    if t.is_cuda:
        # PyTorch exports a CUDA tensor only while its device is the current one.
        with torch.cuda.device(t.device):
            return jax.dlpack.from_dlpack(t)
    return jax.dlpack.from_dlpack(t)


def copy_to_jax(t: torch.Tensor, device: Any = None) -> jax.Array:
    """A JAX array holding a copy of ``t``, placed by ``jax.device_put`` on
    ``device`` (a ``jax.Device`` or ``Sharding``; JAX's default device when
    None).

    The copy goes through host memory, so it needs no JAX backend for ``t``'s
    own device (a CPU module's parameters reach a GPU-only JAX).
    """
    jax_dtype(t.dtype)
    host = t.detach().resolve_conj().resolve_neg().to("cpu", copy=True).contiguous()
    if _numpy_lacks(host.dtype):
        value = host.view(_SAME_WIDTH_INT[host.dtype.itemsize][1]).numpy().view(jax_dtype(host.dtype))
    else:
        value = host.numpy()
    return jax.device_put(value, device)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


_WIDE = (torch.float64, torch.int64, torch.uint64, torch.complex128)


def tree_t2j(tree: Any) -> Any:
    """Every torch tensor in ``tree`` as a JAX array; other leaves unchanged.

    Zero-copy through DLPack: each array shares its tensor's memory and stays
    on its device, so the tensor must not be written to afterwards. With
    ``jax_enable_x64`` off, a 64-bit tensor is copied into 32 bits, as JAX
    takes 64-bit values in that mode, with a ``UserWarning`` naming the leaf.
    """

    narrowed = []

    def convert(path: Any, x: Any) -> Any:
        if not _is_tensor(x):
            return x
        if x.dtype in _WIDE and not jax.config.jax_enable_x64:
            narrowed.append(f"tree{jax.tree_util.keystr(path)} ({x.dtype})")
        return t2j(x)

    converted = jax.tree_util.tree_map_with_path(convert, tree, is_leaf=_is_tensor)
    if narrowed:
        warnings.warn(
            f"t2j_ad.tree_t2j: {', '.join(narrowed)} holds 64-bit values, but jax_enable_x64 is off, so "
            f"JAX gets them in 32 bits (a copy; values beyond 32 bits change: 2**40 becomes 0 as int32). "
            f"Enable x64 (jax.config.update('jax_enable_x64', True)) to keep 64 bits.",
            UserWarning,
            stacklevel=2,
        )
    return converted


def tree_j2t(tree: Any) -> Any:
    """Every JAX array in ``tree`` as a torch tensor; other leaves unchanged.

    Zero-copy through DLPack: each tensor shares its array's memory and stays
    on its device; JAX arrays are immutable, so do not write into the tensor.
    Raises ``ArrayConversionError`` for a tracer or a multi-device array.
    """
    return jax.tree_util.tree_map(lambda x: j2t(x) if isinstance(x, jax.Array) else x, tree)
