"""Choosing the lowering backend: T2J_AD_BACKEND, and a missing extension."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
import torch
from conftest import ON_GPU

import t2j_ad
from t2j_ad import backends
from t2j_ad.backends import callback, ffi

FFI_TARGET = "t2j_ad_torch_call"
# jax.experimental.buffer_callback's custom call target on this platform.
CALLBACK_TARGET = "xla_buffer_python_gpu_callback" if ON_GPU else "xla_buffer_python_cpu_callback"


def _lowered_text(x: jax.Array) -> str:
    # A fresh function each time, so nothing is reused from an earlier lowering.
    f = t2j_ad.jaxify(lambda x: torch.cos(x) + 1)
    return jax.jit(f).lower(x).as_text()


def test_callback_is_forced_by_the_environment(monkeypatch):
    monkeypatch.setenv("T2J_AD_BACKEND", "callback")
    assert backends.select() is callback
    text = _lowered_text(jnp.ones(3))
    assert CALLBACK_TARGET in text and FFI_TARGET not in text


@pytest.mark.skipif(not ffi.available(), reason="the C++ extension is not built in this environment")
def test_ffi_is_the_default_when_built(monkeypatch):
    monkeypatch.delenv("T2J_AD_BACKEND", raising=False)
    assert backends.select() is ffi
    text = _lowered_text(jnp.ones(3))
    assert FFI_TARGET in text and CALLBACK_TARGET not in text


def test_both_backends_compute_the_same(monkeypatch):
    x = jnp.linspace(0.0, 1.0, 5)
    results = []
    for name in ("callback", "ffi") if ffi.available() else ("callback",):
        monkeypatch.setenv("T2J_AD_BACKEND", name)
        f = t2j_ad.jaxify(lambda x: torch.cos(x) + 1)
        results.append(jax.jit(jax.grad(lambda x: f(x).sum()))(x))
    for r in results:
        assert jnp.allclose(r, -jnp.sin(x))


def test_missing_extension_falls_back_with_one_warning(monkeypatch):
    monkeypatch.delenv("T2J_AD_BACKEND", raising=False)
    monkeypatch.setattr(backends, "_ffi_module", lambda: None)
    monkeypatch.setattr(backends, "_warned_missing_ffi", False)
    with pytest.warns(RuntimeWarning, match="C\\+\\+ extension is not built"):
        assert backends.select() is callback
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.select() is callback  # no second warning
    text = _lowered_text(jnp.ones(2))
    assert CALLBACK_TARGET in text


def test_forcing_ffi_without_the_extension_is_an_error(monkeypatch):
    monkeypatch.setenv("T2J_AD_BACKEND", "ffi")
    monkeypatch.setattr(backends, "_ffi_module", lambda: None)
    with pytest.raises(RuntimeError, match="T2J_AD_BACKEND=ffi, but the t2j_ad C\\+\\+ extension is not built"):
        backends.select()


def test_unknown_backend_name_is_an_error(monkeypatch):
    monkeypatch.setenv("T2J_AD_BACKEND", "cuda-graphs")
    with pytest.raises(ValueError, match="T2J_AD_BACKEND must be 'ffi' or 'callback'"):
        backends.select()
