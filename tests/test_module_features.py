"""nn.Module features through jaxify and jaxify_module, held against PyTorch's
own autograd and torch.func on the same math."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import TORCH_DEVICE, assert_tree_allclose, to_numpy, to_torch

import t2j_ad


def _frozen_encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2).to(TORCH_DEVICE).eval().requires_grad_(False)


def test_a_closure_over_a_frozen_encoder_differentiates_the_function_its_value_computes():
    """NOTE [the attention fast path in a function's calls]: a frozen eval-mode
    encoder with a padding mask took PyTorch's nested-tensor fast path (zero
    padded rows) in the value call and the composite ops in the reverse pass:
    the gradient with respect to the input was off by 2.1, silently (graph
    mode's traces never took the fast path)."""
    encoder = _frozen_encoder()
    f = t2j_ad.jaxify(lambda x, mask: encoder(x, src_key_padding_mask=mask))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    mask = jnp.asarray([[False, False, False, True, True], [False, False, False, False, True]])

    def loss(x):
        return jnp.sum(jnp.tanh(f(x, mask)) * w)

    xt = to_torch(x).requires_grad_()
    out = encoder(xt, src_key_padding_mask=to_torch(mask))  # x requires grad: PyTorch's composite ops
    expected = torch.autograd.grad((torch.tanh(out) * to_torch(w)).sum(), xt)[0]
    value, grad = jax.value_and_grad(loss)(x)
    assert_tree_allclose(f(x, mask), jnp.asarray(to_numpy(out.detach())), rtol=1e-5, atol=1e-5)
    assert_tree_allclose(value, loss(x), rtol=1e-5, atol=1e-5)
    assert_tree_allclose(grad, jnp.asarray(to_numpy(expected)), rtol=1e-4, atol=1e-5)
    assert_tree_allclose(jax.jit(jax.grad(loss))(x), jnp.asarray(to_numpy(expected)), rtol=1e-4, atol=1e-5)
    assert torch.backends.mha.get_fastpath_enabled()  # set back after the calls


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_each_module_call_inside_parametrize_cached_computes_its_own_weight(mode, x64):
    """NOTE [a module call's own parametrization cache]: inside
    parametrize.cached(), the first call's weight was cached and read by
    every later call: value_and_grad's gradient lost the path through the
    weight (off by 1.2), and a second step returned the first one's loss."""
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).double().to(TORCH_DEVICE)
    parametrizations.orthogonal(module[0])
    apply, params = t2j_ad.jaxify_module(module, compile=mode)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)))
    key = "0.parametrizations.weight.original"
    moved = {**params, key: params[key] + 0.5}
    step = jax.jit(jax.value_and_grad(lambda p: jnp.sum(jnp.sin(apply(p, x)))))
    with parametrize.cached():
        got = [step(params), step(moved)]
    for (value, grads), p in zip(got, [params, moved]):
        own = {k: to_torch(v).requires_grad_() for k, v in p.items()}
        with parametrize.cached():  # PyTorch's own backward in the block
            expected = torch.sin(torch.func.functional_call(module, own, (to_torch(x),))).sum()
            expected_grads = torch.autograd.grad(expected, list(own.values()))
        assert_tree_allclose(value, jnp.asarray(to_numpy(expected.detach())))
        assert_tree_allclose(grads, {k: jnp.asarray(to_numpy(g)) for k, g in zip(own, expected_grads)})
    assert not parametrize._cache  # nothing left behind


def test_a_module_cast_after_jaxify_module_is_named_when_its_call_fails(x64):
    """``module.double()`` after jaxify_module left float32 params beside
    float64 buffers, and the call failed with PyTorch's "expected scalar
    type Float but found Double" alone."""
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh()).to(TORCH_DEVICE)
    # Eager: a graph keeps the buffers it was traced with (docs/compile-modes.md).
    apply, params = t2j_ad.jaxify_module(module, compile="eager")
    x = jnp.ones((2, 3), jnp.float32)
    apply(params, x)
    module.double()
    with pytest.raises(Exception, match=r"cast after jaxify_module wrapped it \(1\.running_mean float32 -> float64"):
        apply(params, x)
    again, params = t2j_ad.jaxify_module(module)  # the fix the message names
    assert_tree_allclose(again(params, x.astype(jnp.float64)), jnp.asarray(to_numpy(module(to_torch(x).double()))))


def test_an_unregistered_dataclass_result_is_refused_naming_how_to_register_it():
    """A forward returning a dataclass that is no pytree node was refused with
    "return tensors only", where registering it makes it work."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        y: torch.Tensor

    lin = nn.Linear(3, 2).to(TORCH_DEVICE)
    apply, params = t2j_ad.jaxify_module(nn.Sequential(lin))
    f = t2j_ad.jaxify(lambda x: Out(lin(x)))
    with pytest.raises(t2j_ad.TorchCallError, match="output is Out .* jax.tree_util.register_dataclass"):
        f(jnp.ones((4, 3), jnp.float32))
    jax.tree_util.register_dataclass(Out, data_fields=["y"], meta_fields=[])
    assert_tree_allclose(f(jnp.ones((4, 3), jnp.float32)).y, apply(params, jnp.ones((4, 3), jnp.float32)))


def test_a_graph_first_replayed_by_a_fresh_jit_runs_without_grad_mode(x64):
    """NOTE [a graph first replayed by another runner]: a forward decaying its
    weight under no_grad, its step jitted afresh each time: the second step
    replayed the traced graph with grad mode on and was refused ("a leaf
    Variable that requires grad is being used in an in-place operation")."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double().to(TORCH_DEVICE)
    reference = nn.Linear(3, 3).double().to(TORCH_DEVICE)
    reference.load_state_dict(lin.state_dict())

    def forward(layer, x):
        with torch.no_grad():
            layer.weight.mul_(0.9)
        return torch.tanh(layer(x))

    f = t2j_ad.jaxify(lambda x: forward(lin, x), compile="graph")
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)))
    for _ in range(3):
        value, grad = jax.jit(jax.value_and_grad(lambda x: jnp.sum(jnp.sin(f(x)))))(x)
        xt = to_torch(x).requires_grad_()
        expected = torch.sin(forward(reference, xt)).sum()
        expected_grad = torch.autograd.grad(expected, xt)[0]
        assert_tree_allclose(value, jnp.asarray(to_numpy(expected.detach())))
        assert_tree_allclose(grad, jnp.asarray(to_numpy(expected_grad)))
        np.testing.assert_allclose(to_numpy(lin.weight.detach()), to_numpy(reference.weight.detach()))


