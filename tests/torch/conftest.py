"""Settings for the torch backend's tests (``tests/torch``)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "compile: runs torch.compile (slow on CPU; deselect with -m 'not compile')",
    )
