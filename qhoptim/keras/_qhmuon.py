"""QHMuon for Keras 3: ``keras.optimizers.Muon`` with QHM's immediate discount ``nu``."""

from __future__ import annotations

import inspect
import operator
from types import MappingProxyType
from typing import Any

import keras
from keras import ops

from qhoptim import convert, rounding, rules, validation
from qhoptim.keras import _narrow
from qhoptim.keras._base import (
    CheckedLearningRate,
    WholeStoreLoading,
    as_float,
    dense_gradient,
    documented,
    learning_rate_value,
)

__all__ = ["QHMuon"]


def _matmul_add(c: Any, a: Any, b: Any, beta: Any, alpha: Any) -> Any:
    # ``beta * c + alpha * a @ b`` as Keras's Muon writes it: Python evaluates
    # ``alpha * a @ b`` as ``(alpha * a) @ b``.
    return beta * c + alpha * a @ b


def _transpose(x: Any) -> Any:
    return ops.transpose(x, (1, 0))


# Newton-Schulz as Keras's Muon runs it: the norm plus 1e-7, kept 2-D, and
# products by the ``@`` operator (the backend's own; ``keras.ops.matmul`` adds
# dtype handling per call, a tenth of an eager torch step).
_KERAS_MATRIX_OPS = rules.MatrixOps(
    matmul=operator.matmul,
    matmul_add=_matmul_add,
    transpose=_transpose,
    norm=lambda x: ops.norm(x, axis=(-2, -1), keepdims=True),
    clamp_min=ops.maximum,
)

#: The epsilon Keras's Muon adds to the norm it divides by (not an argument there).
KERAS_MUON_NORM_EPS = 1e-7


def _muon_keeps_a_slot_per_index() -> bool:
    """Whether this Keras's Muon hands each variable's momentum to its step (the
    Muon of recent Keras; 3.10's kept slots in dicts by path and stepped 3-D and
    4-D variables too)."""
    step = getattr(keras.optimizers, "Muon", None)
    if step is None:
        return False
    return len(inspect.signature(step._muon_update_step).parameters) == 5


def _check_coefficient(value: Any, name: str) -> Any:
    return validation.check_finite(validation.require_real(value, name), name)


