"""qhoptim.keras from the built wheel, on the active Keras backend.

``qhoptim.keras`` is a package whose backend modules (``_tensorflow``,
``_torch``) are imported only on their backend, so a module missing from the
wheel would show only there: each backend's run imports the package and its
backend module from the wheel, with the helpers of ``tests/test_packaging.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from qh_keras_testing import BACKEND

_HELPERS = Path(__file__).resolve().parents[1] / "test_packaging.py"
BACKEND_MODULES = {"tensorflow": ["qhoptim.keras._tensorflow"], "torch": ["qhoptim.keras._torch"]}


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


def test_keras_backend_imports_from_the_wheel(wheel: Any, tmp_path: Path) -> None:
    # No skip: the keras sessions install keras and the backend's framework.
    assert packaging.frameworks_installed("qhoptim.keras")
    modules = ["qhoptim.keras", *BACKEND_MODULES.get(BACKEND, [])]
    result = packaging.import_from_wheel(wheel, modules, tmp_path)  # KERAS_BACKEND inherited
    for module in modules:
        packaging.assert_imported_from_wheel(wheel, result, module)
