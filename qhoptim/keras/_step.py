"""One variable's step of :mod:`qhoptim.keras`, in ``keras.ops``, from :mod:`qhoptim.rules`.

Each step is a function of the step's inputs, the variable's slots and the
variable itself, returning the new slots and the new variable; it runs
unchanged on every Keras backend (each backend's module may run it its own way:
one XLA computation on TensorFlow, ``jax.jit`` on JAX).
"""

from __future__ import annotations

import functools
from typing import Any

from keras import ops

from qhoptim import rules
from qhoptim.keras._settings import BACKEND

#: What a step takes (``inputs``, by name): the gradient, the learning rate and,
#: for QHAdam (and narrow slots), ``iterations``, the steps already taken.
Inputs = dict[str, Any]
#: A variable's slots by their Keras names (``momentum``, ``velocity``,
#: ``velocity_hat``), in the order the slots were built.
Slots = dict[str, Any]

#: Keras's ``iterations`` wraps around to ``-2**31`` after ``2**31 - 1`` steps
#: (an int32 on the torch backend and on JAX without x64).
_WRAP = 2.0**32


def is_number(value: Any) -> bool:
    """A Python number (folded into the step as a constant); not a variable or tensor."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalar_input(value: Any, dtype: Any) -> Any:
    """A learning rate (or step count) as the step's input.

    A Python number becomes a tensor of the variable's dtype directly
    (``ops.cast(0.1, "float64")`` would round through float32 first); variables
    and tensors pass through and are cast inside the step, as Keras's own
    optimizers cast their float32 learning-rate variable.
    """
    if is_number(value):
        return ops.convert_to_tensor(float(value), dtype=dtype)
    return value


#: The prefix of a hyperparameter's name among a step's inputs
#: (:func:`with_tensor_hyperparameters`).
TENSOR_HYPERPARAMETER = "hyperparameter:"


@functools.cache
def with_tensor_hyperparameters(step: Any, names: tuple[str, ...]) -> Any:
    """``step`` with the hyperparameters ``names`` -- a ``keras.Variable`` or a
    tensor, as Keras's own optimizers take (``beta_1=keras.Variable(0.9)``) --
    passed among its inputs (``"hyperparameter:beta1"``), read at each step and
    cast to the variable's dtype, where a traced function (``tf.function``,
    ``jax.jit``) takes its keywords as constants. One function per rule and
    names, so that compiled steps are reused."""

    def tensor_step(inputs: Inputs, slots: Slots, param: Any, **hparams: Any) -> tuple[Slots, Any]:
        inputs = dict(inputs)
        for name in names:
            hparams[name] = ops.cast(inputs.pop(TENSOR_HYPERPARAMETER + name), param.dtype)
        return step(inputs, slots, param, **hparams)  # type: ignore[no-any-return]

    return tensor_step


def bias_correction_dtype() -> str:
    """The dtype bias corrections are computed in before the cast to the variable's dtype.

    float64 wherever the backend has it (TensorFlow, torch, JAX with
    ``jax_enable_x64``), else float32. ``1 - 0.999**t`` evaluated in float32 is
    off by ~1e-5 relative (0.999 itself rounds), in bfloat16 by a factor of 4.
    """
    if BACKEND == "jax":
        import jax

        # float64 canonicalizes to itself only with ``jax_enable_x64``.
        x64 = jax.dtypes.canonicalize_dtype("float64") == "float64"
        return "float64" if x64 else "float32"
    return "float64"


def step_number(iterations: Any, dtype: Any = None) -> Any:
    """The number of the step being taken, ``iterations + 1``: a Python float for a
    Python int ``iterations``, else a tensor of ``dtype``.

    A wrapped (negative) count would make ``beta**t`` overflow and the bias
    corrections ``-inf``, and the step enormous; it is read as the step it
    stands for (``+ 2**32``), where the bias corrections are 1.
    """
    if isinstance(iterations, int):
        t = float(iterations + 1)
        return t + _WRAP if t < 1 else t
    t = ops.cast(iterations, dtype) + 1
    return ops.where(t < 1, t + _WRAP, t)


def _new_value(param: Any, update: Any, lr: Any, weight_decay: Any) -> Any:
    """``param * (1 - lr * weight_decay) - lr * update``; no decay if ``weight_decay`` is None."""
    decay = 1 if weight_decay is None else rules.decoupled_decay_factor(lr, weight_decay)
    return rules.apply_update(param, update, lr, decay)


def qhm_step(
    inputs: Inputs, slots: Slots, param: Any, *, momentum: Any, nu: Any, weight_decay: Any
) -> tuple[Slots, Any]:
    """One QHM step of one variable (:func:`qhoptim.rules.qhm_update`): the new
    ``momentum`` slot (the normalized buffer) and the new variable."""
    lr = ops.cast(inputs["learning_rate"], param.dtype)
    buffer, direction = rules.qhm_update(
        inputs["gradient"], slots["momentum"], momentum=momentum, nu=nu
    )
    return {"momentum": buffer}, _new_value(param, direction, lr, weight_decay)


def _bias_corrections(
    iterations: Any, dtype: Any, bias_dtype: str, hparams: dict[str, Any]
) -> dict[str, Any]:
    """Both bias corrections of the step after ``iterations``, cast to ``dtype``.

    Computed in ``bias_dtype``, with :func:`qhoptim.rules.bias_correction`'s
    float32 policy (``expm1``) in float32.
    """
    t = step_number(iterations, bias_dtype)
    expm1 = ops.expm1 if bias_dtype == "float32" else None

    def correction(beta: Any) -> Any:
        if is_number(beta):
            return rules.bias_correction(beta, t, expm1=expm1)
        # A variable's or tensor's beta (with_tensor_hyperparameters), in the
        # bias corrections' dtype; its log taken there too.
        beta = ops.cast(beta, bias_dtype)
        return rules.bias_correction(beta, t, expm1=expm1, log=ops.log)

    bc1, bc2 = correction(hparams["beta1"]), correction(hparams["beta2"])
    return {"bias_correction1": ops.cast(bc1, dtype), "bias_correction2": ops.cast(bc2, dtype)}


def qhadam_step(
    inputs: Inputs, slots: Slots, param: Any, *, bias_dtype: str, **hparams: Any
) -> tuple[Slots, Any]:
    """One QHAdam step of one variable (:func:`qhoptim.rules.qhadam_update`): the
    new ``momentum`` and ``velocity`` slots (the moments) and the new variable.

    ``inputs["iterations"]`` counts the steps already taken.
    """
    dtype = param.dtype
    lr = ops.cast(inputs["learning_rate"], dtype)
    weight_decay = hparams.pop("weight_decay")
    exp_avg, exp_avg_sq, update = rules.qhadam_update(
        inputs["gradient"],
        slots["momentum"],
        slots["velocity"],
        sqrt=ops.sqrt,
        **_bias_corrections(inputs["iterations"], dtype, bias_dtype, hparams),
        **hparams,
    )
    new_slots = {"momentum": exp_avg, "velocity": exp_avg_sq}
    return new_slots, _new_value(param, update, lr, weight_decay)


def _maximum(x: Any, y: Any) -> Any:
    """The element-wise maximum of AMSGrad (NaN if either is NaN), in the inputs' dtype.

    ``keras.ops.maximum`` on the torch backend computes float64 tensors in
    float32 (seen with Keras 3.15), so there the step takes ``torch.maximum``
    itself.
    """
    if BACKEND == "torch":
        import torch

        return torch.maximum(x, y)
    return ops.maximum(x, y)


def qhadam_amsgrad_step(
    inputs: Inputs, slots: Slots, param: Any, *, bias_dtype: str, **hparams: Any
) -> tuple[Slots, Any]:
    """One step of QHAdam's AMSGrad variant (:func:`qhoptim.rules.qhadam_amsgrad_update`):
    the new ``momentum``, ``velocity`` and ``velocity_hat`` (the running maximum)
    slots and the new variable; as :func:`qhadam_step`."""
    dtype = param.dtype
    lr = ops.cast(inputs["learning_rate"], dtype)
    weight_decay = hparams.pop("weight_decay")
    exp_avg, exp_avg_sq, max_exp_avg_sq, update = rules.qhadam_amsgrad_update(
        inputs["gradient"],
        slots["momentum"],
        slots["velocity"],
        slots["velocity_hat"],
        sqrt=ops.sqrt,
        maximum=_maximum,
        **_bias_corrections(inputs["iterations"], dtype, bias_dtype, hparams),
        **hparams,
    )
    new_slots = {"momentum": exp_avg, "velocity": exp_avg_sq, "velocity_hat": max_exp_avg_sq}
    return new_slots, _new_value(param, update, lr, weight_decay)


def apply_step(
    step: Any,
    inputs: Inputs,
    slots: Slots,
    variable: Any,
    hparams: dict[str, Any],
    *,
    read: Any,
    assign: Any,
) -> None:
    """Run ``step`` on the values ``read`` gives of its inputs, slots and variable,
    and write the new slots, then the variable, with ``assign(target, value)``."""
    new_slots, new_value = step(
        {name: read(x) for name, x in inputs.items()},
        {name: read(s) for name, s in slots.items()},
        read(variable),
        **hparams,
    )
    for name, value in new_slots.items():
        assign(slots[name], value)
    assign(variable, new_value)
