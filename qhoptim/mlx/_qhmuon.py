"""QHMuon for MLX: Newton-Schulz on MLX's operations and the optimizer."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import mlx.core as mx

from qhoptim import convert, rules, validation
from qhoptim.mlx._base import (
    LearningRate,
    _check_real,
    _dtype_name,
    _NarrowState,
    _stored,
    _working,
)


def _matmul_add(c: mx.array, a: mx.array, b: mx.array, beta: float, alpha: float) -> mx.array:
    """``beta * c + alpha * (a @ b)`` as ``mlx.optimizers.Muon`` forms it:
    ``addmm(beta * c, a, b, alpha=alpha)``. ``addmm`` takes ``alpha`` as a
    float32, so in float64 the product is scaled as an array instead, keeping
    the coefficient's float64 value (the reference's numbers)."""
    if c.dtype == mx.float64:
        return beta * c + alpha * mx.matmul(a, b)
    return mx.addmm(beta * c, a, b, alpha=alpha, beta=1.0)


# Newton-Schulz on MLX as ``mlx.optimizers.Muon`` runs it; the norm keeps its
# dimensions.
_MLX_MATRIX_OPS = rules.MatrixOps(
    matmul=mx.matmul,
    matmul_add=_matmul_add,
    transpose=lambda x: x.T,
    norm=lambda x: mx.linalg.norm(x, keepdims=True),
    clamp_min=mx.maximum,
)

# The dtypes QHMuon's ns_dtype may be (None: the parameter's own).
_NS_DTYPES = (mx.bfloat16, mx.float16, mx.float32, mx.float64)


def _check_ns_dtype(value: Any, name: str) -> Any:
    """QHMuon's ``ns_dtype``: None or one of :data:`_NS_DTYPES`."""
    if value is not None and value not in _NS_DTYPES:
        names = ", ".join(f"mx.{_dtype_name(d)}" for d in _NS_DTYPES)  # a name is no dtype
        raise ValueError(f"{name} must be None or one of {names}; received {name}={value!r}")
    return value


