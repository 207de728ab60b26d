r"""Conversions from other optimizers' hyperparameters to QHM / QHAdam.

Every function takes a source algorithm's hyperparameters *under that
algorithm's own definition* and returns the QHM (:class:`QHMParams`) or QHAdam
(:class:`QHAdamParams`) hyperparameters whose trajectory is the same. Each
function checks its preconditions and raises :class:`ValueError` naming the
argument, the allowed range or condition and the value received, e.g.::

    ValueError: momentum must be in [0, 1); received momentum=1.2

Arguments each in range whose result does not fit in float64 (a momentum that
rounds to 1, a learning rate that overflows) are a :class:`ValueError` naming
those arguments and why, e.g. ``k_p, k_i and k_d give a momentum that rounds
to 1 in float64``; intermediate quantities are computed so that they neither
overflow nor underflow where the result itself is representable.

QHM (Ma & Yarats, 2019, "Quasi-hyperbolic momentum and Adam for deep
learning", ICLR, Sec. 3) uses a *normalized* momentum buffer:

.. math::

    g_{t+1} = \beta g_t + (1 - \beta) \nabla_t, \qquad
    \theta_{t+1} = \theta_t - \alpha \left[(1 - \nu) \nabla_t + \nu g_{t+1}\right]

Which are exact and which are not
---------------------------------
*Exact* conversions reproduce the source trajectory to rounding error from
the usual initial state (zero buffers). The QHAdam conversions of NAdam and
RMSProp hold only *modulo bias correction*: exactly when both sides drop their
bias corrections (``qhoptim.reference.QHAdam.step(..., bias_correction=False)``).
:func:`aggmo_effective_lr` is not a conversion at all but the paper's
*heuristic* for Aggregated Momentum settings that no QHM reproduces.

Every formula here was checked against a naive implementation of the source
algorithm written from its own paper (``conformance/sources.py``); where the
printed formula of Ma & Yarats (2019) disagreed with the numbers, the numbers
won -- see ``docs/conversions.md``, section "Errata".

This module imports only :mod:`math` and :mod:`qhoptim.validation`.
"""

# ruff: noqa: E741  (l is the papers' name: the smoothness constant L, TSO's l)

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple, cast

from qhoptim import validation

__all__ = [
    "QHAdamParams",
    "QHMParams",
    "QHMuonParams",
    "SignQHMParams",
    "TwoStateInitialBuffer",
    "aggmo_effective_lr",
    "from_accsgd",
    "from_adam",
    "from_aggmo",
    "from_an_pid",
    "from_lion",
    "from_momentum",
    "from_muon",
    "from_nadam",
    "from_nesterov",
    "from_pid",
    "from_rmsprop",
    "from_robust_momentum",
    "from_sgd",
    "from_synthesized_nesterov",
    "from_triple_momentum",
    "from_two_state_optimizer",
    "two_state_initial_buffer",
]

# Relative tolerance for the equality conditions (a unit eigenvalue, a D-term
# filter equal to the implied momentum): inputs are usually computed in floats.
_RTOL = 1e-9


class QHMParams(NamedTuple):
    """QHM hyperparameters: ``lr`` (alpha), ``nu`` and ``momentum`` (beta)."""

    lr: float
    nu: float
    momentum: float

    def as_kwargs(self) -> dict[str, float]:
        """``{"lr": ..., "momentum": ..., "nu": ...}``, e.g. ``QHM(params, **p.as_kwargs())``."""
        return {"lr": self.lr, "momentum": self.momentum, "nu": self.nu}


class QHAdamParams(NamedTuple):
    """QHAdam hyperparameters: ``lr``, ``betas = (beta1, beta2)``, ``nus = (nu1, nu2)``, ``eps``."""

    lr: float
    betas: tuple[float, float]
    nus: tuple[float, float]
    eps: float

    def as_kwargs(self) -> dict[str, float | tuple[float, float]]:
        """``{"lr": ..., "betas": ..., "nus": ..., "eps": ...}``."""
        return {"lr": self.lr, "betas": self.betas, "nus": self.nus, "eps": self.eps}


class QHMuonParams(NamedTuple):
    """QHMuon's momentum settings: ``nu`` and ``momentum`` (beta); the learning
    rate and the orthogonalization stay the Muon's."""

    nu: float
    momentum: float

    def as_kwargs(self) -> dict[str, float]:
        """``{"momentum": ..., "nu": ...}``, e.g. ``QHMuon(params, lr=0.02, **p.as_kwargs())``."""
        return {"momentum": self.momentum, "nu": self.nu}


class SignQHMParams(NamedTuple):
    r"""The settings of *sign-QHM*: :math:`\theta_{t+1} = \theta_t - \alpha\,
    \mathrm{sign}\left[(1 - \nu) \nabla_t + \nu g_{t+1}\right]` with QHM's buffer
    :math:`g`. Not a QHM (the sign is taken), so there is no ``as_kwargs``."""

    lr: float
    nu: float
    momentum: float


class TwoStateInitialBuffer(NamedTuple):
    """QHM's initial buffer for a two-state optimizer.

    ``g_0 = a_scale * a_0 + theta_scale * theta_0``; see :func:`two_state_initial_buffer`.
    """

    a_scale: float
    theta_scale: float


# ----------------------------------------------------------------------- checks
def _real(value: float, name: str) -> float:
    """``value`` as a finite float (a concrete real number is required here)."""
    x = validation.require_real(value, name)
    validation.check_finite(value, name)
    return x


def _checked(check: Callable[[float, str], object], value: float, name: str) -> float:
    """``value`` as a float, checked by a :mod:`qhoptim.validation` range check.

    The range check alone decides NaN and infinities, so a bad value reads as
    it does in every backend (``lr must be in [0, inf); received lr=inf``).
    """
    x = validation.require_real(value, name)
    check(value, name)
    return x


def _interval(
    value: float,
    name: str,
    low: float,
    high: float,
    *,
    low_closed: bool = True,
    high_closed: bool = False,
) -> float:
    """``value`` as a float, checked to lie in the interval (validation's wording)."""
    x = validation.require_real(value, name)
    validation.check_interval(
        value, name, low, high, low_closed=low_closed, high_closed=high_closed
    )
    return x


def _received(**values: object) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def _momentum_in_range(beta: float, how: str, **values: object) -> float:
    """The implied QHM momentum must satisfy QHM's ``0 <= momentum < 1``."""
    if not 0.0 <= beta < 1.0:
        raise ValueError(
            f"the QHM momentum {how} must be in [0, 1); "
            f"received {_received(**values)} (momentum={validation.format_bound(beta)})"
        )
    return beta


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _RTOL * max(1.0, abs(a), abs(b))


