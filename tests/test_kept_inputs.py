"""NOTE [inputs kept past a call]: a tensor the PyTorch function keeps past
its call that is an input, or a view of one, holds the value it had, as in
PyTorch, however XLA reuses the input's buffer after the call. Found by the
seventh fuzzing pass (BENCHMARKS.md): a streaming difference came out 0 in
every step of a ``lax.scan``, and a later write through a kept input changed
an immutable JAX array."""

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
from conftest import ON_GPU, TORCH_DEVICE, to_numpy

import t2j_ad
from t2j_ad import kept_inputs, runtime

# NOTE [inputs kept past a call]: GPU calls do not look for kept inputs yet.
# T2J_AD_TEST_KEPT_INPUTS_ON_CUDA=1 runs these tests on a GPU with the look
# turned on there (scripts/run_gpu_checks.sh's step kept-inputs-on-cuda), to
# find whether it can be on for users.
LOOK_ON_CUDA = os.environ.get("T2J_AD_TEST_KEPT_INPUTS_ON_CUDA") == "1"
pytestmark = pytest.mark.skipif(
    ON_GPU and not LOOK_ON_CUDA,
    reason="kept inputs are moved on the CPU only: the look is not yet checked on CUDA (torch 2.11 lacks "
    "UntypedStorage._swap_data_ptr_, and an H100 run saw calls that keep nothing flagged)",
)


@pytest.fixture(autouse=True)
def _look_on_cuda(monkeypatch):
    """With LOOK_ON_CUDA, CUDA calls look for kept inputs as CPU calls do."""
    if LOOK_ON_CUDA:
        monkeypatch.setattr(runtime, "_on_cuda", lambda inputs: False)


class _Delta(torch.nn.Module):
    """A streaming module: the difference from the previous input."""

    def __init__(self) -> None:
        super().__init__()
        self.prev: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x - self.prev if self.prev is not None else torch.zeros_like(x)
        self.prev = x
        return d


def _deltas(xs: np.ndarray) -> np.ndarray:
    module = _Delta()
    return np.stack([module(torch.tensor(x)).numpy() for x in xs])


_XS = np.cumsum(np.random.default_rng(0).normal(size=(6, 3)), 0)


@pytest.mark.parametrize("compile", ["eager", "graph"])
def test_a_streaming_module_keeping_its_input_matches_pytorch(compile):
    apply, params = t2j_ad.jaxify_module(_Delta(), compile=compile)
    step = jax.jit(lambda p, x: apply(p, x * 1.0))  # the input: a buffer of the jit, freed after it
    with pytest.warns(t2j_ad.FallbackWarning) if compile == "graph" else contextlib.nullcontext():
        outs = np.stack([to_numpy(step(params, jnp.asarray(x, jnp.float32))) for x in _XS])
    np.testing.assert_allclose(outs, _deltas(_XS.astype(np.float32)), rtol=1e-6, atol=1e-6)

    apply, params = t2j_ad.jaxify_module(_Delta(), compile=compile)
    scan = jax.jit(lambda p, xs: jax.lax.scan(lambda c, x: (c, apply(p, x)), 0.0, xs)[1])
    with pytest.warns(t2j_ad.FallbackWarning) if compile == "graph" else contextlib.nullcontext():
        ys = to_numpy(scan(params, jnp.asarray(_XS, jnp.float32)))  # the scan reuses its step's buffer
    np.testing.assert_allclose(ys, _deltas(_XS.astype(np.float32)), rtol=1e-6, atol=1e-6)


def test_a_kept_view_holds_its_value_after_xla_reuses_the_buffer():
    kept = []

    def fn(x):
        kept.append(x[1:])
        return x * 2

    step = jax.jit(lambda x: t2j_ad.jaxify(fn)(jnp.sin(x)))
    for i in range(3):
        jax.block_until_ready(step(jnp.full((4,), float(i))))
        [jax.block_until_ready(jnp.full((4,), -1.0) + 0) for _ in range(50)]  # same-sized work after it
        np.testing.assert_allclose(to_numpy(kept[-1]), np.full(3, np.sin(float(i)), np.float32), rtol=1e-6)


