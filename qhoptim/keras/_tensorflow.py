"""The TensorFlow backend's step of :mod:`qhoptim.keras`: one XLA computation per variable.

Imported by ``qhoptim.keras`` only when Keras runs on TensorFlow.
:class:`TensorFlowStep` is the mixin of the optimizers' base class there.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from qhoptim.keras import _settings
from qhoptim.keras._step import apply_step

#: Sparse gradients of the TensorFlow backend (``Embedding`` layers give
#: ``tf.IndexedSlices``), densified before the step.
SPARSE_TYPES: tuple[type, ...] = (tf.IndexedSlices,)


def _jit_compile() -> bool:
    """``qhoptim.keras.TF_JIT_COMPILE``, read at every step: users set it on the package."""
    return bool(_settings.TF_JIT_COMPILE)


def _handle(x: Any) -> Any:
    """What crosses into the XLA-compiled step: ``tf.Variable``s, not Keras's."""
    return x.value if isinstance(x, keras.Variable) else x


def _xla_step(optimizer: Any, step: Any) -> Any:
    """``step`` with its state reads and writes, as one XLA computation.

    The new state is written by ``optimizer.assign`` *inside* the computation:
    every write goes through the optimizer's assign path (where Keras and its
    wrappers hook in), and XLA still fuses the rule with the writes -- one loop
    over memory, the new values never materialized as outputs and copied again.

    Each optimizer keeps its own functions (``TensorFlowStep._step_variable``):
    a traced function may hold on to the variables it first saw, so sharing one
    across optimizers (or models) would call it with deleted variables.
    """

    def run(inputs: dict[str, Any], slots: dict[str, Any], variable: Any, **hparams: Any) -> None:
        read = tf.convert_to_tensor
        apply_step(step, inputs, slots, variable, hparams, read=read, assign=optimizer.assign)

    return tf.function(run, jit_compile=True, reduce_retracing=True)


def dense(gradient: Any) -> Any:
    """A ``tf.IndexedSlices`` (or ``tf.SparseTensor``) gradient as a dense tensor,
    which Keras's ``ops.convert_to_tensor`` leaves sparse."""
    return tf.convert_to_tensor(gradient)


class TensorFlowStep:
    """Mixin of ``qhoptim.keras``'s base class on the TensorFlow backend."""

    def _read(self: Any, x: Any) -> Any:
        """A ``keras.Variable``, the ``tf.Variable`` Keras passes to ``update_step`` or a
        tensor, read once as a tensor."""
        return tf.convert_to_tensor(x)

    def _step_variable(
        self: Any,
        step: Any,
        inputs: dict[str, Any],
        slots: dict[str, Any],
        variable: Any,
        hparams: dict[str, Any],
    ) -> None:
        """The step as one XLA computation (:data:`qhoptim.keras.TF_JIT_COMPILE`), or plain ops."""
        if not _jit_compile():
            super()._step_variable(step, inputs, slots, variable, hparams)  # type: ignore[misc]
            return
        steps = self.__dict__.setdefault("_xla_steps", {})
        if step not in steps:
            steps[step] = _xla_step(self, step)
        steps[step](
            {name: _handle(x) for name, x in inputs.items()},
            {name: _handle(s) for name, s in slots.items()},
            _handle(variable),
            **hparams,
        )
