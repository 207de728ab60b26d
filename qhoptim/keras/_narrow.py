"""Slots stored narrower than their variables (``state_dtype``) in :mod:`qhoptim.keras`.

The step reads the slots in the variable's dtype, runs the rule there, and
stores the new slots back, bfloat16 rounded stochastically with
:mod:`qhoptim.rounding`'s rule (the bits every backend stores).
"""

from __future__ import annotations

import functools
from typing import Any

import keras
from keras import ops

from qhoptim import rounding
from qhoptim.keras._settings import BACKEND

# Unsigned 32-bit arithmetic of the TensorFlow and JAX backends (their uint32
# tensors wrap); constants are made as uint32 tensors, which JAX requires above
# 2**31 - 1. On torch, the rounding is qhoptim.torch's (Python-int seeds).
_BITS = rounding.Bits(
    const=lambda c: ops.convert_to_tensor(c, "uint32"),
    shift=lambda x, n: ops.right_shift(x, ops.convert_to_tensor(n, "uint32")),
    select=ops.where,
)


def state_dtype_name(state_dtype: Any) -> str | None:
    """Keras's name of ``state_dtype`` (``"bfloat16"``, ...), None if it names no dtype."""
    try:
        return str(keras.backend.standardize_dtype(state_dtype))
    except (ValueError, TypeError):
        return None


def itemsize(name: str) -> int:
    """Bytes per value of the dtype Keras names ``name`` (``"bfloat16"``: 2)."""
    digits = "".join(c for c in name if c.isdigit())
    return int(digits) // 8 if digits else 1


def checked_state_dtype(state_dtype: Any, stochastic_rounding: Any) -> str | None:
    """``state_dtype``'s Keras name (None for None), after checking it and
    ``stochastic_rounding`` with the shared wording."""
    name = None if state_dtype is None else state_dtype_name(state_dtype)
    rounding.check_state_dtype(name, state_dtype, allowed=rounding.STATE_DTYPES)
    rounding.check_stochastic_rounding(stochastic_rounding, name, allowed=rounding.STATE_DTYPES)
    return name


def state_config(state_dtype: str | None, stochastic_rounding: bool | None) -> dict[str, Any]:
    """The config entries of a narrow state (none without one: configs stay
    loadable by versions before ``state_dtype``)."""
    if state_dtype is None and stochastic_rounding is None:
        return {}
    return {"state_dtype": state_dtype, "stochastic_rounding": stochastic_rounding}


def slot_dtype(state_dtype: str, variable_dtype: Any) -> str:
    """``state_dtype`` for a slot of a variable of ``variable_dtype``, which it
    must be able to follow: real, and not narrower than the state."""
    param = state_dtype_name(variable_dtype) or str(variable_dtype)
    rounding.check_real(param.startswith("complex"))
    rounding.check_narrower(state_dtype, itemsize(state_dtype), param, itemsize(param))
    return state_dtype


def _state_seed(iterations: Any, first: Any, k: int) -> Any:
    """The rounding seed (:func:`qhoptim.rounding.rounding_seed`) of state
    ``first + k`` in the step after ``iterations`` -- a Python int on torch
    (eager), a uint32 tensor on TensorFlow and JAX (traced)."""
    if BACKEND == "torch":
        return rounding.rounding_seed((int(iterations) + 1) & rounding.MASK32, int(first) + k)
    step = ops.cast(iterations, "uint32") + _BITS.const(1)
    return rounding.rounding_seed(step, first + _BITS.const(k), _BITS)


def _bitcast(x: Any, dtype: str) -> Any:
    """``x``'s bits as ``dtype`` (of the same width); ``keras.ops.view`` is newer
    than Keras 3.10."""
    if BACKEND == "jax":
        import jax

        return jax.lax.bitcast_convert_type(x, dtype)
    return ops.view(x, dtype)


def _after(value: Any) -> Any:
    """0 for each element of ``value`` (uint32), known only once ``value`` is."""
    return ops.cast(ops.logical_and(ops.less(value, 0), ops.greater(value, 0)), "uint32")


