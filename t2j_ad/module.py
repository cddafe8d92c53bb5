"""``jaxify_module``: a ``torch.nn.Module`` as ``apply(params, *args)``.

NOTE [a module's devices]
A module's parameters become JAX arrays that the user owns: they are copied
through host memory and placed by ``jax.device_put`` on ``device=`` (JAX's
default device when not given), so a module built on the CPU serves a GPU-only
JAX (``JAX_PLATFORMS=cuda``, where JAX has no CPU backend to take a CPU tensor
by DLPack), and its parameters land where the inputs will be. The buffers
(``BatchNorm`` statistics, masks, tables) stay torch tensors, passed as
constants; each call uses them on the device the call runs on, copied there
once per device and copied again only after the module changed them in place
(their ``_version`` moved) or replaced them (NOTE [buffers replaced after
jaxify_module]), and bound in the module for the length of the
call (NOTE [binding tensors into a module]). The copy for the parameters'
device is made when the module is jaxified: a graph-mode trace there then finds real tensors to
take in as constants (its own copies would be fake tensors, and the graph
would copy the buffers on every replay). A call runs where its arrays are, so
one module serves CPU and GPU calls alike.

NOTE [binding tensors into a module]
A call runs the module on the parameters JAX passes (and on copies of its
buffers, on another device) by binding them into the module object for the
length of the call, and binding the module's own back after. Each module's
own tensors are bound once: ``_TensorSlots`` lists every (module, name)
holding a parameter or buffer, each module once however many names it has,
with the name ``named_parameters()`` gives the tensor (a tied weight has
one), found in the module as it is at each call (a submodule replaced
after ``jaxify_module`` runs on ``params`` too). The walk that finds them
(191 us for 81 modules) is made again only when the module changed since
the last call: each call reads every module's parameter, buffer and child
tables (the tables themselves, their names and what they hold, compared by
identity; 49 us for 81 modules), which sees a change made through any path,
``setattr``, ``del`` or a table written directly. torch.func.functional_call
bound the tensors of a submodule shared by two parents once per name, and
its second swap saved the first one's tensor as "the module's": the module
was left holding a call's input (a view of an XLA buffer) or a trace's fake
tensor for good.

NOTE [one module, many threads]
A call runs a module on the parameters it is given by binding them into
the module object for the length of the call. XLA calls
one jaxify'd module from several threads at once (one per device in a
sharded jit, and any user threads): two calls inside the module together
would each run on the other's parameters, and each one's gradient with
respect to its own parameters would silently come out zero. So the swap and
the forward it wraps hold one lock per module object, shared by every
``jaxify_module`` of it (``module_locks.lock_of``: two wrappers of one module, called
from two threads, ran each other's parameters and left a plain tensor where
the module's Parameter was), and also the lock of every submodule it binds
tensors into: two modules that share one (an actor and a critic on one
encoder), called by one ``jax.jit`` whose independent custom calls XLA's
CPU runtime ran at once, put back each other's tensors, and the encoder was
left holding a plain tensor, one call's parameter, for good. The locks are
taken in one global order (by the locks' ids), so two calls never wait on
each other; a module whose submodules change between calls takes the
locks it has then (``_holding_locks``), and no other (NOTE [calls made
inside a module's forward]). The backward, which runs on the
recorded graph after the call, holds none. Graph mode traces the forward once (under the
same lock) and never swaps again. A function that closes over the module
(``jaxify(lambda x: model(x))``) takes no lock in its calls: on another
thread while a ``jaxify_module`` call has swapped, it runs on that call's
parameters. Its trial runs take the locks (NOTE [trial runs wait for module
calls] in real_writes.py).

NOTE [calls made inside a module's forward]
A module's forward may call another jaxify'd function (a PyTorch model that
calls JAX), which takes the trial-run lock: for its trial run on a new
shape, or to hold off trial runs while it updates state (NOTE [one trial run
at a time] in real_writes.py). Taken there, it comes after the module's
locks, which the call already holds, while a trial run of a function that
closes over the module takes the trial-run lock and then the module's (NOTE
[trial runs wait for module calls]): a module call on one thread and such a
first call on another each waited for the other, for good, every run. The
trial run therefore waits for a busy module lock without holding the
trial-run lock (NOTE [waiting for a lock without the trial-run lock] in
module_locks.py), and the module call takes only its module's locks. Taking
the trial-run lock before them, in every eager call (a forward cannot say
beforehand whether it will nest), ended that deadlock too, but made a
nested call that the forward waits for on another thread (an ``apply`` run
by ``jax.pmap`` on XLA's device threads, or by a thread pool) wait for the
lock the forward's own thread held, for good. Letting the module's locks go
around the inner call instead would let another call bind its tensors, or
another trial run see this call's, in the middle of this forward.

NOTE [PyTorch's inference fast path]
``nn.MultiheadAttention`` and the ``nn.Transformer*`` layers take a fused
kernel (``_native_multi_head_attention``, nested tensors for a padding mask)
when nothing needs a gradient. A call binds the module to parameters that
do not require grad, so a plain call took it where the same module in
PyTorch, its parameters requiring grad, does not; and a derivative took it
or not by transform. The value came out another function than its
gradient's: zeros at padded positions in a plain call, PyTorch's values
under ``jax.value_and_grad``; and ``jax.hessian`` of an eval-mode attention
failed, the fused kernel having no forward-mode derivative. So a module's
calls run with the fast path off (``torch.backends.mha``), as the module
runs in PyTorch when it trains; graph mode's traces did so already. The
switch is process-wide: it is off while any module call runs, and set back
to what it was when the last one ends, so PyTorch code on another thread
meanwhile computes without the fast path too (the same values, save the
positions a padding mask hides). A function that closes over such a
layer holds it off too (NOTE [the attention fast path in a function's
calls] in attention_fast_path.py).
"""

