"""Brute-force checks of :mod:`qhoptim.analysis` against the paper and the update rules.

The QHAdam quantities are computed by running :func:`qhoptim.rules.qhadam_update`
step by step from a zero state with ``eps = 0`` and no bias correction (the
setting of appendix F), so the analysis is tied to the rule the optimizers use.
The QHWMA is computed by :func:`qhoptim.rules.qhm_update`, whose direction from a
zero buffer is exactly the QHWMA of the gradients.
"""

from __future__ import annotations

import inspect
import math
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qhoptim import rules
from qhoptim.analysis import (
    adam_update_bound,
    ewma_variance_factor,
    kingma_ba_claimed_bound,
    qhadam_bound_optimal_nu2,
    qhadam_maximizing_gradients,
    qhadam_update_bound,
    qhwma_variance_factor,
)

EPS = float(np.finfo(np.float64).eps)

# (nu1, beta1, nu2, beta2), all with 0 < beta1 < sqrt(beta2) < 1.
SETTINGS = [
    pytest.param(1.0, 0.9, 1.0, 0.999, id="adam-defaults"),
    pytest.param(0.7, 0.999, 1.0, 0.999999, id="qh-rule-of-thumb"),
    pytest.param(0.7, 0.9, 1.0, 0.999, id="nu1=0.7"),
    pytest.param(0.8, 0.95, 0.7, 0.98, id="paper-wmt16"),
    pytest.param(0.7, 0.9, 0.6, 0.95, id="both-nu<1"),
    pytest.param(1.5, 0.5, 0.3, 0.6, id="nu1>1"),
    pytest.param(-0.5, 0.3, 0.9, 0.2, id="nu1<0"),
    pytest.param(0.9, 0.9, 0.05, 0.85, id="beta1>beta2,small-nu2"),
    pytest.param(0.0, 0.9, 0.5, 0.99, id="nu1=0"),
    pytest.param(0.7, 0.995, 0.9, 0.991, id="beta1-near-sqrt-beta2"),
]


def slack(t: int) -> float:
    """Relative float slack for the update computed from t + 1 gradients.

    Each EWMA step rounds a few times; by Cauchy-Schwarz the accumulated absolute
    error of g~ is at most ~(t + 2) * eps * bound * sqrt(s~), and s~ (a sum of
    non-negative terms) carries a relative error of the same order.
    """
    return 8 * (t + 2) * EPS


def qhadam_updates(grads: object, nu1: float, beta1: float, nu2: float, beta2: float) -> np.ndarray:
    """QHAdam updates (eps = 0, no bias correction) from a zero state.

    ``grads`` has shape ``(T, ...)``, oldest first; row ``k`` of the result is
    the update computed from gradients ``0..k`` -- the bound's ``t = k``.
    """
    g = np.asarray(grads, dtype=np.float64)
    exp_avg = np.zeros_like(g[0])
    exp_avg_sq = np.zeros_like(g[0])
    out = np.empty_like(g)
    # Steps whose gradients so far are all zero have s~ = 0 (outside the fact's
    # assumption) and give nan; callers look at the steps they need.
    with np.errstate(divide="ignore", invalid="ignore"):
        for k in range(g.shape[0]):
            exp_avg, exp_avg_sq, out[k] = rules.qhadam_update(
                g[k],
                exp_avg,
                exp_avg_sq,
                beta1=beta1,
                beta2=beta2,
                nu1=nu1,
                nu2=nu2,
                eps=0.0,
                bias_correction1=1.0,
                bias_correction2=1.0,
                sqrt=np.sqrt,
            )
    return out


def ratio_from_definition(
    x: np.ndarray, nu1: float, beta1: float, nu2: float, beta2: float
) -> float:
    """|g~_{t+1}| / sqrt(s~_{t+1}) straight from eqns qhadam-g-pre / qhadam-s-pre."""
    t = len(x) - 1
    lag = np.arange(t + 1)
    newest_first = x[::-1]
    g = (1 - nu1) * x[t] + nu1 * (1 - beta1) * np.sum(beta1**lag * newest_first)
    s = (1 - nu2) * x[t] ** 2 + nu2 * (1 - beta2) * np.sum(beta2**lag * newest_first**2)
    return float(abs(g) / np.sqrt(s))


# --------------------------------------------------------------------------- bound


@pytest.mark.parametrize(("nu1", "beta1", "nu2", "beta2"), SETTINGS)
@pytest.mark.parametrize("t", [0, 1, 2, 5, 20, 200])
def test_bound_attained_by_maximizing_gradients(nu1, beta1, nu2, beta2, t):
    bound = qhadam_update_bound(nu1, beta1, nu2, beta2, t)
    x = qhadam_maximizing_gradients(nu1, beta1, nu2, beta2, t)
    assert len(x) == t + 1
    # The rule's last update, the definition, and any rescaling all attain it.
    xs = np.array([x, qhadam_maximizing_gradients(nu1, beta1, nu2, beta2, t, normalize=True)])
    xs = np.concatenate([xs, -3.7 * xs])
    last = qhadam_updates(xs.T, nu1, beta1, nu2, beta2)[-1]
    np.testing.assert_allclose(np.abs(last), bound, rtol=slack(t))
    assert math.isclose(ratio_from_definition(np.array(x), nu1, beta1, nu2, beta2), bound)


