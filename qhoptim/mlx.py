r"""QHM, QHAdam and QHAdamW for Apple's MLX (``mlx.optimizers.Optimizer`` subclasses).

They are used like ``mlx.optimizers.SGD`` and ``Adam``: ``optimizer.update(model,
grads)`` after ``nn.value_and_grad``, a learning rate that is a number or one
of MLX's schedules, the state in ``optimizer.state`` (saved with
``mlx.utils.tree_flatten`` and ``mx.save_safetensors``), and a training step
that ``mx.compile`` compiles with ``inputs=`` / ``outputs=`` naming the state::

    import mlx.optimizers as optim
    import qhoptim.mlx as qhmlx

    optimizer = qhmlx.QHM(learning_rate=1.0, momentum=0.999, nu=0.7)  # the rule of thumb
    optimizer = qhmlx.QHAdam(optim.cosine_decay(1e-3, 10_000), betas=(0.999, 0.999), nus=(0.7, 1.0))

The math of every step comes from :mod:`qhoptim.rules`; this module only keeps
MLX's optimizer conventions. Each parameter's step is one ``mx.compile``\ d
function of the rule, so an eager step is one fused kernel per parameter and a
compiled training step inlines it. Hyperparameters other than the learning
rate are Python numbers and constants of that function (``1 - beta`` is formed
in float64 before it meets the array, as in every backend); the first step of
a configuration compiles its kernel, and changing one of them later compiles
again. Schedule only ``learning_rate``.

Dtypes: a Python float ``learning_rate`` becomes a float32 ``mx.array`` (MLX's
convention), so float64 parameters would step with a learning rate rounded to
float32. A float64 user passes ``learning_rate=mx.array(lr, dtype=mx.float64)``
or a schedule that returns float64 (float64 runs on MLX's CPU stream).

References:
  Ma & Yarats, `Quasi-hyperbolic momentum and Adam for deep learning
  <https://arxiv.org/abs/1810.06801>`_, ICLR 2019.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

try:
    import mlx.core as mx
    import mlx.optimizers as optim
except ImportError as error:  # pragma: no cover - exercised where MLX is absent
    raise ImportError(
        f"qhoptim.mlx needs MLX ({error.name} is not installed). "
        'Install it with `pip install "qhoptim[mlx]"`.'
    ) from error

from qhoptim import convert, rules, validation

__all__ = ["QHM", "QHAdam", "QHAdamW"]

LearningRate = float | mx.array | Callable[[mx.array], mx.array]


# One parameter's step, compiled: MLX fuses it into one kernel (on the CPU it
# compiles C++ on first use and caches it; without a compiler it runs the ops
# one by one). Python-number hyperparameters are constants of the compiled
# function, so ``1 - beta`` is formed in float64 before it meets the array.


@mx.compile
def _qhm_step(
    grad: mx.array, param: mx.array, buf: mx.array, lr: mx.array, factor: Any,
    momentum: Any, nu: Any, coupled_wd: Any,
) -> tuple[mx.array, mx.array]:  # fmt: skip
    """One parameter's step; ``lr`` (in the parameter's dtype) and the decoupled
    decay ``factor`` are this step's, computed once for all parameters. The
    weights stay Python numbers, constants of the kernel: each array scalar is
    one more broadcast input of the fused kernel, measurably slower on the CPU."""
    if coupled_wd:
        grad = rules.coupled_weight_decay(grad, param, coupled_wd)
    buf, direction = rules.qhm_update(grad, buf, momentum=momentum, nu=nu)
    return buf, rules.apply_update(param, direction, lr, factor)


def _sqrt(x: Any) -> Any:
    """A number's square root as a number (``mx.sqrt`` would make it a float32
    array, and round it so for float64 parameters), an array's as an array."""
    return math.sqrt(x) if isinstance(x, (int, float)) else mx.sqrt(x)


def _is_number(x: Any, value: float) -> bool:
    return isinstance(x, (int, float)) and x == value


def _scaled(param: mx.array, factor: Any) -> mx.array:
    """``param * factor``; ``param`` itself for the number 1 (no decoupled decay)."""
    return param if _is_number(factor, 1) else param * factor


