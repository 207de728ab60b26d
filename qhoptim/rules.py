r"""The quasi-hyperbolic update rules, defined once.

Every backend -- the float64 NumPy reference, torch, Keras and optax -- takes
its math from this module. The rules are pure functions over *arrays* that use
only Python arithmetic operators plus the few element-wise operations passed in
explicitly (``sqrt``, optionally ``square``). NumPy arrays, ``jax.numpy`` arrays,
``keras.ops`` tensors and torch tensors all satisfy that contract, so the same
function runs everywhere and XLA fuses it into one kernel.

The *scalar* parts of each rule (the mixing weights, bias corrections, the
decoupled-decay factor) are separate functions returning plain coefficients.
Fast paths that must use in-place kernels (torch's ``_foreach_*`` ops) apply
those coefficients instead of re-deriving them; the conformance suite checks
that the fast path and :func:`qhm_update` / :func:`qhadam_update` agree.

QHM (Ma & Yarats, 2019, section 3), with a normalized momentum buffer:

.. math::

    g_{t+1} &= \beta g_t + (1 - \beta) \nabla_t \\
    \theta_{t+1} &= \theta_t - \alpha \left[(1 - \nu) \nabla_t + \nu g_{t+1}\right]

QHAdam (section 5), with bias-corrected moments and :math:`\epsilon` added
after the square root:

.. math::

    g_{t+1} &= \beta_1 g_t + (1 - \beta_1) \nabla_t, \quad
    g'_{t+1} = g_{t+1} / (1 - \beta_1^{t+1}) \\
    s_{t+1} &= \beta_2 s_t + (1 - \beta_2) \nabla_t^2, \quad
    s'_{t+1} = s_{t+1} / (1 - \beta_2^{t+1}) \\
    \theta_{t+1} &= \theta_t - \alpha \,
      \frac{(1 - \nu_1) \nabla_t + \nu_1 g'_{t+1}}
           {\sqrt{(1 - \nu_2) \nabla_t^2 + \nu_2 s'_{t+1}} + \epsilon}

QHAdam's AMSGrad variant ("analogously modified", section 5;
:func:`qhadam_amsgrad_update`) keeps the running maximum of the *uncorrected*
second moment, as ``torch.optim.Adam(amsgrad=True)`` does, and reads it in
place of :math:`s_{t+1}`, bias-corrected by the current step's correction:

.. math::

    \hat s_{t+1} &= \max(\hat s_t, s_{t+1}), \quad \hat s_0 = 0 \\
    \theta_{t+1} &= \theta_t - \alpha \,
      \frac{(1 - \nu_1) \nabla_t + \nu_1 g'_{t+1}}
           {\sqrt{(1 - \nu_2) \nabla_t^2 + \nu_2 \hat s_{t+1} / (1 - \beta_2^{t+1})} + \epsilon}

QHMuon applies QHM's direction to each 2-D parameter after orthogonalizing
it (Muon: Jordan et al., 2024), :func:`newton_schulz` of
:math:`(1 - \nu) \nabla_t + \nu g_{t+1}`, scaled by :func:`muon_lr_ratio`.
Muon's Nesterov option is :math:`\nu = \beta`, plain Muon :math:`\nu = 1`.

Weight decay comes in two forms, both defined here: *coupled* (L2) decay adds
:math:`\lambda \theta` to the gradient (:func:`coupled_weight_decay`, a new
array: the caller's gradient is never mutated), *decoupled* decay (AdamW,
Loshchilov & Hutter 2019) multiplies the parameter by
:math:`1 - \alpha \lambda` before the update (:func:`decoupled_decay_factor`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from qhoptim import validation

__all__ = [
    "MAX_DENOMINATOR_RATIO",
    "MUON_EPS",
    "MUON_LR_ADJUSTMENTS",
    "MUON_NORM_GUARDS",
    "MUON_NS_COEFFICIENTS",
    "MUON_NS_STEPS",
    "Denominator",
    "FoldedQHAdam",
    "MatrixOps",
    "QHAdamCoefficients",
    "QHAdamMomentWeights",
    "QHMCoefficients",
    "abs_square",
    "amsgrad_maximum",
    "apply_update",
    "bias_correction",
    "coupled_weight_decay",
    "decoupled_decay_factor",
    "ewma",
    "fold_qhadam",
    "folded_qhadam_step",
    "muon_lr_ratio",
    "newton_schulz",
    "qhadam_amsgrad_update",
    "qhadam_coefficients",
    "qhadam_denominator",
    "qhadam_moment_weights",
    "qhadam_update",
    "qhm_bias_corrected_direction",
    "qhm_coefficients",
    "qhm_trace_update",
    "qhm_update",
    "qhmuon_buffer_correction",
    "weight_decay_terms",
]

Array = Any  # any array type supporting + - * / with scalars and arrays


class QHMCoefficients(NamedTuple):
    """Scalar weights of one QHM step.

    ``momentum_buffer = buffer_decay * momentum_buffer + grad_to_buffer * grad``;
    ``direction = grad_weight * grad + buffer_weight * momentum_buffer``.
    """

    buffer_decay: Any  # beta
    grad_to_buffer: Any  # 1 - beta
    grad_weight: Any  # 1 - nu
    buffer_weight: Any  # nu


class QHAdamCoefficients(NamedTuple):
    """Scalar weights of one QHAdam step, bias corrections folded in.

    ``numerator = grad_weight * grad + exp_avg_weight * exp_avg`` and
    ``denominator = sqrt(grad_sq_weight * grad**2 + exp_avg_sq_weight * exp_avg_sq) + eps``.
    """

    grad_weight: Any  # 1 - nu1
    exp_avg_weight: Any  # nu1 / (1 - beta1**t)
    grad_sq_weight: Any  # 1 - nu2
    exp_avg_sq_weight: Any  # nu2 / (1 - beta2**t)


class QHAdamMomentWeights(NamedTuple):
    """The EWMA weights of QHAdam's two moments, as in-place kernels apply them.

    ``exp_avg = exp_avg_decay * exp_avg + grad_to_exp_avg * grad`` (torch's
    ``exp_avg.lerp_(grad, grad_to_exp_avg)``) and ``exp_avg_sq =
    exp_avg_sq_decay * exp_avg_sq + grad_sq_to_exp_avg_sq * |grad|**2``: each
    moment is an EWMA (:func:`ewma`), as QHM's buffer
    (:attr:`QHMCoefficients.grad_to_buffer`).
    """

    exp_avg_decay: Any  # beta1
    grad_to_exp_avg: Any  # 1 - beta1
    exp_avg_sq_decay: Any  # beta2
    grad_sq_to_exp_avg_sq: Any  # 1 - beta2


def qhadam_moment_weights(beta1: Any, beta2: Any) -> QHAdamMomentWeights:
    """The weights of QHAdam's moment EWMAs for discounts ``beta1`` and ``beta2``."""
    return QHAdamMomentWeights(beta1, 1 - beta1, beta2, 1 - beta2)


