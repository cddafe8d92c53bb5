"""One process of the 2-process test in test_multihost.py.

``python multihost_worker.py PROCESS_ID PORT OUT``: joins a 2-process JAX
runtime on 127.0.0.1:PORT (2 CPU devices each), computes jitted per-example
gradients of a PyTorch loss over the global 4-device mesh, and (process 0)
saves the gathered result to OUT.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("T2J_AD_TORCH_THREADS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import t2j_ad  # noqa: E402


def main(process_id: int, port: int, out: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the default in JAX 0.10; explicit
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = []

    def loss(w, x):
        if x.device.type != "meta":  # not the shape inference
            rows.append(1)
        return torch.tanh(x @ w) ** 2

    f = t2j_ad.jaxify(loss, vmap_method="sequential")
    w = np.linspace(-1.0, 1.0, 3, dtype=np.float32)
    x = np.sin(np.arange(48, dtype=np.float32)).reshape(16, 3)
    xs = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("b")), lambda idx: x[idx])
    ws = jax.make_array_from_callback(w.shape, NamedSharding(mesh, P()), lambda idx: w[idx])
    grads = jax.jit(jax.vmap(jax.grad(f), (None, 0)))(ws, xs)
    gathered = multihost_utils.process_allgather(grads, tiled=True)
    # Each process computed its own 8 rows (2 devices x 4), one call a row.
    assert len(rows) == 8, len(rows)
    if process_id == 0:
        np.save(out, np.asarray(gathered))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
