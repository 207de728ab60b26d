"""Helpers of the Keras backend's tests (``tests/keras``).

The Keras backend is whatever ``KERAS_BACKEND`` says (``nox`` runs this
directory once per backend). JAX runs with its defaults -- no
``jax_enable_x64`` -- as Keras users run it, so the exact (float64) checks use
float32 there; the float64 conformance rows of the JAX backend run in their
own process (``test_keras_conformance.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import pytest
from keras import ops

BACKEND = keras.backend.backend()

#: The most precise dtype of the backend as Keras users run it, and the
#: relative tolerance of a comparison in it between two implementations of the
#: same math (different operation order).
EXACT_DTYPE = "float32" if BACKEND == "jax" else "float64"
EXACT_RTOL = 2e-5 if EXACT_DTYPE == "float32" else 1e-12


def only_backend(name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(BACKEND != name, reason=f"needs the {name} Keras backend")


def apply_steps(
    optimizer: keras.optimizers.Optimizer,
    x0: Sequence[np.ndarray],
    grad_fn: Callable[[list[np.ndarray], int], list[np.ndarray]],
    steps: int,
    dtype: str = EXACT_DTYPE,
) -> list[np.ndarray]:
    """``optimizer.apply`` eagerly for ``steps`` steps; gradients from ``grad_fn(params, t)``."""
    variables = [keras.Variable(np.asarray(x, np.float64), dtype=dtype) for x in x0]
    for t in range(steps):
        params = [np.asarray(ops.convert_to_numpy(v), np.float64) for v in variables]
        grads = [ops.convert_to_tensor(g, dtype=dtype) for g in grad_fn(params, t)]
        optimizer.apply(grads, variables)
    return [np.asarray(ops.convert_to_numpy(v), np.float64) for v in variables]


def reference_steps(
    reference: Any,
    x0: Sequence[np.ndarray],
    grad_fn: Callable[[list[np.ndarray], int], list[np.ndarray]],
    steps: int,
    lr: Callable[[int], float] | None = None,
) -> list[np.ndarray]:
    """The float64 reference (``qhoptim.reference``) on the same problem, closed loop."""
    params = [np.asarray(x, np.float64) for x in x0]
    states = [reference.init(p) for p in params]
    for t in range(steps):
        grads = grad_fn(params, t)
        out = [
            reference.step(p, g, s, None if lr is None else lr(t))
            for p, g, s in zip(params, grads, states, strict=True)
        ]
        params = [p for p, _ in out]
        states = [s for _, s in out]
    return params


def quadratic_grad(params: list[np.ndarray], t: int) -> list[np.ndarray]:
    """Gradient of ``sum_i c_i * |x_i - 0.5|^2`` with a per-coordinate curvature."""
    return [2.0 * np.arange(1, p.size + 1).reshape(p.shape) * (p - 0.5) for p in params]


X0 = [np.linspace(-1.0, 2.0, 6).reshape(2, 3), np.array([0.3, -0.7, 1.1])]


def make_regression(n: int = 256, d: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A small nonlinear regression problem (float32)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype("float32")
    w = rng.standard_normal((d, 1)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * x[:, :1] ** 2).astype("float32")
    return x, y


def make_mlp(d: int = 8, seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((d,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def flat_weights(model: keras.Model) -> np.ndarray:
    return np.concatenate([np.ravel(w) for w in model.get_weights()])


def slot_values(opt: Any) -> np.ndarray:
    """The optimizer's slots (its variables but the step count and the learning
    rate, which are scalars), read back as float64, flat; empty before it is built."""
    if not opt.built:
        return np.zeros(0)
    return np.concatenate(
        [np.zeros(0)]
        + [
            np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(v, "float32")), np.float64).ravel()
            for v in opt.variables
            if len(v.shape) > 0
        ]
    )