def abs_square(
    x: Array, *, conj: Callable[[Array], Array], real: Callable[[Array], Array]
) -> Array:
    """``|x|**2`` of a real or complex array, real-valued and without a square root:
    ``real(x * conj(x))``, exactly ``x * x`` for real ``x``. The ``square`` QHAdam's
    rules take for complex gradients (``conj`` and ``real`` are the backend's)."""
    return real(x * conj(x))


def ewma(average: Array, value: Array, beta: Any) -> Array:
    """One step of an exponentially weighted moving average: ``beta*avg + (1-beta)*value``."""
    return beta * average + (1 - beta) * value


def bias_correction(
    beta: Any,
    step: Any,
    *,
    expm1: Callable[[Any], Any] | None = None,
    log: Callable[[Any], Any] = math.log,
) -> Any:
    """``1 - beta**step``: the mass an EWMA started at zero has after ``step`` updates.

    ``step`` counts updates *including* the current one (1 on the first step).
    Works on Python numbers and on traced scalars (``beta ** step`` only).

    The float32 policy: a backend that evaluates the bias correction in a
    precision below float64 passes its element-wise ``expm1`` (and, for a traced
    ``beta``, its ``log``), and the correction is computed as
    ``-expm1(step * log(beta))``. ``1 - beta**step`` cancels catastrophically
    near ``beta = 1`` -- in float32, ``1 - 0.99999**1`` is off by ~1e-2 relative
    and ``1 - 0.9999999**1`` by ~20%, so Adam's first step is not ``lr`` --
    while the ``expm1`` form keeps float32's relative precision (``log(beta)``
    of a Python ``beta`` is taken in float64). Every float32 path (optax,
    Keras, torch's on-device and compiled steps) uses this form; float64 paths
    use ``1 - beta**step`` as written.

    >>> bias_correction(0.9, 2)
    0.18999999999999995
    >>> round(bias_correction(0.9, 2, expm1=math.expm1), 15)
    0.19
    """
    if expm1 is None or (isinstance(beta, (int, float)) and beta == 0):
        return 1 - beta**step
    return -expm1(step * log(beta))


