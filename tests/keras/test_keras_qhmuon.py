"""``qhoptim.keras.QHMuon``: Keras's Muon at ``nu = momentum`` and ``nu = 1``
(to its rounding; AdamW's variables bit for bit), the float64 reference
elsewhere, configuration round trips, narrow slots, and bad input. Runs on every
backend."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
from qh_keras_testing import slot_values

import qhoptim.keras as qk
from conformance.cases import (
    narrow_state_cases,
    narrow_state_tolerance,
    relative_state_distance,
    stored_state_tolerance,
)
from conformance.problems import get_problem
from qhoptim import convert, reference

# Muon's matrices each way, and a vector (Keras's Muon gives it AdamW's step).
SHAPES = {"tall": (6, 4), "wide": (4, 6), "bias": (5,)}
MATRICES = ("tall", "wide")


def _arrays(seed: int, dtype: str = "float32") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}


def _run(opt: keras.optimizers.Optimizer, steps: int, dtype: str = "float32") -> dict[str, Any]:
    variables = {k: keras.Variable(v, dtype=dtype, name=k) for k, v in _arrays(0, dtype).items()}
    for t in range(steps):
        grads = _arrays(100 + t, dtype)
        pairs = [(keras.ops.convert_to_tensor(grads[k], dtype), v) for k, v in variables.items()]
        opt.apply_gradients(pairs)
    return {k: np.asarray(keras.ops.convert_to_numpy(v)) for k, v in variables.items()}


@pytest.mark.parametrize("nesterov", [True, False])
def test_equals_keras_muon(nesterov: bool) -> None:
    settings = {"learning_rate": 0.02, "weight_decay": 0.01}
    want = _run(keras.optimizers.Muon(momentum=0.9, nesterov=nesterov, **settings), 50)
    got = _run(qk.QHMuon.from_params(convert.from_muon(0.9, nesterov), **settings), 50)
    np.testing.assert_array_equal(got["bias"], want["bias"])  # Keras's AdamW step, inherited
    # The trace is updated as beta * m + g where Keras writes m + (g + m * (beta - 1)):
    # float32's rounding.
    for k in MATRICES:
        np.testing.assert_allclose(got[k], want[k], atol=2e-6 * np.abs(want[k]).max())


@pytest.mark.parametrize(
    "settings",
    [
        {"momentum": 0.9, "nu": 0.7},
        {"momentum": 0.99, "nu": 1.3, "weight_decay": 0.0625},
        {"momentum": 0.5, "nu": 0.0},
    ],
)
def test_float32_follows_the_float64_reference(settings: dict[str, Any]) -> None:
    # Keras's Muon steps float32 variables: its shape scaling is a float32
    # tensor (TensorFlow refuses it beside float64) and Keras on torch
    # multiplies float64 matrices in float32. So: float32 against the float64
    # reference, to what float32 Newton-Schulz holds over 20 steps.
    lr = 2.0**-6
    settings = {"weight_decay": 0.0, **settings}
    got = _run(qk.QHMuon(learning_rate=lr, **settings), 20)
    ref = reference.QHMuon(
        lr=lr,
        momentum=settings["momentum"],
        nu=settings["nu"],
        weight_decay=settings["weight_decay"],
        eps=qk._qhmuon.KERAS_MUON_NORM_EPS,
        adjust_lr_fn="match_rms_adamw",  # Keras's rms_rate=0.2
        rms=0.2,
        norm_guard="add",
        unnormalized_buffer=True,
        fan_in_first=True,
    )
    start = {k: v.astype("float64") for k, v in _arrays(0).items()}
    for k in MATRICES:
        theta, state = start[k], ref.init(start[k])
        for t in range(20):
            theta, state = ref.step(theta, _arrays(100 + t)[k].astype("float64"), state)
        deviation = np.abs(got[k] - theta).max() / np.abs(theta).max()
        assert deviation < 2e-6, (k, deviation)  # measured: up to 2.5e-7


def test_configuration_round_trips_and_names() -> None:
    opt = qk.QHMuon(learning_rate=0.01, nu=0.7, momentum=0.99, exclude_layers=["head"])
    config = opt.get_config()
    assert config["nu"] == 0.7 and config["momentum"] == 0.99 and "nesterov" not in config
    again = qk.QHMuon.from_config(config)
    assert again.nu == 0.7 and again.exclude_layers == ["head"]
    assert isinstance(keras.optimizers.get("qhmuon"), qk.QHMuon)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert isinstance(restored, qk.QHMuon) and restored.nu == 0.7


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"momentum": 1.0}, ValueError, r"momentum must be in \[0, 1\); received momentum=1.0"),
        ({"nu": float("nan")}, ValueError, "nu must be a finite real number; received nu=nan"),
        ({"learning_rate": -1.0}, ValueError, r"learning_rate must be in \[0, inf\)"),
        ({"ns_steps": 100}, ValueError, r"ns_steps must be in \[0, 100\); received ns_steps=100"),
        ({"nesterov": False}, TypeError, "QHMuon takes nu instead of nesterov"),
        # Keras's three Newton-Schulz arguments, each by its own name.
        ({"muon_a": float("nan")}, ValueError, r"^muon_a must be a finite real number; received"),
        ({"muon_c": "x"}, TypeError, r"^muon_c must be a real number"),
        # The other variables' AdamW settings, which Keras's Muon takes unchecked.
        ({"adam_beta_1": 1.5}, ValueError, r"adam_beta_1 must be in \[0, 1\)"),
        ({"adam_beta_2": -1.0}, ValueError, r"adam_beta_2 must be in \[0, 1\)"),
        ({"epsilon": -1e-7}, ValueError, r"epsilon must be in \[0, inf\)"),
        ({"adam_weight_decay": -10.0}, ValueError, r"adam_weight_decay must be in \[0, inf\)"),
        ({"adam_lr_ratio": float("nan")}, ValueError, r"adam_lr_ratio must be in \[0, inf\)"),
        ({"rms_rate": -0.2}, ValueError, r"rms_rate must be in \[0, inf\)"),
    ],
)
def test_bad_hyperparameters_are_named(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        qk.QHMuon(**kwargs)


def test_from_params_takes_muon_conversions_only() -> None:
    with pytest.raises(TypeError, match=r"QHMuon\.from_params expects qhoptim\.convert\.QHMuon"):
        qk.QHMuon.from_params(convert.from_nesterov(0.1, 0.9))


def test_an_earlier_keras_muon_is_refused_with_its_version(monkeypatch: pytest.MonkeyPatch) -> None:
    # Keras before 3.13 keeps Muon's slots apart from _muon_update_step.
    monkeypatch.setattr(qk._qhmuon, "_muon_keeps_a_slot_per_index", lambda: False)
    with pytest.raises(ImportError, match=r"Keras 3\.13 and later define it; found keras 3\."):
        qk.QHMuon()


# ------------------------------------------------------------------ state_dtype
def _slot_dtypes(opt: qk.QHMuon) -> dict[str, str]:
    """Each slot's dtype by its name (``tall_momentum``, ``bias_velocity``, ...)."""
    return {v.name: v.dtype for v in opt.variables if v.name not in ("iteration", "learning_rate")}


