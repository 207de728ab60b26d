"""The conformance rows of the active Keras backend all pass (float64 and float32;
QHMuon float32 only).

The runner runs in its own process, as ``python -m conformance --backends keras``
does: its adapter switches on ``jax_enable_x64`` for the JAX backend's float64
rows, which must not leak into the other tests (Keras users run JAX without it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from qh_keras_testing import BACKEND

from conformance import runner
from conformance.cases import load_cases

ROOT = Path(__file__).resolve().parents[2]


def test_conformance_rows_all_pass(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "--backends", "keras", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.exists(), proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    # float64 and float32, but QHMuon in float32 alone (Keras's Muon's dtype)
    assert {(r["case"], r["dtype"]) for r in rows} == {
        (c.name, dtype)
        for c in load_cases()
        for dtype in runner.DTYPES
        if c.optimizer != "qhmuon" or dtype == "float32"
    }
    assert {r["backend"] for r in rows} == {f"keras-{BACKEND}"}
    assert {r["dtype"] for r in rows} == {"float32", "float64"}
    failed = [r for r in rows if not r["passed"]]
    assert not failed, proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    runner.record(runner.read_table(out), "keras")
