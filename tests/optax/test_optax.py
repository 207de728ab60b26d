"""qhoptim.optax: optax idioms, dtypes, pytrees, jit, checkpoints, conformance."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qhoptim.optax as qho
from conformance import runner
from qhoptim import convert
from qhoptim.reference import QHM, QHAdam

F = lambda x: jnp.sum((x - 0.5) ** 2 * jnp.arange(1, x.size + 1, dtype=x.dtype))  # noqa: E731

OPTIMIZERS = {
    "qhm": lambda: qho.qhm(0.1, momentum=0.9, nu=0.7),
    "qhadam": lambda: qho.qhadam(0.05, nu1=0.7, nu2=0.9),
    "qhadamw": lambda: qho.qhadamw(0.05, nu1=0.7, weight_decay=0.01),
    "qhadam-amsgrad": lambda: qho.qhadam(0.05, b2=0.9, nu1=0.7, nu2=0.9, amsgrad=True),
    "qhadamw-amsgrad": lambda: qho.qhadamw(0.05, b2=0.9, weight_decay=0.01, amsgrad=True),
}


def _run(tx, params, steps=5, grad_fn=None, **update_kwargs):
    grad_fn = grad_fn or jax.grad(F)
    state = tx.init(params)
    for _ in range(steps):
        updates, state = tx.update(grad_fn(params), state, params, **update_kwargs)
        params = optax.apply_updates(params, updates)
    return params, state


# --------------------------------------------------------------------------- conformance


def test_conformance_rows_all_pass() -> None:
    rows = runner.run(["optax"])
    runner.record(rows, "optax")
    assert {(r.case, r.dtype) for r in rows} == {
        (c.name, dtype) for c in runner.load_cases() for dtype in runner.DTYPES
    }
    failed = [r for r in rows if not r.passed]
    assert not failed, runner.format_table(failed)


# ------------------------------------------------------------------ known equivalences


def test_qhadam_with_unit_nus_is_optax_adam() -> None:
    x = jnp.linspace(-1.0, 1.0, 7, dtype=jnp.float64)
    a, _ = _run(qho.qhadam(0.05, 0.9, 0.99, 1.0, 1.0, 1e-8), x, steps=20)
    b, _ = _run(optax.adam(0.05, 0.9, 0.99, 1e-8), x, steps=20)
    np.testing.assert_allclose(a, b, rtol=1e-13)


def _spiky_grads(steps: int, size: int = 6) -> np.ndarray:
    """Gradients that shrink, with spikes: the second moment falls, the maximum is read."""
    rng = np.random.default_rng(7)
    g = rng.standard_normal((steps, size)) * np.geomspace(3.0, 0.1, steps)[:, None]
    g[::6] *= 25.0
    return g


@pytest.mark.parametrize(("nus", "weight_decay"), [((1.0, 1.0), 0.0), ((0.7, 0.8), 0.1)])
def test_amsgrad_follows_the_reference_with_torchs_convention(nus, weight_decay) -> None:
    # The float64 reference keeps the maximum of the *uncorrected* second moment
    # (torch's and Keras's Adam(amsgrad=True)); qhoptim.optax follows it.
    grads = _spiky_grads(30)
    x0 = np.linspace(-1.0, 1.0, 6)
    kw = dict(b1=0.9, b2=0.95, nu1=nus[0], nu2=nus[1], eps=1e-8, amsgrad=True)
    tx = (
        qho.qhadamw(0.05, **kw, weight_decay=weight_decay)
        if weight_decay
        else qho.qhadam(0.05, **kw)
    )
    ref = QHAdam(
        0.05,
        betas=(0.9, 0.95),
        nus=nus,
        eps=1e-8,
        weight_decay=weight_decay,
        decoupled_weight_decay=True,
        amsgrad=True,
    )
    params, state = jnp.asarray(x0), tx.init(jnp.asarray(x0))
    want, ref_state = x0, ref.init(x0)
    for g in grads:
        updates, state = tx.update(jnp.asarray(g), state, params)
        params = optax.apply_updates(params, updates)
        want, ref_state = ref.step(want, g, ref_state)
        np.testing.assert_allclose(params, want, rtol=1e-13, atol=1e-15)
    inner = state[0]
    assert isinstance(inner, qho.ScaleByQHAdamAmsgradState)
    np.testing.assert_allclose(inner.nu_max, ref_state.max_exp_avg_sq, rtol=1e-13)
    assert np.any(np.asarray(inner.nu_max) > np.asarray(inner.nu))


def test_amsgrad_differs_from_optax_amsgrad_as_documented() -> None:
    # optax.amsgrad keeps the maximum of the bias-corrected second moment: with
    # nus = (1, 1) the trajectories differ (docs/optax.md), while the reference
    # (torch's convention) is followed above.
    grads = _spiky_grads(30)
    x = jnp.linspace(-1.0, 1.0, 6)
    ours, theirs = qho.qhadam(0.05, 0.9, 0.95, amsgrad=True), optax.amsgrad(0.05, 0.9, 0.95)
    s1, s2 = ours.init(x), theirs.init(x)
    p1 = p2 = x
    for g in grads:
        u1, s1 = ours.update(jnp.asarray(g), s1, p1)
        u2, s2 = theirs.update(jnp.asarray(g), s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    assert float(jnp.max(jnp.abs(p1 - p2))) > 1e-3


def test_amsgrad_state_and_checks() -> None:
    x = jnp.ones(3)
    plain, ams = qho.scale_by_qhadam(), qho.scale_by_qhadam(amsgrad=True)
    assert type(plain.init(x)) is qho.ScaleByQHAdamState  # unchanged without amsgrad
    state = ams.init(x)
    assert state._fields == ("count", "mu", "nu", "nu_max")  # optax's ScaleByAmsgradState's
    assert optax.tree.get(state, "nu_max").dtype == x.dtype
    with pytest.raises(TypeError, match="needs its own state, ScaleByQHAdamAmsgradState"):
        ams.update(x, plain.init(x))
    for value in (1, "yes", None):
        with pytest.raises(TypeError) as info:
            qho.qhadam(0.1, amsgrad=value)
        assert str(info.value) == f"amsgrad must be a bool; received amsgrad={value!r}"
    # complex params: a real running maximum
    z = jnp.ones(2, jnp.complex64)
    assert ams.init(z).nu_max.dtype == jnp.float32


@pytest.mark.parametrize("nesterov", [False, True])
def test_qhm_recovers_optax_sgd_momentum_and_nesterov(nesterov: bool) -> None:
    # optax.sgd keeps an unnormalized trace; QHM's buffer is normalized, so
    # lr_qhm = lr / (1 - beta), and nu = 1 (momentum) or nu = beta (NAG).
    lr, beta = 0.01, 0.9
    x = jnp.linspace(-1.0, 1.0, 7, dtype=jnp.float64)
    a, _ = _run(qho.qhm(lr / (1 - beta), beta, beta if nesterov else 1.0), x, steps=30)
    b, _ = _run(optax.sgd(lr, momentum=beta, nesterov=nesterov), x, steps=30)
    np.testing.assert_allclose(a, b, rtol=1e-12)


# ------------------------------------------------------------- from_params (conversions)


@pytest.mark.parametrize("nesterov", [False, True])
def test_from_params_of_a_conversion_is_optax_sgd(nesterov: bool) -> None:
    lr, beta = 0.01, 0.9
    params = (convert.from_nesterov if nesterov else convert.from_momentum)(lr, beta)
    x = jnp.linspace(-1.0, 1.0, 7, dtype=jnp.float64)
    a, _ = _run(qho.from_params(params), x, steps=30)
    b, _ = _run(optax.sgd(lr, momentum=beta, nesterov=nesterov), x, steps=30)
    np.testing.assert_allclose(a, b, rtol=1e-12)


def test_from_params_of_from_adam_is_optax_adam() -> None:
    x = jnp.linspace(-1.0, 1.0, 7, dtype=jnp.float64)
    a, _ = _run(qho.from_params(convert.from_adam(0.05, (0.9, 0.99), 1e-8)), x, steps=20)
    b, _ = _run(optax.adam(0.05, 0.9, 0.99, 1e-8), x, steps=20)
    np.testing.assert_allclose(a, b, rtol=1e-13)


@pytest.mark.parametrize(
    ("params", "direct"),
    [
        (convert.QHMParams(lr=0.3, nu=0.7, momentum=0.95), lambda: qho.qhm(0.3, 0.95, 0.7)),
        (
            convert.QHAdamParams(lr=0.02, betas=(0.8, 0.9), nus=(0.6, 0.7), eps=1e-6),
            lambda: qho.qhadam(0.02, 0.8, 0.9, 0.6, 0.7, 1e-6),
        ),
    ],
    ids=["QHMParams", "QHAdamParams"],
)
def test_from_params_maps_every_field(params, direct) -> None:
    x = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float64)
    a, state_a = _run(qho.from_params(params), x)
    b, state_b = _run(direct(), x)
    np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(state_a) == jax.tree.structure(state_b)


def test_from_params_passes_keyword_arguments() -> None:
    x = jnp.ones(3, jnp.bfloat16)
    qhm = qho.from_params(convert.from_sgd(0.1), accumulator_dtype=jnp.float32)
    assert qhm.init(x)[0].momentum_buffer.dtype == jnp.float32
    qhadam = qho.from_params(convert.from_adam(1e-3, (0.9, 0.999), 1e-8), mu_dtype=jnp.float32)
    assert qhadam.init(x)[0].mu.dtype == jnp.float32
    with pytest.raises(TypeError, match="mu_dtype"):
        qho.from_params(convert.from_sgd(0.1), mu_dtype=jnp.float32)


@pytest.mark.parametrize(
    "params",
    [
        (0.1, 0.7, 0.9),  # a plain tuple with QHMParams' fields
        {"lr": 0.1, "nu": 0.7, "momentum": 0.9},
        convert.TwoStateInitialBuffer(1.0, 0.0),
        None,
    ],
    ids=["tuple", "dict", "TwoStateInitialBuffer", "None"],
)
def test_from_params_rejects_other_types(params) -> None:
    with pytest.raises(TypeError) as info:
        qho.from_params(params)
    message = str(info.value)
    assert message.startswith(
        "from_params expects qhoptim.convert.QHMParams or qhoptim.convert.QHAdamParams or "
        "qhoptim.convert.QHMuonParams; received "
    )
    assert message.endswith(type(params).__name__)


def test_from_params_is_exported() -> None:
    assert "from_params" in qho.__all__


# -------------------------------------------------------------------- optax idioms


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_chains_after_clip_by_global_norm(name: str) -> None:
    x = jnp.linspace(-3.0, 3.0, 5)
    chained, _ = _run(optax.chain(optax.clip_by_global_norm(0.5), OPTIMIZERS[name]()), x)

    def clipped_grad(p):
        g = jax.grad(F)(p)
        return g * jnp.minimum(1.0, 0.5 / jnp.linalg.norm(g))

    manual, _ = _run(OPTIMIZERS[name](), x, grad_fn=clipped_grad)
    np.testing.assert_allclose(chained, manual, rtol=1e-12)


@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (qho.qhm, {"learning_rate": 0.1, "momentum": 0.9, "nu": 0.7}),
        (qho.qhadam, {"learning_rate": 0.05, "b1": 0.9, "b2": 0.99, "nu1": 0.7, "nu2": 0.8}),
        (qho.qhadamw, {"learning_rate": 0.05, "nu1": 0.7, "weight_decay": 0.1}),
    ],
)
def test_inject_hyperparams_gives_same_updates_and_state(factory, kwargs) -> None:
    x = jnp.linspace(-1.0, 1.0, 6)
    plain_params, plain_state = _run(factory(**kwargs), x, steps=6)
    injected = optax.inject_hyperparams(factory)(**kwargs)
    params, state = x, injected.init(x)
    update = jax.jit(injected.update)  # hyperparameters are traced arrays here
    for _ in range(6):
        updates, state = update(jax.grad(F)(params), state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(params, plain_params, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
        state.inner_state,
        plain_state,
    )


@pytest.mark.parametrize(
    ("factory", "kwargs", "dtype"),
    [
        (qho.qhadam, {"learning_rate": 0.01, "b1": 0.9, "b2": 0.999}, jnp.bfloat16),
        (qho.qhm, {"learning_rate": 0.1, "momentum": 0.999, "nu": 0.7}, jnp.bfloat16),
        (
            qho.qhm,
            {"learning_rate": 0.1, "momentum": 0.999, "nu": 0.7, "accumulator_dtype": jnp.bfloat16},
            jnp.float32,
        ),
    ],
)
def test_injected_hyperparameters_are_not_rounded_to_a_narrow_leaf(factory, kwargs, dtype) -> None:
    # Traced b2 = 0.999 (momentum 0.999) rounded to bfloat16 is 1.0: 1 - b2 = 0
    # left QHAdam's second moment at 0 (a step of m / eps) and QHM's buffer at 0.
    x = jnp.asarray([1.0, 1.0, 1.0], dtype)
    g = jnp.asarray([0.5, -0.3, 0.1], dtype)
    static = ("accumulator_dtype",) if "accumulator_dtype" in kwargs else ()
    # float32 hyperparameters (inject's default for bfloat16 parameters is
    # bfloat16 ones, where b2 = 1.0 is refused as out of range).
    inject = optax.inject_hyperparams(factory, static_args=static, hyperparam_dtype=jnp.float32)
    results = []
    for tx in (factory(**kwargs), inject(**kwargs)):
        params, state, update = x, tx.init(x), jax.jit(tx.update)
        for _ in range(5):
            updates, state = update(g, state, params)
            params = optax.apply_updates(params, updates)
        inner = getattr(state, "inner_state", state)
        results.append([np.asarray(a, np.float32) for a in jax.tree.leaves((params, inner))])
    # The plain optimizer applies its Python-float coefficients in bfloat16, the
    # injected one in float32: the same parameters and states (the buffer, the
    # moments) within bfloat16's rounding.
    for injected, plain in zip(results[1], results[0], strict=True):
        np.testing.assert_allclose(injected, plain, rtol=2e-2)


def test_inject_hyperparams_can_change_nu_midway() -> None:
    tx = optax.inject_hyperparams(qho.qhm)(learning_rate=0.1, momentum=0.9, nu=0.7)
    state = tx.init(jnp.ones(3))
    state.hyperparams["nu"] = jnp.asarray(0.0)
    updates, _ = tx.update(jnp.ones(3), state)
    np.testing.assert_allclose(updates, -0.1 * jnp.ones(3), rtol=1e-7)  # nu = 0: SGD


def test_multisteps_accumulates_then_applies() -> None:
    tx = optax.MultiSteps(qho.qhadam(0.1, nu1=0.7), every_k_schedule=2)
    x = jnp.array([1.0, -2.0])
    state = tx.init(x)
    u1, state = tx.update(jnp.array([1.0, 1.0]), state, x)
    np.testing.assert_array_equal(u1, jnp.zeros(2))
    u2, state = tx.update(jnp.array([3.0, -1.0]), state, x)
    expected, _ = qho.qhadam(0.1, nu1=0.7).update(jnp.array([2.0, 0.0]), qho.qhadam(0.1).init(x))
    np.testing.assert_allclose(u2, expected, rtol=1e-12)


def test_apply_if_finite_skips_nan_steps_and_keeps_state() -> None:
    tx = optax.apply_if_finite(qho.qhadam(0.1), max_consecutive_errors=3)
    x = jnp.array([1.0, 2.0])
    state = tx.init(x)
    _, state = tx.update(jnp.array([1.0, 1.0]), state, x)
    before = state.inner_state
    updates, state = tx.update(jnp.array([jnp.nan, 1.0]), state, x)
    np.testing.assert_array_equal(updates, jnp.zeros(2))
    jax.tree.map(np.testing.assert_array_equal, state.inner_state, before)
    assert int(state.notfinite_count) == 1


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_update_accepts_extra_keyword_arguments(name: str) -> None:
    _run(OPTIMIZERS[name](), jnp.ones(3), steps=1, value=jnp.asarray(1.0), extra="ignored")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_arbitrary_pytrees_with_none_leaves(name: str) -> None:
    params = {"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}, "scale": jnp.ones(())}
    grads = {"dense": {"kernel": jnp.full((2, 3), 0.5), "bias": None}, "scale": jnp.ones(())}
    tx = OPTIMIZERS[name]()
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    assert updates["dense"]["bias"] is None
    assert updates["dense"]["kernel"].shape == (2, 3)
    # leaves without a gradient keep their (zero) state
    flat = jax.tree.leaves(state)
    assert all(jnp.all(jnp.isfinite(a)) for a in flat)


# -------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bf16_params_keep_bf16_updates_and_state(name: str) -> None:
    x = jnp.ones(4, jnp.bfloat16)
    tx = OPTIMIZERS[name]()
    state = tx.init(x)
    updates, new_state = tx.update(jnp.full(4, 0.25, jnp.bfloat16), state, x)
    assert updates.dtype == jnp.bfloat16
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype, state, new_state)
    assert all(jax.tree.leaves(same))


def test_mu_dtype_and_accumulator_dtype_are_honoured() -> None:
    x = jnp.ones(3, jnp.bfloat16)
    state = qho.scale_by_qhadam(mu_dtype=jnp.float32).init(x)
    assert state.mu.dtype == jnp.float32 and state.nu.dtype == jnp.bfloat16
    updates, state2 = qho.scale_by_qhadam(mu_dtype=jnp.float32).update(x, state)
    assert updates.dtype == jnp.bfloat16 and state2.mu.dtype == jnp.float32
    qstate = qho.scale_by_qhm(accumulator_dtype="float32").init(x)
    assert qstate.momentum_buffer.dtype == jnp.float32
    assert qho.scale_by_qhadam().init(x).count.dtype == jnp.int32


def test_complex_params_use_squared_modulus() -> None:
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal(4) + 1j * rng.standard_normal(4)
    grads = rng.standard_normal((10, 4)) + 1j * rng.standard_normal((10, 4))
    ref = QHAdam(lr=0.05, betas=(0.9, 0.99), nus=(0.7, 0.8), eps=1e-8)
    rx, rs = x0, ref.init(x0)
    tx = qho.qhadam(0.05, 0.9, 0.99, 0.7, 0.8, 1e-8)
    x, state = jnp.asarray(x0), tx.init(jnp.asarray(x0))
    assert state[0].nu.dtype == jnp.float64  # real second moment for complex128 params
    for g in grads:
        rx, rs = ref.step(rx, g, rs)
        updates, state = tx.update(jnp.asarray(g), state, x)
        x = optax.apply_updates(x, updates)
    np.testing.assert_allclose(np.asarray(x), rx, rtol=1e-12)


# --------------------------------------------------------------- jit and state shape


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_jit_compiles_once_and_state_is_stable(name: str) -> None:
    tx = OPTIMIZERS[name]()
    traces = []

    @jax.jit
    def step(params, state):
        traces.append(1)
        updates, state = tx.update(jax.grad(F)(params), state, params)
        return optax.apply_updates(params, updates), state

    params = jnp.linspace(0.0, 1.0, 5, dtype=jnp.float32)
    state0 = tx.init(params)
    state = state0
    for _ in range(4):
        params, state = step(params, state)
    assert len(traces) == 1
    same = jax.tree.map(lambda a, b: a.shape == b.shape and a.dtype == b.dtype, state0, state)
    assert all(jax.tree.leaves(same))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_survives_checkpoint_round_trip(name: str) -> None:
    _checkpoint_round_trip(OPTIMIZERS[name](), jnp.linspace(-1.0, 1.0, 4))


def _checkpoint_round_trip(tx: Any, x: jax.Array, *, same_state: bool = False) -> None:
    """3 steps, a flax checkpoint and 4 more steps equal 7 steps, bit for bit
    (``same_state``: the restored state is the saved one, leaf for leaf)."""
    from flax import serialization

    params, state = _run(tx, x, steps=3)
    blob = serialization.to_bytes((params, state))
    restored_params, restored_state = serialization.from_bytes((x, tx.init(x)), blob)
    if same_state:
        jax.tree.map(np.testing.assert_array_equal, restored_state, state)
    a, _ = _run_from(tx, params, state, steps=4)
    b, _ = _run_from(tx, restored_params, restored_state, steps=4)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "make",
    [
        lambda: qho.qhm(0.1, momentum=0.9, nu=0.7, state_dtype=jnp.uint8),
        lambda: qho.qhadam(0.05, nu1=0.7, nu2=0.9, state_dtype=jnp.uint8),
    ],
    ids=["qhm", "qhadam"],
)
def test_an_8_bit_state_survives_a_flax_checkpoint(make: Any) -> None:
    _checkpoint_round_trip(make(), jnp.linspace(-1.0, 1.0, 300, dtype=jnp.float32), same_state=True)


def test_flax_imported_after_init_serializes_an_8_bit_state_after_an_update() -> None:
    # flax learns of EightBitArray on import, at init, and as an update
    # returns one: here flax comes after init, in a process of its own.
    script = """
