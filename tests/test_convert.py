"""qhoptim.convert: closed forms, return types, preconditions and round trips."""

from __future__ import annotations

import inspect
import json
import math
import random
import re
import subprocess
import sys
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qhoptim import convert, validation
from qhoptim.convert import QHAdamParams, QHMParams
from qhoptim.reference import QHM, QHAdam

approx = pytest.approx

QHM_CONVERSIONS: list[tuple[Callable[..., Any], dict[str, Any]]] = [
    (convert.from_sgd, {"lr": 0.1}),
    (convert.from_momentum, {"lr": 0.1, "momentum": 0.9}),
    (convert.from_nesterov, {"lr": 0.1, "momentum": 0.9}),
    (convert.from_pid, {"k_p": -0.03, "k_i": 0.005, "k_d": 0.27}),
    (convert.from_an_pid, {"r": 0.001, "k_d": 0.002, "beta": 0.9}),
    (convert.from_synthesized_nesterov, {"alpha": 0.001, "beta1": 0.9, "beta2": 0.5}),
    (convert.from_robust_momentum, {"l": 100.0, "kappa": 100.0, "rho": 0.95}),
    (convert.from_triple_momentum, {"l": 100.0, "kappa": 100.0}),
    (convert.from_accsgd, {"delta": 0.001, "kappa": 1000.0, "xi": 10.0}),
    (
        convert.from_two_state_optimizer,
        {"h": 0.5, "k": -0.75, "l": 0.001, "m": 0.2, "q": 1.3, "z": -0.001},
    ),
    (convert.from_aggmo, {"lr": 0.1, "betas": [0.0, 0.9]}),
]
QHADAM_CONVERSIONS: list[tuple[Callable[..., Any], dict[str, Any]]] = [
    (convert.from_adam, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}),
    (convert.from_nadam, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}),
    (convert.from_rmsprop, {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8}),
]


# ----------------------------------------------------------------------- types
@pytest.mark.parametrize(
    ("fn", "kwargs"), QHM_CONVERSIONS, ids=lambda x: getattr(x, "__name__", "")
)
def test_qhm_conversions_return_valid_qhm_params(
    fn: Callable[..., Any], kwargs: dict[str, Any]
) -> None:
    p = fn(**kwargs)
    assert type(p) is QHMParams
    assert all(type(v) is float for v in p)
    assert p.as_kwargs() == {"lr": p.lr, "momentum": p.momentum, "nu": p.nu}
    assert 0 <= p.momentum < 1 and p.lr >= 0
    QHM(**p.as_kwargs())  # accepted by the reference optimizer


@pytest.mark.parametrize(
    ("fn", "kwargs"), QHADAM_CONVERSIONS, ids=lambda x: getattr(x, "__name__", "")
)
def test_qhadam_conversions_return_valid_qhadam_params(
    fn: Callable[..., Any], kwargs: dict[str, Any]
) -> None:
    p = fn(**kwargs)
    assert type(p) is QHAdamParams
    assert type(p.betas) is tuple and type(p.nus) is tuple
    assert p.as_kwargs() == {"lr": p.lr, "betas": p.betas, "nus": p.nus, "eps": p.eps}
    QHAdam(**p.as_kwargs())  # type: ignore[arg-type]


def test_convert_imports_no_numpy() -> None:
    code = "import sys, json, qhoptim.convert; print(json.dumps('numpy' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert json.loads(out.stdout) is False


# ---------------------------------------------------------------- closed forms
def test_sgd() -> None:
    assert convert.from_sgd(0.3) == QHMParams(lr=0.3, nu=0.0, momentum=0.0)


def test_momentum_practical_suggestion() -> None:
    # Ma & Yarats (2019), Sec. 7.1: momentum/NAG (0.1, 0.9) -> QHM lr 1.
    assert convert.from_momentum(0.1, 0.9) == approx(QHMParams(1.0, 1.0, 0.9))
    assert convert.from_nesterov(0.1, 0.9) == approx(QHMParams(1.0, 0.9, 0.9))
    assert convert.from_momentum(0.1, 0.0) == QHMParams(0.1, 1.0, 0.0)


def test_pid_closed_form_and_special_cases() -> None:
    assert convert.from_pid(-0.03, 0.005, 0.27) == approx(QHMParams(0.005, 2 / 3, 0.9))
    assert convert.from_pid(-0.03, 0.005, 0.27, beta=0.9) == approx(QHMParams(0.005, 2 / 3, 0.9))
    # k_p = k_d = 0 is plain SGD with step k_i (any D filter).
    assert convert.from_pid(0.0, 0.2, 0.0, beta=0.5) == QHMParams(0.2, 0.0, 0.0)
    # k_p = 0, k_d != 0 (an ID controller): the momentum is 1 exactly, out of
    # range whatever k_d's sign, not a rounding.
    for k_d in (-1.0, 1.0):
        with pytest.raises(ValueError, match=r"must be in \[0, 1\); received k_p=0.0, k_d="):
            convert.from_pid(0.0, 1.0, k_d)
    # App. C.3: momentum iff k_p / k_i = k_d / k_p; NAG iff k_p / k_i = beta k_d / k_p.
    a, b = 0.01, 0.8
    for nu in (1.0, b):
        k_p, k_i, k_d = -a * nu * b / (1 - b), a, a * nu * b**2 / (1 - b) ** 2
        ratio = k_d / k_p if nu == 1.0 else b * k_d / k_p
        assert k_p / k_i == approx(ratio)
        assert convert.from_pid(k_p, k_i, k_d) == approx(QHMParams(a, nu, b))


def test_an_pid_closed_form() -> None:
    # nu = 1 + k_d (1 - beta)^2 / (r beta): corrected sign (App. E prints "1 -").
    p = convert.from_an_pid(r=0.001, k_d=0.002, beta=0.9)
    assert p == approx(QHMParams(0.01, 1 + 0.002 * 0.01 / 0.0009, 0.9))
    assert convert.from_an_pid(0.01, 0.0, 0.5) == approx(QHMParams(0.02, 1.0, 0.5))  # momentum


