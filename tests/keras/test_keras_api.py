"""qhoptim.keras: Keras optimizer API, configuration, serialization, errors, Keras 2."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import warnings
from typing import Any

import keras
import numpy as np
import pytest
from qh_keras_testing import EXACT_RTOL, X0, apply_steps, quadratic_grad, reference_steps

import qhoptim.keras as qk
from qhoptim import convert, reference

CLASSES = (qk.QHM, qk.QHAdam, qk.QHAdamW)
OWN_KEYS = {
    qk.QHM: {"momentum": 0.9, "nu": 0.8},
    qk.QHAdam: {"beta_1": 0.95, "beta_2": 0.98, "nu_1": 0.7, "nu_2": 0.9, "epsilon": 1e-6},
    qk.QHAdamW: {"beta_1": 0.95, "beta_2": 0.98, "nu_1": 0.7, "nu_2": 0.9, "epsilon": 1e-6},
}
BASE_KWARGS = {
    "weight_decay": 0.02,
    "clipnorm": 1.5,
    "use_ema": True,
    "ema_momentum": 0.9,
    "ema_overwrite_frequency": 5,
    "loss_scale_factor": 128.0,
    "gradient_accumulation_steps": 2,
    "name": "my_optimizer",
}


# ------------------------------------------------------------------- the classes


@pytest.mark.parametrize("cls", CLASSES)
def test_is_a_registered_keras_optimizer(cls: type) -> None:
    assert issubclass(cls, keras.optimizers.Optimizer)
    name = f"qhoptim>{cls.__name__}"
    assert keras.saving.get_registered_name(cls) == name
    assert keras.saving.get_registered_object(name) is cls


def test_qhmuon_documents_keras_base_keywords() -> None:
    # Its own arguments are Keras Muon's (**kwargs); the base keywords are listed.
    doc = qk.QHMuon.__doc__ or ""
    assert "{{" not in doc
    for arg in ["learning_rate", *BASE_KWARGS, "clipvalue", "global_clipnorm"]:
        assert f"{arg}:" in doc, arg
    assert keras.saving.get_registered_object("qhoptim>QHMuon") is qk.QHMuon


@pytest.mark.parametrize("cls", CLASSES)
def test_docstring_documents_every_argument(cls: type) -> None:
    doc = cls.__doc__
    assert "{{" not in doc
    for arg in ["learning_rate", *OWN_KEYS[cls], *BASE_KWARGS, "clipvalue", "global_clipnorm"]:
        assert f"{arg}:" in doc, arg


def test_defaults() -> None:
    with pytest.raises(TypeError):
        qk.QHM()  # the normalized buffer changes the lr scale: no default
    c = qk.QHM(0.5).get_config()
    assert (c["learning_rate"], c["momentum"], c["nu"]) == (0.5, 0.999, 0.7)
    assert c["weight_decay"] is None
    c = qk.QHAdam().get_config()
    expected = (0.001, 0.9, 0.999, 1.0, 1.0, 1e-8, None)
    keys = ("learning_rate", "beta_1", "beta_2", "nu_1", "nu_2", "epsilon", "weight_decay")
    assert tuple(c[k] for k in keys) == pytest.approx(expected)
    assert qk.QHAdamW().get_config()["weight_decay"] == 0.004  # Keras's AdamW default


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize("cls", CLASSES)
def test_get_config_from_config_round_trip(cls: type) -> None:
    opt = cls(learning_rate=0.05, **OWN_KEYS[cls], **BASE_KWARGS)
    config = opt.get_config()
    json.dumps(config)  # JSON-serializable, as .keras files need
    for key, value in {**OWN_KEYS[cls], **BASE_KWARGS}.items():
        assert config[key] == pytest.approx(value), key
    assert config["learning_rate"] == pytest.approx(0.05)
    clone = cls.from_config(config)
    assert type(clone) is cls
    assert clone.get_config() == config


@pytest.mark.parametrize("cls", CLASSES)
def test_serialize_deserialize_without_custom_objects(cls: type) -> None:
    opt = cls(learning_rate=0.05, **OWN_KEYS[cls])
    blob = json.loads(json.dumps(keras.optimizers.serialize(opt)))
    clone = keras.optimizers.deserialize(blob)
    assert type(clone) is cls
    assert clone.get_config() == opt.get_config()


@pytest.mark.parametrize("cls", CLASSES)
def test_learning_rate_schedule_round_trip(cls: type) -> None:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    opt = cls(learning_rate=schedule)
    blob = json.loads(json.dumps(keras.optimizers.serialize(opt)))
    clone = keras.optimizers.deserialize(blob)
    restored = clone._learning_rate
    assert isinstance(restored, keras.optimizers.schedules.ExponentialDecay)
    assert restored.get_config() == schedule.get_config()


def test_int_and_numpy_hyperparameters_become_floats() -> None:
    opt = qk.QHM(1, momentum=np.float32(0.5), nu=np.float64(0.25))
    config = opt.get_config()
    json.dumps(config)
    assert config["learning_rate"] == 1.0
    assert (config["momentum"], config["nu"]) == (0.5, 0.25)
    assert all(type(config[k]) is float for k in ("momentum", "nu"))


# ------------------------------------------------------------------- conversions


def test_from_params_qhm_is_one_line() -> None:
    opt = qk.QHM.from_params(convert.from_nesterov(lr=0.1, momentum=0.9), weight_decay=0.01)
    c = opt.get_config()
    assert c["learning_rate"] == pytest.approx(1.0)
    assert (c["momentum"], c["nu"], c["weight_decay"]) == (0.9, 0.9, 0.01)


@pytest.mark.parametrize("cls", [qk.QHAdam, qk.QHAdamW])
def test_from_params_qhadam(cls: type) -> None:
    opt = cls.from_params(convert.from_nadam(2e-3, (0.9, 0.99), 1e-7), clipnorm=1.0)
    c = opt.get_config()
    assert c["learning_rate"] == pytest.approx(2e-3)
    assert (c["beta_1"], c["beta_2"], c["nu_1"], c["nu_2"]) == (0.9, 0.99, 0.9, 1.0)
    assert (c["epsilon"], c["clipnorm"]) == (1e-7, 1.0)


def test_from_params_rejects_the_other_family() -> None:
    with pytest.raises(TypeError, match=r"QHM\.from_params expects qhoptim\.convert\.QHMParams"):
        qk.QHM.from_params(convert.from_adam(1e-3, (0.9, 0.999), 1e-8))
    with pytest.raises(TypeError, match=r"QHAdam\.from_params expects"):
        qk.QHAdam.from_params(convert.from_sgd(0.1))


# ------------------------------------------------------------------------ errors

BAD = [
    (
        qk.QHM,
        {"learning_rate": -0.1},
        "learning_rate must be in [0, inf); received learning_rate=-0.1",
    ),
    (
        qk.QHM,
        {"learning_rate": 0.1, "momentum": 1.0},
        "momentum must be in [0, 1); received momentum=1.0",
    ),
    (
        qk.QHM,
        {"learning_rate": 0.1, "momentum": -0.5},
        "momentum must be in [0, 1); received momentum=-0.5",
    ),
    (
        qk.QHM,
        {"learning_rate": 0.1, "nu": math.nan},
        "nu must be a finite real number; received nu=nan",
    ),
    (
        qk.QHM,
        {"learning_rate": 0.1, "weight_decay": -1.0},
        "weight_decay must be in [0, inf); received weight_decay=-1.0",
    ),
    (qk.QHAdam, {"beta_1": 1.2}, "beta_1 must be in [0, 1); received beta_1=1.2"),
    (qk.QHAdam, {"beta_2": 1.0}, "beta_2 must be in [0, 1); received beta_2=1.0"),
    (qk.QHAdam, {"nu_1": math.inf}, "nu_1 must be a finite real number; received nu_1=inf"),
    (qk.QHAdam, {"nu_2": 1.5}, "nu_2 must be in [0, 1]; received nu_2=1.5"),
    (qk.QHAdam, {"epsilon": -1e-8}, "epsilon must be in [0, inf); received epsilon=-1e-08"),
    (
        qk.QHAdam,
        {"learning_rate": math.nan},
        "learning_rate must be in [0, inf); received learning_rate=nan",
    ),
    (
        qk.QHAdamW,
        {"weight_decay": -0.01},
        "weight_decay must be in [0, inf); received weight_decay=-0.01",
    ),
    (qk.QHAdamW, {"beta_1": -0.1}, "beta_1 must be in [0, 1); received beta_1=-0.1"),
]


@pytest.mark.parametrize(("cls", "kwargs", "message"), BAD)
def test_bad_hyperparameters_raise_the_core_errors(cls: type, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    assert str(info.value) == message


def test_messages_are_the_validation_modules() -> None:
    from qhoptim import validation

    with pytest.raises(ValueError) as core:
        validation.check_beta(1.2, "beta_1")
    with pytest.raises(ValueError) as ours:
        qk.QHAdam(beta_1=1.2)
    assert str(core.value) == str(ours.value)


def test_qhadamw_needs_a_weight_decay() -> None:
    # The shared sentence of torch's and optax's QHAdamW (the core's check), not
    # Keras's own message.
    from qhoptim import validation

    with pytest.raises(TypeError) as core:
        validation.check_weight_decay(None, "weight_decay")
    with pytest.raises(TypeError) as ours:
        qk.QHAdamW(weight_decay=None)
    assert str(ours.value) == str(core.value)
    assert str(ours.value) == "weight_decay must be a real number; received weight_decay=None"


def test_bool_hyperparameter_is_a_type_error() -> None:
    with pytest.raises(
        TypeError, match=r"^momentum must be a real number; received momentum=True$"
    ):
        qk.QHM(0.1, momentum=True)


def test_schedules_and_callables_pass_validation() -> None:
    schedule = keras.optimizers.schedules.CosineDecay(0.1, decay_steps=100)
    assert qk.QHM(schedule)._learning_rate is schedule
    assert callable(qk.QHAdam(lambda: 0.01)._learning_rate)


def test_base_class_errors_are_keras_own() -> None:
    with pytest.raises(ValueError, match="Only one of `clipnorm`, `clipvalue`"):
        qk.QHAdam(clipnorm=1.0, clipvalue=1.0)
    with pytest.raises(ValueError, match="not recognized"):
        qk.QHM(0.1, betas=(0.9, 0.99))


# ------------------------------------------------------------------------ Keras 2


@pytest.mark.parametrize("version", ["2.15.0", "3.0.0", "3.9.2"])
def test_keras_before_3_10_is_refused_on_import(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    # Execute the module's source as a fresh module, with keras looking older.
    monkeypatch.setattr(keras, "__version__", version)
    spec = importlib.util.spec_from_file_location("_qhoptim_keras_probe", qk.__file__)
    module = importlib.util.module_from_spec(spec)
    match = rf"requires Keras >= 3\.10 \(found keras {re.escape(version)}\)"
    with pytest.raises(ImportError, match=match):
        spec.loader.exec_module(module)


def test_keras_3_10_and_later_are_accepted() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for version in ("3.10.0", "3.15.1", "4.0.0"):
            qk._check_keras_version(version, {})


def test_legacy_tf_keras_switch_warns() -> None:
    with pytest.warns(UserWarning, match="TF_USE_LEGACY_KERAS is set"):
        qk._check_keras_version("3.15.1", {"TF_USE_LEGACY_KERAS": "1"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qk._check_keras_version("3.15.1", {"TF_USE_LEGACY_KERAS": "0"})
        qk._check_keras_version("3.15.1", {})


# ------------------------------------------------------- math through the Keras API


def test_callable_learning_rate_is_called_every_step() -> None:
    lrs = [0.1, 0.05, 0.2, 0.01, 0.3]
    opt = qk.QHM(lambda: lrs[int(keras.ops.convert_to_numpy(opt.iterations))], 0.9, 0.7)
    got = apply_steps(opt, X0, quadratic_grad, len(lrs))
    ref_opt = reference.QHM(0.1, 0.9, 0.7)
    ref = reference_steps(ref_opt, X0, quadratic_grad, len(lrs), lrs.__getitem__)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=EXACT_RTOL)


# ------------------------------------------------------------------- amsgrad
@pytest.mark.parametrize("cls", [qk.QHAdam, qk.QHAdamW])
def test_amsgrad_is_documented_configured_and_checked(cls: type) -> None:
    assert "amsgrad:" in cls.__doc__
    assert cls().get_config()["amsgrad"] is False
    opt = cls(learning_rate=0.05, amsgrad=True, **OWN_KEYS[cls])
    config = opt.get_config()
    assert config["amsgrad"] is True
    clone = keras.optimizers.deserialize(json.loads(json.dumps(keras.optimizers.serialize(opt))))
    assert type(clone) is cls and clone.amsgrad is True
    assert clone.get_config() == config
    old = dict(config)
    del old["amsgrad"]  # a configuration saved before amsgrad existed
    assert cls.from_config(old).amsgrad is False
    for value in (1, "yes", None):
        with pytest.raises(TypeError) as info:
            cls(amsgrad=value)
        assert str(info.value) == f"amsgrad must be a bool; received amsgrad={value!r}"


# ------------------------------------------------------------------ by name
@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("qhm", qk.QHM),
        ("QHM", qk.QHM),
        ("qhadam", qk.QHAdam),
        ("QHAdam", qk.QHAdam),
        ("qhadamw", qk.QHAdamW),
        ("QHAdamW", qk.QHAdamW),
    ],
)
def test_optimizers_get_takes_qh_names_with_the_package_defaults(name, cls) -> None:
    opt = keras.optimizers.get(name)
    assert type(opt) is cls
    # The package defaults, as the class built with no arguments has them
    # (QHM has no default learning rate; by name it takes Keras SGD's 0.01).
    default = cls(0.01) if cls is qk.QHM else cls()
    assert opt.get_config() == {**default.get_config(), "name": opt.get_config()["name"]}
    assert opt.learning_rate.numpy() == default.learning_rate.numpy()


def test_compile_with_a_qh_name_trains_with_qh_steps_and_reloads(tmp_path) -> None:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
    model.compile(optimizer="qhadam", loss="mse")
    assert type(model.optimizer) is qk.QHAdam
    x = np.random.default_rng(0).standard_normal((8, 3)).astype("float32")
    y = np.zeros((8, 1), "float32")
    kernel0 = np.asarray(model.layers[0].kernel.numpy(), np.float64)
    model.train_on_batch(x, y)
    # The first step is QHAdam's with its defaults (Adam's first step, as
    # nu = (1, 1)), from the reference fed the same gradient.
    grad = 2 * x.astype(np.float64).T @ (x.astype(np.float64) @ kernel0) / len(x)
    ref = reference.QHAdam(lr=1e-3, eps=1e-7)
    want, _ = ref.step(kernel0, grad, ref.init(kernel0))
    np.testing.assert_allclose(model.layers[0].kernel.numpy(), want, rtol=1e-5)
    path = tmp_path / "model.keras"
    model.save(path)
    config = json.loads(__import__("zipfile").ZipFile(path).read("config.json"))
    assert config["compile_config"]["optimizer"]["registered_name"] == "qhoptim>QHAdam"
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is qk.QHAdam
    assert int(loaded.optimizer.iterations.numpy()) == 1


def test_a_name_registered_before_import_is_kept() -> None:
    class Mine:
        pass

    objects = {"qhadam": Mine}
    qk._register_names(objects)
    assert objects["qhadam"] is Mine
    assert objects["qhm"] is qk.QHM and objects["QHAdamW"] is qk.QHAdamW


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam, qk.QHAdamW])
def test_a_subclass_s_own_update_step_is_what_steps(cls: type) -> None:
    # Keras's extension point: on the torch backend the library's kernels
    # step every variable at once, but only for the library's update_step.
    class SkipsFrozen(cls):  # type: ignore[misc, valid-type]
        calls = 0

        def update_step(self, gradient: object, variable: object, learning_rate: object) -> None:
            type(self).calls += 1
            if "frozen" not in variable.name:  # type: ignore[attr-defined]
                super().update_step(gradient, variable, learning_rate)

    kwargs = {"weight_decay": 0.01} if cls is qk.QHAdamW else {}
    opt = SkipsFrozen(0.1, **kwargs)
    free = keras.Variable(np.ones(3, "float32"), name="free")
    frozen = keras.Variable(np.ones(3, "float32"), name="frozen")
    twin = keras.Variable(np.ones(3, "float32"), name="twin")
    plain = cls(0.1, **kwargs)
    for _ in range(2):
        opt.apply([keras.ops.ones(3), keras.ops.ones(3)], [free, frozen])
        plain.apply([keras.ops.ones(3)], [twin])
    assert SkipsFrozen.calls == 4
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(frozen), np.ones(3, "float32"))
    # The per-variable operations and torch's kernels: the same to float32 rounding.
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(free), keras.ops.convert_to_numpy(twin), rtol=4e-7
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda f: qk.QHAdam(0.1, beta_1=f(0.9), beta_2=f(0.99), nu_1=f(0.7), epsilon=f(1e-7)),
        lambda f: qk.QHM(0.1, momentum=f(0.9), nu=f(0.7)),
    ],
    ids=["qhadam", "qhm"],
)
def test_zero_argument_callable_hyperparameters_step_as_their_values(make: Any) -> None:
    # Keras's own optimizers document beta_1=lambda: 0.9, called at each step;
    # here it was accepted and failed at the step.
    results = []
    for given in (lambda x: x, lambda x: lambda: x):
        opt = make(given)
        variable = keras.Variable(np.linspace(-1.0, 1.0, 6).astype("float32"))
        for t in range(3):
            opt.apply([keras.ops.ones(6) * (t + 1)], [variable])
        results.append(keras.ops.convert_to_numpy(variable))
    np.testing.assert_array_equal(results[1], results[0])


_MISSING_BACKEND = next(
    (b for b in ("tensorflow", "jax", "torch") if importlib.util.find_spec(b) is None), None
)


@pytest.mark.skipif(_MISSING_BACKEND is None, reason="every Keras backend's framework is here")
def test_a_keras_backend_whose_framework_is_missing_is_named_in_the_import_error() -> None:
    # Keras takes TensorFlow unless told otherwise: beside JAX alone, the error
    # said Keras was not installed, and installing it changed nothing.
    import os
    import subprocess
    import sys

    env = dict(os.environ, KERAS_BACKEND=str(_MISSING_BACKEND))
    done = subprocess.run(
        [sys.executable, "-c", "import qhoptim.keras"], capture_output=True, text=True, env=env
    )
    assert done.returncode != 0
    assert "Keras is installed, but its backend needs" in done.stderr, done.stderr[-2000:]
    assert "set KERAS_BACKEND" in done.stderr
