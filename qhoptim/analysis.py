r"""The paper's analysis of QHAdam's update bound and of the QHWMA's variance.

Pure Python (``math`` only; no NumPy), for reasoning about hyperparameters
before training. References are to Ma & Yarats, "Quasi-hyperbolic momentum and
Adam for deep learning", ICLR 2019 (arXiv:1810.06801).

**Update bound** (appendix F, "(QH)Adam's update bound", fact
``qhadam-ub``). With :math:`\epsilon = 0` and no bias correction, QHAdam's
update before the learning rate, :math:`\tilde g_{t+1} / \sqrt{\tilde s_{t+1}}`,
is built from the gradients :math:`x_0, \dots, x_t` (eqns ``qhadam-g-pre`` /
``qhadam-s-pre``)

.. math::

    \tilde g_{t+1} &= (1 - \nu_1 \beta_1) x_t
        + \nu_1 (1 - \beta_1) \textstyle\sum_{i=1}^t \beta_1^i x_{t-i} \\
    \tilde s_{t+1} &= (1 - \nu_2 \beta_2) x_t^2
        + \nu_2 (1 - \beta_2) \textstyle\sum_{i=1}^t \beta_2^i x_{t-i}^2

and, for :math:`0 < \beta_1 < \sqrt{\beta_2} < 1`, is bounded per coordinate by
the tight bound (Cauchy--Schwarz with weights :math:`a_i` of
:math:`\tilde g` and :math:`c_i` of :math:`\tilde s`:
:math:`\sup_x \tilde g^2 / \tilde s = \sum_i a_i^2 / c_i`)

.. math::

    \left|\frac{\tilde g_{t+1}}{\sqrt{\tilde s_{t+1}}}\right| \le
    \sqrt{\frac{(1 - \nu_1 \beta_1)^2}{1 - \nu_2 \beta_2}
    + \frac{[\nu_1 \beta_1 (1 - \beta_1)]^2 \,
            [1 - (\beta_1^2 / \beta_2)^t]}
           {\nu_2 (1 - \beta_2) (\beta_2 - \beta_1^2)}}

**Indexing of** ``t``: as in the paper, ``t`` is the index of the *newest*
gradient, so the bound at ``t`` covers the update computed from the ``t + 1``
gradients :math:`x_0 \dots x_t` -- i.e. the ``(t + 1)``-th optimizer step from a
zero state (``t = 0`` is the first step, whose bound is
:math:`|1 - \nu_1 \beta_1| / \sqrt{1 - \nu_2 \beta_2}`). ``t = None`` is the
:math:`t \to \infty` limit (eqn ``qhadam-ub-limit``); for Adam
(:math:`\nu_1 = \nu_2 = 1`) it is eqn ``adam-ub-limit``,
:math:`(1 - \beta_1)\sqrt{\beta_2 / ((1 - \beta_2)(\beta_2 - \beta_1^2))}`,
about 7.27 for :math:`(\beta_1, \beta_2) = (0.9, 0.999)` where Kingma & Ba
claim :math:`\max(1, (1 - \beta_1)/\sqrt{1 - \beta_2}) \approx 3.16`.

**Variance** (appendix A, fact ``qhwma-variance``, proof in appendix G
"Miscellaneous derivations"). For iid inputs with covariance :math:`\Sigma`, the
QHWMA :math:`\sum_{i=0}^t \delta_{QH}(i) x_{t-i}` with
:math:`\delta_{QH}(0) = 1 - \nu\beta`, :math:`\delta_{QH}(i) = \nu(1-\beta)\beta^i`
has covariance :math:`\rho_t \Sigma` where

.. math::

    \rho_t = (1 - \nu\beta)^2
        + \frac{[\nu \beta (1 - \beta)]^2 (1 - \beta^{2t})}{1 - \beta^2},
    \qquad \rho = \lim_{t\to\infty} \rho_t .

At :math:`\nu = 1` this is the EWMA's :math:`(1 - \beta)^2 / (1 - \beta^2)`
(fact ``ewma-variance``).

**Errata found against brute force** (see ``tests/test_analysis.py``):

- The maximizing sequence of eqn ``qhadam-ub-foc`` is indexed by the *lag*
  ``i`` of :math:`x_{t-i}`, not by the gradient index: the maximizer is
  :math:`x_{t-i} \propto \frac{\nu_1(1-\beta_1)}{\nu_2(1-\beta_2)}
  (\beta_1/\beta_2)^i` for :math:`1 \le i \le t`, and
  :math:`x_t \propto (1-\nu_1\beta_1)/(1-\nu_2\beta_2)`. Read literally
  (:math:`x_i \propto (\beta_1/\beta_2)^i` for :math:`i < t`) the sequence
  falls short of the bound for every ``t >= 1``. The bound itself is right.
- In the QHWMA definition (eqn ``qh-separation`` and the line above it) the
  undiscounted term multiplies :math:`x_t`, not :math:`x_0`.
- The claim "rho decreases with both increasing beta and increasing nu" holds
  for :math:`\nu \in (0, 1]` and :math:`\beta \in (0, 1)`; for
  :math:`\beta < 0` (allowed in appendix A) rho *increases* with nu for
  :math:`\nu > (1 + \beta) / (2 \beta)` (a negative bound: every nu >= 0).
"""