def _has_eigenvalue_one(h: float, k: float, m: float, q: float) -> bool:
    """Whether ``[[h, k], [m, q]]`` has an eigenvalue within 1e-9 of 1.

    With eigenvalues ``1 + e`` and ``b``, ``det(M - I) = e (b - 1)`` and
    ``trace(M) - 2 = e + b - 1``: ``e`` is ``det(M - I) / (trace(M) - 2)`` to
    first order. An eigenvalue ``1 - 1e-9`` moves a mode by a factor ``e`` in
    a billion steps, which no training run tells from 1. A tolerance on the
    determinant alone would not do: its two terms can both be far below any
    fixed tolerance (``h = q = 1 - 3e-5``, ``k = m = 0``: eigenvalues 1 - 3e-5,
    whose QHM drifts 3% from the optimizer), or differ by all they are where
    the eigenvalue is 1 but for a rounding (``q`` rounded to 1.0, ``k m`` of
    1e-187).
    """
    det = (1 - h) * (1 - q) - k * m
    return abs(det) <= _RTOL * abs(2 - h - q)


def _qhm(lr: float, nu: float, momentum: float) -> QHMParams:
    # Safety net: every returned triple is valid for QHM.
    validation.check_qhm(lr=lr, momentum=momentum, nu=nu)
    return QHMParams(float(lr), float(nu), float(momentum))


# ------------------------------------------------------ float64 range handling
def _product(values: Iterable[float]) -> tuple[float, int]:
    """``prod(values)`` as ``(mantissa, exponent)``, multiplied left to right.

    Scaling by powers of two is exact, so wherever the plain product stays in
    the normal range this rounds exactly as it does; elsewhere it neither
    overflows nor underflows.
    """
    mant, exp = 1.0, 0
    for x in values:
        m, e = math.frexp(x)
        mant, e2 = math.frexp(mant * m)
        exp += e + e2
    return mant, exp


def _ratio(nums: Sequence[float], dens: Sequence[float] = ()) -> float:
    """``prod(nums) / prod(dens)`` without spurious over- or underflow in between.

    Equal, bit for bit, to the plain expression wherever its intermediate
    products stay in float64's normal range; ``±inf`` if the true quotient
    overflows, ``nan`` for ``0 / 0``.
    """
    n_mant, n_exp = _product(nums)
    d_mant, d_exp = _product(dens)
    if d_mant == 0.0:
        return math.nan if n_mant == 0.0 else math.copysign(math.inf, n_mant)
    try:
        return math.ldexp(n_mant / d_mant, n_exp - d_exp)
    except OverflowError:
        return math.copysign(math.inf, n_mant / d_mant)


