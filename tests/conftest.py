"""Shared test set-up: JAX's default platform (CPU or a CUDA GPU), full float32
matmuls on both sides, quiet threads, and reference comparisons.

The suite runs on whatever platform JAX defaults to. What a test needs to be
right on both lives here: ``ON_GPU``, ``TORCH_DEVICE`` (where PyTorch
computes when JAX's default device is used), ``to_numpy`` / ``to_torch`` for
references, and ``cuda_only`` for tests that need a GPU.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

os.environ.setdefault("T2J_AD_TORCH_THREADS", "1")
# Also for the fresh interpreters some tests start: NOTE [full float32 matmuls
# in tests]; and JAX must not take 75% of the GPU up front in every process
# (PyTorch allocates on the same GPU, and subprocesses start their own JAX).
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.manual_seed(0)

# NOTE [full float32 matmuls in tests]
# On a GPU, XLA computes float32 matmuls and convolutions in TF32 by default
# (10 mantissa bits) while PyTorch's matmuls do not: a jaxify'd matmul and its
# pure-JAX reference would differ by ~1e-3. Both sides are pinned to full
# float32 here, so the float32 tolerances below hold on every platform.
jax.config.update("jax_default_matmul_precision", "highest")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_float32_matmul_precision("highest")

ON_GPU = jax.default_backend() == "gpu"
if ON_GPU and not torch.cuda.is_available():
    pytest.exit(
        f"JAX's default backend is gpu ({jax.devices()[0]}), but this PyTorch ({torch.__version__}) has no CUDA: "
        "install a CUDA build of torch, or run the suite on CPU with JAX_PLATFORMS=cpu.",
        returncode=4,
    )
# The device PyTorch computes on inside a call on JAX's default device: a
# torch reference built here meets the same tensors a jaxify'd function sees.
TORCH_DEVICE = torch.device("cuda", jax.devices()[0].local_hardware_id) if ON_GPU else torch.device("cpu")

cuda_only = pytest.mark.skipif(
    not ON_GPU,
    reason=f"needs a CUDA GPU as JAX's default device (JAX's default backend is {jax.default_backend()}) "
    "and a CUDA build of torch",
)


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy copy of a torch tensor on any device, or of a JAX array."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def to_torch(x: Any) -> torch.Tensor:
    """A torch copy of a JAX or NumPy array, on ``TORCH_DEVICE``."""
    return torch.as_tensor(np.array(x), device=TORCH_DEVICE)


# Tolerances by dtype name: (rtol, atol).
TOLERANCES = {
    "float16": (1e-2, 1e-2),
    "bfloat16": (5e-2, 5e-2),
    "float32": (1e-5, 1e-5),
    "float64": (1e-10, 1e-10),
    "complex64": (1e-5, 1e-5),
    "complex128": (1e-10, 1e-10),
}


def assert_tree_allclose(actual, expected, *, rtol=None, atol=None, check_dtype=True):
    """Every leaf of ``actual`` matches ``expected`` (same tree, shape, dtype)."""
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, f"tree mismatch: {a_tree} vs {e_tree}"
    for a, e in zip(a_leaves, e_leaves):
        a = np.asarray(a)
        e = np.asarray(e)
        assert a.shape == e.shape, f"shape mismatch: {a.shape} vs {e.shape}"
        if check_dtype:
            assert a.dtype == e.dtype, f"dtype mismatch: {a.dtype} vs {e.dtype}"
        default = TOLERANCES.get(a.dtype.name, (1e-5, 1e-5))
        r = default[0] if rtol is None else rtol
        t = default[1] if atol is None else atol
        if a.dtype == jax.dtypes.float0:
            continue
        np.testing.assert_allclose(
            a.astype(np.float64) if a.dtype.name == "bfloat16" else a,
            e.astype(np.float64) if e.dtype.name == "bfloat16" else e,
            rtol=r,
            atol=t,
        )


# NOTE [tests that choose their compile mode]
# scripts/run_tests.sh runs the core tests a second time with
# T2J_AD_COMPILE=graph, so that every jaxify'd function whose test leaves the
# mode to the default is traced. A test parametrized over the modes itself
# (``@pytest.mark.parametrize("mode", ["eager", "graph"])``, passing
# ``compile=mode``) runs the very same calls in both runs: such tests are
# deselected, not skipped, in a run that sets T2J_AD_COMPILE, and the report
# header says how many.
_TRACED_MODES = {"graph", "inductor"}


def _chooses_its_compile_mode(item: pytest.Item) -> bool:
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames")
        values = mark.args[1] if len(mark.args) > 1 else mark.kwargs.get("argvalues", ())
        if isinstance(names, str) and "," not in names and any(
            isinstance(v, str) and v in _TRACED_MODES for v in values
        ):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:  # noqa: D103
    if not os.environ.get("T2J_AD_COMPILE"):
        return
    chosen = [item for item in items if _chooses_its_compile_mode(item)]
    if chosen:
        config.hook.pytest_deselected(items=chosen)
        deselected = set(chosen)
        items[:] = [item for item in items if item not in deselected]
        config._t2j_ad_compile_deselected = len(chosen)


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:  # noqa: D103
    n = getattr(config, "_t2j_ad_compile_deselected", 0)
    if n:
        return (
            f"T2J_AD_COMPILE={os.environ['T2J_AD_COMPILE']}: {n} tests that choose their compile mode "
            "themselves deselected (NOTE [tests that choose their compile mode] in tests/conftest.py)"
        )
    return None


@pytest.fixture
def traces(monkeypatch):
    """One entry per graph-mode trace made during the test (its number of
    inputs), in order."""
    from t2j_ad import graph_mode

    seen: list[int] = []
    original = graph_mode.trace

    def counting(fn, inputs, grad_enabled, *referenced):
        seen.append(len(inputs))
        return original(fn, inputs, grad_enabled, *referenced)

    monkeypatch.setattr(graph_mode, "trace", counting)
    return seen


def count_resolutions(monkeypatch) -> list[int]:
    """One entry per input signature a jaxify'd function resolves (infers
    shapes for) from now on."""
    from t2j_ad import api

    seen: list[int] = []
    original = api.JaxifiedFunction._resolve

    def counting(self, *args):
        seen.append(1)
        return original(self, *args)

    monkeypatch.setattr(api.JaxifiedFunction, "_resolve", counting)
    return seen


def count_trial_runs(monkeypatch) -> list[int]:
    """One entry per run on stand-in inputs (``infer_outputs``: a signature's
    shapes, or a function's effects found again) from now on."""
    from t2j_ad import api

    seen: list[int] = []
    original = api.infer_outputs

    def counting(*args, **kwargs):
        seen.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(api, "infer_outputs", counting)
    return seen


@pytest.fixture
def x64():
    """Run the test with jax_enable_x64 on."""
    with jax.enable_x64(True):
        yield


def run_in_threads(work: Callable[[int], None], n: int) -> None:
    """Run ``work(k)`` for k in range(n), each on its own thread, all released
    at once by a barrier (so first calls really race); re-raise the first
    failure of any thread here."""
    barrier = threading.Barrier(n)
    failures: list[BaseException] = []

    def run(k: int) -> None:
        try:
            barrier.wait()
            work(k)
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the test's thread
            failures.append(err)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


def finishes_within(work: Callable[[], Any], seconds: float) -> Any:
    """``work()``'s result, run on a daemon thread; fails if it is still
    running after ``seconds`` (a deadlock), and re-raises its failure."""
    results: list = []
    failures: list[BaseException] = []

    def run() -> None:
        try:
            results.append(work())
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the test's thread
            failures.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a deadlock (NOTE [calls made inside a module's forward])"
    if failures:
        raise failures[0]
    return results[0]
