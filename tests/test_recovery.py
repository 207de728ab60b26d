"""The recovery suite: QHM / QHAdam reproduce naive source algorithms in float64."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance import recovery, sources
from conformance.problems import get_problem
from qhoptim import convert

CASES = recovery.load_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_recovery_case(case: recovery.RecoveryCase) -> None:
    row = recovery.run_case(case)
    assert row.max_rel_dev <= 1e-10, f"{case.name}: max rel dev {row.max_rel_dev:.3e}"
    assert row.passed
    # The case is not trivial: the source moves and stays finite.
    traj = case.source_trajectory()
    assert traj.shape == (case.steps + 1, get_problem(case.problem).x0.size)
    assert np.all(np.isfinite(traj))
    assert np.max(np.abs(traj - traj[0])) > 1e-2


def test_every_conversion_has_recovery_cases() -> None:
    used = {c.convert for c in CASES}
    conversions = {n for n in convert.__all__ if n.startswith("from_")}
    assert conversions <= used, conversions - used
    assert all(c.steps >= 100 for c in CASES)


@pytest.mark.parametrize("case", [c for c in CASES if c.exactness != "exact"], ids=lambda c: c.name)
def test_modulo_bias_correction_cases_really_need_it(case: recovery.RecoveryCase) -> None:
    # With bias correction on both sides the trajectories differ: "modulo" is honest.
    problem = get_problem(case.problem)
    overrides = {"bias_correction": True} if "bias_correction" in case.source_params else {}
    qh = recovery.qh_trajectory(case.converted(), problem, case.steps, bias_correction=True)
    dev = recovery.max_relative_deviation(case.source_trajectory(**overrides), qh)
    assert dev > 1e-5


def test_errata_are_detected() -> None:
    rows = recovery.errata_rows()
    assert {r.erratum for r in rows} == set(recovery._ERRATA)
    for r in rows:
        assert r.printed_dev > 1e-2, r
        assert r.corrected_dev <= 1e-10, r


def test_recovery_rows_and_main(capsys: pytest.CaptureFixture[str]) -> None:
    rows = recovery.recovery_rows()
    assert [r.case for r in rows] == [c.name for c in CASES]
    assert all(r.passed for r in rows)
    assert recovery.main([]) == 0
    out = capsys.readouterr().out
    assert "max rel dev" in out and "FAIL" not in out


def test_max_relative_deviation_counts_non_finite_as_inf() -> None:
    a = np.ones((3, 2))
    b = a.copy()
    b[2, 0] = np.nan
    assert recovery.max_relative_deviation(a, b) == float("inf")
    assert recovery.max_relative_deviation(a, a) == 0.0


@settings(max_examples=25, deadline=None)
@given(
    alpha=st.floats(1e-4, 2e-3),
    nu=st.floats(-0.5, 1.5),
    beta=st.floats(0.1, 0.95),
)
def test_snv_round_trip_closed_loop(alpha: float, nu: float, beta: float) -> None:
    # QHM -> SNV (App. C.4's inverse formulas) -> naive SNV trajectory == QHM trajectory.
    problem = get_problem("quadratic-kappa100")
    snv = sources.SynthesizedNesterov(alpha * (1 - beta), beta, (1 - nu) * beta / (1 - beta))
    src = sources.run(snv, problem.grad, problem.x0, 100)
    qh = recovery.qh_trajectory(convert.QHMParams(alpha, nu, beta), problem, 100)
    assert recovery.max_relative_deviation(src, qh) <= 1e-10