from __future__ import annotations

import contextlib
import operator
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import torch

from .api import JaxifiedFunction, check_batch_argnums
from .attention_fast_path import HOLDS_IT, fast_path_off
from .convert import call_device, copy_to_jax, jax_dtype, torch_device, torch_dtype
from .module_modes import refuse_uninitialized
from .module_structure import ModuleChangedError
from .held_bindings import binding_in, place_for_release, release_after_the_call
from .module_locks import acquire, in_lock_order, release
from .parametrization_caches import own_parametrization_cache
from .real_writes import forwards_end_here
from .recurrent_cudnn import cudnn_off


def _warn_narrowed_params_beside_wide_buffers(module: torch.nn.Module, params: Mapping[str, Any]) -> None:
    """With jax_enable_x64 off, a float64 module's parameters became float32
    JAX arrays, while its float64 buffers (BatchNorm's running statistics)
    stay as they are: PyTorch then refuses every call that mixes them
    ("expected scalar type Float but found Double"), naming neither x64 nor
    the buffers. Said here, once, by name."""
    narrowed = [n for n, p in module.named_parameters() if p.dtype in _WIDE and params[n].dtype != jax_dtype(p.dtype)]
    wide = [n for n, b in module.named_buffers() if b.dtype in _WIDE]
    if narrowed and wide:
        warnings.warn(
            f"t2j_ad: jaxify_module({type(module).__name__}): jax_enable_x64 is off, so its 64-bit parameters "
            f"({', '.join(narrowed[:3])}{', ...' if len(narrowed) > 3 else ''}) are 32-bit JAX arrays, as JAX "
            f"holds 64-bit values in this mode, while its 64-bit buffers ({', '.join(wide[:3])}"
            f"{', ...' if len(wide) > 3 else ''}) stay 64-bit, and PyTorch refuses ops that mix the two. "
            f"Enable x64 (jax.config.update('jax_enable_x64', True)) or call module.float() first.",
            UserWarning,
            stacklevel=3,
        )


_WIDE = (torch.float64, torch.complex128)


