"""The C++ FFI backend: the handler in csrc/ and backends/ffi.py.

The first half drives ``t2j_ad._ffi_ext`` directly, through ``jax.ffi.ffi_call``
and a dispatcher of our own, so the handler is tested apart from the rest of
t2j_ad. The second half goes through ``t2j_ad.jaxify`` with the FFI backend
forced, and checks the registry's lifetime rules.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import ON_GPU, TORCH_DEVICE, cuda_only

ffi_ext = pytest.importorskip("t2j_ad._ffi_ext", reason="C++ extension not built")

import t2j_ad  # noqa: E402
from t2j_ad import backends  # noqa: E402
from t2j_ad.backends import ffi, registry  # noqa: E402

TEST_TARGET = "t2j_ad_test_handler"
for _platform, _capsule in ffi_ext.handlers().items():
    jax.ffi.register_ffi_target(TEST_TARGET, _capsule, platform=_platform)


@pytest.fixture
def live_tensors():
    """How many of the tensors the handler wrapped for this test are alive:
    ``ffi_ext.live_tensors()`` less the count the test started with. A tensor
    an earlier test leaked (on the same xdist worker) counts in that test,
    not in every test here after it."""
    gc.collect()  # an earlier test's garbage, freed before the count is taken
    before = ffi_ext.live_tensors()
    return lambda: ffi_ext.live_tensors() - before


@pytest.fixture
def dispatcher():
    """Install a test dispatcher: ``dispatcher(fn)``; restores the real one.

    The test dispatcher gets every call (no runner table) and the raw DLPack
    capsules (no ``wrap``)."""

    def install(fn):
        ffi_ext.set_dispatcher(fn)

    yield install
    ffi.install_dispatcher()


def call(target, key, out_shapes, *args):
    return jax.ffi.ffi_call(target, out_shapes)(*args, key=np.int64(key))


def tensors(caps):
    return [torch.from_dlpack(c) for c in caps]


def on_stream(stream):
    """PyTorch's work in a test dispatcher goes on XLA's stream, as the
    runtime's does: the CUDA handler passes it; the CPU handler passes 0."""
    return torch.cuda.stream(torch.cuda.ExternalStream(stream)) if stream else contextlib.nullcontext()


# -- the handler on its own ----------------------------------------------

# (jax dtype, torch dtype, an op that gives different results for a
# mislabelled dtype, the same op in JAX)
DTYPES = [
    (jnp.float16, torch.float16, lambda t: t * 3 + 0.1, lambda x: x * 3 + jnp.asarray(0.1, x.dtype)),
    (jnp.bfloat16, torch.bfloat16, lambda t: t * 3 + 0.1, lambda x: x * 3 + jnp.asarray(0.1, x.dtype)),
    (jnp.float32, torch.float32, lambda t: t * 3 + 0.1, lambda x: x * 3 + jnp.asarray(0.1, x.dtype)),
    (jnp.float64, torch.float64, lambda t: t * 3 + 0.1, lambda x: x * 3 + jnp.asarray(0.1, x.dtype)),
    (jnp.int8, torch.int8, lambda t: t * 3 - 1, lambda x: x * 3 - 1),
    (jnp.int16, torch.int16, lambda t: t * 3 - 1, lambda x: x * 3 - 1),
    (jnp.int32, torch.int32, lambda t: t * 3 - 1, lambda x: x * 3 - 1),
    (jnp.int64, torch.int64, lambda t: t * 3 - 1, lambda x: x * 3 - 1),
    (jnp.uint8, torch.uint8, lambda t: t * 3 + 1, lambda x: x * 3 + 1),
    (jnp.bool_, torch.bool, torch.logical_not, jnp.logical_not),
    (jnp.complex64, torch.complex64, lambda t: t * (1 + 2j), lambda x: x * (1 + 2j)),
    (jnp.complex128, torch.complex128, lambda t: t * (1 + 2j), lambda x: x * (1 + 2j)),
]
SHAPES = [(5,), (2, 3), (), (0,), (3, 0, 2)]


