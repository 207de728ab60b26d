"""Hypothesis: random valid hyperparameters, shapes and gradients against the float64 reference,
and state round trips (pickled as NumPy arrays) at a random step that continue bit for bit."""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings

import qhoptim.optax as qho
from conformance.fuzzing import FuzzCase, fuzz_cases, reference_run, tolerance
from conformance.runner import max_relative_deviation

EXAMPLES = 40


def _make(case: FuzzCase) -> optax.GradientTransformation:
    hp = case.hparams
    if case.family == "qhm":
        # optax's QHM has no weight decay of its own: chain L2 decay before it.
        return optax.chain(
            optax.add_decayed_weights(hp["weight_decay"]),
            qho.qhm(hp["lr"], hp["momentum"], hp["nu"]),
        )
    args = (hp["lr"], hp["beta1"], hp["beta2"], hp["nu1"], hp["nu2"], hp["eps"])
    if case.family == "qhadamw":
        return qho.qhadamw(*args, weight_decay=hp["weight_decay"])
    return optax.chain(optax.add_decayed_weights(hp["weight_decay"]), qho.qhadam(*args))


def _steps(tx, x, state, grads):
    out = []
    for g in grads:
        updates, state = tx.update(jnp.asarray(g), state, x)
        x = optax.apply_updates(x, updates)
        out.append(np.asarray(x).ravel())
    return out, x, state


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=fuzz_cases())
def test_random_cases_follow_the_reference_and_resume_bit_for_bit(case: FuzzCase) -> None:
    want = reference_run(case, decoupled=case.family == "qhadamw")
    tx = _make(case)
    x0 = jnp.asarray(case.x0)
    traj, _, _ = _steps(tx, x0, tx.init(x0), case.grads)
    got = np.stack([case.x0.ravel(), *traj])
    assert max_relative_deviation(got, want) <= tolerance(case)

    k = case.resume_at
    _, x, state = _steps(tx, x0, tx.init(x0), case.grads[:k])
    blob = pickle.dumps(jax.tree.map(np.asarray, (x, state)))  # a checkpoint of plain arrays
    x, state = jax.tree.map(jnp.asarray, pickle.loads(blob))
    continued, _, _ = _steps(_make(case), x, state, case.grads[k:])
    np.testing.assert_array_equal(np.stack(continued), got[k + 1 :])
