"""Many threads calling one jaxify'd function at once, sized for CI.

8 threads each make 1,000 calls of one jitted function and 1,000 of its
jitted gradient, on inputs of their own (so results crossing between threads
would show), starting together so the first calls also trace and compile
concurrently. Every result is checked against the same math in pure JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import TORCH_DEVICE, finishes_within, run_in_threads, to_numpy

import t2j_ad

THREADS = 8
CALLS = 1000


def _loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w) ** 2).sum()


def _loss_jax(w: jax.Array, x: jax.Array) -> jax.Array:
    return (jnp.tanh(x @ w) ** 2).sum()


@pytest.mark.parametrize("backend", ["ffi", "callback"])
def test_threads_calling_a_function_and_its_gradient(backend, monkeypatch):
    if backend == "ffi":
        pytest.importorskip("t2j_ad._ffi_ext", reason="C++ extension not built")
    monkeypatch.setenv("T2J_AD_BACKEND", backend)
    jax.clear_caches()  # lower afresh on this backend
    ours = t2j_ad.jaxify(_loss)
    f, g = jax.jit(ours), jax.jit(jax.grad(ours))
    x = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
    inputs = [jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32) * (k + 1) / THREADS for k in range(THREADS)]
    expected = [(np.asarray(_loss_jax(w, x)), np.asarray(jax.grad(_loss_jax)(w, x))) for w in inputs]
    counts = [0] * THREADS

    def worker(k: int) -> None:
        want_f, want_g = expected[k]
        for _ in range(CALLS):
            np.testing.assert_allclose(f(inputs[k], x), want_f, rtol=1e-5)
            np.testing.assert_allclose(g(inputs[k], x), want_g, rtol=1e-5, atol=1e-6)
            counts[k] += 1

    run_in_threads(worker, THREADS)
    assert counts == [CALLS] * THREADS


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc2 = torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))).sum()


def _mlp_jax(p: dict, x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ p["fc1.weight"].T + p["fc1.bias"])
    return (h @ p["fc2.weight"].T + p["fc2.bias"]).sum()


@pytest.mark.parametrize("compile", ["eager", "graph"])
def test_threads_differentiating_one_module(compile):
    # torch.func.functional_call swaps parameters into the module object: two
    # threads in one module at once would each run on the other's parameters
    # (found by the 4-device sharded-jit test, whose devices call in parallel).
    torch.manual_seed(0)
    apply, params = t2j_ad.jaxify_module(_Mlp().to(TORCH_DEVICE), compile=compile)
    g = jax.jit(jax.grad(apply))
    x = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
    inputs = [jax.tree_util.tree_map(lambda p, k=k: p * (k + 1) / THREADS, params) for k in range(THREADS)]
    expected = [jax.grad(_mlp_jax)(p, x) for p in inputs]

    def worker(k: int) -> None:
        for _ in range(CALLS // 5):
            got = g(inputs[k], x)
            for name, want in expected[k].items():
                np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)

    run_in_threads(worker, THREADS)


def test_threads_first_calling_different_transforms_of_one_graph_mode_function():
    # Each transform traces its own graph on its first call. Two traces at
    # once undid each other's seeding of PyTorch's generators (NOTE [one
    # trial run at a time]): a trace took that for the function setting the
    # random state and fell back to eager for good, for torch.sin(x) * x.
    for attempt in range(3):  # the race was lost in 6 of 8 tries
        f = t2j_ad.jaxify(lambda x: torch.sin(x) * x, compile="graph")
        transforms = [
            (jax.jit(f), lambda x: jnp.sin(x) * x),
            (jax.jit(jax.grad(lambda x: f(x).sum())), jax.grad(lambda x: (jnp.sin(x) * x).sum())),
            (jax.jit(jax.vmap(f)), lambda x: jnp.sin(x) * x),
            (jax.jit(lambda x: jax.jvp(f, (x,), (x,))[1]), lambda x: jax.jvp(lambda x: jnp.sin(x) * x, (x,), (x,))[1]),
        ]
        x = jnp.linspace(-1.0, 1.0, 48, dtype=jnp.float32).reshape(6, 8)

        def worker(k: int) -> None:
            ours, reference = transforms[k]
            for i in range(3):
                np.testing.assert_allclose(ours(x + i), reference(x + i), rtol=1e-5, atol=1e-6)

        run_in_threads(worker, len(transforms))
        stats = f.compile_stats()
        assert stats["graphs"] == 4 and stats["eager_fallbacks"] == 0, (attempt, stats)


def test_clear_caches_while_another_thread_calls():
    """t2j_ad.clear_caches() emptied the registry while a jitted call on
    another thread still ran its compiled program: some of those calls failed
    with "no PyTorch function is registered under key N"."""
    import threading
    import time

    f = jax.jit(t2j_ad.jaxify(lambda x: torch.sin(x) * 2))
    x = jnp.linspace(0.0, 1.0, 3)
    f(x)
    failures: list[BaseException] = []
    calls = [0]
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            try:
                np.testing.assert_allclose(f(x), 2 * np.sin(np.asarray(x)), rtol=1e-6)
                calls[0] += 1
            except BaseException as err:  # noqa: BLE001 - collected and reported below
                failures.append(err)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        for _ in range(10):
            time.sleep(0.05)
            t2j_ad.clear_caches()
    finally:
        stop.set()
        thread.join()
    assert not failures, failures[:2]
    assert calls[0] > 10


def _run_both_or_fail(workers: list, seconds: float) -> None:
    """Run each of ``workers`` on its own daemon thread, released together;
    fail if any is still running after ``seconds`` (a deadlock) and re-raise
    the first failure of any."""
    import threading
    import time

    barrier = threading.Barrier(len(workers))
    failures: list[BaseException] = []

    def run(work) -> None:
        try:
            barrier.wait()
            work()
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the test's thread
            failures.append(err)

    threads = [threading.Thread(target=run, args=(work,), daemon=True) for work in workers]
    for t in threads:
        t.start()
    deadline = time.monotonic() + seconds
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [k for k, t in enumerate(threads) if t.is_alive()]
    assert not alive, f"threads {alive} still running after {seconds} s: a deadlock (NOTE [lock order])"
    if failures:
        raise failures[0]


class _Nesting(torch.nn.Module):
    """A module whose forward calls another jaxify'd function."""

    def __init__(self, inner, make_input) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.inner, self.make_input = inner, make_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + t2j_ad.tree_j2t(self.inner(self.make_input())).sum()


