"""jaxify_module's ``device=`` and j2t on several (simulated) devices.

See NOTE [a module's devices] in t2j_ad/module.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import t2j_ad
from t2j_ad.convert import ArrayConversionError, j2t
from tests.conftest import assert_tree_allclose


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _linear(p: dict, x: jax.Array) -> jax.Array:
    return x @ p["weight"].T + p["bias"]


def test_params_on_a_chosen_device():
    device = jax.devices()[2]
    apply, params = t2j_ad.jaxify_module(_module(), device=device)
    assert all(p.devices() == {device} for p in params.values())
    x = jax.device_put(jnp.ones((4, 3)), device)
    out = jax.jit(apply)(params, x)
    assert out.devices() == {device}  # the call ran where its arrays are
    assert_tree_allclose(out, _linear(params, x))


def test_params_replicated_by_a_sharding():
    mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = NamedSharding(mesh, P())
    apply, params = t2j_ad.jaxify_module(_module(), device=replicated, batch_argnums=0)
    assert all(p.sharding == replicated for p in params.values())
    x = jax.device_put(jnp.linspace(-1.0, 1.0, 24).reshape(8, 3), NamedSharding(mesh, P("b")))
    assert_tree_allclose(jax.jit(apply)(params, x), _linear(params, x))


def test_j2t_refuses_an_array_on_several_devices():
    mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("b")))
    with pytest.raises(RuntimeError, match="over 4 devices.*addressable_shards"):
        j2t(x)
    shards = [j2t(s.data) for s in x.addressable_shards]  # the fix the message names
    assert torch.equal(torch.cat(shards), torch.arange(8.0))
    assert issubclass(ArrayConversionError, TypeError)
