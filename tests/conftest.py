"""Settings of every test run.

``QHOPTIM_REQUIRE_ALL=1`` turns every skip into a failure; the nox sessions
that install everything their tests need (``distributed``, ``integrations``,
``triton``) set it. ``QHOPTIM_REQUIRE_ALL=platform`` turns every skip into a
failure but the platform's (:data:`PLATFORM_SKIPS`: a GPU, another Keras
backend, a framework the session does not install); every other session sets
that. Either way a test that did not run for any other reason (a package that
failed to install, an import that broke) does not read as passing.

Hypothesis runs without its per-example deadline: nox spreads a session's
tests over every core (pytest-xdist), where an example's wall time says how busy
the machine is, not whether the code is right, and this project's tests never
assert a time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator

import pytest
from hypothesis import settings

settings.register_profile("qhoptim", deadline=None)
settings.load_profile("qhoptim")

REQUIRE_ALL = os.environ.get("QHOPTIM_REQUIRE_ALL", "") not in ("", "0")
PLATFORM_ONLY = os.environ.get("QHOPTIM_REQUIRE_ALL", "") == "platform"

#: The skip reasons that say what the platform lacks (or has), which no
#: session is expected to have all of: a CUDA device, another Keras backend, a
#: framework installed in another session (or, for the tests of its absence,
#: installed here), Triton's interpreter or its CUDA backend, TensorFlow's
#: int64 step count, JAX's buffer assignment.
PLATFORM_SKIPS = re.compile(
    r"needs a CUDA device|needs CUDA, or Triton's interpreter|needs Triton's CUDA backend"
    r"|counts CUDA kernels|Triton's interpreter \(TRITON_INTERPRET=1\) only"
    r"|not installed here; qhoptim\.\w+ is checked where it is"
    r"|installed here: test_backend_imports_from_the_wheel checks"
    r"|needs the \w+ Keras backend|iterations is int64 here|XLA's buffer assignment"
)


def _no_skips(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not (REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail")):
        return
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not (PLATFORM_ONLY and PLATFORM_SKIPS.search(str(reason))):
        report.outcome = "failed"
        report.longrepr = (
            f"skipped, but QHOPTIM_REQUIRE_ALL={os.environ['QHOPTIM_REQUIRE_ALL']} requires it "
            f"to run: {report.longrepr}"
        )


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    _no_skips(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _no_skips(report)
    return report
