"""Attention modules run off PyTorch's inference fast path in t2j_ad's calls.

NOTE [the attention fast path in a function's calls]
``nn.MultiheadAttention`` and the ``nn.Transformer*`` layers take a fused
kernel (``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``,
nested tensors for a padding mask, whose padded rows come out zero) when
nothing they see requires grad; otherwise PyTorch's composite ops, which
keep the padded rows' values. ``jaxify_module`` binds parameters that do not
require grad, so its calls hold the fast path off (NOTE [PyTorch's inference
fast path] in module.py). A function that closes over such a module took it
wherever the module's parameters do not require grad (a frozen pretrained
encoder, ``requires_grad_(False)``, under a JAX head): its plain call, and
the value call of ``jax.grad``, took the fast path, whose inputs require
nothing, while the reverse pass, whose inputs require grad, took the
composite ops: the cotangent JAX computed from the value's zero rows was
pulled back through the other function's rows, and the gradient with
respect to the input of a frozen eval-mode ``TransformerEncoder`` with a
padding mask came out off by 2.1, silently, where ``torch.autograd.grad``
(and graph mode, whose traces never take the fast path) gives PyTorch's.
So every run of a function whose modules (``referenced_modules`` and their
submodules, when its signature is resolved) hold one of these layers holds
the fast path off, as its module calls do: one switch per call, about 2.5
us, and a plain call runs through ``impl``, not the user's function
directly (``BaseFn.direct``): 3 to 8 us in all on a small MLP's jitted
call, 50 us, measured on 2 busy cores (one process-wide setting, held by a count under a lock shared with
``jaxify_module``'s calls: ``fast_path_off``; not around ``jaxify_module``'s
forward, which holds it itself: ``HOLDS_IT``). So a plain call's padded
rows hold the composite ops' values, as under ``jax.grad``, where
PyTorch's own call with nothing requiring grad (or under ``no_grad`` or
``inference_mode``) returns zeros there (a 2-layer encoder: up to 1.95
against 0); the rows the mask keeps agree to rounding (2e-7). A layer
reached only deeper than ``referenced_modules`` looks, or one the function
makes afresh with frozen parameters, still takes the fast path where
PyTorch would. A ``torch.no_grad()`` or ``inference_mode()`` region of the
caller is no part of the call (NOTE [calls run with grad mode on], NOTE
[calls inside torch.inference_mode] in runtime.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .settings_held_off import HeldOff

# PyTorch's attention fast path (``torch.backends.mha``), off while any call
# on any thread holds it; back to what it was when the last hold ends.
fast_path_off = HeldOff(torch.backends.mha.get_fastpath_enabled, torch.backends.mha.set_fastpath_enabled)

# The modules whose forward reads ``torch.backends.mha.get_fastpath_enabled``
# (a decoder layer's attention is a ``MultiheadAttention``, found as its submodule).
_FAST_PATH_MODULES = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoder, torch.nn.TransformerEncoderLayer)


def runs_attention_layers(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether ``modules`` or a submodule of theirs may take the fast path."""
    return any(isinstance(sub, _FAST_PATH_MODULES) for module in modules for sub in module.modules())


# Set on ``jaxify_module``'s forward, which holds the switch itself for as
# long as its bindings (NOTE [PyTorch's inference fast path] in module.py): a
# second hold around it was one more lock and two settings per call, for nothing.
HOLDS_IT = "_t2j_ad_holds_fast_path_off"


def without_attention_fast_path(
    fn: Callable[..., Any], modules: Sequence[torch.nn.Module], torch_fn: Callable[..., Any]
) -> Callable[..., Any]:
    """``fn`` (which runs ``torch_fn``), run with the attention fast path off
    (NOTE [the attention fast path in a function's calls]); ``fn`` itself
    where ``modules`` (the modules it refers to) hold no attention layer, or
    ``torch_fn`` holds the switch itself (``HOLDS_IT``)."""
    if getattr(torch_fn, HOLDS_IT, False) or not runs_attention_layers(modules):
        return fn

    def off_the_fast_path(*args: Any, **kwargs: Any) -> Any:
        with fast_path_off:
            return fn(*args, **kwargs)

    return off_the_fast_path