@pytest.mark.parametrize("compile", ["eager", "graph"])
@pytest.mark.parametrize("inner_kind", ["new shape", "updates state"])
def test_a_module_call_nesting_a_call_beside_a_first_call_of_a_function_closing_over_it(inner_kind, compile):
    # A jaxify_module call holds the module's locks while its forward runs; a
    # jaxify'd function called inside took the trial-run lock (for its trial
    # run on a new shape, or, updating state, to hold off trial runs), while a
    # first call of a function closing over the module on another thread held
    # the trial-run lock and waited for the module's: both hung, every run.
    torch.manual_seed(0)
    calls = 30
    if inner_kind == "new shape":
        step = [0]
        inner = t2j_ad.jaxify(lambda v: v * 2, compile="eager")

        def make_input() -> jax.Array:
            step[0] += 1
            return jnp.ones(step[0], jnp.float32)

        nested_sums = [2.0 * n for n in range(1, calls + 1)]
    else:
        bn = torch.nn.BatchNorm1d(3).train().to(TORCH_DEVICE)  # the device of the arrays it is called on
        inner = t2j_ad.jaxify(lambda v: bn(v), compile="eager")

        def make_input() -> jax.Array:
            return jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3)  # made in the forward, as the module's own

        inner(make_input())  # inferred before the threads
        reference_bn = torch.nn.BatchNorm1d(3).train()
        with torch.no_grad():
            nested_sums = [float(reference_bn(torch.arange(12.0).reshape(4, 3)).sum()) for _ in range(calls)]
    outer = _Nesting(inner, make_input).to(TORCH_DEVICE)  # closing_over runs outer.lin on the arrays' device
    # The nested sums count the forward's runs: eager, as T2J_AD_COMPILE=graph would trace it once more.
    apply, params = t2j_ad.jaxify_module(outer, output_shapes=jax.ShapeDtypeStruct((1, 3), jnp.float32), compile="eager")
    # In graph mode the trace, which holds the trial-run lock around its
    # trial run, takes the module's locks with it (NOTE [waiting for a lock
    # without the trial-run lock] in module_locks.py).
    closing_over = t2j_ad.jaxify(lambda x: outer.lin(x), compile=compile)
    got_apply: list[np.ndarray] = []
    got_closing: list[np.ndarray] = []

    def module_calls() -> None:
        for _ in range(calls):
            got_apply.append(np.asarray(apply(params, jnp.ones((1, 3), jnp.float32))))

    def first_calls() -> None:
        for k in range(1, calls + 1):
            got_closing.append(np.asarray(closing_over(jnp.ones((k, 3), jnp.float32))))

    _run_both_or_fail([module_calls, first_calls], seconds=30)
    with torch.no_grad():
        linear = outer.lin(torch.ones(1, 3, device=TORCH_DEVICE))
        for k, got in enumerate(got_apply):
            np.testing.assert_allclose(got, to_numpy(linear + nested_sums[k]), rtol=1e-5, atol=1e-5)
        for k, got in enumerate(got_closing, start=1):
            np.testing.assert_allclose(got, to_numpy(outer.lin(torch.ones(k, 3, device=TORCH_DEVICE))), rtol=1e-6)
    if inner_kind == "updates state":
        assert int(bn.num_batches_tracked) == calls + 1