@pytest.mark.parametrize(("nu1", "beta1", "nu2", "beta2"), SETTINGS)
def test_t_counts_gradients_from_zero(nu1, beta1, nu2, beta2):
    # t + 1 gradients reach bound(t), which exceeds bound(t - 1) whenever history
    # matters: an off-by-one in t would make one of the two assertions fail.
    for t in range(1, 8):
        x = qhadam_maximizing_gradients(nu1, beta1, nu2, beta2, t)
        ups = np.abs(qhadam_updates(x, nu1, beta1, nu2, beta2))
        assert ups[-1] == pytest.approx(qhadam_update_bound(nu1, beta1, nu2, beta2, t))
        if nu1 != 0:
            assert ups[-1] > qhadam_update_bound(nu1, beta1, nu2, beta2, t - 1) * (1 + 1e-9)
        # every earlier step k respects bound(k) (nan only while all gradients are 0)
        for k, u in enumerate(ups):
            if np.isnan(u):
                assert not np.any(x[: k + 1])
                continue
            assert u <= qhadam_update_bound(nu1, beta1, nu2, beta2, k) * (1 + slack(k))


def test_paper_foc_indexing_erratum():
    # Eqn qhadam-ub-foc written with the gradient index (x_i ~ (b1/b2)^i for i < t)
    # misses the bound; indexed by lag (x_{t-i} ~ (b1/b2)^i) it attains it.
    nu1, beta1, nu2, beta2 = 0.7, 0.9, 0.6, 0.95
    k = nu1 * (1 - beta1) / (nu2 * (1 - beta2))
    newest = (1 - nu1 * beta1) / (1 - nu2 * beta2)
    for t in range(1, 6):
        bound = qhadam_update_bound(nu1, beta1, nu2, beta2, t)
        literal = [k * (beta1 / beta2) ** i for i in range(t)] + [newest]
        by_lag = [k * (beta1 / beta2) ** (t - j) for j in range(t)] + [newest]
        assert abs(qhadam_updates(literal, nu1, beta1, nu2, beta2)[-1]) < bound * (1 - 1e-4)
        assert abs(qhadam_updates(by_lag, nu1, beta1, nu2, beta2)[-1]) == pytest.approx(bound)
        assert by_lag == pytest.approx(qhadam_maximizing_gradients(nu1, beta1, nu2, beta2, t))


def _random_streams(rng: np.random.Generator, steps: int, n: int) -> dict[str, np.ndarray]:
    shape = (steps, n)
    spikes = (rng.random(shape) < 0.02) * 1e3 * rng.standard_normal(shape)
    return {
        "gaussian": rng.standard_normal(shape),
        "gaussian+bias": 2.0 + rng.standard_normal(shape),
        "cauchy": rng.standard_cauchy(shape),
        "student-t2": rng.standard_t(2, shape),
        "spiky": 1e-3 * rng.standard_normal(shape) + spikes,
        "log-uniform-magnitudes": rng.choice([-1.0, 1.0], shape)
        * np.exp(rng.uniform(-20, 20, shape)),
        "random-walk": np.cumsum(rng.standard_normal(shape), axis=0),
        "same-sign": np.abs(rng.standard_normal(shape)) + 1e-3,
    }


@pytest.mark.parametrize(("nu1", "beta1", "nu2", "beta2"), SETTINGS)
def test_bound_never_exceeded_by_random_streams(nu1, beta1, nu2, beta2):
    rng = np.random.default_rng(20190506)
    steps = 60
    finite = np.array([qhadam_update_bound(nu1, beta1, nu2, beta2, k) for k in range(steps)])
    limit = qhadam_update_bound(nu1, beta1, nu2, beta2)
    tol = finite * (1 + np.array([slack(k) for k in range(steps)]))
    streams = _random_streams(rng, steps, 2000)
    # Near-maximizers: the t = steps - 1 maximizer with multiplicative noise.
    x_star = np.array(qhadam_maximizing_gradients(nu1, beta1, nu2, beta2, steps - 1))
    for scale in (1e-2, 1e-5):
        relative = x_star[:, None] * (1 + scale * rng.standard_normal((steps, 500)))
        absolute = scale * abs(x_star[-1]) * rng.standard_normal((steps, 500))
        streams[f"near-maximizer-{scale:g}"] = relative + absolute
    for name, grads in streams.items():
        ups = np.abs(qhadam_updates(grads, nu1, beta1, nu2, beta2))
        assert np.all(np.isfinite(ups)), name
        worst = ups.max(axis=1)
        assert np.all(worst <= tol), (name, np.max(worst / finite))
        assert worst.max() <= limit * (1 + slack(steps))
    # the near-maximizers come close: the bound is tight, not merely valid
    near = np.abs(qhadam_updates(streams["near-maximizer-1e-05"], nu1, beta1, nu2, beta2))[-1]
    assert near.max() == pytest.approx(finite[-1], rel=1e-8)


