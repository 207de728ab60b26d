"""Settings for the torch backend's tests (``tests/torch``)."""

from __future__ import annotations

import os

import pytest

from conformance.triton_interpreter import skip_repeated_patching

# Under Triton's interpreter (the triton nox session: ``fused=True`` on CPU
# tensors runs the CUDA kernels), NumPy computes the masked-off lanes of a block
# too, and warns on their 0/0; the lanes are never stored.
INTERPRETING_TRITON = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter re-patches triton.language at every helper call inside a
# kernel, to no effect; skipping that halves the interpreted tests' time.
skip_repeated_patching()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "compile: runs torch.compile (slow on CPU; deselect with -m 'not compile')",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if INTERPRETING_TRITON:
        lanes = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
        for item in items:
            item.add_marker(lanes)