def decoupled_decay_factor(lr: Any, weight_decay: Any) -> Any:
    """Multiplier ``1 - lr * weight_decay`` applied to the parameter (AdamW-style)."""
    return 1 - lr * weight_decay


def coupled_weight_decay(grad: Array, param: Array, weight_decay: Any) -> Array:
    """L2-regularized gradient ``grad + weight_decay * param`` (a new array)."""
    return grad + weight_decay * param


def weight_decay_terms(
    grad: Array, param: Array, *, lr: Any, weight_decay: Any, decoupled: bool
) -> tuple[Array, Any]:
    """Fold weight decay into a step: return ``(grad, decay_factor)``.

    Coupled (L2) decay returns ``grad + weight_decay * param`` and factor 1;
    decoupled decay returns ``grad`` unchanged and ``1 - lr * weight_decay``.
    Feed both to the rule and to :func:`apply_update`.
    """
    if decoupled:
        return grad, decoupled_decay_factor(lr, weight_decay)
    return coupled_weight_decay(grad, param, weight_decay), 1


def apply_update(param: Array, update: Array, lr: Any, decay_factor: Any = 1) -> Array:
    """``param * decay_factor - lr * update``: the final parameter step of every rule
    (no multiplication for a ``decay_factor`` that is the number 1)."""
    return _weighted(decay_factor, param) - lr * update


def qhm_coefficients(momentum: Any, nu: Any) -> QHMCoefficients:
    """The scalar weights of QHM for discount ``momentum`` (beta) and immediate discount ``nu``."""
    return QHMCoefficients(momentum, 1 - momentum, 1 - nu, nu)


class FoldedQHM(NamedTuple):
    """QHM's update as kernels apply it (:func:`fold_qhm`):
    ``param += buffer_value * momentum_buffer + grad_value * grad`` after the
    buffer's EWMA step, the values holding ``-lr``. A value that is the number 0
    (``nu = 1``: momentum; ``nu = 0``: SGD) lets a kernel skip its term."""

    buffer_value: Any  # -lr * nu
    grad_value: Any  # -lr * (1 - nu)


def fold_qhm(c: QHMCoefficients, lr: Any) -> FoldedQHM:
    """:func:`qhm_update`'s direction times ``-lr`` (``lr`` a number or an array)."""
    return FoldedQHM(_times_weight(-lr, c.buffer_weight), _times_weight(-lr, c.grad_weight))


def qhm_update(
    grad: Array, momentum_buffer: Array, *, momentum: Any, nu: Any
) -> tuple[Array, Array]:
    """One QHM step before the learning rate.

    Args:
      grad: the (already decayed / negated) gradient ``nabla_t``.
      momentum_buffer: ``g_t``, the normalized momentum buffer (zeros initially).
      momentum: ``beta``, the momentum buffer's exponential discount factor.
      nu: the immediate discount factor; ``nu = 0`` is SGD, ``nu = 1`` momentum,
        ``nu = beta`` Nesterov's accelerated gradient.

    Returns:
      ``(g_{t+1}, direction)`` with ``theta_{t+1} = theta_t - lr * direction``.
    """
    c = qhm_coefficients(momentum, nu)
    momentum_buffer = ewma(momentum_buffer, grad, momentum)
    direction = c.grad_weight * grad + c.buffer_weight * momentum_buffer
    return momentum_buffer, direction


def qhadam_coefficients(
    nu1: Any, nu2: Any, bias_correction1: Any, bias_correction2: Any
) -> QHAdamCoefficients:
    """The scalar weights of QHAdam given both bias corrections (see :func:`bias_correction`)."""
    return QHAdamCoefficients(1 - nu1, nu1 / bias_correction1, 1 - nu2, nu2 / bias_correction2)


def _qhadam_moments(
    grad: Array, exp_avg: Array, exp_avg_sq: Array, beta1: Any, beta2: Any, square: Any
) -> tuple[Array, Array, Array]:
    """``(|grad|**2, g_{t+1}, s_{t+1})``: both moments' EWMA step."""
    grad_sq = grad * grad if square is None else square(grad)
    return grad_sq, ewma(exp_avg, grad, beta1), ewma(exp_avg_sq, grad_sq, beta2)