@pytest.mark.parametrize(("nu1", "beta1", "nu2", "beta2"), SETTINGS)
@pytest.mark.parametrize("t", [1, 3, 6])
def test_bound_never_exceeded_by_adversarial_search(nu1, beta1, nu2, beta2, t):
    from scipy import optimize

    rng = np.random.default_rng(1810_06801 + t)
    bound = qhadam_update_bound(nu1, beta1, nu2, beta2, t)

    def neg_sq_ratio(x: np.ndarray) -> float:
        return -(ratio_from_definition(x, nu1, beta1, nu2, beta2) ** 2)

    found = []
    for _ in range(8):
        res = optimize.minimize(neg_sq_ratio, rng.standard_normal(t + 1), method="BFGS")
        ratio = abs(qhadam_updates(res.x, nu1, beta1, nu2, beta2)[-1])
        assert ratio <= bound * (1 + slack(t))
        found.append(ratio)
    # an optimizer that knows nothing of the formula finds the same supremum
    assert max(found) == pytest.approx(bound, rel=1e-6)


@pytest.mark.parametrize(("nu1", "beta1", "nu2", "beta2"), SETTINGS)
def test_finite_t_bound_increases_to_limit(nu1, beta1, nu2, beta2):
    ts = [*range(50), 100, 1000, 10_000, 10**6, 10**9, 10**400]
    b = np.array([qhadam_update_bound(nu1, beta1, nu2, beta2, t) for t in ts])
    limit = qhadam_update_bound(nu1, beta1, nu2, beta2)
    first = abs(1 - nu1 * beta1) / math.sqrt(1 - nu2 * beta2)
    assert b[0] == pytest.approx(first, rel=4 * EPS)
    assert np.all(b <= limit)
    assert b[-1] == limit
    if nu1 == 0:
        assert np.all(b == limit)
        return
    r = beta1**2 / beta2
    resolvable = [t for t in range(50) if r**t > 1e-8]  # while 1 - r^t still moves in floats
    assert np.all(np.diff(b[resolvable]) > 0)
    assert np.all(np.diff(b) >= 0)
    # geometric convergence: limit^2 - bound(t)^2 = (limit^2 - bound(0)^2) * (b1^2/b2)^t
    np.testing.assert_allclose(
        limit**2 - b[:50] ** 2,
        (limit**2 - first**2) * r ** np.arange(50),
        rtol=1e-6,
        atol=1e-13 * limit**2,
    )


def test_nu2_zero_is_unbounded_unless_no_history():
    assert qhadam_update_bound(0.7, 0.9, 0.0, 0.99) == math.inf
    assert qhadam_update_bound(0.7, 0.9, 0.0, 0.99, 1) == math.inf
    assert qhadam_update_bound(0.7, 0.9, 0.0, 0.99, 0) == pytest.approx(1 - 0.63)
    assert qhadam_update_bound(0.0, 0.9, 0.0, 0.99) == 1.0
    # brute force: a large past gradient and s~ = x_t^2 make the update grow without limit
    for big in (1e2, 1e4, 1e6):
        u = abs(qhadam_updates([big, 1.0], 0.7, 0.9, 0.0, 0.99)[-1])
        assert u > 0.7 * 0.1 * 0.9 * big * 0.99
    with pytest.raises(ValueError, match="unbounded for nu2=0"):
        qhadam_maximizing_gradients(0.7, 0.9, 0.0, 0.99, 3)
    for nu1, t in ((0.0, 3), (0.7, 0)):
        x = qhadam_maximizing_gradients(nu1, 0.9, 0.0, 0.99, t)
        u = abs(qhadam_updates(x, nu1, 0.9, 0.0, 0.99)[-1])
        assert u == pytest.approx(qhadam_update_bound(nu1, 0.9, 0.0, 0.99, t))


def test_degenerate_zero_bound():
    # nu1 * beta1 = 1 and t = 0: g~ = 0 for every gradient
    assert qhadam_update_bound(2.0, 0.5, 1.0, 0.9, 0) == 0.0
    x = qhadam_maximizing_gradients(2.0, 0.5, 1.0, 0.9, 0)
    assert x == [1.0]
    assert qhadam_updates(x, 2.0, 0.5, 1.0, 0.9)[-1] == 0.0


def test_maximizing_gradients_normalize_avoids_overflow():
    # beta1 > beta2: the paper's scaling grows like (beta1/beta2)^t
    with pytest.raises(ValueError, match=r"overflows float64 \(pass normalize=True\)"):
        qhadam_maximizing_gradients(0.9, 0.9, 0.5, 0.85, 20_000)
    x = np.array(qhadam_maximizing_gradients(0.9, 0.9, 0.5, 0.85, 20_000, normalize=True))
    assert np.max(np.abs(x)) == 1.0
    assert np.all(np.isfinite(x))
    small = qhadam_maximizing_gradients(0.9, 0.9, 0.5, 0.85, 30)
    np.testing.assert_allclose(
        qhadam_maximizing_gradients(0.9, 0.9, 0.5, 0.85, 30, normalize=True),
        np.array(small) / np.max(np.abs(small)),
        rtol=1e-13,
    )


