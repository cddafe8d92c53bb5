"""LSTM, GRU and RNN under every transform where cuDNN would run them
(NOTE [recurrent modules without cuDNN] in recurrent_cudnn.py).

On an H100 (torch 2.11) no recurrent module had a derivative through
t2j_ad: ``flatten_parameters`` read ``data_ptr()`` of torch.func's wrapped
and a trace's fake weights, and cuDNN's branch of ``_VF.lstm`` the
storage of the wrappers a transform lifts every weight to. The CPU never
takes that path (the weights are no CUDA tensors), so ``cuda_path`` answers
what ``flatten_parameters`` consults as on CUDA: there PyTorch's own
``torch.func.grad`` fails as on the H100, and t2j_ad's calls must not. The
composite's storage read has no such switch on the CPU: that part is
checked by reading (cuDNN off makes ``at::cudnn_is_acceptable`` answer no
first), and on a GPU by these same tests.
"""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.func
from conftest import ON_GPU, TORCH_DEVICE, assert_tree_allclose, to_numpy, to_torch

import t2j_ad
from t2j_ad import recurrent_cudnn
from t2j_ad.rules.fallbacks import FallbackWarning

_FLATTEN = torch.nn.RNNBase.flatten_parameters.__code__
_TENSOR_IS_CUDA = torch._C.TensorBase.is_cuda


@pytest.fixture
def cuda_path(monkeypatch):
    """``flatten_parameters`` sees its weights as CUDA tensors and cuDNN as
    willing whenever it is on, as on a GPU, up to its data_ptr() reads;
    t2j_ad takes PyTorch for one with cuDNN."""
    assert "is_cuda" not in vars(torch.Tensor)

    def is_cuda(tensor: torch.Tensor) -> bool:
        return sys._getframe(1).f_code is _FLATTEN or _TENSOR_IS_CUDA.__get__(tensor)

    monkeypatch.setattr(torch.backends.cudnn, "is_acceptable", lambda tensor: torch.backends.cudnn.enabled)
    monkeypatch.setattr(recurrent_cudnn, "CUDNN_PRESENT", True)
    # After the data_ptr() read: the flattening itself has only a CUDA
    # kernel, which a CUDA build of torch (cuDNN built in) would call on
    # these CPU weights; a CPU build answers False here anyway.
    monkeypatch.setattr(torch, "_use_cudnn_rnn_flatten_weight", lambda: False)
    torch.Tensor.is_cuda = property(is_cuda)
    try:
        yield
    finally:
        del torch.Tensor.is_cuda
    assert torch.backends.cudnn.enabled


def _t_loss(module: torch.nn.Module, x: jax.Array):
    def loss(p):
        return torch.func.functional_call(module, p, (to_torch(x),))[0].square().sum()

    return loss


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_recurrent_modules_have_derivatives_where_cudnn_would_run(cuda_path, cls):
    """The parameters' gradient by jaxify_module and by a function calling
    torch.func.functional_call, and the input's by a closure over the
    module, eager and graph, with no fallback: each equals torch.func's with
    cuDNN off, PyTorch's own workaround (with it on, torch.func fails as on
    the H100). They fell back to torch.autograd.grad, and graph mode traced
    nothing."""
    torch.manual_seed(0)
    module = cls(3, 4, num_layers=2, batch_first=True).to(TORCH_DEVICE)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 3)), jnp.float32)
    weights = {k: v.detach() for k, v in module.named_parameters()}
    t_loss = _t_loss(module, x)
    with pytest.raises(RuntimeError, match="doesn't have storage"):
        torch.func.grad(t_loss)(weights)
    with torch.backends.cudnn.flags(enabled=False):
        expected_value = to_numpy(t_loss(weights))
        expected_grad = {k: to_numpy(g) for k, g in torch.func.grad(t_loss)(weights).items()}
        tx = to_torch(x).requires_grad_()
        expected_x_grad = to_numpy(torch.autograd.grad(module(tx)[0].square().sum(), tx)[0])
    tolerances = dict(rtol=1e-4, atol=1e-5) if ON_GPU else dict(rtol=1e-5, atol=1e-6)
    for mode in ("eager", "graph"):
        apply, params = t2j_ad.jaxify_module(module, compile=mode)
        functional = t2j_ad.jaxify(lambda p, x: torch.func.functional_call(module, p, (x,))[0].square().sum(), compile=mode)
        closure = t2j_ad.jaxify(lambda x: module(x)[0].square().sum(), compile=mode)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            value, grad = jax.value_and_grad(lambda p: jnp.square(apply(p, x)[0]).sum())(params)
            by_functional_call = jax.grad(functional)(params, x)
            x_grad = jax.grad(closure)(x)
        np.testing.assert_allclose(value, expected_value, rtol=1e-5)
        assert_tree_allclose(grad, expected_grad, **tolerances)
        assert_tree_allclose(by_functional_call, expected_grad, **tolerances)
        assert_tree_allclose(x_grad, expected_x_grad, **tolerances)
        for f in (apply, functional, closure):
            stats = f.compile_stats()
            assert stats["eager_fallbacks"] == 0 and stats["graphs"] >= (2 if mode == "graph" else 0), (mode, stats)
        assert torch.backends.cudnn.enabled