def test_a_later_write_through_a_kept_input_leaves_jax_arrays_alone():
    state = {}

    def fn(x, reset):
        if bool(reset):
            state["acc"] = x
        else:
            state["acc"].mul_(0.5)
        return x * 1

    f = t2j_ad.jaxify(fn)
    jax.block_until_ready(f(jnp.ones(4), True))  # the first call runs on copies
    x = jnp.ones(4) + 1.0
    jax.block_until_ready(f(x, True))
    jax.block_until_ready(f(jnp.zeros(4), False))
    np.testing.assert_array_equal(to_numpy(x), np.full(4, 2.0, np.float32))  # a JAX array never changes
    np.testing.assert_array_equal(to_numpy(state["acc"]), np.full(4, 1.0, np.float32))  # PyTorch's write


# NOTE [the move's copy is no write of the run around]: a jaxified call that
# keeps its input, made inside another jaxified function's trial run, moves
# it there. The move's copy was taken for a write of that run, which put
# back uninitialized memory into the caller's array when it ended.
_NESTED_KEEPERS = ("a_list", "a_module")


def _keeping_inner(keeper: str, kept: list[torch.Tensor]):
    """A jaxified ``(w, x) -> x * w`` that keeps its input ``w`` past the call."""
    if keeper == "a_list":

        def fn(w, x):
            kept.append(w)
            return x * w

        return t2j_ad.jaxify(fn)

    class Keeping(torch.nn.Module):
        def forward(self, w, x):
            self.prev = w
            kept.append(w)
            return x * w

    apply, _ = t2j_ad.jaxify_module(Keeping())
    return lambda w, x: apply({}, w, x)


@pytest.mark.parametrize("compile", ["eager", "graph"])
@pytest.mark.parametrize("keeper", _NESTED_KEEPERS)
def test_a_nested_call_keeping_its_input_in_its_callers_trial_run_leaves_the_callers_array_alone(keeper, compile):
    kept: list[torch.Tensor] = []
    inner = _keeping_inner(keeper, kept)
    w = jnp.arange(1.0, 4.0)
    n = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)), jnp.float32)
    for _ in range(2):  # the first call runs on copies; the later ones on w's own buffer
        jax.block_until_ready(inner(w, n))
    outer = t2j_ad.jaxify(lambda x: x * t2j_ad.tree_j2t(inner(w, n)).clone(), compile=compile)
    x = jnp.full((4, 3), 2.0)
    for step in range(3):  # the first runs the outer's trial runs, each with a call of the inner
        with pytest.warns(t2j_ad.FallbackWarning) if compile == "graph" and not step else contextlib.nullcontext():
            got = to_numpy(outer(x))  # graph mode: it calls a jaxified function, so runs eagerly
        [jax.block_until_ready(jnp.full((3,), -1.0) + 0) for _ in range(50)]  # same-sized work after it
        np.testing.assert_array_equal(to_numpy(w), np.arange(1.0, 4.0, dtype=np.float32))
        np.testing.assert_allclose(got, to_numpy(x * n * w), rtol=1e-6)
        np.testing.assert_array_equal(to_numpy(kept[-1]), np.arange(1.0, 4.0, dtype=np.float32))


# NOTE [inputs kept by their address]: what holds an input's memory by its
# address, which moving the storage does not reach (found by the ninth
# fuzzing pass: a logging forward's arrays read XLA's reused buffers, and
# writes through them segfaulted). NumPy reaches only the host's memory: on
# the CPU ``.cpu()`` is the tensor itself, so the NumPy holders below hold
# the input's memory; on CUDA it is the copy to the host that NumPy itself
# needs (``np.asarray`` of a CUDA tensor is refused), which holds nothing of
# the input, and the call must give the same log. DLPack holds the input's
# memory on either device.
_BY_ADDRESS = {
    "numpy": lambda x: x.detach().cpu().numpy(),
    "asarray": lambda x: np.asarray(x.detach().cpu()),
    "memoryview": lambda x: memoryview(x.detach().cpu().numpy()),
    "from_numpy": lambda x: torch.from_numpy(x.detach().cpu().numpy()),
    "from_dlpack": lambda x: torch.from_dlpack(x.detach()),
}


