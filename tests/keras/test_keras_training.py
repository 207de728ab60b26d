"""qhoptim.keras in use: the math through ``apply``, Keras's base features, ``model.fit``,
``.keras`` save -> load -> continue, sparse gradients, ``tf.keras`` and mixed precision."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
from keras import ops
from qh_keras_testing import (
    BACKEND,
    EXACT_DTYPE,
    EXACT_RTOL,
    X0,
    apply_steps,
    flat_weights,
    make_mlp,
    make_regression,
    only_backend,
    quadratic_grad,
    reference_steps,
)

import qhoptim.keras as qk
from qhoptim import convert, reference

# Optimizers and their float64 references (same hyperparameters; learning rates exact
# in float32, the dtype of Keras's learning-rate variable).
PAIRS = {
    "qhm": (
        lambda **kw: qk.QHM(0.25, momentum=0.9, nu=0.7, **kw),
        lambda **kw: reference.QHM(0.25, momentum=0.9, nu=0.7, **kw),
    ),
    "qhadam": (
        lambda **kw: qk.QHAdam(0.0625, beta_1=0.95, beta_2=0.98, nu_1=0.7, nu_2=0.9, **kw),
        lambda **kw: reference.QHAdam(0.0625, betas=(0.95, 0.98), nus=(0.7, 0.9), **kw),
    ),
    # beta_2 = 0.75: the second moment falls as the quadratic converges, so the
    # running maximum is read
    "qhadam-amsgrad": (
        lambda **kw: qk.QHAdam(0.0625, beta_1=0.95, beta_2=0.75, nu_1=0.7, amsgrad=True, **kw),
        lambda **kw: reference.QHAdam(
            0.0625, betas=(0.95, 0.75), nus=(0.7, 1.0), amsgrad=True, **kw
        ),
    ),
}
FIT_OPTIMIZERS = {
    "qhm": lambda: qk.QHM(1.0, momentum=0.9, nu=0.7),
    "qhadam": lambda: qk.QHAdam(1e-2, beta_1=0.95, nu_1=0.7),
    "qhadamw": lambda: qk.QHAdamW(1e-2, weight_decay=1e-3, nu_1=0.7),
}


def _max_rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _assert_close(got: list[np.ndarray], ref: list[np.ndarray], rtol: float = EXACT_RTOL) -> None:
    for a, b in zip(got, ref, strict=True):
        assert _max_rel(a, b) <= rtol, (a, b)


# --------------------------------------------------------------- the math via apply


@pytest.mark.parametrize("name", PAIRS)
def test_decoupled_weight_decay_and_exclusion(name: str) -> None:
    make, make_ref = PAIRS[name]
    opt = make(weight_decay=0.1)
    variables = [
        keras.Variable(X0[0], dtype=EXACT_DTYPE, name="kernel"),
        keras.Variable(X0[1], dtype=EXACT_DTYPE, name="bias"),
    ]
    opt.exclude_from_weight_decay(var_names=["bias"])
    for t in range(12):
        params = [np.asarray(ops.convert_to_numpy(v), np.float64) for v in variables]
        grads = [ops.convert_to_tensor(g, dtype=EXACT_DTYPE) for g in quadratic_grad(params, t)]
        opt.apply(grads, variables)
    decayed = reference_steps(
        make_ref(weight_decay=0.1, decoupled_weight_decay=True), X0[:1], quadratic_grad, 12
    )
    plain = reference_steps(make_ref(), X0[1:], quadratic_grad, 12)
    got = [np.asarray(ops.convert_to_numpy(v), np.float64) for v in variables]
    _assert_close(got, decayed + plain)


@pytest.mark.parametrize("nesterov", [False, True])
def test_qhm_recovers_keras_sgd(nesterov: bool) -> None:
    # Keras's SGD keeps an unnormalized velocity: QHM's lr is lr / (1 - momentum).
    # Values exact in float32: Keras casts its learning rate and momentum through it.
    lr, momentum = 2.0**-6, 0.875
    ours = qk.QHM.from_params(
        (convert.from_nesterov if nesterov else convert.from_momentum)(lr, momentum)
    )
    theirs = keras.optimizers.SGD(lr, momentum=momentum, nesterov=nesterov)
    a = apply_steps(ours, X0, quadratic_grad, 30)
    b = apply_steps(theirs, X0, quadratic_grad, 30)
    _assert_close(a, b)


def test_qhadam_with_unit_nus_and_tiny_epsilon_tracks_keras_adam() -> None:
    lr, b1, b2 = 2.0**-5, 0.875, 1 - 2.0**-7  # exact in float32, as Keras casts them
    ours = qk.QHAdam.from_params(convert.from_adam(lr, (b1, b2), 1e-12))
    theirs = keras.optimizers.Adam(lr, beta_1=b1, beta_2=b2, epsilon=1e-12)
    a = apply_steps(ours, X0, quadratic_grad, 30)
    b = apply_steps(theirs, X0, quadratic_grad, 30)
    _assert_close(a, b, rtol=1e-9 if EXACT_DTYPE == "float64" else 1e-4)


@pytest.mark.parametrize("weight_decay", [None, 0.125])
def test_qhadam_amsgrad_with_unit_nus_is_keras_adam_amsgrad(weight_decay: float | None) -> None:
    # Keras's Adam(amsgrad=True) keeps the maximum of the uncorrected velocity
    # (torch's convention, which qhoptim follows); at epsilon = 0 its epsilon
    # hat and QHAdam's epsilon agree. beta_2 = 0.75: the velocity falls while the
    # quadratic converges, so the maximum is read on most steps.
    lr, b1, b2 = 2.0**-5, 0.875, 0.75  # exact in float32, as Keras casts them
    kw = dict(beta_1=b1, beta_2=b2, epsilon=0.0, amsgrad=True, weight_decay=weight_decay)
    ours = qk.QHAdam(lr, nu_1=1.0, nu_2=1.0, **kw)
    theirs = (keras.optimizers.AdamW if weight_decay else keras.optimizers.Adam)(lr, **kw)
    a = apply_steps(ours, X0, quadratic_grad, 30)
    b = apply_steps(theirs, X0, quadratic_grad, 30)
    _assert_close(a, b, rtol=1e-12 if EXACT_DTYPE == "float64" else 1e-5)
    for ours_slot, their_slot in zip(ours._velocity_hats, theirs._velocity_hats, strict=True):
        np.testing.assert_allclose(
            ops.convert_to_numpy(ours_slot), ops.convert_to_numpy(their_slot), rtol=1e-6
        )
    hat, velocity = (
        ops.convert_to_numpy(ours._velocity_hats[0]),
        ops.convert_to_numpy(ours._velocities[0]),
    )
    assert np.all(hat >= velocity) and np.any(hat > velocity)


def test_qhadam_amsgrad_follows_the_reference() -> None:
    make, make_ref = PAIRS["qhadam-amsgrad"]
    for kw in ({}, {"weight_decay": 0.125}):
        got = apply_steps(make(**kw), X0, quadratic_grad, 25)
        ref_kw = {"weight_decay": 0.125, "decoupled_weight_decay": True} if kw else {}
        _assert_close(got, reference_steps(make_ref(**ref_kw), X0, quadratic_grad, 25))


def test_amsgrad_adds_a_velocity_hat_slot_as_keras_adam() -> None:
    variables = [keras.Variable(np.ones((2, 3))), keras.Variable(np.ones(3))]
    plain, ams, adam = qk.QHAdam(), qk.QHAdamW(amsgrad=True), keras.optimizers.Adam(amsgrad=True)
    for opt in (plain, ams, adam):
        opt.build(variables)
    assert not hasattr(plain, "_velocity_hats")
    names = sorted(v.name for v in ams.variables)
    assert names == sorted(v.name for v in adam.variables)
    assert sum("velocity_hat" in n for n in names) == 2
    assert ams.get_config()["amsgrad"] is True and plain.get_config()["amsgrad"] is False


def test_keras_adam_epsilon_is_epsilon_hat() -> None:
    # Keras's Adam adds epsilon to the *uncorrected* sqrt(v): after one step it
    # equals QHAdam with epsilon / sqrt(1 - beta_2) (the documented relation).
    lr, b1, b2, eps_hat = 2.0**-5, 0.875, 1 - 2.0**-7, 0.25
    theirs = keras.optimizers.Adam(lr, beta_1=b1, beta_2=b2, epsilon=eps_hat)
    ours = qk.QHAdam(lr, beta_1=b1, beta_2=b2, epsilon=eps_hat / np.sqrt(1 - b2))
    same_eps = qk.QHAdam(lr, beta_1=b1, beta_2=b2, epsilon=eps_hat)
    a = apply_steps(ours, X0, quadratic_grad, 1)
    b = apply_steps(theirs, X0, quadratic_grad, 1)
    c = apply_steps(same_eps, X0, quadratic_grad, 1)
    _assert_close(a, b)
    assert _max_rel(c[0], b[0]) > 1e-3


def test_gradient_accumulation_averages_and_counts_real_steps() -> None:
    make, make_ref = PAIRS["qhadam"]
    rng = np.random.default_rng(0)
    noise = [[rng.standard_normal(x.shape) for x in X0] for _ in range(8)]

    def grad(params: list[np.ndarray], t: int) -> list[np.ndarray]:
        return [g + n for g, n in zip(quadratic_grad(params, t), noise[t], strict=True)]

    got = apply_steps(make(gradient_accumulation_steps=2), X0, grad, 8)

    def averaged(params: list[np.ndarray], k: int) -> list[np.ndarray]:
        pairs = zip(grad(params, 2 * k), grad(params, 2 * k + 1), strict=True)
        return [(a + b) / 2 for a, b in pairs]

    _assert_close(got, reference_steps(make_ref(), X0, averaged, 4))


def test_clipnorm_clips_each_gradient() -> None:
    make, make_ref = PAIRS["qhm"]

    def clipped(params: list[np.ndarray], t: int) -> list[np.ndarray]:
        return [g * min(1.0, 0.5 / np.linalg.norm(g)) for g in quadratic_grad(params, t)]

    got = apply_steps(make(clipnorm=0.5), X0, quadratic_grad, 10)
    # Keras's own clipping rounds through float32 on the torch backend.
    _assert_close(got, reference_steps(make_ref(), X0, clipped, 10), rtol=max(EXACT_RTOL, 1e-7))


def test_loss_scale_factor_unscales_gradients() -> None:
    make, make_ref = PAIRS["qhadam"]

    def scaled(params: list[np.ndarray], t: int) -> list[np.ndarray]:
        return [1024.0 * g for g in quadratic_grad(params, t)]

    got = apply_steps(make(loss_scale_factor=1024.0), X0, scaled, 10)
    _assert_close(got, reference_steps(make_ref(), X0, quadratic_grad, 10))


def test_learning_rate_schedule_steps_with_the_iterations() -> None:
    make_ref = PAIRS["qhm"][1]
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([3, 6], [0.25, 0.125, 0.0625])
    got = apply_steps(qk.QHM(schedule, momentum=0.9, nu=0.7), X0, quadratic_grad, 9)
    lrs = [0.25] * 4 + [0.125] * 3 + [0.0625] * 2  # boundaries are inclusive in Keras
    _assert_close(got, reference_steps(make_ref(), X0, quadratic_grad, 9, lrs.__getitem__))


@only_backend("tensorflow")
def test_tf_jit_compile_switch_gives_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    make = PAIRS["qhadam"][0]
    xla_opt, plain_opt = make(weight_decay=0.01), make(weight_decay=0.01)
    compiled = apply_steps(xla_opt, X0, quadratic_grad, 10)
    # Set on the package, read by qhoptim.keras._tensorflow at every step.
    monkeypatch.setattr(qk, "TF_JIT_COMPILE", False)
    plain = apply_steps(plain_opt, X0, quadratic_grad, 10)
    assert xla_opt.__dict__.get("_xla_steps") and not plain_opt.__dict__.get("_xla_steps")
    _assert_close(compiled, plain)


def _mixed_variables() -> list[keras.Variable]:
    """float32 and float64 variables, one excluded from weight decay."""
    return [
        keras.Variable(X0[0], dtype="float64", name="kernel"),
        keras.Variable(X0[1], dtype="float64", name="bias"),
        keras.Variable(X0[0] + 0.25, dtype="float32", name="kernel32"),
    ]


def _apply_mixed(opt: keras.optimizers.Optimizer, steps: int) -> list[np.ndarray]:
    variables = _mixed_variables()
    opt.exclude_from_weight_decay(var_names=["bias"])
    for t in range(steps):
        params = [np.asarray(ops.convert_to_numpy(v), np.float64) for v in variables]
        grads = quadratic_grad(params, t)
        opt.apply(
            [ops.convert_to_tensor(g, v.dtype) for g, v in zip(grads, variables, strict=True)],
            variables,
        )
    return [np.asarray(ops.convert_to_numpy(v), np.float64) for v in variables]


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch, *, fused: bool = False) -> list[int]:
    """Patch the torch kernel layer's whole-list kernels (or the fused ones) to record
    how many tensors each took."""
    from qhoptim.torch import _fused, _kernels

    module, kernels = (
        (_fused, ("fused_qhm", "fused_qhadam_host_steps"))
        if fused
        else (_kernels, ("foreach_qhm", "foreach_qhadam"))
    )
    monkeypatch.setattr(qk, "TORCH_FUSED", fused)
    calls: list[int] = []
    for kernel in kernels:
        original = getattr(module, kernel)
        monkeypatch.setattr(
            module, kernel, lambda *a, _f=original, **kw: calls.append(len(a[0])) or _f(*a, **kw)
        )
    return calls


@only_backend("torch")
@pytest.mark.parametrize("fused", [False, True], ids=["multi-tensor", "fused"])
@pytest.mark.parametrize("name", ["qhm", "qhadam", "qhadamw", "qhadam-amsgrad"])
def test_torch_multi_tensor_step_equals_per_variable_step(
    name: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the torch backend all variables step at once through qhoptim.torch's
    # kernel layer (the fused CPU kernel by default, TORCH_FUSED); Keras's
    # generic path (one ``update_step`` per variable, the code the other
    # backends run) must give the same numbers.
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    make = {
        "qhm": PAIRS["qhm"][0],
        "qhadam": PAIRS["qhadam"][0],
        "qhadamw": qk.QHAdamW,
        "qhadam-amsgrad": PAIRS["qhadam-amsgrad"][0],
    }[name]
    calls = _count_kernel_calls(monkeypatch, fused=fused)
    fast = _apply_mixed(make(weight_decay=0.1), 12)
    # Per step: one call for the decayed kernels (float64 and float32: the
    # kernels group by dtype themselves) and one for the excluded bias.
    assert calls == [2, 1] * 12, calls
    calls.clear()
    from qhoptim.keras._base import QHOptimizer

    monkeypatch.setattr(QHOptimizer, "_backend_update_step", BaseOptimizer._backend_update_step)
    generic = _apply_mixed(make(weight_decay=0.1), 12)
    assert not calls
    for a, b, rtol in zip(fast, generic, (1e-13, 1e-13, 1e-6), strict=True):
        assert _max_rel(a, b) <= rtol, (a, b)


@only_backend("torch")
def test_torch_tensor_hyperparameters_take_the_generic_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    got = apply_steps(PAIRS["qhm"][0](), X0, quadratic_grad, 6)
    calls = _count_kernel_calls(monkeypatch, fused=True)
    opt = PAIRS["qhm"][0]()
    opt.momentum = keras.Variable(
        0.9, dtype="float64"
    )  # no Python float (it may change): per-variable path
    _assert_close(apply_steps(opt, X0, quadratic_grad, 6), got)
    assert not calls
    # A concrete tensor is read as its float, as the constructor reads it: the kernels.
    opt = PAIRS["qhm"][0]()
    opt.momentum = torch.tensor(0.9, dtype=torch.float64)
    assert type(opt.momentum) is float
    _assert_close(apply_steps(opt, X0, quadratic_grad, 6), got)
    assert calls


@pytest.mark.parametrize(
    ("name", "attribute"),
    [("qhm", "momentum"), ("qhm", "nu"), ("qhadam", "beta_1"), ("qhadam", "beta_2")],
)
def test_a_variable_hyperparameter_steps_as_its_value(name: str, attribute: str) -> None:
    # As Keras's own optimizers take one (Adam(beta_1=keras.Variable(0.9))):
    # read at each step, in the variable's dtype, on every path (TensorFlow's
    # XLA step and JAX's jitted fit took it as a constant and failed).
    make, make_ref = PAIRS[name]

    def with_variable() -> keras.optimizers.Optimizer:
        opt = make()
        value = keras.Variable(getattr(opt, attribute), dtype=EXACT_DTYPE, trainable=False)
        setattr(opt, attribute, value)
        return opt

    want = reference_steps(make_ref(), X0, quadratic_grad, 6)
    _assert_close(apply_steps(with_variable(), X0, quadratic_grad, 6), want)
    x, y = make_regression(64)
    fitted = []
    for opt in (make(), with_variable()):
        model = make_mlp()
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        fitted.append(flat_weights(model))
    np.testing.assert_allclose(fitted[1], fitted[0], rtol=1e-5, atol=1e-6)


@only_backend("jax")
def test_jax_stateless_apply_under_jit_matches_apply() -> None:
    import jax

    make = PAIRS["qhadam"][0]
    eager = apply_steps(make(), X0, quadratic_grad, 5)
    opt = make()
    variables = [keras.Variable(x, dtype="float32") for x in X0]
    opt.build(variables)
    params, opt_vars = [v.value for v in variables], [v.value for v in opt.variables]
    step = jax.jit(opt.stateless_apply)
    for t in range(5):
        grads = quadratic_grad([np.asarray(p, np.float64) for p in params], t)
        params, opt_vars = step(opt_vars, [g.astype("float32") for g in grads], params)
    _assert_close([np.asarray(p, np.float64) for p in params], eager, rtol=1e-6)


# ------------------------------------------------------------------------ model.fit


def _fit(model: keras.Model, optimizer, epochs: int, **fit_kwargs) -> list[float]:
    x, y = make_regression()
    if not model.compiled:
        model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, epochs=epochs, batch_size=32, shuffle=False, verbose=0, **fit_kwargs)
    return history.history["loss"]


@pytest.mark.parametrize("name", FIT_OPTIMIZERS)
def test_model_fit_trains(name: str) -> None:
    losses = _fit(make_mlp(), FIT_OPTIMIZERS[name](), epochs=8)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses


def test_model_fit_qhadam_tracks_keras_adam() -> None:
    # nu_1 = nu_2 = 1 is Adam; with epsilon -> 0 the epsilon placements agree.
    ours = flat_weights_after(qk.QHAdam(1e-2, epsilon=1e-12))
    theirs = flat_weights_after(keras.optimizers.Adam(1e-2, epsilon=1e-12))
    assert _max_rel(ours, theirs) < 1e-4


def flat_weights_after(optimizer, epochs: int = 5) -> np.ndarray:
    model = make_mlp()
    _fit(model, optimizer, epochs)
    return flat_weights(model)


def test_model_fit_with_ema_and_accumulation() -> None:
    opt = qk.QHAdam(1e-2, nu_1=0.7, use_ema=True, gradient_accumulation_steps=2)
    model = make_mlp()
    losses = _fit(model, opt, epochs=6)
    assert losses[-1] < 0.7 * losses[0], losses
    assert int(ops.convert_to_numpy(opt.iterations)) == 6 * 8 // 2


SAVE_CASES = {
    "qhm": lambda: qk.QHM(0.5, momentum=0.9, nu=0.7, weight_decay=1e-3),
    "qhadam": lambda: qk.QHAdam(1e-2, nu_1=0.7, nu_2=0.9, clipnorm=1.0),
    "qhadam-amsgrad": lambda: qk.QHAdam(1e-2, beta_2=0.9, nu_1=0.7, amsgrad=True),
    "qhadamw-schedule": lambda: qk.QHAdamW(
        keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=5, decay_rate=0.5),
        weight_decay=1e-2,
        nu_1=0.7,
    ),
}


@pytest.mark.parametrize("name", SAVE_CASES)
def test_keras_file_round_trip_continues_training_identically(name: str, tmp_path: Path) -> None:
    model = make_mlp()
    _fit(model, SAVE_CASES[name](), epochs=2)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)  # no custom_objects: the classes are registered

    assert type(loaded.optimizer) is type(model.optimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    state = [ops.convert_to_numpy(v) for v in model.optimizer.variables]
    restored = [ops.convert_to_numpy(v) for v in loaded.optimizer.variables]
    slots = 1 + ("qhadam" in name) + ("amsgrad" in name)  # per model variable (4 of them)
    assert len(state) == len(restored) == 2 + slots * 4 - ("schedule" in name)
    for a, b in zip(state, restored, strict=True):
        np.testing.assert_array_equal(a, b)

    _fit(model, None, epochs=2)  # uninterrupted
    _fit(loaded, None, epochs=2)  # saved, loaded, continued
    np.testing.assert_allclose(flat_weights(loaded), flat_weights(model), rtol=1e-6, atol=1e-7)


def test_embedding_model_trains() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=(256, 5)).astype("int32")
    y = (ids % 7 == 0).mean(axis=1, keepdims=True).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=qk.QHAdam(5e-2, nu_1=0.7), loss="mse")
    losses = model.fit(ids, y, epochs=10, batch_size=32, verbose=0).history["loss"]
    assert losses[-1] < 0.5 * losses[0], losses


# ------------------------------------------------------------------- TensorFlow only


@only_backend("tensorflow")
@pytest.mark.parametrize("name", FIT_OPTIMIZERS)
@pytest.mark.parametrize("graph", [False, True])
def test_sparse_gradients_equal_their_dense_form(name: str, graph: bool) -> None:
    import tensorflow as tf

    rng = np.random.default_rng(0)
    table0 = rng.standard_normal((20, 4))
    sparse_table = keras.Variable(table0, dtype="float64")
    dense_table = keras.Variable(table0, dtype="float64")
    sparse_opt, dense_opt = FIT_OPTIMIZERS[name](), FIT_OPTIMIZERS[name]()
    sparse_opt.build([sparse_table])
    dense_opt.build([dense_table])
    sparse_apply, dense_apply = sparse_opt.apply, dense_opt.apply  # built: apply(grads)
    if graph:  # as in model.fit
        sparse_apply, dense_apply = tf.function(sparse_apply), tf.function(dense_apply)
    for _ in range(6):
        ids = tf.constant(rng.integers(0, 20, size=7))  # repeated ids included
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(sparse_table.value, ids) ** 2)
        (grad,) = tape.gradient(loss, [sparse_table.value])
        assert isinstance(grad, tf.IndexedSlices)
        sparse_apply([grad])
        dense_apply([tf.convert_to_tensor(grad)])
    np.testing.assert_array_equal(sparse_table.numpy(), dense_table.numpy())
    assert not np.array_equal(sparse_table.numpy(), table0)


@only_backend("tensorflow")
def test_tf_keras_model_compile_and_fit() -> None:
    import tensorflow as tf

    assert isinstance(qk.QHAdam(), tf.keras.optimizers.Optimizer)
    x, y = make_regression()
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential(
        [
            tf.keras.Input((8,)),
            tf.keras.layers.Dense(16, activation="tanh"),
            tf.keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=qk.QHAdam(1e-2, nu_1=0.7), loss="mse")
    losses = model.fit(x, y, epochs=6, batch_size=32, verbose=0).history["loss"]
    assert losses[-1] < 0.5 * losses[0], losses


# ------------------------------------------------------------------ mixed precision


def test_mixed_precision_fit_save_load(tmp_path: Path) -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_mlp()
        model.compile(optimizer=qk.QHAdam(1e-2, nu_1=0.7), loss="mse")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        x, y = make_regression()
        losses = model.fit(x, y, epochs=6, batch_size=32, verbose=0).history["loss"]
        assert np.all(np.isfinite(losses)) and losses[-1] < 0.6 * losses[0], losses
        inner = model.optimizer.inner_optimizer
        assert isinstance(inner, qk.QHAdam)
        assert {str(v.dtype) for v in inner.variables if len(v.shape)} == {"float32"}
        model.save(tmp_path / "mixed.keras")
        loaded = keras.models.load_model(tmp_path / "mixed.keras")
        assert isinstance(loaded.optimizer.inner_optimizer, qk.QHAdam)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_backend_label() -> None:
    from conformance.adapters.keras import KerasAdapter

    assert KerasAdapter.name == f"keras-{BACKEND}"
