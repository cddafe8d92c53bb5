"""Devices: where jaxify_module's parameters and buffers live, where output
shapes are inferred, outputs made on another device than the call's, and
conversions that keep each leaf's device.

See NOTE [a module's devices] in t2j_ad/module.py and NOTE [inference on the
call's device] in t2j_ad/inference.py. On a CPU-only machine the
second device that exists is PyTorch's ``meta``; the CUDA tests need a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import ON_GPU, TORCH_DEVICE, assert_tree_allclose, cuda_only, to_numpy, to_torch

import t2j_ad
from t2j_ad import compat, inference
from t2j_ad.convert import ArrayConversionError, copy_to_jax, copy_to_torch, j2t, jax_device, torch_device
from t2j_ad.inference import infer_outputs
from t2j_ad.torch_fn import Aval


class Shift(torch.nn.Module):
    """A linear layer plus a buffer the forward reads."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("shift", torch.tensor([0.5, -1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.shift


# A failure while XLA runs the call reaches the caller as JaxRuntimeError
# carrying the TorchCallError's text (docs/errors.md).
RAISED = (jax.errors.JaxRuntimeError, t2j_ad.TorchCallError)


def _shift_jax(p: dict, shift: jax.Array, x: jax.Array) -> jax.Array:
    return x @ p["lin.weight"].T + p["lin.bias"] + shift


def _x() -> jax.Array:
    return jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(4, 3)


# ------------------------------------------------------------ jaxify_module


def test_params_on_jax_default_device():
    module = Shift()
    _, params = t2j_ad.jaxify_module(module)
    for name, p in params.items():
        assert p.devices() == {jax.devices()[0]}, name
        np.testing.assert_array_equal(np.asarray(p), module.get_parameter(name).detach().cpu().numpy())


def test_params_are_copies():
    module = Shift()
    apply, params = t2j_ad.jaxify_module(module)
    before = np.asarray(params["lin.weight"]).copy()
    with torch.no_grad():
        module.lin.weight.add_(1.0)  # training the module in place later
    np.testing.assert_array_equal(np.asarray(params["lin.weight"]), before)


def test_params_need_no_dlpack_import(monkeypatch):
    # With JAX_PLATFORMS=cuda, JAX has no CPU backend to take a CPU tensor by
    # DLPack ("Unknown backend cpu"); the parameters must not go that way.
    def refuse(*args, **kwargs):
        raise RuntimeError("Unknown backend cpu")

    monkeypatch.setattr(jax.dlpack, "from_dlpack", refuse)
    module = Shift()
    apply, params = t2j_ad.jaxify_module(module)
    shift = jnp.asarray(module.shift.numpy())
    assert_tree_allclose(jax.jit(apply)(params, _x()), _shift_jax(params, shift, _x()))


def test_device_keyword_places_params():
    device = jax.devices()[-1]
    apply, params = t2j_ad.jaxify_module(Shift(), device=device)
    assert {d for p in params.values() for d in p.devices()} == {device}
    single = jax.sharding.SingleDeviceSharding(device)
    _, again = t2j_ad.jaxify_module(Shift(), device=single)
    assert all(p.sharding == single for p in again.values())


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), 0])
def test_device_keyword_refuses_other_types(device):
    with pytest.raises(TypeError, match=r"device must be a jax.Device .* got"):
        t2j_ad.jaxify_module(Shift(), device=device)


def test_bfloat16_params_copy_exactly():
    module = Shift().to(torch.bfloat16)
    _, params = t2j_ad.jaxify_module(module)
    assert params["lin.weight"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(params["lin.weight"]).astype(np.float32), module.lin.weight.detach().float().numpy()
    )


@pytest.mark.parametrize("compile", ["eager", "graph"])
def test_buffers_follow_the_call(compile):
    # Output shapes are inferred on meta tensors: the buffer goes there too.
    module = Shift()
    apply, params = t2j_ad.jaxify_module(module, compile=compile)
    shift = jnp.asarray(module.shift.numpy())
    assert_tree_allclose(jax.jit(apply)(params, _x()), _shift_jax(params, shift, _x()))
    grads = jax.jit(jax.grad(lambda p: apply(p, _x()).sum()))(params)
    assert_tree_allclose(grads, jax.grad(lambda p: _shift_jax(p, shift, _x()).sum())(params))


# ------------------------------------------------------- shape inference


