"""qhoptim.optax from the built wheel, in the optax session (where optax is installed).

The core session runs ``tests/test_packaging.py`` with NumPy only, where the
backend check can only assert the ImportError; this file runs the positive
check with the same helpers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

_HELPERS = Path(__file__).resolve().parents[1] / "test_packaging.py"


def _load_helpers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_qhoptim_packaging_helpers", _HELPERS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


packaging = _load_helpers()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return packaging.build_and_install(tmp_path_factory.mktemp("wheel"))


def test_optax_backend_imports_from_the_wheel(wheel: Any, tmp_path: Path) -> None:
    # No skip: this session installs jax and optax, so the check must run.
    assert packaging.frameworks_installed("qhoptim.optax")
    result = packaging.import_from_wheel(wheel, ["qhoptim.optax"], tmp_path)
    packaging.assert_imported_from_wheel(wheel, result, "qhoptim.optax")
