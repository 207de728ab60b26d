"""QHM for MLX: the compiled step of one parameter and the optimizer."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import mlx.core as mx

from qhoptim import convert, rules, validation
from qhoptim.mlx._base import (
    LearningRate,
    _check_real,
    _is_number,
    _materialized,
    _Noise,
    _QHOptimizer,
    _stored,
    _working,
)

# One parameter's step, compiled: MLX fuses it into one kernel (on the CPU it
# compiles C++ on first use and caches it; without a compiler it runs the ops
# one by one). Python-number hyperparameters are constants of the compiled
# function, so ``1 - beta`` is formed in float64 before it meets the array.


@mx.compile
def _qhm_step(
    grad: mx.array, param: mx.array, buf: mx.array, lr: mx.array, factor: Any,
    momentum: Any, nu: Any, coupled_wd: Any, noise: _Noise | None = None,
) -> tuple[mx.array, mx.array]:  # fmt: skip
    """One parameter's step; ``lr`` (in the parameter's dtype) and the decoupled
    decay ``factor`` are this step's, computed once for all parameters. The
    weights stay Python numbers, constants of the kernel: each array scalar is
    one more broadcast input of the fused kernel, measurably slower on the CPU.
    A buffer stored narrower than the parameter steps in the parameter's dtype
    and is stored back with :func:`_stored` (``noise``: its seed and positions)."""
    if coupled_wd:
        grad = rules.coupled_weight_decay(grad, param, coupled_wd)
    new_buf, direction = rules.qhm_update(grad, _working(buf, param), momentum=momentum, nu=nu)
    return _stored(new_buf, buf.dtype, noise), rules.apply_update(param, direction, lr, factor)


class QHM(_QHOptimizer):
    r"""Quasi-hyperbolic momentum.

    .. math::

        g_{t+1} &= \beta g_t + (1 - \beta) \nabla_t \\
        \theta_{t+1} &= \theta_t - \alpha \left[(1 - \nu) \nabla_t + \nu g_{t+1}\right]

    The buffer :math:`g` is normalized (an average of past gradients), unlike
    ``mlx.optimizers.SGD``'s velocity: ``SGD(lr, momentum=beta)`` is
    ``QHM(lr / (1 - beta), beta, nu=1.0)`` and ``nesterov=True`` is
    ``nu=beta`` (:meth:`from_params` with :func:`qhoptim.convert.from_nesterov`).

    Args:
      learning_rate: :math:`\alpha`, a number, an ``mx.array`` or a schedule
        (a callable of the step, as MLX's ``optimizers.cosine_decay``).
      momentum: :math:`\beta`, in ``[0, 1)``.
      nu: :math:`\nu`, any finite real (0: SGD, 1: momentum, beta: Nesterov).
      weight_decay: :math:`\lambda \ge 0`; coupled (L2, ``grad + lambda *
        param``) unless ``decoupled_weight_decay``.
      decoupled_weight_decay: multiply the parameter by ``1 - alpha * lambda``
        before the step instead (AdamW-style).
      state_dtype: store the buffer in this dtype (``mx.bfloat16``: half a
        float32 model's state); the step runs in the parameter's dtype and
        writes back with :mod:`qhoptim.rounding`'s stochastic rounding.
      stochastic_rounding: ``None`` (stochastic for bfloat16) or a bool;
        ``False`` rounds to nearest.
      fused: ``True``: each float32 parameter with a float32 or bfloat16
        state steps in the C++ kernel (see the module's notes; a
        ``RuntimeError`` says what is missing where it cannot be built), other
        parameters with MLX's operations. ``None``: only a bfloat16 state, and
        only where the default device is the CPU and the kernel builds.
        ``False``: MLX's operations always. The numbers are the same.

    State per parameter: ``momentum_buffer``.

    Example:
      >>> import mlx.core as mx
      >>> import qhoptim.mlx as qhmlx
      >>> optimizer = qhmlx.QHM(learning_rate=0.5)
      >>> params = {"x": mx.array([1.0, 2.0, 3.0])}
      >>> for _ in range(3):  # the gradient of sum(x**2)
      ...     params = optimizer.apply_gradients({"x": 2 * params["x"]}, params)
      >>> print(f"{mx.sum(params['x'] ** 2).item():.4f}")  # qhoptim.reference.QHM gives 1.62121
      1.6212
    """

    _CHECKS = MappingProxyType(
        {
            "momentum": validation.check_beta,
            "nu": validation.check_nu,
            "weight_decay": validation.check_weight_decay,
            "decoupled_weight_decay": validation.check_bool,
        }
    )

    def __init__(
        self,
        learning_rate: LearningRate,
        momentum: float = 0.999,
        nu: float = 0.7,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        *,
        state_dtype: mx.Dtype | None = None,
        stochastic_rounding: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        validation.check_qhm(
            lr=learning_rate,
            momentum=momentum,
            nu=nu,
            weight_decay=weight_decay,
            names={"lr": "learning_rate"},
        )
        validation.check_bool(decoupled_weight_decay, "decoupled_weight_decay")
        self._start(learning_rate, momentum=momentum, nu=nu, weight_decay=weight_decay)
        # Concrete scalars (a NumPy float, a 0-d array) as the Python floats they hold.
        self.momentum, self.nu = validation.as_float(momentum), validation.as_float(nu)
        self.weight_decay = validation.as_float(weight_decay)
        self.decoupled_weight_decay = decoupled_weight_decay
        self._set_state_dtype(state_dtype, stochastic_rounding)
        self._set_fused(fused)

    @classmethod
    def from_params(cls, params: convert.QHMParams, **kwargs: Any) -> QHM:
        """Build from a :class:`qhoptim.convert.QHMParams`, e.g. a conversion's result."""
        validation.check_conversion(f"{cls.__name__}.from_params", params, convert.QHMParams)
        return cls(params.lr, params.momentum, params.nu, **kwargs)

    def init_single(self, parameter: mx.array, state: dict[str, Any]) -> None:
        _check_real(parameter)
        state["momentum_buffer"] = self._zeros(parameter)

    def apply_single(
        self, gradient: mx.array, parameter: mx.array, state: dict[str, Any]
    ) -> mx.array:
        (buf,) = self._held([state["momentum_buffer"]], parameter)
        store = self._kernel_store(gradient, parameter, [buf])
        if store is not None:
            buf, parameter = self._fused_step(gradient, parameter, [buf], store)
            state["momentum_buffer"] = buf
            return parameter
        lr, factor = self._coefficients_for(parameter.dtype)
        state["momentum_buffer"], parameter = _qhm_step(
            gradient, parameter, buf, lr, factor,
            self.momentum, self.nu, self._coupled_weight_decay(), self._noise([buf], parameter),
        )  # fmt: skip
        return parameter

    def _kernel_inputs(self) -> tuple[list[Any], dict[str, Any]]:
        lr, factor = self._coefficients_for(mx.float32)
        coupled_wd = self._coupled_weight_decay()
        values = [*rules.qhm_coefficients(self.momentum, self.nu), lr, factor, coupled_wd]
        form = {"qhadam": False, "denominator": 0, "grad_term": True}
        return values, {**form, "coupled": coupled_wd != 0, "decay": not _is_number(factor, 1)}

    def _step_coefficients(self, dtype: mx.Dtype) -> tuple[mx.array, Any]:
        """This step's learning rate and decoupled decay factor, in ``dtype``."""
        lr = _materialized(self.learning_rate.astype(dtype))
        return lr, self._decay_factor(lr)