def _scaled_by(w: torch.Tensor, calls: list[str]):
    def scaled(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.device.type)
        return torch.tanh(x * w)

    return scaled


@pytest.mark.parametrize("compile", ["eager", "graph"])
def test_a_function_closing_over_a_tensor_infers_where_the_call_runs(compile):
    # NOTE [inference on the call's device]: meta inputs cannot meet the real
    # weight, so inference takes the call on zeros, and CPU zeros would fail
    # against a weight on the GPU.
    w = np.linspace(0.5, 2.0, 5, dtype=np.float32)
    calls: list[str] = []
    f = t2j_ad.jaxify(_scaled_by(to_torch(w), calls), compile=compile)
    x = jnp.linspace(-1.0, 1.0, 15, dtype=jnp.float32).reshape(3, 5)

    def reference(x: jax.Array) -> jax.Array:
        return jnp.tanh(x * w)

    assert_tree_allclose(jax.jit(f)(x), reference(x))
    assert calls[:2] == ["meta", TORCH_DEVICE.type]
    assert_tree_allclose(jax.jit(jax.grad(lambda x: f(x).sum()))(x), jax.grad(lambda x: reference(x).sum())(x))
    assert_tree_allclose(jax.vmap(f)(x), reference(x))  # rows: a new signature, inferred afresh


def _avals(*shapes: tuple[int, ...]) -> tuple[Aval, ...]:
    return tuple(Aval(shape, np.dtype(np.float32)) for shape in shapes)


# A device this PyTorch cannot make tensors on, CPU build or CUDA build alike.
_UNUSABLE = torch.device("xpu")


def test_inference_tries_the_cpu_when_the_calls_device_fails():
    # Under jax.jit the call's device is JAX's default device, a guess for a
    # call on arrays committed elsewhere: a function closing over CPU tensors
    # must still infer when the guess fails.
    calls: list[str] = []
    inferred = infer_outputs(lambda x: (_scaled_by(torch.ones(3), calls)(x),), _avals((3,)), "f", _UNUSABLE)
    (out,), where = inferred.outputs, inferred.device
    assert out.shape == (3,) and out.dtype == torch.float32 and where == torch.device("cpu")
    assert calls == ["meta", "cpu", "cpu"]  # on zeros, then on ones (NOTE [a second run, on ones])


def test_inference_reports_the_calls_devices_error():
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"broken on {x.device.type}")

    on_cpu = r"ValueError: broken on cpu\n.*on zeros on cpu; on ones it raised ValueError: broken on cpu; pass output_"
    with pytest.raises(t2j_ad.TorchCallError, match=on_cpu):
        infer_outputs(broken, _avals((3,)), "broken", torch.device("cpu"))
    with pytest.raises(t2j_ad.TorchCallError, match=r"\(while inferring output shapes on zeros on xpu;"):
        infer_outputs(broken, _avals((3,)), "broken", _UNUSABLE)


def test_inference_tries_the_other_gpus_before_the_cpu(monkeypatch):
    # A jitted call on arrays committed to JAX's second GPU, closing over a
    # weight on cuda:1: the guess (JAX's default device, cuda:0) fails there,
    # and cuda:1 is tried before the CPU. A CPU PyTorch cannot make CUDA
    # tensors, so the stand-in runs the function on CPU zeros for "cuda:1".
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    cuda = [torch.device("cuda", i) for i in range(3)]
    assert inference.devices_to_try(cuda[1]) == [cuda[1], cuda[0], cuda[2], torch.device("cpu")]
    assert inference.devices_to_try(torch.device("cpu")) == [torch.device("cpu")]

    real_run = inference._run
    tried: list[str] = []

    def run_where_the_weight_is(fn, avals, device, name, *args, **kwargs):
        tried.append(str(device))
        if device != cuda[1]:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found {device} and cuda:1")
        return real_run(fn, avals, torch.device("cpu"), name, *args, **kwargs)

    monkeypatch.setattr(inference, "_run", run_where_the_weight_is)
    w = torch.linspace(0.5, 2.0, 3)
    inferred = infer_outputs(lambda x: (torch.tanh(x * w).to(torch.float64),), _avals((2, 3)), "f", cuda[0])
    (out,), where = inferred.outputs, inferred.device
    assert tried == ["meta", "cuda:0", "cuda:1", "cuda:1"]  # the last: on ones (NOTE [a second run, on ones])
    assert out.shape == (2, 3) and out.dtype == torch.float64 and where == cuda[1]

    tried.clear()
    infer_outputs(lambda x: (x * w,), _avals((3,)), "f", cuda[2])
    assert tried == ["meta", "cuda:2", "cuda:0", "cuda:1", "cuda:1"]

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("broken everywhere")

    tried.clear()
    reported = r"found cuda:0 and cuda:1\n\(while inferring output shapes on zeros on cuda:0;"
    with pytest.raises(t2j_ad.TorchCallError, match=reported):
        infer_outputs(broken, _avals((3,)), "broken", cuda[0])
    # on zeros, then on ones (NOTE [inference on ones when zeros fail]), on every device
    assert tried == ["meta", "cuda:0", "cuda:1", "cuda:2", "cpu", "cuda:0", "cuda:1", "cuda:2", "cpu"]


