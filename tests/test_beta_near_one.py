"""QHAdam with a discount factor near 1, in float32.

In float32, ``1 - beta**t`` cancels catastrophically near ``beta = 1``:
``float32(0.9999999)`` is ``1 - 1.19e-7``, so Adam's first bias correction is
off by ~20% and its first step is not ``lr * sign(grad)``. The float32 policy of
:func:`qhoptim.rules.bias_correction` is ``-expm1(t * log(beta))``. These tests
pin the policy down on the framework-free paths; the conformance cases
``qhadam-*0.9999*`` and ``qhadamw-betas-near-one-*`` run it through every
backend.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance.adapters.numpy_rules import _NumpyOptimizer
from conformance.cases import Case, load_cases
from qhoptim import rules

F32_EPS = float(np.finfo(np.float32).eps)
BETAS_NEAR_ONE = (0.99999, 0.9999999)
# Powers of two and their negatives: the first Adam step is exactly +-1 for them.
EXACT_GRADS = np.array([1.0, -1.0, 2.0, -0.5, 2.0**-20, -(2.0**20)], np.float32)


def _random_grads(n: int = 2000) -> np.ndarray:
    rng = np.random.default_rng(0)
    grads = rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6, n)
    return grads.astype(np.float32)


def _f32_bias_correction(beta: float, step: int) -> np.float32:
    # The float32 policy as a float32 backend evaluates it (optax without x64):
    # the count is float32, log(beta) of a Python beta is taken in float64 and
    # then joins the float32 arithmetic as a weakly typed scalar does (NumPy 2's
    # rule; spelled out so that NumPy 1.x, which would promote to float64, agrees).
    bc = rules.bias_correction(
        beta, np.float32(step), expm1=np.expm1, log=lambda b: np.float32(math.log(b))
    )
    assert bc.dtype == np.float32
    return bc


def _adam_case(beta1: float, beta2: float) -> Case:
    # Adam-equivalent QHAdam: nus = (1, 1), eps = 0, lr = 1.
    return Case(
        name=f"adam-{beta1}-{beta2}",
        problem_name="quadratic",
        optimizer="qhadam",
        hparams={"lr": 1.0, "betas": [beta1, beta2], "nus": [1.0, 1.0], "eps": 0.0},
        schedule={"kind": "constant"},
        steps=1,
    )


def _numpy_first_step(beta1: float, beta2: float, grads: np.ndarray) -> np.ndarray:
    """The first update of the numpy adapter's float32 path (``-lr * update`` from 0)."""
    opt = _NumpyOptimizer(_adam_case(beta1, beta2), [np.zeros_like(grads)])
    (param,) = opt.step([np.zeros_like(grads)], [grads], 1.0)
    assert param.dtype == np.float32
    return -param


@pytest.mark.parametrize("beta", [*BETAS_NEAR_ONE, 0.9, 0.999])
@pytest.mark.parametrize("step", [1, 2, 10, 1000, 10**6])
def test_float32_policy_keeps_relative_precision(beta: float, step: int) -> None:
    exact = -math.expm1(step * math.log(beta))  # float64, to ~1e-16 relative
    assert abs(float(_f32_bias_correction(beta, step)) / exact - 1) <= 2 * F32_EPS


@pytest.mark.parametrize("beta", BETAS_NEAR_ONE)
def test_naive_float32_bias_correction_is_far_off(beta: float) -> None:
    # What the policy exists for: 1 - beta**t evaluated in float32.
    naive = np.float32(1) - np.float32(beta) ** np.float32(1)
    assert abs(float(naive) / (1 - beta) - 1) > 1e-4


@pytest.mark.parametrize("beta2", [0.999, 0.99999, 0.9999999])
@pytest.mark.parametrize("beta1", BETAS_NEAR_ONE)
def test_first_adam_step_is_sign_of_gradient_in_numpy_float32(beta1: float, beta2: float) -> None:
    # The numpy adapter -- the framework-free float32 path the conformance
    # float32 rows shadow -- takes its bias corrections in float64 (Python floats).
    np.testing.assert_array_equal(
        _numpy_first_step(beta1, beta2, EXACT_GRADS), np.sign(EXACT_GRADS)
    )
    grads = _random_grads()
    np.testing.assert_allclose(
        _numpy_first_step(beta1, beta2, grads), np.sign(grads), rtol=0, atol=2 * F32_EPS
    )


@pytest.mark.parametrize("beta2", [0.999, 0.99999, 0.9999999])
@pytest.mark.parametrize("beta1", BETAS_NEAR_ONE)
def test_first_adam_step_is_sign_of_gradient_with_float32_bias_corrections(
    beta1: float, beta2: float
) -> None:
    # Everything in float32, bias corrections included, as optax computes it
    # without x64: still exactly +-1 on powers of two, within 2 ulp elsewhere.
    def first_step(grads: np.ndarray) -> np.ndarray:
        zeros = np.zeros_like(grads)
        _, _, update = rules.qhadam_update(
            grads,
            zeros,
            zeros,
            beta1=beta1,
            beta2=beta2,
            nu1=1.0,
            nu2=1.0,
            eps=0.0,
            bias_correction1=_f32_bias_correction(beta1, 1),
            bias_correction2=_f32_bias_correction(beta2, 1),
            sqrt=np.sqrt,
        )
        assert update.dtype == np.float32
        return update

    np.testing.assert_array_equal(first_step(EXACT_GRADS), np.sign(EXACT_GRADS))
    grads = _random_grads()
    np.testing.assert_allclose(first_step(grads), np.sign(grads), rtol=0, atol=2 * F32_EPS)


def test_first_adam_step_with_naive_float32_bias_correction_is_not_the_sign() -> None:
    zeros = np.zeros_like(EXACT_GRADS)
    beta1 = np.float32(0.9999999)
    _, _, update = rules.qhadam_update(
        EXACT_GRADS,
        zeros,
        zeros,
        beta1=0.9999999,
        beta2=0.999,
        nu1=1.0,
        nu2=1.0,
        eps=0.0,
        bias_correction1=np.float32(1) - beta1,
        bias_correction2=np.float32(1) - np.float32(0.999),
        sqrt=np.sqrt,
    )
    assert np.all(np.abs(np.abs(update) - 1) > 0.1)  # ~16% short of lr


NEAR_ONE_CASES = [c for c in load_cases() if max(c.hparams.get("betas", (0.0, 0.0))) >= 0.99999]


def test_cases_near_one_cover_both_moments() -> None:
    # Every backend runs them (tests/test_conformance.py for numpy, each
    # backend's conformance test and nox session for the others).
    betas = [c.hparams["betas"] for c in NEAR_ONE_CASES]
    assert {0.99999, 0.9999999} <= {b1 for b1, _ in betas}
    assert any(b2 >= 0.99999 for _, b2 in betas)
    assert any(c.hparams["nus"] == [1.0, 1.0] for c in NEAR_ONE_CASES)  # Adam
    assert any(c.optimizer == "qhadamw" for c in NEAR_ONE_CASES)