def _to_float(x: Fraction) -> float:
    """An exact value rounded to float64 (``±inf`` if it overflows)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _names(names: Sequence[str]) -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _unrepresentable(what: str, value: float, /, **values: object) -> ValueError:
    """Arguments in range whose result is not a float64: say which and why."""
    why = "overflows float64" if math.isinf(value) else "is not representable in float64"
    return ValueError(
        f"{_names(list(values))} give {what} that {why} ({what.split()[-1]}={value:g}); "
        f"received {_received(**values)}"
    )


def _rounds_to_one(how: str = "", /, **values: object) -> ValueError:
    return ValueError(
        f"{_names(list(values))} give a momentum that rounds to 1 in float64{how}; "
        f"received {_received(**values)}"
    )


def _finish(lr: float, nu: float, momentum: float, /, **values: object) -> QHMParams:
    """The QHM triple computed from the arguments ``values``, checked to be a float64 QHM.

    The arguments were each checked already; what is left is a result that
    overflows or a momentum that rounds to 1, reported against those arguments.
    """
    if momentum >= 1.0:
        raise _rounds_to_one(**values)
    if not math.isfinite(lr):
        raise _unrepresentable("a QHM lr", lr, **values)
    if not math.isfinite(nu):
        raise _unrepresentable("a QHM nu", nu, **values)
    return _qhm(lr, nu, momentum)


# ------------------------------------------------------------------ SGD family
def from_sgd(lr: float) -> QHMParams:
    r"""Plain SGD :math:`\theta_{t+1} = \theta_t - \alpha \nabla_t` as QHM (exact).

    Source: Robbins & Monro (1951); Ma & Yarats (2019), Sec. 2 and Table 1.
    Formula: :math:`\alpha = \mathrm{lr}`, :math:`\nu = 0`. With :math:`\nu = 0`
    QHM never reads its buffer, so *any* :math:`\beta \in [0, 1)` works; this
    returns ``momentum = 0.0``.

    Preconditions: ``lr >= 0``.
    """
    return _qhm(_checked(validation.check_lr, lr, "lr"), 0.0, 0.0)


def _heavy_ball(lr: float, momentum: float, nu: float | None) -> QHMParams:
    lr = _checked(validation.check_lr, lr, "lr")
    momentum = _checked(validation.check_beta, momentum, "momentum")
    nu_ = 1.0 if nu is None else momentum
    return _finish(lr / (1 - momentum), nu_, momentum, lr=lr, momentum=momentum)


def from_momentum(lr: float, momentum: float) -> QHMParams:
    r"""Heavy-ball momentum with ``torch.optim.SGD`` semantics as QHM (exact).

    Source: Polyak (1964) in the unnormalized form of Sutskever et al. (2013),
    as ``torch.optim.SGD(lr, momentum, dampening=0, nesterov=False)`` defines it:
    :math:`b_{t+1} = \mu b_t + \nabla_t`, :math:`\theta_{t+1} = \theta_t - \eta b_{t+1}`.
    Ma & Yarats (2019), Sec. 2, Sec. 7.1 ("Practical suggestions").

    Formula: the unnormalized buffer is :math:`b = g / (1 - \beta)`, so

    .. math:: \alpha = \frac{\eta}{1 - \mu}, \quad \nu = 1, \quad \beta = \mu

    e.g. ``from_momentum(0.1, 0.9) == QHMParams(lr=1.0, nu=1.0, momentum=0.9)``
    (up to rounding). Only ``dampening=0`` is covered: torch seeds the buffer
    with the undampened first gradient.

    Preconditions: ``lr >= 0``; ``0 <= momentum < 1``.
    """
    return _heavy_ball(lr, momentum, None)


def from_nesterov(lr: float, momentum: float) -> QHMParams:
    r"""Nesterov's accelerated gradient with ``torch.optim.SGD(nesterov=True)`` semantics (exact).

    Source: Nesterov (1983) in the form of Sutskever et al. (2013) as
    ``torch.optim.SGD`` implements it: :math:`b_{t+1} = \mu b_t + \nabla_t`,
    :math:`\theta_{t+1} = \theta_t - \eta (\nabla_t + \mu b_{t+1})`.
    Ma & Yarats (2019), Sec. 4.1 (NAG is QHM with :math:`\nu = \beta`).

    Formula:

    .. math:: \alpha = \frac{\eta}{1 - \mu}, \quad \nu = \mu, \quad \beta = \mu

    Preconditions: ``lr >= 0``; ``0 <= momentum < 1`` (``dampening=0``).
    """
    return _heavy_ball(lr, momentum, 0.0)


# ------------------------------------------------------------------------- PID
def from_pid(k_p: float, k_i: float, k_d: float, *, beta: float | None = None) -> QHMParams:
    r"""Recht's PID control optimizer as QHM (exact).

    Source: B. Recht (2018), "The best things in life are model free", arg min
    blog (PID control view of gradient methods), in the form of Ma & Yarats
    (2019), Sec. 4.2 and App. B/C.3, with error :math:`e_t = -\nabla_t` and a
    low-pass-filtered D term:

    .. math::

        v_t = \beta v_{t-1} + (1-\beta)(e_t - e_{t-1}), \quad
        w_t = w_{t-1} + e_t, \quad
        \theta_{t+1} = \theta_0 + k_P e_t + k_I w_t + k_D v_t

    Formula (App. C.3, verified numerically):

    .. math::

        \alpha = k_I, \quad \nu = \frac{k_P^2}{k_D k_I}, \quad
        \beta = \frac{k_D}{k_D - k_P}

    QHM recovers a PID controller only if its D-term filter discount equals
    :math:`k_D / (k_D - k_P)`; pass that discount as ``beta`` to have it
    checked. ``k_P = k_D = 0`` is plain SGD with step :math:`k_I` (``nu = 0``).

    Preconditions: finite gains; either ``k_p == k_d == 0`` and ``k_i >= 0``,
    or ``k_i > 0`` and ``k_p``, ``k_d`` nonzero with opposite signs (so that
    ``0 < k_d / (k_d - k_p) < 1``); P, D, PD and PI controllers are not
    recoverable. If given, ``beta`` must equal ``k_d / (k_d - k_p)``.
    """
    k_p, k_i, k_d = _real(k_p, "k_p"), _real(k_i, "k_i"), _real(k_d, "k_d")
    if beta is not None:
        beta = _checked(validation.check_beta, beta, "beta")
    if k_p == 0.0 and k_d == 0.0:
        return from_sgd(validation.check_lr(k_i, "k_i"))
    if k_d == 0.0:
        raise ValueError(
            "k_d must be nonzero when k_p is nonzero (a PI controller is not recoverable "
            f"by QHM); received {_received(k_p=k_p, k_d=k_d)}"
        )
    _interval(k_i, "k_i", 0.0, math.inf, low_closed=False)
    if k_d == k_p:
        raise ValueError(
            "k_p and k_d must have opposite signs so that the QHM momentum "
            f"k_d / (k_d - k_p) is in [0, 1); received {_received(k_p=k_p, k_d=k_d)}"
        )
    # Scaled by a power of two (exact): k_d - k_p cannot overflow or underflow.
    scale = -math.frexp(max(abs(k_p), abs(k_d)))[1]
    d, p = math.ldexp(k_d, scale), math.ldexp(k_p, scale)
    # Of strictly opposite signs the momentum is in (0, 1) before rounding;
    # with k_p = 0 it is 1 exactly, which the range check below reports.
    if k_p != 0.0 and (k_p < 0.0) != (k_d < 0.0) and d / (d - p) >= 1.0:
        raise _rounds_to_one(k_p=k_p, k_i=k_i, k_d=k_d)
    momentum = _momentum_in_range(
        d / (d - p), "k_d / (k_d - k_p) (k_p and k_d of opposite signs)", k_p=k_p, k_d=k_d
    )
    if beta is not None and not _close(beta, momentum):
        raise ValueError(
            f"beta (the D-term filter discount) must equal k_d / (k_d - k_p) = {momentum:.12g} "
            f"for QHM to recover the controller; received beta={beta!r}"
        )
    return _finish(k_i, _ratio([k_p, k_p], [k_d, k_i]), momentum, k_p=k_p, k_i=k_i, k_d=k_d)


def from_an_pid(r: float, k_d: float, beta: float) -> QHMParams:
    r"""The PID optimizer of An et al. (2018) as QHM (exact).

    Source: W. An, H. Wang, Q. Sun, J. Xu, Q. Dai, L. Zhang (2018), "A PID
    controller approach for stochastic optimization of deep networks", CVPR,
    Sec. 3 (the PID optimizer), in the form of Ma & Yarats (2019), App. E
    (``beta`` is An et al.'s :math:`\alpha`), :math:`e_t = -\nabla_t`:

    .. math::

        v_t = \beta v_{t-1} - (1-\beta)(e_t - e_{t-1}), \quad
        w_t = \beta w_{t-1} + r e_t, \quad
        \theta_{t+1} = \theta_t + w_t + k_D v_t

    Formula (corrected; App. E prints :math:`\nu = 1 - \ldots`, see the errata
    in ``docs/conversions.md``):

    .. math::

        \alpha = \frac{r}{1 - \beta}, \quad
        \nu = 1 + \frac{k_D (1 - \beta)^2}{r \beta}, \quad \beta = \beta

    With the D term's sign as printed (it *adds* :math:`k_D` times the filtered
    gradient difference), a positive :math:`k_D` gives :math:`\nu > 1`.

    Preconditions: ``r > 0``; ``0 < beta < 1``; ``k_d`` finite.
    """
    r = _interval(r, "r", 0.0, math.inf, low_closed=False)
    k_d = _real(k_d, "k_d")
    beta = _interval(beta, "beta", 0.0, 1.0, low_closed=False)
    nu = 1 + _ratio([k_d, (1 - beta) ** 2], [r, beta])
    return _finish(r / (1 - beta), nu, beta, r=r, k_d=k_d, beta=beta)


# ---------------------------------------------------------------- SNV, RM, TM
def from_synthesized_nesterov(alpha: float, beta1: float, beta2: float) -> QHMParams:
    r"""Lessard et al.'s synthesized Nesterov variant (SNV) as QHM (exact).

    Source: L. Lessard, B. Recht, A. Packard (2016), "Analysis and design of
    optimization algorithms via integral quadratic constraints", SIAM J. Optim.
    26(1), Sec. 6; Ma & Yarats (2019), Sec. 4.3 and App. C.4 (where ``alpha``
    is written :math:`\gamma`). With :math:`\xi_{-1} = \xi_0 = \theta_0`:

    .. math::

        \xi_{t+1} = \xi_t - \alpha \nabla L(\theta_t) + \beta_1 (\xi_t - \xi_{t-1}), \quad
        \theta_{t+1} = \xi_{t+1} + \beta_2 (\xi_{t+1} - \xi_t)

    QHM's :math:`\theta` is SNV's gradient point (:math:`y_k` in Lessard et al.).
    Formula (App. C.4, verified numerically):

    .. math::

        \alpha_{QHM} = \frac{\alpha}{1 - \beta_1}, \quad
        \nu = 1 - \frac{(1 - \beta_1) \beta_2}{\beta_1}, \quad \beta = \beta_1

    ``beta1 = 0`` is accepted only with ``beta2 = 0`` (then SNV is plain SGD).

    Preconditions: ``alpha >= 0``; ``0 <= beta1 < 1``; ``beta2`` finite.
    """
    alpha = _checked(validation.check_lr, alpha, "alpha")
    beta1 = _checked(validation.check_beta, beta1, "beta1")
    beta2 = _real(beta2, "beta2")
    if beta1 == 0.0:
        if beta2 != 0.0:
            raise ValueError(
                "beta2 must be 0 when beta1 = 0 (otherwise SNV is not a QHM); "
                f"received {_received(beta1=beta1, beta2=beta2)}"
            )
        return from_sgd(alpha)
    return _snv(alpha, beta1, beta2, alpha=alpha, beta1=beta1, beta2=beta2)


def _snv(alpha: float, beta1: float, beta2: float, /, **values: object) -> QHMParams:
    """SNV's QHM from its (unchecked) ``alpha, beta1, beta2``; errors name ``values``."""
    if beta1 >= 1.0:
        raise _rounds_to_one(**values)
    if beta1 == 0.0:  # beta2 == 0 too: gradient descent with step alpha
        return _finish(alpha, 0.0, 0.0, **values)
    return _finish(alpha / (1 - beta1), 1 - _ratio([1 - beta1, beta2], [beta1]), beta1, **values)


