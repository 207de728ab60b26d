"""Non-finite gradients, loss scaling, eps = 0, long runs, low precision and state loading."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from keras import ops
from qh_keras_testing import BACKEND, EXACT_DTYPE, EXACT_RTOL

import qhoptim.keras as qk
from conformance.runner import max_relative_deviation
from qhoptim import reference

NAN, INF = math.nan, math.inf
X0 = np.array([1.0, -1.0, 0.5, 2.0, -0.5])
POISONED = np.array(
    [[0.5, NAN, INF, -INF, NAN], [0.25, 1.0, 1.0, 1.0, 1.0], [-0.5, 1.0, 1.0, 1.0, 1.0]]
)


def _np(x) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(x), np.float64)


def _run(opt, grads, x0=X0, dtype=EXACT_DTYPE):
    v = keras.Variable(np.asarray(x0), dtype=dtype)
    for g in grads:
        opt.apply([ops.convert_to_tensor(np.asarray(g), dtype=dtype)], [v])
    return _np(v), opt


def _reference(ref, grads, x0=X0):
    x, state = np.asarray(x0, np.float64), ref.init(np.asarray(x0, np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        for g in grads:
            x, state = ref.step(x, np.asarray(g, np.float64), state)
    return x


def _assert_same_nonfinite(got, want, rtol=EXACT_RTOL) -> None:
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol)


@pytest.mark.parametrize("steps", [1, 3])
def test_non_finite_gradients_propagate_as_in_keras_adam_and_sgd(steps: int) -> None:
    grads = POISONED[:steps]
    # Learning rates a float32 holds exactly: Keras keeps its learning rate in float32.
    adam, _ = _run(keras.optimizers.Adam(0.125), grads)
    for nus in [(1.0, 1.0), (0.7, 0.8)]:
        qh, opt = _run(qk.QHAdam(0.125, nu_1=nus[0], nu_2=nus[1]), grads)
        np.testing.assert_array_equal(np.isfinite(qh), np.isfinite(adam))
        _assert_same_nonfinite(qh, _reference(reference.QHAdam(lr=0.125, nus=nus), grads))
        for slot in (opt._momentums[0], opt._velocities[0]):
            assert not np.all(np.isfinite(_np(slot)))
    sgd, _ = _run(keras.optimizers.SGD(0.0625, momentum=0.5), grads)
    qhm, _ = _run(qk.QHM(0.125, momentum=0.5, nu=1.0), grads)
    _assert_same_nonfinite(qhm, sgd)


def _loss_scaled_steps(inner, grads):
    """Steps of ``LossScaleOptimizer(inner)``; JAX runs it as ``fit`` does (stateless, jitted)."""
    lso = keras.optimizers.LossScaleOptimizer(inner)
    v = keras.Variable(np.asarray(X0), dtype="float32")
    lso.build([v])
    out = []
    if BACKEND == "jax":
        import jax

        step = jax.jit(lso.stateless_apply)
        opt_vars, params = [x.value for x in lso.variables], [v.value]
        for g in grads:
            params, opt_vars = step(opt_vars, [ops.convert_to_tensor(g, "float32")], params)
            out.append(([np.asarray(p) for p in params], [np.asarray(x) for x in opt_vars]))
        paths = [x.path for x in lso.variables]
    else:
        for g in grads:
            lso.apply([ops.convert_to_tensor(g, "float32")], [v])
            out.append(([_np(v)], [_np(x) for x in lso.variables]))
        paths = [x.path for x in lso.variables]
    return out, paths


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam, qk.QHAdamW])
def test_loss_scale_optimizer_skips_non_finite_steps_and_keeps_the_qh_state(cls) -> None:
    inner = cls(0.1) if cls is not qk.QHM else cls(0.1, momentum=0.9, nu=0.7)
    grads = [POISONED[1], POISONED[0], POISONED[2]]
    out, paths = _loss_scaled_steps(inner, grads)
    (p1, s1), (p2, s2), (p3, _) = out
    inner_paths = {x.path for x in inner.variables}
    assert len(inner_paths) >= 3
    for path, a, b in zip(paths, s1, s2, strict=True):
        if path in inner_paths:  # the QH slots, iterations and learning rate
            np.testing.assert_array_equal(a, b, err_msg=path)
    np.testing.assert_array_equal(p1[0], p2[0])
    assert np.all(np.isfinite(p3[0])) and not np.array_equal(p3[0], p2[0])
    scale = next(i for i, p in enumerate(paths) if p.endswith("dynamic_scale"))
    assert s2[scale] < s1[scale]  # recognized as an overflow: the scale went down


def test_eps_zero_with_zero_gradients_is_nan_as_in_keras_adam() -> None:
    grads = np.array([[0.0, 1.0, -2.0], [0.0, 0.5, 1.0]])
    x0 = np.ones(3)
    adam, _ = _run(keras.optimizers.Adam(0.125, epsilon=0.0), grads, x0)
    assert np.isnan(adam[0])
    for nus in [(1.0, 1.0), (0.7, 0.5), (0.0, 0.0)]:
        qh, _ = _run(qk.QHAdam(0.125, nu_1=nus[0], nu_2=nus[1], epsilon=0.0), grads, x0)
        assert np.isnan(qh[0])
        _assert_same_nonfinite(
            qh, _reference(reference.QHAdam(lr=0.125, nus=nus, eps=0.0), grads, x0)
        )
        tiny, _ = _run(qk.QHAdam(0.125, nu_1=nus[0], nu_2=nus[1], epsilon=1e-30), grads, x0)
        assert tiny[0] == 1.0


def _step_from(iterations: int, beta_2: float):
    rng = np.random.default_rng(abs(iterations) % 1000)
    m0, s0, x0, g = (rng.standard_normal(4), rng.uniform(0.1, 1, 4), rng.standard_normal(4),
                     rng.standard_normal(4))  # fmt: skip
    opt = qk.QHAdam(2**-7, beta_1=0.999, beta_2=beta_2, nu_1=0.7, nu_2=0.9)
    v = keras.Variable(x0, dtype=EXACT_DTYPE)
    opt.build([v])
    opt.iterations.assign(iterations)
    opt._momentums[0].assign(ops.convert_to_tensor(m0, EXACT_DTYPE))
    opt._velocities[0].assign(ops.convert_to_tensor(s0, EXACT_DTYPE))
    opt.apply([ops.convert_to_tensor(g, EXACT_DTYPE)], [v])
    m0 = _np(ops.convert_to_tensor(m0, EXACT_DTYPE))
    return opt, _np(v), (x0, g, m0, s0)


@pytest.mark.parametrize("iterations", [10**6 - 1, 2**31 - 2])
def test_bias_correction_at_a_large_step_count(iterations: int) -> None:
    # beta_2 = 0.99999 keeps 1 - beta_2**t away from 1 at 10**6 steps.
    _opt, got, (x0, g, m0, s0) = _step_from(iterations, 0.99999)
    ref = reference.QHAdam(lr=2**-7, betas=(0.999, 0.99999), nus=(0.7, 0.9))
    x0, g, m0, s0 = (np.asarray(np.asarray(a, EXACT_DTYPE), np.float64) for a in (x0, g, m0, s0))
    want, _ = ref.step(x0, g, reference.QHAdamState(iterations, m0, s0))
    # float32 (JAX without x64) computes 1 - beta_2**t in float32: 0.99999 rounds.
    rtol = EXACT_RTOL if EXACT_DTYPE == "float64" else 1e-4
    np.testing.assert_allclose(got, want, rtol=rtol)


def test_an_int32_step_count_that_wraps_around_keeps_bias_corrections_at_1() -> None:
    opt, _, _ = _step_from(0, 0.999)
    if keras.backend.standardize_dtype(opt.iterations.dtype) != "int32":
        pytest.skip(f"iterations is {opt.iterations.dtype} here")
    # Keras's int32 count wraps from 2**31 - 1 to -2**31; the step must not explode.
    opt, got, (x0, g, m0, s0) = _step_from(-(2**31), 0.99999)
    ref = reference.QHAdam(lr=2**-7, betas=(0.999, 0.99999), nus=(0.7, 0.9))
    x0, g, s0 = (np.asarray(np.asarray(a, EXACT_DTYPE), np.float64) for a in (x0, g, s0))
    want, _ = ref.step(x0, g, reference.QHAdamState(2**31, m0, s0))
    np.testing.assert_allclose(got, want, rtol=EXACT_RTOL if EXACT_DTYPE == "float64" else 1e-5)


def test_a_long_run_follows_the_reference() -> None:
    steps = 2000
    grads = np.random.default_rng(1).standard_normal((steps, 3))
    x0 = np.array([1.0, -2.0, 0.5])
    got, opt = _run(qk.QHAdam(2**-10, beta_1=0.999, beta_2=0.9999, nu_1=0.7, nu_2=0.9), grads, x0)
    assert int(_np(opt.iterations)) == steps
    want = _reference(reference.QHAdam(lr=2**-10, betas=(0.999, 0.9999), nus=(0.7, 0.9)), grads, x0)
    # float32 (JAX without x64): each step may round the variable, about one eps per step.
    rtol = 1e-10 if EXACT_DTYPE == "float64" else steps * float(np.finfo(np.float32).eps)
    np.testing.assert_allclose(got, want, rtol=rtol)


LOW_CONFIGS = [
    (
        "qhm",
        lambda: qk.QHM(0.5, momentum=0.99, nu=0.7),
        reference.QHM(lr=0.5, momentum=0.99, nu=0.7),
    ),
    (
        "qhadam",
        lambda: qk.QHAdam(0.05, beta_1=0.995, beta_2=0.999, nu_1=0.7),
        reference.QHAdam(lr=0.05, betas=(0.995, 0.999), nus=(0.7, 1.0)),
    ),
    (
        "qhadamw",
        lambda: qk.QHAdamW(0.05, 0.01, 0.9, 0.99, 0.7, 0.8, 1e-3),
        reference.QHAdamW(lr=0.05, betas=(0.9, 0.99), nus=(0.7, 0.8), eps=1e-3, weight_decay=0.01),
    ),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(("name", "make", "ref"), LOW_CONFIGS, ids=[c[0] for c in LOW_CONFIGS])
def test_low_precision_variables_stay_close_to_the_float64_reference(
    name, make, ref, dtype
) -> None:
    steps = 20
    rng = np.random.default_rng(0)
    x0 = rng.uniform(0.5, 2.0, 16) * rng.choice([-1, 1], 16)
    grads = rng.uniform(0.1, 1.0, (steps, 16)) * rng.choice([-1, 1], (steps, 16))
    opt = make()
    v = keras.Variable(x0, dtype=dtype)
    rx = _np(v)
    rs = ref.init(rx)
    got, want = [rx], [rx]
    for g in grads:
        g_low = ops.convert_to_tensor(g, dtype)
        opt.apply([g_low], [v])
        rx, rs = ref.step(rx, _np(ops.cast(g_low, "float32")), rs)
        got.append(_np(ops.cast(v.value, "float32")))
        want.append(rx)
    slots = [x for x in opt.variables if x.path.endswith(("momentum", "velocity"))]
    assert slots and all(keras.backend.standardize_dtype(x.dtype) == dtype for x in slots)
    eps = float(np.finfo(np.float16).eps) if dtype == "float16" else 2.0**-7
    deviation = max_relative_deviation(np.stack(got), np.stack(want))
    assert deviation <= steps * eps, deviation


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam])
def test_loading_variables_of_the_wrong_shape_raises_and_changes_nothing(cls) -> None:
    opt = cls(0.1)
    v = keras.Variable(np.ones(3), dtype="float32")
    opt.apply([ops.ones((3,))], [v])
    before = [_np(x).copy() for x in opt.variables]
    store = {str(i): _np(x) + 1.0 for i, x in enumerate(opt.variables)}
    store[str(len(store) - 1)] = np.zeros(4)  # the last slot from a different model
    with pytest.raises(ValueError, match=r"saved with shape \(4,\), it has \(3,\)"):
        opt.load_own_variables(store)
    for x, b in zip(opt.variables, before, strict=True):
        np.testing.assert_array_equal(_np(x), b)
    store[str(len(store) - 1)] = np.zeros(3)
    opt.load_own_variables(store)  # a store that fits loads
    np.testing.assert_array_equal(_np(opt.variables[-1]), np.zeros(3))


@pytest.mark.parametrize("beta_2", [0.99999, 0.999999])
def test_bias_corrections_near_beta_1_keep_the_precision_of_the_dtype(beta_2: float) -> None:
    # Found by fuzzing: in float32, 1 - beta_2**t cancels (off by ~1e-2 at t = 1).
    grads = np.array([[-0.0889], [-0.0657], [0.5]])
    x0 = np.array([1.5])
    got, _ = _run(qk.QHAdam(0.5, beta_1=0.0, beta_2=beta_2, nu_1=0.0, epsilon=0.0), grads, x0)
    ref = reference.QHAdam(lr=0.5, betas=(0.0, beta_2), nus=(0.0, 1.0), eps=0.0)
    want = _reference(ref, np.asarray(np.asarray(grads, EXACT_DTYPE), np.float64), x0)
    np.testing.assert_allclose(got, want, rtol=EXACT_RTOL)


def _trained(cls, **kwargs):
    opt = cls(0.1, **kwargs)
    variables = [keras.Variable(np.ones(s), dtype="float32") for s in ((3,), (2, 2))]
    opt.apply([ops.ones(v.shape) for v in variables], variables)
    return opt


def _assert_unchanged(opt, before) -> None:
    for x, b in zip(opt.variables, before, strict=True):
        np.testing.assert_array_equal(_np(x), b)


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam, qk.QHMuon])
@pytest.mark.parametrize("extra", [1, -1])
def test_a_store_of_another_variable_count_raises(cls, extra) -> None:
    # Keras alone warns and loads nothing; docs/robustness.md promises a ValueError.
    opt = _trained(cls)
    before = [_np(x).copy() for x in opt.variables]
    store = {}
    opt.save_own_variables(store)
    if extra > 0:
        store[str(len(opt.variables))] = np.zeros(3)
    else:
        del store[str(len(opt.variables) - 1)]
    with pytest.raises(ValueError, match="cannot load a store of"):
        opt.load_own_variables(store)
    _assert_unchanged(opt, before)


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam, qk.QHMuon])
def test_a_store_from_before_the_first_step_loads_nothing_and_warns(cls) -> None:
    # As Keras's optimizers: model.save before fit, or load_weights into a
    # model just compiled, has no state on one side to carry.
    unbuilt = {}
    cls(0.1).save_own_variables(unbuilt)
    opt = _trained(cls)
    before = [_np(x).copy() for x in opt.variables]
    with pytest.warns(UserWarning, match=f"{cls.__name__} loads no variables: .* had not stepped"):
        opt.load_own_variables(unbuilt)
    _assert_unchanged(opt, before)
    built = {}
    opt.save_own_variables(built)
    fresh = cls(0.1)
    with pytest.warns(UserWarning, match="the optimizer had not stepped yet"):
        fresh.load_own_variables(built)
    assert not fresh.built


@pytest.mark.parametrize(
    ("saved", "loading", "kind"),
    [
        (qk.QHM, qk.QHMuon, "QHM's"),
        (qk.QHMuon, qk.QHM, "QHMuon's"),
        (qk.QHMuon, qk.QHAdam, "QHMuon's"),
    ],
)
def test_a_store_of_another_qh_optimizer_whose_count_fits_raises(
    saved, loading, kind, tmp_path
) -> None:
    # One Dense layer: QHM's two slots and the step count and learning rate
    # make as many variables as QHMuon's; QHMuon assigned three of them
    # before a shape told it apart.
    def trained(opt):
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer=opt, loss="mse")
        model.fit(np.ones((8, 6)), np.ones((8, 3)), batch_size=4, epochs=1, verbose=0)
        return model

    trained(saved(0.05)).save_weights(tmp_path / "saved.weights.h5")
    model = trained(loading(0.02))
    before = [_np(x).copy() for x in model.optimizer.variables]
    with pytest.raises(ValueError, match=f"cannot load these variables: they are {kind}"):
        model.load_weights(tmp_path / "saved.weights.h5")
    _assert_unchanged(model.optimizer, before)


def test_a_model_saved_before_fit_loads(tmp_path) -> None:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=qk.QHAdam(0.01), loss="mse")
    model.save(tmp_path / "m.keras")
    with pytest.warns(UserWarning, match="QHAdam loads no variables"):
        loaded = keras.models.load_model(tmp_path / "m.keras")
    loaded.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=1, verbose=0)
    assert int(_np(loaded.optimizer.iterations)) == 1


def test_a_qhm_store_whose_shapes_fit_is_not_loaded_into_qhadam() -> None:
    # QHM on 4 variables keeps 4 momentum slots; QHAdam on 2 keeps a momentum and
    # a velocity each, in the same order of shapes.
    qhm = qk.QHM(0.1)
    variables = [keras.Variable(np.ones(s), dtype="float32") for s in ((3,), (3,), (2,), (2,))]
    qhm.apply([ops.ones(v.shape) for v in variables], variables)
    store = {}
    qhm.save_own_variables(store)
    qhadam = qk.QHAdam(0.1)
    pair = [keras.Variable(np.ones(s), dtype="float32") for s in ((3,), (2,))]
    qhadam.apply([ops.ones(v.shape) for v in pair], pair)
    assert [tuple(x.shape) for x in qhadam.variables] == [
        tuple(np.shape(store[str(i)])) for i in range(len(qhadam.variables))
    ]
    before = [_np(x).copy() for x in qhadam.variables]
    with pytest.raises(ValueError, match=r"QHM's \(momentum\) slots"):
        qhadam.load_own_variables(store)
    _assert_unchanged(qhadam, before)
    amsgrad = _trained(qk.QHAdam, amsgrad=True)
    store = {}
    _trained(qk.QHAdam).save_own_variables(store)
    with pytest.raises(ValueError, match="slots"):
        amsgrad.load_own_variables(store)
    # QHAdam and QHAdamW keep the same slots: their stores are interchangeable.
    qk_w = _trained(qk.QHAdamW)
    qk_w.load_own_variables(store)


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam])
def test_a_non_numeric_entry_raises_before_anything_is_assigned(cls) -> None:
    opt = _trained(cls)
    before = [_np(x).copy() for x in opt.variables]
    store = {}
    opt.save_own_variables(store)
    for i in range(len(opt.variables)):
        store[str(i)] = np.asarray(store[str(i)]) + 1
    store[str(len(opt.variables) - 1)] = (
        np.array(["not", "a", "number"])[:1].repeat(4).reshape(opt.variables[-1].shape)
    )
    with pytest.raises(ValueError, match="not a number"):
        opt.load_own_variables(store)
    _assert_unchanged(opt, before)


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam, qk.QHAdamW])
def test_a_saved_store_round_trips(cls) -> None:
    opt = _trained(cls)
    store = {}
    opt.save_own_variables(store)
    other = _trained(cls)
    other.apply([ops.ones(v.shape) for v in other._trainable_variables], other._trainable_variables)
    other.load_own_variables(store)
    for a, b in zip(opt.variables, other.variables, strict=True):
        np.testing.assert_array_equal(_np(a), _np(b))


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("beta_1", [0.99999, 0.9999999])
def test_adam_first_step_is_lr_times_the_sign_in_float32(beta_1, amsgrad) -> None:
    # nu_1 = nu_2 = 1 and epsilon = 0 is Adam, whose first step is exactly
    # -lr * sign(g); 1 - beta_1 evaluated in float32 would make it ~16% short
    # at beta_1 = 0.9999999 (float32 bias corrections take the expm1 form).
    g = np.array([1.0, -2.0], "float32")
    v = keras.Variable(np.zeros(2), dtype="float32")
    opt = qk.QHAdam(1.0, beta_1=beta_1, nu_1=1.0, nu_2=1.0, epsilon=0.0, amsgrad=amsgrad)
    opt.apply([ops.convert_to_tensor(g)], [v])
    # Within one float32 ulp of 1: the bias correction -expm1(log(beta_1)) and
    # the moment's (1 - beta_1) round separately, and no float32 arithmetic is
    # exact for every gradient (docs/robustness.md, "beta near 1 in float32").
    one_ulp = float(np.finfo(np.float32).eps)
    np.testing.assert_allclose(ops.convert_to_numpy(v), -np.sign(g), rtol=0, atol=one_ulp)


ALIAS_CONFIGS = [
    (
        "qhm",
        lambda: qk.QHM(0.5, momentum=0.9, nu=0.7, weight_decay=0.1),
        reference.QHM(lr=0.5, momentum=0.9, nu=0.7, weight_decay=0.1, decoupled_weight_decay=True),
    ),
    (
        "qhadamw",
        lambda: qk.QHAdamW(2**-4, weight_decay=0.1, nu_1=0.7, nu_2=0.8, epsilon=1e-3),
        reference.QHAdamW(lr=2**-4, nus=(0.7, 0.8), eps=1e-3, weight_decay=0.1),
    ),
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(("name", "make", "ref"), ALIAS_CONFIGS, ids=[c[0] for c in ALIAS_CONFIGS])
def test_a_gradient_that_is_the_variable_itself_follows_the_reference(
    name, make, ref, fused, monkeypatch
) -> None:
    # The gradient of |x|^2 / 2 is x: the variable's own value as its gradient.
    # On the torch backend that is the variable's storage, which the
    # multi-tensor passes must read before they write it (the fused kernel
    # copies such a gradient itself); elsewhere it is a value like any other.
    # (Learning rates exact in float32: Keras keeps them in float32 variables.)
    monkeypatch.setattr(qk, "TORCH_FUSED", fused)
    opt = make()
    v = keras.Variable(X0, dtype=EXACT_DTYPE)
    x, state = X0.copy(), ref.init(X0.copy())
    for _ in range(3):
        opt.apply([v.value], [v])
        x, state = ref.step(x, x.copy(), state)
    np.testing.assert_allclose(_np(v), x, rtol=EXACT_RTOL if EXACT_DTYPE == "float64" else 1e-5)
