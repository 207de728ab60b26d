"""The settings of :mod:`qhoptim.keras`, read by the steps at every step.

Users set them on the package (``qhoptim.keras.TF_JIT_COMPILE = False``),
which keeps them here, where the modules below it read them.
"""

from __future__ import annotations

import keras

__all__ = ["BACKEND", "TF_JIT_COMPILE", "TORCH_FUSED"]

#: On the TensorFlow backend each variable's step -- reading the state, the
#: rule, writing the state back -- runs as one XLA computation
#: (``tf.function(jit_compile=True)``): one fused loop over memory, as on the
#: JAX backend, and one op per variable in the training graph. Without it
#: TensorFlow runs every ``+ - * /`` of the rule as a separate op and pass over
#: memory, and QHAdam is up to ~1.6x slower than Keras's ``Adam`` on CPU
#: (``benchmarks/keras_step.py``). Set to ``False`` before the first step (before
#: ``fit``) to use plain TensorFlow ops, e.g. on a device without XLA; the
#: numbers are the same. Read from this module at every step; TensorFlow only.
TF_JIT_COMPILE = True

#: On the torch backend, variables step through ``qhoptim.torch``'s fused
#: kernels (one pass over memory per step, as ``fused=True``) when they can be
#: had: on the CPU the C++ kernel, compiled on first use (about 30 s, once per
#: machine; it needs a C++ compiler and ninja), on CUDA the Triton kernels
#: (Triton ships with torch's CUDA builds); the multi-tensor kernels serve where
#: neither can be had. Set to ``False`` to always use the multi-tensor kernels;
#: the numbers agree to rounding. Read at every step.
TORCH_FUSED = True

#: The active Keras backend, read once: Keras chooses it at import.
BACKEND = keras.backend.backend()
