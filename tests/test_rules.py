"""The core rules against closed forms derived in the paper.

The expected values are not re-runs of the same recursion: they come from the
paper's *unrolled* forms (appendix A.8 and C.1), which sum weights over past
gradients directly.
"""

from __future__ import annotations

import numpy as np
import pytest

from qhoptim import rules
from qhoptim.reference import QHM, QHAdam, QHAdamW

RNG = np.random.default_rng(1234)


@pytest.mark.parametrize(("momentum", "nu"), [(0.9, 0.7), (0.999, 0.7), (0.0, 0.5), (0.5, 1.3)])
def test_qhm_matches_unrolled_form(momentum: float, nu: float) -> None:
    # Appendix C.1, eq. (theta-as-sum-qhm) with g_0 = 0:
    #   theta_t = theta_0 - alpha * sum_{i=1}^{t} (1 - nu beta^i) grad_{t-i}
    # (open loop: a fixed gradient stream, so the sum is exact).
    lr, steps = 0.3, 40
    grads = RNG.standard_normal((steps, 5))
    theta0 = RNG.standard_normal(5)
    opt = QHM(lr=lr, momentum=momentum, nu=nu)
    theta, state = theta0, opt.init(theta0)
    for t in range(steps):
        theta, state = opt.step(theta, grads[t], state)
        weights = 1 - nu * momentum ** np.arange(1, t + 2)  # i = 1 .. t+1
        expected = theta0 - lr * (weights[:, None] * grads[t::-1]).sum(axis=0)
        np.testing.assert_allclose(theta, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("betas", "nus", "eps"),
    [
        ((0.9, 0.999), (1.0, 1.0), 1e-8),
        ((0.995, 0.999), (0.7, 1.0), 0.0),
        ((0.9, 0.99), (0.8, 0.5), 1e-3),
    ],
)
def test_qhadam_matches_boxed_rule_unrolled(betas, nus, eps) -> None:
    # Section 5's box with the EWMAs unrolled:
    #   g_{t+1} = (1 - b1) sum_i b1^i grad_{t-i},  s_{t+1} likewise with grad^2.
    (b1, b2), (n1, n2) = betas, nus
    lr, steps = 0.01, 30
    grads = RNG.standard_normal((steps, 4))
    theta0 = RNG.standard_normal(4)
    opt = QHAdam(lr=lr, betas=betas, nus=nus, eps=eps)
    theta, state = theta0, opt.init(theta0)
    expected = theta0.copy()
    for t in range(steps):
        theta, state = opt.step(theta, grads[t], state)
        past = grads[t::-1]
        g = (1 - b1) * (b1 ** np.arange(t + 1))[:, None] * past
        s = (1 - b2) * (b2 ** np.arange(t + 1))[:, None] * past**2
        g_hat, s_hat = g.sum(0) / (1 - b1 ** (t + 1)), s.sum(0) / (1 - b2 ** (t + 1))
        num = (1 - n1) * grads[t] + n1 * g_hat
        den = np.sqrt((1 - n2) * grads[t] ** 2 + n2 * s_hat) + eps
        expected = expected - lr * num / den
        np.testing.assert_allclose(theta, expected, rtol=1e-11, atol=1e-13)


def test_first_qhm_step_is_sgd_with_lr_scaled_by_one_minus_nu_beta() -> None:
    # Appendix A.8: the current gradient's weight is (1 - nu beta).
    g = np.array([2.0, -4.0])
    buf, direction = rules.qhm_update(g, np.zeros(2), momentum=0.999, nu=0.7)
    np.testing.assert_allclose(direction, (1 - 0.7 * 0.999) * g, rtol=1e-15)
    np.testing.assert_allclose(buf, (1 - 0.999) * g, rtol=1e-15)


def test_coupled_decay_does_not_mutate_the_gradient() -> None:
    g, p = np.ones(3), np.full(3, 2.0)
    out = rules.coupled_weight_decay(g, p, 0.1)
    np.testing.assert_array_equal(g, np.ones(3))
    np.testing.assert_allclose(out, 1.2)


def test_qhadamw_decays_the_parameter_before_the_step() -> None:
    # AdamW (Loshchilov & Hutter): theta <- theta (1 - lr wd) - lr * update.
    theta, g = np.array([1.0, -3.0]), np.array([0.5, 0.25])
    w = QHAdamW(lr=0.1, weight_decay=0.2, nus=(0.7, 1.0))
    plain = QHAdam(lr=0.1, nus=(0.7, 1.0))
    got, _ = w.step(theta, g, w.init(theta))
    no_decay, _ = plain.step(theta, g, plain.init(theta))
    np.testing.assert_allclose(got, theta * (1 - 0.1 * 0.2) + (no_decay - theta), rtol=1e-15)


def test_complex_second_moment_uses_squared_modulus() -> None:
    g = np.array([3 + 4j])  # |g|^2 = 25, g^2 = -7 + 24j
    opt = QHAdam(lr=1.0, betas=(0.0, 0.0), nus=(1.0, 1.0), eps=0.0)
    theta, state = opt.step(np.zeros(1, complex), g, opt.init(np.zeros(1, complex)))
    assert state.exp_avg_sq.dtype == np.float64
    np.testing.assert_allclose(state.exp_avg_sq, [25.0])
    np.testing.assert_allclose(theta, -g / 5.0)


def test_zero_gradient_without_decay_is_a_no_op() -> None:
    theta = np.array([0.5, -1.5])
    for opt in (QHM(lr=1.0), QHAdam(lr=1.0)):
        state = opt.init(theta)
        out, state = opt.step(theta, np.zeros(2), state)
        np.testing.assert_array_equal(out, theta)