def from_robust_momentum(l: float, kappa: float, rho: float | None = None) -> QHMParams:
    r"""The Robust Momentum Method as QHM (exact), via SNV.

    Source: S. Cyrus, B. Hu, B. Van Scoy, L. Lessard (2018), "A robust
    accelerated optimization algorithm for strongly convex functions", American
    Control Conference (ACC): for an :math:`L`-smooth, :math:`\mu`-strongly
    convex function with :math:`\kappa = L / \mu` and a rate
    :math:`\rho \in [1 - 1/\sqrt\kappa, 1 - 1/\kappa]`,

    .. math::

        x_{k+1} = x_k + \beta_{RM} (x_k - x_{k-1}) - \alpha_{RM} \nabla f(y_k), \quad
        y_k = x_k + \gamma_{RM} (x_k - x_{k-1}),

        \alpha_{RM} = \frac{\kappa (1-\rho)^2 (1+\rho)}{L}, \quad
        \beta_{RM} = \frac{\kappa \rho^3}{\kappa - 1}, \quad
        \gamma_{RM} = \frac{\rho^3}{(\kappa - 1)(1-\rho)^2 (1+\rho)}

    This is SNV with :math:`(\alpha, \beta_1, \beta_2) = (\alpha_{RM}, \beta_{RM},
    \gamma_{RM})` (:func:`from_synthesized_nesterov`); QHM's :math:`\theta` is
    :math:`y_k`. ``rho=None`` means :math:`\rho = 1 - 1/\sqrt\kappa`.

    What was verified (``tests/test_convert.py``, ``conformance/recovery.toml``):
    at :math:`\rho = 1 - 1/\sqrt\kappa` the three parameters equal Triple
    Momentum's :math:`(1+\rho)/L`, :math:`\rho^2/(2-\rho)`,
    :math:`\rho^2/((1+\rho)(2-\rho))` (Van Scoy et al., 2018) -- the paper's
    claim that Robust Momentum recovers Triple Momentum; at
    :math:`\rho = 1 - 1/\kappa` the method is gradient descent with step
    :math:`1/L` (:math:`\nu = 0`, :math:`\alpha = 1/L`), the paper's other end
    point; on quadratics with spectrum in :math:`[\mu, L]` the iteration's
    spectral radius is at most :math:`\rho`; and closed-loop trajectories of the
    naive method and of QHM agree to rounding error.

    Preconditions: ``l > 0``; ``kappa > 1``;
    ``1 - 1/sqrt(kappa) <= rho <= 1 - 1/kappa``.
    """
    l = _interval(l, "l", 0.0, math.inf, low_closed=False)
    kappa = _interval(kappa, "kappa", 1.0, math.inf, low_closed=False)
    lo, hi = 1 - 1 / math.sqrt(kappa), 1 - 1 / kappa
    values: dict[str, object] = {"l": l, "kappa": kappa}
    if rho is None:
        rho = lo
    else:
        rho = values["rho"] = _interval(rho, "rho", lo, hi, high_closed=True)
    if rho >= 1.0:
        raise _rounds_to_one(" (the rate rho = 1 - 1/sqrt(kappa) rounds to 1)", **values)
    alpha = _ratio([kappa, (1 - rho) ** 2, 1 + rho], [l])
    beta = _ratio([kappa, rho**3], [kappa - 1])
    gamma = _ratio([rho**3], [kappa - 1, (1 - rho) ** 2, 1 + rho])
    return _snv(alpha, beta, gamma, **values)


def from_triple_momentum(l: float, kappa: float) -> QHMParams:
    r"""The Triple Momentum Method as QHM (exact), via SNV.

    Source: B. Van Scoy, R. A. Freeman, K. M. Lynch (2018), "The fastest known
    globally convergent first-order method for minimizing strongly convex
    functions", IEEE Control Systems Letters 2(1). With
    :math:`\rho = 1 - 1/\sqrt\kappa`:

    .. math::

        \xi_{k+1} = (1+\beta)\xi_k - \beta \xi_{k-1} - \alpha \nabla f(y_k), \quad
        y_k = (1+\gamma)\xi_k - \gamma \xi_{k-1}, \quad
        x_k = (1+\delta)\xi_k - \delta \xi_{k-1},

        \alpha = \frac{1+\rho}{L}, \quad \beta = \frac{\rho^2}{2-\rho}, \quad
        \gamma = \frac{\rho^2}{(1+\rho)(2-\rho)}, \quad \delta = \frac{\rho^2}{1-\rho^2}

    SNV with :math:`(\alpha, \beta_1, \beta_2) = (\alpha, \beta, \gamma)`, hence

    .. math::

        \alpha_{QHM} = \frac{\alpha}{1-\beta}, \quad
        \nu = 1 - \frac{(1-\beta)\gamma}{\beta}, \quad \beta_{QHM} = \beta

    QHM's :math:`\theta` is the gradient point :math:`y_k`, not the output
    :math:`x_k` (a different linear combination of the state). Equal to
    ``from_robust_momentum(l, kappa)`` (Ma & Yarats, 2019, Sec. 4.3).

    Preconditions: ``l > 0``; ``kappa >= 1`` (``kappa = 1`` is gradient descent
    with step ``1/l``).
    """
    l = _interval(l, "l", 0.0, math.inf, low_closed=False)
    kappa = _interval(kappa, "kappa", 1.0, math.inf)
    rho = 1 - 1 / math.sqrt(kappa)
    if rho >= 1.0:
        raise _rounds_to_one(" (the rate rho = 1 - 1/sqrt(kappa) rounds to 1)", l=l, kappa=kappa)
    alpha = (1 + rho) / l
    beta = rho**2 / (2 - rho)
    gamma = rho**2 / ((1 + rho) * (2 - rho))
    return _snv(alpha, beta, gamma, l=l, kappa=kappa)


