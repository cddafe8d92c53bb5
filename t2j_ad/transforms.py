"""Build the PyTorch callable of a TorchFn, one transform (Jvp, Vjp, Vmap) at a time.

``build`` applies the transforms in order, each with ``apply_transform``; see
NOTE [every derivative is a PyTorch function] in torch_fn.py. Every callable
here takes tensors and returns a tuple of tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import functorch_levels
from .composite_norms import with_composite_norms
from .convert import canonical_jax_dtype, jax_dtype, on_another_device, torch_dtype
from .held_bindings import held_through_the_call
from .replayed_calls import effects, effects_now, per_example_refusal, token_input
from .rules.fallbacks import forward_mode, reverse_mode, vmap_auto, warn_once
from .state_writes import StateWrites, recomputed_bindings_kept
from .torch_fn import Aval, Jvp, TorchFn, Transform, Vjp, Vmap

Flat = Callable[..., tuple[torch.Tensor, ...]]


def _restrict(g: Flat, primals: Sequence[torch.Tensor], wrt: Sequence[int], out: Sequence[int]) -> Flat:
    """``g`` as a function of the ``wrt`` inputs alone, returning ``out``.

    Inputs outside ``wrt`` are closed over, so PyTorch never differentiates
    with respect to them (symbolic zeros stay symbolic). A fallback runs
    ``g`` more than once on them, so each run gets them with the
    ``requires_grad`` flags they came with: a function that sets it on an
    input (``x if x.requires_grad else x.requires_grad_(True)``, before a
    ``torch.autograd.grad`` of its own) left it set for the next run, which
    then skipped the call that makes torch.func refuse it, and the Hessian
    failed inside PyTorch ("appears to not have been used in the graph").
    """
    closed = [(p, p.requires_grad) for i, p in enumerate(primals) if i not in wrt and isinstance(p, torch.Tensor)]

    def restricted(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        full = list(primals)
        for i, v in zip(wrt, values):
            full[i] = v
        try:
            outs = g(*full)
        finally:
            for p, flag in closed:
                if p.requires_grad is not flag:
                    p.requires_grad_(flag)
        return tuple(outs[j] for j in out)

    return restricted


def _conj_where(tensors: Sequence[torch.Tensor], avals: Sequence[Aval]) -> tuple[torch.Tensor, ...]:
    return tuple(t.conj() if a.is_complex else t for t, a in zip(tensors, avals))


def _dense(grads: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """``grads`` as dense tensors: PyTorch's reverse pass makes sparse
    gradients of its own (``Embedding(sparse=True)``'s weight), while the
    JAX cotangent of a dense input is dense."""
    if all(g.layout is _strided for g in grads):
        return grads
    return tuple(g if g.layout is _strided else g.to_dense() for g in grads)


_strided = torch.strided


def _make_jvp(t: Jvp, g: Flat, ins: tuple[Aval, ...], outs: tuple[Aval, ...], base: Any, prefix: Any) -> Flat:
    n = len(ins)
    over_reverse = any(isinstance(p, Vjp) for p in prefix[:-1])
    # NOTE [a jvp staticmethod under a second forward level] in rules/forward_over_forward.py
    over_forward = any(isinstance(p, Jvp) for p in prefix[:-1])

    def jvp_fn(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        primals, tangents = args[:n], args[n:]
        restricted = _restrict(g, primals, t.wrt, t.out)
        wrt_primals = tuple(primals[i] for i in t.wrt)
        return forward_mode(
            restricted,
            wrt_primals,
            tangents,
            base=base,
            key=prefix,
            over_reverse=over_reverse,
            over_forward=over_forward,
        )

    return jvp_fn


def _make_vjp(t: Vjp, g: Flat, ins: tuple[Aval, ...], outs: tuple[Aval, ...], base: Any, prefix: Any) -> Flat:
    n = len(ins)
    out_avals = [outs[j] for j in t.out]
    wrt_avals = [ins[i] for i in t.wrt]
    # The function's own output names where this reverse pass is the first transform.
    out_names = getattr(base, "out_names", None) if len(prefix) == 1 else None
    # Reverse mode over a reverse pass (NOTE [a reverse pass differentiated again] in rules/fallbacks.py).
    over_reverse = any(isinstance(p, Vjp) for p in prefix[:-1])
    # As the runner's value calls: on a CPU-only PyTorch the only other
    # device is meta, which the value call refuses first.
    other_devices = torch.cuda.is_available()

    def vjp_fn(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        primals, cotangents = args[:n], args[n:]
        restricted = _restrict(g, primals, t.wrt, t.out)
        wrt_primals = tuple(primals[i] for i in t.wrt)
        # JAX transposes complex-linear maps (J^T c); PyTorch's vjp computes
        # the conjugate (J^H c). Conjugating on both sides converts.
        cotangents = _conj_where(cotangents, out_avals)

        def matched(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # With x64 off, a float64 PyTorch output meets a float32 cotangent;
            # differentiating the cast makes the dtypes agree exactly. (Only
            # where they differ: every op costs dispatch under torch.func.)
            outs = restricted(*values)
            for k, (o, c) in enumerate(zip(outs, cotangents) if other_devices else ()):
                if isinstance(o, torch.Tensor) and o.device != c.device:
                    # Autograd would fail deep inside, naming neither (the
                    # value call refuses such an output by name too).
                    name = out_names[t.out[k]] if out_names else f"output {t.out[k]}"
                    raise RuntimeError(on_another_device(base.name, name, o.device, c.device))
            return tuple(o if o.dtype == c.dtype else o.to(c.dtype) for o, c in zip(outs, cotangents))

        grads = reverse_mode(matched, wrt_primals, cotangents, base=base, key=prefix, over_reverse=over_reverse)
        return _conj_where(_dense(grads), wrt_avals)

    return vjp_fn


def _announce_loop_for_state(base: Any, writes: StateWrites) -> None:
    """NOTE [derivatives do not write again]: PyTorch's loop over the
    examples updates the state once per example; torch.vmap would update it
    once for the batch, or fail after a first write (batch norm counts the
    batch, then refuses a batched input). Said once per function, naming
    the state (NOTE [attributes PyTorch's hooks recompute] in real_writes.py:
    an attribute a hook of the user's binds anew is counted)."""
    warn_once(
        base,
        "vmap",
        f"t2j_ad: {base.name!r} updates state it keeps ({', '.join(writes.names())}: running statistics, a "
        f"tensor it writes in place, or one a forward or a hook binds anew); batching it with a sequential "
        f"loop, one update per example as a loop in PyTorch makes them. An attribute that a hook of your own "
        f"computes again from the module's tensors on every call (a pruning mask) is no state: register it "
        f"with torch.nn.utils.parametrize instead, which torch.vmap batches. Pass vmap_method='sequential' to "
        f"silence this.",
    )


def _looping_on_cuda(vectorized: Flat, sequential: Flat) -> Flat:
    """``vectorized``, except on CUDA tensors, where ``sequential`` runs.

    NOTE [dropout on CUDA under torch.vmap]
    A replay batched over tangents alone runs under ``torch.vmap`` with
    ``randomness="same"`` (NOTE [derivatives replay the value's draws] in
    replayed_calls.py), which draws the value call's numbers only if every
    random op draws them the same way batched and unbatched. ``dropout`` on
    CUDA does not: a plain call runs ``native_dropout``'s fused kernel, while
    functorch's batching rule for it makes the mask with ``bernoulli_``, which
    turns the same generator state into another mask (on the CPU both use
    ``bernoulli_``). A Hessian or Jacobian of a function with dropout was then
    taken through a mask the value never used (found on an H200, torch 2.11).
    So on CUDA such a replay loops over the tangents, each run replaying the
    value call's draws as a plain call does; results are exact, the loop is
    slower than one batched run.
    """

    def run(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if _on_cuda(args):
            return sequential(*args)
        return vectorized(*args)

    return run


def _on_cuda(args: Sequence[torch.Tensor]) -> bool:
    return any(a.is_cuda for a in args)


def _example_call(g: Flat, args: Sequence[torch.Tensor], in_dims: tuple[int | None, ...], i: int) -> tuple[Any, ...]:
    """``g`` on example ``i`` of ``args``, each laid out as an unbatched call's input.

    NOTE [each example of the loop from offset 0]
    An unbatched call's input is a whole XLA buffer: storage offset 0. The
    loop's ``select(d, i)`` is a view at offset ``i * stride``, and
    ``as_strided`` with an explicit ``storage_offset`` counts from the
    storage's start, not the view's: ``x.as_strided(size, stride, 0)`` read
    example 0's entries for every example, silently (``torch.vmap`` counts
    from each example's start, as the unbatched call does). So an example
    not at offset 0 goes in as a copy of its own (a copy of each batched
    argument per call, beside a Python call per example). A write into it
    is copied back into the input, where the runtime's version check
    refuses it (InputMutationError) as it refused a write into the view.
    """
    examples: list[Any] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for a, d in zip(args, in_dims):
        if d is None:
            examples.append(a)
            continue
        row = a.select(d, i)
        try:
            own = row.storage_offset() == 0
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            own = False
        if not own:
            copy = row.clone()
            copies.append((row, copy))
            row = copy
        examples.append(row)
    result = g(*examples)
    for row, copy in copies:
        if copy._version:
            with torch.no_grad():
                row.copy_(copy)
    return result


def _make_vmap(t: Vmap, g: Flat, ins: tuple[Aval, ...], outs: tuple[Aval, ...], base: Any, prefix: Any) -> Flat:
    in_dims, size = t.in_dims, t.axis_size
    token = token_input(base)
    # A replay batched over tangents alone (the token unbatched: a Jacobian,
    # a Hessian) draws the value call's numbers once for every tangent, as
    # randomness="same" does (NOTE [derivatives replay the value's draws]).
    randomness = "same" if token is not None and in_dims[token] is None else "error"

    def sequential(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if size == 0:
            device = args[0].device if args else None  # the call's, as every output's must be
            return tuple(torch.empty((0,) + o.shape, dtype=torch_dtype(o.dtype), device=device) for o in outs)
        rows = [_example_call(g, args, in_dims, i) for i in range(size)]
        return tuple(torch.stack([r[j] for r in rows]) for j in range(len(outs)))

    def expand_dims(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Unbatched arguments go in once with in_dims=None: never copied.
        return functorch_levels.vmap(g, args, in_dims, size, randomness)

    def broadcast_all(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # A copy, not an expand() view: PyTorch formulas that write in place
        # (the jvp of prod under a nested vmap) refuse a tensor whose
        # elements share memory ("more than one element of the written-to
        # tensor refers to a single memory location").
        # A replay's token stays as it is: one state, replayed for every tangent.
        spread = [d is None and i != token for i, d in enumerate(in_dims)]
        full = [a.expand((size,) + tuple(a.shape)).clone() if s else a for a, s in zip(args, spread)]
        dims = tuple(0 if s else d for d, s in zip(in_dims, spread))
        return functorch_levels.vmap(g, full, dims, size, randomness)

    if randomness == "same" and effects_now(base).draws_random:
        # NOTE [dropout on CUDA under torch.vmap]
        expand_dims = _looping_on_cuda(expand_dims, sequential)
        broadcast_all = _looping_on_cuda(broadcast_all, sequential)

    def asked_for(vectorized: Flat) -> Flat:
        # The method the user chose: PyTorch's error, and what runs without torch.vmap.
        def batched(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            try:
                return vectorized(*args)
            except (RuntimeError, NotImplementedError, ValueError) as err:  # ValueError: an inner vmap's out_dims
                message = (
                    f"{err}\n(t2j_ad: this ran under torch.vmap, as vmap_method={t.method!r} asks; if torch.vmap "
                    f"cannot batch the function, vmap_method='auto' falls back to a loop over the batch, and "
                    f"vmap_method='sequential' always loops)"
                )
                try:
                    annotated = type(err)(message)
                except Exception:  # noqa: BLE001 - an exception type that takes other arguments
                    annotated = RuntimeError(message)
                raise annotated from err

        return batched

    if t.method == "sequential":
        root = getattr(base, "effects_root", None)
        if root is not None and base.effects.writes and not base.replays:  # the value call of per-example gradients
            if root.vmap_method in ("expand_dims", "broadcast_all"):
                # Its replays would refuse torch.vmap per example, after this
                # loop had updated the state once per example.
                raise per_example_refusal(base.name)
            if root.vmap_method == "auto":
                _announce_loop_for_state(root, base.effects.writes)
        return sequential
    if t.method == "expand_dims":
        return asked_for(expand_dims)
    if t.method == "broadcast_all":
        return asked_for(broadcast_all)

    batched = t.avals(ins, outs)[1]
    wanted = tuple(torch_dtype(a.dtype) for a in batched)  # the dtype check's fast path

    def checked_expand_dims(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # A batching rule of PyTorch's that returns the wrong shape counts as
        # a refusal (torch 2.13's mse_loss under two vmaps that batch its two
        # arguments at different levels, at batch size 1): the loop is right.
        # So does one that returns the wrong dtype: some rules promote by the
        # batched tensors' ranks, not each example's (torch.where or clamp of
        # a float32 example, 0-d, with a float64 0-d argument: float32, where
        # each example's call gives float64). JAX's dtype of the result
        # (with x64 off, a float64 one arrives as float32) is compared.
        results = expand_dims(*args)
        for i, (r, aval, want) in enumerate(zip(results, batched, wanted)):
            if tuple(r.shape) != aval.shape:
                raise RuntimeError(
                    f"torch.vmap returned output {i} with shape {tuple(r.shape)}, but batching gives {aval.shape}"
                )
            if r.dtype is not want and canonical_jax_dtype(jax_dtype(r.dtype)) != aval.dtype:
                raise RuntimeError(
                    f"torch.vmap returned output {i} of dtype {r.dtype}, but each example's call gives "
                    f"{torch_dtype(aval.dtype)}"
                )
        return results

    def auto(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return vmap_auto(checked_expand_dims, sequential, args, base=base, key=prefix)

    if token is not None and in_dims[token] is not None:
        # A replay with one token per example (NOTE [derivatives replay the
        # value's draws]): torch.vmap cannot set a state per example. Over
        # tangents (the token unbatched) torch.vmap batches it.
        return sequential
    writes = effects(base).writes
    if writes:
        _announce_loop_for_state(base, writes)
        return sequential
    return auto


_MAKERS = {Jvp: _make_jvp, Vjp: _make_vjp, Vmap: _make_vmap}


def apply_transform(
    t: Transform, g: Flat, ins: tuple[Aval, ...], outs: tuple[Aval, ...], *, base: Any, prefix: Any
) -> Flat:
    return _MAKERS[type(t)](t, g, ins, outs, base, prefix)


def stage_avals(fun: TorchFn) -> list[tuple[tuple[Aval, ...], tuple[Aval, ...]]]:
    """The (in, out) avals before each transform of ``fun``."""
    stages = []
    ins, outs = fun.base.in_avals, fun.base.out_avals
    for t in fun.transforms:
        stages.append((ins, outs))
        ins, outs = t.avals(ins, outs)
    return stages


def build(fun: TorchFn) -> Callable[..., tuple[Any, ...]]:
    """The PyTorch callable computing ``fun``, built once per transform tuple."""
    base = fun.base
    # NOTE [normalizations at second order]: its own chain of callables, from the base up.
    second_order = sum(isinstance(t, (Jvp, Vjp)) for t in fun.transforms) >= 2
    mark = (_SECOND_ORDER,) if second_order else ()
    g = base.built.get(mark + fun.transforms)
    if g is None:
        g = with_composite_norms(base.fn, getattr(base, "referenced_modules", ())) if second_order else base.fn
        prefix: tuple[Transform, ...] = ()
        for t, (ins, outs) in zip(fun.transforms, stage_avals(fun)):
            prefix = prefix + (t,)
            key = mark + prefix
            cached = base.built.get(key)
            if cached is None:
                cached = apply_transform(t, g, ins, outs, base=base, prefix=prefix)
                with base.lock:
                    base.built[key] = cached
            g = cached
    if not fun.transforms:
        return g
    g = recomputed_bindings_kept(g, _recomputed_by_hooks(base))
    # NOTE [bindings held through the reverse pass] in held_bindings.py
    return held_through_the_call(g)


def _recomputed_by_hooks(base: Any) -> tuple[tuple[torch.nn.Module, str], ...]:
    """The attributes hooks of PyTorch's bind anew in ``base``'s modules, as
    shape inference saw them (NOTE [attributes PyTorch's hooks recompute] in
    real_writes.py); read as seen, not found again for the flags now: a
    build runs no trial run of its own."""
    seen = getattr(base, "effects", None)
    return seen.recomputed if seen is not None else ()


_SECOND_ORDER = "normalizations by plain ops"  # a key of base.built (NOTE [normalizations at second order])
