"""Four simulated CPU devices for the sharding tests.

XLA reads ``XLA_FLAGS`` when JAX first creates its CPU client, so these tests
run in their own pytest invocation (scripts/run_tests.sh does:
``pytest tests/multidevice``); collected together with the rest of the suite
they skip, naming that command.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=4"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.device_count() >= 4:
        return
    skip = pytest.mark.skip(
        reason=f"needs 4 CPU devices, but JAX started with {jax.device_count()} before "
        f"XLA_FLAGS={_FLAG} could apply: run `pytest tests/multidevice` on its own"
    )
    for item in items:
        if "multidevice" in str(item.fspath):
            item.add_marker(skip)