def _example(dtype, shape):
    n = int(np.prod(shape))
    values = np.arange(n).reshape(shape) - 2
    if dtype == jnp.bool_:
        values = values % 2 == 0
    elif np.issubdtype(dtype, np.complexfloating):
        values = values + 0.5j
    elif dtype == jnp.uint8:
        values = values + 2
    return jnp.asarray(values, dtype=dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("jdtype,tdtype,op,ref", DTYPES, ids=lambda v: getattr(v, "__name__", ""))
def test_every_dtype_and_shape_zero_copy(dispatcher, jdtype, tdtype, op, ref, shape, live_tensors):
    seen = {}

    def dispatch(key, inputs, outputs, stream):
        (x,), (out, marker) = tensors(inputs), tensors(outputs)
        seen.update(key=key, stream=stream, dtype=x.dtype, shape=tuple(x.shape), out_shape=tuple(out.shape), ptr=x.data_ptr())
        with on_stream(stream):
            out.copy_(op(x))
            marker.fill_(x.dim())

    dispatcher(dispatch)
    with jax.enable_x64(True):
        x = _example(jdtype, shape)
        # The marker output keeps XLA from skipping a call whose result is empty.
        outs = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((1,), jnp.int32))
        y, marker = jax.jit(lambda x: call(TEST_TARGET, 7, outs, x))(x)
        assert y.dtype == x.dtype and y.shape == shape and int(marker[0]) == len(shape)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(ref(x)))
    assert seen["key"] == 7 and bool(seen["stream"]) == ON_GPU  # XLA's stream on a GPU; none on the CPU
    assert seen["dtype"] == tdtype
    assert seen["shape"] == shape and seen["out_shape"] == shape
    if x.size:  # zero-copy: PyTorch saw the very buffer JAX passed in
        assert seen["ptr"] == x.unsafe_buffer_pointer()
    assert live_tensors() == 0


def test_many_inputs_and_outputs(dispatcher):
    def dispatch(key, inputs, outputs, stream):
        a, b, c = tensors(inputs)
        s, p = tensors(outputs)
        with on_stream(stream):
            s.copy_(a.sum() + b.sum() + c.to(torch.float32).sum())
            p.copy_(torch.outer(a, b))

    dispatcher(dispatch)
    a, b, c = jnp.arange(3.0), jnp.ones(4), jnp.arange(5, dtype=jnp.int32)
    shapes = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((3, 4), jnp.float32))
    s, p = jax.jit(lambda *xs: call(TEST_TARGET, 1, shapes, *xs))(a, b, c)
    assert float(s) == 3.0 + 4.0 + 10.0
    np.testing.assert_array_equal(p, jnp.outer(a, b))


def test_no_inputs(dispatcher):
    def dispatch(key, inputs, outputs, stream):
        assert inputs == []
        with on_stream(stream):
            tensors(outputs)[0].fill_(key)

    dispatcher(dispatch)
    y = jax.jit(lambda: call(TEST_TARGET, 42, jax.ShapeDtypeStruct((2,), jnp.int32)))()
    np.testing.assert_array_equal(y, [42, 42])


def test_unconsumed_and_kept_capsules_are_freed(dispatcher, live_tensors):
    kept = []

    def dispatch(key, inputs, outputs, stream):
        if key == 1:  # never converts the capsules
            return
        kept.append(torch.from_dlpack(inputs[0]))  # outlives the call

    dispatcher(dispatch)
    x = jnp.ones(3)
    out = jax.ShapeDtypeStruct((3,), jnp.float32)
    jax.block_until_ready(jax.jit(lambda x: call(TEST_TARGET, 1, out, x))(x))
    assert live_tensors() == 0
    jax.block_until_ready(jax.jit(lambda x: call(TEST_TARGET, 2, out, x))(x))
    assert live_tensors() == 1
    kept.clear()
    assert live_tensors() == 0