def test_snv_closed_form() -> None:
    assert convert.from_synthesized_nesterov(0.001, 0.9, 0.5) == approx(
        QHMParams(0.01, 1 - 0.1 * 0.5 / 0.9, 0.9)
    )
    # beta2 = beta1 is Nesterov in Lessard et al.'s form; beta2 = 0 is heavy ball.
    assert convert.from_synthesized_nesterov(0.001, 0.9, 0.9).nu == approx(0.9)
    assert convert.from_synthesized_nesterov(0.001, 0.9, 0.0).nu == 1.0
    assert convert.from_synthesized_nesterov(0.5, 0.0, 0.0) == QHMParams(0.5, 0.0, 0.0)


@pytest.mark.parametrize("kappa", [1.5, 10.0, 100.0, 1e4])
def test_robust_momentum_end_points(kappa: float) -> None:
    l = 7.0  # noqa: E741
    # Fast end: Triple Momentum's parameters (Cyrus et al. 2018's claim).
    rho = 1 - 1 / math.sqrt(kappa)
    tm = convert.from_triple_momentum(l, kappa)
    assert convert.from_robust_momentum(l, kappa) == approx(tm, rel=1e-12)
    assert convert.from_robust_momentum(l, kappa, rho) == approx(tm, rel=1e-12)
    a, b, g = (1 + rho) / l, rho**2 / (2 - rho), rho**2 / ((1 + rho) * (2 - rho))
    assert tm == approx(QHMParams(a / (1 - b), 1 - (1 - b) * g / b, b), rel=1e-12)
    # Slow end: gradient descent with step 1/l.
    gd = convert.from_robust_momentum(l, kappa, 1 - 1 / kappa)
    assert gd.lr == approx(1 / l, rel=1e-12)
    assert gd.nu == approx(0.0, abs=1e-12)


@pytest.mark.parametrize("kappa", [2.0, 30.0, 1e3])
def test_robust_momentum_rate_on_quadratics(kappa: float) -> None:
    # On f = lam/2 x^2 with lam in [l/kappa, l] QHM's iteration has spectral
    # radius <= rho, with equality attained: the worst-case rate of the paper.
    import numpy as np

    l = 2.0  # noqa: E741
    for rho in np.linspace(1 - 1 / math.sqrt(kappa), 1 - 1 / kappa, 4):
        p = convert.from_robust_momentum(l, kappa, float(rho))
        a, nu, b = p.lr, p.nu, p.momentum
        worst = 0.0
        for lam in np.linspace(l / kappa, l, 801):
            m = [[b, (1 - b) * lam], [-a * nu * b, 1 - a * lam * (1 - nu * b)]]
            worst = max(worst, float(np.max(np.abs(np.linalg.eigvals(m)))))
        assert worst == approx(float(rho), rel=1e-9)


def test_triple_momentum_kappa_one_is_gradient_descent() -> None:
    assert convert.from_triple_momentum(4.0, 1.0) == QHMParams(0.25, 0.0, 0.0)


def test_accsgd_closed_form() -> None:
    d, k, xi, e = 0.001, 1000.0, 10.0, 0.7
    p = convert.from_accsgd(d, k, xi)
    assert p == approx(
        QHMParams(
            d * e * (1 + xi) / (1 + e),
            (e * xi - 1) / (e * (1 + xi)),
            (k - e * e * xi) / (k + e * xi),
        )
    )


@pytest.mark.parametrize(("kappa", "eps"), [(4.0, 0.7), (1000.0, 0.7), (50.0, 0.3), (1.5, 0.99)])
def test_accsgd_cannot_recover_nag(kappa: float, eps: float) -> None:
    # App. C.5: nu = beta needs xi = (1 - eps + sqrt(4 kappa + (1 - eps)^2)) / (2 eps),
    # which exceeds sqrt(kappa): AccSGD cannot be NAG.
    xi = (1 - eps + math.sqrt(4 * kappa + (1 - eps) ** 2)) / (2 * eps)
    assert xi > math.sqrt(kappa)
    nu = (eps * xi - 1) / (eps * (1 + xi))
    beta = (kappa - eps * eps * xi) / (kappa + eps * xi)
    assert nu == approx(beta)
    with pytest.raises(ValueError, match=r"xi must be in \(0, .*\]; received xi="):
        convert.from_accsgd(0.1, kappa, xi, eps)


def test_two_state_qhm_itself_and_scaled_buffer() -> None:
    a, nu, b, c = 0.005, 0.7, 0.9, 2.5
    tso = {
        "h": b,
        "k": 0.0,
        "l": c * (1 - b),
        "m": -a * nu * b / c,
        "q": 1.0,
        "z": -a * (1 - nu * b),
    }
    assert convert.from_two_state_optimizer(**tso) == approx(QHMParams(a, nu, b))
    assert convert.two_state_initial_buffer(**tso) == approx((1 / c, 0.0))
    # m = 0: theta ignores the buffer -> SGD, and the buffer is irrelevant.
    sgd = {"h": 0.5, "k": 0.3, "l": 0.7, "m": 0.0, "q": 1.0, "z": -0.01}
    assert convert.from_two_state_optimizer(**sgd) == approx(QHMParams(0.01, 0.0, 0.5))
    assert convert.two_state_initial_buffer(**sgd) == (0.0, 0.0)


def test_two_state_eigenvalue_one_is_judged_by_the_eigenvalue() -> None:
    # h = q = 1 - 3e-5, k = m = 0: both eigenvalues are 1 - 3e-5, though the
    # determinant's two terms (9e-10 and 0) differ by less than 1e-9; a QHM
    # made of it drifts 3% from the optimizer in 1e5 steps.
    with pytest.raises(ValueError, match=r"an eigenvalue within 1e-9 of 1\); received h=0.99997"):
        convert.from_two_state_optimizer(1 - 3e-5, 0.0, 0.1, 0.0, 1 - 3e-5, -1e-3)
    # QHM in the coordinates a = g + d theta, d = 1e-186: q = 1 + 0.5 d rounds
    # to 1.0, so (1 - h)(1 - q) = 0 against k m = -2.5e-187; the eigenvalue is
    # 1 but for that rounding, and QHM is recovered.
    a, nu, b, d = 1.0, 1.0, 0.5, 1e-186
    m, q, z = -a * nu * b, 1 + a * nu * b * d, -a * (1 - nu * b)
    assert q == 1.0 and (1 - (b + d * m)) * (1 - q) != d * (q - b) * m
    tso = {"h": b + d * m, "k": d * (q - b), "l": 1 - b + d * z, "m": m, "q": q, "z": z}
    assert convert.from_two_state_optimizer(**tso) == approx(QHMParams(a, nu, b))