import jax, jax.numpy as jnp, optax
import qhoptim.optax as qho
tx = qho.qhadam(0.05, state_dtype=jnp.uint8)
x = jnp.linspace(-1.0, 1.0, 300, dtype=jnp.float32)
state = tx.init(x)
from flax import serialization
_, state = jax.jit(tx.update)(x, state, x)
blob = serialization.to_bytes(state)
back = serialization.from_bytes(tx.init(x), blob)
jax.tree.map(lambda a, b: (a == b).all().item() or exit(1), state, back)
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize(
    "make",
    [
        lambda: qho.qhm(0.1, momentum=0.9, nu=0.7, state_dtype=jnp.uint8),
        lambda: qho.qhadam(0.05, nu1=0.7, nu2=0.9, amsgrad=True, state_dtype=jnp.uint8),
        lambda: qho.qhadam(0.05, nu1=0.7, state_dtype=jnp.bfloat16),
        lambda: qho.qhmuon(0.02, state_dtype=jnp.uint8),
    ],
    ids=["qhm-8-bit", "qhadam-amsgrad-8-bit", "qhadam-bfloat16", "qhmuon-8-bit"],
)
def test_narrow_state_in_a_flax_nnx_optimizer_steps_as_a_plain_loop(make: Any) -> None:
    # nnx.Optimizer keeps each state leaf in a variable and, from its second
    # update on, hands an 8-bit leaf back as the mapping of its two children;
    # the steps read it as the 8-bit array it was, bit for bit a plain loop's.
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):  # type: ignore[misc]
        def __init__(self, rngs: Any) -> None:
            self.linear = nnx.Linear(40, 30, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.linear(x)

    x = jnp.linspace(-1.0, 1.0, 80, dtype=jnp.float32).reshape(2, 40)

    def loss(model: Any) -> jax.Array:
        return (model(x) ** 2).mean()

    model = Model(nnx.Rngs(0))
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, make(), wrt=nnx.Param)

    @nnx.jit
    def train_step(model: Any, optimizer: Any) -> None:
        optimizer.update(model, nnx.grad(loss)(model))

    tx = make()
    state = tx.init(params)
    graphdef, _ = nnx.split(model)

    @jax.jit
    def plain_step(params: Any, state: Any) -> Any:
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p)))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(4):
        train_step(model, optimizer)
        params, state = plain_step(params, state)
    got = nnx.as_pure(nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, got, params)


