"""Hypothesis: random valid hyperparameters, shapes and gradients against the float64 reference
(float32 on JAX); optimizer variables saved and loaded at a random step continue bit for bit."""

from __future__ import annotations

import keras
import numpy as np
from hypothesis import given, settings
from keras import ops
from qh_keras_testing import EXACT_DTYPE

import qhoptim.keras as qk
from conformance.fuzzing import FuzzCase, fuzz_cases, reference_run, tolerance
from conformance.runner import max_relative_deviation

EXAMPLES = 25


def _make(case: FuzzCase) -> keras.optimizers.Optimizer:
    hp = dict(case.hparams)
    # Keras keeps its learning rate in float32; the reference gets that value.
    wd = hp["weight_decay"] or None
    if case.family == "qhm":
        return qk.QHM(hp["lr"], hp["momentum"], hp["nu"], weight_decay=wd)
    cls = qk.QHAdamW if case.family == "qhadamw" else qk.QHAdam
    kwargs = {"weight_decay": hp["weight_decay"]} if cls is qk.QHAdamW else {"weight_decay": wd}
    return cls(
        learning_rate=hp["lr"],
        beta_1=hp["beta1"],
        beta_2=hp["beta2"],
        nu_1=hp["nu1"],
        nu_2=hp["nu2"],
        epsilon=hp["eps"],
        **kwargs,
    )


def _steps(opt, v, grads) -> list[np.ndarray]:
    out = []
    for g in grads:
        opt.apply([ops.convert_to_tensor(g, EXACT_DTYPE)], [v])
        out.append(np.asarray(ops.convert_to_numpy(v), np.float64).ravel())
    return out


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=fuzz_cases())
def test_random_cases_follow_the_reference_and_resume_bit_for_bit(case: FuzzCase) -> None:
    lr32 = float(np.float32(case.hparams["lr"]))
    case = FuzzCase(case.family, {**case.hparams, "lr": lr32}, case.x0, case.grads, case.resume_at)
    grads = case.grads.astype(EXACT_DTYPE).astype(np.float64)
    x0 = case.x0.astype(EXACT_DTYPE).astype(np.float64)
    exact = FuzzCase(case.family, case.hparams, x0, grads, case.resume_at)
    want = reference_run(exact, decoupled=True)  # Keras's weight decay is decoupled
    opt = _make(case)
    v = keras.Variable(x0, dtype=EXACT_DTYPE)
    got = np.stack([x0.ravel(), *_steps(opt, v, grads)])
    assert max_relative_deviation(got, want) <= tolerance(case, EXACT_DTYPE)

    k = case.resume_at
    opt = _make(case)
    v = keras.Variable(x0, dtype=EXACT_DTYPE)
    _steps(opt, v, grads[:k])
    store = {str(i): ops.convert_to_numpy(x) for i, x in enumerate(opt.variables)}
    w = keras.Variable(ops.convert_to_numpy(v), dtype=EXACT_DTYPE)
    resumed = _make(case)
    resumed.build([w])
    resumed.load_own_variables(store)
    continued = np.stack(_steps(resumed, w, grads[k:]))
    np.testing.assert_array_equal(continued, got[k + 1 :])