def _qhadam_direction(
    grad: Array,
    grad_sq: Array,
    exp_avg: Array,
    second_moment: Array,
    c: QHAdamCoefficients,
    eps: Any,
    sqrt: Callable[[Array], Array],
) -> Array:
    """QHAdam's update from the moments; ``second_moment`` is what the denominator reads."""
    numerator = c.grad_weight * grad + c.exp_avg_weight * exp_avg
    denominator = sqrt(c.grad_sq_weight * grad_sq + c.exp_avg_sq_weight * second_moment) + eps
    return numerator / denominator


def qhadam_update(
    grad: Array,
    exp_avg: Array,
    exp_avg_sq: Array,
    *,
    beta1: Any,
    beta2: Any,
    nu1: Any,
    nu2: Any,
    eps: Any,
    bias_correction1: Any,
    bias_correction2: Any,
    sqrt: Callable[[Array], Array],
    square: Callable[[Array], Array] | None = None,
) -> tuple[Array, Array, Array]:
    """One QHAdam step before the learning rate.

    Args:
      grad: the (already decayed / negated) gradient ``nabla_t``.
      exp_avg: ``g_t``, the first-moment EWMA (zeros initially).
      exp_avg_sq: ``s_t``, the second-moment EWMA (zeros initially).
      beta1, beta2: the moments' discount factors.
      nu1, nu2: immediate discount factors; ``nu1 = nu2 = 1`` is Adam.
      eps: added to the denominator *after* the square root and bias correction.
      bias_correction1, bias_correction2: ``1 - beta**t`` for the step ``t``
        being taken (:func:`bias_correction`); pass ``1`` to drop bias correction.
      sqrt: element-wise square root of the backend.
      square: element-wise ``|x|**2`` of the backend (default ``x * x``; pass
        ``|x|**2`` for complex gradients so the second moment stays real).

    Returns:
      ``(g_{t+1}, s_{t+1}, update)`` with ``theta_{t+1} = theta_t - lr * update``.
    """
    grad_sq, exp_avg, exp_avg_sq = _qhadam_moments(grad, exp_avg, exp_avg_sq, beta1, beta2, square)
    c = qhadam_coefficients(nu1, nu2, bias_correction1, bias_correction2)
    return exp_avg, exp_avg_sq, _qhadam_direction(grad, grad_sq, exp_avg, exp_avg_sq, c, eps, sqrt)


def amsgrad_maximum(
    max_exp_avg_sq: Array, exp_avg_sq: Array, *, maximum: Callable[[Array, Array], Array]
) -> Array:
    """AMSGrad's running maximum ``max(max_exp_avg_sq, exp_avg_sq)``, element-wise.

    The maximum is of the *uncorrected* second-moment EWMA ``s_{t+1}`` (this
    step's, after its EWMA update), as ``torch.optim.Adam(amsgrad=True)`` and
    Keras's ``Adam(amsgrad=True)`` keep it; the step then divides it by the
    *current* bias correction ``1 - beta2**t`` (``qhadam_coefficients``'s
    ``exp_avg_sq_weight``). ``optax.amsgrad`` instead takes the maximum of the
    bias-corrected ``s_{t+1} / (1 - beta2**t)``, a different trajectory.
    ``maximum`` is the backend's element-wise maximum (``numpy.maximum``,
    ``torch.maximum``, ...), which propagates NaN.
    """
    return maximum(max_exp_avg_sq, exp_avg_sq)


