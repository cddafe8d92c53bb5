"""Per-call cost of the custom call that runs PyTorch inside a JAX program.

Small input, ``torch.sin(x) * 2`` on an (8,) float32, jitted. Contenders:

- ``floor``: the same PyTorch call made directly, plus a jitted JAX identity
  on the same input (the least any JAX-to-PyTorch call can cost);
- ``t2j_ad ffi``: the jaxify'd function under ``jax.jit``, FFI backend;
- ``ffi handler only``: the same custom call with a bare runner (tensors in,
  ``torch.sin(x) * 2`` copied out), i.e. without the runtime's thread, grad
  mode, mutation and result checks: the cost of the C++ path itself;
- ``t2j_ad callback``: the same, forced onto the Python callback backend;
- ``jax.pure_callback``: a jitted ``jax.pure_callback`` doing the same work.

Targets (issue 5): ``t2j_ad ffi`` at most 1.5x ``floor``, and at least 5x
faster than ``jax.pure_callback``.

Large input, 256 MB of float32: the custom call should add under 1 ms over
the direct PyTorch call, because the input is not copied. Measured on a
function that reads only the last 8 elements (``x[-8:] * 2``), so the time is
all overhead and a copy of the input (tens of ms) would stand out; a full
reduction (``x.sum()``) is shown too.

    python benchmarks/bench_call_latency.py [--threads 1] [--large-mb 256]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from common import format_seconds, markdown_table, print_report, set_threads, time_calls, torch_done  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import t2j_ad  # noqa: E402


def sin2(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2


def tail2(x: torch.Tensor) -> torch.Tensor:
    return x[-8:] * 2


def total(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


def jitted_on(backend: str, fn, x: jax.Array):
    """``jax.jit(jaxify(fn))``, lowered (and compiled) on ``backend``."""
    os.environ["T2J_AD_BACKEND"] = backend
    try:
        f = jax.jit(t2j_ad.jaxify(fn))
        jax.block_until_ready(f(x))  # lowers now, while the backend is forced
    finally:
        del os.environ["T2J_AD_BACKEND"]
    return f


def handler_only(x: jax.Array):
    """The FFI custom call with a bare runner: ``torch.sin(x) * 2`` copied out.

    Registered under a negative key, which ``registry.register`` never
    hands out, in the table the C++ handler reads (NOTE [registry lifetime]).
    """
    from t2j_ad.backends import ffi, registry

    assert ffi.available()
    registry.runners[-1] = lambda inputs, outputs, stream: outputs[0].copy_(sin2(inputs[0]))
    call = jax.ffi.ffi_call(ffi.TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return jax.jit(lambda x: call(x, key=np.int64(-1)))


def small(repeats: int) -> str:
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    tx = torch.from_dlpack(x).clone()
    identity = jax.jit(lambda x: x)
    ffi = jitted_on("ffi", sin2, x)
    callback = jitted_on("callback", sin2, x)
    raw = handler_only(x)
    pure = jax.jit(
        lambda x: jax.pure_callback(
            lambda a: sin2(torch.from_numpy(np.array(a))).numpy(),  # on the host, as pure_callback is
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            x,
        )
    )
    np.testing.assert_allclose(ffi(x), np.asarray(jnp.sin(x) * 2), rtol=1e-6)
    np.testing.assert_allclose(pure(x), np.asarray(jnp.sin(x) * 2), rtol=1e-6)

    sin2_done = torch_done(lambda: sin2(tx))

    def floor():
        sin2_done()
        identity(x).block_until_ready()

    timings = time_calls(
        {
            "floor": floor,
            "t2j_ad ffi": lambda: ffi(x).block_until_ready(),
            "ffi handler only": lambda: raw(x).block_until_ready(),
            "t2j_ad callback": lambda: callback(x).block_until_ready(),
            "jax.pure_callback": lambda: pure(x).block_until_ready(),
        },
        warmup=200,
        repeats=repeats,
    )
    by = {t.name: t.median for t in timings}
    summary = (
        f"t2j_ad ffi / floor = {by['t2j_ad ffi'] / by['floor']:.2f}x (target <= 1.5x); "
        f"jax.pure_callback / t2j_ad ffi = {by['jax.pure_callback'] / by['t2j_ad ffi']:.1f}x (target >= 5x)"
    )
    return markdown_table(timings, "floor") + "\n\n" + summary


def _signed(seconds: float) -> str:
    return format_seconds(seconds) if seconds >= 0 else f"-{format_seconds(-seconds)} (within noise)"


def large(megabytes: int, repeats: int) -> str:
    n = megabytes * 2**20 // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    tx = torch.from_dlpack(x).clone()
    rows = []
    for label, fn in (("`x[-8:] * 2` (reads 32 bytes)", tail2), ("`x.sum()` (reads everything)", total)):
        f = jitted_on("ffi", fn, x)
        np.testing.assert_allclose(np.asarray(f(x)), fn(tx).cpu().numpy(), rtol=1e-3)
        timings = time_calls(
            {"torch direct": torch_done(lambda fn=fn: fn(tx)), "t2j_ad ffi": lambda f=f: f(x).block_until_ready()},
            warmup=3,
            repeats=repeats,
        )
        by = {t.name: t.median for t in timings}
        rows.append(
            f"**{label}**\n\n"
            + markdown_table(timings, "torch direct")
            + f"\n\nt2j_ad ffi adds {_signed(by['t2j_ad ffi'] - by['torch direct'])} "
            "over the direct PyTorch call (target < 1 ms)"
        )
    return "\n\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads (default 1)")
    parser.add_argument("--large-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=31)
    args = parser.parse_args()
    set_threads(args.threads)
    print_report(
        "Call latency: t2j_ad's custom call vs the floor and jax.pure_callback",
        "python benchmarks/bench_call_latency.py " + " ".join(sys.argv[1:]),
        [
            ("Small input: `torch.sin(x) * 2`, x float32 (8,), jitted", small(args.repeats)),
            (f"Large input: {args.large_mb} MB float32, jitted", large(args.large_mb, args.repeats)),
        ],
    )


if __name__ == "__main__":
    main()
