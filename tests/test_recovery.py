"""The recovery suite: QHM / QHAdam reproduce naive source algorithms in float64."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance import recovery, sources
from conformance.problems import Problem, get_problem
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


# Conversions whose target is not QHM or QHAdam, which this suite runs: QHMuon
# steps matrices and Lion is the sign of QHM's direction. tests/test_qhmuon.py
# runs each against its published algorithm instead.
NOT_QHM_OR_QHADAM = {"from_muon", "from_lion"}


def test_every_conversion_has_recovery_cases() -> None:
    used = {c.convert for c in CASES}
    conversions = {n for n in convert.__all__ if n.startswith("from_")}
    assert conversions - NOT_QHM_OR_QHADAM <= used, conversions - NOT_QHM_OR_QHADAM - used
    assert NOT_QHM_OR_QHADAM <= conversions
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


# ------------------------------------------------------------------------ AggMo
@settings(max_examples=40, deadline=None)
@given(
    c0=st.just(0.0) | st.floats(1e-6, 4e-3),
    cb=st.just(0.0) | st.floats(1e-6, 4e-4),
    beta=st.floats(0.0, 0.99),
    copies=st.tuples(st.integers(0, 3), st.integers(1, 3)),
    extra=st.floats(0.5, 0.999),
    data=st.data(),
)
def test_aggmo_closed_loop_any_buffer_layout(
    c0: float,
    cb: float,
    beta: float,
    copies: tuple[int, int],
    extra: float,
    data: st.DataObject,
) -> None:
    # Extended AggMo with {0, beta} split over several buffers in any order (plus
    # a zero-rate buffer of another discount) is the QHM of from_aggmo, closed-loop.
    n0, nb = copies
    rates = [c0] * n0 + [cb] * nb + [0.0]
    betas = [0.0] * n0 + [beta] * nb + [extra]
    order = data.draw(st.permutations(range(len(rates))))
    rates, betas = [rates[i] for i in order], [betas[i] for i in order]
    problem = get_problem("quadratic-kappa100")
    src = sources.run(sources.AggMo(tuple(rates), tuple(betas)), problem.grad, problem.x0, 100)
    qh = recovery.qh_trajectory(convert.from_aggmo(rates, betas), problem, 100)
    assert recovery.max_relative_deviation(src, qh) <= 1e-10


def test_aggmo_source_is_written_as_the_appendix() -> None:
    # One step from zero buffers: every buffer is the gradient; theta moves by
    # (1/K) sum_i lr_i * grad. A second step: g_i = beta_i grad_0 + grad_1.
    algo = sources.AggMo((0.3, 0.6, 0.9), (0.0, 0.5, 0.9))
    s = algo.init(np.array([1.0]))
    s = algo.update(s, np.array([2.0]))
    assert s["x"] == pytest.approx([1.0 - (0.3 + 0.6 + 0.9) * 2.0 / 3])
    s = algo.update(s, np.array([1.0]))
    assert [float(b[0]) for b in s["bufs"]] == pytest.approx([1.0, 2.0, 2.8])
    scalar = sources.AggMo(0.3, (0.0, 0.5))
    assert scalar.update(scalar.init(np.zeros(1)), np.ones(1))["x"] == pytest.approx([-0.3])


AGGMO_BEST = (0.0, 0.9, 0.99, 0.999)  # Ma & Yarats (2019), App. H


def test_aggmo_heuristic_is_not_an_equivalence() -> None:
    # AggMo-Best's discounts, with QHM-Converted (effective lr, nu = 0.97, beta = 0.999):
    # from_aggmo refuses, and the heuristic's trajectory really differs.
    lr = 2e-5
    with pytest.raises(ValueError, match="aggmo_effective_lr"):
        convert.from_aggmo(lr, AGGMO_BEST)
    alpha = convert.aggmo_effective_lr(lr, AGGMO_BEST)
    problem = get_problem("quadratic-kappa100")
    src = sources.run(sources.AggMo(lr, AGGMO_BEST), problem.grad, problem.x0, 300)
    qh = recovery.qh_trajectory(convert.QHMParams(alpha, 0.97, 0.999), problem, 300)
    assert np.all(np.isfinite(src)) and np.all(np.isfinite(qh))
    assert recovery.max_relative_deviation(src, qh) > 1e-2


def _constant_gradient(g: np.ndarray) -> Problem:
    return Problem(
        "constant", "linear objective", np.zeros_like(g), (g.shape,), lambda x, t: g, lambda x: 0.0
    )


@pytest.mark.parametrize(("nu", "beta"), [(0.97, 0.999), (0.7, 0.99), (0.0, 0.5)])
def test_aggmo_effective_lr_matches_the_terminal_step(nu: float, beta: float) -> None:
    # On a constant gradient G both steps tend to -alpha G -- the one thing the
    # heuristic matches, whatever nu and beta.
    lr, betas, g = 0.1, (0.0, 0.9, 0.99), np.array([1.0, -2.0])
    alpha = convert.aggmo_effective_lr(lr, betas)
    problem = _constant_gradient(g)
    src = sources.run(sources.AggMo(lr, betas), problem.grad, problem.x0, 3000)
    qh = recovery.qh_trajectory(convert.QHMParams(alpha, nu, beta), problem, 25_000)
    assert src[-1] - src[-2] == pytest.approx(-alpha * g, rel=1e-9)
    assert qh[-1] - qh[-2] == pytest.approx(-alpha * g, rel=1e-9)
    # ... while the first steps differ: AggMo's is lr * G, QHM's alpha (1 - nu beta) G.
    assert src[1] - src[0] == pytest.approx(-lr * g)
    assert qh[1] - qh[0] == pytest.approx(-alpha * (1 - nu * beta) * g)