# ------------------------------------------------------------------- paper numbers


def test_adam_bound_matches_paper_and_refutes_kingma_ba():
    adam = adam_update_bound(0.9, 0.999)
    claim = kingma_ba_claimed_bound(0.9, 0.999)
    # The paper prints 3 significant digits: the true value lies within half a unit
    # of the last printed digit.
    assert abs(adam - 7.27) <= 0.005
    assert abs(claim - 3.16) <= 0.005
    # eqn adam-ub-limit, and the nu1 = nu2 = 1 case of eqn qhadam-ub-limit
    closed = (1 - 0.9) * math.sqrt(0.999 / ((1 - 0.999) * (0.999 - 0.9**2)))
    assert adam == pytest.approx(closed, rel=4 * EPS)
    assert adam == qhadam_update_bound(1, 0.9, 1, 0.999)
    for t in (0, 5, 100):
        assert adam_update_bound(0.9, 0.999, t) == qhadam_update_bound(1, 0.9, 1, 0.999, t)
    # Kingma & Ba's claim is for Adam *with* bias correction: run the actual rule with
    # bias correction (eps = 0) on the maximizing sequence; late in training the
    # corrections are ~1 and the update exceeds the claim by a factor > 2.
    t = 20_000
    x = np.array(qhadam_maximizing_gradients(1, 0.9, 1, 0.999, t))
    m = v = np.zeros(())
    with np.errstate(divide="ignore", invalid="ignore"):  # the oldest entries underflow
        for step, g in enumerate(x, start=1):
            m, v, u = rules.qhadam_update(
                g,
                m,
                v,
                beta1=0.9,
                beta2=0.999,
                nu1=1.0,
                nu2=1.0,
                eps=0.0,
                bias_correction1=rules.bias_correction(0.9, step),
                bias_correction2=rules.bias_correction(0.999, step),
                sqrt=np.sqrt,
            )
    assert u > 2 * claim
    assert u == pytest.approx(adam, rel=1e-6)


@pytest.mark.parametrize(
    ("beta1", "beta2"), [(0.9, 0.999), (0.9, 0.98), (0.5, 0.3), (0.99, 0.9999)]
)
def test_kingma_ba_claim_is_below_tight_bound(beta1, beta2):
    assert kingma_ba_claimed_bound(beta1, beta2) == max(1, (1 - beta1) / math.sqrt(1 - beta2))
    assert adam_update_bound(beta1, beta2) > kingma_ba_claimed_bound(beta1, beta2)


def test_figure_setting_bound_decreases_with_nu2_up_to_a_point():
    # Figure "qhadam-theoretical-bound": nu1 = 0.8, beta1 = 0.95, beta2 = 0.98.
    nu1, beta1, beta2 = 0.8, 0.95, 0.98
    grid = np.linspace(0.001, 1.0, 999 * 4 + 1)  # step 0.00025
    bounds = np.array([qhadam_update_bound(nu1, beta1, v, beta2) for v in grid])
    at_one = bounds[-1]
    # The limit as the rule reaches it: the update of the maximizing gradients
    # after many steps ((beta1^2 / beta2)^t is below 1e-30 at t = 1000).
    x = qhadam_maximizing_gradients(nu1, beta1, 1.0, beta2, 1000, normalize=True)
    assert qhadam_updates(np.array(x), nu1, beta1, 1.0, beta2)[-1] == pytest.approx(at_one)
    assert at_one == pytest.approx(1.952, abs=5e-4)  # as docs/analysis.md quotes it
    i = int(np.argmin(bounds))
    nu2_star, best = qhadam_bound_optimal_nu2(nu1, beta1, beta2)
    # the closed-form optimum agrees with the grid (quoted in docs/analysis.md),
    # and is far below the Adam-like nu2 = 1
    assert abs(grid[i] - nu2_star) <= 0.00025
    assert bounds[i] == pytest.approx(best, rel=1e-6)
    assert nu2_star == pytest.approx(0.8156, abs=1e-4)
    assert best == pytest.approx(1.1955, abs=1e-4)
    assert best <= bounds.min() and best < 0.62 * at_one
    # "decreases ... up to a point": monotone down from nu2 = 1 to nu2*, then up again
    assert np.all(np.diff(bounds[i:]) > 0)
    assert np.all(np.diff(bounds[: i + 1]) < 0)
    assert bounds[0] > at_one  # too small a nu2 is worse than nu2 = 1
    # closed form of the minimum: |1 - nu1 b1| + |nu1| b1 (1 - b1) sqrt(b2 / ((1-b2)(b2-b1^2)))
    closed = 0.24 + 0.8 * 0.95 * 0.05 * math.sqrt(0.98 / (0.02 * (0.98 - 0.95**2)))
    assert best == pytest.approx(closed, rel=1e-12)