def _run_from(tx, params, state, steps):
    for _ in range(steps):
        updates, state = tx.update(jax.grad(F)(params), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_schedule_learning_rate_matches_reference() -> None:
    schedule = optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.9)
    x0 = np.array([1.0, -1.0, 2.0])
    tx = qho.qhm(schedule, momentum=0.9, nu=0.7)
    x, state = jnp.asarray(x0), tx.init(jnp.asarray(x0))
    ref, rx = QHM(lr=0.1, momentum=0.9, nu=0.7), x0
    rs = ref.init(rx)
    for t in range(8):
        g = 2 * np.asarray(x)
        updates, state = tx.update(jnp.asarray(g), state, x)
        x = optax.apply_updates(x, updates)
        rx, rs = ref.step(rx, 2 * rx, rs, lr=0.1 * 0.9**t)
    # optax's schedules evaluate in float32 even under x64: compare at that precision.
    np.testing.assert_allclose(np.asarray(x), rx, rtol=1e-6)


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: qho.scale_by_qhm(momentum=1.2),
            "momentum must be in [0, 1); received momentum=1.2",
        ),
        (lambda: qho.qhm(0.1, nu=float("nan")), "nu must be a finite real number; received nu=nan"),
        (lambda: qho.qhm(-0.1), "learning_rate must be in [0, inf); received learning_rate=-0.1"),
        (lambda: qho.qhadam(0.1, b1=1.0), "b1 must be in [0, 1); received b1=1.0"),
        (lambda: qho.qhadam(0.1, nu2=1.5), "nu2 must be in [0, 1]; received nu2=1.5"),
        (lambda: qho.qhadam(0.1, eps=-1.0), "eps must be in [0, inf); received eps=-1.0"),
        (
            lambda: qho.qhadamw(0.1, weight_decay=-1.0),
            "weight_decay must be in [0, inf); received weight_decay=-1.0",
        ),
    ],
)
def test_invalid_hyperparameters_raise_core_errors(make, message) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message


