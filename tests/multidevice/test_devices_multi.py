"""jaxify_module's ``device=``, the device shapes are inferred for, and j2t
on several (simulated) devices.

See NOTE [a module's devices] in t2j_ad/module.py and NOTE [inference on the
call's device] in t2j_ad/inference.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import t2j_ad
from t2j_ad import api
from t2j_ad.convert import ArrayConversionError, call_device, default_device, j2t
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


def test_the_calls_device_is_a_concrete_arrays_else_jaxs_default():
    devices = jax.devices()
    assert call_device([jax.device_put(jnp.ones(3), devices[3])]) == devices[3]
    mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
    assert call_device([jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("b")))]) == devices[0]
    seen = []

    @jax.jit
    def traced(x: jax.Array) -> jax.Array:
        seen.append(call_device([x]))  # a tracer: no device of its own
        return x

    traced(jnp.ones(3))
    with jax.default_device(devices[2]):
        assert default_device() == devices[2]
        traced(jnp.ones(2))  # a new shape: traced again
    assert seen == [devices[0], devices[2]]
    with jax.default_device("cpu"):  # a platform name
        assert default_device() == jax.devices("cpu")[0]


def test_inference_is_told_the_calls_device(monkeypatch):
    told = []
    real = api.torch_device
    monkeypatch.setattr(api, "torch_device", lambda device: told.append(device) or real(device))
    w = torch.arange(3.0)
    f = t2j_ad.jaxify(lambda x: x * w)  # closes over w: inferred on zeros
    devices = jax.devices()
    x = jax.device_put(jnp.ones(3), devices[3])
    assert_tree_allclose(f(x), jnp.arange(3.0))
    with jax.default_device(devices[2]):
        assert_tree_allclose(jax.jit(f)(jnp.ones((2, 3))), jnp.tile(jnp.arange(3.0), (2, 1)))
    assert told == [devices[3], devices[2]]


def test_params_follow_jaxs_default_device():
    device = jax.devices()[1]
    with jax.default_device(device):
        apply, params = t2j_ad.jaxify_module(_module())
    assert all(p.devices() == {device} for p in params.values())
    x = jax.device_put(jnp.ones((4, 3)), device)
    assert_tree_allclose(jax.jit(apply)(params, x), _linear(params, x))


_EXITS_WITH_A_CALL_QUEUED = """
import jax, jax.numpy as jnp, numpy as np, torch, t2j_ad
m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
apply, params = t2j_ad.jaxify_module(m, device=jax.devices()[2])
out = apply(params, jnp.asarray(np.ones((8, 3), np.float32)))  # queued on device 2; not awaited
"""


def _each_exits_cleanly(script: str, times: int) -> None:
    """Run ``script`` in ``times`` fresh interpreters on 4 simulated devices,
    all at once (a race at exit shows in some runs, not all): each exits 0
    with no error at exit."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    runs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(times)
    ]
    try:
        for run in runs:
            _, stderr = run.communicate(timeout=180)
            assert run.returncode == 0, stderr
            assert "no Python dispatcher" not in stderr and "Exception ignored" not in stderr, stderr
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()


def test_a_call_still_queued_at_exit_runs():
    """The extension's exit hook dropped the dispatcher before XLA ran a call
    still queued, which then failed with "no Python dispatcher is
    registered" (in 3 to 5 of 8 runs): the queued calls are waited for first."""
    _each_exits_cleanly(_EXITS_WITH_A_CALL_QUEUED, 3)


_EXITS_WITH_A_FREED_RESULT_QUEUED = """
import jax, numpy as np, torch, t2j_ad
from jax.sharding import NamedSharding, PartitionSpec as P
f = t2j_ad.jaxify(lambda w, x: torch.tanh(x @ w), batch_argnums=1)
mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
x = jax.device_put(np.ones((16, 4), np.float32), NamedSharding(mesh, P("data")))
w = jax.device_put(np.ones(4, np.float32), NamedSharding(mesh, P()))
run = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P(), axis_names={"model"}))
print(run(w, x).shape)  # the result is freed while its computation is still queued
"""


def test_a_call_whose_result_was_freed_still_runs_before_exit():
    """The queued calls were waited for through the live arrays only: a
    computation whose result was already freed ran after the dispatcher was
    dropped (in 3 of 6 runs: "no Python dispatcher is registered")."""
    _each_exits_cleanly(_EXITS_WITH_A_FREED_RESULT_QUEUED, 4)