@mx.compile
def _qhadam_step(
    grad: mx.array, param: mx.array, m: mx.array, v: mx.array, v_max: mx.array | None,
    form: Any, weights: tuple[Any, ...], factor: Any, b1: Any, b2: Any, coupled_wd: Any,
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
    m = rules.ewma(m, grad, b1)
    v = rules.ewma(v, grad * grad, b2)
    if v_max is not None:
        v_max = rules.amsgrad_maximum(v_max, v, maximum=mx.maximum)
    delta = rules.folded_qhadam_step(folded, grad, m, v if v_max is None else v_max, sqrt=mx.sqrt)
    param = _scaled(param, factor) + delta
    return (m, v, param) if v_max is None else (m, v, v_max, param)


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


def _materialized(x: Any) -> Any:
    """An array as its own computation (a number as it is): inside an
    ``mx.compile``-d training step MLX would otherwise fuse a scalar chain into
    each parameter's element-wise kernel and evaluate it once per element."""
    return mx.contiguous(x) if isinstance(x, mx.array) else x


def _check_real(parameter: mx.array) -> None:
    if not mx.issubdtype(parameter.dtype, mx.floating):
        raise TypeError(f"qhoptim.mlx optimizes real floating-point arrays; got {parameter.dtype}")


def _check_params(cls: type, params: object, expected: type) -> None:
    """``from_params`` takes a conversion's result of the optimizer's own kind."""
    if not isinstance(params, expected):
        raise TypeError(
            f"{cls.__name__}.from_params expects qhoptim.convert.{expected.__name__}; "
            f"received {type(params).__name__}"
        )


class _QHOptimizer(optim.Optimizer):
    """What QHM and QHAdam share: the step's scalar coefficients, computed once
    per step and dtype for all parameters (:meth:`_step_coefficients`)."""

    weight_decay: float
    decoupled_weight_decay: bool

    def apply_gradients(self, gradients: dict[str, Any], parameters: dict[str, Any]) -> Any:
        self._coefficients: dict[Any, Any] = {}
        return super().apply_gradients(gradients, parameters)

    def _coefficients_for(self, dtype: mx.Dtype) -> Any:
        if dtype not in self._coefficients:
            self._coefficients[dtype] = self._step_coefficients(dtype)
        return self._coefficients[dtype]

    def _step_coefficients(self, dtype: mx.Dtype) -> Any:
        raise NotImplementedError

    def _decay_factor(self, lr: mx.array) -> Any:
        """The decoupled decay factor ``1 - lr * weight_decay``, or the number 1."""
        if self.decoupled_weight_decay and self.weight_decay != 0:
            return _materialized(rules.decoupled_decay_factor(lr, self.weight_decay))
        return 1

    def _coupled_weight_decay(self) -> float:
        return 0.0 if self.decoupled_weight_decay else self.weight_decay


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

    def __init__(
        self,
        learning_rate: LearningRate,
        momentum: float = 0.999,
        nu: float = 0.7,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
    ) -> None:
        validation.check_qhm(
            lr=learning_rate,
            momentum=momentum,
            nu=nu,
            weight_decay=weight_decay,
            names={"lr": "learning_rate"},
        )
        super().__init__()  # type: ignore[no-untyped-call]
        self._maybe_schedule("learning_rate", learning_rate)  # type: ignore[arg-type]
        self.momentum, self.nu = momentum, nu
        self.weight_decay, self.decoupled_weight_decay = weight_decay, decoupled_weight_decay

    @classmethod
    def from_params(cls, params: convert.QHMParams, **kwargs: Any) -> QHM:
        """Build from a :class:`qhoptim.convert.QHMParams`, e.g. a conversion's result."""
        _check_params(cls, params, convert.QHMParams)
        return cls(params.lr, params.momentum, params.nu, **kwargs)

    def init_single(self, parameter: mx.array, state: dict[str, Any]) -> None:
        _check_real(parameter)
        state["momentum_buffer"] = mx.zeros_like(parameter)

    def apply_single(
        self, gradient: mx.array, parameter: mx.array, state: dict[str, Any]
    ) -> mx.array:
        lr, factor = self._coefficients_for(parameter.dtype)
        state["momentum_buffer"], parameter = _qhm_step(
            gradient, parameter, state["momentum_buffer"], lr, factor,
            self.momentum, self.nu, self._coupled_weight_decay(),
        )  # fmt: skip
        return parameter

    def _step_coefficients(self, dtype: mx.Dtype) -> tuple[mx.array, Any]:
        """This step's learning rate and decoupled decay factor, in ``dtype``."""
        lr = _materialized(self.learning_rate.astype(dtype))
        return lr, self._decay_factor(lr)


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
    ) -> None:
        validation.check_bool(amsgrad, "amsgrad")
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
        super().__init__()  # type: ignore[no-untyped-call]
        self._maybe_schedule("learning_rate", learning_rate)  # type: ignore[arg-type]
        self.betas, self.nus, self.eps, self.amsgrad = (b1, b2), (nu1, nu2), eps, amsgrad
        self.weight_decay, self.decoupled_weight_decay = weight_decay, decoupled_weight_decay

    @classmethod
    def from_params(cls, params: convert.QHAdamParams, **kwargs: Any) -> QHAdam:
        """Build from a :class:`qhoptim.convert.QHAdamParams`, e.g. ``convert.from_nadam(...)``."""
        _check_params(cls, params, convert.QHAdamParams)
        return cls(params.lr, params.betas, params.nus, params.eps, **kwargs)

    def init_single(self, parameter: mx.array, state: dict[str, Any]) -> None:
        _check_real(parameter)
        state["m"] = mx.zeros_like(parameter)
        state["v"] = mx.zeros_like(parameter)
        if self.amsgrad:
            state["v_max"] = mx.zeros_like(parameter)

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

    def apply_single(
        self, gradient: mx.array, parameter: mx.array, state: dict[str, Any]
    ) -> mx.array:
        folded, factor = self._coefficients_for(parameter.dtype)
        if self.amsgrad and "v_max" not in state:  # amsgrad switched on for a stepped state
            state["v_max"] = mx.zeros_like(state["v"])  # max(0, v) = v, as torch's
        *moments, parameter = _qhadam_step(
            gradient, parameter, state["m"], state["v"], state["v_max"] if self.amsgrad else None,
            folded.denominator.value, tuple(folded[1:]), factor, *self.betas,
            self._coupled_weight_decay(),
        )  # fmt: skip
        state.update(zip(("m", "v", "v_max") if self.amsgrad else ("m", "v"), moments, strict=True))
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
    ) -> None:
        super().__init__(learning_rate, betas, nus, eps, weight_decay, True, amsgrad=amsgrad)
