"""qhoptim.mlx against the float64 reference: the conformance rows, dtypes and bias correction."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conformance import runner
from conformance.adapters import load_adapter
from qhoptim import reference
from qhoptim.mlx import QHM, QHAdam, QHAdamW


def test_conformance_rows_all_pass() -> None:
    rows = runner.run(["mlx"])
    runner.record(rows, "mlx")
    # float64 and float32, every case but QHMuon's with a scale MLX's Muon lacks
    assert {(r.case, r.dtype) for r in rows} == {
        (c.name, dtype)
        for c in runner.load_cases()
        for dtype in runner.DTYPES
        if c.hparams.get("adjust_lr_fn") in (None, "original")
    }
    assert sum(r.case.startswith("qhmuon") for r in rows) >= 10
    failed = [r for r in rows if not r.passed]
    assert not failed, runner.format_table(failed)


def test_the_fused_steps_conformance_rows_all_pass() -> None:
    assert load_adapter("mlx-fused").available(), "the C++ step did not build"
    rows = runner.run(["mlx-fused"])
    runner.record(rows, "mlx-fused")
    # float32 (the kernel's dtype), every case of QHM, QHAdam and QHAdamW
    assert {(r.case, r.dtype) for r in rows} == {
        (c.name, "float32") for c in runner.load_cases() if c.optimizer != "qhmuon"
    }
    failed = [r for r in rows if not r.passed]
    assert not failed, runner.format_table(failed)
    assert max(r.deviation for r in rows) <= 1e-5


def test_the_adapter_is_registered_and_available() -> None:
    adapter = load_adapter("mlx")
    assert adapter.name == "mlx" and adapter.available()


# ------------------------------------------------- the learning rate's dtype (docs/mlx.md)
CASES = [
    (lambda lr: QHM(lr, 0.9, 0.7), lambda lr: reference.QHM(lr, 0.9, 0.7)),
    (
        lambda lr: QHAdam(lr, (0.9, 0.99), (0.7, 0.8), weight_decay=0.01),
        lambda lr: reference.QHAdam(lr, (0.9, 0.99), (0.7, 0.8), weight_decay=0.01),
    ),
    (lambda lr: QHAdamW(lr, nus=(0.7, 1.0)), lambda lr: reference.QHAdamW(lr, nus=(0.7, 1.0))),
]
LR = 0.1  # not a float32 number: float32(0.1) - 0.1 is 1.5e-9


def _deviation(make, make_reference, learning_rate) -> float:
    """Max relative deviation over 25 float64 steps from the reference with lr = LR."""
    x0 = np.linspace(-1.0, 2.0, 5)
    opt, ref = make(learning_rate), make_reference(LR)
    params, rx, rs = {"x": mx.array(x0, dtype=mx.float64)}, x0, ref.init(x0)
    worst = 0.0
    for t in range(25):
        g = 3.0 * rx + np.cos(t)
        grad = mx.array(3.0 * np.array(params["x"]) + np.cos(t), dtype=mx.float64)
        params = opt.apply_gradients({"x": grad}, params)
        rx, rs = ref.step(rx, g, rs)
        x = np.array(params["x"], dtype=np.float64)
        worst = max(worst, float(np.max(np.abs(x - rx)) / np.max(np.abs(rx))))
    return worst


@pytest.mark.parametrize(("make", "make_reference"), CASES, ids=["QHM", "QHAdam", "QHAdamW"])
def test_a_python_float_learning_rate_is_float32(make, make_reference) -> None:
    # MLX's convention: a Python float becomes a float32 mx.array, so a float64
    # run steps with float32(lr): past the float64 bound (1e-12), within float32's.
    assert make(LR).learning_rate.dtype == mx.float32
    assert runner.TOLERANCES["float64"] < _deviation(make, make_reference, LR)
    assert _deviation(make, make_reference, LR) < runner.TOLERANCES["float32"]


@pytest.mark.parametrize(("make", "make_reference"), CASES, ids=["QHM", "QHAdam", "QHAdamW"])
def test_a_float64_learning_rate_keeps_float64(make, make_reference) -> None:
    # What docs/mlx.md tells a float64 user: an mx.array learning rate in float64 ...
    lr = mx.array(LR, dtype=mx.float64)
    assert make(lr).learning_rate.dtype == mx.float64
    assert _deviation(make, make_reference, lr) <= runner.TOLERANCES["float64"]
    # ... or a schedule that returns float64.
    assert (
        _deviation(make, make_reference, lambda step: mx.array(LR, dtype=mx.float64))
        <= runner.TOLERANCES["float64"]
    )
    # ... or setting it on the optimizer (the setter keeps an mx.array's dtype).
    opt = make(LR)
    opt.learning_rate = mx.array(LR, dtype=mx.float64)
    assert _deviation(lambda _: opt, make_reference, None) <= runner.TOLERANCES["float64"]


# ------------------------------------------------------ bias correction near beta = 1
@pytest.mark.parametrize("beta1", [0.99999, 0.9999999])
def test_float32_first_adam_step_is_lr_for_beta_near_one(beta1: float) -> None:
    # With nus = (1, 1) and eps small the paper's first step is lr * sign(grad);
    # float32's 1 - beta**1 would be ~1e-2 (0.99999) to ~20% (0.9999999) off,
    # rules.bias_correction's expm1 form is not.
    x0, g = np.array([1.0, -2.0, 3.0]), np.array([0.5, -4.0, 1e-3])
    ref = reference.QHAdam(1e-2, (beta1, 0.999), (1.0, 1.0), 1e-12)
    expected, _ = ref.step(x0, g, ref.init(x0))
    opt = QHAdam(1e-2, (beta1, 0.999), (1.0, 1.0), 1e-12)
    params = opt.apply_gradients({"x": mx.array(g, dtype=mx.float32)}, {"x": mx.array(x0)})
    step = np.array(params["x"], dtype=np.float64) - x0
    np.testing.assert_allclose(step, expected - x0, rtol=1e-5)