def test_forward_mode_module_calls_beside_forward_mode_first_calls_that_trace():
    # A jaxify_module call takes the trial-run lock before its module's
    # (NOTE [calls made inside a module's forward]); a forward-mode call that
    # took the forward-AD lock without it (as those not about to trace did)
    # then waited for it, while another thread's forward-mode first call in
    # graph mode held it for its trace and waited for the forward-AD lock.
    import threading

    torch.manual_seed(0)
    module = torch.nn.Linear(3, 3)
    apply, params = t2j_ad.jaxify_module(module)
    x = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)
    y = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32)
    got_module: list[np.ndarray] = []
    got_traced: list[np.ndarray] = []
    done = threading.Event()

    def module_calls() -> None:
        while not done.is_set():
            got_module.append(np.asarray(jax.jvp(lambda x: apply(params, x), (x,), (x,))[1]))

    def first_calls_that_trace() -> None:
        try:
            for _ in range(60):
                traced = t2j_ad.jaxify(lambda y: torch.sin(y) * y, compile="graph")
                got_traced.append(np.asarray(jax.jvp(traced, (y,), (y,))[1]))
        finally:
            done.set()

    _run_both_or_fail([module_calls, first_calls_that_trace], seconds=60)
    with torch.no_grad():
        want_module = torch.from_numpy(np.asarray(x)) @ module.weight.T  # the tangent of a linear map
    ty = torch.from_numpy(np.asarray(y))
    _, want_traced = torch.func.jvp(lambda y: torch.sin(y) * y, (ty,), (ty,))
    assert got_module and len(got_traced) == 60
    for got in got_module:
        np.testing.assert_allclose(got, want_module.numpy(), rtol=1e-5, atol=1e-6)
    for got in got_traced:
        np.testing.assert_allclose(got, want_traced.numpy(), rtol=1e-5, atol=1e-6)


class _Ensemble(torch.nn.Module):
    """A module whose forward runs other jaxify_module applies on a thread
    pool and waits for them."""

    def __init__(self, members, pool) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3, 1)
        self.members, self.pool = members, pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ones = jnp.ones((2, 3), jnp.float32)
        futures = [self.pool.submit(lambda a=a, p=p: np.asarray(a(p, ones))) for a, p in self.members]
        features = sum(torch.from_numpy(np.array(f.result())) for f in futures)
        return self.head(x) * features.sum()


def test_a_module_forward_waiting_for_jaxified_calls_on_a_thread_pool():
    # Every eager module call held the trial-run lock for its whole forward,
    # so the member applies the forward waited for, on the pool's threads,
    # waited for that lock, for good (NOTE [calls made inside a module's
    # forward]).
    import concurrent.futures

    torch.manual_seed(0)
    linears = [torch.nn.Linear(3, 3) for _ in range(2)]
    members = [t2j_ad.jaxify_module(lin) for lin in linears]
    ones = jnp.ones((2, 3), jnp.float32)
    for apply, params in members:
        apply(params, ones)  # inferred before the ensemble's call
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        ensemble = _Ensemble(members, pool)
        apply, params = t2j_ad.jaxify_module(ensemble)
        got = [finishes_within(lambda: np.asarray(apply(params, ones)), seconds=30) for _ in range(3)]
    finally:
        pool.shutdown(wait=False)  # its threads, deadlocked, would never end
    with torch.no_grad():
        features = sum(lin(torch.ones(2, 3)) for lin in linears)
        want = (ensemble.head(torch.ones(2, 3)) * features.sum()).numpy()
    for value in got:
        np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6)
