"""``import qhoptim`` must import no ML framework and stay cheap."""

from __future__ import annotations

import json
import subprocess
import sys

FRAMEWORKS = ("torch", "tensorflow", "keras", "jax", "jaxlib", "optax", "flax", "mlx")


def _fresh(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout


def test_import_qhoptim_loads_no_framework() -> None:
    # Importing the core modules explicitly too: they are what backends import.
    code = (
        "import sys, json, qhoptim, qhoptim.rules, qhoptim.validation, qhoptim.reference\n"
        "import qhoptim.convert, qhoptim.analysis, qhoptim.common, qhoptim.version\n"
        "print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))"
    )
    loaded = set(json.loads(_fresh(code)))
    assert not loaded & set(FRAMEWORKS), loaded & set(FRAMEWORKS)


def test_import_qhoptim_is_fast() -> None:
    # Best of several fresh interpreters, measured inside the interpreter so
    # process start-up does not count. "Well under 0.2 s" on a loaded CI box.
    code = "import time; t = time.perf_counter(); import qhoptim; print(time.perf_counter() - t)"
    best = min(float(_fresh(code)) for _ in range(5))
    assert best < 0.1, f"import qhoptim took {best:.3f} s"


def test_core_submodules_are_lazy_attributes() -> None:
    import qhoptim

    assert qhoptim.rules.qhm_update is not None
    assert "reference" in dir(qhoptim)
    try:
        qhoptim.torchh  # noqa: B018
    except AttributeError as e:
        assert "torchh" in str(e)
    else:  # pragma: no cover
        raise AssertionError("unknown attribute did not raise")
