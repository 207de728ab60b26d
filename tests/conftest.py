"""Settings of every test run.

``QHOPTIM_REQUIRE_ALL=1`` turns every skip into a failure. The nox sessions
that install everything their tests need (``distributed``, ``integrations``)
set it: there a test that did not run must not read as passing.

Hypothesis runs without its per-example deadline: nox spreads a session's
tests over every core (pytest-xdist), where an example's wall time says how busy
the machine is, not whether the code is right, and this project's tests never
assert a time.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest
from hypothesis import settings

settings.register_profile("qhoptim", deadline=None)
settings.load_profile("qhoptim")

REQUIRE_ALL = os.environ.get("QHOPTIM_REQUIRE_ALL", "") not in ("", "0")


def _no_skips(report: pytest.CollectReport | pytest.TestReport) -> None:
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = (
            f"skipped, but QHOPTIM_REQUIRE_ALL=1 requires it to run: {report.longrepr}"
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
