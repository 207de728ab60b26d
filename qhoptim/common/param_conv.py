r"""qhoptim 1.1.0's conversion helpers: ``qhoptim.common.param_conv``.

This is the 1.1.0 spelling of :mod:`qhoptim.convert`, kept so that code written
for qhoptim 1.1.0 keeps working. New code should call :mod:`qhoptim.convert`,
whose results (:class:`qhoptim.convert.QHMParams`,
:class:`qhoptim.convert.QHAdamParams`) the backends accept directly
(``QHM.from_params(...)``, ``QHM(**p.as_kwargs())``).

As in 1.1.0, ``qhoptim.common`` is a package whose one public member is this
submodule, so each of these works::

    from qhoptim.common import param_conv
    import qhoptim.common.param_conv
    from qhoptim.common.param_conv import from_pid, QHMParams

Every function has 1.1.0's name, positional arguments and (lack of)
defaults, and returns 1.1.0's named tuples; each calls the
:mod:`qhoptim.convert` function of the same name, with the same arguments, and
renames the fields:

- ``from_pid(k_p, k_i, k_d)``, ``from_synthesized_nesterov(alpha, beta1, beta2)``,
  ``from_robust_momentum(l, kappa, rho)`` (``rho=None``: Triple Momentum's rate
  ``1 - 1/sqrt(kappa)``), ``from_accsgd(delta, kappa, xi, eps)`` and
  ``from_two_state_optimizer(h, k, l, m, q, z)`` return
  ``QHMParams(alpha, nu, beta)``, which :class:`qhoptim.convert.QHMParams`
  calls ``(lr, nu, momentum)``;
- ``from_nadam(lr, beta1, beta2)`` (``convert.from_nadam(lr, (beta1, beta2),
  eps)``; the conversion leaves ``eps`` as it is, so 1.1.0 had none) returns
  ``QHAdamParams(alpha, nu1, nu2, beta1, beta2)``, which
  :class:`qhoptim.convert.QHAdamParams` holds as ``lr``, ``betas``, ``nus``.

Differences from qhoptim 1.1.0
------------------------------
The formulas are those of :mod:`qhoptim.convert`. Where 1.1.0's formulas are
the same, the numbers agree up to rounding (some are evaluated in a different
order; the last digits can differ, most where ``nu`` is near 0). An upgrading
user gets :mod:`qhoptim.convert`'s behaviour in the three places where 1.1.0
differed:

1. **Preconditions are checked.** 1.1.0 evaluated its formulas on any input.
   Where the input is outside the source algorithm's domain or the result
   would not be a valid QHM, this module raises :class:`ValueError` naming the
   argument, the allowed range and the value received, as
   :mod:`qhoptim.convert` documents for each function. Examples: PID gains
   ``k_p``, ``k_d`` of the same sign (1.1.0 returned a momentum outside
   ``[0, 1)``), a Robust Momentum ``rho`` outside
   ``[1 - 1/sqrt(kappa), 1 - 1/kappa]``, an AccSGD ``xi`` above
   ``sqrt(kappa)`` or ``eps`` outside ``(0, 1)``, a two-state optimizer whose
   transition matrix has no eigenvalue 1. Where 1.1.0 divided by zero
   (``ZeroDivisionError``), the answer is a ``ValueError`` as well, except for
   the degenerate inputs that QHM does recover, which now return ``nu = 0``:
   ``from_pid(0, k_i, 0)`` and ``from_synthesized_nesterov(alpha, 0, 0)``
   (plain SGD), and a two-state optimizer whose QHM lr or momentum is 0.
2. **The two-state optimizer's ``nu`` is corrected.** 1.1.0 used the formulas
   printed in Ma & Yarats (2019), App. D, which hold only under that
   appendix's conditions (they force ``q = 1`` and ``k * m = 0``); there the
   result is unchanged. Outside them 1.1.0's ``nu`` was wrong (``alpha`` and
   ``beta`` were right), although QHM still recovers the optimizer; this
   module returns the general formula's ``nu`` (``docs/conversions.md``,
   Erratum 3). QHM must then start from the buffer that
   :func:`qhoptim.convert.two_state_initial_buffer` gives, which 1.1.0 did not
   provide.
3. **Inputs are concrete real numbers; results are Python floats.** 1.1.0's
   arithmetic passed other types through (a NumPy scalar in gave a NumPy scalar
   out). Here ``int``, ``float``, NumPy scalars and arrays or tensors of one
   element (read as the number they hold, as every backend reads a
   hyperparameter) are accepted and every field is a ``float``; booleans and
   arrays of any other size raise :class:`TypeError`.

This module imports only :mod:`qhoptim.convert` and :mod:`qhoptim.validation`
(no ML framework).
"""

