"""The shared invalid-input table (conformance/invalid_inputs.py) against qhoptim.keras."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest

import qhoptim.keras as qk
from conformance.invalid_inputs import (
    INVALID,
    NAMES,
    Invalid,
    assert_fixed_after_construction,
    assert_refused_when_set,
    backend_kwargs,
    pattern,
)

FAMILIES = [(qk.QHM, "qhm"), (qk.QHAdam, "qhadam"), (qk.QHAdamW, "qhadam")]
CASES = [
    (cls, family, entry)
    for cls, family in FAMILIES
    for entry in INVALID
    if entry.applies_to(family) and NAMES["keras"][entry.param] is not None
]
IDS = [f"{cls.__name__}-{entry.id}" for cls, _, entry in CASES]


@pytest.mark.parametrize(("cls", "family", "entry"), CASES, ids=IDS)
def test_constructor_rejects(cls: type, family: str, entry: Invalid) -> None:
    with pytest.raises(entry.error, match=pattern(entry, NAMES["keras"][entry.param])):
        cls(**backend_kwargs("keras", family, entry))


def test_every_keras_argument_of_the_table_is_tried() -> None:
    tried = {NAMES["keras"][e.param] for _, _, e in CASES}
    assert tried == {
        "learning_rate",
        "momentum",
        "nu",
        "beta_1",
        "beta_2",
        "nu_1",
        "nu_2",
        "epsilon",
        "weight_decay",
    }


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam])
def test_weight_decay_none_means_none(cls: type) -> None:
    opt = cls(learning_rate=0.1, weight_decay=None)
    assert opt.weight_decay is None


def test_callables_schedules_and_numpy_scalars_pass() -> None:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    for opt in (
        qk.QHM(lambda: 0.05, momentum=np.float32(0.9), nu=np.float64(1.2)),
        qk.QHAdam(schedule, beta_1=np.float32(0.9), nu_1=-0.5, epsilon=0),
    ):
        v = keras.Variable(np.ones(3, "float32"))
        opt.apply([keras.ops.ones((3,))], [v])
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(v)))


# ------------------------------------------- concrete scalars are checked as floats
def _arrays():
    """One-element arrays and tensors of every framework at hand: (name, make)."""
    makers = [("numpy", lambda v: np.array(v, "float32"))]
    backend = keras.backend.backend()
    if backend == "jax":
        import jax.numpy as jnp

        makers.append(("jax", lambda v: jnp.array(v, "float32")))
    if backend == "tensorflow":
        import tensorflow as tf

        makers.append(("tf", lambda v: tf.constant(v)))
        makers.append(("tf-float64", lambda v: tf.constant(v, "float64")))
    if backend == "torch":
        import torch

        makers.append(("torch", lambda v: torch.tensor(v)))
    makers.append(("keras", lambda v: keras.ops.convert_to_tensor(v)))
    return makers


ARRAYS = _arrays()


@pytest.mark.parametrize(("kind", "array"), ARRAYS, ids=[k for k, _ in ARRAYS])
@pytest.mark.parametrize(
    ("cls", "name", "value", "requirement"),
    [
        (qk.QHM, "momentum", [1.5], "in [0, 1)"),
        (qk.QHAdam, "beta_1", -1.0, "in [0, 1)"),
        (qk.QHAdam, "epsilon", [-1.0], "in [0, inf)"),
        (qk.QHAdam, "nu_2", 2.0, "in [0, 1]"),
        (qk.QHAdamW, "weight_decay", [-0.5], "in [0, inf)"),
        (qk.QHM, "learning_rate", -0.5, "in [0, inf)"),
    ],
)
def test_concrete_tensors_are_range_checked(kind, array, cls, name, value, requirement) -> None:
    # beta_1=jnp.array(-1.) used to fail only at the step ("math domain error"),
    # momentum=[1.5] trained as gradient ascent.
    kwargs = {"learning_rate": 0.1, name: array(value)}
    shown = repr(float(np.ravel(value)[0]))
    message = f"{name} must be {requirement}; received {name}={shown}"
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        cls(**kwargs)


@pytest.mark.parametrize(("kind", "array"), ARRAYS, ids=[k for k, _ in ARRAYS])
def test_concrete_tensors_step_as_the_floats_they_hold(kind, array) -> None:
    # tf.constant(0.5) as beta_1 used to be accepted, then the first step failed
    # (Pow of float64 and float32).
    # Values float32 holds exactly: the arrays are float32 (0.7 would round).
    hparams = {"beta_1": 0.5, "beta_2": 0.75, "nu_1": 0.625, "nu_2": 0.5, "epsilon": 0.25}
    results = []
    for kwargs in (hparams, {k: array(v) for k, v in hparams.items()}):
        opt = qk.QHAdam(learning_rate=array(0.125) if kwargs is not hparams else 0.125, **kwargs)
        assert all(type(getattr(opt, k)) is float for k in hparams)
        v = keras.Variable(np.linspace(-1.0, 1.0, 3).astype("float32"))
        for _ in range(2):
            opt.apply([keras.ops.convert_to_tensor(np.array([0.5, -2.0, 1.0], "float32"))], [v])
        results.append(keras.ops.convert_to_numpy(v))
    np.testing.assert_array_equal(results[1], results[0])


# ------------------------------------------------------------------- QHMuon
QHMUON_CASES = [e for e in INVALID if e.applies_to("qhm")]


@pytest.mark.parametrize("entry", QHMUON_CASES, ids=[e.id for e in QHMUON_CASES])
def test_qhmuon_rejects_the_table(entry: Invalid) -> None:
    with pytest.raises(entry.error, match=pattern(entry, NAMES["keras"][entry.param])):
        qk.QHMuon(**backend_kwargs("keras", "qhm", entry))


SET_LATER = [
    (qk.QHM, "momentum", 1.0, r"momentum must be in \[0, 1\); received momentum=1.0"),
    (qk.QHM, "nu", float("nan"), r"nu must be a finite real number; received nu=nan"),
    (qk.QHM, "weight_decay", -1.0, r"weight_decay must be in \[0, inf\)"),
    (qk.QHAdam, "beta_1", 1.5, r"beta_1 must be in \[0, 1\); received beta_1=1.5"),
    (qk.QHAdam, "beta_2", -0.1, r"beta_2 must be in \[0, 1\)"),
    (qk.QHAdam, "nu_1", float("inf"), r"nu_1 must be a finite real number"),
    (qk.QHAdamW, "nu_2", 1.5, r"nu_2 must be in \[0, 1\]; received nu_2=1.5"),
    (qk.QHAdamW, "epsilon", -1e-8, r"epsilon must be in \[0, inf\)"),
    (qk.QHMuon, "momentum", 1.0, r"momentum must be in \[0, 1\)"),
    (qk.QHMuon, "muon_a", float("nan"), r"muon_a must be a finite real number"),
    (qk.QHMuon, "adam_beta_1", 2.0, r"adam_beta_1 must be in \[0, 1\)"),
    (qk.QHMuon, "rms_rate", -0.2, r"rms_rate must be in \[0, inf\)"),
    (qk.QHMuon, "ns_steps", -1, r"ns_steps must be in \[0, 100\); received ns_steps=-1"),
    (qk.QHMuon, "ns_steps", 1000, r"ns_steps must be in \[0, 100\)"),
]


@pytest.mark.parametrize(
    ("cls", "name", "value", "message"),
    SET_LATER,
    ids=[f"{c.__name__}-{n}" for c, n, _, _ in SET_LATER],
)
def test_a_hyperparameter_set_later_is_checked_as_the_constructor_checks_it(
    cls: type, name: str, value: float, message: str
) -> None:
    # Keras's own optimizers take opt.beta_1 = 1.5 and step by it. The value
    # before stays; a valid one is taken as given.
    opt = cls(learning_rate=0.01)
    assert_refused_when_set(opt, name, value, message)
    if name == "ns_steps":
        setattr(opt, name, np.int64(3))
        assert type(opt.ns_steps) is int and opt.ns_steps == 3
        return
    # None only where the constructor takes it (Keras's weight_decay, Muon's
    # rms_rate: test_none_set_later_is_taken_where_the_constructor_takes_it).
    if name not in ("weight_decay", "rms_rate"):
        assert_refused_when_set(opt, name, None, rf"{name} must be a real number", TypeError)
    # Kept as the constructor keeps it: a Python float, whatever array held it
    # (a one-element array would otherwise meet a 0-d slot at the step).
    for given in (np.float32(0.5), np.array([0.5]), keras.ops.convert_to_tensor([0.5])):
        setattr(opt, name, given)
        assert type(getattr(opt, name)) is float and getattr(opt, name) == 0.5


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam, qk.QHMuon])
@pytest.mark.parametrize(("name", "value"), [("state_dtype", None), ("stochastic_rounding", False)])
def test_the_state_s_dtype_and_rounding_are_fixed_when_the_optimizer_is_made(
    cls: type, name: str, value: object
) -> None:
    # The slots are made in them (the step rounds by them): changed later,
    # they would no longer describe the slots. The same value is taken.
    assert_fixed_after_construction(
        cls(learning_rate=0.01, state_dtype="bfloat16", stochastic_rounding=True), name, value
    )


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam, qk.QHMuon])
@pytest.mark.parametrize(
    ("name", "value"), [("state_dtype", "bfloat16"), ("stochastic_rounding", False)]
)
def test_the_state_s_dtype_and_rounding_made_none_are_fixed_too(
    cls: type, name: str, value: object
) -> None:
    # None is the class's default: on TensorFlow, Keras's tracking did not store
    # the constructor's None, and a later value passed as the first assignment.
    assert_fixed_after_construction(cls(learning_rate=0.01), name, value)


@pytest.mark.parametrize(
    ("cls", "name"),
    [(qk.QHM, "weight_decay"), (qk.QHAdamW, "weight_decay"), (qk.QHMuon, "rms_rate")],
)
def test_none_set_later_is_taken_where_the_constructor_takes_it(cls: type, name: str) -> None:
    opt = cls(learning_rate=0.01, **{name: 0.1})
    setattr(opt, name, None)
    assert getattr(opt, name) is None


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam, qk.QHAdamW, qk.QHMuon])
def test_a_learning_rate_set_later_is_checked_as_the_constructor_checks_it(cls: type) -> None:
    # Callbacks (LearningRateScheduler, ReduceLROnPlateau) set it; Keras's own
    # optimizers take a negative one and step uphill. The variable keeps its
    # value; a valid number, an int and a concrete array are taken as floats.
    opt = cls(learning_rate=0.01)
    with pytest.raises(
        ValueError, match=r"learning_rate must be in \[0, inf\); received learning_rate=-0.1"
    ):
        opt.learning_rate = -0.1
    np.testing.assert_allclose(float(opt.learning_rate), 0.01, rtol=1e-6)
    for value, want in ((0.5, 0.5), (1, 1.0), (np.array([0.25]), 0.25)):
        opt.learning_rate = value
        np.testing.assert_allclose(float(opt.learning_rate), want, rtol=1e-6)
    # A variable's value is copied into the optimizer's own: that value is checked.
    with pytest.raises(ValueError, match=r"received learning_rate=-1.0"):
        opt.learning_rate = keras.Variable(-1.0)
    np.testing.assert_allclose(float(opt.learning_rate), 0.25, rtol=1e-6)
    opt.learning_rate = keras.Variable(0.125)
    np.testing.assert_allclose(float(opt.learning_rate), 0.125, rtol=1e-6)
    callback = keras.callbacks.LearningRateScheduler(lambda epoch, lr: -lr)
    callback.set_model(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    callback.model.compile(optimizer=opt, loss="mse")
    with pytest.raises(ValueError, match=r"received learning_rate=-0.125"):
        callback.on_epoch_begin(0)


def _schedule() -> float:
    return 0.5


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda f: qk.QHM(0.1, weight_decay=f), "weight_decay"),
        (lambda f: qk.QHAdamW(0.1, weight_decay=f), "weight_decay"),
        (lambda f: qk.QHMuon(0.1, nu=f), "nu"),
        (lambda f: qk.QHMuon(0.1, momentum=f), "momentum"),
        (lambda f: qk.QHMuon(0.1, adam_beta_1=f), "adam_beta_1"),
    ],
)
def test_a_callable_is_refused_where_no_step_calls_it(make, name: str) -> None:
    # QHM's and QHAdam's discounts (and epsilon) are called at each step; these
    # were accepted and failed inside the first step.
    with pytest.raises(
        TypeError, match=rf"^{name} must be a real number; received {name}=<function"
    ):
        make(_schedule)
    opt = qk.QHM(0.1, momentum=_schedule)  # called at each step
    with pytest.raises(TypeError, match=r"^weight_decay must be a real number"):
        opt.weight_decay = _schedule
    opt.nu = _schedule
    assert opt.nu is _schedule


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda a: qk.QHM(0.1, momentum=a), "momentum"),
        (lambda a: qk.QHM(0.1, nu=a), "nu"),
        (lambda a: qk.QHAdam(0.1, beta_1=a), "beta_1"),
        (lambda a: qk.QHAdamW(0.1, nu_2=a), "nu_2"),
        (lambda a: qk.QHAdam(0.1, epsilon=a), "epsilon"),
        (lambda a: qk.QHM(0.1, weight_decay=a), "weight_decay"),
        (lambda a: qk.QHMuon(0.1, nu=a), "nu"),
        (lambda a: qk.QHMuon(0.1, adam_beta_2=a), "adam_beta_2"),
    ],
)
def test_a_hyperparameter_array_of_several_elements_is_refused(make, name: str) -> None:
    # Keras folds each hyperparameter into the step as one number: an array
    # stepped each coordinate by its own on JAX, failed at the step on torch
    # and TensorFlow, and made a config JSON cannot hold.
    with pytest.raises(
        ValueError, match=rf"^{name} must be one number; received an array of shape \(4,\)"
    ):
        make(np.array([0.1, 0.3, 0.5, 0.7]))
    with pytest.raises(
        ValueError, match=rf"^{name} must not be empty; received an array of shape \(0,\)"
    ):
        make(np.array([]))
    opt = make(np.array([0.5]))  # a one-element array is that number
    assert getattr(opt, name) == 0.5
    with pytest.raises(ValueError, match=rf"^{name} must be one number"):
        setattr(opt, name, np.array([0.5, 0.6]))
    assert getattr(opt, name) == 0.5


@pytest.mark.parametrize("value", ["no", np.bool_(True), 1])
def test_amsgrad_set_later_is_a_bool_as_the_constructor_takes_it(value: object) -> None:
    # A truthy string set later turned AMSGrad on (its slots were built).
    with pytest.raises(TypeError, match=r"amsgrad must be a bool"):
        qk.QHAdam(amsgrad=value)
    assert_refused_when_set(qk.QHAdam(), "amsgrad", value, r"amsgrad must be a bool", TypeError)