class _BuffersByDevice:
    """A module's buffers on each device calls run on (NOTE [a module's devices]).

    NOTE [buffers replaced after jaxify_module]
    The buffers a call copies to its device are those the module holds at
    the call (``_TensorSlots.home_buffers``, taken by the walk of the
    module's tables, made again under the module's locks whenever a table
    changed: NOTE [binding tensors into a module]), not those it held when
    ``jaxify_module`` ran: a buffer replaced since (``m.scale =
    torch.full(...)``, ``load_state_dict(assign=True)``, ``module.double()``)
    was copied from the old tensor on every call off the module's device,
    and shape inference (on the ``meta`` device) ran on the old tensor's
    shape and dtype: the call failed with a mismatch whose advice
    (``t2j_ad.clear_caches()``) did not help, and on a GPU a CPU module's
    replaced statistics would have been read stale, silently. A copy is
    kept per device with the tensors it was made from (by identity, so a
    replaced buffer is copied afresh) and their versions (so one written in
    place is too)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.copies: dict[torch.device, tuple[tuple[torch.Tensor, ...], tuple[int, ...], dict[str, torch.Tensor]]] = {}

    def on(self, device: torch.device | None, home: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``home`` (the module's buffers now), or copies of them on ``device``."""
        if device is None or all(b.device == device for b in home.values()):
            return home
        sources = tuple(home.values())
        versions = tuple(b._version for b in sources)
        with self.lock:
            cached = self.copies.get(device)
            if (
                cached is not None
                and cached[1] == versions
                and len(cached[0]) == len(sources)
                and all(map(operator.is_, cached[0], sources))
            ):
                return cached[2]
            moved = {name: b.to(device) for name, b in home.items()}
            # Only real tensors are kept: a trace (fake or meta tensors) gets
            # its own copies, which must not leak into later calls.
            if device.type != "meta" and all(type(b) is torch.Tensor for b in moved.values()):
                self.copies[device] = (sources, versions, moved)
            return moved


class _TensorSlots:
    """Where a module holds each parameter and buffer (NOTE [binding tensors
    into a module]): (table, name, the key ``named_parameters()`` or
    ``named_buffers()`` gives the tensor), each module once."""

    def __init__(self, module: torch.nn.Module) -> None:
        keys: dict[int, str] = {}
        for key, tensor in [*module.named_parameters(), *module.named_buffers()]:
            keys.setdefault(id(tensor), key)
        self.params: list[tuple[dict[str, Any], str, str]] = []
        self.buffers: list[tuple[dict[str, Any], str, str]] = []
        # The module's own buffers as the walk found them, by key (NOTE
        # [buffers replaced after jaxify_module]).
        self.home_buffers: dict[str, torch.Tensor] = {}
        self.modules = [sub for _, sub in module.named_modules()]  # each once
        self.module_ids = frozenset(map(id, self.modules))  # NOTE [a graph inside a module call's bindings]
        for sub in self.modules:
            for name, held in sub._parameters.items():
                if held is not None:
                    self.params.append((sub._parameters, name, keys[id(held)]))
            for name, held in sub._buffers.items():
                if held is not None:
                    self.buffers.append((sub._buffers, name, keys[id(held)]))
                    self.home_buffers[keys[id(held)]] = held


def _tables_held(modules: list[torch.nn.Module]) -> list[Any]:
    """Each module's parameter, buffer and child tables, each followed by its
    names and what it holds: the same objects in the same order only while
    no table was replaced, added to, taken from or written to."""
    held: list[Any] = []
    for sub in modules:
        for table in (sub._parameters, sub._buffers, sub._modules):
            held.append(table)
            held.extend(table.keys())
            held.extend(table.values())
    return held


class _SlotsNow:
    """A module's ``_TensorSlots``, walked again only after the module changed
    (NOTE [binding tensors into a module])."""

    def __init__(self, module: torch.nn.Module, param_keys: Sequence[str]) -> None:
        self._module = module
        self._param_keys = tuple(param_keys)
        # How many calls have their tensors bound into the module now: more
        # than one where a call runs inside another's bindings (the loop of
        # a vmap fallback inside a derivative's call, NOTE [bindings held
        # through the reverse pass]).
        self.binding = 0
        self._walk()

    def _walk(self) -> None:
        self.slots = _TensorSlots(self._module)
        self._held = _tables_held(self.slots.modules)
        # NOTE [one module, many threads]: the module's own lock and those of
        # the submodules it binds tensors into, in one global order.
        holding = [self._module] + [m for m in self.slots.modules if m._parameters or m._buffers]
        self.locks = in_lock_order(holding)
        # The params keys no parameter of the module answers to any more (a
        # parameter renamed after jaxify_module, as prune and parametrize
        # do): their arrays would be bound nowhere, silently.
        bound = {key for _, _, key in self.slots.params}
        self.unbound = [key for key in self._param_keys if key not in bound]
        # Recurrent modules keep a list of their weights (``_flat_weights``),
        # which a call's tensors, bound into their tables, would stay in.
        self.recurrent = [m for m in self.slots.modules if isinstance(m, torch.nn.RNNBase)]

    def now(self) -> _TensorSlots:
        if self.binding:
            # The tables hold a call's tensors, not the module's: the walk
            # stands, and a walk now would keep those tensors, XLA's
            # buffers, past their call (NOTE [inputs kept past a call]).
            return self.slots
        held = _tables_held(self.slots.modules)
        if len(held) != len(self._held) or not all(map(operator.is_, held, self._held)):
            self._walk()
        return self.slots