# ruff: noqa: E741  (l is the papers' name: the smoothness constant L, TSO's l)

from __future__ import annotations

from typing import NamedTuple

from qhoptim import convert, validation

__all__ = [
    "QHAdamParams",
    "QHMParams",
    "from_accsgd",
    "from_nadam",
    "from_pid",
    "from_robust_momentum",
    "from_synthesized_nesterov",
    "from_two_state_optimizer",
]


class QHMParams(NamedTuple):
    """qhoptim 1.1.0's QHM hyperparameters: ``alpha`` (lr), ``nu``, ``beta`` (momentum).

    :class:`qhoptim.convert.QHMParams` names the same fields ``lr``, ``nu``, ``momentum``.
    """

    alpha: float
    nu: float
    beta: float


class QHAdamParams(NamedTuple):
    """qhoptim 1.1.0's QHAdam hyperparameters ``(alpha, nu1, nu2, beta1, beta2)``.

    :class:`qhoptim.convert.QHAdamParams` holds them as ``lr`` (alpha), ``betas``
    and ``nus`` (and ``eps``).
    """

    alpha: float
    nu1: float
    nu2: float
    beta1: float
    beta2: float


def _qhm(p: convert.QHMParams) -> QHMParams:
    return QHMParams(alpha=p.lr, nu=p.nu, beta=p.momentum)


def from_pid(k_p: float, k_i: float, k_d: float) -> QHMParams:
    """Recht's PID controller as QHM; 1.1.0's spelling of :func:`qhoptim.convert.from_pid`."""
    return _qhm(convert.from_pid(k_p, k_i, k_d))


def from_synthesized_nesterov(alpha: float, beta1: float, beta2: float) -> QHMParams:
    """Lessard et al.'s synthesized Nesterov variant as QHM.

    1.1.0's spelling of :func:`qhoptim.convert.from_synthesized_nesterov`.
    """
    return _qhm(convert.from_synthesized_nesterov(alpha, beta1, beta2))


def from_robust_momentum(l: float, kappa: float, rho: float | None) -> QHMParams:
    """The Robust Momentum Method as QHM (``rho=None``: Triple Momentum).

    1.1.0's spelling of :func:`qhoptim.convert.from_robust_momentum`; ``rho``
    has no default here, as in 1.1.0.
    """
    return _qhm(convert.from_robust_momentum(l, kappa, rho))


def from_accsgd(delta: float, kappa: float, xi: float, eps: float) -> QHMParams:
    """AccSGD of Kidambi et al. (2018) as QHM.

    1.1.0's spelling of :func:`qhoptim.convert.from_accsgd`; ``eps`` has no
    default here, as in 1.1.0 (``convert.from_accsgd`` defaults it to 0.7).
    """
    return _qhm(convert.from_accsgd(delta, kappa, xi, eps))


def from_two_state_optimizer(
    h: float, k: float, l: float, m: float, q: float, z: float
) -> QHMParams:
    """The general two-state optimizer of Ma & Yarats (2019), App. D, as QHM.

    1.1.0's spelling of :func:`qhoptim.convert.from_two_state_optimizer`, whose
    ``nu`` corrects 1.1.0's outside App. D's conditions (see the module
    docstring). QHM's initial buffer: :func:`qhoptim.convert.two_state_initial_buffer`.
    """
    return _qhm(convert.from_two_state_optimizer(h, k, l, m, q, z))


def from_nadam(lr: float, beta1: float, beta2: float) -> QHAdamParams:
    """NAdam as QHAdam (modulo bias correction): ``nu1 = beta1``, ``nu2 = 1``.

    1.1.0's spelling of :func:`qhoptim.convert.from_nadam`, with the betas as
    two arguments and no ``eps`` (the conversion keeps ``eps`` as it is).
    """
    # Checked under 1.1.0's argument names first, so that errors name them.
    for value, name in ((beta1, "beta1"), (beta2, "beta2")):
        validation.require_real(value, name)
        validation.check_beta(value, name)
    p = convert.from_nadam(lr, (beta1, beta2), 0.0)
    return QHAdamParams(alpha=p.lr, nu1=p.nus[0], nu2=p.nus[1], beta1=p.betas[0], beta2=p.betas[1])