@pytest.mark.parametrize(
    ("nu1", "beta1", "beta2"),
    [(0.8, 0.95, 0.98), (1.0, 0.9, 0.999), (0.7, 0.9, 0.99), (0.1, 0.5, 0.9), (1.0, 0.3, 0.1)],
)
def test_optimal_nu2_minimizes_over_unit_interval(nu1, beta1, beta2):
    nu2_star, best = qhadam_bound_optimal_nu2(nu1, beta1, beta2)
    assert 0 < nu2_star <= 1
    grid = np.linspace(1e-3, 1.0, 2000)
    others = np.array([qhadam_update_bound(nu1, beta1, v, beta2) for v in grid])
    assert best <= others.min() * (1 + 1e-12)
    assert best == qhadam_update_bound(nu1, beta1, nu2_star, beta2)


def test_optimal_nu2_edge_cases():
    # nu1 = 0: no history in g~, so nu2 -> 0 (s~ = x_t^2) is best, with bound 1
    assert qhadam_bound_optimal_nu2(0.0, 0.9, 0.99) == (0.0, 1.0)
    # unconstrained optimum above 1 clips to nu2 = 1
    nu2_star, best = qhadam_bound_optimal_nu2(1.0, 0.3, 0.1)
    assert nu2_star == 1.0
    assert best == adam_update_bound(0.3, 0.1)


# ---------------------------------------------------------------------- variance


def _qhwma_weights(nu: float, beta: float, t: int) -> np.ndarray:
    """The QHM direction after t + 1 unit impulses: entry j is the weight on x_j."""
    eye = np.eye(t + 1)
    buf = np.zeros(t + 1)
    for j in range(t + 1):
        buf, direction = rules.qhm_update(eye[j], buf, momentum=beta, nu=nu)
    return direction


@pytest.mark.parametrize("nu", [0.0, 0.3, 0.7, 1.0, 1.4, -0.5])
@pytest.mark.parametrize("beta", [-0.9, -0.3, 0.0, 0.5, 0.9, 0.99])
def test_variance_factor_is_sum_of_squared_weights(nu, beta):
    for t in (0, 1, 2, 7, 40):
        w = _qhwma_weights(nu, beta, t)
        # delta_QH(0) = 1 - nu beta weights the *newest* x_t (the paper's x_0 is an erratum)
        delta = np.array([1 - nu * beta] + [nu * (1 - beta) * beta**i for i in range(1, t + 1)])
        np.testing.assert_allclose(w[::-1], delta, rtol=1e-12, atol=1e-15)
        assert qhwma_variance_factor(nu, beta, t) == pytest.approx(np.sum(w**2), rel=1e-12)
    # large t: the exact finite sum of squared weights reaches the limit rho
    lag = np.arange(1, 20_000)
    total = (1 - nu * beta) ** 2 + np.sum((nu * (1 - beta) * beta**lag) ** 2)
    assert qhwma_variance_factor(nu, beta) == pytest.approx(total, rel=1e-12)


@pytest.mark.parametrize(("nu", "beta"), [(0.7, 0.9), (1.0, 0.9), (0.7, 0.999), (0.3, -0.5)])
def test_variance_factor_monte_carlo(nu, beta):
    # Empirical variance of the QHWMA (QHM direction) of n iid N(0, 1) streams.
    rng = np.random.default_rng(7)
    n, t = 200_000, 60
    buf = np.zeros(n)
    for _ in range(t + 1):
        buf, direction = rules.qhm_update(rng.standard_normal(n), buf, momentum=beta, nu=nu)
    rho_t = qhwma_variance_factor(nu, beta, t)
    # the sample variance of n normals has relative standard deviation sqrt(2 / (n - 1))
    assert np.var(direction, ddof=1) == pytest.approx(rho_t, rel=5 * math.sqrt(2 / (n - 1)))


def test_ewma_factor_and_paper_examples():
    for beta in (-0.9, -0.1, 0.0, 0.3, 0.9, 0.99, 0.999999):
        expected = (1 - beta) ** 2 / (1 - beta**2)
        assert ewma_variance_factor(beta) == pytest.approx(expected, rel=1e-12)
        assert ewma_variance_factor(beta) == qhwma_variance_factor(1.0, beta)
        for t in (0, 3, 50):
            assert ewma_variance_factor(beta, t) == qhwma_variance_factor(1.0, beta, t)
    assert ewma_variance_factor(0.9) == pytest.approx(1 / 19, rel=1e-14)
    assert ewma_variance_factor(0.99) == pytest.approx(1 / 199, rel=1e-14)