from __future__ import annotations

import math
import operator

from qhoptim.validation import (
    check_beta,
    check_nu,
    check_nu2,
    format_bound,
    range_error,
    require_real,
)

__all__ = [
    "adam_update_bound",
    "ewma_variance_factor",
    "kingma_ba_claimed_bound",
    "qhadam_bound_optimal_nu2",
    "qhadam_maximizing_gradients",
    "qhadam_update_bound",
    "qhwma_variance_factor",
]

# Exponents beyond this make every ratio < 1 underflow to zero anyway; capping
# keeps ``t * log(r)`` a finite float for arbitrarily large Python ints.
_T_CAP = 2**1000

# Largest finite float64's natural log: exp of anything above it overflows.
_LOG_MAX = math.log(1.7976931348623157e308)


def _square(x: float) -> float:
    """``x ** 2``, ``inf`` where that overflows float64."""
    try:
        return x**2
    except OverflowError:
        return math.inf


def _check_t(t: object, *, allow_none: bool) -> int | None:
    """``t`` is ``None`` (the limit, if allowed) or a non-negative integer."""
    if t is None and allow_none:
        return None
    if isinstance(t, bool):
        raise TypeError(f"t must be a non-negative int; received the bool {t!r}")
    try:
        n = operator.index(t)  # type: ignore[arg-type]
    except TypeError:
        kind = "a non-negative int or None" if allow_none else "a non-negative int"
        raise TypeError(f"t must be {kind}; received t={t!r}") from None
    if n < 0:
        raise ValueError(f"t must be in [0, inf); received t={t!r}")
    return n


def _check_betas(beta1: object, beta2: object) -> tuple[float, float, float]:
    """``0 < beta1 < sqrt(beta2) < 1`` (fact qhadam-ub); returns ``(b1, b2, b2 - b1**2)``."""
    b2 = require_real(beta2, "beta2")
    if not 0.0 < b2 < 1.0:
        raise range_error("beta2", "(0, 1)", beta2)
    b1 = require_real(beta1, "beta1")
    gap = b2 - b1 * b1
    if not (0.0 < b1 < math.sqrt(b2) and gap > 0.0):
        interval = f"(0, sqrt(beta2)) = (0, {format_bound(math.sqrt(b2))})"
        raise range_error("beta1", interval, beta1)
    return b1, b2, gap


def _check_qhadam(
    nu1: object, beta1: object, nu2: object, beta2: object
) -> tuple[float, float, float, float, float]:
    n1 = require_real(check_nu(nu1, "nu1"), "nu1")
    n2 = require_real(check_nu2(nu2, "nu2"), "nu2")
    b1, b2, gap = _check_betas(beta1, beta2)
    return n1, b1, n2, b2, gap


