"""Hypothesis profiles for the property suite.

``ci`` (the default) is derandomized: every run tries the same examples, few
enough to finish in a few minutes on two cores. ``long`` tries many more, with
fresh randomness each run; select it with ``T2J_AD_HYPOTHESIS_PROFILE=long``.
Both print the shrunk failing example and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

from hypothesis import HealthCheck, Phase, settings


# NOTE [two conftest modules]
# tests/ has no __init__.py, so pytest imports both tests/conftest.py and this
# file under the one module name ``conftest``; this one, imported second,
# wins, and every ``from conftest import assert_tree_allclose`` in tests/
# (collected after this directory) lands here. Re-export the shared helpers.
def _load_shared_conftest():
    path = pathlib.Path(__file__).resolve().parents[1] / "conftest.py"
    spec = importlib.util.spec_from_file_location("t2j_ad_shared_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_shared = _load_shared_conftest()
assert_tree_allclose = _shared.assert_tree_allclose
run_in_threads = _shared.run_in_threads
TOLERANCES = _shared.TOLERANCES
ON_GPU = _shared.ON_GPU
TORCH_DEVICE = _shared.TORCH_DEVICE
cuda_only = _shared.cuda_only
to_numpy = _shared.to_numpy
to_torch = _shared.to_torch
count_resolutions = _shared.count_resolutions
count_trial_runs = _shared.count_trial_runs
finishes_within = _shared.finishes_within

_COMMON = dict(
    deadline=None,  # the first call of each shape compiles; timing is not the point
    print_blob=True,
    suppress_health_check=(HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much),
)

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=int(os.environ.get("T2J_AD_HYPOTHESIS_EXAMPLES", "60")),
    # No example database: a derandomized run is reproducible by itself.
    database=None,
    phases=(Phase.explicit, Phase.generate, Phase.shrink, Phase.explain),
    **_COMMON,
)
settings.register_profile(
    "long",
    max_examples=int(os.environ.get("T2J_AD_HYPOTHESIS_EXAMPLES", "200")),
    **_COMMON,
)

PROFILE = os.environ.get("T2J_AD_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def pytest_report_header(config):  # noqa: D103
    return f"t2j_ad property tests: hypothesis profile {PROFILE!r} ({settings.default.max_examples} examples per test)"


# NOTE [counting examples]
# Every property test body starts with strategies.note_reproduction(), which
# counts the example: what is counted is examples actually executed (shrinking
# and explicit examples included), not the configured maxima. At the end of a
# pytest run the count is printed and, when T2J_AD_EXAMPLE_COUNT_FILE names a
# file, appended to it as one line; scripts/run_tests.sh sets it, sums the
# lines of every pytest run it made and prints "property examples this run: N".
# Under pytest-xdist (-n) each worker appends its own line.
COUNT_FILE_ENV = "T2J_AD_EXAMPLE_COUNT_FILE"


def _examples_run() -> int:
    strategies = sys.modules.get("strategies")
    return strategies.examples_run() if strategies is not None else 0


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: D103
    if config.pluginmanager.has_plugin("dsession"):
        return  # the pytest-xdist controller runs no test: each worker counts its own
    n = _examples_run()
    terminalreporter.write_line(f"property examples this pytest run: {n}")
    path = os.environ.get(COUNT_FILE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{n}\n")