@pytest.fixture
def wrapped_before_the_test(dispatcher):
    """A tensor the handler wrapped before the test and kept through it, as
    one an earlier test on the same worker leaked."""
    kept = []
    dispatcher(lambda key, inputs, outputs, stream: kept.append(torch.from_dlpack(inputs[0])))
    out = jax.ShapeDtypeStruct((3,), jnp.float32)
    jax.block_until_ready(jax.jit(lambda x: call(TEST_TARGET, 1, out, x))(jnp.ones(3)))
    assert len(kept) == 1 and ffi_ext.live_tensors() >= 1
    yield
    kept.clear()


def test_a_tensor_wrapped_before_a_test_is_no_leak_of_that_test(wrapped_before_the_test, live_tensors, dispatcher):
    """One tensor leaked by a test elsewhere (tests/test_ad.py, on an xdist
    worker of an H100 run) failed every count of live tensors here after it,
    30 tests: each test now counts from where it started."""
    dispatcher(lambda key, inputs, outputs, stream: None)  # converts nothing
    out = jax.ShapeDtypeStruct((3,), jnp.float32)
    jax.block_until_ready(jax.jit(lambda x: call(TEST_TARGET, 2, out, x))(jnp.ones(3)))
    assert live_tensors() == 0
    assert ffi_ext.live_tensors() >= 1  # the tensor wrapped before, still alive


def test_exception_carries_message_and_traceback(dispatcher, live_tensors):
    def failing_torch_function(x):
        raise ValueError("torch says no: shapes (3,) and (4,)")

    def dispatch(key, inputs, outputs, stream):
        if key == 13:
            failing_torch_function(*tensors(inputs))
        with on_stream(stream):
            tensors(outputs)[0].copy_(tensors(inputs)[0] + 1)

    dispatcher(dispatch)
    x = jnp.arange(3.0)
    out = jax.ShapeDtypeStruct((3,), jnp.float32)
    with pytest.raises(Exception) as info:
        jax.block_until_ready(jax.jit(lambda x: call(TEST_TARGET, 13, out, x))(x))
    text = str(info.value)
    assert "ValueError: torch says no: shapes (3,) and (4,)" in text
    assert "Traceback (most recent call last)" in text
    assert "failing_torch_function" in text  # the frame that raised
    assert live_tensors() == 0
    # The process keeps working, on the same and on other programs.
    for _ in range(3):
        y = jax.jit(lambda x: call(TEST_TARGET, 14, out, x))(x)
        np.testing.assert_array_equal(y, x + 1)


def test_no_dispatcher_is_an_error_not_a_crash(dispatcher):
    dispatcher(None)
    with pytest.raises(Exception, match="no Python dispatcher is registered"):
        jax.block_until_ready(call(TEST_TARGET, 1, jax.ShapeDtypeStruct((2,), jnp.float32), jnp.ones(2)))


def test_set_dispatcher_rejects_non_callables():
    with pytest.raises(TypeError, match="callable"):
        ffi_ext.set_dispatcher(3)


def test_runner_table_is_called_directly_with_wrapped_buffers(dispatcher, live_tensors):
    calls = []

    def runner(inputs, outputs, stream):
        calls.append(("runner", type(inputs[0]), bool(stream)))
        with on_stream(stream):
            outputs[0].copy_(inputs[0] * 3)

    def fallback(key, inputs, outputs, stream):
        calls.append(("dispatcher", key))
        with on_stream(stream):
            outputs[0].copy_(inputs[0] - 1)

    ffi_ext.set_dispatcher(fallback, runners={5: runner}, wrap=torch.from_dlpack)
    x = jnp.arange(4.0)
    out = jax.ShapeDtypeStruct((4,), jnp.float32)
    np.testing.assert_array_equal(jax.jit(lambda x: call(TEST_TARGET, 5, out, x))(x), x * 3)
    np.testing.assert_array_equal(jax.jit(lambda x: call(TEST_TARGET, 6, out, x))(x), x - 1)
    assert calls == [("runner", torch.Tensor, ON_GPU), ("dispatcher", 6)]
    assert live_tensors() == 0