def _address_holder(x: torch.Tensor) -> np.ndarray | torch.Tensor:
    """What holds ``x``'s memory by its address, on its own device: a NumPy
    array on the CPU, a tensor made through DLPack on CUDA (NumPy cannot reach
    device memory)."""
    return x.numpy() if x.device.type == "cpu" else torch.from_dlpack(x)


def _value(entry: np.ndarray | memoryview | torch.Tensor) -> np.ndarray:
    """What a log entry holds, read into NumPy from its own device."""
    return to_numpy(entry) if isinstance(entry, torch.Tensor) else np.asarray(entry)


def _overwrite(entry: np.ndarray | memoryview | torch.Tensor) -> None:
    """Writes -1 into the memory a log entry holds, on its own device, and
    waits for the write."""
    if isinstance(entry, torch.Tensor):
        entry.fill_(-1.0)
        if entry.is_cuda:
            torch.cuda.synchronize(entry.device)
    else:
        np.asarray(entry)[:] = -1.0


class _Logger(torch.nn.Module):
    """Keeps each input by its address: a log of what it was called with."""

    def __init__(self, keep) -> None:
        super().__init__()
        self.keep = keep
        self.log: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(self.keep(x))
        return x * 2


def _logged(log: list) -> np.ndarray:
    return np.stack([_value(entry) for entry in log])


def _logged_by_jaxify_module(keep, xs: np.ndarray, compile: str) -> _Logger:
    """A ``_Logger`` of ``keep``, called through jaxify_module on each of
    ``xs`` plus one under jax.jit, with same-sized JAX work after each call
    (which reuses the input's buffer)."""
    module = _Logger(keep)
    apply, params = t2j_ad.jaxify_module(module, compile=compile)
    step = jax.jit(lambda p, x: apply(p, x + 1.0))  # the input: a buffer of the jit, freed after it
    for x in xs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", t2j_ad.FallbackWarning)  # graph mode: NumPy needs real values
            jax.block_until_ready(step(params, jnp.asarray(x)))
        [jax.block_until_ready(jnp.full(64, -1.0) + 0) for _ in range(50)]  # same-sized work after it
    return module


@pytest.mark.parametrize("compile", ["eager", "graph"])
@pytest.mark.parametrize("holder", list(_BY_ADDRESS))
def test_an_input_kept_by_its_address_holds_its_value(holder, compile):
    xs = np.arange(5 * 64, dtype=np.float32).reshape(5, 64)
    reference = _Logger(_BY_ADDRESS[holder])
    for x in xs:
        reference(torch.tensor(x) + 1.0)

    module = _logged_by_jaxify_module(_BY_ADDRESS[holder], xs, compile)
    np.testing.assert_array_equal(_logged(module.log[-5:]), _logged(reference.log))

    live = [jnp.full(64, 7.0) + k for k in range(50)]  # JAX arrays made after the calls
    for entry in module.log[-5:]:
        _overwrite(entry)  # the user's own memory, as in PyTorch
    for k, array in enumerate(live):
        np.testing.assert_array_equal(to_numpy(array), np.full(64, 7.0 + k, np.float32))