class QHMuon(_NarrowState):
    r"""Muon with quasi-hyperbolic momentum: ``mlx.optimizers.Muon`` plus ``nu``.

    .. math::

        g_{t+1} &= \beta g_t + (1 - \beta) (\nabla_t + \lambda \theta_t) \\
        \theta_{t+1} &= \theta_t - \alpha\, r\, \mathrm{NS}\big((1 - \nu)
            (\nabla_t + \lambda \theta_t) + \nu g_{t+1}\big)

    MLX's Muon step, operation for operation, with its Nesterov switch replaced
    by ``nu``: ``nu=momentum`` is ``Muon(nesterov=True)``, ``nu=1``
    ``Muon(nesterov=False)`` (:func:`qhoptim.convert.from_muon`). As MLX's Muon:
    the weight decay is coupled (added to the gradient); an array of more than
    two dimensions is orthogonalized as the matrix ``(shape[0], -1)``; the
    learning rate is scaled by :math:`r = \sqrt{\max(1, A / B)}` for the last
    two dimensions :math:`A \times B`; arrays of fewer than two dimensions take
    QHM's direction as it is (MLX's advice stands: give them, the embedding and
    the output layer to AdamW). Newton-Schulz is :func:`qhoptim.rules.newton_schulz`
    with MLX's :math:`\lVert U \rVert_F + 10^{-7}`.

    Args:
      learning_rate: :math:`\alpha`, a number, an ``mx.array`` or a schedule.
      momentum: :math:`\beta`, in ``[0, 1)``.
      nu: :math:`\nu`, any finite real (default Muon's Nesterov, ``0.95``).
      weight_decay: :math:`\lambda \ge 0`, coupled, as MLX's Muon.
      ns_steps: Newton-Schulz steps, in ``[0, 100)``.
      ns_dtype: the dtype Newton-Schulz runs in (None: the parameter's, as
        MLX's Muon; ``mx.float64`` for the float64 reference's numbers).
      state_dtype, stochastic_rounding: store the buffer narrower, as
        :class:`QHM` does (the step in the parameter's dtype, the buffer
        written back with :mod:`qhoptim.rounding`'s stochastic rounding).

    State per parameter: ``momentum_buffer``.
    """

    _CHECKS = MappingProxyType(
        {
            "momentum": validation.check_beta,
            "nu": validation.check_nu,
            "weight_decay": validation.check_weight_decay,
            "ns_steps": validation.check_ns_steps,
            "ns_dtype": _check_ns_dtype,
        }
    )

    def __init__(
        self,
        learning_rate: LearningRate,
        momentum: float = 0.95,
        nu: float = 0.95,
        weight_decay: float = 0.01,
        ns_steps: int = rules.MUON_NS_STEPS,
        *,
        ns_dtype: mx.Dtype | None = None,
        state_dtype: mx.Dtype | None = None,
        stochastic_rounding: bool | None = None,
    ) -> None:
        validation.check_qhmuon(
            lr=learning_rate,
            momentum=momentum,
            nu=nu,
            weight_decay=weight_decay,
            eps=rules.MUON_EPS,
            ns_steps=ns_steps,
            ns_coefficients=rules.MUON_NS_COEFFICIENTS,
            adjust_lr_fn=None,
            adjustments=rules.MUON_LR_ADJUSTMENTS,
            names={"lr": "learning_rate"},
        )
        _check_ns_dtype(ns_dtype, "ns_dtype")
        self._start(learning_rate, momentum=momentum, nu=nu, weight_decay=weight_decay)
        self.momentum, self.nu = validation.as_float(momentum), validation.as_float(nu)
        self.weight_decay = validation.as_float(weight_decay)
        self.ns_steps, self.ns_dtype = int(ns_steps), ns_dtype
        self._set_state_dtype(state_dtype, stochastic_rounding)

    @classmethod
    def from_params(cls, params: convert.QHMuonParams, **kwargs: Any) -> QHMuon:
        """Build from :func:`qhoptim.convert.from_muon`'s settings; ``kwargs``
        (``learning_rate`` first) go to the constructor."""
        validation.check_conversion(f"{cls.__name__}.from_params", params, convert.QHMuonParams)
        return cls(**{**params.as_kwargs(), **kwargs})

    def init_single(self, parameter: mx.array, state: dict[str, Any]) -> None:
        _check_real(parameter)
        state["momentum_buffer"] = self._zeros(parameter)

    def apply_single(
        self, gradient: mx.array, parameter: mx.array, state: dict[str, Any]
    ) -> mx.array:
        if self.weight_decay != 0:
            gradient = rules.coupled_weight_decay(gradient, parameter, self.weight_decay)
        (buf,) = self._held([state["momentum_buffer"]], parameter)
        noise = self._noise([buf], parameter)
        new_buf, direction = rules.qhm_update(
            gradient, _working(buf, parameter), momentum=self.momentum, nu=self.nu
        )
        state["momentum_buffer"] = _stored(new_buf, buf.dtype, noise)
        lr = self.learning_rate.astype(gradient.dtype)
        if direction.ndim < 2 or direction.size == 0:  # an empty matrix steps as nothing
            stepped: mx.array = rules.apply_update(parameter, direction, lr)
            return stepped
        matrix = direction.reshape(direction.shape[0], -1)
        # float16 is normalized in float32 first (rules.newton_schulz's ``narrow``).
        half = (matrix.dtype if self.ns_dtype is None else self.ns_dtype) == mx.float16
        if half:
            matrix = matrix.astype(mx.float32)
        elif self.ns_dtype is not None:
            matrix = matrix.astype(self.ns_dtype)
        rows, columns = matrix.shape
        orthogonal = rules.newton_schulz(
            matrix, rows=rows, columns=columns,
            ops=_MLX_MATRIX_OPS, steps=self.ns_steps, norm_guard="add",
            narrow=(lambda x: x.astype(mx.float16)) if half else None,
        )  # fmt: skip
        update = orthogonal.reshape(direction.shape).astype(direction.dtype)
        ratio = rules.muon_lr_ratio(None, direction.shape[-2], direction.shape[-1])
        stepped = rules.apply_update(parameter, update, lr * ratio)
        return stepped