def qhadam_amsgrad_update(
    grad: Array,
    exp_avg: Array,
    exp_avg_sq: Array,
    max_exp_avg_sq: Array,
    *,
    beta1: Any,
    beta2: Any,
    nu1: Any,
    nu2: Any,
    eps: Any,
    bias_correction1: Any,
    bias_correction2: Any,
    sqrt: Callable[[Array], Array],
    maximum: Callable[[Array, Array], Array],
    square: Callable[[Array], Array] | None = None,
) -> tuple[Array, Array, Array, Array]:
    r"""One step of QHAdam's AMSGrad variant before the learning rate.

    As :func:`qhadam_update`, with the running maximum :math:`\hat s` of the
    uncorrected second moment (:func:`amsgrad_maximum`) in place of :math:`s`
    in the denominator, divided by this step's bias correction:

    .. math::

        \hat s_{t+1} = \max(\hat s_t, s_{t+1}), \qquad
        \text{update} = \frac{(1 - \nu_1) \nabla_t + \nu_1 g_{t+1} / (1 - \beta_1^{t+1})}
            {\sqrt{(1 - \nu_2) \nabla_t^2 + \nu_2 \hat s_{t+1} / (1 - \beta_2^{t+1})} + \epsilon}

    ``nu1 = nu2 = 1`` is ``torch.optim.Adam(amsgrad=True)``. ``max_exp_avg_sq``
    starts at zeros (real, like ``exp_avg_sq``); ``maximum`` is the backend's
    element-wise maximum; the other arguments are :func:`qhadam_update`'s.

    Returns:
      ``(g_{t+1}, s_{t+1}, max_{t+1}, update)`` with
      ``theta_{t+1} = theta_t - lr * update``.
    """
    grad_sq, exp_avg, exp_avg_sq = _qhadam_moments(grad, exp_avg, exp_avg_sq, beta1, beta2, square)
    max_exp_avg_sq = amsgrad_maximum(max_exp_avg_sq, exp_avg_sq, maximum=maximum)
    c = qhadam_coefficients(nu1, nu2, bias_correction1, bias_correction2)
    update = _qhadam_direction(grad, grad_sq, exp_avg, max_exp_avg_sq, c, eps, sqrt)
    return exp_avg, exp_avg_sq, max_exp_avg_sq, update


# ------------------------------------------------------------ folded QHAdam
# The in-place kernels (torch's ``addcdiv_`` and ``_foreach_`` twins, fused
# kernels) cannot form the numerator and the denominator as temporaries
# cheaply; they take QHAdam's update in the *folded* form below, whose
# coefficients are derived here, once, from :func:`qhadam_coefficients`.

#: Largest ratio of the two denominator weights folded as ``s + ratio * g**2``:
#: beyond it ``ratio * g**2`` could overflow for gradients whose square does not.
MAX_DENOMINATOR_RATIO = 2.0**64


class Denominator(enum.Enum):
    """Which moments QHAdam's denominator reads (:func:`qhadam_denominator`).

    ``d = sqrt(exp_avg_sq_weight * s + grad_sq_weight * |g|**2) + eps`` with
    the weights of :class:`FoldedQHAdam`; a kernel skips the term a form lacks.
    """

    EXP_AVG_SQ = "exp_avg_sq"
    """``nu2 = 1``: the second moment alone (Adam); the gradient's square is not read."""
    GRAD = "grad"
    """``nu2 = 0``: the gradient alone, ``|g|``; the second moment is not read."""
    MIX = "mix"
    """``0 < nu2 < 1``: both."""


def qhadam_denominator(nu2: float) -> Denominator:
    """The denominator form for ``nu2`` in ``[0, 1]``.

    It depends on ``nu2`` alone, never on the step, so a kernel whose
    coefficients live on a device (capturable, fused) picks it on the host.
    """
    if nu2 == 0:
        return Denominator.GRAD
    if nu2 == 1:
        return Denominator.EXP_AVG_SQ
    return Denominator.MIX


class FoldedQHAdam(NamedTuple):
    """QHAdam's update as in-place kernels apply it (:func:`fold_qhadam`).

    ``param += exp_avg_value * exp_avg / d + grad_value * grad / d`` with
    ``d = sqrt(exp_avg_sq_weight * exp_avg_sq + grad_sq_weight * |grad|**2) + eps``
    (only the terms :attr:`denominator` names; with AMSGrad ``exp_avg_sq`` is
    the running maximum :func:`amsgrad_maximum`, the coefficients are the
    same). The values already hold ``-lr``. A weight that is the number 1
    costs no multiplication, and a value that is the number 0 lets a kernel
    skip its pass.
    """

    denominator: Denominator
    exp_avg_sq_weight: Any
    grad_sq_weight: Any
    eps: Any
    exp_avg_value: Any
    grad_value: Any