def test_a_function_that_starts_keeping_inputs_by_their_address_fails_that_call_only():
    log = []

    def fn(x, keep):
        if bool(keep):
            log.append(_address_holder(x))
        return x * 2

    step = jax.jit(t2j_ad.jaxify(fn))
    jax.block_until_ready(step(jnp.zeros(4), False))  # on copies; kept nothing
    jax.block_until_ready(step(jnp.zeros(4), False))  # on XLA's buffers
    with pytest.raises(Exception, match=r"kept one of its inputs.*Later calls run on copies"):
        jax.block_until_ready(step(jnp.zeros(4), True))
    for i in range(3):
        jax.block_until_ready(step(jnp.full((4,), float(i)), True))
        [jax.block_until_ready(jnp.full((4,), -1.0) + 0) for _ in range(50)]  # same-sized work after it
        np.testing.assert_array_equal(_value(log[-1]), np.full(4, float(i), np.float32))


def test_a_failing_call_that_kept_an_input_by_its_address_raises_its_own_error():
    log = []

    def fn(x, fail):
        if bool(fail):
            log.append(_address_holder(x))
            raise ValueError("the function's own error")
        return x * 2

    f = t2j_ad.jaxify(fn)
    jax.block_until_ready(f(jnp.ones(4), False))  # on copies
    with pytest.raises(Exception, match="the function's own error"):
        jax.block_until_ready(f(jnp.ones(4), True))


@pytest.mark.skipif(not kept_inputs.CAN_MOVE, reason="without a move, a function that keeps inputs runs on copies")
def test_a_streaming_module_looks_for_address_holders_on_its_first_calls_only(monkeypatch):
    looked = []
    held_by_address = kept_inputs.held_by_address
    monkeypatch.setattr(kept_inputs, "held_by_address", lambda *a: looked.append(1) or held_by_address(*a))
    module = _Delta()
    apply, params = t2j_ad.jaxify_module(module)
    step = jax.jit(lambda p, x: apply(p, x * 1.0))
    outs = np.stack([to_numpy(step(params, jnp.asarray(x, jnp.float32))) for x in _XS])
    np.testing.assert_allclose(outs, _deltas(_XS.astype(np.float32)), rtol=1e-6, atol=1e-6)
    assert len(looked) == kept_inputs._KEEPING_CALLS_LOOKED_INTO < len(_XS)


def _pair_step(store: dict):
    """Keeps both inputs, as a streaming function does: the sums of this
    call's inputs less those of the last call's."""

    def step(a, b):
        out = a.sum() + b.sum()
        if store:
            out = out - store["a"].sum() - store["b"].sum()
        store["a"], store["b"] = a.detach(), b.detach()
        return out

    return step


_ONE_BUFFER_TWICE = {
    "one_array_twice": lambda f: lambda x: f(x, x),
    "a_reshape_under_jit": lambda f: jax.jit(lambda x: f(x, x.reshape(3, 2))),  # XLA passes one buffer twice
}


@pytest.mark.parametrize("compile", ["eager", "graph"])
@pytest.mark.parametrize("passed", list(_ONE_BUFFER_TWICE))
def test_inputs_sharing_one_buffer_kept_hold_their_values(passed, compile):
    """NOTE [inputs sharing one buffer]: each input's storage was taken for a
    holder of the other's address, and the second call failed."""
    xs = np.arange(4 * 6, dtype=np.float32).reshape(4, 6) ** 2
    reference_step = _pair_step({})
    second_shape = (6,) if passed == "one_array_twice" else (3, 2)
    want = [reference_step(torch.tensor(x), torch.tensor(x).reshape(second_shape)) for x in xs]
    store: dict = {}
    step = _ONE_BUFFER_TWICE[passed](t2j_ad.jaxify(_pair_step(store), compile=compile))
    got = []
    for x in xs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", t2j_ad.FallbackWarning)
            got.append(to_numpy(step(jnp.asarray(x))))
        [jax.block_until_ready(jnp.full(6, -1.0) + 0) for _ in range(50)]  # same-sized work after it
    np.testing.assert_allclose(np.stack(got), torch.stack(want).numpy(), rtol=1e-6)
    np.testing.assert_array_equal(to_numpy(store["a"]).ravel(), xs[-1])
    np.testing.assert_array_equal(to_numpy(store["b"]).ravel(), xs[-1])