# ---------------------------------------------------------------------- AccSGD
def from_accsgd(delta: float, kappa: float, xi: float, eps: float = 0.7) -> QHMParams:
    r"""AccSGD of Kidambi et al. (2018) as QHM (exact).

    Source: R. Kidambi, P. Netrapalli, P. Jain, S. M. Kakade (2018), "On the
    insufficiency of existing momentum schemes for stochastic optimization",
    ICLR, Algorithm 1 (and the authors' PyTorch ``AccSGD`` with ``lr = delta``,
    ``kappa``, ``xi``, ``smallConst = eps``). With
    :math:`\bar w_0 = w_0 = \theta_0`:

    .. math::

        \bar w_{t+1} = \left(1 - \tfrac{\epsilon^2 \xi}{\kappa}\right) \bar w_t
            + \tfrac{\epsilon^2 \xi}{\kappa}
              \left(w_t - \tfrac{\kappa \delta}{\epsilon} \nabla L(w_t)\right), \quad
        w_{t+1} = \tfrac{\kappa}{\kappa + \epsilon \xi} (w_t - \delta \nabla L(w_t))
            + \tfrac{\epsilon \xi}{\kappa + \epsilon \xi} \bar w_{t+1}

    (Ma & Yarats, 2019, Sec. 4.4 / App. C.5 print this rule with the two
    weights of each line swapped -- an erratum; their transition matrix and the
    conversion below are for the rule above.) Formula (App. C.5, verified
    numerically):

    .. math::

        \alpha = \frac{\delta \epsilon (1 + \xi)}{1 + \epsilon}, \quad
        \nu = \frac{\epsilon \xi - 1}{\epsilon (1 + \xi)}, \quad
        \beta = \frac{\kappa - \epsilon^2 \xi}{\kappa + \epsilon \xi}

    Preconditions: ``delta > 0``; ``kappa > 1``; ``0 < xi <= sqrt(kappa)``;
    ``0 < eps < 1`` (recommended 0.7).
    """
    delta = _interval(delta, "delta", 0.0, math.inf, low_closed=False)
    kappa = _interval(kappa, "kappa", 1.0, math.inf, low_closed=False)
    xi = _interval(xi, "xi", 0.0, math.sqrt(kappa), low_closed=False, high_closed=True)
    eps = _interval(eps, "eps", 0.0, 1.0, low_closed=False)
    return _finish(
        _ratio([delta, eps, 1 + xi], [1 + eps]),  # delta near float64's largest
        (eps * xi - 1) / (eps * (1 + xi)),
        (kappa - eps * eps * xi) / (kappa + eps * xi),
        delta=delta,
        kappa=kappa,
        xi=xi,
        eps=eps,
    )


# ------------------------------------------------------------------------- TSO
def _two_state(
    h: float, k: float, l: float, m: float, q: float, z: float
) -> tuple[float, float, float, float]:
    """Checked ``(alpha, nu, beta, alpha*nu*beta)`` of a two-state optimizer."""
    h, k, l, m, q, z = (_real(v, n) for v, n in zip((h, k, l, m, q, z), "hklmqz", strict=True))
    # theta's response to the state is governed by M = [[h, k], [m, q]]; QHM's
    # has eigenvalues {1, beta}: det(M - I) = 0 and beta = trace(M) - 1.
    if not _has_eigenvalue_one(h, k, m, q):
        raise ValueError(
            "h, k, m, q must satisfy (1 - h) * (1 - q) = k * m (the transition matrix "
            "[[h, k], [m, q]] must have an eigenvalue within 1e-9 of 1); "
            f"received {_received(h=h, k=k, m=m, q=q)}"
        )
    beta = _momentum_in_range(h + q - 1, "h + q - 1", h=h, q=q)
    # theta_t's weight on grad_{t-n} is -alpha + alpha*nu*beta**n = A + B*beta**n.
    lead, tail = _dot(m, l, 1 - h, z), _dot(1 - q, z, -m, l)
    alpha = -lead / (1 - beta)
    anb = tail / (1 - beta)
    values = {"h": h, "k": k, "l": l, "m": m, "q": q, "z": z}
    if not math.isfinite(alpha):
        raise _unrepresentable("a QHM lr", alpha, **values)
    if not math.isfinite(anb):
        raise _unrepresentable("a QHM lr * nu * momentum", anb, **values)
    if alpha < 0.0:
        raise ValueError(
            "the QHM lr -(m*l + (1 - h)*z) / (2 - h - q) must be >= 0; "
            f"received {_received(h=h, l=l, m=m, q=q, z=z)} (lr={alpha:g})"
        )
    if (alpha == 0.0 or beta == 0.0) and abs(tail) > _RTOL * max(abs(m * l), abs((1 - q) * z)):
        raise ValueError(
            "(1 - q)*z - m*l must be 0 when the QHM lr or momentum is 0 (no QHM has that "
            f"gradient response); received {_received(h=h, l=l, m=m, q=q, z=z)}"
        )
    nu = 0.0 if alpha == 0.0 or beta == 0.0 else _ratio([anb], [alpha, beta])
    if not math.isfinite(nu):
        raise _unrepresentable("a QHM nu", nu, **values)
    return alpha, nu, beta, anb


def _dot(a: float, b: float, c: float, d: float) -> float:
    """``a * b + c * d``; exact then rounded where the plain sum is not finite."""
    plain = a * b + c * d
    if math.isfinite(plain):
        return plain
    return _to_float(Fraction(a) * Fraction(b) + Fraction(c) * Fraction(d))


def from_two_state_optimizer(
    h: float, k: float, l: float, m: float, q: float, z: float
) -> QHMParams:
    r"""The general two-state optimizer (TSO) of Ma & Yarats (2019), App. D, as QHM.

    Source: Ma & Yarats (2019), App. D:

    .. math::

        a_{t+1} = h a_t + k \theta_t + l \nabla_t, \quad
        \theta_{t+1} = m a_t + q \theta_t + z \nabla_t

    QHM recovers a TSO if :math:`M = [[h, k], [m, q]]` has eigenvalue 1, i.e.
    :math:`(1-h)(1-q) = km`, and its other eigenvalue :math:`h + q - 1` is a
    valid momentum (not only then: with :math:`m = 0, q = 1` the buffer never
    reaches theta and the TSO is SGD whatever ``h``, which this refuses for
    ``h + q - 1`` outside ``[0, 1)``; :func:`from_sgd` gives it). Then
    (derived from the spectral decomposition of :math:`M`; verified
    numerically):

    .. math::

        \beta = h + q - 1, \quad
        \alpha = -\frac{m l + (1 - h) z}{1 - \beta}, \quad
        \nu = \frac{(1 - q) z - m l}{\alpha \beta (1 - \beta)}

    and QHM must start from the buffer given by :func:`two_state_initial_buffer`.
    App. D states this only under the extra conditions :math:`h - q + \phi = 0`
    and :math:`1 - l = \beta`, which force :math:`q = 1` and :math:`km = 0`; its
    printed :math:`\alpha` and :math:`\beta` agree with the above everywhere, its
    :math:`\nu` and :math:`g_0` only under those conditions (see the errata in
    ``docs/conversions.md``; e.g. AccSGD is a TSO outside them).

    Preconditions: finite coefficients; :math:`(1-h)(1-q) = km`, to within an
    eigenvalue 1e-9 from 1 (:math:`|(1-h)(1-q) - km| \le 10^{-9} |2 - h - q|`);
    ``0 <= h + q - 1 < 1``; ``alpha >= 0``; if ``alpha`` or
    ``beta`` is 0, ``(1 - q) z = m l``.
    """
    alpha, nu, beta, _ = _two_state(h, k, l, m, q, z)
    return _qhm(alpha, nu, beta)


