"""Hypothesis property tests of the float64 reference optimizers and the update rules.

Each property draws valid hyperparameters and a bounded gradient stream (20-50
steps of a small parameter vector) and compares the reference optimizer with an
algorithm written here from its definition in the paper (or in Kingma & Ba), or
checks an invariant: finiteness, decoupled weight decay, zero gradients, and the
tight update bound of :mod:`qhoptim.analysis`.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qhoptim.analysis import qhadam_maximizing_gradients, qhadam_update_bound
from qhoptim.reference import QHM, QHAdam, QHAdamW

EPS = float(np.finfo(np.float64).eps)
FAST = settings(max_examples=60, deadline=None)

lrs = st.floats(1e-4, 1.0)
betas = st.floats(0.0, 0.999)
epsilons = st.floats(1e-10, 1e-1)


@st.composite
def streams(draw: st.DrawFn, max_abs: float = 1e3) -> np.ndarray:
    """A gradient stream of shape ``(steps, dim)``, oldest first."""
    steps = draw(st.integers(20, 50))
    dim = draw(st.integers(1, 4))
    elements = st.floats(-max_abs, max_abs, allow_nan=False, allow_infinity=False)
    return draw(hnp.arrays(np.float64, (steps, dim), elements=elements))


def params_for(grads: np.ndarray) -> np.ndarray:
    return np.linspace(-1.0, 2.0, grads.shape[1])


def run(opt: QHM | QHAdam, theta: np.ndarray, grads: np.ndarray) -> np.ndarray:
    """The parameter trajectory (one row per step) of a reference optimizer."""
    state = opt.init(theta)
    out = []
    for g in grads:
        theta, state = opt.step(theta, g, state)
        out.append(theta)
    return np.array(out)


def assert_trajectories_close(actual: np.ndarray, expected: np.ndarray, moved: float) -> None:
    # ``moved`` bounds the total distance travelled; the two computations differ by a
    # few roundings per step, each relative to that scale.
    atol = 16 * EPS * len(expected) * (1.0 + moved)
    np.testing.assert_allclose(actual, expected, rtol=16 * EPS * len(expected), atol=atol)


# ------------------------------------------------------------------------ QHM


@FAST
@given(lr=lrs, beta=betas, grads=streams())
def test_qhm_nu_one_is_normalized_momentum(lr, beta, grads):
    theta = params_for(grads)
    buf, expected = np.zeros_like(theta), []
    for g in grads:
        buf = beta * buf + (1 - beta) * g
        theta = theta - lr * buf
        expected.append(theta)
    actual = run(QHM(lr=lr, momentum=beta, nu=1.0), params_for(grads), grads)
    assert_trajectories_close(actual, np.array(expected), lr * np.abs(grads).sum())


@FAST
@given(lr=lrs, beta=betas, grads=streams())
def test_qhm_nu_zero_is_sgd(lr, beta, grads):
    theta = params_for(grads)
    expected = theta - lr * np.cumsum(grads, axis=0)
    actual = run(QHM(lr=lr, momentum=beta, nu=0.0), theta, grads)
    assert_trajectories_close(actual, expected, lr * np.abs(grads).sum())


@FAST
@given(lr=lrs, beta=betas, grads=streams())
def test_qhm_nu_beta_is_nesterov(lr, beta, grads):
    # Section 4.1: NAG replaces momentum's g_{t+1} by (1 - beta) grad + beta g_{t+1}.
    theta = params_for(grads)
    buf, expected = np.zeros_like(theta), []
    for g in grads:
        buf = beta * buf + (1 - beta) * g
        theta = theta - lr * ((1 - beta) * g + beta * buf)
        expected.append(theta)
    actual = run(QHM(lr=lr, momentum=beta, nu=beta), params_for(grads), grads)
    assert_trajectories_close(actual, np.array(expected), lr * np.abs(grads).sum())


# --------------------------------------------------------------------- QHAdam


@FAST
@given(lr=lrs, beta1=betas, beta2=betas, eps=epsilons, grads=streams())
def test_qhadam_unit_nus_is_adam(lr, beta1, beta2, eps, grads):
    # Kingma & Ba (2015), Algorithm 1: eps is added after the bias-corrected sqrt.
    theta = params_for(grads)
    m, v = np.zeros_like(theta), np.zeros_like(theta)
    expected, moved = [], np.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        step = lr * m_hat / (np.sqrt(v_hat) + eps)
        theta = theta - step
        moved += np.abs(step)
        expected.append(theta)
    opt = QHAdam(lr=lr, betas=(beta1, beta2), nus=(1.0, 1.0), eps=eps)
    actual = run(opt, params_for(grads), grads)
    # The reference multiplies by nu / (1 - beta**t) where Algorithm 1 divides.
    assert_trajectories_close(actual, np.array(expected), float(moved.max()))


@FAST
@given(
    lr=lrs,
    beta1=st.floats(0.0, 0.9999),
    beta2=st.floats(0.0, 0.9999),
    nu1=st.floats(-3.0, 3.0),
    nu2=st.floats(0.0, 1.0),
    eps=st.floats(1e-12, 1.0),
    bias_correction=st.booleans(),
    grads=streams(max_abs=1e100),
)
def test_qhadam_never_nan_for_finite_gradients(
    lr, beta1, beta2, nu1, nu2, eps, bias_correction, grads
):
    opt = QHAdam(lr=lr, betas=(beta1, beta2), nus=(nu1, nu2), eps=eps)
    theta = params_for(grads)
    state = opt.init(theta)
    for g in grads:
        theta, state = opt.step(theta, g, state, bias_correction=bias_correction)
        assert not np.any(np.isnan(theta))
        assert not np.any(np.isnan(state.exp_avg)) and not np.any(np.isnan(state.exp_avg_sq))


@FAST
@given(
    lr=lrs,
    beta1=betas,
    beta2=betas,
    nus=st.tuples(st.floats(-1.0, 2.0), st.floats(0.0, 1.0)),
    eps=epsilons,
    weight_decay=st.floats(0.0, 1.0),
    grads=streams(),
)
def test_qhadamw_is_qhadam_on_decayed_parameter(lr, beta1, beta2, nus, eps, weight_decay, grads):
    kw = {"lr": lr, "betas": (beta1, beta2), "nus": nus, "eps": eps}
    adamw = QHAdamW(weight_decay=weight_decay, **kw)
    plain = QHAdam(weight_decay=0.0, **kw)
    theta = params_for(grads)
    w_state, p_state = adamw.init(theta), plain.init(theta)
    w_theta = p_theta = theta
    for g in grads:
        w_theta, w_state = adamw.step(w_theta, g, w_state)
        p_theta, p_state = plain.step(p_theta * (1 - lr * weight_decay), g, p_state)
        scale = 1.0 + np.abs(p_theta).max()
        np.testing.assert_allclose(w_theta, p_theta, rtol=8 * EPS, atol=8 * EPS * scale)


@FAST
@given(
    lr=lrs,
    beta1=betas,
    beta2=betas,
    nus=st.tuples(st.floats(-1.0, 2.0), st.floats(0.0, 1.0)),
    nu=st.floats(-1.0, 2.0),
    eps=epsilons,
    steps=st.integers(20, 50),
)
def test_zero_gradients_leave_parameters_unchanged(lr, beta1, beta2, nus, nu, eps, steps):
    theta = np.array([-1.5, 0.0, 3.25])
    grads = np.zeros((steps, theta.size))
    for opt in (
        QHM(lr=lr, momentum=beta1, nu=nu),
        QHAdam(lr=lr, betas=(beta1, beta2), nus=nus, eps=eps),
        QHAdamW(lr=lr, betas=(beta1, beta2), nus=nus, eps=eps, weight_decay=0.0),
    ):
        traj = run(opt, theta, grads)
        np.testing.assert_array_equal(traj, np.broadcast_to(theta, traj.shape))


# ------------------------------------------------------------- update bound


@st.composite
def bound_hyperparameters(draw: st.DrawFn) -> tuple[float, float, float, float]:
    """(nu1, beta1, nu2, beta2) with 0 < beta1 < sqrt(beta2) < 1, the bound's domain."""
    beta2 = draw(st.floats(0.05, 0.9999))
    beta1 = draw(st.floats(0.01, 0.999)) * np.sqrt(beta2)
    # nu2 = 0 exactly, or not so small that s~ underflows to 0 when only the
    # history is nonzero (the bound is astronomically large there anyway).
    nu2 = draw(st.just(0.0) | st.floats(1e-3, 1.0))
    return draw(st.floats(-2.0, 2.0)), float(beta1), nu2, beta2


