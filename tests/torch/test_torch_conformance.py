"""The torch adapters against the float64 reference, on every conformance case."""

from __future__ import annotations

import pytest

from conformance import runner
from conformance.adapters import load_adapter
from conformance.cases import load_cases


@pytest.mark.parametrize("backend", ["torch", "torch-foreach", "torch-fused"])
def test_every_conformance_row_passes(backend: str) -> None:
    assert load_adapter(backend).available()
    rows = runner.run([backend])
    runner.record(rows, backend)
    # float64 and float32, every case; QHMuon's (one implementation) under "torch" alone
    assert {(r.case, r.dtype) for r in rows} == {
        (c.name, dtype)
        for c in load_cases()
        for dtype in runner.DTYPES
        if backend == "torch" or c.optimizer != "qhmuon"
    }
    failed = [r for r in rows if not r.passed]
    assert not failed, runner.format_table(failed)
    assert {r.dtype for r in rows} == {"float64", "float32"}
    assert max(r.deviation for r in rows if r.dtype == "float64") <= 1e-12
    assert max(r.deviation for r in rows if r.dtype == "float32") <= 1e-5
