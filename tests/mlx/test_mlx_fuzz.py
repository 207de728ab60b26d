"""Hypothesis: random valid hyperparameters, shapes and gradients against the float64 reference,
and checkpoints at a random step that continue bit for bit (``mx.savez``: MLX's
safetensors writer takes no float64; the float32 tests use safetensors).

Few examples: every new set of hyperparameters compiles a new per-parameter
kernel (seconds on a small CPU). Under ``CI`` the examples are derandomized
(``conformance.fuzzing``), so MLX's kernel cache serves later runs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from mlx.utils import tree_flatten, tree_unflatten

from conformance.fuzzing import FuzzCase, fuzz_cases, reference_run, tolerance
from conformance.runner import max_relative_deviation
from qhoptim.mlx import QHM, QHAdam, QHAdamW

EXAMPLES = 8


def _make(case: FuzzCase) -> QHM | QHAdam:
    hp, lr = case.hparams, mx.array(case.hparams["lr"], dtype=mx.float64)
    if case.family == "qhm":
        return QHM(lr, hp["momentum"], hp["nu"], hp["weight_decay"])
    args = (lr, (hp["beta1"], hp["beta2"]), (hp["nu1"], hp["nu2"]), hp["eps"], hp["weight_decay"])
    return QHAdamW(*args) if case.family == "qhadamw" else QHAdam(*args)


def _steps(opt: QHM | QHAdam, x: mx.array, grads: np.ndarray) -> tuple[list[np.ndarray], mx.array]:
    out = []
    for g in grads:
        x = opt.apply_gradients({"x": mx.array(g, dtype=mx.float64)}, {"x": x})["x"]
        mx.eval(x, opt.state)
        out.append(np.array(x).ravel())
    return out, x


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=fuzz_cases())
def test_random_cases_follow_the_reference_and_resume_bit_for_bit(case: FuzzCase) -> None:
    want = reference_run(case, decoupled=case.family == "qhadamw")
    x0 = mx.array(case.x0, dtype=mx.float64)
    traj, _ = _steps(_make(case), x0, case.grads)
    got = np.stack([case.x0.ravel(), *traj])
    assert max_relative_deviation(got, want) <= tolerance(case)

    k = case.resume_at
    opt = _make(case)
    _, x = _steps(opt, x0, case.grads[:k])
    with tempfile.TemporaryDirectory() as tmp:
        file = str(Path(tmp) / "checkpoint.npz")
        mx.savez(file, **dict(tree_flatten({"x": x, "optimizer": opt.state})))
        checkpoint = tree_unflatten(list(mx.load(file).items()))
    resumed = _make(case)
    resumed.state = checkpoint["optimizer"]
    continued, _ = _steps(resumed, checkpoint["x"], case.grads[k:])
    np.testing.assert_array_equal(np.stack(continued), got[k + 1 :])
