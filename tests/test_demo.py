"""``nox -s demo``'s program: every installed backend against the reference, rows labelled."""

from __future__ import annotations

import pytest

from conformance import demo


def test_demo_runs_qh_settings_and_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main() == 0
    out = capsys.readouterr().out
    cases = {c.name: c for c in demo.load_cases()}
    shown = [cases[name] for name in demo.DEMO_CASES]
    # Real QH settings, not the special cases that are SGD, momentum or Adam.
    assert {c.optimizer for c in shown} == {"qhm", "qhadam"}
    for case in shown:
        nus = case.hparams.get("nus", [case.hparams.get("nu")])
        assert 0 < nus[0] < 1, case.name
        assert f"== {case.name}" in out
    assert "problems: 2" in out
    assert "numpy" in out


def test_keras_rows_name_their_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "installed_keras_backends", lambda: ["tensorflow", "jax"])
    monkeypatch.setattr(demo, "_keras_trajectory", lambda case, backend: backend)
    monkeypatch.setattr(demo, "REGISTRY", {"keras": "unused"})
    case = demo.load_cases()[0]
    assert list(demo.trajectories(case)) == [
        ("keras-tensorflow", "tensorflow"),
        ("keras-jax", "jax"),
    ]
