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
us (one process-wide setting, held by a count under a lock shared with
``jaxify_module``'s calls: ``fast_path_off``). A layer reached only deeper
than ``referenced_modules`` looks, or one the function makes afresh with
frozen parameters, still takes the fast path where PyTorch would.
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


def without_attention_fast_path(fn: Callable[..., Any], modules: Sequence[torch.nn.Module]) -> Callable[..., Any]:
    """``fn``, run with the attention fast path off (NOTE [the attention fast
    path in a function's calls]); ``fn`` itself where ``modules`` (the
    modules it refers to) hold no attention layer."""
    if not runs_attention_layers(modules):
        return fn

    def off_the_fast_path(*args: Any, **kwargs: Any) -> Any:
        with fast_path_off:
            return fn(*args, **kwargs)

    return off_the_fast_path
