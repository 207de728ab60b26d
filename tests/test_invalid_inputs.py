"""The invalid-input table (conformance/invalid_inputs.py) against the core.

The same table runs against torch, optax and Keras in their test directories;
every backend must raise the same exception type with the same sentence.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conformance.invalid_inputs import (
    CONVERSIONS,
    GOOD,
    INVALID,
    NAMES,
    Invalid,
    backend_kwargs,
    pattern,
)
from qhoptim import convert, reference, validation

GOOD_QHM = GOOD["qhm"]
GOOD_QHADAM = GOOD["qhadam"]
QHM_ENTRIES = [e for e in INVALID if e.applies_to("qhm")]
QHADAM_ENTRIES = [e for e in INVALID if e.applies_to("qhadam")]
SCALAR_QHADAM = [e for e in QHADAM_ENTRIES if e.param not in ("betas", "nus")]


def _ids(entries: list[Invalid]) -> list[str]:
    return [e.id for e in entries]


def _reference_kwargs(entry: Invalid) -> dict[str, Any]:
    return backend_kwargs("reference", "qhadam", entry)


def test_the_table_covers_every_hyperparameter_and_both_error_kinds() -> None:
    params = {e.param for e in INVALID}
    assert params == set(NAMES["torch"])
    for param in params - {"betas", "nus"}:
        kinds = {e.error for e in INVALID if e.param == param}
        assert TypeError in kinds, param
        assert ValueError in kinds, param


@pytest.mark.parametrize("entry", QHM_ENTRIES, ids=_ids(QHM_ENTRIES))
def test_check_qhm_rejects(entry: Invalid) -> None:
    with pytest.raises(entry.error, match=pattern(entry, NAMES["core"][entry.param])):
        validation.check_qhm(**{**GOOD_QHM, entry.param: entry.value})


@pytest.mark.parametrize("entry", SCALAR_QHADAM, ids=_ids(SCALAR_QHADAM))
def test_check_qhadam_rejects(entry: Invalid) -> None:
    with pytest.raises(entry.error, match=pattern(entry, NAMES["core"][entry.param])):
        validation.check_qhadam(**{**GOOD_QHADAM, entry.param: entry.value})


@pytest.mark.parametrize("entry", QHM_ENTRIES, ids=_ids(QHM_ENTRIES))
def test_reference_qhm_rejects(entry: Invalid) -> None:
    with pytest.raises(entry.error, match=pattern(entry, NAMES["reference"][entry.param])):
        reference.QHM(**{**GOOD_QHM, entry.param: entry.value})


@pytest.mark.parametrize("cls", [reference.QHAdam, reference.QHAdamW])
@pytest.mark.parametrize("entry", QHADAM_ENTRIES, ids=_ids(QHADAM_ENTRIES))
def test_reference_qhadam_rejects(cls: type, entry: Invalid) -> None:
    with pytest.raises(entry.error, match=pattern(entry, NAMES["reference"][entry.param])):
        cls(**_reference_kwargs(entry))


ADAM_ENTRIES = [e for e in QHADAM_ENTRIES if e.param in ("lr", "beta1", "beta2", "eps", "betas")]


@pytest.mark.parametrize("entry", ADAM_ENTRIES, ids=_ids(ADAM_ENTRIES))
def test_adam_conversions_reject(entry: Invalid) -> None:
    kwargs = _reference_kwargs(entry)
    args = {"lr": kwargs["lr"], "betas": kwargs["betas"], "eps": kwargs["eps"]}
    for fn in (convert.from_adam, convert.from_nadam):
        with pytest.raises(entry.error, match=pattern(entry, NAMES["reference"][entry.param])):
            fn(**args)


MOMENTUM_ENTRIES = [e for e in QHM_ENTRIES if e.param in ("lr", "momentum")]


@pytest.mark.parametrize("entry", MOMENTUM_ENTRIES, ids=_ids(MOMENTUM_ENTRIES))
def test_momentum_conversions_reject(entry: Invalid) -> None:
    args = {"lr": 0.1, "momentum": 0.9, entry.param: entry.value}
    for fn in (convert.from_momentum, convert.from_nesterov):
        with pytest.raises(entry.error, match=pattern(entry, entry.param)):
            fn(**args)


@pytest.mark.parametrize("case", CONVERSIONS, ids=[c.function for c in CONVERSIONS])
def test_conversion_preconditions(case: Any) -> None:
    with pytest.raises(case.error, match=case.match):
        getattr(convert, case.function)(**case.kwargs)


# ------------------------------------------------------------- what still passes
@pytest.mark.parametrize(
    "value",
    [0, 0.0, 0.5, np.float32(0.5), np.float64(0.0), np.int64(0), np.array(0.25)],
    ids=repr,
)
def test_concrete_valid_values_pass(value: Any) -> None:
    validation.check_qhm(lr=value, momentum=value, nu=value, weight_decay=value)
    validation.check_qhadam(
        lr=value, beta1=value, beta2=value, nu1=value, nu2=value, eps=value, weight_decay=value
    )


class _ArrayLike:
    """An array whose value is not known yet (a tracer, a tensor on a device)."""

    shape = ()
    dtype = "float32"


@pytest.mark.parametrize(
    "value",
    [_ArrayLike(), np.full(3, 0.5), lambda step: 0.1],
    ids=["array-like", "array", "schedule"],  # not repr's addresses: one id in every process
)
def test_deferred_values_pass_unchecked(value: Any) -> None:
    # A schedule where the backend says it calls one (lr; Keras's QHM and QHAdam).
    wd = 0.0 if callable(value) else value
    validation.check_qhm(
        lr=value, momentum=value, nu=value, weight_decay=wd, callables=("momentum", "nu")
    )
    validation.check_qhadam(
        lr=value, beta1=value, beta2=value, nu1=value, nu2=value, eps=value, weight_decay=wd,
        callables=("beta1", "beta2", "nu1", "nu2", "eps"),
    )  # fmt: skip


def _schedule() -> float:
    return 0.5


@pytest.mark.parametrize(
    ("check", "name"),
    [
        (lambda v: validation.check_qhm(lr=0.1, momentum=0.9, nu=v), "nu"),
        (
            lambda v: validation.check_qhm(lr=0.1, momentum=0.9, nu=0.7, weight_decay=v),
            "weight_decay",
        ),
        (lambda v: validation.check_qhm(lr=0.1, momentum=v, nu=0.7, callables=("nu",)), "momentum"),
        (
            lambda v: validation.check_qhadam(
                lr=0.1, beta1=0.9, beta2=0.99, nu1=0.7, nu2=1.0, eps=v
            ),
            "eps",
        ),
        (lambda v: validation.check_one_number(v, "beta2"), "beta2"),
    ],
)
def test_a_schedule_is_refused_where_no_step_calls_one(check: Any, name: str) -> None:
    # It passed the checks and failed inside the first step (every backend).
    message = f"^{name} must be a real number; received {name}=<function _schedule at 0x"
    with pytest.raises(TypeError, match=message):
        check(_schedule)


@pytest.mark.parametrize(
    ("check", "value", "error", "message"),
    [
        (validation.check_beta, np.array([0.5, 1.5]), ValueError, r"must be in \[0, 1\)"),
        (validation.check_eps, np.array([[1e-8], [-1.0]]), ValueError, r"must be in \[0, inf\)"),
        (validation.check_nu, np.array([0.5, np.inf]), ValueError, "must be a finite real number"),
        (validation.check_lr, np.array([0.1, np.nan]), ValueError, r"must be in \[0, inf\)"),
        (validation.check_beta, np.array([True, False]), TypeError, "must be a real number"),
    ],
)
def test_an_array_of_several_elements_is_checked_element_by_element(
    check: Any, value: Any, error: type[Exception], message: str
) -> None:
    # It passes as it is (an optax hyperparameter may broadcast against its
    # leaf), but an element out of range had stepped Keras's JAX backend.
    with pytest.raises(error, match=f"^x {message}; received x=array"):
        check(value, "x")