@contextlib.contextmanager
def _holding_locks(slots_now: _SlotsNow) -> Iterator[_TensorSlots]:
    """Within the block, the module's locks are held (NOTE [one module, many
    threads]); yields its slots as they are now."""
    while True:
        locks = slots_now.locks
        acquire(locks)
        try:
            slots = slots_now.now()  # rewalked under the module's own lock, if it changed
        except BaseException:
            release(locks)
            raise
        if slots_now.locks == locks:
            break
        release(locks)  # a submodule came or went: take the locks it has now
    try:
        yield slots
    finally:
        release(locks)


@contextlib.contextmanager
def _binding(slots_now: _SlotsNow) -> Iterator[None]:
    """Within the block, ``slots_now`` counts one more call binding its
    tensors into the module (under the module's locks)."""
    slots_now.binding += 1
    try:
        yield
    finally:
        slots_now.binding -= 1


def _weight_lists_renewed(recurrent: Sequence[torch.nn.Module]) -> None:
    """Point each recurrent module's weight list (which its forward renews
    from its tables, and ``flatten_parameters`` reads) at its own weights
    again, not at those of the call that just ended: XLA's buffers, freed or
    reused after it (NOTE [inputs kept past a call] in kept_inputs.py).
    With cuDNN off, whose flatten would copy the weights into a new buffer
    after every call (NOTE [recurrent modules without cuDNN])."""
    if not recurrent:
        return
    with cudnn_off():
        for module in recurrent:
            renew = getattr(module, "_update_flat_weights", None)  # private, as long as torch.nn.RNNBase has had it
            if renew is not None:
                renew()


def _unbound_params_error(module: torch.nn.Module, unbound: Sequence[str]) -> ModuleChangedError:
    now = [key for key, _ in module.named_parameters()]
    return ModuleChangedError(
        f"jaxify_module({type(module).__name__}): {', '.join(f'params[{k!r}]' for k in unbound)} names no "
        f"parameter of the module as it is now ({', '.join(now[:6])}{', ...' if len(now) > 6 else ''}): its "
        f"parameters were renamed or removed after jaxify_module (torch.nn.utils.prune and parametrize "
        f"rename weight to weight_orig / parametrizations.weight.original), so that array would be used "
        f"nowhere. Call jaxify_module again for the module as it is now."
    )


@contextlib.contextmanager
def _bound(
    slots: list[tuple[dict[str, Any], str, str]], tensors: Mapping[str, torch.Tensor] | None
) -> Iterator[None]:
    """Within the block, each slot whose key ``tensors`` has holds
    ``tensors[key]``; what it held is put back after (nothing is bound when
    ``tensors`` is None)."""
    if tensors is None:
        yield
        return
    held: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for table, name, key in slots:
            if key not in tensors:
                continue  # added after jaxify_module: it runs on its own, as functional_call left it
            held.append((table, name, table[name]))
            table[name] = tensors[key]
        yield
    finally:
        for table, name, tensor in reversed(held):
            table[name] = tensor


def _call_device(params: Mapping[str, torch.Tensor], args: Any, kwargs: Any) -> torch.device | None:
    """The device a call runs on: its first tensor's."""
    for t in params.values():
        return t.device
    for leaf in jax.tree_util.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return None


def _first_device(arrays: Any, device: Any) -> jax.Device:
    """The (first) device the parameters are on, or would be."""
    if isinstance(device, jax.sharding.Sharding):
        return min(device.device_set, key=lambda d: d.id)
    if isinstance(device, jax.Device):
        return device
    return call_device(list(arrays))  # on JAX's default device, as device_put(x, None) puts them


def _check_device(device: Any) -> None:
    if device is None or isinstance(device, (jax.Device, jax.sharding.Sharding)):
        return
    raise TypeError(
        f"jaxify_module: device must be a jax.Device (e.g. jax.devices('gpu')[0]) or a "
        f"jax.sharding.Sharding (e.g. NamedSharding(mesh, P()) to replicate the parameters), "
        f"got {type(device).__name__} {device!r}."
    )


