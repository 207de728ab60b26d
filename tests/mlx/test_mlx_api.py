"""qhoptim.mlx: the classes, their defaults and state, imports, and what they recover."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import subprocess
import sys

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_map

import qhoptim.mlx as qhmlx
from qhoptim import convert, reference
from qhoptim.mlx import QHM, QHAdam, QHAdamW

F64 = mx.float64


def _defaults(cls: type) -> dict[str, object]:
    return {
        name: p.default
        for name, p in inspect.signature(cls).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def _reference_defaults(cls: type) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name != "lr"}


def _run(opt, x0: np.ndarray, grad, steps: int, dtype=F64) -> np.ndarray:
    """``steps`` steps of ``opt`` from ``x0`` with gradients ``grad(x, t)``; the last iterate."""
    params = {"x": mx.array(x0, dtype=dtype)}
    for t in range(steps):
        g = {"x": mx.array(grad(np.array(params["x"], dtype=np.float64), t), dtype=dtype)}
        params = opt.apply_gradients(g, params)
        mx.eval(params, opt.state)
    return np.array(params["x"], dtype=np.float64)


def _grad(x: np.ndarray, t: int) -> np.ndarray:
    # A quadratic with distinct curvatures and a drifting linear term.
    return np.arange(1.0, x.size + 1) * x + np.sin(t + np.arange(x.size))


X0 = np.linspace(-1.0, 1.5, 6)


# ---------------------------------------------------------------------------- classes


def test_the_public_api() -> None:
    assert qhmlx.__all__ == ["QHM", "QHAdam", "QHAdamW", "QHMuon"]
    for cls in (QHM, QHAdam, QHAdamW, qhmlx.QHMuon):
        assert issubclass(cls, optim.Optimizer)
    assert issubclass(QHAdamW, QHAdam)


def test_defaults_are_the_other_backends() -> None:
    # The float64 reference holds the defaults every backend shares; the
    # state's dtype is the parameters' unless one is asked for, and the path
    # MLX's operations but for a bfloat16 state (fused=None).
    qhm = _defaults(QHM)
    state = {"state_dtype": None, "stochastic_rounding": None, "fused": None}
    assert qhm == {**_reference_defaults(reference.QHM), "decoupled_weight_decay": False, **state}
    assert _defaults(QHAdam) == {**_reference_defaults(reference.QHAdam), **state}
    assert "learning_rate" not in qhm  # required, as in MLX's own optimizers


def test_qhadamw_takes_mlx_adamw_default_weight_decay() -> None:
    want = inspect.signature(optim.AdamW).parameters["weight_decay"].default
    assert _defaults(QHAdamW)["weight_decay"] == want
    assert QHAdamW(1e-3).weight_decay == want
    assert QHAdamW(1e-3).decoupled_weight_decay is True
    assert {k: v for k, v in _defaults(QHAdamW).items() if k != "weight_decay"} == {
        k: v
        for k, v in _defaults(QHAdam).items()
        if k not in ("weight_decay", "decoupled_weight_decay")
    }


@pytest.mark.parametrize(
    ("make", "keys"),
    [
        (lambda: QHM(0.1), {"momentum_buffer"}),
        (lambda: QHAdam(0.1), {"m", "v"}),
        (lambda: QHAdamW(0.1), {"m", "v"}),
        (lambda: QHAdam(0.1, amsgrad=True), {"m", "v", "v_max"}),
        (lambda: QHAdamW(0.1, amsgrad=True), {"m", "v", "v_max"}),
    ],
    ids=["QHM", "QHAdam", "QHAdamW", "QHAdam-amsgrad", "QHAdamW-amsgrad"],
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16, mx.float64])
def test_state_is_zeros_in_the_parameter_dtype(make, keys, dtype) -> None:
    opt = make()
    params = {"w": mx.ones((3, 2), dtype=dtype), "layers": [{"b": mx.ones(4, dtype=dtype)}]}
    opt.init(params)
    assert set(opt.state) == {"step", "learning_rate", "w", "layers"}
    for leaf in (opt.state["w"], opt.state["layers"][0]["b"]):
        assert set(leaf) == keys
        for value in leaf.values():
            assert value.dtype == dtype and not bool(mx.any(value))
    assert opt.state["step"].item() == 0


def test_integer_and_complex_parameters_are_refused() -> None:
    for dtype in (mx.int32, mx.complex64):
        for opt in (QHM(0.1), QHAdam(0.1)):
            with pytest.raises(TypeError, match="real floating-point"):
                opt.init({"w": mx.zeros(2, dtype=dtype)})


@pytest.mark.parametrize("cls", [QHM, QHAdam, QHAdamW])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_low_precision_parameters_keep_their_dtype(cls, dtype) -> None:
    opt = cls(mx.array(0.5, dtype=dtype))
    params = {"w": mx.ones(4, dtype=dtype)}
    for _ in range(3):
        params = opt.apply_gradients({"w": mx.ones(4, dtype=dtype)}, params)
    mx.eval(params, opt.state)
    assert params["w"].dtype == dtype
    assert all(v.dtype == dtype for v in opt.state["w"].values())
    assert bool(mx.all(params["w"] < 1.0))


# ---------------------------------------------------------------------------- imports


def _fresh(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout


def test_import_qhoptim_does_not_import_mlx() -> None:
    code = (
        "import sys, json, qhoptim, qhoptim.rules, qhoptim.validation, qhoptim.reference\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx')))"
    )
    assert json.loads(_fresh(code)) == []


def test_import_without_mlx_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['mlx'] = None  # as if MLX were not installed\n"
        "try:\n"
        "    import qhoptim.mlx\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    message = _fresh(code)
    assert "qhoptim.mlx needs MLX" in message
    assert 'pip install "qhoptim[mlx]"' in message


# ------------------------------------------------------------------------ from_params


def test_from_params_of_from_nesterov_is_mlx_sgd_nesterov() -> None:
    lr, beta = 0.01, 0.9
    params = convert.from_nesterov(lr, beta)
    qhm = QHM.from_params(params)
    qhm.learning_rate = mx.array(params.lr, dtype=F64)  # a float64 run's lr, kept in float64
    a = _run(qhm, X0, _grad, 30)
    sgd = optim.SGD(mx.array(lr, dtype=F64), momentum=beta, nesterov=True)
    np.testing.assert_allclose(a, _run(sgd, X0, _grad, 30), rtol=1e-12)


def test_from_params_maps_every_field() -> None:
    p = convert.QHAdamParams(lr=0.02, betas=(0.8, 0.9), nus=(0.6, 0.7), eps=1e-6)
    opt = QHAdamW.from_params(p, weight_decay=0.1)
    assert type(opt) is QHAdamW
    assert (opt.betas, opt.nus, opt.eps, opt.weight_decay) == ((0.8, 0.9), (0.6, 0.7), 1e-6, 0.1)
    assert opt.learning_rate.item() == pytest.approx(0.02)
    q = QHM.from_params(convert.QHMParams(lr=0.3, nu=0.7, momentum=0.95), weight_decay=0.1)
    assert (q.momentum, q.nu, q.weight_decay) == (0.95, 0.7, 0.1)


@pytest.mark.parametrize(
    ("cls", "params"),
    [(QHM, convert.QHAdamParams(1e-3, (0.9, 0.999), (1.0, 1.0), 1e-8)), (QHAdam, None)],
)
def test_from_params_rejects_other_types(cls, params) -> None:
    with pytest.raises(TypeError, match=f"^{cls.__name__}.from_params expects qhoptim.convert"):
        cls.from_params(params)


# ---------------------------------------------- what QHM and QHAdam recover (paper, sec. 4)


@pytest.mark.parametrize("nesterov", [False, True])
def test_qhm_recovers_mlx_sgd_momentum_and_nesterov(nesterov: bool) -> None:
    # MLX's SGD keeps an unnormalized velocity: lr_qhm = lr / (1 - beta);
    # nu = 1 is momentum, nu = beta Nesterov.
    lr, beta = 0.01, 0.9
    qhm = QHM(mx.array(lr / (1 - beta), dtype=F64), beta, beta if nesterov else 1.0)
    sgd = optim.SGD(mx.array(lr, dtype=F64), momentum=beta, nesterov=nesterov)
    np.testing.assert_allclose(_run(qhm, X0, _grad, 30), _run(sgd, X0, _grad, 30), rtol=1e-12)


# MLX's Adam forms its bias corrections in float32, also for float64
# parameters: ``1 - b**step`` and its ``rsqrt``. Betas that float32 holds
# exactly (0.5**t and 0.75**t are exact for t < 16) leave only the float32
# ``rsqrt`` of the second correction: the runs agree to float32 rounding.
BETAS = (0.5, 0.75)
ADAM_RTOL = 1e-6


def test_qhadam_with_unit_nus_is_mlx_adam_with_bias_correction() -> None:
    lr = mx.array(0.05, dtype=F64)
    a = _run(QHAdam(lr, BETAS, (1.0, 1.0), 1e-8), X0, _grad, 15)
    b = _run(optim.Adam(lr, list(BETAS), 1e-8, bias_correction=True), X0, _grad, 15)
    np.testing.assert_allclose(a, b, rtol=ADAM_RTOL)


def test_qhadamw_with_unit_nus_is_mlx_adamw_with_bias_correction() -> None:
    lr = mx.array(0.05, dtype=F64)
    a = _run(QHAdamW(lr, BETAS, (1.0, 1.0), 1e-8, weight_decay=0.1), X0, _grad, 15)
    adamw = optim.AdamW(lr, list(BETAS), 1e-8, weight_decay=0.1, bias_correction=True)
    np.testing.assert_allclose(a, _run(adamw, X0, _grad, 15), rtol=ADAM_RTOL)


def test_adam_state_resumes_as_qhadam() -> None:
    # QHAdam keeps Adam's state names and meaning (m, v): an Adam checkpoint
    # continues as QHAdam with nus = (1, 1).
    lr = mx.array(0.05, dtype=F64)
    adam = optim.Adam(lr, list(BETAS), 1e-8, bias_correction=True)
    x = _run(adam, X0, _grad, 5)
    qhadam = QHAdam(lr, BETAS, (1.0, 1.0), 1e-8)
    qhadam.state = tree_map(lambda a: a, adam.state)  # a copy of the containers
    after_adam = _run(adam, x, _grad, 5)
    np.testing.assert_allclose(_run(qhadam, x, _grad, 5), after_adam, rtol=ADAM_RTOL)


# --------------------------------------------------------------------------- amsgrad


def test_amsgrad_switched_on_for_a_stepped_state_starts_its_maximum_at_zero() -> None:
    # As torch: the running maximum of a state stepped without amsgrad starts at 0.
    lr, hp = mx.array(0.05, dtype=F64), {"betas": (0.9, 0.99), "nus": (0.7, 0.9)}
    plain = QHAdam(lr, **hp)
    x = _run(plain, X0, _grad, 4)
    ref = reference.QHAdam(0.05, **hp, amsgrad=True)
    rs = ref.init(X0)._replace(  # the reference's state at step 4, without a maximum yet
        step=4, exp_avg=np.array(plain.state["x"]["m"]), exp_avg_sq=np.array(plain.state["x"]["v"])
    )
    ams = QHAdam(lr, **hp, amsgrad=True)
    ams.state = tree_map(lambda a: a, plain.state)
    rx = x
    for t in range(4, 8):
        rx, rs = ref.step(rx, _grad(rx, t), rs)
    got = _run(ams, x, lambda x, t: _grad(x, t + 4), 4)
    np.testing.assert_allclose(got, rx, rtol=1e-12)


# ------------------------------------------------ flags and concrete scalars
@pytest.mark.parametrize("value", ["yes", 1, None, 0.0])
@pytest.mark.parametrize("cls", [qhmlx.QHM, qhmlx.QHAdam])
def test_decoupled_weight_decay_must_be_a_bool(cls: type, value: object) -> None:
    # The shared wording (torch's, optax's): any non-empty string is not True.
    match = f"decoupled_weight_decay must be a bool; received decoupled_weight_decay={value!r}"
    with pytest.raises(TypeError, match=re.escape(match)):
        cls(0.1, decoupled_weight_decay=value)


def test_concrete_numpy_scalars_are_held_as_python_floats() -> None:
    qhm = qhmlx.QHM(0.1, momentum=np.float64(0.9), nu=np.array(0.7), weight_decay=np.float32(0.5))
    assert [type(x) for x in (qhm.momentum, qhm.nu, qhm.weight_decay)] == [float] * 3
    assert (qhm.momentum, qhm.nu, qhm.weight_decay) == (0.9, 0.7, 0.5)
    qhadam = qhmlx.QHAdam(0.1, betas=(np.float32(0.5), 0.999), nus=(np.array(0.7), 1.0))
    assert [type(x) for x in (*qhadam.betas, *qhadam.nus, qhadam.eps)] == [float] * 5


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (QHM, {}),
        (QHAdam, {}),
        (QHAdam, {"state_dtype": mx.bfloat16}),
        (QHAdam, {"state_dtype": mx.bfloat16, "fused": False}),
        (qhmlx.QHMuon, {}),
    ],
)
def test_a_step_that_fails_part_way_leaves_the_state_as_it_was(cls: type, kwargs: dict) -> None:
    # MLX steps the parameters in turn: the first one's state was written
    # before the second one's gradient (of the wrong shape) failed.
    def good(t: int) -> dict[str, mx.array]:
        return {"a": mx.full((3, 3), 1.0 + t), "b": mx.full((4,), 2.0 - t)}

    opt, twin = cls(learning_rate=0.1, **kwargs), cls(learning_rate=0.1, **kwargs)
    params = opt.apply_gradients(good(0), {"a": mx.ones((3, 3)), "b": mx.ones((4,))})
    twin_params = twin.apply_gradients(good(0), {"a": mx.ones((3, 3)), "b": mx.ones((4,))})
    state = opt.state
    held = [(d, dict(d)) for d in (state, state["a"], state["b"])]
    with pytest.raises(ValueError):
        opt.apply_gradients({"a": mx.ones((3, 3)), "b": mx.ones((5,))}, params)
    assert opt.state is state  # the same dictionaries, which a compiled step holds
    for d, items in held:
        assert d.keys() == items.keys()
        assert all(d[k] is v for k, v in items.items())
    # The next step is the second, as if the failed one had not been tried.
    params = opt.apply_gradients(good(1), params)
    twin_params = twin.apply_gradients(good(1), twin_params)
    assert opt.step.item() == twin.step.item() == 2
    for k in params:
        assert mx.array_equal(params[k], twin_params[k]).item()
        for name in opt.state[k]:
            assert mx.array_equal(opt.state[k][name], twin.state[k][name]).item(), (k, name)