def test_adam_family() -> None:
    assert convert.from_adam(1e-3, (0.9, 0.999), 1e-8) == QHAdamParams(
        1e-3, (0.9, 0.999), (1.0, 1.0), 1e-8
    )
    assert convert.from_nadam(2e-3, [0.95, 0.99], 0.0) == QHAdamParams(
        2e-3, (0.95, 0.99), (0.95, 1.0), 0.0
    )
    assert convert.from_rmsprop(1e-2, 0.99, 1e-8) == QHAdamParams(
        1e-2, (0.0, 0.99), (0.0, 1.0), 1e-8
    )


def test_aggmo_closed_forms() -> None:
    # [0, beta] (App. H): c_0 = c_beta = lr / 2; alpha = c_0 + c_beta / (1 - beta).
    assert convert.from_aggmo(0.1, [0.0, 0.9]) == approx(QHMParams(0.55, 10 / 11, 0.9))
    # K = 1: momentum, as torch's SGD momentum (same unnormalized buffer).
    assert convert.from_aggmo(0.1, [0.9]) == approx(convert.from_momentum(0.1, 0.9))
    assert convert.from_aggmo(0.1, (0.9,)).nu == 1.0
    # Every discount 0: SGD with step lr; K = 1, beta = 0 too.
    assert convert.from_aggmo(0.1, [0.0, 0.0, 0.0]) == QHMParams(0.1, 0.0, 0.0)
    assert convert.from_aggmo(0.1, [0.0]) == QHMParams(0.1, 0.0, 0.0)
    # Extended AggMo: per-buffer rates, weights c_b = rate / K.
    p = convert.from_aggmo([0.3, 0.6], [0.0, 0.95])
    assert p == approx(QHMParams(0.15 + 0.3 / 0.05, (0.3 / 0.05) / (0.15 + 0.3 / 0.05), 0.95))
    # Buffers of equal discount add up (in any order, with any multiplicity).
    assert convert.from_aggmo(0.1, [0.9, 0.0, 0.9, 0.0]) == approx(
        convert.from_aggmo(0.1, [0, 0.9])
    )
    assert convert.from_aggmo([0.1, 0.2, 0.3], [0.9, 0.0, 0.9]) == approx(
        convert.from_aggmo([0.4 / 3, 0.8 / 3], [0.0, 0.9])  # K = 2: the same weights
    )


def test_aggmo_zero_rates_drop_their_buffers() -> None:
    # A zero-rate buffer never moves theta, whatever its discount.
    assert convert.from_aggmo([0.2, 0.0, 0.1], [0.0, 0.999, 0.9]) == approx(
        convert.from_aggmo([0.4 / 3, 0.2 / 3], [0.0, 0.9])  # K = 2: the same weights
    )
    p = convert.from_aggmo([0.3, 0.0, 0.15], [0.0, 0.999, 0.9])
    assert p == approx(QHMParams(0.1 + 0.05 / 0.1, 0.5 / 0.6, 0.9))
    # Rates of one discount that cancel drop it too; [0, beta] with rate 0 on 0 is momentum.
    assert convert.from_aggmo([0.1, -0.1, 0.2], [0.99, 0.99, 0.0]) == approx(
        QHMParams(0.2 / 3, 0.0, 0.0)
    )
    assert convert.from_aggmo([0.0, 0.2], [0.0, 0.9]).nu == 1.0
    # Nothing moves: lr 0, or every rate 0.
    assert convert.from_aggmo(0.0, [0.0, 0.9, 0.99]) == QHMParams(0.0, 0.0, 0.0)
    assert convert.from_aggmo([0.0, 0.0], [0.5, 0.9]) == QHMParams(0.0, 0.0, 0.0)


def test_aggmo_negative_rates_give_nu_outside_unit_interval() -> None:
    # App. H: gamma in R^K. A negative rate on the beta = 0 buffer is nu > 1 ...
    assert convert.from_aggmo([-0.02, 0.05], [0.0, 0.9]) == approx(
        QHMParams(0.24, 0.25 / 0.24, 0.9)
    )
    # ... and on the momentum buffer nu < 0.
    p = convert.from_aggmo([1.0, -0.01], [0.0, 0.9])
    assert p == approx(QHMParams(0.5 - 0.05, -0.05 / 0.45, 0.9))


def test_aggmo_effective_lr() -> None:
    # App. H: AggMo-Best (gamma = 0.1, betas = [0, 0.9, 0.99, 0.999]) -> 27.775 ("round up to 28").
    assert convert.aggmo_effective_lr(0.1, [0.0, 0.9, 0.99, 0.999]) == approx(27.775, rel=1e-12)
    assert type(convert.aggmo_effective_lr(0.1, [0.0, 0.9])) is float
    assert convert.aggmo_effective_lr([0.4, 0.0], [0.0, 0.5]) == approx(0.2)
    assert convert.aggmo_effective_lr(0.0, [0.9, 0.99]) == 0.0


@settings(max_examples=200, deadline=None)
@given(
    rates=st.lists(st.floats(0.0, 1.0) | st.floats(-1.0, 1.0), min_size=1, max_size=6),
    beta=st.floats(0.0, 0.999),
    data=st.data(),
)
def test_aggmo_exact_lr_is_the_effective_lr(
    rates: list[float], beta: float, data: st.DataObject
) -> None:
    # Where AggMo is a QHM, the paper's heuristic step size is the exact alpha.
    betas = [data.draw(st.sampled_from([0.0, beta])) for _ in rates]
    try:
        p = convert.from_aggmo(rates, betas)
    except ValueError as e:
        assert "must be" in str(e)
        return
    if p.lr > 0:
        assert p.lr == approx(convert.aggmo_effective_lr(rates, betas), rel=1e-9, abs=1e-12)


