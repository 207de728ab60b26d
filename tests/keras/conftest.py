"""Settings of the Keras backend's tests (``tests/keras``); helpers are in ``qh_keras_testing``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# TensorFlow's C++ start-up chatter (CPU features, oneDNN) is noise in test logs.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = Path(__file__).resolve().parent

# Keras's own Variable.__array__ (keras 3.15) predates NumPy 2's ``copy``
# keyword; NumPy >= 2.4 warns each time Keras reads a variable into NumPy
# (``get_config``, ``model.get_weights``). Not ours to fix; the suite otherwise
# turns every warning into an error (pyproject's filterwarnings).
KERAS_NUMPY_COPY_WARNING = (
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.filterwarnings(KERAS_NUMPY_COPY_WARNING))