def test_flax_example_trains() -> None:
    import runpy
    from pathlib import Path

    example = Path(__file__).parents[2] / "docs" / "examples" / "optax_flax_mlp.py"
    result = runpy.run_path(str(example), run_name="example")
    losses = result["train"](steps=150)
    assert losses[-1] < 0.5 * losses[0]


# ------------------------------------------------- updates must fit the state's tree
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize(
    "grads",
    [
        lambda x, y: [x, y],  # a list for a dict
        lambda x, y: (x, y),  # a tuple for a dict
        lambda x, y: {"a": x, "c": y},  # another key
        lambda x, y: {"a": x, "b": {"c": y}},  # another nesting
    ],
    ids=["list", "tuple", "key", "nesting"],
)
def test_updates_of_another_structure_raise_as_in_optax_adam(name: str, grads) -> None:
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    g = grads(jnp.full(2, 0.5), jnp.full(2, -2.0))
    adam = optax.adam(0.1)
    with pytest.raises(ValueError) as adam_error:
        adam.update(g, adam.init(params), params)
    tx = OPTIMIZERS[name]()
    with pytest.raises(type(adam_error.value), match="pytree structure"):
        tx.update(g, tx.init(params), params)


def test_leaves_in_another_order_are_refused_not_swapped() -> None:
    # Same leaf count and shapes, other order: each parameter must keep its moments.
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    tx = qho.qhadam(0.1, nu1=0.7)
    _, state = tx.update({"a": jnp.full(2, 3.0), "b": jnp.full(2, -1.0)}, tx.init(params))
    with pytest.raises(ValueError, match="pytree structure"):
        tx.update([jnp.ones(2), jnp.ones(2)], state)
    with pytest.raises(ValueError, match="pytree structure"):
        tx.update((jnp.ones(2), jnp.ones(2)), state)