@pytest.mark.parametrize("compile", ["eager", "graph"])
def test_a_view_the_caller_holds_of_an_input_is_no_holder_of_its_address(compile):
    """NOTE [what the call made, in Python's generation lists]: the caller's
    own zero-copy view, alive during the call, was taken for a holder of the
    input's address, and the second call failed."""
    store: dict = {}
    step = t2j_ad.jaxify(lambda x: _pair_step(store)(x, x * 0), compile=compile)
    reference_step = _pair_step({})
    for k in range(1, 5):
        x = jnp.full(4, float(k))
        mine = t2j_ad.tree_j2t(x)  # the caller's own PyTorch view of x
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", t2j_ad.FallbackWarning)
            got = to_numpy(step(x))
        want = reference_step(torch.full((4,), float(k)), torch.zeros(4))
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
        np.testing.assert_array_equal(to_numpy(mine), np.full(4, float(k), np.float32))
    np.testing.assert_array_equal(to_numpy(store["a"]), np.full(4, 4.0, np.float32))



@pytest.mark.parametrize("collection", ["young", "gc_collect", "allocations"])
def test_a_view_the_caller_holds_is_no_holder_after_a_collection_during_the_call(collection):
    """NOTE [the caller's own views]: a streaming function that keeps its
    input (a tensor, no NumPy) and makes Python objects enough for a
    collection, while the caller holds its ``tree_j2t`` view in a dict made
    after it: the collection moved the view after the mark, and the call
    failed, naming NumPy arrays it never made (the review of the twentieth
    session)."""
    collect = {
        "young": lambda: [[i] for i in range(2000)],
        "gc_collect": lambda: gc.collect(1),
        "allocations": lambda: [[i] for i in range(30_000)],
    }[collection]
    state: dict = {}

    def f(a):
        state["prev"] = a.detach()  # keeps its input
        collect()
        return a * 2

    jf = t2j_ad.jaxify(f)
    for k in range(4):
        x = jnp.full((8,), float(k))
        view = t2j_ad.tree_j2t(x)
        log = {"x": view}  # the caller's view, held by a container made after it
        del view
        np.testing.assert_array_equal(to_numpy(jf(x)), np.full(8, 2.0 * k, np.float32))
        np.testing.assert_array_equal(to_numpy(log["x"]), np.full(8, float(k), np.float32))
    np.testing.assert_array_equal(to_numpy(state["prev"]), np.full(8, 3.0, np.float32))


_COLLECTIONS = {
    "gc_collect": lambda: gc.collect(1),  # what survives it moves to the oldest generation
    "allocations": lambda: [[i] for i in range(30_000)],  # net allocations: Python collects generation 1
}


@pytest.mark.parametrize("compile", ["eager", "graph"])
@pytest.mark.parametrize("holder", ["numpy", "from_dlpack"])
@pytest.mark.parametrize("collection", list(_COLLECTIONS))
def test_an_input_kept_by_its_address_is_found_after_a_collection_during_the_call(collection, holder, compile):
    """NOTE [a collection during the look's call]: the NumPy array's tensor,
    moved to the oldest generation, was not looked at, and the log read
    XLA's reused buffers."""
    collect = _COLLECTIONS[collection]

    def keep(x):
        logged = _BY_ADDRESS[holder](x)
        collect()
        return logged

    xs = np.arange(5 * 64, dtype=np.float32).reshape(5, 64)
    reference = _Logger(keep)
    for x in xs:
        reference(torch.tensor(x) + 1.0)

    module = _logged_by_jaxify_module(keep, xs, compile)
    np.testing.assert_array_equal(_logged(module.log[-5:]), _logged(reference.log))