def fold_qhadam(
    c: QHAdamCoefficients,
    lr: Any,
    eps: Any,
    denominator: Denominator,
    *,
    factor_out: bool = True,
    sqrt: Callable[[Any], Any] = math.sqrt,
) -> FoldedQHAdam:
    r"""QHAdam's weights ``c`` (:func:`qhadam_coefficients`), ``lr`` and ``eps`` for kernels.

    The update of :func:`qhadam_update`, times ``-lr``,

    .. math::

        -\alpha \frac{w_g g + w_m m}{\sqrt{w_{g^2} g^2 + w_s s} + \epsilon}

    is ``(exp_avg_value * m + grad_value * g) / d``. With ``factor_out``
    (coefficients that are Python numbers) the common factor ``k = sqrt(w_s)``
    is taken out of the square root, so that one denominator weight is 1 and
    costs no pass: ``eps / k``, ``-lr * w / k``, and the other weight divided
    by ``k**2``; ``k = sqrt(w_{g^2})`` instead when ``w_s`` is 0 or so small
    next to ``w_{g^2}`` (``nu2`` near 0) that the ratio could overflow
    (:data:`MAX_DENOMINATOR_RATIO`). Without it (coefficients that live on a
    device, one per tensor, which would each cost a pass) the weights are
    returned as they are. ``denominator`` comes from :func:`qhadam_denominator`;
    ``sqrt`` is the backend's for device coefficients.
    """
    if not factor_out:
        return FoldedQHAdam(
            denominator,
            c.exp_avg_sq_weight,
            c.grad_sq_weight,
            eps,
            -lr * c.exp_avg_weight,
            _times_weight(-lr, c.grad_weight),
        )
    if denominator is Denominator.EXP_AVG_SQ:
        s_weight, g_weight, k = 1.0, 0.0, sqrt(c.exp_avg_sq_weight)
    elif denominator is Denominator.GRAD:
        s_weight, g_weight, k = 0.0, 1.0, sqrt(c.grad_sq_weight)
    elif c.grad_sq_weight <= MAX_DENOMINATOR_RATIO * c.exp_avg_sq_weight:
        s_weight, g_weight = 1.0, c.grad_sq_weight / c.exp_avg_sq_weight
        k = sqrt(c.exp_avg_sq_weight)
    else:
        s_weight, g_weight = c.exp_avg_sq_weight / c.grad_sq_weight, 1.0
        k = sqrt(c.grad_sq_weight)
    return FoldedQHAdam(
        denominator,
        s_weight,
        g_weight,
        eps / k,
        -lr * c.exp_avg_weight / k,
        _times_weight(-lr, c.grad_weight) / k,
    )


def _times_weight(x: Any, weight: Any) -> Any:
    """``x * weight``; the number 0 for a weight that is the number 0 (``1 - nu1``
    at ``nu1 = 1``), also when ``x`` is an array (a device learning rate), so
    that the term stays one a kernel can skip."""
    if isinstance(weight, (int, float)) and weight == 0:
        return 0.0
    return x * weight


def _is_zero(c: Any) -> bool:
    return isinstance(c, (int, float)) and c == 0


def folded_qhadam_step(
    f: FoldedQHAdam,
    grad: Array,
    exp_avg: Array,
    exp_avg_sq: Array,
    *,
    sqrt: Callable[[Array], Array],
    square: Callable[[Array], Array] | None = None,
) -> Array:
    """The parameter change ``-lr * update`` of one QHAdam step in folded form.

    ``exp_avg`` and ``exp_avg_sq`` are the moments *after* this step's EWMA;
    for the AMSGrad variant ``exp_avg_sq`` is the running maximum
    :func:`amsgrad_maximum` (after this step's), which the fold's coefficients
    take unchanged. What the fused kernels compute (one division; torch's
    multi-tensor kernels divide each term, the same to rounding);
    ``tests/test_rules.py`` checks it against :func:`qhadam_update` and
    :func:`qhadam_amsgrad_update`. A weight that is the number 1 costs no
    multiplication and a value that is the number 0 no term.
    """
    form = f.denominator
    if form is Denominator.EXP_AVG_SQ:
        base = _weighted(f.exp_avg_sq_weight, exp_avg_sq)
    else:
        grad_sq = grad * grad if square is None else square(grad)
        base = _weighted(f.grad_sq_weight, grad_sq)
        if form is Denominator.MIX:
            base = _weighted(f.exp_avg_sq_weight, exp_avg_sq) + base
    numerator = f.exp_avg_value * exp_avg
    if not _is_zero(f.grad_value):
        numerator = numerator + f.grad_value * grad
    return numerator / (sqrt(base) + f.eps)


def _weighted(weight: Any, x: Array) -> Array:
    """``weight * x``; ``x`` itself for the number 1."""
    return x if isinstance(weight, (int, float)) and weight == 1 else weight * x