@pytest.mark.parametrize("name", ["qhm", "qhadam", "qhadamw"])
@pytest.mark.parametrize("jit", [False, True])
def test_inject_hyperparams_takes_complex_parameters(name: str, jit: bool) -> None:
    # optax casts the injected hyperparameters to the parameters' dtype,
    # complex64 here: their real part is the hyperparameter (optax.adam's way).
    make = {"qhm": qho.qhm, "qhadam": qho.qhadam, "qhadamw": qho.qhadamw}[name]
    params = jnp.asarray([1 + 1j, 2 - 1j], jnp.complex64)
    grads = jnp.asarray([0.5 - 0.2j, -0.3 + 0.1j], jnp.complex64)
    injected = optax.inject_hyperparams(make)(learning_rate=0.01)
    plain = make(0.01)
    update = jax.jit(injected.update) if jit else injected.update
    state, plain_state = injected.init(params), plain.init(params)
    for _ in range(3):
        got, state = update(grads, state, params)
        want, plain_state = plain.update(grads, plain_state, params)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    with pytest.raises(TypeError, match=r"learning_rate must be a real number"):
        make(jnp.asarray(0.01 + 0.5j, jnp.complex64))


def test_inject_hyperparams_on_bfloat16_parameters_says_what_made_b2_one() -> None:
    # optax casts the injected hyperparameters to bfloat16, where the default
    # b2 = 0.999 is 1.0: the range check's error says why, and the fix.
    params = jnp.ones(4, jnp.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"^b2 must be in \[0, 1\); received b2=1.0 \(a hyperparameter in bfloat16: "
        r"optax.inject_hyperparams casts them to the parameters' dtype; "
        r"give it hyperparam_dtype=jnp.float32\)$",
    ):
        optax.inject_hyperparams(qho.qhadam)(learning_rate=1e-3).init(params)
    fixed = optax.inject_hyperparams(qho.qhadam, hyperparam_dtype=jnp.float32)(learning_rate=1e-3)
    fixed.update(params, fixed.init(params), params)


def test_inject_hyperparams_with_state_dtype_outside_static_args_says_what_to_do() -> None:
    # jnp.bfloat16 is callable: optax calls it as a schedule of the step count.
    with pytest.raises(TypeError, match=r"give static_args=\('state_dtype',\)"):
        optax.inject_hyperparams(qho.qhadam)(learning_rate=1e-3, state_dtype=jnp.bfloat16).init(
            jnp.ones(4)
        )