def test_muons_momentum_slots_are_stored_narrow_and_adamws_are_not() -> None:
    opt = qk.QHMuon(learning_rate=0.02, momentum=0.9, nu=0.7, state_dtype="bfloat16")
    _run(opt, 3)
    dtypes = _slot_dtypes(opt)
    for k in MATRICES:
        assert dtypes[f"{k}_momentum"] == "bfloat16"
    assert dtypes["bias_momentum"] == "float32" and dtypes["bias_velocity"] == "float32"
    config = opt.get_config()
    assert config["state_dtype"] == "bfloat16" and config["stochastic_rounding"] is None
    assert "state_dtype" not in qk.QHMuon(learning_rate=0.02).get_config()


def test_a_restored_optimizer_continues_bit_for_bit() -> None:
    settings = {"learning_rate": 0.02, "momentum": 0.9, "nu": 0.7, "state_dtype": "bfloat16"}
    want = _run(qk.QHMuon(**settings), 6)
    first = qk.QHMuon(**settings)
    variables = {k: keras.Variable(v, dtype="float32", name=k) for k, v in _arrays(0).items()}

    def steps(opt: qk.QHMuon, ts: range) -> None:
        for t in ts:
            grads = _arrays(100 + t)
            opt.apply_gradients(
                [(keras.ops.convert_to_tensor(grads[k]), v) for k, v in variables.items()]
            )

    steps(first, range(3))
    store: dict[str, Any] = {}
    first.save_own_variables(store)
    resumed = qk.QHMuon.from_config(first.get_config())
    resumed.build(list(variables.values()))
    resumed.load_own_variables(store)
    steps(resumed, range(3, 6))
    for k, v in variables.items():
        np.testing.assert_array_equal(np.asarray(keras.ops.convert_to_numpy(v)), want[k])


