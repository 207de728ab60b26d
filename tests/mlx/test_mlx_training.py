"""qhoptim.mlx in training: nn.value_and_grad, mx.compile, checkpoints, schedules, weight decay."""

from __future__ import annotations

import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from conformance.runner import TOLERANCES
from qhoptim import reference
from qhoptim.mlx import QHM, QHAdam, QHAdamW

OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "QHM": lambda: QHM(0.1, momentum=0.9, nu=0.7, weight_decay=1e-2),
    "QHAdam": lambda: QHAdam(optim.cosine_decay(0.05, 20), nus=(0.7, 0.8), weight_decay=1e-2),
    "QHAdamW": lambda: QHAdamW(0.05, nus=(0.7, 1.0)),
    "QHAdam-amsgrad": lambda: QHAdam(0.05, betas=(0.9, 0.99), nus=(0.7, 0.9), amsgrad=True),
}


def _model() -> nn.Module:
    mx.random.seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _data() -> tuple[mx.array, mx.array]:
    x = mx.random.normal((32, 4), key=mx.random.key(1))
    return x, mx.sin(x[:, :1]) + x[:, 1:2]


def _loss(model: nn.Module, x: mx.array, y: mx.array) -> mx.array:
    return mx.mean((model(x) - y) ** 2)


def _train(model: nn.Module, opt: Any, steps: int, compiled: bool = False) -> list[float]:
    x, y = _data()

    def step(x: mx.array, y: mx.array) -> mx.array:
        loss, grads = nn.value_and_grad(model, _loss)(model, x, y)
        opt.update(model, grads)
        return loss

    if compiled:
        state = [model.state, opt.state]
        step = mx.compile(step, inputs=state, outputs=state)
    losses = []
    for _ in range(steps):
        losses.append(step(x, y))
        mx.eval(model.state, opt.state)
    return [float(v) for v in losses]


def _flat(tree: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(tree)}


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        assert a[k].dtype == b[k].dtype, k


def _assert_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    # Within the float32 conformance bound, measured as the suite does:
    # max|a - b| / max|b| per array.
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        scale = max(float(np.max(np.abs(b[k]))), np.finfo(np.float32).tiny)
        assert float(np.max(np.abs(a[k] - b[k]))) / scale <= TOLERANCES["float32"], k


# ------------------------------------------------------------------- nn.value_and_grad


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_mlp_trains_with_value_and_grad(name: str) -> None:
    losses = _train(_model(), OPTIMIZERS[name](), 40)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("name", ["QHM", "QHAdam"])
def test_each_parameter_steps_as_the_reference(name: str) -> None:
    # One step on a real model's parameter tree, leaf by leaf, against the
    # float64 reference fed the same float32 gradients.
    model, x, y = _model(), *_data()
    before = _flat(model.parameters())
    grads = nn.value_and_grad(model, _loss)(model, x, y)[1]
    if name == "QHM":
        opt, ref = QHM(0.1, 0.9, 0.7), reference.QHM(0.1, 0.9, 0.7)
    else:
        opt, ref = QHAdam(0.05, nus=(0.7, 0.8)), reference.QHAdam(0.05, nus=(0.7, 0.8))
    opt.update(model, grads)
    after = _flat(model.parameters())
    for key, g in _flat(grads).items():
        expected, _ = ref.step(before[key], g, ref.init(before[key]))
        np.testing.assert_allclose(after[key], expected, rtol=1e-6, atol=1e-7, err_msg=key)


# ----------------------------------------------------------------------- mx.compile


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_compiled_training_step_equals_the_eager_one(name: str) -> None:
    eager_model, eager_opt = _model(), OPTIMIZERS[name]()
    eager = _train(eager_model, eager_opt, 8)
    model, opt = _model(), OPTIMIZERS[name]()
    opt.init(model.trainable_parameters())  # the state must exist before compiling
    compiled = _train(model, opt, 8, compiled=True)
    # The same arithmetic; MLX may fuse the compiled graph differently (and
    # evaluate a bias correction's expm1 in another kernel), which can move a
    # float32 result by an ulp: bit-identical on MLX 0.32.4, not on 0.32.1.
    np.testing.assert_allclose(compiled, eager, rtol=TOLERANCES["float32"])
    _assert_close(_flat(model.parameters()), _flat(eager_model.parameters()))
    _assert_close(_flat(opt.state), _flat(eager_opt.state))


