"""The core rules against closed forms derived in the paper.

The expected values are not re-runs of the same recursion: they come from the
paper's *unrolled* forms (appendix A.8 and C.1), which sum weights over past
gradients directly.
"""

from __future__ import annotations

from typing import Any

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


# ------------------------------------------------------------ folded QHAdam
# (nu2, expected form): nu2 = 1 reads s alone, nu2 = 0 |g| alone, both in
# between; near 0 the gradient's weight is factored out instead of the second
# moment's (MAX_DENOMINATOR_RATIO), down to the smallest subnormal.
FORMS = [
    (1.0, rules.Denominator.EXP_AVG_SQ),
    (0.0, rules.Denominator.GRAD),
    (0.5, rules.Denominator.MIX),
    (1e-12, rules.Denominator.MIX),
    (1e-25, rules.Denominator.MIX),
    (5e-324, rules.Denominator.MIX),
]


@pytest.mark.parametrize(("nu2", "form"), FORMS)
def test_denominator_form_depends_on_nu2_alone(nu2: float, form: rules.Denominator) -> None:
    assert rules.qhadam_denominator(nu2) is form


@pytest.mark.parametrize(("nu2", "form"), FORMS)
@pytest.mark.parametrize("eps", [1e-8, 0.0, 0.3])
@pytest.mark.parametrize("nu1", [0.0, 0.7, 1.0, -0.3])
@pytest.mark.parametrize("step", [1, 10, 1000])
@pytest.mark.parametrize("factor_out", [True, False], ids=["host", "device"])
def test_folded_step_equals_the_rule(
    nu2: float, form: rules.Denominator, eps: float, nu1: float, step: int, factor_out: bool
) -> None:
    # The folded form the in-place kernels apply is -lr * qhadam_update's update.
    b1, b2, lr = 0.9, 0.999, 0.01
    grad = RNG.standard_normal(50)
    exp_avg, exp_avg_sq = RNG.standard_normal(50), RNG.random(50)
    bc1, bc2 = rules.bias_correction(b1, step), rules.bias_correction(b2, step)
    new_exp_avg, new_exp_avg_sq, update = rules.qhadam_update(
        grad, exp_avg, exp_avg_sq, beta1=b1, beta2=b2, nu1=nu1, nu2=nu2, eps=eps,
        bias_correction1=bc1, bias_correction2=bc2, sqrt=np.sqrt,
    )  # fmt: skip
    c = rules.qhadam_coefficients(nu1, nu2, bc1, bc2)
    f = rules.fold_qhadam(c, lr, eps, rules.qhadam_denominator(nu2), factor_out=factor_out)
    assert f.denominator is form
    got = rules.folded_qhadam_step(f, grad, new_exp_avg, new_exp_avg_sq, sqrt=np.sqrt)
    # atol: where the numerator cancels (nu1 < 0), relative to the largest element
    scale = np.abs(lr * update).max()
    np.testing.assert_allclose(got, -lr * update, rtol=1e-13, atol=1e-13 * scale)
    # A zero value lets a kernel skip its pass: nu1 = 1 reads no gradient,
    # nu1 = 0 no first moment.
    assert (f.grad_value == 0) == (nu1 == 1.0)
    assert (f.exp_avg_value == 0) == (nu1 == 0.0)
    if factor_out:  # one denominator weight is 1: no pass for it
        assert 1.0 in (f.exp_avg_sq_weight, f.grad_sq_weight)
        # ... and the other cannot overflow against the gradient's square
        assert max(f.exp_avg_sq_weight, f.grad_sq_weight) <= rules.MAX_DENOMINATOR_RATIO


def test_a_device_learning_rate_keeps_a_zero_value_a_number() -> None:
    # An array lr (MLX, torch's tensor lr) times a zero weight stays the number
    # 0, so that a kernel still skips the term (nu1 = 1: Adam's numerator).
    lr = np.array(0.01)
    c = rules.qhadam_coefficients(1.0, 1.0, np.array(0.1), np.array(0.001))
    for factor_out in (True, False):
        f = rules.fold_qhadam(c, lr, 1e-8, rules.Denominator.EXP_AVG_SQ, factor_out=factor_out)
        assert type(f.grad_value) is float and f.grad_value == 0


@pytest.mark.parametrize("nu", [0.0, 0.7, 1.0, 1.3])
@pytest.mark.parametrize("lr", [0.5, np.array(0.5)], ids=["number", "array"])
def test_folded_qhm_values_are_minus_lr_times_the_weights(nu: float, lr: Any) -> None:
    grad, buf = RNG.standard_normal(20), RNG.standard_normal(20)
    c = rules.qhm_coefficients(0.9, nu)
    new_buf, direction = rules.qhm_update(grad, buf, momentum=0.9, nu=nu)
    f = rules.fold_qhm(c, lr)
    np.testing.assert_allclose(
        f.buffer_value * new_buf + f.grad_value * grad, -0.5 * direction, rtol=1e-15, atol=1e-16
    )
    # A zero weight is the number 0, whatever lr is: a kernel skips the term.
    assert (type(f.grad_value) is float and f.grad_value == 0) == (nu == 1.0)
    assert (type(f.buffer_value) is float and f.buffer_value == 0) == (nu == 0.0)