def _note_recast_params(
    err: Exception, params: Mapping[str, torch.Tensor], given: Mapping[str, torch.dtype], module: torch.nn.Module
) -> None:
    """Name, on ``err`` (a failure inside the module), the entries of
    ``params`` whose dtype is not the one jaxify_module gave them: PyTorch
    then fails with a dtype mismatch that names no parameter (a float16 bias
    in a float32 Linear: "self and mat2 must have the same dtype"). Where
    every entry was cast alike, the buffers left in another dtype are named
    instead (``BatchNorm``'s running statistics)."""
    recast = {k: t.dtype for k, t in params.items() if k in given and t.dtype != given[k]}
    if not recast:
        return
    if len(recast) == len(given) and len(set(recast.values())) == 1:
        dtype = next(iter(recast.values()))
        left = {name: b.dtype for name, b in module.named_buffers() if b.is_floating_point() and b.dtype != dtype}
        if left:
            others = sorted({str(jax_dtype(d)) for d in left.values()})
            err.add_note(
                f"every params entry is {jax_dtype(dtype)}, but the module's buffers {', '.join(list(left)[:6])}"
                f"{', ...' if len(left) > 6 else ''} are {', '.join(others)}: jaxify_module passes buffers as "
                f"the module holds them. Call module.to({dtype}) before jaxify_module to compute in "
                f"{jax_dtype(dtype)}."
            )
            return
    named = [f"params[{k!r}] is {jax_dtype(d)} where jaxify_module gave {jax_dtype(given[k])}" for k, d in recast.items()]
    err.add_note(
        f"{'; '.join(named)}. PyTorch computes with the dtypes it is given: cast every parameter and "
        f"the inputs alike, or pass those entries in the dtypes jaxify_module gave them."
    )


def _dtypes_held(module: torch.nn.Module) -> dict[str, torch.dtype]:
    """The dtype of each buffer of ``module``, by name. Not its parameters:
    inside a call they are the ``params`` bound (float64 ``params`` for a
    float32 module were named as the module cast to float64, which it was
    not), and a cast that reached only them fails no call."""
    return {name: t.dtype for name, t in module.named_buffers()}


def _note_module_recast(err: Exception, module: torch.nn.Module, wrapped: Mapping[str, torch.dtype]) -> None:
    """Name, on ``err`` (a failure inside the module), the buffers cast
    since ``jaxify_module`` (``wrapped``: their dtypes then):
    ``module.double()`` after it left float32 ``params`` beside float64
    buffers, and PyTorch failed with "expected scalar type Float but found
    Double", which names neither the cast nor the fix."""
    now = _dtypes_held(module)
    cast = [
        f"{name} {str(wrapped[name]).removeprefix('torch.')} -> {str(d).removeprefix('torch.')}"
        for name, d in now.items()
        if wrapped.get(name, d) != d
    ]
    if not cast:
        return
    err.add_note(
        f"jaxify_module({type(module).__name__}): the module was cast after jaxify_module wrapped it "
        f"({', '.join(cast[:4])}{', ...' if len(cast) > 4 else ''}): each call binds the params it is given and "
        f"passes the buffers as the module holds them now. Call jaxify_module again for the module as it is now "
        f"(and use the params it returns), or cast the module back."
    )