# ---------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_safetensors_checkpoint_resumes_bit_identically(name: str, tmp_path: Path) -> None:
    model, opt = _model(), OPTIMIZERS[name]()
    _train(model, opt, 5)
    model.save_weights(str(tmp_path / "model.safetensors"))
    mx.save_safetensors(str(tmp_path / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    _train(model, opt, 5)  # the uninterrupted run

    resumed_model, resumed_opt = _model(), OPTIMIZERS[name]()
    resumed_model.load_weights(str(tmp_path / "model.safetensors"))
    resumed_opt.state = tree_unflatten(
        list(mx.load(str(tmp_path / "optimizer.safetensors")).items())
    )
    assert resumed_opt.state["step"].item() == 5
    _train(resumed_model, resumed_opt, 5)
    _assert_same(_flat(resumed_model.parameters()), _flat(model.parameters()))
    _assert_same(_flat(resumed_opt.state), _flat(opt.state))


# ------------------------------------------------------------------------ schedules


@pytest.mark.parametrize(
    "schedule",
    [
        optim.exponential_decay(0.1, 0.9),
        optim.step_decay(0.1, 0.5, 3),
        optim.join_schedules([optim.linear_schedule(0.0, 0.1, 4), optim.cosine_decay(0.1, 8)], [4]),
    ],
    ids=["exponential_decay", "step_decay", "warmup-cosine"],
)
@pytest.mark.parametrize("name", ["QHM", "QHAdam"])
def test_mlx_schedules_give_step_t_the_rate_schedule_t(name: str, schedule) -> None:
    # float64 parameters; the schedule's float32 values, read back exactly, are
    # the reference's per-step learning rates.
    x0 = np.array([1.0, -1.0, 2.0])
    if name == "QHM":
        opt, ref = QHM(schedule, 0.9, 0.7), reference.QHM(1.0, 0.9, 0.7)
    else:
        opt, ref = QHAdam(schedule, nus=(0.7, 1.0)), reference.QHAdam(1.0, nus=(0.7, 1.0))
    params, rx, rs = {"x": mx.array(x0, dtype=mx.float64)}, x0, ref.init(x0)
    for t in range(12):
        lr = float(schedule(mx.array(t)).astype(mx.float64))
        params = opt.apply_gradients({"x": mx.array(2 * rx, dtype=mx.float64)}, params)
        rx, rs = ref.step(rx, 2 * rx, rs, lr=lr)
        np.testing.assert_allclose(np.array(params["x"]), rx, rtol=1e-12)


def test_setting_the_learning_rate_takes_effect_on_the_next_step() -> None:
    opt = QHM(0.1, momentum=0.5, nu=0.0)  # nu = 0: plain SGD, step = -lr * grad
    params = opt.apply_gradients({"x": mx.ones(2)}, {"x": mx.zeros(2)})
    opt.learning_rate = 0.25
    params = opt.apply_gradients({"x": mx.ones(2)}, params)
    np.testing.assert_allclose(np.array(params["x"]), -(0.1 + 0.25) * np.ones(2), rtol=1e-6)


# --------------------------------------------------------------------- weight decay


def _against_reference(opt: Any, ref: Any, steps: int = 10) -> None:
    x0 = np.array([1.5, -0.5, 2.0, 0.25])
    params, rx, rs = {"x": mx.array(x0, dtype=mx.float64)}, x0, ref.init(x0)
    for t in range(steps):
        g = np.cos(rx + t)
        params = opt.apply_gradients({"x": mx.array(g, dtype=mx.float64)}, params)
        rx, rs = ref.step(rx, g, rs)
    np.testing.assert_allclose(np.array(params["x"]), rx, rtol=1e-12)


LR = mx.array(0.05, dtype=mx.float64)


@pytest.mark.parametrize("decoupled", [False, True], ids=["coupled", "decoupled"])
def test_qhm_weight_decay_forms(decoupled: bool) -> None:
    _against_reference(
        QHM(LR, 0.9, 0.7, weight_decay=0.1, decoupled_weight_decay=decoupled),
        reference.QHM(0.05, 0.9, 0.7, weight_decay=0.1, decoupled_weight_decay=decoupled),
    )


@pytest.mark.parametrize("decoupled", [False, True], ids=["coupled", "decoupled"])
def test_qhadam_weight_decay_forms(decoupled: bool) -> None:
    _against_reference(
        QHAdam(LR, nus=(0.7, 0.9), weight_decay=0.1, decoupled_weight_decay=decoupled),
        reference.QHAdam(0.05, nus=(0.7, 0.9), weight_decay=0.1, decoupled_weight_decay=decoupled),
    )


def test_qhadamw_is_decoupled_decay_with_mlx_adamw_default() -> None:
    _against_reference(
        QHAdamW(LR, nus=(0.7, 0.9)), reference.QHAdamW(0.05, nus=(0.7, 0.9), weight_decay=0.01)
    )


def test_coupled_decay_does_not_change_the_callers_gradient() -> None:
    grads = {"x": mx.array([1.0, 2.0])}
    QHAdam(0.1, weight_decay=0.5).apply_gradients(grads, {"x": mx.array([3.0, 4.0])})
    np.testing.assert_array_equal(np.array(grads["x"]), [1.0, 2.0])


# ------------------------------------------------------------------- MLX's machinery


def test_multi_optimizer_splits_parameters() -> None:
    model = _model()
    opt = optim.MultiOptimizer([QHAdamW(0.01), QHM(0.1)], [lambda path, w: w.ndim > 1])
    losses = _train(model, opt, 20)
    assert losses[-1] < losses[0]
    weights, biases = (
        {k.rsplit(".", 1)[-1] for k, _ in tree_flatten(s)} for s in opt.state["states"]
    )
    assert weights == {"step", "learning_rate", "m", "v"}
    assert biases == {"step", "learning_rate", "momentum_buffer"}


def test_frozen_parameters_are_left_alone() -> None:
    model = _model()
    model.layers[0].freeze()
    frozen = _flat(model.layers[0].parameters())
    _train(model, QHAdam(0.05, nus=(0.7, 1.0)), 3)
    _assert_same(_flat(model.layers[0].parameters()), frozen)


def test_the_digits_example_trains() -> None:
    example = Path(__file__).parents[2] / "docs" / "examples" / "mlx_digits.py"
    losses, accuracy = runpy.run_path(str(example), run_name="example")["train"](epochs=8)
    assert losses[-1] < 0.25 * losses[0]
    assert accuracy > 0.9
