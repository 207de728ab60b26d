"""QHAdam and QHAdamW for MLX: the compiled step of one parameter and the optimizers."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

import mlx.core as mx

from qhoptim import convert, rounding, rules, validation
from qhoptim.mlx._base import (
    _DENOMINATORS,
    LearningRate,
    _check_real,
    _dtype_name,
    _is_number,
    _materialized,
    _Noise,
    _pair,
    _QHOptimizer,
    _scaled,
    _sqrt,
    _stored,
    _working,
)


@mx.compile
def _qhadam_step(
    grad: mx.array, param: mx.array, m: mx.array, v: mx.array, v_max: mx.array | None,
    form: Any, weights: tuple[Any, ...], factor: Any, b1: Any, b2: Any, coupled_wd: Any,
    noise: _Noise | None = None,
) -> tuple[mx.array, ...]:  # fmt: skip
    """One parameter's step in the folded form the fused kernels of every
    backend use (:func:`qhoptim.rules.folded_qhadam_step`): the step's scalar
    coefficients (``folded``, with the learning rate, and the decoupled decay
    ``factor``) are computed once per step for all parameters, so that the
    element-wise kernel does only the moments' and the update's arithmetic.
    ``form`` is the fold's :class:`~qhoptim.rules.Denominator` by value and
    ``weights`` its other fields (``mx.compile`` takes arrays and numbers)."""
    folded = rules.FoldedQHAdam(rules.Denominator(form), *weights)
    if coupled_wd:
        grad = rules.coupled_weight_decay(grad, param, coupled_wd)
    stored = [m, v] if v_max is None else [m, v, v_max]
    m, v, *rest = (_working(x, param) for x in stored)
    m = rules.ewma(m, grad, b1)
    v = rules.ewma(v, grad * grad, b2)
    if rest:
        rest = [rules.amsgrad_maximum(rest[0], v, maximum=mx.maximum)]
    delta = rules.folded_qhadam_step(folded, grad, m, rest[0] if rest else v, sqrt=mx.sqrt)
    param = _scaled(param, factor) + delta
    moments = [
        _stored(x, kept.dtype, noise, k)
        for k, (x, kept) in enumerate(zip([m, v, *rest], stored, strict=True))
    ]
    return (*moments, param)


def _bias_correction(beta: Any, step: mx.array, dtype: mx.Dtype) -> mx.array:
    """``1 - beta**step`` by :func:`qhoptim.rules.bias_correction`'s policy, in ``dtype``.

    float64 parameters: ``1 - beta**t`` in float64, as the reference computes
    it. Below float64: ``-expm1(t * log(beta))`` in float32 (``log`` of a
    Python ``beta`` taken in float64), which keeps float32's relative precision
    near ``beta = 1``, then rounded to the parameter's dtype.
    """
    if dtype == mx.float64:
        bc = rules.bias_correction(beta, step.astype(mx.float64))
    else:
        log = mx.log if isinstance(beta, mx.array) else math.log
        t = step.astype(mx.float32)
        bc = rules.bias_correction(beta, t, expm1=mx.expm1, log=log).astype(dtype)
    # Materialized (3x the step's time with a single large parameter otherwise,
    # expm1 or pow evaluated once per element).
    return mx.contiguous(bc)


class QHAdam(_QHOptimizer):
    r"""QHAdam: Adam with quasi-hyperbolic moment estimators.

    .. math::

        \theta_{t+1} = \theta_t - \alpha \,
            \frac{(1 - \nu_1) \nabla_t + \nu_1 \hat g_{t+1}}
                 {\sqrt{(1 - \nu_2) \nabla_t^2 + \nu_2 \hat s_{t+1}} + \epsilon}

    with bias-corrected moments :math:`\hat g, \hat s`. ``nus=(1, 1)`` is
    ``mlx.optimizers.Adam(..., bias_correction=True)``; the moments keep
    Adam's state names, ``m`` and ``v``. Bias correction is always on (it is
    the paper's QHAdam).

    Args:
      learning_rate: :math:`\alpha`, a number, an ``mx.array`` or a schedule.
      betas: :math:`(\beta_1, \beta_2)`, each in ``[0, 1)``.
      nus: :math:`(\nu_1, \nu_2)`: ``nu1`` any finite real, ``nu2`` in ``[0, 1]``.
      eps: added to the denominator after the square root, ``>= 0``.
      weight_decay: :math:`\lambda \ge 0`; coupled (L2) unless
        ``decoupled_weight_decay``.
      decoupled_weight_decay: decay as AdamW does (see :class:`QHAdamW`).
      amsgrad: the AMSGrad variant (:func:`qhoptim.rules.qhadam_amsgrad_update`,
        as ``torch.optim.Adam(amsgrad=True)``): the denominator reads the running
        maximum ``v_max`` of the uncorrected second moment, an extra state.
      state_dtype: store the moments in this dtype (``mx.bfloat16``: 4 bytes
        per float32 parameter instead of 8), as :class:`QHM`'s buffer.
      stochastic_rounding: as :class:`QHM`'s.
      fused: as :class:`QHM`'s.

    Example:
      >>> import mlx.core as mx
      >>> import qhoptim.mlx as qhmlx
      >>> optimizer = qhmlx.QHAdam(learning_rate=0.1, nus=(0.7, 1.0))
      >>> params = {"x": mx.array([1.0, 2.0, 3.0])}
      >>> for _ in range(3):
      ...     params = optimizer.apply_gradients({"x": 2 * params["x"]}, params)
      >>> print(f"{mx.sum(params['x'] ** 2).item():.4f}")  # qhoptim.reference.QHAdam gives 10.69798
      10.6980
    """

    _CHECKS = MappingProxyType(
        {
            "betas": _pair(validation.check_beta, validation.check_beta),
            "nus": _pair(validation.check_nu, validation.check_nu2),
            "eps": validation.check_eps,
            "weight_decay": validation.check_weight_decay,
            "decoupled_weight_decay": validation.check_bool,
            "amsgrad": validation.check_bool,
        }
    )

    def __init__(
        self,
        learning_rate: LearningRate,
        betas: tuple[float, float] = (0.9, 0.999),
        nus: tuple[float, float] = (1.0, 1.0),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        *,
        amsgrad: bool = False,
        state_dtype: mx.Dtype | None = None,
        stochastic_rounding: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        validation.check_bool(amsgrad, "amsgrad")
        validation.check_bool(decoupled_weight_decay, "decoupled_weight_decay")
        b1, b2 = validation.check_pair(betas, "betas")
        nu1, nu2 = validation.check_pair(nus, "nus")
        validation.check_qhadam(
            lr=learning_rate,
            beta1=b1,
            beta2=b2,
            nu1=nu1,
            nu2=nu2,
            eps=eps,
            weight_decay=weight_decay,
            names={
                "lr": "learning_rate",
                "beta1": "betas[0]",
                "beta2": "betas[1]",
                "nu1": "nus[0]",
                "nu2": "nus[1]",
            },
        )
        self._start(
            learning_rate,
            **{"betas[0]": b1, "betas[1]": b2, "nus[0]": nu1, "nus[1]": nu2},
            eps=eps,
            weight_decay=weight_decay,
        )
        # Concrete scalars (a NumPy float, a 0-d array) as the Python floats they hold.
        b1, b2, nu1, nu2, eps = map(validation.as_float, (b1, b2, nu1, nu2, eps))
        self.betas, self.nus, self.eps, self.amsgrad = (b1, b2), (nu1, nu2), eps, amsgrad
        self.weight_decay = validation.as_float(weight_decay)
        self.decoupled_weight_decay = decoupled_weight_decay
        self._set_state_dtype(state_dtype, stochastic_rounding)
        rounding.check_second_moment_dtype(_dtype_name(state_dtype))
        self._set_fused(fused)

    @classmethod
    def from_params(cls, params: convert.QHAdamParams, **kwargs: Any) -> QHAdam:
        """Build from a :class:`qhoptim.convert.QHAdamParams`, e.g. ``convert.from_nadam(...)``."""
        validation.check_conversion(f"{cls.__name__}.from_params", params, convert.QHAdamParams)
        return cls(params.lr, params.betas, params.nus, params.eps, **kwargs)

    def init_single(self, parameter: mx.array, state: dict[str, Any]) -> None:
        _check_real(parameter)
        state["m"] = self._zeros(parameter)
        state["v"] = self._zeros(parameter)
        if self.amsgrad:
            state["v_max"] = self._zeros(parameter)

    def _step_coefficients(self, dtype: mx.Dtype) -> tuple[rules.FoldedQHAdam, Any]:
        """This step's folded coefficients and decoupled decay factor, in ``dtype``.

        :func:`qhoptim.rules.qhadam_coefficients` of the bias corrections,
        folded with the learning rate by :func:`qhoptim.rules.fold_qhadam`: the
        common factor comes out of the square root when the denominator has
        one term (with both, which term's weight to factor out depends on the
        values, so they stay as they are). Each array is materialized.
        """
        (b1, b2), (nu1, nu2) = self.betas, self.nus
        lr = self.learning_rate.astype(dtype)
        bc1 = _bias_correction(b1, self.step, dtype)
        bc2 = _bias_correction(b2, self.step, dtype)
        c = rules.qhadam_coefficients(nu1, nu2, bc1, bc2)
        form = rules.qhadam_denominator(nu2)
        one_term = form is not rules.Denominator.MIX
        folded = rules.fold_qhadam(c, lr, self.eps, form, factor_out=one_term, sqrt=_sqrt)
        return rules.FoldedQHAdam(*map(_materialized, folded)), self._decay_factor(lr)

    def _kernel_inputs(self) -> tuple[list[Any], dict[str, Any]]:
        folded, factor = self._coefficients_for(mx.float32)
        (b1, b2), coupled_wd = self.betas, self._coupled_weight_decay()
        values = [b1, 1 - b1, b2, 1 - b2, *folded[1:], factor, coupled_wd]
        form = {
            "qhadam": True,
            "denominator": _DENOMINATORS[folded.denominator],
            "grad_term": not _is_number(folded.grad_value, 0),
            "coupled": coupled_wd != 0,
            "decay": not _is_number(factor, 1),
        }
        return values, form

    def apply_single(
        self, gradient: mx.array, parameter: mx.array, state: dict[str, Any]
    ) -> mx.array:
        if self.amsgrad and "v_max" not in state:  # amsgrad switched on for a stepped state
            state["v_max"] = mx.zeros_like(state["v"])  # max(0, v) = v, as torch's (its dtype)
        keys = ("m", "v", "v_max") if self.amsgrad else ("m", "v")
        stored = self._held([state[k] for k in keys], parameter)
        store = self._kernel_store(gradient, parameter, stored)
        if store is not None:
            *moments, parameter = self._fused_step(gradient, parameter, stored, store)
            state.update(zip(keys, moments, strict=True))
            return parameter
        folded, factor = self._coefficients_for(parameter.dtype)
        *moments, parameter = _qhadam_step(
            gradient, parameter, stored[0], stored[1], stored[2] if self.amsgrad else None,
            folded.denominator.value, tuple(folded[1:]), factor, *self.betas,
            self._coupled_weight_decay(), self._noise(stored, parameter),
        )  # fmt: skip
        state.update(zip(keys, moments, strict=True))
        return parameter


class QHAdamW(QHAdam):
    r"""QHAdam with decoupled weight decay, as ``mlx.optimizers.AdamW``.

    :math:`\theta \leftarrow (1 - \alpha\lambda)\,\theta` before the QHAdam
    step. ``weight_decay`` defaults to ``0.01``, MLX ``AdamW``'s default.
    """

    def __init__(
        self,
        learning_rate: LearningRate,
        betas: tuple[float, float] = (0.9, 0.999),
        nus: tuple[float, float] = (1.0, 1.0),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        amsgrad: bool = False,
        state_dtype: mx.Dtype | None = None,
        stochastic_rounding: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        super().__init__(
            learning_rate, betas, nus, eps, weight_decay, True, amsgrad=amsgrad,
            state_dtype=state_dtype, stochastic_rounding=stochastic_rounding, fused=fused,
        )  # fmt: skip
