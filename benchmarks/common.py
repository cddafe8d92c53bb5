"""Shared timing helpers for the benchmarks in this folder.

Every benchmark times each contender in the same process and reports ratios,
so the numbers compare like with like on whatever machine runs them. A
contender is a zero-argument callable that returns when its work is done
(call ``jax.block_until_ready`` inside it for JAX results).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Benchmarks run on CPU unless told otherwise, like the tests.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@dataclass(frozen=True)
class Timing:
    """Median, spread and best of one contender's per-call time, in seconds."""

    name: str
    median: float
    low: float
    high: float
    best: float
    repeats: int


def torch_device() -> Any:
    """The torch device matching JAX's default device: ``cuda:N`` or ``cpu``,
    so a PyTorch contender computes where t2j_ad's calls do."""
    import jax
    import torch

    device = jax.devices()[0]
    return torch.device("cuda", device.local_hardware_id) if device.platform == "gpu" else torch.device("cpu")


def to_torch(*trees: Any) -> list[Any]:
    """Pytrees of NumPy arrays as torch tensors on ``torch_device()``."""
    import jax
    import torch

    device = torch_device()
    return [jax.tree.map(lambda a: torch.from_numpy(a).to(device), tree) for tree in trees]


def torch_done(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` as a contender that returns when PyTorch's work is done (CUDA
    kernels are asynchronous; JAX contenders block on their results alike)."""
    import torch

    if torch_device().type != "cuda":
        return fn

    def done() -> Any:
        result = fn()
        torch.cuda.synchronize()
        return result

    return done


def _calls_per_sample(fn: Callable[[], Any], min_time: float) -> int:
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, int(min_time / once))


def time_calls(
    contenders: Mapping[str, Callable[[], Any]],
    *,
    warmup: int = 3,
    repeats: int = 15,
    min_time: float = 0.05,
    repeats_of: Mapping[str, int] | None = None,
) -> list[Timing]:
    """Median per-call time of each contender, sampled round-robin.

    ``warmup`` calls of each come first (compilation, caches). Then each of
    ``repeats`` rounds times every contender once, in turn, running it enough
    times to last about ``min_time`` seconds (so sub-millisecond calls are not
    swamped by timer resolution). Interleaving means a burst of load from
    elsewhere on the machine hits every contender alike, which keeps the
    ratios honest on a shared machine. ``repeats_of`` lowers the number of
    rounds for slow contenders.

    Each round starts one contender later than the last, so no contender
    always runs right after the same other one (XLA's CPU worker threads, for
    one, keep spinning for a moment after a JAX computation).
    """
    repeats_of = dict(repeats_of or {})
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    number = {name: _calls_per_sample(fn, min_time) for name, fn in contenders.items()}
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            if round_ >= repeats_of.get(name, repeats):
                continue
            fn = contenders[name]
            start = time.perf_counter()
            for _ in range(number[name]):
                fn()
            samples[name].append((time.perf_counter() - start) / number[name])
    timings = []
    for name, times in samples.items():
        times.sort()
        q = len(times) // 4  # interquartile range: the spread between runs
        timings.append(Timing(name, statistics.median(times), times[q], times[-1 - q], times[0], len(times)))
    return timings


def cross_entropy_of(apply: Callable[..., Any]) -> Callable[..., Any]:
    """The JAX loss of a training step: the mean cross-entropy of
    ``apply(params, x)``'s logits against one-hot labels."""
    import jax
    import jax.numpy as jnp

    def loss(params: Any, x: Any, onehot: Any) -> Any:
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(apply(params, x)) * onehot, axis=-1))

    return loss


def torch_training_step(module: Any, x: Any, onehot: Any) -> tuple[Any, dict[str, Any]]:
    """One training step of ``module`` by PyTorch's autograd, with the loss of
    ``cross_entropy_of``: the loss, and each parameter's gradient."""
    import torch

    module.zero_grad(set_to_none=True)
    loss = -(torch.log_softmax(module(x), -1) * onehot).sum(-1).mean()
    loss.backward()
    return loss, {name: p.grad for name, p in module.named_parameters()}


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def markdown_table(timings: Sequence[Timing], reference: str) -> str:
    """A table of medians (with interquartile range and best sample) and the
    ratio of each median to the median of ``reference``."""
    ref = next(t for t in timings if t.name == reference).median
    lines = [
        f"| contender | median | IQR | best | median / median of {reference} |",
        "|---|---:|---:|---:|---:|",
    ]
    for t in timings:
        lines.append(
            f"| {t.name} | {format_seconds(t.median)} | "
            f"{format_seconds(t.low)} – {format_seconds(t.high)} | {format_seconds(t.best)} | {t.median / ref:.2f}x |"
        )
    return "\n".join(lines)


def rss_mb() -> float:
    """This process's resident memory (RSS) now, in MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def set_threads(n: int) -> None:
    """Use ``n`` PyTorch threads in t2j_ad calls and in plain PyTorch alike,
    so torch.func references run with the same width as t2j_ad."""
    import torch

    import t2j_ad

    t2j_ad.set_torch_threads(n)
    torch.set_num_threads(n)


def environment() -> str:
    """One line naming what produced the numbers."""
    import jax
    import torch

    from t2j_ad import backends
    from t2j_ad.malloc_tuning import tune_malloc

    backend = backends.select().__name__.rsplit(".", 1)[-1]
    return (
        f"t2j_ad backend `{backend}`, glibc malloc `{tune_malloc()}`, torch {torch.__version__}, jax {jax.__version__}, "
        f"Python {sys.version.split()[0]}, {platform.machine()} with {os.cpu_count()} CPU(s), "
        f"JAX platform {jax.default_backend()}"
    )


def print_report(title: str, command: str, sections: Sequence[tuple[str, str]]) -> None:
    """Print a markdown block: title, command, environment, then each table."""
    print(f"### {title}\n")
    print(f"`{command}`\n")
    print(environment() + "\n")
    for heading, body in sections:
        print(f"{heading}\n\n{body}\n")


def thread_args(doc: str):
    """The ``--threads`` / ``--repeats`` command line every benchmark takes."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="PyTorch thread counts to measure")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["graph", "inductor"],
        default=["graph", "inductor"],
        help="compile modes to time besides eager (default both; inductor compiles for minutes on a GPU)",
    )
    parser.add_argument(
        "--first-call-probe",
        action="store_true",
        help="internal: time the first inductor call in this fresh process and print it as JSON",
    )
    return parser.parse_args()


def compiled_modes_summary(by_name: Mapping[str, float], modes: Sequence[str], inductor_target: float) -> str:
    """The summary's ratios for the compile modes timed (``--modes``):
    graph against torch.func (target 0.8x) and pure JAX, inductor against
    pure JAX (``inductor_target``); each part starts with "; "."""
    parts = ""
    if "graph" in modes:
        parts += f"; graph / torch.func = {by_name['t2j_ad graph'] / by_name['torch.func']:.2f}x (target <= 0.8x)"
        parts += f"; graph / pure JAX = {by_name['t2j_ad graph'] / by_name['pure JAX']:.2f}x"
    if "inductor" in modes:
        ratio = by_name["t2j_ad inductor"] / by_name["pure JAX"]
        parts += f"; inductor / pure JAX = {ratio:.2f}x (target <= {inductor_target}x)"
    return parts


def first_call_costs(name: str, jaxified: Any, call: Callable[[], Any]) -> str:
    """Run ``call`` (the first call of a ``compile="graph"|"inductor"`` function)
    and report what it cost: the whole first call, and the trace and compile
    seconds ``jaxified.compile_stats()`` recorded."""
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    stats = jaxified.compile_stats()
    return (
        f"{name}: first call {format_seconds(first)} (trace {format_seconds(stats['trace_seconds'])}, "
        f"compile {format_seconds(stats['compile_seconds'])}; {stats['graphs']} graph(s), "
        f"{stats['eager_fallbacks']} eager fallback(s))"
    )


def first_call_probe(jaxified: Any, call: Callable[[], Any]) -> None:
    """In a fresh process (``--first-call-probe``): time ``call``, the first
    call of the inductor version, and print it with ``jaxified.compile_stats()``
    as JSON for ``second_process_section``."""
    start = time.perf_counter()
    call()
    print(json.dumps({"first_call": time.perf_counter() - start, **jaxified.compile_stats()}))


def second_process_section(script: str) -> tuple[str, str]:
    """Run ``script --first-call-probe`` in a fresh interpreter (sharing this
    process's inductor cache directory) and report its first call."""
    done = subprocess.run(
        [sys.executable, script, "--first-call-probe"], capture_output=True, text=True, check=True, env=dict(os.environ)
    )
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    return (
        "Inductor in a second process (PyTorch's disk cache warm)",
        f"first call {probe['first_call']:.2f} s, of which compile {probe['compile_seconds']:.2f} s "
        f"and trace {probe['trace_seconds']:.2f} s",
    )


def fresh_inductor_cache() -> str:
    """Point inductor at an empty cache directory for this run (and the
    processes it starts), so the first compile is a cold one."""
    import tempfile

    path = tempfile.mkdtemp(prefix="t2j_ad_bench_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path