def test_apply_update_without_decay_does_not_multiply() -> None:
    # decay_factor 1 (the number) is the parameter itself, bit for bit, inf and
    # NaN included; an array factor of 1 multiplies as written.
    param = np.array([1.5, -np.inf, np.nan, -0.0])
    got = rules.apply_update(param, np.zeros(4), 0.1)
    np.testing.assert_array_equal(got, param)
    assert np.signbit(got[3])


def test_folded_step_of_a_complex_gradient_uses_the_squared_modulus() -> None:
    grad = RNG.standard_normal(8) + 1j * RNG.standard_normal(8)
    exp_avg = RNG.standard_normal(8) + 1j * RNG.standard_normal(8)
    exp_avg_sq = RNG.random(8)
    kw = {"beta1": 0.9, "beta2": 0.99, "nu1": 0.7, "nu2": 0.6, "eps": 1e-3}
    bc1, bc2 = rules.bias_correction(0.9, 3), rules.bias_correction(0.99, 3)
    square = lambda x: np.abs(x) ** 2  # noqa: E731
    m, s, update = rules.qhadam_update(
        grad, exp_avg, exp_avg_sq, bias_correction1=bc1, bias_correction2=bc2,
        sqrt=np.sqrt, square=square, **kw,
    )  # fmt: skip
    c = rules.qhadam_coefficients(0.7, 0.6, bc1, bc2)
    f = rules.fold_qhadam(c, 0.5, 1e-3, rules.qhadam_denominator(0.6))
    got = rules.folded_qhadam_step(f, grad, m, s, sqrt=np.sqrt, square=square)
    np.testing.assert_allclose(got, -0.5 * update, rtol=1e-13)


# ------------------------------------------------- bias correction in float32
@pytest.mark.parametrize("beta", [0.9, 0.999, 0.99999, 0.9999999])
@pytest.mark.parametrize("step", [1, 2, 100, 10**6])
def test_expm1_bias_correction_keeps_float32_precision(beta: float, step: int) -> None:
    # The float32 policy: -expm1(t log beta) with log(beta) in float64 is within
    # a few float32 ulps of the exact 1 - beta**t (math.fsum-free: float64 is
    # exact enough here), where 1 - beta**t evaluated in float32 is not.
    exact = -np.expm1(step * np.log(beta))
    t = np.float32(step)
    # log(beta) taken in float64 joins the float32 arithmetic as a weakly typed
    # scalar (NumPy 2's rule, spelled out for NumPy 1.x).
    got = rules.bias_correction(beta, t, expm1=np.expm1, log=lambda b: np.float32(np.log(b)))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, exact, rtol=4 * np.finfo(np.float32).eps)
    naive = rules.bias_correction(np.float32(beta), t)
    if beta >= 0.99999 and step == 1:  # the cancellation the policy exists for
        assert abs(naive - exact) / exact > 1e-3


def test_expm1_bias_correction_of_beta_zero_is_one() -> None:
    # log(0) is -inf: beta = 0 is taken as 1 - 0**t, for numbers and traced arrays alike.
    assert rules.bias_correction(0.0, np.float32(3), expm1=np.expm1) == 1.0
    with np.errstate(divide="ignore"):
        traced = rules.bias_correction(np.float32(0.0), np.float32(3), expm1=np.expm1, log=np.log)
    assert traced == 1.0


# ------------------------------------------------------ AMSGrad (section 5)
@pytest.mark.parametrize(
    ("betas", "nus", "eps"),
    [
        ((0.9, 0.999), (1.0, 1.0), 1e-8),
        ((0.995, 0.98), (0.7, 1.0), 0.0),
        ((0.9, 0.99), (0.8, 0.5), 1e-3),
        ((0.9, 0.9), (0.7, 0.0), 1e-2),
    ],
)
def test_qhadam_amsgrad_matches_the_running_maximum_unrolled(betas, nus, eps) -> None:
    # torch's convention: the maximum of the *uncorrected* second moments
    # s_1 .. s_{t+1} (each unrolled), divided by this step's bias correction.
    (b1, b2), (n1, n2) = betas, nus
    lr, steps = 0.01, 30
    # Gradients that shrink, with spikes: the second moment falls, so the
    # maximum differs from it on most steps.
    grads = RNG.standard_normal((steps, 4)) * np.geomspace(10.0, 0.1, steps)[:, None]
    grads[::7] *= 30
    theta0 = RNG.standard_normal(4)
    opt = QHAdam(lr=lr, betas=betas, nus=nus, eps=eps, amsgrad=True)
    theta, state = theta0, opt.init(theta0)
    expected, history, differs = theta0.copy(), [], 0
    for t in range(steps):
        theta, state = opt.step(theta, grads[t], state)
        past = grads[t::-1]
        g = ((1 - b1) * (b1 ** np.arange(t + 1))[:, None] * past).sum(0)
        s = ((1 - b2) * (b2 ** np.arange(t + 1))[:, None] * past**2).sum(0)
        history.append(s)
        s_max = np.max(history, axis=0)
        differs += int(np.any(s_max > s * (1 + 1e-9)))
        num = (1 - n1) * grads[t] + n1 * g / (1 - b1 ** (t + 1))
        den = np.sqrt((1 - n2) * grads[t] ** 2 + n2 * s_max / (1 - b2 ** (t + 1))) + eps
        expected = expected - lr * num / den
        np.testing.assert_allclose(theta, expected, rtol=1e-11, atol=1e-13)
        np.testing.assert_allclose(state.exp_avg_sq, s, rtol=1e-12)
        np.testing.assert_allclose(state.max_exp_avg_sq, s_max, rtol=1e-12)
    assert differs > steps // 2  # the maximum was exercised


