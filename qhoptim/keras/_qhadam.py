"""QHAdam and QHAdamW for Keras 3."""

from __future__ import annotations

from types import MappingProxyType

import keras

from qhoptim import convert, rounding, validation
from qhoptim.keras._base import (
    QHOptimizer,
    as_float,
    documented,
    hyperparameter_value,
    learning_rate_value,
)
from qhoptim.keras._step import bias_correction_dtype, qhadam_amsgrad_step, qhadam_step

__all__ = ["QHAdam", "QHAdamW"]

_QHADAM_NAMES = {
    "lr": "learning_rate",
    "beta1": "beta_1",
    "beta2": "beta_2",
    "nu1": "nu_1",
    "nu2": "nu_2",
    "eps": "epsilon",
}


@keras.saving.register_keras_serializable(package="qhoptim")
@documented
class QHAdam(QHOptimizer):
    r"""Optimizer that implements QHAdam (quasi-hyperbolic Adam).

    QHAdam replaces both of Adam's moment estimates by quasi-hyperbolic
    averages of the estimate and the current gradient:

    .. math::

        g_{t+1} &= \beta_1 g_t + (1 - \beta_1) \nabla_t, \quad
        g'_{t+1} = g_{t+1} / (1 - \beta_1^{t+1}) \\
        s_{t+1} &= \beta_2 s_t + (1 - \beta_2) \nabla_t^2, \quad
        s'_{t+1} = s_{t+1} / (1 - \beta_2^{t+1}) \\
        \theta_{t+1} &= \theta_t - \alpha \,
          \frac{(1 - \nu_1) \nabla_t + \nu_1 g'_{t+1}}
               {\sqrt{(1 - \nu_2) \nabla_t^2 + \nu_2 s'_{t+1}} + \epsilon}

    with :math:`\alpha` = ``learning_rate``, :math:`\beta_{1,2}` =
    ``beta_1, beta_2``, :math:`\nu_{1,2}` = ``nu_1, nu_2`` and :math:`\epsilon`
    = ``epsilon``. ``nu_1 = nu_2 = 1`` is Adam (the paper's suggestion is
    ``nu_1=0.7, nu_2=1.0, beta_1=0.995, beta_2=0.999``).

    Note on ``epsilon``: as in the paper and in Kingma & Ba's Algorithm 1,
    :math:`\epsilon` is added *after* bias correction. Keras's ``Adam`` adds
    its ``epsilon`` ("epsilon hat") to the *uncorrected* :math:`\sqrt{s}`,
    which equals this rule with :math:`\epsilon_t = \hat\epsilon /
    \sqrt{1 - \beta_2^t}`; the two agree as :math:`\epsilon \to 0`.

    Args:
        learning_rate: A float, a
            `keras.optimizers.schedules.LearningRateSchedule` instance, or
            a callable that takes no arguments and returns the actual value to
            use. The learning rate. Defaults to `0.001`.
        beta_1: Float in ``[0, 1)``. The exponential decay rate of the first
            moment estimate. Defaults to `0.9`.
        beta_2: Float in ``[0, 1)``. The exponential decay rate of the second
            moment estimate. Defaults to `0.999`.
        nu_1: Float. Immediate discount factor of the first moment (any finite
            real). Defaults to `1.0`.
        nu_2: Float in ``[0, 1]``. Immediate discount factor of the second
            moment; values below 1 mix the current squared gradient into the
            denominator, which lowers the worst-case step only near the optimum
            of ``qhoptim.analysis.qhadam_bound_optimal_nu2`` (mostly together with
            ``nu_1 < 1``). Defaults to `1.0`.
        epsilon: Float ``>= 0`` added to the denominator after the square root
            and bias correction. Defaults to `1e-8`.
        {{base_optimizer_keyword_args}}
        amsgrad: Boolean (keyword only). Whether to apply the AMSGrad variant
            (the paper's "analogously modified" QHAdam), as Keras's ``Adam``:
            the running maximum of the second moment (slot ``velocity_hat``)
            takes its place in the denominator, bias-corrected by the current
            step. Defaults to `False`.
        state_dtype: String (keyword only). Store the slots in this dtype,
            e.g. ``"bfloat16"``: 4 bytes per float32 parameter instead of 8,
            rounded stochastically as :class:`QHM`'s. Defaults to `None`.
        stochastic_rounding: Boolean or `None` (keyword only), as
            :class:`QHM`'s. Defaults to `None`.

    Reference:
        - [Ma & Yarats, 2019](https://arxiv.org/abs/1810.06801), section 5.
    """

    _RULE = "qhadam"
    _CHECKS = MappingProxyType(
        {
            "beta_1": validation.check_beta,
            "beta_2": validation.check_beta,
            "nu_1": validation.check_nu,
            "nu_2": validation.check_nu2,
            "epsilon": validation.check_eps,
            "weight_decay": validation.optional(validation.check_weight_decay),
            "amsgrad": validation.check_bool,
        }
    )
    _CALLABLE = frozenset({"beta_1", "beta_2", "nu_1", "nu_2", "epsilon"})  # called at each step

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        nu_1=1.0,
        nu_2=1.0,
        epsilon=1e-8,
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
        amsgrad=False,
        state_dtype=None,
        stochastic_rounding=None,
        **kwargs,
    ):
        learning_rate = learning_rate_value(learning_rate)
        validation.check_bool(amsgrad, "amsgrad")
        validation.check_qhadam(
            lr=learning_rate,
            beta1=beta_1,
            beta2=beta_2,
            nu1=nu_1,
            nu2=nu_2,
            eps=epsilon,
            weight_decay=0.0 if weight_decay is None else weight_decay,
            names=_QHADAM_NAMES,
            callables=("beta1", "beta2", "nu1", "nu2", "eps"),
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
        self.beta_1 = as_float(beta_1)
        self.beta_2 = as_float(beta_2)
        self.nu_1 = as_float(nu_1)
        self.nu_2 = as_float(nu_2)
        self.epsilon = as_float(epsilon)
        self.amsgrad = amsgrad
        self._set_state_dtype(state_dtype, stochastic_rounding)
        rounding.check_second_moment_dtype(self.state_dtype)

    @classmethod
    def from_params(cls, params, **kwargs):
        """Build from :class:`qhoptim.convert.QHAdamParams`, e.g. a conversion's result.

        ``QHAdam.from_params(qhoptim.convert.from_nadam(1e-3, (0.9, 0.999), 1e-8))``
        is NAdam modulo bias correction. Keyword arguments (``weight_decay``,
        ``clipnorm``, ...) are passed to the constructor.
        """
        validation.check_conversion(f"{cls.__name__}.from_params", params, convert.QHAdamParams)
        (beta_1, beta_2), (nu_1, nu_2) = params.betas, params.nus
        return cls(
            learning_rate=params.lr,
            beta_1=beta_1,
            beta_2=beta_2,
            nu_1=nu_1,
            nu_2=nu_2,
            epsilon=params.eps,
            **kwargs,
        )

    def build(self, var_list):
        """Initialize optimizer variables: the two moment estimates per variable,
        and with ``amsgrad`` the running maximum of the second (``velocity_hat``,
        as Keras's ``Adam``).

        Args:
            var_list: list of model variables to build QHAdam variables on.
        """
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities = self._add_slots(var_list, ["momentum", "velocity"])
        if self.amsgrad:
            self._velocity_hats = self._add_slots(var_list, "velocity_hat")

    def _layout(self):
        return 3 if self.amsgrad else 2

    def _hyperparameters(self):
        values = (self.beta_1, self.beta_2, self.nu_1, self.nu_2, self.epsilon)
        names = ("beta1", "beta2", "nu1", "nu2", "eps")
        return dict(zip(names, map(hyperparameter_value, values), strict=True))

    def _slots(self, index):
        slots = {"momentum": self._momentums[index], "velocity": self._velocities[index]}
        if self.amsgrad:
            slots["velocity_hat"] = self._velocity_hats[index]
        return slots

    def update_step(self, gradient, variable, learning_rate):
        """Update step given gradient and the associated model variable."""
        index = self._get_variable_index(variable)
        self._run_step(
            qhadam_amsgrad_step if self.amsgrad else qhadam_step,
            {"gradient": gradient, "learning_rate": learning_rate, "iterations": self.iterations},
            self._slots(index),
            variable,
            index,
            weight_decay=self._weight_decay_for(variable),
            bias_dtype=bias_correction_dtype(),
            **self._hyperparameters(),
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "beta_1": self.beta_1,
                "beta_2": self.beta_2,
                "nu_1": self.nu_1,
                "nu_2": self.nu_2,
                "epsilon": self.epsilon,
                "amsgrad": self.amsgrad,
                **self._state_config(),
            }
        )
        return config