@pytest.mark.skipif(
    not ON_GPU or len(jax.devices()) < 2,
    reason=f"needs two CUDA GPUs as JAX's devices (JAX has {len(jax.devices())} {jax.default_backend()} device(s))",
)
def test_a_jitted_call_on_the_second_gpu_infers_there():
    # Every argument is traced, so the guess is JAX's default device (GPU 0),
    # where zeros cannot meet the weight on the second GPU.
    second = jax.devices()[1]
    w = np.linspace(0.5, 2.0, 5, dtype=np.float32)
    weight = torch.as_tensor(w, device=torch_device(second))
    f = t2j_ad.jaxify(lambda x: torch.tanh(x * weight))
    x = jax.device_put(jnp.linspace(-1.0, 1.0, 15, dtype=jnp.float32).reshape(3, 5), second)
    out = jax.jit(f)(x)
    assert out.devices() == {second}
    assert_tree_allclose(out, jnp.tanh(x * w))


class _GpuDevice:
    """Stands in for a JAX GPU device: what torch_device and jax_device read."""

    platform = "gpu"

    def __init__(self, cuda_index: int) -> None:
        self.local_hardware_id = cuda_index


def test_torch_device_of_jax_devices():
    assert torch_device(jax.devices("cpu")[0]) == torch.device("cpu")
    assert torch_device(_GpuDevice(1)) == torch.device("cuda", 1)


def test_jax_device_finds_the_gpu_by_its_cuda_index(monkeypatch):
    # A process that JAX lets see only CUDA GPUs 2 and 3
    # (jax.distributed.initialize(local_device_ids=[2, 3])): cuda:3 is JAX's
    # second local GPU, not its fourth.
    gpus = [_GpuDevice(2), _GpuDevice(3)]
    local_devices = jax.local_devices
    monkeypatch.setattr(
        jax, "local_devices", lambda backend=None: gpus if backend == "gpu" else local_devices(backend=backend)
    )
    assert jax_device(torch.device("cuda", 3)) is gpus[1]
    assert jax_device(torch.device("cpu")) == jax.local_devices(backend="cpu")[0]
    with pytest.raises(ValueError, match=r"cuda:0 has no JAX device: JAX's local GPUs have CUDA indices \[2, 3\]"):
        jax_device(torch.device("cuda", 0))


@cuda_only
def test_jax_device_inverts_torch_device():
    for device in jax.local_devices(backend="gpu"):
        assert jax_device(torch_device(device)) == device


# --------------------------------------------- outputs on another device