def test_variance_factor_monotonicity_regimes():
    betas = np.linspace(-0.999, 0.999, 801)
    nus = np.linspace(0.0, 1.0, 201)
    rho = np.array([[qhwma_variance_factor(nu, b) for b in betas] for nu in nus])
    # decreasing in beta on (-1, 1) for every nu in (0, 1]; constant 1 at nu = 0
    assert np.all(np.diff(rho[1:], axis=1) < 0)
    assert np.all(rho[0] == 1.0)
    # decreasing in nu for beta in (0, 1) ...
    pos = betas > 1e-9  # the grid's middle point is 0 up to rounding: rho is flat there
    assert np.all(np.diff(rho[:, pos], axis=0) < 0)
    # ... but *increasing* in nu for beta < 0 (the paper's claim needs beta > 0)
    assert np.all(np.diff(rho[:, betas < 0], axis=0) > 0)
    # outside nu in [0, 1] monotonicity breaks where d rho / d nu and d rho / d beta
    # change sign: nu* = (1 + b) / (2 b) and nu = (1 + b)^2 / (b (2 + b)).
    b = 0.9
    turn = (1 + b) / (2 * b)
    assert qhwma_variance_factor(turn + 0.1, b) > qhwma_variance_factor(turn, b)
    assert qhwma_variance_factor(turn - 0.1, b) > qhwma_variance_factor(turn, b)
    nu = 1.5
    assert nu > (1 + b) ** 2 / (b * (2 + b))
    assert qhwma_variance_factor(nu, b + 0.01) > qhwma_variance_factor(nu, b)


def test_variance_factor_lower_bound():
    betas = np.linspace(-0.999, 0.999, 401)
    for nu in np.linspace(0.0, 1.0, 41):
        rho = np.array([qhwma_variance_factor(nu, b) for b in betas])
        assert np.all(rho >= (1 - nu) ** 2)
        # tight: approached as beta -> 1
        gap = qhwma_variance_factor(nu, 1 - 1e-9) - (1 - nu) ** 2
        assert 0 <= gap < 1e-9


def test_variance_factor_finite_t_increases_to_limit():
    for nu, beta in ((0.7, 0.9), (0.7, -0.9), (1.0, 0.5)):
        vals = [qhwma_variance_factor(nu, beta, t) for t in range(60)]
        assert vals[0] == pytest.approx((1 - nu * beta) ** 2)
        assert np.all(np.diff(vals) >= 0)
        assert vals[-1] <= qhwma_variance_factor(nu, beta)
        assert qhwma_variance_factor(nu, beta, 10**6) == qhwma_variance_factor(nu, beta)


# ------------------------------------------------------------------ preconditions


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            (0.7, 0.0, 1.0, 0.999),
            r"beta1 must be in \(0, sqrt\(beta2\)\) = \(0, 0\.999499874937461\); "
            r"received beta1=0\.0",
        ),
        ((0.7, -0.1, 1.0, 0.999), r"beta1 must be in \(0, sqrt\(beta2\)\).*received beta1=-0\.1"),
        ((0.7, 0.95, 1.0, 0.9), r"beta1 must be in \(0, sqrt\(beta2\)\).*received beta1=0\.95"),
        ((0.7, math.sqrt(0.81), 1.0, 0.81), r"received beta1=0\.9"),
        ((0.7, 0.9, 1.0, 1.0), r"beta2 must be in \(0, 1\); received beta2=1\.0"),
        ((0.7, 0.9, 1.0, 0), r"beta2 must be in \(0, 1\); received beta2=0$"),
        ((0.7, 0.9, 1.0, math.nan), r"beta2 must be in \(0, 1\); received beta2=nan"),
        ((0.7, 0.9, 1.1, 0.999), r"nu2 must be in \[0, 1\]; received nu2=1\.1"),
        ((0.7, 0.9, -0.1, 0.999), r"nu2 must be in \[0, 1\]; received nu2=-0\.1"),
        ((math.inf, 0.9, 1.0, 0.999), r"nu1 must be a finite real number; received nu1=inf"),
        ((math.nan, 0.9, 1.0, 0.999), r"nu1 must be a finite real number; received nu1=nan"),
    ],
)
def test_bound_precondition_errors(args, message):
    with pytest.raises(ValueError, match=message):
        qhadam_update_bound(*args)
    with pytest.raises(ValueError, match=message):
        qhadam_maximizing_gradients(*args, 3)
    if args[0] == 0.7 and args[2] == 1.0:  # the betas alone
        with pytest.raises(ValueError, match=message):
            adam_update_bound(args[1], args[3])


def test_t_precondition_errors():
    with pytest.raises(ValueError, match=r"t must be in \[0, inf\); received t=-1"):
        qhadam_update_bound(0.7, 0.9, 1.0, 0.999, -1)
    for bad in (1.5, 2.0, "3"):
        with pytest.raises(TypeError, match="t must be a non-negative int or None"):
            qhadam_update_bound(0.7, 0.9, 1.0, 0.999, bad)
    with pytest.raises(TypeError, match="bool"):
        qhadam_update_bound(0.7, 0.9, 1.0, 0.999, True)
    with pytest.raises(TypeError, match="t must be a non-negative int;"):
        qhadam_maximizing_gradients(0.7, 0.9, 1.0, 0.999, None)
    with pytest.raises(ValueError, match=r"t must be in \[0, inf\)"):
        qhwma_variance_factor(0.7, 0.9, -2)
    # NumPy integers are integers
    assert qhadam_update_bound(0.7, 0.9, 1.0, 0.999, np.int64(5)) == qhadam_update_bound(
        0.7, 0.9, 1.0, 0.999, 5
    )