@pytest.mark.parametrize("collected", [False, True])
def test_a_look_passes_over_the_oldest_generation_only_after_a_collection(monkeypatch, collected):
    """NOTE [a collection during the look's call]: the oldest generation,
    hundreds of thousands of objects, is looked at only where a collection
    moved the call's objects there; what the look finds is the same."""
    generations = []
    get_objects = gc.get_objects
    monkeypatch.setattr(gc, "get_objects", lambda *gen: generations.extend(gen) or get_objects(*gen))
    gc.disable()  # no collection but the test's own
    try:
        x = torch.ones(16)  # an input, made for its call
        mark = kept_inputs.references([x])  # as the runner makes it, just before the call
        logged = x.detach().numpy()
        if collected:
            gc.collect(1)
        assert kept_inputs.held_by_address([x], 0, mark)
        del logged
        assert not kept_inputs.held_by_address([x], 0, mark)
    finally:
        gc.enable()
    oldest = {kept_inputs._OLDEST_GENERATION}
    assert set(generations) == set(kept_inputs._YOUNG_GENERATIONS) | (oldest if collected else set())


def _reads_its_storage(w, x):
    assert x.untyped_storage().nbytes() == 48  # makes the storage's Python object, kept with it
    # (under torch.func's transforms a wrapper has no storage to read)
    return torch.sin(x @ w).sum()


@pytest.mark.parametrize("compile", ["eager", "graph"])
def test_calls_that_keep_nothing_copy_nothing(monkeypatch, compile):
    monkeypatch.setattr(t2j_ad.runtime, "CAN_MOVE", True)  # the move itself only recorded, below
    # A graph-mode derivative's trace, and any untyped_storage() call, make
    # the storage's Python object: once taken for a kept view, which copied
    # the inputs of each such call, and failed it where PyTorch cannot move them.
    moved = []
    monkeypatch.setattr(kept_inputs, "_to_own_memory", lambda storage: moved.append(storage.nbytes()))
    f = t2j_ad.jaxify(lambda w, x: torch.tanh(x @ w).sum(), compile=compile)
    same = t2j_ad.jaxify(lambda x: x, compile=compile)  # returns its input: the call's own result, not kept
    reads = t2j_ad.jaxify(_reads_its_storage, compile=compile)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    apply, params = t2j_ad.jaxify_module(module, compile=compile)
    lin = torch.nn.Linear(4, 4).to(TORCH_DEVICE)  # a parameter: the first run of a graph for a flag records autograd history
    flagged = t2j_ad.jaxify(lambda x: x @ lin.weight.T * (2.0 if lin.training else 3.0), compile=compile)

    def toggled():
        lin.train(not lin.training)  # graph mode: another graph, its first run on XLA's buffers
        return flagged(x)

    recurrent, weights = t2j_ad.jaxify_module(torch.nn.GRU(4, 3), compile=compile)  # its weight list
    norm = torch.nn.Sequential(torch.nn.Conv1d(3, 3, 1), torch.nn.BatchNorm1d(3, momentum=None))
    normed, norm_params = t2j_ad.jaxify_module(norm, compile=compile)  # per example, inside the call's bindings

    def per_example_normed(p):
        return jax.vmap(normed, (None, 0))(p, jnp.ones((2, 1, 3, 5))).sum()

    def in_inference_mode():
        with torch.inference_mode():
            return f(w, x)

    w, x, ws = jnp.ones(4), jnp.ones((3, 4)), jnp.ones((2, 4))
    calls = [
        lambda: f(w, x),
        lambda: jax.grad(f)(w, x),
        lambda: jax.vmap(f, (0, None))(ws, x),
        lambda: jax.hessian(f)(w, x),
        lambda: jax.jvp(f, (w, x), (w, x)),
        lambda: same(x),
        lambda: jax.grad(lambda p: apply(p, x).sum())(params),
        lambda: reads(w, x),
        toggled,
        lambda: recurrent(weights, x),
        lambda: jax.grad(per_example_normed)(norm_params),
        in_inference_mode,
    ]
    for call in calls:
        for jit in (False, True):
            run = jax.jit(call) if jit else call
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", t2j_ad.FallbackWarning)  # loops and eager runs, announced
                jax.block_until_ready(run())  # the first call of each runs on copies
                jax.block_until_ready(run())
    assert moved == []