def test_amsgrad_update_is_the_rule_with_the_maximum_in_the_denominator() -> None:
    grad, exp_avg = RNG.standard_normal(20), RNG.standard_normal(20)
    exp_avg_sq, max_exp_avg_sq = RNG.random(20), RNG.random(20)
    kw = dict(beta1=0.9, beta2=0.99, nu1=0.7, nu2=0.6, eps=1e-3, sqrt=np.sqrt)
    bcs = dict(bias_correction1=rules.bias_correction(0.9, 4), bias_correction2=0.25)
    m, s, new_max, update = rules.qhadam_amsgrad_update(
        grad, exp_avg, exp_avg_sq, max_exp_avg_sq, maximum=np.maximum, **kw, **bcs
    )
    m_plain, s_plain, _ = rules.qhadam_update(grad, exp_avg, exp_avg_sq, **kw, **bcs)
    np.testing.assert_array_equal(m, m_plain)
    np.testing.assert_array_equal(s, s_plain)
    np.testing.assert_array_equal(new_max, np.maximum(max_exp_avg_sq, s_plain))
    # The update is qhadam_update's with the maximum read where s was: feed
    # qhadam_update the second moment whose EWMA step lands on the maximum.
    c = rules.qhadam_coefficients(0.7, 0.6, bcs["bias_correction1"], bcs["bias_correction2"])
    num = c.grad_weight * grad + c.exp_avg_weight * m
    den = np.sqrt(c.grad_sq_weight * grad**2 + c.exp_avg_sq_weight * new_max) + 1e-3
    np.testing.assert_allclose(update, num / den, rtol=1e-15)


@pytest.mark.parametrize(("nu2", "form"), FORMS)
@pytest.mark.parametrize("factor_out", [True, False], ids=["host", "device"])
def test_folded_step_with_the_maximum_equals_the_amsgrad_rule(
    nu2: float, form: rules.Denominator, factor_out: bool
) -> None:
    # The kernels apply the same fold to the running maximum.
    b1, b2, lr, eps, step = 0.9, 0.99, 0.01, 1e-8, 7
    grad, exp_avg = RNG.standard_normal(50), RNG.standard_normal(50)
    exp_avg_sq, max_exp_avg_sq = RNG.random(50), RNG.random(50)
    bc1, bc2 = rules.bias_correction(b1, step), rules.bias_correction(b2, step)
    m, _, new_max, update = rules.qhadam_amsgrad_update(
        grad, exp_avg, exp_avg_sq, max_exp_avg_sq, beta1=b1, beta2=b2, nu1=0.7, nu2=nu2,
        eps=eps, bias_correction1=bc1, bias_correction2=bc2, sqrt=np.sqrt, maximum=np.maximum,
    )  # fmt: skip
    c = rules.qhadam_coefficients(0.7, nu2, bc1, bc2)
    f = rules.fold_qhadam(c, lr, eps, form, factor_out=factor_out)
    got = rules.folded_qhadam_step(f, grad, m, new_max, sqrt=np.sqrt)
    np.testing.assert_allclose(
        got, -lr * update, rtol=1e-13, atol=1e-13 * np.abs(lr * update).max()
    )


def test_amsgrad_maximum_propagates_nan() -> None:
    got = rules.amsgrad_maximum(
        np.array([1.0, np.nan]), np.array([np.nan, 2.0]), maximum=np.maximum
    )
    assert np.isnan(got).all()


def test_reference_amsgrad_needs_its_state() -> None:
    opt = QHAdam(amsgrad=True)
    theta = np.ones(2)
    assert opt.init(theta).max_exp_avg_sq is not None
    assert QHAdam().init(theta).max_exp_avg_sq is None
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        opt.step(theta, theta, QHAdam().init(theta))
    with pytest.raises(TypeError, match=r"amsgrad must be a bool; received amsgrad=1"):
        QHAdam(amsgrad=1)  # type: ignore[arg-type]
    assert QHAdamW(amsgrad=True).amsgrad