def test_variance_and_claim_precondition_errors():
    for beta in (1.0, -1.0, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"beta must be in \(-1, 1\); received beta="):
            qhwma_variance_factor(0.7, beta)
        with pytest.raises(ValueError, match=r"beta must be in \(-1, 1\)"):
            ewma_variance_factor(beta)
    with pytest.raises(ValueError, match="nu must be a finite real number"):
        qhwma_variance_factor(math.inf, 0.5)
    with pytest.raises(ValueError, match=r"beta2 must be in \[0, 1\); received beta2=1\.0"):
        kingma_ba_claimed_bound(0.9, 1.0)
    with pytest.raises(TypeError, match=r"^nu must be a real number; received nu=True$"):
        qhwma_variance_factor(True, 0.5)
    with pytest.raises(TypeError, match="beta1 must be a real number"):
        qhadam_update_bound(0.7, "0.9", 1.0, 0.999)


def test_numpy_scalars_accepted_and_module_is_numpy_free():
    assert qhadam_update_bound(np.float64(0.7), np.float32(0.5), np.float64(1.0), 0.9) == (
        qhadam_update_bound(0.7, 0.5, 1.0, 0.9)
    )
    with pytest.raises(ValueError, match=r"received beta1=0\.95$"):
        qhadam_update_bound(0.7, np.float64(0.95), 1.0, 0.9)
    code = "import sys, qhoptim.analysis; assert 'numpy' not in sys.modules, 'numpy imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------- what nu2 does to the bound (docs)
@pytest.mark.parametrize("beta2", [0.98, 0.999])
def test_nu2_alone_at_0_7_loosens_adams_bound(beta2):
    # docs/analysis.md, README: with nu1 = 1, nu2 = 0.7 is *worse* than Adam.
    adam = adam_update_bound(0.9, beta2)
    assert qhadam_update_bound(1.0, 0.9, 0.7, beta2) > adam
    # ... while nu2 at its optimum is below Adam, by little (< 10%).
    star, best = qhadam_bound_optimal_nu2(1.0, 0.9, beta2)
    assert star > 0.95
    assert 0.9 * adam < best < adam


@pytest.mark.parametrize(
    ("beta1", "beta2"), [(0.9, 0.98), (0.9, 0.999), (0.3, 0.95), (0.9, 0.85), (0.7, 0.6)]
)
def test_with_nu1_one_nu2_below_one_helps_iff_beta1_below_beta2(beta1, beta2):
    # From the convex form A/(1-u) + C/u (u = nu2 beta2): the optimum u* lies
    # below beta2 iff beta1 < beta2 when nu1 = 1; check against a fine grid.
    star, _ = qhadam_bound_optimal_nu2(1.0, beta1, beta2)
    grid = np.linspace(0.05, 1.0, 2000)
    at_one = qhadam_update_bound(1.0, beta1, 1.0, beta2)
    below = min(qhadam_update_bound(1.0, beta1, float(v), beta2) for v in grid[:-1])
    assert (star < 1.0) is (beta1 < beta2) is (below < at_one)


@pytest.mark.parametrize("beta2", [0.98, 0.999])
def test_nu1_below_one_raises_the_bound_and_the_pair_lowers_it(beta2):
    adam = adam_update_bound(0.9, beta2)
    for nu1 in (0.9, 0.8, 0.7):
        assert qhadam_update_bound(nu1, 0.9, 1.0, beta2) > adam
        assert qhadam_bound_optimal_nu2(nu1, 0.9, beta2)[1] < adam


def test_wmt_setting_gain_comes_mostly_from_beta1():
    # The paper's WMT16 setting against its Adam baseline (beta1 = 0.9).
    qh = qhadam_update_bound(0.8, 0.95, 0.7, 0.98)
    baseline = adam_update_bound(0.9, 0.98)
    adam_beta1 = adam_update_bound(0.95, 0.98)
    nu1_alone = qhadam_update_bound(0.8, 0.95, 1.0, 0.98)
    assert qh < adam_beta1 < baseline < nu1_alone
    assert baseline - adam_beta1 > adam_beta1 - qh  # most of the gain: beta1


# ------------------------------------------------- float64 range (extreme inputs)
def test_update_bound_tiny_nu2_is_finite_not_zero_division():
    # n2 * (1 - b2) * gap underflows to 0, the bound (~1/sqrt(nu2)) does not.
    b = qhadam_update_bound(0.7, 0.9, 5e-324, 0.999)
    assert math.isfinite(b) and b > qhadam_update_bound(0.7, 0.9, 1e-300, 0.999)
    # The history term dominates and scales as 1/sqrt(nu2).
    scaled = qhadam_update_bound(0.7, 0.9, 1e-300, 0.999) * math.sqrt(1e-300 / 5e-324)
    assert b == pytest.approx(scaled, rel=1e-6)
    assert qhadam_update_bound(0.7, 0.9, 0.0, 0.999) == math.inf  # the docstring's limit