# ------------------------------------------------------------------- QHMuon
#: Muon's quintic Newton-Schulz coefficients :math:`(a, b, c)`, as every
#: framework's Muon ships them (they maximize the slope at zero).
MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: Muon's number of Newton-Schulz steps.
MUON_NS_STEPS = 5
#: The floor of the norm :func:`newton_schulz` divides by (a zero matrix stays zero).
MUON_EPS = 1e-7
#: The learning-rate adjustments :func:`muon_lr_ratio` knows, besides ``None``.
MUON_LR_ADJUSTMENTS = ("original", "match_rms_adamw")
#: How a Muon keeps the norm it divides by away from zero: ``"max"``,
#: :math:`\max(\lVert U \rVert_F, \epsilon)` (torch), or ``"add"``,
#: :math:`\lVert U \rVert_F + \epsilon` (MLX, Keras, optax).
MUON_NORM_GUARDS = ("max", "add")


class MatrixOps(NamedTuple):
    """The matrix operations :func:`newton_schulz` takes from a backend.

    ``matmul_add(c, a, b, beta, alpha)`` is ``beta * c + alpha * (a @ b)``
    (torch's ``addmm``: one rounding in a narrow dtype), ``norm`` the Frobenius
    norm and ``clamp_min(x, low)`` the larger of ``x`` and ``low``.
    ``repeat(n, f, x)``, where given, is ``f`` applied ``n`` times to ``x``
    for a count that is not a Python int (a traced one: JAX's ``fori_loop``).
    """

    matmul: Callable[[Array, Array], Array]
    matmul_add: Callable[[Array, Array, Array, Any, Any], Array]
    transpose: Callable[[Array], Array]
    norm: Callable[[Array], Any]
    clamp_min: Callable[[Any, float], Any]
    repeat: Callable[[Any, Callable[[Array], Array], Array], Array] | None = None


def newton_schulz(
    update: Array,
    *,
    rows: int,
    columns: int,
    ops: MatrixOps,
    coefficients: tuple[float, float, float] = MUON_NS_COEFFICIENTS,
    steps: int = MUON_NS_STEPS,
    eps: float = MUON_EPS,
    norm_guard: str = "max",
    narrow: Callable[[Array], Array] | None = None,
) -> Array:
    r"""Muon's orthogonalization of a ``rows x columns`` matrix: ``steps`` quintic
    Newton-Schulz iterations with ``coefficients`` :math:`(a, b, c)`.

    .. math::

        X_0 = U / \max(\lVert U \rVert_F, \epsilon)
            \text{ or } U / (\lVert U \rVert_F + \epsilon), \quad
        A_k = X_k X_k^\top, \quad
        X_{k+1} = a X_k + (b A_k + c A_k^2) X_k

    run on :math:`U^\top` when ``rows > columns`` (so that :math:`A_k` is the
    smaller Gram matrix) and transposed back. The Frobenius norm bounds the
    spectral norm, so the singular values start in :math:`[0, 1]`; the
    iteration pushes them towards 1 (to roughly :math:`[0.7, 1.2]` with the
    default coefficients: Muon's "approximately orthogonal"). The dtype is the
    caller's: frameworks run it in bfloat16 or float32, the reference in float64.
    ``norm_guard`` (:data:`MUON_NORM_GUARDS`) says how ``eps`` guards the norm,
    as the host framework's Muon does. ``narrow``: a cast to float16 (whose
    range ends at 65504), applied after the normalization, which then runs in
    the update's wider dtype: in float16 a norm past 256 squared overflows and
    a tiny one underflows, and the step would be zero or NaN.
    """
    a, b, c = coefficients
    tall = rows > columns
    x = ops.transpose(update) if tall else update
    norm = ops.norm(x)
    if norm_guard == "max":
        x = x / ops.clamp_min(norm, eps)
    elif norm_guard == "add":
        x = x / (norm + eps)
    else:
        validation.check_choice(norm_guard, "norm_guard", MUON_NORM_GUARDS)
    if narrow is not None:
        x = narrow(x)

    def iteration(x: Array) -> Array:
        gram = ops.matmul(x, ops.transpose(x))
        polynomial = ops.matmul_add(gram, gram, gram, b, c)
        return ops.matmul_add(x, polynomial, x, a, 1)

    if ops.repeat is None or isinstance(steps, int):
        for _ in range(steps):
            x = iteration(x)
    else:
        x = ops.repeat(steps, iteration, x)
    return ops.transpose(x) if tall else x


