"""Two processes on 127.0.0.1 joined by jax.distributed, 2 CPU devices each.

Each process runs tests/multidevice/multihost_worker.py; the gathered
per-example gradients must equal a single-process run of the same jitted
function here (4 simulated devices) and pure JAX. Bounded in time; every
process is ended by the test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import t2j_ad
from tests.conftest import assert_tree_allclose

WORKER = Path(__file__).with_name("multihost_worker.py")
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_grads():
    mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
    f = t2j_ad.jaxify(lambda w, x: torch.tanh(x @ w) ** 2, vmap_method="sequential")
    w = np.linspace(-1.0, 1.0, 3, dtype=np.float32)
    x = np.sin(np.arange(48, dtype=np.float32)).reshape(16, 3)
    xs = jax.device_put(x, NamedSharding(mesh, P("b")))
    ours = jax.jit(jax.vmap(jax.grad(f), (None, 0)))(w, xs)
    reference = jax.vmap(jax.grad(lambda w, x: jnp.tanh(x @ w) ** 2), (None, 0))(w, x)
    return np.asarray(ours), reference


def test_two_processes_match_one(tmp_path):
    port = _free_port()
    out = tmp_path / "grads.npy"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the worker sets its own (2 devices)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-4000:]}"
    ours, reference = _single_process_grads()
    multi = np.load(out)
    assert_tree_allclose(multi, ours)
    assert_tree_allclose(multi, np.asarray(reference))
