"""Shared test set-up: CPU only, quiet threads, and reference comparisons."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("T2J_AD_TORCH_THREADS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.manual_seed(0)

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