def _store(value: Any, dtype: str, seed: Any, after: Any = None) -> Any:
    """A step's new state in the slot's ``dtype``: with a ``seed``, rounded to
    bfloat16 stochastically (:mod:`qhoptim.rounding`), else cast (to nearest).

    ``after``: the variable's new value. On JAX the noise's seed takes a zero
    made of it (:func:`_after`), so that the rounded slot is written after the
    variable's update has read the old slot: Keras's trainer donates the
    slots, and without that order XLA's CPU backend copies each narrow slot
    before overwriting it in place (QHAdam's bfloat16 slots took 2.0x the
    float32 slots' step on ResNet-18 shapes, 1.6x with the order). AMSGrad's
    second moment is still copied: the maximum's store reads the old one, and
    ordering the stores among themselves through their values does not hold
    (XLA recomputes a stored slot where another store reads it); so is a slot
    rounded to nearest, whose cast takes no seed. Every slot has its
    variable's shape, which the zero's broadcast relies on."""
    if seed is None:
        return ops.cast(value, dtype)
    if BACKEND == "torch":
        import torch

        from qhoptim.torch import _state_dtype

        out = torch.empty(value.shape, dtype=torch.bfloat16, device=value.device)
        _state_dtype.stochastic_round_(out, value, seed)
        return out
    x = ops.cast(value, "float32")
    if BACKEND == "tensorflow":
        import tensorflow as tf

        # Its step is traced for shapes unknown until XLA compiles it (Keras's
        # ops want a known rank), and XLA has no uint32 range.
        positions = tf.reshape(tf.cast(tf.range(tf.size(x)), tf.uint32), tf.shape(x))
        bitcast = tf.bitcast
    else:
        positions = ops.reshape(ops.arange(ops.size(x), dtype="uint32"), ops.shape(x))
        bitcast = _bitcast
        if after is not None:
            seed = seed ^ _after(after)
    noise = rounding.noise16(positions, seed, _BITS)
    top = rounding.bfloat16_bits(bitcast(x, "uint32"), noise, _BITS)
    return bitcast(ops.cast(top, "uint16"), "bfloat16")


def stored(
    value: Any,
    *,
    state_dtype: str,
    stochastic: bool,
    iterations: Any,
    first: Any,
    k: int,
    after: Any = None,
) -> Any:
    """A step's new state ``value`` in ``state_dtype``: rounded with the seed of
    state ``first + k`` (:func:`qhoptim.rounding.state_index`) in the step after
    ``iterations`` where ``stochastic``, else cast (:func:`_store`, ``after``
    the variable's new value)."""
    seed = _state_seed(iterations, first, k) if stochastic else None
    return _store(value, state_dtype, seed, after)


@functools.cache
def with_narrow_state(step: Any) -> Any:
    """``step`` for slots stored narrower than their variable: the slots are
    read in the variable's dtype, the rule runs there, and the new slots are
    stored back (:func:`_store`), the ``k``-th rounded with the seed of state
    ``inputs["state_index"] + k`` (:func:`qhoptim.rounding.state_index`) in the
    step after ``inputs["iterations"]``. One function per rule, so that
    compiled steps are reused."""

    def narrow_step(
        inputs: dict[str, Any],
        slots: dict[str, Any],
        param: Any,
        *,
        state_dtype: str,
        stochastic: bool,
        **hparams: Any,
    ) -> tuple[dict[str, Any], Any]:
        working = {name: ops.cast(s, param.dtype) for name, s in slots.items()}
        new_slots, new_param = step(inputs, working, param, **hparams)
        kept = {
            name: stored(
                value,
                state_dtype=state_dtype,
                stochastic=stochastic,
                iterations=inputs["iterations"],
                first=inputs["state_index"],
                k=k,
                after=new_param,
            )
            for k, (name, value) in enumerate(new_slots.items())
        }
        return kept, new_param

    return narrow_step