def qhadam_update_bound(
    nu1: float, beta1: float, nu2: float, beta2: float, t: int | None = None
) -> float:
    r"""Tight bound on QHAdam's per-coordinate update :math:`|\tilde g / \sqrt{\tilde s}|`.

    Appendix F, fact ``qhadam-ub`` (finite ``t``) and eqn ``qhadam-ub-limit``
    (``t=None``), with :math:`\epsilon = 0` and no bias correction:

    .. math::

        \sqrt{\frac{(1 - \nu_1 \beta_1)^2}{1 - \nu_2 \beta_2}
        + \frac{[\nu_1 \beta_1 (1 - \beta_1)]^2 [1 - (\beta_1^2/\beta_2)^t]}
               {\nu_2 (1 - \beta_2) (\beta_2 - \beta_1^2)}}

    The bound is a supremum over all gradient sequences and is attained by
    :func:`qhadam_maximizing_gradients`. Multiply by the learning rate for the
    bound on the parameter step.

    Args:
      nu1: any finite real (as the optimizer accepts; the bound holds for all).
      beta1: ``0 < beta1 < sqrt(beta2)``, the fact's assumption.
      nu2: in ``[0, 1]``. For ``nu2 = 0`` the second-moment estimate is just
        :math:`x_t^2` and ignores the history that :math:`\tilde g` still
        sees, so the supremum is ``math.inf`` -- unless ``t = 0`` or
        ``nu1 = 0``, where no history enters :math:`\tilde g` and the formula's
        first term alone is the (finite, attained) bound.
      beta2: in ``(0, 1)``.
      t: index of the newest gradient: the update computed from the ``t + 1``
        gradients :math:`x_0 \dots x_t` (the ``(t+1)``-th step from a zero
        state). ``None`` (default) gives the :math:`t \to \infty` limit, which
        bounds every step. The finite-``t`` bound increases with ``t`` to it
        (strictly when ``nu1 != 0``).

    Returns:
      The bound as a float: ``math.inf`` for ``nu2 = 0`` (above) and wherever
      the bound exceeds float64's range (e.g. ``nu1 = 1e308``); otherwise the
      finite value, also where intermediate terms would over- or underflow
      (a tiny positive ``nu2`` such as ``5e-324`` gives a large finite bound).

    Raises:
      ValueError: a hyperparameter outside the ranges above, or ``t < 0``.
      TypeError: a non-real hyperparameter, or ``t`` not an int (or ``None``).
    """
    n1, b1, n2, b2, gap = _check_qhadam(nu1, beta1, nu2, beta2)
    steps = _check_t(t, allow_none=True)
    immediate = _square(1.0 - n1 * b1) / (1.0 - n2 * b2)
    if steps is None:
        history = 1.0
    else:
        # 1 - (beta1**2 / beta2)**t, written so it is 0 at t = 0, increases with
        # t, and stays accurate when beta1**2 / beta2 is close to 1.
        rest = gap / b2  # 1 - beta1**2 / beta2; 1 if beta1**2 / beta2 underflows
        if rest < 1.0:
            history = -math.expm1(min(steps, _T_CAP) * math.log1p(-rest))
        else:
            history = 1.0 if steps else 0.0
    weight = n1 * b1 * (1.0 - b1)
    denominator = n2 * (1.0 - b2) * gap
    if n1 == 0.0 or history == 0.0:
        bound = math.sqrt(immediate)
    elif n2 == 0.0:
        return math.inf
    elif denominator > 0.0:
        bound = math.sqrt(immediate + weight * weight * history / denominator)
    else:
        bound = math.inf  # the denominator underflowed: take the scaled route below
    if math.isfinite(bound):
        return bound
    # Squares or the denominator out of float64's range: the same bound as a
    # hypotenuse of square roots, inf only if the bound itself overflows.
    first = abs(1.0 - n1 * b1) / math.sqrt(1.0 - n2 * b2)
    if n1 == 0.0 or history == 0.0:
        return first
    second = abs(weight) * math.sqrt(history) / math.sqrt(n2) / math.sqrt(1.0 - b2)
    second /= math.sqrt(gap)
    try:
        return math.hypot(first, second)
    except OverflowError:
        return math.inf