def test_a_kept_storage_object_counts_as_kept(monkeypatch):
    monkeypatch.setattr(t2j_ad.runtime, "CAN_MOVE", True)  # the move itself only recorded, below
    moved = []
    monkeypatch.setattr(kept_inputs, "_to_own_memory", lambda storage: moved.append(storage.nbytes()))
    kept = []

    def fn(x):
        kept.append(x.untyped_storage())
        return x * 2

    f = t2j_ad.jaxify(fn)
    for _ in range(3):
        jax.block_until_ready(f(jnp.ones(4)))  # the first call runs on copies
    assert moved == [16, 16]


@pytest.fixture
def cannot_move(monkeypatch):
    """A PyTorch without UntypedStorage._swap_data_ptr_ (2.11, the GPU machines' build)."""
    monkeypatch.setattr(t2j_ad.runtime, "CAN_MOVE", False)
    monkeypatch.setattr(kept_inputs, "_to_own_memory", lambda storage: pytest.fail("moved without a swap"))


@pytest.mark.parametrize("compile", ["eager", "graph"])
def test_where_inputs_cannot_be_moved_a_function_keeping_them_from_the_start_runs_on_copies(cannot_move, compile):
    apply, params = t2j_ad.jaxify_module(_Delta(), compile=compile)
    scan = jax.jit(lambda p, xs: jax.lax.scan(lambda c, x: (c, apply(p, x)), 0.0, xs)[1])
    with pytest.warns(t2j_ad.FallbackWarning) if compile == "graph" else contextlib.nullcontext():
        ys = to_numpy(scan(params, jnp.asarray(_XS, jnp.float32)))
    np.testing.assert_allclose(ys, _deltas(_XS.astype(np.float32)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("where", ["plainly", "in_an_except_block"])
def test_where_inputs_cannot_be_moved_a_function_that_starts_keeping_fails_that_call_only(cannot_move, where):
    """Made in the caller's except block, the call was taken for a failing
    one and not looked at: its kept input read XLA's reused buffer."""
    kept = []

    def fn(x, keep):
        if bool(keep):
            kept.append(x[1:])
        return x * 2

    step = jax.jit(t2j_ad.jaxify(fn))
    jax.block_until_ready(step(jnp.zeros(4), False))  # on copies; kept nothing
    jax.block_until_ready(step(jnp.zeros(4), False))  # on XLA's buffers
    with pytest.raises(Exception, match=r"cannot move it to memory of its own.*Later calls run on copies"):
        if where == "plainly":
            jax.block_until_ready(step(jnp.zeros(4), True))
        else:
            try:
                raise KeyError("a failure of the caller's own, which it handles")
            except KeyError:
                jax.block_until_ready(step(jnp.zeros(4), True))
    for i in range(3):
        jax.block_until_ready(step(jnp.full((4,), float(i)), True))
        [jax.block_until_ready(jnp.full((4,), -1.0) + 0) for _ in range(50)]  # same-sized work after it
        np.testing.assert_array_equal(to_numpy(kept[-1]), np.full(3, float(i), np.float32))


def test_where_inputs_cannot_be_moved_the_calls_own_error_is_raised(cannot_move):
    def fn(x, fail):
        if bool(fail):
            raise ValueError("the function's own error")  # its traceback holds x
        return x * 2

    f = t2j_ad.jaxify(fn)
    jax.block_until_ready(f(jnp.ones(4), False))
    with pytest.raises(Exception, match="the function's own error"):
        jax.block_until_ready(f(jnp.ones(4), True))
    jax.block_until_ready(f(jnp.ones(4), False))
    assert not any(entry.base.keeps_inputs for entry in f._cache.values())  # a traceback is no keeper