# --------------------------------------------------------------- preconditions
ERRORS: list[tuple[Callable[..., Any], dict[str, Any], str]] = [
    (convert.from_sgd, {"lr": -1.0}, r"lr must be in \[0, inf\); received lr=-1.0"),
    (
        convert.from_momentum,
        {"lr": 0.1, "momentum": 1.0},
        r"momentum must be in \[0, 1\); received momentum=1.0",
    ),
    (
        convert.from_momentum,
        {"lr": -0.1, "momentum": 0.9},
        r"lr must be in \[0, inf\); received lr=-0.1",
    ),
    (
        convert.from_nesterov,
        {"lr": 0.1, "momentum": -0.5},
        r"momentum must be in \[0, 1\); received momentum=-0.5",
    ),
    (
        convert.from_nesterov,
        {"lr": 0.1, "momentum": math.nan},
        r"momentum must be in \[0, 1\); received momentum=nan",
    ),
    (
        convert.from_pid,
        {"k_p": 0.1, "k_i": 0.1, "k_d": 0.0},
        r"k_d must be nonzero .*PI controller.*received k_p=0.1, k_d=0.0",
    ),
    (
        convert.from_pid,
        {"k_p": -0.1, "k_i": 0.0, "k_d": 0.9},
        r"k_i must be in \(0, inf\); received k_i=0.0",
    ),
    (
        convert.from_pid,
        {"k_p": 0.1, "k_i": 0.1, "k_d": 0.9},
        r"momentum k_d / \(k_d - k_p\).*must be in \[0, 1\); "
        r"received k_p=0.1, k_d=0.9 \(momentum=1.125\)",
    ),
    (
        convert.from_pid,
        {"k_p": 0.0, "k_i": 0.1, "k_d": 0.9},
        r"received k_p=0.0, k_d=0.9 \(momentum=1\)",
    ),
    (
        convert.from_pid,
        {"k_p": 0.3, "k_i": 0.1, "k_d": 0.3},
        r"opposite signs.*received k_p=0.3, k_d=0.3",
    ),
    (
        convert.from_pid,
        {"k_p": 0.0, "k_i": -0.1, "k_d": 0.0},
        r"k_i must be in \[0, inf\); received k_i=-0.1",
    ),
    (
        convert.from_pid,
        {"k_p": -0.03, "k_i": 0.005, "k_d": 0.27, "beta": 0.5},
        r"beta \(the D-term filter discount\) must equal k_d / \(k_d - k_p\) = 0.9"
        r".*received beta=0.5",
    ),
    (
        convert.from_pid,
        {"k_p": math.inf, "k_i": 0.1, "k_d": 0.9},
        r"k_p must be a finite real number; received k_p=inf",
    ),
    (
        convert.from_an_pid,
        {"r": 0.0, "k_d": 0.1, "beta": 0.9},
        r"r must be in \(0, inf\); received r=0.0",
    ),
    (
        convert.from_an_pid,
        {"r": 0.1, "k_d": 0.1, "beta": 1.0},
        r"beta must be in \(0, 1\); received beta=1.0",
    ),
    (
        convert.from_an_pid,
        {"r": 0.1, "k_d": 0.1, "beta": 0.0},
        r"beta must be in \(0, 1\); received beta=0.0",
    ),
    (
        convert.from_synthesized_nesterov,
        {"alpha": -1.0, "beta1": 0.9, "beta2": 0.5},
        r"alpha must be in \[0, inf\); received alpha=-1.0",
    ),
    (
        convert.from_synthesized_nesterov,
        {"alpha": 0.1, "beta1": 1.2, "beta2": 0.5},
        r"beta1 must be in \[0, 1\); received beta1=1.2",
    ),
    (
        convert.from_synthesized_nesterov,
        {"alpha": 0.1, "beta1": 0.0, "beta2": 0.5},
        r"beta2 must be 0 when beta1 = 0.*received beta1=0.0, beta2=0.5",
    ),
    (
        convert.from_robust_momentum,
        {"l": 0.0, "kappa": 10.0},
        r"l must be in \(0, inf\); received l=0.0",
    ),
    (
        convert.from_robust_momentum,
        {"l": 1.0, "kappa": 1.0},
        r"kappa must be in \(1, inf\); received kappa=1.0",
    ),
    (
        convert.from_robust_momentum,
        {"l": 1.0, "kappa": 100.0, "rho": 0.5},
        r"rho must be in \[0.9, 0.99\]; received rho=0.5",
    ),
    (
        convert.from_robust_momentum,
        {"l": 1.0, "kappa": 100.0, "rho": 0.995},
        r"rho must be in \[0.9, 0.99\]; received rho=0.995",
    ),
    (
        convert.from_triple_momentum,
        {"l": -1.0, "kappa": 10.0},
        r"l must be in \(0, inf\); received l=-1.0",
    ),
    (
        convert.from_triple_momentum,
        {"l": 1.0, "kappa": 0.5},
        r"kappa must be in \[1, inf\); received kappa=0.5",
    ),
    (
        convert.from_accsgd,
        {"delta": 0.0, "kappa": 10.0, "xi": 2.0},
        r"delta must be in \(0, inf\); received delta=0.0",
    ),
    (
        convert.from_accsgd,
        {"delta": 0.1, "kappa": 1.0, "xi": 1.0},
        r"kappa must be in \(1, inf\); received kappa=1.0",
    ),
    (
        convert.from_accsgd,
        {"delta": 0.1, "kappa": 100.0, "xi": 11.0},
        r"xi must be in \(0, 10\]; received xi=11.0",
    ),
    (
        convert.from_accsgd,
        {"delta": 0.1, "kappa": 100.0, "xi": 0.0},
        r"xi must be in \(0, 10\]; received xi=0.0",
    ),
    (
        convert.from_accsgd,
        {"delta": 0.1, "kappa": 100.0, "xi": 5.0, "eps": 1.0},
        r"eps must be in \(0, 1\); received eps=1.0",
    ),
    (
        convert.from_two_state_optimizer,
        {"h": 0.5, "k": 0.1, "l": 0.1, "m": 0.1, "q": 0.5, "z": -0.1},
        r"must satisfy \(1 - h\) \* \(1 - q\) = k \* m.*received h=0.5, k=0.1, m=0.1, q=0.5",
    ),
    (
        convert.from_two_state_optimizer,
        {"h": 1.5, "k": 0.0, "l": 0.1, "m": 0.1, "q": 1.0, "z": -0.1},
        r"momentum h \+ q - 1 must be in \[0, 1\); received h=1.5, q=1.0 \(momentum=1.5\)",
    ),
    (
        convert.from_two_state_optimizer,
        {"h": 0.5, "k": 0.0, "l": 0.5, "m": 0.0, "q": 1.0, "z": 0.1},
        r"lr .* must be >= 0; received .*z=0.1 \(lr=-0.1\)",
    ),
    (
        convert.from_two_state_optimizer,
        {"h": 0.0, "k": 0.0, "l": 1.0, "m": -0.1, "q": 1.0, "z": -0.1},
        r"\(1 - q\)\*z - m\*l must be 0 .*received h=0.0, l=1.0, m=-0.1",
    ),
    (
        convert.two_state_initial_buffer,
        {"h": 0.9, "k": 0.0, "l": 0.1, "m": 0.1, "q": 1.2, "z": -0.1},
        r"must satisfy \(1 - h\) \* \(1 - q\) = k \* m",
    ),
    (
        convert.from_adam,
        {"lr": 1e-3, "betas": (0.9, 1.0), "eps": 1e-8},
        r"betas\[1\] must be in \[0, 1\); received betas\[1\]=1.0",
    ),
    (
        convert.from_adam,
        {"lr": 1e-3, "betas": (-0.1, 0.9), "eps": 1e-8},
        r"betas\[0\] must be in \[0, 1\); received betas\[0\]=-0.1",
    ),
    (
        convert.from_adam,
        {"lr": 1e-3, "betas": (0.9,), "eps": 1e-8},
        r"betas must be a pair of two numbers; received betas=\(0.9,\)",
    ),
    (
        convert.from_nadam,
        {"lr": 1e-3, "betas": (0.9, 0.99), "eps": -1e-8},
        r"eps must be in \[0, inf\); received eps=-1e-08",
    ),
    (
        convert.from_nadam,
        {"lr": -1e-3, "betas": (0.9, 0.99), "eps": 1e-8},
        r"lr must be in \[0, inf\); received lr=-0.001",
    ),
    (
        convert.from_rmsprop,
        {"lr": 1e-3, "alpha": 1.0, "eps": 1e-8},
        r"alpha must be in \[0, 1\); received alpha=1.0",
    ),
    (
        convert.from_rmsprop,
        {"lr": 1e-3, "alpha": 0.9, "eps": math.inf},
        r"eps must be in \[0, inf\); received eps=inf",
    ),
    (
        convert.from_aggmo,
        {"lr": 0.1, "betas": [0.0, 0.9, 0.99, 0.999]},
        r"betas must contain at most one nonzero discount with a nonzero rate .*"
        r"received betas=\[0.0, 0.9, 0.99, 0.999\] \(nonzero discounts with nonzero rates: "
        r"0.9, 0.99, 0.999\).*aggmo_effective_lr",
    ),
    (
        convert.from_aggmo,
        {"lr": [0.1, 0.2], "betas": [0.9, 0.99]},
        r"at most one nonzero discount.*rates: 0.9, 0.99\)",
    ),
    (
        convert.from_aggmo,
        {"lr": [0.1, 0.0, 0.2, 0.3], "betas": [0.0, 0.9, 0.7, 0.5]},
        r"at most one nonzero discount.*rates: 0.5, 0.7\)",  # 0.9 has rate 0: not listed
    ),
    (
        convert.from_aggmo,
        {"lr": 0.1, "betas": [0.0, 1.0]},
        r"betas\[1\] must be in \[0, 1\); received betas\[1\]=1.0",
    ),
    (
        convert.from_aggmo,
        {"lr": 0.1, "betas": [-0.1]},
        r"betas\[0\] must be in \[0, 1\); received betas\[0\]=-0.1",
    ),
    (
        convert.from_aggmo,
        {"lr": -0.1, "betas": [0.0, 0.9]},
        r"lr must be in \[0, inf\); received lr=-0.1",
    ),
    (
        convert.from_aggmo,
        {"lr": math.nan, "betas": [0.9]},
        r"lr must be in \[0, inf\); received lr=nan",
    ),
    (
        convert.from_aggmo,
        {"lr": 0.1, "betas": []},
        r"betas must be a non-empty sequence of discount factors; received betas=\[\]",
    ),
    (
        convert.from_aggmo,
        {"lr": 0.1, "betas": 0.9},
        r"betas must be a non-empty sequence .*received betas=0.9",
    ),
    (
        convert.from_aggmo,
        {"lr": [0.1, 0.2, 0.3], "betas": [0.0, 0.9]},
        r"lr must be one number \(AggMo\) or one rate per buffer \(extended AggMo: "
        r"len\(betas\) = 2 rates\); received lr=\[0.1, 0.2, 0.3\]",
    ),
    (
        convert.from_aggmo,
        {"lr": [0.1, math.inf], "betas": [0.0, 0.9]},
        r"lr\[1\] must be a finite real number; received lr\[1\]=inf",
    ),
    (
        convert.from_aggmo,
        {"lr": [0.1, -0.1], "betas": [0.0, 0.9]},
        r"QHM lr sum_i lr\[i\] / \(len\(betas\) \* \(1 - betas\[i\]\)\) must be > 0; "
        r"received lr=\[0.1, -0.1\], betas=\[0.0, 0.9\] \(lr=-0.45\)",
    ),
    (
        convert.from_aggmo,
        {"lr": [0.5, -0.25], "betas": [0.0, 0.5]},
        r"must be > 0; .*\(lr=0\)",  # alpha = 0 but theta moves: no QHM
    ),
    (
        convert.from_aggmo,
        {"lr": [0.1, -0.3], "betas": [0.0, 0.0]},
        r"AggMo step sum\(lr\) / len\(betas\) must be >= 0 when every discount is 0; "
        r"received lr=\[0.1, -0.3\], betas=\[0.0, 0.0\] \(step=-0.1\)",
    ),
    (
        convert.aggmo_effective_lr,
        {"lr": 0.1, "betas": [0.0, 0.9, 1.0]},
        r"betas\[2\] must be in \[0, 1\); received betas\[2\]=1.0",
    ),
    (
        convert.aggmo_effective_lr,
        {"lr": [0.1, -0.1], "betas": [0.0, 0.9]},
        r"effective step size .* must be >= 0; received .*\(effective lr=-0.45\)",
    ),
    (
        convert.aggmo_effective_lr,
        {"lr": -1.0, "betas": [0.0, 0.9, 0.99]},
        r"lr must be in \[0, inf\); received lr=-1.0",
    ),
]