def two_state_initial_buffer(
    h: float, k: float, l: float, m: float, q: float, z: float
) -> TwoStateInitialBuffer:
    r"""QHM's initial momentum buffer reproducing a TSO started from :math:`(a_0, \theta_0)`.

    Returns ``(a_scale, theta_scale)`` with
    :math:`g_0 = a_{\mathrm{scale}} a_0 + \theta_{\mathrm{scale}} \theta_0`:

    .. math::

        g_0 = -\frac{m a_0 + (q - 1) \theta_0}{\alpha \nu \beta}

    (Ma & Yarats, 2019, App. D, print :math:`g_0 = c\, a_0`, which is this
    formula when :math:`q = 1`.) When :math:`\alpha \nu \beta = 0` QHM's
    trajectory does not depend on :math:`g_0`; this returns ``(0.0, 0.0)`` and
    the TSO is recovered only from initial states with
    :math:`m a_0 = (1 - q) \theta_0`. Same preconditions as
    :func:`from_two_state_optimizer`.
    """
    _, _, _, anb = _two_state(h, k, l, m, q, z)
    if anb == 0.0:
        return TwoStateInitialBuffer(0.0, 0.0)
    a_scale, theta_scale = -float(m) / anb, (1 - float(q)) / anb
    for what, value in (("an a_scale", a_scale), ("a theta_scale", theta_scale)):
        if not math.isfinite(value):
            raise _unrepresentable(what, value, h=h, k=k, l=l, m=m, q=q, z=z)
    return TwoStateInitialBuffer(a_scale, theta_scale)


# ----------------------------------------------------------------------- AggMo
def _vector(value: object) -> list[Any] | None:
    """``value`` as a list if it is a sequence or a 1-d array (not a string), else ``None``."""
    if isinstance(value, (str, bytes)):
        return None
    if isinstance(value, Sequence):
        return list(value)
    if getattr(value, "ndim", None) == 1:  # a NumPy vector
        return list(cast(Iterable[Any], value))
    return None


def _aggmo_args(lr: float | Sequence[float], betas: Sequence[float]) -> list[tuple[float, float]]:
    """Checked ``(rate, discount)`` per AggMo buffer: ``lr`` is one rate or one per buffer."""
    raw_betas = _vector(betas)
    if not raw_betas:
        raise ValueError(
            f"betas must be a non-empty sequence of discount factors; received betas={betas!r}"
        )
    discounts = [
        _checked(validation.check_beta, b, f"betas[{i}]") + 0.0  # -0.0 -> 0.0
        for i, b in enumerate(raw_betas)
    ]
    k = len(discounts)
    rates_in = _vector(lr)
    if rates_in is None:
        rates = [_checked(validation.check_lr, lr, "lr")] * k  # type: ignore[arg-type]
    elif len(rates_in) == k:
        rates = [_real(r, f"lr[{i}]") for i, r in enumerate(rates_in)]
    else:
        raise ValueError(
            "lr must be one number (AggMo) or one rate per buffer (extended AggMo: "
            f"len(betas) = {k} rates); received lr={lr!r}"
        )
    return list(zip(rates, discounts, strict=True))


def _aggmo_weights(lr: float | Sequence[float], betas: Sequence[float]) -> dict[float, float]:
    """AggMo as ``{discount: weight}``: buffers of equal discount merged, zero weights dropped.

    Buffers of equal discount start at zero and see the same gradients, so they
    are equal forever: ``(1/K) sum_i lr_i g_i`` has the weight
    ``(1/K) sum_{i: beta_i = b} lr_i`` on the buffer of discount ``b``.
    """
    pairs = _aggmo_args(lr, betas)
    k = len(pairs)
    merged: dict[float, list[float]] = {}
    for rate, discount in pairs:
        merged.setdefault(discount, []).append(rate)
    weights = {b: _group_weight(rates, k) for b, rates in sorted(merged.items())}
    return {b: w for b, w in weights.items() if w != 0.0}


def _group_weight(rates: list[float], k: int) -> float:
    # n equal rates: rate * (n / k), exactly the rate when n = k (AggMo with one discount).
    if all(r == rates[0] for r in rates):
        return rates[0] * (len(rates) / k)
    try:
        return math.fsum(rates) / k
    except OverflowError:  # the sum overflows, the mean (k >= len(rates)) cannot
        return _to_float(sum(map(Fraction, rates), Fraction(0)) / k)


