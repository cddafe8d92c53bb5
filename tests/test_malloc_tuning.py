"""glibc malloc tuning (NOTE [heap trimming] in t2j_ad/malloc_tuning.py).

The settings are process-wide and applied once, so each end-to-end case runs
in a fresh interpreter.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap

import pytest

from t2j_ad import malloc_tuning

needs_glibc = pytest.mark.skipif(
    not malloc_tuning.on_glibc(), reason="the tuning applies to glibc's malloc only (Linux with glibc)"
)

# Runs one jaxify'd call, then reports the outcome and what glibc does with a
# 24 MiB block: above glibc's starting mmap threshold (128 KiB), below the
# tuned one (32 MiB); freeing it leaves less than the tuned trim threshold
# (64 MiB) at the top of the heap.
_PROBE = textwrap.dedent(
    """
    import ctypes, json
    import jax.numpy as jnp, torch
    import t2j_ad
    from t2j_ad import malloc_tuning

    t2j_ad.jaxify(lambda x: x * 2)(jnp.ones(3))

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    info = getattr(libc, "mallinfo2", None)
    report = {"outcome": malloc_tuning.tune_malloc(), "again": malloc_tuning.tune_malloc()}
    if info is not None:
        info.restype = MallInfo2
        before = info()
        block = libc.malloc(24 << 20)
        during = info()
        libc.free(block)
        after = info()
        report.update(
            mapped=during.hblkhd > before.hblkhd,
            heap_kept=after.arena >= during.arena,
        )
    print(json.dumps(report))
    """
)


def _probe(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    environ.pop(malloc_tuning.ENV, None)
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=environ, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_glibc
def test_first_call_tunes_glibc_so_large_blocks_stay_in_the_heap():
    report = _probe()
    assert report["outcome"] == report["again"] == "tuned"
    if "mapped" not in report:
        pytest.skip("glibc before 2.33 has no mallinfo2 to observe the heap with")
    # Below the mmap threshold: served from the heap, not mapped afresh...
    assert not report["mapped"]
    # ...and freeing it does not hand the heap top back to the OS.
    assert report["heap_kept"]


@needs_glibc
def test_opting_out_leaves_malloc_alone():
    assert _probe(**{malloc_tuning.ENV: "0"})["outcome"] == "disabled"


@needs_glibc
@pytest.mark.parametrize(
    "env",
    [
        {"MALLOC_TOP_PAD_": str(64 << 20)},
        {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"},
    ],
    ids=["top_pad", "mmap_threshold", "tunables"],
)
def test_the_applications_own_malloc_settings_win(env):
    assert _probe(**env)["outcome"] == "user-configured"


def test_unrelated_tunables_do_not_count_as_a_choice(monkeypatch):
    for name in ("MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")
    assert not malloc_tuning._user_configured()


@pytest.mark.parametrize("value", ["", "1", "yes", "ON"])
def test_switch_values_that_enable(monkeypatch, value):
    monkeypatch.setenv(malloc_tuning.ENV, value)
    assert malloc_tuning._enabled()


@pytest.mark.parametrize("value", ["0", "false", "Off", "no"])
def test_switch_values_that_disable(monkeypatch, value):
    monkeypatch.setenv(malloc_tuning.ENV, value)
    assert not malloc_tuning._enabled()


def test_a_bad_switch_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(malloc_tuning.ENV, "sometimes")
    with pytest.raises(ValueError, match="T2J_AD_TUNE_MALLOC must be 1 .* or 0"):
        malloc_tuning._enabled()


def test_thresholds_are_glibcs_own_ceiling():
    # DEFAULT_MMAP_THRESHOLD_MAX is 4 * 1024 * 1024 * sizeof(long) on 64-bit
    # glibc, and its dynamic rule sets the trim threshold to twice it.
    assert malloc_tuning.MMAP_THRESHOLD == 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
    assert malloc_tuning.TRIM_THRESHOLD == 2 * malloc_tuning.MMAP_THRESHOLD