def qhm_trace_update(grad: Array, trace: Array, *, momentum: Any, nu: Any) -> tuple[Array, Array]:
    r"""QHM's direction over an *unnormalized* trace, divided by :math:`1 - \beta`.

    .. math::

        m_{t+1} = \beta m_t + \nabla_t, \qquad
        d_t = \frac{1 - \nu}{1 - \beta} \nabla_t + \nu\, m_{t+1}

    The trace is :math:`g / (1 - \beta)` for QHM's normalized buffer :math:`g`,
    so :math:`d_t` is QHM's direction over :math:`1 - \beta`: the same after
    Muon's normalization. Keras's Muon keeps this trace; its Nesterov direction
    :math:`\nabla_t + \beta m_{t+1}` is :math:`\nu = \beta` (the gradient's
    weight is then exactly 1) and its plain one :math:`m_{t+1}` is :math:`\nu = 1`.
    Returns ``(m_{t+1}, d_t)``.
    """
    trace = momentum * trace + grad
    return trace, ((1 - nu) / (1 - momentum)) * grad + nu * trace


def qhmuon_buffer_correction(nu: Any, grad_correction: Any, *, minimum: Any = min) -> Any:
    r"""The buffer term's bias correction :math:`1 - \min(\nu, 1)\,\beta^t` of
    optax's Muon form (:func:`qhm_bias_corrected_direction`), from the gradient
    term's :math:`c = 1 - \beta^t` (:func:`bias_correction`).

    Written :math:`c + (1 - c)(1 - \min(\nu, 1))`: two non-negative terms, so
    it keeps the precision of :math:`c` near :math:`\beta = 1` (no cancellation).
    At :math:`\nu = \beta` it is :math:`1 - \beta^{t+1}`, optax's Nesterov
    correction; at :math:`\nu \ge 1`, :math:`c`. ``minimum`` is the backend's
    (``jnp.minimum`` for a traced ``nu``).
    """
    return grad_correction + (1 - grad_correction) * (1 - minimum(nu, 1))


def qhm_bias_corrected_direction(
    grad: Array, momentum_buffer: Array, *, nu: Any, grad_correction: Any, buffer_correction: Any
) -> Array:
    r"""QHM's direction with both terms bias-corrected, as optax's Muon forms it.

    .. math:: \nu \frac{g_{t+1}}{1 - \min(\nu, 1)\beta^t}
        + (1 - \nu) \frac{\nabla_t}{1 - \beta^t}

    (``grad_correction`` :math:`1 - \beta^t`, ``buffer_correction`` from
    :func:`qhmuon_buffer_correction`). ``optax.contrib.muon`` with Nesterov is
    :math:`\nu = \beta` (its :math:`\beta \hat m_{t+1} + (1 - \beta) \hat g_t`,
    the buffer corrected by :math:`1 - \beta^{t+1}`); without, :math:`\nu = 1`
    (:math:`g_{t+1} / (1 - \beta^t)`).
    """
    return nu * (momentum_buffer / buffer_correction) + (1 - nu) * (grad / grad_correction)


def muon_lr_ratio(adjust: str | None, fan_out: int, fan_in: int, *, rms: float = 0.2) -> float:
    r"""The factor Muon multiplies the learning rate by for a ``fan_out x fan_in`` matrix.

    * ``"original"`` (and ``None``): :math:`\sqrt{\max(1, \text{fan\_out} / \text{fan\_in})}`,
      Jordan's Muon, torch's default: an orthogonal tall matrix's update has the
      RMS of a square one's;
    * ``"match_rms_adamw"``: :math:`\text{rms} \sqrt{\max(\text{fan\_out}, \text{fan\_in})}`
      (Liu et al., 2025, "Muon is scalable for LLM training"; ``rms = 0.2``):
      the update's RMS is AdamW's typical 0.2, so AdamW's learning rate and
      weight decay carry over.

    torch and MLX store a layer's weight as ``(fan_out, fan_in)``: their
    ``rows x columns``; optax and Keras as ``(fan_in, fan_out)``.
    """
    if fan_out == 0 or fan_in == 0:
        # An empty matrix has an empty update; any factor is 1 (not a division by 0).
        validation.check_choice(adjust, "adjust_lr_fn", [None, *MUON_LR_ADJUSTMENTS])
        return 1.0
    if adjust is None or adjust == "original":
        return math.sqrt(max(1.0, fan_out / fan_in))
    if adjust == "match_rms_adamw":
        return rms * math.sqrt(max(fan_out, fan_in))
    validation.check_choice(adjust, "adjust_lr_fn", [None, *MUON_LR_ADJUSTMENTS])
    raise AssertionError("unreachable")  # pragma: no cover