def from_aggmo(lr: float | Sequence[float], betas: Sequence[float]) -> QHMParams:
    r"""Aggregated Momentum (AggMo) as QHM -- exact for two buffer sets only.

    Source: J. Lucas, S. Sun, R. Zemel, R. Grosse (2019), "Aggregated Momentum:
    stability through passive damping", ICLR; as Ma & Yarats (2019), App. H
    state it (and the authors' PyTorch ``AggMo``: zero buffers, step ``lr / K``
    per buffer). ``K`` unnormalized buffers, one per discount
    :math:`\beta^{(i)}`, all starting at zero:

    .. math::

        g^{(i)}_{t+1} = \beta^{(i)} g^{(i)}_t + \nabla_t, \qquad
        \theta_{t+1} = \theta_t - \frac{1}{K} \sum_{i=1}^K \gamma^{(i)} g^{(i)}_{t+1}

    with :math:`\gamma^{(i)} = \gamma` (``lr`` a number: AggMo) or one rate per
    buffer (``lr`` a sequence of ``K`` rates: *extended* AggMo).

    Derivation. Buffers of equal discount start equal (zero) and see the same
    gradients, so they stay equal: merged, the discount :math:`b` carries the
    weight :math:`c_b = \frac{1}{K}\sum_{i:\beta^{(i)}=b} \gamma^{(i)}`, and a
    discount whose rates sum to zero is dropped. A :math:`b = 0` buffer is the
    gradient itself. What remains is a QHM exactly when its discounts are
    :math:`\{\beta\}` or :math:`\{0, \beta\}`: QHM's normalized buffer from
    :math:`g_0 = 0` is :math:`g_t = (1 - \beta) m_t` with
    :math:`m_{t+1} = \beta m_t + \nabla_t`, :math:`m_0 = 0` (by induction), so
    :math:`\theta_{t+1} = \theta_t - c_0 \nabla_t - c_\beta m_{t+1}` is QHM with

    .. math::

        \alpha = c_0 + \frac{c_\beta}{1 - \beta}, \quad
        \nu = \frac{c_\beta}{(1 - \beta) \alpha}, \quad \beta = \beta

    and no special initial buffer. :math:`\{\beta\}` alone (:math:`c_0 = 0`) is
    momentum, :math:`\nu = 1`; :math:`\{0\}` alone is SGD with step
    :math:`c_0` (returned as ``nu = 0``, ``momentum = 0``). Note that
    :math:`\alpha` is then exactly :func:`aggmo_effective_lr`. Conversely every
    QHM is extended AggMo with ``betas = [0, beta]`` and
    ``lr = [2 alpha (1 - nu), 2 alpha nu (1 - beta)]`` (App. H's remark).

    Any other set -- two nonzero discounts, or three or more distinct ones, such
    as AggMo's usual ``[0, 0.9, 0.99]`` -- mixes several geometric decays that
    one QHM buffer cannot produce: this raises ``ValueError``. The paper's
    answer for those is a heuristic, :func:`aggmo_effective_lr`, with
    :math:`\nu` and :math:`\beta` chosen by hand.

    Preconditions: ``betas`` a non-empty sequence with ``0 <= betas[i] < 1``;
    ``lr >= 0`` if a number, else ``len(betas)`` finite rates (of any sign:
    App. H lets :math:`\gamma \in \mathbb{R}^K`); after merging, at most one
    nonzero discount with a nonzero weight; the resulting ``alpha > 0`` (or
    every weight 0, giving ``QHMParams(0, 0, 0)``).
    """
    weights = _aggmo_weights(lr, betas)
    moving = [b for b in weights if b != 0.0]
    if len(moving) > 1:
        raise ValueError(
            "betas must contain at most one nonzero discount with a nonzero rate for AggMo to "
            "be a QHM (the distinct discounts, equal ones merged, must be {beta} or {0, beta}); "
            f"received betas={betas!r} (nonzero discounts with nonzero rates: "
            f"{', '.join(f'{b:g}' for b in moving)}). No QHM reproduces this AggMo; "
            "aggmo_effective_lr(lr, betas) is the paper's heuristic QHM step size for it "
            "(Ma & Yarats, 2019, App. H), not an equivalence"
        )
    c0 = weights.get(0.0, 0.0)
    if not moving:  # plain SGD with step c0 (or nothing at all)
        if c0 < 0.0:
            raise ValueError(
                "the AggMo step sum(lr) / len(betas) must be >= 0 when every discount is 0; "
                f"received lr={lr!r}, betas={betas!r} (step={c0:g})"
            )
        return _qhm(c0, 0.0, 0.0)
    beta = moving[0]
    slow = weights[beta] / (1 - beta)
    alpha = c0 + slow
    nu = slow / alpha if alpha > 0.0 else math.nan
    if not (math.isfinite(alpha) and math.isfinite(nu)):  # redo exactly, then round
        exact_slow = Fraction(weights[beta]) / Fraction(1 - beta)
        exact_alpha = Fraction(c0) + exact_slow
        alpha = _to_float(exact_alpha)
        if exact_alpha > 0:
            nu = _to_float(exact_slow / exact_alpha)
    if not alpha > 0.0:
        raise ValueError(
            "the QHM lr sum_i lr[i] / (len(betas) * (1 - betas[i])) must be > 0; "
            f"received lr={lr!r}, betas={betas!r} (lr={alpha:g})"
        )
    return _finish(alpha, nu, beta, lr=lr, betas=betas)


def aggmo_effective_lr(lr: float | Sequence[float], betas: Sequence[float]) -> float:
    r"""Ma & Yarats's *effective step size* of an AggMo setting -- a heuristic, not an equivalence.

    Source: Ma & Yarats (2019), App. H ("Parameterizing QHM"):

    .. math::

        \alpha = \frac{1}{K} \sum_{i=1}^K \frac{\gamma^{(i)}}{1 - \beta^{(i)}}

    (``lr`` a number :math:`\gamma` or one rate per buffer, as in
    :func:`from_aggmo`). For the paper's "AggMo-Best", ``lr = 0.1`` and
    ``betas = [0, 0.9, 0.99, 0.999]``, this is ``27.775``, which the paper
    rounds to ``alpha = 28`` and pairs with ``nu = 0.97``, ``beta = 0.999``
    chosen by hand ("QHM-Converted").

    What it means: on a constant gradient :math:`G`, AggMo's buffer
    :math:`i` tends to :math:`G / (1 - \beta^{(i)})`, so its step tends to
    :math:`\alpha G` -- the step every QHM with learning rate :math:`\alpha`
    tends to, whatever its :math:`\nu` and :math:`\beta`. Equivalently, both
    give every gradient the same *total* weight over all later steps. How that
    weight is spread over time differs (AggMo: a sum of ``K`` geometric decays;
    QHM: an immediate part and one decay), so trajectories differ. Only where
    :func:`from_aggmo` applies (discounts :math:`\{\beta\}` or
    :math:`\{0, \beta\}`) is this the exact QHM learning rate.

    Preconditions: as :func:`from_aggmo` for ``lr`` and ``betas`` (any set of
    discounts); the result must be ``>= 0``.
    """
    pairs = _aggmo_args(lr, betas)
    try:
        alpha = math.fsum(rate / (1 - b) for rate, b in pairs) / len(pairs)
    except (OverflowError, ValueError):  # a term or the sum overflows: redo exactly
        alpha = math.nan
    if not math.isfinite(alpha):
        exact = sum((Fraction(rate) / Fraction(1 - b) for rate, b in pairs), Fraction(0))
        alpha = _to_float(exact / len(pairs))
    if math.isinf(alpha) and alpha > 0.0:
        raise _unrepresentable("an effective lr", alpha, lr=lr, betas=betas)
    if alpha < 0.0:
        raise ValueError(
            "the effective step size sum_i lr[i] / (len(betas) * (1 - betas[i])) must be >= 0; "
            f"received lr={lr!r}, betas={betas!r} (effective lr={alpha:g})"
        )
    return alpha


# ------------------------------------------------------------------ Adam family
def _adam_args(lr: float, betas: Sequence[float], eps: float) -> tuple[float, float, float, float]:
    b1, b2 = validation.check_pair(betas, "betas")
    return (
        _checked(validation.check_lr, lr, "lr"),
        _checked(validation.check_beta, b1, "betas[0]"),
        _checked(validation.check_beta, b2, "betas[1]"),
        _checked(validation.check_eps, eps, "eps"),
    )


