"""``qhoptim.mlx.QHMuon``: MLX's Muon bit for bit at ``nu = momentum`` and
``nu = 1``, the float64 reference elsewhere, its state (also stored narrow), and bad input."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_map

from qhoptim import convert, reference
from qhoptim.mlx import QHM, QHMuon

F64 = mx.float64
# A matrix each way, an array of three dimensions (orthogonalized as
# (shape[0], -1)) and a vector (QHM's direction as it is), as MLX's Muon takes them.
SHAPES = {"tall": (6, 4), "wide": (4, 6), "conv": (3, 2, 2), "bias": (5,)}


def _arrays(seed: int, dtype: Any = mx.float32) -> dict[str, mx.array]:
    rng = np.random.default_rng(seed)
    return {k: mx.array(rng.standard_normal(s), dtype=dtype) for k, s in SHAPES.items()}


def _run(opt: optim.Optimizer, params: dict[str, mx.array], steps: int, first: int = 0) -> Any:
    for t in range(first, first + steps):
        params = opt.apply_gradients(_arrays(100 + t, params["tall"].dtype), params)
    mx.eval(params, opt.state)
    return params


@pytest.mark.skipif(not hasattr(optim, "Muon"), reason="this MLX has no optimizers.Muon")
@pytest.mark.parametrize("nesterov", [True, False])
def test_equals_mlx_muon_bit_for_bit(nesterov: bool) -> None:
    muon = optim.Muon(0.02, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    qh = QHMuon.from_params(convert.from_muon(0.9, nesterov), learning_rate=0.02, weight_decay=0.01)
    want, got = _run(muon, _arrays(0), 50), _run(qh, _arrays(0), 50)
    for k in SHAPES:
        np.testing.assert_array_equal(np.array(got[k]), np.array(want[k]), err_msg=k)
        np.testing.assert_array_equal(
            np.array(qh.state[k]["momentum_buffer"]), np.array(muon.state[k]["v"]), err_msg=k
        )


@pytest.mark.parametrize(
    "settings",
    [
        {"momentum": 0.9, "nu": 0.7},
        {"momentum": 0.999, "nu": 1.3, "weight_decay": 0.05},
        {"momentum": 0.5, "nu": 0.0},
    ],
)
def test_float64_follows_the_reference(settings: dict[str, Any]) -> None:
    ref = reference.QHMuon(
        lr=0.02, **{"weight_decay": 0.0, **settings}, norm_guard="add",
        decoupled_weight_decay=False,
    )  # fmt: skip
    opt = QHMuon(mx.array(0.02, dtype=F64), **{"weight_decay": 0.0, **settings}, ns_dtype=F64)
    start = _arrays(0, F64)
    with mx.stream(mx.cpu):  # float64 runs on MLX's CPU stream
        got = _run(opt, dict(start), 30)
    for k in ("tall", "wide"):
        theta = np.array(start[k])
        state = ref.init(theta)
        for t in range(30):
            theta, state = ref.step(theta, np.array(_arrays(100 + t, F64)[k]), state)
        np.testing.assert_allclose(np.array(got[k]), theta, rtol=1e-12, atol=1e-13)


def test_vectors_take_qhm_direction() -> None:
    # Fewer than two dimensions: no orthogonalization, no shape ratio: QHM's step.
    qh = QHMuon(0.1, momentum=0.9, nu=0.7, weight_decay=0.0)
    qhm = QHM(0.1, momentum=0.9, nu=0.7)
    a = b = {"bias": mx.array([1.0, -2.0, 3.0])}
    for t in range(5):
        g = {"bias": mx.array([0.5, 0.25 * t, -1.0])}
        a, b = qh.apply_gradients(g, a), qhm.apply_gradients(g, b)
    np.testing.assert_array_equal(np.array(a["bias"]), np.array(b["bias"]))


@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0, 0), (0, 3, 3)])
def test_an_empty_matrix_steps_as_nothing(shape: tuple[int, ...]) -> None:
    # As in the other backends (and MLX's Muon): the other parameters step.
    params = {"empty": mx.zeros(shape), "other": mx.ones((3, 2))}
    grads = {"empty": mx.zeros(shape), "other": mx.ones((3, 2))}
    opt = QHMuon(0.1)
    stepped = opt.apply_gradients(grads, params)
    mx.eval(stepped)
    assert stepped["empty"].shape == shape
    assert not np.array_equal(np.array(stepped["other"]), np.ones((3, 2)))


def test_state_resumes_bit_for_bit() -> None:
    whole = _run(QHMuon(0.02, nu=0.7), _arrays(0), 10)
    first = QHMuon(0.02, nu=0.7)
    half = _run(first, _arrays(0), 5)
    second = QHMuon(0.02, nu=0.7)
    second.state = tree_map(lambda a: mx.array(np.array(a)), first.state)  # a checkpoint's copy
    resumed = _run(second, half, 5, first=5)
    for k in SHAPES:
        np.testing.assert_array_equal(np.array(resumed[k]), np.array(whole[k]), err_msg=k)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"momentum": 1.0}, ValueError, r"momentum must be in \[0, 1\); received momentum=1.0"),
        ({"nu": float("nan")}, ValueError, "nu must be a finite real number; received nu=nan"),
        ({"learning_rate": -1.0}, ValueError, r"learning_rate must be in \[0, inf\)"),
        ({"ns_steps": -1}, ValueError, r"ns_steps must be in \[0, 100\); received ns_steps=-1"),
        ({"ns_dtype": mx.int32}, ValueError, "ns_dtype must be None or one of mx.bfloat16"),
    ],
)
def test_bad_hyperparameters_are_named(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        QHMuon(**{"learning_rate": 0.02, **kwargs})


def test_from_params_takes_muon_conversions_only() -> None:
    expected = r"QHMuon\.from_params expects qhoptim\.convert\.QHMuonParams"
    with pytest.raises(TypeError, match=expected):
        QHMuon.from_params(convert.from_nesterov(0.1, 0.9), learning_rate=0.1)  # type: ignore[arg-type]


# ------------------------------------------------------------------ state_dtype
def test_a_bfloat16_buffer_resumes_bit_for_bit() -> None:
    whole = QHMuon(0.02, momentum=0.9, nu=0.7, state_dtype=mx.bfloat16)
    want = _run(whole, _arrays(0), 10)
    for k in SHAPES:
        assert whole.state[k]["momentum_buffer"].dtype == mx.bfloat16
    first = QHMuon(0.02, momentum=0.9, nu=0.7, state_dtype=mx.bfloat16)
    half = _run(first, _arrays(0), 5)
    resumed = QHMuon(0.02, momentum=0.9, nu=0.7, state_dtype=mx.bfloat16)
    resumed.state = tree_map(lambda x: x, first.state)  # a checkpoint: the same arrays
    got = _run(resumed, half, 5, first=5)
    for k in SHAPES:
        np.testing.assert_array_equal(np.array(got[k]), np.array(want[k]))


def test_stochastic_rounding_is_the_narrow_buffers_default() -> None:
    def buffers(**kwargs: Any) -> list[np.ndarray]:
        opt = QHMuon(0.02, momentum=0.9, nu=0.7, state_dtype=mx.bfloat16, **kwargs)
        _run(opt, _arrays(0), 5)
        return [np.array(opt.state[k]["momentum_buffer"].astype(mx.float32)) for k in SHAPES]

    default, nearest = buffers(), buffers(stochastic_rounding=False)
    for d, s in zip(default, buffers(stochastic_rounding=True), strict=True):
        np.testing.assert_array_equal(d, s)
    assert any(not np.array_equal(d, n) for d, n in zip(default, nearest, strict=True))


def test_bad_state_settings_are_named() -> None:
    with pytest.raises(ValueError, match=r"state_dtype must be None or one of mx\.bfloat16"):
        QHMuon(0.02, state_dtype=mx.int8)
    with pytest.raises(TypeError, match="stochastic_rounding must be None or a bool"):
        QHMuon(0.02, state_dtype=mx.bfloat16, stochastic_rounding=1)


@pytest.mark.parametrize("scale", [1e-8, 1e3])
def test_a_float16_orthogonalization_keeps_the_step_of_small_and_large_gradients(
    scale: float,
) -> None:
    # Cast to float16 before the norm, the step was zero (or NaN): the squared
    # norm overflowed float16, or the entries underflowed.
    g = mx.array(np.random.default_rng(0).standard_normal((64, 64)) * scale, dtype=mx.float32)

    def first_update(ns_dtype: Any) -> np.ndarray:
        opt = QHMuon(1.0, ns_dtype=ns_dtype)
        stepped = opt.apply_gradients({"w": g}, {"w": mx.zeros((64, 64))})
        return np.array(stepped["w"], dtype=np.float64)

    want, got = first_update(mx.float32), first_update(mx.float16)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * np.abs(want).max())


@pytest.mark.parametrize("scale", [1e-4, 1e2])
def test_float16_parameters_orthogonalize_in_float32_first(scale: float) -> None:
    # With ns_dtype None a float16 parameter's direction is float16: its norm
    # zeroed (1e2: the squares' sum overflows) or NaN'd (1e-4: the squares
    # underflow) the step where it was taken in float16.
    g = np.random.default_rng(0).standard_normal((64, 64)) * scale

    def first_update(dtype: Any) -> np.ndarray:
        opt = QHMuon(1.0)
        stepped = opt.apply_gradients(
            {"w": mx.array(g, dtype=dtype)}, {"w": mx.zeros((64, 64), dtype)}
        )
        return np.array(stepped["w"].astype(mx.float32), dtype=np.float64)

    want, got = first_update(mx.float32), first_update(mx.float16)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * np.abs(want).max())