@pytest.mark.parametrize(("fn", "kwargs", "message"), ERRORS, ids=[m[:40] for *_, m in ERRORS])
def test_precondition_errors(fn: Callable[..., Any], kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fn(**kwargs)


def test_non_numbers_are_type_errors() -> None:
    with pytest.raises(TypeError, match="lr must be a real number"):
        convert.from_sgd("0.1")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"^momentum must be a real number; received momentum=True$"
    ):
        convert.from_momentum(0.1, True)


def test_aggmo_argument_types() -> None:
    import numpy as np

    with pytest.raises(TypeError, match=r"^lr must be a real number; received lr='0.1'$"):
        convert.from_aggmo("0.1", [0.9])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"betas must be a non-empty sequence"):
        convert.from_aggmo(0.1, "0.9")
    with pytest.raises(
        TypeError, match=r"^betas\[0\] must be a real number; received betas\[0\]=True$"
    ):
        convert.from_aggmo(0.1, [True])
    with pytest.raises(TypeError, match=r"^lr\[1\] must be a real number"):
        convert.from_aggmo([0.1, None], [0.0, 0.9])  # type: ignore[list-item]
    # NumPy vectors and scalars are fine; -0.0 is the discount 0.
    p = convert.from_aggmo(np.float32(0.5), np.array([0.0, 0.5]))
    assert p == QHMParams(0.75, 0.5 / 0.75, 0.5) and all(type(v) is float for v in p)
    assert convert.from_aggmo(np.array([0.1, 0.2]), (-0.0, 0.5)) == convert.from_aggmo(
        [0.1, 0.2], (0.0, 0.5)
    )
    assert convert.aggmo_effective_lr(np.float64(0.1), np.array([0.0, 0.9])) == approx(0.55)


