"""The shared hyperparameter checks: ranges, wording, pass-through of non-concrete values."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from qhoptim import validation as v
from qhoptim.reference import QHM, QHAdam, QHAdamW

BAD = [
    # (check, value, expected message)
    (
        lambda x: v.check_beta(x, "momentum"),
        1.2,
        "momentum must be in [0, 1); received momentum=1.2",
    ),
    (
        lambda x: v.check_beta(x, "momentum"),
        1.0,
        "momentum must be in [0, 1); received momentum=1.0",
    ),
    (
        lambda x: v.check_beta(x, "momentum"),
        -0.1,
        "momentum must be in [0, 1); received momentum=-0.1",
    ),
    (lambda x: v.check_lr(x), -1e-3, "lr must be in [0, inf); received lr=-0.001"),
    (lambda x: v.check_lr(x), math.inf, "lr must be in [0, inf); received lr=inf"),
    (lambda x: v.check_eps(x), -1e-8, "eps must be in [0, inf); received eps=-1e-08"),
    (
        lambda x: v.check_weight_decay(x),
        -1,
        "weight_decay must be in [0, inf); received weight_decay=-1",
    ),
    (lambda x: v.check_nu2(x, "nu2"), 1.5, "nu2 must be in [0, 1]; received nu2=1.5"),
    (lambda x: v.check_nu2(x, "nu2"), -0.5, "nu2 must be in [0, 1]; received nu2=-0.5"),
    (lambda x: v.check_nu(x, "nu"), math.nan, "nu must be a finite real number; received nu=nan"),
    (lambda x: v.check_nu(x, "nu"), -math.inf, "nu must be a finite real number; received nu=-inf"),
    (lambda x: v.check_beta(x, "beta1"), math.nan, "beta1 must be in [0, 1); received beta1=nan"),
    (lambda x: v.check_beta(x, "b1"), np.float32(1.5), "b1 must be in [0, 1); received b1=1.5"),
    # Python ints beyond float64: out of range as inf is, not an OverflowError.
    pytest.param(
        lambda x: v.check_lr(x),
        10**400,
        f"lr must be in [0, inf); received lr={10**400}",
        id="lr-int-beyond-float64",
    ),
    pytest.param(
        lambda x: v.check_nu(x, "nu"),
        -(10**400),
        f"nu must be a finite real number; received nu={-(10**400)}",
        id="nu-int-beyond-float64",
    ),
]


@pytest.mark.parametrize(("check", "value", "message"), BAD)
def test_bad_values_raise_with_name_range_and_value(check, value, message) -> None:
    with pytest.raises(ValueError) as info:
        check(value)
    assert str(info.value) == message


@pytest.mark.parametrize("nu", [-3.0, -0.2, 0.0, 0.7, 1.0, 1.3, 10])
def test_nu_accepts_any_finite_real(nu) -> None:
    assert v.check_nu(nu) == nu


@pytest.mark.parametrize("beta", [0, 0.0, 0.5, 0.999, np.float64(0.9), np.array(0.9)])
def test_good_betas_pass_through_unchanged(beta) -> None:
    assert v.check_beta(beta, "beta") is beta


class _Traced:
    """Stands in for a traced array or tensor: not a concrete number, but array-like."""

    shape = ()
    dtype = "float32"


@pytest.mark.parametrize("value", [_Traced(), lambda step: 0.1, np.full(3, 0.5)])
def test_non_concrete_values_are_passed_through(value) -> None:
    for check in (v.check_lr, v.check_eps, v.check_weight_decay):
        assert check(value) is value
    assert v.check_beta(value, "momentum") is value
    assert v.check_nu(value) is value


def test_bool_is_not_a_number() -> None:
    with pytest.raises(
        TypeError, match=r"^momentum must be a real number; received momentum=True$"
    ):
        v.check_beta(True, "momentum")
    with pytest.raises(TypeError, match="bool"):
        v.concrete_float(True)


def test_reference_optimizers_validate_with_their_argument_names() -> None:
    with pytest.raises(ValueError, match=r"^momentum must be in \[0, 1\); received momentum=1.2$"):
        QHM(lr=1.0, momentum=1.2, nu=0.7)
    with pytest.raises(ValueError, match=r"^nus\[1\] must be in \[0, 1\]; received nus\[1\]=2.0$"):
        QHAdam(nus=(1.0, 2.0))
    with pytest.raises(ValueError, match=r"^betas\[0\] must be in \[0, 1\)"):
        QHAdamW(betas=(1.0, 0.9))
    with pytest.raises(ValueError, match=r"^lr must be in \[0, inf\); received lr=-1.0$"):
        QHM(lr=1.0).step(np.ones(2), np.ones(2), QHM(lr=1.0).init(np.ones(2)), lr=-1.0)


@pytest.mark.parametrize("value", [True, False])
def test_check_bool_passes_bools(value) -> None:
    assert v.check_bool(value, "amsgrad") is value


@pytest.mark.parametrize(
    ("value", "shown"),
    [(1, "1"), (0, "0"), ("yes", "'yes'"), (None, "None"), (np.True_, "np.True_")],
)
def test_check_bool_refuses_everything_else(value, shown) -> None:
    with pytest.raises(TypeError) as info:
        v.check_bool(value, "amsgrad")
    assert str(info.value) == f"amsgrad must be a bool; received amsgrad={value!r}"


def test_one_number_is_a_scalar_or_an_array_of_one() -> None:
    for value in (0.5, np.float32(0.5), np.array(0.5), np.array([0.5]), np.ones((1, 1)), "x"):
        assert v.check_one_number(value, "momentum") is value
    for shape in [(4,), (2, 3)]:
        message = f"momentum must be one number; received an array of shape {shape}"
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            v.check_one_number(np.ones(shape), "momentum")


def test_an_empty_array_is_refused_by_the_range_checks_and_as_one_number() -> None:
    # It passed both, and failed inside the first step in every backend.
    for shape in [(0,), (2, 0)]:
        message = f"momentum must not be empty; received an array of shape {shape}"
        for check in (v.check_one_number, v.check_beta, v.check_finite, v.check_lr):
            with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
                check(np.ones(shape), "momentum")
