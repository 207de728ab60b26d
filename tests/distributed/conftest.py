"""Settings of the scale-out tests (``tests/distributed``).

Each test compares a distributed run with an independent single-device run and
reports the largest difference it measured; the figures are listed at the end
of the run (``report_difference``).

``QHOPTIM_REQUIRE_ALL=1`` (the ``distributed`` nox session sets it; see
``tests/conftest.py``) turns every skip into a failure: there, each framework
is installed, and a test that did not run must not read as passing.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

# TensorFlow's C++ start-up chatter (CPU features, oneDNN) is noise in test logs.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_FIGURES = pytest.StashKey[list[tuple[str, float, float, str]]]()


@pytest.fixture
def report_difference(
    request: pytest.FixtureRequest, record_property: Callable[[str, object], None]
) -> Callable[..., None]:
    """``report_difference(what, max_abs, max_rel, tolerance)``: keep a measured figure."""

    def report(what: str, max_abs: float, max_rel: float, tolerance: str = "") -> None:
        record_property(what, f"max abs {max_abs:.3g}, max rel {max_rel:.3g}")
        request.config.stash.setdefault(_FIGURES, []).append((what, max_abs, max_rel, tolerance))

    return report


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    figures = config.stash.get(_FIGURES, [])
    if not figures:
        return
    terminalreporter.section("distributed vs single-device: largest differences")
    width = max(len(what) for what, *_ in figures)
    for what, max_abs, max_rel, tolerance in figures:
        terminalreporter.write_line(
            f"{what:<{width}}  abs {max_abs:9.3g}  rel {max_rel:9.3g}  {tolerance}"
        )