@keras.saving.register_keras_serializable(package="qhoptim")
@documented
class QHMuon(
    validation.CheckedAttributes,
    CheckedLearningRate,
    WholeStoreLoading,
    keras.optimizers.Muon,  # type: ignore[misc]
):
    r"""Muon with quasi-hyperbolic momentum: ``keras.optimizers.Muon`` plus ``nu``.

    For each variable Keras's Muon steps with Muon (2-D variables but
    embeddings and ``exclude_layers``), with the momentum trace :math:`m`:

    .. math::

        m_{t+1} &= \beta m_t + \nabla_t \\
        \theta_{t+1} &= \theta_t - \alpha\, r\, \mathrm{NS}\Big(\frac{1 - \nu}{1 - \beta}
            \nabla_t + \nu m_{t+1}\Big)

    QHM's direction over Keras's unnormalized trace
    (:func:`qhoptim.rules.qhm_trace_update`): ``nu=momentum`` is Keras's
    ``Muon(nesterov=True)`` (:math:`\nabla_t + \beta m_{t+1}`), ``nu=1``
    ``Muon(nesterov=False)`` (:math:`m_{t+1}`); :func:`qhoptim.convert.from_muon`
    gives the settings. Everything else is Keras's Muon, inherited: the AdamW
    step of the other variables, ``rms_rate``'s scaling
    :math:`r = \text{rms\_rate} \sqrt{\max(A, B)}`, the decoupled weight decays,
    the configuration. Newton-Schulz is :func:`qhoptim.rules.newton_schulz`
    with Keras's :math:`\lVert U \rVert_F + 10^{-7}`.

    Args:
        learning_rate: as Keras's Muon (default 0.001).
        nu: Float (keyword only). :math:`\nu`, any finite real. Defaults to
            `0.95`, Keras's default ``momentum``: its Nesterov direction.
        state_dtype: String (keyword only). Store the momentum slot of each
            variable Muon steps in this dtype (``"bfloat16"``: half a float32
            slot), as :class:`QHM` stores its own; the step runs in the
            variable's dtype. AdamW's slots (the other variables') keep their
            variable's dtype. Defaults to `None`.
        stochastic_rounding: Bool (keyword only). With ``state_dtype``: `None`
            rounds bfloat16 stochastically (:mod:`qhoptim.rounding`), `False`
            to nearest.
        **kwargs: every other argument of ``keras.optimizers.Muon`` (``momentum``,
            ``ns_steps``, ``muon_a``/``muon_b``/``muon_c``, ``weight_decay``,
            ``rms_rate``, the ``adam_*`` settings, ``exclude_layers``, ...),
            but ``nesterov``, which ``nu`` replaces; and Keras's base keywords:
        {{base_optimizer_keyword_args}}

    Needs the Muon of recent Keras (which hands each variable's momentum to
    its step: Keras 3.13 and later); an earlier one is refused with the version found.
    """

    momentum: float
    nu: float
    _CHECKS = MappingProxyType(
        {
            "momentum": validation.check_beta,
            "nu": validation.check_nu,
            "weight_decay": validation.optional(validation.check_weight_decay),
            "muon_a": _check_coefficient,
            "muon_b": _check_coefficient,
            "muon_c": _check_coefficient,
            "adam_beta_1": validation.check_beta,
            "adam_beta_2": validation.check_beta,
            "epsilon": validation.check_eps,
            "adam_weight_decay": validation.check_weight_decay,
            "adam_lr_ratio": validation.check_lr,
            "rms_rate": validation.optional(validation.check_lr),
            "ns_steps": validation.check_ns_steps,
        }
    )
    # The dtype of the momentum slot being made (None: its variable's), while
    # ``build`` makes the slots.
    _slot_dtype: str | None = None
    _building_slots = False

    def __init__(
        self,
        learning_rate: Any = 0.001,
        *,
        nu: float = 0.95,
        state_dtype: Any = None,
        stochastic_rounding: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if not _muon_keeps_a_slot_per_index():
            raise ImportError(
                "qhoptim.keras.QHMuon builds on keras.optimizers.Muon as Keras 3.13 and "
                f"later define it; found keras {keras.__version__}. Upgrade Keras "
                "(`pip install -U keras`)."
            )
        if "nesterov" in kwargs:
            raise TypeError("QHMuon takes nu instead of nesterov (nu=momentum is Nesterov's)")
        learning_rate = learning_rate_value(learning_rate)
        super().__init__(learning_rate=learning_rate, nesterov=True, **kwargs)
        weight_decay = 0.0 if self.weight_decay is None else self.weight_decay
        for name in ("muon_a", "muon_b", "muon_c"):  # Keras's names: each its own argument
            _check_coefficient(getattr(self, name), name)
        validation.check_qhmuon(
            lr=learning_rate,
            momentum=self.momentum,
            nu=nu,
            weight_decay=weight_decay,
            eps=KERAS_MUON_NORM_EPS,
            ns_steps=self.ns_steps,
            ns_coefficients=(self.muon_a, self.muon_b, self.muon_c),
            adjust_lr_fn=None,
            adjustments=rules.MUON_LR_ADJUSTMENTS,
            names={"lr": "learning_rate", "ns_coefficients": "(muon_a, muon_b, muon_c)"},
        )
        # The AdamW step of the other variables, whose settings Keras's Muon
        # takes unchecked, and the matrices' RMS scale (None: unscaled).
        validation.check_beta(self.adam_beta_1, "adam_beta_1")
        validation.check_beta(self.adam_beta_2, "adam_beta_2")
        validation.check_eps(self.epsilon, "epsilon")
        validation.check_weight_decay(self.adam_weight_decay, "adam_weight_decay")
        validation.check_lr(self.adam_lr_ratio, "adam_lr_ratio")
        if self.rms_rate is not None:
            validation.check_lr(self.rms_rate, "rms_rate")
        self.momentum, self.nu = as_float(self.momentum), as_float(nu)
        self.state_dtype = _narrow.checked_state_dtype(state_dtype, stochastic_rounding)
        self.stochastic_rounding = stochastic_rounding

    @classmethod
    def from_params(cls, params: Any, **kwargs: Any) -> QHMuon:
        """Build from :func:`qhoptim.convert.from_muon`'s settings; keyword
        arguments (``learning_rate``, ...) go to the constructor."""
        validation.check_conversion(f"{cls.__name__}.from_params", params, convert.QHMuonParams)
        return cls(**{**params.as_kwargs(), **kwargs})

    def add_variable_from_reference(
        self, reference_variable: Any, name: Any = None, initializer: Any = "zeros"
    ) -> Any:
        """Keras's; the momentum slot of a variable Muon steps takes ``state_dtype``."""
        state_dtype = self.state_dtype
        narrow = (
            self._building_slots
            and name == "momentum"
            and not self._should_use_adamw(reference_variable)
        )
        if narrow and state_dtype is not None:
            self._slot_dtype = _narrow.slot_dtype(state_dtype, reference_variable.dtype)
        try:
            return super().add_variable_from_reference(reference_variable, name, initializer)
        finally:
            self._slot_dtype = None

    def build(self, var_list: Any) -> None:
        if not self.built and self.state_dtype is not None:
            # Every slot's dtype checked before Keras marks the optimizer built
            # and any slot exists: a refused build leaves nothing half-made.
            for variable in var_list:
                if not self._should_use_adamw(variable):
                    _narrow.slot_dtype(self.state_dtype, variable.dtype)
        self._building_slots = True
        try:
            super().build(var_list)
        finally:
            self._building_slots = False

    def _layout(self) -> int:
        return 4

    def add_variable(self, *args: Any, **kwargs: Any) -> Any:
        if self._slot_dtype is not None:
            kwargs["dtype"] = self._slot_dtype
        return super().add_variable(*args, **kwargs)

    def _muon_update_step(self, gradient: Any, variable: Any, lr: Any, m: Any) -> None:
        # A sparse gradient (an embedding's on TensorFlow) is the dense one
        # with zero rows: the buffer decays at every row, as Keras's Muon has it.
        gradient = dense_gradient(gradient)
        narrow = m.dtype != variable.dtype
        trace = ops.cast(m, variable.dtype) if narrow else m
        trace, direction = rules.qhm_trace_update(
            gradient, trace, momentum=self.momentum, nu=self.nu
        )
        if narrow:
            trace = _narrow.stored(
                trace,
                state_dtype=m.dtype,
                stochastic=rounding.stochastic(m.dtype, self.stochastic_rounding),
                iterations=self.iterations,
                first=ops.convert_to_tensor(
                    rounding.state_index(self._get_variable_index(variable)), "uint32"
                ),
                k=0,
            )
        self.assign(m, trace)
        rows, columns = direction.shape
        update = rules.newton_schulz(
            direction,
            rows=rows,
            columns=columns,
            ops=_KERAS_MATRIX_OPS,
            coefficients=(self.muon_a, self.muon_b, self.muon_c),
            steps=self.ns_steps,
            eps=KERAS_MUON_NORM_EPS,
            norm_guard="add",
        )
        self.assign_sub(variable, self.lr_adjust(lr * update))

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.pop("nesterov", None)
        config["nu"] = self.nu
        config.update(_narrow.state_config(self.state_dtype, self.stochastic_rounding))
        return config
