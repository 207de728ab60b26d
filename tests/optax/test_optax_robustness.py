"""Non-finite gradients, eps = 0, long runs and low precision in qhoptim.optax."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qhoptim.optax as qho
from conformance.runner import max_relative_deviation
from qhoptim import reference

NAN, INF = math.nan, math.inf
X0 = np.array([1.0, -1.0, 0.5, 2.0, -0.5])
POISONED = np.array(
    [[0.5, NAN, INF, -INF, NAN], [0.25, 1.0, 1.0, 1.0, 1.0], [-0.5, 1.0, 1.0, 1.0, 1.0]]
)


def _run(tx, grads, x0=X0):
    x = jnp.asarray(x0)
    state = tx.init(x)
    for g in grads:
        updates, state = tx.update(jnp.asarray(g), state, x)
        x = optax.apply_updates(x, updates)
    return np.asarray(x), state


def _assert_same_nonfinite(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-12)


@pytest.mark.parametrize("steps", [1, 3])
def test_non_finite_gradients_propagate_as_in_optax_adam_and_sgd(steps: int) -> None:
    grads = POISONED[:steps]
    adam, adam_state = _run(optax.adam(0.1), grads)
    qh, qh_state = _run(qho.qhadam(0.1), grads)
    _assert_same_nonfinite(qh, adam)
    _assert_same_nonfinite(qh_state[0].mu, adam_state[0].mu)
    _assert_same_nonfinite(qh_state[0].nu, adam_state[0].nu)
    ref = reference.QHAdam(lr=0.1, nus=(0.7, 0.8))
    x, state = X0, ref.init(X0)
    with np.errstate(invalid="ignore"):
        for g in grads:
            x, state = ref.step(x, g, state)
    _assert_same_nonfinite(_run(qho.qhadam(0.1, nu1=0.7, nu2=0.8), grads)[0], x)
    sgd, _ = _run(optax.sgd(0.01, momentum=0.9), grads)
    _assert_same_nonfinite(_run(qho.qhm(0.1, momentum=0.9, nu=1.0), grads)[0], sgd)
    np.testing.assert_array_equal(
        np.isfinite(_run(qho.qhm(0.1, momentum=0.9, nu=0.7), grads)[0]), np.isfinite(sgd)
    )


@pytest.mark.parametrize(
    "make",
    [lambda: qho.qhm(0.1, 0.9, 0.7), lambda: qho.qhadam(0.1, nu1=0.7), lambda: qho.qhadamw(0.1)],
)
def test_apply_if_finite_skips_the_step_and_keeps_the_state(make) -> None:
    guarded = optax.apply_if_finite(make(), max_consecutive_errors=5)
    plain = make()
    x = jnp.asarray(X0)
    g_state, p_state = guarded.init(x), plain.init(x)
    for poison in (False, True, False):
        g = jnp.asarray(POISONED[0] if poison else POISONED[1])
        before = g_state.inner_state
        updates, g_state = guarded.update(g, g_state, x)
        if poison:
            np.testing.assert_array_equal(updates, np.zeros(5))
            jax.tree.map(np.testing.assert_array_equal, g_state.inner_state, before)
            continue
        want, p_state = plain.update(g, p_state, x)
        np.testing.assert_array_equal(updates, want)  # the clean steps are the plain optimizer's
    assert int(g_state.total_notfinite) == 1


def test_eps_zero_with_zero_gradients_is_nan_as_in_optax_adam() -> None:
    grads = np.array([[0.0, 1.0, -2.0], [0.0, 0.5, 1.0]])
    x0 = np.ones(3)
    adam, _ = _run(optax.adam(0.1, eps=0.0), grads, x0)
    for nus in [(1.0, 1.0), (0.7, 0.5), (0.0, 0.0)]:
        qh, _ = _run(qho.qhadam(0.1, nu1=nus[0], nu2=nus[1], eps=0.0), grads, x0)
        ref = reference.QHAdam(lr=0.1, nus=nus, eps=0.0)
        x, state = x0, ref.init(x0)
        with np.errstate(invalid="ignore"):
            for g in grads:
                x, state = ref.step(x, g, state)
        assert np.isnan(adam[0]) and np.isnan(qh[0])
        _assert_same_nonfinite(qh, x)
        tiny, _ = _run(qho.qhadam(0.1, nu1=nus[0], nu2=nus[1], eps=1e-300), grads, x0)
        assert tiny[0] == 1.0


@pytest.mark.parametrize("count", [10**6 - 1, 2**31 - 2, 2**31 - 1])
def test_bias_correction_at_a_large_count(count: int) -> None:
    # The count is an int32 that saturates (optax.safe_increment) instead of wrapping.
    b1, b2, nus = 0.999, 0.99999, (0.7, 0.9)
    rng = np.random.default_rng(count % 1000)
    m0, s0, x0 = rng.standard_normal(4), rng.uniform(0.1, 1, 4), rng.standard_normal(4)
    g = rng.standard_normal(4)
    tx = qho.qhadam(0.01, b1, b2, *nus)
    state = tx.init(jnp.asarray(x0))
    inner = state[0]._replace(
        count=jnp.asarray(count, jnp.int32), mu=jnp.asarray(m0), nu=jnp.asarray(s0)
    )
    updates, new_state = tx.update(jnp.asarray(g), (inner, state[1]), jnp.asarray(x0))
    taken = min(count + 1, 2**31 - 1)
    assert int(new_state[0].count) == taken
    ref = reference.QHAdam(lr=0.01, betas=(b1, b2), nus=nus)
    want, _ = ref.step(x0, g, reference.QHAdamState(taken - 1, m0, s0))
    np.testing.assert_allclose(x0 + np.asarray(updates), want, rtol=1e-12)


def test_a_long_jitted_run_follows_the_reference() -> None:
    steps = 5000
    grads = np.random.default_rng(1).standard_normal((steps, 3))
    x0 = np.array([1.0, -2.0, 0.5])
    tx = qho.qhadam(1e-3, 0.999, 0.9999, 0.7, 0.9)

    def body(carry, g):
        x, state = carry
        updates, state = tx.update(g, state, x)
        return (optax.apply_updates(x, updates), state), None

    (x, state), _ = jax.lax.scan(body, (jnp.asarray(x0), tx.init(jnp.asarray(x0))), grads)
    assert int(state[0].count) == steps
    ref = reference.QHAdam(lr=1e-3, betas=(0.999, 0.9999), nus=(0.7, 0.9))
    rx, rs = x0, ref.init(x0)
    for g in grads:
        rx, rs = ref.step(rx, g, rs)
    np.testing.assert_allclose(np.asarray(x), rx, rtol=1e-10)


LOW = [jnp.float16, jnp.bfloat16]
LOW_CONFIGS = [
    ("qhm", lambda: qho.qhm(0.5, 0.99, 0.7), reference.QHM(lr=0.5, momentum=0.99, nu=0.7)),
    (
        "qhadam",
        lambda: qho.qhadam(0.05, 0.995, 0.999, 0.7, 1.0),
        reference.QHAdam(lr=0.05, betas=(0.995, 0.999), nus=(0.7, 1.0)),
    ),
    (
        "qhadamw",
        lambda: qho.qhadamw(0.05, 0.9, 0.99, 0.7, 0.8, 1e-3, weight_decay=0.01),
        reference.QHAdamW(lr=0.05, betas=(0.9, 0.99), nus=(0.7, 0.8), eps=1e-3, weight_decay=0.01),
    ),
]


@pytest.mark.parametrize("dtype", LOW, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(("name", "make", "ref"), LOW_CONFIGS, ids=[c[0] for c in LOW_CONFIGS])
def test_low_precision_params_stay_close_to_the_float64_reference(name, make, ref, dtype) -> None:
    steps = 20
    rng = np.random.default_rng(0)
    x0 = rng.uniform(0.5, 2.0, 16) * rng.choice([-1, 1], 16)
    grads = rng.uniform(0.1, 1.0, (steps, 16)) * rng.choice([-1, 1], (steps, 16))
    tx = make()
    x = jnp.asarray(x0, dtype)
    state = tx.init(x)
    rx = np.asarray(x, np.float64)
    rs = ref.init(rx)
    got, want = [rx], [rx]
    for g in grads:
        g_low = jnp.asarray(g, dtype)
        updates, state = tx.update(g_low, state, x)
        x = optax.apply_updates(x, updates)
        assert x.dtype == dtype
        rx, rs = ref.step(rx, np.asarray(g_low, np.float64), rs)
        got.append(np.asarray(x, np.float64))
        want.append(rx)
    for leaf in jax.tree.leaves(state):
        assert leaf.dtype in (jnp.dtype(dtype), jnp.dtype(jnp.int32)), leaf.dtype
    deviation = max_relative_deviation(np.stack(got), np.stack(want))
    assert deviation <= steps * float(jnp.finfo(dtype).eps), deviation