def test_update_bound_overflow_is_inf_and_representable_values_are_returned():
    assert qhadam_update_bound(1e308, 0.5, 1.0, 0.999, 0) == math.inf
    assert qhadam_update_bound(1e308, 0.9, 1.0, 0.999) == math.inf
    # (1 - nu1 beta1)**2 overflowed (OverflowError) where the bound is representable.
    # At t = 0 the formula's first term alone: |1 - nu1 beta1| / sqrt(1 - nu2 beta2).
    assert qhadam_update_bound(1e308, 0.5, 0.9, 0.5, 0) == pytest.approx(
        5e307 / math.sqrt(0.55), rel=1e-3
    )
    # (1 - nu1 beta1)**2 overflows but the bound itself (~1.2e308) does not.
    b = qhadam_update_bound(1e308, 0.5, 0.9, 0.5)
    assert math.isfinite(b)
    small = qhadam_update_bound(1e300, 0.5, 0.9, 0.5)
    assert b == pytest.approx(small * 1e8, rel=1e-12)


def test_optimal_nu2_and_variance_at_extremes():
    nu2, bound = qhadam_bound_optimal_nu2(0.999999, 5e-324, 0.999999)
    assert 0.0 < nu2 <= 1.0 and math.isfinite(bound)
    nu2, bound = qhadam_bound_optimal_nu2(1e308, 0.3, 0.9)
    assert 0.0 < nu2 <= 1.0 and bound >= 1e307
    assert qhwma_variance_factor(-1e308, 0.3, 1) == math.inf
    assert qhwma_variance_factor(-1e308, 0.999999, 0) == math.inf  # not inf * 0 = nan


def test_maximizing_gradients_extremes_raise_value_error_or_attain():
    with pytest.raises(ValueError, match="nu1"):
        qhadam_maximizing_gradients(1e308, 0.9, 1 - 2**-53, 1 - 2**-53, 0)
    assert len(qhadam_maximizing_gradients(1e308, 0.9, 1 - 2**-53, 1 - 2**-53, 0, normalize=True))
    # n2 * (1 - b2) underflows: the entries are huge but finite in log space.
    x = qhadam_maximizing_gradients(-1e-170, 1e-08, 5e-324, 0.9, 3, normalize=True)
    assert all(math.isfinite(v) for v in x) and max(map(abs, x)) == 1.0


_EXTREMES = [0.0, -0.0, 5e-324, -5e-324, 1e-170, -1e-170, 0.5, 0.9, 1 - 2**-53, 1.0]
_EXTREMES += [2.0, -1.0, 1e40, -1e40, 1e308, -1e308]
_reals = st.one_of(st.sampled_from(_EXTREMES), st.floats(allow_nan=False, allow_infinity=False))
_ts = st.one_of(st.none(), st.integers(0, 50), st.sampled_from([10**6, 2**1100]))


ANALYSIS: list[tuple[Callable[..., Any], list[str]]] = [
    (qhadam_update_bound, ["nu1", "beta1", "nu2", "beta2", "t"]),
    (adam_update_bound, ["beta1", "beta2", "t"]),
    (kingma_ba_claimed_bound, ["beta1", "beta2"]),
    (qhadam_bound_optimal_nu2, ["nu1", "beta1", "beta2"]),
    (qhadam_maximizing_gradients, ["nu1", "beta1", "nu2", "beta2", "t"]),
    (qhwma_variance_factor, ["nu", "beta", "t"]),
    (ewma_variance_factor, ["beta", "t"]),
]


def test_property_table_covers_every_public_function():
    from qhoptim import analysis

    assert sorted(f.__name__ for f, _ in ANALYSIS) == sorted(analysis.__all__)
    for fn, names in ANALYSIS:
        assert list(inspect.signature(fn).parameters)[: len(names)] == names


def _names_an_argument(message: str, names: list[str]) -> bool:
    return any(re.search(rf"\b{n}\b", message) for n in names)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), index=st.integers(0, len(ANALYSIS) - 1), normalize=st.booleans())
def test_property_analysis_returns_a_bound_or_names_an_argument(
    data: Any, index: int, normalize: bool
) -> None:
    fn, names = ANALYSIS[index]
    args = [data.draw(_ts if n == "t" else _reals, label=n) for n in names]
    kwargs: dict[str, Any] = {}
    if fn is qhadam_maximizing_gradients:
        args[-1] = data.draw(st.integers(0, 30), label="t")
        kwargs["normalize"] = normalize
    try:
        result = fn(*args, **kwargs)
    except ValueError as e:
        assert _names_an_argument(str(e), names), str(e)
        return
    if fn is qhadam_maximizing_gradients:
        assert result and all(math.isfinite(v) for v in result)
        return
    values = list(result) if isinstance(result, tuple) else [result]
    for v in values:
        assert type(v) is float and v >= 0.0  # a float >= 0 or inf, never nan