def adam_update_bound(beta1: float, beta2: float, t: int | None = None) -> float:
    r"""Tight bound on Adam's per-coordinate update (no bias correction, :math:`\epsilon = 0`).

    :func:`qhadam_update_bound` at :math:`\nu_1 = \nu_2 = 1`; for ``t=None``
    this is appendix F's eqn ``adam-ub-limit``:

    .. math::

        (1 - \beta_1) \sqrt{\frac{\beta_2}{(1 - \beta_2)(\beta_2 - \beta_1^2)}}

    e.g. :math:`\approx 7.27` for :math:`(0.9, 0.999)` -- compare
    :func:`kingma_ba_claimed_bound`, :math:`\approx 3.16`. Requires
    ``0 < beta1 < sqrt(beta2) < 1``; ``t`` as in :func:`qhadam_update_bound`.
    """
    return qhadam_update_bound(1.0, beta1, 1.0, beta2, t)


def kingma_ba_claimed_bound(beta1: float, beta2: float) -> float:
    r"""The (incorrect) per-step bound claimed by Kingma & Ba (2015), section 2.1.

    :math:`\max(1, (1 - \beta_1) / \sqrt{1 - \beta_2})`, times the learning
    rate. Appendix F of Ma & Yarats shows it is not a bound: the tight bound is
    :func:`adam_update_bound` (7.27 vs the claimed 3.16 at ``(0.9, 0.999)``).
    Provided for comparison only. ``beta1, beta2`` in ``[0, 1)``.
    """
    b1 = require_real(check_beta(beta1, "beta1"), "beta1")
    b2 = require_real(check_beta(beta2, "beta2"), "beta2")
    return max(1.0, (1.0 - b1) / math.sqrt(1.0 - b2))


def qhadam_maximizing_gradients(
    nu1: float, beta1: float, nu2: float, beta2: float, t: int, *, normalize: bool = False
) -> list[float]:
    r"""A gradient sequence :math:`x_0 \dots x_t` (oldest first) attaining the bound.

    Appendix F, eqn ``qhadam-ub-foc``, *indexed by lag* (the paper's
    :math:`x_i` there must be read as :math:`x_{t-i}`; see the module
    docstring): :math:`x = C^{-1} a`, the weights of :math:`\tilde g` over
    those of :math:`\tilde s`,

    .. math::

        x_t = \frac{1 - \nu_1 \beta_1}{1 - \nu_2 \beta_2}, \qquad
        x_{t-i} = \frac{\nu_1 (1 - \beta_1)}{\nu_2 (1 - \beta_2)}
                  \left(\frac{\beta_1}{\beta_2}\right)^i \quad (1 \le i \le t).

    Feeding these ``t + 1`` gradients to QHAdam from a zero state
    (:math:`\epsilon = 0`, no bias correction) makes the last update equal
    :func:`qhadam_update_bound` ``(nu1, beta1, nu2, beta2, t)``. Any nonzero
    multiple attains it too; ``normalize=True`` returns the multiple whose
    largest magnitude is 1 (computed in log space, so it cannot overflow when
    ``beta1 > beta2`` and ``t`` is large). In the degenerate case ``t = 0``
    with :math:`\nu_1 \beta_1 = 1` (bound 0) the sequence ``[1.0]`` is returned.

    Raises:
      ValueError: as :func:`qhadam_update_bound`; also for ``nu2 = 0`` with
        ``nu1 != 0`` and ``t >= 1``, where the update is unbounded.
        Also when an entry overflows float64 (use ``normalize=True``, which
        never overflows).
    """
    n1, b1, n2, b2, _ = _check_qhadam(nu1, beta1, nu2, beta2)
    steps = _check_t(t, allow_none=False)
    assert steps is not None
    newest = (1.0 - n1 * b1) / (1.0 - n2 * b2)
    log_past = -math.inf
    if n1 == 0.0 or steps == 0:
        past_scale = 0.0  # no history enters g~: any past values do, zeros are simplest
    elif n2 == 0.0:
        raise ValueError(
            "the QHAdam update is unbounded for nu2=0 with nu1 != 0 and t >= 1; "
            f"no maximizing sequence exists; received nu2={n2!r}, "
            f"nu1={n1!r}, t={steps}"
        )
    else:
        # log |nu1 (1 - beta1) / (nu2 (1 - beta2))|: finite even where the ratio is not.
        log_past = math.log(abs(n1)) + math.log1p(-b1) - math.log(n2) - math.log1p(-b2)
        denominator = n2 * (1.0 - b2)
        past_scale = n1 * (1.0 - b1) / denominator if denominator else math.inf
        if not (math.isfinite(past_scale) and past_scale):
            # Out of float64's range: a sentinel (sign kept) sending the entries to log space.
            past_scale = math.copysign(math.inf, n1)
    if past_scale == 0.0 and newest == 0.0:
        return [1.0]
    log_q = math.log(b1) - math.log(b2)
    # Oldest first: x_j has lag t - j.
    if not normalize:
        try:
            xs = [past_scale * (b1 / b2) ** (steps - j) for j in range(steps)] + [newest]
        except OverflowError:
            xs = [math.inf]
        if all(math.isfinite(x) for x in xs):
            return xs
        overflow = ValueError(
            "the maximizing gradients for nu1, beta1, nu2, beta2 and t have an entry "
            "that overflows float64 (pass normalize=True); "
            f"received nu1={n1!r}, beta1={b1!r}, nu2={n2!r}, beta2={b2!r}, t={steps}"
        )
        if not math.isfinite(newest):
            raise overflow
        # Redo in log space: only an entry whose own magnitude overflows is an error.
        sign = math.copysign(1.0, past_scale)
        xs = []
        for j in range(steps):
            log_x = log_past + (steps - j) * log_q
            if log_x > _LOG_MAX:
                raise overflow
            xs.append(sign * math.exp(log_x))
        return [*xs, newest]
    logs = [log_past + (steps - j) * log_q if past_scale else -math.inf for j in range(steps)]
    # log |newest|, finite even where newest overflows.
    logs.append(math.log(abs(1.0 - n1 * b1)) - math.log1p(-n2 * b2) if newest else -math.inf)
    top = max(logs)
    signs = [math.copysign(1.0, past_scale)] * steps + [math.copysign(1.0, newest)]
    return [s * math.exp(v - top) for s, v in zip(signs, logs, strict=True)]