def test_an_exception_in_wrap_is_an_error_not_a_crash(dispatcher, live_tensors):
    def wrap(capsule):
        raise ValueError("cannot wrap this buffer")

    ffi_ext.set_dispatcher(lambda *args: None, runners={}, wrap=wrap)
    with pytest.raises(Exception, match="ValueError: cannot wrap this buffer"):
        jax.block_until_ready(call(TEST_TARGET, 1, jax.ShapeDtypeStruct((2,), jnp.float32), jnp.ones(2)))
    assert live_tensors() == 0


def test_set_dispatcher_checks_runners_and_wrap():
    with pytest.raises(TypeError, match="runners must be a dict"):
        ffi_ext.set_dispatcher(ffi._dispatch, runners=[], wrap=None)
    with pytest.raises(TypeError, match="wrap must be a callable"):
        ffi_ext.set_dispatcher(ffi._dispatch, runners=None, wrap=3)
    ffi.install_dispatcher()


def test_unsupported_dtype_is_an_error(live_tensors):
    x = jnp.ones(4, dtype=jnp.float8_e4m3b11fnuz)  # an XLA type with no DLPack code
    with pytest.raises(Exception, match="no DLPack/PyTorch equivalent"):
        jax.block_until_ready(call(TEST_TARGET, 1, jax.ShapeDtypeStruct((4,), jnp.float32), x))
    assert live_tensors() == 0


def test_unknown_key_through_the_real_dispatcher(live_tensors):
    assert ffi.available()
    out = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(Exception, match="no PyTorch function is registered under key 123456789"):
        jax.block_until_ready(call(ffi.TARGET, 123456789, out, jnp.ones(2)))
    assert live_tensors() == 0


# -- through t2j_ad.jaxify, with the FFI backend forced ---------------------


@pytest.fixture(autouse=False)
def ffi_backend(monkeypatch):
    monkeypatch.setenv("T2J_AD_BACKEND", "ffi")
    assert backends.select() is ffi
    yield
    jax.clear_caches()


def _sin2(x):
    return torch.sin(x) * 2


def _keys_in(lowered) -> list[int]:
    import re

    text = lowered.as_text()
    assert ffi.TARGET in text
    return [int(k) for k in re.findall(r"key = (\d+) : i64", text)]


def test_jaxify_under_jit_grad_vmap(ffi_backend):
    f = t2j_ad.jaxify(_sin2)
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    np.testing.assert_allclose(jax.jit(f)(x), jnp.sin(x) * 2, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: f(x).sum())(x), jnp.cos(x) * 2, rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(f)(x.reshape(2, 4)), jnp.sin(x.reshape(2, 4)) * 2, rtol=1e-6)
    np.testing.assert_allclose(
        jax.hessian(lambda x: f(x).sum())(x[:3]), jnp.diag(-jnp.sin(x[:3]) * 2), rtol=1e-5, atol=1e-6
    )


@cuda_only
def test_on_the_gpu_pytorch_runs_on_xlas_stream_without_copies(ffi_backend):
    seen = {}

    def probe(x):
        if x.device.type != "meta":
            seen.update(device=x.device, ptr=x.data_ptr(), stream=torch.cuda.current_stream(x.device).cuda_stream)
        return torch.sin(x) * 2

    f = jax.jit(t2j_ad.jaxify(probe, compile="eager"))
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    f(x)  # the first call hands PyTorch a copy, until it has seen probe leave its input alone
    np.testing.assert_allclose(f(x), jnp.sin(x) * 2, rtol=1e-6)
    assert seen["device"] == TORCH_DEVICE
    assert seen["ptr"] == x.unsafe_buffer_pointer()  # XLA's own buffer
    # XLA's stream (torch.cuda.ExternalStream), not PyTorch's default one.
    assert seen["stream"] not in (0, torch.cuda.default_stream(TORCH_DEVICE).cuda_stream)