# --------------------------------------------------------------------- QHAdamW
@keras.saving.register_keras_serializable(package="qhoptim")
@documented
class QHAdamW(QHAdam):
    r"""QHAdam with decoupled weight decay, as Keras's ``AdamW`` is Adam with it.

    Before each step the variable is multiplied by :math:`1 - \alpha\lambda`
    (:math:`\lambda` = ``weight_decay``), in the same pass as the QHAdam
    update. ``QHAdamW(weight_decay=wd, ...)`` is ``QHAdam(weight_decay=wd, ...)``
    with a non-zero default, ``0.004`` -- Keras's ``AdamW`` default (torch's
    ``AdamW`` and ``qhoptim.torch.QHAdamW`` default to ``0.01``).

    Args:
        learning_rate: A float, a
            `keras.optimizers.schedules.LearningRateSchedule` instance, or
            a callable that takes no arguments and returns the actual value to
            use. The learning rate. Defaults to `0.001`.
        weight_decay: Float ``>= 0``. The decoupled weight decay
            :math:`\lambda`. Defaults to `0.004`.
        beta_1: Float in ``[0, 1)``. Defaults to `0.9`.
        beta_2: Float in ``[0, 1)``. Defaults to `0.999`.
        nu_1: Float. Immediate discount factor of the first moment. Defaults to `1.0`.
        nu_2: Float in ``[0, 1]``. Immediate discount factor of the second
            moment. Defaults to `1.0`.
        epsilon: Float ``>= 0`` added to the denominator after the square root
            and bias correction. Defaults to `1e-8`.
        {{base_optimizer_keyword_args}}
        amsgrad: Boolean (keyword only). The AMSGrad variant, as in
            :class:`QHAdam`. Defaults to `False`.
        state_dtype, stochastic_rounding: keyword only, as in :class:`QHAdam`.

    References:
        - [Ma & Yarats, 2019](https://arxiv.org/abs/1810.06801), section 5.
        - [Loshchilov & Hutter, 2019](https://arxiv.org/abs/1711.05101).
    """

    def __init__(
        self,
        learning_rate=0.001,
        weight_decay=0.004,
        beta_1=0.9,
        beta_2=0.999,
        nu_1=1.0,
        nu_2=1.0,
        epsilon=1e-8,
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
        amsgrad=False,
        state_dtype=None,
        stochastic_rounding=None,
        **kwargs,
    ):
        # None means "no decay" for QHAdam (Keras's convention); QHAdamW is the
        # decay, so None is not a number here, in the sentence of every backend.
        validation.check_weight_decay(weight_decay, "weight_decay")
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            nu_1=nu_1,
            nu_2=nu_2,
            epsilon=epsilon,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
            amsgrad=amsgrad,
            state_dtype=state_dtype,
            stochastic_rounding=stochastic_rounding,
            **kwargs,
        )
