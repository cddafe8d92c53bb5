"""Four simulated CPU devices for the sharding tests.

XLA reads ``XLA_FLAGS`` once, when JAX first creates its CPU client, so these
tests run in their own pytest invocation with the flag set (as
scripts/run_tests.sh does):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest tests/multidevice

Without it (or collected together with the rest of the suite) they skip,
naming that command. Setting the flag here instead would silently give every
other test in the session 4 devices too. The devices are simulated CPU
devices, so where JAX's default backend is not the CPU (a GPU machine) these
tests skip too, saying so; they run there with ``JAX_PLATFORMS=cpu`` added.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest

# The tests here import the suite's helpers as ``tests.conftest`` (a plain
# ``conftest`` would be this file): the repository root must be importable
# however pytest was started.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

FLAG = "--xla_force_host_platform_device_count=4"


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if "multidevice" in str(item.path)]
    backend = jax.default_backend()
    if not mine or (backend == "cpu" and jax.device_count() >= 4):
        return
    if backend != "cpu":
        reason = (
            f"needs 4 simulated CPU devices ({FLAG}), but JAX's default backend is {backend}: run "
            f"`JAX_PLATFORMS=cpu XLA_FLAGS={FLAG} pytest tests/multidevice` on its own"
        )
    else:
        reason = (
            f"needs 4 CPU devices, JAX has {jax.device_count()}: run "
            f"`XLA_FLAGS={FLAG} pytest tests/multidevice` on its own (scripts/run_tests.sh does)"
        )
    skip = pytest.mark.skip(reason=reason)
    for item in mine:
        item.add_marker(skip)