def test_jaxify_lowers_to_the_custom_call_with_stable_keys(ffi_backend):
    f = t2j_ad.jaxify(_sin2)
    g = t2j_ad.jaxify(_sin2)
    x = jnp.ones(8)
    (k1,) = _keys_in(jax.jit(f).lower(x))
    (k2,) = _keys_in(jax.jit(lambda x: f(x)).lower(x))  # a fresh trace
    (k3,) = _keys_in(jax.jit(g).lower(x))  # another jaxify'd function
    assert k1 == k2
    assert k3 != k1


def test_jaxify_exception_reaches_the_caller(ffi_backend):
    def broken(x):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    f = t2j_ad.jaxify(broken, output_shapes=jax.ShapeDtypeStruct((3,), jnp.float32))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(jax.jit(f)(jnp.ones(3)))
    assert "mat1 and mat2 shapes cannot be multiplied" in str(info.value)
    assert "broken" in str(info.value)  # the traceback names the PyTorch frame
    g = t2j_ad.jaxify(_sin2)
    np.testing.assert_allclose(jax.jit(g)(jnp.ones(3)), jnp.sin(jnp.ones(3)) * 2, rtol=1e-6)


def _run_fresh_wrappers(n):
    x = jnp.ones(4)
    for i in range(n):
        f = t2j_ad.jaxify(lambda x, i=i: x * i)
        jax.block_until_ready(jax.jit(f)(x))


def test_registry_releases_dropped_wrappers(ffi_backend):
    jax.clear_caches()
    gc.collect()
    before = registry.size()
    _run_fresh_wrappers(200)
    gc.collect()
    # Nothing but JAX's own bounded caches (cleared by jax.clear_caches, which
    # t2j_ad.clear_caches calls) can still hold a dropped wrapper's TorchFn...
    assert registry.size() - before <= 200
    jax.clear_caches()
    gc.collect()
    # ...and once they let go, the entries are gone without any clear().
    assert registry.size() - before < 10, registry.size()


def test_registry_releases_dropped_wrappers_without_clearing_jax(ffi_backend):
    # JAX's abstract-eval cache (an LRU of 2048) would hold primitive params
    # strongly; _jax_internals registers TorchFn as a weakly held cache key.
    jax.clear_caches()
    gc.collect()
    before = registry.size()
    _run_fresh_wrappers(150)
    gc.collect()
    assert registry.size() - before < 10, registry.size()


def test_compiled_executable_keeps_its_entry_alive(ffi_backend):
    x = jnp.arange(4.0)
    lowered = jax.jit(t2j_ad.jaxify(_sin2)).lower(x)
    (key,) = _keys_in(lowered)
    compiled = lowered.compile()
    del lowered
    gc.collect()
    size = registry.size()
    jax.clear_caches()
    gc.collect()
    # Only the executable refers to the function now, and it still runs.
    np.testing.assert_allclose(compiled(x), jnp.sin(x) * 2, rtol=1e-6)
    assert registry.size() == size
    assert key in registry.runners  # the handler's hot path for this key
    del compiled
    gc.collect()
    assert registry.size() == size - 1
    # The runner does not keep its TorchFn alive, and left with it.
    assert key not in registry.runners


def test_clear_caches_leaves_programs_still_held_working(ffi_backend):
    """clear_caches emptied the registry, so an ahead-of-time compiled
    program, or a jitted call on another thread, failed with LookupError;
    entries now go with the programs that hold them."""
    f = t2j_ad.jaxify(_sin2)
    x = jnp.arange(4.0)
    jax.jit(f)(x)
    compiled = jax.jit(f).lower(x).compile()
    t2j_ad.clear_caches()
    gc.collect()
    held = registry.size()  # the held program's entry among them
    assert held >= 1
    np.testing.assert_allclose(compiled(x), jnp.sin(x) * 2, rtol=1e-6)
    del compiled
    gc.collect()
    assert registry.size() == held - 1
    np.testing.assert_allclose(jax.jit(f)(x), jnp.sin(x) * 2, rtol=1e-6)


