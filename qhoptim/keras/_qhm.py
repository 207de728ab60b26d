"""QHM for Keras 3."""

from __future__ import annotations

from types import MappingProxyType

import keras

from qhoptim import convert, validation
from qhoptim.keras._base import (
    QHOptimizer,
    as_float,
    documented,
    hyperparameter_value,
    learning_rate_value,
)
from qhoptim.keras._step import qhm_step

__all__ = ["QHM"]


@keras.saving.register_keras_serializable(package="qhoptim")
@documented
class QHM(QHOptimizer):
    r"""Optimizer that implements quasi-hyperbolic momentum (QHM).

    QHM averages a plain SGD step and a momentum step, with a *normalized*
    momentum buffer :math:`g` (an average of past gradients):

    .. math::

        g_{t+1} &= \beta g_t + (1 - \beta) \nabla_t \\
        \theta_{t+1} &= \theta_t - \alpha \left[(1 - \nu) \nabla_t + \nu g_{t+1}\right]

    with :math:`\alpha` = ``learning_rate``, :math:`\beta` = ``momentum`` and
    :math:`\nu` = ``nu``. ``nu=0`` is SGD, ``nu=1`` is momentum and
    ``nu=momentum`` is Nesterov's accelerated gradient; the paper's rule of
    thumb is ``nu=0.7, momentum=0.999``.

    Because the buffer is normalized, Keras's ``SGD(learning_rate=lr,
    momentum=beta)`` (an unnormalized velocity, like torch's) corresponds to
    ``QHM(learning_rate=lr / (1 - beta), momentum=beta, nu=1.0)``, and
    ``nesterov=True`` to ``nu=beta``; ``QHM.from_params(
    qhoptim.convert.from_nesterov(lr, beta))`` does the conversion. For that
    reason ``learning_rate`` has no default; by name (``"qhm"``), where none
    can be passed, it is 0.01 (:attr:`NAMED_LEARNING_RATE`).

    Args:
        learning_rate: A float, a
            `keras.optimizers.schedules.LearningRateSchedule` instance, or
            a callable that takes no arguments and returns the actual value to
            use. The learning rate :math:`\alpha`. Required.
        momentum: Float in ``[0, 1)``. :math:`\beta`, the discount factor of
            the normalized momentum buffer. Defaults to `0.999`.
        nu: Float. :math:`\nu`, the immediate discount factor (any finite
            real; conversions from other algorithms may give values outside
            ``[0, 1]``). Defaults to `0.7`.
        {{base_optimizer_keyword_args}}
        state_dtype: String (keyword only). Store the momentum slot in this
            dtype, e.g. ``"bfloat16"`` (half a float32 model's slot memory);
            the step runs in the variable's dtype and writes the slot back
            with ``qhoptim.rounding``'s stochastic rounding. Defaults to
            `None` (the variable's dtype).
        stochastic_rounding: Boolean or `None` (keyword only). With
            ``state_dtype``: `None` rounds bfloat16 stochastically, `False`
            to nearest. Defaults to `None`.

    Note: ``weight_decay`` is Keras's decoupled weight decay
    (:math:`\theta \leftarrow \theta (1 - \alpha\lambda)` before the step), as
    for every Keras optimizer; ``qhoptim.torch.QHM`` defaults to coupled (L2)
    decay instead, which Keras expresses with
    ``kernel_regularizer=keras.regularizers.L2(weight_decay / 2)``.

    Reference:
        - [Ma & Yarats, 2019](https://arxiv.org/abs/1810.06801), section 3.
    """

    _RULE = "qhm"
    _CHECKS = MappingProxyType(
        {
            "momentum": validation.check_beta,
            "nu": validation.check_nu,
            "weight_decay": validation.optional(validation.check_weight_decay),
        }
    )
    _CALLABLE = frozenset({"momentum", "nu"})  # called at each step

    def __init__(
        self,
        learning_rate,
        momentum=0.999,
        nu=0.7,
        weight_decay=None,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name=None,
        *,
        state_dtype=None,
        stochastic_rounding=None,
        **kwargs,
    ):
        learning_rate = learning_rate_value(learning_rate)
        validation.check_qhm(
            lr=learning_rate,
            momentum=momentum,
            nu=nu,
            weight_decay=0.0 if weight_decay is None else weight_decay,
            names={"lr": "learning_rate"},
            callables=("momentum", "nu"),
        )
        super().__init__(
            learning_rate=learning_rate,
            name=name,
            weight_decay=as_float(weight_decay),
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            **kwargs,
        )
        self.momentum = as_float(momentum)
        self.nu = as_float(nu)
        self._set_state_dtype(state_dtype, stochastic_rounding)

    @classmethod
    def from_params(cls, params, **kwargs):
        """Build from :class:`qhoptim.convert.QHMParams`, e.g. a conversion's result.

        ``QHM.from_params(qhoptim.convert.from_nesterov(lr=0.01, momentum=0.9))``
        is Keras's ``SGD(0.01, momentum=0.9, nesterov=True)``. Keyword
        arguments (``weight_decay``, ``clipnorm``, ...) are passed to the
        constructor.
        """
        validation.check_conversion(f"{cls.__name__}.from_params", params, convert.QHMParams)
        return cls(learning_rate=params.lr, momentum=params.momentum, nu=params.nu, **kwargs)

    def build(self, var_list):
        """Initialize optimizer variables: one normalized momentum buffer per variable.

        Args:
            var_list: list of model variables to build QHM variables on.
        """
        if self.built:
            return
        super().build(var_list)
        self._momentums = self._add_slots(var_list, "momentum")

    def _layout(self):
        return 1

    def _hyperparameters(self):
        return {
            "momentum": hyperparameter_value(self.momentum),
            "nu": hyperparameter_value(self.nu),
        }

    def _slots(self, index):
        return {"momentum": self._momentums[index]}

    def update_step(self, gradient, variable, learning_rate):
        """Update step given gradient and the associated model variable."""
        index = self._get_variable_index(variable)
        self._run_step(
            qhm_step,
            {"gradient": gradient, "learning_rate": learning_rate},
            self._slots(index),
            variable,
            index,
            weight_decay=self._weight_decay_for(variable),
            **self._hyperparameters(),
        )

    def get_config(self):
        config = super().get_config()
        config.update({"momentum": self.momentum, "nu": self.nu, **self._state_config()})
        return config

    #: The learning rate of ``QHM`` built by name (``"qhm"``), where there is no
    #: argument to pass it: Keras's ``"sgd"`` default, ``SGD(0.01)`` without
    #: momentum, whose step on a constant gradient QHM's normalized buffer
    #: reaches with the same number.
    NAMED_LEARNING_RATE = 0.01

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """The optimizer of ``config``; a config without ``learning_rate`` -- what
        ``keras.optimizers.get("qhm")`` and ``compile(optimizer="qhm")`` pass --
        takes :attr:`NAMED_LEARNING_RATE`. Saved configs always hold one."""
        if "learning_rate" not in config:
            config = {**config, "learning_rate": cls.NAMED_LEARNING_RATE}
        return super().from_config(config, custom_objects=custom_objects)