def _check_params(params: Any, expected: Mapping[str, jax.Array]) -> None:
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params is a {type(params).__name__}; expected the dict of "
            f"{len(expected)} parameters returned by jaxify_module (name -> array)."
        )
    missing = [k for k in expected if k not in params]
    extra = [k for k in params if k not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append("missing " + ", ".join(f"params[{k!r}]" for k in missing))
        if extra:
            parts.append("unexpected " + ", ".join(f"params[{k!r}]" for k in extra))
        raise TypeError(
            f"params does not match the module's parameters: {'; '.join(parts)}. "
            f"Pass the dict returned by jaxify_module (or one with the same keys)."
        )
    for k, ref in expected.items():
        value = params[k]
        shape = getattr(value, "shape", None)
        if shape is None:
            raise TypeError(f"params[{k!r}] is a {type(value).__name__}; expected an array of shape {ref.shape}.")
        if tuple(shape) != tuple(ref.shape):
            raise TypeError(f"params[{k!r}] has shape {tuple(shape)}; the module's parameter has shape {tuple(ref.shape)}.")


def jaxify_module(
    module: torch.nn.Module,
    *,
    vmap_method: str = "auto",
    batch_argnums: int | tuple[int, ...] | None = None,
    compile: str | None = None,
    device: jax.Device | jax.sharding.Sharding | None = None,
    output_shapes: Any = None,
) -> tuple[ModuleApply, dict[str, jax.Array]]:
    """``apply, params`` for a ``torch.nn.Module``.

    ``params`` maps each name of ``module.named_parameters()`` to a JAX array
    (a copy, so later in-place training of the module does not change it).
    ``apply(params, *args, **kwargs)`` runs the module with ``params`` bound
    in it, and its buffers as constants, so JAX
    can differentiate with respect to ``params``. Each call runs on the device
    of its arrays, the buffers copied there (NOTE [a module's devices]).
    Attention layers run as when the module trains in PyTorch, off the
    fused inference fast path of ``torch.backends.mha``, so a plain call
    computes what its derivatives differentiate (NOTE [PyTorch's inference
    fast path]).

    Args:
        module: the PyTorch module, on any device.
        vmap_method: as in ``jaxify``.
        batch_argnums: as in ``jaxify``, counting the arguments after
            ``params`` (``batch_argnums=0``: the first input is a batch the
            forward maps row by row).
        compile: as in ``jaxify``.
        device: where ``params`` are placed: a ``jax.Device`` or a
            ``jax.sharding.Sharding``; JAX's default device when None.
        output_shapes: as in ``jaxify``: a pytree of ``jax.ShapeDtypeStruct``
            the forward returns, for a module that cannot run on stand-in
            inputs (``pack_padded_sequence`` refuses lengths of zero).

    Returns:
        ``(apply, params)``: a JAX function of ``(params, *args, **kwargs)``
        and the dict of the module's parameters as JAX arrays. ``apply``
        pickles as the module and these options (all but ``device``), made
        again by ``jaxify_module`` when loaded (NOTE [pickling apply]).

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``, ``device`` is
            not a JAX device or sharding, or ``batch_argnums`` is not a
            non-negative int or a tuple of them; later, from ``apply``:
            ``params`` lacks a parameter, has an extra one, or one of another
            shape (the message names it).
        ValueError: a parameter or buffer is on the ``meta`` device, or
            ``vmap_method`` or ``compile`` is not one ``jaxify`` takes.
        UninitializedModuleError: a lazy submodule (``nn.LazyLinear``) has
            not made its parameters yet (a ``ValueError``; run the module
            once first).
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"jaxify_module: module must be a torch.nn.Module, got {type(module).__name__}.")
    _check_device(device)
    for sub in module.modules():
        refuse_uninitialized(sub)  # before PyTorch's own error from reading its parameters
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_meta:
            raise ValueError(
                f"jaxify_module({type(module).__name__}): {name} is on the meta device, which holds no "
                f"values to hand JAX. Materialize the module first: module.to_empty(device='cpu') and "
                f"initialize it (or load a state_dict), then wrap it."
            )
    params = {name: copy_to_jax(p, device) for name, p in module.named_parameters()}
    _warn_narrowed_params_beside_wide_buffers(module, params)
    buffers = _BuffersByDevice()
    slots_now = _SlotsNow(module, list(params))  # read and rewalked under the module's locks
    # NOTE [a module's devices]: copied now to where the parameters went.
    buffers.on(torch_device(_first_device(params.values(), device)), slots_now.slots.home_buffers)

    def forward(params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        # The module as it is now, as functional_call found it. NOTE [one module, many threads]
        with contextlib.ExitStack() as held:
            slots = held.enter_context(_holding_locks(slots_now))
            # NOTE [buffers replaced after jaxify_module]
            home = slots.home_buffers
            on_device = buffers.on(_call_device(params, args, kwargs), home)
            # On their own device the module runs on its buffers as they are, so a
            # forward that binds a new buffer keeps it, as in PyTorch; elsewhere on
            # copies. NOTE [binding tensors into a module]
            copies = None if on_device is home else on_device
            # PyTorch's attention fast path, off within the block (NOTE
            # [PyTorch's inference fast path]); blocks on several threads nest.
            held.enter_context(fast_path_off)
            if slots_now.unbound:
                raise _unbound_params_error(module, slots_now.unbound)
            place = place_for_release()  # NOTE [a nested call's bindings are its own]
            try:
                held.enter_context(_binding(slots_now))
                held.enter_context(binding_in(slots.module_ids))  # NOTE [a graph inside a module call's bindings]
                held.callback(_weight_lists_renewed, slots_now.recurrent)  # once the module's own are back
                held.enter_context(_bound(slots.params, params))
                held.enter_context(_bound(slots.buffers, copies))
                # NOTE [a module call's own parametrization cache]
                with forwards_end_here(), own_parametrization_cache(slots.module_ids):
                    out = module(*args, **kwargs)
            except Exception as err:
                _note_recast_params(err, params, given_dtypes, module)
                _note_module_recast(err, module, wrapped_dtypes)
                raise
            # NOTE [bindings held through the reverse pass]: a derivative call
            # releases them when it ends; anything else, now.
            release = held.pop_all().close
            if not release_after_the_call(release, place):
                release()
            return out

    forward.__qualname__ = f"{type(module).__name__}.forward"
    setattr(forward, HOLDS_IT, True)  # no second hold around it (attention_fast_path.py)
    nums = check_batch_argnums(batch_argnums)
    shifted = None if nums is None else tuple(i + 1 for i in nums)  # params come first
    jaxified = JaxifiedFunction(
        forward, vmap_method, output_shapes, batch_argnums=shifted, compile=compile, params_first=True
    )

    given_dtypes = {name: torch_dtype(p.dtype) for name, p in params.items()}
    wrapped_dtypes = _dtypes_held(module)  # to name a cast made after this (_note_module_recast)
    made_by = _ApplyOptions(vmap_method, nums, jaxified.compile, output_shapes)
    return ModuleApply(module, jaxified, dict(params), made_by, forward.__qualname__), params


# NOTE [pickling apply]
# ``apply`` was a closure over the module, its buffers' copies and the locks
# of its calls: pickle refused it by name (its qualified name,
# ``Sequential.forward``, names nothing in t2j_ad.module) and cloudpickle
# on a lock ("cannot pickle '_thread.lock' object"), while a jaxify'd
# function pickles as what makes it. So ``apply`` is an object that pickles
# as the module and ``jaxify_module``'s options, and is made again from them
# by ``jaxify_module`` when loaded: its caches start empty, as a jaxify'd
# function's do, and it runs a copy of the module, as anything pickled with
# its module does. ``device=`` is left out (a ``jax.Device`` does not
# pickle): it placed the ``params`` the loaded apply is not given, so its
# module's buffers are copied ahead to JAX's default device, and to any
# other by the first call there (NOTE [a module's devices]).
# ``copy.deepcopy`` gives ``apply`` itself, as for Python functions and a
# jaxify'd function.


class _ApplyOptions(NamedTuple):
    """The options of ``jaxify_module`` an ``apply`` is made again with
    (NOTE [pickling apply]); ``batch_argnums`` as the user counts them,
    ``compile`` resolved."""

    vmap_method: str
    batch_argnums: tuple[int, ...] | None
    compile: str
    output_shapes: Any


class ModuleApply:
    """``apply(params, *args, **kwargs)`` of ``jaxify_module``: the module
    with ``params`` bound in (``apply.jaxified``: the jaxify'd function of
    ``(params, *args, **kwargs)``). Pickles as its module and options (NOTE
    [pickling apply])."""

    def __init__(
        self,
        module: torch.nn.Module,
        jaxified: JaxifiedFunction,
        reference: dict[str, jax.Array],
        made_by: _ApplyOptions,
        qualname: str,
    ) -> None:
        self.jaxified = jaxified
        self.compile_stats = jaxified.compile_stats
        self._reference = reference  # the params' shapes, to check each call's against
        self._module = module
        self._made_by = made_by
        self.__name__ = "apply"
        self.__qualname__ = qualname

    def __call__(self, params: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        _check_params(params, self._reference)
        return self.jaxified(dict(params), *args, **kwargs)

    def __repr__(self) -> str:
        return f"<jaxify_module apply of {self.__qualname__}>"

    def __deepcopy__(self, memo: dict[int, Any]) -> ModuleApply:
        return self  # NOTE [pickling apply]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuilt_apply, (self._module, *self._made_by))


def _rebuilt_apply(
    module: torch.nn.Module,
    vmap_method: str,
    batch_argnums: tuple[int, ...] | None,
    compile: str,
    output_shapes: Any,
) -> ModuleApply:
    """A pickled ``apply`` made again (``ModuleApply.__reduce__``, NOTE [pickling apply])."""
    apply, _ = jaxify_module(
        module, vmap_method=vmap_method, batch_argnums=batch_argnums, compile=compile, output_shapes=output_shapes
    )
    return apply