def from_adam(lr: float, betas: Sequence[float], eps: float) -> QHAdamParams:
    r"""Adam as QHAdam (exact, bias correction included).

    Source: D. P. Kingma, J. Ba (2015), "Adam: a method for stochastic
    optimization", ICLR, Algorithm 1 (:math:`\epsilon` added after the square
    root of the bias-corrected second moment); Ma & Yarats (2019), Sec. 5.

    Formula: same ``lr``, ``betas``, ``eps``; :math:`\nu_1 = \nu_2 = 1`.

    Preconditions: ``lr >= 0``; ``0 <= betas[i] < 1``; ``eps >= 0``.
    """
    lr, b1, b2, eps = _adam_args(lr, betas, eps)
    return QHAdamParams(lr, (b1, b2), (1.0, 1.0), eps)


def from_nadam(lr: float, betas: Sequence[float], eps: float) -> QHAdamParams:
    r"""NAdam as QHAdam -- holds only *modulo bias correction*.

    Source: T. Dozat (2016), "Incorporating Nesterov momentum into Adam", ICLR
    workshop, Algorithm 2, with a constant momentum schedule
    :math:`\mu_t = \beta_1`: the update numerator is
    :math:`(1-\beta_1) \hat\nabla_t + \beta_1 \hat m_t`. Ma & Yarats (2019), Sec. 5.

    Formula: same ``lr``, ``betas``, ``eps``; :math:`\nu_1 = \beta_1`,
    :math:`\nu_2 = 1`. Exact when both NAdam and QHAdam drop their bias
    corrections; with them, NAdam corrects the gradient by
    :math:`1 - \beta_1^t` and the buffer by :math:`1 - \beta_1^{t+1}` while QHAdam
    corrects only the buffer, by :math:`1 - \beta_1^t`, so the trajectories differ.

    Preconditions: ``lr >= 0``; ``0 <= betas[i] < 1``; ``eps >= 0``.
    """
    lr, b1, b2, eps = _adam_args(lr, betas, eps)
    return QHAdamParams(lr, (b1, b2), (b1, 1.0), eps)


def from_rmsprop(lr: float, alpha: float, eps: float) -> QHAdamParams:
    r"""RMSProp (``torch.optim.RMSprop`` naming) as QHAdam -- *modulo bias correction*.

    Source: T. Tieleman, G. Hinton (2012), "Lecture 6.5 -- RMSProp", COURSERA:
    Neural Networks for Machine Learning; ``torch.optim.RMSprop(lr, alpha, eps,
    centered=False, momentum=0)``: :math:`s_{t+1} = \alpha s_t + (1-\alpha) \nabla_t^2`,
    :math:`\theta_{t+1} = \theta_t - \eta \nabla_t / (\sqrt{s_{t+1}} + \epsilon)`.
    Ma & Yarats (2019), Sec. 5.

    Formula: :math:`\nu = (0, 1)`, :math:`\beta_2 = \alpha`; :math:`\beta_1` is
    unused when :math:`\nu_1 = 0` (any value works; this returns 0). Exact when
    QHAdam drops bias correction; with it, QHAdam divides the second moment by
    :math:`1 - \alpha^t`, which RMSProp does not.

    Preconditions: ``lr >= 0``; ``0 <= alpha < 1``; ``eps >= 0``.
    """
    lr = _checked(validation.check_lr, lr, "lr")
    alpha = _checked(validation.check_beta, alpha, "alpha")
    eps = _checked(validation.check_eps, eps, "eps")
    return QHAdamParams(lr, (0.0, alpha), (0.0, 1.0), eps)


# ------------------------------------------------------------ Muon and Lion
def from_muon(momentum: float, nesterov: bool = True) -> QHMuonParams:
    r"""Muon's momentum (``torch.optim.Muon`` semantics) as QHMuon's (exact).

    Source: K. Jordan et al. (2024), "Muon: an optimizer for hidden layers in
    neural networks", as ``torch.optim.Muon`` and ``mlx.optimizers.Muon``
    define it: :math:`B_t = \mu B_{t-1} + (1 - \mu) \nabla_t` (a ``lerp``),
    orthogonalized direction :math:`(1 - \mu) \nabla_t + \mu B_t` with
    ``nesterov=True``, :math:`B_t` without. That is QHM's direction:

    .. math:: \beta = \mu, \quad \nu = \mu \text{ (Nesterov) or } 1

    The learning rate, its shape adjustment and the Newton-Schulz iteration are
    unchanged. Keras's Muon (unnormalized buffer) gives the same direction up
    to a positive scale, which the orthogonalization removes (to its ``eps``).

    Preconditions: ``0 <= momentum < 1``; ``nesterov`` a bool.
    """
    momentum = _checked(validation.check_beta, momentum, "momentum")
    validation.check_bool(nesterov, "nesterov")
    return QHMuonParams(momentum if nesterov else 1.0, momentum)


def from_lion(lr: float, betas: Sequence[float]) -> SignQHMParams:
    r"""Lion as sign-QHM (exact): the sign of QHM's direction.

    Source: X. Chen et al. (2023), "Symbolic discovery of optimization
    algorithms", Program 1: :math:`c_t = \beta_1 m_{t-1} + (1 - \beta_1)
    \nabla_t`, :math:`\theta_t = \theta_{t-1} - \eta\,\mathrm{sign}(c_t)`,
    :math:`m_t = \beta_2 m_{t-1} + (1 - \beta_2) \nabla_t`. QHM's direction
    reads the *updated* buffer: with :math:`\beta = \beta_2`,
    :math:`(1 - \nu) \nabla_t + \nu m_t = \nu \beta_2 m_{t-1} +
    (1 - \nu \beta_2) \nabla_t`, which is :math:`c_t` for

    .. math:: \alpha = \eta, \quad \nu = \beta_1 / \beta_2, \quad \beta = \beta_2

    (Lion's defaults ``betas=(0.9, 0.99)`` give :math:`\nu = 0.909\ldots`).
    Lion's decoupled weight decay is the same on both sides.

    Preconditions: ``lr >= 0``; ``0 <= betas[i] < 1``; ``betas[1] > 0`` unless
    ``betas[0] = 0`` (then :math:`\nu = 0`: signSGD).
    """
    b1, b2 = validation.check_pair(betas, "betas")
    lr = _checked(validation.check_lr, lr, "lr")
    b1 = _checked(validation.check_beta, b1, "betas[0]")
    b2 = _checked(validation.check_beta, b2, "betas[1]")
    if b1 == 0:
        return SignQHMParams(lr, 0.0, b2)
    if b2 == 0:
        raise ValueError(
            f"betas[1] must be in (0, 1) when betas[0] > 0; received {_received(betas=betas)}"
        )
    nu = b1 / b2
    if not math.isfinite(nu):  # a subnormal betas[1]
        raise _unrepresentable("a QHM nu", nu, betas=betas)
    return SignQHMParams(lr, nu, b2)
