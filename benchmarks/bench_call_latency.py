"""Per-call cost of the custom call that runs PyTorch inside a JAX program.

Small input, ``torch.sin(x) * 2`` on an (8,) float32, jitted. Contenders:

- ``floor``: the same PyTorch call made directly, plus a jitted JAX identity
  on the same input (the least any JAX-to-PyTorch call can cost);
- ``t2j_ad ffi``: the jaxify'd function under ``jax.jit``, FFI backend;
- ``ffi handler only``: the same custom call with a bare runner (tensors in,
  ``torch.sin(x) * 2`` copied out), i.e. without the runtime's thread, grad
  mode, mutation and result checks: the cost of the C++ path itself;
- ``t2j_ad callback``: the same, forced onto the Python callback backend;
- ``jax.pure_callback``: a jitted ``jax.pure_callback`` doing the same work;
- ``torch2jax``: the same function through the ``torch2jax`` package, when
  it is installed (it is not a requirement of t2j_ad).

On a GPU a third section times the pieces of a call there: whole calls that
do less and less (a jitted JAX identity; our custom call with a runner that
does nothing; one that only copies its input on XLA's stream), then
host-side steps alone: making XLA's stream current (NOTE [switching to XLA's
stream]), with and without ordering it with PyTorch's stream (NOTE [ordering
with the caller's PyTorch stream]), against entering and leaving
``torch.cuda.stream``, and the DLPack import of a CUDA buffer against a CPU
one.

Targets (issue 5): ``t2j_ad ffi`` at most 1.5x ``floor``, and at least 5x
faster than ``jax.pure_callback``.

Large input, 256 MB of float32: the custom call should add under 1 ms over
the direct PyTorch call, because the input is not copied. Measured on a
function that reads only the last 8 elements (``x[-8:] * 2``), so the time is
all overhead and a copy of the input (tens of ms) would stand out; a full
reduction (``x.sum()``) is shown too.

A module of many submodules, 40 x (``Linear(8, 8)``, ``Tanh``) on a (4, 8)
input: ``jaxify_module``'s call, jitted, against the module called directly.
What t2j_ad adds over the direct call is the custom call above plus binding
the parameters into the module (NOTE [binding tensors into a module]).

    python benchmarks/bench_call_latency.py [--threads 1] [--large-mb 256]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402
    format_seconds,
    markdown_table,
    print_report,
    set_threads,
    time_calls,
    torch_device,
    torch_done,
)

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


def custom_call(x: jax.Array, key: int, runner):
    """``jax.jit`` of the FFI custom call on ``x`` with a runner of our own.

    Registered under a negative key, which ``registry.register`` never
    hands out, in the table the C++ handler reads (NOTE [registry lifetime]).
    """
    from t2j_ad.backends import ffi, registry

    assert ffi.available()
    registry.runners[key] = runner
    call = jax.ffi.ffi_call(ffi.TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return jax.jit(lambda x: call(x, key=np.int64(key)))


def handler_only(x: jax.Array):
    """The FFI custom call with a bare runner: ``torch.sin(x) * 2`` copied out."""
    return custom_call(x, -1, lambda inputs, outputs, stream: outputs[0].copy_(sin2(inputs[0])))


def torch2jax_contender(fn, x: jax.Array):
    """``jax.jit`` of the ``torch2jax`` package's wrapper of ``fn``, or None
    when that package is not installed (or is t2j_ad's own compat layer)."""
    try:
        import torch2jax
    except ImportError:
        return None
    from t2j_ad import compat

    if getattr(torch2jax, "torch2jax", None) in (None, compat.torch2jax):
        return None
    return jax.jit(torch2jax.torch2jax(fn, x))


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
    other = torch2jax_contender(sin2, x)
    np.testing.assert_allclose(ffi(x), np.asarray(jnp.sin(x) * 2), rtol=1e-6)
    np.testing.assert_allclose(pure(x), np.asarray(jnp.sin(x) * 2), rtol=1e-6)

    sin2_done = torch_done(lambda: sin2(tx))

    def floor():
        sin2_done()
        identity(x).block_until_ready()

    contenders = {
        "floor": floor,
        "t2j_ad ffi": lambda: ffi(x).block_until_ready(),
        "ffi handler only": lambda: raw(x).block_until_ready(),
        "t2j_ad callback": lambda: callback(x).block_until_ready(),
        "jax.pure_callback": lambda: pure(x).block_until_ready(),
    }
    if other is not None:
        np.testing.assert_allclose(other(x), np.asarray(jnp.sin(x) * 2), rtol=1e-6)
        contenders["torch2jax"] = lambda: other(x).block_until_ready()
    timings = time_calls(contenders, warmup=200, repeats=repeats)
    by = {t.name: t.median for t in timings}
    summary = (
        f"t2j_ad ffi / floor = {by['t2j_ad ffi'] / by['floor']:.2f}x (target <= 1.5x); "
        f"jax.pure_callback / t2j_ad ffi = {by['jax.pure_callback'] / by['t2j_ad ffi']:.1f}x (target >= 5x)"
    )
    if other is not None:
        summary += f"; torch2jax / t2j_ad ffi = {by['torch2jax'] / by['t2j_ad ffi']:.2f}x (target > 1x)"
    else:
        summary += "; torch2jax: not installed here, not timed"
    return markdown_table(timings, "floor") + "\n\n" + summary


def gpu_pieces(repeats: int) -> str:
    """What the parts of a GPU call cost: whole calls that do less and less,
    then host-side steps timed alone."""
    from torch.utils.dlpack import to_dlpack

    from t2j_ad import cuda_streams
    from t2j_ad.backends.ffi import _from_dlpack

    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    identity = jax.jit(lambda x: x)
    noop = custom_call(x, -2, lambda inputs, outputs, stream: None)
    copy = custom_call(
        x, -3, lambda inputs, outputs, stream: cuda_streams.run_on_stream(
            cuda_streams.external_stream(stream, inputs[0].get_device()), outputs[0].copy_, inputs[0]
        )
    )
    calls = time_calls(
        {
            "jitted JAX identity": lambda: identity(x).block_until_ready(),
            "custom call, runner does nothing": lambda: noop(x).block_until_ready(),
            "custom call, runner copies the input on XLA's stream": lambda: copy(x).block_until_ready(),
        },
        warmup=200,
        repeats=repeats,
    )

    device = torch_device()
    xla_side = torch.cuda.Stream(device=device)  # stands in for XLA's stream
    wrapped = cuda_streams.external_stream(xla_side.cuda_stream, device.index)
    cuda_streams.run_on_stream(wrapped, lambda: None)  # the first call checks the direct switch

    def context_manager():
        with torch.cuda.stream(wrapped):
            pass

    on_gpu, on_cpu = torch.ones(8, device=device), torch.ones(8)
    contenders = {
        "torch.cuda.stream enter + exit": context_manager,
        "t2j_ad stream switch, ordered both ways": lambda: cuda_streams.run_on_stream(wrapped, lambda: None),
        "to_dlpack + from_dlpack, CPU tensor": lambda: _from_dlpack(to_dlpack(on_cpu)),
        "to_dlpack + from_dlpack, CUDA tensor": lambda: _from_dlpack(to_dlpack(on_gpu)),
    }
    switch = cuda_streams._runner.switch
    if switch is not None:
        ids = (wrapped.stream_id, wrapped.device_index, wrapped.device_type)
        contenders["t2j_ad stream switch alone"] = lambda: switch.run(ids, lambda was_current: None)
    steps = time_calls(contenders, warmup=200, repeats=repeats)
    reason = cuda_streams._runner.fallback_reason
    how = f"the context manager (the direct switch did not check out: {reason})" if reason else "the direct switch"
    return (
        markdown_table(calls, "jitted JAX identity")
        + "\n\n"
        + markdown_table(steps, "torch.cuda.stream enter + exit")
        + f"\n\nt2j_ad switches streams by {how}."
    )


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


MODULE_LAYERS = 40


def module_call(repeats: int) -> str:
    torch.manual_seed(0)
    layers = [layer for _ in range(MODULE_LAYERS) for layer in (torch.nn.Linear(8, 8), torch.nn.Tanh())]
    module = torch.nn.Sequential(*layers).to(torch_device())
    apply, params = t2j_ad.jaxify_module(module)
    f = jax.jit(apply)
    x = jax.random.normal(jax.random.key(1), (4, 8), jnp.float32)
    tx = torch.from_dlpack(x).clone()
    with torch.no_grad():
        np.testing.assert_allclose(np.asarray(f(params, x)), module(tx).cpu().numpy(), rtol=1e-5, atol=1e-6)

    def direct():
        with torch.no_grad():
            return module(tx)

    timings = time_calls(
        {"torch direct": torch_done(direct), "t2j_ad ffi": lambda: f(params, x).block_until_ready()},
        warmup=3,
        repeats=repeats,
    )
    by = {t.name: t.median for t in timings}
    return (
        markdown_table(timings, "torch direct")
        + f"\n\nt2j_ad ffi adds {_signed(by['t2j_ad ffi'] - by['torch direct'])} over the direct call "
        f"({len(list(module.modules()))} modules, {len(params)} parameters)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads (default 1)")
    parser.add_argument("--large-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=31)
    args = parser.parse_args()
    set_threads(args.threads)
    sections = [
        ("Small input: `torch.sin(x) * 2`, x float32 (8,), jitted", small(args.repeats)),
        (f"Large input: {args.large_mb} MB float32, jitted", large(args.large_mb, args.repeats)),
        (f"A module: {MODULE_LAYERS} x (Linear(8, 8), Tanh), input (4, 8), jitted", module_call(args.repeats)),
    ]
    if torch_device().type == "cuda":
        sections.append(("Pieces of a GPU call, each alone", gpu_pieces(args.repeats)))
    print_report(
        "Call latency: t2j_ad's custom call vs the floor and jax.pure_callback",
        "python benchmarks/bench_call_latency.py " + " ".join(sys.argv[1:]),
        sections,
    )


if __name__ == "__main__":
    main()
