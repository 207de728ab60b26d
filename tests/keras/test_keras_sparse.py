"""Sparse gradients and the optimizer's assign path, in the style of Keras's
``keras/src/optimizers/optimizer_sparse_test.py``.

Keras's test patches the variables' ``assign``/``assign_add``/``assign_sub`` to
fail: an optimizer must write through ``self.assign`` (where backends and
wrappers hook in), never on a variable directly. Here the optimizer's own
``assign`` lets the write through, so the steps really run and their numbers
are compared with the float64 reference. Gradients are sparse on the backends
that have sparse tensors (``tf.IndexedSlices``, JAX's ``BCOO``; Keras has none
on torch), with a repeated row, and each optimizer runs both as ``model.fit``
runs it and on Keras's per-variable path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import keras
import numpy as np
import pytest
from keras import ops
from qh_keras_testing import BACKEND, EXACT_DTYPE, EXACT_RTOL, reference_steps

import qhoptim.keras as qk
from qhoptim import reference

SHAPE = (5, 3)
ROWS = np.array([0, 2, 4, 2])  # row 2 twice: its gradients add up
STEPS = 4
ASSIGNS = ("assign", "assign_add", "assign_sub")

# Learning rates exact in float32 (Keras keeps its learning rate in a float32 variable).
CASES: dict[str, tuple[Callable[[], Any], Any]] = {
    "qhm": (
        lambda: qk.QHM(0.25, momentum=0.9, nu=0.7, weight_decay=0.1),
        reference.QHM(0.25, momentum=0.9, nu=0.7, weight_decay=0.1, decoupled_weight_decay=True),
    ),
    "qhadam": (
        lambda: qk.QHAdam(0.0625, beta_1=0.95, beta_2=0.98, nu_1=0.7, nu_2=0.9),
        reference.QHAdam(0.0625, betas=(0.95, 0.98), nus=(0.7, 0.9)),
    ),
    "qhadamw": (
        lambda: qk.QHAdamW(0.0625, weight_decay=0.1, nu_1=0.7, nu_2=0.9, epsilon=1e-6),
        reference.QHAdamW(0.0625, nus=(0.7, 0.9), eps=1e-6, weight_decay=0.1),
    ),
}


def _row_values(t: int) -> np.ndarray:
    """The gradient's rows at step ``t``, exact in the variables' dtype."""
    values = np.random.default_rng(t).standard_normal((len(ROWS), SHAPE[1]))
    return np.asarray(np.asarray(values, EXACT_DTYPE), np.float64)


def _dense_gradient(t: int) -> np.ndarray:
    dense = np.zeros(SHAPE)
    np.add.at(dense, ROWS, _row_values(t))
    return dense


def _gradient(t: int, dtype: str = EXACT_DTYPE) -> Any:
    """Step ``t``'s gradient as the backend's sparse tensor (dense on torch)."""
    values = ops.convert_to_tensor(_row_values(t), dtype=dtype)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.IndexedSlices(values, tf.constant(ROWS), tf.constant(SHAPE, tf.int64))
    if BACKEND == "jax":
        import jax.experimental.sparse as jax_sparse

        return jax_sparse.BCOO((values, ROWS[:, None]), shape=SHAPE)
    return ops.convert_to_tensor(_dense_gradient(t), dtype=dtype)


@contextlib.contextmanager
def _writes_only_through(optimizer: Any, variable: keras.Variable) -> Iterator[list[Any]]:
    """Fail any direct ``assign*`` on a non-scalar variable; let ``optimizer.assign*`` through.

    Yields the variables written through the optimizer's assign methods.
    """
    variable_class = type(variable.value) if BACKEND == "tensorflow" else type(variable)
    writes: list[Any] = []
    inside = [False]

    def guarded(name: str) -> Callable[..., Any]:
        original = getattr(variable_class, name)

        def method(var: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            if len(var.shape) and not inside[0]:
                pytest.fail(
                    f"Optimizer is calling `{name}` directly on a variable. Use "
                    f"`self.{name}(variable, value)` instead to support sparse updates."
                )
            return original(var, value, *args, **kwargs)

        return method

    def through(name: str) -> Callable[..., Any]:
        original = getattr(optimizer, name)

        def method(var: Any, value: Any) -> Any:
            writes.append(var)
            inside[0] = True
            try:
                return original(var, value)
            finally:
                inside[0] = False

        return method

    with contextlib.ExitStack() as stack:
        for name in ASSIGNS:
            stack.enter_context(mock.patch.object(variable_class, name, guarded(name)))
            stack.enter_context(mock.patch.object(optimizer, name, through(name)))
        yield writes


def _apply_all(optimizer: Any, variable: keras.Variable, fit: bool) -> Any:
    """``STEPS`` steps of ``optimizer`` on ``variable``: as ``model.fit`` runs them, or eagerly.

    Returns the variable's new value.
    """
    grads = [_gradient(t) for t in range(STEPS)]
    if fit and BACKEND == "tensorflow":
        import tensorflow as tf

        optimizer.build([variable])
        apply = tf.function(optimizer.apply)
        for g in grads:
            apply([g])
        return variable.value
    if fit and BACKEND == "jax":
        import jax

        optimizer.build([variable])
        step = jax.jit(optimizer.stateless_apply)
        opt_vars, params = [v.value for v in optimizer.variables], [variable.value]
        for g in grads:
            params, opt_vars = step(opt_vars, [g], params)
        return params[0]
    for g in grads:
        optimizer.apply([g], [variable])
    return variable.value


@pytest.mark.parametrize("fit", [True, False], ids=["as-fit", "per-variable"])
@pytest.mark.parametrize("name", CASES)
def test_sparse_gradients_write_through_the_optimizer_and_match_the_reference(
    name: str, fit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, ref = CASES[name]
    if not fit and BACKEND == "tensorflow":
        monkeypatch.setattr(qk, "TF_JIT_COMPILE", False)
    if not fit and BACKEND == "torch":  # Keras's generic path: update_step per variable
        from keras.src.optimizers.base_optimizer import BaseOptimizer

        from qhoptim.keras._base import QHOptimizer

        monkeypatch.setattr(QHOptimizer, "_backend_update_step", BaseOptimizer._backend_update_step)
    table0 = np.linspace(-1.0, 1.0, SHAPE[0] * SHAPE[1]).reshape(SHAPE)
    variable = keras.Variable(table0, dtype=EXACT_DTYPE, name="table")
    optimizer = make()
    with _writes_only_through(optimizer, variable) as writes:
        value = _apply_all(optimizer, variable, fit)

    if fit and BACKEND == "torch":
        assert not writes  # the multi-tensor kernels update the tensors in place
    else:
        assert writes
    got = np.asarray(ops.convert_to_numpy(value), np.float64)
    want = reference_steps(ref, [table0], lambda params, t: [_dense_gradient(t)], STEPS)[0]
    np.testing.assert_allclose(got, want, rtol=EXACT_RTOL)
    assert not np.allclose(got, table0)


def test_qhmuon_steps_a_sparse_gradient_as_its_dense_gradient() -> None:
    # An embedding's gradient on TensorFlow is tf.IndexedSlices; Muon steps it
    # as the dense gradient with zero rows (QHMuon's dense steps are checked
    # against the reference in test_keras_qhmuon.py). float32, as Muon runs.
    table0 = np.linspace(-1.0, 1.0, SHAPE[0] * SHAPE[1]).reshape(SHAPE)

    def run(sparse: bool) -> np.ndarray:
        variable = keras.Variable(table0, dtype="float32", name="table")
        optimizer = qk.QHMuon(0.0625, momentum=0.9, nu=0.7)
        optimizer.build([variable])
        for t in range(STEPS):
            gradient = _gradient(t, "float32") if sparse else _dense_gradient(t)
            optimizer.apply(
                [ops.convert_to_tensor(gradient, "float32") if not sparse else gradient], [variable]
            )
        return np.asarray(ops.convert_to_numpy(variable.value), np.float64)

    sparse, dense = run(True), run(False)
    # The rows' sums (row 2 twice) in float32 one way, float64 then rounded the
    # other: float32 rounding, through the orthogonalization, of values about 1.
    np.testing.assert_allclose(sparse, dense, rtol=1e-6, atol=1e-6)
    assert not np.allclose(sparse, table0)
