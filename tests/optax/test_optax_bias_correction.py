"""qhoptim.optax's bias corrections: the float32 policy of ``rules.bias_correction``.

Without x64 (JAX's default) the count and the corrections are float32 and use
``-expm1(t * log(beta))``; with x64 they are ``1 - beta**t`` in float64, as the
float64 reference computes them (the expm1 form differs from it by up to
~1e-9 relative at ``beta = 0.9999999``, beyond the 1e-12 conformance bound).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qhoptim.optax as qho
from conformance.adapters.optax import x64
from qhoptim import rules
from qhoptim.optax._tree import bias_correction

F32_EPS = float(np.finfo(np.float32).eps)
# Powers of two: the step-by-step float32 first Adam step is exactly +-1 on them.
EXACT_GRADS = np.array([1.0, -1.0, 2.0, -0.5, 2.0**-20, -(2.0**20)], np.float32)


def _random_grads(n: int = 1000) -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6, n)).astype(np.float32)


def _first_update(tx: optax.GradientTransformation, grads: np.ndarray) -> np.ndarray:
    g = jnp.asarray(grads)
    updates, _ = jax.jit(tx.update)(g, tx.init(jnp.zeros_like(g)))
    assert updates.dtype == jnp.float32
    return np.asarray(updates)


@pytest.mark.parametrize("inject", [False, True], ids=["python-betas", "traced-betas"])
@pytest.mark.parametrize("b2", [0.999, 0.99999])
@pytest.mark.parametrize("b1", [0.99999, 0.9999999])
def test_first_adam_step_is_lr_times_sign_in_float32(b1: float, b2: float, inject: bool) -> None:
    # Adam-equivalent QHAdam (nus = 1, eps = 0, lr = 1): the first step is
    # -sign(grad). With 1 - beta**t in float32 it is ~16% short at b1 = 0.9999999.
    factory = optax.inject_hyperparams(qho.qhadam) if inject else qho.qhadam
    with x64(False):
        tx = factory(learning_rate=1.0, b1=b1, b2=b2, nu1=1.0, nu2=1.0, eps=0.0)
        exact = _first_update(tx, EXACT_GRADS)
        grads = _random_grads()
        approx = _first_update(tx, grads)
    # Within an ulp or two: XLA's fused float32 arithmetic does not round like
    # the step-by-step NumPy path, which is exact on powers of two
    # (tests/test_beta_near_one.py).
    np.testing.assert_allclose(exact, -np.sign(EXACT_GRADS), rtol=0, atol=2 * F32_EPS)
    np.testing.assert_allclose(approx, -np.sign(grads), rtol=0, atol=4 * F32_EPS)


def test_float32_state_and_bias_corrections_stay_float32() -> None:
    with x64(False):
        tx = qho.scale_by_qhadam(b1=0.9999999)
        x = jnp.ones(3, jnp.float32)
        _, state = tx.update(x, tx.init(x))
        bc = bias_correction(0.9999999, state.count)
    assert state.count.dtype == jnp.int32
    assert state.mu.dtype == state.nu.dtype == jnp.float32
    assert bc.dtype == jnp.float32
    assert abs(float(bc) / (1 - 0.9999999) - 1) <= F32_EPS


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 0.999, 0.99999, 0.9999999])
@pytest.mark.parametrize("step", [1, 2, 7, 1000, 2**20])
def test_float32_bias_correction_has_float32_relative_precision(beta: float, step: int) -> None:
    exact = 1.0 if beta == 0 else -math.expm1(step * math.log(beta))
    count = jnp.asarray(step, jnp.int32)
    with x64(False):
        python_beta = bias_correction(beta, count)
        traced_beta = jax.jit(bias_correction)(jnp.float32(beta), count)
    assert python_beta.dtype == traced_beta.dtype == jnp.float32
    assert abs(float(python_beta) / exact - 1) <= 2 * F32_EPS
    # A traced beta is itself float32: compare with its own exact correction.
    beta32 = float(np.float32(beta))
    exact32 = 1.0 if beta32 == 0 else -math.expm1(step * math.log(beta32))
    assert abs(float(traced_beta) / exact32 - 1) <= 4 * F32_EPS


@pytest.mark.parametrize("beta", [0.9, 0.999, 0.99999, 0.9999999])
@pytest.mark.parametrize("step", [1, 2, 1000, 10**6])
def test_x64_bias_correction_is_the_references(beta: float, step: int) -> None:
    # The reference's 1 - beta**t in float64 (the conformance float64 rows), to
    # a float64 ulp of 1 (bit for bit on CPU); with an integer exponent XLA's
    # repeated squaring was 15-60 ulps off at step 1000.
    count = jnp.asarray(step, jnp.int32)
    expected = rules.bias_correction(beta, step)
    for bc in (
        bias_correction(beta, count),
        jax.jit(bias_correction)(jnp.float64(beta), count),
    ):
        assert bc.dtype == jnp.float64
        assert abs(float(bc) - expected) <= np.finfo(np.float64).eps
        if step == 1:
            assert float(bc) == expected == 1 - beta


@pytest.mark.parametrize("amsgrad", [False, True])
def test_first_update_near_beta_one_is_minus_the_sign_to_an_ulp(amsgrad: bool) -> None:
    # The Hardening II check: qhadam(1.0, b1=0.9999999, eps=0.0) in float32.
    g = jnp.array([1.0, -2.0], jnp.float32)
    with x64(False):
        tx = qho.qhadam(1.0, b1=0.9999999, eps=0.0, amsgrad=amsgrad)
        updates, _ = tx.update(g, tx.init(jnp.zeros(2, jnp.float32)))
    assert updates.dtype == jnp.float32
    # Within one float32 ulp of 1 (the naive 1 - b1**t is ~16% short): the bias
    # correction -expm1(log(b1)) and the moment's (1 - b1) round separately, and
    # no float32 arithmetic is exact for every g (docs/robustness.md).
    np.testing.assert_allclose(updates, -np.sign(np.asarray(g)), rtol=0, atol=F32_EPS)