def qhadam_bound_optimal_nu2(nu1: float, beta1: float, beta2: float) -> tuple[float, float]:
    r"""The ``nu2`` in ``[0, 1]`` minimizing the limit bound, and that minimal bound.

    Appendix F's discussion: lowering :math:`\nu_2` below 1 "decreases the
    right-hand side of eqn qhadam-ub-limit, up to a point". Writing the squared
    bound as :math:`A / (1 - u) + C / u` with :math:`u = \nu_2 \beta_2`,
    :math:`A = (1 - \nu_1\beta_1)^2` and
    :math:`C = [\nu_1\beta_1(1-\beta_1)]^2 \beta_2 / ((1-\beta_2)(\beta_2-\beta_1^2))`,
    it is convex in :math:`u` with minimum :math:`(\sqrt A + \sqrt C)^2` at
    :math:`u^* = \sqrt C / (\sqrt A + \sqrt C)`. So
    :math:`\nu_2^* = \min(1, u^* / \beta_2)` and, when :math:`\nu_2^* < 1`,
    the minimal bound is :math:`|1 - \nu_1\beta_1| + |\nu_1|\beta_1(1-\beta_1)
    \sqrt{\beta_2 / ((1-\beta_2)(\beta_2-\beta_1^2))}`.
    For the paper's figure (``nu1=0.8, beta1=0.95, beta2=0.98``) this is
    about 1.196 at ``nu2`` about 0.816, vs 1.952 at ``nu2 = 1``.

    Returns ``(nu2_star, qhadam_update_bound(nu1, beta1, nu2_star, beta2))``.
    Preconditions as :func:`qhadam_update_bound`.
    """
    n1, b1, _, b2, gap = _check_qhadam(nu1, beta1, 1.0, beta2)
    root_a = abs(1.0 - n1 * b1)
    root_c = abs(n1) * b1 * (1.0 - b1) * (math.sqrt(b2 / gap) / math.sqrt(1.0 - b2))
    if 0.0 < root_a + root_c < math.inf:
        nu2_star = min(1.0, root_c / ((root_a + root_c) * b2))
    else:  # root_c overflows (u* rounds to 1): u* = 1 / (1 + root_a / root_c)
        nu2_star = min(1.0, 1.0 / ((1.0 + root_a / root_c) * b2))
    if nu2_star == 0.0 and n1 != 0.0:
        # u* > 0 underflowed; nu2 = 0 would make the bound inf, the least positive nu2 does not.
        nu2_star = math.ulp(0.0)
    return nu2_star, qhadam_update_bound(n1, b1, nu2_star, b2)