def _on_meta(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(x.shape, device="meta")


def _tuple_on_meta(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, torch.zeros(x.shape, device="meta")


@pytest.mark.parametrize("compile", ["eager", "graph"])
@pytest.mark.parametrize("fn, output", [(_on_meta, "_on_meta: output"), (_tuple_on_meta, r"_tuple_on_meta: output\[1\]")])
def test_output_on_another_device_is_refused(fn, output, compile):
    f = t2j_ad.jaxify(fn, compile=compile)
    with pytest.raises(RAISED, match=rf"{output} is on device meta, but this call runs on {TORCH_DEVICE}") as info:
        jax.block_until_ready(f(jnp.ones(3)))
    assert "device=x.device" in str(info.value)
    # The process lives on, and a correct function still runs.
    assert_tree_allclose(t2j_ad.jaxify(lambda x: x * 2)(jnp.ones(3)), jnp.full(3, 2.0))


@cuda_only
def test_cpu_output_in_a_gpu_call_is_refused():
    f = t2j_ad.jaxify(lambda x: (x * 2).cpu())
    x = jnp.ones(3)
    with pytest.raises(RAISED, match=r": output is on device cpu, but this call runs on cuda"):
        jax.block_until_ready(f(x))
    with pytest.raises(RAISED, match=r"is on device cpu, but this call runs on cuda"):
        jax.block_until_ready(jax.grad(lambda x: f(x).sum())(x))


@cuda_only
def test_cpu_module_runs_on_the_gpu():
    module = Shift()  # built on the CPU; JAX's default device is the GPU
    apply, params = t2j_ad.jaxify_module(module)
    assert all(d.platform == "gpu" for p in params.values() for d in p.devices())
    shift = jnp.asarray(module.shift.numpy())
    assert_tree_allclose(jax.jit(apply)(params, _x()), _shift_jax(params, shift, _x()))
    with torch.no_grad():
        module.shift.mul_(3.0)  # changed in place: the next call sees it
    assert_tree_allclose(jax.jit(apply)(params, _x() + 0), _shift_jax(params, shift * 3.0, _x()))


# ---------------------------------------------------------- conversions


def test_j2t_of_a_tracer_is_a_runtime_error():
    @jax.jit
    def f(x):
        with pytest.raises(RuntimeError, match="traced value"):
            j2t(x)
        with pytest.raises(TypeError, match="traced value"):
            compat.j2t(x, via="host")
        return x

    f(jnp.ones(2))
    assert issubclass(ArrayConversionError, RuntimeError) and issubclass(ArrayConversionError, TypeError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.bool])
def test_host_copies_round_trip(dtype, x64):
    t = torch.arange(6).reshape(2, 3).to(dtype)
    a = copy_to_jax(t)
    assert a.devices() == {jax.devices()[0]}
    back = copy_to_torch(a)
    assert back.dtype == dtype and back.device == TORCH_DEVICE
    assert torch.equal(back.cpu(), t)
    t[0, 0] = 5  # the copies do not share memory
    assert not torch.equal(back.cpu(), t)


@pytest.mark.parametrize("via", ["dlpack", "cpu", "host"])
def test_compat_conversions_keep_the_device(via):
    x = jnp.linspace(0.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)
    (device,) = x.devices()
    t = compat.j2t(x, via=via)
    assert t.device.type == ("cuda" if device.platform == "gpu" else "cpu")
    back = compat.t2j(t, via=via)
    assert back.devices() == {device}
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


@cuda_only
def test_trees_keep_each_leafs_device():
    tree = {"gpu": torch.ones(2, device="cuda"), "cpu": torch.ones(3), "n": 1}
    arrays = t2j_ad.tree_t2j(tree)
    assert arrays["n"] == 1
    assert {d.platform for d in arrays["gpu"].devices()} == {"gpu"}
    assert {d.platform for d in arrays["cpu"].devices()} == {"cpu"}
    back = t2j_ad.tree_j2t(arrays)
    assert back["gpu"].is_cuda and not back["cpu"].is_cuda


@cuda_only
def test_xla_stream_is_wrapped_once_per_device():
    from t2j_ad import cuda_streams

    f = jax.jit(t2j_ad.jaxify(lambda x: torch.sin(x) * 2))
    x = jnp.ones(8)
    for _ in range(3):
        assert_tree_allclose(f(x), jnp.sin(x) * 2)
    wrapped = dict(cuda_streams._external_streams)
    assert wrapped and all(s.device_index == device for (_, device), s in wrapped.items())
    assert_tree_allclose(f(x + 1), jnp.sin(x + 1) * 2)
    assert cuda_streams._external_streams == wrapped


def test_tree_j2t_of_a_call_that_failed_raises_its_error():
    # NOTE [a failed computation read through DLPack]: on a GPU a failed
    # call's arrays come back before its error, and torch.from_dlpack never
    # raised it; PyTorch read a buffer nothing had written (an H100: a
    # nested call's refusal was lost and the outer derivative went on).
    def refuses_negatives(x):
        if bool((x < 0).any()):
            raise ValueError("refuses_negatives: a negative input")
        return x * 2

    f = t2j_ad.jaxify(refuses_negatives)
    np.testing.assert_array_equal(to_numpy(t2j_ad.tree_j2t(f(jnp.ones(3, jnp.float32)))), np.full(3, 2.0))
    with pytest.raises(Exception, match="a negative input"):
        t2j_ad.tree_j2t(f(-jnp.ones(3, jnp.float32)))
