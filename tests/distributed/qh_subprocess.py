"""Run a program of this directory in a fresh Python process.

JAX reads ``XLA_FLAGS`` and TensorFlow its logical devices once, at start-up, so
the multi-device runs need processes of their own. They import the same
``qhoptim`` as the pytest process (its checkout comes first on PYTHONPATH).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import qhoptim

HERE = Path(__file__).resolve().parent
QHOPTIM_ROOT = Path(qhoptim.__file__).resolve().parents[1]


def run_program(script: str, *args: str, env: dict[str, str], timeout: float = 300) -> str:
    """Run ``python HERE/script *args`` with ``env`` added; return its stdout, fail on error."""
    path = os.pathsep.join(p for p in (str(QHOPTIM_ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        env={**os.environ, "PYTHONPATH": path, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{script} exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
        )
    return proc.stdout


def require_module(name: str) -> None:
    """Skip unless ``name`` is installed; it is imported by the subprocess only.

    (``pytest.importorskip`` would import it here too: TensorFlow takes seconds.)
    """
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