def qhwma_variance_factor(nu: float, beta: float, t: int | None = None) -> float:
    r""":math:`\rho`, the covariance factor of the QHWMA of iid inputs.

    Appendix A, fact ``qhwma-variance`` (proof in "Miscellaneous derivations"):
    :math:`\mathrm{Cov}[\mathrm{QHWMA}_{\nu,\beta}(x_{0 \dots t})] = \rho_t \Sigma`
    with :math:`\rho_t = \sum_{i=0}^t \delta_{QH}(i)^2`,

    .. math::

        \rho_t = (1 - \nu\beta)^2
            + \frac{[\nu\beta(1-\beta)]^2 (1 - \beta^{2t})}{1 - \beta^2},
        \qquad \rho = \lim_{t \to \infty} \rho_t
            = (1 - \nu\beta)^2 + \frac{[\nu\beta(1-\beta)]^2}{1 - \beta^2}.

    QHM's update direction :math:`(1-\nu)\nabla_t + \nu g_{t+1}` from a zero
    buffer is exactly this QHWMA of the gradients, so for iid gradient noise
    its covariance is :math:`\rho_t \Sigma`. Where rho exceeds float64's range
    (``|nu|`` near ``1e308``) this returns ``math.inf``.

    For :math:`\nu \in (0, 1]` rho decreases with increasing beta on
    ``(-1, 1)``; for :math:`\beta \in (0, 1)` it decreases with increasing
    nu on ``[0, (1 + beta) / (2 beta))`` (which contains ``[0, 1]``); for
    :math:`\beta < 0` it increases with nu on ``((1 + beta) / (2 beta), inf)``
    (which contains ``[0, inf)``). For :math:`\nu \in [0, 1]`,
    :math:`\rho \ge (1 - \nu)^2`, the infimum approached as beta -> 1.

    Args:
      nu: any finite real (appendix A: :math:`\nu \in \mathbb{R}`).
      beta: in ``(-1, 1)``, appendix A's domain for the discount (wider than the
        optimizers' ``[0, 1)``: the estimator is defined there).
      t: ``None`` (default) for the :math:`t \to \infty` limit, or the index of
        the newest input: ``t + 1`` inputs :math:`x_0 \dots x_t`.
    """
    n = require_real(check_nu(nu, "nu"), "nu")
    b = require_real(beta, "beta")
    if not -1.0 < b < 1.0:
        raise range_error("beta", "(-1, 1)", beta)
    steps = _check_t(t, allow_none=True)
    if steps is None:
        history = 1.0
    elif b == 0.0:
        history = 0.0  # the history term's weight (nu * beta)**2 is zero anyway
    else:
        history = -math.expm1(2 * min(steps, _T_CAP) * math.log(abs(b)))
    nb = n * b
    # (1 - b)**2 / (1 - b**2) == (1 - b) / (1 + b); all terms are non-negative
    # (inf where rho itself overflows float64).
    rho = _square(1.0 - nb)
    return rho + nb * nb * (1.0 - b) / (1.0 + b) * history if history else rho


def ewma_variance_factor(beta: float, t: int | None = None) -> float:
    r"""Covariance factor :math:`(1 - \beta)^2 / (1 - \beta^2)` of the EWMA of iid inputs.

    Appendix A, fact ``ewma-variance``: the QHWMA factor at :math:`\nu = 1`
    (:func:`qhwma_variance_factor`, which this calls). ``beta = 0.9`` gives
    1/19, ``beta = 0.99`` gives 1/199. ``beta`` in ``(-1, 1)``; ``t`` as in
    :func:`qhwma_variance_factor` (finite ``t``:
    :math:`(1-\beta)^2 + \beta^2 (1-\beta)^2 (1-\beta^{2t}) / (1-\beta^2)`).
    """
    return qhwma_variance_factor(1.0, beta, t)