class _Recording(torch.nn.Module):
    """A module whose forward notes whether cuDNN is on."""

    def __init__(self, inner: torch.nn.Module, seen: list[bool]):
        super().__init__()
        self.inner = inner
        self.seen = seen

    def forward(self, x):
        self.seen.append(torch.backends.cudnn.enabled)
        return self.inner(x)


class _Tagger(torch.nn.Module):
    def __init__(self, in_rnn: list[bool], in_head: list[bool]):
        super().__init__()
        self.rnn = torch.nn.LSTM(3, 4, batch_first=True)
        # After t2j_ad's global pre-hook, before the forward.
        self.rnn.register_forward_pre_hook(lambda m, args: in_rnn.append(torch.backends.cudnn.enabled))
        self.head = _Recording(torch.nn.Linear(4, 2), in_head)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def test_only_the_recurrent_forward_runs_without_cudnn(cuda_path):
    """cuDNN is off inside the LSTM's forward and on in the layer after it
    (a convolution there keeps cuDNN), and on again after the call; a
    function that refers to no recurrent module is left as it is."""
    in_rnn: list[bool] = []
    in_head: list[bool] = []
    torch.manual_seed(0)
    model = _Tagger(in_rnn, in_head).to(TORCH_DEVICE)
    apply, params = t2j_ad.jaxify_module(model, compile="eager")
    x = jnp.ones((2, 5, 3), jnp.float32)
    jax.block_until_ready(jax.grad(lambda p: apply(p, x).sum())(params))
    assert in_rnn and in_head and not any(in_rnn) and all(in_head), (in_rnn, in_head)
    assert torch.backends.cudnn.enabled

    def plain(x):
        return x * 2

    assert recurrent_cudnn.without_cudnn_in_recurrent_forwards(plain, ()) is plain
    assert recurrent_cudnn.without_cudnn_in_recurrent_forwards(plain, (torch.nn.Linear(2, 2),)) is plain


class _NotingLSTM(torch.nn.LSTM):
    """An LSTM whose forward notes whether cuDNN is on, and may be interrupted."""

    def __init__(self, seen: list[bool], interrupt: bool = False):
        super().__init__(3, 4)
        self.seen = seen
        self.interrupt = interrupt

    def forward(self, x):
        self.seen.append(torch.backends.cudnn.enabled)
        if self.interrupt:
            raise KeyboardInterrupt
        return super().forward(x)


def test_nested_calls_and_an_interrupted_forward_leave_cudnn_on():
    """Two calls' hooks around one forward (a jaxify'd function called in
    another's forward) switch cuDNN back on once, after the forward; a
    forward a KeyboardInterrupt ends, which runs no forward hook, too."""
    seen: list[bool] = []
    lstm = _NotingLSTM(seen)
    after: list[bool] = []
    with recurrent_cudnn.recurrent_forwards_without_cudnn():
        with recurrent_cudnn.recurrent_forwards_without_cudnn():
            lstm(torch.ones(5, 1, 3))
            after.append(torch.backends.cudnn.enabled)
    assert seen == [False] and after == [True] and torch.backends.cudnn.enabled
    interrupted = _NotingLSTM(seen, interrupt=True)
    with pytest.raises(KeyboardInterrupt):
        with recurrent_cudnn.recurrent_forwards_without_cudnn():
            interrupted(torch.ones(5, 1, 3))
    assert seen == [False, False] and torch.backends.cudnn.enabled
