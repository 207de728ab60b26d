"""``qhoptim.optax.qhmuon``: ``optax.contrib.muon`` at ``nu = beta`` and
``nu = 1`` (to its rounding), the float64 reference elsewhere, AdamW for what
is not a matrix, its state (also stored narrow), and bad input."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qhoptim.optax as qho
from qhoptim import convert, reference

# A matrix each way, a square one, and a vector (AdamW's, as optax's Muon routes it).
SHAPES = {"tall": (6, 4), "wide": (4, 6), "square": (5, 5), "bias": (5,)}
MATRICES = ("tall", "wide", "square")


def _tree(seed: int, dtype: Any = jnp.float32) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in SHAPES.items()}


def _run(tx: optax.GradientTransformation, params: Any, steps: int, first: int = 0, state=None):
    """``steps`` jitted steps (eager JAX would dispatch each small op: minutes)."""
    state = tx.init(params) if state is None else state

    @jax.jit
    def step(grads: Any, state: Any, params: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for t in range(first, first + steps):
        params, state = step(_tree(100 + t, params["tall"].dtype), state, params)
    return params, state


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("consistent_rms", [None, 0.2])
def test_equals_optax_muon(nesterov: bool, consistent_rms: float | None) -> None:
    settings = {"weight_decay": 0.1, "consistent_rms": consistent_rms}
    muon = optax.contrib.muon(0.02, beta=0.9, nesterov=nesterov, **settings)
    # The documented one line: from_params sets AdamW's Nesterov as optax's
    # Muon ties it (without, nesterov=False stepped the bias 10% off).
    qh = qho.from_params(convert.from_muon(0.9, nesterov), learning_rate=0.02, **settings)
    want, _ = _run(muon, _tree(0), 50)
    got, _ = _run(qh, _tree(0), 50)
    # AdamW's arrays are optax's own step: bit for bit.
    np.testing.assert_array_equal(np.asarray(got["bias"]), np.asarray(want["bias"]))
    # The matrices: the same operations but for the bias corrections, which
    # follow qhoptim's float32 policy (rules.bias_correction): float32 rounding.
    for k in MATRICES:
        scale = float(jnp.max(jnp.abs(want[k])))
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), atol=2e-6 * scale)


@pytest.mark.parametrize(
    "settings",
    [
        {"beta": 0.9, "nu": 0.7},
        {"beta": 0.999, "nu": 1.3, "weight_decay": 0.05},
        {"beta": 0.5, "nu": 0.0, "consistent_rms": 0.2},
        {"beta": 0.9, "nu": -0.2},
    ],
)
def test_float64_follows_the_reference(settings: dict[str, Any]) -> None:
    settings = {"weight_decay": 0.0, "consistent_rms": None, **settings}
    tx = qho.qhmuon(0.02, **settings)
    start = _tree(0, jnp.float64)
    got, _ = _run(tx, start, 30)
    ref = reference.QHMuon(
        lr=0.02,
        momentum=settings["beta"],
        nu=settings["nu"],
        weight_decay=settings["weight_decay"],
        eps=1e-8,
        adjust_lr_fn=None if settings["consistent_rms"] is None else "match_rms_adamw",
        norm_guard="add",
        bias_corrected=True,
        fan_in_first=True,
    )
    for k in MATRICES:
        theta = np.asarray(start[k])
        state = ref.init(theta)
        for t in range(30):
            theta, state = ref.step(theta, np.asarray(_tree(100 + t, jnp.float64)[k]), state)
        np.testing.assert_allclose(np.asarray(got[k]), theta, rtol=1e-12, atol=1e-13)


def test_state_resumes_bit_for_bit_and_eager_steps_as_jitted() -> None:
    tx = qho.qhmuon(0.02, beta=0.9, nu=0.7)
    whole, _ = _run(tx, _tree(0), 10)
    half, state = _run(tx, _tree(0), 5)
    saved = jax.tree.map(np.asarray, state)  # a checkpoint's host copy
    resumed, _ = _run(tx, half, 5, first=5, state=jax.tree.map(jnp.asarray, saved))
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(resumed[k]), np.asarray(whole[k]))
    # Eager, one step: what jit compiled, to float32's rounding (XLA fuses).
    params = _tree(0)
    eager, _ = tx.update(_tree(100), tx.init(params), params)
    jitted, _ = _run(tx, params, 1)
    for k in SHAPES:
        want = np.asarray(optax.apply_updates(params, eager)[k])
        np.testing.assert_allclose(np.asarray(jitted[k]), want, atol=1e-6 * np.abs(want).max())


def test_scale_by_qhmuon_state_and_matrices_only() -> None:
    tx = qho.scale_by_qhmuon(beta=0.9, nu=0.7, mu_dtype=jnp.bfloat16)
    params = {"w": jnp.ones((3, 2))}
    state = tx.init(params)
    assert isinstance(state, qho.ScaleByQHMuonState)
    assert state.momentum_buffer["w"].dtype == jnp.bfloat16 and int(state.count) == 0
    _, state = tx.update({"w": jnp.ones((3, 2))}, state)
    assert int(state.count) == 1 and state.momentum_buffer["w"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"scale_by_qhmuon takes matrices only .* \(4,\)"):
        tx.init({"b": jnp.ones(4)})


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"beta": 1.0}, ValueError, r"beta must be in \[0, 1\); received beta=1.0"),
        ({"nu": float("inf")}, ValueError, "nu must be a finite real number; received nu=inf"),
        ({"ns_steps": 100}, ValueError, r"ns_steps must be in \[0, 100\); received ns_steps=100"),
        ({"ns_coeffs": (1.0, 2.0)}, ValueError, r"ns_coeffs must be three numbers \(a, b, c\)"),
        ({"eps": -1.0}, ValueError, r"eps must be in \[0, inf\); received eps=-1.0"),
        ({"weight_decay": -0.1}, ValueError, r"weight_decay must be in \[0, inf\)"),
        ({"adam_nesterov": 1}, TypeError, "adam_nesterov must be a bool"),
        # AdamW's settings of the other arrays, which optax.adamw does not check.
        ({"adam_learning_rate": -0.1}, ValueError, r"adam_learning_rate must be in \[0, inf\)"),
        ({"adam_b1": 1.5}, ValueError, r"adam_b1 must be in \[0, 1\); received adam_b1=1.5"),
        ({"adam_b2": 2.0}, ValueError, r"adam_b2 must be in \[0, 1\); received adam_b2=2.0"),
        ({"adam_eps_root": -1.0}, ValueError, r"adam_eps_root must be in \[0, inf\)"),
        ({"adam_weight_decay": -1.0}, ValueError, r"adam_weight_decay must be in \[0, inf\)"),
        ({"consistent_rms": -0.2}, ValueError, r"consistent_rms must be in \[0, inf\)"),
        ({"ns_dtype": jnp.int32}, ValueError, "ns_dtype must be None or a floating-point dtype"),
        ({"mu_dtype": jnp.int8}, ValueError, "mu_dtype must be None or a floating-point dtype"),
    ],
)
def test_bad_hyperparameters_are_named(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        qho.qhmuon(0.02, **kwargs)


@pytest.mark.parametrize("static", [(), ("ns_steps",)])
def test_inject_hyperparams_gives_the_same_steps(static: tuple[str, ...]) -> None:
    # inject_hyperparams makes every number an array, traced under jit: nu
    # (min(nu, 1) of the buffer's correction) and ns_steps (a loop's count)
    # among them, as optax.contrib.muon takes them.
    kwargs = {"learning_rate": 0.02, "beta": 0.9, "nu": 0.7, "ns_steps": 4}
    params = _tree(0)
    plain, _ = _run(qho.qhmuon(**kwargs), params, steps=3)
    injected_tx = optax.inject_hyperparams(qho.qhmuon, static_args=static)(**kwargs)
    injected, _ = _run(injected_tx, params, steps=3)
    for k in SHAPES:
        np.testing.assert_allclose(injected[k], plain[k], rtol=1e-6, atol=1e-7)


def test_from_params_builds_qhmuon_from_from_muon() -> None:
    a = qho.from_params(convert.from_muon(0.9), learning_rate=0.02)
    b = qho.qhmuon(0.02, beta=0.9, nu=0.9)
    got, _ = _run(a, _tree(0), 3)
    want, _ = _run(b, _tree(0), 3)
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


@pytest.mark.parametrize("b1, b2", [(0.9, 0.99), (0.95, 0.98)])
def test_optax_lion_is_sign_qhm(b1: float, b2: float) -> None:
    # convert.from_lion's claim, against optax.lion itself: QHM's buffer and
    # direction from the rules, the sign of the direction taken.
    from qhoptim import rules

    settings = convert.from_lion(1e-3, (b1, b2))
    lion = optax.lion(1e-3, b1=b1, b2=b2, weight_decay=0.0)
    params = _tree(0)
    state = lion.init(params)
    buffers = {k: np.zeros(s) for k, s in SHAPES.items()}
    for t in range(30):
        grads = _tree(100 + t)
        updates, state = lion.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        for k in SHAPES:
            buffers[k], direction = rules.qhm_update(
                np.asarray(grads[k], np.float64), buffers[k],
                momentum=settings.momentum, nu=settings.nu,
            )  # fmt: skip
            # Each step is -lr * sign(QHM's direction), coordinate for coordinate.
            want = np.float32(-settings.lr) * np.sign(direction).astype(np.float32)
            np.testing.assert_array_equal(np.asarray(updates[k]), want)


# ------------------------------------------------------------------ state_dtype
def test_a_bfloat16_buffer_resumes_bit_for_bit() -> None:
    tx = qho.qhmuon(0.02, beta=0.9, nu=0.7, state_dtype=jnp.bfloat16)
    whole, state = _run(tx, _tree(0), 10)
    muon_state = state.inner_states["qhmuon"].inner_state[0]
    assert isinstance(muon_state, qho.ScaleByQHMuonState) and int(muon_state.count) == 10
    for k in MATRICES:
        assert muon_state.momentum_buffer[k].dtype == jnp.bfloat16
    half, state = _run(tx, _tree(0), 5)
    saved = jax.tree.map(np.asarray, state)
    resumed, _ = _run(tx, half, 5, first=5, state=jax.tree.map(jnp.asarray, saved))
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(resumed[k]), np.asarray(whole[k]))


def test_stochastic_rounding_is_the_narrow_buffers_default() -> None:
    # The same 5 steps stored to nearest end elsewhere: the default rounds stochastically.
    def buffers(**kwargs: Any) -> list[np.ndarray]:
        tx = qho.scale_by_qhmuon(beta=0.9, nu=0.7, state_dtype=jnp.bfloat16, **kwargs)
        params = {k: v for k, v in _tree(0).items() if k in MATRICES}
        state = tx.init(params)
        for t in range(5):
            grads = {k: v for k, v in _tree(100 + t).items() if k in MATRICES}
            _, state = jax.jit(tx.update)(grads, state)
        return [np.asarray(state.momentum_buffer[k], np.float32) for k in MATRICES]

    default, stochastic = buffers(), buffers(stochastic_rounding=True)
    nearest = buffers(stochastic_rounding=False)
    for d, s in zip(default, stochastic, strict=True):
        np.testing.assert_array_equal(d, s)
    assert any(not np.array_equal(d, n) for d, n in zip(default, nearest, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"state_dtype": jnp.bfloat16, "mu_dtype": jnp.bfloat16}, "give one"),
        ({"state_dtype": "int8"}, "state_dtype must be None or one of bfloat16"),
    ],
)
def test_bad_state_settings_are_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        qho.scale_by_qhmuon(**kwargs)


def test_qhmuon_takes_a_state_dtype_for_the_matrices_and_mu_dtype_for_adamw() -> None:
    # Both were refused as setting one buffer ("give one"); in the alias they
    # set two: the matrices' buffers, and AdamW's first moments.
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    tx = qho.qhmuon(0.1, state_dtype=jnp.bfloat16, mu_dtype=jnp.float16)
    state = tx.init(params)
    _, state = tx.update(params, state, params)
    dtypes = {jnp.dtype(x.dtype).name for x in jax.tree.leaves(state)}
    assert {"bfloat16", "float16"} <= dtypes


@pytest.mark.parametrize("scale", [1e-8, 1e3])
def test_a_float16_orthogonalization_keeps_the_step_of_small_and_large_gradients(
    scale: float,
) -> None:
    # Cast to float16 before the norm, the step was zero (or NaN): the squared
    # norm overflowed float16, or the entries underflowed.
    g = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)) * scale, jnp.float32)

    def first_update(ns_dtype: Any) -> np.ndarray:
        tx = qho.qhmuon(1.0, ns_dtype=ns_dtype)
        updates, _ = tx.update(g, tx.init(g), g)
        return np.asarray(updates, np.float64)

    want, got = first_update(jnp.float32), first_update(jnp.float16)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * np.abs(want).max())


@pytest.mark.parametrize("ns_dtype", [None, jnp.float16, jnp.float32])
@pytest.mark.parametrize("scale", [1e-5, 1e3])
def test_float16_parameters_step_as_float32_ones(ns_dtype: Any, scale: float) -> None:
    # The first step's bias correction (1 / (1 - beta) = 20) overflowed a float16
    # direction at gradients of 1e3 (NaN), and with ns_dtype None a float16 norm
    # zeroed or NaN'd it: formed and normalized in float32 now.
    g = np.random.default_rng(0).standard_normal((64, 64)) * scale

    def first_update(dtype: Any, ns: Any) -> np.ndarray:
        x = jnp.asarray(g, dtype)
        tx = qho.qhmuon(1.0, ns_dtype=ns)
        updates, _ = tx.update(x, tx.init(x), x)
        return np.asarray(updates, np.float64)

    want, got = first_update(jnp.float32, jnp.float32), first_update(jnp.float16, ns_dtype)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * np.abs(want).max())