def test_module_calls_inside_parametrize_cached_beside_another_threads_forwards():
    """NOTE [a module call's own parametrization cache]: the call walked the
    dict itself to drop its own entries, and a forward on another thread
    caching its weights in the same block meanwhile made it raise
    "dictionary changed size during iteration" out of the call."""
    import sys
    import threading
    import time

    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).to(TORCH_DEVICE)
    parametrizations.orthogonal(module[0])
    apply, params = t2j_ad.jaxify_module(module)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
    expected = jnp.asarray(to_numpy(module(to_torch(x)).detach()))
    stop = threading.Event()
    weight = torch.zeros(1)

    def other_thread():  # stands for forwards caching other modules' weights
        while not stop.is_set():
            parametrize._cache[(-1, "weight")] = weight
            time.sleep(5e-5)
            parametrize._cache.pop((-1, "weight"), None)
            time.sleep(5e-5)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with parametrize.cached():
            parametrize._cache.update({(-2 - i, "weight"): weight for i in range(2000)})  # a long walk
            thread = threading.Thread(target=other_thread)
            thread.start()
            try:
                got = [apply(params, x) for _ in range(30)]
            finally:
                stop.set()
                thread.join()
            assert len(parametrize._cache) == 2000  # the block's other entries kept, this call's own dropped
    finally:
        sys.setswitchinterval(interval)
    for y in got:
        assert_tree_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_a_module_call_holds_the_attention_fast_path_off_once(monkeypatch):
    """NOTE [the attention fast path in a function's calls]: jaxify_module's
    forward, which refers to its module, was wrapped in a second hold of the
    switch around its own: one more lock and two settings per call."""
    from t2j_ad.attention_fast_path import fast_path_off

    encoder = _frozen_encoder()
    apply, params = t2j_ad.jaxify_module(encoder, compile="eager")  # a graph's replay runs no forward
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 8)), jnp.float32)
    apply(params, x)  # resolved
    holds = []
    off = fast_path_off.off
    monkeypatch.setattr(fast_path_off, "off", lambda: (holds.append(1), off()))
    got = apply(params, x)
    assert len(holds) == 1
    xt = to_torch(x).requires_grad_()  # PyTorch's composite ops
    assert_tree_allclose(got, jnp.asarray(to_numpy(encoder(xt).detach())), rtol=1e-5, atol=1e-5)
    assert torch.backends.mha.get_fastpath_enabled() and not fast_path_off._held


def test_float64_params_for_a_float32_module_are_not_named_as_a_cast_of_the_module(x64):
    """The cast note read the module's parameters inside the call, where they
    are the params bound: float64 params for a float32 module (whose float32
    buffers then fail PyTorch's batch_norm) were named as "the module was cast
    after jaxify_module wrapped it (0.weight float32 -> float64, ...)"."""
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh()).to(TORCH_DEVICE)
    apply, params = t2j_ad.jaxify_module(module, compile="eager")
    wide = jax.tree.map(lambda a: a.astype(jnp.float64), params)
    x = jnp.ones((2, 3), jnp.float64)
    with pytest.raises(Exception) as failure:
        apply(wide, x)
    assert "expected scalar type" in str(failure.value)
    assert "the module was cast" not in str(failure.value)
    assert_tree_allclose(apply(params, x.astype(jnp.float32)), jnp.asarray(to_numpy(module(to_torch(x).float()))))


class _ScaledLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_buffer_replaced_after_jaxify_module_is_the_one_each_call_reads():
    """NOTE [buffers replaced after jaxify_module]: the buffers a call copies
    to its device (here: the meta device of shape inference) were those the
    module held when jaxify_module ran, so a buffer replaced since, of
    another shape, failed the next new signature's call with a shape
    mismatch (and on a GPU, a CPU module's replaced buffer was read stale)."""
    torch.manual_seed(0)
    module = _ScaledLinear().to(TORCH_DEVICE)
    apply, params = t2j_ad.jaxify_module(module)
    apply(params, jnp.ones((2, 3)))
    module.scale = torch.linspace(1.0, 2.0, 12, device=TORCH_DEVICE).reshape(4, 1, 3)  # replaced, another shape
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 3)), jnp.float32)
    y = apply(params, x)
    with torch.no_grad():
        assert_tree_allclose(y, to_numpy(module(to_torch(x))), rtol=1e-6, atol=1e-6)
    g = jax.grad(lambda p: jnp.sum(apply(p, x) ** 2))(params)
    xt = to_torch(x)
    module.zero_grad()
    (module(xt) ** 2).sum().backward()
    assert_tree_allclose(g["lin.weight"], to_numpy(module.lin.weight.grad), rtol=1e-5, atol=1e-5)