def test_numpy_scalars_are_accepted() -> None:
    import numpy as np

    p = convert.from_momentum(np.float32(0.5), np.float64(0.5))
    assert p == QHMParams(1.0, 1.0, 0.5) and all(type(v) is float for v in p)


# ------------------------------------------------------------------ round trips
lrs = st.floats(1e-4, 10.0)
nus = st.floats(-2.0, 3.0)
betas = st.floats(0.05, 0.995)


@settings(max_examples=200, deadline=None)
@given(alpha=lrs, nu=nus, beta=betas)
def test_round_trip_qhm_snv_qhm(alpha: float, nu: float, beta: float) -> None:
    # App. C.4: QHM is SNV with gamma = alpha (1 - beta), beta1 = beta,
    # beta2 = (1 - nu) beta / (1 - beta).
    p = convert.from_synthesized_nesterov(alpha * (1 - beta), beta, (1 - nu) * beta / (1 - beta))
    assert p == approx(QHMParams(alpha, nu, beta), rel=1e-9, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(alpha=lrs, nu=nus.filter(lambda v: abs(v) > 1e-3), beta=betas)
def test_round_trip_qhm_pid_qhm(alpha: float, nu: float, beta: float) -> None:
    # App. C.3: k_p = -alpha nu beta / (1 - beta), k_i = alpha,
    # k_d = alpha nu beta^2 / (1 - beta)^2.
    k_p = -alpha * nu * beta / (1 - beta)
    k_d = alpha * nu * beta**2 / (1 - beta) ** 2
    p = convert.from_pid(k_p, alpha, k_d, beta=beta)
    assert p == approx(QHMParams(alpha, nu, beta), rel=1e-9, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(alpha=lrs, nu=st.floats(0.0, 0.95), beta=betas, eps=st.floats(0.05, 0.95))
def test_round_trip_qhm_accsgd_qhm(alpha: float, nu: float, beta: float, eps: float) -> None:
    # App. C.5: delta = alpha (1 - nu), kappa = (beta + eps)(eps nu + 1) / ((1 - nu)(1 - beta)),
    # xi = (eps nu + 1) / (eps (1 - nu)); valid only where AccSGD's xi <= sqrt(kappa).
    delta = alpha * (1 - nu)
    kappa = (beta + eps) * (eps * nu + 1) / ((1 - nu) * (1 - beta))
    xi = (eps * nu + 1) / (eps * (1 - nu))
    if kappa <= 1 or xi > math.sqrt(kappa):
        with pytest.raises(ValueError, match=r"kappa|xi"):
            convert.from_accsgd(delta, kappa, xi, eps)
        return
    p = convert.from_accsgd(delta, kappa, xi, eps)
    assert p == approx(QHMParams(alpha, nu, beta), rel=1e-9, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(
    alpha=lrs,
    nu=nus.filter(lambda v: abs(v) > 1e-3),
    beta=betas,
    c=st.floats(0.1, 10.0) | st.floats(-10.0, -0.1),
    d=st.floats(-2.0, 2.0),
)
def test_round_trip_qhm_two_state_qhm(
    alpha: float, nu: float, beta: float, c: float, d: float
) -> None:
    # QHM in the coordinates a = c g + d theta is a general TSO (q != 1, k m != 0).
    m = -alpha * nu * beta / c
    q = 1 + alpha * nu * beta * d / c
    z = -alpha * (1 - nu * beta)
    tso = {
        "h": beta + d * m,
        "k": d * (q - beta),
        "l": c * (1 - beta) + d * z,
        "m": m,
        "q": q,
        "z": z,
    }
    assert convert.from_two_state_optimizer(**tso) == approx(
        QHMParams(alpha, nu, beta), rel=1e-7, abs=1e-7
    )
    # g_0 = (a_0 - d theta_0) / c
    assert convert.two_state_initial_buffer(**tso) == approx((1 / c, -d / c), rel=1e-7, abs=1e-7)


@settings(max_examples=200, deadline=None)
@given(alpha=lrs, nu=nus.filter(lambda v: abs(v) > 1e-3), beta=betas)
def test_round_trip_qhm_extended_aggmo_qhm(alpha: float, nu: float, beta: float) -> None:
    # App. H: extended AggMo with betas [0, beta] and rates
    # [2 alpha (1 - nu), 2 alpha nu (1 - beta)] is QHM.
    rates = [2 * alpha * (1 - nu), 2 * alpha * nu * (1 - beta)]
    p = convert.from_aggmo(rates, [0.0, beta])
    assert p == approx(QHMParams(alpha, nu, beta), rel=1e-9, abs=1e-9)


# ------------------------------------------------- float64 range (extreme inputs)
def test_pid_tiny_gains_convert_without_zero_division() -> None:
    # k_p**2 and k_d * k_i underflow to 0; the ratio is -1.
    assert convert.from_pid(1e-170, 1e-170, -1e-170) == QHMParams(1e-170, -1.0, 0.5)
    # k_d - k_p overflows; k_d / (k_d - k_p) is 0.5.
    assert convert.from_pid(1e308, 1.0, -1e308).momentum == 0.5


def test_accsgd_near_float64s_largest_delta_converts() -> None:
    # delta * eps overflowed in between; the QHM lr, 1.647e308, is finite.
    delta, kappa, xi, eps = 1e308, 10.0, 3.0, 0.7
    exact = Fraction(delta) * Fraction(eps) * (1 + Fraction(xi)) / (1 + Fraction(eps))
    assert convert.from_accsgd(delta, kappa, xi, eps).lr == float(exact)


def test_a_computed_bound_is_shown_with_every_digit_it_needs() -> None:
    # Six digits printed sqrt(10) as 3.16228, a range that seemed to hold 3.162278.
    message = "xi must be in (0, 3.1622776601683795]; received xi=3.162278"
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        convert.from_accsgd(0.1, 10.0, 3.162278)
    assert validation.format_bound(1e-08) == "1e-08" and validation.format_bound(0.0) == "0"
    # The implied momentum too: 1.0000001000000003 printed as 1 read as in range.
    with pytest.raises(ValueError, match=r"\(momentum=1\.0000001000000003\)$"):
        convert.from_two_state_optimizer(1.0000001, 0, 0, 0, 1, 0)


def test_pid_momentum_rounding_to_one_names_the_gains() -> None:
    with pytest.raises(
        ValueError, match=r"^k_p, k_i and k_d give a momentum that rounds to 1 in float64; "
    ):
        convert.from_pid(-1e-20, 1.0, 1.0)


def test_an_pid_tiny_r_converts_without_zero_division() -> None:
    assert convert.from_an_pid(5e-324, 0, 0.5) == QHMParams(1e-323, 1.0, 0.5)
    with pytest.raises(ValueError, match=r"^r, k_d and beta give a QHM nu that overflows"):
        convert.from_an_pid(5e-324, 1.0, 0.5)


@pytest.mark.parametrize(
    "fn", [convert.from_robust_momentum, convert.from_triple_momentum], ids=lambda f: f.__name__
)
def test_huge_kappa_names_l_and_kappa(fn: Callable[..., Any]) -> None:
    with pytest.raises(ValueError, match=r"^l and kappa give a momentum that rounds to 1"):
        fn(1, 1e40)


@pytest.mark.parametrize(
    "fn", [convert.from_robust_momentum, convert.from_triple_momentum], ids=lambda f: f.__name__
)
def test_tiny_l_names_l_and_kappa_not_alpha(fn: Callable[..., Any]) -> None:
    with pytest.raises(ValueError, match=r"^l and kappa give a QHM lr that overflows float64"):
        fn(l=5e-324, kappa=10)


def test_overflowing_results_name_the_arguments() -> None:
    with pytest.raises(ValueError, match=r"^lr and momentum give a QHM lr that overflows"):
        convert.from_momentum(1e308, 0.999)
    with pytest.raises(ValueError, match=r"^alpha, beta1 and beta2 give a QHM nu that overflows"):
        convert.from_synthesized_nesterov(1e-8, 5e-324, 2.0)
    with pytest.raises(ValueError, match=r"^delta, kappa, xi and eps give a momentum that rounds"):
        convert.from_accsgd(1e-8, 1e40, 0.9, 1e-170)
    with pytest.raises(ValueError, match=r"^lr and betas give a QHM lr that overflows"):
        convert.from_aggmo(1e308, [0.999999])
    with pytest.raises(ValueError, match=r"^lr and betas give an effective lr that overflows"):
        convert.aggmo_effective_lr(1e308, [1e-8, 0.999999])
    tso = {"h": 1.0, "k": 1 - 2**-53, "l": 1 - 2**-53, "m": -5e-324, "q": 0.9, "z": -0.0}
    with pytest.raises(ValueError, match=r"^h, k, l, m, q and z give a theta_scale that overflows"):
        convert.two_state_initial_buffer(**tso)


def test_two_state_underflowing_lr_times_momentum_is_no_zero_division() -> None:
    # alpha * beta underflowed to 0 in nu = anb / (alpha * beta).
    tso = {"h": 1e-08, "k": 0.3, "l": 0.3, "m": 5e-324, "q": 1 - 2**-53, "z": -5e-324}
    p = convert.from_two_state_optimizer(**tso)
    assert p.lr == 5e-324 and p.momentum == approx(1e-8)


def test_aggmo_sums_that_overflow_in_between() -> None:
    # fsum raised OverflowError ("intermediate overflow") on these.
    assert convert.aggmo_effective_lr(1e308, [-0.0, 0.0, 0.5]) == approx(1.3333333333333333e308)
    assert convert.from_aggmo([1e308, 1e308], [0.0, 0.0]) == QHMParams(1e308, 0.0, 0.0)
    # lr / (1 - beta) terms of opposite signs, each inf: the exact sum is finite.
    assert convert.aggmo_effective_lr([1e308, -1e308], [0.999, 0.999]) == 0.0


_LARGEST = Fraction(sys.float_info.max)
#: Each conversion in exact arithmetic (the paper's appendix C formulas):
#: (lr, nu, momentum) from the arguments.
_EXACT = {
    "from_accsgd": lambda d, k, x, e: (
        d * e * (1 + x) / (1 + e),
        (e * x - 1) / (e * (1 + x)),
        (k - e * e * x) / (k + e * x),
    ),
    "from_an_pid": lambda r, kd, b: (r / (1 - b), 1 + kd * (1 - b) ** 2 / (r * b), b),
    "from_synthesized_nesterov": lambda a, b1, b2: (
        (a / (1 - b1), 1 - (1 - b1) * b2 / b1, b1) if b1 else (a, Fraction(0), Fraction(0))
    ),
    "from_momentum": lambda lr, mu: (lr / (1 - mu), Fraction(1), mu),
    "from_pid": lambda kp, ki, kd: (ki, kp * kp / (kd * ki), kd / (kd - kp)),
}


@pytest.mark.parametrize("name", list(_EXACT))
def test_a_result_is_refused_as_unrepresentable_only_when_it_is(name: str) -> None:
    # from_accsgd refused delta=1e308 as overflowing where its lr, 1.647e308,
    # is finite: each refusal for float64's range is held to the exact values.
    rng = random.Random(0)
    scales = [5e-324, 1e-310, 1e-170, 1e-10, 0.3, 0.7, 0.9, 0.999, 1 - 2**-53, 2.0, 10.0]
    scales += [1e10, 1e154, 1e200, 1e300, 1e308, 1.7e308]
    fn, exact = getattr(convert, name), _EXACT[name]
    arity = len(inspect.signature(exact).parameters)
    for _ in range(3000):
        args = [
            rng.choice(scales) * rng.choice([1, 1, -1])
            if rng.random() < 0.7
            else rng.uniform(-5, 5)
            for _ in range(arity)
        ]
        try:
            fn(*args)
            continue
        except ValueError as error:
            message = str(error)
        if not re.search("overflows|not representable|rounds to 1", message):
            continue
        try:
            lr, nu, momentum = exact(*map(Fraction, args))
        except ZeroDivisionError:
            continue
        representable = all(abs(v) <= _LARGEST for v in (lr, nu, momentum))
        assert not (representable and float(momentum) < 1.0), (args, message)


_EXTREMES = [0.0, -0.0, 5e-324, -5e-324, 1e-170, -1e-170, 0.5, 0.9, 1 - 2**-53, 1.0]
_EXTREMES += [2.0, -1.0, 1e40, -1e40, 1e308, -1e308]
_reals = st.one_of(st.sampled_from(_EXTREMES), st.floats(allow_nan=False, allow_infinity=False))
_rate_lists = st.lists(_reals, min_size=1, max_size=4)
_SEQUENCE_ARGS = {"betas", "lr"}


def _public_conversions() -> list[str]:
    return [n for n in convert.__all__ if n[0].islower()]


def test_property_covers_every_public_conversion() -> None:
    # The property below draws every argument from the signature: nothing is skipped.
    assert len(_public_conversions()) == 18


@settings(max_examples=600, deadline=None)
@given(data=st.data(), name=st.sampled_from(_public_conversions()))
def test_property_conversion_returns_valid_params_or_names_an_argument(
    data: Any, name: str
) -> None:
    fn = getattr(convert, name)
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {}
    for p in params.values():
        if p.default is not inspect.Parameter.empty and not data.draw(st.booleans(), label=p.name):
            continue
        if p.name == "nesterov":
            kwargs[p.name] = data.draw(st.booleans(), label=p.name)
        elif name in ("from_adam", "from_nadam", "from_lion") and p.name == "betas":
            kwargs[p.name] = (data.draw(_reals), data.draw(_reals))
        elif "aggmo" in name and p.name == "betas":
            kwargs[p.name] = data.draw(_rate_lists, label=p.name)
        elif "aggmo" in name and p.name == "lr":
            kwargs[p.name] = data.draw(st.one_of(_reals, _rate_lists), label=p.name)
        else:
            kwargs[p.name] = data.draw(_reals, label=p.name)
    try:
        result = fn(**kwargs)
    except ValueError as e:
        assert any(re.search(rf"\b{n}\b", str(e)) for n in params), str(e)
        return
    if isinstance(result, QHMParams):
        assert all(type(v) is float and math.isfinite(v) for v in result)
        assert result.lr >= 0 and 0 <= result.momentum < 1
        validation.check_qhm(**result.as_kwargs())
    elif isinstance(result, QHAdamParams):
        validation.check_qhadam(
            lr=result.lr,
            beta1=result.betas[0],
            beta2=result.betas[1],
            nu1=result.nus[0],
            nu2=result.nus[1],
            eps=result.eps,
        )
    elif isinstance(result, convert.QHMuonParams):
        assert all(type(v) is float and math.isfinite(v) for v in result)
        assert 0 <= result.momentum < 1
    elif isinstance(result, convert.SignQHMParams):
        assert all(type(v) is float and math.isfinite(v) for v in result)
        assert result.lr >= 0 and 0 <= result.momentum < 1
        validation.check_qhm(lr=result.lr, momentum=result.momentum, nu=result.nu)
    elif isinstance(result, convert.TwoStateInitialBuffer):
        assert all(math.isfinite(v) for v in result)
    else:  # aggmo_effective_lr
        assert type(result) is float and 0 <= result < math.inf