@pytest.mark.skipif(
    os.environ.get("T2J_AD_SLOW") != "1",
    reason="slow (100,000 calls, minutes): set T2J_AD_SLOW=1; benchmarks/bench_registry_memory.py measures the same",
)
def test_memory_flat_over_many_fresh_wrappers(ffi_backend):
    import resource

    x = jnp.ones(4)

    def run(n):
        for i in range(n):
            jax.block_until_ready(jax.jit(t2j_ad.jaxify(lambda x, i=i: x * i))(x))
        gc.collect()

    run(2000)
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run(20000)
    end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert registry.size() < 10
    assert end - start < 50 * 1024, (start, end)  # KiB


# -- one build for CPU and GPU (NOTE [one build for CPU and GPU] in csrc/) ----


def _lowered_for(platform, f, x) -> str:
    """StableHLO of ``jax.jit(f)(x)`` lowered for ``platform`` (``"cpu"`` or
    ``"cuda"``), whichever devices this machine has."""
    return jax.jit(f).trace(x).lower(lowering_platforms=(platform,)).as_text()


def test_every_build_holds_the_cuda_handler():
    # Built with or without a CUDA toolkit, and there either way.
    assert set(ffi_ext.handlers()) == {"cpu", "CUDA"}
    assert ffi_ext.has_cuda
    assert ffi.platforms() == {"cpu", "cuda"}


def test_a_cuda_lowering_uses_the_custom_call(ffi_backend):
    f = t2j_ad.jaxify(_sin2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no handler, using the callback backend"
        text = _lowered_for("cuda", f, jnp.ones(4))
    assert f"custom_call @{ffi.TARGET}" in text


def test_a_refused_cuda_registration_leaves_cpu_on_the_ffi(ffi_backend, monkeypatch):
    register = jax.ffi.register_ffi_target

    def refuse_cuda(name, fn, platform="cpu", **kwargs):
        if platform == "CUDA":
            raise RuntimeError("this jaxlib has no CUDA")
        return register(name, fn, platform=platform, **kwargs)

    monkeypatch.setattr(jax.ffi, "register_ffi_target", refuse_cuda)
    monkeypatch.setattr(ffi, "_registered", None)
    monkeypatch.setattr(ffi, "_warned_platforms", set())
    assert ffi.platforms() == {"cpu"}
    f = t2j_ad.jaxify(_sin2)
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    assert ffi.TARGET in _lowered_for("cpu", f, x)
    # CUDA, now without a handler, takes the callback backend, saying so once.
    with pytest.warns(RuntimeWarning, match=r"no handler for platform\(s\) \['cuda'\]"):
        text = _lowered_for("cuda", f, x)
    assert ffi.TARGET not in text
    # And it runs: through the FFI on a CPU, through the callback backend on a GPU.
    np.testing.assert_allclose(jax.jit(f)(x), jnp.sin(x) * 2, rtol=1e-6)


class _ModuleContext:
    """Stands in for a lowering's ``ctx.module_context``: its backend, and
    the host callbacks handed to it."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.host_callbacks: list = []

    def add_host_callback(self, callback) -> None:
        self.host_callbacks.append(callback)


def test_a_lowering_for_a_compile_only_client_keeps_its_functions_itself(monkeypatch):
    # Such a client (AOT cross-compilation for a described topology) takes
    # host callbacks only as capsules: compiling refused our holder, so no
    # t2j_ad function could be cross-compiled for GPUs (torch2jax's suite on
    # an H200). Its executables never run here; the holder lives on instead.
    from t2j_ad import _jax_internals

    class CompileOnly:
        pass

    monkeypatch.setattr(_jax_internals, "_CompileOnlyClient", CompileOnly)
    monkeypatch.setattr(ffi, "_compiled_elsewhere", [])

    class Ctx:
        def __init__(self, backend) -> None:
            self.module_context = _ModuleContext(backend)

    elsewhere, here = Ctx(CompileOnly()), Ctx(object())
    held = ffi.keep_alive(elsewhere)
    assert elsewhere.module_context.host_callbacks == [] and ffi._compiled_elsewhere == [held]
    tied = ffi.keep_alive(here)
    assert here.module_context.host_callbacks == [tied] and ffi._compiled_elsewhere == [held]