@pytest.mark.parametrize("case", narrow_state_cases(("qhmuon",)), ids=lambda c: c.name)
def test_bfloat16_slots_follow_float32_slots_on_the_conformance_matrices(case: Any) -> None:
    problem = get_problem(case.problem_name)
    hp = {"weight_decay": 0.0, **case.hparams}

    def run(**options: Any) -> tuple[np.ndarray, list[np.ndarray]]:
        opt = qk.QHMuon(
            learning_rate=hp["lr"], momentum=hp["momentum"], nu=hp["nu"],
            weight_decay=hp["weight_decay"], **options,
        )  # fmt: skip
        variables = [
            keras.Variable(a, dtype="float32", name=f"p{i}")
            for i, a in enumerate(problem.split(problem.x0))
        ]
        out, slots = [], []
        for t in range(100):
            x = problem.join([np.asarray(keras.ops.convert_to_numpy(v)) for v in variables])
            grads = [
                keras.ops.convert_to_tensor(g, "float32") for g in problem.split(problem.grad(x, t))
            ]
            opt.apply_gradients(list(zip(grads, variables, strict=True)))
            out.append(problem.join([np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]))
            slots.append(slot_values(opt))
        return np.array(out), slots

    (wide, wide_slots), (narrow, narrow_slots) = run(), run(state_dtype="bfloat16")
    relative = np.linalg.norm(narrow - wide, axis=1) / np.linalg.norm(wide, axis=1)
    assert relative.max() <= narrow_state_tolerance(case)
    # The trajectories alone strayed 0.7% with the buffer reset at every step.
    assert relative_state_distance(narrow_slots, wide_slots) <= stored_state_tolerance(
        case, eight_bit=False
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"state_dtype": "int8"}, ValueError, "state_dtype must be None or one of bfloat16"),
        ({"stochastic_rounding": 1}, TypeError, "stochastic_rounding must be None or a bool"),
    ],
)
def test_bad_state_settings_are_named(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        qk.QHMuon(learning_rate=0.02, **kwargs)


def test_a_slot_wider_than_its_variable_is_refused() -> None:
    opt = qk.QHMuon(learning_rate=0.02, state_dtype="float32")
    with pytest.raises(ValueError, match="wider than a parameter's dtype float16"):
        opt.build([keras.Variable(np.zeros((3, 2)), dtype="float16", name="w")])


def test_a_refused_first_step_leaves_nothing_built_and_is_refused_again() -> None:
    # A matrix whose slot can follow, then one whose slot cannot: the refusal
    # comes before Keras marks the optimizer built or makes any slot, so the
    # next step is refused alike and no variable moves.
    a = keras.Variable(np.ones((3, 2)), dtype="float32", name="a")
    w = keras.Variable(np.ones((3, 2)), dtype="float16", name="w")
    opt = qk.QHMuon(learning_rate=0.02, state_dtype="float32")
    grads = [keras.ops.ones((3, 2)), keras.ops.ones((3, 2), dtype="float16")]
    for _ in range(2):
        with pytest.raises(ValueError, match="wider than a parameter's dtype float16"):
            opt.apply(grads, [a, w])
        assert not opt.built and int(opt.iterations) == 0
        assert np.array_equal(np.asarray(a), np.ones((3, 2)))


# ------------------------------------------------------------------------ Lion
@pytest.mark.parametrize(("b1", "b2"), [(0.9, 0.99), (0.95, 0.98)])
def test_keras_lion_is_sign_qhm(b1: float, b2: float) -> None:
    # convert.from_lion's claim, against keras.optimizers.Lion itself: QHM's
    # buffer and direction from the rules (in float64), the sign of the
    # direction taken; each step of Lion is -lr times that sign.
    from qhoptim import rules

    settings = convert.from_lion(2.0**-10, (b1, b2))
    lion = keras.optimizers.Lion(learning_rate=2.0**-10, beta_1=b1, beta_2=b2)
    variables = {k: keras.Variable(v, name=k) for k, v in _arrays(0).items()}
    buffers = {k: np.zeros(s) for k, s in SHAPES.items()}
    for t in range(30):
        grads = _arrays(100 + t)
        before = {k: np.asarray(keras.ops.convert_to_numpy(v)) for k, v in variables.items()}
        lion.apply_gradients(
            [(keras.ops.convert_to_tensor(grads[k]), v) for k, v in variables.items()]
        )
        for k, v in variables.items():
            buffers[k], direction = rules.qhm_update(
                grads[k].astype(np.float64), buffers[k], momentum=settings.momentum, nu=settings.nu
            )
            want = before[k] - np.float32(settings.lr) * np.sign(direction).astype(np.float32)
            np.testing.assert_array_equal(np.asarray(keras.ops.convert_to_numpy(v)), want)