def _tiny_to_zero(x: float) -> float:
    # Squares of |x| < 1e-154 are subnormal or 0 and lose the relative precision
    # the bound's slack assumes; exact zeros are kept (they test s~ = 0).
    return 0.0 if abs(x) < 1e-30 else x


@FAST
@given(
    hyper=bound_hyperparameters(),
    grads=streams(max_abs=1e4).map(np.vectorize(_tiny_to_zero, otypes=[np.float64])),
)
def test_qhadam_update_never_exceeds_tight_bound(hyper, grads):
    nu1, beta1, nu2, beta2 = hyper
    # eps = 0 and no bias correction: appendix G's setting. With theta = 0 and lr = 1
    # the returned parameter is exactly minus the update.
    opt = QHAdam(lr=1.0, betas=(beta1, beta2), nus=(nu1, nu2), eps=0.0)
    state = opt.init(grads[0])
    worst = 0.0
    for t, g in enumerate(grads):
        with np.errstate(divide="ignore", invalid="ignore"):
            theta, state = opt.step(np.zeros_like(g), g, state, bias_correction=False)
        update = np.abs(theta)
        # s~ = 0 (outside the bound's assumption): no gradient yet, or nu2 = 0 and g = 0
        undefined = ~np.any(grads[: t + 1] != 0, axis=0) | ((nu2 == 0) & (g == 0))
        assert np.all(np.isfinite(update[~undefined]))
        # t + 1 gradients so far: the bound's t; slack as in tests/test_analysis.py.
        # Rounding is relative to the numerator's two terms, not to their
        # difference: with nu1 > 1 they can cancel to far below either (e.g.
        # nu1 = 2, beta1 ~ 0.5 at t = 0), so the slack scales with their sum.
        bound = qhadam_update_bound(nu1, beta1, nu2, beta2, t)
        slack = 8 * (t + 2) * EPS
        with np.errstate(divide="ignore", invalid="ignore"):
            den = np.sqrt((1 - nu2) * g**2 + nu2 * state.exp_avg_sq)
            terms = (abs(1 - nu1) * np.abs(g) + abs(nu1) * np.abs(state.exp_avg)) / den
        tolerance = bound * (1 + slack) + slack * terms
        assert np.all(update[~undefined] <= tolerance[~undefined])
        if np.isfinite(bound) and np.any(~undefined):
            worst = max(worst, float(np.max(update[~undefined])) / bound)
    target(worst)  # steer the search towards streams that press against the bound


@pytest.mark.parametrize("t", [0, 1, 10, 49])
def test_bound_test_would_catch_an_off_by_one(t):
    # The property above compares step t (0-based) with bound(t); bound(t - 1) would
    # be too small: the maximizing stream exceeds it. (Guards the indexing itself.)
    nu1, beta1, nu2, beta2 = 0.7, 0.9, 0.6, 0.95
    grads = np.array(qhadam_maximizing_gradients(nu1, beta1, nu2, beta2, t))[:, None]
    opt = QHAdam(lr=1.0, betas=(beta1, beta2), nus=(nu1, nu2), eps=0.0)
    state = opt.init(grads[0])
    for g in grads:
        theta, state = opt.step(np.zeros_like(g), g, state, bias_correction=False)
    assert abs(theta[0]) == pytest.approx(qhadam_update_bound(nu1, beta1, nu2, beta2, t))
    if t > 0:
        assert abs(theta[0]) > qhadam_update_bound(nu1, beta1, nu2, beta2, t - 1)
